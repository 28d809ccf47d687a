// CRC-32C: the portable slicing-by-8 kernel, the shift tables of the
// interleaved instruction kernels (crc32c_sse42.cpp, crc32c_arm.cpp) and
// their entry in the dispatch registry.
#include "dspark/crc32c.hpp"

#include <algorithm>
#include <cstring>

#include "crc32c_kernels.hpp"
#include "dispatch_families.hpp"

namespace dspark {
namespace detail {

namespace {

struct SliceTables {
    std::uint32_t t[8][256];
};

// t[0] is the classic byte table; t[k][b] is byte b followed by k zero bytes.
SliceTables make_slice_tables() noexcept {
    SliceTables s{};
    for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint32_t c = b;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        s.t[0][b] = c;
    }
    for (std::uint32_t b = 0; b < 256; ++b)
        for (int k = 1; k < 8; ++k) s.t[k][b] = (s.t[k - 1][b] >> 8) ^ s.t[0][s.t[k - 1][b] & 0xFF];
    return s;
}

const SliceTables& slices() noexcept {
    static const SliceTables s = make_slice_tables();
    return s;
}

// a * b modulo the polynomial, in the reflected bit order (bit 31 is x^0).
std::uint32_t mult_mod_p(std::uint32_t a, std::uint32_t b) noexcept {
    std::uint32_t m = 1u << 31, p = 0;
    for (; m != 0; m >>= 1) {
        if (a & m) p ^= b;
        b = (b & 1) ? (b >> 1) ^ CRC32C_POLY : b >> 1;
    }
    return p;
}

// x^(8 n) modulo the polynomial: the register map of n appended zero bytes.
std::uint32_t x8n_mod_p(std::size_t n) noexcept {
    std::uint32_t p = 1u << 31;       // x^0
    std::uint32_t sq = 1u << 23;      // x^8
    for (; n != 0; n >>= 1) {
        if (n & 1) p = mult_mod_p(sq, p);
        sq = mult_mod_p(sq, sq);
    }
    return p;
}

CrcShift make_shift(std::size_t zeros) noexcept {
    CrcShift s{};
    const std::uint32_t op = x8n_mod_p(zeros);
    for (int k = 0; k < 4; ++k)
        for (std::uint32_t b = 0; b < 256; ++b) s.t[k][b] = mult_mod_p(op, b << (8 * k));
    return s;
}

std::uint32_t portable_update(std::uint32_t c, const std::uint8_t* p, std::size_t n) noexcept {
    const auto& t = slices().t;
    for (; n >= 8; p += 8, n -= 8) {
        std::uint32_t lo, hi;  // little-endian words (the table order assumes it)
        lo = std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24;
        hi = std::uint32_t(p[4]) | std::uint32_t(p[5]) << 8 | std::uint32_t(p[6]) << 16 | std::uint32_t(p[7]) << 24;
        lo ^= c;
        c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
            t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    }
    for (; n != 0; ++p, --n) c = t[0][(c ^ *p) & 0xFF] ^ (c >> 8);
    return c;
}

std::uint32_t portable_copy(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src, std::size_t n) noexcept {
    while (n != 0) {
        const std::size_t k = std::min(n, CRC_COPY_CHUNK);
        // The copy is what is checksummed (read back while in cache), so a
        // source changing under the call can never pass as what was stored.
        std::memcpy(dst, src, k);
        c = portable_update(c, dst, k);
        src += k;
        dst += k;
        n -= k;
    }
    return c;
}

}  // namespace

const CrcShift& crc_shift_long() noexcept {
    static const CrcShift s = make_shift(CRC_LONG);
    return s;
}
const CrcShift& crc_shift_short() noexcept {
    static const CrcShift s = make_shift(CRC_SHORT);
    return s;
}

const CrcKernels kPortableCrc = {portable_update, portable_copy, portable_copy};  // its copy is checksummed

}  // namespace detail

// --------------------------------------------------------------- dispatch ---

namespace {

const detail::CrcKernels* crc_kernels_for(CrcPath p) noexcept {
    switch (p) {
        case CrcPath::Portable: return &detail::kPortableCrc;
#if defined(DSPARK_X86)
        case CrcPath::Sse42: return &detail::kSse42Crc;
#endif
#if defined(DSPARK_AARCH64)
        case CrcPath::ArmCrc: return &detail::kArmCrc;
#endif
        default: return nullptr;
    }
}

// The registry only ever activates a path whose kernels this build has.
const detail::CrcKernels& active_crc() noexcept { return *crc_kernels_for(active_crc_path()); }

}  // namespace

namespace detail {
const char* crc32c_kernel_name(int k) noexcept {
    return k == 0 ? "crc32c" : k == 1 ? "crc32c copy" : nullptr;
}
const char* crc32c_kernel_origin(int k, int path) noexcept {
    return crc32c_kernel_name(k) != nullptr && crc_kernels_for(static_cast<CrcPath>(path)) != nullptr
               ? crc_path_name(static_cast<CrcPath>(path))
               : nullptr;
}
}  // namespace detail

bool crc_path_supported(CrcPath p) noexcept {
    return kernel_path_supported(KernelFamily::Crc32c, static_cast<int>(p));
}
CrcPath best_crc_path() noexcept { return static_cast<CrcPath>(best_kernel_path(KernelFamily::Crc32c)); }
CrcPath active_crc_path() noexcept { return static_cast<CrcPath>(active_kernel_path(KernelFamily::Crc32c)); }
void set_crc_path(CrcPath p) { set_kernel_path(KernelFamily::Crc32c, static_cast<int>(p)); }
const char* crc_path_name(CrcPath p) noexcept {
    const char* n = kernel_path_name(KernelFamily::Crc32c, static_cast<int>(p));
    return n != nullptr ? n : "?";
}

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n) noexcept {
    return ~active_crc().update(~crc, static_cast<const std::uint8_t*>(data), n);
}

std::uint32_t crc32c_copy(std::uint32_t crc, void* dst, const void* src, std::size_t n) noexcept {
    return ~active_crc().copy(~crc, static_cast<std::uint8_t*>(dst), static_cast<const std::uint8_t*>(src), n);
}

std::uint32_t crc32c_copy_shared(std::uint32_t crc, void* dst, const void* src, std::size_t n) noexcept {
    return ~active_crc().copy_shared(~crc, static_cast<std::uint8_t*>(dst), static_cast<const std::uint8_t*>(src), n);
}

}  // namespace dspark
