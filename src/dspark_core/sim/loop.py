"""A whole speculative-decoding loop over a Stager: prefill, draft, verify, accept, failures.

:class:`SpeculativeLoop` drives a :class:`Target` and a :class:`Drafter` through
any object with the Stager API (:class:`dspark_core.Stager` or
:class:`dspark_core.reference.ReferenceStager`), following docs/protocol.md (the rules: docs/design.md section 2)
literally. Greedy decoding only.

One round for a sequence whose target sits at ``n_past`` with a sampled but
not yet decoded token ``last``::

    plan = stager.draft(seq, n_past)            # or draft_many for several sequences
    if plan.skip:                               # nothing to draft with: decode `last` normally
        target.decode([last]) -> 1 row          # stager.process(seq, [n_past], row)
    else:
        drafter.clear(seq) if plan.clear_cache
        logits = drafter.decode(seq, plan.positions, plan.rows,
                                [last, mask, ..., mask], plan.block_positions)
        drafter.crop(seq, plan.crop_from)
        stager.commit(seq)                      # or stager.fail(seq, "decode" | "crop")
        d_1..d_B = argmax(logits)               # block row k predicts the token after row k
        target.decode([last, d_1, ..., d_B])    # B + 1 rows at [n_past, n_past + B]
        stager.process(seq, positions, rows)
        n = leading k with d_(k+1) == target's greedy token after position n_past + k
        stager.accept(seq, n)                   # keeps n + 1 rows
        target.rollback(n_past + n + 1)         # drop the rejected tokens
        emit d_1..d_n and the target's token after them (the new `last`)

So ``n_accepted`` is in ``[0, B]``, the target advances by ``n_accepted + 1``
and the Stager keeps exactly the rows of the tokens the target kept. Output is
therefore the target's own greedy decoding, token for token (lossless).

A failed drafter round (any exception from ``clear``/``decode``/``crop`` other
than ``AssertionError``, which signals a bug) is reported with
``stager.fail`` and the round falls back to one plain target decode.

With ``ring`` (the owner of an external-row Stager's rows: a
:class:`~dspark_core.cuda.DeviceRing`, rows on the device, or a
:class:`~dspark_core.HostRing`, rows in host memory) ``process`` becomes
``ring.write`` (the target's rows are uploaded, as a GPU target would
produce them on the device) and the drafter reads ``ring.gather(plan)``
instead of ``plan.rows``.

A chain drafter (``drafter.kind == "chain"``: EAGLE-3, EAGLE, MTP; the toy
is :class:`~dspark_core.sim.toy_chain.ToyChainDrafter`) runs over a Stager
with ``StagerConfig(kind="chain")``: every ``process`` passes the tokens the
target read at those positions (``tokens=``), and the round is::

        drafts = drafter.decode_chain(seq, plan.positions, plan.rows,
                                      plan.successors(last), plan.block_positions)

each staged row paired with the id of the token after it (the newest row
with ``last``), the ``B`` drafts one per step at the block positions (the
crop removes their entries).

With ``check_recompute`` the loop checks, after each committed round, that the
drafter's (incremental, windowed) block logits equal a from-scratch
``drafter.recompute`` over the context rows ``[pos_base, start)`` at rebased
positions ``[0, start - pos_base)``; with f32 storage it also checks that those
rows are bit-identical to the rows the target produced.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import numpy.typing as npt

from .tree_draft import accepted_path, draft_tree

#: Token ids: a sequence of ints or a 1-D integer array.
Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]

__all__ = [
    "Target",
    "Drafter",
    "TargetOutput",
    "SpeculativeLoop",
    "SequenceResult",
    "LoopResult",
    "RecomputeMismatch",
    "DrafterError",
]

logger = logging.getLogger("dspark_core")


class DrafterError(RuntimeError):
    """What a Drafter raises for an expected failure of a round (e.g. no free KV slot).

    The loop recovers from any exception through ``Stager.fail``; failures of
    this type are logged at DEBUG, any other exception (possibly a drafter bug)
    at WARNING. An optional ``stage`` attribute ("decode" / "crop") says where
    the round failed.
    """


class RecomputeMismatch(AssertionError):
    """The incrementally cached drafter disagreed with a from-scratch recompute."""


@runtime_checkable
class TargetOutput(Protocol):
    """Result of :meth:`Target.decode`."""

    next_tokens: np.ndarray  #: greedy next token after each decoded position, ``(n,)``
    rows: np.ndarray  #: capture rows of the decoded positions, ``(n, feature_dim)``


@runtime_checkable
class Target(Protocol):
    """The target model of one sequence (greedy).

    ``decode`` appends tokens at ``n_past`` and returns, per position, the
    greedy next token and the capture (feature) row; ``rollback`` drops
    positions ``>= n_past``; ``reset`` starts a new request.
    """

    feature_dim: int

    @property
    def n_past(self) -> int: ...

    def reset(self) -> None: ...

    def decode(self, tokens: Tokens) -> TargetOutput: ...

    def rollback(self, n_past: int) -> None: ...


@runtime_checkable
class Drafter(Protocol):
    """A block drafter with a per-sequence KV cache addressed by drafter position.

    ``decode`` runs the staged context rows at ``positions`` plus the block
    ``block_tokens`` at ``block_positions`` and returns either block logits
    ``(B, vocab)`` (block row ``k`` predicts the token after block row ``k``)
    or ``B`` draft token ids. ``clear`` removes the sequence's whole cache;
    ``crop`` removes cached positions ``>= from_pos``. ``recompute`` (optional,
    used by ``check_recompute``) evaluates the same block from scratch.
    """

    mask_token_id: int

    def clear(self, seq: int) -> None: ...

    def crop(self, seq: int, from_pos: int) -> None: ...

    def decode(
        self,
        seq: int,
        positions: np.ndarray,
        rows: np.ndarray,
        block_tokens: Tokens,
        block_positions: np.ndarray,
    ) -> np.ndarray: ...


@dataclass
class SequenceResult:
    """What one sequence did over a :meth:`SpeculativeLoop.run`.

    Attributes:
        seq: sequence id.
        prompt_len: prompt tokens.
        tokens: the generated tokens (int64).
        rounds: drafter rounds attempted (committed + failed).
        skips: rounds the Stager skipped (plain decode), by reason.
        failures: drafter rounds that failed (``Stager.fail``).
        drafted: draft tokens proposed; ``accepted``: of which accepted.
        max_drafter_pos: largest drafter position the drafter ran at (block included).
        max_drafter_batch: largest drafter batch (staged rows + block).
        peak_rows / peak_bytes: largest buffered rows / bytes in the Stager.
        drafter_kv_peak: largest drafter KV cache length (if the drafter reports it).
        stats: the Stager's ``stats(seq)`` at the end.
        recompute_checks / recompute_max_err: "incremental equals recompute" checks done
            and the largest absolute logit difference seen.
        timeline: per drafter round: ``n_past``, ``max_pos`` (largest drafter position),
            ``rows`` (buffered rows after the round), ``rebase`` (0/1), ``drafted`` (``B``,
            or 0 for a failed round) and ``accepted`` (draft tokens the target kept).
    """

    seq: int
    prompt_len: int
    tokens: np.ndarray
    rounds: int = 0
    skips: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    drafted: int = 0
    accepted: int = 0
    max_drafter_pos: int = -1
    max_drafter_batch: int = 0
    peak_rows: int = 0
    peak_bytes: int = 0
    drafter_kv_peak: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    recompute_checks: int = 0
    # Tree verification (tree=True): rounds verified as a tree, and of those the accepted
    # paths whose tokens and rows a linear verify of the same tokens reproduced.
    tree_rounds: int = 0
    tree_paths_linear: int = 0
    recompute_max_err: float = 0.0
    timeline: dict[str, list[int]] = field(default_factory=dict)

    @property
    def n_generated(self) -> int:
        """Generated tokens."""
        return int(len(self.tokens))

    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def restaged_per_token(self) -> float:
        """Restaged rows per generated token (``stats["restaged_rows"]`` / generated)."""
        return self.stats.get("restaged_rows", 0) / max(1, self.n_generated)


@dataclass
class LoopResult:
    """The result of :meth:`SpeculativeLoop.run`.

    Attributes:
        sequences: one :class:`SequenceResult` per sequence, in id order.
        iterations: loop iterations (one drafter batch each).
        wall_s: total seconds; ``stager_s`` / ``drafter_s`` / ``target_s``: the parts.
        block_size / window / row_bytes: from the Stager's config.
    """

    sequences: list[SequenceResult]
    iterations: int
    wall_s: float
    stager_s: float
    drafter_s: float
    target_s: float
    block_size: int
    window: int
    row_bytes: int

    @property
    def n_generated(self) -> int:
        """Generated tokens over all sequences."""
        return sum(s.n_generated for s in self.sequences)

    def summary(self) -> dict[str, Any]:
        """Aggregate numbers (maxima over sequences, sums of counters)."""
        seqs = self.sequences
        rounds = sum(s.rounds for s in seqs)
        drafted = sum(s.drafted for s in seqs)
        gen = self.n_generated
        stat_sum = lambda k: sum(s.stats.get(k, 0) for s in seqs)  # noqa: E731
        return {
            "sequences": len(seqs),
            "generated_tokens": gen,
            "iterations": self.iterations,
            "drafter_rounds": rounds,
            "failures": sum(s.failures for s in seqs),
            "skips": sum(sum(s.skips.values()) for s in seqs),
            "acceptance": sum(s.accepted for s in seqs) / drafted if drafted else 0.0,
            "tokens_per_round": gen / max(1, rounds + sum(sum(s.skips.values()) for s in seqs)),
            "max_drafter_pos": max((s.max_drafter_pos for s in seqs), default=-1),
            "max_drafter_batch": max((s.max_drafter_batch for s in seqs), default=0),
            "peak_rows": max((s.peak_rows for s in seqs), default=0),
            "peak_bytes": max((s.peak_bytes for s in seqs), default=0),
            "drafter_kv_peak": max((s.drafter_kv_peak for s in seqs), default=0),
            "rebases": stat_sum("rebases"),
            "restaged_rows": stat_sum("restaged_rows"),
            "restaged_per_token": stat_sum("restaged_rows") / max(1, gen),
            "recompute_checks": sum(s.recompute_checks for s in seqs),
            "tree_rounds": sum(s.tree_rounds for s in seqs),
            "tree_paths_linear": sum(s.tree_paths_linear for s in seqs),
            "recompute_max_err": max((s.recompute_max_err for s in seqs), default=0.0),
            "wall_s": self.wall_s,
            "ms_per_round": 1e3 * self.wall_s / max(1, self.iterations),
            "stager_ms_per_round": 1e3 * self.stager_s / max(1, self.iterations),
            "drafter_ms_per_round": 1e3 * self.drafter_s / max(1, self.iterations),
            "target_ms_per_round": 1e3 * self.target_s / max(1, self.iterations),
        }


@dataclass
class _SeqState:
    seq: int
    target: Any
    prompt_len: int
    n_past: int = 0
    last: int = -1
    out: list[int] = field(default_factory=list)
    res: SequenceResult | None = None
    shadow: dict[int, np.ndarray] = field(default_factory=dict)  # abs pos -> staged row (check_recompute)
    log: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # rows fed to process
    log_n: int = 0
    second: np.ndarray | None = None  # the last round's second-choice drafts (a tree's leaves)
    log_tokens: dict[int, int] = field(default_factory=dict)  # abs pos -> the token processed there (check)


class TreeMismatch(AssertionError):
    """A tree's accepted path disagreed with a linear verify of the same tokens."""


