"""``publish_many`` / ``hit_many``: a step's prefix-store calls in one call each.

The oracles: a loop of ``publish`` / ``hit`` on a twin pair (same Stager
configuration, same store, same calls), and the pure-Python reference's own
batches. Over random steps of many sequences, in both row modes, the batch
leaves the store (keys, stats, every block's exported bytes), every
sequence (state, snapshot bytes) and, with external rows, both tables as
the loop leaves them, with one table change per batch. A rejected batch,
refused at its third entry after two valid ones, changes nothing, and says
which entry, word for word as the reference does.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import massive_rows
from dspark_core import HostPrefixTable, HostRing, PrefixStore, Stager, StagerConfig
from dspark_core.reference import ReferencePrefixStore, ReferenceStager

D, B, W, BT = 32, 4, 64, 8
N = 6
IMPLS = {"core": (Stager, PrefixStore), "reference": (ReferenceStager, ReferencePrefixStore)}


def keys_of(tag: int, lo: int, hi: int) -> list[int]:
    return [tag * 100_000 + s for s in range(lo, hi, BT)]


class Pair:
    """A Stager and its store (with a HostRing and HostPrefixTable in external-row mode)."""

    def __init__(self, impl: str, rows: str, budget: int = 1 << 20) -> None:
        stager, store = IMPLS[impl]
        self.cfg = StagerConfig(D, B, W, max_seqs=N, storage="q8_0", rows=rows)
        self.st = stager(self.cfg)
        self.store = store(self.cfg, BT, budget)
        self.external = rows == "external"
        if self.external:
            self.ring = HostRing(self.st)
            self.table = HostPrefixTable(self.store, self.ring)

    def feed(self, seq: int, lo: int, rows: np.ndarray) -> None:
        pos = np.arange(lo, lo + len(rows))
        if self.external:
            self.ring.write(seq, pos, rows)
        else:
            self.st.process(seq, pos, rows)

    def publish_loop(self, seqs, keys, starts, ends) -> None:
        for s, k, a, b in zip(seqs, keys, starts, ends):
            if self.external:
                self.table.publish(self.ring, s, k, a, b)
            else:
                self.store.publish(self.st, s, k, a, b)

    def publish_many(self, seqs, keys, starts, ends):
        if self.external:
            return self.table.publish_many(self.ring, seqs, keys, starts, ends)
        return self.store.publish_many(self.st, seqs, keys, starts, ends)

    def hit_loop(self, seqs, keys, n_tokens) -> list:
        if self.external:
            return [self.table.hit(self.ring, s, k, h) for s, k, h in zip(seqs, keys, n_tokens)]
        return [self.store.hit(self.st, s, k, h) for s, k, h in zip(seqs, keys, n_tokens)]

    def hit_many(self, seqs, keys, n_tokens):
        if self.external:
            return self.table.hit_many(self.ring, seqs, keys, n_tokens)
        return self.store.hit_many(self.st, seqs, keys, n_tokens)

    def everything(self) -> tuple:
        """What a call may change: every sequence, the store, both tables."""
        seqs = tuple((repr(self.st.state(s)), bytes(self.st.snapshot(s))) for s in range(N))
        live = tuple(self.ring.read(self.st.live_slots(s)).tobytes() for s in range(N)) if self.external else ()
        blocks = tuple(sorted(
            (bytes(k), self.table.export_block(k) if self.external else self.store.export_block(k))
            for k in self.store.keys()))
        stats = {k: v for k, v in self.store.stats().items() if k != "resident_bytes"}
        return seqs, live, blocks, tuple(sorted(stats.items())), self.st.moves_issued


def _step_publishes(rng, ends_now, published, shared):
    """One step's publishes: the blocks completed since each sequence's last publish (a sequence
    whose lag is short may wait a step). s and s + 3 share a prompt: ``shared``, both may publish
    in one step (a block new to the store in two entries), else one sequence per prompt."""
    seqs, keys, starts, ends, tags = [], [], [], [], set()
    for s in rng.permutation(N).tolist():
        lo, hi = published[s], ends_now[s] // BT * BT
        if hi <= lo or (s % 3 in tags and not shared) or (hi - lo < 3 * BT and rng.random() < 0.3):
            continue
        tags.add(s % 3)
        seqs.append(s)
        keys.append(keys_of(s % 3, lo, hi))
        starts.append(lo)
        ends.append(hi)
    return seqs, keys, starts, ends


@pytest.mark.parametrize("rows", ["held", "external"])
@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("budget", [1 << 20, 12_000], ids=["roomy", "evicting"])
@pytest.mark.parametrize("shared", [False, True], ids=["one-entry-per-prompt", "shared-blocks"])
def test_batches_equal_loops(impl, rows, budget, shared):
    rng = np.random.default_rng(hash((impl, rows, budget, shared)) % 2**32)
    batch, loop = Pair(impl, rows, budget), Pair(impl, rows, budget)
    prompts = {t: massive_rows(np.random.default_rng(t), 400, D) for t in range(3)}
    ends_now, published = [0] * N, [0] * N
    for step in range(30):
        # Prefill chunks of a few blocks: sequences s and s + 3 carry the same prompt rows.
        for s in range(N):
            n = int(rng.integers(1, 12))
            if ends_now[s] + n > 400:
                continue
            chunk = prompts[s % 3][ends_now[s]:ends_now[s] + n]
            for p in (batch, loop):
                p.feed(s, ends_now[s], chunk)
            ends_now[s] += n
        seqs, keys, starts, ends = _step_publishes(rng, ends_now, published, shared)
        loop.publish_loop(seqs, keys, starts, ends)
        moves = batch.publish_many(seqs, keys, starts, ends)
        for i in range(len(seqs)):
            published[seqs[i]] = ends[i]
        if rows == "external":
            assert moves.serial in (0, batch.st.moves_issued)
        assert batch.everything()[2:4] == loop.everything()[2:4], step
        if step % 5 == 4:  # hits: some sequences start over from the store
            hs = rng.choice(N, size=3, replace=False).tolist()
            hk = [keys_of(s % 3, 0, ends_now[s]) for s in hs]
            ht = [min(ends_now[s] // BT, int(rng.integers(0, 25))) * BT for s in hs]  # whole blocks
            hk = [k[: -(-t // BT)] for k, t in zip(hk, ht)]
            want = loop.hit_loop(hs, hk, ht)
            got = batch.hit_many(hs, hk, ht)
            assert [h.as_dict() for h in got] == [h.as_dict() for h in want]
            for s, h in zip(hs, got):  # the prefill goes on from replay_from
                ends_now[s] = h.replay_from
                published[s] = min(published[s], h.replay_from) // BT * BT
        assert batch.everything()[:4] == loop.everything()[:4], step


@pytest.mark.parametrize("rows", ["held", "external"])
def test_core_batches_equal_the_reference_batches(rows):
    """The same steps through the core's and the reference's batches: moves (with their serials),
    hits, stores and sequences identical."""
    core, ref = Pair("core", rows, 12_000), Pair("reference", rows, 12_000)
    rng = np.random.default_rng(5)
    rows_of = massive_rows(rng, 200, D)
    for s in range(N):
        for p in (core, ref):
            p.feed(s, 0, rows_of[: 100 + 10 * s])
    seqs = [0, 2, 4, 5]
    ends = [(100 + 10 * s) // BT * BT for s in seqs]
    starts = [-(-(e - 56) // BT) * BT for e in ends]  # the blocks the rings still hold
    keys = [keys_of(7 + s, a, e) for s, a, e in zip(seqs, starts, ends)]
    a, b = core.publish_many(seqs, keys, starts, ends), ref.publish_many(seqs, keys, starts, ends)
    assert np.array_equal(a, b) and a.serial == b.serial
    hs, hk, ht = [1, 3], [keys_of(7, 0, 96), keys_of(9, 0, 120)], [96, 120]
    x, y = core.hit_many(hs, hk, ht), ref.hit_many(hs, hk, ht)
    assert [h.as_dict() for h in x] == [h.as_dict() for h in y]
    assert np.array_equal(x.moves, y.moves) and x.moves.serial == y.moves.serial
    assert core.everything() == ref.everything()


def _rejections(p: Pair):
    """Batches refused at their third entry (after two valid ones), and the error each raises."""
    ok = [([0, 1], [keys_of(1, 0, 40), keys_of(2, 0, 40)], [0, 0], [40, 40])]
    return [
        # rows not final yet (past the sequence's end)
        ([0, 1, 2], ok[0][1] + [keys_of(3, 0, 80)], [0, 0, 0], [40, 40, 80]),
        # a chain of the wrong length
        ([0, 1, 2], ok[0][1] + [keys_of(3, 0, 24)], [0, 0, 0], [40, 40, 40]),
        # a block new in two entries, at other positions in the second (as a loop's second publish)
        ([0, 1, 2], ok[0][1] + [keys_of(1, 0, 40)], [0, 0, 8], [40, 40, 48]),
        # an unknown sequence
        ([0, 1, N], ok[0][1] + [keys_of(3, 0, 40)], [0, 0, 0], [40, 40, 40]),
    ]


@pytest.mark.parametrize("rows", ["held", "external"])
def test_a_rejected_batch_changes_nothing_and_says_what_the_reference_says(rows):
    messages = {}
    for impl in sorted(IMPLS):
        p = Pair(impl, rows)
        for s in range(N):
            p.feed(s, 0, massive_rows(np.random.default_rng(s), 50, D))
        p.publish_many([4], [keys_of(9, 0, 16)], [0], [16])
        before = p.everything()
        got = []
        for seqs, keys, starts, ends in _rejections(p):
            with pytest.raises((ValueError, TypeError)) as exc:
                p.publish_many(seqs, keys, starts, ends)
            got.append(f"{type(exc.value).__name__}: {exc.value}")
            assert p.everything() == before
        with pytest.raises(ValueError) as exc:
            p.hit_many([0, 1, 5], [keys_of(9, 0, 16), keys_of(9, 0, 16), keys_of(9, 0, 8)], [16, 16, 24])
        got.append(f"{type(exc.value).__name__}: {exc.value}")
        assert p.everything() == before
        messages[impl] = got
    assert messages["core"] == messages["reference"]
    assert "publish_many: seqs[2] (sequence 2)" in messages["core"][0]
    assert messages["core"][2].startswith("ValueError: publish_many: seqs[2] (sequence 2): key ")
    assert "is held for positions [0, 8), not [8, 16)" in messages["core"][2]
    assert messages["core"][4].startswith("ValueError: hit_many: seqs[2] (sequence 5)")


def test_a_batch_keeps_a_block_a_later_entry_refreshes_from_rows_it_no_longer_holds():
    """Where a loop fails part-way (entry 0's new block evicts the block entry 1 refreshes, whose
    rows entry 1 no longer holds), the batch evicts the next least recently used block instead and
    succeeds, and the core and the reference agree."""
    results = {}
    for impl in sorted(IMPLS):
        stager, store_type = IMPLS[impl]
        cfg = StagerConfig(D, B, W, max_seqs=3, storage="q8_0")
        st = stager(cfg)
        row_bytes = cfg.row_bytes
        store = store_type(cfg, BT, 3 * BT * row_bytes)  # three blocks
        rows = massive_rows(np.random.default_rng(1), 200, D)
        st.process(1, np.arange(8), rows[:8])
        store.publish(st, 1, keys_of(1, 0, 8), 0, 8)  # oldest: the block entry 1 refreshes
        st.process(2, np.arange(16), rows[:16])
        store.publish(st, 2, keys_of(2, 0, 16), 0, 16)  # two more: the store is full
        st.process(1, np.arange(8, 200), rows[8:200])  # its rows 0..8 leave the window
        st.process(0, np.arange(8), rows[:8])
        seqs, keys, starts, ends = [0, 1], [keys_of(3, 0, 8), keys_of(1, 0, 8)], [0, 0], [8, 8]
        store.publish_many(st, seqs, keys, starts, ends)
        results[impl] = (sorted(map(bytes, store.keys())), store.stats()["evicted_lru"])
        assert keys_of(1, 0, 8)[0] in store and keys_of(3, 0, 8)[0] in store
        # The loop of the same calls, on a copy of the situation, fails at its second publish.
        st2, store2 = stager(cfg), store_type(cfg, BT, 3 * BT * row_bytes)
        st2.process(1, np.arange(8), rows[:8])
        store2.publish(st2, 1, keys_of(1, 0, 8), 0, 8)
        st2.process(2, np.arange(16), rows[:16])
        store2.publish(st2, 2, keys_of(2, 0, 16), 0, 16)
        st2.process(1, np.arange(8, 200), rows[8:200])
        st2.process(0, np.arange(8), rows[:8])
        store2.publish(st2, 0, keys_of(3, 0, 8), 0, 8)
        with pytest.raises(ValueError, match="no longer held"):
            store2.publish(st2, 1, keys_of(1, 0, 8), 0, 8)
    assert results["core"] == results["reference"]


# A block new to the store in two entries of a batch (a shared system prompt whose chunk two
# requests finish in the same step): the first entry adds it, a later one refreshes it, as a loop
# of publish does. The oracles: the loop, and the reference's batch.


def _shared_prompt_pairs(impl: str, rows: str, budget: int) -> tuple[Pair, Pair]:
    """A batch pair and a loop pair where seqs 0..2 hold the same 48-row system prompt and then
    their own rows (seq 2: one more block), seq 3 the prompt and 100 rows more (the prompt's rows
    have left its window), and seq 4 the prompt's positions with other rows."""
    system = massive_rows(np.random.default_rng(11), 48, D)
    pairs = Pair(impl, rows, budget), Pair(impl, rows, budget)
    for p in pairs:
        for s in range(3):
            p.feed(s, 0, system)
            p.feed(s, 48, massive_rows(np.random.default_rng(20 + s), 8 * (s + 1), D))
        p.feed(3, 0, system)
        p.feed(3, 48, massive_rows(np.random.default_rng(23), 100, D))
        p.feed(4, 0, massive_rows(np.random.default_rng(24), 48, D))
    return pairs


