"""Prefix-store moves are table changes of the Stager, numbered with its forks, shifts and restores.

External-row mode: a publish copies ring rows into the store's table and a
hit copies them back, and the Stager numbers those moves (``serial``) from
the same counter as every other change of its table, under the lock of the
operation, so an owner applies every change in serial order (what
``DeviceRing.apply`` requires). Only the array the store returned is
applicable.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import at_once, massive_rows

from dspark_core import PrefixStore, Stager, StagerConfig
from dspark_core.stager import snapshot_format
from dspark_core.stager.config import STORAGES
from dspark_core.formats import quantize_rows
from dspark_core.prefix.hit import HIT, PUBLISH
from dspark_core.reference import ReferencePrefixStore, ReferenceStager

CFG = StagerConfig(32, 4, 96, max_seqs=6, storage="q8_0")
BT = 8
UNWRITTEN = 0xA5


def rows_for(seed: int, n: int) -> np.ndarray:
    return np.clip(massive_rows(np.random.default_rng(seed), n, CFG.feature_dim, peak=3e4), -6e4, 6e4)


def encoded(rows: np.ndarray) -> np.ndarray:
    enc = quantize_rows(rows, CFG.storage, nonfinite="error")
    return np.ascontiguousarray(enc).view(np.uint8).reshape(len(rows), CFG.row_bytes)


def keys(tag: int, lo: int, hi: int) -> list[int]:
    return [tag * 10_000 + s for s in range(lo, hi, BT)]


class Owner:
    """An external-row Stager and store with the owner's mirror tables, and a held twin (the oracle)."""

    def __init__(self, Stg=Stager, Store=PrefixStore, cfg: StagerConfig = CFG) -> None:
        self.cfg = cfg  # CFG's rows (feature_dim, storage); the window may differ
        self.held, self.ext = Stg(cfg), Stg(cfg.replace(rows="external"))
        self.hstore = Store(cfg, BT, 1 << 22)
        self.xstore = Store(cfg.replace(rows="external"), BT, 1 << 22)
        self.ring = np.full((cfg.max_seqs * self.ext.ring_rows, cfg.row_bytes), UNWRITTEN, np.uint8)
        self.table = np.full((self.xstore.table_rows, cfg.row_bytes), UNWRITTEN, np.uint8)

    def feed(self, seq: int, rows: np.ndarray, lo: int = 0) -> np.ndarray:
        """Both Stagers process the rows; returns the external one's slots."""
        pos = np.arange(lo, lo + len(rows))
        self.held.process(seq, pos, rows)
        slots = self.ext.process(seq, pos)
        live = slots >= 0
        self.ring[slots[live]] = encoded(rows)[live]
        return slots

    def apply(self, change) -> None:
        """One table change, as an owner applies it: between the ring and the store's table."""
        moves = change.moves if hasattr(change, "moves") else change
        direction = getattr(moves, "direction", "")
        src, dst = {PUBLISH: (self.ring, self.table), HIT: (self.table, self.ring)}.get(direction,
                                                                                          (self.ring, self.ring))
        for s, d, n in moves.tolist():
            dst[d:d + n] = src[s:s + n].copy()

    def check(self) -> None:
        """Every sequence's live rows and every block's rows are the held twin's."""
        for s in range(self.cfg.max_seqs):
            assert self.held.state(s) == self.ext.state(s), s
            rows = snapshot_format.unpack(self.held.snapshot(s), self.cfg.snapshot_fingerprint(), STORAGES).rows
            assert self.ring[self.ext.live_slots(s)].tobytes() == rows, s
        assert self.hstore.keys() == self.xstore.keys()
        for k in self.xstore.keys():
            slots = self.xstore.block_slots(k)
            assert self.xstore.export_block(k, self.table[slots]) == self.hstore.export_block(k)


@pytest.mark.parametrize("impl", [(Stager, PrefixStore), (ReferenceStager, ReferencePrefixStore)],
                         ids=["core", "reference"])
