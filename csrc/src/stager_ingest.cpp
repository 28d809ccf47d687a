// The Stager's ingest (dspark/stager.hpp): rows into the rings, checked and
// converted before anything changes (process, process_many, the external-row
// forms), and reservations (reserve, confirm, cancel).
#include "dspark/stager.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "dspark/errors.hpp"
#include "row_format_kernels.hpp"
#include "stager_batch.hpp"

namespace dspark {

using detail::copy_of;
using detail::in_batch;
using detail::seq_msg;

// -- ingest -------------------------------------------------------------------

// One sequence's rows between their checks and their commit (prepare_append
// -> commit_append): where they go, and the state after them.
struct Stager::Append {
    std::int64_t p0 = 0;
    std::size_t n = 0;
    std::size_t skip = 0;  // leading input rows below the new horizon: never stored
    std::size_t keep = 0;
    // The rows fit in free slots beside every row held now: they were
    // converted there already (spans a, b), and committing only counts them.
    bool clean = false;
    std::int64_t end = 0, horizon = 0, tentative = 0;
    bool accept_open = false;
    FeatureBuffer::Span a, b;
    // The ring's bookkeeping before the rows were converted into its free
    // slots (its first allocation kept): a rejection puts it back, so that
    // not even the resident-bytes count (stats().bytes) moves.
    bool marked = false;
    FeatureBuffer::Marks before;
    // The rows' token ids (a chain drafter's Stager), n of them: the kept
    // rows' go beside them at commit.
    const std::int32_t* tokens = nullptr;
};

namespace {

// process(): rows of a float type, encoded into the storage. The call
// operator is the `encode` of prepare_append (converts input rows
// [first, first + count) into dst, or only checks them when dst is null;
// returns the flat index, from row `first`, of the first value that cannot
// be staged, or -1); value(i) is input element i (flat from row 0) as f32.
struct FloatRows {
    const std::uint8_t* src;
    ElemType type;
    std::size_t dim, in_row;
    Storage storage;
    NonFinite policy;
    EncodeBounds bounds;
    std::int64_t operator()(std::size_t first, std::size_t count, std::uint8_t* dst) const {
        const std::uint8_t* from = src + first * in_row;
        return dst ? encode_rows(from, type, dst, storage, count, dim, policy, bounds)
                   : find_unencodable(from, type, count * dim, bounds.limit);
    }
    float value(std::int64_t flat) const { return element_value(src, type, static_cast<std::size_t>(flat)); }
};

// process_external(): no bytes to convert or check (the owner writes them).
struct NoRows {
    std::int64_t operator()(std::size_t, std::size_t, std::uint8_t*) const { return -1; }
    float value(std::int64_t) const { return 0.0f; }  // never asked: nothing is checked
};

}  // namespace

// Checks a sequence's n rows from position p0 (their positions checked
// already) and, in the common case (every round) where they fit in free
// slots beside every row held now, converts them straight into those slots
// (check fused into the conversion): a rejection then leaves every row as it
// was. Otherwise (a prefill chunk longer than the window) only checks the
// whole input; commit_append drops the dead rows and converts after that.
// Changes nothing observable; may throw (the rows' contents, or the ring's
// first allocation: address space only).
template <class Encode, class Value>
Stager::Append Stager::prepare_append(std::int64_t seq_id, Seq& s, std::int64_t p0, std::size_t n, Encode&& encode,
                                      Value&& value, bool fallible) {
    Append g;
    g.p0 = p0;
    g.n = n;
    if (n == 0) return g;
    const auto dim = static_cast<std::int64_t>(opt_.feature_dim);
    auto reject = [&](std::int64_t flat) {
        throw std::invalid_argument(unstageable_message(seq_id, p0, flat, value(flat)));
    };
    // The state after a successful append, to know which input rows survive.
    SeqFields after;
    after.started = true;
    after.end = p0 + static_cast<std::int64_t>(n);
    after.horizon = s.started ? s.horizon : p0;
    after.accept_open = s.accept_open;
    after.tentative = s.tentative;
    if (after.accept_open) {
        after.tentative += static_cast<std::int64_t>(n);
        if (after.tentative > opt_.block_size + 1) after.accept_open = false, after.tentative = 0;
    }
    g.end = after.end;
    g.accept_open = after.accept_open;
    g.tentative = after.tentative;
    g.horizon = horizon_after(after);
    // Input rows below the new horizon are never stored (bounded ingest).
    g.skip = static_cast<std::size_t>(std::clamp<std::int64_t>(g.horizon - p0, 0, std::int64_t(n)));
    g.keep = n - g.skip;
    // The ring reserves its whole bound up front (address space only): the
    // one step that can fail here for a reason other than the rows.
    if (s.buf.capacity() == 0) s.buf.reserve_back(g.keep, ring_rows_);
    g.marked = true;
    g.before = s.buf.marks();
    g.clean = g.skip == 0 && s.buf.size() + g.keep <= s.buf.capacity();
    if (!g.clean) {
        if (fallible) {
            const std::int64_t bad = encode(0, n, nullptr);
            if (bad >= 0) reject(bad);
        }
        return g;
    }
    if (!s.started || s.buf.size() == 0) s.buf.reset(p0);
    s.buf.back_spans(g.keep, g.a, g.b);
    std::int64_t bad = encode(0, g.a.rows, g.a.data);
    if (g.b.rows) {
        const std::int64_t bad2 = encode(g.a.rows, g.b.rows, g.b.data);
        if (bad < 0 && bad2 >= 0) bad = static_cast<std::int64_t>(g.a.rows) * dim + bad2;
    }
    // Only free slots were written: rejecting here leaves every row as it was.
    if (fallible && bad >= 0) {
        s.buf.set_marks(g.before);
        reject(bad);
    }
    return g;
}

// Makes a prepared append the sequence's rows (nothing here can fail but a
// broken invariant: the horizon rule keeps every append inside the ring).
// slots_out (external mode): the global slot of every input row, -1 for the
// rows below the new horizon that are never stored.
template <class Encode>
void Stager::commit_append(std::int64_t seq_id, Seq& s, Append& g, Encode&& encode, std::int64_t* slots_out) {
    if (g.n == 0) return;
    if (!g.clean) {
        // Checked already: dead rows can go before converting.
        if (s.started) trim_head(s, std::min(g.horizon, s.end));
        if (!s.started || s.buf.size() == 0) s.buf.reset(g.p0 + static_cast<std::int64_t>(g.skip));
        if (g.keep) {
            s.buf.reserve_back(g.keep, ring_rows_);  // no-op unless the ring must grow past its bound
            s.buf.back_spans(g.keep, g.a, g.b);
            (void)encode(g.skip, g.a.rows, g.a.data);
            if (g.b.rows) (void)encode(g.skip + g.a.rows, g.b.rows, g.b.data);
        }
    }
    if (g.keep) s.buf.commit_back(g.keep);
    if (g.keep && g.tokens) s.buf.set_tokens(g.p0 + static_cast<std::int64_t>(g.skip), g.tokens + g.skip, g.keep);
    if (slots_out) {
        const std::int64_t base = slot_base(seq_id);
        for (std::size_t i = 0; i < g.skip; ++i) slots_out[i] = -1;
        std::int64_t* out = slots_out + g.skip;
        if (g.keep) {
            for (std::size_t i = 0; i < g.a.rows; ++i) *out++ = base + static_cast<std::int64_t>(g.a.slot + i);
            for (std::size_t i = 0; i < g.b.rows; ++i) *out++ = base + static_cast<std::int64_t>(g.b.slot + i);
        }
    }
    // Publish the new state.
    if (!s.started) {
        s.started = true;
        s.horizon = s.n_cache = s.pos_base = g.p0;
    }
    s.end = g.end;
    s.accept_open = g.accept_open;
    s.tentative = g.tentative;
    s.horizon = g.horizon;
    advance_horizon(s);
}

const std::uint8_t* Stager::unaliased_input(const void* rows, std::size_t nbytes, const std::int64_t* seqs,
                                            std::size_t n, std::vector<std::uint8_t>& copy) const {
    const auto* src = static_cast<const std::uint8_t*>(rows);
    for (std::size_t i = 0; i < n; ++i)
        if (get(seqs[i]).buf.overlaps(src, nbytes)) {
            copy.assign(src, src + nbytes);
            return copy.data();
        }
    return src;
}

void Stager::process(std::int64_t seq, const std::int64_t* positions, std::size_t n, const void* rows, ElemType type,
                     const std::int32_t* tokens) {
    auto lock = lock_seq(seq);
    Seq& s = mut(ready(seq));
    require_mode(RowMode::Held, "process");
    const std::int64_t p0 = validate_positions(seq, s, positions, n);
    const TokenIds ids = check_tokens(nullptr, tokens, n);
    append_held(seq, s, p0, n, rows, type, ids.data());
}

Stager::TokenIds Stager::check_tokens(const char* call, const std::int32_t* tokens, std::size_t n) const {
    const std::string in = call ? std::string(call) + ": " : std::string();
    TokenIds out;
    if (opt_.kind != DrafterKind::Chain) {
        if (tokens)
            throw std::invalid_argument(in + "tokens are kept for a chain drafter (kind=\"chain\") only; this "
                                             "Stager's drafter kind is \"" + drafter_kind_name(opt_.kind) + "\"");
        return out;
    }
    if (!tokens) {
        if (n)
            throw std::invalid_argument(in + "a chain drafter's Stager (kind=\"chain\") needs the token id of every "
                                             "row (tokens: the token the target read at each row's position)");
        return out;
    }
    out.ids.assign(tokens, tokens + n);
    out.given = true;
    for (std::size_t i = 0; i < n; ++i)
        if (out.ids[i] < 0)
            throw std::invalid_argument(in + "tokens[" + std::to_string(i) + "] is " + std::to_string(out.ids[i]) +
                                        ": token ids are >= 0; nothing was appended");
    return out;
}

void Stager::tokens(std::int64_t seq, std::int64_t from, std::int64_t to, std::int32_t* out) const {
    auto lock = lock_seq(seq);
    const Seq& s = needs(seq, Need::Any);
    if (opt_.kind != DrafterKind::Chain)
        throw std::invalid_argument(std::string("tokens: this Stager's drafter kind is \"") + drafter_kind_name(opt_.kind) +
                                    "\"; token ids are kept for a chain drafter (kind=\"chain\") only");
    // The stageable rows [horizon, end) (buffered_positions): dead rows below
    // the horizon are neither staged nor snapshotted, so their ids are not asked.
    const std::int64_t lo = s.started ? s.horizon : 0, end = s.started ? s.end : 0;
    if (from > to || from < lo || to > end)
        throw std::invalid_argument(seq_msg(seq) + ": tokens of positions [" + std::to_string(from) + ", " +
                                    std::to_string(to) + ") asked, but its stageable rows are [" + std::to_string(lo) +
                                    ", " + std::to_string(end) + ")");
    s.buf.copy_tokens_out(from, to, out);
}

void Stager::append_held(std::int64_t seq, Seq& s, std::int64_t p0, std::size_t n, const void* rows, ElemType type,
                         const std::int32_t* tokens) {
    const std::size_t dim = static_cast<std::size_t>(opt_.feature_dim), in_row = dim * elem_bytes(type);
    std::vector<std::uint8_t> copy;
    const FloatRows src{unaliased_input(rows, n * in_row, &seq, 1, copy), type, dim, in_row, opt_.storage,
                        opt_.nonfinite, bounds_};
    auto value = [&](std::int64_t flat) { return src.value(flat); };
    Append g = prepare_append(seq, s, p0, n, src, value, opt_.nonfinite == NonFinite::Error);
    g.tokens = tokens;
    commit_append(seq, s, g, src, nullptr);
}

std::string Stager::unstageable_message(std::int64_t seq, std::int64_t p0, std::int64_t flat, float v) const {
    const auto dim = static_cast<std::int64_t>(opt_.feature_dim);
    const std::int64_t row = flat / dim;
    char val[32];
    // NaN prints as "nan" whatever its sign bit (as Python formats it).
    if (std::isnan(v)) std::snprintf(val, sizeof val, "nan");
    else std::snprintf(val, sizeof val, "%.9g", static_cast<double>(v));
    std::string what;
    if (std::isfinite(v)) {
        char lim[32];
        std::snprintf(lim, sizeof lim, "%.9g", static_cast<double>(bounds_.limit));
        what = std::string(", which overflows ") + storage_name(opt_.storage) + " storage" +
               (opt_.stage == ElemType::F32 ? std::string()
                                            : std::string(" staged as ") + elem_name(opt_.stage)) +
               " (|x| must stay below " + lim + ")";
    } else {
        what = ", a non-finite value";
    }
    return seq_msg(seq) + ": row " + std::to_string(row) + " (position " + std::to_string(p0 + row) +
           "), channel " + std::to_string(flat % dim) + " holds " + val + what +
           "; nothing was appended. Models with massive activations need storage=\"bf16\" (or f32), or "
           "nonfinite=\"clamp\" to clamp to the largest value the storage can hold";
}


void Stager::process_encoded(std::int64_t seq, const std::int64_t* positions, std::size_t n, const std::uint8_t* data,
                             std::size_t nbytes, const std::int32_t* tokens) {
    auto lock = lock_seq(seq);
    Seq& s = mut(ready(seq));
    require_mode(RowMode::Held, "process_encoded");
    if (nbytes != n * row_bytes_)
        throw std::invalid_argument("encoded rows must be " + std::to_string(n) + " x " + std::to_string(row_bytes_) +
                                    " bytes (" + storage_name(opt_.storage) + "), got " + std::to_string(nbytes));
    const std::int64_t p0 = validate_positions(seq, s, positions, n);
    const TokenIds ids = check_tokens(nullptr, tokens, n);
    const std::size_t dim = static_cast<std::size_t>(opt_.feature_dim);
    const bool fallible = opt_.nonfinite == NonFinite::Error;
    std::vector<std::uint8_t> copy;
    data = unaliased_input(data, nbytes, &seq, 1, copy);
    // Stored bytes are staged as they are, so only the staged type bounds them.
    const float limit = encode_bounds(Storage::F32, opt_.stage).limit;
    auto encode = [&](std::size_t first, std::size_t count, std::uint8_t* dst) -> std::int64_t {
        const std::uint8_t* from = data + first * row_bytes_;
        if (dst) detail::copy_bytes(dst, from, count * row_bytes_);
        return fallible ? find_unstageable_encoded(from, opt_.storage, count, dim, limit) : -1;
    };
    auto value = [&](std::int64_t flat) {  // the stored value, decoded
        std::vector<float> row(dim);
        decode_rows(data + static_cast<std::size_t>(flat) / dim * row_bytes_, opt_.storage, row.data(), ElemType::F32,
                    1, dim);
        return row[static_cast<std::size_t>(flat) % dim];
    };
    Append g = prepare_append(seq, s, p0, n, encode, value, fallible);
    g.tokens = ids.data();
    commit_append(seq, s, g, encode, nullptr);
}

void Stager::external_one(std::int64_t seq, const std::int64_t* positions, std::size_t n, std::int64_t* slots_out,
                          bool reserve, const std::int32_t* tokens) {
    const std::int64_t cu[2] = {0, static_cast<std::int64_t>(n)};
    auto lock = lock_seq(seq);
    needs(seq, Need::Ready);
    append_external(nullptr, &seq, 1, cu, positions, n, slots_out, reserve, tokens);
}

void Stager::process_external(std::int64_t seq, const std::int64_t* positions, std::size_t n, std::int64_t* slots_out,
                              const std::int32_t* tokens) {
    external_one(seq, positions, n, slots_out, false, tokens);
}

void Stager::process_many(const std::int64_t* seqs_in, std::size_t n, const std::int64_t* cu_in,
                          const std::int64_t* positions, std::size_t total, const void* rows, ElemType type,
                          const std::int32_t* tokens) {
    const char* call = "process_many";
    const std::vector<std::int64_t> seqs = copy_of(seqs_in, n), cu = copy_of(cu_in, n + 1);
    check_ids(call, seqs.data(), n);
    BatchLock lock(*this, seqs.data(), n);
    check_states(call, seqs.data(), n, Need::Ready);
    require_mode(RowMode::Held, call);
    check_unique(call, lock, seqs.data(), n);
    check_offsets(call, cu.data(), n, total);
    std::vector<std::int64_t> p0(n);
    for (std::size_t i = 0; i < n; ++i)
        p0[i] = in_batch(call, i, seqs[i], [&] {
            return validate_positions(seqs[i], get(seqs[i]), positions + cu[i], static_cast<std::size_t>(cu[i + 1] - cu[i]));
        });
    const TokenIds ids = check_tokens(call, tokens, total);
    append_held_many(call, seqs, cu, p0, total, rows, type, ids.data());
}

void Stager::append_held_many(const char* call, const std::vector<std::int64_t>& seqs,
                              const std::vector<std::int64_t>& cu, const std::vector<std::int64_t>& p0,
                              std::size_t total, const void* rows, ElemType type, const std::int32_t* tokens) {
    const std::size_t n = seqs.size();
    const std::size_t dim = static_cast<std::size_t>(opt_.feature_dim), in_row = dim * elem_bytes(type);
    const bool fallible = opt_.nonfinite == NonFinite::Error;
    std::vector<std::uint8_t> copy;
    const std::uint8_t* input = unaliased_input(rows, total * in_row, seqs.data(), n, copy);
    std::vector<FloatRows> src;
    src.reserve(n);
    for (std::size_t i = 0; i < n; ++i)
        src.push_back(FloatRows{input + static_cast<std::size_t>(cu[i]) * in_row, type, dim, in_row, opt_.storage,
                                opt_.nonfinite, bounds_});
    std::vector<Append> g(n);
    std::size_t i = 0;
    try {
        for (; i < n; ++i) {
            auto value = [&](std::int64_t flat) { return src[i].value(flat); };
            g[i] = in_batch(call, i, seqs[i], [&] {
                return prepare_append(seqs[i], mut(get(seqs[i])), p0[i], static_cast<std::size_t>(cu[i + 1] - cu[i]),
                                      src[i], value, fallible);
            });
        }
    } catch (...) {
        // Sequence i rejected its rows (and put its ring back): so do the ones before it.
        while (i--)
            if (g[i].marked) mut(get(seqs[i])).buf.set_marks(g[i].before);
        throw;
    }
    for (std::size_t i = 0; i < n; ++i) {
        g[i].tokens = tokens ? tokens + cu[i] : nullptr;
        commit_append(seqs[i], mut(get(seqs[i])), g[i], src[i], nullptr);
    }
}

// process_external (call == nullptr: one sequence, checked and locked by the
// caller), process_external_many, reserve and reserve_many: every sequence's
// positions checked, then all appended; a reservation remembers the state
// before it first (cancel puts it back).
void Stager::append_external(const char* call, const std::int64_t* seqs, std::size_t n, const std::int64_t* cu,
                             const std::int64_t* positions, std::size_t total, std::int64_t* slots_out,
                             bool reserve, const std::int32_t* tokens) {
    const char* name = call ? call : reserve ? "reserve" : "process_external";
    require_mode(RowMode::External, name);
    if (call) check_offsets(call, cu, n, total);
    std::vector<std::int64_t> p0(n);
    auto check = [&](std::size_t i) {
        return validate_positions(seqs[i], get(seqs[i]), positions + cu[i], static_cast<std::size_t>(cu[i + 1] - cu[i]));
    };
    for (std::size_t i = 0; i < n; ++i) p0[i] = call ? in_batch(call, i, seqs[i], [&] { return check(i); }) : check(i);
    const TokenIds ids = check_tokens(call, tokens, total);
    const NoRows none;
    auto value = [&](std::int64_t flat) { return none.value(flat); };
    std::vector<Append> g(n);
    for (std::size_t i = 0; i < n; ++i) {
        Seq& s = mut(get(seqs[i]));
        if (reserve) {  // the fields and the ring before the rows (cancel puts them back)
            s.before = static_cast<const SeqFields&>(s);
            s.before_marks = s.buf.marks();
        }
        g[i] = prepare_append(seqs[i], s, p0[i], static_cast<std::size_t>(cu[i + 1] - cu[i]), none, value, false);
        g[i].tokens = ids.given ? ids.ids.data() + cu[i] : nullptr;
        // Only an append that is not clean (rows trimmed or the ring full) may
        // take the slots of rows cancel puts back: keep their ids.
        if (reserve) {
            if (s.buf.with_tokens() && !g[i].clean) s.before_tokens = s.buf.save_tokens();
            else s.before_tokens.clear();
        }
    }
    for (std::size_t i = 0; i < n; ++i) {
        Seq& s = mut(get(seqs[i]));
        commit_append(seqs[i], s, g[i], none, slots_out + cu[i]);
        if (reserve) s.reserved = true;
    }
}

void Stager::external_many(const char* call, const std::int64_t* seqs_in, std::size_t n, const std::int64_t* cu_in,
                           const std::int64_t* positions, std::size_t total, std::int64_t* slots_out, bool reserve,
                           const std::int32_t* tokens) {
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Ready);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    const std::vector<std::int64_t> cu = copy_of(cu_in, n + 1);
    append_external(call, seqs.data(), n, cu.data(), positions, total, slots_out, reserve, tokens);
}

