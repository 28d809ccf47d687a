"""What a careless or hostile server hands the device step can neither crash the process, nor
strand a sequence, nor change a row's id (issue: the device step's safety).

Each test here is one of the defects an adversarial pass found, fixed: a damaged step state
(the state is a writable view a GPU server copies back), output arrays swapped between the
check and the use, a long reservation's cancel on a chain Stager, a cancel after a hand-over
right after ``reserve``, ``end`` of a handed-over sequence, and the smaller conversions. The
core is held to the reference twin wherever the twin models the call (a damaged step state
exists only in the core: the twin keeps no step state array).
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.errors import StateError
from dspark_core.reference import ReferenceStager
from dspark_core.stager.device_step import (
    STEP_DAMAGED, STEP_NOT_ON_DEVICE, STEP_OK, STEP_STATE_FIELDS, StepOutputs,
)

B, W = 2, 9
FIELD = {name: k for k, name in enumerate(STEP_STATE_FIELDS)}


def config(kind: str = "block", n: int = 3) -> StagerConfig:
    return StagerConfig(feature_dim=32, block_size=B, window=W, max_seqs=n, rows="external", kind=kind)


def handed(n_rows: int = 6, steps: int = 2) -> Stager:
    """Sequence 0 handed over with a prompt and a few steps; sequence 1 on the host."""
    st = Stager(config())
    for q in (0, 1):
        st.begin(q)
        st.process(q, np.arange(n_rows))
    st.to_device([0])
    for _ in range(steps):
        assert st.step_many([0], [1]).status.tolist() == [STEP_OK]
    return st


# -- 1. a damaged step state -------------------------------------------------------------------

def _overflow(s: np.ndarray) -> None:  # the reported one: 200,000 rows claimed for a plan max_rows wide
    s[FIELD["end"], 0] = s[FIELD["count"], 0] = 200_000
    s[FIELD["pos_base"], 0] = 200_000 - 1


def _set(name: str, value: int):
    def damage(s: np.ndarray) -> None:
        s[FIELD[name], 0] = value
    return damage


def _histogram(s: np.ndarray) -> None:
    s[len(STEP_STATE_FIELDS), 0] = -5


DAMAGE = {
    "overflow": _overflow,
    "live_flag": _set("live", 7),
    "tentative": _set("tentative", B + 5),
    "head_slot": _set("head_slot", 10**6),
    "cap": _set("cap", 3),
    "cache_after_end": _set("n_cache", 10**9),
    "negative_counter": _set("rounds", -1),
    "huge_counter": _set("staged_rows", 2**62 + 1),
    "unknown_fault": _set("fault", 12345),
    "reserved_code": _set("reserved", 9),
    "drafting_flag": _set("drafting_off", 2),
    "negative_drafting_skips": _set("skips_drafting_off", -3),
    "histogram": _histogram,
}


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_a_damaged_step_state_is_a_sticky_status_never_a_write_out_of_bounds(name):
    st = handed()
    DAMAGE[name](st.step_state)
    out = StepOutputs.empty(1, *st.step_layout[1:], B)
    st.step_many([0], [0], out=out)
    assert out.status.tolist() == [STEP_DAMAGED]
    assert out.n_rows.tolist() == [0] and (out.row_slots == -1).all() and (out.verify_slots == -1).all()
    assert st.step_many([0], [1]).status.tolist() == [STEP_DAMAGED]  # sticky
    with pytest.raises(ValueError, match=r"step_many: seqs\[0\] \(sequence 0\): the step state is damaged"):
        st.check_step([0], out.status)
    if name == "unknown_fault":  # the step's own record replaced the only bad field: the state is whole
        with pytest.raises(ValueError, match=r"sequence 0 is back on the host, but one of its device steps failed: "
                                             r"the step state is damaged \(the fault code is unknown\)"):
            st.to_host([0])
        assert not st.on_device(0)
        return
    with pytest.raises(ValueError, match=r"to_host: seqs\[0\] \(sequence 0\): the step state is damaged"):
        st.to_host([0])
    assert st.on_device(0)


def test_to_host_refuses_a_state_whose_next_round_is_not_buffered():
    """n_cache below the ring's head with no rebase due: the host's next draft would find its
    rows missing ("dspark internal error"), so to_host refuses it and brings nothing back."""
    st = handed(n_rows=12, steps=0)
    s = st.step_state
    before = s.copy()
    end = int(s[FIELD["end"], 0])
    s[FIELD["head_pos"], 0] = s[FIELD["horizon"], 0] = end - 2  # a consistent ring of the last 2 rows
    s[FIELD["count"], 0] = 2
    s[FIELD["n_cache"], 0] = s[FIELD["pos_base"], 0] = end - 4  # no rebase due, rows from end - 4 wanted
    s[FIELD["restage_owed"], 0] = 0
    with pytest.raises(ValueError, match=r"damaged \(the rows of its next round are not buffered\)"):
        st.to_host([0])
    assert st.on_device(0)
    s[:] = before  # a state a step wrote comes back as it is
    st.to_host([0])
    st.draft(0, st.state(0)["end"])


def test_a_damaged_sequence_is_never_stranded_end_frees_it():
    st = handed()
    totals = st.totals().stats["rounds"]
    _overflow(st.step_state)
    assert st.step_many([0], [0]).status.tolist() == [STEP_DAMAGED]
    st.end(0)
    assert not st.on_device(0)
    assert st.step_many([0], [0]).status.tolist() == [STEP_NOT_ON_DEVICE]
    assert st.totals().stats["rounds"] >= totals  # counters never go back
    st.begin(0)
    st.process(0, np.arange(4))
    st.to_device([0])  # the slot serves again
    assert st.step_many([0], [0]).status.tolist() == [STEP_OK]
    st.to_host([0])


@pytest.mark.parametrize("column", ["staged_rows", "rounds", "histogram"])
def test_a_copy_back_that_lowers_a_counter_never_takes_the_metrics_back(column):
    """A state a step could have written but for a counter below what the host saw last (a
    stale copy back: the device keeps no history, so only the host can tell): the metrics stay
    at the last whole state, to_host refuses it (nothing brought back) and end frees it with
    counters that never went back. (The fuzzer found totals going back through such a copy.)"""
    st = handed(n_rows=3 * W, steps=3)
    before = st.totals()
    s = st.step_state
    at = len(STEP_STATE_FIELDS) + 1 if column == "histogram" else FIELD[column]  # bucket 1: one accepted draft
    assert s[at, 0] > 0
    s[at, 0] -= 1
    after = st.totals()
    assert all(after.stats[k] >= before.stats[k] for k in ("rounds", "staged_rows", "verified_rounds", "commits"))
    assert (after.accepted >= before.accepted).all()
    with pytest.raises(ValueError, match=r"the step state is damaged \(a counter is below what its steps had made\)"):
        st.to_host([0])
    assert st.on_device(0)
    st.end(0)
    assert not st.on_device(0)
    ended = st.totals()
    assert all(ended.stats[k] >= before.stats[k] for k in ("rounds", "staged_rows", "verified_rounds", "commits"))
    assert (ended.accepted >= before.accepted).all()


# -- 2. output arrays pinned for the call ---------------------------------------------------------

class _FreshArrays(StepOutputs):
    """A hostile StepOutputs: every read of a field makes a new array (the old code checked one
    and wrote through another, already freed), and counts the reads."""

    reads: dict[str, int]

    def __init__(self, template: StepOutputs) -> None:
        object.__setattr__(self, "_template", template)
        object.__setattr__(self, "reads", {})

    def __getattribute__(self, name: str):
        if name in StepOutputs.__dataclass_fields__:
            reads = object.__getattribute__(self, "reads")
            reads[name] = reads.get(name, 0) + 1
            arr = getattr(object.__getattribute__(self, "_template"), name)
            return None if arr is None else arr.copy()
        return object.__getattribute__(self, name)


def test_step_outputs_are_read_once_and_held_for_the_call():
    st = handed()
    out = _FreshArrays(StepOutputs.empty(1, *st.step_layout[1:], B))
    st.step_many([0], [1], out=out)
    assert set(out.reads) == set(StepOutputs.__dataclass_fields__)
    assert all(v == 1 for v in out.reads.values()), out.reads


def test_misaligned_outputs_and_token_tables_are_refused():
    st = handed()
    out = StepOutputs.empty(1, *st.step_layout[1:], B)
    raw = np.zeros(out.start.nbytes + 1, np.uint8)
    out.start = np.frombuffer(raw.data, np.int64, count=1, offset=1)  # writable, misaligned
    assert not out.start.flags.aligned
    with pytest.raises(ValueError, match="start must be C-contiguous, aligned and writable"):
        st.step_many([0], [1], out=out)
    chain = Stager(config("chain"))
    chain.begin(0)
    chain.process(0, np.arange(5), tokens=np.arange(5))
    n = chain.new_token_table().shape[0]
    raw = np.zeros(4 * n + 2, np.uint8)
    table = np.frombuffer(raw.data, np.int32, count=n, offset=2)
    with pytest.raises(ValueError, match="slot token table must be a 1-D C-contiguous, aligned array"):
        chain.to_device([0], tokens=table)
    assert not chain.on_device(0)


# -- 3. a long reservation's cancel restores every id ---------------------------------------------

@pytest.mark.parametrize("hand_over", [False, True], ids=["host", "hand-over"])
@pytest.mark.parametrize("n", [3, W + 1, 10 * W])
def test_cancel_of_a_reservation_of_any_length_restores_the_ids(n, hand_over):
    """A reservation longer than the window (an ordinary long prefill chunk) reuses the slots of
    rows cancel brings back: their ids come back with them, as the twin's do."""
    seen = []
    for cls in (Stager, ReferenceStager):
        st = cls(config("chain"))
        st.begin(0)
        st.process(0, np.arange(W + 1), tokens=np.arange(100, 100 + W + 1))
        st.reserve(0, np.arange(W + 1, W + 1 + n), tokens=np.arange(1000, 1000 + n))
        if hand_over:
            table = st.new_token_table()
            st.to_device([0], tokens=table)
            st.to_host([0], tokens=table)
        st.cancel(0)
        s = st.state(0)
        seen.append((st.snapshot(0), st.tokens(0, s["horizon"], s["end"]).tolist(), st.live_slots(0).tolist(),
                     st.draft(0, W + 1).tokens.tolist()))
    assert seen[0] == seen[1]
    assert seen[0][1] == list(range(100, 100 + W + 1))[-len(seen[0][1]):]


