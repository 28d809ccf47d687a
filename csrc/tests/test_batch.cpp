// C++ tests of the batched calls (docs/design.md 2.9): each batch equals its
// per-sequence calls (plans, rows, state, stats, snapshots); a rejected batch
// changes nothing and names `seqs[i] (sequence s)`; reserve -> confirm equals
// process_external and reserve -> cancel leaves the sequence byte-identical;
// end frees the ring in any state; and the per-sequence locks: threads on
// distinct sequences end in the state of a serial replay, and crossing fork /
// batch calls never deadlock.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "dspark/errors.hpp"
#include "dspark/stager.hpp"

using namespace dspark;

namespace {

constexpr std::int64_t D = 32, B = 4, W = 24;
constexpr std::int64_t N_SEQS = 6;

StagerOptions opts(RowMode rows, Storage st = Storage::F32, std::int64_t seqs = N_SEQS) {
    StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    o.max_seqs = seqs;
    o.storage = st;
    o.rows = rows;
    o.max_failures = 2;
    return o;
}

// Rows that look like activations: a position ramp, a massive channel, a tag.
std::vector<float> rows_for(std::int64_t from, std::int64_t n, float tag = 0) {
    std::vector<float> r(static_cast<std::size_t>(n * D));
    for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t c = 0; c < D; ++c)
            r[static_cast<std::size_t>(i * D + c)] =
                (c == 3 ? 900.0f : 0.01f * float(c)) + float(from + i) * 0.5f + tag;
    return r;
}

std::vector<std::int64_t> span(std::int64_t from, std::int64_t n) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = from + i;
    return p;
}

// Everything observable about one sequence, as bytes: state, stats, live
// slots, open round and its snapshot (rows included in held mode).
std::vector<std::uint8_t> fingerprint(const Stager& s, std::int64_t seq) {
    std::vector<std::uint8_t> out;
    auto put = [&](const void* p, std::size_t n) {
        const auto* b = static_cast<const std::uint8_t*>(p);
        out.insert(out.end(), b, b + n);
    };
    const SeqState st = s.state(seq);
    for (const FieldInfo* f = SEQ_STATE_FIELDS; f->name; ++f)
        put(reinterpret_cast<const char*>(&st) + f->offset, f->is_bool ? sizeof(bool) : sizeof(std::int64_t));
    const SeqStats ss = s.stats(seq);
    for (const FieldInfo* f = SEQ_STATS_FIELDS; f->name; ++f)
        put(reinterpret_cast<const char*>(&ss) + f->offset, sizeof(std::int64_t));
    SlotRun runs[2];
    s.live_slots(seq, runs);
    put(runs, sizeof runs);
    const std::uint64_t r = s.open_round_id(seq);
    put(&r, sizeof r);
    if (!st.reservation_open && !st.open_round) {
        const auto snap = s.snapshot(seq);
        put(snap.data(), snap.size());
    }
    return out;
}

std::vector<std::vector<std::uint8_t>> fingerprints(const Stager& s) {
    std::vector<std::vector<std::uint8_t>> all;
    for (std::int64_t q = 0; q < s.options().max_seqs; ++q) all.push_back(fingerprint(s, q));
    return all;
}

bool same_plan(const RoundPlan& a, const RoundPlan& b) {
    return a.seq == b.seq && a.round == b.round && a.skip == b.skip && a.mismatch == b.mismatch &&
           a.rebase == b.rebase && a.clear_cache == b.clear_cache && a.start == b.start && a.pos_base == b.pos_base &&
           a.first_row == b.first_row && a.n_rows == b.n_rows && a.crop_from == b.crop_from &&
           a.slot_runs[0].first == b.slot_runs[0].first && a.slot_runs[0].count == b.slot_runs[0].count &&
           a.slot_runs[1].first == b.slot_runs[1].first && a.slot_runs[1].count == b.slot_runs[1].count;
}

// A varlen batch: the sequences' new rows, flat, with cu_seqlens.
struct Flat {
    std::vector<std::int64_t> seqs, cu{0}, positions;
    std::vector<float> rows;
    void add(std::int64_t seq, std::int64_t from, std::int64_t n, float tag = 0) {
        seqs.push_back(seq);
        auto p = span(from, n);
        auto r = rows_for(from, n, tag);
        positions.insert(positions.end(), p.begin(), p.end());
        rows.insert(rows.end(), r.begin(), r.end());
        cu.push_back(cu.back() + n);
    }
};

// One server step on `many` with batched calls and on `one` with per-sequence
// calls: process the verify rows, accept, draft, commit / fail. Checks the
// results agree and returns the batch's staged rows.
struct Twin {
    Stager one, many;
    std::vector<std::int64_t> end = std::vector<std::int64_t>(N_SEQS, 0);
    int opened = 0, rebases = 0, skips = 0;  // the scenario reaches every path
    explicit Twin(const StagerOptions& o) : one(o), many(o) {}

