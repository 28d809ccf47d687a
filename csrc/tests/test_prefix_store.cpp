// C++ tests of the prefix store (dspark/prefix_store.hpp) without Python: the
// keep rule, a hit's first rounds equal a full prefill's (held and external
// rows, every storage), replay positions on misses, LRU eviction under the
// budget, export / import, and rejected calls that change nothing. The
// Python suite compares the core with the reference twin op for op.
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "dspark/errors.hpp"
#include "dspark/prefix_store.hpp"
#include "dspark/stager.hpp"

using namespace dspark;

namespace {

constexpr std::int64_t D = 64;

StagerOptions sopts(std::int64_t B, std::int64_t W, Storage st = Storage::F32, RowMode mode = RowMode::Held,
                    std::int64_t seqs = 3) {
    StagerOptions o;
    o.feature_dim = D;
    o.block_size = B;
    o.window = W;
    o.max_seqs = seqs;
    o.storage = st;
    o.rows = mode;
    return o;
}

PrefixStoreOptions popts(const StagerOptions& s, std::int64_t bt, std::int64_t budget) {
    return prefix_store_options(s, bt, budget);
}

// Rows like activations: a position-dependent ramp plus one large channel.
std::vector<float> rows_for(std::int64_t from, std::int64_t n) {
    std::vector<float> r(static_cast<std::size_t>(n * D));
    for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t c = 0; c < D; ++c)
            r[static_cast<std::size_t>(i * D + c)] =
                (c == 5 ? 900.0f : 1.0f) * (0.01f * float((from + i) % 97) - 0.3f + 0.002f * float(c));
    return r;
}

void process(Stager& s, std::int64_t seq, std::int64_t from, std::int64_t n, std::vector<std::int64_t>* slots = nullptr) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = from + i;
    if (s.external()) {
        std::vector<std::int64_t> out(static_cast<std::size_t>(n));
        s.process_external(seq, p.data(), p.size(), out.data());
        if (slots) *slots = out;
        return;
    }
    const auto r = rows_for(from, n);
    s.process(seq, p.data(), p.size(), r.data(), ElemType::F32);
}

// A chain of keys "k<block start>" for blocks of bt positions covering [0, h).
struct Chain {
    std::string bytes;
    std::vector<std::size_t> offsets{0};
    Chain(std::int64_t lo, std::int64_t h, std::int64_t bt, const std::string& tag = "") {
        for (std::int64_t s = lo; s < h; s += bt) {
            bytes += "k" + tag + std::to_string(s) + ":" + std::to_string(std::min(s + bt, h));
            offsets.push_back(bytes.size());
        }
    }
    KeyChain view() const {
        return KeyChain{reinterpret_cast<const std::uint8_t*>(bytes.data()), offsets.data(), offsets.size() - 1};
    }
};

struct Round {
    RoundPlan plan;
    ByteVec rows;
};

Round draft(Stager& s, std::int64_t seq, std::int64_t n_past) {
    Round r;
    r.plan = s.draft(seq, n_past, r.rows);
    return r;
}

bool same_plan(const RoundPlan& a, const RoundPlan& b) {
    return a.skip == b.skip && a.rebase == b.rebase && a.clear_cache == b.clear_cache && a.start == b.start &&
           a.pos_base == b.pos_base && a.first_row == b.first_row && a.n_rows == b.n_rows && a.crop_from == b.crop_from;
}

// Publishes [0, h) of seq into the store block by block, as a server hands them over after each chunk.
void prefill_and_publish(Stager& st, std::int64_t seq, PrefixStore& store, std::int64_t h, std::int64_t chunk) {
    const std::int64_t bt = store.options().block_tokens;
    st.begin(seq);
    for (std::int64_t at = 0; at < h;) {
        const std::int64_t n = std::min(chunk, h - at);
        process(st, seq, at, n);
        at += n;
        // every block that is complete now, and the partial one at the end
        const std::int64_t lo = (at - n) / bt * bt;
        const std::int64_t hi = at == h ? h : at / bt * bt;
        if (hi > lo) {
            Chain c(lo, hi, bt);
            st.publish_prefix(seq, store, c.view(), lo, hi);
        }
    }
}

}  // namespace

