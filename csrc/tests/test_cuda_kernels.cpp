// The CUDA kernels, run on the host, against the CPU path.
//
// csrc/tests/cuda_emulation/kernel_emulation.hpp models the execution subset the
// kernels use (lanes of a warp in lock step as fibers, ballots and shuffles
// evaluated when all 32 lanes reach them, divergence reported as an error),
// so the kernels and the
// per-format launch dispatch of csrc/cuda/row_format_kernels.cuh run here
// unmodified. Built as plain C++ with -ffp-contract=off, + * / are single
// round-to-nearest-even operations like the device's __fadd_rn / __fmul_rn /
// __fdiv_rn (and the PTX test cuda_ptx_exactness checks nvcc emits no FMA,
// approximate or flush-to-zero float instruction). Every launch must give
// exactly the bytes of dspark::encode_rows / decode_rows on the scalar path,
// at every grid size. This runs on any machine; tests/test_cuda.py checks
// the real GPU's bytes where one is present.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "cuda_emulation/kernel_emulation.hpp"  // first: the kernels need its model of CUDA
#include "cuda_emulation/cuda_runtime.h"

#include "../cuda/row_format_kernels.cuh"
#include "check.hpp"
#include "row_types.hpp"
#include "dspark/row_format.hpp"

using namespace dspark;
using dspark_test::as_type;

