// The C ABI (dspark/dspark.h) over the C++ Stager and row formats.
//
// Every entry point runs its body inside guarded(), which maps each C++
// exception to a status code and the thread's last-error message: no
// exception crosses the C boundary. Argument checks that the Python binding
// makes before calling the core (null pointers, code ranges, byte counts,
// max_seqs) are made here; every value check the core makes itself (sequence
// ids, positions, protocol state, ...) is left to it, so both APIs reject the
// same calls with the same messages. A rejected call changes nothing.
#include "dspark/dspark.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"
#include "dspark/stager.hpp"
#include "c_api_common.hpp"

#ifndef DSPARK_VERSION_STRING
#error "DSPARK_VERSION_STRING must be defined by the build (the project version)"
#endif

namespace {

using namespace dspark_c;  // guarded, require, last_error(), last_moves(), ... (c_api_common.hpp)
using dspark::ElemType;
using dspark::NonFinite;
using dspark::Storage;

// Python's MAX_SEQS_LIMIT (config.py): a sanity limit on sequence slots.
constexpr std::int64_t MAX_SEQS_LIMIT = std::int64_t(1) << 16;
// The size of the first version of dspark_config: every field of it is required.
constexpr std::size_t CONFIG_V1_BYTES = sizeof(dspark_config);

// The runs of this thread's last dspark_restore (dspark_last_restore_runs),
// reset before the call runs. (The last error and last moves: c_api_common.hpp.)
thread_local dspark::SlotRun last_restore_runs[2];

Storage storage_of(std::int32_t code, bool config) {
    if (code < 0 || code >= dspark::STORAGE_COUNT) {
        const std::string msg = "storage code " + std::to_string(code) +
                                " is not supported; use DSPARK_STORAGE_F32/F16/BF16/Q8_0/Q4_0 (0..4)";
        if (config) throw dspark::ConfigError(msg);
        throw dspark::TypeError(msg);
    }
    return static_cast<Storage>(code);
}

ElemType elem_of(std::int32_t code, const char* what) {
    if (code < DSPARK_DTYPE_F32 || code > DSPARK_DTYPE_BF16)
        throw dspark::TypeError(std::string(what) + ": dtype code " + std::to_string(code) +
                                " is not supported (expected DSPARK_DTYPE_F32, F16 or BF16)");
    return static_cast<ElemType>(code);
}

NonFinite nonfinite_of(std::int32_t code, bool config) {
    static_assert(DSPARK_NONFINITE_CLAMP + 1 == dspark::NONFINITE_COUNT, "the C codes follow dspark::NonFinite");
    if (code < 0 || code >= dspark::NONFINITE_COUNT) {
        const std::string msg = "nonfinite code " + std::to_string(code) +
                                " is not supported; use DSPARK_NONFINITE_ERROR, ZERO, CLAMP_F16 or CLAMP (0..3)";
        if (config) throw dspark::ConfigError(msg);
        throw std::invalid_argument(msg);
    }
    return static_cast<NonFinite>(code);
}

void require_disjoint(const void* a, std::size_t na, const void* b, std::size_t nb) {
    const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
    if (na && nb && pa < pb + nb && pb < pa + na)
        throw std::invalid_argument("the output buffer overlaps the input buffer");
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
        if (raw[i]) throw Unsupported("config sets fields this library version does not know (struct_size " +
                                      std::to_string(size) + " > " + std::to_string(sizeof(dspark_config)) + ")");
    dspark_config c;
    dspark_config_init(&c);
    std::memcpy(static_cast<void*>(&c), in, std::min<std::size_t>(size, sizeof c));
    c.struct_size = sizeof c;
    return c;
}

// Bytes per staged row in `dtype` (DSPARK_DTYPE_STORAGE: the storage bytes).
std::size_t out_row_bytes(const dspark_stager& st, std::int32_t dtype) {
    if (dtype == DSPARK_DTYPE_STORAGE) return st.core.row_bytes();
    return mul_size(static_cast<std::size_t>(st.config.feature_dim), dspark::elem_bytes(elem_of(dtype, "draft rows")),
                    "row size");
}

// strict: a draft at n_past that would skip because the buffered rows do not
// end at n_past - 1 (a protocol mismatch: a missing accept, rollback or
// process) is a StateError, with the cause (Python: protocol_mismatch.py).
void check_strict(const dspark_stager& st, std::int64_t seq, std::int64_t n_past) {
    if (!st.config.strict) return;
    const dspark::SeqState s = st.core.state(seq);
    if (s.disabled || !s.started || n_past <= s.n_cache || s.end == n_past) return;
    const std::string cause =
        s.end > n_past
            ? "rows " + std::to_string(n_past) + ".." + std::to_string(s.end - 1) +
                  " are still buffered: was accept() not called after the verify batch (it keeps n_accepted + 1 "
                  "of its rows), or is a rollback() to the target's n_past missing?"
            : "rows " + std::to_string(s.end) + ".." + std::to_string(n_past - 1) +
                  " were never processed: every target decode (prefill chunk, verify batch) must be passed to "
                  "process()";
    throw dspark::StateError("sequence " + std::to_string(seq) + ": draft(n_past=" + std::to_string(n_past) +
                             ") does not match the buffered rows (newest " + std::to_string(s.end - 1) + "): " +
                             cause + " (strict=True; nothing changed)");
}

dspark_plan to_c(const dspark::RoundPlan& p, bool external) {
    dspark_plan c;
    std::memset(&c, 0, sizeof c);
    c.seq = p.seq;
    c.start = p.start;
    c.pos_base = p.pos_base;
    c.first_row = p.first_row;
    c.n_rows = p.n_rows;
    c.crop_from = p.crop_from;
    c.skip = static_cast<std::int32_t>(p.skip);
    c.rebase = p.rebase;
    c.clear_cache = p.clear_cache;
    c.rows_mode = external ? DSPARK_ROWS_EXTERNAL : DSPARK_ROWS_HELD;
    for (int k = 0; k < 2; ++k) {
        c.slot_first[k] = p.slot_runs[k].first;
        c.slot_count[k] = p.slot_runs[k].count;
    }
    return c;
}

// Drafts through the core's RowSink: storage bytes go straight into the
// caller's buffer, or into `scratch` and are decoded after the round opened
// (decoding cannot fail). Too small: TooSmall before anything changes.
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
                throw TooSmall("the rows buffer holds " + std::to_string(capacity_) + " bytes, the plan needs " +
                               std::to_string(need), need);
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

// Runs fork / shift and keeps its moves as this thread's last moves. The
// room is reserved before the op, so recording cannot fail after it changed
// the stager (a move list holds at most 2 + ring_rows pieces).
template <class Op>
dspark_status with_moves(dspark_stager* st, Op&& op) {
    last_moves().clear();
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        last_moves().reserve(static_cast<std::size_t>(core.ring_rows()) + 2);
        const std::vector<dspark::SlotMove> moves = op(core);
        for (const dspark::SlotMove& m : moves) last_moves().push_back(dspark_slot_move{m.src, m.dst, m.count});
    });
}

}  // namespace

