// libFuzzer target over dspark::PrefixStore (dspark/prefix_store.hpp) and the
// Stager's prefix calls (publish_prefix, start_from_prefix), held rows.
//
// The first byte picks a mode, the next ones a configuration (storage, B, W,
// block_tokens, a budget of a few pages, so LRU eviction runs all the time):
//  0 ops: a sequence of calls on three conversations (each has its own rows,
//    a pure function of the position, and its own chain of block keys):
//    process, publish_prefix (ranges valid and not, chains right and broken),
//    publish_rows (also with other rows for blocks already held: an error),
//    hits (lookup first, then start_from_prefix on a scratch Stager), evict
//    by key, export / import into a second store, clear.
//  1 import of an exported block with damage from the input (byte edits,
//    truncation, extension; checksums refreshed or not), into a store of the
//    same configuration or of another block_tokens.
//  2 import of the raw input bytes.
//
// Findings (the process aborts, libFuzzer saves the input):
//  * any exception other than the documented ones (std::invalid_argument and
//    its subclasses, dspark::StateError); a crash or sanitizer report;
//  * a rejected call that changed anything: the store's keys (in LRU order),
//    counters, blocks, slots and exported bytes, or the Stager's state;
//  * a broken store invariant (check_store): blocks / keys / counters agree,
//    pages held <= n_pages, bytes held and page memory <= the budget, every
//    block's kept rows are the keep rule's, its pages are ceil(rows /
//    page_rows), the slots of all blocks are distinct and inside the table;
//  * a hit that reports other than lookup did just before it, a replay
//    position more than K before n_tokens or past it, rows != replay_from -
//    first_row, or an "exact" hit whose first round differs from a full
//    prefill's (plan and staged bytes, from a Stager that processed every
//    position of the conversation);
//  * an evict that does not drop what was held; a block published with other
//    rows under held keys that is accepted;
//  * an import that succeeds but whose block does not export to the very
//    bytes imported; an export of a held block that another store refuses.
//
// Build: cmake -DDSPARK_FUZZ=ON with clang (csrc/fuzz/CMakeLists.txt).
// Run:   ./fuzz_prefix -max_total_time=60 CORPUS_DIR
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "dspark/crc32c.hpp"
#include "dspark/dspark.h"
#include "dspark/errors.hpp"
#include "dspark/prefix_store.hpp"
#include "dspark/stager.hpp"
#include "fuzz_common.hpp"

using namespace dspark;
using dspark_fuzz::Reader;

