"""Batched calls against per-sequence calls (docs/design.md 2.9).

A hypothesis state machine drives two C++ Stagers with the same server steps,
one with the batched calls (``process_many``, ``draft_many`` (copying, and
zero-copy: ``copy=False``), ``commit_many``,
``fail_many``, ``accept_many``, ``end_many``, ``reserve_many`` /
``confirm_many`` / ``cancel_many``) and one with a loop of per-sequence
calls, in both row modes. After every step both agree on everything
observable: results (slots, plans, staged rows, the BatchPlan's arrays and
padded form, rebuilt here from the per-sequence plans), state, counters,
live slots and snapshot bytes. A rejected batch changes nothing, and when it
names ``seqs[i] (sequence s)`` the rest of its message is the per-sequence
call's own error for that sequence. The reference twin runs the same
batches: the same outcomes, word for word, and the same state.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import massive_rows
from dspark_core import Stager, StagerConfig, StateError
from dspark_core.reference import SEMANTIC_STATS, ReferenceStager
from dspark_core.stager.stage_plan import BATCH_ARRAYS, SKIP_REASONS

N_SEQS = 4
#: A batch's ids: mostly valid, sometimes unknown (-1, N_SEQS) or repeated.
IDS = hs.lists(hs.integers(-1, N_SEQS), max_size=4)
_NAMED = re.compile(r"^(\w+): seqs\[(\d+)\] \(sequence (-?\d+)\): (.*)$", re.S)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the type and the message are what is compared
        return ("raise", (type(exc), str(exc)))


def fingerprint(st: Stager, seq: int):
    """Everything observable about one sequence."""
    state = st.state(seq)
    snap = None if state["open_round"] or state["reservation_open"] else st.snapshot(seq)
    return state, st.stats(seq), st.live_slots(seq).tolist(), st.open_round_id(seq), snap


def expected_batch(plans, cfg: StagerConfig, max_rows: int) -> dict[str, np.ndarray]:
    """A BatchPlan's arrays, built from per-sequence plans without the BatchPlan code."""
    active = np.array([p.skip is None for p in plans], bool)
    n_rows = np.array([p.n_rows for p in plans], np.int64)
    crop = np.array([p.crop_from for p in plans], np.int64)
    block = np.full((len(plans), cfg.block_size), -1, np.int32)
    pos_pad = np.full((len(plans), max_rows), -1, np.int32)
    slot_pad = np.full((len(plans), max_rows), -1, np.int64)
    for i, p in enumerate(plans):
        if p.skip is None:
            block[i] = p.block_positions
        pos_pad[i, : p.n_rows] = p.positions
        slot_pad[i, : p.n_rows] = p.slots
    out = {
        "seqs": np.array([p.seq for p in plans], np.int64),
        "skip_code": np.array([0 if p.skip is None else 1 + SKIP_REASONS.index(p.skip) for p in plans], np.uint8),
        "active": active,
        "rebase": np.array([p.rebase for p in plans], bool),
        "clear_cache": np.array([p.clear_cache for p in plans], bool),
        "start": np.array([p.start for p in plans], np.int64),
        "pos_base": np.array([p.pos_base for p in plans], np.int64),
        "crop_from": crop,
        "round": np.array([p.round for p in plans], np.int64),
        "n_rows": n_rows,
        "block_positions": block,
        "row_offsets": np.concatenate([[0], np.cumsum(n_rows)]).astype(np.int64),
        "positions": np.concatenate([p.positions for p in plans] + [np.zeros(0, np.int32)]).astype(np.int32),
        "slots": np.concatenate([p.slots for p in plans] + [np.zeros(0, np.int64)]).astype(np.int64),
        "row_seq": np.repeat(np.array([p.seq for p in plans], np.int64), n_rows),
        "padded.positions": pos_pad,
        "padded.slots": slot_pad,
    }
    assert set(BATCH_ARRAYS) <= set(out)
    return out


