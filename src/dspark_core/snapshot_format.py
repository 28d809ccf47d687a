"""The snapshot format (version 1): one sequence's staging state as bytes.

Used by ``Stager.snapshot`` / ``Stager.restore`` (C++: ``csrc/src/snapshot.cpp``)
and by the reference twin (this module). Both write identical bytes; tests
compare them. Little-endian throughout::

    offset size  field
    0      4     magic b"DSPK"
    4      2     version (u16) = 1
    6      2     header bytes (u16) = 88
    8      4     feature_dim (u32)          \\
    12     1     storage code (u8, index in STORAGES)  | config fingerprint:
    13     3     reserved, zero                        | must match the
    16     4     window (u32)                          | restoring Stager
    20     4     block_size (u32)                      |
    24     4     row_bytes (u32)            /
    28     4     flags (u32): 1 started, 2 disabled, 4 restage owed,
                 8 first round, 16 accept window open
    32     8     end: next expected position (i64)
    40     8     horizon: oldest available position (i64)
    48     8     n_cache (i64)
    56     8     pos_base (i64)
    64     8     tentative rows (i64)
    72     4     consecutive failures (u32)
    76     4     reserved, zero
    80     8     n_rows (u64) == end - horizon
    88     ...   n_rows rows in storage format, oldest first
    -4     4     CRC-32 (zlib) of every byte before it

Restoring checks length, magic, version, checksum, fingerprint and the
internal consistency of the fields, and raises ``ValueError`` naming the
problem before anything is changed. A restored sequence always restages
cleanly on its next round (the drafter cache of the new slot is unknown).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

__all__ = ["MAGIC", "VERSION", "HEADER_BYTES", "SnapshotState", "pack", "unpack", "FLAG_BITS"]

MAGIC = b"DSPK"
VERSION = 1
HEADER_BYTES = 88
_HEADER = struct.Struct("<4sHHIB3sIIIIqqqqqII Q".replace(" ", ""))
assert _HEADER.size == HEADER_BYTES

FLAG_STARTED = 1
FLAG_DISABLED = 2
FLAG_OWED = 4
FLAG_FIRST_ROUND = 8
FLAG_ACCEPT_OPEN = 16
FLAG_BITS = FLAG_STARTED | FLAG_DISABLED | FLAG_OWED | FLAG_FIRST_ROUND | FLAG_ACCEPT_OPEN


@dataclass
class SnapshotState:
    """The fields of a snapshot (rows as one bytes object, oldest first)."""

    started: bool
    disabled: bool
    restage_owed: bool
    first_round: bool
    accept_open: bool
    end: int
    horizon: int
    n_cache: int
    pos_base: int
    tentative: int
    failures: int
    rows: bytes


def pack(state: SnapshotState, fingerprint: tuple[int, int, int, int, int]) -> bytes:
    """Serialise ``state`` under ``fingerprint = (feature_dim, storage_code, window, block, row_bytes)``."""
    feature_dim, storage_code, window, block, row_bytes = fingerprint
    n_rows = len(state.rows) // row_bytes if row_bytes else 0
    flags = (
        FLAG_STARTED * state.started
        | FLAG_DISABLED * state.disabled
        | FLAG_OWED * state.restage_owed
        | FLAG_FIRST_ROUND * state.first_round
        | FLAG_ACCEPT_OPEN * state.accept_open
    )
    head = _HEADER.pack(
        MAGIC, VERSION, HEADER_BYTES, feature_dim, storage_code, b"\0\0\0", window, block, row_bytes,
        flags, state.end, state.horizon, state.n_cache, state.pos_base, state.tentative,
        state.failures, 0, n_rows,
    )
    body = head + state.rows
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def unpack(
    data: bytes, fingerprint: tuple[int, int, int, int, int], storages: tuple[str, ...]
) -> SnapshotState:
    """Parse and validate snapshot bytes; ``ValueError`` naming the first problem."""
    if len(data) < HEADER_BYTES + 4:
        raise ValueError(f"snapshot is truncated: {len(data)} bytes, a header needs {HEADER_BYTES + 4}")
    (magic, version, header_bytes, feature_dim, storage_code, res0, window, block, row_bytes, flags,
     end, horizon, n_cache, pos_base, tentative, failures, res1, n_rows) = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError("not a dspark_core snapshot (bad magic)")
    if version != VERSION:
        raise ValueError(f"unsupported snapshot version {version} (this build reads {VERSION})")
    if header_bytes != HEADER_BYTES:
        raise ValueError(f"bad snapshot header size {header_bytes}")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if zlib.crc32(data[:-4]) & 0xFFFFFFFF != crc:
        raise ValueError("snapshot checksum mismatch (damaged data)")
    mine = fingerprint
    theirs = (feature_dim, storage_code, window, block, row_bytes)
    if theirs != mine:
        def fmt(fp: tuple[int, ...]) -> str:
            code = fp[1]
            name = storages[code] if 0 <= code < len(storages) else f"code {code}"
            return f"feature_dim={fp[0]}, storage={name}, window={fp[2]}, block_size={fp[3]}"
        raise ValueError(f"snapshot was taken with ({fmt(theirs)}) but this Stager has ({fmt(mine)})")
    if res0 != b"\0\0\0" or res1 != 0 or flags & ~FLAG_BITS:
        raise ValueError("snapshot has reserved bits set")
    if len(data) != HEADER_BYTES + n_rows * row_bytes + 4:
        raise ValueError(
            f"snapshot length {len(data)} does not match its {n_rows} rows of {row_bytes} bytes"
        )
    started = bool(flags & FLAG_STARTED)
    if started:
        ok = (
            0 <= horizon <= end
            and 0 <= pos_base <= n_cache <= end
            and n_rows == end - horizon
            and n_rows <= window + block + 1
            and 0 <= tentative <= block + 1
            and tentative <= end - n_cache
            and (tentative == 0 or flags & FLAG_ACCEPT_OPEN)
            # an accept may leave end as low as this: the horizon must not pass it
            and horizon <= (end - tentative + 1 if tentative else end)
            and end < (1 << 62)
        )
    else:
        # a fresh sequence: nothing but the first-round flag
        ok = end == horizon == n_cache == pos_base == tentative == n_rows == 0 and flags == FLAG_FIRST_ROUND and failures == 0
    if not ok:
        raise ValueError("snapshot fields are inconsistent")
    rows = bytes(data[HEADER_BYTES : HEADER_BYTES + n_rows * row_bytes])
    return SnapshotState(
        started=started,
        disabled=bool(flags & FLAG_DISABLED),
        restage_owed=bool(flags & FLAG_OWED),
        first_round=bool(flags & FLAG_FIRST_ROUND),
        accept_open=bool(flags & FLAG_ACCEPT_OPEN),
        end=end,
        horizon=horizon,
        n_cache=n_cache,
        pos_base=pos_base,
        tentative=tentative,
        failures=failures,
        rows=rows,
    )