extern "C" {

const char* dspark_version(void) { return DSPARK_VERSION_STRING; }

int32_t dspark_abi_version(void) { return DSPARK_ABI_VERSION; }

const char* dspark_last_error(void) { return last_error().c_str(); }

const char* dspark_status_name(dspark_status status) {
    switch (status) {
        case DSPARK_OK: return "DSPARK_OK";
        case DSPARK_E_INVALID_ARGUMENT: return "DSPARK_E_INVALID_ARGUMENT";
        case DSPARK_E_CONFIG: return "DSPARK_E_CONFIG";
        case DSPARK_E_STATE: return "DSPARK_E_STATE";
        case DSPARK_E_TYPE: return "DSPARK_E_TYPE";
        case DSPARK_E_NULL_POINTER: return "DSPARK_E_NULL_POINTER";
        case DSPARK_E_BUFFER_TOO_SMALL: return "DSPARK_E_BUFFER_TOO_SMALL";
        case DSPARK_E_OUT_OF_MEMORY: return "DSPARK_E_OUT_OF_MEMORY";
        case DSPARK_E_UNSUPPORTED: return "DSPARK_E_UNSUPPORTED";
        case DSPARK_E_INTERNAL: return "DSPARK_E_INTERNAL";
        default: return "DSPARK_E_UNKNOWN";
    }
}

dspark_status dspark_stager_create(const dspark_config* config, dspark_stager** out) {
    return guarded([&] {
        require(out, "out");
        *out = nullptr;
        const dspark_config c = read_config(config);
        if (c.rows_mode != DSPARK_ROWS_HELD && c.rows_mode != DSPARK_ROWS_EXTERNAL)
            throw dspark::ConfigError("rows_mode " + std::to_string(c.rows_mode) +
                                      " is not a rows mode (DSPARK_ROWS_HELD 0 or DSPARK_ROWS_EXTERNAL 1)");
        if (c.max_seqs > MAX_SEQS_LIMIT)
            throw dspark::ConfigError("max_seqs (" + std::to_string(c.max_seqs) + ") exceeds the limit " +
                                      std::to_string(MAX_SEQS_LIMIT));
        dspark::StagerOptions o;
        o.feature_dim = c.feature_dim;
        o.block_size = c.block_size;
        o.window = c.window;
        o.max_seqs = c.max_seqs;
        o.storage = storage_of(c.storage, true);
        o.max_failures = c.max_failures;
        o.nonfinite = nonfinite_of(c.nonfinite, true);
        if (c.stage_dtype < DSPARK_DTYPE_F32 || c.stage_dtype > DSPARK_DTYPE_BF16)
            throw dspark::ConfigError("stage_dtype code " + std::to_string(c.stage_dtype) +
                                      " is not supported; use DSPARK_DTYPE_F32, F16 or BF16");
        o.stage = static_cast<ElemType>(c.stage_dtype);
        o.rows = c.rows_mode == DSPARK_ROWS_EXTERNAL ? dspark::RowMode::External : dspark::RowMode::Held;
        if (c.strict != 0 && c.strict != 1)
            throw dspark::ConfigError("strict must be 0 or 1, got " + std::to_string(c.strict));
        *out = new dspark_stager(o, c);  // the core checks every value (ConfigError)
    });
}

void dspark_stager_destroy(dspark_stager* st) { delete st; }

dspark_status dspark_ring_rows(const dspark_stager* st, int64_t* out) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require(out, "out");
        *out = core.ring_rows();
    });
}

