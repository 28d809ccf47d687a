// The device step's CPU twin (Stager::step_many over dspark/step_math.hpp)
// against its oracle, the per-sequence core: a second Stager driven by
// confirm, accept, draft, commit / fail and reserve. A seeded random
// differential over thousands of steps (N = 1..256, every storage, window
// crossings, rebases, ring wraps, trims, sequences handed over and back at
// random, cancels, rollbacks, bad entries) compares every plan, slot and
// status word, and after each hand-back state(), stats(), live_slots() and
// snapshot bytes. Fixed tests pin the window rule's boundary and the accept
// arithmetic (each kills its mutant of step_math.hpp), the refusals of
// host-only calls, and the atomicity of rejected calls. A chain drafter's
// Stager runs the same differential with its token ids handed over by slot
// (the slot token table): the test writes each verify row's id at its
// verify slot, as a server does, and every hand-back compares the ids too.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.hpp"
#include "dspark/errors.hpp"
#include "dspark/stager.hpp"

using namespace dspark;
using i64 = std::int64_t;

namespace {

StagerOptions options(i64 n, i64 block, i64 window, Storage storage, DrafterKind kind = DrafterKind::Block) {
    StagerOptions o;
    o.kind = kind;
    o.feature_dim = 32;  // whole q blocks
    o.block_size = block;
    o.window = window;
    o.max_seqs = n;
    o.storage = storage;
    o.rows = RowMode::External;
    o.max_failures = 3;
    return o;
}

// One step's answers for n entries, in the padded layout.
struct StepOut {
    std::vector<std::int32_t> status, skip, flags, row_pos, block_pos;
    std::vector<i64> start, pos_base, crop_from, n_rows, row_slots, verify;
    device_step::Outputs out;
    StepOut(const Stager& st, std::size_t n) {
        const auto c = st.step_config();
        const std::size_t mr = static_cast<std::size_t>(c.max_rows), b = static_cast<std::size_t>(c.block);
        status.assign(n, 99);
        skip.assign(n, 99);
        flags.assign(n, 99);
        start.assign(n, 99);
        pos_base.assign(n, 99);
        crop_from.assign(n, 99);
        n_rows.assign(n, 99);
        row_slots.assign(n * mr, 99);
        row_pos.assign(n * mr, 99);
        block_pos.assign(n * b, 99);
        verify.assign(n * (b + 1), 99);
        out.status = status.data();
        out.skip = skip.data();
        out.flags = flags.data();
        out.start = start.data();
        out.pos_base = pos_base.data();
        out.crop_from = crop_from.data();
        out.n_rows = n_rows.data();
        out.row_slots = row_slots.data();
        out.row_positions = row_pos.data();
        out.block_positions = block_pos.data();
        out.verify_slots = verify.data();
    }
};

// What one sequence's step is in per-sequence calls (the oracle): the
// plan, the verify rows' slots (padded to B + 1 with -1).
struct Expected {
    RoundPlan plan;
    std::vector<i64> verify;
};

// The token id of a row at a position (a chain drafter's Stager), or null.
using IdFn = std::function<std::int32_t(i64)>;

// confirm, accept(a), draft(end), commit or fail(stage) (fail_stage: -1 =
// commit), reserve [end, end + B] (only [end] after a skip), with the ids
// id(p) of the reserved rows when given.
Expected host_step(Stager& st, i64 seq, i64 a, int fail_stage, const IdFn& id = nullptr) {
    const i64 b = st.options().block_size;
    if (st.state(seq).reservation_open) st.confirm(seq);
    st.accept(seq, a);
    ByteVec rows;
    Expected e;
    e.plan = st.draft(seq, st.state(seq).end, rows);
    if (e.plan.skip == Skip::None) {
        if (fail_stage < 0) st.commit(seq);
        else st.fail(seq, static_cast<FailStage>(fail_stage));
    }
    const i64 nv = e.plan.skip == Skip::None ? b + 1 : 1;
    const i64 end = st.state(seq).end;
    std::vector<i64> pos(static_cast<std::size_t>(nv));
    for (i64 k = 0; k < nv; ++k) pos[static_cast<std::size_t>(k)] = end + k;
    e.verify.assign(static_cast<std::size_t>(b + 1), -1);
    std::vector<std::int32_t> ids;
    for (i64 p : pos)
        if (id) ids.push_back(id(p));
    st.reserve(seq, pos.data(), pos.size(), e.verify.data(), id ? ids.data() : nullptr);
    return e;
}

// Entry i of a step against the oracle's plan.
bool same_entry(const Stager& st, const StepOut& o, std::size_t i, const Expected& e) {
    const auto c = st.step_config();
    const std::size_t mr = static_cast<std::size_t>(c.max_rows), b = static_cast<std::size_t>(c.block);
    const RoundPlan& p = e.plan;
    bool ok = o.status[i] == device_step::STATUS_OK && o.skip[i] == static_cast<std::int32_t>(p.skip) &&
              o.flags[i] == ((p.rebase ? device_step::PLAN_REBASE : 0) | (p.clear_cache ? device_step::PLAN_CLEAR_CACHE : 0)) &&
              o.start[i] == p.start && o.pos_base[i] == p.pos_base && o.crop_from[i] == p.crop_from &&
              o.n_rows[i] == p.n_rows;
    // The plan's rows, padded as the step lays them out (plan_rows, then pad_rows).
    const std::size_t n = static_cast<std::size_t>(p.n_rows);
    std::vector<std::int32_t> csr_pos(n), pos(mr);
    std::vector<i64> csr_slots(n), slots(mr), offsets(2);
    plan_rows(&p, 1, offsets.data(), csr_pos.data(), csr_slots.data());
    pad_rows(&p.seq, 1, offsets.data(), csr_pos.data(), n, mr, pos.data());
    pad_rows(&p.seq, 1, offsets.data(), csr_slots.data(), n, mr, slots.data());
    for (std::size_t k = 0; k < mr; ++k)
        ok = ok && o.row_pos[i * mr + k] == pos[k] && o.row_slots[i * mr + k] == slots[k];
    for (std::size_t k = 0; k < b; ++k)
        ok = ok && o.block_pos[i * b + k] ==
                       (p.skip == Skip::None ? static_cast<std::int32_t>(p.start - p.pos_base + static_cast<i64>(k)) : -1);
    for (std::size_t k = 0; k <= b; ++k) ok = ok && o.verify[i * (b + 1) + k] == e.verify[k];
    return ok;
}

// An entry that was not stepped reads as nothing.
bool nothing(const Stager& st, const StepOut& o, std::size_t i) {
    const auto c = st.step_config();
    const std::size_t mr = static_cast<std::size_t>(c.max_rows), b = static_cast<std::size_t>(c.block);
    bool ok = o.skip[i] == device_step::NOT_STEPPED && o.flags[i] == 0 && o.start[i] == -1 && o.pos_base[i] == -1 &&
              o.crop_from[i] == -1 && o.n_rows[i] == 0;
    for (std::size_t k = 0; k < mr; ++k) ok = ok && o.row_pos[i * mr + k] == -1 && o.row_slots[i * mr + k] == -1;
    for (std::size_t k = 0; k < b; ++k) ok = ok && o.block_pos[i * b + k] == -1;
    for (std::size_t k = 0; k <= b; ++k) ok = ok && o.verify[i * (b + 1) + k] == -1;
    return ok;
}

template <class T>
bool same_fields(const T& x, const T& y, const FieldInfo* table, const char* what, i64 seq) {
    bool ok = true;
    for (const FieldInfo* f = table; f->name; ++f) {
        const auto* px = reinterpret_cast<const std::uint8_t*>(&x) + f->offset;
        const auto* py = reinterpret_cast<const std::uint8_t*>(&y) + f->offset;
        const bool eq = f->is_bool ? *reinterpret_cast<const bool*>(px) == *reinterpret_cast<const bool*>(py)
                                   : std::memcmp(px, py, sizeof(i64)) == 0;
        if (!eq) {
            long long vx = f->is_bool ? *reinterpret_cast<const bool*>(px) : *reinterpret_cast<const i64*>(px);
            long long vy = f->is_bool ? *reinterpret_cast<const bool*>(py) : *reinterpret_cast<const i64*>(py);
            std::printf("  sequence %lld: %s.%s differs: %lld vs %lld\n", static_cast<long long>(seq), what, f->name,
                        vx, vy);
            ok = false;
        }
    }
    return ok;
}

// state(), stats(), live_slots() and (when ready) the snapshot bytes of seq.
bool same_seq(const Stager& a, const Stager& b, i64 seq) {
    bool ok = same_fields(a.state(seq), b.state(seq), SEQ_STATE_FIELDS, "state", seq) &&
              same_fields(a.stats(seq), b.stats(seq), SEQ_STATS_FIELDS, "stats", seq) &&
              a.accepted(seq) == b.accepted(seq);
    SlotRun ra[2], rb[2];
    a.live_slots(seq, ra);
    b.live_slots(seq, rb);
    for (int k = 0; k < 2; ++k) ok = ok && ra[k].first == rb[k].first && ra[k].count == rb[k].count;
    if (!a.state(seq).reservation_open && !a.state(seq).open_round) ok = ok && a.snapshot(seq) == b.snapshot(seq);
    if (ok && a.options().kind == DrafterKind::Chain) {
        const SeqState st = a.state(seq);
        std::vector<std::int32_t> ta(static_cast<std::size_t>(st.end - st.horizon)), tb(ta.size());
        a.tokens(seq, st.horizon, st.end, ta.data());
        b.tokens(seq, st.horizon, st.end, tb.data());
        if (ta != tb) {
            std::printf("  sequence %lld: the token ids differ\n", static_cast<long long>(seq));
            ok = false;
        }
    }
    return ok;
}

void prompt(Stager& st, i64 seq, i64 p0, i64 len, std::vector<i64>* slots, const IdFn& id = nullptr) {
    std::vector<i64> pos(static_cast<std::size_t>(len)), out(static_cast<std::size_t>(len));
    std::vector<std::int32_t> ids;
    for (i64 k = 0; k < len; ++k) pos[static_cast<std::size_t>(k)] = p0 + k;
    for (i64 p : pos)
        if (id) ids.push_back(id(p));
    st.begin(seq);
    st.process_external(seq, pos.data(), pos.size(), out.data(), id ? ids.data() : nullptr);
    if (slots) *slots = out;
}

// The differential over one configuration. Every sequence lives on one of
// two Stagers' sides: `dev` (handed over: driven by step_many) or host
// (driven by host_step on both Stagers); `orc` is always driven by host_step.
struct Differential {
    Stager dev, orc;
    std::mt19937_64 rng;
    i64 n, b, w;
    std::vector<bool> on_dev;
    std::vector<int> pending_fail;  // the stage a device round failed at, -1: none
    int mismatches = 0;
    long steps = 0, rebases = 0, skips = 0, faults = 0, wraps = 0;
    // A chain drafter's Stager: the slot token table the device side's ids
    // travel in, and a generation per sequence, bumped by each step and
    // prompt, in its rows' ids (a verify row at a position an accept freed
    // gets a new id, so an id left behind at a slot shows).
    bool chain;
    std::vector<std::int32_t> table;
    std::vector<i64> gen;
    std::vector<bool> cleared;  // a failed round's verify slots set to -1
    long refusals = 0;

