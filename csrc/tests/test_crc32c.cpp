// CRC-32C: known vectors, every path against a bitwise definition on random
// buffers of every length class (bytes, 8-byte words, SHORT and LONG
// streams), chaining, and crc32c_copy / crc32c_copy_shared (same value, same
// bytes copied; the shared one's checksum is of the bytes stored even while
// another thread writes the source).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../src/crc32c_kernels.hpp"  // detail::set_aliased_copy_split: both copy loops
#include "check.hpp"
#include "dspark/crc32c.hpp"

using namespace dspark;

namespace {

// The definition, one bit at a time (independent of both kernels' tables).
std::uint32_t crc32c_bitwise(const std::uint8_t* p, std::size_t n) {
    std::uint32_t c = 0xFFFFFFFFu;
    for (std::size_t i = 0; i < n; ++i) {
        c ^= p[i];
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    return ~c;
}

std::vector<CrcPath> paths() {
    std::vector<CrcPath> v;
    for (int p = 0; p < kernel_path_count(KernelFamily::Crc32c); ++p)
        if (crc_path_supported(static_cast<CrcPath>(p))) v.push_back(static_cast<CrcPath>(p));
    return v;
}

std::vector<std::uint8_t> random_bytes(std::size_t n, unsigned seed) {
    std::mt19937 g(seed);
    std::vector<std::uint8_t> v(n);
    for (auto& b : v) b = static_cast<std::uint8_t>(g());
    return v;
}

// Lengths around every boundary of the kernels (8, 3 x 256, 3 x 8192, the copy chunk).
const std::size_t LENGTHS[] = {0, 1, 7, 8, 9, 63, 255, 767, 768, 769, 1000, 24575, 24576, 24577, 50000, 73731};

}  // namespace

TEST_CASE(known_vectors) {
    const char* nine = "123456789";
    std::vector<std::uint8_t> zeros(32, 0), ones(32, 0xFF), inc(32);
    for (int i = 0; i < 32; ++i) inc[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i);
    const CrcPath before = active_crc_path();
    for (CrcPath p : paths()) {
        set_crc_path(p);
        CHECK_EQ(crc32c(0, nine, 9), 0xE3069283u);
        CHECK_EQ(crc32c(0, nine, 0), 0u);
        // RFC 3720 (iSCSI) B.4 test vectors.
        CHECK_EQ(crc32c(0, zeros.data(), 32), 0x8A9136AAu);
        CHECK_EQ(crc32c(0, ones.data(), 32), 0x62A8AB43u);
        CHECK_EQ(crc32c(0, inc.data(), 32), 0x46DD794Eu);
    }
    set_crc_path(before);
}

TEST_CASE(paths_agree_with_the_definition) {
    const CrcPath before = active_crc_path();
    for (std::size_t n : LENGTHS) {
        const auto data = random_bytes(n + 3, static_cast<unsigned>(n));
        for (std::size_t off = 0; off < 3; ++off) {  // unaligned starts too
            const std::uint32_t want = crc32c_bitwise(data.data() + off, n);
            for (CrcPath p : paths()) {
                set_crc_path(p);
                CHECK_EQ(crc32c(0, data.data() + off, n), want);
                // Chained in two uneven parts.
                const std::size_t cut = n / 3;
                CHECK_EQ(crc32c(crc32c(0, data.data() + off, cut), data.data() + off + cut, n - cut), want);
            }
        }
    }
    set_crc_path(before);
}

TEST_CASE(copy_checksums_and_copies) {
    const CrcPath before = active_crc_path();
    // Past the streaming threshold too (non-temporal stores), with an unaligned dst.
    std::vector<std::size_t> lengths(std::begin(LENGTHS), std::end(LENGTHS));
    lengths.push_back((std::size_t(4) << 20) + 12345);
    for (std::size_t n : lengths) {
        const auto src = random_bytes(n, static_cast<unsigned>(n) + 7);
        const std::uint32_t want = crc32c_bitwise(src.data(), n);
        for (CrcPath p : paths()) {
            set_crc_path(p);
            std::vector<std::uint8_t> dst(n + 5, 0xA5);
            CHECK_EQ(crc32c_copy(0, dst.data() + 3, src.data(), n), want);
            CHECK(n == 0 || std::memcmp(dst.data() + 3, src.data(), n) == 0);
            CHECK(dst[0] == 0xA5 && dst[1] == 0xA5 && dst[2] == 0xA5 && dst[n + 3] == 0xA5 && dst[n + 4] == 0xA5);
        }
    }
    set_crc_path(before);
}

TEST_CASE(streamed_copy_in_every_page_layout) {
    // A streamed copy whose destination's page offset lies just ahead of the source's
    // (4K aliasing) takes another loop on AMD CPUs (crc32c_sse42.cpp; forced here on
    // every CPU, and forced off): the same checksum and bytes,
    // nothing written outside, for (dst - src) % 4096 inside the window, at its edges and
    // outside it. The length covers chunks with and without a next one to prefetch.
    const std::size_t n = (std::size_t(4) << 20) + 2 * 3 * 8192 + 777;
    constexpr std::size_t PAGE = 4096, GUARD = 64;
    const auto src = random_bytes(n, 91);
    const std::uint32_t want = crc32c_bitwise(src.data(), n);
    std::vector<std::uint8_t> buf(n + PAGE + 2 * GUARD);
    const std::uintptr_t from = reinterpret_cast<std::uintptr_t>(src.data());
    const std::uintptr_t base = reinterpret_cast<std::uintptr_t>(buf.data()) + GUARD;
    const CrcPath before = active_crc_path();
    for (std::size_t d : {0, 1, 16, 64, 112, 191, 192, 193, 256, 4000, 4095}) {
        std::uint8_t* dst = buf.data() + GUARD + ((from + d - base) & (PAGE - 1));  // dst - src = d (mod PAGE)
        CHECK_EQ((reinterpret_cast<std::uintptr_t>(dst) - from) & (PAGE - 1), d);
        // Both loops on any CPU: the vendor's choice, then each forced.
        for (detail::AliasedCopySplit split : {detail::SPLIT_BY_VENDOR, detail::SPLIT_NEVER, detail::SPLIT_ALWAYS}) {
            detail::set_aliased_copy_split(split);
            for (CrcPath p : paths()) {
                set_crc_path(p);
                for (auto copy : {crc32c_copy, crc32c_copy_shared}) {  // both: the same bytes and checksum
                    std::fill(buf.begin(), buf.end(), std::uint8_t{0xA5});
                    CHECK_EQ(copy(0, dst, src.data(), n), want);
                    CHECK(std::memcmp(dst, src.data(), n) == 0);
                    CHECK(dst[-1] == 0xA5 && dst[n] == 0xA5);
                }
            }
        }
    }
    detail::set_aliased_copy_split(detail::SPLIT_BY_VENDOR);
    set_crc_path(before);
}

TEST_CASE(a_source_changing_under_the_copy_never_passes_as_what_was_stored) {
    // A restore checksums a caller's buffer another thread may still be writing:
    // whatever bytes were stored, the checksum returned must be theirs (else a
    // damaged snapshot could pass as intact). Every path and both SSE4.2 loops, the
    // aliasing layout (dst - src = 64 mod a page) with streamed stores (n >= 4 MiB).
    constexpr std::size_t n = std::size_t(4) << 20, PAGE = 4096;
    std::vector<std::uint8_t> src(n + PAGE), dst(n + 2 * PAGE);
    std::mt19937 rng(7);
    for (auto& b : src) b = static_cast<std::uint8_t>(rng());
    std::uint8_t* s0 = src.data() + ((PAGE - reinterpret_cast<std::uintptr_t>(src.data()) % PAGE) % PAGE);
    std::uint8_t* d0 = dst.data() + ((PAGE - reinterpret_cast<std::uintptr_t>(dst.data()) % PAGE) % PAGE) + 64;
    std::atomic<bool> stop{false};
    std::thread flipper([&] {  // flips bytes all over the source, a chunk's length apart
        for (std::uint8_t k = 1; !stop.load(std::memory_order_relaxed); ++k)
            for (std::size_t i = 5000; i < n; i += 24577) __atomic_store_n(s0 + i, k, __ATOMIC_RELAXED);
    });
    const CrcPath before = active_crc_path();
    for (detail::AliasedCopySplit split : {detail::SPLIT_NEVER, detail::SPLIT_ALWAYS}) {
        detail::set_aliased_copy_split(split);
        for (CrcPath p : paths()) {
            set_crc_path(p);
            for (int r = 0; r < 40; ++r) CHECK_EQ(crc32c_copy_shared(0, d0, s0, n), crc32c(0, d0, n));
        }
    }
    stop.store(true);
    flipper.join();
    detail::set_aliased_copy_split(detail::SPLIT_BY_VENDOR);
    set_crc_path(before);
}

TEST_CASE(dispatch) {
    CHECK(crc_path_supported(CrcPath::Portable));
    CHECK(crc_path_supported(best_crc_path()));
    CHECK(std::strcmp(crc_path_name(CrcPath::Sse42), "sse4.2") == 0);
    if (!crc_path_supported(CrcPath::Sse42)) CHECK_THROWS(set_crc_path(CrcPath::Sse42), std::invalid_argument);
}

TEST_MAIN()