SYSTEM = keys_of(1, 0, 48)
SHARED_BATCH = (
    [1, 0, 2, 3],
    [SYSTEM, SYSTEM, SYSTEM + keys_of(52, 48, 64), SYSTEM],
    [0, 0, 0, 0],
    [48, 48, 64, 48],
)


@pytest.mark.parametrize("rows", ["held", "external"])
@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("budget", [1 << 20, 12_000], ids=["roomy", "evicting"])
def test_a_block_new_in_two_entries_is_added_once_and_refreshed_as_a_loop_does(impl, rows, budget):
    batch, loop = _shared_prompt_pairs(impl, rows, budget)
    for p in (batch, loop):  # fill the store, so that the evicting budget evicts during the batch
        for t in range(8):
            p.feed(5, 8 * t, massive_rows(np.random.default_rng(30 + t), 8, D))
            p.publish_loop([5], [keys_of(90 + t, 8 * t, 8 * t + 8)], [8 * t], [8 * t + 8])
    seqs, keys, starts, ends = SHARED_BATCH
    if budget < 1 << 20:  # seq 3 refreshes from rows it no longer holds: a loop is exact only while nothing evicts
        seqs, keys, starts, ends = seqs[:3], keys[:3], starts[:3], ends[:3]
    loop.publish_loop(seqs, keys, starts, ends)
    moves = batch.publish_many(seqs, keys, starts, ends)
    assert batch.everything()[:4] == loop.everything()[:4]  # (one table change, not one per entry)
    stats = batch.store.stats()
    assert stats["republished"] == loop.store.stats()["republished"] >= 2 * len(SYSTEM) // (1 if budget >= 1 << 20 else 2)
    for k in SYSTEM:  # added from the batch's first entry (seq 1) and held under one key each
        assert k in batch.store
    if rows == "external":
        assert moves.serial == batch.st.moves_issued
    # A hit on the shared prompt stages seq 1's rows: the same as the loop's.
    a, b = batch.hit_loop([5], [SYSTEM], [48]), loop.hit_loop([5], [SYSTEM], [48])
    assert [h.as_dict() for h in a] == [h.as_dict() for h in b]
    assert batch.everything()[:4] == loop.everything()[:4]