    Differential(i64 n_, i64 b_, i64 w_, Storage s, std::uint64_t seed, DrafterKind kind)
        : dev(options(n_, b_, w_, s, kind)), orc(options(n_, b_, w_, s, kind)), rng(seed), n(n_), b(b_), w(w_),
          on_dev(static_cast<std::size_t>(n_), false), pending_fail(static_cast<std::size_t>(n_), -1),
          chain(kind == DrafterKind::Chain), gen(static_cast<std::size_t>(n_), 0),
          cleared(static_cast<std::size_t>(n_), false) {
        if (chain) table.assign(static_cast<std::size_t>(n * dev.ring_rows()), -5);
        for (i64 q = 0; q < n; ++q) {
            const i64 p0 = pick(0, 100), len = pick(1, 3 * w);
            std::vector<i64> sa, sb;
            prompt(dev, q, p0, len, &sa, ids(q));
            prompt(orc, q, p0, len, &sb, ids(q));
            if (sa != sb) ++mismatches;
        }
    }
    // Sequence q's row ids in its current generation (null: block drafter).
    IdFn ids(i64 q) const {
        if (!chain) return nullptr;
        const auto g = static_cast<std::uint64_t>(gen[static_cast<std::size_t>(q)]);
        return [g, q](i64 p) {
            return static_cast<std::int32_t>((g * 1000003u + static_cast<std::uint64_t>(p) * 31u +
                                              static_cast<std::uint64_t>(q)) % 2000000000u);
        };
    }
    std::int32_t* tokens() { return chain ? table.data() : nullptr; }
    std::size_t n_tokens() const { return table.size(); }
    i64 pick(i64 lo, i64 hi) { return std::uniform_int_distribution<i64>(lo, hi)(rng); }
    bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }

