"""Fuzzing and invariant-checking helpers for the Stager (and for your server loop).

Three pieces, all deterministic (the same bytes always give the same calls):

* :func:`decode_ops` turns any byte string into a :class:`~dspark_core.StagerConfig`
  and a list of :class:`Op` (every Stager operation, with valid *and* invalid
  arguments, on several sequences, every storage format). Each op takes a fixed
  six-byte record, so flipping one byte changes one op and leaves the rest of
  the sequence alone: a coverage-guided fuzzer's small mutations stay
  meaningful. Positions are symbolic (``at="end"``, ``delta=-1``) and are
  resolved against the sequence's state when the op runs, so most calls are
  valid continuations and the interesting invalid ones are one byte away.
* :func:`run_differential` applies the ops to the C++-backed
  :class:`dspark_core.Stager` and to the pure-Python
  :class:`~dspark_core.reference.ReferenceStager` and compares every result
  (exception type, plan fields, staged bytes, state, counters, snapshot
  bytes); any difference raises :class:`Desync` with a readable op trace.
* :func:`check_invariants` (one-shot) and :class:`InvariantChecker` (a proxy
  you wrap around any Stager-like object, e.g. the one inside your server's
  loop) check the protocol's guarantees after every call: positions
  contiguous, drafter positions inside ``[0, W)``, the block fits, staged rows
  are the rows the server gave, ``clear_cache`` whenever the drafter cache
  cannot be trusted, the buffer bound, no round left open after commit/fail.

Example: fuzz the core against the reference::

    >>> from dspark_core.testing import decode_ops, run_differential
    >>> config, ops = decode_ops(bytes(range(64)))
    >>> report = run_differential(config, ops)      # raises Desync on any difference
    >>> report.n_calls > 0
    True

Example: check your own loop (any object with the Stager API)::

    >>> import numpy as np
    >>> from dspark_core import Stager, StagerConfig
    >>> from dspark_core.testing import InvariantChecker
    >>> cfg = StagerConfig(feature_dim=32, block_size=4, window=16)
    >>> st = InvariantChecker(Stager(cfg))          # same API, checks every call
    >>> st.process(0, np.arange(10), np.ones((10, 32), np.float32))
    >>> plan = st.draft(0, 10)
    >>> st.commit(0)

A violated invariant raises :class:`InvariantViolation` (an ``AssertionError``).
"""

from __future__ import annotations

import logging
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from . import reference_formats as rf
from . import snapshot_format
from .config import STAGE_DTYPES, STORAGES, TRIM_CHUNK, StagerConfig
from .errors import StateError
from .reference import SEMANTIC_STATS, ReferenceStager
from .stage_plan import SKIP_REASONS

__all__ = [
    "Op",
    "Call",
    "Desync",
    "InvariantViolation",
    "RunReport",
    "OPS",
    "ALLOWED_ERRORS",
    "decode_config",
    "decode_ops",
    "encode_config",
    "run_differential",
    "check_plan",
    "check_invariants",
    "InvariantChecker",
]

#: Exceptions a Stager may raise for a rejected call (anything else is a finding).
ALLOWED_ERRORS = (ValueError, TypeError, StateError)

#: Bytes the config takes at the start of the input, and bytes per op record.
CONFIG_BYTES = 5
OP_BYTES = 6
MAX_OPS = 64

_MAX_POS = 1 << 62


class Desync(AssertionError):
    """The core and the reference disagreed (or the core broke an invariant).

    ``trace`` holds the calls made so far, one readable line each.
    """

    def __init__(self, message: str, trace: Sequence[str] = ()) -> None:
        self.trace = list(trace)
        tail = "\n".join(self.trace[-40:])
        super().__init__(f"{message}\n--- op trace (last {min(40, len(self.trace))} calls) ---\n{tail}")


class InvariantViolation(AssertionError):
    """A Stager (or a server loop around it) broke one of the protocol's guarantees."""


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


_NONFINITE_BY_BYTE = ("error", "error", "zero", "clamp_f16")