void Stager::process_external_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* cu,
                                   const std::int64_t* positions, std::size_t total, std::int64_t* slots_out) {
    external_many("process_external_many", seqs, n, cu, positions, total, slots_out, false, nullptr);
}

void Stager::process_external_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* cu,
                                   const std::int64_t* positions, std::size_t total, std::int64_t* slots_out,
                                   const char* call, const std::int32_t* tokens) {
    external_many(call, seqs, n, cu, positions, total, slots_out, false, tokens);
}

// -- reservations --------------------------------------------------------------

void Stager::reserve(std::int64_t seq, const std::int64_t* positions, std::size_t n, std::int64_t* slots_out,
                     const std::int32_t* tokens) {
    external_one(seq, positions, n, slots_out, true, tokens);
}

void Stager::reserve_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* cu,
                          const std::int64_t* positions, std::size_t total, std::int64_t* slots_out,
                          const std::int32_t* tokens) {
    external_many("reserve_many", seqs, n, cu, positions, total, slots_out, true, tokens);
}

// The rows are in the owner's table: the state the reservation made stands.
void Stager::end_reservation(Seq& s, bool keep) noexcept {
    if (!keep) {  // the fields, the ring and the ids as before reserve: nothing happened
        static_cast<SeqFields&>(s) = s.before;
        s.buf.set_marks(s.before_marks);
        if (!s.before_tokens.empty()) s.buf.restore_tokens(std::move(s.before_tokens));
    }
    s.before_tokens.clear();
    s.reserved = false;
}

