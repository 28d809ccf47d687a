#!/usr/bin/env python3
"""A continuous-batching speculative-decoding server with a prefix cache and the prefix store.

The server keeps the target's KV cache in a vLLM-style block manager (written
below: 16-token blocks, chained block hashes, reference counts, a bounded pool
whose unreferenced cached blocks are evicted least recently used first) and
the drafter's feature rows of cached blocks in a ``dspark_core.PrefixStore``
under the same keys, so a request that hits the KV cache starts its drafter
from the rows a full prefill would have staged. The workload is a chat
service: conversations share a long system prompt (longer than the drafter's
window ``W``, so the first round after a hit rebases), each turn's prompt is
the previous conversation plus new user tokens, and turns arrive at different
steps; a free slot takes the next request that has arrived and fits the pool.

One scheduler step, for every sequence at once, with one call of each kind and
no per-sequence loop around the core:

* ``store.hit_many(stager, seqs, keys, n_tokens)`` for the admitted requests
  (each one's chain of cached block keys and the cached length the block
  manager found; 0 for a miss): each prefills from ``hit.replay_from``, and
  when the store lacked rows the block manager drops the KV blocks past it;
* ``store.evict(keys)``: the cached blocks the KV pool evicted while it
  allocated this step's blocks;
* ``draft_many`` for the sequences past their prefill, the (fake) drafter for
  the whole batch, ``commit_many`` / ``fail_many`` (injected drafter failures);
* one target forward for the step, prefill chunks and verify batches together,
  and one ``process_many`` of all its rows (flat, ``cu_seqlens``);
* ``accept_many`` for the verified sequences;
* ``store.publish_many(stager, seqs, keys, starts, ends)``: the blocks that
  became full this step (the block manager hashes and caches them), and at a
  request's end its last, partial block (docs/prefix_cache.md: the next turn
  of the conversation hits there);
* ``end_many`` for the finished requests.

``--rows external``: the Stager holds no row bytes; a ``HostRing`` keeps them
and a ``HostPrefixTable`` the store's (``ring.write_many`` for the forward's
rows, ``ring.gather(batch_plan)`` for the drafter batch,
``table.hit_many(ring, ...)`` / ``table.publish_many(ring, ...)``, which apply
their copies).

The fake target and drafter are those of examples/minimal_server.py (no model
files), run for a whole step at a time. Checked at runtime, exit status 1 if
anything fails:

* every first round stages exactly what a full prefill of the same tokens
  stages: a second, held Stager prefills each such request's whole prompt and
  drafts, and the plans (skip, rebase, clear_cache, pos_base, positions, block
  positions, crop_from) and the staged rows' bytes must be equal (that
  Stager's calls are the check's, not the server's: they are not counted);
* every request's output equals the fake target's plain greedy decoding
  (lossless), and every staged row is the target's row at its position
  (exactly, in f32 storage);
* the drafter's cache holds exactly drafter positions ``[0, block start)``
  before each block and never sees a position ``>= W``.

    python examples/prefix_server.py
    python examples/prefix_server.py --rows external --storage q8_0
    python examples/prefix_server.py --slots 8 --requests 32 --storage f32
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np
from minimal_server import BLOCK, MASSIVE, VOCAB, WINDOW, D, FakeDrafter, FakeTarget, greedy, next_token

from dspark_core import HostPrefixTable, HostRing, PrefixStore, Stager, StagerConfig

BLOCK_TOKENS = 16  # the KV cache's block size (vLLM's default), and the store's block_tokens
SYSTEM_TOKENS = 384  # the system prompt every conversation starts with (W = 64)
TURNS = 4  # requests per conversation
USER_TOKENS = (8, 40)  # new user tokens per turn (uniform in [lo, hi))
GENERATE = (24, 72)  # tokens generated per turn
THINK_STEPS = (0, 8)  # steps between a reply and the conversation's next turn


def block_key(prev: int, tokens: np.ndarray | list[int]) -> int:
    """A block's key: the hash of the previous block's key and the block's tokens (chained, as
    vLLM's block hashes), 63 bits. A partial block hashes fewer tokens, so it never shares a key
    with a full one."""
    data = prev.to_bytes(8, "little") + np.asarray(tokens, "<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class BlockManager:
    """A vLLM-style KV block pool.

    ``n_blocks`` physical blocks of ``BLOCK_TOKENS`` tokens, each with a
    reference count and, once full (or at a request's end, partial), a chained
    hash under which it is cached. Unreferenced blocks wait in a free queue in
    eviction order (least recently used first); allocating takes the head,
    and a cached block taken there is evicted: its key goes to ``evicted``,
    which the server passes to ``store.evict``. A block a request frees keeps
    its hash (it may be hit again until it is evicted).
    """

    def __init__(self, n_blocks: int) -> None:
        self.ref = [0] * n_blocks
        self.key: list[int | None] = [None] * n_blocks
        self.cached: dict[int, int] = {}  # key -> block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(n_blocks))
        self.evicted: list[int] = []  # keys evicted since the server last took them
        self.evictions = 0

    def n_free(self) -> int:
        return len(self.free)

    def match(self, tokens: np.ndarray) -> tuple[int, list[int], list[int], int | None]:
        """The longest cached prefix of ``tokens``, leaving at least one token to compute.

        Returns ``(h, keys, blocks, partial)``: ``h`` cached tokens, the keys of
        their blocks (the last one partial when ``h`` is not a multiple of the
        block size), the full blocks to reference, and the cached partial
        block (or None), which the request copies rather than shares.
        """
        bt, limit = BLOCK_TOKENS, len(tokens) - 1
        keys: list[int] = []
        blocks: list[int] = []
        prev = h = 0
        while h + bt <= limit:
            k = block_key(prev, tokens[h:h + bt])
            b = self.cached.get(k)
            if b is None:
                break
            keys.append(k)
            blocks.append(b)
            prev, h = k, h + bt
        for e in range(min(h + bt - 1, limit), h, -1):  # a partial block cached at a request's end
            k = block_key(prev, tokens[h:e])
            b = self.cached.get(k)
            if b is not None:
                keys.append(k)
                return e, keys, blocks, b
        return h, keys, blocks, None

    def reference(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def touch(self, b: int) -> None:
        """A cached block read without being shared: most recently used."""
        if self.ref[b] == 0:
            self.free.move_to_end(b)

    def allocate(self) -> int:
        b, _ = self.free.popitem(last=False)
        k = self.key[b]
        if k is not None:  # the least recently used cached block: evicted
            del self.cached[k]
            self.key[b] = None
            self.evicted.append(k)
            self.evictions += 1
        self.ref[b] = 1
        return b

    def release(self, blocks: list[int]) -> None:
        """Drop one reference of each block; the last blocks of a request are evicted first."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def cache(self, b: int, k: int) -> None:
        """Block ``b`` holds the tokens of key ``k`` now. A key another block caches already
        (a request that computed the same prefix at the same time) leaves ``b`` uncached."""
        if k not in self.cached:
            self.cached[k] = b
            self.key[b] = k

    def take_evicted(self) -> list[int]:
        out, self.evicted = self.evicted, []
        return out


class PoolTooSmall(RuntimeError):
    pass


class StepTarget:
    """minimal_server's fake target, for a whole step's flat batch of (position, token) pairs."""

    def __init__(self) -> None:
        t = FakeTarget()
        self.embedding, self.noise = t.embedding, t.noise
        self.channels = np.array([c for c, _ in MASSIVE])
        self.values = np.array([v for _, v in MASSIVE])

    def rows(self, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        r = self.embedding[tokens] + self.noise[positions]
        r[positions == 0] *= np.float32(100.0)  # the first position's hidden state has a huge norm
        r[:, self.channels] = self.values * (1.0 + 0.01 * np.sin(positions))[:, None]
        return r


class DrafterError(RuntimeError):
    pass


class StepDrafter:
    """minimal_server's fake drafter for a whole batch plan: each slot's drafter KV cache is
    ``[0, n_cached)`` (drafter positions), checked against every plan."""

    def __init__(self, embedding: np.ndarray, slots: int, fail_every: int) -> None:
        fd = FakeDrafter(embedding, 0)
        self.clean, self.unit = fd.clean, fd.unit
        self.n_cached = np.zeros(slots, np.int64)
        self.last_row = np.zeros((slots, D), np.float32)  # the cached row at n_cached - 1
        self.decodes = np.zeros(slots, np.int64)
        self.fail_every = fail_every
        self.max_position = -1

    def reset(self, seqs: list[int]) -> None:
        self.n_cached[seqs] = 0
        self.decodes[seqs] = 0

    def decode(self, plan, ctx: np.ndarray, n_pasts: np.ndarray, lasts: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One drafter batch: returns (batch indices drafted, their drafts (n, B), indices failed)."""
        idx = np.flatnonzero(plan.active)
        seqs = plan.seqs[idx]
        self.decodes[seqs] += 1
        cached = np.where(plan.clear_cache[idx], 0, self.n_cached[seqs])
        fail = (self.decodes[seqs] % self.fail_every == 0) if self.fail_every else np.zeros(len(idx), bool)
        self.n_cached[seqs[fail]] = cached[fail]  # an injected failure: after the clear, before the decode
        go, gs, cached = idx[~fail], seqs[~fail], cached[~fail]
        lo, n = plan.row_offsets[go], plan.n_rows[go].astype(np.int64)
        bpos = plan.block_positions[go].astype(np.int64)
        first = bpos[:, 0]
        start = first - n
        # The context rows are drafter positions [start, first) in order, on top of a cache
        # holding [0, cached): together exactly [0, first); the block follows at once.
        flat = np.concatenate([np.arange(a, a + k) for a, k in zip(lo, n)]) if len(go) else np.zeros(0, np.int64)
        want = np.repeat(start, n) + (np.arange(len(flat)) - np.repeat(np.cumsum(n) - n, n))
        problems = []
        if not np.array_equal(plan.positions[flat], want):
            problems.append("context positions are not contiguous up to the block")
        if np.any(start > cached) or np.any(cached > first) or np.any(first < 1):
            problems.append("the drafter's cache would not hold exactly [0, block start)")
        if not np.array_equal(bpos, first[:, None] + np.arange(BLOCK)):
            problems.append("block positions are not consecutive")
        if len(go) and (int(bpos[:, -1].max()) >= WINDOW or int(plan.positions[flat].min(initial=0)) < 0):
            problems.append(f"a drafter position outside [0, {WINDOW})")
        if not np.array_equal(plan.pos_base[go] + first, n_pasts[go]):
            problems.append("the block does not start at the target's n_past")
        if problems:
            raise AssertionError("drafter: " + "; ".join(problems))
        if len(go):
            self.max_position = max(self.max_position, int(bpos[:, -1].max()))
        rows = self.last_row[gs]
        has = n > 0
        rows[has] = ctx[lo[has] + n[has] - 1]
        self.last_row[gs] = rows
        prev = (rows[:, self.clean] @ self.unit.T).argmax(axis=1)  # the token before `last`, read from its row
        cur = lasts[go].astype(np.int64)
        drafts = np.empty((len(go), BLOCK), np.int64)
        for k in range(BLOCK):  # minimal_server's rule: wrong for one token in five
            guess = next_token(prev, cur)
            prev, cur = cur, np.where(cur % 5 == 0, (guess + 1) % VOCAB, guess)
            drafts[:, k] = cur
        self.n_cached[gs] = np.minimum(first, plan.crop_from[go])  # the block is cropped again
        return go, drafts, idx[fail]


@dataclass
class Request:
    rid: int
    conv: int
    turn: int
    arrival: int
    prompt: np.ndarray
    generate: int


@dataclass
class Seq:
    """A slot serving a request: its tokens, KV blocks and where it stands."""

    req: Request
    tokens: list[int]  # prompt + generated; the KV holds positions [0, n_past)
    n_past: int = 0
    last: int = -1  # sampled, not decoded yet
    out: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)  # KV blocks, by block index
    reserved: int = 0  # blocks this request may come to hold
    keys: list[int] = field(default_factory=list)  # chained keys of its full blocks
    published: int = 0  # blocks below it are in the store (or were not publishable)
    hit: int = 0  # cached tokens its KV hit found
    first_check: bool = True  # its first round is compared with a full prefill's

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.req.prompt)


@dataclass
class Counters:
    steps: int = 0
    max_batch: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    failures: int = 0
    hits: int = 0
    full_hits: int = 0
    cached_tokens: int = 0
    not_prefilled: int = 0
    replayed: int = 0
    prompt_tokens: int = 0
    prefilled: int = 0
    first_checked: int = 0
    first_after_hit: int = 0
    first_equal: int = 0
    finished: int = 0
    lossless: int = 0
    max_rel_err: float = 0.0
    published_blocks: int = 0
    calls: list[int] = field(default_factory=list)


class PrefixServer:
    def __init__(self, storage: str, rows: str, slots: int, kv_blocks: int, store_bytes: int, fail_every: int) -> None:
        self.cfg = StagerConfig(feature_dim=D, block_size=BLOCK, window=WINDOW, storage=storage, rows=rows,
                                max_seqs=slots, strict=True)
        self.st = Stager(self.cfg)
        self.store = PrefixStore(self.cfg, BLOCK_TOKENS, store_bytes)
        self.external = rows == "external"
        if self.external:
            self.ring = HostRing(self.st)
            self.table = HostPrefixTable(self.store, self.ring)
        # The checker: a held Stager of the same storage that prefills whole prompts.
        self.full = Stager(StagerConfig(feature_dim=D, block_size=BLOCK, window=WINDOW, storage=storage,
                                        max_seqs=slots, strict=True))
        self.n_slots = slots
        # Prefill chunks of at most W - max(K, block): a block a chunk completes still has its rows
        # in the ring when it is published after the step (docs/prefix_cache.md, "When to publish").
        self.chunk = WINDOW - max(self.cfg.w_keep, BLOCK_TOKENS)
        self.target = StepTarget()
        self.drafter = StepDrafter(self.target.embedding, slots, fail_every)
        self.bm = BlockManager(kv_blocks)
        self.promised = 0  # blocks admitted requests may still allocate
        self.seqs: dict[int, Seq] = {}
        self.c = Counters()
        self.calls: Counter[str] = Counter()
        self.failures: list[str] = []

    # -- bookkeeping -----------------------------------------------------------------
    def core(self, name: str, fn, *args):
        """Every dspark_core call of the serving loop goes through here, to be counted."""
        self.calls[name] += 1
        return fn(*args)

    def check(self, ok: bool, what: str) -> None:
        if not ok and len(self.failures) < 20:
            self.failures.append(what)

    # -- admission -------------------------------------------------------------------
    def admit(self, waiting: list[Request], step: int) -> list[tuple[int, list[int], int, int | None]]:
        """Free slots take arrived requests (in arrival order) while the KV pool can hold them.

        Returns ``(seq, keys, h, partial block)`` per admitted request: its KV
        hit, which the block manager already references.
        """
        admitted = []
        bm = self.bm
        while waiting and waiting[0].arrival <= step and len(self.seqs) < self.n_slots:
            req = waiting[0]
            h, keys, blocks, partial = bm.match(req.prompt)
            need = -(-(len(req.prompt) + req.generate + BLOCK + 1) // BLOCK_TOKENS)
            free_hits = sum(1 for b in blocks if bm.ref[b] == 0)
            # A replay drops the blocks past replay_from >= h - K, which other requests may still share:
            # room for their replacements too, so that the pool never promises more than it has.
            droppable = min(len(blocks), -(-self.cfg.w_keep // BLOCK_TOKENS))
            if bm.n_free() - free_hits - self.promised < need - len(blocks) + droppable:
                if not self.seqs:
                    raise PoolTooSmall(f"request {req.rid} needs {need} KV blocks, more than the pool's "
                                       f"{len(bm.ref)} (--kv-blocks)")
                break  # the pool is full: the request waits (first come, first served)
            waiting.pop(0)
            bm.reference(blocks)
            if partial is not None:
                bm.touch(partial)
            seq = min(set(range(self.n_slots)) - set(self.seqs))
            self.seqs[seq] = Seq(req, [int(t) for t in req.prompt], table=list(blocks), reserved=need)
            self.promised += need - len(blocks)
            admitted.append((seq, keys, h, partial))
        return admitted

    def grow(self) -> None:
        """Allocate the blocks each sequence's tokens of this step need (evicting cached blocks)."""
        for s in self.seqs.values():
            n = min(len(s.req.prompt), s.n_past + self.chunk) if s.prefilling else s.n_past + BLOCK + 1
            while len(s.table) * BLOCK_TOKENS < n:
                s.table.append(self.bm.allocate())
                self.promised -= 1

    def start(self, admitted, hits) -> None:
        """Each admitted request prefills from ``hit.replay_from``; the KV hit shrinks to match."""
        c = self.c
        for (seq, keys, h, _), hit in zip(admitted, hits):
            s = self.seqs[seq]
            r = hit.replay_from
            keep = r // BLOCK_TOKENS  # full blocks below the replay point stay shared
            if keep < len(s.table):
                dropped = s.table[keep:]
                del s.table[keep:]
                self.bm.release(dropped)
                self.promised += len(dropped)
            s.n_past = r
            s.hit = h
            s.keys = list(keys[:keep])
            # The block holding r is published once full if its rows from its start are held.
            s.published = keep if keep * BLOCK_TOKENS >= hit.first_row else -(-r // BLOCK_TOKENS)
            self.drafter.reset([seq])
            c.prompt_tokens += len(s.req.prompt)
            c.not_prefilled += r
            c.replayed += h - r
            if h:
                c.hits += 1
                c.cached_tokens += h
                c.full_hits += r == h

    # -- the step ---------------------------------------------------------------------
    def step(self, waiting: list[Request], step: int) -> list[tuple[Request, list[int]]]:
        """One scheduler step; returns the finished requests and their replies."""
        c, st = self.c, self.st
        self.calls.clear()
        admitted = self.admit(waiting, step)
        if not self.seqs:
            return []
        c.steps += 1
        c.max_batch = max(c.max_batch, len(self.seqs))
        if admitted:
            seqs = [a[0] for a in admitted]
            keys = [a[1] for a in admitted]
            h = [a[2] for a in admitted]
            if self.external:
                hits = self.core("hit_many", self.table.hit_many, self.ring, seqs, keys, h)
            else:
                hits = self.core("hit_many", self.store.hit_many, st, seqs, keys, h)
            self.start(admitted, hits)
        self.grow()
        evicted = self.bm.take_evicted()
        if evicted:  # the KV pool dropped them: so does the store
            self.core("evict", self.store.evict, evicted)

        order = sorted(self.seqs)
        decoding = [q for q in order if not self.seqs[q].prefilling]
        drafts: dict[int, np.ndarray] = {}
        if decoding:
            drafts = self.draft(decoding)

        # One target forward: prefill chunks and verify batches, flat.
        tok_l, pos_l, prev_l, lens = [], [], [], []
        for q in order:
            s = self.seqs[q]
            if s.prefilling:
                toks = s.tokens[s.n_past:min(len(s.req.prompt), s.n_past + self.chunk)]
            else:
                toks = [s.last, *drafts[q].tolist()] if q in drafts else [s.last]
            p0 = s.n_past
            tok_l += toks
            pos_l += range(p0, p0 + len(toks))
            prev_l += [s.tokens[p0 - 1] if p0 else 0] + toks[:-1]
            lens.append(len(toks))
        tokens = np.asarray(tok_l, np.int64)
        positions = np.asarray(pos_l, np.int64)
        rows = self.target.rows(positions, tokens)
        nxt = next_token(np.asarray(prev_l, np.int64), tokens)
        cu = np.concatenate([[0], np.cumsum(lens)])
        if self.external:
            self.core("write_many", self.ring.write_many, order, cu, positions, rows)
        else:
            self.core("process_many", st.process_many, order, cu, positions, rows)

        n_acc = []
        for i, q in enumerate(order):
            s = self.seqs[q]
            lo, hi = int(cu[i]), int(cu[i + 1])
            if s.prefilling:
                s.n_past += hi - lo
                c.prefilled += hi - lo
                if not s.prefilling:
                    s.last = int(nxt[hi - 1])
                    s.out = [s.last]
                    s.tokens.append(s.last)
                continue
            n = 0
            if q in drafts:
                d = drafts[q]
                while n < BLOCK and d[n] == nxt[lo + n]:
                    n += 1
                c.drafted += BLOCK
                c.accepted += n
                new = d[:n].tolist()
            else:
                new = []
            s.n_past += n + 1
            s.last = int(nxt[lo + n])
            new.append(s.last)
            s.out += new
            s.tokens += new
            n_acc.append(n)
        if decoding:
            self.core("accept_many", st.accept_many, decoding, n_acc)

        # Blocks that became full (the block manager caches them) and, at a request's end, its
        # partial last block: one publish for the step.
        done = [q for q in order if not self.seqs[q].prefilling and len(self.seqs[q].out) >= self.seqs[q].req.generate]
        self.publish(order, set(done))
        nxt_turns = []
        if done:
            self.core("end_many", st.end_many, done)
            for q in done:
                nxt_turns += self.finish(q, step)
        c.calls.append(sum(self.calls.values()))
        self.check(max(self.calls.values(), default=0) <= 1, f"step {step}: more than one call of a kind: {self.calls}")
        return nxt_turns

    def draft(self, decoding: list[int]) -> dict[int, np.ndarray]:
        st, c = self.st, self.c
        n_pasts = np.array([self.seqs[q].n_past for q in decoding], np.int64)
        plan = self.core("draft_many", st.draft_many, decoding, n_pasts)
        if self.external:
            ctx = self.core("gather", self.ring.gather, plan)
        else:
            ctx = np.asarray(plan.rows, np.float32)
        self.check_rows(plan, ctx)
        self.check_first_rounds(plan)
        lasts = np.array([self.seqs[q].last for q in decoding], np.int64)
        go, d, failed = self.drafter.decode(plan, ctx, n_pasts, lasts)
        c.rounds += len(go) + len(failed)
        c.failures += len(failed)
        if len(go):
            self.core("commit_many", st.commit_many, plan.seqs[go])
        if len(failed):
            self.core("fail_many", st.fail_many, plan.seqs[failed], "decode")
        return {int(q): d[j] for j, q in enumerate(plan.seqs[go])}

    def publish(self, order: list[int], finishing: set[int]) -> None:
        seqs, keys, starts, ends = [], [], [], []
        claimed: set[int] = set()  # a block new to the store goes in one entry of a batch
        for q in order:
            s = self.seqs[q]
            # The KV holds final rows up to n_past; a finishing request keeps its reply's.
            kv = min(s.n_past, len(s.req.prompt) + s.req.generate)
            while (len(s.keys) + 1) * BLOCK_TOKENS <= kv:
                j = len(s.keys)
                k = block_key(s.keys[-1] if s.keys else 0, s.tokens[j * BLOCK_TOKENS:(j + 1) * BLOCK_TOKENS])
                s.keys.append(k)
                self.bm.cache(s.table[j], k)
            # (key, start, end) of the blocks to hand over: the full ones not published yet ...
            blocks = [(k, j * BLOCK_TOKENS, (j + 1) * BLOCK_TOKENS)
                      for j, k in enumerate(s.keys[s.published:], s.published)]
            if q in finishing and kv % BLOCK_TOKENS:  # ... and at the end, the partial last block
                j = len(s.keys)
                k = block_key(s.keys[-1] if s.keys else 0, s.tokens[j * BLOCK_TOKENS:kv])
                self.bm.cache(s.table[j], k)
                if s.published <= j:
                    blocks.append((k, j * BLOCK_TOKENS, kv))
            # Requests that computed the same prefix in the same step: a block goes in one entry
            # of the batch. Blocks an earlier entry has are skipped at the front; at the first one
            # further on the entry stops (it goes on from there next step).
            lead = 0
            while lead < len(blocks) and blocks[lead][0] in claimed:
                lead += 1
            take = lead
            while take < len(blocks) and blocks[take][0] not in claimed:
                take += 1
            if take:
                s.published = min(s.published + take, len(s.keys))
            if take == lead:
                continue
            chain = [k for k, _, _ in blocks[lead:take]]
            claimed.update(chain)
            seqs.append(q)
            keys.append(chain)
            starts.append(blocks[lead][1])
            ends.append(blocks[take - 1][2])
            self.c.published_blocks += len(chain)
        if seqs:
            if self.external:
                self.core("publish_many", self.table.publish_many, self.ring, seqs, keys, starts, ends)
            else:
                self.core("publish_many", self.store.publish_many, self.st, seqs, keys, starts, ends)

    def finish(self, q: int, step: int) -> list[tuple[Request, list[int]]]:
        s = self.seqs.pop(q)
        req = s.req
        self.bm.release(s.table)
        self.promised -= s.reserved - len(s.table)
        reply = s.out[:req.generate]
        good = reply == greedy([int(t) for t in req.prompt], req.generate)
        self.check(good, f"request {req.rid}: the output differs from the target's greedy decoding")
        self.c.finished += 1
        self.c.lossless += good
        return [(req, reply)]

    # -- checks ---------------------------------------------------------------------------
    def check_rows(self, plan, ctx: np.ndarray) -> None:
        """Every staged row is the target's row at its absolute position."""
        n = plan.n_rows.astype(np.int64)
        if not n.sum():
            return
        pos = np.repeat(plan.pos_base.astype(np.int64), n) + plan.positions
        toks = np.concatenate([np.asarray(self.seqs[int(q)].tokens, np.int64)[pos[a:b]] for q, a, b in
                               zip(plan.seqs, plan.row_offsets[:-1], plan.row_offsets[1:])])
        want = self.target.rows(pos, toks)
        err = np.abs(ctx - want) / np.maximum(np.abs(want), 1e-30)
        self.c.max_rel_err = max(self.c.max_rel_err, float(err.max()))

    def check_first_rounds(self, plan) -> None:
        """Each sequence's first round against a Stager that prefilled its whole prompt."""
        idx = [i for i, q in enumerate(plan.seqs) if self.seqs[int(q)].first_check]
        if not idx:
            return
        seqs = plan.seqs[idx]
        n_pasts = np.array([self.seqs[int(q)].n_past for q in seqs], np.int64)
        positions = np.concatenate([np.arange(n) for n in n_pasts])
        tokens = np.concatenate([np.asarray(self.seqs[int(q)].tokens[:n], np.int64) for q, n in zip(seqs, n_pasts)])
        cu = np.concatenate([[0], np.cumsum(n_pasts)])
        full = self.full
        full.process_many(seqs, cu, positions, self.target.rows(positions, tokens))
        ref = full.draft_many(seqs, n_pasts)
        for j, i in enumerate(idx):
            s = self.seqs[int(plan.seqs[i])]
            s.first_check = False
            lo, hi = int(plan.row_offsets[i]), int(plan.row_offsets[i + 1])
            rlo, rhi = int(ref.row_offsets[j]), int(ref.row_offsets[j + 1])
            same = all(getattr(plan, f)[i] == getattr(ref, f)[j] for f in
                       ("active", "skip_code", "rebase", "clear_cache", "pos_base", "crop_from", "n_rows"))
            same = same and np.array_equal(plan.block_positions[i], ref.block_positions[j])
            same = same and np.array_equal(plan.positions[lo:hi], ref.positions[rlo:rhi])
            staged = (self.ring.table[plan.slots[lo:hi]] if self.external else plan.encoded_rows[lo:hi]).tobytes()
            same = same and staged == ref.encoded_rows[rlo:rhi].tobytes()
            self.c.first_checked += 1
            self.c.first_after_hit += s.hit > 0
            self.c.first_equal += same
            self.check(same, f"request {s.req.rid}: its first round differs from a full prefill's")
        full.end_many(seqs)


class Workload:
    """Conversations on one system prompt: turn ``t + 1`` arrives a few steps after turn ``t``'s reply,
    its prompt the conversation so far plus new user tokens."""

    def __init__(self, rng: np.random.Generator, requests: int) -> None:
        self.rng = rng
        self.total = requests
        self.conversations = -(-requests // TURNS)
        self.system = rng.integers(0, VOCAB, SYSTEM_TOKENS)
        self.made = 0
        self.waiting: list[Request] = []
        for conv in range(self.conversations):  # first turns: two conversations start per step
            self.add(conv, 0, self.system, conv // 2)

    def add(self, conv: int, turn: int, history: np.ndarray, arrival: int) -> None:
        if self.made >= self.total or turn >= TURNS:
            return
        rng = self.rng
        user = rng.integers(0, VOCAB, int(rng.integers(*USER_TOKENS)))
        req = Request(self.made, conv, turn, arrival, np.concatenate([history, user]), int(rng.integers(*GENERATE)))
        self.made += 1
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: (r.arrival, r.rid))

    def replied(self, req: Request, reply: list[int], step: int) -> None:
        think = int(self.rng.integers(*THINK_STEPS))
        self.add(req.conv, req.turn + 1, np.concatenate([req.prompt, reply]), step + 1 + think)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="held", choices=("held", "external"))
    ap.add_argument("--storage", default="bf16", choices=("f32", "f16", "bf16", "q8_0", "q4_0"))
    ap.add_argument("--slots", type=int, default=32, help="sequences served at once (default 32)")
    ap.add_argument("--requests", type=int, default=256,
                    help=f"requests in all, {TURNS} turns per conversation (default 256)")
    ap.add_argument("--kv-blocks", type=int, default=1024, help="blocks in the KV pool (default 1024)")
    ap.add_argument("--store-kib", type=int, default=3072, help="the prefix store's budget in KiB (default 3072)")
    ap.add_argument("--fail-every", type=int, default=7, help="fail every N-th decode of each drafter (0: never)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.slots < 1 or a.requests < 1:
        ap.error("--slots and --requests must be positive")

    t0 = time.perf_counter()
    srv = PrefixServer(a.storage, a.rows, a.slots, a.kv_blocks, a.store_kib << 10, a.fail_every)
    wl = Workload(np.random.default_rng(a.seed), a.requests)
    print(f"prefix_server: rows={a.rows} storage={a.storage} D={D} B={BLOCK} W={WINDOW} (K={srv.cfg.w_keep}), "
          f"{BLOCK_TOKENS}-token blocks, {a.slots} slots, {a.requests} requests ({wl.conversations} conversations "
          f"of up to {TURNS} turns on a {SYSTEM_TOKENS}-token system prompt), KV pool {a.kv_blocks} blocks, "
          f"store budget {a.store_kib} KiB")
    step = 0
    while wl.waiting or srv.seqs:
        try:
            finished = srv.step(wl.waiting, step)
        except PoolTooSmall as e:
            print(e)
            return 1
        for req, reply in finished:
            wl.replied(req, reply, step)
        step += 1
    wall = time.perf_counter() - t0

    c, bm = srv.c, srv.bm
    calls = np.asarray(c.calls)
    s = srv.store.stats()
    print(f"steps: {c.steps}, up to {c.max_batch} sequences per step; {c.rounds} drafter rounds, acceptance "
          f"{100 * c.accepted / max(1, c.drafted):.1f}%, {c.failures} drafter failures recovered")
    print(f"hits: {c.hits} of {c.finished} requests ({c.full_hits} found every row in the store), "
          f"{c.cached_tokens} cached tokens; not prefilled again thanks to the cache: {c.not_prefilled} of "
          f"{c.prompt_tokens} prompt tokens ({100 * c.not_prefilled / max(1, c.prompt_tokens):.1f}%; "
          f"{c.prefilled} prefilled), {c.replayed} replayed (rows the store lacked)")
    print(f"KV pool: {bm.evictions} cached blocks evicted (store.evict); store: {c.published_blocks} blocks "
          f"published, {s['blocks']} held in {s['bytes']} bytes, {s['evicted_lru']} evicted by its budget")
    print(f"first rounds equal to a full prefill's (plan and staged row bytes): {c.first_equal} of "
          f"{c.first_checked} ({c.first_after_hit} after a hit)")
    print(f"outputs equal to the target's greedy decoding: {c.lossless} of {c.finished}; staged rows vs the "
          f"target's rows: max relative error {c.max_rel_err:.3g}; largest drafter position "
          f"{srv.drafter.max_position} (W = {WINDOW})")
    print(f"dspark_core calls per step: mean {calls.mean():.1f}, max {calls.max()} (one of each kind at most, "
          f"whatever the number of sequences), {wall:.1f} s")

    srv.check(c.finished == a.requests, f"{c.finished} of {a.requests} requests finished")
    srv.check(c.first_checked == c.finished, "a request's first round was not checked")
    srv.check(c.prefilled + c.not_prefilled == c.prompt_tokens, "prompt tokens neither cached nor prefilled")
    srv.check(srv.drafter.max_position < WINDOW, "a drafter position reached W")
    srv.check(a.storage != "f32" or c.max_rel_err == 0, "f32 rows were not staged exactly")
    freed = all(srv.st.stats(q)["reserved_bytes"] == 0 for q in range(a.slots))
    srv.check(freed, "a slot's rows were not freed at the end")
    srv.check(srv.promised == 0 and not any(bm.ref), "the KV pool did not get every block back")
    for f in srv.failures:
        print(f"FAILED: {f}")
    print(f"lossless: {'yes' if not srv.failures else 'NO'}")
    return 0 if not srv.failures else 1


if __name__ == "__main__":
    sys.exit(main())
