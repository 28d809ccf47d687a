"""Stage 4: the live speculative loop: the real target verifies, dspark_core stages, the trained drafter drafts.

For each held-out document and probe depth ``p`` the target (llama.cpp through
:class:`~dspark_core.engines.llama_cpp.LlamaCppCapture`) prefills the document's
first ``p`` tokens once, capturing their rows, and its KV cache is saved
(``save_state``) and loaded into the live context. Then, from that state:

* the reference: the target's own greedy decode of ``G`` tokens, one token per decode;
* for every drafter and mode, a :class:`~dspark_core.sim.loop.SpeculativeLoop` run of
  ``G`` tokens: the Stager (the C++ core; held rows, or external rows in a
  :class:`~dspark_core.HostRing`) stages the prompt's rows and every verify batch's,
  the drafter drafts ``B`` tokens from each plan, the target verifies them in one
  batch decode and rolls its KV cache back past the rejected ones.

The prompt's prefill is served from the saved state and rows (:class:`PrefilledTarget`:
a prefix-cache hit, the same rows the target produced), every later decode is the
target's.

The live context evaluates every batch one token per ubatch (``n_ubatch = 1``): a
verify batch's rows and logits are then bit for bit those of one-token decodes, so
"lossless" is checked exactly. With llama.cpp's batched kernels a verify batch's
logits differ from a one-token decode's in the last bits (the kernels depend on the
batch shape), and a near tie between two tokens can flip the greedy choice (seen at
depth 700 after 11 tokens on this model); that is the engine's numerics, not the
speculation, and it would hide a real loss among those flips. Every row handed to the drafter is checked bit for bit against the row the
target produced at its absolute position (:class:`AuditedDrafter`), and the loop's
tokens against the reference: lossless means equal, token for token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from capture import N_BATCH, Captured
from modes import Mode

__all__ = ["Probe", "prepare_probes", "PrefilledTarget", "AuditedDrafter", "run_probe", "LiveResult"]

log = logging.getLogger("real_drafter")


class RowMismatch(AssertionError):
    """A row handed to the drafter differs from the target's row at its position."""


@dataclass
class Probe:
    """A prefilled prompt: ``p`` tokens of a document, the target's rows and KV state there,
    the first generated token and the target's greedy reference of ``G`` tokens."""

    doc: str
    depth: int
    prompt: np.ndarray
    rows: np.ndarray
    state: bytes
    greedy: np.ndarray
    greedy_s: float


def prepare_probes(prefill: Any, engine: Any, cap: Captured, depths: Sequence[int], n_generate: int) -> list[Probe]:
    """Prefill ``cap``'s tokens up to each depth in turn on ``prefill`` (one pass), saving the state
    at each; the greedy reference decoded from it on ``engine`` (the live loop's context), one
    token per decode."""
    toks = cap.tokens
    depths = sorted(int(d) for d in depths)
    rows = np.empty((depths[-1], prefill.feature_dim), np.float32)
    prefill.reset()
    probes = []
    done = 0
    for p in depths:
        last = -1
        for lo in range(done, p, N_BATCH):
            hi = min(p, lo + N_BATCH)
            r = prefill.evaluate(toks[lo:hi], logits="last", out=rows[lo:hi])
            last = int(r.next_tokens[-1])
        done = p
        state = prefill.save_state()
        engine.load_state(state, toks[:p])
        t0 = time.perf_counter()
        greedy = [last]
        for _ in range(n_generate - 1):
            greedy.append(int(engine.evaluate([greedy[-1]], logits="all").next_tokens[0]))
        greedy_s = time.perf_counter() - t0
        probes.append(Probe(cap.name, p, toks[:p].copy(), rows[:p].copy(), state, np.asarray(greedy, np.int64),
                            greedy_s))
    return probes


class PrefilledTarget:
    """The loop's Target over ``engine``, its prompt served from a :class:`Probe`.

    ``reset`` restores the probe's KV state; ``decode`` of the prompt's tokens returns the
    probe's rows (the next token after the prompt on the last chunk); every other decode is the
    engine's. Every row returned is logged by absolute position for :class:`AuditedDrafter`.
    """

    def __init__(self, engine: Any, probe: Probe) -> None:
        self.engine = engine
        self.probe = probe
        self.feature_dim = engine.feature_dim
        self._n = 0
        self.log = np.zeros((len(probe.prompt) + 4 * N_BATCH, engine.feature_dim), np.float32)

    @property
    def n_past(self) -> int:
        return self._n

    def reset(self) -> None:
        self.engine.load_state(self.probe.state, self.probe.prompt)
        self._n = 0

    def decode(self, tokens: Any) -> Any:
        from dspark_core.engines.llama_cpp import CaptureResult

        toks = np.asarray(tokens, np.int64)
        p = len(self.probe.prompt)
        lo, hi = self._n, self._n + len(toks)
        if hi <= p:
            if not np.array_equal(toks, self.probe.prompt[lo:hi]):
                raise ValueError("a prefill that is not the probe's prompt")
            rows = self.probe.rows[lo:hi]
            nxt = np.full(len(toks), -1, np.int64)
            if hi == p:
                nxt[-1] = self.probe.greedy[0]
            out = CaptureResult(rows=rows, next_tokens=nxt)
        else:
            if lo < p:
                raise ValueError("a decode across the end of the probe's prompt")
            if self.engine.n_past != lo:
                raise AssertionError(f"the engine is at {self.engine.n_past}, the loop at {lo}")
            out = self.engine.decode(toks)
        if hi > len(self.log):
            grown = np.zeros((2 * hi, self.feature_dim), np.float32)
            grown[: len(self.log)] = self.log
            self.log = grown
        self.log[lo:hi] = out.rows
        self._n = hi
        return out

    def rollback(self, n_past: int) -> None:
        p = len(self.probe.prompt)
        if n_past < p:
            raise ValueError("a rollback into the probe's prompt")
        self.engine.rollback(n_past)
        self._n = n_past


