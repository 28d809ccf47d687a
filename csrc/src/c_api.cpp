// The C ABI (dspark/dspark.h) over the C++ Stager and row formats.
//
// Every entry point runs its body inside guarded(), which maps each C++
// exception to its status code (the core's one table, DSPARK_ERROR_KINDS)
// and the thread's last-error message: no exception crosses the C boundary.
// This layer only converts: int32 codes to the core's enums (the core's
// enum_from_code), NULL pointers and byte counts of C buffers. Every rule of
// the contract (sequence ids, round state, values, strict mode, limits) is
// the core's, so both APIs reject the same calls with the same messages, in
// the same order (docs/design.md 2.1): a conversion that fails lets the
// core's sequence checks speak first (converted()). A rejected call changes
// nothing.
#include "dspark/dspark.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"
#include "dspark/stager.hpp"

#ifndef DSPARK_VERSION_STRING
#error "DSPARK_VERSION_STRING must be defined by the build (the project version)"
#endif

#include "c_api_common.hpp"

namespace {

using dspark::ElemType;
using dspark::NonFinite;
using dspark::Storage;
using Need = dspark::Stager::Need;

// The size of the first version of dspark_config (up to rows_mode): every
// field of it is required; a field appended since (kind) takes its default
// when the caller's struct_size stops before it.
constexpr std::size_t CONFIG_V1_BYTES = offsetof(dspark_config, kind);
static_assert(CONFIG_V1_BYTES == 64, "dspark_config's first version is 64 bytes");

using namespace dspark_c;  // the shared guard, conversions, handle and last moves (c_api_common.hpp)

// The stage's message as the core words it ("stage code 7 is not one of ...").
std::string stage_code_error(std::int64_t code) {
    try {
        (void)dspark::enum_from_code<std::invalid_argument>("stage", code, dspark::FAIL_STAGE_COUNT,
                                                            dspark::fail_stage_name);
    } catch (const std::invalid_argument& e) {
        return e.what();
    }
    return {};
}

// The element type of n rows of `dtype` given as rows_bytes bytes, which must
// be exactly n x feature_dim elements (dspark_process and its batch; `prefix`
// names the batch call in the message).
ElemType checked_rows_type(const dspark_stager& st, std::int32_t dtype, std::size_t n, std::size_t rows_bytes,
                           const char* prefix) {
    const ElemType type = elem_of(dtype);
    const auto dim = static_cast<std::size_t>(st.config.feature_dim);
    const std::size_t want = mul_size(mul_size(n, dim, "rows"), dspark::elem_bytes(type), "rows");
    if (rows_bytes != want)
        throw std::invalid_argument(std::string(prefix) + "rows must be " + std::to_string(n) + " x " +
                                    std::to_string(dim) + " elements (" + std::to_string(want) + " bytes), got " +
                                    std::to_string(rows_bytes) + " bytes");
    return type;
}

// A getter: the handle, the output pointer, then *out = get(handle).
template <class T, class Get>
dspark_status get_into(const dspark_stager* st, T* out, Get&& get) {
    return guarded([&] {
        core_of(st);
        require(out, "out");
        *out = get(*st);
    });
}

// The config as this library knows it: the caller's first struct_size
// bytes, defaults for the fields past them; unknown trailing bytes must be 0.
dspark_config read_config(const dspark_config* in) {
    require(in, "config");
    std::uint32_t size;
    std::memcpy(&size, in, sizeof size);
    if (size < CONFIG_V1_BYTES)
        throw std::invalid_argument("config.struct_size is " + std::to_string(size) + ", expected at least " +
                                    std::to_string(CONFIG_V1_BYTES) + " (initialise it with dspark_config_init)");
    const auto* raw = reinterpret_cast<const unsigned char*>(in);
    for (std::size_t i = sizeof(dspark_config); i < size; ++i)
        if (raw[i]) throw dspark::Unsupported("config sets fields this library version does not know (struct_size " +
                                              std::to_string(size) + " > " + std::to_string(sizeof(dspark_config)) + ")");
    dspark_config c;
    dspark_config_init(&c);
    std::memcpy(static_cast<void*>(&c), in, std::min<std::size_t>(size, sizeof c));
    c.struct_size = sizeof c;
    return c;
}

// The core's options for a C config: the codes converted; every value is
// checked by the Stager's constructor (check_options).
dspark::StagerOptions options_of(const dspark_config& c) {
    using dspark::ConfigError;
    using dspark::enum_from_code;
    dspark::StagerOptions o;
    o.feature_dim = c.feature_dim;
    o.block_size = c.block_size;
    o.window = c.window;
    o.max_seqs = c.max_seqs;
    o.max_failures = c.max_failures;
    o.storage = enum_from_code<ConfigError>("storage", c.storage, dspark::STORAGE_COUNT, dspark::storage_name);
    o.nonfinite =
        enum_from_code<ConfigError>("nonfinite", c.nonfinite, dspark::NONFINITE_COUNT, dspark::nonfinite_name);
    o.stage = enum_from_code<ConfigError>("stage_dtype", c.stage_dtype, dspark::ELEM_TYPE_COUNT, dspark::elem_name);
    o.rows = enum_from_code<ConfigError>("rows_mode", c.rows_mode, dspark::ROW_MODE_COUNT, dspark::row_mode_name);
    static_assert(DSPARK_ROWS_EXTERNAL == static_cast<int>(dspark::RowMode::External), "the C codes follow RowMode");
    if (c.strict != 0 && c.strict != 1) throw ConfigError("strict must be 0 or 1, got " + std::to_string(c.strict));
    o.strict = c.strict == 1;
    o.kind = enum_from_code<ConfigError>("kind", c.kind, dspark::DRAFTER_KIND_COUNT, dspark::drafter_kind_name);
    static_assert(DSPARK_KIND_CHAIN == static_cast<int>(dspark::DrafterKind::Chain), "the C codes follow DrafterKind");
    return o;
}

// Bytes per staged row in `dtype` (DSPARK_DTYPE_STORAGE: the storage bytes).
std::size_t out_row_bytes(const dspark_stager& st, std::int32_t dtype) {
    if (dtype == DSPARK_DTYPE_STORAGE) return st.core.row_bytes();
    return mul_size(static_cast<std::size_t>(st.config.feature_dim), dspark::elem_bytes(elem_of(dtype)), "row size");
}

dspark_plan to_c(const dspark::RoundPlan& from, bool external) {
    dspark_plan to;
    std::memset(&to, 0, sizeof to);
    DSPARK_ROUND_PLAN_FIELDS(DSPARK_COPY_FIELD)
    to.rows_mode = external ? DSPARK_ROWS_EXTERNAL : DSPARK_ROWS_HELD;
    for (int k = 0; k < 2; ++k) {
        to.slot_first[k] = from.slot_runs[k].first;
        to.slot_count[k] = from.slot_runs[k].count;
    }
    return to;
}

// Drafts through the core's RowSink: storage bytes go straight into the
// caller's buffer, or into `scratch` and are decoded after the round opened
// (decoding cannot fail). Too small: BufferTooSmall, thrown by the core's
// call of the sink after every check and before anything changes.
class DraftSink {
public:
    // External mode: the core never calls the sink (plans carry slots), so
    // the row arguments are ignored and nothing is written.
    DraftSink(dspark_stager& st, std::int32_t dtype, void* rows, std::size_t capacity)
        : st_(st), dtype_(st.core.external() ? DSPARK_DTYPE_STORAGE : dtype),
          rows_(st.core.external() ? nullptr : static_cast<std::uint8_t*>(rows)),
          capacity_(st.core.external() ? 0 : capacity), out_row_(out_row_bytes(st, dtype_)) {
        require_buffer(rows_, capacity_, "rows");
    }

