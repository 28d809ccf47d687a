// Tests of the C ABI's batch calls (dspark_*_many), reservations and a
// request's end: a server loop driven through the batch calls equals the
// same loop through the per-sequence calls (plans, rows, slots, failures,
// snapshots and state after every step, both row modes), and a rejected batch
// returns the C++ Stager's error (its status and its exact message, the
// oracle being a C++ Stager in the same state) and changes nothing.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "c_api_common.hpp"
#include "check.hpp"
#include "dspark/dspark.h"
#include "dspark/errors.hpp"
#include "dspark/stager.hpp"

namespace {

using c_api_test::D, c_api_test::Handle, c_api_test::rows_for, c_api_test::snap, c_api_test::span;
constexpr std::int64_t B = 7, W = 20, SEQS = 6;

dspark_config config(std::int32_t rows_mode, std::int32_t storage = DSPARK_STORAGE_F32) {
    dspark_config c;
    dspark_config_init(&c);
    c.feature_dim = D;
    c.block_size = B;
    c.window = W;
    c.max_seqs = SEQS;
    c.storage = storage;
    c.rows_mode = rows_mode;
    return c;
}

dspark::StagerOptions options(std::int32_t rows_mode) {
    dspark::StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    o.max_seqs = SEQS;
    o.rows = rows_mode == DSPARK_ROWS_EXTERNAL ? dspark::RowMode::External : dspark::RowMode::Held;
    return o;
}

// Every sequence's state and snapshot: what "changes nothing" compares.
std::vector<std::vector<std::uint8_t>> everything(dspark_stager* st) {
    std::vector<std::vector<std::uint8_t>> all;
    for (std::int64_t q = 0; q < SEQS; ++q) {
        dspark_state s;
        dspark_state_init(&s);
        CHECK_EQ(dspark_state_get(st, q, &s), DSPARK_OK);
        const auto* b = reinterpret_cast<const std::uint8_t*>(&s);
        all.emplace_back(b, b + sizeof s);
        all.push_back(snap(st, q));
    }
    return all;
}

std::int64_t end_of(dspark_stager* st, std::int64_t seq) {
    dspark_state s;
    dspark_state_init(&s);
    CHECK_EQ(dspark_state_get(st, seq, &s), DSPARK_OK);
    return s.end;
}

bool same_plan(const dspark_plan& a, const dspark_plan& b) {
    return std::memcmp(&a, &b, sizeof a) == 0;
}

// The status the C ABI gives for the C++ error being handled.
dspark_status status_of_current() {
    switch (dspark::classify_current_error().kind) {
#define DSPARK_TEST_STATUS(k, c_status, python) \
    case dspark::ErrorKind::k: return DSPARK_E_##c_status;
        DSPARK_ERROR_KINDS(DSPARK_TEST_STATUS)
#undef DSPARK_TEST_STATUS
    }
    return DSPARK_E_INTERNAL;
}

// A C call that must fail exactly as the C++ call `cpp` throws (status and
// message), changing nothing in the handle.
void rejects_like_cpp(dspark_stager* st, const std::function<dspark_status()>& c_call,
                      const std::function<void()>& cpp, const char* what) {
    std::string want;
    dspark_status want_status = DSPARK_OK;
    try {
        cpp();
    } catch (...) {
        want_status = status_of_current();
        want = dspark::classify_current_error().what;
    }
    const auto before = everything(st);
    const dspark_status got = c_call();
    if (got != want_status || want != dspark_last_error() || want_status == DSPARK_OK)
        std::printf("  %s: C gave %s \"%s\", C++ %s \"%s\"\n", what, dspark_status_name(got), dspark_last_error(),
                    dspark_status_name(want_status), want.c_str());
    CHECK(want_status != DSPARK_OK);
    CHECK_EQ(got, want_status);
    CHECK(want == dspark_last_error());
    CHECK(everything(st) == before);
}

// A step of a server loop for the active sequences `act`, in both handles:
// `batch` through the *_many calls, `single` through one call per sequence.
// Each sequence verifies 1 + k rows (k varies), accepts some of them, drafts
// at its end (`view`: dspark_draft_many_view, whose runs must hold the rows
// dspark_draft copies), and commits or fails (fail every fifth). Compares
// what each call hands out.
// Returns the rounds it committed and failed.
std::pair<std::size_t, std::size_t> step(dspark_stager* batch, dspark_stager* single,
                                         const std::vector<std::int64_t>& act, int t, bool external, bool reserve,
                                         bool view) {
    const std::size_t n = act.size();
    std::vector<std::int64_t> cu{0}, pos;
    std::vector<float> rows;
    for (std::int64_t q : act) {
        const std::int64_t e = end_of(single, q), k = 1 + (t * 3 + q) % B;
        const auto p = span(e, k);
        const auto r = rows_for(e, k, t + 1);
        pos.insert(pos.end(), p.begin(), p.end());
        rows.insert(rows.end(), r.begin(), r.end());
        cu.push_back(static_cast<std::int64_t>(pos.size()));
    }
    const std::size_t total = pos.size();
    std::vector<std::int64_t> slots(total, -7), slots1(total, -7);
    if (external && reserve) {
        CHECK_EQ(dspark_reserve_many(batch, act.data(), n, cu.data(), pos.data(), total, slots.data()), DSPARK_OK);
        CHECK_EQ(dspark_confirm_many(batch, act.data(), n), DSPARK_OK);
    } else if (external) {
        CHECK_EQ(dspark_process_external_many(batch, act.data(), n, cu.data(), pos.data(), total, slots.data()),
                 DSPARK_OK);
    } else {
        CHECK_EQ(dspark_process_many(batch, act.data(), n, cu.data(), pos.data(), total, rows.data(),
                                     DSPARK_DTYPE_F32, rows.size() * sizeof(float)),
                 DSPARK_OK);
    }
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t a = static_cast<std::size_t>(cu[i]), k = static_cast<std::size_t>(cu[i + 1]) - a;
        if (external)
            CHECK_EQ(dspark_process_external(single, act[i], pos.data() + a, k, slots1.data() + a), DSPARK_OK);
        else
            CHECK_EQ(dspark_process(single, act[i], pos.data() + a, k, rows.data() + a * D, DSPARK_DTYPE_F32,
                                    k * D * sizeof(float)),
                     DSPARK_OK);
    }
    CHECK(slots == slots1);

