"""The reference twin of the device step (docs/protocol.md, "The device step").

The core's step (``dspark/step_math.hpp``) restates the per-sequence rules as
integer math over arrays; this twin instead runs the reference Stager's own
per-sequence operations, which is the step's definition: confirm the verify
rows the last step reserved, ``accept(a)``, ``draft(end)``, ``commit`` (the
drafter is assumed to succeed; the state before the commit is kept so that
``to_host`` can turn it into a ``fail``), and reserve the next verify rows
``[end, end + B]`` (``[end]`` after a skip). A handed-over sequence stays in
the Stager's own table; every other call on it raises ``StateError`` (the
Stager's ``_get``) until ``to_host``.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from . import arguments as arg
from ..stager.device_step import StepOutputs, StepRows
from ..errors import StateError
from .arguments import FAIL_STAGES, MAX_POSITION
from .seq import _Seq

if TYPE_CHECKING:
    from .stager import ReferenceStager

# The status words and codes, spelled out here (the oracle borrows no table of
# the core's): docs/protocol.md "The device step".
STEP_OK, STEP_NOT_IN_STEP, STEP_FIRST_ERROR = 0, 1, 16
STEP_NOT_ON_DEVICE, STEP_DUPLICATE, STEP_BAD_COUNT, STEP_POSITION_LIMIT, STEP_INTERNAL = 16, 17, 18, 19, 20
STEP_DAMAGED = 21  # only the core's step state can be damaged: this twin keeps none
STEP_REBASE, STEP_CLEAR_CACHE = 1, 2
PADDING_ID = -1  # with count -1: a fixed-capacity step's padding entry, STEP_NOT_IN_STEP
NOT_STEPPED = -1
#: A plan's skip reason -> its code in ``StepOutputs.skip``.
SKIP_CODES = {None: 0, "disabled": 1, "empty": 2, "no_context": 3, "missing_rows": 4, "drafting_off": 5}

#: The fields ``commit`` changes, which a ``fail`` reported at ``to_host`` puts back first.
_COMMIT_FIELDS = ("n_cache", "pos_base", "restage_owed", "first_round", "failures", "verify_owed")
_MODE_HINT = 'the device step plans slots: run the Stager with rows="external"'


def on_device_error(i: int) -> StateError:
    """What every host call on a handed-over sequence raises."""
    return StateError(f"sequence {i} is on the device (to_device): call to_host([{i}]) first, "
                      "which brings it back with its step state")


def _status_error(prefix: str, block: int, max_seqs: int, status: int, seq: int, value: int | None) -> Exception:
    """A status word as the core's error (``value``: a sticky fault's value, when known)."""
    if status == STEP_NOT_ON_DEVICE:
        if not 0 <= seq < max_seqs:
            return ValueError(prefix + f"unknown sequence {seq} (this Stager has sequences 0..{max_seqs - 1})")
        return StateError(prefix + f"sequence {seq} is not on the device: call to_device([{seq}]) before its steps")
    if status == STEP_DUPLICATE:
        return ValueError(prefix + f"sequence {seq} appears earlier in the same step: a step names each sequence once")
    if status == STEP_BAD_COUNT:
        got = str(value) if value is not None else "a value outside"
        return ValueError(prefix + f"n_accepted must be in [0, {block}] (or -1: not in this step), got {got}; "
                          "that step changed nothing for the sequence")
    if status == STEP_POSITION_LIMIT:
        at = str(value) if value is not None else "end"
        return ValueError(prefix + f"the verify rows after position {at} would pass 2**62 - 1; that step changed "
                          "nothing for the sequence")
    if status == STEP_DAMAGED:
        return ValueError(prefix + "the step state is damaged (a rule is broken); the step changed nothing for the "
                          "sequence: end it, or copy back a state a step wrote")
    if status == STEP_INTERNAL:
        return RuntimeError(prefix + "dspark internal error: a device step found the staged rows not buffered "
                            f"(status {status}); that step changed nothing for the sequence")
    return ValueError(prefix + f"status {status} is not a status word of the device step (0, 1 or 16..{STEP_DAMAGED})")


class DeviceStepMixin:
    """``to_device`` / ``to_host`` / ``step_many`` / ``check_step`` of :class:`ReferenceStager`."""

    def _device(self) -> dict[int, _Seq | None]:
        """Handed-over sequences -> the state before their last step's commit (None: no open round)."""
        return self.__dict__.setdefault("_device_pending", {})

    def _handovers(self) -> dict[int, _Seq]:
        """Handed-over sequences -> the sequence as handed over (what totals() counts until to_host)."""
        return self.__dict__.setdefault("_device_handovers", {})

    def _handed_over(self, i: int) -> _Seq | None:
        """Sequence ``i`` as it was handed over, or None when it is on the host."""
        return self._handovers().get(i)

    def _stepped(self) -> set[int]:
        """Handed-over sequences whose reservation is a step's (the host's, handed over, saved
        the slot ids a long reservation displaced; a step's saves none)."""
        return self.__dict__.setdefault("_device_stepped", set())

    def _faults(self) -> dict[int, tuple[int, int]]:
        """Sticky faults of handed-over sequences: (status, value)."""
        return self.__dict__.setdefault("_device_faults", {})

    def on_device(self, seq: int) -> bool:
        return cast("ReferenceStager", self)._known_id(seq) in self._device()

    def _table_size(self) -> int:
        ref = cast("ReferenceStager", self)
        return len(ref._seqs) * ref.ring_rows

    def new_token_table(self) -> np.ndarray:
        """A slot token table (int32, one id per global slot, all -1)."""
        return np.full(self._table_size(), -1, np.int32)

    def _slot_ids(self, q: int, st: _Seq, every: bool = False) -> list[tuple[int, int, dict[int, int]]]:
        """A chain drafter's ids travel by slot: (position, global slot, the ids' dict) of the
        rows a later call may read, the stageable rows [horizon, end) and, with a
        reservation, those of the sequence before it. A slot holds one id: where a long
        reservation's row took the slot of a row before it, the reservation's id travels and
        the row before keeps its own (the core's saved slot ids put it back on cancel);
        ``every``: that row listed too (at the same slot), as the core's to_host checks it."""
        ref = cast("ReferenceStager", self)
        base = q * ref.ring_rows
        out = []
        taken: set[int] = set()
        for x in (st, st.reservation):
            if x is None or not x.started:
                continue
            mine = []
            for p, g in zip(range(x.horizon, x.end), x.ring.slots(x.horizon, x.end, base)):
                if every or g not in taken:
                    mine.append((p, g, x.tokens))
            taken.update(g for _, g, _ in mine)
            out += mine
        return out

    @staticmethod
    def _uncommit(st: _Seq, pending: _Seq | None) -> None:
        """Undo this twin's early commit of the round the last step opened (the core keeps it
        open until the next step): ``st`` and its reservation as the core's step state holds them."""
        if pending is None:
            return
        for x in (st, st.reservation):
            if x is not None:
                for name in _COMMIT_FIELDS:
                    setattr(x, name, getattr(pending, name))
                x.stats["commits"] = pending.stats["commits"]
                x.open_round = pending.open_round

    def _metrics_seq(self, i: int) -> _Seq:
        """Sequence ``i`` as its metrics read it: a handed-over one's as its steps made it (live)."""
        ref = cast("ReferenceStager", self)
        device = self._device()
        if i not in device:
            return ref._seqs[i]
        st = copy.deepcopy(ref._seqs[i])
        self._uncommit(st, device[i])
        return st

    def _leave_step(self, i: int) -> None:
        """``end`` of a handed-over sequence: it leaves the step as ``end`` finds it on the
        host: an open round dropped (the early commit undone: counted in rounds, not in
        commits), a reservation kept for ``end`` to count as before it."""
        device = self._device()
        if i not in device:
            return
        pending = device.pop(i)
        self._handovers().pop(i, None)
        self._stepped().discard(i)
        self._faults().pop(i, None)
        self._uncommit(cast("ReferenceStager", self)._seqs[i], pending)

    def to_device(self, seqs: Any, tokens: Any = None) -> None:
        ref = cast("ReferenceStager", self)
        call = "to_device"
        ids = arg.seq_ids(call, seqs)
        table = arg.token_table(call, tokens, True)
        ref._check_ids(call, ids)
        if not ref._external:
            raise ValueError(f"{call} needs external-row mode, but this Stager holds its rows ({_MODE_HINT})")
        arg.check_token_table(call, ref._chain, table, self._table_size())
        device = self._device()
        for k, q in enumerate(ids.tolist()):
            st = ref._seqs[q]
            at = arg.batch_context(call, k, q)
            if q in device:
                raise StateError(at + f"sequence {q} is on the device already")
            if not st.started:
                raise StateError(at + f"sequence {q} holds no rows: process its prompt (process_external) before "
                                 "to_device")
            if st.tree is not None:
                raise StateError(at + f"sequence {q} holds a tree verify batch (the device step verifies linear "
                                      "batches): call accept_path before to_device")
        arg.unique(call, ids)
        for q in ids.tolist():
            st = ref._seqs[q]
            self._handovers()[q] = copy.deepcopy(st)
            self._stepped().discard(q)
            if table is not None:  # the ids at their rows' slots, -1 at the sequence's others
                table[q * ref.ring_rows:(q + 1) * ref.ring_rows] = -1
                for p, g, kept in self._slot_ids(q, st):
                    table[g] = kept[p]
            pending = None
            if st.open_round is not None:  # the next step commits it: now, keeping the state before
                pending = copy.deepcopy(st)
                ref._commit_checked(st)
            device[q] = pending

    def to_host(self, seqs: Any, outcomes: Any = None, tokens: Any = None) -> np.ndarray:
        ref = cast("ReferenceStager", self)
        call = "to_host"
        ids = arg.seq_ids(call, seqs)
        n = len(ids)
        codes = [-1] * n
        if outcomes is not None:
            items = list(outcomes)
            if len(items) != n:
                raise ValueError(f"{call}: {n} sequences for {len(items)} outcomes")
            for k, o in enumerate(items):
                if o is None:
                    codes[k] = -1
                elif isinstance(o, str):
                    try:
                        codes[k] = FAIL_STAGES.index(arg.fail_stage(o, "outcome"))
                    except ValueError as exc:
                        raise ValueError(arg.batch_context(call, k, int(ids[k])) + str(exc)) from None
                else:
                    codes[k] = min(max(arg.integer("outcome", o), -(2**31)), 2**31 - 1)  # int32, as the core's
        table = arg.token_table(call, tokens, False)
        ref._check_ids(call, ids)
        arg.check_token_table(call, ref._chain, table, self._table_size())
        device = self._device()
        for k, q in enumerate(ids.tolist()):
            if q not in device:
                raise StateError(arg.batch_context(call, k, q) + f"sequence {q} is not on the device (to_device)")
        arg.unique(call, ids)
        for k, q in enumerate(ids.tolist()):
            at = arg.batch_context(call, k, q)
            if codes[k] != -1 and not 0 <= codes[k] < len(FAIL_STAGES):
                raise ValueError(at + "outcome must be -1 (the drafter ran: commit) or a fail stage code (0: decode, "
                                 f"1: crop), got {codes[k]}")
            if codes[k] != -1 and device[q] is None:
                raise StateError(at + f"sequence {q} has no open round to fail (its last step skipped, or it was never "
                                 "stepped)")
        disabled = np.zeros(n, np.int64)
        # Each round resolved by its outcome, on copies (nothing changes until every check passed).
        resolved = []
        for k, q in enumerate(ids.tolist()):
            st, pending = copy.deepcopy(ref._seqs[q]), device[q]
            if codes[k] != -1 and pending is not None:
                for x in (st, st.reservation):
                    if x is None:
                        continue
                    for name in _COMMIT_FIELDS:
                        setattr(x, name, getattr(pending, name))
                    x.stats["commits"] = pending.stats["commits"]
                    x.open_round = pending.open_round
                    now = ref._fail_checked(x)
                    if x is st and now:
                        disabled[k] = st.failures
            resolved.append(st)
        if table is not None:
            for k, q in enumerate(ids.tolist()):
                self._check_slot_ids(call, k, q, resolved[k], table)
        faults = self._faults()
        faulted: tuple[int, int, tuple[int, int]] | None = None
        for k, q in enumerate(ids.tolist()):
            device.pop(q)
            self._handovers().pop(q)
            stepped = q in self._stepped()
            self._stepped().discard(q)
            st = ref._seqs[q] = resolved[k]
            if table is not None:
                x = st.reservation
                if x is not None and not stepped:  # a host reservation's displaced rows keep their ids
                    travels = {p for p, _, kept in self._slot_ids(q, st) if kept is x.tokens}
                    x.tokens = {p: t for p, t in x.tokens.items() if x.horizon <= p < x.end and p not in travels}
                elif x is not None:
                    x.tokens = {}
                st.tokens = {}
                for p, g, kept in self._slot_ids(q, st, every=stepped):
                    kept[p] = int(table[g])
            fault = faults.pop(q, None)
            if fault is not None and faulted is None:
                faulted = (k, q, fault)
        if faulted is not None:
            k, q, (status, value) = faulted
            prefix = arg.batch_context(call, k, q) + f"sequence {q} is back on the host, but one of its device " \
                "steps failed: "
            raise _status_error(prefix, ref.config.block_size, len(ref._seqs), status, q, value)
        return disabled

    def _check_slot_ids(self, call: str, k: int, q: int, st: _Seq, table: np.ndarray) -> None:
        """The ids of the rows that come back are written (>= 0), but for the reservation's own
        rows (the last step's verify rows): a round whose drafter failed builds no verify
        batch, and confirm refuses them."""
        unwritten_from = st.reservation.end if st.reservation is not None else st.end
        for p, g, _ in self._slot_ids(q, st, every=True):
            if table[g] < 0 and p < unwritten_from:
                raise ValueError(arg.batch_context(call, k, q) + f"the slot token table holds {int(table[g])} at slot "
                                 f"{g}, the row of position {p}: write each verify row's token id at its verify slot "
                                 "before the next step (docs/protocol.md, the device step); nothing was brought back")

    def step_many(self, seqs: Any, n_accepted: Any, out: StepOutputs | None = None) -> StepOutputs:
        ref = cast("ReferenceStager", self)
        call = "step_many"
        if not ref._external:
            raise ValueError(f"{call} needs external-row mode, but this Stager holds its rows ({_MODE_HINT})")
        ids = arg.seq_ids(call, seqs)
        counts = arg.batch_ints(call, "n_accepted", n_accepted, len(ids))
        c = ref.config
        max_rows = c.window - c.block_size
        if out is None:
            out = StepOutputs.empty(len(ids), max_rows, c.block_size)
        else:
            out.check(len(ids), max_rows, c.block_size)
        if len(out.status) > len(ids):  # a fixed-capacity step: the entries past the batch are padding
            pad = len(out.status) - len(ids)
            ids = np.concatenate([ids, np.full(pad, PADDING_ID, np.int64)])
            counts = np.concatenate([counts, np.full(pad, -1, np.int64)])
        seen: set[int] = set()
        for k, (q, a) in enumerate(zip(ids.tolist(), counts.tolist())):
            dup = q in seen
            if 0 <= q < len(ref._seqs):
                seen.add(q)
            self._nothing(out, k)
            out.status[k] = self._step_entry(out, k, q, a, dup)
        return out

    @staticmethod
    def _nothing(out: StepOutputs, k: int) -> None:
        out.skip[k] = NOT_STEPPED
        out.flags[k] = 0
        out.n_rows[k] = 0
        for name in ("start", "pos_base", "crop_from"):
            getattr(out, name)[k] = -1
        for name in ("row_slots", "row_positions", "block_positions", "verify_slots"):
            arr = getattr(out, name)
            if arr is not None:
                arr[k, :] = -1

    def _step_entry(self, out: StepOutputs, k: int, q: int, a: int, dup: bool) -> int:
        ref = cast("ReferenceStager", self)
        c = ref.config
        device, faults = self._device(), self._faults()
        if q == PADDING_ID and a == -1:
            return STEP_NOT_IN_STEP
        if not 0 <= q < len(ref._seqs):
            return STEP_NOT_ON_DEVICE
        if dup:
            return STEP_DUPLICATE
        if q not in device:
            return STEP_NOT_ON_DEVICE
        if q in faults:
            return faults[q][0]
        if a == -1:
            return STEP_NOT_IN_STEP
        if not -1 <= a <= c.block_size:
            faults[q] = (STEP_BAD_COUNT, a)
            return STEP_BAD_COUNT
        st = copy.deepcopy(ref._seqs[q])  # a step that fails changes nothing
        rounds = ref._rounds
        st.reservation = None  # confirm
        ref._accept_checked(st, a)
        try:
            plan = ref._draft_checked(q, st, st.end, ids=False)
        except AssertionError:
            ref._rounds = rounds
            faults[q] = (STEP_INTERNAL, ref._seqs[q].end)
            return STEP_INTERNAL
        pending = None
        if plan.skip is None:
            pending = copy.deepcopy(st)
            ref._commit_checked(st)
        n_verify = c.block_size + 1 if plan.skip is None else 1
        if st.end + n_verify > MAX_POSITION - 1:
            ref._rounds = rounds
            faults[q] = (STEP_POSITION_LIMIT, st.end)
            return STEP_POSITION_LIMIT
        slots = ref._reserve_checked(q, st, np.arange(st.end, st.end + n_verify, dtype=np.int64))
        self._stepped().add(q)
        ref._seqs[q] = st
        device[q] = pending
        out.skip[k] = SKIP_CODES[plan.skip]
        out.flags[k] = (STEP_REBASE if plan.rebase else 0) | (STEP_CLEAR_CACHE if plan.clear_cache else 0)
        out.start[k] = plan.start
        out.pos_base[k] = plan.pos_base if plan.skip is None else -1
        out.crop_from[k] = plan.crop_from if plan.skip is None else -1
        out.n_rows[k] = len(plan.slots) if plan.skip is None else 0
        if plan.skip is None:
            m = len(plan.slots)
            if out.row_slots is not None:
                out.row_slots[k, :m] = plan.slots
            if out.row_positions is not None:
                out.row_positions[k, :m] = plan.positions
            out.block_positions[k, :] = plan.block_positions
        out.verify_slots[k, : len(slots)] = slots
        return STEP_OK

    def step_rows(self, seqs: Any, out: StepOutputs, rows: StepRows | None = None) -> StepRows:
        """The CSR rows of the batch the last ``step_many(seqs, ..., out=out)`` stepped, from
        the sequences' own rings: entry i's drafted rows ``[start - n_rows, start)`` where the
        ring still holds them (else, and for an entry not stepped or skipped, none)."""
        ref = cast("ReferenceStager", self)
        call = "step_rows"
        if not ref._external:
            raise ValueError(f"{call} needs external-row mode, but this Stager holds its rows ({_MODE_HINT})")
        ids = arg.seq_ids(call, seqs)
        c = ref.config
        max_rows = c.window - c.block_size
        if not isinstance(out, StepOutputs):
            raise TypeError(f"{call}: out must be a StepOutputs, got {type(out).__name__}")
        out.checked_plan_arrays(len(ids))
        if rows is None:
            rows = StepRows.empty(out.capacity, max_rows)
        rows.check(len(ids), max_rows)
        device, faults = self._device(), self._faults()
        total = 0
        for k, q in enumerate(ids.tolist()):
            rows.row_offsets[k] = total
            n, start, base = int(out.n_rows[k]), int(out.start[k]), int(out.pos_base[k])
            if (not 0 <= q < len(ref._seqs) or q not in device or q in faults or out.status[k] != STEP_OK
                    or out.skip[k] != 0 or not 0 < n <= max_rows or not 0 <= base <= start - n
                    or start - base > c.window):
                continue
            ring = ref._seqs[q].ring
            lo = start - n
            if ring.cap == 0 or lo < ring.head or start > ring.end:
                continue
            if rows.row_slots is not None:
                rows.row_slots[total:total + n] = ring.slots(lo, start, q * ref.ring_rows)
            if rows.row_positions is not None:
                rows.row_positions[total:total + n] = np.arange(lo - base, start - base)
            total += n
        rows.row_offsets[len(ids):] = total
        return rows

    def check_step(self, seqs: Any, statuses: Any) -> None:
        ref = cast("ReferenceStager", self)
        ids = arg.seq_ids("check_step", seqs)
        arr = np.asarray(statuses, np.int32)
        if arr.ndim != 1 or len(arr) != len(ids):
            raise ValueError(f"check_step: {len(ids)} sequences for statuses of shape {arr.shape}")
        for k, (q, s) in enumerate(zip(ids.tolist(), arr.tolist())):
            if s >= STEP_FIRST_ERROR or s not in (STEP_OK, STEP_NOT_IN_STEP):
                raise _status_error(arg.batch_context("step_many", k, q), ref.config.block_size, len(ref._seqs),
                                    s, q, None)
