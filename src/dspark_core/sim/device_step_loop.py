"""The speculative loop driven by the device step (docs/protocol.md 2.10).

:class:`DeviceStepLoop` runs :class:`~dspark_core.sim.loop.SpeculativeLoop`'s
session with the sequences handed over after their prefill: each iteration is
one ``step_many`` of every active sequence with the accept counts of the last
verify (commit, confirm, accept, plan and the next verify rows' slots in one
call), the drafter reading its rows at the step's slots, and the verify
forward's rows written at the step's verify slots. Nothing in an iteration
asks the Stager a question on the host: the only waits are the hand-backs of a
sequence whose drafter failed (``to_host`` with the failure, its plain decode,
``to_device`` again), counted as ``host_waits``. The host path's loop needs
one per iteration (the accept counts on the host before ``accept`` and
``draft``).

External rows only (a :class:`~dspark_core.HostRing` or ``DeviceRing`` owns
them); the recompute check is not supported here (it reads the Stager's plans).

A chain drafter's ids travel by slot while its sequences are on the device: the
loop keeps the slot token table (``Stager.new_token_table``) a server keeps
beside its rows, hands it to ``to_device`` / ``to_host``, writes each verify
row's id at its verify slot with the row, and reads the staged rows' ids at
their row slots (each row's successor: the next row's id, then ``last``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..stager.device_step import STEP_CLEAR_CACHE, STEP_REBASE, StepOutputs
from .loop import DrafterError, LoopResult, SpeculativeLoop, Tokens, _SeqState

logger = logging.getLogger("dspark_core")


class _StepPlan:
    """Entry ``k`` of a step's answers, with the attributes the loop reads of a plan."""

    def __init__(self, out: StepOutputs, k: int) -> None:
        assert out.row_positions is not None and out.row_slots is not None
        n = int(out.n_rows[k])
        self.start = int(out.start[k])
        self.pos_base = int(out.pos_base[k])
        self.crop_from = int(out.crop_from[k])
        self.rebase = bool(out.flags[k] & STEP_REBASE)
        self.clear_cache = bool(out.flags[k] & STEP_CLEAR_CACHE)
        self.positions = out.row_positions[k, :n].copy()
        self.slots = out.row_slots[k, :n].copy()
        self.block_positions = out.block_positions[k].copy()


