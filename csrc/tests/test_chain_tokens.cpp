// A chain drafter's Stager (DrafterKind::Chain): the token id kept beside
// each row follows the row through every call that moves, drops, copies or
// restores rows, in both row modes. Every row's id is a function of the
// position it was processed at (ID_BASE + p), so an id that stayed behind
// when its row moved, or moved without it, shows as a mismatch.
#include <cstdint>
#include <map>
#include <stdexcept>
#include <vector>

#include "check.hpp"
#include "dspark/errors.hpp"
#include "dspark/stager.hpp"

using namespace dspark;

namespace {

constexpr std::int64_t D = 32, B = 3, W = 16;
constexpr std::int32_t ID_BASE = 1000;

StagerOptions chain_opts(RowMode mode, std::int64_t seqs = 2) {
    StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    o.max_seqs = seqs;
    o.rows = mode;
    o.kind = DrafterKind::Chain;
    return o;
}

std::vector<std::int64_t> span(std::int64_t from, std::int64_t n) {
    std::vector<std::int64_t> v;
    for (std::int64_t i = 0; i < n; ++i) v.push_back(from + i);
    return v;
}

// The ids of `positions` (the oracle's).
std::vector<std::int32_t> ids_of(const std::vector<std::int64_t>& positions, std::int32_t base = ID_BASE) {
    std::vector<std::int32_t> v;
    for (std::int64_t p : positions) v.push_back(base + static_cast<std::int32_t>(p));
    return v;
}

// Appends rows at [from, from + n) with their ids (either mode).
void feed(Stager& s, std::int64_t seq, std::int64_t from, std::int64_t n, std::int32_t base = ID_BASE) {
    const auto pos = span(from, n);
    const auto ids = ids_of(pos, base);
    if (s.external()) {
        std::vector<std::int64_t> slots(pos.size());
        s.process_external(seq, pos.data(), pos.size(), slots.data(), ids.data());
    } else {
        std::vector<float> rows(static_cast<std::size_t>(n * D), 0.5f);
        s.process(seq, pos.data(), pos.size(), rows.data(), ElemType::F32, ids.data());
    }
}

// The ids kept for the stageable rows, and the positions they cover.
std::vector<std::int32_t> kept(const Stager& s, std::int64_t seq) {
    const SeqState st = s.state(seq);
    std::vector<std::int32_t> out(static_cast<std::size_t>(st.end - st.horizon), -7);
    s.tokens(seq, st.horizon, st.end, out.data());
    return out;
}

std::vector<std::int64_t> live(const Stager& s, std::int64_t seq) {
    const SeqState st = s.state(seq);
    return span(st.horizon, st.end - st.horizon);
}

// Rounds of B + 1 rows, accepting `acc` each: the window rebases and the
// ring wraps and trims several times.
void rounds(Stager& s, std::int64_t seq, int n, std::int64_t acc) {
    for (int r = 0; r < n; ++r) {
        const std::int64_t end = s.state(seq).end;
        ByteVec staged;
        (void)s.draft(seq, end, staged);
        s.commit(seq);
        feed(s, seq, end, B + 1);
        s.accept(seq, acc);
    }
}

void each_mode(void (*body)(RowMode)) {
    body(RowMode::Held);
    body(RowMode::External);
}

}  // namespace

TEST_CASE(ids_follow_their_rows_through_rounds_trims_and_accepts) {
    each_mode([](RowMode mode) {
        Stager s(chain_opts(mode));
        s.begin(0);
        feed(s, 0, 0, 10);
        CHECK(kept(s, 0) == ids_of(live(s, 0)));
        rounds(s, 0, 40, 1);  // past several windows and ring wraps
        CHECK(s.state(0).end > 3 * W);
        CHECK(kept(s, 0) == ids_of(live(s, 0)));
        s.rollback(0, s.state(0).end - 2);
        CHECK(kept(s, 0) == ids_of(live(s, 0)));
    });
}

TEST_CASE(shift_fork_and_restore_carry_the_ids) {
    each_mode([](RowMode mode) {
        Stager s(chain_opts(mode));
        s.begin(0);
        feed(s, 0, 0, 12);
        // shift: positions [4, 7) go, the rows after them move down by 3 with their ids.
        (void)s.shift(0, 4, 3);
        std::vector<std::int32_t> want;
        for (std::int64_t p : live(s, 0)) want.push_back(ID_BASE + static_cast<std::int32_t>(p < 4 ? p : p + 3));
        CHECK(kept(s, 0) == want);
        // fork: the child holds the parent's ids.
        s.begin(1);
        feed(s, 1, 0, 5, 50);  // replaced by the fork
        (void)s.fork(0, 1);
        CHECK(kept(s, 1) == want);
        // snapshot -> restore into the other sequence (migration's path).
        s.begin(1);
        const auto snap = s.snapshot(0);
        s.restore(1, snap.data(), snap.size());
        CHECK(kept(s, 1) == want);
        CHECK(s.snapshot(1) == snap);
        // a damaged id is a checksum mismatch, and the sequence stays as it was.
        auto bad = snap;
        bad[bad.size() - 1] ^= 0x40;
        CHECK_THROWS(s.restore(1, bad.data(), bad.size()), std::invalid_argument);
        CHECK_THROWS(s.check_restore(1, bad.data(), bad.size()), std::invalid_argument);
        CHECK(kept(s, 1) == want);
    });
}

