// PrefixStore: encoded feature rows of cached prompt prefixes, keyed by the
// server's own prefix-cache block keys (docs/prefix_cache.md), so that a
// prefix-cache hit restages what a full prefill would have staged.
//
// A block is a run of positions [start, end) of a prompt: block i of a key
// chain covers [i * block_tokens, min((i + 1) * block_tokens, n_tokens)), so
// every block is full but possibly the last. Keys are opaque byte strings
// (1 .. PREFIX_MAX_KEY_BYTES bytes): the chained block hashes of a vLLM-style
// block manager, an SGLang radix page's hash, llama-server's prompt chunks.
//
// Which rows of a block are kept (the keep rule, docs/prefix_cache.md): a hit
// at h followed by a first round at start >= h stages, of the rows before h,
// either [h - K, h) (start + B > W: the round rebases) or all of [0, h)
// (start <= W - B, so h <= W - B). A block [s, e) serves hits at h >= e, so
// it keeps all its rows when e <= W - B and only [max(s, e - K), e)
// otherwise; the others are dropped at publish time. With block_tokens <= K
// that is every row; a long block (llama-server's whole cached prompt) keeps
// K rows however long it is.
//
// Memory: rows live in pages of page_rows() rows (min(block_tokens, K)); a
// block takes ceil(kept rows / page_rows) pages. The budget is a number of
// pages (budget_bytes / page bytes), the same in both row modes, and pages
// are handed out lowest free page first. Held mode: page memory is allocated
// lazily, a chunk of pages at a time, and freed pages are reused. External
// mode: the pages are rows of a table the owner allocates (table_rows() rows
// of row_bytes, on its device); the store hands out slots and the copies to
// apply, and holds no row bytes.
//
// Eviction: least recently used block first, whenever a publish needs pages;
// hits and republishes refresh a block. Pages held never exceed n_pages().
//
// Validation (docs/design.md 2.1, docs/prefix_cache.md "Calls"): every call
// checks everything first, in a fixed order, in functions without side
// effects (the check_* / plan_* members below; the Stager side's in
// stager_prefix.cpp), and a rejected call changes nothing. Messages are
// written here once; the reference twin spells out the same ones.
//
// Thread safety: every public method takes the store's mutex. The Stager-side
// operations (Stager::publish_prefix, Stager::start_from_prefix) take the
// Stager's mutex first, then the store's: that is the lock order, and no code
// path takes a Stager's mutex while holding a store's.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "dspark/byte_buffer.hpp"
#include "dspark/feature_buffer.hpp"
#include "dspark/row_format.hpp"
#include "dspark/stager.hpp"