    void hand_back(const std::vector<i64>& seqs, bool expect_fault) {
        std::vector<std::int32_t> outcomes;
        for (i64 q : seqs) outcomes.push_back(static_cast<std::int32_t>(pending_fail[static_cast<std::size_t>(q)]));
        std::vector<i64> disabled(seqs.size(), -7);
        bool threw = false;
        try {
            dev.to_host(seqs.data(), seqs.size(), outcomes.data(), disabled.data(), tokens(), n_tokens());
        } catch (const std::invalid_argument&) {
            threw = true;
        }
        if (threw != expect_fault) ++mismatches;
        for (i64 q : seqs) {
            on_dev[static_cast<std::size_t>(q)] = false;
            // A chain drafter's failed round never wrote its verify rows' ids
            // (their slots hold what an earlier round left, or the -1 the
            // test wrote there: confirm refuses those, changing nothing);
            // the server cancels.
            if (chain && pending_fail[static_cast<std::size_t>(q)] >= 0) {
                if (cleared[static_cast<std::size_t>(q)]) {
                    const SeqState before = dev.state(q);
                    bool refused = false;
                    try {
                        dev.confirm(q);
                    } catch (const std::invalid_argument&) {
                        refused = true;
                    }
                    if (!refused || !dev.state(q).reservation_open ||
                        !same_fields(before, dev.state(q), SEQ_STATE_FIELDS, "state", q))
                        ++mismatches;
                    refusals += refused;
                }
                dev.cancel(q);
                orc.cancel(q);
            }
            cleared[static_cast<std::size_t>(q)] = false;
            pending_fail[static_cast<std::size_t>(q)] = -1;
            if (!same_seq(dev, orc, q)) ++mismatches;
        }
        // A cancel puts back the fields the device saved before its reservation.
        for (i64 q : seqs)
            if (dev.state(q).reservation_open && chance(0.2)) {
                dev.cancel(q);
                orc.cancel(q);
                if (!same_seq(dev, orc, q)) ++mismatches;
            }
    }

    // confirm, accept, draft on both; the oracle commits at once.
    void half_step(i64 q) {
        const i64 a = pick(0, b);
        RoundPlan p[2];
        int k = 0;
        for (Stager* st : {&dev, &orc}) {
            if (st->state(q).reservation_open) st->confirm(q);
            st->accept(q, a);
            ByteVec rows;
            p[k++] = st->draft(q, st->state(q).end, rows);
        }
        if (p[0].n_rows != p[1].n_rows || p[0].rebase != p[1].rebase) ++mismatches;
        if (p[1].skip == Skip::None) orc.commit(q);
    }

    // Host-only events on host sequences: a rollback (restage owed, the
    // rows the drafter cached dropped) or a begin with a new prompt.
    void host_event(i64 q) {
        for (Stager* st : {&dev, &orc})
            if (st->state(q).reservation_open) st->confirm(q);
        const SeqState s = orc.state(q);
        if (chance(0.5) && s.end > s.horizon + 1) {
            const i64 to = pick(std::max(s.horizon, s.end - 2 * b), s.end - 1);
            dev.rollback(q, to);
            orc.rollback(q, to);
        } else {
            const i64 p0 = pick(0, 50), len = pick(1, 2 * w);
            gen[static_cast<std::size_t>(q)] += 1;
            prompt(dev, q, p0, len, nullptr, ids(q));
            prompt(orc, q, p0, len, nullptr, ids(q));
        }
        if (!same_seq(dev, orc, q)) ++mismatches;
    }

