// libFuzzer target over dspark::Stager: the input bytes become a configuration
// and a sequence of calls (valid and invalid, several sequences, every storage).
//
// Findings (the process aborts, libFuzzer saves the input):
//  * any exception other than the documented ones (std::invalid_argument and
//    its ConfigError / TypeError subclasses, dspark::StateError), e.g. the
//    core's "internal error" std::logic_error, std::bad_alloc, std::length_error;
//  * a crash or sanitizer report (built with -fsanitize=fuzzer,address,undefined);
//  * a rejected call that changed state;
//  * a broken invariant: positions contiguous, drafter positions inside
//    [0, W), the block fits, the buffer bound (peak rows), no round open after
//    commit / fail, and staged rows equal to the rows the caller gave (a
//    shadow copy of every sequence's rows is kept here).
//
// Build: cmake -DDSPARK_FUZZ=ON with clang (csrc/fuzz/CMakeLists.txt).
// Run:   ./fuzz_stager -max_total_time=60 CORPUS_DIR
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"
#include "dspark/stager.hpp"
#include "fuzz_common.hpp"

using namespace dspark;
using dspark_fuzz::Reader;

namespace {

constexpr std::int64_t MAXP = MAX_POSITION;

struct Shadow {
    std::map<std::int64_t, std::string> rows;  // absolute position -> encoded row
};

bool same_state(const SeqState& a, const SeqState& b) {
    return a.started == b.started && a.end == b.end && a.horizon == b.horizon && a.n_cache == b.n_cache &&
           a.pos_base == b.pos_base && a.n_retained == b.n_retained && a.n_pending == b.n_pending &&
           a.open_round == b.open_round && a.consecutive_failures == b.consecutive_failures &&
           a.disabled == b.disabled && a.restage_owed == b.restage_owed && a.first_round == b.first_round &&
           a.tentative_rows == b.tentative_rows;
}

bool same_stats(const SeqStats& a, const SeqStats& b) {
    return a.rounds == b.rounds && a.commits == b.commits && a.failures == b.failures && a.rebases == b.rebases &&
           a.staged_rows == b.staged_rows && a.restaged_rows == b.restaged_rows && a.skips == b.skips &&
           a.rows == b.rows && a.peak_rows == b.peak_rows;
}

struct Harness {
    StagerOptions o;
    Stager st;
    std::vector<Shadow> shadow;
    std::vector<std::vector<std::uint8_t>> snaps;
    std::int64_t bound;

    explicit Harness(const StagerOptions& opt)
        : o(opt), st(opt), shadow(static_cast<std::size_t>(opt.max_seqs)),
          bound(opt.window + TRIM_CHUNK + opt.block_size + 1) {}

    std::int64_t seq_of(std::uint8_t b) const {
        const int v = b % 16;
        if (v == 14) return -1;
        if (v == 15) return o.max_seqs + (b >> 4);
        return v % o.max_seqs;
    }
    bool valid(std::int64_t s) const { return s >= 0 && s < o.max_seqs; }
    std::int64_t end_of(std::int64_t s) const { return valid(s) ? st.state(s).end : 0; }

    // -- invariants ---------------------------------------------------------
    void check_seq(std::int64_t s) {
        const SeqState x = st.state(s);
        const SeqStats t = st.stats(s);
        FUZZ_CHECK(t.peak_rows <= bound);
        FUZZ_CHECK(t.rows <= t.peak_rows);
        FUZZ_CHECK(x.tentative_rows >= 0 && x.tentative_rows <= o.block_size + 1);
        if (!x.started) {
            FUZZ_CHECK(!x.open_round && x.n_retained == 0 && x.n_pending == 0);
            return;
        }
        FUZZ_CHECK(0 <= x.horizon && x.horizon <= x.end);
        FUZZ_CHECK(0 <= x.pos_base && x.pos_base <= x.n_cache && x.n_cache <= x.end);
        FUZZ_CHECK(x.end < MAXP + 1);
        FUZZ_CHECK(x.n_retained >= 0 && x.n_pending >= 0 && x.n_retained + x.n_pending == x.end - x.horizon);
        FUZZ_CHECK(x.restage_owed || x.n_cache - x.pos_base <= o.window - o.block_size);
        FUZZ_CHECK(x.tentative_rows <= x.end - x.n_cache);
        FUZZ_CHECK(t.rows >= x.end - x.horizon);
        // The shadow keeps rows from the horizon on; drop what can never be staged.
        auto& m = shadow[static_cast<std::size_t>(s)].rows;
        m.erase(m.begin(), m.lower_bound(x.horizon));
        m.erase(m.lower_bound(x.end), m.end());
    }
    void check_all() {
        for (std::int64_t s = 0; s < o.max_seqs; ++s) check_seq(s);
    }

