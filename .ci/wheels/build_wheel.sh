#!/usr/bin/env bash
# Builds a manylinux_2_28 wheel of dspark_core for x86_64 or aarch64 on any
# x86-64 Linux, without a container runtime: zig's clang (the `ziglang` PyPI
# package) targets glibc 2.28 and links GCC 12's libstdc++ statically
# (zig-c++), so the extensions need glibc >= 2.28 and libgcc_s.so.1, and the
# SDK library inside (libdspark_core.so, the one copy of the core that the
# extensions load) keeps GCC's C++ ABI. The CUDA kernels are built for every
# release architecture (DSPARK_CUDA_ARCHITECTURES=release; a plain `pip install .`
# builds only the visible GPU's). aarch64 is a cross build: Python's
# headers come from an arm64 Debian root (ARM64_ROOT, made by
# .ci/arm64_root.sh), NumPy's from its aarch64 wheel. x86_64 gets the CUDA
# extension where nvcc is found (DSPARK_CUDA, default AUTO): nvcc compiles
# with GCC as its host compiler, zig links, so the CUDA variant is
# manylinux_2_28 too. aarch64 is the CPU wheel (no aarch64 CUDA toolkit here).
#
#   .ci/wheels/build_wheel.sh x86_64|aarch64 OUTDIR
#
# Then `auditwheel show` must find it consistent with manylinux_2_28 or
# older and needing no library outside glibc (and libgcc_s), and `wheel tags` tags it
# manylinux_2_28_<arch>. Prints the wheel's path last. Environment: PYTHON (a
# Python 3.11 with the build requirements: scikit-build-core, cython,
# cython-cmake, numpy, ziglang, auditwheel, wheel), ARM64_ROOT and
# ARM64_WHEELS (aarch64 only: a directory holding the aarch64 numpy wheel).
set -euo pipefail
arch=${1:?arch: x86_64 or aarch64}
out=${2:?output directory}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

export DSPARK_ZIG="$PY -m ziglang" DSPARK_ZIG_TARGET="$arch-linux-gnu.2.28"
defs=(-C "cmake.define.CMAKE_TOOLCHAIN_FILE=$here/zig-toolchain.cmake" -C "build-dir=$work/build" -C build.verbose=true)
if [ "$arch" = x86_64 ]; then
  export DSPARK_CUDA=${DSPARK_CUDA:-AUTO}
  defs+=(-C "cmake.define.CMAKE_CUDA_HOST_COMPILER=$(command -v g++)" -C "cmake.define.DSPARK_CUDA_ARCHITECTURES=release")
elif [ "$arch" = aarch64 ]; then
  export DSPARK_CUDA=OFF
  : "${ARM64_ROOT:?ARM64_ROOT: an arm64 Debian root with libpython3.11-dev (.ci/arm64_root.sh)}"
  : "${ARM64_WHEELS:?ARM64_WHEELS: a directory holding the aarch64 numpy wheel}"
  # Debian splits pyconfig.h by architecture: one include directory for the build.
  cp -r "$ARM64_ROOT/usr/include/python3.11" "$work/pyinc"
  cp "$ARM64_ROOT/usr/include/aarch64-linux-gnu/python3.11/pyconfig.h" "$work/pyinc/pyconfig.h"
  (cd "$work" && "$PY" -m zipfile -e "$(ls "$ARM64_WHEELS"/numpy-*aarch64*.whl | head -1)" npwheel)
  export _PYTHON_HOST_PLATFORM=linux-aarch64 SETUPTOOLS_EXT_SUFFIX=.cpython-311-aarch64-linux-gnu.so
  defs+=(-C "cmake.define.Python_INCLUDE_DIR=$work/pyinc"
         -C "cmake.define.Python_NumPy_INCLUDE_DIR=$work/npwheel/numpy/_core/include")
else
  echo "build_wheel.sh: arch must be x86_64 or aarch64, got $arch" >&2
  exit 2
fi

(cd "$root" && "$PY" -m pip wheel . -v --no-build-isolation --no-deps -w "$work/raw" "${defs[@]}") >"$work/build.log" 2>&1 \
  || { tail -60 "$work/build.log"; exit 1; }
grep -E "dspark: CUDA kernels" "$work/build.log" >&2 || true
if grep -q "dspark: CUDA kernels enabled" "$work/build.log"; then
  # The GPUs DSpark runs on, from the nvcc command lines themselves: Hopper
  # and GH200 (sm_90), Blackwell B200 / GB200 (sm_100), RTX Blackwell
  # (sm_120) and the DGX Spark's GB10 (sm_121).
  codes=$(grep -o 'arch=compute_[0-9]*,code=\[[a-z_0-9,]*\]' "$work/build.log" | sort -u | tr '\n' ' ')
  echo "nvcc targets: $codes" >&2
  for sm in sm_90 sm_100 sm_120 sm_121; do
    case "$codes" in *"$sm]"* | *"$sm,"*) ;; *) echo "build_wheel.sh: no $sm code in the CUDA build" >&2; exit 1 ;; esac
  done
fi
raw=$(ls "$work"/raw/*.whl)
show=$("$PY" -m auditwheel show "$raw" 2>&1)
echo "$show" | grep -v '^INFO' >&2
tag=$(echo "$show" | sed -n 's/.*following platform tag: "manylinux_\([0-9]*\)_\([0-9]*\)_.*/\1 \2/p')
read -r major minor <<<"${tag:-99 99}"
if [ "$major" -ne 2 ] || [ "$minor" -gt 28 ]; then
  echo "build_wheel.sh: the $arch wheel needs manylinux_${major}_${minor}, newer than manylinux_2_28" >&2
  exit 1
fi
if echo "$show" | grep -qi "requires additional\|will be grafted"; then
  echo "build_wheel.sh: the $arch wheel needs a library outside glibc" >&2
  exit 1
fi
# Nothing to graft (auditwheel show lists only glibc's libraries, checked
# above): the manylinux tag is a retag. (auditwheel repair takes only the
# host's architecture.)
"$PY" -m wheel tags --remove --platform-tag "manylinux_2_28_$arch" "$raw" >/dev/null
mv "$(ls "$work"/raw/*manylinux_2_28_"$arch".whl)" "$out/"
ls "$out"/dspark_core-*manylinux_2_28_"$arch".whl