    void run(int n_steps) {
        for (int t = 0; t < n_steps; ++t) {
            // Hand over and back at random (a sequence with a failed round
            // went back right after its step).
            std::vector<i64> to_dev, to_back;
            for (i64 q = 0; q < n; ++q) {
                const auto u = static_cast<std::size_t>(q);
                if (!on_dev[u] && !orc.state(q).disabled && chance(0.15)) to_dev.push_back(q);
                else if (on_dev[u] && chance(0.03)) to_back.push_back(q);
            }
            std::shuffle(to_dev.begin(), to_dev.end(), rng);
            if (!to_back.empty()) hand_back(to_back, false);
            // Some go over with a round open (drafted, not committed): the
            // device's next step (or to_host) commits it; the oracle now.
            for (i64 q : to_dev)
                if (chance(0.3)) half_step(q);
            if (!to_dev.empty()) {
                dev.to_device(to_dev.data(), to_dev.size(), tokens(), n_tokens());
                for (i64 q : to_dev) on_dev[static_cast<std::size_t>(q)] = true;
            }
            // The step's batch: device sequences in random order, some sitting
            // out (-1), sometimes a host sequence, an unknown id, a repeat or a
            // bad count (status words).
            std::vector<i64> seqs, counts;
            std::vector<int> kind;  // 0: stepped, 1: not in step, 2: status error, 3: bad count
            for (i64 q = 0; q < n; ++q)
                if (on_dev[static_cast<std::size_t>(q)]) {
                    seqs.push_back(q);
                    const bool out = chance(0.1);
                    counts.push_back(out ? -1 : pick(0, b));
                    kind.push_back(out ? 1 : 0);
                }
            for (std::size_t i = seqs.size(); i > 1; --i) {
                const std::size_t j = static_cast<std::size_t>(pick(0, static_cast<i64>(i) - 1));
                std::swap(seqs[i - 1], seqs[j]);
                std::swap(counts[i - 1], counts[j]);
                std::swap(kind[i - 1], kind[j]);
            }
            if (chance(0.05)) {  // an unknown id
                seqs.push_back(chance(0.5) ? n + pick(0, 3) : -1 - pick(0, 3));
                counts.push_back(0);
                kind.push_back(2);
            }
            if (chance(0.05) && !seqs.empty() && kind[0] != 3) {  // a repeat of the first entry
                seqs.push_back(seqs[0]);
                counts.push_back(0);
                kind.push_back(2);
            }
            for (i64 q = 0; q < n && chance(0.1); ++q)  // a host sequence
                if (!on_dev[static_cast<std::size_t>(q)]) {
                    seqs.push_back(q);
                    counts.push_back(0);
                    kind.push_back(2);
                    break;
                }
            if (chance(0.01) && !seqs.empty() && kind[0] == 0) {  // a bad count: a sticky fault
                counts[0] = chance(0.5) ? b + 1 + pick(0, 5) : -2 - pick(0, 5);
                kind[0] = 3;
            }
            StepOut o(dev, seqs.size());
            dev.step_many(seqs.data(), counts.data(), seqs.size(), o.out);
            ++steps;
            std::vector<i64> faulted, failed;
            for (std::size_t i = 0; i < seqs.size(); ++i) {
                const i64 q = seqs[i];
                if (kind[i] == 0) {
                    const int stage = chance(0.05) ? static_cast<int>(pick(0, 1)) : -1;
                    gen[static_cast<std::size_t>(q)] += 1;
                    const Expected e = host_step(orc, q, counts[i], stage, ids(q));
                    // The server's verify batch: its ids at the verify slots
                    // (a round whose drafter failed builds none).
                    const bool drafted_failed = stage >= 0 && e.plan.skip == Skip::None;
                    const bool clear = drafted_failed && chance(0.5);
                    cleared[static_cast<std::size_t>(q)] = clear;
                    if (chain && (!drafted_failed || clear) && o.status[i] == device_step::STATUS_OK)
                        for (i64 k = 0; k <= b; ++k) {
                            const i64 g = o.verify[i * static_cast<std::size_t>(b + 1) + static_cast<std::size_t>(k)];
                            if (g >= 0) table[static_cast<std::size_t>(g)] = clear ? -1 : ids(q)(o.start[i] + k);
                        }
                    if (!same_entry(dev, o, i, e)) {
                        if (mismatches < 5)
                            std::printf("  step %d entry %zu (sequence %lld, a=%lld): status %d plan differs\n", t, i,
                                        static_cast<long long>(q), static_cast<long long>(counts[i]), o.status[i]);
                        ++mismatches;
                    }
                    if (e.plan.rebase) ++rebases;
                    if (e.plan.skip != Skip::None) ++skips;
                    bool wrapped = e.plan.slot_runs[1].count > 0;
                    for (std::size_t k = 1; k < e.verify.size(); ++k)
                        wrapped = wrapped || (e.verify[k] >= 0 && e.verify[k] < e.verify[k - 1]);
                    if (wrapped) ++wraps;
                    if (stage >= 0 && e.plan.skip == Skip::None) {
                        pending_fail[static_cast<std::size_t>(q)] = stage;
                        failed.push_back(q);
                    }
                } else {
                    const std::int32_t want = kind[i] == 1 ? device_step::STATUS_NOT_IN_STEP
                                              : kind[i] == 3 ? device_step::STATUS_BAD_COUNT
                                                             : o.status[i];
                    if (o.status[i] != want || !nothing(dev, o, i)) ++mismatches;
                    if (kind[i] == 2 && o.status[i] != device_step::STATUS_NOT_ON_DEVICE &&
                        o.status[i] != device_step::STATUS_DUPLICATE)
                        ++mismatches;
                    if (kind[i] == 3) faulted.push_back(q);
                }
            }
            // Statuses raise the core's errors; OK ones do not.
            bool any_error = false;
            for (std::int32_t s : o.status) any_error = any_error || s >= device_step::STATUS_FIRST_ERROR;
            bool threw = false;
            try {
                dev.check_step(seqs.data(), o.status.data(), seqs.size());
            } catch (const std::exception&) {
                threw = true;
            }
            if (threw != any_error) ++mismatches;
            if (!failed.empty()) hand_back(failed, false);
            if (!faulted.empty()) {
                faults += 1;
                hand_back(faulted, true);
            }
            // Host sequences take their steps by per-sequence calls on both.
            for (i64 q = 0; q < n; ++q) {
                if (on_dev[static_cast<std::size_t>(q)]) continue;
                if (chance(0.03)) {
                    host_event(q);
                    continue;
                }
                if (orc.state(q).disabled) continue;
                const i64 a = pick(0, b);
                const int stage = chance(0.05) ? static_cast<int>(pick(0, 1)) : -1;
                gen[static_cast<std::size_t>(q)] += 1;
                const Expected x = host_step(dev, q, a, stage, ids(q)), y = host_step(orc, q, a, stage, ids(q));
                if (x.verify != y.verify || x.plan.n_rows != y.plan.n_rows) ++mismatches;
            }
        }
        std::vector<i64> all;
        for (i64 q = 0; q < n; ++q)
            if (on_dev[static_cast<std::size_t>(q)]) all.push_back(q);
        if (!all.empty()) hand_back(all, false);
        for (i64 q = 0; q < n; ++q)
            for (Stager* st : {&dev, &orc})
                if (st->state(q).reservation_open) st->confirm(q);
        for (i64 q = 0; q < n; ++q)
            if (!same_seq(dev, orc, q)) ++mismatches;
        // The Stagers' metrics: the histograms the steps counted on the
        // device equal the host calls' (and they counted some).
        const StagerTotals td = dev.totals(), to = orc.totals();
        if (td.accepted != to.accepted || !same_fields(td.stats, to.stats, SEQ_STATS_FIELDS, "totals", -1))
            ++mismatches;
        if (to.stats.verified_rounds == 0) ++mismatches;
    }
};

