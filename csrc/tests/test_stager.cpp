// C++ unit tests of the Stager state machine (no Python). The synthetic loop
// scenario with window crossing, the memory bound, atomic rejection, and the
// lifecycle operations. The Python suite compares the core with the reference
// twin op for op; these tests keep the core testable on its own.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "check.hpp"
#include "dspark/errors.hpp"
#include "dspark/stager.hpp"

using namespace dspark;

namespace {

constexpr std::int64_t D = 32;

StagerOptions opts(std::int64_t B, std::int64_t W, Storage st = Storage::F32, std::int64_t seqs = 1) {
    StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    o.max_seqs = seqs;
    o.storage = st;
    return o;
}

// Rows whose first element is the position (plus a version tag).
std::vector<float> rows_for(std::int64_t from, std::int64_t n, float version = 0) {
    std::vector<float> r(static_cast<std::size_t>(n * D));
    for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t c = 0; c < D; ++c) r[static_cast<std::size_t>(i * D + c)] = float(from + i) + version + 0.001f * float(c);
    return r;
}

std::vector<std::int64_t> span(std::int64_t from, std::int64_t n) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = from + i;
    return p;
}

void process(Stager& s, std::int64_t seq, std::int64_t from, std::int64_t n, float version = 0) {
    auto p = span(from, n);
    auto r = rows_for(from, n, version);
    s.process(seq, p.data(), p.size(), r.data(), ElemType::F32);
}

float first_value(const ByteVec& rows, std::size_t row) {
    float v;
    std::memcpy(&v, rows.data() + row * D * 4, 4);
    return v;
}

// Two v2 snapshots hold the same rows (bytes after the 96-byte header).
bool same_rows(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
    return a.size() == b.size() && std::memcmp(a.data() + 96, b.data() + 96, a.size() - 96) == 0;
}

}  // namespace

TEST_CASE(synthetic_loop_crosses_the_window) {
    // B = 7, W = 20, K = 10; a 5-row prompt; accepts 7, 3, 0, 7, 5, 1, 4.
    Stager s(opts(7, 20));
    CHECK_EQ(s.w_keep(), 10);
    process(s, 0, 0, 5);
    struct Want { std::int64_t start; bool rebase; std::int64_t lo, base; };
    const Want want[] = {{5, false, 0, 0},   {13, false, 5, 0},  {17, true, 7, 7},   {18, false, 17, 7},
                         {26, true, 16, 16}, {32, true, 22, 22}, {34, false, 32, 22}, {39, true, 29, 29}};
    const std::int64_t accepts[] = {7, 3, 0, 7, 5, 1, 4};
    std::int64_t n_past = 5;
    for (int r = 0; r < 8; ++r) {
        CHECK_EQ(n_past, want[r].start);
        ByteVec rows;
        RoundPlan p = s.draft(0, n_past, rows);
        CHECK(p.skip == Skip::None);
        CHECK_EQ(p.rebase, want[r].rebase);
        CHECK_EQ(p.clear_cache, want[r].rebase || r == 0);
        CHECK_EQ(p.first_row, want[r].lo);
        CHECK_EQ(p.pos_base, want[r].base);
        CHECK_EQ(p.n_rows, want[r].start - want[r].lo);
        CHECK_EQ(p.crop_from, want[r].start - want[r].base);
        CHECK(p.crop_from + 7 <= 20);
        CHECK_EQ(rows.size(), std::size_t(p.n_rows * D * 4));
        s.commit(0);
        if (r == 7) break;
        process(s, 0, n_past, 8, 0.25f * float(r + 1));
        s.accept(0, accepts[r]);
        n_past += accepts[r] + 1;
    }
    CHECK_EQ(s.stats(0).rebases, 4);
}

TEST_CASE(skip_and_fail_stage_names) {
    // The Python tables enumerate these until the first empty / null name.
    CHECK(std::string(skip_name(Skip::None)).empty());
    CHECK(std::string(skip_name(Skip::MissingRows)) == "missing_rows");
    CHECK(std::string(skip_name(static_cast<Skip>(200))).empty());
    CHECK(std::string(fail_stage_name(FailStage::Decode)) == "decode");
    CHECK(std::string(fail_stage_name(FailStage::Crop)) == "crop");
    CHECK(fail_stage_name(static_cast<FailStage>(200)) == nullptr);
}

