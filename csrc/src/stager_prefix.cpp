// The Stager side of the prefix store (dspark/prefix_store.hpp): publishing a
// sequence's final rows from its ring, and starting a sequence from a hit.
// Lock order: the sequence's lock, then the store's. Moves of external rows
// take their serial from the Stager's one counter of table changes, under
// both locks, like fork / shift / restore (docs/external_rows.md).
#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "dspark/errors.hpp"
#include "dspark/prefix_store.hpp"
#include "dspark/stager.hpp"
#include "stager_batch.hpp"

namespace dspark {

using detail::copy_of;
using detail::in_batch;

namespace {

std::string range(std::int64_t a, std::int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + ")"; }

// Appends a copy, merged into the previous one when both sides continue it.
void add_move(std::vector<SlotMove>& moves, std::int64_t src, std::int64_t dst, std::int64_t count) {
    if (count <= 0) return;
    if (!moves.empty()) {
        SlotMove& last = moves.back();
        if (last.src + last.count == src && last.dst + last.count == dst) {
            last.count += count;
            return;
        }
    }
    moves.push_back({src, dst, count});
}

}  // namespace

// A block new to the store that an entry of a publish batch adds, under its
// key: what a later entry of the same key finds held when it runs (the
// first entry's positions and rows; its ring holds every kept row).
struct PrefixBatchBlock {
    std::size_t entry;
    const FeatureBuffer* rows;
    std::int64_t start, end;
};
struct PrefixBatchBlocks {
    std::unordered_map<std::string_view, PrefixBatchBlock> by_key;  // the first entry of each key
};

// After the sequence's own checks (ready()), under the store's mutex, in
// order: the store's configuration (ConfigError), the publish itself (the
// store's plan_publish: positions, keys, the chain against them; a batch's
// earlier blocks as held ones), the sequence's rows (it holds rows, [start,
// end) are final, the rows new blocks keep are still held), then the
// contents, in chain order: a block already held must carry the rows the
// ring still holds. No side effects.
std::vector<PrefixPlannedBlock> Stager::check_publish_prefix(std::int64_t seq, const Seq& s, const PrefixStore& store,
                                                             const KeyChain& keys, std::int64_t start,
                                                             std::int64_t end, const PrefixBatchBlocks* batch) const {
    store.check_compatible(opt_);
    std::vector<PrefixPlannedBlock> plan = store.plan_publish(keys, start, end);
    // The batch's blocks this entry finds held by the time it runs.
    std::vector<const PrefixBatchBlock*> earlier(plan.size(), nullptr);
    if (batch)
        for (std::size_t j = 0; j < plan.size(); ++j) {
            const PrefixPlannedBlock& pb = plan[j];
            const auto it = pb.existing ? batch->by_key.end() : batch->by_key.find(pb.key);
            if (it == batch->by_key.end()) continue;
            PrefixStore::check_same_positions(pb.key, it->second.start, it->second.end, pb.start, pb.end);
            earlier[j] = &it->second;
        }
    const std::string who = detail::seq_msg(seq);
    if (!s.started) throw std::invalid_argument(who + " holds no rows (nothing was processed since begin())");
    // Rows an accept() may still drop are not final (the first one is).
    const std::int64_t final_end = firm_end(s);
    if (end > final_end)
        throw std::invalid_argument(who + ": positions " + range(start, end) + " reach past its final rows (" +
                                    range(s.horizon, final_end) + (final_end < s.end ? "; call accept() first" : "") +
                                    ")");
    for (std::size_t j = 0; j < plan.size(); ++j) {
        const PrefixPlannedBlock& pb = plan[j];
        if (!pb.existing && !earlier[j] && pb.kept.first < s.horizon)
            throw std::invalid_argument(
                who + ": rows " + range(pb.kept.first, std::min(s.horizon, pb.kept.first + pb.kept.count)) +
                " of the block at " + range(pb.start, pb.end) + " are no longer held (its oldest row is " +
                std::to_string(s.horizon) +
                "): publish each block when the server hands it over, before later rows push it out of the "
                "window, or pass its rows to publish_rows (external rows: the store table's publish_rows)");
    }
    if (store.external()) return plan;  // the owner's rows: not visible here
    // A block published again after its rows left the window is refreshed on
    // its key and positions alone: only the rows the ring still holds compare.
    const auto ring_equals = [&](std::int64_t lo, std::int64_t hi, const std::uint8_t* want) {
        bool same = true;
        s.buf.for_each_run(lo, hi, [&](const std::uint8_t* run, std::size_t bytes) {
            same = same && std::memcmp(run, want, bytes) == 0;
            want += bytes;
        });
        return same;
    };
    ByteVec theirs;
    for (std::size_t j = 0; j < plan.size(); ++j) {
        const PrefixPlannedBlock& pb = plan[j];
        bool same = true;
        if (pb.existing) {
            same = store.same_rows(*pb.existing, [&](const PrefixStore::Piece& pc, const std::uint8_t* held) {
                const std::int64_t lo = std::max(pc.pos, s.horizon), hi = pc.pos + pc.count;
                return lo >= hi || ring_equals(lo, hi, held + static_cast<std::size_t>(lo - pc.pos) * row_bytes_);
            });
        } else if (earlier[j]) {
            const std::int64_t lo = std::max(pb.kept.first, s.horizon), hi = pb.end;
            if (lo < hi) {
                theirs.resize(static_cast<std::size_t>(hi - lo) * row_bytes_);
                earlier[j]->rows->copy_out(lo, hi, theirs.data());
                same = ring_equals(lo, hi, theirs.data());
            }
        }
        if (!same) PrefixStore::refuse_other_rows(pb, who + ": ");
    }
    return plan;
}

// The changes a prefix store makes to a sequence, shared by the calls and
// their batches (each checks first, then calls these).
struct Stager::PrefixOps {
    // A checked publish's rows into the store: held mode copies them from
    // the ring into its pages; external mode records the copies (this
    // Stager's table -> the store's) in `moves`. `keep`: blocks no eviction
    // takes (a batch's). What can fail is the store index's own small
    // allocations (std::bad_alloc).
    static void publish(const Stager& st, std::int64_t seq, const Seq& s, PrefixStore& store,
                        const std::vector<PrefixPlannedBlock>& plan, std::vector<SlotMove>& moves,
                        const PrefixStore::Keep* keep) {
        const std::int64_t base = st.slot_base(seq);
        const std::int64_t pr = store.page_rows();
        store.commit_publish(plan, [&](const PrefixStore::Piece& pc, std::uint8_t* dst) {
            if (dst) {
                s.buf.copy_out(pc.pos, pc.pos + pc.count, dst);
                return;
            }
            SlotRun runs[2];
            s.buf.runs(pc.pos, pc.pos + pc.count, base, runs);
            std::int64_t to = pc.page * pr + pc.off;
            for (const SlotRun& r : runs) {
                add_move(moves, r.first, to, r.count);
                to += r.count;
            }
        }, keep);
    }

