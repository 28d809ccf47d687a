"""The device step's CUDA kernel through Python (``dspark_core.cuda.DeviceStep``): every step
equals the CPU twin's (``Stager.step_many``) on a second Stager, sequences handed over and
back through the device copy of the step state; and the step captured into a CUDA graph
replays with new accept counts written into the same device array, one launch per step.
Runs where the CUDA kernels were built (a GPU, or DSPARK_CUDA=EMULATE: CI's rehearsal)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig, cuda
from dspark_core.reference import SEMANTIC_STATS
from dspark_core.stager.device_step import STEP_OK

gpu = pytest.mark.skipif(not cuda.available(), reason=f"no CUDA device: {cuda.unavailable_reason()}")


def config(n: int, b: int, w: int, storage: str = "q8_0") -> StagerConfig:
    return StagerConfig(feature_dim=32, block_size=b, window=w, max_seqs=n, storage=storage, rows="external")


def prompt(st, q: int, p0: int, n: int) -> None:
    st.begin(q)
    st.process(q, np.arange(p0, p0 + n))


def same(x, y) -> None:
    for name in x.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)


@gpu
def test_device_steps_equal_the_cpu_twin():
    n, b, w = 12, 3, 13
    cpu, dev = Stager(config(n, b, w)), Stager(config(n, b, w))
    rng = np.random.default_rng(4)
    for q in range(n):
        p0, ln = int(rng.integers(0, 30)), int(rng.integers(1, 3 * w))
        prompt(cpu, q, p0, ln)
        prompt(dev, q, p0, ln)
    step = cuda.DeviceStep(dev, capacity=n)
    on = np.zeros(n, bool)
    for _ in range(120):
        back = [q for q in range(n) if on[q] and rng.random() < 0.05]
        if back:
            np.testing.assert_array_equal(cpu.to_host(back), step.to_host(back))
            on[back] = False
            for q in back:
                assert cpu.state(q) == dev.state(q) and cpu.stats(q) == dev.stats(q)
                np.testing.assert_array_equal(cpu.accepted(q), dev.accepted(q))
        go = [q for q in range(n) if not on[q] and rng.random() < 0.2]
        if go:
            cpu.to_device(go)
            step.to_device(go)
            on[go] = True
        seqs = [int(q) for q in rng.permutation(n)]  # host sequences too: NOT_ON_DEVICE
        counts = [int(rng.integers(0, b + 1)) for _ in seqs]
        step.set_batch(seqs, counts)
        step.launch()
        same(step.outputs(), cpu.step_many(seqs, counts))
    held = list(np.flatnonzero(on))
    cpu.to_host(held)
    step.to_host(held)
    assert cpu.totals().stats["verified_rounds"] > 0  # the kernel counted the rounds its steps verified
    assert cpu.totals() == dev.totals()
    for q in range(n):
        assert cpu.state(q) == dev.state(q) and cpu.stats(q) == dev.stats(q)
        np.testing.assert_array_equal(cpu.accepted(q), dev.accepted(q))
        if cpu.state(q)["reservation_open"]:  # settled alike, so that the snapshots compare too
            for s in (cpu, dev):
                (s.confirm if q % 2 else s.cancel)(q)
        assert cpu.snapshot(q) == dev.snapshot(q)


@gpu
def test_a_chain_drafters_ids_travel_in_a_device_token_table():
    """A chain drafter's Stager on the CUDA step: the ids go over in a device slot token table
    (only the handed sequences' slots copied), the server writes each verify row's id at its
    verify slot on the device, and what comes back equals the CPU twin's hand-backs over a
    host table: the tables, states and ids."""
    from dspark_core.cuda import DeviceArray

    n, b, w = 6, 3, 13
    cfg = config(n, b, w).replace(kind="chain")
    cpu, dev = Stager(cfg), Stager(cfg)
    ids_of = lambda pos, g: ((np.asarray(pos) * 7 + 1000 * g) % 50_000).astype(np.int32)  # noqa: E731
    for q in range(n):
        for st in (cpu, dev):
            st.begin(q)
            st.process(q, np.arange(q, q + 9 + q), tokens=ids_of(np.arange(q, q + 9 + q), 0))
    host_table = cpu.new_token_table()
    table = DeviceArray.from_numpy(np.full_like(host_table, 5), device=0, stream=0)
    step = cuda.DeviceStep(dev, capacity=n)
    with pytest.raises(ValueError, match="slot token table"):
        step.to_device([0], tokens=DeviceArray.from_numpy(np.zeros(3, np.int32), device=0, stream=0))
    with pytest.raises(ValueError, match=r"it needs the slot token table \(tokens: int32"):
        step.to_device([0])
    assert not dev.on_device(0)
    seqs = [4, 1, 2]
    cpu.to_device(seqs, tokens=host_table)
    step.to_device(seqs, tokens=table)
    got = table.get()
    rr = dev.ring_rows
    for q in range(n):  # the handed sequences' slots as the twin wrote them, the others untouched
        want = host_table[q * rr:(q + 1) * rr] if q in seqs else np.full(rr, 5, np.int32)
        np.testing.assert_array_equal(got[q * rr:(q + 1) * rr], want)
    rng = np.random.default_rng(5)
    for g in range(1, 40):
        counts = [int(c) for c in rng.integers(0, b + 1, len(seqs))]
        step.set_batch(seqs, counts)
        step.launch()
        out = step.outputs()
        same(out, cpu.step_many(seqs, counts))
        # The verify batch's ids at its verify slots, on the device and in the twin's table.
        cur = table.get()
        for k in range(len(seqs)):
            slots = out.verify_slots[k][out.verify_slots[k] >= 0]
            ids = ids_of(out.start[k] + np.arange(len(slots)), g)
            cur[slots] = host_table[slots] = ids
        table = DeviceArray.from_numpy(cur, device=0, stream=0)
    np.testing.assert_array_equal(cpu.to_host(seqs, tokens=host_table), step.to_host(seqs, tokens=table))
    for q in seqs:
        assert cpu.state(q) == dev.state(q)
        s = dev.state(q)
        np.testing.assert_array_equal(dev.tokens(q, s["horizon"], s["end"]), cpu.tokens(q, s["horizon"], s["end"]))
        for st in (cpu, dev):
            st.confirm(q)
        assert cpu.snapshot(q) == dev.snapshot(q)


@gpu
def test_a_captured_step_replays_with_new_counts():
    cu = cuda._cuda
    n, b, w = 8, 4, 20
    cpu, dev = Stager(config(n, b, w)), Stager(config(n, b, w))
    for q in range(n):
        prompt(cpu, q, 2 * q, 5 + q)
        prompt(dev, q, 2 * q, 5 + q)
    seqs = list(range(n))[::-1]
    cpu.to_device(seqs)
    step = cuda.DeviceStep(dev, capacity=n)
    step.to_device(seqs)
    step.set_batch(seqs, [0] * n)
    stream = cu.Stream(0)
    cu.capture_begin(stream.handle)
    try:
        step.launch(stream.handle)
    finally:
        graph = cu.capture_end(stream.handle)  # fails had the step synchronized, allocated or copied
    rng = np.random.default_rng(1)
    emulated = cu.emulated_launches() >= 0
    for _ in range(100):
        counts = [int(c) for c in rng.integers(0, b + 1, n)]
        step.set_counts(counts)  # the sampler's write into the same device array
        before = cu.emulated_launches()
        graph.launch(stream.handle)
        cu.synchronize(stream.handle)
        if emulated:
            assert cu.emulated_launches() - before == 1
        got = step.outputs()
        assert (got.status == STEP_OK).all()
        same(got, cpu.step_many(seqs, counts))
    step.to_host(seqs)
    cpu.to_host(seqs)
    for q in range(n):
        assert cpu.stats(q) == dev.stats(q)


@gpu
@pytest.mark.parametrize("width", [np.int32, np.int64])
def test_the_step_reads_the_samplers_own_counts(width):
    """read_counts_from: a captured step reads the sampler's own int32 / int64 buffer, rewritten
    between replays, and equals the CPU twin given the same counts (-1: not in this step)."""
    cu = cuda._cuda
    n, b, w = 6, 3, 14
    cpu, dev = Stager(config(n, b, w)), Stager(config(n, b, w))
    for q in range(n):
        prompt(cpu, q, q, 4 + 2 * q)
        prompt(dev, q, q, 4 + 2 * q)
    seqs = list(range(n))
    cpu.to_device(seqs)
    step = cuda.DeviceStep(dev, capacity=n)
    step.to_device(seqs)
    sampler = cuda.DeviceArray.from_numpy(np.zeros(n, width), stream=0)
    step.read_counts_from(sampler)
    assert step.counts_ptr == sampler.ptr and step.counts_dtype == np.dtype(width)
    step.set_batch(seqs)
    stream = cu.Stream(0)
    cu.capture_begin(stream.handle)
    try:
        step.launch(stream.handle)
    finally:
        graph = cu.capture_end(stream.handle)
    rng = np.random.default_rng(7)
    for t in range(60):
        counts = rng.integers(0, b + 1, n).astype(width)
        if t % 5 == 4:
            counts[rng.integers(0, n)] = -1  # not in this step
        cu.copy_to_device(sampler.ptr, counts.view(np.uint8), 0)  # the sampler's write
        cu.synchronize(0)
        graph.launch(stream.handle)
        cu.synchronize(stream.handle)
        same(step.outputs(), cpu.step_many(seqs, counts.tolist()))
    with pytest.raises(ValueError, match="int32 or int64"):
        step.read_counts_from(sampler.ptr, np.int16)
    with pytest.raises(ValueError, match="needs its dtype"):
        step.read_counts_from(sampler.ptr)


#: Replays of the captured step graph (the issue: "replays for hundreds of steps").
GRAPH_REPLAYS = 300


@gpu
@pytest.mark.parametrize("storage", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_a_graph_of_step_gather_and_capture_write_equals_a_held_stager(storage):
    """accept -> plan -> gather -> (drafter) -> reserve -> the verify rows' capture write, one
    captured graph replayed for hundreds of steps: the gathered rows are exactly what a held
    Stager driven by per-sequence calls stages (rebases included), and once handed back the
    sequences' state and counters are the held Stager's."""
    cu = cuda._cuda
    n, b, w, d = 4, 3, 14, 32
    held = Stager(StagerConfig(feature_dim=d, block_size=b, window=w, max_seqs=n, storage=storage))
    ext = Stager(config(n, b, w, storage=storage))
    stream = cu.Stream(0)
    ring = cuda.DeviceRing(ext, stream=stream.handle, backend="dspark")
    rng = np.random.default_rng(2)
    for q in range(n):
        x = rng.standard_normal((6 + 2 * q, d)).astype(np.float32)
        held.process(q, np.arange(len(x)), x)
        ring.write(q, np.arange(len(x)), ring.upload(x))
    ring.synchronize()
    seqs = list(range(n))
    step = cuda.DeviceStep(ext, capacity=n)
    step.to_device(seqs)
    step.set_batch(seqs, [0] * n)
    max_rows = step.max_rows
    gathered = cuda.DeviceArray((n, max_rows, d), np.float32)
    verify_rows = cuda.DeviceArray((n, b + 1, d), np.float32)
    gstatus, wstatus = ring.new_status(), ring.new_status()
    ring.synchronize()
    cu.capture_begin(stream.handle)
    try:
        step.launch(stream.handle)
        ring.gather_slots(step.arrays["row_slots"], gathered, status=gstatus)
        ring.write_slots(step.arrays["verify_slots"], verify_rows, status=wstatus)
    finally:
        graph = cu.capture_end(stream.handle)
    counts = np.zeros(n, np.int64)
    rebases = 0
    for _ in range(GRAPH_REPLAYS):
        rows = rng.standard_normal((n, b + 1, d)).astype(np.float32)  # this step's verify forward
        cu.copy_to_device(verify_rows.ptr, rows.reshape(-1).view(np.uint8), stream.handle)
        step.set_counts(counts)
        graph.launch(stream.handle)
        cu.synchronize(stream.handle)
        out = step.outputs()
        assert (out.status == STEP_OK).all()
        got = gathered.get()
        for k, q in enumerate(seqs):
            held.accept(q, int(counts[q]))
            plan = held.draft(q, held.state(q)["end"])
            m = int(out.n_rows[k])
            if plan.skip is None:
                np.testing.assert_array_equal(got[k, :m], plan.rows)
                held.commit(q)
                rebases += plan.rebase
            nv = b + 1 if plan.skip is None else 1
            end = held.state(q)["end"]
            held.process(q, np.arange(end, end + nv), rows[k, :nv])
            counts[q] = int(rng.integers(0, b + 1)) if nv > 1 else 0
    assert rebases > 0
    step.to_host(seqs)  # commits each open round, as the held Stager's commit did
    ext.confirm_many(seqs)  # the capture write wrote the verify rows, as held.process did
    for q in seqs:  # the counters both row modes keep (bytes are held rows' only)
        assert ext.state(q) == held.state(q)
        assert {k: ext.stats(q)[k] for k in SEMANTIC_STATS} == {k: held.stats(q)[k] for k in SEMANTIC_STATS}
        np.testing.assert_array_equal(ext.accepted(q), held.accepted(q))


@gpu
def test_one_captured_graph_replays_over_a_batch_of_changing_size():
    """A graph captured once for ``capacity`` entries serves batches that grow and shrink: the
    ids and counts are rewritten in place with padding entries past the batch
    (``set_batch(..., pad=True)``), with no re-capture; every replay equals the CPU twin's
    fixed-capacity step."""
    from dspark_core.stager.device_step import StepOutputs

    cu = cuda._cuda
    n, b, w, cap = 6, 3, 16, 8
    cpu, dev = Stager(config(n, b, w)), Stager(config(n, b, w))
    for q in range(n):
        prompt(cpu, q, 0, 4 + 2 * q)
        prompt(dev, q, 0, 4 + 2 * q)
    everyone = list(range(n))
    cpu.to_device(everyone)
    step = cuda.DeviceStep(dev, capacity=cap)
    step.to_device(everyone)
    step.set_batch([0], [0], pad=True)
    stream = cu.Stream(0)
    cu.capture_begin(stream.handle)
    try:
        step.launch(stream.handle)
    finally:
        graph = cu.capture_end(stream.handle)
    rng = np.random.default_rng(7)
    out = StepOutputs.empty(cap, cpu.step_layout[1], b)
    for _ in range(60):
        k = int(rng.integers(0, n + 1))
        seqs = [int(q) for q in rng.permutation(n)[:k]]
        counts = [int(c) for c in rng.integers(-1, b + 1, k)]
        step.set_batch(seqs, counts, pad=True)
        graph.launch(stream.handle)
        cu.synchronize(stream.handle)
        cpu.step_many(seqs, counts, out=out)
        same(step.outputs(), out)
    step.to_host(everyone)
    cpu.to_host(everyone)
    for q in everyone:
        assert cpu.state(q) == dev.state(q) and cpu.stats(q) == dev.stats(q)


@gpu
def test_the_drafting_switch_reaches_the_device_copy_and_comes_back():
    """DeviceStep.set_drafting on handed-over sequences: the steps launched after it skip them
    with SKIP_DRAFTING_OFF (or draft them again), as the CPU twin's after disable / enable, the
    other sequences' columns on the device untouched (their steps since the hand-over kept);
    to_host brings the switch back."""
    from dspark_core.stager.device_step import SKIP_DRAFTING_OFF, StepOutputs

    n, b, w = 4, 3, 16
    cpu, dev = Stager(config(n, b, w)), Stager(config(n, b, w))
    for q in range(n):
        prompt(cpu, q, 0, 5 + q)
        prompt(dev, q, 0, 5 + q)
    everyone = list(range(n))
    cpu.to_device(everyone)
    step = cuda.DeviceStep(dev, capacity=n, stream="new")
    step.to_device(everyone)
    graph = step.capture()
    out = StepOutputs.empty(n, cpu.step_layout[1], b)
    skips = []
    for k in range(12):
        if k == 2:
            step.set_drafting([1, 3], on=False)
            cpu.disable_many([1, 3])
        if k == 7:
            step.set_drafting([3], on=True)
            cpu.enable(3)
        counts = [k % (b + 1)] * n
        step.set_batch(everyone, counts)
        step.replay(graph)
        cpu.step_many(everyone, counts, out=out)
        got = step.outputs()
        same(got, out)
        skips.append(got.skip.tolist())
    assert skips[3][1] == skips[3][3] == SKIP_DRAFTING_OFF and skips[8][3] == 0 and skips[8][1] == SKIP_DRAFTING_OFF
    step.to_host(everyone)
    cpu.to_host(everyone)
    for q in everyone:
        assert cpu.state(q) == dev.state(q) and cpu.stats(q) == dev.stats(q)
    assert dev.state(1)["drafting_off"] and not dev.state(3)["drafting_off"]


@gpu
def test_capture_needs_a_stream_of_its_own():
    st = Stager(config(1, 2, 9))
    prompt(st, 0, 0, 4)
    with pytest.raises(ValueError, match="legacy default stream cannot be captured"):
        cuda.DeviceStep(st, capacity=1).capture()
