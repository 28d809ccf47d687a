"""The owners of an external-row Stager's rows, bit-exact with held mode: DeviceRing and HostRing.

Every test of the owner's interface runs for both owners (the ``owner``
parameter): HostRing everywhere, DeviceRing where a CUDA device is usable (a
real GPU, or in CI the DSPARK_CUDA=EMULATE build's emulated device, where
"device memory" is host memory and the same kernels run under the warp
model); the launch counts need the device. The oracle is a held
Stager with the same configuration fed the same host rows: after every round
``ring.gather(plan)`` must equal its ``plan.rows`` byte for byte (and
``gather(batch)`` its ``batch.rows``), through long prefills, ring wrap,
rebases, failures, rollbacks, forks and shifts, for every storage and stage
dtype. Launches are counted by wrapping the binding's encode / decode entry
points (one kernel launch per call, as test_cuda_kernels.cpp checks).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from conftest import at_once

from dspark_core import HostRing, Stager, StagerConfig, cuda, formats
from dspark_core.stager import snapshot_format
from dspark_core.stager.config import STORAGES
from dspark_core.errors import StateError

BF16 = np.dtype(ml_dtypes.bfloat16)

gpu = pytest.mark.skipif(not cuda.available(), reason=f"no CUDA device: {cuda.unavailable_reason()}")

#: The owner classes by name; DeviceRing's tests skip without a device.
OWNERS = {"host": HostRing, "device": cuda.DeviceRing}
OWNER_PARAMS = ["host", pytest.param("device", marks=gpu)]


@pytest.fixture(params=OWNER_PARAMS)
def owner(request):
    """Which owner of the rows a test drives (every interface test runs for both)."""
    return request.param


@pytest.mark.skipif(cuda.available(), reason="checks the no-device error; a device is present")
def test_without_a_device_the_ring_says_why():
    st = Stager(StagerConfig(32, 2, 12, rows="external"))
    with pytest.raises(RuntimeError, match="no CUDA device available"):
        cuda.DeviceRing(st)


def activations(rng, n, dim, dtype=np.float32, bos=False, big=True):
    """N(0, 1) noise with a few massive channels (1e3 - 1e5) and a huge-norm BOS row
    (``big=False``: massive channels up to 3e4, which every storage can hold)."""
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x[:, [1, dim // 3, dim - 2]] *= np.array([1e3, 2e4, 1e5] if big else [1e3, 5e3, 7e3], np.float32)
    if bos and n and big:
        x[0] *= np.float32(300.0)
    if np.dtype(dtype) == np.float16:  # float16 inputs stay finite (its range ends at 65504)
        x = np.clip(x, -6e4, 6e4)
    return x.astype(dtype)


def host(ring, d):
    """An owner's array as its bytes on the host."""
    return ring.to_numpy(d).view(np.uint8).reshape(-1)


def empty(ring, shape, dtype):
    """An uninitialized array in an owner's memory."""
    if isinstance(ring, HostRing):
        return np.empty(shape, dtype)
    return cuda.DeviceArray(shape, dtype)


class Launches:
    """Counts calls of the binding's encode / decode (one kernel launch each)."""

    NAMES = ("encode", "decode")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.NAMES:
            fn = getattr(cuda._cuda, name)
            monkeypatch.setattr(cuda._cuda, name, self._counted(fn))

    def _counted(self, fn):
        def call(*a):
            self.n += 1
            return fn(*a)
        return call

    def take(self):
        n, self.n = self.n, 0
        return n


