// Internal: the CRC-32C kernels of each path and the tables they share.
//
// Kernels work on the raw CRC register (no initial / final inversion; the
// public crc32c() adds those). The instruction kernels checksum three streams of
// LONG (or SHORT) bytes at once and joins them with the shift operators
// below: appending n zero bytes to a message is a linear map of its register,
// applied here as four byte-indexed table lookups.
#pragma once
#include <cstddef>
#include <cstdint>

namespace dspark {
namespace detail {

// The reflected CRC-32C polynomial.
inline constexpr std::uint32_t CRC32C_POLY = 0x82F63B78u;
// Stream lengths of the three-way interleaved loop (LONG: 3 x 8 KiB; SHORT
// covers what is left of medium inputs); the shift tables join the streams.
inline constexpr std::size_t CRC_LONG = 8192;
inline constexpr std::size_t CRC_SHORT = 256;
// The portable copy checksums and copies chunks of this many bytes (in L1).
inline constexpr std::size_t CRC_COPY_CHUNK = 3 * CRC_LONG;
// Copies at least this large use non-temporal stores (they would only evict
// the cache; smaller ones are likely read again soon).
inline constexpr std::size_t CRC_STREAM_MIN_BYTES = std::size_t(4) << 20;

// Which loop the SSE4.2 copy runs where its stores would alias its loads
// (crc32c_sse42.cpp): SPLIT_BY_VENDOR (the default: the two-pass loop on AMD
// only), SPLIT_NEVER or SPLIT_ALWAYS (tests run both loops on any x86 CPU). The
// checksum and the bytes are the same either way; only the speed differs.
enum AliasedCopySplit : int { SPLIT_BY_VENDOR = -1, SPLIT_NEVER = 0, SPLIT_ALWAYS = 1 };
void set_aliased_copy_split(AliasedCopySplit mode) noexcept;

// Pins a value a copy kernel checksums and stores: once loaded it lives in a
// register the compiler cannot see into, so it never loads it from the source
// a second time for the other use. (It may, while it assumes no other thread
// writes the source; restore's source is a caller's buffer that may change, and
// the checksum must be of the very bytes stored. The fused loops once did so.)
#if defined(__GNUC__) || defined(__clang__)
#define DSPARK_PIN(v) __asm__ volatile("" : "+r"(v))
#if defined(__x86_64__) || defined(__i386__)
#define DSPARK_PIN_XMM(v) __asm__ volatile("" : "+x"(v))
#endif
#define DSPARK_COMPILER_FENCE() __asm__ volatile("" ::: "memory")
#else
#define DSPARK_PIN(v) ((void)0)
#define DSPARK_PIN_XMM(v) ((void)0)
#define DSPARK_COMPILER_FENCE() ((void)0)
#endif

struct CrcKernels {
    std::uint32_t (*update)(std::uint32_t raw, const std::uint8_t* p, std::size_t n);
    std::uint32_t (*copy)(std::uint32_t raw, std::uint8_t* dst, const std::uint8_t* src, std::size_t n);
    // copy for a source another thread may write (crc32c_copy_shared): the checksum of the bytes stored.
    std::uint32_t (*copy_shared)(std::uint32_t raw, std::uint8_t* dst, const std::uint8_t* src, std::size_t n);
};

struct CrcShift {
    std::uint32_t t[4][256];
};
// Register maps "append CRC_LONG (CRC_SHORT) zero bytes".
const CrcShift& crc_shift_long() noexcept;
const CrcShift& crc_shift_short() noexcept;

static inline std::uint32_t crc_apply_shift(const CrcShift& s, std::uint32_t c) noexcept {
    return s.t[0][c & 0xFF] ^ s.t[1][(c >> 8) & 0xFF] ^ s.t[2][(c >> 16) & 0xFF] ^ s.t[3][c >> 24];
}

// The update of the instruction kernels, written once for both: three
// interleaved streams of CRC_LONG, then CRC_SHORT bytes (the instruction's
// latency is about three of its issue slots), joined by the shift tables, then
// 8 bytes and single bytes. `Crc` supplies the two instructions (u64: one
// 8-byte step, u8: one byte); each kernel's translation unit instantiates it
// with its own ISA flags (static: internal linkage, see row_format_kernels.hpp).
template <class Crc>
static inline std::uint32_t crc_three_way(std::uint32_t c, const std::uint8_t* p, std::size_t len,
                                          const CrcShift& shift) noexcept {
    std::uint32_t c0 = c, c1 = 0, c2 = 0;
    const std::uint8_t* end = p + len;
    for (; p != end; p += 8) {
        c0 = Crc::u64(c0, Crc::load64(p));
        c1 = Crc::u64(c1, Crc::load64(p + len));
        c2 = Crc::u64(c2, Crc::load64(p + 2 * len));
    }
    return crc_apply_shift(shift, crc_apply_shift(shift, c0) ^ c1) ^ c2;
}

template <class Crc>
static inline std::uint32_t crc_update_streams(std::uint32_t c, const std::uint8_t* p, std::size_t n) noexcept {
    if (n >= 3 * CRC_LONG) {
        const CrcShift& s = crc_shift_long();
        for (; n >= 3 * CRC_LONG; p += 3 * CRC_LONG, n -= 3 * CRC_LONG) c = crc_three_way<Crc>(c, p, CRC_LONG, s);
    }
    if (n >= 3 * CRC_SHORT) {
        const CrcShift& s = crc_shift_short();
        for (; n >= 3 * CRC_SHORT; p += 3 * CRC_SHORT, n -= 3 * CRC_SHORT) c = crc_three_way<Crc>(c, p, CRC_SHORT, s);
    }
    for (; n >= 8; p += 8, n -= 8) c = Crc::u64(c, Crc::load64(p));
    for (; n != 0; ++p, --n) c = Crc::u8(c, *p);
    return c;
}

extern const CrcKernels kPortableCrc;
#if defined(DSPARK_X86)
extern const CrcKernels kSse42Crc;
#endif
#if defined(DSPARK_AARCH64)
extern const CrcKernels kArmCrc;
#endif

}  // namespace detail
}  // namespace dspark