    dspark::Stager::RowSink sink() {
        return [this](const dspark::RoundPlan* plans, std::size_t n) -> std::uint8_t* {
            n_rows_ = 0;
            for (std::size_t i = 0; i < n; ++i) n_rows_ += static_cast<std::size_t>(plans[i].n_rows);
            const std::size_t need = mul_size(n_rows_, out_row_, "draft rows");
            if (need > capacity_)
                throw dspark::BufferTooSmall("the rows buffer holds " + std::to_string(capacity_) +
                                                 " bytes, the plan needs " + std::to_string(need),
                                             need);
            if (dtype_ == DSPARK_DTYPE_STORAGE) return rows_;
            scratch_.resize(n_rows_ * st_.core.row_bytes());  // may throw bad_alloc: nothing changed yet
            return scratch_.data();
        };
    }

    // Decodes the staged rows into the caller's buffer; returns the bytes written.
    std::size_t finish() noexcept {
        if (dtype_ != DSPARK_DTYPE_STORAGE && n_rows_)
            dspark::decode_rows(scratch_.data(), st_.core.options().storage, rows_, static_cast<ElemType>(dtype_),
                                n_rows_, static_cast<std::size_t>(st_.config.feature_dim));
        return n_rows_ * out_row_;
    }

private:
    dspark_stager& st_;
    std::int32_t dtype_;
    std::uint8_t* rows_;
    std::size_t capacity_;
    std::size_t out_row_;
    std::size_t n_rows_ = 0;
    dspark::ByteVec scratch_;
};

// Runs fork / shift and keeps its moves as this thread's last moves: the
// core's own vector is swapped in, so recording allocates nothing after the
// op changed the Stager (and holds only what the op returned).
template <class Op>
dspark_status with_moves(dspark_stager* st, Op&& op) {
    last_moves.clear();
    last_moves_copied = false;
    return guarded([&] {
        std::vector<dspark::SlotMove> moves = op(core_of(st));
        last_moves.swap(moves);
    });
}

// A batch call that takes its sequences only (commit_many, confirm_many, ...).
dspark_status on_seqs(dspark_stager* st, const int64_t* seqs, size_t n,
                      void (dspark::Stager::*call)(const std::int64_t*, std::size_t)) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        (core.*call)(seqs, n);
    });
}

