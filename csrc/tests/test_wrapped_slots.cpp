// Rings that wrap, on sequences other than 0, in both row modes: the second
// slot run keeps the sequence's base, a fork from a wrapped parent sends each
// of its two runs to its own child slots, and a restore over a busy (wrapped)
// slot survives damaged data and then lands. The layout is built exactly:
// W = 64, B = 4 (a ring of 581 slots), 600 positions fed 64 at a time leave
// the live rows 536..599 in ring slots 536..580 and then 0..18.
#include <cstring>
#include <vector>

#include "check.hpp"
#include "dspark/stager.hpp"

using namespace dspark;

namespace {

constexpr std::int64_t D = 32, B = 4, W = 64, SEQS = 4;
constexpr std::int64_t RING = W + TRIM_CHUNK + B + 1;
constexpr std::int64_t FED = 600, CHUNK = 64, HEAD = 536;
constexpr std::int64_t FIRST_RUN = RING - HEAD, SECOND_RUN = FED - RING;  // 45 and 19 rows

StagerOptions opts(RowMode mode) {
    StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    o.max_seqs = SEQS;
    o.rows = mode;
    return o;
}

// Rows that name their sequence and position.
std::vector<float> rows_for(std::int64_t seq, std::int64_t from, std::int64_t n) {
    std::vector<float> r(static_cast<std::size_t>(n * D));
    for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t c = 0; c < D; ++c)
            r[static_cast<std::size_t>(i * D + c)] = float(seq) * 1e4f + float(from + i) + 0.001f * float(c);
    return r;
}

// The held core (oracle of the rows) and the external core with its owner's table.
struct Pair {
    Stager held{opts(RowMode::Held)};
    Stager ext{opts(RowMode::External)};
    std::size_t rb = held.row_bytes();
    std::vector<std::uint8_t> table = std::vector<std::uint8_t>(static_cast<std::size_t>(SEQS * RING) * rb, 0xa5);

    void feed(std::int64_t seq, std::int64_t from, std::int64_t to) {
        for (std::int64_t a = from; a < to; a += CHUNK) {
            const std::int64_t n = std::min(CHUNK, to - a);
            std::vector<std::int64_t> pos(static_cast<std::size_t>(n)), slots(pos.size());
            for (std::int64_t i = 0; i < n; ++i) pos[static_cast<std::size_t>(i)] = a + i;
            const auto r = rows_for(seq, a, n);
            held.process(seq, pos.data(), pos.size(), r.data(), ElemType::F32);
            ext.process_external(seq, pos.data(), pos.size(), slots.data());
            for (std::size_t i = 0; i < slots.size(); ++i)
                if (slots[i] >= 0) std::memcpy(table.data() + static_cast<std::size_t>(slots[i]) * rb, r.data() + i * D, rb);
        }
    }
    void apply(const std::vector<SlotMove>& moves) {
        for (const SlotMove& m : moves) {
            CHECK(m.src + m.count <= m.dst || m.dst + m.count <= m.src);
            std::memcpy(table.data() + static_cast<std::size_t>(m.dst) * rb,
                        table.data() + static_cast<std::size_t>(m.src) * rb, static_cast<std::size_t>(m.count) * rb);
        }
    }
    // Drafts at the end in both modes: the same slot runs, and the table's rows
    // at them are the held core's staged rows. Returns the plan.
    RoundPlan round(std::int64_t seq) {
        const std::int64_t end = held.state(seq).end;
        ByteVec hr, xr;
        const RoundPlan hp = held.draft(seq, end, hr), xp = ext.draft(seq, end, xr);
        CHECK(hp.skip == Skip::None && xp.skip == Skip::None);
        std::size_t at = 0;
        for (int k = 0; k < 2; ++k) {
            CHECK_EQ(hp.slot_runs[k].first, xp.slot_runs[k].first);
            CHECK_EQ(hp.slot_runs[k].count, xp.slot_runs[k].count);
            for (std::int64_t i = 0; i < xp.slot_runs[k].count; ++i, ++at)
                CHECK(std::memcmp(table.data() + static_cast<std::size_t>(xp.slot_runs[k].first + i) * rb,
                                  hr.data() + at * rb, rb) == 0);
        }
        CHECK_EQ(static_cast<std::int64_t>(at), hp.n_rows);
        held.commit(seq);
        ext.commit(seq);
        return xp;
    }
};

}  // namespace

