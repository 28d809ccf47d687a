"""A server whose n_past disagrees with its buffered rows is told so, once, or stopped (strict)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import feature_rows

from dspark_core import StateError

D, B, W = 32, 4, 16


def verify_without_accept(st, seq=0):
    """A round whose verify batch is processed but never accept()-ed: rows 6..10 stay buffered."""
    st.process(seq, np.arange(6), feature_rows(range(6), D))
    assert st.draft(seq, 6).skip is None
    st.commit(seq)
    st.process(seq, np.arange(6, 6 + B + 1), feature_rows(range(6, 6 + B + 1), D))
    # The target accepted 1 draft token: its n_past is 8, the buffer ends at 11.


def mismatch_records(caplog):
    return [r for r in caplog.records if r.name == "dspark_core" and "missing_rows" in r.getMessage()]


def test_forgotten_accept_warns_once_naming_both_numbers_and_the_cause(make_stager, caplog):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    verify_without_accept(st)
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        assert st.draft(0, 8).skip == "missing_rows"
        assert st.draft(0, 8).skip == "missing_rows"
        assert st.draft(0, 9).skip == "missing_rows"
    recs = mismatch_records(caplog)
    assert len(recs) == 1  # once per sequence
    msg = recs[0].getMessage()
    assert "n_past=8" in msg and "newest buffered row is 10" in msg
    assert "accept()" in msg and "rollback()" in msg


def test_begin_rearms_the_warning_and_other_sequences_warn_on_their_own(make_stager, caplog):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=2)
    verify_without_accept(st, 0)
    verify_without_accept(st, 1)
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        st.draft(0, 8)
        st.draft_many([0, 1], [8, 8])
        st.begin(0)
        verify_without_accept(st, 0)
        st.draft(0, 8)
    seqs = [r.args[0] for r in mismatch_records(caplog)]
    assert seqs == [0, 1, 0]


def test_rows_never_processed_name_the_gap(make_stager, caplog):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    st.process(0, np.arange(6), feature_rows(range(6), D))
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        assert st.draft(0, 9).skip == "missing_rows"
    (rec,) = mismatch_records(caplog)
    assert "rows 6..8 were never processed" in rec.getMessage()


def test_ordinary_skips_are_quiet(make_stager, caplog):
    st = make_stager(feature_dim=D, block_size=B, window=W, strict=True)
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        assert st.draft(0, 5).skip == "empty"
        st.process(0, np.arange(6), feature_rows(range(6), D))
        st.draft(0, 6)
        st.commit(0)
        assert st.draft(0, 6).skip == "no_context"
    assert mismatch_records(caplog) == []


def test_strict_raises_before_anything_changes(make_stager, caplog):
    st = make_stager(feature_dim=D, block_size=B, window=W, strict=True)
    verify_without_accept(st)
    before = (st.state(0), st.stats(0))
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        with pytest.raises(StateError, match=r"draft\(n_past=8\).*newest 10.*accept\(\)"):
            st.draft(0, 8)
    assert (st.state(0), st.stats(0)) == before
    assert mismatch_records(caplog) == []
    st.accept(0, 1)  # the fix the message names
    assert st.draft(0, 8).skip is None


def test_strict_draft_many_is_atomic(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W, max_seqs=2, strict=True)
    st.process(0, np.arange(6), feature_rows(range(6), D))
    verify_without_accept(st, 1)
    with pytest.raises(StateError, match="sequence 1"):
        st.draft_many([0, 1], [6, 8])
    assert st.state(0)["open_round"] is False  # sequence 0's round was not opened either
    assert st.draft_many([0], [6]).plans[0].skip is None


def test_positions_error_names_the_likely_cause(make_stager):
    st = make_stager(feature_dim=D, block_size=B, window=W)
    verify_without_accept(st)
    with pytest.raises(ValueError, match=r"must continue at 11, got 8 \(rows up to 10 are buffered: was accept\(\)"):
        st.process(0, np.arange(8, 10), feature_rows(range(8, 10), D))
    with pytest.raises(ValueError, match=r"got 13 \(rows 11..12 were never processed"):
        st.process(0, np.arange(13, 14), feature_rows(range(13, 14), D))


def lagging_setup(st):
    """Rows 0..108 all in the drafter's cache: the sequence's buffered end is 109."""
    st.process(0, np.arange(109), feature_rows(range(109), D))
    assert st.draft(0, 109).skip is None
    st.commit(0)


def test_a_lagging_n_past_is_out_of_protocol_too(make_stager, caplog):
    """draft(50) with rows up to 108 buffered was a silent no_context skip: it is
    a mismatch like any other (strict raises, otherwise one warning)."""
    strict = make_stager(feature_dim=D, block_size=B, window=200, strict=True)
    lagging_setup(strict)
    before = (strict.state(0), strict.stats(0))
    with pytest.raises(StateError, match=r"draft\(n_past=50\) does not match the buffered rows \(newest 108\): "
                                         r"rows 50..108 are still buffered"):
        strict.draft(0, 50)
    with pytest.raises(StateError, match="sequence 0"):
        strict.draft_many([0], [50])
    assert (strict.state(0), strict.stats(0)) == before
    lax = make_stager(feature_dim=D, block_size=B, window=200)
    lagging_setup(lax)
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        assert lax.draft(0, 50).skip == "no_context"
        assert lax.draft(0, 60).skip == "no_context"
    (rec,) = [r for r in caplog.records if r.name == "dspark_core"]
    assert rec.getMessage().startswith(
        "sequence 0: draft(n_past=50) skipped (no_context): the newest buffered row is 108; rows 50..108 are still"
    )


def test_legitimate_skips_stay_legitimate_under_strict(make_stager, caplog):
    st = make_stager(feature_dim=D, block_size=B, window=200, strict=True, max_seqs=2, max_failures=1)
    with caplog.at_level(logging.WARNING, logger="dspark_core"):
        assert st.draft(0, 7).skip == "empty"  # nothing processed: any n_past
        lagging_setup(st)
        assert st.draft(0, 109).skip == "no_context"  # at the end, nothing new
        st.rollback(0, 100)  # into the drafter's cache
        assert st.draft(0, 100).skip == "no_context"  # exactly the rolled-back n_past
        st.process(0, [100], feature_rows([100], D))
        assert st.draft(0, 101).skip is None
        st.fail(0)  # max_failures=1: disabled
        assert st.draft(0, 5).skip == "disabled"  # its server may stop feeding it rows
    assert mismatch_records(caplog) == []
    assert not [r for r in caplog.records if "draft(n_past" in r.getMessage()]
