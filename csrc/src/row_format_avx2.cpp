// AVX2 + F16C row-format kernels (this TU is compiled with -mavx2 -mf16c, no
// FMA). Byte-identical to the scalar kernels in row_format.cpp.
#if defined(DSPARK_X86)
#include <immintrin.h>

#include <algorithm>

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

// Round half away from zero (roundf), exact: r = trunc(v); |v - r| is exact.
inline __m256 roundf8(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 diff = abs8(_mm256_sub_ps(v, t));
    const __m256 ge = _mm256_cmp_ps(diff, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 sone = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
    return _mm256_add_ps(t, _mm256_and_ps(ge, sone));
}

// All-ones lanes where !(|v| < limit): NaN, +-Inf, or a value whose
// encoding overflows (the limits are in row_format_kernels.hpp).
inline __m256i over8(__m256 v, __m256 limit) {
    return _mm256_castps_si256(_mm256_cmp_ps(abs8(v), limit, _CMP_NLT_UQ));
}

bool a_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t n) {
    const __m256 lim = _mm256_set1_ps(F16_LIMIT);
    __m256i bad = _mm256_setzero_si256();
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(src + i), v1 = _mm256_loadu_ps(src + i + 8);
        bad = _mm256_or_si256(bad, _mm256_or_si256(over8(v0, lim), over8(v1, lim)));
        const __m128i h0 = _mm256_cvtps_ph(v0, kRne);
        const __m128i h1 = _mm256_cvtps_ph(v1, kRne);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_set_m128i(h1, h0));
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(src + i);
        bad = _mm256_or_si256(bad, over8(v, lim));
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
    const __m256 lim = _mm256_set1_ps(BF16_LIMIT);
    __m256i bad = _mm256_setzero_si256();
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
        const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8));
        bad = _mm256_or_si256(bad, _mm256_or_si256(over8(_mm256_castsi256_ps(u0), lim), over8(_mm256_castsi256_ps(u1), lim)));
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

// Quantizers work in groups of G8 blocks, as the AVX-512 ones do in 16s: the
// 8 block maxima come from one transposing butterfly, and the scales (two
// IEEE divisions and an f16 rounding per block) are computed 8 at a time, so
// no scalar division or horizontal reduction sits in the per-block path. A
// group holding a NaN goes to the scalar block code; the tail goes block by
// block. Divisions are exact (correctly rounded), so the bytes are the same.
constexpr std::size_t G8 = 8;

// All-ones lanes where any of the block's four vectors is NaN.
inline __m256 nan32(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    return _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
                        _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q), _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q)));
}

inline __m256 absmax32(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    return _mm256_max_ps(_mm256_max_ps(abs8(v0), abs8(v1)), _mm256_max_ps(abs8(v2), abs8(v3)));
}

// The horizontal maxima of 8 vectors, as one vector (lane k = max of m[k]):
// 128-bit halves, then pairs, then single floats, then one permute back to
// block order (7 max and 15 shuffles for 8 blocks). Callers pass no NaN.
inline __m256 hmax8x8(const __m256* m) {
    __m256 v[4], w[2];
    for (int k = 0; k < 4; ++k)  // [m(2k) folded to 4 | m(2k+1) folded to 4]
        v[k] = _mm256_max_ps(_mm256_permute2f128_ps(m[2 * k], m[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(m[2 * k], m[2 * k + 1], 0x31));
    for (int k = 0; k < 2; ++k)  // 2 floats per block
        w[k] = _mm256_max_ps(_mm256_shuffle_ps(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 r = _mm256_max_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
    // r holds blocks 0, 2, 4, 6 | 1, 3, 5, 7.
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// d (as f16 bits) and id = 1 / d (0 where d == 0) for 8 blocks, from their
// (signed, for q4_0) max and the divisor; no lane divides by zero.
inline void scales8(__m256 mx, float divisor, float* id, std::uint16_t* dh) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 d = _mm256_div_ps(mx, _mm256_set1_ps(divisor));
    const __m256 nz = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    _mm256_storeu_ps(id, _mm256_and_ps(_mm256_div_ps(one, _mm256_blendv_ps(one, d, nz)), nz));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dh), _mm256_cvtps_ph(d, kRne));
}

// The 32 quants of a q8_0 block (after its d), from the block's id.
inline void q8_quants(const float* x, std::uint8_t* out, float id) {
    const __m256i lowbyte = _mm256_set1_epi32(0xff);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 vid = _mm256_set1_ps(id);
    __m256i i[4];
    for (int k = 0; k < 4; ++k)
        i[k] = _mm256_and_si256(_mm256_cvttps_epi32(roundf8(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), vid))), lowbyte);
    const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(i[0], i[1]), _mm256_packus_epi32(i[2], i[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2), _mm256_permutevar8x32_epi32(p, perm));
}