dspark_status dspark_stager_config(const dspark_stager* st, dspark_config* out) {
    return guarded([&] {
        core_of(st);
        require(out, "out");
        write_sized(out, st->config);
    });
}

dspark_status dspark_stager_row_bytes(const dspark_stager* st, size_t* out) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require(out, "out");
        *out = core.row_bytes();
    });
}

dspark_status dspark_stager_max_plan_rows(const dspark_stager* st, int64_t* out) {
    return guarded([&] {
        core_of(st);
        require(out, "out");
        // Without a rebase start - pos_base + B <= W bounds the rows; a rebase
        // stages at most w_keep <= W - B.
        *out = st->config.window - st->config.block_size;
    });
}

dspark_status dspark_begin(dspark_stager* st, int64_t seq) {
    return guarded([&] { core_of(st).begin(seq); });
}

dspark_status dspark_process(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n, const void* rows,
                             int32_t dtype, size_t rows_bytes) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        core.check_ready(seq);
        const ElemType t = elem_of(dtype, "process");
        const std::size_t want = mul_size(mul_size(n, static_cast<std::size_t>(st->config.feature_dim), "rows"),
                                          dspark::elem_bytes(t), "rows");
        if (rows_bytes != want)
            throw std::invalid_argument("rows must be " + std::to_string(n) + " x " +
                                        std::to_string(st->config.feature_dim) + " elements (" + std::to_string(want) +
                                        " bytes), got " + std::to_string(rows_bytes) + " bytes");
        require_buffer(positions, n, "positions");
        require_buffer(rows, rows_bytes, "rows");
        core.process(seq, positions, n, rows, t);
    });
}

dspark_status dspark_process_encoded(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                     const void* data, size_t nbytes) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        core.check_ready(seq);
        require_buffer(positions, n, "positions");
        require_buffer(data, nbytes, "data");
        core.process_encoded(seq, positions, n, static_cast<const std::uint8_t*>(data), nbytes);  // checks nbytes
    });
}

dspark_status dspark_process_external(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                      int64_t* slots_out) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        core.check_ready(seq);
        require_buffer(positions, n, "positions");
        require_buffer(slots_out, n, "slots_out");
        core.process_external(seq, positions, n, slots_out);  // held mode: invalid_argument naming the mode
    });
}

dspark_status dspark_draft_size(const dspark_stager* st, int64_t seq, int64_t n_past, int32_t rows_dtype,
                                size_t* bytes) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require(bytes, "bytes");
        // External mode: plans name slots, nothing is copied out (rows_dtype
        // is ignored, as by dspark_draft).
        const std::size_t row = core.external() ? 0 : out_row_bytes(*st, rows_dtype);
        const dspark::RoundPlan p = core.peek(seq, n_past);
        *bytes = mul_size(static_cast<std::size_t>(p.n_rows), row, "draft rows");
    });
}

