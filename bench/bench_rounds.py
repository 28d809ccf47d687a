#!/usr/bin/env python3
"""Per-round staging cost of dspark_core.Stager against its baselines, at several context depths.

A steady-state round is what a server does per speculative step, with the
Stager calls in protocol order (docs/design.md section 2)::

    plan = st.draft(seq, n_past)   # stage the rows committed since the cache end
    plan.rows                      # touch the staged rows: a view for f32 storage,
                                   # a decode to float32 for the other storages
    st.commit(seq)
    st.process(seq, [n_past .. n_past + B], rows)   # the verify batch: B + 1 float32 rows
    st.accept(seq, n)              # keeps n + 1 rows; n_past += n + 1

With a fixed accept count n (default B / 2) every steady round stages n + 1
rows. Rounds whose plan rebases (``plan.rebase``) are counted separately.

Depth = the target's n_past when the timed rounds start. It is reached by
beginning the sequence at origin p0 = max(0, depth - W) and processing the W
prompt rows [p0, depth) in 512-row process() calls from one reused array
(docs/design.md section 2: rows before p0 are simply unavailable). The core's bounded ingest
keeps only the rows a later round can stage (the newest K), so this leaves
the protocol state a full prefill from position 0 would (only the dead head
awaiting its lazy trim can differ, by < TRIM_CHUNK rows); ``--prefill
chunked`` feeds the whole prompt from position 0 instead, to check. The first round then rebases (it stages the newest
K = W/2 rows) like the first round after any long prompt, and the timed
rounds start after a few warm-up rounds. Depths below W simply have fewer rows.

Compared, per (feature dim D, storage, depth), each measured interleaved
(each pass runs every depth once in a random order, so machine noise hits every depth alike):

* core: dspark_core.Stager (C++).
* reference: dspark_core.reference.ReferenceStager (pure Python), same D and
  protocol. Its post-prefill state is loaded from the core's snapshot()
  (same format) because its own prefill encodes every prompt row in Python.
* naive: a numpy baseline that keeps the window's W rows (storage format) in
  one array, writes the B + 1 converted rows in, and every round gathers the
  whole window (min(n_past - p0, W) rows, position order, np.take) and decodes
  it: what staging the full context at absolute positions does, but bounded
  to the window (the full context would be depth rows: 12.5 GiB at 128k).
* memcpy round: np.copyto of the same float32 bytes in the same pattern
  and order (the n + 1 rows the previous round wrote out into a preallocated
  array, then B + 1 rows into a ring as large as the Stager's): the floor for
  this data movement.

Bytes per round are memcpy-equivalent bytes: each pass counts once, by its
larger side, so it is directly comparable with a memcpy's GB/s: convert
(B + 1) * D * 4 + staged copy n_rows * row_bytes + decode n_rows * D * 4
(non-f32 storage only). GB/s = bytes / median round time.

Rebase rounds: natural ones (every ~(W/2 - B) / (n + 1) rounds) are split off
from the steady rounds; more are induced with draft + fail() (the next round
then restages the newest K rows, exactly the work of a window-overflow rebase)
and timed as whole rounds. Amortised = steady + (rebase - steady) / cycle,
cycle = floor((W - B - K) / (n + 1)) + 1 rounds.

Slot: a server reuses a sequence slot for request after request, and the
Stager keeps a slot's ring across ``begin()``. So by default (``--slot
reused``) slot 0 first serves an earlier sequence until every slot of its ring
has been written, then ``begin(0)`` starts the measured one. With ``--slot
fresh`` each depth gets a new Stager: its first ~W / (n + 1) rounds write
into ring pages never touched before and pay their first-touch page faults
(one per 2 MiB huge page, far more on a VM whose memory the host backs
lazily); a young sequence at a shallow depth sees the most of them. The
"core faults/round" column shows the mean page faults per steady round.

Targets (docs/design.md section 6): steady per-round cost flat across depth
(max/min median <= 1.10) and round bandwidth >= 80% of the memcpy round. The
reference / core ratio is information, not a target: the reference is
vectorised numpy, so the ratio measures the reference as much as the core.

    python bench/bench_rounds.py --quick     # D = 25,600 only, short runs (< 1 min)
    python bench/bench_rounds.py             # D = 25,600 and 12,288, every storage (a few minutes)

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import _common as C

ds = C.import_dspark()
from dspark_core import Stager, StagerConfig, formats  # noqa: E402
from dspark_core.stager.config import TRIM_CHUNK  # noqa: E402
from dspark_core.reference import ReferenceStager  # noqa: E402

ns = time.perf_counter_ns


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

OPS = ("draft", "rows", "commit", "process", "accept")


@dataclass
class Rec:
    """One timed round."""

    total: int
    ops: dict[str, int]
    rebase: bool
    n_rows: int
    nbytes: int
    faults: int = 0  # minor page faults during the round (getrusage, outside the timed spans)


@dataclass
class Series:
    """Timed rounds of one runner."""

    steady: list[Rec] = field(default_factory=list)
    rebase: list[Rec] = field(default_factory=list)

    def add(self, r: Rec) -> None:
        (self.rebase if r.rebase else self.steady).append(r)

    @staticmethod
    def _t(rs: list[Rec], key: str | None = None) -> list[float]:
        return [r.total if key is None else (r.ops[key] if key != "stage" else r.ops["draft"] + r.ops["rows"])
                for r in rs]

    def med(self, key: str | None = None, rebase: bool = False) -> float | None:
        return C.median(self._t(self.rebase if rebase else self.steady, key))

    def p90(self, rebase: bool = False) -> float | None:
        return C.p90(self._t(self.rebase if rebase else self.steady))

    def bytes_med(self, rebase: bool = False) -> float | None:
        rs = self.rebase if rebase else self.steady
        return C.median([r.nbytes for r in rs])

    def faults_med(self, rebase: bool = False) -> float | None:
        rs = self.rebase if rebase else self.steady
        return C.median([r.faults for r in rs])

    def faults_mean(self) -> float:
        return sum(r.faults for r in self.steady) / len(self.steady) if self.steady else 0.0

    def rows_med(self, rebase: bool = False) -> float | None:
        rs = self.rebase if rebase else self.steady
        return C.median([r.n_rows for r in rs])


def round_bytes(cfg: StagerConfig, n_rows: int) -> int:
    """memcpy-equivalent bytes of one round (see the module docstring)."""
    d4 = cfg.feature_dim * 4
    b = (cfg.block_size + 1) * d4 + n_rows * cfg.row_bytes
    if cfg.storage != "f32":
        b += n_rows * d4
    return b


class StagerRunner:
    """Drives one sequence of a Stager or ReferenceStager through rounds."""

    def __init__(self, stager: Any, depth: int, x: np.ndarray, n_acc: int) -> None:
        self.st = stager
        self.cfg: StagerConfig = stager.config
        self.depth = depth
        self.n_past = depth
        self.x = x
        self.n_acc = n_acc
        self.offsets = np.arange(self.cfg.block_size + 1, dtype=np.int64)

    def prefill(self, mode: str, chunk_rows: np.ndarray) -> None:
        """Process the prompt rows [p0, depth) in chunks of one reused array (only positions matter).

        mode "origin": p0 = max(0, depth - W); "chunked": p0 = 0 (the whole prompt).
        """
        self.st.begin(0)
        p0 = max(0, self.depth - self.cfg.window) if mode == "origin" else 0
        ch = len(chunk_rows)
        for lo in range(p0, self.depth, ch):
            hi = min(self.depth, lo + ch)
            self.st.process(0, np.arange(lo, hi, dtype=np.int64), chunk_rows[: hi - lo])

    def _round(self, fail: bool = False) -> Rec:
        st, n_past = self.st, self.n_past
        f0 = minflt()
        t0 = ns()
        plan = st.draft(0, n_past)
        t1 = ns()
        _ = plan.rows
        t2 = ns()
        if fail:
            st.fail(0, "decode")
        else:
            st.commit(0)
        t3 = ns()
        pos = self.offsets + n_past
        t4 = ns()
        st.process(0, pos, self.x)
        t5 = ns()
        st.accept(0, self.n_acc)
        t6 = ns()
        f1 = minflt()
        if plan.skip is not None:
            raise RuntimeError(f"unexpected skip {plan.skip!r} at n_past={n_past}")
        self.n_past = n_past + self.n_acc + 1
        n = plan.n_rows
        return Rec(total=(t3 - t0) + (t6 - t4),
                   ops={"draft": t1 - t0, "rows": t2 - t1, "commit": t3 - t2, "process": t5 - t4,
                        "accept": t6 - t5},
                   rebase=bool(plan.rebase), n_rows=n, nbytes=round_bytes(self.cfg, n), faults=f1 - f0)

    def round(self) -> Rec:
        return self._round()

    def induced_rebase(self) -> Rec:
        """An untimed round that fails (the next round owes a clean restage), then the timed rebase round."""
        self._round(fail=True)
        r = self._round()
        if not r.rebase:
            raise RuntimeError("induced rebase did not rebase")
        return r


class NaiveRunner:
    """Re-copies the whole window every round (see the module docstring)."""

    def __init__(self, cfg: StagerConfig, depth: int, x: np.ndarray, n_acc: int, shared: dict[str, np.ndarray]):
        self.cfg = cfg
        self.n_acc = n_acc
        self.x = x
        W = cfg.window
        self.p0 = max(0, depth - W)
        self.n_past = depth
        self.ring = shared["ring"]          # (W, row_bytes) uint8, storage format
        self.gather = shared["gather"]      # (W, row_bytes) uint8
        self.decoded = shared["decoded"]    # (W, D) float32
        self.enc = formats.quantize_rows(x, cfg.storage)  # reused output of the convert pass
        self.enc_u8 = self.enc.view(np.uint8).reshape(len(x), cfg.row_bytes)
        self.offsets = np.arange(cfg.block_size + 1, dtype=np.int64)

    def round(self) -> Rec:
        c = self.cfg
        W = c.window
        n_past = self.n_past
        t0 = ns()
        # process: convert the verify rows, write them at their window slots
        formats.quantize_rows(self.x, c.storage, out=self.enc)
        self.ring[(self.offsets + n_past) % W] = self.enc_u8
        t1 = ns()
        # accept: the target kept n + 1 rows; the rest get overwritten later
        self.n_past = n_past = n_past + self.n_acc + 1
        # stage: gather the whole live window in position order (+ decode)
        live = min(n_past - self.p0, W)
        idx = np.arange(n_past - live, n_past, dtype=np.int64) % W
        g = self.gather[:live]
        np.take(self.ring, idx, axis=0, out=g)
        if c.storage != "f32":
            formats.dequantize_rows(g, c.storage, c.feature_dim, np.float32, out=self.decoded[:live])
        t2 = ns()
        return Rec(total=t2 - t0, ops={"process": t1 - t0, "draft": t2 - t1, "rows": 0, "commit": 0, "accept": 0},
                   rebase=False, n_rows=live, nbytes=round_bytes(c, live))


class MemcpyRunner:
    """np.copyto of a round's float32 bytes: B + 1 rows into a ring, n + 1 rows out."""

    def __init__(self, cfg: StagerConfig, x: np.ndarray, n_acc: int, rounds: int) -> None:
        self.cfg = cfg
        self.x = x
        self.n_acc = n_acc
        # As large as the Stager's largest ring, but only the slots the timed rounds reach are
        # allocated (and touched up front, so no page fault lands in a timed copy).
        rows = min(cfg.window + TRIM_CHUNK + cfg.block_size + 1, (rounds + 1) * (n_acc + 1) + len(x))
        self.ring = np.ones((rows, cfg.feature_dim), np.float32)
        self.out = np.empty((n_acc + 1, cfg.feature_dim), np.float32)
        self.slot = 0
        self.prev = 0  # where the previous round's rows start (the first round reads the ring's first rows)

    def round(self) -> Rec:
        b1 = len(self.x)
        if self.slot + b1 > len(self.ring):
            self.slot = 0
        s, prev = self.slot, self.prev
        t0 = ns()
        # In a core round's order: the draft stages the rows the previous round's
        # process wrote (other runners' rounds ran in between), then the process
        # writes this round's. Copying out the rows just written would read them
        # hot from L2, an advantage no staging round has.
        np.copyto(self.out, self.ring[prev: prev + self.n_acc + 1])
        t1 = ns()
        np.copyto(self.ring[s: s + b1], self.x)
        t2 = ns()
        self.prev, self.slot = s, s + self.n_acc + 1
        nbytes = (b1 + self.n_acc + 1) * self.cfg.feature_dim * 4
        return Rec(total=t2 - t0, ops={"process": t2 - t1, "draft": t1 - t0, "rows": 0, "commit": 0, "accept": 0},
                   rebase=False, n_rows=self.n_acc + 1, nbytes=nbytes)


