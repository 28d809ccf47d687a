"""The reference prefix store's own argument rules and messages, spelled out.

As :mod:`dspark_core.reference.arguments` for the Stager: nothing here comes
from the core or its binding. The conversions (keys, chains, block bytes)
and the wording of every message are written again from docs/prefix_cache.md;
the differential tests compare every exception's type and message with the
core's, so a rule that drifts on either side shows up.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ..errors import ConfigError
from .arguments import bad_value

#: Keys are 1..64 bytes (a SHA-256 block hash is 32).
MAX_KEY_BYTES = 64
#: Largest block (``block_tokens``), as the window's limit.
MAX_BLOCK_TOKENS = 1 << 30
#: Positions and counts stay below this.
MAX_POSITION = 1 << 62
#: The fields a Stager must share with the store, in the order a mismatch names them.
SHARED_FIELDS = ("feature_dim", "storage", "window", "block_size", "nonfinite", "stage_dtype", "rows")

_U64 = 1 << 64
_I64_MIN = -(1 << 63)


# -- conversions ------------------------------------------------------------------


def key(value: Any) -> bytes:
    """One key: bytes as given, an int as its 64-bit two's complement (8 bytes, little-endian)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (str, bool)) or value is None:
        raise TypeError(f"a key must be bytes or an int, got {type(value).__name__}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"a key must be bytes or an int, got {type(value).__name__}") from None
    if not _I64_MIN <= v < _U64:
        raise ValueError(f"an int key must be in [-2**63, 2**64), got {v}")
    return (v % _U64).to_bytes(8, "little")


def key_chain(value: Any) -> list[bytes]:
    """A chain: a sequence of keys, a 1-D integer array or a 2-D uint8 array (a key per row)."""
    if isinstance(value, (bytes, bytearray, memoryview, str)) or not hasattr(value, "__len__"):
        raise TypeError(f"keys must be a sequence of keys (bytes or ints) or an array, got {type(value).__name__}")
    if isinstance(value, np.ndarray):
        if value.ndim == 1 and value.dtype.kind in "iu":
            if value.dtype.kind == "u" and value.dtype.itemsize > 8:
                raise TypeError(f"int keys must fit 64 bits, got dtype {value.dtype}")
            return [key(int(v)) for v in value]
        if value.ndim == 2 and value.dtype == np.uint8:
            return [bytes(row) for row in value]
        raise TypeError(
            f"a key array must be 1-D integers or 2-D uint8 (n, key_bytes), got {value.ndim}-D {value.dtype}"
        )
    return [key(k) for k in value]


def block_rows(value: Any) -> bytes:
    """An external-row block's rows for ``export_block``: bytes-like or a uint8 array."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, np.ndarray) or value.dtype != np.uint8:
        what = f"dtype {value.dtype}" if isinstance(value, np.ndarray) else type(value).__name__
        raise TypeError(f"rows must be uint8 (the block's rows read from block_slots(key)), got {what}")
    return value.tobytes()


def block_data(value: Any) -> bytes:
    """An exported block, any buffer, as bytes."""
    try:
        return memoryview(value).tobytes()
    except (TypeError, ValueError):
        raise TypeError(f"block data must be bytes-like, got {type(value).__name__}") from None


# -- values and their messages ------------------------------------------------------


def key_text(k: bytes) -> str:
    """A key in a message: hex of its first 12 bytes."""
    return "0x" + k[:12].hex() + ("..." if len(k) > 12 else "")


def key_chains(call: str, value: Any, n: int) -> list[list[bytes]]:
    """A batch's chains, one per sequence (errors start with ``call`` and name the chain)."""
    if isinstance(value, (bytes, bytearray, memoryview, str)) or not hasattr(value, "__len__"):
        raise TypeError(f"{call}: keys must be one chain of keys per sequence, got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{call}: {n} sequences for {len(value)} key chains")
    chains = []
    for i, chain in enumerate(value):
        try:
            chains.append(key_chain(chain))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{call}: keys[{i}]: {exc}") from None
    return chains


def batch_without_room(call: str, kept_pages: int, largest: int, n_pages: int) -> ValueError:
    return ValueError(f"{call}: the batch refreshes blocks of {kept_pages} pages from rows its sequences no longer "
                      f"hold, and a new block needs {largest} of the store's {n_pages} pages beside them: publish "
                      "fewer blocks at once (nothing changed)")


def span(a: int, b: int) -> str:
    return f"[{a}, {b})"


def store_options(block_tokens: int, budget_bytes: int) -> None:
    if block_tokens < 1:
        raise ConfigError(f"block_tokens must be >= 1, got {block_tokens}")
    if block_tokens > MAX_BLOCK_TOKENS:
        raise ConfigError(f"block_tokens ({block_tokens}) must be <= 2**30")
    if budget_bytes < 1:
        raise ConfigError(f"budget_bytes must be >= 1, got {budget_bytes}")


def budget_too_small(budget: int, max_kept: int, row_bytes: int, pages: int, page_bytes: int) -> ConfigError:
    return ConfigError(
        f"budget_bytes ({budget}) is smaller than one block: {max_kept} rows of {row_bytes} bytes in {pages} "
        f"page(s) of {page_bytes} bytes need {pages * page_bytes}"
    )


def _fields(c: Any) -> str:
    return (f"feature_dim={c.feature_dim}, storage={c.storage}, nonfinite={c.nonfinite}, "
            f"stage_dtype={c.stage_dtype}, window={c.window}, block_size={c.block_size}, rows={c.rows}")


def compatible(store: Any, stager: Any) -> None:
    """A Stager of ``stager`` (a config) can use a store of ``store``: ConfigError naming the fields."""
    diff = [f for f in SHARED_FIELDS if getattr(store, f) != getattr(stager, f)]
    if diff:
        raise ConfigError(
            f"this PrefixStore holds rows of ({_fields(store)}) but the Stager has ({_fields(stager)}): "
            f"{', '.join(diff)} differ. Stagers share a store only when all of these are equal"
        )


def chain_keys(keys: list[bytes]) -> None:
    """Every key of a chain is 1..64 bytes."""
    for i, k in enumerate(keys):
        if not 1 <= len(k) <= MAX_KEY_BYTES:
            raise ValueError(f"key {i} has {len(k)} bytes; keys must be 1..{MAX_KEY_BYTES} bytes")


def wrong_mode(call: str, held_needed: bool, other: str) -> TypeError:
    if held_needed:
        return TypeError(f"{call} needs a held-row store; this one keeps its rows in the owner's table (use {other})")
    return TypeError(f"{call} needs an external-row store; this one holds its rows (use {other})")


def publish_span(keys: list[bytes], start: int, end: int, block_tokens: int) -> None:
    """The positions of a publish and the chain's length, then its keys."""
    if start < 0 or end >= MAX_POSITION or end <= start:
        raise ValueError(f"publish needs positions 0 <= start < end < 2**62, got {span(start, end)}")
    if start % block_tokens:
        raise ValueError(f"publish must start at a block boundary: start {start} is not a multiple of block_tokens "
                         f"({block_tokens})")
    n = -(-(end - start) // block_tokens)
    if len(keys) != n:
        raise ValueError(f"{len(keys)} keys for positions {span(start, end)}: that is {n} block(s) of "
                         f"block_tokens={block_tokens} (the last may be partial), one key each")
    chain_keys(keys)


def key_twice(k: bytes) -> ValueError:
    return ValueError(f"key {key_text(k)} appears twice in the chain (blocks of a chain have distinct keys)")


def key_moved(k: bytes, held: tuple[int, int], wanted: tuple[int, int]) -> ValueError:
    return ValueError(f"key {key_text(k)} is held for positions {span(*held)}, not {span(*wanted)}: a key must name "
                      "the same block every time")


def hit_span(keys: list[bytes], h: int, block_tokens: int) -> None:
    """n_tokens and the chain's length, then its keys."""
    if not 0 <= h < MAX_POSITION:
        raise ValueError(f"n_tokens must be in [0, 2**62), got {h}")
    n = -(-h // block_tokens)
    if len(keys) != n:
        raise ValueError(f"{len(keys)} keys for a hit of {h} tokens: the chain needs {n} (one per block of "
                         f"block_tokens={block_tokens}, the last may be partial)")
    chain_keys(keys)


def chain_mismatch(i: int, k: bytes, held: tuple[int, int], wanted: tuple[int, int]) -> ValueError:
    return ValueError(f"the key chain does not match the positions: key {i} ({key_text(k)}) is held for positions "
                      f"{span(*held)}, but block {i} of a hit covers {span(*wanted)}")


def holds_no_rows(seq: int) -> ValueError:
    return ValueError(f"sequence {seq} holds no rows (nothing was processed since begin())")


def not_final(seq: int, start: int, end: int, horizon: int, final_end: int, tentative: bool) -> ValueError:
    more = "; call accept() first" if tentative else ""
    return ValueError(f"sequence {seq}: positions {span(start, end)} reach past its final rows "
                      f"({span(horizon, final_end)}{more})")


def rows_gone(seq: int, first: int, count: int, block: tuple[int, int], horizon: int) -> ValueError:
    return ValueError(
        f"sequence {seq}: rows {span(first, min(horizon, first + count))} of the block at {span(*block)} are no "
        f"longer held (its oldest row is {horizon}): publish each block when the server hands it over, before "
        "later rows push it out of the window, or pass its rows to publish_rows (external rows: the store table's "
        "publish_rows)"
    )


def other_rows(who: str, block: tuple[int, int], k: bytes) -> ValueError:
    return ValueError(f"{who}the block at {span(*block)} (key {key_text(k)}) is already held with other rows: a block "
                      "published twice must carry the same rows")


def row_count(n: int, dim: int, dtype: str, start: int, end: int, got: int) -> ValueError:
    return ValueError(f"rows must be {n} x {dim} {dtype} values for positions {span(start, end)}, got {got} rows")


def unstorable(row: int, start: int, channel: int, value: float, storage: str, stage_dtype: str,
               limit: float) -> ValueError:
    return ValueError(f"{bad_value(start, row, channel, value, storage, stage_dtype, limit)}; nothing was "
                      "published (nonfinite='error')")


def no_block(k: bytes) -> ValueError:
    return ValueError(f"this PrefixStore holds no block with key {key_text(k)}")


def export_rows(external: bool, rows: bytes | None, n_rows: int, row_bytes: int) -> None:
    """The rows an export is given: the block's in external-row mode, none in held mode."""
    body = n_rows * row_bytes
    if external and (rows is None or len(rows) != body):
        got = "none" if rows is None else f"{len(rows)} bytes"
        raise ValueError(f"an external-row store exports the rows its owner read from block_slots(key): {n_rows} rows "
                         f"of {row_bytes} bytes ({body} bytes), got {got}")
    if not external and rows is not None:
        raise ValueError("a held-row store exports its own rows: pass no rows")