# -- 4. a cancel after a hand-over puts back the sequence before reserve ---------------------------

def test_cancel_after_a_hand_over_right_after_reserve_restores_a_fresh_sequence():
    seen = []
    for cls in (Stager, ReferenceStager):
        st = cls(config())
        st.begin(0)
        st.reserve(0, np.arange(100, 103))
        st.to_device([0])
        st.to_host([0])
        st.cancel(0)
        s = st.state(0)
        seen.append((s["started"], s["n_cache"], s["pos_base"], st.totals().started))
        st.process(0, np.arange(4))  # the slot serves: a prompt from 0
        st.to_device([0])
        st.to_host([0])
    assert seen[0] == seen[1] == (False, 0, 0, 0)


def test_a_hand_over_of_the_hosts_reservation_that_a_step_confirmed_comes_back_stepped():
    """The other side of the rule above: once a step has run, the reservation is the step's."""
    seen = []
    for cls in (Stager, ReferenceStager):
        st = cls(config())
        st.begin(0)
        st.process(0, np.arange(5))
        st.reserve(0, np.arange(5, 8))
        st.to_device([0])
        st.step_many([0], [1])
        st.to_host([0])
        seen.append((st.state(0), st.stats(0)["rounds"]))
        st.cancel(0)  # the step's own verify rows
        seen.append((st.state(0),))
    assert seen[0] == seen[2] and seen[1] == seen[3]