class SpeculativeLoop:
    """Greedy speculative decoding of one or more sequences over a Stager.

    Args:
        stager: a :class:`dspark_core.Stager` or :class:`~dspark_core.reference.ReferenceStager`
            (``max_seqs`` must cover the sequences run).
        drafter: the block drafter (:class:`Drafter`), shared by all sequences.
        targets: one :class:`Target` per sequence (sequence ``i`` uses ``targets[i]``);
            a single target is accepted for one sequence.
        prefill_chunk: prompt rows per ``process`` call (a server's ``n_batch``).
        check_recompute: ``0``/``False``: off; ``k``: check "incremental equals
            recompute" every ``k``-th committed round of each sequence (``True`` = every round).
        rtol, atol: tolerances of that check (see :mod:`dspark_core.sim.toy` for why 1e-9
            suits a float64 drafter).
        use_draft_many: plan all sequences with one ``draft_many`` call per iteration
            (default: when there is more than one sequence).
        record_timeline: keep per-round positions and buffered rows (for plots).
        ring: the owner of the rows of ``stager`` (which must then be in
            external-row mode): a :class:`~dspark_core.cuda.DeviceRing` or a
            :class:`~dspark_core.HostRing`; rows are written to and gathered
            from its table instead of passing through the Stager.
        tree: verify each round as a draft tree (:mod:`dspark_core.sim.tree_draft`:
            ``process_tree`` and ``accept_path``, through ``ring`` when given), each
            accepted path checked against a linear verify of the same tokens.

    A chain drafter (``drafter.kind == "chain"``) needs a chain drafter's Stager
    (``StagerConfig(kind="chain")``) and the other way round: ``ValueError``.
    """

    def __init__(
        self,
        stager: Any,
        drafter: Drafter,
        targets: Target | Sequence[Target],
        *,
        prefill_chunk: int = 512,
        check_recompute: int | bool = 0,
        rtol: float = 1e-9,
        atol: float = 1e-9,
        use_draft_many: bool | None = None,
        record_timeline: bool = True,
        ring: Any = None,
        tree: bool = False,
    ) -> None:
        self.stager = stager
        self.tree = tree
        self.drafter = drafter
        self.targets: list[Any] = list(targets) if isinstance(targets, (list, tuple)) else [targets]
        cfg = getattr(stager, "config", None)
        if cfg is None:
            raise TypeError("stager must expose its StagerConfig as .config")
        self.config = cfg
        self.chain = getattr(cfg, "kind", "block") == "chain"
        drafter_kind = getattr(drafter, "kind", "block")
        if drafter_kind != getattr(cfg, "kind", "block"):
            raise ValueError(f"a {drafter_kind} drafter needs a Stager of kind {drafter_kind!r}, got "
                             f"StagerConfig(kind={getattr(cfg, 'kind', 'block')!r})")
        if ring is not None and getattr(ring, "stager", None) is not stager:
            raise ValueError("ring must be a DeviceRing or HostRing over this loop's stager")
        if ring is None and getattr(cfg, "external_rows", False):
            raise ValueError("an external-row Stager holds no rows: pass ring=DeviceRing(stager) or HostRing(stager)")
        self.ring = ring
        self.block_size: int = int(cfg.block_size)
        if len(self.targets) > cfg.max_seqs:
            raise ValueError(f"{len(self.targets)} targets for a Stager with max_seqs={cfg.max_seqs}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.check_every = int(check_recompute)  # True -> 1 (every round), False -> 0 (off)
        if self.check_every and not hasattr(drafter, "recompute_chain" if self.chain else "recompute"):
            raise TypeError("check_recompute needs a drafter with a recompute() (chain: recompute_chain()) method")
        self.rtol, self.atol = rtol, atol
        self.use_draft_many = use_draft_many
        self.record_timeline = record_timeline
        self._t_stager = self._t_drafter = self._t_target = 0.0

    # -- timed calls --------------------------------------------------------------
    def _st(self, name: str, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return getattr(self.stager, name)(*args, **kw)
        finally:
            self._t_stager += time.perf_counter() - t

    def _tg(self, s: _SeqState, tokens: Tokens) -> Any:
        t = time.perf_counter()
        try:
            return s.target.decode(tokens)
        finally:
            self._t_target += time.perf_counter() - t

    def _track_rows(self, s: _SeqState) -> int:
        stats = self.stager.stats(s.seq)
        res = s.res
        assert res is not None
        rows = int(stats.get("rows", 0))
        peak = max(rows, int(stats.get("peak_rows", 0)))
        if peak > res.peak_rows:
            res.peak_rows = peak
        # Bytes of the rows held (not the core's resident ring memory, which the
        # reference does not have): comparable between implementations and modes.
        res.peak_bytes = max(res.peak_bytes, peak * int(self.config.row_bytes))
        return rows

    def _process(self, s: _SeqState, start: int, rows: np.ndarray, tokens: Tokens) -> None:
        """The target's rows at ``[start, start + n)``, read from ``tokens`` (which a chain
        drafter's Stager keeps beside the rows)."""
        pos = np.arange(start, start + len(rows), dtype=np.int64)
        kw = {"tokens": np.asarray(tokens, np.int64)} if self.chain else {}
        if self.ring is not None:
            t = time.perf_counter()
            self.ring.write(s.seq, pos, self.ring.upload(rows), **kw)
            self._t_stager += time.perf_counter() - t
        else:
            self._st("process", s.seq, pos, rows, **kw)
        self._log(s, start, rows, tokens)

    def _log(self, s: _SeqState, start: int, rows: np.ndarray, tokens: Tokens) -> None:
        if self.check_every:
            for k, t in enumerate(np.asarray(tokens, np.int64).tolist()):
                s.log_tokens[start + k] = t
            # the loop's own log of the rows fed to the Stager (truncated on accept), for the f32 check
            need = start + len(rows)
            if need > len(s.log):
                grown = np.zeros((max(need, 2 * len(s.log), 1024), rows.shape[1]), np.float32)
                if s.log_n:
                    grown[: s.log_n] = s.log[: s.log_n]
                s.log = grown
            s.log[start:need] = rows
            s.log_n = need

    # -- phases ---------------------------------------------------------------------
    def _prefill(self, s: _SeqState, tokens: Tokens) -> None:
        prompt = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(prompt) == 0:
            raise ValueError(f"sequence {s.seq}: empty prompt")
        s.target.reset()
        self._st("begin", s.seq)
        last = -1
        for lo in range(0, len(prompt), self.prefill_chunk):
            chunk = prompt[lo : lo + self.prefill_chunk]
            out = self._tg(s, chunk)
            self._process(s, lo, out.rows, chunk)
            self._track_rows(s)
            last = int(out.next_tokens[-1])
        s.n_past = len(prompt)
        s.last = last
        s.out = [last]

    def _plain_decode(self, s: _SeqState) -> None:
        out = self._tg(s, [s.last])
        self._process(s, s.n_past, out.rows, [s.last])
        s.n_past += 1
        s.last = int(out.next_tokens[0])
        s.out.append(s.last)

    def _drafter_round(self, s: _SeqState, plan: Any) -> np.ndarray | None:
        """Run the drafter for ``plan``; commit or fail. Returns the B draft tokens or None."""
        d = self.drafter
        B = self.block_size
        res = s.res
        assert res is not None
        res.rounds += 1
        bpos = np.asarray(plan.block_positions)
        res.max_drafter_pos = max(res.max_drafter_pos, int(bpos[-1]))
        res.max_drafter_batch = max(res.max_drafter_batch, int(len(plan.positions)) + B)
        # A block drafter's queries, or a chain drafter's ids after each staged row.
        block = plan.successors(s.last).tolist() if self.chain else [s.last] + [int(d.mask_token_id)] * (B - 1)
        stage = "decode"
        t = time.perf_counter()
        rows = self._staged_rows(plan)
        try:
            if plan.clear_cache:
                d.clear(s.seq)
            if self.chain:
                out = d.decode_chain(s.seq, plan.positions, rows, block, bpos)  # type: ignore[attr-defined]
            else:
                out = d.decode(s.seq, plan.positions, rows, block, bpos)
            stage = "crop"
            d.crop(s.seq, int(plan.crop_from))
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - a drafter failure: recover through the Stager
            self._t_drafter += time.perf_counter() - t
            # An expected failure (a DrafterError, e.g. out of KV slots) is routine; anything
            # else may be a drafter bug: recovered the same way, but said out loud.
            level = logging.DEBUG if isinstance(exc, DrafterError) else logging.WARNING
            logger.log(level, "sequence %d: drafter %s failed: %r", s.seq, stage, exc)
            stage = getattr(exc, "stage", stage)
            self._st("fail", s.seq, stage if stage in ("decode", "crop") else "decode")
            res.failures += 1
            s.shadow.clear()
            return None
        self._t_drafter += time.perf_counter() - t
        self._st("commit", s.seq)
        out = np.asarray(out)
        if out.ndim == 2:
            logits = out
            order = np.argsort(-out, axis=1, kind="stable")
            draft = order[:, 0].astype(np.int64)
            s.second = order[:, 1].astype(np.int64) if out.shape[1] > 1 else None
        else:
            logits = None
            draft = out.astype(np.int64).reshape(-1)
            s.second = None
        if len(draft) != B:
            raise ValueError(f"drafter returned {len(draft)} draft tokens, expected {B}")
        if self.check_every:
            self._check(s, plan, rows, block, logits, draft)
        return draft

    def _staged_rows(self, plan: Any) -> Any:
        """The plan's rows: ``plan.rows``, or gathered from the device ring (then brought
        to the host for the toy drafter, as a GPU drafter would read them in place)."""
        if self.ring is None:
            return plan.rows
        t = time.perf_counter()
        try:
            return self.ring.to_numpy(self.ring.gather(plan))
        finally:
            self._t_stager += time.perf_counter() - t

    def _check(
        self, s: _SeqState, plan: Any, rows: Any, block: list[int], logits: np.ndarray | None, draft: np.ndarray
    ) -> None:
        """Incremental equals recompute over [pos_base, start) at rebased positions."""
        res = s.res
        assert res is not None
        if plan.clear_cache:
            s.shadow.clear()
        base, start = int(plan.pos_base), int(plan.start)
        staged = np.asarray(rows)
        for i, p in enumerate(np.asarray(plan.positions)):
            s.shadow[base + int(p)] = staged[i]
        # the drafter cache now holds [pos_base, start); nothing else may be in the shadow
        for a in [a for a in s.shadow if a < base or a >= start]:
            del s.shadow[a]
        committed = res.rounds - res.failures
        if committed % self.check_every:
            return
        missing = [a for a in range(base, start) if a not in s.shadow]
        if missing:
            raise RecomputeMismatch(
                f"sequence {s.seq}: drafter cache should hold [{base}, {start}) but rows {missing[:5]} were never staged"
            )
        ctx = np.stack([s.shadow[a] for a in range(base, start)]) if start > base else np.zeros(
            (0, staged.shape[1] if staged.ndim == 2 else self.config.feature_dim), np.float32
        )
        if self.config.storage == "f32" and self.config.stage_dtype == "float32" and start > base:
            want = s.log[base:start]
            if not np.array_equal(ctx.astype(np.float32), want):
                raise RecomputeMismatch(f"sequence {s.seq}: staged rows [{base}, {start}) differ from the target's rows")
        if self.chain:
            # The ids the Stager handed out, against the loop's own log of the tokens it processed.
            succ = [s.log_tokens[a + 1] if a + 1 < start else s.last for a in range(base, start)]
            if list(block) != succ[len(succ) - len(block):]:
                raise RecomputeMismatch(f"sequence {s.seq}: the staged rows' successor ids {list(block)[:8]} differ "
                                        f"from the tokens processed after them {succ[len(succ) - len(block):][:8]}")
            ref = self.drafter.recompute_chain(ctx, np.arange(0, start - base), succ,  # type: ignore[attr-defined]
                                               np.asarray(plan.block_positions))
        else:
            ref = self.drafter.recompute(ctx, np.arange(0, start - base), block, np.asarray(plan.block_positions))  # type: ignore[attr-defined]
        if logits is None:  # the drafter returned tokens: compare the greedy choices
            ok = bool(np.array_equal(np.argmax(ref, axis=1), draft))
            err = 0.0
        else:
            err = float(np.max(np.abs(ref - logits))) if ref.size else 0.0
            ok = bool(np.allclose(logits, ref, rtol=self.rtol, atol=self.atol))
        res.recompute_checks += 1
        res.recompute_max_err = max(res.recompute_max_err, err)
        if not ok:
            raise RecomputeMismatch(
                f"sequence {s.seq}: incremental drafter logits differ from recompute by {err:.3g} "
                f"(round {res.rounds}, pos_base {base}, start {start}, rebase {plan.rebase})"
            )

    def _verify(self, s: _SeqState, draft: np.ndarray) -> int:
        """Verify ``draft`` with one target decode; returns the number of draft tokens accepted."""
        B = self.block_size
        res = s.res
        assert res is not None
        toks = [s.last, *(int(x) for x in draft)]
        out = self._tg(s, toks)
        self._process(s, s.n_past, out.rows, toks)
        g = np.asarray(out.next_tokens)
        n_acc = 0
        while n_acc < B and int(draft[n_acc]) == int(g[n_acc]):
            n_acc += 1
        self._st("accept", s.seq, n_acc)
        t = time.perf_counter()
        s.target.rollback(s.n_past + n_acc + 1)
        self._t_target += time.perf_counter() - t
        s.log_n = min(s.log_n, s.n_past + n_acc + 1)
        res.drafted += B
        res.accepted += n_acc
        s.out.extend(int(x) for x in draft[:n_acc])
        s.last = int(g[n_acc])
        s.out.append(s.last)
        s.n_past += n_acc + 1
        return n_acc

    def _verify_tree(self, s: _SeqState, draft: np.ndarray) -> int:
        """Verify the round as a draft tree (:func:`~dspark_core.sim.tree_draft.draft_tree`);
        returns the drafts accepted.

        The target decodes each node after its ancestors (the greedy chain in one decode,
        each leaf after its parent); the Stager gets the nodes as one tree verify batch and
        keeps the accepted path. The target then re-decodes that path linearly, as a linear
        verify of the same tokens would, and its choices and rows must be the tree's.
        """
        res = s.res
        assert res is not None
        n0, B = s.n_past, self.block_size
        tree = draft_tree(s.last, draft, s.second, B)
        n = len(tree.tokens)
        nxt = np.empty(n, np.int64)
        rows = np.empty((n, self.config.feature_dim), np.float32)
        chain = tree.chain
        out = self._tg(s, [tree.tokens[i] for i in chain])
        nxt[chain], rows[chain] = out.next_tokens, out.rows
        for i in range(n):
            if i not in chain:  # a leaf beside the chain: after its parent, at n0 + depth
                s.target.rollback(n0 + tree.depths[i])
                leaf = self._tg(s, [tree.tokens[i]])
                nxt[i], rows[i] = leaf.next_tokens[0], leaf.rows[0]
        parents = np.asarray(tree.parents, np.int64)
        path = accepted_path(tree, nxt)
        kw = {"tokens": np.asarray(tree.tokens, np.int64)} if self.chain else {}
        if self.ring is not None:
            t = time.perf_counter()
            self.ring.write_tree(s.seq, n0, parents, self.ring.upload(rows), **kw)
            self.ring.accept_path(s.seq, np.asarray(path, np.int64))  # applies the copies
            self._t_stager += time.perf_counter() - t
        else:
            self._st("process_tree", s.seq, n0, parents, rows, **kw)
            self._st("accept_path", s.seq, np.asarray(path, np.int64))
        k = len(path)
        self._log(s, n0, rows[path], [tree.tokens[i] for i in path])
        s.log_n = min(s.log_n, n0 + k)
        # The linear verify of the accepted tokens: the target's own state must end there anyway.
        s.target.rollback(n0)
        lin = self._tg(s, [tree.tokens[i] for i in path])
        if not (np.array_equal(lin.next_tokens, nxt[path]) and np.allclose(lin.rows, rows[path], rtol=1e-6, atol=1e-6)):
            raise TreeMismatch(f"sequence {s.seq}: the accepted path {path} at {n0} differs from a linear verify of its tokens")
        res.tree_rounds += 1
        res.tree_paths_linear += 1
        res.drafted += B
        res.accepted += k - 1
        s.out.extend(tree.tokens[i] for i in path[1:])
        s.last = int(nxt[path[-1]])
        s.out.append(s.last)
        s.n_past += k
        return k - 1

    # -- driver -------------------------------------------------------------------------
    def run(
        self,
        prompts: Sequence[Tokens],
        n_generate: int,
        progress: Callable[[int, int], None] | None = None,
    ) -> LoopResult:
        """Prefill every prompt, then generate ``n_generate`` tokens per sequence.

        Args:
            prompts: one token list per sequence (``len(prompts) <= len(targets)``).
            n_generate: tokens to generate per sequence (>= 1).
            progress: called as ``progress(generated_so_far, total)`` after each iteration.

        Returns:
            :class:`LoopResult`; ``result.sequences[i].tokens`` equals the target's own
            greedy decoding of ``prompts[i]``.
        """
        states = self._start(prompts, n_generate)
        # Per-round figures cover generation only: the prefill's time is not a round's.
        self._t_stager = self._t_drafter = self._t_target = 0.0
        t0 = time.perf_counter()
        total = n_generate * len(states)
        many = self.use_draft_many if self.use_draft_many is not None else len(states) > 1
        iterations = 0
        active = [s for s in states if len(s.out) < n_generate]
        while active:
            iterations += 1
            if many:
                bp = self._st("draft_many", [s.seq for s in active], [s.n_past for s in active])
                plans = list(bp.plans)
            else:
                plans = [self._st("draft", s.seq, s.n_past) for s in active]
            for s, plan in zip(active, plans):
                res = s.res
                assert res is not None
                if plan.skip is not None:
                    res.skips[plan.skip] = res.skips.get(plan.skip, 0) + 1
                    self._plain_decode(s)
                    self._track_rows(s)
                    continue
                draft = self._drafter_round(s, plan)
                n_acc = 0
                if draft is None:
                    self._plain_decode(s)
                else:
                    n_acc = self._verify_tree(s, draft) if self.tree else self._verify(s, draft)
                rows = self._track_rows(s)
                if self.record_timeline:
                    tl = res.timeline
                    tl["n_past"].append(s.n_past)
                    tl["max_pos"].append(int(plan.block_positions[-1]))
                    tl["rows"].append(rows)
                    tl["rebase"].append(int(bool(plan.rebase)))
                    tl["drafted"].append(0 if draft is None else self.block_size)
                    tl["accepted"].append(n_acc)
            active = [s for s in active if len(s.out) < n_generate]
            if progress is not None:
                progress(sum(min(len(s.out), n_generate) for s in states), total)
        return self._result(states, n_generate, iterations, time.perf_counter() - t0)

    def _start(self, prompts: Sequence[Tokens], n_generate: int) -> list[_SeqState]:
        """The run's arguments checked and every prompt prefilled (shared with the device step's loop)."""
        if n_generate < 1:
            raise ValueError(f"n_generate must be >= 1, got {n_generate}")
        if len(prompts) > len(self.targets):
            raise ValueError(f"{len(prompts)} prompts for {len(self.targets)} targets")
        states = [_SeqState(seq=i, target=self.targets[i], prompt_len=len(p)) for i, p in enumerate(prompts)]
        for s in states:
            s.res = SequenceResult(seq=s.seq, prompt_len=s.prompt_len, tokens=np.zeros(0, np.int64))
            if self.record_timeline:
                s.res.timeline = {"n_past": [], "max_pos": [], "rows": [], "rebase": [], "drafted": [], "accepted": []}
            self._prefill(s, prompts[s.seq])
        return states

    def _result(self, states: list[_SeqState], n_generate: int, iterations: int, wall: float) -> LoopResult:
        """The run's result: each sequence's tokens, counters and drafter cache peak, and the timings
        (shared with the device step's loop)."""
        for s in states:
            res = s.res
            assert res is not None
            res.tokens = np.asarray(s.out[:n_generate], dtype=np.int64)
            res.stats = {k: int(v) for k, v in dict(self.stager.stats(s.seq)).items()}
            peak_kv = getattr(self.drafter, "peak_cache_len", None)
            if callable(peak_kv):
                res.drafter_kv_peak = int(peak_kv(s.seq))
        cfg = self.config
        return LoopResult(
            sequences=[s.res for s in states if s.res is not None],
            iterations=iterations,
            wall_s=wall,
            stager_s=self._t_stager,
            drafter_s=self._t_drafter,
            target_s=self._t_target,
            block_size=int(cfg.block_size),
            window=int(cfg.window),
            row_bytes=int(cfg.row_bytes),
        )