// The 16 nibble bytes of a q4_0 block (after its d), from the block's id.
inline void q4_quants(const float* x, std::uint8_t* out, float id) {
    const __m256i lowbyte = _mm256_set1_epi32(0xff);
    const __m256i fifteen = _mm256_set1_epi32(15);
    const __m256 half8 = _mm256_set1_ps(8.5f);
    const __m256 vid = _mm256_set1_ps(id);
    auto q = [&](int k) {
        const __m256 v = _mm256_loadu_ps(x + 8 * k);
        const __m256i i = _mm256_and_si256(_mm256_cvttps_epi32(_mm256_add_ps(_mm256_mul_ps(v, vid), half8)), lowbyte);
        return _mm256_min_epi32(i, fifteen);
    };
    const __m256i c0 = _mm256_or_si256(q(0), _mm256_slli_epi32(q(2), 4));
    const __m256i c1 = _mm256_or_si256(q(1), _mm256_slli_epi32(q(3), 4));
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(c0, c1), 0xD8);  // 16 x u16 in order
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2), bytes);
}

// Signed value of the first element of block x whose magnitude is amax (+0
// if amax is 0; amax is the block's largest magnitude, no NaN).
inline float q4_signed_max(const float* x, float amax) {
    if (!(amax > 0.0f)) return 0.0f;
    const __m256 am = _mm256_set1_ps(amax);
    unsigned mask = 0;
    for (int k = 0; k < 4; ++k)
        mask |= static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(abs8(_mm256_loadu_ps(x + 8 * k)), am,
                                                                        _CMP_EQ_OQ)))
                << (8 * k);
    return x[__builtin_ctz(mask)];
}

// One group loop for both quantizers: Scalar is the NaN fallback block code,
// SignedMax turns a block's largest magnitude into the max its d is made of,
// Quants writes the block's quants.
template <void (*Scalar)(const float*, std::uint8_t*), float (*SignedMax)(const float*, float),
          void (*Quants)(const float*, std::uint8_t*, float)>
bool quantize_groups(const float* src, std::uint8_t* dst, std::size_t nb, std::size_t block_bytes, float divisor,
                     float limit) {
    // A block is unencodable when it holds a NaN or its largest magnitude
    // reaches `limit` (its fp16 scale would overflow; +-Inf included).
    const __m256 lim = _mm256_set1_ps(limit);
    alignas(32) float amax[G8], mx[G8], id[G8];
    alignas(16) std::uint16_t dh[G8];
    __m256 m[G8];
    __m256i bad = _mm256_setzero_si256();
    std::size_t b = 0;
    for (; b + G8 <= nb; b += G8) {
        const float* x = src + b * QK;
        std::uint8_t* out = dst + b * block_bytes;
        __m256 nan = _mm256_setzero_ps();
        for (std::size_t k = 0; k < G8; ++k) {
            const float* xk = x + k * QK;
            const __m256 v0 = _mm256_loadu_ps(xk), v1 = _mm256_loadu_ps(xk + 8);
            const __m256 v2 = _mm256_loadu_ps(xk + 16), v3 = _mm256_loadu_ps(xk + 24);
            nan = _mm256_or_ps(nan, nan32(v0, v1, v2, v3));
            m[k] = absmax32(v0, v1, v2, v3);
            bad = _mm256_or_si256(bad, over8(m[k], lim));
        }
        bad = _mm256_or_si256(bad, _mm256_castps_si256(nan));
        if (_mm256_movemask_ps(nan) != 0) {
            for (std::size_t k = 0; k < G8; ++k) Scalar(x + k * QK, out + k * block_bytes);
            continue;
        }
        _mm256_store_ps(amax, hmax8x8(m));
        for (std::size_t k = 0; k < G8; ++k) mx[k] = SignedMax(x + k * QK, amax[k]);
        scales8(_mm256_load_ps(mx), divisor, id, dh);
        for (std::size_t k = 0; k < G8; ++k) {
            store_d(out + k * block_bytes, dh[k]);
            Quants(x + k * QK, out + k * block_bytes, id[k]);
        }
    }
    for (; b < nb; ++b) {  // the tail, one block at a time
        const float* x = src + b * QK;
        std::uint8_t* out = dst + b * block_bytes;
        const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        const __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        const __m256 nan = nan32(v0, v1, v2, v3);
        const __m256 am = absmax32(v0, v1, v2, v3);
        bad = _mm256_or_si256(bad, _mm256_or_si256(over8(am, lim), _mm256_castps_si256(nan)));
        if (_mm256_movemask_ps(nan) != 0) { Scalar(x, out); continue; }
        const float d = SignedMax(x, hmax8(am)) / divisor;
        const float i = d != 0.0f ? 1.0f / d : 0.0f;
        store_d(out, f16_of(d));
        Quants(x, out, i);
    }
    return !_mm256_testz_si256(bad, bad);
}

inline float q8_max(const float*, float amax) { return amax; }

