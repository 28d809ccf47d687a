// Internal: per-SIMD-path kernel tables of the row-format conversions.
//
// Every kernel works on a flat run of elements (rows are contiguous and the
// q formats' blocks are contiguous too, so n_rows rows of `dim` elements are
// just n_rows * dim / 32 consecutive blocks). The scalar table is the
// definition; the AVX2, AVX-512, NEON and NEON-BF16 tables must produce
// identical bytes, and so must the scalar table on every CPU: where x86 and
// Arm differ (float -> int out of range, the NaN of inf * 0) the scalar code
// spells out x86's result (cvtt_i32, mul_x86_nan), so the bytes depend on
// the input alone.
//
// The scalar bit helpers below are `static inline` on purpose: this header is
// included by translation units compiled for different ISAs, and an inline
// function with external linkage could be merged by the linker into the
// AVX-512 copy and then be called on a CPU without AVX-512.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dspark/row_format.hpp"

namespace dspark {
namespace detail {

// The smallest magnitude each storage cannot encode as a finite value
// (encode_bounds in row_format.hpp; the ctest derives each by search):
//  f16:  65520 rounds to +inf (65504 is the largest half);
//  bf16: 0x7f7f8000 rounds up to 0x7f80 (+inf), 0x1.ffp+127;
//  q8_0: d = amax / 127 rounds to an fp16 +inf from amax = 127 * 65520 on;
//  q4_0: d = max / -8 does from |max| = 8 * 65520 on.
inline constexpr float F16_LIMIT = 65520.0f;
inline constexpr float BF16_LIMIT = 0x1.ffp+127f;
inline constexpr float Q8_0_LIMIT = 8321040.0f;
inline constexpr float Q4_0_LIMIT = 524160.0f;
// f32 storage: only NaN / +-Inf are unencodable.
inline constexpr float NO_LIMIT = __builtin_huge_valf();

// Copies of at least this many bytes use non-temporal (cache-bypassing)
// stores. A copy that large (a rebase stages W/2 rows: 200 MB of f32 rows at
// D = 25,600) outgrows a core's share of the last-level cache, so caching it
// only costs a read for ownership of every destination line and evicts the
// rows a round works on, its own and, on a server, other threads'. Below it
// (a verify batch of B + 1 rows, 1.7 MB at D = 25,600 f32; a round's few new
// rows) the copy stays cache-hot, where the next draft reads the accepted rows
// back and the next verify batch overwrites the rest.
// (glibc's memcpy makes the same switch at a threshold derived from the cache
// size the CPU reports: 240 MB on the 2-core EPYC of bench/, past a rebase.)
inline constexpr std::size_t STREAM_MIN_BYTES = std::size_t(8) << 20;

struct Kernels {
    // f32 -> f16 (IEEE binary16, round to nearest even, NaN kept quiet) and
    // f32 -> bf16 (ggml's rounding; NaN kept quiet). Both return whether any
    // input was unencodable (NaN, +-Inf, or a finite value whose encoding
    // overflows: |x| >= the format's limit above): the NonFinite::Error check
    // fused into the conversion pass (the caller looks for the index only
    // when one was).
    bool (*f32_to_f16)(const float* src, std::uint16_t* dst, std::size_t n);
    bool (*f32_to_bf16)(const float* src, std::uint16_t* dst, std::size_t n);
    // Exact widenings.
    void (*f16_to_f32)(const std::uint16_t* src, float* dst, std::size_t n);
    void (*bf16_to_f32)(const std::uint16_t* src, float* dst, std::size_t n);
    // Quantize / dequantize n_blocks blocks of 32 elements. The quantizers
    // return whether any block was unencodable (a NaN / +-Inf, or a block
    // scale that overflows fp16; the check fused, as above).
    bool (*quantize_q8_0)(const float* src, std::uint8_t* dst, std::size_t n_blocks);
    bool (*quantize_q4_0)(const float* src, std::uint8_t* dst, std::size_t n_blocks);
    void (*dequantize_q8_0)(const std::uint8_t* src, float* dst, std::size_t n_blocks);
    void (*dequantize_q4_0)(const std::uint8_t* src, float* dst, std::size_t n_blocks);
    // Index of the first of n floats with !(|x| < limit) (NaN included), or -1;
    // limit = +inf (NO_LIMIT) finds the first NaN / +-Inf.
    std::int64_t (*find_unencodable_f32)(const float* src, std::size_t n, float limit);
    // Copy n floats bit for bit and return the index of the first NaN / +-Inf,
    // or -1: the f32 -> f32 ingest path, one pass over memory.
    // Copies of STREAM_MIN_BYTES or more use non-temporal stores, as copy_stream.
    std::int64_t (*copy_find_nonfinite_f32)(const float* src, float* dst, std::size_t n);
    // Copy n bytes with non-temporal stores (cache-bypassing; memcpy where the
    // path has none). For copies of STREAM_MIN_BYTES or more: copy_bytes.
    void (*copy_stream)(void* dst, const void* src, std::size_t n);
};

// memcpy, through the active path's copy_stream from STREAM_MIN_BYTES on:
// the one rule for the core's row copies (a plan's staged rows, the encoded
// rows process_encoded or a restore appends, a ring's re-linearisation).
void copy_bytes(void* dst, const void* src, std::size_t n) noexcept;

extern const Kernels kScalarKernels;
// The scalar table's copy_stream (a memcpy), which the NEON tables share.
void scalar_copy_stream(void* dst, const void* src, std::size_t n);
#if defined(DSPARK_X86)
extern const Kernels kAvx2Kernels;
extern const Kernels kAvx512Kernels;

// The AVX2 decoders (256-bit stores), which the AVX-512 table uses as well:
// numpy's large arrays are only 16-byte aligned, and a 64-byte store to such
// a destination splits across two cache lines; on the 2-core Xeon of this
// project's benchmarks the 512-bit decoders ran 12-25% slower than these
// (paired runs; as fast only into 64-byte-aligned output).
void avx2_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t n);
void avx2_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t n);
void avx2_dequantize_q8_0(const std::uint8_t* src, float* dst, std::size_t n_blocks);
void avx2_dequantize_q4_0(const std::uint8_t* src, float* dst, std::size_t n_blocks);
// 256-bit streaming stores need only 32-byte alignment, which a peel gives any
// destination; the AVX-512 table shares this copy.
void avx2_copy_stream(void* dst, const void* src, std::size_t n);
#endif
#if defined(DSPARK_AARCH64)
extern const Kernels kNeonKernels;
extern const Kernels kNeonBf16Kernels;

