"""Batches of many sequences in one call: ``write_slots`` / ``gather_slots`` / ``write_many``
and ``gather(BatchPlan)``, for both owners (HostRing everywhere, DeviceRing on a device or
the emulated one).

The oracle is a held Stager fed the same rows: after a step that writes the rows of every
sequence at once, the batch gather of the next plans equals the held ``BatchPlan.rows`` byte
for byte, in the flat (CSR) form and in the fixed-shape padded ``[N, max_rows]`` form (whose
padding rows are zeros), for every storage and stage dtype, through ring wrap, rebases and
rows below the horizon (slot -1). On the device each batch call is one kernel launch (one
more, a read-only check, under ``nonfinite="error"``), counted by the emulated device; the
asynchronous ``status=`` form captures into a CUDA graph (the emulated capture refuses
synchronizations, allocations and host copies) and replays with new slots.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dspark_core import Stager, StagerConfig, cuda, formats
from dspark_core.stager.config import STORAGES
from test_device_ring import OWNER_PARAMS, OWNERS, empty, gpu, host as host_bytes
from test_device_ring import Launches as BindingCalls

BF16 = np.dtype(ml_dtypes.bfloat16)


def activations(rng, n, dim, scale=1.0):
    """N(0, 1) rows with massive channels (up to 7e3 x scale) and a huge-norm first row."""
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x[:, [1, dim // 3, dim - 2]] *= np.array([1e3, 5e3, 7e3], np.float32) * np.float32(scale)
    if n:
        x[0] *= np.float32(3.0)
    return x


def padded(plans, width):
    """The fixed-shape form of a batch's slots: ``[N, width]``, -1 after each plan's rows."""
    out = np.full((len(plans), width), -1, np.int64)
    for i, p in enumerate(plans):
        out[i, : len(p.slots)] = p.slots
    return out


class Launches(BindingCalls):
    """Kernel launches on the device: the emulated device's own count, else the binding's
    calls (one launch each, as test_cuda_batch.cpp checks)."""

    NAMES = BindingCalls.NAMES + ("scatter_rows", "gather_rows", "check_rows")

    def __init__(self, monkeypatch):
        self.emulated = cuda._cuda.emulated_launches() >= 0
        if self.emulated:
            self.n = cuda._cuda.emulated_launches()
        else:
            super().__init__(monkeypatch)

    def take(self):
        if not self.emulated:
            return super().take()
        now = cuda._cuda.emulated_launches()
        n, self.n = now - self.n, now
        return n


class Server:
    """N sequences stepped together: a held Stager (the oracle) and an external one whose rows
    an owner writes with one write_slots per step."""

    def __init__(self, cfg, owner, n_seqs, seed=0, scale=1.0):
        self.held = Stager(cfg)
        self.ext = Stager(cfg.replace(rows="external"))
        self.ring = OWNERS[owner](self.ext)
        self.rng = np.random.default_rng(seed)
        self.cfg = cfg
        self.seqs = list(range(n_seqs))
        self.scale = scale

    def end(self, seq):
        return self.held.state(seq)["end"]

    def step_rows(self, counts):
        """Rows for each sequence (``counts[i]`` rows), processed by both Stagers; the external
        side writes them all with one write_slots. Returns (flat slots, flat rows)."""
        rows, slots = [], []
        for seq, n in zip(self.seqs, counts):
            x = activations(self.rng, n, self.cfg.feature_dim, self.scale)
            pos = np.arange(self.end(seq), self.end(seq) + n)
            self.held.process(seq, pos, x)
            slots.append(self.ext.process(seq, pos))
            rows.append(x)
        flat_slots, flat_rows = np.concatenate(slots), np.concatenate(rows)
        self.ring.write_slots(flat_slots, self.ring.upload(flat_rows))
        return flat_slots, flat_rows

    def plans(self):
        ends = [self.end(s) for s in self.seqs]
        return self.held.draft_many(self.seqs, ends), self.ext.draft_many(self.seqs, ends)

    def close(self, accepted):
        for seq, a in zip(self.seqs, accepted):
            if self.held.state(seq)["open_round"]:
                self.held.commit(seq)
                self.ext.commit(seq)
            self.held.accept(seq, a)
            self.ext.accept(seq, a)


@pytest.mark.parametrize("owner", OWNER_PARAMS)
@pytest.mark.parametrize("nonfinite", ["clamp", "error"])
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("stage_dtype", ["float32", "float16", "bfloat16"])
def test_batches_equal_held_mode(owner, storage, stage_dtype, nonfinite):
    """Four sequences joining at different lengths (one prompt longer than the window: rows
    below the horizon), stepped together until a ring wraps: each step's rows are written
    with one write_slots; each step's plans are gathered flat and padded. Rows with massive
    channels past f16's range, clamped; under "error", rows every storage holds."""
    cfg = StagerConfig(64, 3, 24, max_seqs=4, storage=storage, stage_dtype=stage_dtype, nonfinite=nonfinite)
    s = Server(cfg, owner, 4, seed=STORAGES.index(storage), scale=20.0 if nonfinite == "clamp" else 0.2)
    slots, _ = s.step_rows([90, 5, 17, 1])  # then sequence 2 takes 4 rows a step: its ring wraps
    assert (slots == -1).any()  # the 90-row prompt: its first rows are below the horizon
    width = cfg.window + cfg.block_size  # a fixed width that holds any plan
    wrapped = False
    for i in range(135):
        hb, xb = s.plans()
        active = [p for p in xb.plans if p.skip is None]
        wrapped |= any(len(p.slots) > 1 and np.any(np.diff(p.slots) != 1) for p in active)
        if active:
            flat = s.ring.gather_slots(xb.slots)
            assert host_bytes(s.ring, flat).tobytes() == hb.rows.view(np.uint8).reshape(-1).tobytes()
            pad = padded(xb.plans, width)
            out = empty(s.ring, pad.shape + (64,), s.ring.stage_dtype)
            assert s.ring.gather_slots(pad, out) is out
            got = s.ring.to_numpy(out)
            for k, (hp, xp) in enumerate(zip(hb.plans, xb.plans)):
                n = len(xp.slots)
                if xp.skip is None:
                    assert got[k, :n].tobytes() == hp.rows.tobytes()
                assert not got[k, n:].view(np.uint8).any()  # padding rows: zeros
            assert s.ring.to_numpy(s.ring.gather(xb)).tobytes() == hb.rows.tobytes()
        s.close([i % 4, (i + 1) % 4, 3, 0])
        s.step_rows([1 + i % 4, 1 + (i + 1) % 4, 4, 1])
    assert wrapped


