// Tests of the prefix store's C ABI (dspark/dspark.h, "prefix store"): a hit
// through the C calls restages what a full prefill stages (held rows; and
// external rows, with the moves applied to caller-owned tables), keys list
// in LRU order, export / import across stores, and every rejected call
// returns its status code, names the problem and changes nothing.
#include <cstring>
#include <string>
#include <vector>

#include "c_api_common.hpp"
#include "check.hpp"
#include "dspark/dspark.h"
#include "dspark/prefix_store.hpp"

namespace {

constexpr std::int64_t D = 64, B = 4, W = 64, BT = 8;  // K = 32, W - B = 60

dspark_stager* make_stager(std::int32_t rows_mode = DSPARK_ROWS_HELD, std::int32_t storage = DSPARK_STORAGE_F32) {
    dspark_config c;
    dspark_config_init(&c);
    c.feature_dim = D;
    c.block_size = B;
    c.window = W;
    c.max_seqs = 2;
    c.storage = storage;
    c.rows_mode = rows_mode;
    dspark_stager* st = nullptr;
    if (dspark_stager_create(&c, &st) != DSPARK_OK) std::printf("  create failed: %s\n", dspark_last_error());
    return st;
}

std::vector<float> rows_for(std::int64_t from, std::int64_t n) {
    std::vector<float> r(static_cast<std::size_t>(n * D));
    for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t c = 0; c < D; ++c)
            r[static_cast<std::size_t>(i * D + c)] = (c == 3 ? 2e3f : 1.0f) * float((from + i) % 53) * 0.03f - float(c) * 0.01f;
    return r;
}

std::vector<std::int64_t> span(std::int64_t from, std::int64_t n) {
    std::vector<std::int64_t> p(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = from + i;
    return p;
}

// uint64 keys (8 bytes each) of blocks [lo, hi) of a prompt.
struct Chain {
    std::vector<std::uint64_t> keys;
    std::vector<std::size_t> offsets{0};
    Chain(std::int64_t lo, std::int64_t hi, std::uint64_t tag = 0) {
        for (std::int64_t s = lo; s < hi; s += BT) {
            keys.push_back((0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(s + 1) ^ static_cast<std::uint64_t>(std::min(s + BT, hi))) + (tag << 56));
            offsets.push_back(offsets.back() + 8);
        }
    }
    const std::uint8_t* bytes() const { return reinterpret_cast<const std::uint8_t*>(keys.data()); }
    std::size_t n() const { return keys.size(); }
};

// A held-row and an external-row Stager, each with its store (block_tokens BT, 1 MiB).
struct HeldAndExternal {
    dspark_stager* held = make_stager();
    dspark_stager* ext = make_stager(DSPARK_ROWS_EXTERNAL);
    dspark_prefix_store *hs = nullptr, *es = nullptr;
    HeldAndExternal() {
        CHECK_EQ(dspark_prefix_store_create(held, BT, 1 << 20, &hs), DSPARK_OK);
        CHECK_EQ(dspark_prefix_store_create(ext, BT, 1 << 20, &es), DSPARK_OK);
    }
    ~HeldAndExternal() {
        dspark_prefix_store_destroy(hs);
        dspark_prefix_store_destroy(es);
        dspark_stager_destroy(held);
        dspark_stager_destroy(ext);
    }
    HeldAndExternal(const HeldAndExternal&) = delete;
    HeldAndExternal& operator=(const HeldAndExternal&) = delete;
};

bool mentions(const char* what) { return std::strstr(dspark_last_error(), what) != nullptr; }

void prefill_publish(dspark_stager* st, dspark_prefix_store* store, std::int64_t seq, std::int64_t h,
                     std::vector<std::uint8_t>* ring = nullptr, std::vector<std::uint8_t>* table = nullptr) {
    CHECK_EQ(dspark_begin(st, seq), DSPARK_OK);
    size_t rb = 0;
    dspark_stager_row_bytes(st, &rb);
    for (std::int64_t at = 0; at < h; at += 24) {
        const std::int64_t n = std::min<std::int64_t>(24, h - at);
        const auto pos = span(at, n);
        const auto rows = rows_for(at, n);
        if (ring) {
            std::vector<std::int64_t> slots(static_cast<std::size_t>(n));
            CHECK_EQ(dspark_process_external(st, seq, pos.data(), pos.size(), slots.data()), DSPARK_OK);
            for (std::int64_t i = 0; i < n; ++i)  // f32 storage: the encoded row is the row
                if (slots[static_cast<std::size_t>(i)] >= 0)
                    std::memcpy(ring->data() + static_cast<std::size_t>(slots[static_cast<std::size_t>(i)]) * rb,
                                rows.data() + i * D, rb);
        } else {
            CHECK_EQ(dspark_process(st, seq, pos.data(), pos.size(), rows.data(), DSPARK_DTYPE_F32, rows.size() * 4), DSPARK_OK);
        }
        const std::int64_t lo = at / BT * BT, hi = at + n == h ? h : (at + n) / BT * BT;
        if (hi <= lo) continue;
        Chain c(lo, hi);
        CHECK_EQ(dspark_prefix_publish(st, seq, store, c.bytes(), c.offsets.data(), c.n(), lo, hi), DSPARK_OK);
        if (table) {
            const dspark_slot_move* m = nullptr;
            size_t k = 0;
            dspark_last_moves(&m, &k);
            for (size_t i = 0; i < k; ++i)
                std::memcpy(table->data() + static_cast<std::size_t>(m[i].dst) * rb,
                            ring->data() + static_cast<std::size_t>(m[i].src) * rb, static_cast<std::size_t>(m[i].count) * rb);
        }
    }
}

}  // namespace