namespace {

float from_bits(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
std::uint32_t bits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }

struct ScalarPath {
    SimdPath saved = active_simd_path();
    ScalarPath() { set_simd_path(SimdPath::Scalar); }
    ~ScalarPath() { set_simd_path(saved); }
};

// ------------------------------------------------- emulated launches ---

constexpr unsigned long long NO_BAD = ~0ull;

// Grid sizes a launch is tried with: one block (every thread loops), a few
// blocks (the grid-stride tail is ragged), one quantizer lane per 4 elements
// and one thread per element (more warps than q blocks).
std::vector<unsigned> grids_for(std::size_t elems) {
    const auto blocks_for = [](std::size_t threads) {
        return static_cast<unsigned>((threads + kernels::kThreads - 1) / kernels::kThreads);
    };
    std::vector<unsigned> g{1u, 3u};
    for (unsigned b : {blocks_for(elems / kernels::kElemsPerLane), blocks_for(elems)})
        if (b > 3 && b != g.back()) g.push_back(b);
    return g;
}

// The device encode (row_format_cuda.cu's encode_rows_cuda after its checks):
// launch_encode_in<in> with the flag word, read back as the first bad index.
// `limit`: bits of encode_bounds(out, staged).limit (0: the storage's own).
std::int64_t gpu_encode(const void* src, int in, std::uint8_t* dst, int out, std::size_t n, int policy,
                        unsigned grid, bool with_flag = true, std::uint32_t limit = 0) {
    unsigned long long flag = NO_BAD;
    unsigned long long* bad = policy == bm::NF_ERROR && with_flag ? &flag : nullptr;
    switch (in) {
        case bm::E_F32: kernels::launch_encode_in<bm::E_F32>(out, src, dst, n, policy, bad, grid, grid, nullptr, limit); break;
        case bm::E_F16: kernels::launch_encode_in<bm::E_F16>(out, src, dst, n, policy, bad, grid, grid, nullptr, limit); break;
        default: kernels::launch_encode_in<bm::E_BF16>(out, src, dst, n, policy, bad, grid, grid, nullptr, limit); break;
    }
    return flag == NO_BAD ? -1 : static_cast<std::int64_t>(flag);
}

// The device decode (decode_rows_cuda): a byte copy for the same format, else
// launch_decode_out<out>.
void gpu_decode(const std::uint8_t* src, int in, void* dst, int out, std::size_t n, unsigned grid) {
    if (in == out) {
        std::memcpy(dst, src, n * (out == bm::E_F32 ? 4 : 2));
        return;
    }
    switch (out) {
        case bm::E_F32: kernels::launch_decode_out<bm::E_F32>(in, src, dst, n, grid, nullptr); break;
        case bm::E_F16: kernels::launch_decode_out<bm::E_F16>(in, src, dst, n, grid, nullptr); break;
        default: kernels::launch_decode_out<bm::E_BF16>(in, src, dst, n, grid, nullptr); break;
    }
}

// ------------------------------------------------------------------ data ---

// Blocks of every awkward kind (as test_row_format.cpp's and the Python
// format tests' datasets): gaussians at 1e-4 / 1 / 1e3, Student-t(3),
// massive activations, zero and -0 blocks, q8 ties and near-ties, q4
// opposite maxima, d overflow / underflow in fp16, f32 subnormals (id = inf),
// fp16 edges, arbitrary bit patterns and (optionally) NaN / Inf.
std::vector<float> dataset(std::size_t n_blocks, unsigned seed, bool nonfinite) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::student_t_distribution<float> t3(3.0f);
    std::uniform_int_distribution<int> kind(0, 17), idx(0, 31), k127(-127, 127), k8(-8, 7);
    const float f16_edges[] = {65504.0f, 65519.99f, 65520.0f, -65520.0f, 6.1e-5f, 5.96e-8f, 2.98e-8f, 1e-8f, 7e4f};
    std::vector<float> x(n_blocks * 32);
    for (std::size_t b = 0; b < n_blocks; ++b) {
        float* v = x.data() + b * 32;
        const int kd = static_cast<int>(b % 18 == 0 ? kind(rng) : b % 18);
        for (int j = 0; j < 32; ++j) {
            switch (kd) {
                case 0: v[j] = g(rng) * 1e-4f; break;
                case 1: v[j] = g(rng); break;
                case 2: v[j] = g(rng) * 1e3f; break;
                case 3: v[j] = 0.0f; break;
                case 4: v[j] = (j % 3 == 0) ? -0.0f : 0.0f; break;                   // mixed +-0
                case 5: v[j] = j == 0 ? 127.0f : static_cast<float>(k127(rng) % 127) + 0.5f; break;  // q8 ties
                case 6: {                                                           // q8 near-ties
                    float tv = static_cast<float>(k127(rng) % 126) + 0.5f;
                    v[j] = j == 1 ? 127.0f : (j % 2 ? std::nextafter(tv, 0.0f) : std::nextafter(tv, 200.0f));
                    break;
                }
                case 7: v[j] = g(rng) * 1e6f; break;     // fp16 d overflow
                case 8: v[j] = g(rng) * 1e-9f; break;    // fp16 d underflow
                case 9: v[j] = g(rng) * 1e-41f; break;   // f32 subnormals: id = inf
                case 10: v[j] = static_cast<float>(k8(rng)); break;  // q4 grid
                case 11: v[j] = g(rng) * 6e4f; break;    // around fp16 max
                case 12: v[j] = t3(rng); break;          // Student-t(3)
                case 13: v[j] = 3.0f * static_cast<float>(k127(rng)) / 127.0f; break;
                case 14: v[j] = f16_edges[static_cast<unsigned>(rng()) % 9] * ((rng() & 1) ? 1.0f : -1.0f); break;
                case 15: v[j] = g(rng) * 1e38f; break;   // amax near FLT_MAX
                case 16: v[j] = from_bits(static_cast<std::uint32_t>(rng())); break;  // any bits
                default: v[j] = g(rng) * 1e-30f; break;
            }
        }
        if (kd == 1 && b % 3 == 0) v[idx(rng)] = 5e3f;  // massive activation
        if (kd == 10 || kd == 13) {  // equal-magnitude opposite-sign maxima: the first wins
            const int a = idx(rng), c = idx(rng);
            v[a] = (b & 1) ? 8.0f : -8.0f;
            v[c] = -v[a];
        }
        if (kd == 4 && (b & 1)) v[0] = -0.0f;  // all-zero block whose first element is -0.0
        if (nonfinite && b % 5 == 2) {
            const int j = idx(rng);
            switch (static_cast<int>(b / 5) % 5) {
                case 0: v[j] = std::numeric_limits<float>::infinity(); break;
                case 1: v[j] = -std::numeric_limits<float>::infinity(); break;
                case 2: v[j] = std::nanf(""); break;
                case 3: v[j] = from_bits(0xff812345u); break;  // negative signalling NaN with payload
                default: v[j] = from_bits(0x7fa00001u); v[(j + 7) % 32] = from_bits(0xffc0beefu); break;
            }
        }
        if (!nonfinite)
            for (int j = 0; j < 32; ++j)
                if (!std::isfinite(v[j])) v[j] = 1.0f;
    }
    return x;
}

int first_diff(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
    if (a.size() != b.size()) return -2;
    for (std::size_t i = 0; i < a.size(); ++i) if (a[i] != b[i]) return static_cast<int>(i);
    return -1;
}

constexpr std::size_t DIM = 256;