TEST_CASE(config_errors_are_exceptions_not_aborts) {
    CHECK_THROWS(Stager(opts(10, 20)), ConfigError);   // W <= 2B
    CHECK_THROWS(Stager(opts(0, 20)), ConfigError);
    StagerOptions q = opts(4, 20, Storage::Q4_0);
    q.feature_dim = 33;                                  // q formats need D % 32 == 0
    CHECK_THROWS(Stager(q), ConfigError);
    StagerOptions m = opts(4, 20);
    m.max_seqs = 0;
    CHECK_THROWS(Stager(m), ConfigError);
    // 2 * block_size past int64: refused, not wrapped to a negative bound every window exceeds.
    for (std::int64_t b : {std::int64_t(1) << 62, INT64_MAX}) {
        StagerOptions big = opts(4, 20);
        big.block_size = b;
        CHECK_THROWS(Stager(big), ConfigError);
    }
}

TEST_CASE(rejected_calls_change_nothing) {
    Stager s(opts(4, 12));
    process(s, 0, 0, 6);
    auto before = s.snapshot(0);
    auto p = span(7, 2);  // gap: expected 6
    auto r = rows_for(7, 2);
    CHECK_THROWS(s.process(0, p.data(), 2, r.data(), ElemType::F32), std::invalid_argument);
    auto q = span(6, 3);
    auto bad = rows_for(6, 3);
    bad[D + 3] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS(s.process(0, q.data(), 3, bad.data(), ElemType::F32), std::invalid_argument);
    CHECK(s.snapshot(0) == before);
    ByteVec unused;
    CHECK_THROWS(s.draft(0, -1, unused), std::invalid_argument);
    CHECK_THROWS(s.accept(0, 5), std::invalid_argument);
    CHECK_THROWS(s.begin(1), std::invalid_argument);  // unknown sequence
    CHECK_THROWS(s.commit(0), StateError);           // no open round
    ByteVec rows;
    s.draft(0, 6, rows);
    CHECK_THROWS(process(s, 0, 6, 1), StateError);   // open round
    CHECK_THROWS(s.snapshot(0), StateError);
    s.commit(0);
    CHECK(s.state(0).n_cache == 6);
}

TEST_CASE(prefill_of_100k_rows_stays_bounded) {
    const std::int64_t B = 16, W = 1024;
    Stager s(opts(B, W));
    std::vector<float> chunk(static_cast<std::size_t>(4096 * D), 1.0f);
    for (std::int64_t n = 0; n < 100000; n += 4096) {
        const std::int64_t k = std::min<std::int64_t>(4096, 100000 - n);
        auto p = span(n, k);
        s.process(0, p.data(), p.size(), chunk.data(), ElemType::F32);
    }
    const SeqStats st = s.stats(0);
    CHECK(st.peak_rows <= W + TRIM_CHUNK + B + 1);
    ByteVec rows;
    RoundPlan p = s.draft(0, 100000, rows);
    CHECK(p.rebase);
    CHECK_EQ(p.n_rows, W / 2);
    CHECK_EQ(p.pos_base, 100000 - W / 2);
}

TEST_CASE(fail_keeps_retained_rows_and_disables_after_max) {
    StagerOptions o = opts(4, 12);
    o.max_failures = 2;
    Stager s(o);
    process(s, 0, 0, 30);
    ByteVec rows;
    RoundPlan a = s.draft(0, 30, rows);
    CHECK(a.rebase && a.n_rows == 6);
    CHECK(!s.fail(0, FailStage::Decode));
    process(s, 0, 30, 1);
    rows.clear();
    RoundPlan b = s.draft(0, 31, rows);
    CHECK(b.rebase && b.n_rows == 6 && first_value(rows, 0) == 25.0f);
    CHECK(s.fail(0, FailStage::Crop));  // second consecutive failure disables (reported once)
    rows.clear();
    CHECK(s.draft(0, 31, rows).skip == Skip::Disabled);
    s.begin(0);
    CHECK(!s.state(0).disabled);
}

