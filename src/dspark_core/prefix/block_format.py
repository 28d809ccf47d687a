"""The prefix block format (version 1): one prefix-store block as bytes for another process.

``PrefixStore.export_block`` writes it and ``import_block`` reads it (C++:
``csrc/src/prefix_store.cpp``); the reference twin packs and unpacks it here.
Both write identical bytes; tests compare them. Little-endian throughout, so
a block can live next to the KV blocks of the same prompt in a shared or
distributed cache (LMCache, Mooncake, Redis) and be imported by any process
whose store has the same configuration::

    offset size  field
    0      4     magic b"DSPB"
    4      2     version (u16) = 1
    6      2     header bytes (u16) = 64
    8      4     feature_dim (u32)                          fingerprint
    12     1     storage code (u8, index in STORAGES)       fingerprint
    13     1     nonfinite policy (u8)                      fingerprint
    14     1     staged element type (u8)                   fingerprint
    15     1     key length (u8, 1..64)
    16     4     window (u32)                               fingerprint
    20     4     block_size (u32)                           fingerprint
    24     4     row_bytes (u32)                            fingerprint
    28     4     block_tokens (u32)                         must match
    32     8     start: the block's first position (i64, a multiple of block_tokens)
    40     8     end: one past its last position (i64, end - start <= block_tokens)
    48     4     n_rows (u32): the kept rows [end - n_rows, end), as the keep
                 rule gives them (all of the block when end <= W - B, else
                 min(end - start, K))
    52     4     reserved, zero
    56     4     CRC-32C of the key and the rows [64, 64 + key length + n_rows * row_bytes)
    60     4     CRC-32C of the header bytes [0, 60)
    64     ...   the key, then n_rows rows in storage format, in position order

Importing checks length, magic, version, the header checksum, the
fingerprint and block_tokens, the consistency of the fields (the kept rows
must be what the importing store's keep rule gives) and the rows' checksum,
and raises ``ValueError`` naming the problem before anything changes. The
rows are trusted once the checksum matches, as a snapshot's are.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from ..stager.config import NONFINITE_POLICIES, STAGE_DTYPES, STORAGES, StagerConfig
from ..stager.snapshot_format import crc32c

__all__ = ["MAGIC", "VERSION", "HEADER_BYTES", "Fingerprint", "PrefixBlock", "fingerprint", "pack", "unpack",
           "refresh_checksums"]

MAGIC = b"DSPB"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHHIBBBBIIIIqqII")  # up to the two checksums
BODY_CRC_AT = 56
HEADER_CRC_AT = 60
assert _HEADER.size == BODY_CRC_AT

#: ``(feature_dim, storage_code, nonfinite_code, stage_code, window, block_size, row_bytes)``:
#: what a block must match in the importing store.
Fingerprint = tuple[int, int, int, int, int, int, int]


@dataclass(frozen=True)
class PrefixBlock:
    """A block as the format carries it: key, positions, and the kept rows (one bytes object)."""

    key: bytes
    start: int
    end: int
    n_rows: int
    rows: bytes


def fingerprint(config: StagerConfig) -> Fingerprint:
    """The fingerprint of a store of ``config`` (the core's code tables)."""
    return (config.feature_dim, STORAGES.index(config.storage), NONFINITE_POLICIES.index(config.nonfinite),
            STAGE_DTYPES.index(config.stage_dtype), config.window, config.block_size, config.row_bytes)


def pack(fp: Fingerprint, block_tokens: int, block: PrefixBlock) -> bytes:
    """The bytes of ``block`` in a store of fingerprint ``fp`` and ``block_tokens``."""
    dim, st, nf, stage, window, bsize, row_bytes = fp
    head = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, dim, st, nf, stage, len(block.key), window, bsize, row_bytes,
                        block_tokens, block.start, block.end, block.n_rows, 0)
    body = block.key + block.rows
    head += struct.pack("<I", crc32c(body))
    return head + struct.pack("<I", crc32c(head)) + body