void check_encode_all(bool nonfinite, unsigned seed, std::size_t rows) {
    ScalarPath sp;
    const auto x = dataset(rows * DIM / 32, seed, nonfinite);
    for (int in = 0; in < 3; ++in) {
        const auto src = as_type(x, static_cast<ElemType>(in));
        for (int st = 0; st < STORAGE_COUNT; ++st) {
            for (int pol = 0; pol < NONFINITE_COUNT; ++pol) {
                const std::size_t rb = row_bytes(static_cast<Storage>(st), DIM);
                std::vector<std::uint8_t> want(rows * rb, 0xcd);
                const std::int64_t wb = encode_rows(src.data(), static_cast<ElemType>(in), want.data(),
                                                    static_cast<Storage>(st), rows, DIM, static_cast<NonFinite>(pol));
                for (unsigned grid : grids_for(rows * DIM)) {
                    std::vector<std::uint8_t> got(rows * rb, 0xab);
                    const std::int64_t gb = gpu_encode(src.data(), in, got.data(), st, rows * DIM, pol, grid);
                    const int d = first_diff(want, got);
                    if (d != -1 || wb != gb)
                        std::printf("  encode in=%d storage=%s policy=%d nonfinite=%d grid=%u: first differing "
                                    "byte %d, first_bad %lld vs %lld\n", in, storage_name(static_cast<Storage>(st)),
                                    pol, nonfinite, grid, d, static_cast<long long>(wb), static_cast<long long>(gb));
                    CHECK_EQ(d, -1);
                    CHECK_EQ(wb, gb);
                }
            }
        }
    }
}

// Rows staged in a narrower type than the storage decodes to: the device
// encode holds them to encode_bounds(storage, staged), as the CPU's
// encode_rows(..., bounds) and a Stager's process() do. Values straddle
// every narrowed limit (f16's 65520 and the q formats' block maxima staged
// as f16, bf16's near FLT_MAX), plus the general dataset.
void check_encode_staged(unsigned seed, std::size_t rows) {
    ScalarPath sp;
    auto x = dataset(rows * DIM / 32, seed, true);
    std::mt19937 rng(seed);
    for (int st = 0; st < STORAGE_COUNT; ++st)
        for (int staged = 0; staged < 3; ++staged) {
            const EncodeBounds b = encode_bounds(static_cast<Storage>(st), static_cast<ElemType>(staged));
            if (!std::isfinite(b.limit)) continue;
            // A block of values around this limit every 7 blocks: just below, at, just above.
            for (std::size_t blk = static_cast<std::size_t>(st * 3 + staged) % 7; blk < x.size() / 32; blk += 7)
                for (int j = 0; j < 32; ++j) {
                    const float edge[] = {b.clamp_to, b.limit, std::nextafter(b.limit, INFINITY), b.limit * 0.5f};
                    x[blk * 32 + j] = edge[rng() % 4] * ((rng() & 1) ? 1.0f : -1.0f);
                }
        }
    for (int in = 0; in < 3; ++in) {
        const auto src = as_type(x, static_cast<ElemType>(in));
        for (int st = 0; st < STORAGE_COUNT; ++st)
            for (int staged = 0; staged < 3; ++staged) {
                const EncodeBounds b = encode_bounds(static_cast<Storage>(st), static_cast<ElemType>(staged));
                for (int pol = 0; pol < NONFINITE_COUNT; ++pol) {
                    const std::size_t rb = row_bytes(static_cast<Storage>(st), DIM);
                    std::vector<std::uint8_t> want(rows * rb, 0xcd);
                    const std::int64_t wb = encode_rows(src.data(), static_cast<ElemType>(in), want.data(),
                                                        static_cast<Storage>(st), rows, DIM,
                                                        static_cast<NonFinite>(pol), b);
                    for (unsigned grid : {1u, 7u}) {
                        std::vector<std::uint8_t> got(rows * rb, 0xab);
                        const std::int64_t gb =
                            gpu_encode(src.data(), in, got.data(), st, rows * DIM, pol, grid, true, bits(b.limit));
                        const int d = first_diff(want, got);
                        if (d != -1 || wb != gb)
                            std::printf("  staged encode in=%d storage=%s staged=%d policy=%d grid=%u: first "
                                        "differing byte %d, first_bad %lld vs %lld\n", in,
                                        storage_name(static_cast<Storage>(st)), staged, pol, grid, d,
                                        static_cast<long long>(wb), static_cast<long long>(gb));
                        CHECK_EQ(d, -1);
                        CHECK_EQ(wb, gb);
                    }
                }
            }
    }
}

}  // namespace

