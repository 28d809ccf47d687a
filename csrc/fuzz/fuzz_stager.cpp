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
//    shadow copy of every sequence's rows is kept here);
//  * external-row mode disagreeing with held mode: every call also runs on an
//    external-row Stager of the same configuration, whose rows live in a
//    mirror table here, written at the slots process / restore return and
//    moved by the moves fork / shift return, as an owner does. Both must give
//    the same outcome, plans, slot runs, moves and states, and after every
//    call the mirror's rows at the live slots must be the held Stager's rows.
//    (The owner checks rows before process, as docs/external_rows.md says:
//    rows the held Stager rejected are never offered to the external one.)
//  * threads (configurations with b3 >= 128 and two or more sequences): the
//    single-sequence calls made are replayed on a fresh Stager from two
//    threads, sequences split between them, and serially on another; every
//    call's outcome (plan, rows, moves, snapshot bytes) and every sequence's
//    final snapshot must be the serial replay's.
//
// Build: cmake -DDSPARK_FUZZ=ON with clang (csrc/fuzz/CMakeLists.txt).
// Run:   ./fuzz_stager -max_total_time=60 CORPUS_DIR
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <functional>
#include <map>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
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

// How a call ended: 0 returned, 1 std::invalid_argument (incl. ConfigError,
// TypeError), 2 StateError.
enum Outcome : int { OK = 0, INVALID = 1, STATE = 2 };

template <class Fn>
int outcome_of(Fn&& fn) {
    try {
        fn();
    } catch (const StateError&) {
        return STATE;
    } catch (const std::invalid_argument&) {
        return INVALID;
    }
    return OK;
}

StagerOptions external_of(StagerOptions o) {
    o.rows = RowMode::External;
    return o;
}

bool same_plan(const RoundPlan& a, const RoundPlan& b) {
    return a.seq == b.seq && a.skip == b.skip && a.rebase == b.rebase && a.clear_cache == b.clear_cache &&
           a.start == b.start && a.pos_base == b.pos_base && a.first_row == b.first_row && a.n_rows == b.n_rows &&
           a.crop_from == b.crop_from && a.slot_runs[0].first == b.slot_runs[0].first &&
           a.slot_runs[0].count == b.slot_runs[0].count && a.slot_runs[1].first == b.slot_runs[1].first &&
           a.slot_runs[1].count == b.slot_runs[1].count;
}

bool same_moves(const std::vector<SlotMove>& a, const std::vector<SlotMove>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
        if (a[i].src != b[i].src || a[i].dst != b[i].dst || a[i].count != b[i].count) return false;
    return true;
}

// One single-sequence call, replayable on any Stager of the configuration:
// returns its outcome and what it returned, as bytes (for the thread replay).
struct Replay {
    std::int64_t seq;
    std::function<std::string(Stager&)> run;
};

