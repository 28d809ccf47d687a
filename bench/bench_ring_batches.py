#!/usr/bin/env python3
"""Batched gather / write of external rows on the device: launches and bandwidth per batch.

A batching server's step touches the rows of every active sequence. ``DeviceRing`` does that
per sequence (``gather(plan)``: a launch per run of a plan's slots, up to two per sequence;
``write``: up to two per sequence) or for the whole batch at once (``gather_slots`` /
``write_slots``, or ``gather(batch_plan)``: one launch over a flat int64 slot array; a
read-only check launch more for a write under ``nonfinite="error"``). For N = 16, 64, 256
sequences of ``--rows`` rows each, with the slots of a real external-row Stager whose rings
wrap, this prints per batch:

* launches: per-sequence vs batched (counted by the emulated device, or as the binding's
  calls on a GPU: one launch each);
* correctness (always): the batched write's table bytes and the batched gather's rows equal
  the CPU path's (``formats.quantize_rows`` / ``dequantize_rows``) byte for byte;
* on a GPU only: microseconds per batch (median of ``--reps`` timed loops of the bare
  launches, so the figure is the device's, not the Python layer's), bandwidth
  GB/s = (bytes read + bytes written) / time, and the ratio to a device-to-device copy of
  the same number of bytes measured in the same run. On the emulated device (a CPU model of
  the kernels) timings mean nothing and are not printed.

    python bench/bench_ring_batches.py                       # D = 4096, q8_0 and bf16
    python bench/bench_ring_batches.py --dim 8192 --storages q8_0,q4_0,bf16,f32 --rows 17
    python bench/bench_ring_batches.py --json                # one record per (N, storage, op)

``bench/gpu_check.sh`` runs it; the CI rehearsal runs it on the emulated device. Exit status
1 when a byte differs. Not a test (never collected by pytest).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

import _common as C

ds = C.import_dspark()
from dspark_core import Stager, StagerConfig, cuda, formats  # noqa: E402
from dspark_core.cuda import _backend as B  # noqa: E402
from dspark_core.cuda.device_ring import slot_runs  # noqa: E402

N_SEQS = (16, 64, 256)
CU: Any = cuda._cuda  # the binding (present where cuda.available())


def activations(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x[:, [1, dim // 3]] *= np.float32(3e3)
    return x


class Launches:
    """Device operations a call enqueues: the binding's launchers, each one kernel launch or,
    for a decode to the storage's own format, one device-to-device copy. On the emulated
    device its own kernel count is kept too (a batched call must be exactly one kernel)."""

    NAMES = ("encode", "decode", "scatter_rows", "gather_rows", "check_rows")

    def __init__(self) -> None:
        self.binding = CU
        self.calls = 0
        for name in self.NAMES:
            setattr(self.binding, name, self._counted(getattr(self.binding, name)))

    def _counted(self, fn: Any) -> Any:
        def call(*a: Any) -> Any:
            self.calls += 1
            return fn(*a)
        return call

    def count(self, fn: Any) -> tuple[int, int]:
        """(device operations, kernel launches on the emulated device or -1) of ``fn()``."""
        calls, kernels = self.calls, self.binding.emulated_launches()
        fn()
        return self.calls - calls, (self.binding.emulated_launches() - kernels) if kernels >= 0 else -1


def device_us(fn: Any, reps: int, inner: int) -> float:
    """Median over ``reps`` of the time per call of ``inner`` back-to-back calls (then one sync)."""
    cu = CU
    fn()
    cu.synchronize(0)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        cu.synchronize(0)
        out.append((time.perf_counter() - t) / inner)
    return float(np.median(out)) * 1e6


def run_case(n_seqs: int, storage: str, args: argparse.Namespace, launches: Launches,
             rng: np.random.Generator) -> tuple[list[dict[str, Any]], bool]:
    cu = CU
    dim, rows = args.dim, args.rows
    cfg = StagerConfig(dim, args.block, args.window, max_seqs=n_seqs, storage=storage, rows="external",
                       stage_dtype="bfloat16", nonfinite="clamp")
    st = Stager(cfg)
    ring = cuda.DeviceRing(st, backend="dspark")
    # Decode steps of one row until the next rows of every other sequence straddle its
    # ring's end (two runs of slots: two launches per sequence in the per-sequence calls).
    pos0 = {}
    for s in range(n_seqs):
        stop = (s + 1) * st.ring_rows - (rows // 2 if s % 2 else rows) - 1
        p = 0
        while int(np.asarray(st.process(s, [p]))[0]) != stop:
            p += 1
        pos0[s] = p + 1
    slots = np.concatenate([np.asarray(st.process(s, np.arange(pos0[s], pos0[s] + rows))) for s in range(n_seqs)])
    per_seq = [slots[s * rows:(s + 1) * rows] for s in range(n_seqs)]
    wraps = sum(len(slot_runs(p)) > 1 for p in per_seq)
    n = len(slots)
    x = activations(rng, n, dim)
    xd = cuda.DeviceArray.from_numpy(x)
    sd = cuda.DeviceArray.from_numpy(slots)
    out = cuda.DeviceArray((n, dim), B._BF16)
    code, rb = B._STORAGE[storage], ring.row_bytes
    policy, staged, bf16 = B._POLICY["clamp"], B._ELEM[B._BF16], B._ELEM[B._BF16]
    in_row = dim * 4

    def write_batched() -> None:
        cu.scatter_rows(xd.ptr, 0, n, dim, sd.ptr, ring._table_ptr, code, ring.rows, policy, staged, 0, False, 0)

    def write_per_seq() -> None:
        for s, ps in enumerate(per_seq):
            for slot, r0, m in slot_runs(ps):
                cu.encode(xd.ptr + (s * rows + r0) * in_row, 0, ring._table_ptr + slot * rb, code, m, dim, policy,
                          False, 0, staged)

    status = cuda.DeviceArray((2,), np.uint64)
    error, staged_code = B._POLICY["error"], staged

    def write_batched_error() -> None:  # the status form under nonfinite="error": check, then gated write
        cu.batch_status_reset(status.ptr, 0)
        cu.check_rows(xd.ptr, 0, n, dim, sd.ptr, ring.rows, code, staged_code, status.ptr, 0)
        cu.scatter_rows(xd.ptr, 0, n, dim, sd.ptr, ring._table_ptr, code, ring.rows, error, staged_code, status.ptr,
                        True, 0)

    def gather_batched() -> None:
        cu.gather_rows(ring._table_ptr, code, ring.rows, dim, sd.ptr, n, out.ptr, bf16, 0, 0)

    def gather_per_seq() -> None:
        for s, ps in enumerate(per_seq):
            for slot, r0, m in slot_runs(ps):
                cu.decode(ring._table_ptr + slot * rb, code, out.ptr + (s * rows + r0) * dim * 2, bf16, m, dim, 0)

    # Correctness: the public batch calls against the CPU path.
    ring.write_slots(sd, xd)
    table = np.frombuffer(cu.copy_to_host(ring._table_ptr, ring.nbytes), np.uint8).reshape(ring.rows, rb)
    enc = formats.quantize_rows(x, storage, nonfinite="clamp").view(np.uint8).reshape(n, rb)
    ok_write = table[slots].tobytes() == enc.tobytes()
    got = ring.to_numpy(ring.gather_slots(sd, out))
    ok_gather = got.tobytes() == formats.dequantize_rows(enc, storage, dim, B._BF16).tobytes()

    records = []
    for op, batched, per, read, written, kernels_per_batch in (
        ("write", write_batched, write_per_seq, n * in_row, n * rb, 1),
        ("write, 'error'", write_batched_error, None, 2 * n * in_row, n * rb, 2),
        ("gather", gather_batched, gather_per_seq, n * rb, n * dim * 2, 1),
    ):
        ops_per = launches.count(per)[0] if per is not None else None
        ops_batched, kernels = launches.count(batched)
        rec: dict[str, Any] = {
            "n_seqs": n_seqs, "storage": storage, "op": op, "rows": n, "dim": dim, "wrapped_seqs": wraps,
            "ops_per_seq_calls": ops_per, "ops_batched": ops_batched, "bytes": read + written,
            "correct": (ok_gather if op == "gather" else ok_write) and kernels in (-1, kernels_per_batch),
        }
        # Timed on the emulated device too (one call each, not reported), so a rehearsal runs this code.
        half = (read + written) // 2
        a, b = cuda.DeviceArray((half,), np.uint8), cuda.DeviceArray((half,), np.uint8)
        t_copy = device_us(lambda: cu.copy_device(b.ptr, a.ptr, half, 0), args.reps, args.inner)
        t_batch = device_us(batched, args.reps, args.inner)
        t_per = device_us(per, args.reps, max(1, args.inner // 8)) if per is not None else None
        rec.update(us_batched=t_batch, us_per_seq_calls=t_per, us_copy=t_copy,
                   gbps_batched=(read + written) / t_batch / 1e3, gbps_copy=2 * half / t_copy / 1e3)
        records.append(rec)
    return records, all(r["correct"] for r in records)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=C.parse_size, default=4096, help="feature dim D (default 4096)")
    ap.add_argument("--rows", type=int, default=16, help="rows per sequence in a batch (default 16)")
    ap.add_argument("--block", type=int, default=16, help="block size B (default 16)")
    ap.add_argument("--window", type=int, default=256, help="window W (default 256: a small table)")
    ap.add_argument("--seqs", type=C.parse_list, default=list(N_SEQS), help="batch sizes N (default 16,64,256)")
    ap.add_argument("--storages", default="q8_0,bf16", help="comma-separated storages (default q8_0,bf16)")
    ap.add_argument("--reps", type=int, default=7, help="timed loops per figure (median)")
    ap.add_argument("--inner", type=int, default=50, help="calls per timed loop")
    ap.add_argument("--json", action="store_true", help="print one JSON record per (N, storage, op)")
    args = ap.parse_args()
    if not cuda.available():
        print(f"bench_ring_batches: no CUDA device ({cuda.unavailable_reason()})", file=sys.stderr)
        return 2
    emulated = cuda._backend._emulated()
    if emulated:  # timings run once each (the code path), and are not reported
        args.reps, args.inner = 1, 1
    launches = Launches()
    rng = np.random.default_rng(0)
    records, ok = [], True
    for storage in args.storages.split(","):
        for n_seqs in args.seqs:
            print(f"  N={n_seqs} {storage}", file=sys.stderr, flush=True)
            recs, good = run_case(n_seqs, storage, args, launches, rng)
            records += recs
            ok &= good
    if args.json:
        for r in records:
            print(json.dumps({k: v for k, v in r.items() if not (emulated and k.startswith(("us_", "gbps_")))}))
        return 0 if ok else 1
    where = ("EMULATED device (a CPU model of the kernels): launches and bytes only, no timings"
             if emulated else f"device 0: {CU.device_name(0)}")
    lines = C.header_lines("Batched gather / write of external rows (DeviceRing)", [
        where, f"D = {args.dim}, {args.rows} rows per sequence, stage dtype bfloat16, nonfinite='clamp'; "
               "write, 'error': the status form under nonfinite='error' (a read-only check launch, then the write "
               "gated on it; its bytes read count the rows twice)",
        "per-seq calls: a launch per run of each sequence's slots (what write / gather(plan) do; a gather to "
        "the storage's own format is a copy per run instead); batched: one kernel launch over the flat slot "
        "array (write_slots / gather_slots / gather(batch_plan); checked on the emulated device)",
        "GB/s = (bytes read + bytes written) / time; copy: a device-to-device copy of the same bytes, same run",
    ])
    head = ["N", "storage", "op", "rows", "seqs wrapped", "launches per-seq", "launches batched", "bytes == CPU"]
    if not emulated:
        head += ["us per-seq", "us batched", "GB/s batched", "GB/s copy", "batched / copy"]
    rows = []
    for r in records:
        row = [r["n_seqs"], r["storage"], r["op"], r["rows"], r["wrapped_seqs"],
               "-" if r["ops_per_seq_calls"] is None else r["ops_per_seq_calls"], r["ops_batched"],
               "yes" if r["correct"] else "**NO**"]
        if not emulated:
            per = r["us_per_seq_calls"]
            row += ["-" if per is None else f"{per:.1f}", f"{r['us_batched']:.1f}", f"{r['gbps_batched']:.0f}",
                    f"{r['gbps_copy']:.0f}", f"{r['gbps_batched'] / r['gbps_copy']:.2f}"]
        rows.append(row)
    lines += C.table(head, rows, "lll" + "r" * (len(head) - 3))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
