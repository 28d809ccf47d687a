"""Prefix-cache block keys as the prefix store takes them.

A key names one block of a cached prompt: whatever the server's prefix cache
already uses (a vLLM-style chained block hash, an SGLang radix page's hash, a
hash of a llama-server prompt chunk). The core stores keys as opaque byte
strings of 1..64 bytes; from Python a key is

* a bytes-like object (``bytes``, ``bytearray``, ``memoryview``) of 1..64 bytes, or
* an ``int`` in ``[-2**63, 2**64)``: shorthand for its 64-bit two's
  complement, 8 bytes little-endian (so ``-1`` and ``2**64 - 1`` are the same
  key, as they are the same 64-bit hash).

A chain (the keys of blocks 0, 1, ... of a prompt) is a sequence of keys, or
a 1-D integer ndarray (each element an int key), or a 2-D uint8 ndarray
``(n, key_bytes)``. It is handed to the core as one byte string plus ``n + 1``
offsets.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

__all__ = ["MAX_KEY_BYTES", "as_key", "as_key_chain"]

#: Longest key (a SHA-256 block hash is 32 bytes).
MAX_KEY_BYTES = 64

_U64 = 1 << 64
_I64_MIN = -(1 << 63)


def as_key(key: Any) -> bytes:
    """One key as the bytes the core stores (TypeError / ValueError naming the problem)."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        out = bytes(key)
        if not 1 <= len(out) <= MAX_KEY_BYTES:
            raise ValueError(f"a key must be 1..{MAX_KEY_BYTES} bytes, got {len(out)}")
        return out
    if isinstance(key, (str, bool)) or key is None:
        raise TypeError(f"a key must be bytes or an int, got {type(key).__name__}")
    try:
        v = operator.index(key)
    except TypeError:
        raise TypeError(f"a key must be bytes or an int, got {type(key).__name__}") from None
    if not _I64_MIN <= v < _U64:
        raise ValueError(f"an int key must be in [-2**63, 2**64), got {v}")
    return (v % _U64).to_bytes(8, "little")


def as_key_chain(keys: Any) -> tuple[bytes, np.ndarray]:
    """A chain of keys as ``(bytes, offsets)``: key ``i`` is ``bytes[offsets[i]:offsets[i + 1]]``.

    ``offsets`` is a C-contiguous ``np.uintp`` array of ``n + 1`` entries.
    """
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not hasattr(keys, "__len__"):
        raise TypeError(f"keys must be a sequence of keys (bytes or ints) or an array, got {type(keys).__name__}")
    if isinstance(keys, np.ndarray):
        if keys.ndim == 1 and keys.dtype.kind in "iu":
            if keys.dtype.kind == "u" and keys.dtype.itemsize > 8:
                raise TypeError(f"int keys must fit 64 bits, got dtype {keys.dtype}")
            data = keys.astype("<i8" if keys.dtype.kind == "i" else "<u8").tobytes()
            return data, np.arange(0, 8 * len(keys) + 1, 8, dtype=np.uintp)
        if keys.ndim == 2 and keys.dtype == np.uint8:
            n, width = keys.shape
            if n and not 1 <= width <= MAX_KEY_BYTES:
                raise ValueError(f"a key must be 1..{MAX_KEY_BYTES} bytes, got rows of {width}")
            return np.ascontiguousarray(keys).tobytes(), np.arange(0, width * n + 1, max(width, 1), dtype=np.uintp)[: n + 1]
        raise TypeError(
            f"a key array must be 1-D integers or 2-D uint8 (n, key_bytes), got {keys.ndim}-D {keys.dtype}"
        )
    parts = [as_key(k) for k in keys]
    offsets = np.zeros(len(parts) + 1, np.uintp)
    if parts:
        np.cumsum([len(p) for p in parts], out=offsets[1:])
    return b"".join(parts), offsets