    void process(const Flat& f) {
        const std::size_t total = f.positions.size();
        if (one.external()) {
            std::vector<std::int64_t> a(total, -7), b(total, -7);
            for (std::size_t i = 0; i < f.seqs.size(); ++i)
                one.process_external(f.seqs[i], f.positions.data() + f.cu[i], std::size_t(f.cu[i + 1] - f.cu[i]),
                                     a.data() + f.cu[i]);
            many.process_external_many(f.seqs.data(), f.seqs.size(), f.cu.data(), f.positions.data(), total, b.data());
            CHECK(a == b);
        } else {
            for (std::size_t i = 0; i < f.seqs.size(); ++i)
                one.process(f.seqs[i], f.positions.data() + f.cu[i], std::size_t(f.cu[i + 1] - f.cu[i]),
                            f.rows.data() + f.cu[i] * D, ElemType::F32);
            many.process_many(f.seqs.data(), f.seqs.size(), f.cu.data(), f.positions.data(), total, f.rows.data(),
                              ElemType::F32);
        }
        for (std::size_t i = 0; i < f.seqs.size(); ++i) end[std::size_t(f.seqs[i])] = f.positions[std::size_t(f.cu[i + 1] - 1)];
    }

    std::vector<RoundPlan> draft(const std::vector<std::int64_t>& seqs, const std::vector<std::int64_t>& pasts) {
        std::vector<RoundPlan> a, b;
        ByteVec ra, rb;
        for (std::size_t i = 0; i < seqs.size(); ++i) a.push_back(one.draft(seqs[i], pasts[i], ra));
        many.draft_many(seqs.data(), pasts.data(), seqs.size(), b, rb);
        CHECK_EQ(a.size(), b.size());
        for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) CHECK(same_plan(a[i], b[i]));
        CHECK(ra.size() == rb.size() && (ra.empty() || std::memcmp(ra.data(), rb.data(), ra.size()) == 0));
        for (auto& p : b) {
            opened += p.skip == Skip::None;
            rebases += p.rebase;
            skips += p.skip != Skip::None;
        }
        return b;
    }

    void same() { CHECK(fingerprints(one) == fingerprints(many)); }
};

void run_steps(RowMode mode, Storage storage) {
    Twin t(opts(mode, storage));
    // Prompts of different lengths, one of them longer than the window.
    Flat prompt;
    const std::int64_t lens[] = {5, 40, 1, 9};
    for (std::int64_t q = 0; q < 4; ++q) prompt.add(q, 0, lens[q], float(q));
    t.process(prompt);
    t.same();
    std::vector<std::int64_t> n_past = {5, 40, 1, 9};
    for (int step = 0; step < 12; ++step) {
        std::vector<std::int64_t> seqs = {3, 0, 1, 2};
        if (step % 5 == 4) seqs = {1, 3};  // not every sequence every step
        std::vector<std::int64_t> pasts;
        for (auto q : seqs) pasts.push_back(n_past[std::size_t(q)] + (step == 7 && q == 3 ? 1 : 0));  // one mismatch skip
        auto plans = t.draft(seqs, pasts);
        t.same();
        std::vector<std::int64_t> commit, failed;
        std::vector<FailStage> stages;
        for (auto& p : plans) {
            if (p.skip != Skip::None) continue;
            if ((step + p.seq) % 4 == 1) {
                failed.push_back(p.seq);
                stages.push_back(step % 2 ? FailStage::Crop : FailStage::Decode);
            } else {
                commit.push_back(p.seq);
            }
        }
        for (auto q : commit) t.one.commit(q);
        t.many.commit_many(commit.data(), commit.size());
        std::vector<std::int64_t> da(failed.size()), db(failed.size(), -5);
        for (std::size_t i = 0; i < failed.size(); ++i) da[i] = t.one.fail(failed[i], stages[i]);
        t.many.fail_many(failed.data(), stages.data(), failed.size(), db.data());
        CHECK(da == db);
        t.same();
        // Verify: B + 1 rows per sequence, then accept a varying count.
        Flat verify;
        std::vector<std::int64_t> acc;
        for (auto q : seqs) {
            verify.add(q, n_past[std::size_t(q)], B + 1, float(step));
            acc.push_back((step * 3 + q) % (B + 1));
        }
        t.process(verify);
        t.same();
        for (std::size_t i = 0; i < seqs.size(); ++i) t.one.accept(seqs[i], acc[i]);
        t.many.accept_many(seqs.data(), acc.data(), seqs.size());
        for (std::size_t i = 0; i < seqs.size(); ++i) n_past[std::size_t(seqs[i])] += acc[i] + 1;
        t.same();
        // A request ends and another begins on a fresh sequence mid-run.
        if (step == 6) {
            const std::int64_t q[] = {2};
            t.one.end(2);
            t.many.end_many(q, 1);
            Flat again;
            again.add(2, 0, 3, 9.0f);
            t.process(again);
            n_past[2] = 3;
            t.same();
        }
    }
    CHECK(t.opened > 30 && t.rebases > 3 && t.skips > 0);
    // Batches of nothing are no-ops.
    t.many.commit_many(nullptr, 0);
    t.many.accept_many(nullptr, nullptr, 0);
    t.many.end_many(nullptr, 0);
    const std::int64_t cu0[1] = {0};
    if (t.many.external()) t.many.process_external_many(nullptr, 0, cu0, nullptr, 0, nullptr);
    else t.many.process_many(nullptr, 0, cu0, nullptr, 0, nullptr, ElemType::F32);
    t.same();
}

