"""A multi-turn chat workload with prefix caching: what a prefix-cache hit does to the drafter.

Conversations share a system prompt and extend their own history turn after
turn: each request is the previous request's prompt and reply plus a new user
message. The server keeps a prefix cache of the target's KV by block (chained
hashes of ``block_tokens`` tokens, plus the partial block at each request's
end, where the next turn hits), so a request only prefills what the cache
lacks. The drafter, though, needs feature rows of the positions before its
first round, which a hit never computes. Four ways to handle that, run side
by side on the same requests:

* ``off``: prefix caching off: every request prefills its whole prompt.
* ``cold``: the hit is taken and the drafter starts cold at the hit boundary
  (the sequence's first row is the first prefilled one; what engines that
  keep prefix caching on do today).
* ``replay``: the hit is shortened by ``K`` tokens and those are prefilled
  again, so the drafter gets ``K`` context rows ("prefix replay").
* ``store``: the hit is taken and a :class:`~dspark_core.PrefixStore` holds
  the rows of published blocks: the first round restages what a full
  prefill would have, and only a miss costs a replay (at most ``K`` tokens).

The toy target's rows carry the token it expects ``lookahead`` positions
later, and the toy drafter reads them from exactly that far back: with a
``lookahead`` longer than a user message, a cold drafter has nothing to read
for its first rounds after a hit, as a real drafter with too little context
has (its acceptance depends on its context rows). Every variant's output is
checked against the target's own greedy decoding (lossless).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .loop import SpeculativeLoop

__all__ = ["VARIANTS", "MultiTurnConfig", "PrefixCache", "Request", "RequestLoop", "Publisher", "PlanRecorder",
           "run_multiturn"]

#: The variants, in the order they are reported.
VARIANTS = ("off", "cold", "replay", "store")


@dataclass(frozen=True)
class MultiTurnConfig:
    """The workload and the models (defaults: ``dspark-core simulate --workload multiturn``)."""

    conversations: int = 3
    turns: int = 4
    system_tokens: int = 600
    user_tokens: int = 24
    generate: int = 96
    block: int = 8
    window: int = 512
    storage: str = "f32"
    feature_dim: int = 128
    lookahead: int = 48
    deviation: float = 0.0005
    block_tokens: int = 16
    budget_bytes: int = 4 << 20
    prefill_chunk: int = 256
    first_rounds: int = 8
    seed: int = 0
    seqs: int = 1
    rows: str = "held"


class PrefixCache:
    """The server's prefix cache (the target's KV, unbounded here): chained block keys.

    Block ``i`` of a prompt is ``tokens[i * bt:(i + 1) * bt]``; its key hashes
    the previous block's key and its tokens, so equal keys mean equal
    prefixes. A request's last, partial block is cached too (llama-server's
    prompt cache keeps the whole prompt; a multi-turn conversation's next
    request hits exactly there).
    """

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._keys: set[bytes] = set()

    def chain(self, tokens: np.ndarray, n: int) -> list[bytes]:
        """Keys of the blocks of ``tokens[:n]`` (the last one partial when ``n`` is not a multiple)."""
        out, prev = [], b""
        for s in range(0, n, self.block_tokens):
            prev = hashlib.blake2b(prev + tokens[s:min(s + self.block_tokens, n)].astype("<i8").tobytes(),
                                   digest_size=16).digest()
            out.append(prev)
        return out

    def add(self, tokens: np.ndarray, n: int) -> None:
        """The KV of ``tokens[:n]`` is cached now."""
        self._keys.update(self.chain(tokens, n))

    def hit(self, tokens: np.ndarray) -> int:
        """Tokens of the longest cached prefix of ``tokens``, leaving at least one to compute."""
        bt, n = self.block_tokens, len(tokens)
        keys = self.chain(tokens, n)
        h = 0
        for i, k in enumerate(keys):
            e = min((i + 1) * bt, n)
            if e - i * bt < bt or k not in self._keys:
                break
            h = e
        for e in range(min(h + bt - 1, n), h, -1):  # a partial block cached at a request's end
            if self.chain(tokens, e)[-1] in self._keys:
                h = e
                break
        return min(h, n - 1)


class PlanRecorder:
    """The Stager, recording each request's first plan (``first_plan``, its ``first_rows``) and
    the accepted counts of its rounds; ``restart()`` before each request."""

    def __init__(self, stager: Any) -> None:
        self._st = stager
        self.first_plan: Any = None
        self.first_rows: int | None = None
        self.accepted: list[int] = []

    def restart(self) -> None:
        self.first_plan, self.first_rows, self.accepted = None, None, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._st, name)

    def draft(self, seq: int, n_past: int, copy: bool = True) -> Any:
        plan = self._st.draft(seq, n_past, copy)
        if plan.skip is None and self.first_rows is None:
            self.first_plan, self.first_rows = plan, int(plan.n_rows)
        return plan

    def accept(self, seq: int, n: int) -> None:
        self.accepted.append(int(n))
        self._st.accept(seq, n)


@dataclass
class Request:
    """How :class:`RequestLoop` prefills one request.

    Attributes:
        replay_from: the target prefills ``[replay_from, len(prompt))``; its KV before that
            comes from the prefix cache.
        hit: the Stager's sequence was started by ``PrefixStore.hit`` (no ``begin``).
        restore: ``restore(target)`` loads the cached KV (a real engine's state restore) and
            leaves the target at ``replay_from``; without it the target is reset and, for a
            toy target, recomputes it (which is not counted as prefill).
        publish: ``publish(end)`` after each prefill chunk (the blocks complete below ``end``).
        prefilled: tokens the target prefilled (set by the loop).
    """

    replay_from: int = 0
    hit: bool = False
    restore: Callable[[Any], None] | None = None
    publish: Callable[[int], None] | None = None
    prefilled: int = 0


class RequestLoop(SpeculativeLoop):
    """The speculative loop, with a prefill that starts from a prefix-cache hit.

    ``request`` is the :class:`Request` of sequence 0, or of every sequence;
    ``requests`` (a dict by sequence, when set) gives each sequence its own.
    With ``batch_publish`` set, a request's ``publish`` is called for the
    chunks before its last, and ``batch_publish()`` once every sequence is
    prefilled. The loop records each sequence's first drafter round's context rows
    (``first_rows``) and the accepted counts of its rounds (``accepted``);
    ``restart()`` clears them before a new batch of requests.
    """

    request: Request = Request()
    requests: dict[int, Request] | None = None
    #: Called once the last sequence of ``requests`` is prefilled (a batch's one ``publish_many`` of
    #: its prompts' last blocks); until then each request publishes only the blocks of earlier chunks.
    batch_publish: Callable[[], Any] | None = None

    def restart(self) -> None:
        self.first_rows: dict[int, int] = {}
        self.accepted: dict[int, list[int]] = {}

    def _drafter_round(self, s: Any, plan: Any) -> np.ndarray | None:
        firsts = self.__dict__.setdefault("first_rows", {})
        firsts.setdefault(s.seq, int(plan.n_rows))
        return super()._drafter_round(s, plan)

    def _verify(self, s: Any, draft: np.ndarray) -> int:
        n = super()._verify(s, draft)
        self.__dict__.setdefault("accepted", {}).setdefault(s.seq, []).append(int(n))
        return n

    def _prefill(self, s: Any, tokens: Any) -> None:
        prompt = np.asarray(tokens, dtype=np.int64).reshape(-1)
        r = self.requests[s.seq] if self.requests is not None else self.request
        if r.restore is not None:
            r.restore(s.target)
            if s.target.n_past != r.replay_from:
                raise ValueError(f"restore left the target at {s.target.n_past}, not at {r.replay_from}")
        else:
            s.target.reset()
            if r.replay_from:  # the cached KV: the toy target recomputes its state, which is no prefill
                s.target.decode(prompt[:r.replay_from])
        if not r.hit:
            self._st("begin", s.seq)
        last = -1
        for lo in range(r.replay_from, len(prompt), self.prefill_chunk):
            out = self._tg(s, prompt[lo:lo + self.prefill_chunk])
            r.prefilled += len(out.rows)
            self._process(s, lo, out.rows, prompt[lo:lo + self.prefill_chunk])
            end = lo + len(out.rows)
            # The server hands over the blocks this chunk completed; with batch_publish, those of the
            # last chunk wait for the batch's one publish (the sequence's rows stay put till then).
            if r.publish is not None and (end < len(prompt) or self.batch_publish is None):
                r.publish(end)
            self._track_rows(s)
            last = int(out.next_tokens[-1])
        s.n_past = len(prompt)
        s.last = last
        s.out = [last]
        if self.batch_publish is not None and self.requests is not None and s.seq == max(self.requests):
            self.batch_publish()  # every sequence of the batch is prefilled: one publish for them all


class Publisher:
    """Publishes a request's blocks into the store as they complete (``PrefixStore.publish``).

    ``seq``: the request's sequence; ``table`` and ``ring`` (external rows): publish through
    ``table.publish(ring, ...)``, which applies the copies.
    """

    def __init__(self, store: Any, stager: Any, block_tokens: int, cached: int, keys: list[bytes], seq: int = 0,
                 table: Any = None, ring: Any = None) -> None:
        self.store, self.stager, self.bt, self.keys = store, stager, block_tokens, keys
        self.seq, self.table, self.ring = seq, table, ring
        self.done = cached // block_tokens * block_tokens  # full blocks below it are cached already

    def entry(self, end: int, partial: bool = False) -> tuple[list[bytes], int, int] | None:
        """``(keys, start, end)`` of the blocks complete below ``end`` not published yet (``partial``: and
        the one ending at ``end``), now counted as published; None when there are none. Only whole
        blocks inside the sequence's ``publishable`` range go in: blocks whose rows have left its
        window are skipped, and a partial block reaching past its final rows waits."""
        bt = self.bt
        first, last = self.stager.publishable(self.seq)
        if end > last:  # the rows past `last` are not final: the partial block's key is for `end`
            end, partial = last, False
        hi = end if partial else end // bt * bt
        lo = max(self.done, -(-first // bt) * bt)
        if hi <= lo:
            return None
        self.done = hi
        return self.keys[lo // bt: -(-hi // bt)], lo, hi

    def __call__(self, end: int, partial: bool = False) -> None:
        """Publish the blocks complete below ``end`` (``partial``: and the one ending at ``end``)."""
        e = self.entry(end, partial)
        if e is None:
            return
        if self.table is not None:
            self.table.publish(self.ring, self.seq, *e)
        else:
            self.store.publish(self.stager, self.seq, *e)


def publish_batch(store: Any, stager: Any, pubs: list[Publisher], ends: list[int], table: Any = None,
                  ring: Any = None, partial: bool = True) -> int:
    """One ``publish_many`` (``table.publish_many(ring, ...)``) for several requests' blocks up to
    ``ends`` (``partial``: and their partial last blocks). Requests on a shared prompt bring its new
    blocks in several entries: the first adds them, the others refresh them. Returns the number of
    entries."""
    seqs, keys, starts, stops = [], [], [], []
    for pub, end in zip(pubs, ends):
        e = pub.entry(end, partial)
        if e is None:
            continue
        chain, lo, hi = e
        seqs.append(pub.seq)
        keys.append(chain)
        starts.append(lo)
        stops.append(hi)
    if seqs:
        if table is not None:
            table.publish_many(ring, seqs, keys, starts, stops)
        else:
            store.publish_many(stager, seqs, keys, starts, stops)
    return len(seqs)


@dataclass
class _Totals:
    prefilled: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    after_hit: list[bool] = field(default_factory=list)
    first_rows: list[int] = field(default_factory=list)
    hits: int = 0
    first_accepted: int = 0
    first_drafted: int = 0
    accepted: int = 0
    drafted: int = 0
    replayed: int = 0
    lossless: bool = True


def _core_stager(config: Any) -> tuple[Any, str]:
    from .._ext._stager import Stager

    return Stager(config), "core"


def _store_for(stager: Any, config: Any, block_tokens: int, budget_bytes: int) -> Any:
    from ..reference import ReferencePrefixStore, ReferenceStager

    if isinstance(stager, ReferenceStager):
        return ReferencePrefixStore(config, block_tokens, budget_bytes)
    from .._ext._stager import PrefixStore

    return PrefixStore(config, block_tokens, budget_bytes)


def _ring_for(stager: Any, make_ring: Callable[[Any], Any] | None) -> Any:
    if make_ring is not None:
        return make_ring(stager)
    from ..rows.host_ring import HostRing

    return HostRing(stager)


def _table_for(store: Any, ring: Any) -> Any:
    """The store's table beside ``ring``: a ``cuda.PrefixTable`` for a ``DeviceRing``, else a ``HostPrefixTable``."""
    from ..prefix.host_table import HostPrefixTable
    from ..rows.host_ring import HostRing

    if isinstance(ring, HostRing):
        return HostPrefixTable(store, ring)
    from ..cuda import PrefixTable

    return PrefixTable(store, ring)


def run_multiturn(
    cfg: MultiTurnConfig,
    variants: tuple[str, ...] = VARIANTS,
    make_stager: Callable[[Any], tuple[Any, str]] = _core_stager,
    make_ring: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """Run the workload once per variant; returns the figures ``simulate --workload multiturn`` prints.

    ``make_stager(config) -> (stager, kind)`` builds each variant's Stager (the
    C++ core by default; the reference twin pairs with the reference store).

    ``cfg.seqs > 1``: the requests of a turn run ``seqs`` at a time, as one
    batch: one ``hit_many`` for the batch's hits, one ``publish_many`` for
    the prompts' blocks once all are prefilled (a prompt longer than a chunk
    publishes its earlier chunks' blocks as they complete, before later rows
    push them out), the loop's ``draft_many`` each round, and one
    ``publish_many`` for the replies' blocks at the end.
    ``cfg.rows == "external"``: the Stagers hold no rows; ``make_ring(stager)``
    (default: a :class:`~dspark_core.HostRing`) keeps them, and the store's rows
    are in a :class:`~dspark_core.HostPrefixTable` (a ``cuda.PrefixTable``
    beside a ``DeviceRing``), whose ``hit_many`` / ``publish`` /
    ``publish_many`` apply their copies.
    """
    from ..stager.config import StagerConfig
    from .toy import ToyDrafter, ToyTarget, greedy_reference

    if cfg.lookahead >= cfg.window // 2:
        raise ValueError(f"lookahead ({cfg.lookahead}) must be below K = window // 2 ({cfg.window // 2})")
    if cfg.seqs < 1:
        raise ValueError(f"seqs must be >= 1, got {cfg.seqs}")
    if cfg.rows not in ("held", "external"):
        raise ValueError(f"rows must be 'held' or 'external', got {cfg.rows!r}")
    scfg = StagerConfig(cfg.feature_dim, cfg.block, cfg.window, storage=cfg.storage, max_seqs=cfg.seqs,
                        rows=cfg.rows)
    K, bt = scfg.w_keep, cfg.block_tokens

    def new_target() -> ToyTarget:
        return ToyTarget(feature_dim=cfg.feature_dim, lookahead=cfg.lookahead, deviation=cfg.deviation,
                         seed=cfg.seed)

    ref = new_target()
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x3A17]))

    def text(first: int, n: int) -> np.ndarray:
        """n tokens of the toy language from `first`: the target's permutation chain, with rare
        jumps. Context then predicts what follows it (a row's code names the token `lookahead`
        positions on), so what a drafter can predict right after a hit depends on its rows."""
        out = np.empty(n, np.int64)
        tok = first
        for i in range(n):
            tok = int(rng.integers(0, ref.vocab_size)) if rng.random() < cfg.deviation else int(ref.perm[tok])
            out[i] = tok
        return out

    system = text(int(rng.integers(0, ref.vocab_size)), cfg.system_tokens)
    # The requests (turn-major: every conversation's first turn, then every second turn, ...) and
    # their greedy replies: the same for every variant, since every variant must be lossless. A
    # user message continues the conversation (the toy language has no other way to make sense).
    history = [system.copy() for _ in range(cfg.conversations)]
    requests: list[tuple[np.ndarray, np.ndarray]] = []
    for t in range(cfg.turns):
        for c in range(cfg.conversations):
            user = text(int(history[c][-1]) if t or c == 0 else int(rng.integers(0, ref.vocab_size)),
                        cfg.user_tokens)
            prompt = np.concatenate([history[c], user])
            reply = greedy_reference(ref, prompt, cfg.generate)
            requests.append((prompt, reply))
            history[c] = np.concatenate([prompt, reply])

    out: dict[str, Any] = {
        "config": {**cfg.__dict__, "w_keep": K, "row_bytes": scfg.row_bytes, "requests": len(requests)},
        "variants": {},
    }
    # Batches: the requests of one turn (turn-major order), seqs at a time, so a request never
    # shares a batch with the conversation's previous turn it hits.
    per_turn = cfg.conversations
    batches = [list(range(t * per_turn + lo, t * per_turn + min(lo + cfg.seqs, per_turn)))
               for t in range(cfg.turns) for lo in range(0, per_turn, cfg.seqs)]
    for variant in variants:
        st, kind = make_stager(scfg)
        out["stager"] = kind
        ring = _ring_for(st, make_ring) if cfg.rows == "external" else None
        store = _store_for(st, scfg, bt, cfg.budget_bytes) if variant == "store" else None
        table = _table_for(store, ring) if store is not None and ring is not None else None
        targets = [new_target() for _ in range(cfg.seqs)]
        drafter = ToyDrafter.for_target(targets[0], cfg.block, seed=cfg.seed, n_ctx_train=cfg.window)
        # Prefill chunks of at most W - K tokens: a block completed by a chunk then still has its
        # rows in the ring when the server hands it over (longer chunks: PrefixStore.publish_rows).
        chunk = min(cfg.prefill_chunk, cfg.window - K)
        loop = RequestLoop(st, drafter, targets, prefill_chunk=chunk, record_timeline=False, ring=ring)
        cache = PrefixCache(bt)
        tot = _Totals()
        peak_store = 0
        for batch in batches:
            seqs = list(range(len(batch)))
            prompts = [requests[i][0] for i in batch]
            would_hit = [cache.hit(p) for p in prompts]  # what a prefix cache would hold (off: not used)
            hs = [0 if variant == "off" else h for h in would_hit]
            reqs = {q: Request() for q in seqs}
            pubs: list[Publisher] = []
            if variant == "cold":
                for q in seqs:
                    reqs[q].replay_from = hs[q]
            elif variant == "replay":
                for q in seqs:
                    reqs[q].replay_from = max(0, hs[q] - K)
                    tot.replayed += hs[q] - reqs[q].replay_from
            elif variant == "store":
                assert store is not None
                chains = [cache.chain(p, h) for p, h in zip(prompts, hs)]
                if table is not None:
                    hits = table.hit_many(ring, seqs, chains, hs)
                else:
                    hits = store.hit_many(st, seqs, chains, hs)
                for q, hit in zip(seqs, hits):
                    reqs[q].replay_from, reqs[q].hit = hit.replay_from, True
                    tot.replayed += hit.replay_tokens
                    pub = Publisher(store, st, bt, hs[q], cache.chain(prompts[q], len(prompts[q])), seq=q,
                                    table=table, ring=ring)
                    reqs[q].publish = pub
                    pubs.append(pub)
            loop.requests = reqs
            loop.batch_publish = None
            if pubs:  # the prompts' blocks of every request's last prefill chunk: one call
                loop.batch_publish = functools.partial(publish_batch, store, st, pubs, [len(p) for p in prompts],
                                                       table=table, ring=ring, partial=False)
            loop.restart()
            res = loop.run(prompts, cfg.generate).sequences
            ends = []
            for q, i in enumerate(batch):
                reply = requests[i][1]
                tot.lossless &= bool(np.array_equal(res[q].tokens, reply))
                tot.prefilled.append(reqs[q].prefilled)
                tot.cached.append(hs[q])
                tot.accepted += res[q].accepted
                tot.drafted += res[q].drafted
                tot.after_hit.append(bool(would_hit[q]))
                if would_hit[q]:  # a request that starts from a hit (or would, with caching on)
                    tot.hits += 1
                    tot.first_rows.append(loop.first_rows.get(q, 0))
                    first = loop.accepted.get(q, [])[: cfg.first_rounds]
                    tot.first_accepted += sum(first)
                    tot.first_drafted += cfg.block * len(first)
                # The server caches the KV of the prompt and the reply but its last token (sampled, not
                # decoded yet; a longer speculative overshoot is not cached, so every variant caches alike).
                end = len(prompts[q]) + cfg.generate - 1
                assert int(st.state(q)["end"]) >= end
                tokens = np.concatenate([prompts[q], reply])
                cache.add(tokens, end)
                ends.append(end)
                if pubs:
                    pubs[q].keys = cache.chain(tokens, end)
            if pubs and store is not None:  # the replies' blocks and the partial blocks at their ends: one call
                publish_batch(store, st, pubs, ends, table=table, ring=ring)
                peak_store = max(peak_store, int(store.stats()["bytes"]))
        hit_reqs = np.asarray(tot.after_hit)
        summary = {
            "prefilled_per_request": float(np.mean(tot.prefilled)),
            "prefilled_per_hit_request": float(np.mean(np.asarray(tot.prefilled)[hit_reqs])) if tot.hits else 0.0,
            "cached_per_hit_request": float(np.mean(np.asarray(tot.cached)[hit_reqs])) if tot.hits else 0.0,
            "prefilled_total": int(sum(tot.prefilled)),
            "hit_requests": tot.hits,
            "first_round_context_rows": float(np.mean(tot.first_rows)) if tot.first_rows else 0.0,
            "first_round_context_rows_min": int(min(tot.first_rows)) if tot.first_rows else 0,
            "acceptance_after_hit": tot.first_accepted / tot.first_drafted if tot.first_drafted else 0.0,
            "acceptance": tot.accepted / tot.drafted if tot.drafted else 0.0,
            "replayed_tokens": tot.replayed,
            "lossless": tot.lossless,
        }
        if store is not None:
            s = store.stats()
            summary.update(store_bytes=int(s["bytes"]), store_peak_bytes=peak_store, store_blocks=int(s["blocks"]),
                           store_budget_bytes=cfg.budget_bytes, store_hits=int(s["hits"]),
                           store_full_hits=int(s["full_hits"]), store_evicted=int(s["evicted_lru"]))
        out["variants"][variant] = summary
    out["lossless"] = all(v["lossless"] for v in out["variants"].values())
    return out
