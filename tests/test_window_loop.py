"""The synthetic loop test, extended past the window (B = 7, W = 20, K = 10).

The synthetic rounds cross the window and drive a
rebase. A 5-row prompt, accept schedule 7, 3, 0, 7, 5, 1, 4: rounds start at
5, 13, 17, 18, 26, 32, 34, 39; 17 is the first rebase. Expected values were
worked by hand from docs/design.md section 2 (see the comments per round).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import feature_rows

from dspark_core import StagerConfig

B, W, K, D = 7, 20, 10, 32

# (start, rebase, clear_cache, staged absolute rows [lo, hi), pos_base)
# Non-rebase rounds stage [n_cache, start) at [n_cache - base, start - base);
# a rebase keeps the newest K = 10 rows before start at [0, 10).
EXPECTED = [
    (5, False, True, (0, 5), 0),     # first round: whole prompt from position 0; 5 + 7 <= 20
    (13, False, False, (5, 13), 0),  # 13 - 0 + 7 = 20 <= 20: still fits
    (17, True, True, (7, 17), 7),    # 17 + 7 = 24 > 20: first rebase, keep [7, 17)
    (18, False, False, (17, 18), 7),  # 18 - 7 + 7 = 18 <= 20
    (26, True, True, (16, 26), 16),  # 26 - 7 + 7 = 26 > 20
    (32, True, True, (22, 32), 22),  # 32 - 16 + 7 = 23 > 20
    (34, False, False, (32, 34), 22),  # 34 - 22 + 7 = 19 <= 20
    (39, True, True, (29, 39), 29),  # 39 - 22 + 7 = 24 > 20
]
ACCEPTS = [7, 3, 0, 7, 5, 1, 4]


def test_window_constants():
    c = StagerConfig(D, B, W)
    assert c.w_keep == K


def test_synthetic_loop_crosses_the_window(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.begin(0)
    st.process(0, np.arange(5), feature_rows(range(5), D))
    # Rows that survive at each absolute position (version = round that sent them).
    truth = {p: feature_rows([p], D)[0] for p in range(5)}
    n_past = 5
    for rnd, (start, rebase, clear, (lo, hi), base) in enumerate(EXPECTED):
        assert n_past == start
        plan = st.draft(0, n_past)
        assert plan.skip is None
        assert plan.start == start
        assert plan.rebase is rebase, rnd
        assert plan.clear_cache is clear, rnd
        assert plan.pos_base == base
        np.testing.assert_array_equal(plan.positions, np.arange(lo - base, hi - base))
        np.testing.assert_array_equal(plan.block_positions, np.arange(start - base, start - base + B))
        assert plan.crop_from == start - base
        assert plan.positions.dtype == np.int32 and plan.block_positions.dtype == np.int32
        # Every drafter position stays inside the window.
        assert plan.block_positions[-1] < W
        np.testing.assert_array_equal(plan.rows, np.stack([truth[p] for p in range(lo, hi)]))
        st.commit(0)
        if rnd == len(ACCEPTS):
            break
        # Verification captures B + 1 rows at [start, start + B + 1); keep n + 1.
        verify = np.arange(start, start + B + 1)
        rows = feature_rows(verify, D, version=rnd + 1)
        st.process(0, verify, rows)
        n = ACCEPTS[rnd]
        st.accept(0, n)
        for k in range(n + 1):
            truth[start + k] = rows[k]
        n_past = start + n + 1
    stats = st.stats(0)
    assert stats["rounds"] == len(EXPECTED)
    assert stats["rebases"] == 4
    assert stats["restaged_rows"] == 40


def test_rejected_rows_are_never_staged(make_stager):
    """accept(0) keeps only the row of the last accepted token; the next round stages it alone."""
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(5), feature_rows(range(5), D))
    st.draft(0, 5)
    st.commit(0)
    st.process(0, np.arange(5, 13), feature_rows(range(5, 13), D, version=9))
    st.accept(0, 0)
    assert st.state(0)["end"] == 6
    plan = st.draft(0, 6)
    np.testing.assert_array_equal(plan.positions, [5])
    np.testing.assert_array_equal(plan.rows, feature_rows([5], D, version=9))
    # Rows 6.. were dropped: continuing at 7 is a gap.
    st.commit(0)
    with pytest.raises(ValueError, match="continue at 6"):
        st.process(0, [7], feature_rows([7], D))