// The message of what `f` throws as E ("" when it throws nothing, "?" when another type).
template <class E, class F>
std::string error_of(F&& f) {
    try {
        f();
    } catch (const E& e) {
        return e.what();
    } catch (...) {
        return "?";
    }
    return "";
}

bool has(const std::string& s, const std::string& part) {
    const bool ok = s.find(part) != std::string::npos;
    if (!ok) std::printf("  message \"%s\" lacks \"%s\"\n", s.c_str(), part.c_str());
    return ok;
}

// A Stager with sequences in several states: 0 and 1 buffered rows, 2 has an
// open round, 3 buffered rows, 4 and 5 never used.
void prime(Stager& s) {
    const RowMode mode = s.options().rows;
    std::vector<std::int64_t> slots(64);
    for (std::int64_t q = 0; q < 4; ++q) {
        auto p = span(0, 6);
        auto r = rows_for(0, 6, float(q));
        if (mode == RowMode::External) s.process_external(q, p.data(), p.size(), slots.data());
        else s.process(q, p.data(), p.size(), r.data(), ElemType::F32);
    }
    ByteVec rows;
    s.draft(2, 6, rows);
}

}  // namespace

TEST_CASE(batched_steps_equal_per_sequence_calls_held) {
    run_steps(RowMode::Held, Storage::F32);
    run_steps(RowMode::Held, Storage::Q8_0);
}

TEST_CASE(batched_steps_equal_per_sequence_calls_external) { run_steps(RowMode::External, Storage::F32); }

