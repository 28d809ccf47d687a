"""Prefix store: the C++ core and the reference twin, held and external rows, call for call.

A hypothesis RuleBasedStateMachine drives four (Stager, PrefixStore) pairs
with the same calls: the C++ core and the pure-Python reference, each with
held rows and with external rows. Sequences belong to conversations whose
rows and block keys are fixed functions of (conversation, position), and
every conversation shares its first positions (a system prompt), so
publishes from one sequence meet hits, partial hits, republishes and misses
from others. Budgets are a handful of pages, so LRU eviction runs all the
time; keys are also evicted by the server and blocks exported / imported.

After every call the four must agree: outcome (or exception type), the
PrefixHit, the keys in LRU order, the store counters, every sequence's
state and counters, and the moves of the two external pairs. The test plays
the owner of the external rows with numpy mirror tables (the Stagers' ring
table and the store's table), written only from the slots and moves the
external core returns; every plan's slots must then hold the held core's
rows byte for byte, and every block of the external store, read from the
mirror at block_slots(key), must export to the held store's bytes.
"""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as hs
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dspark_core import PrefixStore, Stager, StagerConfig
from dspark_core.prefix import block_format as prefix_block_format
from dspark_core.stager.config import STORAGES
from dspark_core.formats import quantize_rows
from dspark_core.reference import SEMANTIC_PREFIX_STATS, SEMANTIC_STATS, ReferencePrefixStore, ReferenceStager
from conftest import massive_rows

#: Positions a conversation has rows for.
MAX_LEN = 900
#: Conversations (each shares the system prompt, then goes its own way).
CONVS = 4
UNWRITTEN = 0xA5
SEQ = hs.integers(0, 5)


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the type and the message are what is compared
        return ("raise", (type(exc), str(exc)))


class Pair:
    """One Stager and its store."""

    def __init__(self, name: str, stager, store) -> None:
        self.name, self.st, self.store = name, stager, store


