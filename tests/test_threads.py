"""Concurrent calls on one Stager from several Python threads are safe and exact."""

from __future__ import annotations

import threading

import numpy as np

from dspark_core import Stager, StagerConfig
from dspark_core.reference import ReferenceStager

D, B, W, SEQS = 256, 4, 40, 6


def drive(st, seq, rounds, out):
    rng = np.random.default_rng(seq)
    st.begin(seq)
    prompt = rng.standard_normal((30 + seq, D)).astype(np.float32)
    st.process(seq, np.arange(len(prompt)), prompt)
    n_past = len(prompt)
    plans = []
    for r in range(rounds):
        plan = st.draft(seq, n_past)
        plans.append((plan.pos_base, plan.positions.copy(), plan.rows.copy()))
        if r % 7 == 3:
            st.fail(seq, "decode")
        else:
            st.commit(seq)
        verify = rng.standard_normal((B + 1, D)).astype(np.float32)
        st.process(seq, np.arange(n_past, n_past + B + 1), verify)
        n_acc = int(rng.integers(0, B + 1))
        st.accept(seq, n_acc)
        n_past += n_acc + 1
    out[seq] = (plans, st.snapshot(seq))


def test_threads_on_separate_sequences_match_a_sequential_reference():
    cfg = StagerConfig(D, B, W, max_seqs=SEQS, storage="q8_0")
    st = Stager(cfg)
    got: dict = {}
    stop = threading.Event()

    def observer():
        while not stop.is_set():
            for s in range(SEQS):
                st.stats(s)
                st.state(s)

    threads = [threading.Thread(target=drive, args=(st, s, 120, got)) for s in range(SEQS)]
    obs = threading.Thread(target=observer)
    obs.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    obs.join()

    ref = ReferenceStager(cfg)
    want: dict = {}
    for s in range(SEQS):
        drive(ref, s, 120, want)
    for s in range(SEQS):
        (gp, gsnap), (wp, wsnap) = got[s], want[s]
        assert gsnap == wsnap
        for (b1, p1, r1), (b2, p2, r2) in zip(gp, wp):
            assert b1 == b2
            np.testing.assert_array_equal(p1, p2)
            assert r1.tobytes() == r2.tobytes()


def test_threads_racing_on_one_sequence_never_corrupt_it():
    """Two threads race process() on one sequence: one wins each position, the other gets ValueError."""
    st = Stager(StagerConfig(D, B, W))
    rows = np.ones((1, D), np.float32)
    errors = []

    def push():
        for _ in range(2000):
            end = st.state(0)["end"]
            try:
                st.process(0, [end], rows * end)
            except ValueError as exc:  # lost the race: positions must continue
                errors.append(str(exc))

    ts = [threading.Thread(target=push) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    end = st.state(0)["end"]
    assert end + len(errors) == 4000
    assert all("continue at" in e for e in errors)
    plan = st.draft(0, end)
    np.testing.assert_array_equal(plan.rows[:, 0], np.arange(end - plan.n_rows, end, dtype=np.float32))