void differential(i64 n, i64 b, i64 w, Storage s, std::uint64_t seed, int n_steps,
                  DrafterKind kind = DrafterKind::Block) {
    Differential d(n, b, w, s, seed, kind);
    d.run(n_steps);
    std::printf("  N=%lld B=%lld W=%lld %s%s: %ld steps, %ld rebases, %ld skips, %ld wraps, %ld faults\n",
                static_cast<long long>(n), static_cast<long long>(b), static_cast<long long>(w), storage_name(s),
                d.chain ? " chain" : "", d.steps, d.rebases, d.skips, d.wraps, d.faults);
    CHECK_EQ(d.mismatches, 0);
    CHECK(!d.chain || d.refusals > 0);
    CHECK(d.rebases > 0);
    CHECK(d.wraps > 0);
}

// A Stager with sequence 0 started at position 0 with `len` prompt rows.
void start(Stager& st, i64 len) { prompt(st, 0, 0, len, nullptr); }

// Runs one step of sequence 0 with count a on `dev`, and its oracle on `orc`.
// Sequence 0 started with n rows on both Stagers, handed over on dev; returns its id.
i64 start_pair(Stager& dev, Stager& orc, i64 n) {
    start(dev, n);
    start(orc, n);
    const i64 seq = 0;
    dev.to_device(&seq, 1);
    return seq;
}

bool step_both(Stager& dev, Stager& orc, i64 a, StepOut* keep = nullptr) {
    const i64 seq = 0;
    StepOut o(dev, 1);
    dev.step_many(&seq, &a, 1, o.out);
    const Expected e = host_step(orc, seq, a, -1);
    if (keep) *keep = o;
    return same_entry(dev, o, 0, e);
}

}  // namespace

TEST_CASE(differential_all_storages) {
    differential(1, 1, 3, Storage::F32, 1, 4000);
    differential(7, 4, 16, Storage::F16, 2, 900);
    differential(64, 3, 11, Storage::BF16, 3, 600);
    differential(33, 2, 9, Storage::Q4_0, 4, 700);
    differential(256, 8, 40, Storage::Q8_0, 5, 300);
}

TEST_CASE(differential_chain_drafter) {
    differential(1, 1, 3, Storage::F32, 11, 3000, DrafterKind::Chain);
    differential(7, 4, 16, Storage::F16, 12, 900, DrafterKind::Chain);
    differential(64, 3, 11, Storage::Q8_0, 13, 500, DrafterKind::Chain);
}

// The window rule's boundary: a round whose block ends exactly at the
// window's last position (start - pos_base + B == W) does not rebase; one
// more row does. B = 2, W = 7: from the first round (pos_base 0) on, each
// step accepting 0 adds one row; the rounds at start 5 and 6 straddle it.
TEST_CASE(rebase_boundary) {
    Stager dev(options(1, 2, 7, Storage::F32)), orc(options(1, 2, 7, Storage::F32));
    const i64 seq = start_pair(dev, orc, 3);
    std::vector<bool> rebased;
    for (int t = 0; t < 6; ++t) {
        StepOut o(dev, 1);
        CHECK(step_both(dev, orc, 0, &o));
        rebased.push_back((o.flags[0] & device_step::PLAN_REBASE) != 0);
        CHECK_EQ(o.start[0], 3 + t);
    }
    // start 3 (first round: clear_cache, no rebase), 4, 5 (5 - 0 + 2 == 7
    // == W: fits), 6 (8 > W: rebase to pos_base 3), 7, 8 (8 - 3 + 2 == W).
    const std::vector<bool> want = {false, false, false, true, false, false};
    CHECK(rebased == want);
    dev.to_host(&seq, 1);
    if (orc.state(0).reservation_open) orc.confirm(0);
    if (dev.state(0).reservation_open) dev.confirm(0);
    CHECK(same_seq(dev, orc, 0));
}

// A sequence restored from a snapshot owes its drafter a restage (the new
// slot's cache is unknown): the next step rebases although its rows fit the
// window (the rebase condition's restage_owed term; without it the step would
// plan an ordinary round on a cache that is not there).
TEST_CASE(restage_owed_rebases_the_next_step) {
    Stager dev(options(1, 2, 32, Storage::F32)), orc(options(1, 2, 32, Storage::F32));
    const i64 seq = start_pair(dev, orc, 10);
    for (int t = 0; t < 3; ++t) {
        StepOut o(dev, 1);
        CHECK(step_both(dev, orc, 1, &o));
        CHECK((o.flags[0] & device_step::PLAN_REBASE) == 0);
    }
    dev.to_host(&seq, 1);
    for (Stager* s : {&dev, &orc}) {
        if (s->state(0).reservation_open) s->confirm(0);
        const auto snap = s->snapshot(0);
        s->restore(0, snap.data(), snap.size());
        CHECK(s->state(0).restage_owed);
    }
    dev.to_device(&seq, 1);
    StepOut o(dev, 1);
    CHECK(step_both(dev, orc, 1, &o));
    CHECK_EQ(o.skip[0], 0);
    CHECK((o.flags[0] & device_step::PLAN_REBASE) != 0);
    dev.to_host(&seq, 1);
    CHECK(!dev.state(0).restage_owed);
    if (orc.state(0).reservation_open) orc.confirm(0);
    if (dev.state(0).reservation_open) dev.confirm(0);
    CHECK(same_seq(dev, orc, 0));
}