class DeviceStepLoop(SpeculativeLoop):
    """:class:`SpeculativeLoop` over ``step_many`` (needs ``ring``: external rows)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.ring is None:
            raise ValueError("the device step needs external rows: pass ring=HostRing(stager) or DeviceRing(stager)")
        if self.check_every:
            raise ValueError("check_recompute is not supported by the device-step loop")
        self.host_waits = 0  # hand-backs (to_host) during generation
        self.steps = 0
        self._on_device: set[int] = set()
        # A chain drafter's slot token table, passed to every hand-over and hand-back.
        self._table = self.stager.new_token_table() if self.chain else None
        self._hand = {"tokens": self._table} if self.chain else {}

    def _track_rows(self, s: _SeqState) -> int:
        # stats() refuses a handed-over sequence: its rows are tracked once it is back.
        return 0 if s.seq in self._on_device else super()._track_rows(s)

    def _write_at(self, s: _SeqState, slots: np.ndarray, rows: np.ndarray, tokens: Tokens) -> None:
        """The target's rows (read from ``tokens``) at the step's verify slots; a chain
        drafter's ids at the same slots of the token table."""
        t = time.perf_counter()
        self.ring.write_slots(slots, self.ring.upload(rows))
        if self._table is not None:
            ids = np.asarray(tokens, np.int64)[: len(slots)]
            self._table[slots[slots >= 0]] = ids[slots >= 0]
        self._t_stager += time.perf_counter() - t

    def _decode_last(self, s: _SeqState, slots: np.ndarray) -> None:
        """A plain decode of ``last`` whose row goes to ``slots[0]`` (reserved by the step)."""
        out = self._tg(s, [s.last])
        self._write_at(s, slots[:1], np.asarray(out.rows)[:1], [s.last])
        s.n_past += 1
        s.last = int(out.next_tokens[0])
        s.out.append(s.last)

    def _failed(self, s: _SeqState, stage: str) -> None:
        """The drafter failed on the step's round: bring the sequence back with the failure,
        drop the verify rows the step reserved, decode ``last`` plainly, hand it over again."""
        q = s.seq
        self.host_waits += 1
        self._on_device.discard(q)
        self._st("to_host", [q], [stage], **self._hand)
        self._st("cancel", q)  # the round built no verify batch: its rows and ids were never written
        self._plain_decode(s)
        self._track_rows(s)
        self._st("to_device", [q], **self._hand)
        self._on_device.add(q)

    def _draft(self, s: _SeqState, plan: _StepPlan) -> np.ndarray | None:
        d, B = self.drafter, self.block_size
        res = s.res
        assert res is not None
        res.rounds += 1
        res.max_drafter_pos = max(res.max_drafter_pos, int(plan.block_positions[-1]))
        res.max_drafter_batch = max(res.max_drafter_batch, len(plan.positions) + B)
        t = time.perf_counter()
        rows = self.ring.to_numpy(self.ring.gather_slots(plan.slots))
        if self._table is not None:  # each staged row's successor: the next row's id, then last
            block = [*self._table[plan.slots[1:]].tolist(), s.last] if len(plan.slots) else []
        else:
            block = [s.last] + [int(d.mask_token_id)] * (B - 1)
        self._t_stager += time.perf_counter() - t
        stage = "decode"
        t = time.perf_counter()
        try:
            if plan.clear_cache:
                d.clear(s.seq)
            if self._table is not None:
                out = d.decode_chain(s.seq, plan.positions, rows, block, plan.block_positions)  # type: ignore[attr-defined]
            else:
                out = d.decode(s.seq, plan.positions, rows, block, plan.block_positions)
            stage = "crop"
            d.crop(s.seq, plan.crop_from)
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - a drafter failure: recover through the Stager
            self._t_drafter += time.perf_counter() - t
            level = logging.DEBUG if isinstance(exc, DrafterError) else logging.WARNING
            logger.log(level, "sequence %d: drafter %s failed: %r", s.seq, stage, exc)
            stage = getattr(exc, "stage", stage)
            self._failed(s, stage if stage in ("decode", "crop") else "decode")
            res.failures += 1
            return None
        self._t_drafter += time.perf_counter() - t
        out = np.asarray(out)
        draft = (np.argmax(out, axis=1) if out.ndim == 2 else out.reshape(-1)).astype(np.int64)
        if len(draft) != B:
            raise ValueError(f"drafter returned {len(draft)} draft tokens, expected {B}")
        return draft

    def _verify_at(self, s: _SeqState, draft: np.ndarray, slots: np.ndarray) -> int:
        """The verify forward, its rows written at the step's verify slots; returns the accept count."""
        B = self.block_size
        res = s.res
        assert res is not None
        tokens = [s.last, *(int(x) for x in draft)]
        out = self._tg(s, tokens)
        self._write_at(s, slots, np.asarray(out.rows), tokens)
        g = np.asarray(out.next_tokens)
        n_acc = 0
        while n_acc < B and int(draft[n_acc]) == int(g[n_acc]):
            n_acc += 1
        t = time.perf_counter()
        s.target.rollback(s.n_past + n_acc + 1)
        self._t_target += time.perf_counter() - t
        res.drafted += B
        res.accepted += n_acc
        s.out.extend(int(x) for x in draft[:n_acc])
        s.last = int(g[n_acc])
        s.out.append(s.last)
        s.n_past += n_acc + 1
        return n_acc

    def run(self, prompts: Sequence[Tokens], n_generate: int,
            progress: Callable[[int, int], None] | None = None) -> LoopResult:
        """As :meth:`SpeculativeLoop.run`, one ``step_many`` per iteration."""
        states = self._start(prompts, n_generate)
        self._t_stager = self._t_drafter = self._t_target = 0.0
        t0 = time.perf_counter()
        total = n_generate * len(states)
        counts = {s.seq: 0 for s in states}  # the last verify's accept counts (0 before the first)
        active = [s for s in states if len(s.out) < n_generate]
        self._st("to_device", [s.seq for s in active], **self._hand)
        self._on_device.update(s.seq for s in active)
        iterations = 0
        while active:
            iterations += 1
            ids = [s.seq for s in active]
            out = self._st("step_many", ids, [counts[q] for q in ids])
            self._st("check_step", ids, out.status)  # raises the core's error for a status word
            self.steps += 1
            for k, s in enumerate(active):
                res = s.res
                assert res is not None
                q = s.seq
                verify = out.verify_slots[k]
                if out.skip[k] != 0:  # no_context: the step reserved [end] for `last` alone
                    res.skips["no_context"] = res.skips.get("no_context", 0) + 1
                    self._decode_last(s, verify)
                    counts[q] = 0
                    continue
                plan = _StepPlan(out, k)
                draft = self._draft(s, plan)
                n_acc = 0
                if draft is None:
                    counts[q] = 0  # handed back, decoded plainly and handed over again
                else:
                    n_acc = counts[q] = self._verify_at(s, draft, verify)
                if self.record_timeline:
                    tl = res.timeline
                    tl["n_past"].append(s.n_past)
                    tl["max_pos"].append(int(plan.block_positions[-1]))
                    tl["rows"].append(0)
                    tl["rebase"].append(int(plan.rebase))
                    tl["drafted"].append(0 if draft is None else self.block_size)
                    tl["accepted"].append(n_acc)
            done = [s for s in active if len(s.out) >= n_generate]
            if done:  # finished: back on the host (their last verify rows confirmed)
                ids_done = [s.seq for s in done]
                self._st("to_host", ids_done, **self._hand)
                self._on_device.difference_update(ids_done)
                for s in done:
                    if self.stager.state(s.seq)["reservation_open"]:  # not after a failure's plain decode
                        self._st("confirm", s.seq)
                        self._st("accept", s.seq, counts[s.seq])
                    self._track_rows(s)
            active = [s for s in active if len(s.out) < n_generate]
            if progress is not None:
                progress(sum(min(len(s.out), n_generate) for s in states), total)
        return self._result(states, n_generate, iterations, time.perf_counter() - t0)