TEST_CASE(keep_rule_keeps_blocks_below_W_minus_B_whole_and_the_last_K_rows_above) {
    // W = 64, B = 4: K = 32, W - B = 60.
    const auto so = sopts(4, 64);
    PrefixStore small(popts(so, 16, 1 << 20));  // blocks <= K: every row
    Stager st(so);
    prefill_and_publish(st, 0, small, 200, 16);
    for (std::int64_t s = 0; s < 200; s += 16) {
        const std::string k = "k" + std::to_string(s) + ":" + std::to_string(std::min<std::int64_t>(s + 16, 200));
        CHECK_EQ(small.info(k).rows, std::min<std::int64_t>(16, 200 - s));
    }
    // Whole-prompt blocks (block_tokens 1000 > K).
    PrefixStore big(popts(so, 1000, 1 << 22));
    st.begin(1);
    process(st, 1, 0, 60);
    Chain c(0, 60, 1000);
    st.publish_prefix(1, big, c.view(), 0, 60);
    CHECK_EQ(big.info("k0:60").rows, 60);  // ends at W - B: a hit at 60 stages all of it
    st.begin(2);
    process(st, 2, 0, 61);
    Chain c2(0, 61, 1000);
    st.publish_prefix(2, big, c2.view(), 0, 61);
    CHECK_EQ(big.info("k0:61").rows, 32);  // a hit at 61 rebases: the last K rows
    CHECK_EQ(big.info("k0:61").kept.first, 61 - 32);
    // Long blocks from the ring: at completion the ring still holds their last K rows.
    st.begin(0);
    process(st, 0, 0, 2000);
    Chain c3(1000, 2000, 1000, "x");
    st.publish_prefix(0, big, c3.view(), 1000, 2000);
    CHECK_EQ(big.info("kx1000:2000").rows, 32);
    // ... and from the caller's rows.
    const auto r = rows_for(0, 2000);
    Chain c4(0, 2000, 1000, "y");
    big.publish_rows(c4.view(), 0, 2000, r.data(), ElemType::F32, r.size() * 4);
    CHECK_EQ(big.info("ky0:1000").rows, 32);
    CHECK_EQ(big.info("ky0:1000").kept.first, 1000 - 32);
    CHECK_EQ(big.info("ky1000:2000").kept.first, 2000 - 32);
}

// The claim: after a hit at h, every round equals a full prefill's (plan and
// staged bytes), for every storage and for hits below and above W - B.
TEST_CASE(hit_rounds_equal_a_full_prefill) {
    const Storage storages[] = {Storage::F32, Storage::F16, Storage::BF16, Storage::Q8_0, Storage::Q4_0};
    for (Storage stg : storages)
        for (std::int64_t bt : {8, 16, 100})
            for (std::int64_t h : {8, 16, 40, 56, 57, 60, 61, 96, 100, 200, 333}) {  // W - B = 60
                const auto so = sopts(4, 64, stg);
                PrefixStore store(popts(so, bt, 1 << 22));
                Stager pub(so), full(so), hit(so);
                prefill_and_publish(pub, 0, store, h, 24);
                const std::int64_t n = h + 7;  // the new request: 7 more prompt tokens
                full.begin(0);
                process(full, 0, 0, n);
                Chain c(0, h, bt);
                std::vector<SlotMove> moves;
                const PrefixHit r = hit.start_from_prefix(0, store, c.view(), h, &moves);
                CHECK_EQ(r.replay_from, h);
                CHECK(r.exact);
                CHECK_EQ(r.first_row, h <= 60 ? 0 : h - 32);
                process(hit, 0, h, n - h);
                std::int64_t at = n;
                for (int round = 0; round < 12; ++round) {
                    Round a = draft(full, 0, at), b = draft(hit, 0, at);
                    CHECK(same_plan(a.plan, b.plan));
                    CHECK(a.rows.size() == b.rows.size() && std::memcmp(a.rows.data(), b.rows.data(), a.rows.size()) == 0);
                    full.commit(0);
                    hit.commit(0);
                    process(full, 0, at, 5);
                    process(hit, 0, at, 5);
                    full.accept(0, 2);
                    hit.accept(0, 2);
                    at += 3;
                }
            }
}

