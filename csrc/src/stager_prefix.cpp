// The Stager side of the prefix store (dspark/prefix_store.hpp): publishing a
// sequence's final rows from its ring, and starting a sequence from a hit.
// Lock order: the sequence's lock, then the store's. Moves of external rows
// take their serial from the Stager's one counter of table changes, under
// both locks, like fork / shift / restore (docs/external_rows.md).
#include <algorithm>
#include <cstring>
#include <string>

#include "dspark/errors.hpp"
#include "dspark/prefix_store.hpp"
#include "dspark/stager.hpp"

namespace dspark {

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

// After the sequence's own checks (ready()), under the store's mutex, in
// order: the store's configuration (ConfigError), the publish itself (the
// store's plan_publish: positions, keys, the chain against them), the
// sequence's rows (it holds rows, [start, end) are final, the rows new blocks
// keep are still held), then the contents: a block already held must carry
// the rows the ring still holds. No side effects.
std::vector<PrefixPlannedBlock> Stager::check_publish_prefix(std::int64_t seq, const Seq& s, const PrefixStore& store,
                                                             const KeyChain& keys, std::int64_t start,
                                                             std::int64_t end) const {
    store.check_compatible(opt_);
    std::vector<PrefixPlannedBlock> plan = store.plan_publish(keys, start, end);
    const std::string who = "sequence " + std::to_string(seq);
    if (!s.started) throw std::invalid_argument(who + " holds no rows (nothing was processed since begin())");
    // Rows an accept() may still drop are not final (the first one is).
    const std::int64_t final_end = firm_end(s);
    if (end > final_end)
        throw std::invalid_argument(who + ": positions " + range(start, end) + " reach past its final rows (" +
                                    range(s.horizon, final_end) + (final_end < s.end ? "; call accept() first" : "") +
                                    ")");
    for (const auto& pb : plan)
        if (!pb.existing && pb.kept.first < s.horizon)
            throw std::invalid_argument(
                who + ": rows " + range(pb.kept.first, std::min(s.horizon, pb.kept.first + pb.kept.count)) +
                " of the block at " + range(pb.start, pb.end) + " are no longer held (its oldest row is " +
                std::to_string(s.horizon) +
                "): publish each block when the server hands it over, before later rows push it out of the "
                "window, or pass its rows to publish_rows (external rows: the store table's publish_rows)");
    // A block published again after its rows left the window is refreshed on
    // its key and positions alone: only the rows the ring still holds compare.
    store.check_same_rows(plan, [&](const PrefixStore::Piece& pc, const std::uint8_t* held) {
        const std::int64_t lo = std::max(pc.pos, s.horizon), hi = pc.pos + pc.count;
        if (lo >= hi) return true;
        const std::uint8_t* want = held + static_cast<std::size_t>(lo - pc.pos) * row_bytes_;
        bool same = true;
        s.buf.for_each_run(lo, hi, [&](const std::uint8_t* run, std::size_t bytes) {
            same = same && std::memcmp(run, want, bytes) == 0;
            want += bytes;
        });
        return same;
    }, who + ": ");
    return plan;
}

std::vector<SlotMove> Stager::publish_prefix(std::int64_t seq, PrefixStore& store, const KeyChain& keys,
                                             std::int64_t start, std::int64_t end, std::uint64_t* serial) {
    auto lock = lock_seq(seq);
    const Seq& s = ready(seq);
    if (serial) *serial = 0;
    std::lock_guard<std::mutex> store_lock(store.mu_);
    const std::vector<PrefixPlannedBlock> plan = check_publish_prefix(seq, s, store, keys, start, end);
    const std::int64_t new_pages = store.new_pages(plan);
    const std::int64_t base = slot_base(seq);
    const std::int64_t pr = store.page_rows();
    std::vector<SlotMove> moves;
    // A piece per page, two ring runs per piece at most: recording them
    // cannot allocate once the store changed.
    if (external()) moves.reserve(static_cast<std::size_t>(2 * new_pages));
    store.reserve_pages(new_pages);
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
    });
    if (!moves.empty()) {
        const std::uint64_t n = next_serial("publish_prefix", seq);  // under the sequence's lock, with fork / shift / restore
        if (serial) *serial = n;
    }
    return moves;
}

PrefixHit Stager::start_from_prefix(std::int64_t seq, PrefixStore& store, const KeyChain& keys, std::int64_t n_tokens,
                                    std::vector<SlotMove>* moves, std::uint64_t* serial) {
    auto lock = lock_seq(seq);
    Seq& target = mut(ready(seq));
    if (serial) *serial = 0;
    // The checks after the sequence's: the store, where the moves go, the hit
    // (the store's plan_hit: n_tokens, the keys, the chain against the
    // positions). No side effects.
    store.check_compatible(opt_);
    if (external() && !moves) throw std::invalid_argument("an external-row hit needs somewhere to put its moves");
    std::lock_guard<std::mutex> store_lock(store.mu_);
    const PrefixStore::HitPlan plan = store.plan_hit(keys, n_tokens);
    const PrefixHit& hit = plan.hit;
    std::vector<SlotMove> out;
    if (external()) out.reserve(plan.pieces.size());
    if (hit.replay_from == 0) {
        // Nothing before the prefill's first position: a plain begin().
        fresh_seq(target);
    } else {
        // Build the new state completely, then swap it in (as restore does).
        // A new request on the slot, as begin(): its mismatch report and
        // round start afresh.
        Seq s;
        s.started = true;
        s.end = hit.replay_from;
        s.horizon = hit.first_row;
        s.n_cache = s.pos_base = hit.origin;
        s.restage_owed = plan.owed;  // origin below the first row held: the first round restages
        s.first_round = true;
        const auto n = static_cast<std::size_t>(hit.rows);
        s.buf = ring_for(target.buf, hit.first_row, n);  // may throw: nothing changed yet
        if (n) {
            // A reset ring appends from index 0: position p goes to ring index p - first_row.
            FeatureBuffer::Span x, y;
            s.buf.back_spans(n, x, y);
            const std::int64_t base = slot_base(seq);
            for (const PrefixStore::Piece& pc : plan.pieces) {
                const std::int64_t at = pc.pos - hit.first_row;
                if (external())
                    add_move(out, pc.page * store.page_rows() + pc.off, base + static_cast<std::int64_t>(x.slot) + at,
                             pc.count);
                else
                    std::memcpy(x.data + static_cast<std::size_t>(at) * row_bytes_,
                                store.page_data(pc.page) + static_cast<std::size_t>(pc.off) * row_bytes_,
                                static_cast<std::size_t>(pc.count) * row_bytes_);
            }
            s.buf.commit_back(n);
        }
        target = std::move(s);
        advance_horizon(target);
    }
    for (PrefixStore::Block* b : plan.used) store.touch(*b);
    if (n_tokens > 0) {
        store.stats_.hits += 1;
        store.stats_.hit_rows += hit.rows;
        store.stats_.replayed_tokens += n_tokens - hit.replay_from;
        if (hit.exact && hit.replay_from == n_tokens) store.stats_.full_hits += 1;
    }
    if (!out.empty()) {
        const std::uint64_t n = next_serial("start_from_prefix", seq);  // under the sequence's lock, with fork / shift / restore
        if (serial) *serial = n;
    }
    if (moves) moves->swap(out);
    return hit;
}

}  // namespace dspark
