"""Wrapped rings away from sequence 0: slots and moves of the second run.

A ring wraps at most once, so the slots of a sequence's live rows are at most
two runs, the second starting at the sequence's first slot (``seq *
ring_rows``). Two mistakes there stay invisible on sequence 0 (whose first
slot is 0) or on a parent whose rows do not wrap:

* the second run losing the sequence's base: plans and ``live_slots`` then
  point into sequence 0's slots;
* ``fork`` from a parent whose live rows wrap sending both of its runs to the
  same child slots (the child's destination not advanced past the first run).

Each test builds that layout deterministically, in both row modes, and checks
the slots and moves against the reference twin's ring model and against
explicit expectations, and (external mode) the rows an owner's numpy mirror
table holds at the plan's slots against the held core's rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.stager.config import TRIM_CHUNK
from dspark_core.formats import quantize_rows
from dspark_core.reference import ReferenceStager

from conftest import massive_rows

D, B, W = 32, 4, 64
RING = W + TRIM_CHUNK + B + 1  # 581 slots per sequence
# 600 positions fed 64 at a time: live rows 536..599 sit in ring slots 536..580, then 0..18.
FED, CHUNK = 600, 64
FIRST_RUN = RING - 536  # 45 rows before the ring's end
SECOND_RUN = FED - 536 - FIRST_RUN  # 19 rows from the ring's first slot


def config(storage: str, rows: str) -> StagerConfig:
    return StagerConfig(D, B, W, max_seqs=4, storage=storage, rows=rows, nonfinite="clamp")


def encode(cfg: StagerConfig, rows: np.ndarray) -> np.ndarray:
    enc = quantize_rows(rows, cfg.storage, nonfinite=cfg.nonfinite)
    return np.ascontiguousarray(enc).view(np.uint8).reshape(len(rows), cfg.row_bytes)


class Trio:
    """The held core (oracle of the rows), the external core with its owner's mirror
    table, and the reference in the same row mode as ``mode``'s core."""

    def __init__(self, storage: str) -> None:
        self.cfg = config(storage, "held")
        self.held = Stager(self.cfg)
        self.ext = Stager(config(storage, "external"))
        self.refs = {"held": ReferenceStager(self.cfg), "external": ReferenceStager(config(storage, "external"))}
        self.mirror = np.full((4 * RING, self.cfg.row_bytes), 0xA5, np.uint8)
        self.rng = np.random.default_rng(3)

    def feed(self, seq: int, lo: int, hi: int, chunk: int = CHUNK) -> None:
        rows = massive_rows(self.rng, hi - lo, D)
        for a in range(lo, hi, chunk):
            b = min(hi, a + chunk)
            pos = np.arange(a, b, dtype=np.int64)
            self.held.process(seq, pos, rows[a - lo:b - lo])
            self.refs["held"].process(seq, pos, rows[a - lo:b - lo])
            slots = self.ext.process(seq, pos)
            np.testing.assert_array_equal(slots, self.refs["external"].process(seq, pos))
            keep = slots >= 0
            self.mirror[slots[keep]] = encode(self.cfg, rows[a - lo:b - lo][keep])

    def apply(self, moves: np.ndarray) -> None:
        for src, dst, n in np.asarray(moves).tolist():
            assert src + n <= dst or dst + n <= src, "a move overlaps itself"
            self.mirror[dst:dst + n] = self.mirror[src:src + n].copy()

    def check_round(self, seq: int) -> np.ndarray:
        """Draft at the end on all four; the same slots everywhere, the mirror's rows the held core's."""
        end = self.held.state(seq)["end"]
        plans = [self.held.draft(seq, end), self.ext.draft(seq, end),
                 self.refs["held"].draft(seq, end), self.refs["external"].draft(seq, end)]
        assert plans[0].skip is None
        for p in plans[1:]:
            np.testing.assert_array_equal(p.slots, plans[0].slots)
        assert self.mirror[plans[1].slots].tobytes() == plans[0].encoded_rows.tobytes()
        for st in (self.held, self.ext, *self.refs.values()):
            st.commit(seq)
        return np.asarray(plans[0].slots)


@pytest.mark.parametrize("storage", ["f32", "q8_0"])
@pytest.mark.parametrize("seq", [1, 3])
def test_wrapped_ring_slots_keep_the_sequence_base(storage, seq):
    t = Trio(storage)
    t.feed(seq, 0, FED)
    base = seq * RING
    want = np.concatenate([base + np.arange(536, RING), base + np.arange(SECOND_RUN)])
    for st in (t.held, t.ext, *t.refs.values()):
        np.testing.assert_array_equal(st.live_slots(seq), want)
    # The first round restages the newest K = W / 2 rows, 568..599: across the ring's end.
    slots = t.check_round(seq)
    assert slots[0] > slots[-1], "the round's slots wrap: two runs"
    assert (slots >= base).all() and (slots < base + RING).all()
    for st in (t.held, t.ext, *t.refs.values()):
        st.rollback(seq, FED - 10)  # into the drafter's cache: the next round restages
    t.feed(seq, FED - 10, FED - 10 + 2)
    slots = t.check_round(seq)
    assert slots[0] > slots[-1], "the round's slots wrap: two runs"
    assert (slots >= base).all() and (slots < base + RING).all()
    # Another sequence (0) running meanwhile never shares a slot with it.
    t.feed(0, 0, 40)
    assert not set(t.check_round(0).tolist()) & set(want.tolist())


@pytest.mark.parametrize("storage", ["f32", "q4_0"])
@pytest.mark.parametrize(("parent", "child"), [(1, 2), (2, 0), (0, 3)])
def test_fork_of_a_wrapped_parent_sends_each_run_to_its_own_child_slots(storage, parent, child):
    t = Trio(storage)
    t.feed(child, 0, 30)  # the child holds rows of its own, replaced by the fork
    t.feed(parent, 0, FED)
    moves = {name: np.asarray(st.fork(parent, child)) for name, st in
             (("held", t.held), ("ext", t.ext), ("ref-held", t.refs["held"]), ("ref-ext", t.refs["external"]))}
    want = [[parent * RING + 536, child * RING, FIRST_RUN],
            [parent * RING, child * RING + FIRST_RUN, SECOND_RUN]]
    for name, m in moves.items():
        np.testing.assert_array_equal(m, want, err_msg=name)
    t.apply(moves["ext"])
    np.testing.assert_array_equal(t.ext.live_slots(child), child * RING + np.arange(FED - 536))
    # The child's first round restages from its own slots: the parent's rows, in order.
    t.check_round(child)
    # The parent is unchanged by the fork and keeps working.
    t.check_round(parent)
