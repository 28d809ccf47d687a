"""The op codec: bytes -> a StagerConfig and a list of :class:`Op` (and back, for seeds).

Every op is a fixed six-byte record, so one flipped byte changes one op; see
:mod:`dspark_core.testing` for how the pieces fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ..stager.config import NONFINITE_POLICIES, STAGE_DTYPES, STORAGES, StagerConfig

#: Bytes the config takes at the start of the input, and bytes per op record.
CONFIG_BYTES = 5
OP_BYTES = 6
MAX_OPS = 64

_MAX_POS = 1 << 62


# ---------------------------------------------------------------------------
# Ops and their decoding
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One decoded operation: a Stager method (or macro) and symbolic arguments.

    ``args`` are resolved against the sequence's state when the op runs
    (:func:`run_differential`), e.g. ``at="end"`` becomes the next position
    the sequence expects.
    """

    name: str
    args: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.args:
            if k == key:
                return v
        return default

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.args)
        return f"{self.name}({inner})"


@dataclass
class Call:
    """A concrete call: ``method(*args)`` with a short human-readable description."""

    method: str
    args: tuple[Any, ...]
    text: str

    def __repr__(self) -> str:
        return self.text


class _Reader:
    """Bytes as a stream of small integers; past the end every read is 0."""

    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)
        self.i = 0

    def left(self) -> int:
        return max(0, len(self.data) - self.i)

    def u8(self) -> int:
        if self.i < len(self.data):
            v = self.data[self.i]
            self.i += 1
            return v
        self.i += 1
        return 0

    def take(self, n: int) -> bytes:
        out = bytes(self.u8() for _ in range(n))
        return out


_NONFINITE_BY_BYTE = ("error", *NONFINITE_POLICIES)


def decode_config(head: bytes) -> StagerConfig:
    """The :class:`StagerConfig` the first :data:`CONFIG_BYTES` bytes select.

    ``feature_dim`` in {32, 64}; every storage; ``block_size`` 1..8;
    ``window = 2B + 1 + extra`` (extra 0..39, or 60..99); ``max_seqs`` 1..3;
    ``max_failures`` 1..3; every stage dtype and non-finite policy; strict or not.
    """
    r = _Reader(head)
    b0, b1, b2, b3, b4 = (r.u8() for _ in range(CONFIG_BYTES))
    dim = (32, 64)[b0 & 1]
    storage = STORAGES[(b0 >> 1) % len(STORAGES)]
    block = 1 + b1 % 8
    max_failures = 1 + (b1 >> 3) % 3
    extra = b2 % 40 + (60 if b2 >= 200 else 0)
    max_seqs = 1 + b3 % 3
    stage_dtype = STAGE_DTYPES[(b3 >> 2) % len(STAGE_DTYPES)]
    nonfinite = _NONFINITE_BY_BYTE[(b4 & 0x7F) % len(_NONFINITE_BY_BYTE)]  # bit 7: strict
    return StagerConfig(
        dim, block, 2 * block + 1 + extra, max_seqs=max_seqs, storage=storage,
        max_failures=max_failures, stage_dtype=stage_dtype, nonfinite=nonfinite, strict=bool(b4 & 0x80),
    )


def encode_config(config: StagerConfig) -> bytes:
    """Inverse of :func:`decode_config` (for writing seeds); ``ValueError`` if not reachable."""
    b0 = (0 if config.feature_dim == 32 else 1) | (STORAGES.index(config.storage) << 1)
    b1 = (config.block_size - 1) | ((config.max_failures - 1) << 3)
    extra = config.window - 2 * config.block_size - 1
    b2 = extra if extra < 40 else 200 + (extra - 60)
    b3 = next((b for b in range(256) if b % 3 == config.max_seqs - 1
               and (b >> 2) % 3 == STAGE_DTYPES.index(config.stage_dtype)), 0)
    b4 = _NONFINITE_BY_BYTE.index(config.nonfinite) | (0x80 if config.strict else 0)
    out = bytes([b0, b1, b2, b3, b4])
    if decode_config(out) != config:
        raise ValueError(f"config {config} cannot be expressed by decode_config")
    return out


