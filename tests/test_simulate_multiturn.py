"""``dspark-core simulate --workload multiturn``: prefix caching off, cold drafter, replay, row store.

The claims of docs/prefix_cache.md, measured on a small multi-turn workload:
the row store prefills only the new tokens (as a cold start does), stages a
full K-row context at the first round after a hit (as caching off does), and
its acceptance equals caching off's exactly (its rounds are the same rounds);
a cold drafter loses the first rounds; a K-token replay pays K tokens per
request; every variant is lossless. Under a budget too small for the
conversations, misses replay at most K tokens and acceptance still matches.
"""

from __future__ import annotations

import json

import pytest

from dspark_core.sim.multiturn import MultiTurnConfig, PrefixCache, run_multiturn
from test_simulate import _run  # the simulate command's parser, as the long workload's tests run it

SMALL = MultiTurnConfig(conversations=2, turns=3, system_tokens=300, user_tokens=20, generate=64, window=256,
                        block=4, feature_dim=64)


@pytest.fixture(scope="module")
def result():
    return run_multiturn(SMALL)


def test_every_variant_is_lossless(result):
    assert result["lossless"] and all(v["lossless"] for v in result["variants"].values())


def test_the_store_prefills_only_new_tokens_and_restages_a_full_context(result):
    off, cold, replay, store = (result["variants"][k] for k in ("off", "cold", "replay", "store"))
    K = result["config"]["w_keep"]
    assert store["prefilled_total"] == cold["prefilled_total"] < replay["prefilled_total"] < off["prefilled_total"]
    assert replay["replayed_tokens"] == K * replay["hit_requests"] and store["replayed_tokens"] == 0
    # Every hit here is far above W - B: the first round rebases to K rows, as with caching off.
    assert store["first_round_context_rows_min"] == off["first_round_context_rows_min"] == K
    # A cold drafter has the new tokens only (plus a block the cache did not hit): less than it reads back.
    assert cold["first_round_context_rows_min"] <= SMALL.user_tokens + 1 < SMALL.lookahead
    assert cold["first_round_context_rows"] <= SMALL.user_tokens + SMALL.block_tokens
    assert store["store_full_hits"] == store["store_hits"] == store["hit_requests"]
    assert store["store_peak_bytes"] <= SMALL.budget_bytes


def test_the_store_matches_caching_off_and_a_cold_drafter_does_not(result):
    off, cold, replay, store = (result["variants"][k] for k in ("off", "cold", "replay", "store"))
    assert store["acceptance_after_hit"] == off["acceptance_after_hit"] == replay["acceptance_after_hit"]
    assert store["acceptance"] == off["acceptance"]
    assert off["acceptance_after_hit"] > 0.5
    assert cold["acceptance_after_hit"] < 0.1 and cold["acceptance"] < off["acceptance"]


def test_a_small_budget_degrades_to_short_replays():
    r = run_multiturn(SMALL.__class__(**{**SMALL.__dict__, "budget_bytes": 40_000}), variants=("off", "store"))
    off, store = r["variants"]["off"], r["variants"]["store"]
    K = r["config"]["w_keep"]
    assert store["store_evicted"] > 0 and store["store_peak_bytes"] <= 40_000
    assert 0 < store["replayed_tokens"] <= K * store["hit_requests"]
    assert store["store_full_hits"] < store["store_hits"]
    assert store["acceptance"] == off["acceptance"] and store["lossless"]


def test_the_prefix_cache_hits_the_end_of_the_previous_request():
    cache = PrefixCache(16)
    import numpy as np

    a = np.arange(100)
    cache.add(a, 90)
    assert cache.hit(np.concatenate([a[:90], [7, 8, 9]])) == 90  # the partial block at the end
    assert cache.hit(np.concatenate([a[:50], [7] * 60])) == 48  # full blocks only
    assert cache.hit(a[:90]) == 89  # at least one token is computed


ARGS = ["--workload", "multiturn", "--conversations", "2", "--turns", "2", "--system-tokens", "200",
        "--user-tokens", "16", "--reply-tokens", "40", "--window", "128", "--block", "4", "--lookahead", "32",
        "--feature-dim", "64", "--quiet"]


