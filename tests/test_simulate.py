"""``dspark-core simulate``: small sessions, table and JSON fields, windowed vs absolute."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from dspark_core.cli import simulate as sim

SMALL = ["--context", "700", "--generate", "300", "--block", "4", "--window", "64", "--quiet"]


def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    sim.add_parser(sub)
    args = parser.parse_args(["simulate", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_simulate_json_windowed_vs_absolute(capsys):
    rc, out, _ = _run([*SMALL, "--stager", "reference", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["lossless"] is True
    w, a = data["modes"]["windowed"], data["modes"]["absolute"]
    for m in (w, a):
        for key in ("max_drafter_pos", "max_drafter_batch", "peak_rows", "peak_bytes", "drafter_kv_rows_needed",
                    "restaged_per_token", "rebases", "ms_per_round", "lossless", "acceptance"):
            assert key in m
        assert m["lossless"] is True
        # The Stager's metrics equal the loop's own counts of the rounds it verified.
        assert m["metrics_match"] is True and m["verified_rounds"] == sum(m["accepted_histogram"]) > 0
    W = data["config"]["window"]
    assert data["config"]["trained"] == W == 64  # the toy drafter's trained range defaults to the window
    assert w["tokens_per_seq"] == 300 and a["tokens_per_seq"] == sim.DEFAULTS["absolute_tokens"] == 64
    assert w["max_drafter_pos"] < W <= a["max_drafter_pos"]
    assert a["max_drafter_pos"] >= 700 + 64 - 1
    assert w["max_drafter_batch"] <= W < a["max_drafter_batch"]
    assert w["rebases"] > 0 and a["rebases"] == 0
    assert w["peak_rows"] < a["peak_rows"]
    assert a["peak_rows"] >= 700  # absolute staging holds the whole prompt
    assert w["drafter_kv_rows_needed"] <= W < a["drafter_kv_rows_needed"]
    assert w["rounds_outside_window"] == 0 < a["rounds_outside_window"]
    assert 0.5 < w["restaged_per_token"] < 1.5
    # the trained range: windowed drafts inside it, absolute entirely past it (positions >= 700)
    assert w["rounds_past_trained_range"] == 0 and a["rounds_past_trained_range"] == a["drafter_rounds"] > 50
    assert w["acceptance_in_trained_range"] == w["acceptance"] > 0.3
    assert a["acceptance_in_trained_range"] is None
    assert a["acceptance_past_trained_range"] == a["acceptance"] < 0.2 * w["acceptance"]


def test_simulate_absolute_acceptance_falls_as_it_crosses_the_trained_range(capsys):
    argv = ["--context", "40", "--generate", "500", "--block", "4", "--window", "64", "--trained", "160",
            "--absolute-tokens", "0", "--quiet", "--stager", "reference"]
    rc, out, _ = _run([*argv, "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    w, a = data["modes"]["windowed"], data["modes"]["absolute"]
    assert data["lossless"] and a["tokens_per_seq"] == w["tokens_per_seq"] == 500
    assert w["max_drafter_pos"] < 64 and w["acceptance"] > 0.3
    assert 0 < a["rounds_past_trained_range"] < a["drafter_rounds"]
    assert a["acceptance_in_trained_range"] > 0.5 * w["acceptance"]
    assert a["acceptance_past_trained_range"] < 0.2 * w["acceptance"]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    assert "drafter rounds at positions >= 160 (trained)" in out
    assert "in the rounds inside the range" in out and "past it" in out
    assert "toy model of the effect" in out.lower() and "59% to 4.6%" in out and "1.36x" in out


def test_simulate_table_with_checks_and_failures(capsys):
    rc, out, err = _run([*SMALL, "--seqs", "2", "--check", "--fail-every", "6", "--storage", "q8_0"], capsys)
    assert rc == 0, err
    for label in ("largest drafter position", "largest drafter batch", "peak buffered rows", "peak buffered bytes",
                  "drafter KV rows needed", "restaged rows / generated token", "rebases", "time / round",
                  "incremental vs recompute", "injected drafter failures"):
        assert label in out
    assert "lossless (== target greedy)" in out and " NO" not in out
    assert "windowed (W=64)" in out and "absolute (no window)" in out
    assert "ran the first 64 of 300 tokens" in " ".join(out.split())


def test_acceptance_by_position_groups_rounds_of_equal_count():
    tl = {"max_pos": [5, 1, 3, 2, 4, 9], "drafted": [4, 4, 4, 0, 4, 4], "accepted": [1, 4, 3, 0, 2, 0]}
    x, y = sim.acceptance_by_position(tl, n_groups=2)
    # drafted rounds by position: 1 (4/4), 3 (3/4), 4 (2/4) | 5 (1/4), 9 (0/4); the failed round is left out
    np.testing.assert_allclose(x, [8 / 3, 7.0])
    np.testing.assert_allclose(y, [9 / 12, 1 / 8])
    assert [len(v) for v in sim.acceptance_by_position({"max_pos": [], "drafted": [], "accepted": []})] == [0, 0]


def test_acceptance_between_splits_rounds_at_the_trained_range():
    tls = [{"max_pos": [10, 63, 64, 70], "drafted": [4, 4, 4, 0], "accepted": [2, 4, 1, 0]},
           {"max_pos": [64], "drafted": [4], "accepted": [0]}]
    assert sim.acceptance_between(tls, 0, 64) == 6 / 8  # a round whose block ends at position 64 is past [0, 64)
    assert sim.acceptance_between(tls, 64, float("inf")) == 1 / 8
    assert sim.acceptance_between(tls, 100, 200) is None


def test_simulate_bad_range_options_are_clean_errors(capsys):
    for bad in (["--trained", "0"], ["--absolute-tokens", "-1"]):
        rc, _, err = _run(["--context", "50", "--generate", "10", "--quiet", *bad], capsys)
        assert rc == 2 and bad[0].lstrip("-") in err


def test_simulate_bad_window_is_a_clean_error(capsys):
    rc, _, err = _run(["--context", "50", "--generate", "10", "--block", "8", "--window", "16", "--quiet"], capsys)
    assert rc == 2
    assert "window (16)" in err and "16" in err


def test_simulate_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "s.png"
    rc, _, _ = _run([*SMALL, "--plot", str(png)], capsys)
    assert rc == 0
    assert png.stat().st_size > 1000


def test_simulate_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    rc, _, err = _run([*SMALL, "--plot", str(tmp_path / "x.png")], capsys)
    assert rc == 2
    assert "matplotlib" in err


def test_defaults_are_embedded():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    sim.add_parser(sub)
    args = parser.parse_args(["simulate"])
    assert args.context == sim.DEFAULTS["context"] and args.window == sim.DEFAULTS["window"]
    assert args.func is sim.run


def test_single_blas_thread_sets_one_thread_and_restores_the_count():
    from dspark_core.sim.blas_threads import openblas_libraries, single_blas_thread

    libs = openblas_libraries()
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    assert bool(libs) == ("openblas" in blas.lower())  # numpy's own OpenBLAS is found when it has one
    counts = [getattr(lib, get)() for lib, _, get in libs]
    try:
        for lib, set_, _ in libs:
            getattr(lib, set_)(2)
        with single_blas_thread() as n:
            assert n == len(libs)
            assert [getattr(lib, get)() for lib, _, get in libs] == [1] * n
        assert [getattr(lib, get)() for lib, _, get in libs] == [2] * len(libs)
    finally:
        for (lib, set_, _), c in zip(libs, counts):
            getattr(lib, set_)(c)


@pytest.mark.parametrize("stager", ["core", "reference"])
def test_simulate_tree_paths_equal_a_linear_verify(capsys, stager):
    """--tree: every round verified as a tree, every accepted path reproduced by a linear verify,
    lossless, the Stager's metrics equal the loop's counts; windowed still beats absolute."""
    rc, out, _ = _run([*SMALL, "--tree", "--check", "--stager", stager, "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["config"]["tree"] is True and data["lossless"] is True
    w, a = data["modes"]["windowed"], data["modes"]["absolute"]
    for m in (w, a):
        assert m["tree_rounds"] == m["tree_paths_linear"] == m["verified_rounds"] == m["drafter_rounds"] > 0
        assert m["metrics_match"] is True and m["recompute_checks"] == m["drafter_rounds"]
        # a tree of B + 1 = 5 nodes reaches depth (B + 1) // 2 = 2: no bucket past it
        assert m["accepted_histogram"][3:] == [0, 0]
    assert w["acceptance"] > 2 * a["acceptance"]
    rc, table, _ = _run([*SMALL, "--tree"], capsys)
    assert rc == 0 and "tree rounds: paths == linear verify" in table


def test_simulate_tree_over_external_rows(capsys):
    """--tree with --rows external: the nodes' rows written at process_tree's slots, the
    path's copies applied by the ring owner; the same tokens and counts as held rows."""
    rc, out, _ = _run([*SMALL, "--tree", "--check", "--rows", "external", "--ring", "host", "--json"], capsys)
    assert rc == 0
    ext = json.loads(out)
    rc, out, _ = _run([*SMALL, "--tree", "--json"], capsys)
    held = json.loads(out)
    assert ext["lossless"] is True
    for mode in ("windowed", "absolute"):
        e, h = ext["modes"][mode], held["modes"][mode]
        assert e["tree_rounds"] == e["tree_paths_linear"] == h["tree_rounds"] > 0
        assert e["accepted_histogram"] == h["accepted_histogram"] and e["rebases"] == h["rebases"]
        assert e["recompute_checks"] == e["drafter_rounds"]
    rc, _, err = _run([*SMALL, "--tree", "--rows", "external", "--ring", "host", "--device-step"], capsys)
    assert rc == 2 and "--tree verifies on the host" in err