TEST_CASE(a_miss_names_the_cheapest_replay_never_more_than_K) {
    const auto so = sopts(4, 64);  // K = 32, W - B = 60
    const std::int64_t bt = 8, h = 200;
    PrefixStore store(popts(so, bt, 1 << 22));
    Stager pub(so), hit(so);
    prefill_and_publish(pub, 0, store, h, 24);
    Chain c(0, h, bt);
    // Drop the block [176, 184): rows [168, 176) are still held, so replay from 176.
    Chain gone(176, 184, bt);
    store.evict(gone.view());
    std::vector<SlotMove> moves;
    PrefixHit r = hit.start_from_prefix(0, store, c.view(), h, &moves);
    CHECK_EQ(r.first_row, h - 32);
    CHECK_EQ(r.replay_from, 176);
    CHECK_EQ(r.rows, 176 - (h - 32));
    const SeqState s = hit.state(0);
    CHECK_EQ(s.end, 176);
    CHECK_EQ(s.pos_base, 0);
    CHECK(s.restage_owed);
    // Nothing held: replay the last K positions (never the prompt).
    PrefixStore empty(popts(so, bt, 1 << 22));
    r = hit.start_from_prefix(1, empty, c.view(), h, &moves);
    CHECK_EQ(r.replay_from, h - 32);
    CHECK_EQ(r.rows, 0);
    // A short prompt (h <= W - B) missing its first block: no replay longer than K.
    PrefixStore s2(popts(so, bt, 1 << 22));
    prefill_and_publish(pub, 1, s2, 56, 24);
    Chain c56(0, 56, bt), first(0, 8, bt);
    s2.evict(first.view());
    r = hit.start_from_prefix(2, s2, c56.view(), 56, &moves);
    CHECK_EQ(r.replay_from, 56);
    CHECK_EQ(r.first_row, 8);
    CHECK_EQ(r.origin, 8);
    CHECK(!r.exact);
    CHECK_EQ(hit.state(2).pos_base, 8);
    Round a = draft(hit, 2, 56);
    CHECK_EQ(a.plan.first_row, 8);  // 48 rows of context, at drafter positions [0, 48)
    CHECK_EQ(a.plan.pos_base, 8);
}

TEST_CASE(budget_lru_and_eviction_by_key) {
    const auto so = sopts(4, 64);
    const std::int64_t bt = 8;
    const std::uint64_t page = 8 * D * 4;
    CHECK_THROWS(PrefixStore(popts(so, bt, page - 1)), ConfigError);
    CHECK_EQ(PrefixStore(popts(so, bt, page)).n_pages(), 1);  // exactly one block fits
    PrefixStore store(popts(so, bt, 5 * page + 7));
    CHECK_EQ(store.n_pages(), 5);
    Stager st(so);
    prefill_and_publish(st, 0, store, 56, 8);  // 7 blocks into 5 pages: the first two go
    CHECK_EQ(static_cast<std::int64_t>(store.size()), 5);
    CHECK(!store.contains("k0:8") && !store.contains("k8:16") && store.contains("k16:24"));
    CHECK(store.stats().bytes <= static_cast<std::int64_t>(5 * page + 7));
    CHECK_EQ(store.stats().evicted_lru, 2);
    // A hit refreshes the blocks it reads: k16:24 is not the oldest any more.
    Chain c(0, 56, bt);
    std::vector<SlotMove> moves;
    st.start_from_prefix(1, store, c.view(), 56, &moves);
    // (h = 56 <= W - B needs rows from 0: the store lacks [0, 16): graceful, K rows from 24)
    CHECK(store.keys().front() == std::string("k16:24"));
    Chain ev(16, 32, bt);
    CHECK_EQ(store.evict(ev.view()), 2);
    CHECK_EQ(store.evict(ev.view()), 0);
    CHECK_EQ(static_cast<std::int64_t>(store.size()), 3);
    CHECK_EQ(store.stats().evicted_by_key, 2);
    // The lowest free page first: the pages of k16:24 and k24:32 are free again; a new block
    // takes the lower of them.
    std::int64_t lowest = store.n_pages();
    const auto r = rows_for(500, 8);
    Chain fresh(0, 8, bt, "z");
    store.publish_rows(fresh.view(), 0, 8, r.data(), ElemType::F32, r.size() * 4);
    std::vector<bool> used(static_cast<std::size_t>(store.n_pages()), false);
    for (const std::string& k : store.keys())
        if (k != "kz0:8") used[static_cast<std::size_t>(store.block_slots(k).front() / store.page_rows())] = true;
    for (std::int64_t p = 0; p < store.n_pages(); ++p)
        if (!used[static_cast<std::size_t>(p)]) {
            lowest = p;
            break;
        }
    CHECK_EQ(store.block_slots("kz0:8").front(), lowest * store.page_rows());
}

