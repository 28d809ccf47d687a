// The ring itself: FeatureBuffer's wrap-around spans and copies, and the
// Stager's lazy TRIM_CHUNK trimming, against hand-computed slots and counts.
// Each row holds its own position, so a row copied from the wrong slot shows.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "check.hpp"
#include "dspark/feature_buffer.hpp"
#include "dspark/stager.hpp"

using namespace dspark;

namespace {

// -- FeatureBuffer with 4-byte rows (a u32 position each) --------------------

void append(FeatureBuffer& r, std::int64_t from, std::size_t n, std::size_t want_first, std::size_t want_second) {
    r.reserve_back(n, 8);
    FeatureBuffer::Span a, b;
    r.back_spans(n, a, b);
    CHECK_EQ(a.rows, want_first);
    CHECK_EQ(b.rows, want_second);
    for (std::size_t i = 0; i < n; ++i) {
        const auto v = static_cast<std::uint32_t>(from + static_cast<std::int64_t>(i));
        std::memcpy((i < a.rows ? a.data + i * 4 : b.data + (i - a.rows) * 4), &v, 4);
    }
    r.commit_back(n);
}

std::vector<std::uint32_t> out(const FeatureBuffer& r, std::int64_t from, std::int64_t to) {
    std::vector<std::uint32_t> v(static_cast<std::size_t>(to - from), 0xffffffffu);
    r.copy_out(from, to, reinterpret_cast<std::uint8_t*>(v.data()));
    return v;
}

std::vector<std::uint32_t> iota(std::uint32_t from, std::uint32_t to) {
    std::vector<std::uint32_t> v;
    for (std::uint32_t p = from; p < to; ++p) v.push_back(p);
    return v;
}

// -- Stager with D = 32 f32 rows whose every element is the position ----------

constexpr std::int64_t D = 32, B = 2, W = 10;
constexpr std::int64_t CAP = W + TRIM_CHUNK + B + 1;  // 525 slots

Stager make_stager(std::int64_t seqs = 1) {
    StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    o.max_seqs = seqs;
    return Stager(o);
}

void feed(Stager& s, std::int64_t from, std::int64_t n) {
    std::vector<std::int64_t> pos(static_cast<std::size_t>(n));
    std::vector<float> rows(static_cast<std::size_t>(n * D));
    for (std::int64_t i = 0; i < n; ++i) {
        pos[static_cast<std::size_t>(i)] = from + i;
        for (std::int64_t c = 0; c < D; ++c) rows[static_cast<std::size_t>(i * D + c)] = float(from + i);
    }
    s.process(0, pos.data(), pos.size(), rows.data(), ElemType::F32);
}

// The positions held in a snapshot's rows (its live rows [horizon, end), copied out of the ring).
std::vector<std::uint32_t> snapshot_positions(const Stager& s, std::int64_t seq) {
    const std::vector<std::uint8_t> snap = s.snapshot(seq);
    const SeqState st = s.state(seq);
    const std::size_t n = static_cast<std::size_t>(st.end - st.horizon);
    std::uint16_t header = 0;  // the header's size (offset 6 in every version); the rows follow it
    std::memcpy(&header, snap.data() + 6, 2);
    CHECK(snap.size() >= header + n * D * 4);
    const std::uint8_t* rows = snap.data() + header;
    std::vector<std::uint32_t> v;
    for (std::size_t i = 0; i < n; ++i) {
        float x;
        std::memcpy(&x, rows + i * D * 4, 4);
        v.push_back(static_cast<std::uint32_t>(x));
    }
    return v;
}

std::vector<std::uint32_t> staged_positions(const ByteVec& rows) {
    std::vector<std::uint32_t> v;
    for (std::size_t off = 0; off < rows.size(); off += D * 4) {
        float x;
        std::memcpy(&x, rows.data() + off, 4);
        v.push_back(static_cast<std::uint32_t>(x));
    }
    return v;
}

void check_counts(const Stager& s, std::int64_t rows, std::int64_t trims, std::int64_t trimmed, std::int64_t peak) {
    const SeqStats t = s.stats(0);
    CHECK_EQ(t.rows, rows);
    CHECK_EQ(t.trims, trims);
    CHECK_EQ(t.trimmed_rows, trimmed);
    CHECK_EQ(t.peak_rows, peak);
}

}  // namespace