namespace {

constexpr std::int64_t D = 32;         // one q8_0 / q4_0 block per row
constexpr std::int64_t MAX_LEN = 400;  // positions per conversation
constexpr int N_CONV = 3;
constexpr int MAX_OPS = 96;
// The block export format's offsets (src/dspark_core/prefix/block_format.py).
constexpr std::size_t BLOCK_HEADER = 64, BODY_CRC_AT = 56, HEADER_CRC_AT = 60;

// How a call ended: 0 returned, 1 std::invalid_argument (and its subclasses),
// 2 StateError. Anything else escapes and is a finding.
enum Outcome : int { OK = 0, INVALID = 1, STATE = 2 };

template <class Fn>
int outcome_of(Fn&& fn, std::string* what = nullptr) {
    try {
        fn();
    } catch (const StateError& e) {
        if (what) *what = e.what();
        return STATE;
    } catch (const std::invalid_argument& e) {
        if (what) *what = e.what();
        return INVALID;
    }
    return OK;
}

// The rows of conversation `conv` at position p: activations-like (one massive
// channel, never zero, so a row scaled by 0.5 encodes differently in every
// storage), finite in f16.
float value(int conv, std::int64_t p, std::int64_t c) {
    std::uint32_t h = static_cast<std::uint32_t>(conv * 1000003 + p * 7919 + c * 104729);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float v = static_cast<float>(static_cast<int>(h % 2001) - 1000) * 0.001f;
    return c == 3 ? 2000.0f + 9000.0f * v : v;
}

std::vector<float> rows_of(int conv, std::int64_t lo, std::int64_t hi, float scale = 1.0f) {
    std::vector<float> r(static_cast<std::size_t>((hi - lo) * D));
    for (std::int64_t p = lo; p < hi; ++p)
        for (std::int64_t c = 0; c < D; ++c) r[static_cast<std::size_t>((p - lo) * D + c)] = scale * value(conv, p, c);
    return r;
}

// The id of the token at position p of conversation conv (the prompt a chain drafter's hit takes).
std::int32_t tok_of(int conv, std::int64_t p) {
    return static_cast<std::int32_t>((conv * 7919 + p * 31 + 5) % 50000);
}

// A chain of keys: key of block [s, e) of conversation conv is "c<conv>:<s>:<e>".
struct Chain {
    std::string bytes;
    std::vector<std::size_t> offsets{0};
    void add(const std::string& k) {
        bytes += k;
        offsets.push_back(bytes.size());
    }
    KeyChain view() const {
        return KeyChain{reinterpret_cast<const std::uint8_t*>(bytes.data()), offsets.data(), offsets.size() - 1};
    }
    std::string key(std::size_t i) const { return bytes.substr(offsets[i], offsets[i + 1] - offsets[i]); }
    std::size_t n() const { return offsets.size() - 1; }
};

std::string key_of(int conv, std::int64_t s, std::int64_t e) {
    return "c" + std::to_string(conv) + ":" + std::to_string(s) + ":" + std::to_string(e);
}

// Keys of the blocks of [lo, hi) (lo need not be a block boundary: then the
// chain is wrong and the call must say so), bent by `bend`: 0 as is, 1 the
// first key dropped, 2 a key added, 3 two keys swapped, 4 another conversation's.
Chain chain_of(int conv, std::int64_t lo, std::int64_t hi, std::int64_t bt, int bend) {
    std::vector<std::string> keys;
    for (std::int64_t s = lo; s < hi; s += bt) keys.push_back(key_of(conv, s, std::min(s + bt, hi)));
    switch (bend) {
        case 1: if (!keys.empty()) keys.erase(keys.begin()); break;
        case 2: keys.push_back(key_of(conv, hi, hi + bt)); break;
        case 3: if (keys.size() >= 2) std::swap(keys[0], keys[1]); break;
        case 4: for (auto& k : keys) k[1] = static_cast<char>('0' + (k[1] - '0' + 1) % N_CONV); break;
        default: break;
    }
    Chain c;
    for (const auto& k : keys) c.add(k);
    return c;
}

std::vector<std::uint8_t> export_of(const PrefixStore& store, const std::string& key) {
    std::vector<std::uint8_t> out(store.export_size(key));
    FUZZ_CHECK(store.export_into(key, out.data(), out.size()) == out.size());
    return out;
}

// Everything observable about a store: a rejected call must leave it equal.
std::string store_image(const PrefixStore& store) {
    std::string img;
    const PrefixStats s = store.stats();
#define DSPARK_STATS_VALUE(type, name) s.name,
    for (std::int64_t v : {DSPARK_PREFIX_STATS_FIELDS(DSPARK_STATS_VALUE)}) img += std::to_string(v) + ",";
#undef DSPARK_STATS_VALUE
    for (const std::string& k : store.keys()) {
        img += "|" + k + ":";
        for (std::int64_t slot : store.block_slots(k)) img += std::to_string(slot) + ",";
        const auto bytes = export_of(store, k);
        img.append(bytes.begin(), bytes.end());
    }
    return img;
}

std::string state_image(const Stager& st) {
    std::string img;
    for (std::int64_t q = 0; q < st.options().max_seqs; ++q) {
        const SeqState s = st.state(q);
        for (std::int64_t v : {std::int64_t(s.started), s.end, s.horizon, s.n_cache, s.pos_base, s.n_retained,
                               s.n_pending, std::int64_t(s.open_round), std::int64_t(s.restage_owed),
                               std::int64_t(s.first_round)})
            img += std::to_string(v) + ",";
    }
    return img + std::to_string(st.moves_issued());
}

// The store's invariants (see the top of the file).
void check_store(const PrefixStore& store) {
    const PrefixStoreOptions& o = store.options();
    const PrefixStats s = store.stats();
    const std::vector<std::string> keys = store.keys();
    const std::int64_t page_bytes = store.page_rows() * static_cast<std::int64_t>(store.row_bytes());
    FUZZ_CHECK(s.blocks == static_cast<std::int64_t>(keys.size()));
    FUZZ_CHECK(store.size() == keys.size());
    FUZZ_CHECK(s.pages >= 0 && s.pages <= store.n_pages());
    FUZZ_CHECK(s.bytes == s.pages * page_bytes && s.bytes <= o.budget_bytes);
    FUZZ_CHECK(s.resident_bytes >= s.bytes && s.resident_bytes <= store.n_pages() * page_bytes);
    const std::int64_t K = store.w_keep(), whole_below = o.window - o.block_size;
    std::int64_t pages = 0, key_bytes = 0;
    std::set<std::int64_t> slots;
    for (const std::string& k : keys) {
        FUZZ_CHECK(store.contains(k));
        const PrefixBlockInfo b = store.info(k);
        FUZZ_CHECK(b.start >= 0 && b.start % o.block_tokens == 0 && b.end > b.start && b.end - b.start <= o.block_tokens);
        // The keep rule: all rows of a block ending at or below W - B, else its last K.
        const std::int64_t first = b.end <= whole_below ? b.start : std::max(b.start, b.end - K);
        FUZZ_CHECK(b.kept.first == first && b.kept.first + b.kept.count == b.end && b.rows == b.kept.count);
        FUZZ_CHECK(b.pages == (b.rows + store.page_rows() - 1) / store.page_rows());
        pages += b.pages;
        key_bytes += static_cast<std::int64_t>(k.size());
        const std::vector<std::int64_t> bs = store.block_slots(k);
        FUZZ_CHECK(static_cast<std::int64_t>(bs.size()) == b.rows);
        for (std::int64_t slot : bs) {
            FUZZ_CHECK(slot >= 0 && slot < store.table_rows());
            FUZZ_CHECK(slots.insert(slot).second);  // no two rows share a slot
        }
    }
    FUZZ_CHECK(pages == s.pages && key_bytes == s.key_bytes);
}

struct Config {
    StagerOptions so;
    PrefixStoreOptions po;
};

// A configuration from the input, or false when the core rejects it.
bool config_of(Reader& r, Config& c) {
    static const Storage storages[] = {Storage::F32, Storage::F16, Storage::BF16, Storage::Q8_0, Storage::Q4_0};
    static const std::int64_t tokens[] = {1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 64, 100};
    c.so.feature_dim = D;
    c.so.storage = storages[r.u8() % 5];
    c.so.block_size = 1 + r.u8() % 6;
    c.so.window = 2 * c.so.block_size + 1 + r.u8() % 48;
    c.so.max_seqs = N_CONV;
    c.po = prefix_store_options(c.so, tokens[r.u8() % 12], 0);
    const std::int64_t n_pages = 1 + r.u8() % 12;
    const std::int64_t slack = r.u8();
    try {
        PrefixStoreOptions roomy = c.po;
        roomy.budget_bytes = std::int64_t(1) << 30;
        const PrefixStore probe(roomy);
        const std::int64_t page_bytes = probe.page_rows() * static_cast<std::int64_t>(probe.row_bytes());
        // A budget of n_pages pages, never below one block's pages.
        const std::int64_t block_pages = (c.po.block_tokens + probe.page_rows() - 1) / probe.page_rows();
        c.po.budget_bytes = std::max(n_pages, block_pages) * page_bytes + slack % page_bytes;
        Stager check(c.so);
        (void)check;
    } catch (const std::invalid_argument&) {
        return false;
    }
    return true;
}

// Byte edits from the input, then (maybe) the checksums made right again so the
// field checks behind them are reached.
void damage(Reader& r, std::vector<std::uint8_t>& data) {
    const int edits = r.u8() % 4;
    for (int e = 0; e < edits && !data.empty(); ++e) {
        const std::size_t at = r.u16() % data.size();
        data[at] ^= static_cast<std::uint8_t>(1 + r.u8() % 255);
    }
    const std::uint8_t how = r.u8();
    if (how & 1) data.resize(data.size() - std::min<std::size_t>(data.size(), 1 + r.u8() % 16));
    if (how & 2) data.insert(data.end(), 1 + r.u8() % 8, r.u8());
    if ((how & 4) && data.size() >= BLOCK_HEADER) {
        const std::uint32_t body = crc32c(0, data.data() + BLOCK_HEADER, data.size() - BLOCK_HEADER);
        std::memcpy(data.data() + BODY_CRC_AT, &body, 4);  // little-endian machines only (the fuzz hosts)
        const std::uint32_t head = crc32c(0, data.data(), HEADER_CRC_AT);
        std::memcpy(data.data() + HEADER_CRC_AT, &head, 4);
    }
}

// Imports `data`: it is refused with std::invalid_argument and nothing changes,
// or it is taken and its key exports to exactly these bytes.
void import_checked(PrefixStore& store, const std::vector<std::uint8_t>& data) {
    const std::string before = store_image(store);
    std::vector<std::int64_t> slots;
    const int out = outcome_of([&] { slots = store.import_block(data.data(), data.size()); });
    FUZZ_CHECK(out == OK || out == INVALID);
    if (out != OK) {
        FUZZ_CHECK(store_image(store) == before);
        return;
    }
    FUZZ_CHECK(slots.empty());  // held rows: no slots to write
    FUZZ_CHECK(data.size() >= BLOCK_HEADER + data[15]);
    const std::string key(reinterpret_cast<const char*>(data.data()) + BLOCK_HEADER, data[15]);
    FUZZ_CHECK(store.contains(key));
    FUZZ_CHECK(export_of(store, key) == data);
    check_store(store);
}

StagerOptions chain_options(StagerOptions o) {
    o.kind = DrafterKind::Chain;
    return o;
}

// A C ABI stager of the configuration (the C++ defaults of every field not set).
dspark_stager* c_stager(const StagerOptions& o) {
    dspark_config c;
    dspark_config_init(&c);
    c.storage = static_cast<std::int32_t>(o.storage);
    c.feature_dim = o.feature_dim;
    c.block_size = o.block_size;
    c.window = o.window;
    c.max_seqs = o.max_seqs;
    c.kind = o.kind == DrafterKind::Chain ? DSPARK_KIND_CHAIN : DSPARK_KIND_BLOCK;
    dspark_stager* st = nullptr;
    FUZZ_CHECK(dspark_stager_create(&c, &st) == DSPARK_OK && st != nullptr);
    return st;
}

// The C ABI's status as the C++ outcome it stands for.
int outcome_of_status(dspark_status s) {
    if (s == DSPARK_OK) return OK;
    if (s == DSPARK_E_STATE) return STATE;
    FUZZ_CHECK(s == DSPARK_E_INVALID_ARGUMENT || s == DSPARK_E_CONFIG || s == DSPARK_E_TYPE);
    return INVALID;
}

struct Harness {
    Config c;
    Stager st;        // sequence q belongs to conversation q
    Stager hitter;    // sequence 0: started from hits
    Stager full;      // sequence 0: a full prefill, the hits' oracle
    PrefixStore store, other;
    std::int64_t bt;
    // A chain drafter's hits (docs/design.md 2.12): the C ABI's chain stager (cst) hits cstore, a
    // copy of store's blocks made before every hit, through dspark_prefix_hit(_many)_tokens; its
    // oracle is the C++ chain stager chit hitting store. A block stager through the C ABI (cbst)
    // hits with the plain forms (the oracle: hitter), and its _tokens forms are refused.
    Stager chit;
    dspark_stager* cst = nullptr;
    dspark_stager* cbst = nullptr;
    dspark_prefix_store* cstore = nullptr;
    int chit_conv[N_CONV] = {-1, -1, -1};  // the conversation whose prompt a chain sequence hit, or -1

