#!/usr/bin/env python3
"""A/B: the encode throughput of two dspark_core builds, timed alternately on this machine.

Used to show what a change to the conversion kernels costs (e.g. the fused
overflow check: ``|x| < limit`` instead of an exponent test). Each build is
a Python interpreter that imports its own dspark_core (a venv per build).
The two are run alternately, one short child process per measurement
(baseline, candidate, baseline, ...), so a shared machine's drift hits both
alike; the table gives each side's median GB/s (float32 side of the
conversion) and the candidate / baseline ratio per storage.

    python bench/ab_convert.py --baseline OLD/bin/python --candidate NEW/bin/python
    python bench/ab_convert.py --baseline OLD/bin/python --call no-out   # quantize_rows(x, st)

``--call out`` (default) times ``quantize_rows(x, st, out=o)`` (under the
default ``nonfinite="error"`` that call checks the input before writing
``o``, so that a rejected call leaves it untouched); ``--call no-out`` times
the allocating call, whose check stays fused in the single conversion pass.

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Sequence

import _common  # bench/ is on sys.path when a script here runs

STORAGES = ("f16", "bf16", "q8_0", "q4_0")

#: The child: best-of-`repeats` encode time per storage, as JSON {storage: seconds}.
CHILD = r"""
import json, sys, time
import numpy as np
from dspark_core import formats
rows, dim, repeats, path, call = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
pol = sys.argv[6]
rng = np.random.default_rng(0)
x = rng.standard_normal((rows, dim)).astype(np.float32)
x[:, 7] *= 3000.0  # a massive channel, still encodable everywhere
out = {}
with formats.simd_path(path):
    for st in %r:
        o = formats.quantize_rows(x, st)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            formats.quantize_rows(x, st, nonfinite=pol, out=o) if call == "out" else formats.quantize_rows(x, st, nonfinite=pol)
            best = min(best, time.perf_counter() - t0)
        out[st] = best
print(json.dumps(out))
""" % (STORAGES,)


def measure(python: str, rows: int, dim: int, repeats: int, path: str, call: str, pol: str) -> dict[str, float]:
    res = subprocess.run([python, "-c", CHILD, str(rows), str(dim), str(repeats), path, call, pol],
                         check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="python of the baseline build")
    ap.add_argument("--candidate", default=sys.executable, help="python of the candidate build (default: this one)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--dim", type=int, default=25_600)
    ap.add_argument("--repeats", type=int, default=5, help="timings per child (best kept)")
    ap.add_argument("--rounds", type=int, default=7, help="alternating child runs per side (median kept)")
    ap.add_argument("--path", default=_common.simd_path().split()[0], help="SIMD path for both (scalar, avx2, avx512)")
    ap.add_argument("--call", choices=("out", "no-out"), default="out",
                    help="time quantize_rows into a preallocated out= (default) or allocating")
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--nonfinite", default="error",
                    help="policy of the timed call; 'keep' times the one-pass kernel alone (no out= guarantee)")
    args = ap.parse_args(argv)

    times: dict[str, dict[str, list[float]]] = {"baseline": {}, "candidate": {}}
    for _ in range(args.rounds):
        for side in ("baseline", "candidate"):
            py = args.baseline if side == "baseline" else args.candidate
            for st, t in measure(py, args.rows, args.dim, args.repeats, args.path, args.call, args.nonfinite).items():
                times[side].setdefault(st, []).append(t)
    gb = args.rows * args.dim * 4 / 1e9
    rows = []
    for st in STORAGES:
        b = _common.median(times["baseline"][st])
        c = _common.median(times["candidate"][st])
        assert b is not None and c is not None
        rows.append([st, f"{gb / b:.2f}", f"{gb / c:.2f}", f"{b / c:.3f}"])
    lines = _common.header_lines(
        "A/B encode throughput (GB/s of float32 input, median of alternating runs)",
        [f"rows x dim: {args.rows} x {args.dim}; SIMD path: {args.path}; "
         f"{args.rounds} rounds x best of {args.repeats}; call: {args.call}, nonfinite={args.nonfinite}"],
    )
    lines += _common.table(["storage", "baseline GB/s", "candidate GB/s", "candidate / baseline"], rows)
    _common.emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
