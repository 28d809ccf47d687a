// PrefixStore (dspark/prefix_store.hpp): blocks, pages, LRU, the keep rule,
// hit planning. Export / import is in prefix_block_format.cpp; the Stager side
// (publish from a ring, a hit into a ring) in stager_prefix.cpp. The
// pure-Python twin is src/dspark_core/reference/prefix_store.py.
#include "dspark/prefix_store.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "dspark/errors.hpp"
#include "dspark/stager.hpp"
#include "prefix_store_detail.hpp"

namespace dspark {

using prefix_detail::bad;
using prefix_detail::fingerprint_text;

namespace {

// Page memory is allocated this much at a time (a chunk holds at least one page).
constexpr std::size_t CHUNK_BYTES = std::size_t(4) << 20;


std::string range(std::int64_t a, std::int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + ")"; }

// The key as printable text for messages: hex, shortened.
std::string key_text(std::string_view k) {
    static const char* hex = "0123456789abcdef";
    std::string out = "0x";
    const std::size_t n = std::min<std::size_t>(k.size(), 12);
    for (std::size_t i = 0; i < n; ++i) {
        out += hex[static_cast<std::uint8_t>(k[i]) >> 4];
        out += hex[static_cast<std::uint8_t>(k[i]) & 15];
    }
    if (n < k.size()) out += "...";
    return out;
}


}  // namespace

#define DSPARK_HIT_FIELD_INFO(type, name) DSPARK_FIELD_INFO(PrefixHit, type, name)
#define DSPARK_PREFIX_STATS_FIELD_INFO(type, name) DSPARK_FIELD_INFO(PrefixStats, type, name)
const FieldInfo PREFIX_HIT_FIELDS[] = {DSPARK_PREFIX_HIT_FIELDS(DSPARK_HIT_FIELD_INFO){nullptr, 0, false}};
const FieldInfo PREFIX_STATS_FIELDS[] = {
    DSPARK_PREFIX_STATS_FIELDS(DSPARK_PREFIX_STATS_FIELD_INFO){nullptr, 0, false}};
#undef DSPARK_PREFIX_STATS_FIELD_INFO
#undef DSPARK_HIT_FIELD_INFO

PrefixStoreOptions prefix_store_options(const StagerOptions& s, std::int64_t block_tokens,
                                        std::int64_t budget_bytes) noexcept {
    PrefixStoreOptions o;
    static_cast<RowOptions&>(o) = s;
    o.block_tokens = block_tokens;
    o.budget_bytes = budget_bytes;
    return o;
}

StagerOptions stager_options(const PrefixStoreOptions& o) noexcept {
    StagerOptions s;
    static_cast<RowOptions&>(s) = o;
    s.max_seqs = 1;
    return s;
}

PrefixStore::PrefixStore(const PrefixStoreOptions& o) : opt_(o) {
    // The rows' configuration follows the Stager's rules (one Stager validates it).
    const Stager probe(stager_options(o));  // ConfigError for anything a Stager refuses; max_seqs 1 allocates no rows
    row_bytes_ = probe.row_bytes();
    w_keep_ = probe.w_keep();
    if (o.block_tokens < 1) throw ConfigError("block_tokens must be >= 1, got " + std::to_string(o.block_tokens));
    if (o.block_tokens > MAX_WINDOW)
        throw ConfigError("block_tokens (" + std::to_string(o.block_tokens) + ") must be <= 2**30");
    if (o.budget_bytes < 1) throw ConfigError("budget_bytes must be >= 1, got " + std::to_string(o.budget_bytes));
    page_rows_ = std::min(o.block_tokens, w_keep_);
    page_bytes_ = static_cast<std::size_t>(page_rows_) * row_bytes_;
    // The largest block: a full block's kept rows (all of it below W - B, K
    // rows above).
    const std::int64_t max_kept = std::min(o.block_tokens, std::max(o.window - o.block_size, w_keep_));
    const std::int64_t max_block_pages = pages_for(max_kept);
    const std::uint64_t pages = static_cast<std::uint64_t>(o.budget_bytes) / page_bytes_;
    if (pages < static_cast<std::uint64_t>(max_block_pages))
        throw ConfigError("budget_bytes (" + std::to_string(o.budget_bytes) + ") is smaller than one block: " +
                          std::to_string(max_kept) + " rows of " + std::to_string(row_bytes_) + " bytes in " +
                          std::to_string(max_block_pages) + " page(s) of " + std::to_string(page_bytes_) +
                          " bytes need " + std::to_string(static_cast<std::uint64_t>(max_block_pages) * page_bytes_));
    // Slots are int64 in the external table: keep them representable.
    n_pages_ = static_cast<std::int64_t>(std::min<std::uint64_t>(pages, (std::uint64_t(1) << 62) / page_rows_));
    pages_per_chunk_ = static_cast<std::int64_t>(std::max<std::size_t>(1, CHUNK_BYTES / page_bytes_));
    // chunks_ grows with the pages in use (reserve_pages), never with the
    // budget: a budget of 2**46 bytes meaning "no limit" costs nothing upfront.
}

void PrefixStore::check_compatible(const StagerOptions& s) const {
    std::string diff;
    auto note = [&](bool same, const char* name) {
        if (!same) diff += (diff.empty() ? "" : ", ") + std::string(name);
    };
    note(s.feature_dim == opt_.feature_dim, "feature_dim");
    note(s.storage == opt_.storage, "storage");
    note(s.window == opt_.window, "window");
    note(s.block_size == opt_.block_size, "block_size");
    note(s.nonfinite == opt_.nonfinite, "nonfinite");
    note(s.stage == opt_.stage, "stage_dtype");
    note(s.rows == opt_.rows, "rows");
    if (diff.empty()) return;
    throw ConfigError(
        "this PrefixStore holds rows of (" +
        fingerprint_text(opt_.feature_dim, opt_.storage, opt_.nonfinite, opt_.stage, opt_.window, opt_.block_size) +
        ", rows=" + (external() ? "external" : "held") + ") but the Stager has (" +
        fingerprint_text(s.feature_dim, s.storage, s.nonfinite, s.stage, s.window, s.block_size) +
        ", rows=" + (s.rows == RowMode::External ? "external" : "held") + "): " + diff +
        " differ. Stagers share a store only when all of these are equal");
}

// -- the keep rule ----------------------------------------------------------------
// A hit at h stages, of the rows before h, [h - K, h), or all of [0, h) when
// h <= W - B. Block [s, e) serves hits at h >= e: below W - B (e <= W - B)
// it may be asked for every row, above only for rows >= e - K.
SlotRun PrefixStore::kept_run(std::int64_t s, std::int64_t e) const noexcept {
    const std::int64_t lo = e <= opt_.window - opt_.block_size ? s : std::max(s, e - w_keep_);
    return SlotRun{lo, e - lo};
}


// -- keys -----------------------------------------------------------------------------

std::string_view PrefixStore::key_at(const KeyChain& keys, std::size_t i) {
    const std::size_t a = keys.offsets[i], b = keys.offsets[i + 1];
    if (b < a) bad("key offsets must not decrease (key " + std::to_string(i) + ")");
    const std::size_t n = b - a;
    if (n < 1 || n > PREFIX_MAX_KEY_BYTES)
        bad("key " + std::to_string(i) + " has " + std::to_string(n) + " bytes; keys must be 1.." +
            std::to_string(PREFIX_MAX_KEY_BYTES) + " bytes");
    return std::string_view(reinterpret_cast<const char*>(keys.bytes) + a, n);
}

void PrefixStore::check_chain(const KeyChain& keys) const {
    if (keys.n == 0) return;
    if (!keys.offsets) bad("key offsets are missing");
    if (keys.offsets[0] != 0) bad("key offsets must start at 0");
    if (!keys.bytes && keys.offsets[keys.n] != 0) bad("key bytes are missing");
    for (std::size_t i = 0; i < keys.n; ++i) key_at(keys, i);
}

// -- publish ------------------------------------------------------------------------

std::vector<PrefixStore::PlannedBlock> PrefixStore::plan_publish(const KeyChain& keys, std::int64_t start,
                                                                 std::int64_t end) const {
    const std::int64_t bt = opt_.block_tokens;
    if (start < 0 || end >= MAX_POSITION || end <= start)
        bad("publish needs positions 0 <= start < end < 2**62, got " + range(start, end));
    if (start % bt != 0)
        bad("publish must start at a block boundary: start " + std::to_string(start) + " is not a multiple of block_tokens (" +
            std::to_string(bt) + ")");
    const std::int64_t n_blocks = (end - start + bt - 1) / bt;
    if (static_cast<std::int64_t>(keys.n) != n_blocks)
        bad(std::to_string(keys.n) + " keys for positions " + range(start, end) + ": that is " +
            std::to_string(n_blocks) + " block(s) of block_tokens=" + std::to_string(bt) +
            " (the last may be partial), one key each");
    check_chain(keys);
    std::vector<PlannedBlock> plan;
    plan.reserve(keys.n);
    std::unordered_set<std::string_view> seen;
    for (std::size_t j = 0; j < keys.n; ++j) {
        PlannedBlock pb{};
        pb.key = key_at(keys, j);
        pb.start = start + static_cast<std::int64_t>(j) * bt;
        pb.end = std::min(pb.start + bt, end);
        if (!seen.insert(pb.key).second)
            bad("key " + key_text(pb.key) + " appears twice in the chain (blocks of a chain have distinct keys)");
        pb.kept = kept_run(pb.start, pb.end);
        const auto it = index_.find(std::string(pb.key));
        pb.existing = it == index_.end() ? nullptr : const_cast<Block*>(&it->second);
        if (pb.existing) check_same_positions(pb.key, pb.existing->start, pb.existing->end, pb.start, pb.end);
        plan.push_back(pb);
    }
    return plan;
}

void PrefixStore::check_same_positions(std::string_view key, std::int64_t held_start, std::int64_t held_end,
                                       std::int64_t start, std::int64_t end) {
    if (held_start != start || held_end != end)
        bad("key " + key_text(key) + " is held for positions " + range(held_start, held_end) + ", not " +
            range(start, end) + ": a key must name the same block every time");
}

void PrefixStore::refuse_other_rows(const PlannedBlock& pb, const std::string& who) {
    bad(who + "the block at " + range(pb.start, pb.end) + " (key " + key_text(pb.key) +
        ") is already held with other rows: a block published twice must carry the same rows");
}

void PrefixStore::require_mode(RowMode mode, const char* call, const char* other) const {
    if (opt_.rows == mode) return;
    throw TypeError(std::string(call) + (mode == RowMode::Held
                                             ? " needs a held-row store; this one keeps its rows in the owner's table (use "
                                             : " needs an external-row store; this one holds its rows (use ") +
                    other + ")");
}

std::int64_t PrefixStore::new_pages(const std::vector<PlannedBlock>& plan) const noexcept {
    std::int64_t n = 0;
    for (const PlannedBlock& pb : plan)
        if (!pb.existing) n += pages_for(pb.kept.count);
    return n;
}

void PrefixStore::check_same_rows(const std::vector<PlannedBlock>& plan, const RowSame& same,
                                  const std::string& who) const {
    if (external()) return;  // the owner's rows: not visible here
    for (const PlannedBlock& pb : plan)
        if (pb.existing && !same_rows(*pb.existing, same)) refuse_other_rows(pb, who);
}

bool PrefixStore::same_rows(const Block& b, const RowSame& same) const {
    bool equal = true;
    for_each_piece(b.kept, b.pages, [&](const Piece& pc) {
        equal = equal && same(pc, page_data(pc.page) + static_cast<std::size_t>(pc.off) * row_bytes_);
    });
    return equal;
}

void PrefixStore::reserve_pages(std::int64_t n_new) {
    // Room to free every page a commit can ever have taken: drop() must not allocate.
    freed_.reserve(static_cast<std::size_t>(std::min(n_pages_, next_fresh_ + n_new)));
    if (external()) return;
    const std::int64_t in_use = stats_.pages;
    // Lowest free page first: a page taken while k pages are in use has an
    // index < k + 1, so no page past in_use + n_new is ever touched.
    const std::int64_t top = std::min(n_pages_, in_use + n_new);
    const std::int64_t chunks = (top + pages_per_chunk_ - 1) / pages_per_chunk_;
    // Moving a chunk keeps its bytes where they are: page pointers stay valid.
    if (chunks_.size() < static_cast<std::size_t>(chunks)) chunks_.resize(static_cast<std::size_t>(chunks));
    for (std::int64_t c = 0; c < chunks; ++c) {
        ByteVec& chunk = chunks_[static_cast<std::size_t>(c)];
        if (!chunk.empty()) continue;
        const std::int64_t pages = std::min(pages_per_chunk_, n_pages_ - c * pages_per_chunk_);
        chunk.resize(static_cast<std::size_t>(pages) * page_bytes_);  // may throw bad_alloc: nothing changed
        stats_.resident_bytes += static_cast<std::int64_t>(chunk.size());
    }
}

std::uint8_t* PrefixStore::page_data(std::int64_t page) noexcept {
    return chunks_[static_cast<std::size_t>(page / pages_per_chunk_)].data() +
           static_cast<std::size_t>(page % pages_per_chunk_) * page_bytes_;
}
const std::uint8_t* PrefixStore::page_data(std::int64_t page) const noexcept {
    return const_cast<PrefixStore*>(this)->page_data(page);
}

// Lowest free page first: the smallest freed page (all are below
// next_fresh_), else a page never used.
std::int64_t PrefixStore::take_page() {
    std::int64_t p;
    if (!freed_.empty()) {
        std::pop_heap(freed_.begin(), freed_.end(), std::greater<>());
        p = freed_.back();
        freed_.pop_back();
    } else {
        p = next_fresh_++;
    }
    stats_.pages += 1;
    return p;
}

// No allocation: freed_ has room for every page ever taken (reserve_pages).
void PrefixStore::drop(Block& b) {
    for (std::int64_t p : b.pages) {
        freed_.push_back(p);
        std::push_heap(freed_.begin(), freed_.end(), std::greater<>());
    }
    stats_.pages -= static_cast<std::int64_t>(b.pages.size());
    stats_.key_bytes -= static_cast<std::int64_t>(b.key.size());
    stats_.blocks -= 1;
    lru_.erase(b.lru);
    index_.erase(index_.find(b.key));
}

void PrefixStore::touch(Block& b) { lru_.splice(lru_.end(), lru_, b.lru); }

// Existing blocks are refreshed first (in chain order), then new blocks are
// added in chain order, each evicting least recently used blocks until its
// pages are free. The caller validated the plan and reserved the pages
// (reserve_pages): what is left to fail is the index's own small
// allocations (std::bad_alloc), and then every block is added whole or not
// at all, the ones before it staying added.
void PrefixStore::commit_publish(const std::vector<PlannedBlock>& plan, const RowFill& fill, const Keep* keep) {
    for (const PlannedBlock& pb : plan)
        if (pb.existing) {
            touch(*pb.existing);
            stats_.republished += 1;
        }
    for (const PlannedBlock& pb : plan) {
        if (pb.existing) continue;
        const std::int64_t need = pages_for(pb.kept.count);
        while (n_pages_ - stats_.pages < need) {
            auto victim = lru_.begin();
            if (keep)
                while (keep->count((*victim)->key)) ++victim;
            drop(**victim);
            stats_.evicted_lru += 1;
        }
        auto [it, inserted] = index_.emplace(std::string(pb.key), Block{});
        (void)inserted;
        Block& b = it->second;
        b.key = it->first;
        b.start = pb.start;
        b.end = pb.end;
        b.kept = pb.kept;
        b.pages.reserve(static_cast<std::size_t>(need));
        for (std::int64_t i = 0; i < need; ++i) b.pages.push_back(take_page());
        b.lru = lru_.insert(lru_.end(), &b);
        stats_.blocks += 1;
        stats_.key_bytes += static_cast<std::int64_t>(b.key.size());
        stats_.published += 1;
        for_each_piece(b.kept, b.pages, [&](const Piece& pc) {
            fill(pc, external() ? nullptr : page_data(pc.page) + static_cast<std::size_t>(pc.off) * row_bytes_);
        });
    }
}

void PrefixStore::publish_rows(const KeyChain& keys, std::int64_t start, std::int64_t end, const void* rows,
                               ElemType type, std::size_t rows_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    require_mode(RowMode::Held, "publish_rows", "publish_slots");
    const std::vector<PlannedBlock> plan = plan_publish(keys, start, end);
    const std::size_t dim = static_cast<std::size_t>(opt_.feature_dim);
    const std::size_t in_row = dim * elem_bytes(type);
    const std::size_t n = static_cast<std::size_t>(end - start);
    if (rows_bytes % in_row != 0 || rows_bytes / in_row != n)  // (n * in_row could overflow)
        bad("rows must be " + std::to_string(n) + " x " + std::to_string(dim) + " " + elem_name(type) +
            " values for positions " + range(start, end) + ", got " + std::to_string(rows_bytes / in_row) +
            (rows_bytes % in_row ? " rows and " + std::to_string(rows_bytes % in_row) + " bytes" : " rows"));
    if (!rows && n) bad("rows are missing");
    // Encode every kept row once (checked under "error" before anything
    // changes); then fill new blocks from, and compare held ones with, it.
    const auto* src = static_cast<const std::uint8_t*>(rows);
    const EncodeBounds bounds = encode_bounds(opt_.storage, opt_.stage);
    ByteVec enc(n * row_bytes_);
    std::vector<bool> kept(n, false);
    for (const PlannedBlock& pb : plan)
        for (std::int64_t p = pb.kept.first; p < pb.kept.first + pb.kept.count; ++p)
            kept[static_cast<std::size_t>(p - start)] = true;
    for (std::size_t i = 0; i < n;) {
        if (!kept[i]) {
            ++i;
            continue;
        }
        std::size_t j = i;
        while (j < n && kept[j]) ++j;
        const std::int64_t first_bad = encode_rows(src + i * in_row, type, enc.data() + i * row_bytes_, opt_.storage,
                                                   j - i, dim, opt_.nonfinite, bounds);
        if (first_bad >= 0) {
            const std::size_t flat = i * dim + static_cast<std::size_t>(first_bad);
            const float v = element_value(src, type, flat);
            char val[32], lim[32];
            // NaN prints as "nan" whatever its sign bit (as Python formats it).
            if (std::isnan(v)) std::snprintf(val, sizeof val, "nan");
            else std::snprintf(val, sizeof val, "%.9g", static_cast<double>(v));
            std::snprintf(lim, sizeof lim, "%.9g", static_cast<double>(bounds.limit));
            const std::size_t row = flat / dim;
            bad("row " + std::to_string(row) + " (position " + std::to_string(start + static_cast<std::int64_t>(row)) +
                "), channel " + std::to_string(flat % dim) + " holds " + val +
                (std::isfinite(v) ? std::string(", which overflows ") + storage_name(opt_.storage) + " storage" +
                                        (opt_.stage == ElemType::F32 ? std::string()
                                                                     : std::string(" staged as ") + elem_name(opt_.stage)) +
                                        " (|x| must stay below " + lim + ")"
                                  : std::string(", a non-finite value")) +
                "; nothing was published (nonfinite='error')");
        }
        i = j;
    }
    auto at = [&](std::int64_t pos) { return enc.data() + static_cast<std::size_t>(pos - start) * row_bytes_; };
    check_same_rows(plan, [&](const Piece& pc, const std::uint8_t* held) {
        return std::memcmp(held, at(pc.pos), static_cast<std::size_t>(pc.count) * row_bytes_) == 0;
    }, "");
    reserve_pages(new_pages(plan));
    commit_publish(plan, [&](const Piece& pc, std::uint8_t* dst) {
        std::memcpy(dst, at(pc.pos), static_cast<std::size_t>(pc.count) * row_bytes_);
    });
}

void PrefixStore::publish_slots(const KeyChain& keys, std::int64_t start, std::int64_t end, const SlotSink& slots) {
    std::lock_guard<std::mutex> lock(mu_);
    require_mode(RowMode::External, "publish_slots", "publish_rows");
    const std::vector<PlannedBlock> plan = plan_publish(keys, start, end);
    // Every check passed: room for the slots (may throw), then the pages.
    std::int64_t* out = slots(static_cast<std::size_t>(end - start));
    reserve_pages(new_pages(plan));
    std::fill(out, out + (end - start), std::int64_t(-1));
    commit_publish(plan, [&](const Piece& pc, std::uint8_t*) {
        for (std::int64_t i = 0; i < pc.count; ++i) out[pc.pos - start + i] = pc.page * page_rows_ + pc.off + i;
    });
}

std::vector<std::int64_t> PrefixStore::publish_slots(const KeyChain& keys, std::int64_t start, std::int64_t end) {
    std::vector<std::int64_t> out;
    publish_slots(keys, start, end, [&](std::size_t n) {
        out.resize(n);
        return out.data();
    });
    return out;
}

// -- eviction and introspection -------------------------------------------------------

std::int64_t PrefixStore::evict(const KeyChain& keys) {
    std::lock_guard<std::mutex> lock(mu_);
    check_chain(keys);
    std::int64_t n = 0;
    for (std::size_t i = 0; i < keys.n; ++i) {
        const auto it = index_.find(std::string(key_at(keys, i)));
        if (it == index_.end()) continue;
        drop(it->second);
        stats_.evicted_by_key += 1;
        ++n;
    }
    return n;
}

void PrefixStore::clear() {
    std::lock_guard<std::mutex> lock(mu_);
    index_.clear();
    lru_.clear();
    freed_.clear();  // keeps its capacity
    next_fresh_ = 0;
    const std::int64_t resident = stats_.resident_bytes;  // page memory stays allocated for reuse
    stats_ = PrefixStats{};
    stats_.resident_bytes = resident;
}

std::size_t PrefixStore::size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return index_.size();
}

