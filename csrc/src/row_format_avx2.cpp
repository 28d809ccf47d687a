// AVX2 + F16C row-format kernels (this TU is compiled with -mavx2 -mf16c, no
// FMA). Byte-identical to the scalar kernels in row_format.cpp.
#if defined(DSPARK_X86)
#include <immintrin.h>

#include "row_format_kernels.hpp"

namespace dspark {
namespace detail {
namespace {

constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

inline std::uint16_t f16_of(float d) {
    return static_cast<std::uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(d), kRne), 0));
}

inline bool any_nan8(__m256 a, __m256 b, __m256 c, __m256 e) {
    const __m256 u = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)),
                                  _mm256_or_ps(_mm256_cmp_ps(c, c, _CMP_UNORD_Q), _mm256_cmp_ps(e, e, _CMP_UNORD_Q)));
    return _mm256_movemask_ps(u) != 0;
}

// Round half away from zero (roundf), exact: r = trunc(v); |v - r| is exact.
inline __m256 roundf8(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 diff = abs8(_mm256_sub_ps(v, t));
    const __m256 ge = _mm256_cmp_ps(diff, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 sone = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
    return _mm256_add_ps(t, _mm256_and_ps(ge, sone));
}

// All-ones lanes where v is NaN / +-Inf (exponent all ones).
inline __m256i nonfinite8(__m256i u) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(u, e), e);
}

bool a_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t n) {
    __m256i bad = _mm256_setzero_si256();
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(src + i), v1 = _mm256_loadu_ps(src + i + 8);
        bad = _mm256_or_si256(bad, _mm256_or_si256(nonfinite8(_mm256_castps_si256(v0)), nonfinite8(_mm256_castps_si256(v1))));
        const __m128i h0 = _mm256_cvtps_ph(v0, kRne);
        const __m128i h1 = _mm256_cvtps_ph(v1, kRne);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_set_m128i(h1, h0));
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(src + i);
        bad = _mm256_or_si256(bad, nonfinite8(_mm256_castps_si256(v)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(v, kRne));
    }
    const bool tail = kScalarKernels.f32_to_f16(src + i, dst + i, n - i);
    return tail || !_mm256_testz_si256(bad, bad);
}

void a_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    kScalarKernels.f16_to_f32(src + i, dst + i, n - i);
}

inline __m256i bf16_8(__m256i u) {
    const __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i isnan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rne = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rne, qnan, isnan);
}

bool a_f32_to_bf16(const float* src, std::uint16_t* dst, std::size_t n) {
    __m256i bad = _mm256_setzero_si256();
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8));
        bad = _mm256_or_si256(bad, _mm256_or_si256(nonfinite8(u0), nonfinite8(u1)));
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_8(u0), bf16_8(u1)), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), p);
    }
    const bool tail = kScalarKernels.f32_to_bf16(src + i, dst + i, n - i);
    return tail || !_mm256_testz_si256(bad, bad);
}

void a_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_slli_epi32(w, 16));
    }
    kScalarKernels.bf16_to_f32(src + i, dst + i, n - i);
}

inline void store_d(std::uint8_t* p, std::uint16_t h) {
    p[0] = static_cast<std::uint8_t>(h & 0xff);
    p[1] = static_cast<std::uint8_t>(h >> 8);
}

// All-ones lanes of the block's 32 floats that are NaN / +-Inf, or-ed together.
inline __m256i nonfinite32(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    return _mm256_or_si256(
        _mm256_or_si256(nonfinite8(_mm256_castps_si256(v0)), nonfinite8(_mm256_castps_si256(v1))),
        _mm256_or_si256(nonfinite8(_mm256_castps_si256(v2)), nonfinite8(_mm256_castps_si256(v3))));
}

bool a_quantize_q8_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    const __m256i lowbyte = _mm256_set1_epi32(0xff);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i bad = _mm256_setzero_si256();
    for (std::size_t b = 0; b < nb; ++b) {
        const float* x = src + b * QK;
        std::uint8_t* out = dst + b * Q8_0_BLOCK_BYTES;
        const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        bad = _mm256_or_si256(bad, nonfinite32(v0, v1, v2, v3));
        if (any_nan8(v0, v1, v2, v3)) { quantize_block_q8_0_scalar(x, out); continue; }
        const __m256 m = _mm256_max_ps(_mm256_max_ps(abs8(v0), abs8(v1)), _mm256_max_ps(abs8(v2), abs8(v3)));
        const float amax = hmax8(m);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        store_d(out, f16_of(d));
        const __m256 vid = _mm256_set1_ps(id);
        const __m256i i0 = _mm256_and_si256(_mm256_cvttps_epi32(roundf8(_mm256_mul_ps(v0, vid))), lowbyte);
        const __m256i i1 = _mm256_and_si256(_mm256_cvttps_epi32(roundf8(_mm256_mul_ps(v1, vid))), lowbyte);
        const __m256i i2 = _mm256_and_si256(_mm256_cvttps_epi32(roundf8(_mm256_mul_ps(v2, vid))), lowbyte);
        const __m256i i3 = _mm256_and_si256(_mm256_cvttps_epi32(roundf8(_mm256_mul_ps(v3, vid))), lowbyte);
        const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(i0, i1), _mm256_packus_epi32(i2, i3));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2), _mm256_permutevar8x32_epi32(p, perm));
    }
    return !_mm256_testz_si256(bad, bad);
}

