#include "dspark/stager.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "dspark/crc32c.hpp"
#include "dspark/errors.hpp"
#include "row_format_kernels.hpp"
#include "stager_batch.hpp"

namespace dspark {

using detail::copy_of;
using detail::in_batch;
using detail::seq_msg;

namespace {

// A position-like count (n_past, n_keep, ...): [0, MAX_POSITION).
void require_count(const char* name, std::int64_t v) {
    if (v < 0 || v >= MAX_POSITION)
        throw std::invalid_argument(std::string(name) + " must be in [0, 2**62), got " + std::to_string(v));
}

// An enum field of StagerOptions that holds no valid value (a C++ caller's cast).
template <class E>
void require_code(const char* field, E value, int count, const char* (*name)(E) noexcept) {
    (void)enum_from_code<ConfigError>(field, static_cast<std::int64_t>(value), count, name);
}

}  // namespace

const char* skip_name(Skip s) noexcept {
    switch (s) {
        case Skip::Disabled: return "disabled";
        case Skip::Empty: return "empty";
        case Skip::NoContext: return "no_context";
        case Skip::MissingRows: return "missing_rows";
        case Skip::DraftingOff: return "drafting_off";
        default: return "";
    }
}

const char* fail_stage_name(FailStage s) noexcept {
    switch (s) {
        case FailStage::Decode: return "decode";
        case FailStage::Crop: return "crop";
    }
    return nullptr;
}

const char* drafter_kind_name(DrafterKind k) noexcept {
    switch (k) {
        case DrafterKind::Block: return "block";
        case DrafterKind::Chain: return "chain";
    }
    return nullptr;
}

const char* row_mode_name(RowMode m) noexcept {
    switch (m) {
        case RowMode::Held: return "held";
        case RowMode::External: return "external";
    }
    return nullptr;
}

#define DSPARK_STATE_FIELD_INFO(type, name) DSPARK_FIELD_INFO(SeqState, type, name)
#define DSPARK_STATS_FIELD_INFO(type, name) DSPARK_FIELD_INFO(SeqStats, type, name)
const FieldInfo SEQ_STATE_FIELDS[] = {DSPARK_SEQ_STATE_FIELDS(DSPARK_STATE_FIELD_INFO){nullptr, 0, false}};
const FieldInfo SEQ_STATS_FIELDS[] = {DSPARK_SEQ_STATS_FIELDS(DSPARK_STATS_FIELD_INFO){nullptr, 0, false}};
#undef DSPARK_STATS_FIELD_INFO
#undef DSPARK_STATE_FIELD_INFO
#define DSPARK_STATS_NAME(name) #name,
const char* const SEQ_STATS_GAUGES[] = {DSPARK_SEQ_STATS_GAUGES(DSPARK_STATS_NAME) nullptr};
const char* const SEQ_STATS_PEAKS[] = {DSPARK_SEQ_STATS_PEAKS(DSPARK_STATS_NAME) nullptr};
#undef DSPARK_STATS_NAME

std::string mismatch_cause(std::int64_t n_past, std::int64_t end) {
    if (end > n_past)
        return "rows " + std::to_string(n_past) + ".." + std::to_string(end - 1) +
               " are still buffered: was accept() not called after the verify batch (it keeps n_accepted + 1 of "
               "its rows), or is a rollback() to the target's n_past missing?";
    return "rows " + std::to_string(end) + ".." + std::to_string(n_past - 1) +
           " were never processed: every target decode (prefill chunk, verify batch) must be passed to process()";
}

void check_options(const StagerOptions& o) {
    const std::pair<const char*, std::int64_t> counts[] = {
        {"feature_dim", o.feature_dim}, {"block_size", o.block_size},     {"window", o.window},
        {"max_seqs", o.max_seqs},       {"max_failures", o.max_failures},
    };
    for (const auto& [name, v] : counts)
        if (v < 1) throw ConfigError(std::string(name) + " must be >= 1, got " + std::to_string(v));
    require_code("storage", o.storage, STORAGE_COUNT, storage_name);
    require_code("nonfinite", o.nonfinite, NONFINITE_COUNT, nonfinite_name);
    require_code("stage_dtype", o.stage, ELEM_TYPE_COUNT, elem_name);
    require_code("rows", o.rows, ROW_MODE_COUNT, row_mode_name);
    require_code("kind", o.kind, DRAFTER_KIND_COUNT, drafter_kind_name);
    // A rebase keeps W / 2 rows and must still fit a block: W > 2B (never an abort). Written as
    // B > (W - 1) / 2 (W >= 1 here): 2B overflows int64 for B >= 2**62, which once let any W pass.
    if (o.block_size > (o.window - 1) / 2)
        throw ConfigError("window (" + std::to_string(o.window) + ") must be greater than 2 * block_size (2 * " +
                          std::to_string(o.block_size) + " = " +
                          std::to_string(2 * static_cast<std::uint64_t>(o.block_size)) + ")");
    if (o.window > MAX_WINDOW) throw ConfigError("window (" + std::to_string(o.window) + ") must be <= 2**30");
    if (o.feature_dim > MAX_FEATURE_DIM)
        throw ConfigError("feature_dim (" + std::to_string(o.feature_dim) + ") must be <= 2**28");
    if (o.max_seqs > MAX_SEQS_LIMIT)
        throw ConfigError("max_seqs (" + std::to_string(o.max_seqs) + ") exceeds the limit " +
                          std::to_string(MAX_SEQS_LIMIT));
    // q formats: whole blocks of 32 (ConfigError naming storage and feature_dim).
    (void)dspark::row_bytes(o.storage, static_cast<std::size_t>(o.feature_dim));
}

Stager::Stager(const StagerOptions& o) : opt_(o) {
    check_options(o);
    row_bytes_ = dspark::row_bytes(o.storage, static_cast<std::size_t>(o.feature_dim));
    bounds_ = encode_bounds(o.storage, o.stage);
    w_keep_ = dspark::w_keep(o.block_size, o.window);
    ring_rows_ = static_cast<std::size_t>(dspark::ring_rows(o.block_size, o.window));
    // The ring reserves ring_rows_ rows: that size must be representable.
    if (ring_rows_ > (SIZE_MAX >> 1) / row_bytes_)
        throw ConfigError("window x feature_dim is too large: one sequence's buffer would exceed the address space");
    seqs_.resize(static_cast<std::size_t>(o.max_seqs));
    const auto buckets = static_cast<std::size_t>(o.block_size) + 1;
    accepted_.assign(static_cast<std::size_t>(o.max_seqs) * buckets, 0);
    retired_.accepted.assign(buckets, 0);
    for (auto& s : seqs_) fresh_seq(s);
    locks_ = std::make_unique<SeqMutex[]>(static_cast<std::size_t>(o.max_seqs));
    changed_ = std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(o.max_seqs));
}

