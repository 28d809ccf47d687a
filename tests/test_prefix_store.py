"""The prefix store's promises, one by one (the state machine compares core and reference at large).

* After a hit, every round equals a full prefill's: plan and staged bytes,
  from the first round on, for every storage, above and below ``W - B``,
  for the core and the reference.
* A miss names the cheapest replay: never more than ``K`` positions, exactly
  ``n_tokens`` when nothing is missing, and a short prompt never replays more
  than ``K`` either.
* The keep rule; memory never exceeds the budget; LRU order.
* Bad input gets a clear error and changes nothing.
* Keys: ints are their 8 little-endian bytes; arrays work.
* Several threads on two Stagers sharing one store.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from dspark_core import ConfigError, PrefixStore, StateError, Stager, StagerConfig
from dspark_core._ext._row_format import PREFIX_HIT_FIELDS, PREFIX_STATS_FIELDS
from dspark_core.stager.config import STORAGES
from dspark_core.prefix.keys import as_key, as_key_chain
from dspark_core.reference import ReferencePrefixStore, ReferenceStager
from conftest import flipping, massive_rows

IMPLS = [(Stager, PrefixStore), (ReferenceStager, ReferencePrefixStore)]
IDS = ["core", "reference"]


def rows_of(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """Activation-like rows that every storage and stage dtype carries."""
    return np.clip(massive_rows(np.random.default_rng(seed), n, dim, peak=3e4), -6e4, 6e4)


def chain(h: int, bt: int, tag: int = 0) -> list[int]:
    """Int keys of the blocks of [0, h): distinct per (tag, block, end)."""
    return [hash((tag, s, min(s + bt, h))) for s in range(0, h, bt)]


def prefill(st, store, seq: int, rows: np.ndarray, bt: int, chunk: int, tag: int = 0) -> None:
    """A request as a server runs it: prefill in chunks, publish each block once complete."""
    n = len(rows)
    keys = chain(n, bt, tag)
    st.begin(seq)
    for at in range(0, n, chunk):
        hi = min(n, at + chunk)
        st.process(seq, np.arange(at, hi), rows[at:hi])
        lo_b, hi_b = at // bt * bt, (hi if hi == n else hi // bt * bt)
        if hi_b > lo_b:
            store.publish(st, seq, keys[lo_b // bt: -(-hi_b // bt)], lo_b, hi_b)


def same_plan(a, b) -> None:
    assert (a.skip, a.start, a.rebase, a.clear_cache, a.crop_from, a.pos_base) == (
        b.skip, b.start, b.rebase, b.clear_cache, b.crop_from, b.pos_base)
    assert np.array_equal(a.positions, b.positions) and np.array_equal(a.block_positions, b.block_positions)
    assert a.encoded_rows.tobytes() == b.encoded_rows.tobytes()
    assert a.rows.tobytes() == b.rows.tobytes()


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
@settings(max_examples=40, deadline=None)
@given(
    storage=hs.sampled_from(STORAGES),
    block=hs.integers(1, 6),
    extra=hs.integers(1, 60),
    bt=hs.sampled_from([1, 4, 16, 64, 1000]),
    h=hs.integers(1, 400),
    new=hs.integers(1, 20),
    chunk=hs.integers(1, 90),
    stage=hs.sampled_from(["float32", "bfloat16"]),
    accepts=hs.lists(hs.integers(0, 6), min_size=1, max_size=12),
)
def test_rounds_after_a_hit_equal_a_full_prefill(impl, storage, block, extra, bt, h, new, chunk, stage, accepts):
    Stg, Store = impl
    cfg = StagerConfig(64, block, 2 * block + extra, max_seqs=3, storage=storage, stage_dtype=stage)
    rows = rows_of(h + new + 12 * (block + 1), 64)
    store = Store(cfg, bt, 1 << 24)
    pub, full, hit = Stg(cfg), Stg(cfg), Stg(cfg)
    # A block published after the chunk that completed it still has its kept rows when the chunk
    # is at most W - max(K, block_tokens) tokens (docs/prefix_cache.md, "When to publish").
    prefill(pub, store, 0, rows[:h], bt, max(1, min(chunk, cfg.window - max(cfg.w_keep, bt))))
    n = h + new  # the next request: the cached h tokens and `new` more
    full.begin(0)
    full.process(0, np.arange(n), rows[:n])
    r = store.hit(hit, 0, chain(h, bt), h)
    assert r.complete and r.exact and r.replay_tokens == 0
    assert r.first_row == (0 if h <= cfg.window - block else h - cfg.w_keep)
    hit.process(0, np.arange(h, n), rows[h:n])
    at = n
    for k in accepts:  # rounds with verify batches, rebases included
        a, b = full.draft(0, at), hit.draft(0, at)
        same_plan(a, b)
        full.commit(0)
        hit.commit(0)
        verify = rows[at:at + block + 1]
        full.process(0, np.arange(at, at + block + 1), verify)
        hit.process(0, np.arange(at, at + block + 1), verify)
        k = min(k, block)
        full.accept(0, k)
        hit.accept(0, k)
        at += k + 1


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_hits_and_stats_have_the_cores_fields(impl):
    """PrefixHit's fields and stats()' keys are the core's lists (PREFIX_HIT_FIELDS,
    PREFIX_STATS_FIELDS), in order, for the core and the reference twin alike."""
    Stg, Store = impl
    cfg = StagerConfig(64, 4, 64, max_seqs=2)
    store = Store(cfg, 8, 1 << 20)
    st = Stg(cfg)
    prefill(st, store, 0, rows_of(40, 64), 8, 16)
    hit = store.hit(st, 1, chain(40, 8), 40)
    assert tuple(f.name for f in dataclasses.fields(hit)) == (*PREFIX_HIT_FIELDS, "moves")
    assert tuple(hit.as_dict()) == PREFIX_HIT_FIELDS
    assert hit.as_dict() == store.lookup(chain(40, 8), 40).as_dict()
    core_only = () if Store is PrefixStore else ("resident_bytes",)  # the core's allocation
    assert tuple(store.stats()) == tuple(k for k in PREFIX_STATS_FIELDS if k not in core_only)


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_a_miss_replays_at_most_K_positions(impl):
    Stg, Store = impl
    cfg = StagerConfig(64, 4, 64, max_seqs=3)  # K = 32, W - B = 60
    K, bt = cfg.w_keep, 8
    rows = rows_of(300, 64)
    store = Store(cfg, bt, 1 << 22)
    st = Stg(cfg)
    prefill(st, store, 0, rows[:200], bt, 24)
    keys = chain(200, bt)
    # Complete: nothing to re-prefill.
    store.publish_rows([b"other"], 0, 8, rows[:8])  # the most recent block
    r = store.hit(st, 1, keys, 200)
    assert (r.first_row, r.replay_from, r.rows, r.origin) == (200 - K, 200, K, 0)
    s = st.state(1)
    assert (s["end"], s["horizon"], s["n_cache"], s["pos_base"], s["restage_owed"]) == (200, 200 - K, 0, 0, True)
    # The hit refreshed the blocks it read (positions [168, 200): the last 4 blocks).
    assert store.keys()[-4:] == [as_key(k) for k in keys[-4:]] and store.keys()[-5] == b"other"
    # The block [184, 192) is gone: rows [168, 184) are there, replay from 184.
    store.evict([keys[23]])
    r = store.lookup(keys, 200)
    assert (r.first_row, r.replay_from, r.exact) == (168, 184, True)
    # Everything is gone: replay K positions, never the prompt.
    store.clear()
    r = store.hit(st, 1, keys, 200)
    assert (r.replay_from, r.rows, r.replay_tokens) == (200 - K, 0, K)
    st.process(1, np.arange(200 - K, 203), rows[200 - K:203])
    full = Stg(cfg)
    full.begin(0)
    full.process(0, np.arange(203), rows[:203])
    same_plan(full.draft(0, 203), st.draft(1, 203))  # the replay restores a full first round


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_a_short_prompt_missing_its_first_rows_replays_no_more_than_K(impl):
    Stg, Store = impl
    cfg = StagerConfig(64, 4, 128, max_seqs=2)  # K = 64, W - B = 124
    bt = 8
    rows = rows_of(124, 64)
    store = Store(cfg, bt, 1 << 22)
    st = Stg(cfg)
    prefill(st, store, 0, rows[:120], bt, 40)
    keys = chain(120, bt)
    # Missing [0, 8) in a prompt of 120 <= W - B: exactness would replay all 120 tokens.
    store.evict(keys[:1])
    r = store.hit(st, 1, keys, 120)
    assert (r.replay_from, r.first_row, r.origin, r.exact) == (120, 8, 8, False)
    st.process(1, np.arange(120, 124), rows[120:124])
    plan = st.draft(1, 124)
    assert plan.n_rows == 116 and plan.pos_base == 8  # at least K rows of context, from position 8
    # Missing [56, 64) too: replay [56, 120) (64 = K positions), rows [8, 56) kept.
    store.evict(keys[7:8])
    r = store.lookup(keys, 120)
    assert (r.replay_from, r.first_row, r.origin, r.replay_tokens) == (56, 8, 8, 64)
    # Missing only [64, 72) (above h - K): exact, replay from 64.
    prefill(st, store, 0, rows[:120], bt, 40)
    store.evict(keys[8:9])
    r = store.lookup(keys, 120)
    assert (r.replay_from, r.first_row, r.origin, r.exact) == (64, 0, 0, True)


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_keep_rule(impl):
    Stg, Store = impl
    cfg = StagerConfig(64, 4, 64, max_seqs=1)  # K = 32, W - B = 60
    store = Store(cfg, 1000, 1 << 22)
    rows = rows_of(2000, 64)
    store.publish_rows([b"a"], 0, 60, rows[:60])
    store.publish_rows([b"b"], 0, 61, rows[:61])
    store.publish_rows([b"c", b"d"], 0, 2000, rows)
    assert store.info(b"a") == {"start": 0, "end": 60, "first_row": 0, "rows": 60, "pages": 2}
    assert store.info(b"b")["first_row"] == 61 - 32  # a hit at 61 rebases: the last K rows
    assert store.info(b"c")["rows"] == store.info(b"d")["rows"] == 32
    assert store.page_rows == 32


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_budget_and_lru(impl):
    Stg, Store = impl
    cfg = StagerConfig(32, 2, 40, max_seqs=2)
    bt = 4
    page = bt * cfg.row_bytes
    with pytest.raises(ConfigError, match="smaller than one block"):
        Store(cfg, bt, page - 1)
    assert Store(cfg, bt, page).n_pages == 1  # exactly one block fits
    store = Store(cfg, bt, 3 * page + page // 2)
    assert store.n_pages == 3
    rows = rows_of(40, 32)
    store.publish_rows([1, 2], 0, 8, rows[:8])
    store.publish_rows([3], 8, 12, rows[8:12])
    store.publish_rows([1], 0, 4, rows[:4])  # refresh: 1 is the most recent now
    store.publish_rows([4], 12, 16, rows[12:16])  # evicts 2, the least recently used
    assert store.keys() == [as_key(3), as_key(1), as_key(4)]
    # The lowest free page first: 4 took the page 2 left (page 1).
    assert store.block_slots(4).tolist() == list(range(bt, 2 * bt))
    s = store.stats()
    assert (s["blocks"], s["pages"], s["evicted_lru"], s["republished"]) == (3, 3, 1, 1)
    assert s["bytes"] == 3 * page <= store.budget_bytes
    assert store.evict([3, 99]) == 1 and len(store) == 2 and 3 not in store and 1 in store
    # Freed pages before pages never used: a large store reuses page 0 once block 1 is gone.
    big = Store(cfg, bt, 100 * page)
    big.publish_rows([1, 2, 3], 0, 12, rows[:12])
    big.evict([1])
    big.publish_rows([5], 12, 16, rows[12:16])
    assert big.block_slots(5).tolist() == list(range(bt))


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_bad_input_is_rejected_and_changes_nothing(impl):
    Stg, Store = impl
    cfg = StagerConfig(64, 4, 64, max_seqs=3)
    bt = 8
    rows = rows_of(100, 64)
    store = Store(cfg, bt, 1 << 22)
    st = Stg(cfg)
    prefill(st, store, 0, rows[:40], bt, 16)
    keys = chain(40, bt)
    snapshot = (store.keys(), store.stats())

    def unchanged():
        assert (store.keys(), store.stats()) == snapshot

    # A hit whose key chain does not match the positions.
    with pytest.raises(ValueError, match="does not match the positions"):
        store.hit(st, 1, keys[1:] + [123], 40)
    with pytest.raises(ValueError, match="keys for a hit of 48 tokens"):
        store.hit(st, 1, keys, 48)
    assert not st.state(1)["started"]
    # A block published twice with other rows.
    with pytest.raises(ValueError, match="other rows"):
        store.publish_rows(keys[:1], 0, 8, rows[:8] + 1)
    # A key that names other positions.
    with pytest.raises(ValueError, match="positions"):
        store.publish_rows(keys[:1], 8, 16, rows[8:16])
    # Rows gone from the ring, rows not final yet, unaligned blocks.
    st.process(0, np.arange(40, 140), np.vstack([rows[40:100], rows[:40]]))
    with pytest.raises(ValueError, match="no longer held"):
        store.publish(st, 0, chain(48, bt)[5:], 40, 48)
    with pytest.raises(ValueError, match="final rows"):
        store.publish(st, 0, [1], 136, 141)
    with pytest.raises(ValueError, match="block boundary"):
        store.publish(st, 0, [1], 130, 136)
    # Rows of a verify batch before accept() are not final.
    st.draft(0, 140)
    st.commit(0)
    st.process(0, np.arange(140, 145), rows[:5])
    with pytest.raises(ValueError, match="final rows"):
        store.publish(st, 0, [1], 136, 142)
    st.accept(0, 4)
    store.publish(st, 0, [1], 136, 144)  # final now
    store.evict([1])
    # A Stager of another configuration; a store of another configuration's block.
    other = Stg(cfg.replace(storage="q8_0"))
    with pytest.raises(ConfigError, match="storage"):
        store.hit(other, 0, keys, 40)
    with pytest.raises(ConfigError, match="window"):
        store.publish(Stg(cfg.replace(window=128)), 0, keys, 0, 40)
    data = Store(cfg.replace(storage="q8_0"), bt, 1 << 22)
    data.publish_rows([7], 0, 8, rows[:8])
    with pytest.raises(ValueError, match="configuration|exported with"):
        store.import_block(data.export_block(7))
    # Damaged blocks.
    good = bytearray(store.export_block(keys[2]))
    store.evict([keys[2]])
    snapshot = (store.keys(), store.stats())
    for i in (0, 9, 30, 60, 70, len(good) - 1):
        bad = bytearray(good)
        bad[i] ^= 4
        with pytest.raises(ValueError):
            store.import_block(bytes(bad))
    with pytest.raises(ValueError, match="truncated"):
        store.import_block(bytes(good[:40]))
    with pytest.raises(ValueError):
        store.import_block(bytes(good[:-1]))
    unchanged()
    store.import_block(bytes(good))
    assert keys[2] in store
    # An open round comes first (StateError), then the other checks.
    st.begin(2)
    st.process(2, np.arange(8), rows[:8])
    st.draft(2, 8)
    with pytest.raises(StateError):
        store.hit(st, 2, "not keys", 8)
    # Keys of the wrong kind.
    with pytest.raises(TypeError):
        store.lookup([1.5], 8)
    with pytest.raises(ValueError, match="1..64 bytes"):
        store.lookup([b""], 8)
    with pytest.raises(TypeError):
        store.hit(object(), 0, keys, 40)


def test_rows_that_cannot_be_stored_are_rejected():
    cfg = StagerConfig(64, 4, 64, storage="f16")
    for Store in (PrefixStore, ReferencePrefixStore):
        store = Store(cfg, 8, 1 << 20)
        rows = rows_of(8, 64)
        rows[3, 5] = 7e4  # above f16's range
        with pytest.raises(ValueError):
            store.publish_rows([1], 0, 8, rows)
        assert len(store) == 0


def test_keys():
    assert as_key(-1) == as_key(2**64 - 1) == b"\xff" * 8
    assert as_key(5) == (5).to_bytes(8, "little")
    with pytest.raises(ValueError):
        as_key(2**64)
    with pytest.raises(TypeError):
        as_key("text")
    data, off = as_key_chain(np.array([1, 2, 3], np.uint64))
    assert data == b"".join(as_key(k) for k in (1, 2, 3)) and off.tolist() == [0, 8, 16, 24]
    data, off = as_key_chain(np.arange(6, dtype=np.uint8).reshape(2, 3))
    assert data == bytes(range(6)) and off.tolist() == [0, 3, 6]
    data, off = as_key_chain([b"ab", 7, bytearray(b"xyz")])
    assert off.tolist() == [0, 2, 10, 13]
    cfg = StagerConfig(32, 2, 40)
    store = PrefixStore(cfg, 4, 1 << 20)
    store.publish_rows(np.array([10, 11], np.int64), 0, 8, rows_of(8, 32))
    assert 10 in store and as_key(11) in store and store.keys() == [as_key(10), as_key(11)]


def test_threads_share_one_store():
    """Two Stagers, four threads, one store: publishes and hits interleave; every hit that finds
    its rows restages exactly what a full prefill stages."""
    cfg = StagerConfig(128, 4, 96, max_seqs=4, storage="q8_0")
    store = PrefixStore(cfg, 16, 1 << 24)
    stagers = [Stager(cfg), Stager(cfg)]
    rows = rows_of(400, 128, seed=3)
    lengths = [160, 200, 240, 280]
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            st = stagers[t % 2]
            seq = t // 2
            for i in range(20):
                h = lengths[(t + i) % 4]
                if i % 2 == 0:
                    prefill(st, store, seq, rows[:h], 16, 40)
                    continue
                r = store.hit(st, seq, chain(h, 16), h)
                st.process(seq, np.arange(r.replay_from, h + 3), rows[r.replay_from:h + 3])
                full = Stager(cfg)
                full.begin(0)
                full.process(0, np.arange(h + 3), rows[:h + 3])
                same_plan(full.draft(0, h + 3), st.draft(seq, h + 3))
                st.commit(seq)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.stats()["hits"] == 40


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_a_huge_budget_costs_only_what_is_held():
    """A server passes a budget of 2**46 bytes to mean "no limit": constructing the store must not
    size anything by it (its page bookkeeping once took 384 MiB at once), and publishing a block
    makes resident what the block needs (one chunk of pages), not what the budget allows."""
    cfg = StagerConfig(feature_dim=256, block_size=4, window=96)
    before = _resident_bytes()
    store = PrefixStore(cfg, 16, 2**46)
    assert store.stats()["resident_bytes"] == 0
    assert _resident_bytes() - before < 16 << 20
    store.publish_rows([1, 2], 0, 32, massive_rows(np.random.default_rng(0), 32, 256))
    held = store.stats()["resident_bytes"]
    assert 0 < held <= 8 << 20  # whole chunks of pages (4 MiB each) for the pages in use
    assert _resident_bytes() - before < held + (16 << 20)


@pytest.mark.parametrize("end", [59, 60, 61])
def test_import_keep_rule_at_the_window_edge(end):
    """W = 64, B = 4 (W - B = 60), K = 32, blocks of 64 tokens: a block ending at or below W - B
    keeps every row, one ending above it its last K. Exported by the core, imported by the
    reference twin (its own parse of the keep rule) and back, at the edge: the same bytes."""
    cfg = StagerConfig(feature_dim=32, block_size=4, window=64)
    rows = massive_rows(np.random.default_rng(end), end, 32)
    core = PrefixStore(cfg, 64, 1 << 20)
    core.publish_rows([7], 0, end, rows)
    data = core.export_block(7)
    kept = end if end <= 60 else 32
    assert core.lookup([7], end).rows == kept
    ref = ReferencePrefixStore(cfg, 64, 1 << 20)
    ref.import_block(data)
    assert ref.export_block(7) == data
    back = PrefixStore(cfg, 64, 1 << 20)
    back.import_block(ref.export_block(7))
    assert back.export_block(7) == data


@pytest.mark.parametrize("impl", [(Stager, PrefixStore), (ReferenceStager, ReferencePrefixStore)],
                         ids=["core", "reference"])
def test_full_hits_count_hits_that_found_every_row(impl):
    """``PrefixHit.exact``: the first round equals a full prefill's; ``stats()["full_hits"]``: hits
    that found every row and were exact. A hit whose last block was evicted replays its rows: still
    exact, not full."""
    stager, store_type = impl
    cfg = StagerConfig(feature_dim=32, block_size=4, window=64, max_seqs=3)
    st, store = stager(cfg), store_type(cfg, 8, 1 << 20)
    keys = [100 + s for s in range(0, 48, 8)]
    st.process(0, np.arange(48), massive_rows(np.random.default_rng(3), 48, 32))
    store.publish(st, 0, keys, 0, 48)
    full = store.hit(st, 1, keys, 48)
    assert full.exact and full.replay_from == 48 and store.stats()["full_hits"] == 1
    store.evict(keys[-1:])
    partial = store.hit(st, 2, keys, 48)
    assert partial.exact and partial.replay_from < 48
    assert store.stats()["hits"] == 2 and store.stats()["full_hits"] == 1


def test_a_block_changing_under_import_never_passes_as_intact():
    """import_block reads the caller's buffer with the GIL released: while another thread flips
    a byte of its rows, every import either refuses the block (checksum) or keeps the block as
    exported, never the flipped bytes."""
    cfg = StagerConfig(64, 2, 40, max_seqs=1, storage="f32")
    st = Stager(cfg)
    src = PrefixStore(cfg, 16, 1 << 24)
    st.begin(0)
    st.process(0, np.arange(32), np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32))
    src.publish(st, 0, [b"k0", b"k1"], 0, 32)
    want = bytes(src.export_block(b"k1"))
    buf = np.frombuffer(bytearray(want), np.uint8).copy()
    accepted = rejected = 0
    with flipping(buf, len(want) - 100):
        for _ in range(300):
            dst = PrefixStore(cfg, 16, 1 << 24)
            try:
                dst.import_block(buf)
            except ValueError:
                rejected += 1
                assert dst.stats()["blocks"] == 0
                continue
            accepted += 1
            assert bytes(dst.export_block(b"k1")) == want
    assert accepted + rejected == 300