def test_a_leaf_decoded_off_its_parent_is_caught_by_the_linear_verify(monkeypatch):
    """The loop's check can fail: a leaf the target decoded after the wrong ancestors (one
    position too deep) on the accepted path differs from a linear verify of the path's tokens."""
    from dspark_core import Stager, StagerConfig
    from dspark_core.sim import loop as loop_mod
    from dspark_core.sim.toy import ToyDrafter, ToyTarget
    from dspark_core.sim.tree_draft import DraftTree, draft_tree

    def too_deep(*args):
        t = draft_tree(*args)
        return DraftTree(t.tokens, t.parents, [d + (i not in t.chain) for i, d in enumerate(t.depths)])

    target = ToyTarget(feature_dim=128, lookahead=4)
    run = loop_mod.SpeculativeLoop(Stager(StagerConfig(128, 4, 64)), ToyDrafter.for_target(target, 4), target, tree=True)
    monkeypatch.setattr(loop_mod, "draft_tree", too_deep)
    monkeypatch.setattr(loop_mod, "accepted_path", lambda tree, nxt: [0, 2])  # through the first leaf
    with pytest.raises(loop_mod.TreeMismatch, match=r"the accepted path \[0, 2\] .* differs from a linear verify"):
        run.run([np.arange(200) % 100], 50)