def interleave(runners: list[Any], n: int, fn: str = "round", seed: int = 0) -> list[Series]:
    """n timed calls of runner.<fn>() per runner: in each pass every runner once, in a fresh random order.

    Random (not rotating) order, so that no runner always follows the same one: what ran just before
    (its cache and allocator footprint) measurably changes a round's time (a fixed order put a 25% bias
    on whichever runner followed the memcpy round).
    """
    out = [Series() for _ in runners]
    order = np.arange(len(runners))
    rng = np.random.default_rng(seed)
    for _ in range(n):
        rng.shuffle(order)
        for idx in order:
            out[idx].add(getattr(runners[idx], fn)())
    return out


@dataclass
class ConfigResult:
    D: int
    storage: str
    row_bytes: int
    depths: list[int]
    core: list[Series]
    ref: list[Series | None]
    naive: list[Series | None]
    memcpy: Series
    core_rebase: list[Series]
    ref_rebase: Series | None
    memcpy_hot_gbps: float
    memcpy_big_gbps: float
    seconds: float


def warm_slot(st: Any, x: np.ndarray, n_acc: int, chunk_rows: np.ndarray) -> int:
    """Serve an earlier sequence in slot 0 until its whole ring is resident, then ``begin(0)``.

    What a server's slot looks like after its first request. Returns the rounds it took.
    """
    r = StagerRunner(st, len(chunk_rows), x, n_acc)
    r.prefill("origin", chunk_rows)
    cap = (st.config.window + TRIM_CHUNK + st.config.block_size + 1) * st.config.row_bytes
    limit = 4 * cap // (len(x) * st.config.row_bytes) + 16  # each round writes len(x) = B + 1 rows
    for n in range(limit):
        if st.stats(0)["bytes"] >= cap:
            st.begin(0)
            return n
        r.round()
    raise RuntimeError(f"slot 0's ring was not fully written after {limit} rounds: {st.stats(0)}")