TEST_CASE(rejected_batches_change_nothing_and_name_the_sequence) {
    for (RowMode mode : {RowMode::Held, RowMode::External}) {
        Stager s(opts(mode));
        prime(s);
        const auto before = fingerprints(s);
        const bool ext = mode == RowMode::External;
        std::vector<std::int64_t> out(64);
        // process_many / process_external_many: rows 6.. for 0 and 1.
        auto process = [&](std::vector<std::int64_t> seqs, std::vector<std::int64_t> cu, std::vector<std::int64_t> pos,
                           std::vector<float> rows) {
            if (ext)
                s.process_external_many(seqs.data(), seqs.size(), cu.data(), pos.data(), pos.size(), out.data());
            else
                s.process_many(seqs.data(), seqs.size(), cu.data(), pos.data(), pos.size(), rows.data(), ElemType::F32);
        };
        const char* pcall = ext ? "process_external_many" : "process_many";
        auto good_rows = rows_for(6, 4);
        std::string m;
        // An unknown id, named, before anything else.
        m = error_of<std::invalid_argument>([&] { process({0, 9}, {0, 2, 4}, {6, 7, 6, 7}, good_rows); });
        CHECK(has(m, std::string(pcall) + ": seqs[1] (sequence 9): unknown sequence 9"));
        // A sequence in the wrong state: 2 has an open round.
        m = error_of<StateError>([&] { process({0, 2}, {0, 2, 4}, {6, 7, 6, 7}, good_rows); });
        CHECK(has(m, std::string(pcall) + ": seqs[1] (sequence 2): sequence 2 has an open round"));
        // A repeated id.
        m = error_of<std::invalid_argument>([&] { process({0, 1, 0}, {0, 1, 2, 4}, {6, 6, 7, 8}, good_rows); });
        CHECK(has(m, "sequence 0 appears twice (seqs[0] and seqs[2])"));
        // Offsets that do not start at 0, decrease, or miss the total.
        m = error_of<std::invalid_argument>([&] { process({0, 1}, {1, 2, 4}, {6, 7, 6, 7}, good_rows); });
        CHECK(has(m, "cu_seqlens must start at 0"));
        m = error_of<std::invalid_argument>([&] { process({0, 1}, {0, 3, 2}, {6, 7, 6, 7}, good_rows); });
        CHECK(has(m, "must not decrease"));
        m = error_of<std::invalid_argument>([&] { process({0, 1}, {0, 2, 3}, {6, 7, 6, 7}, good_rows); });
        CHECK(has(m, "must end at the 4 rows"));
        // A bad value in sequence k: positions of seqs[1] do not continue.
        m = error_of<std::invalid_argument>([&] { process({0, 1}, {0, 2, 4}, {6, 7, 9, 10}, good_rows); });
        CHECK(has(m, std::string(pcall) + ": seqs[1] (sequence 1): sequence 1: positions must continue at 6"));
        if (!ext) {
            // An unstageable row in sequence k (after k - 1 sequences converted theirs into free slots).
            auto bad = good_rows;
            bad[std::size_t(3 * D + 5)] = NAN;
            m = error_of<std::invalid_argument>([&] { process({0, 1}, {0, 2, 4}, {6, 7, 6, 7}, bad); });
            CHECK(has(m, "process_many: seqs[1] (sequence 1): sequence 1: row 1 (position 7), channel 5 holds nan"));
            // process_many on an external Stager is a mode error (and the reverse).
        }
        CHECK(fingerprints(s) == before);

        // draft_many: a bad n_past in sequence k.
        std::vector<RoundPlan> plans;
        ByteVec rows;
        const std::int64_t ds[] = {0, 1}, dp[] = {6, -1};
        m = error_of<std::invalid_argument>([&] { s.draft_many(ds, dp, 2, plans, rows); });
        CHECK(has(m, "draft_many: seqs[1] (sequence 1): n_past"));
        // commit_many / fail_many need open rounds; accept_many a ready state and counts >= 0.
        const std::int64_t c2[] = {2, 0};
        m = error_of<StateError>([&] { s.commit_many(c2, 2); });
        CHECK(has(m, "commit_many: seqs[1] (sequence 0): sequence 0 has no open round"));
        const FailStage fs[] = {FailStage::Decode, static_cast<FailStage>(7)};
        const std::int64_t f2[] = {2, 2};
        m = error_of<std::invalid_argument>([&] { s.fail_many(f2, fs, 2, nullptr); });
        CHECK(has(m, "fail_many: sequence 2 appears twice (seqs[0] and seqs[1])"));
        const std::int64_t a2[] = {0, 1}, na[] = {1, -3};
        m = error_of<std::invalid_argument>([&] { s.accept_many(a2, na, 2); });
        CHECK(has(m, "accept_many: seqs[1] (sequence 1): n_accepted"));
        const std::int64_t a3[] = {0, 2};
        m = error_of<StateError>([&] { s.accept_many(a3, na, 2); });
        CHECK(has(m, "accept_many: seqs[1] (sequence 2): sequence 2 has an open round"));
        const std::int64_t e2[] = {4, -1};
        m = error_of<std::invalid_argument>([&] { s.end_many(e2, 2); });
        CHECK(has(m, "end_many: seqs[1] (sequence -1): unknown sequence -1"));
        const std::int64_t e3[] = {4, 5, 4};
        m = error_of<std::invalid_argument>([&] { s.end_many(e3, 3); });
        CHECK(has(m, "end_many: sequence 4 appears twice"));
        CHECK(fingerprints(s) == before);

        // reserve_many and confirm / cancel batches.
        if (ext) {
            const std::int64_t rs[] = {0, 1}, rc[] = {0, 1, 3}, rp[] = {6, 7, 8};
            m = error_of<std::invalid_argument>([&] { s.reserve_many(rs, 2, rc, rp, 3, out.data()); });
            CHECK(has(m, "reserve_many: seqs[1] (sequence 1): sequence 1: positions must continue at 6"));
            const std::int64_t cs[] = {0};
            m = error_of<StateError>([&] { s.confirm_many(cs, 1); });
            CHECK(has(m, "confirm_many: seqs[0] (sequence 0): sequence 0 has no reserved rows"));
            m = error_of<StateError>([&] { s.cancel_many(cs, 1); });
            CHECK(has(m, "cancel_many: seqs[0] (sequence 0): sequence 0 has no reserved rows"));
        } else {
            const std::int64_t rs[] = {0}, rc[] = {0, 1}, rp[] = {6};
            m = error_of<std::invalid_argument>([&] { s.reserve_many(rs, 1, rc, rp, 1, out.data()); });
            CHECK(has(m, "reserve_many needs external-row mode"));
        }
        CHECK(fingerprints(s) == before);
        // What the rejections left shows in the next rows too (the ring's
        // resident bytes are counted when rows are committed).
        Stager twin(opts(mode));
        prime(twin);
        for (Stager* x : {&s, &twin}) {
            Flat f;  // fewer rows than the rejected batch wrote into free slots
            f.add(0, 6, 1);
            f.add(1, 6, 1);
            f.add(3, 6, 1);
            if (ext) x->process_external_many(f.seqs.data(), 3, f.cu.data(), f.positions.data(), 3, out.data());
            else x->process_many(f.seqs.data(), 3, f.cu.data(), f.positions.data(), 3, f.rows.data(), ElemType::F32);
        }
        CHECK(fingerprints(s) == fingerprints(twin));
    }
}

