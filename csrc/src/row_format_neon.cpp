// NEON (AArch64 Advanced SIMD) row-format kernels: baseline ARMv8-A, so this
// TU needs no extra flags (every AArch64 CPU has NEON; the registry still
// checks the ASIMD hwcap). Byte-identical to the scalar kernels in
// row_format.cpp, whose x86 semantics they reproduce where ARM differs:
//  * float -> int: FCVTZS saturates (+big -> INT32_MAX) where x86's cvttss2si
//    gives INT32_MIN; both give NaN -> a low byte of 0, so only |v| >= 2^31
//    is patched (to 0, INT32_MIN's low byte);
//  * inf * 0 in a decode: ARM's default NaN is 0x7fc00000, x86's 0xffc00000;
//    a block whose scale is infinite goes to the scalar block code, which
//    patches it (mul_x86_nan).
// FCVTN / FCVTL (f32 <-> f16) round to nearest even and keep NaN payloads as
// F16C does (quieted, top bits), under the default FPCR (no flush to zero).
#if defined(DSPARK_AARCH64)
#include <arm_neon.h>

#include "row_format_kernels.hpp"

namespace dspark {
namespace detail {
namespace {

// All-ones lanes where !(|v| < limit): NaN, +-Inf, or a value whose
// encoding overflows (the limits are in row_format_kernels.hpp).
inline uint32x4_t over4(float32x4_t v, float32x4_t limit) { return vmvnq_u32(vcaltq_f32(v, limit)); }

inline bool any4(uint32x4_t m) { return vmaxvq_u32(m) != 0; }

bool n_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t n) {
    const float32x4_t lim = vdupq_n_f32(F16_LIMIT);
    uint32x4_t bad = vdupq_n_u32(0);
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float32x4_t v0 = vld1q_f32(src + i), v1 = vld1q_f32(src + i + 4);
        bad = vorrq_u32(bad, vorrq_u32(over4(v0, lim), over4(v1, lim)));
        vst1q_u16(dst + i, vreinterpretq_u16_f16(vcvt_high_f16_f32(vcvt_f16_f32(v0), v1)));
    }
    const bool tail = kScalarKernels.f32_to_f16(src + i, dst + i, n - i);
    return tail || any4(bad);
}

void n_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(src + i));
        vst1q_f32(dst + i, vcvt_f32_f16(vget_low_f16(h)));
        vst1q_f32(dst + i + 4, vcvt_high_f32_f16(h));
    }
    kScalarKernels.f16_to_f32(src + i, dst + i, n - i);
}

// ggml's rounding in integer arithmetic (f32_to_bf16_scalar), 4 lanes:
// (u + 0x7fff + lsb) >> 16, NaN -> (u >> 16) | 0x40 == (u | 0x400000) >> 16.
inline uint16x4_t bf16_4(uint32x4_t u) {
    const uint32x4_t isnan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffffu)), vdupq_n_u32(0x7f800000u));
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1u));
    const uint32x4_t rne = vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fffu)));
    const uint32x4_t qnan = vorrq_u32(u, vdupq_n_u32(0x00400000u));
    return vshrn_n_u32(vbslq_u32(isnan, qnan, rne), 16);
}

bool n_f32_to_bf16(const float* src, std::uint16_t* dst, std::size_t n) {
    const float32x4_t lim = vdupq_n_f32(BF16_LIMIT);
    uint32x4_t bad = vdupq_n_u32(0);
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint32x4_t u0 = vld1q_u32(reinterpret_cast<const std::uint32_t*>(src + i));
        const uint32x4_t u1 = vld1q_u32(reinterpret_cast<const std::uint32_t*>(src + i + 4));
        bad = vorrq_u32(bad, vorrq_u32(over4(vreinterpretq_f32_u32(u0), lim), over4(vreinterpretq_f32_u32(u1), lim)));
        vst1q_u16(dst + i, vcombine_u16(bf16_4(u0), bf16_4(u1)));
    }
    const bool tail = kScalarKernels.f32_to_bf16(src + i, dst + i, n - i);
    return tail || any4(bad);
}