dspark_status dspark_draft(dspark_stager* st, int64_t seq, int64_t n_past, int32_t rows_dtype, void* rows,
                           size_t rows_capacity, dspark_plan* plan, size_t* rows_written) {
    return guarded(
        [&] {
            dspark::Stager& core = core_of(st);
            require(plan, "plan");
            if (rows_written) *rows_written = 0;
            DraftSink sink(*st, rows_dtype, rows, rows_capacity);
            core.check_ready(seq);
            if (n_past >= 0) check_strict(*st, seq, n_past);  // a bad n_past is the core's error
            const dspark::RoundPlan p = core.draft_into(seq, n_past, sink.sink());
            const std::size_t written = sink.finish();
            *plan = to_c(p, core.external());
            if (rows_written) *rows_written = written;
        },
        rows_written);
}

dspark_status dspark_draft_many(dspark_stager* st, const int64_t* seqs, const int64_t* n_pasts, size_t n,
                                int32_t rows_dtype, void* rows, size_t rows_capacity, dspark_plan* plans,
                                size_t* rows_written) {
    return guarded(
        [&] {
            dspark::Stager& core = core_of(st);
            require_buffer(seqs, n, "seqs");
            require_buffer(n_pasts, n, "n_pasts");
            require_buffer(plans, n, "plans");
            if (rows_written) *rows_written = 0;
            DraftSink sink(*st, rows_dtype, rows, rows_capacity);
            if (st->config.strict) {  // before anything opens: a rejected batch changes nothing
                for (std::size_t i = 0; i < n; ++i) core.check_ready(seqs[i]);
                for (std::size_t i = 0; i < n; ++i)
                    if (n_pasts[i] >= 0) check_strict(*st, seqs[i], n_pasts[i]);
            }
            std::vector<dspark::RoundPlan> out;
            core.draft_many_into(seqs, n_pasts, n, out, sink.sink());
            const std::size_t written = sink.finish();
            for (std::size_t i = 0; i < out.size(); ++i) plans[i] = to_c(out[i], core.external());
            if (rows_written) *rows_written = written;
        },
        rows_written);
}

dspark_status dspark_commit(dspark_stager* st, int64_t seq) {
    return guarded([&] { core_of(st).commit(seq); });
}

dspark_status dspark_fail(dspark_stager* st, int64_t seq, int32_t stage, int64_t* disabled_after) {
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        core.check_open(seq);
        if (stage != DSPARK_FAIL_DECODE && stage != DSPARK_FAIL_CROP)
            throw std::invalid_argument("stage must be DSPARK_FAIL_DECODE (0) or DSPARK_FAIL_CROP (1), got " +
                                        std::to_string(stage));
        const std::int64_t d = core.fail(seq, static_cast<dspark::FailStage>(stage));
        if (disabled_after) *disabled_after = d;
    });
}

dspark_status dspark_accept(dspark_stager* st, int64_t seq, int64_t n_accepted) {
    return guarded([&] { core_of(st).accept(seq, n_accepted); });
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
        *moves = last_moves().empty() ? nullptr : last_moves().data();
        *n = last_moves().size();
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
        require(bytes, "bytes");
        *bytes = core.snapshot_size(seq);
    });
}

dspark_status dspark_snapshot(const dspark_stager* st, int64_t seq, void* out, size_t capacity, size_t* written) {
    return guarded(
        [&] {
            const dspark::Stager& core = core_of(st);
            require_buffer(out, capacity, "out");
            if (written) *written = 0;
            // The core writes straight into `out` (one pass, no copy); it would
            // reject a short buffer too, but without the size the caller needs.
            const std::size_t need = core.snapshot_size(seq);
            if (need > capacity)
                throw TooSmall("the snapshot buffer holds " + std::to_string(capacity) + " bytes, the snapshot needs " +
                               std::to_string(need), need);
            const std::size_t n = core.snapshot_into(seq, static_cast<std::uint8_t*>(out), capacity);
            if (written) *written = n;
        },
        written);
}

dspark_status dspark_restore(dspark_stager* st, int64_t seq, const void* data, size_t nbytes) {
    last_restore_runs[0] = last_restore_runs[1] = dspark::SlotRun{};
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        core.check_ready(seq);
        require_buffer(data, nbytes, "data");
        dspark::SlotRun runs[2];
        core.restore(seq, static_cast<const std::uint8_t*>(data), nbytes, runs);  // checks every byte
        last_restore_runs[0] = runs[0];
        last_restore_runs[1] = runs[1];
    });
}

dspark_status dspark_state_get(const dspark_stager* st, int64_t seq, dspark_state* out) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require(out, "out");
        const dspark::SeqState s = core.state(seq);
        dspark_state c;
        std::memset(&c, 0, sizeof c);
        c.started = s.started;
        c.open_round = s.open_round;
        c.disabled = s.disabled;
        c.restage_owed = s.restage_owed;
        c.first_round = s.first_round;
        c.end = s.end;
        c.horizon = s.horizon;
        c.n_cache = s.n_cache;
        c.pos_base = s.pos_base;
        c.n_retained = s.n_retained;
        c.n_pending = s.n_pending;
        c.consecutive_failures = s.consecutive_failures;
        c.tentative_rows = s.tentative_rows;
        write_sized(out, c);
    });
}