TEST_CASE(storage_limits_are_encode_bounds) {
    // The kernels' own table of limits is the CPU's encode_bounds(storage).
    for (int st = 0; st < STORAGE_COUNT; ++st) {
        const EncodeBounds b = encode_bounds(static_cast<Storage>(st));
        CHECK_EQ(bits(b.limit), bm::limit_bits(st));
        if (std::isfinite(b.limit)) CHECK_EQ(bits(b.clamp_to), bm::limit_bits(st) - 1u);
        for (int staged = 0; staged < 3; ++staged) {  // a staged type only ever tightens them
            const EncodeBounds t = encode_bounds(static_cast<Storage>(st), static_cast<ElemType>(staged));
            CHECK(bits(t.limit) <= bm::limit_bits(st));
            if (std::isfinite(t.limit)) CHECK_EQ(bits(t.clamp_to), bits(t.limit) - 1u);
        }
    }
}

TEST_CASE(encode_matches_cpu_with_a_narrower_staged_type) {
    check_encode_staged(4242, 32);
    check_encode_staged(77, 8);
}

TEST_CASE(encode_matches_cpu_finite) { check_encode_all(false, 1234, 64); }

TEST_CASE(encode_matches_cpu_nonfinite) { check_encode_all(true, 99, 64); }

TEST_CASE(encode_matches_cpu_many_seeds) {
    for (unsigned seed = 1; seed <= 8; ++seed) check_encode_all(seed % 2 == 0, seed * 7919u, 16);
}

TEST_CASE(one_launch_per_contiguous_run) {
    // docs/design.md section 3: a whole run of rows (here 64 rows of 256) is one
    // kernel launch, whatever the formats and policy (not one launch per row).
    const auto x = dataset(64 * DIM / 32, 17, false);
    for (int in = 0; in < 3; ++in) {
        const auto src = as_type(x, static_cast<ElemType>(in));
        for (int st = 0; st < STORAGE_COUNT; ++st) {
            std::vector<std::uint8_t> enc(64 * row_bytes(static_cast<Storage>(st), DIM));
            for (int pol = 0; pol < NONFINITE_COUNT; ++pol) {
                const std::size_t before = dspark_emu::launch_count();
                gpu_encode(src.data(), in, enc.data(), st, 64 * DIM, pol, 3);
                CHECK_EQ(dspark_emu::launch_count() - before, 1u);
            }
            if (st == in) continue;  // same format: a device copy, no kernel
            std::vector<std::uint8_t> dec(64 * DIM * elem_bytes(static_cast<ElemType>(in)));
            const std::size_t before = dspark_emu::launch_count();
            gpu_decode(enc.data(), st, dec.data(), in, 64 * DIM, 3);
            CHECK_EQ(dspark_emu::launch_count() - before, 1u);
        }
    }
}

TEST_CASE(ragged_runs_stay_in_bounds) {
    // Runs of 1-13 blocks (not a multiple of the quantizers' 4 blocks a warp,
    // nor of 256 elements): same bytes as the CPU, and nothing written past
    // the end of the output (guard bytes).
    ScalarPath sp;
    constexpr std::size_t GUARD = 256;
    for (std::size_t nb : {1u, 2u, 3u, 5u, 7u, 13u}) {
        const auto x = dataset(nb, static_cast<unsigned>(nb * 31), nb % 2 == 1);
        const std::size_t n = nb * 32;
        for (int in = 0; in < 3; ++in) {
            const auto src = as_type(x, static_cast<ElemType>(in));
            for (int st = 0; st < STORAGE_COUNT; ++st) {
                const std::size_t nbytes = row_bytes(static_cast<Storage>(st), n);
                std::vector<std::uint8_t> want(nbytes);
                const std::int64_t wb = encode_rows(src.data(), static_cast<ElemType>(in), want.data(),
                                                    static_cast<Storage>(st), 1, n, NonFinite::Error);
                for (unsigned grid : {1u, 2u}) {
                    std::vector<std::uint8_t> got(nbytes + GUARD, 0xab);
                    CHECK_EQ(gpu_encode(src.data(), in, got.data(), st, n, bm::NF_ERROR, grid), wb);
                    CHECK_EQ(std::memcmp(got.data(), want.data(), nbytes), 0);
                    for (std::size_t k = nbytes; k < got.size(); ++k) CHECK_EQ(got[k], 0xab);
                }
                for (int out = 0; out < 3; ++out) {
                    const std::size_t ob = n * elem_bytes(static_cast<ElemType>(out));
                    std::vector<std::uint8_t> dwant(ob), dgot(ob + GUARD, 0xab);
                    decode_rows(want.data(), static_cast<Storage>(st), dwant.data(), static_cast<ElemType>(out), 1, n);
                    gpu_decode(want.data(), st, dgot.data(), out, n, 1);
                    CHECK_EQ(std::memcmp(dgot.data(), dwant.data(), ob), 0);
                    for (std::size_t k = ob; k < dgot.size(); ++k) CHECK_EQ(dgot[k], 0xab);
                }
            }
        }
    }
}

