#!/usr/bin/env python3
"""Threads on distinct sequences: 2 threads against 1, steady held-mode rounds.

Each sequence has its own lock in the core and the binding releases the GIL
around every call that moves rows, so two threads working on two different
sequences of one Stager should run in parallel. Held mode, D = 25,600 (the
row width of a large target), B = 16, W = 4,096; two sequences, each
prefilled, then steady rounds (after a warm-up that wraps each ring)::

    plan = st.draft(seq, n_past); st.commit(seq)
    st.process(seq, verify_positions, verify_rows)   # B + 1 float32 rows
    st.accept(seq, 3)

with the staged rows copied out (``draft``) or handed over as views of the
ring (``draft(seq, n_past, copy=False)``: "zero-copy", so a rebase moves no
W/2 rows);

* 1 thread: the rounds of both sequences, one after the other;
* 2 threads: one thread per sequence, the same rounds, started together;

each from Python threads (the GIL released while rows are copied) and
from C threads through the C ABI (bench/threads_floor.c, compiled here
against the installed SDK: the core without the interpreter); for f32 also
the rounds' copies alone, without the core ("bytes alone": the ceiling the
machine's shared memory system puts on 2 threads moving these bytes; with
zero-copy drafts, only the verify rows' copy into the ring).

The threads are pinned, each to a CPU of its own (the 1-thread runs to the
first; ``--no-pin`` leaves them to the scheduler): in a trial of tens of
milliseconds the scheduler's first placement of two freshly woken threads,
often both on the waker's CPU until a load balance moves one, would be
measured instead of the rounds (milliseconds of start skew on this VM).

A trial runs each sequence for one rebase period (REBASE_PERIOD rounds, one
W/2-row rebase each): every trial holds the same work, so no ratio compares
a trial that rebased with one that did not. A rebase copies W/2 rows (200 MB
of f32 rows) and is bound by memory bandwidth, which the two cores share; on
a server two sequences rebase at the same moment only by chance, so the
target is measured with the sequences half a rebase period apart
("staggered"), and the table also shows them in step ("aligned": both
threads rebase at once, the worst case).

Throughput = rounds / wall time (2 threads: from the first worker's start to
the last one's end); the table gives the median over trials of each, and the
ratio 2 threads / 1 thread (target >= 1.7x on 2 cores), for f32 and q8_0
storage. The machine is shared: the load average is printed. The threads'
CPU time per round and their CPU share (CPU / wall / threads) tell
contention (CPU per round rises: here, the memory system both cores share)
from missing cores or waiting (the share falls).

    python bench/bench_threads.py
    python bench/bench_threads.py --quick --json

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import _common as C

ds = C.import_dspark()
from bench_step import build_c_program  # noqa: E402
from dspark_core import Stager, StagerConfig  # noqa: E402
from dspark_core.stager.config import STORAGES  # noqa: E402

HERE = Path(__file__).resolve().parent
D, B, W = 25600, 16, 4096
ACCEPT = 3
SEQS = (0, 1)
# Rounds between two rebases of a sequence: a rebase keeps min(W/2, W - B)
# rows, and the next comes once start - pos_base + B > W (509 rounds here).
KEEP = min(W // 2, W - B)
REBASE_PERIOD = (W - KEEP - B) // (ACCEPT + 1) + 1
# The two sequences' offset in rounds: half a rebase period (the target's
# layout), or none (both rebase at once).
LAYOUTS = (("staggered", REBASE_PERIOD // 2), ("aligned", 0))
BYTES_ALONE = "bytes alone (C)"
ZERO_COPY = ", zero-copy"


class Pair:
    """Two sequences of one held-mode Stager in steady rounds (each with its own verify rows)."""

    def __init__(self, storage: str, prefill: int, stagger: int) -> None:
        self.st = Stager(StagerConfig(feature_dim=D, block_size=B, window=W, storage=storage, max_seqs=len(SEQS)))
        rng = np.random.default_rng(1)
        self.verify = rng.standard_normal((B + 1, D), dtype=np.float32)
        self.verify[:, 7] = 3.0e3  # a massive channel
        pre = rng.standard_normal((prefill, D), dtype=np.float32)
        pre[0] *= 40.0  # a huge-norm first row
        self.n_past = {}
        for q in SEQS:
            self.st.process(q, np.arange(prefill), pre)
            self.n_past[q] = prefill
        # Warm-up until each ring has wrapped: steady rounds touch no new page (first touches
        # would be page faults, serialised in the kernel, not the Stager's work); the second
        # sequence `stagger` rounds further.
        warm = self.st.ring_rows // (ACCEPT + 1) + 16
        for i, q in enumerate(SEQS):
            self.rounds(q, warm + i * stagger)

    def rounds(self, seq: int, k: int, copy: bool = True) -> None:
        st, n_past, verify = self.st, self.n_past[seq], self.verify
        for _ in range(k):
            st.draft(seq, n_past, copy)
            st.commit(seq)
            st.process(seq, np.arange(n_past, n_past + B + 1), verify)
            st.accept(seq, ACCEPT)
            n_past += ACCEPT + 1
        self.n_past[seq] = n_past


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order (all of them where affinity is not supported)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin(cpus: set[int] | None) -> None:
    """Restrict the calling thread to ``cpus`` (Linux: pid 0 is the calling thread); None: no-op."""
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


@dataclass
class Trial:
    rounds_per_s: float
    cpu_us_per_round: float  # CPU time of the threads running rounds (time.thread_time), per round
    cpu_share: float  # that CPU time / (wall time x threads): < 1 when the threads did not get their cores


def one_thread(pair: Pair, k: int, cpus: list[int] | None, copy: bool) -> Trial:
    saved = allowed_cpus()
    pin({cpus[0]} if cpus else None)
    try:
        t0, c0 = time.perf_counter(), time.thread_time()
        for q in SEQS:
            pair.rounds(q, k, copy)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    finally:
        pin(set(saved) if cpus else None)
    n = len(SEQS) * k
    return Trial(n / wall, cpu / n * 1e6, cpu / wall)


def two_threads(pair: Pair, k: int, cpus: list[int] | None, copy: bool) -> Trial:
    go = threading.Barrier(len(SEQS))
    cpu = [0.0] * len(SEQS)
    span = [(0.0, 0.0)] * len(SEQS)

    def work(i: int, q: int) -> None:
        pin({cpus[i]} if cpus else None)
        go.wait()
        t0, c0 = time.perf_counter(), time.thread_time()
        pair.rounds(q, k, copy)
        cpu[i] = time.thread_time() - c0
        span[i] = (t0, time.perf_counter())

    threads = [threading.Thread(target=work, args=(i, q)) for i, q in enumerate(SEQS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # From the first worker's start to the last one's end (on 2 cores a third,
    # timing thread may run late and miss the start).
    wall = max(e for _, e in span) - min(s for s, _ in span)
    n = len(SEQS) * k
    return Trial(n / wall, sum(cpu) / n * 1e6, sum(cpu) / (wall * len(SEQS)))


def c_threads(exe: Path, storage: str, k: int, trials: int, stagger: int,
              cpus: list[int] | None, mode: str) -> tuple[list[Trial], list[Trial]]:
    """The same rounds through the C ABI from C threads (threads_floor.c): no interpreter, no GIL.

    ``mode``: "copy" or "view" (the draft), or "bytes" / "bytes-view": the rounds' copies
    alone, without the core (f32 only).
    """
    out = subprocess.run([str(exe), str(STORAGES.index(storage)), str(D), str(B), str(W), str(ACCEPT), str(k),
                          str(trials), str(stagger), *[str(c) for c in (cpus or [-1, -1])], mode],
                         check=True, capture_output=True, text=True).stdout
    by: dict[str, list[Trial]] = {"1": [], "2": []}
    for line in out.split("\n"):
        if line.strip():
            t, wall, cpu = line.split()
            n = len(SEQS) * k
            by[t].append(Trial(n / (int(wall) / 1e9), int(cpu) / 1e3 / n, int(cpu) / int(wall) / int(t)))
    return by["1"], by["2"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storages", default="f32,q8_0")
    ap.add_argument("--rounds", type=int, default=REBASE_PERIOD,
                    help=f"rounds per sequence per trial (default {REBASE_PERIOD}: one rebase period)")
    ap.add_argument("--trials", type=int, default=7, help="trials of each (alternating 1 and 2 threads)")
    ap.add_argument("--quick", action="store_true", help="3 trials")
    ap.add_argument("--no-pin", action="store_true", help="leave the threads to the scheduler (default: one CPU each)")
    ap.add_argument("--drafts", default="copy,zero-copy",
                    help="how the rounds draft: copy (draft), zero-copy (draft(copy=False)), or both (default)")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="one JSON record per storage: on stdout instead of the table (no PATH), or into PATH "
                         "with the targets, the table still printed (bench/run_all.py)")
    args = ap.parse_args()
    if args.quick:
        args.trials = 3
    drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    if not drafts or set(drafts) - {"copy", "zero-copy"}:
        ap.error(f"--drafts: copy and / or zero-copy, got {args.drafts!r}")
    allowed = allowed_cpus()
    cpus = None if args.no_pin or len(allowed) < len(SEQS) or not hasattr(os, "sched_setaffinity") \
        else allowed[: len(SEQS)]
    load_before = os.getloadavg()[0]
    records: list[dict[str, Any]] = []

    def record(storage: str, layout: str, way: str, one: list[Trial], two: list[Trial], draft: str) -> None:
        def med(ts: list[Trial], field: str) -> float:
            return float(np.median([getattr(t, field) for t in ts]))

        ratios = [b.rounds_per_s / a.rounds_per_s for a, b in zip(one, two)]
        records.append({"storage": storage, "sequences": layout, "way": way + (ZERO_COPY if draft != "copy" else ""),
                        "draft": draft, "feature_dim": D, "rounds_per_trial": 2 * args.rounds,
                        "trials": args.trials, "one_thread_rounds_per_s": med(one, "rounds_per_s"),
                        "two_threads_rounds_per_s": med(two, "rounds_per_s"),
                        "ratio": med(two, "rounds_per_s") / med(one, "rounds_per_s"),
                        "median_trial_ratio": float(np.median(ratios)),
                        "one_thread_cpu_us_per_round": med(one, "cpu_us_per_round"),
                        "two_threads_cpu_us_per_round": med(two, "cpu_us_per_round"),
                        "one_thread_cpu_share": med(one, "cpu_share"),
                        "two_threads_cpu_share": med(two, "cpu_share")})

    with tempfile.TemporaryDirectory() as tmp:
        exe = build_c_program(HERE / "threads_floor.c", Path(tmp))
        for storage in [s.strip() for s in args.storages.split(",") if s.strip()]:
            for layout, stagger in LAYOUTS:
                for draft in drafts:
                    copy = draft == "copy"
                    pair = Pair(storage, prefill=64, stagger=stagger)
                    one: list[Trial] = []
                    two: list[Trial] = []
                    for _ in range(args.trials):  # alternate, so load drifts hit both alike
                        one.append(one_thread(pair, args.rounds, cpus, copy))
                        two.append(two_threads(pair, args.rounds, cpus, copy))
                    del pair
                    record(storage, layout, "Python threads", one, two, draft)
                    record(storage, layout, "C threads",
                           *c_threads(exe, storage, args.rounds, args.trials, stagger, cpus,
                                      "copy" if copy else "view"), draft)
                    if storage == "f32":  # the memory system's ceiling for these bytes
                        record(storage, layout, BYTES_ALONE,
                               *c_threads(exe, storage, args.rounds, args.trials, stagger, cpus,
                                          "bytes" if copy else "bytes-view"), draft)
    load_after = os.getloadavg()[0]
    if args.json == "-":
        for r in records:
            print(json.dumps(r))
        return 0
    targets = [{"target": "2 threads on distinct sequences >= 1.7x one thread's rounds/s",
                "where": f"held, D = {D:,}, {r['storage']}, {r['way']}", "value": r["ratio"],
                "pass": r["ratio"] >= 1.7, "text": f"{r['ratio']:.2f}x"}
               for r in records if r["way"].startswith("Python threads") and r["sequences"] == LAYOUTS[0][0]]
    C.write_json(args.json, {"records": records, "targets": targets, "load": [load_before, load_after]})
    lines = C.header_lines(
        "Threads on distinct sequences: steady held-mode rounds, 2 threads vs 1",
        [f"D = {D}, B = {B}, W = {W}, accept {ACCEPT}; {len(SEQS)} sequences of one Stager; "
         f"{args.trials} trials of {2 * args.rounds} rounds",
         f"cores: {os.cpu_count()}; load average (1 min) {load_before:.2f} before, {load_after:.2f} after",
         f"threads: {'pinned to CPUs ' + ', '.join(map(str, cpus)) if cpus else 'placed by the scheduler'}"])
    lines += C.table(["storage", "sequences", "way", "1 thread (rounds/s)", "2 threads (rounds/s)", "2 / 1", "median trial 2 / 1",
                      "target >= 1.7x", "CPU us / round, 1 / 2 threads", "CPU share, 1 / 2 threads"],
                     [[r["storage"], r["sequences"], r["way"], f"{r['one_thread_rounds_per_s']:.0f}", f"{r['two_threads_rounds_per_s']:.0f}",
                       C.fmt_x(r["ratio"], 2), C.fmt_x(r["median_trial_ratio"], 2),
                       "-" if r["way"].startswith(BYTES_ALONE)
                       else C.verdict(r["ratio"] >= 1.7) if r["sequences"] == LAYOUTS[0][0] else "(worst case)",
                       f"{r['one_thread_cpu_us_per_round']:.0f} / {r['two_threads_cpu_us_per_round']:.0f}",
                       f"{r['one_thread_cpu_share']:.2f} / {r['two_threads_cpu_share']:.2f}"]
                      for r in records])
    lines += ["",
              "Sequences: staggered, half a rebase period apart (the target's layout: on a server two sequences",
              "rebase at once only by chance); aligned, in step, so both threads copy a rebase's W/2 rows at once.",
              "CPU us / round: the threads' own CPU time per round (equal for 1 and 2 threads when the threads do",
              "not contend: no lock spinning, no shared cache lines, memory bandwidth to spare). CPU share: that",
              "CPU time / (wall x threads); below 1 the threads were waiting for a core (other load), for each",
              "other or (Python) for the GIL, and the throughput ratio is bounded by it.",
              "C threads: the same rounds through the C ABI from two C threads (bench/threads_floor.c, no",
              "interpreter, no GIL): what the core itself gives two threads on this machine at this moment.",
              "Bytes alone (f32): the rounds' copies without the core (B + 1 rows into a ring, the staged rows",
              "out of it, a rebase's rows streamed past the cache as the core streams them), from two C threads:",
              "the ratio this machine's memory system allows for this many bytes, the ceiling of the other rows.",
              "Zero-copy: the rounds draft with draft(seq, n_past, copy=False) (the C ABI's dspark_draft_view):",
              "the staged rows are views of the ring, so no round copies them and a rebase moves no W/2 rows;",
              "bytes alone then copies only the verify rows into the ring."]
    C.emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