void n_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint16x8_t b = vld1q_u16(src + i);
        vst1q_u32(reinterpret_cast<std::uint32_t*>(dst + i), vshll_n_u16(vget_low_u16(b), 16));
        vst1q_u32(reinterpret_cast<std::uint32_t*>(dst + i + 4), vshll_high_n_u16(b, 16));
    }
    kScalarKernels.bf16_to_f32(src + i, dst + i, n - i);
}

inline void store_d(std::uint8_t* p, std::uint16_t h) {
    p[0] = static_cast<std::uint8_t>(h & 0xff);
    p[1] = static_cast<std::uint8_t>(h >> 8);
}

// One block's 32 floats as 8 vectors.
struct Block {
    float32x4_t v[8];
};
inline Block load_block(const float* x) {
    Block b;
    for (int k = 0; k < 8; ++k) b.v[k] = vld1q_f32(x + 4 * k);
    return b;
}
inline bool has_nan(const Block& b) {
    uint32x4_t ord = vceqq_f32(b.v[0], b.v[0]);
    for (int k = 1; k < 8; ++k) ord = vandq_u32(ord, vceqq_f32(b.v[k], b.v[k]));
    return vminvq_u32(ord) == 0;
}
// Lane-wise max of |x| over the block (4 lanes; no NaN in the block).
inline float32x4_t absmax4(const Block& b) {
    float32x4_t m = vabsq_f32(b.v[0]);
    for (int k = 1; k < 8; ++k) m = vmaxq_f32(m, vabsq_f32(b.v[k]));
    return m;
}

// x86 cvttss2si's low byte: FCVTZS, with |v| >= 2^31 (INT32_MIN on x86, a
// saturated value here) patched to 0. NaN is 0 on both.
inline int32x4_t cvtt4(float32x4_t v) {
    const uint32x4_t out_of_range = vcageq_f32(v, vdupq_n_f32(2147483648.0f));
    return vreinterpretq_s32_u32(vbicq_u32(vreinterpretq_u32_s32(vcvtq_s32_f32(v)), out_of_range));
}

// The low bytes of 16 int32 lanes, in order.
inline uint8x16_t low_bytes(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
    const int16x8_t ab = vmovn_high_s32(vmovn_s32(a), b);
    const int16x8_t cd = vmovn_high_s32(vmovn_s32(c), d);
    return vreinterpretq_u8_s8(vmovn_high_s16(vmovn_s16(ab), cd));
}

// Quantizers work in groups of G4 blocks: one pairwise-max tree gives the 4
// block maxima as a vector, and the scales (two IEEE divisions and an f16
// rounding per block) are computed 4 at a time. Divisions are correctly
// rounded, so the bytes are the scalar ones. A group holding a NaN goes to
// the scalar block code; the tail goes block by block.
constexpr std::size_t G4 = 4;

// The 32 quants of a q8_0 block (after its d): roundf(x * id), low byte.
inline void q8_quants(const Block& b, std::uint8_t* out, float id) {
    const float32x4_t vid = vdupq_n_f32(id);
    int32x4_t q[8];
    for (int k = 0; k < 8; ++k) q[k] = cvtt4(vrndaq_f32(vmulq_f32(b.v[k], vid)));  // FRINTA: ties away
    vst1q_u8(out + 2, low_bytes(q[0], q[1], q[2], q[3]));
    vst1q_u8(out + 18, low_bytes(q[4], q[5], q[6], q[7]));
}