    // A hit, planned, with the ring it needs taken already.
    struct Hit {
        PrefixStore::HitPlan plan;
        std::int64_t n_tokens = 0;
        FeatureBuffer fresh;  // a new ring, when the sequence's own has no room (else empty)
        const std::int32_t* tokens = nullptr;  // a chain drafter's: the ids of [0, n_tokens)
    };

    // The hit's checks (the store's plan_hit) and its allocation: may throw,
    // nothing has changed.
    static Hit plan_hit(const Stager& st, const Seq& target, PrefixStore& store, const KeyChain& keys,
                        std::int64_t n_tokens) {
        Hit h{store.plan_hit(keys, n_tokens), n_tokens, FeatureBuffer(), nullptr};
        const auto n = static_cast<std::size_t>(h.plan.hit.rows);
        if (h.plan.hit.replay_from != 0 && (target.buf.capacity() == 0 || target.buf.capacity() < n)) {
            h.fresh = st.new_ring();
            h.fresh.reserve_back(n, st.ring_rows_);
        }
        return h;
    }

    // Starts `target` from a planned hit (as ring_for + a restore would):
    // cannot fail (external moves: `out` has room for every piece).
    static void apply_hit(Stager& st, std::int64_t seq, Seq& target, PrefixStore& store, Hit& h,
                          std::vector<SlotMove>& out) {
        const PrefixHit& hit = h.plan.hit;
        if (hit.replay_from == 0) {
            // Nothing before the prefill's first position: a plain begin().
            st.fresh_seq(target);
        } else {
            // Build the new state completely, then swap it in (as restore
            // does). A new request on the slot, as begin(): its mismatch
            // report and round start afresh.
            Seq s;
            s.started = true;
            s.end = hit.replay_from;
            s.horizon = hit.first_row;
            s.n_cache = s.pos_base = hit.origin;
            s.restage_owed = h.plan.owed;  // origin below the first row held: the first round restages
            s.first_round = true;
            const auto n = static_cast<std::size_t>(hit.rows);
            s.buf = h.fresh.capacity() ? std::move(h.fresh) : std::move(target.buf);
            s.buf.reset(hit.first_row);
            if (n) {
                // A reset ring appends from index 0: position p goes to ring index p - first_row.
                FeatureBuffer::Span x, y;
                s.buf.back_spans(n, x, y);
                const std::int64_t base = st.slot_base(seq);
                for (const PrefixStore::Piece& pc : h.plan.pieces) {
                    const std::int64_t at = pc.pos - hit.first_row;
                    if (st.external())
                        add_move(out, pc.page * store.page_rows() + pc.off,
                                 base + static_cast<std::int64_t>(x.slot) + at, pc.count);
                    else
                        std::memcpy(x.data + static_cast<std::size_t>(at) * st.row_bytes_,
                                    store.page_data(pc.page) + static_cast<std::size_t>(pc.off) * st.row_bytes_,
                                    static_cast<std::size_t>(pc.count) * st.row_bytes_);
                }
                s.buf.commit_back(n);
                if (h.tokens) s.buf.set_tokens(hit.first_row, h.tokens + hit.first_row, n);
            }
            st.retire_stats(target);  // the new request's counters start afresh
            target = std::move(s);
            st.advance_horizon(target);
        }
        for (PrefixStore::Block* b : h.plan.used) store.touch(*b);
        if (h.n_tokens > 0) {
            store.stats_.hits += 1;
            store.stats_.hit_rows += hit.rows;
            store.stats_.replayed_tokens += h.n_tokens - hit.replay_from;
            if (hit.exact && hit.replay_from == h.n_tokens) store.stats_.full_hits += 1;
        }
    }
};

std::pair<std::int64_t, std::int64_t> Stager::publishable(std::int64_t seq) const {
    auto lock = lock_seq(seq);
    const Seq& s = ready(seq);
    if (!s.started) return {0, 0};
    // check_publish_prefix's bounds: final rows end at firm_end, held ones start at the horizon.
    return {s.horizon, firm_end(s)};
}

std::vector<SlotMove> Stager::publish_prefix(std::int64_t seq, PrefixStore& store, const KeyChain& keys,
                                             std::int64_t start, std::int64_t end, std::uint64_t* serial) {
    auto lock = lock_seq(seq);
    const Seq& s = ready(seq);
    if (serial) *serial = 0;
    std::lock_guard<std::mutex> store_lock(store.mu_);
    const std::vector<PrefixPlannedBlock> plan = check_publish_prefix(seq, s, store, keys, start, end);
    const std::int64_t new_pages = store.new_pages(plan);
    std::vector<SlotMove> moves;
    // A piece per page, two ring runs per piece at most: recording them
    // cannot allocate once the store changed.
    if (external()) moves.reserve(static_cast<std::size_t>(2 * new_pages));
    store.reserve_pages(new_pages);
    PrefixOps::publish(*this, seq, s, store, plan, moves, nullptr);
    if (!moves.empty()) {
        const std::uint64_t k = next_serial("publish_prefix", seq);  // under the sequence's lock, with fork / shift / restore
        if (serial) *serial = k;
    }
    return moves;
}

std::vector<SlotMove> Stager::publish_prefix_many(const std::int64_t* seqs_in, std::size_t n, PrefixStore& store,
                                                  const KeyChain* keys, const std::int64_t* starts_in,
                                                  const std::int64_t* ends_in, std::uint64_t* serial) {
    const char* call = "publish_many";
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Ready);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    const std::vector<std::int64_t> starts = copy_of(starts_in, n), ends = copy_of(ends_in, n);
    if (serial) *serial = 0;
    std::lock_guard<std::mutex> store_lock(store.mu_);
    // Every entry against the store as the call found it, and the blocks new
    // to it that earlier entries add: a later entry of such a key refreshes
    // the block, as in a loop.
    std::vector<std::vector<PrefixPlannedBlock>> plans(n);
    PrefixBatchBlocks added;
    for (std::size_t i = 0; i < n; ++i) {
        const Seq& s = get(seqs[i]);
        plans[i] = in_batch(call, i, seqs[i], [&] {
            return check_publish_prefix(seqs[i], s, store, keys[i], starts[i], ends[i], &added);
        });
        for (const PrefixPlannedBlock& pb : plans[i])
            if (!pb.existing) added.by_key.emplace(pb.key, PrefixBatchBlock{i, &s.buf, pb.start, pb.end});
    }
    // Blocks an entry refreshes from rows it no longer holds (held ones, or
    // ones an earlier entry adds): kept from evictions until that entry has
    // run (a loop would fail there).
    PrefixStore::Keep keep;
    std::vector<std::vector<std::string_view>> fragile(n);
    std::int64_t upper = 0, kept_pages = 0, largest = 0;
    for (std::size_t i = 0; i < n; ++i)
        for (const PrefixPlannedBlock& pb : plans[i]) {
            const std::int64_t pages = store.pages_for(pb.kept.count);
            upper += pages;
            largest = std::max(largest, pages);
            const bool held_then = pb.existing || added.by_key.at(pb.key).entry != i;
            if (held_then && pb.kept.first < get(seqs[i]).horizon) {
                fragile[i].push_back(pb.key);
                if (keep[pb.key]++ == 0)
                    kept_pages += pb.existing ? static_cast<std::int64_t>(pb.existing->pages.size()) : pages;
            }
        }
    if (store.n_pages_ - kept_pages < largest)
        throw std::invalid_argument(std::string(call) + ": the batch refreshes blocks of " + std::to_string(kept_pages) +
                                    " pages from rows its sequences no longer hold, and a new block needs " +
                                    std::to_string(largest) + " of the store's " + std::to_string(store.n_pages_) +
                                    " pages beside them: publish fewer blocks at once (nothing changed)");
    std::vector<SlotMove> moves;
    if (external()) moves.reserve(static_cast<std::size_t>(2 * upper));
    store.reserve_pages(upper);  // may throw std::bad_alloc: nothing changed yet
    for (std::size_t i = 0; i < n; ++i) {
        for (const std::string_view k : fragile[i])  // refreshed now: as a loop would, from here on
            if (--keep[k] == 0) keep.erase(k);
        // Planned again: an earlier entry may have added a block this one
        // refreshes, or evicted one it found held (it then publishes it anew,
        // from rows it still holds).
        const std::vector<PrefixPlannedBlock> plan =
            i == 0 ? std::move(plans[0]) : store.plan_publish(keys[i], starts[i], ends[i]);
        PrefixOps::publish(*this, seqs[i], get(seqs[i]), store, plan, moves, keep.empty() ? nullptr : &keep);
    }
    if (!moves.empty()) {
        const std::uint64_t k = next_serial("publish_prefix", seqs.data(), n);
        if (serial) *serial = k;
    }
    return moves;
}

