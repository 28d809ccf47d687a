// CRC-32C with SSE4.2's crc32 instruction (this translation unit alone is
// compiled with -msse4.2; it runs only where the dispatch found SSE4.2).
//
// The instruction has a latency of 3 cycles and a throughput of 1 per cycle,
// so three independent streams keep it busy: 24 bytes per 3 cycles, faster
// than one core reads memory. The streams' registers are joined by the shift
// tables (crc32c_kernels.hpp). Same results as the portable kernel.
#if defined(DSPARK_X86)
#include <nmmintrin.h>

#include <algorithm>
#include <cstring>

#include "crc32c_kernels.hpp"

namespace dspark {
namespace detail {

namespace {

inline std::uint64_t load64(const std::uint8_t* p) noexcept {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
}

// Three streams of `len` bytes at p, p + len, p + 2 len (len % 8 == 0).
inline std::uint32_t three_way(std::uint32_t c, const std::uint8_t* p, std::size_t len, const CrcShift& shift) noexcept {
    std::uint64_t c0 = c, c1 = 0, c2 = 0;
    const std::uint8_t* end = p + len;
    for (; p != end; p += 8) {
        c0 = _mm_crc32_u64(c0, load64(p));
        c1 = _mm_crc32_u64(c1, load64(p + len));
        c2 = _mm_crc32_u64(c2, load64(p + 2 * len));
    }
    std::uint32_t r = crc_apply_shift(shift, static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1);
    return crc_apply_shift(shift, r) ^ static_cast<std::uint32_t>(c2);
}

std::uint32_t sse42_update(std::uint32_t c, const std::uint8_t* p, std::size_t n) noexcept {
    if (n >= 3 * CRC_LONG) {
        const CrcShift& s = crc_shift_long();
        for (; n >= 3 * CRC_LONG; p += 3 * CRC_LONG, n -= 3 * CRC_LONG) c = three_way(c, p, CRC_LONG, s);
    }
    if (n >= 3 * CRC_SHORT) {
        const CrcShift& s = crc_shift_short();
        for (; n >= 3 * CRC_SHORT; p += 3 * CRC_SHORT, n -= 3 * CRC_SHORT) c = three_way(c, p, CRC_SHORT, s);
    }
    std::uint64_t c64 = c;
    for (; n >= 8; p += 8, n -= 8) c64 = _mm_crc32_u64(c64, load64(p));
    c = static_cast<std::uint32_t>(c64);
    for (; n != 0; ++p, --n) c = _mm_crc32_u8(c, *p);
    return c;
}

// memcpy with non-temporal 16-byte stores once dst is aligned.
void stream_copy(std::uint8_t* dst, const std::uint8_t* src, std::size_t n) noexcept {
    const std::size_t head = std::min(n, (16 - (reinterpret_cast<std::uintptr_t>(dst) & 15)) & 15);
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
    std::memcpy(dst, src, n);
}

std::uint32_t sse42_copy(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src, std::size_t n) noexcept {
    const bool stream = n >= CRC_STREAM_MIN_BYTES;
    while (n != 0) {
        const std::size_t k = std::min(n, CRC_COPY_CHUNK);
        c = sse42_update(c, src, k);  // brings the chunk into L1 ...
        if (stream) stream_copy(dst, src, k);  // ... and the copy reads it from there
        else std::memcpy(dst, src, k);
        src += k;
        dst += k;
        n -= k;
    }
    if (stream) _mm_sfence();  // the streamed stores are visible before we return
    return c;
}

}  // namespace

const CrcKernels kSse42Crc = {sse42_update, sse42_copy};

}  // namespace detail
}  // namespace dspark
#endif  // DSPARK_X86
