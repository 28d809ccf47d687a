"""``accept`` acts on the rows of the round just drafted, once (protocol.md 2.3): rows that arrive
after that round's accept (plain decodes after a skip, after a failed round, or after the round's
own accept) are never dropped by a later ``accept``, on the host, in both row modes, through the
batch calls and after a hand-back from the device step; core and twin alike."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.reference import ReferenceStager

D, B, W = 32, 4, 16
CLASSES = pytest.mark.parametrize("cls", [Stager, ReferenceStager], ids=["core", "reference"])
MODES = pytest.mark.parametrize("rows", ["held", "external"])


def stager(cls, rows: str):
    return cls(StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=2, rows=rows))


def feed(st, positions) -> None:
    pos = np.asarray(positions, np.int64)
    if st.config.rows == "held":
        rows = np.full((len(pos), D), 0.5, np.float32)
        rows[:, 0] = pos  # one massive channel: the position
        st.process(0, pos, rows)
    else:
        st.process(0, pos)


def round_verified(st, n_past: int, n: int) -> int:
    """draft, commit, the verify batch, accept(n): the new n_past."""
    plan = st.draft(0, n_past)
    assert plan.skip is None
    st.commit(0)
    feed(st, range(n_past, n_past + B + 1))
    st.accept(0, n)
    return n_past + n + 1


@CLASSES
@MODES
def test_plain_decodes_after_a_rounds_accept_are_never_dropped(cls, rows):
    """The reported case: a verify, accept(1), three plain decodes, accept(0): main dropped two
    processed rows, the next draft skipped with missing_rows and warned about rows 'never
    processed'."""
    st = stager(cls, rows)
    st.begin(0)
    feed(st, range(8))
    n_past = round_verified(st, 8, 1)
    feed(st, range(n_past, n_past + 3))  # three plain decodes
    st.accept(0, 0)
    st.accept_many([0], [0])
    assert st.state(0)["end"] == n_past + 3
    assert st.draft(0, n_past + 3).skip is None


@CLASSES
@MODES
def test_plain_decodes_after_a_failed_round_are_never_dropped(cls, rows):
    st = stager(cls, rows)
    st.begin(0)
    feed(st, range(8))
    st.draft(0, 8)
    st.fail(0, "decode")
    feed(st, [8])  # the failed round's server decodes `last` alone, with its accept
    st.accept(0, 0)
    feed(st, [9, 10, 11])  # three more plain decodes before the next accept
    st.accept(0, 0)
    assert st.state(0)["end"] == 12
    assert st.draft(0, 12).skip is None


@CLASSES
def test_a_skipped_round_keeps_its_rows_through_accepts(cls):
    st = stager(cls, "external")
    st.begin(0)
    feed(st, range(6))
    n_past = round_verified(st, 6, B)
    st.disable(0)
    assert st.draft(0, n_past).skip == "drafting_off"
    feed(st, range(n_past, n_past + 5))
    st.accept(0, 0)
    st.enable(0)
    assert st.state(0)["end"] == n_past + 5
    assert st.draft(0, n_past + 5).skip is None


@CLASSES
def test_after_a_failure_hand_back_plain_decodes_are_kept(cls):
    """A device-step server whose drafter failed brings the sequence back and decodes on the host."""
    st = stager(cls, "external")
    st.begin(0)
    feed(st, range(10))
    st.to_device([0])
    for a in (0, 1, 2):
        st.step_many([0], [a])
    st.to_host([0], ["decode"])
    st.cancel(0)  # no verify batch for a failed round: `last` is decoded alone on the host
    end = st.state(0)["end"]
    feed(st, [end])
    st.accept_many([0], [0])
    feed(st, [end + 1, end + 2, end + 3])
    st.accept_many([0], [0])
    assert st.state(0)["end"] == end + 4
    end += 1
    assert st.draft(0, end + 3).skip is None