    void check_plan(const RoundPlan& p, const std::uint8_t* rows, std::size_t nbytes, const SeqState& before) {
        if (p.skip != Skip::None) {
            FUZZ_CHECK(p.n_rows == 0);
            return;
        }
        const std::int64_t B = o.block_size;
        FUZZ_CHECK(p.n_rows >= 0 && static_cast<std::size_t>(p.n_rows) * st.row_bytes() == nbytes);
        FUZZ_CHECK(p.first_row + p.n_rows == p.start);
        FUZZ_CHECK(p.crop_from == p.start - p.pos_base);
        FUZZ_CHECK(p.first_row - p.pos_base >= 0);             // drafter positions >= 0
        FUZZ_CHECK(p.crop_from >= 0 && p.crop_from + B <= o.window);  // block fits [0, W)
        FUZZ_CHECK(p.first_row >= before.horizon);
        FUZZ_CHECK(p.start == before.end);
        FUZZ_CHECK(!p.rebase || p.clear_cache);
        FUZZ_CHECK(!p.clear_cache || p.first_row == p.pos_base);  // a cleared cache restarts at 0
        FUZZ_CHECK(!p.rebase || p.n_rows <= st.w_keep());
        FUZZ_CHECK(p.clear_cache || p.first_row == before.n_cache);  // continue the cache exactly
        // Staged rows are the rows the caller gave.
        const auto& m = shadow[static_cast<std::size_t>(p.seq)].rows;
        const std::size_t rb = st.row_bytes();
        for (std::int64_t k = 0; k < p.n_rows; ++k) {
            auto it = m.find(p.first_row + k);
            if (it == m.end()) continue;  // a restored row the harness did not see
            FUZZ_CHECK(it->second.size() == rb && std::memcmp(it->second.data(), rows + k * rb, rb) == 0);
        }
    }

    // Run fn; documented rejections must leave every sequence as it was.
    template <class Fn>
    bool attempt(Fn&& fn) {
        std::vector<SeqState> sb;
        std::vector<SeqStats> tb;
        for (std::int64_t s = 0; s < o.max_seqs; ++s) sb.push_back(st.state(s)), tb.push_back(st.stats(s));
        try {
            fn();
        } catch (const StateError&) {
            goto rejected;
        } catch (const std::invalid_argument&) {  // incl. ConfigError, TypeError
            goto rejected;
        }
        check_all();
        return true;
    rejected:
        for (std::int64_t s = 0; s < o.max_seqs; ++s) {
            FUZZ_CHECK(same_state(st.state(s), sb[static_cast<std::size_t>(s)]));
            FUZZ_CHECK(same_stats(st.stats(s), tb[static_cast<std::size_t>(s)]));
        }
        return false;
    }

