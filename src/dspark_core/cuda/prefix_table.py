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
table's. These rules, the checks and the export / import flow are the
shared owner's (:mod:`dspark_core.prefix.table_owner`), the same for the
host twin :class:`dspark_core.HostPrefixTable`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..prefix.table_owner import PrefixTableOwner
from ..stager.stage_plan import consecutive_runs
from . import _backend, interop

__all__ = ["PrefixTable"]


class PrefixTable(PrefixTableOwner):
    """The device table of an external-row PrefixStore (see the module docstring).

    Args:
        store: a :class:`~dspark_core.PrefixStore` (or the reference twin) in
            external-row mode.
        ring: the :class:`~dspark_core.cuda.DeviceRing` whose device, backend,
            stream and storage the table takes (any ring of a Stager using the store).

    Attributes:
        table: the device array ``(store.table_rows, row_bytes)`` uint8.

    The checks, locks and the export / import flow are the shared owner's
    (:mod:`dspark_core.prefix.table_owner`); this class moves the bytes.
    """

    def __init__(self, store: Any, ring: Any) -> None:
        super().__init__(store, ring)
        self.lib, self.device, self.stream, self._stream_obj = ring.lib, ring.device, ring.stream, ring._stream_obj
        self.table = interop._alloc(self.lib, (self.rows, self.row_bytes), _backend._U8, self.device, self.stream)
        self._table_ptr = interop._dev_array(self.table, "PrefixTable table", stream=self.stream).ptr
        self._cu = _backend._require()

    def __repr__(self) -> str:
        return f"PrefixTable(storage={self.storage!r}, rows={self.rows} x {self.row_bytes} B, device={self.device})"

    def _check_place(self, ring: Any, fn: str) -> None:
        if ring.device != self.device:
            raise ValueError(f"{fn}: the PrefixTable lives on device {self.device}, the ring on device {ring.device}")

    def _copy_rows(self, moves: np.ndarray, to_store: bool, ring: Any) -> None:
        """Device to device, on the table's stream; the written table is marked on the ring's."""
        rb = self.row_bytes
        src_ptr, dst_ptr = (ring._table_ptr, self._table_ptr) if to_store else (self._table_ptr, ring._table_ptr)
        for src, dst, m in moves.tolist():
            self._cu.copy_device(dst_ptr + dst * rb, src_ptr + src * rb, m * rb, self.stream)
        interop._mark_written(self.table if to_store else ring.table, ring.stream, ring._stream_obj)

    def _host_rows(self, rows: Any, fn: str) -> np.ndarray:
        """Host rows as they are; a device array (DeviceArray, cupy, torch) read back after the
        table's work (one copy: the encode runs on the host)."""
        if isinstance(rows, np.ndarray):
            return rows
        self._cu.synchronize(self.stream, self.device)
        if hasattr(rows, "get"):  # DeviceArray, cupy
            return np.asarray(rows.get())
        if hasattr(rows, "detach"):  # torch
            t = rows.detach()
            if str(t.dtype) == "torch.bfloat16":
                return t.view(__import__("torch").int16).cpu().numpy().view(_backend._BF16)
            return t.cpu().numpy()
        raise TypeError(f"{fn}: rows must be a numpy array or a device array, got {type(rows).__name__}")

    def _read_rows(self, slots: np.ndarray) -> np.ndarray:
        """One download per run of consecutive slots (a block's slots are usually one run)."""
        self._cu.synchronize(self.stream, self.device)
        rb = self.row_bytes
        rows = np.empty((len(slots), rb), np.uint8)
        for a, b in consecutive_runs(slots):
            data = self._cu.copy_to_host(self._table_ptr + int(slots[a]) * rb, (b - a) * rb)
            rows[a:b] = np.frombuffer(data, np.uint8).reshape(b - a, rb)
        return rows

    def _write_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """One upload of the rows, then a device copy per run of consecutive slots."""
        rb = self.row_bytes
        staged = interop.DeviceArray.from_numpy(rows, self.device, self._stream_obj if self.stream else None)
        src = interop._dev_array(staged, "imported rows", stream=self.stream).ptr
        for a, b in consecutive_runs(slots):
            self._cu.copy_device(self._table_ptr + int(slots[a]) * rb, src + a * rb, (b - a) * rb, self.stream)
        self._cu.synchronize(self.stream, self.device)  # `staged` is freed when this returns
        interop._mark_written(self.table, self.stream, self._stream_obj)
