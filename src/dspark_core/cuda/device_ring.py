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

Ordering: everything is enqueued on the ring's stream (``stream=`` at
construction; default: the table library's current stream, or the legacy
default stream). The caller orders its producers and consumers with it.

Threads. The Stager numbers every change of the table it asks for (the
moves of ``fork`` / ``shift``, the slots of an external ``restore``, the
moves of a prefix store's ``publish`` / ``hit``) under the lock of the
operation, so their ``serial`` order is the order they happened in. The ring
applies them in exactly that order: :meth:`fork`, :meth:`shift` and
:meth:`restore` (and ``PrefixTable.publish`` / ``hit``) hold the ring's lock
across the Stager's call and the copies, so several threads may call them
at once; :meth:`apply` (moves a caller got from the Stager itself) refuses
anything but the next serial, and anything but the array the Stager
returned (a view, slice or copy of it has no serial).

Lock order (docs/prefix_cache.md, "Sharing and threads"): a ring's lock,
then a ``PrefixTable``'s, then (inside the core) the Stager's mutex, then the
store's. Nothing takes a ring's lock while holding a table's, and the core's
mutexes are innermost (no core call calls back into Python), so no two
threads wait on each other.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

import numpy as np

from .. import formats
from .._args import as_positions
from ..prefix_hit import PUBLISH, PrefixMoves
from ..slot_moves import RestoredSlots, SlotMoves
from ..stage_plan import BatchPlan, StagePlan
from . import _backend, interop
from .convert import _stage_dtype

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


class DeviceRing:
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

    def __init__(self, stager: Any, storage: str | None = None, *, device: int | None = None, stream: Any = None,
                 backend: str | None = None) -> None:
        cfg = stager.config
        if not cfg.external_rows:
            raise ValueError(
                "DeviceRing needs a Stager in external-row mode (StagerConfig(rows='external')); "
                f"this one holds its rows (rows={cfg.rows!r})"
            )
        cu = _backend._require()
        self.stager = stager
        self.storage = cfg.storage if storage is None else storage
        self.feature_dim = int(cfg.feature_dim)
        self.row_bytes = formats.row_bytes(self.storage, self.feature_dim)  # ConfigError for q + D % 32
        self.ring_rows = int(stager.ring_rows)
        self.rows = int(cfg.max_seqs) * self.ring_rows
        self.stage_dtype = _stage_dtype(cfg.stage_dtype)
        # The kernels hold the rows to encode_bounds(storage, stage_dtype), as a held
        # Stager's process() does: rows staged in a narrower type than the storage
        # decodes to (f32 rows staged as float16) must stay below that type's limit.
        self._staged = _backend._ELEM[self.stage_dtype]
        self._limit = formats.encode_bounds(self.storage, self.stage_dtype).limit
        self._error = cfg.nonfinite == "error"
        self._policy = _backend._POLICY[cfg.nonfinite]
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
        self._moves_applied = int(stager.moves_issued)
        # Held across a Stager call that changes the table and the ring's copies
        # for it, so that table changes apply in serial order from any thread.
        self._lock = threading.RLock()
        self._cu = cu

    def __repr__(self) -> str:
        return (f"DeviceRing(storage={self.storage!r}, rows={self.rows} x {self.row_bytes} B, "
                f"device={self.device}, backend={self.lib!r})")

    @property
    def nbytes(self) -> int:
        """Device memory of the table."""
        return self.rows * self.row_bytes

    @property
    def bytes_per_sequence(self) -> int:
        """Device memory one sequence's slots take (``ring_rows * row_bytes``)."""
        return self.ring_rows * self.row_bytes

    # -- write ------------------------------------------------------------
    def write(self, seq: int, positions: Any, rows: Any, *, in_dtype: Any = None) -> np.ndarray:
        """``stager.process(seq, positions)`` and encode the device ``rows`` into the returned slots.

        ``rows``: (n, feature_dim) float32 / float16 / bfloat16 device array
        (``in_dtype="bfloat16"`` reads uint16 as bfloat16 bits). Returns the
        slots (int64; -1 for rows below the horizon, which are not written).
        A rejected call (state, positions, dtype / shape, a NaN / Inf under
        ``nonfinite="error"``) raises before the Stager or the table changes.
        """
        pos = as_positions(positions)
        # The Stager's own checks (sequence, round state, positions), in its
        # order and with its messages, before the rows are looked at.
        self.stager.check_process(seq, pos)
        a, elem = self._rows(rows, in_dtype)
        n = a.shape[0]
        if len(pos) != n:
            raise ValueError(f"DeviceRing.write: {len(pos)} positions for {n} rows")
        cu, s = self._cu, self.stream
        interop._order_after_producer(a, s, self.device)
        in_row = self.feature_dim * a.dtype.itemsize
        staged = False
        if self._error and n:
            # Validate first: encode into the staging buffer with the report.
            staging = self._staging_rows(min(n, STAGING_ROWS))
            for r0 in range(0, n, STAGING_ROWS):
                m = min(STAGING_ROWS, n - r0)
                bad = cu.encode(a.ptr + r0 * in_row, elem, staging, _backend._STORAGE[self.storage], m,
                                self.feature_dim, self._policy, True, s, self._staged)
                if bad >= 0:
                    r = r0 + int(bad) // self.feature_dim
                    raise ValueError(
                        f"sequence {seq}: row {r} (position {int(pos[r])}) holds a non-finite value, or one that "
                        f"overflows {self.storage} storage staged as {self.stage_dtype} (|x| must stay below "
                        f"{self._limit:.9g}); nothing was appended (nonfinite='error')"
                    )
            staged = n <= STAGING_ROWS
        slots = self.stager.process(seq, pos)
        for slot, r0, m in slot_runs(slots):
            dst = self._table_ptr + slot * self.row_bytes
            if staged:
                cu.copy_device(dst, self._staging_ptr + r0 * self.row_bytes, m * self.row_bytes, s)
            else:
                cu.encode(a.ptr + r0 * in_row, elem, dst, _backend._STORAGE[self.storage], m, self.feature_dim,
                          self._policy, False, s, self._staged)
        interop._mark_written(self.table, s, self._stream_obj)
        return slots

    def _rows(self, rows: Any, in_dtype: Any) -> tuple[interop._DevArray, int]:
        a = interop._dev_array(rows, "DeviceRing.write: rows", stream=self.stream)
        dt = a.dtype
        if in_dtype is not None:
            want = _stage_dtype(in_dtype) if isinstance(in_dtype, str) else np.dtype(in_dtype)
            if want == _backend._BF16 and dt == _backend._U16:
                dt = _backend._BF16
            elif want != dt:
                raise TypeError(f"DeviceRing.write: in_dtype {want} does not match the array's dtype {dt}")
        if dt not in _backend._ELEM:
            raise TypeError(f"DeviceRing.write: rows dtype {dt} is not supported; expected float32, float16 or bfloat16")
        if len(a.shape) != 2 or a.shape[1] != self.feature_dim:
            raise ValueError(f"DeviceRing.write: rows must be (n, {self.feature_dim}), got shape {a.shape}")
        if a.size and interop._device_of(a) != self.device:
            raise ValueError(f"DeviceRing.write: rows are on device {a.device}, the ring on device {self.device}")
        a.dtype = dt
        return a, _backend._ELEM[dt]

    def _staging_rows(self, n: int) -> int:
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = interop._alloc(self.lib, (n, self.row_bytes), _backend._U8, self.device, self.stream)
            self._staging_ptr = interop._dev_array(self._staging, "staging", stream=self.stream).ptr
        return self._staging_ptr

    # -- gather -----------------------------------------------------------
    def gather(self, plan: StagePlan | BatchPlan, dtype: Any = None, out: Any = None) -> Any:
        """Decode the plan's staged slots into one contiguous ``(n_rows, feature_dim)`` device array.

        ``plan``: a :class:`StagePlan` or a :class:`BatchPlan` (draft_many) of
        this ring's Stager, while its round is open (a plan of a round that
        has closed raises ``ValueError``: later writes may have reused its
        slots, even if a newer round of the sequence is open). ``dtype``: float32 /
        float16 / bfloat16 (default: the Stager's ``stage_dtype``). At most two
        launches per sequence (the ring wraps at most once). Equal, byte for
        byte, to ``plan.rows`` of a held Stager with the same storage.
        """
        plans = plan.plans if isinstance(plan, BatchPlan) else [plan]
        if not all(isinstance(p, StagePlan) for p in plans):
            raise TypeError(f"DeviceRing.gather: expected a StagePlan or a BatchPlan, got {type(plan).__name__}")
        active = [p for p in plans if p.skip is None]
        for p in active:
            self._check_plan(p)
        odt = self.stage_dtype if dtype is None else _stage_dtype(dtype) if isinstance(dtype, str) \
            else np.dtype(dtype)
        if odt not in _backend._ELEM:
            raise TypeError(f"DeviceRing.gather: dtype {odt} is not supported; expected float32, float16 or bfloat16")
        n = sum(len(p.slots) for p in active)
        shape = (n, self.feature_dim)
        if out is None:
            out = interop._alloc(self.lib, shape, odt, self.device, self.stream)
        o = interop._check_out(out, "DeviceRing.gather: out", shape, odt, self.stream)
        t = interop._DevArray(self.table, self._table_ptr, (self.rows, self.row_bytes), _backend._U8, self.device,
                           None, None, False)
        interop._check_disjoint(t, o, "DeviceRing.gather")
        interop._order_after_producer(o, self.stream, self.device)
        out_row = self.feature_dim * odt.itemsize
        at = 0
        for p in active:
            for slot, r0, m in slot_runs(p.slots):
                self._cu.decode(self._table_ptr + slot * self.row_bytes, _backend._STORAGE[self.storage],
                                o.ptr + (at + r0) * out_row, _backend._ELEM[odt], m, self.feature_dim, self.stream)
            at += len(p.slots)
        interop._mark_written(out, self.stream, self._stream_obj)
        return out

    def _check_plan(self, p: StagePlan) -> None:
        if p.source is not self.stager:
            raise ValueError(
                f"DeviceRing.gather: the plan of sequence {p.seq} comes from another Stager; its slots do not "
                "index this ring's table"
            )
        open_round = self.stager.open_round_id(p.seq)
        if open_round == 0 or p.round != open_round:
            now = "has no open round" if open_round == 0 else f"has another round open now (round {open_round})"
            raise ValueError(
                f"DeviceRing.gather: the plan of sequence {p.seq} is of round {p.round}, and the sequence {now}: "
                "gather a plan between its draft() and its commit() / fail() (later writes may reuse its slots)"
            )

    # -- moves ------------------------------------------------------------
    def _next_change(self, change: SlotMoves | RestoredSlots, what: str) -> None:
        """Refuse a table change that is not the Stager's next one, as it issued it
        (a view, slice, copy or edit of it carries no serial, or other bytes)."""
        if change.source is not self.stager and change.serial:
            raise ValueError(f"DeviceRing.{what}: these come from another Stager")
        if not change.applicable():
            raise ValueError(
                f"DeviceRing.{what}: not the array the Stager returned (a view, slice, reversal, copy or edit "
                "of it carries no serial): pass fork() / shift() / restore()'s result itself"
            )
        want = self._moves_applied + 1
        if change.serial != want:
            raise ValueError(
                f"DeviceRing.{what}: table changes applied out of order: expected change #{want} of this Stager, "
                f"got #{change.serial} (each non-empty fork / shift / restore result must be applied once, in "
                "serial order)"
            )

    def _require_applied(self, what: str) -> None:
        """Before the ring asks the Stager for a table change: every earlier one is
        applied (else the new one could not be, and the Stager would have moved on)."""
        issued = int(self.stager.moves_issued)
        if issued != self._moves_applied:
            raise ValueError(
                f"DeviceRing.{what}: the Stager issued table changes up to #{issued}, the ring applied up to "
                f"#{self._moves_applied}: apply the missing fork() / shift() moves first (nothing changed)"
            )

    def apply(self, moves: SlotMoves, *, prefix_table: Any = None) -> None:
        """Apply the moves ``fork`` / ``shift`` returned (device-to-device copies, in order).

        Every non-empty moves array of the Stager (and the slots of an
        external ``restore``, which :meth:`restore` fills) must be applied
        once, in serial order; moves of another Stager, out of order (twice,
        or after skipping one), or not the array the Stager returned (a view,
        slice, reversal, copy or edit of it) raise ``ValueError`` and copy
        nothing. The moves of a prefix store's publish / hit
        (:class:`~dspark_core.prefix_hit.PrefixMoves`, numbered among the same
        table changes) copy between this ring's table and the store's: pass
        its :class:`~dspark_core.cuda.PrefixTable` as ``prefix_table``
        (``PrefixTable.publish`` / ``hit`` do, under both tables' locks).
        """
        if not isinstance(moves, SlotMoves):
            raise TypeError(
                f"DeviceRing.apply: expected the moves fork() / shift() returned, got {type(moves).__name__}"
            )
        if len(moves) == 0:
            return
        with self._lock:
            self._next_change(moves, "apply")
            if isinstance(moves, PrefixMoves):
                self._apply_prefix(moves, prefix_table)
                return
            rb = self.row_bytes
            rows = moves.tolist()
            for src, dst, m in rows:
                if not (m > 0 and 0 <= src and src + m <= self.rows and 0 <= dst and dst + m <= self.rows):
                    raise ValueError(f"DeviceRing.apply: move [{src}, {dst}, {m}] is outside the table")
            for src, dst, m in rows:
                self._cu.copy_device(self._table_ptr + dst * rb, self._table_ptr + src * rb, m * rb, self.stream)
            self._moves_applied = moves.serial
            interop._mark_written(self.table, self.stream, self._stream_obj)

    def _apply_prefix(self, moves: PrefixMoves, table: Any) -> None:
        """The copies of a prefix publish (ring -> store table) or hit (store table -> ring).
        Lock order: this ring's, then the table's (held by the caller / taken here)."""
        if table is None or table.store is not moves.store:
            raise ValueError(
                "DeviceRing.apply: these moves copy between this ring and a PrefixStore's table: pass "
                "prefix_table=<the PrefixTable of that store>"
            )
        if table.storage != self.storage or table.device != self.device:
            raise ValueError("DeviceRing.apply: the PrefixTable keeps another storage or lives on another device")
        with table._lock:
            table.copy(moves, self._table_ptr, self.rows)  # checks every move first
            self._moves_applied = moves.serial
            written = table.table if moves.direction == PUBLISH else self.table
            interop._mark_written(written, self.stream, self._stream_obj)

    def fork(self, src: int, dst: int) -> SlotMoves:
        """``stager.fork(src, dst)`` and apply its moves (safe from several threads)."""
        with self._lock:
            self._require_applied("fork")
            moves = self.stager.fork(src, dst)
            self.apply(moves)
        return moves

    def shift(self, seq: int, n_keep: int, n_discard: int) -> SlotMoves:
        """``stager.shift(seq, n_keep, n_discard)`` and apply its moves (safe from several threads)."""
        with self._lock:
            self._require_applied("shift")
            moves = self.stager.shift(seq, n_keep, n_discard)
            self.apply(moves)
        return moves

    # -- snapshots --------------------------------------------------------
    def snapshot(self, seq: int) -> tuple[bytes, Any]:
        """``(stager.snapshot(seq), rows)``: the bookkeeping and a device copy of the
        sequence's stageable rows, ``(n, row_bytes)`` uint8 in the ring's storage (at most
        two device-to-device copies). Restore both with :meth:`restore`, on this ring or
        another one of the same configuration."""
        data = self.stager.snapshot(seq)
        slots = self.stager.live_slots(seq)
        rows = interop._alloc(self.lib, (len(slots), self.row_bytes), _backend._U8, self.device, self.stream)
        r = interop._dev_array(rows, "snapshot rows", stream=self.stream)
        for slot, r0, m in slot_runs(slots):
            self._cu.copy_device(r.ptr + r0 * self.row_bytes, self._table_ptr + slot * self.row_bytes,
                                 m * self.row_bytes, self.stream)
        interop._mark_written(rows, self.stream, self._stream_obj)
        return data, rows

    def restore(self, seq: int, data: Any, rows: Any) -> np.ndarray:
        """``stager.restore(seq, data)`` and copy ``rows`` (from :meth:`snapshot`) into the
        slots it returns. Bad data, or rows of the wrong shape, raise before anything changes."""
        cfg = self.stager.config
        from .. import snapshot_format

        state = snapshot_format.unpack(data, cfg.snapshot_fingerprint(), external=True)
        n = state.end - state.horizon if state.started else 0
        r = interop._dev_array(rows, "DeviceRing.restore: rows", stream=self.stream)
        if r.dtype != _backend._U8 or r.shape != (n, self.row_bytes):
            raise ValueError(
                f"DeviceRing.restore: rows must be uint8 ({n}, {self.row_bytes}) (what snapshot() returned), "
                f"got {r.dtype} {r.shape}"
            )
        if n and interop._device_of(r) != self.device:
            raise ValueError(f"DeviceRing.restore: rows are on device {r.device}, the ring on device {self.device}")
        interop._order_after_producer(r, self.stream, self.device)
        with self._lock:  # the restore and its copies, in serial order among the table changes
            self._require_applied("restore")
            slots = self.stager.restore(seq, data)
            if len(slots):
                self._next_change(slots, "restore")
                for slot, r0, m in slot_runs(slots):
                    self._cu.copy_device(self._table_ptr + slot * self.row_bytes, r.ptr + r0 * self.row_bytes,
                                         m * self.row_bytes, self.stream)
                self._moves_applied = slots.serial
            interop._mark_written(self.table, self.stream, self._stream_obj)
        return slots

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