TEST_CASE(odd_lengths_and_unaligned_buffers) {
    // The chunked kernels' other paths: runs whose length is not a multiple
    // of 4 (the element-by-element tail) and buffers that are element-aligned
    // but not aligned for the 8 / 16-byte vector accesses (one or two
    // elements, or for q data bytes, past an aligned address: two f32 are
    // 8-byte aligned but not 16).
    ScalarPath sp;
    const auto x = dataset(64, 4242, true);
    for (std::size_t n : {1u, 3u, 5u, 37u, 1027u, 2048u}) {
        for (int shift = 0; shift < 3; ++shift) {
            for (int in = 0; in < 3; ++in) {
                const std::size_t ib = elem_bytes(static_cast<ElemType>(in));
                const auto all = as_type(x, static_cast<ElemType>(in));
                std::vector<std::uint8_t> src_buf(n * ib + 16);
                std::uint8_t* src = src_buf.data() + shift * ib;
                std::memcpy(src, all.data(), n * ib);
                for (int st = 0; st < STORAGE_COUNT; ++st) {
                    if (st >= 3 && n % 32 != 0) continue;  // q formats hold whole blocks
                    const std::size_t nbytes = row_bytes(static_cast<Storage>(st), n);
                    const std::size_t db = st >= 3 ? 1 : elem_bytes(static_cast<ElemType>(st));
                    for (int pol = 0; pol < NONFINITE_COUNT; ++pol) {
                        std::vector<std::uint8_t> want(nbytes), got_buf(nbytes + 16, 0xab);
                        std::uint8_t* got = got_buf.data() + shift * db;
                        const std::int64_t wb = encode_rows(src, static_cast<ElemType>(in), want.data(),
                                                            static_cast<Storage>(st), 1, n, static_cast<NonFinite>(pol));
                        CHECK_EQ(gpu_encode(src, in, got, st, n, pol, 2), wb);
                        CHECK_EQ(std::memcmp(got, want.data(), nbytes), 0);
                        if (pol != 0) continue;
                        for (int out = 0; out < 3; ++out) {
                            const std::size_t ob = n * elem_bytes(static_cast<ElemType>(out));
                            std::vector<std::uint8_t> dwant(ob), dgot_buf(ob + 16, 0xab);
                            std::uint8_t* dgot = dgot_buf.data() + shift * elem_bytes(static_cast<ElemType>(out));
                            decode_rows(want.data(), static_cast<Storage>(st), dwant.data(), static_cast<ElemType>(out),
                                        1, n);
                            gpu_decode(got, st, dgot, out, n, 2);
                            CHECK_EQ(std::memcmp(dgot, dwant.data(), ob), 0);
                            CHECK_EQ(dgot_buf[shift * elem_bytes(static_cast<ElemType>(out)) + ob], 0xab);
                        }
                    }
                }
            }
        }
    }
}

TEST_CASE(decode_matches_cpu) {
    ScalarPath sp;
    for (bool nonfinite : {false, true}) {
        const std::size_t rows = 48;
        const auto x = dataset(rows * DIM / 32, nonfinite ? 5u : 6u, nonfinite);
        for (int st = 0; st < STORAGE_COUNT; ++st) {
            const std::size_t rb = row_bytes(static_cast<Storage>(st), DIM);
            std::vector<std::uint8_t> enc(rows * rb);
            encode_rows(x.data(), ElemType::F32, enc.data(), static_cast<Storage>(st), rows, DIM, NonFinite::Error);
            // Also every q block scale with arbitrary fp16 bits (NaN, inf, subnormal d).
            if (st >= 3) {
                std::mt19937 rng(st);
                const std::size_t bb = st == 3 ? 34 : 18;
                for (std::size_t b = 0; b < enc.size() / bb; b += 3) {
                    const std::uint16_t h = static_cast<std::uint16_t>(rng());
                    enc[b * bb] = h & 0xff; enc[b * bb + 1] = h >> 8;
                }
            }
            for (int out = 0; out < 3; ++out) {
                const std::size_t eb = elem_bytes(static_cast<ElemType>(out));
                std::vector<std::uint8_t> want(rows * DIM * eb, 0xcd);
                decode_rows(enc.data(), static_cast<Storage>(st), want.data(), static_cast<ElemType>(out), rows, DIM);
                for (unsigned grid : grids_for(rows * DIM)) {
                    std::vector<std::uint8_t> got(rows * DIM * eb, 0xab);
                    gpu_decode(enc.data(), st, got.data(), out, rows * DIM, grid);
                    const int d = first_diff(want, got);
                    if (d != -1)
                        std::printf("  decode storage=%s out=%d nonfinite=%d grid=%u: first differing byte %d\n",
                                    storage_name(static_cast<Storage>(st)), out, nonfinite, grid, d);
                    CHECK_EQ(d, -1);
                }
            }
        }
    }
}