    explicit Harness(const Config& cfg)
        : c(cfg), st(cfg.so), hitter(cfg.so), full(cfg.so), store(cfg.po), other(cfg.po), bt(cfg.po.block_tokens),
          chit(chain_options(cfg.so)) {
        cst = c_stager(chit.options());
        cbst = c_stager(cfg.so);
        FUZZ_CHECK(dspark_prefix_store_create(cst, cfg.po.block_tokens, cfg.po.budget_bytes, &cstore) == DSPARK_OK);
    }
    ~Harness() {
        dspark_prefix_store_destroy(cstore);
        dspark_stager_destroy(cst);
        dspark_stager_destroy(cbst);
    }
    Harness(const Harness&) = delete;
    Harness& operator=(const Harness&) = delete;

    // cstore holds store's blocks (their rows as exported), nothing else.
    void sync_cstore() {
        FUZZ_CHECK(dspark_prefix_clear(cstore) == DSPARK_OK);
        for (const std::string& k : store.keys()) {
            const auto data = export_of(store, k);
            std::size_t n_slots = 9;
            FUZZ_CHECK(dspark_prefix_import(cstore, data.data(), data.size(), nullptr, 0, &n_slots) == DSPARK_OK);
            FUZZ_CHECK(n_slots == 0);
        }
        std::size_t n = 0;
        FUZZ_CHECK(dspark_prefix_count(cstore, &n) == DSPARK_OK && n == store.size());
    }

