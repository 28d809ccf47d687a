"""The target's token embedding (frozen, tied) and the draft vocabulary with its draft-to-target map.

The embedding rows are read from the target's GGUF (``token_embd.weight``) and
dequantized with gguf-py, only the rows asked for, scaled by ``sqrt(n_embd)`` as Gemma
scales its input embeddings. The draft vocabulary is the ``V`` most frequent greedy
labels of the training captures (ties broken by token id); ``d2t[i]`` is draft token
``i``'s target id, as EAGLE-3's map.
"""

from __future__ import annotations

import math
import struct
from typing import Sequence

import numpy as np

__all__ = ["Embedding", "draft_vocabulary", "find_tensor"]

#: The embedding tensor's name in a llama.cpp GGUF.
EMBD_TENSOR = "token_embd.weight"


#: Byte sizes of GGUF's scalar metadata types (by type id); 8 is a string, 9 an array.
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def find_tensor(path: str, name: str) -> tuple[int, int, tuple[int, ...]]:
    """``(file offset, ggml type, dims)`` of tensor ``name`` in a GGUF file, from its header alone
    (gguf-py's reader parses every metadata array, the 262k-token vocabulary included: half a minute)."""
    buf = np.memmap(path, np.uint8, mode="r")
    mv = memoryview(buf)
    pos = 0

    def u(fmt: str) -> int:
        nonlocal pos
        (v,) = struct.unpack_from(fmt, mv, pos)
        pos += struct.calcsize(fmt)
        return int(v)

    def skip_string() -> str:
        nonlocal pos
        n = u("<Q")
        s = bytes(mv[pos : pos + n]).decode("utf-8", "replace")
        pos += n
        return s

    def skip_value(t: int) -> None:
        nonlocal pos
        if t == _STRING:
            skip_string()
        elif t == _ARRAY:
            et, n = u("<I"), u("<Q")
            if et in _SCALAR:
                pos += _SCALAR[et] * n
            else:
                for _ in range(n):
                    skip_value(et)
        else:
            pos += _SCALAR[t]

    if bytes(mv[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    u("<I")  # version
    n_tensors, n_kv = u("<Q"), u("<Q")
    alignment = 32
    for _ in range(n_kv):
        key = skip_string()
        t = u("<I")
        if key == "general.alignment":
            alignment = u("<I")
        else:
            skip_value(t)
    found = None
    for _ in range(n_tensors):
        tname = skip_string()
        dims = tuple(u("<Q") for _ in range(u("<I")))
        ttype, off = u("<I"), u("<Q")
        if tname == name:
            found = (off, ttype, dims)
    if found is None:
        raise KeyError(f"{path} has no tensor {name}")
    data_start = -(-pos // alignment) * alignment
    return data_start + found[0], found[1], found[2]


class Embedding:
    """Rows of the target's token embedding, dequantized on demand (and memoised)."""

    def __init__(self, model_path: str) -> None:
        import gguf

        offset, ttype, dims = find_tensor(model_path, EMBD_TENSOR)
        self._type = gguf.GGMLQuantizationType(ttype)
        block, block_bytes = gguf.GGML_QUANT_SIZES[self._type]
        self.width, self.n_vocab = int(dims[0]), int(dims[1])
        row_bytes = self.width // block * block_bytes
        self._data = np.memmap(model_path, np.uint8, mode="r", offset=offset, shape=(self.n_vocab, row_bytes))
        self._dequantize = gguf.quants.dequantize
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