TEST_CASE(snapshot_round_trip_and_damage) {
    Stager s(opts(4, 12, Storage::Q8_0, 2));
    process(s, 0, 0, 40);
    ByteVec rows;
    s.draft(0, 40, rows);
    s.commit(0);
    auto snap = s.snapshot(0);
    s.restore(1, snap.data(), snap.size());
    CHECK(s.state(1).end == 40 && s.state(1).restage_owed);
    auto before = s.snapshot(1);
    for (std::size_t i = 0; i < snap.size(); ++i) {
        auto d = snap;
        d[i] ^= 0x10;
        CHECK_THROWS(s.restore(1, d.data(), d.size()), std::invalid_argument);
    }
    for (std::size_t k = 0; k < snap.size(); k += 5) CHECK_THROWS(s.restore(1, snap.data(), k), std::invalid_argument);
    auto longer = snap;
    longer.push_back(0);
    CHECK_THROWS(s.restore(1, longer.data(), longer.size()), std::invalid_argument);
    CHECK(s.snapshot(1) == before);
}

TEST_CASE(snapshot_into_a_buffer_and_restore_from_it) {
    Stager s(opts(4, 12, Storage::Q4_0, 3));
    process(s, 0, 0, 40);
    ByteVec rows;
    s.draft(0, 40, rows);
    s.commit(0);
    const std::size_t need = s.snapshot_size(0);
    const auto snap = s.snapshot(0);
    CHECK_EQ(need, snap.size());
    // Too small: rejected before anything is written.
    std::vector<std::uint8_t> buf(need + 8, 0xEE);
    CHECK_THROWS(s.snapshot_into(0, buf.data(), need - 1), std::invalid_argument);
    CHECK(buf[0] == 0xEE && buf[need - 2] == 0xEE);
    CHECK_EQ(s.snapshot_into(0, buf.data(), buf.size()), need);
    CHECK(std::memcmp(buf.data(), snap.data(), need) == 0);
    CHECK(buf[need] == 0xEE);  // nothing past the snapshot
    // Into an emptied slot (one pass) and into one still holding rows (checked first).
    process(s, 2, 0, 9, 0.5f);
    for (std::int64_t slot : {1, 2}) {
        s.restore(slot, buf.data(), need);
        CHECK(same_rows(s.snapshot(slot), snap));
        CHECK(s.state(slot).end == 40 && s.state(slot).horizon == s.state(0).horizon && s.state(slot).restage_owed);
    }
}

// snapshot_alloc sizes, allocates with no lock held, and sizes again when the
// sequence changed in between (here: the allocator itself appends rows, as
// another thread could); the bytes equal snapshot()'s, and a failed
// allocation is std::bad_alloc with nothing else changed.
TEST_CASE(snapshot_alloc_sizes_again_when_the_sequence_grew_in_between) {
    Stager s(opts(4, 12, Storage::Q8_0, 3));
    process(s, 0, 0, 5);  // fewer rows than the window keeps: 3 more grow the snapshot
    struct Ctx {
        Stager* st;
        int calls = 0;
        std::vector<std::uint8_t> buf;
    } ctx{&s};
    auto alloc = [](std::size_t n, void* c) -> std::uint8_t* {
        auto* x = static_cast<Ctx*>(c);
        if (x->calls++ == 0) process(*x->st, 0, 5, 3, 0.75f);  // the sequence grows before the write
        x->buf.assign(n, 0xEE);
        return x->buf.data();
    };
    const std::size_t before = s.snapshot_size(0);
    const std::size_t n = s.snapshot_alloc(0, alloc, &ctx);
    CHECK_EQ(ctx.calls, 2);
    CHECK(n > before);
    CHECK_EQ(n, ctx.buf.size());
    CHECK(ctx.buf == s.snapshot(0));
    auto refuse = [](std::size_t, void*) -> std::uint8_t* { return nullptr; };
    CHECK_THROWS(s.snapshot_alloc(0, refuse, nullptr), std::bad_alloc);
    CHECK_EQ(s.state(0).end, 8);
}