def run_config(D: int, storage: str, a: argparse.Namespace, log: Any) -> ConfigResult:
    t_start = time.perf_counter()
    cfg = StagerConfig(D, a.block_size, a.window, storage=storage)
    rng = np.random.default_rng(a.seed)
    x = rng.standard_normal((a.block_size + 1, D), dtype=np.float32)
    x[:, rng.choice(D, 8, replace=False)] *= 100.0  # a few massive channels, as real captures have
    chunk_rows = np.resize(x, (a.chunk, D))  # prompt rows: only their positions matter

    # ---- core (+ memcpy round, interleaved) -------------------------------
    core_runners = []
    snaps = []
    for d in a.depths:
        st = Stager(cfg)
        if a.slot == "reused":
            warm_slot(st, x, a.accept, chunk_rows)
        r = StagerRunner(st, d, x, a.accept)
        r.prefill(a.prefill, chunk_rows)
        if not a.no_reference:
            snaps.append(r.st.snapshot(0) if a.ref_depths is None or d in a.ref_depths else None)
        core_runners.append(r)
    for r in core_runners:  # the first round (rebase / whole prompt) + warm-up
        for _ in range(1 + a.warmup):
            r.round()
    mem = MemcpyRunner(cfg, x, a.accept, a.rounds + a.warmup)
    for _ in range(a.warmup):
        mem.round()
    series = interleave(core_runners + [mem], a.rounds)
    core, mem_s = series[:-1], series[-1]
    core_rebase = interleave(core_runners, a.rebases, "induced_rebase") if a.rebases else [Series() for _ in a.depths]
    for s, rb in zip(core, core_rebase):  # natural rebases seen in the steady run count too
        rb.rebase.extend(s.rebase)
    hot = C.memcpy_gbps((a.block_size + 1) * D * 4, 30)
    big = C.memcpy_gbps(64 << 20, 5)
    del core_runners, mem
    gc.collect()
    log(f"  core done ({time.perf_counter() - t_start:.1f}s)")

    # ---- reference ----------------------------------------------------------
    ref: list[Series | None] = [None] * len(a.depths)
    ref_rebase = None
    if not a.no_reference:
        runners, idxs, firsts = [], [], []
        for i, (d, snap) in enumerate(zip(a.depths, snaps)):
            if snap is None:
                continue
            rs = ReferenceStager(cfg)
            rs.restore(0, snap)
            rr = StagerRunner(rs, d, x, a.accept)
            first = rr.round()  # restore() owes a clean restage: a K-row rebase, kept as a rebase sample
            for _ in range(a.ref_warmup):
                rr.round()
            runners.append(rr)
            idxs.append(i)
            firsts.append(first)
        snaps.clear()
        for i, s in zip(idxs, interleave(runners, a.ref_rounds)):
            ref[i] = s
        if runners:
            ref_rebase = Series()
            ref_rebase.rebase.append(firsts[-1])
            if a.ref_rebases:
                ref_rebase.rebase.extend(interleave([runners[-1]], a.ref_rebases, "induced_rebase")[0].rebase)
            ref_rebase.rebase.extend(ref[idxs[-1]].rebase)  # type: ignore[union-attr]
        del runners
        gc.collect()
        log(f"  reference done ({time.perf_counter() - t_start:.1f}s)")

    # ---- naive ----------------------------------------------------------------
    naive: list[Series | None] = [None] * len(a.depths)
    if a.naive_rounds:
        W = cfg.window
        enc = formats.quantize_rows(x, storage).view(np.uint8).reshape(len(x), cfg.row_bytes)
        shared = {
            "ring": np.resize(enc, (W, cfg.row_bytes)),  # finite rows in storage format (values don't matter)
            "gather": np.empty((W, cfg.row_bytes), np.uint8),
            "decoded": np.empty((W if storage != "f32" else 0, D), np.float32),
        }
        runners = [NaiveRunner(cfg, d, x, a.accept, shared) for d in a.depths]
        runners[-1].round()  # warm-up (page faults of the shared arrays)
        naive = list(interleave(runners, a.naive_rounds))
        del runners, shared
        gc.collect()
        log(f"  naive done ({time.perf_counter() - t_start:.1f}s)")

    return ConfigResult(D, storage, cfg.row_bytes, list(a.depths), core, ref, naive, mem_s, core_rebase,
                        ref_rebase, hot, big, time.perf_counter() - t_start)