def decode_config(head: bytes) -> StagerConfig:
    """The :class:`StagerConfig` the first :data:`CONFIG_BYTES` bytes select.

    ``feature_dim`` in {32, 64}; every storage; ``block_size`` 1..8;
    ``window = 2B + 1 + extra`` (extra 0..39, or 60..99); ``max_seqs`` 1..3;
    ``max_failures`` 1..3; every stage dtype and non-finite policy.
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
    nonfinite = _NONFINITE_BY_BYTE[b4 % 4]
    return StagerConfig(
        dim, block, 2 * block + 1 + extra, max_seqs=max_seqs, storage=storage,
        max_failures=max_failures, stage_dtype=stage_dtype, nonfinite=nonfinite,
    )


def encode_config(config: StagerConfig) -> bytes:
    """Inverse of :func:`decode_config` (for writing seeds); ``ValueError`` if not reachable."""
    b0 = (0 if config.feature_dim == 32 else 1) | (STORAGES.index(config.storage) << 1)
    b1 = (config.block_size - 1) | ((config.max_failures - 1) << 3)
    extra = config.window - 2 * config.block_size - 1
    b2 = extra if extra < 40 else 200 + (extra - 60)
    b3 = next((b for b in range(256) if b % 3 == config.max_seqs - 1
               and (b >> 2) % 3 == STAGE_DTYPES.index(config.stage_dtype)), 0)
    b4 = _NONFINITE_BY_BYTE.index(config.nonfinite)
    out = bytes([b0, b1, b2, b3, b4])
    if decode_config(out) != config:
        raise ValueError(f"config {config} cannot be expressed by decode_config")
    return out


# Op table: an opcode byte picks an entry (common ops get several slots).
OPS = (
    "begin", "process", "process", "process", "process", "process_encoded", "draft", "draft",
    "draft", "draft_many", "commit", "commit", "fail", "accept", "accept", "rollback",
    "shift", "fork", "snapshot", "restore", "round", "round", "round", "round",
    "round", "long_prefill", "introspect", "process", "round", "draft", "commit", "restore",
)

_POS_MODES = ("end",) * 10 + ("end+1", "end-1", "zero", "neg", "gap", "far")
_ROW_KINDS = ("float32",) * 6 + ("float16", "float16", "bfloat16", "bfloat16", "float64", "int32",
                                  "width", "1d", "list", "strided")
_FILLS = ("normal", "normal", "normal", "tiny", "big", "zeros", "ties", "negzero")
_POS_KINDS = ("int64",) * 12 + ("int32", "uint64", "float", "2d")
_DRAFT_MODES = ("end",) * 8 + ("end+1", "end-1", "end-3", "zero", "neg", "big", "n_cache", "np")
_FAIL_STAGES = ("decode", "decode", "crop", "crop", "bogus", "", None, 0, b"decode", ["decode"])
_DAMAGE = ("none", "none", "none", "flip", "cut", "grow", "patch", "patch", "patch", "patch",
           "foreign", "empty", "list", "none", "flip", "patch")
#: Snapshot header fields a "patch" damage may rewrite (offset, struct format).
_PATCH_FIELDS = (
    (32, "<q", "end"), (40, "<q", "horizon"), (48, "<q", "n_cache"), (56, "<q", "pos_base"),
    (64, "<q", "tentative"), (72, "<I", "failures"), (28, "<I", "flags"), (80, "<Q", "n_rows"),
    (16, "<I", "window"), (76, "<I", "reserved"),
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
        return Op(name, (seq, ("n_past", _DRAFT_MODES[a1 % 16])))
    if name == "draft_many":
        k = a1 % 5
        seqs = tuple(b for b in (a2, a3, a4, a2 ^ 0x55)[:k])
        mode = ("end", "end", "end", "end+1", "end-1", "mismatch", "zero", "end")[(a1 >> 3) % 8]
        return Op(name, (("seqs", seqs), ("n_past", mode)))
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
    if name == "introspect":
        return Op(name, (seq, ("what", _INTROSPECT[a1 % 4])))
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


# ---------------------------------------------------------------------------
# Deterministic data
# ---------------------------------------------------------------------------


def _hash_u32(n: int, seed: int) -> np.ndarray:
    idx = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        u = (idx + np.uint64(seed) * np.uint64(0x9E3779B1) + np.uint64(1)) * np.uint64(2654435761)
        u ^= u >> np.uint64(15)
        u *= np.uint64(0x2C1B3C6D)
    return (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def make_rows(n: int, dim: int, fill: str = "normal", seed: int = 0, special: Any = None) -> np.ndarray:
    """Deterministic float32 rows ``(n, dim)`` of a given character.

    ``fill``: ``normal`` (values in [-2, 2)), ``tiny`` (f16 subnormals),
    ``big`` (beyond f16 range), ``zeros``, ``ties`` (q8_0 rounding ties),
    ``negzero``. ``special = (kind, index)`` puts a NaN / +-Inf at one cell.
    """
    u = _hash_u32(n * dim, seed)
    x = (u.astype(np.float64) / 2**32 - 0.5) * 4.0
    if fill == "tiny":
        x *= 1e-5
    elif fill == "big":
        x *= 4e4
    elif fill == "zeros":
        x[:] = 0.0
    elif fill == "negzero":
        x[:] = -0.0
    elif fill == "ties":
        x = ((u % 255).astype(np.float64) - 127.0) / 2.0
        x[::32] = 127.0  # block max 127 -> d = 1: every k + 0.5 is a tie
    out = x.astype(np.float32).reshape(n, dim)
    if special is not None and n:
        kind, at = special
        flat = out.reshape(-1)
        flat[at % flat.size] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
    return out


def _as_dtype(x: np.ndarray, kind: str) -> Any:
    if kind == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    with np.errstate(over="ignore", invalid="ignore"):
        if kind == "float16":
            return x.astype(np.float16)
        if kind == "float64":
            return x.astype(np.float64)
        if kind == "int32":
            return np.nan_to_num(x).astype(np.int32)
    if kind == "width":
        return np.ascontiguousarray(x[:, :-1])
    if kind == "1d":
        return x.reshape(-1)
    if kind == "list":
        return x.tolist()
    if kind == "strided":
        return np.repeat(x, 2, axis=0)[::2]
    return x


def _fmt_pos(pos: Any) -> str:
    if isinstance(pos, np.ndarray) and pos.ndim == 1 and pos.size:
        contiguous = pos.size == 1 or bool(np.all(np.diff(pos.astype(np.float64)) == 1))
        if contiguous:
            return f"[{pos[0]}..{pos[-1]}]:{pos.dtype}"
        return f"{pos.tolist()}:{pos.dtype}"
    if isinstance(pos, np.ndarray):
        return f"array{pos.shape}:{pos.dtype}"
    return repr(pos)


def _fmt_arr(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"{x.dtype}{tuple(x.shape)}"
    return f"{type(x).__name__}(len {len(x)})" if hasattr(x, "__len__") else repr(x)


# ---------------------------------------------------------------------------
# Differential runner
# ---------------------------------------------------------------------------


@dataclass
class RunReport:
    """What :func:`run_differential` did: op / call counts and outcomes."""

    config: StagerConfig
    n_ops: int = 0
    n_calls: int = 0
    n_errors: int = 0
    n_plans: int = 0
    n_skips: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.n_ops} ops, {self.n_calls} calls ({self.n_plans} plans, {self.n_skips} skips, "
                f"{self.n_errors} rejected: {self.errors})")


def _outcome(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return ("raise", exc)


def _plan_diff(a: Any, b: Any) -> str | None:
    """First difference between two StagePlans (``None`` when identical)."""
    for name in ("seq", "skip", "start", "rebase", "clear_cache", "crop_from", "pos_base"):
        va, vb = getattr(a, name), getattr(b, name)
        if va != vb or type(va) is not type(vb) and not (isinstance(va, int) and isinstance(vb, int)):
            return f"plan.{name}: core {va!r} != reference {vb!r}"
    for name in ("positions", "block_positions", "slots", "encoded_rows"):
        va, vb = getattr(a, name), getattr(b, name)
        if va.dtype != vb.dtype or va.shape != vb.shape or va.tobytes() != vb.tobytes():
            return f"plan.{name}: core {va.dtype}{va.shape} != reference {vb.dtype}{vb.shape} (or bytes differ)"
    ra, rb = a.rows, b.rows
    if ra.dtype != rb.dtype or ra.shape != rb.shape or ra.tobytes() != rb.tobytes():
        return f"plan.rows: core {ra.dtype}{ra.shape} != reference {rb.dtype}{rb.shape} (or bytes differ)"
    return None


class _Runner:
    def __init__(self, config: StagerConfig, core: Any, ref: Any, check: bool) -> None:
        self.cfg = config
        self.core = core
        self.ref = ref
        self.check = check
        self.snaps: list[bytes] = []
        self.report = RunReport(config)
        self.logs: list[logging.LogRecord] = []

    # -- helpers ------------------------------------------------------------
    def fail(self, message: str) -> None:
        raise Desync(message, self.report.trace)

    def seq_of(self, b: int) -> Any:
        """A sequence id from a byte: mostly valid, sometimes unknown (-1, max_seqs) or np.int64."""
        v = b % 16
        if v == 14:
            return -1
        if v == 15:
            return self.cfg.max_seqs
        s = v % self.cfg.max_seqs
        return np.int64(s) if b & 0x80 else s

    def valid(self, seq: Any) -> bool:
        return isinstance(seq, (int, np.integer)) and 0 <= int(seq) < self.cfg.max_seqs

    def st(self, seq: Any) -> dict[str, Any]:
        if self.valid(seq):
            return self.ref.state(int(seq))
        return {"end": 0, "n_cache": 0, "horizon": 0}

    def snapshot_of(self, stager: Any, seq: int) -> bytes | None:
        try:
            return stager.snapshot(seq)
        except StateError:
            return None

    def full_state(self, stager: Any) -> list[tuple[Any, ...]]:
        out = []
        for s in range(self.cfg.max_seqs):
            stats = stager.stats(s)
            out.append((stager.state(s), {k: stats[k] for k in SEMANTIC_STATS}, self.snapshot_of(stager, s)))
        return out

    # -- one call on both ------------------------------------------------------
    def call(self, c: Call) -> tuple[str, Any, Any]:
        rep = self.report
        rep.n_calls += 1
        rep.calls[c.method] = rep.calls.get(c.method, 0) + 1
        line = f"#{rep.n_calls:<4} {c.text}"
        rep.trace.append(line)
        before_core = self.full_state(self.core)
        before_ref = self.full_state(self.ref)
        logs = self.logs
        del logs[:]
        a = _outcome(getattr(self.core, c.method), c.args)
        logs_core = [r.getMessage() for r in logs]
        del logs[:]
        b = _outcome(getattr(self.ref, c.method), c.args)
        logs_ref = [r.getMessage() for r in logs]
        del logs[:]
        if logs_core != logs_ref:
            self.fail(f"{c.text}: core logged {logs_core}, reference logged {logs_ref}")
        if a[0] != b[0]:
            what_a = f"raised {type(a[1]).__name__}: {a[1]}" if a[0] == "raise" else "returned"
            what_b = f"raised {type(b[1]).__name__}: {b[1]}" if b[0] == "raise" else "returned"
            self.fail(f"{c.text}: core {what_a}, reference {what_b}")
        if a[0] == "raise":
            ta, tb = type(a[1]), type(b[1])
            rep.trace[-1] = f"{line}  -> {ta.__name__}"
            if ta is not tb:
                self.fail(f"{c.text}: core raised {ta.__name__}({a[1]}), reference {tb.__name__}({b[1]})")
            if not isinstance(a[1], ALLOWED_ERRORS):
                self.fail(f"{c.text}: undocumented exception {ta.__name__}: {a[1]}")
            rep.n_errors += 1
            rep.errors[ta.__name__] = rep.errors.get(ta.__name__, 0) + 1
            if self.full_state(self.core) != before_core:
                self.fail(f"{c.text}: the core's state changed although the call was rejected")
            if self.full_state(self.ref) != before_ref:
                self.fail(f"{c.text}: the reference's state changed although the call was rejected")
        else:
            self.compare_results(c, a[1], b[1])
        self.compare_state(c)
        if self.check:
            closed = [int(c.args[0])] if c.method in ("commit", "fail") and a[0] == "ok" else ()
            for name, stager in (("core", self.core), ("reference", self.ref)):
                try:
                    check_invariants(stager, self.cfg, closed=closed)
                except InvariantViolation as exc:
                    self.fail(f"{c.text}: {name} invariant: {exc}")
        return a[0], a[1], b[1]

    def compare_results(self, c: Call, ra: Any, rb: Any) -> None:
        rep = self.report
        if c.method == "draft":
            d = _plan_diff(ra, rb)
            if d:
                self.fail(f"{c.text}: {d}")
            rep.trace[-1] += f"  -> {ra!r}"
            self.count_plan(ra)
            if self.check:
                self.plan_check(c, ra)
        elif c.method == "draft_many":
            if ra.seqs != rb.seqs or len(ra.plans) != len(rb.plans):
                self.fail(f"{c.text}: batch seqs {ra.seqs} != {rb.seqs}")
            for pa, pb in zip(ra.plans, rb.plans):
                d = _plan_diff(pa, pb)
                if d:
                    self.fail(f"{c.text}: seq {pa.seq}: {d}")
                self.count_plan(pa)
                if self.check:
                    self.plan_check(c, pa)
            for name in ("positions", "row_seq", "slots", "rows", "encoded_rows"):
                va, vb = getattr(ra, name), getattr(rb, name)
                if va.dtype != vb.dtype or va.shape != vb.shape or va.tobytes() != vb.tobytes():
                    self.fail(f"{c.text}: batch.{name} differs")
            if ra.skips != rb.skips:
                self.fail(f"{c.text}: batch.skips {ra.skips} != {rb.skips}")
            rep.trace[-1] += f"  -> {ra!r}"
        elif c.method == "snapshot":
            if ra != rb:
                self.fail(f"{c.text}: snapshot bytes differ ({len(ra)} vs {len(rb)} bytes)")
            self.snaps.append(ra)
        elif c.method in ("state", "stats"):
            if c.method == "stats":
                ra = {k: ra[k] for k in SEMANTIC_STATS}
                rb = {k: rb[k] for k in SEMANTIC_STATS}
            if ra != rb:
                self.fail(f"{c.text}: {ra} != {rb}")
        elif isinstance(ra, np.ndarray) or isinstance(rb, np.ndarray):  # fork / shift moves
            if not (isinstance(ra, np.ndarray) and isinstance(rb, np.ndarray) and ra.dtype == rb.dtype
                    and ra.shape == rb.shape and np.array_equal(ra, rb)):
                self.fail(f"{c.text}: core returned {ra!r}, reference {rb!r}")
        elif ra != rb:
            self.fail(f"{c.text}: core returned {ra!r}, reference {rb!r}")

    def count_plan(self, plan: Any) -> None:
        if plan.skip is None:
            self.report.n_plans += 1
        else:
            self.report.n_skips += 1

    def plan_check(self, c: Call, plan: Any) -> None:
        try:
            check_plan(plan, self.cfg)
        except InvariantViolation as exc:
            self.fail(f"{c.text}: plan invariant: {exc}")

    def compare_state(self, c: Call) -> None:
        for s in range(self.cfg.max_seqs):
            a, b = self.core.state(s), self.ref.state(s)
            if a != b:
                diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
                self.fail(f"after {c.text}: state({s}) differs (core, reference): {diff}")
            sa, sb = self.core.stats(s), self.ref.stats(s)
            da = {k: sa[k] for k in SEMANTIC_STATS}
            db = {k: sb[k] for k in SEMANTIC_STATS}
            if da != db:
                diff = {k: (da[k], db[k]) for k in da if da[k] != db[k]}
                self.fail(f"after {c.text}: stats({s}) differ (core, reference): {diff}")
            if sa.get("rows", 0) < sb.get("rows", 0):
                self.fail(f"after {c.text}: core holds {sa['rows']} rows, fewer than the reference's {sb['rows']}")
            if not a["open_round"]:
                oa, ob = _outcome(self.core.snapshot, (s,)), _outcome(self.ref.snapshot, (s,))
                for side, o in (("core", oa), ("reference", ob)):
                    if o[0] == "raise":
                        self.fail(f"after {c.text}: {side} snapshot({s}) raised {type(o[1]).__name__}: {o[1]}")
                xa, xb = oa[1], ob[1]
                if xa != xb:
                    self.fail(f"after {c.text}: snapshot({s}) bytes differ ({len(xa)} vs {len(xb)} bytes)")

    # -- materialising ops -------------------------------------------------------
    def positions(self, seq: Any, mode: str, n: int, kind: str = "int64") -> Any:
        end = int(self.st(seq)["end"])
        if mode == "end":
            p = np.arange(end, end + n)
        elif mode == "end+1":
            p = np.arange(end + 1, end + 1 + n)
        elif mode == "end-1":
            p = np.arange(end - 1, end - 1 + n) if end > 0 else np.arange(n)
        elif mode == "zero":
            p = np.arange(n)
        elif mode == "neg":
            p = np.arange(-1, n - 1)
        elif mode == "gap":
            p = np.arange(end, end + n)
            if n > 1:
                p[-1] += 1
        elif mode == "far":
            p = np.arange(_MAX_POS - 1 - n // 2, _MAX_POS - 1 - n // 2 + n)
        else:
            raise AssertionError(mode)
        p = p.astype(np.int64)
        if kind == "int32":
            return p.astype(np.int32) if p.size == 0 or (p.max() < 2**31 and p.min() >= -(2**31)) else p
        if kind == "uint64":
            return p.astype(np.uint64) if p.size == 0 or p.min() >= 0 else p
        if kind == "float":
            return p.astype(np.float64)
        if kind == "2d":
            return p.reshape(1, -1)
        return p

    def n_past(self, seq: Any, mode: str) -> Any:
        st = self.st(seq)
        end = int(st["end"])
        return {
            "end": end, "end+1": end + 1, "end-1": max(0, end - 1), "end-3": max(0, end - 3), "zero": 0,
            "neg": -1, "big": _MAX_POS, "n_cache": int(st["n_cache"]), "np": np.int64(end),
        }[mode]

    def op_calls(self, op: Op) -> list[Call] | None:
        """Concrete calls for ``op`` (``None`` for macros handled in run_op)."""
        cfg = self.cfg
        name = op.name
        if name in ("begin", "commit", "snapshot"):
            seq = self.seq_of(op.get("seq"))
            return [Call(name, (seq,), f"{name}({seq!r})")]
        if name == "process":
            seq = self.seq_of(op.get("seq"))
            n = op.get("n")
            pos = self.positions(seq, op.get("at"), n, op.get("pos_dtype"))
            x = make_rows(n, cfg.feature_dim, op.get("fill"), op.get("seed"), op.get("special"))
            rows = _as_dtype(x, op.get("rows"))
            sp = op.get("special")
            desc = f"{op.get('fill')}#{op.get('seed')}" + (f"+{sp[0]}@{sp[1]}" if sp else "")
            return [Call("process", (seq, pos, rows), f"process({seq!r}, {_fmt_pos(pos)}, {_fmt_arr(rows)} {desc})")]
        if name == "process_encoded":
            seq = self.seq_of(op.get("seq"))
            n = op.get("n")
            pos = self.positions(seq, op.get("at"), n)
            mode = op.get("data")
            seed = op.get("seed")
            if mode == "raw":
                data: Any = _hash_u32(n * cfg.row_bytes, seed).astype(np.uint8).reshape(n, cfg.row_bytes)
            else:
                special = ("nan", seed) if mode == "valid_nan" else None
                x = make_rows(n, cfg.feature_dim, op.get("fill"), seed, special)
                enc = rf.encode(x, cfg.storage, "keep")
                data = np.ascontiguousarray(enc).view(np.uint8).reshape(n, cfg.row_bytes)
                if mode == "short":
                    data = data.reshape(-1)[:-1] if data.size else np.zeros(1, np.uint8)
                elif mode == "int8":
                    data = data.view(np.int8)
                elif mode == "flat":
                    data = data.reshape(-1)
                elif mode == "2d":
                    data = data.reshape(1, -1) if n != 1 else data.reshape(-1, 2)
                elif mode == "list":
                    data = data.tolist()
            return [Call("process_encoded", (seq, pos, data),
                         f"process_encoded({seq!r}, {_fmt_pos(pos)}, {_fmt_arr(data)} {mode}#{seed})")]
        if name == "draft":
            seq = self.seq_of(op.get("seq"))
            n_past = self.n_past(seq, op.get("n_past"))
            return [Call("draft", (seq, n_past), f"draft({seq!r}, {n_past!r})")]
        if name == "draft_many":
            seqs = [self.seq_of(b) for b in op.get("seqs")]
            mode = op.get("n_past")
            pasts = [self.n_past(s, {"mismatch": "end"}.get(mode, mode)) for s in seqs]
            if mode == "mismatch":
                pasts.append(0)
            return [Call("draft_many", (seqs, pasts), f"draft_many({seqs!r}, {pasts!r})")]
        if name == "fail":
            seq = self.seq_of(op.get("seq"))
            stage = op.get("stage")
            return [Call("fail", (seq, stage), f"fail({seq!r}, {stage!r})")]
        if name == "accept":
            seq = self.seq_of(op.get("seq"))
            return [Call("accept", (seq, op.get("n")), f"accept({seq!r}, {op.get('n')})")]
        if name == "rollback":
            seq = self.seq_of(op.get("seq"))
            back = op.get("back")
            end = int(self.st(seq)["end"])
            n_past = {"neg": -1, "zero": 0, "big": _MAX_POS}.get(back) if isinstance(back, str) else max(0, end - back)
            return [Call("rollback", (seq, n_past), f"rollback({seq!r}, {n_past!r})")]
        if name == "shift":
            seq = self.seq_of(op.get("seq"))
            end = int(self.st(seq)["end"])
            mode = op.get("mode")
            keep = op.get("keep") * (end + 1) // 256
            discard = op.get("discard") * (end - keep + 1) // 256
            if mode == 5:
                keep = -1
            elif mode == 6:
                discard = end - keep + 1  # reaches past the end
            elif mode == 7:
                discard = -1
            return [Call("shift", (seq, keep, discard), f"shift({seq!r}, {keep}, {discard})")]
        if name == "fork":
            src, dst = self.seq_of(op.get("src")), self.seq_of(op.get("dst"))
            return [Call("fork", (src, dst), f"fork({src!r}, {dst!r})")]
        if name == "restore":
            seq = self.seq_of(op.get("seq"))
            data, desc = self.restore_data(op)
            return [Call("restore", (seq, data), f"restore({seq!r}, {desc})")]
        if name == "long_prefill":
            seq = self.seq_of(op.get("seq"))
            w = cfg.window
            n = {"w+1": w + 1, "2w+3": 2 * w + 3, "trim": TRIM_CHUNK + w + 7, "big": 2 * TRIM_CHUNK + 3}[op.get("n")]
            calls = []
            start = int(self.st(seq)["end"])
            k = op.get("chunks")
            sizes = [n // k] * (k - 1) + [n - n // k * (k - 1)]
            for i, m in enumerate(sizes):
                pos = np.arange(start, start + m, dtype=np.int64)
                rows = make_rows(m, cfg.feature_dim, "normal", op.get("seed") * 7 + i)
                calls.append(Call("process", (seq, pos, rows), f"process({seq!r}, {_fmt_pos(pos)}, {_fmt_arr(rows)} long)"))
                start += m
            return calls
        if name == "introspect":
            seq = self.seq_of(op.get("seq"))
            what = op.get("what")
            return [Call(what, (seq,), f"{what}({seq!r})")]
        return None

    def restore_data(self, op: Op) -> tuple[Any, str]:
        damage = op.get("damage")
        if damage == "empty":
            return b"", "b''"
        if damage == "foreign":
            other = self.cfg.replace(window=self.cfg.window + 1)
            return ReferenceStager(other).snapshot(0), "snapshot of another config"
        if self.snaps:
            which = op.get("which") % len(self.snaps)
            base = self.snaps[which]
            src = f"snaps[{which}]"
        else:
            base = ReferenceStager(self.cfg).snapshot(0)
            src = "fresh snapshot"
        data = bytearray(base)
        pos, value = op.get("pos"), op.get("value")
        if damage == "flip":
            i = (pos * 257 + value) % len(data)
            data[i] ^= 1 << (value % 8)
            return bytes(data), f"{src} with bit {value % 8} of byte {i} flipped"
        if damage == "cut":
            k = 1 + value % 9
            return bytes(data[:-k]), f"{src} cut by {k} bytes"
        if damage == "grow":
            k = 1 + value % 5
            return bytes(data) + b"\0" * k, f"{src} + {k} zero bytes"
        if damage == "list":
            return list(data), f"list({src})"
        if damage == "patch":
            off, fmt, fname = _PATCH_FIELDS[op.get("field") % len(_PATCH_FIELDS)]
            (old,) = struct.unpack_from(fmt, data, off)
            d = _PATCH_DELTAS[value % len(_PATCH_DELTAS)]
            bits = struct.calcsize(fmt) * 8
            signed = fmt[-1].islower()
            if d == "zero":
                new = 0
            elif d == "neg1":
                new = -1
            elif d == "max62":
                new = _MAX_POS
            elif d == "max63":
                new = (1 << 63) - 1
            elif d == "flip_flag":
                new = old ^ (1 << (pos % 6))
            else:
                new = old + d
            lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
            new = (new - lo) % (hi - lo + 1) + lo  # wrap into the field
            struct.pack_into(fmt, data, off, new)
            struct.pack_into("<I", data, len(data) - 4, zlib.crc32(bytes(data[:-4])) & 0xFFFFFFFF)
            return bytes(data), f"{src} with {fname} {old} -> {new} (checksum fixed)"
        return bytes(data), src

    # -- running ops ----------------------------------------------------------
    def run_op(self, op: Op) -> None:
        self.report.n_ops += 1
        self.report.trace.append(f"== op {self.report.n_ops}: {op!r}")
        if op.name == "round":
            self.run_round(op)
            return
        calls = self.op_calls(op)
        assert calls is not None, op
        for c in calls:
            self.call(c)

    def run_round(self, op: Op) -> None:
        """Whole rounds as a server drives them: draft, commit/fail, verify B + 1 rows, accept."""
        cfg = self.cfg
        seq = self.seq_of(op.get("seq"))
        close = op.get("close")
        b = cfg.block_size
        nv = op.get("n_verify")
        n = b + 1 if nv == 0 else min(nv, b + 1)
        for r in range(op.get("rounds")):
            end = int(self.st(seq)["end"])
            kind, plan, _ = self.call(Call("draft", (seq, end), f"draft({seq!r}, {end})"))
            if kind == "ok" and plan.skip is None:
                if close == "commit" or (close in ("decode", "crop") and r % 2):
                    self.call(Call("commit", (seq,), f"commit({seq!r})"))
                elif close in ("decode", "crop"):
                    self.call(Call("fail", (seq, close), f"fail({seq!r}, {close!r})"))
                else:
                    return  # leave the round open: later ops meet a StateError
            pos = np.arange(end, end + n, dtype=np.int64)
            rows = make_rows(n, cfg.feature_dim, "normal", op.get("seed") * 31 + r + end)
            self.call(Call("process", (seq, pos, rows), f"process({seq!r}, {_fmt_pos(pos)}, {_fmt_arr(rows)} verify)"))
            acc = (op.get("accepted") + r * 3) % (b + 1)
            self.call(Call("accept", (seq, acc), f"accept({seq!r}, {acc})"))


def run_differential(
    config: StagerConfig,
    ops: Sequence[Op],
    *,
    check: bool = True,
    core: Any = None,
    reference: Any = None,
) -> RunReport:
    """Apply ``ops`` to the C++ core and to the reference, comparing everything.

    After every call: the same outcome (the same exception type, or the same
    plan fields, ``encoded_rows`` and ``rows`` bytes, return values), the same
    ``state(seq)`` and :data:`~dspark_core.reference.SEMANTIC_STATS` counters
    for every sequence, the same snapshot bytes for every sequence with no
    open round, and a rejected call must change nothing on either side. With
    ``check`` the invariants (:func:`check_invariants`, :func:`check_plan`)
    are checked on both sides too.

    ``core`` / ``reference`` replace ``Stager(config)`` / ``ReferenceStager(config)``
    (e.g. to test the harness against a deliberately broken stager).

    Raises:
        Desync: on the first difference or violation, with the op trace.
    """
    if core is None:
        from ._stager import Stager

        core = Stager(config)
    if reference is None:
        reference = ReferenceStager(config)
    runner = _Runner(config, core, reference, check)
    # Both sides must log the same records (e.g. exactly one warning when a
    # sequence is disabled); capture them instead of printing them.
    log = logging.getLogger("dspark_core")
    handler = _Capture(runner.logs)
    saved = log.propagate, log.level
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        for op in ops:
            runner.run_op(op)
    finally:
        log.removeHandler(handler)
        log.propagate, log.level = saved
    return runner.report


class _Capture(logging.Handler):
    def __init__(self, sink: list[logging.LogRecord]) -> None:
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record)


# ---------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------


def _violation(msg: str) -> None:
    raise InvariantViolation(msg)


def check_plan(plan: Any, config: StagerConfig, *, verify_rows: bool = True) -> None:
    """Check one :class:`StagePlan` against the protocol's static guarantees.

    Drafter positions inside ``[0, W)`` and contiguous (context rows then the
    block, no gap), ``crop_from`` at the block, ``clear_cache`` plans start at
    drafter position 0, a rebase keeps at most ``w_keep`` rows, array shapes
    and dtypes, and (``verify_rows``) ``rows`` equal ``encoded_rows`` decoded.

    Raises:
        InvariantViolation: naming the broken rule.
    """
    c = config
    tag = f"seq {plan.seq} plan at {plan.start}"
    if plan.skip is not None:
        if plan.skip not in SKIP_REASONS:
            _violation(f"{tag}: unknown skip reason {plan.skip!r}")
        if len(plan.positions) or len(plan.block_positions) or len(plan.encoded_rows):
            _violation(f"{tag}: a skipped plan stages something")
        return
    pos = np.asarray(plan.positions)
    blk = np.asarray(plan.block_positions)
    n = len(pos)
    if pos.dtype != np.int32 or blk.dtype != np.int32:
        _violation(f"{tag}: positions must be int32, got {pos.dtype} / {blk.dtype}")
    if n and not np.array_equal(pos, np.arange(pos[0], pos[0] + n)):
        _violation(f"{tag}: context positions are not contiguous: {pos.tolist()}")
    if len(blk) != c.block_size or not np.array_equal(blk, np.arange(plan.crop_from, plan.crop_from + c.block_size)):
        _violation(f"{tag}: block positions {blk.tolist()} are not [crop_from, crop_from + B) = "
                   f"[{plan.crop_from}, {plan.crop_from + c.block_size})")
    if n and pos[-1] + 1 != plan.crop_from:
        _violation(f"{tag}: context rows end at {pos[-1] + 1}, but the block starts at {plan.crop_from}")
    if (n and pos[0] < 0) or plan.crop_from < 0:
        _violation(f"{tag}: negative drafter position (positions from {pos[0] if n else None}, crop_from {plan.crop_from})")
    if plan.crop_from + c.block_size > c.window:
        _violation(f"{tag}: block [{plan.crop_from}, {plan.crop_from + c.block_size}) does not fit the window {c.window}")
    if plan.crop_from != plan.start - plan.pos_base or plan.pos_base < 0:
        _violation(f"{tag}: crop_from {plan.crop_from} != start {plan.start} - pos_base {plan.pos_base}")
    if plan.rebase and not plan.clear_cache:
        _violation(f"{tag}: a rebase must clear the drafter cache")
    if plan.clear_cache and plan.crop_from != n:
        _violation(f"{tag}: clear_cache, but the {n} context rows do not start at drafter position 0 "
                   f"(block at {plan.crop_from})")
    if plan.rebase and n > c.w_keep:
        _violation(f"{tag}: a rebase restaged {n} rows, more than w_keep = {c.w_keep}")
    enc = np.asarray(plan.encoded_rows)
    if enc.dtype != np.uint8 or enc.shape != (n, c.row_bytes):
        _violation(f"{tag}: encoded_rows is {enc.dtype}{enc.shape}, expected uint8({n}, {c.row_bytes})")
    rows = plan.rows
    if rows.dtype != c.numpy_stage_dtype or rows.shape != (n, c.feature_dim):
        _violation(f"{tag}: rows is {rows.dtype}{rows.shape}, expected {c.numpy_stage_dtype}({n}, {c.feature_dim})")
    if verify_rows and n:
        expect = rf.decode(enc, c.storage, c.feature_dim, c.numpy_stage_dtype)
        if expect.tobytes() != np.ascontiguousarray(rows).tobytes():
            _violation(f"{tag}: rows are not encoded_rows decoded to {c.stage_dtype}")


def check_invariants(
    stager: Any, config: StagerConfig, plan: Any = None, *, closed: Iterable[int] = ()
) -> None:
    """Check every sequence's state of ``stager`` (and ``plan``, if given).

    Per started sequence: ``horizon <= end`` and ``pos_base <= n_cache <= end``
    (positions contiguous: ``n_retained + n_pending == end - horizon``), the
    drafter cache inside the window (``n_cache - pos_base <= W - B`` unless a
    clean restage is owed), at most ``B + 1`` tentative rows, the buffer bound
    (``peak_rows <= W + TRIM_CHUNK + B + 1``, rows held >= ``end - horizon``),
    and no open round on the sequences in ``closed`` (those just committed or
    failed). ``plan`` (a StagePlan or BatchPlan) is checked with :func:`check_plan`.

    Raises:
        InvariantViolation: naming the sequence and the broken rule.
    """
    c = config
    closed = set(int(s) for s in closed)
    for s in range(c.max_seqs):
        st = stager.state(s)
        stats = stager.stats(s)
        tag = f"seq {s}"
        if s in closed and st["open_round"]:
            _violation(f"{tag}: a round is still open after commit/fail")
        if st["tentative_rows"] < 0 or st["tentative_rows"] > c.block_size + 1:
            _violation(f"{tag}: {st['tentative_rows']} tentative rows (at most B + 1 = {c.block_size + 1})")
        peak = stats.get("peak_rows", stats.get("rows", 0))
        if peak > c.max_buffered_rows or stats.get("rows", 0) > c.max_buffered_rows:
            _violation(f"{tag}: {peak} rows buffered, over the bound W + TRIM_CHUNK + B + 1 = {c.max_buffered_rows}")
        if not st["started"]:
            if st["open_round"] or st["n_retained"] or st["n_pending"]:
                _violation(f"{tag}: a sequence that never received rows has state {st}")
            continue
        end, h, nc, pb = st["end"], st["horizon"], st["n_cache"], st["pos_base"]
        if not 0 <= h <= end:
            _violation(f"{tag}: horizon {h} is not inside [0, end = {end}]")
        if not 0 <= pb <= nc <= end:
            _violation(f"{tag}: expected 0 <= pos_base {pb} <= n_cache {nc} <= end {end}")
        if st["n_retained"] + st["n_pending"] != end - h or st["n_retained"] < 0 or st["n_pending"] < 0:
            _violation(f"{tag}: retained {st['n_retained']} + pending {st['n_pending']} != end - horizon = {end - h}")
        if not st["restage_owed"] and nc - pb > c.window - c.block_size:
            _violation(f"{tag}: drafter cache [0, {nc - pb}) leaves no room for a block in the window {c.window}")
        if st["tentative_rows"] > end - nc:
            _violation(f"{tag}: {st['tentative_rows']} tentative rows but only {end - nc} rows after the cache end")
        if "rows" in stats and stats["rows"] < end - h:
            _violation(f"{tag}: holds {stats['rows']} rows, fewer than the {end - h} stageable ones")
        if not st["open_round"] and hasattr(stager, "snapshot"):
            # The sequence's own snapshot must be restorable (and describe this state).
            try:
                snap = snapshot_format.unpack(bytes(stager.snapshot(s)), c.snapshot_fingerprint(), STORAGES)
            except ValueError as exc:
                _violation(f"{tag}: its own snapshot would not restore: {exc}")
            if (snap.end, snap.horizon, snap.n_cache, snap.pos_base) != (end, h, nc, pb):
                _violation(f"{tag}: snapshot fields differ from state()")
    if plan is not None:
        plans = getattr(plan, "plans", None)
        for p in plans if plans is not None else [plan]:
            check_plan(p, config)


# ---------------------------------------------------------------------------
# A checking proxy for server loops
# ---------------------------------------------------------------------------


_POLICY_FOR_TRUTH = {"error": "keep", "zero": "zero", "clamp_f16": "clamp_f16"}


@dataclass
class _Model:
    """What the server's drafter holds for one sequence, and the target's rows."""

    truth: dict[int, bytes] = field(default_factory=dict)  # abs position -> encoded row the server gave
    cache: dict[int, tuple[int, bytes]] | None = None  # drafter pos -> (abs pos, row); None: unknown
    open_plan: Any = None


class InvariantChecker:
    """Wrap any Stager-like object and check every call and plan.

    Use it in place of the stager inside your server loop (or a test of it)::

        st = InvariantChecker(Stager(config))        # or ReferenceStager, or your own
        st.begin(0); st.process(0, pos, rows); plan = st.draft(0, n_past); st.commit(0)

    Besides :func:`check_plan` and :func:`check_invariants` after every call,
    it keeps a model of the drafter's KV cache as a server following the
    protocol would (clear on ``clear_cache``, decode the rows and the block,
    crop at ``crop_from``; unknown after ``fail`` / ``rollback`` into it /
    ``shift`` / ``fork`` / ``restore``) and of the rows the target produced,
    and checks that

    * a plan that does not clear the cache continues it exactly: the cache
      holds drafter positions ``[0, first staged position)``, every cached
      row is the current row of ``pos_base + drafter position``;
    * every staged row is byte for byte the row the server gave for that
      absolute position (with ``check_rows``);
    * a rejected call changes no state, and no round stays open after
      ``commit`` / ``fail``.

    Other attributes pass through to the wrapped object. ``calls`` counts the
    checked calls.

    Raises:
        InvariantViolation: on the first broken guarantee.
    """

    def __init__(self, stager: Any, config: StagerConfig | None = None, *, check_rows: bool = True) -> None:
        self._st = stager
        self._cfg = config if config is not None else stager.config
        self._check_rows = check_rows
        self._models = [_Model() for _ in range(self._cfg.max_seqs)]
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._st, name)

    def __repr__(self) -> str:
        return f"InvariantChecker({self._st!r})"

    # -- plumbing -------------------------------------------------------------
    def _valid(self, seq: Any) -> int | None:
        try:
            i = int(seq)
        except (TypeError, ValueError):
            return None
        return i if 0 <= i < self._cfg.max_seqs and isinstance(seq, (int, np.integer)) else None

    def _states(self) -> list[dict[str, Any]]:
        return [self._st.state(s) for s in range(self._cfg.max_seqs)]

    def _call(self, name: str, *args: Any, closed: Iterable[int] = ()) -> Any:
        self.calls += 1
        before = self._states()
        try:
            result = getattr(self._st, name)(*args)
        except Exception:
            if self._states() != before:
                _violation(f"{name}{args!r:.200}: the call was rejected but the state changed")
            raise
        check_invariants(self._st, self._cfg, closed=closed)
        return result

    def _enc(self, rows: Any) -> np.ndarray:
        from .formats import quantize_rows

        x = np.ascontiguousarray(rows)
        enc = quantize_rows(x, self._cfg.storage, nonfinite=_POLICY_FOR_TRUTH[self._cfg.nonfinite])
        return np.ascontiguousarray(enc).view(np.uint8).reshape(len(x), self._cfg.row_bytes)

    def _sync_truth(self, s: int) -> None:
        """Forget target rows the stager no longer has and no cached row refers to."""
        m = self._models[s]
        st = self._st.state(s)
        if not st["started"]:
            m.truth.clear()
            return
        lo = st["horizon"]
        if m.cache:
            lo = min(lo, min(a for a, _ in m.cache.values()))
        for p in [p for p in m.truth if p < lo or p >= st["end"]]:
            del m.truth[p]

    def _check_against_model(self, s: int, plan: Any) -> None:
        if plan.skip is not None:
            return
        m = self._models[s]
        tag = f"seq {s} plan at {plan.start}"
        n = plan.n_rows
        first = int(plan.crop_from) - n
        if not plan.clear_cache:
            if m.cache is None:
                _violation(f"{tag}: the drafter cache cannot be trusted (after fail / rollback / shift / fork / "
                           "restore / begin), but the plan does not clear it")
            if sorted(m.cache) != list(range(len(m.cache))) or len(m.cache) != first:
                _violation(f"{tag}: the drafter cache holds positions [0, {len(m.cache)}), "
                           f"but the plan stages from {first}")
            for dpos, (abs_pos, row) in m.cache.items():
                if abs_pos != dpos + plan.pos_base:
                    _violation(f"{tag}: drafter position {dpos} holds target row {abs_pos}, "
                               f"but pos_base {plan.pos_base} maps it to {dpos + plan.pos_base}")
                if self._check_rows and m.truth.get(abs_pos, row) != row:
                    _violation(f"{tag}: drafter position {dpos} holds a stale row for target position {abs_pos}")
        if self._check_rows:
            enc = np.asarray(plan.encoded_rows)
            for k in range(n):
                abs_pos = plan.pos_base + first + k
                want = m.truth.get(abs_pos)
                if want is None:
                    _violation(f"{tag}: staged target position {abs_pos}, which the server never gave "
                               "(or which was dropped)")
                if enc[k].tobytes() != want:
                    _violation(f"{tag}: staged row for target position {abs_pos} differs from the row the server gave")
        if plan.start != max(m.truth, default=plan.start - 1) + 1 and self._check_rows:
            _violation(f"{tag}: planned at {plan.start}, but the target's rows end at {max(m.truth, default=-1) + 1}")

    # -- the protocol ---------------------------------------------------------
    def begin(self, seq: int) -> None:
        self._call("begin", seq)
        s = self._valid(seq)
        if s is not None:
            self._models[s] = _Model()

    def process(self, seq: int, positions: Any, rows: Any) -> None:
        self._call("process", seq, positions, rows)
        s = self._valid(seq)
        pos = np.asarray(positions).reshape(-1)
        if s is not None and len(pos):
            enc = self._enc(rows)
            for k, p in enumerate(pos.tolist()):
                self._models[s].truth[int(p)] = enc[k].tobytes()
            self._sync_truth(s)

    def process_encoded(self, seq: int, positions: Any, data: Any) -> None:
        self._call("process_encoded", seq, positions, data)
        s = self._valid(seq)
        pos = np.asarray(positions).reshape(-1)
        if s is not None and len(pos):
            enc = np.ascontiguousarray(data, dtype=np.uint8).reshape(len(pos), self._cfg.row_bytes)
            for k, p in enumerate(pos.tolist()):
                self._models[s].truth[int(p)] = enc[k].tobytes()
            self._sync_truth(s)

    def _after_plan(self, s: int, plan: Any) -> None:
        check_plan(plan, self._cfg)
        self._check_against_model(s, plan)
        st = self._st.state(s)
        if plan.skip is None:
            if not st["open_round"]:
                _violation(f"seq {s}: draft returned a plan but opened no round")
            self._models[s].open_plan = plan
        elif st["open_round"]:
            _violation(f"seq {s}: a skipped plan ({plan.skip}) left a round open")

    def draft(self, seq: int, n_past: int) -> Any:
        plan = self._call("draft", seq, n_past)
        self._after_plan(int(seq), plan)
        return plan

    def draft_many(self, seqs: Sequence[int], n_pasts: Sequence[int]) -> Any:
        batch = self._call("draft_many", seqs, n_pasts)
        if [p.seq for p in batch.plans] != [int(s) for s in seqs]:
            _violation(f"draft_many: plans for {[p.seq for p in batch.plans]}, asked for {list(seqs)}")
        for p in batch.plans:
            self._after_plan(p.seq, p)
        active = [p for p in batch.plans if p.skip is None]
        want = np.concatenate([p.positions for p in active]) if active else np.zeros(0, np.int32)
        if not np.array_equal(batch.positions, want):
            _violation("draft_many: batch positions are not the plans' positions concatenated")
        return batch

    def commit(self, seq: int) -> None:
        self._call("commit", seq, closed=[int(seq)])
        s = int(seq)
        m = self._models[s]
        plan, m.open_plan = m.open_plan, None
        if plan is None:
            return  # opened behind the checker's back: nothing to model
        cache = {} if plan.clear_cache or m.cache is None else m.cache
        first = int(plan.crop_from) - plan.n_rows
        enc = np.asarray(plan.encoded_rows)
        for k in range(plan.n_rows):
            cache[first + k] = (plan.pos_base + first + k, enc[k].tobytes())
        m.cache = {d: v for d, v in cache.items() if d < plan.crop_from}  # the crop
        self._sync_truth(s)

    def fail(self, seq: int, stage: str = "decode") -> None:
        self._call("fail", seq, stage, closed=[int(seq)])
        m = self._models[int(seq)]
        m.open_plan = None
        m.cache = None

    def accept(self, seq: int, n_accepted: int) -> None:
        s = self._valid(seq)
        before = self._st.state(s) if s is not None else None
        self._call("accept", seq, n_accepted)
        if s is not None:
            after = self._st.state(s)
            if after["end"] > before["end"] or after["end"] < before["end"] - before["tentative_rows"]:
                _violation(f"seq {s}: accept moved the end from {before['end']} to {after['end']} "
                           f"({before['tentative_rows']} tentative rows)")
            self._sync_truth(s)

    def rollback(self, seq: int, n_past: int) -> None:
        self._call("rollback", seq, n_past)
        s = self._valid(seq)
        if s is not None:
            m = self._models[s]
            if m.cache and any(a >= int(n_past) for a, _ in m.cache.values()):
                m.cache = None  # the drafter holds rows of positions the target dropped
            self._sync_truth(s)

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        self._call("shift", seq, n_keep, n_discard)
        s = self._valid(seq)
        if s is not None and n_discard:
            m = self._models[s]
            hi = n_keep + n_discard
            m.truth = {(p if p < n_keep else p - n_discard): r for p, r in m.truth.items() if not n_keep <= p < hi}
            m.cache = None
            self._sync_truth(s)

    def fork(self, src: int, dst: int) -> None:
        self._call("fork", src, dst)
        a, b = self._models[int(src)], _Model()
        b.truth = dict(a.truth)
        self._models[int(dst)] = b
        self._sync_truth(int(dst))

    def snapshot(self, seq: int) -> bytes:
        data = self._call("snapshot", seq)
        s = int(seq)
        c = self._cfg
        try:
            snap = snapshot_format.unpack(bytes(data), c.snapshot_fingerprint(), STORAGES)
        except ValueError as exc:
            _violation(f"seq {s}: its own snapshot does not restore: {exc}")
        st = self._st.state(s)
        for k in ("end", "horizon", "n_cache", "pos_base", "started", "disabled"):
            if getattr(snap, k) != st[k]:
                _violation(f"seq {s}: snapshot {k} = {getattr(snap, k)}, state says {st[k]}")
        return data

    def restore(self, seq: int, data: Any) -> None:
        self._call("restore", seq, data)
        s = int(seq)
        c = self._cfg
        snap = snapshot_format.unpack(bytes(memoryview(data)), c.snapshot_fingerprint(), STORAGES)  # accepted
        m = _Model()
        rb = c.row_bytes
        for k in range(snap.end - snap.horizon):
            m.truth[snap.horizon + k] = snap.rows[k * rb:(k + 1) * rb]
        self._models[s] = m
        st = self._st.state(s)
        if st["started"] and not st["restage_owed"]:
            _violation(f"seq {s}: a restored sequence must restage cleanly")
        self._sync_truth(s)

    def state(self, seq: int) -> dict[str, Any]:
        return self._st.state(seq)

    def stats(self, seq: int) -> dict[str, int]:
        return self._st.stats(seq)
