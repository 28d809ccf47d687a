"""The one table of storages, policies, skip reasons and fail stages, read from the C++ core.

Checked against independent sources (gguf-py's block table, numpy's item
sizes, the reference twin's own list) and against what the core does with
each name, so a table that drifted from the core cannot pass.
"""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest

import dspark_core
from dspark_core import Stager, StagerConfig, formats
from dspark_core.stager import core_tables
from dspark_core.stager import config as config_mod
from dspark_core.stager import stage_plan
from dspark_core.reference import ReferenceStager
from dspark_core.reference import formats as ref_formats

_FLOAT_ITEMSIZE = {"f32": np.dtype(np.float32).itemsize, "f16": np.dtype(np.float16).itemsize,
                   "bf16": np.dtype(ml_dtypes.bfloat16).itemsize}
_GGUF_TYPE = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def test_storages_match_the_reference_and_gguf_block_sizes():
    assert core_tables.STORAGES == ref_formats.STORAGES
    for name, fmt in core_tables.STORAGE_FORMATS.items():
        if name in _GGUF_TYPE:
            assert (fmt.block_elems, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[_GGUF_TYPE[name]]
            assert fmt.quantized
        else:
            assert (fmt.block_elems, fmt.block_bytes) == (1, _FLOAT_ITEMSIZE[name])
            assert not fmt.quantized


@pytest.mark.parametrize("storage", core_tables.STORAGES)
def test_row_bytes_equal_the_reference_encoding(storage):
    fmt = core_tables.STORAGE_FORMATS[storage]
    dim = 3 * 32
    x = np.random.default_rng(0).standard_normal((2, dim)).astype(np.float32)
    enc = np.ascontiguousarray(ref_formats.encode(x, storage))
    assert enc.nbytes == 2 * fmt.row_bytes(dim) == 2 * formats.row_bytes(storage, dim)
    assert config_mod.storage_row_bytes(storage, dim) == fmt.row_bytes(dim)
    if fmt.quantized:
        with pytest.raises(dspark_core.ConfigError, match=f"{storage}.*feature_dim"):
            fmt.row_bytes(dim + 1)


def test_one_table_everywhere():
    """Every module's names are the core table's objects, not copies."""
    assert dspark_core.STORAGES is core_tables.STORAGES is config_mod.STORAGES is formats.STORAGES
    assert dspark_core.NONFINITE_POLICIES is config_mod.NONFINITE_POLICIES is core_tables.NONFINITE_POLICIES
    assert formats.NONFINITE_POLICIES == (*core_tables.NONFINITE_POLICIES, "keep")
    assert dspark_core.SKIP_REASONS is stage_plan.SKIP_REASONS is core_tables.SKIP_REASONS
    assert dspark_core.FAIL_STAGES is stage_plan.FAIL_STAGES is core_tables.FAIL_STAGES


@pytest.mark.parametrize("policy", core_tables.NONFINITE_POLICIES)
@pytest.mark.parametrize("cls", [Stager, ReferenceStager])
def test_every_policy_is_a_working_config(cls, policy):
    st = cls(StagerConfig(32, 2, 16, storage="f16", nonfinite=policy))
    st.begin(0)
    rows = np.ones((3, 32), np.float32)
    st.process(0, np.arange(3), rows)
    assert st.draft(0, 3).skip is None


def test_skip_reasons_are_what_the_core_returns():
    """The core's skips that a plain call sequence reaches are named by the table."""
    st = Stager(StagerConfig(32, 2, 16, max_failures=1))
    st.begin(0)
    seen = {st.draft(0, 0).skip}  # nothing processed yet
    st.process(0, np.arange(4), np.ones((4, 32), np.float32))
    plan = st.draft(0, 4)
    assert plan.skip is None
    st.fail(0, core_tables.FAIL_STAGES[0])  # max_failures=1: the sequence is disabled
    seen.add(st.draft(0, 4).skip)
    assert seen <= set(core_tables.SKIP_REASONS)
    assert "disabled" in seen
    for stage in core_tables.FAIL_STAGES:
        st.begin(0)
        st.process(0, np.arange(4), np.ones((4, 32), np.float32))
        assert st.draft(0, 4).skip is None
        st.fail(0, stage)  # accepted: the core knows every stage the table names
    st.begin(0)
    st.process(0, np.arange(4), np.ones((4, 32), np.float32))
    st.draft(0, 4)
    with pytest.raises(ValueError, match="stage must be one of"):
        st.fail(0, "verify")


def test_the_fuzz_codec_reaches_every_policy():
    """The op codec's policy table names exactly the core's policies (a new one gets fuzzed)."""
    from dspark_core.testing import ops

    assert set(ops._NONFINITE_BY_BYTE) == set(core_tables.NONFINITE_POLICIES)


@pytest.mark.parametrize("block, window", [(1, 3), (4, 9), (7, 20), (16, 2048), (3, 1 << 30)])
def test_derived_sizes_are_the_cores(block, window):
    """w_keep and ring_rows come from the core: StagerConfig's equal a Stager's and the
    documented formulas (K = min(W // 2, W - B); W + TRIM_CHUNK + B + 1), and the old name
    of ring_rows still answers, with a DeprecationWarning."""
    cfg = StagerConfig(32, block, window)
    assert cfg.w_keep == core_tables.w_keep(block, window) == min(window // 2, window - block)
    assert cfg.ring_rows == core_tables.ring_rows(block, window) == window + core_tables.TRIM_CHUNK + block + 1
    if window < 1 << 20:  # a Stager of one sequence reserves its ring's address space only
        st = Stager(cfg)
        assert (st.w_keep, st.ring_rows) == (cfg.w_keep, cfg.ring_rows)
    with pytest.warns(DeprecationWarning, match="ring_rows"):
        assert cfg.max_buffered_rows == cfg.ring_rows