// process_external_many and reserve_many (`op(core)`, the core's call, named
// `call`): flat positions in, one slot per row out. Held mode: the core names the mode.
dspark_status flat_slots(dspark_stager* st, const char* call, const int64_t* seqs, size_t n, const int64_t* offsets,
                         const int64_t* positions, size_t total, int64_t* slots_out,
                         const std::function<void(dspark::Stager&)>& op) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        converted_batch(core, call, seqs, n, Need::Ready, [&] {
            require(offsets, "offsets");
            require_buffer(positions, total, "positions");
            require_buffer(slots_out, total, "slots_out");
        });
        op(core);
    });
}

}  // namespace

extern "C" {

const char* dspark_version(void) { return DSPARK_VERSION_STRING; }

int32_t dspark_abi_version(void) { return DSPARK_ABI_VERSION; }

const char* dspark_last_error(void) { return last_error.c_str(); }

const char* dspark_status_name(dspark_status status) {
    switch (status) {
        case DSPARK_OK: return "DSPARK_OK";
#define DSPARK_STATUS_NAME(k, c_status, python) \
    case DSPARK_E_##c_status: return "DSPARK_E_" #c_status;
        DSPARK_ERROR_KINDS(DSPARK_STATUS_NAME)
#undef DSPARK_STATUS_NAME
        default: return "DSPARK_E_UNKNOWN";
    }
}

dspark_status dspark_stager_create(const dspark_config* config, dspark_stager** out) {
    return guarded([&] {
        require(out, "out");
        *out = nullptr;
        const dspark_config c = read_config(config);
        *out = new dspark_stager(options_of(c), c);  // the core checks every value (ConfigError)
    });
}

void dspark_stager_destroy(dspark_stager* st) { delete st; }

dspark_status dspark_ring_rows(const dspark_stager* st, int64_t* out) {
    return get_into(st, out, [](const dspark_stager& h) { return h.core.ring_rows(); });
}

dspark_status dspark_stager_config(const dspark_stager* st, dspark_config* out) {
    return guarded([&] {
        core_of(st);
        require(out, "out");
        write_sized(out, st->config);
    });
}

dspark_status dspark_stager_row_bytes(const dspark_stager* st, size_t* out) {
    return get_into(st, out, [](const dspark_stager& h) { return h.core.row_bytes(); });
}

dspark_status dspark_stager_max_plan_rows(const dspark_stager* st, int64_t* out) {
    return get_into(st, out, [](const dspark_stager& h) { return h.core.max_plan_rows(); });
}

dspark_status dspark_begin(dspark_stager* st, int64_t seq) {
    return guarded([&] { core_of(st).begin(seq); });
}

dspark_status dspark_process_tokens(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                    const void* rows, int32_t dtype, size_t rows_bytes, const int32_t* tokens) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        const ElemType t = converted(core, seq, false, [&] {
            const ElemType type = checked_rows_type(*st, dtype, n, rows_bytes, "");
            require_buffer(positions, n, "positions");
            require_buffer(rows, rows_bytes, "rows");
            return type;
        });
        core.process(seq, positions, n, rows, t, tokens);  // the core checks the tokens (kind, values)
    });
}

dspark_status dspark_process(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n, const void* rows,
                             int32_t dtype, size_t rows_bytes) {
    return dspark_process_tokens(st, seq, positions, n, rows, dtype, rows_bytes, nullptr);
}

dspark_status dspark_tokens(const dspark_stager* st, int64_t seq, int64_t from, int64_t to, int32_t* out) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        converted(core, seq, Need::Any, [&] {
            if (to > from) require_buffer(out, static_cast<std::size_t>(to - from), "out");
        });
        core.tokens(seq, from, to, out);
    });
}

dspark_status dspark_process_encoded_tokens(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                            const void* data, size_t nbytes, const int32_t* tokens) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        converted(core, seq, false, [&] {
            require_buffer(positions, n, "positions");
            require_buffer(data, nbytes, "data");
        });
        core.process_encoded(seq, positions, n, static_cast<const std::uint8_t*>(data), nbytes,  // checks nbytes
                             tokens);
    });
}

dspark_status dspark_process_encoded(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                     const void* data, size_t nbytes) {
    return dspark_process_encoded_tokens(st, seq, positions, n, data, nbytes, nullptr);
}

namespace {

// process_external and reserve (`op(core)`, the core's call): one
// sequence's positions in, one slot per row out. Held mode: the core names the mode.
dspark_status seq_slots(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n, int64_t* slots_out,
                        const std::function<void(dspark::Stager&)>& op) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        converted(core, seq, false, [&] {
            require_buffer(positions, n, "positions");
            require_buffer(slots_out, n, "slots_out");
        });
        op(core);
    });
}

}  // namespace

dspark_status dspark_process_external_tokens(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                             int64_t* slots_out, const int32_t* tokens) {
    return seq_slots(st, seq, positions, n, slots_out,
                     [&](dspark::Stager& core) { core.process_external(seq, positions, n, slots_out, tokens); });
}