    std::vector<std::int64_t> acc(n);
    for (std::size_t i = 0; i < n; ++i) acc[i] = (t + act[i]) % (cu[i + 1] - cu[i]);
    CHECK_EQ(dspark_accept_many(batch, act.data(), acc.data(), n), DSPARK_OK);
    for (std::size_t i = 0; i < n; ++i) CHECK_EQ(dspark_accept(single, act[i], acc[i]), DSPARK_OK);

    std::vector<std::int64_t> past(n);
    for (std::size_t i = 0; i < n; ++i) past[i] = end_of(single, act[i]);
    std::vector<dspark_plan> plans(n);
    std::vector<float> out(n * static_cast<std::size_t>(W * D));
    std::size_t written = 0;
    if (view) {  // the rows where they lie in the batch's rings, laid end to end (f32 storage: the f32 rows)
        std::vector<const void*> data(2 * n, &written);
        std::vector<std::size_t> runs(2 * n, 99);
        CHECK_EQ(dspark_draft_many_view(batch, act.data(), past.data(), n, plans.data(), data.data(), runs.data()),
                 DSPARK_OK);
        auto* o = reinterpret_cast<std::uint8_t*>(out.data());
        for (std::size_t i = 0; i < n; ++i)
            for (int k = 0; k < 2; ++k) {
                CHECK_EQ(static_cast<std::int64_t>(runs[2 * i + k]), plans[i].slot_count[k]);
                CHECK((runs[2 * i + k] == 0) == (data[2 * i + k] == nullptr));
                if (runs[2 * i + k]) std::memcpy(o + written, data[2 * i + k], runs[2 * i + k] * D * sizeof(float));
                written += runs[2 * i + k] * D * sizeof(float);
            }
    } else {
        CHECK_EQ(dspark_draft_many(batch, act.data(), past.data(), n, DSPARK_DTYPE_F32, out.data(),
                                   out.size() * sizeof(float), plans.data(), &written),
                 DSPARK_OK);
    }
    std::size_t at = 0;
    for (std::size_t i = 0; i < n; ++i) {
        dspark_plan p;
        std::size_t w = 0;
        std::vector<float> one(static_cast<std::size_t>(W * D));
        CHECK_EQ(dspark_draft(single, act[i], past[i], DSPARK_DTYPE_F32, one.data(), one.size() * sizeof(float), &p,
                              &w),
                 DSPARK_OK);
        CHECK(same_plan(p, plans[i]));
        CHECK(at + w <= written);
        CHECK(w == 0 || std::memcmp(reinterpret_cast<const std::uint8_t*>(out.data()) + at, one.data(), w) == 0);
        at += w;
    }
    CHECK_EQ(at, written);