bool a_quantize_q4_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    const __m256i lowbyte = _mm256_set1_epi32(0xff);
    const __m256i fifteen = _mm256_set1_epi32(15);
    const __m256 half8 = _mm256_set1_ps(8.5f);
    __m256i bad = _mm256_setzero_si256();
    for (std::size_t b = 0; b < nb; ++b) {
        const float* x = src + b * QK;
        std::uint8_t* out = dst + b * Q4_0_BLOCK_BYTES;
        const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        bad = _mm256_or_si256(bad, nonfinite32(v0, v1, v2, v3));
        if (any_nan8(v0, v1, v2, v3)) { quantize_block_q4_0_scalar(x, out); continue; }
        const __m256 a0 = abs8(v0), a1 = abs8(v1), a2 = abs8(v2), a3 = abs8(v3);
        const float amax = hmax8(_mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3)));
        float max = 0.0f;
        if (amax > 0.0f) {
            const __m256 am = _mm256_set1_ps(amax);
            const unsigned mask = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a0, am, _CMP_EQ_OQ))) |
                                  (static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a1, am, _CMP_EQ_OQ))) << 8) |
                                  (static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a2, am, _CMP_EQ_OQ))) << 16) |
                                  (static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a3, am, _CMP_EQ_OQ))) << 24);
            max = x[__builtin_ctz(mask)];
        }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        store_d(out, f16_of(d));
        const __m256 vid = _mm256_set1_ps(id);
        auto q = [&](__m256 v) {
            const __m256i i = _mm256_and_si256(_mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(v, vid), half8)), lowbyte);
            return _mm256_min_epi32(i, fifteen);
        };
        const __m256i c0 = _mm256_or_si256(q(v0), _mm256_slli_epi32(q(v2), 4));
        const __m256i c1 = _mm256_or_si256(q(v1), _mm256_slli_epi32(q(v3), 4));
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(c0, c1), 0xD8);  // 16 x u16 in order
        const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2), bytes);
    }
    return !_mm256_testz_si256(bad, bad);
}

inline float load_d(const std::uint8_t* p) {
    const int h = p[0] | (p[1] << 8);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

void a_dequantize_q8_0(const std::uint8_t* src, float* dst, std::size_t nb) {
    for (std::size_t b = 0; b < nb; ++b) {
        const std::uint8_t* blk = src + b * Q8_0_BLOCK_BYTES;
        const __m256 d = _mm256_set1_ps(load_d(blk));
        float* y = dst + b * QK;
        for (int k = 0; k < 4; ++k) {
            const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * k));
            const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
            _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(qf, d));
        }
    }
}

void a_dequantize_q4_0(const std::uint8_t* src, float* dst, std::size_t nb) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m256i eight = _mm256_set1_epi32(8);
    for (std::size_t b = 0; b < nb; ++b) {
        const std::uint8_t* blk = src + b * Q4_0_BLOCK_BYTES;
        const __m256 d = _mm256_set1_ps(load_d(blk));
        float* y = dst + b * QK;
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
        const __m128i lo = _mm_and_si128(raw, m4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int k = 0; k < 4; ++k) {
            const __m256i qi = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[k]), eight);
            _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(qi), d));
        }
    }
}

std::int64_t a_find_nonfinite_f32(const float* src, std::size_t n) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    std::size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i acc = _mm256_setzero_si256();
        __m256i c[4];
        for (int k = 0; k < 4; ++k) {
            const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8 * k));
            c[k] = _mm256_cmpeq_epi32(_mm256_and_si256(u, e), e);
            acc = _mm256_or_si256(acc, c[k]);
        }
        if (!_mm256_testz_si256(acc, acc)) {
            for (int k = 0; k < 4; ++k) {
                const int m = _mm256_movemask_ps(_mm256_castsi256_ps(c[k]));
                if (m) return static_cast<std::int64_t>(i + 8 * k + __builtin_ctz(static_cast<unsigned>(m)));
            }
        }
    }
    const std::int64_t r = kScalarKernels.find_nonfinite_f32(src + i, n - i);
    return r < 0 ? -1 : static_cast<std::int64_t>(i) + r;
}

// One pass: 32 floats loaded, stored and checked per iteration.
std::int64_t a_copy_find_nonfinite_f32(const float* src, float* dst, std::size_t n) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    std::int64_t first_bad = -1;
    std::size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i u[4];
        __m256i bad = _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k) {
            u[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8 * k));
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(u[k], e), e));
        }
        for (int k = 0; k < 4; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i + 8 * k), u[k]);
        if (!_mm256_testz_si256(bad, bad) && first_bad < 0)
            first_bad = static_cast<std::int64_t>(i) + a_find_nonfinite_f32(src + i, 32);
    }
    const std::int64_t r = kScalarKernels.copy_find_nonfinite_f32(src + i, dst + i, n - i);  // the tail
    if (first_bad < 0 && r >= 0) first_bad = static_cast<std::int64_t>(i) + r;
    return first_bad;
}

}  // namespace

void avx2_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) { a_f16_to_f32(src, dst, n); }
void avx2_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) { a_bf16_to_f32(src, dst, n); }
void avx2_dequantize_q8_0(const std::uint8_t* src, float* dst, std::size_t nb) { a_dequantize_q8_0(src, dst, nb); }
void avx2_dequantize_q4_0(const std::uint8_t* src, float* dst, std::size_t nb) { a_dequantize_q4_0(src, dst, nb); }

const Kernels kAvx2Kernels = {
    a_f32_to_f16,      a_f32_to_bf16,     a_f16_to_f32,      a_bf16_to_f32,        a_quantize_q8_0,
    a_quantize_q4_0,   a_dequantize_q8_0, a_dequantize_q4_0, a_find_nonfinite_f32, a_copy_find_nonfinite_f32,
};

}  // namespace detail
}  // namespace dspark
#endif  // DSPARK_X86
