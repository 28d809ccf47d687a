// AVX-512 (F/BW/VL/DQ) + F16C row-format kernels. No AVX512-BF16 (it flushes
// subnormals) and no FMA. Byte-identical to the scalar kernels.
#if defined(DSPARK_X86)
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (_mm512_undefined_*).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "row_format_kernels.hpp"

namespace dspark {
namespace detail {
namespace {

constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline __m512 abs16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
}

inline std::uint16_t f16_of(float d) {
    return static_cast<std::uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(d), kRne), 0));
}

inline void store_d(std::uint8_t* p, std::uint16_t h) {
    p[0] = static_cast<std::uint8_t>(h & 0xff);
    p[1] = static_cast<std::uint8_t>(h >> 8);
}

// roundf (half away from zero), exact.
inline __m512 roundf16(__m512 v) {
    const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 ge = _mm512_cmp_ps_mask(abs16(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 sone = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)),
                        _mm512_castps_si512(_mm512_set1_ps(1.0f))));
    return _mm512_mask_add_ps(t, ge, t, sone);
}

// Lanes where !(|v| < limit): NaN, +-Inf, or a value whose encoding
// overflows (the limits are in row_format_kernels.hpp).
inline __mmask16 over16(__m512 v, __m512 limit) { return _mm512_cmp_ps_mask(abs16(v), limit, _CMP_NLT_UQ); }

bool x_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t n) {
    const __m512 lim = _mm512_set1_ps(F16_LIMIT);
    __mmask16 bad = 0;
    std::size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 v0 = _mm512_loadu_ps(src + i), v1 = _mm512_loadu_ps(src + i + 16);
        bad |= over16(v0, lim) | over16(v1, lim);
        const __m256i h0 = _mm512_cvtps_ph(v0, kRne);
        const __m256i h1 = _mm512_cvtps_ph(v1, kRne);
        _mm512_storeu_si512(dst + i, _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1));
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(src + i);
        bad |= over16(v, lim);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtps_ph(v, kRne));
    }
    const bool tail = kScalarKernels.f32_to_f16(src + i, dst + i, n - i);
    return tail || bad != 0;
}

inline __m256i bf16_16(__m512i u) {
    const __mmask16 isnan =
        _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_or_epi32(r, isnan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

bool x_f32_to_bf16(const float* src, std::uint16_t* dst, std::size_t n) {
    const __m512 lim = _mm512_set1_ps(BF16_LIMIT);
    __mmask16 bad = 0;
    std::size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512i u0 = _mm512_loadu_si512(src + i), u1 = _mm512_loadu_si512(src + i + 16);
        bad |= over16(_mm512_castsi512_ps(u0), lim) | over16(_mm512_castsi512_ps(u1), lim);
        _mm512_storeu_si512(dst + i, _mm512_inserti64x4(_mm512_castsi256_si512(bf16_16(u0)), bf16_16(u1), 1));
    }
    for (; i + 16 <= n; i += 16) {
        const __m512i u = _mm512_loadu_si512(src + i);
        bad |= over16(_mm512_castsi512_ps(u), lim);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), bf16_16(u));
    }
    const bool tail = kScalarKernels.f32_to_bf16(src + i, dst + i, n - i);
    return tail || bad != 0;
}

inline bool any_nan(__m512 a, __m512 b) {
    return (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) != 0;
}

// Quantizers work on groups of 16 blocks: pass 1 finds each block's max,
// then d, id and the fp16 d are computed for all 16 at once (exact IEEE
// division per lane, same as the scalar code), then pass 2 quantizes. This
// keeps the long per-block dependency chain (reduce -> div -> div -> cvt)
// out of the way. Blocks holding a NaN go to the scalar block code.
constexpr std::size_t G = 16;

inline void q8_block(const float* x, std::uint8_t* out, float id) {
    const __m512 vid = _mm512_set1_ps(id);
    // cvtt gives INT32_MIN for NaN/Inf; vpmovdb keeps the low byte (0).
    const __m128i q0 = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(roundf16(_mm512_mul_ps(_mm512_loadu_ps(x), vid))));
    const __m128i q1 =
        _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(roundf16(_mm512_mul_ps(_mm512_loadu_ps(x + 16), vid))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2), q0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 18), q1);
}