    // A C ABI stager's sequence: its state and snapshot bytes (a snapshot holds the ids).
    static std::vector<std::uint8_t> c_image(dspark_stager* s, std::int64_t q) {
        dspark_state x;
        dspark_state_init(&x);
        FUZZ_CHECK(dspark_state_get(s, q, &x) == DSPARK_OK);
        std::vector<std::uint8_t> out(reinterpret_cast<const std::uint8_t*>(&x),
                                      reinterpret_cast<const std::uint8_t*>(&x) + sizeof x);
        std::size_t n = 0, w = 0;
        if (dspark_snapshot_size(s, q, &n) == DSPARK_OK) {
            std::vector<std::uint8_t> snap(n);
            FUZZ_CHECK(dspark_snapshot(s, q, snap.data(), n, &w) == DSPARK_OK && w == n);
            out.insert(out.end(), snap.begin(), snap.end());
        }
        return out;
    }
    // The C++ chain stager's sequence as the same bytes: its snapshot (and its state, below).
    std::vector<std::uint8_t> cpp_snapshot(std::int64_t q) const {
        std::vector<std::uint8_t> snap;
        if (outcome_of([&] { snap = chit.snapshot(q); }) != OK) return {};
        return snap;
    }

    // cst and chit agree on every sequence: state, snapshot bytes, the ids of the stageable rows;
    // a sequence started by a hit holds its prompt's ids.
    void check_chain_twins() {
        for (std::int64_t q = 0; q < N_CONV; ++q) {
            dspark_state x;
            dspark_state_init(&x);
            FUZZ_CHECK(dspark_state_get(cst, q, &x) == DSPARK_OK);
            const SeqState y = chit.state(q);
            FUZZ_CHECK(x.started == y.started && x.end == y.end && x.horizon == y.horizon && x.n_cache == y.n_cache &&
                       x.pos_base == y.pos_base && x.open_round == y.open_round && x.n_retained == y.n_retained &&
                       x.n_pending == y.n_pending && x.first_round == y.first_round);
            std::size_t n = 0, w = 0;
            const bool has = dspark_snapshot_size(cst, q, &n) == DSPARK_OK;
            const std::vector<std::uint8_t> want = cpp_snapshot(q);
            FUZZ_CHECK(has == !want.empty());
            if (has) {
                std::vector<std::uint8_t> snap(n);
                FUZZ_CHECK(dspark_snapshot(cst, q, snap.data(), n, &w) == DSPARK_OK && snap == want);
            }
            const std::int64_t lo = y.started ? y.horizon : 0, hi = y.started ? y.end : 0;
            std::vector<std::int32_t> got(static_cast<std::size_t>(hi - lo) + 1, -7), ids(got.size(), -7);
            FUZZ_CHECK(dspark_tokens(cst, q, lo, hi, got.data()) == DSPARK_OK);
            chit.tokens(q, lo, hi, ids.data());
            FUZZ_CHECK(got == ids);
            if (chit_conv[q] >= 0)
                for (std::int64_t p = lo; p < hi; ++p)
                    FUZZ_CHECK(got[static_cast<std::size_t>(p - lo)] == tok_of(chit_conv[q], p));
        }
    }

