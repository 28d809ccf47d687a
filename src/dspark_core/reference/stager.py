"""The pure-Python reference stager: the executable form of docs/design.md section 2.

:class:`ReferenceStager` has the same API as :class:`dspark_core.Stager` and
is written to be obviously correct rather than fast: rows live in a dict keyed
by absolute position, every rule is spelled out where it applies, and the
row formats come from numpy / ml_dtypes / gguf-py (``reference.formats``).
It is the oracle the C++ core is tested against, op for op.

State of one sequence (all positions absolute):

* ``end``: the next position ``process`` expects (last buffered + 1).
* ``horizon``: the oldest position that can still be staged. Rows below it
  are gone (the core drops them lazily in ``TRIM_CHUNK`` chunks; here at
  once). It only moves forward, except on ``rollback`` / ``shift``, and is
  recomputed by :meth:`_advance_horizon` after every change.
* ``n_cache`` / ``pos_base``: the drafter cache holds rows
  ``[pos_base, n_cache)`` at drafter positions ``[0, n_cache - pos_base)``.
* ``restage_owed``: the drafter cache is unknown (after ``fail``, a rollback
  into it, ``fork``, ``shift``, ``restore``): the next round rebases.
* ``tentative``: rows appended since the last draft (or accept) that
  ``accept`` may still drop. Once more than ``B + 1`` such rows arrive (no
  verify batch is larger) they are final and ``accept`` is a no-op until the
  next draft; before the first draft after ``begin`` rows are final too.

Horizon rule (what keeps memory bounded while prompts are far longer than
the window, without ever changing what a later round stages). With ``f`` the
firm end (the smallest end an ``accept`` can leave), the last ``W`` positions
before ``f`` stay stageable::

    horizon = max(horizon, f - W)

A later round never needs more: a rebase stages rows ``>= start - K`` and a
plain round rows ``>= n_cache >= pos_base > f + B - W``. Keeping ``W`` rather
than ``K`` rows is what lets a rollback of up to ``W - K`` positions (a
regenerate, an edited message) restage a full ``K``-row context. Live rows
stay ``<= W + B`` (plus the dead head below the horizon that the core has not
trimmed yet: fewer than ``TRIM_CHUNK`` rows), inside ``W + TRIM_CHUNK + B + 1``.

Ring bookkeeping: the rows themselves are dropped here at once, but the
counters ``rows``, ``peak_rows``, ``trims`` and ``trimmed_rows`` are the
core's, computed from a ``head`` position that moves as the core's ring head
does (``_trim``: lazily, once ``horizon - head >= TRIM_CHUNK``; before a
prefill chunk that does not fit beside the held rows; never for input rows
below the new horizon, which the core does not store at all). The core holds
``[head, end)``; its counters are compared with these exactly.

Slots. Besides the rows, each sequence drives a :class:`RingModel`: the
core's ring bookkeeping (head, head slot, count, capacity) at the same points
the core changes its ring, with the same lazy ``TRIM_CHUNK`` trim. It gives
every plan's ``slots`` and the moves ``fork`` / ``shift`` return, in both row
modes; in external-row mode (``rows="external"``) it is all the reference
keeps of the rows, and ``process`` returns the slots to write.

Batches (``process_many``, ``accept_many``, ``draft_many``, ``commit_many``,
``fail_many``, ``reserve_many``, ``confirm_many``, ``cancel_many``,
``end_many``, ``open_round_ids``) do for each sequence what its per-sequence
call does, after checking the whole batch (see "batches" below): a rejected
batch changes nothing. A reservation (``reserve``, external-row mode) is
``process`` with the sequence held until ``confirm`` (nothing more to do) or
``cancel`` (the sequence as it was before, put back whole); ``end`` makes a
sequence, whatever its state, as a new Stager's.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import numpy as np

from . import arguments as arg
from . import formats as rf
from ..stager import snapshot_format
from ..stager.config import StagerConfig
from ..errors import StateError
from ..rows.slot_moves import RestoredSlots, SlotMoves, no_moves
from ..stager.stage_plan import BatchPlan, StagePlan
from .config import check_config
from .arguments import DISABLED_WARNING, FAIL_STAGES, MISMATCH_WARNING, TRIM_CHUNK
from .batch_plan import batch_plan
from .device_step import DeviceStepMixin, on_device_error
from .ring import RingModel
from .seq import ANY, OPEN, READY, RESERVED, SEMANTIC_STATS, TREE, _Seq
from .tree import TreeVerifyMixin
from ..stager.pickling import reduce_stager
from ..stager.totals import StagerTotals

__all__ = ["ReferenceStager", "FAIL_STAGES"]

logger = logging.getLogger("dspark_core")



#: How ``totals()`` combines the fields over sequences (spelled out here, not
#: read from the core): gauges over the sequences now, peaks as the largest;
#: every other field is a counter over every sequence since the Stager was made.
_TOTAL_GAUGES = ("rows", "live_rows")
_TOTAL_PEAKS = ("peak_rows",)


def _moves(src_slots: list[int], dst_slots: list[int]) -> np.ndarray:
    """Slot pairs (one per row, in order) as (n, 3) int64 moves of consecutive runs."""
    runs: list[list[int]] = []
    for a, b in zip(src_slots, dst_slots):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return np.array(runs, np.int64).reshape(len(runs), 3)


def _ring_runs(enc: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, ...]:
    """A ``copy=False`` plan's rows as the core's ring holds them: a new run wherever the
    next row's slot is not the one after the previous row's (the ring wrapped)."""
    runs: list[list[int]] = []
    for i, slot in enumerate(slots.tolist()):
        if not runs or slot != slots[i - 1] + 1:
            runs.append([])
        runs[-1].append(i)
    return tuple(enc[r[0]: r[-1] + 1] for r in runs)


class ReferenceStager(DeviceStepMixin, TreeVerifyMixin):
    """Pure-Python twin of :class:`dspark_core.Stager` (same API, same results)."""

    def __init__(self, config: StagerConfig) -> None:
        if not isinstance(config, StagerConfig):
            raise TypeError(f"config must be a StagerConfig, got {type(config).__name__}")
        check_config(config)  # the twin's own rules (a StagerConfig met the core's)
        self.config = config
        self._external = config.rows == "external"
        self._chain = config.kind == "chain"
        self._strict = config.strict
        self._w_keep = min(config.window // 2, config.window - config.block_size)
        self._ring_rows = config.window + TRIM_CHUNK + config.block_size + 1
        self._row_bytes = rf.row_bytes(config.storage, config.feature_dim)
        self._warned: set[int] = set()  # sequences whose protocol mismatch was logged (until begin)
        # What a snapshot must match (the header's fields, the format's codes).
        self._fingerprint = (
            config.feature_dim, rf.STORAGES.index(config.storage), config.window, config.block_size,
            self._row_bytes, arg.NONFINITE_POLICIES.index(config.nonfinite), arg.STAGE_DTYPES.index(config.stage_dtype),
        )
        self._rounds = 0  # rounds opened: plan.round
        self.moves_issued = 0  # table changes numbered: moves of fork / shift, external restores
        self.last_change = ""  # the call that issued the newest one
        self._changed = [0] * int(config.max_seqs)  # per sequence: the newest change into or out of its slots
        self._seqs = [self._new_seq(RingModel(self._ring_rows)) for _ in range(config.max_seqs)]
        # The counters and histogram of the sequences whose stats were reset (totals()).
        self._retired: dict[str, int] = dict.fromkeys(SEMANTIC_STATS, 0)
        self._retired_accepted = [0] * (config.block_size + 1)

    @property
    def w_keep(self) -> int:
        """Rows kept on a rebase (``K = min(W // 2, W - B)``)."""
        return self._w_keep

    @property
    def ring_rows(self) -> int:
        """Ring slots per sequence (``W + TRIM_CHUNK + B + 1``)."""
        return self._ring_rows

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle / deepcopy as the core does: the config plus every sequence's snapshot."""
        return reduce_stager(self)

    def __repr__(self) -> str:
        c = self.config
        return (f"ReferenceStager(feature_dim={c.feature_dim}, block_size={c.block_size}, window={c.window}, "
                f"max_seqs={c.max_seqs}, storage={c.storage!r})")

    # -- helpers --------------------------------------------------------
    def _new_seq(self, ring: RingModel, **fields: Any) -> _Seq:
        """A sequence as begin() leaves it (or with ``fields``), on ``ring``."""
        return _Seq(ring=ring, accepted=[0] * (self.config.block_size + 1), **fields)

    @staticmethod
    def _settled(st: _Seq) -> _Seq:
        """What totals() count of a sequence: itself, or as before its open reservation
        (cancel puts those counters back; confirm makes them the sequence's)."""
        return st.reservation if st.reservation is not None else st

    def _reset_seq(self, i: int, new: _Seq) -> None:
        """Put ``new`` in slot ``i``, keeping the old sequence's counters for totals()."""
        self._add_stats(self._retired, self._stats_of(self._settled(self._seqs[i])), gauges=False)
        self._retired_accepted = [a + b for a, b in zip(self._retired_accepted, self._seqs[i].accepted)]
        self._seqs[i] = new

    @staticmethod
    def _add_stats(to: dict[str, int], now: dict[str, int], gauges: bool) -> None:
        """``to += now`` as totals combine sequences: the peaks take the larger; the gauges add
        only for a sequence now (``gauges``), never for an ended one's kept counters."""
        for name in SEMANTIC_STATS:
            if name in _TOTAL_PEAKS:
                to[name] = max(to[name], now[name])
            elif gauges or name not in _TOTAL_GAUGES:
                to[name] += now[name]

    def _get(self, seq: Any) -> _Seq:
        """Sequence ``seq`` on the host: its id first, then that it is not handed over."""
        i = self._known_id(seq)
        self._on_host(i)
        return self._seqs[i]

    def _known_id(self, seq: Any) -> int:
        """The id ``seq`` of a sequence of this Stager (the core's ``get``)."""
        i = arg.integer("seq", seq)
        if not 0 <= i < len(self._seqs):
            raise arg.unknown_sequence(i, len(self._seqs))
        return i

    def _on_host(self, i: int) -> None:
        """The first state check (the core's ``refuse_on_device``): a handed-over sequence's
        state is the device step's (device_step.py) until ``to_host``."""
        if i in self._device():
            raise on_device_error(i)

    def _closed(self, seq: Any) -> tuple[int, _Seq]:
        st = self._get(seq)
        i = arg.integer("seq", seq)
        self._need(i, st, READY)
        return i, st

    @staticmethod
    def _need(i: int, st: _Seq, need: str) -> None:
        """The state check of every call (after the id's): ``need`` is READY, OPEN, RESERVED, ANY or TREE."""
        if need == ANY:
            return
        if st.reservation is not None and need != RESERVED:
            raise StateError(f"sequence {i} has reserved rows: call confirm() or cancel() first")
        if need == READY and st.open_round is not None:
            raise StateError(f"sequence {i} has an open round: call commit() or fail() first")
        if need == READY and st.tree is not None:
            raise StateError(f"sequence {i} holds a tree verify batch: call accept_path() first")
        if need == TREE and st.tree is None:
            raise StateError(f"sequence {i} holds no tree verify batch (call process_tree() first)")
        if need == OPEN and st.open_round is None:
            raise StateError(f"sequence {i} has no open round (call draft() first)")
        if need == RESERVED and st.reservation is None:
            raise StateError(f"sequence {i} has no reserved rows (call reserve() first)")

    def _firm_end(self, st: _Seq) -> int:
        if st.accept_open and st.tentative > 0:
            return st.end - st.tentative + 1  # accept keeps at least one row
        return st.end

    def _advance_horizon(self, st: _Seq) -> None:
        self._update_horizon(st)
        self._trim_ring(st)
        if st.started and st.horizon - st.head >= TRIM_CHUNK:  # the core's lazy trim (counters)
            self._trim(st, st.horizon, st.end)
        self._note_size(st)

    def _trim_ring(self, st: _Seq) -> None:
        """The core's lazy trim on the ring model: dead head rows leave a chunk at a time."""
        if st.started and st.horizon - st.ring.head >= TRIM_CHUNK:
            st.ring.drop_front(st.horizon)

    def _update_horizon(self, st: _Seq) -> None:
        if not st.started:
            return
        need = self._firm_end(st) - self.config.window
        if need > st.horizon:
            st.horizon = need
        for p in [p for p in st.rows if p < st.horizon]:
            del st.rows[p]
        for p in [p for p in st.tokens if p < st.horizon]:
            del st.tokens[p]

    @staticmethod
    def _trim(st: _Seq, new_head: int, buf_end: int) -> None:
        """The core's head drop (bookkeeping): the ring ``[head, buf_end)`` loses rows below ``new_head``."""
        new_head = min(max(new_head, st.head), buf_end)
        if new_head > st.head:
            st.stats["trims"] += 1
            st.stats["trimmed_rows"] += new_head - st.head
            st.head = new_head

    @staticmethod
    def _note_size(st: _Seq) -> None:
        st.stats["rows"] = st.end - st.head if st.started else 0
        st.stats["peak_rows"] = max(st.stats["peak_rows"], st.stats["rows"])
        # Two models of the core's ring head (the counters' and the slots'): they must agree.
        assert not st.started or st.head == st.ring.head, (st.head, st.ring.head)

    def _encode(self, seq: int, positions: np.ndarray, rows: np.ndarray) -> np.ndarray:
        c = self.config
        if c.nonfinite == "error":
            # Overflow included: the value must stay finite once stored and staged.
            self._check_stageable(seq, positions, rows.astype(np.float32), rf.bounds(c.storage, c.stage_dtype)[0])
        enc = rf.encode(rows, c.storage, "keep" if c.nonfinite == "error" else c.nonfinite, c.stage_dtype)
        return np.ascontiguousarray(enc).view(np.uint8).reshape(len(rows), self._row_bytes)

    def _check_stageable(self, seq: int, positions: np.ndarray, values: np.ndarray, limit: float) -> None:
        """Raise unless every value is below ``limit`` in magnitude (NaN never is)."""
        with np.errstate(invalid="ignore"):
            bad = np.argwhere(~(np.abs(values) < np.float32(limit)))
        if len(bad):
            r, ch = (int(v) for v in bad[0])
            c = self.config
            raise arg.unstageable(seq, int(positions[0]), r, ch, float(values[r, ch]), c.storage, c.stage_dtype,
                                  rf.bounds(c.storage, c.stage_dtype)[0])

    def _decode(self, encoded: np.ndarray) -> np.ndarray:
        c = self.config
        if len(encoded) == 0:
            return np.zeros((0, c.feature_dim), c.numpy_stage_dtype)
        return rf.decode(encoded, c.storage, c.feature_dim, c.numpy_stage_dtype)

    # -- round protocol -------------------------------------------------
    def begin(self, seq: int) -> None:
        """Reset ``seq`` for a new request (re-enables a disabled sequence)."""
        i, old = self._closed(seq)
        old.ring.reset(0)  # the core keeps the ring (and its capacity) of a reused slot
        self._reset_seq(i, self._new_seq(old.ring))
        self._warned.discard(i)  # the next mismatch of this sequence is logged again

    def process(self, seq: int, positions: Any, rows: Any = None, tokens: Any = None) -> np.ndarray | None:
        """Buffer the target's capture rows at absolute ``positions``.

        External-row mode: no rows; returns the slot of each row (-1 below
        the horizon). ``tokens``: a chain drafter's ids, one per row.
        """
        i, st = self._closed(seq)
        arg.rows_given(self._external, rows)
        pos = arg.positions(positions)
        if self._external:
            ids = arg.tokens("", tokens, len(pos))
            self._check_positions(i, st, pos)
            arg.check_tokens("", self._chain, ids, len(pos))
            if len(pos) == 0:
                return np.zeros(0, np.int64)
            return np.array(self._append(i, st, int(pos[0]), None, len(pos), ids), np.int64)
        arr = arg.rows(rows, self.config.feature_dim)
        if arr.shape[0] != len(pos):
            raise ValueError(f"{len(pos)} positions for {arr.shape[0]} rows")
        ids = arg.tokens("", tokens, len(pos))
        self._check_positions(i, st, pos)
        arg.check_tokens("", self._chain, ids, len(pos))
        if len(pos) == 0:
            return None
        self._append(i, st, int(pos[0]), self._encode(i, pos, arr), len(pos), ids)
        return None

    def tokens(self, seq: int, start: int, stop: int) -> np.ndarray:
        """The token ids kept beside the rows of ``[start, stop)`` (a chain drafter's Stager)."""
        i = arg.integer("seq", seq)
        st = self._get(seq)
        a, b = arg.integer("start", start), arg.integer("stop", stop)
        if not self._chain:
            raise ValueError('tokens: this Stager\'s drafter kind is "block"; token ids are kept for a chain '
                             'drafter (kind="chain") only')
        lo, end = (st.horizon, st.end) if st.started else (0, 0)
        if a > b or a < lo or b > end:
            raise ValueError(f"sequence {i}: tokens of positions [{a}, {b}) asked, but its stageable rows are "
                             f"[{lo}, {end})")
        return np.array([st.tokens[p] for p in range(a, b)], np.int32)

    def check_process(self, seq: int, positions: Any, tokens: Any = None) -> None:
        """What ``process(seq, positions, ..., tokens=tokens)`` checks of its sequence, positions
        and token ids, changing nothing."""
        i, st = self._closed(seq)
        pos = arg.positions(positions)
        ids = arg.tokens("", tokens, len(pos))
        self._check_positions(i, st, pos)
        arg.check_tokens("", self._chain, ids, len(pos))

    def process_encoded(self, seq: int, positions: Any, data: Any, tokens: Any = None) -> None:
        """Buffer rows already in storage format (uint8 ``(n, row_bytes)`` or flat).

        Stored as given; under ``nonfinite="error"`` rows with non-finite stored
        values (or q-block scales) are rejected, the other policies do not
        rewrite encoded rows.
        """
        i, st = self._closed(seq)
        arg.held_rows(self._external, "process_encoded")
        c = self.config
        pos = arg.positions(positions)
        n = len(pos)
        flat = arg.encoded(data, n, self._row_bytes)
        if len(flat) != n * self._row_bytes:
            raise ValueError(
                f"encoded rows must be {n} x {self._row_bytes} bytes ({c.storage}), got {len(flat)}"
            )
        ids = arg.tokens("", tokens, n)
        self._check_positions(i, st, pos)
        arg.check_tokens("", self._chain, ids, n)
        if n == 0:
            return
        enc = flat.reshape(n, self._row_bytes)
        if c.nonfinite == "error":
            # Stored bytes are staged as they are: only the staged type bounds
            # them (a q block scale that is inf / nan makes its block non-finite).
            staged = rf.decode(enc, c.storage, c.feature_dim, np.float32)
            self._check_stageable(i, pos, staged, rf.bounds("f32", c.stage_dtype)[0])
        self._append(i, st, int(pos[0]), enc.copy(), n, ids)

    def _check_positions(self, i: int, st: _Seq, pos: np.ndarray) -> None:
        arg.position_values(i, pos, st.end if st.started else None)

    def _append(self, i: int, st: _Seq, p0: int, enc: np.ndarray | None, n: int,
                ids: np.ndarray | None = None) -> list[int]:
        """Append n rows (``enc``: their bytes, None in external mode; ``ids``: their token
        ids, a chain drafter's); returns their slots."""
        c = self.config
        was_started, old_end = st.started, st.end
        held = st.end - st.head if st.started else 0
        if not st.started:
            st.started = True
            st.end = st.horizon = st.n_cache = st.pos_base = p0
        if enc is not None:
            for k in range(n):
                st.rows[p0 + k] = enc[k].copy()
        if ids is not None:
            for k, t in enumerate(ids.tolist()):
                st.tokens[p0 + k] = t
        st.end = p0 + n
        if st.accept_open:
            st.tentative += n
            if st.tentative > c.block_size + 1:
                st.accept_open, st.tentative = False, 0
        # The core's bounded ingest (bookkeeping): input rows below the new
        # horizon are never stored; a chunk that does not fit beside the held
        # rows first trims the head up to that horizon.
        h_new = max(st.horizon, self._firm_end(st) - c.window)
        skip = min(max(h_new - p0, 0), n)
        clean_append = skip == 0 and held + n - skip <= self._ring_rows
        if was_started and not clean_append:
            self._trim(st, min(h_new, p0), p0)
        if not was_started or st.head == p0:  # the ring is empty: it restarts at the first stored row
            st.head = p0 + skip
        self._update_horizon(st)
        slots = self._ring_append(i, st, was_started, old_end, p0, n)
        self._advance_horizon(st)
        return slots

    def _ring_append(self, i: int, st: _Seq, was_started: bool, old_end: int, p0: int, n: int) -> list[int]:
        """The core's bounded ingest, on the ring: rows below the new horizon
        are never stored (slot -1); when the new rows do not fit beside the
        held ones, the dead head goes first; an empty ring restarts at index 0."""
        ring = st.ring
        skip = min(max(st.horizon - p0, 0), n)
        keep = n - skip
        if ring.cap == 0:
            ring.reserve(keep)
        clean = skip == 0 and ring.count + keep <= ring.cap
        if was_started and not clean:
            ring.drop_front(min(st.horizon, old_end))
        if not was_started or ring.count == 0:
            ring.reset(p0 + skip)
        idx: list[int] = []
        if keep:
            ring.reserve(keep)
            idx = ring.append(keep)
        base = i * self._ring_rows
        return [-1] * skip + [base + x for x in idx]

    def _skip_reason(self, st: _Seq, start: int) -> str | None:
        if st.disabled:
            return "disabled"
        if st.drafting_off:
            return "drafting_off"
        if not st.started:
            return "empty"
        if start <= st.n_cache:
            return "no_context"
        if st.end != start:
            return "missing_rows"
        return None

    @staticmethod
    def _out_of_protocol(st: _Seq, start: int) -> bool:
        """A draft whose n_past disagrees with the rows of a sequence that holds
        some and is not disabled (docs/protocol.md section 3), whatever its skip."""
        return st.started and not st.disabled and start != st.end

    def _check_strict(self, i: int, st: _Seq, start: int) -> None:
        if self._strict and self._out_of_protocol(st, start):
            raise arg.strict_mismatch(i, start, st.end)

    def _draft_checked(self, i: int, st: _Seq, start: int, views: bool = False, ids: bool = True) -> StagePlan:
        """``ids``: a chain drafter's plan carries its rows' ids (the device step's does not:
        they are in the server's slot token table while the sequence is on the device)."""
        c = self.config
        st.verify_owed = False  # a draft, skipped or not: the last round's verify is over
        reason = self._skip_reason(st, start)
        if reason is not None:
            st.stats["skips"] += 1
            st.stats["skips_" + reason] += 1
            if self._out_of_protocol(st, start) and i not in self._warned:
                self._warned.add(i)
                logger.warning(MISMATCH_WARNING, i, start, reason, st.end - 1, arg.mismatch_cause(start, st.end))
            return StagePlan.skipped(i, start, reason, feature_dim=c.feature_dim, row_bytes=self._row_bytes,
                                     stage_dtype=c.numpy_stage_dtype, external=self._external, chain=self._chain)
        rebase = st.restage_owed or start - st.pos_base + c.block_size > c.window
        if rebase:
            keep = min(start - st.horizon, self._w_keep)
            base = lo = start - keep
        else:
            base, lo = st.pos_base, st.n_cache
        assert lo >= st.horizon and lo >= st.ring.head, "staged rows must be available"
        slots = np.array(st.ring.slots(lo, start, i * self._ring_rows), np.int64)
        if self._external:
            enc = rows = None
        else:
            enc = (np.stack([st.rows[p] for p in range(lo, start)]) if start > lo
                   else np.zeros((0, self._row_bytes), np.uint8))
            rows = self._decode(enc)
        plan = StagePlan(
            seq=i, start=start, skip=None, rebase=rebase, clear_cache=rebase or st.first_round,
            positions=np.arange(lo - base, start - base, dtype=np.int32),
            block_positions=np.arange(start - base, start - base + c.block_size, dtype=np.int32),
            crop_from=start - base, pos_base=base, encoded_rows=enc, rows=rows, slots=slots,
            external=self._external, source=self if self._external else None, round=self._rounds + 1,
            # copy=False: the rows cut where the ring wraps, as the core's views of it are.
            encoded_runs=_ring_runs(enc, slots) if views and enc is not None else None,
            decode=self._decode if views else None,
            tokens=np.array([st.tokens[p] for p in range(lo, start)], np.int32) if self._chain and ids else None,
        )
        self._rounds += 1
        st.open_round = (start, base)
        st.round = self._rounds
        st.accept_open, st.tentative = True, 0
        st.stats["rounds"] += 1
        st.stats["staged_rows"] += start - lo
        if rebase:
            st.stats["rebases"] += 1
            st.stats["restaged_rows"] += start - lo
        return plan

    def draft(self, seq: int, n_past: int, copy: bool = True) -> StagePlan:
        """Plan this round for a target at ``n_past``; opens a round unless skipped.

        ``copy=False``: the plan's runs are the core's zero-copy views of its
        ring; here they are copies cut at the same slot, so that plans compare.
        """
        i, st = self._closed(seq)
        views = arg.zero_copy(self._external, copy)
        start = arg.count("n_past", arg.integer("n_past", n_past))
        self._check_strict(i, st, start)
        return self._draft_checked(i, st, start, views)

    def _open(self, seq: Any) -> tuple[int, _Seq]:
        st = self._get(seq)
        i = arg.integer("seq", seq)
        self._need(i, st, OPEN)
        return i, st

    def commit(self, seq: int) -> None:
        """The drafter decode and crop of the open round succeeded."""
        _, st = self._open(seq)
        self._commit_checked(st)

    def _commit_checked(self, st: _Seq) -> None:
        start, base = st.open_round  # type: ignore[misc]
        st.open_round = None
        st.n_cache, st.pos_base = start, base
        st.restage_owed = st.first_round = False
        st.failures = 0
        st.verify_owed = True
        st.stats["commits"] += 1
        self._advance_horizon(st)

    def fail(self, seq: int, stage: str = "decode") -> int:
        """The drafter decode or crop of the open round failed: restage next round. Returns the
        failure count when this failure disabled the sequence, else 0."""
        i, st = self._open(seq)
        stage = arg.fail_stage(stage)
        if self._fail_checked(st):
            logger.warning(DISABLED_WARNING, i, st.failures, stage)
            return st.failures
        return 0

    def _fail_checked(self, st: _Seq) -> bool:
        """Close the open round as failed; True when this failure disabled the sequence."""
        st.open_round = None
        st.restage_owed = True
        st.first_round = False
        st.failures += 1
        st.stats["failures"] += 1
        disabled_now = st.failures >= self.config.max_failures and not st.disabled
        st.disabled = st.disabled or disabled_now
        self._advance_horizon(st)
        return disabled_now

    def accept(self, seq: int, n_accepted: int) -> None:
        """Keep the rows of the ``n_accepted`` accepted tokens (+1) of the last verify batch."""
        _, st = self._closed(seq)
        n = self._check_accept(arg.integer("n_accepted", n_accepted))
        self._accept_checked(st, n)

    def _check_accept(self, n: int) -> int:
        if not 0 <= n <= self.config.block_size:
            raise ValueError(f"n_accepted must be in [0, {self.config.block_size}], got {n}")
        return n

    def _accept_checked(self, st: _Seq, n: int) -> None:
        if not st.accept_open or st.tentative == 0:
            return
        self._keep_tentative(st, min(st.tentative, n + 1))

    def _keep_tentative(self, st: _Seq, keep: int) -> None:
        """The verify's end (accept, accept_path): the first ``keep`` tentative rows stay, the rest go."""
        if st.verify_owed:  # the committed round's verify: the drafts it keeps
            st.verify_owed = False
            st.accepted[keep - 1] += 1
            st.stats["verified_rounds"] += 1
            st.stats["accepted_tokens"] += keep - 1
        new_end = st.end - st.tentative + keep
        for p in range(new_end, st.end):
            st.rows.pop(p, None)
            st.tokens.pop(p, None)
        st.ring.drop_back(new_end)
        st.end = new_end
        st.tentative = 0
        st.accept_open = False  # an accept acts on the round just drafted, once: later rows are final
        self._advance_horizon(st)

    # -- batches: one call for many sequences ----------------------------
    # A batch call does for each of its sequences what the per-sequence call
    # does, and checks the whole batch first, step by step as a per-sequence
    # call checks one sequence (docs/design.md 2.1): every id, then every
    # state, then the kind and shape of the arrays, unique ids, then the
    # values sequence by sequence, contents last. Only then does anything
    # change: a rejected batch changes nothing. An error about one sequence
    # is the per-sequence call's error, prefixed by ``arg.batch_context``.

    def _check_batch(self, call: str, ids: np.ndarray, need: str) -> list[_Seq]:
        """A batch's first two steps, as the core's (``check_ids``, then ``check_states``):
        every id exists, then sequence by sequence, it is on the host (not handed over to
        the device step) and its state is ``need``."""
        seqs = ids.tolist()
        self._check_ids(call, ids)
        states = [self._seqs[s] for s in seqs]
        for k, (s, st) in enumerate(zip(seqs, states)):
            with arg.in_batch(call, k, s):
                self._on_host(s)
                self._need(s, st, need)
        return states

    def _check_ids(self, call: str, ids: np.ndarray) -> None:
        """A batch's first step: every id is one of this Stager's sequences."""
        for k, s in enumerate(ids.tolist()):
            with arg.in_batch(call, k, s):
                self._known_id(s)

    def _converted(self, call: str, ids: np.ndarray, need: str, convert: Callable[..., Any], *args: Any) -> Any:
        """``convert(*args)``: a batch's other arrays; when one cannot be converted,
        the batch's id and state errors come first (as for one sequence)."""
        try:
            return convert(*args)
        except (TypeError, ValueError) as exc:
            conversion = exc
        self._check_batch(call, ids, need)
        raise conversion

    def _check_rows(self, call: str, ids: np.ndarray, states: list[_Seq], cu: np.ndarray,
                    pos: np.ndarray) -> list[tuple[int, int]]:
        """The offsets, then each sequence's positions; returns each sequence's ``[a, b)`` rows."""
        arg.offsets(call, cu, len(pos))
        spans = [(int(cu[k]), int(cu[k + 1])) for k in range(len(ids))]
        for k, (s, st, (a, b)) in enumerate(zip(ids.tolist(), states, spans)):
            with arg.in_batch(call, k, s):
                self._check_positions(s, st, pos[a:b])
        return spans

    def process_many(self, seqs: Any, cu_seqlens: Any, positions: Any, rows: Any = None,
                     tokens: Any = None) -> np.ndarray | None:
        """``process`` for the sequences of one target forward, rows flat as in a varlen batch.

        The rows of ``seqs[i]`` are rows ``[cu_seqlens[i], cu_seqlens[i + 1])``
        of ``positions`` and (held mode) ``rows``. External-row mode: no rows;
        returns the flat slots, one per row (-1 below the horizon).
        """
        call = "process_many"
        ids = arg.seq_ids(call, seqs)
        cu, pos, arr = self._converted(call, ids, READY, arg.batch_rows, call, self._external,
                                       self.config.feature_dim, len(ids), cu_seqlens, positions, rows)
        token_ids = self._converted(call, ids, READY, arg.tokens, call, tokens, len(pos))
        states = self._check_batch(call, ids, READY)
        arg.unique(call, ids)
        spans = self._check_rows(call, ids, states, cu, pos)
        arg.check_tokens(call, self._chain, token_ids, len(pos))
        encoded: list[np.ndarray | None] = [None] * len(ids)
        if arr is not None:
            for k, (s, (a, b)) in enumerate(zip(ids.tolist(), spans)):
                if b > a:
                    with arg.in_batch(call, k, s):
                        encoded[k] = self._encode(s, pos[a:b], arr[a:b])
        slots: list[int] = []
        for s, st, (a, b), enc in zip(ids.tolist(), states, spans, encoded):
            if b > a:
                slots += self._append(s, st, int(pos[a]), enc, b - a, None if token_ids is None else token_ids[a:b])
        return np.array(slots, np.int64) if self._external else None

    def check_process_many(self, seqs: Any, cu_seqlens: Any, positions: Any, tokens: Any = None) -> None:
        """What ``process_many(seqs, cu_seqlens, positions, ..., tokens=tokens)`` checks of its
        sequences, offsets, positions and token ids, changing nothing."""
        call = "process_many"
        ids = arg.seq_ids(call, seqs)
        cu, pos, _ = self._converted(call, ids, READY, arg.batch_rows, call, True, self.config.feature_dim,
                                     len(ids), cu_seqlens, positions, None)
        token_ids = self._converted(call, ids, READY, arg.tokens, call, tokens, len(pos))
        states = self._check_batch(call, ids, READY)
        arg.unique(call, ids)
        self._check_rows(call, ids, states, cu, pos)
        arg.check_tokens(call, self._chain, token_ids, len(pos))

    def accept_many(self, seqs: Any, n_accepted: Any) -> None:
        """``accept`` for several sequences: ``n_accepted[i]`` for ``seqs[i]``."""
        call = "accept_many"
        seq_list, values, states = self._ready_with_ints(call, seqs, "n_accepted", n_accepted)
        for k, (s, n) in enumerate(zip(seq_list, values)):
            with arg.in_batch(call, k, s):
                self._check_accept(n)
        for st, n in zip(states, values):
            self._accept_checked(st, n)

    def _ready_with_ints(self, call: str, seqs: Any, name: str, values: Any,
                         then: Callable[[np.ndarray], Any] | None = None) -> tuple[list[int], list[int], list[_Seq]]:
        """A batch of ready sequences with one integer each (``n_pasts``, ``n_accepted``), checked
        up to its unique ids: the ids, the integers and the sequences. ``then(ids)``: a further
        argument's conversion, after the integers'."""
        ids = arg.seq_ids(call, seqs)
        ints = self._converted(call, ids, READY, arg.batch_ints, call, name, values, len(ids))
        if then is not None:
            then(ids)
        states = self._check_batch(call, ids, READY)
        arg.unique(call, ids)
        return ids.tolist(), ints.tolist(), states

    def draft_many(self, seqs: Any, n_pasts: Any, copy: bool = True) -> BatchPlan:
        """``draft`` for several sequences as one drafter batch (a :class:`BatchPlan`).

        ``copy=False``: the batch's runs are the core's zero-copy views of its
        rings; here they are copies cut at the same slots, so that plans compare.
        """
        call = "draft_many"
        seq_list, past_list, states = self._ready_with_ints(
            call, seqs, "n_pasts", n_pasts, lambda ids: self._converted(call, ids, READY, arg.zero_copy,
                                                                        self._external, copy, call))
        views = arg.zero_copy(self._external, copy, call)  # converted in its turn above: cannot fail now
        for k, (s, p) in enumerate(zip(seq_list, past_list)):
            with arg.in_batch(call, k, s):
                arg.count("n_past", p)
        for k, (s, st, p) in enumerate(zip(seq_list, states, past_list)):
            with arg.in_batch(call, k, s):
                self._check_strict(s, st, p)
        plans = [self._draft_checked(s, st, p, views) for s, st, p in zip(seq_list, states, past_list)]
        c = self.config
        return batch_plan(
            plans, block_size=c.block_size, feature_dim=c.feature_dim, row_bytes=self._row_bytes,
            stage_dtype=c.numpy_stage_dtype, max_plan_rows=c.window - c.block_size, storage=c.storage,
            external=self._external, source=self if self._external else None,
            decode=None if self._external else self._decode,
            zero_copy=views, chain=self._chain,
        )

    def commit_many(self, seqs: Any) -> None:
        """``commit`` for several sequences."""
        call = "commit_many"
        ids = arg.seq_ids(call, seqs)
        states = self._check_batch(call, ids, OPEN)
        arg.unique(call, ids)
        for st in states:
            self._commit_checked(st)

    def fail_many(self, seqs: Any, stages: Any = "decode") -> np.ndarray:
        """``fail`` for several sequences: one stage for all of them, or one per sequence
        (names, or indices in ``FAIL_STAGES``). Returns ``fail``'s answer per sequence."""
        call = "fail_many"
        ids = arg.seq_ids(call, seqs)
        names = self._converted(call, ids, OPEN, arg.fail_stages, call, stages, ids)
        states = self._check_batch(call, ids, OPEN)
        arg.unique(call, ids)
        disabled = [self._fail_checked(st) for st in states]
        for s, st, name, now in zip(ids.tolist(), states, names, disabled):
            if now:
                logger.warning(DISABLED_WARNING, s, st.failures, name)
        return np.array([st.failures if now else 0 for st, now in zip(states, disabled)], np.int64)

    def _number_change(self, call: str, *seqs: int) -> int:
        """The next table change's serial, issued by ``call``, copying into or out of ``seqs``' slots."""
        self.moves_issued += 1
        self.last_change = call
        for s in seqs:
            self._changed[s] = self.moves_issued
        return self.moves_issued

    def changes_of(self, seqs: Any) -> int:
        """The serial of the newest table change that copies rows into or out of the slots of any of
        ``seqs`` (0: none yet)."""
        ids = arg.seq_ids("changes_of", seqs)
        self._check_ids("changes_of", ids)  # the ids alone: a question any sequence answers, on the device too
        return max((self._changed[s] for s in ids.tolist()), default=0)

    def open_round_ids(self, seqs: Any) -> np.ndarray:
        """``open_round_id`` of several sequences (int64; an id may repeat)."""
        ids = arg.seq_ids("open_round_ids", seqs)
        self._check_batch("open_round_ids", ids, ANY)
        return np.array([self.open_round_id(s) for s in ids.tolist()], np.int64)

    # -- a request's end --------------------------------------------------
    def end(self, seq: int) -> None:
        """The request on ``seq`` is over: drop whatever it holds (an open round, a
        reservation, its rows and ring); the sequence is as a new Stager's."""
        i = self._known_id(seq)
        self._leave_step(i)  # end takes any state, a handed-over one too
        self._end_checked(i)

    def end_many(self, seqs: Any) -> None:
        """``end`` for several sequences (handed-over ones too)."""
        ids = arg.seq_ids("end_many", seqs)
        self._check_ids("end_many", ids)
        arg.unique("end_many", ids)
        for q in ids.tolist():
            self._leave_step(q)
            self._end_checked(q)

    def _end_checked(self, i: int) -> None:
        self._reset_seq(i, self._new_seq(RingModel(self._ring_rows)))
        self._warned.discard(i)

    # -- drafting per request ---------------------------------------------
    def disable(self, seq: int) -> None:
        """Drafting off for the request on ``seq``: every draft skips with ``"drafting_off"``
        (any state: a handed-over sequence's steps skip too)."""
        self._switch(self._known_id(seq), True)

    def enable(self, seq: int) -> None:
        """Drafting back on for ``seq``: the next draft plans at once."""
        self._switch(self._known_id(seq), False)

    def _switch(self, i: int, off: bool) -> None:
        """The request's switch, kept by its reservation too (a cancel does not undo it)."""
        st = self._seqs[i]
        for x in (st, st.reservation):
            if x is not None:
                x.drafting_off = off

    def disable_many(self, seqs: Any) -> None:
        """``disable`` for several sequences (every id checked first)."""
        self._set_drafting("disable_many", seqs, True)

    def enable_many(self, seqs: Any) -> None:
        """``enable`` for several sequences (every id checked first)."""
        self._set_drafting("enable_many", seqs, False)

    def _set_drafting(self, call: str, seqs: Any, off: bool) -> None:
        ids = arg.seq_ids(call, seqs)
        self._check_ids(call, ids)  # any state, a handed-over one too; a repeated id: the same switch twice
        for q in ids.tolist():
            self._switch(q, off)

    # -- slots before the rows (external-row mode) ------------------------
    # reserve is process in external-row mode, with the sequence then held
    # until confirm (the rows were written: nothing more to do) or cancel (the
    # sequence as it was before, exactly: it is put back whole).

    def reserve(self, seq: int, positions: Any, tokens: Any = None) -> np.ndarray:
        """The slots ``process(seq, positions)`` would return, handed out before the rows exist."""
        i, st = self._closed(seq)
        pos = arg.positions(positions)
        ids = arg.tokens("", tokens, len(pos))
        if not self._external:
            raise arg.external_only("reserve")
        self._check_positions(i, st, pos)
        arg.check_tokens("", self._chain, ids, len(pos))
        return np.array(self._reserve_checked(i, st, pos, ids), np.int64)

    def reserve_many(self, seqs: Any, cu_seqlens: Any, positions: Any, tokens: Any = None) -> np.ndarray:
        """``reserve`` for the sequences of one target forward (flat, as ``process_many``)."""
        call = "reserve_many"
        ids = arg.seq_ids(call, seqs)
        cu, pos, _ = self._converted(call, ids, READY, arg.batch_rows, call, True, self.config.feature_dim,
                                     len(ids), cu_seqlens, positions, None)
        flat = self._converted(call, ids, READY, arg.tokens, call, tokens, len(pos))
        states = self._check_batch(call, ids, READY)
        arg.unique(call, ids)
        if not self._external:
            raise arg.external_only(call)
        spans = self._check_rows(call, ids, states, cu, pos)
        arg.check_tokens(call, self._chain, flat, len(pos))
        slots: list[int] = []
        for s, st, (a, b) in zip(ids.tolist(), states, spans):
            slots += self._reserve_checked(s, st, pos[a:b], None if flat is None else flat[a:b])
        return np.array(slots, np.int64)

    def _reserve_checked(self, i: int, st: _Seq, pos: np.ndarray, ids: np.ndarray | None = None) -> list[int]:
        before = copy.deepcopy(st)
        slots = self._append(i, st, int(pos[0]), None, len(pos), ids) if len(pos) else []
        st.reservation = before
        return slots

    def confirm(self, seq: int) -> None:
        """The reserved rows are in the owner's table: they are the sequence's now."""
        i = arg.integer("seq", seq)
        self._need(i, self._get(i), RESERVED)
        self._check_confirmable(i, self._seqs[i])
        self._seqs[i].reservation = None

    def _check_confirmable(self, i: int, st: _Seq) -> None:
        """A chain drafter's reservation back from the device step before its verify rows' ids
        were written (to_host) has rows without ids: only cancel takes it back."""
        if not self._chain or st.reservation is None:
            return
        for p in range(max(st.reservation.end, st.horizon), st.end):
            if st.tokens.get(p, 0) < 0:
                raise ValueError(f"sequence {i}'s reserved row at position {p} has no token id (it came back from the "
                                 "device step before its verify batch's ids were written at its verify slots): "
                                 "cancel the reservation")

    def cancel(self, seq: int) -> None:
        """The reserved rows never came: the sequence is exactly as before ``reserve``."""
        i = arg.integer("seq", seq)
        self._need(i, self._get(i), RESERVED)
        self._cancel_checked(i)

    def _cancel_checked(self, i: int) -> None:
        before = self._seqs[i].reservation
        assert before is not None
        before.drafting_off = self._seqs[i].drafting_off  # a switch made since the reservation stays
        self._seqs[i] = before

    def confirm_many(self, seqs: Any) -> None:
        """``confirm`` for several sequences."""
        ids = arg.seq_ids("confirm_many", seqs)
        states = self._check_batch("confirm_many", ids, RESERVED)
        arg.unique("confirm_many", ids)
        for k, (q, st) in enumerate(zip(ids.tolist(), states)):
            with arg.in_batch("confirm_many", k, q):
                self._check_confirmable(q, st)
        for st in states:
            st.reservation = None

    def cancel_many(self, seqs: Any) -> None:
        """``cancel`` for several sequences."""
        ids = arg.seq_ids("cancel_many", seqs)
        self._check_batch("cancel_many", ids, RESERVED)
        arg.unique("cancel_many", ids)
        for s in ids.tolist():
            self._cancel_checked(s)

    # -- lifecycle ------------------------------------------------------
    def rollback(self, seq: int, n_past: int) -> None:
        """The target rolled back to ``n_past``: drop rows ``>= n_past``."""
        _, st = self._closed(seq)
        n_past = arg.count("n_past", arg.integer("n_past", n_past))
        if not st.started or n_past >= st.end:
            return
        for p in [p for p in st.rows if p >= n_past]:
            del st.rows[p]
        for p in [p for p in st.tokens if p >= n_past]:
            del st.tokens[p]
        st.ring.drop_back(n_past)
        if st.ring.count == 0:
            st.ring.reset(n_past)
        st.head = min(st.head, n_past)  # the core's ring drops its back rows (an emptied ring restarts there)
        st.end = n_past
        st.horizon = min(st.horizon, n_past)
        if st.n_cache > n_past:
            st.n_cache = n_past
            st.restage_owed = True
        st.pos_base = min(st.pos_base, st.n_cache)
        if st.horizon > st.n_cache:
            st.restage_owed = True  # rows pending since the cache end are gone
        st.accept_open, st.tentative = False, 0
        self._advance_horizon(st)

    def shift(self, seq: int, n_keep: int, n_discard: int) -> SlotMoves:
        """Mirror the target's context shift: drop ``[n_keep, n_keep + n_discard)``, move the rest down.

        Returns the moves ``[src_slot, dst_slot, count]`` (see RingModel.compact).
        """
        i, st = self._closed(seq)
        n_keep, n_discard = arg.integer("n_keep", n_keep), arg.integer("n_discard", n_discard)
        arg.count("n_keep", n_keep)
        arg.count("n_discard", n_discard)
        if not st.started or n_discard == 0:
            return no_moves(self)
        if n_keep + n_discard > st.end:
            raise ValueError(
                f"shift of [{n_keep}, {n_keep + n_discard}) reaches past the end of the sequence ({st.end})"
            )
        hi = n_keep + n_discard

        def moved(x: int) -> int:
            return x if x < n_keep else (n_keep if x < hi else x - n_discard)

        st.rows = {moved(p): r for p, r in st.rows.items() if not n_keep <= p < hi}
        st.tokens = {moved(p): t for p, t in st.tokens.items() if not n_keep <= p < hi}
        # The ring keeps the live rows in place around the discarded range.
        frm = max(st.horizon, st.ring.head)
        moves = st.ring.compact(frm, n_keep, hi, moved(st.horizon), i * self._ring_rows)
        st.end, st.horizon = moved(st.end), moved(st.horizon)
        st.head = st.horizon  # the core keeps the live rows, renumbered from the horizon (no trim counted)
        st.n_cache, st.pos_base = moved(st.n_cache), moved(st.pos_base)
        st.restage_owed = True
        st.accept_open, st.tentative = False, 0
        self._advance_horizon(st)
        return self._issue(np.array(moves, np.int64).reshape(len(moves), 3), "shift", i)

    def fork(self, src: int, dst: int) -> SlotMoves:
        """Give ``dst`` an independent copy of ``src``'s state; ``dst`` restages next round.

        Returns the moves of ``src``'s rows into ``dst``'s first slots.
        """
        s = arg.integer("src", src)
        d = arg.integer("dst", dst)
        self._known_id(s)  # both ids, then each one's state, as the core's lock_pair and ready()
        self._known_id(d)
        self._closed(s)
        self._closed(d)
        if s == d:
            raise ValueError(f"fork needs two different sequences, got {s} twice")
        a = self._seqs[s]
        frm = max(a.horizon, a.ring.head) if a.started else 0
        k = a.end - frm if a.started else 0
        src_slots = a.ring.slots(frm, frm + k, s * self._ring_rows)
        ring = self._ring_for(self._seqs[d].ring, frm, k)
        dst_slots = [d * self._ring_rows + x for x in ring.append(k)]
        b = self._new_seq(
            ring,
            started=a.started, end=a.end, horizon=a.horizon, n_cache=a.n_cache, pos_base=a.pos_base,
            restage_owed=a.started, first_round=a.first_round, disabled=a.disabled, failures=a.failures,
            accept_open=a.accept_open, tentative=a.tentative,
            rows={p: r.copy() for p, r in a.rows.items()}, head=a.horizon if a.started else 0,
            tokens={p: t for p, t in a.tokens.items() if p >= a.horizon},
            drafting_off=a.drafting_off,
        )
        self._reset_seq(d, b)
        self._advance_horizon(b)
        return self._issue(_moves(src_slots, dst_slots), "fork", d, s)

    def _issue(self, moves: np.ndarray, call: str, *seqs: int) -> SlotMoves:
        """Moves as the core returns them: numbered among the table changes when non-empty."""
        if len(moves) == 0:
            return no_moves(self)
        self._number_change(call, *seqs)
        return SlotMoves.wrap(moves, self, self.moves_issued)

    def _ring_for(self, reuse: RingModel, pos: int, n: int) -> RingModel:
        """The core's ring_for: ``reuse`` emptied when it has room for n rows, else a new ring."""
        if reuse.cap == 0 or reuse.cap < n:
            reuse = RingModel(self._ring_rows)
            reuse.reserve(n)
        reuse.reset(pos)
        return reuse

    def _snapshot_state(self, seq: int) -> snapshot_format.SnapshotState:
        _, st = self._closed(seq)
        held = not self._external  # external-row mode: bookkeeping only, the owner keeps the rows
        rows = b"".join(st.rows[p].tobytes() for p in range(st.horizon, st.end)) if st.started and held else b""
        return snapshot_format.SnapshotState(
            started=st.started, disabled=st.disabled, restage_owed=st.restage_owed,
            first_round=st.first_round, accept_open=st.accept_open, end=st.end, horizon=st.horizon,
            n_cache=st.n_cache, pos_base=st.pos_base, tentative=st.tentative, failures=st.failures,
            rows=rows, external=self._external, drafting_off=st.drafting_off,
            tokens=(np.array([st.tokens[p] for p in range(st.horizon, st.end)] if st.started else [], "<i4").tobytes()
                    if self._chain else None),
        )

    def snapshot(self, seq: int) -> bytes:
        """The sequence's state as versioned, checksummed bytes (see ``snapshot_format``)."""
        return snapshot_format.pack(self._snapshot_state(seq), self._fingerprint)

    def snapshot_size(self, seq: int) -> int:
        """Bytes ``snapshot(seq)`` returns and ``snapshot_into(seq, ...)`` writes."""
        _, st = self._closed(seq)
        n_rows = st.end - st.horizon if st.started else 0
        return snapshot_format.snapshot_bytes(n_rows, 0 if self._external else self._row_bytes, self._chain)

    def snapshot_into(self, seq: int, buffer: Any) -> int:
        """Write the snapshot into a writable C-contiguous buffer; returns the bytes written.

        ``TypeError`` for an object that is not a writable contiguous buffer,
        ``ValueError`` when it is too small (nothing is written).
        """
        self._closed(seq)
        out = arg.writable(buffer)
        need = self.snapshot_size(seq)
        if len(out) < need:
            raise ValueError(
                f"snapshot buffer of {len(out)} bytes is too small: the snapshot of sequence {seq} needs {need}"
            )
        out[:need] = self.snapshot(seq)
        return need

    def restore(self, seq: int, data: Any) -> RestoredSlots | None:
        """Replace the sequence's state with a snapshot; bad data leaves it untouched.

        External-row mode: returns the slots where the owner puts the saved rows back,
        numbered among the table changes when there are any.
        """
        i, old = self._closed(seq)
        raw = arg.readable(data)
        s = snapshot_format.unpack(raw, self._fingerprint, rf.STORAGES, arg.NONFINITE_POLICIES, external=self._external,
                                   stage_dtypes=arg.STAGE_DTYPES, tokens=self._chain)
        rb = self._row_bytes
        st = self._new_seq(
            RingModel(0),  # replaced below
            started=s.started, end=s.end, horizon=s.horizon, n_cache=s.n_cache, pos_base=s.pos_base,
            restage_owed=s.started, first_round=s.first_round, disabled=s.disabled, failures=s.failures,
            accept_open=s.accept_open, tentative=s.tentative, head=s.horizon, drafting_off=s.drafting_off,
        )
        for k in range(0 if self._external else s.end - s.horizon):
            st.rows[s.horizon + k] = np.frombuffer(s.rows, np.uint8, rb, k * rb).copy()
        if s.tokens is not None:
            st.tokens = {s.horizon + k: t for k, t in enumerate(np.frombuffer(s.tokens, "<i4").tolist())}
        n = s.end - s.horizon
        st.ring = self._ring_for(old.ring, s.horizon, n)
        if n:
            st.ring.reserve(n)
            st.ring.append(n)
        slots = np.array(st.ring.slots(s.horizon, s.end, i * self._ring_rows), np.int64)
        self._reset_seq(i, st)
        self._advance_horizon(st)
        if not self._external:
            return None
        serial = 0
        if n:  # the owner writes the rows back: a table change, in order
            serial = self._number_change("restore", i)
        return RestoredSlots.wrap(slots, self, serial)

    def check_restore(self, seq: int, data: Any) -> int:
        """Every check ``restore`` makes, nothing changed: the rows the snapshot brings back."""
        self._closed(seq)
        s = snapshot_format.unpack(arg.readable(data), self._fingerprint, rf.STORAGES, arg.NONFINITE_POLICIES,
                                   external=self._external, stage_dtypes=arg.STAGE_DTYPES, tokens=self._chain)
        return s.end - s.horizon

    # -- introspection --------------------------------------------------
    def state(self, seq: int) -> dict[str, Any]:
        """The sequence's protocol state (the same dict the core returns)."""
        st = self._get(seq)
        return {
            "started": st.started,
            "end": st.end,
            "horizon": st.horizon,
            "n_cache": st.n_cache,
            "pos_base": st.pos_base,
            "n_retained": max(0, st.n_cache - st.horizon) if st.started else 0,
            "n_pending": st.end - max(st.n_cache, st.horizon) if st.started else 0,
            "open_round": st.open_round is not None,
            "consecutive_failures": st.failures,
            "disabled": st.disabled,
            "restage_owed": st.restage_owed,
            "first_round": st.first_round,
            "tentative_rows": st.tentative if st.accept_open else 0,
            "reservation_open": st.reservation is not None,
            "drafting_off": st.drafting_off,
            "tree_nodes": len(st.tree) if st.tree is not None else 0,
        }

    def stats(self, seq: int) -> dict[str, int]:
        """Counters of the sequence since its last ``begin`` (a handed-over one's: live, from its steps)."""
        return self._stats_of(self._metrics_seq(self._known_id(seq)))

    @staticmethod
    def _stats_of(st: _Seq) -> dict[str, int]:
        out = dict(st.stats)
        out["live_rows"] = st.end - st.horizon if st.started else 0
        return out

    def accepted(self, seq: int) -> np.ndarray:
        """The sequence's accepted drafts per verified round since its last ``begin`` (``[k]``: k accepted)."""
        return np.array(self._metrics_seq(self._known_id(seq)).accepted, np.int64)

    def accepted_many(self, seqs: Any) -> np.ndarray:
        """``accepted`` of several sequences: int64 ``[len(seqs), block_size + 1]``, every id checked first."""
        ids = arg.seq_ids("accepted_many", seqs)
        self._check_ids("accepted_many", ids)  # a question: a handed-over sequence's answer is live
        return np.array([self._metrics_seq(s).accepted for s in ids.tolist()], np.int64).reshape(
            len(ids), self.config.block_size + 1)

    def totals(self) -> StagerTotals:
        """The Stager's metrics: the counters of every sequence since it was made, the gauges
        of the sequences now, the peaks' largest; handed-over sequences live, from their steps."""
        out = dict(self._retired)
        accepted = list(self._retired_accepted)
        started = 0
        for i in range(len(self._seqs)):
            st = self._settled(self._metrics_seq(i))
            self._add_stats(out, self._stats_of(st), gauges=True)
            accepted = [a + b for a, b in zip(accepted, st.accepted)]
            started += st.started
        return StagerTotals(out, np.array(accepted, np.int64), started)

    def open_round_id(self, seq: int) -> int:
        """The round open on ``seq`` (``plan.round``), or 0 when none is."""
        st = self._get(seq)
        return st.round if st.open_round is not None else 0

    def live_slots(self, seq: int) -> np.ndarray:
        """Slots of the stageable rows ``[horizon, end)``, oldest first."""
        i = arg.integer("seq", seq)
        st = self._get(seq)
        if not st.started:
            return np.zeros(0, np.int64)
        return np.array(st.ring.slots(st.horizon, st.end, i * self._ring_rows), np.int64)

    def buffered_positions(self, seq: int) -> tuple[int, int]:
        """``(horizon, end)``: the absolute positions that can still be staged."""
        st = self._get(seq)
        return (st.horizon, st.end) if st.started else (0, 0)

    def publishable(self, seq: Any) -> tuple[int, int]:
        """``(lo, hi)``: the positions whose rows a prefix store's ``publish`` can take now: the rows
        held (from the horizon) that are final (below what an open accept may drop); ``(0, 0)`` for a
        sequence holding no rows. The checks are ``publish``'s (a ready sequence)."""
        _, st = self._closed(seq)
        return (st.horizon, self._firm_end(st)) if st.started else (0, 0)
