"""The README's runnable example (examples/minimal_server.py) runs and its checks hold.

The example is run as a user runs it (a subprocess of this interpreter). Its own checks are
independent of the Stager: the output is compared with plain greedy decoding of the fake target,
and every staged row with the row the fake target produced at that absolute position
(``pos_base + position``), so a wrong rebase, row or position shows up here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minimal_server.py"


def run_example(*args: str) -> tuple[str, dict[str, float]]:
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], check=False, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr}"

    def num(pattern: str) -> float:
        m = re.search(pattern, out)
        assert m, f"{pattern!r} not in the output:\n{out}"
        return float(m.group(1))

    figures = {
        "window": num(r"\bW=(\d+)"),
        "block": num(r"\bB=(\d+)"),
        "acceptance": num(r"acceptance ([\d.]+)%"),
        "rebases": num(r"(\d+) rebases"),
        "failures": num(r"(\d+) drafter failures recovered"),
        "max_pos": num(r"largest drafter position: (-?\d+)"),
        "peak_rows": num(r"peak rows held: (\d+)"),
        "bound": num(r"W \+ 512 \+ B \+ 1 = (\d+)"),
        "rel_err": num(r"max relative error ([\d.e+-]+)"),
        "keep": num(r"\(K=(\d+)\)"),
        "rolled_back": num(r"rolled back (\d+) positions"),
        "restaged_after_edit": num(r"first restage after it: (-?\d+) rows"),
    }
    return out, figures


@pytest.mark.parametrize("storage", ["bf16", "f32", "q4_0"])
def test_minimal_server_is_lossless_inside_the_window(storage: str) -> None:
    out, f = run_example("--storage", storage)
    assert f"storage={storage}" in out
    assert "lossless: yes" in out
    # The run crossed the window many times and recovered from the injected failures ...
    assert f["rebases"] >= 5
    assert f["failures"] >= 1
    # ... while drafting for real (neither never nor always right).
    assert 0 < f["acceptance"] < 100
    # Positions stay inside [0, W) and reach its end; memory stays inside the bound.
    assert f["max_pos"] == f["window"] - 1
    assert f["bound"] == f["window"] + 512 + f["block"] + 1
    assert 0 < f["peak_rows"] <= f["bound"]
    # A rollback of at most W - K positions restages a full K-row context (docs/design.md 8).
    assert f["rolled_back"] <= f["window"] - f["keep"]
    assert f["restaged_after_edit"] == f["keep"]


def test_minimal_server_stages_the_targets_rows_exactly_in_f32() -> None:
    _, f = run_example("--storage", "f32")
    assert f["rel_err"] == 0.0


def test_minimal_server_bf16_rows_within_one_rounding() -> None:
    # bf16 keeps 8 significant bits: round to nearest is within 2**-8 of the value.
    _, f = run_example("--storage", "bf16")
    assert 0 < f["rel_err"] <= 2.0**-8


@pytest.mark.parametrize("storage", ["f32", "q8_0"])
def test_minimal_server_with_zero_copy_drafts(storage: str) -> None:
    """The drafter reads views of the Stager's ring (draft(copy=False)): the same run, token for token."""
    out, f = run_example("--storage", storage, "--zero-copy")
    copied, g = run_example("--storage", storage)
    assert "zero-copy staged rows" in out and "copied staged rows" in copied
    assert "lossless: yes" in out
    assert f == g  # every figure: acceptance, rebases, failures, positions, the rows' error
    if storage == "f32":
        assert f["rel_err"] == 0.0


def test_minimal_server_without_drafter_failures() -> None:
    out, f = run_example("--fail-every", "0", "--generate", "120")
    assert "lossless: yes" in out
    assert f["failures"] == 0


# examples/prefix_server.py: a batched server with a vLLM-style block manager and the prefix store.
PREFIX_SERVER = EXAMPLE.parent / "prefix_server.py"
#: The calls of one step: evict, hit_many, draft_many, gather (external rows), commit_many, fail_many,
#: process_many / write_many, accept_many, publish_many, end_many.
CALL_KINDS = 10


def run_prefix_server(*args: str) -> tuple[str, dict[str, float]]:
    proc = subprocess.run([sys.executable, str(PREFIX_SERVER), *args], check=False, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr}"
    assert out.splitlines()[-1] == "lossless: yes", out

    def num(pattern: str) -> float:
        m = re.search(pattern, out)
        assert m, f"{pattern!r} not in the output:\n{out}"
        return float(m.group(1))

    figures = {
        "steps": num(r"steps: (\d+)"),
        "batch": num(r"up to (\d+) sequences per step"),
        "failures": num(r"(\d+) drafter failures recovered"),
        "hits": num(r"hits: (\d+) of"),
        "finished": num(r"hits: \d+ of (\d+) requests"),
        "full_hits": num(r"\((\d+) found every row in the store\)"),
        "not_prefilled": num(r"thanks to the cache: (\d+) of"),
        "replayed": num(r"(\d+) replayed"),
        "kv_evicted": num(r"KV pool: (\d+) cached blocks evicted"),
        "first_equal": num(r"full prefill's \(plan and staged row bytes\): (\d+) of"),
        "first_checked": num(r"staged row bytes\): \d+ of (\d+)"),
        "first_after_hit": num(r"\((\d+) after a hit\)"),
        "lossless": num(r"greedy decoding: (\d+) of"),
        "rel_err": num(r"max relative error ([\d.e+-]+)"),
        "max_pos": num(r"largest drafter position (-?\d+)"),
        "calls_max": num(r"calls per step: mean [\d.]+, max (\d+)"),
    }
    return out, figures


@pytest.mark.parametrize("rows", ["held", "external"])
def test_prefix_server_hits_restage_a_full_prefill_and_stay_lossless(rows: str) -> None:
    # A KV pool and a store small enough to evict: hits that found every row and hits that replay.
    out, f = run_prefix_server("--rows", rows, "--storage", "f32", "--slots", "8", "--requests", "32",
                               "--kv-blocks", "200", "--store-kib", "256")
    assert f"rows={rows}" in out
    assert f["finished"] == f["lossless"] == 32
    assert f["first_equal"] == f["first_checked"] == 32
    assert f["first_after_hit"] == f["hits"] >= 28  # only the first conversations' first turns miss
    assert 0 < f["full_hits"] < f["hits"] and f["replayed"] > 0 and f["kv_evicted"] > 0
    assert f["not_prefilled"] > 0 and f["failures"] > 0 and f["batch"] == 8
    assert f["rel_err"] == 0.0  # f32 rows staged exactly, through the store too
    assert f["max_pos"] < 64
    assert f["calls_max"] <= CALL_KINDS


@pytest.mark.parametrize(("rows", "storage"), [("held", "bf16"), ("external", "q4_0")])
def test_prefix_server_calls_per_step_do_not_grow_with_the_batch(rows: str, storage: str) -> None:
    small = run_prefix_server("--rows", rows, "--storage", storage, "--slots", "2", "--requests", "8")[1]
    large = run_prefix_server("--rows", rows, "--storage", storage, "--slots", "24", "--requests", "96")[1]
    assert small["batch"] == 2 and large["batch"] == 24
    assert small["calls_max"] <= CALL_KINDS and large["calls_max"] <= CALL_KINDS
    assert large["first_equal"] == large["first_checked"] == 96
