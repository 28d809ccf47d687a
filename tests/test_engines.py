"""The engine-side helpers that need no engine: the stand-in drafter, the checked Stager and its
replay, the massive-activation figures, the lazy import of llama-cpp-python and the capture CLI.

The real-engine tests are in test_llama_cpp_capture.py (they need llama-cpp-python and a model).
"""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest

from dspark_core import Stager, StagerConfig, dequantize_rows, quantize_rows
from dspark_core.cli import main
from dspark_core.engines.activations import massive_activations, storage_outcomes
from dspark_core.engines.checked_stager import CheckedStager, StagingMismatch, check_plan, replay
from dspark_core.engines.standin_drafter import LookupDrafter, lookup_draft
from dspark_core.sim.loop import SpeculativeLoop
from dspark_core.reference import ReferenceStager
from dspark_core.sim.toy import TargetOutput, ToyTarget


def activation_rows(n: int, n_layers: int, n_embd: int, seed: int = 0) -> np.ndarray:
    """Rows shaped like a real target's: N(0, 1) noise, two massive channels per layer
    (1e3 .. 9e4, present on every token, as in Gemma 3), and a huge-norm BOS row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n_layers, n_embd)).astype(np.float32)
    x[0] *= 30.0  # BOS: a huge-norm row
    for k in range(n_layers):
        x[:, k, 7 + k] = rng.uniform(1e3, 3e3, n) * (k + 1)
        x[:, k, n_embd * 3 // 4 + k] = -rng.uniform(2e4, 9e4, n)
    return x.reshape(n, n_layers * n_embd)


# ---------------------------------------------------------------------------------------
# the stand-in drafter


def test_lookup_draft_continues_the_latest_match_of_the_longest_suffix():
    h = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 5 (latest earlier) -> 7, 8, 5, 1
    assert lookup_draft(h, 4, ngram=3) == [7, 8, 5, 1]
    # no 3- or 2-gram match: falls back to the last token's latest earlier occurrence
    assert lookup_draft([4, 5, 6, 4, 6], 3, ngram=3) == [4, 6, 6]  # padded with the last token
    assert lookup_draft([1, 2, 3], 2) == [3, 3]  # nothing matches: repeat the last token
    with pytest.raises(ValueError):
        lookup_draft([], 2)


class _CopyTarget:
    """A target over real token ids whose text repeats: greedy next token = the token 5 back."""

    feature_dim = 3 * 64

    def __init__(self) -> None:
        self.toy = ToyTarget(feature_dim=self.feature_dim, seed=3)
        self.toks: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self.toks)

    def reset(self) -> None:
        self.toy.reset()
        self.toks = []

    def decode(self, tokens):
        nxt = []
        for t in tokens:
            self.toks.append(int(t))
            nxt.append(self.toks[-5] if len(self.toks) >= 5 else 1000 + len(self.toks))
        out = self.toy.decode([t % self.toy.vocab_size for t in tokens])
        rows = out.rows * 1.0
        rows[:, 40] += 4e4  # a massive channel
        return TargetOutput(np.asarray(nxt, np.int64), rows)

    def rollback(self, n_past: int) -> None:
        self.toy.rollback(n_past)
        del self.toks[n_past:]


def _session(storage="f32", nonfinite="error"):
    tgt = _CopyTarget()
    cfg = StagerConfig(tgt.feature_dim, 4, 64, storage=storage, nonfinite=nonfinite)
    checked = CheckedStager(ReferenceStager(cfg))
    drafter = LookupDrafter(lambda: tgt.toks, tgt.feature_dim, 4)
    loop = SpeculativeLoop(checked, drafter, tgt, prefill_chunk=16, use_draft_many=False)
    prompt = [11, 12, 13, 14, 15] * 20
    res = loop.run([prompt], 150)
    return tgt, checked, drafter, res


def test_session_with_the_lookup_drafter_accepts_and_stages_every_row_exactly():
    tgt, checked, drafter, res = _session()
    seq = res.sequences[0]
    # the text repeats with period 5, so prompt lookup predicts it: drafts are accepted
    assert seq.acceptance > 0.9
    want = [tgt.toks[i] for i in range(100, 100 + 150)]
    assert seq.tokens.tolist() == want  # the loop is lossless with the stand-in drafter
    stats = checked.stats(0)
    assert stats["rebases"] >= 2  # 250 positions through a window of 64
    assert checked.staged_rows_checked == stats["staged_rows"] > 0
    assert drafter.rows_consumed == stats["staged_rows"]


def test_replay_on_other_storages_follows_the_recorded_plans():
    _, checked, _, res = _session()  # recorded on the reference Stager
    f32 = checked.stats(0)
    core_f32 = Stager(checked.config)
    r32 = {Stager: replay(checked.trace, core_f32)}  # the C++ core follows the reference's plans
    assert r32[Stager].peak_rows == core_f32.stats(0)["peak_rows"]  # lazy trims: more than the reference
    r32[ReferenceStager] = replay(checked.trace, ReferenceStager(checked.config))
    # the reference trims eagerly; the replay also sees the verify rows held before accept
    assert res.sequences[0].peak_rows <= r32[ReferenceStager].peak_rows <= r32[Stager].peak_rows
    assert r32[Stager].peak_rows <= checked.config.ring_rows
    for storage in ("bf16", "q8_0", "q4_0"):
        for make in (Stager, ReferenceStager):
            r = replay(checked.trace, make(checked.config.replace(storage=storage)))
            assert r.staged_rows_checked == r.staged_rows == f32["staged_rows"]
            assert r.rebases == f32["rebases"]
            assert r.peak_rows == r32[make].peak_rows  # the storage changes bytes, never rows
            assert r.peak_bytes == r.peak_rows * r.row_bytes


def test_replay_reports_a_plan_that_differs_from_the_recorded_one():
    _, checked, _, _ = _session()
    trace = list(checked.trace)
    i = next(i for i, c in enumerate(trace) if c[0] == "draft" and len(c[3]) > 1)
    op, seq, n_past, key = trace[i]
    trace[i] = (op, seq, n_past, (not key[0], *key[1:]))  # flip clear_cache
    with pytest.raises(StagingMismatch, match="differs from the recorded one"):
        replay(trace, ReferenceStager(checked.config))


class _Plan:
    def __init__(self, rows, positions, pos_base, encoded=None):
        self.seq, self.rows, self.positions, self.pos_base = 0, rows, positions, pos_base
        self.encoded_rows = encoded


def test_check_plan_catches_a_wrong_row_and_a_wrong_encoding():
    cfg = StagerConfig(64, 4, 32, storage="q8_0")
    log = activation_rows(10, 2, 32)
    enc = quantize_rows(log[3:7], "q8_0")
    good = dequantize_rows(enc, "q8_0", 64)
    assert check_plan(_Plan(good, np.arange(0, 4), 3, enc), log, cfg) == 4
    shifted = dequantize_rows(quantize_rows(log[4:8], "q8_0"), "q8_0", 64)  # the rows one position later
    with pytest.raises(StagingMismatch, match="position 3"):
        check_plan(_Plan(shifted, np.arange(0, 4), 3, enc), log, cfg)
    bad_enc = enc.copy()
    bad_enc[2, 5] ^= 1
    with pytest.raises(StagingMismatch, match="encoded row at position 5"):
        check_plan(_Plan(good, np.arange(0, 4), 3, bad_enc), log, cfg)
    f32 = StagerConfig(64, 4, 32)
    one_ulp = log[3:7].copy()
    one_ulp.view(np.uint32)[1, 9] += 1
    with pytest.raises(StagingMismatch, match="position 4"):
        check_plan(_Plan(one_ulp, np.arange(0, 4), 3), log, f32)


# ---------------------------------------------------------------------------------------
# massive activations


def test_massive_activations_finds_the_planted_channels_per_layer():
    rows = activation_rows(50, 3, 128, seed=1)
    acts = massive_activations(rows, (2, 9, 16), 128)
    x = np.abs(rows.reshape(50, 3, 128))
    for k, a in enumerate(acts):
        assert a.layer == (2, 9, 16)[k]
        assert a.massive_channels == [96 + k, 7 + k]  # largest first
        assert a.max_channel == 96 + k
        assert a.max_abs == float(x[:, k].max())
        assert a.median_abs == pytest.approx(float(np.median(x[:, k])))
        assert a.tokens_with_massive == 50


def test_storage_outcomes_classifies_from_the_staged_values():
    rows = activation_rows(12, 2, 64, seed=2)
    big = float(rows.flat[np.argmax(np.abs(rows))])

    def make(storage, policy):
        return ReferenceStager(StagerConfig(128, 4, 32, storage=storage, nonfinite=policy))

    out = {(o.storage, o.nonfinite): o for o in storage_outcomes(rows, make, ("f32", "bf16", "q8_0", "q4_0"), ("error",))}
    assert out["f32", "error"].outcome == "kept" and out["f32", "error"].staged_max == big
    assert out["f32", "error"].changed_beyond_rounding == 0
    import ml_dtypes

    assert out["bf16", "error"].staged_max == float(np.float32(big).astype(ml_dtypes.bfloat16))
    for q in ("q8_0", "q4_0"):
        o = out[q, "error"]
        assert o.outcome == "kept" and o.nonfinite_staged == 0
        # nonzero values sharing a block with a massive value that gguf-py's round trip sends to 0
        qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[q]
        back = gguf.dequantize(gguf.quantize(rows, qt), qt).reshape(12, -1, 32)
        xb = rows.reshape(12, -1, 32)
        in_big = np.abs(xb).max(axis=2, keepdims=True) > 20 * np.median(np.abs(rows))
        assert o.small_lost == int(np.count_nonzero(in_big & (xb != 0) & (back == 0))) > 100

    nan_rows = rows.copy()
    nan_rows[3, 5] = np.nan
    o = storage_outcomes(nan_rows, make, ("f32",), ("error", "zero"))
    assert o[0].outcome == "rejected (ValueError)" and "position 3" in o[0].message
    assert o[1].outcome == "kept" and o[1].changed_beyond_rounding == 1  # the NaN, now 0


# ---------------------------------------------------------------------------------------
# the optional dependency


def test_importing_dspark_core_and_the_engines_never_imports_llama_cpp():
    code = (
        "import sys, dspark_core, dspark_core.engines, dspark_core.engines.llama_cpp, dspark_core.cli;"
        "import dspark_core.cli.capture;"
        "assert 'llama_cpp' not in sys.modules, 'llama_cpp imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_missing_llama_cpp_is_an_import_error_with_the_install_command(monkeypatch):
    from dspark_core.engines import llama_cpp as eng

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # "not installed"
    assert eng.available() is False
    with pytest.raises(ImportError, match=r"pip install 'dspark_core\[llama-cpp\]'"):
        eng.LlamaCppCapture("model.gguf", [2])
    with pytest.raises(ImportError, match=r"pip install 'dspark_core\[llama-cpp\]'"):
        eng.load_llama("model.gguf")


def test_capture_command_is_listed_and_says_what_is_missing(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["capture", "--help"])
    assert e.value.code == 0
    assert "--target" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert main(["capture", "--target", str(tmp_path / "m.gguf"), "-q"]) == 2
    assert "pip install 'dspark_core[llama-cpp]'" in capsys.readouterr().err
    assert main(["capture", "--target", "x.gguf", "--layers", "2,a"]) == 2
    assert "--layers must be integers" in capsys.readouterr().err


def test_tap_layers_from_drafter_metadata_and_the_default_taps():
    from dspark_core import DrafterInfo
    from dspark_core.engines.llama_cpp import default_tap_layers, tap_layers_from

    info = DrafterInfo(path="d.gguf", architecture="dflash", block_size=16, target_layers=(2, 10, 17))
    assert tap_layers_from(info) == (2, 10, 17)
    assert tap_layers_from(info, layer_shift=1) == (1, 9, 16)  # hidden_states indices -> l_out indices
    with pytest.raises(ValueError, match="no target layers"):
        tap_layers_from(DrafterInfo(path="d.gguf", architecture="dflash", block_size=16))
    assert default_tap_layers(18) == (2, 9, 15)
    with pytest.raises(ValueError, match="too shallow"):
        default_tap_layers(4)