// The 16 nibble bytes of a q4_0 block: min(15, low byte of cvtt(x * id + 8.5)).
inline void q4_quants(const Block& b, std::uint8_t* out, float id) {
    const float32x4_t vid = vdupq_n_f32(id), half8 = vdupq_n_f32(8.5f);
    const uint32x4_t lowbyte = vdupq_n_u32(0xffu), fifteen = vdupq_n_u32(15u);
    uint32x4_t q[8];
    for (int k = 0; k < 8; ++k) {
        const float32x4_t x0 = vaddq_f32(vmulq_f32(b.v[k], vid), half8);
        q[k] = vminq_u32(vandq_u32(vreinterpretq_u32_s32(cvtt4(x0)), lowbyte), fifteen);
    }
    int32x4_t c[4];  // element j in the low nibble, j + 16 in the high one
    for (int k = 0; k < 4; ++k) c[k] = vreinterpretq_s32_u32(vorrq_u32(q[k], vshlq_n_u32(q[k + 4], 4)));
    vst1q_u8(out + 2, low_bytes(c[0], c[1], c[2], c[3]));
}

inline float q8_max(const Block&, const float*, float amax) { return amax; }

// Signed value of the first element whose magnitude is amax (+0 if amax is
// 0): the lanes equal to amax as a 32-bit mask, lowest set bit first.
inline float q4_signed_max(const Block& b, const float* x, float amax) {
    if (!(amax > 0.0f)) return 0.0f;
    const float32x4_t am = vdupq_n_f32(amax);
    const uint32x4_t weight = {1u, 2u, 4u, 8u};
    std::uint32_t mask = 0;
    for (int k = 0; k < 8; ++k)
        mask |= vaddvq_u32(vandq_u32(vceqq_f32(vabsq_f32(b.v[k]), am), weight)) << (4 * k);
    return x[__builtin_ctz(mask)];
}

template <void (*Scalar)(const float*, std::uint8_t*), float (*SignedMax)(const Block&, const float*, float),
          void (*Quants)(const Block&, std::uint8_t*, float)>
bool quantize_groups(const float* src, std::uint8_t* dst, std::size_t nb, std::size_t block_bytes, float divisor,
                     float limit) {
    // A block is unencodable when it holds a NaN or its largest magnitude
    // reaches `limit` (its fp16 scale would overflow; +-Inf included).
    const float32x4_t lim = vdupq_n_f32(limit);
    const float32x4_t div = vdupq_n_f32(divisor), one = vdupq_n_f32(1.0f);
    uint32x4_t bad = vdupq_n_u32(0);
    bool nan_seen = false;
    std::size_t b = 0;
    for (; b + G4 <= nb; b += G4) {
        const float* x = src + b * QK;
        std::uint8_t* out = dst + b * block_bytes;
        Block blk[G4];
        float32x4_t m[G4];
        bool nan = false;
        for (std::size_t k = 0; k < G4; ++k) {
            blk[k] = load_block(x + k * QK);
            nan |= has_nan(blk[k]);
        }
        if (nan) {
            nan_seen = true;
            for (std::size_t k = 0; k < G4; ++k) Scalar(x + k * QK, out + k * block_bytes);
            continue;
        }
        for (std::size_t k = 0; k < G4; ++k) {
            m[k] = absmax4(blk[k]);
            bad = vorrq_u32(bad, over4(m[k], lim));
        }
        // Lane k = the maximum of block k.
        const float32x4_t amax = vpmaxq_f32(vpmaxq_f32(m[0], m[1]), vpmaxq_f32(m[2], m[3]));
        alignas(16) float am[G4], mx[G4], id[G4];
        vst1q_f32(am, amax);
        for (std::size_t k = 0; k < G4; ++k) mx[k] = SignedMax(blk[k], x + k * QK, am[k]);
        const float32x4_t d = vdivq_f32(vld1q_f32(mx), div);
        const uint32x4_t nz = vmvnq_u32(vceqzq_f32(d));  // d != 0 (d is never NaN here)
        vst1q_f32(id, vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(vdivq_f32(one, vbslq_f32(nz, d, one))), nz)));
        alignas(8) std::uint16_t dh[G4];
        vst1_u16(dh, vreinterpret_u16_f16(vcvt_f16_f32(d)));
        for (std::size_t k = 0; k < G4; ++k) {
            store_d(out + k * block_bytes, dh[k]);
            Quants(blk[k], out + k * block_bytes, id[k]);
        }
    }
    for (; b < nb; ++b) {  // the tail, one block at a time
        const float* x = src + b * QK;
        std::uint8_t* out = dst + b * block_bytes;
        const Block blk = load_block(x);
        if (has_nan(blk)) {
            nan_seen = true;
            Scalar(x, out);
            continue;
        }
        const float32x4_t m = absmax4(blk);
        bad = vorrq_u32(bad, over4(m, lim));
        const float d = SignedMax(blk, x, vmaxvq_f32(m)) / divisor;
        const float i = d != 0.0f ? 1.0f / d : 0.0f;
        store_d(out, vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(d))), 0));
        Quants(blk, out, i);
    }
    return nan_seen || any4(bad);
}

