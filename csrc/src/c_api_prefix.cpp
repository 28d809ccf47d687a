// The C ABI of the prefix store (dspark/dspark.h, "prefix store") over
// dspark::PrefixStore and the Stager's prefix calls. Same rules as c_api.cpp:
// every entry point runs inside guarded(), argument checks the Python binding
// makes are made here, value checks are the core's.
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "c_api_common.hpp"
#include "dspark/dspark.h"
#include "dspark/prefix_store.hpp"

struct dspark_prefix_store {
    dspark::PrefixStore core;
    explicit dspark_prefix_store(const dspark::PrefixStoreOptions& o) : core(o) {}
};

namespace {

using namespace dspark_c;

dspark::PrefixStore& store_of(dspark_prefix_store* s) {
    require(s, "store");
    return s->core;
}
const dspark::PrefixStore& store_of(const dspark_prefix_store* s) {
    require(s, "store");
    return s->core;
}

dspark::KeyChain chain_of(const uint8_t* keys, const size_t* offsets, size_t n) {
    if (n) require(offsets, "key_offsets");
    return dspark::KeyChain{keys, offsets, n};  // the core checks the offsets and key lengths
}

std::string_view key_of(const uint8_t* key, size_t len) {
    require_buffer(key, len, "key");
    return std::string_view(reinterpret_cast<const char*>(key), len);
}

dspark_prefix_hit_result to_c(const dspark::PrefixHit& h) {
    dspark_prefix_hit_result c;
    std::memset(&c, 0, sizeof c);
    c.n_tokens = h.n_tokens;
    c.need_first = h.need_first;
    c.first_row = h.first_row;
    c.replay_from = h.replay_from;
    c.rows = h.rows;
    c.origin = h.origin;
    c.blocks_found = h.blocks_found;
    c.exact = h.exact ? 1 : 0;
    return c;
}

// Room for the moves a publish or hit of `core` can return (a move per ring
// run of each page piece: fewer than 2 * ring_rows + 2), taken before the op
// so that recording them cannot fail once the op changed the stager.
void reserve_moves(const dspark::Stager& core) {
    last_moves().reserve(2 * static_cast<std::size_t>(core.ring_rows()) + 2);
}

void record(const std::vector<dspark::SlotMove>& moves) {
    for (const dspark::SlotMove& m : moves) last_moves().push_back(dspark_slot_move{m.src, m.dst, m.count});
}

}  // namespace

extern "C" {

dspark_status dspark_prefix_store_create(const dspark_stager* like, int64_t block_tokens, uint64_t budget_bytes,
                                         dspark_prefix_store** out) {
    return guarded([&] {
        require(out, "out");
        *out = nullptr;
        const dspark::StagerOptions& s = core_of(like).options();
        dspark::PrefixStoreOptions o;
        o.feature_dim = s.feature_dim;
        o.block_size = s.block_size;
        o.window = s.window;
        o.storage = s.storage;
        o.nonfinite = s.nonfinite;
        o.stage = s.stage;
        o.rows = s.rows;
        o.block_tokens = block_tokens;
        o.budget_bytes = budget_bytes;
        *out = new dspark_prefix_store(o);  // ConfigError for an unusable budget or block size
    });
}

void dspark_prefix_store_destroy(dspark_prefix_store* store) { delete store; }

dspark_status dspark_prefix_store_layout(const dspark_prefix_store* store, int64_t* page_rows, int64_t* n_pages,
                                         int64_t* table_rows) {
    return guarded([&] {
        const dspark::PrefixStore& s = store_of(store);
        if (page_rows) *page_rows = s.page_rows();
        if (n_pages) *n_pages = s.n_pages();
        if (table_rows) *table_rows = s.table_rows();
    });
}

dspark_status dspark_prefix_publish(dspark_stager* st, int64_t seq, dspark_prefix_store* store, const uint8_t* keys,
                                    const size_t* key_offsets, size_t n_keys, int64_t start, int64_t end) {
    last_moves().clear();
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        dspark::PrefixStore& s = store_of(store);
        const dspark::KeyChain chain = chain_of(keys, key_offsets, n_keys);
        reserve_moves(core);
        record(core.publish_prefix(seq, s, chain, start, end));
    });
}

