"""The target's token embedding (frozen, tied) and the draft vocabulary with its draft-to-target map.

The embedding rows are read from the target's GGUF (``token_embd.weight``) and
dequantized with gguf-py, only the rows asked for, scaled by ``sqrt(n_embd)`` as Gemma
scales its input embeddings. The draft vocabulary is the ``V`` most frequent greedy
labels of the training captures (ties broken by token id); ``d2t[i]`` is draft token
``i``'s target id, as EAGLE-3's map.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["Embedding", "draft_vocabulary"]

#: The embedding tensor's name in a llama.cpp GGUF.
EMBD_TENSOR = "token_embd.weight"


class Embedding:
    """Rows of the target's token embedding, dequantized on demand (and memoised)."""

    def __init__(self, model_path: str) -> None:
        import gguf

        reader = gguf.GGUFReader(model_path)
        (t,) = [t for t in reader.tensors if t.name == EMBD_TENSOR]
        self._data, self._type = t.data, t.tensor_type
        self._dequantize = gguf.quants.dequantize
        self.n_vocab = int(t.data.shape[0])
        self.width = int(t.shape[0])
        self.scale = math.sqrt(self.width)
        self._memo: dict[int, np.ndarray] = {}

    def rows(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 ``(len(ids), width)``: the scaled embedding of each id."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        need = [int(i) for i in np.unique(ids) if int(i) not in self._memo]
        if need:
            got = self._dequantize(self._data[np.asarray(need)], self._type).reshape(len(need), self.width)
            for i, r in zip(need, got):
                self._memo[i] = (r * self.scale).astype(np.float32)
        return np.stack([self._memo[int(i)] for i in ids]) if len(ids) else np.zeros((0, self.width), np.float32)


def draft_vocabulary(labels: Sequence[np.ndarray], size: int) -> tuple[np.ndarray, float]:
    """``(d2t, coverage)``: the ``size`` most frequent labels (int64, most frequent first) and the
    fraction of the training labels they cover."""
    allv = np.concatenate([np.asarray(x, np.int64) for x in labels])
    ids, counts = np.unique(allv, return_counts=True)
    order = np.lexsort((ids, -counts))[:size]
    return ids[order], float(counts[order].sum() / len(allv))
