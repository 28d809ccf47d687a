"""Rows handed to ``process`` that lie in the Stager's own ring.

A ``draft(copy=False)`` view is a window on the ring itself. Handed back as
input (by a loop that feeds the drafter's rows to the target by mistake, or
by an adversary), its bytes may sit in the very slots the append trims and
converts into. The append must read them as they were when the call was
made, check everything before its first change, and leave the sequence as
the reference twin (which copies every input) leaves it: the same plans,
rows, state, stats and snapshot bytes, however the ring wraps and trims.

Before the fix, the held ring trimmed its dead head rows, then the
conversion refused the overlap: ``stats()`` counted a trim, ``state()`` and
snapshots claimed rows that were gone, and ``rollback`` + ``snapshot`` read
freed slots (a segfault). ``process_many`` committed its first sequences
before the refusal.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import massive_rows
from dspark_core import Stager, StagerConfig
from dspark_core.reference import ReferenceStager

D, B, W = 32, 4, 24
# How many rounds old the view handed back is, round after round: the ring
# holds W + TRIM_CHUNK + B + 1 rows, so some of them lie in slots a trim of
# the very call that takes them back frees and converts into.
STALE_ROUNDS = range(20, 300, 7)
ROUNDS = 400


def _same(core: Stager, ref: ReferenceStager, seq: int) -> None:
    assert core.state(seq) == ref.state(seq)
    ref_stats = ref.stats(seq)  # the twin holds no bytes: it counts rows, not bytes
    assert {k: v for k, v in core.stats(seq).items() if k in ref_stats} == ref_stats
    assert bytes(core.snapshot(seq)) == bytes(ref.snapshot(seq))


def _same_plan(a, b) -> None:
    assert (a.skip, a.start, a.pos_base, a.rebase, a.clear_cache) == (b.skip, b.start, b.pos_base, b.rebase, b.clear_cache)
    assert a.encoded_rows.tobytes() == b.encoded_rows.tobytes()


class _Pair:
    """A core Stager and the reference twin driven by the same rounds (accept = B)."""

    def __init__(self, storage: str, n_seqs: int = 1, seed: int = 0) -> None:
        cfg = StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=n_seqs, storage=storage)
        self.core, self.ref = Stager(cfg), ReferenceStager(cfg)
        self.rng = np.random.default_rng(seed)
        self.n_past = [40] * n_seqs
        self.views: list[list[np.ndarray]] = [[] for _ in range(n_seqs)]
        for seq in range(n_seqs):
            prompt = massive_rows(self.rng, 40, D)
            for st in (self.core, self.ref):
                st.process(seq, np.arange(40), prompt)

    def round(self, seq: int) -> None:
        """One round; the core drafts zero-copy and keeps the views of its rows (one list per round)."""
        n = self.n_past[seq]
        p = self.core.draft(seq, n, copy=False)
        _same_plan(p, self.ref.draft(seq, n))
        self.views[seq].append([np.asarray(r) for r in p.encoded_runs])
        for st in (self.core, self.ref):
            st.commit(seq)
        verify = massive_rows(self.rng, B + 1, D)
        for st in (self.core, self.ref):
            st.process(seq, np.arange(n, n + B + 1), verify)
            st.accept(seq, B)
        self.n_past[seq] = n + B + 1


@pytest.mark.parametrize("storage", ["f32", "bf16", "q8_0"])
def test_a_stale_view_handed_back_is_read_as_it_was(storage):
    """Every round past warm-up, the view of an old round goes back in: the call that trims the
    slots under it stages its bytes as they were, as the reference does with a copy."""
    pair = _Pair(storage)
    trimmed_under_view = 0
    for r in range(ROUNDS):
        pair.round(0)
        age = STALE_ROUNDS[r % len(STALE_ROUNDS)]
        if len(pair.views[0]) <= age:
            continue
        view = pair.views[0][-age - 1][0]
        n = pair.n_past[0]
        before = pair.core.stats(0)["trims"]
        copy = view.copy()
        pos = np.arange(n, n + len(view))
        pair.core.process_encoded(0, pos, view)
        pair.ref.process_encoded(0, pos, copy)
        trimmed_under_view += pair.core.stats(0)["trims"] > before
        pair.n_past[0] = n + len(view)
        _same(pair.core, pair.ref, 0)
    # The case of the defect was reached: a call whose input lay in the ring trimmed it.
    assert trimmed_under_view > 0


def test_a_stale_f32_view_through_process_then_rollback_and_snapshot():
    """f32 rows come back through ``process`` (a conversion, not a copy); after it a rollback and
    a snapshot read only rows the sequence holds (they segfaulted on the half-applied state)."""
    pair = _Pair("f32", seed=1)
    hits = 0
    for r in range(ROUNDS):
        pair.round(0)
        age = STALE_ROUNDS[r % len(STALE_ROUNDS)]
        if len(pair.views[0]) <= age:
            continue
        view = pair.views[0][-age - 1][0].view(np.float32).reshape(-1, D)
        n = pair.n_past[0]
        before = pair.core.stats(0)["trims"]
        copy = view.copy()
        pair.core.process(0, np.arange(n, n + len(view)), view)
        pair.ref.process(0, np.arange(n, n + len(view)), copy)
        hits += pair.core.stats(0)["trims"] > before
        pair.n_past[0] = n + len(view)
        _same(pair.core, pair.ref, 0)
        if r % 7 == 0:
            back = pair.n_past[0] - 2
            for st in (pair.core, pair.ref):
                st.rollback(0, back)
            pair.n_past[0] = back
            _same(pair.core, pair.ref, 0)
    assert hits > 0


def test_process_many_reads_a_view_of_one_of_its_rings_as_it_was():
    """One stale view of sequence 0's ring split between sequences 0 and 1 of a batch, while
    sequence 0's append trims and reuses those slots: every sequence as the reference leaves it
    (the batch once committed sequence 0, then refused on sequence 1)."""
    pair = _Pair("f32", n_seqs=2, seed=2)
    hits = 0
    for r in range(ROUNDS):
        pair.round(0)
        pair.round(1)
        age = STALE_ROUNDS[r % len(STALE_ROUNDS)]
        if len(pair.views[0]) <= age:
            continue
        view = pair.views[0][-age - 1][0].view(np.float32).reshape(-1, D)
        k = len(view)
        if k < 2:
            continue
        half = k // 2
        n0, n1 = pair.n_past
        pos = np.concatenate([np.arange(n0, n0 + half), np.arange(n1, n1 + k - half)])
        cu = np.array([0, half, k])
        copy = view.copy()
        before = pair.core.stats(0)["trims"]
        pair.core.process_many([0, 1], cu, pos, view)
        pair.ref.process_many([0, 1], cu, pos, copy)
        hits += pair.core.stats(0)["trims"] > before
        pair.n_past = [n0 + half, n1 + k - half]
        for seq in (0, 1):
            _same(pair.core, pair.ref, seq)
    assert hits > 0
