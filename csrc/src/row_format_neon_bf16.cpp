// The NEON table with FEAT_BF16's BFCVTN for f32 -> bf16 (this TU alone is
// compiled with +bf16; it runs only where the registry found the BF16 hwcap).
// Every other kernel is the NEON one.
//
// BFCVTN is byte-identical to ggml's rounding (f32_to_bf16_scalar) only
// under the default FPCR, which it honours (unlike x86's AVX512-BF16
// conversion, which always flushes subnormals; docs/design.md 3.2): round to
// nearest even with FZ = 0 keeps subnormals, DN = 0 keeps the NaN's sign and
// top payload bits and quiets it, exactly (u >> 16) | 0x40, and overflow
// rounds to infinity as the integer recipe does. So each call reads FPCR
// and, unless the rounding mode, FZ, DN and AH bits are all zero, converts
// with the NEON integer kernel instead.
#if defined(DSPARK_AARCH64)
#include <arm_neon.h>

#include "row_format_kernels.hpp"

namespace dspark {
namespace detail {
namespace {

// FPCR: AH (bit 1), FZ (24), DN (25), RMode (23:22).
constexpr std::uint64_t FPCR_AFFECTS_BFCVT = (1ull << 1) | (1ull << 22) | (1ull << 23) | (1ull << 24) | (1ull << 25);

inline bool default_fpcr() {
    std::uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    return (fpcr & FPCR_AFFECTS_BFCVT) == 0;
}

inline uint32x4_t over4(float32x4_t v, float32x4_t limit) { return vmvnq_u32(vcaltq_f32(v, limit)); }

bool b_f32_to_bf16(const float* src, std::uint16_t* dst, std::size_t n) {
    if (!default_fpcr()) return kNeonKernels.f32_to_bf16(src, dst, n);
    const float32x4_t lim = vdupq_n_f32(BF16_LIMIT);
    uint32x4_t bad = vdupq_n_u32(0);
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float32x4_t v0 = vld1q_f32(src + i), v1 = vld1q_f32(src + i + 4);
        bad = vorrq_u32(bad, vorrq_u32(over4(v0, lim), over4(v1, lim)));
        const bfloat16x8_t h = vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(v0), v1);
        vst1q_u16(dst + i, vreinterpretq_u16_bf16(h));
    }
    const bool tail = kScalarKernels.f32_to_bf16(src + i, dst + i, n - i);
    return tail || vmaxvq_u32(bad) != 0;
}

}  // namespace

const Kernels kNeonBf16Kernels = {
    neon_f32_to_f16,      b_f32_to_bf16,        neon_f16_to_f32,           neon_bf16_to_f32,
    neon_quantize_q8_0,   neon_quantize_q4_0,   neon_dequantize_q8_0,      neon_dequantize_q4_0,
    neon_find_unencodable_f32,                  neon_copy_find_nonfinite_f32, scalar_copy_stream,
};

}  // namespace detail
}  // namespace dspark
#endif  // DSPARK_AARCH64
