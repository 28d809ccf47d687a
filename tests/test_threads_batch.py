"""Threads on distinct sequences, batched and per-sequence calls (docs/design.md 2.9).

Each sequence has its own lock in the core and every call that moves rows releases the GIL,
so calls on different sequences run side by side: the state after
concurrent calls equals a serial replay, and one thread's calls complete
while another thread is inside a long call of its own (the GIL released).
No timing is measured: only what happened during what.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from conftest import at_once, massive_rows
from dspark_core import Stager, StagerConfig

D, B, W = 64, 4, 48


def fingerprint(st: Stager, seq: int):
    state = st.state(seq)
    snap = None if state["open_round"] or state["reservation_open"] else st.snapshot(seq)
    return state, st.stats(seq), st.live_slots(seq).tolist(), snap


def worker(st: Stager, seqs: list[int], rounds: int, seed: int) -> None:
    """A server's steps on its own sequences: batched process / draft (held: zero-copy every
    other round) / commit / fail / accept, a per-sequence fork inside the group, and a request
    that ends and restarts."""
    rng = np.random.default_rng(seed)
    external = st.config.rows == "external"
    ends = [0] * len(seqs)

    def process(lens):
        flat = np.concatenate([np.arange(e, e + n) for e, n in zip(ends, lens)])
        cu = np.concatenate([[0], np.cumsum(lens)])
        if external:
            st.process_many(seqs, cu, flat)
        else:
            st.process_many(seqs, cu, flat, massive_rows(rng, len(flat), D))
        for k, n in enumerate(lens):
            ends[k] += n

    process([7 + 5 * k for k in range(len(seqs))])
    for r in range(rounds):
        bp = st.draft_many(seqs, ends, copy=external or r % 2 == 0)  # held: zero-copy every other round
        views = [x.tobytes() for x in bp.encoded_runs] if bp.zero_copy else None
        opened = bp.seqs[bp.active]
        if r % 4 == 3:
            st.fail_many(opened, "decode")
        else:
            st.commit_many(opened)
        if views is not None:  # commit / fail leave the rows in the views, whatever other threads do
            assert [x.tobytes() for x in bp.encoded_runs] == views
        process([B + 1] * len(seqs))
        acc = [(r + k) % (B + 1) for k in range(len(seqs))]
        st.accept_many(seqs, acc)
        ends = [e - (B + 1) + a + 1 for e, a in zip(ends, acc)]
        if r % 9 == 4:
            st.fork(seqs[0], seqs[1])
            ends[1] = ends[0]
        if r % 13 == 6:
            st.end(seqs[-1])
            ends[-1] = 0
            process([0] * (len(seqs) - 1) + [3])


@pytest.mark.parametrize("rows", ["held", "external"])
def test_threads_on_disjoint_sequences_equal_a_serial_replay(rows):
    cfg = StagerConfig(D, B, W, max_seqs=6, storage="q8_0", rows=rows)
    groups = [[0, 1, 2], [5, 3, 4]]
    par, ser = Stager(cfg), Stager(cfg)
    done = at_once([(worker, (par, g, 40, k)) for k, g in enumerate(groups)])
    assert sorted(done) == [0, 1]  # both workers ran to the end (an assertion in one would stop it)
    for k, g in enumerate(groups):
        worker(ser, g, 40, k)
    for s in range(6):
        assert fingerprint(par, s) == fingerprint(ser, s), s
    assert par.moves_issued == ser.moves_issued


def test_calls_on_other_sequences_complete_during_a_long_call():
    """While one thread is inside long process_many calls on sequences 0..1, another
    thread's calls on sequence 2 complete: the long call released the GIL (held, no
    step of sequence 2 could run inside it). That it holds only its own sequences'
    locks is csrc/tests/test_batch.cpp's a_batch_holds_only_its_own_sequences."""
    cfg = StagerConfig(1024, B, W, max_seqs=3, storage="q8_0")
    st = Stager(cfg)
    n = 6000  # rows per long call: each is converted and checked whole (bounded ingest keeps W)
    rows = massive_rows(np.random.default_rng(0), 2 * n, 1024)
    st.process(2, np.arange(8), rows[:8])
    calls = [0]  # odd while a long call runs: 2k + 1 during the k-th
    finished = threading.Event()
    during = [0]

    seqs, cu = np.array([0, 1]), np.array([0, n, 2 * n])
    positions = [np.concatenate([np.arange(k * n, (k + 1) * n)] * 2) for k in range(10)]

    def long_calls():
        for k in range(10):
            calls[0] += 1
            st.process_many(seqs, cu, positions[k], rows)
            calls[0] += 1
        finished.set()

    def short_calls():
        end = 8
        while not finished.is_set():
            before = calls[0]
            st.draft(2, end)
            st.commit(2)
            st.process(2, np.arange(end, end + 1), rows[:1])
            st.accept(2, 0)
            end += 1
            if before % 2 and calls[0] == before:
                during[0] += 1  # a whole step of sequence 2 inside one call on sequences 0..1

    # No forced GIL switches: a thread runs only while another has released the
    # GIL itself, so a step of sequence 2 inside a long call proves that call released it.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        at_once([(long_calls, ()), (short_calls, ())])
    finally:
        sys.setswitchinterval(interval)
    assert during[0] > 0
    assert st.state(0)["end"] == 10 * n and st.state(2)["end"] > 8
