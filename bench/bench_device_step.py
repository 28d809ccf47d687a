#!/usr/bin/env python3
"""The device step against the host path: the same per-step work, with and without the host sync.

One speculative step of N external-row sequences (D = 8,192, B = 16, W = 4,096,
q8_0 storage; the sampler's accept counts random in 0..B, the same ones both
ways), two ways, in the same run, on the same Stager configuration:

* ``host path``: ``confirm_many``, ``accept_many``, ``draft_many``,
  ``commit_many``, ``reserve_many`` (flat arrays, one call each). A GPU server
  must first copy the sampler's accept counts to the host (one host
  synchronisation per step) and launch its drafter only after the plan
  came back from the host;
* ``device step (CPU twin)``: ``step_many`` (one call, GIL released), the
  host twin of the CUDA kernel, which does the same work from the counts
  where they are: no host synchronisation, one launch per step
  (csrc/tests/test_cuda_step.cpp counts it on the emulated device);
* ``device step + padded rows``: the same, also writing the graph-safe
  padded gather slots and positions ([N, W - B] each, -1 padding: a fixed
  shape for a captured graph), which the host path's plans do not hold;
* ``host path + padded rows``: the host path plus ``BatchPlan.padded`` into
  fixed buffers (the same padded answers: the baseline of the row above);
* ``device step + padded rows, capacity 2N``: the padded step through one
  ``StepOutputs`` of twice the batch (a graph captured for 2N entries serving N:
  the N entries past the batch are padding, ``STEP_NOT_IN_STEP``), what a
  fixed-capacity server pays for its headroom;
* ``device step + CSR rows``: the unpadded step, then ``step_rows`` (the CSR
  rows of the batch: ``row_offsets`` and the flat slots and positions, a gather
  of one call; the layout a server without the padded arrays gathers from),
  and the same through capacity 2N (``device step + CSR rows, capacity 2N``).

Besides ``x host path``, the table gives each device way's ratio to the unpadded
device step of the same N, measured in the same run (``x unpadded step``: what
the padded layout, the CSR rows and the fixed capacity cost on top of the step).

The table gives the median step time, the ratio of the two, the host
synchronisations and kernel launches a GPU server's step needs each way. Target
(issue "the step never waits for the host"): the CPU twin at N = 256 within
1.5x of the host path (the same work); and, with the padded rows both ways,
``device step + padded rows`` within 1.5x of ``host path + padded rows``. Step time on a GPU, with and without the
sync: ``device step (CUDA graph)`` (dspark_core.cuda.DeviceStep captured into a
graph, one replay per step) against ``host path + count copy`` (the host path
plus the device-to-host copy of the accept counts it needs), where the CUDA
kernels are built (on the emulated device the times are CPU times; the
launches per step are measured there).

    python bench/bench_device_step.py               # N = 64, 128, 256, 512, 1024
    python bench/bench_device_step.py --quick       # fewer steps, N up to 256
    python bench/bench_device_step.py --json

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

import _common as C

ds = C.import_dspark()
from dspark_core.stager.device_step import STEP_OK, StepOutputs, StepRows  # noqa: E402  (after the dev-build fallback)

D, STORAGE = 8192, "q8_0"
#: B and W (--block / --window change them: the emulated device wants a small W).
SHAPE = {"B": 16, "W": 4096}
PROMPT = 3000
TARGET_RATIO = 1.5
#: What a GPU server's step needs from the host, each way (by construction of the calls).
CAPACITY_WAY = "device step + padded rows, capacity 2N"
CSR_WAY, CSR_CAPACITY_WAY = "device step + CSR rows", "device step + CSR rows, capacity 2N"
#: The unpadded device step: the baseline of the "x unpadded step" column.
UNPADDED_WAY = "device step (CPU twin)"
WAYS = ("host path", UNPADDED_WAY, "host path + padded rows", "device step + padded rows", CAPACITY_WAY, CSR_WAY,
        CSR_CAPACITY_WAY)
HOST_SYNCS = {"host path": 1, UNPADDED_WAY: 0, "host path + padded rows": 1,
              "device step + padded rows": 0, CAPACITY_WAY: 0, CSR_WAY: 0, CSR_CAPACITY_WAY: 0,
              "device step (CUDA graph)": 0, "host path + count copy": 1}
LAUNCHES = {"host path": "0 (+ host work)", UNPADDED_WAY: "1 (the kernel)",
            "host path + padded rows": "0 (+ host work)", "device step + padded rows": "1 (the kernel)",
            CAPACITY_WAY: "1 (the kernel)", CSR_WAY: "3 (the kernel, scan, rows)",
            CSR_CAPACITY_WAY: "3 (the kernel, scan, rows)", "host path + count copy": "0 (+ host work)"}


def make(n: int) -> Any:
    st = ds.Stager(ds.StagerConfig(feature_dim=D, block_size=SHAPE["B"], window=SHAPE["W"], max_seqs=n, storage=STORAGE,
                                   rows="external"))
    for q in range(n):
        st.begin(q)
        st.process(q, np.arange(PROMPT))
    return st


def host_way(n: int, counts: list[np.ndarray], warmup: int, padded: bool = False) -> list[int]:
    """Step times (ns) of the host path's batch calls (``padded``: also the plan's padded
    gather slots and positions, into fixed buffers as a graph's inputs)."""
    st = make(n)
    width = SHAPE["W"] - SHAPE["B"]
    pos_out, slots_out = np.empty((n, width), np.int32), np.empty((n, width), np.int64)
    seqs = np.arange(n, dtype=np.int64)
    ends = np.full(n, PROMPT, np.int64)
    b = SHAPE["B"]
    cu = np.arange(n + 1, dtype=np.int64) * (b + 1)
    offs = np.arange(b + 1, dtype=np.int64)
    reserved = False
    times = []
    for t, a in enumerate(counts):
        t0 = time.perf_counter_ns()
        if reserved:
            st.confirm_many(seqs)
            st.accept_many(seqs, a)
            ends = ends + a + 1
        bp = st.draft_many(seqs, ends)
        if padded:
            bp.padded(width, positions_out=pos_out, slots_out=slots_out)
        st.commit_many(seqs[bp.active])
        st.reserve_many(seqs, cu, (ends[:, None] + offs).ravel())
        reserved = True
        t1 = time.perf_counter_ns()
        if t >= warmup:
            times.append(t1 - t0)
    return times


