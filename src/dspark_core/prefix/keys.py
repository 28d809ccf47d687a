"""The prefix store binding's argument conversions: block keys, key chains, block bytes.

A key names one block of a cached prompt: whatever the server's prefix cache
already uses (a vLLM-style chained block hash, an SGLang radix page's hash, a
hash of a llama-server prompt chunk). The core stores keys as opaque byte
strings of 1..64 bytes (its rule, checked there); from Python a key is

* a bytes-like object (``bytes``, ``bytearray``, ``memoryview``), or
* an ``int`` in ``[-2**63, 2**64)``: shorthand for its 64-bit two's
  complement, 8 bytes little-endian (so ``-1`` and ``2**64 - 1`` are the same
  key, as they are the same 64-bit hash).

A chain (the keys of blocks 0, 1, ... of a prompt) is a sequence of keys, or
a 1-D integer ndarray (each element an int key), or a 2-D uint8 ndarray
``(n, key_bytes)``. It is handed to the core as one byte string plus ``n + 1``
offsets.

Only conversions live here (as in ``_args``): their errors are about the
kind of an argument (TypeError) or an int key beyond 64 bits (ValueError).
What a key or a chain must be (lengths, one key per block, ...) is the
core's rule; the reference twin spells out its own copies.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, NamedTuple

import numpy as np

__all__ = ["as_key", "as_key_chain", "as_block_rows", "as_block_data"]

_U64 = 1 << 64
_I64_MIN = -(1 << 63)


def as_key(key: Any) -> bytes:
    """One key as the bytes the core stores (TypeError / ValueError naming the problem)."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, (str, bool)) or key is None:
        raise TypeError(f"a key must be bytes or an int, got {type(key).__name__}")
    try:
        v = operator.index(key)
    except TypeError:
        raise TypeError(f"a key must be bytes or an int, got {type(key).__name__}") from None
    if not _I64_MIN <= v < _U64:
        raise ValueError(f"an int key must be in [-2**63, 2**64), got {v}")
    return (v % _U64).to_bytes(8, "little")


class KeyBatch(NamedTuple):
    """A batch's chains as one key array: chain ``i`` is ``n_keys[i]`` keys whose bytes start at
    ``data[byte_start[i]:]``, with offsets ``offsets[off_start[i]:]`` (from 0, as a chain's)."""

    data: bytes
    offsets: np.ndarray  # np.uintp
    byte_start: np.ndarray  # np.uintp
    off_start: np.ndarray  # np.uintp
    n_keys: np.ndarray  # np.uintp


def _int_key_array(flat: list[int]) -> np.ndarray | None:
    """Int keys as their 8 little-endian bytes each (as :func:`as_key`), one array; None when one
    is outside [-2**63, 2**64) (the slow path then names it)."""
    try:
        return np.array(flat, "<i8")
    except OverflowError:
        if min(flat) < _I64_MIN or max(flat) >= _U64:
            return None
        return np.array([v % _U64 for v in flat], "<u8")


def as_key_chains(call: str, keys: Any, n: int) -> KeyBatch:
    """A batch's chains (``keys[i]``: sequence ``i``'s), each as :func:`as_key_chain` would give
    it, in one key array. Errors start with ``call`` and name the chain. Chains of int keys (the
    common case: hashes) are converted together, not key by key."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not hasattr(keys, "__len__"):
        raise TypeError(f"{call}: keys must be one chain of keys per sequence, got {type(keys).__name__}")
    if len(keys) != n:
        raise ValueError(f"{call}: {n} sequences for {len(keys)} key chains")
    if all(isinstance(c, (list, tuple)) for c in keys):
        flat = list(itertools.chain.from_iterable(keys))
        if set(map(type, flat)) <= {int}:  # plain ints (bools and numpy scalars take the slow path)
            wide = _int_key_array(flat)
            count = np.fromiter(map(len, keys), np.uintp, n) if n else np.zeros(0, np.uintp)
            if wide is not None:
                byte_start = np.zeros(n, np.uintp)
                if n > 1:
                    np.cumsum(count[:-1] * 8, out=byte_start[1:])
                width = int(count.max()) if n else 0
                return KeyBatch(wide.tobytes(), np.arange(width + 1, dtype=np.uintp) * 8, byte_start,
                                np.zeros(n, np.uintp), count)
    chains = []
    for i, chain in enumerate(keys):
        try:
            chains.append(as_key_chain(chain))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{call}: keys[{i}]: {exc}") from None
    sizes = np.fromiter((len(d) for d, _ in chains), np.uintp, n) if n else np.zeros(0, np.uintp)
    count = np.fromiter((len(o) - 1 for _, o in chains), np.uintp, n) if n else np.zeros(0, np.uintp)
    byte_start, off_start = np.zeros(n, np.uintp), np.zeros(n, np.uintp)
    if n > 1:
        np.cumsum(sizes[:-1], out=byte_start[1:])
        np.cumsum(count[:-1] + 1, out=off_start[1:])
    offsets = np.concatenate([o for _, o in chains]).astype(np.uintp) if n else np.zeros(0, np.uintp)
    return KeyBatch(b"".join(d for d, _ in chains), offsets, byte_start, off_start, count)


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
            return data, np.arange(len(keys) + 1, dtype=np.uintp) * 8
        if keys.ndim == 2 and keys.dtype == np.uint8:
            n, width = keys.shape
            return np.ascontiguousarray(keys).tobytes(), np.arange(n + 1, dtype=np.uintp) * width
        raise TypeError(
            f"a key array must be 1-D integers or 2-D uint8 (n, key_bytes), got {keys.ndim}-D {keys.dtype}"
        )
    parts = [as_key(k) for k in keys]
    offsets = np.zeros(len(parts) + 1, np.uintp)
    if parts:
        np.cumsum([len(p) for p in parts], out=offsets[1:])
    return b"".join(parts), offsets


def as_block_rows(rows: Any) -> memoryview:
    """An external-row block's rows for ``export_block`` as flat bytes: a bytes-like object or a
    uint8 array (the rows as read from ``block_slots(key)``); their count is the core's to check."""
    if isinstance(rows, (bytes, bytearray, memoryview)):
        return memoryview(bytes(rows))
    if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8:
        what = f"dtype {rows.dtype}" if isinstance(rows, np.ndarray) else type(rows).__name__
        raise TypeError(f"rows must be uint8 (the block's rows read from block_slots(key)), got {what}")
    return np.ascontiguousarray(rows).reshape(-1).data  # a 1-D uint8 array: a "B" view of its bytes


def as_block_data(data: Any) -> memoryview:
    """An exported block (any buffer) as flat bytes for ``import_block``."""
    try:
        view = memoryview(data)
    except (TypeError, ValueError):
        raise TypeError(f"block data must be bytes-like, got {type(data).__name__}") from None
    return memoryview(view.tobytes()) if not view.c_contiguous else view.cast("B")