TEST_CASE(c_hit_restages_what_a_full_prefill_stages) {
    dspark_stager* st = make_stager();
    dspark_prefix_store* store = nullptr;
    CHECK_EQ(dspark_prefix_store_create(st, BT, 1 << 20, &store), DSPARK_OK);
    const std::int64_t h = 100, n = 104;
    prefill_publish(st, store, 0, h);
    Chain c(0, h);
    dspark_prefix_hit_result r;
    CHECK_EQ(dspark_prefix_hit(st, 1, store, c.bytes(), c.offsets.data(), c.n(), h, &r), DSPARK_OK);
    CHECK_EQ(r.replay_from, h);
    CHECK_EQ(r.first_row, h - 32);
    CHECK_EQ(r.rows, 32);
    CHECK_EQ(r.exact, 1);
    // Every field of the result, each from its own member: the sequence's origin is 0 (as after
    // a full prefill), not first_row; the rows came from the blocks of [h - 32, h).
    CHECK_EQ(r.n_tokens, h);
    CHECK_EQ(r.need_first, h - 32);
    CHECK_EQ(r.origin, 0);
    CHECK_EQ(r.blocks_found, (h + BT - 1) / BT - (h - 32) / BT);
    const auto pos = span(h, n - h);
    const auto rows = rows_for(h, n - h);
    CHECK_EQ(dspark_process(st, 1, pos.data(), pos.size(), rows.data(), DSPARK_DTYPE_F32, rows.size() * 4), DSPARK_OK);
    dspark_stager* full = make_stager();
    const auto all = span(0, n);
    const auto all_rows = rows_for(0, n);
    dspark_begin(full, 0);
    CHECK_EQ(dspark_process(full, 0, all.data(), all.size(), all_rows.data(), DSPARK_DTYPE_F32, all_rows.size() * 4), DSPARK_OK);
    std::vector<float> a(static_cast<std::size_t>(W * D)), b(a.size());
    dspark_plan pa, pb;
    size_t wa = 0, wb = 0;
    CHECK_EQ(dspark_draft(full, 0, n, DSPARK_DTYPE_F32, a.data(), a.size() * 4, &pa, &wa), DSPARK_OK);
    CHECK_EQ(dspark_draft(st, 1, n, DSPARK_DTYPE_F32, b.data(), b.size() * 4, &pb, &wb), DSPARK_OK);
    CHECK_EQ(pa.pos_base, pb.pos_base);
    CHECK_EQ(pa.n_rows, pb.n_rows);
    CHECK_EQ(pa.rebase, pb.rebase);
    CHECK(wa == wb && std::memcmp(a.data(), b.data(), wa) == 0);
    // Keys in LRU order: the hit refreshed the blocks it read, the newest last.
    size_t nk = 0, need = 0;
    CHECK_EQ(dspark_prefix_keys(store, nullptr, 0, nullptr, 0, &nk, &need), DSPARK_E_BUFFER_TOO_SMALL);
    CHECK_EQ(nk, 13u);
    CHECK_EQ(need, 13u * 8);
    std::vector<std::uint8_t> kb(need);
    std::vector<size_t> ko(nk + 1);
    CHECK_EQ(dspark_prefix_keys(store, kb.data(), kb.size(), ko.data(), ko.size(), &nk, &need), DSPARK_OK);
    CHECK(std::memcmp(kb.data() + ko[nk - 1], c.bytes() + c.offsets[12], 8) == 0);
    CHECK(std::memcmp(kb.data(), c.bytes(), 8) == 0);  // block 0: not read by the hit, the oldest
    dspark_prefix_stats s;
    dspark_prefix_stats_init(&s);
    CHECK_EQ(dspark_prefix_stats_get(store, &s), DSPARK_OK);
    CHECK_EQ(s.blocks, 13);
    CHECK_EQ(s.hits, 1);
    CHECK_EQ(s.full_hits, 1);
    dspark_prefix_store_destroy(store);
    dspark_stager_destroy(st);
    dspark_stager_destroy(full);
}