class AuditedDrafter:
    """A drafter runtime whose every staged row is checked against the target's row there.

    The round's ``start`` is the target's ``n_past``; its ``pos_base`` is ``start`` minus the
    first block position, so staged row ``i`` is the target's row at ``pos_base + positions[i]``.
    """

    def __init__(self, inner: Any, target: PrefilledTarget) -> None:
        self.inner = inner
        self.target = target
        self.kind = inner.kind
        self.mask_token_id = inner.mask_token_id
        self.rows_checked = 0

    def clear(self, seq: int) -> None:
        self.inner.clear(seq)

    def crop(self, seq: int, from_pos: int) -> None:
        self.inner.crop(seq, from_pos)

    def peak_cache_len(self, seq: int | None = None) -> int:
        return int(self.inner.peak_cache_len(seq))

    def _check(self, positions: Any, rows: Any, block_positions: Any) -> None:
        pos = np.asarray(positions, np.int64)
        base = self.target.n_past - int(np.asarray(block_positions)[0])
        want = self.target.log[base + pos]
        got = np.asarray(rows, np.float32)
        if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            raise RowMismatch(f"a staged row of the round at {self.target.n_past} differs from the target's row")
        self.rows_checked += len(pos)

    def decode(self, seq: int, positions: Any, rows: Any, block_tokens: Any, block_positions: Any) -> np.ndarray:
        self._check(positions, rows, block_positions)
        return self.inner.decode(seq, positions, rows, block_tokens, block_positions)

    def decode_chain(self, seq: int, positions: Any, rows: Any, successors: Any, block_positions: Any) -> np.ndarray:
        self._check(positions, rows, block_positions)
        return self.inner.decode_chain(seq, positions, rows, successors, block_positions)


@dataclass
class LiveResult:
    """One live run: the probe, the verdict and the per-round record."""

    doc: str
    depth: int
    lossless: bool
    first_divergence: int | None
    rounds_n_past: np.ndarray  #: the target's n_past after each drafter round
    rounds_accepted: np.ndarray
    rounds_drafted: np.ndarray
    drafter_s: float
    loop_s: float
    rows_checked: int
    rebases: int
    max_drafter_pos: int
    rows_mode: str
    extra: dict[str, Any] = field(default_factory=dict)


def run_probe(engine: Any, probe: Probe, runtime: Any, mode: Mode, T: int, n_max: int, external: bool) -> LiveResult:
    """One speculative run of ``len(probe.greedy)`` tokens from ``probe`` (see the module docstring)."""
    from dspark_core import HostRing, Stager, StagerConfig
    from dspark_core.sim.loop import SpeculativeLoop

    if mode.absolute_positions:
        raise ValueError("the mask check is offline only")
    B = runtime.block_size
    W = mode.window(T, n_max, B)
    cfg = StagerConfig(engine.feature_dim, B, W, storage="f32", kind=runtime.kind,
                       rows="external" if external else "held")
    stager = Stager(cfg)
    ring = HostRing(stager) if external else None
    target = PrefilledTarget(engine, probe)
    drafter = AuditedDrafter(runtime, target)
    runtime.drafter_s = 0.0
    runtime.position_offset = 0
    loop = SpeculativeLoop(stager, drafter, target, prefill_chunk=N_BATCH, use_draft_many=False, ring=ring)
    t0 = time.perf_counter()
    res = loop.run([probe.prompt], len(probe.greedy))
    loop_s = time.perf_counter() - t0
    seq = res.sequences[0]
    g = probe.greedy
    n = min(len(seq.tokens), len(g))
    diff = np.flatnonzero(seq.tokens[:n] != g[:n])
    first = int(diff[0]) if len(diff) else (None if len(seq.tokens) == len(g) else n)
    tl = seq.timeline
    return LiveResult(
        probe.doc, probe.depth, first is None, first, np.asarray(tl["n_past"], np.int64),
        np.asarray(tl["accepted"], np.int64), np.asarray(tl["drafted"], np.int64), runtime.drafter_s, loop_s,
        drafter.rows_checked, int(seq.stats.get("rebases", 0)), int(seq.max_drafter_pos),
        "external" if external else "held",
        {"drafter_ms_per_round": res.summary()["drafter_ms_per_round"]},
    )
