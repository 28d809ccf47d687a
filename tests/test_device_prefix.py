"""A prefix store whose rows live with the ring owner: HostPrefixTable and cuda.PrefixTable.

Every test runs for both owners (the ``owner`` parameter): the host table
beside HostRings everywhere, the device table beside DeviceRings where a CUDA
device is usable (a real GPU, or in CI the DSPARK_CUDA=EMULATE build's
emulated device). The oracle is a held Stager and a held store fed the same
host rows: after a hit, ``ring.gather(plan)`` must equal the held plan's rows
byte for byte, round after round, for every storage; on the device,
publishes and hits copy rows device to device only; a block exported from
either table imports into a held store (and back). The moves are the ring's
table changes: they need their table (the right kind, store and storage),
apply once and in serial order, and a rejected call changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import at_once, massive_rows

from dspark_core import HostPrefixTable, HostRing, PrefixStore, Stager, StagerConfig, cuda, formats
from dspark_core.stager import snapshot_format
from dspark_core.stager.config import STORAGES
from dspark_core.prefix.hit import HIT, PUBLISH, PrefixMoves
from dspark_core.prefix.table_owner import PrefixTableOwner
from dspark_core.reference import ReferencePrefixStore, ReferenceStager
from test_device_ring import Launches as BindingCalls

gpu = pytest.mark.skipif(not cuda.available(), reason=f"no CUDA device: {cuda.unavailable_reason()}")

#: The table of each owner kind; the device's tests skip without a device.
TABLES = {"host": HostPrefixTable, "device": cuda.PrefixTable}
OWNER_PARAMS = ["host", pytest.param("device", marks=gpu)]


@pytest.fixture(params=OWNER_PARAMS)
def owner(request):
    """Which owner keeps the rows (every test runs for both)."""
    return request.param


def ring_of(owner: str, stager, **kw):
    """The ring owner of ``stager``'s rows of the ``owner`` kind."""
    return HostRing(stager, **kw) if owner == "host" else cuda.DeviceRing(stager, backend="dspark", **kw)


def owned(owner: str, cfg: StagerConfig):
    """An external-row Stager of ``cfg``, its ring, a store (blocks of 8) and the store's table."""
    ext = Stager(cfg)
    ring = ring_of(owner, ext)
    store = PrefixStore(cfg, 8, 1 << 20)
    return ext, ring, store, TABLES[owner](store, ring)