# Op table: an opcode byte picks an entry (common ops get several slots).
OPS = (
    "begin", "process", "process", "process", "process", "process_encoded", "draft", "draft",
    "draft", "draft_many", "commit", "commit", "fail", "accept", "accept", "rollback",
    "shift", "fork", "snapshot", "restore", "round", "round", "round", "round",
    "round", "long_prefill", "introspect", "process", "drafting", "draft", "commit", "long_decode",
)

_POS_MODES = ("end",) * 10 + ("end+1", "end-1", "zero", "neg", "gap", "far")
_ROW_KINDS = ("float32",) * 6 + ("float16", "float16", "bfloat16", "bfloat16", "float64", "int32",
                                  "width", "1d", "list", "strided")
_FILLS = ("normal", "normal", "massive", "tiny", "big", "zeros", "ties", "negzero")
_POS_KINDS = ("int64",) * 12 + ("int32", "uint64", "float", "2d")
_DRAFT_MODES = ("end",) * 8 + ("end+1", "end-1", "end-3", "zero", "neg", "big", "n_cache", "np")
# draft's copy: mostly a copy, a zero-copy view often, a bad value now and then.
_COPY_MODES = (True, True, True, True, False, False, False, "no")
# draft_many's, from the two bits its other fields leave.
_MANY_COPY_MODES = (True, True, False, "no")
_FAIL_STAGES = ("decode", "decode", "crop", "crop", "bogus", "", None, 0, b"decode", ["decode"])
_DAMAGE = ("none", "none", "none", "flip", "cut", "grow", "patch", "patch", "patch", "patch",
           "foreign", "empty", "list", "none", "flip", "patch")
#: Snapshot header fields a "patch" damage may rewrite (offset, struct format).
_PATCH_FIELDS = (
    (32, "<q", "end"), (40, "<q", "horizon"), (48, "<q", "n_cache"), (56, "<q", "pos_base"),
    (64, "<q", "tentative"), (72, "<I", "failures"), (28, "<I", "flags"), (80, "<Q", "n_rows"),
    (16, "<I", "window"), (76, "<I", "stage_dtype+reserved"), (13, "<B", "nonfinite"), (14, "<H", "content_flags"),
)
_PATCH_DELTAS = (-3, -2, -1, 1, 2, 3, 5, 8, 0, "zero", "neg1", "max62", "max63", "flip_flag", 4, -4)
_ENC_MODES = ("valid",) * 6 + ("raw", "raw", "short", "int8", "flat", "flat", "valid_nan", "2d", "list", "valid")
_INTROSPECT = ("state", "stats", "buffered_positions", "snapshot")