TEST_CASE(snapshots_of_the_other_kind_are_refused) {
    StagerOptions block = chain_opts(RowMode::Held);
    block.kind = DrafterKind::Block;
    Stager b(block), c(chain_opts(RowMode::Held));
    b.begin(0);
    c.begin(0);
    std::vector<float> rows(4 * D, 0.25f);
    const auto pos = span(0, 4);
    b.process(0, pos.data(), pos.size(), rows.data(), ElemType::F32);
    feed(c, 0, 0, 4);
    const auto from_block = b.snapshot(0), from_chain = c.snapshot(0);
    CHECK_EQ(from_chain.size(), from_block.size() + 4 * sizeof(std::int32_t));
    CHECK_THROWS(c.restore(0, from_block.data(), from_block.size()), std::invalid_argument);
    CHECK_THROWS(b.restore(0, from_chain.data(), from_chain.size()), std::invalid_argument);
    CHECK(kept(c, 0) == ids_of(span(0, 4)));
}

TEST_CASE(token_arguments_are_checked_before_anything_changes) {
    each_mode([](RowMode mode) {
        Stager s(chain_opts(mode));
        s.begin(0);
        feed(s, 0, 0, 4);
        const auto pos = span(4, 2);
        std::vector<float> rows(2 * D, 0.5f);
        std::vector<std::int64_t> slots(2);
        const std::vector<std::int32_t> negative = {7, -1};
        if (mode == RowMode::Held) {
            CHECK_THROWS(s.process(0, pos.data(), 2, rows.data(), ElemType::F32), std::invalid_argument);
            CHECK_THROWS(s.process(0, pos.data(), 2, rows.data(), ElemType::F32, negative.data()),
                         std::invalid_argument);
        } else {
            CHECK_THROWS(s.process_external(0, pos.data(), 2, slots.data()), std::invalid_argument);
            CHECK_THROWS(s.process_external(0, pos.data(), 2, slots.data(), negative.data()), std::invalid_argument);
            CHECK_THROWS(s.reserve(0, pos.data(), 2, slots.data()), std::invalid_argument);
        }
        CHECK_EQ(s.state(0).end, 4);
        const std::int64_t parents[2] = {-1, 0};
        const std::int32_t tree_ids[2] = {5, 6};
        CHECK_THROWS(s.check_process_tree(0, 4, parents, 2, tree_ids), StateError);  // no draft since
        ByteVec staged;
        (void)s.draft(0, 4, staged);
        s.commit(0);
        CHECK_THROWS(s.check_process_tree(0, 4, parents, 2), std::invalid_argument);  // a tree's nodes need ids too
        CHECK_THROWS(s.check_process_tree(0, 4, parents, 2, negative.data()), std::invalid_argument);
        s.check_process_tree(0, 4, parents, 2, tree_ids);

        std::int32_t out[2];
        CHECK_THROWS(s.tokens(0, 3, 5, out), std::invalid_argument);  // past the end
        CHECK_THROWS(s.tokens(5, 0, 1, out), std::invalid_argument);  // no such sequence
    });
    StagerOptions block = chain_opts(RowMode::Held);
    block.kind = DrafterKind::Block;
    Stager b(block);
    b.begin(0);
    const auto pos = span(0, 2);
    std::vector<float> rows(2 * D, 0.5f);
    const std::vector<std::int32_t> ids = {1, 2};
    CHECK_THROWS(b.process(0, pos.data(), 2, rows.data(), ElemType::F32, ids.data()), std::invalid_argument);
    std::int32_t out[1];
    CHECK_THROWS(b.tokens(0, 0, 0, out), std::invalid_argument);
    CHECK_EQ(b.state(0).end, 0);
}

TEST_CASE(batched_process_keeps_each_sequences_ids) {
    each_mode([](RowMode mode) {
        Stager s(chain_opts(mode));
        s.begin(0);
        s.begin(1);
        const std::int64_t seqs[2] = {1, 0}, cu[3] = {0, 3, 5};
        const std::vector<std::int64_t> pos = {0, 1, 2, 0, 1};
        const std::vector<std::int32_t> ids = {11, 12, 13, 21, 22}, bad = {11, 12, 13, 21, -22};
        std::vector<float> rows(5 * D, 0.5f);
        std::vector<std::int64_t> slots(5);
        auto call = [&](const std::int32_t* t) {
            if (mode == RowMode::Held) s.process_many(seqs, 2, cu, pos.data(), 5, rows.data(), ElemType::F32, t);
            else s.process_external_many(seqs, 2, cu, pos.data(), 5, slots.data(), "process_external_many", t);
        };
        CHECK_THROWS(call(bad.data()), std::invalid_argument);  // the whole batch is refused
        CHECK_EQ(s.state(1).end, 0);
        call(ids.data());
        CHECK(kept(s, 1) == (std::vector<std::int32_t>{11, 12, 13}));
        CHECK(kept(s, 0) == (std::vector<std::int32_t>{21, 22}));
    });
}

TEST_MAIN()