def rows_of(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """Activation-like rows (massive channels, a huge-norm BOS row) every storage holds."""
    return np.clip(massive_rows(np.random.default_rng(seed), n, dim, peak=3e4), -6e4, 6e4)


def keys_of(h: int, bt: int, tag: int = 0) -> list[int]:
    return [hash((tag, s, min(s + bt, h))) for s in range(0, h, bt)]


def snapshot(ring, table, store):
    """Everything a rejected call must leave as it was: both tables' bytes, the ring's applied
    serial, the Stager's issued one, the store's keys."""
    return (ring.to_numpy(ring.table).tobytes(), ring.to_numpy(table.table).tobytes(), ring._moves_applied,
            ring.stager.moves_issued, sorted(store.keys()))


@pytest.mark.parametrize("impl", ["core", "reference"])
@pytest.mark.parametrize("storage", STORAGES)
def test_hits_through_a_prefix_table_equal_held_rows(owner, storage, impl, monkeypatch):
    cfg = StagerConfig(64, 4, 96, max_seqs=3, storage=storage)
    bt, chunk = 16, 40
    Stg, Store = (Stager, PrefixStore) if impl == "core" else (ReferenceStager, ReferencePrefixStore)
    held, ext = Stager(cfg), Stg(cfg.replace(rows="external"))
    hstore = PrefixStore(cfg, bt, 1 << 22)
    xstore = Store(ext.config, bt, 1 << 22)
    ring = ring_of(owner, ext)
    table = TABLES[owner](xstore, ring)
    assert table.nbytes == xstore.table_rows * cfg.row_bytes
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
                moves = table.publish(ring, 0, keys[lo_b // bt: -(-hi_b // bt)], lo_b, hi_b)
                assert moves.direction == PUBLISH
        if owner == "device":  # a hit copies device rows only: no host round trip of a row
            monkeypatch.setattr(cuda._backend._cuda, "copy_to_host", lambda *a: pytest.fail("host copy in a hit"))
        a = hstore.hit(held, 1, keys, h)
        b = table.hit(ring, 1, keys, h)
        monkeypatch.undo()
        assert a.as_dict() == b.as_dict() and a.complete
        assert len(b.moves) and b.moves.direction == HIT
        assert ring._moves_applied == ext.moves_issued
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
            assert got.tobytes() == p.rows.tobytes(), (h, k)
            held.commit(1)
            ext.commit(1)
    assert hstore.keys() == xstore.keys()


def test_export_from_a_table_imports_anywhere(owner):
    """Blocks move between processes as bytes: a table's export equals a held store's, imports
    into a held store and into a fresh table (another process), and comes back unchanged."""
    cfg = StagerConfig(64, 4, 96, max_seqs=2, storage="q8_0")
    # Each owner its own rows: memory a table of the other owner's run freed cannot hold them already.
    seed = 10 * list(TABLES).index(owner)
    ext = Stager(cfg.replace(rows="external"))
    xstore = PrefixStore(ext.config, 8, 1 << 20)
    ring = ring_of(owner, ext)
    table = TABLES[owner](xstore, ring)
    rows = rows_of(32, 64, seed)
    ext.begin(0)
    ring.write(0, np.arange(32), ring.upload(rows))
    table.publish(ring, 0, [1, 2, 3, 4], 0, 32)
    held = PrefixStore(cfg, 8, 1 << 20)
    held.publish_rows([1, 2, 3, 4], 0, 32, rows)
    # Another process: a held store and an external one with its own table import the blocks.
    far_held = PrefixStore(cfg, 8, 1 << 20)
    far_ext = Stager(cfg.replace(rows="external"))
    far_store = PrefixStore(far_ext.config, 8, 1 << 20)
    far_ring = ring_of(owner, far_ext)
    far_table = TABLES[owner](far_store, far_ring)
    for k in (1, 2, 3, 4):
        data = table.export_block(k)
        assert data == held.export_block(k)
        far_held.import_block(data)
        assert far_held.export_block(k) == data
        slots = far_table.import_block(held.export_block(k))
        assert len(slots) == 8 and (slots >= 0).all()
        assert far_table.export_block(k) == data
        xstore.evict([k])
        table.import_block(data)
        assert table.export_block(k) == data
    # A hit through the far table stages the rows the publishing process wrote.
    far_table.hit(far_ring, 1, [1, 2, 3, 4], 32)
    assert far_ring.read(far_ext.live_slots(1)).tobytes() == ring.read(ext.live_slots(0)).tobytes()
    # A block the store already holds: nothing to write (every slot -1), the table unchanged.
    before = ring.to_numpy(table.table).tobytes()
    assert (table.import_block(held.export_block(3)) == -1).all()
    assert ring.to_numpy(table.table).tobytes() == before
    # Held -> table -> held: a block published elsewhere comes back as the same bytes.
    held.publish_rows([9], 32, 40, rows_of(8, 64, seed + 1))
    table.import_block(held.export_block(9))
    assert table.export_block(9) == held.export_block(9)
    # Damaged data is refused before anything changes.
    bad = bytearray(held.export_block(9))
    bad[-1] ^= 1
    xstore.evict([9])
    before = ring.to_numpy(table.table).tobytes()
    with pytest.raises(ValueError, match="checksum|CRC"):
        table.import_block(bytes(bad))
    assert 9 not in xstore and ring.to_numpy(table.table).tobytes() == before


def test_import_of_a_strided_buffer_writes_the_rows(owner):
    """A block handed over in a buffer that is not C-contiguous (a strided view): the store and the
    table take it together; a hit then stages the exported rows, not zeros (the table once re-read
    the buffer after the store had taken the block, raised TypeError, and left exact hits of
    empty rows that a second import did not repair)."""
    cfg = StagerConfig(64, 4, 96, max_seqs=2, storage="q8_0", rows="external")
    held = PrefixStore(cfg.replace(rows="held"), 8, 1 << 20)
    rows = rows_of(16, 64, 7)
    held.publish_rows([5, 6], 0, 16, rows)
    ext = Stager(cfg)
    store = PrefixStore(cfg, 8, 1 << 20)
    ring = ring_of(owner, ext)
    table = TABLES[owner](store, ring)
    for k in (5, 6):
        data = np.frombuffer(held.export_block(k), np.uint8)
        wide = np.zeros((len(data), 2), np.uint8)
        wide[:, 0] = data
        strided = wide[:, 0]
        assert not strided.flags.c_contiguous
        slots = table.import_block(strided)
        assert len(slots) == 8 and (slots >= 0).all()
        assert table.export_block(k) == held.export_block(k)
    hit = table.hit(ring, 0, [5, 6], 16)
    assert hit.exact
    want = formats.quantize_rows(rows, "q8_0")
    assert ring.read(ext.live_slots(0)).tobytes() == want.tobytes()


def test_a_long_prefill_chunk_publishes_every_block_through_the_table(owner):
    """External rows, a 2,048-token prefill chunk with W = 96: the ring keeps only the chunk's
    last rows, so ``table.publish(ring, ...)`` cannot publish its early blocks; the table's
    ``publish_rows`` takes them from the chunk's rows, and a hit stages what a held store's
    ``publish_rows`` gives a held Stager, byte for byte. Bad rows are refused first."""
    cfg = StagerConfig(64, 4, 96, max_seqs=2, storage="q4_0", rows="external")
    rows = rows_of(2048, 64, 11)
    keys = keys_of(2048, 8)
    ext, ring, store, table = owned(owner, cfg)
    ring.write(0, np.arange(2048), ring.upload(rows))
    with pytest.raises(ValueError, match="no longer held"):
        table.publish(ring, 0, keys, 0, 2048)
    bad = rows.copy()
    bad[5, 3] = np.nan
    with pytest.raises(ValueError, match=r"row 5 \(position 5\), column 3 .*nothing was published"):
        table.publish_rows(keys, 0, 2048, bad)
    with pytest.raises(ValueError, match=r"need 2048 rows, got 2047"):
        table.publish_rows(keys, 0, 2048, rows[1:])
    assert len(store) == 0
    slots = table.publish_rows(keys, 0, 2048, rows)
    assert len(slots) == 2048 and len(store) == 256
    held_cfg = cfg.replace(rows="held")
    held, hstore = Stager(held_cfg), PrefixStore(held_cfg, 8, 1 << 20)
    hstore.publish_rows(keys, 0, 2048, rows)
    for h in (2048, 1000, 40):
        got, want = table.hit(ring, 1, keys[: (h + 7) // 8], h), hstore.hit(held, 1, keys[: (h + 7) // 8], h)
        fields = ("n_tokens", "first_row", "replay_from", "rows", "origin", "exact", "blocks_found")
        assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
        assert got.replay_from == h
        assert ring.read(ext.live_slots(1)).tobytes() == snapshot_format.unpack(
            held.snapshot(1), held_cfg.snapshot_fingerprint()).rows


def test_batches_through_the_table_equal_single_calls(owner):
    """``table.publish_many`` / ``table.hit_many`` (one table change each) leave both tables and
    every sequence as ``table.publish`` / ``table.hit`` one sequence at a time."""
    cfg = StagerConfig(64, 4, 96, max_seqs=4, storage="q8_0", rows="external")
    pairs = [owned(owner, cfg), owned(owner, cfg)]
    for _ext, ring, _, _ in pairs:
        for s in (0, 1):
            ring.write(s, np.arange(40), ring.upload(rows_of(40, 64, 20 + s)))
    chains = [keys_of(40, 8, tag=1), keys_of(40, 8, tag=2)]
    (ea, ra, sa, ta), (eb, rb, sb, tb) = pairs
    for s in (0, 1):
        ta.publish(ra, s, chains[s], 0, 40)
    issued = eb.moves_issued
    tb.publish_many(rb, [0, 1], chains, [0, 0], [40, 40])
    assert eb.moves_issued == issued + 1
    single = [ta.hit(ra, 2, chains[1], 40), ta.hit(ra, 3, chains[0][:3], 24)]
    batch = tb.hit_many(rb, [2, 3], [chains[1], chains[0][:3]], [40, 24])
    assert [h.as_dict() for h in batch] == [h.as_dict() for h in single]
    for k in sa.keys():  # the blocks' rows (a device table's unused rows hold whatever was there)
        assert ta.export_block(k) == tb.export_block(k)
    assert sorted(sa.keys()) == sorted(sb.keys())
    for s in range(4):
        assert ea.state(s) == eb.state(s)
        assert ra.read(ea.live_slots(s)).tobytes() == rb.read(eb.live_slots(s)).tobytes()


class Copies(BindingCalls):
    """The backend's host downloads and device copies, counted (test_device_ring's counter)."""

    NAMES = ("copy_to_host", "copy_device")


@gpu
def test_a_device_table_moves_a_run_of_slots_in_one_copy(monkeypatch):
    """Export reads, and import writes, one copy per run of consecutive slots (a block's
    slots are one run unless the store's free rows are fragmented), not one per row."""
    cfg = StagerConfig(64, 4, 96, rows="external", storage="q8_0")
    ext, ring, store, table = owned("device", cfg)
    copies = Copies(monkeypatch)
    rows = rows_of(16, 64, 5)
    ext.begin(0)
    ring.write(0, np.arange(16), ring.upload(rows))
    table.publish(ring, 0, [1, 2], 0, 16)
    held = PrefixStore(cfg.replace(rows="held"), 8, 1 << 20)
    held.publish_rows([1, 2], 0, 16, rows)
    for k in (1, 2):
        copies.take()
        assert table.export_block(k) == held.export_block(k)
        s = [int(x) for x in store.block_slots(k)]
        assert copies.take() == 1 + sum(b != a + 1 for a, b in zip(s, s[1:]))
    # Slots in three runs (out of order between runs): three copies each way, rows in slot order.
    slots = np.array([40, 41, 42, 70, 71, 9], np.int64)
    enc = formats.quantize_rows(rows_of(6, 64, 6), "q8_0")
    copies.take()
    table._write_rows(slots, enc)
    assert copies.take() == 3
    assert (ring.to_numpy(table.table)[slots] == enc).all()
    copies.take()
    assert (table._read_rows(slots) == enc).all()
    assert copies.take() == 3


def test_prefix_moves_need_their_table(owner):
    cfg = StagerConfig(64, 4, 96, rows="external")
    ext, ring, store, table = owned(owner, cfg)
    other = TABLES[owner](PrefixStore(cfg, 8, 1 << 20), ring)  # another store's table
    ext.begin(0)
    ring.write(0, np.arange(8), ring.upload(rows_of(8, 64)))
    moves = store.publish(ext, 0, [7], 0, 8)
    before = snapshot(ring, table, store)
    with pytest.raises(ValueError, match="prefix_table"):
        ring.apply(moves)
    with pytest.raises(ValueError, match="prefix_table"):
        ring.apply(moves, prefix_table=other)
    with pytest.raises(TypeError, match="prefix_table must be"):
        ring.apply(moves, prefix_table=store)
    assert snapshot(ring, table, store) == before
    ring.apply(moves, prefix_table=table)
    assert ring._moves_applied == moves.serial == 1
    with pytest.raises(ValueError, match="out of order"):
        ring.apply(moves, prefix_table=table)
    with pytest.raises(ValueError, match="external-row mode"):
        TABLES[owner](PrefixStore(cfg.replace(rows="held"), 8, 1 << 20), ring)
    with pytest.raises(TypeError, match="ring must be a ring owner"):
        TABLES[owner](store, ext)


def test_a_table_of_another_storage_is_refused_and_changes_nothing(owner):
    """A ring of another storage than the store's (``storage=`` at construction) cannot take the
    store's rows: the table refuses it when built, and publish / hit / apply refuse it before the
    store, the Stager or a table changes."""
    cfg = StagerConfig(64, 4, 96, max_seqs=3, storage="q8_0", rows="external")
    ext, ring, store, table = owned(owner, cfg)
    ring.write(0, np.arange(16), ring.upload(rows_of(16, 64)))
    table.publish(ring, 0, [7, 8], 0, 16)
    wide = ring_of(owner, ext, storage="f16")  # the same Stager's slots (and serials), rows in f16
    with pytest.raises(ValueError, match="'f16' rows but the store's rows are 'q8_0'"):
        TABLES[owner](store, wide)
    before = snapshot(wide, table, store)
    issued = ext.moves_issued
    with pytest.raises(ValueError, match="one format"):
        table.publish(wide, 0, [9], 0, 8)
    with pytest.raises(ValueError, match="one format"):
        table.hit(wide, 1, [7, 8], 16)
    assert 9 not in store and ext.moves_issued == issued and ext.state(1)["started"] is False
    hit = store.hit(ext, 1, [7, 8], 16)
    with pytest.raises(ValueError, match="one format"):
        wide.apply(hit.moves, prefix_table=table)
    assert snapshot(wide, table, store)[:3] == before[:3]  # no row copied, nothing applied
    ring.apply(hit.moves, prefix_table=table)
    assert ring.read(ext.live_slots(1)).tobytes() == ring.read(ext.live_slots(0)).tobytes()


def test_moves_outside_the_tables_copy_nothing(owner):
    """Every move of a publish / hit is checked against both tables before a row moves (moves
    that did not come from the store, numbered as the next change)."""
    cfg = StagerConfig(64, 4, 96, max_seqs=2, rows="external")
    ext, ring, store, table = owned(owner, cfg)
    ring.write(0, np.arange(16), ring.upload(rows_of(16, 64)))
    table.publish(ring, 0, [7, 8], 0, 16)
    before = snapshot(ring, table, store)
    nxt = ring._moves_applied + 1
    for direction, bad in ((PUBLISH, [0, table.rows - 2, 3]), (PUBLISH, [ring.rows - 1, 0, 2]),
                           (HIT, [table.rows - 2, 0, 3]), (HIT, [0, ring.rows - 1, 2]), (HIT, [0, -1, 1]),
                           (PUBLISH, [-1, 0, 1]), (PUBLISH, [0, 0, 0])):
        moves = PrefixMoves.wrap_prefix(np.array([[0, 8, 1], bad]), ext, nxt, direction, store)
        with pytest.raises(ValueError, match=r"move \[.*\] is outside the tables"):
            ring.apply(moves, prefix_table=table)
        assert snapshot(ring, table, store) == before, (direction, bad)


class _OtherTable(PrefixTableOwner):
    """A third kind of table (a server's own owner), with its ring kind: it must not mix with the others."""

    def __init__(self, store, ring):
        super().__init__(store, ring)
        self.table = np.zeros((self.rows, self.row_bytes), np.uint8)


class _OtherRing(HostRing):
    _prefix_table_type = _OtherTable


def test_a_table_pairs_with_its_kind_of_ring_anywhere():
    """Each ring kind copies prefix rows with its own table kind (a TypeError otherwise, before
    the store or a table changes), shown with a third kind beside HostRing's."""
    cfg = StagerConfig(64, 4, 96, max_seqs=2, rows="external")
    ext = Stager(cfg)
    host, other_ring = HostRing(ext), _OtherRing(ext)
    store = PrefixStore(cfg, 8, 1 << 20)
    with pytest.raises(TypeError, match="a HostRing copies prefix rows with a HostPrefixTable, not a _OtherTable"):
        _OtherTable(store, host)
    with pytest.raises(TypeError, match="a _OtherRing copies prefix rows with a _OtherTable, not a HostPrefixTable"):
        HostPrefixTable(store, other_ring)
    htable, otable = HostPrefixTable(store, host), _OtherTable(store, other_ring)
    host.write(0, np.arange(8), rows_of(8, 64))
    before = snapshot(host, htable, store)
    with pytest.raises(TypeError, match="not a _OtherTable"):
        otable.publish(host, 0, [7], 0, 8)
    with pytest.raises(TypeError, match="not a _OtherTable"):
        otable.hit(host, 1, [7], 8)
    assert snapshot(host, htable, store) == before
    moves = store.publish(ext, 0, [7], 0, 8)
    with pytest.raises(TypeError, match="not a _OtherTable"):
        host.apply(moves, prefix_table=otable)
    assert host._moves_applied == 0 and not otable.table.any() and not htable.table.any()
    host.apply(moves, prefix_table=htable)
    assert htable.table.any()


@gpu
@pytest.mark.skipif(cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_device_table_refuses_a_ring_on_another_device():
    cfg = StagerConfig(64, 4, 96, max_seqs=2, rows="external")
    ext = Stager(cfg)
    ring0 = cuda.DeviceRing(ext, backend="dspark", device=0)
    store = PrefixStore(cfg, 8, 1 << 20)
    table = cuda.PrefixTable(store, ring0)
    ring0.write(0, np.arange(8), ring0.upload(rows_of(8, 64)))
    ring1 = cuda.DeviceRing(ext, backend="dspark", device=1)
    with pytest.raises(ValueError, match="lives on device 0, the ring on device 1"):
        table.publish(ring1, 0, [7], 0, 8)
    assert 7 not in store and ext.moves_issued == 0
    moves = store.publish(ext, 0, [7], 0, 8)
    with pytest.raises(ValueError, match="lives on device 0, the ring on device 1"):
        ring1.apply(moves, prefix_table=table)
    assert ring1._moves_applied == 0
    ring0.apply(moves, prefix_table=table)


@gpu
def test_a_table_pairs_with_its_kind_of_ring():
    """A host table beside a DeviceRing, or a device table beside a HostRing, is a TypeError
    before anything changes."""
    cfg = StagerConfig(64, 4, 96, max_seqs=2, rows="external")
    ext = Stager(cfg)
    host, dev = HostRing(ext), cuda.DeviceRing(ext, backend="dspark")
    store = PrefixStore(cfg, 8, 1 << 20)
    with pytest.raises(TypeError, match="a DeviceRing copies prefix rows with a PrefixTable, not a HostPrefixTable"):
        HostPrefixTable(store, dev)
    with pytest.raises(TypeError, match="a HostRing copies prefix rows with a HostPrefixTable, not a PrefixTable"):
        cuda.PrefixTable(store, host)
    htable, dtable = HostPrefixTable(store, host), cuda.PrefixTable(store, dev)
    host.write(0, np.arange(8), rows_of(8, 64))
    with pytest.raises(TypeError, match="HostPrefixTable"):
        dtable.publish(host, 0, [7], 0, 8)
    assert 7 not in store and ext.moves_issued == 0
    moves = store.publish(ext, 0, [7], 0, 8)
    with pytest.raises(TypeError, match="HostPrefixTable"):
        host.apply(moves, prefix_table=dtable)
    with pytest.raises(TypeError, match="PrefixTable"):
        dev.apply(moves, prefix_table=htable)
    assert host._moves_applied == dev._moves_applied == 0
    host.apply(moves, prefix_table=htable)


def test_a_view_of_prefix_moves_is_refused_and_forks_interleave(owner):
    """Prefix moves are the ring's table changes like a fork's: applied once, in serial order, only
    as the store returned them."""
    cfg = StagerConfig(64, 4, 96, max_seqs=3, rows="external")
    ext, ring, store, table = owned(owner, cfg)
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
    with pytest.raises(ValueError, match="missing"):
        table.hit(ring, 1, [7, 8], 16)
    assert 9 not in store and ext.moves_issued == 3
    ring.apply(hit.moves, prefix_table=table)
    assert ring.read(ext.live_slots(2)).tobytes() == ring.read(ext.live_slots(0)).tobytes()


def test_threads_publish_hit_and_fork_through_one_ring(owner):
    """Four threads change one ring's table at once (a fork, a shift, a publish and a hit through
    the table): the ring applies everything in serial order, and every sequence's rows and every
    block equal a held Stager's and store's fed the same rows."""
    cfg = StagerConfig(64, 4, 96, max_seqs=5, storage="q8_0")
    rows = [rows_of(80, 64, seed) for seed in range(3)]
    for trial in range(6):
        held, ext = Stager(cfg), Stager(cfg.replace(rows="external"))
        hstore, xstore = PrefixStore(cfg, 8, 1 << 22), PrefixStore(ext.config, 8, 1 << 22)
        ring = ring_of(owner, ext)
        table = TABLES[owner](xstore, ring)
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


def test_publish_rows_takes_every_row_dtype(owner):
    """float32, float16 and bfloat16 rows (bfloat16 also as uint16 bits with in_dtype) publish the
    bytes a held store's publish_rows of the same rows holds; other dtypes are a TypeError."""
    import ml_dtypes

    cfg = StagerConfig(64, 4, 96, max_seqs=2, storage="bf16", rows="external")
    rows = rows_of(16, 64, 4)
    held = PrefixStore(cfg.replace(rows="held"), 8, 1 << 20)
    for tag, dtype in enumerate((np.float32, np.float16, ml_dtypes.bfloat16, "bits")):
        _, ring, store, table = owned(owner, cfg)
        x = rows.astype(ml_dtypes.bfloat16).view(np.uint16) if dtype == "bits" else rows.astype(dtype)
        table.publish_rows(keys_of(16, 8, tag), 0, 16, x, in_dtype="bfloat16" if dtype == "bits" else None)
        held.publish_rows(keys_of(16, 8, tag), 0, 16, x.view(ml_dtypes.bfloat16) if dtype == "bits" else x)
        for k in keys_of(16, 8, tag):
            assert table.export_block(k) == held.export_block(k)
    with pytest.raises(TypeError, match="rows dtype float64 is not supported"):
        table.publish_rows(keys_of(16, 8, 9), 0, 16, rows.astype(np.float64))