TEST_CASE(reserve_confirm_equals_process_external_and_cancel_changes_nothing) {
    Stager a(opts(RowMode::External)), b(opts(RowMode::External));
    prime(a);
    prime(b);
    // One batch: 0 and 1 continue, 4 starts (a prompt of 30 rows: longer than the window).
    Flat f;
    f.add(0, 6, 3);
    f.add(1, 6, 5);
    f.add(4, 0, 30);
    const std::size_t total = f.positions.size();
    std::vector<std::int64_t> sa(total), sb(total);
    a.process_external_many(f.seqs.data(), 3, f.cu.data(), f.positions.data(), total, sa.data());
    const auto before = fingerprints(b);
    b.reserve_many(f.seqs.data(), 3, f.cu.data(), f.positions.data(), total, sb.data());
    CHECK(sa == sb);  // the same slots, before the rows exist
    CHECK(b.state(4).reservation_open && b.state(0).reservation_open && !b.state(3).reservation_open);
    // A reserved sequence refuses every call but confirm, cancel and end.
    ByteVec rows;
    CHECK(has(error_of<StateError>([&] { b.draft(0, 9, rows); }), "sequence 0 has reserved rows"));
    CHECK(has(error_of<StateError>([&] { b.accept(1, 0); }), "sequence 1 has reserved rows"));
    CHECK(has(error_of<StateError>([&] { b.snapshot(4); }), "sequence 4 has reserved rows"));
    const std::int64_t both[] = {0, 3};
    CHECK(has(error_of<StateError>([&] { b.cancel_many(both, 2); }), "cancel_many: seqs[1] (sequence 3)"));
    // Cancel all three: byte-identical to before.
    b.cancel_many(f.seqs.data(), 3);
    CHECK(fingerprints(b) == before);
    // Reserve again (the same slots), confirm one at a time: process_external's state.
    std::vector<std::int64_t> sc(total);
    b.reserve_many(f.seqs.data(), 3, f.cu.data(), f.positions.data(), total, sc.data());
    CHECK(sc == sa);
    b.confirm(4);
    const std::int64_t rest[] = {1, 0};
    b.confirm_many(rest, 2);
    CHECK(fingerprints(a) == fingerprints(b));
    // Per-sequence reserve -> cancel, with a ring that wraps.
    for (int k = 0; k < 20; ++k) {
        const std::int64_t from = a.state(0).end;
        auto p = span(from, 5);
        std::vector<std::int64_t> x(5), y(5);
        const auto fp = fingerprint(b, 0);
        b.reserve(0, p.data(), 5, y.data());
        b.cancel(0);
        CHECK(fingerprint(b, 0) == fp);
        a.process_external(0, p.data(), 5, x.data());
        b.reserve(0, p.data(), 5, y.data());
        CHECK(x == y);
        b.confirm(0);
        CHECK(fingerprint(a, 0) == fingerprint(b, 0));
        ByteVec r;
        a.draft(0, from + 5, r);
        b.draft(0, from + 5, r);
        a.commit(0);
        b.commit(0);
    }
}

TEST_CASE(end_frees_the_ring_in_any_state) {
    for (RowMode mode : {RowMode::Held, RowMode::External}) {
        Stager s(opts(mode));
        prime(s);
        const Stager fresh(opts(mode));
        const bool held = mode == RowMode::Held;  // an external ring holds no bytes
        CHECK(!held || (s.stats(0).reserved_bytes > 0 && s.stats(0).bytes > 0));
        // Idle (0), open round (2), never used (5): each ends as a new Stager's sequence.
        const std::int64_t q[] = {0, 2, 5};
        s.end_many(q, 3);
        for (std::int64_t k : q) {
            CHECK(fingerprint(s, k) == fingerprint(fresh, k));
            CHECK_EQ(s.stats(k).reserved_bytes, 0);
            CHECK_EQ(s.stats(k).bytes, 0);
        }
        CHECK(fingerprint(s, 1).size() > 0 && s.state(1).end == 6);  // the others keep theirs
        // begin keeps the ring for the next request; end does not.
        s.begin(1);
        CHECK(!held || s.stats(1).reserved_bytes > 0);
        s.end(1);
        CHECK_EQ(s.stats(1).reserved_bytes, 0);
        // A reservation is dropped too (the abort path).
        if (mode == RowMode::External) {
            auto p = span(6, 4);
            std::vector<std::int64_t> slots(4);
            s.reserve(3, p.data(), 4, slots.data());
            s.end(3);
            CHECK(fingerprint(s, 3) == fingerprint(fresh, 3));
        }
        // The next request starts anywhere, as on a new Stager.
        auto p = span(100, 3);
        auto r = rows_for(100, 3);
        std::vector<std::int64_t> slots(3);
        if (mode == RowMode::External) s.process_external(0, p.data(), 3, slots.data());
        else s.process(0, p.data(), 3, r.data(), ElemType::F32);
        CHECK_EQ(s.state(0).end, 103);
    }
}

// -- threads ------------------------------------------------------------------