TEST_CASE(elementwise_exhaustive_f16_bf16) {
    // Every fp16 / bf16 bit pattern widens exactly and narrows back as the CPU does.
    ScalarPath sp;
    std::vector<std::uint16_t> all(65536);
    for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
    for (int et : {1, 2}) {
        std::vector<float> want(65536), got(65536);
        decode_rows(all.data(), static_cast<Storage>(et), want.data(), ElemType::F32, 1, 65536);
        for (std::size_t i = 0; i < 65536; ++i) got[i] = et == 1 ? bm::f16_to_f32(all[i]) : bm::bf16_to_f32(all[i]);
        CHECK_EQ(std::memcmp(want.data(), got.data(), 65536 * 4), 0);
    }
    // f32 -> f16 / bf16 over a stride of all f32 patterns (plus the neighbours of
    // every rounding boundary class).
    std::vector<float> f;
    for (std::uint64_t u = 0; u <= 0xffffffffull; u += 65521) f.push_back(from_bits(static_cast<std::uint32_t>(u)));
    for (std::uint32_t e = 0; e < 256; ++e)
        for (std::uint32_t m : {0x0u, 0xfffu, 0x1000u, 0x1001u, 0x2fffu, 0x3000u, 0x7fffu, 0x8000u, 0x8001u, 0x18000u, 0x7fffffu})
            for (std::uint32_t s : {0u, 0x80000000u}) f.push_back(from_bits(s | (e << 23) | m));
    for (int st : {1, 2}) {
        std::vector<std::uint16_t> want(f.size()), got(f.size());
        encode_rows(f.data(), ElemType::F32, want.data(), static_cast<Storage>(st), 1, f.size(), NonFinite::Error);
        for (std::size_t i = 0; i < f.size(); ++i) got[i] = st == 1 ? bm::f32_to_f16(f[i]) : bm::f32_to_bf16(f[i]);
        CHECK_EQ(std::memcmp(want.data(), got.data(), f.size() * 2), 0);
    }
}

TEST_CASE(round_and_cvtt_helpers) {
    // round_half_away equals C roundf on ties, near-ties and large values.
    const float vals[] = {0.5f, -0.5f, 1.5f, 2.5f, -3.5f, 0.49999997f, -0.49999997f, 1.4999999f,
                          8388607.5f, 8388608.0f, 16777215.0f, 1e30f, -1e30f, 0.0f, -0.0f, 126.5f, -126.5f};
    for (float v : vals) CHECK_EQ(bits(bm::round_half_away(v)), bits(std::round(v)));
    std::mt19937 rng(3);
    for (int i = 0; i < 200000; ++i) {
        const float v = from_bits(static_cast<std::uint32_t>(rng()));
        if (std::isnan(v)) continue;
        if (bits(bm::round_half_away(v)) != bits(std::round(v))) { CHECK(false); break; }
    }
    CHECK_EQ(bm::cvtt_i32(std::nanf("")), INT32_MIN);
    CHECK_EQ(bm::cvtt_i32(3e9f), INT32_MIN);
    CHECK_EQ(bm::cvtt_i32(-2147483648.0f), INT32_MIN);
    CHECK_EQ(bm::cvtt_i32(-2147483520.0f), -2147483520);
    CHECK_EQ(bm::cvtt_i32(-7.9f), -7);
}