# -- report -----------------------------------------------------------------------


def cycle_rounds(a: argparse.Namespace) -> int:
    K = min(a.window // 2, a.window - a.block_size)
    return (a.window - a.block_size - K) // (a.accept + 1) + 1


def report(results: list[ConfigResult], a: argparse.Namespace, wall: float) -> tuple[list[str], dict[str, Any]]:
    K = min(a.window // 2, a.window - a.block_size)
    cyc = cycle_rounds(a)
    lines = C.header_lines(
        "Per-round staging cost (bench_rounds.py)",
        [
            f"B = {a.block_size}, W = {a.window} (K = {K} rows kept on a rebase), accept n = {a.accept} per round "
            f"(stages n + 1 = {a.accept + 1} rows), stage dtype float32, seq 0 of a 1-sequence Stager",
            ("slot: reused (slot 0 served an earlier sequence until its whole ring was written, then begin(0))"
             if a.slot == "reused" else "slot: fresh (a new Stager per depth; its rounds first-touch the ring)"),
            "depth reached by: prompt rows [p0, depth) in "
            f"{a.chunk}-row process() calls, p0 = {'max(0, depth - W)' if a.prefill == 'origin' else '0'}",
            f"timed: {a.rounds} steady rounds per depth after {a.warmup} warm-up (core), {a.ref_rounds} (reference"
            f"{', depths ' + ', '.join(C.fmt_size(d) for d in a.ref_depths) if a.ref_depths else ''}), "
            f"{a.naive_rounds} (naive); rebases: {a.rebases} induced per depth (core), the first round after "
            f"restore(){f' + {a.ref_rebases} induced' if a.ref_rebases else ''} (reference, deepest depth); "
            "depths interleaved (each pass runs every depth once, in random order); "
            "times are medians (p90 where shown), perf_counter_ns",
            f"rebase cycle: one rebase every {cyc} rounds at this accept count; "
            f"amortised = steady + (rebase - steady) / {cyc}",
            f"total wall time {wall:.0f} s",
        ],
    )
    summary: dict[str, Any] = {"script": "bench_rounds", "targets": [], "wall_s": wall}
    targets = summary["targets"]

    for D in sorted({r.D for r in results}, reverse=True):
        rs = [r for r in results if r.D == D]
        lines += [f"### D = {D:,} ({fmt_row_bytes(D)})", ""]
        lines += ["Steady-state rounds (us per round; ratios are reference / core and naive / core):", ""]
        rows = []
        for r in rs:
            for i, d in enumerate(r.depths):
                c = r.core[i]
                cm = c.med()
                rf = r.ref[i]
                rm = rf.med() if rf else None
                nv = r.naive[i]
                nm = nv.med() if nv else None
                rb = r.core_rebase[i].med(rebase=True)
                amort = cm + (rb - cm) / cyc if (cm is not None and rb is not None) else None
                rows.append([
                    r.storage, C.fmt_size(d), C.fmt_us(cm), C.fmt_us(c.p90()), C.fmt_us(c.med("stage")),
                    C.fmt_us(rm), C.fmt_x(rm / cm if rm and cm else None),
                    C.fmt_us(nm), C.fmt_x(nm / cm if nm and cm else None),
                    C.fmt_us(rb), f"{r.core_rebase[i].rows_med(rebase=True) or 0:.0f}", C.fmt_us(amort),
                    f"{c.faults_mean():,.2f}",
                ])
        lines += C.table(
            ["storage", "depth", "core", "core p90", "core draft+rows", "reference", "ref/core", "naive", "naive/core", "core rebase", "rebase rows", "core amortised",
             "core faults/round (mean)"],
            rows, "llrrrrrrrrrrr")
        lines.append("")

        # bandwidth
        lines += ["Bandwidth (memcpy-equivalent bytes per steady round / median time; memcpy round = same float32 "
                  "bytes by np.copyto in the same pattern, interleaved with the core rounds):", ""]
        rows = []
        for r in rs:
            for i, d in enumerate(r.depths):
                c = r.core[i]
                cm, nb = c.med(), c.bytes_med()
                gb = nb / cm if cm and nb else None
                mg = r.memcpy.bytes_med() / r.memcpy.med()  # type: ignore[operator]
                pct = gb / mg if gb else None
                rows.append([r.storage, C.fmt_size(d), C.fmt_bytes(nb or 0), f"{gb:.2f}" if gb else "-",
                             f"{mg:.2f}", f"{100 * pct:.0f}%" if pct else "-",
                             C.verdict(None if pct is None else pct >= a.min_bw),
                             f"{r.memcpy_hot_gbps:.2f}", f"{r.memcpy_big_gbps:.2f}"])
        lines += C.table(["storage", "depth", "bytes/round", "core GB/s", "memcpy round GB/s", "core/memcpy",
                          f">= {100 * a.min_bw:.0f}%", f"memcpy hot {a.block_size + 1}x{D} f32 GB/s",
                          "memcpy 64 MiB GB/s"], rows, "llrrrrlrr")
        lines.append("")

        # where the time goes (deepest depth)
        i = len(rs[0].depths) - 1
        dd = rs[0].depths[i]
        lines += [f"Where the time goes at depth {C.fmt_size(dd)} (median us per call in a steady round; "
                  f"process = convert B + 1 rows, draft = plan + copy the staged rows, rows = decode on access):", ""]
        rows = []
        for r in rs:
            for name, s in (("core", r.core[i]), ("reference", r.ref[i])):
                if s is None or not s.steady:
                    continue
                rows.append([r.storage, name] + [C.fmt_us(s.med(op)) for op in OPS] + [C.fmt_us(s.med()),
                                                                                         f"{s.faults_med():.0f}"])
        m = rs[0].memcpy
        rows.append(["(f32 bytes)", "memcpy round", C.fmt_us(m.med("draft")), "-", "-", C.fmt_us(m.med("process")),
                     "-", C.fmt_us(m.med()), "-"])
        lines += C.table(["storage", "impl", *OPS, "round", "page faults/round"], rows, "llrrrrrrr")
        lines += ["", "(memcpy round: draft = copy out the n + 1 rows the previous round wrote, process = copy B + 1 rows "
                  "into the ring.)", ""]

        # rebase rounds: core vs reference
        if any(r.ref_rebase for r in rs):
            lines += [f"Rebase rounds at depth {C.fmt_size(dd)} (us; restage K rows):", ""]
            rows = []
            for r in rs:
                cr = r.core_rebase[i].med(rebase=True)
                rr = r.ref_rebase.med(rebase=True) if r.ref_rebase else None
                rf = r.ref_rebase.faults_med(rebase=True) if r.ref_rebase else None
                rows.append([r.storage, C.fmt_us(cr), C.fmt_us(r.core_rebase[i].med("stage", rebase=True)),
                             f"{r.core_rebase[i].faults_med(rebase=True) or 0:,.0f}",
                             C.fmt_us(rr), "-" if rf is None else f"{rf:,.0f}",
                             C.fmt_x(rr / cr if rr and cr else None)])
            lines += C.table(["storage", "core rebase", "core draft+rows", "core page faults", "reference rebase",
                              "reference page faults", "ref/core"], rows, "lrrrrrr")
            lines.append("")

        # targets
        rows = []
        for r in rs:
            meds = [s.med() for s in r.core]
            flat = max(meds) / min(meds) if all(meds) and len(meds) > 1 else None
            ratios = [rf.med() / s.med() for s, rf in zip(r.core, r.ref) if rf and rf.steady and s.med()]
            bws = [(s.bytes_med() / s.med()) / (r.memcpy.bytes_med() / r.memcpy.med()) for s in r.core]
            t_flat = None if flat is None else flat <= 1 + a.flat_tol
            t_bw = min(bws) >= a.min_bw
            rows.append([r.storage,
                         f"{flat:.3f}" if flat else "-", C.verdict(t_flat),
                         C.fmt_x(min(ratios)) if ratios else "-",
                         f"{100 * min(bws):.0f}%", C.verdict(t_bw)])
            for name, val, high, thr, ok in (
                    ("flat across depth (max/min steady median)", flat, None, 1 + a.flat_tol, t_flat),
                    ("round bandwidth / memcpy round (min over depths)", min(bws), max(bws), a.min_bw, t_bw)):
                targets.append({"D": D, "storage": r.storage, "target": name, "value": val, "high": high,
                                "threshold": thr, "pass": ok})
        lines += [f"Targets, D = {D:,} (depths {', '.join(C.fmt_size(d) for d in rs[0].depths)}):", ""]
        lines += C.table(["storage", f"max/min over depth (<= {1 + a.flat_tol:.2f})", "flat",
                          "min ref/core (information)", "min core/memcpy", f">= {100 * a.min_bw:.0f}%"],
                         rows, "lrlrrl")
        lines.append("")
    summary["configs"] = [
        {"D": r.D, "storage": r.storage, "depths": r.depths, "seconds": r.seconds,
         "core_steady_ns": [s.med() for s in r.core], "core_p90_ns": [s.p90() for s in r.core],
         "core_rebase_ns": [s.med(rebase=True) for s in r.core_rebase],
         "ref_steady_ns": [s.med() if s else None for s in r.ref],
         "naive_ns": [s.med() if s else None for s in r.naive],
         "bytes": [s.bytes_med() for s in r.core],
         "memcpy_round_gbps": r.memcpy.bytes_med() / r.memcpy.med(),  # type: ignore[operator]
         "memcpy_hot_gbps": r.memcpy_hot_gbps, "memcpy_64mib_gbps": r.memcpy_big_gbps}
        for r in results
    ]
    return lines, summary


def fmt_row_bytes(D: int) -> str:
    parts = []
    for s in formats.STORAGES:
        try:
            parts.append(f"{s} {C.fmt_bytes(formats.row_bytes(s, D))}")
        except Exception:  # noqa: BLE001 - q formats need D % 32 == 0
            pass
    return "row: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="CI-sized run: D = 25,600 only, depths 1k,32k,128k, fewer rounds (well under a minute)")
    ap.add_argument("--dims", type=C.parse_list, default=None,
                    help="feature dims D, comma-separated (default 25600,12288; --quick 25600)")
    ap.add_argument("--depths", type=C.parse_list, default=None,
                    help="context depths (target n_past), comma-separated "
                         "(default 1k,8k,32k,128k; --quick 1k,32k,128k)")
    ap.add_argument("--storages", default=",".join(formats.STORAGES),
                    help=f"storage dtypes, comma-separated (default all: {','.join(formats.STORAGES)})")
    ap.add_argument("--block-size", type=int, default=16, help="drafter block size B (default 16)")
    ap.add_argument("--window", type=C.parse_size, default=4096, help="drafter window W (default 4096)")
    ap.add_argument("--accept", type=int, default=None, help="n_accepted every round (default B // 2)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed steady rounds per depth, core (default 600; quick 100)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed warm-up rounds after the first round (default 5)")
    ap.add_argument("--rebases", type=int, default=None,
                    help="induced rebase rounds per depth, core (default 6; quick 2)")
    ap.add_argument("--ref-rounds", type=int, default=None,
                    help="timed rounds per depth, reference (default 40; quick 10)")
    ap.add_argument("--ref-warmup", type=int, default=2, help="untimed reference warm-up rounds (default 2)")
    ap.add_argument("--ref-rebases", type=int, default=0,
                    help="extra induced rebase rounds of the reference at its deepest depth (default 0: its first "
                         "round after restore() is a K-row rebase and is the sample)")
    ap.add_argument("--ref-depths", type=C.parse_list, default=None,
                    help="depths at which to run the reference (default: all; --quick: the shallowest and deepest)")
    ap.add_argument("--no-reference", action="store_true", help="skip the pure-Python reference")
    ap.add_argument("--naive-rounds", type=int, default=None,
                    help="timed rounds per depth of the naive whole-window baseline (default 5; quick 1; 0 = none)")
    ap.add_argument("--prefill", choices=("origin", "chunked"), default="origin",
                    help="how depth is reached: 'origin' begins at p0 = depth - W (default, instant); "
                         "'chunked' processes the whole prompt from 0 in --chunk rows (slower, same state)")
    ap.add_argument("--slot", choices=("reused", "fresh"), default="reused",
                    help="'reused' (default): slot 0 first serves an earlier sequence that writes its whole ring, "
                         "as a server's slots after their first request; 'fresh': a new Stager per depth, whose "
                         "rounds pay the ring's first-touch page faults")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk rows for --prefill chunked (default 512)")
    ap.add_argument("--min-bw", type=float, default=0.8, help="target fraction of the memcpy round (default 0.8)")
    ap.add_argument("--flat-tol", type=float, default=0.10, help="allowed max/min - 1 across depths (default 0.10)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed of the rows (default 0)")
    ap.add_argument("--out", default=None, help="also write the markdown report to this file")
    ap.add_argument("--json", default=None, help="write raw medians and target verdicts as JSON to this file")
    a = ap.parse_args(argv)

    q = a.quick
    a.dims = a.dims or ([25600] if q else [25600, 12288])
    a.storages = [s.strip() for s in a.storages.split(",") if s.strip()]
    bad = [s for s in a.storages if s not in formats.STORAGES]
    if bad:
        ap.error(f"unknown storage(s) {bad}; use {formats.STORAGES}")
    a.accept = a.block_size // 2 if a.accept is None else a.accept
    if not 0 <= a.accept <= a.block_size:
        ap.error("--accept must be in [0, B]")
    a.rounds = a.rounds or (100 if q else 600)
    a.rebases = (2 if q else 6) if a.rebases is None else a.rebases
    a.ref_rounds = a.ref_rounds or (10 if q else 40)
    a.naive_rounds = (1 if q else 5) if a.naive_rounds is None else a.naive_rounds
    a.depths = sorted(set(a.depths or C.parse_list("1k,32k,128k" if q else "1k,8k,32k,128k")))
    if a.ref_depths is None and q:
        a.ref_depths = [a.depths[0], a.depths[-1]]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    results = []
    for D in a.dims:
        for s in a.storages:
            log(f"D={D} storage={s} ...")
            results.append(run_config(D, s, a, log))
    lines, summary = report(results, a, time.perf_counter() - t0)
    C.emit(lines, a.out)
    C.write_json(a.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
