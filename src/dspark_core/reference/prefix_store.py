"""The pure-Python reference prefix store: the executable form of docs/prefix_cache.md.

:class:`ReferencePrefixStore` has the API of :class:`dspark_core.PrefixStore`
and works with :class:`~dspark_core.reference.ReferenceStager`. It is written
to be obviously correct, not fast: a block keeps its rows in a dict keyed by
absolute position, the LRU order is an ``OrderedDict``, and each rule is
spelled out where it applies. It is the oracle the C++ store is tested
against, call for call (same results, slots, moves, keys in LRU order,
counters and exceptions).

The rules:

* **Blocks.** Block ``i`` of a chain covers ``[i * block_tokens,
  min((i + 1) * block_tokens, n))``. A key names the same positions every time.
* **Keep rule.** A hit at ``h`` followed by a first round at ``start >= h``
  stages, of the rows before ``h``, ``[h - K, h)`` (``start + B > W``: a
  rebase) or all of ``[0, h)`` (``start <= W - B``). A block ``[s, e)``
  serves hits at ``h >= e``: it keeps every row when ``e <= W - B`` and only
  ``[max(s, e - K), e)`` otherwise.
* **Pages.** Rows live in pages of ``page_rows = min(block_tokens, K)`` rows,
  ``ceil(kept / page_rows)`` per block; the budget is ``budget_bytes //
  page bytes`` pages. The lowest free page is taken first.
* **LRU.** A publish refreshes the blocks it finds already held (same rows),
  in chain order, then adds its new blocks in chain order, each evicting the
  least recently used blocks until its pages are free. A hit refreshes the
  blocks it read.
* **Hits.** ``need = h - K`` (or 0 when ``h <= W - B``) and ``m`` = the first
  row ``>= need`` the store lacks (``h`` if none). If ``m >= h - K``: the
  sequence holds ``[need, m)``, the server prefills from ``m``, origin 0 (as a
  full prefill: exact; the first round rebases when ``need > 0``, which a
  full prefill's does too). Otherwise (a short prompt missing rows far below
  ``h``): no replay longer than ``K``: ``m2`` = the first row ``>= h - K`` the
  store lacks, the sequence holds the run of rows ending at ``m2`` and starts
  there (origin = its first row).

The checks of each call, their order and their messages are the core's
(docs/prefix_cache.md "Calls"), spelled out in :mod:`.prefix_arguments`.
"""


from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import arguments as arg
from . import formats as rf
from . import prefix_arguments as parg
from ..prefix import block_format as prefix_block_format
from ..stager.config import StagerConfig
from ..prefix.hit import HIT, PUBLISH, PrefixHit, PrefixHits, PrefixMoves, no_prefix_moves
from .ring import RingModel
from .seq import READY, _Seq
from .stager import ReferenceStager, _moves

__all__ = ["ReferencePrefixStore", "SEMANTIC_PREFIX_STATS"]

#: Counters both stores keep with the same values (``resident_bytes`` is the core's allocation).
SEMANTIC_PREFIX_STATS = (
    "blocks", "pages", "bytes", "key_bytes", "published", "republished", "evicted_lru", "evicted_by_key",
    "hits", "full_hits", "hit_rows", "replayed_tokens",
)

_Plan = list[tuple[bytes, int, int, "_Block | None"]]


