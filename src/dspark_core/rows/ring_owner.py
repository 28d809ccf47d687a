"""RingOwner: the rules every owner of an external-row Stager's rows keeps, written once.

An external-row Stager (``StagerConfig(rows="external")``) hands out slots and
holds no row bytes; an *owner* keeps the table the slots index and moves the
rows. Two owners exist: :class:`dspark_core.rows.host_ring.HostRing` (numpy, any
machine) and :class:`dspark_core.cuda.DeviceRing` (a CUDA device). They
differ only in where the table lives and how rows are converted; everything
a caller can get wrong is checked here, the same way for both:

* identity and order: moves of this Stager only, every non-empty moves array
  applied once and in order; plans of this Stager only, gathered while their
  round is open;
* writes: the Stager's own state and position checks first, then (under
  ``nonfinite="error"``) rows that cannot be staged are rejected before the
  Stager or the table changes;
* batches (``write_slots`` / ``gather_slots``): shapes, slot ranges, the
  status words of the asynchronous form;
* the ``fork`` / ``shift`` / ``snapshot`` / ``restore`` helpers.

A subclass implements the table and its conversions (the ``_``-prefixed
hooks at the end of this class).

Threads. The Stager numbers every change of the table it asks for (the
moves of ``fork`` / ``shift``, the slots of an external ``restore``) under
the lock of the operation, so their ``serial`` order is the order they
happened in. An owner applies them in exactly that order: :meth:`fork`,
:meth:`shift` and :meth:`restore` hold the owner's lock across the Stager's
call and the copies, so several threads may call them at once;
:meth:`apply` (moves a caller got from the Stager itself) refuses anything
but the next serial, and anything but the array the Stager returned (a
view, slice or copy of it has no serial).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, NamedTuple

import numpy as np

from .. import formats
from ..stager._args import as_parents, as_positions
from ..prefix.hit import PrefixMoves
from ..prefix.table_owner import PrefixTableOwner
from . import _bf16
from .row_dtypes import input_row_dtype, is_row_dtype, row_dtype
from .slot_moves import RestoredSlots, SlotMoves
from ..stager.stage_plan import BatchPlan, StagePlan

__all__ = ["RingOwner", "BatchStatus", "STATUS_NONE"]

#: The Python call behind each of the core's table-change names (``Stager.last_change``).
_CHANGE_CALLS = {
    "fork": "Stager.fork()",
    "shift": "Stager.shift()",
    "accept_path": "Stager.accept_path()",
    "accept_path_many": "Stager.accept_path_many()",
    "restore": "Stager.restore()",
    "publish_prefix": "PrefixStore.publish()",
    "start_from_prefix": "PrefixStore.hit()",
}

#: A status word's value while nothing was reported (the device kernels' ``~0``).
STATUS_NONE = np.iinfo(np.uint64).max

def _process_many_order(seqs: Any, second: Any, third: Any) -> tuple[Any, Any]:
    """``write_many``'s ``(cu_seqlens, positions)``; the arguments of its first form,
    ``(seqs, starts, cu_seqlens, rows)`` (one start per sequence, then N + 1 offsets), are
    recognised by their lengths and converted, with a DeprecationWarning."""
    try:
        n, n2, n3 = len(seqs), len(second), len(third)
    except TypeError:
        return second, third  # not sized: process_many's own checks say what is wrong
    if not (n2 == n and n3 == n + 1 and n2 != n + 1):
        return second, third
    warnings.warn(
        "write_many(seqs, starts, cu_seqlens, rows) is deprecated: pass process_many's arguments, "
        "write_many(seqs, cu_seqlens, positions, rows)", DeprecationWarning, stacklevel=3
    )
    starts, cu = as_positions(second), np.asarray(third)
    if cu.dtype.kind not in "iu" or cu.ndim != 1:
        return cu, np.zeros(0, np.int64)  # refused by process_many's checks, with its message
    runs = [np.arange(s, s + m, dtype=np.int64) for s, m in zip(starts.tolist(), np.diff(cu).tolist())]
    return cu, np.concatenate(runs) if runs else np.zeros(0, np.int64)


class BatchStatus(NamedTuple):
    """What a batch reported (:meth:`RingOwner.read_status`); ``None``: nothing.

    ``bad_row`` / ``bad_column``: the first input value that cannot be staged
    (a write under ``nonfinite="error"``: the batch changed nothing).
    ``bad_slot_row``: the first row whose slot was outside ``[-1, table rows)``
    (the row was skipped: not written, or gathered as zeros).
    """

    bad_row: int | None
    bad_column: int | None
    bad_slot_row: int | None

    @property
    def ok(self) -> bool:
        return self.bad_row is None and self.bad_slot_row is None


class RingOwner:
    """The shared part of an external-row Stager's row owner (see the module docstring).

    Attributes:
        stager: the Stager (``rows="external"``) whose slots index the table.
        storage: the table's row format.
        feature_dim: elements per row.
        row_bytes: bytes of one row in ``storage``.
        ring_rows: slots per sequence (``stager.ring_rows``).
        rows: rows of the table (``max_seqs * ring_rows``).
        stage_dtype: the Stager's stage dtype (numpy), the default of ``gather``.
        table: the table, ``(rows, row_bytes)`` uint8 (the subclass's array type).
    """

    table: Any
    #: The table class of an external-row PrefixStore's rows that this owner's prefix moves
    #: copy to and from (``apply(moves, prefix_table=...)``).
    _prefix_table_type: type[PrefixTableOwner]

    def __init__(self, stager: Any, storage: str | None = None) -> None:
        cfg = stager.config
        if not cfg.external_rows:
            raise ValueError(
                f"{self._name} needs a Stager in external-row mode (StagerConfig(rows='external')); "
                f"this one holds its rows (rows={cfg.rows!r})"
            )
        self.stager = stager
        self.storage = cfg.storage if storage is None else storage
        self.feature_dim = int(cfg.feature_dim)
        self.row_bytes = formats.row_bytes(self.storage, self.feature_dim)  # ConfigError for q + D % 32
        self.ring_rows = int(stager.ring_rows)
        self.rows = int(cfg.max_seqs) * self.ring_rows
        self.stage_dtype = row_dtype(cfg.stage_dtype)
        # Rows are held to encode_bounds(storage, stage_dtype), as a held Stager's
        # process() does: rows staged in a narrower type than the storage decodes to
        # (f32 rows staged as float16) must stay below that type's limit.
        self._limit = formats.encode_bounds(self.storage, self.stage_dtype).limit
        self._nonfinite = cfg.nonfinite
        self._error = cfg.nonfinite == "error"
        self._moves_applied = int(stager.moves_issued)
        if self.storage == "bf16":
            # bfloat16 rows are likely: load their support (ml_dtypes, about a second on a
            # loaded machine) now, with the owner, not inside a server's first step.
            _bf16.dtype()
        # Held across a Stager call that changes the table and the owner's copies
        # for it, so that table changes apply in serial order from any thread.
        self._lock = threading.RLock()

    @property
    def _name(self) -> str:
        return type(self).__name__

    @property
    def nbytes(self) -> int:
        """Memory of the table."""
        return self.rows * self.row_bytes

    @property
    def bytes_per_sequence(self) -> int:
        """Memory one sequence's slots take (``ring_rows * row_bytes``)."""
        return self.ring_rows * self.row_bytes

    # -- write ------------------------------------------------------------
    def write(self, seq: int, positions: Any, rows: Any, *, in_dtype: Any = None, tokens: Any = None) -> np.ndarray:
        """``stager.process(seq, positions, tokens=tokens)`` and encode ``rows`` into the returned slots.

        ``rows``: (n, feature_dim) float32 / float16 / bfloat16 in the owner's
        memory (``in_dtype="bfloat16"`` reads uint16 as bfloat16 bits).
        Returns the slots (int64; -1 for rows below the horizon, which are not
        written). A rejected call (state, positions, dtype / shape, a value
        that cannot be staged under ``nonfinite="error"``) raises before the
        Stager or the table changes. ``tokens``: a chain drafter's Stager's
        token ids, one per row (``Stager.process``).
        """
        pos = as_positions(positions)
        # The Stager's own checks (sequence, round state, positions, token
        # ids), in its order and with its messages, before the rows are looked at.
        self.stager.check_process(seq, pos, tokens)
        self._require_applied("write", [seq])
        a = self._input_rows(rows, in_dtype, f"{self._name}.write", None)
        n = a.shape[0]
        if len(pos) != n:
            raise ValueError(f"{self._name}.write: {len(pos)} positions for {n} rows")
        prepared = self._prepare_write(seq, pos, a)
        slots = self.stager.process(seq, pos, tokens=tokens)
        self._store_write(a, slots, prepared)
        return slots

    def write_many(self, seqs: Any, cu_seqlens: Any, positions: Any, rows: Any, *,
                   in_dtype: Any = None, tokens: Any = None) -> np.ndarray:
        """``stager.process_many(seqs, cu_seqlens, positions, tokens=tokens)`` and encode ``rows``
        into its slots (``tokens``: flat, a chain drafter's Stager's).

        The arguments are ``process_many``'s: the rows of ``seqs[i]`` are
        rows ``[cu_seqlens[i], cu_seqlens[i + 1])`` of ``positions`` and of
        ``rows`` (``(total, feature_dim)``, as a varlen attention batch's).
        Returns the flat slots (int64, -1 below the horizon). Everything is
        checked first, in order: the Stager's own checks of the batch (its
        messages, naming the sequence), the rows, the table changes of those
        sequences, and under ``nonfinite="error"`` every value. A rejected
        call changes nothing (no Stager, no table row). Then one
        ``process_many`` (the core's, atomic) and one encode for all the rows
        (DeviceRing: one launch, and one check launch more under
        ``nonfinite="error"``).
        """
        fn = f"{self._name}.write_many"
        cu_seqlens, positions = _process_many_order(seqs, cu_seqlens, positions)
        self.stager.check_process_many(seqs, cu_seqlens, positions, tokens)
        # Checked: plain integer arrays of the right shapes from here on.
        seq_ids = np.asarray(seqs, np.int64).reshape(-1)
        cu = np.asarray(cu_seqlens, np.int64)
        pos = np.asarray(positions, np.int64)
        a = self._input_rows(rows, in_dtype, fn, None)
        if a.shape[0] != len(pos):
            raise ValueError(f"{fn}: {len(pos)} positions for {a.shape[0]} rows")
        self._require_applied("write_many", seq_ids)
        prepared = self._prepare_batch_write(np.repeat(seq_ids, np.diff(cu)), pos, a)
        flat = self.stager.process_many(seq_ids, cu, pos, tokens=tokens)
        self._store_batch_write(a, flat, prepared)
        return flat

    def _unstageable(self, seq: Any, row: int, positions: np.ndarray) -> ValueError:
        """The error of a write whose row ``row`` holds a value that cannot be staged.
        ``seq``: the sequence, or an array of each row's sequence (write_many)."""
        s = int(seq[row]) if isinstance(seq, np.ndarray) else int(seq)
        return ValueError(
            f"sequence {s}: row {row} (position {int(positions[row])}) holds a non-finite value, or one that "
            f"overflows {self.storage} storage staged as {self.stage_dtype} (|x| must stay below "
            f"{self._limit:.9g}); nothing was appended (nonfinite='error')"
        )

    def _unstageable_batch(self, fn: str, index: int) -> ValueError:
        """The error of a checked batch write whose flat input element ``index`` cannot be staged."""
        r, c = divmod(int(index), self.feature_dim)
        return ValueError(
            f"{fn}: row {r}, column {c} holds a non-finite value, or one that overflows {self.storage} storage "
            f"staged as {self.stage_dtype} (|x| must stay below {self._limit:.9g}); nothing was written "
            "(nonfinite='error')"
        )

    def _input_dtype(self, dt: np.dtype, in_dtype: Any, fn: str) -> np.dtype:
        return input_row_dtype(dt, in_dtype, fn)

    def _check_row_shape(self, shape: tuple[int, ...], lead: tuple[int, ...] | None, fn: str) -> None:
        """Rows are (n, feature_dim); a batch's rows are ``lead + (feature_dim,)`` or (prod(lead), feature_dim)."""
        d = self.feature_dim
        if lead is None:
            if len(shape) != 2 or shape[1] != d:
                raise ValueError(f"{fn}: rows must be (n, {d}), got shape {shape}")
            return
        n = int(np.prod(lead))
        if shape != lead + (d,) and shape != (n, d):
            raise ValueError(f"{fn}: rows must be {lead + (d,)} or {(n, d)} (one per slot), got shape {shape}")

    # -- gather -----------------------------------------------------------
    def gather(self, plan: StagePlan | BatchPlan, dtype: Any = None, out: Any = None) -> Any:
        """Decode the plan's staged slots into one contiguous ``(n_rows, feature_dim)`` array.

        ``plan``: a :class:`StagePlan` or a :class:`BatchPlan` (draft_many) of
        this owner's Stager, while its round is open (a plan of a round that
        has closed raises ``ValueError``: later writes may have reused its
        slots, even if a newer round of the sequence is open). ``dtype``: float32 /
        float16 / bfloat16 (default: the Stager's ``stage_dtype``). Equal, byte
        for byte, to ``plan.rows`` of a held Stager with the same storage.
        """
        odt = self._out_dtype(dtype, f"{self._name}.gather")
        if isinstance(plan, BatchPlan):
            # The batch's own arrays: one round-id call and one flat slot array,
            # no per-sequence Python (skipped sequences stage no rows).
            self._check_batch(plan)
            self._require_applied("gather", plan.seqs[plan.active])
            return self._gather_plans(plan.slots, int(plan.row_offsets[-1]), odt, out, True)
        if not isinstance(plan, StagePlan):
            raise TypeError(f"{self._name}.gather: expected a StagePlan or a BatchPlan, got {type(plan).__name__}")
        if plan.skip is not None:
            return self._gather_plans(np.zeros(0, np.int64), 0, odt, out, False)
        self._check_source(plan.source, plan.seq)
        self._check_round(plan.seq, plan.round, self.stager.open_round_id(plan.seq))
        self._require_applied("gather", [plan.seq])
        return self._gather_plans(plan.slots, len(plan.slots), odt, out, False)

    def _check_source(self, source: Any, seq: int) -> None:
        if source is not self.stager:
            raise ValueError(
                f"{self._name}.gather: the plan of sequence {seq} comes from another Stager; its slots do not "
                "index this ring's table"
            )

    def _check_round(self, seq: int, plan_round: int, open_round: int) -> None:
        if open_round == 0 or plan_round != open_round:
            now = "has no open round" if open_round == 0 else f"has another round open now (round {open_round})"
            raise ValueError(
                f"{self._name}.gather: the plan of sequence {seq} is of round {plan_round}, and the sequence {now}: "
                "gather a plan between its draft() and its commit() / fail() (later writes may reuse its slots)"
            )

    def _check_batch(self, plan: BatchPlan) -> None:
        """Every active sequence's round still open: the first that is not raises, as a single plan's would."""
        active = np.flatnonzero(plan.active)
        if len(active) == 0:
            return
        self._check_source(plan.source, int(plan.seqs[active[0]]))
        open_rounds = self.stager.open_round_ids(plan.seqs[active])
        stale = np.flatnonzero(open_rounds != plan.round[active])
        if len(stale):
            i = int(active[stale[0]])
            self._check_round(int(plan.seqs[i]), int(plan.round[i]), int(open_rounds[stale[0]]))

    def _out_dtype(self, dtype: Any, fn: str) -> np.dtype:
        odt = self.stage_dtype if dtype is None else row_dtype(dtype)
        if not is_row_dtype(odt):
            raise TypeError(f"{fn}: dtype {odt} is not supported; expected float32, float16 or bfloat16")
        return odt

    # -- batches ------------------------------------------------------------
    def write_slots(self, slots: Any, rows: Any, *, in_dtype: Any = None, status: Any = None) -> None:
        """Encode row ``i`` of ``rows`` into table row ``slots[i]`` for a whole batch at once.

        ``slots``: int64, 1-D ``(n,)`` (a flat batch: the slots ``process``
        returned for each sequence, concatenated) or 2-D ``(N, max_rows)`` (a
        fixed-shape batch, e.g. for a CUDA graph); ``-1`` skips the row
        (padding, or a row below the horizon). ``rows``: ``slots.shape +
        (feature_dim,)`` or ``(slots.size, feature_dim)``. The Stager is not
        called: the slots come from ``process`` (or a plan), already made.

        ``status=None``: everything is checked first and a rejected batch
        raises ``ValueError`` naming the row and changes nothing (slots
        outside the table; under ``nonfinite="error"`` a value that cannot be
        staged). ``status=`` a status array (:meth:`new_status`): the
        asynchronous form, for CUDA graphs: nothing is raised, the status
        reports (read it with :meth:`read_status`); under ``"error"`` a batch
        with a bad value or slot changes nothing, otherwise bad slots are
        skipped.
        """
        fn = f"{self._name}.write_slots"
        s = self._batch_slots(slots, fn, status, True)
        self._require_applied_slots("write_slots", s)
        a = self._input_rows(rows, in_dtype, fn, tuple(s.shape))
        self._scatter(s, a, status, fn)

    def gather_slots(self, slots: Any, out: Any = None, *, dtype: Any = None, status: Any = None) -> Any:
        """Decode table row ``slots[i]`` into row ``i`` of ``out`` for a whole batch at once.

        ``slots`` as :meth:`write_slots` (rows whose slot is -1 become zeros).
        ``out``: ``slots.shape + (feature_dim,)`` or ``(slots.size,
        feature_dim)`` in ``dtype`` (default: ``out``'s dtype, else the
        Stager's ``stage_dtype``); allocated when None. ``status`` as
        :meth:`write_slots` (``None``: slots outside the table raise). The
        caller keeps the slots' rows alive (a plan's round still open).
        """
        fn = f"{self._name}.gather_slots"
        s = self._batch_slots(slots, fn, status, False)
        self._require_applied_slots("gather_slots", s)
        return self._gather_slots(s, out, dtype, status, fn)

    def _check_slot_values(self, slots: np.ndarray, fn: str, distinct: bool, status: Any = None) -> None:
        """Host slots: each -1 or a table row (unless ``status`` is given: the asynchronous form
        reports a slot outside the table in it instead); a write's distinct (two rows into one
        slot race)."""
        flat = slots.reshape(-1)
        bad = np.flatnonzero((flat < -1) | (flat >= self.rows)) if status is None else np.zeros(0, np.intp)
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"{fn}: slot {int(flat[i])} (row {i}) is outside the table [0, {self.rows}) "
                             "and not -1 (skip)")
        live = flat[flat >= 0]
        if distinct and len(np.unique(live)) != len(live):
            raise ValueError(f"{fn}: a slot appears twice; the rows of one write go to distinct slots")

    def read_status(self, status: Any) -> BatchStatus:
        """What the batch that wrote ``status`` reported (waits for it)."""
        bad, slot = (int(x) for x in self._status_words(status))
        d = self.feature_dim
        return BatchStatus(None if bad == STATUS_NONE else bad // d, None if bad == STATUS_NONE else bad % d,
                           None if slot == STATUS_NONE else slot)

    # -- moves ------------------------------------------------------------
    def _next_change(self, change: SlotMoves | RestoredSlots, what: str) -> None:
        """Refuse a table change that is not the Stager's next one, as it issued it
        (a view, slice, copy or edit of it carries no serial, or other bytes)."""
        if change.source is not self.stager and change.serial:
            raise ValueError(f"{self._name}.{what}: these come from another Stager")
        if not change.applicable():
            raise ValueError(
                f"{self._name}.{what}: not the array the Stager returned (a view, slice, reversal, copy or edit "
                "of it carries no serial): pass fork() / shift() / restore()'s result itself"
            )
        want = self._moves_applied + 1
        if change.serial != want:
            raise ValueError(
                f"{self._name}.{what}: table changes applied out of order: expected change #{want} of this "
                f"Stager, got #{change.serial} (each non-empty fork / shift / restore result must be applied "
                "once, in serial order)"
            )

    def _require_applied(self, what: str, seqs: Any = None) -> None:
        """Before the owner asks the Stager for a table change (``seqs`` None): every change the
        Stager issued is applied, else the new one could not be applied in order. Before it writes
        or gathers the rows of ``seqs``: every change into or out of their slots is applied, else
        the table lacks rows the Stager counts on (a gather would hand the drafter whatever the
        slots held: zeros) or a later copy would read rows written over. ValueError, naming the
        call that issued the newest change; nothing changed. Other sequences' changes may wait:
        a thread that forks does not stop one that drafts."""
        with self._lock:  # a fork / shift / restore of another thread applies its change before this reads
            applied = self._moves_applied
            issued = int(self.stager.moves_issued if seqs is None else self.stager.changes_of(seqs))
        if issued > applied:
            call = _CHANGE_CALLS.get(self.stager.last_change, self.stager.last_change)
            raise ValueError(
                f"{self._name}.{what}: the Stager issued table changes up to #{issued} (the newest by {call}), "
                f"this ring applied up to #{applied}: their rows are not in the table: apply the missing changes "
                "first: ring.apply(moves) (prefix moves: ring.apply(moves, prefix_table=table)), or call "
                "ring.fork / ring.shift / ring.restore and table.hit / table.publish, which apply their own "
                "(nothing changed)"
            )

    def _require_applied_slots(self, what: str, s: Any) -> None:
        """:meth:`_require_applied` for a batch of raw slots: the sequences whose slots they are
        (all of them when the slots are on a device: reading them back would synchronize)."""
        host = self._host_slots(s)
        if host is None:
            self._require_applied(what)
            return
        flat = host.reshape(-1)
        self._require_applied(what, np.unique(flat[(flat >= 0) & (flat < self.rows)] // self.ring_rows))

    def apply(self, moves: SlotMoves, *, prefix_table: Any = None) -> None:
        """Apply the moves ``fork`` / ``shift`` / ``accept_path`` returned (row copies, in order).

        Every non-empty moves array of the Stager (and the slots of an
        external ``restore``, which :meth:`restore` fills) must be applied
        once, in serial order; moves of another Stager, out of order (twice,
        or after skipping one), or not the array the Stager returned (a view,
        slice, reversal, copy or edit of it) raise ``ValueError`` and copy
        nothing. The moves of a prefix store's publish / hit
        (:class:`~dspark_core.prefix.hit.PrefixMoves`, numbered among the same
        table changes) copy between this table and the store's: pass the
        store's table as ``prefix_table`` (a ``HostPrefixTable`` for a
        HostRing, a ``cuda.PrefixTable`` for a DeviceRing; their ``publish`` /
        ``hit`` do, under both tables' locks).
        """
        if not isinstance(moves, SlotMoves):
            raise TypeError(
                f"{self._name}.apply: expected the moves fork() / shift() returned, got {type(moves).__name__}"
            )
        if len(moves) == 0:
            return
        with self._lock:
            self._next_change(moves, "apply")
            if isinstance(moves, PrefixMoves):
                self._apply_prefix(moves, prefix_table)
                return
            rows = moves.tolist()
            for src, dst, m in rows:
                if not (m > 0 and 0 <= src and src + m <= self.rows and 0 <= dst and dst + m <= self.rows):
                    raise ValueError(f"{self._name}.apply: move [{src}, {dst}, {m}] is outside the table")
            self._copy_moves(rows)
            self._moves_applied = moves.serial

    def _apply_prefix(self, moves: PrefixMoves, table: Any) -> None:
        """The copies of a prefix publish (ring -> store table) or hit (store table -> ring), with
        that store's table; everything checked before a row moves. Lock order: this ring's (held
        by apply), then the table's."""
        fn = f"{self._name}.apply"
        if table is not None and not isinstance(table, PrefixTableOwner):
            raise TypeError(f"{fn}: prefix_table must be a {self._prefix_table_type.__name__}, got "
                            f"{type(table).__name__}")
        if table is None or table.store is not moves.store:
            raise ValueError(
                f"{fn}: these moves copy between this ring and a PrefixStore's table: pass "
                f"prefix_table=<the {self._prefix_table_type.__name__} of that store>"
            )
        table.check_ring(self, fn)
        with table._lock:
            table.copy(moves, self)  # checks every move first
            self._moves_applied = moves.serial

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

    # -- tree verification (docs/design.md 2.11) ----------------------------
    def write_tree(self, seq: int, n_past: int, parents: Any, rows: Any, *, in_dtype: Any = None,
                   tokens: Any = None) -> np.ndarray:
        """``stager.process_tree(seq, n_past, parents)`` and encode the nodes' ``rows`` into the returned slots.

        ``rows``: (n, feature_dim), node ``i``'s row at ``rows[i]`` (as :meth:`write`'s).
        Returns the slots (int64). Checked first, in order: the Stager's own
        checks (the sequence, its state, the root, the parents), the table
        changes of the sequence, the rows; a rejected call changes nothing. ``tokens``: a chain
        drafter's Stager's ids, one per node.
        """
        par = as_parents(parents)
        self.stager.check_process_tree(seq, n_past, par, tokens)
        self._require_applied("write_tree", [seq])
        a = self._input_rows(rows, in_dtype, f"{self._name}.write_tree", None)
        n = a.shape[0]
        if len(par) != n:
            raise ValueError(f"{self._name}.write_tree: {len(par)} parents for {n} rows")
        pos = np.arange(int(n_past), int(n_past) + n, dtype=np.int64)  # each node's ring position
        prepared = self._prepare_write(seq, pos, a)
        slots = self.stager.process_tree(seq, n_past, par, tokens=tokens)
        self._store_write(a, slots, prepared)
        return slots

    def accept_path(self, seq: int, nodes: Any) -> SlotMoves:
        """``stager.accept_path(seq, nodes)`` and apply its moves (safe from several threads)."""
        with self._lock:
            self._require_applied("accept_path")
            moves = self.stager.accept_path(seq, nodes)
            self.apply(moves)
        return moves

    def accept_path_many(self, seqs: Any, cu_seqlens: Any, nodes: Any) -> SlotMoves:
        """``stager.accept_path_many(seqs, cu_seqlens, nodes)`` and apply its moves (safe from several threads)."""
        with self._lock:
            self._require_applied("accept_path_many")
            moves = self.stager.accept_path_many(seqs, cu_seqlens, nodes)
            self.apply(moves)
        return moves

    # -- snapshots --------------------------------------------------------
    def snapshot(self, seq: int) -> tuple[bytes, Any]:
        """``(stager.snapshot(seq), rows)``: the bookkeeping and a copy of the sequence's
        stageable rows, ``(n, row_bytes)`` uint8 in the owner's storage. Restore both
        with :meth:`restore`, on this owner or another one of the same configuration."""
        data = self.stager.snapshot(seq)
        return data, self._copy_out(self.stager.live_slots(seq))

    def restore(self, seq: int, data: Any, rows: Any) -> np.ndarray:
        """``stager.restore(seq, data)`` and copy ``rows`` (from :meth:`snapshot`) into the
        slots it returns. Bad data, or rows of the wrong shape, raise before anything changes."""
        r = self._snapshot_rows(rows, self.stager.check_restore(seq, data))  # the core's reading of the data
        with self._lock:  # the restore and its copies, in serial order among the table changes
            self._require_applied("restore")
            slots = self.stager.restore(seq, data)
            if len(slots):
                self._next_change(slots, "restore")
                self._copy_in(slots, r)
                self._moves_applied = slots.serial
        return slots

    # -- the table: implemented by each owner -------------------------------
    def _input_rows(self, rows: Any, in_dtype: Any, fn: str, lead: tuple[int, ...] | None) -> Any:
        """The rows as the owner's array view (with ``.shape``), dtype and shape checked:
        (n, feature_dim) when ``lead`` is None, else a batch's (see _check_row_shape)."""
        raise NotImplementedError

    def _prepare_write(self, seq: Any, pos: np.ndarray, a: Any) -> Any:
        """Before the Stager is called: under ``nonfinite="error"`` raise
        :meth:`_unstageable` for the first row that cannot be staged; returns
        what :meth:`_store_write` needs."""
        raise NotImplementedError

    def _store_write(self, a: Any, slots: np.ndarray, prepared: Any) -> None:
        """Encode the rows whose slot is >= 0 into their slots."""
        raise NotImplementedError

    def _prepare_batch_write(self, seqs: np.ndarray, pos: np.ndarray, a: Any) -> Any:
        """:meth:`_prepare_write` for the rows of many sequences (``seqs``: each row's)."""
        return self._prepare_write(seqs, pos, a)

    def _store_batch_write(self, a: Any, slots: np.ndarray, prepared: Any) -> None:
        """:meth:`_store_write` for the rows of many sequences."""
        self._store_write(a, slots, prepared)

    def _gather_plans(self, slots: np.ndarray, n: int, odt: np.dtype, out: Any, batch: bool) -> Any:
        """Decode the rows at ``slots`` (n of them) into ``out`` (n, feature_dim) of ``odt``; ``batch``:
        they are a whole BatchPlan's (a device owner moves them in one launch)."""
        raise NotImplementedError

    def _batch_slots(self, slots: Any, fn: str, status: Any, distinct: bool) -> Any:
        """A batch's slots (checked as far as the form allows, see write_slots; ``distinct``:
        a write's)."""
        raise NotImplementedError

    def _host_slots(self, s: Any) -> np.ndarray | None:
        """The host copy of a batch's slots (:meth:`_batch_slots`' result), None when it has none."""
        raise NotImplementedError

    def _scatter(self, s: Any, a: Any, status: Any, fn: str) -> None:
        raise NotImplementedError

    def _gather_slots(self, s: Any, out: Any, dtype: Any, status: Any, fn: str) -> Any:
        raise NotImplementedError

    def _status_words(self, status: Any) -> np.ndarray:
        """The two status words as uint64 (after the batch that wrote them)."""
        raise NotImplementedError

    def _copy_moves(self, moves: list[list[int]]) -> None:
        """Copy table rows ``[src, src + m)`` to ``[dst, dst + m)``, in order."""
        raise NotImplementedError

    def _copy_out(self, slots: np.ndarray) -> Any:
        """A new ``(len(slots), row_bytes)`` uint8 array of the rows at ``slots``."""
        raise NotImplementedError

    def _snapshot_rows(self, rows: Any, n: int) -> Any:
        """``rows`` checked as :meth:`snapshot`'s rows of ``n`` rows (ValueError otherwise)."""
        raise NotImplementedError

    def _copy_in(self, slots: np.ndarray, rows: Any) -> None:
        """Copy ``rows`` into the table at ``slots``."""
        raise NotImplementedError