# -- end of a handed-over sequence (design.md 2.5: end takes any state) ---------------------------

@pytest.mark.parametrize("batch", [False, True], ids=["end", "end_many"])
def test_end_of_a_handed_over_sequence_drops_it_from_the_step_as_the_twin_does(batch):
    totals = []
    for cls in (Stager, ReferenceStager):
        st = cls(config())
        for q in (0, 1):
            st.begin(q)
            st.process(q, np.arange(12))
        st.to_device([0, 1])
        for a in (1, 2, 0):
            st.step_many([0, 1], [a, 1])
        if batch:
            st.end_many([1, 0])
        else:
            st.end(0)
            st.end(1)
        assert not st.on_device(0) and not st.on_device(1)
        assert st.step_many([0], [0]).status.tolist() == [STEP_NOT_ON_DEVICE]
        t = st.totals()
        totals.append((t.stats, t.accepted.tolist(), t.started))
    common = totals[0][0].keys() & totals[1][0].keys()
    assert {k: totals[0][0][k] for k in common} == {k: totals[1][0][k] for k in common}
    assert totals[0][1:] == totals[1][1:]
    assert totals[0][0]["rounds"] == 2 * 3 and totals[0][0]["commits"] == 2 * 2  # the open round: dropped


# -- the smaller ones --------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [Stager, ReferenceStager], ids=["core", "reference"])
@pytest.mark.parametrize("status", [2, -1, 15, 99])
def test_check_step_names_a_word_that_is_no_status(cls, status):
    st = cls(config())
    with pytest.raises(ValueError, match=f"status {status} is not a status word of the device step"):
        st.check_step([0], [status])


@pytest.mark.parametrize("cls", [Stager, ReferenceStager], ids=["core", "reference"])
@pytest.mark.parametrize("outcome", [2**31, -(2**40), 7])
def test_to_host_outcome_outside_int32_is_a_value_error(cls, outcome):
    st = cls(config())
    st.begin(0)
    st.process(0, np.arange(6))
    st.to_device([0])
    st.step_many([0], [0])
    with pytest.raises(ValueError, match=r"to_host: seqs\[0\] \(sequence 0\): outcome must be -1"):
        st.to_host([0], [outcome])
    assert st.on_device(0)


def test_step_state_fields_name_the_columns():
    st = handed()
    s = st.step_state
    state = st.step_config
    assert s.shape == (len(STEP_STATE_FIELDS) + state["block"] + 1, state["max_seqs"])
    assert s[FIELD["live"]].tolist() == [1, 0, 0]
    st.to_host([0])
    assert s[FIELD["live"], 0] == 0 and s[FIELD["end"], 0] == st.state(0)["end"]


def test_a_handed_over_sequence_is_refused_by_no_call_that_frees_it():
    """No sequence can end up refused by every call: on the device, end frees it."""
    st = handed()
    with pytest.raises(StateError):
        st.begin(0)
    st.end(0)
    st.begin(0)