void Stager::fresh_seq(Seq& s) const {
    retire_stats(s);
    FeatureBuffer buf = std::move(s.buf);
    s = Seq{};
    s.buf = std::move(buf);
    if (s.buf.row_bytes() != row_bytes_ || s.buf.external() != external() ||
        s.buf.with_tokens() != (opt_.kind == DrafterKind::Chain))
        s.buf = new_ring();
    s.buf.reset(0);
    note_size(s);
}


// -- metrics -------------------------------------------------------------------
// Invariant: totals() == retired_ + the settled stats of every sequence (as
// before an open reservation), so a sequence's counters are folded into
// retired_ exactly when they reset, and no counter of totals() goes back.

namespace {

// to += from, as totals combine two sequences' stats: every field adds up
// but the peaks, which take the larger.
void add_stats(SeqStats& to, const SeqStats& from) noexcept {
#define DSPARK_PEAK_SAVE(name) const std::int64_t name = std::max(to.name, from.name);
    DSPARK_SEQ_STATS_PEAKS(DSPARK_PEAK_SAVE)
#undef DSPARK_PEAK_SAVE
#define DSPARK_ADD_FIELD(type, name) to.name += from.name;
    DSPARK_SEQ_STATS_FIELDS(DSPARK_ADD_FIELD)
#undef DSPARK_ADD_FIELD
#define DSPARK_PEAK_SET(name) to.name = name;
    DSPARK_SEQ_STATS_PEAKS(DSPARK_PEAK_SET)
#undef DSPARK_PEAK_SET
}

}  // namespace

std::int64_t* Stager::accepted_row(const Seq& s) const noexcept {
    const auto i = static_cast<std::size_t>(&s - seqs_.data());
    return accepted_.data() + i * (static_cast<std::size_t>(opt_.block_size) + 1);
}

void Stager::retire_stats(const Seq& s) const {
    std::int64_t* row = accepted_row(s);
    std::lock_guard<std::mutex> lock(retired_.m);
    SeqStats& to = retired_.stats;
    add_stats(to, stats_of(s, true));
#define DSPARK_DROP_GAUGE(name) to.name = 0;
    DSPARK_SEQ_STATS_GAUGES(DSPARK_DROP_GAUGE)  // an ended sequence holds nothing
#undef DSPARK_DROP_GAUGE
    for (std::size_t k = 0; k < retired_.accepted.size(); ++k) {
        retired_.accepted[k] += row[k];
        row[k] = 0;
    }
}

SeqStats Stager::stats_of(const Seq& s, bool settled) const {
    if (s.on_device) {
        std::vector<std::int64_t> hist(static_cast<std::size_t>(opt_.block_size) + 1);
        return stats_on_device(s, settled, hist.data());
    }
    return stats_of_fields(settled && s.reserved ? s.before : s, accepted_row(s));
}

SeqStats Stager::stats_of_fields(const SeqFields& f, const std::int64_t* row) const {
    SeqStats out = f.stats;
    out.live_rows = f.started ? f.end - f.horizon : 0;
    for (std::int64_t k = 0; k <= opt_.block_size; ++k) {
        out.verified_rounds += row[k];
        out.accepted_tokens += k * row[k];
    }
    return out;
}

std::string batch_context(const char* call, std::size_t i, std::int64_t seq) {
    return std::string(call) + ": seqs[" + std::to_string(i) + "] (sequence " + std::to_string(seq) + "): ";
}

// -- locks ---------------------------------------------------------------------
// Each sequence has its own mutex (stager.hpp, "Thread safety"). A call checks
// its ids first (an unknown id locks nothing), then locks: one sequence, two
// in id order (fork), or a batch's in id order (BatchLock), so two calls
// never wait on each other in a cycle.

std::unique_lock<std::mutex> Stager::lock_seq(std::int64_t seq) const {
    get(seq);
    return std::unique_lock<std::mutex>(locks_[static_cast<std::size_t>(seq)].m);
}

std::pair<std::unique_lock<std::mutex>, std::unique_lock<std::mutex>> Stager::lock_pair(std::int64_t a,
                                                                                         std::int64_t b) const {
    get(a);
    get(b);
    const std::int64_t lo = std::min(a, b), hi = std::max(a, b);
    std::unique_lock<std::mutex> first(locks_[static_cast<std::size_t>(lo)].m);
    if (lo == hi) return {std::move(first), std::unique_lock<std::mutex>()};
    return {std::move(first), std::unique_lock<std::mutex>(locks_[static_cast<std::size_t>(hi)].m)};
}

// -- validation (design.md 2.1) -------------------------------------------------
// 1. an unknown sequence (std::invalid_argument), 2. the state (StateError),
// 3. the arguments' values, in the order of the call's signature, content
// (non-finite rows, snapshot bytes) last, 4. strict mode's protocol check
// (StateError). Each function below checks without changing anything; the
// calls run them, then change state. A batch runs each step over all of its
// sequences before the next step.

const Stager::Seq& Stager::get(std::int64_t seq) const {
    if (seq < 0 || seq >= opt_.max_seqs) throw std::invalid_argument(detail::unknown_sequence(seq, opt_.max_seqs));
    return seqs_[static_cast<std::size_t>(seq)];
}