dspark_status dspark_prefix_hit(dspark_stager* st, int64_t seq, dspark_prefix_store* store, const uint8_t* keys,
                                const size_t* key_offsets, size_t n_keys, int64_t n_tokens, dspark_prefix_hit_result* out) {
    last_moves().clear();
    return guarded([&] {
        dspark::Stager& core = core_of(st);
        dspark::PrefixStore& s = store_of(store);
        const dspark::KeyChain chain = chain_of(keys, key_offsets, n_keys);
        std::vector<dspark::SlotMove> moves;
        reserve_moves(core);
        const dspark::PrefixHit h = core.start_from_prefix(seq, s, chain, n_tokens, &moves);
        if (out) *out = to_c(h);
        record(moves);
    });
}

dspark_status dspark_prefix_lookup(const dspark_prefix_store* store, const uint8_t* keys, const size_t* key_offsets,
                                   size_t n_keys, int64_t n_tokens, dspark_prefix_hit_result* out) {
    return guarded([&] {
        const dspark::PrefixStore& s = store_of(store);
        require(out, "out");
        *out = to_c(s.lookup(chain_of(keys, key_offsets, n_keys), n_tokens));
    });
}

dspark_status dspark_prefix_publish_rows(dspark_prefix_store* store, const uint8_t* keys, const size_t* key_offsets,
                                         size_t n_keys, int64_t start, int64_t end, const void* rows, int32_t dtype,
                                         size_t rows_bytes) {
    return guarded([&] {
        dspark::PrefixStore& s = store_of(store);
        if (dtype < DSPARK_DTYPE_F32 || dtype > DSPARK_DTYPE_BF16)
            throw dspark::TypeError("publish_rows: dtype code " + std::to_string(dtype) +
                                    " is not supported (expected DSPARK_DTYPE_F32, F16 or BF16)");
        require_buffer(rows, rows_bytes, "rows");
        s.publish_rows(chain_of(keys, key_offsets, n_keys), start, end, rows, static_cast<dspark::ElemType>(dtype),
                       rows_bytes);
    });
}

dspark_status dspark_prefix_publish_external(dspark_prefix_store* store, const uint8_t* keys,
                                             const size_t* key_offsets, size_t n_keys, int64_t start, int64_t end,
                                             int64_t* slots_out) {
    return guarded([&] {
        dspark::PrefixStore& s = store_of(store);
        s.publish_external(chain_of(keys, key_offsets, n_keys), start, end, slots_out);
    });
}

dspark_status dspark_prefix_evict(dspark_prefix_store* store, const uint8_t* keys, const size_t* key_offsets,
                                  size_t n_keys, int64_t* n_evicted) {
    return guarded([&] {
        const int64_t n = store_of(store).evict(chain_of(keys, key_offsets, n_keys));
        if (n_evicted) *n_evicted = n;
    });
}

dspark_status dspark_prefix_clear(dspark_prefix_store* store) {
    return guarded([&] { store_of(store).clear(); });
}

dspark_status dspark_prefix_count(const dspark_prefix_store* store, size_t* n) {
    return guarded([&] {
        const dspark::PrefixStore& s = store_of(store);
        require(n, "n");
        *n = s.size();
    });
}

dspark_status dspark_prefix_keys(const dspark_prefix_store* store, uint8_t* bytes, size_t bytes_capacity,
                                 size_t* key_offsets, size_t offsets_capacity, size_t* n_keys, size_t* bytes_needed) {
    return guarded([&] {
        const dspark::PrefixStore& s = store_of(store);
        require(n_keys, "n_keys");
        require(bytes_needed, "bytes_needed");
        const std::vector<std::string> keys = s.keys();  // one snapshot of the LRU order
        std::size_t total = 0;
        for (const std::string& k : keys) total += k.size();
        *n_keys = keys.size();
        *bytes_needed = total;
        if (bytes_capacity < total || offsets_capacity < keys.size() + 1)
            throw TooSmall("the keys need " + std::to_string(total) + " bytes and " + std::to_string(keys.size() + 1) +
                           " offsets", total);
        require_buffer(bytes, total, "bytes");
        require(key_offsets, "key_offsets");
        std::size_t at = 0;
        key_offsets[0] = 0;
        for (std::size_t i = 0; i < keys.size(); ++i) {
            std::memcpy(bytes + at, keys[i].data(), keys[i].size());
            at += keys[i].size();
            key_offsets[i + 1] = at;
        }
    });
}

