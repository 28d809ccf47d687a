"""``dspark-core inspect``: table and JSON output, errors as one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_core.cli import main
from gguf_helpers import dflash_kv, dspark_kv, write_gguf


@pytest.fixture(autouse=True)
def _no_env_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSPARK_WINDOW_CAP", raising=False)


@pytest.fixture
def drafter(tmp_path: Path) -> Path:
    # B = 16, trained range 4096, feature width 25600 = 5 layers * 5120 (fc.weight ne[0]).
    return write_gguf(
        tmp_path / "drafter.gguf",
        "dspark",
        dspark_kv(context_length=262144, **{"dspark.trained_context_length": 4096, "dspark.embedding_length": 5120}),
        [("fc.weight", (5120, 25600), "float16")],
    )


def test_table(drafter: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["inspect", str(drafter), "--target-ctx", "131072", "--n-batch", "2048", "--parallel", "4", "--storage", "q8_0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "drafter" in out and "context plan" in out
    assert str(drafter) in out
    assert "dspark.dspark.block_size" in out and "dspark.trained_context_length" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and ln.split()}
    assert lines["block_size"].split()[1] == "16"
    assert lines["n_ctx_train"].split()[1] == "4096"
    assert lines["feature_dim"].split()[1] == "25600"
    assert lines["window"].split()[1] == "2048"  # min(4096, 2048)
    assert lines["w_keep"].split()[1] == "1024"
    assert lines["n_outputs_max"].split()[1] == "68"  # 4 * (1 + 16)
    assert "8192" in out  # drafter n_ctx = 2048 * 4
    assert "70,094,400" in out  # per seq: (2048 + 512 + 16 + 1) * 25600 / 32 * 34
    assert "280,377,600" in out  # 4 slots


def test_json(drafter: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["inspect", str(drafter), "--target-ctx", "65536", "--n-batch", "8192", "--storage", "bf16", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    doc = json.loads(out)
    d, p = doc["drafter"], doc["plan"]
    assert d["block_size"] == 16 and d["mask_token_id"] == 151669
    assert d["target_layers"] == [1, 16, 31, 46, 61]
    assert d["n_ctx_train"] == 4096 and d["n_ctx_train_source"] == "dspark.trained_context_length"
    assert d["context_length"] == 262144
    assert p["window"] == 4096 and p["window_source"] == "n_ctx_train"  # min(4096, 8192)
    assert p["w_keep"] == 2048
    assert p["n_ctx"] == 4096 and p["n_batch"] == 4096 and p["n_ubatch"] == 4096
    assert p["n_outputs_max"] == 17  # 1 * (1 + 16)
    assert p["ring_rows"] == 4625  # 4096 + 512 + 16 + 1
    assert p["row_bytes"] == 51200  # 2 * 25600
    assert p["peak_feature_bytes_per_seq"] == 236_800_000  # 4625 * 51200
    assert p["warnings"] == []


def test_overrides_and_cap(drafter: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_WINDOW_CAP", "1500")
    rc = main(["inspect", str(drafter), "--n-ctx-train", "3000", "--window-cap", "1800", "--n-batch", "4096", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    doc = json.loads(out)
    assert doc["drafter"]["n_ctx_train"] == 3000 and doc["drafter"]["n_ctx_train_source"] == "override"
    assert doc["plan"]["window"] == 1500 and doc["plan"]["window_source"] == "cap"  # min(3000, 4096, 1800, 1500)
    assert doc["plan"]["window_cap_source"] == "DSPARK_WINDOW_CAP"
    assert doc["plan"]["w_keep"] == 750


def test_inherited_context_warning_in_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write_gguf(tmp_path / "f.gguf", "dflash", dflash_kv(context_length=32768))
    rc = main(["inspect", str(p), "--target-ctx", "32768", "--json"])
    out, _ = capsys.readouterr()
    assert rc == 0
    warnings = json.loads(out)["plan"]["warnings"]
    assert len(warnings) == 1 and "dflash.context_length = 32768" in warnings[0]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("dspark-core inspect: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "missing.gguf"
    line = _error(capsys, ["inspect", str(path)])
    assert f"{path}: no such file" in line


def test_not_a_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "readme.gguf"
    path.write_text("just text\n")
    assert "not a GGUF file" in _error(capsys, ["inspect", str(path), "--json"])


def test_truncated(drafter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = tmp_path / "cut.gguf"
    with open(drafter, "rb") as f:
        cut.write_bytes(f.read(200))
    assert "truncated" in _error(capsys, ["inspect", str(cut)])


def test_draft_length_mismatch(drafter: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(capsys, ["inspect", str(drafter), "--n-draft", "6"])
    assert "draft length (6) must equal the drafter's block_size (16)" in line


def test_window_too_small(drafter: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(capsys, ["inspect", str(drafter), "--n-batch", "32"])
    assert "window (32) must be greater than 2 * block_size (2 * 16 = 32)" in line


def test_help_lists_inspect(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["inspect", "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--target-ctx", "--n-batch", "--parallel", "--storage", "--json", "--n-ctx-train"):
        assert flag in out
