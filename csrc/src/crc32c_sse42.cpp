// CRC-32C with SSE4.2's crc32 instruction (this translation unit alone is
// compiled with -msse4.2; it runs only where the dispatch found SSE4.2).
//
// The instruction has a latency of 3 cycles and a throughput of 1 per cycle,
// so three independent streams keep it busy: 24 bytes per 3 cycles, faster
// than one core reads memory. The streams' registers are joined by the shift
// tables (crc32c_kernels.hpp). The copy kernel stores each 16 bytes right
// after checksumming them (one pass; large copies with non-temporal stores),
// except, on AMD cores, where the destination's page offset lies just ahead of
// the source's (ALIAS_WINDOW below). Same results as the portable kernel.
#if defined(DSPARK_X86)
#include <nmmintrin.h>
#include <smmintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "crc32c_kernels.hpp"
#include "dspark/dispatch.hpp"

namespace dspark {
namespace detail {

namespace {

// The instructions for crc_update_streams (crc32c_kernels.hpp).
struct Sse42 {
    static std::uint64_t load64(const std::uint8_t* p) noexcept {
        std::uint64_t v;
        std::memcpy(&v, p, 8);
        return v;
    }
    static std::uint32_t u64(std::uint32_t c, std::uint64_t v) noexcept {
        return static_cast<std::uint32_t>(_mm_crc32_u64(c, v));
    }
    static std::uint32_t u8(std::uint32_t c, std::uint8_t v) noexcept { return _mm_crc32_u8(c, v); }
};

std::uint32_t sse42_update(std::uint32_t c, const std::uint8_t* p, std::size_t n) noexcept {
    return crc_update_streams<Sse42>(c, p, n);
}

template <bool Stream>
inline void store128(std::uint8_t* p, __m128i v) noexcept {
    if constexpr (Stream) _mm_stream_si128(reinterpret_cast<__m128i*>(p), v);  // p is 16-byte aligned
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
}

inline std::uint64_t crc128(std::uint64_t c, __m128i v) noexcept {
    c = _mm_crc32_u64(c, static_cast<std::uint64_t>(_mm_cvtsi128_si64(v)));
    return _mm_crc32_u64(c, static_cast<std::uint64_t>(_mm_extract_epi64(v, 1)));
}

// One byte copied and checksummed from the same load.
inline std::uint32_t copy_byte(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src) noexcept {
    std::uint8_t v = *src;
    DSPARK_PIN(v);
    *dst = v;
    return _mm_crc32_u8(c, v);
}

// three_way fused with the copy: every 16 bytes are loaded once, checksummed
// and stored, so the checksum overlaps the memory traffic instead of adding
// to it (len % 16 == 0).
template <bool Stream>
inline std::uint32_t copy_three_way(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src, std::size_t len,
                                    const CrcShift& shift) noexcept {
    std::uint64_t c0 = c, c1 = 0, c2 = 0;
    for (std::size_t i = 0; i < len; i += 16) {
        __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + len + i));
        __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * len + i));
        DSPARK_PIN_XMM(a);  // checksummed and stored from the same load
        DSPARK_PIN_XMM(b);
        DSPARK_PIN_XMM(d);
        c0 = crc128(c0, a);
        c1 = crc128(c1, b);
        c2 = crc128(c2, d);
        store128<Stream>(dst + i, a);
        store128<Stream>(dst + len + i, b);
        store128<Stream>(dst + 2 * len + i, d);
    }
    std::uint32_t r = crc_apply_shift(shift, static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1);
    return crc_apply_shift(shift, r) ^ static_cast<std::uint32_t>(c2);
}