@pytest.mark.parametrize("rows", ["held", "external"])
def test_core_and_reference_agree_on_a_block_new_in_two_entries(rows):
    core, ref = _shared_prompt_pairs("core", rows, 1 << 20), _shared_prompt_pairs("reference", rows, 1 << 20)
    a, b = core[0].publish_many(*SHARED_BATCH), ref[0].publish_many(*SHARED_BATCH)
    assert np.array_equal(a, b) and a.serial == b.serial
    assert core[0].everything() == ref[0].everything()
    assert core[0].store.stats()["published"] == len(SYSTEM) + 2  # seq 2's two own blocks
    assert core[0].store.stats()["republished"] == 3 * len(SYSTEM)  # seqs 0, 2 and 3


@pytest.mark.parametrize("rows", ["held", "external"])
def test_a_later_entry_with_other_rows_or_positions_is_refused_as_a_loop_refuses_it(rows):
    """The later entry of a block new to the store must bring what a second publish must: its
    positions, and (held rows) the same rows where it still holds them. The batch is refused with
    the loop's second publish's error, naming the entry, and changes nothing."""
    cases = [
        ([0, 4], [SYSTEM, SYSTEM], [0, 0], [48, 48]),  # seq 4: other rows at the prompt's positions
        ([0, 1], [SYSTEM, [SYSTEM[1], 777]], [0, 0], [48, 16]),  # SYSTEM[1], of [8, 16), at [0, 8)
    ]
    for k, (seqs, keys, starts, ends) in enumerate(cases):
        if rows == "external" and k == 0:
            continue  # the owner's rows: not visible to the store, a refresh as a loop's
        messages = {}
        for impl in sorted(IMPLS):
            batch, loop = _shared_prompt_pairs(impl, rows, 1 << 20)
            loop.publish_loop(seqs[:1], keys[:1], starts[:1], ends[:1])
            with pytest.raises(ValueError) as single:
                loop.publish_loop(seqs[1:], keys[1:], starts[1:], ends[1:])
            before = batch.everything()
            with pytest.raises(ValueError) as exc:
                batch.publish_many(seqs, keys, starts, ends)
            assert str(exc.value) == f"publish_many: seqs[1] (sequence {seqs[1]}): {single.value}"
            assert batch.everything() == before
            messages[impl] = str(exc.value)
        assert messages["core"] == messages["reference"]
        assert ("other rows" if k == 0 else "is held for positions") in messages["core"]