    // One chain hit of conversation conv's first h positions under ch (through the C ABI and the
    // C++ oracle), with the prompt's ids drawn by tk: mostly right, tk % 8 == 7 one negative,
    // tk % 16 == 15 none (refused, nothing changed); then the plain and _tokens forms on the C
    // block stager. `looked`, `seen`: what lookup and the block hitter found.
    void chain_hit(int conv, const Chain& ch, std::int64_t h, std::uint8_t tk, int looked, const PrefixHit& seen,
                   const std::string& seen_what) {
        std::vector<std::int32_t> ids(static_cast<std::size_t>(h) + 1);
        for (std::int64_t p = 0; p < h; ++p) ids[static_cast<std::size_t>(p)] = tok_of(conv, p);
        const bool none = tk % 16 == 15, negative = !none && h && tk % 8 == 7;
        if (negative) ids[(tk >> 4) % static_cast<std::size_t>(h)] = -1;
        const std::int32_t* tp = none ? nullptr : ids.data();
        const std::int64_t q = tk % N_CONV;
        sync_cstore();
        const auto c_before = c_image(cst, q);
        const auto cpp_before = cpp_snapshot(q);
        const std::string sb = state_image(chit);
        std::string what;
        PrefixHit got;
        std::vector<SlotMove> moves;
        const int out = outcome_of([&] { got = chit.start_from_prefix(q, store, ch.view(), h, &moves, nullptr, tp); }, &what);
        dspark_prefix_hit_result res;
        std::memset(&res, 0x5a, sizeof res);
        const dspark_status s = dspark_prefix_hit_tokens(cst, q, cstore, reinterpret_cast<const std::uint8_t*>(ch.bytes.data()),
                                                         ch.offsets.data(), ch.n(), h, tp, &res);
        FUZZ_CHECK(outcome_of_status(s) == out && (s == DSPARK_OK ? std::string() : what) == dspark_last_error());
        if (none && h) FUZZ_CHECK(out == INVALID);
        if (negative) FUZZ_CHECK(out == INVALID);
        if (!none && !negative) {  // the ids change nothing else: the block hitter's outcome and hit
            FUZZ_CHECK(out == looked && (out == OK || what == seen_what));
        }
        if (out != OK) {
            FUZZ_CHECK(c_image(cst, q) == c_before && cpp_snapshot(q) == cpp_before && state_image(chit) == sb);
        } else {
#define DSPARK_SAME_FIELD(type, name) && got.name == seen.name && static_cast<std::int64_t>(res.name) == static_cast<std::int64_t>(got.name)
            FUZZ_CHECK(true DSPARK_PREFIX_HIT_FIELDS(DSPARK_SAME_FIELD));
#undef DSPARK_SAME_FIELD
            chit_conv[q] = conv;
            // The rows the hit brought back carry the prompt's ids.
            const std::size_t m = static_cast<std::size_t>(got.replay_from - got.first_row);
            std::vector<std::int32_t> back(m + 1, -7);
            FUZZ_CHECK(dspark_tokens(cst, q, got.first_row, got.replay_from, back.data()) == DSPARK_OK);
            for (std::size_t i = 0; i < m; ++i) FUZZ_CHECK(back[i] == tok_of(conv, got.first_row + static_cast<std::int64_t>(i)));
        }
        check_chain_twins();
        // A block stager through the C ABI: the plain form finds what the block hitter found;
        // the _tokens form (ids given) is refused, nothing changed.
        const auto b_before = c_image(cbst, 0);
        std::memset(&res, 0x5a, sizeof res);
        const dspark_status bs = dspark_prefix_hit_tokens(cbst, 0, cstore, reinterpret_cast<const std::uint8_t*>(ch.bytes.data()),
                                                          ch.offsets.data(), ch.n(), h, ids.data(), &res);
        FUZZ_CHECK(bs != DSPARK_OK && c_image(cbst, 0) == b_before);
        const dspark_status ps = dspark_prefix_hit(cbst, 0, cstore, reinterpret_cast<const std::uint8_t*>(ch.bytes.data()),
                                                   ch.offsets.data(), ch.n(), h, &res);
        FUZZ_CHECK(outcome_of_status(ps) == looked);
        if (ps == DSPARK_OK) {
#define DSPARK_SAME_FIELD(type, name) && static_cast<std::int64_t>(res.name) == static_cast<std::int64_t>(seen.name)
            FUZZ_CHECK(true DSPARK_PREFIX_HIT_FIELDS(DSPARK_SAME_FIELD));
#undef DSPARK_SAME_FIELD
        }
    }

