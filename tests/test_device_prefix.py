"""A prefix store whose rows live on the device (PrefixTable), next to DeviceRings.

Runs where a CUDA device is usable: a real GPU, or (in CI) the
DSPARK_CUDA=EMULATE build's emulated device. The oracle is a held Stager and
a held store fed the same host rows: after a hit, ``ring.gather(plan)`` must
equal the held plan's rows byte for byte, round after round, for every
storage; publishes and hits copy rows device to device only; a block
exported from the device table imports into a held store (and back).
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_core import PrefixStore, Stager, StagerConfig, cuda
from dspark_core.config import STORAGES

gpu = pytest.mark.skipif(not cuda.available(), reason=f"no CUDA device: {cuda.unavailable_reason()}")


def rows_of(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x[:, [1, dim // 3]] *= np.array([1e3, 7e3], np.float32)
    return x


def keys_of(h: int, bt: int, tag: int = 0) -> list[int]:
    return [hash((tag, s, min(s + bt, h))) for s in range(0, h, bt)]


@gpu
@pytest.mark.parametrize("storage", STORAGES)
def test_hits_through_a_prefix_table_equal_held_rows(storage, monkeypatch):
    cfg = StagerConfig(64, 4, 96, max_seqs=3, storage=storage)
    bt, chunk = 16, 40
    held, ext = Stager(cfg), Stager(cfg.replace(rows="external"))
    hstore = PrefixStore(cfg, bt, 1 << 22)
    xstore = PrefixStore(ext.config, bt, 1 << 22)
    ring = cuda.DeviceRing(ext, backend="dspark")
    table = cuda.PrefixTable(xstore, ring)
    rows = rows_of(400, 64)
    for h in (40, 90, 300):  # below W - B, above it, and far above
        keys = keys_of(h, bt)
        held.begin(0)
        ext.begin(0)
        for at in range(0, h, chunk):
            hi = min(h, at + chunk)
            held.process(0, np.arange(at, hi), rows[at:hi])
            ring.write(0, np.arange(at, hi), ring.upload(rows[at:hi]))
            lo_b, hi_b = at // bt * bt, (hi if hi == h else hi // bt * bt)
            if hi_b > lo_b:
                hstore.publish(held, 0, keys[lo_b // bt: -(-hi_b // bt)], lo_b, hi_b)
                table.publish(ring, 0, keys[lo_b // bt: -(-hi_b // bt)], lo_b, hi_b)
        # A hit copies device rows only: no host round trip of a row.
        monkeypatch.setattr(cuda._backend._cuda, "copy_to_host", lambda *a: pytest.fail("host copy in a hit"))
        a = hstore.hit(held, 1, keys, h)
        b = table.hit(ring, 1, keys, h)
        monkeypatch.undo()
        assert a.as_dict() == b.as_dict() and a.complete
        assert len(b.moves) and b.moves.direction == "hit"
        at = h
        for k in range(6):
            n = 3 if k == 0 else 5
            held.process(1, np.arange(at, at + n), rows[at:at + n])
            ring.write(1, np.arange(at, at + n), ring.upload(rows[at:at + n]))
            if k:
                held.accept(1, 2)
                ext.accept(1, 2)
            at = held.state(1)["end"]
            p, q = held.draft(1, at), ext.draft(1, at)
            assert (p.pos_base, p.rebase, p.n_rows) == (q.pos_base, q.rebase, q.n_rows)
            got = ring.to_numpy(ring.gather(q))
            assert got.tobytes() == p.rows.tobytes()
            held.commit(1)
            ext.commit(1)
    assert hstore.keys() == xstore.keys()


@gpu
def test_export_from_the_device_imports_anywhere():
    cfg = StagerConfig(64, 4, 96, max_seqs=2, storage="q8_0")
    ext = Stager(cfg.replace(rows="external"))
    xstore = PrefixStore(ext.config, 8, 1 << 20)
    ring = cuda.DeviceRing(ext, backend="dspark")
    table = cuda.PrefixTable(xstore, ring)
    rows = rows_of(32, 64)
    ext.begin(0)
    ring.write(0, np.arange(32), ring.upload(rows))
    table.publish(ring, 0, [1, 2, 3, 4], 0, 32)
    held = PrefixStore(cfg, 8, 1 << 20)
    held.publish_rows([1, 2, 3, 4], 0, 32, rows)
    for k in (1, 2, 3, 4):
        data = table.export_block(k)
        assert data == held.export_block(k)
        xstore.evict([k])
        table.import_block(data)
    assert table.export_block(3) == held.export_block(3)


@gpu
def test_prefix_moves_need_their_table():
    cfg = StagerConfig(64, 4, 96, rows="external")
    ext = Stager(cfg)
    ring = cuda.DeviceRing(ext, backend="dspark")
    store = PrefixStore(cfg, 8, 1 << 20)
    table = cuda.PrefixTable(store, ring)
    ext.begin(0)
    ring.write(0, np.arange(8), ring.upload(rows_of(8, 64)))
    moves = store.publish(ext, 0, [7], 0, 8)
    with pytest.raises(ValueError, match="prefix_table"):
        ring.apply(moves)
    ring.apply(moves, prefix_table=table)
    with pytest.raises(ValueError, match="out of order"):
        ring.apply(moves, prefix_table=table)
    with pytest.raises(ValueError, match="external-row mode"):
        cuda.PrefixTable(PrefixStore(cfg.replace(rows="held"), 8, 1 << 20), ring)


@gpu
def test_a_view_of_prefix_moves_is_refused_and_forks_interleave():
    """Prefix moves are the ring's table changes like a fork's: applied once, in serial order, only
    as the store returned them."""
    cfg = StagerConfig(64, 4, 96, max_seqs=3, rows="external")
    ext = Stager(cfg)
    ring = cuda.DeviceRing(ext, backend="dspark")
    store = PrefixStore(cfg, 8, 1 << 20)
    table = cuda.PrefixTable(store, ring)
    ring.write(0, np.arange(16), ring.upload(rows_of(16, 64)))
    fork = ext.fork(0, 1)
    moves = store.publish(ext, 0, [7, 8], 0, 16)
    assert (fork.serial, moves.serial) == (1, 2)
    with pytest.raises(ValueError, match="out of order"):
        ring.apply(moves, prefix_table=table)
    ring.apply(fork)
    with pytest.raises(ValueError, match="not the array the Stager returned"):
        ring.apply(moves[:1], prefix_table=table)
    ring.apply(moves, prefix_table=table)
    hit = store.hit(ext, 2, [7, 8], 16)
    with pytest.raises(ValueError, match="missing"):
        table.publish(ring, 1, [9], 0, 8)  # the ring must first apply the hit: nothing changed
    assert 9 not in store and ext.moves_issued == 3
    ring.apply(hit.moves, prefix_table=table)
    assert ring.read(ext.live_slots(2)).tobytes() == ring.read(ext.live_slots(0)).tobytes()


@gpu
def test_threads_publish_hit_and_fork_through_one_ring():
    """Four threads change one ring's table at once (a fork, a shift, a publish and a hit through
    the PrefixTable): the ring applies everything in serial order, and every sequence's rows and
    every block equal a held Stager's and store's fed the same rows."""
    from conftest import at_once

    from dspark_core import snapshot_format

    cfg = StagerConfig(64, 4, 96, max_seqs=5, storage="q8_0")
    rows = [rows_of(80, 64, seed) for seed in range(3)]
    for trial in range(6):
        held, ext = Stager(cfg), Stager(cfg.replace(rows="external"))
        hstore, xstore = PrefixStore(cfg, 8, 1 << 22), PrefixStore(ext.config, 8, 1 << 22)
        ring = cuda.DeviceRing(ext, backend="dspark")
        table = cuda.PrefixTable(xstore, ring)
        for seq, r, n in ((0, rows[0], 80), (3, rows[1], 48), (4, rows[2], 40)):
            held.process(seq, np.arange(n), r[:n])
            ring.write(seq, np.arange(n), ring.upload(r[:n]))
        hstore.publish(held, 0, keys_of(80, 8), 0, 80)
        table.publish(ring, 0, keys_of(80, 8), 0, 80)
        calls = [
            (ring.fork, (0, 1)),
            (table.hit, (ring, 2, keys_of(80, 8), 80)),
            (table.publish, (ring, 3, keys_of(48, 8, tag=1), 0, 48)),
            (ring.shift, (4, 8, 16)),
        ]
        if trial % 2:
            calls.reverse()
        at_once(calls)
        assert ring._moves_applied == ext.moves_issued == 5
        held.fork(0, 1)
        hstore.hit(held, 2, keys_of(80, 8), 80)
        hstore.publish(held, 3, keys_of(48, 8, tag=1), 0, 48)
        held.shift(4, 8, 16)
        for s in range(cfg.max_seqs):
            want = snapshot_format.unpack(held.snapshot(s), cfg.snapshot_fingerprint(), STORAGES).rows
            assert ring.read(ext.live_slots(s)).tobytes() == want, (trial, s)
        assert sorted(xstore.keys()) == sorted(hstore.keys())
        for k in xstore.keys():
            assert table.export_block(k) == hstore.export_block(k), trial
