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