dspark_status dspark_process_external(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                      int64_t* slots_out) {
    return dspark_process_external_tokens(st, seq, positions, n, slots_out, nullptr);
}

dspark_status dspark_draft_size(const dspark_stager* st, int64_t seq, int64_t n_past, int32_t rows_dtype,
                                size_t* bytes) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        // External mode: plans name slots, nothing is copied out (rows_dtype
        // is ignored, as by dspark_draft).
        const std::size_t row = converted(core, seq, false, [&] {
            require(bytes, "bytes");
            return core.external() ? std::size_t(0) : out_row_bytes(*st, rows_dtype);
        });
        const dspark::RoundPlan p = core.peek(seq, n_past);
        *bytes = mul_size(static_cast<std::size_t>(p.n_rows), row, "draft rows");
    });
}

dspark_status dspark_draft(dspark_stager* st, int64_t seq, int64_t n_past, int32_t rows_dtype, void* rows,
                           size_t rows_capacity, dspark_plan* plan, size_t* rows_written) {
    return guarded(
        [&] {
            dspark::Stager& core = core_of(st);
            if (rows_written) *rows_written = 0;
            DraftSink sink = converted(core, seq, false, [&] {
                require(plan, "plan");
                return DraftSink(*st, rows_dtype, rows, rows_capacity);
            });
            const dspark::RoundPlan p = core.draft_into(seq, n_past, sink.sink());
            const std::size_t written = sink.finish();
            *plan = to_c(p, core.external());
            if (rows_written) *rows_written = written;
        },
        rows_written);
}

dspark_status dspark_draft_view(dspark_stager* st, int64_t seq, int64_t n_past, dspark_plan* plan,
                                const void* run_data[2], size_t run_rows[2]) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        converted(core, seq, false, [&] {
            require(plan, "plan");
            require(run_data, "run_data");
            require(run_rows, "run_rows");
        });
        dspark::RowView view;
        const dspark::RoundPlan p = core.draft_view(seq, n_past, view);
        *plan = to_c(p, core.external());
        for (int k = 0; k < 2; ++k) {
            run_data[k] = view.data[k];
            run_rows[k] = view.rows[k];
        }
    });
}

dspark_status dspark_draft_many(dspark_stager* st, const int64_t* seqs, const int64_t* n_pasts, size_t n,
                                int32_t rows_dtype, void* rows, size_t rows_capacity, dspark_plan* plans,
                                size_t* rows_written) {
    return guarded(
        [&] {
            dspark::Stager& core = core_of(st);
            if (rows_written) *rows_written = 0;
            require_buffer(seqs, n, "seqs");
            DraftSink sink = [&] {
                try {
                    require_buffer(n_pasts, n, "n_pasts");
                    require_buffer(plans, n, "plans");
                    return DraftSink(*st, rows_dtype, rows, rows_capacity);
                } catch (...) {
                    core.check_batch("draft_many", seqs, n);  // the sequences' errors first (design.md 2.1)
                    throw;
                }
            }();
            std::vector<dspark::RoundPlan> out;
            core.draft_many_into(seqs, n_pasts, n, out, sink.sink());  // strict mode's checks included
            const std::size_t written = sink.finish();
            for (std::size_t i = 0; i < out.size(); ++i) plans[i] = to_c(out[i], core.external());
            if (rows_written) *rows_written = written;
        },
        rows_written);
}

dspark_status dspark_draft_many_view(dspark_stager* st, const int64_t* seqs, const int64_t* n_pasts, size_t n,
                                     dspark_plan* plans, const void** run_data, size_t* run_rows) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        converted_batch(core, "draft_many_view", seqs, n, Need::Ready, [&] {
            require_buffer(n_pasts, n, "n_pasts");
            require_buffer(plans, n, "plans");
            require_buffer(run_data, n, "run_data");  // 2 * n entries; n > 0 is what makes NULL wrong
            require_buffer(run_rows, n, "run_rows");
        });
        std::vector<dspark::RoundPlan> out;
        std::vector<dspark::RowView> views;
        core.draft_many_view(seqs, n_pasts, n, out, views);  // strict mode's checks included
        for (std::size_t i = 0; i < out.size(); ++i) {
            plans[i] = to_c(out[i], core.external());
            for (int k = 0; k < 2; ++k) {
                run_data[2 * i + k] = views[i].data[k];
                run_rows[2 * i + k] = views[i].rows[k];
            }
        }
    });
}

dspark_status dspark_process_many(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                  const int64_t* positions, size_t total, const void* rows, int32_t dtype,
                                  size_t rows_bytes) {
    return dspark_process_many_tokens(st, seqs, n, offsets, positions, total, rows, dtype, rows_bytes, nullptr);
}

dspark_status dspark_process_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                         const int64_t* positions, size_t total, const void* rows, int32_t dtype,
                                         size_t rows_bytes, const int32_t* tokens) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        const ElemType t = converted_batch(core, "process_many", seqs, n, Need::Ready, [&] {
            require(offsets, "offsets");
            const ElemType type = checked_rows_type(*st, dtype, total, rows_bytes, "process_many: ");
            require_buffer(positions, total, "positions");
            require_buffer(rows, rows_bytes, "rows");
            return type;
        });
        core.process_many(seqs, n, offsets, positions, total, rows, t, tokens);  // checks offsets against total
    });
}