// dspark_prefix_hit_result / dspark_prefix_stats are filled from the core's
// field lists (DSPARK_PREFIX_HIT_FIELDS / DSPARK_PREFIX_STATS_FIELDS): a field
// the header lacks does not compile, a field only the header has breaks the
// size check, and every field is set (no 0xAB byte pattern left).
TEST_CASE(c_hit_and_stats_fill_every_field) {
    dspark_stager* st = make_stager();
    dspark_prefix_store* store = nullptr;
    CHECK_EQ(dspark_prefix_store_create(st, BT, 1 << 20, &store), DSPARK_OK);
    const std::int64_t h = 100;
    prefill_publish(st, store, 0, h);
    Chain c(0, h);
    dspark_prefix_hit_result r;
    dspark_prefix_stats s;
    std::memset(&r, 0xAB, sizeof r);
    std::memset(&s, 0xAB, sizeof s);
    s.struct_size = sizeof s;
    CHECK_EQ(dspark_prefix_hit(st, 1, store, c.bytes(), c.offsets.data(), c.n(), h, &r), DSPARK_OK);
    CHECK_EQ(dspark_prefix_stats_get(store, &s), DSPARK_OK);
    {
        const dspark_prefix_hit_result& rec = r;
        c_api_test::FieldCount count;
        count.bytes = sizeof(rec.reserved0);
        DSPARK_PREFIX_HIT_FIELDS(DSPARK_COUNT_FIELD)
        CHECK_EQ(count.set, count.fields);
        CHECK_EQ(sizeof(dspark_prefix_hit_result), count.bytes);
    }
    {
        const dspark_prefix_stats& rec = s;
        c_api_test::FieldCount count;
        count.bytes = sizeof(rec.struct_size) + sizeof(rec.reserved0);
        DSPARK_PREFIX_STATS_FIELDS(DSPARK_COUNT_FIELD)
        CHECK_EQ(count.set, count.fields);
        CHECK_EQ(sizeof(dspark_prefix_stats), count.bytes);
    }
    dspark_prefix_store_destroy(store);
    dspark_stager_destroy(st);
}