inline void q4_block(const float* x, std::uint8_t* out, float id) {
    const __m512i lowbyte = _mm512_set1_epi32(0xff);
    const __m512i fifteen = _mm512_set1_epi32(15);
    const __m512 half8 = _mm512_set1_ps(8.5f);
    const __m512 vid = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_min_epi32(
        _mm512_and_si512(_mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(x), vid), half8)), lowbyte),
        fifteen);
    const __m512i q1 = _mm512_min_epi32(
        _mm512_and_si512(_mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(x + 16), vid), half8)),
                         lowbyte),
        fifteen);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2), _mm512_cvtepi32_epi8(_mm512_or_si512(q0, _mm512_slli_epi32(q1, 4))));
}

// The horizontal maxima of 16 vectors, as one vector (lane k = max of m[k]):
// a transposing butterfly (15 max, 30 shuffles, 1 permute for 16 blocks)
// instead of 16 separate reductions. Max is exact and order-free; callers
// pass no NaN.
inline __m512 hmax16x16(const __m512* m) {
    __m512 v[8], w[4], x[2];
    for (int k = 0; k < 8; ++k)  // 128-bit quarters: halves of each vector, two vectors a result
        v[k] = _mm512_max_ps(_mm512_shuffle_f32x4(m[2 * k], m[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(m[2 * k], m[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; ++k)  // one quarter a vector
        w[k] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; ++k)  // within quarters: 4 -> 2 floats
        x[k] = _mm512_max_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 r = _mm512_max_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // Lane i now holds vector (i % 4) * 4 + i / 4: transpose back.
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// d and id for 16 blocks from their (signed, for q4_0) max and divisor.
inline void scales16(__m512 m, float divisor, float* id, std::uint16_t* dh) {
    const __m512 d = _mm512_div_ps(m, _mm512_set1_ps(divisor));
    const __mmask16 nz = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ);  // d != 0 (true for NaN)
    _mm512_storeu_ps(id, _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0f), d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dh), _mm512_cvtps_ph(d, kRne));
}

// Signed value of the first element of the block x whose magnitude is amax
// (+0 if amax is 0; amax is the block's largest magnitude, no NaN).
inline float q4_signed_max(const float* x, float amax) {
    if (!(amax > 0.0f)) return 0.0f;
    const __m512 am = _mm512_set1_ps(amax);
    const unsigned mask = static_cast<unsigned>(_mm512_cmp_ps_mask(abs16(_mm512_loadu_ps(x)), am, _CMP_EQ_OQ)) |
                          (static_cast<unsigned>(_mm512_cmp_ps_mask(abs16(_mm512_loadu_ps(x + 16)), am, _CMP_EQ_OQ))
                           << 16);
    return x[__builtin_ctz(mask)];
}

inline float q8_max(const float*, float amax) { return amax; }

// One group loop for both quantizers (as in the AVX2 file): Scalar is the NaN
// fallback block code, SignedMax turns a block's largest magnitude into the
// max its d is made of (q4_0: the sign of its first largest element, from an
// L1-hot reload), Quants writes the block's quants.
template <void (*Scalar)(const float*, std::uint8_t*), float (*SignedMax)(const float*, float),
          void (*Quants)(const float*, std::uint8_t*, float)>
bool quantize_groups(const float* src, std::uint8_t* dst, std::size_t nb, std::size_t block_bytes, float divisor,
                     float limit) {
    // A block is unencodable when it holds a NaN or its largest magnitude
    // reaches `limit` (its fp16 scale would overflow; +-Inf included).
    const __m512 lim = _mm512_set1_ps(limit);
    alignas(64) float amax[G], mx[G], id[G];
    __m512 m[G];
    alignas(32) std::uint16_t dh[G];
    __mmask16 bad = 0;
    std::size_t b = 0;
    for (; b + G <= nb; b += G) {
        const float* x = src + b * QK;
        std::uint8_t* out = dst + b * block_bytes;
        __mmask16 nan = 0;
        for (std::size_t k = 0; k < G; ++k) {
            const __m512 v0 = _mm512_loadu_ps(x + k * QK), v1 = _mm512_loadu_ps(x + k * QK + 16);
            nan |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
            m[k] = _mm512_max_ps(abs16(v0), abs16(v1));
            bad |= _mm512_cmp_ps_mask(m[k], lim, _CMP_NLT_UQ);
        }
        bad |= nan;
        if (nan) {
            for (std::size_t k = 0; k < G; ++k) Scalar(x + k * QK, out + k * block_bytes);
            continue;
        }
        _mm512_store_ps(amax, hmax16x16(m));
        for (std::size_t k = 0; k < G; ++k) mx[k] = SignedMax(x + k * QK, amax[k]);
        scales16(_mm512_load_ps(mx), divisor, id, dh);
        for (std::size_t k = 0; k < G; ++k) {
            store_d(out + k * block_bytes, dh[k]);
            Quants(x + k * QK, out + k * block_bytes, id[k]);
        }
    }
    for (; b < nb; ++b) {  // the tail, one block at a time
        const float* x = src + b * QK;
        std::uint8_t* out = dst + b * block_bytes;
        const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
        bad |= over16(v0, lim) | over16(v1, lim);
        if (any_nan(v0, v1)) { Scalar(x, out); continue; }
        const float d = SignedMax(x, _mm512_reduce_max_ps(_mm512_max_ps(abs16(v0), abs16(v1)))) / divisor;
        const float i = d != 0.0f ? 1.0f / d : 0.0f;
        store_d(out, f16_of(d));
        Quants(x, out, i);
    }
    return bad != 0;
}

bool x_quantize_q8_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    return quantize_groups<quantize_block_q8_0_scalar, q8_max, q8_block>(src, dst, nb, Q8_0_BLOCK_BYTES, 127.0f,
                                                                                Q8_0_LIMIT);
}

