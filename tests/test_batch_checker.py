"""``InvariantChecker`` over the batched calls: a server step of many sequences, checked.

The checker models each batch as its per-sequence calls (the drafter cache after
``commit_many``, the rows after ``process_many``, a new sequence after ``end_many``), in
both row modes (external: it owns the rows, as for ``process``), and catches a core whose
batch leaves a round open.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import massive_rows
from dspark_core import Stager, StagerConfig
from dspark_core.testing import InvariantChecker, InvariantViolation

D, B, W = 32, 4, 40


def server_steps(st, rng, steps=30):
    """Sequences joining and finishing at different times, failures, accepts of every size."""
    n = st.config.max_seqs
    ends = [0] * n
    live: list[int] = []
    for step in range(steps):
        if step % 5 == 0 and len(live) < n:  # a request joins
            live.append(next(s for s in range(n) if s not in live))
        join = [s for s in live if ends[s] == 0]
        feed = [s for s in live if s not in join]
        if join:
            lens = [3 + 7 * (s % 3) for s in join]
            flat = np.concatenate([np.arange(k) for k in lens])
            st.process_many(join, np.concatenate([[0], np.cumsum(lens)]), flat, massive_rows(rng, len(flat), D))
            for s, k in zip(join, lens):
                ends[s] = k
        seqs = np.array(sorted(join + feed), np.int64)
        bp = st.draft_many(seqs, [ends[s] for s in seqs])
        opened = bp.seqs[bp.active]
        ok = np.array([(step + int(s)) % 4 != 3 for s in opened], bool)
        st.commit_many(opened[ok])
        st.fail_many(opened[~ok], ["crop" if int(s) % 2 else "decode" for s in opened[~ok]])
        lens = [B + 1] * len(seqs)
        flat = np.concatenate([np.arange(ends[s], ends[s] + B + 1) for s in seqs])
        st.process_many(seqs, np.concatenate([[0], np.cumsum(lens)]), flat, massive_rows(rng, len(flat), D))
        acc = [(step + int(s)) % (B + 1) for s in seqs]
        st.accept_many(seqs, acc)
        for s, a in zip(seqs.tolist(), acc):
            ends[s] += a + 1
        if step % 7 == 6 and live:  # a request finishes
            done = live.pop(0)
            st.end_many([done])
            ends[done] = 0


@pytest.mark.parametrize("rows", ["held", "external"])
def test_checker_follows_batched_steps(rows):
    checker = InvariantChecker(Stager(StagerConfig(D, B, W, max_seqs=4, storage="q8_0", rows=rows)))
    server_steps(checker, np.random.default_rng(1))
    assert checker.calls > 100


class CommitManyForgetsOne:
    """A Stager whose commit_many leaves the last sequence's round open."""

    def __init__(self, config):
        self._st = Stager(config)
        self.config = config

    def __getattr__(self, name):
        return getattr(self._st, name)

    def commit_many(self, seqs):
        seqs = list(seqs)
        self._st.commit_many(seqs[:-1])


def test_checker_catches_a_batch_that_leaves_a_round_open():
    cfg = StagerConfig(D, B, W, max_seqs=4)
    checker = InvariantChecker(CommitManyForgetsOne(cfg))
    with pytest.raises(InvariantViolation, match="open"):
        server_steps(checker, np.random.default_rng(2))
