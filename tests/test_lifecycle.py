"""Lifecycle beyond draft / commit / accept: rollback, fork, shift, snapshot/restore, draft_many.

Each runs on the core and the reference (``make_stager``); the state machine
in test_stager_state_machine.py also interleaves them at random.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import feature_rows

from dspark_core import StagerConfig, StateError
from dspark_core.stager.config import STORAGES
from dspark_core.stager.stage_plan import SKIP_REASONS

D, B, W = 32, 4, 16  # K = 8


def run_rounds(st, seq, n_past, accepts, version=0):
    """Drive whole rounds (draft, commit, verify B + 1 rows, accept); returns the new n_past."""
    for _k, n in enumerate(accepts):
        plan = st.draft(seq, n_past)
        assert plan.skip is None
        st.commit(seq)
        st.process(seq, np.arange(n_past, n_past + B + 1), feature_rows(range(n_past, n_past + B + 1), D, version))
        st.accept(seq, n)
        n_past += n + 1
    return n_past


# -- rollback -----------------------------------------------------------------

def test_rollback_inside_pending_rows_keeps_the_cache(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(6), feature_rows(range(6), D))
    st.draft(0, 6)
    st.commit(0)  # cache holds [0, 6)
    st.process(0, np.arange(6, 10), feature_rows(range(6, 10), D))
    st.rollback(0, 8)  # drop 8, 9: the cache did not reach them
    s = st.state(0)
    assert (s["end"], s["n_cache"], s["restage_owed"]) == (8, 6, False)
    plan = st.draft(0, 8)
    assert not plan.rebase and list(plan.positions) == [6, 7]


def test_rollback_into_the_cache_forces_a_clean_restage(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(10), feature_rows(range(10), D))
    st.draft(0, 10)
    st.commit(0)  # cache holds [0, 10)
    st.rollback(0, 7)  # prefix reuse: the target kept 7 tokens
    s = st.state(0)
    assert (s["end"], s["n_cache"], s["restage_owed"]) == (7, 7, True)
    assert st.draft(0, 7).skip == "no_context"  # nothing new since the (rolled back) cache end
    st.process(0, np.arange(7, 9), feature_rows(range(7, 9), D, version=1))
    plan = st.draft(0, 9)
    assert plan.rebase and plan.clear_cache
    # The last W positions stay stageable (horizon = max(horizon, f - W) = 0
    # here), so the rollback costs no context: the restage keeps K = 8 rows.
    assert st.state(0)["horizon"] == 0
    assert plan.pos_base == 1 and list(plan.positions) == list(range(8))
    np.testing.assert_array_equal(plan.rows[-2:], feature_rows(range(7, 9), D, version=1))
    np.testing.assert_array_equal(plan.rows[:6], feature_rows(range(1, 7), D))


@pytest.mark.parametrize("storage", ["f32", "q4_0"])
def test_rollback_of_a_long_session_restages_a_full_context(make_stager, storage):
    """A regenerate 600 positions back after a 10k prefill and 300 rounds still
    restages K rows, and they are the rows originally captured there."""
    d, b, w = 64, 8, 2048
    k = min(w // 2, w - b)
    st = make_stager(feature_dim=d, block_size=b, window=w, storage=storage)
    ref = make_stager(feature_dim=d, block_size=b, window=w, storage=storage)
    prompt = 10_000
    for lo in range(0, prompt, 1024):  # prefill in n_batch chunks
        hi = min(prompt, lo + 1024)
        st.process(0, np.arange(lo, hi), feature_rows(range(lo, hi), d))
    n_past = prompt
    rng = random.Random(7)
    for _ in range(300):
        plan = st.draft(0, n_past)
        assert plan.skip is None
        st.commit(0)
        st.process(0, np.arange(n_past, n_past + b + 1), feature_rows(range(n_past, n_past + b + 1), d))
        n = rng.randint(0, b)
        st.accept(0, n)
        n_past += n + 1
    assert st.stats(0)["live_rows"] <= w + b  # the bound W + TRIM_CHUNK + B + 1 minus the lazy head
    back = n_past - 600
    st.rollback(0, back)
    st.process(0, np.arange(back, back + 1), feature_rows(range(back, back + 1), d, version=1))
    plan = st.draft(0, back + 1)
    assert plan.rebase and plan.clear_cache
    assert len(plan.positions) == k and plan.pos_base == back + 1 - k
    assert list(plan.positions) == list(range(k))
    # The expected rows: the same positions captured into a fresh stager.
    ref.process(0, np.arange(back + 1 - k, back), feature_rows(range(back + 1 - k, back), d))
    ref.process(0, np.arange(back, back + 1), feature_rows(range(back, back + 1), d, version=1))
    want = ref.draft(0, back + 1)
    np.testing.assert_array_equal(plan.encoded_rows, want.encoded_rows)
    np.testing.assert_array_equal(plan.rows, want.rows)


def test_rollback_with_open_round_is_a_state_error(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(4), feature_rows(range(4), D))
    st.draft(0, 4)
    with pytest.raises(StateError):
        st.rollback(0, 2)
    st.fail(0)
    st.rollback(0, 2)
    assert st.state(0)["end"] == 2


# -- fork ---------------------------------------------------------------------

def test_fork_child_restages_and_diverges(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=3)
    st.process(0, np.arange(5), feature_rows(range(5), D))
    n = run_rounds(st, 0, 5, [4, 2, 3])
    st.fork(0, 1)
    st.fork(0, 2)
    assert st.snapshot(1) != st.snapshot(0)  # owes a restage; rows are the same
    assert st.state(1)["restage_owed"] and not st.state(0)["restage_owed"]
    parent = st.draft(0, n)
    child = st.draft(1, n)
    assert not parent.rebase and child.rebase and child.clear_cache
    np.testing.assert_array_equal(child.rows[-parent.n_rows:], parent.rows)
    st.commit(0)
    st.commit(1)
    # Diverge: different verify rows and accept counts.
    st.process(0, np.arange(n, n + B + 1), feature_rows(range(n, n + B + 1), D, version=10))
    st.process(1, np.arange(n, n + B + 1), feature_rows(range(n, n + B + 1), D, version=20))
    st.accept(0, 4)
    st.accept(1, 1)
    a = st.draft(0, n + 5)
    b = st.draft(1, n + 2)
    np.testing.assert_array_equal(a.rows[-5:], feature_rows(range(n, n + 5), D, version=10))
    np.testing.assert_array_equal(b.rows[-2:], feature_rows(range(n, n + 2), D, version=20))
    # The second child never saw either write.
    c = st.draft(2, n)
    assert c.rebase
    np.testing.assert_array_equal(c.rows[-1], feature_rows([n - 1], D)[0])


def test_fork_rejects_open_rounds_and_self(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=2)
    st.process(0, np.arange(4), feature_rows(range(4), D))
    with pytest.raises(ValueError, match="two different"):
        st.fork(0, 0)
    st.draft(0, 4)
    with pytest.raises(StateError):
        st.fork(0, 1)
    with pytest.raises(StateError):
        st.fork(1, 0)


# -- shift --------------------------------------------------------------------

def test_shift_mirrors_the_targets_context_shift(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(12), feature_rows(range(12), D))
    st.draft(0, 12)
    st.commit(0)  # 12 + 4 = 16 <= 16: no rebase, cache [0, 12)
    st.shift(0, 2, 3)  # drop [2, 5); 5.. move down by 3
    s = st.state(0)
    assert s["end"] == 9 and s["restage_owed"]
    st.process(0, [9], feature_rows([12], D, version=1))  # the target's next row, at its new position
    plan = st.draft(0, 10)
    assert plan.rebase and plan.pos_base == 2
    want = np.concatenate([feature_rows(range(5, 12), D), feature_rows([12], D, version=1)])
    np.testing.assert_array_equal(plan.rows, want)  # rows 5..11 now live at 2..8


def test_shift_keeps_prefix_rows(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(8), feature_rows(range(8), D))
    st.shift(0, 3, 2)
    plan = st.draft(0, 6)
    np.testing.assert_array_equal(plan.rows, feature_rows([0, 1, 2, 5, 6, 7], D))


# -- snapshot / restore -------------------------------------------------------

@pytest.mark.parametrize("storage", STORAGES)
def test_snapshot_round_trip_into_another_slot(make_stager, storage):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=2, storage=storage)
    st.process(0, np.arange(40), feature_rows(range(40), D))
    n = run_rounds(st, 0, 40, [1, 4, 0, 2])
    data = st.snapshot(0)
    st.restore(1, data)
    a, b = st.state(0), st.state(1)
    assert b["restage_owed"] and {k: v for k, v in a.items() if k != "restage_owed"} == {
        k: v for k, v in b.items() if k != "restage_owed"
    }
    pa, pb = st.draft(0, n), st.draft(1, n)
    assert pb.rebase
    np.testing.assert_array_equal(pb.rows[-pa.n_rows:], pa.rows)


def test_snapshot_of_a_fresh_sequence_restores(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=2)
    st.process(1, np.arange(4), feature_rows(range(4), D))
    st.restore(1, st.snapshot(0))
    assert st.state(1) == st.state(0)
    assert st.draft(1, 4).skip == "empty"


def test_restore_into_a_different_config_names_the_mismatch(make_stager):
    a = make_stager(feature_dim=D, block_size=B, window=W)
    a.process(0, np.arange(4), feature_rows(range(4), D))
    data = a.snapshot(0)
    for kw in [dict(window=W + 2), dict(block_size=B + 1), dict(storage="f16"), dict(feature_dim=64)]:
        cfg = dict(feature_dim=D, block_size=B, window=W)
        cfg.update(kw)
        b = make_stager(**cfg)
        b.process(0, np.arange(3), feature_rows(range(3), cfg["feature_dim"]))
        before = (b.state(0), b.snapshot(0))
        with pytest.raises(ValueError, match="snapshot was taken with"):
            b.restore(0, data)
        assert (b.state(0), b.snapshot(0)) == before


def test_snapshot_fuzz_flip_truncate_extend(make_stager):
    """Every damaged snapshot is a ValueError and leaves the slot exactly as it was."""
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=2, storage="q4_0")
    st.process(0, np.arange(30), feature_rows(range(30), D))
    run_rounds(st, 0, 30, [2, 3])
    good = st.snapshot(0)
    st.process(1, np.arange(5), feature_rows(range(5), D, version=3))
    before = (st.state(1), st.stats(1), st.snapshot(1))
    rng = random.Random(1234)
    damaged = []
    for i in range(len(good)):  # every byte, one bit each
        b = bytearray(good)
        b[i] ^= 1 << rng.randrange(8)
        damaged.append(bytes(b))
    for _ in range(300):  # multi-byte damage
        b = bytearray(good)
        for _ in range(rng.randrange(2, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        damaged.append(bytes(b))
    damaged += [good[:k] for k in range(0, len(good), 7)]
    damaged += [good + bytes(k) for k in (1, 4, 9)] + [good + good]
    damaged += [b"", b"DSPK", bytes(200)]
    for data in damaged:
        if data == good:
            continue
        with pytest.raises(ValueError):
            st.restore(1, data)
    assert (st.state(1), st.stats(1), st.snapshot(1)) == before
    st.restore(1, good)
    assert st.state(1)["end"] == st.state(0)["end"]


# -- draft_many ---------------------------------------------------------------

@pytest.mark.parametrize("storage", ["f32", "q8_0"])
def test_draft_many_equals_per_sequence_drafts(make_stager, storage):
    cfg = dict(feature_dim=D, block_size=B, window=W, max_seqs=4, storage=storage)
    one, many = make_stager(**cfg), make_stager(**cfg)
    for st in (one, many):
        for s, (p0, n) in enumerate([(0, 5), (3, 30), (0, 2), (10, 12)]):
            st.process(s, np.arange(p0, p0 + n), feature_rows(range(p0, p0 + n), D, version=s))
    st_one = [one.draft(s, p) for s, p in zip([3, 0, 1, 2], [22, 5, 33, 1])]
    batch = many.draft_many([3, 0, 1, 2], [22, 5, 33, 1])
    assert batch.seqs.tolist() == [3, 0, 1, 2]
    assert batch.skips == {2: "missing_rows"}
    assert batch.skip_code.tolist() == [0, 0, 0, 1 + SKIP_REASONS.index("missing_rows")]
    for a, b in zip(st_one, batch.plans):
        assert (a.skip, a.rebase, a.clear_cache, a.crop_from, a.pos_base) == (b.skip, b.rebase, b.clear_cache, b.crop_from, b.pos_base)
        np.testing.assert_array_equal(a.positions, b.positions)
        np.testing.assert_array_equal(a.block_positions, b.block_positions)
        np.testing.assert_array_equal(a.rows, b.rows)
    active = [p for p in st_one if p.skip is None]
    np.testing.assert_array_equal(batch.rows, np.concatenate([p.rows for p in active]))
    np.testing.assert_array_equal(batch.positions, np.concatenate([p.positions for p in active]))
    np.testing.assert_array_equal(batch.row_seq, np.concatenate([np.full(p.n_rows, p.seq) for p in active]))
    assert batch.crop_from.tolist() == [p.crop_from for p in st_one]
    assert batch.n_rows.tolist() == [p.n_rows for p in st_one]
    np.testing.assert_array_equal(batch.row_offsets, np.cumsum([0] + [p.n_rows for p in st_one]))
    for s in (3, 0, 1):
        many.commit(s)
    with pytest.raises(StateError):
        many.commit(2)  # skipped: no round was opened


def test_draft_many_is_atomic(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=3)
    for s in range(3):
        st.process(s, np.arange(4), feature_rows(range(4), D))
    st.draft(2, 4)
    before = [st.state(s) for s in range(3)]
    with pytest.raises(StateError):
        st.draft_many([0, 1, 2], [4, 4, 4])
    with pytest.raises(ValueError):
        st.draft_many([0, 1, 7], [4, 4, 4])
    with pytest.raises(ValueError):
        st.draft_many([0, 1], [4, -4])
    assert [st.state(s) for s in range(3)] == before


def test_stager_config_survives_repr(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    assert isinstance(st.config, StagerConfig)


def test_empty_draft_many_keeps_shapes(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W, storage="q8_0", stage_dtype="float16")
    batch = st.draft_many([], [])
    assert batch.rows.shape == (0, D) and batch.rows.dtype == np.float16
    assert batch.encoded_rows.shape == (0, D // 32 * 34) and batch.encoded_rows.dtype == np.uint8
    assert batch.positions.shape == (0,) and batch.skips == {}