void Stager::check_confirmable(std::int64_t seq, const Seq& s) const {
    if (!s.buf.with_tokens()) return;
    // A reservation that came back from the device step before the server
    // wrote its verify rows' ids (to_host): its rows have no ids to keep.
    for (std::int64_t p = std::max(s.before.end, s.horizon); p < s.end; ++p) {
        std::int32_t id = 0;
        s.buf.copy_tokens_out(p, p + 1, &id);
        if (id < 0)
            throw std::invalid_argument(seq_msg(seq) + "'s reserved row at position " + std::to_string(p) +
                                        " has no token id (it came back from the device step before its verify "
                                        "batch's ids were written at its verify slots): cancel the reservation");
    }
}

void Stager::confirm(std::int64_t seq) {
    auto lock = lock_seq(seq);
    const Seq& s = needs(seq, Need::Reserved);
    check_confirmable(seq, s);
    end_reservation(mut(s), true);
}

void Stager::cancel(std::int64_t seq) {
    auto lock = lock_seq(seq);
    end_reservation(mut(needs(seq, Need::Reserved)), false);
}

void Stager::confirm_many(const std::int64_t* seqs_in, std::size_t n) {
    const char* call = "confirm_many";
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Reserved);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    for (std::size_t i = 0; i < seqs.size(); ++i)
        in_batch(call, i, seqs[i], [&] { check_confirmable(seqs[i], get(seqs[i])); });
    for (std::int64_t q : seqs) end_reservation(mut(get(q)), true);
}

void Stager::cancel_many(const std::int64_t* seqs_in, std::size_t n) {
    const char* call = "cancel_many";
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Reserved);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    for (std::int64_t q : seqs) end_reservation(mut(get(q)), false);
}

}  // namespace dspark
