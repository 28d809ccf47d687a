"""A Stager wrapper that checks every staged row and records the session for replays.

:class:`CheckedStager` forwards the protocol calls of a session to a Stager and

* keeps the row last fed to ``process`` for every absolute position (the
  captured row the Stager must stage there: a rejected draft row is replaced
  when its position is captured again);
* checks every plan's staged rows against those rows: bit for bit when the
  storage is f32, else equal to the CPU encode (``quantize_rows`` with the
  Stager's non-finite policy, then ``dequantize_rows``), and the plan's
  ``encoded_rows`` equal to that encode byte for byte;
* records the calls, so :func:`replay` can drive a Stager of another storage
  through the same session (the plans' positions must then be the same: the
  storage changes bytes, never the protocol) without running the target again.

A mismatch raises :class:`StagingMismatch` (an ``AssertionError``: a bug).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..formats import dequantize_rows, quantize_rows

__all__ = ["CheckedStager", "StagingMismatch", "ReplayResult", "replay"]


class StagingMismatch(AssertionError):
    """A staged row differs from what the captured row must stage as."""


def _plan_key(plan: Any) -> tuple[Any, ...]:
    if plan.skip is not None:
        return (plan.skip,)
    return (
        bool(plan.clear_cache), bool(plan.rebase), int(plan.pos_base), int(plan.crop_from),
        np.asarray(plan.positions).tobytes(), np.asarray(plan.block_positions).tobytes(),
    )


@dataclass
class _Log:
    """Captured rows by absolute position (grown on demand)."""

    feature_dim: int
    rows: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.rows = np.zeros((1024, self.feature_dim), np.float32)

    def put(self, positions: np.ndarray, rows: np.ndarray) -> None:
        need = int(positions.max()) + 1
        if need > len(self.rows):
            grown = np.zeros((max(need, 2 * len(self.rows)), self.feature_dim), np.float32)
            grown[: len(self.rows)] = self.rows
            self.rows = grown
        self.rows[positions] = rows


class CheckedStager:
    """Forward to ``stager``; check staged rows; record the calls (see module docstring)."""

    def __init__(self, stager: Any) -> None:
        self.stager = stager
        self.config = stager.config
        self.trace: list[tuple[Any, ...]] = []
        self.staged_rows_checked = 0
        self._logs: dict[int, _Log] = {}

    def _log(self, seq: int) -> _Log:
        if seq not in self._logs:
            self._logs[seq] = _Log(int(self.config.feature_dim))
        return self._logs[seq]

    def begin(self, seq: int) -> None:
        self.stager.begin(seq)
        self.trace.append(("begin", seq))

    def process(self, seq: int, positions: Any, rows: np.ndarray) -> None:
        pos = np.asarray(positions, dtype=np.int64)
        self.stager.process(seq, pos, rows)
        rows32 = np.ascontiguousarray(rows, dtype=np.float32)
        self._log(seq).put(pos, rows32)
        self.trace.append(("process", seq, pos.copy(), rows32.copy()))

    def draft(self, seq: int, n_past: int, copy: bool = True) -> Any:
        # `copy` passed on only when asked for, as InvariantChecker does: the stager may be
        # a wrapper whose draft takes (seq, n_past) alone.
        plan = self.stager.draft(seq, n_past, *(() if copy is True else (copy,)))
        self.trace.append(("draft", seq, int(n_past), _plan_key(plan)))
        if plan.skip is None:
            self.staged_rows_checked += check_plan(plan, self._log(seq).rows, self.config)
        return plan

    def commit(self, seq: int) -> None:
        self.stager.commit(seq)
        self.trace.append(("commit", seq))

    def fail(self, seq: int, stage: str = "decode") -> int:
        disabled_after = int(self.stager.fail(seq, stage))
        self.trace.append(("fail", seq, stage))
        return disabled_after

    def accept(self, seq: int, n_accepted: int) -> None:
        self.stager.accept(seq, n_accepted)
        self.trace.append(("accept", seq, int(n_accepted)))

    def __getattr__(self, name: str) -> Any:  # stats, state, ...: read-only calls
        return getattr(self.stager, name)


def check_plan(plan: Any, log_rows: np.ndarray, config: Any) -> int:
    """Check ``plan``'s staged rows against the captured ``log_rows``; return how many were checked."""
    abs_pos = int(plan.pos_base) + np.asarray(plan.positions, dtype=np.int64)
    if len(abs_pos) == 0:
        return 0
    want = log_rows[abs_pos]
    storage, D = config.storage, int(config.feature_dim)
    staged = np.asarray(plan.rows)
    if staged.dtype != np.float32:
        raise StagingMismatch("check_plan compares float32 staged rows (stage_dtype='float32')")
    if storage == "f32":
        expect = want
    else:
        enc = quantize_rows(want, storage, nonfinite=config.nonfinite)
        enc_bytes = np.ascontiguousarray(enc).view(np.uint8).reshape(len(abs_pos), -1)
        got_bytes = np.asarray(plan.encoded_rows).reshape(len(abs_pos), -1)
        if not np.array_equal(enc_bytes, got_bytes):
            bad = int(np.flatnonzero((enc_bytes != got_bytes).any(axis=1))[0])
            raise StagingMismatch(
                f"seq {plan.seq}: encoded row at position {int(abs_pos[bad])} differs from quantize_rows({storage})"
            )
        expect = dequantize_rows(enc, storage, D)
    if not np.array_equal(staged.view(np.uint32), np.ascontiguousarray(expect).view(np.uint32)):
        bad = int(np.flatnonzero((staged.view(np.uint32) != expect.view(np.uint32)).any(axis=1))[0])
        raise StagingMismatch(
            f"seq {plan.seq}: staged row at position {int(abs_pos[bad])} (drafter position "
            f"{int(plan.positions[bad])}) differs from the captured row ({storage})"
        )
    return len(abs_pos)