def device_way(n: int, counts: list[np.ndarray], warmup: int, padded: bool, capacity: int | None = None,
               csr: bool = False) -> list[int]:
    """Step times (ns) of the CPU twin, answers into fixed buffers (``padded``: with the
    [N, W - B] gather slots and positions of a CUDA graph's fixed shape; ``capacity``:
    buffers of that many entries, the ones past the batch padding; ``csr``: then the
    batch's CSR rows, ``step_rows``, into fixed buffers of the same capacity)."""
    st = make(n)
    seqs = np.arange(n, dtype=np.int64)
    st.to_device(seqs)
    out = StepOutputs.empty(capacity or n, st.step_layout[1], SHAPE["B"], padded=padded)
    rows = StepRows.empty(capacity or n, st.step_layout[1]) if csr else None
    first = np.zeros(n, np.int64)  # the first step: no verify rows yet (accept does nothing)
    times = []
    for t, a in enumerate(counts):
        t0 = time.perf_counter_ns()
        st.step_many(seqs, first if t == 0 else a, out=out)
        if rows is not None:
            st.step_rows(seqs, out, rows)
        t1 = time.perf_counter_ns()
        if not (out.status[:n] == STEP_OK).all():
            raise SystemExit(f"step {t}: status words {np.unique(out.status)}")
        if t >= warmup:
            times.append(t1 - t0)
    st.to_host(seqs)
    return times