dspark_status dspark_process_external_many(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                           const int64_t* positions, size_t total, int64_t* slots_out) {
    return dspark_process_external_many_tokens(st, seqs, n, offsets, positions, total, slots_out, nullptr);
}

dspark_status dspark_process_external_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                                  const int64_t* offsets, const int64_t* positions, size_t total,
                                                  int64_t* slots_out, const int32_t* tokens) {
    const char* call = "process_external_many";
    return flat_slots(st, call, seqs, n, offsets, positions, total, slots_out, [&](dspark::Stager& core) {
        core.process_external_many(seqs, n, offsets, positions, total, slots_out, call, tokens);
    });
}

dspark_status dspark_accept_many(dspark_stager* st, const int64_t* seqs, const int64_t* n_accepted, size_t n) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        converted_batch(core, "accept_many", seqs, n, Need::Ready,
                        [&] { require_buffer(n_accepted, n, "n_accepted"); });
        core.accept_many(seqs, n_accepted, n);
    });
}

dspark_status dspark_commit_many(dspark_stager* st, const int64_t* seqs, size_t n) {
    return on_seqs(st, seqs, n, &dspark::Stager::commit_many);
}

dspark_status dspark_fail_many(dspark_stager* st, const int64_t* seqs, const int32_t* stages, size_t n,
                               int64_t* disabled_after) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        // The core checks each stage code (after ids, states and uniqueness);
        // only a code wider than its enum holds is refused here, after the ids
        // and states, with the core's words.
        const std::vector<dspark::FailStage> codes = converted_batch(core, "fail_many", seqs, n, Need::Open, [&] {
            require_buffer(stages, n, "stages");
            std::vector<dspark::FailStage> out(n);
            for (std::size_t i = 0; i < n; ++i) {
                const std::int32_t code = stages[i];
                if (code < 0 || code > UINT8_MAX)
                    throw std::invalid_argument(dspark::batch_context("fail_many", i, seqs[i]) +
                                                stage_code_error(code));
                out[i] = static_cast<dspark::FailStage>(code);
            }
            return out;
        });
        core.fail_many(seqs, codes.data(), n, disabled_after);
    });
}

dspark_status dspark_reserve_tokens(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                    int64_t* slots_out, const int32_t* tokens) {
    return seq_slots(st, seq, positions, n, slots_out,
                     [&](dspark::Stager& core) { core.reserve(seq, positions, n, slots_out, tokens); });
}

dspark_status dspark_reserve(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                             int64_t* slots_out) {
    return dspark_reserve_tokens(st, seq, positions, n, slots_out, nullptr);
}

dspark_status dspark_reserve_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                         const int64_t* positions, size_t total, int64_t* slots_out,
                                         const int32_t* tokens) {
    return flat_slots(st, "reserve_many", seqs, n, offsets, positions, total, slots_out, [&](dspark::Stager& core) {
        core.reserve_many(seqs, n, offsets, positions, total, slots_out, tokens);
    });
}

dspark_status dspark_reserve_many(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                  const int64_t* positions, size_t total, int64_t* slots_out) {
    return dspark_reserve_many_tokens(st, seqs, n, offsets, positions, total, slots_out, nullptr);
}

dspark_status dspark_confirm(dspark_stager* st, int64_t seq) {
    return guarded([&] { core_of(st).confirm(seq); });
}

dspark_status dspark_cancel(dspark_stager* st, int64_t seq) {
    return guarded([&] { core_of(st).cancel(seq); });
}

dspark_status dspark_confirm_many(dspark_stager* st, const int64_t* seqs, size_t n) {
    return on_seqs(st, seqs, n, &dspark::Stager::confirm_many);
}

dspark_status dspark_cancel_many(dspark_stager* st, const int64_t* seqs, size_t n) {
    return on_seqs(st, seqs, n, &dspark::Stager::cancel_many);
}

dspark_status dspark_end(dspark_stager* st, int64_t seq) {
    return guarded([&] { core_of(st).end(seq); });
}

dspark_status dspark_end_many(dspark_stager* st, const int64_t* seqs, size_t n) {
    return on_seqs(st, seqs, n, &dspark::Stager::end_many);
}

dspark_status dspark_disable(dspark_stager* st, int64_t seq) {
    return guarded([&] { core_of(st).disable(seq); });
}

dspark_status dspark_enable(dspark_stager* st, int64_t seq) {
    return guarded([&] { core_of(st).enable(seq); });
}

dspark_status dspark_disable_many(dspark_stager* st, const int64_t* seqs, size_t n) {
    return on_seqs(st, seqs, n, &dspark::Stager::disable_many);
}

dspark_status dspark_enable_many(dspark_stager* st, const int64_t* seqs, size_t n) {
    return on_seqs(st, seqs, n, &dspark::Stager::enable_many);
}

