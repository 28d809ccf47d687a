// The C ABI of the prefix store (dspark/dspark.h, "prefix store") over
// dspark::PrefixStore and the Stager's prefix calls. As c_api.cpp: every
// entry point runs inside guarded() (the core's one error table), this layer
// only converts (NULL pointers, buffer sizes, dtype codes; converted() lets
// the sequence's own errors come first), and every rule is the core's.
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

// A batch's chains (dspark_prefix_publish_many): chain i is the keys from
// key chain_offsets[i] of the one key array (offsets rising from 0), each
// with its offsets rebased to 0 as a chain's are (the core checks the rest).
struct BatchChains {
    std::vector<size_t> offsets;  // every chain's offsets, rebased, one after the other
    std::vector<dspark::KeyChain> chains;
};

BatchChains chains_of(const uint8_t* keys, const size_t* key_offsets, const size_t* chain_offsets, size_t n) {
    require(chain_offsets, "chain_offsets");
    if (chain_offsets[0] != 0)
        throw std::invalid_argument("chain_offsets[0] must be 0, got " + std::to_string(chain_offsets[0]));
    BatchChains out;
    for (size_t i = 0; i < n; ++i) {
        if (chain_offsets[i + 1] < chain_offsets[i])
            throw std::invalid_argument("chain_offsets must not decrease, got chain_offsets[" + std::to_string(i + 1) +
                                        "] = " + std::to_string(chain_offsets[i + 1]) + " < chain_offsets[" +
                                        std::to_string(i) + "] = " + std::to_string(chain_offsets[i]));
        if (chain_offsets[i + 1] > chain_offsets[i]) require(key_offsets, "key_offsets");
    }
    out.offsets.reserve(chain_offsets[n] + n);
    std::vector<size_t> first(n);
    for (size_t i = 0; i < n; ++i) {
        first[i] = out.offsets.size();
        const size_t c = chain_offsets[i], m = chain_offsets[i + 1] - c;
        for (size_t j = 0; j <= m && m; ++j) out.offsets.push_back(key_offsets[c + j] - key_offsets[c]);
    }
    out.chains.resize(n);
    for (size_t i = 0; i < n; ++i) {
        const size_t c = chain_offsets[i], m = chain_offsets[i + 1] - c;
        out.chains[i] = m ? dspark::KeyChain{keys ? keys + key_offsets[c] : nullptr, out.offsets.data() + first[i], m}
                          : dspark::KeyChain{keys, nullptr, 0};
    }
    return out;
}

std::string_view key_of(const uint8_t* key, size_t len) {
    require_buffer(key, len, "key");
    return std::string_view(reinterpret_cast<const char*>(key), len);
}

dspark_prefix_hit_result to_c(const dspark::PrefixHit& from) {
    dspark_prefix_hit_result to;
    std::memset(&to, 0, sizeof to);
    DSPARK_PREFIX_HIT_FIELDS(DSPARK_COPY_FIELD)
    return to;
}

// The slots a call hands out go to the caller's buffer of `capacity`
// entries: the core asks after every check (BufferTooSmall when it is short;
// *n, when given, receives the count either way).
dspark::SlotSink slots_into(int64_t* slots, size_t capacity, size_t* n) {
    return [=](std::size_t count) -> std::int64_t* {
        if (n) *n = count;
        if (count > capacity)
            throw dspark::BufferTooSmall("slots_out holds " + std::to_string(capacity) + " entries, the call needs " +
                                             std::to_string(count),
                                         count);
        return slots;
    };
}

// Resets this thread's last moves, then runs op, which returns the moves the
// core made: they are swapped in (recording allocates nothing after the op
// changed the stager or the store), as dspark_fork's.
template <class Op>
dspark_status with_prefix_moves(Op&& op) {
    last_moves.clear();
    last_moves_copied = false;
    return guarded([&] {
        std::vector<dspark::SlotMove> moves = op();
        last_moves.swap(moves);
    });
}

}  // namespace

