#!/usr/bin/env bash
# Sanitizers and bounded fuzzing (called by .ci/run). Exits non-zero on any finding.
#
#  1. ASan + UBSan build of the core and its ctest tests (-DDSPARK_SANITIZE=ON), ctest; then
#     the Cython binding built the same way and the pytest suite run against it.
#  2. libFuzzer targets (csrc/fuzz, clang): fuzz_stager (held and external-row mode with a
#     mirror table, threads), fuzz_formats, fuzz_c_api (the C ABI against the C++ API),
#     fuzz_prefix (the prefix store: ops under budget pressure, damaged block imports): replay
#     the recorded findings, then fuzz each target for FUZZ_SECONDS from a copy of its seed
#     corpus (tests/fuzz_corpus/cpp_*), and print its coverage (libFuzzer's cov / ft).
#  3. atheris (python -m dspark_core.testing.fuzz) on the ops (held + external mirror) /
#     threads / snapshot / decode targets for PY_FUZZ_SECONDS each, from a copy of
#     tests/fuzz_corpus/<target>.
#
# Environment: FUZZ_SECONDS (default 60), PY_FUZZ_SECONDS (default 30), PYTHON (default
# python3; must import dspark_core), SAN_CXX (compiler of the sanitizer ctest build, default
# g++: Debian bookworm's clang 14 rejects __builtin_cpu_supports("f16c") in row_format.cpp),
# FUZZ_WORK (scratch dir, default a mktemp dir).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FUZZ_SECONDS="${FUZZ_SECONDS:-60}"
PY_FUZZ_SECONDS="${PY_FUZZ_SECONDS:-30}"
PYTHON="${PYTHON:-python3}"
SAN_CXX="${SAN_CXX:-g++}"
WORK="${FUZZ_WORK:-$(mktemp -d /tmp/dspark-fuzz.XXXXXX)}"
mkdir -p "$WORK"
JOBS="$(nproc 2>/dev/null || echo 2)"
CORPUS="$ROOT/tests/fuzz_corpus"
status=0
say() { printf '\n== %s\n' "$*"; }

# -- tools ---------------------------------------------------------------------------
need_apt=()
command -v clang++ >/dev/null 2>&1 || need_apt+=(clang)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq </dev/null >/dev/null
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" </dev/null >/dev/null
fi
CLANG_MAJOR="$(clang++ --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -1)"
if ! clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a | grep -q / || \
   [ ! -e "$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a)" ]; then
  if ! ls /usr/lib/llvm-"$CLANG_MAJOR"/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
    say "installing libclang-rt-$CLANG_MAJOR-dev (libFuzzer runtime)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "libclang-rt-$CLANG_MAJOR-dev" </dev/null >/dev/null || true
  fi
fi

# -- 1. sanitizer ctest build ----------------------------------------------------------
say "ASan + UBSan ctest build ($SAN_CXX)"
SAN_CC="${SAN_CXX/g++/gcc}"; SAN_CC="${SAN_CC/clang++/clang}"
CC="$SAN_CC" CXX="$SAN_CXX" cmake -S "$ROOT" -B "$WORK/san" -G Ninja -DDSPARK_BUILD_TESTS=ON \
  -DDSPARK_SANITIZE=ON -DDSPARK_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$WORK/san-configure.log"
cmake --build "$WORK/san" -j"$JOBS" >"$WORK/san-build.log" || { tail -30 "$WORK/san-build.log"; exit 1; }
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
if ! (cd "$WORK/san" && ctest --output-on-failure -j"$JOBS"); then status=1; fi

# -- 1b. the Cython binding under ASan + UBSan: the whole pytest suite (minus GPU tests)
#        against a sanitized build. Python
#        itself is not instrumented, so libasan (and libstdc++, for ASan's throw interceptor)
#        are preloaded; leak checking is off (CPython's own allocations would drown it).
say "ASan + UBSan: pytest against a sanitized build of the extension"
ASAN_VENV="$WORK/asan-venv"
"$PYTHON" -m venv "$ASAN_VENV"
"$ASAN_VENV/bin/python" -m pip install -q scikit-build-core cython cython-cmake numpy ninja pytest hypothesis ml_dtypes gguf prometheus-client \
  </dev/null >"$WORK/asan-pip.log" 2>&1 || { tail -20 "$WORK/asan-pip.log"; exit 1; }
"$ASAN_VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -C build-dir="$WORK/asan-build" \
  -C cmake.define.DSPARK_SANITIZE=ON -C cmake.define.DSPARK_CUDA=OFF -C cmake.build-type=RelWithDebInfo "$ROOT" \
  </dev/null >"$WORK/asan-build.log" 2>&1 || { tail -30 "$WORK/asan-build.log"; exit 1; }