class PrefixStoreMachine(RuleBasedStateMachine):
    @initialize(
        dim=hs.sampled_from((32, 64)),
        block=hs.integers(1, 4),
        extra=hs.integers(1, 30),
        seqs=hs.integers(2, 3),
        storage=hs.sampled_from(STORAGES),
        stage_dtype=hs.sampled_from(["float32", "float32", "float16", "bfloat16"]),
        block_tokens=hs.sampled_from([1, 3, 4, 8, 11, 40]),
        pages=hs.sampled_from([0, 1, 3, 8, 20, 60, 200]),
        system=hs.integers(0, 60),
        seed=hs.integers(0, 2**16),
        kind=hs.sampled_from(["block", "block", "chain"]),
    )
    def setup(self, dim, block, extra, seqs, storage, stage_dtype, block_tokens, pages, system, seed, kind):
        cfg = StagerConfig(dim, block, 2 * block + extra, max_seqs=seqs, storage=storage, stage_dtype=stage_dtype,
                           kind=kind)
        ext = cfg.replace(rows="external")
        self.cfg, self.bt = cfg, block_tokens
        page_rows = min(block_tokens, cfg.w_keep)
        max_kept = min(block_tokens, max(cfg.window - cfg.block_size, cfg.w_keep))
        budget = (-(-max_kept // page_rows) + pages) * page_rows * cfg.row_bytes + pages  # a little slack
        self.pairs = [
            Pair("core held", Stager(cfg), PrefixStore(cfg, block_tokens, budget)),
            Pair("ref held", ReferenceStager(cfg), ReferencePrefixStore(cfg, block_tokens, budget)),
            Pair("core ext", Stager(ext), PrefixStore(ext, block_tokens, budget)),
            Pair("ref ext", ReferenceStager(ext), ReferencePrefixStore(ext, block_tokens, budget)),
        ]
        self.held, self.xcore = self.pairs[0], self.pairs[2]
        self.ring = np.full((seqs * self.xcore.st.ring_rows, cfg.row_bytes), UNWRITTEN, np.uint8)
        self.table = np.full((self.xcore.store.table_rows, cfg.row_bytes), UNWRITTEN, np.uint8)
        rng = np.random.default_rng(seed)
        # Activation-like rows every storage and stage dtype carries (|x| < 65,504).
        base = np.clip(massive_rows(rng, MAX_LEN, dim, peak=3e4), -6e4, 6e4)
        self.rows = []
        for _ in range(CONVS):
            own = np.clip(massive_rows(rng, MAX_LEN, dim, peak=3e4), -6e4, 6e4)
            own[:system] = base[:system]
            self.rows.append(own)
        # Each conversation's token ids (a chain drafter's Stagers keep them beside the rows; the
        # system prompt's are shared, as its keys are).
        base_ids = rng.integers(0, 50000, MAX_LEN, dtype=np.int32)
        self.ids = []
        for _ in range(CONVS):
            own_ids = rng.integers(0, 50000, MAX_LEN, dtype=np.int32)
            own_ids[:system] = base_ids[:system]
            self.ids.append(own_ids)
        self.rng = rng
        self.system = system
        self.conv = [0] * seqs  # the conversation each sequence follows
        self.published: list[tuple[int, int]] = []  # (conversation, tokens) of requests that published

    # -- helpers --------------------------------------------------------
    def key(self, conv: int, s: int, e: int) -> bytes:
        """Block [s, e) of a conversation: shared by all within the system prompt."""
        return struct.pack("<qqq", -1 if e <= self.system else conv, s, e)

    def chain(self, conv: int, lo: int, hi: int) -> list[bytes]:
        return [self.key(conv, s, min(s + self.bt, hi)) for s in range(lo, hi, self.bt)]

    def encode(self, rows: np.ndarray) -> np.ndarray:
        enc = quantize_rows(rows, self.cfg.storage, nonfinite="error")
        return np.ascontiguousarray(enc).view(np.uint8).reshape(len(rows), self.cfg.row_bytes)

    def end(self, seq: int) -> int:
        return self.held.st.state(seq)["end"]

    def apply(self, moves, src: np.ndarray, dst: np.ndarray) -> None:
        for s, d, n in moves.tolist():
            assert n > 0 and 0 <= s and s + n <= len(src) and 0 <= d and d + n <= len(dst)
            dst[d:d + n] = src[s:s + n]

    def all4(self, call):
        """call(pair) on the four pairs: the same outcome; returns the outcomes."""
        return self.agree([outcome(call, p) for p in self.pairs])

    def agree(self, outs):
        """The four pairs' outcomes agree (as all4 checks them); returns them."""
        kinds = {o[0] for o in outs}
        assert len(kinds) == 1, [(p.name, o) for p, o in zip(self.pairs, outs)]
        if outs[0][0] == "raise":
            # The same exception type everywhere, and the same message from the core and the
            # reference of each row mode (each spells its messages out on its own).
            assert len({o[1][0] for o in outs}) == 1, [(p.name, o) for p, o in zip(self.pairs, outs)]
            assert outs[0][1] == outs[1][1] and outs[2][1] == outs[3][1], [(p.name, o) for p, o in zip(self.pairs, outs)]
            event("rejected: " + outs[0][1][0].__name__)
        return outs

    @property
    def chain_kind(self) -> bool:
        return self.cfg.kind == "chain"

    def prompt_kw(self, ids: np.ndarray) -> tuple[dict, bool]:
        """A hit's tokens= (the prompt's ids, flat in a batch): a chain Stager's, now and then with
        a negative id, none or one too many; a block Stager's none, now and then some. Returns (kw,
        bad): bad when the ids must be refused."""
        defect = self.rng.random()
        if self.chain_kind:
            if defect < 0.04 and len(ids):
                bad = ids.copy()
                bad[int(self.rng.integers(len(ids)))] = -1
                return {"tokens": bad}, True
            if defect < 0.07 and len(ids):
                return {}, True
            if defect < 0.10:
                return {"tokens": np.append(ids, 7)}, True
            return {"tokens": ids}, False
        if defect < 0.05:
            return {"tokens": ids}, True
        return {}, False

    def image(self):
        """What a rejected call must leave as it was, in every pair: the store's keys and counters,
        every sequence's state, counters and ids."""
        out = []
        for p in self.pairs:
            seqs = []
            for s in range(self.cfg.max_seqs):
                ids = None
                if self.chain_kind:
                    lo, hi = p.st.buffered_positions(s)
                    ids = p.st.tokens(s, lo, hi).tolist()
                seqs.append((p.st.state(s), p.st.stats(s), ids))
            out.append((p.store.keys(), p.store.stats(), seqs))
        return out

    def refused(self, before, outs, kw) -> None:
        """A call with bad ids: refused everywhere (ValueError / TypeError, or the sequence's own
        error first), nothing changed."""
        assert outs[0][0] == "raise", (kw, outs)
        assert self.image() == before, kw

    def feed(self, seq: int, lo: int, hi: int) -> None:
        """process rows [lo, hi) of the sequence's conversation; the owner writes the external rows."""
        rows = self.rows[self.conv[seq]][lo:hi]
        pos = np.arange(lo, hi)
        kw = {"tokens": self.ids[self.conv[seq]][lo:hi]} if self.chain_kind else {}
        outs = self.all4(lambda p: p.st.process(seq, pos, None if p.st.config.external_rows else rows, **kw))
        if outs[0][0] == "ok":
            slots = outs[2][1]
            assert np.array_equal(slots, outs[3][1])
            live = slots >= 0
            self.ring[slots[live]] = self.encode(rows)[live]

    def moves(self, outs, src, dst):
        """The external pairs' moves agree; the owner applies the core's."""
        if outs[0][0] != "ok":
            return
        a, b = outs[2][1], outs[3][1]
        am = a.moves if hasattr(a, "moves") else a
        bm = b.moves if hasattr(b, "moves") else b
        assert np.array_equal(am, bm), (am, bm)
        assert am.serial == bm.serial and am.direction == bm.direction
        assert len(outs[0][1].moves if hasattr(outs[0][1], "moves") else outs[0][1]) == 0  # held: nothing to copy
        self.apply(am, src, dst)

    # -- rules ----------------------------------------------------------
    @rule(seq=SEQ, conv=hs.integers(0, CONVS - 1))
    def begin(self, seq, conv):
        seq %= self.cfg.max_seqs
        self.all4(lambda p: p.st.begin(seq))
        self.conv[seq] = conv

    @rule(seq=SEQ, n=hs.integers(1, 40))
    def process(self, seq, n):
        seq %= self.cfg.max_seqs
        lo = self.end(seq)
        self.feed(seq, lo, min(MAX_LEN, lo + n))

    @rule(seq=SEQ, conv=hs.integers(0, CONVS - 1), n=hs.integers(1, 300), chunk=hs.integers(1, 64))
    def prefill_and_publish(self, seq, conv, n, chunk):
        """A request as a server runs it: begin, prefill in chunks, publish each block once complete
        (and the partial block at the end)."""
        seq %= self.cfg.max_seqs
        self.begin(seq, conv)
        at = 0
        while at < n:
            hi = min(n, at + chunk)
            self.feed(seq, at, hi)
            lo_b = at // self.bt * self.bt
            hi_b = hi if hi == n else hi // self.bt * self.bt
            if hi_b > lo_b:
                keys = self.chain(conv, lo_b, hi_b)
                outs = self.all4(lambda p, keys=keys, lo=lo_b, hi=hi_b: p.store.publish(p.st, seq, keys, lo, hi))
                self.moves(outs, self.ring, self.table)
            at = hi
        self.published.append((conv, n))

    @rule(seq=SEQ, lo=hs.integers(0, 80), n=hs.integers(0, 60), conv=hs.none() | hs.integers(0, CONVS - 1))
    def publish(self, seq, lo, n, conv):
        """Any range, valid or not (unaligned, past the final rows, rows gone, another conversation's keys)."""
        seq %= self.cfg.max_seqs
        end = self.end(seq)
        lo = max(0, end - lo)
        hi = lo + n
        keys = self.chain(self.conv[seq] if conv is None else conv, lo // self.bt * self.bt, max(hi, lo + 1))
        call = lambda p: p.store.publish(p.st, seq, keys, lo, hi)  # noqa: E731
        if conv is None or conv == self.conv[seq]:
            self.moves(self.all4(call), self.ring, self.table)
            return
        # Another conversation's keys over this sequence's rows: a held store refuses a key it
        # holds with other rows; an external store cannot see rows, so it is not asked then.
        held = [outcome(call, p) for p in self.pairs[:2]]
        if held[0][0] == "raise" and "already held with other rows" in held[0][1][1]:
            assert held[0][1] == held[1][1], held
            event("rejected: a held block with other rows")
            return
        outs = self.agree(held + [outcome(call, p) for p in self.pairs[2:]])
        self.moves(outs, self.ring, self.table)
        if outs[0][0] == "ok":  # undo, so that the keys keep their conversation's rows
            assert len({outcome(lambda p: p.store.evict(keys), p) for p in self.pairs}) == 1

    @rule(seq=SEQ, conv=hs.integers(0, CONVS - 1), h=hs.integers(0, 320) | hs.sampled_from(["last", "block"]),
          which=hs.integers(0, 1000), extra=hs.integers(0, 12), shift=hs.sampled_from([0, 0, 0, 0, 1, -1]))
    def hit(self, seq, conv, h, which, extra, shift):
        """A new request whose first h tokens hit the server's prefix cache; then prefill the rest.

        ``h`` is any length, or that of a request that published ("last": where a multi-turn
        conversation's next request hits; "block": its last full block)."""
        seq %= self.cfg.max_seqs
        if isinstance(h, str):
            if not self.published:
                return
            mode = h
            conv, h = self.published[which % len(self.published)]
            if mode == "block":
                h = h // self.bt * self.bt
        keys = self.chain(conv, 0, h)
        if shift and keys:  # a chain that does not match the positions (or the wrong length)
            keys = keys[1:] if shift < 0 else keys + [b"extra"]
        kw, bad = self.prompt_kw(self.ids[conv][:h])
        before = self.image() if bad else None
        outs = self.all4(lambda p: p.store.hit(p.st, seq, keys, h, **kw))
        if bad:
            self.refused(before, outs, kw)
            return
        self.moves(outs, self.table, self.ring)
        if outs[0][0] != "ok":
            return
        hits = [o[1] for o in outs]
        assert all(x.as_dict() == hits[0].as_dict() for x in hits), [x.as_dict() for x in hits]
        r = hits[0]
        event("hit: " + ("empty" if h == 0 else "complete" if r.complete and r.exact else
                         "replay" if r.exact else "short prompt, rows missing deep"))
        assert r.replay_from <= h and (h - r.replay_from <= self.cfg.w_keep or r.replay_from == 0 and h <= self.cfg.w_keep)
        self.conv[seq] = conv
        self.feed(seq, r.replay_from, min(MAX_LEN, h + extra))

    @rule(picks=hs.lists(hs.tuples(SEQ, hs.integers(0, 3), hs.integers(1, 3), hs.integers(0, 7)), min_size=1,
                         max_size=4))
    def publish_many(self, picks):
        """One step's publishes of several sequences (their own conversations' keys): mostly the
        last blocks before a sequence's end, sometimes any range (entries refused at any place);
        two entries may carry the same new block."""
        seqs, keys, los, his = [], [], [], []
        for seq, back, blocks, skew in picks:
            seq %= self.cfg.max_seqs
            if seq in seqs:
                continue
            end = self.end(seq)
            lo = max(0, (end // self.bt - back) * self.bt) + (skew if skew > 4 else 0)
            n = min(blocks * self.bt, max(end - lo, 1)) + (skew if skew == 4 else 0)
            seqs.append(seq)
            keys.append(self.chain(self.conv[seq], lo // self.bt * self.bt, max(lo + n, lo + 1)))
            los.append(lo)
            his.append(lo + n)
        outs = self.all4(lambda p: p.store.publish_many(p.st, seqs, keys, los, his))
        event(f"publish_many: {outs[0][0]}")
        self.moves(outs, self.ring, self.table)

    @rule(picks=hs.lists(hs.tuples(SEQ, hs.integers(0, 1000), hs.integers(0, 12)), min_size=1, max_size=3),
          whole=hs.booleans())
    def hit_many(self, picks, whole):
        """Several new requests in one step, each hitting a published conversation (where its next
        turn hits, or at its last full block); then each prefills the rest."""
        if not self.published:
            return
        seqs, keys, hs_, convs, extras = [], [], [], [], []
        for seq, which, extra in picks:
            seq %= self.cfg.max_seqs
            if seq in seqs:
                continue
            conv, h = self.published[which % len(self.published)]
            h = h if whole else h // self.bt * self.bt
            seqs.append(seq)
            keys.append(self.chain(conv, 0, h))
            hs_.append(h)
            convs.append(conv)
            extras.append(extra)
        flat = np.concatenate([self.ids[c][:h] for c, h in zip(convs, hs_)])
        kw, bad = self.prompt_kw(flat)
        before = self.image() if bad else None
        outs = self.all4(lambda p: p.store.hit_many(p.st, seqs, keys, hs_, **kw))
        if bad:
            self.refused(before, outs, kw)
            return
        self.moves(outs, self.table, self.ring)
        if outs[0][0] != "ok":
            return
        results = [[h.as_dict() for h in o[1]] for o in outs]
        assert all(r == results[0] for r in results), results
        for seq, conv, h, extra, r in zip(seqs, convs, hs_, extras, outs[0][1]):
            self.conv[seq] = conv
            self.feed(seq, r.replay_from, min(MAX_LEN, h + extra))

    @rule(seq=SEQ, rounds=hs.integers(1, 6), n_accepted=hs.integers(0, 4), close=hs.sampled_from(["commit", "fail"]))
    def rounds(self, seq, rounds, n_accepted, close):
        """Rounds as a server drives them: draft, check the plans, close, verify B + 1 rows, accept."""
        seq %= self.cfg.max_seqs
        b = self.cfg.block_size
        for _ in range(rounds):
            end = self.end(seq)
            if end + b + 1 > MAX_LEN:
                return
            outs = self.all4(lambda p, end=end: p.st.draft(seq, end))
            if outs[0][0] == "ok":
                self.check_plans([o[1] for o in outs])
                if outs[0][1].skip is None:
                    self.all4(lambda p: p.st.commit(seq) if close == "commit" else p.st.fail(seq, "decode"))
            self.feed(seq, end, end + b + 1)
            self.all4(lambda p: p.st.accept(seq, min(n_accepted, b)))

    def check_plans(self, plans):
        a = plans[0]
        for x in plans[1:]:
            assert (x.skip, x.start, x.rebase, x.clear_cache, x.crop_from, x.pos_base) == (
                a.skip, a.start, a.rebase, a.clear_cache, a.crop_from, a.pos_base)
            assert np.array_equal(x.positions, a.positions) and np.array_equal(x.block_positions, a.block_positions)
        assert a.encoded_rows.tobytes() == plans[1].encoded_rows.tobytes()
        assert np.array_equal(plans[2].slots, plans[3].slots)
        assert self.ring[plans[2].slots].tobytes() == a.encoded_rows.tobytes()

    @rule(conv=hs.integers(0, CONVS - 1), lo=hs.integers(0, 30), n=hs.integers(1, 3))
    def evict(self, conv, lo, n):
        """The server's KV cache dropped some blocks."""
        keys = self.chain(conv, lo * self.bt, (lo + n) * self.bt)
        outs = self.all4(lambda p: p.store.evict(keys))
        assert len({o[1] for o in outs}) == 1

    @rule(conv=hs.integers(0, CONVS - 1), lo=hs.integers(0, 20), n=hs.integers(1, 80), other=hs.booleans())
    def publish_rows(self, conv, lo, n, other):
        """Rows given by the caller (a chunk longer than the window); with other rows, a held block is
        an error (held stores: the external ones cannot see rows and are not asked)."""
        lo *= self.bt
        hi = min(MAX_LEN, lo + n)
        keys = self.chain(conv, lo, hi)
        rows = self.rows[conv][lo:hi]
        if other:
            rows = rows * np.float32(0.5)
            outs = [outcome(p.store.publish_rows, keys, lo, hi, rows) for p in self.pairs[:2]]
            assert outs[0][0] == outs[1][0] and (outs[0][0] == "ok" or outs[0][1] == outs[1][1]), outs
            if outs[0][0] == "ok":  # nothing was held: undo, so that the keys keep their true rows
                for p in self.pairs[:2]:
                    p.store.evict(keys)
                for p in self.pairs[2:]:  # the same eviction counters
                    p.store.publish_slots(keys, lo, hi)
                    p.store.evict(keys)
            return
        outs = self.all4(lambda p: p.store.publish_slots(keys, lo, hi) if p.st.config.external_rows
                         else p.store.publish_rows(keys, lo, hi, rows))
        if outs[0][0] == "ok":
            slots = outs[2][1]
            assert np.array_equal(slots, outs[3][1])
            live = slots >= 0
            self.table[slots[live]] = self.encode(rows)[live]

    @precondition(lambda self: len(self.held.store) > 0)
    @rule(which=hs.integers(0, 10**6), damage=hs.sampled_from([None, None, "flip", "cut"]))
    def export_import(self, which, damage):
        """Export a block from every store (the same bytes), drop it, import it back."""
        keys = self.held.store.keys()
        key = keys[which % len(keys)]
        data = [p.store.export_block(key) for p in self.pairs[:2]]
        data += [p.store.export_block(key, self.table[p.store.block_slots(key)]) for p in self.pairs[2:]]
        assert all(d == data[0] for d in data)
        blob = bytearray(data[0])
        if damage == "flip":
            blob[which % len(blob)] ^= 1 << (which % 8)
        elif damage == "cut":
            del blob[-1 - which % 5:]
        self.all4(lambda p: p.store.evict([key]))
        outs = self.all4(lambda p: p.store.import_block(bytes(blob)))
        event(f"import: {outs[0][0]}")
        if outs[0][0] == "ok":
            slots = outs[2][1]
            assert np.array_equal(slots, outs[3][1])
            blk = prefix_block_format.unpack(bytes(blob), prefix_block_format.fingerprint(self.cfg), self.bt,
                                             self.cfg.w_keep)
            self.table[slots] = np.frombuffer(blk.rows, np.uint8).reshape(-1, self.cfg.row_bytes)

    # -- invariants -----------------------------------------------------
    @invariant()
    def same_everywhere(self):
        if not hasattr(self, "pairs"):
            return
        keys = self.held.store.keys()
        stats = {k: self.held.store.stats()[k] for k in SEMANTIC_PREFIX_STATS}
        assert stats["bytes"] <= self.held.store.budget_bytes
        if stats["evicted_lru"]:
            event("LRU evictions")
        if stats["republished"]:
            event("republished blocks")
        for p in self.pairs[1:]:
            assert p.store.keys() == keys, p.name
            assert {k: p.store.stats()[k] for k in SEMANTIC_PREFIX_STATS} == stats, p.name
        for s in range(self.cfg.max_seqs):
            state = self.held.st.state(s)
            counters = {k: self.held.st.stats(s)[k] for k in SEMANTIC_STATS}
            for p in self.pairs[1:]:
                assert p.st.state(s) == state, (p.name, s)
                assert {k: p.st.stats(s)[k] for k in SEMANTIC_STATS} == counters, (p.name, s)
                assert np.array_equal(p.st.accepted(s), self.held.st.accepted(s)), (p.name, s)
            if self.chain_kind:  # the ids beside the rows: the same everywhere, the conversation's own
                lo, hi = self.held.st.buffered_positions(s)
                ids = self.held.st.tokens(s, lo, hi)
                for p in self.pairs[1:]:
                    assert np.array_equal(p.st.tokens(s, lo, hi), ids), (p.name, s)
                if state["started"]:
                    assert np.array_equal(ids, self.ids[self.conv[s]][lo:hi]), s
        # The Stagers' totals: a prefix start keeps the replaced request's counters in them.
        totals = self.held.st.totals()
        for p in self.pairs[1:]:
            t = p.st.totals()
            assert {k: t.stats[k] for k in SEMANTIC_STATS} == {k: totals.stats[k] for k in SEMANTIC_STATS}, p.name
            assert np.array_equal(t.accepted, totals.accepted), p.name
        # The mirror of the store's table holds the held store's rows.
        for k in keys:
            slots = self.xcore.store.block_slots(k)
            assert np.array_equal(slots, self.pairs[3].store.block_slots(k))
            assert self.xcore.store.export_block(k, self.table[slots]) == self.held.store.export_block(k)


PrefixStoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPrefixStoreMachine = PrefixStoreMachine.TestCase