def cuda_ways(n: int, counts: list[np.ndarray], warmup: int) -> dict[str, Any]:
    """Where the CUDA kernels are built: the step as a captured graph (one replay per step,
    the counts written into its device array between replays, untimed: a sampler kernel's
    write) against the host path plus the one device-to-host copy of the counts it needs.
    Returns step times (ns) and the launches per replay (measured on the emulated device)."""
    from dspark_core import cuda

    cu = cuda._cuda
    st = make(n)
    seqs = np.arange(n, dtype=np.int64)
    step = cuda.DeviceStep(st, n)
    step.to_device(seqs)
    step.set_batch(seqs, np.zeros(n, np.int32))
    stream = cu.Stream(0)
    cu.capture_begin(stream.handle)
    try:
        step.launch(stream.handle)
    finally:
        graph = cu.capture_end(stream.handle)
    times, launches = [], []
    for t, a in enumerate(counts):
        step.set_counts(a if t else np.zeros(n, np.int32))
        before = cu.emulated_launches()
        t0 = time.perf_counter_ns()
        graph.launch(stream.handle)
        cu.synchronize(stream.handle)
        t1 = time.perf_counter_ns()
        launches.append(cu.emulated_launches() - before)
        if t >= warmup:
            times.append(t1 - t0)
    # The host path's step with the sync it needs: the counts copied back first.
    sync_times = []
    for t, ns in enumerate(host_way(n, counts, 0)):
        t0 = time.perf_counter_ns()
        cu.copy_to_host(step.counts_ptr, 4 * n)
        sync = time.perf_counter_ns() - t0
        if t >= warmup:
            sync_times.append(ns + sync)
    step.to_host(seqs)
    return {"graph": times, "host+sync": sync_times, "launches": launches[-1] if launches[0] >= 0 else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="64,128,256,512,1024", help="sequence counts N (comma separated)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per (N, way)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    ap.add_argument("--quick", action="store_true", help="N up to 256, 50 timed steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block", type=int, default=SHAPE["B"], help=f"B (default {SHAPE['B']})")
    ap.add_argument("--window", type=int, default=SHAPE["W"],
                    help=f"W (default {SHAPE['W']}; the emulated device wants a small one)")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA ways even where the kernels are built")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="one JSON record per (N, way): on stdout instead of the table (no PATH), or into PATH")
    args = ap.parse_args()
    ns = C.parse_list(args.ns)
    if args.quick:
        ns = [x for x in ns if x <= 256]
        args.steps, args.warmup = min(args.steps, 50), min(args.warmup, 5)
    SHAPE.update(B=args.block, W=args.window)
    B, W = args.block, args.window
    with_cuda = False
    if not args.no_cuda:
        from dspark_core import cuda

        with_cuda = cuda.available()
    load_before = os.getloadavg()[0]
    rng = np.random.default_rng(args.seed)
    records: list[dict[str, Any]] = []
    for n in ns:
        counts = [rng.integers(0, B + 1, n).astype(np.int64) for _ in range(args.warmup + args.steps)]
        # Interleaved halves, so that a load change hits both ways alike.
        half = args.warmup + args.steps // 2
        runs: dict[str, list[int]] = {way: [] for way in WAYS}
        for part in (counts[:half], counts[:args.warmup] + counts[half:]):
            runs["host path"] += host_way(n, part, args.warmup)
            runs["device step (CPU twin)"] += device_way(n, part, args.warmup, False)
            runs["host path + padded rows"] += host_way(n, part, args.warmup, True)
            runs["device step + padded rows"] += device_way(n, part, args.warmup, True)
            runs[CAPACITY_WAY] += device_way(n, part, args.warmup, True, capacity=2 * n)
            runs[CSR_WAY] += device_way(n, part, args.warmup, False, csr=True)
            runs[CSR_CAPACITY_WAY] += device_way(n, part, args.warmup, False, capacity=2 * n, csr=True)
        for way, times in runs.items():
            records.append({"n": n, "way": way, "steps": len(times), "median_step_us": float(np.median(times)) / 1e3,
                            "host_syncs_per_step": HOST_SYNCS[way]})
        if with_cuda:
            got = cuda_ways(n, counts, args.warmup)
            measured = got["launches"]
            LAUNCHES["device step (CUDA graph)"] = "1 (graph)" if measured is None else f"{measured} (measured)"
            for way, key in (("device step (CUDA graph)", "graph"), ("host path + count copy", "host+sync")):
                records.append({"n": n, "way": way, "steps": len(got[key]),
                                "median_step_us": float(np.median(got[key])) / 1e3,
                                "host_syncs_per_step": HOST_SYNCS[way], "launches_per_step": measured})
    load_after = os.getloadavg()[0]

    def get(n: int, way: str) -> dict[str, Any]:
        return next(r for r in records if r["n"] == n and r["way"] == way)

    targets = []
    if 256 in ns:
        ratio = get(256, "device step (CPU twin)")["median_step_us"] / get(256, "host path")["median_step_us"]
        targets.append({"target": f"CPU twin within {TARGET_RATIO}x of the host path", "where": "N = 256",
                        "value": ratio, "pass": ratio <= TARGET_RATIO,
                        "text": f"{ratio:.2f}x"})
        ratio = (get(256, "device step + padded rows")["median_step_us"]
                 / get(256, "host path + padded rows")["median_step_us"])
        targets.append({"target": f"CPU twin with padded rows within {TARGET_RATIO}x of the host path with them",
                        "where": "N = 256", "value": ratio, "pass": ratio <= TARGET_RATIO, "text": f"{ratio:.2f}x"})
    for r in records:  # each device way's cost over the unpadded step, same N, same run
        if r["way"] in WAYS and r["way"].startswith("device step"):
            r["x_unpadded_step"] = r["median_step_us"] / get(r["n"], UNPADDED_WAY)["median_step_us"]
    if args.json == "-":
        for r in records:
            print(json.dumps(r))
        return 0
    C.write_json(args.json, {"records": records, "targets": targets, "load": [load_before, load_after]})
    lines = C.header_lines(
        "The device step against the host path (the same work per step)",
        [f"D = {D}, B = {B}, W = {W}, storage {STORAGE}, external rows; accept counts random in 0..{B}",
         f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after; medians of the timed steps",
         "host path: confirm_many + accept_many + draft_many + commit_many + reserve_many; "
         "device step: step_many (the CUDA kernel's CPU twin)"])
    rows = []
    for n in ns:
        host, unpadded = get(n, "host path"), get(n, UNPADDED_WAY)
        for way in WAYS + (("device step (CUDA graph)", "host path + count copy") if with_cuda else ()):
            r = get(n, way)
            device_way_ = way.startswith("device step") and way != "device step (CUDA graph)"
            rows.append([n, way, C.fmt_us(r["median_step_us"] * 1e3),
                         C.fmt_x(r["median_step_us"] / host["median_step_us"], 2),
                         C.fmt_x(r["median_step_us"] / unpadded["median_step_us"], 2) if device_way_ else "",
                         HOST_SYNCS[way], LAUNCHES[way]])
    lines += C.table(["N", "way", "step (us)", "x host path", "x unpadded step", "host syncs / step",
                      "launches / step"], rows, "rlrrrrl")
    lines.append("")
    lines += [f"- {t['target']} ({t['where']}): {t['text']} {C.verdict(t['pass'])}" for t in targets]
    C.emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