PrefixHit Stager::start_from_prefix(std::int64_t seq, PrefixStore& store, const KeyChain& keys, std::int64_t n_tokens,
                                    std::vector<SlotMove>* moves, std::uint64_t* serial, const std::int32_t* tokens) {
    auto lock = lock_seq(seq);
    Seq& target = mut(ready(seq));
    if (serial) *serial = 0;
    // The checks after the sequence's: the store, where the moves go, the hit
    // (the store's plan_hit: n_tokens, the keys, the chain against the
    // positions). No side effects.
    store.check_compatible(opt_);
    if (external() && !moves) throw std::invalid_argument("an external-row hit needs somewhere to put its moves");
    std::lock_guard<std::mutex> store_lock(store.mu_);
    PrefixOps::Hit h = PrefixOps::plan_hit(*this, target, store, keys, n_tokens);
    const TokenIds ids = check_tokens(nullptr, tokens, static_cast<std::size_t>(n_tokens));  // n_tokens >= 0: planned
    h.tokens = ids.data();
    std::vector<SlotMove> out;
    if (external()) out.reserve(h.plan.pieces.size());
    PrefixOps::apply_hit(*this, seq, target, store, h, out);
    if (!out.empty()) {
        const std::uint64_t k = next_serial("start_from_prefix", seq);  // under the sequence's lock, with fork / shift / restore
        if (serial) *serial = k;
    }
    if (moves) moves->swap(out);
    return h.plan.hit;
}