extern "C" {

dspark_status dspark_prefix_store_create(const dspark_stager* like, int64_t block_tokens, int64_t budget_bytes,
                                         dspark_prefix_store** out) {
    return guarded([&] {
        require(out, "out");
        *out = nullptr;
        // The core checks every value (ConfigError).
        *out = new dspark_prefix_store(dspark::prefix_store_options(core_of(like).options(), block_tokens, budget_bytes));
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
    return with_prefix_moves([&] {
        dspark::Stager& core = core_of(st);
        dspark::PrefixStore* s = converted(core, seq, false, [&] { return &store_of(store); });
        const dspark::KeyChain chain = converted(core, seq, false, [&] { return chain_of(keys, key_offsets, n_keys); });
        return core.publish_prefix(seq, *s, chain, start, end);
    });
}

dspark_status dspark_prefix_hit_tokens(dspark_stager* st, int64_t seq, dspark_prefix_store* store, const uint8_t* keys,
                                       const size_t* key_offsets, size_t n_keys, int64_t n_tokens,
                                       const int32_t* tokens, dspark_prefix_hit_result* out) {
    return with_prefix_moves([&] {
        dspark::Stager& core = core_of(st);
        dspark::PrefixStore* s = converted(core, seq, false, [&] { return &store_of(store); });
        const dspark::KeyChain chain = converted(core, seq, false, [&] { return chain_of(keys, key_offsets, n_keys); });
        std::vector<dspark::SlotMove> moves;
        const dspark::PrefixHit h = core.start_from_prefix(seq, *s, chain, n_tokens, &moves, nullptr, tokens);
        if (out) *out = to_c(h);
        return moves;
    });
}

dspark_status dspark_prefix_hit(dspark_stager* st, int64_t seq, dspark_prefix_store* store, const uint8_t* keys,
                                const size_t* key_offsets, size_t n_keys, int64_t n_tokens, dspark_prefix_hit_result* out) {
    return dspark_prefix_hit_tokens(st, seq, store, keys, key_offsets, n_keys, n_tokens, nullptr, out);
}

dspark_status dspark_prefix_publish_many(dspark_stager* st, const int64_t* seqs, size_t n, dspark_prefix_store* store,
                                         const uint8_t* keys, const size_t* key_offsets, const size_t* chain_offsets,
                                         const int64_t* starts, const int64_t* ends) {
    return with_prefix_moves([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        const char* call = "publish_many";
        const auto need = dspark::Stager::Need::Ready;
        dspark::PrefixStore* s = converted_batch(core, call, seqs, n, need, [&] { return &store_of(store); });
        const BatchChains chains = converted_batch(core, call, seqs, n, need, [&] {
            return chains_of(keys, key_offsets, chain_offsets, n);
        });
        converted_batch(core, call, seqs, n, need, [&] {
            require_buffer(starts, n, "starts");
            require_buffer(ends, n, "ends");
        });
        return core.publish_prefix_many(seqs, n, *s, chains.chains.data(), starts, ends);
    });
}

dspark_status dspark_prefix_hit_many(dspark_stager* st, const int64_t* seqs, size_t n, dspark_prefix_store* store,
                                     const uint8_t* keys, const size_t* key_offsets, const size_t* chain_offsets,
                                     const int64_t* n_tokens, dspark_prefix_hit_result* out) {
    return dspark_prefix_hit_many_tokens(st, seqs, n, store, keys, key_offsets, chain_offsets, n_tokens, nullptr, out);
}

dspark_status dspark_prefix_hit_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                            dspark_prefix_store* store, const uint8_t* keys, const size_t* key_offsets,
                                            const size_t* chain_offsets, const int64_t* n_tokens,
                                            const int32_t* tokens, dspark_prefix_hit_result* out) {
    return with_prefix_moves([&] {
        dspark::Stager& core = core_of(st);
        require_buffer(seqs, n, "seqs");
        const char* call = "hit_many";
        const auto need = dspark::Stager::Need::Ready;
        dspark::PrefixStore* s = converted_batch(core, call, seqs, n, need, [&] { return &store_of(store); });
        const BatchChains chains = converted_batch(core, call, seqs, n, need, [&] {
            return chains_of(keys, key_offsets, chain_offsets, n);
        });
        converted_batch(core, call, seqs, n, need, [&] { require_buffer(n_tokens, n, "n_tokens"); });
        std::vector<dspark::PrefixHit> hits;
        std::vector<dspark::SlotMove> moves;
        core.start_from_prefix_many(seqs, n, *s, chains.chains.data(), n_tokens, hits, &moves, nullptr, tokens);
        if (out)
            for (size_t i = 0; i < n; ++i) out[i] = to_c(hits[i]);
        return moves;
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
        const dspark::KeyChain chain = chain_of(keys, key_offsets, n_keys);
        const dspark::ElemType type = elem_of(dtype);
        require_buffer(rows, rows_bytes, "rows");
        s.publish_rows(chain, start, end, rows, type, rows_bytes);  // checks the row count
    });
}

dspark_status dspark_prefix_publish_slots(dspark_prefix_store* store, const uint8_t* keys, const size_t* key_offsets,
                                          size_t n_keys, int64_t start, int64_t end, int64_t* slots_out,
                                          size_t slots_capacity) {
    return guarded([&] {
        dspark::PrefixStore& s = store_of(store);
        const dspark::KeyChain chain = chain_of(keys, key_offsets, n_keys);
        require_buffer(slots_out, slots_capacity, "slots_out");
        s.publish_slots(chain, start, end, slots_into(slots_out, slots_capacity, nullptr));
    });
}

dspark_status dspark_prefix_evict(dspark_prefix_store* store, const uint8_t* keys, const size_t* key_offsets,
                                  size_t n_keys, int64_t* n_evicted) {
    return guarded([&] {
        dspark::PrefixStore& s = store_of(store);
        const int64_t n = s.evict(chain_of(keys, key_offsets, n_keys));
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
        require_buffer(bytes, bytes_capacity, "bytes");
        require_buffer(key_offsets, offsets_capacity, "key_offsets");
        const std::vector<std::string> keys = s.keys();  // one snapshot of the LRU order
        std::size_t total = 0;
        for (const std::string& k : keys) total += k.size();
        *n_keys = keys.size();
        *bytes_needed = total;
        if (bytes_capacity < total || offsets_capacity < keys.size() + 1)
            throw dspark::BufferTooSmall("the keys need " + std::to_string(total) + " bytes and " +
                                             std::to_string(keys.size() + 1) + " offsets",
                                         total);
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
        get_record(out, [&] { return s.stats(); }, [](const dspark::PrefixStats& from, dspark_prefix_stats& to) {
            DSPARK_PREFIX_STATS_FIELDS(DSPARK_COPY_FIELD)
        });
    });
}

dspark_status dspark_prefix_block_slots(const dspark_prefix_store* store, const uint8_t* key, size_t key_len,
                                        int64_t* slots, size_t capacity, size_t* n) {
    return guarded([&] {
        const dspark::PrefixStore& s = store_of(store);
        const std::string_view k = key_of(key, key_len);
        require_buffer(slots, capacity, "slots");
        require(n, "n");
        const std::vector<std::int64_t> v = s.block_slots(k);
        *n = v.size();
        if (capacity < v.size())
            throw dspark::BufferTooSmall("the block has " + std::to_string(v.size()) + " rows", v.size());
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
            require_buffer(rows, rows_bytes, "rows");
            require_buffer(out, capacity, "out");
            if (written) *written = 0;
            // The core checks the key, the rows and the capacity (BufferTooSmall: needed).
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
        require_buffer(slots_out, slots_capacity, "slots_out");
        if (n_slots) *n_slots = 0;
        // The core checks the whole block first, then asks for room for its
        // slots (external rows only).
        s.import_block(static_cast<const std::uint8_t*>(data), nbytes, slots_into(slots_out, slots_capacity, n_slots));
    });
}

}  // extern "C"