// 4K aliasing. A load whose address matches a pending store's in its low 12
// bits is held back until the core knows they differ; the fused loop's stores
// run d = (dst - src) mod 4096 bytes ahead of its loads, so for small d > 0
// almost every load meets a pending streamed store, and the loop ran 2-10x
// slower (measured for d = 16..144 on an AMD EPYC; from d = 208 on, as fast as
// at d = 0). That is snapshot_into's usual layout: the rows go 96 bytes into a
// numpy buffer, which starts 16 bytes into a page, out of a ring that starts
// on one (d = 112). Cached stores (copies under CRC_STREAM_MIN_BYTES) are
// left as they are: the window there is narrower and the copy is CRC-bound.
// Intel cores do not stall so: on a Xeon with AVX-512 the fused loop ran at
// d = 16..144 within 20% of d = 1024 (0.8x a memcpy), and copy_two_pass,
// which reads each chunk before it writes any, cost 30% there (0.6x). So
// the split is taken on AMD CPUs only (set_aliased_copy_split overrides it).
inline constexpr std::size_t ALIAS_WINDOW = 192;
inline constexpr std::size_t PAGE_OFFSET_MASK = 4095;
inline constexpr std::size_t LINE = 64;

std::atomic<int> g_split{SPLIT_BY_VENDOR};

// Whether this CPU stalls on the aliasing layout (the override, else the vendor).
inline bool split_aliased_copies() noexcept {
    const int mode = g_split.load(std::memory_order_relaxed);
    return mode == SPLIT_BY_VENDOR ? cpu_features().amd : mode == SPLIT_ALWAYS;
}

inline bool stores_alias_loads(const std::uint8_t* dst, const std::uint8_t* src) noexcept {
    const std::size_t d =
        (reinterpret_cast<std::uintptr_t>(dst) - reinterpret_cast<std::uintptr_t>(src)) & PAGE_OFFSET_MASK;
    return d != 0 && d <= ALIAS_WINDOW && split_aliased_copies();
}

// The aliasing layout's chunk (3 x CRC_LONG bytes, dst 64-byte aligned): checksum
// it first (loads only; the chunk is then in L1), then stream it out of L1 last
// line first, so every load lies below the stores still pending (d > 0). While
// it streams out, the next chunk (`next`, null for none) is prefetched into L2:
// the two passes would otherwise leave the reads idle while the writes run.
// It reads src twice: only for a source no other thread writes (crc32c_copy).
inline void stream_out(std::uint8_t* dst, const std::uint8_t* from, const std::uint8_t* next) noexcept {
    for (std::size_t i = 3 * CRC_LONG; i != 0;) {
        i -= LINE;
        if (next) _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T1);
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 16));
        const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 32));
        const __m128i f = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 48));
        store128<true>(dst + i, a);
        store128<true>(dst + i + 16, b);
        store128<true>(dst + i + 32, e);
        store128<true>(dst + i + 48, f);
    }
}

inline std::uint32_t copy_two_pass(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src,
                                   const std::uint8_t* next, const CrcShift& shift) noexcept {
    c = crc_three_way<Sse42>(c, src, CRC_LONG, shift);
    stream_out(dst, src, next);
    return c;
}

// Where copy_two_pass_shared stages a chunk: this thread's L1-sized buffer, at
// the page offset 2 KiB past dst's. Its stores then lie 2 KiB + d past the loads
// from src, and its loads 2 KiB before the stores to dst: neither pair aliases.
inline constexpr std::size_t STAGE_AWAY = 2048;
inline std::uint8_t* staging_for(const std::uint8_t* dst) noexcept {
    alignas(LINE) static thread_local std::uint8_t buf[3 * CRC_LONG + PAGE_OFFSET_MASK + 1];
    const std::size_t want = (reinterpret_cast<std::uintptr_t>(dst) + STAGE_AWAY) & PAGE_OFFSET_MASK;
    const std::size_t have = reinterpret_cast<std::uintptr_t>(buf) & PAGE_OFFSET_MASK;
    return buf + ((want - have) & PAGE_OFFSET_MASK);
}

