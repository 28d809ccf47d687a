"""The snapshot format (version 2; version 1 still read): one sequence's staging state as bytes.

Used by ``Stager.snapshot`` / ``snapshot_into`` / ``restore`` (C++:
``csrc/src/snapshot.cpp``) and by the reference twin (this module). Both
write identical bytes; tests compare them. Little-endian throughout.

Version 2 (written); "fingerprint" fields must match the restoring Stager::

    offset size  field
    0      4     magic b"DSPK"
    4      2     version (u16) = 2
    6      2     header bytes (u16) = 96
    8      4     feature_dim (u32)                          fingerprint
    12     1     storage code (u8, index in STORAGES)       fingerprint
    13     1     nonfinite policy (u8, index in
                 NONFINITE_POLICIES)                        fingerprint
    14     2     content flags (u16): what the snapshot carries; 0 = rows
                 inline. Bit 0 (CONTENT_EXTERNAL_ROWS): the rows are held
                 outside the snapshot (external-row mode: bookkeeping only;
                 n_rows still counts them, none follow the header). Bit 1
                 (CONTENT_TOKENS): n_rows token ids (i32) follow the rows
                 (or the header): the snapshot of a chain drafter's Stager.
                 A reader rejects bits it does not know, a snapshot of the
                 other row mode, and one of the other drafter kind.
    16     4     window (u32)                               fingerprint
    20     4     block_size (u32)                           fingerprint
    24     4     row_bytes (u32)                            fingerprint
    28     4     flags (u32): 1 started, 2 disabled, 4 restage owed,
                 8 first round, 16 accept window open, 32 drafting
                 turned off by the server (disable; a reader that
                 predates it rejects the snapshot: reserved bits)
    32     8     end: next expected position (i64)
    40     8     horizon: oldest available position (i64)
    48     8     n_cache (i64)
    56     8     pos_base (i64)
    64     8     tentative rows (i64)
    72     4     consecutive failures (u32)
    76     1     staged element type (u8, index in
                 STAGE_DTYPES)                              fingerprint
    77     3     reserved, zero
    80     8     n_rows (u64) == end - horizon
    88     4     CRC-32C of everything after the header (the rows, then
                 the token ids)
    92     4     CRC-32C of the header bytes [0, 92)
    96     ...   n_rows rows in storage format, oldest first (none with
                 CONTENT_EXTERNAL_ROWS)
    ...    ...   with CONTENT_TOKENS: n_rows token ids (i32), the id kept
                 beside each row, oldest first

Version 1 (read only): the same fields at the same offsets up to 88 (bytes
13..15 and 76..79 reserved: it records neither the nonfinite policy nor the
staged type, which are not checked for it), the rows at 88, and a trailing
CRC-32 (zlib's) of every byte before it.

The nonfinite policy and the staged type are fingerprinted because both
bound the values a Stager lets into its rows (no NaN under "zero", finite
after narrowing to float16 ...): rows written under one configuration must
not reach a Stager that promised the other.

CRC-32C is the Castagnoli CRC (SSE4.2's ``crc32`` instruction): the core
checksums at memory speed. Restoring checks length, magic, version, the
header checksum, content flags, fingerprint, the internal consistency of the
fields and then the rows' checksum, and raises ``ValueError`` naming the
problem before anything is changed. A restored sequence always restages
cleanly on its next round (the drafter cache of the new slot is unknown).
"""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from math import isqrt
from typing import Any

import numpy as np

from .config import NONFINITE_POLICIES, STAGE_DTYPES, STORAGES
from .core_tables import MAX_POSITION

__all__ = [
    "MAGIC", "VERSION", "HEADER_BYTES", "V1_HEADER_BYTES", "SnapshotState", "pack", "unpack", "FLAG_BITS",
    "crc32c", "snapshot_bytes", "refresh_checksums",
]

MAGIC = b"DSPK"
VERSION = 2
HEADER_BYTES = 96
#: Offsets of the two checksums in a v2 header.
ROWS_CRC_AT = 88
HEADER_CRC_AT = 92
#: Content flag: the rows stayed with their owner (external-row mode).
CONTENT_EXTERNAL_ROWS = 1
#: Content flag: the token ids beside the rows follow them (a chain drafter's Stager).
CONTENT_TOKENS = 2
#: Content flags a reader of this version understands.
CONTENT_FLAGS_KNOWN = CONTENT_EXTERNAL_ROWS | CONTENT_TOKENS
#: Bytes of one token id.
TOKEN_BYTES = 4
#: Version 1: an 88-byte header, the rows, a 4-byte CRC-32 trailer.
V1_VERSION = 1
V1_HEADER_BYTES = 88
V1_TRAILER_BYTES = 4
#: Enough bytes to read magic, version and header size.
PREAMBLE_BYTES = 8

