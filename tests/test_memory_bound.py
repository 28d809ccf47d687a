"""Bounded memory: a sequence never holds more than W + TRIM_CHUNK + B + 1 rows.

Staging without a window holds the whole prompt until the first draft (~6 GB
for a 60k prompt on a 27B target); the core keeps only rows a later round can stage.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig, TRIM_CHUNK
from dspark_core._ext import _stager
from dspark_core.reference import ReferenceStager

D, B, W = 64, 16, 1024


def test_trim_chunk_is_one_constant():
    assert TRIM_CHUNK == _stager.TRIM_CHUNK == 512


@pytest.mark.parametrize("chunk", [100_000, 4096, 512, 97])
@pytest.mark.parametrize("storage", ["f32", "q4_0"])
def test_100k_prefill_stays_bounded(chunk, storage):
    cfg = StagerConfig(D, B, W, storage=storage)
    st = Stager(cfg)
    bound = W + TRIM_CHUNK + B + 1
    rows = np.random.default_rng(0).standard_normal((chunk, D)).astype(np.float32)
    n = 0
    while n < 100_000:
        k = min(chunk, 100_000 - n)
        st.process(0, np.arange(n, n + k), rows[:k])
        n += k
        assert st.stats(0)["peak_rows"] <= bound
    stats = st.stats(0)
    assert stats["peak_rows"] <= bound
    # The ring reserved exactly the bound once and never grew.
    assert stats["reserved_bytes"] == bound * cfg.row_bytes
    assert stats["peak_bytes"] <= stats["reserved_bytes"]
    # The first round rebases onto the newest K rows: the prompt's tail.
    plan = st.draft(0, 100_000)
    assert plan.rebase and plan.n_rows == W // 2 and plan.pos_base == 100_000 - W // 2
    tail = rows[(100_000 - W // 2 - (100_000 - k)) % chunk:][: W // 2] if chunk == 100_000 else None
    if tail is not None and storage == "f32":
        np.testing.assert_array_equal(plan.rows, tail)


def test_steady_rounds_at_depth_stay_bounded():
    cfg = StagerConfig(D, B, W)
    st = Stager(cfg)
    ref = ReferenceStager(cfg)
    bound = W + TRIM_CHUNK + B + 1
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((3000, D)).astype(np.float32)
    for s in (st, ref):
        s.process(0, np.arange(3000), prompt)
    n_past = 3000
    for _r in range(400):
        verify = rng.standard_normal((B + 1, D)).astype(np.float32)
        n_acc = int(rng.integers(0, B + 1))
        for s in (st, ref):
            plan = s.draft(0, n_past)
            assert plan.block_positions[-1] < W
            s.commit(0)
            s.process(0, np.arange(n_past, n_past + B + 1), verify)
            s.accept(0, n_acc)
        n_past += n_acc + 1
        assert st.stats(0)["peak_rows"] <= bound
        assert ref.stats(0)["live_rows"] <= W  # rows still stageable never exceed the window
        assert st.stats(0)["rows"] == ref.stats(0)["rows"]  # the ring holds what the bookkeeping says
    stats = st.stats(0)
    assert stats["reserved_bytes"] == bound * cfg.row_bytes
    assert stats["live_rows"] == ref.stats(0)["live_rows"] <= W
    assert stats["trims"] > 0 and stats["trimmed_rows"] >= TRIM_CHUNK
    assert stats["rebases"] > 5
    assert st.snapshot(0) == ref.snapshot(0)


def test_begin_keeps_allocation_bounded():
    st = Stager(StagerConfig(D, B, W))
    rows = np.zeros((5000, D), np.float32)
    for _ in range(3):
        st.begin(0)
        st.process(0, np.arange(5000), rows)
    stats = st.stats(0)
    assert stats["bytes"] <= stats["reserved_bytes"] == (W + TRIM_CHUNK + B + 1) * D * 4


def test_short_context_touches_only_what_it_holds():
    """The bound is reserved as address space; only written rows become resident."""
    st = Stager(StagerConfig(D, B, W))
    st.process(0, np.arange(10), np.zeros((10, D), np.float32))
    stats = st.stats(0)
    assert stats["bytes"] == 10 * D * 4
    assert stats["reserved_bytes"] == (W + TRIM_CHUNK + B + 1) * D * 4
