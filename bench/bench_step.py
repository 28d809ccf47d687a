#!/usr/bin/env python3
"""One server step for N sequences: per-sequence Python calls, batched Python calls, and the C floor.

A continuous-batching server runs one scheduler step for every active
sequence at once. The step here, for N sequences (D = 8,192, B = 16,
W = 4,096, q8_0 storage, 3 of the 16 drafted tokens accepted)::

    process the B verify rows of every sequence   (held: bf16 rows; external: slots)
    accept 3 of them
    draft at the new end                           (held: the staged rows copied out,
                                                    or handed out as views: "zero-copy")
    commit

three ways, in the same run, on the same Stager configuration:

* ``per-seq``: one Python call per sequence and step (``process``,
  ``accept``, ``draft``, ``commit``), as the API was before the batch calls;
* ``batched``: ``process_many``, ``accept_many``, ``draft_many``,
  ``commit_many`` (flat arrays, one call each);
* ``C floor``: the same batch calls through the C ABI from a small C
  program (bench/step_floor.c, compiled here against the installed
  package's SDK): the core's own work, no interpreter.

Both Python ways compute their step's positions the same way (one numpy
expression over all sequences; per-seq slices it). The table gives the
median step time, its ratio to the floor and to per-seq, the median draft
phase (draft_many against a loop of draft; held mode also with zero-copy
drafts, copy=False, both ways), and the batched step's cost per
sequence (flat in N when the batched path does no per-sequence Python work).
``--json``: one record per (N, mode, way) with the median step in us and the
phase medians.

    python bench/bench_step.py                # N = 1, 16, 64, 256, 1024; both modes
    python bench/bench_step.py --quick        # fewer steps, N up to 256
    python bench/bench_step.py --json

Targets (issue "batched server steps"): at N = 256 in external mode the
batched Python step within 2x of the C floor and >= 10x faster than
per-seq; the batched cost linear in N; draft_many never slower than a loop
of draft (zero-copy: draft_many(copy=False) than a loop of draft(copy=False)).
Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import _common as C

ds = C.import_dspark()
from dspark_core import Stager, StagerConfig  # noqa: E402

HERE = Path(__file__).resolve().parent
FLOOR_SOURCE = HERE / "step_floor.c"
D, B, W = 8192, 16, 4096
STORAGE = "q8_0"
STORAGE_CODE = 3  # DSPARK_STORAGE_Q8_0
ACCEPT = 3
PHASES = ("process", "accept", "draft", "commit")
WAYS = ("per-seq", "batched", "C floor")
#: Held mode only: the same Python ways with zero-copy drafts (draft(copy=False) /
#: draft_many(copy=False): the staged rows handed out as views of the rings).
ZERO_COPY_WAYS = ("per-seq, zero-copy", "batched, zero-copy")
#: At small N a step takes microseconds, and a first few slow steps (a fresh
#: Stager's buffers still growing) or a second's disturbance would move a
#: median of 20: every (N, mode, way) times and warms up at least this many
#: sequence-steps (steps x N; --quick: a quarter).
MIN_TIMED_SEQUENCE_STEPS = 256
MIN_WARMUP_SEQUENCE_STEPS = 64


def ways_of(mode: str) -> tuple[str, ...]:
    return WAYS + ZERO_COPY_WAYS if mode == "held" else WAYS

try:
    import ml_dtypes

    BF16: Any = ml_dtypes.bfloat16
except ImportError:  # the rows are then float32: more bytes for every way alike
    BF16 = np.float32


def build_c_program(source: Path, out_dir: Path) -> Path:
    """Compiles a C program of bench/ against the installed package's C SDK (as docs/c_api.md builds one)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    exe = out_dir / source.stem
    lib = ds.get_library_dir()  # the shared core: found at run time through the run path
    cmd = [cc, "-O2", "-std=c99", str(source), f"-I{ds.get_include()}", f"-L{lib}", f"-Wl,-rpath,{lib}",
           "-ldspark_core", "-lstdc++", "-lm", "-lpthread", "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def run_floor(exe: Path, mode: str, n: int, warmup: int, steps: int) -> dict[str, list[int]]:
    """The C program's per-step ns, by phase."""
    bf16 = BF16 is not np.float32
    if not bf16:
        raise SystemExit("bench_step.py needs ml_dtypes (bf16 rows, as the C floor takes them)")
    out = subprocess.run([str(exe), mode, str(n), str(D), str(B), str(W), str(STORAGE_CODE), str(ACCEPT),
                          str(warmup), str(steps)], check=True, capture_output=True, text=True).stdout
    cols: dict[str, list[int]] = {k: [] for k in ("step", *PHASES)}
    for line in out.split("\n"):
        if line.strip():
            for k, v in zip(cols, line.split()):
                cols[k].append(int(v))
    return cols


def python_way(mode: str, n: int, batched: bool, warmup: int, steps: int, copy: bool = True,
               kind: str = "block") -> dict[str, list[int]]:
    """Per-step ns by phase of the Python calls: one call per sequence, or the batch calls
    (``copy=False``: zero-copy drafts, held mode; ``kind="chain"``: a chain drafter's Stager,
    every row with its token id, bench_chain.py)."""
    cfg = StagerConfig(feature_dim=D, block_size=B, window=W, storage=STORAGE, max_seqs=n, rows=mode, kind=kind)
    chain = kind == "chain"
    st = Stager(cfg)
    external = mode == "external"
    seqs = np.arange(n, dtype=np.int64)
    ids = seqs.tolist()
    cu = np.arange(0, n * B + 1, B, dtype=np.int64)
    block = np.arange(B, dtype=np.int64)
    rng = np.random.default_rng(0)
    # The verify rows of all sequences (and, past them, one prefill's): bf16, a massive channel.
    rows = all_rows = None
    if not external:
        all_rows = rng.standard_normal((n * B + B + 1, D), dtype=np.float32).astype(BF16)
        all_rows[:, 3] = 1.0e4
        rows = all_rows[: n * B]
    # Prefill B + 1 rows and one round per sequence, as the C floor does.
    pre = np.arange(B + 1, dtype=np.int64)
    pre_ids = (pre % 32000).astype(np.int32) if chain else None
    for q in ids:
        if all_rows is None:
            st.process(q, pre, tokens=pre_ids)
        else:
            st.process(q, pre, all_rows[n * B:], tokens=pre_ids)
    n_past = np.full(n, B + 1, dtype=np.int64)
    st.draft_many(seqs, n_past)
    st.commit_many(seqs)
    acc = np.full(n, ACCEPT, dtype=np.int64)
    cols: dict[str, list[int]] = {k: [] for k in ("step", *PHASES)}
    clock = time.perf_counter_ns
    for t in range(warmup + steps):
        # The verify batch's ids (a chain drafter's): the server holds them, so not timed.
        tok = ((n_past[:, None] + block).ravel() % 32000).astype(np.int32) if chain else None
        t0 = clock()
        pos = (n_past[:, None] + block).ravel()
        if batched:
            if external:
                st.process_many(seqs, cu, pos, tokens=tok)
            else:
                st.process_many(seqs, cu, pos, rows, tokens=tok)
            t1 = clock()
            st.accept_many(seqs, acc)
            n_past += ACCEPT + 1
            t2 = clock()
            st.draft_many(seqs, n_past, copy)
            t3 = clock()
            st.commit_many(seqs)
        else:
            for i in ids:
                t_i = None if tok is None else tok[i * B:(i + 1) * B]
                if rows is None:
                    st.process(i, pos[i * B:(i + 1) * B], tokens=t_i)
                else:
                    st.process(i, pos[i * B:(i + 1) * B], rows[i * B:(i + 1) * B], tokens=t_i)
            t1 = clock()
            for i in ids:
                st.accept(i, ACCEPT)
            n_past += ACCEPT + 1
            t2 = clock()
            for i, p in zip(ids, n_past.tolist()):
                st.draft(i, p, copy)
            t3 = clock()
            for i in ids:
                st.commit(i)
        t4 = clock()
        if t >= warmup:
            for k, v in zip(cols, (t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                cols[k].append(v)
    del st
    return cols


def find(records: list[dict[str, Any]], n: int, mode: str, way: str) -> dict[str, Any]:
    return next(r for r in records if r["n"] == n and r["mode"] == mode and r["way"] == way)


def step_targets(records: list[dict[str, Any]], ns: list[int], modes: list[str]) -> list[dict[str, Any]]:
    """The issue's targets, each with the figures it rests on (bench/run_all.py summarises them)."""
    out: list[dict[str, Any]] = []

    def med(n: int, mode: str, way: str, key: str = "median_step_us") -> float:
        return float(find(records, n, mode, way)[key])

    if 256 in ns and "external" in modes:
        b, f, p = (med(256, "external", w) for w in ("batched", "C floor", "per-seq"))
        out.append({"target": "batched Python step within 2x of the C floor", "where": "N = 256, external",
                    "value": b / f, "pass": b / f <= 2.0, "text": f"{b / f:.2f}x the floor"})
        out.append({"target": "batched Python step >= 10x faster than per-sequence calls",
                    "where": "N = 256, external", "value": p / b, "pass": p / b >= 10.0,
                    "text": f"{p / b:.1f}x faster"})
    for mode in modes:
        big = [x for x in ns if x >= 64]
        # Held mode: encoding the rows is the step (the ways agree within the noise), so the
        # difference to the floor is noise; the linearity target is external mode's.
        if mode == "external" and len(big) >= 2:
            # No per-sequence Python work: what the batched calls add to the core's own work
            # (batched - floor) per sequence does not grow with N (1.5x slack for noise).
            lo, hi = big[0], big[-1]
            a, z = ((med(x, mode, "batched") - med(x, mode, "C floor")) / x for x in (lo, hi))
            out.append({"target": "batched step linear in N: Python's cost over the floor per sequence does not grow",
                        "where": f"{mode}, N = {lo} .. {hi}", "value": z * 1e3, "pass": z <= 1.5 * max(a, 0.0),
                        "text": f"{a * 1e3:.0f} ns -> {z * 1e3:.0f} ns per sequence"})
        for suffix in ("", ", zero-copy") if mode == "held" else ("",):
            worst = max((med(n, mode, "batched" + suffix, "median_draft_us")
                         / med(n, mode, "per-seq" + suffix, "median_draft_us"), n) for n in ns)
            what = "draft_many(copy=False) never slower than a loop of draft(copy=False)" if suffix else \
                "draft_many never slower than a loop of draft"
            out.append({"target": what, "where": f"{mode}, every N", "value": worst[0], "pass": worst[0] <= 1.0,
                        "text": f"worst draft_many / loop {worst[0]:.2f} (N = {worst[1]})"})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="1,16,64,256,1024", help="sequence counts N (comma separated)")
    ap.add_argument("--modes", default="external,held", help="row modes: external, held")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per (N, mode, way); at small N at least "
                    f"{MIN_TIMED_SEQUENCE_STEPS} / N")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (buffer pool, first touches); at small N at least "
                    f"{MIN_WARMUP_SEQUENCE_STEPS} / N")
    ap.add_argument("--quick", action="store_true", help="N up to 256, 5 timed steps")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="one JSON record per (N, mode, way): on stdout instead of the table (no PATH), "
                         "or into PATH with the targets, the table still printed (bench/run_all.py)")
    args = ap.parse_args()
    ns = C.parse_list(args.ns)
    min_timed, min_warmup = MIN_TIMED_SEQUENCE_STEPS, MIN_WARMUP_SEQUENCE_STEPS
    if args.quick:
        ns = [x for x in ns if x <= 256]
        args.steps, args.warmup = min(args.steps, 7), min(args.warmup, 5)
        min_timed, min_warmup = min_timed // 4, min_warmup // 4
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    load_before = os.getloadavg()[0]

    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_c_program(FLOOR_SOURCE, Path(tmp))
        for mode in modes:
            for n in ns:
                # Held mode at large N moves n * B rows of D per step through
                # every way: fewer steps there (the medians still compare).
                big = mode == "held" and n > 256
                steps = max(3, args.steps // 4) if big else max(args.steps, -(-min_timed // n))
                warmup = min(args.warmup, 2) if big else max(args.warmup, -(-min_warmup // n))
                runs = {
                    "C floor": run_floor(exe, mode, n, warmup, steps),
                    "batched": python_way(mode, n, True, warmup, steps),
                    "per-seq": python_way(mode, n, False, warmup, steps),
                }
                if mode == "held":
                    runs["batched, zero-copy"] = python_way(mode, n, True, warmup, steps, copy=False)
                    runs["per-seq, zero-copy"] = python_way(mode, n, False, warmup, steps, copy=False)
                for way in ways_of(mode):
                    cols = runs[way]
                    rec: dict[str, Any] = {"n": n, "mode": mode, "way": way, "steps": steps,
                                           "median_step_us": float(np.median(cols["step"])) / 1e3}
                    for ph in PHASES:
                        rec[f"median_{ph}_us"] = float(np.median(cols[ph])) / 1e3
                    records.append(rec)
    load_after = os.getloadavg()[0]

    targets = step_targets(records, ns, modes)
    if args.json == "-":
        for r in records:
            print(json.dumps(r))
        return 0
    C.write_json(args.json, {"records": records, "targets": targets, "load": [load_before, load_after]})

    def get(n: int, mode: str, way: str) -> dict[str, Any]:
        return find(records, n, mode, way)

    lines = C.header_lines(
        "One server step: per-sequence Python calls, batched Python calls, the C floor",
        [f"D = {D}, B = {B}, W = {W}, storage {STORAGE}, accept {ACCEPT} of {B}; held rows bf16",
         f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after; medians of the timed steps",
         "C floor: bench/step_floor.c, the C ABI's batch calls from C, built against the installed SDK"])
    rows_out = []
    for mode in modes:
        for n in ns:
            floor, per = get(n, mode, "C floor"), get(n, mode, "per-seq")
            for way in ways_of(mode):
                r = get(n, mode, way)
                rows_out.append([
                    mode, n, way, C.fmt_us(r["median_step_us"] * 1e3),
                    C.fmt_x(r["median_step_us"] / floor["median_step_us"], 2),
                    C.fmt_x(per["median_step_us"] / r["median_step_us"]),
                    C.fmt_us(r["median_draft_us"] * 1e3),
                    f"{r['median_step_us'] / n * 1e3:.0f} ns"])
    lines += C.table(["mode", "N", "way", "step (us)", "x floor", "per-seq / way", "draft phase (us)",
                      "step / sequence"],
                     rows_out)
    lines.append("")
    lines += [f"- {t['target']} ({t['where']}): {t['text']} {C.verdict(t['pass'])}" for t in targets]
    C.emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