TEST_CASE(c_external_moves_fill_the_callers_tables) {
    const HeldAndExternal pair;
    dspark_stager *held = pair.held, *ext = pair.ext;
    dspark_prefix_store *hs = pair.hs, *es = pair.es;
    int64_t ring_rows = 0, table_rows = 0;
    dspark_ring_rows(ext, &ring_rows);
    CHECK_EQ(dspark_prefix_store_layout(es, nullptr, nullptr, &table_rows), DSPARK_OK);
    std::vector<std::uint8_t> ring(static_cast<std::size_t>(2 * ring_rows * D * 4)), table(static_cast<std::size_t>(table_rows * D * 4));
    const std::int64_t h = 90;
    prefill_publish(held, hs, 0, h);
    prefill_publish(ext, es, 0, h, &ring, &table);
    Chain c(0, h);
    dspark_prefix_hit_result r;
    CHECK_EQ(dspark_prefix_hit(ext, 1, es, c.bytes(), c.offsets.data(), c.n(), h, &r), DSPARK_OK);
    const dspark_slot_move* m = nullptr;
    size_t k = 0;
    dspark_last_moves(&m, &k);
    CHECK(k > 0);
    for (size_t i = 0; i < k; ++i)
        std::memcpy(ring.data() + static_cast<std::size_t>(m[i].dst) * D * 4, table.data() + static_cast<std::size_t>(m[i].src) * D * 4,
                    static_cast<std::size_t>(m[i].count) * D * 4);
    CHECK_EQ(dspark_prefix_hit(held, 1, hs, c.bytes(), c.offsets.data(), c.n(), h, nullptr), DSPARK_OK);
    dspark_last_moves(&m, &k);
    CHECK_EQ(k, 0u);  // held: nothing to copy
    std::vector<float> want(static_cast<std::size_t>(W * D));
    dspark_plan pw, pe;
    size_t written = 0;
    CHECK_EQ(dspark_draft(held, 1, h, DSPARK_DTYPE_F32, want.data(), want.size() * 4, &pw, &written), DSPARK_OK);
    CHECK_EQ(dspark_draft(ext, 1, h, DSPARK_DTYPE_F32, nullptr, 0, &pe, nullptr), DSPARK_OK);
    CHECK_EQ(pe.n_rows, pw.n_rows);
    std::vector<std::uint8_t> got;
    for (int run = 0; run < 2; ++run)
        got.insert(got.end(), ring.begin() + pe.slot_first[run] * D * 4, ring.begin() + (pe.slot_first[run] + pe.slot_count[run]) * D * 4);
    CHECK(got.size() == written && std::memcmp(got.data(), want.data(), written) == 0);
    // Export a block from the external store (rows read at its slots) = the held store's bytes.
    const std::uint8_t* key = c.bytes() + c.offsets[10];
    std::vector<std::int64_t> slots(BT);
    size_t ns = 0;
    CHECK_EQ(dspark_prefix_block_slots(es, key, 8, slots.data(), slots.size(), &ns), DSPARK_OK);
    std::vector<std::uint8_t> rows;
    for (size_t i = 0; i < ns; ++i)
        rows.insert(rows.end(), table.begin() + slots[i] * D * 4, table.begin() + (slots[i] + 1) * D * 4);
    size_t need = 0;
    CHECK_EQ(dspark_prefix_export(hs, key, 8, nullptr, 0, nullptr, 0, &need), DSPARK_E_BUFFER_TOO_SMALL);
    std::vector<std::uint8_t> x(need), y(need);
    CHECK_EQ(dspark_prefix_export(hs, key, 8, nullptr, 0, x.data(), x.size(), &need), DSPARK_OK);
    CHECK_EQ(dspark_prefix_export(es, key, 8, rows.data(), rows.size(), y.data(), y.size(), &need), DSPARK_OK);
    CHECK(x == y);
    // Import into a fresh external store: the slots to write.
    dspark_prefix_store* e2 = nullptr;
    CHECK_EQ(dspark_prefix_store_create(ext, BT, 1 << 20, &e2), DSPARK_OK);
    std::vector<std::int64_t> islots(BT);
    size_t ni = 0;
    CHECK_EQ(dspark_prefix_import(e2, x.data(), x.size(), islots.data(), 2, &ni), DSPARK_E_BUFFER_TOO_SMALL);
    CHECK_EQ(ni, ns);
    size_t count = 9;
    dspark_prefix_count(e2, &count);
    CHECK_EQ(count, 0u);
    CHECK_EQ(dspark_prefix_import(e2, x.data(), x.size(), islots.data(), islots.size(), &ni), DSPARK_OK);
    CHECK_EQ(ni, ns);
    dspark_prefix_count(e2, &count);
    CHECK_EQ(count, 1u);
    dspark_prefix_store_destroy(e2);
}

TEST_CASE(c_rejected_calls_say_why_and_change_nothing) {
    dspark_stager* st = make_stager();
    dspark_stager* q8 = make_stager(DSPARK_ROWS_HELD, DSPARK_STORAGE_Q8_0);
    dspark_prefix_store* store = nullptr;
    CHECK_EQ(dspark_prefix_store_create(st, BT, 100, &store), DSPARK_E_CONFIG);
    CHECK(store == nullptr && mentions("smaller than one block"));
    CHECK_EQ(dspark_prefix_store_create(nullptr, BT, 1 << 20, &store), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_prefix_store_create(st, 0, 1 << 20, &store), DSPARK_E_CONFIG);
    CHECK_EQ(dspark_prefix_store_create(st, BT, 1 << 20, &store), DSPARK_OK);
    prefill_publish(st, store, 0, 40);
    Chain c(0, 40), shifted(8, 48);
    dspark_prefix_hit_result r;
    CHECK_EQ(dspark_prefix_hit(q8, 0, store, c.bytes(), c.offsets.data(), c.n(), 40, &r), DSPARK_E_CONFIG);
    CHECK(mentions("storage"));
    CHECK_EQ(dspark_prefix_hit(st, 1, store, shifted.bytes(), shifted.offsets.data(), shifted.n(), 40, &r),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("does not match the positions"));
    CHECK_EQ(dspark_prefix_hit(st, 1, store, c.bytes(), nullptr, c.n(), 40, &r), DSPARK_E_NULL_POINTER);
    CHECK_EQ(dspark_prefix_hit(st, 5, store, c.bytes(), c.offsets.data(), c.n(), 40, &r), DSPARK_E_INVALID_ARGUMENT);
    const std::size_t bad_offsets[2] = {0, 65};
    std::vector<std::uint8_t> long_key(65, 1);
    CHECK_EQ(dspark_prefix_evict(store, long_key.data(), bad_offsets, 1, nullptr), DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("1..64 bytes"));
    // The same block with other rows.
    Chain k0(0, 8);
    auto other = rows_for(500, 8);
    CHECK_EQ(dspark_prefix_publish_rows(store, k0.bytes(), k0.offsets.data(), 1, 0, 8, other.data(), DSPARK_DTYPE_F32,
                                        other.size() * 4), DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("other rows"));
    CHECK_EQ(dspark_prefix_publish_rows(store, k0.bytes(), k0.offsets.data(), 1, 0, 8, other.data(), 9,
                                        other.size() * 4), DSPARK_E_TYPE);
    // A damaged block.
    size_t need = 0;
    dspark_prefix_export(store, c.bytes(), 8, nullptr, 0, nullptr, 0, &need);
    std::vector<std::uint8_t> data(need);
    CHECK_EQ(dspark_prefix_export(store, c.bytes(), 8, nullptr, 0, data.data(), data.size(), &need), DSPARK_OK);
    int64_t evicted = 0;
    CHECK_EQ(dspark_prefix_evict(store, c.bytes(), c.offsets.data(), 1, &evicted), DSPARK_OK);
    CHECK_EQ(evicted, 1);
    data[70] ^= 1;
    CHECK_EQ(dspark_prefix_import(store, data.data(), data.size(), nullptr, 0, nullptr), DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("checksum"));
    size_t count = 0;
    dspark_prefix_count(store, &count);
    CHECK_EQ(count, 4u);
    dspark_prefix_stats s;
    dspark_prefix_stats_init(&s);
    dspark_prefix_stats_get(store, &s);
    CHECK_EQ(s.hits, 0);
    CHECK_EQ(s.evicted_by_key, 1);
    dspark_prefix_store_destroy(store);
    dspark_stager_destroy(st);
    dspark_stager_destroy(q8);
}

