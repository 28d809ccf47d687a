"""InvariantChecker in both row modes.

Held mode: the Stager keeps the rows and the checker reads them from the plans.
External-row mode: the checker is the owner of the rows; it keeps a numpy
mirror of the row table, writes the rows ``process`` is given at the slots the
Stager returns, applies the moves of ``fork`` / ``shift``, puts a snapshot's
rows back at the slots ``restore`` returns, and checks every plan's rows, read
from the mirror at ``plan.slots``, as in held mode.

A hypothesis state machine drives a held checker and an external checker (over
the C++ core and over the reference) with the same calls: the same outcomes,
and the external checker's rows at every plan's slots are, byte for byte, the
held core's ``plan.encoded_rows`` (an oracle the checker never sees). The
deterministic tests below break a Stager in one way each (a wrong slot, lost or
reordered moves, a wrong restore slot, a plan outside its sequence) and require
the external checker to say so.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import massive_rows
from dspark_core import Stager, StagerConfig
from dspark_core.stager.config import STORAGES
from dspark_core.reference import ReferenceStager
from dspark_core.rows.slot_moves import SlotMoves
from dspark_core.testing import InvariantChecker, InvariantViolation
from dspark_core.testing.invariants import UNWRITTEN, check_slots

SEQ = hs.integers(0, 2)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except InvariantViolation:
        raise
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return ("raise", type(exc))


class CheckerModes(RuleBasedStateMachine):
    """A held checker, and external checkers over the core and the reference, driven alike."""

    @initialize(
        block=hs.integers(1, 4), extra=hs.integers(1, 20), seqs=hs.integers(1, 3),
        storage=hs.sampled_from(STORAGES), seed=hs.integers(0, 2**16),
    )
    def setup(self, block, extra, seqs, storage, seed):
        cfg = StagerConfig(64, block, 2 * block + extra, max_seqs=seqs, storage=storage, nonfinite="clamp")
        self.cfg = cfg
        self.held = InvariantChecker(Stager(cfg))
        ext_cfg = cfg.replace(rows="external")
        self.ext = InvariantChecker(Stager(ext_cfg))
        self.ref = InvariantChecker(ReferenceStager(ext_cfg))
        self.rng = np.random.default_rng(seed)
        self.snaps: list[tuple[bytes, bytes]] = []

    def pick(self, k):
        return k % self.cfg.max_seqs

    def end(self, seq):
        return self.held.state(seq)["end"]

    def all3(self, name, *args):
        """The same call through the three checkers: the same outcome (a violation propagates)."""
        got = [outcome(getattr(ck, name), *args) for ck in (self.held, self.ext, self.ref)]
        kinds = {g[0] for g in got}
        assert len(kinds) == 1 and (kinds == {"ok"} or len({g[1] for g in got}) == 1), (name, args, got)
        return got

    def same_plan(self, hp, xp, rp):
        for name in ("skip", "start", "rebase", "clear_cache", "crop_from", "pos_base"):
            assert getattr(hp, name) == getattr(xp, name) == getattr(rp, name), name
        assert np.array_equal(hp.slots, xp.slots) and np.array_equal(xp.slots, rp.slots)
        # the external checkers' own rows at the plan's slots are the held core's rows
        assert self.ext.plan_rows(xp).tobytes() == hp.encoded_rows.tobytes()
        assert self.ref.plan_rows(rp).tobytes() == hp.encoded_rows.tobytes()

    def feed(self, seq, start, n):
        rows = massive_rows(self.rng, n, self.cfg.feature_dim)
        h, x, r = self.all3("process", seq, np.arange(start, start + n), rows)
        if h[0] == "ok":
            assert h[1] is None and np.array_equal(x[1], r[1]) and len(x[1]) == n

    @rule(seq=SEQ)
    def begin(self, seq):
        self.all3("begin", self.pick(seq))

    @rule(seq=SEQ, n=hs.integers(0, 9), offset=hs.sampled_from([0, 0, 0, 1, -1]))
    def process(self, seq, n, offset):
        seq = self.pick(seq)
        self.feed(seq, max(0, self.end(seq) + offset), n)

    @rule(seq=SEQ, n=hs.integers(40, 700))
    def long_prefill(self, seq, n):
        seq = self.pick(seq)
        self.feed(seq, self.end(seq), n)

    @rule(seq=SEQ, rounds=hs.integers(1, 60), n_accepted=hs.integers(0, 4), fail_every=hs.integers(0, 5))
    def rounds(self, seq, rounds, n_accepted, fail_every):
        """Whole rounds as a server drives them (long runs wrap the ring)."""
        seq = self.pick(seq)
        B = self.cfg.block_size
        for i in range(rounds):
            end = self.end(seq)
            h, x, r = self.all3("draft", seq, end)
            if h[0] == "ok":
                self.same_plan(h[1], x[1], r[1])
                if h[1].skip is None:
                    self.all3("fail" if fail_every and i % fail_every == fail_every - 1 else "commit", seq)
            self.feed(seq, end, B + 1)
            self.all3("accept", seq, min(n_accepted, B))

    @rule(seqs=hs.lists(SEQ, max_size=3))
    def draft_many(self, seqs):
        seqs = [self.pick(s) for s in seqs]
        h, x, r = self.all3("draft_many", seqs, [self.end(s) for s in seqs])
        if h[0] == "ok":
            for a, b, c in zip(h[1].plans, x[1].plans, r[1].plans):
                self.same_plan(a, b, c)
            for s in {p.seq for p in h[1].plans if p.skip is None}:
                self.all3("commit", s)

    @rule(seq=SEQ, back=hs.integers(0, 40))
    def rollback(self, seq, back):
        seq = self.pick(seq)
        self.all3("rollback", seq, max(0, self.end(seq) - back))

    @rule(seq=SEQ, keep_back=hs.integers(1, 8), n_discard=hs.integers(1, 6))
    def shift(self, seq, keep_back, n_discard):
        seq = self.pick(seq)
        n_keep = max(0, self.end(seq) - keep_back - n_discard)  # inside the window: the tail moves
        self.all3("shift", seq, n_keep, n_discard)

    @rule(src=SEQ, dst=SEQ)
    def fork(self, src, dst):
        self.all3("fork", self.pick(src), self.pick(dst))

    @rule(seq=SEQ)
    def snapshot(self, seq):
        h, x, r = self.all3("snapshot", self.pick(seq))
        if h[0] == "ok":
            assert x[1] == r[1]
            self.snaps.append((h[1], x[1]))

    @precondition(lambda self: getattr(self, "snaps", None))
    @rule(seq=SEQ, which=hs.integers(0, 100))
    def restore(self, seq, which):
        seq = self.pick(seq)
        held_snap, ext_snap = self.snaps[which % len(self.snaps)]
        x = outcome(self.ext.restore, seq, ext_snap)  # the checkers kept the rows when they took it...
        if x[0] == "raise" and x[1] is TypeError:  # ... unless two snapshots had these bytes and other rows
            assert self.held.state(seq) == self.ext.state(seq)  # refused before the Stager saw it
            return
        h = outcome(self.held.restore, seq, held_snap)
        r = outcome(self.ref.restore, seq, ext_snap)
        assert h[0] == x[0] == r[0], (h, x, r)

    @invariant()
    def same_state(self):
        if hasattr(self, "cfg"):
            for s in range(self.cfg.max_seqs):
                assert self.held.state(s) == self.ext.state(s) == self.ref.state(s)


CheckerModes.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestCheckerModes = CheckerModes.TestCase


# ------------------------------------------------------------ deterministic ---

CFG = StagerConfig(64, 2, 12, max_seqs=3, storage="q8_0", nonfinite="clamp")


def _rows(n, seed=0):
    return massive_rows(np.random.default_rng(seed), n, CFG.feature_dim)


def _session(st):
    """A session touching every row-moving call; returns the plans and their rows, read
    from the checker while each round was open (later rows may reuse the slots)."""
    st.process(0, np.arange(0, 700), _rows(700, 1))  # longer than the ring: slots wrap, the head is dropped
    plans = []
    for i in range(300):  # 600 rows kept, through a ring of 527: it wraps
        end = st.state(0)["end"]
        plans.append(_drafted(st, 0, end))
        st.commit(0) if i % 7 else st.fail(0)
        st.process(0, np.arange(end, end + 3), _rows(3, 10 + i))
        st.accept(0, i % 3)
    st.fork(0, 1)
    end = st.state(1)["end"]
    st.shift(1, end - 6, 3)
    plans.append(_drafted(st, 1, end - 3))
    st.commit(1)
    data = st.snapshot(1)
    st.restore(2, data)
    st.process(2, np.arange(end - 3, end), _rows(3, 99))
    plans.append(_drafted(st, 2, end))
    st.commit(2)
    return plans


def _drafted(st, seq, n_past):
    plan = st.draft(seq, n_past)
    return plan, st.plan_rows(plan).copy()


@pytest.mark.parametrize("cls", [Stager, ReferenceStager])
def test_held_and_external_sessions_stage_the_same_rows(cls):
    held = InvariantChecker(cls(CFG))
    ext = InvariantChecker(cls(CFG.replace(rows="external")))
    assert held.mirror is None and ext.mirror.shape == (3 * ext.ring_rows, CFG.row_bytes)
    hp, xp = _session(held), _session(ext)
    assert len(hp) == len(xp) == 302
    for (a, a_rows), (b, b_rows) in zip(hp, xp):
        assert b.external and np.array_equal(a.slots, b.slots)
        assert a.n_rows and b_rows.tobytes() == a.encoded_rows.tobytes() == a_rows.tobytes()
    assert np.any(np.diff([p.slots[-1] for p, _ in xp[:300]]) < 0)  # the ring wrapped
    assert ext.calls == held.calls


def test_external_process_takes_the_rows_and_returns_the_slots():
    ext = InvariantChecker(Stager(CFG.replace(rows="external")))
    slots = ext.process(1, np.arange(4), _rows(4))
    np.testing.assert_array_equal(slots, ext.ring_rows + np.arange(4))
    assert not np.all(ext.mirror[slots] == UNWRITTEN)
    with pytest.raises(TypeError, match="pass them to process"):
        ext.process(1, np.arange(4, 6))
    with pytest.raises(ValueError, match="2 positions for 3 rows"):
        ext.process(1, np.arange(4, 6), _rows(3))
    enc = ext.plan_rows(ext.draft(1, 4))
    ext.commit(1)
    # process_encoded writes encoded rows as given
    slots = ext.process_encoded(1, np.arange(4, 6), enc[:2])
    assert ext.mirror[slots].tobytes() == enc[:2].tobytes()
    assert ext.state(1)["end"] == 6


def test_external_owner_rejects_unencodable_rows_before_the_stager_sees_them():
    st = Stager(CFG.replace(rows="external", nonfinite="error"))
    ext = InvariantChecker(st)
    rows = _rows(3)
    rows[1, 5] = np.nan
    with pytest.raises(ValueError, match="unencodable"):
        ext.process(0, np.arange(3), rows)
    assert st.state(0)["started"] is False  # the Stager was never asked for slots


def test_external_restore_needs_the_rows_of_a_snapshot_it_did_not_take():
    a = InvariantChecker(Stager(CFG.replace(rows="external")))
    a.process(0, np.arange(30), _rows(30))
    data = a.snapshot(0)
    saved = a.mirror[a.live_slots(0)].copy()
    b = InvariantChecker(Stager(CFG.replace(rows="external")))
    with pytest.raises(TypeError, match="holds no rows"):
        b.restore(1, data)
    assert b.state(1)["started"] is False
    slots = b.restore(1, data, saved)
    assert b.mirror[slots].tobytes() == saved.tobytes()
    plan = b.draft(1, 30)
    assert b.plan_rows(plan).tobytes() == a.plan_rows(a.draft(0, 30)).tobytes()
    # the same bookkeeping with other rows: the checker cannot tell which rows to restore
    a.begin(1)
    a.process(1, np.arange(30), _rows(30, seed=5))
    a.commit(0)
    assert a.snapshot(1) == data
    with pytest.raises(TypeError, match="holds no rows"):
        a.restore(2, data)


# ------------------------------------------------- a broken Stager is caught ---


class _Broken:
    """A Stager whose one method is replaced; everything else passes through."""

    def __init__(self, inner, **overrides):
        self._inner = inner
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _ext():
    return Stager(CFG.replace(rows="external"))


def _moves(moves, rows):
    return SlotMoves.wrap(np.asarray(rows, np.int64).reshape(-1, 3), moves.source, moves.serial)


def test_a_wrong_process_slot_is_caught():
    inner = _ext()
    st = _Broken(inner, process=lambda seq, pos: inner.process(seq, pos) + 1)  # every row one slot off
    with pytest.raises(InvariantViolation, match="slot"):
        InvariantChecker(st, inner.config).process(0, np.arange(5), _rows(5))


def test_a_live_row_without_a_slot_is_caught():
    inner = _ext()

    def process(seq, pos):
        slots = inner.process(seq, pos).copy()
        slots[-1] = -1  # "below the horizon", but it is the newest row
        return slots

    with pytest.raises(InvariantViolation, match="slot -1 must mark exactly the rows below the horizon"):
        InvariantChecker(_Broken(inner, process=process), inner.config).process(0, np.arange(5), _rows(5))


def test_a_fork_that_loses_its_moves_is_caught():
    inner = _ext()
    st = _Broken(inner, fork=lambda src, dst: _moves(inner.fork(src, dst), []))
    ck = InvariantChecker(st, inner.config)
    ck.process(0, np.arange(20), _rows(20))
    with pytest.raises(InvariantViolation, match="seq 1: the row of position 8 at slot"):  # the horizon: 20 - W
        ck.fork(0, 1)


def test_shift_moves_applied_in_another_order_are_caught():
    inner = _ext()
    st = _Broken(inner, shift=lambda seq, k, d: _moves(m := inner.shift(seq, k, d), np.asarray(m)[::-1]))
    ck = InvariantChecker(st, inner.config)
    ck.process(0, np.arange(20), _rows(20))
    with pytest.raises(InvariantViolation, match="is not the row the server gave"):
        ck.shift(0, 12, 2)  # rows 14..19 move down in pieces of 2: reversed, a piece reads an overwritten row


def test_overlapping_or_out_of_order_moves_are_caught():
    inner = _ext()
    st = _Broken(inner, fork=lambda src, dst: _moves(inner.fork(src, dst), [[0, 1, 5]]))
    ck = InvariantChecker(st, inner.config)
    ck.process(0, np.arange(20), _rows(20))
    with pytest.raises(InvariantViolation, match="overlaps itself"):
        ck.fork(0, 1)
    inner = _ext()
    stale = []
    st = _Broken(inner, fork=lambda src, dst: stale[0] if stale else stale.append(inner.fork(src, dst)) or stale[0])
    ck = InvariantChecker(st, inner.config)
    ck.process(0, np.arange(20), _rows(20))
    ck.fork(0, 1)
    with pytest.raises(InvariantViolation, match="serial"):
        ck.fork(0, 2)  # the same moves again: an owner must not apply them twice


def test_a_wrong_restore_slot_is_caught():
    inner = _ext()
    st = _Broken(inner, restore=lambda seq, data: inner.restore(seq, data)[::-1].copy())
    ck = InvariantChecker(st, inner.config)
    ck.process(0, np.arange(20), _rows(20))
    data = ck.snapshot(0)
    with pytest.raises(InvariantViolation):
        ck.restore(1, data)


def test_a_plan_outside_its_sequence_slots_is_caught():
    check_slots(np.array([10, 11, 0, 1], np.int64), 0, 4, CFG, "ok: two runs, the second from slot 0")
    R = CFG.ring_rows
    with pytest.raises(InvariantViolation, match="leave sequence 1"):
        check_slots(np.array([R - 1, R], np.int64), 1, 2, CFG, "plan")
    with pytest.raises(InvariantViolation, match="two runs"):
        check_slots(np.array([5, 7], np.int64), 0, 2, CFG, "plan")
    with pytest.raises(InvariantViolation, match="int64"):
        check_slots(np.array([5, 6], np.int32), 0, 2, CFG, "plan")
    inner = _ext()

    def draft(seq, n_past):
        plan = inner.draft(seq, n_past)
        plan.slots = plan.slots + R  # the rows of another sequence
        return plan

    ck = InvariantChecker(_Broken(inner, draft=draft), inner.config)
    ck.process(0, np.arange(20), _rows(20))
    with pytest.raises(InvariantViolation, match="leave sequence 0"):
        ck.draft(0, 20)


def test_a_plan_whose_slots_hold_other_rows_is_caught():
    inner = _ext()

    def draft(seq, n_past):
        plan = inner.draft(seq, n_past)
        plan.slots = plan.slots - 1  # still the sequence's slots, one row early
        return plan

    ck = InvariantChecker(_Broken(inner, draft=draft), inner.config)
    ck.process(0, np.arange(20), _rows(20))
    with pytest.raises(InvariantViolation, match="differs from the row the server gave"):
        ck.draft(0, 20)