class BatchedMatchesPerSequence(RuleBasedStateMachine):
    @initialize(
        external=hs.booleans(),
        block=hs.integers(1, 5),
        extra=hs.integers(1, 24),
        storage=hs.sampled_from(["f32", "q8_0", "bf16"]),
        max_failures=hs.integers(1, 3),
    )
    def setup(self, external, block, extra, storage, max_failures):
        self.cfg = StagerConfig(32, block, 2 * block + extra, max_seqs=N_SEQS, storage=storage,
                                max_failures=max_failures, rows="external" if external else "held")
        self.many, self.one = Stager(self.cfg), Stager(self.cfg)
        self.ref = ReferenceStager(self.cfg)  # the same batches on the reference twin
        self.external = external
        self.rng = np.random.default_rng(block * 100 + extra)

    # -- helpers ----------------------------------------------------------
    def end(self, seq: int) -> int:
        if not 0 <= seq < N_SEQS:
            return 0
        st = self.one.state(seq)
        return st["end"] if st["started"] else 0

    def batch(self, call: str, many_args: tuple, per_seq: list[tuple[str, int, tuple]]):
        """Run the batch on ``many``; on success, the per-sequence calls on ``one``
        (each must succeed); on rejection, nothing changed, and an error that
        names a sequence is that sequence's own error."""
        before = [fingerprint(self.many, s) for s in range(N_SEQS)]
        got = outcome(getattr(self.many, call), *many_args)
        twin = outcome(getattr(self.ref, call), *many_args)
        assert got[0] == twin[0], (call, got, twin)
        if got[0] == "raise":
            assert got[1] == twin[1], (call, got[1], twin[1])  # the same type and words
        elif call == "draft_many":
            for name in BATCH_ARRAYS:
                x, y = getattr(got[1], name), getattr(twin[1], name)
                assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), name
            if not self.external:
                assert got[1].rows.tobytes() == twin[1].rows.tobytes()
                assert got[1].zero_copy == twin[1].zero_copy
                assert [r.tobytes() for r in got[1].encoded_runs] == [r.tobytes() for r in twin[1].encoded_runs]
                np.testing.assert_array_equal(got[1].run_offsets, twin[1].run_offsets)
        elif got[1] is not None:
            np.testing.assert_array_equal(got[1], twin[1])
        if got[0] == "ok":
            results = [getattr(self.one, name)(seq, *args) for name, seq, args in per_seq]
            return got[1], results
        assert [fingerprint(self.many, s) for s in range(N_SEQS)] == before, f"rejected {call} changed state"
        kind, msg = got[1]
        m = _NAMED.match(msg)
        if m:
            assert m.group(1) == call
            i, seq = int(m.group(2)), int(m.group(3))
            assert int(np.asarray(many_args[0]).reshape(-1)[i]) == seq
            name, s, args = per_seq[i]
            want = outcome(getattr(self.one, name), s, *args)
            assert want[0] == "raise" and want[1] == (kind, m.group(4)), (msg, want)
        return None, None

    # -- rules --------------------------------------------------------------
    @rule(seqs=IDS, lens=hs.lists(hs.integers(0, 40), min_size=4, max_size=4),
          bad=hs.sampled_from([None, None, None, "gap", "nan", "cu"]), at=hs.integers(0, 3))
    def process(self, seqs, lens, bad, at):
        lens = lens[: len(seqs)]
        starts = [self.end(s) for s in seqs]
        if bad == "gap" and seqs:
            starts[at % len(seqs)] += 1
        positions = [np.arange(a, a + n, dtype=np.int64) for a, n in zip(starts, lens)]
        flat = np.concatenate(positions + [np.zeros(0, np.int64)])
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        if bad == "cu" and seqs:
            cu[-1] += 1
        if self.external:
            got, res = self.batch("process_many", (seqs, cu, flat),
                                  [("process", s, (p,)) for s, p in zip(seqs, positions)])
            if got is not None:
                np.testing.assert_array_equal(got, np.concatenate(res + [np.zeros(0, np.int64)]))
                assert got.dtype == np.int64
            return
        rows = massive_rows(self.rng, len(flat), 32) * np.float32(0.01)
        if bad == "nan" and len(flat):
            rows[int(self.rng.integers(len(flat))), int(self.rng.integers(32))] = np.nan
        parts = np.split(rows, cu[1:-1]) if bad != "cu" else [rows[:0]] * len(seqs)
        self.batch("process_many", (seqs, cu, flat, rows),
                   [("process", s, (p, r)) for s, p, r in zip(seqs, positions, parts)])

    @rule(seqs=IDS, delta=hs.sampled_from([0, 0, 0, 1, -1, -10**6]), max_rows=hs.integers(0, 8),
          copy=hs.sampled_from([True, True, False, "no"]))
    def draft(self, seqs, delta, max_rows, copy):
        # copy=False: zero-copy views (external mode: refused, as is a copy that is not a bool).
        pasts = [max(-1, self.end(s) + delta) for s in seqs]
        got, res = self.batch("draft_many", (seqs, pasts, copy),
                              [("draft", s, (p, copy)) for s, p in zip(seqs, pasts)])
        if got is None:
            return
        width = max(max_rows, max([p.n_rows for p in res] + [0]))
        want = expected_batch(res, self.cfg, width)
        padded = got.padded(width)
        for name, value in [*((n, getattr(got, n)) for n in BATCH_ARRAYS),
                            ("padded.positions", padded.positions), ("padded.slots", padded.slots)]:
            w = want[name]
            assert (value.dtype, value.shape) == (w.dtype, w.shape), name
            np.testing.assert_array_equal(value, w, err_msg=name)
        if not self.external:
            assert got.rows.tobytes() == b"".join(p.rows.tobytes() for p in res)
            assert got.encoded_rows.tobytes() == b"".join(p.encoded_rows.tobytes() for p in res)
            # The runs: each sequence's where its slots break, views of the rings when zero-copy.
            assert got.zero_copy == (copy is False)
            runs = [r for p in res for r in p.encoded_runs]
            assert [r.tobytes() for r in got.encoded_runs] == [r.tobytes() for r in runs]
            assert got.run_offsets.tolist() == np.cumsum([0] + [len(p.encoded_runs) for p in res]).tolist()
            assert [r.tobytes() for r in got.row_runs] == [r.tobytes() for p in res for r in p.row_runs]
            if got.zero_copy:
                assert all(not r.flags.writeable and not r.flags.owndata for r in got.encoded_runs)
        for a, b in zip(got.plans, res):
            assert (a.seq, a.skip, a.round, a.crop_from, a.pos_base) == (b.seq, b.skip, b.round, b.crop_from, b.pos_base)
            np.testing.assert_array_equal(a.block_positions, b.block_positions)
            if not self.external:
                assert a.rows.tobytes() == b.rows.tobytes()
                assert a.zero_copy == b.zero_copy
                assert [r.tobytes() for r in a.encoded_runs] == [r.tobytes() for r in b.encoded_runs]

    @rule(seqs=IDS, stage=hs.sampled_from(["commit", "decode", "crop", "mixed", "bad"]))
    def close(self, seqs, stage):
        if stage == "commit":
            self.batch("commit_many", (seqs,), [("commit", s, ()) for s in seqs])
            return
        stages = [("decode", "crop")[k % 2] for k in range(len(seqs))] if stage == "mixed" else \
            ["decode"] * len(seqs) if stage == "decode" else ["crop"] * len(seqs)
        if stage == "bad" and seqs:
            stages[-1] = "verify"
        self.batch("fail_many", (seqs, stages), [("fail", s, (g,)) for s, g in zip(seqs, stages)])

    @rule(seqs=IDS, counts=hs.lists(hs.integers(-1, 6), min_size=4, max_size=4))
    def accept(self, seqs, counts):
        counts = counts[: len(seqs)]
        self.batch("accept_many", (seqs, counts), [("accept", s, (c,)) for s, c in zip(seqs, counts)])

    @rule(seqs=IDS)
    def end_requests(self, seqs):
        self.batch("end_many", (seqs,), [("end", s, ()) for s in seqs])

    @precondition(lambda self: self.external)
    @rule(seqs=IDS, lens=hs.lists(hs.integers(0, 12), min_size=4, max_size=4), then=hs.sampled_from(["confirm", "cancel", "leave"]))
    def reserve(self, seqs, lens, then):
        lens = lens[: len(seqs)]
        positions = [np.arange(self.end(s), self.end(s) + n, dtype=np.int64) for s, n in zip(seqs, lens)]
        flat = np.concatenate(positions + [np.zeros(0, np.int64)])
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        got, res = self.batch("reserve_many", (seqs, cu, flat), [("reserve", s, (p,)) for s, p in zip(seqs, positions)])
        if got is not None:
            np.testing.assert_array_equal(got, np.concatenate(res + [np.zeros(0, np.int64)]))
        if then != "leave":
            self.batch(f"{then}_many", (seqs,), [(then, s, ()) for s in seqs])

    @rule(seqs=IDS)
    def open_rounds(self, seqs):
        a = outcome(self.many.open_round_ids, seqs)
        b = outcome(lambda: np.array([self.one.open_round_id(s) for s in seqs], np.int64))
        assert a[0] == b[0]
        if a[0] == "ok":
            np.testing.assert_array_equal(a[1], b[1])

    @invariant()
    def same_everywhere(self):
        for s in range(N_SEQS):
            assert fingerprint(self.many, s) == fingerprint(self.one, s), s
            a, b = fingerprint(self.many, s), fingerprint(self.ref, s)
            assert (a[0], a[2], a[3], a[4]) == (b[0], b[2], b[3], b[4]), s
            assert {k: a[1][k] for k in SEMANTIC_STATS} == {k: b[1][k] for k in SEMANTIC_STATS}, s