// accept keeps n_accepted + 1 of the verify rows: every count 0..B, each
// checked by the next plan's start and, after a hand-back, the state.
TEST_CASE(accept_arithmetic) {
    const i64 b = 4;
    for (i64 a = 0; a <= b; ++a) {
        Stager dev(options(1, b, 32, Storage::F32)), orc(options(1, b, 32, Storage::F32));
        start(dev, 10);
        start(orc, 10);
        const i64 seq = 0;
        dev.to_device(&seq, 1);
        CHECK(step_both(dev, orc, 0));  // the first round: verify rows 10..14 reserved
        StepOut o(dev, 1);
        CHECK(step_both(dev, orc, a, &o));
        CHECK_EQ(o.start[0], 10 + a + 1);  // rows 10 .. 10 + a kept
        dev.to_host(&seq, 1);
        dev.confirm(0);
        orc.confirm(0);
        CHECK(same_seq(dev, orc, 0));
        CHECK_EQ(dev.state(0).end, 10 + a + 1 + b + 1);
    }
}

// A sequence on the device refuses every host call but end (which ends it) and the metrics (stats,
// accepted, totals: read from the step state), naming to_host.
TEST_CASE(host_calls_refused_on_device) {
    Stager st(options(2, 2, 9, Storage::F32));
    start(st, 5);
    const i64 seq = 0;
    st.to_device(&seq, 1);
    CHECK(st.on_device(0));
    i64 pos = 5, slot = 0;
    ByteVec rows;
    auto refused = [&](auto&& f) {
        try {
            f();
        } catch (const StateError& e) {
            return std::string(e.what()).find("to_host([0])") != std::string::npos;
        } catch (...) {
        }
        return false;
    };
    CHECK(refused([&] { st.process_external(0, &pos, 1, &slot); }));
    CHECK(refused([&] { st.reserve(0, &pos, 1, &slot); }));
    CHECK(refused([&] { st.accept(0, 0); }));
    CHECK(refused([&] { (void)st.draft(0, 5, rows); }));
    CHECK(refused([&] { st.begin(0); }));
    CHECK(refused([&] { st.rollback(0, 2); }));
    CHECK(refused([&] { (void)st.shift(0, 1, 1); }));
    CHECK(refused([&] { (void)st.fork(0, 1); }));
    CHECK(refused([&] { (void)st.fork(1, 0); }));
    CHECK(refused([&] { (void)st.snapshot(0); }));
    CHECK(refused([&] { (void)st.state(0); }));
    CHECK(refused([&] { (void)st.open_round_id(0); }));
    CHECK(refused([&] {
        SlotRun r[2];
        st.live_slots(0, r);
    }));
    // Every other host call, single and batched (a batch naming 0 among others
    // refuses as a whole: sequence 1, started, is left as it was).
    const auto snap_other = st.snapshot(1);
    // both: sequence 1 first (it passes every check of the call); zero_first where 1 has no
    // open round or reservation to act on, so that 0's refusal comes first.
    const i64 both[] = {1, 0}, zero_first[] = {0, 1}, counts[] = {0, 0}, offsets[] = {0, 0, 1}, past[] = {0, 5};
    const FailStage stages[] = {FailStage::Decode, FailStage::Decode};
    i64 slots2[2] = {0, 0}, disabled[2] = {0, 0};
    std::vector<RoundPlan> plans;
    CHECK(refused([&] { st.commit(0); }));
    CHECK(refused([&] { (void)st.fail(0, FailStage::Decode); }));
    CHECK(refused([&] { st.confirm(0); }));
    CHECK(refused([&] { st.cancel(0); }));
    CHECK(refused([&] { (void)st.snapshot_size(0); }));
    CHECK(refused([&] { (void)st.snapshot_into(0, nullptr, 0); }));
    CHECK(refused([&] { st.restore(0, snap_other.data(), snap_other.size()); }));
    CHECK(refused([&] { (void)st.check_restore(0, snap_other.data(), snap_other.size()); }));
    CHECK(refused([&] { st.accept_many(both, counts, 2); }));
    CHECK(refused([&] { st.commit_many(zero_first, 2); }));
    CHECK(refused([&] { st.fail_many(zero_first, stages, 2, disabled); }));
    CHECK(refused([&] { st.confirm_many(zero_first, 2); }));
    CHECK(refused([&] { st.cancel_many(zero_first, 2); }));
    CHECK(refused([&] { st.draft_many(both, past, 2, plans, rows); }));
    CHECK(refused([&] { st.process_external_many(both, 2, offsets, &pos, 1, slots2); }));
    CHECK(refused([&] { st.reserve_many(both, 2, offsets, &pos, 1, slots2); }));
    CHECK(refused([&] { st.check_process_many(both, 2, offsets, &pos, 1); }));
    // The drafting switch takes a handed-over sequence: it writes its step state's column.
    const i64 col = device_step::F_drafting_off * st.step_config().max_seqs;
    st.disable(0);
    CHECK_EQ(st.step_state()[col], 1);
    st.enable_many(both, 2);
    CHECK_EQ(st.step_state()[col], 0);
    CHECK(st.snapshot(1) == snap_other);
    // Sequence 1 is untouched by it.
    prompt(st, 1, 0, 4, nullptr);
    CHECK(!st.on_device(1));
    st.to_host(&seq, 1);
    CHECK(!st.on_device(0));
    CHECK_EQ(st.state(0).end, 5);
}

// Whether f throws std::invalid_argument whose message holds `what`.
template <class F>
bool throws_with(F&& f, const char* what) {
    try {
        f();
    } catch (const std::invalid_argument& e) {
        return std::string(e.what()).find(what) != std::string::npos;
    }
    return false;
}