dspark_status dspark_commit(dspark_stager* st, int64_t seq) {
    return guarded([&] { core_of(st).commit(seq); });
}

dspark_status dspark_fail(dspark_stager* st, int64_t seq, int32_t stage, int64_t* disabled_after) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        const auto s = converted(core, seq, true, [&] {
            return dspark::enum_from_code<std::invalid_argument>("stage", stage, dspark::FAIL_STAGE_COUNT,
                                                                 dspark::fail_stage_name);
        });
        const std::int64_t d = core.fail(seq, s);
        if (disabled_after) *disabled_after = d;
    });
}

dspark_status dspark_accept(dspark_stager* st, int64_t seq, int64_t n_accepted) {
    return guarded([&] { core_of(st).accept(seq, n_accepted); });
}

dspark_status dspark_process_tree(dspark_stager* st, int64_t seq, int64_t n_past, const int64_t* parents, size_t n,
                                  const void* rows, int32_t dtype, size_t rows_bytes) {
    return dspark_process_tree_tokens(st, seq, n_past, parents, n, rows, dtype, rows_bytes, nullptr);
}

dspark_status dspark_process_tree_tokens(dspark_stager* st, int64_t seq, int64_t n_past, const int64_t* parents,
                                         size_t n, const void* rows, int32_t dtype, size_t rows_bytes,
                                         const int32_t* tokens) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        const ElemType t = converted(core, seq, false, [&] {
            const ElemType type = checked_rows_type(*st, dtype, n, rows_bytes, "");
            require_buffer(parents, n, "parents");
            require_buffer(rows, rows_bytes, "rows");
            return type;
        });
        core.process_tree(seq, n_past, parents, n, rows, t, tokens);
    });
}

dspark_status dspark_process_tree_external(dspark_stager* st, int64_t seq, int64_t n_past, const int64_t* parents,
                                           size_t n, int64_t* slots_out) {
    return dspark_process_tree_external_tokens(st, seq, n_past, parents, n, slots_out, nullptr);
}

dspark_status dspark_process_tree_external_tokens(dspark_stager* st, int64_t seq, int64_t n_past,
                                                  const int64_t* parents, size_t n, int64_t* slots_out,
                                                  const int32_t* tokens) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        converted(core, seq, false, [&] {
            require_buffer(parents, n, "parents");
            require_buffer(slots_out, n, "slots_out");
        });
        core.process_tree_external(seq, n_past, parents, n, slots_out, tokens);
    });
}

dspark_status dspark_process_tree_many(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                       const int64_t* n_pasts, const int64_t* parents, size_t total, const void* rows,
                                       int32_t dtype, size_t rows_bytes) {
    return dspark_process_tree_many_tokens(st, seqs, n, offsets, n_pasts, parents, total, rows, dtype, rows_bytes,
                                           nullptr);
}

dspark_status dspark_process_tree_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                              const int64_t* n_pasts, const int64_t* parents, size_t total,
                                              const void* rows, int32_t dtype, size_t rows_bytes,
                                              const int32_t* tokens) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        const ElemType t = converted_batch(core, "process_tree_many", seqs, n, Need::Ready, [&] {
            require(offsets, "offsets");
            const ElemType type = checked_rows_type(*st, dtype, total, rows_bytes, "process_tree_many: ");
            require_buffer(n_pasts, n, "n_pasts");
            require_buffer(parents, total, "parents");
            require_buffer(rows, rows_bytes, "rows");
            return type;
        });
        core.process_tree_many(seqs, n, offsets, n_pasts, parents, total, rows, t, tokens);
    });
}

dspark_status dspark_process_tree_external_many(dspark_stager* st, const int64_t* seqs, size_t n,
                                                const int64_t* offsets, const int64_t* n_pasts,
                                                const int64_t* parents, size_t total, int64_t* slots_out) {
    return dspark_process_tree_external_many_tokens(st, seqs, n, offsets, n_pasts, parents, total, slots_out, nullptr);
}

dspark_status dspark_process_tree_external_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                                       const int64_t* offsets, const int64_t* n_pasts,
                                                       const int64_t* parents, size_t total, int64_t* slots_out,
                                                       const int32_t* tokens) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        converted_batch(core, "process_tree_external_many", seqs, n, Need::Ready, [&] {
            require(offsets, "offsets");
            require_buffer(n_pasts, n, "n_pasts");
            require_buffer(parents, total, "parents");
            require_buffer(slots_out, total, "slots_out");
        });
        core.process_tree_external_many(seqs, n, offsets, n_pasts, parents, total, slots_out,
                                        "process_tree_external_many", tokens);
    });
}

dspark_status dspark_accept_path(dspark_stager* st, int64_t seq, const int64_t* nodes, size_t n) {
    return with_moves(st, [&](dspark::Stager& core) {
        converted(core, seq, Need::Tree, [&] { require_buffer(nodes, n, "nodes"); });
        return core.accept_path(seq, nodes, n);
    });
}

