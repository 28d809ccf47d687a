#!/usr/bin/env python3
"""Snapshot / restore throughput against memcpy (np.copyto of the same bytes, same run).

A sequence is moved between processes or machines as a snapshot (format v2:
a 96-byte header, the rows, CRC-32C's of both). For each storage and D, one
Stager (B = 16, W = 4096 by default) is prefilled with W rows (realistic
activations: N(0,1) with a few massive channels) so its window is full; then,
interleaved and in a rotating order, each repeat times:

* memcpy: ``np.copyto`` between two preallocated uint8 arrays of the
  snapshot's size (the baseline: what moving the bytes costs at all);
* snapshot_into: into a preallocated (already faulted-in) numpy buffer;
* restore, emptied slot: ``begin(1); restore(1, buffer)`` from that buffer
  (the decode side's reused slot: rows are checksummed while copied, one pass);
* restore, slot holding rows: ``restore(1, buffer)`` over a slot that still
  holds rows (one pass too: the rows are checksummed while copied into the
  Stager's spare ring, swapped in once they check out, so a damaged snapshot
  still leaves the slot untouched);
* snapshot(): the allocating call (a fresh bytes object each time: its page
  faults are part of the cost);
* v1 restore: the same state as a version-1 blob (zlib's byte-at-a-time
  CRC-32), what restore cost before format v2 (fewer repeats, it is slow).

Ratios are memcpy's median time over the operation's median time (1.0x =
memcpy speed; the goal for snapshot_into and restore from a buffer, into an
emptied slot or one holding rows, is >= 0.8x). --crc-paths also times snapshot_into / restore on the portable CRC-32C
kernel. Peak memory is about 9 snapshot sizes (~3.8 GB at f32, D = 25,600).

    python bench/bench_snapshot.py --quick     # D = 12,288, W = 1024, few repeats (seconds)
    python bench/bench_snapshot.py             # f32 and q4_0 at D = 12,288 and 25,600, W = 4096

Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

import _common as C

ds = C.import_dspark()
from dspark_core import Stager, StagerConfig  # noqa: E402
from dspark_core import kernels  # noqa: E402
from dspark_core.stager import snapshot_format as sf  # noqa: E402

GOAL = 0.8  # snapshot_into and restore-from-buffer, as a fraction of memcpy throughput


def activations(n: int, dim: int, seed: int) -> np.ndarray:
    """N(0,1) with massive channels (q4_0's fp16 block scales still hold them)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x[:, [3, dim // 3, dim - 5]] *= np.float32(2e3)
    x[:, 7] += np.float32(3e4)
    return x


def as_v1(v2: bytes | np.ndarray) -> bytes:
    """The same state as a version-1 blob: 88-byte header, rows, zlib CRC-32 trailer."""
    data = bytes(v2)
    head = bytearray(data[:sf.V1_HEADER_BYTES])
    head[4:8] = (1).to_bytes(2, "little") + sf.V1_HEADER_BYTES.to_bytes(2, "little")
    head[13:16] = bytes(3)
    head[76:80] = bytes(4)
    body = bytes(head) + data[sf.HEADER_BYTES:]
    return body + (zlib.crc32(body) & 0xFFFFFFFF).to_bytes(4, "little")


def measure(storage: str, D: int, W: int, B: int, repeats: int, v1_repeats: int, crc_paths: list[str],
            chunk: int = 512) -> dict[str, Any]:
    cfg = StagerConfig(D, B, W, max_seqs=2, storage=storage)
    st = Stager(cfg)
    st.begin(0)
    rows = activations(chunk, D, 1)
    for lo in range(0, W, chunk):
        hi = min(W, lo + chunk)
        st.process(0, np.arange(lo, hi, dtype=np.int64), rows[: hi - lo])
    n = st.snapshot_size(0)
    live = st.stats(0)["live_rows"]
    buf = np.ones(n, np.uint8)  # faulted in: only the copy is timed
    st.snapshot_into(0, buf)
    src = buf.copy()
    dst = np.ones(n, np.uint8)
    st.begin(1)
    st.restore(1, buf)  # slot 1's ring exists and is faulted in

    def restore_emptied() -> None:
        st.begin(1)
        st.restore(1, buf)

    ops: dict[str, Callable[[], object]] = {
        "memcpy": lambda: np.copyto(dst, src),
        "snapshot_into": lambda: st.snapshot_into(0, buf),
        "restore (emptied slot)": restore_emptied,
        "restore (slot holding rows)": lambda: st.restore(1, buf),
        "snapshot() (allocating)": lambda: st.snapshot(0),
    }
    times: dict[str, list[int]] = {k: [] for k in ops}
    names = list(ops)
    for name in names:  # warm-up
        ops[name]()
    for r in range(repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter_ns()
            ops[name]()
            times[name].append(time.perf_counter_ns() - t0)

    # Other CRC-32C kernels (portable): snapshot_into and restore, interleaved with memcpy again.
    active = kernels.active("crc32c")
    for path in crc_paths:
        if path == active or path not in kernels.supported("crc32c"):
            continue
        with kernels.use("crc32c", path):
            for name in (f"snapshot_into [{path}]", f"restore (emptied slot) [{path}]"):
                times[name] = []
            for _ in range(max(1, repeats // 2)):
                for name, fn in ((f"snapshot_into [{path}]", ops["snapshot_into"]),
                                 (f"restore (emptied slot) [{path}]", restore_emptied)):
                    t0 = time.perf_counter_ns()
                    fn()
                    times[name].append(time.perf_counter_ns() - t0)

    if v1_repeats:
        v1 = as_v1(buf)
        old = Stager(cfg)
        old.begin(0)
        old.restore(0, v1)
        name = "v1 restore (CRC-32 table)"
        times[name] = []
        for _ in range(v1_repeats):
            old.begin(0)
            t0 = time.perf_counter_ns()
            old.restore(0, v1)
            times[name].append(time.perf_counter_ns() - t0)
        del old, v1

    med = {k: C.median(v) for k, v in times.items()}
    return {"storage": storage, "D": D, "W": W, "B": B, "bytes": n, "rows": live, "repeats": repeats,
            "crc_path": active, "median_ns": med, "ratio": {k: med["memcpy"] / v for k, v in med.items() if v}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI-sized: D = 12,288, W = 1024, 3 repeats")
    ap.add_argument("--dims", type=C.parse_list, default=None, help="feature dims (default 12288,25600)")
    ap.add_argument("--storages", default="f32,q4_0", help="storages, comma-separated (default f32,q4_0)")
    ap.add_argument("--window", type=C.parse_size, default=None, help="W, rows in the snapshot (default 4096)")
    ap.add_argument("--block-size", type=int, default=16, help="B (default 16)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per operation (default 9; --quick 3)")
    ap.add_argument("--v1-repeats", type=int, default=None, help="repeats of the slow v1 restore (default 2; 0 skips)")
    ap.add_argument("--crc-paths", default="portable",
                    help="also time these CRC-32C kernels besides the active one (default portable; '' for none)")
    ap.add_argument("--out", default=None, help="also write the markdown report to this file")
    ap.add_argument("--json", default=None, help="write raw medians and target verdicts as JSON to this file")
    a = ap.parse_args(argv)
    dims = a.dims or ([12288] if a.quick else [12288, 25600])
    W = a.window or (1024 if a.quick else 4096)
    repeats = a.repeats or (3 if a.quick else 9)
    v1_repeats = a.v1_repeats if a.v1_repeats is not None else (1 if a.quick else 2)
    storages = [s.strip() for s in a.storages.split(",") if s.strip()]
    crc_paths = [p.strip() for p in a.crc_paths.split(",") if p.strip()]

    t_all = time.perf_counter()
    results = []
    for s in storages:
        for D in dims:
            print(f"storage={s} D={D} W={W} ...", file=sys.stderr, flush=True)
            results.append(measure(s, D, W, a.block_size, repeats, v1_repeats, crc_paths))
    wall = time.perf_counter() - t_all

    lines = C.header_lines(
        "Snapshot / restore vs memcpy (bench_snapshot.py)",
        [(f"W = {W} rows prefilled (the snapshot holds the live rows), B = {a.block_size}; {repeats} interleaved "
          f"repeats, medians; ratio = memcpy median / operation median (goal >= {GOAL}x for snapshot_into and "
          "restore from a buffer)"),
         (f"CRC-32C kernel: {results[0]['crc_path'] if results else '?'} (supported: "
          f"{', '.join(kernels.supported('crc32c'))})"),
         f"total wall time {wall:.0f} s"],
    )
    targets = []
    rows = []
    for r in results:
        med, ratio = r["median_ns"], r["ratio"]
        for name in med:
            goal = name in ("snapshot_into", "restore (emptied slot)", "restore (slot holding rows)")
            ok = ratio[name] >= GOAL if goal else None
            if goal:
                targets.append({"target": f"{name} / memcpy >= {GOAL}x", "storage": r["storage"], "D": r["D"],
                                "value": ratio[name], "pass": ok})
            gbps = r["bytes"] / med[name]
            rows.append([r["storage"], f"{r['D']:,}", f"{r['rows']:,}", C.fmt_bytes(r["bytes"]), name,
                         f"{med[name] / 1e6:,.1f}", f"{gbps:.1f}", f"{ratio[name]:.2f}x",
                         C.verdict(ok) if goal else "-"])
    lines += C.table(["storage", "D", "rows", "snapshot", "operation", "median ms", "GB/s", "vs memcpy",
                      f">= {GOAL}x"], rows, "lrrrlrrrl")
    lines += ["", ("GB/s counts the snapshot's bytes once (1e9 B/s). 'emptied slot' is what a decode node's "
                   "reused slot sees after begin(); a slot still holding rows must survive a damaged snapshot, so "
                   "the rows are checksummed while copied into the Stager's spare ring (also one pass), which "
                   "replaces the slot's ring only once they check out. snapshot() pays the page faults of a fresh "
                   "bytes object each call."), ""]
    lines += ["Snapshot sizes (96 + rows x row_bytes; the table in docs/moving_sequences.md uses the same formula):", ""]
    size_rows = []
    for s in storages:
        for D in dims:
            rb = ds.formats.row_bytes(s, D)
            size_rows.append([s, f"{D:,}", f"{rb:,}", C.fmt_bytes(sf.snapshot_bytes(W, rb))])
    lines += C.table(["storage", "D", "row bytes", f"W = {W} rows"], size_rows, "lrrr")
    C.emit(lines, a.out)
    C.write_json(a.json, {"script": "bench_snapshot", "wall_s": wall, "targets": targets, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