TEST_CASE(damaged_rows_leave_the_slot_untouched) {
    Stager s(opts(4, 12, Storage::F16, 3));
    process(s, 0, 0, 30);
    auto snap = s.snapshot(0);
    snap.back() ^= 0x01;  // the last row byte
    process(s, 1, 0, 5, 0.25f);  // a slot with rows
    s.begin(2);                  // an emptied slot (the one-pass path)
    for (std::int64_t slot : {1, 2}) {
        const auto before = s.snapshot(slot);
        const auto state = s.state(slot);
        CHECK_THROWS(s.restore(slot, snap.data(), snap.size()), std::invalid_argument);
        CHECK(s.snapshot(slot) == before);
        CHECK(s.state(slot).end == state.end && s.state(slot).started == state.started);
    }
    // The emptied slot still works after the rejected restore.
    process(s, 2, 0, 3, 0.75f);
    CHECK_EQ(s.state(2).end, 3);
}

TEST_CASE(snapshot_fingerprint_holds_the_nonfinite_policy) {
    StagerOptions zero = opts(4, 12);
    zero.nonfinite = NonFinite::Zero;
    Stager a(zero), b(opts(4, 12));
    process(a, 0, 0, 10);
    const auto snap = a.snapshot(0);
    process(b, 0, 0, 3);
    const auto before = b.snapshot(0);
    CHECK_THROWS(b.restore(0, snap.data(), snap.size()), std::invalid_argument);
    CHECK(b.snapshot(0) == before);
    Stager c(zero);
    c.restore(0, snap.data(), snap.size());
    CHECK(same_rows(c.snapshot(0), snap));
}

TEST_CASE(fork_is_independent_and_shift_moves_rows) {
    Stager s(opts(4, 16, Storage::F32, 2));
    process(s, 0, 0, 10);
    s.fork(0, 1);
    process(s, 0, 10, 2, 0.5f);
    process(s, 1, 10, 3, 0.75f);
    CHECK_EQ(s.state(0).end, 12);
    CHECK_EQ(s.state(1).end, 13);
    ByteVec rows;
    s.shift(1, 2, 4);  // drop [2, 6): 6.. move down by 4
    CHECK_EQ(s.state(1).end, 9);
    RoundPlan p = s.draft(1, 9, rows);
    CHECK(p.rebase);
    // The horizon stays at 0 (13 - W < 0): after the shift the stageable rows
    // are old [0, 2) and [6, 13) at [0, 9); the rebase keeps the newest K = 8.
    CHECK_EQ(p.n_rows, 8);
    CHECK(first_value(rows, 0) == 1.0f && first_value(rows, 1) == 6.0f && first_value(rows, 5) == 10.75f);
    CHECK_THROWS(s.fork(1, 0), StateError);  // open round on the source
    CHECK_THROWS(s.fork(0, 0), std::invalid_argument);
}

TEST_CASE(rollback_into_the_cache_owes_a_restage) {
    Stager s(opts(4, 16));
    process(s, 0, 0, 10);
    ByteVec rows;
    s.draft(0, 10, rows);
    s.commit(0);
    s.rollback(0, 7);
    CHECK(s.state(0).restage_owed);
    CHECK_EQ(s.state(0).end, 7);
    rows.clear();
    CHECK(s.draft(0, 7, rows).skip == Skip::NoContext);
}