TEST_CASE(c_checks_come_in_the_cores_order_with_its_messages) {
    // The sequence's errors first (an unknown id, an open round), then this layer's conversions
    // (NULL pointers), then the core's values: the order and the words of the Python API.
    const HeldAndExternal pair;
    dspark_stager* st = pair.held;
    dspark_prefix_store *store = pair.hs, *es = pair.es;
    prefill_publish(st, store, 0, 40);
    Chain c(0, 40);
    dspark_prefix_hit_result r;
    CHECK_EQ(dspark_prefix_publish(st, 7, nullptr, c.bytes(), nullptr, c.n(), 0, 40), DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("unknown sequence 7"));
    CHECK_EQ(dspark_prefix_publish(st, 0, nullptr, c.bytes(), c.offsets.data(), c.n(), 0, 40), DSPARK_E_NULL_POINTER);
    CHECK(mentions("store is NULL"));
    const auto pos = span(0, 8);
    const auto rows = rows_for(0, 8);
    CHECK_EQ(dspark_process(st, 1, pos.data(), 8, rows.data(), DSPARK_DTYPE_F32, rows.size() * 4), DSPARK_OK);
    dspark_plan plan;
    std::vector<float> out(static_cast<std::size_t>(W * D));
    CHECK_EQ(dspark_draft(st, 1, 8, DSPARK_DTYPE_F32, out.data(), out.size() * 4, &plan, nullptr), DSPARK_OK);
    CHECK_EQ(dspark_prefix_hit(st, 1, store, c.bytes(), nullptr, c.n(), 40, &r), DSPARK_E_STATE);
    CHECK(mentions("open round"));
    CHECK_EQ(dspark_prefix_hit(st, 0, store, c.bytes(), c.offsets.data(), c.n() - 1, 40, &r), DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::strcmp(dspark_last_error(), "4 keys for a hit of 40 tokens: the chain needs 5 (one per block of "
                                           "block_tokens=8, the last may be partial)") == 0);
    // publish_slots: the mode (a TYPE error), the publish, then the caller's capacity.
    std::vector<std::int64_t> slots(8, -7);
    CHECK_EQ(dspark_prefix_publish_slots(store, c.bytes(), c.offsets.data(), 1, 40, 48, slots.data(), slots.size()),
             DSPARK_E_TYPE);
    CHECK(mentions("publish_slots needs an external-row store"));
    CHECK_EQ(dspark_prefix_publish_slots(es, c.bytes(), c.offsets.data(), 1, 0, std::int64_t(1) << 61, nullptr, 0),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("1 keys for positions"));
    CHECK_EQ(dspark_prefix_publish_slots(es, c.bytes(), c.offsets.data(), 1, 0, 8, slots.data(), 7),
             DSPARK_E_BUFFER_TOO_SMALL);
    size_t count = 9;
    dspark_prefix_count(es, &count);
    CHECK_EQ(count, 0u);
    CHECK(slots[0] == -7);  // nothing written
    CHECK_EQ(dspark_prefix_publish_slots(es, c.bytes(), c.offsets.data(), 1, 0, 8, slots.data(), 8), DSPARK_OK);
    CHECK_EQ(slots[0], 0);
    CHECK_EQ(slots[7], 7);
    dspark_prefix_count(es, &count);
    CHECK_EQ(count, 1u);
    // publish_rows: the dtype code is this layer's conversion (TYPE), before the core's checks.
    CHECK_EQ(dspark_prefix_publish_rows(store, c.bytes(), c.offsets.data(), 1, 3, 8, rows.data(), 7, rows.size() * 4),
             DSPARK_E_TYPE);
    CHECK(mentions("dtype code 7"));
    Chain next(40, 48);
    CHECK_EQ(dspark_prefix_publish_rows(store, next.bytes(), next.offsets.data(), 1, 40, 48, rows.data(),
                                        DSPARK_DTYPE_F32, rows.size() * 4 - 6), DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("rows must be 8 x 64 float32 values for positions [40, 48), got 7 rows and 250 bytes"));
}