const Stager::Seq& Stager::needs(std::int64_t seq, Need need) const {
    const Seq& s = get(seq);
    refuse_on_device(seq, s);
    if (need == Need::Any) return s;
    if (s.reserved && need != Need::Reserved)
        throw StateError(seq_msg(seq) + " has reserved rows: call confirm() or cancel() first");
    switch (need) {
        case Need::Ready:
            if (s.open) throw StateError(seq_msg(seq) + " has an open round: call commit() or fail() first");
            if (!s.tree.empty())
                throw StateError(seq_msg(seq) + " holds a tree verify batch: call accept_path() first");
            break;
        case Need::Tree:
            if (s.tree.empty())
                throw StateError(seq_msg(seq) + " holds no tree verify batch (call process_tree() first)");
            break;
        case Need::Open:
            if (!s.open) throw StateError(seq_msg(seq) + " has no open round (call draft() first)");
            break;
        case Need::Reserved:
            if (!s.reserved) throw StateError(seq_msg(seq) + " has no reserved rows (call reserve() first)");
            break;
        case Need::Any: break;
    }
    return s;
}

void Stager::require_mode(RowMode mode, const char* call, const char* instead) const {
    if (opt_.rows == mode) return;
    if (instead == nullptr)
        instead = mode == RowMode::Held ? "use process_external: the rows stay with their owner"
                                        : "use process / process_encoded";
    throw std::invalid_argument(std::string(call) +
                                (mode == RowMode::Held ? " needs held rows, but this Stager runs in external-row mode ("
                                                       : " needs external-row mode, but this Stager holds its rows (") +
                                instead + ")");
}

void Stager::check_sequence(std::int64_t seq, Need need) const {
    auto lock = lock_seq(seq);
    needs(seq, need);
}

void Stager::check_ids(const char* call, const std::int64_t* seqs, std::size_t n) const {
    for (std::size_t i = 0; i < n; ++i) in_batch(call, i, seqs[i], [&] { get(seqs[i]); });
}

void Stager::check_states(const char* call, const std::int64_t* seqs, std::size_t n, Need need) const {
    for (std::size_t i = 0; i < n; ++i) in_batch(call, i, seqs[i], [&] { needs(seqs[i], need); });
}

void Stager::check_batch(const char* call, const std::int64_t* seqs, std::size_t n, Need need) const {
    const std::vector<std::int64_t> ids = copy_of(seqs, n);
    check_ids(call, ids.data(), n);
    BatchLock lock(*this, ids.data(), n);
    check_states(call, ids.data(), n, need);
}

void Stager::check_unique(const char* call, const BatchLock& lock, const std::int64_t* seqs, std::size_t n) const {
    const std::size_t j = lock.repeat();
    if (j == n) return;
    std::size_t i = 0;
    while (seqs[i] != seqs[j]) ++i;
    throw std::invalid_argument(std::string(call) + ": sequence " + std::to_string(seqs[j]) + " appears twice (seqs[" +
                                std::to_string(i) + "] and seqs[" + std::to_string(j) +
                                "]): a batch names each sequence once");
}

void Stager::check_offsets(const char* call, const std::int64_t* cu, std::size_t n, std::size_t total) {
    const std::string who = std::string(call) + ": cu_seqlens ";
    if (cu[0] != 0) throw std::invalid_argument(who + "must start at 0, got " + std::to_string(cu[0]));
    for (std::size_t i = 0; i < n; ++i)
        if (cu[i + 1] < cu[i])
            throw std::invalid_argument(who + "must not decrease, got cu_seqlens[" + std::to_string(i + 1) + "] = " +
                                        std::to_string(cu[i + 1]) + " < cu_seqlens[" + std::to_string(i) +
                                        "] = " + std::to_string(cu[i]));
    if (static_cast<std::uint64_t>(cu[n]) != total)
        throw std::invalid_argument(who + "must end at the " + std::to_string(total) + " rows, got " +
                                    std::to_string(cu[n]));
}

// Returns the first position, read once: everything after uses only it and n
// (the caller's array may change under a released GIL; ours must not).
std::int64_t Stager::validate_positions(std::int64_t seq_id, const Seq& s, const std::int64_t* pos,
                                        std::size_t n) const {
    if (n == 0) return 0;
    const std::int64_t p0 = pos[0];
    // Every position in range first (the first one that is not is named),
    // so that end = last + 1 < MAX_POSITION; then contiguity; then continuity.
    for (std::size_t i = 0; i < n; ++i) {
        const std::int64_t p = i == 0 ? p0 : pos[i];
        if (p < 0 || p >= MAX_POSITION - 1)
            throw std::invalid_argument("position " + std::to_string(p) + " is out of range [0, 2**62 - 1)");
    }
    for (std::size_t i = 1; i < n; ++i)
        if (pos[i] != p0 + static_cast<std::int64_t>(i))
            throw std::invalid_argument(seq_msg(seq_id) + ": positions must be contiguous (+1 each row)");
    if (s.started && p0 != s.end)
        throw std::invalid_argument(
            seq_msg(seq_id) + ": positions must continue at " + std::to_string(s.end) + ", got " +
            std::to_string(p0) +
            (p0 < s.end ? " (rows up to " + std::to_string(s.end - 1) +
                              " are buffered: was accept() not called after the verify batch, or is a rollback() "
                              "to the target's n_past missing?)"
                        : " (rows " + std::to_string(s.end) + ".." + std::to_string(p0 - 1) +
                              " were never processed: every target decode must be passed to process())"));
    return p0;
}

void Stager::check_process(std::int64_t seq, const std::int64_t* positions, std::size_t n,
                           const std::int32_t* tokens) const {
    auto lock = lock_seq(seq);
    const Seq& s = ready(seq);
    validate_positions(seq, s, positions, n);
    (void)check_tokens(nullptr, tokens, n);
}

void Stager::check_process_many(const std::int64_t* seqs_in, std::size_t n, const std::int64_t* cu_in,
                                const std::int64_t* positions, std::size_t total, const std::int32_t* tokens) const {
    const char* call = "process_many";
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Ready);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    const std::vector<std::int64_t> cu = copy_of(cu_in, n + 1);
    check_offsets(call, cu.data(), n, total);
    for (std::size_t i = 0; i < n; ++i)
        in_batch(call, i, seqs[i], [&] {
            return validate_positions(seqs[i], get(seqs[i]), positions + cu[i], static_cast<std::size_t>(cu[i + 1] - cu[i]));
        });
    (void)check_tokens(call, tokens, total);
}

