// The CUDA kernels' arithmetic, compiled for the host, against the CPU path.
//
// csrc/cuda/block_math.cuh holds every per-element and per-block operation
// the kernels perform (as __host__ __device__ functions). Built here as plain
// C++ (with -ffp-contract=off, so + * / are single round-to-nearest-even
// operations like __fadd_rn / __fmul_rn / __fdiv_rn), it must give exactly
// the bytes of dspark::encode_rows / decode_rows on the scalar path. The
// helpers below replay the kernels' control flow (row_format_cuda.cu): the
// element kernels, the warp-per-block quantizers (the shuffle butterfly is
// simulated lane by lane with the same combine operators) and the decoders.
// This runs on any machine; tests/test_cuda.py checks the real GPU bytes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "../cuda/block_math.cuh"
#include "check.hpp"
#include "dspark/row_format.hpp"

using namespace dspark;

namespace {

float from_bits(std::uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
std::uint32_t bits(float f) { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }

struct ScalarPath {
    SimdPath saved = active_simd_path();
    ScalarPath() { set_simd_path(SimdPath::Scalar); }
    ~ScalarPath() { set_simd_path(saved); }
};

// ------------------------------------------------ kernel replays (host) ---

// Warp butterfly over 32 lanes (as __shfl_xor_sync with offsets 16..1).
float warp_q8_amax(const float* v) {
    unsigned nan_lanes = 0;
    for (int l = 0; l < 32; ++l) if (bm::is_nan(v[l])) nan_lanes |= 1u << l;
    if (nan_lanes) { int first = 0; while (!(nan_lanes >> first & 1u)) ++first; return bm::abs_f(v[first]); }
    float a[32];
    for (int l = 0; l < 32; ++l) a[l] = bm::abs_f(v[l]);
    for (int o = 16; o > 0; o >>= 1) {
        float n[32];
        for (int l = 0; l < 32; ++l) n[l] = bm::q8_amax_combine(a[l], a[l ^ o]);
        std::memcpy(a, n, sizeof a);
    }
    for (int l = 1; l < 32; ++l) if (bits(a[l]) != bits(a[0])) return std::nanf("lanes disagree");
    return a[0];
}

float warp_q4_max(const float* v) {
    unsigned nan_lanes = 0;
    for (int l = 0; l < 32; ++l) if (bm::is_nan(v[l])) nan_lanes |= 1u << l;
    if (nan_lanes) { int first = 0; while (!(nan_lanes >> first & 1u)) ++first; return v[first]; }
    bm::ArgMax p[32];
    for (int l = 0; l < 32; ++l) p[l] = {bm::abs_f(v[l]), l};
    for (int o = 16; o > 0; o >>= 1) {
        bm::ArgMax n[32];
        for (int l = 0; l < 32; ++l) n[l] = bm::q4_argmax_combine(p[l], p[l ^ o]);
        std::memcpy(p, n, sizeof p);
    }
    for (int l = 1; l < 32; ++l) if (p[l].j != p[0].j) return std::nanf("lanes disagree");
    return p[0].a == 0.0f ? 0.0f : v[p[0].j];
}

// k_encode_float / k_quantize for a whole run; returns the first non-finite
// index under NF_ERROR (what the atomicMin flag ends up holding) or -1.
std::int64_t gpu_encode(const void* src, int in, std::uint8_t* dst, int out, std::size_t n, int policy) {
    std::int64_t bad = -1;
    if (out <= bm::S_BF16) {
        for (std::size_t i = 0; i < n; ++i) {
            float v = bm::load_elem(src, in, i);
            if (policy == bm::NF_ERROR) {
                if (bad < 0 && bm::is_nonfinite(v)) bad = static_cast<std::int64_t>(i);
                if (in == out) {
                    const std::size_t eb = in == bm::E_F32 ? 4 : 2;
                    std::memcpy(dst + i * eb, static_cast<const std::uint8_t*>(src) + i * eb, eb);
                    continue;
                }
            } else {
                v = bm::apply_policy(v, policy);
            }
            bm::store_elem(dst, out, i, v);
        }
        return bad;
    }
    for (std::size_t b = 0; b < n / 32; ++b) {
        float v[32];
        for (int l = 0; l < 32; ++l) {
            v[l] = bm::load_elem(src, in, b * 32 + l);
            if (policy == bm::NF_ERROR) {
                if (bad < 0 && bm::is_nonfinite(v[l])) bad = static_cast<std::int64_t>(b * 32 + l);
            } else {
                v[l] = bm::apply_policy(v[l], policy);
            }
        }
        if (out == bm::S_Q8_0) {
            const bm::Scales s = bm::q8_scales(warp_q8_amax(v));
            std::uint8_t* blk = dst + b * bm::Q8_BLOCK;
            for (int l = 0; l < 32; ++l) blk[2 + l] = bm::q8_quant(v[l], s.id);
            const std::uint16_t dh = bm::f32_to_f16(s.d);
            blk[0] = dh & 0xff; blk[1] = dh >> 8;
        } else {
            const bm::Scales s = bm::q4_scales(warp_q4_max(v));
            std::uint8_t* blk = dst + b * bm::Q4_BLOCK;
            std::uint32_t q[32];
            for (int l = 0; l < 32; ++l) q[l] = bm::q4_quant(v[l], s.id);
            for (int l = 0; l < 16; ++l) blk[2 + l] = static_cast<std::uint8_t>(q[l] | (q[l + 16] << 4));
            const std::uint16_t dh = bm::f32_to_f16(s.d);
            blk[0] = dh & 0xff; blk[1] = dh >> 8;
        }
    }
    return bad;
}

// k_dequantize / k_decode_float (same format: a byte copy).
void gpu_decode(const std::uint8_t* src, int in, void* dst, int out, std::size_t n) {
    if (in == out) {
        std::memcpy(dst, src, n * (out == bm::E_F32 ? 4 : 2));
        return;
    }
    for (std::size_t i = 0; i < n; ++i) {
        float v;
        if (in <= bm::S_BF16) {
            v = bm::load_elem(src, in, i);
        } else {
            const std::uint8_t* blk = src + (i / 32) * (in == bm::S_Q8_0 ? bm::Q8_BLOCK : bm::Q4_BLOCK);
            const float d = bm::block_scale(blk);
            v = in == bm::S_Q8_0 ? bm::q8_dequant(blk, d, static_cast<int>(i % 32))
                                 : bm::q4_dequant(blk, d, static_cast<int>(i % 32));
        }
        bm::store_elem(dst, out, i, v);
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

// The dataset in element type et (f16 / bf16 via the CPU's encoder, keeping
// NaN / Inf).
std::vector<std::uint8_t> as_type(const std::vector<float>& x, ElemType et) {
    std::vector<std::uint8_t> out(x.size() * elem_bytes(et));
    if (et == ElemType::F32) std::memcpy(out.data(), x.data(), out.size());
    else encode_rows(x.data(), ElemType::F32, out.data(), static_cast<Storage>(et), 1, x.size(), NonFinite::Error);
    return out;
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
            for (int pol = 0; pol < 3; ++pol) {
                const std::size_t rb = row_bytes(static_cast<Storage>(st), DIM);
                std::vector<std::uint8_t> want(rows * rb, 0xcd), got(rows * rb, 0xab);
                const std::int64_t wb = encode_rows(src.data(), static_cast<ElemType>(in), want.data(),
                                                    static_cast<Storage>(st), rows, DIM, static_cast<NonFinite>(pol));
                const std::int64_t gb = gpu_encode(src.data(), in, got.data(), st, rows * DIM, pol);
                const int d = first_diff(want, got);
                if (d != -1 || wb != gb)
                    std::printf("  encode in=%d storage=%s policy=%d nonfinite=%d: first differing byte %d, "
                                "first_bad %lld vs %lld\n", in, storage_name(static_cast<Storage>(st)), pol,
                                nonfinite, d, static_cast<long long>(wb), static_cast<long long>(gb));
                CHECK_EQ(d, -1);
                CHECK_EQ(wb, gb);
            }
        }
    }
}

}  // namespace

TEST_CASE(encode_matches_cpu_finite) { check_encode_all(false, 1234, 64); }

TEST_CASE(encode_matches_cpu_nonfinite) { check_encode_all(true, 99, 64); }

TEST_CASE(encode_matches_cpu_many_seeds) {
    for (unsigned seed = 1; seed <= 8; ++seed) check_encode_all(seed % 2 == 0, seed * 7919u, 16);
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
                std::vector<std::uint8_t> want(rows * DIM * eb, 0xcd), got(rows * DIM * eb, 0xab);
                decode_rows(enc.data(), static_cast<Storage>(st), want.data(), static_cast<ElemType>(out), rows, DIM);
                gpu_decode(enc.data(), st, got.data(), out, rows * DIM);
                const int d = first_diff(want, got);
                if (d != -1)
                    std::printf("  decode storage=%s out=%d nonfinite=%d: first differing byte %d\n",
                                storage_name(static_cast<Storage>(st)), out, nonfinite, d);
                CHECK_EQ(d, -1);
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
    CHECK_EQ(warp_q4_max(y), 8.0f);
    y[5] = -8.0f; y[20] = 8.0f;
    CHECK_EQ(warp_q4_max(y), -8.0f);
    // Sequential and warp selections agree.
    const auto x = dataset(4000, 77, true);
    for (std::size_t b = 0; b < 4000; ++b) {
        const float* v = x.data() + b * 32;
        CHECK_EQ(bits(bm::q8_amax_seq(v)), bits(warp_q8_amax(v)));
        CHECK_EQ(bits(bm::q4_max_seq(v)), bits(warp_q4_max(v)));
    }
}

TEST_MAIN()