namespace {

// n chains as dspark_prefix_publish_many takes them: one key array, key
// offsets from it, and where each chain starts among them.
struct Chains {
    std::vector<std::uint8_t> bytes;
    std::vector<std::size_t> key_offsets{0}, chain_offsets{0};
    explicit Chains(const std::vector<const Chain*>& chains) {
        for (const Chain* c : chains) {
            bytes.insert(bytes.end(), c->bytes(), c->bytes() + 8 * c->n());
            for (std::size_t k = 0; k < c->n(); ++k) key_offsets.push_back(key_offsets.back() + 8);
            chain_offsets.push_back(chain_offsets.back() + c->n());
        }
    }
};

std::vector<std::uint8_t> snapshot_of(dspark_stager* st, std::int64_t seq) {
    std::size_t n = 0;
    CHECK_EQ(dspark_snapshot_size(st, seq, &n), DSPARK_OK);
    std::vector<std::uint8_t> out(n);
    std::size_t written = 0;
    CHECK_EQ(dspark_snapshot(st, seq, out.data(), out.size(), &written), DSPARK_OK);
    return out;
}

dspark_prefix_stats stats_of(const dspark_prefix_store* store) {
    dspark_prefix_stats s;
    dspark_prefix_stats_init(&s);
    CHECK_EQ(dspark_prefix_stats_get(store, &s), DSPARK_OK);
    return s;
}

bool same_stats(const dspark_prefix_stats& a, const dspark_prefix_stats& b) {
    return a.blocks == b.blocks && a.pages == b.pages && a.published == b.published &&
           a.republished == b.republished && a.evicted_lru == b.evicted_lru && a.hits == b.hits &&
           a.full_hits == b.full_hits && a.hit_rows == b.hit_rows && a.replayed_tokens == b.replayed_tokens;
}

}  // namespace