RoundPlan Stager::check_draft(std::int64_t seq, const Seq& s, std::int64_t n_past) const {
    require_count("n_past", n_past);
    RoundPlan p = plan_round(seq, s, n_past);
    if (p.mismatch && opt_.strict)
        throw StateError(seq_msg(seq) + ": draft(n_past=" + std::to_string(n_past) +
                         ") does not match the buffered rows (newest " + std::to_string(s.end - 1) +
                         "): " + mismatch_cause(n_past, s.end) + " (strict=True; nothing changed)");
    return p;
}

void Stager::check_accept(std::int64_t n_accepted) const {
    if (n_accepted < 0 || n_accepted > opt_.block_size)
        throw std::invalid_argument("n_accepted must be in [0, " + std::to_string(opt_.block_size) + "], got " +
                                    std::to_string(n_accepted));
}

void Stager::check_shift(const Seq& s, std::int64_t n_keep, std::int64_t n_discard) const {
    require_count("n_keep", n_keep);
    require_count("n_discard", n_discard);
    if (s.started && n_discard != 0 && n_keep + n_discard > s.end)
        throw std::invalid_argument("shift of [" + std::to_string(n_keep) + ", " + std::to_string(n_keep + n_discard) +
                                    ") reaches past the end of the sequence (" + std::to_string(s.end) + ")");
}

// -- the horizon ---------------------------------------------------------------
// See reference/stager.py: with f the smallest end an accept can leave, the last W
// positions before f stay stageable. Every later round needs less than that
// (a rebase needs rows >= start - K, a plain round rows >= n_cache >=
// pos_base > f + B - W), and keeping W instead of K rows is what lets a
// rollback of up to W - K positions still restage a full K-row context.
// Live rows stay <= W + B, so held rows stay under W + TRIM_CHUNK + B + 1.

std::int64_t Stager::firm_end(const SeqFields& s) const noexcept {
    return (s.accept_open && s.tentative > 0) ? s.end - s.tentative + 1 : s.end;
}

std::int64_t Stager::horizon_after(const SeqFields& s) const noexcept {
    return std::max(s.horizon, firm_end(s) - opt_.window);
}

void Stager::note_size(Seq& s) noexcept {
    s.stats.rows = static_cast<std::int64_t>(s.buf.size());
    s.stats.bytes = static_cast<std::int64_t>(s.buf.bytes_touched());
    s.stats.reserved_bytes = static_cast<std::int64_t>(s.buf.bytes_reserved());
    s.stats.peak_rows = std::max(s.stats.peak_rows, s.stats.rows);
    s.stats.peak_bytes = std::max(s.stats.peak_bytes, s.stats.bytes);
}

void Stager::advance_horizon(Seq& s) noexcept {
    if (s.started) s.horizon = horizon_after(s);
    // Lazy trim: dead head rows go once a chunk of them has piled up. With the
    // ring this is O(1); the chunking bounds memory at W + TRIM_CHUNK + B + 1.
    if (s.started && s.horizon - s.buf.head() >= TRIM_CHUNK) trim_head(s, s.horizon);
    note_size(s);
}

void Stager::trim_head(Seq& s, std::int64_t new_head) noexcept {
    const std::int64_t before = s.buf.head();
    s.buf.drop_front(new_head);
    const std::int64_t k = s.buf.head() - before;
    if (k > 0) {
        s.stats.trims += 1;
        s.stats.trimmed_rows += k;
    }
}

// -- rounds -------------------------------------------------------------------

// Plans a round without changing anything (may throw only on a broken invariant).
RoundPlan Stager::plan_round(std::int64_t seq_id, const Seq& s, std::int64_t start) const {
    RoundPlan p;
    p.seq = seq_id;
    p.start = start;
    p.end = s.end;
    // Out of protocol (docs/protocol.md section 3): a sequence with rows, not
    // disabled (its server may stop feeding it), drafted at an n_past that is
    // not its buffered end. Whatever the skip (missing_rows, or no_context for
    // an n_past lagging behind rows already cached); never an opened round.
    p.mismatch = s.started && !s.disabled && start != s.end;
    p.report_mismatch = p.mismatch && !s.mismatch_reported;
    if (s.disabled) p.skip = Skip::Disabled;
    else if (s.drafting_off) p.skip = Skip::DraftingOff;
    else if (!s.started) p.skip = Skip::Empty;
    else if (start <= s.n_cache) p.skip = Skip::NoContext;
    else if (s.end != start) p.skip = Skip::MissingRows;
    if (p.skip != Skip::None) return p;
    const bool rebase = s.restage_owed || start - s.pos_base + opt_.block_size > opt_.window;
    std::int64_t base, lo;
    if (rebase) {
        const std::int64_t keep = std::min(start - s.horizon, w_keep_);
        base = lo = start - keep;
    } else {
        base = s.pos_base;
        lo = s.n_cache;
    }
    // Structurally guaranteed by the horizon rule; checked because a wrong
    // answer here would stage garbage into the drafter.
    if (lo < s.buf.head() || lo < s.horizon || start > s.buf.end())
        throw std::logic_error("dspark internal error: staged rows are not buffered");
    p.rebase = rebase;
    p.clear_cache = rebase || s.first_round;
    p.pos_base = base;
    p.first_row = lo;
    p.n_rows = start - lo;
    p.crop_from = start - base;
    s.buf.runs(lo, start, slot_base(seq_id), p.slot_runs);
    return p;
}