namespace {

// One thread's work on its own sequences {a, b}: rounds with batched and
// per-sequence calls, a fork a -> b, a shift of a; deterministic per sequence.
void worker(Stager& s, std::int64_t a, std::int64_t b, int rounds) {
    std::vector<std::int64_t> slots(64);
    auto feed = [&](std::int64_t q, std::int64_t from, std::int64_t n) {
        auto p = span(from, n);
        auto r = rows_for(from, n, float(q));
        if (s.external()) s.process_external(q, p.data(), std::size_t(n), slots.data());
        else s.process(q, p.data(), std::size_t(n), r.data(), ElemType::F32);
    };
    feed(a, 0, 7);
    feed(b, 0, 3);
    std::int64_t na = 7, nb = 3;
    for (int k = 0; k < rounds; ++k) {
        const std::int64_t seqs[] = {a, b}, pasts[] = {na, nb};
        std::vector<RoundPlan> plans;
        ByteVec rows;
        s.draft_many(seqs, pasts, 2, plans, rows);
        std::vector<std::int64_t> open;
        for (auto& p : plans)
            if (p.skip == Skip::None) open.push_back(p.seq);
        if (k % 3 == 2 && !open.empty()) {
            const FailStage st[] = {FailStage::Decode, FailStage::Crop};
            s.fail_many(open.data(), st, open.size(), nullptr);
        } else {
            s.commit_many(open.data(), open.size());
        }
        Flat f;
        f.add(a, na, B + 1, float(k));
        f.add(b, nb, B + 1, float(k));
        if (s.external()) s.process_external_many(f.seqs.data(), 2, f.cu.data(), f.positions.data(), f.positions.size(), slots.data());
        else s.process_many(f.seqs.data(), 2, f.cu.data(), f.positions.data(), f.positions.size(), f.rows.data(), ElemType::F32);
        const std::int64_t acc[] = {k % (B + 1), (k + 2) % (B + 1)};
        s.accept_many(seqs, acc, 2);
        na += acc[0] + 1;
        nb += acc[1] + 1;
        if (k % 7 == 3) {
            s.fork(a, b);
            nb = na;
        }
        if (k % 11 == 5 && na > 10) {
            s.shift(a, 2, 4);
            na -= 4;
        }
    }
}

void threads_equal_serial(RowMode mode, Storage storage) {
    constexpr int ROUNDS = 60;
    Stager par(opts(mode, storage, 4)), ser(opts(mode, storage, 4));
    std::thread t1([&] { worker(par, 0, 1, ROUNDS); });
    std::thread t2([&] { worker(par, 3, 2, ROUNDS); });
    t1.join();
    t2.join();
    worker(ser, 0, 1, ROUNDS);
    worker(ser, 3, 2, ROUNDS);
    // Round ids and move serials interleave across threads; everything per sequence is as serial.
    for (std::int64_t q = 0; q < 4; ++q) {
        CHECK(fingerprint(par, q) == fingerprint(ser, q));
    }
    CHECK_EQ(par.moves_issued(), ser.moves_issued());
}

}  // namespace

TEST_CASE(threads_on_distinct_sequences_end_as_a_serial_replay) {
    threads_equal_serial(RowMode::Held, Storage::F32);
    threads_equal_serial(RowMode::Held, Storage::Q8_0);
    threads_equal_serial(RowMode::External, Storage::F32);
}

namespace {

// Rows 0..n-1 for every sequence of a held Stager.
void fill(Stager& s, std::int64_t n) {
    for (std::int64_t q = 0; q < s.options().max_seqs; ++q) {
        auto p = span(0, n);
        auto r = rows_for(0, n, float(q));
        s.process(q, p.data(), std::size_t(n), r.data(), ElemType::F32);
    }
}

}  // namespace

TEST_CASE(a_batch_holds_only_its_own_sequences) {
    // draft_many_into calls its sink while it holds the locks of its batch's
    // sequences (0 and 1). Inside the sink, another thread runs a whole round
    // on sequence 2 and a batch on {3, 2}: with one Stager-wide lock they
    // could not run until the sink returned, and the wait below would time out.
    {
        Stager s(opts(RowMode::Held, Storage::F32, 4));
        fill(s, 8);
        std::mutex m;
        std::condition_variable cv;
        bool other_done = false, in_time = false;
        std::vector<std::uint8_t> room(1 << 16);
        std::vector<RoundPlan> plans;
        const std::int64_t seqs[] = {1, 0}, pasts[] = {8, 8};
        std::thread other;
        s.draft_many_into(seqs, pasts, 2, plans, [&](const RoundPlan*, std::size_t) {
            other = std::thread([&] {
                ByteVec rows;
                s.draft(2, 8, rows);
                s.commit(2);
                const std::int64_t q[] = {3, 2}, acc[] = {0, 0};
                s.accept_many(q, acc, 2);
                std::lock_guard<std::mutex> g(m);
                other_done = true;
                cv.notify_all();
            });
            std::unique_lock<std::mutex> g(m);
            in_time = cv.wait_for(g, std::chrono::seconds(20), [&] { return other_done; });
            return room.data();
        });
        other.join();
        CHECK(in_time);
        CHECK(s.state(0).open_round && s.state(1).open_round && s.stats(2).commits == 1);
    }
}