    // Several chain hits in one call (dspark_prefix_hit_many_tokens against C++
    // start_from_prefix_many, ids flat in batch order; sequences may repeat, defects as
    // chain_hit's); with right ids, the block hitter's batch finds the same.
    void chain_hit_many(Reader& r) {
        const std::uint8_t shape = r.u8(), tk = r.u8();
        const std::size_t k = 1 + shape % 3;
        std::vector<std::int64_t> seqs(k), n_tokens(k);
        std::vector<int> convs(k);
        std::vector<Chain> chains(k);
        std::string keys;
        std::vector<std::size_t> key_offsets{0}, chain_offsets{0};
        std::vector<std::int32_t> ids;
        for (std::size_t i = 0; i < k; ++i) {
            seqs[i] = r.u8() % N_CONV;
            convs[i] = r.u8() % N_CONV;
            n_tokens[i] = r.u16() % (MAX_LEN + 1);
            chains[i] = chain_of(convs[i], 0, n_tokens[i], bt, (shape >> 4) % 8 == 7 ? 1 : 0);
            for (std::size_t j = 0; j < chains[i].n(); ++j) {
                keys += chains[i].key(j);
                key_offsets.push_back(keys.size());
            }
            chain_offsets.push_back(key_offsets.size() - 1);
            for (std::int64_t p = 0; p < n_tokens[i]; ++p) ids.push_back(tok_of(convs[i], p));
        }
        const std::size_t total = ids.size();
        ids.push_back(0);  // never empty
        const bool none = tk % 16 == 15, negative = !none && total && tk % 8 == 7;
        if (negative) ids[(tk >> 4) % total] = -3;
        const std::int32_t* tp = none ? nullptr : ids.data();
        std::vector<KeyChain> views(k);
        for (std::size_t i = 0; i < k; ++i) views[i] = chains[i].view();
        sync_cstore();
        std::vector<std::vector<std::uint8_t>> c_before, cpp_before;
        for (std::int64_t q = 0; q < N_CONV; ++q) {
            c_before.push_back(c_image(cst, q));
            cpp_before.push_back(cpp_snapshot(q));
        }
        const std::string sb = state_image(chit);
        std::vector<PrefixHit> hits, bhits;
        std::vector<SlotMove> moves;
        std::string what, bwhat;
        const int out = outcome_of([&] {
            chit.start_from_prefix_many(seqs.data(), k, store, views.data(), n_tokens.data(), hits, &moves, nullptr, tp);
        }, &what);
        std::vector<dspark_prefix_hit_result> res(k);
        const dspark_status s = dspark_prefix_hit_many_tokens(cst, seqs.data(), k, cstore,
                                                              reinterpret_cast<const std::uint8_t*>(keys.data()),
                                                              key_offsets.data(), chain_offsets.data(), n_tokens.data(),
                                                              tp, res.data());
        FUZZ_CHECK(outcome_of_status(s) == out && (s == DSPARK_OK ? std::string() : what) == dspark_last_error());
        if ((none && total) || negative) FUZZ_CHECK(out == INVALID);
        const int bout = attempt([&] {
            hitter.start_from_prefix_many(seqs.data(), k, store, views.data(), n_tokens.data(), bhits, &moves);
        }, &bwhat);
        if (!none && !negative) FUZZ_CHECK(out == bout && (out == OK || what == bwhat));
        if (out != OK) {
            for (std::int64_t q = 0; q < N_CONV; ++q)
                FUZZ_CHECK(c_image(cst, q) == c_before[static_cast<std::size_t>(q)] &&
                           cpp_snapshot(q) == cpp_before[static_cast<std::size_t>(q)]);
            FUZZ_CHECK(state_image(chit) == sb);
        } else {
            FUZZ_CHECK(hits.size() == k && bhits.size() == k);
            for (std::size_t i = 0; i < k; ++i) {
#define DSPARK_SAME_FIELD(type, name) && hits[i].name == bhits[i].name && static_cast<std::int64_t>(res[i].name) == static_cast<std::int64_t>(hits[i].name)
                FUZZ_CHECK(true DSPARK_PREFIX_HIT_FIELDS(DSPARK_SAME_FIELD));
#undef DSPARK_SAME_FIELD
                chit_conv[seqs[i]] = convs[i];
            }
        }
        check_chain_twins();
    }

    std::int64_t end(std::int64_t q) const { return st.state(q).end; }

    void feed(Stager& s, std::int64_t q, int conv, std::int64_t lo, std::int64_t hi) {
        if (hi <= lo) return;
        std::vector<std::int64_t> pos(static_cast<std::size_t>(hi - lo));
        for (std::int64_t i = lo; i < hi; ++i) pos[static_cast<std::size_t>(i - lo)] = i;
        const auto rows = rows_of(conv, lo, hi);
        s.process(q, pos.data(), pos.size(), rows.data(), ElemType::F32);
    }

