#!/usr/bin/env python3
"""Row-format conversion throughput: dspark_core vs memcpy, numpy/ml_dtypes, gguf-py, ggml-cpu.

Prints a markdown table. Throughput is GB/s of the *float32 side* of each
conversion (rows * dim * 4 bytes, whatever the storage), so every row is
comparable with the memcpy baseline (``np.copyto`` of a float32 array of the
same size, measured in the same run). Times are the median of N repeats, all
single-threaded, into preallocated outputs.

    python bench/bench_convert.py            # 512 x 25,600 rows (~2 min max)
    python bench/bench_convert.py --quick    # 64 x 25,600, 3 repeats

The ggml-cpu columns (ggml's own SIMD row converters, docs/design.md section 6)
appear when a libggml-cpu is found (``$DSPARK_GGML_LIB_DIR`` or an installed
llama-cpp-python; see ggml_cpu.py), with a check of whose bytes equal ggml's
reference quantizers.

Targets (docs/design.md section 6): every conversion at >= 80% of a memcpy of the
same float32 bytes measured at the same moment, and as fast as ggml-cpu's converters
where ggml has one: a paired ratio >= 0.95. Both sides of that pair run at memory
bandwidth, so a tie reads anywhere near 1.0 and ">= 1.0" would be a coin toss.

Not a test (never collected by pytest: no ``test_`` names, lives in bench/).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import Callable

import gguf
import ml_dtypes
import numpy as np

import _common  # bench/ is on sys.path when a script here runs
import ggml_cpu

from dspark_core import formats
from dspark_core.stager.core_tables import STORAGE_FORMATS

#: Target: conversion throughput / memcpy throughput measured at the same moment.
MIN_VS_MEMCPY = 0.8
#: Target: ggml-cpu time / dspark time, paired. Below 1.0 because both are memory bound:
#: equal speed measures as a ratio scattered around 1.0.
MIN_VS_GGML = 0.95

BF16 = np.dtype(ml_dtypes.bfloat16)
QT = {
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (page faults, caches)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def paired_medians(fa: Callable[[], object], fb: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median times of two functions timed alternately (a, b, a, b, ...), so
    that a shared machine's drift hits both alike: for head-to-head ratios."""
    fa()
    fb()
    ta, tb = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fa()
        ta.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fb()
        tb.append(time.perf_counter() - t0)
    return float(np.median(ta)), float(np.median(tb))