// Copies a planned round's rows to out[at..] (none for a null `out`: external
// rows, or a draft_view) and opens the round, naming it (p.round). Cannot
// throw: `out` already holds the room.
void Stager::open_round(Seq& s, RoundPlan& p, std::uint8_t* out) noexcept {
    s.verify_owed = false;  // a draft, skipped or not: the last round's verify is over
    if (p.skip != Skip::None) {
        // A skip changes no protocol state and opens no round.
        s.stats.skips += 1;
        switch (p.skip) {
            case Skip::Disabled: s.stats.skips_disabled += 1; break;
            case Skip::Empty: s.stats.skips_empty += 1; break;
            case Skip::NoContext: s.stats.skips_no_context += 1; break;
            case Skip::MissingRows: s.stats.skips_missing_rows += 1; break;
            case Skip::DraftingOff: s.stats.skips_drafting_off += 1; break;
            case Skip::None: break;
        }
        if (p.report_mismatch) s.mismatch_reported = true;
        return;
    }
    if (out) s.buf.copy_out(p.first_row, p.start, out);
    s.open = true;
    s.round = p.round = rounds_.fetch_add(1, std::memory_order_relaxed) + 1;
    s.open_start = p.start;
    s.open_base = p.pos_base;
    s.accept_open = true;
    s.tentative = 0;
    s.stats.rounds += 1;
    s.stats.staged_rows += p.n_rows;
    if (p.rebase) {
        s.stats.rebases += 1;
        s.stats.restaged_rows += p.n_rows;
    }
}

RoundPlan Stager::draft(std::int64_t seq, std::int64_t n_past, ByteVec& rows_out) {
    return draft_into(seq, n_past, [&](const RoundPlan* p, std::size_t k) { return grow_rows(rows_out, p, k); });
}

void Stager::draft_many(const std::int64_t* seqs, const std::int64_t* n_pasts, std::size_t n,
                        std::vector<RoundPlan>& plans, ByteVec& rows_out) {
    draft_many_into(seqs, n_pasts, n, plans,
                    [&](const RoundPlan* p, std::size_t k) { return grow_rows(rows_out, p, k); });
}

// Room for the rows of plans[0..n) at the end of `rows_out` (from the pool:
// the only step that can fail, with bad_alloc).
std::uint8_t* Stager::grow_rows(ByteVec& rows_out, const RoundPlan* plans, std::size_t n) const {
    std::size_t bytes = 0;
    for (std::size_t i = 0; i < n; ++i) bytes += static_cast<std::size_t>(plans[i].n_rows) * row_bytes_;
    const std::size_t at = rows_out.size();
    pool_->grow(rows_out, at + bytes);
    rows_out.resize(at + bytes);
    return rows_out.data() + at;
}

RoundPlan Stager::peek(std::int64_t seq, std::int64_t n_past) const {
    auto lock = lock_seq(seq);
    return check_draft(seq, ready(seq), n_past);
}

RoundPlan Stager::draft_into(std::int64_t seq, std::int64_t n_past, const RowSink& sink) {
    auto lock = lock_seq(seq);
    const Seq& s = ready(seq);
    RoundPlan p = check_draft(seq, s, n_past);
    // External-row mode stages no bytes: the sink is not asked for room.
    std::uint8_t* out = external() ? nullptr : sink(&p, 1);  // may throw: nothing has changed yet
    open_round(mut(s), p, out);
    return p;
}

RoundPlan Stager::draft_view(std::int64_t seq, std::int64_t n_past, RowView& view) {
    auto lock = lock_seq(seq);
    const Seq& s = ready(seq);
    require_mode(RowMode::Held, "draft_view", "the rows stay with their owner: read them at the plan's slots");
    RoundPlan p = check_draft(seq, s, n_past);
    RowView v = p.skip == Skip::None ? view_of(s, p) : RowView{};
    open_round(mut(s), p, nullptr);
    view = std::move(v);
    return p;
}

RowView Stager::view_of(const Seq& s, const RoundPlan& p) const {
    RowView v;
    std::size_t k = 0;
    s.buf.for_each_run(p.first_row, p.start, [&](const std::uint8_t* run, std::size_t bytes) {
        v.data[k] = run;
        v.rows[k++] = bytes / row_bytes_;
    });
    v.keep = s.buf.storage();
    return v;
}

std::vector<RoundPlan> Stager::plan_batch(const char* call, const BatchLock& lock, const std::int64_t* seqs,
                                          const std::int64_t* n_pasts, std::size_t n, bool views) const {
    // Each check runs over the whole batch before the next (design.md 2.1).
    check_states(call, seqs, n, Need::Ready);
    check_unique(call, lock, seqs, n);
    if (views) require_mode(RowMode::Held, call, "the rows stay with their owner: read them at the plans' slots");
    for (std::size_t i = 0; i < n; ++i) in_batch(call, i, seqs[i], [&] { require_count("n_past", n_pasts[i]); });
    std::vector<RoundPlan> planned;
    planned.reserve(n);
    for (std::size_t i = 0; i < n; ++i)
        planned.push_back(in_batch(call, i, seqs[i], [&] { return check_draft(seqs[i], get(seqs[i]), n_pasts[i]); }));
    return planned;
}

void Stager::draft_many_into(const std::int64_t* seqs_in, const std::int64_t* n_pasts_in, std::size_t n,
                             std::vector<RoundPlan>& plans, const RowSink& sink) {
    const char* call = "draft_many";
    const std::vector<std::int64_t> seqs = copy_of(seqs_in, n), n_pasts = copy_of(n_pasts_in, n);
    // Validate and plan everything, then take the room once, then open: a
    // rejected batch (bad argument, state, strict mismatch, or no room)
    // changes nothing.
    check_ids(call, seqs.data(), n);
    BatchLock lock(*this, seqs.data(), n);
    std::vector<RoundPlan> planned = plan_batch(call, lock, seqs.data(), n_pasts.data(), n, false);
    std::uint8_t* out = external() ? nullptr : sink(planned.data(), n);
    for (RoundPlan& p : planned) {
        open_round(mut(get(p.seq)), p, out);
        if (out) out += static_cast<std::size_t>(p.n_rows) * row_bytes_;
    }
    plans.swap(planned);
}

void Stager::draft_many_view(const std::int64_t* seqs_in, const std::int64_t* n_pasts_in, std::size_t n,
                             std::vector<RoundPlan>& plans, std::vector<RowView>& views, const char* call) {
    const std::vector<std::int64_t> seqs = copy_of(seqs_in, n), n_pasts = copy_of(n_pasts_in, n);
    check_ids(call, seqs.data(), n);
    BatchLock lock(*this, seqs.data(), n);
    std::vector<RoundPlan> planned = plan_batch(call, lock, seqs.data(), n_pasts.data(), n, true);
    std::vector<RowView> viewed(n);  // the only allocation: before anything changes
    for (std::size_t i = 0; i < n; ++i) {
        const Seq& s = get(seqs[i]);
        if (planned[i].skip == Skip::None) viewed[i] = view_of(s, planned[i]);
        open_round(mut(s), planned[i], nullptr);
    }
    plans.swap(planned);
    views.swap(viewed);
}

