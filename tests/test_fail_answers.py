"""``fail`` / ``fail_many`` answer which sequences the failure disabled, as ``to_host`` and the C
ABI's ``disabled_after`` do; core and twin alike."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.reference import ReferenceStager

D, B, W = 32, 4, 16


@pytest.mark.parametrize("cls", [Stager, ReferenceStager], ids=["core", "reference"])
def test_fail_and_fail_many_say_which_sequences_got_disabled(cls):
    """fail / fail_many answer as to_host and the C ABI do: the failure count where this
    failure disabled the sequence (max_failures in a row), else 0."""
    st = cls(StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=2, rows="external", max_failures=2))
    for q in (0, 1):
        st.begin(q)
        st.process(q, np.arange(8))
    st.draft(0, 8)
    assert st.fail(0, "decode") == 0
    st.draft(0, 8)
    assert st.fail(0, "crop") == 2  # the second in a row: disabled
    st.draft(1, 8)
    got = st.fail_many([1], ["decode"])
    assert got.dtype == np.int64 and got.tolist() == [0]