// External-row mode: the owner's table, written at the returned slots and
// moved by the returned moves, holds at plan.slot_runs what a held Stager
// stages, across a ring wrap, a shift that moves rows and a fork.
TEST_CASE(external_rows_follow_slots_and_moves) {
    StagerOptions o = opts(3, 12, Storage::F32, 2);
    Stager held(o);
    o.rows = RowMode::External;
    Stager ext(o);
    CHECK_EQ(ext.ring_rows(), 12 + TRIM_CHUNK + 3 + 1);
    const std::size_t rb = ext.row_bytes();
    std::vector<std::uint8_t> table(static_cast<std::size_t>(2 * ext.ring_rows()) * rb, 0xa5);
    auto feed = [&](std::int64_t seq, std::int64_t from, std::int64_t n, float version) {
        auto r = rows_for(from, n, version);
        auto p = span(from, n);
        held.process(seq, p.data(), p.size(), r.data(), ElemType::F32);
        std::vector<std::int64_t> slots(p.size());
        ext.process_external(seq, p.data(), p.size(), slots.data());
        for (std::size_t i = 0; i < slots.size(); ++i)
            if (slots[i] >= 0) std::memcpy(table.data() + static_cast<std::size_t>(slots[i]) * rb, r.data() + i * D, rb);
    };
    auto apply = [&](const std::vector<SlotMove>& moves) {
        for (const SlotMove& m : moves) {
            CHECK(m.src + m.count <= m.dst || m.dst + m.count <= m.src);  // never overlapping
            std::memcpy(table.data() + static_cast<std::size_t>(m.dst) * rb,
                        table.data() + static_cast<std::size_t>(m.src) * rb, static_cast<std::size_t>(m.count) * rb);
        }
    };
    bool wrapped = false;
    auto round = [&](std::int64_t seq) {
        const std::int64_t end = held.state(seq).end;
        ByteVec hr, xr;
        const RoundPlan hp = held.draft(seq, end, hr), xp = ext.draft(seq, end, xr);
        CHECK(xr.size() == 0);  // no rows in external mode
        CHECK_EQ(hp.n_rows, xp.n_rows);
        std::size_t at = 0;
        for (const SlotRun& run : xp.slot_runs)
            for (std::int64_t k = 0; k < run.count; ++k, ++at)
                CHECK(std::memcmp(table.data() + static_cast<std::size_t>(run.first + k) * rb, hr.data() + at * rb, rb) == 0);
        CHECK_EQ(static_cast<std::int64_t>(at), xp.n_rows);
        wrapped = wrapped || xp.slot_runs[1].count > 0;
        if (hp.skip == Skip::None) {
            held.commit(seq);
            ext.commit(seq);
        }
    };
    feed(0, 0, 40, 0);
    for (int i = 0; i < 300; ++i) {
        round(0);
        feed(0, held.state(0).end, 4, 0.5f);
        held.accept(0, 3);
        ext.accept(0, 3);
    }
    CHECK(wrapped);
    const auto hm = held.shift(0, held.state(0).end - 4, 1), xm = ext.shift(0, ext.state(0).end - 4, 1);
    CHECK(!xm.empty() && xm.size() == hm.size());
    apply(xm);
    round(0);
    apply(ext.fork(0, 1));
    held.fork(0, 1);
    round(1);
    // External mode stages no bytes: draft_into never asks its sink for room.
    {
        feed(0, held.state(0).end, 2, 0.25f);
        const std::int64_t end = ext.state(0).end;
        const RoundPlan p = ext.draft_into(0, end, [](const RoundPlan*, std::size_t) -> std::uint8_t* {
            throw std::runtime_error("the sink must not be called in external-row mode");
        });
        CHECK(p.skip == Skip::None && p.n_rows == p.slot_runs[0].count + p.slot_runs[1].count);
        ext.commit(0);
    }
    // Rows in the wrong mode are an error, never silently accepted.
    auto p = span(ext.state(0).end, 1);
    auto r = rows_for(p[0], 1);
    CHECK_THROWS(ext.process(0, p.data(), 1, r.data(), ElemType::F32), std::invalid_argument);
    std::int64_t slot = 0;
    CHECK_THROWS(held.process_external(0, p.data(), 1, &slot), std::invalid_argument);
}

// The limits are the core's, checked by the Stager itself (a tampered Python
// config or a C++ caller gets the same ConfigError): the boundary is exact.
TEST_CASE(limits_are_checked_at_their_boundary) {
    StagerOptions o = opts(4, 20);
    o.max_seqs = MAX_SEQS_LIMIT;
    { Stager at_limit(o); CHECK_EQ(at_limit.state(MAX_SEQS_LIMIT - 1).end, 0); }
    o.max_seqs = MAX_SEQS_LIMIT + 1;
    CHECK_THROWS(Stager(o), ConfigError);
    o = opts(4, MAX_WINDOW + 1);
    CHECK_THROWS(Stager(o), ConfigError);
    o = opts(4, 20);
    o.feature_dim = MAX_FEATURE_DIM + 32;
    CHECK_THROWS(Stager(o), ConfigError);
    o = opts(4, 20);
    o.rows = static_cast<RowMode>(7);  // a cast the enum does not name
    CHECK_THROWS(Stager(o), ConfigError);
    o = opts(4, 20);
    o.stage = static_cast<ElemType>(3);
    CHECK_THROWS(Stager(o), ConfigError);
}