class Pair:
    """A held Stager (the oracle) and an external Stager + its row owner, driven together."""

    def __init__(self, cfg, owner="device", seed=0, in_dtype=np.float32, big=False):
        self.held = Stager(cfg)
        self.ext = Stager(cfg.replace(rows="external"))
        self.ring = OWNERS[owner](self.ext)
        self.rng = np.random.default_rng(seed)
        self.dim = cfg.feature_dim
        self.in_dtype = in_dtype
        self.big = big

    def end(self, seq):
        return self.held.state(seq)["end"]

    def feed(self, seq, n):
        start = self.end(seq)
        rows = activations(self.rng, n, self.dim, self.in_dtype, bos=start == 0, big=self.big)
        pos = np.arange(start, start + n)
        self.held.process(seq, pos, rows)
        return self.ring.write(seq, pos, self.ring.upload(rows))

    def both(self, name, *args):
        a = getattr(self.held, name)(*args)
        b = getattr(self.ext, name)(*args)
        return a, b

    def round(self, seq, close="commit"):
        """draft on both; the ring's gather equals the held plan's rows byte for byte."""
        end = self.end(seq)
        hp, xp = self.both("draft", seq, end)
        assert hp.skip == xp.skip and np.array_equal(hp.slots, xp.slots)
        if hp.skip is None:
            got = self.ring.gather(xp)
            assert got.shape == hp.rows.shape and got.dtype == hp.rows.dtype
            assert np.array_equal(host(self.ring, got), hp.rows.view(np.uint8).reshape(-1))
            self.both("commit", seq) if close == "commit" else self.both("fail", seq, close)
        return hp, xp


#: Every (storage, stage dtype) pair, narrowing ones included (f32 rows staged as float16
#: are held to 65,520 by the device kernels as by a held Stager).
RING_CONFIGS = [(s, d) for s in STORAGES for d in ("float32", "float16", "bfloat16")]


@pytest.mark.parametrize("nonfinite", ["clamp", "error"])
@pytest.mark.parametrize(("storage", "stage_dtype"), RING_CONFIGS)
def test_device_ring_matches_held_mode(owner, storage, stage_dtype, nonfinite):
    """Massive activations (1e5 channels, a 300x BOS row) clamped to what the storage holds,
    or, under nonfinite="error", rows every storage can hold."""
    cfg = StagerConfig(64, 3, 24, max_seqs=3, storage=storage, stage_dtype=stage_dtype, nonfinite=nonfinite)
    p = Pair(cfg, owner, seed=STORAGES.index(storage), big=nonfinite == "clamp")
    p.feed(0, 900)  # a prompt far longer than the window: bounded ingest
    wrapped = False
    for i in range(220):  # ~900 rows through a 540-slot ring: wraps
        hp, xp = p.round(0, "commit" if i % 17 else "decode")
        wrapped |= bool(len(xp.slots) > 1 and np.any(np.diff(xp.slots) != 1))
        p.feed(0, 4)
        p.both("accept", 0, i % 4)
    assert wrapped
    p.both("rollback", 0, p.end(0) - 5)
    p.round(0)
    hm = p.held.fork(0, 1)
    xm = p.ring.fork(0, 1)
    assert np.array_equal(hm, xm)
    p.round(1)
    p.feed(1, 4)
    keep = p.end(1) - 6
    hm, xm = p.held.shift(1, keep, 2), p.ring.shift(1, keep, 2)
    assert np.array_equal(hm, xm) and len(xm) > 0
    p.round(1)
    # draft_many: one batch, one contiguous device array.
    p.feed(0, 4)
    p.feed(2, 30)
    hb, xb = p.both("draft_many", [0, 1, 2], [p.end(0), p.end(1), p.end(2)])
    got = p.ring.gather(xb)
    assert np.array_equal(host(p.ring, got), hb.rows.view(np.uint8).reshape(-1))
    assert got.shape == (len(hb.rows), 64)


