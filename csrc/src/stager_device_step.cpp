// The device step's host side (stager.hpp, "the device step"): handing
// sequences over into the step state and back, the CPU twin of the step, and
// the errors of its status words. The step's math is dspark/step_math.hpp,
// shared with the CUDA kernel.
//
// Invariant: while a sequence is on the device (Seq::on_device), its fields
// in the step state are the truth and its Seq's fields are stale; every call
// but the ones here refuses it (refuse_on_device, through needs() and the
// introspection calls), so nothing reads the stale fields.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "dspark/errors.hpp"
#include "dspark/stager.hpp"
#include "stager_batch.hpp"

namespace dspark {

#define DSPARK_STEP_CONFIG_FIELD_INFO(type, name) DSPARK_FIELD_INFO(device_step::Config, type, name)
const FieldInfo STEP_CONFIG_FIELDS[] = {DSPARK_STEP_CONFIG_FIELDS(DSPARK_STEP_CONFIG_FIELD_INFO){nullptr, 0, false}};
#undef DSPARK_STEP_CONFIG_FIELD_INFO
#define DSPARK_STEP_OUTPUT_INFO(type, name, shape) {#name, offsetof(device_step::Outputs, name), sizeof(type), shape},
const device_step::OutputInfo STEP_OUTPUTS[] = {DSPARK_STEP_OUTPUT_FIELDS(DSPARK_STEP_OUTPUT_INFO){nullptr, 0, 0, nullptr}};
#undef DSPARK_STEP_OUTPUT_INFO
#define DSPARK_STEP_FIELD_NAME(name) #name,
const char* const STEP_STATE_FIELDS[] = {DSPARK_STEP_FIELDS(DSPARK_STEP_FIELD_NAME) nullptr};
#undef DSPARK_STEP_FIELD_NAME

namespace {

using device_step::i64;
using device_step::Regs;

using detail::seq_msg;

std::string where(const char* call, std::size_t i, i64 seq) { return batch_context(call, i, seq); }

// The caller's arrays may change under a released GIL: read them once.
std::vector<i64> copy_ids(const i64* p, std::size_t n) { return n ? std::vector<i64>(p, p + n) : std::vector<i64>(); }

FeatureBuffer::Marks marks_of(i64 cap, i64 touched, i64 head_slot, i64 count, i64 head_pos) {
    FeatureBuffer::Marks m;
    m.cap = static_cast<std::size_t>(cap);
    m.touched = static_cast<std::size_t>(touched);
    m.head_slot = static_cast<std::size_t>(head_slot);
    m.count = static_cast<std::size_t>(count);
    m.head_pos = head_pos;
    return m;
}

// fail_seq's changes on the step's fields (stats.failures is the caller's):
// returns the failure count when this failure disabled the sequence, else 0.
i64 fail_regs(const device_step::Config& c, Regs& r, i64 max_failures) {
    r.open = 0;
    r.restage_owed = 1;
    r.first_round = 0;
    r.failures += 1;
    i64 disabled_after = 0;
    if (r.failures >= max_failures && !r.disabled) {
        r.disabled = 1;
        disabled_after = r.failures;
    }
    device_step::advance_horizon(c, r);
    return disabled_after;
}

// What each broken rule says (step_math.hpp's DSPARK_STEP_DAMAGE list).
const char* damage_text(int code) {
#define DSPARK_STEP_DAMAGE_TEXT(name, text) text,
    static const char* const texts[] = {DSPARK_STEP_DAMAGE(DSPARK_STEP_DAMAGE_TEXT)};
#undef DSPARK_STEP_DAMAGE_TEXT
    return code >= 0 && code < device_step::DAMAGE_COUNT ? texts[code] : "an unknown rule is broken";
}

// What the host saw of a sequence last, whole (Seq::last_whole and its
// histogram): a step only raises its counters and its histogram, so a state
// below it is one a copy back (or a server's write) made, and the metrics
// read from it would go back.
struct LastWhole {
    const Regs& regs;
    const std::vector<i64>& histogram;
};

// A counter or a histogram bucket below the last whole state's. Only the
// live counters: a reservation's pre_* copies are lower by design.
bool went_back(const device_step::Config& c, const i64* state, i64 seq, const Regs& r, const LastWhole& last) {
    const Regs& w = last.regs;
    const i64 now[] = {r.rounds, r.commits, r.rebases, r.staged_rows, r.restaged_rows, r.skips, r.trims,
                       r.trimmed_rows, r.peak_rows, r.skips_disabled, r.skips_no_context, r.skips_drafting_off};
    const i64 was[] = {w.rounds, w.commits, w.rebases, w.staged_rows, w.restaged_rows, w.skips, w.trims,
                       w.trimmed_rows, w.peak_rows, w.skips_disabled, w.skips_no_context, w.skips_drafting_off};
    for (std::size_t k = 0; k < sizeof now / sizeof now[0]; ++k)
        if (now[k] < was[k]) return true;
    for (std::size_t k = 0; k < last.histogram.size() && static_cast<i64>(k) <= c.block; ++k)
        if (state[device_step::bucket_at(c, seq, static_cast<i64>(k))] < last.histogram[k]) return true;
    return false;
}

// The first rule a step state breaks that the host cannot serve (NOT_LIVE,
// a Damage code, WENT_BACK or DAMAGE_NONE): the step's own rules
// (damage_of), and the ones only the host knows (max_failures, the last
// whole state: the device keeps no history).
constexpr int NOT_LIVE = -1;
constexpr int WENT_BACK = device_step::DAMAGE_COUNT;
int host_damage(const device_step::Config& c, const i64* state, i64 seq, const Regs& r, i64 max_failures,
                const LastWhole& last) {
    if (r.live == 0) return NOT_LIVE;
    const int code = device_step::damage_of(c, state, seq, r);
    if (code != device_step::DAMAGE_NONE) return code;
    if (r.failures > max_failures) return device_step::DAMAGE_FAILURES;
    return went_back(c, state, seq, r, last) ? WENT_BACK : int{device_step::DAMAGE_NONE};
}

// What host_damage found, in words ("" when nothing).
std::string damage(const device_step::Config& c, const i64* state, i64 seq, const Regs& r, i64 max_failures,
                   const LastWhole& last) {
    const int code = host_damage(c, state, seq, r, max_failures, last);
    if (code == NOT_LIVE) return "the sequence is not live in it";
    if (code == WENT_BACK) return "a counter is below what its steps had made";
    return damage_text(code);
}

// The rows a draft at `end` would stage without a rebase are buffered (the
// host's plan_round would otherwise find them missing: "dspark internal
// error"). Checked on the state as it comes back, its round resolved; an
// accept before that draft only lowers `end` (or skips it: no_context).
bool drafts_buffered(const device_step::Config& c, const Regs& r) {
    const bool rebase = r.restage_owed || r.end - r.pos_base + c.block > c.window;
    return rebase || r.n_cache >= r.end || (r.n_cache >= r.head_pos && r.n_cache >= r.horizon);
}

// A status word as the core's own error, after `prefix` (which names the
// entry); arg: the fault's value (a sticky fault read from the state), or
// -1 when unknown (a status word alone).
[[noreturn]] void raise_status(const std::string& prefix, const device_step::Config& c, std::int32_t status, i64 seq,
                               bool has_arg, i64 arg) {
    const std::string b = std::to_string(c.block);
    switch (status) {
        case device_step::STATUS_NOT_ON_DEVICE:
            if (seq < 0 || seq >= c.max_seqs) throw std::invalid_argument(prefix + detail::unknown_sequence(seq, c.max_seqs));
            throw StateError(prefix + seq_msg(seq) + " is not on the device: call to_device([" +
                             std::to_string(seq) + "]) before its steps");
        case device_step::STATUS_DUPLICATE:
            throw std::invalid_argument(prefix + seq_msg(seq) +
                                        " appears earlier in the same step: a step names each sequence once");
        case device_step::STATUS_BAD_COUNT:
            throw std::invalid_argument(prefix + "n_accepted must be in [0, " + b + "] (or -1: not in this step), got " +
                                        (has_arg ? std::to_string(arg) : std::string("a value outside")) +
                                        "; that step changed nothing for the sequence");
        case device_step::STATUS_POSITION_LIMIT:
            throw std::invalid_argument(prefix + "the verify rows after position " +
                                        (has_arg ? std::to_string(arg) : std::string("end")) +
                                        " would pass 2**62 - 1; that step changed nothing for the sequence");
        case device_step::STATUS_DAMAGED:
            throw std::invalid_argument(prefix + "the step state is damaged (" +
                                        (has_arg ? damage_text(static_cast<int>(arg)) : "a rule is broken") +
                                        "); the step changed nothing for the sequence: end it, or copy back a "
                                        "state a step wrote");
        case device_step::STATUS_INTERNAL:
            throw std::logic_error(prefix + "dspark internal error: a device step found the staged rows not "
                                            "buffered (status " + std::to_string(status) +
                                   "); that step changed nothing for the sequence");
        default:
            throw std::invalid_argument(prefix + "status " + std::to_string(status) +
                                        " is not a status word of the device step (0, 1 or 16.." +
                                        std::to_string(device_step::STATUS_LAST) + ")");
    }
}

// A batch's valid ids, each once, in increasing order: the order its
// sequences are locked in (the Stager's lock order).
std::vector<i64> lock_order(const std::vector<i64>& ids, i64 max_seqs) {
    std::vector<i64> order;
    order.reserve(ids.size());
    for (i64 q : ids)
        if (q >= 0 && q < max_seqs) order.push_back(q);
    std::sort(order.begin(), order.end());
    order.erase(std::unique(order.begin(), order.end()), order.end());
    return order;
}

// A batch names each sequence once: the first repeat's error (ids valid).
void check_unique_ids(const char* call, const std::vector<i64>& seqs, std::size_t n_unique) {
    if (n_unique == seqs.size()) return;
    for (std::size_t j = 1; j < seqs.size(); ++j)
        for (std::size_t i = 0; i < j; ++i)
            if (seqs[i] == seqs[j])
                throw std::invalid_argument(std::string(call) + ": sequence " + std::to_string(seqs[j]) +
                                            " appears twice (seqs[" + std::to_string(i) + "] and seqs[" +
                                            std::to_string(j) + "]): a batch names each sequence once");
}

// A chain drafter's ids travel by slot (to_device / to_host), those of the
// rows a later call may read: the stageable rows [horizon, end) of the
// step's fields and, with a reservation, those of the fields before it
// (cancel puts them back). A short reservation never takes their slots; one
// longer than the ring's free slots may (a long prefill chunk): its slot then
// holds the reservation's row, whose id is the one on the device, and the
// host keeps the displaced id (Seq::before_tokens) for a cancel. So the
// `before` rows come first and the live ones last: written in that order,
// the live id wins a shared slot. Dead rows below the horizon keep no id
// anyone reads.
struct StageableRows {
    const Regs &live, &before;
    bool with_before;
    // f(pos, k, m) for each run of rows (at most two per ring: it wraps at
    // most once): positions [pos, pos + m) at ring indices [k, k + m). A row
    // of both rings is listed twice, at the same index.
    template <class F>
    void each(F&& f) const {
        if (with_before) runs_of(before, f);
        runs_of(live, f);
    }
    template <class F>
    static void runs_of(const Regs& r, F&& f) {
        const i64 n = r.end - r.horizon;
        if (n <= 0) return;
        const i64 k = device_step::slot(r, r.horizon), run = device_step::imin(n, r.cap - k);
        f(r.horizon, static_cast<std::size_t>(k), static_cast<std::size_t>(run));
        if (run < n) f(r.horizon + run, std::size_t{0}, static_cast<std::size_t>(n - run));
    }
};
StageableRows stageable_rows(const Regs& live, const Regs& before, bool with_before) {
    return StageableRows{live, before, with_before};
}

}  // namespace

void Stager::check_token_table(const char* call, const void* tokens, std::size_t n_tokens) const {
    const std::size_t want = static_cast<std::size_t>(opt_.max_seqs) * ring_rows_;
    if (opt_.kind != DrafterKind::Chain) {
        if (tokens)
            throw std::invalid_argument(std::string(call) + ": tokens (the slot token table) are kept for a chain "
                                        "drafter (kind=\"chain\") only; this Stager's drafter kind is \"" +
                                        drafter_kind_name(opt_.kind) + "\"");
        return;
    }
    if (!tokens)
        throw std::invalid_argument(std::string(call) + ": a chain drafter's Stager hands its rows' token ids over "
                                    "by slot: it needs the slot token table (tokens: int32, max_seqs * ring_rows = " +
                                    std::to_string(want) + " ids; in C, the dspark_to_device_tokens / "
                                    "dspark_to_host_tokens forms)");
    if (n_tokens != want)
        throw std::invalid_argument(std::string(call) + ": the slot token table holds " + std::to_string(n_tokens) +
                                    " ids; it needs one per global slot, max_seqs * ring_rows = " +
                                    std::to_string(want));
}

struct StepIO {
    using SeqFields = Stager::SeqFields;
    // A Seq's fields that the step state carries, in both directions. The
    // reservation's `before` fields differ from the live ones only in what
    // reserve changes (every other call needs no reservation), so the pre_*
    // columns are all of it.
    static Regs regs_of(const SeqFields& s, const FeatureBuffer::Marks& m) {
        Regs r{};
        r.live = 1;
        r.end = s.end;
        r.horizon = s.horizon;
        r.n_cache = s.n_cache;
        r.pos_base = s.pos_base;
        r.restage_owed = s.restage_owed;
        r.first_round = s.first_round;
        r.disabled = s.disabled;
        r.failures = s.failures;
        r.accept_open = s.accept_open;
        r.tentative = s.tentative;
        r.verify_owed = s.verify_owed;
        r.open = s.open;
        r.open_start = s.open_start;
        r.open_base = s.open_base;
        r.cap = static_cast<i64>(m.cap);
        r.touched = static_cast<i64>(m.touched);
        r.head_slot = static_cast<i64>(m.head_slot);
        r.head_pos = m.head_pos;
        r.count = static_cast<i64>(m.count);
        r.rounds = s.stats.rounds;
        r.commits = s.stats.commits;
        r.rebases = s.stats.rebases;
        r.staged_rows = s.stats.staged_rows;
        r.restaged_rows = s.stats.restaged_rows;
        r.skips = s.stats.skips;
        r.skips_disabled = s.stats.skips_disabled;
        r.skips_no_context = s.stats.skips_no_context;
        r.skips_drafting_off = s.stats.skips_drafting_off;
        r.trims = s.stats.trims;
        r.trimmed_rows = s.stats.trimmed_rows;
        r.peak_rows = s.stats.peak_rows;
        return r;
    }