TEST_CASE(q_quirks) {
    // All-zero q4_0 block -> d = -0.0 (0x8000), every nibble 8; q8_0 -> all zero.
    float z[32] = {};
    std::uint8_t o4[18], o8[34];
    bm::q4_block(z, o4);
    CHECK_EQ(o4[0], 0x00); CHECK_EQ(o4[1], 0x80);
    for (int j = 2; j < 18; ++j) CHECK_EQ(o4[j], 0x88);
    bm::q8_block(z, o8);
    for (int j = 0; j < 34; ++j) CHECK_EQ(o8[j], 0);
    // First maximum wins: 8 before -8 -> d = -1 (0xbc00).
    float y[32] = {};
    y[5] = 8.0f; y[20] = -8.0f;
    bm::q4_block(y, o4);
    CHECK_EQ(o4[0], 0x00); CHECK_EQ(o4[1], 0xbc);
    // The warp kernel picks the same first maximum.
    std::uint8_t g4[18];
    gpu_encode(y, bm::E_F32, g4, bm::S_Q4_0, 32, bm::NF_ERROR, 1);
    CHECK_EQ(std::memcmp(g4, o4, 18), 0);
    y[5] = -8.0f; y[20] = 8.0f;  // now -8 comes first: d = +1 (0x3c00)
    gpu_encode(y, bm::E_F32, g4, bm::S_Q4_0, 32, bm::NF_ERROR, 1);
    CHECK_EQ(g4[0], 0x00); CHECK_EQ(g4[1], 0x3c);
    // Whole-block helpers (sequential) and the warp kernels agree on every
    // awkward block, NaN blocks included.
    ScalarPath sp;
    const std::size_t nb = 4000;
    const auto x = dataset(nb, 77, true);
    std::vector<std::uint8_t> seq8(nb * 34), seq4(nb * 18), warp8(nb * 34), warp4(nb * 18);
    for (std::size_t b = 0; b < nb; ++b) {
        bm::q8_block(x.data() + b * 32, seq8.data() + b * 34);
        bm::q4_block(x.data() + b * 32, seq4.data() + b * 18);
    }
    gpu_encode(x.data(), bm::E_F32, warp4.data(), bm::S_Q4_0, nb * 32, bm::NF_ERROR, 5, false);
    gpu_encode(x.data(), bm::E_F32, warp8.data(), bm::S_Q8_0, nb * 32, bm::NF_ERROR, 5, false);
    CHECK_EQ(first_diff(seq8, warp8), -1);
    CHECK_EQ(first_diff(seq4, warp4), -1);
}

// ------------------------------------------------------ the emulator itself ---

// A kernel whose lanes exchange values through every collective the
// row-format kernels use; results computed by hand.
__global__ void k_collectives(int* out) {
    const int lane = static_cast<int>(threadIdx.x & 31u);
    int sum = lane;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const unsigned odd = __ballot_sync(0xffffffffu, lane & 1);
    const int from7 = __shfl_sync(0xffffffffu, lane * 10, 7);
    const int down = __shfl_down_sync(0xffffffffu, lane, 16);
    const float fx = __shfl_xor_sync(0xffffffffu, static_cast<float>(lane) + 0.5f, 1);
    int* o = out + (blockIdx.x * blockDim.x + threadIdx.x) * 5;
    o[0] = sum;
    o[1] = static_cast<int>(odd == 0xaaaaaaaau);
    o[2] = from7;
    o[3] = down;
    o[4] = static_cast<int>(fx * 2.0f);
}

// Lanes 0-3 leave before the others shuffle: undefined on a GPU.
__global__ void k_early_exit(int* out) {
    const int lane = static_cast<int>(threadIdx.x & 31u);
    if (lane < 4) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, lane, 1);
}

// Odd lanes ballot while even lanes shuffle.
__global__ void k_mixed_collectives(int* out) {
    const int lane = static_cast<int>(threadIdx.x & 31u);
    out[threadIdx.x] = (lane & 1) ? static_cast<int>(__ballot_sync(0xffffffffu, 1))
                                  : __shfl_sync(0xffffffffu, lane, 0);
}

TEST_CASE(emulator_collectives) {
    const unsigned grid = 2, block = 64;
    std::vector<int> out(grid * block * 5, -1);
    dspark_emu::launch(grid, block, [&] { k_collectives(out.data()); });
    for (unsigned t = 0; t < grid * block; ++t) {
        const int lane = static_cast<int>(t % 32);
        const int* o = out.data() + t * 5;
        CHECK_EQ(o[0], 496);                             // 0 + 1 + ... + 31 in every lane
        CHECK_EQ(o[1], 1);                               // odd lanes' ballot bits
        CHECK_EQ(o[2], 70);                              // lane 7's value
        CHECK_EQ(o[3], lane < 16 ? lane + 16 : lane);    // out of range: own value
        CHECK_EQ(o[4], 2 * (lane ^ 1) + 1);              // float bits travel intact
    }
}