def test_cli_table_and_json(capsys):
    rc, out, _ = _run(ARGS, capsys)
    assert rc == 0
    for label in ("prefix caching off", "cold start", "replay K tail", "row store", "acceptance overall",
                  "store memory (peak) / budget", "lossless"):
        assert label in out
    rc, out, _ = _run([*ARGS, "--json", "--stager", "reference"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["stager"] == "reference" and set(data["variants"]) == {"off", "cold", "replay", "store"}
    assert data["variants"]["store"]["acceptance"] == data["variants"]["off"]["acceptance"]


def test_cli_rejects_a_lookahead_beyond_K(capsys):
    rc, _, err = _run([*ARGS, "--lookahead", "64"], capsys)
    assert rc == 2 and "lookahead" in err


# --seqs (batches of a turn's requests: hit_many, draft_many, publish_many) and --rows external (HostRing +
# HostPrefixTable): the same claims, and the same figures as held rows.
BATCHED = MultiTurnConfig(**{**SMALL.__dict__, "conversations": 3, "seqs": 2})


def _figures(r):
    keys = ("prefilled_total", "replayed_tokens", "first_round_context_rows", "acceptance", "acceptance_after_hit",
            "lossless")
    return {v: {k: x[k] for k in keys} for v, x in r["variants"].items()}


@pytest.mark.parametrize("seqs", [1, 2])
def test_external_rows_give_held_rows_figures(seqs):
    cfg = MultiTurnConfig(**{**BATCHED.__dict__, "seqs": seqs})
    held = run_multiturn(cfg)
    external = run_multiturn(MultiTurnConfig(**{**cfg.__dict__, "rows": "external"}))
    assert held["lossless"] and external["lossless"]
    assert _figures(external) == _figures(held)
    store = external["variants"]["store"]
    assert store["store_full_hits"] == store["store_hits"] == store["hit_requests"] > 0


def test_batches_hit_and_publish_with_one_call_each(monkeypatch):
    from dspark_core.prefix.host_table import HostPrefixTable

    calls = {"hit_many": 0, "publish_many": 0}
    for name in calls:
        orig = getattr(HostPrefixTable, name)

        def counted(self, *a, _orig=orig, _name=name):
            calls[_name] += 1
            return _orig(self, *a)

        monkeypatch.setattr(HostPrefixTable, name, counted)
    cfg = MultiTurnConfig(**{**BATCHED.__dict__, "rows": "external"})
    r = run_multiturn(cfg, variants=("off", "store"))
    batches = cfg.turns * -(-cfg.conversations // cfg.seqs)
    # One hit_many per batch; one publish_many for the prompts' last blocks (when they complete one)
    # and one for the replies' blocks.
    assert calls["hit_many"] == batches and batches < calls["publish_many"] <= 2 * batches
    store, off = r["variants"]["store"], r["variants"]["off"]
    assert store["lossless"] and store["acceptance"] == off["acceptance"]
    # A batch's requests run together: the second conversation's first turn cannot hit the first's blocks.
    assert store["hit_requests"] == cfg.conversations * cfg.turns - cfg.seqs


def test_cli_batched_external_rows(capsys):
    rc, out, _ = _run([*ARGS, "--conversations", "3", "--seqs", "2", "--rows", "external", "--ring", "host",
                       "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["config"]["seqs"] == 2 and data["config"]["rows"] == "external" and data["config"]["ring"] == "host"
    assert data["lossless"]
    assert data["variants"]["store"]["acceptance"] == data["variants"]["off"]["acceptance"]
    rc, out, _ = _run([*ARGS, "--seqs", "2", "--rows", "external", "--ring", "host"], capsys)
    assert rc == 0 and "2 sequence(s) per batch" in out and "external rows (host ring)" in out


@pytest.mark.parametrize("extra", [["--context", "100"], ["--generate", "10"], ["--fail-every", "3"], ["--check"],
                                   ["--prefill-chunk", "64"], ["--deviation", "0.1"], ["--trained", "64"],
                                   ["--absolute-tokens", "0"], ["--plot", "x.png"]])
def test_cli_refuses_options_the_multiturn_workload_would_ignore(capsys, extra):
    rc, _, err = _run([*ARGS, *extra], capsys)
    assert rc == 2 and extra[0] in err and "not used by --workload multiturn" in err


@pytest.mark.parametrize("extra", [["--conversations", "5"], ["--lookahead", "20"], ["--budget-mib", "1"],
                                   ["--reply-tokens", "10"]])
def test_cli_refuses_multiturn_options_with_the_long_workload(capsys, extra):
    rc, _, err = _run(["--context", "300", "--generate", "20", "--quiet", *extra], capsys)
    assert rc == 2 and extra[0] in err and "only used by --workload multiturn" in err


def test_cli_rejects_zero_seqs(capsys):
    rc, _, err = _run([*ARGS, "--seqs", "0"], capsys)
    assert rc == 2 and "--seqs" in err
