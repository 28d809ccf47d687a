#!/usr/bin/env python3
"""What a chain drafter's token ids cost: the batched server step and the device step's
hand-overs, a chain drafter's Stager against a block drafter's, in the same run.

A chain drafter's Stager (``StagerConfig(kind="chain")``: EAGLE-3, EAGLE, MTP)
keeps one int32 id beside every row (design.md 2.12): ``process_many`` checks and
copies ``n * B`` more ids, every move of rows moves them, and the device step hands
them over by slot (``to_device`` / ``to_host`` with the slot token table). Two
measurements, each a chain Stager against a block one of the same configuration
(D = 8,192, B = 16, W = 4,096, q8_0), timed alternately (block, chain, block,
chain, ...) so that the machine's load falls on both alike:

* ``server step``: bench_step.py's batched step (``process_many`` of the B verify
  rows of every sequence, ``accept_many``, ``draft_many``, ``commit_many``), held
  and external rows;
* ``hand-over``: ``to_device`` then ``to_host`` of all N sequences (external rows),
  the chain Stager with its slot token table (``max_seqs * ring_rows`` ids
  written, then every row's id read back and checked).

The table gives the medians and the ratio chain / block; the step's ratio is what
a server pays for the ids. ``--json``: the records. Not a test (never collected by
pytest).

    python bench/bench_chain.py              # N = 16, 256
    python bench/bench_chain.py --quick      # fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

import _common as C
from bench_step import B, D, STORAGE, W, python_way

C.import_dspark()
from dspark_core import Stager, StagerConfig  # noqa: E402

KINDS = ("block", "chain")
#: Alternating rounds per measurement: each round times both kinds once.
ROUNDS = 5


def step_medians(mode: str, n: int, warmup: int, steps: int) -> dict[str, float]:
    """Median batched step (us) per kind, over ROUNDS alternating runs."""
    samples: dict[str, list[int]] = {k: [] for k in KINDS}
    for _ in range(ROUNDS):
        for kind in KINDS:
            samples[kind] += python_way(mode, n, True, warmup, steps, kind=kind)["step"]
    return {k: float(np.median(v)) / 1e3 for k, v in samples.items()}


def handover_medians(n: int, repeats: int) -> dict[str, float]:
    """Median to_device + to_host of all n sequences (us) per kind, external rows."""
    stagers, tables = {}, {}
    for kind in KINDS:
        cfg = StagerConfig(feature_dim=D, block_size=B, window=W, storage=STORAGE, max_seqs=n, rows="external",
                           kind=kind)
        st = Stager(cfg)
        prompt = np.arange(W, dtype=np.int64)  # a full window of rows per sequence
        ids = (prompt % 32000).astype(np.int32) if kind == "chain" else None
        for q in range(n):
            st.process(q, prompt, tokens=ids)
        stagers[kind] = st
        tables[kind] = st.new_token_table() if kind == "chain" else None
    seqs = np.arange(n, dtype=np.int64)
    samples: dict[str, list[int]] = {k: [] for k in KINDS}
    for _ in range(ROUNDS):
        for kind in KINDS:
            st, table = stagers[kind], tables[kind]

            def hand(st: Any = st, table: Any = table) -> None:
                st.to_device(seqs, tokens=table)
                st.to_host(seqs, tokens=table)

            samples[kind] += C.time_ns(hand, repeats)
    return {k: float(np.median(v)) / 1e3 for k, v in samples.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="16,256", help="sequence counts N (comma separated)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (ROUNDS runs per kind)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first, per run")
    ap.add_argument("--quick", action="store_true", help="3 timed steps per run, N = 16 and 64")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="the records, into PATH (or on stdout with no PATH, instead of the table)")
    args = ap.parse_args()
    ns = C.parse_list("16,64" if args.quick else args.ns)
    if args.quick:
        args.steps, args.warmup = 3, 2
    load_before = os.getloadavg()[0]
    records: list[dict[str, Any]] = []
    for n in ns:
        for mode in ("external", "held"):
            med = step_medians(mode, n, args.warmup, args.steps)
            records.append({"what": "server step", "mode": mode, "n": n, **{f"{k}_us": v for k, v in med.items()},
                            "ratio": med["chain"] / med["block"]})
        med = handover_medians(n, max(3, args.steps))
        records.append({"what": "hand-over", "mode": "external", "n": n, **{f"{k}_us": v for k, v in med.items()},
                        "ratio": med["chain"] / med["block"]})
    load_after = os.getloadavg()[0]
    if args.json == "-":
        for r in records:
            print(json.dumps(r))
        return 0
    C.write_json(args.json, {"records": records, "load": [load_before, load_after]})
    lines = C.header_lines(
        "A chain drafter's token ids: its Stager against a block drafter's",
        [f"D = {D}, B = {B}, W = {W}, storage {STORAGE}; kinds timed alternately, {ROUNDS} rounds",
         f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after; medians"])
    lines += C.table(["what", "mode", "N", "block (us)", "chain (us)", "chain / block"],
                     [[r["what"], r["mode"], r["n"], C.fmt_us(r["block_us"] * 1e3), C.fmt_us(r["chain_us"] * 1e3),
                       f"{r['ratio']:.2f}"] for r in records])
    C.emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