bool n_quantize_q8_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    return quantize_groups<quantize_block_q8_0_scalar, q8_max, q8_quants>(src, dst, nb, Q8_0_BLOCK_BYTES, 127.0f,
                                                                          Q8_0_LIMIT);
}

bool n_quantize_q4_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    return quantize_groups<quantize_block_q4_0_scalar, q4_signed_max, q4_quants>(src, dst, nb, Q4_0_BLOCK_BYTES,
                                                                                  -8.0f, Q4_0_LIMIT);
}

inline float load_d(const std::uint8_t* p) { return f16_to_f32_scalar(static_cast<std::uint16_t>(p[0] | (p[1] << 8))); }

void n_dequantize_q8_0(const std::uint8_t* src, float* dst, std::size_t nb) {
    for (std::size_t b = 0; b < nb; ++b) {
        const std::uint8_t* blk = src + b * Q8_0_BLOCK_BYTES;
        const float df = load_d(blk);
        float* y = dst + b * QK;
        if (std::isinf(df)) {  // inf * 0: x86's NaN (see the top of this file)
            dequantize_block_q8_0_scalar(blk, y);
            continue;
        }
        const float32x4_t d = vdupq_n_f32(df);
        for (int h = 0; h < 2; ++h) {
            const int8x16_t q = vld1q_s8(reinterpret_cast<const std::int8_t*>(blk + 2 + 16 * h));
            const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
            float* yh = y + 16 * h;
            vst1q_f32(yh, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), d));
            vst1q_f32(yh + 4, vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(lo)), d));
            vst1q_f32(yh + 8, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), d));
            vst1q_f32(yh + 12, vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(hi)), d));
        }
    }
}

void n_dequantize_q4_0(const std::uint8_t* src, float* dst, std::size_t nb) {
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    const int8x16_t eight = vdupq_n_s8(8);
    for (std::size_t b = 0; b < nb; ++b) {
        const std::uint8_t* blk = src + b * Q4_0_BLOCK_BYTES;
        const float df = load_d(blk);
        float* y = dst + b * QK;
        if (std::isinf(df)) {
            dequantize_block_q4_0_scalar(blk, y);
            continue;
        }
        const float32x4_t d = vdupq_n_f32(df);
        const uint8x16_t raw = vld1q_u8(blk + 2);
        // Elements 0..15 are the low nibbles, 16..31 the high ones; minus 8.
        const int8x16_t parts[2] = {vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, m4)), eight),
                                    vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), eight)};
        for (int h = 0; h < 2; ++h) {
            const int16x8_t lo = vmovl_s8(vget_low_s8(parts[h])), hi = vmovl_high_s8(parts[h]);
            float* yh = y + 16 * h;
            vst1q_f32(yh, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), d));
            vst1q_f32(yh + 4, vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(lo)), d));
            vst1q_f32(yh + 8, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), d));
            vst1q_f32(yh + 12, vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(hi)), d));
        }
    }
}