def on_path(path: str, fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` run on SIMD path ``path`` (the switch costs microseconds; a call, milliseconds)."""
    def run() -> None:
        with formats.simd_path(path):
            fn()
    return run


def path_and_scalar(path: str, nbytes: int, fn: Callable[[], object], reps: int) -> dict[str, float]:
    """GB/s of ``fn`` on SIMD path ``path`` and on the scalar one, timed alternately."""
    t_path, t_scalar = paired_medians(on_path(path, fn), on_path("scalar", fn), reps)
    return {path: gbps(nbytes, t_path), "scalar": gbps(nbytes, t_scalar)}


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="rows (default 512, --quick 64)")
    ap.add_argument("--dim", type=int, default=25600, help="feature dim (default 25,600)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7, --quick 3)")
    ap.add_argument("--gguf-rows", type=int, default=8, help="rows for the (slow) gguf-py column")
    ap.add_argument("--quick", action="store_true", help="small, fast run")
    ap.add_argument("--path", default=None,
                    help="dspark SIMD path of the main column and the ggml-cpu pairing (default: the best this "
                         "CPU supports; e.g. avx2 for what an AVX2-only machine runs)")
    ap.add_argument("--json", default=None, help="write the target verdicts as JSON to this file")
    args = ap.parse_args(argv)
    if args.path is not None and args.path not in formats.simd_paths():
        ap.error(f"--path {args.path!r}: this CPU / build supports {formats.simd_paths()}")
    rows = args.rows or (64 if args.quick else 512)
    reps = args.repeats or (3 if args.quick else 9)
    dim = args.dim
    grows = min(args.gguf_rows, rows)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    x[:, rng.choice(dim, 8, replace=False)] *= 1e3  # a few massive channels
    nbytes = x.nbytes
    gbytes = grows * dim * 4
    xs = np.ascontiguousarray(x[:grows])

    print(f"# Row conversion throughput ({rows} x {dim:,} float32 = {nbytes / 1e6:.1f} MB)")
    print()
    print(f"- command: `{_common.command_line()}`")
    print(f"- machine: {_common.cpu_model()}, {os.cpu_count()} logical cores; {platform.platform()}")
    print(f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"- numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}, gguf {getattr(gguf, '__version__', '?')}")
    path = args.path or formats.best_simd_path()
    print(f"- dspark SIMD paths: {formats.simd_paths()}, best = {formats.best_simd_path()}, measured = {path}")
    print(f"- GB/s of the float32 side; median of {reps}; single thread; gguf-py on {grows} rows")
    ggml, ggml_from = ggml_cpu.load()
    print(f"- ggml-cpu: {_common.display_path(ggml_from) if ggml else 'not measured: ' + ggml_from}")
    print()

    dst32 = np.empty_like(x)
    t_memcpy = median_time(lambda: np.copyto(dst32, x), reps)
    mem = gbps(nbytes, t_memcpy)
    print(f"memcpy baseline at start (np.copyto float32 -> float32): **{mem:.2f} GB/s**")
    print()

    header = ["storage", "direction", f"dspark {path}", "dspark scalar", "numpy/ml_dtypes", "gguf-py",
              "ggml-cpu", "memcpy (same moment)", f"{path} / memcpy", f"{path} / ggml-cpu (paired)"]
    exactness: list[str] = []
    vs_memcpy: list[tuple[str, float]] = []
    vs_ggml: list[tuple[str, float]] = []
    guard: list[str] = []

    def memcpy_now() -> float:
        # Re-measured next to every row: shared machines drift a lot.
        return gbps(nbytes, median_time(lambda: np.copyto(dst32, x), reps))
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] * len(header)) + "|")

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for storage in formats.STORAGES:
        enc = formats.quantize_rows(x, storage)
        enc_out = np.empty_like(enc)
        enc_small = formats.quantize_rows(xs, storage)
        out32 = np.empty((rows, dim), np.float32)
        out16 = np.empty((rows, dim), np.float16)

        # ---- encode from f32. "keep" runs the same one-pass kernel, the fused
        # NaN / Inf / overflow check included, without the out= guarantee that
        # "error" adds (a rejected call leaves out untouched: one more read of
        # x or a save of out); that guarantee's cost is printed after the table.
        def encode() -> object:
            return formats.quantize_rows(x, storage, nonfinite="keep", out=enc_out)

        res = path_and_scalar(path, nbytes, encode, reps)
        t_err, t_keep = paired_medians(on_path(path, lambda: formats.quantize_rows(x, storage, out=enc_out)),
                                       on_path(path, encode), reps)
        guard.append(f"{storage} {t_keep / t_err:.2f}")
        npv = None
        if storage in ("f32", "f16", "bf16"):
            tgt = {"f32": dst32, "f16": out16, "bf16": enc_out}[storage]
            npv = gbps(nbytes, median_time(lambda: np.copyto(tgt, x, casting="unsafe"), reps))
        if storage == "f32":
            gg = None
        elif storage == "f16":
            gg = gbps(gbytes, median_time(lambda: gguf.quantize(xs, gguf.GGMLQuantizationType.F16), reps))
        else:
            with np.errstate(all="ignore"):
                gg = gbps(gbytes, median_time(lambda: gguf.quantize(xs, QT[storage]), max(1, reps // 2)))
        gc = vs = None
        if ggml is not None and ggml.has(storage):
            gout = np.empty_like(enc_out)
            t_ours, t_ggml = paired_medians(on_path(path, encode),
                                            lambda: ggml.encode(storage, x, gout), reps)
            gc, vs = gbps(nbytes, t_ggml), t_ggml / t_ours
            vs_ggml.append((f"encode f32 -> {storage}", vs))
            exactness.append(_compare_with_ggml(ggml, storage, x, enc))
        m = memcpy_now()
        vs_memcpy.append((f"encode f32 -> {storage}", res[path] / m))
        print(f"| {storage} | encode f32 -> {storage} | {fmt(res[path])} | {fmt(res['scalar'])} | {fmt(npv)} "
              f"| {fmt(gg)} | {fmt(gc)} | {m:.2f} | {res[path] / m:.2f} | {fmt(vs)} |")

        # ---- decode to f32 / f16
        for od, out in ((np.float32, out32), (np.float16, out16)):
            odn = np.dtype(od).name
            res = path_and_scalar(path, nbytes, lambda: formats.dequantize_rows(enc, storage, dim, od, out=out), reps)
            npv = None
            if storage in ("f32", "f16", "bf16"):
                npv = gbps(nbytes, median_time(lambda: np.copyto(out, enc, casting="unsafe"), reps))
            if storage == "f32":
                gg = None
            else:
                raw = enc_small.view(np.uint8)
                if storage == "f16":
                    fn = lambda: gguf.dequantize(raw.view(np.float16), gguf.GGMLQuantizationType.F16).astype(od)  # noqa: E731
                elif storage == "bf16":
                    fn = lambda: gguf.dequantize(raw, QT["bf16"]).astype(od)  # noqa: E731
                else:
                    bb = STORAGE_FORMATS[storage].block_bytes
                    fn = lambda: gguf.dequantize(raw.reshape(-1, bb), QT[storage]).astype(od)  # noqa: E731
                with np.errstate(all="ignore"):
                    gg = gbps(gbytes, median_time(fn, reps))
            gc = vs = None
            if ggml is not None and od == np.float32 and ggml.has_decode(storage):
                gout32 = np.empty_like(out)
                t_ours, t_ggml = paired_medians(on_path(path, lambda: formats.dequantize_rows(enc, storage, dim, od,
                                                                                           out=out)),
                                                lambda: ggml.decode(storage, enc, gout32), reps)
                gc, vs = gbps(nbytes, t_ggml), t_ggml / t_ours
                vs_ggml.append((f"decode {storage} -> float32", vs))
                if not np.array_equal(gout32.view(np.uint32), out.view(np.uint32)):
                    exactness.append(f"decode {storage} -> float32: ggml-cpu and dspark bytes differ")
            m = memcpy_now()
            vs_memcpy.append((f"decode {storage} -> {odn}", res[path] / m))
            print(f"| {storage} | decode {storage} -> {odn} | {fmt(res[path])} | {fmt(res['scalar'])} "
                  f"| {fmt(npv)} | {fmt(gg)} | {fmt(gc)} | {m:.2f} | {res[path] / m:.2f} | {fmt(vs)} |")
    print()
    print("numpy/ml_dtypes = `np.copyto(dst, src, casting='unsafe')` (astype into a preallocated array); "
          "gguf-py includes its allocations. ggml-cpu = one call over all rows, single thread; the last "
          "column times dspark and ggml-cpu alternately (same moments), > 1 = dspark faster. The two dspark "
          "columns are timed alternately too.")
    print()
    print("Encode rows time `quantize_rows(x, storage, nonfinite='keep', out=...)`: the one-pass kernel with "
          "its fused NaN / Inf / overflow check. Under the default nonfinite='error' with `out=`, a rejected "
          "call must leave `out` untouched, which costs one more read of x (float storages) or a save of "
          "`out` (q formats); that call's throughput relative to the kernel's (paired): " + ", ".join(guard) + ".")
    if exactness:
        print()
        print("Bytes against ggml (the same input as the table):")
        print()
        for line in exactness:
            print(f"- {line}")
    if args.json:
        worst = min(vs_ggml, key=lambda r: r[1]) if vs_ggml else None
        best = max(vs_ggml, key=lambda r: r[1]) if vs_ggml else None
        low = min(vs_memcpy, key=lambda r: r[1])
        targets = [
            {"target": "conversion / memcpy (min over storages and directions)", "value": low[1],
             "high": max(v for _, v in vs_memcpy), "threshold": MIN_VS_MEMCPY,
             "pass": low[1] >= MIN_VS_MEMCPY, "where": f"{rows} x {dim:,}, worst: {low[0]}"},
            {"target": "conversion / ggml-cpu, paired (min over comparable rows)",
             "value": None if worst is None else worst[1], "high": None if best is None else best[1],
             "threshold": MIN_VS_GGML, "pass": None if worst is None else worst[1] >= MIN_VS_GGML,
             "where": "no libggml-cpu found" if worst is None else f"worst: {worst[0]}"},
        ]
        _common.write_json(args.json, {"targets": targets, "vs_ggml": dict(vs_ggml)})
    return 0


def _compare_with_ggml(ggml: ggml_cpu.GgmlCpu, storage: str, x: np.ndarray, ours: np.ndarray) -> str:
    """Whose bytes equal what: dspark vs ggml-cpu's SIMD converter and ggml's reference."""
    simd = np.empty_like(ours)
    ggml.encode(storage, x, simd)
    fmt = STORAGE_FORMATS[storage]
    bb = fmt.block_bytes if fmt.quantized else None
    if bb is None:
        same = np.array_equal(simd.view(np.uint16), ours.view(np.uint16))
        return f"encode f32 -> {storage}: ggml-cpu SIMD {'==' if same else '!='} dspark"
    a, b = simd.reshape(-1, bb), ours.reshape(-1, bb)
    differ = int(np.count_nonzero((a != b).any(axis=1)))
    line = f"encode f32 -> {storage}: ggml-cpu SIMD differs from dspark in {differ:,} of {len(a):,} blocks"
    if ggml.has(storage, ref=True):
        ref = np.empty_like(ours)
        ggml.encode(storage, x, ref, ref=True)
        rdiff = int(np.count_nonzero((ref.reshape(-1, bb) != b).any(axis=1)))
        line += f"; ggml's reference (quantize_row_{storage}_ref) differs from dspark in {rdiff:,}"
    return line


if __name__ == "__main__":
    sys.exit(main())