@dataclass
class _Block:
    key: bytes
    start: int
    end: int
    first: int  # kept rows [first, end)
    pages: list[int]
    rows: dict[int, bytes] = field(default_factory=dict)  # held mode: position -> encoded row

    def slots(self, page_rows: int) -> list[int]:
        """Table slot of each kept row, in position order."""
        return [self.pages[t // page_rows] * page_rows + t % page_rows for t in range(self.end - self.first)]


class ReferencePrefixStore:
    """Pure-Python twin of :class:`dspark_core.PrefixStore` (same API, same results)."""

    def __init__(self, config: StagerConfig, block_tokens: int, budget_bytes: int) -> None:
        if not isinstance(config, StagerConfig):
            raise TypeError(f"config must be a StagerConfig, got {type(config).__name__}")
        self.config = config
        self.block_tokens = arg.integer("block_tokens", block_tokens)
        self.budget_bytes = arg.integer("budget_bytes", budget_bytes)
        parg.store_options(self.block_tokens, self.budget_bytes)
        w, b = config.window, config.block_size
        self.row_bytes = rf.row_bytes(config.storage, config.feature_dim)
        self.w_keep = min(w // 2, w - b)
        self.page_rows = min(self.block_tokens, self.w_keep)
        page_bytes = self.page_rows * self.row_bytes
        max_kept = min(self.block_tokens, max(w - b, self.w_keep))
        if self.budget_bytes // page_bytes < self._pages_for(max_kept):
            raise parg.budget_too_small(self.budget_bytes, max_kept, self.row_bytes, self._pages_for(max_kept),
                                        page_bytes)
        self.n_pages = min(self.budget_bytes // page_bytes, (1 << 62) // self.page_rows)
        self.table_rows = self.n_pages * self.page_rows
        self._page_bytes = page_bytes
        self._external = config.rows == "external"
        # The block format's fingerprint, from the reference's own code tables.
        self._fingerprint = (config.feature_dim, rf.STORAGES.index(config.storage),
                             arg.NONFINITE_POLICIES.index(config.nonfinite), arg.STAGE_DTYPES.index(config.stage_dtype),
                             w, b, self.row_bytes)
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._freed: list[int] = []  # min-heap, all below _next_fresh
        self._next_fresh = 0
        self._stats = dict.fromkeys(SEMANTIC_PREFIX_STATS, 0)

    def __repr__(self) -> str:
        return (f"ReferencePrefixStore(block_tokens={self.block_tokens}, budget_bytes={self.budget_bytes}, "
                f"blocks={len(self)})")

    # -- rules ------------------------------------------------------------
    def _kept_first(self, s: int, e: int) -> int:
        """The keep rule: all of ``[s, e)`` when ``e <= W - B``, else its last ``K`` rows."""
        c = self.config
        return s if e <= c.window - c.block_size else max(s, e - self.w_keep)

    def _pages_for(self, rows: int) -> int:
        return -(-rows // self.page_rows)

    @staticmethod
    def _stager(stager: Any) -> ReferenceStager:
        if not isinstance(stager, ReferenceStager):
            raise TypeError(f"stager must be a dspark_core.reference.ReferenceStager, got {type(stager).__name__}")
        return stager

    def _plan(self, keys: list[bytes], start: int, end: int) -> _Plan:
        """The checks of a publish (positions, the chain, keys twice, keys held for other positions) and
        its blocks: ``(key, s, e, held block or None)``."""
        bt = self.block_tokens
        parg.publish_span(keys, start, end, bt)
        plan: _Plan = []
        seen: set[bytes] = set()
        for j, k in enumerate(keys):
            s = start + j * bt
            e = min(s + bt, end)
            if k in seen:
                raise parg.key_twice(k)
            seen.add(k)
            b = self._blocks.get(k)
            if b is not None and (b.start, b.end) != (s, e):
                raise parg.key_moved(k, (b.start, b.end), (s, e))
            plan.append((k, s, e, b))
        return plan

    def _same_rows(self, plan: _Plan, row: Callable[[int], bytes | None], who: str,
                   earlier: dict[bytes, _Seq] | None = None) -> None:
        """Held mode, in chain order: blocks already held carry these rows (``row(p)`` is None where not
        visible), and so do blocks an earlier entry of a batch adds (``earlier``: key -> that entry's
        sequence, which holds every kept row)."""
        if self._external:
            return
        earlier = earlier or {}
        for k, s, e, b in plan:
            if b is not None:
                held = b.rows
            elif k in earlier:
                src = earlier[k]
                held = {p: src.rows[p].tobytes() for p in range(self._kept_first(s, e), e)}
            else:
                continue
            if any(row(p) not in (None, held[p]) for p in range(self._kept_first(s, e), e)):
                raise parg.other_rows(who, (s, e), k)

    def _take_page(self) -> int:
        if self._freed:
            p = heapq.heappop(self._freed)
        else:
            p = self._next_fresh
            self._next_fresh += 1
        self._stats["pages"] += 1
        return p

    def _drop(self, key: bytes) -> None:
        b = self._blocks.pop(key)
        for p in b.pages:
            heapq.heappush(self._freed, p)
        self._stats["pages"] -= len(b.pages)
        self._stats["key_bytes"] -= len(key)
        self._stats["blocks"] -= 1

    def _commit(self, plan: _Plan, rows_of: Any, keep: Any = ()) -> list[_Block]:
        """Refresh held blocks, then add new ones (evicting LRU blocks, but none in ``keep``: a batch's);
        ``rows_of(pos)`` gives a row."""
        for k, _, _, b in plan:
            if b is not None:
                self._blocks.move_to_end(k)
                self._stats["republished"] += 1
        added = []
        for k, s, e, b in plan:
            if b is not None:
                continue
            first = self._kept_first(s, e)
            need = self._pages_for(e - first)
            while self.n_pages - self._stats["pages"] < need:
                self._drop(next(key for key in self._blocks if key not in keep))
                self._stats["evicted_lru"] += 1
            nb = _Block(k, s, e, first, [self._take_page() for _ in range(need)])
            if not self._external:
                nb.rows = {p: rows_of(p) for p in range(first, e)}
            self._blocks[k] = nb
            self._stats["blocks"] += 1
            self._stats["key_bytes"] += len(k)
            self._stats["published"] += 1
            added.append(nb)
        return added

    def _issue(self, stager: ReferenceStager, moves: np.ndarray, direction: str, *seqs: int) -> PrefixMoves:
        """Moves as the core numbers them: among the Stager's table changes, when non-empty (one
        change of every sequence of a batch)."""
        if len(moves) == 0:
            return no_prefix_moves(stager, direction, self)
        call = "publish_prefix" if direction == PUBLISH else "start_from_prefix"
        return PrefixMoves.wrap_prefix(moves, stager, stager._number_change(call, *seqs), direction, self)

    # -- the Stager side ----------------------------------------------------
    def publish(self, stager: Any, seq: Any, keys: Any, start: Any, end: Any) -> PrefixMoves:
        """Record the final rows ``[start, end)`` of ``seq`` under ``keys`` (see the module docstring)."""
        stager = self._stager(stager)
        i, st = stager._closed(seq)
        chain = parg.key_chain(keys)
        start = arg.integer("start", start)
        end = arg.integer("end", end)
        plan = self._check_publish(stager, i, st, chain, start, end)
        src: list[int] = []
        dst: list[int] = []
        self._publish_rows(stager, i, st, plan, src, dst)
        if not self._external:
            return no_prefix_moves(stager, PUBLISH, self)
        return self._issue(stager, _moves(src, dst), PUBLISH, i)

    def _check_publish(self, stager: ReferenceStager, i: int, st: _Seq, chain: list[bytes], start: int,
                       end: int, batch: dict[bytes, tuple[int, int, int, _Seq]] | None = None) -> _Plan:
        """A publish's checks after the sequence's (the store, the plan, the rows); its plan (against the
        store as found). ``batch`` (publish_many): key -> (entry, start, end, sequence) of the blocks new
        to the store that earlier entries add; this entry finds them held, as a loop would."""
        parg.compatible(self.config, stager.config)
        plan = self._plan(chain, start, end)
        earlier: dict[bytes, _Seq] = {}
        for k, s, e, b in plan:
            if b is None and batch and k in batch:
                _, bs, be, src = batch[k]
                if (bs, be) != (s, e):
                    raise parg.key_moved(k, (bs, be), (s, e))
                earlier[k] = src
        if not st.started:
            raise parg.holds_no_rows(i)
        final_end = stager._firm_end(st)
        if end > final_end:
            raise parg.not_final(i, start, end, st.horizon, final_end, final_end < st.end)
        for k, s, e, b in plan:
            first = self._kept_first(s, e)
            if b is None and k not in earlier and first < st.horizon:
                raise parg.rows_gone(i, first, e - first, (s, e), st.horizon)
        # Rows the ring no longer holds compare as equal (a refresh on the key and positions alone).
        self._same_rows(plan, lambda p: st.rows[p].tobytes() if p in st.rows else None, f"sequence {i}: ", earlier)
        return plan

    def _publish_rows(self, stager: ReferenceStager, i: int, st: _Seq, plan: _Plan, src: list[int], dst: list[int],
                      keep: Any = ()) -> None:
        """A checked publish's change; external rows: its copies appended to ``src`` / ``dst``."""
        added = self._commit(plan, lambda p: st.rows[p].tobytes(), keep)
        if self._external:
            base = i * stager.ring_rows
            for b in added:
                src += st.ring.slots(b.first, b.end, base)
                dst += b.slots(self.page_rows)

    def publish_many(self, stager: Any, seqs: Any, keys: Any, starts: Any, ends: Any) -> PrefixMoves:
        """``publish`` for a step's sequences, checked whole first (see the core's publish_prefix_many)."""
        stager = self._stager(stager)
        call = "publish_many"
        ids = arg.seq_ids(call, seqs)
        n = len(ids)
        chains = stager._converted(call, ids, READY, parg.key_chains, call, keys, n)
        first = stager._converted(call, ids, READY, arg.batch_ints, call, "starts", starts, n).tolist()
        last = stager._converted(call, ids, READY, arg.batch_ints, call, "ends", ends, n).tolist()
        states = stager._check_batch(call, ids, READY)
        arg.unique(call, ids)
        seq_list = ids.tolist()
        # Every entry against the store as found, and the blocks new to it that earlier entries add
        # (a later entry of such a key refreshes the block, as in a loop).
        plans = []
        added: dict[bytes, tuple[int, int, int, _Seq]] = {}
        for k, s in enumerate(seq_list):
            with arg.in_batch(call, k, s):
                plans.append(self._check_publish(stager, s, states[k], chains[k], first[k], last[k], added))
            for key, bs, be, blk in plans[-1]:
                if blk is None and key not in added:
                    added[key] = (k, bs, be, states[k])
        # Blocks an entry refreshes from rows it no longer holds (held, or added by an earlier entry): kept.
        keep: dict[bytes, int] = {}
        fragile: list[list[bytes]] = [[] for _ in seq_list]
        kept_pages = largest = 0
        for k, plan in enumerate(plans):
            for key, bs, be, blk in plan:
                kept_first = self._kept_first(bs, be)
                pages = self._pages_for(be - kept_first)
                largest = max(largest, pages)
                held_then = blk is not None or added[key][0] != k
                if held_then and kept_first < states[k].horizon:
                    fragile[k].append(key)
                    if key not in keep:
                        kept_pages += len(blk.pages) if blk is not None else pages
                    keep[key] = keep.get(key, 0) + 1
        if self.n_pages - kept_pages < largest:
            raise parg.batch_without_room(call, kept_pages, largest, self.n_pages)
        src: list[int] = []
        dst: list[int] = []
        for k, s in enumerate(seq_list):
            for key in fragile[k]:
                keep[key] -= 1
                if keep[key] == 0:
                    del keep[key]
            plan = plans[0] if k == 0 else self._plan(chains[k], first[k], last[k])
            self._publish_rows(stager, s, states[k], plan, src, dst, keep)
        if not self._external:
            return no_prefix_moves(stager, PUBLISH, self)
        return self._issue(stager, _moves(src, dst), PUBLISH, *seq_list)

    def _plan_hit(self, chain: list[bytes], h: int) -> tuple[dict[str, Any], list[_Block]]:
        bt, c, K = self.block_tokens, self.config, self.w_keep
        parg.hit_span(chain, h, bt)
        out = dict(n_tokens=h, need_first=0, first_row=0, replay_from=0, rows=0, origin=0, exact=True,
                   blocks_found=0, owed=False)
        if h == 0:
            return out, []
        need = 0 if h <= c.window - c.block_size else h - K
        out["need_first"] = need

        def block(i: int) -> _Block | None:
            s, e = i * bt, min(i * bt + bt, h)
            b = self._blocks.get(chain[i])
            if b is not None and (b.start, b.end) != (s, e):
                raise parg.chain_mismatch(i, chain[i], (b.start, b.end), (s, e))
            return b

        held = {i: block(i) for i in range(need // bt, len(chain))}  # every examined block is checked

        def has(p: int) -> bool:
            b = held[p // bt]
            return b is not None and b.first <= p

        def first_missing(lo: int) -> int:
            return next((p for p in range(lo, h) if not has(p)), h)

        m = first_missing(need)
        if m >= h - K:
            a, to, origin, owed, exact = need, m, 0, need > 0, True
        else:
            to = first_missing(h - K)
            a = to
            while a > 0 and has(a - 1):
                a -= 1
            origin, owed, exact = a, False, False
        used = [held[i] for i in range(a // bt, -(-to // bt))] if to > a else []
        out.update(first_row=a, replay_from=to, rows=to - a, origin=origin, exact=exact, owed=owed,
                   blocks_found=len(used))
        return out, [b for b in used if b is not None]

    def hit(self, stager: Any, seq: Any, keys: Any, n_tokens: Any, tokens: Any = None) -> PrefixHit:
        """Start ``seq`` from a prefix-cache hit of ``n_tokens`` positions (see the module docstring);
        ``tokens``: a chain drafter's Stager's prompt ids of ``[0, n_tokens)``."""
        stager = self._stager(stager)
        i, old = stager._closed(seq)
        chain = parg.key_chain(keys)
        h = arg.integer("n_tokens", n_tokens)
        ids = arg.tokens("", tokens, max(h, 0))
        parg.compatible(self.config, stager.config)
        plan, used = self._plan_hit(chain, h)
        arg.check_tokens("", stager._chain, ids, h)
        src: list[int] = []
        dst: list[int] = []
        self._apply_hit(stager, i, h, plan, used, src, dst, ids)
        return PrefixHit(**plan, moves=self._issue(stager, _moves(src, dst), HIT, i) if self._external
                         else no_prefix_moves(stager, HIT, self))

    def hit_many(self, stager: Any, seqs: Any, keys: Any, n_tokens: Any, tokens: Any = None) -> PrefixHits:
        """``hit`` for several sequences, every hit planned first (see the core's start_from_prefix_many)."""
        stager = self._stager(stager)
        call = "hit_many"
        ids = arg.seq_ids(call, seqs)
        n = len(ids)
        chains = stager._converted(call, ids, READY, parg.key_chains, call, keys, n)
        hs = stager._converted(call, ids, READY, arg.batch_ints, call, "n_tokens", n_tokens, n).tolist()
        flat = stager._converted(call, ids, READY, arg.tokens, call, tokens, sum(max(h, 0) for h in hs))
        stager._check_batch(call, ids, READY)
        arg.unique(call, ids)
        parg.compatible(self.config, stager.config)
        seq_list = ids.tolist()
        planned = []
        for k, s in enumerate(seq_list):
            with arg.in_batch(call, k, s):
                planned.append(self._plan_hit(chains[k], hs[k]))
        arg.check_tokens(call, stager._chain, flat, sum(hs))
        starts = np.cumsum([0, *hs]).tolist()
        src: list[int] = []
        dst: list[int] = []
        for k, (s, h, (plan, used)) in enumerate(zip(seq_list, hs, planned)):
            mine = None if flat is None else flat[starts[k]:starts[k + 1]]
            self._apply_hit(stager, s, h, plan, used, src, dst, mine)
        empty = no_prefix_moves(stager, HIT, self)
        moves = self._issue(stager, _moves(src, dst), HIT, *seq_list) if self._external else empty
        return PrefixHits([PrefixHit(**plan, moves=empty) for plan, _ in planned], moves)

    def _apply_hit(self, stager: ReferenceStager, i: int, h: int, plan: dict[str, Any], used: list[_Block],
                   src: list[int], dst: list[int], ids: np.ndarray | None = None) -> None:
        """Starts sequence ``i`` from a planned hit (``plan`` loses its ``owed``); external rows: its
        copies appended to ``src`` / ``dst``; ``ids``: the prompt's token ids (a chain drafter's)."""
        old = stager._seqs[i]
        a, to = plan["first_row"], plan["replay_from"]
        base = i * stager.ring_rows
        if to == 0:
            old.ring.reset(0)
            stager._reset_seq(i, stager._new_seq(old.ring))  # begin()
        else:
            n = to - a
            st = stager._new_seq(RingModel(0), started=True, end=to, horizon=a, n_cache=plan["origin"],
                                 pos_base=plan["origin"], restage_owed=plan["owed"], first_round=True, head=a)
            st.ring = stager._ring_for(old.ring, a, n)
            if n:
                st.ring.reserve(n)
                st.ring.append(n)
            where = {p: (b, t) for b in used for t, p in enumerate(range(b.first, b.end))}
            if self._external:
                src += [where[p][0].slots(self.page_rows)[where[p][1]] for p in range(a, to)]
                dst += st.ring.slots(a, to, base)
            else:
                st.rows = {p: np.frombuffer(where[p][0].rows[p], np.uint8).copy() for p in range(a, to)}
            if ids is not None:
                st.tokens = {p: int(ids[p]) for p in range(a, to)}
            stager._reset_seq(i, st)
            stager._advance_horizon(st)
        stager._warned.discard(i)  # a new request on the slot, as begin()
        for b in used:
            self._blocks.move_to_end(b.key)
        if h:
            self._stats["hits"] += 1
            self._stats["hit_rows"] += to - a
            self._stats["replayed_tokens"] += h - to
            self._stats["full_hits"] += int(plan["exact"] and to == h)
        plan.pop("owed")

    def lookup(self, keys: Any, n_tokens: Any) -> PrefixHit:
        """What ``hit`` would find now; changes nothing."""
        chain = parg.key_chain(keys)
        plan, _ = self._plan_hit(chain, arg.integer("n_tokens", n_tokens))
        plan.pop("owed")
        return PrefixHit(**plan, moves=no_prefix_moves(None, HIT, self))

    # -- the store alone ------------------------------------------------------
    def publish_rows(self, keys: Any, start: Any, end: Any, rows: Any) -> None:
        """Record rows ``[start, end)`` given by the caller (held mode)."""
        chain = parg.key_chain(keys)
        start = arg.integer("start", start)
        end = arg.integer("end", end)
        c = self.config
        arr = arg.rows(rows, c.feature_dim)
        if self._external:
            raise parg.wrong_mode("publish_rows", True, "publish_slots")
        plan = self._plan(chain, start, end)
        if arr.shape[0] != end - start:
            raise parg.row_count(end - start, c.feature_dim, arr.dtype.name, start, end, arr.shape[0])
        kept = [p for _, s, e, _ in plan for p in range(self._kept_first(s, e), e)]
        x = arr[[p - start for p in kept]]
        if c.nonfinite == "error" and len(x):
            limit = rf.bounds(c.storage, c.stage_dtype)[0]
            with np.errstate(invalid="ignore"):
                bad = np.argwhere(~(np.abs(x.astype(np.float32)) < np.float32(limit)))
            if len(bad):
                r, ch = (int(v) for v in bad[0])
                raise parg.unstorable(kept[r] - start, start, ch, float(x[r, ch]), c.storage, c.stage_dtype, limit)
        enc = rf.encode(x, c.storage, "keep" if c.nonfinite == "error" else c.nonfinite, c.stage_dtype)
        by_pos = dict(zip(kept, np.ascontiguousarray(enc).view(np.uint8).reshape(len(kept), self.row_bytes)))
        self._same_rows(plan, lambda p: by_pos[p].tobytes(), "")
        self._commit(plan, lambda p: by_pos[p].tobytes())

    def publish_slots(self, keys: Any, start: Any, end: Any) -> np.ndarray:
        """External-row mode: the table slot of each position (-1: not kept, or already held)."""
        chain = parg.key_chain(keys)
        start = arg.integer("start", start)
        end = arg.integer("end", end)
        if not self._external:
            raise parg.wrong_mode("publish_slots", False, "publish_rows")
        plan = self._plan(chain, start, end)
        out = np.full(end - start, -1, np.int64)
        for b in self._commit(plan, None):
            out[b.first - start:b.end - start] = b.slots(self.page_rows)
        return out

    def evict(self, keys: Any) -> int:
        """Drop the blocks with these keys; returns how many were held."""
        chain = parg.key_chain(keys)
        parg.chain_keys(chain)
        n = 0
        for k in chain:
            if k in self._blocks:
                self._drop(k)
                self._stats["evicted_by_key"] += 1
                n += 1
        return n

    def clear(self) -> None:
        """Drop every block; the counters restart."""
        self._blocks.clear()
        self._freed.clear()
        self._next_fresh = 0
        self._stats = dict.fromkeys(SEMANTIC_PREFIX_STATS, 0)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Any) -> bool:
        return parg.key(key) in self._blocks

    def keys(self) -> list[bytes]:
        """Keys held, least recently used first."""
        return list(self._blocks)

    def _block(self, key: bytes) -> _Block:
        b = self._blocks.get(key)
        if b is None:
            raise parg.no_block(key)
        return b

    def info(self, key: Any) -> dict[str, int]:
        """``start``, ``end``, ``first_row``, ``rows``, ``pages`` of one block."""
        b = self._block(parg.key(key))
        return {"start": b.start, "end": b.end, "first_row": b.first, "rows": b.end - b.first, "pages": len(b.pages)}

    def block_slots(self, key: Any) -> np.ndarray:
        """Table slots of the block's kept rows, in position order."""
        return np.array(self._block(parg.key(key)).slots(self.page_rows), np.int64)

    def stats(self) -> dict[str, int]:
        """The counters (``SEMANTIC_PREFIX_STATS``)."""
        out = dict(self._stats)
        out["bytes"] = out["pages"] * self._page_bytes
        return out

    def export_block(self, key: Any, rows: Any = None) -> bytes:
        """The block as bytes (``prefix.block_format``); external mode takes the owner's ``rows``."""
        k = parg.key(key)
        data = None if rows is None else parg.block_rows(rows)
        b = self._block(k)
        n = b.end - b.first
        parg.export_rows(self._external, data, n, self.row_bytes)
        if data is None:
            data = b"".join(b.rows[p] for p in range(b.first, b.end))
        return prefix_block_format.pack(self._fingerprint, self.block_tokens,
                                        prefix_block_format.PrefixBlock(b.key, b.start, b.end, n, data))

    def import_block(self, data: Any) -> np.ndarray | None:
        """Add the block in ``data``; bad data is a ValueError and changes nothing.

        External-row mode: the slots where the owner writes the data's rows (-1 when already held)."""
        raw = parg.block_data(data)
        blk = prefix_block_format.unpack(raw, self._fingerprint, self.block_tokens, self.w_keep, rf.STORAGES,
                                         arg.NONFINITE_POLICIES, arg.STAGE_DTYPES)
        plan = self._plan([blk.key], blk.start, blk.end)
        rb = self.row_bytes
        first = blk.end - blk.n_rows
        row = {first + t: blk.rows[t * rb:(t + 1) * rb] for t in range(blk.n_rows)}
        self._same_rows(plan, row.__getitem__, "")
        added = self._commit(plan, row.__getitem__)
        if not self._external:
            return None
        return np.array(added[0].slots(self.page_rows), np.int64) if added else np.full(blk.n_rows, -1, np.int64)