def test_publish_and_hit_moves_take_the_next_serial(impl):
    o = Owner(*impl)
    a = rows_for(1, 80)
    o.feed(0, a)
    f = o.ext.fork(0, 1)
    p = o.xstore.publish(o.ext, 0, keys(1, 0, 80), 0, 80)
    o.hstore.publish(o.held, 0, keys(1, 0, 80), 0, 80)
    h = o.xstore.hit(o.ext, 2, keys(1, 0, 80), 80)
    o.hstore.hit(o.held, 2, keys(1, 0, 80), 80)
    s = o.ext.shift(1, 8, 8)
    assert [f.serial, p.serial, h.moves.serial, s.serial] == [1, 2, 3, 4] and o.ext.moves_issued == 4
    assert p.source is o.ext and p.store is o.xstore and p.direction == PUBLISH
    assert h.moves.source is o.ext and h.moves.store is o.xstore and h.moves.direction == HIT
    assert p.applicable() and h.moves.applicable()
    for piece in (p[:1], p.copy(), h.moves[::-1], np.asarray(h.moves).view(type(h.moves))):
        assert not piece.applicable() and piece.serial == 0 and piece.source is None
    # Nothing to copy: no serial (held mode's publish and hit, an empty hit, a republish).
    assert o.xstore.hit(o.ext, 3, [], 0).moves.serial == 0
    assert o.xstore.publish(o.ext, 0, keys(1, 0, 8), 0, 8).serial == 0
    o.hstore.publish(o.held, 0, keys(1, 0, 8), 0, 8)
    assert o.hstore.publish(o.held, 0, keys(2, 0, 80), 0, 80).serial == 0 and o.held.moves_issued == 0
    assert o.ext.moves_issued == 4
    o.xstore.evict(keys(2, 0, 80))  # held only: keep the two stores alike
    o.hstore.evict(keys(2, 0, 80))
    o.held.fork(0, 1)
    o.held.shift(1, 8, 8)
    for change in (f, p, h, s):
        o.apply(change)
    o.check()


@pytest.mark.parametrize("impl", [(Stager, PrefixStore), (ReferenceStager, ReferencePrefixStore)],
                         ids=["core", "reference"])
def test_a_published_block_that_straddles_the_end_of_the_ring(impl):
    """W = 64, B = 4, a sequence fed to position 600 in verify-sized chunks: the block of
    positions 576..584 sits in the ring's last and first slots, so its publish is two runs of
    moves, each to its own store slots (the second once landed on the first's slots)."""
    o = Owner(*impl, cfg=CFG.replace(window=64))
    slot_of: dict[int, int] = {}
    for lo in range(0, 600, 5):
        slots = o.feed(0, rows_for(lo, 5), lo)
        slot_of.update({lo + i: int(x) for i, x in enumerate(slots)})
    block = [slot_of[p] for p in range(576, 584)]
    assert block != list(range(block[0], block[0] + 8))  # it wraps: two runs
    for lo, hi in ((568, 576), (576, 584), (584, 592)):
        o.apply(o.xstore.publish(o.ext, 0, keys(3, lo, hi), lo, hi))
        o.hstore.publish(o.held, 0, keys(3, lo, hi), lo, hi)
    o.check()


def _trial(trial: int) -> None:
    """Four threads change the external table at once: a fork, a shift, a publish and a hit (of
    blocks published before). Applied in serial order, and replayed in serial order on the held
    twin, every sequence's rows and every block's rows agree."""
    o = Owner()
    a, b, c = rows_for(trial, 80), rows_for(trial + 1, 48), rows_for(trial + 2, 40)
    o.feed(0, a)
    o.apply(o.xstore.publish(o.ext, 0, keys(1, 0, 80), 0, 80))
    o.hstore.publish(o.held, 0, keys(1, 0, 80), 0, 80)
    o.feed(2, b)
    o.feed(4, c)
    calls = [
        ("fork", lambda st, store: st.fork(0, 1)),
        ("publish", lambda st, store: store.publish(st, 2, keys(2, 0, 48), 0, 48)),
        ("hit", lambda st, store: store.hit(st, 3, keys(1, 0, 80), 80)),
        ("shift", lambda st, store: st.shift(4, 8, 16)),
    ]
    if trial % 2:
        calls.reverse()
    issued = o.ext.moves_issued
    results = at_once([(fn, (o.ext, o.xstore)) for _, fn in calls])
    serial = {k: (r.moves if hasattr(r, "moves") else r).serial for k, r in results.items()}
    order = sorted(results, key=serial.__getitem__)
    assert [serial[k] for k in order] == list(range(issued + 1, issued + 5)) and o.ext.moves_issued == issued + 4
    for k in order:
        calls[k][1](o.held, o.hstore)
        o.apply(results[k])
    o.check()


def test_concurrent_prefix_moves_are_numbered_in_the_order_they_happened():
    for trial in range(40):
        _trial(trial)