    // A call that may be rejected: rejected, it changes nothing.
    template <class Fn>
    int attempt(Fn&& fn, std::string* what = nullptr) {
        const std::string before = store_image(store), sb = state_image(st), hb = state_image(hitter);
        const int out = outcome_of(fn, what);
        if (out != OK) {
            FUZZ_CHECK(store_image(store) == before);
            FUZZ_CHECK(state_image(st) == sb);
            FUZZ_CHECK(state_image(hitter) == hb);
        }
        return out;
    }

    void publish(Reader& r) {
        const int q = r.u8() % N_CONV;
        const std::uint8_t how = r.u8();
        const std::int64_t e = end(q);
        std::int64_t lo = (r.u8() % (e / bt + 2)) * bt + ((how & 1) ? 1 : 0);  // odd: not a block boundary
        std::int64_t hi = (how & 2) ? e : std::min(e, lo + bt * (1 + r.u8() % 6));
        if (how & 4) hi += 1 + r.u8() % 3;  // past the rows processed
        // Bent chains 1-3 (another conversation's keys over these rows would make the
        // store's rows disagree with the keys' conversation, which hits compare with).
        const Chain ch = chain_of(q, lo, hi, bt, (how >> 3) % 4);
        attempt([&] { st.publish_prefix(q, store, ch.view(), lo, hi); });
    }

    void publish_rows(Reader& r) {
        const int conv = r.u8() % N_CONV;
        const std::uint8_t how = r.u8();
        const std::int64_t lo = (r.u8() % (MAX_LEN / bt + 1)) * bt;
        const std::int64_t hi = std::min<std::int64_t>(MAX_LEN, lo + bt * (1 + r.u8() % 4) - (how & 1));
        if (hi <= lo) return;
        const Chain ch = chain_of(conv, lo, hi, bt, 0);
        bool all_held = true;
        for (std::size_t i = 0; i < ch.n(); ++i) all_held = all_held && store.contains(ch.key(i));
        const bool other_rows = (how & 2) && all_held;
        const auto rows = rows_of(conv, lo, hi, other_rows ? 0.5f : 1.0f);
        const int out = attempt(
            [&] { store.publish_rows(ch.view(), lo, hi, rows.data(), ElemType::F32, rows.size() * sizeof(float)); });
        if (other_rows) FUZZ_CHECK(out == INVALID);  // a block published twice must carry the same rows
    }

    void hit(Reader& r) {
        const int conv = r.u8() % N_CONV;
        const std::uint8_t how = r.u8();
        const std::int64_t h = r.u16() % (MAX_LEN + 1);
        const std::int64_t extra = r.u8() % 12;
        const int bend = (how & 7) < 5 ? how & 7 : 0;
        const Chain ch = chain_of(conv, 0, h, bt, bend);
        PrefixHit seen, got;
        std::string seen_what, got_what;
        const int looked = outcome_of([&] { seen = store.lookup(ch.view(), h); }, &seen_what);
        const std::string before = store_image(store);
        if (looked != OK) FUZZ_CHECK(store_image(store) == before);
        std::vector<SlotMove> moves;
        const int out = attempt([&] { got = hitter.start_from_prefix(0, store, ch.view(), h, &moves); }, &got_what);
        FUZZ_CHECK(out == looked && got_what == seen_what);
        // A block stager refuses the prompt's ids, changing nothing (attempt checks).
        if (how >> 3 == 30) {
            std::vector<std::int32_t> ids(static_cast<std::size_t>(h) + 1, 1);
            PrefixHit ignored;
            std::vector<SlotMove> none;
            FUZZ_CHECK(attempt([&] { ignored = hitter.start_from_prefix(0, store, ch.view(), h, &none, nullptr, ids.data()); }) ==
                       (out == STATE ? STATE : INVALID));
        }
        chain_hit(conv, ch, h, static_cast<std::uint8_t>(how >> 3), looked, seen, seen_what);
        if (out != OK) return;
        FUZZ_CHECK(moves.empty());  // held rows: the core copies them itself
#define DSPARK_SAME_FIELD(type, name) && got.name == seen.name
        FUZZ_CHECK(true DSPARK_PREFIX_HIT_FIELDS(DSPARK_SAME_FIELD));
#undef DSPARK_SAME_FIELD
        const std::int64_t K = store.w_keep();
        FUZZ_CHECK(got.n_tokens == h && got.replay_from <= h && got.replay_from >= std::max<std::int64_t>(0, h - K));
        FUZZ_CHECK(got.rows == got.replay_from - got.first_row && got.rows >= 0 && got.first_row >= got.need_first);
        FUZZ_CHECK(!got.exact || got.origin == 0);
        FUZZ_CHECK(hitter.state(0).end == got.replay_from);
        if (bend != 0) return;  // the rows found belong to other keys' blocks: nothing to compare
        // The new request: the replayed positions, then `extra` more.
        const std::int64_t n = h + extra;
        feed(hitter, 0, conv, got.replay_from, n);
        full.begin(0);
        feed(full, 0, conv, 0, n);
        if (n == 0 || !got.exact) return;
        ByteVec a, b;
        RoundPlan pa, pb;
        const int fa = outcome_of([&] { pa = full.draft(0, n, a); });
        FUZZ_CHECK(outcome_of([&] { pb = hitter.draft(0, n, b); }) == fa);
        if (fa != OK) return;
        FUZZ_CHECK(pa.skip == pb.skip && pa.rebase == pb.rebase && pa.clear_cache == pb.clear_cache &&
                   pa.start == pb.start && pa.pos_base == pb.pos_base && pa.first_row == pb.first_row &&
                   pa.n_rows == pb.n_rows && pa.crop_from == pb.crop_from);
        FUZZ_CHECK(a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0));
        full.commit(0);
        hitter.commit(0);
    }

