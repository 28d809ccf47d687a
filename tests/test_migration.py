"""A sequence moves between processes mid-session (disaggregated prefill -> decode).

A "prefill node" process runs the prompt and the first rounds of a session,
writes the sequence's snapshot straight into shared memory (or sends it over
a localhost socket) and exits. The "decode node" (this process) restores it
into one of its slots and continues. An unmoved twin runs the whole session
in one Stager. The oracles:

* moved at a round where the twin rebases anyway, every later plan (fields
  and staged bytes) is identical to the twin's;
* moved anywhere, the first plan after the move restages (the drafter cache
  of the new slot is unknown), every plan is identical to the pure-Python
  reference twin's moved in-process at the same round, and every staged row
  is the encoding (reference encoder) of the row the target produced last
  for that position.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.reference import formats as rf
from dspark_core.stager import snapshot_format as sf
from dspark_core.reference import ReferenceStager

D, B, W = 256, 4, 32
PROMPT = 21
ROUNDS = 34


def config(storage: str) -> StagerConfig:
    return StagerConfig(feature_dim=D, block_size=B, window=W, max_seqs=3, storage=storage)


def target_rows(positions: np.ndarray, n_past: int) -> np.ndarray:
    """Capture rows the target produces at these positions during the round at n_past: N(0,1)
    with massive channels, a huge-norm BOS row; re-verified positions get new values."""
    rng = np.random.default_rng(1000 + n_past)
    x = rng.standard_normal((len(positions), D)).astype(np.float32)
    x[:, [11, 97]] *= np.float32(4e3)
    x[:, 200] += np.float32(6e4)
    if len(positions) and positions[0] == 0:
        x[0] *= np.float32(3.0)  # q4_0's fp16 block scale (max / 8) still holds it
    return x


def accepts() -> list[int]:
    return np.random.default_rng(7).integers(0, B + 1, ROUNDS).tolist()


def start(st, seq: int, fed: dict | None = None) -> int:
    st.begin(seq)
    pos = np.arange(PROMPT)
    rows = target_rows(pos, 0)
    st.process(seq, pos, rows)
    if fed is not None:
        fed.update(zip(pos.tolist(), rows))
    return PROMPT


def play(st, seq: int, n_past: int, rounds: range, plans: list | None = None, fed: dict | None = None) -> int:
    """Server rounds: draft, commit, verify B + 1 rows, accept."""
    acc = accepts()
    for r in rounds:
        p = st.draft(seq, n_past)
        if plans is not None:
            plans.append(p)
        if not p.skip:
            st.commit(seq)
        v = np.arange(n_past, n_past + B + 1)
        rows = target_rows(v, n_past)
        st.process(seq, v, rows)
        if fed is not None:
            fed.update(zip(v.tolist(), rows))
        st.accept(seq, acc[r])
        n_past += acc[r] + 1
    return n_past


def n_past_after(rounds: int) -> int:
    return PROMPT + sum(a + 1 for a in accepts()[:rounds])


# -- the prefill node (a separate process) -------------------------------------


def prefill_node_shm(storage: str, moves: list[int], shm_name: str, slot_bytes: int, out) -> None:
    """Run the session on slot 0 and snapshot it at each round in `moves` into the shared block."""
    shm = shared_memory.SharedMemory(name=shm_name)
    resource_tracker.unregister(shm._name, "shared_memory")  # the decode node owns and unlinks it
    try:
        st = Stager(config(storage))
        n_past = start(st, 0)
        done = 0
        sizes = []
        for k, at in enumerate(moves):
            n_past = play(st, 0, n_past, range(done, at))
            done = at
            view = shm.buf[k * slot_bytes:(k + 1) * slot_bytes]
            sizes.append(st.snapshot_into(0, view))  # straight into shared memory
            del view
        out.put(sizes)
    finally:
        shm.close()


def prefill_node_socket(storage: str, at: int, port: int) -> None:
    st = Stager(config(storage))
    play(st, 0, start(st, 0), range(at))
    buf = bytearray(st.snapshot_size(0))
    st.snapshot_into(0, buf)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(len(buf).to_bytes(8, "little") + buf)


# -- the decode node (this process) --------------------------------------------


def twin_run(storage: str) -> list:
    plans: list = []
    st = Stager(config(storage))
    play(st, 0, start(st, 0), range(ROUNDS), plans)
    return plans


def plan_key(p):
    rows = None if p.skip else p.encoded_rows.tobytes()
    return (p.skip, p.rebase, p.clear_cache, p.start, p.pos_base, p.crop_from,
            None if p.skip else p.positions.tolist(), None if p.skip else p.block_positions.tolist(), rows)


def decode_node(storage: str, at: int, blob, slot_state: str) -> tuple[list, dict]:
    """Restore the moved sequence into slot 2 of a serving Stager and play the rest."""
    st = Stager(config(storage))
    if slot_state != "fresh":
        start(st, 2)  # an earlier request used this slot
        play(st, 2, PROMPT, range(5))
        if slot_state == "emptied":
            st.begin(2)
    st.restore(2, blob)
    fed: dict = {}
    # The rows the target produced up to the move (what the moved snapshot must hold).
    replay = Stager(config(storage))
    play(replay, 0, start(replay, 0, fed), range(at), fed=fed)
    plans: list = []
    play(st, 2, n_past_after(at), range(at, ROUNDS), plans, fed)
    return plans, fed


def reference_moved(storage: str, at: int) -> list:
    """The pure-Python twin moved in-process (its own snapshot code) at the same round."""
    st = ReferenceStager(config(storage))
    n_past = play(st, 0, start(st, 0), range(at))
    st.restore(2, st.snapshot(0))
    plans: list = []
    play(st, 2, n_past, range(at, ROUNDS), plans)
    return plans


def check_against_twins(storage: str, at: int, plans: list, fed: dict) -> None:
    twin = twin_run(storage)[at:]
    assert len(plans) == len(twin)
    first = plans[0]
    assert not first.skip and first.rebase and first.clear_cache  # the new slot restages
    if twin[0].rebase:  # moved where the unmoved twin rebases anyway: identical throughout
        for i, (p, q) in enumerate(zip(plans, twin)):
            assert plan_key(p) == plan_key(q), f"plan {at + i} differs from the unmoved twin"
    for i, (p, q) in enumerate(zip(plans, reference_moved(storage, at))):
        assert plan_key(p) == plan_key(q), f"plan {at + i} differs from the reference moved in-process"
        if p.skip:
            continue
        # Every staged row is the encoding of the target's latest row for its position.
        want = np.stack([fed[int(x) + p.pos_base] for x in p.positions])
        assert p.encoded_rows.tobytes() == rf.encode(want, storage).tobytes(), f"rows of plan {at + i}"


def _rebase_round(storage: str) -> int:
    twin = twin_run(storage)
    return next(i for i, p in enumerate(twin) if p.rebase and i >= ROUNDS // 3)


@pytest.mark.parametrize("storage", ["f32", "q4_0"])
def test_migrate_through_shared_memory(storage):
    rebase_at = _rebase_round(storage)
    moves = sorted({rebase_at, rebase_at + 1, ROUNDS // 2 - 3})
    slot_bytes = sf.snapshot_bytes(W + B + 1, config(storage).row_bytes)  # the most a snapshot holds
    shm = shared_memory.SharedMemory(create=True, size=slot_bytes * len(moves))
    try:
        ctx = mp.get_context("spawn")  # a fresh interpreter, nothing shared but the block
        out = ctx.Queue()
        proc = ctx.Process(target=prefill_node_shm, args=(storage, moves, shm.name, slot_bytes, out))
        proc.start()
        sizes = out.get(timeout=120)
        proc.join(timeout=60)
        assert proc.exitcode == 0
        for k, at in enumerate(moves):
            with shm.buf[k * slot_bytes:k * slot_bytes + sizes[k]] as blob:  # restored in place, no copy
                for slot_state in ("fresh", "emptied", "holding_rows"):
                    plans, fed = decode_node(storage, at, blob, slot_state)
                    check_against_twins(storage, at, plans, fed)
                damaged = bytearray(blob)
            # Damaged in transit: always rejected, the slot untouched.
            damaged[len(damaged) // 2] ^= 0x20
            st = Stager(config(storage))
            play(st, 1, start(st, 1), range(3))
            before = (st.state(1), st.snapshot(1))
            with pytest.raises(ValueError, match="checksum"):
                st.restore(1, damaged)
            assert (st.state(1), st.snapshot(1)) == before
    finally:
        shm.close()
        shm.unlink()


def test_migrate_over_a_localhost_socket():
    storage = "q4_0"
    at = ROUNDS // 2 - 1
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=prefill_node_socket, args=(storage, at, port))
        proc.start()
        server.settimeout(120)
        conn, _ = server.accept()
        with conn:
            head = bytearray(8)
            view = memoryview(head)
            while view:
                view = view[conn.recv_into(view):]
            n = int.from_bytes(head, "little")
            buf = bytearray(n)  # received straight into the buffer restore reads
            view = memoryview(buf)
            while view:
                got = conn.recv_into(view)
                assert got, "connection closed early"
                view = view[got:]
        proc.join(timeout=60)
    assert proc.exitcode == 0
    plans, fed = decode_node(storage, at, buf, "emptied")
    check_against_twins(storage, at, plans, fed)
