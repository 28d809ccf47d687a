// CRC-32C with the ARMv8 CRC32C instructions (this TU alone is compiled with
// +crc; it runs only where the registry found the CRC32 hwcap).
//
// As on x86 (crc32c_sse42.cpp): the instruction has a latency of 2-3 cycles
// and a throughput of one per cycle on current cores, so three independent
// streams keep it busy; the streams' registers are joined by the shift tables
// (crc32c_kernels.hpp). The copy kernel stores each 16 bytes right after
// checksumming them (one pass over the source). Same results as the
// portable kernel.
#if defined(DSPARK_AARCH64)
#include <arm_acle.h>

#include <cstring>

#include "crc32c_kernels.hpp"

namespace dspark {
namespace detail {

namespace {

// The instructions for crc_update_streams (crc32c_kernels.hpp).
struct ArmCrc32c {
    static std::uint64_t load64(const std::uint8_t* p) noexcept {
        std::uint64_t v;
        std::memcpy(&v, p, 8);  // little-endian, as the portable tables assume
        return v;
    }
    static std::uint32_t u64(std::uint32_t c, std::uint64_t v) noexcept { return __crc32cd(c, v); }
    static std::uint32_t u8(std::uint32_t c, std::uint8_t v) noexcept { return __crc32cb(c, v); }
};

std::uint32_t arm_update(std::uint32_t c, const std::uint8_t* p, std::size_t n) noexcept {
    return crc_update_streams<ArmCrc32c>(c, p, n);
}

// three_way fused with the copy: every 16 bytes are loaded once, checksummed
// and stored (len % 16 == 0).
inline std::uint32_t copy_three_way(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src, std::size_t len,
                                    const CrcShift& shift) noexcept {
    std::uint32_t c0 = c, c1 = 0, c2 = 0;
    for (std::size_t i = 0; i < len; i += 16) {
        std::uint64_t a[2], b[2], d[2];
        std::memcpy(a, src + i, 16);
        std::memcpy(b, src + len + i, 16);
        std::memcpy(d, src + 2 * len + i, 16);
        DSPARK_PIN(a[0]);  // checksummed and stored from the same load
        DSPARK_PIN(a[1]);
        DSPARK_PIN(b[0]);
        DSPARK_PIN(b[1]);
        DSPARK_PIN(d[0]);
        DSPARK_PIN(d[1]);
        c0 = __crc32cd(__crc32cd(c0, a[0]), a[1]);
        c1 = __crc32cd(__crc32cd(c1, b[0]), b[1]);
        c2 = __crc32cd(__crc32cd(c2, d[0]), d[1]);
        std::memcpy(dst + i, a, 16);
        std::memcpy(dst + len + i, b, 16);
        std::memcpy(dst + 2 * len + i, d, 16);
    }
    return crc_apply_shift(shift, crc_apply_shift(shift, c0) ^ c1) ^ c2;
}

std::uint32_t arm_copy(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src, std::size_t n) noexcept {
    if (n >= 3 * CRC_LONG) {
        const CrcShift& s = crc_shift_long();
        for (; n >= 3 * CRC_LONG; src += 3 * CRC_LONG, dst += 3 * CRC_LONG, n -= 3 * CRC_LONG)
            c = copy_three_way(c, dst, src, CRC_LONG, s);
    }
    if (n >= 3 * CRC_SHORT) {
        const CrcShift& s = crc_shift_short();
        for (; n >= 3 * CRC_SHORT; src += 3 * CRC_SHORT, dst += 3 * CRC_SHORT, n -= 3 * CRC_SHORT)
            c = copy_three_way(c, dst, src, CRC_SHORT, s);
    }
    for (; n >= 8; src += 8, dst += 8, n -= 8) {
        std::uint64_t v = ArmCrc32c::load64(src);
        DSPARK_PIN(v);
        c = __crc32cd(c, v);
        std::memcpy(dst, &v, 8);
    }
    for (; n != 0; ++src, ++dst, --n) {
        std::uint8_t v = *src;
        DSPARK_PIN(v);
        *dst = v;
        c = __crc32cb(c, v);
    }
    return c;
}

}  // namespace

const CrcKernels kArmCrc = {arm_update, arm_copy, arm_copy};  // one fused loop: reads once

}  // namespace detail
}  // namespace dspark
#endif  // DSPARK_AARCH64