TEST_CASE(a_hit_refreshes_the_blocks_it_read) {
    const auto so = sopts(4, 64);  // K = 32
    const std::int64_t bt = 8;
    PrefixStore store(popts(so, bt, 1 << 20));
    Stager st(so);
    prefill_and_publish(st, 0, store, 100, 24);  // k0:8 .. k96:100
    const auto r = rows_for(0, 16);
    Chain other(0, 16, bt, "q");
    store.publish_rows(other.view(), 0, 16, r.data(), ElemType::F32, r.size() * 4);  // newer than all of them
    Chain c(0, 100, bt);
    std::vector<SlotMove> moves;
    st.start_from_prefix(1, store, c.view(), 100, &moves);  // reads [68, 100): blocks k64:72 .. k96:100
    const auto keys = store.keys();
    CHECK(keys.front() == std::string("k0:8"));
    CHECK(keys.back() == std::string("k96:100"));
    CHECK(keys[keys.size() - 6] == std::string("kq8:16"));  // the other prompt is older now
    // The lowest free page first, before pages never used: k0:8 held page 0.
    CHECK_EQ(store.block_slots("k0:8").front(), 0);
    Chain first(0, 8, bt);
    store.evict(first.view());
    Chain z(0, 8, bt, "z");
    store.publish_rows(z.view(), 0, 8, r.data(), ElemType::F32, 8 * D * 4);
    CHECK_EQ(store.block_slots("kz0:8").front(), 0);
}

TEST_CASE(rejected_calls_change_nothing) {
    const auto so = sopts(4, 64);
    const std::int64_t bt = 8;
    PrefixStore store(popts(so, bt, 1 << 20));
    Stager st(so);
    prefill_and_publish(st, 0, store, 40, 16);
    const auto before = store.keys();
    // A chain whose keys name other positions.
    Chain shifted(8, 48, bt);
    std::vector<SlotMove> moves;
    CHECK_THROWS(st.start_from_prefix(1, store, shifted.view(), 40, &moves), std::invalid_argument);
    // Wrong chain length, bad start.
    Chain c(0, 40, bt);
    CHECK_THROWS(st.start_from_prefix(1, store, c.view(), 48, &moves), std::invalid_argument);
    CHECK_THROWS(st.publish_prefix(0, store, c.view(), 4, 40), std::invalid_argument);
    // The same block with other rows.
    auto other = rows_for(1000, 8);
    Chain k0(0, 8, bt);
    CHECK_THROWS(store.publish_rows(k0.view(), 0, 8, other.data(), ElemType::F32, other.size() * 4), std::invalid_argument);
    // The same rows again: a refresh.
    auto same = rows_for(0, 8);
    store.publish_rows(k0.view(), 0, 8, same.data(), ElemType::F32, same.size() * 4);
    CHECK_EQ(store.stats().republished, 1);
    CHECK(store.keys().back() == std::string("k0:8"));
    // A Stager of another configuration.
    Stager other_cfg(sopts(4, 64, Storage::Q8_0));
    CHECK_THROWS(other_cfg.publish_prefix(0, store, c.view(), 0, 40), ConfigError);
    // Rows past the sequence's final rows; rows of a verify batch before accept().
    Chain c48(0, 48, bt);
    CHECK_THROWS(st.publish_prefix(0, store, c48.view(), 0, 48), std::invalid_argument);
    ByteVec out;
    st.draft(0, 40, out);
    st.commit(0);
    process(st, 0, 40, 5);  // a verify batch: rows 41..44 are tentative until accept
    Chain v(40, 48, bt, "v");
    CHECK_THROWS(st.publish_prefix(0, store, v.view(), 40, 42), std::invalid_argument);
    st.accept(0, 4);
    // Rows that left the window (the sequence holds its last W = 64 positions).
    process(st, 0, 45, 100);
    Chain gone(40, 48, bt, "g");
    CHECK_THROWS(st.publish_prefix(0, store, gone.view(), 40, 48), std::invalid_argument);
    CHECK_EQ(static_cast<std::int64_t>(store.size()), 5);
    CHECK(store.stats().hits == 0);
    CHECK(store.keys() == before || store.keys().back() == std::string("k0:8"));  // the refresh above only
}