TEST_CASE(crossing_forks_and_batches_never_deadlock) {
    // Every thread takes sequences 0..3 in a different order: forks both
    // ways, batches naming them in reverse, shifts. With one lock order
    // (increasing id) no cycle can form; a deadlock hangs this test (ctest's
    // timeout fails it).
    Stager s(opts(RowMode::Held, Storage::F32, 4));
    fill(s, 12);
    std::atomic<int> done{0};
    std::atomic<long> errors{0};
    auto hammer = [&](int id) {
        for (int k = 0; k < 400; ++k) {
            const std::int64_t x = (id + k) % 4, y = (id + 3 * k + 1) % 4;
            try {
                if (x != y) s.fork(x, y);
                const std::int64_t rev[] = {3, 2, 1, 0}, fwd[] = {0, 1, 2, 3};
                const std::int64_t* order = (id + k) % 2 ? rev : fwd;
                std::uint64_t ids[4];
                s.open_round_ids(order, 4, ids);
                s.end_many(order + (k % 4), 1);
                auto p = span(0, 12);
                auto r = rows_for(0, 12);
                s.process(order[k % 4], p.data(), 12, r.data(), ElemType::F32);
                const std::int64_t acc[] = {0, 0, 0, 0};
                s.accept_many(order, acc, 4);
                if (s.state(x).end > 6) s.shift(x, 1, 2);
            } catch (const std::exception&) {
                errors.fetch_add(1);  // another thread changed the sequence in between: a clean rejection
            }
        }
        done.fetch_add(1);
    };
    std::vector<std::thread> ts;
    for (int id = 0; id < 4; ++id) ts.emplace_back(hammer, id);
    for (auto& t : ts) t.join();
    CHECK_EQ(done.load(), 4);
    // Every sequence is still consistent: its snapshot (checked whole on
    // restore) restores into a fresh Stager with the same rows.
    Stager check(opts(RowMode::Held, Storage::F32, 4));
    for (std::int64_t q = 0; q < 4; ++q) {
        auto snap = s.snapshot(q);
        check.restore(q, snap.data(), snap.size());
        CHECK(check.state(q).end == s.state(q).end && check.state(q).horizon == s.state(q).horizon);
        SlotRun x[2], y[2];
        s.live_slots(q, x);
        check.live_slots(q, y);
        CHECK(x[0].count + x[1].count == y[0].count + y[1].count);
    }
}

// paged_rows against the rule written out: the table shifted by whole blocks,
// each row's slot in its block; refusals leave the outputs as they were.
TEST_CASE(paged_rows_shift_each_window_into_its_own_blocks) {
    const std::int64_t bt = 4;  // KV block tokens
    const std::size_t m = 5, stride = 7;  // columns used, columns per table row
    const std::int64_t seqs[3] = {10, 11, 12};
    const std::int64_t pos_base[3] = {9, -1, 0};  // a window from 9, a skipped plan, a window from 0
    const std::int64_t offsets[4] = {0, 3, 3, 5};
    const std::int32_t positions[5] = {0, 1, 6, 3, 4};
    std::vector<std::int32_t> tables(3 * stride);
    for (std::size_t k = 0; k < tables.size(); ++k) tables[k] = static_cast<std::int32_t>(100 + k);
    std::vector<std::int32_t> shifted(3 * m, -7);
    std::vector<std::int64_t> slots(5, -7);
    dspark::paged_rows(seqs, 3, pos_base, offsets, positions, 5, tables.data(), m, stride, bt, 0, shifted.data(),
                       slots.data());
    // Plan 0: shift 9 / 4 = 2 columns, the last two null; plan 1 all null; plan 2 unshifted.
    const std::vector<std::int32_t> want_shifted = {102, 103, 104, 0, 0, 0, 0, 0, 0, 0, 114, 115, 116, 117, 118};
    CHECK(shifted == want_shifted);
    // Row slots: block p / 4 of the shifted row, offset p % 4.
    const std::vector<std::int64_t> want_slots = {102 * 4 + 0, 102 * 4 + 1, 103 * 4 + 2, 114 * 4 + 3, 115 * 4 + 0};
    CHECK(slots == want_slots);
    // Each refusal: the message names the sequence, nothing is written.
    const std::int32_t far[5] = {0, 1, 20, 3, 4};  // block 5 of 5 columns
    std::vector<std::int32_t> s2(3 * m, -7);
    std::vector<std::int64_t> r2(5, -7);
    bool named = false;
    try {
        dspark::paged_rows(seqs, 3, pos_base, offsets, far, 5, tables.data(), m, stride, bt, 0, s2.data(), r2.data());
    } catch (const std::invalid_argument& e) {
        named = std::string(e.what()).rfind("paged: seqs[0] (sequence 10): drafter position 20", 0) == 0;
    }
    CHECK(named);
    const std::int64_t rows_on_skip[4] = {0, 3, 4, 5};
    CHECK_THROWS(dspark::paged_rows(seqs, 3, pos_base, rows_on_skip, positions, 5, tables.data(), m, stride, bt, 0,
                                    s2.data(), r2.data()), std::invalid_argument);
    const std::int64_t falling[4] = {0, 3, 2, 5};
    CHECK_THROWS(dspark::paged_rows(seqs, 3, pos_base, falling, positions, 5, tables.data(), m, stride, bt, 0,
                                    s2.data(), r2.data()), std::invalid_argument);
    CHECK_THROWS(dspark::paged_rows(seqs, 3, pos_base, offsets, positions, 5, tables.data(), m, stride, 0, 0,
                                    s2.data(), r2.data()), std::invalid_argument);
    CHECK(s2 == std::vector<std::int32_t>(3 * m, -7));
    CHECK(r2 == std::vector<std::int64_t>(5, -7));
    // Slots alone (no shifted tables asked for) are the same.
    std::vector<std::int64_t> alone(5, -7);
    dspark::paged_rows(seqs, 3, pos_base, offsets, positions, 5, tables.data(), m, stride, bt, 0, nullptr, alone.data());
    CHECK(alone == want_slots);
}

