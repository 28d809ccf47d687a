"""A fixed-capacity device step: one ``StepOutputs`` of capacity ``N`` serves any batch of at most
``N`` entries (a CUDA graph is captured once for ``N``), the entries past the batch and any
explicit padding entry (``PADDING_ID``, count -1) are ``STEP_NOT_IN_STEP`` and change nothing.
Random batches of changing size through one capacity, against exact-size steps of a second core
and the reference twin: every answer and every state equal."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.reference import ReferenceStager
from dspark_core.stager.device_step import PADDING_ID, STEP_NOT_IN_STEP, STEP_OK, StepOutputs

B, W, SEQS, CAP = 3, 14, 6, 8


def make(cls):
    st = cls(StagerConfig(feature_dim=16, block_size=B, window=W, max_seqs=SEQS, rows="external"))
    for q in range(SEQS):
        st.begin(q)
        st.process(q, np.arange(5 + 3 * q))
    st.to_device(list(range(SEQS)))
    return st


def nothing(out: StepOutputs, k: int) -> bool:
    """Entry k reads as "not stepped"."""
    return (out.status[k] == STEP_NOT_IN_STEP and out.skip[k] == -1 and out.n_rows[k] == 0
            and (out.row_slots[k] == -1).all() and (out.verify_slots[k] == -1).all()
            and (out.block_positions[k] == -1).all())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_capacity_serves_batches_of_changing_size(seed):
    rng = np.random.default_rng(seed)
    fixed, exact, twin = make(Stager), make(Stager), make(ReferenceStager)
    max_rows = fixed.step_layout[1]
    out = StepOutputs.empty(CAP, max_rows, B)
    twin_out = StepOutputs.empty(CAP, max_rows, B)
    for _ in range(60):
        n = int(rng.integers(0, SEQS + 1))
        seqs = rng.permutation(SEQS)[:n].tolist()
        counts = rng.integers(-1, B + 1, n).tolist()
        if n and rng.random() < 0.3:  # explicit padding entries inside the batch, repeated
            k = int(rng.integers(0, n + 1))
            seqs[k:k] = [PADDING_ID, PADDING_ID]
            counts[k:k] = [-1, -1]
        seqs, counts = seqs[:CAP], counts[:CAP]
        fixed.step_many(seqs, counts, out=out)
        twin.step_many(seqs, counts, out=twin_out)
        want = exact.step_many(seqs, counts)
        for name in StepOutputs.__dataclass_fields__:
            got, ref = getattr(out, name), getattr(twin_out, name)
            np.testing.assert_array_equal(got[:len(seqs)], getattr(want, name), err_msg=name)
            np.testing.assert_array_equal(got, ref, err_msg=name)
        assert all(nothing(out, k) for k in range(len(seqs), CAP))
        assert all(nothing(out, k) for k, q in enumerate(seqs) if q == PADDING_ID)
        assert (out.status[:len(seqs)] < 16).all()  # no entry of these batches is an error
    q = list(range(SEQS))
    fixed.to_host(q)
    exact.to_host(q)
    twin.to_host(q)
    for s in q:
        assert fixed.state(s) == exact.state(s) == twin.state(s)
        for st in (fixed, exact):
            if st.state(s)["reservation_open"]:
                st.confirm(s)
        assert fixed.snapshot(s) == exact.snapshot(s)
    assert fixed.totals().stats["rounds"] == exact.totals().stats["rounds"] > 0


def test_a_padding_entry_needs_count_minus_one_and_outputs_must_hold_the_batch():
    st = make(Stager)
    out = StepOutputs.empty(2, st.step_layout[1], B)
    st.step_many([PADDING_ID, 0], [-1, 0], out=out)
    assert out.status.tolist() == [STEP_NOT_IN_STEP, STEP_OK]
    st.step_many([PADDING_ID], [0], out=out)  # a count with the padding id: an unknown sequence
    assert out.status.tolist() == [16, STEP_NOT_IN_STEP]
    with pytest.raises(ValueError, match="unknown sequence -1"):
        st.check_step([PADDING_ID], out.status[:1])
    state, answers = st.step_state.copy(), [getattr(out, f).copy() for f in StepOutputs.__dataclass_fields__]
    with pytest.raises(ValueError, match="2 entries for a batch of 3"):
        st.step_many([0, 1, 2], [0, 0, 0], out=out)
    np.testing.assert_array_equal(st.step_state, state)  # refused before anything changed
    for f, before in zip(StepOutputs.__dataclass_fields__, answers):
        np.testing.assert_array_equal(getattr(out, f), before, err_msg=f)
