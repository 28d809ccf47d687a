// Per-element and per-block arithmetic of the row formats, shared by the CUDA
// kernels (row_format_kernels.cuh) and the host tests (csrc/tests/test_cuda_kernels.cpp).
//
// This header compiles as CUDA (__host__ __device__) and as plain C++17. The
// CPU scalar path (csrc/src/row_format.cpp + row_format_kernels.hpp) is the
// definition of the bytes; everything here is written so that the same
// source gives those bytes on both sides:
//
//  * every float operation is one IEEE round-to-nearest-even operation:
//    __fadd_rn / __fmul_rn / __fdiv_rn on the device (never contracted into
//    an FMA, never approximate), plain + * / on the host (the test is built
//    with -ffp-contract=off); subnormals are kept (no FTZ) on both sides;
//  * fp16 / bf16 conversions are the CPU's integer bit recipes (NaN payloads
//    kept, quieted), not __float2half_rn (which canonicalises NaN);
//  * float -> int is x86 cvttss2si (NaN / out of range -> INT32_MIN), not
//    the device's saturating conversion;
//  * round-half-away-from-zero is computed exactly (trunc + exact fraction);
//  * the few operations whose NaN *payload* reaches the output bytes (the q
//    scales of a block holding a NaN, dequantization with d = NaN or
//    inf * 0) follow x86 SSE NaN rules: the first NaN operand, quieted, and
//    the default NaN 0xffc00000 for an invalid operation. (A GPU returns its
//    canonical 0x7fffffff instead.)
//
// Do not compile users of this header with -use_fast_math / -ffast-math.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DSPARK_HD __host__ __device__ __forceinline__
#else
#define DSPARK_HD inline
#endif

