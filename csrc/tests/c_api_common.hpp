// What the C ABI's ctest programs share (test_c_api*.cpp): the row width,
// a handle that destroys its Stager, activation-like rows, positions and a
// sequence's snapshot bytes (its whole observable state).
#pragma once
#include <cstdint>
#include <cstdio>
#include <vector>

#include "dspark/dspark.h"

namespace c_api_test {

constexpr std::int64_t D = 32;

// A listed record as the C ABI filled it (the core's DSPARK_*_FIELDS lists),
// after the test set its bytes to 0xAB: its listed fields, the bytes they
// take, and how many were written. DSPARK_COUNT_FIELD expands with `rec` (the
// C struct) and `count` in scope.
struct FieldCount {
    std::size_t fields = 0, bytes = 0, set = 0;
};
#define DSPARK_COUNT_FIELD(type, name) \
    ++count.fields;                    \
    count.bytes += sizeof(rec.name);   \
    count.set += rec.name != static_cast<decltype(rec.name)>(0xABABABABABABABABull);

struct Handle {
    dspark_stager* st = nullptr;
    explicit Handle(const dspark_config& c) {
        if (dspark_stager_create(&c, &st) != DSPARK_OK) std::printf("  create failed: %s\n", dspark_last_error());
    }
    ~Handle() { dspark_stager_destroy(st); }
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;
};

// Activation-like rows: N(0,1)-ish noise from a hash, a massive channel (col
// 3, ~1e4) and a huge-norm first row (position 0, ~1e5), tagged by position
// and by a version (a re-verified position gets other values).
inline std::vector<float> rows_for(std::int64_t from, std::int64_t n, int version = 0) {
    std::vector<float> r(static_cast<std::size_t>(n * D));
    for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t c = 0; c < D; ++c) {
            const std::int64_t p = from + i;
            const std::uint32_t h = static_cast<std::uint32_t>((p * 2654435761u) ^ (c * 40503u) ^ (version * 97u));
            float v = (static_cast<float>(h % 2001u) - 1000.0f) / 400.0f;
            if (c == 3) v = 1.0e4f + static_cast<float>(p);
            if (p == 0) v *= 10.0f;
            r[static_cast<std::size_t>(i * D + c)] = v;
        }
    return r;
}

inline std::vector<std::int64_t> span(std::int64_t from, std::int64_t n) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = from + i;
    return p;
}

// The whole observable state of a sequence, to check that rejected calls change nothing.
inline std::vector<std::uint8_t> snap(dspark_stager* st, std::int64_t seq) {
    std::size_t n = 0;
    if (dspark_snapshot_size(st, seq, &n) != DSPARK_OK) return {};
    std::vector<std::uint8_t> out(n);
    std::size_t written = 0;
    if (dspark_snapshot(st, seq, out.data(), out.size(), &written) != DSPARK_OK) return {};
    out.resize(written);
    return out;
}

}  // namespace c_api_test