namespace dspark {

// Keys are 1..64 bytes: a 32-byte SHA-256 block hash fits, so does an int64.
inline constexpr std::size_t PREFIX_MAX_KEY_BYTES = 64;

// The rows' configuration (RowOptions): every Stager that publishes into or
// hits from the store must have these values (the snapshot fingerprint: the
// keep rule depends on window and block size; what a row may hold, on the
// storage, the non-finite policy and the staged type).
struct PrefixStoreOptions : RowOptions {
    // Tokens per prefix block (the server's KV block size).
    std::int64_t block_tokens = 16;
    // Upper bound on the row memory held (held mode) or on the owner's table
    // (external mode): at least one block's pages.
    std::int64_t budget_bytes = 0;
};

// The store options for the rows of Stagers configured as `stager` (its
// RowOptions; max_seqs, max_failures and strict are each Stager's own), and
// back: the options of a one-sequence Stager of the store's rows.
PrefixStoreOptions prefix_store_options(const StagerOptions& stager, std::int64_t block_tokens,
                                        std::int64_t budget_bytes) noexcept;
StagerOptions stager_options(const PrefixStoreOptions& store) noexcept;

// A chain of keys: key i is bytes[offsets[i], offsets[i + 1]); offsets has
// n + 1 entries, offsets[0] == 0.
struct KeyChain {
    const std::uint8_t* bytes = nullptr;
    const std::size_t* offsets = nullptr;
    std::size_t n = 0;
};

// What a hit at n_tokens found (Stager::start_from_prefix, PrefixStore::lookup).
//  need_first: the first row before n_tokens a full prefill's first round
//    could stage (n_tokens - K, or 0 when n_tokens <= W - B);
//  first_row / replay_from: the ring holds rows [first_row, replay_from);
//  rows == replay_from - first_row;
//  replay_from: where the server prefills from (== n_tokens: nothing to
//    re-prefill; never below n_tokens - K);
//  origin: the sequence's pos_base and n_cache (0, as if it had processed
//    every position, unless the store lacked rows deep in a short prompt:
//    then first_row, see docs/prefix_cache.md);
//  exact: the first round equals a full prefill's (false only in that case);
//  blocks_found: blocks of the chain the rows came from.
#define DSPARK_PREFIX_HIT_FIELDS(X)   \
    X(std::int64_t, n_tokens)         \
    X(std::int64_t, need_first)       \
    X(std::int64_t, first_row)        \
    X(std::int64_t, replay_from)      \
    X(std::int64_t, rows)             \
    X(std::int64_t, origin)           \
    X(bool, exact)                    \
    X(std::int64_t, blocks_found)
struct PrefixHit {
    DSPARK_PREFIX_HIT_FIELDS(DSPARK_DECLARE_FIELD)
    // Exact unless the store lacked rows deep in a short prompt (the list's
    // defaults are zero).
    PrefixHit() noexcept : exact(true) {}
};

// One block as the store holds it.
struct PrefixBlockInfo {
    std::int64_t start = 0, end = 0;  // positions [start, end)
    SlotRun kept;                     // kept positions [kept.first, kept.first + kept.count)
    std::int64_t rows = 0;            // kept rows (kept.count)
    std::int64_t pages = 0;
};

// Counters since construction (or clear()).
//  blocks / pages / bytes: held now (bytes = pages * page bytes <= budget);
//  resident_bytes: page memory allocated (held mode; freed pages are reused);
//  key_bytes: bytes of the keys held;
//  published: blocks added (publish, publish_rows / publish_slots, import);
//  republished: publishes of a block already held with the same rows (a refresh);
//  evicted_lru / evicted_by_key: blocks dropped for room / by evict();
//  hits: start_from_prefix calls with n_tokens > 0; full_hits: of which
//  found every row (replay_from == n_tokens: nothing to prefill again) and
//  were exact (PrefixHit::exact; named exact_hits before, which read as if
//  it counted PrefixHit::exact alone); hit_rows: rows placed in rings;
//  replayed_tokens: sum of n_tokens - replay_from over hits.
#define DSPARK_PREFIX_STATS_FIELDS(X)  \
    X(std::int64_t, blocks)            \
    X(std::int64_t, pages)             \
    X(std::int64_t, bytes)             \
    X(std::int64_t, resident_bytes)    \
    X(std::int64_t, key_bytes)         \
    X(std::int64_t, published)         \
    X(std::int64_t, republished)       \
    X(std::int64_t, evicted_lru)       \
    X(std::int64_t, evicted_by_key)    \
    X(std::int64_t, hits)              \
    X(std::int64_t, full_hits)         \
    X(std::int64_t, hit_rows)          \
    X(std::int64_t, replayed_tokens)
struct PrefixStats {
    DSPARK_PREFIX_STATS_FIELDS(DSPARK_DECLARE_FIELD)
};

// The tables of PrefixHit / PrefixStats (field_list.hpp): the binding's
// PrefixHit fields and stats() keys; the C ABI copies through the lists.
extern const FieldInfo PREFIX_HIT_FIELDS[];
extern const FieldInfo PREFIX_STATS_FIELDS[];

// Where a call that hands out slots writes them: called once, after every
// check and before anything changes, with the number of slots; returns room
// for them or throws (BufferTooSmall, bad_alloc), and the call then changes
// nothing. (The C ABI checks the caller's capacity; the vector forms below
// allocate only for a request that passed every check.)
using SlotSink = std::function<std::int64_t*(std::size_t n)>;

struct PrefixPlannedBlock;  // below: a block of a checked publish

class PrefixStore {
public:
    // ConfigError for an unusable configuration: the Stager's rules
    // (check_options), then block_tokens in [1, 2**30], budget_bytes >= 1,
    // and a budget that holds one block.
    explicit PrefixStore(const PrefixStoreOptions& options);
    PrefixStore(const PrefixStore&) = delete;
    PrefixStore& operator=(const PrefixStore&) = delete;

    const PrefixStoreOptions& options() const noexcept { return opt_; }
    std::size_t row_bytes() const noexcept { return row_bytes_; }
    std::int64_t w_keep() const noexcept { return w_keep_; }
    std::int64_t page_rows() const noexcept { return page_rows_; }
    std::int64_t n_pages() const noexcept { return n_pages_; }
    // External mode: rows of the owner's table (n_pages * page_rows); slot
    // page * page_rows + i is row i of page `page`.
    std::int64_t table_rows() const noexcept { return n_pages_ * page_rows_; }
    bool external() const noexcept { return opt_.rows == RowMode::External; }

    // ConfigError unless a Stager with these options can use the store (the
    // message names the fields that differ).
    void check_compatible(const StagerOptions& stager) const;