def _decode_op(code: int, a: bytes) -> Op:
    name = OPS[code % len(OPS)]
    a0, a1, a2, a3, a4 = a
    seq = ("seq", a0)
    if name in ("begin", "commit", "snapshot"):
        return Op(name, (seq,))
    if name == "process":
        special = None if a4 % 8 != 7 else (("nan", "inf", "-inf")[(a4 >> 3) % 3], a4 >> 3)
        return Op(name, (
            seq, ("n", a1 % 13), ("at", _POS_MODES[a2 % 16]), ("rows", _ROW_KINDS[a2 >> 4]),
            ("fill", _FILLS[a3 % 8]), ("seed", a3 >> 3), ("special", special),
            ("pos_dtype", _POS_KINDS[a1 >> 4]),
        ))
    if name == "process_encoded":
        return Op(name, (
            seq, ("n", a1 % 7), ("at", _POS_MODES[a2 % 16]), ("data", _ENC_MODES[a2 >> 4]),
            ("fill", _FILLS[a3 % 8]), ("seed", a3 >> 3 | a4 << 5),
        ))
    if name == "draft":
        return Op(name, (seq, ("n_past", _DRAFT_MODES[a1 % 16]), ("copy", _COPY_MODES[a2 % len(_COPY_MODES)])))
    if name == "draft_many":
        k = a1 % 5
        seqs = tuple(b for b in (a2, a3, a4, a2 ^ 0x55)[:k])
        mode = ("end", "end", "end", "end+1", "end-1", "mismatch", "zero", "end")[(a1 >> 3) % 8]
        return Op(name, (("seqs", seqs), ("n_past", mode), ("copy", _MANY_COPY_MODES[(a1 >> 6) & 3])))
    if name == "fail":
        return Op(name, (seq, ("stage", _FAIL_STAGES[a1 % len(_FAIL_STAGES)])))
    if name == "accept":
        return Op(name, (seq, ("n", (a1 % 12) - 1)))
    if name == "rollback":
        back = {250: "neg", 251: "zero", 252: "big"}.get(a1, a1 % 42 - 2)
        return Op(name, (seq, ("back", back)))
    if name == "shift":
        return Op(name, (seq, ("keep", a1), ("discard", a2), ("mode", a3 % 8)))
    if name == "fork":
        return Op(name, (("src", a0), ("dst", a1)))
    if name == "restore":
        return Op(name, (
            seq, ("which", a1), ("damage", _DAMAGE[a2 % 16]), ("field", a2 >> 4), ("value", a3), ("pos", a4),
        ))
    if name == "round":
        close = ("commit", "commit", "commit", "commit", "commit", "decode", "crop", "none")[a1 % 8]
        n_verify = (a1 >> 3) % 4  # 0: B + 1 rows, else that many (capped at B + 1)
        return Op(name, (seq, ("close", close), ("n_verify", n_verify), ("accepted", a2), ("rounds", 1 + a3 % 6),
                         ("seed", a4)))
    if name == "long_prefill":
        n = (("w+1", "2w+3", "trim", "big")[a1 % 4])
        return Op(name, (seq, ("n", n), ("chunks", 1 + a2 % 3), ("seed", a3)))
    if name == "long_decode":  # chunks of W // 2 rows past the ring's end: held rows wrap around it
        return Op(name, (seq, ("extra", a1 % 4), ("seed", a2)))
    if name == "introspect":
        return Op(name, (seq, ("what", _INTROSPECT[a1 % 4])))
    if name == "drafting":  # disable / enable of one sequence, or of a batch (a4: which ones)
        k = a2 % 4  # 0: one sequence, else a batch of k
        seqs = (a0,) if k == 0 else tuple(b for b in (a0, a3, a4, a3 ^ 0x55)[:k])
        return Op(name, (("seqs", seqs), ("on", bool(a1 & 1)), ("many", k != 0)))
    raise AssertionError(name)


def decode_ops(data: bytes, *, max_ops: int = MAX_OPS) -> tuple[StagerConfig, list[Op]]:
    """Decode ``data`` into a config and a list of ops (deterministic, total).

    The first :data:`CONFIG_BYTES` bytes pick the config (:func:`decode_config`),
    then every :data:`OP_BYTES` bytes make one :class:`Op` (an opcode byte
    and five argument bytes); a short last record is padded with zeros.
    Every byte string decodes; at most ``max_ops`` ops are returned.
    """
    data = bytes(data)
    config = decode_config(data[:CONFIG_BYTES])
    r = _Reader(data[CONFIG_BYTES:])
    ops: list[Op] = []
    while r.left() > 0 and len(ops) < max_ops:
        code = r.u8()
        ops.append(_decode_op(code, r.take(5)))
    return config, ops


def encode_ops(config: StagerConfig, records: Iterable[tuple[str, bytes]]) -> bytes:
    """Bytes that decode to ``config`` and ops given as ``(op name, 5 argument bytes)``.

    Helper for writing seed inputs by hand (``tests/fuzz_corpus/make_seeds.py``).
    """
    out = bytearray(encode_config(config))
    for name, args in records:
        args = bytes(args).ljust(5, b"\0")[:5]
        out.append(OPS.index(name))
        out += args
    return bytes(out)
