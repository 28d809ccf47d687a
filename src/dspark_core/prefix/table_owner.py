"""PrefixTableOwner: the rules every owner of an external-row PrefixStore's rows keeps, written once.

An external-row :class:`~dspark_core.PrefixStore` holds no row bytes: it
hands out slots of a table (``store.table_rows`` rows of ``row_bytes``) that
its owner allocates next to the Stagers' ring tables. Two owners exist, one
per ring owner (:mod:`dspark_core.rows.ring_owner`):
:class:`dspark_core.HostPrefixTable` (a numpy array, beside a ``HostRing``)
and :class:`dspark_core.cuda.PrefixTable` (a CUDA device, beside the
``DeviceRing`` s). They differ only in where the table lives and how rows
move; everything else is here, the same for both:

* construction: the store is in external-row mode; the ring is of the owner
  kind the table pairs with (``RingOwner._prefix_table_type``), in the
  store's storage;
* :meth:`publish` / :meth:`hit`: the ring checked first, then, under the
  ring's lock and the table's, the store's call and its copies, so the
  moves are numbered among the ring's table changes and applied in the
  order the store made them;
* :meth:`copy` (the ring's ``apply``): every move inside both tables before
  a row moves;
* :meth:`export_block` / :meth:`import_block`: the store's call with the
  block's rows read from / written into the table, under the table's lock.

A subclass moves the bytes (the ``_``-prefixed hooks at the end).

Lock order: a ring's lock, then a table's, then (inside the core) the
Stager's and the store's mutexes. Nothing takes a ring's lock while holding
a table's, and no core call calls back into Python, so threads sharing
rings and tables never wait on each other in a cycle.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from .. import formats
from .._ext import _row_format
from .keys import as_block_data
from ..rows.row_dtypes import input_row_dtype
from .hit import PUBLISH, PrefixHit, PrefixHits, PrefixMoves

__all__ = ["PrefixTableOwner"]


class PrefixTableOwner:
    """The shared part of an external-row PrefixStore's table (see the module docstring).

    Args:
        store: a :class:`~dspark_core.PrefixStore` (or the reference twin) in
            external-row mode.
        ring: a ring owner of a Stager using the store; the table pairs with
            its kind and takes its storage (and, on a device, its place).

    Attributes:
        store: the store whose slots index the table.
        storage: the rows' format (the store's, which the rings' must be).
        row_bytes: bytes of one row.
        rows: rows of the table (``store.table_rows``).
        table: the table, ``(rows, row_bytes)`` uint8 (the subclass's array type).
    """

    table: Any

    def __init__(self, store: Any, ring: Any) -> None:
        if not store.config.external_rows:
            raise ValueError(
                f"{self._name} needs a PrefixStore in external-row mode (its config's rows='external'); "
                "this one holds its rows"
            )
        self.store = store
        self.storage = store.config.storage
        self._check_pair(ring, self._name)  # its place: the subclass takes the ring's
        self.row_bytes = formats.row_bytes(self.storage, int(store.config.feature_dim))
        self.rows = int(store.table_rows)
        self._lock = threading.RLock()  # after a ring's lock, before the core's mutexes

    @property
    def _name(self) -> str:
        return type(self).__name__

    @property
    def nbytes(self) -> int:
        """Memory of the table (at most the store's ``budget_bytes``)."""
        return self.rows * self.row_bytes

    def check_ring(self, ring: Any, fn: str) -> None:
        """Refuse a ring this table cannot copy rows to and from (``fn``: the call, for the message):
        another kind of owner (``TypeError``), another storage or place (``ValueError``)."""
        self._check_pair(ring, fn)
        self._check_place(ring, fn)

    def _check_pair(self, ring: Any, fn: str) -> None:
        """The ring's kind pairs with this table's, and its storage is the store's."""
        kind = getattr(ring, "_prefix_table_type", None)
        if kind is None:
            raise TypeError(f"{fn}: ring must be a ring owner (HostRing or cuda.DeviceRing), got "
                            f"{type(ring).__name__}")
        if not isinstance(self, kind):
            raise TypeError(f"{fn}: a {type(ring).__name__} copies prefix rows with a {kind.__name__}, "
                            f"not a {self._name}")
        if ring.storage != self.storage:
            raise ValueError(
                f"{fn}: the ring keeps {ring.storage!r} rows but the store's rows are {self.storage!r}: "
                "the copies between them need one format"
            )

    # -- through a ring ---------------------------------------------------
    def _through(self, ring: Any, what: str, call: Callable[[Any], Any]) -> Any:
        """``call(ring.stager)`` (a store call that changes the tables) and its copies applied, under
        both locks: the ring checked before the store changes, every earlier change applied."""
        fn = f"{self._name}.{what}"
        self.check_ring(ring, fn)  # before the store changes
        with ring._lock, self._lock:
            ring._require_applied(fn)
            result = call(ring.stager)
            ring.apply(result if isinstance(result, PrefixMoves) else result.moves, prefix_table=self)
        return result

    def publish(self, ring: Any, seq: int, keys: Any, start: int, end: int) -> PrefixMoves:
        """``store.publish(ring.stager, ...)`` and apply its copies (ring table -> this table)."""
        return self._through(ring, "publish", lambda st: self.store.publish(st, seq, keys, start, end))

    def hit(self, ring: Any, seq: int, keys: Any, n_tokens: int, tokens: Any = None) -> PrefixHit:
        """``store.hit(ring.stager, ...)`` and apply its copies (this table -> ring table)."""
        return self._through(ring, "hit", lambda st: self.store.hit(st, seq, keys, n_tokens, tokens=tokens))

    def publish_many(self, ring: Any, seqs: Any, keys: Any, starts: Any, ends: Any) -> PrefixMoves:
        """``store.publish_many(ring.stager, ...)`` and apply its copies (one table change for the batch)."""
        return self._through(ring, "publish_many", lambda st: self.store.publish_many(st, seqs, keys, starts, ends))

    def hit_many(self, ring: Any, seqs: Any, keys: Any, n_tokens: Any, tokens: Any = None) -> PrefixHits:
        """``store.hit_many(ring.stager, ...)`` and apply its copies (one table change for the batch)."""
        return self._through(ring, "hit_many",
                             lambda st: self.store.hit_many(st, seqs, keys, n_tokens, tokens=tokens))

    def copy(self, moves: PrefixMoves, ring: Any) -> None:
        """The copies of ``moves`` between ``ring``'s table and this one (a publish: ring -> table,
        a hit: table -> ring), every move checked first. For the ring's ``apply``, which holds
        both locks and has checked the moves' identity and order."""
        to_store = moves.direction == PUBLISH
        src_rows, dst_rows = (ring.rows, self.rows) if to_store else (self.rows, ring.rows)
        arr = np.asarray(moves, np.int64).reshape(-1, 3)
        src, dst, m = arr[:, 0], arr[:, 1], arr[:, 2]
        bad = np.flatnonzero((m <= 0) | (src < 0) | (src + m > src_rows) | (dst < 0) | (dst + m > dst_rows))
        if len(bad):
            s, d, k = arr[bad[0]].tolist()
            raise ValueError(f"{self._name}: move [{s}, {d}, {k}] is outside the tables")
        self._copy_rows(arr, to_store, ring)

    # -- other processes ----------------------------------------------------
    def publish_rows(self, keys: Any, start: int, end: int, rows: Any, *, in_dtype: Any = None) -> np.ndarray:
        """``store.publish_slots(keys, start, end)`` and encode the kept rows of ``rows`` into the
        slots it returns: ``store.publish_rows`` for external rows.

        For blocks whose rows no Stager holds any more: a prefill chunk longer than the window
        (vLLM's 2,048-8,192 tokens) leaves only its last rows in the ring, so a server publishes
        the chunk's blocks from the rows it captured, in the same call. ``rows``: ``(end - start,
        feature_dim)`` float32 / float16 / bfloat16 (``in_dtype="bfloat16"`` reads uint16 as
        bfloat16 bits), encoded as the store's Stagers encode them (storage, ``nonfinite``, stage
        dtype): a later hit stages the bytes a held store's ``publish_rows`` would have. Host
        rows; a device array is read back first (one copy). Returns the slots (-1: a row the
        store does not keep, or of a block it already holds). Rows of the wrong shape or dtype,
        and under ``nonfinite="error"`` a value that cannot be staged, raise before the store
        changes."""
        fn = f"{self._name}.publish_rows"
        cfg = self.store.config

        a = self._host_rows(rows, fn)
        a = a.view(input_row_dtype(a.dtype, in_dtype, fn))
        if a.ndim != 2 or a.shape[1] != cfg.feature_dim:
            raise ValueError(f"{fn}: rows must be (n, {cfg.feature_dim}), got shape {a.shape}")
        if isinstance(start, (int, np.integer)) and isinstance(end, (int, np.integer)) and a.shape[0] != end - start:
            raise ValueError(f"{fn}: positions [{start}, {end}) need {int(end) - int(start)} rows, "
                             f"got {a.shape[0]}")
        enc, bad = _row_format.encode(np.ascontiguousarray(a), self.storage, cfg.nonfinite, None, cfg.stage_dtype)
        if cfg.nonfinite == "error" and bad >= 0:
            r, c = divmod(int(bad), int(cfg.feature_dim))
            raise ValueError(f"{fn}: row {r} (position {int(start) + r}), column {c} holds a non-finite value, or "
                             f"one that overflows {self.storage} storage staged as {cfg.stage_dtype}; nothing was "
                             "published (nonfinite='error')")
        with self._lock:
            slots = self.store.publish_slots(keys, start, end)  # the store's checks, then its change
            live = slots >= 0
            if live.any():
                enc_rows = enc.view(np.uint8).reshape(len(slots), self.row_bytes)
                self._write_rows(slots[live], np.ascontiguousarray(enc_rows[live]))
        return slots

    def export_block(self, key: Any) -> bytes:
        """``store.export_block(key, rows)`` with the block's rows read from the table."""
        with self._lock:
            slots = self.store.block_slots(key)
            return bytes(self.store.export_block(key, self._read_rows(np.asarray(slots, np.int64))))

    def import_block(self, data: Any) -> np.ndarray:
        """``store.import_block(data)`` and write the block's rows into the slots it returns
        (-1: a row the store already held). Bad data raises before anything changes."""
        raw = as_block_data(data)  # the one conversion (any buffer), before the store changes
        with self._lock:
            slots = self.store.import_block(raw)
            live = slots >= 0
            if live.any():
                # The store parsed and checked the block; its rows end it (prefix_block_format),
                # one per slot. No second parse: nothing can fail between the store's change and
                # the rows' write.
                rows = np.frombuffer(raw, np.uint8)[len(raw) - len(slots) * self.row_bytes:]
                self._write_rows(slots[live], np.ascontiguousarray(rows.reshape(-1, self.row_bytes)[live]))
            return slots

    # -- the table: implemented by each owner -------------------------------
    def _check_place(self, ring: Any, fn: str) -> None:
        """Refuse a ring whose table this one cannot reach (a device owner: another device)."""

    def _copy_rows(self, moves: np.ndarray, to_store: bool, ring: Any) -> None:
        """Copy rows ``[src, src + m)`` to ``[dst, dst + m)`` of each move (``(n, 3)`` int64), in
        order: from ``ring``'s table into this one when ``to_store``, else the other way (the moves
        are checked)."""
        raise NotImplementedError

    def _host_rows(self, rows: Any, fn: str) -> np.ndarray:
        """``rows`` as a host numpy array (a device owner reads a device array back)."""
        if not isinstance(rows, np.ndarray):
            raise TypeError(f"{fn}: rows must be a numpy array (host memory), got {type(rows).__name__}")
        return rows

    def _read_rows(self, slots: np.ndarray) -> np.ndarray:
        """A new host ``(len(slots), row_bytes)`` uint8 array of the table's rows at ``slots``
        (after every copy enqueued before)."""
        raise NotImplementedError

    def _write_rows(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Write the host ``rows`` (``(len(slots), row_bytes)`` uint8) into the table at ``slots``."""
        raise NotImplementedError