dspark_status dspark_stats_get(const dspark_stager* st, int64_t seq, dspark_stats* out) {
    return guarded([&] {
        const dspark::Stager& core = core_of(st);
        require(out, "out");
        const dspark::SeqStats s = core.stats(seq);
        dspark_stats c;
        std::memset(&c, 0, sizeof c);
        c.rounds = s.rounds;
        c.commits = s.commits;
        c.failures = s.failures;
        c.rebases = s.rebases;
        c.staged_rows = s.staged_rows;
        c.restaged_rows = s.restaged_rows;
        c.skips = s.skips;
        c.trims = s.trims;
        c.trimmed_rows = s.trimmed_rows;
        c.live_rows = s.live_rows;
        c.rows = s.rows;
        c.peak_rows = s.peak_rows;
        c.bytes = s.bytes;
        c.peak_bytes = s.peak_bytes;
        c.reserved_bytes = s.reserved_bytes;
        write_sized(out, c);
    });
}

dspark_status dspark_row_bytes(int32_t storage, size_t dim, size_t* out) {
    return guarded([&] {
        require(out, "out");
        *out = dspark::row_bytes(storage_of(storage, false), dim);
    });
}

dspark_status dspark_encode_rows(const void* src, int32_t src_dtype, size_t src_bytes, size_t n_rows, size_t dim,
                                 int32_t storage, int32_t nonfinite, void* dst, size_t dst_capacity,
                                 int64_t* first_bad) {
    return guarded([&] {
        const ElemType in = elem_of(src_dtype, "encode_rows");
        const Storage out = storage_of(storage, false);
        const NonFinite policy = nonfinite_of(nonfinite, false);
        const std::size_t rb = dspark::row_bytes(out, dim);  // ConfigError for q formats and dim % 32
        const std::size_t in_bytes = mul_size(mul_size(n_rows, dim, "encode_rows input"), dspark::elem_bytes(in),
                                              "encode_rows input");
        if (src_bytes != in_bytes)
            throw std::invalid_argument("encode_rows: the input must be " + std::to_string(n_rows) + " x " +
                                        std::to_string(dim) + " elements (" + std::to_string(in_bytes) +
                                        " bytes), got " + std::to_string(src_bytes) + " bytes");
        const std::size_t out_bytes = mul_size(n_rows, rb, "encode_rows output");
        if (dst_capacity < out_bytes)
            throw TooSmall("encode_rows: dst holds " + std::to_string(dst_capacity) + " bytes, needs " +
                           std::to_string(out_bytes), out_bytes);
        require_buffer(src, src_bytes, "src");
        require_buffer(dst, out_bytes, "dst");
        require_disjoint(src, src_bytes, dst, out_bytes);
        const std::int64_t bad = n_rows ? dspark::encode_rows(src, in, dst, out, n_rows, dim, policy) : -1;
        if (first_bad) *first_bad = bad;
    });
}

dspark_status dspark_decode_rows(const void* src, int32_t storage, size_t src_bytes, size_t n_rows, size_t dim,
                                 void* dst, int32_t dst_dtype, size_t dst_capacity) {
    return guarded([&] {
        const Storage in = storage_of(storage, false);
        const ElemType out = elem_of(dst_dtype, "decode_rows");
        const std::size_t rb = dspark::row_bytes(in, dim);
        const std::size_t in_bytes = mul_size(n_rows, rb, "decode_rows input");
        if (src_bytes != in_bytes)
            throw std::invalid_argument("decode_rows: the input must be " + std::to_string(n_rows) + " rows of " +
                                        std::to_string(rb) + " bytes (" + std::to_string(in_bytes) + "), got " +
                                        std::to_string(src_bytes) + " bytes");
        const std::size_t out_bytes = mul_size(mul_size(n_rows, dim, "decode_rows output"), dspark::elem_bytes(out),
                                               "decode_rows output");
        if (dst_capacity < out_bytes)
            throw TooSmall("decode_rows: dst holds " + std::to_string(dst_capacity) + " bytes, needs " +
                           std::to_string(out_bytes), out_bytes);
        require_buffer(src, src_bytes, "src");
        require_buffer(dst, out_bytes, "dst");
        require_disjoint(src, src_bytes, dst, out_bytes);
        if (n_rows) dspark::decode_rows(src, in, dst, out, n_rows, dim);
    });
}

}  // extern "C"
