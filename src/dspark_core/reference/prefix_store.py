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
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import formats as rf
from .. import prefix_block_format
from .._args import as_count, as_rows, readable_bytes
from ..config import StagerConfig, positive_int
from ..errors import ConfigError
from ..prefix_hit import HIT, PUBLISH, PrefixHit, PrefixMoves, no_prefix_moves
from ..prefix_keys import as_key, as_key_chain
from .stager import ReferenceStager, _moves, _Seq

__all__ = ["ReferencePrefixStore", "SEMANTIC_PREFIX_STATS"]

#: Counters both stores keep with the same values (``resident_bytes`` is the core's allocation).
SEMANTIC_PREFIX_STATS = (
    "blocks", "pages", "bytes", "key_bytes", "published", "republished", "evicted_lru", "evicted_by_key",
    "hits", "exact_hits", "hit_rows", "replayed_tokens",
)

#: Fields a Stager must share with the store.
_SHARED = ("feature_dim", "storage", "window", "block_size", "nonfinite", "stage_dtype", "rows")


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
        self.block_tokens = positive_int("block_tokens", block_tokens)
        self.budget_bytes = positive_int("budget_bytes", budget_bytes)
        if self.budget_bytes >= 1 << 64:
            raise ConfigError(f"budget_bytes must be < 2**64, got {self.budget_bytes}")
        if self.block_tokens > 1 << 30:
            raise ConfigError(f"block_tokens ({self.block_tokens}) must be <= 2**30")
        self.row_bytes = config.row_bytes
        self.w_keep = config.w_keep
        self.page_rows = min(self.block_tokens, self.w_keep)
        page_bytes = self.page_rows * self.row_bytes
        max_kept = min(self.block_tokens, max(config.window - config.block_size, self.w_keep))
        if self.budget_bytes // page_bytes < -(-max_kept // self.page_rows):
            raise ConfigError(f"budget_bytes ({self.budget_bytes}) is smaller than one block")
        self.n_pages = min(self.budget_bytes // page_bytes, (1 << 62) // self.page_rows)
        self.table_rows = self.n_pages * self.page_rows
        self._page_bytes = page_bytes
        self._external = config.external_rows
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._freed: list[int] = []  # min-heap, all below _next_fresh
        self._next_fresh = 0
        self._stats = dict.fromkeys(SEMANTIC_PREFIX_STATS, 0)

    def __repr__(self) -> str:
        return (f"ReferencePrefixStore(block_tokens={self.block_tokens}, budget_bytes={self.budget_bytes}, "
                f"blocks={len(self)})")

    # -- rules ------------------------------------------------------------
    def _kept_first(self, s: int, e: int) -> int:
        c = self.config
        return s if e <= c.window - c.block_size else max(s, e - self.w_keep)

    def _pages_for(self, rows: int) -> int:
        return -(-rows // self.page_rows)

    def _check_compatible(self, stager: ReferenceStager) -> None:
        diff = [f for f in _SHARED if getattr(stager.config, f) != getattr(self.config, f)]
        if diff:
            raise ConfigError(f"this store's rows differ from the Stager's in {', '.join(diff)}")

    def _ready(self, stager: Any, seq: Any) -> tuple[int, _Seq]:
        if not isinstance(stager, ReferenceStager):
            raise TypeError(f"stager must be a ReferenceStager, got {type(stager).__name__}")
        i, st = stager._closed(seq)
        self._check_compatible(stager)
        return i, st

    @staticmethod
    def _keys(keys: Any) -> list[bytes]:
        data, offsets = as_key_chain(keys)
        return [data[int(a):int(b)] for a, b in zip(offsets[:-1], offsets[1:])]

    def _plan(self, keys: list[bytes], start: int, end: int) -> list[tuple[bytes, int, int, _Block | None]]:
        """Blocks of a publish of ``[start, end)``: ``(key, s, e, held block or None)``; ValueError if bad."""
        bt = self.block_tokens
        if start < 0 or end >= 1 << 62 or end <= start:
            raise ValueError(f"publish needs positions 0 <= start < end < 2**62, got [{start}, {end})")
        if start % bt:
            raise ValueError(f"publish must start at a block boundary, got {start}")
        if len(keys) != -(-(end - start) // bt):
            raise ValueError(f"{len(keys)} keys for positions [{start}, {end})")
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice in the chain")
        plan = []
        for j, k in enumerate(keys):
            s = start + j * bt
            e = min(s + bt, end)
            b = self._blocks.get(k)
            if b is not None and (b.start, b.end) != (s, e):
                raise ValueError(f"key {k!r} is held for positions [{b.start}, {b.end}), not [{s}, {e})")
            plan.append((k, s, e, b))
        return plan

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

    def _commit(self, plan: list[tuple[bytes, int, int, _Block | None]], rows_of: Any) -> list[_Block]:
        """Refresh held blocks, then add new ones (evicting LRU blocks); ``rows_of(pos)`` gives a row."""
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
                self._drop(next(iter(self._blocks)))
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

    # -- the Stager side ----------------------------------------------------
    def publish(self, stager: ReferenceStager, seq: int, keys: Any, start: int, end: int) -> PrefixMoves:
        """Record the final rows ``[start, end)`` of ``seq`` under ``keys`` (see the module docstring)."""
        i, st = self._ready(stager, seq)
        chain = self._keys(keys)
        start = as_count("start", start)
        end = as_count("end", end)
        if not st.started:
            raise ValueError(f"sequence {i} holds no rows")
        if end > stager._firm_end(st):
            raise ValueError(f"sequence {i}: positions [{start}, {end}) reach past its final rows")
        plan = self._plan(chain, start, end)
        for _, s, e, b in plan:
            if b is None and self._kept_first(s, e) < st.horizon:
                raise ValueError(f"sequence {i}: rows of the block at [{s}, {e}) are no longer held")
        for _, s, e, b in plan:  # the rows the ring still holds must be the same
            if b is not None and not self._external:
                if any(b.rows[p] != st.rows[p].tobytes() for p in range(max(b.first, st.horizon), e)):
                    raise ValueError(f"sequence {i}: the block at [{s}, {e}) is already held with other rows")
        added = self._commit(plan, lambda p: st.rows[p].tobytes())
        if not self._external:
            return no_prefix_moves(stager, PUBLISH, self)
        base = i * stager.config.ring_rows
        src: list[int] = []
        dst: list[int] = []
        for b in added:
            src += st.ring.slots(b.first, b.end, base)
            dst += b.slots(self.page_rows)
        return self._issue(stager, _moves(src, dst), PUBLISH)

    def _issue(self, stager: ReferenceStager, moves: np.ndarray, direction: str) -> PrefixMoves:
        if len(moves) == 0:
            return no_prefix_moves(stager, direction, self)
        stager.moves_issued += 1
        return PrefixMoves.wrap_prefix(moves, stager, stager.moves_issued, direction, self)

    def _plan_hit(self, chain: list[bytes], h: int) -> tuple[dict[str, Any], list[_Block]]:
        bt, c, K = self.block_tokens, self.config, self.w_keep
        if len(chain) != -(-h // bt):
            raise ValueError(f"{len(chain)} keys for a hit of {h} tokens")
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
                raise ValueError(f"the key chain does not match the positions at block {i}")
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

    def hit(self, stager: ReferenceStager, seq: int, keys: Any, n_tokens: int) -> PrefixHit:
        """Start ``seq`` from a prefix-cache hit of ``n_tokens`` positions (see the module docstring)."""
        i, old = self._ready(stager, seq)
        chain = self._keys(keys)
        h = as_count("n_tokens", n_tokens)
        plan, used = self._plan_hit(chain, h)
        a, to = plan["first_row"], plan["replay_from"]
        base = i * stager.config.ring_rows
        moves = np.zeros((0, 3), np.int64)
        if to == 0:
            old.ring.reset(0)
            stager._seqs[i] = _Seq(ring=old.ring)  # begin()
        else:
            n = to - a
            st = _Seq(started=True, end=to, horizon=a, n_cache=plan["origin"], pos_base=plan["origin"],
                      restage_owed=plan["owed"], first_round=True, head=a)
            st.ring = stager._ring_for(old.ring, a, n)
            if n:
                st.ring.reserve(n)
                st.ring.append(n)
            where = {p: (b, t) for b in used for t, p in enumerate(range(b.first, b.end))}
            if self._external:
                moves = _moves([where[p][0].slots(self.page_rows)[where[p][1]] for p in range(a, to)],
                               st.ring.slots(a, to, base))
            else:
                st.rows = {p: np.frombuffer(where[p][0].rows[p], np.uint8).copy() for p in range(a, to)}
            stager._seqs[i] = st
            stager._advance_horizon(st)
        stager._mismatch.reset(i)
        for b in used:
            self._blocks.move_to_end(b.key)
        if h:
            self._stats["hits"] += 1
            self._stats["hit_rows"] += to - a
            self._stats["replayed_tokens"] += h - to
            self._stats["exact_hits"] += int(plan["exact"] and to == h)
        plan.pop("owed")
        return PrefixHit(**plan, moves=self._issue(stager, moves, HIT) if self._external
                         else no_prefix_moves(stager, HIT, self))

    def lookup(self, keys: Any, n_tokens: int) -> PrefixHit:
        """What ``hit`` would find now; changes nothing."""
        chain = self._keys(keys)
        plan, _ = self._plan_hit(chain, as_count("n_tokens", n_tokens))
        plan.pop("owed")
        return PrefixHit(**plan, moves=no_prefix_moves(None, HIT, self))

    # -- the store alone ------------------------------------------------------
    def publish_rows(self, keys: Any, start: int, end: int, rows: Any) -> None:
        """Record rows ``[start, end)`` given by the caller (held mode)."""
        if self._external:
            raise ValueError("publish_rows needs a held-row store")
        chain = self._keys(keys)
        start = as_count("start", start)
        end = as_count("end", end)
        c = self.config
        arr = as_rows(rows, c.feature_dim)
        plan = self._plan(chain, start, end)
        if arr.shape[0] != end - start:
            raise ValueError(f"{arr.shape[0]} rows for positions [{start}, {end})")
        kept = [p for _, s, e, _ in plan for p in range(self._kept_first(s, e), e)]
        x = arr[[p - start for p in kept]]
        if c.nonfinite == "error" and len(x):
            limit = np.float32(rf.bounds(c.storage, c.stage_dtype)[0])
            with np.errstate(invalid="ignore"):
                if not np.all(np.abs(x.astype(np.float32)) < limit):
                    raise ValueError("a row holds a value this store's rows cannot carry (nonfinite='error')")
        enc = rf.encode(x, c.storage, "keep" if c.nonfinite == "error" else c.nonfinite, c.stage_dtype)
        by_pos = dict(zip(kept, np.ascontiguousarray(enc).view(np.uint8).reshape(len(kept), c.row_bytes)))
        for _, s, e, b in plan:
            if b is not None and any(b.rows[p] != by_pos[p].tobytes() for p in range(b.first, e)):
                raise ValueError(f"the block at [{s}, {e}) is already held with other rows")
        self._commit(plan, lambda p: by_pos[p].tobytes())

    def publish_slots(self, keys: Any, start: int, end: int) -> np.ndarray:
        """External-row mode: the table slot of each position (-1: not kept, or already held)."""
        if not self._external:
            raise ValueError("publish_slots needs an external-row store")
        chain = self._keys(keys)
        start = as_count("start", start)
        end = as_count("end", end)
        plan = self._plan(chain, start, end)
        out = np.full(end - start, -1, np.int64)
        for b in self._commit(plan, None):
            out[b.first - start:b.end - start] = b.slots(self.page_rows)
        return out

    def evict(self, keys: Any) -> int:
        """Drop the blocks with these keys; returns how many were held."""
        n = 0
        for k in self._keys(keys):
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
        return as_key(key) in self._blocks

    def keys(self) -> list[bytes]:
        """Keys held, least recently used first."""
        return list(self._blocks)

    def _block(self, key: Any) -> _Block:
        b = self._blocks.get(as_key(key))
        if b is None:
            raise ValueError(f"this store holds no block with key {key!r}")
        return b

    def info(self, key: Any) -> dict[str, int]:
        """``start``, ``end``, ``first_row``, ``rows``, ``pages`` of one block."""
        b = self._block(key)
        return {"start": b.start, "end": b.end, "first_row": b.first, "rows": b.end - b.first, "pages": len(b.pages)}

    def block_slots(self, key: Any) -> np.ndarray:
        """Table slots of the block's kept rows, in position order."""
        return np.array(self._block(key).slots(self.page_rows), np.int64)

    def stats(self) -> dict[str, int]:
        """The counters (``SEMANTIC_PREFIX_STATS``)."""
        out = dict(self._stats)
        out["bytes"] = out["pages"] * self._page_bytes
        return out

    def export_block(self, key: Any, rows: Any = None) -> bytes:
        """The block as bytes (``prefix_block_format``); external mode takes the owner's ``rows``."""
        b = self._block(key)
        n = b.end - b.first
        if self._external:
            if rows is None:
                raise ValueError("an external-row store exports the rows its owner read from block_slots(key)")
            data = bytes(readable_bytes(np.ascontiguousarray(rows, dtype=np.uint8).reshape(-1)))
            if len(data) != n * self.row_bytes:
                raise ValueError(f"the block has {n} rows of {self.row_bytes} bytes, got {len(data)} bytes")
        else:
            if rows is not None:
                raise ValueError("a held-row store exports its own rows: pass no rows")
            data = b"".join(b.rows[p] for p in range(b.first, b.end))
        return prefix_block_format.pack(self.config, self.block_tokens,
                                        prefix_block_format.PrefixBlock(b.key, b.start, b.end, n, data))

    def import_block(self, data: Any) -> np.ndarray | None:
        """Add the block in ``data``; bad data is a ValueError and changes nothing.

        External-row mode: the slots where the owner writes the data's rows (-1 when already held)."""
        blk = prefix_block_format.unpack(self.config, self.block_tokens, bytes(readable_bytes(data)))
        plan = self._plan([blk.key], blk.start, blk.end)
        rb = self.row_bytes
        first = blk.end - blk.n_rows
        row = {first + t: blk.rows[t * rb:(t + 1) * rb] for t in range(blk.n_rows)}
        held = plan[0][3]
        if held is not None and not self._external and any(held.rows[p] != row[p] for p in row):
            raise ValueError("the block is already held with other rows")
        added = self._commit(plan, row.__getitem__)
        if not self._external:
            return None
        return np.array(added[0].slots(self.page_rows), np.int64) if added else np.full(blk.n_rows, -1, np.int64)
