"""The differential runner: the same ops on the C++ core and the reference, every result compared.

With ``external=True`` every call also runs on an external-row core
(``rows="external"``) whose rows live in a numpy mirror table here, the way an
owner keeps them: each accepted ``process`` writes the held core's rows at the
slots it returns, ``fork`` / ``shift`` moves are applied in order, a
``restore`` puts the snapshot's rows at the slots it returns. After every call
the external core must agree with the held one (outcome, plans, slots, moves,
state, counters) and the mirror's rows at every live slot must be the held
core's rows (:class:`ExternalShadow`).
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..stager import snapshot_format
from ..stager.config import TRIM_CHUNK, StagerConfig
from ..errors import StateError
from ..reference import SEMANTIC_STATS, ReferenceStager
from ..reference import formats as rf
from ..stager.stage_plan import BATCH_ARRAYS, PaddedRows
from .data import _as_dtype, _fmt_arr, _fmt_pos, _hash_u32, make_rows
from .invariants import InvariantViolation, check_invariants, check_plan
from .ops import _MAX_POS, _PATCH_DELTAS, _PATCH_FIELDS, Call, Op

#: Exceptions a Stager may raise for a rejected call (anything else is a finding).
ALLOWED_ERRORS = (ValueError, TypeError, StateError)

#: Calls that act on one sequence and return nothing to compare but their outcome.
_PLAIN_CALLS = ("begin", "commit", "fail", "accept", "rollback", "disable", "enable", "disable_many", "enable_many")


class Desync(AssertionError):
    """The core and the reference disagreed (or the core broke an invariant).

    ``trace`` holds the calls made so far, one readable line each.
    """

    def __init__(self, message: str, trace: Sequence[str] = ()) -> None:
        self.trace = list(trace)
        tail = "\n".join(self.trace[-40:])
        super().__init__(f"{message}\n--- op trace (last {min(40, len(self.trace))} calls) ---\n{tail}")



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
    #: The calls made, in order (what :func:`replay_threads` replays).
    made: list[Call] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.n_ops} ops, {self.n_calls} calls ({self.n_plans} plans, {self.n_skips} skips, "
                f"{self.n_errors} rejected: {self.errors})")


def _outcome(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the type and the message are what is compared
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


def _batch_diff(a: Any, b: Any) -> str | None:
    """First difference between two BatchPlans' arrays, the padded form's included (``None`` when identical)."""
    arrays = [(name, getattr(a, name), getattr(b, name)) for name in BATCH_ARRAYS]
    if not a.external:
        if a.zero_copy != b.zero_copy:
            return f"batch.zero_copy: core {a.zero_copy} != reference {b.zero_copy}"
        if len(a.encoded_runs) != len(b.encoded_runs):
            return f"batch.encoded_runs: core {len(a.encoded_runs)} runs != reference {len(b.encoded_runs)}"
        arrays += [(name, getattr(a, name), getattr(b, name)) for name in ("encoded_rows", "rows", "run_offsets")]
        arrays += [(f"encoded_runs[{k}]", x, y) for k, (x, y) in enumerate(zip(a.encoded_runs, b.encoded_runs))]
    arrays += [(f"padded().{name}", x, y) for name, x, y in zip(PaddedRows._fields, a.padded(), b.padded())]
    for name, va, vb in arrays:
        if va.dtype != vb.dtype or va.shape != vb.shape or va.tobytes() != vb.tobytes():
            return f"batch.{name}: core {va.dtype}{va.shape} != reference {vb.dtype}{vb.shape} (or values differ)"
    return None


def _said(o: tuple[str, Any]) -> str:
    return f"raised {type(o[1]).__name__}: {o[1]}" if o[0] == "raise" else "returned"


def _to_external(snapshot: bytes) -> bytes:
    """The bookkeeping of a held-mode v2 snapshot as an external-row snapshot (content flag set,
    rows dropped, checksums fixed)."""
    head = bytearray(snapshot[: snapshot_format.HEADER_BYTES])
    if len(head) == snapshot_format.HEADER_BYTES:
        head[14] |= snapshot_format.CONTENT_EXTERNAL_ROWS
        snapshot_format.refresh_checksums(head)
    return bytes(head)


class ExternalShadow:
    """An external-row twin of the held core, and the owner's mirror table of its rows.

    Driven by :class:`_Runner` after each call on the held core (see the module
    docstring). Rows the held core rejected are never offered to the twin: an
    owner checks its rows before ``process`` (docs/external_rows.md); calls
    rejected before their rows are looked at (an unknown sequence, an open
    round) must be rejected by both.
    """

    def __init__(self, config: StagerConfig, held: Any, ext: Any = None) -> None:
        if ext is None:
            from .._ext._stager import Stager

            ext = Stager(config.replace(rows="external"))
        self.cfg = config
        self.held = held
        self.ext = ext
        self.mirror = np.full((config.max_seqs * config.ring_rows, config.row_bytes), 0xA5, np.uint8)

    def rows_of(self, seq: int, positions: Any) -> np.ndarray:
        """The held core's stored rows at ``positions`` (all inside [horizon, end))."""
        horizon = self.held.state(seq)["horizon"]
        snap = self.held.snapshot(seq)
        rows = np.frombuffer(snap, np.uint8, offset=snapshot_format.HEADER_BYTES).reshape(-1, self.cfg.row_bytes)
        return rows[np.asarray(positions, np.int64) - horizon]

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        slots = np.asarray(slots, np.int64)
        self.mirror[slots] = rows

    def apply(self, moves: Any) -> None:
        """Apply moves in order; each must stay inside the table and not overlap itself."""
        m = np.asarray(moves, np.int64).reshape(-1, 3)
        for src, dst, n in m.tolist():
            if not (n > 0 and 0 <= src and 0 <= dst and src + n <= len(self.mirror) and dst + n <= len(self.mirror)):
                raise AssertionError(f"move {[src, dst, n]} is outside the table")
            if not (src + n <= dst or dst + n <= src):
                raise AssertionError(f"move {[src, dst, n]} overlaps itself")
            self.mirror[dst:dst + n] = self.mirror[src:src + n].copy()

    def follow(self, runner: "_Runner", c: Call, a: tuple[str, Any]) -> None:
        """Make the call ``c`` on the twin, given the held core's outcome ``a``."""
        m, args = c.method, c.args
        seq: Any = args[0] if args else None
        before_rows = runner.valid(seq) and not self.held.state(int(seq))["open_round"]
        if m in ("process", "process_encoded"):
            if a[0] == "ok":
                x = self.expect(runner, c, a, self.ext.process, (seq, args[1]))
                slots = np.asarray(x, np.int64)
                pos = np.asarray(args[1], np.int64).reshape(-1)
                keep = slots >= 0
                if keep.any():
                    self.write(slots[keep], self.rows_of(int(seq), pos[keep]))
            elif not (runner.valid(seq) and before_rows):
                self.expect(runner, c, a, self.ext.process, (seq, args[1]))
            return
        if m == "restore":
            data = args[1]
            if a[0] == "ok":
                raw = bytes(data)
                v2 = len(raw) >= snapshot_format.HEADER_BYTES and raw[4:6] == b"\x02\x00"
                src = raw if v2 else bytes(self.held.snapshot(int(seq)))  # v1: the held core's state now
                slots = np.asarray(self.expect(runner, c, a, self.ext.restore, (seq, _to_external(src))), np.int64)
                rows = np.frombuffer(src, np.uint8, offset=snapshot_format.HEADER_BYTES).reshape(-1, self.cfg.row_bytes)
                if len(slots) != len(rows):
                    runner.fail(f"{c.text}: external restore gave {len(slots)} slots for {len(rows)} rows")
                self.write(slots, rows)
            elif not (runner.valid(seq) and before_rows):
                self.expect(runner, c, a, self.ext.restore, (seq, data))
            return
        if m in _PLAIN_CALLS or m in ("state", "stats", "buffered_positions", "live_slots"):
            x = self.expect(runner, c, a, getattr(self.ext, m), args)
            if m in ("state", "buffered_positions") and a[0] == "ok" and x != a[1]:
                runner.fail(f"{c.text}: external {x} != held {a[1]}")
            return
        if m == "snapshot":
            self.expect(runner, c, a, self.ext.snapshot, args)
            return
        if m in ("fork", "shift"):
            x = self.expect(runner, c, a, getattr(self.ext, m), args)
            if a[0] == "ok":
                if not np.array_equal(np.asarray(x), np.asarray(a[1])):
                    runner.fail(f"{c.text}: external moves {np.asarray(x).tolist()} != held {np.asarray(a[1]).tolist()}")
                try:
                    self.apply(x)
                except AssertionError as exc:
                    runner.fail(f"{c.text}: {exc}")
            return
        if m == "draft":
            # The external twin holds no rows to view: its plan is the same, by copy.
            x = self.expect(runner, c, a, self.ext.draft, args[:2] if args[2:] == (False,) else args)
            if a[0] == "ok":
                self.check_plan(runner, c, a[1], x)
            return
        if m == "draft_many":
            x = self.expect(runner, c, a, self.ext.draft_many, args[:2] if args[2:] == (False,) else args)
            if a[0] == "ok":
                if len(x.plans) != len(a[1].plans):
                    runner.fail(f"{c.text}: external batch of {len(x.plans)} plans, held {len(a[1].plans)}")
                for hp, xp in zip(a[1].plans, x.plans):
                    self.check_plan(runner, c, hp, xp)
            return
        raise AssertionError(f"no external twin for {m}")

    def expect(self, runner: "_Runner", c: Call, a: tuple[str, Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Call ``fn(*args)`` on the twin: the same outcome as the held core's ``a``."""
        x = _outcome(fn, args)
        if x[0] != a[0] or (x[0] == "raise" and type(x[1]) is not type(a[1])):
            runner.fail(f"{c.text}: held core {_said(a)}, external core {_said(x)}")
        return x[1]

    def check_plan(self, runner: "_Runner", c: Call, hp: Any, xp: Any) -> None:
        for name in ("seq", "skip", "start", "rebase", "clear_cache", "crop_from", "pos_base"):
            if getattr(hp, name) != getattr(xp, name):
                runner.fail(f"{c.text}: external plan.{name} {getattr(xp, name)!r} != held {getattr(hp, name)!r}")
        for name in ("positions", "block_positions", "slots"):
            if not np.array_equal(getattr(hp, name), getattr(xp, name)):
                runner.fail(f"{c.text}: external plan.{name} differs from the held plan's")
        got = self.mirror[np.asarray(xp.slots, np.int64)]
        if got.tobytes() != np.ascontiguousarray(hp.encoded_rows).tobytes():
            runner.fail(f"{c.text}: the mirror's rows at the external plan's slots are not the held plan's rows")

    def check(self, runner: "_Runner", c: Call) -> None:
        """After every call: the twin's state and counters are the held core's, and the mirror holds
        the held core's live rows at the live slots."""
        for s in range(self.cfg.max_seqs):
            h, x = self.held.state(s), self.ext.state(s)
            if h != x:
                runner.fail(f"after {c.text}: external state({s}) {x} != held {h}")
            hs, xs = self.held.stats(s), self.ext.stats(s)
            if {k: hs[k] for k in SEMANTIC_STATS} != {k: xs[k] for k in SEMANTIC_STATS}:
                runner.fail(f"after {c.text}: external stats({s}) differ from the held core's")
            if not np.array_equal(self.held.accepted(s), self.ext.accepted(s)):
                runner.fail(f"after {c.text}: external accepted({s}) differs from the held core's")
            slots = np.asarray(self.ext.live_slots(s), np.int64)
            if not np.array_equal(slots, self.held.live_slots(s)):
                runner.fail(f"after {c.text}: external live_slots({s}) differ from the held core's")
            if h["started"] and not h["open_round"]:
                want = bytes(self.held.snapshot(s))[snapshot_format.HEADER_BYTES:]
                if self.mirror[slots].tobytes() != want:
                    runner.fail(f"after {c.text}: the mirror's rows at the live slots of sequence {s} are not the "
                                "held core's rows")


class _Runner:
    def __init__(self, config: StagerConfig, core: Any, ref: Any, check: bool,
                 external: ExternalShadow | None = None) -> None:
        self.cfg = config
        self.core = core
        self.ref = ref
        self.check = check
        self.snaps: list[bytes] = []
        self.report = RunReport(config)
        self.logs: list[logging.LogRecord] = []
        self.external = external
        # Sequence -> (its last zero-copy plan, the rows it must still show).
        self.views: dict[int, tuple[Any, bytes]] = {}

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
            out.append((stager.state(s), {k: stats[k] for k in SEMANTIC_STATS}, stager.accepted(s).tolist(),
                        self.snapshot_of(stager, s)))
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
            if ta is not tb or str(a[1]) != str(b[1]):  # the same exception, word for word
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
        self.check_views(c, a, b)
        self.report.made.append(c)
        if self.external is not None:
            self.external.follow(self, c, a)
            self.external.check(self, c)
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
            d = _batch_diff(ra, rb)
            if d:
                self.fail(f"{c.text}: {d}")
            for pa, pb in zip(ra.plans, rb.plans):
                d = _plan_diff(pa, pb)
                if d:
                    self.fail(f"{c.text}: seq {pa.seq}: {d}")
                self.count_plan(pa)
                if self.check:
                    self.plan_check(c, pa)
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

    def check_views(self, c: Call, a: tuple[str, Any], b: tuple[str, Any]) -> None:
        """The zero-copy views of ``draft(copy=False)`` / ``draft_many(..., copy=False)`` hold their
        rows (the reference's copies of them) while the sequence sees only calls that leave its
        rows alone."""
        touched: set[int] | None = set()
        if c.method in _MULTI_SEQ_CALLS:
            touched = None  # any of them
        elif c.args and self.valid(c.args[0]):
            touched = {int(c.args[0])}
        for s in list(self.views):
            if touched is None or (s in touched and c.method not in _KEEPS_VIEWS):
                del self.views[s]
        for s, (plan, want) in self.views.items():
            got = b"".join(r.tobytes() for r in plan.encoded_runs)
            if got != want:
                self.fail(f"after {c.text}: sequence {s}'s zero-copy rows changed under a call that keeps them")
        if c.method not in ("draft", "draft_many") or c.args[2:] != (False,) or a[0] != "ok":
            return
        pairs = [(a[1], b[1])] if c.method == "draft" else zip(a[1].plans, b[1].plans)
        for plan, twin in pairs:  # each opened round's views, and the reference's copy of their rows
            if plan.skip is None:
                self.views[int(plan.seq)] = (plan, np.ascontiguousarray(twin.encoded_rows).tobytes())

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
        ta, tb = self.core.totals(), self.ref.totals()
        if {k: ta.stats[k] for k in SEMANTIC_STATS} != tb.stats or not np.array_equal(ta.accepted, tb.accepted) \
                or ta.started != tb.started:
            self.fail(f"after {c.text}: totals() differ (core, reference): {ta} != {tb}")
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
            if not np.array_equal(self.core.accepted(s), self.ref.accepted(s)):
                self.fail(f"after {c.text}: accepted({s}) differs (core, reference): "
                          f"{self.core.accepted(s).tolist()} != {self.ref.accepted(s).tolist()}")
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
            copy = op.get("copy", True)
            if copy is True:
                return [Call("draft", (seq, n_past), f"draft({seq!r}, {n_past!r})")]
            return [Call("draft", (seq, n_past, copy), f"draft({seq!r}, {n_past!r}, copy={copy!r})")]
        if name == "draft_many":
            seqs = [self.seq_of(b) for b in op.get("seqs")]
            mode = op.get("n_past")
            pasts = [self.n_past(s, {"mismatch": "end"}.get(mode, mode)) for s in seqs]
            if mode == "mismatch":
                pasts.append(0)
            copy = op.get("copy", True)
            if copy is True:
                return [Call("draft_many", (seqs, pasts), f"draft_many({seqs!r}, {pasts!r})")]
            return [Call("draft_many", (seqs, pasts, copy), f"draft_many({seqs!r}, {pasts!r}, copy={copy!r})")]
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
        if name == "drafting":
            call = "enable" if op.get("on") else "disable"
            seqs = [self.seq_of(b) for b in op.get("seqs")]
            if op.get("many"):
                return [Call(call + "_many", (seqs,), f"{call}_many({seqs!r})")]
            return [Call(call, (seqs[0],), f"{call}({seqs[0]!r})")]
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
        if name == "long_decode":
            seq = self.seq_of(op.get("seq"))
            chunk = max(1, cfg.window // 2)
            start = int(self.st(seq)["end"])
            calls = []
            for i in range(cfg.ring_rows // chunk + 1 + op.get("extra")):
                pos = np.arange(start, start + chunk, dtype=np.int64)
                rows = make_rows(chunk, cfg.feature_dim, "normal", op.get("seed") * 13 + i)
                calls.append(Call("process", (seq, pos, rows), f"process({seq!r}, {_fmt_pos(pos)}, {_fmt_arr(rows)} decode)"))
                start += chunk
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
            snapshot_format.refresh_checksums(data)
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
    external: bool = False,
    external_core: Any = None,
) -> RunReport:
    """Apply ``ops`` to the C++ core and to the reference, comparing everything.

    After every call: the same outcome (the same exception type and message, or the same
    plan fields, ``encoded_rows`` and ``rows`` bytes, return values), the same
    ``state(seq)`` and :data:`~dspark_core.reference.SEMANTIC_STATS` counters
    for every sequence, the same snapshot bytes for every sequence with no
    open round, and a rejected call must change nothing on either side. With
    ``check`` the invariants (:func:`check_invariants`, :func:`check_plan`)
    are checked on both sides too.

    ``core`` / ``reference`` replace ``Stager(config)`` / ``ReferenceStager(config)``
    (e.g. to test the harness against a deliberately broken stager).

    With ``external`` every call also runs on an external-row core with a mirror
    table of its rows, checked against the held core (:class:`ExternalShadow`);
    ``external_core`` replaces ``Stager(config.replace(rows="external"))``.

    Raises:
        Desync: on the first difference or violation, with the op trace.
    """
    if core is None:
        from .._ext._stager import Stager

        core = Stager(config)
    if reference is None:
        reference = ReferenceStager(config)
    shadow = ExternalShadow(config, core, external_core) if external or external_core is not None else None
    runner = _Runner(config, core, reference, check, shadow)
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
# Threads
# ---------------------------------------------------------------------------

#: Calls that involve two or more sequences (not replayed from several threads).
_MULTI_SEQ_CALLS = ("fork", "draft_many", "disable_many", "enable_many")
# Calls on a sequence that leave its rows where a zero-copy plan's views see them.
_KEEPS_VIEWS = ("commit", "fail", "snapshot", "state", "stats")


def _digest(o: tuple[str, Any]) -> Any:
    """A comparable summary of a call's outcome: the exception type, or what it returned."""
    kind, v = o
    if kind == "raise":
        return ("raise", type(v).__name__)
    if v is None or isinstance(v, (bool, int, tuple)):
        return ("ok", v)
    if isinstance(v, (bytes, bytearray)):
        return ("ok", bytes(v))
    if isinstance(v, dict):
        return ("ok", tuple(sorted(v.items())))
    if isinstance(v, np.ndarray):
        return ("ok", v.dtype.str, v.shape, v.tobytes())
    fields = tuple(getattr(v, k) for k in ("seq", "skip", "start", "rebase", "clear_cache", "crop_from", "pos_base"))
    arrays = tuple(np.asarray(getattr(v, k)).tobytes() for k in ("positions", "block_positions", "slots"))
    rows = b"" if getattr(v, "external", False) else np.ascontiguousarray(v.encoded_rows).tobytes()
    return ("ok", fields, arrays, rows)


def _external_call(c: Call) -> Call | None:
    """``c`` as an external-row owner makes it (``process`` without rows, restore of the
    bookkeeping); None for calls that have no external form."""
    if c.method in ("process", "process_encoded"):
        return Call("process", c.args[:2], c.text)
    if c.method == "restore":
        data = c.args[1]
        if not isinstance(data, (bytes, bytearray)):
            return None
        return Call("restore", (c.args[0], _to_external(bytes(data))), c.text)
    return c


def replay_threads(config: StagerConfig, calls: Sequence[Call], *, threads: int = 2, external: bool = True) -> int:
    """Replay the single-sequence ``calls`` on a fresh core serially, and on another
    from ``threads`` threads (sequence ``s`` on thread ``s % threads``, each in order).

    Calls on different sequences commute, so every call must end as in the serial
    replay (the same exception type, or the same plan, rows, slots, moves,
    snapshot bytes) and every sequence must end with the same state and snapshot.
    The Stager releases the GIL inside its calls, so the threads do run in the
    core at once. With ``external``, the same calls as an owner of external rows
    makes them run on two external-row cores as well.

    Returns the number of calls replayed. Raises:
        Desync: on the first difference (the trace lists the replayed calls).
    """
    from .._ext._stager import Stager

    log = logging.getLogger("dspark_core")
    quiet = log.disabled
    log.disabled = True  # both replays warn alike (strict-protocol hints): not what is compared
    try:
        return _replay_threads(config, calls, threads, external, Stager)
    finally:
        log.disabled = quiet


def _replay_threads(config: StagerConfig, calls: Sequence[Call], threads: int, external: bool,
                    make: Callable[[StagerConfig], Any]) -> int:
    import threading

    single = [c for c in calls if c.method not in _MULTI_SEQ_CALLS and c.args and isinstance(c.args[0], (int, np.integer))]
    modes: list[tuple[StagerConfig, list[Call]]] = [(config, single)]
    if external:
        ext_calls = [x for x in (_external_call(c) for c in single) if x is not None]
        modes.append((config.replace(rows="external"), ext_calls))
    for cfg, todo in modes:
        serial, threaded = make(cfg), make(cfg)
        want = [_digest(_outcome(getattr(serial, c.method), c.args)) for c in todo]
        got: list[Any] = [None] * len(todo)
        errors: list[BaseException] = []

        def worker(k: int, todo: list[Call] = todo, threaded: Any = threaded, got: list[Any] = got,
                   errors: list[BaseException] = errors) -> None:
            try:
                for i, c in enumerate(todo):
                    if int(c.args[0]) % threads == k:
                        got[i] = _digest(_outcome(getattr(threaded, c.method), c.args))
            except BaseException as exc:  # noqa: BLE001 - reported below, with the trace
                errors.append(exc)

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        trace = [f"{'[external] ' if cfg.external_rows else ''}{c.text}" for c in todo]
        if errors:
            raise Desync(f"a thread raised {type(errors[0]).__name__}: {errors[0]}", trace)
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                raise Desync(f"call {i} ({todo[i].text}) on sequence {int(todo[i].args[0])}: from threads "
                             f"{str(g)[:200]}, serially {str(w)[:200]}", trace[: i + 1])
        for s in range(cfg.max_seqs):
            if serial.state(s) != threaded.state(s):
                raise Desync(f"sequence {s}: state {threaded.state(s)} from threads, {serial.state(s)} serially", trace)
            if not serial.state(s)["open_round"] and bytes(serial.snapshot(s)) != bytes(threaded.snapshot(s)):
                raise Desync(f"sequence {s}: snapshot bytes from threads differ from the serial replay's", trace)
    return len(single)