void Stager::start_from_prefix_many(const std::int64_t* seqs_in, std::size_t n, PrefixStore& store,
                                    const KeyChain* keys, const std::int64_t* n_tokens_in,
                                    std::vector<PrefixHit>& hits, std::vector<SlotMove>* moves,
                                    std::uint64_t* serial, const std::int32_t* tokens) {
    const char* call = "hit_many";
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Ready);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    const std::vector<std::int64_t> n_tokens = copy_of(n_tokens_in, n);
    if (serial) *serial = 0;
    store.check_compatible(opt_);
    if (external() && !moves) throw std::invalid_argument("an external-row hit needs somewhere to put its moves");
    std::lock_guard<std::mutex> store_lock(store.mu_);
    // Every hit planned and its ring taken before any changes. (Hits read
    // the store and change only its LRU order and counters: a plan holds
    // whatever the batch's earlier hits do.)
    std::vector<PrefixOps::Hit> work;
    work.reserve(n);
    std::size_t pieces = 0;
    for (std::size_t i = 0; i < n; ++i) {
        work.push_back(in_batch(call, i, seqs[i], [&] {
            return PrefixOps::plan_hit(*this, get(seqs[i]), store, keys[i], n_tokens[i]);
        }));
        pieces += work.back().plan.pieces.size();
    }
    // The ids, flat in batch order (every n_tokens checked by its hit's plan).
    std::size_t total = 0;
    for (std::size_t i = 0; i < n; ++i) total += static_cast<std::size_t>(n_tokens[i]);
    const TokenIds ids = check_tokens(call, tokens, total);
    for (std::size_t i = 0, at = 0; i < n; at += static_cast<std::size_t>(n_tokens[i++]))
        work[i].tokens = ids.given ? ids.ids.data() + at : nullptr;
    std::vector<SlotMove> out;
    if (external()) out.reserve(pieces);
    std::vector<PrefixHit> result;
    result.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
        PrefixOps::apply_hit(*this, seqs[i], mut(get(seqs[i])), store, work[i], out);
        result.push_back(work[i].plan.hit);
    }
    if (!out.empty()) {
        const std::uint64_t k = next_serial("start_from_prefix", seqs.data(), n);
        if (serial) *serial = k;
    }
    hits.swap(result);
    if (moves) moves->swap(out);
}

}  // namespace dspark