TEST_CASE(export_import_round_trip_and_damage) {
    const auto so = sopts(4, 64, Storage::Q4_0);
    const std::int64_t bt = 8;
    PrefixStore a(popts(so, bt, 1 << 20)), b(popts(so, bt, 1 << 20));
    Stager st(so);
    prefill_and_publish(st, 0, a, 100, 24);
    Chain c(0, 100, bt);
    for (std::size_t i = 0; i < c.offsets.size() - 1; ++i) {
        const std::string key = c.bytes.substr(c.offsets[i], c.offsets[i + 1] - c.offsets[i]);
        std::vector<std::uint8_t> data(a.export_size(key));
        CHECK_EQ(a.export_into(key, data.data(), data.size()), data.size());
        if (i == 3) {
            auto bad = data;
            bad[bad.size() - 1] ^= 1;
            CHECK_THROWS(b.import_block(bad.data(), bad.size()), std::invalid_argument);
            CHECK(!b.contains(key));
        }
        b.import_block(data.data(), data.size());
    }
    Stager x(so), y(so);
    std::vector<SlotMove> moves;
    x.start_from_prefix(0, a, c.view(), 100, &moves);
    y.start_from_prefix(0, b, c.view(), 100, &moves);
    process(x, 0, 100, 3);
    process(y, 0, 100, 3);
    Round p = draft(x, 0, 103), q = draft(y, 0, 103);
    CHECK(same_plan(p.plan, q.plan));
    CHECK(p.rows.size() == q.rows.size() && std::memcmp(p.rows.data(), q.rows.data(), p.rows.size()) == 0);
    // Another configuration cannot import.
    PrefixStore f32(popts(sopts(4, 64), bt, 1 << 20));
    std::vector<std::uint8_t> data(a.export_size("k0:8"));
    a.export_into("k0:8", data.data(), data.size());
    CHECK_THROWS(f32.import_block(data.data(), data.size()), std::invalid_argument);
}

