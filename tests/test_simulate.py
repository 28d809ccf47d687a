"""``dspark-core simulate``: small sessions, table and JSON fields, windowed vs absolute."""

from __future__ import annotations

import argparse
import json

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
    W = data["config"]["window"]
    assert w["max_drafter_pos"] < W <= a["max_drafter_pos"]
    assert a["max_drafter_pos"] >= 700 + 300 - 1
    assert w["max_drafter_batch"] <= W < a["max_drafter_batch"]
    assert w["rebases"] > 0 and a["rebases"] == 0
    assert w["peak_rows"] < a["peak_rows"]
    assert a["peak_rows"] >= 700  # absolute staging holds the whole prompt
    assert w["drafter_kv_rows_needed"] <= W < a["drafter_kv_rows_needed"]
    assert w["rounds_outside_window"] == 0 < a["rounds_outside_window"]
    assert 0.5 < w["restaged_per_token"] < 1.5


def test_simulate_table_with_checks_and_failures(capsys):
    rc, out, err = _run([*SMALL, "--seqs", "2", "--check", "--fail-every", "6", "--storage", "q8_0"], capsys)
    assert rc == 0, err
    for label in ("largest drafter position", "largest drafter batch", "peak buffered rows", "peak buffered bytes",
                  "drafter KV rows needed", "restaged rows / generated token", "rebases", "time / round",
                  "incremental vs recompute", "injected drafter failures"):
        assert label in out
    assert "lossless (== target greedy)" in out and " NO" not in out
    assert "windowed (W=64)" in out and "absolute (no window)" in out


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