// docs/protocol.md section 3: a draft whose n_past is not the buffered end of
// a started, enabled sequence is out of protocol, whatever skip it would make.
TEST_CASE(strict_mode_refuses_every_out_of_protocol_draft) {
    StagerOptions o = opts(4, 200, Storage::F32, 2);
    o.strict = true;
    Stager s(o);
    ByteVec rows;
    // Not started: an ordinary "empty" skip, whatever n_past.
    CHECK(s.draft(0, 50, rows).skip == Skip::Empty);
    process(s, 0, 0, 109);  // newest row 108
    CHECK(s.draft(0, 109, rows).skip == Skip::None);
    s.commit(0);
    const SeqStats before = s.stats(0);
    CHECK_THROWS(s.draft(0, 50, rows), StateError);   // lagging: was a silent no_context skip
    CHECK_THROWS(s.draft(0, 111, rows), StateError);  // ahead: a missing process
    CHECK_THROWS(s.peek(0, 50), StateError);          // peek makes draft's checks
    const std::int64_t seqs[] = {1, 0};
    const std::int64_t pasts[] = {0, 50};
    std::vector<RoundPlan> plans;
    CHECK_THROWS(s.draft_many(seqs, pasts, 2, plans, rows), StateError);
    CHECK_EQ(s.stats(0).skips, before.skips);  // nothing counted: nothing happened
    // The argument's own range comes first (design.md 2.1), then strict mode.
    CHECK_THROWS(s.draft(0, MAX_POSITION, rows), std::invalid_argument);
    // Legitimate skips stay legitimate: at the end after a commit, and at
    // exactly n_past after a rollback into the cache.
    CHECK(s.draft(0, 109, rows).skip == Skip::NoContext);
    s.rollback(0, 100);
    CHECK(s.draft(0, 100, rows).skip == Skip::NoContext);
    process(s, 0, 100, 1);
    CHECK(s.draft(0, 101, rows).skip == Skip::None);
}

TEST_CASE(a_mismatch_is_reported_once_per_sequence_until_begin) {
    Stager s(opts(4, 200, Storage::F32, 2));
    ByteVec rows;
    process(s, 0, 0, 109);
    CHECK(s.draft(0, 109, rows).skip == Skip::None);
    s.commit(0);
    const RoundPlan lag = s.draft(0, 50, rows);
    CHECK(lag.skip == Skip::NoContext && lag.mismatch && lag.report_mismatch && lag.end == 109);
    const RoundPlan again = s.draft(0, 120, rows);
    CHECK(again.skip == Skip::MissingRows && again.mismatch && !again.report_mismatch);
    CHECK(mismatch_cause(50, 109).find("rows 50..108 are still buffered") == 0);
    CHECK(mismatch_cause(120, 109).find("rows 109..119 were never processed") == 0);
    const RoundPlan fine = s.draft(0, 109, rows);  // an ordinary no_context skip
    CHECK(fine.skip == Skip::NoContext && !fine.mismatch);
    s.begin(0);
    process(s, 0, 0, 3);
    CHECK(s.draft(0, 7, rows).report_mismatch);  // begin re-arms the report
}

// A draft_view's runs outlive the ring they came from: end() releases the
// sequence's bytes and destroying the Stager frees the rest, but `keep` holds
// the view's bytes (ASan would report a read of freed memory here).
TEST_CASE(a_row_view_keeps_its_bytes_alive_past_end_and_destruction) {
    std::vector<std::uint8_t> copied;
    RowView view;
    {
        Stager s(opts(4, 16, Storage::F32, 3));
        process(s, 0, 0, 12);
        process(s, 1, 0, 12);
        ByteVec rows;
        RoundPlan p = s.draft(0, 12, rows);  // the copy, for comparison
        copied.assign(rows.begin(), rows.end());
        RoundPlan v = s.draft_view(1, 12, view);
        CHECK_EQ(v.n_rows, p.n_rows);
        CHECK_EQ(view.rows[0], static_cast<std::size_t>(p.n_rows));
        CHECK(view.keep != nullptr);
        s.end(1);
        process(s, 2, 0, 12, 5.0f);  // other rows, in another ring
    }
    CHECK_EQ(copied.size(), view.rows[0] * D * 4);
    CHECK(std::memcmp(view.data[0], copied.data(), copied.size()) == 0);
    float first;
    std::memcpy(&first, view.data[0], 4);
    CHECK_EQ(first, 0.0f);  // position 0's row
}

TEST_MAIN()