# Fields common to both versions (offsets 0..88); v2 splits v1's reserved
# bytes 13..15 into the nonfinite code (u8) and the content flags (u16), and
# v1's reserved u32 at 76 into the staged type (u8) and 3 reserved bytes.
_FIELDS = struct.Struct("<4sHHIBBHIIIIqqqqqIB3sQ")
assert _FIELDS.size == V1_HEADER_BYTES
_CRCS = struct.Struct("<II")

FLAG_STARTED = 1
FLAG_DISABLED = 2
FLAG_OWED = 4
FLAG_FIRST_ROUND = 8
FLAG_ACCEPT_OPEN = 16
FLAG_DRAFTING_OFF = 32
FLAG_BITS = FLAG_STARTED | FLAG_DISABLED | FLAG_OWED | FLAG_FIRST_ROUND | FLAG_ACCEPT_OPEN | FLAG_DRAFTING_OFF

Fingerprint = tuple[int, int, int, int, int, int, int]


def snapshot_bytes(n_rows: int, row_bytes: int, tokens: bool = False) -> int:
    """Size of a v2 snapshot holding ``n_rows`` rows of ``row_bytes`` bytes (``tokens``: and their ids)."""
    return HEADER_BYTES + n_rows * (row_bytes + (TOKEN_BYTES if tokens else 0))


# -- CRC-32C, pure Python ---------------------------------------------------

_POLY = 0x82F63B78
_MASK = 0xFFFFFFFF


def _byte_table() -> list[int]:
    table = []
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _byte_table()
_TABLE_NP = np.array(_TABLE, dtype=np.uint32)
#: Below this many bytes the plain byte loop is faster than the lanes.
_LANES_MIN_BYTES = 2048


def _mult_mod_p(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial (reflected: bit 31 is x^0)."""
    p = 0
    m = 1 << 31
    while m:
        if a & m:
            p ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        m >>= 1
    return p


def _x8n_mod_p(n: int) -> int:
    """``x^(8 n)`` modulo the polynomial: the register map of ``n`` appended zero bytes."""
    p, sq = 1 << 31, 1 << 23  # x^0, x^8
    while n:
        if n & 1:
            p = _mult_mod_p(sq, p)
        sq = _mult_mod_p(sq, sq)
        n >>= 1
    return p


@functools.lru_cache(maxsize=64)
def _shift_tables(n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Byte-indexed tables of the (linear) map "append ``n`` zero bytes" to a raw register."""
    v = (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]).ravel()
    for _ in range(n):
        v = _TABLE_NP[v & 0xFF] ^ (v >> 8)
    t = v.reshape(4, 256)
    return t[0].tolist(), t[1].tolist(), t[2].tolist(), t[3].tolist()