TestBatchedMatchesPerSequence = BatchedMatchesPerSequence.TestCase


# -- errors ---------------------------------------------------------------------


@pytest.fixture(params=["held", "external"])
def primed(request):
    """Sequences 0, 1, 3 hold rows 0..5; sequence 2 has an open round."""
    st = Stager(StagerConfig(32, 4, 24, max_seqs=N_SEQS, rows=request.param))
    for s in (0, 1, 2, 3):
        if request.param == "external":
            st.process(s, np.arange(6))
        else:
            st.process(s, np.arange(6), massive_rows(np.random.default_rng(s), 6, 32))
    st.draft(2, 6)
    return st


def rows_if_held(st, n):
    return None if st.config.rows == "external" else np.ones((n, 32), np.float32)


def test_batch_errors_name_the_sequence_and_the_argument(primed):
    st = primed
    before = [fingerprint(st, s) for s in range(N_SEQS)]
    cases = [
        (ValueError, r"^process_many: seqs\[1\] \(sequence 7\): unknown sequence 7 ",
         lambda: st.process_many([0, 7], [0, 1, 2], [6, 6], rows_if_held(st, 2))),
        (StateError, r"^process_many: seqs\[1\] \(sequence 2\): sequence 2 has an open round",
         lambda: st.process_many([0, 2], [0, 1, 2], [6, 6], rows_if_held(st, 2))),
        (ValueError, r"^process_many: sequence 0 appears twice \(seqs\[0\] and seqs\[1\]\)",
         lambda: st.process_many([0, 0], [0, 1, 2], [6, 7], rows_if_held(st, 2))),
        (ValueError, r"cu_seqlens must have 3 entries \(one more than seqs\), got 2",
         lambda: st.process_many([0, 1], [0, 2], [6, 6], rows_if_held(st, 2))),
        (ValueError, r"cu_seqlens must not decrease",
         lambda: st.process_many([0, 1], [0, 2, 1], [6], rows_if_held(st, 1))),
        (ValueError, r"^process_many: seqs\[1\] \(sequence 3\): sequence 3: positions must continue at 6, got 9",
         lambda: st.process_many([1, 3], [0, 1, 2], [6, 9], rows_if_held(st, 2))),
        (TypeError, r"^process_many: seqs must be integers, got dtype float64",
         lambda: st.process_many([0.5], [0, 1], [6], rows_if_held(st, 1))),
        (ValueError, r"^draft_many: seqs\[0\] \(sequence 1\): n_past",
         lambda: st.draft_many([1, 0], [-5, 6])),
        (ValueError, r"^draft_many: 2 sequences for 1 n_pasts values",
         lambda: st.draft_many([1, 0], [6])),
        (StateError, r"^commit_many: seqs\[0\] \(sequence 0\): sequence 0 has no open round",
         lambda: st.commit_many([0, 2])),
        (ValueError, r"^fail_many: seqs\[0\] \(sequence 2\): stage must be one of \('decode', 'crop'\), got 'x'",
         lambda: st.fail_many([2], ["x"])),
        (ValueError, r"^accept_many: seqs\[1\] \(sequence 1\): n_accepted",
         lambda: st.accept_many([0, 1], [0, -2])),
        (ValueError, r"^end_many: seqs\[0\] \(sequence -1\): unknown sequence -1",
         lambda: st.end_many([-1])),
        (StateError, r"^confirm_many: seqs\[0\] \(sequence 0\): sequence 0 has no reserved rows",
         lambda: st.confirm_many([0])),
        (ValueError, r"^open_round_ids: seqs\[0\] \(sequence 9\): unknown sequence 9",
         lambda: st.open_round_ids([9])),
    ]
    if st.config.rows == "external":
        cases.append((TypeError, r"^process_many: this Stager runs in external-row mode",
                      lambda: st.process_many([0], [0, 1], [6], np.ones((1, 32), np.float32))))
    else:
        bad = np.ones((2, 32), np.float32)
        bad[1, 7] = np.inf
        cases += [
            (ValueError, r"^process_many: seqs\[1\] \(sequence 3\): sequence 3: row 0 \(position 6\), channel 7 holds inf",
             lambda: st.process_many([1, 3], [0, 1, 2], [6, 6], bad)),
            (TypeError, r"^process_many: rows are required", lambda: st.process_many([0], [0, 1], [6])),
            (ValueError, r"^reserve_many needs external-row mode", lambda: st.reserve_many([0], [0, 1], [6])),
        ]
    for kind, pattern, call in cases:
        with pytest.raises(kind, match=pattern):
            call()
    assert [fingerprint(st, s) for s in range(N_SEQS)] == before