bool a_quantize_q8_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    return quantize_groups<quantize_block_q8_0_scalar, q8_max, q8_quants>(src, dst, nb, Q8_0_BLOCK_BYTES, 127.0f,
                                                                                Q8_0_LIMIT);
}

bool a_quantize_q4_0(const float* src, std::uint8_t* dst, std::size_t nb) {
    return quantize_groups<quantize_block_q4_0_scalar, q4_signed_max, q4_quants>(src, dst, nb, Q4_0_BLOCK_BYTES,
                                                                                  -8.0f, Q4_0_LIMIT);
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

std::int64_t a_find_unencodable_f32(const float* src, std::size_t n, float limit) {
    const __m256 lim = _mm256_set1_ps(limit);
    std::size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        int m[4];
        for (int k = 0; k < 4; ++k) m[k] = _mm256_movemask_ps(_mm256_castsi256_ps(over8(_mm256_loadu_ps(src + i + 8 * k), lim)));
        if ((m[0] | m[1] | m[2] | m[3]) != 0)
            for (int k = 0; k < 4; ++k)
                if (m[k]) return static_cast<std::int64_t>(i + 8 * k + __builtin_ctz(static_cast<unsigned>(m[k])));
    }
    const std::int64_t r = kScalarKernels.find_unencodable_f32(src + i, n - i, limit);
    return r < 0 ? -1 : static_cast<std::int64_t>(i) + r;
}

// The bytes before `p`'s next 32-byte boundary (streaming stores are aligned).
std::size_t peel32(const void* p) noexcept { return (32 - (reinterpret_cast<std::uintptr_t>(p) & 31)) & 31; }

// One pass: 32 floats loaded, stored and checked per iteration; from
// STREAM_MIN_BYTES on the stores bypass the cache.
std::int64_t a_copy_find_nonfinite_f32(const float* src, float* dst, std::size_t n) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    const bool stream = n * 4 >= STREAM_MIN_BYTES && peel32(dst) % 4 == 0;
    std::int64_t first_bad = -1;
    std::size_t i = 0;
    if (stream) {  // the floats before the first 32-byte-aligned store
        i = peel32(dst) / 4;
        first_bad = kScalarKernels.copy_find_nonfinite_f32(src, dst, i);
    }
    for (; i + 32 <= n; i += 32) {
        __m256i u[4];
        __m256i bad = _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k) {
            u[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8 * k));
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(u[k], e), e));
        }
        if (stream) {
            for (int k = 0; k < 4; ++k) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 8 * k), u[k]);
        } else {
            for (int k = 0; k < 4; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i + 8 * k), u[k]);
        }
        if (!_mm256_testz_si256(bad, bad) && first_bad < 0)
            first_bad = static_cast<std::int64_t>(i) + a_find_unencodable_f32(src + i, 32, NO_LIMIT);
    }
    if (stream) _mm_sfence();
    const std::int64_t r = kScalarKernels.copy_find_nonfinite_f32(src + i, dst + i, n - i);  // the tail
    if (first_bad < 0 && r >= 0) first_bad = static_cast<std::int64_t>(i) + r;
    return first_bad;
}

}  // namespace

// 128 bytes per iteration, loaded unaligned and stored aligned past the cache.
void avx2_copy_stream(void* dst, const void* src, std::size_t n) {
    auto* d = static_cast<std::uint8_t*>(dst);
    const auto* s = static_cast<const std::uint8_t*>(src);
    const std::size_t head = std::min(peel32(d), n);
    std::memcpy(d, s, head);
    std::size_t i = head;
    for (; i + 128 <= n; i += 128) {
        __m256i u[4];
        for (int k = 0; k < 4; ++k) u[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32 * k));
        for (int k = 0; k < 4; ++k) _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32 * k), u[k]);
    }
    _mm_sfence();  // the streamed lines are visible before anything the caller writes next
    std::memcpy(d + i, s + i, n - i);
}

void avx2_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) { a_f16_to_f32(src, dst, n); }
void avx2_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t n) { a_bf16_to_f32(src, dst, n); }
void avx2_dequantize_q8_0(const std::uint8_t* src, float* dst, std::size_t nb) { a_dequantize_q8_0(src, dst, nb); }
void avx2_dequantize_q4_0(const std::uint8_t* src, float* dst, std::size_t nb) { a_dequantize_q4_0(src, dst, nb); }

// The decoders by their exported names, the functions the AVX-512 table
// holds too (the dispatch table tells a shared kernel by its address).
const Kernels kAvx2Kernels = {
    a_f32_to_f16,         a_f32_to_bf16,        avx2_f16_to_f32,      avx2_bf16_to_f32,     a_quantize_q8_0,
    a_quantize_q4_0,      avx2_dequantize_q8_0, avx2_dequantize_q4_0, a_find_unencodable_f32,
    a_copy_find_nonfinite_f32, avx2_copy_stream,
};

}  // namespace detail
}  // namespace dspark
#endif  // DSPARK_X86
