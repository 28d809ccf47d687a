"""DeviceRing: the rows of an external-row Stager, on the GPU, in any storage.

A :class:`DeviceRing` owns the table an external-row Stager
(``StagerConfig(rows="external")``) plans against: one device array of
``max_seqs * ring_rows`` rows of ``row_bytes`` (uint8), in f32 / f16 / bf16 /
q8_0 / q4_0 (the quantized formats cut the feature memory 2-7x on the GPU).
The rows never visit host memory: the Stager sees positions and hands out
slots; the ring encodes the target's device rows into those slots and decodes
the staged slots for the drafter::

    st = Stager(StagerConfig(D, B, W, max_seqs=8, storage="q8_0", rows="external"))
    ring = DeviceRing(st)                        # the table: torch / cupy / DeviceArray
    ring.write(seq, positions, hidden)           # process + encode (<= 2 launches)
    plan = st.draft(seq, n_past)
    ctx = ring.gather(plan, "bfloat16")          # (plan.n_rows, D) on the device
    ...decode the drafter on ctx at plan.positions...
    st.commit(seq)
    ring.fork(parent, child)                     # Stager.fork + apply its moves

Bit-exact with the CPU path: the same kernels as :mod:`dspark_core.cuda`,
which are byte for byte the host conversions.

Non-finite rows. The Stager never sees external rows, so it cannot check
them: the ring does. Under the Stager's ``nonfinite="error"`` a write must be
rejected before anything changes, so :meth:`write` validates first: it
encodes the rows into a staging buffer with the kernels' first-non-finite
report (one launch per ``STAGING_ROWS`` rows, then one synchronisation),
raises ``ValueError`` naming the row if one holds a NaN / Inf, and only then
asks the Stager for slots and copies the staged bytes into them (at most two
device-to-device copies; a batch longer than the staging buffer is encoded
again, straight into its slots, at most two launches). Under ``"zero"`` or
``"clamp_f16"`` nothing can be rejected: the slots come first and the rows
are encoded straight into them (at most two launches, asynchronous).

Batches. ``write_slots`` / ``gather_slots`` (and ``write_many``,
``gather(batch_plan)``) move the rows of a whole batch of sequences in one
kernel launch over a flat int64 slot array (csrc/cuda/row_batch_cuda.hpp);
with ``status=`` they neither synchronize nor allocate, so a CUDA graph can
hold them (docs/external_rows.md, "Batches").

Ordering: everything is enqueued on the ring's stream (``stream=`` at
construction; default: the table library's current stream, or the legacy
default stream). The caller orders its producers and consumers with it.

Threads, and the identity and order checks of moves and plans: the shared
owner's (:mod:`dspark_core.rows.ring_owner`).

A prefix store's rows (docs/prefix_cache.md): a :class:`~dspark_core.cuda.PrefixTable`
keeps them on the same device; the moves of its ``publish`` / ``hit``
(:class:`~dspark_core.prefix.hit.PrefixMoves`, numbered among the Stager's
table changes) copy between the two tables, device to device. Lock order: a
ring's lock, then a ``PrefixTable``'s, then (inside the core) the sequences'
and the store's mutexes; nothing takes a ring's lock while holding a table's,
and no core call calls back into Python, so no two threads wait on each other.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import numpy as np

from ..rows.ring_owner import STATUS_NONE, RingOwner
from . import _backend, interop
from .prefix_table import PrefixTable

__all__ = ["DeviceRing", "STAGING_ROWS"]

#: Rows validated per launch under ``nonfinite="error"`` (the staging buffer's
#: height; a verify batch or a prefill chunk up to this size is encoded once).
STAGING_ROWS = 512


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """``(first_slot, first_index, count)`` of each run of consecutive slots >= 0."""
    s = np.asarray(slots, np.int64)
    live = np.flatnonzero(s >= 0)
    if len(live) == 0:
        return []
    idx = live
    breaks = np.flatnonzero((np.diff(s[idx]) != 1) | (np.diff(idx) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(idx)]))
    return [(int(s[idx[a]]), int(idx[a]), int(b - a)) for a, b in zip(starts, ends)]


class _Slots(NamedTuple):
    """A batch's slot array on the device: pointer, shape, and the host copy when there is one."""

    ptr: int
    shape: tuple[int, ...]
    host: np.ndarray | None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