std::int64_t n_find_unencodable_f32(const float* src, std::size_t n, float limit) {
    const float32x4_t lim = vdupq_n_f32(limit);
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const uint32x4_t m = vorrq_u32(vorrq_u32(over4(vld1q_f32(src + i), lim), over4(vld1q_f32(src + i + 4), lim)),
                                       vorrq_u32(over4(vld1q_f32(src + i + 8), lim), over4(vld1q_f32(src + i + 12), lim)));
        if (any4(m)) return static_cast<std::int64_t>(i) + kScalarKernels.find_unencodable_f32(src + i, 16, limit);
    }
    const std::int64_t r = kScalarKernels.find_unencodable_f32(src + i, n - i, limit);
    return r < 0 ? -1 : static_cast<std::int64_t>(i) + r;
}

// One pass: 16 floats loaded, stored and checked per iteration.
std::int64_t n_copy_find_nonfinite_f32(const float* src, float* dst, std::size_t n) {
    const uint32x4_t e = vdupq_n_u32(0x7f800000u);
    std::int64_t first_bad = -1;
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint32x4_t u[4];
        uint32x4_t bad = vdupq_n_u32(0);
        for (int k = 0; k < 4; ++k) {
            u[k] = vld1q_u32(reinterpret_cast<const std::uint32_t*>(src + i + 4 * k));
            bad = vorrq_u32(bad, vceqq_u32(vandq_u32(u[k], e), e));
        }
        for (int k = 0; k < 4; ++k) vst1q_u32(reinterpret_cast<std::uint32_t*>(dst + i + 4 * k), u[k]);
        if (first_bad < 0 && any4(bad))
            first_bad = static_cast<std::int64_t>(i) + kScalarKernels.find_unencodable_f32(src + i, 16, NO_LIMIT);
    }
    const std::int64_t r = kScalarKernels.copy_find_nonfinite_f32(src + i, dst + i, n - i);  // the tail
    if (first_bad < 0 && r >= 0) first_bad = static_cast<std::int64_t>(i) + r;
    return first_bad;
}

}  // namespace

bool neon_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t n) { return n_f32_to_f16(src, dst, n); }
void neon_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) { n_f16_to_f32(src, dst, n); }
void neon_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) { n_bf16_to_f32(src, dst, n); }
bool neon_quantize_q8_0(const float* src, std::uint8_t* dst, std::size_t nb) { return n_quantize_q8_0(src, dst, nb); }
bool neon_quantize_q4_0(const float* src, std::uint8_t* dst, std::size_t nb) { return n_quantize_q4_0(src, dst, nb); }
void neon_dequantize_q8_0(const std::uint8_t* src, float* dst, std::size_t nb) { n_dequantize_q8_0(src, dst, nb); }
void neon_dequantize_q4_0(const std::uint8_t* src, float* dst, std::size_t nb) { n_dequantize_q4_0(src, dst, nb); }
std::int64_t neon_find_unencodable_f32(const float* src, std::size_t n, float limit) {
    return n_find_unencodable_f32(src, n, limit);
}
std::int64_t neon_copy_find_nonfinite_f32(const float* src, float* dst, std::size_t n) {
    return n_copy_find_nonfinite_f32(src, dst, n);
}

const Kernels kNeonKernels = {
    neon_f32_to_f16,      n_f32_to_bf16,        neon_f16_to_f32,           neon_bf16_to_f32,
    neon_quantize_q8_0,   neon_quantize_q4_0,   neon_dequantize_q8_0,      neon_dequantize_q4_0,
    neon_find_unencodable_f32,                  neon_copy_find_nonfinite_f32, scalar_copy_stream,
};

}  // namespace detail
}  // namespace dspark
#endif  // DSPARK_AARCH64