TEST_CASE(emulator_reports_divergence) {
    std::vector<int> out(64, 0);
    CHECK_THROWS(dspark_emu::launch(1, 32, [&] { k_early_exit(out.data()); }), std::runtime_error);
    CHECK_THROWS(dspark_emu::launch(1, 32, [&] { k_mixed_collectives(out.data()); }), std::runtime_error);
    CHECK_THROWS(dspark_emu::launch(1, 48, [&] { k_collectives(out.data()); }), std::invalid_argument);
    // A kernel launching a kernel is reported, not deadlocked.
    CHECK_THROWS(dspark_emu::launch(1, 32, [&] { dspark_emu::launch(1, 32, [&] { k_collectives(out.data()); }); }),
                 std::runtime_error);
    // A misaligned vector access faults on a GPU; here the launch reports it.
    alignas(16) float f[8] = {};
    CHECK_THROWS(dspark_emu::launch(1, 32, [&] { (void)kernels::vload<float4>(f + 1, 0); }), std::runtime_error);
    CHECK_THROWS(dspark_emu::launch(1, 32, [&] { kernels::vstore(f + 2, 0, float4{}); }), std::runtime_error);
    // A failed launch leaves the emulator usable.
    std::vector<int> ok(32 * 5, -1);
    dspark_emu::launch(1, 32, [&] { k_collectives(ok.data()); });
    CHECK_EQ(ok[0], 496);
}

TEST_CASE(emulated_runtime) {
    // The last error is per host thread, as in CUDA: one thread's failure is
    // not another's cudaGetLastError().
    (void)cudaGetLastError();
    std::thread other([] { CHECK_EQ(cudaSetDevice(99), cudaErrorInvalidDevice); });
    other.join();
    CHECK_EQ(cudaGetLastError(), cudaSuccess);
    CHECK_EQ(cudaSetDevice(99), cudaErrorInvalidDevice);
    CHECK_EQ(cudaGetLastError(), cudaErrorInvalidDevice);
    CHECK_EQ(cudaGetLastError(), cudaSuccess);
    // Allocations: impossible sizes fail; pointers are device memory exactly
    // inside a live allocation; copies must stay inside one.
    void* p = nullptr;
    CHECK_EQ(cudaMalloc(&p, SIZE_MAX), cudaErrorMemoryAllocation);
    (void)cudaGetLastError();
    CHECK_EQ(cudaMalloc(&p, 100), cudaSuccess);
    cudaPointerAttributes a{};
    CHECK_EQ(cudaPointerGetAttributes(&a, static_cast<char*>(p) + 99), cudaSuccess);
    CHECK_EQ(a.type, cudaMemoryTypeDevice);
    CHECK_EQ(cudaPointerGetAttributes(&a, static_cast<char*>(p) + 100), cudaSuccess);
    CHECK_EQ(a.type, cudaMemoryTypeUnregistered);
    int host = 0;
    CHECK_EQ(cudaPointerGetAttributes(&a, &host), cudaSuccess);
    CHECK_EQ(a.type, cudaMemoryTypeUnregistered);
    char buf[128] = {};
    CHECK_EQ(cudaMemcpy(p, buf, 100, cudaMemcpyHostToDevice), cudaSuccess);
    CHECK_EQ(cudaMemcpy(p, buf, 101, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
    volatile std::size_t huge = SIZE_MAX - 10;  // volatile: no compile-time bound warning for the unexecuted copy
    CHECK_EQ(cudaMemcpy(buf, static_cast<char*>(p) + 50, huge, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    CHECK_EQ(cudaMemcpy(&host, buf, 4, cudaMemcpyHostToDevice), cudaErrorInvalidValue);  // not device memory
    (void)cudaGetLastError();
    CHECK_EQ(cudaFree(p), cudaSuccess);
    CHECK_EQ(cudaFree(p), cudaErrorInvalidValue);  // twice
    (void)cudaGetLastError();
}

TEST_CASE(nonfinite_flag_is_first_index_at_any_grid) {
    // Non-finite values in several blocks and warps: the flag holds the
    // smallest index whatever order the warps ran in.
    ScalarPath sp;
    std::vector<float> x(64 * 256, 1.0f);
    x[9000] = std::numeric_limits<float>::infinity();
    x[5000 + 31] = std::nanf("");
    x[12000] = -std::numeric_limits<float>::infinity();
    for (int st = 0; st < STORAGE_COUNT; ++st) {
        const std::size_t rb = row_bytes(static_cast<Storage>(st), 256);
        std::vector<std::uint8_t> got(64 * rb);
        for (unsigned grid : {1u, 2u, 5u, 64u})
            CHECK_EQ(gpu_encode(x.data(), bm::E_F32, got.data(), st, x.size(), bm::NF_ERROR, grid), 5031);
    }
}

TEST_MAIN()