    // -- rows -------------------------------------------------------------------
    std::vector<float> make_rows(std::size_t n, Reader& r) {
        const std::size_t D = static_cast<std::size_t>(o.feature_dim);
        std::vector<float> x(n * D);
        const std::uint8_t fill = r.u8(), seed = r.u8(), special = r.u8();
        std::uint32_t h = 0x9E3779B1u * (seed + 1u);
        for (std::size_t i = 0; i < x.size(); ++i) {
            h ^= h << 13, h ^= h >> 17, h ^= h << 5;
            float v = (static_cast<float>(h >> 8) / 16777216.0f - 0.5f) * 4.0f;
            switch (fill % 7) {
                case 6:  // real activations: a massive channel (1e3..1e5), a huge-norm BOS row holding 87,929
                    if (i % D == 3 % D) v *= 1e3f * static_cast<float>(1 + h % 100);
                    if (i < D) v = i == 3 % D ? 87929.0f : v * 30.0f;
                    break;
                case 1: v *= 1e-5f; break;
                case 2: v *= 4e4f; break;
                case 3: v = 0.0f; break;
                case 4: v = -0.0f; break;
                case 5: v = static_cast<float>(static_cast<int>(h % 255) - 127) * 0.5f; if (i % 32 == 0) v = 127; break;
                default: break;
            }
            x[i] = v;
        }
        if (special % 8 == 7 && !x.empty()) {
            const float sv[3] = {NAN, INFINITY, -INFINITY};
            x[(special >> 3) % x.size()] = sv[(special >> 3) % 3];
        }
        return x;
    }

    std::vector<std::int64_t> positions(std::int64_t seq, std::size_t n, std::uint8_t mode) {
        const std::int64_t end = end_of(seq);
        std::int64_t p0 = end;
        switch (mode % 16) {
            case 10: p0 = end + 1; break;
            case 11: p0 = end - 1; break;
            case 12: p0 = 0; break;
            case 13: p0 = -1; break;
#ifdef DSPARK_FUZZ_SKIP_KNOWN  // exploration builds: stay clear of a finding already reported
            case 15: p0 = MAXP - 2 - static_cast<std::int64_t>(n); break;
#else
            case 15: p0 = MAXP - 1 - static_cast<std::int64_t>(n / 2); break;
#endif
            default: break;
        }
        std::vector<std::int64_t> p(n);
        for (std::size_t i = 0; i < n; ++i) p[i] = p0 + static_cast<std::int64_t>(i);
        if (mode % 16 == 14 && n > 1) p[n - 1] += 1;  // a gap
        return p;
    }

    void record(std::int64_t seq, const std::vector<std::int64_t>& pos, const std::uint8_t* enc) {
        const std::size_t rb = st.row_bytes();
        auto& m = shadow[static_cast<std::size_t>(seq)].rows;
        for (std::size_t i = 0; i < pos.size(); ++i)
            m[pos[i]] = std::string(reinterpret_cast<const char*>(enc + i * rb), rb);
    }

    // -- ops -----------------------------------------------------------------------
    void op_process(Reader& r, std::int64_t seq, std::size_t n) {
        const std::uint8_t pmode = r.u8(), tmode = r.u8();
        auto pos = positions(seq, n, pmode);
        std::vector<float> x = make_rows(n, r);
        const std::size_t D = static_cast<std::size_t>(o.feature_dim);
        const ElemType t = static_cast<ElemType>(tmode % 3);
        std::vector<std::uint8_t> in(n * D * elem_bytes(t));
        if (in.empty()) {} else if (t == ElemType::F32) std::memcpy(in.data(), x.data(), in.size());
        else encode_rows(x.data(), ElemType::F32, in.data(), t == ElemType::F16 ? Storage::F16 : Storage::BF16, n, D,
                         NonFinite::Error);
        // What the stager should store (same conversion, same policy).
        std::vector<std::uint8_t> enc(n * st.row_bytes());
        if (n) encode_rows(in.data(), t, enc.data(), o.storage, n, D, o.nonfinite, encode_bounds(o.storage, o.stage));
        if (attempt([&] { st.process(seq, pos.data(), n, in.data(), t); }))
            record(seq, pos, enc.data());
    }

    void op_process_encoded(Reader& r, std::int64_t seq) {
        const std::size_t n = r.u8() % 7;
        const std::uint8_t pmode = r.u8(), dmode = r.u8();
        auto pos = positions(seq, n, pmode);
        const std::size_t rb = st.row_bytes();
        std::vector<std::uint8_t> enc(n * rb);
        if (dmode % 4 == 0) {  // raw bytes from the input (arbitrary scales / NaN payloads)
            for (auto& b : enc) b = r.u8();
        } else {
            std::vector<float> x = make_rows(n, r);
            if (n) encode_rows(x.data(), ElemType::F32, enc.data(), o.storage, n, static_cast<std::size_t>(o.feature_dim),
                               NonFinite::Error);
        }
        std::size_t nbytes = enc.size();
        if (dmode % 8 == 5) nbytes = nbytes ? nbytes - 1 : 1;  // a wrong length
        if (nbytes > enc.size()) enc.resize(nbytes);
        if (attempt([&] { st.process_encoded(seq, pos.data(), n, enc.data(), nbytes); }))
            record(seq, pos, enc.data());
    }

