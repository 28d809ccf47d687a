// The device step's math (docs/protocol.md, "The device step"): the state of
// the sequences a server hands over (Stager::to_device), and one function
// that runs one sequence's step over it. The CPU twin (Stager::step_many,
// csrc/src/stager_device_step.cpp) and the CUDA kernel both call step_one, so the
// two cannot disagree; the differential tests hold both to the per-sequence
// core (stager.cpp, stager_ingest.cpp), whose rules this file restates op for op for
// external-row mode. Plain integer math: it compiles as C++17 and as CUDA
// (__host__ __device__, the DSPARK_HD convention of csrc/cuda/block_math.cuh).
//
// One step of a handed-over sequence, with the sampler's accept count a:
//   commit   the round the previous step opened (the drafter ran; a drafter
//            failure is host-only: hand the sequence back with its outcome),
//   confirm  the verify rows the previous step reserved (the target wrote them),
//   accept(a),
//   draft    at n_past = end (a skip: disabled, drafting_off or no_context),
//   reserve  the next verify batch's rows [end, end + B] (only [end] after a
//            skip: a skipped sequence verifies `last` alone).
// That is the per-sequence sequence confirm, accept(a), draft(end), commit,
// reserve, with the commit moved after the reserve: the two touch disjoint
// fields (commit: cache end, pos_base, flags, failures; reserve: end, the
// horizon, tentative rows, the ring), and commit's horizon update is a no-op
// after the accept's, so the order changes nothing observable. The round
// stays open on the device until that commit, so a server can still report
// a drafter failure (Stager::to_host's outcomes).
//
// What the device cannot decide is a status word (STATUS_*): the step then
// changes nothing for that sequence.
#pragma once
#include <cstdint>

#include "dspark/field_list.hpp"

#if !defined(DSPARK_HD)
#if defined(__CUDACC__)
#define DSPARK_HD __host__ __device__ __forceinline__
#else
#define DSPARK_HD inline
#endif
#endif