bool x_quantize_q4_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    return quantize_groups<quantize_block_q4_0_scalar, q4_signed_max, q4_block>(src, dst, nb, Q4_0_BLOCK_BYTES,
                                                                                 -8.0f, Q4_0_LIMIT);
}

std::int64_t x_find_unencodable_f32(const float* src, std::size_t n, float limit) {
    const __m512 lim = _mm512_set1_ps(limit);
    std::size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __mmask16 m[4];
        for (int k = 0; k < 4; ++k) m[k] = over16(_mm512_loadu_ps(src + i + 16 * k), lim);
        if ((m[0] | m[1] | m[2] | m[3]) != 0)
            for (int k = 0; k < 4; ++k)
                if (m[k]) return static_cast<std::int64_t>(i + 16 * k + __builtin_ctz(static_cast<unsigned>(m[k])));
    }
    const std::int64_t r = kScalarKernels.find_unencodable_f32(src + i, n - i, limit);
    return r < 0 ? -1 : static_cast<std::int64_t>(i) + r;
}

// One pass: 64 floats loaded, stored and checked per iteration.
std::int64_t x_copy_find_nonfinite_f32(const float* src, float* dst, std::size_t n) {
    const __m512i e = _mm512_set1_epi32(0x7f800000);
    // Big copies bypass the cache (no read for ownership of the destination,
    // as glibc's memcpy does past its threshold); small ones stay cache-hot.
    const bool stream = n * 4 >= STREAM_MIN_BYTES && (reinterpret_cast<std::uintptr_t>(dst) & 3) == 0;
    std::int64_t first_bad = -1;
    std::size_t i = 0;
    if (stream) {  // peel up to 15 floats so the streaming stores are 64-byte aligned
        while ((reinterpret_cast<std::uintptr_t>(dst + i) & 63) != 0) ++i;
        std::memcpy(dst, src, i * 4);
        first_bad = kScalarKernels.find_unencodable_f32(src, i, NO_LIMIT);
    }
    for (; i + 64 <= n; i += 64) {
        __m512i u[4];
        __mmask16 bad = 0;
        for (int k = 0; k < 4; ++k) {
            u[k] = _mm512_loadu_si512(src + i + 16 * k);
            bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(u[k], e), e);
        }
        if (stream) {
            for (int k = 0; k < 4; ++k) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 16 * k), u[k]);
        } else {
            for (int k = 0; k < 4; ++k) _mm512_storeu_si512(dst + i + 16 * k, u[k]);
        }
        if (bad && first_bad < 0) first_bad = static_cast<std::int64_t>(i) + x_find_unencodable_f32(src + i, 64, NO_LIMIT);
    }
    if (stream) _mm_sfence();
    const std::int64_t r = kScalarKernels.copy_find_nonfinite_f32(src + i, dst + i, n - i);  // the tail
    if (first_bad < 0 && r >= 0) first_bad = static_cast<std::int64_t>(i) + r;
    return first_bad;
}

}  // namespace

const Kernels kAvx512Kernels = {
    x_f32_to_f16,         x_f32_to_bf16,        avx2_f16_to_f32,      avx2_bf16_to_f32,     x_quantize_q8_0,
    x_quantize_q4_0,      avx2_dequantize_q8_0, avx2_dequantize_q4_0, x_find_unencodable_f32,
    x_copy_find_nonfinite_f32, avx2_copy_stream,
};

}  // namespace detail
}  // namespace dspark
#endif  // DSPARK_X86
