#!/usr/bin/env python3
"""Peak buffered rows and bytes per sequence against prompt length: Stager vs hold-all staging.

For each storage dtype and prompt length, a fresh 1-sequence Stager
(D = 25,600, B = 16, W = 4096 by default) receives the prompt in 512-row
``process`` chunks (one reused float32 array; only the positions change), as
a server's prefill does. Then it drafts, and runs decode rounds
(process B + 1 verify rows, accept n = B / 2) across at least one rebase and
trim, so the peak covers generation as well as prefill. The numbers are the
core's own counters: ``stats(seq)["peak_rows"]`` (rows held) and
``["peak_bytes"]`` (ring memory written so far, i.e. resident; the ring
reserves its bound as address space up front and touches it as rows arrive).

Bound (docs/design.md section 6): peak rows <= W + TRIM_CHUNK + B + 1 whatever the
prompt length.

The hold-all columns are *computed*, not measured: hold-all staging (llama.cpp's
draft-dspark staging, which this package replaces) holds every prompt row, float32,
until the first draft, so its peak is prompt-length rows of D * 4 bytes
(~6 GB for a 60k prompt at D = 25,600). "hold-all, same storage" is that row
count at this storage's row size, for a like-for-like comparison.

    python bench/bench_memory.py --quick     # prompts up to 32k
    python bench/bench_memory.py             # prompts 1k .. 128k, every storage

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import _common as C

ds = C.import_dspark()
from dspark_core import Stager, StagerConfig, formats  # noqa: E402
from dspark_core.stager.config import TRIM_CHUNK  # noqa: E402


def run_one(cfg: StagerConfig, prompt: int, chunk_rows: np.ndarray, verify: np.ndarray, rounds: int,
            n_acc: int) -> dict[str, Any]:
    st = Stager(cfg)
    st.begin(0)
    ch = len(chunk_rows)
    t0 = time.perf_counter()
    for lo in range(0, prompt, ch):
        hi = min(prompt, lo + ch)
        st.process(0, np.arange(lo, hi, dtype=np.int64), chunk_rows[: hi - lo])
    t_prefill = time.perf_counter() - t0
    after_prefill = st.stats(0)
    n_past = prompt
    offsets = np.arange(cfg.block_size + 1, dtype=np.int64)
    t0 = time.perf_counter()
    for _ in range(rounds):
        plan = st.draft(0, n_past)
        if plan.skip is not None:
            raise RuntimeError(f"unexpected skip {plan.skip!r}")
        _ = plan.rows
        st.commit(0)
        st.process(0, offsets + n_past, verify)
        st.accept(0, n_acc)
        n_past += n_acc + 1
    t_rounds = time.perf_counter() - t0
    s = st.stats(0)
    return {
        "prompt": prompt,
        "prefill_s": t_prefill,
        "rounds_s": t_rounds,
        "prefill_peak_rows": after_prefill["peak_rows"],
        "prefill_peak_bytes": after_prefill["peak_bytes"],
        "peak_rows": s["peak_rows"],
        "peak_bytes": s["peak_bytes"],
        "rebases": s["rebases"],
        "trims": s["trims"],
        "rows_now": s["rows"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI-sized run: prompts up to 32k, one rebase cycle (< 30 s)")
    ap.add_argument("--prompts", type=C.parse_list, default=C.parse_list("1k,4k,16k,64k,128k"),
                    help="prompt lengths, comma-separated (default 1k,4k,16k,64k,128k)")
    ap.add_argument("--max-prompt", type=C.parse_size, default=None,
                    help="drop prompt lengths above this (default none; --quick 32k)")
    ap.add_argument("--dim", type=C.parse_size, default=25600, help="feature dim D (default 25,600)")
    ap.add_argument("--storages", default=",".join(formats.STORAGES),
                    help=f"storage dtypes, comma-separated (default all: {','.join(formats.STORAGES)})")
    ap.add_argument("--block-size", type=int, default=16, help="drafter block size B (default 16)")
    ap.add_argument("--window", type=C.parse_size, default=4096, help="drafter window W (default 4096)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk rows per process call (default 512)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="decode rounds after the prompt (default: 2 rebase cycles + 10; --quick 1 cycle + 10)")
    ap.add_argument("--out", default=None, help="also write the markdown report to this file")
    ap.add_argument("--json", default=None, help="write raw numbers and target verdicts as JSON to this file")
    a = ap.parse_args(argv)

    cap = a.max_prompt if a.max_prompt is not None else (32768 if a.quick else None)
    prompts = sorted({p for p in a.prompts if cap is None or p <= cap})
    storages = [s.strip() for s in a.storages.split(",") if s.strip()]
    B, W, D = a.block_size, a.window, a.dim
    n_acc = B // 2
    K = min(W // 2, W - B)
    cycle = (W - B - K) // (n_acc + 1) + 1
    rounds = a.rounds if a.rounds is not None else (cycle + 10 if a.quick else 2 * cycle + 10)
    bound = W + TRIM_CHUNK + B + 1

    rng = np.random.default_rng(0)
    chunk_rows = rng.standard_normal((a.chunk, D), dtype=np.float32)
    verify = rng.standard_normal((B + 1, D), dtype=np.float32)

    t_all = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {}
    for s in storages:
        cfg = StagerConfig(D, B, W, storage=s)
        print(f"storage={s} ...", file=sys.stderr, flush=True)
        results[s] = [run_one(cfg, p, chunk_rows, verify, rounds, n_acc) for p in prompts]
    wall = time.perf_counter() - t_all

    lines = C.header_lines(
        "Peak buffer per sequence vs prompt length (bench_memory.py)",
        [
            f"D = {D:,}, B = {B}, W = {W}; prompt fed in {a.chunk}-row process() chunks, then {rounds} decode rounds "
            f"(accept n = {n_acc}; a rebase every {cycle} rounds)",
            f"bound: peak rows <= W + TRIM_CHUNK + B + 1 = {W} + {TRIM_CHUNK} + {B} + 1 = {bound}",
            "Stager columns are measured (stats()['peak_rows'], ['peak_bytes'] = resident ring memory); the hold-all "
            "columns are computed from its documented behaviour (every prompt row held as float32 until the first "
            "draft)",
            f"total wall time {wall:.0f} s",
        ],
    )
    targets = []
    rows = []
    for s in storages:
        rb = formats.row_bytes(s, D)
        for r in results[s]:
            p = r["prompt"]
            holdall_f32 = p * D * 4
            ok = r["peak_rows"] <= bound
            targets.append({"storage": s, "prompt": p, "target": "peak rows <= W + TRIM_CHUNK + B + 1",
                            "value": r["peak_rows"], "bound": bound, "pass": ok})
            pb = r["prefill_peak_bytes"]
            rows.append([
                s, C.fmt_size(p), f"{r['prefill_peak_rows']:,}", C.fmt_bytes(pb),
                f"{p:,}", C.fmt_bytes(holdall_f32), C.fmt_bytes(p * rb),
                C.fmt_x(holdall_f32 / pb if pb else None), C.fmt_x(p * rb / pb if pb else None),
                f"{r['peak_rows']:,}", C.verdict(ok), C.fmt_bytes(r["peak_bytes"]),
                f"{r['prefill_s'] * 1e3:,.0f}", f"{r['rebases']}/{r['trims']}",
            ])
    lines += C.table(
        ["storage", "prompt", "Stager rows at first draft", "Stager bytes at first draft",
         "hold-all rows", "hold-all bytes (f32)", "hold-all bytes, same storage", "hold-all f32 / Stager",
         "same storage / Stager", "Stager peak rows, whole run", f"<= {bound}", "Stager peak bytes, whole run",
         "prefill ms", "rebases/trims"],
        rows, "llrrrrrrrrlrrr")
    lines += ["", "'at first draft' = the peak over the prefill, where hold-all staging holds the whole prompt; 'whole run' "
              "adds the decode rounds (hold-all staging is also bounded there, by its own lazy trim). Bytes are the ring "
              "memory written (resident; at most the bound's row count); 'prefill ms' includes the "
              "non-finite check of every prompt row (rows below the horizon are neither converted nor stored).", ""]
    C.emit(lines, a.out)
    C.write_json(a.json, {"script": "bench_memory", "wall_s": wall, "targets": targets, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
