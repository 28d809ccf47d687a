"""The toy target and drafter: determinism, rollback, cache discipline, incremental == recompute."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core.sim.toy import (
    DrafterFailure, FlakyDrafter, ToyDrafter, ToyTarget, greedy_reference, rope, rope_angles, untrained_angles,
)

# float64 drafter: incremental and batch evaluation differ only in summation order (~n * 2**-53).
RTOL = ATOL = 1e-9


def _prompt(n: int, seed: int = 0, vocab: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


def test_target_is_deterministic_and_batch_independent():
    a, b = ToyTarget(seed=3), ToyTarget(seed=3)
    p = _prompt(50)
    out_a = a.decode(p)
    out_b = b.decode(p[:20])
    out_b2 = b.decode(p[20:])
    assert np.array_equal(out_a.next_tokens, np.concatenate([out_b.next_tokens, out_b2.next_tokens]))
    # Rows agree to float32 rounding: a batch split may change BLAS's summation order.
    np.testing.assert_allclose(out_a.rows, np.concatenate([out_b.rows, out_b2.rows]), rtol=1e-5, atol=1e-6)
    assert out_a.rows.dtype == np.float32 and out_a.rows.shape == (50, 128)


def test_target_rows_depend_on_the_whole_prefix():
    t = ToyTarget(seed=1)
    p = _prompt(40)
    r1 = t.decode(p).rows
    t.reset()
    q = p.copy()
    q[0] = (q[0] + 1) % t.vocab_size  # change only the first token
    r2 = t.decode(q).rows
    assert not np.allclose(r1[-1], r2[-1])


def test_target_rollback_matches_fresh_decode():
    t = ToyTarget(seed=2)
    p = _prompt(30)
    t.decode(p)
    t.decode([1, 2, 3, 4])
    t.rollback(31)
    after = t.decode([5, 6])
    ref = ToyTarget(seed=2)
    ref.decode(p)
    ref.decode([1])
    want = ref.decode([5, 6])
    assert np.array_equal(after.next_tokens, want.next_tokens)
    assert np.array_equal(after.rows, want.rows)
    with pytest.raises(ValueError):
        t.rollback(t.n_past + 1)


def test_greedy_reference_is_nontrivial():
    t = ToyTarget(seed=0, deviation=0.05)
    toks = greedy_reference(t, _prompt(100), 1000)
    assert len(toks) == 1000
    assert len(set(toks.tolist())) > 50  # not a short cycle
    dev = np.mean(toks[1:] != t.perm[toks[:-1]])
    assert 0.01 < dev < 0.15


def test_rope_is_relative():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 1, 32)), rng.standard_normal((1, 1, 32))
    s1 = float(np.sum(rope(q, np.array([10])) * rope(k, np.array([3]))))
    s2 = float(np.sum(rope(q, np.array([1010])) * rope(k, np.array([1003]))))
    assert s1 == pytest.approx(s2, rel=1e-9, abs=1e-9)


def _ctx(t: ToyTarget, n: int) -> np.ndarray:
    t.reset()
    return t.decode(_prompt(n, 7)).rows


def test_incremental_equals_recompute_with_chunks_and_crops():
    t = ToyTarget(seed=4)
    rows = _ctx(t, 300)
    d = ToyDrafter.for_target(t, 8)
    block = [5] + [d.mask_token_id] * 7
    n = 0
    for chunk in (100, 1, 37, 0, 162):
        hi = n + chunk
        inc = d.decode(0, np.arange(n, hi), rows[n:hi], block, np.arange(hi, hi + 8))
        assert d.cache_len(0) == hi + 8
        d.crop(0, hi)
        assert d.cache_len(0) == hi
        ref = d.recompute(rows[:hi], np.arange(hi), block, np.arange(hi, hi + 8))
        np.testing.assert_allclose(inc, ref, rtol=RTOL, atol=ATOL)
        n = hi


def test_drafter_is_position_invariant_by_construction():
    """RoPE is relative: the same rows at shifted positions give the same logits (to rounding)."""
    t = ToyTarget(seed=4)
    rows = _ctx(t, 64)
    d = ToyDrafter.for_target(t, 8)
    block = [5] + [d.mask_token_id] * 7
    a = d.recompute(rows, np.arange(64), block, np.arange(64, 72))
    b = d.recompute(rows, np.arange(64) + 5000, block, np.arange(5064, 5072))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_drafter_predicts_the_target():
    t = ToyTarget(seed=5, deviation=0.0)
    p = _prompt(100)
    toks = greedy_reference(t, p, 40)
    d = ToyDrafter.for_target(t, 8)
    rows = t.rows_at(0, 120)
    start = 120
    last = int(t.tokens[start])
    logits = d.recompute(rows, np.arange(start), [last] + [d.mask_token_id] * 7, np.arange(start, start + 8))
    want = t.tokens[start + 1 : start + 9]
    assert np.array_equal(np.argmax(logits, axis=1), want)
    assert len(toks) == 40


def test_strict_cache_catches_staging_bugs():
    t = ToyTarget(seed=1)
    rows = _ctx(t, 20)
    d = ToyDrafter.for_target(t, 4)
    blk = [1, d.mask_token_id, d.mask_token_id, d.mask_token_id]
    d.decode(0, np.arange(10), rows[:10], blk, np.arange(10, 14))
    # forgot to crop: the next staged rows do not continue the cache end
    with pytest.raises(AssertionError):
        d.decode(0, np.arange(10, 12), rows[10:12], blk, np.arange(12, 16))
    d.crop(0, 10)
    with pytest.raises(AssertionError):  # a gap
        d.decode(0, np.arange(11, 12), rows[11:12], blk, np.arange(12, 16))
    with pytest.raises(AssertionError):  # block not right after the context
        d.decode(0, np.arange(10, 12), rows[10:12], blk, np.arange(13, 17))
    d.clear(0)
    assert d.cache_len(0) == 0


def test_float32_drafter_tolerance():
    t = ToyTarget(seed=4)
    rows = _ctx(t, 200)
    d = ToyDrafter.for_target(t, 8, dtype=np.float32)
    block = [5] + [d.mask_token_id] * 7
    d.decode(0, np.arange(150), rows[:150], block, np.arange(150, 158))
    d.crop(0, 150)
    inc = d.decode(0, np.arange(150, 200), rows[150:], block, np.arange(200, 208))
    ref = d.recompute(rows, np.arange(200), block, np.arange(200, 208))
    assert inc.dtype == np.float32
    np.testing.assert_allclose(inc, ref, rtol=1e-4, atol=1e-4)


def test_flaky_drafter_fails_on_schedule():
    t = ToyTarget(seed=1)
    rows = _ctx(t, 40)
    d = FlakyDrafter(ToyDrafter.for_target(t, 4), every=2, stage="mixed")
    blk = [1] + [d.mask_token_id] * 3
    d.decode(0, np.arange(10), rows[:10], blk, np.arange(10, 14))
    d.crop(0, 10)
    with pytest.raises(DrafterFailure) as e:
        d.decode(0, np.arange(10, 12), rows[10:12], blk, np.arange(12, 16))
    assert e.value.stage == "decode"
    d.clear(0)
    d.decode(0, np.arange(10), rows[:10], blk, np.arange(10, 14))
    d.clear(0)
    d.decode(0, np.arange(10), rows[:10], blk, np.arange(10, 14))  # 4th round: crop failure
    with pytest.raises(DrafterFailure) as e:
        d.crop(0, 10)
    assert e.value.stage == "crop"
    assert d.cache_len(0) == 14  # the block stayed: the next round must clear


# -- the trained range ----------------------------------------------------------------------


def test_position_encoding_is_rope_inside_the_trained_range_and_untrained_past_it():
    d = ToyDrafter(n_ctx_train=100, seed=3)
    pos = np.array([0, 1, 57, 99, 100, 101, 5000])
    ang = d.position_angles(pos)
    np.testing.assert_array_equal(ang[:4], rope_angles(pos[:4], 16))
    assert np.all(np.abs(ang[4:] - rope_angles(pos[4:], 16)) > 1e-6)
    # untrained angles: a pure function of (seed, position), uniform-looking, seed-dependent
    np.testing.assert_array_equal(ang[4:], d.position_angles(pos[4:]))
    np.testing.assert_array_equal(ang[5], d.position_angles(np.array([101]))[0])
    many = untrained_angles(np.arange(1000, 3000), 16, 3)
    assert many.min() >= 0.0 and many.max() < 2 * np.pi
    assert abs(float(many.mean()) - np.pi) < 0.05
    assert not np.array_equal(many, untrained_angles(np.arange(1000, 3000), 16, 4))
    # no trained range: RoPE everywhere
    np.testing.assert_array_equal(ToyDrafter().position_angles(pos), rope_angles(pos, 16))
    with pytest.raises(ValueError, match="n_ctx_train"):
        ToyDrafter(n_ctx_train=0)


def _block_predictions(d: ToyDrafter, t: ToyTarget, start: int, offset: int) -> int:
    """How many of the block's B predictions match the target, with the context [0, start)
    placed at drafter positions [offset, offset + start)."""
    B = d.block_size
    rows = t.rows_at(0, start)
    last = int(t.tokens[start])
    logits = d.recompute(rows, np.arange(start) + offset, [last] + [d.mask_token_id] * (B - 1),
                         np.arange(start, start + B) + offset)
    return int(np.sum(np.argmax(logits, axis=1) == t.tokens[start + 1 : start + 1 + B]))


def test_drafter_predicts_inside_its_trained_range_and_not_past_it():
    t = ToyTarget(seed=5, deviation=0.03)
    greedy_reference(t, _prompt(300), 400)
    d = ToyDrafter.for_target(t, 8, n_ctx_train=1024)
    starts = range(310, 690, 20)
    inside = [_block_predictions(d, t, s, 0) for s in starts]
    # inside the range the encoding is exactly relative: shifted placements predict the same
    assert [_block_predictions(d, t, s, 1024 - 8 - s) for s in starts] == inside
    assert sum(inside) > 0.3 * 8 * len(starts)
    # past it the planted head cannot find the row `lookahead` back: chance is 1/128 a token
    for offset in (1024, 20_000):
        past = sum(_block_predictions(d, t, s, offset) for s in starts)
        assert past < 0.1 * sum(inside)
    # without a trained range the far shift still predicts
    assert [_block_predictions(ToyDrafter.for_target(t, 8), t, s, 20_000) for s in starts] == inside


def test_incremental_equals_recompute_across_the_trained_range():
    t = ToyTarget(seed=4)
    rows = _ctx(t, 300)
    d = ToyDrafter.for_target(t, 8, n_ctx_train=150)
    block = [5] + [d.mask_token_id] * 7
    n = 0
    for chunk in (100, 45, 1, 154):  # the block enters the untrained range, then the context does
        hi = n + chunk
        inc = d.decode(0, np.arange(n, hi), rows[n:hi], block, np.arange(hi, hi + 8))
        d.crop(0, hi)
        ref = d.recompute(rows[:hi], np.arange(hi), block, np.arange(hi, hi + 8))
        np.testing.assert_allclose(inc, ref, rtol=RTOL, atol=ATOL)
        n = hi
