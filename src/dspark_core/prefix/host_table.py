"""HostPrefixTable: the rows of an external-row PrefixStore in host memory, beside the HostRings.

The host twin of :class:`dspark_core.cuda.PrefixTable` (the same calls, checks,
locks and errors: both are :class:`~dspark_core.prefix.table_owner.PrefixTableOwner`),
with the store's table in a numpy array (``store.table_rows`` rows of
``row_bytes`` uint8, in the store's storage), shared by every
:class:`~dspark_core.HostRing` whose Stager uses the store. So external-row
mode keeps its prefix hits without a GPU: a CPU server, a test of a server's
loop, the examples::

    cfg = StagerConfig(D, B, W, max_seqs=8, storage="q8_0", rows="external")
    st, store = Stager(cfg), PrefixStore(cfg, block_tokens=16, budget_bytes=1 << 30)
    ring = HostRing(st)
    table = HostPrefixTable(store, ring)              # (store.table_rows, row_bytes) uint8
    table.publish(ring, seq, keys, start, end)        # store.publish + the copies ring -> table
    hit = table.hit(ring, seq, keys, n_tokens)        # store.hit + the copies table -> ring
    data = table.export_block(key)                    # bytes for another process
    table.import_block(data)                          # and back

The moves of a publish / hit are the ring's table changes, applied in serial
order with its forks and shifts (``HostRing.apply(moves, prefix_table=table)``);
:meth:`publish` and :meth:`hit` hold the ring's lock, then the table's,
across the store's call and its copies. Every call is synchronous.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._ext._stager import copy_slot_rows
from .table_owner import PrefixTableOwner

__all__ = ["HostPrefixTable"]


class HostPrefixTable(PrefixTableOwner):
    """The host (numpy) table of an external-row PrefixStore (see the module docstring).

    Args:
        store: a :class:`~dspark_core.PrefixStore` (or the reference twin) in
            external-row mode.
        ring: a :class:`~dspark_core.HostRing` of a Stager using the store, in
            the store's storage.

    Attributes:
        table: ``(store.table_rows, row_bytes)`` uint8 numpy array.
    """

    def __init__(self, store: Any, ring: Any) -> None:
        super().__init__(store, ring)
        self.table = np.zeros((self.rows, self.row_bytes), np.uint8)

    def __repr__(self) -> str:
        return f"HostPrefixTable(storage={self.storage!r}, rows={self.rows} x {self.row_bytes} B)"

    def _copy_rows(self, moves: np.ndarray, to_store: bool, ring: Any) -> None:
        # One core call for a batch's moves (publish_many / hit_many: a few rows each, many of them).
        src, dst = (ring.table, self.table) if to_store else (self.table, ring.table)
        copy_slot_rows(src, dst, moves)

    def _read_rows(self, slots: np.ndarray) -> np.ndarray:
        return self.table[slots]

    def _write_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        self.table[slots] = rows