TEST_CASE(ring_spans_and_copies_wrap_at_the_last_slot) {
    FeatureBuffer r(4);
    r.reset(0);
    append(r, 0, 5, 5, 0);  // first reserve: 8 slots; positions 0..4 in slots 0..4
    CHECK_EQ(r.capacity(), 8u);
    r.drop_front(3);         // head 3 at slot 3
    append(r, 5, 5, 3, 2);   // 5..7 in slots 5..7, 8..9 wrap to slots 0..1
    CHECK_EQ(r.head(), 3);
    CHECK_EQ(r.end(), 10);
    CHECK(out(r, 3, 10) == iota(3, 10));  // straddles the wrap
    CHECK(out(r, 6, 9) == iota(6, 9));    // last two slots, then slot 0
    CHECK(out(r, 7, 8) == iota(7, 8));    // the last slot alone
    CHECK(out(r, 8, 10) == iota(8, 10));  // wholly after the wrap
    r.drop_front(8);                      // head at slot 0 now
    append(r, 10, 6, 6, 0);               // slots 2..7: no wrap
    append(r, 16, 0, 0, 0);
    CHECK(out(r, 8, 16) == iota(8, 16));
    r.drop_back(12);                      // back rows go: [8, 12) in slots 0..3
    r.drop_front(9);
    append(r, 12, 4, 4, 0);               // slots 4..7
    r.drop_front(13);                     // [13, 16) in slots 5..7
    append(r, 16, 5, 5, 0);               // the tail is past the last slot: 16..20 start again at slot 0
    CHECK(out(r, 13, 21) == iota(13, 21));
    CHECK_EQ(r.size(), 8u);
    // Growing past the reserve re-linearises: the oldest row lands in slot 0.
    r.reserve_back(10, 8);
    CHECK_EQ(r.capacity(), 18u);
    CHECK(out(r, 13, 21) == iota(13, 21));
    append(r, 21, 10, 10, 0);
    CHECK(out(r, 13, 31) == iota(13, 31));
}

TEST_CASE(lazy_trim_fires_at_exactly_trim_chunk_dead_rows) {
    // One row per call, no drafts: the horizon is end - W; the head stays at
    // 0 until horizon - head reaches TRIM_CHUNK (end = W + 512 = 522).
    Stager s = make_stager();
    for (std::int64_t p = 0; p < 521; ++p) feed(s, p, 1);
    check_counts(s, 521, 0, 0, 521);
    CHECK_EQ(s.stats(0).reserved_bytes, CAP * D * 4);
    feed(s, 521, 1);  // end 522, horizon 512: 512 dead rows -> trimmed
    check_counts(s, W, 1, 512, 521);
    for (std::int64_t p = 522; p < 1033; ++p) feed(s, p, 1);
    check_counts(s, 521, 1, 512, 521);  // head 512, end 1033, horizon 1023: 511 dead
    feed(s, 1033, 1);
    check_counts(s, W, 2, 1024, 521);
    CHECK_EQ(s.stats(0).live_rows, W);
}