// Drafting per request: disable skips every draft with DraftingOff while rows
// keep flowing (and trimming); enable drafts at once, rebasing when the rows
// outgrew the window meanwhile. The switch survives a cancelled reservation,
// is copied by fork, carried by snapshots, cleared by begin; a batch with a
// bad id changes nothing.
TEST_CASE(drafting_off_skips_while_rows_flow_and_enable_drafts_at_once) {
    Stager s(opts(4, 12, Storage::Q8_0, 3));
    process(s, 0, 0, 10);
    ByteVec rows;
    RoundPlan p = s.draft(0, 10, rows);
    CHECK(p.skip == Skip::None);
    s.commit(0);
    s.disable(0);
    s.disable(0);  // idempotent
    CHECK(s.state(0).drafting_off);
    const std::int64_t skips = s.stats(0).skips;
    p = s.draft(0, 10, rows);
    CHECK(p.skip == Skip::DraftingOff);
    CHECK(std::string(skip_name(Skip::DraftingOff)) == "drafting_off");
    CHECK_EQ(s.stats(0).skips, skips + 1);
    process(s, 0, 10, 200);  // rows keep flowing, the ring keeps its bound
    CHECK_EQ(s.state(0).end, 210);
    CHECK(s.stats(0).peak_rows <= 12 + TRIM_CHUNK + 4 + 1);
    // Snapshots carry it; fork copies it.
    const auto snap = s.snapshot(0);
    s.restore(1, snap.data(), snap.size());
    CHECK(s.state(1).drafting_off);
    s.fork(0, 2);
    CHECK(s.state(2).drafting_off);
    // A batch naming an unknown id changes nothing.
    const std::int64_t bad[] = {1, 7};
    CHECK_THROWS(s.enable_many(bad, 2), std::invalid_argument);
    CHECK(s.state(1).drafting_off);
    const std::int64_t both[] = {1, 2};
    s.enable_many(both, 2);
    CHECK(!s.state(1).drafting_off && !s.state(2).drafting_off);
    // enable: the next draft plans at once, a rebase onto the newest rows.
    s.enable(0);
    p = s.draft(0, 210, rows);
    CHECK(p.skip == Skip::None);
    CHECK(p.rebase && p.clear_cache);
    CHECK_EQ(p.start - p.first_row, w_keep(4, 12));
    s.commit(0);
    // begin clears it (the switch is the request's).
    s.disable(0);
    s.begin(0);
    CHECK(!s.state(0).drafting_off);
}

TEST_CASE(drafting_off_survives_a_cancelled_reservation) {
    StagerOptions o = opts(4, 12, Storage::F32, 1);
    o.rows = RowMode::External;
    Stager s(o);
    std::int64_t pos[5] = {0, 1, 2, 3, 4}, slots[5];
    s.process_external(0, pos, 5, slots);
    std::int64_t more[2] = {5, 6};
    s.reserve(0, more, 2, slots);
    s.disable(0);
    s.cancel(0);
    CHECK(s.state(0).drafting_off);
    ByteVec rows;
    CHECK(s.draft(0, 5, rows).skip == Skip::DraftingOff);
    // A fresh sequence's snapshot with the switch on restores as such.
    Stager t(o);
    t.disable(0);
    const auto snap = t.snapshot(0);
    s.restore(0, snap.data(), snap.size());
    CHECK(s.state(0).drafting_off && !s.state(0).started);
}