def test_hit_many_on_the_table_applies_one_change_and_gathers_the_published_rows():
    p = Pair("core", "external")
    rows = massive_rows(np.random.default_rng(2), 64, D)
    p.feed(0, 0, rows)
    p.table.publish_many(p.ring, [0], [keys_of(1, 0, 64)], [0], [64])
    issued = p.st.moves_issued
    hits = p.table.hit_many(p.ring, [1, 2], [keys_of(1, 0, 64), keys_of(1, 0, 40)], [64, 40])
    assert p.st.moves_issued == issued + 1 and hits.moves.serial == issued + 1
    assert all(len(h.moves) == 0 for h in hits)
    for s in (1, 2):
        plan = p.st.draft(s, hits[s - 1].replay_from)
        assert np.any(p.ring.gather(plan) != 0)
        p.st.commit(s)


# Int keys of every kind the fast conversion meets: small, negative, at and past 2**63 (the same
# 64-bit hash as its negative twin), the extremes. The oracle: the same chains as bytes keys
# (prefix.keys.as_key, the documented meaning of an int key).


@pytest.mark.parametrize("rows", ["held", "external"])
def test_int_key_batches_equal_the_same_chains_as_bytes(rows):
    from dspark_core.prefix.keys import as_key

    rng = np.random.default_rng(5)
    ints, raw = Pair("core", rows), Pair("core", rows)
    x = massive_rows(rng, 2 * BT, D)
    for p in (ints, raw):
        for s in range(3):
            p.feed(s, 0, x)
    # Chains of different lengths, as lists and a tuple.
    chains = [[0, 2**63], (-1,), [2**63 - 1, -123_456_789]]
    as_bytes = [[as_key(k) for k in c] for c in chains]
    ends = [len(c) * BT for c in chains]
    ints.publish_many([0, 1, 2], chains, [0, 0, 0], ends)
    raw.publish_many([0, 1, 2], as_bytes, [0, 0, 0], ends)
    assert sorted(map(bytes, ints.store.keys())) == sorted(map(bytes, raw.store.keys()))
    assert ints.everything() == raw.everything()
    # -1 and 2**64 - 1 name one key: a hit under either spelling finds the other's block.
    twin = [[(k + 2**64) % 2**64 if k < 0 else (k - 2**64 if k >= 2**63 else k) for k in c] for c in chains]
    a = ints.hit_many([3, 4, 5], twin, ends)
    b = raw.hit_many([3, 4, 5], as_bytes, ends)
    assert [h.as_dict() for h in a] == [h.as_dict() for h in b]
    assert all(h.blocks_found == len(c) for h, c in zip(a, chains))
    assert ints.everything() == raw.everything()