// to_device and to_host check everything before they change anything.
TEST_CASE(rejected_hand_overs_change_nothing) {
    Stager st(options(4, 2, 9, Storage::F32)), held([] {
        StagerOptions o = options(1, 2, 9, Storage::F32);
        o.rows = RowMode::Held;
        return o;
    }());
    for (i64 q = 0; q < 3; ++q) prompt(st, q, 0, 6, nullptr);  // sequence 3 never started
    const std::vector<std::uint8_t> snap0 = st.snapshot(0);
    const i64 bad_tail[] = {0, 3};
    CHECK_THROWS(st.to_device(bad_tail, 2), StateError);  // 3 holds no rows
    CHECK(!st.on_device(0));
    const i64 repeat[] = {0, 1, 0};
    CHECK_THROWS(st.to_device(repeat, 3), std::invalid_argument);
    CHECK(!st.on_device(0) && !st.on_device(1));
    const i64 unknown[] = {0, 9};
    CHECK_THROWS(st.to_device(unknown, 2), std::invalid_argument);
    const i64 zero = 0;
    CHECK_THROWS(held.to_device(&zero, 1), std::invalid_argument);
    CHECK(st.snapshot(0) == snap0);
    // to_host: a valid part first, then a sequence not on the device.
    const i64 two[] = {0, 1};
    st.to_device(two, 2);
    const i64 back_bad[] = {0, 2};
    CHECK_THROWS(st.to_host(back_bad, 2), StateError);
    CHECK(st.on_device(0) && st.on_device(1));
    // A failure outcome needs an open round: sequence 0 has none yet.
    const std::int32_t fail_decode[] = {0, -1};
    CHECK_THROWS(st.to_host(two, 2, fail_decode), StateError);
    CHECK(st.on_device(0) && st.on_device(1));
    // A damaged step state is refused whole.
    i64* state = st.step_state();
    const auto c = st.step_config();
    const i64 saved = state[device_step::F_count * c.max_seqs + 1];
    state[device_step::F_count * c.max_seqs + 1] = c.ring_rows + 5;
    CHECK_THROWS(st.to_host(two, 2), std::invalid_argument);
    CHECK(st.on_device(0) && st.on_device(1));
    state[device_step::F_count * c.max_seqs + 1] = saved;
    // So is a negative histogram count, or a flag that is neither 0 nor 1.
    i64& bucket = state[(device_step::FIELD_COUNT + 2) * c.max_seqs + 1];
    bucket = -1;
    CHECK(throws_with([&] { st.to_host(two, 2); }, "a histogram count is negative"));
    CHECK(st.on_device(0) && st.on_device(1));
    bucket = 0;
    i64& owed = state[device_step::F_verify_owed * c.max_seqs + 0];
    owed = 2;
    CHECK(throws_with([&] { st.to_host(two, 2); }, "a flag is neither 0 nor 1"));
    CHECK(st.on_device(0) && st.on_device(1));
    owed = 0;
    st.to_host(two, 2);
    CHECK(st.snapshot(0) == snap0);
    // step_many in held mode, and without a status array.
    StepOut o(st, 1);
    i64 a = 0;
    CHECK_THROWS(held.step_many(&zero, &a, 1, o.out), std::invalid_argument);
    device_step::Outputs none;
    CHECK_THROWS(st.step_many(&zero, &a, 1, none), std::invalid_argument);
}

// A bad count is a sticky fault: the step changes nothing, later steps
// repeat it, and to_host brings the sequence back, then raises the core's
// own error naming it.
TEST_CASE(bad_count_is_a_sticky_fault) {
    Stager dev(options(2, 3, 12, Storage::F32)), orc(options(2, 3, 12, Storage::F32));
    for (Stager* st : {&dev, &orc}) {
        prompt(*st, 0, 0, 8, nullptr);
        prompt(*st, 1, 0, 8, nullptr);
    }
    const i64 both[] = {0, 1};
    dev.to_device(both, 2);
    {
        StepOut o(dev, 2);
        const i64 counts[] = {0, 0};
        dev.step_many(both, counts, 2, o.out);
        for (i64 q : both) (void)host_step(orc, q, 0, -1);
    }
    StepOut o(dev, 2);
    const i64 counts[] = {2, 4};  // 4 > B = 3
    dev.step_many(both, counts, 2, o.out);
    const Expected e = host_step(orc, 0, 2, -1);
    CHECK(same_entry(dev, o, 0, e));
    CHECK_EQ(o.status[1], device_step::STATUS_BAD_COUNT);
    CHECK(nothing(dev, o, 1));
    StepOut again(dev, 1);
    const i64 fine = 1;
    dev.step_many(&both[1], &fine, 1, again.out);
    CHECK_EQ(again.status[0], device_step::STATUS_BAD_COUNT);
    bool named = false;
    try {
        dev.check_step(both, o.status.data(), 2);
    } catch (const std::invalid_argument& x) {
        named = std::string(x.what()).find("step_many: seqs[1] (sequence 1)") != std::string::npos;
    }
    CHECK(named);
    named = false;
    try {
        dev.to_host(both, 2);
    } catch (const std::invalid_argument& x) {
        named = std::string(x.what()).find("sequence 1") != std::string::npos &&
                std::string(x.what()).find("got 4") != std::string::npos;
    }
    CHECK(named);
    CHECK(!dev.on_device(0) && !dev.on_device(1));
    for (i64 q : both) CHECK(same_seq(dev, orc, q));
}

