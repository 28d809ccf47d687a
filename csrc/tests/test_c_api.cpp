// Tests of the C ABI (dspark/dspark.h): every rejected call returns its status
// code and a message naming the bad value, never crashes, and changes nothing;
// accepted calls give what the C++ Stager gives for the same calls (the
// oracle here is a second, C++ Stager driven in lock step). Runs clean under
// DSPARK_SANITIZE=ON (ASan + UBSan).
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "c_api_common.hpp"
#include "check.hpp"
#include "dspark/dspark.h"
#include "dspark/row_format.hpp"
#include "dspark/stager.hpp"

namespace {

using c_api_test::D, c_api_test::FieldCount, c_api_test::Handle, c_api_test::rows_for, c_api_test::snap, c_api_test::span;
constexpr std::int64_t B = 7, W = 20;

dspark_config config(std::int32_t storage = DSPARK_STORAGE_F32, std::int64_t seqs = 2) {
    dspark_config c;
    dspark_config_init(&c);
    c.feature_dim = D;
    c.block_size = B;
    c.window = W;
    c.max_seqs = seqs;
    c.storage = storage;
    return c;
}

bool error_mentions(const char* what) { return std::strstr(dspark_last_error(), what) != nullptr; }

dspark_status process(dspark_stager* st, std::int64_t seq, std::int64_t from, std::int64_t n, int version = 0) {
    const auto rows = rows_for(from, n, version);
    const auto pos = span(from, n);
    return dspark_process(st, seq, pos.data(), pos.size(), rows.data(), DSPARK_DTYPE_F32, rows.size() * sizeof(float));
}

}  // namespace

TEST_CASE(version_and_status_names) {
    CHECK(std::strcmp(dspark_version(), "") != 0);
    CHECK_EQ(dspark_abi_version(), DSPARK_ABI_VERSION);
    CHECK(std::strcmp(dspark_status_name(DSPARK_E_STATE), "DSPARK_E_STATE") == 0);
    CHECK(std::strcmp(dspark_status_name(12345), "DSPARK_E_UNKNOWN") == 0);
}

TEST_CASE(create_rejects_bad_configs_with_their_codes) {
    dspark_stager* st = reinterpret_cast<dspark_stager*>(0x1);
    CHECK_EQ(dspark_stager_create(nullptr, &st), DSPARK_E_NULL_POINTER);
    CHECK(st == nullptr);  // *out is cleared before anything can fail
    CHECK(error_mentions("config is NULL"));
    dspark_config c = config();
    CHECK_EQ(dspark_stager_create(&c, nullptr), DSPARK_E_NULL_POINTER);

    c.window = 2 * B;  // W must exceed 2B
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    CHECK(error_mentions("window (14) must be greater than 2 * block_size"));
    c = config(DSPARK_STORAGE_Q4_0);
    c.feature_dim = 33;
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    c = config(7);
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    CHECK(error_mentions("storage code 7"));
    c = config();
    c.nonfinite = -1;
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    c = config();
    c.max_seqs = (1 << 16) + 1;  // Python's MAX_SEQS_LIMIT
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    CHECK(error_mentions("65537"));
    c = config();
    c.max_failures = 0;
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    c = config();
    c.stage_dtype = DSPARK_DTYPE_STORAGE;  // a stage dtype is a float type
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    CHECK(error_mentions("stage_dtype code -1"));
    c = config();
    c.strict = 2;
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    c = config();
    c.rows_mode = 9;
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    CHECK(error_mentions("rows_mode code 9 is not one of held (0), external (1)"));
    CHECK(st == nullptr);
}

TEST_CASE(config_struct_size_rules) {
    dspark_stager* st = nullptr;
    dspark_config c = config();
    c.struct_size = 8;  // older than any version
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("struct_size"));
    // A newer caller: trailing fields this library does not know must be zero.
    struct Newer {
        dspark_config base;
        std::int64_t future;
    } n;
    n.base = config();
    n.base.struct_size = sizeof(Newer);
    n.future = 0;
    CHECK_EQ(dspark_stager_create(&n.base, &st), DSPARK_OK);
    dspark_config got;
    dspark_config_init(&got);
    CHECK_EQ(dspark_stager_config(st, &got), DSPARK_OK);
    CHECK_EQ(got.window, W);
    CHECK_EQ(got.max_failures, 3);
    CHECK_EQ(got.struct_size, sizeof(dspark_config));
    dspark_stager_destroy(st);
    st = nullptr;
    n.future = 1;
    CHECK_EQ(dspark_stager_create(&n.base, &st), DSPARK_E_UNSUPPORTED);
    CHECK(st == nullptr);
    dspark_stager_destroy(nullptr);  // allowed
}

TEST_CASE(every_call_rejects_a_null_stager) {
    std::int64_t i64 = 0;
    std::size_t sz = 0;
    dspark_plan plan;
    dspark_state state;
    dspark_state_init(&state);
    dspark_stats stats;
    dspark_stats_init(&stats);
    dspark_config cfg;
    dspark_config_init(&cfg);
    const std::uint8_t byte = 0;
    CHECK_EQ(dspark_stager_config(nullptr, &cfg), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_stager_row_bytes(nullptr, &sz), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_stager_max_plan_rows(nullptr, &i64), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_begin(nullptr, 0), DSPARK_E_NULL_POINTER);
    CHECK(error_mentions("stager is NULL"));
    CHECK_EQ(dspark_process(nullptr, 0, nullptr, 0, nullptr, DSPARK_DTYPE_F32, 0), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_process_encoded(nullptr, 0, nullptr, 0, nullptr, 0), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_draft_size(nullptr, 0, 1, DSPARK_DTYPE_F32, &sz), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_draft(nullptr, 0, 1, DSPARK_DTYPE_F32, nullptr, 0, &plan, &sz), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_draft_many(nullptr, &i64, &i64, 1, DSPARK_DTYPE_F32, nullptr, 0, &plan, &sz), DSPARK_E_NULL_POINTER);
    const void* run_data[2];
    CHECK_EQ(dspark_draft_view(nullptr, 0, 1, &plan, run_data, &sz), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_commit(nullptr, 0), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_fail(nullptr, 0, DSPARK_FAIL_DECODE, &i64), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_accept(nullptr, 0, 0), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_rollback(nullptr, 0, 0), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_shift(nullptr, 0, 0, 0), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_fork(nullptr, 0, 1), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_snapshot_size(nullptr, 0, &sz), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_snapshot(nullptr, 0, nullptr, 0, &sz), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_restore(nullptr, 0, &byte, 1), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_state_get(nullptr, 0, &state), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_stats_get(nullptr, 0, &stats), DSPARK_E_NULL_POINTER);
}

TEST_CASE(null_buffers_and_outputs_are_errors_not_crashes) {
    Handle h(config());
    std::int64_t pos = 0;
    CHECK_EQ(dspark_process(h.st, 0, nullptr, 1, nullptr, DSPARK_DTYPE_F32, D * 4), DSPARK_E_NULL_POINTER);
    CHECK(error_mentions("positions is NULL"));
    CHECK_EQ(dspark_process(h.st, 0, &pos, 1, nullptr, DSPARK_DTYPE_F32, D * 4), DSPARK_E_NULL_POINTER);
    CHECK(error_mentions("rows is NULL"));
    CHECK_EQ(dspark_process_encoded(h.st, 0, &pos, 1, nullptr, D * 4), DSPARK_E_NULL_POINTER);
    // Zero rows: NULL is fine and nothing happens.
    CHECK_EQ(dspark_process(h.st, 0, nullptr, 0, nullptr, DSPARK_DTYPE_F32, 0), DSPARK_OK);
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, nullptr, 0, nullptr, nullptr), DSPARK_E_NULL_POINTER);
    CHECK(error_mentions("plan is NULL"));
    dspark_plan plan;
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, nullptr, 64, &plan, nullptr), DSPARK_E_NULL_POINTER);
    std::size_t sz;
    CHECK_EQ(dspark_draft_size(h.st, 0, 5, DSPARK_DTYPE_F32, nullptr), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_snapshot_size(h.st, 0, nullptr), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_snapshot(h.st, 0, nullptr, 10, &sz), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_restore(h.st, 0, nullptr, 10), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_state_get(h.st, 0, nullptr), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_stats_get(h.st, 0, nullptr), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_draft_many(h.st, nullptr, nullptr, 1, DSPARK_DTYPE_F32, nullptr, 0, &plan, nullptr),
             DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_row_bytes(DSPARK_STORAGE_F32, D, nullptr), DSPARK_E_NULL_POINTER);
    dspark_state st;
    dspark_state_init(&st);
    CHECK_EQ(dspark_state_get(h.st, 0, &st), DSPARK_OK);
    CHECK_EQ(st.end, 5);  // only the accepted process call changed anything
    CHECK(!st.open_round);
}

