"""Handing a Stager's rows around: encoded rows from any buffer, and a whole
Stager pickled / deep-copied into another process (config plus every
sequence's snapshot). Both the core and the reference twin."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from dspark_core import StagerConfig, StateError
from dspark_core import formats

D, B, W = 64, 4, 24


def activations(first: int, n: int, dim: int = D) -> np.ndarray:
    """Rows that look like real hidden states and identify their position:
    N(0, 1) noise from a per-position seed, a massive channel near 5e3 and
    a huge-norm BOS row (position 0)."""
    out = np.empty((n, dim), np.float32)
    for i in range(n):
        p = first + i
        r = np.random.default_rng(p).standard_normal(dim).astype(np.float32)
        r[7] = 5e3 + p
        if p == 0:
            r *= 8.0
        out[i] = r
    return out


# -- process_encoded: any buffer ------------------------------------------------


@pytest.mark.parametrize("storage", formats.STORAGES)
@pytest.mark.parametrize("kind", ["ndarray2d", "ndarray1d", "bytes", "bytearray", "memoryview", "memoryview2d"])
def test_process_encoded_accepts_every_buffer(make_stager, storage: str, kind: str) -> None:
    cfg = StagerConfig(D, B, W, storage=storage, stage_dtype="float32")
    st = make_stager(cfg)
    x = activations(0, 6)
    enc = formats.quantize_rows(x, storage).view(np.uint8).reshape(6, cfg.row_bytes)
    data = {
        "ndarray2d": enc,
        "ndarray1d": enc.reshape(-1),
        "bytes": enc.tobytes(),
        "bytearray": bytearray(enc.tobytes()),
        "memoryview": memoryview(enc.tobytes()),
        "memoryview2d": memoryview(enc),
    }[kind]
    st.process_encoded(0, np.arange(6), data)
    plan = st.draft(0, 6)
    assert plan.encoded_rows.tobytes() == enc.tobytes()
    np.testing.assert_array_equal(plan.rows, formats.dequantize_rows(enc, storage, D))


@pytest.mark.parametrize(
    "data, exc",
    [(b"\0" * 7, ValueError), (bytearray(3), ValueError), ("text", TypeError), (None, TypeError),
     (np.zeros(2 * D * 4, np.int8), TypeError)],
)
def test_process_encoded_rejects_wrong_buffers(make_stager, data, exc) -> None:
    st = make_stager(StagerConfig(D, B, W))
    with pytest.raises(exc):
        st.process_encoded(0, np.arange(2), data)
    assert st.state(0)["end"] == 0


# -- pickle / deepcopy -------------------------------------------------------------


def drive(st, seqs, rounds: int, n_past: dict[int, int], seed: int):
    """Server-like rounds on every sequence; returns every plan's bytes and fields."""
    rng = np.random.default_rng(seed)
    log = []
    for _ in range(rounds):
        for s in seqs:
            plan = st.draft(s, n_past[s])
            log.append((s, plan.skip, plan.rebase, plan.pos_base, plan.crop_from, plan.positions.tolist(),
                        plan.encoded_rows.tobytes()))
            if plan.skip is None:
                st.commit(s)
            st.process(s, np.arange(n_past[s], n_past[s] + B + 1), activations(n_past[s], B + 1))
            acc = int(rng.integers(0, B + 1))
            st.accept(s, acc)
            n_past[s] = st.state(s)["end"]  # n_past + acc + 1 after a round; all B + 1 rows after a skip
    return log


def filled(make_stager, storage: str = "q8_0"):
    cfg = StagerConfig(D, B, W, max_seqs=3, storage=storage)
    st = make_stager(cfg)
    st.process(0, np.arange(100), activations(0, 100))
    st.process(1, np.arange(40), activations(0, 40))
    n_past = {0: 100, 1: 40}
    drive(st, [0, 1], 7, n_past, seed=1)
    if st.draft(0, n_past[0]).skip is None:
        st.fail(0, "decode")  # sequence 0 owes a restage and counts a failure
    return cfg, st, n_past


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_copied_stager_continues_as_one_restored_from_snapshots(make_stager, how: str) -> None:
    cfg, st, n_past = filled(make_stager)
    snaps = [st.snapshot(s) for s in range(cfg.max_seqs)]
    twin = pickle.loads(pickle.dumps(st)) if how == "pickle" else copy.deepcopy(st)
    assert type(twin) is type(st) and twin.config == cfg
    # What a worker gets: exactly the state a restore of each snapshot gives.
    restored = make_stager(cfg)
    for s in range(cfg.max_seqs):
        restored.restore(s, snaps[s])
        assert twin.snapshot(s) == restored.snapshot(s)  # the original's, with restage_owed for started ones
        assert twin.state(s) == restored.state(s)
    # The copy is independent of the original ...
    st.begin(0)
    assert twin.state(0)["end"] == n_past[0]
    # ... and continues with the same plans and rows as the restored Stager.
    log_twin = drive(twin, [0, 1, 2], 12, {**n_past, 2: 0}, seed=5)
    log_rest = drive(restored, [0, 1, 2], 12, {**n_past, 2: 0}, seed=5)
    assert log_twin == log_rest
    # Its first round on sequence 1 rebases onto rows that are the original activations.
    first = next(e for e in log_twin if e[0] == 1)
    assert first[1] is None and first[2]  # staged, rebased: the drafter cache did not travel
    k = len(first[5])
    want = formats.quantize_rows(activations(n_past[1] - k, k), cfg.storage)
    assert first[6] == want.tobytes()


def test_pickle_with_an_open_round_raises_state_error(make_stager) -> None:
    cfg, st, n_past = filled(make_stager)
    plan = st.draft(1, n_past[1])
    assert plan.skip is None
    with pytest.raises(StateError, match="sequence 1 has an open round"):
        pickle.dumps(st)
    with pytest.raises(StateError, match="sequence 1 has an open round"):
        copy.deepcopy(st)
    st.commit(1)
    assert pickle.loads(pickle.dumps(st)).state(1) == {**st.state(1), "restage_owed": True}


def test_pickle_round_trips_every_snapshot_and_restarts_counters(make_stager) -> None:
    cfg, st, _ = filled(make_stager, storage="f16")
    twin = pickle.loads(pickle.dumps(st, protocol=pickle.HIGHEST_PROTOCOL))
    for s in range(cfg.max_seqs):
        state = st.state(s)
        assert twin.state(s) == {**state, "restage_owed": state["started"]}
        assert twin.buffered_positions(s) == st.buffered_positions(s)
        assert twin.stats(s)["live_rows"] == st.stats(s)["live_rows"]
        assert twin.stats(s)["rounds"] == 0 < st.stats(s)["rounds"] + (s == 2)  # counters restart, as after restore