// publish_many / hit_many through the C ABI: equal to loops of the single
// calls (stores, hit results, snapshots); a batch refused at its second
// entry, or for its chain offsets, changes nothing and names the entry.
TEST_CASE(c_batches_equal_loops_and_a_rejected_batch_changes_nothing) {
    dspark_stager *a = make_stager(), *b = make_stager();
    dspark_prefix_store *sa = nullptr, *sb = nullptr;
    CHECK_EQ(dspark_prefix_store_create(a, BT, 1 << 20, &sa), DSPARK_OK);
    CHECK_EQ(dspark_prefix_store_create(b, BT, 1 << 20, &sb), DSPARK_OK);
    for (dspark_stager* st : {a, b})
        for (std::int64_t seq : {0, 1}) {
            const auto pos = span(0, 40);
            const auto rows = rows_for(100 * seq, 40);
            CHECK_EQ(dspark_process(st, seq, pos.data(), pos.size(), rows.data(), DSPARK_DTYPE_F32, rows.size() * 4), DSPARK_OK);
        }
    const Chain c0(0, 40, 1), c1(0, 40, 2);
    CHECK_EQ(dspark_prefix_publish(a, 0, sa, c0.bytes(), c0.offsets.data(), c0.n(), 0, 40), DSPARK_OK);
    CHECK_EQ(dspark_prefix_publish(a, 1, sa, c1.bytes(), c1.offsets.data(), c1.n(), 0, 40), DSPARK_OK);
    const Chains both({&c0, &c1});
    const std::int64_t seqs[2] = {0, 1}, starts[2] = {0, 0}, ends[2] = {40, 40};
    CHECK_EQ(dspark_prefix_publish_many(b, seqs, 2, sb, both.bytes.data(), both.key_offsets.data(),
                                        both.chain_offsets.data(), starts, ends), DSPARK_OK);
    CHECK(same_stats(stats_of(sa), stats_of(sb)));
    // Hits crossed over: sequence 0 from sequence 1's blocks and the other way round.
    dspark_prefix_hit_result loop[2], batch[2];
    CHECK_EQ(dspark_prefix_hit(a, 0, sa, c1.bytes(), c1.offsets.data(), c1.n(), 40, &loop[0]), DSPARK_OK);
    CHECK_EQ(dspark_prefix_hit(a, 1, sa, c0.bytes(), c0.offsets.data(), c0.n(), 40, &loop[1]), DSPARK_OK);
    const Chains crossed({&c1, &c0});
    const std::int64_t n_tokens[2] = {40, 40};
    CHECK_EQ(dspark_prefix_hit_many(b, seqs, 2, sb, crossed.bytes.data(), crossed.key_offsets.data(),
                                    crossed.chain_offsets.data(), n_tokens, batch), DSPARK_OK);
    CHECK(std::memcmp(loop, batch, sizeof loop) == 0);
    CHECK_EQ(batch[0].rows, 40);
    for (std::int64_t seq : {0, 1}) CHECK(snapshot_of(a, seq) == snapshot_of(b, seq));
    CHECK(same_stats(stats_of(sa), stats_of(sb)));
    // Refused at entry 1 (positions past its rows) after a valid entry 0: nothing changes.
    const dspark_prefix_stats before = stats_of(sb);
    const auto snap0 = snapshot_of(b, 0);
    const Chain c2(0, 40, 3), c3(0, 48, 4);
    const Chains bad({&c2, &c3});
    const std::int64_t bad_ends[2] = {40, 48};
    CHECK_EQ(dspark_prefix_publish_many(b, seqs, 2, sb, bad.bytes.data(), bad.key_offsets.data(),
                                        bad.chain_offsets.data(), starts, bad_ends), DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("publish_many: seqs[1] (sequence 1)"));
    const std::size_t falling[3] = {0, 5, 4};
    CHECK_EQ(dspark_prefix_publish_many(b, seqs, 2, sb, bad.bytes.data(), bad.key_offsets.data(), falling, starts,
                                        ends), DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("chain_offsets must not decrease"));
    CHECK(same_stats(before, stats_of(sb)));
    CHECK(snap0 == snapshot_of(b, 0));
    dspark_prefix_store_destroy(sa);
    dspark_prefix_store_destroy(sb);
    dspark_stager_destroy(a);
    dspark_stager_destroy(b);
}

// Two requests on one shared prompt bring its new blocks in one batch: the
// first entry adds them, the second refreshes them, as a loop of publishes
// does (stores, snapshots and a hit equal); other rows in the second entry
// are refused with the loop's second publish's error and change nothing.
TEST_CASE(c_a_block_new_in_two_entries_is_added_once_and_refreshed) {
    dspark_stager *a = make_stager(), *b = make_stager(), *c = make_stager();
    dspark_prefix_store *sa = nullptr, *sb = nullptr, *sc = nullptr;
    CHECK_EQ(dspark_prefix_store_create(a, BT, 1 << 20, &sa), DSPARK_OK);
    CHECK_EQ(dspark_prefix_store_create(b, BT, 1 << 20, &sb), DSPARK_OK);
    CHECK_EQ(dspark_prefix_store_create(c, BT, 1 << 20, &sc), DSPARK_OK);
    const auto pos = span(0, 40);
    for (dspark_stager* st : {a, b, c})
        for (std::int64_t seq : {0, 1}) {
            // a, b: the same prompt rows in both sequences; c: other rows in sequence 1
            const auto rows = rows_for(st == c && seq == 1 ? 500 : 0, 40);
            CHECK_EQ(dspark_process(st, seq, pos.data(), pos.size(), rows.data(), DSPARK_DTYPE_F32, rows.size() * 4), DSPARK_OK);
        }
    const Chain shared(0, 40, 7);
    for (std::int64_t seq : {0, 1})
        CHECK_EQ(dspark_prefix_publish(a, seq, sa, shared.bytes(), shared.offsets.data(), shared.n(), 0, 40), DSPARK_OK);
    const Chains twice({&shared, &shared});
    const std::int64_t seqs[2] = {0, 1}, starts[2] = {0, 0}, ends[2] = {40, 40};
    CHECK_EQ(dspark_prefix_publish_many(b, seqs, 2, sb, twice.bytes.data(), twice.key_offsets.data(),
                                        twice.chain_offsets.data(), starts, ends), DSPARK_OK);
    CHECK(same_stats(stats_of(sa), stats_of(sb)));
    CHECK_EQ(stats_of(sb).published, static_cast<std::int64_t>(shared.n()));
    CHECK_EQ(stats_of(sb).republished, static_cast<std::int64_t>(shared.n()));
    for (std::int64_t seq : {0, 1}) CHECK(snapshot_of(a, seq) == snapshot_of(b, seq));
    dspark_prefix_hit_result loop, batch;
    CHECK_EQ(dspark_prefix_hit(a, 1, sa, shared.bytes(), shared.offsets.data(), shared.n(), 40, &loop), DSPARK_OK);
    CHECK_EQ(dspark_prefix_hit(b, 1, sb, shared.bytes(), shared.offsets.data(), shared.n(), 40, &batch), DSPARK_OK);
    CHECK(std::memcmp(&loop, &batch, sizeof loop) == 0);
    CHECK(snapshot_of(a, 1) == snapshot_of(b, 1));
    // Other rows under the same new keys: refused whole, with the loop's error.
    const dspark_prefix_stats before = stats_of(sc);
    CHECK_EQ(dspark_prefix_publish_many(c, seqs, 2, sc, twice.bytes.data(), twice.key_offsets.data(),
                                        twice.chain_offsets.data(), starts, ends), DSPARK_E_INVALID_ARGUMENT);
    CHECK(mentions("publish_many: seqs[1] (sequence 1): "));
    CHECK(mentions("is already held with other rows"));
    CHECK(same_stats(before, stats_of(sc)));
    CHECK_EQ(stats_of(sc).blocks, 0);
    for (dspark_prefix_store* s : {sa, sb, sc}) dspark_prefix_store_destroy(s);
    for (dspark_stager* st : {a, b, c}) dspark_stager_destroy(st);
}