    // The reservation's `before` into r's pre_* columns (the live ones when none).
    static void set_pre(Regs& r, const SeqFields& b, const FeatureBuffer::Marks& m) {
        const Regs p = regs_of(b, m);
        r.pre_end = p.end;
        r.pre_horizon = p.horizon;
        r.pre_accept_open = p.accept_open;
        r.pre_tentative = p.tentative;
        r.pre_cap = p.cap;
        r.pre_touched = p.touched;
        r.pre_head_slot = p.head_slot;
        r.pre_head_pos = p.head_pos;
        r.pre_count = p.count;
        r.pre_trims = p.trims;
        r.pre_trimmed_rows = p.trimmed_rows;
        r.pre_peak_rows = p.peak_rows;
    }

    // The fields before the reservation: r with its pre_* columns in place.
    static Regs before_of(const Regs& r) {
        Regs p = r;
        p.end = r.pre_end;
        p.horizon = r.pre_horizon;
        p.accept_open = r.pre_accept_open;
        p.tentative = r.pre_tentative;
        p.cap = r.pre_cap;
        p.touched = r.pre_touched;
        p.head_slot = r.pre_head_slot;
        p.head_pos = r.pre_head_pos;
        p.count = r.pre_count;
        p.trims = r.pre_trims;
        p.trimmed_rows = r.pre_trimmed_rows;
        p.peak_rows = r.pre_peak_rows;
        p.reserved = 0;
        return p;
    }

