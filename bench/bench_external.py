#!/usr/bin/env python3
"""External-row mode vs held mode: bytes across PCIe and host CPU time per steady round.

A GPU server captures the target's rows on the device. In held mode every
row crosses to the host (the verify batch, device -> host, before
``process``) and every staged row crosses back (``plan.encoded_rows``, host ->
device, before the drafter decodes). In external-row mode
(``StagerConfig(rows="external")``, with a ``DeviceRing`` or the server's
own table) no row byte crosses: the host only plans, and what it hands the
device is the plan's integers (drafter positions, block positions, slots).

For each row width D (25,600 and 12,288 by default) and storage, one
sequence runs a prefill far past the window, then steady decode rounds as a
server drives them::

    plan = st.draft(0, n_past); st.commit(0)
    st.process(0, verify_positions, verify_rows)      # held; external: no rows
    st.accept(0, n_acc)

The table gives, per round (medians over the timed rounds):

* bytes host <-> device: held = verify rows in the capture dtype (float32,
  D2H) + staged rows in storage format (H2D); external = 0 row bytes, plus
  the plan's integers (int32 positions and block positions, int64 slots);
* host CPU time of the Stager calls (``time.thread_time_ns``: CPU, not wall;
  the copies themselves are not included, there is no GPU here), held vs
  external and their ratio. The external round touches no row, so its time
  does not depend on D: the last table divides it at each D by its value at
  the smallest D (~1.0 expected);
* device memory per sequence of a DeviceRing table, per storage
  (``ring_rows * row_bytes``; ``ring_rows = W + 512 + B + 1``).

    python bench/bench_external.py --quick
    python bench/bench_external.py --dims 25600,12288,1024

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
from dspark_core import Stager, StagerConfig  # noqa: E402
from dspark_core.stager.config import STORAGES, storage_row_bytes  # noqa: E402


def steady_rounds(cfg: StagerConfig, prompt: int, rounds: int, n_acc: int, verify: np.ndarray | None
                  ) -> tuple[list[int], list[int]]:
    """CPU ns per steady round and plan-integer bytes per round (after a prefill and warm-up)."""
    st = Stager(cfg)
    external = cfg.external_rows
    B = cfg.block_size
    chunk = 512
    rows = None if external else np.ones((chunk, cfg.feature_dim), np.float32)
    for lo in range(0, prompt, chunk):
        hi = min(prompt, lo + chunk)
        pos = np.arange(lo, hi, dtype=np.int64)
        st.process(0, pos) if external else st.process(0, pos, rows[: hi - lo])
    n_past = prompt
    offsets = np.arange(B + 1, dtype=np.int64)
    cpu: list[int] = []
    ints: list[int] = []
    for r in range(rounds + 10):  # 10 warm-up rounds
        t0 = time.thread_time_ns()
        plan = st.draft(0, n_past)
        st.commit(0)
        pos = n_past + offsets
        slots = st.process(0, pos) if external else st.process(0, pos, verify)
        st.accept(0, n_acc)
        t1 = time.thread_time_ns()
        n_past += n_acc + 1
        if r >= 10:
            cpu.append(t1 - t0)
            # what the device needs from the host: positions (int32), block positions (int32), slots (int64)
            n = plan.n_rows
            ints.append(4 * n + 4 * B + (8 * n + 8 * len(slots) if external else 0))
    return cpu, ints


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI-sized: fewer rounds, a 1k window")
    ap.add_argument("--dims", default="25600,12288", help="row widths D (default 25600,12288)")
    ap.add_argument("--storages", default="f32,q8_0", help="storages timed in held mode (default f32,q8_0)")
    ap.add_argument("--window", type=int, default=None, help="W (default 4096; --quick 1024)")
    ap.add_argument("--block", type=int, default=16, help="B (default 16)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 300; --quick 60)")
    ap.add_argument("--json", default=None, help="also write the figures as JSON here")
    ap.add_argument("--out", default=None, help="also write the table here")
    a = ap.parse_args(argv)
    dims = C.parse_list(a.dims)
    storages = [s.strip() for s in a.storages.split(",") if s.strip()]
    W = a.window or (1024 if a.quick else 4096)
    B = a.block
    rounds = a.rounds or (60 if a.quick else 300)
    prompt = 2 * W + 700
    n_acc = B // 2
    verify = {}

    results: list[dict[str, Any]] = []
    ext_cpu: dict[int, float] = {}
    for D in dims:
        verify[D] = np.ones((B + 1, D), np.float32)
        for storage in storages:
            cfg = StagerConfig(D, B, W, storage=storage)
            print(f"D={D} {storage}: held", file=sys.stderr, flush=True)
            h_cpu, _ = steady_rounds(cfg, prompt, rounds, n_acc, verify[D])
            print(f"D={D} {storage}: external", file=sys.stderr, flush=True)
            x_cpu, x_ints = steady_rounds(cfg.replace(rows="external"), prompt, rounds, n_acc, None)
            rb = cfg.row_bytes
            staged_rows = n_acc + 1  # a steady (non-rebase) round stages the rows since the cache end
            held_bytes = (B + 1) * D * 4 + staged_rows * rb
            hm, xm = C.median(h_cpu), C.median(x_cpu)
            ext_cpu.setdefault(D, xm)
            results.append({
                "D": D, "storage": storage, "row_bytes": rb, "held_bytes": held_bytes,
                "external_row_bytes": 0, "external_int_bytes": int(np.median(x_ints)),
                "held_cpu_ns": hm, "external_cpu_ns": xm, "ratio": hm / xm if xm else None,
            })

    lines = C.header_lines("External-row mode: bytes host <-> device and host CPU per steady round", [
        f"W = {W}, B = {B}, n_accepted = {n_acc}, prompt {prompt:,} rows, {rounds} timed rounds "
        "(median; host CPU time of the Stager calls per round)",
    ])
    lines += ["### Per steady round", ""]
    rows = []
    for r in results:
        rows.append([f"{r['D']:,}", r["storage"], C.fmt_bytes(r["held_bytes"]),
                     f"0 rows + {r['external_int_bytes']} B of integers",
                     C.fmt_us(r["held_cpu_ns"]), C.fmt_us(r["external_cpu_ns"]), C.fmt_x(r["ratio"])])
    lines += C.table(["D", "storage", "held: row bytes H<->D", "external: bytes H<->D",
                      "held CPU / round (us)", "external CPU / round (us)", "held / external"], rows, "llrrrrr")
    lines += ["", "held bytes = verify batch (B + 1 rows, float32, device -> host) + staged rows "
              "(n_accepted + 1 rows in storage format, host -> device).", ""]

    base_d = min(dims)
    lines += [f"### External round: host CPU time against D (relative to D = {base_d:,})", ""]
    lines += C.table(["D", "external CPU / round (us)", f"/ D = {base_d:,}"],
                     [[f"{d:,}", C.fmt_us(ext_cpu[d]), f"{ext_cpu[d] / ext_cpu[base_d]:.2f}"] for d in dims], "lrr")
    lines += [""]

    ring_rows = W + 512 + B + 1
    lines += [f"### DeviceRing memory per sequence (ring_rows = W + 512 + B + 1 = {ring_rows:,})", ""]
    mem_rows = []
    for D in dims:
        f32 = ring_rows * storage_row_bytes("f32", D)
        mem_rows.append([f"{D:,}"] + [
            f"{C.fmt_bytes(ring_rows * storage_row_bytes(s, D))} ({f32 / (ring_rows * storage_row_bytes(s, D)):.1f}x less)"
            if s != "f32" else C.fmt_bytes(f32) for s in STORAGES])
    lines += C.table(["D", *STORAGES], mem_rows, "l" + "r" * len(STORAGES))
    C.emit(lines, a.out)
    flat = max(ext_cpu.values()) / min(ext_cpu.values()) if ext_cpu else None
    C.write_json(a.json, {"results": results, "external_cpu_by_dim": ext_cpu, "window": W, "block": B,
                          "targets": [{"target": "external round CPU independent of D (max / min over D)",
                                       "value": flat, "pass": flat is not None and flat < 1.5},
                                      {"target": "external: row bytes host <-> device per round", "value": 0,
                                       "pass": all(r["external_row_bytes"] == 0 for r in results)}]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