// A drafter failure reported at hand-back is fail(stage): after
// max_failures of them the sequence is disabled (disabled_after says so);
// handed over again it steps as the host path does, a disabled skip
// verifying `last` alone.
TEST_CASE(failures_reported_at_hand_back) {
    Stager dev(options(1, 2, 9, Storage::F32)), orc(options(1, 2, 9, Storage::F32));
    start(dev, 6);
    start(orc, 6);
    const i64 seq = 0;
    for (int k = 1; k <= 3; ++k) {
        dev.to_device(&seq, 1);
        StepOut o(dev, 1);
        const i64 a = 1;
        dev.step_many(&seq, &a, 1, o.out);
        const Expected e = host_step(orc, seq, a, 1);
        CHECK(same_entry(dev, o, 0, e));
        const std::int32_t crop = 1;
        i64 disabled = -1;
        dev.to_host(&seq, 1, &crop, &disabled);
        CHECK_EQ(disabled, k == 3 ? 3 : 0);
        CHECK(same_seq(dev, orc, seq));
    }
    CHECK(dev.state(0).disabled);
    dev.to_device(&seq, 1);
    for (int k = 0; k < 3; ++k) {
        StepOut o(dev, 1);
        const i64 a = 0;
        dev.step_many(&seq, &a, 1, o.out);
        const Expected e = host_step(orc, seq, a, -1);
        CHECK(e.plan.skip == Skip::Disabled && o.skip[0] == device_step::SKIP_DISABLED);
        CHECK(same_entry(dev, o, 0, e));
    }
    dev.to_host(&seq, 1);
    CHECK(same_seq(dev, orc, seq));
}

// The verify rows of a step may not pass 2**62 - 1: a sticky fault, the
// step changes nothing, and to_host raises the host's own error.
TEST_CASE(position_limit_is_a_fault) {
    Stager st(options(1, 2, 9, Storage::F32));
    prompt(st, 0, MAX_POSITION - 8, 2, nullptr);  // end = MAX_POSITION - 6
    const i64 seq = 0;
    st.to_device(&seq, 1);
    StepOut first(st, 1);
    i64 a = 0;
    st.step_many(&seq, &a, 1, first.out);
    CHECK_EQ(first.status[0], device_step::STATUS_OK);  // verify rows up to MAX_POSITION - 4
    StepOut second(st, 1);
    a = 2;  // keeps all 3: end = MAX_POSITION - 3, the next 3 rows reach MAX_POSITION - 1
    st.step_many(&seq, &a, 1, second.out);
    CHECK_EQ(second.status[0], device_step::STATUS_POSITION_LIMIT);
    CHECK(nothing(st, second, 0));
    bool named = false;
    try {
        st.to_host(&seq, 1);
    } catch (const std::invalid_argument& e) {
        named = std::string(e.what()).find("2**62") != std::string::npos;
    }
    CHECK(named);
    // As the first step left it: its round committed, its verify rows reserved.
    CHECK(st.state(0).reservation_open);
    CHECK_EQ(st.state(0).end, MAX_POSITION - 6 + 3);
    CHECK_EQ(st.stats(0).commits, 1);
}

// A chain drafter's slot token table: the hand-overs check it whole before
// they change anything; to_device writes a sequence's ids at its rows' slots
// and -1 at its others, leaving other sequences' slots alone; a row whose
// id the server never wrote is refused by to_host (naming it), and a failed
// round's unwritten verify rows by confirm (cancel takes them back).
TEST_CASE(chain_token_table) {
    const i64 B = 2;
    Stager st(options(3, B, 9, Storage::F32, DrafterKind::Chain)), block(options(3, B, 9, Storage::F32));
    const IdFn id = [](i64 p) { return static_cast<std::int32_t>(40 + p); };
    std::vector<i64> slots0;
    prompt(st, 0, 0, 6, &slots0, id);
    prompt(st, 1, 0, 3, nullptr, id);
    prompt(block, 0, 0, 6, nullptr);
    const i64 rr = st.ring_rows();
    const std::size_t n_tab = static_cast<std::size_t>(3 * rr);
    std::vector<std::int32_t> table(n_tab, 77);
    const i64 zero = 0;
    CHECK(throws_with([&] { st.to_device(&zero, 1); }, "slot token table"));
    CHECK(throws_with([&] { st.to_device(&zero, 1, table.data(), n_tab - 1); }, ("holds " + std::to_string(n_tab - 1)).c_str()));
    CHECK(throws_with([&] { block.to_device(&zero, 1, table.data(), n_tab); }, "chain drafter"));
    CHECK(!st.on_device(0) && !block.on_device(0));
    CHECK(std::all_of(table.begin(), table.end(), [](std::int32_t v) { return v == 77; }));
    st.to_device(&zero, 1, table.data(), n_tab);
    for (i64 k = 0; k < rr; ++k) {
        const auto it = std::find(slots0.begin(), slots0.end(), k);
        CHECK_EQ(table[static_cast<std::size_t>(k)], it == slots0.end() ? -1 : id(it - slots0.begin()));
    }
    for (std::size_t g = static_cast<std::size_t>(rr); g < n_tab; ++g) CHECK_EQ(table[g], 77);
    // Two steps: the second confirms the first's verify rows, whose ids
    // were never written: to_host refuses, naming the first of them.
    StepOut o1(st, 1), o2(st, 1);
    i64 a = 0;
    st.step_many(&zero, &a, 1, o1.out);
    st.step_many(&zero, &a, 1, o2.out);
    CHECK_EQ(o2.status[0], device_step::STATUS_OK);
    const std::string first = "slot " + std::to_string(o1.verify[0]) + ", the row of position 6";
    CHECK(throws_with([&] { st.to_host(&zero, 1, nullptr, nullptr, table.data(), n_tab); }, first.c_str()));
    CHECK(st.on_device(0));
    table[static_cast<std::size_t>(o1.verify[0])] = 1234;  // accept 0 kept the verify batch's first row
    // The second step's verify rows stay unwritten: its round failed.
    const std::int32_t crop = 1;
    st.to_host(&zero, 1, &crop, nullptr, table.data(), n_tab);
    CHECK(!st.on_device(0) && st.state(0).reservation_open);
    CHECK(throws_with([&] { st.confirm(0); }, "has no token id"));
    CHECK(throws_with([&] { st.confirm_many(&zero, 1); }, "confirm_many: seqs[0] (sequence 0)"));
    CHECK(st.state(0).reservation_open);
    st.cancel(0);
    std::vector<std::int32_t> got(7);
    st.tokens(0, 0, 7, got.data());
    CHECK_EQ(got[6], 1234);
    for (i64 p = 0; p < 6; ++p) CHECK_EQ(got[static_cast<std::size_t>(p)], id(p));
}

TEST_MAIN()