    std::vector<std::int64_t> commits, fails;
    std::vector<std::int32_t> stages;
    for (std::size_t i = 0; i < n; ++i) {
        if (plans[i].skip != DSPARK_SKIP_NONE) continue;
        if ((t + act[i]) % 5 == 0) {
            fails.push_back(act[i]);
            stages.push_back((t & 1) ? DSPARK_FAIL_CROP : DSPARK_FAIL_DECODE);
        } else {
            commits.push_back(act[i]);
        }
    }
    CHECK_EQ(dspark_commit_many(batch, commits.data(), commits.size()), DSPARK_OK);
    std::vector<std::int64_t> disabled(fails.size(), -1);
    CHECK_EQ(dspark_fail_many(batch, fails.data(), stages.data(), fails.size(), disabled.data()), DSPARK_OK);
    for (std::int64_t q : commits) CHECK_EQ(dspark_commit(single, q), DSPARK_OK);
    for (std::size_t i = 0; i < fails.size(); ++i) {
        std::int64_t d = -1;
        CHECK_EQ(dspark_fail(single, fails[i], stages[i], &d), DSPARK_OK);
        CHECK_EQ(disabled[i], d);
    }
    return {commits.size(), fails.size()};
}

void check_same(dspark_stager* a, dspark_stager* b) { CHECK(everything(a) == everything(b)); }

void server_loop(std::int32_t rows_mode) {
    const bool external = rows_mode == DSPARK_ROWS_EXTERNAL;
    Handle batch(config(rows_mode)), single(config(rows_mode));
    // Sequences join at different steps (a prefill of 3 + q rows), run, one
    // forks, some end mid-loop (end_many against end) and come back.
    std::vector<std::int64_t> act;
    std::size_t commits = 0, fails = 0;
    for (int t = 0; t < 14; ++t) {
        std::vector<std::int64_t> joining;
        for (std::int64_t q = 0; q < SEQS; ++q)
            if (t == q || (t == 10 && q == 1)) joining.push_back(q);
        for (std::int64_t q : joining) {
            for (dspark_stager* st : {batch.st, single.st}) {
                CHECK_EQ(dspark_begin(st, q), DSPARK_OK);
                const auto p = span(0, 3 + q);
                const auto r = rows_for(0, 3 + q);
                if (external) {
                    std::vector<std::int64_t> s(p.size());
                    CHECK_EQ(dspark_process_external(st, q, p.data(), p.size(), s.data()), DSPARK_OK);
                } else {
                    CHECK_EQ(dspark_process(st, q, p.data(), p.size(), r.data(), DSPARK_DTYPE_F32, r.size() * 4),
                             DSPARK_OK);
                }
            }
            act.push_back(q);
        }
        if (t == 6) {  // fork 2 -> 5 (5 joined at step 5 and is replaced)
            std::vector<std::int64_t> keep;
            for (std::int64_t q : act)
                if (q != 5) keep.push_back(q);
            act = keep;
            CHECK_EQ(dspark_fork(batch.st, 2, 5), DSPARK_OK);
            CHECK_EQ(dspark_fork(single.st, 2, 5), DSPARK_OK);
            act.push_back(5);
        }
        if (t == 8 || t == 12) {  // requests finish: 1 and 3 at 8, the rest at 12 (one of them with a round open)
            std::vector<std::int64_t> done, keep;
            for (std::int64_t q : act) ((t == 8 ? (q == 1 || q == 3) : q % 2 == 0) ? done : keep).push_back(q);
            CHECK_EQ(dspark_end_many(batch.st, done.data(), done.size()), DSPARK_OK);
            for (std::int64_t q : done) CHECK_EQ(dspark_end(single.st, q), DSPARK_OK);
            act = keep;
        }
        // Odd steps list the batch in reverse: a batch's order is the caller's.
        std::vector<std::int64_t> order(act.rbegin(), act.rend());
        const auto done =
            step(batch.st, single.st, t % 2 ? order : act, t, external, external && t % 3 == 0, !external && t % 3 == 1);
        commits += done.first;
        fails += done.second;
        check_same(batch.st, single.st);
    }
    CHECK(commits > 20 && fails > 3);  // the loop did run rounds and failures
    std::printf("  %s: %zu commits, %zu failures\n", external ? "external" : "held", commits, fails);
}

}  // namespace

TEST_CASE(batch_calls_equal_their_per_sequence_calls_held) { server_loop(DSPARK_ROWS_HELD); }