// commit and fail on a sequence whose open round was checked.
void Stager::commit_seq(Seq& s) noexcept {
    s.open = false;
    s.n_cache = s.open_start;
    s.pos_base = s.open_base;
    s.restage_owed = false;
    s.first_round = false;
    s.failures = 0;
    s.verify_owed = true;
    s.stats.commits += 1;
    advance_horizon(s);
}

std::int64_t Stager::fail_seq(Seq& s) noexcept {
    // The drafter cache is unknown now: restage cleanly from the retained rows,
    // which are kept (dropping them would leave nothing to restage: a soft skip forever).
    s.open = false;
    s.restage_owed = true;
    s.first_round = false;
    s.failures += 1;
    s.stats.failures += 1;
    std::int64_t disabled_after = 0;
    if (s.failures >= opt_.max_failures && !s.disabled) {
        s.disabled = true;
        disabled_after = s.failures;
    }
    advance_horizon(s);
    return disabled_after;
}

void Stager::accept_seq(Seq& s, std::int64_t n_accepted) noexcept {
    if (!s.accept_open || s.tentative == 0) return;
    // Only rows appended since the last draft can go: never the retained head.
    keep_tentative(s, std::min(s.tentative, n_accepted + 1));
}

void Stager::keep_tentative(Seq& s, std::int64_t keep) noexcept {
    if (s.verify_owed) {  // the committed round's verify: the drafts it keeps (<= B)
        accepted_row(s)[keep - 1] += 1;
        s.verify_owed = false;
    }
    const std::int64_t new_end = s.end - s.tentative + keep;
    s.buf.drop_back(new_end);
    s.end = new_end;
    s.tentative = 0;
    // An accept acts on the round just drafted, once: rows that arrive after
    // it (plain decodes after a skip or a failure) are final, and a later
    // accept is harmless (protocol.md 2.3).
    s.accept_open = false;
    advance_horizon(s);
}

void Stager::commit(std::int64_t seq) {
    auto lock = lock_seq(seq);
    commit_seq(mut(opened(seq)));
}

std::int64_t Stager::fail(std::int64_t seq, FailStage stage) {
    auto lock = lock_seq(seq);
    Seq& s = mut(opened(seq));
    (void)enum_from_code<std::invalid_argument>("stage", static_cast<std::int64_t>(stage), FAIL_STAGE_COUNT,
                                                fail_stage_name);
    return fail_seq(s);
}

void Stager::accept(std::int64_t seq, std::int64_t n_accepted) {
    auto lock = lock_seq(seq);
    Seq& s = mut(ready(seq));
    check_accept(n_accepted);
    accept_seq(s, n_accepted);
}

void Stager::commit_many(const std::int64_t* seqs_in, std::size_t n) {
    const char* call = "commit_many";
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Open);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    for (std::int64_t q : seqs) commit_seq(mut(get(q)));
}

void Stager::fail_many(const std::int64_t* seqs_in, const FailStage* stages_in, std::size_t n,
                       std::int64_t* disabled_after) {
    const char* call = "fail_many";
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Open);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    std::vector<FailStage> stages(stages_in, stages_in + n);
    for (std::size_t i = 0; i < n; ++i)
        in_batch(call, i, seqs[i], [&] {
            (void)enum_from_code<std::invalid_argument>("stage", static_cast<std::int64_t>(stages[i]),
                                                        FAIL_STAGE_COUNT, fail_stage_name);
        });
    for (std::size_t i = 0; i < n; ++i) {
        const std::int64_t d = fail_seq(mut(get(seqs[i])));
        if (disabled_after) disabled_after[i] = d;
    }
}

void Stager::accept_many(const std::int64_t* seqs_in, const std::int64_t* n_accepted_in, std::size_t n) {
    const char* call = "accept_many";
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Ready);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    const std::vector<std::int64_t> n_accepted = copy_of(n_accepted_in, n);
    for (std::size_t i = 0; i < n; ++i) in_batch(call, i, seqs[i], [&] { check_accept(n_accepted[i]); });
    for (std::size_t i = 0; i < n; ++i) accept_seq(mut(get(seqs[i])), n_accepted[i]);
}

// -- lifecycle ----------------------------------------------------------------

void Stager::begin(std::int64_t seq) {
    auto lock = lock_seq(seq);
    fresh_seq(mut(ready(seq)));
}

FeatureBuffer Stager::end_seq(Seq& s) const {
    FeatureBuffer ring = std::move(s.buf);  // leaves s.buf empty (capacity 0), with its row size
    fresh_seq(s);
    return ring;
}

void Stager::end(std::int64_t seq) {
    FeatureBuffer ring;  // freed after the lock is released
    auto lock = lock_seq(seq);
    Seq& s = mut(get(seq));
    if (s.on_device) leave_step(seq, s);  // end takes any state, a handed-over one too
    ring = end_seq(s);
}

void Stager::end_many(const std::int64_t* seqs_in, std::size_t n) {
    const char* call = "end_many";
    const std::vector<std::int64_t> seqs = copy_of(seqs_in, n);
    std::vector<FeatureBuffer> rings;  // freed after the locks are released
    check_ids(call, seqs.data(), n);
    rings.reserve(n);
    BatchLock lock(*this, seqs.data(), n);
    check_unique(call, lock, seqs.data(), n);
    for (std::int64_t q : seqs) {  // end takes any state, a handed-over one too
        Seq& s = mut(get(q));
        if (s.on_device) leave_step(q, s);
        rings.push_back(end_seq(s));
    }
}

void Stager::set_drafting(const char* call, const std::int64_t* seqs_in, std::size_t n, bool off) {
    const std::vector<std::int64_t> seqs = copy_of(seqs_in, n);
    check_ids(call, seqs.data(), n);
    BatchLock lock(*this, seqs.data(), n);  // a repeated id sets the same switch twice: allowed
    for (std::int64_t q : seqs) switch_drafting(q, mut(get(q)), off);
}

