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
    """The speculative loop, with a prefill that starts from a prefix-cache hit (``request``)."""

    request: Request = Request()

    def _prefill(self, s: Any, tokens: Any) -> None:
        prompt = np.asarray(tokens, dtype=np.int64).reshape(-1)
        r = self.request
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
            self._process(s, lo, out.rows)
            if r.publish is not None:  # the server hands over the blocks this chunk completed
                r.publish(lo + len(out.rows))
            self._track_rows(s)
            last = int(out.next_tokens[-1])
        s.n_past = len(prompt)
        s.last = last
        s.out = [last]


class Publisher:
    """Publishes a request's blocks into the store as they complete (``PrefixStore.publish``)."""

    def __init__(self, store: Any, stager: Any, block_tokens: int, cached: int, keys: list[bytes]) -> None:
        self.store, self.stager, self.bt, self.keys = store, stager, block_tokens, keys
        self.done = cached // block_tokens * block_tokens  # full blocks below it are cached already

    def __call__(self, end: int, partial: bool = False) -> None:
        """Publish the blocks complete below ``end`` (``partial``: and the one ending at ``end``)."""
        hi = end if partial else end // self.bt * self.bt
        if hi > self.done:
            self.store.publish(self.stager, 0, self.keys[self.done // self.bt: -(-hi // self.bt)], self.done, hi)
            self.done = hi


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


def run_multiturn(
    cfg: MultiTurnConfig,
    variants: tuple[str, ...] = VARIANTS,
    make_stager: Callable[[Any], tuple[Any, str]] = _core_stager,
) -> dict[str, Any]:
    """Run the workload once per variant; returns the figures ``simulate --workload multiturn`` prints.

    ``make_stager(config) -> (stager, kind)`` builds each variant's Stager (the
    C++ core by default; the reference twin pairs with the reference store).
    """
    from ..config import StagerConfig
    from .toy import ToyDrafter, ToyTarget, greedy_reference

    if cfg.lookahead >= cfg.window // 2:
        raise ValueError(f"lookahead ({cfg.lookahead}) must be below K = window // 2 ({cfg.window // 2})")
    if cfg.generate + cfg.block + 1 > cfg.window // 2:
        raise ValueError("generate must stay below window // 2 - block: the reply's blocks are published at the end")
    scfg = StagerConfig(cfg.feature_dim, cfg.block, cfg.window, storage=cfg.storage)
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
    for variant in variants:
        st, kind = make_stager(scfg)
        out["stager"] = kind
        store = _store_for(st, scfg, bt, cfg.budget_bytes) if variant == "store" else None
        rec = PlanRecorder(st)
        target = new_target()
        drafter = ToyDrafter.for_target(target, cfg.block, seed=cfg.seed, n_ctx_train=cfg.window)
        # Prefill chunks of at most W - K tokens: a block completed by a chunk then still has its
        # rows in the ring when the server hands it over (longer chunks: PrefixStore.publish_rows).
        chunk = min(cfg.prefill_chunk, cfg.window - K)
        loop = RequestLoop(rec, drafter, [target], prefill_chunk=chunk, record_timeline=False)
        cache = PrefixCache(bt)
        tot = _Totals()
        peak_store = 0
        for prompt, reply in requests:
            would_hit = cache.hit(prompt)  # what a prefix cache would hold (off: not used)
            h = 0 if variant == "off" else would_hit
            req = Request()
            pub = None
            if variant == "cold":
                req.replay_from = h
            elif variant == "replay":
                req.replay_from = max(0, h - K)
                tot.replayed += h - req.replay_from
            elif variant == "store":
                assert store is not None
                hit = store.hit(st, 0, cache.chain(prompt, h), h)
                req.replay_from, req.hit = hit.replay_from, True
                tot.replayed += hit.replay_tokens
                pub = Publisher(store, st, bt, h, cache.chain(prompt, len(prompt)))
                req.publish = pub
            rec.restart()
            loop.request = req
            res = loop.run([prompt], cfg.generate).sequences[0]
            tot.lossless &= bool(np.array_equal(res.tokens, reply))
            tot.prefilled.append(req.prefilled)
            tot.cached.append(h)
            tot.accepted += res.accepted
            tot.drafted += res.drafted
            tot.after_hit.append(bool(would_hit))
            if would_hit:  # a request that starts from a hit (or would, with caching on)
                tot.hits += 1
                tot.first_rows.append(rec.first_rows or 0)
                first = rec.accepted[: cfg.first_rounds]
                tot.first_accepted += sum(first)
                tot.first_drafted += cfg.block * len(first)
            # The server caches the KV of the prompt and the reply but its last token (sampled, not
            # decoded yet; a longer speculative overshoot is not cached, so every variant caches alike).
            end = len(prompt) + cfg.generate - 1
            assert int(st.state(0)["end"]) >= end
            tokens = np.concatenate([prompt, reply])
            cache.add(tokens, end)
            if pub is not None:  # the reply's blocks and the partial block at the end
                pub.keys = cache.chain(tokens, end)
                pub(end, partial=True)
                peak_store = max(peak_store, int(pub.store.stats()["bytes"]))
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