    static void put_fields(const Regs& r, SeqFields& s) {
        s.end = r.end;
        s.horizon = r.horizon;
        s.n_cache = r.n_cache;
        s.pos_base = r.pos_base;
        s.restage_owed = r.restage_owed != 0;
        s.first_round = r.first_round != 0;
        s.disabled = r.disabled != 0;
        s.failures = r.failures;
        s.accept_open = r.accept_open != 0;
        s.tentative = r.tentative;
        s.verify_owed = r.verify_owed != 0;
        s.open = r.open != 0;
        s.open_start = r.open_start;
        s.open_base = r.open_base;
        s.stats.rounds = r.rounds;
        s.stats.commits = r.commits;
        s.stats.rebases = r.rebases;
        s.stats.staged_rows = r.staged_rows;
        s.stats.restaged_rows = r.restaged_rows;
        s.stats.skips = r.skips;
        s.stats.skips_disabled = r.skips_disabled;
        s.stats.skips_no_context = r.skips_no_context;
        s.stats.skips_drafting_off = r.skips_drafting_off;
        s.stats.trims = r.trims;
        s.stats.trimmed_rows = r.trimmed_rows;
        s.stats.rows = r.count;  // note_size: rows held == the ring's count
        s.stats.peak_rows = r.peak_rows;
    }

};

void Stager::refuse_on_device(std::int64_t seq, const Seq& s) const {
    if (s.on_device)
        throw StateError(seq_msg(seq) + " is on the device (to_device): call to_host([" + std::to_string(seq) +
                         "]) first, which brings it back with its step state");
}

device_step::Config Stager::step_config() const noexcept {
    device_step::Config c;
    c.block = opt_.block_size;
    c.window = opt_.window;
    c.w_keep = w_keep_;
    c.ring_rows = static_cast<i64>(ring_rows_);
    c.max_seqs = opt_.max_seqs;
    c.max_rows = max_plan_rows();
    c.trim_chunk = TRIM_CHUNK;
    c.max_position = MAX_POSITION;
    return c;
}

std::int64_t* Stager::step_state() {
    std::call_once(step_once_, [&] {
        const auto k = static_cast<std::size_t>(device_step::columns(step_config())) *
                       static_cast<std::size_t>(opt_.max_seqs);
        step_state_.reset(new std::int64_t[k]());  // zero: no sequence is live
    });
    return step_state_.get();
}

// The sequence's step fields and counters come back as trusted_regs reads
// them (so totals() never go back by the steps it made), and its live column
// is cleared, so a later step names it STEP_NOT_ON_DEVICE. The caller ends it.
void Stager::leave_step(std::int64_t seq, Seq& s) noexcept {
    const device_step::Config c = step_config();
    i64* state = step_state_.get();  // allocated: the sequence was handed over
    // As end on the host: an open round is dropped (counted in rounds, not in
    // commits), a reservation counts as before it (Stager::stats_of).
    const Regs r = trusted_regs(s, accepted_row(s));
    StepIO::put_fields(r, s);
    if (r.reserved == device_step::RESERVED_STEP) {
        s.before = static_cast<const SeqFields&>(s);
        StepIO::put_fields(StepIO::before_of(r), s.before);
    }
    s.reserved = r.reserved != device_step::RESERVED_NONE;
    state[device_step::F_live * c.max_seqs + seq] = 0;
    s.on_device = false;
}

Regs Stager::trusted_regs(const Seq& s, std::int64_t* histogram) const {
    const device_step::Config c = step_config();
    const i64 seq = static_cast<i64>(&s - seqs_.data());
    const i64* state = step_state_.get();  // allocated: the sequence was handed over
    Regs r;
    device_step::load(state, c.max_seqs, seq, r);
    if (host_damage(c, state, seq, r, opt_.max_failures, LastWhole{s.last_whole, s.last_whole_hist}) !=
        device_step::DAMAGE_NONE) {  // the last whole state seen: counters never go back
        std::copy(s.last_whole_hist.begin(), s.last_whole_hist.end(), histogram);
        return s.last_whole;
    }
    for (i64 k = 0; k <= c.block; ++k) histogram[k] = state[device_step::bucket_at(c, seq, k)];
    s.last_whole = r;
    s.last_whole_hist.assign(histogram, histogram + c.block + 1);
    return r;
}

SeqStats Stager::stats_on_device(const Seq& s, bool settled, std::int64_t* histogram) const {
    const Regs r = trusted_regs(s, histogram);
    SeqFields f = s;  // the fields as to_host would bring them back (the open round not committed)
    if (settled && r.reserved == device_step::RESERVED_HOST) {
        f = s.before;
    } else {
        StepIO::put_fields(settled && r.reserved == device_step::RESERVED_STEP ? StepIO::before_of(r) : r, f);
    }
    return stats_of_fields(f, histogram);
}

bool Stager::on_device(std::int64_t seq) const {
    auto lock = lock_seq(seq);
    return get(seq).on_device;
}

void Stager::to_device(const std::int64_t* seqs_in, std::size_t n, std::int32_t* tokens, std::size_t n_tokens) {
    const char* call = "to_device";
    const std::vector<i64> seqs = copy_ids(seqs_in, n);
    for (std::size_t i = 0; i < n; ++i)
        try {
            get(seqs[i]);
        } catch (...) {
            rethrow_with_prefix(where(call, i, seqs[i]));
        }
    require_mode(RowMode::External, call, "the device step plans slots: run the Stager with rows=\"external\"");
    check_token_table(call, tokens, n_tokens);
    i64* state = step_state();  // may throw (allocation): nothing has changed
    const device_step::Config c = step_config();
    const std::vector<i64> order = lock_order(seqs, c.max_seqs);
    std::vector<std::unique_lock<std::mutex>> held;
    held.reserve(order.size());
    for (i64 q : order) held.emplace_back(locks_[static_cast<std::size_t>(q)].m);
    for (std::size_t i = 0; i < n; ++i) {
        const Seq& s = get(seqs[i]);
        const std::string at = where(call, i, seqs[i]);
        if (s.on_device) throw StateError(at + seq_msg(seqs[i]) + " is on the device already");
        if (!s.started)
            throw StateError(at + seq_msg(seqs[i]) +
                             " holds no rows: process its prompt (process_external) before to_device");
        if (!s.tree.empty())
            throw StateError(at + seq_msg(seqs[i]) +
                             " holds a tree verify batch (the device step verifies linear batches): call "
                             "accept_path before to_device");
    }
    check_unique_ids(call, seqs, order.size());
    for (i64 q : seqs) {
        Seq& s = seqs_[static_cast<std::size_t>(q)];
        Regs r = StepIO::regs_of(s, s.buf.marks());
        r.drafting_off = s.drafting_off;  // the request's switch, outside SeqFields
        r.reserved = s.reserved ? device_step::RESERVED_HOST : device_step::RESERVED_NONE;
        if (s.reserved) StepIO::set_pre(r, s.before, s.before_marks);
        else StepIO::set_pre(r, s, s.buf.marks());
        r.fault = r.fault_arg = 0;
        device_step::store(state, c.max_seqs, q, r);
        const i64* hist = accepted_row(s);
        for (i64 k = 0; k <= c.block; ++k) state[device_step::bucket_at(c, q, k)] = hist[k];
        s.last_whole = r;
        s.last_whole_hist.assign(hist, hist + c.block + 1);
        if (tokens) {  // the ids at their rows' slots, -1 at the sequence's others
            std::int32_t* mine = tokens + q * c.ring_rows;
            std::fill(mine, mine + c.ring_rows, -1);
            const Regs pre = StepIO::before_of(r);
            const std::int32_t* kept = s.buf.slot_tokens();
            stageable_rows(r, pre, s.reserved).each([&](i64, std::size_t k, std::size_t m) {
                std::copy_n(kept + k, m, mine + k);
            });
        }
        s.on_device = true;
    }
}

void Stager::to_host(const std::int64_t* seqs_in, std::size_t n, const std::int32_t* outcomes_in,
                     std::int64_t* disabled_after, const std::int32_t* tokens, std::size_t n_tokens) {
    const char* call = "to_host";
    const std::vector<i64> seqs = copy_ids(seqs_in, n);
    std::vector<std::int32_t> outcomes(n, -1);
    if (outcomes_in) std::copy(outcomes_in, outcomes_in + n, outcomes.begin());
    for (std::size_t i = 0; i < n; ++i)
        try {
            get(seqs[i]);
        } catch (...) {
            rethrow_with_prefix(where(call, i, seqs[i]));
        }
    check_token_table(call, tokens, n_tokens);
    i64* state = step_state();
    const device_step::Config c = step_config();
    const std::vector<i64> order = lock_order(seqs, c.max_seqs);
    std::vector<std::unique_lock<std::mutex>> held;
    held.reserve(order.size());
    for (i64 q : order) held.emplace_back(locks_[static_cast<std::size_t>(q)].m);
    // Every check before any change (design.md 2.1): states, uniqueness,
    // the outcomes, the step state's consistency, then the token ids.
    for (std::size_t i = 0; i < n; ++i)
        if (!get(seqs[i]).on_device)
            throw StateError(where(call, i, seqs[i]) + seq_msg(seqs[i]) + " is not on the device (to_device)");
    check_unique_ids(call, seqs, order.size());
    std::vector<Regs> regs(n);
    for (std::size_t i = 0; i < n; ++i) {
        device_step::load(state, c.max_seqs, seqs[i], regs[i]);
        const std::string at = where(call, i, seqs[i]);
        const std::int32_t o = outcomes[i];
        if (o != -1 && (o < 0 || o >= FAIL_STAGE_COUNT))
            throw std::invalid_argument(at + "outcome must be -1 (the drafter ran: commit) or a fail stage code (0: "
                                             "decode, 1: crop), got " + std::to_string(o));
        if (o != -1 && !regs[i].open)
            throw StateError(at + seq_msg(seqs[i]) +
                             " has no open round to fail (its last step skipped, or it was never stepped)");
    }
    auto refuse = [&](std::size_t i, const std::string& why) {
        throw std::invalid_argument(where(call, i, seqs[i]) + "the step state is damaged (" + why +
                                    "); nothing was brought back");
    };
    for (std::size_t i = 0; i < n; ++i) {
        const Seq& s = get(seqs[i]);
        const std::string bad = damage(c, state, seqs[i], regs[i], opt_.max_failures,
                                       LastWhole{s.last_whole, s.last_whole_hist});
        if (!bad.empty()) refuse(i, bad);
        // The host's own reservation, untouched on the device, comes back as the host keeps it.
        if (regs[i].reserved == device_step::RESERVED_HOST && !get(seqs[i]).reserved)
            refuse(i, "it names a reservation the host never handed over");
    }
    // Each round resolved by its outcome, on the live fields and on the ones
    // before the reservation (resolving first or after the reservation is
    // the same: the two touch disjoint fields); nothing is stored yet. The
    // `before` of the host's reservation is the host's own (it also holds
    // what the step state does not carry: started, n_cache, pos_base, ...).
    std::vector<Regs> pres(n);
    std::vector<i64> disabled(n, 0);
    std::vector<char> failed(n, 0);
    for (std::size_t i = 0; i < n; ++i) {
        Regs& r = regs[i];
        const Seq& s = get(seqs[i]);
        pres[i] = r.reserved == device_step::RESERVED_HOST ? StepIO::regs_of(s.before, s.before_marks)
                                                           : StepIO::before_of(r);
        if (!r.open) continue;
        failed[i] = outcomes[i] != -1;
        if (failed[i]) {
            disabled[i] = fail_regs(c, r, opt_.max_failures);
            (void)fail_regs(c, pres[i], opt_.max_failures);
        } else {
            device_step::commit(c, r);
            device_step::commit(c, pres[i]);
        }
    }
    for (std::size_t i = 0; i < n; ++i)
        if (!drafts_buffered(c, regs[i]) || (regs[i].reserved && !drafts_buffered(c, pres[i])))
            refuse(i, "the rows of its next round are not buffered");
    // A chain drafter's ids: a private copy of each sequence's slots (the
    // caller's table may change under a released GIL), checked at the rows
    // that come back, and room for them in its ring (allocated now, before
    // anything changes).
    std::vector<std::vector<std::int32_t>> ids(tokens ? n : 0);
    for (std::size_t i = 0; i < ids.size(); ++i) {
        const i64 q = seqs[i];
        const Regs &r = regs[i], &pre = pres[i];
        const std::int32_t* mine = tokens + q * c.ring_rows;
        ids[i].assign(mine, mine + c.ring_rows);
        // The reservation's own rows (the last step's verify rows, from
        // pre.end on) may come back unwritten: a round whose drafter failed
        // builds no verify batch. confirm refuses them; cancel drops them.
        const i64 unwritten_from = r.reserved ? pre.end : r.end;
        stageable_rows(r, pre, r.reserved == device_step::RESERVED_STEP).each([&](i64 pos, std::size_t k,
                                                                                   std::size_t m) {
            const std::int32_t* run = ids[i].data() + k;
            const auto checked = static_cast<std::ptrdiff_t>(
                device_step::iclamp(unwritten_from - pos, 0, static_cast<i64>(m)));
            const std::int32_t* bad = std::find_if(run, run + checked, [](std::int32_t v) { return v < 0; });
            if (bad == run + checked) return;
            const i64 j = bad - run;
            throw std::invalid_argument(where(call, i, q) + "the slot token table holds " + std::to_string(*bad) +
                                        " at slot " + std::to_string(q * c.ring_rows + static_cast<i64>(k) + j) +
                                        ", the row of position " + std::to_string(pos + j) +
                                        ": write each verify row's token id at its verify slot before the next "
                                        "step (docs/protocol.md, the device step); nothing was brought back");
        });
        seqs_[static_cast<std::size_t>(q)].buf.size_tokens(static_cast<std::size_t>(c.ring_rows));
    }
    // Bring each back.
    std::size_t faulted = n;
    for (std::size_t i = 0; i < n; ++i) {
        Seq& s = seqs_[static_cast<std::size_t>(seqs[i])];
        const Regs &r = regs[i], &pre = pres[i];
        if (disabled_after) disabled_after[i] = disabled[i];
        StepIO::put_fields(r, s);
        s.drafting_off = r.drafting_off != 0;  // switched on the device (set_drafting) or before it
        i64* hist = accepted_row(s);
        for (i64 k = 0; k <= c.block; ++k) hist[k] = state[device_step::bucket_at(c, seqs[i], k)];
        s.buf.set_marks(marks_of(r.cap, r.touched, r.head_slot, r.count, r.head_pos));
        s.round = 0;
        if (failed[i]) s.stats.failures += 1;
        s.reserved = r.reserved != device_step::RESERVED_NONE;
        if (r.reserved == device_step::RESERVED_STEP) {  // the last step's: its `before` is the step's fields
            s.before = static_cast<const SeqFields&>(s);
            StepIO::put_fields(pre, s.before);
            s.before_marks = marks_of(pre.cap, pre.touched, pre.head_slot, pre.count, pre.head_pos);
            s.before_tokens.clear();
        } else if (r.reserved == device_step::RESERVED_HOST) {  // the host's: kept, its round resolved
            StepIO::put_fields(pre, s.before);
        } else {
            s.before_tokens.clear();
        }
        if (!ids.empty()) {
            std::int32_t* kept = s.buf.slot_tokens();
            const std::int32_t* got = ids[i].data();
            stageable_rows(r, pre, r.reserved == device_step::RESERVED_STEP)
                .each([&](i64, std::size_t k, std::size_t m) { std::copy_n(got + k, m, kept + k); });
        }
        s.on_device = false;
        state[device_step::F_live * c.max_seqs + seqs[i]] = 0;
        if (faulted == n && r.fault != 0) faulted = i;
    }
    if (faulted != n) {
        const Regs& r = regs[faulted];
        raise_status(where(call, faulted, seqs[faulted]) + seq_msg(seqs[faulted]) +
                         " is back on the host, but one of its device steps failed: ",
                     c, static_cast<std::int32_t>(r.fault), seqs[faulted], true, r.fault_arg);
    }
}

void Stager::step_many(const std::int64_t* seqs_in, const std::int64_t* counts_in, std::size_t n,
                       const device_step::Outputs& out) {
    const char* call = "step_many";
    require_mode(RowMode::External, call, "the device step plans slots: run the Stager with rows=\"external\"");
    if (n && out.status == nullptr) throw NullPointer(std::string(call) + ": out.status must not be null");
    const std::vector<i64> seqs = copy_ids(seqs_in, n), counts = copy_ids(counts_in, n);
    i64* state = step_state();
    const device_step::Config c = step_config();
    // An id's later occurrences are duplicates (the kernel finds them by
    // scanning the entries before its own; here a mark per sequence).
    thread_local std::vector<std::uint8_t> seen;
    if (seen.size() < static_cast<std::size_t>(c.max_seqs)) seen.resize(static_cast<std::size_t>(c.max_seqs));
    const std::vector<i64> order = lock_order(seqs, c.max_seqs);
    std::vector<std::unique_lock<std::mutex>> held;
    held.reserve(order.size());
    for (i64 q : order) held.emplace_back(locks_[static_cast<std::size_t>(q)].m);
    for (std::size_t i = 0; i < n; ++i) {
        const i64 q = seqs[i];
        bool dup = false;
        if (q >= 0 && q < c.max_seqs) {
            dup = seen[static_cast<std::size_t>(q)] != 0;
            seen[static_cast<std::size_t>(q)] = 1;
        }
        device_step::Plan plan;
        const std::int32_t status = device_step::step_one(c, state, out, static_cast<i64>(i), q, counts[i], dup, plan);
        device_step::write_rows(c, out, static_cast<i64>(i), device_step::rows_of(status, plan), 0, 1);
    }
    for (i64 q : seqs)
        if (q >= 0 && q < c.max_seqs) seen[static_cast<std::size_t>(q)] = 0;
}

void Stager::step_rows(const std::int64_t* seqs_in, std::size_t n, const device_step::Outputs& out,
                       std::size_t capacity, const device_step::CsrRows& rows) {
    const char* call = "step_rows";
    require_mode(RowMode::External, call, "the device step plans slots: run the Stager with rows=\"external\"");
    if (capacity < n)
        throw std::invalid_argument(std::string(call) + ": rows for " + std::to_string(capacity) +
                                    " entries, a batch of " + std::to_string(n) +
                                    ": the CSR rows serve any batch of at most their capacity");
    if (rows.row_offsets == nullptr) throw NullPointer(std::string(call) + ": rows.row_offsets must not be null");
    if (n && (!out.status || !out.skip || !out.start || !out.n_rows || !out.pos_base))
        throw NullPointer(std::string(call) + ": out.status, skip, start, n_rows and pos_base must not be null");
    const std::vector<i64> seqs = copy_ids(seqs_in, n);
    const i64* state = step_state();
    const device_step::Config c = step_config();
    const std::vector<i64> order = lock_order(seqs, c.max_seqs);
    std::vector<std::unique_lock<std::mutex>> held;
    held.reserve(order.size());
    for (i64 q : order) held.emplace_back(locks_[static_cast<std::size_t>(q)].m);
    i64 total = 0;
    for (std::size_t i = 0; i < n; ++i) {
        const device_step::Rows w = device_step::rows_after_step(c, state, out, static_cast<i64>(i), seqs[i]);
        rows.row_offsets[i] = total;
        device_step::write_csr_rows(rows, total, w, 0, 1);
        total += w.n_rows;
    }
    for (std::size_t i = n; i <= capacity; ++i) rows.row_offsets[i] = total;
}

void Stager::check_step(const std::int64_t* seqs, const std::int32_t* statuses, std::size_t n) const {
    const device_step::Config c = step_config();
    for (std::size_t i = 0; i < n; ++i)
        if (statuses[i] >= device_step::STATUS_FIRST_ERROR || (statuses[i] != device_step::STATUS_OK &&
                                                        statuses[i] != device_step::STATUS_NOT_IN_STEP))
            raise_status(where("step_many", i, seqs[i]), c, statuses[i], seqs[i], false, 0);
}

}  // namespace dspark