// copy_two_pass for a source another thread may write (crc32c_copy_shared):
// the chunk is read from src once, into the staging buffer, and both passes
// read it there, so the checksum is of the very bytes stored.
inline std::uint32_t copy_two_pass_shared(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src,
                                          const std::uint8_t* next, const CrcShift& shift) noexcept {
    std::uint8_t* tmp = staging_for(dst);
    for (std::size_t i = 0; i != 3 * CRC_LONG; i += 16)
        _mm_store_si128(reinterpret_cast<__m128i*>(tmp + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    DSPARK_COMPILER_FENCE();  // both passes below read tmp itself, never src again
    c = crc_three_way<Sse42>(c, tmp, CRC_LONG, shift);
    stream_out(dst, tmp, next);
    return c;
}

// Shared: the source may change under the call (copy_two_pass_shared where the
// layout takes the two-pass loop; the fused loops read each byte once anyway).
template <bool Stream, bool Shared>
std::uint32_t copy_impl(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src, std::size_t n) noexcept {
    bool aliased = false;
    if (Stream) {  // non-temporal stores fill whole lines from a line-aligned destination
        const std::size_t head = std::min(n, (LINE - (reinterpret_cast<std::uintptr_t>(dst) & (LINE - 1))) & (LINE - 1));
        for (std::size_t i = 0; i < head; ++i) c = copy_byte(c, dst + i, src + i);
        dst += head;
        src += head;
        n -= head;
        aliased = stores_alias_loads(dst, src);
    }
    if (n >= 3 * CRC_LONG) {
        const CrcShift& s = crc_shift_long();
        for (; n >= 3 * CRC_LONG; src += 3 * CRC_LONG, dst += 3 * CRC_LONG, n -= 3 * CRC_LONG) {
            const std::uint8_t* next = n >= 6 * CRC_LONG ? src + 3 * CRC_LONG : nullptr;
            if (!aliased) c = copy_three_way<Stream>(c, dst, src, CRC_LONG, s);
            else if (Shared) c = copy_two_pass_shared(c, dst, src, next, s);
            else c = copy_two_pass(c, dst, src, next, s);
        }
    }
    if (n >= 3 * CRC_SHORT) {
        const CrcShift& s = crc_shift_short();
        for (; n >= 3 * CRC_SHORT; src += 3 * CRC_SHORT, dst += 3 * CRC_SHORT, n -= 3 * CRC_SHORT)
            c = copy_three_way<Stream>(c, dst, src, CRC_SHORT, s);
    }
    std::uint64_t c64 = c;
    for (; n >= 16; src += 16, dst += 16, n -= 16) {
        __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
        DSPARK_PIN_XMM(v);
        c64 = crc128(c64, v);
        store128<Stream>(dst, v);
    }
    c = static_cast<std::uint32_t>(c64);
    for (; n != 0; ++src, ++dst, --n) c = copy_byte(c, dst, src);
    if (Stream) _mm_sfence();  // the streamed stores are visible before we return
    return c;
}

std::uint32_t sse42_copy(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src, std::size_t n) noexcept {
    return n >= CRC_STREAM_MIN_BYTES ? copy_impl<true, false>(c, dst, src, n) : copy_impl<false, false>(c, dst, src, n);
}

std::uint32_t sse42_copy_shared(std::uint32_t c, std::uint8_t* dst, const std::uint8_t* src, std::size_t n) noexcept {
    return n >= CRC_STREAM_MIN_BYTES ? copy_impl<true, true>(c, dst, src, n) : copy_impl<false, true>(c, dst, src, n);
}

}  // namespace

const CrcKernels kSse42Crc = {sse42_update, sse42_copy, sse42_copy_shared};

void set_aliased_copy_split(AliasedCopySplit mode) noexcept { g_split.store(mode, std::memory_order_relaxed); }

}  // namespace detail
}  // namespace dspark
#else
#include "crc32c_kernels.hpp"

namespace dspark::detail {
void set_aliased_copy_split(AliasedCopySplit) noexcept {}  // no SSE4.2 copy here: nothing to choose
}  // namespace dspark::detail
#endif  // DSPARK_X86