def test_batch_integers_beyond_int64_are_clamped_as_per_sequence_arguments_are():
    """A list holding a Python int beyond int64 (numpy makes it an object array) is clamped as
    the per-sequence calls clamp their integer arguments, so the batch raises the per-sequence
    call's own error, named; core and reference alike. Other objects stay a TypeError."""
    cfg = StagerConfig(32, 4, 24, max_seqs=2)
    for st in (Stager(cfg), ReferenceStager(cfg)):
        st.process(0, np.arange(6), massive_rows(np.random.default_rng(0), 6, 32))
        with pytest.raises(ValueError) as one:
            st.draft(2**70, 6)
        with pytest.raises(ValueError) as many:
            st.draft_many([0, 2**70], [6, 6])
        assert str(many.value) == f"draft_many: seqs[1] (sequence {2**63 - 1}): {one.value}"
        with pytest.raises(ValueError) as one:
            st.draft(0, -(2**70))
        with pytest.raises(ValueError) as many:
            st.draft_many([0], [-(2**70)])
        assert str(many.value) == f"draft_many: seqs[0] (sequence 0): {one.value}"
        with pytest.raises(TypeError, match="end_many: seqs must be integers, got dtype object"):
            st.end_many([1, None])
        assert not st.state(0)["open_round"]