// Any state, a handed-over one too: its switch is then its step state's
// drafting_off column (the CPU twin's truth; a GPU server writes the same
// column of its device copy, cuda.DeviceStep.set_drafting), which to_host
// brings back.
void Stager::switch_drafting(std::int64_t seq, Seq& s, bool off) noexcept {
    s.drafting_off = off;
    if (s.on_device) step_state_.get()[device_step::F_drafting_off * opt_.max_seqs + seq] = off ? 1 : 0;
}

void Stager::disable(std::int64_t seq) {
    auto lock = lock_seq(seq);
    switch_drafting(seq, mut(get(seq)), true);
}

void Stager::enable(std::int64_t seq) {
    auto lock = lock_seq(seq);
    switch_drafting(seq, mut(get(seq)), false);
}

void Stager::disable_many(const std::int64_t* seqs, std::size_t n) { set_drafting("disable_many", seqs, n, true); }

void Stager::enable_many(const std::int64_t* seqs, std::size_t n) { set_drafting("enable_many", seqs, n, false); }

void Stager::rollback(std::int64_t seq, std::int64_t n_past) {
    auto lock = lock_seq(seq);
    Seq& s = mut(ready(seq));
    require_count("n_past", n_past);
    if (!s.started || n_past >= s.end) return;
    s.buf.drop_back(n_past);
    if (s.buf.size() == 0) s.buf.reset(n_past);
    s.end = n_past;
    s.horizon = std::min(s.horizon, n_past);
    if (s.n_cache > n_past) {
        s.n_cache = n_past;
        s.restage_owed = true;
    }
    s.pos_base = std::min(s.pos_base, s.n_cache);
    if (s.horizon > s.n_cache) s.restage_owed = true;  // rows pending since the cache end are gone
    s.accept_open = false;
    s.tentative = 0;
    advance_horizon(s);
}

std::vector<SlotMove> Stager::shift(std::int64_t seq, std::int64_t n_keep, std::int64_t n_discard,
                                    std::uint64_t* serial) {
    auto lock = lock_seq(seq);
    Seq& s = mut(ready(seq));
    check_shift(s, n_keep, n_discard);
    if (serial) *serial = 0;
    std::vector<SlotMove> moves;
    if (!s.started || n_discard == 0) return moves;
    const std::int64_t hi = n_keep + n_discard;
    auto moved = [&](std::int64_t x) { return x < n_keep ? x : (x < hi ? n_keep : x - n_discard); };
    // Keep the live rows [horizon, end) without the discarded range, in place:
    // the rows before it stay in their slots, the rows after it move down to
    // follow them (no copy at all when either side is empty, the usual case:
    // the window lies past n_keep). Dead head rows below the horizon go too.
    const std::int64_t from = std::max(s.horizon, s.buf.head());
    s.buf.compact(from, n_keep, hi, moved(s.horizon), slot_base(seq), moves);  // allocates first
    s.end = moved(s.end);
    s.horizon = moved(s.horizon);
    s.n_cache = moved(s.n_cache);
    s.pos_base = moved(s.pos_base);
    s.restage_owed = true;
    s.accept_open = false;
    s.tentative = 0;
    advance_horizon(s);
    if (!moves.empty()) {
        const std::uint64_t k = next_serial("shift", seq);  // under the sequence's lock
        if (serial) *serial = k;
    }
    return moves;
}

std::vector<SlotMove> Stager::fork(std::int64_t src, std::int64_t dst, std::uint64_t* serial) {
    auto locks = lock_pair(src, dst);  // both ids checked first, in the order of the call
    const Seq& a = ready(src);
    Seq& b = mut(ready(dst));
    if (src == dst) throw std::invalid_argument("fork needs two different sequences, got " + std::to_string(src) + " twice");
    if (serial) *serial = 0;
    Seq c;
    c.started = a.started;
    c.end = a.end;
    c.horizon = a.horizon;
    c.n_cache = a.n_cache;
    c.pos_base = a.pos_base;
    c.restage_owed = a.started;  // the child's drafter cache is empty
    c.first_round = a.first_round;
    c.disabled = a.disabled;
    c.drafting_off = a.drafting_off;
    c.failures = a.failures;
    c.accept_open = a.accept_open;
    c.tentative = a.tentative;
    c.mismatch_reported = b.mismatch_reported;  // the slot's report, until its begin()
    const std::int64_t from = a.started ? std::max(a.horizon, a.buf.head()) : 0;
    const std::size_t k = a.started ? static_cast<std::size_t>(a.end - from) : 0;
    // The copies: the parent's rows (at most two runs) to the child's first slots.
    std::vector<SlotMove> moves;
    SlotRun parent[2];
    a.buf.runs(from, from + static_cast<std::int64_t>(k), slot_base(src), parent);
    moves.reserve(2);
    c.buf = ring_for(b.buf, from, k);  // the child's old rows are being replaced
    if (k) {
        FeatureBuffer::Span x, y;
        c.buf.back_spans(k, x, y);  // an emptied ring starts at slot 0: one span
        a.buf.copy_out(from, a.end, x.data);
        c.buf.commit_back(k);
        if (c.buf.with_tokens()) {  // the ids go with the rows
            std::vector<std::int32_t> ids(k);
            a.buf.copy_tokens_out(from, a.end, ids.data());
            c.buf.set_tokens(from, ids.data(), k);
        }
        std::int64_t to = slot_base(dst) + static_cast<std::int64_t>(x.slot);
        for (const SlotRun& r : parent)
            if (r.count) {
                moves.push_back({r.first, to, r.count});
                to += r.count;
            }
    }
    retire_stats(b);  // the child's counters start afresh
    b = std::move(c);
    advance_horizon(b);
    if (!moves.empty()) {
        const std::uint64_t k2 = next_serial("fork", dst, src);  // under the lock of both sequences
        if (serial) *serial = k2;
    }
    return moves;
}

// A ring for n rows from position pos: `reuse` itself (emptied) when it has
// room, else a new one. Allocates, and so may throw, before touching `reuse`.
FeatureBuffer Stager::ring_for(FeatureBuffer& reuse, std::int64_t pos, std::size_t n) const {
    if (reuse.capacity() == 0 || reuse.capacity() < n) {
        FeatureBuffer fresh = new_ring();
        fresh.reserve_back(n, ring_rows_);
        fresh.reset(pos);
        return fresh;
    }
    FeatureBuffer ring = std::move(reuse);
    ring.reset(pos);
    return ring;
}