def _raw_lanes(data: np.ndarray) -> int:
    """Raw CRC register (initial value 0) of ``data`` (uint8), computed in parallel lanes.

    Leading zero bytes do not change a register that starts at 0, so the data
    is padded in front to ``lanes x m`` bytes; every lane (row) is checksummed
    at once, column by column, and the lanes are joined by shifting the running
    register over ``m`` zero bytes (x^(8 m)) before adding the next lane.
    """
    n = data.size
    m = max(64, isqrt(n))
    lanes = -(-n // m)
    padded = np.zeros(lanes * m, dtype=np.uint8)
    padded[lanes * m - n:] = data
    cols = np.ascontiguousarray(padded.reshape(lanes, m).T).astype(np.uint32)
    r = np.zeros(lanes, dtype=np.uint32)
    for j in range(m):
        r = _TABLE_NP[(r ^ cols[j]) & 0xFF] ^ (r >> 8)
    t0, t1, t2, t3 = _shift_tables(m)
    acc = 0
    for x in r.tolist():
        acc = t0[acc & 0xFF] ^ t1[(acc >> 8) & 0xFF] ^ t2[(acc >> 16) & 0xFF] ^ t3[acc >> 24] ^ x
    return acc


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of a bytes-like object, chained from ``crc``.

    ``crc32c(b"123456789") == 0xE3069283``; ``crc32c(b, crc32c(a)) == crc32c(a + b)``.
    """
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    n = buf.size
    c = crc ^ _MASK
    if n < _LANES_MIN_BYTES:
        table = _TABLE
        for b in buf.tobytes():
            c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    else:
        # raw(M, init=c) = c shifted over len(M) zero bytes ^ raw(M, init=0)
        c = _mult_mod_p(_x8n_mod_p(n), c) ^ _raw_lanes(buf)
    return c ^ _MASK


# -- the format -------------------------------------------------------------


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
    external: bool = False  # taken in external-row mode: ``rows`` is empty, the owner keeps them
    drafting_off: bool = False  # the request's drafting switch (disable)
    tokens: bytes | None = None  # a chain drafter's: n_rows int32 ids (little-endian), oldest first


def pack(state: SnapshotState, fingerprint: Fingerprint) -> bytes:
    """Serialise ``state`` (format v2) under ``fingerprint = (feature_dim, storage_code,
    window, block, row_bytes, nonfinite_code, stage_code)`` (``StagerConfig.snapshot_fingerprint``)."""
    feature_dim, storage_code, window, block, row_bytes, nonfinite_code, stage_code = fingerprint
    if state.external:
        assert not state.rows, "an external-row snapshot carries no rows"
        n_rows = state.end - state.horizon if state.started else 0
    else:
        n_rows = len(state.rows) // row_bytes if row_bytes else 0
    flags = (
        FLAG_STARTED * state.started
        | FLAG_DISABLED * state.disabled
        | FLAG_OWED * state.restage_owed
        | FLAG_FIRST_ROUND * state.first_round
        | FLAG_ACCEPT_OPEN * state.accept_open
        | FLAG_DRAFTING_OFF * state.drafting_off
    )
    fields = _FIELDS.pack(
        MAGIC, VERSION, HEADER_BYTES, feature_dim, storage_code, nonfinite_code,
        (CONTENT_EXTERNAL_ROWS if state.external else 0) | (CONTENT_TOKENS if state.tokens is not None else 0),
        window, block, row_bytes, flags, state.end, state.horizon, state.n_cache, state.pos_base, state.tentative,
        state.failures, stage_code, b"\0\0\0", n_rows,
    )
    body = state.rows + (state.tokens or b"")
    head = fields + struct.pack("<I", crc32c(body))
    return head + struct.pack("<I", crc32c(head)) + body


def refresh_checksums(data: bytearray) -> None:
    """Rewrite the checksums of a (v2, possibly edited) snapshot in place so they match its bytes.

    For tests and fuzzing: edited fields then reach the checks behind the checksums.
    Data too short for a v2 header is left alone.
    """
    if len(data) < HEADER_BYTES:
        return
    struct.pack_into("<I", data, ROWS_CRC_AT, crc32c(memoryview(data)[HEADER_BYTES:]))
    struct.pack_into("<I", data, HEADER_CRC_AT, crc32c(memoryview(data)[:HEADER_CRC_AT]))


def _name(names: tuple[str, ...], code: int) -> str:
    return names[code] if 0 <= code < len(names) else f"code {code}"


def _describe(fp: tuple[int, ...], storages: tuple[str, ...], policies: tuple[str, ...] | None,
              stage_dtypes: tuple[str, ...]) -> str:
    out = f"feature_dim={fp[0]}, storage={_name(storages, fp[1])}, window={fp[2]}, block_size={fp[3]}"
    if policies is not None:  # v2
        out += f", nonfinite={_name(policies, fp[5])}, stage_dtype={_name(stage_dtypes, fp[6])}"
    return out


def unpack(
    data: Any,
    fingerprint: Fingerprint,
    storages: tuple[str, ...] = STORAGES,
    policies: tuple[str, ...] = NONFINITE_POLICIES,
    external: bool = False,
    stage_dtypes: tuple[str, ...] = STAGE_DTYPES,
    tokens: bool = False,
) -> SnapshotState:
    """Parse and validate snapshot bytes (v1 or v2); ``ValueError`` naming the first problem.

    ``external``: the restoring Stager runs in external-row mode; a snapshot of
    the other row mode is a ``ValueError``; ``tokens``: it keeps token ids (a chain
    drafter's), and a snapshot of the other kind is a ``ValueError``. ``storages``, ``policies`` and
    ``stage_dtypes`` name the header's codes in messages (the reference twin
    passes its own tables).
    """
    data = memoryview(data).cast("B")
    n = len(data)
    if n < PREAMBLE_BYTES:
        raise ValueError(f"snapshot is truncated: {n} bytes, a header needs {HEADER_BYTES}")
    magic, version, header_bytes = struct.unpack_from("<4sHH", data, 0)
    if magic != MAGIC:
        raise ValueError("not a dspark_core snapshot (bad magic)")
    if version not in (V1_VERSION, VERSION):
        raise ValueError(f"unsupported snapshot version {version} (this build reads 1 and {VERSION})")
    v1 = version == V1_VERSION
    header, trailer = (V1_HEADER_BYTES, V1_TRAILER_BYTES) if v1 else (HEADER_BYTES, 0)
    if n < header + trailer:
        raise ValueError(f"snapshot is truncated: {n} bytes, a header needs {header + trailer}")
    if header_bytes != header:
        raise ValueError(f"bad snapshot header size {header_bytes}")
    (_, _, _, feature_dim, storage_code, nonfinite_code, content, window, block, row_bytes, flags,
     end, horizon, n_cache, pos_base, tentative, failures, stage_code, reserved, n_rows) = _FIELDS.unpack_from(data, 0)
    if v1:
        (crc,) = struct.unpack_from("<I", data, n - 4)
        if zlib.crc32(data[:-4]) & _MASK != crc:
            raise ValueError("snapshot checksum mismatch (damaged data)")
        rows_crc = 0
    else:
        rows_crc, header_crc = _CRCS.unpack_from(data, ROWS_CRC_AT)
        if crc32c(data[:HEADER_CRC_AT]) != header_crc:
            raise ValueError("snapshot header checksum mismatch (damaged data)")
        if content & ~CONTENT_FLAGS_KNOWN:
            raise ValueError(f"snapshot content flags {content} are not supported by this build")
    snap_external = not v1 and bool(content & CONTENT_EXTERNAL_ROWS)
    if snap_external and not external:
        raise ValueError(
            "snapshot holds no rows (taken in external-row mode: the rows stayed with their owner); this Stager "
            "holds its rows (rows='held'): restore it into an external-row Stager"
        )
    if external and not snap_external:
        raise ValueError(
            "snapshot carries its rows (taken in held mode); this Stager runs in external-row mode "
            "(rows='external') and cannot take them: restore it into a held-mode Stager"
        )
    snap_tokens = not v1 and bool(content & CONTENT_TOKENS)
    if snap_tokens and not tokens:
        raise ValueError('snapshot carries token ids (taken by a chain drafter\'s Stager, kind="chain"); this '
                         'Stager\'s drafter kind is "block"')
    if tokens and not snap_tokens:
        raise ValueError("snapshot carries no token ids (taken by a block drafter's Stager); this Stager serves a "
                         'chain drafter (kind="chain"), whose rows need theirs')
    theirs = (feature_dim, storage_code, window, block, row_bytes, nonfinite_code, stage_code)
    mine = tuple(fingerprint)
    if theirs[:5] != mine[:5] or (not v1 and theirs[5:] != mine[5:]):
        names = None if v1 else policies
        raise ValueError(
            f"snapshot was taken with ({_describe(theirs, storages, names, stage_dtypes)}) "
            f"but this Stager has ({_describe(mine, storages, names, stage_dtypes)})"
        )
    # v1: bytes 13..15 and 76..79 reserved; v2: 77..79.
    reserved_set = reserved != b"\0\0\0" or (v1 and (nonfinite_code or content or stage_code))
    if reserved_set or flags & ~FLAG_BITS:
        raise ValueError("snapshot has reserved bits set")
    per_row = (0 if external else row_bytes) + (TOKEN_BYTES if snap_tokens else 0)
    if per_row == 0:
        if n != header:
            raise ValueError(
                f"snapshot length {n} is not its header's {header} bytes (an external-row snapshot holds no rows)"
            )
    elif n != header + n_rows * per_row + trailer:
        with_ids = " (with their token ids)" if snap_tokens else ""
        raise ValueError(f"snapshot length {n} does not match its {n_rows} rows of {per_row} bytes{with_ids}")
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
            and end < MAX_POSITION
        )
    else:
        # a fresh sequence: nothing but the first-round flag (and the request's drafting switch)
        ok = (end == horizon == n_cache == pos_base == tentative == n_rows == 0
              and flags & ~FLAG_DRAFTING_OFF == FLAG_FIRST_ROUND and failures == 0)
    if not ok:
        raise ValueError("snapshot fields are inconsistent")
    rows_end = header + (0 if external else n_rows * row_bytes)
    rows = data[header:rows_end]
    ids = data[rows_end: rows_end + (n_rows * TOKEN_BYTES if snap_tokens else 0)]
    if not v1 and crc32c(ids, crc32c(rows)) != rows_crc:
        raise ValueError("snapshot rows checksum mismatch (damaged data)")
    if snap_tokens and n_rows and int(np.frombuffer(ids, "<i4").min()) < 0:
        raise ValueError("snapshot token ids are inconsistent (a negative id)")
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
        rows=rows.tobytes(),
        external=snap_external,
        drafting_off=bool(flags & FLAG_DRAFTING_OFF),
        tokens=ids.tobytes() if snap_tokens else None,
    )