    // Rows [start, end) given by the caller (held mode): n rows of feature_dim
    // elements of `type` (rows_bytes bytes). Only the kept rows are encoded.
    // Checks: the store's mode (TypeError), the publish (plan_publish), the
    // byte count, then the rows' values and, for blocks already held, that
    // they are the same rows.
    void publish_rows(const KeyChain& keys, std::int64_t start, std::int64_t end, const void* rows, ElemType type,
                      std::size_t rows_bytes);
    // External mode: the owner writes the rows itself. `slots` receives
    // end - start entries: the table slot where the owner writes the row of
    // position start + i, or -1 for a row the store does not keep (or a block
    // it already holds). Checks: the mode (TypeError), then plan_publish.
    void publish_slots(const KeyChain& keys, std::int64_t start, std::int64_t end, const SlotSink& slots);
    std::vector<std::int64_t> publish_slots(const KeyChain& keys, std::int64_t start, std::int64_t end);
    // Drops the blocks with these keys (unknown keys are ignored); returns
    // how many were held.
    std::int64_t evict(const KeyChain& keys);
    void clear();

    std::size_t size() const;
    bool contains(std::string_view key) const;
    // std::invalid_argument for a key the store does not hold.
    PrefixBlockInfo info(std::string_view key) const;
    // The table slots of the block's kept rows, in position order (external
    // mode: what the owner reads to export the block; held mode: the same
    // arithmetic, for introspection).
    std::vector<std::int64_t> block_slots(std::string_view key) const;
    // Keys held, least recently used first.
    std::vector<std::string> keys() const;
    PrefixStats stats() const;
    // What a hit at n_tokens would find; changes nothing (no refresh).
    PrefixHit lookup(const KeyChain& keys, std::int64_t n_tokens) const;

    // Export format v1 (layout in src/dspark_core/prefix/block_format.py):
    // a 64-byte header (fingerprint, key length, block_tokens, positions,
    // kept rows, CRC-32C of the key and rows, CRC-32C of the header), the
    // key, the kept rows. Held mode writes its rows; external mode takes them
    // from `rows` (the owner's copy of block_slots(key), rows * row_bytes
    // bytes). Checks: the key is held, the rows (external: given, of the
    // block's size; held: none), then cap >= export_size(key)
    // (BufferTooSmall, writing nothing).
    std::size_t export_size(std::string_view key) const;
    std::size_t export_into(std::string_view key, std::uint8_t* dst, std::size_t cap,
                            const std::uint8_t* rows = nullptr, std::size_t rows_bytes = 0) const;
    // Adds the block in `data` (as publish would: LRU eviction for room; a
    // block already held with the same rows is refreshed, with other rows
    // or positions it is an error). Damaged, foreign or inconsistent data
    // throws std::invalid_argument and changes nothing (check_import). External
    // mode: `slots` receives one slot per row of the data, where the owner
    // writes it (in order; all -1 when the block was already held); held mode
    // never calls it.
    void import_block(const std::uint8_t* data, std::size_t n, const SlotSink& slots);
    std::vector<std::int64_t> import_block(const std::uint8_t* data, std::size_t n);

    // -- what the checks return (for the Stager side, stager_prefix.cpp) ------
    struct Block {
        std::string key;
        std::int64_t start = 0, end = 0;
        SlotRun kept;
        std::vector<std::int64_t> pages;
        std::list<Block*>::iterator lru;
        std::int64_t rows() const noexcept { return kept.count; }
    };
    // A contiguous part of a block's kept rows inside one page: positions
    // [pos, pos + count) at rows [off, off + count) of page `page`.
    struct Piece {
        std::int64_t pos, count, page, off;
    };
    using PlannedBlock = PrefixPlannedBlock;

private:
    friend class Stager;

    // Where the rows of a publish come from: fill(piece, dst) writes the
    // piece's rows to dst (held) or records its slots (external, dst null).
    using RowFill = std::function<void(const Piece&, std::uint8_t* dst)>;
    // Compares rows already held (held mode) with the new ones: same(piece,
    // held) is true for equal rows (or rows it cannot see).
    using RowSame = std::function<bool(const Piece&, const std::uint8_t* held)>;

    // The keep rule (see above): the kept positions of block [s, e).
    SlotRun kept_run(std::int64_t s, std::int64_t e) const noexcept;
    std::int64_t pages_for(std::int64_t rows) const noexcept { return (rows + page_rows_ - 1) / page_rows_; }

