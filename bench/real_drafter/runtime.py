"""A trained drafter behind the speculative loop's Drafter protocol, with its own per-sequence KV cache.

:class:`BlockRuntime` (``decode``) and :class:`ChainRuntime` (``decode_chain``) keep,
per sequence, each layer's keys and values of the entries staged so far, addressed by
drafter position: staged positions must continue the cache (asserted: a plan that
skipped or repeated a row is a bug, not a miss), ``crop`` drops the entries from a
position on, ``clear`` empties it. Each returns the ``B`` draft tokens as target ids
(through the draft-to-target map).

``position_offset`` is added to every position the drafter runs at: 0 runs it where
the plan says (rebased); the plan's ``pos_base`` runs a windowed plan at absolute
positions (the window kept as a mask over the same rows), the comparison of
:mod:`offline` that tells the window's cap on distances from the rebase.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from train import Trained
from vocab import Embedding

__all__ = ["BlockRuntime", "ChainRuntime", "runtime_for"]

#: Initial cache capacity per sequence (grown by doubling).
_CAPACITY = 1024


class _Cache:
    """One sequence's per-layer keys and values ``(capacity, heads, hd)``, ``n`` of them in use."""

    def __init__(self, n_layers: int, heads: int, hd: int) -> None:
        self.k = [torch.zeros(_CAPACITY, heads, hd) for _ in range(n_layers)]
        self.v = [torch.zeros(_CAPACITY, heads, hd) for _ in range(n_layers)]
        self.n = 0
        self.peak = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: int) -> None:
        need = at + len(k)
        if need > len(self.k[layer]):
            cap = max(need, 2 * len(self.k[layer]))
            for lst in (self.k, self.v):
                grown = torch.zeros(cap, *lst[layer].shape[1:])
                grown[: len(lst[layer])] = lst[layer]
                lst[layer] = grown
        self.k[layer][at:need] = k
        self.v[layer][at:need] = v

    def view(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][None, :n], self.v[layer][None, :n]


class _Runtime:
    kind = "block"

    def __init__(self, trained: Trained, emb: Embedding) -> None:
        self.t = trained
        self.model = trained.model.eval()
        self.c = trained.config
        self.emb = emb
        self.block_size = self.c.block_size
        self.mask_token_id = self.c.mask_token_id
        self.position_offset = 0
        self.max_position = -1  #: the largest position the drafter ran at (offset included)
        self.drafter_s = 0.0  #: time inside decode / decode_chain
        self.calls = 0
        self._caches: dict[int, _Cache] = {}

    def _cache(self, seq: int) -> _Cache:
        if seq not in self._caches:
            self._caches[seq] = _Cache(self.c.n_layers, self.c.n_heads, self.c.head_dim)
        return self._caches[seq]

    def clear(self, seq: int) -> None:
        self._cache(seq).n = 0

    def crop(self, seq: int, from_pos: int) -> None:
        c = self._cache(seq)
        c.n = min(c.n, max(0, int(from_pos)))

    def peak_cache_len(self, seq: int | None = None) -> int:
        return max((c.peak for s, c in self._caches.items() if seq is None or s == seq), default=0)

    def _positions(self, positions: Any, c: _Cache) -> torch.Tensor:
        pos = np.asarray(positions, np.int64)
        if len(pos):
            assert int(pos[0]) == c.n and np.array_equal(pos, np.arange(c.n, c.n + len(pos))), (
                f"staged positions {pos[:3]}... do not continue the drafter cache (length {c.n})")
        return torch.from_numpy(pos + self.position_offset)

    def _rows(self, rows: Any) -> torch.Tensor:
        a = np.asarray(rows)
        if a.dtype != np.float32 or not a.flags.writeable or not a.flags.c_contiguous:
            a = np.array(a, np.float32, order="C")  # torch wants its own writeable float32 buffer
        return torch.from_numpy(a)

    def _to_target(self, draft_ids: Sequence[int]) -> np.ndarray:
        return self.t.d2t[np.asarray(draft_ids, np.int64)]


class BlockRuntime(_Runtime):
    """The block drafter's rounds (see the module docstring)."""

    kind = "block"

    def decode(self, seq: int, positions: Any, rows: Any, block_tokens: Any, block_positions: Any) -> np.ndarray:
        t0 = time.perf_counter()
        c = self._cache(seq)
        with torch.inference_mode():
            pos = self._positions(positions, c)
            if len(pos):
                kv = self.model.context(self._rows(rows), pos)
                for i, (k, v) in enumerate(kv):
                    c.append(i, k, v, c.n)
                c.n += len(pos)
                c.peak = max(c.peak, c.n)
            bpos_np = np.asarray(block_positions, np.int64)
            assert int(bpos_np[0]) == c.n, f"the block at {bpos_np[0]} does not follow the cache (length {c.n})"
            bpos = torch.from_numpy(bpos_np + self.position_offset)[None]
            first = torch.from_numpy(self.emb.rows([int(block_tokens[0])]))
            blk = torch.cat([first, self.model.mask_embedding.expand(self.block_size - 1, -1)])[None]
            logits = self.model.block([c.view(i, c.n) for i in range(self.c.n_layers)], blk, bpos, None)
            draft = logits[0].argmax(-1).numpy()
        self.max_position = max(self.max_position, int(bpos[0, -1]))
        self.drafter_s += time.perf_counter() - t0
        self.calls += 1
        return self._to_target(draft)


class ChainRuntime(_Runtime):
    """The chain drafter's rounds (see the module docstring)."""

    kind = "chain"

    def decode_chain(self, seq: int, positions: Any, rows: Any, successors: Any, block_positions: Any) -> np.ndarray:
        t0 = time.perf_counter()
        c = self._cache(seq)
        m = self.model
        with torch.inference_mode():
            pos = self._positions(positions, c)
            succ = np.asarray(successors, np.int64)
            u = m.entry_input(m.row_features(self._rows(rows)), torch.from_numpy(self.emb.rows(succ)), pos)
            k, v = m.kv(u, pos)
            c.append(0, k, v, c.n)
            c.n += len(pos)
            # the newest entry's output (causal: it sees every cached entry)
            h = m.entries(u[-1:][None], pos[-1:][None], *c.view(0, c.n), None)
            draft = [int(m.logits(h)[0, -1].argmax())]
            bpos = np.asarray(block_positions, np.int64)
            assert int(bpos[0]) == c.n, f"the draft steps at {bpos[0]} do not follow the cache (length {c.n})"
            for j in range(1, self.block_size):
                p = torch.from_numpy(bpos[j - 1 : j] + self.position_offset)
                tok = torch.from_numpy(self.emb.rows(self._to_target(draft[-1:])))
                u = m.entry_input(m.self_fc(h[0, -1:]), tok, p)
                k, v = m.kv(u, p)
                c.append(0, k, v, c.n)
                c.n += 1
                h = m.entries(u[None], p[None], *c.view(0, c.n), None)
                draft.append(int(m.logits(h)[0, -1].argmax()))
            c.peak = max(c.peak, c.n)
        self.max_position = max(self.max_position, int(bpos[-1]) + self.position_offset)
        self.drafter_s += time.perf_counter() - t0
        self.calls += 1
        return self._to_target(draft)


def runtime_for(trained: Trained, emb: Embedding) -> BlockRuntime | ChainRuntime:
    """The runtime of a trained drafter's kind."""
    return BlockRuntime(trained, emb) if trained.config.kind == "block" else ChainRuntime(trained, emb)