// External rows: the store's rows live in the owner's table; mirror tables
// driven only by the returned slots and moves give the held rows.
TEST_CASE(external_moves_mirror_held_rows) {
    const auto held_o = sopts(4, 64, Storage::F16);
    const auto ext_o = sopts(4, 64, Storage::F16, RowMode::External);
    const std::int64_t bt = 8, h = 150;
    PrefixStore hs(popts(held_o, bt, 1 << 20)), es(popts(ext_o, bt, 1 << 20));
    Stager held(held_o), ext(ext_o);
    const std::size_t rb = held.row_bytes();
    std::vector<std::uint8_t> ring(static_cast<std::size_t>(ext.ring_rows() * 3) * rb), table(static_cast<std::size_t>(es.table_rows()) * rb);
    auto write = [&](std::int64_t from, std::int64_t n, const std::vector<std::int64_t>& slots) {
        const auto r = rows_for(from, n);
        std::vector<std::uint8_t> enc(static_cast<std::size_t>(n) * rb);
        encode_rows(r.data(), ElemType::F32, enc.data(), Storage::F16, static_cast<std::size_t>(n), D, NonFinite::Error);
        for (std::int64_t i = 0; i < n; ++i)
            if (slots[static_cast<std::size_t>(i)] >= 0)
                std::memcpy(ring.data() + static_cast<std::size_t>(slots[static_cast<std::size_t>(i)]) * rb,
                            enc.data() + static_cast<std::size_t>(i) * rb, rb);
    };
    auto apply = [&](const std::vector<SlotMove>& moves, std::uint8_t* from, std::uint8_t* to) {
        for (const SlotMove& m : moves)
            std::memcpy(to + static_cast<std::size_t>(m.dst) * rb, from + static_cast<std::size_t>(m.src) * rb,
                        static_cast<std::size_t>(m.count) * rb);
    };
    prefill_and_publish(held, 0, hs, h, 24);
    ext.begin(0);
    for (std::int64_t at = 0; at < h;) {
        const std::int64_t n = std::min<std::int64_t>(24, h - at);
        std::vector<std::int64_t> slots;
        process(ext, 0, at, n, &slots);
        write(at, n, slots);
        at += n;
        const std::int64_t lo = (at - n) / bt * bt, hi = at == h ? h : at / bt * bt;
        Chain c(lo, hi, bt);
        apply(ext.publish_prefix(0, es, c.view(), lo, hi), ring.data(), table.data());
    }
    CHECK(hs.keys() == es.keys());
    Chain c(0, h, bt);
    std::vector<SlotMove> hm, em;
    held.start_from_prefix(1, hs, c.view(), h, &hm);
    const PrefixHit r = ext.start_from_prefix(1, es, c.view(), h, &em);
    CHECK(hm.empty());
    CHECK(!em.empty());
    apply(em, table.data(), ring.data());
    std::vector<std::int64_t> slots;
    process(ext, 1, h, 4, &slots);
    write(h, 4, slots);
    process(held, 1, h, 4);
    Round a = draft(held, 1, h + 4), b = draft(ext, 1, h + 4);
    CHECK(same_plan(a.plan, b.plan));
    CHECK_EQ(r.rows, 32);
    // The external plan's slots hold the held plan's rows.
    std::vector<std::uint8_t> got;
    for (const SlotRun& run : b.plan.slot_runs)
        got.insert(got.end(), ring.begin() + run.first * static_cast<std::int64_t>(rb),
                   ring.begin() + (run.first + run.count) * static_cast<std::int64_t>(rb));
    CHECK(got.size() == a.rows.size() && std::memcmp(got.data(), a.rows.data(), got.size()) == 0);
}

TEST_CASE(prefix_moves_take_the_stagers_serials) {
    // Publish and hit moves are table changes of the Stager: numbered with its forks, shifts
    // and restores (one counter), only when something moves.
    const auto o = sopts(4, 64, Storage::F32, RowMode::External, 4);
    Stager st(o);
    PrefixStore store(popts(o, 8, 1 << 20));
    process(st, 0, 0, 40);
    std::uint64_t fork_serial = 9, publish_serial = 9, hit_serial = 9, empty_serial = 9;
    CHECK(!st.fork(0, 1, &fork_serial).empty());
    Chain c(0, 40, 8);
    CHECK(!st.publish_prefix(0, store, c.view(), 0, 40, &publish_serial).empty());
    std::vector<SlotMove> moves;
    st.start_from_prefix(2, store, c.view(), 40, &moves, &hit_serial);
    CHECK(!moves.empty());
    CHECK_EQ(fork_serial, 1u);
    CHECK_EQ(publish_serial, 2u);
    CHECK_EQ(hit_serial, 3u);
    Chain none(0, 0, 8);
    st.start_from_prefix(3, store, none.view(), 0, &moves, &empty_serial);
    CHECK(moves.empty());
    CHECK_EQ(empty_serial, 0u);
    CHECK(st.publish_prefix(0, store, c.view(), 0, 40, &publish_serial).empty());  // a refresh: nothing moves
    CHECK_EQ(publish_serial, 0u);
    CHECK_EQ(st.moves_issued(), 3u);
    // A rejected call takes no serial.
    CHECK_THROWS(st.publish_prefix(0, store, c.view(), 0, 48), std::invalid_argument);
    CHECK_EQ(st.moves_issued(), 3u);
    // Held rows: the core copied them, nothing to number.
    const auto h = sopts(4, 64);
    Stager held(h);
    PrefixStore hs(popts(h, 8, 1 << 20));
    process(held, 0, 0, 40);
    CHECK(held.publish_prefix(0, hs, c.view(), 0, 40, &publish_serial).empty());
    held.start_from_prefix(1, hs, c.view(), 40, nullptr, &hit_serial);
    CHECK_EQ(publish_serial + hit_serial, 0u);
    CHECK_EQ(held.moves_issued(), 0u);
}