namespace dspark {
namespace device_step {

using i64 = std::int64_t;

// Every field of a handed-over sequence, as X(name). The state is
// structure-of-arrays: field f of sequence s is state[f * max_seqs + s]
// (int64), one contiguous array per field, FIELD_COUNT * max_seqs in all,
// followed by the acceptance histogram: block + 1 more columns, bucket k of
// sequence s at state[(FIELD_COUNT + k) * max_seqs + s] (columns()).
// The names are the host Seq's fields (stager.hpp) they carry.
#define DSPARK_STEP_FIELDS(X)                                                              \
    X(live)          /* 1 while handed over (to_device .. to_host) */                      \
    X(end) X(horizon) X(n_cache) X(pos_base)                                               \
    X(restage_owed) X(first_round) X(disabled) X(failures)                                 \
    X(drafting_off)  /* the server's switch (disable / enable): every draft skips */       \
    X(accept_open) X(tentative) X(verify_owed)                                             \
    X(open) X(open_start) X(open_base) /* the round the last step opened */                \
    X(reserved)      /* the verify rows the last step reserved */                          \
    X(cap) X(touched) X(head_slot) X(head_pos) X(count) /* the ring (FeatureBuffer::Marks) */ \
    X(rounds) X(commits) X(rebases) X(staged_rows) X(restaged_rows) X(skips) X(trims)      \
    X(trimmed_rows) X(peak_rows) X(skips_disabled) X(skips_no_context)                     \
    X(skips_drafting_off)  /* the stats a step changes */                                  \
    /* before the reservation (what cancel puts back): the fields reserve changes */       \
    X(pre_end) X(pre_horizon) X(pre_accept_open) X(pre_tentative) X(pre_cap) X(pre_touched) \
    X(pre_head_slot) X(pre_head_pos) X(pre_count) X(pre_trims) X(pre_trimmed_rows)         \
    X(pre_peak_rows)                                                                       \
    X(fault) X(fault_arg) /* the first fault (STATUS_*, sticky until to_host) and its value */

#define DSPARK_STEP_ENUM(name) F_##name,
enum Field : int { DSPARK_STEP_FIELDS(DSPARK_STEP_ENUM) FIELD_COUNT };
#undef DSPARK_STEP_ENUM

// One sequence's fields, loaded, changed, and stored back only when its step
// succeeds (a step that fails changes nothing).
#define DSPARK_STEP_MEMBER(name) i64 name;
struct Regs {
    DSPARK_STEP_FIELDS(DSPARK_STEP_MEMBER)
};
#undef DSPARK_STEP_MEMBER

// Per-entry status of a step (int32). OK and NOT_IN_STEP are not errors;
// every code from STATUS_FIRST_ERROR on is one, and the step changed nothing
// for that entry. The sticky ones (BAD_COUNT, POSITION_LIMIT, INTERNAL) are
// kept in the sequence's `fault` field: later steps on it change nothing and
// repeat the code, and to_host raises it.
enum Status : std::int32_t {
    STATUS_OK = 0,
    STATUS_NOT_IN_STEP = 1,       // accept count -1: the sequence sat this step out
    STATUS_FIRST_ERROR = 16,
    STATUS_NOT_ON_DEVICE = 16,    // an unknown id, or a sequence not handed over
    STATUS_DUPLICATE = 17,        // the id appears earlier in the same step
    STATUS_BAD_COUNT = 18,        // accept count outside [-1, B] (fault_arg: the count)
    STATUS_POSITION_LIMIT = 19,   // the verify rows would pass 2**62 - 1 (fault_arg: end)
    STATUS_INTERNAL = 20,         // a broken invariant (staged rows not buffered)
    STATUS_DAMAGED = 21,          // the state breaks a rule of damage_of (fault_arg: the Damage code)
    STATUS_LAST = STATUS_DAMAGED,
};

// Whether `status` is one of the words a step writes.
DSPARK_HD bool known_status(std::int64_t status) {
    return status == STATUS_OK || status == STATUS_NOT_IN_STEP ||
           (status >= STATUS_FIRST_ERROR && status <= STATUS_LAST);
}
// The sticky faults, which a sequence's `fault` field may hold.
DSPARK_HD bool sticky_status(std::int64_t status) {
    return status == STATUS_BAD_COUNT || status == STATUS_POSITION_LIMIT || status == STATUS_INTERNAL ||
           status == STATUS_DAMAGED;
}

// The neutral padding entry of a fixed-capacity step (a CUDA graph captured
// for N entries serving a batch of fewer): id PADDING_ID with count -1 is
// STATUS_NOT_IN_STEP and changes nothing, however often it appears.
enum : std::int64_t { PADDING_ID = -1 };

// plan flags (int32 bits).
enum : std::int32_t { PLAN_REBASE = 1, PLAN_CLEAR_CACHE = 2 };
// The skip codes of dspark::Skip a step can make: disabled (max_failures
// rounds failed), no_context, drafting_off (the server's switch: disable).
enum : std::int32_t { SKIP_NONE = 0, SKIP_DISABLED = 1, SKIP_NO_CONTEXT = 3, SKIP_DRAFTING_OFF = 5, NOT_STEPPED = -1 };

// The Stager's constants the step needs, listed once (Config, the C ABI's
// dspark_step_config, Stager.step_config()'s keys and the CUDA binding's
// argument order all expand this list): block B, window W, w_keep (rows a
// rebase restages at most), ring_rows (slots per sequence: W + TRIM_CHUNK +
// B + 1), max_seqs, max_rows (the padded plan width W - B: the most rows a
// plan stages), trim_chunk (TRIM_CHUNK), max_position (MAX_POSITION).
#define DSPARK_STEP_CONFIG_FIELDS(X) \
    X(std::int64_t, block)           \
    X(std::int64_t, window)          \
    X(std::int64_t, w_keep)          \
    X(std::int64_t, ring_rows)       \
    X(std::int64_t, max_seqs)        \
    X(std::int64_t, max_rows)        \
    X(std::int64_t, trim_chunk)      \
    X(std::int64_t, max_position)
struct Config {
    DSPARK_STEP_CONFIG_FIELDS(DSPARK_DECLARE_FIELD)
};

// Where a step writes entry i's answers, listed once as X(element type,
// name, shape): Outputs, the C ABI's dspark_step_out, the bindings' output
// arrays (their names, dtypes and shapes) all expand this list. The shape is
// in units of the batch ("n": one per entry; "n,max_rows": the padded
// context rows; "n,block": the block; "n,block+1": the verify rows):
// status (STATUS_*), skip (Skip code, NOT_STEPPED), flags (PLAN_* bits),
// start (the round's n_past: end after accept), pos_base and crop_from (-1
// for a skip), n_rows (context rows staged), row_slots / row_positions (the
// context rows' global slots / drafter positions, -1 padding), block_positions
// (the block's drafter positions), verify_slots (the next verify rows' slots,
// -1 unused). Every pointer but status may be null (not written). Entries
// that were not stepped (status != OK) read as "nothing": skip NOT_STEPPED and
// -1 everywhere else.
#define DSPARK_STEP_OUTPUT_FIELDS(X)                   \
    X(std::int32_t, status, "n")                       \
    X(std::int32_t, skip, "n")                         \
    X(std::int32_t, flags, "n")                        \
    X(std::int64_t, start, "n")                        \
    X(std::int64_t, pos_base, "n")                     \
    X(std::int64_t, crop_from, "n")                    \
    X(std::int64_t, n_rows, "n")                       \
    X(std::int64_t, row_slots, "n,max_rows")           \
    X(std::int32_t, row_positions, "n,max_rows")       \
    X(std::int32_t, block_positions, "n,block")        \
    X(std::int64_t, verify_slots, "n,block+1")
#define DSPARK_DECLARE_OUTPUT(type, name, shape) type* name = nullptr;
struct Outputs {
    DSPARK_STEP_OUTPUT_FIELDS(DSPARK_DECLARE_OUTPUT)
};
#undef DSPARK_DECLARE_OUTPUT

// One output of the list: its name, where its pointer lies in Outputs, its
// element size and shape. The table ends with a null name.
struct OutputInfo {
    const char* name;
    std::size_t offset;
    std::size_t elem_bytes;
    const char* shape;
};

// The step state's columns: the fields, then the histogram's block + 1.
DSPARK_HD i64 columns(const Config& c) { return FIELD_COUNT + c.block + 1; }
// Where sequence seq's histogram bucket k (rounds with k accepted drafts) lies in the state.
DSPARK_HD i64 bucket_at(const Config& c, i64 seq, i64 k) { return (FIELD_COUNT + k) * c.max_seqs + seq; }

DSPARK_HD i64 imin(i64 a, i64 b) { return a < b ? a : b; }
DSPARK_HD i64 imax(i64 a, i64 b) { return a > b ? a : b; }
DSPARK_HD i64 iclamp(i64 v, i64 lo, i64 hi) { return v < lo ? lo : (v > hi ? hi : v); }

DSPARK_HD void load(const i64* state, i64 max_seqs, i64 seq, Regs& r) {
#define DSPARK_STEP_LOAD(name) r.name = state[F_##name * max_seqs + seq];
    DSPARK_STEP_FIELDS(DSPARK_STEP_LOAD)
#undef DSPARK_STEP_LOAD
}

DSPARK_HD void store(i64* state, i64 max_seqs, i64 seq, const Regs& r) {
#define DSPARK_STEP_STORE(name) state[F_##name * max_seqs + seq] = r.name;
    DSPARK_STEP_FIELDS(DSPARK_STEP_STORE)
#undef DSPARK_STEP_STORE
}

// -- what a state may hold ----------------------------------------------------
// The step state is a plain array a server may copy back from its device (or
// scribble on): the step trusts no field of it before damage_of has passed,
// and Stager::to_host refuses the same states (and a few more it can see:
// failures above max_failures). Every rule below is one a step's own writes
// keep; together they bound every index and slot a step computes (the plan's
// rows inside the sequence's ring and at most max_rows of them, the verify
// slots, the histogram bucket) and keep every counter far from overflow.

// `reserved`: whose reservation the sequence holds. The host's (made by
// reserve before to_device and untouched since: no step has run) comes back
// as the host made it, with the fields the step state does not carry;
// a step's own is confirmed by the next step or comes back from pre_*.
enum : std::int32_t { RESERVED_NONE = 0, RESERVED_HOST = 1, RESERVED_STEP = 2 };

// The broken rules, as X(code name, what it says).
#define DSPARK_STEP_DAMAGE(X)                                                 \
    X(NONE, "")                                                               \
    X(LIVE, "its live flag is neither 0 nor 1")                               \
    X(FLAG, "a flag is neither 0 nor 1")                                      \
    X(RING, "the ring's bookkeeping is inconsistent")                         \
    X(PRE_RING, "the reservation's saved ring is inconsistent")               \
    X(CACHE, "the drafter cache's range is inconsistent")                     \
    X(TENTATIVE, "the tentative row count is out of range")                   \
    X(FAILURES, "the failure count is out of range")                          \
    X(OPEN, "the open round is inconsistent")                                 \
    X(COUNTER, "a counter is negative or past 2**62")                         \
    X(HISTOGRAM, "a histogram count is negative or past 2**62")               \
    X(FAULT, "the fault code is unknown")
#define DSPARK_STEP_DAMAGE_ENUM(name, text) DAMAGE_##name,
enum Damage : int { DSPARK_STEP_DAMAGE(DSPARK_STEP_DAMAGE_ENUM) DAMAGE_COUNT };
#undef DSPARK_STEP_DAMAGE_ENUM

DSPARK_HD bool is_flag(i64 v) { return v == 0 || v == 1; }
DSPARK_HD bool is_count(const Config& c, i64 v) { return v >= 0 && v < c.max_position; }

// A ring's bookkeeping (FeatureBuffer::Marks) with its sequence's end and
// horizon: rows [head_pos, end) held, the horizon among them.
DSPARK_HD bool ring_ok(const Config& c, i64 cap, i64 touched, i64 head_slot, i64 count, i64 head_pos, i64 end,
                       i64 horizon) {
    if (cap != 0 && cap != c.ring_rows) return false;
    if (count < 0 || count > cap || touched < 0 || touched > cap) return false;
    if (head_slot < 0 || (cap ? head_slot >= cap : head_slot != 0)) return false;
    if (head_pos < 0 || end >= c.max_position) return false;  // first: head_pos + count cannot overflow
    return head_pos <= horizon && horizon <= end && head_pos + count == end;
}

// The first rule sequence `seq`'s state breaks (DAMAGE_NONE when it breaks none).
DSPARK_HD int damage_of(const Config& c, const i64* state, i64 seq, const Regs& r) {
    if (!is_flag(r.live)) return DAMAGE_LIVE;
    if (!is_flag(r.restage_owed) || !is_flag(r.first_round) || !is_flag(r.disabled) || !is_flag(r.drafting_off) ||
        !is_flag(r.accept_open) ||
        !is_flag(r.open) || !is_flag(r.pre_accept_open) || !is_flag(r.verify_owed) || r.reserved < RESERVED_NONE ||
        r.reserved > RESERVED_STEP)
        return DAMAGE_FLAG;
    if (!ring_ok(c, r.cap, r.touched, r.head_slot, r.count, r.head_pos, r.end, r.horizon)) return DAMAGE_RING;
    if (r.reserved && !ring_ok(c, r.pre_cap, r.pre_touched, r.pre_head_slot, r.pre_count, r.pre_head_pos, r.pre_end,
                               r.pre_horizon))
        return DAMAGE_PRE_RING;
    if (r.pos_base < 0 || r.pos_base > r.n_cache || r.n_cache > r.end) return DAMAGE_CACHE;
    if (r.tentative < 0 || r.tentative > c.block + 1 || r.pre_tentative < 0 || r.pre_tentative > c.block + 1)
        return DAMAGE_TENTATIVE;
    if (!is_count(c, r.failures)) return DAMAGE_FAILURES;
    if (r.open && (r.open_start > r.end || r.open_base < 0 || r.open_base > r.open_start)) return DAMAGE_OPEN;
    const i64 counters[] = {r.rounds,       r.commits,        r.rebases,       r.staged_rows,
                            r.restaged_rows, r.skips,         r.trims,         r.trimmed_rows,
                            r.peak_rows,    r.skips_disabled, r.skips_no_context, r.skips_drafting_off,
                            r.pre_trims,    r.pre_trimmed_rows, r.pre_peak_rows};
    for (i64 v : counters)
        if (!is_count(c, v)) return DAMAGE_COUNTER;
    for (i64 k = 0; k <= c.block; ++k)
        if (!is_count(c, state[(FIELD_COUNT + k) * c.max_seqs + seq])) return DAMAGE_HISTOGRAM;
    if (r.fault != 0 && !sticky_status(r.fault)) return DAMAGE_FAULT;
    return DAMAGE_NONE;
}

// -- the ring (FeatureBuffer's bookkeeping, external: no bytes) ----------------

// The ring index of position pos (head_pos <= pos < head_pos + count).
DSPARK_HD i64 slot(const Regs& r, i64 pos) {
    const i64 s = r.head_slot + (pos - r.head_pos);
    return s >= r.cap ? s - r.cap : s;
}

DSPARK_HD void ring_reset(Regs& r, i64 pos) {
    r.head_pos = pos;
    r.head_slot = 0;
    r.count = 0;
}

DSPARK_HD void drop_front(Regs& r, i64 new_head) {
    new_head = iclamp(new_head, r.head_pos, r.head_pos + r.count);
    const i64 k = new_head - r.head_pos;
    if (k == 0) return;
    r.head_slot = r.count == k ? 0 : slot(r, new_head);  // an emptied ring restarts at slot 0
    r.head_pos = new_head;
    r.count -= k;
}

DSPARK_HD void drop_back(Regs& r, i64 new_end) {
    new_end = iclamp(new_end, r.head_pos, r.head_pos + r.count);
    r.count = new_end - r.head_pos;
}

// FeatureBuffer::reserve_back of an external ring: the first call takes the
// sequence's ring_rows slots; false where the host would throw (outgrow).
DSPARK_HD bool reserve_back(const Config& c, Regs& r, i64 n) {
    const i64 need = r.count + n;
    if (need <= r.cap) return true;
    if (r.cap != 0 || need > c.ring_rows) return false;
    r.cap = c.ring_rows;
    r.head_slot = 0;
    return true;
}

// FeatureBuffer::back_spans: the next n free slots, as a first run of
// `run` slots from ring index `first` and n - run more from slot 0.
DSPARK_HD void back_spans(Regs& r, i64 n, i64& first, i64& run) {
    const i64 tail = r.count == 0 ? r.head_slot : slot(r, r.head_pos + r.count - 1) + 1;
    first = tail >= r.cap ? tail - r.cap : tail;
    run = imin(n, r.cap - first);
    r.touched = imax(r.touched, imax(first + run, n - run));
}

// -- the horizon (stager.cpp, "the horizon") ------------------------------------

DSPARK_HD i64 firm_end(const Regs& r) {
    return (r.accept_open && r.tentative > 0) ? r.end - r.tentative + 1 : r.end;
}

DSPARK_HD void trim_head(Regs& r, i64 new_head) {
    const i64 before = r.head_pos;
    drop_front(r, new_head);
    const i64 k = r.head_pos - before;
    if (k > 0) {
        r.trims += 1;
        r.trimmed_rows += k;
    }
}

// Every handed-over sequence is started (to_device refuses others).
DSPARK_HD void advance_horizon(const Config& c, Regs& r) {
    r.horizon = imax(r.horizon, firm_end(r) - c.window);
    if (r.horizon - r.head_pos >= c.trim_chunk) trim_head(r, r.horizon);
    r.peak_rows = imax(r.peak_rows, r.count);  // note_size: rows == count
}

// -- the per-sequence operations (stager.cpp's commit_seq, accept_seq, ...) -----

DSPARK_HD void commit(const Config& c, Regs& r) {
    r.open = 0;
    r.n_cache = r.open_start;
    r.pos_base = r.open_base;
    r.restage_owed = 0;
    r.first_round = 0;
    r.failures = 0;
    r.verify_owed = 1;
    r.commits += 1;
    advance_horizon(c, r);
}

// Returns the drafts the accept kept when it verified a committed round (the
// histogram's bucket, counted by the caller on success), else -1.
DSPARK_HD i64 accept(const Config& c, Regs& r, i64 n_accepted) {
    if (!r.accept_open || r.tentative == 0) return -1;
    // Only rows appended since the last draft can go: never the retained head.
    const i64 keep = imin(r.tentative, n_accepted + 1);
    const i64 verified = r.verify_owed != 0 ? keep - 1 : -1;
    r.verify_owed = 0;
    const i64 new_end = r.end - r.tentative + keep;
    drop_back(r, new_end);
    r.end = new_end;
    r.tentative = 0;
    r.accept_open = 0;  // an accept acts on the round just drafted, once (stager.cpp's keep_tentative)
    advance_horizon(c, r);
    return verified;
}

// A round's plan (RoundPlan's fields that a step hands out).
struct Plan {
    std::int32_t skip = SKIP_NONE;
    bool rebase = false, clear_cache = false;
    i64 start = 0, pos_base = -1, first_row = 0, n_rows = 0, crop_from = -1;
    i64 run_first[2] = {0, 0}, run_count[2] = {0, 0};  // global slots of the staged rows
};

// plan_round at start = end (never a mismatch), and open_round on success.
// false on a broken invariant (the host's "staged rows are not buffered").
DSPARK_HD bool draft(const Config& c, Regs& r, i64 seq, Plan& p) {
    p.start = r.end;
    r.verify_owed = 0;  // a draft, skipped or not: the last round's verify is over
    // plan_round's order: a disabled sequence, then the server's switch, then no context.
    if (r.disabled) p.skip = SKIP_DISABLED;
    else if (r.drafting_off) p.skip = SKIP_DRAFTING_OFF;
    else if (p.start <= r.n_cache) p.skip = SKIP_NO_CONTEXT;
    if (p.skip != SKIP_NONE) {
        r.skips += 1;
        if (p.skip == SKIP_DISABLED) r.skips_disabled += 1;
        else if (p.skip == SKIP_DRAFTING_OFF) r.skips_drafting_off += 1;
        else r.skips_no_context += 1;
        return true;
    }
    // The window rule: the block must end inside the drafter's W positions.
    const bool rebase = r.restage_owed || p.start - r.pos_base + c.block > c.window;
    i64 base, lo;
    if (rebase) {
        base = lo = p.start - imin(p.start - r.horizon, c.w_keep);
    } else {
        base = r.pos_base;
        lo = r.n_cache;
    }
    // Also a bound by construction: never more rows than the padded plan holds.
    if (lo < r.head_pos || lo < r.horizon || p.start > r.head_pos + r.count || p.start - lo > c.max_rows)
        return false;
    p.rebase = rebase;
    p.clear_cache = rebase || r.first_round;
    p.pos_base = base;
    p.first_row = lo;
    p.n_rows = p.start - lo;
    p.crop_from = p.start - base;
    if (p.n_rows > 0) {
        const i64 s = slot(r, lo), run = imin(p.n_rows, r.cap - s);
        p.run_first[0] = seq * c.ring_rows + s;
        p.run_count[0] = run;
        if (run < p.n_rows) {
            p.run_first[1] = seq * c.ring_rows;
            p.run_count[1] = p.n_rows - run;
        }
    }
    r.open = 1;
    r.open_start = p.start;
    r.open_base = base;
    r.accept_open = 1;
    r.tentative = 0;
    r.rounds += 1;
    r.staged_rows += p.n_rows;
    if (rebase) {
        r.rebases += 1;
        r.restaged_rows += p.n_rows;
    }
    return true;
}

// reserve of n rows at [end, end + n) (stager_ingest.cpp's prepare_append +
// commit_append for external rows), remembering the fields before it; slots_out[k] is row k's
// global slot or -1 (below the horizon). false where the host would throw on
// a broken invariant.
DSPARK_HD bool reserve(const Config& c, Regs& r, i64 seq, i64 n, i64* slots_out) {
    r.pre_end = r.end;
    r.pre_horizon = r.horizon;
    r.pre_accept_open = r.accept_open;
    r.pre_tentative = r.tentative;
    r.pre_cap = r.cap;
    r.pre_touched = r.touched;
    r.pre_head_slot = r.head_slot;
    r.pre_head_pos = r.head_pos;
    r.pre_count = r.count;
    r.pre_trims = r.trims;
    r.pre_trimmed_rows = r.trimmed_rows;
    r.pre_peak_rows = r.peak_rows;
    const i64 p0 = r.end;
    // The state after the rows, to know which of them survive.
    Regs after = r;
    after.end = p0 + n;
    if (after.accept_open) {
        after.tentative += n;
        if (after.tentative > c.block + 1) after.accept_open = 0, after.tentative = 0;
    }
    const i64 g_horizon = imax(after.horizon, firm_end(after) - c.window);
    const i64 skip = iclamp(g_horizon - p0, 0, n), keep = n - skip;
    if (r.cap == 0 && !reserve_back(c, r, keep)) return false;
    i64 first = 0, run = 0;
    const bool clean = skip == 0 && r.count + keep <= r.cap;
    if (clean) {
        if (r.count == 0) ring_reset(r, p0);
        back_spans(r, keep, first, run);
    } else {
        trim_head(r, imin(g_horizon, r.end));  // dead rows go before the new ones
        if (r.count == 0) ring_reset(r, p0 + skip);
        if (keep) {
            if (!reserve_back(c, r, keep)) return false;
            back_spans(r, keep, first, run);
        }
    }
    r.count += keep;
    if (slots_out) {
        const i64 base = seq * c.ring_rows;
        for (i64 k = 0; k < skip; ++k) slots_out[k] = -1;
        for (i64 k = 0; k < keep; ++k) slots_out[skip + k] = base + (k < run ? first + k : k - run);
    }
    r.end = after.end;
    r.accept_open = after.accept_open;
    r.tentative = after.tentative;
    r.horizon = g_horizon;
    advance_horizon(c, r);
    r.reserved = RESERVED_STEP;
    return true;
}

// Entry i's answers for an entry that was not stepped: nothing.
DSPARK_HD void write_nothing(const Config& c, const Outputs& o, i64 i) {
    if (o.skip) o.skip[i] = NOT_STEPPED;
    if (o.flags) o.flags[i] = 0;
    if (o.start) o.start[i] = -1;
    if (o.pos_base) o.pos_base[i] = -1;
    if (o.crop_from) o.crop_from[i] = -1;
    if (o.n_rows) o.n_rows[i] = 0;
    for (i64 k = 0; k < c.block; ++k)
        if (o.block_positions) o.block_positions[i * c.block + k] = -1;
    for (i64 k = 0; k <= c.block; ++k)
        if (o.verify_slots) o.verify_slots[i * (c.block + 1) + k] = -1;
}

DSPARK_HD void write_plan(const Config& c, const Outputs& o, i64 i, const Plan& p) {
    if (o.skip) o.skip[i] = p.skip;
    if (o.flags) o.flags[i] = (p.rebase ? PLAN_REBASE : 0) | (p.clear_cache ? PLAN_CLEAR_CACHE : 0);
    if (o.start) o.start[i] = p.start;
    if (o.pos_base) o.pos_base[i] = p.pos_base;
    if (o.crop_from) o.crop_from[i] = p.crop_from;
    if (o.n_rows) o.n_rows[i] = p.n_rows;
    for (i64 k = 0; k < c.block; ++k)
        if (o.block_positions)
            o.block_positions[i * c.block + k] =
                p.skip == SKIP_NONE ? static_cast<std::int32_t>(p.start - p.pos_base + k) : -1;
}

// Entry i's padded context rows (row_slots / row_positions, [max_rows] each,
// -1 padding) from its plan: rows k = lane, lane + lanes, ... (the CPU twin
// writes them all, lane 0 of 1; the kernel spreads them over a warp).
// n_rows is 0 for an entry that was not stepped (all padding).
struct Rows {
    i64 n_rows = 0, run_first0 = 0, run_count0 = 0, run_first1 = 0, pos0 = 0;  // pos0: first_row - pos_base
};

DSPARK_HD Rows rows_of(std::int32_t status, const Plan& p) {
    Rows w;
    if (status != STATUS_OK || p.skip != SKIP_NONE) return w;
    w.n_rows = p.n_rows;
    w.run_first0 = p.run_first[0];
    w.run_count0 = p.run_count[0];
    w.run_first1 = p.run_first[1];
    w.pos0 = p.first_row - p.pos_base;
    return w;
}

// The first k >= lo that is this lane's (k == lane mod lanes).
DSPARK_HD i64 lane_from(i64 lo, i64 lane, i64 lanes) { return lo + ((lane - lo) % lanes + lanes) % lanes; }

DSPARK_HD void write_rows(const Config& c, const Outputs& o, i64 i, const Rows& w, i64 lane, i64 lanes) {
    // Three plain loops (the first run, the second, the padding): no branch
    // per row, so the CPU twin's compiler vectorizes them.
    const i64 run0 = imin(w.n_rows, w.run_count0);
    if (o.row_slots) {
        i64* out = o.row_slots + i * c.max_rows;
        for (i64 k = lane; k < run0; k += lanes) out[k] = w.run_first0 + k;
        for (i64 k = lane_from(run0, lane, lanes); k < w.n_rows; k += lanes) out[k] = w.run_first1 + (k - run0);
        for (i64 k = lane_from(w.n_rows, lane, lanes); k < c.max_rows; k += lanes) out[k] = -1;
    }
    if (o.row_positions) {
        std::int32_t* out = o.row_positions + i * c.max_rows;
        for (i64 k = lane; k < w.n_rows; k += lanes) out[k] = static_cast<std::int32_t>(w.pos0 + k);
        for (i64 k = lane_from(w.n_rows, lane, lanes); k < c.max_rows; k += lanes) out[k] = -1;
    }
}

// One entry of a step: sequence `seq` (already checked to be the first
// occurrence of its id in the batch; `duplicate` otherwise) with accept count
// `count` (-1: not in this step). Returns the status it wrote; `p` receives
// the round's plan (write_rows writes its padded rows).
DSPARK_HD std::int32_t step_one(const Config& c, i64* state, const Outputs& o, i64 i, i64 seq, i64 count,
                                bool duplicate, Plan& p) {
    p = Plan();
    write_nothing(c, o, i);
    std::int32_t status = STATUS_OK;
    Regs r;
    if (seq == PADDING_ID && count == -1) {
        status = STATUS_NOT_IN_STEP;
    } else if (seq < 0 || seq >= c.max_seqs) {
        status = STATUS_NOT_ON_DEVICE;
    } else if (duplicate) {
        status = STATUS_DUPLICATE;
    } else {
        load(state, c.max_seqs, seq, r);
        const int damage = r.live == 0 ? DAMAGE_NONE : damage_of(c, state, seq, r);
        if (r.live == 0) {
            status = STATUS_NOT_ON_DEVICE;
        } else if (damage != DAMAGE_NONE) {
            status = STATUS_DAMAGED;  // sticky: nothing of the state is trusted, only the fault is recorded
            state[F_fault * c.max_seqs + seq] = status;
            state[F_fault_arg * c.max_seqs + seq] = damage;
        } else if (r.fault) {
            status = static_cast<std::int32_t>(r.fault);  // repeated; its first value is kept
        } else if (count == -1) {
            status = STATUS_NOT_IN_STEP;
        } else if (count < -1 || count > c.block) {
            status = STATUS_BAD_COUNT;  // sticky: only the fault is recorded
            state[F_fault * c.max_seqs + seq] = status;
            state[F_fault_arg * c.max_seqs + seq] = count;
        }
    }
    if (status != STATUS_OK) {
        o.status[i] = status;
        return status;
    }
    const i64 end_before = r.end;
    if (r.open) commit(c, r);
    r.reserved = 0;  // confirm: the target wrote the verify rows
    const i64 verified = accept(c, r, count);
    i64 fault_arg = 0;
    if (!draft(c, r, seq, p)) {
        status = STATUS_INTERNAL;
    } else {
        // A skipped round verifies `last` alone: one row.
        const i64 n_verify = p.skip == SKIP_NONE ? c.block + 1 : 1;
        if (r.end + n_verify > c.max_position - 1) {
            status = STATUS_POSITION_LIMIT;
            fault_arg = r.end;
        } else if (!reserve(c, r, seq, n_verify, o.verify_slots ? o.verify_slots + i * (c.block + 1) : nullptr)) {
            status = STATUS_INTERNAL;
        }
    }
    if (status != STATUS_OK) {  // nothing of this step is kept but the fault
        if (o.verify_slots)
            for (i64 k = 0; k <= c.block; ++k) o.verify_slots[i * (c.block + 1) + k] = -1;
        state[F_fault * c.max_seqs + seq] = status;
        state[F_fault_arg * c.max_seqs + seq] = status == STATUS_INTERNAL ? end_before : fault_arg;
        o.status[i] = status;
        return status;
    }
    store(state, c.max_seqs, seq, r);
    if (verified >= 0) state[bucket_at(c, seq, verified)] += 1;
    write_plan(c, o, i, p);
    o.status[i] = STATUS_OK;
    return STATUS_OK;
}

// -- the CSR rows of a step's batch (Stager::step_rows; the CUDA step's rows) --
// The unpadded layout's gather (docs/protocol.md 2.10, "the CSR rows"): after
// a step, the context rows of every entry of its batch as one flat list, the
// rows of entry i at [row_offsets[i], row_offsets[i + 1]) of row_slots (int64
// global slots) and row_positions (int32 drafter positions): draft_many's
// BatchPlan layout, so a server's gather is one call over row_offsets[-1]
// rows. A pass of its own after the step (it needs an exclusive scan of n_rows
// over the batch), reading only the step's plan outputs (status, skip, start,
// n_rows, pos_base) and the ring marks the step left in the state: an entry
// stepped OK with a drafted round has its rows [start - n_rows, start) still
// buffered in its ring (the step's reservation trims below the window's
// start only). Nothing the caller hands in is trusted: an entry whose plan
// does not describe rows its ring holds (a stale or mismatched `out`, a
// damaged state) has 0 rows, so every slot lies in the entry's sequence's ring
// and no entry writes past max_rows rows (row_slots / row_positions hold
// capacity * max_rows elements).

// Where a CSR pass writes (row_offsets: capacity + 1 elements, required;
// row_slots / row_positions: capacity * max_rows elements, null: not written).
struct CsrRows {
    i64* row_offsets = nullptr;
    i64* row_slots = nullptr;
    std::int32_t* row_positions = nullptr;
};

// Entry i's context rows after the step that wrote `o` (seq: the batch's id
// at entry i): its run(s) of slots and its first position, or 0 rows. Each
// output is read once (a caller's array may change meanwhile: the checks hold
// for the values used).
DSPARK_HD Rows rows_after_step(const Config& c, const i64* state, const Outputs& o, i64 i, i64 seq) {
    Rows w;
    if (seq < 0 || seq >= c.max_seqs) return w;
    if (o.status[i] != STATUS_OK || o.skip[i] != SKIP_NONE) return w;
    const i64 n = o.n_rows[i], start = o.start[i], pos_base = o.pos_base[i];
    if (n <= 0 || n > c.max_rows || start < n || start >= c.max_position) return w;
    const i64 lo = start - n;
    if (pos_base < 0 || pos_base > lo || start - pos_base > c.window) return w;
    const i64 live = state[F_live * c.max_seqs + seq], fault = state[F_fault * c.max_seqs + seq];
    const i64 cap = state[F_cap * c.max_seqs + seq], touched = state[F_touched * c.max_seqs + seq];
    const i64 head_slot = state[F_head_slot * c.max_seqs + seq], head_pos = state[F_head_pos * c.max_seqs + seq];
    const i64 count = state[F_count * c.max_seqs + seq], end = state[F_end * c.max_seqs + seq];
    const i64 horizon = state[F_horizon * c.max_seqs + seq];
    if (live != 1 || fault != 0 || cap == 0 || !ring_ok(c, cap, touched, head_slot, count, head_pos, end, horizon))
        return w;
    if (lo < head_pos || start > head_pos + count) return w;  // not (all) buffered
    const i64 s0 = head_slot + (lo - head_pos), s = s0 >= cap ? s0 - cap : s0;
    w.n_rows = n;
    w.run_first0 = seq * c.ring_rows + s;
    w.run_count0 = imin(n, cap - s);
    w.run_first1 = seq * c.ring_rows;
    w.pos0 = lo - pos_base;
    return w;
}

// Entry w's rows at [at, at + w.n_rows) of the flat arrays: rows k = lane,
// lane + lanes, ... (the CPU twin: lane 0 of 1; the kernel: a warp).
DSPARK_HD void write_csr_rows(const CsrRows& o, i64 at, const Rows& w, i64 lane, i64 lanes) {
    const i64 run0 = imin(w.n_rows, w.run_count0);
    if (o.row_slots) {
        i64* out = o.row_slots + at;
        for (i64 k = lane; k < run0; k += lanes) out[k] = w.run_first0 + k;
        for (i64 k = lane_from(run0, lane, lanes); k < w.n_rows; k += lanes) out[k] = w.run_first1 + (k - run0);
    }
    if (o.row_positions) {
        std::int32_t* out = o.row_positions + at;
        for (i64 k = lane; k < w.n_rows; k += lanes) out[k] = static_cast<std::int32_t>(w.pos0 + k);
    }
}

}  // namespace device_step
}  // namespace dspark