TEST_CASE(second_run_of_a_wrapped_ring_keeps_the_sequence_base) {
    for (std::int64_t seq : {1, 3}) {
        Pair p;
        p.feed(seq, 0, FED);
        for (Stager* st : {&p.held, &p.ext}) {
            SlotRun live[2];
            st->live_slots(seq, live);
            CHECK_EQ(live[0].first, seq * RING + HEAD);
            CHECK_EQ(live[0].count, FIRST_RUN);
            CHECK_EQ(live[1].first, seq * RING);  // the sequence's first slot, not slot 0
            CHECK_EQ(live[1].count, SECOND_RUN);
        }
        // The rebase stages the newest K = 32 rows, 568..599: across the ring's end.
        const RoundPlan r = p.round(seq);
        CHECK_EQ(r.slot_runs[0].first, seq * RING + 568);
        CHECK_EQ(r.slot_runs[1].first, seq * RING);
        CHECK_EQ(r.slot_runs[1].count, SECOND_RUN);
    }
}

TEST_CASE(fork_of_a_wrapped_parent_sends_each_run_to_its_own_child_slots) {
    const std::int64_t pairs[][2] = {{1, 2}, {2, 0}, {0, 3}};
    for (const auto& pc : pairs) {
        const std::int64_t parent = pc[0], child = pc[1];
        Pair p;
        p.feed(child, 0, 30);  // replaced by the fork
        p.feed(parent, 0, FED);
        const auto hm = p.held.fork(parent, child), xm = p.ext.fork(parent, child);
        for (const auto* m : {&hm, &xm}) {
            CHECK_EQ(m->size(), std::size_t(2));
            if (m->size() != 2) continue;
            CHECK_EQ((*m)[0].src, parent * RING + HEAD);
            CHECK_EQ((*m)[0].dst, child * RING);
            CHECK_EQ((*m)[0].count, FIRST_RUN);
            CHECK_EQ((*m)[1].src, parent * RING);
            CHECK_EQ((*m)[1].dst, child * RING + FIRST_RUN);  // after the first run, not on it
            CHECK_EQ((*m)[1].count, SECOND_RUN);
        }
        p.apply(xm);
        p.round(child);   // the child's rows, read from its own slots, are the parent's
        p.round(parent);  // and the parent is untouched
    }
}

TEST_CASE(restore_over_a_wrapped_busy_slot_survives_damage_then_lands) {
    Pair p;
    p.feed(2, 300, 420);
    p.feed(1, 0, FED);  // busy and wrapped: live rows in slots 536..580 and 0..18
    p.feed(3, 0, 50);   // busy, rows at the front
    const auto snap = p.held.snapshot(2);
    const auto before = p.held.snapshot(1);
    for (std::size_t at : {std::size_t(96 + 5), snap.size() - 7}) {
        auto bad = snap;
        bad[at] ^= 0x20;
        CHECK_THROWS(p.held.restore(1, bad.data(), bad.size()), std::invalid_argument);
        CHECK(p.held.snapshot(1) == before);
    }
    p.held.restore(1, snap.data(), snap.size());
    const auto after = p.held.snapshot(1), again = p.held.snapshot(2);
    CHECK(std::memcmp(after.data() + 96, again.data() + 96, after.size() - 96) == 0 && after.size() == again.size());
    // And again, into the other busy slot: the ring slot 1 gave up is the spare now.
    p.held.restore(3, snap.data(), snap.size());
    const auto third = p.held.snapshot(3);
    CHECK(third.size() == snap.size() && std::memcmp(third.data() + 96, snap.data() + 96, snap.size() - 96) == 0);
    CHECK(p.held.snapshot(1) == after);
}

TEST_MAIN()