    void evict(Reader& r) {
        const int conv = r.u8() % N_CONV;
        const std::int64_t lo = (r.u8() % (MAX_LEN / bt + 1)) * bt;
        const std::int64_t hi = std::min<std::int64_t>(MAX_LEN, lo + bt * (1 + r.u8() % 4));
        if (hi <= lo) return;
        const Chain ch = chain_of(conv, lo, hi, bt, 0);
        std::int64_t held = 0;
        for (std::size_t i = 0; i < ch.n(); ++i) held += store.contains(ch.key(i));
        const std::int64_t before = store.stats().evicted_by_key;
        FUZZ_CHECK(store.evict(ch.view()) == held);
        FUZZ_CHECK(store.stats().evicted_by_key == before + held);
        for (std::size_t i = 0; i < ch.n(); ++i) FUZZ_CHECK(!store.contains(ch.key(i)));
    }

    void export_import(Reader& r) {
        const std::vector<std::string> keys = store.keys();
        if (keys.empty()) return;
        const std::string key = keys[r.u8() % keys.size()];
        std::vector<std::uint8_t> data = export_of(store, key);
        if (r.u8() & 1) {
            // A whole block moves: another store of the configuration takes it as it is
            // (after dropping what a damaged import may have left under the key).
            Chain one;
            one.add(key);
            other.evict(one.view());
            FUZZ_CHECK(outcome_of([&] { other.import_block(data.data(), data.size()); }) == OK);
            FUZZ_CHECK(export_of(other, key) == data);
        } else {
            damage(r, data);
            import_checked(other, data);
        }
        check_store(other);
    }
};

void fuzz_ops(Reader& r, const Config& cfg) {
    Harness h(cfg);
    for (int q = 0; q < N_CONV; ++q) h.st.begin(q);
    for (int op = 0; op < MAX_OPS && r.more(); ++op) {
        switch (r.u8() % 8) {
            case 0: {  // the conversation goes on
                const int q = r.u8() % N_CONV;
                const std::int64_t e = h.end(q), n = std::min<std::int64_t>(MAX_LEN - e, 1 + r.u8() % 48);
                h.feed(h.st, q, q, e, e + n);
                break;
            }
            case 1: h.publish(r); break;
            case 2: h.publish_rows(r); break;
            case 3: h.hit(r); break;
            case 4: h.evict(r); break;
            case 5: h.export_import(r); break;
            case 6: {  // a conversation starts over (its keys and rows stay the same)
                const int q = r.u8() % N_CONV;
                h.st.begin(q);
                break;
            }
            default: {
                const std::uint8_t b = r.u8();
                if (b % 8 == 0) h.store.clear();
                else if (b % 8 >= 5) h.chain_hit_many(r);
                break;
            }
        }
        check_store(h.store);
    }
}

void fuzz_import(Reader& r, const Config& cfg, bool raw) {
    PrefixStoreOptions into = cfg.po;
    if (!raw && (r.u8() % 4 == 0)) into.block_tokens = into.block_tokens % 24 + 1;  // maybe another block_tokens
    std::unique_ptr<PrefixStore> target;
    try {
        target = std::make_unique<PrefixStore>(into);
    } catch (const std::invalid_argument&) {
        return;  // a budget below one block of the other block_tokens
    }
    if (raw) {
        const std::vector<std::uint8_t> data = r.rest();
        import_checked(*target, data);
        return;
    }
    PrefixStore source(cfg.po);
    const std::int64_t bt = cfg.po.block_tokens;
    const std::int64_t start = (r.u8() % 8) * bt, end = start + 1 + r.u8() % bt;
    Chain ch;
    ch.add(key_of(0, start, end));
    const auto rows = rows_of(r.u8() % N_CONV, start, end);
    source.publish_rows(ch.view(), start, end, rows.data(), ElemType::F32, rows.size() * sizeof(float));
    std::vector<std::uint8_t> data = export_of(source, ch.key(0));
    if (into.block_tokens == bt) {
        PrefixStore copy(cfg.po);
        import_checked(copy, data);
        FUZZ_CHECK(copy.contains(ch.key(0)));  // undamaged, it is taken
    }
    damage(r, data);
    import_checked(*target, data);
    import_checked(*target, data);  // again: refreshed, or refused again
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    Reader r(data, size);
    const int mode = r.u8() % 3;
    Config cfg;
    if (!config_of(r, cfg)) return 0;
    if (mode == 0) fuzz_ops(r, cfg);
    else fuzz_import(r, cfg, mode == 2);
    return 0;
}
