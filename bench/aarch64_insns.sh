#!/usr/bin/env bash
# Instructions per element of the aarch64 row-format kernels, scalar vs NEON vs
# NEON-BF16, counted under QEMU's user-mode emulator (an x86-64 host cannot
# time aarch64 code; on a real aarch64 machine bench/run_all.py measures speed).
#
#   bash bench/aarch64_insns.sh [BUILD_DIR]
#
# BUILD_DIR: an aarch64 cross build of the core (default build/ci-aarch64, as
# .ci/aarch64.sh leaves it; see docs/platforms.md). Needs g++-aarch64-linux-gnu,
# qemu-user and gcc. A tiny TCG plugin (written here against QEMU's plugin
# API version 1: a callback per executed translation block adds its length)
# counts every guest instruction; a driver converts N = 65,536 elements of
# f32 data (|x| < 4) once per run, and the per-element cost is the difference
# of runs that make the data only / also encode / also decode, divided by N
# (the one-time encode_bounds tables are built in every run). Prints a
# markdown table with the command and the ratio scalar / NEON.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build/ci-aarch64}
LIB="$B/csrc/libdspark_core.a"
[ -f "$LIB" ] || { echo "no $LIB: cross-build the core first (docs/platforms.md)" >&2; exit 1; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
N=65536

cat >"$W/insn.c" <<'EOF'
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
typedef struct qemu_info_t qemu_info_t;
__attribute__((visibility("default"))) int qemu_plugin_version = 1;
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t, void (*)(qemu_plugin_id_t, struct qemu_plugin_tb*));
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb*);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb*, void (*)(unsigned int, void*), int, void*);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t, void (*)(qemu_plugin_id_t, void*), void*);
static uint64_t total;
static void exec_cb(unsigned int vcpu, void* n) { (void)vcpu; total += (uintptr_t)n; }
static void trans_cb(qemu_plugin_id_t id, struct qemu_plugin_tb* tb) {
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_cb(tb, exec_cb, 0, (void*)(uintptr_t)qemu_plugin_tb_n_insns(tb));
}
static void at_exit(qemu_plugin_id_t id, void* p) { (void)id; (void)p; fprintf(stderr, "INSNS %llu\n", (unsigned long long)total); }
__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t* info, int argc, char** argv) {
    (void)info; (void)argc; (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, trans_cb);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
EOF
cat >"$W/drv.cpp" <<'EOF'
// drv PATH FORMAT N MODE: MODE 0 makes the data, 1 also encodes f32 -> FORMAT, 2 also decodes back.
#include <cstdlib>
#include <string>
#include <vector>
#include "dspark/row_format.hpp"
using namespace dspark;
int main(int, char** argv) {
    const int path = std::atoi(argv[1]), mode = std::atoi(argv[4]);
    const std::string fmt = argv[2];
    const std::size_t n = std::strtoull(argv[3], nullptr, 10);
    std::vector<float> x(n), y(n);
    std::vector<std::uint8_t> enc(n * 4);
    unsigned s = 12345;
    for (auto& v : x) { s = s * 1664525u + 1013904223u; v = static_cast<int>(s >> 8) * (1.0f / (1 << 21)) - 4.0f; }
    set_simd_path(static_cast<SimdPath>(path));
    for (int k = 0; k < STORAGE_COUNT; ++k) (void)encode_bounds(static_cast<Storage>(k));
    const Storage st = storage_from_name(fmt);
    if (mode >= 1) encode_rows(x.data(), ElemType::F32, enc.data(), st, 1, n, NonFinite::Error);
    if (mode >= 2) decode_rows(enc.data(), st, y.data(), ElemType::F32, 1, n);
    return 0;
}
EOF
gcc -O2 -shared -fPIC "$W/insn.c" -o "$W/libinsn.so"
aarch64-linux-gnu-g++ -O2 -std=c++17 -ffp-contract=off -Icsrc/include "$W/drv.cpp" "$LIB" -o "$W/drv" -lpthread
count() {
  QEMU_CPU=max qemu-aarch64 -L /usr/aarch64-linux-gnu -plugin "$W/libinsn.so" "$W/drv" "$1" "$2" "$N" "$3" 2>&1 \
    | sed -n 's/^INSNS //p'
}
per() { python3 -c "print(f'{($2 - $1) / $N:.2f}')"; }
ratio() { python3 -c "print(f'{$1 / $2:.1f}')"; }

echo "# aarch64 row-format kernels: guest instructions per element (QEMU TCG plugin)"
echo
echo "- command: \`bash bench/aarch64_insns.sh $*\`"
echo "- $(qemu-aarch64 --version | head -1), -cpu max; core: $LIB; N = $N elements, f32 data |x| < 4"
echo
echo "| conversion | scalar | neon | neon-bf16 | scalar / neon |"
echo "|---|---|---|---|---|"
for f in f16 bf16 q8_0 q4_0; do
  declare -A enc=() dec=()
  for p in 0 3 4; do  # SimdPath::Scalar, Neon, NeonBf16
    i0=$(count $p $f 0); i1=$(count $p $f 1); i2=$(count $p $f 2)
    enc[$p]=$(per "$i0" "$i1"); dec[$p]=$(per "$i1" "$i2")
  done
  echo "| f32 -> $f | ${enc[0]} | ${enc[3]} | ${enc[4]} | $(ratio "${enc[0]}" "${enc[3]}")x |"
  echo "| $f -> f32 | ${dec[0]} | ${dec[3]} | ${dec[4]} | $(ratio "${dec[0]}" "${dec[3]}")x |"
done
echo
echo "Scalar decoders that GCC vectorises by itself (bf16 -> f32 is a shift) cost the same."