namespace dspark {
namespace bm {

// Elements per quantization block and block sizes (as row_format.hpp).
constexpr int QK = 32;
constexpr int Q8_BLOCK = 2 + QK;
constexpr int Q4_BLOCK = 2 + QK / 2;

// Element / storage codes (the values of dspark::ElemType / dspark::Storage).
enum : int { E_F32 = 0, E_F16 = 1, E_BF16 = 2 };
enum : int { S_F32 = 0, S_F16 = 1, S_BF16 = 2, S_Q8_0 = 3, S_Q4_0 = 4 };
// dspark::NonFinite.
enum : int { NF_ERROR = 0, NF_ZERO = 1, NF_CLAMP_F16 = 2, NF_CLAMP = 3 };

// ------------------------------------------------------------- bit casts ---

DSPARK_HD std::uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
#endif
}

DSPARK_HD float u2f(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

// ------------------------------------------------- correctly rounded ops ---

DSPARK_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

DSPARK_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

DSPARK_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

DSPARK_HD float trunc_f(float a) {
#if defined(__CUDA_ARCH__)
    return truncf(a);
#else
    return std::trunc(a);
#endif
}

DSPARK_HD bool is_nan(float f) { return (f2u(f) & 0x7fffffffu) > 0x7f800000u; }
DSPARK_HD bool is_nonfinite(float f) { return (f2u(f) & 0x7f800000u) == 0x7f800000u; }
DSPARK_HD float abs_f(float f) { return u2f(f2u(f) & 0x7fffffffu); }
DSPARK_HD float quiet(float f) { return u2f(f2u(f) | 0x00400000u); }

// x86 SSE NaN result rules for a binary operation a op b whose IEEE result is r.
DSPARK_HD float x86_nan_rules(float a, float b, float r) {
    if (is_nan(a)) return quiet(a);
    if (is_nan(b)) return quiet(b);
    if (is_nan(r)) return u2f(0xffc00000u);  // invalid operation: "QNaN indefinite"
    return r;
}
DSPARK_HD float x86_mul(float a, float b) { return x86_nan_rules(a, b, mul_rn(a, b)); }
DSPARK_HD float x86_div(float a, float b) { return x86_nan_rules(a, b, div_rn(a, b)); }

// x86 cvttss2si: truncate toward zero; NaN or outside int32 -> INT32_MIN.
DSPARK_HD std::int32_t cvtt_i32(float v) {
    if (!(abs_f(v) < 2147483648.0f)) return static_cast<std::int32_t>(0x80000000u);
    return static_cast<std::int32_t>(v);
}

// C roundf (halves away from zero), computed exactly: x - trunc(x) is exact
// and so is t +- 1 for |t| < 2^24 (larger floats are integers: frac == 0).
// NaN / +-inf come back as NaN / +-inf.
DSPARK_HD float round_half_away(float x) {
    const float t = trunc_f(x);
    const float frac = abs_f(add_rn(x, -t));
    if (frac >= 0.5f) return add_rn(t, (f2u(x) & 0x80000000u) ? -1.0f : 1.0f);
    return t;
}

// ----------------------------------------------------- fp16 / bf16 bits ---

// IEEE binary32 -> binary16, RNE; overflow -> inf; subnormals exact; NaN ->
// quiet NaN keeping the top 9 payload bits (f32_to_f16_scalar).
DSPARK_HD std::uint16_t f32_to_f16(float f) {
    const std::uint32_t x = f2u(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x47800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    if (ax >= 0x38800000u) {
        const std::uint32_t r = ax - 0x38000000u;
        return static_cast<std::uint16_t>(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
    }
    const float t = add_rn(u2f(ax), 0.5f);  // RNE onto the 2^-24 grid
    return static_cast<std::uint16_t>(sign | (f2u(t) - 0x3f000000u));
}

// binary16 -> binary32, exact; a signalling NaN comes back quiet.
DSPARK_HD float f16_to_f32(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu;
    const std::uint32_t man = h & 0x3ffu;
    std::uint32_t u;
    if (exp == 0) {
        if (man == 0) return u2f(sign);
        const float v = mul_rn(static_cast<float>(man), 5.9604644775390625e-08f);  // exact
        u = sign | f2u(v);
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return u2f(u);
}

// ggml_compute_fp32_to_bf16: RNE, NaN kept quiet, subnormals not flushed.
DSPARK_HD std::uint16_t f32_to_bf16(float f) {
    const std::uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 64u);
    return static_cast<std::uint16_t>((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

DSPARK_HD float bf16_to_f32(std::uint16_t b) { return u2f(static_cast<std::uint32_t>(b) << 16); }

// Element `i` of a run of elements of type `et`, widened exactly to f32.
DSPARK_HD float load_elem(const void* src, int et, std::size_t i) {
    if (et == E_F32) return static_cast<const float*>(src)[i];
    const std::uint16_t h = static_cast<const std::uint16_t*>(src)[i];
    return et == E_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// Store v as element `i` of type `et` (one RNE step for f16 / bf16).
DSPARK_HD void store_elem(void* dst, int et, std::size_t i, float v) {
    if (et == E_F32) {
        static_cast<float*>(dst)[i] = v;
    } else {
        static_cast<std::uint16_t*>(dst)[i] = et == E_F16 ? f32_to_f16(v) : f32_to_bf16(v);
    }
}

// ------------------------------------------------------ non-finite policy ---

// The smallest magnitude storage `st` cannot encode as a finite value, as
// bits (dspark::encode_bounds(st).limit: +inf, 65520, 0x1.ffp+127,
// 127 * 65520, 8 * 65520); the clamp bound is the float just below it.
DSPARK_HD std::uint32_t limit_bits(int st) {
    return st == S_F16 ? 0x477ff000u : st == S_BF16 ? 0x7f7f8000u : st == S_Q8_0 ? 0x4afdf020u
                                                                : st == S_Q4_0 ? 0x48fff000u : 0x7f800000u;
}
// The kernels take the limit as bits: the storage's own, or a tighter one
// when the rows are staged in a narrower type (dspark::encode_bounds(st,
// staged).limit: f32 rows staged as f16 must stay below 65520). Either way
// the clamp bound is the float just below it, as encode_bounds' clamp_to.
//
// !(|v| < limit): NaN, +-Inf, or a finite value whose encoding (or staging)
// overflows.
DSPARK_HD bool beyond(float v, std::uint32_t limit) { return !(abs_f(v) < u2f(limit)); }

// NF_ZERO: unencodable -> 0. NF_CLAMP: NaN -> 0, clamp to the largest
// encodable magnitude. NF_CLAMP_F16: the same, bounded by +-65504 too.
// NF_ERROR: unchanged (the caller records the first unencodable index).
DSPARK_HD float apply_policy(float v, int policy, std::uint32_t limit) {
    if (policy == NF_ZERO) return beyond(v, limit) ? 0.0f : v;
    if (policy == NF_CLAMP || policy == NF_CLAMP_F16) {
        float hi = u2f(limit - 1u);
        if (policy == NF_CLAMP_F16 && hi > 65504.0f) hi = 65504.0f;
        if (v != v) v = 0.0f;
        v = v < -hi ? -hi : v;
        v = v > hi ? hi : v;
    }
    return v;
}

// ------------------------------------------------------------------- q8_0 ---
//
// A block is quantized in three steps so the device can do step 1 with a
// warp reduction and steps 2-3 per lane:
//  1. amax: the largest |x| of the block, or |x| of its FIRST NaN if any;
//  2. scales: d = amax / 127 (fp32), id = d ? 1 / d : 0, d stored as fp16;
//  3. each q = low byte of cvtt(roundf(x * id)).

struct Scales {
    float d;   // fp32 scale (stored as fp16)
    float id;  // fp32 inverse used for the quants
};

DSPARK_HD float q8_amax_seq(const float* x) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) {
        const float a = abs_f(x[j]);
        if (is_nan(a)) return a;
        if (a > amax) amax = a;
    }
    return amax;
}

// Warp form of step 1 (the device reduces with __shfl_xor_sync over lanes
// 16, 8, 4, 2, 1 using these combine operators; max is exact and order-free).
DSPARK_HD float q8_amax_combine(float a, float b) { return b > a ? b : a; }

DSPARK_HD Scales q8_scales(float amax) {
    const float d = x86_div(amax, 127.0f);
    const float id = d != 0.0f ? x86_div(1.0f, d) : 0.0f;
    return {d, id};
}

DSPARK_HD std::uint8_t q8_quant(float x, float id) {
    return static_cast<std::uint8_t>(static_cast<std::uint32_t>(cvtt_i32(round_half_away(mul_rn(x, id)))) & 0xffu);
}

// Whole block (the host test's entry point; the device uses the steps).
DSPARK_HD void q8_block(const float* x, std::uint8_t* out) {
    const Scales s = q8_scales(q8_amax_seq(x));
    const std::uint16_t dh = f32_to_f16(s.d);
    out[0] = static_cast<std::uint8_t>(dh & 0xff);
    out[1] = static_cast<std::uint8_t>(dh >> 8);
    for (int j = 0; j < QK; ++j) out[2 + j] = q8_quant(x[j], s.id);
}

// ------------------------------------------------------------------- q4_0 ---
//
//  1. max: the block's FIRST NaN if any, else the first element of largest
//     magnitude, else (every |x| == 0) +0.0;
//  2. d = max / -8 (fp32; +0 / -8 = -0 -> fp16 0x8000), id = d ? 1 / d : 0;
//  3. q = min(15, low byte of cvtt(x * id + 8.5)); element j is the low
//     nibble of byte j, element j + 16 its high nibble.

DSPARK_HD float q4_max_seq(const float* x) {
    float amax = 0.0f;
    float max = 0.0f;
    for (int j = 0; j < QK; ++j) {
        const float v = x[j];
        if (is_nan(v)) return v;
        if (amax < abs_f(v)) {
            amax = abs_f(v);
            max = v;
        }
    }
    return max;
}

// Warp form of step 1 for finite blocks: each lane holds (|x_j|, j); the
// combine keeps the larger magnitude, ties going to the lower index (the
// first element of largest magnitude). After the butterfly every lane holds
// the winner; when its magnitude is 0 the block max is +0.0, else x[winner].
struct ArgMax {
    float a;
    int j;
};
DSPARK_HD ArgMax q4_argmax_combine(ArgMax p, ArgMax q) {
    if (q.a > p.a || (q.a == p.a && q.j < p.j)) return q;
    return p;
}

DSPARK_HD Scales q4_scales(float max) {
    const float d = x86_div(max, -8.0f);
    const float id = d != 0.0f ? x86_div(1.0f, d) : 0.0f;
    return {d, id};
}

DSPARK_HD std::uint32_t q4_quant(float x, float id) {
    const float x0 = add_rn(mul_rn(x, id), 8.5f);
    const std::uint32_t q = static_cast<std::uint32_t>(cvtt_i32(x0)) & 0xffu;
    return q < 15u ? q : 15u;
}

DSPARK_HD void q4_block(const float* x, std::uint8_t* out) {
    const Scales s = q4_scales(q4_max_seq(x));
    const std::uint16_t dh = f32_to_f16(s.d);
    out[0] = static_cast<std::uint8_t>(dh & 0xff);
    out[1] = static_cast<std::uint8_t>(dh >> 8);
    for (int j = 0; j < QK / 2; ++j)
        out[2 + j] = static_cast<std::uint8_t>(q4_quant(x[j], s.id) | (q4_quant(x[QK / 2 + j], s.id) << 4));
}

// -------------------------------------------------------------- decoding ---

DSPARK_HD float block_scale(const std::uint8_t* blk) {
    return f16_to_f32(static_cast<std::uint16_t>(blk[0] | (blk[1] << 8)));
}

// Element j of a q8_0 / q4_0 block, exact in f32 (x86 NaN rules for d = NaN
// and inf * 0).
DSPARK_HD float q8_dequant(const std::uint8_t* blk, float d, int j) {
    return x86_mul(static_cast<float>(static_cast<std::int8_t>(blk[2 + j])), d);
}

DSPARK_HD float q4_dequant(const std::uint8_t* blk, float d, int j) {
    const std::uint8_t b = blk[2 + (j & (QK / 2 - 1))];
    const int q = (j < QK / 2 ? (b & 0x0f) : (b >> 4)) - 8;
    return x86_mul(static_cast<float>(q), d);
}

}  // namespace bm
}  // namespace dspark
