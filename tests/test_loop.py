"""End to end: the speculative loop over a Stager with the toy models.

Claims checked here, against the C++ core and the pure-Python reference:

* lossless: the loop's greedy output equals the target's own greedy decoding,
  token for token, over thousands of tokens;
* incremental equals recompute: every committed round's drafter logits (from the
  incrementally cached, windowed drafter) match a from-scratch recompute over
  the context ``[pos_base, start)`` at rebased positions, including rebase
  rounds and rounds after a failure. The drafter computes in float64, so the
  two differ only by summation order: ``rtol = atol = 1e-9`` (see ``toy``);
* the drafter never runs outside ``[0, W)`` and buffered rows stay bounded.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core.stager.config import StagerConfig
from dspark_core.sim.loop import RecomputeMismatch, SpeculativeLoop
from dspark_core.reference import ReferenceStager
from dspark_core.sim.toy import FlakyDrafter, ToyDrafter, ToyTarget, greedy_reference


def _core_stager():
    from dspark_core import Stager  # the package imports its extension: the core is always there

    return Stager


@pytest.fixture(params=["core", "reference"])
def stager_cls(request):
    return _core_stager() if request.param == "core" else ReferenceStager


D = 128


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, n)


def _session(stager_cls, *, prompts, n_generate, B=4, W=96, storage="f32", drafter_wrap=None,
             check=1, seed=0, deviation=0.03, max_failures=3, prefill_chunk=256, stage_dtype="float32",
             n_ctx_train=None):
    cfg = StagerConfig(D, B, W, max_seqs=len(prompts), storage=storage, max_failures=max_failures,
                       stage_dtype=stage_dtype)
    st = stager_cls(cfg)
    targets = [ToyTarget(feature_dim=D, lookahead=B, deviation=deviation, seed=seed) for _ in prompts]
    drafter = ToyDrafter.for_target(targets[0], B, seed=seed, n_ctx_train=n_ctx_train)
    if drafter_wrap is not None:
        drafter = drafter_wrap(drafter)
    loop = SpeculativeLoop(st, drafter, targets, check_recompute=check, prefill_chunk=prefill_chunk)
    res = loop.run(prompts, n_generate)
    ref_t = ToyTarget(feature_dim=D, lookahead=B, deviation=deviation, seed=seed)
    greedy = [greedy_reference(ref_t, p, n_generate) for p in prompts]
    return res, greedy, cfg, drafter


def test_lossless_over_thousands_of_tokens(stager_cls):
    res, greedy, cfg, _ = _session(stager_cls, prompts=[_prompt(1500, 1)], n_generate=3000, W=128, check=0)
    s = res.sequences[0]
    assert s.n_generated == 3000
    assert np.array_equal(s.tokens, greedy[0])
    assert s.accepted > 0 and s.rounds > 0  # speculation actually happened
    assert s.stats["rebases"] > 10
    assert s.max_drafter_pos < cfg.window
    assert s.max_drafter_batch <= cfg.window
    assert s.peak_rows <= cfg.ring_rows
    # ~ one restaged row per generated token (K rows per W/2 - B tokens of headroom)
    assert 0.7 < s.restaged_per_token < 1.4


def test_incremental_equals_recompute_with_rebases_and_failures(stager_cls):
    def flaky(d):
        return FlakyDrafter(d, every=4, stage="mixed")  # never 3 in a row: the sequence stays enabled

    res, greedy, cfg, drafter = _session(
        stager_cls, prompts=[_prompt(400, 2)], n_generate=1500, W=64, drafter_wrap=flaky, check=1
    )
    s = res.sequences[0]
    assert np.array_equal(s.tokens, greedy[0])
    stages = {st for _, _, st in drafter.failures}
    assert stages == {"decode", "crop"}
    assert s.failures == len(drafter.failures) == s.stats["failures"] > 10
    assert not s.skips
    assert s.stats["rebases"] > s.failures  # every failure forced a rebase, plus the window ones
    # every committed round was checked, rebase rounds and the round after each failure included
    assert s.recompute_checks == s.rounds - s.failures == s.stats["commits"]
    assert s.recompute_max_err < 1e-9
    assert s.max_drafter_pos < cfg.window


def test_several_sequences_with_draft_many(stager_cls):
    prompts = [_prompt(700, 3), _prompt(45, 4), _prompt(3, 5)]  # longer than W, shorter than W, shorter than B
    res, greedy, cfg, _ = _session(stager_cls, prompts=prompts, n_generate=400, W=64, check=1)
    for s, g in zip(res.sequences, greedy):
        assert np.array_equal(s.tokens, g)
        assert s.max_drafter_pos < cfg.window
        assert s.recompute_checks > 0
    assert res.iterations < sum(s.rounds for s in res.sequences)  # one drafter batch served several sequences


def test_disabled_after_consecutive_failures_still_lossless(stager_cls, caplog):
    def always(d):
        return FlakyDrafter(d, every=1, stage="decode")

    with caplog.at_level("WARNING", logger="dspark_core"):
        res, greedy, _, _ = _session(stager_cls, prompts=[_prompt(200, 6)], n_generate=100, W=64,
                                     drafter_wrap=always, max_failures=3)
    s = res.sequences[0]
    assert np.array_equal(s.tokens, greedy[0])
    assert s.failures == 3
    assert s.skips.get("disabled", 0) > 0
    assert sum("disabled" in r.getMessage() for r in caplog.records) == 1


def test_windowed_acceptance_equals_absolute_acceptance(stager_cls):
    """Losslessness cannot see staging errors (verification fixes any draft); acceptance can.

    The toy drafter is exactly relative (its planted head reads the row B
    positions back), so staging the right rows at rebased positions must give
    the same accepted tokens as staging at absolute positions; a wrong row, a
    wrong position or a missed crop would lower the windowed acceptance.
    """
    P, N, B = 600, 600, 4
    win, _, cfg, _ = _session(stager_cls, prompts=[_prompt(P, 12)], n_generate=N, W=48, check=0)
    W_abs = 2 * (P + N + B + 1) + 1
    absolute, _, _, _ = _session(stager_cls, prompts=[_prompt(P, 12)], n_generate=N, W=W_abs, check=0)
    a, b = win.sequences[0], absolute.sequences[0]
    assert a.stats["rebases"] > 10 and b.stats["rebases"] == 0
    assert a.accepted == b.accepted and a.rounds == b.rounds
    assert a.accepted / a.rounds > 0.5  # tokens accepted per round: speculation works


def _acceptance(timeline, lo, hi):
    """Accepted / drafted over the rounds whose largest drafter position is in [lo, hi)."""
    pos = np.asarray(timeline["max_pos"])
    sel = (pos >= lo) & (pos < hi)
    return np.sum(np.asarray(timeline["accepted"])[sel]) / np.sum(np.asarray(timeline["drafted"])[sel])


def test_trained_range_absolute_acceptance_falls_past_it_windowed_holds(stager_cls):
    """A drafter whose position encoding is defined on [0, T) only: absolute staging crosses T
    and its acceptance collapses there; windowed staging never leaves [0, W), W <= T, and
    drafts exactly as a drafter without a range would. Every run stays lossless."""
    P, N, B, T = 100, 900, 4, 256
    W_abs = 2 * (P + N + B + 1) + 1
    run = {}
    for name, W, rng in (("win", 96, T), ("win_free", 96, None), ("abs", W_abs, T), ("abs_free", W_abs, None)):
        check = 1 if name == "abs" else 0  # past T, too, the cached drafter equals a recompute
        res, greedy, _, _ = _session(stager_cls, prompts=[_prompt(P, 14)], n_generate=N, W=W, check=check,
                                     n_ctx_train=rng)
        s = res.sequences[0]
        assert np.array_equal(s.tokens, greedy[0]), name
        assert s.recompute_checks == (s.rounds if check else 0) and s.recompute_max_err < 1e-9
        assert sum(s.timeline["drafted"]) == s.drafted and sum(s.timeline["accepted"]) == s.accepted
        run[name] = s
    win, absolute = run["win"], run["abs"]
    assert win.max_drafter_pos < 96 and absolute.max_drafter_pos >= P + N - 1
    # windowed: inside the range throughout, so exactly the unbounded drafter's drafts
    assert win.timeline == run["win_free"].timeline and win.acceptance > 0.3
    # absolute: as good as windowed while its rounds are inside [0, T) ...
    inside = _acceptance(absolute.timeline, 0, T)
    assert inside > 0.5 * win.acceptance
    # ... and below a fifth of it past T, where the unbounded drafter keeps drafting well
    assert _acceptance(absolute.timeline, T, np.inf) < 0.2 * win.acceptance
    assert _acceptance(run["abs_free"].timeline, T, np.inf) > 0.5 * win.acceptance


def test_recompute_check_with_a_float16_drafter(stager_cls):
    """Staged float16 rows are rounded: the check compares logits, not rows, and passes."""
    res, greedy, _, _ = _session(stager_cls, prompts=[_prompt(300, 13)], n_generate=200, W=64,
                                 stage_dtype="float16")
    s = res.sequences[0]
    assert np.array_equal(s.tokens, greedy[0]) and s.recompute_checks > 0


def test_absolute_staging_runs_at_absolute_positions(stager_cls):
    P, N, B = 600, 300, 4
    W_abs = 2 * (P + N + B + 1) + 1
    res, greedy, cfg, _ = _session(stager_cls, prompts=[_prompt(P, 8)], n_generate=N, W=W_abs, check=0)
    s = res.sequences[0]
    assert np.array_equal(s.tokens, greedy[0])
    assert s.stats["rebases"] == 0
    assert s.max_drafter_pos >= P + N - 1
    assert s.max_drafter_batch >= P  # the first round stages the whole prompt
    assert s.peak_rows >= P + N - 1  # nothing is ever trimmed


@pytest.mark.parametrize("storage", ["f16", "q8_0", "q4_0"])
def test_lossy_storage_is_still_lossless_and_consistent(stager_cls, storage):
    res, greedy, _, _ = _session(stager_cls, prompts=[_prompt(300, 9)], n_generate=300, W=64, storage=storage)
    s = res.sequences[0]
    assert np.array_equal(s.tokens, greedy[0])
    assert s.recompute_checks > 0 and s.recompute_max_err < 1e-9


def test_token_returning_drafter(stager_cls):
    class Tokens:
        def __init__(self, d):
            self.d = d
            self.mask_token_id = d.mask_token_id

        def clear(self, seq):
            self.d.clear(seq)

        def crop(self, seq, from_pos):
            self.d.crop(seq, from_pos)

        def decode(self, *a):
            return np.argmax(self.d.decode(*a), axis=1)

        def recompute(self, *a):
            return self.d.recompute(*a)

    res, greedy, _, _ = _session(stager_cls, prompts=[_prompt(150, 10)], n_generate=200, W=64, drafter_wrap=Tokens)
    assert np.array_equal(res.sequences[0].tokens, greedy[0])
    assert res.sequences[0].accepted > 0


def test_recompute_check_has_teeth(stager_cls):
    """A drafter whose cache silently drifts is caught by the recompute check."""

    class Drifting(ToyDrafter):
        def crop(self, seq, from_pos):
            super().crop(seq, from_pos)
            c = self._cache(seq)
            if c.n > 70:
                c.v[0, 1, 3] += 1e-3  # corrupt one cached value

    t = ToyTarget(feature_dim=D, lookahead=4, seed=0)
    d = Drifting.for_target(t, 4)
    st = stager_cls(StagerConfig(D, 4, 512))
    loop = SpeculativeLoop(st, d, [t], check_recompute=1)
    with pytest.raises(RecomputeMismatch):
        loop.run([_prompt(60, 11)], 200)


def test_loop_rejects_bad_arguments():
    cfg = StagerConfig(D, 4, 64)
    t = ToyTarget(feature_dim=D, lookahead=4)
    d = ToyDrafter.for_target(t, 4)
    loop = SpeculativeLoop(ReferenceStager(cfg), d, [t])
    with pytest.raises(ValueError):
        loop.run([_prompt(10, 0)], 0)
    with pytest.raises(ValueError):
        loop.run([[]], 5)
    with pytest.raises(ValueError):
        SpeculativeLoop(ReferenceStager(cfg), d, [t, t])  # max_seqs=1