TEST_MAIN()

// pack_plans lays each plan's fields into the rows its name lists give
// (seqs, start, pos_base, crop_from, round, row_offsets; skip_code, rebase,
// clear_cache), and its positions and slots as plan_rows does.
TEST_CASE(pack_plans_writes_each_field_in_its_named_row) {
    Stager s(opts(RowMode::Held));
    auto feed = [&](std::int64_t q, std::int64_t n) {
        auto p = span(0, n);
        auto r = rows_for(0, n, float(q));
        s.process(q, p.data(), std::size_t(n), r.data(), ElemType::F32);
    };
    feed(0, 9);
    feed(2, 30);  // past the window: a rebase
    feed(1, 6);   // drafted at a stale n_past: a missing_rows skip whose start (4) is not its end (6)
    s.begin(3);   // empty: a skip
    const std::int64_t seqs[] = {2, 3, 0, 1}, pasts[] = {30, 0, 9, 4};
    std::vector<RoundPlan> plans;
    ByteVec rows;
    s.draft_many(seqs, pasts, 4, plans, rows);
    const std::vector<std::string> meta_names = {"seqs", "start", "pos_base", "crop_from", "round", "row_offsets"};
    const std::vector<std::string> flag_names = {"skip_code", "rebase", "clear_cache"};
    for (std::size_t k = 0; k <= meta_names.size(); ++k)
        CHECK(k < meta_names.size() ? BATCH_META_ROWS[k] == meta_names[k] : BATCH_META_ROWS[k] == nullptr);
    for (std::size_t k = 0; k <= flag_names.size(); ++k)
        CHECK(k < flag_names.size() ? BATCH_FLAG_ROWS[k] == flag_names[k] : BATCH_FLAG_ROWS[k] == nullptr);
    const std::size_t n = plans.size(), w = n + 1;
    std::int64_t total = 0;
    for (auto& p : plans) total += p.n_rows;
    const auto rows_n = static_cast<std::size_t>(total);
    std::vector<std::int64_t> meta(6 * w, -7), slots(rows_n), ref_off(w), ref_slots(rows_n);
    std::vector<std::uint8_t> flags(3 * n, 0xEE);
    std::vector<std::int32_t> pos(rows_n), ref_pos(rows_n);
    pack_plans(plans.data(), n, meta.data(), flags.data(), pos.data(), slots.data());
    plan_rows(plans.data(), n, ref_off.data(), ref_pos.data(), ref_slots.data());
    CHECK(plans[0].rebase && plans[1].skip != Skip::None && plans[2].skip == Skip::None);
    CHECK(plans[3].skip == Skip::MissingRows && plans[3].start == 4 && plans[3].end == 6);
    for (std::size_t i = 0; i < n; ++i) {
        const RoundPlan& p = plans[i];
        CHECK_EQ(meta[0 * w + i], p.seq);
        CHECK_EQ(meta[1 * w + i], p.start);
        CHECK_EQ(meta[2 * w + i], p.pos_base);
        CHECK_EQ(meta[3 * w + i], p.crop_from);
        CHECK_EQ(meta[4 * w + i], std::int64_t(p.round));
        CHECK_EQ(int(flags[0 * n + i]), int(p.skip));
        CHECK_EQ(int(flags[1 * n + i]), int(p.rebase));
        CHECK_EQ(int(flags[2 * n + i]), int(p.clear_cache));
    }
    for (std::size_t i = 0; i < w; ++i) CHECK_EQ(meta[5 * w + i], ref_off[i]);
    CHECK(pos == ref_pos && slots == ref_slots);
}