def test_draft_tree_shapes():
    from dspark_core.sim.tree_draft import accepted_path, draft_tree

    t = draft_tree(7, np.array([1, 2, 3, 4]), np.array([5, 6, 7, 8]), 4)
    # B = 4: the chain to depth 2, the second choices beside its 2 nodes: B + 1 = 5 nodes
    assert t.tokens == [7, 1, 5, 2, 6] and t.parents == [-1, 0, 0, 1, 1] and t.chain == [0, 1, 3]
    assert t.depths == [0, 1, 1, 2, 2] and all(p < i for i, p in enumerate(t.parents))
    chain = draft_tree(7, np.array([1, 2, 3, 4]), None, 4)
    assert chain.parents == [-1, 0, 1, 2, 3] and chain.chain == [0, 1, 2, 3, 4]
    # the target's choice after each node: 1 after the root, then 6 after node 1 (a leaf)
    assert accepted_path(t, np.array([1, 6, 0, 0, 0])) == [0, 1, 4]
    assert accepted_path(t, np.array([5, 0, 9, 0, 0])) == [0, 2]
    assert accepted_path(t, np.array([9, 0, 0, 0, 0])) == [0]


@pytest.mark.parametrize("stager", ["core", "reference"])
def test_simulate_eagle3_chain_drafter_windowed_holds_absolute_collapses(capsys, stager):
    """--drafter eagle3: a toy chain drafter over a chain drafter's Stager. Lossless; inside the
    trained range (windowed) it drafts well, past it (absolute) acceptance falls to chance; the
    Stager's metrics equal the loop's counts; --check compares every round's successor ids with
    the tokens the loop processed and the drafts with a from-scratch recompute."""
    rc, out, _ = _run([*SMALL, "--drafter", "eagle3", "--check", "--stager", stager, "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["config"]["drafter"] == "eagle3" and data["config"]["drafter_kind"] == "chain"
    assert data["lossless"] is True
    w, a = data["modes"]["windowed"], data["modes"]["absolute"]
    for m in (w, a):
        assert m["lossless"] is True and m["metrics_match"] is True
        assert m["recompute_checks"] == m["drafter_rounds"] > 0 and m["recompute_max_err"] == 0.0
    assert w["max_drafter_pos"] < 64 <= a["max_drafter_pos"] and w["rebases"] > 0
    assert w["acceptance"] > 0.3 and a["acceptance"] < 0.2 * w["acceptance"]
    rc, table, _ = _run([*SMALL, "--drafter", "eagle3", "--stager", stager], capsys)
    assert rc == 0 and "drafter: eagle3 (chain)" in table


def test_simulate_eagle3_over_external_rows_and_with_failures(capsys):
    """The chain drafter's ids travel beside rows the owner holds (HostRing), and through injected
    drafter failures; the same tokens as held rows."""
    args = [*SMALL, "--drafter", "eagle3", "--check", "--fail-every", "5", "--json"]
    rc, out, _ = _run([*args, "--rows", "external", "--ring", "host"], capsys)
    assert rc == 0
    ext = json.loads(out)
    rc, out, _ = _run(args, capsys)
    held = json.loads(out)
    assert ext["lossless"] is True and held["lossless"] is True
    for mode in ("windowed", "absolute"):
        e, h = ext["modes"][mode], held["modes"][mode]
        assert e["failures"] == h["failures"] > 0
        assert e["accepted_histogram"] == h["accepted_histogram"] and e["rebases"] == h["rebases"]


@pytest.mark.parametrize("rows", ["held", "external"])
def test_simulate_eagle3_tree_paths_carry_their_ids(capsys, rows):
    """--drafter eagle3 --tree: the chain drafter's second choices as leaves, each node with its
    token id; every accepted path equals a linear verify, and --check compares the successor ids
    of every later round (the compacted path's ids among them) with the tokens the loop processed."""
    rc, out, _ = _run([*SMALL, "--drafter", "eagle3", "--tree", "--check", "--rows", rows, "--ring", "host",
                       "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["lossless"] is True
    w = data["modes"]["windowed"]
    assert w["tree_rounds"] == w["tree_paths_linear"] == w["drafter_rounds"] > 0
    assert w["recompute_checks"] == w["drafter_rounds"] and w["metrics_match"] is True
    # leaves beside the chain: some accepted paths end in a leaf (the histogram reaches past 0)
    assert sum(w["accepted_histogram"][1:]) > 0


def test_a_chain_drafter_needs_a_chain_stager():
    from dspark_core import Stager, StagerConfig
    from dspark_core.sim.loop import SpeculativeLoop
    from dspark_core.sim.toy import ToyDrafter, ToyTarget
    from dspark_core.sim.toy_chain import ToyChainDrafter

    target = ToyTarget(lookahead=4)
    with pytest.raises(ValueError, match="a chain drafter needs a Stager of kind 'chain'"):
        SpeculativeLoop(Stager(StagerConfig(128, 4, 64)), ToyChainDrafter.for_target(target, 4), target)
    with pytest.raises(ValueError, match="a block drafter needs a Stager of kind 'block'"):
        SpeculativeLoop(Stager(StagerConfig(128, 4, 64, kind="chain")), ToyDrafter.for_target(target, 4), target)


def test_a_chain_drafter_fed_each_rows_own_token_collapses(monkeypatch):
    """The ids matter: the same loop with each row paired with its own token instead of the
    one after it (an off-by-one a server could make) drafts at chance, and --check names it."""
    from dspark_core.stager.stage_plan import StagePlan

    rc = sim.simulate(context=700, generate=300, block=4, window=64, modes=("windowed",), drafter="eagle3")
    good = rc["modes"]["windowed"]["acceptance"]
    monkeypatch.setattr(StagePlan, "successors", lambda self, next_token: self.tokens.copy())
    bad = sim.simulate(context=700, generate=300, block=4, window=64, modes=("windowed",), drafter="eagle3")
    assert bad["lossless"] is True  # verification keeps the output exact; only the drafts suffer
    assert good > 0.3 and bad["modes"]["windowed"]["acceptance"] < 0.1 * good
    with pytest.raises(AssertionError, match="successor ids .* differ from the tokens processed after them"):
        sim.simulate(context=700, generate=50, block=4, window=64, modes=("windowed",), drafter="eagle3", check=True)