# -- BatchPlan: arrays computed once, a fixed padded shape ----------------------------


def test_batch_plan_properties_are_computed_once_and_padded_shape_is_fixed():
    cfg = StagerConfig(32, 4, 40, max_seqs=8, rows="external")
    st = Stager(cfg)
    shapes = set()
    pos_buf = np.empty((8, 16), np.int32)
    slot_buf = np.empty((8, 16), np.int64)
    ends = [0] * 8
    for step in range(12):
        lens = [(step * 5 + s * 3) % 9 + 1 for s in range(8)]
        flat = np.concatenate([np.arange(ends[s], ends[s] + n) for s, n in enumerate(lens)])
        st.process_many(np.arange(8), np.concatenate([[0], np.cumsum(lens)]), flat)
        ends = [e + n for e, n in zip(ends, lens)]
        bp = st.draft_many(np.arange(8), ends)
        # Each derived array is one object, computed on first access (no dict, no copy per access).
        for name in ("active", "n_rows", "block_positions", "row_seq", "plans", "skips"):
            assert getattr(bp, name) is getattr(bp, name), name
        assert bp.plan(3) is bp.plans[3]
        assert isinstance(bp.crop_from, np.ndarray) and isinstance(bp.clear_cache, np.ndarray)
        fit = bool((bp.n_rows <= 16).all())
        if fit:
            padded = bp.padded(16, positions_out=pos_buf, slots_out=slot_buf)
            assert padded.positions is pos_buf and padded.slots is slot_buf
            shapes.add((padded.positions.shape, padded.slots.shape))
            for i in range(8):
                k = int(bp.n_rows[i])
                np.testing.assert_array_equal(pos_buf[i, :k], bp.positions[bp.row_offsets[i]: bp.row_offsets[i + 1]])
                assert (pos_buf[i, k:] == -1).all() and (slot_buf[i, k:] == -1).all()
        else:
            big = int(np.flatnonzero(bp.n_rows > 16)[0])
            with pytest.raises(ValueError, match=f"sequence {big}"):
                bp.padded(16, positions_out=pos_buf, slots_out=slot_buf)
        assert bp.padded().positions.shape == (8, st.config.window - st.config.block_size)
        st.commit_many(bp.seqs[bp.active])
    assert shapes == {((8, 16), (8, 16))}