TEST_CASE(bad_values_name_themselves) {
    Handle h(config());
    CHECK_EQ(dspark_begin(h.st, 2), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("unknown sequence 2"));
    CHECK_EQ(dspark_begin(h.st, -1), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    CHECK_EQ(process(h.st, 0, 7, 2), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("positions must continue at 5, got 7"));
    // Wrong byte counts for the row count.
    const auto rows = rows_for(5, 2);
    const auto pos = span(5, 2);
    CHECK_EQ(dspark_process(h.st, 0, pos.data(), 2, rows.data(), DSPARK_DTYPE_F32, rows.size() * 4 - 1),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("rows must be 2 x 32 elements (256 bytes), got 255 bytes"));
    CHECK_EQ(dspark_process(h.st, 0, pos.data(), 2, rows.data(), 9, rows.size() * 4), DSPARK_E_TYPE);
    CHECK(error_mentions("dtype code 9"));
    CHECK_EQ(dspark_process(h.st, 0, pos.data(), 2, rows.data(), DSPARK_DTYPE_STORAGE, rows.size() * 4), DSPARK_E_TYPE);
    CHECK_EQ(dspark_process_encoded(h.st, 0, pos.data(), 2, rows.data(), 100), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("encoded rows must be 2 x 128 bytes"));
    // Non-finite rows are rejected whole (nonfinite = ERROR).
    auto bad = rows;
    bad[D + 4] = std::numeric_limits<float>::quiet_NaN();
    CHECK_EQ(dspark_process(h.st, 0, pos.data(), 2, bad.data(), DSPARK_DTYPE_F32, bad.size() * 4),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("row 1 (position 6), channel 4 holds nan"));
    std::size_t sz;
    CHECK_EQ(dspark_draft_size(h.st, 0, -1, DSPARK_DTYPE_F32, &sz), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("n_past must be in [0, 2**62), got -1"));
    CHECK_EQ(dspark_draft_size(h.st, 0, 5, 7, &sz), DSPARK_E_TYPE);
    CHECK_EQ(dspark_accept(h.st, 0, B + 1), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("n_accepted must be in [0, 7], got 8"));
    CHECK_EQ(dspark_shift(h.st, 0, -1, 1), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_shift(h.st, 0, 3, 10), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("reaches past the end"));
    CHECK_EQ(dspark_fork(h.st, 0, 0), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_fork(h.st, 0, 5), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_rollback(h.st, 0, -3), DSPARK_E_INVALID_ARGUMENT);
    dspark_state st;
    dspark_state_init(&st);
    CHECK_EQ(dspark_state_get(h.st, 0, &st), DSPARK_OK);
    CHECK_EQ(st.end, 5);
}

TEST_CASE(protocol_state_errors_and_atomicity) {
    Handle h(config());
    CHECK_EQ(dspark_commit(h.st, 0), DSPARK_E_STATE);
    CHECK(error_mentions("has no open round"));
    CHECK_EQ(dspark_fail(h.st, 0, DSPARK_FAIL_DECODE, nullptr), DSPARK_E_STATE);
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    dspark_plan plan;
    std::vector<float> out(static_cast<std::size_t>(W * D));
    std::size_t written = 0;
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, &written), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_NONE);
    const auto before = snap(h.st, 1);
    dspark_state open_state, st;
    dspark_state_init(&open_state);
    dspark_state_init(&st);
    CHECK_EQ(dspark_state_get(h.st, 0, &open_state), DSPARK_OK);
    CHECK(open_state.open_round);
    // Round open: everything but commit / fail / introspection is a StateError.
    CHECK_EQ(process(h.st, 0, 5, 1), DSPARK_E_STATE);
    CHECK(error_mentions("sequence 0 has an open round"));
    CHECK_EQ(dspark_begin(h.st, 0), DSPARK_E_STATE);
    CHECK_EQ(dspark_accept(h.st, 0, 1), DSPARK_E_STATE);
    CHECK_EQ(dspark_rollback(h.st, 0, 1), DSPARK_E_STATE);
    CHECK_EQ(dspark_shift(h.st, 0, 1, 1), DSPARK_E_STATE);
    CHECK_EQ(dspark_fork(h.st, 0, 1), DSPARK_E_STATE);
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, &written), DSPARK_E_STATE);
    std::size_t sz;
    CHECK_EQ(dspark_snapshot_size(h.st, 0, &sz), DSPARK_E_STATE);
    std::uint8_t junk[4] = {1, 2, 3, 4};
    CHECK_EQ(dspark_restore(h.st, 0, junk, sizeof junk), DSPARK_E_STATE);
    CHECK_EQ(dspark_fail(h.st, 0, 5, nullptr), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("stage code 5 is not one of decode (0), crop (1)"));
    CHECK_EQ(dspark_state_get(h.st, 0, &st), DSPARK_OK);
    CHECK(std::memcmp(&st, &open_state, sizeof st) == 0);  // no rejected call changed anything
    std::int64_t disabled = -1;
    CHECK_EQ(dspark_fail(h.st, 0, DSPARK_FAIL_CROP, &disabled), DSPARK_OK);
    CHECK_EQ(disabled, 0);
    CHECK(snap(h.st, 1) == before);
    // A bad snapshot is rejected with its reason and changes nothing.
    const auto good = snap(h.st, 0);
    CHECK(!good.empty());
    auto damaged = good;
    damaged[damaged.size() / 2] ^= 0x40;
    CHECK_EQ(dspark_restore(h.st, 1, damaged.data(), damaged.size()), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("checksum"));
    CHECK(snap(h.st, 1) == before);
    CHECK_EQ(dspark_restore(h.st, 1, good.data(), good.size()), DSPARK_OK);
    CHECK(snap(h.st, 1) == good);
}

TEST_CASE(stage_dtype_bounds_what_process_accepts) {
    // f32 storage staged as f16: 9e4 would be +inf in the drafter's f16 rows.
    dspark_config c = config();
    c.stage_dtype = DSPARK_DTYPE_F16;
    Handle h(c);
    auto rows = rows_for(0, 2);
    rows[D + 7] = 9.0e4f;
    const auto pos = span(0, 2);
    CHECK_EQ(dspark_process(h.st, 0, pos.data(), 2, rows.data(), DSPARK_DTYPE_F32, rows.size() * 4),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("staged as float16"));
    // The same rows are fine for an f32-staged Stager, and with nonfinite = CLAMP.
    Handle f32(config());
    CHECK_EQ(dspark_process(f32.st, 0, pos.data(), 2, rows.data(), DSPARK_DTYPE_F32, rows.size() * 4), DSPARK_OK);
    c.nonfinite = DSPARK_NONFINITE_CLAMP;
    Handle clamp(c);
    CHECK_EQ(dspark_process(clamp.st, 0, pos.data(), 2, rows.data(), DSPARK_DTYPE_F32, rows.size() * 4), DSPARK_OK);
}

