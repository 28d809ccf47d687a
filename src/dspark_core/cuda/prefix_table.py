"""PrefixTable: the rows of an external-row PrefixStore, on the GPU, next to the DeviceRings.

An external-row :class:`~dspark_core.PrefixStore` holds no row bytes: it
hands out slots of a table its owner allocates. A :class:`PrefixTable` is
that table on a CUDA device (``store.table_rows`` rows of ``row_bytes``, in
the rings' storage), shared by every :class:`~dspark_core.cuda.DeviceRing`
whose Stager uses the store. Publishing copies rows from a ring's table into
it and a hit copies them back, device to device (``DeviceRing.apply``): a hit
never moves a row through host memory::

    store = PrefixStore(cfg, block_tokens=16, budget_bytes=4 << 30)   # cfg.rows == "external"
    table = PrefixTable(store, ring)                  # on ring's device, backend and stream
    table.publish(ring, seq, keys, start, end)        # store.publish + the copies ring -> table
    hit = table.hit(ring, seq, keys, n_tokens)        # store.hit + the copies table -> ring
    data = table.export_block(key)                    # bytes for another process
    table.import_block(data)                          # and back

Ordering: everything is enqueued on the ring's stream, in call order.
Several rings sharing one table must use one stream (or order their streams).

Threads: :meth:`publish` and :meth:`hit` hold the ring's lock, then the
table's, across the store's call and its copies: the moves are numbered
among the ring's table changes (the ring applies them in serial order with
its forks and shifts), and the store's changes reach the stream in the order
the store made them (a hit's copies out of a page are enqueued before a
later publish reuses that page). :meth:`export_block` / :meth:`import_block`
hold the table's lock. The lock order is ring, table, then the core's
Stager and store mutexes; nothing takes a ring's lock while holding a
table's.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .. import formats
from ..prefix_hit import PrefixHit, PrefixMoves
from . import _backend, interop

__all__ = ["PrefixTable"]


class PrefixTable:
    """The device table of an external-row PrefixStore (see the module docstring).

    Args:
        store: a :class:`~dspark_core.PrefixStore` (or the reference twin) in
            external-row mode.
        ring: the :class:`~dspark_core.cuda.DeviceRing` whose device, backend,
            stream and storage the table takes (any ring of a Stager using the store).

    Attributes:
        table: the device array ``(store.table_rows, row_bytes)`` uint8.
    """

    def __init__(self, store: Any, ring: Any) -> None:
        if not store.config.external_rows:
            raise ValueError(
                "PrefixTable needs a PrefixStore in external-row mode (its config's rows='external'); "
                "this one holds its rows"
            )
        if ring.storage != store.config.storage:
            raise ValueError(
                f"PrefixTable: the ring keeps {ring.storage!r} rows but the store's rows are "
                f"{store.config.storage!r}: the copies between them need one format"
            )
        self.store = store
        self.storage = ring.storage
        self.row_bytes = formats.row_bytes(self.storage, int(store.config.feature_dim))
        self.rows = int(store.table_rows)
        self.lib, self.device, self.stream, self._stream_obj = ring.lib, ring.device, ring.stream, ring._stream_obj
        self.table = interop._alloc(self.lib, (self.rows, self.row_bytes), _backend._U8, self.device, self.stream)
        self._table_ptr = interop._dev_array(self.table, "PrefixTable table", stream=self.stream).ptr
        self._cu = _backend._require()
        self._lock = threading.RLock()  # after a ring's lock, before the core's mutexes

    def __repr__(self) -> str:
        return f"PrefixTable(storage={self.storage!r}, rows={self.rows} x {self.row_bytes} B, device={self.device})"

    @property
    def nbytes(self) -> int:
        """Device memory of the table (at most the store's ``budget_bytes``)."""
        return self.rows * self.row_bytes

    # -- through a ring ---------------------------------------------------
    def publish(self, ring: Any, seq: int, keys: Any, start: int, end: int) -> PrefixMoves:
        """``store.publish(ring.stager, ...)`` and apply its copies (ring table -> this table)."""
        with ring._lock, self._lock:
            ring._require_applied("PrefixTable.publish")
            moves = self.store.publish(ring.stager, seq, keys, start, end)
            ring.apply(moves, prefix_table=self)
        return moves

    def hit(self, ring: Any, seq: int, keys: Any, n_tokens: int) -> PrefixHit:
        """``store.hit(ring.stager, ...)`` and apply its copies (this table -> ring table)."""
        with ring._lock, self._lock:
            ring._require_applied("PrefixTable.hit")
            hit = self.store.hit(ring.stager, seq, keys, n_tokens)
            ring.apply(hit.moves, prefix_table=self)
        return hit

    def copy(self, moves: PrefixMoves, ring_table_ptr: int, ring_rows: int) -> None:
        """The device-to-device copies of ``moves`` between a ring's table and this one (for DeviceRing)."""
        rb = self.row_bytes
        to_store = moves.direction == "publish"
        src_ptr, dst_ptr = (ring_table_ptr, self._table_ptr) if to_store else (self._table_ptr, ring_table_ptr)
        src_rows, dst_rows = (ring_rows, self.rows) if to_store else (self.rows, ring_rows)
        rows = moves.tolist()
        for src, dst, m in rows:
            if not (m > 0 and 0 <= src and src + m <= src_rows and 0 <= dst and dst + m <= dst_rows):
                raise ValueError(f"PrefixTable: move [{src}, {dst}, {m}] is outside the tables")
        for src, dst, m in rows:
            self._cu.copy_device(dst_ptr + dst * rb, src_ptr + src * rb, m * rb, self.stream)

    # -- other processes ----------------------------------------------------
    def export_block(self, key: Any) -> bytes:
        """``store.export_block(key, rows)`` with the block's rows read from the device."""
        with self._lock:
            self._cu.synchronize(self.stream, self.device)
            slots = self.store.block_slots(key)
            rows = np.empty((len(slots), self.row_bytes), np.uint8)
            for i, s in enumerate(slots.tolist()):
                rows[i] = np.frombuffer(self._cu.copy_to_host(self._table_ptr + s * self.row_bytes, self.row_bytes),
                                        np.uint8)
            return bytes(self.store.export_block(key, rows))

    def import_block(self, data: Any) -> np.ndarray:
        """``store.import_block(data)`` and upload the block's rows into the slots it returns."""
        from .. import prefix_block_format

        with self._lock:
            slots = self.store.import_block(data)
            live = slots >= 0
            if live.any():
                # The store checked the block; its rows follow the header and the key.
                blk = prefix_block_format.unpack(data, prefix_block_format.fingerprint(self.store.config),
                                                 self.store.block_tokens, self.store.w_keep)
                rows = np.frombuffer(blk.rows, np.uint8).reshape(-1, self.row_bytes)
                staged = interop.DeviceArray.from_numpy(np.ascontiguousarray(rows[live]), self.device,
                                                        self._stream_obj if self.stream else None)
                src = interop._dev_array(staged, "imported rows", stream=self.stream).ptr
                for i, s in enumerate(slots[live].tolist()):
                    self._cu.copy_device(self._table_ptr + s * self.row_bytes, src + i * self.row_bytes,
                                         self.row_bytes, self.stream)
                self._cu.synchronize(self.stream, self.device)  # `staged` is freed when this returns
            interop._mark_written(self.table, self.stream, self._stream_obj)
            return slots