TEST_CASE(batch_calls_equal_their_per_sequence_calls_external) { server_loop(DSPARK_ROWS_EXTERNAL); }

TEST_CASE(reserve_confirm_equals_process_external_and_cancel_changes_nothing) {
    Handle h(config(DSPARK_ROWS_EXTERNAL)), ref(config(DSPARK_ROWS_EXTERNAL));
    const auto p = span(0, 9);
    std::vector<std::int64_t> s(9), s1(9);
    const auto before = everything(h.st);
    CHECK_EQ(dspark_reserve(h.st, 0, p.data(), 9, s.data()), DSPARK_OK);
    dspark_state st;
    dspark_state_init(&st);
    CHECK_EQ(dspark_state_get(h.st, 0, &st), DSPARK_OK);
    CHECK_EQ(st.reservation_open, 1);
    // Only confirm, cancel and end are allowed while the slots are reserved.
    CHECK_EQ(dspark_process_external(h.st, 0, p.data(), 9, s1.data()), DSPARK_E_STATE);
    CHECK_EQ(dspark_accept(h.st, 0, 0), DSPARK_E_STATE);
    CHECK_EQ(dspark_cancel(h.st, 0), DSPARK_OK);
    CHECK(everything(h.st) == before);
    CHECK_EQ(dspark_confirm(h.st, 0), DSPARK_E_STATE);  // nothing reserved now
    CHECK_EQ(dspark_reserve(h.st, 0, p.data(), 9, s.data()), DSPARK_OK);
    CHECK_EQ(dspark_confirm(h.st, 0), DSPARK_OK);
    CHECK_EQ(dspark_process_external(ref.st, 0, p.data(), 9, s1.data()), DSPARK_OK);
    CHECK(s == s1);
    check_same(h.st, ref.st);
    // A batch: cancel_many puts every sequence back.
    const std::int64_t seqs[] = {3, 0};
    const std::int64_t cu[] = {0, 4, 6};
    const std::int64_t pos[] = {0, 1, 2, 3, 9, 10};
    std::int64_t slots[6];
    const auto mid = everything(h.st);
    CHECK_EQ(dspark_reserve_many(h.st, seqs, 2, cu, pos, 6, slots), DSPARK_OK);
    CHECK_EQ(dspark_cancel_many(h.st, seqs, 2), DSPARK_OK);
    CHECK(everything(h.st) == mid);
    // Held mode has no reservations: the mode is named.
    Handle held(config(DSPARK_ROWS_HELD));
    CHECK_EQ(dspark_reserve(held.st, 0, p.data(), 9, s.data()), DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::strstr(dspark_last_error(), "external") != nullptr);
}

TEST_CASE(end_releases_the_ring_and_drops_open_rounds) {
    for (std::int32_t mode : {DSPARK_ROWS_HELD, DSPARK_ROWS_EXTERNAL}) {
        Handle h(config(mode)), fresh(config(mode));
        const auto p = span(0, 12);
        const auto r = rows_for(0, 12);
        std::vector<std::int64_t> s(12);
        for (std::int64_t q : {0, 1, 2}) {
            if (mode == DSPARK_ROWS_EXTERNAL)
                CHECK_EQ(dspark_process_external(h.st, q, p.data(), 12, s.data()), DSPARK_OK);
            else
                CHECK_EQ(dspark_process(h.st, q, p.data(), 12, r.data(), DSPARK_DTYPE_F32, r.size() * 4), DSPARK_OK);
        }
        dspark_plan plan;
        CHECK_EQ(dspark_draft(h.st, 1, 12, DSPARK_DTYPE_STORAGE, nullptr, 0, &plan, nullptr),
                 mode == DSPARK_ROWS_EXTERNAL ? DSPARK_OK : DSPARK_E_BUFFER_TOO_SMALL);
        if (mode == DSPARK_ROWS_EXTERNAL) CHECK_EQ(dspark_reserve(h.st, 2, p.data() + 0, 0, s.data()), DSPARK_OK);
        const std::int64_t seqs[] = {2, 1};
        CHECK_EQ(dspark_end_many(h.st, seqs, 2), DSPARK_OK);  // an open round and a reservation: dropped
        CHECK_EQ(dspark_end(h.st, 0), DSPARK_OK);
        check_same(h.st, fresh.st);
        dspark_stats st;
        dspark_stats_init(&st);
        CHECK_EQ(dspark_stats_get(h.st, 0, &st), DSPARK_OK);
        CHECK_EQ(st.bytes, 0);
        CHECK_EQ(st.reserved_bytes, 0);
    }
}

