// Tree verification (dspark/stager.hpp, docs/design.md 2.11): a verify batch
// whose rows are the nodes of a draft tree, and accept_path, which keeps one
// root-to-node path at consecutive positions.
//
// The tree's rows are the round's tentative rows, one ring slot per node in
// node order (slot of position root + i for node i), so every bound of a
// linear verify batch holds as it is: at most B + 1 tentative rows, the
// firm end root + 1 (the horizon never passes the root), the ring's tail
// room. accept_path moves the path's rows down onto the first slots and
// drops the rest, which leaves the sequence exactly as a linear batch of
// the path's rows followed by accept(n - 1) would.
#include "dspark/stager.hpp"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "dspark/errors.hpp"
#include "stager_batch.hpp"

namespace dspark {

using detail::copy_of;
using detail::in_batch;
using detail::seq_msg;

namespace {

// Appends the copy of one row (global slots) to `moves`, merged into the
// last move when it continues it and the merged ranges still cannot
// overlap (a run no longer than the distance it moves down).
void add_move(std::vector<SlotMove>& moves, std::size_t first, std::int64_t src, std::int64_t dst) {
    if (moves.size() > first) {
        SlotMove& m = moves.back();
        if (m.src + m.count == src && m.dst + m.count == dst && m.count < src - dst) {
            m.count += 1;
            return;
        }
    }
    moves.push_back({src, dst, 1});
}

}  // namespace

std::vector<std::int64_t> Stager::check_tree(std::int64_t seq_id, const Seq& s, std::int64_t n_past,
                                             const std::int64_t* parents, std::size_t n) const {
    // The tree's rows must be the round's tentative rows, the root first.
    if (!s.started || !s.accept_open || s.tentative != 0)
        throw StateError(seq_msg(seq_id) +
                         " takes a tree verify batch only as the first rows after a round's draft (" +
                         (!s.started || !s.accept_open
                              ? std::string("its rows are final: no draft since (an accept closes a round), or a rollback, shift or more than "
                                            "block_size + 1 rows since")
                              : std::to_string(s.tentative) + " rows arrived since") +
                         ")");
    const std::int64_t cap = max_tree_nodes(opt_.block_size);
    if (n == 0 || static_cast<std::int64_t>(n) > cap)
        throw std::invalid_argument("a tree verify batch holds 1 to " + std::to_string(cap) +
                                    " nodes (the root and at most block_size drafts), got " + std::to_string(n));
    if (n_past != s.end)
        throw std::invalid_argument(seq_msg(seq_id) + ": the tree's root must stand at the sequence's end " +
                                    std::to_string(s.end) + " (n_past), got " + std::to_string(n_past));
    if (parents[0] != -1)
        throw std::invalid_argument("parents[0] must be -1 (node 0 is the root), got " + std::to_string(parents[0]));
    for (std::size_t i = 1; i < n; ++i)
        if (parents[i] < 0 || parents[i] >= static_cast<std::int64_t>(i))
            throw std::invalid_argument("parents[" + std::to_string(i) + "] = " + std::to_string(parents[i]) +
                                        ": a node's parent is an earlier node (0 <= parents[i] < i)");
    std::vector<std::int64_t> positions(n);
    for (std::size_t i = 0; i < n; ++i) positions[i] = n_past + static_cast<std::int64_t>(i);
    validate_positions(seq_id, s, positions.data(), n);  // the range rule of every row
    return positions;
}

void Stager::check_process_tree(std::int64_t seq, std::int64_t n_past, const std::int64_t* parents,
                                std::size_t n, const std::int32_t* tokens) const {
    auto lock = lock_seq(seq);
    (void)check_tree(seq, ready(seq), n_past, parents, n);
    (void)check_tokens(nullptr, tokens, n);
}

void Stager::process_tree(std::int64_t seq, std::int64_t n_past, const std::int64_t* parents, std::size_t n,
                          const void* rows, ElemType type, const std::int32_t* tokens) {
    auto lock = lock_seq(seq);
    Seq& s = mut(ready(seq));
    require_mode(RowMode::Held, "process_tree", "use process_tree_external: the rows stay with their owner");
    const std::vector<std::int64_t> positions = check_tree(seq, s, n_past, parents, n);
    const TokenIds ids = check_tokens(nullptr, tokens, n);
    std::vector<std::int64_t> tree(parents, parents + n);  // before any change: may throw
    append_held(seq, s, positions[0], n, rows, type, ids.data());
    s.tree = std::move(tree);
}

void Stager::process_tree_external(std::int64_t seq, std::int64_t n_past, const std::int64_t* parents,
                                   std::size_t n, std::int64_t* slots_out, const std::int32_t* tokens) {
    auto lock = lock_seq(seq);
    Seq& s = mut(ready(seq));
    require_mode(RowMode::External, "process_tree_external", "use process_tree: this Stager holds its rows");
    const std::vector<std::int64_t> positions = check_tree(seq, s, n_past, parents, n);
    std::vector<std::int64_t> tree(parents, parents + n);
    const std::int64_t cu[2] = {0, static_cast<std::int64_t>(n)};
    append_external(nullptr, &seq, 1, cu, positions.data(), n, slots_out, false, tokens);  // checks the tokens
    s.tree = std::move(tree);
}

std::vector<std::vector<std::int64_t>> Stager::check_tree_many(const char* call, const std::vector<std::int64_t>& seqs,
                                                               const std::vector<std::int64_t>& cu,
                                                               const std::int64_t* n_pasts, const std::int64_t* parents,
                                                               std::size_t total, std::vector<std::int64_t>& p0) const {
    const std::size_t n = seqs.size();
    check_offsets(call, cu.data(), n, total);
    std::vector<std::vector<std::int64_t>> trees(n);
    p0.assign(n, 0);
    for (std::size_t i = 0; i < n; ++i) {
        const std::int64_t* par = parents + cu[i];
        const std::size_t len = static_cast<std::size_t>(cu[i + 1] - cu[i]);
        p0[i] = in_batch(call, i, seqs[i], [&] { return check_tree(seqs[i], get(seqs[i]), n_pasts[i], par, len)[0]; });
        trees[i].assign(par, par + len);
    }
    return trees;
}

void Stager::tree_batch(const char* call, RowMode mode, const char* instead, const std::int64_t* seqs_in,
                        std::size_t n, const std::int64_t* offsets, const std::int64_t* n_pasts_in,
                        const std::int64_t* parents_in, std::size_t total, const std::int32_t* tokens,
                        const TreeAppend& append) {
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Ready);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    require_mode(mode, call, instead);
    const std::vector<std::int64_t> cu = copy_of(offsets, n + 1), n_pasts = copy_of(n_pasts_in, n),
                                    parents = copy_of(parents_in, total);
    std::vector<std::int64_t> p0;
    std::vector<std::vector<std::int64_t>> trees = check_tree_many(call, seqs, cu, n_pasts.data(), parents.data(), total, p0);
    const TokenIds ids = check_tokens(call, tokens, total);
    append(seqs, cu, p0, ids.data());
    for (std::size_t i = 0; i < n; ++i) mut(get(seqs[i])).tree = std::move(trees[i]);
}