ASAN_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
if ! (cd "$WORK" && env -u PYTHONPATH LD_PRELOAD="$ASAN_PRELOAD" ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" \
      UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" "$ASAN_VENV/bin/python" -m pytest -q -p no:cacheprovider \
      "$ROOT/tests" --ignore="$ROOT/tests/test_cuda.py" 2>&1 | tail -3); then
  status=1
fi

# -- 2. libFuzzer targets ---------------------------------------------------------------------
say "libFuzzer build (clang $CLANG_MAJOR)"
CC=clang CXX=clang++ cmake -S "$ROOT" -B "$WORK/fuzz" -G Ninja -DDSPARK_FUZZ=ON -DDSPARK_BUILD_TESTS=OFF \
  -DDSPARK_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$WORK/fuzz-configure.log"
cmake --build "$WORK/fuzz" -j"$JOBS" --target fuzz_stager fuzz_formats fuzz_c_api fuzz_prefix fuzz_stager_skip_known \
  fuzz_formats_skip_known fuzz_c_api_skip_known fuzz_prefix_skip_known >"$WORK/fuzz-build.log" \
  || { tail -30 "$WORK/fuzz-build.log"; exit 1; }

known_open() { grep -qxF "$1" "$CORPUS/findings/KNOWN_OPEN" 2>/dev/null; }
for t in stager formats c_api prefix; do
  bin="$WORK/fuzz/csrc/fuzz/fuzz_$t"
  # Recorded findings: open ones must still reproduce, fixed ones must pass.
  for f in "$CORPUS/findings/cpp_$t"/*; do
    [ -e "$f" ] || continue
    key="cpp_$t/$(basename "$f")"
    if "$bin" "$f" >"$WORK/replay.log" 2>&1; then
      if known_open "$key"; then echo "FIXED? $key passes now: remove it from findings/KNOWN_OPEN"; status=1; fi
    else
      if known_open "$key"; then echo "open finding $key still reproduces (known)";
      else echo "REGRESSION: $key"; tail -20 "$WORK/replay.log"; status=1; fi
    fi
  done
  # With open findings of this target, fuzz the build that steers clear of them (csrc/fuzz/
  # CMakeLists.txt): the bounded run is for new findings; the open ones were replayed above.
  if grep -q "^cpp_$t/" "$CORPUS/findings/KNOWN_OPEN" 2>/dev/null; then bin="${bin}_skip_known"; fi
  say "$(basename "$bin"): ${FUZZ_SECONDS}s"
  mkdir -p "$WORK/corpus-$t" "$WORK/artifacts-$t"
  cp "$CORPUS/cpp_$t"/* "$WORK/corpus-$t"/
  if ! "$bin" -max_total_time="$FUZZ_SECONDS" -print_final_stats=1 -timeout=20 -rss_limit_mb=2048 \
       -artifact_prefix="$WORK/artifacts-$t/" "$WORK/corpus-$t" >"$WORK/fuzz-$t.log" 2>&1; then
    echo "FINDING in fuzz_$t:"; grep -E "FUZZ FINDING|ERROR|runtime error|SUMMARY|Test unit written" "$WORK/fuzz-$t.log" | head -20
    status=1
  fi
  grep -E "INITED|DONE|stat::number_of_executed_units|stat::new_units_added|stat::peak_rss_mb" "$WORK/fuzz-$t.log" | tail -5
done

# -- 3. atheris (Python: core vs reference) ----------------------------------------------------------
if ! "$PYTHON" -c "import atheris" >/dev/null 2>&1; then
  if ! "$PYTHON" -m pip install -q atheris >/dev/null 2>&1; then
    echo "atheris could not be installed: the Python fuzz run cannot happen"
    # In CI a missing fuzz step is a failure, not a silent pass.
    if [ -n "${CI:-}" ]; then status=1; fi
  fi
fi
if "$PYTHON" -c "import atheris, dspark_core.testing.fuzz" >/dev/null 2>&1; then
  for t in ops threads snapshot decode; do
    say "python -m dspark_core.testing.fuzz --target $t: ${PY_FUZZ_SECONDS}s"
    mkdir -p "$WORK/py-corpus-$t" "$WORK/py-artifacts-$t"
    cp "$CORPUS/$t"/* "$WORK/py-corpus-$t"/
    if ! "$PYTHON" -m dspark_core.testing.fuzz --target "$t" --max-time "$PY_FUZZ_SECONDS" --corpus "$WORK/py-corpus-$t" \
         --artifact-prefix "$WORK/py-artifacts-$t/" >"$WORK/py-fuzz-$t.log" 2>&1; then
      echo "FINDING in python target $t:"
      grep -E -A12 "Uncaught Python exception" "$WORK/py-fuzz-$t.log" | head -30
      status=1
    fi
    grep -E "INITED|DONE|stat::number_of_executed_units|stat::new_units_added" "$WORK/py-fuzz-$t.log" | tail -4
  done
fi

say "fuzz steps: $([ $status -eq 0 ] && echo 'no findings' || echo 'FINDINGS (see above)'); logs in $WORK"
exit $status
