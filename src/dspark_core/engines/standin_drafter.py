"""A stand-in block drafter for a real target that has no trained drafter.

:class:`LookupDrafter` keeps the drafter side of the protocol real and lets the
session accept draft tokens:

* the staged rows go into a :class:`dspark_core.sim.toy.ToyDrafter` (a KV-injection
  drafter with random weights, strict about positions: staged positions must
  continue its cache and the block must follow the context), so every plan's
  ``clear_cache`` / positions / ``crop_from`` is exercised on the real rows;
* the draft tokens come from prompt lookup: the ``B`` tokens that followed the
  latest earlier occurrence of the last ``ngram`` tokens (down to one token),
  so text that repeats itself gets its drafts accepted and the verify batches
  exercise every ``n_accepted``.

Acceptance therefore says how repetitive the text is, not how good a drafter
is; it is the protocol and the rows that are real.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import numpy.typing as npt

from ..sim.toy import ToyDrafter

__all__ = ["LookupDrafter", "lookup_draft"]

#: Width of the toy drafter's token embedding table (real token ids are folded into it).
_TOY_VOCAB = 256


def lookup_draft(history: Sequence[int], n: int, ngram: int = 3) -> list[int]:
    """The ``n`` tokens that followed the latest earlier occurrence of ``history``'s last
    ``k`` tokens, for the largest ``k <= ngram`` that occurs; padded with the last token."""
    h = list(history)
    if not h:
        raise ValueError("lookup_draft needs at least one token of history")
    for k in range(min(ngram, len(h) - 1), 0, -1):
        tail = h[-k:]
        for start in range(len(h) - k - 1, -1, -1):  # latest earlier occurrence first
            if h[start : start + k] == tail:
                got = h[start + k : start + k + n]
                return got + [h[-1]] * (n - len(got))
    return [h[-1]] * n


class LookupDrafter:
    """Prompt-lookup drafts plus a toy KV-injection drafter fed with the staged rows.

    Args:
        history: returns the target's tokens at positions ``[0, n_past)`` when a round is drafted.
        feature_dim: width of a staged row.
        block_size: ``B``.
        ngram: longest suffix matched by the lookup.
        seed: seed of the toy drafter's weights.
    """

    mask_token_id = -1  #: unused: the block's mask rows are the toy drafter's own mask token

    def __init__(
        self, history: Callable[[], Sequence[int]], feature_dim: int, block_size: int, ngram: int = 3, seed: int = 0
    ) -> None:
        self.history = history
        self.block_size = block_size
        self.ngram = ngram
        self.toy = ToyDrafter(
            vocab_size=_TOY_VOCAB, feature_dim=feature_dim, block_size=block_size, lookahead=block_size,
            dtype=np.float32, seed=seed,
        )
        self.rows_consumed = 0

    def clear(self, seq: int) -> None:
        self.toy.clear(seq)

    def crop(self, seq: int, from_pos: int) -> None:
        self.toy.crop(seq, from_pos)

    def peak_cache_len(self, seq: int | None = None) -> int:
        return self.toy.peak_cache_len(seq)

    def decode(
        self,
        seq: int,
        positions: np.ndarray,
        rows: np.ndarray,
        block_tokens: Sequence[int] | npt.NDArray[np.integer[Any]],
        block_positions: np.ndarray,
    ) -> np.ndarray:
        """Run the toy drafter on the staged rows (position checks included); return ``B`` draft ids."""
        last = int(block_tokens[0])
        toy_block = [last % _TOY_VOCAB] + [self.toy.mask_token_id] * (len(block_tokens) - 1)
        self.toy.decode(seq, positions, rows, toy_block, block_positions)
        self.rows_consumed += len(positions)
        return np.asarray(lookup_draft([*self.history(), last], self.block_size, self.ngram), dtype=np.int64)
