#!/usr/bin/env python3
"""A batched speculative-decoding server: one scheduler step for every active sequence.

A continuous-batching server (vLLM, SGLang, llama-server with many slots)
runs one step for all its sequences at once. This loop does the same over
one ``dspark_core.Stager`` with the batch calls, one call per step each:

* requests arrive at different steps with different prompts and lengths;
  a free slot takes the next one: its prompt is prefilled (``process_many``
  of all the prompts admitted this step, rows flat with ``cu_seqlens``);
* each step: ``draft_many`` for every active sequence (a :class:`BatchPlan`
  of arrays: the drafter batch is read off its CSR rows), the drafter
  decodes each sequence, ``commit_many`` / ``fail_many`` (injected drafter
  failures), one verify forward of the target for every sequence
  (``[last, d_1 .. d_B]``, or ``last`` alone when the round skipped or
  failed) and ``process_many`` of its rows, then ``accept_many``;
* a request forks (``fork``: a second answer to the same prefix, its own
  continuation), one request is aborted with its round open, and every
  request that finishes calls ``end_many``, which frees its slot's rows.

``--rows external``: the Stager holds no row bytes; this loop owns a numpy
table of ``max_seqs * ring_rows`` rows, writes each verify row at the slot
``process_many`` hands out, reads the drafter's rows at the plan's slots, and
applies the copies ``fork`` returns.

``--zero-copy`` (held rows): ``draft_many(..., copy=False)`` hands the drafter
batch over as read-only views of the Stager's rings (``plan.row_runs``, each
sequence's at ``plan.run_offsets``), so a rebase's ``W / 2`` rows are not
copied; the loop reads them before the verify rows are processed.

The fake target and drafter are those of examples/minimal_server.py (no model
files). Every staged row is checked against the target's row at that
absolute position, and every request's output against the target's own
greedy decoding (lossless).

    python examples/batched_server.py
    python examples/batched_server.py --rows external --storage q8_0
    python examples/batched_server.py --zero-copy --storage q8_0

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import numpy as np
from minimal_server import BLOCK, MASK, VOCAB, WINDOW, D, DrafterError, FakeDrafter, FakeTarget, greedy

from dspark_core import Stager, StagerConfig

SLOTS = 6  # sequences served at once (max_seqs)


@dataclass
class Request:
    rid: int
    arrival: int  # the step it arrives at
    prompt: list[int]
    generate: int
    fork_at: int = -1  # generated tokens after which it forks (-1: never)
    fork_edit: list[int] = field(default_factory=list)  # the fork's own new tokens
    abort_at: int = -1  # generated tokens after which it is aborted (-1: never)


@dataclass
class Slot:
    """A sequence slot serving one request."""

    req: Request
    target: FakeTarget
    drafter: FakeDrafter
    prefix: list[int]  # what the target saw before generating (the greedy reference's input)
    n_past: int = 0
    last: int = -1
    out: list[int] = field(default_factory=list)
    forked: bool = False


@dataclass
class Counters:
    steps: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    failures: int = 0
    skips: int = 0
    forks: int = 0
    aborted: int = 0
    finished: int = 0
    lossless: int = 0
    max_rel_err: float = 0.0
    max_batch: int = 0


class BatchedServer:
    def __init__(self, storage: str, rows: str, fail_every: int, zero_copy: bool = False) -> None:
        self.cfg = StagerConfig(feature_dim=D, block_size=BLOCK, window=WINDOW, storage=storage, rows=rows,
                                max_seqs=SLOTS, strict=True)
        self.st = Stager(self.cfg)
        self.external = rows == "external"
        self.zero_copy = zero_copy
        # External rows: the owner's table, one ring of ring_rows rows per slot.
        self.table = np.zeros((SLOTS * self.st.ring_rows if self.external else 0, D), np.float32)
        self.fail_every = fail_every
        self.slots: dict[int, Slot] = {}
        self.c = Counters()

    # -- rows in and out -------------------------------------------------------
    def put_rows(self, seqs: list[int], cu: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> None:
        """process_many of one forward's rows (flat); external: write them at their slots."""
        if self.external:
            slots = self.st.process_many(seqs, cu, positions)
            keep = slots >= 0  # -1: below the horizon, no round can stage it
            self.table[slots[keep]] = rows[keep]
        else:
            self.st.process_many(seqs, cu, positions, rows)

    def plan_rows(self, plan) -> np.ndarray:
        """The drafter batch's context rows (CSR, plan.row_offsets) as float32."""
        if self.external:
            return self.table[plan.slots]
        if plan.zero_copy:  # the runs, views of the rings, laid end to end in the drafter's buffer
            out = np.empty((len(plan.positions), D), np.float32)
            at = 0
            for run in plan.row_runs:
                out[at: at + len(run)] = run
                at += len(run)
            return out
        return np.asarray(plan.rows, np.float32)

    # -- the scheduler ---------------------------------------------------------
    def admit(self, waiting: list[Request], step: int) -> None:
        """Free slots take the requests that have arrived; their prompts are prefilled in one call."""
        new: list[int] = []
        for req in [r for r in waiting if r.arrival <= step]:
            free = [s for s in range(SLOTS) if s not in self.slots]
            if not free:
                break
            waiting.remove(req)
            target = FakeTarget()
            slot = Slot(req, target, FakeDrafter(target.embedding, self.fail_every), list(req.prompt))
            self.slots[free[0]] = slot
            new.append(free[0])
        if not new:
            return
        outs = [self.slots[s].target.decode(self.slots[s].req.prompt) for s in new]
        cu = np.cumsum([0] + [len(o.rows) for o in outs])
        positions = np.concatenate([np.arange(len(o.rows)) for o in outs])
        self.put_rows(new, cu, positions, np.concatenate([o.rows for o in outs]))
        for s, o in zip(new, outs):
            self.slots[s].n_past = len(o.rows)
            self.slots[s].last = o.next_tokens[-1]
            self.slots[s].out = [self.slots[s].last]

    def fork(self, src: int) -> None:
        """A second answer to src's prefix in a free slot, with its own new tokens (an edit).

        The Stager, the target's KV cache and the drafter's cache are copied;
        the child then prefills its edit and generates its own continuation.
        """
        free = [s for s in range(SLOTS) if s not in self.slots]
        if not free:
            return
        dst, parent = free[0], self.slots[src]
        moves = self.st.fork(src, dst)
        if self.external:  # apply the copies, in order
            for a, b, k in moves.tolist():
                self.table[b:b + k] = self.table[a:a + k]
        target = FakeTarget()
        target.tokens = list(parent.target.tokens)  # positions [0, n_past)
        drafter = FakeDrafter(target.embedding, self.fail_every)
        drafter.cache = dict(parent.drafter.cache)
        edit = parent.req.fork_edit
        child = Slot(Request(-parent.req.rid, -1, [], parent.req.generate), target, drafter,
                     prefix=target.tokens + edit, n_past=parent.n_past)
        out = target.decode(edit)
        self.put_rows([dst], np.array([0, len(edit)]), np.arange(child.n_past, child.n_past + len(edit)), out.rows)
        child.n_past += len(edit)
        child.last = out.next_tokens[-1]
        child.out = [child.last]
        self.slots[dst] = child
        parent.forked = True
        self.c.forks += 1

    def check_rows(self, plan, rows: np.ndarray, i: int, target: FakeTarget) -> None:
        lo, hi = int(plan.row_offsets[i]), int(plan.row_offsets[i + 1])
        if hi == lo:
            return
        want = target.rows_at(int(plan.pos_base[i]) + plan.positions[lo:hi].astype(np.int64))
        err = np.abs(rows[lo:hi] - want) / np.maximum(np.abs(want), 1e-30)
        self.c.max_rel_err = max(self.c.max_rel_err, float(err.max()))

    def step(self) -> list[int]:
        """One scheduler step for every active sequence; returns the slots whose request finished."""
        st, c = self.st, self.c
        seqs = sorted(self.slots)
        c.steps += 1
        c.max_batch = max(c.max_batch, len(seqs))
        plan = st.draft_many(seqs, [self.slots[s].n_past for s in seqs], copy=not self.zero_copy)
        rows = self.plan_rows(plan)
        drafts: dict[int, list[int]] = {}
        ok: list[int] = []
        failed: list[tuple[int, str]] = []
        aborted: list[int] = []
        for i, s in enumerate(seqs):
            slot = self.slots[s]
            if not plan.active[i]:
                c.skips += 1
                continue
            if slot.req.abort_at >= 0 and len(slot.out) >= slot.req.abort_at:
                aborted.append(s)  # the client went away mid-round: its round stays open
                continue
            c.rounds += 1
            self.check_rows(plan, rows, i, slot.target)
            lo, hi = int(plan.row_offsets[i]), int(plan.row_offsets[i + 1])
            d = slot.drafter
            try:
                if plan.clear_cache[i]:
                    d.remove()
                drafts[s] = d.decode(rows[lo:hi], plan.positions[lo:hi], [slot.last] + [MASK] * (BLOCK - 1),
                                     plan.block_positions[i])
                d.remove(int(plan.crop_from[i]))
                ok.append(s)
            except DrafterError as e:
                failed.append((s, e.stage))
        st.commit_many(ok)
        st.fail_many([s for s, _ in failed], [stage for _, stage in failed])
        c.failures += len(failed)
        if aborted:  # end drops the open round and frees the rows
            st.end_many(aborted)
            for s in aborted:
                del self.slots[s]
            c.aborted += len(aborted)
        # One verify forward for every remaining sequence.
        seqs = sorted(self.slots)
        outs = []
        for s in seqs:
            slot = self.slots[s]
            outs.append(slot.target.decode([slot.last, *drafts[s]] if s in drafts else [slot.last]))
        cu = np.cumsum([0] + [len(o.rows) for o in outs])
        positions = np.concatenate([np.arange(self.slots[s].n_past, self.slots[s].n_past + len(o.rows))
                                    for s, o in zip(seqs, outs)])
        self.put_rows(seqs, cu, positions, np.concatenate([o.rows for o in outs]))
        n_acc = []
        for s, o in zip(seqs, outs):
            slot = self.slots[s]
            n = 0
            if s in drafts:
                while n < BLOCK and drafts[s][n] == o.next_tokens[n]:
                    n += 1
                c.drafted += BLOCK
                c.accepted += n
                slot.target.rollback(slot.n_past + n + 1)
                slot.out += drafts[s][:n]
            n_acc.append(n)
            slot.n_past += n + 1
            slot.last = o.next_tokens[n]
            slot.out.append(slot.last)
        st.accept_many(seqs, n_acc)  # keeps the rows of last, d_1 .. d_n (a single row: itself)
        # Forks, then finished requests.
        for s in seqs:
            slot = self.slots[s]
            if slot.req.fork_at >= 0 and not slot.forked and len(slot.out) >= slot.req.fork_at:
                self.fork(s)
        done = [s for s in sorted(self.slots) if len(self.slots[s].out) >= self.slots[s].req.generate]
        return done

    def finish(self, done: list[int]) -> bool:
        """end_many for the finished requests; True when each one's output is the target's greedy decoding."""
        ok = True
        self.st.end_many(done)
        for s in done:
            slot = self.slots.pop(s)
            n = slot.req.generate
            good = slot.out[:n] == greedy(slot.prefix, n)
            ok = ok and good
            self.c.finished += 1
            self.c.lossless += good
        return ok


