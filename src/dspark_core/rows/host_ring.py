"""HostRing: the rows of an external-row Stager in host memory, on any machine.

The same owner as :class:`dspark_core.cuda.DeviceRing` (the same calls, checks
and bytes: both are :class:`~dspark_core.rows.ring_owner.RingOwner`), with the
table in a numpy array and the core's CPU conversions. So external-row mode
runs without a GPU: a CPU server, a test of a server's loop, the examples,
``dspark-core simulate --rows external``::

    st = Stager(StagerConfig(D, B, W, max_seqs=8, storage="q8_0", rows="external"))
    ring = HostRing(st)                          # table: (8 * st.ring_rows, row_bytes) uint8
    ring.write(seq, positions, hidden)           # process + encode into the slots
    plan = st.draft(seq, n_past)
    ctx = ring.gather(plan)                      # (plan.n_rows, D) in the stage dtype
    st.commit(seq)
    ring.fork(parent, child)                     # Stager.fork + apply its moves

Bit-exact with held mode: rows are encoded with the Stager's bounds
(``encode_bounds(storage, stage_dtype)``) and decoded by the same core
functions a held Stager uses. Every call is synchronous; the ``status=``
form of the batch calls reports into a numpy status array
(:meth:`new_status`) instead of raising, as the device's does.

A prefix store's rows (docs/prefix_cache.md): a :class:`~dspark_core.HostPrefixTable`
keeps them in host memory; the moves of its ``publish`` / ``hit`` copy between
the two tables (``apply(moves, prefix_table=table)``).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from .. import formats
from .._ext import _row_format
from ..prefix.host_table import HostPrefixTable
from .ring_owner import STATUS_NONE, RingOwner

__all__ = ["HostRing"]


class HostRing(RingOwner):
    """The host (numpy) table of an external-row Stager (see the module docstring).

    Args:
        stager: a :class:`~dspark_core.Stager` (or the reference twin) with ``rows="external"``.
        storage: the table's row format (default: the Stager's ``storage``).

    Attributes:
        table: ``(max_seqs * ring_rows, row_bytes)`` uint8 numpy array.
    """

    _prefix_table_type = HostPrefixTable

    def __init__(self, stager: Any, storage: str | None = None) -> None:
        super().__init__(stager, storage)
        self.table = np.zeros((self.rows, self.row_bytes), np.uint8)

    def __repr__(self) -> str:
        return f"HostRing(storage={self.storage!r}, rows={self.rows} x {self.row_bytes} B)"

    # -- write ------------------------------------------------------------
    def _input_rows(self, rows: Any, in_dtype: Any, fn: str, lead: tuple[int, ...] | None) -> np.ndarray:
        if not isinstance(rows, np.ndarray):
            raise TypeError(f"{fn}: rows must be a numpy array (host memory), got {type(rows).__name__}")
        dt = self._input_dtype(rows.dtype, in_dtype, fn)
        self._check_row_shape(rows.shape, lead, fn)
        a = rows.view(dt) if dt != rows.dtype else rows
        return np.ascontiguousarray(a).reshape(-1, self.feature_dim)

    def _encode(self, rows: np.ndarray) -> tuple[np.ndarray, int]:
        """``rows`` encoded with the Stager's policy and bounds, as (n, row_bytes) bytes, and
        the flat index of the first value that cannot be staged (-1: none; "error" only)."""
        enc, bad = _row_format.encode(rows, self.storage, self._nonfinite, None, self.stage_dtype)
        return enc.view(np.uint8).reshape(len(rows), self.row_bytes), int(bad) if self._error else -1

    def _prepare_write(self, seq: Any, pos: np.ndarray, a: np.ndarray) -> np.ndarray:
        enc, bad = self._encode(a)
        if bad >= 0:
            raise self._unstageable(seq, bad // self.feature_dim, pos)
        return enc

    def _store_write(self, a: np.ndarray, slots: np.ndarray, enc: np.ndarray) -> None:
        live = slots >= 0
        self.table[slots[live]] = enc[live]

    # -- gather -----------------------------------------------------------
    def _decode(self, slots: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Decode the rows at ``slots`` into ``out`` (n, feature_dim); rows whose slot is -1 (or
        outside the table: the status form reported it) become zeros."""
        live = (slots >= 0) & (slots < self.rows)
        if live.all():
            formats.dequantize_rows(self.table[slots], self.storage, self.feature_dim, out.dtype, out=out)
        else:
            out[live] = formats.dequantize_rows(self.table[slots[live]], self.storage, self.feature_dim, out.dtype)
            out[~live] = 0
        return out

    def _gather_plans(self, slots: np.ndarray, n: int, odt: np.dtype, out: Any, batch: bool) -> np.ndarray:
        shape = (n, self.feature_dim)
        o = self._out_array(out, shape, shape, odt, f"{self._name}.gather")
        return self._decode(slots.astype(np.int64, copy=False), o)

    def _out_array(self, out: Any, shape: tuple[int, ...], alt: tuple[int, ...], odt: np.dtype,
                   fn: str) -> np.ndarray:
        if out is None:
            return np.empty(shape, odt)
        if (not isinstance(out, np.ndarray) or out.dtype != odt or out.shape not in (shape, alt)
                or not out.flags.c_contiguous or not out.flags.writeable):
            got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
            raise ValueError(f"{fn}: out must be a writeable C-contiguous {odt} numpy array of shape {shape}; "
                             f"got {got}")
        return out

    # -- batches ------------------------------------------------------------
    def new_status(self) -> np.ndarray:
        """A status array for the ``status=`` form of the batch calls (two uint64 words)."""
        return np.full(2, STATUS_NONE, np.uint64)

    def _status_words(self, status: Any) -> np.ndarray:
        if not isinstance(status, np.ndarray) or status.dtype != np.uint64 or status.shape != (2,):
            raise ValueError(f"{self._name}: status must be the uint64 (2,) array new_status() returns")
        return status

    def _batch_slots(self, slots: Any, fn: str, status: Any, distinct: bool) -> np.ndarray:
        h = np.asarray(slots)
        if h.dtype.kind not in "iu" or h.ndim not in (1, 2):
            raise TypeError(f"{fn}: slots must be a 1-D or 2-D integer array, got {h.dtype} {h.shape}")
        h = np.ascontiguousarray(h, np.int64)
        if status is not None:  # checked first: a bad status array leaves the last report alone
            words = self._status_words(status)
        self._check_slot_values(h, fn, distinct, status)
        if status is not None:
            words[:] = STATUS_NONE
            outside = np.flatnonzero((h.reshape(-1) < -1) | (h.reshape(-1) >= self.rows))
            if len(outside):  # the row is skipped (not written, gathered as zeros), as the device kernels do
                words[1] = outside[0]
        return h

    def _host_slots(self, s: np.ndarray) -> np.ndarray:
        return s

    def _scatter(self, s: np.ndarray, a: np.ndarray, status: Any, fn: str) -> None:
        flat = s.reshape(-1)
        live = np.flatnonzero((flat >= 0) & (flat < self.rows))
        enc, bad = self._encode(a[live])
        if bad >= 0:  # the first value that cannot be staged, as its flat index in the batch
            index = int(live[bad // self.feature_dim]) * self.feature_dim + bad % self.feature_dim
            if status is None:
                raise self._unstageable_batch(fn, index)
            self._status_words(status)[0] = index
            return
        if status is not None and self._error and self._status_words(status)[1] != STATUS_NONE:
            return  # under nonfinite="error" a batch with a bad slot changes nothing
        self.table[flat[live]] = enc

    def _gather_slots(self, s: np.ndarray, out: Any, dtype: Any, status: Any, fn: str) -> np.ndarray:
        n, d = s.size, self.feature_dim
        odt = self._out_dtype(dtype if dtype is not None else out.dtype if isinstance(out, np.ndarray) else None, fn)
        o = self._out_array(out, tuple(s.shape) + (d,), (n, d), odt, fn)
        self._decode(s.reshape(-1), o.reshape(n, d))
        return o

    # -- moves and snapshots ------------------------------------------------
    def _copy_moves(self, moves: list[list[int]]) -> None:
        for src, dst, m in moves:
            self.table[dst : dst + m] = self.table[src : src + m]

    def _copy_out(self, slots: np.ndarray) -> np.ndarray:
        return self.table[np.asarray(slots, np.int64)]

    def _snapshot_rows(self, rows: Any, n: int) -> np.ndarray:
        if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.shape != (n, self.row_bytes):
            got = f"{rows.dtype} {rows.shape}" if isinstance(rows, np.ndarray) else type(rows).__name__
            raise ValueError(f"{self._name}.restore: rows must be uint8 ({n}, {self.row_bytes}) (what snapshot() "
                             f"returned), got {got}")
        return rows

    def _copy_in(self, slots: np.ndarray, rows: np.ndarray) -> None:
        self.table[np.asarray(slots, np.int64)] = rows

    # -- the owner interface's host side -------------------------------------
    def upload(self, rows: np.ndarray) -> np.ndarray:
        """The rows as this owner takes them (a host array: a contiguous copy)."""
        return np.ascontiguousarray(rows)

    def to_numpy(self, arr: Any) -> np.ndarray:
        """``arr`` as a numpy array (it already is one)."""
        return np.asarray(arr)

    def synchronize(self) -> None:
        """Nothing to wait for: every call is synchronous."""

    def read(self, slots: Iterable[int]) -> np.ndarray:
        """The encoded bytes at ``slots`` as a (n, row_bytes) uint8 array (a copy)."""
        return self.table[np.asarray(list(slots), np.int64).reshape(-1)]