dspark_status dspark_accept_path_many(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                      const int64_t* nodes, size_t total) {
    return with_moves(st, [&](dspark::Stager& core) {
        require_buffer(seqs, n, "seqs");
        converted_batch(core, "accept_path_many", seqs, n, Need::Tree, [&] {
            require(offsets, "offsets");
            require_buffer(nodes, total, "nodes");
        });
        return core.accept_path_many(seqs, n, offsets, nodes, total);
    });
}

dspark_status dspark_rollback(dspark_stager* st, int64_t seq, int64_t n_past) {
    return guarded([&] { core_of(st).rollback(seq, n_past); });
}

dspark_status dspark_shift(dspark_stager* st, int64_t seq, int64_t n_keep, int64_t n_discard) {
    return with_moves(st, [&](dspark::Stager& core) { return core.shift(seq, n_keep, n_discard); });
}

dspark_status dspark_fork(dspark_stager* st, int64_t src, int64_t dst) {
    return with_moves(st, [&](dspark::Stager& core) { return core.fork(src, dst); });
}

dspark_status dspark_last_moves(const dspark_slot_move** moves, size_t* n) {
    return guarded([&] {
        require(moves, "moves");
        require(n, "n");
        if (!last_moves_copied) {
            // A copy of exactly the last call's moves (the previous copy is freed).
            std::vector<dspark_slot_move> c;
            c.reserve(last_moves.size());
            for (const dspark::SlotMove& m : last_moves) c.push_back(dspark_slot_move{m.src, m.dst, m.count});
            last_moves_c.swap(c);
            last_moves_copied = true;
        }
        *moves = last_moves_c.empty() ? nullptr : last_moves_c.data();
        *n = last_moves_c.size();
    });
}

dspark_status dspark_live_slots(const dspark_stager* st, int64_t seq, int64_t first[2], int64_t count[2]) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require(first, "first");
        require(count, "count");
        dspark::SlotRun runs[2];
        core.live_slots(seq, runs);
        for (int k = 0; k < 2; ++k) {
            first[k] = runs[k].first;
            count[k] = runs[k].count;
        }
    });
}

dspark_status dspark_last_restore_runs(int64_t first[2], int64_t count[2]) {
    return guarded([&] {
        require(first, "first");
        require(count, "count");
        for (int k = 0; k < 2; ++k) {
            first[k] = last_restore_runs[k].first;
            count[k] = last_restore_runs[k].count;
        }
    });
}

dspark_status dspark_snapshot_size(const dspark_stager* st, int64_t seq, size_t* bytes) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        converted(core, seq, false, [&] { require(bytes, "bytes"); });
        *bytes = core.snapshot_size(seq);
    });
}

dspark_status dspark_snapshot(const dspark_stager* st, int64_t seq, void* out, size_t capacity, size_t* written) {
    return guarded(
        [&] {
            const dspark::Stager& core = core_of(st);
            if (written) *written = 0;
            converted(core, seq, false, [&] { require_buffer(out, capacity, "out"); });
            // The core writes straight into `out` (one pass, no copy), or
            // throws BufferTooSmall with the size needed.
            const std::size_t n = core.snapshot_into(seq, static_cast<std::uint8_t*>(out), capacity);
            if (written) *written = n;
        },
        written);
}

dspark_status dspark_restore(dspark_stager* st, int64_t seq, const void* data, size_t nbytes) {
    last_restore_runs[0] = last_restore_runs[1] = dspark::SlotRun{};
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        converted(core, seq, false, [&] { require_buffer(data, nbytes, "data"); });
        dspark::SlotRun runs[2];
        core.restore(seq, static_cast<const std::uint8_t*>(data), nbytes, runs);  // checks every byte
        last_restore_runs[0] = runs[0];
        last_restore_runs[1] = runs[1];
    });
}

// The core's field lists (stager.hpp): a field of SeqState / SeqStats that
// dspark_state / dspark_stats lacks does not compile.
dspark_status dspark_open_round_ids(const dspark_stager* st, const int64_t* seqs, size_t n, uint64_t* out) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        require_buffer(out, n, "out");
        core.open_round_ids(seqs, n, out);
    });
}

dspark_status dspark_state_get(const dspark_stager* st, int64_t seq, dspark_state* out) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        get_record(out, [&] { return core.state(seq); }, [](const dspark::SeqState& from, dspark_state& to) {
            DSPARK_SEQ_STATE_FIELDS(DSPARK_COPY_FIELD)
        });
    });
}

dspark_status dspark_stats_get(const dspark_stager* st, int64_t seq, dspark_stats* out) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        get_record(out, [&] { return core.stats(seq); }, [](const dspark::SeqStats& from, dspark_stats& to) {
            DSPARK_SEQ_STATS_FIELDS(DSPARK_COPY_FIELD)
        });
    });
}

namespace {
// A histogram of block_size + 1 buckets needs that much room (BufferTooSmall).
void check_buckets(const dspark::Stager& core, size_t n) {
    const auto buckets = static_cast<size_t>(core.options().block_size) + 1;
    if (n < buckets)
        throw dspark::BufferTooSmall("the histogram has " + std::to_string(buckets) +
                                         " buckets (block_size + 1), got room for " + std::to_string(n),
                                     buckets);
}
}  // namespace