    std::int64_t n_past_of(std::int64_t seq, std::uint8_t mode) {
        const std::int64_t end = end_of(seq);
        switch (mode % 16) {
            case 8: return end + 1;
            case 9: return end - 1;
            case 10: return end - 3;
            case 11: return 0;
            case 12: return -1;
            case 13: return MAXP;
            case 14: return valid(seq) ? st.state(seq).n_cache : 0;
            case 15: return std::numeric_limits<std::int64_t>::min();
            default: return end;
        }
    }

    void op_draft(std::int64_t seq, std::int64_t n_past) {
        const SeqState before = valid(seq) ? st.state(seq) : SeqState{};
        ByteVec out;
        RoundPlan p;
        if (attempt([&] { p = st.draft(seq, n_past, out); })) {
            check_plan(p, out.data(), out.size(), before);
            FUZZ_CHECK(st.state(seq).open_round == (p.skip == Skip::None));
        }
    }

    void op_draft_many(Reader& r) {
        const std::size_t k = r.u8() % 5;
        const std::uint8_t mode = r.u8();
        std::vector<std::int64_t> seqs, pasts;
        std::vector<SeqState> before;
        for (std::size_t i = 0; i < k; ++i) {
            seqs.push_back(seq_of(r.u8()));
            pasts.push_back(n_past_of(seqs.back(), mode));
            before.push_back(valid(seqs.back()) ? st.state(seqs.back()) : SeqState{});
        }
        std::vector<RoundPlan> plans;
        ByteVec out;
        if (attempt([&] { st.draft_many(seqs.data(), pasts.data(), k, plans, out); })) {
            FUZZ_CHECK(plans.size() == k);
            std::size_t off = 0;
            for (std::size_t i = 0; i < k; ++i) {
                const std::size_t nb = static_cast<std::size_t>(plans[i].n_rows) * st.row_bytes();
                FUZZ_CHECK(plans[i].seq == seqs[i] && off + nb <= out.size());
                check_plan(plans[i], out.data() + off, nb, before[i]);
                off += nb;
            }
            FUZZ_CHECK(off == out.size());
        }
    }

    void op_restore(Reader& r, std::int64_t seq) {
        const std::uint8_t which = r.u8(), damage = r.u8(), at = r.u8(), val = r.u8();
        std::vector<std::uint8_t> data;
        if (damage % 8 == 7 || snaps.empty()) {
            const std::size_t len = r.u8();
            for (std::size_t i = 0; i < len; ++i) data.push_back(r.u8());
            if (damage & 0x80) dspark_fuzz::fix_crc(data);
        } else {
            data = snaps[which % snaps.size()];
            switch (damage % 8) {
                case 1: data[(at * 257u + val) % data.size()] ^= static_cast<std::uint8_t>(1u << (val % 8)); break;
                case 2: data.resize(data.size() - std::min<std::size_t>(data.size(), 1 + val % 9)); break;
                case 3: data.resize(data.size() + 1 + val % 5, 0); break;
                case 4: case 5: case 6: {  // rewrite a header field, fix the checksum
                    static const int offs[] = {32, 40, 48, 56, 64, 72, 28, 80, 16, 76};
                    const int off = offs[at % 10];
                    const int width = (off == 72 || off == 28 || off == 16 || off == 76) ? 4 : 8;
                    std::uint64_t v = 0;
                    for (int k = 0; k < width; ++k) v |= std::uint64_t(data[off + k]) << (8 * k);
                    const std::int64_t deltas[] = {-3, -2, -1, 1, 2, 3, 5, 8};
                    if (val < 200) v += static_cast<std::uint64_t>(deltas[val % 8]);
                    else if (val < 220) v = 0;
                    else if (val < 240) v = ~std::uint64_t(0);
                    else v = std::uint64_t(1) << (val % 64);
                    for (int k = 0; k < width; ++k) data[off + k] = static_cast<std::uint8_t>(v >> (8 * k));
                    dspark_fuzz::fix_crc(data);
                    break;
                }
                default: break;
            }
        }
        std::vector<std::uint8_t> before;
        if (valid(seq) && !st.state(seq).open_round) before = st.snapshot(seq);
        if (attempt([&] { st.restore(seq, data.data(), data.size()); })) {
            auto& m = shadow[static_cast<std::size_t>(seq)].rows;
            m.clear();
            const SeqState x = st.state(seq);
            FUZZ_CHECK(!x.started || x.restage_owed);
            (void)st.snapshot(seq);  // must be representable
        } else if (!before.empty()) {
            FUZZ_CHECK(st.snapshot(seq) == before);
        }
    }