// Appends n contiguous rows (room must exist: ring_for / a reserved ring).
void Stager::append_rows(FeatureBuffer& ring, const std::uint8_t* rows, std::size_t n, std::uint32_t* crc) const {
    if (n == 0) return;
    ring.reserve_back(n, ring_rows_);
    FeatureBuffer::Span x, y;
    ring.back_spans(n, x, y);
    const std::uint8_t* second = rows + x.rows * row_bytes_;
    if (crc != nullptr) {
        *crc = crc32c_copy(*crc, x.data, rows, x.rows * row_bytes_);
        if (y.rows) *crc = crc32c_copy(*crc, y.data, second, y.rows * row_bytes_);
    } else {
        detail::copy_bytes(x.data, rows, x.rows * row_bytes_);
        if (y.rows) detail::copy_bytes(y.data, second, y.rows * row_bytes_);
    }
    ring.commit_back(n);
}


// -- introspection ---------------------------------------------------------------

SeqState Stager::state(std::int64_t seq) const {
    auto lock = lock_seq(seq);
    const Seq& s = get(seq);
    refuse_on_device(seq, s);
    SeqState o;
    o.started = s.started;
    o.end = s.end;
    o.horizon = s.horizon;
    o.n_cache = s.n_cache;
    o.pos_base = s.pos_base;
    o.n_retained = s.started ? std::max<std::int64_t>(0, s.n_cache - s.horizon) : 0;
    o.n_pending = s.started ? s.end - std::max(s.n_cache, s.horizon) : 0;
    o.open_round = s.open;
    o.consecutive_failures = s.failures;
    o.disabled = s.disabled;
    o.restage_owed = s.restage_owed;
    o.first_round = s.first_round;
    o.tentative_rows = s.accept_open ? s.tentative : 0;
    o.reservation_open = s.reserved;
    o.drafting_off = s.drafting_off;
    o.tree_nodes = static_cast<std::int64_t>(s.tree.size());
    return o;
}

std::uint64_t Stager::open_round_id(std::int64_t seq) const {
    auto lock = lock_seq(seq);
    const Seq& s = get(seq);
    refuse_on_device(seq, s);
    return s.open ? s.round : 0;
}

void Stager::open_round_ids(const std::int64_t* seqs_in, std::size_t n, std::uint64_t* out) const {
    const char* call = "open_round_ids";
    const std::vector<std::int64_t> seqs = copy_of(seqs_in, n);
    check_ids(call, seqs.data(), n);
    BatchLock lock(*this, seqs.data(), n);  // a question: a repeated id is answered twice
    for (std::size_t i = 0; i < n; ++i) {
        const Seq& s = get(seqs[i]);
        in_batch(call, i, seqs[i], [&] { refuse_on_device(seqs[i], s); });
        out[i] = s.open ? s.round : 0;
    }
}

std::uint64_t Stager::changes_of(const std::int64_t* seqs, std::size_t n) const {
    check_ids("changes_of", seqs, n);
    std::uint64_t newest = 0;
    for (std::size_t i = 0; i < n; ++i)
        newest = std::max(newest, changed_[static_cast<std::size_t>(seqs[i])].load(std::memory_order_acquire));
    return newest;
}

void Stager::live_slots(std::int64_t seq, SlotRun out[2]) const {
    auto lock = lock_seq(seq);
    const Seq& s = get(seq);
    refuse_on_device(seq, s);
    out[0] = out[1] = SlotRun{};
    if (s.started) s.buf.runs(s.horizon, s.end, slot_base(seq), out);
}

// The metrics of a handed-over sequence are its step state's (live: they
// never stall or go back while the device steps it).
SeqStats Stager::stats(std::int64_t seq) const {
    auto lock = lock_seq(seq);
    return stats_of(get(seq));
}

// The sequence's histogram into out (block_size + 1 counts).
void Stager::histogram_of(const Seq& s, std::int64_t* out) const {
    if (s.on_device) {
        (void)stats_on_device(s, false, out);
        return;
    }
    const std::int64_t* row = accepted_row(s);
    std::copy(row, row + opt_.block_size + 1, out);
}

std::vector<std::int64_t> Stager::accepted(std::int64_t seq) const {
    auto lock = lock_seq(seq);
    std::vector<std::int64_t> out(static_cast<std::size_t>(opt_.block_size) + 1);
    histogram_of(get(seq), out.data());
    return out;
}

void Stager::accepted_many(const std::int64_t* seqs_in, std::size_t n, std::int64_t* out) const {
    const char* call = "accepted_many";
    const std::vector<std::int64_t> seqs = copy_of(seqs_in, n);
    check_ids(call, seqs.data(), n);
    BatchLock lock(*this, seqs.data(), n);  // a question: a repeated id is answered twice
    const auto buckets = static_cast<std::size_t>(opt_.block_size) + 1;
    for (std::size_t i = 0; i < n; ++i) histogram_of(get(seqs[i]), out + i * buckets);
}

StagerTotals Stager::totals() const {
    StagerTotals t;
    // Every sequence locked (in id order, the lock order) and then retired_:
    // no sequence retires while its counters are read, so the sum is one
    // moment's and never goes back.
    std::vector<std::unique_lock<std::mutex>> locks;
    locks.reserve(seqs_.size());
    for (std::size_t i = 0; i < seqs_.size(); ++i) locks.emplace_back(locks_[i].m);
    std::lock_guard<std::mutex> lock(retired_.m);
    t.stats = retired_.stats;
    t.accepted = retired_.accepted;
    std::vector<std::int64_t> row(t.accepted.size());
    for (const Seq& s : seqs_) {
        add_stats(t.stats, stats_of(s, true));
        histogram_of(s, row.data());
        for (std::size_t k = 0; k < t.accepted.size(); ++k) t.accepted[k] += row[k];
        if ((s.reserved ? s.before : s).started) t.started += 1;
    }
    return t;
}

}  // namespace dspark