@pytest.mark.parametrize("in_dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("storage", ["f16", "q8_0"])
def test_write_is_bit_exact_for_every_input_dtype(owner, storage, in_dtype):
    cfg = StagerConfig(64, 2, 20, storage=storage)
    p = Pair(cfg, owner, seed=3, in_dtype=in_dtype)
    slots = p.feed(0, 7)
    np.testing.assert_array_equal(slots, np.arange(7))
    enc = p.held.draft(0, 7).encoded_rows
    assert p.ring.read(slots).tobytes() == enc.tobytes()


@gpu
@pytest.mark.parametrize("nonfinite", ["error", "zero"])
def test_launches_per_call(monkeypatch, nonfinite):
    """write: <= 2 encode launches (one validation launch more under 'error');
    gather: <= 2 decode launches per sequence, also when the slots wrap."""
    cfg = StagerConfig(64, 3, 24, storage="q4_0", nonfinite=nonfinite, max_seqs=2)
    p = Pair(cfg, "device")
    launches = Launches(monkeypatch)
    p.feed(0, 30)  # 12 rows stay at slots 0..11 (W // 2)
    p.feed(0, 1)  # one more: rounds of 4 rows then straddle the ring's end
    assert launches.take() == 2
    worst_write = worst_gather = 0
    for _ in range(200):
        end = p.end(0)
        xp = p.ext.draft(0, end)
        hp = p.held.draft(0, end)
        launches.take()
        got = p.ring.gather(xp)
        worst_gather = max(worst_gather, launches.take())
        assert host(p.ring, got).tobytes() == hp.rows.view(np.uint8).reshape(-1).tobytes()
        p.both("commit", 0)
        p.feed(0, 4)
        worst_write = max(worst_write, launches.take())
        p.both("accept", 0, 3)
    assert worst_gather == 2  # the ring wrapped under a plan: two runs, two launches
    assert worst_write == (1 if nonfinite == "error" else 2)  # error: validate once, then copy


def test_nonfinite_rows_are_rejected_before_anything_changes(owner):
    cfg = StagerConfig(32, 2, 12)
    p = Pair(cfg, owner)
    p.feed(0, 5)
    state, stats = p.ext.state(0), p.ext.stats(0)
    before = p.ring.read(range(8))
    rows = activations(p.rng, 3, 32)
    rows[1, 7] = np.nan
    with pytest.raises(ValueError, match=r"row 1 \(position 6\) holds a non-finite value"):
        p.ring.write(0, [5, 6, 7], p.ring.upload(rows))
    assert p.ext.state(0) == state and p.ext.stats(0) == stats
    assert p.ring.read(range(8)).tobytes() == before.tobytes()
    # A prefill chunk longer than the staging buffer is validated in pieces.
    big = activations(p.rng, 1300, 32)
    big[1100, 0] = np.inf
    with pytest.raises(ValueError, match=r"row 1100 \(position 1105\)"):
        p.ring.write(0, np.arange(5, 1305), p.ring.upload(big))
    assert p.ext.state(0) == state
    # Under nonfinite="zero" the row is written with zeros, as the held core does.
    z = Pair(cfg.replace(nonfinite="zero"), owner)
    z.held.process(0, [0, 1, 2], rows)
    slots = z.ring.write(0, [0, 1, 2], z.ring.upload(rows))
    assert z.ring.read(slots).tobytes() == z.held.draft(0, 3).encoded_rows.tobytes()


def test_long_prefill_chunk_is_encoded_into_its_slots(owner):
    """More rows than the staging buffer holds: validated in pieces, then encoded straight
    into the slots; only the rows a later round can stage get one."""
    cfg = StagerConfig(32, 4, 900, storage="bf16")
    p = Pair(cfg, owner, seed=5)
    slots = p.feed(0, 1400)
    w = cfg.window  # the last W rows stay stageable
    assert (slots[: 1400 - w] == -1).all()
    np.testing.assert_array_equal(slots[1400 - w:], np.arange(w))
    hp, _ = p.round(0)
    assert hp.n_rows == cfg.w_keep


@pytest.mark.parametrize("storage", ["f32", "q8_0"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gather_in_another_dtype_equals_the_cpu_decoder(owner, storage, dtype):

    cfg = StagerConfig(64, 2, 16, storage=storage)
    p = Pair(cfg, owner, seed=11)
    p.feed(0, 9)
    hp, xp = p.both("draft", 0, 9)
    got = p.ring.gather(xp, dtype)
    want = formats.dequantize_rows(hp.encoded_rows, storage, 64, BF16 if dtype == "bfloat16" else dtype)
    assert got.shape == want.shape and host(p.ring, got).tobytes() == want.tobytes()
    out = empty(p.ring, want.shape, want.dtype)
    assert p.ring.gather(xp, dtype, out=out) is out and host(p.ring, out).tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="shape"):
        p.ring.gather(xp, dtype, out=empty(p.ring, (1, 64), want.dtype))


#: (storage, stage dtype) pairs whose stage dtype narrows the storage's own bounds.
NARROWING = [(s, d) for s, d in RING_CONFIGS
             if formats.encode_bounds(s, BF16 if d == "bfloat16" else d) != formats.encode_bounds(s)]


def test_narrowing_pairs_exist():
    assert ("f32", "float16") in NARROWING and ("q8_0", "float16") in NARROWING and ("f32", "bfloat16") in NARROWING
    assert ("f16", "float16") not in NARROWING


@pytest.mark.parametrize("nonfinite", ["error", "zero", "clamp", "clamp_f16"])
@pytest.mark.parametrize(("storage", "stage_dtype"), NARROWING)
def test_a_narrowing_stage_dtype_holds_device_rows_to_its_limit(owner, storage, stage_dtype, nonfinite):
    """Finite rows just below, at and above the narrowed limit (and far above the storage's
    own for f32): the ring rejects exactly what the held Stager rejects, and otherwise
    stores and stages its bytes, clamped or zeroed alike."""
    cfg = StagerConfig(64, 2, 16, storage=storage, stage_dtype=stage_dtype, nonfinite=nonfinite)
    b = formats.encode_bounds(storage, BF16 if stage_dtype == "bfloat16" else stage_dtype)
    p = Pair(cfg, owner, seed=21)
    p.feed(0, 6)
    below, at = np.float32(b.clamp_to), np.float32(b.limit)
    above = np.nextafter(at, np.float32(np.inf))
    far = np.float32(min(float(at) * 1.5, 3.4e38))
    rejected = 0
    for k, v in enumerate([below, -below, at, -above, far]):
        rows = activations(p.rng, 3, 64, big=False)
        rows[1, 5 + k] = v
        pos = np.arange(p.end(0), p.end(0) + 3)
        state, before = p.ext.state(0), p.ring.read(range(12))
        try:
            p.held.process(0, pos, rows)
        except ValueError:
            assert nonfinite == "error" and abs(v) >= at
            with pytest.raises(ValueError, match=r"row 1 .* overflows"):
                p.ring.write(0, pos, p.ring.upload(rows))
            assert p.ext.state(0) == state and p.ring.read(range(12)).tobytes() == before.tobytes()
            rejected += 1
            continue
        assert abs(v) < at or nonfinite != "error"
        p.ring.write(0, pos, p.ring.upload(rows))
        p.round(0)  # the staged rows: the held plan's, byte for byte (rows in stage_dtype)
        assert p.held.state(0) == p.ext.state(0)
    assert rejected == (3 if nonfinite == "error" else 0)


def test_errors_are_clear_and_change_nothing(owner):
    cfg = StagerConfig(32, 2, 12, max_seqs=2)
    with pytest.raises(ValueError, match="external-row mode"):
        OWNERS[owner](Stager(cfg))
    p = Pair(cfg, owner)
    other = Stager(cfg.replace(rows="external"))
    p.feed(0, 6)
    other.process(0, np.arange(6))
    with pytest.raises(ValueError, match="another Stager"):
        p.ring.gather(other.draft(0, 6))
    other.commit(0)
    hp, xp = p.both("draft", 0, 6)
    p.ring.gather(xp)
    with pytest.raises(StateError):
        p.ring.write(0, [6], p.ring.upload(activations(p.rng, 1, 32)))
    p.both("commit", 0)
    with pytest.raises(ValueError, match="no open round"):
        p.ring.gather(xp)
    # Wrong dtype, shape, host memory, positions: clear errors, nothing appended.
    state = p.ext.state(0)
    with pytest.raises(TypeError, match="dtype int32"):
        p.ring.write(0, [6], p.ring.upload(np.zeros((1, 32), np.int32)))
    with pytest.raises(ValueError, match=r"must be \(n, 32\)"):
        p.ring.write(0, [6], p.ring.upload(np.zeros((1, 31), np.float32)))
    with pytest.raises(TypeError, match="host memory"):  # each owner takes its own memory's arrays
        p.ring.write(0, [6], np.zeros((1, 32), np.float32) if owner == "device" else [[0.0] * 32])
    with pytest.raises(ValueError, match="continue at 6"):
        p.ring.write(0, [7], p.ring.upload(np.zeros((1, 32), np.float32)))
    with pytest.raises(ValueError, match="2 positions for 1 rows"):
        p.ring.write(0, [6, 7], p.ring.upload(np.zeros((1, 32), np.float32)))
    assert p.ext.state(0) == state
    # Moves: of another Stager, out of order, or not moves at all.
    p.feed(0, 2)
    p.held.fork(0, 1)
    first = p.ext.fork(0, 1)
    p.held.fork(0, 1)
    second = p.ext.fork(0, 1)
    with pytest.raises(ValueError, match="out of order: expected change #1"):
        p.ring.apply(second)
    p.ring.apply(first)
    with pytest.raises(ValueError, match="out of order"):
        p.ring.apply(first)  # twice
    other.process(1, np.arange(0, 3))
    with pytest.raises(ValueError, match="another Stager"):
        p.ring.apply(other.fork(1, 0))
    with pytest.raises(TypeError, match="moves"):
        p.ring.apply(np.asarray(second))
    p.ring.apply(second)
    p.round(1)


@pytest.mark.parametrize("storage", ["f32", "q4_0"])
def test_loop_with_external_rows_is_lossless(owner, storage):
    """The whole speculative loop (prefill chunks, rebases, injected drafter failures, two
    sequences planned with draft_many) with the rows only in the owner's table: the output is
    the target's greedy decoding, the drafter's incremental logits equal a from-scratch
    recompute, and every figure equals the held-mode run's."""
    from dspark_core.cli.simulate import simulate

    kw = dict(context=700, generate=120, block=4, window=64, storage=storage, seqs=2, feature_dim=64,
              prefill_chunk=256, fail_every=7, check=True, stager="core", modes=("windowed",))
    ext = simulate(rows="external", ring=owner, **kw)
    held = simulate(rows="held", **kw)
    assert ext["config"]["ring"] == owner
    assert ext["lossless"] and held["lossless"]
    e, h = ext["modes"]["windowed"], held["modes"]["windowed"]
    assert e["rebases"] > 0 and e["failures"] > 0 and e["recompute_checks"] > 0
    for k in ("generated_tokens", "drafter_rounds", "failures", "rebases", "restaged_rows", "acceptance",
              "peak_rows", "max_drafter_pos", "recompute_max_err"):
        assert e[k] == h[k], k


def test_tree_loop_with_external_rows_is_lossless(owner):
    """Rounds verified as draft trees with the rows only in the owner's table (write_tree, the
    path's copies applied by accept_path): lossless, every path equal to a linear verify, the
    staged rows equal to the rows the server gave (--check), every figure the held run's."""
    from dspark_core.cli.simulate import simulate

    kw = dict(context=700, generate=120, block=4, window=64, storage="bf16", seqs=2, feature_dim=64,
              prefill_chunk=256, check=True, stager="core", modes=("windowed",), tree=True)
    ext = simulate(rows="external", ring=owner, **kw)
    held = simulate(rows="held", **kw)
    assert ext["lossless"] and held["lossless"]
    e, h = ext["modes"]["windowed"], held["modes"]["windowed"]
    assert e["tree_rounds"] == e["tree_paths_linear"] == e["recompute_checks"] > 0 and e["rebases"] > 0
    for k in ("generated_tokens", "drafter_rounds", "rebases", "restaged_rows", "acceptance", "peak_rows",
              "accepted_histogram", "recompute_max_err"):
        assert e[k] == h[k], k


def test_simulate_rows_external_runs_without_a_device(capsys):
    """--rows external needs no GPU: without a device (or with --ring host) a HostRing keeps
    the rows, and the table says so; --ring device without one says why."""
    from dspark_core import cli

    assert cli.main(["simulate", "--context", "100", "--generate", "10", "--rows", "external", "--ring", "host"]) == 0
    assert "rows in host memory (external-row mode, HostRing)" in capsys.readouterr().out
    if cuda.available():
        pytest.skip("checks the no-device error; a device is present")
    assert cli.main(["simulate", "--context", "100", "--generate", "10", "--rows", "external", "-q"]) == 0
    assert "HostRing" in capsys.readouterr().out
    assert cli.main(["simulate", "--context", "100", "--generate", "10", "--rows", "external", "--ring", "device",
                     "-q"]) == 2
    assert "no CUDA device available" in capsys.readouterr().err


def test_snapshot_and_restore_move_a_sequence_between_rings(owner):
    """An external snapshot (bookkeeping) plus the ring's device copy of the rows restore the
    sequence on another ring: its next round stages what the held Stager stages."""
    cfg = StagerConfig(64, 3, 24, max_seqs=2, storage="q8_0")
    p = Pair(cfg, owner, seed=9)
    p.feed(0, 300)
    for _ in range(40):
        p.round(0)
        p.feed(0, 4)
        p.both("accept", 0, 2)
    data, rows = p.ring.snapshot(0)
    held_data = p.held.snapshot(0)
    other = Stager(cfg.replace(rows="external"))
    ring2 = OWNERS[owner](other)
    with pytest.raises(ValueError, match=r"rows must be uint8 \("):
        ring2.restore(1, data, p.ring.upload(np.zeros((1, 2), np.uint8)))
    with pytest.raises(ValueError, match="carries its rows"):
        ring2.restore(1, held_data, rows)
    assert other.state(1)["started"] is False
    slots = ring2.restore(1, data, rows)
    assert len(slots) == rows.shape[0]
    held2 = Stager(cfg)
    held2.restore(1, held_data)
    end = held2.state(1)["end"]
    hp, xp = held2.draft(1, end), other.draft(1, end)
    got = ring2.gather(xp)
    assert host(ring2, got).tobytes() == hp.rows.view(np.uint8).reshape(-1).tobytes()


def _ring_trial(owner, threads_call_the_ring):
    """A held oracle, an external Stager and its ring: sequence 0 holds 300 rows, 2 holds
    200, 4 holds 40; 5's snapshot and device rows are saved. Threads then fork, shift and
    restore overlapping sequences at once and draft an unrelated one."""
    cfg = StagerConfig(32, 4, 400, max_seqs=6, storage="q8_0")
    p = Pair(cfg, owner, seed=1)
    for seq, n in ((0, 300), (2, 200), (4, 40), (5, 120)):
        p.feed(seq, n)
    snap_x, rows_x = p.ring.snapshot(5)
    snap_h = p.held.snapshot(5)
    calls = [("shift", (0, 100, 50)), ("fork", (0, 1)), ("fork", (2, 3))]
    if threads_call_the_ring:
        calls.append(("restore", (2, snap_x, rows_x)))
    target = p.ring if threads_call_the_ring else p.ext
    gathered = []

    def draft_other():
        plan = p.ext.draft(4, 40)
        gathered.append(p.ring.to_numpy(p.ring.gather(plan)).tobytes())
        p.ext.commit(4)

    results = at_once([(getattr(target, name), args) for name, args in calls], draft_other)
    order = sorted(results, key=lambda k: results[k].serial)
    assert [results[k].serial for k in order] == list(range(1, len(calls) + 1))
    for k in order:
        name, args = calls[k]
        if not threads_call_the_ring:
            p.ring.apply(results[k])  # the moves the threads got, applied in serial order
        want = getattr(p.held, name)(*((2, snap_h) if name == "restore" else args))
        if name != "restore":
            assert np.array_equal(want, results[k])
    assert gathered == [p.held.draft(4, 40).rows.tobytes()]
    p.held.commit(4)
    for s in range(cfg.max_seqs):
        assert p.held.state(s) == p.ext.state(s)
        slots = p.ext.live_slots(s)
        rows = snapshot_format.unpack(p.held.snapshot(s), cfg.snapshot_fingerprint()).rows
        assert p.ring.read(slots).tobytes() == rows, s


@pytest.mark.parametrize("threads_call_the_ring", [True, False], ids=["ring-calls", "apply-after"])
def test_table_changes_from_several_threads_apply_in_serial_order(owner, threads_call_the_ring):
    """Concurrent fork / shift / restore: the core numbers them in the order they ran, the
    ring applies them in that order (its own calls from any thread, or moves applied later
    through apply), and the device table holds the held oracle's rows afterwards."""
    for _ in range(40):
        _ring_trial(owner, threads_call_the_ring)


def test_apply_refuses_views_copies_and_edits(owner):
    cfg = StagerConfig(32, 2, 64, max_seqs=2)
    p = Pair(cfg, owner)
    p.feed(0, 40)
    hm, xm = p.held.shift(0, 10, 3), p.ext.shift(0, 10, 3)
    assert len(xm) > 2 and np.array_equal(hm, xm)
    table = p.ring.read(range(80))
    for piece in (xm[:1], xm[::-1], xm.copy(), xm[1:]):
        with pytest.raises(ValueError, match="not the array the Stager returned"):
            p.ring.apply(piece)
    xm.flags.writeable = True  # an edit in place keeps the serial, not the issued bytes
    xm[0, 0] += 1
    with pytest.raises(ValueError, match="not the array the Stager returned"):
        p.ring.apply(xm)
    xm[0, 0] -= 1
    assert p.ring.read(range(80)).tobytes() == table.tobytes()  # nothing copied
    p.ring.apply(xm)
    p.round(0)
    # A table change the ring did not apply blocks the ring's own next one, before the Stager moves.
    p.held.fork(0, 1)
    pending = p.ext.fork(0, 1)
    state = p.ext.state(1)
    with pytest.raises(ValueError, match="apply the missing"):
        p.ring.fork(0, 1)
    assert p.ext.state(1) == state and p.ext.moves_issued == pending.serial
    p.ring.apply(pending)
    p.round(1)


def test_gather_refuses_a_plan_whose_round_has_closed(owner):
    """A plan of a closed round is refused even while a newer round of its sequence is open
    (its slots may hold other rows by now), and a batch plan likewise."""
    cfg = StagerConfig(32, 2, 12, max_seqs=2)
    p = Pair(cfg, owner)
    p.feed(0, 5)
    p.feed(1, 5)
    _, old = p.both("draft", 0, 5)
    p.both("commit", 0)
    for _ in range(120):
        p.round(0)
        p.feed(0, 3)
        p.both("accept", 0, 2)
    hp, now = p.both("draft", 0, p.end(0))
    assert now.round > old.round > 0
    with pytest.raises(ValueError, match=rf"of round {old.round}, and the sequence has another round open"):
        p.ring.gather(old)
    assert np.array_equal(host(p.ring, p.ring.gather(now)), hp.rows.view(np.uint8).reshape(-1))
    p.both("commit", 0)
    hb, xb = p.both("draft_many", [0, 1], [p.end(0), p.end(1)])
    p.ring.gather(xb)
    p.both("commit", 1)
    with pytest.raises(ValueError, match="sequence 1 is of round .* has no open round"):
        p.ring.gather(xb)