TEST_CASE(live_rows_straddling_the_wrap_copy_out_intact) {
    // 525 slots; position p sits in slot p % 525 (head at slot 0 until the
    // trim at end 522 moves it to slot 512). At end 530 the live rows
    // [520, 530) are slots 520..524 then 0..4.
    Stager s = make_stager(2);
    for (std::int64_t p = 0; p < 530; ++p) feed(s, p, 1);
    check_counts(s, 18, 1, 512, 521);
    CHECK(snapshot_positions(s, 0) == iota(520, 530));
    // The rebase of a first round keeps K = 5 rows: 525..529 (slots 0..4).
    // A round at end 528 stages 523..527: slots 523, 524, 0, 1, 2.
    Stager t = make_stager();
    for (std::int64_t p = 0; p < 528; ++p) feed(t, p, 1);
    ByteVec rows;
    const RoundPlan plan = t.draft(0, 528, rows);
    CHECK(plan.rebase);
    CHECK_EQ(plan.first_row, 523);
    CHECK(staged_positions(rows) == iota(523, 528));
    // A fork copies the straddling live rows into a fresh ring (slot 0 on).
    s.fork(0, 1);
    CHECK(snapshot_positions(s, 1) == iota(520, 530));
    ByteVec forked;
    const RoundPlan fp = s.draft(1, 530, forked);
    CHECK(fp.rebase);
    CHECK(staged_positions(forked) == iota(525, 530));
    // Chunks of 5: the second trim comes at end 1035 (horizon 1025, 513 dead
    // rows). Then a chunk that itself wraps: 7 rows from 1045 (slot 520)
    // fill slots 520..524 and 0..1.
    for (std::int64_t p = 530; p < 1045; p += 5) feed(s, p, 5);
    check_counts(s, 20, 2, 1025, 521);
    feed(s, 1045, 7);
    check_counts(s, 27, 2, 1025, 521);
    CHECK(snapshot_positions(s, 0) == iota(1042, 1052));
}

TEST_CASE(long_chunks_trim_before_append_and_skip_rows_below_the_horizon) {
    // 515 rows held (horizon 505), then 20 rows at once: the new horizon is
    // 525, so input rows 515..524 are never stored and the whole held ring
    // (515 rows, all below it) goes in one trim; 10 rows remain.
    Stager s = make_stager();
    for (std::int64_t p = 0; p < 515; ++p) feed(s, p, 1);
    check_counts(s, 515, 0, 0, 515);
    feed(s, 515, 20);
    check_counts(s, W, 1, 515, 515);
    CHECK(snapshot_positions(s, 0) == iota(525, 535));
    // A chunk that fits the window but not beside the held rows: 521 held
    // (horizon 511, no trim yet), then 10 rows: 531 > 525 slots.
    Stager t = make_stager();
    for (std::int64_t p = 0; p < 521; ++p) feed(t, p, 1);
    feed(t, 521, 10);  // the held rows all lie below the new horizon 521: one trim, then the append
    check_counts(t, W, 1, 521, 521);
    CHECK(snapshot_positions(t, 0) == iota(521, 531));
}

// -- copy_slot_rows: an owner's table copies, in order, all checked first -----

TEST_CASE(copy_slot_rows_applies_moves_in_order) {
    // One table, 4-byte rows holding their slot: [0,3) -> [2,5) overlaps (memmove), then a move
    // reads a row the first one wrote.
    std::vector<std::uint32_t> t(8);
    for (std::uint32_t i = 0; i < 8; ++i) t[i] = i;
    auto* bytes = reinterpret_cast<std::uint8_t*>(t.data());
    const SlotMove moves[] = {{0, 2, 3}, {4, 7, 1}};
    copy_slot_rows(moves, 2, bytes, 8, bytes, 8, 4);
    const std::uint32_t want[] = {0, 1, 0, 1, 2, 5, 6, 2};
    for (int i = 0; i < 8; ++i) CHECK_EQ(t[i], want[i]);
}

TEST_CASE(copy_slot_rows_refuses_any_move_outside_a_table_before_copying) {
    std::vector<std::uint8_t> src(10 * 2, 7), dst(4 * 2, 0);
    const SlotMove bad[][2] = {{{0, 0, 1}, {0, 0, 0}}, {{0, 0, 1}, {-1, 0, 1}}, {{0, 0, 1}, {0, 3, 2}},
                               {{0, 0, 1}, {9, 0, 2}}, {{0, 0, 1}, {INT64_MAX, 0, 2}}};
    for (const auto& m : bad) {
        CHECK_THROWS(copy_slot_rows(m, 2, src.data(), 10, dst.data(), 4, 2), std::invalid_argument);
        for (std::uint8_t b : dst) CHECK_EQ(b, 0);  // the good first move was not applied either
    }
}

TEST_MAIN()