dspark_status dspark_prefix_stats_get(const dspark_prefix_store* store, dspark_prefix_stats* out) {
    return guarded([&] {
        const dspark::PrefixStore& s = store_of(store);
        require(out, "out");
        const dspark::PrefixStats t = s.stats();
        dspark_prefix_stats c;
        std::memset(&c, 0, sizeof c);
        c.blocks = t.blocks;
        c.pages = t.pages;
        c.bytes = t.bytes;
        c.resident_bytes = t.resident_bytes;
        c.key_bytes = t.key_bytes;
        c.published = t.published;
        c.republished = t.republished;
        c.evicted_lru = t.evicted_lru;
        c.evicted_by_key = t.evicted_by_key;
        c.hits = t.hits;
        c.exact_hits = t.exact_hits;
        c.hit_rows = t.hit_rows;
        c.replayed_tokens = t.replayed_tokens;
        write_sized(out, c);
    });
}

dspark_status dspark_prefix_block_slots(const dspark_prefix_store* store, const uint8_t* key, size_t key_len,
                                        int64_t* slots, size_t capacity, size_t* n) {
    return guarded([&] {
        const dspark::PrefixStore& s = store_of(store);
        require(n, "n");
        const std::vector<std::int64_t> v = s.block_slots(key_of(key, key_len));
        *n = v.size();
        if (capacity < v.size()) throw TooSmall("the block has " + std::to_string(v.size()) + " rows", v.size());
        require_buffer(slots, v.size(), "slots");
        if (!v.empty()) std::memcpy(slots, v.data(), v.size() * sizeof(std::int64_t));
    });
}

dspark_status dspark_prefix_export(const dspark_prefix_store* store, const uint8_t* key, size_t key_len,
                                   const void* rows, size_t rows_bytes, void* out, size_t capacity, size_t* written) {
    size_t needed = 0;
    const dspark_status rc = guarded(
        [&] {
            const dspark::PrefixStore& s = store_of(store);
            const std::string_view k = key_of(key, key_len);
            const std::size_t size = s.export_size(k);
            if (capacity < size) throw TooSmall("the block needs " + std::to_string(size) + " bytes", size);
            require(out, "out");
            require_buffer(rows, rows_bytes, "rows");
            const std::size_t n = s.export_into(k, static_cast<std::uint8_t*>(out), capacity,
                                                static_cast<const std::uint8_t*>(rows), rows_bytes);
            if (written) *written = n;
        },
        &needed);
    if (rc == DSPARK_E_BUFFER_TOO_SMALL && written) *written = needed;
    return rc;
}

dspark_status dspark_prefix_import(dspark_prefix_store* store, const void* data, size_t nbytes, int64_t* slots_out,
                                   size_t slots_capacity, size_t* n_slots) {
    return guarded([&] {
        dspark::PrefixStore& s = store_of(store);
        require_buffer(data, nbytes, "data");
        const auto* d = static_cast<const std::uint8_t*>(data);
        if (s.external()) {
            // The slots the import will report: its kept rows (u32 at offset 48 of a
            // well-formed header; the core rejects anything else before changing anything).
            std::size_t rows = 0;
            if (nbytes >= 64) rows = std::size_t(d[48]) | std::size_t(d[49]) << 8 | std::size_t(d[50]) << 16 |
                                     std::size_t(d[51]) << 24;
            if (n_slots) *n_slots = rows;
            if (slots_capacity < rows)
                throw TooSmall("the block has " + std::to_string(rows) + " rows: slots_out needs room for each", rows);
            require_buffer(slots_out, rows, "slots_out");
        }
        std::vector<std::int64_t> slots;
        s.import_block(d, nbytes, s.external() ? &slots : nullptr);
        if (!slots.empty()) std::memcpy(slots_out, slots.data(), slots.size() * sizeof(std::int64_t));
        if (n_slots) *n_slots = slots.size();
    });
}

}  // extern "C"
