#!/usr/bin/env bash
# GPU check for dspark_core's CUDA row conversion, in one go (< 5 minutes):
#   1. builds and installs the package with the CUDA kernels (DSPARK_CUDA=ON),
#   2. runs the GPU tests (tests/test_cuda.py: GPU bytes == CPU bytes; tests/test_device_ring.py,
#      tests/test_ring_batches.py: the rows of external-row Stagers on the device, CUDA graphs;
#      tests/test_device_prefix.py: a prefix store's rows on the device; tests/test_graph_server.py
#      and examples/graph_server.py --step graph: a server's whole loop on one captured graph),
#   3. prints conversion throughput (GB/s) next to device-to-device copy
#      bandwidth on the same GPU,
#   4. runs bench/bench_ring_batches.py: launches per batch, per-sequence vs batched, and
#      the batched gather / write bandwidth against a device copy at N = 16, 64, 256,
#   5. runs bench/bench_device_step.py: host synchronisations and launches per step of the
#      device step against the host path, and its CPU twin's step time against the same work,
#   6. where this Python has vLLM with a CUDA torch: the vLLM plugin's tests and its cost per
#      engine step (bench/bench_vllm.py) on the GPU.
#
# Needs: an NVIDIA GPU + a driver new enough for the CUDA toolkit's runtime
# (CUDA 13 needs driver >= 580; the runtime is linked statically), nvcc
# (CUDA >= 11.2) on PATH or at /usr/local/cuda/bin, a C++17 compiler, Python
# >= 3.10 with the build requirements already installed (scikit-build-core,
# cython, cython-cmake, ninja, cmake: it builds with --no-build-isolation)
# and numpy, ml_dtypes, gguf, pytest, hypothesis. A preflight step checks
# these first and stops with the list of what is missing. cupy / torch are
# optional: the tests always use dspark_core.cuda.DeviceArray, and also cupy
# and / or torch when they reach the GPU. Set GPU_CHECK_CUPY=1 to try
# `pip install cupy-cuda13x` (then cupy-cuda12x) first (needs the package index).
#
# Usage: bash bench/gpu_check.sh            (from anywhere in the repository)
# Env:   GPU_CHECK_ARCHS  CUDA architectures to build (default: the GPU's own,
#                         queried with nvidia-smi, e.g. "90-real"; falls back to
#                         the project default list)
#        GPU_CHECK_ROWS / GPU_CHECK_DIM  benchmark shape (default 32768 x 4096:
#                         512 MiB of f32, so a launch takes ~0.1-0.3 ms and the
#                         per-call host overhead is a few percent)
#        GPU_CHECK_CUDA   DSPARK_CUDA mode to build (default ON). EMULATE
#                         rehearses the whole script on a machine without a
#                         GPU (emulated device; use a tiny shape: the figures
#                         are then CPU figures, not GPU ones).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
log() { printf '\n=== [%3ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
PY=${PYTHON:-python3}

MODE=${GPU_CHECK_CUDA:-ON}

log "environment + preflight"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader || echo "nvidia-smi failed"
if [ "$MODE" != "EMULATE" ]; then
  nvcc --version | tail -2 || { echo "nvcc not found: cannot build the kernels"; exit 2; }
fi
$PY - <<'EOF'
import importlib.util, sys
need = ["numpy", "ml_dtypes", "gguf", "pytest", "hypothesis", "scikit_build_core", "Cython", "cython_cmake"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print("python", sys.version.split()[0])
import shutil
if shutil.which("cmake") is None and importlib.util.find_spec("cmake") is None:
    missing.append("cmake")
if missing:
    raise SystemExit(f"missing Python packages: {', '.join(missing)} (install them first; this script "
                     "builds with --no-build-isolation and downloads nothing)")
EOF

# Build only for this GPU unless told otherwise (keeps the build to seconds).
ARCHS=${GPU_CHECK_ARCHS:-}
if [ -z "$ARCHS" ]; then
  CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
  if [[ "$CC" =~ ^[0-9]+$ ]]; then ARCHS="${CC}-real"; else ARCHS="75-real;80-real;90-real;90-virtual"; fi
fi
ARCH_ARGS=(-C "cmake.define.DSPARK_CUDA_ARCHITECTURES=$ARCHS")
if [ "$MODE" = "EMULATE" ]; then ARCHS="none (emulated)"; ARCH_ARGS=(); fi

if [ "${GPU_CHECK_CUPY:-0}" = "1" ] && ! $PY -c "import cupy" >/dev/null 2>&1; then
  log "installing cupy (optional)"
  timeout 120 $PY -m pip install -q cupy-cuda13x || timeout 120 $PY -m pip install -q cupy-cuda12x \
    || echo "cupy not installed; continuing without it"
fi

log "build + install with DSPARK_CUDA=$MODE (architectures: $ARCHS)"
DSPARK_CUDA=$MODE $PY -m pip install -q --no-build-isolation --no-deps . \
  -C build-dir="build/gpu_check_$MODE" ${ARCH_ARGS[@]+"${ARCH_ARGS[@]}"}
$PY - <<'EOF'
from dspark_core import cuda
print("dspark_core.cuda.available():", cuda.available(), "devices:", cuda.device_count(),
      "emulated:", cuda._emulated(), cuda.unavailable_reason())
if not cuda.available():
    raise SystemExit("CUDA not available after the build: see the reason above (an old driver? CUDA 13 needs >= 580)")
print("device 0:", cuda._cuda.device_name(0), "| runtime", cuda._cuda.runtime_version(),
      "| driver", cuda._cuda.driver_version())
for lib in ("cupy", "torch"):
    try:
        m = __import__(lib)
        print(f"{lib} {m.__version__} available")
    except Exception as exc:  # noqa: BLE001
        print(f"{lib} not available ({type(exc).__name__})")
EOF

log "GPU tests (tests/test_cuda.py, tests/test_device_ring.py, tests/test_ring_batches.py, tests/test_device_prefix.py, tests/test_cuda_device_step.py, tests/test_cuda_device_step_safety.py, tests/test_graph_server.py)"
$PY -m pytest tests/test_cuda.py tests/test_device_ring.py tests/test_ring_batches.py tests/test_device_prefix.py \
  tests/test_cuda_device_step.py tests/test_cuda_device_step_safety.py tests/test_graph_server.py -q -p no:cacheprovider -rfEs -x

log "graph server (examples/graph_server.py --step graph: the device step captured once into a CUDA graph)"
for layout in padded csr; do
  graph_out=$(cd examples && $PY graph_server.py --step graph --layout "$layout" --storage q8_0)
  echo "$graph_out"
  tail -n 1 <<<"$graph_out" | grep -qx "lossless: yes"
done

log "benchmark"
$PY - <<'EOF'
import os
import time

import ml_dtypes
import numpy as np

from dspark_core import cuda, formats

cu = cuda._cuda
ROWS = int(os.environ.get("GPU_CHECK_ROWS", 32768))
DIM = int(os.environ.get("GPU_CHECK_DIM", 4096))
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": BF16}


def timeit(fn, reps=20):
    fn()
    cu.synchronize(0)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        cu.synchronize(0)
        best = min(best, (time.perf_counter() - t) / reps)
    return best


rng = np.random.default_rng(0)
host = (rng.standard_normal((ROWS, DIM)) * rng.uniform(1e-2, 1e2, (ROWS, 1))).astype(np.float32)
print(f"rows x dim = {ROWS} x {DIM} ({ROWS * DIM / 1e6:.1f} M elements); GB/s = (bytes read + bytes written) / time")
if cuda._emulated():
    print("EMULATED DEVICE (GPU_CHECK_CUDA=EMULATE): a rehearsal; these are CPU figures, not GPU ones")

# Device-to-device copy bandwidth (the roofline for a streaming conversion).
nb = ROWS * DIM * 4
a = cuda.DeviceArray.from_numpy(host)
b = cuda.DeviceArray((ROWS, DIM), np.float32)
t = timeit(lambda: cu.copy_device(b.ptr, a.ptr, nb, 0))
copy_gbs = 2 * nb / t / 1e9
print(f"{'device-to-device copy (f32)':34s} {copy_gbs:8.1f} GB/s   {t * 1e3:7.3f} ms")

# Conversions are timed through the binding (one launch per call, no
# Python-side parsing), so the figures are the kernels' bandwidth; the public
# API's per-call overhead is measured once at the end.
KEEP, ERROR = cuda._backend._POLICY["keep"], cuda._backend._POLICY["error"]
print("\nencode (nonfinite='keep': no host sync; 'error' adds one sync + 8-byte readback)")
srcs = {k: cuda.DeviceArray.from_numpy(host.astype(dt)) for k, dt in DTYPES.items()}
encoded = {}
for st in formats.STORAGES:
    rb = formats.row_bytes(st, DIM)
    for k, dt in DTYPES.items():
        out = cuda.DeviceArray((ROWS, rb) if st[0] == "q" else (ROWS, DIM), formats.storage_dtype(st) if st != "bf16" else BF16)
        x = srcs[k]
        args = (x.ptr, cuda._backend._ELEM[dt], out.ptr, cuda._backend._STORAGE[st], ROWS, DIM)
        t = timeit(lambda: cu.encode(*args, KEEP, False, 0))
        moved = x.nbytes + out.nbytes
        print(f"  {k:>4s} -> {st:<5s}  {moved / t / 1e9:8.1f} GB/s  ({100 * moved / t / 1e9 / copy_gbs:5.1f}% of copy)  {t * 1e3:7.3f} ms")
        if k == "f32":
            encoded[st] = out
    x = srcs["f32"]
    args = (x.ptr, cuda._backend._ELEM[x.dtype], encoded[st].ptr, cuda._backend._STORAGE[st], ROWS, DIM)
    t = timeit(lambda: cu.encode(*args, ERROR, True, 0), reps=10)
    moved = x.nbytes + encoded[st].nbytes
    print(f"   f32 -> {st:<5s}  {moved / t / 1e9:8.1f} GB/s  (nonfinite='error', synchronous)  {t * 1e3:7.3f} ms")

print("\ndecode (same format in and out is a device copy)")
for st in formats.STORAGES:
    for k, dt in DTYPES.items():
        out = cuda.DeviceArray((ROWS, DIM), dt)
        data = encoded[st]
        args = (data.ptr, cuda._backend._STORAGE[st], out.ptr, cuda._backend._ELEM[dt], ROWS, DIM)
        t = timeit(lambda: cu.decode(*args, 0))
        moved = data.nbytes + out.nbytes
        print(f"  {st:>5s} -> {k:<4s}  {moved / t / 1e9:8.1f} GB/s  ({100 * moved / t / 1e9 / copy_gbs:5.1f}% of copy)  {t * 1e3:7.3f} ms")

# The public API's overhead: the same f32 -> q8_0 encode through quantize_rows.
x, out = srcs["f32"], encoded["q8_0"]
t_api = timeit(lambda: cuda.quantize_rows(x, "q8_0", nonfinite="keep", out=out))
args = (x.ptr, cuda._backend._ELEM[x.dtype], out.ptr, cuda._backend._STORAGE["q8_0"], ROWS, DIM)
t_raw = timeit(lambda: cu.encode(*args, KEEP, False, 0))
print(f"\nquantize_rows() vs the bare launch (f32 -> q8_0): {t_api * 1e3:.3f} ms vs {t_raw * 1e3:.3f} ms "
      f"({(t_api - t_raw) * 1e6:+.1f} us per call)")

# Spot check on the benchmark data: GPU bytes == CPU bytes.
for st in ("q8_0", "q4_0"):
    assert np.array_equal(encoded[st].get().view(np.uint8).reshape(-1),
                          formats.quantize_rows(host, st).view(np.uint8).reshape(-1)), st
print("\nbenchmark data: GPU q8_0 / q4_0 bytes == CPU bytes")

# DeviceRing: the rows of an external-row Stager on the device. write = Stager.process +
# encode into the returned slots; gather = decode a plan's staged slots into one array.
# Through the public API (the Stager's bookkeeping and the Python layer included).
from dspark_core import Stager, StagerConfig
from dspark_core.cuda.device_ring import slot_runs

N = max(64, ROWS // 2)  # rows per write; W = 2N, so a rebase plan stages N rows
print(f"\nDeviceRing (external-row Stager, W = {2 * N}, B = 16): {N} rows per write / gather; "
      "GB/s = (bytes read + bytes written) / time")
xw = cuda.DeviceArray.from_numpy(host[:N])
for st in formats.STORAGES:
    rb = formats.row_bytes(st, DIM)
    for policy in ("zero", "error"):
        stager = Stager(StagerConfig(DIM, 16, 2 * N, storage=st, rows="external", nonfinite=policy))
        ring = cuda.DeviceRing(stager, backend="dspark")
        at = [0]
        written = [0]

        def write():
            p = at[0]
            slots = ring.write(0, np.arange(p, p + N), xw)
            at[0] = p + N
            written[0] = int((slots >= 0).sum())

        t = timeit(write, reps=5)
        moved = N * DIM * 4 + written[0] * rb
        how = "validate + copy, synchronous" if policy == "error" else "straight into the slots"
        print(f"  write  f32 -> {st:<5s} {moved / t / 1e9:8.1f} GB/s  ({100 * moved / t / 1e9 / copy_gbs:5.1f}% of copy)"
              f"  {t * 1e3:7.3f} ms  (nonfinite={policy!r}: {how})")
    plan = stager.draft(0, at[0])
    k = plan.n_rows
    for k_name, dt in (("f32", np.dtype(np.float32)), ("bf16", BF16)):
        out = cuda.DeviceArray((k, DIM), dt)
        t = timeit(lambda: ring.gather(plan, dt, out=out), reps=5)
        moved = k * rb + k * DIM * dt.itemsize
        print(f"  gather {st:>5s} -> {k_name:<4s} {moved / t / 1e9:8.1f} GB/s  ({100 * moved / t / 1e9 / copy_gbs:5.1f}% of copy)"
              f"  {t * 1e3:7.3f} ms  ({k} rows in {len(slot_runs(plan.slots))} run(s))")
    stager.commit(0)
EOF

log "batches of sequences (bench/bench_ring_batches.py)"
if [ "$MODE" = "EMULATE" ]; then
  # The emulated device: launches and bytes only (a CPU model of the kernels), small rows.
  $PY bench/bench_ring_batches.py --dim "${GPU_CHECK_DIM:-512}" --rows 4 --storages q8_0,q4_0,bf16,f32
else
  $PY bench/bench_ring_batches.py --dim "${GPU_CHECK_DIM:-4096}" --rows 16 --storages q8_0,q4_0,bf16,f32
fi

log "the device step (bench/bench_device_step.py; ctest test_cuda_step checks the kernel on the emulated device)"
# Host synchronisations and launches per step, the CPU twin against the host path's batch
# calls (the same work), and the step as a captured graph against the host path plus the
# copy of the accept counts it needs (step time with and without the sync).
if [ "$MODE" = "EMULATE" ]; then
  # The emulated device: launches only (its times are a CPU model's), a small window.
  $PY bench/bench_device_step.py --ns 16 --window 64 --block 4 --steps 20 --warmup 3
else
  $PY bench/bench_device_step.py --ns 64,256,1024 --steps 100
fi

log "the vLLM plugin on vLLM's CUDA build (tests/test_vllm_plugin.py, tests/test_vllm_staging.py, bench/bench_vllm.py)"
# Only where this Python already has vLLM with a GPU torch (this script installs nothing that large):
# the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0), the row table and the drafter's inputs on the GPU.
if [ "$MODE" != "EMULATE" ] && $PY -c "import torch, vllm; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  VLLM_USE_V2_MODEL_RUNNER=0 $PY -m pytest tests/test_vllm_plugin.py tests/test_vllm_staging.py -q -p no:cacheprovider -rfEs
  for method in eagle3 dflash; do
    VLLM_USE_V2_MODEL_RUNNER=0 $PY bench/bench_vllm.py --method "$method" --size small --general
  done
else
  echo "skipped: no vLLM with a CUDA torch in this Python (or the emulated device); docs/vllm.md, Tests and CI"
fi
log "done"