bool PrefixStore::contains(std::string_view key) const {
    std::lock_guard<std::mutex> lock(mu_);
    return index_.count(std::string(key)) != 0;
}

const PrefixStore::Block& PrefixStore::held(std::string_view key) const {
    const auto it = index_.find(std::string(key));
    if (it == index_.end()) bad("this PrefixStore holds no block with key " + key_text(key));
    return it->second;
}

PrefixBlockInfo PrefixStore::info(std::string_view key) const {
    std::lock_guard<std::mutex> lock(mu_);
    const Block& b = held(key);
    PrefixBlockInfo out;
    out.start = b.start;
    out.end = b.end;
    out.kept = b.kept;
    out.rows = b.rows();
    out.pages = static_cast<std::int64_t>(b.pages.size());
    return out;
}

std::vector<std::int64_t> PrefixStore::block_slots(std::string_view key) const {
    std::lock_guard<std::mutex> lock(mu_);
    const Block& b = held(key);
    std::vector<std::int64_t> out;
    out.reserve(static_cast<std::size_t>(b.rows()));
    for_each_piece(b.kept, b.pages, [&](const Piece& pc) {
        for (std::int64_t i = 0; i < pc.count; ++i) out.push_back(pc.page * page_rows_ + pc.off + i);
    });
    return out;
}

