"""Rows of vLLM's cached prompt blocks, so a prefix-cache hit restages what a full prefill would have.

A :class:`~dspark_core.PrefixStore` in external-row mode keyed by vLLM's own
block hashes (``vllm.v1.core.kv_cache_utils.hash_block_tokens`` with the
engine's hash function, chained from ``NONE_HASH`` as vLLM's scheduler chains
them), its rows in a torch table beside the staging's ring table on vLLM's
device. As a request's prompt blocks are computed, their captured rows are published; a new
request that starts past position 0 (vLLM computed only the tokens after its
hit) begins from the store's hit instead of a cold sequence. The copies
between the two tables are the store's ``PrefixMoves``, applied here with
index copies on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._ext._stager import PrefixStore

__all__ = ["PrefixRows", "vllm_block_hashes", "DEFAULT_BUDGET_BYTES"]

logger = logging.getLogger(__name__)

#: The store's row budget when DSPARK_VLLM_PREFIX_BYTES does not set one (LRU beyond it).
DEFAULT_BUDGET_BYTES = 256 << 20


def vllm_block_hashes(tokens: Sequence[int], block_tokens: int, hash_name: str, n_blocks: int) -> list[bytes]:
    """vLLM's chained hashes of the first ``n_blocks`` full blocks of ``tokens`` (no extra keys:
    multimodal inputs, LoRA and cache salts change vLLM's hashes, and such requests then miss)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    fn = get_hash_fn_by_name(hash_name)
    out: list[bytes] = []
    parent = None
    for b in range(n_blocks):
        parent = hash_block_tokens(fn, parent, tokens[b * block_tokens:(b + 1) * block_tokens])
        out.append(bytes(parent))
    return out


class PrefixRows:
    """The prefix store of one RequestStaging and its row table (torch, on the staging's device)."""

    def __init__(self, staging: Any, *, block_tokens: int, hash_name: str, budget_bytes: int) -> None:
        import torch

        self.staging = staging
        self.block_tokens = block_tokens
        self.hash_name = hash_name
        self.store = PrefixStore(staging.stager.config, block_tokens=block_tokens, budget_bytes=budget_bytes)
        self.table = torch.zeros((int(self.store.table_rows), staging.table.shape[1]), dtype=staging.table.dtype,
                                 device=staging.device)
        self._published: dict[str, int] = {}     # request -> prompt positions published so far
        self.hits = 0
        self.hit_rows = 0

    def _copy(self, moves: Any, to_store: bool) -> None:
        import torch

        arr = np.asarray(moves, np.int64).reshape(-1, 3)
        if not len(arr):
            return
        src_t, dst_t = (self.staging.table, self.table) if to_store else (self.table, self.staging.table)
        src = np.concatenate([np.arange(s, s + m) for s, _, m in arr])
        dst = np.concatenate([np.arange(d, d + m) for _, d, m in arr])
        dev = self.staging.device
        dst_t.index_copy_(0, torch.from_numpy(dst).to(dev), src_t.index_select(0, torch.from_numpy(src).to(dev)))

    def hit(self, req_id: str, seq: int, prompt: Sequence[int], n_tokens: int) -> bool:
        """Start ``seq`` from the store's rows of ``prompt[:n_tokens]`` (vLLM's hit).

        Returns whether the sequence now holds every row a full prefill's first
        round would stage; False leaves it begun cold at ``n_tokens``."""
        n_blocks = -(-n_tokens // self.block_tokens)
        keys = vllm_block_hashes(prompt, self.block_tokens, self.hash_name, n_blocks)
        tokens = np.asarray(prompt[:n_tokens], np.int32) if self.staging.kind == "chain" else None
        found = self.store.lookup(keys, n_tokens)
        if not found.complete:
            return False
        hit = self.store.hit(self.staging.stager, seq, keys, n_tokens, tokens=tokens)
        self._copy(hit.moves, to_store=False)
        self._published[req_id] = n_tokens
        self.hits += 1
        self.hit_rows += int(hit.rows)
        return bool(hit.complete)

    def publish(self, req_id: str, prompt: Sequence[int], first: int, rows: Any) -> None:
        """Publish the prompt blocks that lie whole in this step's rows of ``req_id``.

        ``rows``: the step's captured rows of the request, at positions ``first, first + 1, ...``.
        The rows come from the capture, not from the ring, since a prefill longer than the window
        keeps only its newest rows in the ring (``publish_slots``: the store says which rows of a
        block it keeps and where).
        """
        import torch

        bt = self.block_tokens
        lo = -(-first // bt) * bt
        hi = min(first + int(rows.shape[0]), len(prompt)) // bt * bt
        lo = max(lo, self._published.get(req_id, 0))
        if hi <= lo:
            return
        keys = vllm_block_hashes(prompt, bt, self.hash_name, hi // bt)
        try:
            slots = np.asarray(self.store.publish_slots(keys[lo // bt:], lo, hi), np.int64)
        except ValueError as err:
            logger.debug("dspark_core: prefix blocks [%d, %d) of %s not published: %s", lo, hi, req_id, err)
            return
        keep = np.flatnonzero(slots >= 0)
        if len(keep):
            dev = self.staging.device
            src = torch.from_numpy(keep + (lo - first)).to(dev)
            self.table.index_copy_(0, torch.from_numpy(slots[keep]).to(dev),
                                   rows.index_select(0, src).to(self.table.dtype))
        self._published[req_id] = hi

    def forget(self, req_id: str) -> None:
        """The request ended: its blocks stay in the store (vLLM's cache keeps them too)."""
        self._published.pop(req_id, None)