TEST_CASE(strict_rejects_a_protocol_mismatch_before_anything_changes) {
    dspark_config c = config();
    Handle lax(c);
    c.strict = 1;
    Handle strict(c);
    for (dspark_stager* st : {lax.st, strict.st}) {
        CHECK_EQ(process(st, 0, 0, 5), DSPARK_OK);
        dspark_plan plan;
        std::vector<float> out(static_cast<std::size_t>(W * D));
        CHECK_EQ(dspark_draft(st, 0, 5, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
        CHECK_EQ(dspark_commit(st, 0), DSPARK_OK);
        CHECK_EQ(process(st, 0, 5, B + 1), DSPARK_OK);  // a verify batch, and no accept
    }
    dspark_plan plan;
    std::vector<float> out(static_cast<std::size_t>(W * D));
    // Without strict: a skip the caller must notice (and log).
    CHECK_EQ(dspark_draft(lax.st, 0, 8, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_MISSING_ROWS);
    // Strict: an error naming the cause, and no skip counted.
    dspark_stats before, after;
    dspark_stats_init(&before);
    dspark_stats_init(&after);
    CHECK_EQ(dspark_stats_get(strict.st, 0, &before), DSPARK_OK);
    CHECK_EQ(dspark_draft(strict.st, 0, 8, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr),
             DSPARK_E_STATE);
    CHECK(error_mentions("rows 8..12 are still buffered: was accept() not called"));
    const std::int64_t seqs[] = {1, 0};
    const std::int64_t pasts[] = {0, 8};
    dspark_plan plans[2];
    CHECK_EQ(dspark_draft_many(strict.st, seqs, pasts, 2, DSPARK_DTYPE_F32, out.data(), out.size() * 4, plans, nullptr),
             DSPARK_E_STATE);
    CHECK(error_mentions("draft(n_past=8) does not match the buffered rows (newest 12)"));
    CHECK_EQ(dspark_stats_get(strict.st, 0, &after), DSPARK_OK);
    CHECK(std::memcmp(&before, &after, sizeof before) == 0);
    // Ordinary skips are not mismatches: an unstarted sequence still skips EMPTY.
    CHECK_EQ(dspark_draft(strict.st, 1, 0, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_EMPTY);
    CHECK_EQ(dspark_accept(strict.st, 0, 2), DSPARK_OK);
    CHECK_EQ(dspark_draft(strict.st, 0, 8, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_NONE);
}

// The C ABI converts and calls: the core's limits reach it unchanged, at the
// exact boundary (a copy of a limit in this layer would break one side).
TEST_CASE(the_cores_limits_reach_the_c_abi) {
    dspark_stager* st = nullptr;
    dspark_config c = config(DSPARK_STORAGE_F32, dspark::MAX_SEQS_LIMIT);
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_OK);
    dspark_stager_destroy(st);
    st = nullptr;
    c.max_seqs = dspark::MAX_SEQS_LIMIT + 1;
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    CHECK(error_mentions("exceeds the limit"));
    c = config();
    c.window = dspark::MAX_WINDOW + 1;
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    CHECK(st == nullptr);
}

// docs/design.md 2.1: the sequence, its round state, the arguments' values,
// and strict mode last: a bad n_past or a duplicate id is the argument's error
// under strict = 1 too, as in Python; an out-of-protocol n_past, lagging
// behind the buffered rows included, is DSPARK_E_STATE, and its skip is
// reported (not raised) without strict.
TEST_CASE(strict_mode_comes_after_the_argument_checks) {
    dspark_config c = config();
    c.strict = 1;
    Handle strict(c);
    Handle lax(config());
    std::vector<float> out(static_cast<std::size_t>(W * D));
    dspark_plan plan;
    for (dspark_stager* st : {strict.st, lax.st}) {
        CHECK_EQ(process(st, 0, 0, 12), DSPARK_OK);
        CHECK_EQ(dspark_draft(st, 0, 12, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
        CHECK_EQ(dspark_commit(st, 0), DSPARK_OK);
    }
    CHECK_EQ(dspark_draft(strict.st, 0, std::int64_t(1) << 62, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan,
                          nullptr),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("n_past must be in [0, 2**62)"));
    const std::int64_t dup[] = {0, 0};
    const std::int64_t pasts[] = {5, 5};
    dspark_plan plans[2];
    CHECK_EQ(dspark_draft_many(strict.st, dup, pasts, 2, DSPARK_DTYPE_F32, out.data(), out.size() * 4, plans, nullptr),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("appears twice"));
    // n_past 5 lags behind the rows 0..11, all in the drafter's cache.
    CHECK_EQ(dspark_draft(strict.st, 0, 5, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr),
             DSPARK_E_STATE);
    CHECK(error_mentions("rows 5..11 are still buffered"));
    std::size_t sz = 0;
    CHECK_EQ(dspark_draft_size(strict.st, 0, 5, DSPARK_DTYPE_F32, &sz), DSPARK_E_STATE);
    CHECK_EQ(dspark_draft(lax.st, 0, 5, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_NO_CONTEXT);
    // At the buffered end the same skip is legitimate on both.
    CHECK_EQ(dspark_draft(strict.st, 0, 12, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_NO_CONTEXT);
    // An unknown sequence comes before a NULL plan (the order, for C's own checks too).
    CHECK_EQ(dspark_draft(strict.st, 9, 12, DSPARK_DTYPE_F32, out.data(), out.size() * 4, nullptr, nullptr),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("unknown sequence 9"));
}

// dspark_state / dspark_stats are filled from the core's field lists
// (DSPARK_SEQ_STATE_FIELDS / DSPARK_SEQ_STATS_FIELDS): a field the header
// lacks does not compile, a field only the header has breaks the size check,
// and every field is set (no 0xAB byte pattern left).
TEST_CASE(state_and_stats_fill_every_field) {
    Handle h(config());
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    dspark_state s;
    dspark_stats t;
    std::memset(&s, 0xAB, sizeof s);
    std::memset(&t, 0xAB, sizeof t);
    s.struct_size = sizeof s;
    t.struct_size = sizeof t;
    CHECK_EQ(dspark_state_get(h.st, 0, &s), DSPARK_OK);
    CHECK_EQ(dspark_stats_get(h.st, 0, &t), DSPARK_OK);
    // Per struct: its fields, the bytes they and the header take, how many were written.
    {
        const dspark_state& rec = s;
        FieldCount count;
        count.bytes = sizeof(rec.struct_size);  // its last int32 is drafting_off (was reserved0)
        DSPARK_SEQ_STATE_FIELDS(DSPARK_COUNT_FIELD)
        CHECK_EQ(count.set, count.fields);
        CHECK_EQ(sizeof(dspark_state), count.bytes);
    }
    {
        const dspark_stats& rec = t;
        FieldCount count;
        count.bytes = sizeof(rec.struct_size) + sizeof(rec.reserved0);
        DSPARK_SEQ_STATS_FIELDS(DSPARK_COUNT_FIELD)
        CHECK_EQ(count.set, count.fields);
        CHECK_EQ(sizeof(dspark_stats), count.bytes);
    }
}

// dspark_plan is filled from the core's list of the fields it mirrors
// (DSPARK_ROUND_PLAN_FIELDS) plus rows_mode and the slot runs: a listed field
// the header lacks does not compile, an unlisted one breaks the size check,
// and every listed field is set (no 0xAB byte pattern left).
TEST_CASE(plan_fills_every_listed_field) {
    Handle h(config());
    CHECK_EQ(process(h.st, 0, 0, 40), DSPARK_OK);
    std::vector<float> out(static_cast<std::size_t>(W * D));
    dspark_plan rec;
    std::memset(&rec, 0xAB, sizeof rec);
    CHECK_EQ(dspark_draft(h.st, 0, 40, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &rec, nullptr), DSPARK_OK);
    FieldCount count;
    count.bytes = sizeof(rec.rows_mode) + sizeof(rec.slot_first) + sizeof(rec.slot_count) + sizeof(rec.reserved);
    DSPARK_ROUND_PLAN_FIELDS(DSPARK_COUNT_FIELD)
    CHECK_EQ(count.set, count.fields);
    CHECK_EQ(sizeof(dspark_plan), count.bytes);
}

#if defined(__linux__)
// The process's virtual memory (VmSize, KiB), from /proc/self/status.
long vm_size_kib() {
    FILE* f = std::fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kib = -1;
    while (std::fgets(line, sizeof line, f))
        if (std::strncmp(line, "VmSize:", 7) == 0) kib = std::strtol(line + 7, nullptr, 10);
    std::fclose(f);
    return kib;
}
#endif

// A fork or shift keeps only the moves it returned: at the largest window the
// config allows, a fork of a 3-row sequence succeeds and leaves the thread
// holding three rows' worth (it once reserved window + 2 moves, 24 GiB here,
// and failed with DSPARK_E_OUT_OF_MEMORY, or kept them).
TEST_CASE(moves_take_only_what_the_call_returns) {
    dspark_config c = config(DSPARK_STORAGE_F32, 2);
    c.window = dspark::MAX_WINDOW;
    c.rows_mode = DSPARK_ROWS_EXTERNAL;
    Handle h(c);
    const auto pos = span(0, 3);
    std::int64_t slots[3];
    CHECK_EQ(dspark_process_external(h.st, 0, pos.data(), 3, slots), DSPARK_OK);
    dspark_status st = DSPARK_OK;
    const dspark_slot_move* moves = nullptr;
    std::size_t n = 0;
    long grew = 0;
    std::thread([&] {
#if defined(__linux__)
        const long before = vm_size_kib();
#endif
        st = dspark_fork(h.st, 0, 1);
        if (st == DSPARK_OK) st = dspark_last_moves(&moves, &n);
        if (st == DSPARK_OK && n == 1) {
            CHECK_EQ(moves[0].count, 3);
            CHECK_EQ(moves[0].src, 0);
        }
#if defined(__linux__)
        grew = vm_size_kib() - before;
#endif
    }).join();
    CHECK_EQ(st, DSPARK_OK);
    CHECK_EQ(n, 1u);
    CHECK(grew < 64 * 1024);  // KiB: nothing near window-sized
}

// design.md 2.1 on the C ABI: this layer's own checks (codes, NULL buffers,
// byte counts) come after the core's sequence checks, as Python's conversions do.
TEST_CASE(c_conversions_come_after_the_sequence_checks) {
    Handle h(config());
    std::int64_t pos = 0;
    CHECK_EQ(dspark_process(h.st, 9, &pos, 1, nullptr, 42, 3), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("unknown sequence 9"));
    CHECK_EQ(dspark_process_encoded(h.st, 9, nullptr, 1, nullptr, 4), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("unknown sequence 9"));
    CHECK_EQ(dspark_restore(h.st, 9, nullptr, 10), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("unknown sequence 9"));
    std::size_t sz = 0;
    CHECK_EQ(dspark_snapshot(h.st, -1, nullptr, 10, &sz), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_fail(h.st, 0, 7, nullptr), DSPARK_E_STATE);  // no open round, before the stage code
    CHECK(error_mentions("no open round"));
    const std::int64_t seqs[] = {0, 9};
    CHECK_EQ(dspark_draft_many(h.st, seqs, nullptr, 2, DSPARK_DTYPE_F32, nullptr, 0, nullptr, nullptr),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("unknown sequence 9"));
    // A known, closed sequence: now the conversion's own error.
    CHECK_EQ(dspark_restore(h.st, 0, nullptr, 10), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_process(h.st, 0, &pos, 1, nullptr, 42, 3), DSPARK_E_TYPE);
}

TEST_CASE(disabled_after_max_failures) {
    Handle h(config());
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    dspark_plan plan;
    std::vector<float> out(static_cast<std::size_t>(W * D));
    std::int64_t disabled = -1;
    for (int i = 1; i <= 3; ++i) {
        CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
        CHECK_EQ(dspark_fail(h.st, 0, DSPARK_FAIL_DECODE, &disabled), DSPARK_OK);
        CHECK_EQ(disabled, i == 3 ? 3 : 0);
    }
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_DISABLED);
    CHECK_EQ(plan.n_rows, 0);
}

// dspark_disable / dspark_enable (and their _many forms): the core's switch,
// its skip code and state field, its errors as status codes.
TEST_CASE(drafting_off_per_request) {
    Handle h(config());
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    CHECK_EQ(process(h.st, 1, 0, 5), DSPARK_OK);
    dspark_plan plan;
    std::vector<float> out(static_cast<std::size_t>(W * D));
    CHECK_EQ(dspark_disable(h.st, 0), DSPARK_OK);
    dspark_state st;
    dspark_state_init(&st);
    CHECK_EQ(dspark_state_get(h.st, 0, &st), DSPARK_OK);
    CHECK_EQ(st.drafting_off, 1);
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_DRAFTING_OFF);
    CHECK_EQ(plan.skip, static_cast<int>(dspark::Skip::DraftingOff));
    CHECK_EQ(process(h.st, 0, 5, 3), DSPARK_OK);  // rows keep flowing
    const std::int64_t bad[] = {1, 99}, both[] = {0, 1};
    CHECK_EQ(dspark_disable_many(h.st, bad, 2), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_state_get(h.st, 1, &st), DSPARK_OK);
    CHECK_EQ(st.drafting_off, 0);  // nothing changed
    CHECK_EQ(dspark_disable_many(h.st, nullptr, 2), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_enable(h.st, 99), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_disable_many(h.st, both, 2), DSPARK_OK);
    CHECK_EQ(dspark_enable_many(h.st, both, 2), DSPARK_OK);
    CHECK_EQ(dspark_state_get(h.st, 0, &st), DSPARK_OK);
    CHECK_EQ(st.drafting_off, 0);
    CHECK_EQ(dspark_draft(h.st, 0, 8, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_NONE);
    CHECK_EQ(dspark_disable(nullptr, 0), DSPARK_E_NULL_POINTER);
}

TEST_CASE(draft_too_small_reports_the_size_and_changes_nothing) {
    Handle h(config(DSPARK_STORAGE_Q8_0));
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    std::size_t need_f32 = 0, need_raw = 0, row_bytes = 0;
    CHECK_EQ(dspark_stager_row_bytes(h.st, &row_bytes), DSPARK_OK);
    CHECK_EQ(row_bytes, dspark::row_bytes(dspark::Storage::Q8_0, D));
    CHECK_EQ(dspark_draft_size(h.st, 0, 5, DSPARK_DTYPE_F32, &need_f32), DSPARK_OK);
    CHECK_EQ(need_f32, 5u * D * 4);
    CHECK_EQ(dspark_draft_size(h.st, 0, 5, DSPARK_DTYPE_STORAGE, &need_raw), DSPARK_OK);
    CHECK_EQ(need_raw, 5u * row_bytes);
    const auto before = snap(h.st, 0);
    std::vector<std::uint8_t> buf(need_f32);
    dspark_plan plan;
    std::size_t written = 0;
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, buf.data(), need_f32 - 1, &plan, &written),
             DSPARK_E_BUFFER_TOO_SMALL);
    CHECK_EQ(written, need_f32);
    CHECK(error_mentions("the plan needs 640"));
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, nullptr, 0, &plan, &written), DSPARK_E_BUFFER_TOO_SMALL);
    CHECK(snap(h.st, 0) == before);  // no round opened
    dspark_stats stats;
    dspark_stats_init(&stats);
    CHECK_EQ(dspark_stats_get(h.st, 0, &stats), DSPARK_OK);
    CHECK_EQ(stats.rounds, 0);
    // The exact size fits; decoded rows equal the decoded storage bytes.
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, buf.data(), need_f32, &plan, &written), DSPARK_OK);
    CHECK_EQ(written, need_f32);
    const auto src = rows_for(0, 5);
    std::vector<std::uint8_t> enc(5 * row_bytes);
    dspark::encode_rows(src.data(), dspark::ElemType::F32, enc.data(), dspark::Storage::Q8_0, 5, D,
                        dspark::NonFinite::Error);
    std::vector<float> dec(5 * D);
    dspark::decode_rows(enc.data(), dspark::Storage::Q8_0, dec.data(), dspark::ElemType::F32, 5, D);
    CHECK(std::memcmp(buf.data(), dec.data(), need_f32) == 0);
    CHECK_EQ(dspark_commit(h.st, 0), DSPARK_OK);
}

TEST_CASE(state_and_stats_honour_a_smaller_struct_size) {
    Handle h(config());
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    // An older caller's dspark_stats that ends after `failures`.
    dspark_stats s;
    std::memset(&s, 0xAB, sizeof s);
    s.struct_size = offsetof(dspark_stats, rebases);
    CHECK_EQ(dspark_stats_get(h.st, 0, &s), DSPARK_OK);
    CHECK_EQ(s.struct_size, offsetof(dspark_stats, rebases));
    CHECK_EQ(s.rounds, 0);
    std::int64_t untouched;
    std::memset(&untouched, 0xAB, sizeof untouched);
    CHECK(std::memcmp(&s.rebases, &untouched, sizeof untouched) == 0);  // past struct_size: not written
    s.struct_size = 2;
    CHECK_EQ(dspark_stats_get(h.st, 0, &s), DSPARK_E_INVALID_ARGUMENT);
}

TEST_CASE(c_calls_match_the_cpp_stager_in_lock_step) {
    // The window loop (B = 7, W = 20, accepts 7 3 0 7 5 1 4) through both APIs.
    Handle h(config(DSPARK_STORAGE_BF16, 1));
    dspark::StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    o.storage = dspark::Storage::BF16;
    dspark::Stager ref(o);
    const std::int64_t accepts[] = {7, 3, 0, 7, 5, 1, 4};
    std::int64_t max_rows = 0;
    CHECK_EQ(dspark_stager_max_plan_rows(h.st, &max_rows), DSPARK_OK);
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    ref.process(0, span(0, 5).data(), 5, rows_for(0, 5).data(), dspark::ElemType::F32);
    std::int64_t n_past = 5;
    std::vector<std::uint8_t> buf(static_cast<std::size_t>(W * D * 2));
    for (int rnd = 0; rnd <= 7; ++rnd) {
        dspark_plan plan;
        std::size_t written = 0;
        CHECK_EQ(dspark_draft(h.st, 0, n_past, DSPARK_DTYPE_STORAGE, buf.data(), buf.size(), &plan, &written), DSPARK_OK);
        dspark::ByteVec want;
        const dspark::RoundPlan p = ref.draft(0, n_past, want);
        CHECK_EQ(plan.start, p.start);
        CHECK_EQ(plan.rebase, p.rebase);
        CHECK_EQ(plan.clear_cache, p.clear_cache);
        CHECK_EQ(plan.pos_base, p.pos_base);
        CHECK_EQ(plan.first_row, p.first_row);
        CHECK_EQ(plan.n_rows, p.n_rows);
        CHECK_EQ(plan.crop_from, p.crop_from);
        CHECK(plan.n_rows <= max_rows);
        CHECK_EQ(written, want.size());
        CHECK(std::memcmp(buf.data(), want.data(), written) == 0);
        CHECK_EQ(dspark_commit(h.st, 0), DSPARK_OK);
        ref.commit(0);
        if (rnd == 7) break;
        const auto rows = rows_for(n_past, B + 1, rnd + 1);
        const auto pos = span(n_past, B + 1);
        CHECK_EQ(dspark_process(h.st, 0, pos.data(), pos.size(), rows.data(), DSPARK_DTYPE_F32, rows.size() * 4),
                 DSPARK_OK);
        ref.process(0, pos.data(), pos.size(), rows.data(), dspark::ElemType::F32);
        CHECK_EQ(dspark_accept(h.st, 0, accepts[rnd]), DSPARK_OK);
        ref.accept(0, accepts[rnd]);
        n_past += accepts[rnd] + 1;
    }
    dspark_stats s;
    dspark_stats_init(&s);
    CHECK_EQ(dspark_stats_get(h.st, 0, &s), DSPARK_OK);
    CHECK_EQ(s.rounds, 8);
    CHECK_EQ(s.rebases, 4);
    CHECK_EQ(s.restaged_rows, 40);
    CHECK(snap(h.st, 0) == ref.snapshot(0));
    // The acceptance histogram: each accept above verified its round.
    const std::vector<std::int64_t> want = {1, 1, 0, 1, 1, 1, 0, 2};
    CHECK(ref.accepted(0) == want);
    CHECK_EQ(s.verified_rounds, 7);
    CHECK_EQ(s.accepted_tokens, 27);
    std::vector<std::int64_t> hist(B + 2, -1);
    CHECK_EQ(dspark_accepted_get(h.st, 0, hist.data(), B), DSPARK_E_BUFFER_TOO_SMALL);  // no room: nothing written
    CHECK(error_mentions("8 buckets"));
    CHECK(hist == std::vector<std::int64_t>(B + 2, -1));
    CHECK_EQ(dspark_accepted_get(h.st, 0, hist.data(), B + 2), DSPARK_OK);
    CHECK(std::vector<std::int64_t>(hist.begin(), hist.begin() + B + 1) == want);
    CHECK_EQ(hist[B + 1], -1);
    CHECK_EQ(dspark_accepted_get(h.st, 5, hist.data(), B + 1), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_accepted_get(h.st, 0, nullptr, B + 1), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_accepted_get(nullptr, 0, hist.data(), B + 1), DSPARK_E_NULL_POINTER);
    // The batched form: sequence 0 twice (a question may repeat), and too little room.
    const std::int64_t twice[] = {0, 0};
    std::vector<std::int64_t> both(2 * (B + 1), -1);
    CHECK_EQ(dspark_accepted_many(h.st, twice, 2, both.data(), both.size() - 1), DSPARK_E_BUFFER_TOO_SMALL);
    CHECK(both == std::vector<std::int64_t>(2 * (B + 1), -1));
    const std::int64_t unknown[] = {0, 4};
    CHECK_EQ(dspark_accepted_many(h.st, unknown, 2, both.data(), both.size()), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("accepted_many: seqs[1] (sequence 4)"));
    CHECK(both == std::vector<std::int64_t>(2 * (B + 1), -1));
    CHECK_EQ(dspark_accepted_many(h.st, twice, 2, both.data(), both.size()), DSPARK_OK);
    CHECK(std::vector<std::int64_t>(both.begin(), both.begin() + B + 1) == want);
    CHECK(std::vector<std::int64_t>(both.begin() + B + 1, both.end()) == want);
    CHECK_EQ(dspark_accepted_many(h.st, nullptr, 0, nullptr, 0), DSPARK_OK);
    // The Stager's totals, after the sequence ended: its counters stay.
    CHECK_EQ(dspark_end(h.st, 0), DSPARK_OK);
    dspark_stats t;
    dspark_stats_init(&t);
    std::int64_t started = -1;
    std::fill(hist.begin(), hist.end(), -1);
    CHECK_EQ(dspark_totals_get(h.st, &t, hist.data(), B, &started), DSPARK_E_BUFFER_TOO_SMALL);
    CHECK_EQ(started, -1);
    CHECK_EQ(dspark_totals_get(h.st, &t, hist.data(), B + 1, &started), DSPARK_OK);
    CHECK(std::vector<std::int64_t>(hist.begin(), hist.begin() + B + 1) == want);
    CHECK_EQ(started, 0);
    CHECK_EQ(t.rounds, 8);
    CHECK_EQ(t.verified_rounds, 7);
    CHECK_EQ(t.rows, 0);
    CHECK_EQ(t.peak_rows, s.peak_rows);
    CHECK_EQ(dspark_totals_get(h.st, &t, nullptr, 0, nullptr), DSPARK_OK);
    CHECK_EQ(dspark_totals_get(h.st, nullptr, nullptr, 0, nullptr), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_totals_get(nullptr, &t, nullptr, 0, nullptr), DSPARK_E_NULL_POINTER);
}

TEST_CASE(draft_many_is_all_or_nothing) {
    Handle h(config(DSPARK_STORAGE_F32, 3));
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    CHECK_EQ(process(h.st, 1, 0, 9), DSPARK_OK);
    const std::int64_t seqs[] = {0, 1, 2};
    const std::int64_t pasts[] = {5, 9, 0};
    dspark_plan plans[3];
    std::vector<float> out(static_cast<std::size_t>(3 * W * D));
    std::size_t written = 0;
    const std::int64_t dup[] = {0, 0, 2};
    CHECK_EQ(dspark_draft_many(h.st, dup, pasts, 3, DSPARK_DTYPE_F32, out.data(), out.size() * 4, plans, &written),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("appears twice"));
    CHECK_EQ(dspark_draft_many(h.st, seqs, pasts, 3, DSPARK_DTYPE_F32, out.data(), 14 * D * 4 - 4, plans, &written),
             DSPARK_E_BUFFER_TOO_SMALL);
    CHECK_EQ(written, 14u * D * 4);
    dspark_state st;
    dspark_state_init(&st);
    CHECK_EQ(dspark_state_get(h.st, 0, &st), DSPARK_OK);
    CHECK(!st.open_round);
    CHECK_EQ(dspark_draft_many(h.st, seqs, pasts, 3, DSPARK_DTYPE_F32, out.data(), out.size() * 4, plans, &written),
             DSPARK_OK);
    CHECK_EQ(written, 14u * D * 4);
    CHECK_EQ(plans[0].n_rows, 5);
    CHECK_EQ(plans[1].n_rows, 9);
    CHECK_EQ(plans[2].skip, DSPARK_SKIP_EMPTY);
    const auto r1 = rows_for(0, 9);
    CHECK(std::memcmp(out.data() + 5 * D, r1.data(), r1.size() * 4) == 0);
    CHECK_EQ(dspark_draft_many(h.st, seqs, pasts, 0, DSPARK_DTYPE_F32, nullptr, 0, nullptr, &written), DSPARK_OK);
    CHECK_EQ(written, 0u);
}

TEST_CASE(snapshot_buffer_sizes) {
    Handle h(config());
    CHECK_EQ(process(h.st, 0, 0, 5), DSPARK_OK);
    std::size_t n = 0, written = 0;
    CHECK_EQ(dspark_snapshot_size(h.st, 0, &n), DSPARK_OK);
    std::vector<std::uint8_t> buf(n);
    CHECK_EQ(dspark_snapshot(h.st, 0, buf.data(), n - 1, &written), DSPARK_E_BUFFER_TOO_SMALL);
    CHECK_EQ(written, n);
    CHECK_EQ(dspark_snapshot(h.st, 0, buf.data(), n, &written), DSPARK_OK);
    CHECK_EQ(written, n);
    CHECK_EQ(dspark_restore(h.st, 1, buf.data(), n - 1), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_restore(h.st, 1, buf.data(), 0), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("truncated"));
}

TEST_CASE(encode_decode_rows_check_sizes_codes_and_overlap) {
    const auto src = rows_for(0, 3);
    std::size_t rb = 0;
    CHECK_EQ(dspark_row_bytes(DSPARK_STORAGE_Q4_0, D, &rb), DSPARK_OK);
    CHECK_EQ(rb, 18u);
    CHECK_EQ(dspark_row_bytes(DSPARK_STORAGE_Q4_0, 33, &rb), DSPARK_E_CONFIG);
    CHECK_EQ(dspark_row_bytes(11, D, &rb), DSPARK_E_TYPE);
    std::vector<std::uint8_t> enc(3 * 18);
    std::int64_t bad = 99;
    const std::size_t sb = src.size() * 4;
    CHECK_EQ(dspark_encode_rows(src.data(), DSPARK_DTYPE_F32, sb, 3, D, DSPARK_STORAGE_Q4_0, DSPARK_NONFINITE_ERROR,
                                enc.data(), enc.size() - 1, &bad), DSPARK_E_BUFFER_TOO_SMALL);
    CHECK_EQ(dspark_encode_rows(src.data(), DSPARK_DTYPE_F32, sb - 4, 3, D, DSPARK_STORAGE_Q4_0,
                                DSPARK_NONFINITE_ERROR, enc.data(), enc.size(), &bad), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_encode_rows(src.data(), 5, sb, 3, D, DSPARK_STORAGE_Q4_0, DSPARK_NONFINITE_ERROR, enc.data(),
                                enc.size(), &bad), DSPARK_E_TYPE);
    CHECK_EQ(dspark_encode_rows(src.data(), DSPARK_DTYPE_F32, sb, 3, D, DSPARK_STORAGE_Q4_0, 4, enc.data(), enc.size(),
                                &bad), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("nonfinite code 4"));
    CHECK_EQ(dspark_encode_rows(nullptr, DSPARK_DTYPE_F32, sb, 3, D, DSPARK_STORAGE_Q4_0, DSPARK_NONFINITE_ERROR,
                                enc.data(), enc.size(), &bad), DSPARK_E_NULL_POINTER);
    CHECK_EQ(bad, 99);  // rejected calls write nothing
    CHECK_EQ(dspark_encode_rows(src.data(), DSPARK_DTYPE_F32, sb, 3, D, DSPARK_STORAGE_Q4_0, DSPARK_NONFINITE_ERROR,
                                enc.data(), enc.size(), &bad), DSPARK_OK);
    CHECK_EQ(bad, -1);
    std::vector<std::uint8_t> want(enc.size());
    dspark::encode_rows(src.data(), dspark::ElemType::F32, want.data(), dspark::Storage::Q4_0, 3, D,
                        dspark::NonFinite::Error);
    CHECK(enc == want);
    // The first non-finite element is reported; the rows are still converted.
    auto nan_src = src;
    nan_src[D + 5] = std::numeric_limits<float>::infinity();
    CHECK_EQ(dspark_encode_rows(nan_src.data(), DSPARK_DTYPE_F32, sb, 3, D, DSPARK_STORAGE_Q4_0,
                                DSPARK_NONFINITE_ERROR, enc.data(), enc.size(), &bad), DSPARK_OK);
    CHECK_EQ(bad, D + 5);
    CHECK_EQ(dspark_encode_rows(nan_src.data(), DSPARK_DTYPE_F32, sb, 3, D, DSPARK_STORAGE_Q4_0, DSPARK_NONFINITE_ZERO,
                                enc.data(), enc.size(), &bad), DSPARK_OK);
    CHECK_EQ(bad, -1);
    // In place is an overlap: rejected.
    std::vector<float> inplace = src;
    CHECK_EQ(dspark_encode_rows(inplace.data(), DSPARK_DTYPE_F32, sb, 3, D, DSPARK_STORAGE_F16, DSPARK_NONFINITE_ERROR,
                                inplace.data(), sb, &bad), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("overlaps"));
    std::vector<float> dec(3 * D);
    CHECK_EQ(dspark_decode_rows(want.data(), DSPARK_STORAGE_Q4_0, want.size(), 3, D, dec.data(), DSPARK_DTYPE_F32,
                                dec.size() * 4 - 1), DSPARK_E_BUFFER_TOO_SMALL);
    CHECK_EQ(dspark_decode_rows(want.data(), DSPARK_STORAGE_Q4_0, want.size() + 1, 3, D, dec.data(), DSPARK_DTYPE_F32,
                                dec.size() * 4), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_decode_rows(want.data(), DSPARK_STORAGE_Q4_0, want.size(), 3, D, dec.data(), DSPARK_DTYPE_STORAGE,
                                dec.size() * 4), DSPARK_E_TYPE);
    CHECK_EQ(dspark_decode_rows(want.data(), DSPARK_STORAGE_Q4_0, want.size(), 3, D, dec.data(), DSPARK_DTYPE_F32,
                                dec.size() * 4), DSPARK_OK);
    std::vector<float> want_dec(3 * D);
    dspark::decode_rows(want.data(), dspark::Storage::Q4_0, want_dec.data(), dspark::ElemType::F32, 3, D);
    CHECK(dec == want_dec);
    // Sizes that overflow size_t are rejected, not wrapped.
    const std::size_t huge = std::numeric_limits<std::size_t>::max() / 8;
    CHECK_EQ(dspark_decode_rows(want.data(), DSPARK_STORAGE_F32, want.size(), huge, D, dec.data(), DSPARK_DTYPE_F32,
                                dec.size() * 4), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("overflows"));
    CHECK_EQ(dspark_encode_rows(src.data(), DSPARK_DTYPE_F32, 0, 0, D, DSPARK_STORAGE_Q4_0, DSPARK_NONFINITE_ERROR,
                                nullptr, 0, &bad), DSPARK_OK);  // zero rows: NULL is fine
}

// The window loop on `seq` through the C ABI; returns the bytes of every staged row.
std::vector<std::uint8_t> window_loop(dspark_stager* st, std::int64_t seq) {
    const std::int64_t accepts[] = {7, 3, 0, 7, 5, 1, 4};
    std::vector<std::uint8_t> all, buf(static_cast<std::size_t>(W * D * 4));
    if (process(st, seq, 0, 5, int(seq)) != DSPARK_OK) return {};
    std::int64_t n_past = 5;
    for (int rnd = 0; rnd <= 7; ++rnd) {
        dspark_plan plan;
        std::size_t written = 0;
        if (dspark_draft(st, seq, n_past, DSPARK_DTYPE_F32, buf.data(), buf.size(), &plan, &written) != DSPARK_OK ||
            dspark_commit(st, seq) != DSPARK_OK)
            return {};
        all.insert(all.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(written));
        if (rnd == 7) break;
        if (process(st, seq, n_past, B + 1, int(seq) * 16 + rnd + 1) != DSPARK_OK ||
            dspark_accept(st, seq, accepts[rnd]) != DSPARK_OK)
            return {};
        n_past += accepts[rnd] + 1;
    }
    return all;
}

TEST_CASE(one_handle_from_several_threads) {
    // Each thread drives its own sequence of one shared Stager; the results
    // equal the same loops run one after another.
    constexpr int N = 4;
    Handle serial(config(DSPARK_STORAGE_BF16, N));
    Handle shared(config(DSPARK_STORAGE_BF16, N));
    std::vector<std::vector<std::uint8_t>> want(N), got(N);
    for (int i = 0; i < N; ++i) want[i] = window_loop(serial.st, i);
    std::vector<std::thread> threads;
    for (int i = 0; i < N; ++i) threads.emplace_back([&, i] { got[i] = window_loop(shared.st, i); });
    for (auto& t : threads) t.join();
    for (int i = 0; i < N; ++i) {
        CHECK(!want[i].empty());
        CHECK(got[i] == want[i]);
    }
    CHECK(want[0] != want[1]);  // the sequences' rows differ, so a mix-up would show
}

// ---- external-row mode -----------------------------------------------------

// The owner of external rows: a table of max_seqs * ring_rows storage rows,
// written only at the slots process_external returns and moved only by the
// moves fork / shift report. Its rows at a plan's slot runs must be the held
// stager's draft rows byte for byte.
struct Mirror {
    std::size_t row_bytes = 0;
    std::vector<std::uint8_t> table;

    Mirror(dspark_stager* st, std::int64_t seqs) {
        std::int64_t ring = 0;
        CHECK_EQ(dspark_ring_rows(st, &ring), DSPARK_OK);
        CHECK_EQ(dspark_stager_row_bytes(st, &row_bytes), DSPARK_OK);
        table.assign(static_cast<std::size_t>(seqs * ring) * row_bytes, 0xEE);
    }
    std::uint8_t* row(std::int64_t slot) { return table.data() + static_cast<std::size_t>(slot) * row_bytes; }

    // Encodes rows (f32, n x D) as the owner would and writes row i at slots[i] >= 0.
    void write(const std::int64_t* slots, std::int64_t n, const std::vector<float>& rows, std::int32_t storage) {
        std::vector<std::uint8_t> enc(static_cast<std::size_t>(n) * row_bytes);
        std::int64_t bad = 0;
        CHECK_EQ(dspark_encode_rows(rows.data(), DSPARK_DTYPE_F32, rows.size() * 4, static_cast<std::size_t>(n), D,
                                    storage, DSPARK_NONFINITE_ERROR, enc.data(), enc.size(), &bad),
                 DSPARK_OK);
        CHECK_EQ(bad, -1);
        for (std::int64_t i = 0; i < n; ++i)
            if (slots[i] >= 0) std::memcpy(row(slots[i]), enc.data() + static_cast<std::size_t>(i) * row_bytes, row_bytes);
    }
    // Rows at runs (first, count), in order.
    std::vector<std::uint8_t> gather(const std::int64_t first[2], const std::int64_t count[2]) {
        std::vector<std::uint8_t> out;
        for (int k = 0; k < 2; ++k)
            for (std::int64_t i = 0; i < count[k]; ++i) out.insert(out.end(), row(first[k] + i), row(first[k] + i) + row_bytes);
        return out;
    }
    void put(const std::int64_t first[2], const std::int64_t count[2], const std::vector<std::uint8_t>& rows) {
        std::size_t at = 0;
        for (int k = 0; k < 2; ++k)
            for (std::int64_t i = 0; i < count[k]; ++i, at += row_bytes) std::memcpy(row(first[k] + i), rows.data() + at, row_bytes);
        CHECK_EQ(at, rows.size());
    }
    // Applies this thread's last moves; returns how many there were.
    std::size_t apply_last_moves() {
        const dspark_slot_move* moves = nullptr;
        std::size_t n = 99;
        CHECK_EQ(dspark_last_moves(&moves, &n), DSPARK_OK);
        for (std::size_t i = 0; i < n; ++i) {
            CHECK(moves[i].count > 0);
            // The contract: the two ranges of one move never overlap (memcpy is enough).
            CHECK(moves[i].src + moves[i].count <= moves[i].dst || moves[i].dst + moves[i].count <= moves[i].src);
            std::memcpy(row(moves[i].dst), row(moves[i].src), static_cast<std::size_t>(moves[i].count) * row_bytes);
        }
        return n;
    }
};

std::vector<dspark_slot_move> last_moves_copy() {
    const dspark_slot_move* moves = nullptr;
    std::size_t n = 0;
    CHECK_EQ(dspark_last_moves(&moves, &n), DSPARK_OK);
    return n ? std::vector<dspark_slot_move>(moves, moves + n) : std::vector<dspark_slot_move>{};
}

bool same_moves(const std::vector<dspark_slot_move>& a, const std::vector<dspark_slot_move>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
        if (a[i].src != b[i].src || a[i].dst != b[i].dst || a[i].count != b[i].count) return false;
    return true;
}

constexpr std::int32_t EXT_STORAGE = DSPARK_STORAGE_Q8_0;
constexpr std::int64_t EXT_SEQS = 3;

dspark_config external_config() {
    dspark_config c = config(EXT_STORAGE, EXT_SEQS);
    c.rows_mode = DSPARK_ROWS_EXTERNAL;
    return c;
}

// A held and an external stager fed the same calls.
struct Pair {
    Handle held{config(EXT_STORAGE, EXT_SEQS)};
    Handle ext{external_config()};
    Mirror mirror{ext.st, EXT_SEQS};
    std::int64_t processed_below_horizon = 0;  // rows process_external said not to write

    void begin(std::int64_t seq) {
        CHECK_EQ(dspark_begin(held.st, seq), DSPARK_OK);
        CHECK_EQ(dspark_begin(ext.st, seq), DSPARK_OK);
    }
    void process(std::int64_t seq, std::int64_t from, std::int64_t n, int version) {
        const auto rows = rows_for(from, n, version);
        const auto pos = span(from, n);
        CHECK_EQ(dspark_process(held.st, seq, pos.data(), pos.size(), rows.data(), DSPARK_DTYPE_F32, rows.size() * 4),
                 DSPARK_OK);
        std::vector<std::int64_t> slots(static_cast<std::size_t>(n), -7);
        CHECK_EQ(dspark_process_external(ext.st, seq, pos.data(), pos.size(), slots.data()), DSPARK_OK);
        for (std::int64_t s : slots) {
            CHECK(s >= -1);  // every entry written
            if (s < 0) ++processed_below_horizon;
        }
        mirror.write(slots.data(), n, rows, EXT_STORAGE);
    }
    // Drafts both at n_past; the plans must agree and the mirror rows at the
    // external plan's slots must be the held draft's rows. Returns the plan.
    dspark_plan draft(std::int64_t seq, std::int64_t n_past) {
        std::vector<std::uint8_t> buf(static_cast<std::size_t>(W) * mirror.row_bytes);
        dspark_plan hp, xp;
        std::size_t hw = 0, xw = 99;
        CHECK_EQ(dspark_draft(held.st, seq, n_past, DSPARK_DTYPE_STORAGE, buf.data(), buf.size(), &hp, &hw), DSPARK_OK);
        std::size_t size = 99;
        CHECK_EQ(dspark_draft_size(ext.st, seq, n_past, 77, &size), DSPARK_OK);  // rows_dtype is ignored
        CHECK_EQ(size, 0u);
        CHECK_EQ(dspark_draft(ext.st, seq, n_past, 77, nullptr, 0, &xp, &xw), DSPARK_OK);
        CHECK_EQ(xw, 0u);
        CHECK_EQ(hp.rows_mode, DSPARK_ROWS_HELD);
        CHECK_EQ(xp.rows_mode, DSPARK_ROWS_EXTERNAL);
        CHECK_EQ(xp.skip, hp.skip);
        CHECK_EQ(xp.start, hp.start);
        CHECK_EQ(xp.rebase, hp.rebase);
        CHECK_EQ(xp.clear_cache, hp.clear_cache);
        CHECK_EQ(xp.pos_base, hp.pos_base);
        CHECK_EQ(xp.first_row, hp.first_row);
        CHECK_EQ(xp.n_rows, hp.n_rows);
        CHECK_EQ(xp.crop_from, hp.crop_from);
        for (int k = 0; k < 2; ++k) {  // the same ring bookkeeping in both modes
            CHECK_EQ(xp.slot_first[k], hp.slot_first[k]);
            CHECK_EQ(xp.slot_count[k], hp.slot_count[k]);
        }
        CHECK_EQ(xp.reserved[0], 0);
        CHECK_EQ(xp.round, hp.round);  // the same calls on both: each Stager numbers its rounds alike
        CHECK_EQ(xp.round != 0, xp.skip == DSPARK_SKIP_NONE);

        CHECK_EQ(xp.slot_count[0] + xp.slot_count[1], xp.n_rows);
        CHECK_EQ(hw, static_cast<std::size_t>(hp.n_rows) * mirror.row_bytes);
        const std::vector<std::uint8_t> got = mirror.gather(xp.slot_first, xp.slot_count);
        CHECK_EQ(got.size(), hw);
        CHECK(std::memcmp(got.data(), buf.data(), hw) == 0);
        return xp;
    }
    void both(dspark_status (*call)(dspark_stager*, std::int64_t), std::int64_t seq) {
        CHECK_EQ(call(held.st, seq), DSPARK_OK);
        CHECK_EQ(call(ext.st, seq), DSPARK_OK);
    }
    void accept(std::int64_t seq, std::int64_t n) {
        CHECK_EQ(dspark_accept(held.st, seq, n), DSPARK_OK);
        CHECK_EQ(dspark_accept(ext.st, seq, n), DSPARK_OK);
    }
    // Rounds of the speculative loop from n_past; returns the new n_past.
    std::int64_t rounds(std::int64_t seq, std::int64_t n_past, int n, int version, bool* wrapped) {
        for (int r = 0; r < n; ++r) {
            const dspark_plan p = draft(seq, n_past);
            CHECK_EQ(p.skip, DSPARK_SKIP_NONE);
            if (p.skip != DSPARK_SKIP_NONE) std::printf("  seq %lld n_past %lld round %d\n", (long long)seq, (long long)n_past, r);
            if (p.slot_count[1] > 0) *wrapped = true;
            both(dspark_commit, seq);
            process(seq, n_past, B + 1, version + r);
            const std::int64_t n_acc = (r * 5 + 3) % (B + 1);
            accept(seq, n_acc);
            n_past += n_acc + 1;
        }
        return n_past;
    }
};

TEST_CASE(external_rows_match_held_rows_through_the_c_abi) {
    Pair t;
    std::int64_t ring = 0;
    CHECK_EQ(dspark_ring_rows(t.ext.st, &ring), DSPARK_OK);
    CHECK_EQ(ring, W + 512 + B + 1);  // W + TRIM_CHUNK + B + 1
    dspark_config got;
    dspark_config_init(&got);
    CHECK_EQ(dspark_stager_config(t.ext.st, &got), DSPARK_OK);
    CHECK_EQ(got.rows_mode, DSPARK_ROWS_EXTERNAL);

    // A long prefill in chunks: the ring trims its dead head and wraps.
    t.begin(0);
    std::int64_t n_past = 0;
    for (; n_past < 2 * ring + 37; n_past += 97) t.process(0, n_past, 97, 0);
    t.process(0, n_past, 3 * W, 0);  // one chunk longer than the window: its head is below the horizon
    n_past += 3 * W;
    CHECK(t.processed_below_horizon > 0);
    bool wrapped = false;
    n_past = t.rounds(0, n_past, 12, 1, &wrapped);

    // Keep prefilling in short chunks until a plan's slots wrap the ring.
    for (int i = 0; i < 200 && !wrapped; ++i) {
        t.process(0, n_past, 13, 100 + i);
        n_past += 13;
        const dspark_plan p = t.draft(0, n_past);
        if (p.slot_count[1] > 0) wrapped = true;
        t.both(dspark_commit, 0);
    }
    CHECK(wrapped);
    t.process(0, n_past, 4, 299);  // the last plan drafted at n_past: new rows before the next round
    n_past += 4;
    n_past = t.rounds(0, n_past, 6, 300, &wrapped);

    // fork: the child's rows are copied by the moves only.
    CHECK_EQ(dspark_fork(t.held.st, 0, 1), DSPARK_OK);
    const std::vector<dspark_slot_move> held_fork = last_moves_copy();
    CHECK_EQ(dspark_fork(t.ext.st, 0, 1), DSPARK_OK);
    CHECK(same_moves(last_moves_copy(), held_fork));
    const std::size_t n_fork = t.mirror.apply_last_moves();
    CHECK(n_fork >= 1 && n_fork <= 2);
    for (const dspark_slot_move& m : held_fork) CHECK(m.dst >= ring && m.dst + m.count <= 2 * ring);  // into seq 1
    std::int64_t child_past = t.rounds(1, n_past, 5, 400, &wrapped);
    n_past = t.rounds(0, n_past, 3, 500, &wrapped);  // the parent is untouched by the child's rounds

    // shift with rows on both sides of the discarded range: the tail moves.
    dspark_state s;
    dspark_state_init(&s);
    CHECK_EQ(dspark_state_get(t.ext.st, 0, &s), DSPARK_OK);
    CHECK_EQ(s.end, n_past);
    const std::int64_t n_keep = n_past - 9, n_discard = 4;
    CHECK(n_keep > s.horizon);
    CHECK_EQ(dspark_shift(t.held.st, 0, n_keep, n_discard), DSPARK_OK);
    const std::vector<dspark_slot_move> held_shift = last_moves_copy();
    CHECK_EQ(dspark_shift(t.ext.st, 0, n_keep, n_discard), DSPARK_OK);
    CHECK(same_moves(last_moves_copy(), held_shift));
    CHECK(t.mirror.apply_last_moves() > 0);
    n_past -= n_discard;
    t.process(0, n_past, 5, 600);
    n_past += 5;
    n_past = t.rounds(0, n_past, 4, 700, &wrapped);
    // A shift that moves nothing (the discarded range is the tail) reports no moves.
    CHECK_EQ(dspark_shift(t.ext.st, 1, child_past - 2, 2), DSPARK_OK);
    CHECK(last_moves_copy().empty());
    CHECK_EQ(dspark_shift(t.held.st, 1, child_past - 2, 2), DSPARK_OK);
    child_past -= 2;
    child_past = t.rounds(1, child_past, 3, 800, &wrapped);

    // snapshot / restore into other handles: the owner saves the rows at the
    // live slots and puts them back at the restore runs.
    Pair u;
    std::int64_t live_first[2], live_count[2];
    CHECK_EQ(dspark_live_slots(t.ext.st, 0, live_first, live_count), DSPARK_OK);
    CHECK_EQ(dspark_state_get(t.ext.st, 0, &s), DSPARK_OK);
    CHECK_EQ(live_count[0] + live_count[1], s.end - s.horizon);
    const std::vector<std::uint8_t> saved = t.mirror.gather(live_first, live_count);
    const std::vector<std::uint8_t> xsnap = snap(t.ext.st, 0), hsnap = snap(t.held.st, 0);
    CHECK(!xsnap.empty() && xsnap.size() < hsnap.size());  // bookkeeping only
    // seq 2 of the other pair: its slots differ from seq 0's.
    CHECK_EQ(dspark_restore(u.held.st, 2, hsnap.data(), hsnap.size()), DSPARK_OK);
    CHECK_EQ(dspark_restore(u.ext.st, 2, xsnap.data(), xsnap.size()), DSPARK_OK);
    std::int64_t rf[2] = {-5, -5}, rc[2] = {-5, -5};
    CHECK_EQ(dspark_last_restore_runs(rf, rc), DSPARK_OK);
    CHECK_EQ(rc[0] + rc[1], live_count[0] + live_count[1]);
    CHECK(rf[0] >= 2 * ring && rf[0] + rc[0] <= 3 * ring);
    std::int64_t lf[2], lc[2];
    CHECK_EQ(dspark_live_slots(u.ext.st, 2, lf, lc), DSPARK_OK);
    for (int k = 0; k < 2; ++k) {
        CHECK_EQ(lf[k] * (lc[k] > 0), rf[k] * (rc[k] > 0));
        CHECK_EQ(lc[k], rc[k]);
    }
    u.mirror.put(rf, rc, saved);
    std::int64_t u_past = u.rounds(2, n_past, 6, 900, &wrapped);
    CHECK(u_past > n_past);

    // A snapshot of the other mode is rejected; the failed restore leaves no runs.
    const std::vector<std::uint8_t> before = snap(u.ext.st, 0);
    CHECK_EQ(dspark_restore(u.ext.st, 0, hsnap.data(), hsnap.size()), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_last_restore_runs(rf, rc), DSPARK_OK);
    CHECK(rc[0] == 0 && rc[1] == 0);
    CHECK(snap(u.ext.st, 0) == before);
    CHECK_EQ(dspark_restore(u.held.st, 0, xsnap.data(), xsnap.size()), DSPARK_E_INVALID_ARGUMENT);
}

TEST_CASE(external_mode_error_paths_change_nothing) {
    Pair t;
    t.begin(0);
    t.process(0, 0, 6, 0);
    const std::vector<std::uint8_t> xs = snap(t.ext.st, 0), hs = snap(t.held.st, 0);
    const auto pos = span(6, 2);
    const auto rows = rows_for(6, 2);
    // Row calls of the other mode name the mode.
    CHECK_EQ(dspark_process(t.ext.st, 0, pos.data(), 2, rows.data(), DSPARK_DTYPE_F32, rows.size() * 4),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("external-row mode"));
    std::vector<std::uint8_t> enc(2 * t.mirror.row_bytes);
    CHECK_EQ(dspark_process_encoded(t.ext.st, 0, pos.data(), 2, enc.data(), enc.size()), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("external-row mode"));
    std::int64_t slots[2] = {-9, -9};
    CHECK_EQ(dspark_process_external(t.held.st, 0, pos.data(), 2, slots), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("needs external-row mode"));
    CHECK(slots[0] == -9 && slots[1] == -9);
    // NULL buffers, a bad position, an unknown sequence: errors, nothing written.
    CHECK_EQ(dspark_process_external(t.ext.st, 0, pos.data(), 2, nullptr), DSPARK_E_NULL_POINTER);
    CHECK(error_mentions("slots_out is NULL"));
    CHECK_EQ(dspark_process_external(t.ext.st, 0, nullptr, 2, slots), DSPARK_E_NULL_POINTER);
    CHECK(error_mentions("positions is NULL"));
    const std::int64_t gap[2] = {7, 8};
    CHECK_EQ(dspark_process_external(t.ext.st, 0, gap, 2, slots), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("positions must continue at 6, got 7"));
    CHECK(slots[0] == -9 && slots[1] == -9);
    CHECK_EQ(dspark_process_external(t.ext.st, EXT_SEQS, pos.data(), 2, slots), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_process_external(t.ext.st, 0, nullptr, 0, nullptr), DSPARK_OK);  // empty: nothing to point at
    CHECK(snap(t.ext.st, 0) == xs);
    CHECK(snap(t.held.st, 0) == hs);
    // An open round refuses process_external (StateError), as process.
    dspark_plan p;
    CHECK_EQ(dspark_draft(t.ext.st, 0, 6, DSPARK_DTYPE_STORAGE, nullptr, 0, &p, nullptr), DSPARK_OK);
    CHECK_EQ(p.skip, DSPARK_SKIP_NONE);
    CHECK_EQ(dspark_process_external(t.ext.st, 0, pos.data(), 2, slots), DSPARK_E_STATE);
    CHECK(error_mentions("open round"));
    CHECK_EQ(dspark_commit(t.ext.st, 0), DSPARK_OK);
    // A failed fork / shift leaves no moves behind (a stale list is never applied twice).
    CHECK_EQ(dspark_fork(t.ext.st, 0, 1), DSPARK_OK);
    CHECK(!last_moves_copy().empty());
    CHECK_EQ(dspark_fork(t.ext.st, 0, EXT_SEQS), DSPARK_E_INVALID_ARGUMENT);
    CHECK(last_moves_copy().empty());
    const dspark_slot_move* m = nullptr;
    std::size_t n = 0;
    CHECK_EQ(dspark_last_moves(nullptr, &n), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_last_moves(&m, nullptr), DSPARK_E_NULL_POINTER);
    std::int64_t f[2], c[2];
    CHECK_EQ(dspark_last_restore_runs(nullptr, c), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_live_slots(t.ext.st, 0, f, nullptr), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_ring_rows(nullptr, f), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_ring_rows(t.ext.st, nullptr), DSPARK_E_NULL_POINTER);
}

TEST_CASE(last_moves_are_per_thread) {
    Pair t;
    t.begin(0);
    t.process(0, 0, 6, 0);
    CHECK_EQ(dspark_fork(t.ext.st, 0, 1), DSPARK_OK);
    const std::vector<dspark_slot_move> mine = last_moves_copy();
    CHECK(!mine.empty());
    std::size_t other_n = 99;
    std::thread([&] {
        const dspark_slot_move* m = nullptr;
        dspark_last_moves(&m, &other_n);
        CHECK_EQ(dspark_fork(t.held.st, 0, 1), DSPARK_OK);  // this thread's own moves
    }).join();
    CHECK_EQ(other_n, 0u);
    CHECK(same_moves(last_moves_copy(), mine));
}

TEST_CASE(last_error_is_per_thread_and_cleared_by_success) {
    CHECK_EQ(dspark_begin(nullptr, 0), DSPARK_E_NULL_POINTER);
    std::string other = "unset";
    std::thread t([&] { other = dspark_last_error(); });
    t.join();
    CHECK(other.empty());  // the other thread made no call
    CHECK(error_mentions("stager is NULL"));
    std::size_t rb;
    CHECK_EQ(dspark_row_bytes(DSPARK_STORAGE_F32, D, &rb), DSPARK_OK);
    CHECK(std::strcmp(dspark_last_error(), "") == 0);
}

// ---- zero-copy drafts --------------------------------------------------------

// The rows of a view's runs, concatenated.
std::vector<std::uint8_t> view_bytes(const void* const data[2], const std::size_t rows[2], std::size_t row_bytes) {
    std::vector<std::uint8_t> out;
    for (int k = 0; k < 2; ++k) {
        const auto* p = static_cast<const std::uint8_t*>(data[k]);
        if (rows[k]) out.insert(out.end(), p, p + rows[k] * row_bytes);
    }
    return out;
}

// A Stager drafting with dspark_draft_view and one drafting with dspark_draft
// (storage rows), driven in lock step through rounds that rebase and wrap the
// ring: the same plans, and the view's runs are the copy's bytes, split where
// the plan's slot runs split. The runs still hold those bytes after commit.
TEST_CASE(draft_view_hands_out_the_rows_a_copying_draft_stages) {
    for (std::int32_t storage : {DSPARK_STORAGE_F32, DSPARK_STORAGE_BF16, DSPARK_STORAGE_Q8_0}) {
        Handle copy(config(storage)), view(config(storage));
        std::size_t row_bytes = 0;
        CHECK_EQ(dspark_stager_row_bytes(view.st, &row_bytes), DSPARK_OK);
        std::int64_t n_past = 0, rebases = 0, wraps = 0;
        const std::int64_t accepts[] = {0, 2, 7, 3, 1};
        for (std::int64_t round = 0; round < 400; ++round) {
            const std::int64_t n = round == 0 ? 9 : B + 1;
            CHECK_EQ(process(copy.st, 0, n_past, n, static_cast<int>(round)), DSPARK_OK);
            CHECK_EQ(process(view.st, 0, n_past, n, static_cast<int>(round)), DSPARK_OK);
            if (round) {
                const std::int64_t a = accepts[round % 5];
                CHECK_EQ(dspark_accept(copy.st, 0, a), DSPARK_OK);
                CHECK_EQ(dspark_accept(view.st, 0, a), DSPARK_OK);
                n_past += a + 1;
            } else {
                n_past = n;
            }
            std::vector<std::uint8_t> out(static_cast<std::size_t>(W) * row_bytes);
            dspark_plan pc, pv;
            std::size_t written = 0;
            CHECK_EQ(dspark_draft(copy.st, 0, n_past, DSPARK_DTYPE_STORAGE, out.data(), out.size(), &pc, &written),
                     DSPARK_OK);
            const void* data[2] = {nullptr, nullptr};
            std::size_t rows[2] = {99, 99};
            CHECK_EQ(dspark_draft_view(view.st, 0, n_past, &pv, data, rows), DSPARK_OK);
            CHECK(std::memcmp(&pc, &pv, sizeof pc) == 0);
            CHECK_EQ(static_cast<std::int64_t>(rows[0]), pv.slot_count[0]);
            CHECK_EQ(static_cast<std::int64_t>(rows[1]), pv.slot_count[1]);
            CHECK((rows[1] == 0) == (data[1] == nullptr));
            out.resize(written);
            CHECK(view_bytes(data, rows, row_bytes) == out);
            rebases += pv.rebase;
            wraps += rows[1] != 0;
            // commit and fail leave the rows in place.
            CHECK_EQ(dspark_commit(copy.st, 0), DSPARK_OK);
            CHECK_EQ(dspark_commit(view.st, 0), DSPARK_OK);
            CHECK(view_bytes(data, rows, row_bytes) == out);
        }
        CHECK(rebases > 10);
        CHECK(wraps > 0);
        CHECK(snap(copy.st, 0) == snap(view.st, 0));
    }
}

TEST_CASE(draft_view_refusals_change_nothing) {
    Handle h(config());
    CHECK_EQ(process(h.st, 0, 0, 6), DSPARK_OK);
    const std::vector<std::uint8_t> before = snap(h.st, 0);
    dspark_plan plan;
    const void* data[2];
    std::size_t rows[2];
    CHECK_EQ(dspark_draft_view(h.st, 0, 6, nullptr, data, rows), DSPARK_E_NULL_POINTER);
    CHECK(error_mentions("plan is NULL"));
    CHECK_EQ(dspark_draft_view(h.st, 0, 6, &plan, nullptr, rows), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_draft_view(h.st, 0, 6, &plan, data, nullptr), DSPARK_E_NULL_POINTER);
    // The sequence's own error comes before a NULL output's.
    CHECK_EQ(dspark_draft_view(h.st, 9, 6, &plan, data, nullptr), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_draft_view(h.st, 0, -1, &plan, data, rows), DSPARK_E_INVALID_ARGUMENT);
    CHECK(snap(h.st, 0) == before);
    // A skip is a plan with no runs.
    CHECK_EQ(dspark_draft_view(h.st, 1, 0, &plan, data, rows), DSPARK_OK);
    CHECK_EQ(plan.skip, DSPARK_SKIP_EMPTY);
    CHECK(rows[0] == 0 && rows[1] == 0 && data[0] == nullptr && data[1] == nullptr);
    dspark_config c = config();
    c.rows_mode = DSPARK_ROWS_EXTERNAL;
    Handle ext(c);
    std::int64_t slots[6];
    const std::vector<std::int64_t> pos = span(0, 6);
    CHECK_EQ(dspark_process_external(ext.st, 0, pos.data(), 6, slots), DSPARK_OK);
    CHECK_EQ(dspark_draft_view(ext.st, 0, 6, &plan, data, rows), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("draft_view needs held rows"));
    dspark_state st;
    dspark_state_init(&st);
    CHECK_EQ(dspark_state_get(ext.st, 0, &st), DSPARK_OK);
    CHECK(!st.open_round);
}

TEST_CASE(a_chain_stager_keeps_the_token_ids_it_is_given) {
    dspark_config c = config();
    c.kind = 7;
    dspark_stager* st = nullptr;
    CHECK_EQ(dspark_stager_create(&c, &st), DSPARK_E_CONFIG);
    CHECK(error_mentions("kind"));
    c.kind = DSPARK_KIND_CHAIN;
    Handle h(c);
    CHECK_EQ(dspark_begin(h.st, 0), DSPARK_OK);
    const auto rows = rows_for(0, 4);
    const auto pos = span(0, 4);
    const std::int32_t ids[4] = {40, 41, 42, 43}, bad[4] = {40, 41, -1, 43};
    const std::size_t nbytes = rows.size() * sizeof(float);
    // The plain call carries no ids: refused, nothing appended.
    CHECK_EQ(dspark_process(h.st, 0, pos.data(), 4, rows.data(), DSPARK_DTYPE_F32, nbytes), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("needs the token id of every row"));
    CHECK_EQ(dspark_process_tokens(h.st, 0, pos.data(), 4, rows.data(), DSPARK_DTYPE_F32, nbytes, bad),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("tokens[2] is -1"));
    std::int32_t out[4] = {0, 0, 0, 0};
    CHECK_EQ(dspark_tokens(h.st, 0, 0, 1, out), DSPARK_E_INVALID_ARGUMENT);  // nothing held yet
    CHECK_EQ(dspark_process_tokens(h.st, 0, pos.data(), 4, rows.data(), DSPARK_DTYPE_F32, nbytes, ids), DSPARK_OK);
    CHECK_EQ(dspark_tokens(h.st, 0, 0, 4, out), DSPARK_OK);
    CHECK(out[0] == 40 && out[3] == 43);
    CHECK_EQ(dspark_tokens(h.st, 0, 1, 4, nullptr), DSPARK_E_NULL_POINTER);
    // Batched: the ids flat as the rows.
    CHECK_EQ(dspark_begin(h.st, 1), DSPARK_OK);
    const std::int64_t seqs[2] = {1, 0}, cu[3] = {0, 2, 3}, bpos[3] = {0, 1, 4};
    const std::int32_t bids[3] = {50, 51, 44};
    const auto brows = rows_for(0, 3);
    CHECK_EQ(dspark_process_many_tokens(h.st, seqs, 2, cu, bpos, 3, brows.data(), DSPARK_DTYPE_F32,
                                        brows.size() * sizeof(float), bids),
             DSPARK_OK);
    CHECK_EQ(dspark_tokens(h.st, 1, 0, 2, out), DSPARK_OK);
    CHECK(out[0] == 50 && out[1] == 51);
    CHECK_EQ(dspark_tokens(h.st, 0, 4, 5, out), DSPARK_OK);
    CHECK_EQ(out[0], 44);
    // A tree verify batch: each node with its id; the accepted path keeps its nodes' ids.
    dspark_plan plan;
    std::vector<float> staged(static_cast<std::size_t>(W * D));
    size_t written = 0;
    CHECK_EQ(dspark_draft(h.st, 0, 5, DSPARK_DTYPE_F32, staged.data(), staged.size() * sizeof(float), &plan, &written),
             DSPARK_OK);
    CHECK_EQ(dspark_commit(h.st, 0), DSPARK_OK);
    const std::int64_t parents[3] = {-1, 0, 0};
    const std::int32_t node_ids[3] = {60, 61, 62};
    const auto trows = rows_for(5, 3);
    CHECK_EQ(dspark_process_tree(h.st, 0, 5, parents, 3, trows.data(), DSPARK_DTYPE_F32, trows.size() * sizeof(float)),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_process_tree_tokens(h.st, 0, 5, parents, 3, trows.data(), DSPARK_DTYPE_F32,
                                        trows.size() * sizeof(float), node_ids),
             DSPARK_OK);
    const std::int64_t path[2] = {0, 2};
    CHECK_EQ(dspark_accept_path(h.st, 0, path, 2), DSPARK_OK);
    CHECK_EQ(dspark_tokens(h.st, 0, 5, 7, out), DSPARK_OK);
    CHECK(out[0] == 60 && out[1] == 62);
    // A block stager keeps none: ids are refused, not dropped.
    Handle b(config());
    CHECK_EQ(dspark_begin(b.st, 0), DSPARK_OK);
    CHECK_EQ(dspark_process_tokens(b.st, 0, pos.data(), 4, rows.data(), DSPARK_DTYPE_F32, nbytes, ids),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("kept for a chain drafter"));
    CHECK_EQ(dspark_tokens(b.st, 0, 0, 0, out), DSPARK_E_INVALID_ARGUMENT);
    // External rows: the ids beside the slots.
    dspark_config e = config();
    e.kind = DSPARK_KIND_CHAIN;
    e.rows_mode = DSPARK_ROWS_EXTERNAL;
    Handle x(e);
    CHECK_EQ(dspark_begin(x.st, 0), DSPARK_OK);
    std::int64_t slots[4];
    CHECK_EQ(dspark_process_external(x.st, 0, pos.data(), 4, slots), DSPARK_E_INVALID_ARGUMENT);
    CHECK_EQ(dspark_process_external_tokens(x.st, 0, pos.data(), 4, slots, ids), DSPARK_OK);
    CHECK_EQ(dspark_tokens(x.st, 0, 2, 4, out), DSPARK_OK);
    CHECK(out[0] == 42 && out[1] == 43);
    const std::int64_t one[1] = {0}, cu1[2] = {0, 1}, p4[1] = {4};
    const std::int32_t id4[1] = {44};
    CHECK_EQ(dspark_process_external_many_tokens(x.st, one, 1, cu1, p4, 1, slots, id4), DSPARK_OK);
    CHECK_EQ(dspark_tokens(x.st, 0, 4, 5, out), DSPARK_OK);
    CHECK_EQ(out[0], 44);
}

TEST_MAIN()

TEST_CASE(tree_verify_batches_through_the_c_abi) {
    // A tree of 5 nodes (parents -1 0 0 1 2) and the path 0 2 4, against the
    // C++ Stager verifying the same tokens linearly: process + accept(2).
    Handle h(config(DSPARK_STORAGE_F32, 2));
    dspark::StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    dspark::Stager line(o);
    CHECK_EQ(process(h.st, 0, 0, 9), DSPARK_OK);
    line.process(0, span(0, 9).data(), 9, rows_for(0, 9).data(), dspark::ElemType::F32);
    dspark_plan plan;
    std::vector<std::uint8_t> buf(static_cast<std::size_t>(W * D * 4));
    CHECK_EQ(dspark_draft(h.st, 0, 9, DSPARK_DTYPE_STORAGE, buf.data(), buf.size(), &plan, nullptr), DSPARK_OK);
    CHECK_EQ(dspark_commit(h.st, 0), DSPARK_OK);
    dspark::ByteVec out;
    line.draft(0, 9, out);
    line.commit(0);
    const std::int64_t parents[] = {-1, 0, 0, 1, 2};
    const auto rows = rows_for(9, 5, 1);
    const std::size_t nbytes = rows.size() * sizeof(float);
    // Bad trees: each its status, nothing changed.
    const auto before = snap(h.st, 0);
    const std::int64_t cycle[] = {-1, 0, 2, 1, 2};
    CHECK_EQ(dspark_process_tree(h.st, 0, 9, cycle, 5, rows.data(), DSPARK_DTYPE_F32, nbytes), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("parents[2] = 2"));
    CHECK_EQ(dspark_process_tree(h.st, 0, 8, parents, 5, rows.data(), DSPARK_DTYPE_F32, nbytes), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("root must stand at the sequence's end 9"));
    CHECK_EQ(dspark_process_tree(h.st, 0, 9, nullptr, 5, rows.data(), DSPARK_DTYPE_F32, nbytes), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_process_tree(h.st, 1, 0, parents, 1, rows.data(), DSPARK_DTYPE_F32, D * 4), DSPARK_E_STATE);
    CHECK_EQ(dspark_process_tree_external(h.st, 0, 9, parents, 5, nullptr), DSPARK_E_NULL_POINTER);
    std::int64_t slots[5];
    CHECK_EQ(dspark_process_tree_external(h.st, 0, 9, parents, 5, slots), DSPARK_E_INVALID_ARGUMENT);  // held mode
    CHECK(snap(h.st, 0) == before);
    CHECK_EQ(dspark_process_tree(h.st, 0, 9, parents, 5, rows.data(), DSPARK_DTYPE_F32, nbytes), DSPARK_OK);
    dspark_state s;
    dspark_state_init(&s);
    CHECK_EQ(dspark_state_get(h.st, 0, &s), DSPARK_OK);
    CHECK_EQ(s.tree_nodes, 5);
    CHECK_EQ(dspark_accept(h.st, 0, 2), DSPARK_E_STATE);  // the tree wants its path
    CHECK(error_mentions("holds a tree verify batch"));
    const std::int64_t sibling[] = {0, 1, 4};
    CHECK_EQ(dspark_accept_path(h.st, 0, sibling, 3), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("nodes[2] = 4 is not a child of nodes[1] = 1"));
    CHECK_EQ(dspark_accept_path(h.st, 0, nullptr, 3), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_accept_path(h.st, 1, sibling, 3), DSPARK_E_STATE);  // sequence 1 holds no tree
    const std::int64_t path[] = {0, 2, 4};
    CHECK_EQ(dspark_accept_path(h.st, 0, path, 3), DSPARK_OK);
    const dspark_slot_move* moves = nullptr;
    std::size_t n_moves = 0;
    CHECK_EQ(dspark_last_moves(&moves, &n_moves), DSPARK_OK);
    CHECK_EQ(n_moves, 2u);  // node 2 -> row 1, node 4 -> row 2 (held: applied already)
    CHECK_EQ(moves[0].src - moves[0].dst, 1);
    CHECK_EQ(moves[1].src - moves[1].dst, 2);
    std::vector<float> linear;
    for (std::int64_t node : path) linear.insert(linear.end(), rows.begin() + node * D, rows.begin() + (node + 1) * D);
    line.process(0, span(9, 3).data(), 3, linear.data(), dspark::ElemType::F32);
    line.accept(0, 2);
    CHECK(snap(h.st, 0) == line.snapshot(0));
    std::int64_t hist[B + 1];
    CHECK_EQ(dspark_accepted_get(h.st, 0, hist, B + 1), DSPARK_OK);
    CHECK(line.accepted(0) == std::vector<std::int64_t>(hist, hist + B + 1));
    CHECK_EQ(hist[2], 1);
    // The batched form checks every path before it keeps any.
    CHECK_EQ(dspark_draft(h.st, 0, 12, DSPARK_DTYPE_STORAGE, buf.data(), buf.size(), &plan, nullptr), DSPARK_OK);
    CHECK_EQ(dspark_commit(h.st, 0), DSPARK_OK);
    CHECK_EQ(dspark_process_tree(h.st, 0, 12, parents, 5, rows.data(), DSPARK_DTYPE_F32, nbytes), DSPARK_OK);
    const std::int64_t seqs[] = {0};
    const std::int64_t offsets[] = {0, 3};
    CHECK_EQ(dspark_accept_path_many(h.st, seqs, 1, nullptr, path, 3), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_accept_path_many(h.st, seqs, 1, offsets, sibling, 3), DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("accept_path_many: seqs[0] (sequence 0): nodes[2] = 4"));
    CHECK_EQ(dspark_state_get(h.st, 0, &s), DSPARK_OK);
    CHECK_EQ(s.tree_nodes, 5);
    CHECK_EQ(dspark_accept_path_many(h.st, seqs, 1, offsets, path, 3), DSPARK_OK);
    CHECK_EQ(dspark_state_get(h.st, 0, &s), DSPARK_OK);
    CHECK_EQ(s.tree_nodes, 0);
    CHECK_EQ(s.end, 15);
    // The batched process_tree: a bad tree of sequence 0 refuses the whole batch.
    CHECK_EQ(dspark_draft(h.st, 0, 15, DSPARK_DTYPE_STORAGE, buf.data(), buf.size(), &plan, nullptr), DSPARK_OK);
    CHECK_EQ(dspark_commit(h.st, 0), DSPARK_OK);
    const std::int64_t tree_cu[] = {0, 5};
    const std::int64_t root = 15;
    CHECK_EQ(dspark_process_tree_many(h.st, seqs, 1, tree_cu, &root, cycle, 5, rows.data(), DSPARK_DTYPE_F32, nbytes),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(error_mentions("process_tree_many: seqs[0] (sequence 0): parents[2] = 2"));
    CHECK_EQ(dspark_process_tree_many(h.st, seqs, 1, tree_cu, nullptr, parents, 5, rows.data(), DSPARK_DTYPE_F32, nbytes),
             DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_process_tree_external_many(h.st, seqs, 1, tree_cu, &root, parents, 5, slots),
             DSPARK_E_INVALID_ARGUMENT);  // held mode
    CHECK_EQ(dspark_state_get(h.st, 0, &s), DSPARK_OK);
    CHECK_EQ(s.tree_nodes, 0);
    CHECK_EQ(dspark_process_tree_many(h.st, seqs, 1, tree_cu, &root, parents, 5, rows.data(), DSPARK_DTYPE_F32, nbytes),
             DSPARK_OK);
    CHECK_EQ(dspark_state_get(h.st, 0, &s), DSPARK_OK);
    CHECK_EQ(s.tree_nodes, 5);
}