def refresh_checksums(data: bytearray) -> None:
    """Rewrite both checksums of a (possibly edited) block in place so they match its bytes.

    For tests and fuzzing: edited fields then reach the checks behind the checksums.
    Data too short for a header is left alone.
    """
    if len(data) < HEADER_BYTES:
        return
    struct.pack_into("<I", data, BODY_CRC_AT, crc32c(bytes(data[HEADER_BYTES:])))
    struct.pack_into("<I", data, HEADER_CRC_AT, crc32c(bytes(data[:HEADER_CRC_AT])))


def _describe(dim: int, st: int, nf: int, stage: int, window: int, bsize: int, storages: tuple[str, ...],
              policies: tuple[str, ...], stage_dtypes: tuple[str, ...]) -> str:
    return (f"feature_dim={dim}, storage={storages[st]}, nonfinite={policies[nf]}, "
            f"stage_dtype={stage_dtypes[stage]}, window={window}, block_size={bsize}")


def unpack(
    data: Any,
    fp: Fingerprint,
    block_tokens: int,
    w_keep: int,
    storages: tuple[str, ...] = STORAGES,
    policies: tuple[str, ...] = NONFINITE_POLICIES,
    stage_dtypes: tuple[str, ...] = STAGE_DTYPES,
) -> PrefixBlock:
    """Parse and check ``data`` for a store of fingerprint ``fp``, ``block_tokens`` and ``K = w_keep``.

    ``ValueError`` naming the first problem, in the core's order and words.
    ``storages``, ``policies`` and ``stage_dtypes`` name the header's codes in
    messages (the reference twin passes its own tables).
    """
    data = bytes(memoryview(data).cast("B"))
    n = len(data)
    if n < HEADER_BYTES:
        raise ValueError(f"prefix block is truncated: {n} bytes, its header needs {HEADER_BYTES}")
    (magic, version, header, dim, st, nf, stage, key_len, window, bsize, row_bytes, bt, start, end, n_rows,
     reserved) = _HEADER.unpack_from(data, 0)
    body_crc, header_crc = struct.unpack_from("<II", data, BODY_CRC_AT)
    if magic != MAGIC:
        raise ValueError("not a dspark_core prefix block (bad magic)")
    if version != VERSION:
        raise ValueError(f"unsupported prefix block version {version} (this build reads {VERSION})")
    if header != HEADER_BYTES:
        raise ValueError(f"bad prefix block header size {header}")
    if crc32c(data[:HEADER_CRC_AT]) != header_crc:
        raise ValueError("prefix block header checksum mismatch (damaged data)")
    if (dim, st, nf, stage, window, bsize, row_bytes) != tuple(fp):
        known = st < len(storages) and nf < len(policies) and stage < len(stage_dtypes)
        theirs = (_describe(dim, st, nf, stage, window, bsize, storages, policies, stage_dtypes) if known
                  else "unknown storage / policy / dtype codes")
        mine = _describe(*fp[:6], storages, policies, stage_dtypes)
        raise ValueError(f"prefix block was exported with ({theirs}) but this store has ({mine})")
    if bt != block_tokens:
        raise ValueError(f"prefix block was exported with block_tokens={bt} but this store has "
                         f"block_tokens={block_tokens}")
    if reserved:
        raise ValueError("prefix block has reserved bytes set")
    # The keep rule: the kept rows of [start, end) are all of it when end <= W - B, else the last K.
    kept = end - start if end <= window - bsize else min(end - start, w_keep)
    if (not 1 <= key_len <= 64 or start < 0 or end <= start or end >= 1 << 62 or start % block_tokens
            or end - start > block_tokens or n_rows != kept):
        raise ValueError("prefix block fields are inconsistent")
    want = HEADER_BYTES + key_len + n_rows * row_bytes
    if n != want:
        raise ValueError(f"prefix block length {n} does not match its header ({want} bytes)")
    body = data[HEADER_BYTES:]
    if crc32c(body) != body_crc:
        raise ValueError("prefix block checksum mismatch (damaged data)")
    return PrefixBlock(key=body[:key_len], start=start, end=end, n_rows=n_rows, rows=body[key_len:])