void Stager::process_tree_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                               const std::int64_t* n_pasts, const std::int64_t* parents, std::size_t total,
                               const void* rows, ElemType type, const std::int32_t* tokens) {
    const char* call = "process_tree_many";
    tree_batch(call, RowMode::Held, "use process_tree_external_many: the rows stay with their owner", seqs, n, offsets,
               n_pasts, parents, total, tokens, [&](const auto& ids, const auto& cu, const auto& p0, const auto* t) {
                   append_held_many(call, ids, cu, p0, total, rows, type, t);
               });
}

void Stager::process_tree_external_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                                        const std::int64_t* n_pasts, const std::int64_t* parents, std::size_t total,
                                        std::int64_t* slots_out, const char* call, const std::int32_t* tokens) {
    tree_batch(call, RowMode::External, "use process_tree_many: this Stager holds its rows", seqs, n, offsets, n_pasts,
               parents, total, tokens, [&](const auto& ids, const auto& cu, const auto& p0, const auto* t) {
                   std::vector<std::int64_t> positions(total);  // each node's ring position: root + its index
                   for (std::size_t i = 0; i < ids.size(); ++i)
                       for (std::int64_t k = cu[i]; k < cu[i + 1]; ++k)
                           positions[static_cast<std::size_t>(k)] = p0[i] + (k - cu[i]);
                   append_external(call, ids.data(), ids.size(), cu.data(), positions.data(), total, slots_out, false,
                                   t);
               });
}