class DeviceRing(RingOwner):
    """The device table of an external-row Stager (see the module docstring).

    Args:
        stager: a :class:`~dspark_core.Stager` (or the reference twin) with
            ``rows="external"``.
        storage: the table's row format (default: the Stager's ``storage``).
        device: CUDA device ordinal (default: the table library's current one).
        stream: stream for every operation (int handle, cupy / torch stream;
            default: the library's current stream, else the legacy default).
        backend: ``"torch"``, ``"cupy"`` or ``"dspark"``
            (:class:`~dspark_core.interop.DeviceArray`); default: cupy, else torch,
            else dspark.

    Attributes:
        table: the device array ``(max_seqs * ring_rows, row_bytes)`` uint8.
        row_bytes: bytes of one row in ``storage``.
    """

    _prefix_table_type = PrefixTable

    def __init__(self, stager: Any, storage: str | None = None, *, device: int | None = None, stream: Any = None,
                 backend: str | None = None) -> None:
        super().__init__(stager, storage)
        cu = _backend._require()
        # The kernels hold the rows to encode_bounds(storage, stage_dtype) (RingOwner).
        self._staged = _backend._ELEM[self.stage_dtype]
        self._policy = _backend._POLICY[stager.config.nonfinite]
        lib = backend or next((x for x in ("cupy", "torch") if interop._usable_backend(x)), "dspark")
        if lib not in ("cupy", "torch", "dspark"):
            raise ValueError(f"DeviceRing: backend must be 'cupy', 'torch' or 'dspark', got {backend!r}")
        self.lib = lib
        self.device = interop._current_device(lib) if device is None else int(device)
        self._stream_obj = stream
        self.stream = interop._stream_handle(stream, lib, self.device)
        self.table = interop._alloc(lib, (self.rows, self.row_bytes), _backend._U8, self.device, self.stream)
        self._table_ptr = interop._dev_array(self.table, "DeviceRing table", stream=self.stream).ptr
        self._staging: Any = None
        self._staging_ptr = 0
        self._index: Any = None  # uploaded slots of host batches (int64 as bytes)
        self._index_ptr = 0
        self._status: Any = None  # the status words of the checked batch calls
        self._cu = cu

    def __repr__(self) -> str:
        return (f"DeviceRing(storage={self.storage!r}, rows={self.rows} x {self.row_bytes} B, "
                f"device={self.device}, backend={self.lib!r})")

    # -- write ------------------------------------------------------------
    def _input_rows(self, rows: Any, in_dtype: Any, fn: str, lead: tuple[int, ...] | None) -> interop._DevArray:
        a = interop._dev_array(rows, f"{fn}: rows", stream=self.stream)
        a.dtype = self._input_dtype(a.dtype, in_dtype, fn)
        self._check_row_shape(a.shape, lead, fn)
        if a.size and interop._device_of(a) != self.device:
            raise ValueError(f"{fn}: rows are on device {a.device}, the ring on device {self.device}")
        return a

    def _prepare_write(self, seq: Any, pos: np.ndarray, a: interop._DevArray) -> bool:
        """Under nonfinite="error", validate first: encode into the staging buffer with the
        kernels' first-unencodable report (one launch per STAGING_ROWS rows, then one
        synchronization). Returns whether the staged bytes are the whole write."""
        n = a.shape[0]
        if not (self._error and n):
            return False
        cu, s = self._cu, self.stream
        interop._order_after_producer(a, s, self.device)
        elem = _backend._ELEM[a.dtype]
        in_row = self.feature_dim * a.dtype.itemsize
        staging = self._staging_rows(min(n, STAGING_ROWS))
        for r0 in range(0, n, STAGING_ROWS):
            m = min(STAGING_ROWS, n - r0)
            bad = cu.encode(a.ptr + r0 * in_row, elem, staging, _backend._STORAGE[self.storage], m,
                            self.feature_dim, self._policy, True, s, self._staged)
            if bad >= 0:
                raise self._unstageable(seq, r0 + int(bad) // self.feature_dim, pos)
        return n <= STAGING_ROWS

    def _store_write(self, a: interop._DevArray, slots: np.ndarray, staged: bool) -> None:
        cu, s = self._cu, self.stream
        interop._order_after_producer(a, s, self.device)
        elem = _backend._ELEM[a.dtype]
        in_row = self.feature_dim * a.dtype.itemsize
        for slot, r0, m in slot_runs(slots):
            dst = self._table_ptr + slot * self.row_bytes
            if staged:
                cu.copy_device(dst, self._staging_ptr + r0 * self.row_bytes, m * self.row_bytes, s)
            else:
                cu.encode(a.ptr + r0 * in_row, elem, dst, _backend._STORAGE[self.storage], m, self.feature_dim,
                          self._policy, False, s, self._staged)
        interop._mark_written(self.table, s, self._stream_obj)

    def _prepare_batch_write(self, seqs: np.ndarray, pos: np.ndarray, a: interop._DevArray) -> None:
        """Under nonfinite="error": one read-only check launch over all the rows, its report
        read back (one synchronization), before any Stager call."""
        if not (self._error and a.shape[0]):
            return
        interop._order_after_producer(a, self.stream, self.device)
        w = self._own_status()
        self._cu.batch_status_reset(w, self.stream)
        self._cu.check_rows(a.ptr, _backend._ELEM[a.dtype], a.shape[0], self.feature_dim, 0, self.rows,
                            _backend._STORAGE[self.storage], self._staged, w, self.stream)
        bad = int(self._status_words(self._status)[0])
        if bad != STATUS_NONE:
            raise self._unstageable(seqs, bad // self.feature_dim, pos)

    def _store_batch_write(self, a: interop._DevArray, slots: np.ndarray, prepared: None) -> None:
        """All the sequences' rows in one launch (their slots uploaded)."""
        if len(slots):
            self._scatter(_Slots(self._upload_slots(slots), (len(slots),), slots), a, None, "DeviceRing.write_many",
                          checked=True)

    def _staging_rows(self, n: int) -> int:
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = interop._alloc(self.lib, (n, self.row_bytes), _backend._U8, self.device, self.stream)
            self._staging_ptr = interop._dev_array(self._staging, "staging", stream=self.stream).ptr
        return self._staging_ptr

    # -- gather -----------------------------------------------------------
    def _gather_plans(self, slots: np.ndarray, n: int, odt: np.dtype, out: Any, batch: bool) -> Any:
        """One plan's slots: a launch per run (at most two, nothing uploaded). A
        batch's flat slots (a BatchPlan): uploaded, one launch for the whole batch."""
        shape = (n, self.feature_dim)
        if out is None:
            out = interop._alloc(self.lib, shape, odt, self.device, self.stream)
        o = interop._check_out(out, "DeviceRing.gather: out", shape, odt, self.stream)
        interop._check_disjoint(self._table_view(), o, "DeviceRing.gather")
        interop._order_after_producer(o, self.stream, self.device)
        if batch and n:
            self._cu.gather_rows(self._table_ptr, _backend._STORAGE[self.storage], self.rows, self.feature_dim,
                                 self._upload_slots(slots.astype(np.int64, copy=False)), n, o.ptr,
                                 _backend._ELEM[odt], 0, self.stream)
        else:
            out_row = self.feature_dim * odt.itemsize
            for slot, r0, m in slot_runs(slots):
                self._cu.decode(self._table_ptr + slot * self.row_bytes, _backend._STORAGE[self.storage],
                                o.ptr + r0 * out_row, _backend._ELEM[odt], m, self.feature_dim, self.stream)
        interop._mark_written(out, self.stream, self._stream_obj)
        return out

    def _table_view(self) -> interop._DevArray:
        return interop._DevArray(self.table, self._table_ptr, (self.rows, self.row_bytes), _backend._U8, self.device,
                                 None, None, False)

    # -- batches ------------------------------------------------------------
    def new_status(self) -> Any:
        """A status array for the asynchronous batch calls (``status=``): two uint64 words
        on the ring's device, as 16 uint8 (:meth:`read_status` reads them)."""
        return interop._alloc(self.lib, (16,), _backend._U8, self.device, self.stream)

    def _status_ptr(self, status: Any, fn: str) -> int:
        st = interop._dev_array(status, f"{fn}: status", stream=self.stream)
        if st.nbytes != 16 or st.dtype not in (_backend._U8, np.dtype(np.uint64), np.dtype(np.int64)):
            raise ValueError(f"{fn}: status must be two 8-byte words on the device (new_status()), got {st.dtype} "
                             f"{st.shape}")
        if interop._device_of(st) != self.device:
            raise ValueError(f"{fn}: status is on device {st.device}, the ring on device {self.device}")
        return st.ptr

    def _status_words(self, status: Any) -> np.ndarray:
        ptr = self._status_ptr(status, "DeviceRing.read_status")
        self.synchronize()
        return np.frombuffer(self._cu.copy_to_host(ptr, 16), np.uint64)

    def _own_status(self) -> int:
        if self._status is None:
            self._status = self.new_status()
        return self._status_ptr(self._status, "DeviceRing")

    def _upload_slots(self, slots: np.ndarray) -> int:
        """Host slots into the ring's index buffer (ordered on the ring's stream)."""
        nbytes = slots.size * 8
        if self._index is None or self._index.shape[0] < nbytes:
            self._index = interop._alloc(self.lib, (max(nbytes, 1024),), _backend._U8, self.device, self.stream)
            self._index_ptr = interop._dev_array(self._index, "index", stream=self.stream).ptr
        if nbytes:
            self._cu.copy_to_device(self._index_ptr, np.ascontiguousarray(slots, np.int64).view(np.uint8).reshape(-1),
                                    self.stream)
        return self._index_ptr

    def _batch_slots(self, slots: Any, fn: str, status: Any, distinct: bool) -> _Slots:
        if isinstance(slots, (np.ndarray, list, tuple)):
            h = np.asarray(slots)
            if h.dtype.kind not in "iu" or h.ndim not in (1, 2):
                raise TypeError(f"{fn}: slots must be a 1-D or 2-D integer array, got {h.dtype} {h.shape}")
            h = np.ascontiguousarray(h, np.int64)
            self._check_slot_values(h, fn, distinct, status)
            return _Slots(self._upload_slots(h), tuple(h.shape), h)
        d = interop._dev_array(slots, f"{fn}: slots", stream=self.stream)
        if d.dtype != np.dtype(np.int64) or len(d.shape) not in (1, 2):
            raise TypeError(f"{fn}: slots must be a 1-D or 2-D int64 array, got {d.dtype} {d.shape}")
        if d.size and interop._device_of(d) != self.device:
            raise ValueError(f"{fn}: slots are on device {d.device}, the ring on device {self.device}")
        interop._order_after_producer(d, self.stream, self.device)
        host = None
        if status is None:  # the checked form: read them back (a synchronization) and check them
            self.synchronize()
            raw = self._cu.copy_to_host(d.ptr, d.nbytes) if d.size else b""
            host = np.frombuffer(raw, np.int64).reshape(d.shape)
            self._check_slot_values(host, fn, distinct)
        return _Slots(d.ptr, tuple(d.shape), host)

    def _host_slots(self, s: _Slots) -> np.ndarray | None:
        return s.host

    def _scatter(self, s: _Slots, a: interop._DevArray, status: Any, fn: str, checked: bool = False) -> None:
        """The batch write; ``checked``: the rows were checked already (write_many)."""
        n = s.size
        if n == 0:
            return
        interop._check_disjoint(self._table_view(), a, fn)
        cu, st = self._cu, self.stream
        interop._order_after_producer(a, st, self.device)
        elem = _backend._ELEM[a.dtype]
        code = _backend._STORAGE[self.storage]
        words = self._status_ptr(status, fn) if status is not None else 0
        if status is None and self._error and not checked:
            # Checked: a read-only check launch, its report read back, then the write.
            w = self._own_status()
            cu.batch_status_reset(w, st)
            cu.check_rows(a.ptr, elem, n, self.feature_dim, s.ptr, self.rows, code, self._staged, w, st)
            bad = int(self._status_words(self._status)[0])
            if bad != STATUS_NONE:
                raise self._unstageable_batch(fn, bad)
        elif status is not None:
            cu.batch_status_reset(words, st)
            if self._error:  # asynchronous: the write is gated on the check's report
                cu.check_rows(a.ptr, elem, n, self.feature_dim, s.ptr, self.rows, code, self._staged, words, st)
        cu.scatter_rows(a.ptr, elem, n, self.feature_dim, s.ptr, self._table_ptr, code, self.rows, self._policy,
                        self._staged, words, status is not None and self._error, st)
        interop._mark_written(self.table, st, self._stream_obj)

    def _gather_slots(self, s: _Slots, out: Any, dtype: Any, status: Any, fn: str) -> Any:
        lead = s.shape
        n = s.size
        if dtype is not None:
            odt = self._out_dtype(dtype, fn)
        elif out is not None:
            dt = interop._dev_array(out, f"{fn}: out", stream=self.stream).dtype
            odt = self._out_dtype(_backend._BF16 if dt == _backend._U16 else dt, fn)
        else:
            odt = self.stage_dtype
        if out is None:
            out = interop._alloc(self.lib, lead + (self.feature_dim,), odt, self.device, self.stream)
        o = interop._dev_array(out, f"{fn}: out", stream=self.stream, writable=True)
        shape = (n, self.feature_dim) if o.shape == (n, self.feature_dim) else lead + (self.feature_dim,)
        o = interop._check_out(out, f"{fn}: out", shape, odt, self.stream)
        if n == 0:
            return out
        if interop._device_of(o) != self.device:
            raise ValueError(f"{fn}: out is on device {o.device}, the ring on device {self.device}")
        interop._check_disjoint(self._table_view(), o, fn)
        interop._order_after_producer(o, self.stream, self.device)
        words = 0
        if status is not None:
            words = self._status_ptr(status, fn)
            self._cu.batch_status_reset(words, self.stream)
        self._cu.gather_rows(self._table_ptr, _backend._STORAGE[self.storage], self.rows, self.feature_dim, s.ptr, n,
                             o.ptr, _backend._ELEM[odt], words, self.stream)
        interop._mark_written(out, self.stream, self._stream_obj)
        return out

    # -- moves and snapshots ------------------------------------------------
    def _copy_moves(self, moves: list[list[int]]) -> None:
        rb = self.row_bytes
        for src, dst, m in moves:
            self._cu.copy_device(self._table_ptr + dst * rb, self._table_ptr + src * rb, m * rb, self.stream)
        interop._mark_written(self.table, self.stream, self._stream_obj)

    def _copy_out(self, slots: np.ndarray) -> Any:
        rows = interop._alloc(self.lib, (len(slots), self.row_bytes), _backend._U8, self.device, self.stream)
        r = interop._dev_array(rows, "snapshot rows", stream=self.stream)
        for slot, r0, m in slot_runs(slots):
            self._cu.copy_device(r.ptr + r0 * self.row_bytes, self._table_ptr + slot * self.row_bytes,
                                 m * self.row_bytes, self.stream)
        interop._mark_written(rows, self.stream, self._stream_obj)
        return rows

    def _snapshot_rows(self, rows: Any, n: int) -> interop._DevArray:
        r = interop._dev_array(rows, "DeviceRing.restore: rows", stream=self.stream)
        if r.dtype != _backend._U8 or r.shape != (n, self.row_bytes):
            raise ValueError(
                f"DeviceRing.restore: rows must be uint8 ({n}, {self.row_bytes}) (what snapshot() returned), "
                f"got {r.dtype} {r.shape}"
            )
        if n and interop._device_of(r) != self.device:
            raise ValueError(f"DeviceRing.restore: rows are on device {r.device}, the ring on device {self.device}")
        interop._order_after_producer(r, self.stream, self.device)
        return r

    def _copy_in(self, slots: np.ndarray, r: interop._DevArray) -> None:
        for slot, r0, m in slot_runs(slots):
            self._cu.copy_device(self._table_ptr + slot * self.row_bytes, r.ptr + r0 * self.row_bytes,
                                 m * self.row_bytes, self.stream)
        interop._mark_written(self.table, self.stream, self._stream_obj)

    # -- host side (tests, simulations) -------------------------------------
    def upload(self, rows: np.ndarray) -> Any:
        """A host array as a device array of the ring's backend (for tests and simulations:
        a GPU server's target produces its rows on the device)."""
        a = np.ascontiguousarray(rows)
        if self.lib == "dspark":
            return interop.DeviceArray.from_numpy(a, self.device, self._stream_obj if self.stream else None)
        if self.lib == "cupy":
            cupy = __import__("cupy")  # optional: not a dependency
            with cupy.cuda.Device(self.device):
                return cupy.asarray(a.view(np.uint16) if a.dtype == _backend._BF16 else a)
        torch = __import__("torch")  # optional: not a dependency
        if a.dtype == _backend._BF16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(f"cuda:{self.device}")
        return torch.from_numpy(a.copy()).to(f"cuda:{self.device}")

    def to_numpy(self, arr: Any) -> np.ndarray:
        """A device array (of any backend) as a host numpy array, after the ring's work on it."""
        self.synchronize()
        if isinstance(arr, interop.DeviceArray):
            return arr.get()
        if hasattr(arr, "get"):  # cupy
            return arr.get()
        t = arr.detach()
        if str(t.dtype) == "torch.bfloat16":
            return t.view(__import__("torch").int16).cpu().numpy().view(_backend._BF16)
        return t.cpu().numpy()

    def synchronize(self) -> None:
        """Wait for everything enqueued on the ring's stream."""
        self._cu.synchronize(self.stream, self.device)

    def read(self, slots: Iterable[int]) -> np.ndarray:
        """The encoded bytes at ``slots`` as a host (n, row_bytes) uint8 array (tests, debugging)."""
        self.synchronize()
        out = [np.frombuffer(self._cu.copy_to_host(self._table_ptr + int(x) * self.row_bytes, self.row_bytes),
                             np.uint8) for x in slots]
        return np.stack(out) if out else np.zeros((0, self.row_bytes), np.uint8)