TEST_CASE(rejected_batches_give_the_cpp_error_and_change_nothing) {
    for (std::int32_t mode : {DSPARK_ROWS_HELD, DSPARK_ROWS_EXTERNAL}) {
        const bool external = mode == DSPARK_ROWS_EXTERNAL;
        Handle h(config(mode));
        dspark::Stager core(options(mode));
        // The same state in both: 0 and 1 hold rows, 2 has a round open.
        for (std::int64_t q : {0, 1, 2}) {
            const auto p = span(0, 5 + q);
            const auto r = rows_for(0, 5 + q);
            std::vector<std::int64_t> s(p.size());
            if (external) {
                CHECK_EQ(dspark_process_external(h.st, q, p.data(), p.size(), s.data()), DSPARK_OK);
                core.process_external(q, p.data(), p.size(), s.data());
            } else {
                CHECK_EQ(dspark_process(h.st, q, p.data(), p.size(), r.data(), DSPARK_DTYPE_F32, r.size() * 4),
                         DSPARK_OK);
                core.process(q, p.data(), p.size(), r.data(), dspark::ElemType::F32);
            }
        }
        std::vector<float> buf(static_cast<std::size_t>(W * D));
        dspark_plan plan;
        CHECK_EQ(dspark_draft(h.st, 2, 7, DSPARK_DTYPE_STORAGE, buf.data(), buf.size() * 4, &plan, nullptr),
                 DSPARK_OK);
        dspark::ByteVec rows_out;
        core.draft(2, 7, rows_out);

        std::int64_t slots[16];
        const auto rows = rows_for(5, 3);
        // process_many / process_external_many / reserve_many: each error of
        // the order (ids, states, uniqueness, offsets, positions), in the
        // second sequence of the batch.
        struct Bad {
            const char* what;
            std::vector<std::int64_t> seqs, cu, pos;
        };
        const std::vector<Bad> bad_rows = {
            {"unknown id", {0, 9}, {0, 1, 2}, {5, 6}},
            {"open round", {0, 2}, {0, 1, 2}, {5, 7}},
            {"duplicate", {0, 0}, {0, 1, 2}, {5, 6}},
            {"offsets start", {0, 1}, {1, 1, 2}, {5, 6}},
            {"offsets fall", {0, 1}, {0, 2, 1}, {5, 6}},
            {"offsets end", {0, 1}, {0, 1, 1}, {5, 6}},
            {"gap", {0, 1}, {0, 1, 2}, {5, 9}},
            {"negative", {0, 1}, {0, 1, 2}, {5, -1}},
            {"not contiguous", {1, 0}, {0, 2, 3}, {6, 8, 5}},
        };
        for (const Bad& b : bad_rows) {
            const std::size_t n = b.seqs.size(), total = b.pos.size();
            if (external) {
                rejects_like_cpp(
                    h.st,
                    [&] { return dspark_process_external_many(h.st, b.seqs.data(), n, b.cu.data(), b.pos.data(), total, slots); },
                    [&] { core.process_external_many(b.seqs.data(), n, b.cu.data(), b.pos.data(), total, slots); },
                    b.what);
                rejects_like_cpp(
                    h.st, [&] { return dspark_reserve_many(h.st, b.seqs.data(), n, b.cu.data(), b.pos.data(), total, slots); },
                    [&] { core.reserve_many(b.seqs.data(), n, b.cu.data(), b.pos.data(), total, slots); }, b.what);
            } else {
                rejects_like_cpp(
                    h.st,
                    [&] {
                        return dspark_process_many(h.st, b.seqs.data(), n, b.cu.data(), b.pos.data(), total,
                                                   rows.data(), DSPARK_DTYPE_F32, total * D * 4);
                    },
                    [&] {
                        core.process_many(b.seqs.data(), n, b.cu.data(), b.pos.data(), total, rows.data(),
                                          dspark::ElemType::F32);
                    },
                    b.what);
            }
        }
        // The other mode's call names the mode.
        const std::int64_t s01[] = {0, 1}, cu2[] = {0, 1, 2}, p56[] = {5, 6};
        if (external)
            rejects_like_cpp(
                h.st, [&] { return dspark_process_many(h.st, s01, 2, cu2, p56, 2, rows.data(), DSPARK_DTYPE_F32, 2 * D * 4); },
                [&] { core.process_many(s01, 2, cu2, p56, 2, rows.data(), dspark::ElemType::F32); }, "mode");
        else
            rejects_like_cpp(
                h.st, [&] { return dspark_process_external_many(h.st, s01, 2, cu2, p56, 2, slots); },
                [&] { core.process_external_many(s01, 2, cu2, p56, 2, slots); }, "mode");
        // accept_many, commit_many, fail_many, confirm_many, cancel_many, end_many.
        const std::int64_t s0_9[] = {0, 9}, s0_2[] = {0, 2}, s2_0[] = {2, 0}, s2_2[] = {2, 2}, s1_0[] = {1, 0};
        const std::int64_t acc_bad[] = {0, -1}, acc[] = {0, 0};
        rejects_like_cpp(h.st, [&] { return dspark_accept_many(h.st, s0_9, acc, 2); },
                         [&] { core.accept_many(s0_9, acc, 2); }, "accept id");
        rejects_like_cpp(h.st, [&] { return dspark_accept_many(h.st, s0_2, acc, 2); },
                         [&] { core.accept_many(s0_2, acc, 2); }, "accept state");
        rejects_like_cpp(h.st, [&] { return dspark_accept_many(h.st, s1_0, acc_bad, 2); },
                         [&] { core.accept_many(s1_0, acc_bad, 2); }, "accept value");
        rejects_like_cpp(h.st, [&] { return dspark_commit_many(h.st, s2_0, 2); },
                         [&] { core.commit_many(s2_0, 2); }, "commit state");
        rejects_like_cpp(h.st, [&] { return dspark_commit_many(h.st, s2_2, 2); },
                         [&] { core.commit_many(s2_2, 2); }, "commit duplicate");
        const std::int32_t st_ok[] = {DSPARK_FAIL_DECODE, DSPARK_FAIL_CROP}, st_bad[] = {7};
        const dspark::FailStage fs_ok[] = {dspark::FailStage::Decode, dspark::FailStage::Crop};
        const dspark::FailStage fs_bad[] = {static_cast<dspark::FailStage>(7)};
        rejects_like_cpp(h.st, [&] { return dspark_fail_many(h.st, s2_0, st_ok, 2, nullptr); },
                         [&] { core.fail_many(s2_0, fs_ok, 2, nullptr); }, "fail state");
        rejects_like_cpp(h.st, [&] { return dspark_fail_many(h.st, s2_2, st_bad, 1, nullptr); },
                         [&] { core.fail_many(s2_2, fs_bad, 1, nullptr); }, "fail stage");
        rejects_like_cpp(h.st, [&] { return dspark_confirm_many(h.st, s1_0, 2); },
                         [&] { core.confirm_many(s1_0, 2); }, "confirm state");
        rejects_like_cpp(h.st, [&] { return dspark_cancel_many(h.st, s0_9, 2); },
                         [&] { core.cancel_many(s0_9, 2); }, "cancel id");
        rejects_like_cpp(h.st, [&] { return dspark_end_many(h.st, s2_2, 2); }, [&] { core.end_many(s2_2, 2); },
                         "end duplicate");
        rejects_like_cpp(h.st, [&] { return dspark_end_many(h.st, s0_9, 2); }, [&] { core.end_many(s0_9, 2); },
                         "end id");
        // draft_many_view: ids, states, duplicates, the mode, n_past, in that order.
        std::vector<dspark_plan> vp(2);
        std::vector<const void*> vd(4);
        std::vector<std::size_t> vr(4);
        std::vector<dspark::RoundPlan> cp;
        std::vector<dspark::RowView> cv;
        const std::int64_t past_ok[] = {5, 6}, past_bad[] = {5, -1}, s0_1[] = {0, 1}, s0_0[] = {0, 0};
        const struct {
            const char* what;
            const std::int64_t* seqs;
            const std::int64_t* pasts;
        } bad_views[] = {{"view id", s0_9, past_ok}, {"view state", s0_2, past_ok}, {"view duplicate", s0_0, past_ok},
                         {"view n_past", s0_1, past_bad}, {"view mode", s0_1, past_ok}};
        for (const auto& b : bad_views) {
            if (!external && std::strcmp(b.what, "view mode") == 0) continue;  // held: a batch that opens
            rejects_like_cpp(
                h.st, [&] { return dspark_draft_many_view(h.st, b.seqs, b.pasts, 2, vp.data(), vd.data(), vr.data()); },
                [&] { core.draft_many_view(b.seqs, b.pasts, 2, cp, cv); }, b.what);
        }
        // The mode is checked after the states and the duplicates (design.md 2.1), before n_past.
        if (external) {
            CHECK_EQ(dspark_draft_many_view(h.st, s0_2, past_ok, 2, vp.data(), vd.data(), vr.data()), DSPARK_E_STATE);
            CHECK_EQ(dspark_draft_many_view(h.st, s0_0, past_ok, 2, vp.data(), vd.data(), vr.data()),
                     DSPARK_E_INVALID_ARGUMENT);
            CHECK(std::strstr(dspark_last_error(), "appears twice") != nullptr);
            CHECK_EQ(dspark_draft_many_view(h.st, s0_1, past_bad, 2, vp.data(), vd.data(), vr.data()),
                     DSPARK_E_INVALID_ARGUMENT);
            CHECK(std::strstr(dspark_last_error(), "needs held rows") != nullptr);
        }
        // Stage codes wider than the core's enum: the core's words.
        const std::int32_t wide[] = {300};
        const auto before = everything(h.st);
        CHECK_EQ(dspark_fail_many(h.st, s2_2, wide, 1, nullptr), DSPARK_E_INVALID_ARGUMENT);
        CHECK(std::string(dspark_last_error()).rfind("fail_many: seqs[0] (sequence 2): stage code 300 is not one of", 0) == 0);
        CHECK(everything(h.st) == before);
    }
}

