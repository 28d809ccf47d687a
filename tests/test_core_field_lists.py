"""The core's field lists reach Python whole: a field the core gains in one of its lists
(dspark/stager.hpp, dspark/step_math.hpp) fails here until the Python side carries it.

Each list is written once in the core (an X-macro); the binding reads the names from the
core (``_ext._row_format``), so these tests compare the Python types with the core's lists,
not with a copy of them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_core import Stager, StagerConfig
from dspark_core._ext import _row_format
from dspark_core.stager.device_step import StepOutputs
from dspark_core.stager.stage_plan import BATCH_ARRAYS, BatchPlan, StagePlan


def _stager() -> Stager:
    st = Stager(StagerConfig(feature_dim=32, block_size=3, window=13, max_seqs=3))
    x = np.random.default_rng(0).standard_normal((20, 32)).astype(np.float32)
    for q in (0, 1):
        st.process(q, np.arange(20 - 5 * q), x[: 20 - 5 * q])
    st.begin(2)  # empty: a skip
    return st


def test_a_stage_plan_carries_every_round_plan_field():
    st = _stager()
    for seq, n_past in ((0, 20), (1, 15), (2, 0)):
        plan = st.draft(seq, n_past)
        missing = [f for f in _row_format.ROUND_PLAN_FIELDS if not hasattr(plan, f)]
        assert not missing, f"StagePlan lacks the core's round plan fields {missing}"
        if plan.n_rows:
            assert plan.first_row == int(plan.positions[0]) + plan.pos_base
        assert plan.first_row + plan.n_rows == plan.start
        if plan.skip is None:
            st.commit(seq)
    assert isinstance(plan, StagePlan)


def test_a_batch_plan_names_the_cores_batch_rows():
    """BatchPlan's packed arrays are the core's rows, by the core's names, each an array of BatchPlan."""
    st = _stager()
    bp = st.draft_many([0, 2, 1], [20, 0, 15])
    assert isinstance(bp, BatchPlan)
    assert bp._meta.shape == (len(_row_format.BATCH_META_ROWS), 4)
    assert bp._flags.shape == (len(_row_format.BATCH_FLAG_ROWS), 3)
    assert set(_row_format.BATCH_META_ROWS) | set(_row_format.BATCH_FLAG_ROWS) <= set(BATCH_ARRAYS)
    for plan, i in zip(bp.plans, range(3)):
        assert plan.seq == bp.seqs[i] and plan.start == bp.start[i] and plan.round == bp.round[i]
        assert plan.pos_base == bp.pos_base[i] and plan.crop_from == bp.crop_from[i]
        assert (plan.skip is None) == (bp.skip_code[i] == 0) and plan.rebase == bp.rebase[i]


def test_step_outputs_are_the_cores_outputs():
    assert tuple(f.name for f in dataclasses.fields(StepOutputs)) == tuple(n for n, _, _ in _row_format.STEP_OUTPUTS)
    st = Stager(StagerConfig(feature_dim=32, block_size=3, window=13, max_seqs=2, rows="external"))
    out = StepOutputs.empty(2, st.step_config["max_rows"], 3)
    for name, nbytes, shape in _row_format.STEP_OUTPUTS:
        arr = getattr(out, name)
        dims = {"n": 2, "max_rows": st.step_config["max_rows"], "block": 3, "block+1": 4}
        assert arr.dtype.itemsize == nbytes and arr.shape == tuple(dims[d] for d in shape.split(",")), name
    assert tuple(st.step_config) == _row_format.STEP_CONFIG_FIELDS