    void op_round(Reader& r, std::int64_t seq) {
        const std::uint8_t close = r.u8(), nv = r.u8(), acc = r.u8(), rounds = r.u8();
        const std::int64_t B = o.block_size;
        for (int k = 0; k < 1 + rounds % 6; ++k) {
            const std::int64_t end = end_of(seq);
            const SeqState before = valid(seq) ? st.state(seq) : SeqState{};
            ByteVec out;
            RoundPlan p;
            if (attempt([&] { p = st.draft(seq, end, out); })) {
                check_plan(p, out.data(), out.size(), before);
                if (p.skip == Skip::None) {
                    if (close % 8 < 5 || k % 2) {
                        attempt([&] { st.commit(seq); });
                    } else if (close % 8 < 7) {
                        attempt([&] { st.fail(seq, static_cast<FailStage>(close % 8 - 5)); });
                    } else {
                        return;  // leave it open
                    }
                    FUZZ_CHECK(!st.state(seq).open_round);
                }
            }
            const std::size_t n = static_cast<std::size_t>(nv % 4 == 0 ? B + 1 : std::min<std::int64_t>(nv % 4, B + 1));
            Reader none(nullptr, 0);
            std::vector<float> x = make_rows(n, none);
            std::vector<std::int64_t> pos(n);
            for (std::size_t i = 0; i < n; ++i) pos[i] = end + static_cast<std::int64_t>(i);
            std::vector<std::uint8_t> enc(n * st.row_bytes());
            encode_rows(x.data(), ElemType::F32, enc.data(), o.storage, n, static_cast<std::size_t>(o.feature_dim),
                        o.nonfinite);
            if (attempt([&] { st.process(seq, pos.data(), n, x.data(), ElemType::F32); })) record(seq, pos, enc.data());
            attempt([&] { st.accept(seq, (acc + 3 * k) % (B + 1)); });
        }
    }

