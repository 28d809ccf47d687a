"""DrafterInfo.from_gguf: key spellings, precedence, warnings, bad files, payload never read.

Expected values are literals worked out by hand from the metadata each test
writes (see the comments), never computed by the code under test.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGUFEndian, GGUFReader

from dspark_core.context_plan import plan_context
from dspark_core.gguf.drafter_info import DrafterInfo, DrafterMetadataError
from dspark_core.gguf.reader import _reader_class
from dspark_core.errors import ConfigError
from gguf_helpers import T, dflash_kv, dspark_kv, typed, write_gguf

LOGGER = "dspark_core"


def _mapped(path: Path) -> bool:
    """Whether ``path`` is memory-mapped in this process (False where /proc is absent)."""
    try:
        with open("/proc/self/maps") as f:
            return str(Path(path).resolve()) in f.read()
    except OSError:
        return False


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


# ---------------------------------------------------------------------------
# Key spellings
# ---------------------------------------------------------------------------


def test_dspark_double_prefix_every_field(tmp_path: Path) -> None:
    # fc.weight numpy shape (5120, 25600) -> GGUF ne = [25600, 5120];
    # 25600 = 5 target layers * 5120 (= dspark.embedding_length) -> feature_dim 25600.
    p = write_gguf(
        tmp_path / "d.gguf",
        "dspark",
        dspark_kv(style="dspark.dspark", **{"dspark.embedding_length": 5120, "general.name": "Drafter-27B"}),
        [("fc.weight", (5120, 25600), "float16"), ("blk.0.attn_q.weight", (5120, 5120), "float16")],
    )
    info = DrafterInfo.from_gguf(p)
    assert info.path == str(p)
    assert info.architecture == "dspark"
    assert info.name == "Drafter-27B"
    assert info.block_size == 16
    assert info.mask_token_id == 151669
    assert info.target_layers == (1, 16, 31, 46, 61)
    assert info.n_capture == 5
    assert info.n_ctx_train == 4096
    assert info.n_ctx_train_source == "dspark.context_length"
    assert info.context_length == 4096
    assert info.trained_context_length is None
    assert info.feature_dim == 25600
    assert info.feature_dim_source == "tensor fc.weight"
    assert info.embedding_length == 5120
    assert info.n_tensors == 2
    # file = header + 2 payloads: 5120*25600*2 = 262,144,000 and 5120*5120*2 = 52,428,800 bytes
    assert info.file_size == os.path.getsize(p)
    assert info.file_size > 262_144_000 + 52_428_800
    assert info.warnings == ()
    assert dict(info.sources) == {
        "block_size": "dspark.dspark.block_size",
        "mask_token_id": "dspark.dspark.mask_token_id",
        "target_layers": "dspark.dspark.target_layers",
        "n_ctx_train": "dspark.context_length",
        "feature_dim": "tensor fc.weight",
    }


def test_dspark_single_prefix(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv(block_size=8, mask_token_id=7, target_layers=[3, 5], style="dspark"))
    info = DrafterInfo.from_gguf(p)
    assert (info.block_size, info.mask_token_id, info.target_layers) == (8, 7, (3, 5))
    assert info.sources["block_size"] == "dspark.block_size"
    assert info.feature_dim is None  # no tensors, no key


def test_dflash_as_llama_cpp_writes_it(tmp_path: Path) -> None:
    # gpt-oss-120b DFlash: fc.weight [14400, 2880]; 14400 = 5 * 2880; no embedding_length
    # key, so the width comes from the tensor named exactly "fc" (tier 2).
    p = write_gguf(tmp_path / "f.gguf", "dflash", dflash_kv(), [("fc.weight", (2880, 14400), "float16")])
    info = DrafterInfo.from_gguf(p)
    assert info.architecture == "dflash"
    assert info.block_size == 10
    assert info.mask_token_id == 200000
    assert info.sources["mask_token_id"] == "tokenizer.ggml.mask_token_id"
    assert info.target_layers == (2, 10, 18, 26, 34)
    assert info.n_ctx_train == 4096 and info.n_ctx_train_source == "dflash.context_length"
    assert info.feature_dim == 14400


def test_dflash_double_prefix(tmp_path: Path) -> None:
    kv = {"dflash.dflash.block_size": 6, "dflash.dflash.mask_token_id": 9, "dflash.dflash.target_layers": [4], "dflash.context_length": 2048}
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "f.gguf", "dflash", kv))
    assert (info.block_size, info.mask_token_id, info.target_layers, info.n_ctx_train) == (6, 9, (4,), 2048)
    assert info.sources["block_size"] == "dflash.dflash.block_size"


@pytest.mark.parametrize("arch", ["dflash", "qwen3"])
def test_other_family_spellings_accepted(tmp_path: Path, arch: str) -> None:
    kv = {"dspark.dspark.block_size": 4, "dspark.target_layers": [1, 2], f"{arch}.context_length": 1024}
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "x.gguf", arch, kv))
    assert info.architecture == arch
    assert info.block_size == 4
    assert info.target_layers == (1, 2)
    assert info.mask_token_id is None
    assert info.n_ctx_train == 1024


def test_own_spelling_wins_over_other_spellings(tmp_path: Path) -> None:
    kv = {"dspark.block_size": 8, "dspark.dspark.block_size": 16, "dflash.block_size": 3, "dspark.context_length": 4096}
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv))
    assert info.block_size == 16 and info.sources["block_size"] == "dspark.dspark.block_size"


@pytest.mark.parametrize("sub", [T.INT32, T.UINT32, T.INT64, T.UINT64, T.UINT16])
def test_target_layer_array_types(tmp_path: Path, sub: T) -> None:
    kv = dspark_kv(target_layers=[], **{"dspark.dspark.target_layers": typed([2, 10, 18, 26, 34], T.ARRAY, sub)})
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv))
    assert info.target_layers == (2, 10, 18, 26, 34)
    assert all(type(x) is int for x in info.target_layers)


def test_target_layer_ids_alias(tmp_path: Path) -> None:
    kv = {"dspark.block_size": 5, "dspark.target_layer_ids": typed([8, 24, 52], T.ARRAY, T.UINT32), "dspark.context_length": 4096}
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv))
    assert info.target_layers == (8, 24, 52) and info.sources["target_layers"] == "dspark.target_layer_ids"


@pytest.mark.parametrize("vtype", [T.UINT8, T.INT16, T.INT32, T.UINT64, T.INT64])
def test_integer_widths_for_scalars(tmp_path: Path, vtype: T) -> None:
    kv = dspark_kv(**{"dspark.dspark.block_size": typed(12, vtype), "dspark.context_length": typed(100, vtype)})
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv))
    assert (info.block_size, info.n_ctx_train) == (12, 100)


def test_big_endian_file(tmp_path: Path) -> None:
    kv = dspark_kv(**{"tokenizer.ggml.tokens": typed(["a", "bb", "ccc"], T.ARRAY, T.STRING), "dspark.trained_context_length": 8192})
    p = write_gguf(tmp_path / "be.gguf", "dspark", kv, [("fc.weight", (64, 320), "float32")], endianess=GGUFEndian.BIG)
    info = DrafterInfo.from_gguf(p)
    assert (info.block_size, info.mask_token_id, info.target_layers) == (16, 151669, (1, 16, 31, 46, 61))
    assert info.n_ctx_train == 8192
    assert info.feature_dim == 320  # 320 = 5 layers * 64, tensor named fc


# ---------------------------------------------------------------------------
# n_ctx_train precedence
# ---------------------------------------------------------------------------


def test_trained_context_length_wins(tmp_path: Path) -> None:
    kv = dspark_kv(context_length=262144, **{"dspark.trained_context_length": 4096})
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv))
    assert info.n_ctx_train == 4096
    assert info.n_ctx_train_source == "dspark.trained_context_length"
    assert info.context_length == 262144 and info.trained_context_length == 4096


def test_trained_context_length_doubled_prefix(tmp_path: Path) -> None:
    kv = dspark_kv(**{"dspark.dspark.trained_context_length": 3000})
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv))
    assert (info.n_ctx_train, info.n_ctx_train_source) == (3000, "dspark.dspark.trained_context_length")


def test_override_wins_over_both(tmp_path: Path) -> None:
    kv = dspark_kv(context_length=262144, **{"dspark.trained_context_length": 4096})
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv), n_ctx_train=1000)
    assert (info.n_ctx_train, info.n_ctx_train_source) == (1000, "override")
    assert info.context_length == 262144 and info.trained_context_length == 4096
    assert info.sources["n_ctx_train"] == "override"


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4096"])
def test_bad_override(tmp_path: Path, bad: object) -> None:
    p = write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv())
    with pytest.raises(ConfigError, match="n_ctx_train"):
        DrafterInfo.from_gguf(p, n_ctx_train=bad)  # type: ignore[arg-type]


def test_no_context_length_at_all(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv(context_length=None))
    info = DrafterInfo.from_gguf(p)
    assert info.n_ctx_train is None and info.n_ctx_train_source is None
    with pytest.raises(DrafterMetadataError, match=r"trained context is unknown.*n_ctx_train=") as ei:
        plan_context(info, None, 2048)
    assert str(ei.value).startswith(f"{p}: ")
    assert DrafterInfo.from_gguf(p, n_ctx_train=4096).n_ctx_train == 4096


# ---------------------------------------------------------------------------
# feature width
# ---------------------------------------------------------------------------


def test_feature_dim_explicit_key(tmp_path: Path) -> None:
    kv = dspark_kv(**{"dspark.feature_dim": 25600})
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv, [("fc.weight", (64, 320), "float32")]))
    assert (info.feature_dim, info.feature_dim_source) == (25600, "dspark.feature_dim")  # key beats tensor


def test_feature_dim_from_target_embedding_length(tmp_path: Path) -> None:
    kv = dspark_kv(**{"dspark.target_embedding_length": 5120})
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv))
    # 5 target layers * 5120 = 25600
    assert info.feature_dim == 25600
    assert info.feature_dim_source == "5 * dspark.target_embedding_length"


def test_feature_dim_from_proj_tensor_and_hidden_size(tmp_path: Path) -> None:
    # 3 layers, embedding_length 4096: enc.weight ne[0] = 12288 = 3 * 4096 (tier 1);
    # attn_q is not a projection name and is ignored.
    kv = dspark_kv(target_layers=[2, 4, 6], **{"dspark.embedding_length": 4096})
    tensors = [("blk.0.attn_q.weight", (4096, 4096), "float16"), ("enc.weight", (4096, 12288), "float16")]
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", kv, tensors))
    assert (info.feature_dim, info.feature_dim_source) == (12288, "tensor enc.weight")


@pytest.mark.parametrize(
    "tensors",
    [
        [],  # no tensors
        [("fc.weight", (64, 321), "float32")],  # 321 not divisible by 5 layers
        [("fc.weight", (64,), "float32")],  # not 2-D
        [("blk.0.ffn_up.weight", (64, 320), "float32")],  # not a projection name
        [("a.fc.weight", (64, 320), "float32"), ("b.fc.weight", (64, 640), "float32")],  # ambiguous
    ],
)
def test_feature_dim_unknown_is_none(tmp_path: Path, tensors: list) -> None:
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv(), tensors))
    assert info.feature_dim is None and info.feature_dim_source is None


# ---------------------------------------------------------------------------
# The inherited-context warning
# ---------------------------------------------------------------------------


def test_placeholder_context_length_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv(context_length=262144))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = DrafterInfo.from_gguf(p)
        plan = plan_context(info, 262144, 2048)  # also equal to the target: still one warning
    recs = _warnings(caplog)
    assert len(recs) == 1
    msg = recs[0].getMessage()
    assert "dspark.context_length" in msg and "262144" in msg
    assert "n_ctx_train=" in msg and "dspark.trained_context_length" in msg
    assert info.n_ctx_train == 262144  # reported, not guessed
    assert len(info.warnings) == 1 and plan.warnings == info.warnings


def test_context_equal_to_target_warns_from_gguf(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = write_gguf(tmp_path / "f.gguf", "dflash", dflash_kv(context_length=32768))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = DrafterInfo.from_gguf(p, target_n_ctx=32768)
        plan_context(info, 32768, 2048)
    recs = _warnings(caplog)
    assert len(recs) == 1
    assert "dflash.context_length = 32768" in recs[0].getMessage()
    assert "target's context (32768)" in recs[0].getMessage()


def test_context_equal_to_target_warns_from_plan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = write_gguf(tmp_path / "f.gguf", "dflash", dflash_kv(context_length=32768))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = DrafterInfo.from_gguf(p)
        assert _warnings(caplog) == []
        plan = plan_context(info, 32768, 2048)
    recs = _warnings(caplog)
    assert len(recs) == 1 and "dflash.context_length" in recs[0].getMessage()
    assert len(plan.warnings) == 1


@pytest.mark.parametrize(
    "kv, override, target",
    [
        (dspark_kv(context_length=4096), None, 32768),  # genuine trained range
        (dspark_kv(context_length=262144, **{"dspark.trained_context_length": 4096}), None, 262144),  # explicit key
        (dspark_kv(context_length=262144), 4096, 262144),  # caller override
        (dspark_kv(context_length=32768, **{"dspark.trained_context_length": 32768}), None, 32768),
    ],
)
def test_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture, kv: dict, override: int | None, target: int) -> None:
    p = write_gguf(tmp_path / "d.gguf", "dspark", kv)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = DrafterInfo.from_gguf(p, n_ctx_train=override, target_n_ctx=target)
        plan_context(info, target, 2048)
    assert _warnings(caplog) == []
    assert info.warnings == ()


# ---------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------


def _bad(path: Path, match: str, **kw: object) -> DrafterMetadataError:
    with pytest.raises(DrafterMetadataError, match=match) as ei:
        DrafterInfo.from_gguf(path, **kw)  # type: ignore[arg-type]
    err = ei.value
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert str(err).startswith(f"{path}: "), str(err)
    assert err.path == str(path)
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)  # no chained traceback
    assert not _mapped(path)  # the error holds no file mapping
    assert "\n" not in str(err)
    return err


def test_missing_file(tmp_path: Path) -> None:
    _bad(tmp_path / "nope.gguf", "no such file")


def test_directory(tmp_path: Path) -> None:
    _bad(tmp_path, "is a directory")


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "e.gguf"
    p.write_bytes(b"")
    _bad(p, "empty file")


@pytest.mark.parametrize("data", [b"PK\x03\x04" + b"\0" * 100, b"hello world, not a model\n", b"GG"])
def test_not_a_gguf(tmp_path: Path, data: bytes) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(data)
    _bad(p, "not a GGUF file")


def test_unsupported_version(tmp_path: Path) -> None:
    p = tmp_path / "v.gguf"
    p.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + b"\0" * 16)
    _bad(p, "unsupported GGUF version 7")


def _tokenized_file(tmp_path: Path) -> Path:
    kv = dspark_kv(**{"tokenizer.ggml.tokens": typed([f"t{i}" for i in range(50)], T.ARRAY, T.STRING)})
    return write_gguf(tmp_path / "full.gguf", "dspark", kv, [("fc.weight", (64, 320), "float32")])


@pytest.mark.parametrize("where", ["header", "kv", "string_array", "tensor_info", "payload"])
def test_truncated(tmp_path: Path, where: str) -> None:
    full = _tokenized_file(tmp_path).read_bytes()
    data_start = len(full) - 64 * 320 * 4  # the payload is the last 81,920 bytes
    cut = {
        "header": 10,
        "kv": full.index(b"dspark.dspark.mask_token_id") + 5,
        "string_array": full.index(b"t25"),
        "tensor_info": full.index(b"fc.weight") + 3,
        "payload": data_start + 1000,
    }[where]
    p = tmp_path / "cut.gguf"
    p.write_bytes(full[:cut])
    _bad(p, "truncated")


@pytest.mark.parametrize("key, item", [(b"tokenizer.ggml.tokens", 8), (b"dspark.dspark.target_layers", 5)])
def test_corrupt_array_length_fails_fast(tmp_path: Path, key: bytes, item: int) -> None:
    # An array length of 2**60: the stock reader would loop over it; this must fail at once.
    data = bytearray(_tokenized_file(tmp_path).read_bytes())
    at = data.index(key) + len(key)
    assert int.from_bytes(data[at : at + 4], "little") == 9  # ARRAY
    assert int.from_bytes(data[at + 4 : at + 8], "little") == item
    data[at + 8 : at + 16] = (1 << 60).to_bytes(8, "little")
    p = tmp_path / "corrupt.gguf"
    p.write_bytes(bytes(data))
    _bad(p, "truncated")  # (the stock reader would iterate 2**60 times: this returning is the test)


def test_missing_block_size(tmp_path: Path) -> None:
    kv = {"dspark.mask_token_id": 5, "dspark.context_length": 4096}
    err = _bad(write_gguf(tmp_path / "d.gguf", "dspark", kv), "missing block_size")
    assert "dspark.dspark.block_size" in str(err) and "dflash.block_size" in str(err)


def test_missing_architecture(tmp_path: Path) -> None:
    _bad(write_gguf(tmp_path / "d.gguf", None, dspark_kv()), "missing general.architecture")


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("dspark.dspark.block_size", "16", r"dspark\.dspark\.block_size: expected an integer, found STRING"),
        ("dspark.dspark.block_size", 16.0, r"dspark\.dspark\.block_size: expected an integer, found FLOAT32"),
        ("dspark.dspark.block_size", True, r"dspark\.dspark\.block_size: expected an integer, found BOOL"),
        ("dspark.dspark.block_size", typed([16], T.ARRAY, T.UINT32), r"block_size: expected an integer, found ARRAY\[UINT32\]"),
        ("dspark.dspark.block_size", 0, r"dspark\.dspark\.block_size: must be >= 1, found 0"),
        ("dspark.dspark.mask_token_id", "<mask>", r"mask_token_id: expected an integer, found STRING"),
        ("dspark.dspark.mask_token_id", typed(-1, T.INT32), r"mask_token_id: must be >= 0, found -1"),
        ("dspark.dspark.target_layers", typed([1.0, 2.0], T.ARRAY, T.FLOAT32), r"target_layers: expected an integer array, found ARRAY\[FLOAT32\]"),
        ("dspark.dspark.target_layers", typed(["1", "2"], T.ARRAY, T.STRING), r"target_layers: expected an integer array, found ARRAY\[STRING\]"),
        ("dspark.dspark.target_layers", 3, r"target_layers: expected an integer array, found UINT32"),
        ("dspark.dspark.target_layers", typed([1, -2], T.ARRAY, T.INT32), r"target_layers: layer ids must be >= 0"),
        ("dspark.context_length", 4096.0, r"dspark\.context_length: expected an integer, found FLOAT32"),
        ("dspark.trained_context_length", "4k", r"dspark\.trained_context_length: expected an integer, found STRING"),
        ("general.architecture", typed(7, T.UINT32), r"general\.architecture: expected a string, found UINT32"),
    ],
)
def test_wrong_value_types(tmp_path: Path, key: str, value: object, match: str) -> None:
    kv = dspark_kv()
    kv[key] = value
    _bad(write_gguf(tmp_path / "d.gguf", "dspark", kv), match)


def test_trained_range_too_small_for_block(tmp_path: Path) -> None:
    # block 16, context 32: 32 <= 2 * 16 = 32 -> no window can work
    p = write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv(context_length=32))
    err = _bad(p, r"n_ctx_train \(32, from dspark\.context_length\) must be greater than 2 \* block_size \(2 \* 16 = 32\)")
    assert "rebase" in str(err)
    _bad(p, r"n_ctx_train \(20, from the override\)", n_ctx_train=20)
    assert DrafterInfo.from_gguf(p, n_ctx_train=33).n_ctx_train == 33  # 33 > 32


# ---------------------------------------------------------------------------
# The reader itself
# ---------------------------------------------------------------------------


def test_fast_reader_agrees_with_stock_reader(tmp_path: Path) -> None:
    kv = dspark_kv(
        **{
            "tokenizer.ggml.tokens": typed(["a", "bé", "ccc"], T.ARRAY, T.STRING),
            "tokenizer.ggml.scores": typed([0.5, -1.0, 2.0], T.ARRAY, T.FLOAT32),
            "tokenizer.ggml.token_type": typed([1, 2, 3], T.ARRAY, T.INT32),
            "x.u64s": typed([1 << 40, 3], T.ARRAY, T.UINT64),
            "x.f64": typed(0.25, T.FLOAT64),
            "x.b": True,
            "dspark.trained_context_length": 4096,
        }
    )
    p = write_gguf(tmp_path / "d.gguf", "dspark", kv, [("fc.weight", (64, 320), "float32"), ("n.weight", (64,), "float16")])
    ours, stock = _reader_class()(str(p)), GGUFReader(p)
    assert list(ours.fields) == list(stock.fields)
    for k, f in stock.fields.items():
        if k == "tokenizer.ggml.tokens":
            continue  # string arrays are skipped, not decoded
        assert ours.fields[k].contents() == f.contents(), k
    assert ours.data_offset == stock.data_offset
    assert [(t.name, t.shape.tolist(), t.data_offset) for t in ours.tensors] == [
        (t.name, t.shape.tolist(), t.data_offset) for t in stock.tensors
    ]


def test_large_vocabulary_opens_fast(tmp_path: Path) -> None:
    # A drafter carrying the target's tokenizer (152k tokens): the stock reader
    # takes seconds walking the arrays element by element.
    kv = {
        "tokenizer.ggml.tokens": typed([f"tok{i}" for i in range(152_000)], T.ARRAY, T.STRING),
        "tokenizer.ggml.token_type": typed([1] * 152_000, T.ARRAY, T.INT32),
        **dspark_kv(),  # after the vocabulary: offsets must be right after skipping it
    }
    p = write_gguf(tmp_path / "v.gguf", "dspark", kv)
    DrafterInfo.from_gguf(p)  # warm-up (imports)
    # No timing assertion (benchmarks live in bench/): the stock reader's cost is
    # one Python object per array element, so count Python allocations instead.
    tracemalloc.start()
    info = DrafterInfo.from_gguf(p)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert (info.block_size, info.mask_token_id, info.n_ctx_train) == (16, 151669, 4096)
    assert peak < 2 << 20, peak  # < 2 MiB for 304k array elements: nothing per element


_PROBE = textwrap.dedent(
    """
    import json, resource, sys, time, tracemalloc
    import numpy as np
    import gguf  # import cost is not what is measured
    from dspark_core.gguf.drafter_info import DrafterInfo

    path, data_offset, probe_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    def rss_peak_kib():
        # This process's own peak (VmHWM). Not ru_maxrss: on Linux a child starts
        # with its parent's peak there (kept across fork + exec), so after a test
        # that made pytest big (the emulated CUDA device's arrays) every growth
        # measured here would read 0.
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    def faults():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_minflt + r.ru_majflt

    out = {}
    DrafterInfo.from_gguf(path)  # warm-up: lazy imports, reader class
    rss0, flt0 = rss_peak_kib(), faults()
    tracemalloc.start()
    t0 = time.perf_counter()
    info = DrafterInfo.from_gguf(path)
    out["seconds"] = time.perf_counter() - t0
    out["py_peak_bytes"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    out["rss_growth_kib"] = rss_peak_kib() - rss0
    out["faults"] = faults() - flt0
    out["feature_dim"] = info.feature_dim

    # Control: the same probes see a read of the first probe_bytes of payload.
    rss0, flt0 = rss_peak_kib(), faults()
    m = np.memmap(path, mode="r", offset=data_offset, shape=(probe_bytes,))
    int(m[::4096].sum())
    out["control_rss_growth_kib"] = rss_peak_kib() - rss0
    out["control_faults"] = faults() - flt0
    print(json.dumps(out))
    """
)


def test_large_payload_is_never_read(tmp_path: Path) -> None:
    # ~400 MB of tensor data (sparse: no disk blocks, written in no time):
    # fc.weight f16 (5120 x 25600) = 262,144,000 bytes, ffn_up f16 (13824 x 5120) = 141,557,760 bytes.
    tensors = [("fc.weight", (5120, 25600), "float16"), ("blk.0.ffn_up.weight", (13824, 5120), "float16")]
    p = write_gguf(tmp_path / "big.gguf", "dspark", dspark_kv(**{"dspark.embedding_length": 5120}), tensors)
    size = os.path.getsize(p)
    assert size > 403_000_000
    data_offset = size - 262_144_000 - 141_557_760  # both sizes are multiples of 32: no padding
    # The control touches every page of the payload. (It read 128 MiB once: with large
    # page-cache folios mapped per fault, as under ASan, that took only 493 faults,
    # too close to the 127 the metadata read itself takes.)
    probe = 262_144_000 + 141_557_760
    env = dict(os.environ)
    import dspark_core

    src = os.path.dirname(os.path.dirname(os.path.abspath(dspark_core.__file__)))  # where it was imported from
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(p), str(data_offset), str(probe)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["feature_dim"] == 25600  # 5 layers * 5120
    assert r["py_peak_bytes"] < 4 << 20, r  # < 4 MiB of Python allocations
    assert r["rss_growth_kib"] < 8 * 1024, r  # < 8 MiB
    # the probes do see a payload read: ~400 MB of pages -> tens of MiB of peak RSS at least
    assert r["control_rss_growth_kib"] > 32 * 1024, r
    assert r["control_faults"] > 4 * r["faults"], r


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def test_to_dict_is_json_ready(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "f.gguf", "dflash", dflash_kv(), [("fc.weight", (2880, 14400), "float16")])
    d = json.loads(json.dumps(DrafterInfo.from_gguf(p).to_dict()))
    assert d["path"] == str(p)
    assert d["architecture"] == "dflash"
    assert d["block_size"] == 10
    assert d["mask_token_id"] == 200000
    assert d["target_layers"] == [2, 10, 18, 26, 34]
    assert d["n_ctx_train"] == 4096 and d["n_ctx_train_source"] == "dflash.context_length"
    assert d["feature_dim"] == 14400
    assert d["warnings"] == []
    assert d["sources"]["mask_token_id"] == "tokenizer.ggml.mask_token_id"


def test_file_is_unmapped_after_reading(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv(), [("fc.weight", (64, 320), "float32")])
    reader = GGUFReader(p)
    assert _mapped(p) or not os.path.exists("/proc/self/maps")  # the probe sees a live mapping
    del reader
    info = DrafterInfo.from_gguf(p)
    assert info.block_size == 16
    assert not _mapped(p)


def test_info_is_frozen_and_hashable(tmp_path: Path) -> None:
    info = DrafterInfo.from_gguf(write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv()))
    with pytest.raises(AttributeError):
        info.block_size = 3  # type: ignore[misc]
    assert hash(info) == hash(DrafterInfo.from_gguf(tmp_path / "d.gguf"))