// The acceptance metrics: a round counts in the histogram once, at the first
// accept after its commit that acts; plain decodes, failed rounds and
// rollbacks count nothing. The Stager's totals keep the counters of
// sequences whose stats reset (begin, fork into, restore) and never go back.
TEST_CASE(accepted_histogram_counts_verified_rounds_and_totals_stay_monotonic) {
    const std::int64_t B = 4;
    Stager s(opts(B, 12, Storage::F16, 2));
    ByteVec rows;
    process(s, 0, 0, 6);
    auto round = [&](std::int64_t n_past, std::int64_t accepted) {  // draft, commit, verify, accept
        CHECK(s.draft(0, n_past, rows).skip == Skip::None);
        s.commit(0);
        process(s, 0, n_past, B + 1);
        s.accept(0, accepted);
        return n_past + accepted + 1;
    };
    std::int64_t n = round(6, 2);
    n = round(n, 0);
    n = round(n, 2);
    s.accept(0, 3);  // no new rows since: acts on nothing, counts nothing
    process(s, 0, n, 1);  // a plain decode: the accept after it counts nothing
    s.accept(0, 0);
    n += 1;
    CHECK(s.draft(0, n, rows).skip == Skip::None);
    s.fail(0, FailStage::Decode);  // a failed round is never verified
    process(s, 0, n, B + 1);
    s.accept(0, B);
    n += B + 1;
    CHECK(s.draft(0, n, rows).skip == Skip::None);
    s.commit(0);
    s.rollback(0, n - 1);  // the round's verify is gone with its rows
    process(s, 0, n - 1, B + 1);
    s.accept(0, 1);
    // A committed round whose verify never came, then a new round that fails:
    // the accept after it verifies neither.
    n = s.state(0).end;
    CHECK(s.draft(0, n, rows).skip == Skip::None);
    s.commit(0);
    process(s, 0, n, 1);
    CHECK(s.draft(0, n + 1, rows).skip == Skip::None);
    s.fail(0, FailStage::Crop);
    process(s, 0, n + 1, B + 1);
    s.accept(0, 2);
    // A committed round whose verify never came, then a skipped draft and a
    // plain decode: its accept is the decode's, not the round's.
    n = s.state(0).end;
    CHECK(s.draft(0, n, rows).skip == Skip::None);
    s.commit(0);
    s.disable(0);
    CHECK(s.draft(0, n, rows).skip == Skip::DraftingOff);
    s.enable(0);
    process(s, 0, n, 1);
    s.accept(0, 0);
    // A shift drops the verify of the round committed before it.
    n = s.state(0).end;
    CHECK(s.draft(0, n, rows).skip == Skip::None);
    s.commit(0);
    s.shift(0, 1, 2);
    process(s, 0, n - 2, B + 1);
    s.accept(0, 3);
    const std::vector<std::int64_t> want = {1, 0, 2, 0, 0};
    CHECK(s.accepted(0) == want);
    SeqStats st = s.stats(0);
    CHECK_EQ(st.verified_rounds, 3);
    CHECK_EQ(st.accepted_tokens, 4);
    // Skips by reason: missing_rows (n_past behind the rows), drafting_off.
    CHECK(s.draft(0, 3, rows).skip != Skip::None);
    s.disable(0);
    CHECK(s.draft(0, s.state(0).end, rows).skip == Skip::DraftingOff);
    st = s.stats(0);
    CHECK_EQ(st.skips_drafting_off, 2);
    CHECK_EQ(st.skips, st.skips_disabled + st.skips_empty + st.skips_no_context + st.skips_missing_rows +
                           st.skips_drafting_off);
    // Totals: sequence 0's counters, then kept across fork (into 1), begin and end.
    StagerTotals t0 = s.totals();
    CHECK(t0.accepted == want);
    CHECK_EQ(t0.started, 1);
    CHECK_EQ(t0.stats.rounds, st.rounds);
    CHECK_EQ(t0.stats.rows, st.rows);
    // A fork between a commit and its verify: the child's first accept counts nothing.
    s.enable(0);
    n = s.state(0).end;
    CHECK(s.draft(0, n, rows).skip == Skip::None);
    s.commit(0);
    s.fork(0, 1);
    process(s, 1, n, B + 1);
    s.accept(1, 2);
    CHECK(s.accepted(1) == std::vector<std::int64_t>(B + 1, 0));
    const std::int64_t peak0 = s.stats(0).peak_rows;
    s.begin(0);
    CHECK(s.accepted(0) == std::vector<std::int64_t>(B + 1, 0));
    const StagerTotals t1 = s.totals();
    CHECK(t1.accepted == want);
    CHECK_EQ(t1.stats.rounds, st.rounds + 1);
    CHECK_EQ(t1.stats.skips_drafting_off, 2);
    CHECK_EQ(t1.stats.peak_rows, std::max(peak0, s.stats(1).peak_rows));  // the largest any sequence held
    CHECK_EQ(t1.stats.rows, s.stats(1).rows);           // gauges: the live sequences only
    s.end(1);
    CHECK_EQ(s.totals().stats.rows, 0);
    CHECK_EQ(s.totals().stats.restaged_rows, t1.stats.restaged_rows);
}