TEST_CASE(slots_are_asked_for_only_after_every_check) {
    // publish_slots and import_block allocate the slots they return only for a call that passed
    // every check: an absurd range is a ValueError, never an allocation; a sink that refuses
    // (a C caller's short buffer) leaves the store as it was.
    const auto o = sopts(4, 64, Storage::F32, RowMode::External);
    PrefixStore store(popts(o, 8, 1 << 20));
    bool asked = false;
    auto sink = [&](std::size_t) -> std::int64_t* {
        asked = true;
        throw BufferTooSmall("short", 8);
    };
    Chain one(0, 8, 8);
    CHECK_THROWS(store.publish_slots(one.view(), 0, std::int64_t(1) << 61, sink), std::invalid_argument);
    CHECK(!asked);
    CHECK_THROWS(store.publish_slots(one.view(), 0, 8, sink), BufferTooSmall);
    CHECK(asked);
    CHECK_EQ(store.size(), 0u);
    CHECK_EQ(store.stats().published, 0);
    const std::vector<std::int64_t> slots = store.publish_slots(one.view(), 0, 8);
    CHECK_EQ(slots.size(), 8u);
    CHECK_EQ(slots[0], 0);
    // Export: a short buffer is BufferTooSmall with the size needed, nothing written.
    const std::string key = one.bytes;
    std::vector<std::uint8_t> rows(8 * store.row_bytes(), 7), out(store.export_size(key));
    try {
        store.export_into(key, out.data(), out.size() - 1, rows.data(), rows.size());
        CHECK(false);
    } catch (const BufferTooSmall& e) {
        CHECK_EQ(e.needed, out.size());
    }
    CHECK_EQ(store.export_into(key, out.data(), out.size(), rows.data(), rows.size()), out.size());
    // Import: damaged data never reaches the sink; a refusing sink changes nothing.
    PrefixStore other(popts(o, 8, 1 << 20));
    asked = false;
    std::vector<std::uint8_t> bad = out;
    bad.back() ^= 1;
    CHECK_THROWS(other.import_block(bad.data(), bad.size(), sink), std::invalid_argument);
    CHECK(!asked);
    CHECK_THROWS(other.import_block(out.data(), out.size(), sink), BufferTooSmall);
    CHECK(asked);
    CHECK_EQ(other.size(), 0u);
    CHECK_EQ(other.import_block(out.data(), out.size()).size(), 8u);
    CHECK_EQ(other.size(), 1u);
}

TEST_MAIN()

// publishable(seq): [horizon, the final rows' end); a block inside it
// publishes, one a row past either end is refused (W = 64, B = 4, blocks of 8).
TEST_CASE(publishable_is_the_range_whose_whole_blocks_publish) {
    const auto so = sopts(4, 64);
    Stager st(so);
    CHECK(st.publishable(0) == std::make_pair(std::int64_t{0}, std::int64_t{0}));  // no rows yet
    process(st, 0, 0, 150);
    draft(st, 0, 150);
    st.commit(0);
    process(st, 0, 150, 5);  // a verify batch: its first row is final, the rest wait for accept
    const auto range = st.publishable(0);
    CHECK_EQ(range.first, st.state(0).horizon);
    CHECK_EQ(range.second, 151);
    CHECK(range.first > 0);
    const std::int64_t lo = (range.first + 7) / 8 * 8, hi = range.second / 8 * 8;
    for (std::int64_t s = lo - 8; s <= hi; s += 8) {
        PrefixStore store(popts(so, 8, 1 << 20));
        Chain c(s, s + 8, 8);
        bool ok = true;
        try {
            st.publish_prefix(0, store, c.view(), s, s + 8);
        } catch (const std::invalid_argument&) {
            ok = false;
        }
        CHECK_EQ(ok, s >= range.first && s + 8 <= range.second);
    }
    st.accept(0, 4);
    CHECK_EQ(st.publishable(0).second, 155);
}