@pytest.mark.parametrize("owner", OWNER_PARAMS)
@pytest.mark.parametrize("in_dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
def test_write_slots_takes_every_input_dtype_and_the_padded_shape(owner, in_dtype):
    cfg = StagerConfig(64, 2, 16, max_seqs=2, storage="q8_0")
    ring = OWNERS[owner](Stager(cfg.replace(rows="external")))
    rng = np.random.default_rng(4)
    x = np.clip(activations(rng, 6, 64), -6e4, 6e4).astype(in_dtype)
    slots = np.array([[3, 4, -1], [40, 41, 42]], np.int64)
    untouched = ring.read(range(5, 40)).tobytes()
    ring.write_slots(slots, ring.upload(x.reshape(2, 3, 64)))
    want = formats.quantize_rows(x, "q8_0")
    live = slots.reshape(-1) >= 0
    assert ring.read(slots.reshape(-1)[live]).tobytes() == want[live].tobytes()
    assert ring.read(range(5, 40)).tobytes() == untouched  # the padding row wrote nowhere
    if in_dtype == BF16:  # bfloat16 bits given as uint16
        ring.write_slots([7], ring.upload(x[:1].view(np.uint16)), in_dtype="bfloat16")
        assert ring.read([7]).tobytes() == want[:1].tobytes()


@pytest.mark.parametrize("owner", OWNER_PARAMS)
def test_a_rejected_batch_changes_nothing_and_names_the_row(owner):
    """nonfinite="error": the checked form raises before any row is written; the status form
    reports the row and column instead, and writes nothing either."""
    cfg = StagerConfig(64, 2, 16, max_seqs=2, storage="f16")
    ring = OWNERS[owner](Stager(cfg.replace(rows="external")))
    rng = np.random.default_rng(5)
    x = activations(rng, 5, 64)
    x[3, 9] = np.float32(7e4)  # past f16's 65,520
    slots = np.array([0, 1, 2, 3, 4], np.int64)
    before = ring.read(range(ring.rows)).tobytes()
    with pytest.raises(ValueError, match=r"row 3, column 9 holds .* nothing was written"):
        ring.write_slots(slots, ring.upload(x))
    status = ring.new_status()
    ring.write_slots(slots, ring.upload(x), status=status)
    st = ring.read_status(status)
    assert (st.bad_row, st.bad_column, st.bad_slot_row, st.ok) == (3, 9, None, False)
    assert ring.read(range(ring.rows)).tobytes() == before
    # A padding row is not checked: the same batch with that row skipped is written.
    slots[3] = -1
    ring.write_slots(slots, ring.upload(x), status=status)
    assert ring.read_status(status).ok
    assert ring.read([0]).tobytes() == formats.quantize_rows(x[:1], "f16").tobytes()


@pytest.mark.parametrize("owner", OWNER_PARAMS)
def test_slots_are_checked(owner):
    cfg = StagerConfig(32, 2, 12, max_seqs=2)
    ring = OWNERS[owner](Stager(cfg.replace(rows="external")))
    x = ring.upload(np.zeros((2, 32), np.float32))
    for bad in ([0, ring.rows], [-2, 0]):
        with pytest.raises(ValueError, match=r"slot .* \(row \d\) is outside the table"):
            ring.write_slots(np.array(bad), x)
        with pytest.raises(ValueError, match="outside the table"):
            ring.gather_slots(np.array(bad))
    with pytest.raises(ValueError, match="a slot appears twice"):
        ring.write_slots(np.array([4, 4]), x)
    ring.gather_slots(np.array([4, 4]))  # reading one row twice is fine
    with pytest.raises(TypeError, match="integer"):
        ring.write_slots(np.array([0.0, 1.0]), x)
    with pytest.raises(ValueError, match=r"rows must be \(3, 32\)"):
        ring.write_slots(np.array([0, 1, 2]), x)
    with pytest.raises(ValueError, match="out must be"):
        ring.gather_slots(np.array([0, 1]), empty(ring, (3, 32), np.float32))
    with pytest.raises(TypeError, match="dtype float64"):
        ring.gather_slots(np.array([0, 1]), dtype=np.float64)


@pytest.mark.parametrize("owner", OWNER_PARAMS)
def test_write_many_is_the_per_sequence_writes_and_all_or_nothing(owner):
    """One call for three sequences equals three writes (slots, bytes, Stager state); a batch
    with one bad sequence (positions, or a NaN under nonfinite='error') changes nothing. The
    arguments are process_many's, with its checks and messages."""
    cfg = StagerConfig(64, 2, 16, max_seqs=4, storage="bf16")
    a, b = Stager(cfg.replace(rows="external")), Stager(cfg.replace(rows="external"))
    ra, rb = OWNERS[owner](a), OWNERS[owner](b)
    rng = np.random.default_rng(6)
    x = activations(rng, 11, 64)
    cu_seqlens = [0, 3, 4, 11]
    positions = np.concatenate([np.arange(3), np.arange(1), np.arange(7)])
    flat = ra.write_many([2, 0, 1], cu_seqlens, positions, ra.upload(x))
    each = [rb.write(seq, np.arange(0, hi - lo), rb.upload(x[lo:hi]))
            for seq, lo, hi in zip([2, 0, 1], cu_seqlens[:-1], cu_seqlens[1:])]
    assert np.array_equal(flat, np.concatenate(each))
    assert ra.read(flat).tobytes() == rb.read(flat).tobytes()
    assert [a.state(s) for s in range(3)] == [b.state(s) for s in range(3)]
    states, table = [a.state(s) for s in range(4)], ra.read(range(ra.rows)).tobytes()
    y = activations(rng, 4, 64)
    bad_calls = [
        (ValueError, r"process_many: seqs\[1\] \(sequence 1\): sequence 1: positions must continue at 7",
         ([3, 1], [0, 2, 4], [0, 1, 6, 7])),
        (ValueError, "appears twice", ([1, 1], [0, 2, 4], [7, 8, 9, 10])),
        (ValueError, "cu_seqlens must not decrease", ([3, 1], [0, 3, 2], [0, 1, 7, 8])),
        # The conversions process_many makes: floats are refused, not truncated; 2-D not flattened.
        (TypeError, "seqs must be integers", (np.array([3.0, 1.0]), [0, 2, 4], [0, 1, 7, 8])),
        (TypeError, "cu_seqlens must be integers", ([3, 1], np.array([0.0, 2.0, 4.0]), [0, 1, 7, 8])),
        (TypeError, "positions must be integers", ([3, 1], [0, 2, 4], np.array([0.0, 1, 7, 8]))),
        (ValueError, "seqs must be 1-D", (np.array([[3, 1]]), [0, 2, 4], [0, 1, 7, 8])),
        (ValueError, "positions must be 1-D", ([3, 1], [0, 2, 4], np.array([[0, 1], [7, 8]]))),
    ]
    for exc, message, args in bad_calls:
        with pytest.raises(exc, match=message):
            ra.write_many(*args, ra.upload(y))
        with pytest.raises(exc, match=message):  # the same error as the Stager's own batch call
            a.process_many(*args)
    y[3, 0] = np.nan
    with pytest.raises(ValueError, match=r"sequence 1: row 3 \(position 8\) holds a non-finite value"):
        ra.write_many([3, 1], [0, 2, 4], [0, 1, 7, 8], ra.upload(y))
    assert [a.state(s) for s in range(4)] == states and ra.read(range(ra.rows)).tobytes() == table


@pytest.mark.parametrize("owner", OWNER_PARAMS)
def test_write_many_first_form_still_works_with_a_warning(owner):
    """``write_many(seqs, starts, cu_seqlens, rows)`` (one start per sequence) is recognised by its
    lengths and warns, naming process_many's order; it writes what the new form writes."""
    cfg = StagerConfig(64, 2, 16, max_seqs=4, storage="q8_0", rows="external")
    a, b = Stager(cfg), Stager(cfg)
    ra, rb = OWNERS[owner](a), OWNERS[owner](b)
    x = activations(np.random.default_rng(8), 5, 64)
    with pytest.warns(DeprecationWarning, match=r"write_many\(seqs, cu_seqlens, positions, rows\)"):
        old = ra.write_many([1, 3], [0, 0], [0, 2, 5], ra.upload(x))
    new = rb.write_many([1, 3], [0, 2, 5], [0, 1, 0, 1, 2], rb.upload(x))
    assert np.array_equal(old, new) and ra.read(old).tobytes() == rb.read(new).tobytes()


@gpu
@pytest.mark.parametrize("nonfinite", ["zero", "error"])
def test_one_launch_per_batch(monkeypatch, nonfinite):
    """16 sequences: gather(BatchPlan), gather_slots (flat or padded) and write_slots are one
    launch each (write_slots under 'error': a read-only check launch more), where the
    per-sequence calls took up to two launches per sequence."""
    cfg = StagerConfig(64, 3, 24, max_seqs=16, storage="q4_0", nonfinite=nonfinite)
    s = Server(cfg, "device", 16, seed=7)
    s.step_rows([30 + i for i in range(16)])  # rounds of 4 rows then straddle the rings' ends
    launches = Launches(monkeypatch)
    per_write = 2 if nonfinite == "error" else 1
    for i in range(40):
        hb, xb = s.plans()
        launches.take()
        got = s.ring.gather(xb)
        assert launches.take() == 1
        assert host_bytes(s.ring, got).tobytes() == hb.rows.view(np.uint8).reshape(-1).tobytes()
        s.ring.gather_slots(padded(xb.plans, 32))
        assert launches.take() == 1
        s.close([i % 4] * 16)
        s.step_rows([1 + (i + k) % 4 for k in range(16)])
        assert launches.take() == per_write
    # write_many: process for each sequence, one launch for all their rows (and one check).
    counts = np.arange(16) % 3 + 1
    x = activations(s.rng, int(counts.sum()), 64)
    starts = [s.end(q) for q in range(16)]
    cu_seqlens = np.concatenate([[0], np.cumsum(counts)])
    for q in range(16):
        s.held.process(q, np.arange(starts[q], starts[q] + counts[q]), x[cu_seqlens[q]:cu_seqlens[q + 1]])
    launches.take()
    positions = np.concatenate([np.arange(starts[q], starts[q] + counts[q]) for q in range(16)])
    slots = s.ring.write_many(range(16), cu_seqlens, positions, s.ring.upload(x))
    assert launches.take() == per_write
    hb, xb = s.plans()
    assert host_bytes(s.ring, s.ring.gather(xb)).tobytes() == hb.rows.view(np.uint8).reshape(-1).tobytes()
    assert len(slots) == len(x)


@gpu
@pytest.mark.parametrize("nonfinite", ["clamp", "error"])
def test_the_status_form_is_captured_into_a_graph_and_replays_with_new_slots(nonfinite):
    """A server's step as a CUDA graph: fixed-shape device slot arrays and rows, write_slots and
    gather_slots with status words, captured once on the ring's stream and replayed after the
    slots change in place: the same bytes as the held Stager each step, and no
    synchronization, allocation or host copy inside (the capture would fail)."""
    cu = cuda._cuda
    stream = cu.Stream(0)
    n_seqs, dim = 4, 64
    cfg = StagerConfig(dim, 3, 24, max_seqs=n_seqs, storage="q8_0", stage_dtype="bfloat16", nonfinite=nonfinite)
    width = cfg.window + cfg.block_size  # holds any plan
    held, ext = Stager(cfg), Stager(cfg.replace(rows="external"))
    ring = cuda.DeviceRing(ext, stream=stream.handle, backend="dspark")
    rng = np.random.default_rng(8)
    # The graph's fixed buffers: B + 1 = 4 verify rows per sequence, the plans' slots padded to W + B.
    wslots = cuda.DeviceArray.from_numpy(np.full((n_seqs, 4), -1, np.int64), stream=stream.handle)
    rows = cuda.DeviceArray((n_seqs, 4, dim), np.float32)
    gslots = cuda.DeviceArray.from_numpy(np.full((n_seqs, width), -1, np.int64), stream=stream.handle)
    out = cuda.DeviceArray((n_seqs, width, dim), BF16)
    wstatus, gstatus = ring.new_status(), ring.new_status()
    ring.synchronize()
    cu.capture_begin(stream.handle)
    try:
        ring.write_slots(wslots, rows, status=wstatus)
        ring.gather_slots(gslots, out, status=gstatus)
    finally:
        graph = cu.capture_end(stream.handle)
    for seq in range(n_seqs):  # prompts, outside the graph
        x = activations(rng, 6 + seq, dim)
        held.process(seq, np.arange(len(x)), x)
        ring.write(seq, np.arange(len(x)), ring.upload(x))
    for step in range(12):
        # The plans of this step, then the rows the forward produced (n_accepted + 1 per sequence).
        ends = [held.state(q)["end"] for q in range(n_seqs)]
        hb, xb = held.draft_many(range(n_seqs), ends), ext.draft_many(range(n_seqs), ends)
        counts = [1 + (step + q) % 4 for q in range(n_seqs)]
        x = activations(rng, 4 * n_seqs, dim).reshape(n_seqs, 4, dim)
        if nonfinite == "error" and step == 5:
            x[2, counts[2] - 1, 7] = np.inf
        for q in range(n_seqs):
            if held.state(q)["open_round"]:
                held.commit(q)
                ext.commit(q)
                held.accept(q, counts[q] - 1)
                ext.accept(q, counts[q] - 1)
        ws = np.full((n_seqs, 4), -1, np.int64)
        rejected = nonfinite == "error" and step == 5
        for q in range(n_seqs):
            pos = np.arange(held.state(q)["end"], held.state(q)["end"] + counts[q])
            if not rejected:
                held.process(q, pos, x[q, : counts[q]])
            ws[q, : counts[q]] = ext.process(q, pos) if not rejected else -1
        if rejected:  # make the batch's bad row live: its slot is written by this step
            ws[2, counts[2] - 1] = 0
        # Between replays: new contents in the same device arrays (host-to-device copies).
        cu.copy_to_device(wslots.ptr, ws.view(np.uint8).reshape(-1), stream.handle)
        cu.copy_to_device(rows.ptr, x.view(np.uint8).reshape(-1), stream.handle)
        cu.copy_to_device(gslots.ptr, padded(xb.plans, width).view(np.uint8).reshape(-1), stream.handle)
        before = ring.read(range(ring.rows)).tobytes()
        graph.launch(stream.handle)
        got = ring.to_numpy(out)
        for k, (hp, xp) in enumerate(zip(hb.plans, xb.plans)):
            if xp.skip is None:
                assert got[k, : len(xp.slots)].tobytes() == hp.rows.tobytes()
            assert not got[k, len(xp.slots):].view(np.uint8).any()
        assert ring.read_status(gstatus).ok
        w = ring.read_status(wstatus)
        if rejected:  # reported, and the whole batch left the table alone
            assert (w.bad_row, w.bad_column) == (2 * 4 + counts[2] - 1, 7)
            assert ring.read(range(ring.rows)).tobytes() == before
        else:
            assert w.ok
            live = ws.reshape(-1) >= 0
            want = formats.quantize_rows(x.reshape(-1, dim)[live], "q8_0")
            assert ring.read(ws.reshape(-1)[live]).tobytes() == want.tobytes()


@gpu
def test_the_checked_form_cannot_be_captured():
    """status=None with device slots reads them back (a synchronization): a capture fails,
    and says so, instead of recording a graph that does something else."""
    cu = cuda._cuda
    stream = cu.Stream(0)
    ring = cuda.DeviceRing(Stager(StagerConfig(32, 2, 12, rows="external")), stream=stream.handle, backend="dspark")
    slots = cuda.DeviceArray.from_numpy(np.array([0, 1], np.int64), stream=stream.handle)
    x = cuda.DeviceArray.from_numpy(np.zeros((2, 32), np.float32), stream=stream.handle)
    ring.synchronize()
    cu.capture_begin(stream.handle)
    try:
        with pytest.raises(RuntimeError, match="capturing"):
            ring.write_slots(slots, x)
    finally:
        with pytest.raises(RuntimeError, match="could not be captured"):
            cu.capture_end(stream.handle)