    // -- checks (no side effects; under the store's mutex) ----------------------
    // Key i of a chain (its offsets in order, 1..64 bytes).
    static std::string_view key_at(const KeyChain& keys, std::size_t i);
    // Every key of the chain, in order.
    void check_chain(const KeyChain& keys) const;
    // The mode a store-only call needs (TypeError naming the call and the other one).
    void require_mode(RowMode mode, const char* call, const char* other) const;
    // A publish of [start, end): the keys, the positions (0 <= start < end <
    // 2**62, start a block boundary), the chain against them (one key per
    // block, no key twice, held keys for the same positions). Lists its blocks.
    std::vector<PlannedBlock> plan_publish(const KeyChain& keys, std::int64_t start, std::int64_t end) const;
    // Pages the new blocks of a plan take.
    std::int64_t new_pages(const std::vector<PlannedBlock>& plan) const noexcept;
    // Held mode: the kept rows of every block already held equal the new ones
    // (std::invalid_argument naming the block otherwise; `who` prefixes it).
    void check_same_rows(const std::vector<PlannedBlock>& plan, const RowSame& same, const std::string& who) const;
    // Held mode: same(piece, held) for every piece of a held block's rows.
    bool same_rows(const Block& b, const RowSame& same) const;
    // The error of a block held with other rows than a publish brings.
    [[noreturn]] static void refuse_other_rows(const PlannedBlock& pb, const std::string& who);
    // std::invalid_argument unless a key held for [held_start, held_end) is
    // published for the same positions [start, end).
    static void check_same_positions(std::string_view key, std::int64_t held_start, std::int64_t held_end,
                                     std::int64_t start, std::int64_t end);
    // A hit at n_tokens: the keys, n_tokens in [0, 2**62), one key per block,
    // held keys for the same positions; and the rows it places.
    struct HitPlan {
        PrefixHit hit;
        bool owed = false;  // the first round must restage (origin below first_row)
        std::vector<Piece> pieces;
        std::vector<Block*> used;
    };
    HitPlan plan_hit(const KeyChain& keys, std::int64_t n_tokens) const;
    // An exported block for this store: every field and checksum (see import_block).
    struct ImportPlan {
        std::int64_t start = 0, end = 0;
        std::size_t key_len = 0;
        std::uint32_t n_rows = 0;
        const std::uint8_t* rows = nullptr;
    };
    ImportPlan check_import(const std::uint8_t* data, std::size_t n) const;
    // The block held under `key` (std::invalid_argument naming it otherwise).
    const Block& held(std::string_view key) const;

    // -- changes -------------------------------------------------------------------
    // Calls f(piece) for each piece of the kept rows `run` laid out in `pages`.
    template <class F>
    void for_each_piece(const SlotRun& run, const std::vector<std::int64_t>& pages, F&& f) const;
    // Page memory for every page a commit of `n_new` more pages can touch
    // (allocates, may throw bad_alloc; changes nothing observable).
    void reserve_pages(std::int64_t n_new);
    // Keys of blocks no eviction may take (a batch of publishes', counted;
    // a key may name a block the batch adds later).
    using Keep = std::unordered_map<std::string_view, int>;
    // Adds the planned blocks (evicting LRU blocks for room), filling their
    // rows. `keep`: the least recently used block not in it goes instead
    // (there must be one).
    void commit_publish(const std::vector<PlannedBlock>& plan, const RowFill& fill, const Keep* keep = nullptr);
    std::int64_t take_page();
    void drop(Block& b);
    void touch(Block& b);
    std::uint8_t* page_data(std::int64_t page) noexcept;
    const std::uint8_t* page_data(std::int64_t page) const noexcept;
    // The block at chain index i if held (its positions must be [s, e), else
    // std::invalid_argument), else null.
    Block* held_block(const KeyChain& keys, std::size_t i, std::int64_t s, std::int64_t e) const;

    PrefixStoreOptions opt_;
    std::size_t row_bytes_ = 0;
    std::int64_t w_keep_ = 0;
    std::int64_t page_rows_ = 0;
    std::int64_t n_pages_ = 0;
    std::size_t page_bytes_ = 0;
    std::int64_t pages_per_chunk_ = 1;
    std::vector<ByteVec> chunks_;    // held mode: page memory, a chunk of pages each (as far as pages were used)
    std::vector<std::int64_t> freed_;  // min-heap of freed pages (all below next_fresh_)
    std::int64_t next_fresh_ = 0;    // pages [next_fresh_, n_pages_) never used
    std::unordered_map<std::string, Block> index_;
    std::list<Block*> lru_;          // least recently used first
    PrefixStats stats_;
    mutable std::mutex mu_;
};

// A block a checked publish adds (new) or finds already held (existing != null).
struct PrefixPlannedBlock {
    std::string_view key;
    std::int64_t start, end;
    SlotRun kept;
    PrefixStore::Block* existing;
};

}  // namespace dspark