// The NEON kernels the NEON-BF16 table shares (all but f32 -> bf16).
bool neon_f32_to_f16(const float* src, std::uint16_t* dst, std::size_t n);
void neon_f16_to_f32(const std::uint16_t* src, float* dst, std::size_t n);
void neon_bf16_to_f32(const std::uint16_t* src, float* dst, std::size_t n);
bool neon_quantize_q8_0(const float* src, std::uint8_t* dst, std::size_t n_blocks);
bool neon_quantize_q4_0(const float* src, std::uint8_t* dst, std::size_t n_blocks);
void neon_dequantize_q8_0(const std::uint8_t* src, float* dst, std::size_t n_blocks);
void neon_dequantize_q4_0(const std::uint8_t* src, float* dst, std::size_t n_blocks);
std::int64_t neon_find_unencodable_f32(const float* src, std::size_t n, float limit);
std::int64_t neon_copy_find_nonfinite_f32(const float* src, float* dst, std::size_t n);
#endif

// Scalar single-block quantizers (defined in row_format.cpp, compiled for the
// baseline ISA). The SIMD kernels hand blocks holding a NaN to these, so NaN
// handling has exactly one definition.
void quantize_block_q8_0_scalar(const float* x, std::uint8_t* out);
void quantize_block_q4_0_scalar(const float* x, std::uint8_t* out);
// Scalar single-block decoders, which the NEON decoders hand blocks with an
// infinite scale to (the one case whose NaN bits differ between CPUs).
void dequantize_block_q8_0_scalar(const std::uint8_t* blk, float* y);
void dequantize_block_q4_0_scalar(const std::uint8_t* blk, float* y);

// ---------------------------------------------------------------------------
// Bit helpers (internal linkage in every TU; see the note at the top).

static inline std::uint32_t f32_bits(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float bits_f32(std::uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// IEEE binary32 -> binary16, round to nearest even; overflow -> +-inf,
// subnormals exact; NaN -> quiet NaN keeping the top 9 payload bits (what
// F16C's vcvtps2ph does; numpy's astype(float16) agrees for quiet NaNs).
static inline std::uint16_t f32_to_f16_scalar(float f) {
    const std::uint32_t x = f32_bits(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x47800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65536 (and inf)
    if (ax >= 0x38800000u) {  // normal in f16 (>= 2^-14); a carry may round up to inf
        const std::uint32_t r = ax - 0x38000000u;  // rebias exponent 127 -> 15
        return static_cast<std::uint16_t>(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13));
    }
    // Subnormal (or zero) in f16: the grid is 2^-24; adding 0.5f rounds |f|
    // to that grid with the FPU's round-to-nearest-even (0.5 has ulp 2^-24).
    const float t = bits_f32(ax) + 0.5f;
    return static_cast<std::uint16_t>(sign | (f32_bits(t) - 0x3f000000u));
}

// binary16 -> binary32, exact; a signalling NaN comes back quiet (as F16C).
static inline float f16_to_f32_scalar(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu;
    const std::uint32_t man = h & 0x3ffu;
    std::uint32_t u;
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        const float v = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24, exact
        u = sign | f32_bits(v);
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u);
    } else {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return bits_f32(u);
}

// ggml_compute_fp32_to_bf16.
static inline std::uint16_t f32_to_bf16_scalar(float f) {
    const std::uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 64u);
    return static_cast<std::uint16_t>((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

static inline float bf16_to_f32_scalar(std::uint16_t b) {
    return bits_f32(static_cast<std::uint32_t>(b) << 16);
}

// q * d with x86's NaN rule for an invalid product (inf * 0): SSE returns
// its default NaN 0xffc00000, Arm its default NaN 0x7fc00000. A NaN operand
// (d only: q is an integer) comes back quieted on both.
static inline float mul_x86_nan(float q, float d) {
    const float r = q * d;
#if !defined(DSPARK_X86)
    if (r != r && d == d) return bits_f32(0xffc00000u);
#endif
    return r;
}

// x86 cvttss2si semantics: truncate toward zero; NaN or out of int32 range
// gives INT32_MIN. (numpy's float -> int8/uint8 casts and the C code's
// (int8_t) casts compile to this and keep the low byte.)
static inline std::int32_t cvtt_i32(float v) {
    if (!(std::fabs(v) < 2147483648.0f)) return INT32_MIN;
    return static_cast<std::int32_t>(v);
}

}  // namespace detail
}  // namespace dspark