std::vector<std::string> PrefixStore::keys() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    out.reserve(lru_.size());
    for (const Block* b : lru_) out.push_back(b->key);
    return out;
}

PrefixStats PrefixStore::stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    PrefixStats s = stats_;
    s.bytes = s.pages * static_cast<std::int64_t>(page_bytes_);
    return s;
}

// -- hits -------------------------------------------------------------------------------

PrefixStore::Block* PrefixStore::held_block(const KeyChain& keys, std::size_t i, std::int64_t s, std::int64_t e) const {
    const std::string_view k = key_at(keys, i);
    const auto it = index_.find(std::string(k));
    if (it == index_.end()) return nullptr;
    const Block& b = it->second;
    if (b.start != s || b.end != e)
        bad("the key chain does not match the positions: key " + std::to_string(i) + " (" + key_text(k) +
            ") is held for positions " + range(b.start, b.end) + ", but block " + std::to_string(i) + " of a hit covers " +
            range(s, e));
    return const_cast<Block*>(&b);
}

namespace {
// True when the block's kept rows include every position of [lo, hi).
bool covers(const SlotRun& kept, std::int64_t lo, std::int64_t hi) {
    return hi <= lo || (kept.first <= lo && hi <= kept.first + kept.count);
}
}  // namespace

// Which rows a hit at h places and where the server prefills from
// (docs/prefix_cache.md, "Hits"):
//  need = h - K, or 0 when h <= W - B (the rows a full prefill's first round
//  can stage); m = the first row >= need the store lacks (h if none).
//  * m >= h - K (always when h > W - B): rows [need, m), replay from m (at
//    most K positions), origin 0 as for a full prefill. Exact.
//  * else (a short prompt missing rows deep below h - K): no replay longer
//    than K: replay from m2, the first row >= h - K the store lacks, with
//    the rows held contiguously below it, [a, m2), and origin a: the first
//    round stages at least K rows (from a), not the full prompt.
PrefixStore::HitPlan PrefixStore::plan_hit(const KeyChain& keys, std::int64_t h) const {
    const std::int64_t bt = opt_.block_tokens;
    if (h < 0 || h >= MAX_POSITION) bad("n_tokens must be in [0, 2**62), got " + std::to_string(h));
    const std::int64_t n_blocks = (h + bt - 1) / bt;
    if (static_cast<std::int64_t>(keys.n) != n_blocks)
        bad(std::to_string(keys.n) + " keys for a hit of " + std::to_string(h) + " tokens: the chain needs " +
            std::to_string(n_blocks) + " (one per block of block_tokens=" + std::to_string(bt) +
            ", the last may be partial)");
    check_chain(keys);
    HitPlan plan;
    PrefixHit& r = plan.hit;
    r.n_tokens = h;
    if (h == 0) return plan;
    const std::int64_t K = w_keep_;
    const std::int64_t need = h <= opt_.window - opt_.block_size ? 0 : h - K;
    r.need_first = need;
    auto block_of = [&](std::int64_t i) -> Block* {
        const std::int64_t s = i * bt, e = std::min(s + bt, h);
        return held_block(keys, static_cast<std::size_t>(i), s, e);
    };
    // Blocks [need / bt, n): every one is checked against the chain's positions.
    const std::int64_t i0 = need / bt;
    std::vector<Block*> found(static_cast<std::size_t>(n_blocks - i0), nullptr);
    for (std::int64_t i = i0; i < n_blocks; ++i) found[static_cast<std::size_t>(i - i0)] = block_of(i);
    // First row >= lo that is not held (h if none).
    auto first_missing = [&](std::int64_t lo) {
        for (std::int64_t i = lo / bt; i < n_blocks; ++i) {
            const Block* b = found[static_cast<std::size_t>(i - i0)];
            const std::int64_t s = std::max(lo, i * bt), e = std::min(i * bt + bt, h);
            if (!b || !covers(b->kept, s, e)) return s;
        }
        return h;
    };
    const std::int64_t m = first_missing(need);
    std::int64_t a, to;
    if (m >= h - K) {
        a = need, to = m;
        r.origin = 0;
        plan.owed = a > 0;  // the first round restages [start - K, start), as a full prefill's rebase does
    } else {
        // need == 0 and i0 == 0 here: `found` holds every block of the chain.
        to = first_missing(h - K);
        // The run of rows held contiguously below `to` (every row below W - B is kept).
        a = to;
        while (a > 0) {
            const std::int64_t j = (a - 1) / bt;
            const Block* b = found[static_cast<std::size_t>(j)];
            if (!b || b->kept.first >= a) break;
            a = std::max(b->kept.first, j * bt);
            if (a > j * bt) break;
        }
        r.origin = a;
        r.exact = false;
    }
    r.first_row = a;
    r.replay_from = to;
    r.rows = to - a;
    // The pieces of rows [a, to), block by block, and the blocks read.
    for (std::int64_t i = a / bt; a < to && i * bt < to; ++i) {  // a >= need: every block is in `found`
        Block* b = found[static_cast<std::size_t>(i - i0)];
        const std::int64_t lo = std::max(a, i * bt), hi = std::min(to, i * bt + bt);
        for_each_piece(b->kept, b->pages, [&](const Piece& pc) {
            const std::int64_t x = std::max(lo, pc.pos), y = std::min(hi, pc.pos + pc.count);
            if (x < y) plan.pieces.push_back(Piece{x, y - x, pc.page, pc.off + (x - pc.pos)});
        });
        plan.used.push_back(b);
    }
    r.blocks_found = static_cast<std::int64_t>(plan.used.size());
    return plan;
}

PrefixHit PrefixStore::lookup(const KeyChain& keys, std::int64_t n_tokens) const {
    std::lock_guard<std::mutex> lock(mu_);
    return plan_hit(keys, n_tokens).hit;
}

}  // namespace dspark