def test_stage_plan_positions_are_made_once_on_first_access():
    """A plan from draft makes positions / block_positions when first asked (a server that reads
    only crop_from and the rows pays for neither), once, equal to the reference's eager arrays."""
    cfg = StagerConfig(32, 4, 24)
    st, ref = Stager(cfg), ReferenceStager(cfg)
    rows = massive_rows(np.random.default_rng(9), 30, 32)
    for s in (st, ref):
        s.process(0, np.arange(30), rows)
    plan, want = st.draft(0, 30), ref.draft(0, 30)
    assert plan.n_rows == want.n_rows > 0
    for name in ("positions", "block_positions"):
        got, exp = getattr(plan, name), getattr(want, name)
        assert got is getattr(plan, name), name
        assert (got.dtype, got.shape, got.tobytes()) == (exp.dtype, exp.shape, exp.tobytes()), name
    assert plan.positions[-1] + 1 == plan.crop_from == plan.block_positions[0]
    from dspark_core.stager.stage_plan import StagePlan
    common = dict(seq=0, start=1, skip=None, rebase=False, clear_cache=False, crop_from=1, pos_base=0,
                  encoded_rows=None, external=True)
    for bad in ({}, {"n_rows": 1}, {"positions": np.zeros(1, np.int32), "n_rows": 1, "block_size": 4}):
        with pytest.raises(TypeError, match="positions or n_rows"):
            StagePlan(**common, **bad)


# -- end ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["idle", "open_round", "reservation"])
def test_end_frees_the_ring_and_leaves_a_new_stagers_sequence(how):
    rows = "external" if how == "reservation" else "held"
    cfg = StagerConfig(64, 4, 32, max_seqs=2, rows=rows)
    st, fresh = Stager(cfg), Stager(cfg)
    if rows == "held":
        st.process(1, np.arange(20), massive_rows(np.random.default_rng(0), 20, 64))
        assert st.stats(1)["bytes"] > 0 and st.stats(1)["reserved_bytes"] > 0
    else:
        st.process(1, np.arange(20))
    if how == "open_round":
        assert st.draft(1, 20).skip is None
    elif how == "reservation":
        st.reserve(1, np.arange(20, 25))
    st.end(1)
    assert fingerprint(st, 1)[:4] == fingerprint(fresh, 1)[:4]
    assert st.stats(1)["bytes"] == st.stats(1)["reserved_bytes"] == 0
    st.process(1, np.arange(500, 503), None if rows == "external" else np.ones((3, 64), np.float32))
    assert st.state(1)["end"] == 503  # the next request starts anywhere
