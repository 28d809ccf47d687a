// The C ABI of the device step (dspark/dspark.h, "the device step") over the
// Stager's to_device / to_host / step_many / check_step. As c_api.cpp: every
// entry point runs inside guarded() (the core's one error table) and only
// converts; the codes and the output struct mirror dspark/step_math.hpp's,
// checked here at compile time.
#include <cstddef>

#include "c_api_common.hpp"
#include "dspark/dspark.h"
#include "dspark/stager.hpp"
#include "dspark/step_math.hpp"

namespace {

using namespace dspark_c;
namespace step = dspark::device_step;

// The C enums and the core's are different types: compare their values.
constexpr bool eq(int c_code, int core_code) { return c_code == core_code; }
static_assert(eq(DSPARK_STEP_OK, step::STATUS_OK) && eq(DSPARK_STEP_NOT_IN_STEP, step::STATUS_NOT_IN_STEP) &&
                  eq(DSPARK_STEP_FIRST_ERROR, step::STATUS_FIRST_ERROR) &&
                  eq(DSPARK_STEP_NOT_ON_DEVICE, step::STATUS_NOT_ON_DEVICE) &&
                  eq(DSPARK_STEP_DUPLICATE, step::STATUS_DUPLICATE) && eq(DSPARK_STEP_BAD_COUNT, step::STATUS_BAD_COUNT) &&
                  eq(DSPARK_STEP_POSITION_LIMIT, step::STATUS_POSITION_LIMIT) &&
                  eq(DSPARK_STEP_INTERNAL, step::STATUS_INTERNAL) && eq(DSPARK_STEP_DAMAGED, step::STATUS_DAMAGED) &&
                  eq(DSPARK_STEP_DAMAGED, step::STATUS_LAST),
              "the C status codes are step_math.hpp's");
static_assert(DSPARK_STEP_PADDING_ID == step::PADDING_ID, "the C padding id is step_math.hpp's");
static_assert(eq(DSPARK_STEP_REBASE, step::PLAN_REBASE) && eq(DSPARK_STEP_CLEAR_CACHE, step::PLAN_CLEAR_CACHE),
              "the C plan flags are step_math.hpp's");

// The step writes each output as its element type: each must be aligned for it.
step::Outputs outputs_of(const dspark_step_out& from) {
    step::Outputs to;
#define DSPARK_COPY_OUTPUT(type, name, shape) \
    require_aligned(from.name, "out->" #name);  \
    to.name = from.name;
    DSPARK_STEP_OUTPUT_FIELDS(DSPARK_COPY_OUTPUT)
#undef DSPARK_COPY_OUTPUT
    return to;
}

}  // namespace

extern "C" {

dspark_status dspark_step_config_get(const dspark_stager* st, dspark_step_config* out) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        get_record(out, [&] { return core.step_config(); }, [](const step::Config& from, dspark_step_config& to) {
            DSPARK_STEP_CONFIG_FIELDS(DSPARK_COPY_FIELD)
        });
    });
}

dspark_status dspark_on_device(const dspark_stager* st, int64_t seq, int32_t* on) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require(on, "on");
        *on = core.on_device(seq) ? 1 : 0;
    });
}

dspark_status dspark_step_layout(const dspark_stager* st, int64_t* fields, int64_t* max_rows) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        if (fields) *fields = step::columns(core.step_config());
        if (max_rows) *max_rows = core.step_config().max_rows;
    });
}

dspark_status dspark_step_state(dspark_stager* st, int64_t** state) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require(state, "state");
        *state = core.step_state();
    });
}

dspark_status dspark_to_device(dspark_stager* st, const int64_t* seqs, size_t n) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        core.to_device(seqs, n);
    });
}

dspark_status dspark_to_host(dspark_stager* st, const int64_t* seqs, size_t n, const int32_t* outcomes,
                             int64_t* disabled_after) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        require_aligned(outcomes, "outcomes");
        require_aligned(disabled_after, "disabled_after");
        core.to_host(seqs, n, outcomes, disabled_after);
    });
}

dspark_status dspark_to_device_tokens(dspark_stager* st, const int64_t* seqs, size_t n, int32_t* tokens,
                                     size_t n_tokens) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        require(tokens, "tokens");
        require_aligned(tokens, "tokens");
        core.to_device(seqs, n, tokens, n_tokens);
    });
}

dspark_status dspark_to_host_tokens(dspark_stager* st, const int64_t* seqs, size_t n, const int32_t* outcomes,
                                   int64_t* disabled_after, const int32_t* tokens, size_t n_tokens) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        require(tokens, "tokens");
        require_aligned(tokens, "tokens");
        require_aligned(outcomes, "outcomes");
        require_aligned(disabled_after, "disabled_after");
        core.to_host(seqs, n, outcomes, disabled_after, tokens, n_tokens);
    });
}

dspark_status dspark_step_many(dspark_stager* st, const int64_t* seqs, const int64_t* n_accepted, size_t n,
                               const dspark_step_out* out) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        require_buffer(n_accepted, n, "n_accepted");
        require(out, "out");
        core.step_many(seqs, n_accepted, n, outputs_of(*out));
    });
}

dspark_status dspark_check_step(const dspark_stager* st, const int64_t* seqs, const int32_t* statuses, size_t n) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        require_buffer(statuses, n, "statuses");
        core.check_step(seqs, statuses, n);
    });
}

dspark_status dspark_step_rows(dspark_stager* st, const int64_t* seqs, size_t n, const dspark_step_out* out,
                               size_t capacity, int64_t* row_offsets, int64_t* row_slots, int32_t* row_positions) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        require(out, "out");
        require(row_offsets, "row_offsets");
        require_aligned(row_offsets, "row_offsets");
        require_aligned(row_slots, "row_slots");
        require_aligned(row_positions, "row_positions");
        step::CsrRows rows;
        rows.row_offsets = row_offsets;
        rows.row_slots = row_slots;
        rows.row_positions = row_positions;
        core.step_rows(seqs, n, outputs_of(*out), capacity, rows);
    });
}

}  // extern "C"