TEST_CASE(batch_conversions_come_after_the_sequence_checks) {
    Handle h(config(DSPARK_ROWS_HELD));
    const std::int64_t bad[] = {0, 9}, good[] = {0, 1}, cu[] = {0, 1, 2}, pos[] = {0, 0};
    const auto rows = rows_for(0, 2);
    // A bad id is named before a NULL offsets array or a wrong byte count.
    CHECK_EQ(dspark_process_many(h.st, bad, 2, nullptr, pos, 2, rows.data(), DSPARK_DTYPE_F32, 2 * D * 4),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::strstr(dspark_last_error(), "process_many: seqs[1] (sequence 9)") != nullptr);
    CHECK_EQ(dspark_process_many(h.st, bad, 2, cu, pos, 2, rows.data(), DSPARK_DTYPE_F32, 3), DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::strstr(dspark_last_error(), "sequence 9") != nullptr);
    CHECK_EQ(dspark_process_many(h.st, good, 2, nullptr, pos, 2, rows.data(), DSPARK_DTYPE_F32, 2 * D * 4),
             DSPARK_E_NULL_POINTER);
    CHECK(std::strstr(dspark_last_error(), "offsets is NULL") != nullptr);
    CHECK_EQ(dspark_process_many(h.st, good, 2, cu, pos, 2, rows.data(), DSPARK_DTYPE_F32, 3), DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::strstr(dspark_last_error(), "got 3 bytes") != nullptr);
    CHECK_EQ(dspark_process_many(h.st, good, 2, cu, pos, 2, rows.data(), 9, 2 * D * 4), DSPARK_E_TYPE);
    CHECK_EQ(dspark_process_many(h.st, nullptr, 2, cu, pos, 2, rows.data(), DSPARK_DTYPE_F32, 2 * D * 4),
             DSPARK_E_NULL_POINTER);
    CHECK(std::strstr(dspark_last_error(), "seqs is NULL") != nullptr);
    CHECK_EQ(dspark_accept_many(h.st, good, nullptr, 2), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_accept_many(h.st, bad, nullptr, 2), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_fail_many(h.st, good, nullptr, 2, nullptr), DSPARK_E_STATE);  // no round open: state first
    CHECK_EQ(dspark_commit_many(h.st, nullptr, 1), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_end_many(h.st, nullptr, 1), DSPARK_E_NULL_POINTER);
    // draft_many_view: a bad id before a NULL output; each NULL output named.
    dspark_plan vp[2];
    const void* vd[4];
    std::size_t vr[4];
    const std::int64_t past[] = {2, 2};
    CHECK_EQ(dspark_draft_many_view(h.st, bad, past, 2, nullptr, vd, vr), DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::strstr(dspark_last_error(), "draft_many_view: seqs[1] (sequence 9)") != nullptr);
    CHECK_EQ(dspark_draft_many_view(h.st, good, nullptr, 2, vp, vd, vr), DSPARK_E_NULL_POINTER);
    CHECK(std::strstr(dspark_last_error(), "n_pasts is NULL") != nullptr);
    CHECK_EQ(dspark_draft_many_view(h.st, good, past, 2, nullptr, vd, vr), DSPARK_E_NULL_POINTER);
    CHECK(std::strstr(dspark_last_error(), "plans is NULL") != nullptr);
    CHECK_EQ(dspark_draft_many_view(h.st, good, past, 2, vp, nullptr, vr), DSPARK_E_NULL_POINTER);
    CHECK(std::strstr(dspark_last_error(), "run_data is NULL") != nullptr);
    CHECK_EQ(dspark_draft_many_view(h.st, good, past, 2, vp, vd, nullptr), DSPARK_E_NULL_POINTER);
    CHECK(std::strstr(dspark_last_error(), "run_rows is NULL") != nullptr);
    CHECK_EQ(dspark_draft_many_view(nullptr, good, past, 2, vp, vd, vr), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_draft_many_view(h.st, nullptr, 0, 0, nullptr, nullptr, nullptr), DSPARK_OK);
    // Empty batches are no-ops; offsets is still read ({0}).
    const std::int64_t zero[] = {0};
    CHECK_EQ(dspark_process_many(h.st, nullptr, 0, zero, nullptr, 0, nullptr, DSPARK_DTYPE_F32, 0), DSPARK_OK);
    CHECK_EQ(dspark_commit_many(h.st, nullptr, 0), DSPARK_OK);
    CHECK_EQ(dspark_end_many(h.st, nullptr, 0), DSPARK_OK);
    // No handle: NULL_POINTER from every new call.
    std::int64_t slot = 0;
    CHECK_EQ(dspark_process_many(nullptr, good, 2, cu, pos, 2, rows.data(), DSPARK_DTYPE_F32, 2 * D * 4),
             DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_process_external_many(nullptr, good, 2, cu, pos, 2, &slot), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_accept_many(nullptr, good, good, 2), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_commit_many(nullptr, good, 2), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_fail_many(nullptr, good, nullptr, 2, nullptr), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_reserve(nullptr, 0, pos, 1, &slot), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_reserve_many(nullptr, good, 2, cu, pos, 2, &slot), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_confirm(nullptr, 0), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_cancel(nullptr, 0), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_confirm_many(nullptr, good, 2), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_cancel_many(nullptr, good, 2), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_end(nullptr, 0), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_end_many(nullptr, good, 2), DSPARK_E_NULL_POINTER);
}

