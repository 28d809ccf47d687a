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