@pytest.mark.parametrize("keys, error, match", [
    ([[0], [2**64]], ValueError, r"keys\[1\].*\[-2\*\*63, 2\*\*64\)"),
    ([[0], [-(2**63) - 1]], ValueError, r"keys\[1\].*\[-2\*\*63, 2\*\*64\)"),
    ([[0], [True]], TypeError, r"keys\[1\]"),
    ([[0], [1.0]], TypeError, r"keys\[1\]"),
    ([[0], "ab"], TypeError, r"keys\[1\]"),
], ids=["past 2**64", "below -2**63", "bool", "float", "str chain"])
def test_a_batch_of_int_keys_with_one_bad_key_names_it_and_changes_nothing(keys, error, match):
    p = Pair("core", "held")
    p.feed(0, 0, massive_rows(np.random.default_rng(1), BT, D))
    p.feed(1, 0, massive_rows(np.random.default_rng(2), BT, D))
    before = p.everything()
    with pytest.raises(error, match=match):
        p.publish_many([0, 1], keys, [0, 0], [BT, BT])
    with pytest.raises(error, match=match):
        p.hit_many([2, 3], keys, [BT, BT])
    assert p.everything() == before
    # numpy integers and bools are keys the slow path converts (or refuses) as before.
    p.publish_many([0, 1], [[np.int64(5)], [np.uint64(2**64 - 1)]], [0, 0], [BT, BT])
    assert sorted(map(bytes, p.store.keys())) == sorted([(5).to_bytes(8, "little"), b"\xff" * 8])