template <class T>
void put_pod(std::string& out, const T& v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

struct Harness {
    StagerOptions o;
    Stager st;
    // External-row twin and its owner's table (max_seqs * ring_rows rows).
    Stager ext;
    std::size_t rb;
    std::vector<std::uint8_t> table;
    std::vector<Shadow> shadow;
    std::vector<std::vector<std::uint8_t>> snaps;
    std::int64_t bound;
    int last = OK;  // the held call's outcome in attempt()
    std::vector<Replay> replays;  // single-sequence calls made on st, in order (threads mode)
    bool record_replays = false;

    explicit Harness(const StagerOptions& opt)
        : o(opt), st(opt), ext(external_of(opt)), rb(st.row_bytes()),
          table(static_cast<std::size_t>(opt.max_seqs * ext.ring_rows()) * rb, 0xa5),
          shadow(static_cast<std::size_t>(opt.max_seqs)), bound(opt.window + TRIM_CHUNK + opt.block_size + 1) {}

    std::uint8_t* slot_row(std::int64_t slot) {
        FUZZ_CHECK(slot >= 0 && static_cast<std::size_t>(slot + 1) * rb <= table.size());
        return table.data() + static_cast<std::size_t>(slot) * rb;
    }
    // The owner writes rows [i] to slots[i] (-1: not stored).
    void write_rows(const std::int64_t* slots, std::size_t n, const std::uint8_t* enc) {
        for (std::size_t i = 0; i < n; ++i)
            if (slots[i] >= 0) std::memcpy(slot_row(slots[i]), enc + i * rb, rb);
    }
    // The owner copies rows in order along the runs.
    void write_runs(const SlotRun runs[2], const std::uint8_t* rows) {
        for (int k = 0; k < 2; ++k)
            for (std::int64_t i = 0; i < runs[k].count; ++i, rows += rb) std::memcpy(slot_row(runs[k].first + i), rows, rb);
    }
    void apply(const std::vector<SlotMove>& moves) {
        for (const SlotMove& m : moves) {
            FUZZ_CHECK(m.count > 0 && (m.src + m.count <= m.dst || m.dst + m.count <= m.src));  // never overlapping
            slot_row(m.src + m.count - 1), slot_row(m.dst + m.count - 1);  // inside the table
            std::memcpy(slot_row(m.dst), slot_row(m.src), static_cast<std::size_t>(m.count) * rb);
        }
    }
    // The external plan's rows, read from the table, are the held plan's rows.
    void check_plan_rows(const RoundPlan& xp, const std::uint8_t* rows) {
        std::size_t at = 0;
        for (const SlotRun& run : xp.slot_runs)
            for (std::int64_t i = 0; i < run.count; ++i, ++at)
                FUZZ_CHECK(std::memcmp(slot_row(run.first + i), rows + at * rb, rb) == 0);
        FUZZ_CHECK(static_cast<std::int64_t>(at) == xp.n_rows);
    }
    // After every call: the same state in both modes, and the table holds the
    // held Stager's live rows at the live slots.
    void check_mirror() {
        for (std::int64_t s = 0; s < o.max_seqs; ++s) {
            const SeqState h = st.state(s), x = ext.state(s);
            FUZZ_CHECK(same_state(h, x));
            FUZZ_CHECK(same_stats(st.stats(s), ext.stats(s)));
            SlotRun hl[2], xl[2];
            st.live_slots(s, hl);
            ext.live_slots(s, xl);
            for (int k = 0; k < 2; ++k) FUZZ_CHECK(hl[k].first == xl[k].first && hl[k].count == xl[k].count);
            if (h.open_round || !h.started) continue;
            const auto snap = st.snapshot(s);  // rows [horizon, end) after the 96-byte header
            FUZZ_CHECK(snap.size() == 96 + static_cast<std::size_t>(h.end - h.horizon) * rb);
            std::size_t at = 96;
            for (int k = 0; k < 2; ++k)
                for (std::int64_t i = 0; i < xl[k].count; ++i, at += rb)
                    FUZZ_CHECK(std::memcmp(slot_row(xl[k].first + i), snap.data() + at, rb) == 0);
            FUZZ_CHECK(at == snap.size());
        }
    }
    // Run a call on the external twin: the same outcome as the held one.
    template <class Fn>
    bool ext_attempt(Fn&& fn) {
        const int x = outcome_of(fn);
        if (x != last) std::fprintf(stderr, "held outcome %d, external outcome %d\n", last, x);
        FUZZ_CHECK(x == last);
        return x == OK;
    }
    // Whether a rejection of this sequence's call comes before its rows are
    // looked at (an unknown sequence, an open round): the external twin must
    // reject it too, although the owner would also have offered it the rows.
    bool rejected_before_rows(std::int64_t seq) const { return !valid(seq) || st.state(seq).open_round; }
    void log_replay(std::int64_t seq, std::function<std::string(Stager&)> fn) {
        if (record_replays && valid(seq)) replays.push_back({seq, std::move(fn)});
    }

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
        last = outcome_of(fn);
        if (last == OK) {
            check_all();
            return true;
        }
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
        const bool ok = attempt([&] { st.process(seq, pos.data(), n, in.data(), t); });
        if (ok) record(seq, pos, enc.data());
        process_external(seq, pos, enc, ok);
        log_replay(seq, [seq, pos, in, t](Stager& x) {
            return std::to_string(outcome_of([&] { x.process(seq, pos.data(), pos.size(), in.data(), t); }));
        });
    }

    // The owner's side of an accepted process: the same positions on the
    // external twin, the encoded rows written at the slots it returns. Rows
    // the held Stager rejected are never offered (the owner checks first),
    // unless the call is rejected before rows are looked at.
    void process_external(std::int64_t seq, const std::vector<std::int64_t>& pos, const std::vector<std::uint8_t>& enc,
                          bool held_ok) {
        if (!held_ok && !rejected_before_rows(seq)) return;
        std::vector<std::int64_t> slots(pos.size(), -2);
        if (ext_attempt([&] { ext.process_external(seq, pos.data(), pos.size(), slots.data()); })) {
            for (std::size_t i = 0; i < slots.size(); ++i) {
                FUZZ_CHECK(slots[i] == -1 || (slots[i] >= seq * ext.ring_rows() && slots[i] < (seq + 1) * ext.ring_rows()));
                FUZZ_CHECK(i == 0 || slots[i - 1] == -1 || slots[i] != slots[i - 1]);
            }
            write_rows(slots.data(), slots.size(), enc.data());
        }
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
        const bool ok = attempt([&] { st.process_encoded(seq, pos.data(), n, enc.data(), nbytes); });
        if (ok) record(seq, pos, enc.data());
        process_external(seq, pos, enc, ok);
        log_replay(seq, [seq, pos, enc, nbytes](Stager& x) {
            return std::to_string(outcome_of([&] { x.process_encoded(seq, pos.data(), pos.size(), enc.data(), nbytes); }));
        });
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

    // draft on both twins: the same plan, and the table's rows at its slots.
    bool draft_both(std::int64_t seq, std::int64_t n_past, RoundPlan& p) {
        const SeqState before = valid(seq) ? st.state(seq) : SeqState{};
        ByteVec out, xout;
        RoundPlan xp;
        const bool ok = attempt([&] { p = st.draft(seq, n_past, out); });
        if (ok) {
            check_plan(p, out.data(), out.size(), before);
            FUZZ_CHECK(st.state(seq).open_round == (p.skip == Skip::None));
        }
        if (ext_attempt([&] { xp = ext.draft(seq, n_past, xout); })) {
            FUZZ_CHECK(same_plan(p, xp) && xout.empty());
            check_plan_rows(xp, out.data());
        }
        log_replay(seq, [seq, n_past](Stager& x) {
            ByteVec rows;
            RoundPlan q;
            std::string r = std::to_string(outcome_of([&] { q = x.draft(seq, n_past, rows); }));
            put_pod(r, q.skip), put_pod(r, q.start), put_pod(r, q.pos_base), put_pod(r, q.first_row);
            put_pod(r, q.n_rows), put_pod(r, q.rebase), put_pod(r, q.slot_runs);
            return r.append(reinterpret_cast<const char*>(rows.data()), rows.size());
        });
        return ok;
    }

    void op_draft(std::int64_t seq, std::int64_t n_past) {
        RoundPlan p;
        draft_both(seq, n_past, p);
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
        std::vector<RoundPlan> plans, xplans;
        ByteVec out, xout;
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
        if (ext_attempt([&] { ext.draft_many(seqs.data(), pasts.data(), k, xplans, xout); })) {
            FUZZ_CHECK(xplans.size() == k && xout.empty());
            std::size_t off = 0;
            for (std::size_t i = 0; i < k; ++i) {
                FUZZ_CHECK(same_plan(plans[i], xplans[i]));
                check_plan_rows(xplans[i], out.data() + off);
                off += static_cast<std::size_t>(plans[i].n_rows) * rb;
            }
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
        const bool ok = attempt([&] { st.restore(seq, data.data(), data.size()); });
        if (ok) {
            auto& m = shadow[static_cast<std::size_t>(seq)].rows;
            m.clear();
            const SeqState x = st.state(seq);
            FUZZ_CHECK(!x.started || x.restage_owed);
            (void)st.snapshot(seq);  // must be representable
        } else if (!before.empty()) {
            FUZZ_CHECK(st.snapshot(seq) == before);
        }
        const bool header_patch = !(damage % 8 == 7 || snaps.empty()) && damage % 8 >= 4 && damage % 8 <= 6;
        restore_external(seq, data, ok, header_patch);
        log_replay(seq, [seq, data](Stager& x) {
            std::string r = std::to_string(outcome_of([&] { x.restore(seq, data.data(), data.size()); }));
            if (r == "0") {
                const auto snap = x.snapshot(seq);
                r.append(reinterpret_cast<const char*>(snap.data()), snap.size());
            }
            return r;
        });
    }

    // The same bookkeeping as an external-row snapshot: the content flag set,
    // the rows dropped, the checksums fixed.
    static std::vector<std::uint8_t> as_external(std::vector<std::uint8_t> d) {
        constexpr std::size_t HEADER = 96, CONTENT_FLAGS = 14;
        if (d.size() < HEADER) return d;
        d.resize(HEADER);
        d[CONTENT_FLAGS] |= 1;
        dspark_fuzz::fix_crc(d);
        return d;
    }

    // The owner's restore: a snapshot the held Stager took restores into the
    // external twin as bookkeeping, and its rows go to the slots returned. A
    // rewritten header field must be rejected by both modes alike.
    void restore_external(std::int64_t seq, const std::vector<std::uint8_t>& data, bool held_ok, bool must_agree) {
        if (held_ok) {
            // A version-1 blob has no v2 header to convert: take the held Stager's state now.
            const bool v2 = data.size() >= 96 && data[4] == 2 && data[5] == 0;
            const std::vector<std::uint8_t> src = v2 ? data : st.snapshot(seq);
            const std::vector<std::uint8_t> x = as_external(src);
            SlotRun runs[2];
            if (ext_attempt([&] { ext.restore(seq, x.data(), x.size(), runs); })) {
                FUZZ_CHECK(static_cast<std::size_t>(runs[0].count + runs[1].count) * rb + 96 == src.size());
                write_runs(runs, src.data() + 96);
            }
        } else if (must_agree || rejected_before_rows(seq)) {
            const std::vector<std::uint8_t> x = as_external(data);
            ext_attempt([&] { ext.restore(seq, x.data(), x.size()); });
        }
    }

    void op_round(Reader& r, std::int64_t seq) {
        const std::uint8_t close = r.u8(), nv = r.u8(), acc = r.u8(), rounds = r.u8();
        const std::int64_t B = o.block_size;
        for (int k = 0; k < 1 + rounds % 6; ++k) {
            const std::int64_t end = end_of(seq);
            RoundPlan p;
            if (draft_both(seq, end, p)) {
                if (p.skip == Skip::None) {
                    if (close % 8 < 5 || k % 2) {
                        twin(seq, [seq](Stager& x) { x.commit(seq); });
                    } else if (close % 8 < 7) {
                        const auto stage = static_cast<FailStage>(close % 8 - 5);
                        twin(seq, [seq, stage](Stager& x) { x.fail(seq, stage); });
                    } else {
                        return;  // leave it open
                    }
                    FUZZ_CHECK(!st.state(seq).open_round);
                }
            }
            const std::size_t n = static_cast<std::size_t>(nv % 4 == 0 ? B + 1 : std::min<std::int64_t>(nv % 4, B + 1));
            process_rows(seq, n, 0);
            const std::int64_t a = (acc + 3 * k) % (B + 1);
            twin(seq, [seq, a](Stager& y) { y.accept(seq, a); });
        }
    }

    // Contiguous float rows at the sequence's end, on both twins (the rows of
    // op_round and op_long_decode: ordinary activations from a seed).
    bool process_rows(std::int64_t seq, std::size_t n, std::uint8_t seed) {
        const std::int64_t end = end_of(seq);
        const std::uint8_t bytes[3] = {0, seed, 0};  // fill, seed, no special value
        Reader rr(bytes, sizeof bytes);
        std::vector<float> x = make_rows(n, rr);
        std::vector<std::int64_t> pos(n);
        for (std::size_t i = 0; i < n; ++i) pos[i] = end + static_cast<std::int64_t>(i);
        std::vector<std::uint8_t> enc(n * rb);
        if (n) encode_rows(x.data(), ElemType::F32, enc.data(), o.storage, n, static_cast<std::size_t>(o.feature_dim),
                           o.nonfinite, encode_bounds(o.storage, o.stage));
        const bool ok = attempt([&] { st.process(seq, pos.data(), n, x.data(), ElemType::F32); });
        if (ok) record(seq, pos, enc.data());
        process_external(seq, pos, enc, ok);
        log_replay(seq, [seq, pos, x](Stager& y) {
            return std::to_string(outcome_of([&] { y.process(seq, pos.data(), pos.size(), x.data(), ElemType::F32); }));
        });
        return ok;
    }

    // Enough chunks of W / 2 rows to pass the whole ring once: rows stay live
    // across the ring's end, so plans, live slots, forks and shifts see two runs.
    void op_long_decode(std::int64_t seq, std::uint8_t b) {
        const std::size_t chunk = static_cast<std::size_t>(std::max<std::int64_t>(1, o.window / 2));
        const std::size_t chunks = static_cast<std::size_t>(ext.ring_rows()) / chunk + 1 + (b >> 2) % 4;
        for (std::size_t k = 0; k < chunks; ++k)
            if (!process_rows(seq, chunk, static_cast<std::uint8_t>(b + k))) return;
    }

    // A call with no result to compare but its outcome, on both twins (and
    // logged for the thread replay when it concerns one sequence).
    bool twin(std::int64_t seq, const std::function<void(Stager&)>& fn) {
        const bool ok = attempt([&] { fn(st); });
        ext_attempt([&] { fn(ext); });
        log_replay(seq, [fn](Stager& x) { return std::to_string(outcome_of([&] { fn(x); })); });
        return ok;
    }

    void step(Reader& r) {
        const std::uint8_t code = r.u8();
        const std::int64_t seq = seq_of(r.u8());
        switch (code % 16) {
            case 0: twin(seq, [seq](Stager& x) { x.begin(seq); }); if (valid(seq) && !st.state(seq).open_round) shadow[seq].rows.clear(); break;
            case 1: case 2: op_process(r, seq, r.u8() % 13); break;
            case 3: {
                const std::uint8_t b = r.u8();
                if (b % 4 == 3) {  // a long decode in chunks of W / 2 rows: the ring wraps (held rows stay live)
                    op_long_decode(seq, b);
                    break;
                }
                // a long prefill, past the window and a trim chunk
                op_process(r, seq, static_cast<std::size_t>(o.window + (b % 2 ? TRIM_CHUNK : 1) + b % 64));
                break;
            }
            case 4: op_process_encoded(r, seq); break;
            case 5: op_draft(seq, n_past_of(seq, r.u8())); break;
            case 6: op_draft_many(r); break;
            case 7: twin(seq, [seq](Stager& x) { x.commit(seq); }); if (valid(seq)) FUZZ_CHECK(!st.state(seq).open_round); break;
            case 8: {
                const std::uint8_t b = r.u8();
                const auto stage = static_cast<FailStage>(b % 4);
                twin(seq, [seq, stage](Stager& x) { x.fail(seq, stage); });
                if (valid(seq) && b % 4 < 2) FUZZ_CHECK(!st.state(seq).open_round);
                break;
            }
            case 9: {
                const std::uint8_t b = r.u8();
                const std::int64_t n = b == 255 ? std::numeric_limits<std::int64_t>::max() : static_cast<std::int64_t>(b % 12) - 1;
                twin(seq, [seq, n](Stager& x) { x.accept(seq, n); });
                break;
            }
            case 10: {
                const std::uint8_t b = r.u8();
                const std::int64_t end = end_of(seq);
                const std::int64_t np = b >= 250 ? (b == 250 ? -1 : b == 251 ? MAXP : 0) : std::max<std::int64_t>(0, end - (b % 42 - 2));
                twin(seq, [seq, np](Stager& x) { x.rollback(seq, np); });
                break;
            }
            case 11: {
                const std::uint8_t a = r.u8(), b = r.u8(), mode = r.u8();
                const std::int64_t end = end_of(seq);
                std::int64_t keep = a * (end + 1) / 256, discard = b * (end - keep + 1) / 256;
                if (mode % 8 == 5) keep = -1;
                if (mode % 8 == 6) discard = end - keep + 1;
                if (mode % 8 == 7) discard = MAXP - 1, keep = MAXP - 1;
                std::vector<SlotMove> hm, xm;
                const bool ok = attempt([&] { hm = st.shift(seq, keep, discard); });
                if (ext_attempt([&] { xm = ext.shift(seq, keep, discard); })) {
                    FUZZ_CHECK(same_moves(hm, xm));
                    apply(xm);
                }
                log_replay(seq, [seq, keep, discard](Stager& x) {
                    std::vector<SlotMove> m;
                    std::string out = std::to_string(outcome_of([&] { m = x.shift(seq, keep, discard); }));
                    for (const SlotMove& v : m) put_pod(out, v);
                    return out;
                });
                if (ok && discard > 0) {
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
                std::vector<SlotMove> hm, xm;
                if (attempt([&] { hm = st.fork(seq, dst); }) && valid(dst)) shadow[dst].rows = shadow[seq].rows;
                if (ext_attempt([&] { xm = ext.fork(seq, dst); })) {
                    FUZZ_CHECK(same_moves(hm, xm));
                    apply(xm);
                }
                break;
            }
            case 13:
                attempt([&] { snaps.push_back(st.snapshot(seq)); });
                ext_attempt([&] { (void)ext.snapshot(seq); });
                if (snaps.size() > 8) snaps.erase(snaps.begin());
                break;
            case 14: op_restore(r, seq); break;
            default: op_round(r, seq); break;
        }
    }
};

// The recorded single-sequence calls, replayed serially on one Stager and
// from two threads (sequences split by parity) on another: calls on different
// sequences commute, so every call must end as in the serial replay and every
// sequence's final state and snapshot bytes must be the serial ones. (A
// missing lock, a shared buffer handed to two calls, a torn ring would show
// as a different plan, rows or snapshot, or as a sanitizer report.)
void thread_replay(const StagerOptions& o, const std::vector<Replay>& calls) {
    Stager serial(o), threaded(o);
    std::vector<std::string> want(calls.size()), got(calls.size());
    for (std::size_t i = 0; i < calls.size(); ++i) want[i] = calls[i].run(serial);
    auto worker = [&](std::int64_t parity) {
        for (std::size_t i = 0; i < calls.size(); ++i)
            if (calls[i].seq % 2 == parity) got[i] = calls[i].run(threaded);
    };
    std::thread even(worker, 0), odd(worker, 1);
    even.join();
    odd.join();
    for (std::size_t i = 0; i < calls.size(); ++i) {
        if (got[i] != want[i])
            std::fprintf(stderr, "call %zu (sequence %lld): threads gave outcome %c, the serial replay %c\n", i,
                         static_cast<long long>(calls[i].seq), got[i].empty() ? '?' : got[i][0],
                         want[i].empty() ? '?' : want[i][0]);
        FUZZ_CHECK(got[i] == want[i]);
    }
    for (std::int64_t s = 0; s < o.max_seqs; ++s) {
        FUZZ_CHECK(same_state(serial.state(s), threaded.state(s)));
        FUZZ_CHECK(same_stats(serial.stats(s), threaded.stats(s)));
        if (!serial.state(s).open_round) FUZZ_CHECK(serial.snapshot(s) == threaded.snapshot(s));
    }
}

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
    h.record_replays = b3 >= 128 && o.max_seqs >= 2;
    int ops = 0;
    while (r.more() && ops++ < 96) {
        h.step(r);
        h.check_mirror();
    }
    if (h.record_replays) thread_replay(o, h.replays);
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
        // The owner's side: save the rows at the live slots, restore the
        // bookkeeping, put the rows back where restore says.
        SlotRun live[2], runs[2];
        h.ext.live_slots(s, live);
        std::vector<std::uint8_t> saved;
        for (const SlotRun& run : live)
            for (std::int64_t i = 0; i < run.count; ++i)
                saved.insert(saved.end(), h.slot_row(run.first + i), h.slot_row(run.first + i) + h.rb);
        const auto xsnap = h.ext.snapshot(s);
        h.ext.restore(s, xsnap.data(), xsnap.size(), runs);
        FUZZ_CHECK(static_cast<std::size_t>(runs[0].count + runs[1].count) * h.rb == saved.size());
        h.write_runs(runs, saved.data());
    }
    h.check_mirror();
    return 0;
}