dspark_status dspark_accepted_get(const dspark_stager* st, int64_t seq, int64_t* out, size_t n) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require(out, "out");
        check_buckets(core, n);
        const std::vector<int64_t> h = core.accepted(seq);
        std::copy(h.begin(), h.end(), out);
    });
}

dspark_status dspark_accepted_many(const dspark_stager* st, const int64_t* seqs, size_t n, int64_t* out,
                                   size_t out_n) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        const auto buckets = static_cast<size_t>(core.options().block_size) + 1;
        require_buffer(out, out_n, "out");
        if (n && out_n / n < buckets)
            throw dspark::BufferTooSmall("accepted_many: " + std::to_string(n) + " histograms of " +
                                             std::to_string(buckets) + " buckets need " +
                                             std::to_string(n * buckets) + " entries, got room for " +
                                             std::to_string(out_n),
                                         n * buckets);
        core.accepted_many(seqs, n, out);
    });
}

dspark_status dspark_totals_get(const dspark_stager* st, dspark_stats* out, int64_t* accepted, size_t n,
                                int64_t* started) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require(out, "out");
        if (accepted) check_buckets(core, n);
        const dspark::StagerTotals t = core.totals();
        get_record(out, [&] { return t.stats; }, [](const dspark::SeqStats& from, dspark_stats& to) {
            DSPARK_SEQ_STATS_FIELDS(DSPARK_COPY_FIELD)
        });
        if (accepted) std::copy(t.accepted.begin(), t.accepted.end(), accepted);
        if (started) *started = t.started;
    });
}

dspark_status dspark_row_bytes(int32_t storage, size_t dim, size_t* out) {
    return guarded([&] {
        require(out, "out");
        *out = dspark::row_bytes(storage_of(storage), dim);
    });
}

dspark_status dspark_encode_rows(const void* src, int32_t src_dtype, size_t src_bytes, size_t n_rows, size_t dim,
                                 int32_t storage, int32_t nonfinite, void* dst, size_t dst_capacity,
                                 int64_t* first_bad) {
    return guarded([&] {
        const ElemType in = elem_of(src_dtype);
        const Storage out = storage_of(storage);
        const NonFinite policy = nonfinite_of(nonfinite);
        const std::size_t rb = dspark::row_bytes(out, dim);  // ConfigError for q formats and dim % 32
        const std::size_t in_bytes = mul_size(mul_size(n_rows, dim, "encode_rows input"), dspark::elem_bytes(in),
                                              "encode_rows input");
        if (src_bytes != in_bytes)
            throw std::invalid_argument("encode_rows: the input must be " + std::to_string(n_rows) + " x " +
                                        std::to_string(dim) + " elements (" + std::to_string(in_bytes) +
                                        " bytes), got " + std::to_string(src_bytes) + " bytes");
        const std::size_t out_bytes = mul_size(n_rows, rb, "encode_rows output");
        if (dst_capacity < out_bytes)
            throw dspark::BufferTooSmall("encode_rows: dst holds " + std::to_string(dst_capacity) + " bytes, needs " +
                                             std::to_string(out_bytes),
                                         out_bytes);
        require_buffer(src, src_bytes, "src");
        require_buffer(dst, out_bytes, "dst");
        // The core refuses a dst overlapping src.
        const std::int64_t bad = n_rows ? dspark::encode_rows(src, in, dst, out, n_rows, dim, policy) : -1;
        if (first_bad) *first_bad = bad;
    });
}

dspark_status dspark_decode_rows(const void* src, int32_t storage, size_t src_bytes, size_t n_rows, size_t dim,
                                 void* dst, int32_t dst_dtype, size_t dst_capacity) {
    return guarded([&] {
        const Storage in = storage_of(storage);
        const ElemType out = elem_of(dst_dtype);
        const std::size_t rb = dspark::row_bytes(in, dim);
        const std::size_t in_bytes = mul_size(n_rows, rb, "decode_rows input");
        if (src_bytes != in_bytes)
            throw std::invalid_argument("decode_rows: the input must be " + std::to_string(n_rows) + " rows of " +
                                        std::to_string(rb) + " bytes (" + std::to_string(in_bytes) + "), got " +
                                        std::to_string(src_bytes) + " bytes");
        const std::size_t out_bytes = mul_size(mul_size(n_rows, dim, "decode_rows output"), dspark::elem_bytes(out),
                                               "decode_rows output");
        if (dst_capacity < out_bytes)
            throw dspark::BufferTooSmall("decode_rows: dst holds " + std::to_string(dst_capacity) + " bytes, needs " +
                                             std::to_string(out_bytes),
                                         out_bytes);
        require_buffer(src, src_bytes, "src");
        require_buffer(dst, out_bytes, "dst");
        // The core refuses a dst overlapping src.
        if (n_rows) dspark::decode_rows(src, in, dst, out, n_rows, dim);
    });
}

}  // extern "C"
