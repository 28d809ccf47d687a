// Shared helpers of the libFuzzer targets: a byte reader that yields zeros past
// the end, a finding reporter that aborts (libFuzzer records the input), and
// zlib's CRC-32 for building snapshots whose checksum is right.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

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

inline std::uint32_t crc32(const std::uint8_t* p, std::size_t n) {
    std::uint32_t c = 0xFFFFFFFFu;
    for (std::size_t i = 0; i < n; ++i) {
        c ^= p[i];
        for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    }
    return c ^ 0xFFFFFFFFu;
}

// Rewrite the trailing CRC-32 of a snapshot so that damage gets past the checksum.
inline void fix_crc(std::vector<std::uint8_t>& s) {
    if (s.size() < 4) return;
    const std::uint32_t c = crc32(s.data(), s.size() - 4);
    for (int k = 0; k < 4; ++k) s[s.size() - 4 + k] = static_cast<std::uint8_t>(c >> (8 * k));
}

}  // namespace dspark_fuzz
