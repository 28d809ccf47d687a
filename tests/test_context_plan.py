"""plan_context: every number checked against values worked out by hand (in the comments)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_core.stager.config import StagerConfig
from dspark_core.context_plan import ContextPlan, plan_context, row_bytes
from dspark_core.gguf.drafter_info import DrafterInfo
from dspark_core.errors import ConfigError
from gguf_helpers import dspark_kv, write_gguf


@pytest.fixture(autouse=True)
def _no_env_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSPARK_WINDOW_CAP", raising=False)


def _info(block_size: int = 16, n_ctx_train: int | None = 4096, feature_dim: int | None = 25600, **kw: object) -> DrafterInfo:
    return DrafterInfo(
        path="drafter.gguf",
        architecture="dspark",
        block_size=block_size,
        mask_token_id=151669,
        target_layers=(1, 16, 31, 46, 61),
        n_ctx_train=n_ctx_train,
        n_ctx_train_source="dspark.trained_context_length",
        feature_dim=feature_dim,
        **kw,  # type: ignore[arg-type]
    )


def test_27b_target_four_slots_q8_0() -> None:
    # B = 16, n_ctx_train = 4096, n_batch = 2048, 4 slots, D = 5 * 5120 = 25600, q8_0.
    plan = plan_context(_info(), 131072, 2048, n_parallel=4, storage="q8_0")
    assert plan.window == 2048  # min(4096, 2048)
    assert plan.window_source == "n_batch"
    assert plan.window_cap is None and plan.window_cap_source is None
    assert plan.w_keep == 1024  # min(2048 // 2 = 1024, 2048 - 16 = 2032)
    assert plan.n_ctx_seq == 2048
    assert plan.n_ctx == 8192  # 2048 * 4
    assert plan.n_batch == 2048
    assert plan.n_ubatch == 2048
    assert plan.n_batch_draft_many == 8192  # 2048 * 4: every slot's round in one batch
    assert plan.n_outputs_max == 68  # 4 * (1 + 16)
    assert plan.ring_rows == 2577  # 2048 + 512 + 16 + 1
    assert plan.row_bytes == 27200  # 25600 / 32 = 800 blocks * 34 bytes
    assert plan.peak_feature_bytes_per_seq == 70_094_400  # 2577 * 27200
    assert plan.peak_feature_bytes == 280_377_600  # 70,094,400 * 4
    assert plan.block_size == 16 and plan.feature_dim == 25600
    assert plan.storage == "q8_0" and plan.n_parallel == 4
    assert plan.target_n_ctx == 131072 and plan.n_ctx_train == 4096 and plan.target_n_batch == 2048
    assert plan.unwindowed_n_ctx == 131072  # a drafter without a window inherits the target context
    assert plan.unwindowed_n_batch == 131088  # 131072 + 16
    assert plan.path == "drafter.gguf"
    assert plan.warnings == ()


def test_window_bound_by_trained_range_f32() -> None:
    # B = 4, n_ctx_train = 4096, n_batch = 8192, D = 4096, f32, 1 slot.
    plan = plan_context(_info(block_size=4, feature_dim=4096), 32768, 8192)
    assert plan.window == 4096 and plan.window_source == "n_ctx_train"
    assert plan.w_keep == 2048  # min(2048, 4092)
    assert plan.n_ctx == 4096 and plan.n_batch == 4096 and plan.n_ubatch == 4096
    assert plan.n_outputs_max == 5  # 1 * (1 + 4)
    assert plan.ring_rows == 4613  # 4096 + 512 + 4 + 1
    assert plan.row_bytes == 16384  # 4 * 4096
    assert plan.peak_feature_bytes_per_seq == 75_579_392  # 4613 * 16384
    assert plan.peak_feature_bytes == 75_579_392


def test_tie_counts_as_trained_range() -> None:
    plan = plan_context(_info(), None, 4096)
    assert plan.window == 4096 and plan.window_source == "n_ctx_train"
    assert plan.target_n_ctx is None and plan.unwindowed_n_ctx is None and plan.unwindowed_n_batch is None


@pytest.mark.parametrize(
    "storage, rb, per_seq",
    [
        # D = 4096, B = 16, W = 2048: rows = 2048 + 512 + 16 + 1 = 2577
        ("f32", 16384, 42_221_568),  # 4 * 4096; 2577 * 16384
        ("f16", 8192, 21_110_784),  # 2 * 4096; 2577 * 8192
        ("bf16", 8192, 21_110_784),
        ("q8_0", 4352, 11_215_104),  # 128 blocks * 34; 2577 * 4352
        ("q4_0", 2304, 5_937_408),  # 128 blocks * 18; 2577 * 2304
    ],
)
def test_storage_row_bytes(storage: str, rb: int, per_seq: int) -> None:
    plan = plan_context(_info(feature_dim=4096), None, 2048, n_parallel=3, storage=storage)
    assert row_bytes(storage, 4096) == rb
    assert plan.row_bytes == rb
    assert plan.peak_feature_bytes_per_seq == per_seq
    assert plan.peak_feature_bytes == 3 * per_seq


def test_unknown_feature_dim_gives_no_bytes() -> None:
    plan = plan_context(_info(feature_dim=None), None, 2048, n_parallel=2, storage="q4_0")
    assert plan.row_bytes is None and plan.peak_feature_bytes_per_seq is None and plan.peak_feature_bytes is None
    assert plan.ring_rows == 2577
    with pytest.raises(ConfigError, match="feature_dim is unknown"):
        StagerConfig.from_plan(plan)
    cfg = StagerConfig.from_plan(plan, feature_dim=4096)
    assert (cfg.feature_dim, cfg.block_size, cfg.window, cfg.max_seqs, cfg.storage) == (4096, 16, 2048, 2, "q4_0")


def test_q_storage_needs_multiple_of_32() -> None:
    with pytest.raises(ConfigError, match=r"feature_dim % 32 == 0, got feature_dim 4100"):
        plan_context(_info(feature_dim=4100), None, 2048, storage="q4_0")
    assert plan_context(_info(feature_dim=4100), None, 2048, storage="f16").row_bytes == 8200


def test_stager_config_from_plan_matches() -> None:
    plan = plan_context(_info(), 131072, 2048, n_parallel=4, storage="q8_0")
    cfg = StagerConfig.from_plan(plan)
    assert cfg == StagerConfig(25600, 16, 2048, max_seqs=4, storage="q8_0")
    assert cfg.w_keep == plan.w_keep
    assert cfg.ring_rows == plan.ring_rows
    assert cfg.row_bytes == plan.row_bytes


# ---------------------------------------------------------------------------
# Caps
# ---------------------------------------------------------------------------


def test_cap_argument_lowers() -> None:
    plan = plan_context(_info(), None, 2048, window_cap=1000)
    assert plan.window == 1000 and plan.window_source == "cap"
    assert (plan.window_cap, plan.window_cap_source) == (1000, "window_cap")
    assert plan.w_keep == 500  # min(500, 984)
    assert plan.ring_rows == 1529  # 1000 + 512 + 16 + 1
    assert plan.n_ctx == 1000 and plan.n_batch == 1000 and plan.n_ubatch == 1000


def test_cap_never_raises() -> None:
    plan = plan_context(_info(), None, 2048, window_cap=100000)
    assert plan.window == 2048 and plan.window_source == "n_batch" and plan.window_cap == 100000


def test_env_cap_lowers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_WINDOW_CAP", "900")
    plan = plan_context(_info(), None, 2048, window_cap=1000)
    assert plan.window == 900 and plan.window_source == "cap"  # min(4096, 2048, 1000, 900)
    assert plan.window_cap_source == "DSPARK_WINDOW_CAP"
    assert plan.w_keep == 450


def test_env_cap_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_WINDOW_CAP", "5000")
    plan = plan_context(_info(), None, 2048)
    assert plan.window == 2048 and plan.window_source == "n_batch"
    monkeypatch.setenv("DSPARK_WINDOW_CAP", "5000")
    assert plan_context(_info(), None, 2048, window_cap=1200).window == 1200  # the smaller cap wins


def test_env_cap_blank_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_WINDOW_CAP", "  ")
    assert plan_context(_info(), None, 2048).window == 2048


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "1.5", "2k"])
def test_env_cap_invalid(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("DSPARK_WINDOW_CAP", raw)
    with pytest.raises(ConfigError, match="DSPARK_WINDOW_CAP") as ei:
        plan_context(_info(), None, 2048)
    assert repr(raw) in str(ei.value)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_draft_length_must_equal_block_size() -> None:
    with pytest.raises(ConfigError) as ei:
        plan_context(_info(block_size=4), None, 2048, n_draft=6)
    assert str(ei.value) == "draft length (6) must equal the drafter's block_size (4)"
    assert plan_context(_info(block_size=4), None, 2048, n_draft=4).block_size == 4


def test_window_must_exceed_twice_the_block() -> None:
    # B = 10, n_batch = 20: W = 20 <= 2 * 10
    with pytest.raises(ConfigError, match=r"window \(20\) must be greater than 2 \* block_size \(2 \* 10 = 20\)") as ei:
        plan_context(_info(block_size=10), None, 20)
    assert str(ei.value).startswith("drafter.gguf: ")
    assert "n_batch 20" in str(ei.value)
    # W = 21 is the smallest that works: w_keep = min(10, 11) = 10
    plan = plan_context(_info(block_size=10), None, 21)
    assert plan.window == 21 and plan.w_keep == 10 and plan.ring_rows == 544  # 21 + 512 + 10 + 1
    # a cap can cause it too
    with pytest.raises(ConfigError, match=r"window \(32\) must be greater than 2 \* block_size \(2 \* 16 = 32\).*cap 32"):
        plan_context(_info(), None, 2048, window_cap=32)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"n_batch": 0}, "n_batch must be >= 1"),
        ({"n_batch": 2.5}, "n_batch must be an integer"),
        ({"n_parallel": 0}, "n_parallel must be >= 1"),
        ({"storage": "f8"}, "storage 'f8' is not supported"),
        ({"target_n_ctx": 0}, "target_n_ctx must be >= 1"),
        ({"window_cap": 0}, "window_cap must be >= 1"),
        ({"n_draft": 0}, "n_draft must be >= 1"),
    ],
)
def test_bad_arguments(kw: dict, match: str) -> None:
    args = {"target_n_ctx": None, "n_batch": 2048, **kw}
    with pytest.raises(ConfigError, match=match):
        plan_context(_info(), **args)


# ---------------------------------------------------------------------------
# From a file, and output
# ---------------------------------------------------------------------------


def test_plan_from_gguf(tmp_path: Path) -> None:
    # dspark drafter: B = 16, trained 4096, fc.weight ne[0] = 25600 = 5 * 5120.
    p = write_gguf(
        tmp_path / "d.gguf",
        "dspark",
        dspark_kv(**{"dspark.embedding_length": 5120}),
        [("fc.weight", (5120, 25600), "float16")],
    )
    plan = plan_context(DrafterInfo.from_gguf(p), 65536, 8192, n_parallel=2, storage="bf16")
    assert plan.window == 4096 and plan.window_source == "n_ctx_train"
    assert plan.w_keep == 2048
    assert plan.n_ctx == 8192  # 4096 * 2
    assert plan.n_outputs_max == 34  # 2 * 17
    assert plan.ring_rows == 4625  # 4096 + 512 + 16 + 1
    assert plan.row_bytes == 51200  # 2 * 25600
    assert plan.peak_feature_bytes_per_seq == 236_800_000  # 4625 * 51200
    assert plan.peak_feature_bytes == 473_600_000
    assert plan.path == str(p)


def test_to_dict_and_table() -> None:
    plan = plan_context(_info(), 131072, 2048, n_parallel=4, storage="q8_0")
    assert isinstance(plan, ContextPlan)
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["window"] == 2048 and d["w_keep"] == 1024 and d["n_ctx"] == 8192
    assert d["n_outputs_max"] == 68 and d["peak_feature_bytes"] == 280_377_600
    assert d["window_source"] == "n_batch" and d["storage"] == "q8_0" and d["warnings"] == []
    table = plan.format_table()
    for text in ("window", "2048", "w_keep", "1024", "8192", "68", "2577", "70,094,400", "280,377,600"):
        assert text in table
    lines = table.splitlines()
    assert lines[0] == "context plan"
    rows = plan.table_rows()
    width = max(len(k) for k, _ in rows)
    assert lines[1:] == [f"  {k.ljust(width)}  {v}" for k, v in rows]  # one aligned value column


@pytest.mark.parametrize("storage", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_row_bytes_matches_the_core(storage: str) -> None:
    try:
        from dspark_core.formats import row_bytes as core_row_bytes
    except ImportError:  # pragma: no cover - compiled part not built
        pytest.skip("compiled row formats not available")
    for d in (32, 4096, 25600):
        assert row_bytes(storage, d) == core_row_bytes(storage, d)


def test_anchor_names_are_deprecated_aliases() -> None:
    plan = plan_context(_info(), 4096, 512)
    with pytest.warns(DeprecationWarning, match="unwindowed_n_ctx"):
        assert plan.anchor_n_ctx == plan.unwindowed_n_ctx == 4096
    with pytest.warns(DeprecationWarning, match="unwindowed_n_batch"):
        assert plan.anchor_n_batch == plan.unwindowed_n_batch
    assert not any("anchor" in k for k in plan.to_dict())
    assert not any("anchor" in label for label, _ in plan.table_rows())


def test_peak_rows_per_seq_is_a_deprecated_alias_of_ring_rows() -> None:
    """One name per quantity: the rows a sequence ever holds are ``ring_rows`` everywhere
    (StagerConfig, the core, the plan, its JSON)."""
    plan = plan_context(_info(), 4096, 512)
    with pytest.warns(DeprecationWarning, match=r"ContextPlan\.peak_rows_per_seq is deprecated; use ContextPlan\.ring_rows"):
        assert plan.peak_rows_per_seq == plan.ring_rows
    assert "ring_rows" in plan.to_dict() and "peak_rows_per_seq" not in plan.to_dict()
