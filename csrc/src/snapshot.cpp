// Snapshot format v1 of one sequence (byte layout documented in
// src/dspark_core/snapshot_format.py, which the reference twin implements;
// tests compare the bytes of both).
#include <array>
#include <cstring>
#include <string>

#include "dspark/errors.hpp"
#include "dspark/stager.hpp"

namespace dspark {

namespace {

constexpr char MAGIC[4] = {'D', 'S', 'P', 'K'};
constexpr std::uint16_t VERSION = 1;
constexpr std::uint16_t HEADER_BYTES = 88;
constexpr std::uint32_t FLAG_STARTED = 1, FLAG_DISABLED = 2, FLAG_OWED = 4, FLAG_FIRST_ROUND = 8,
                        FLAG_ACCEPT_OPEN = 16;
constexpr std::uint32_t FLAG_BITS = 31;

// CRC-32 (IEEE 802.3, zlib's crc32), table-driven.
std::uint32_t crc32(const std::uint8_t* p, std::size_t n) {
    static const std::array<std::uint32_t, 256> table = [] {
        std::array<std::uint32_t, 256> t{};
        for (std::uint32_t i = 0; i < 256; ++i) {
            std::uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            t[i] = c;
        }
        return t;
    }();
    std::uint32_t c = 0xFFFFFFFFu;
    for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

// Little-endian field access (the format is LE on every host).
template <class T>
void put(std::uint8_t* at, T v) {
    for (std::size_t i = 0; i < sizeof(T); ++i) at[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(v) >> (8 * i));
}
template <class T>
T take(const std::uint8_t* at) {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<std::uint64_t>(at[i]) << (8 * i);
    return static_cast<T>(v);
}

}  // namespace

std::vector<std::uint8_t> Stager::snapshot(std::int64_t seq) const {
    std::lock_guard<std::mutex> lock(mu_);
    const Seq& s = ready(seq);
    require_mode(RowMode::Held, "snapshot");
    const std::int64_t n_rows = s.started ? s.end - s.horizon : 0;
    std::vector<std::uint8_t> out(HEADER_BYTES + static_cast<std::size_t>(n_rows) * row_bytes_ + 4, 0);
    std::uint8_t* h = out.data();
    std::memcpy(h, MAGIC, 4);
    put<std::uint16_t>(h + 4, VERSION);
    put<std::uint16_t>(h + 6, HEADER_BYTES);
    put<std::uint32_t>(h + 8, static_cast<std::uint32_t>(opt_.feature_dim));
    put<std::uint8_t>(h + 12, static_cast<std::uint8_t>(opt_.storage));
    put<std::uint32_t>(h + 16, static_cast<std::uint32_t>(opt_.window));
    put<std::uint32_t>(h + 20, static_cast<std::uint32_t>(opt_.block_size));
    put<std::uint32_t>(h + 24, static_cast<std::uint32_t>(row_bytes_));
    const std::uint32_t flags = (s.started ? FLAG_STARTED : 0) | (s.disabled ? FLAG_DISABLED : 0) |
                                (s.restage_owed ? FLAG_OWED : 0) | (s.first_round ? FLAG_FIRST_ROUND : 0) |
                                (s.accept_open ? FLAG_ACCEPT_OPEN : 0);
    put<std::uint32_t>(h + 28, flags);
    put<std::int64_t>(h + 32, s.end);
    put<std::int64_t>(h + 40, s.horizon);
    put<std::int64_t>(h + 48, s.n_cache);
    put<std::int64_t>(h + 56, s.pos_base);
    put<std::int64_t>(h + 64, s.tentative);
    put<std::uint32_t>(h + 72, static_cast<std::uint32_t>(s.failures));
    put<std::uint64_t>(h + 80, static_cast<std::uint64_t>(n_rows));
    if (n_rows) s.buf.copy_out(s.horizon, s.end, h + HEADER_BYTES);
    const std::size_t body = out.size() - 4;
    put<std::uint32_t>(h + body, crc32(h, body));
    return out;
}

void Stager::restore(std::int64_t seq, const std::uint8_t* d, std::size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    Seq& target = ready(seq);
    require_mode(RowMode::Held, "restore");
    auto bad = [](const std::string& why) { throw std::invalid_argument(why); };
    if (n < HEADER_BYTES + 4u)
        bad("snapshot is truncated: " + std::to_string(n) + " bytes, a header needs " + std::to_string(HEADER_BYTES + 4));
    if (std::memcmp(d, MAGIC, 4) != 0) bad("not a dspark_core snapshot (bad magic)");
    const auto version = take<std::uint16_t>(d + 4);
    if (version != VERSION)
        bad("unsupported snapshot version " + std::to_string(version) + " (this build reads " + std::to_string(VERSION) + ")");
    if (take<std::uint16_t>(d + 6) != HEADER_BYTES) bad("bad snapshot header size " + std::to_string(take<std::uint16_t>(d + 6)));
    if (crc32(d, n - 4) != take<std::uint32_t>(d + n - 4)) bad("snapshot checksum mismatch (damaged data)");

    const std::uint32_t feature_dim = take<std::uint32_t>(d + 8);
    const std::uint8_t storage = take<std::uint8_t>(d + 12);
    const std::uint32_t window = take<std::uint32_t>(d + 16), block = take<std::uint32_t>(d + 20);
    const std::uint32_t rbytes = take<std::uint32_t>(d + 24);
    if (feature_dim != opt_.feature_dim || storage != static_cast<std::uint8_t>(opt_.storage) ||
        window != opt_.window || block != opt_.block_size || rbytes != row_bytes_) {
        auto fmt = [](std::uint32_t dim, std::uint8_t st, std::uint32_t w, std::uint32_t b) {
            const std::string name = st < STORAGE_COUNT ? storage_name(static_cast<Storage>(st)) : "code " + std::to_string(st);
            return "feature_dim=" + std::to_string(dim) + ", storage=" + name + ", window=" + std::to_string(w) +
                   ", block_size=" + std::to_string(b);
        };
        bad("snapshot was taken with (" + fmt(feature_dim, storage, window, block) + ") but this Stager has (" +
            fmt(static_cast<std::uint32_t>(opt_.feature_dim), static_cast<std::uint8_t>(opt_.storage),
                static_cast<std::uint32_t>(opt_.window), static_cast<std::uint32_t>(opt_.block_size)) + ")");
    }
    const std::uint32_t flags = take<std::uint32_t>(d + 28);
    if (d[13] || d[14] || d[15] || take<std::uint32_t>(d + 76) || (flags & ~FLAG_BITS)) bad("snapshot has reserved bits set");
    const std::uint64_t n_rows = take<std::uint64_t>(d + 80);
    // Overflow-safe: n_rows must fit the bytes actually present.
    if (n_rows > (n - HEADER_BYTES - 4) / (row_bytes_ ? row_bytes_ : 1) || HEADER_BYTES + n_rows * row_bytes_ + 4 != n)
        bad("snapshot length " + std::to_string(n) + " does not match its " + std::to_string(n_rows) + " rows of " +
            std::to_string(row_bytes_) + " bytes");
    const std::int64_t end = take<std::int64_t>(d + 32), horizon = take<std::int64_t>(d + 40);
    const std::int64_t n_cache = take<std::int64_t>(d + 48), pos_base = take<std::int64_t>(d + 56);
    const std::int64_t tentative = take<std::int64_t>(d + 64);
    const std::uint32_t failures = take<std::uint32_t>(d + 72);
    const bool started = flags & FLAG_STARTED;
    bool ok;
    if (started) {
        ok = 0 <= horizon && horizon <= end && 0 <= pos_base && pos_base <= n_cache && n_cache <= end &&
             static_cast<std::uint64_t>(end - horizon) == n_rows &&
             n_rows <= static_cast<std::uint64_t>(opt_.window + opt_.block_size + 1) && 0 <= tentative &&
             tentative <= opt_.block_size + 1 && tentative <= end - n_cache &&
             (tentative == 0 || (flags & FLAG_ACCEPT_OPEN)) &&
             // an accept may leave end as low as this: the horizon must not pass it
             horizon <= (tentative ? end - tentative + 1 : end) && end < MAX_POSITION;
    } else {
        ok = end == 0 && horizon == 0 && n_cache == 0 && pos_base == 0 && tentative == 0 && n_rows == 0 &&
             flags == FLAG_FIRST_ROUND && failures == 0;  // a fresh sequence
    }
    if (!ok) bad("snapshot fields are inconsistent");

    // Build the new state completely, then swap it in: bad data never
    // leaves the slot half-restored.
    Seq s;
    s.started = started;
    s.disabled = flags & FLAG_DISABLED;
    s.restage_owed = started;  // the drafter cache of this slot is unknown
    s.first_round = flags & FLAG_FIRST_ROUND;
    s.accept_open = flags & FLAG_ACCEPT_OPEN;
    s.end = end;
    s.horizon = horizon;
    s.n_cache = n_cache;
    s.pos_base = pos_base;
    s.tentative = tentative;
    s.failures = failures;
    s.buf = ring_for(target.buf, horizon, n_rows);  // validated: nothing below can fail
    append_rows(s.buf, d + HEADER_BYTES, n_rows);
    target = std::move(s);
    advance_horizon(target);
}

}  // namespace dspark