def requests(rng: np.random.Generator, n: int) -> list[Request]:
    out = []
    for rid in range(n):
        prompt = [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(8, 150)))]
        r = Request(rid, arrival=3 * rid, prompt=prompt, generate=int(rng.integers(30, 160)))
        if rid == 1:
            r.fork_at, r.fork_edit = 20, [int(t) for t in rng.integers(0, VOCAB, 3)]
        if rid == 4:
            r.abort_at = 25
        out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage", default="bf16", choices=("f32", "f16", "bf16", "q8_0", "q4_0"))
    ap.add_argument("--rows", default="held", choices=("held", "external"))
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--fail-every", type=int, default=7, help="fail every N-th decode of each drafter (0: never)")
    ap.add_argument("--zero-copy", action="store_true",
                    help="held rows: draft_many(copy=False), the drafter batch as views of the rings")
    a = ap.parse_args(argv)
    if a.zero_copy and a.rows == "external":
        ap.error("--zero-copy needs held rows (external rows are read from this loop's own table)")

    srv = BatchedServer(a.storage, a.rows, a.fail_every, a.zero_copy)
    waiting = requests(np.random.default_rng(2), a.requests)
    print(f"batched_server: storage={a.storage} rows={a.rows}{' zero-copy' if a.zero_copy else ''} D={D} "
          f"B={BLOCK} W={WINDOW}, {SLOTS} slots, {a.requests} requests")
    ok = True
    step = 0
    while waiting or srv.slots:
        srv.admit(waiting, step)
        if srv.slots:
            ok = srv.finish(srv.step()) and ok
        step += 1
    c = srv.c
    print(f"{c.steps} steps, up to {c.max_batch} sequences per step, {c.rounds} drafter rounds, acceptance "
          f"{100 * c.accepted / max(1, c.drafted):.1f}%, {c.failures} drafter failures recovered, {c.skips} skips")
    print(f"{c.forks} fork, {c.aborted} aborted with a round open, {c.finished} requests finished "
          f"({c.lossless} equal to the target's greedy decoding)")
    print(f"staged rows vs the target's rows: max relative error {c.max_rel_err:.3g}")
    # The Stager's own metrics (totals over every request it served) against this loop's counts.
    t = srv.st.totals()
    counted = t.stats["verified_rounds"] == c.drafted // BLOCK and t.stats["accepted_tokens"] == c.accepted
    hist = " ".join(f"{k}:{n}" for k, n in enumerate(t.accepted.tolist()))
    print(f"metrics: {t.stats['verified_rounds']} verified rounds, accepted drafts per round {hist}; "
          f"equal to this loop's counts: {'yes' if counted else 'NO'}")
    freed = all(srv.st.stats(s)["reserved_bytes"] == 0 for s in range(SLOTS))
    print(f"every slot's rows freed at the end: {'yes' if freed else 'NO'}")
    # External rows sit in this loop's float32 table and f32 storage keeps them as they are: exact.
    exact = a.rows == "external" or a.storage == "f32"
    ok = ok and counted and freed and c.forks == 1 and c.aborted == 1 and c.failures > 0 and (c.max_rel_err == 0 or not exact)
    print(f"lossless: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