TEST_CASE(c_a_chain_stagers_hit_takes_the_prompts_ids) {
    dspark_stager* block = make_stager();
    dspark_config c;
    dspark_config_init(&c);
    CHECK_EQ(dspark_stager_config(block, &c), DSPARK_OK);
    c.kind = DSPARK_KIND_CHAIN;
    dspark_stager* chain = nullptr;
    CHECK_EQ(dspark_stager_create(&c, &chain), DSPARK_OK);
    dspark_prefix_store* store = nullptr;
    CHECK_EQ(dspark_prefix_store_create(block, BT, 1 << 20, &store), DSPARK_OK);  // rows, not ids: one store serves both kinds
    const std::int64_t h = 100;
    prefill_publish(block, store, 0, h);
    Chain keys(0, h);
    std::vector<std::int32_t> prompt(static_cast<std::size_t>(h));
    for (std::int64_t p = 0; p < h; ++p) prompt[static_cast<std::size_t>(p)] = static_cast<std::int32_t>(7 * p + 3);
    dspark_prefix_hit_result r;
    CHECK_EQ(dspark_prefix_hit(chain, 1, store, keys.bytes(), keys.offsets.data(), keys.n(), h, &r),
             DSPARK_E_INVALID_ARGUMENT);
    CHECK(std::strstr(dspark_last_error(), "needs the token id of every row") != nullptr);
    CHECK_EQ(dspark_prefix_hit_tokens(chain, 1, store, keys.bytes(), keys.offsets.data(), keys.n(), h, prompt.data(), &r),
             DSPARK_OK);
    CHECK_EQ(r.first_row, h - 32);
    std::vector<std::int32_t> got(32, -7);
    CHECK_EQ(dspark_tokens(chain, 1, r.first_row, r.replay_from, got.data()), DSPARK_OK);
    CHECK(std::equal(got.begin(), got.end(), prompt.begin() + (h - 32)));
    // The batch: the ids flat, one prompt after the other.
    const std::int64_t seqs[1] = {0}, n_tokens[1] = {h};
    const std::size_t chains[2] = {0, keys.n()};
    CHECK_EQ(dspark_prefix_hit_many_tokens(chain, seqs, 1, store, keys.bytes(), keys.offsets.data(), chains, n_tokens,
                                           prompt.data(), &r),
             DSPARK_OK);
    std::fill(got.begin(), got.end(), -7);
    CHECK_EQ(dspark_tokens(chain, 0, r.first_row, r.replay_from, got.data()), DSPARK_OK);
    CHECK(std::equal(got.begin(), got.end(), prompt.begin() + (h - 32)));
    // A block stager's hit takes none.
    CHECK_EQ(dspark_prefix_hit_tokens(block, 1, store, keys.bytes(), keys.offsets.data(), keys.n(), h, prompt.data(), &r),
             DSPARK_E_INVALID_ARGUMENT);
    dspark_prefix_store_destroy(store);
    dspark_stager_destroy(chain);
    dspark_stager_destroy(block);
}

TEST_MAIN()