    void step(Reader& r) {
        const std::uint8_t code = r.u8();
        const std::int64_t seq = seq_of(r.u8());
        switch (code % 16) {
            case 0: attempt([&] { st.begin(seq); }); if (valid(seq) && !st.state(seq).open_round) shadow[seq].rows.clear(); break;
            case 1: case 2: op_process(r, seq, r.u8() % 13); break;
            case 3: {
                const std::uint8_t b = r.u8();  // a long prefill, past the window and a trim chunk
                op_process(r, seq, static_cast<std::size_t>(o.window + (b % 2 ? TRIM_CHUNK : 1) + b % 64));
                break;
            }
            case 4: op_process_encoded(r, seq); break;
            case 5: op_draft(seq, n_past_of(seq, r.u8())); break;
            case 6: op_draft_many(r); break;
            case 7: attempt([&] { st.commit(seq); }); if (valid(seq)) FUZZ_CHECK(!st.state(seq).open_round); break;
            case 8: {
                const std::uint8_t b = r.u8();
                attempt([&] { st.fail(seq, static_cast<FailStage>(b % 4)); });
                if (valid(seq) && b % 4 < 2) FUZZ_CHECK(!st.state(seq).open_round);
                break;
            }
            case 9: {
                const std::uint8_t b = r.u8();
                const std::int64_t n = b == 255 ? std::numeric_limits<std::int64_t>::max() : static_cast<std::int64_t>(b % 12) - 1;
                attempt([&] { st.accept(seq, n); });
                break;
            }
            case 10: {
                const std::uint8_t b = r.u8();
                const std::int64_t end = end_of(seq);
                const std::int64_t np = b >= 250 ? (b == 250 ? -1 : b == 251 ? MAXP : 0) : std::max<std::int64_t>(0, end - (b % 42 - 2));
                attempt([&] { st.rollback(seq, np); });
                break;
            }
            case 11: {
                const std::uint8_t a = r.u8(), b = r.u8(), mode = r.u8();
                const std::int64_t end = end_of(seq);
                std::int64_t keep = a * (end + 1) / 256, discard = b * (end - keep + 1) / 256;
                if (mode % 8 == 5) keep = -1;
                if (mode % 8 == 6) discard = end - keep + 1;
                if (mode % 8 == 7) discard = MAXP - 1, keep = MAXP - 1;
                if (attempt([&] { st.shift(seq, keep, discard); }) && discard > 0) {
                    // Mirror the shift in the shadow: drop [keep, keep + discard), move the rest down.
                    auto& m = shadow[static_cast<std::size_t>(seq)].rows;
                    std::map<std::int64_t, std::string> moved;
                    for (auto& [p, row] : m)
                        if (p < keep) moved[p] = row;
                        else if (p >= keep + discard) moved[p - discard] = row;
                    m.swap(moved);
                    check_seq(seq);
                }
                break;
            }
            case 12: {
                const std::int64_t dst = seq_of(r.u8());
                if (attempt([&] { st.fork(seq, dst); }) && valid(dst)) shadow[dst].rows = shadow[seq].rows;
                break;
            }
            case 13:
                attempt([&] { snaps.push_back(st.snapshot(seq)); });
                if (snaps.size() > 8) snaps.erase(snaps.begin());
                break;
            case 14: op_restore(r, seq); break;
            default: op_round(r, seq); break;
        }
    }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    Reader r(data, size);
    StagerOptions o;
    const std::uint8_t b0 = r.u8(), b1 = r.u8(), b2 = r.u8(), b3 = r.u8(), b4 = r.u8();
    o.storage = static_cast<Storage>((b0 >> 1) % STORAGE_COUNT);
    const bool q = o.storage == Storage::Q8_0 || o.storage == Storage::Q4_0;
    static const std::int64_t dims[4] = {32, 64, 1, 7};
    o.feature_dim = dims[(b0 & 1) | (q ? 0 : (b0 >> 4) & 2)];
    o.block_size = 1 + b1 % 8;
    o.max_failures = 1 + (b1 >> 3) % 3;
    o.window = 2 * o.block_size + 1 + b2 % 40 + (b2 >= 200 ? 60 : 0);
    o.max_seqs = 1 + b3 % 3;
    o.nonfinite = static_cast<NonFinite>(b4 % NONFINITE_COUNT);
    o.stage = static_cast<ElemType>((b4 >> 2) % 3);
    if (b4 >= 252) {  // a configuration that cannot work must be a ConfigError, never a crash
        o.window = 2 * o.block_size - (b4 - 252);
        try {
            Stager bad(o);
            FUZZ_CHECK(!"a window <= 2 * block_size was accepted");
        } catch (const ConfigError&) {
        }
        return 0;
    }
    Harness h(o);
    int ops = 0;
    while (r.more() && ops++ < 96) h.step(r);
    // Whatever happened, every sequence can still be snapshotted and restored.
    for (std::int64_t s = 0; s < o.max_seqs; ++s) {
        if (h.st.state(s).open_round) continue;
        const auto snap = h.st.snapshot(s);
        try {
            h.st.restore(s, snap.data(), snap.size());
        } catch (const std::exception& e) {
            std::fprintf(stderr, "restore of its own snapshot failed: %s\n", e.what());
            FUZZ_CHECK(!"a sequence's own snapshot does not restore");
        }
        h.check_seq(s);
    }
    return 0;
}
