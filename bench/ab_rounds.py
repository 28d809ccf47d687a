#!/usr/bin/env python3
"""A/B: the per-round cost of two dspark_core builds' Stager, timed alternately on this machine.

Used to show what a change to the binding or the core's call path costs (e.g.
moving every argument check into the core: no pre-check calls, no Python-side
protocol check). A round is a steady speculative step in protocol order::

    plan = st.draft(0, n_past); plan.rows; st.commit(0)
    st.process(0, positions, rows)       # B + 1 float32 rows
    st.accept(0, B // 2)

Each build is a Python interpreter that imports its own dspark_core (a venv per
build). The two run alternately, one short child process per measurement
(baseline, candidate, baseline, ...), so a shared machine's drift hits both
alike; the table gives each side's median microseconds per round and the
baseline / candidate speed ratio, per (feature dim, storage): a small D shows
the call overhead, a large one the data movement.

    python bench/ab_rounds.py --baseline OLD/bin/python --candidate NEW/bin/python

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Sequence

import _common  # bench/ is on sys.path when a script here runs

#: The child: best-of-`repeats` mean seconds per round, as JSON.
CHILD = r"""
import json, sys, time
import numpy as np
from dspark_core import Stager, StagerConfig
dim, storage, rounds, repeats = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
B, W = 16, 4096
st = Stager(StagerConfig(dim, B, W, storage=storage))
rng = np.random.default_rng(0)
verify = rng.standard_normal((B + 1, dim)).astype(np.float32)
st.process(0, np.arange(W // 2), rng.standard_normal((W // 2, dim)).astype(np.float32))
n_past = W // 2
def run(k):
    global n_past
    for _ in range(k):
        plan = st.draft(0, n_past)
        plan.rows
        st.commit(0)
        st.process(0, np.arange(n_past, n_past + B + 1), verify)
        st.accept(0, B // 2)
        n_past += B // 2 + 1
run(50)
best = float("inf")
for _ in range(repeats):
    t0 = time.perf_counter()
    run(rounds)
    best = min(best, (time.perf_counter() - t0) / rounds)
print(json.dumps(best))
"""

#: (feature dim, storage): the call overhead (small rows), and the data movement (a 27B target's rows).
CASES = ((256, "f32"), (256, "q8_0"), (25_600, "f32"), (25_600, "q8_0"))


def measure(python: str, dim: int, storage: str, rounds: int, repeats: int) -> float:
    res = subprocess.run([python, "-c", CHILD, str(dim), storage, str(rounds), str(repeats)],
                         check=True, capture_output=True, text=True)
    return float(json.loads(res.stdout.strip().splitlines()[-1]))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="python of the baseline build")
    ap.add_argument("--candidate", default=sys.executable, help="python of the candidate build (default: this one)")
    ap.add_argument("--rounds", type=int, default=2000, help="timed rounds per repeat (small D; / 20 at large D)")
    ap.add_argument("--repeats", type=int, default=3, help="timings per child (best kept)")
    ap.add_argument("--runs", type=int, default=7, help="alternating child runs per side (median kept)")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)

    times: dict[tuple[int, str], dict[str, list[float]]] = {c: {"baseline": [], "candidate": []} for c in CASES}
    for _ in range(args.runs):
        for case in CASES:
            rounds = args.rounds if case[0] < 4096 else max(50, args.rounds // 20)
            for side in ("baseline", "candidate"):
                py = args.baseline if side == "baseline" else args.candidate
                times[case][side].append(measure(py, case[0], case[1], rounds, args.repeats))
    rows = []
    for (dim, storage), t in times.items():
        b, c = _common.median(t["baseline"]), _common.median(t["candidate"])
        assert b is not None and c is not None
        rows.append([str(dim), storage, f"{b * 1e6:.2f}", f"{c * 1e6:.2f}", f"{b / c:.3f}"])
    lines = _common.header_lines(
        "A/B per-round cost (microseconds per steady round, median of alternating runs)",
        [f"B = 16, W = 4096, n_accepted = 8; {args.runs} runs x best of {args.repeats}; "
         f"{args.rounds} rounds per timing at D = 256 ({max(50, args.rounds // 20)} at D = 25600)"],
    )
    lines += _common.table(["feature dim", "storage", "baseline us", "candidate us", "speed: baseline / candidate"],
                           rows)
    _common.emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