void Stager::check_path(const Seq& s, const std::int64_t* nodes, std::size_t n) const {
    const std::int64_t t = static_cast<std::int64_t>(s.tree.size());
    if (n == 0 || static_cast<std::int64_t>(n) > t)
        throw std::invalid_argument("a path of the tree holds 1 to " + std::to_string(t) +
                                    " nodes, got " + std::to_string(n));
    if (nodes[0] != 0)
        throw std::invalid_argument("nodes[0] must be 0 (a path starts at the root), got " + std::to_string(nodes[0]));
    for (std::size_t k = 1; k < n; ++k) {
        const std::int64_t v = nodes[k];
        const std::string at = "nodes[" + std::to_string(k) + "] = " + std::to_string(v);
        if (v < 0 || v >= t)
            throw std::invalid_argument(at + " is not a node of the tree (0 to " + std::to_string(t - 1) + ")");
        const std::int64_t parent = s.tree[static_cast<std::size_t>(v)];
        if (parent != nodes[k - 1])
            throw std::invalid_argument(at + " is not a child of nodes[" + std::to_string(k - 1) + "] = " +
                                        std::to_string(nodes[k - 1]) + " (its parent is node " +
                                        std::to_string(parent) + "): a path goes down from the root");
    }
}

void Stager::accept_path_seq(std::int64_t seq_id, Seq& s, const std::int64_t* nodes, std::size_t n,
                             std::vector<SlotMove>& moves) {
    const std::int64_t root = s.end - s.tentative, keep = static_cast<std::int64_t>(n);
    const std::size_t first = moves.size();
    // Row k of the path moves from the slot of node nodes[k] to the k-th
    // slot, in increasing k: nodes[j] >= j > k for every later j (a node's
    // depth is at most its index), so no copy overwrites a row still to be read.
    for (std::int64_t k = 1; k < keep; ++k) {
        const std::int64_t from = root + nodes[k], to = root + k;
        if (from == to) continue;
        s.buf.copy_row(from, to);
        add_move(moves, first, slot_base(seq_id) + static_cast<std::int64_t>(s.buf.slot(from)),
                 slot_base(seq_id) + static_cast<std::int64_t>(s.buf.slot(to)));
    }
    s.tree.clear();
    keep_tentative(s, keep);  // then as accept(keep - 1) after a linear batch
}

std::vector<SlotMove> Stager::accept_path(std::int64_t seq, const std::int64_t* nodes, std::size_t n,
                                          std::uint64_t* serial) {
    auto lock = lock_seq(seq);
    Seq& s = mut(needs(seq, Need::Tree));
    check_path(s, nodes, n);
    if (serial) *serial = 0;
    std::vector<SlotMove> moves;
    moves.reserve(n);  // every allocation before the first change
    accept_path_seq(seq, s, nodes, n, moves);
    if (!moves.empty()) {
        const std::uint64_t k = next_serial("accept_path", seq);  // under the sequence's lock
        if (serial) *serial = k;
    }
    return moves;
}

std::vector<SlotMove> Stager::accept_path_many(const std::int64_t* seqs_in, std::size_t n,
                                               const std::int64_t* offsets_in, const std::int64_t* nodes_in,
                                               std::size_t total, std::uint64_t* serial) {
    const char* call = "accept_path_many";
    const CheckedBatch batch(*this, call, seqs_in, n, Need::Tree);
    const std::vector<std::int64_t>& seqs = batch.seqs();
    const std::vector<std::int64_t> cu = copy_of(offsets_in, n + 1), nodes = copy_of(nodes_in, total);
    check_offsets(call, cu.data(), n, total);
    for (std::size_t i = 0; i < n; ++i)
        in_batch(call, i, seqs[i], [&] {
            check_path(get(seqs[i]), nodes.data() + cu[i], static_cast<std::size_t>(cu[i + 1] - cu[i]));
        });
    if (serial) *serial = 0;
    std::vector<SlotMove> moves;
    std::vector<std::int64_t> moved;  // the sequences whose rows moved
    moves.reserve(total);
    moved.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
        const std::size_t before = moves.size();
        accept_path_seq(seqs[i], mut(get(seqs[i])), nodes.data() + cu[i], static_cast<std::size_t>(cu[i + 1] - cu[i]),
                        moves);
        if (moves.size() > before) moved.push_back(seqs[i]);
    }
    if (!moves.empty()) {
        const std::uint64_t k = next_serial(call, moved.data(), moved.size());
        if (serial) *serial = k;
    }
    return moves;
}

}  // namespace dspark
