// Shared helpers of the libFuzzer targets: a byte reader that yields zeros past
// the end, a finding reporter that aborts (libFuzzer records the input), and
// the checksum fix-up for building snapshots whose CRC-32C's are right.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dspark/crc32c.hpp"

namespace dspark_fuzz {

struct Reader {
    const std::uint8_t* d;
    std::size_t n, i = 0;
    Reader(const std::uint8_t* data, std::size_t size) : d(data), n(size) {}
    bool more() const { return i < n; }
    std::size_t left() const { return i < n ? n - i : 0; }
    std::uint8_t u8() { return i < n ? d[i++] : (++i, 0); }
    std::uint16_t u16() { std::uint16_t lo = u8(); return static_cast<std::uint16_t>(lo | (u8() << 8)); }
    std::uint32_t u32() { std::uint32_t lo = u16(); return lo | (std::uint32_t(u16()) << 16); }
    std::uint64_t u64() { std::uint64_t lo = u32(); return lo | (std::uint64_t(u32()) << 32); }
    // The rest of the input (possibly empty).
    std::vector<std::uint8_t> rest() {
        std::vector<std::uint8_t> v;
        if (i < n) v.assign(d + i, d + n);
        i = n;
        return v;
    }
};

[[noreturn]] inline void finding(const char* file, int line, const char* what) {
    std::fprintf(stderr, "FUZZ FINDING at %s:%d: %s\n", file, line, what);
    std::fflush(stderr);
    std::abort();
}
#define FUZZ_CHECK(cond) do { if (!(cond)) ::dspark_fuzz::finding(__FILE__, __LINE__, #cond); } while (0)

// Rewrite the CRC-32C's of a v2 snapshot (rows at offset 88, header at 92)
// so that damage gets past the checksums.
inline void fix_crc(std::vector<std::uint8_t>& s) {
    constexpr std::size_t HEADER = 96, ROWS_CRC = 88, HEADER_CRC = 92;
    if (s.size() < HEADER) return;
    const std::uint32_t rows = dspark::crc32c(0, s.data() + HEADER, s.size() - HEADER);
    for (int k = 0; k < 4; ++k) s[ROWS_CRC + k] = static_cast<std::uint8_t>(rows >> (8 * k));
    const std::uint32_t head = dspark::crc32c(0, s.data(), HEADER_CRC);
    for (int k = 0; k < 4; ++k) s[HEADER_CRC + k] = static_cast<std::uint8_t>(head >> (8 * k));
}

}  // namespace dspark_fuzz