@dataclass
class ReplayResult:
    """One storage's replay of a recorded session."""

    storage: str
    nonfinite: str
    row_bytes: int
    staged_rows_checked: int
    rebases: int
    staged_rows: int
    peak_rows: int
    peak_bytes: int  #: ``peak_rows * row_bytes``: the rows held at most (not resident pages)


def replay(trace: list[tuple[Any, ...]], stager: Any) -> ReplayResult:
    """Drive ``stager`` (another storage) through ``trace``; check plans and staged rows.

    Raises:
        StagingMismatch: a plan differs from the recorded one, or a staged row from its encode.
        ValueError: the storage's non-finite policy rejected a row (nothing checked after it).
    """
    cfg = stager.config
    logs: dict[int, _Log] = {}
    checked = 0
    seqs: set[int] = set()
    peak_rows = 0
    for call in trace:
        op, seq = call[0], call[1]
        seqs.add(seq)
        if op == "begin":
            stager.begin(seq)
        elif op == "process":
            _, _, pos, rows = call
            stager.process(seq, pos, rows)
            logs.setdefault(seq, _Log(int(cfg.feature_dim))).put(pos, rows)
        elif op == "draft":
            _, _, n_past, key = call
            plan = stager.draft(seq, n_past)
            if _plan_key(plan) != key:
                raise StagingMismatch(f"seq {seq}: the {cfg.storage} plan at n_past {n_past} differs from the recorded one")
            if plan.skip is None:
                checked += check_plan(plan, logs[seq].rows, cfg)
        elif op == "commit":
            stager.commit(seq)
        elif op == "fail":
            stager.fail(seq, call[2])
        elif op == "accept":
            stager.accept(seq, call[2])
        else:  # pragma: no cover - the recorder writes only the ops above
            raise ValueError(f"unknown op {op!r} in the trace")
        if op in ("process", "accept"):  # where rows are added / kept (the reference reports no peak)
            st = stager.stats(seq)
            peak_rows = max(peak_rows, int(st.get("peak_rows", st["rows"])))
    stats = [stager.stats(s) for s in sorted(seqs)]
    return ReplayResult(
        storage=cfg.storage, nonfinite=cfg.nonfinite, row_bytes=int(cfg.row_bytes), staged_rows_checked=checked,
        rebases=sum(int(s["rebases"]) for s in stats), staged_rows=sum(int(s["staged_rows"]) for s in stats),
        peak_rows=peak_rows, peak_bytes=peak_rows * int(cfg.row_bytes),
    )