// A plan carries the round it opened, and dspark_open_round_ids says which
// rounds are open now: a C owner of external rows can refuse a stale plan.
TEST_CASE(plans_carry_their_round_and_open_round_ids_tell_a_stale_plan) {
    Handle h(config(DSPARK_ROWS_EXTERNAL));
    const auto p = span(0, 12);
    std::vector<std::int64_t> s(12);
    for (std::int64_t q : {0, 1})
        CHECK_EQ(dspark_process_external(h.st, q, p.data(), 12, s.data()), DSPARK_OK);
    dspark_plan a, b;
    CHECK_EQ(dspark_draft(h.st, 0, 12, DSPARK_DTYPE_STORAGE, nullptr, 0, &a, nullptr), DSPARK_OK);
    CHECK_EQ(dspark_draft(h.st, 1, 12, DSPARK_DTYPE_STORAGE, nullptr, 0, &b, nullptr), DSPARK_OK);
    CHECK(a.round != 0 && b.round != 0 && a.round != b.round);
    CHECK_EQ(a.reserved[0], 0);
    const std::int64_t seqs[] = {1, 0, 2};
    std::uint64_t open[3] = {9, 9, 9};
    CHECK_EQ(dspark_open_round_ids(h.st, seqs, 3, open), DSPARK_OK);
    CHECK_EQ(open[0], b.round);
    CHECK_EQ(open[1], a.round);
    CHECK_EQ(open[2], 0u);  // no round open on sequence 2
    CHECK_EQ(dspark_commit(h.st, 0), DSPARK_OK);
    CHECK_EQ(dspark_draft(h.st, 0, 12, DSPARK_DTYPE_STORAGE, nullptr, 0, &b, nullptr), DSPARK_OK);
    CHECK_EQ(dspark_open_round_ids(h.st, seqs + 1, 1, open), DSPARK_OK);
    CHECK(open[0] == b.round && open[0] != a.round);  // the first plan of sequence 0 is stale now
    const std::int64_t unknown[] = {0, SEQS};
    CHECK_EQ(dspark_open_round_ids(h.st, unknown, 2, open), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_open_round_ids(h.st, nullptr, 1, open), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_open_round_ids(h.st, nullptr, 0, nullptr), DSPARK_OK);
}

TEST_MAIN()
