// FeatureBuffer: one sequence's encoded feature rows at contiguous absolute
// positions [head(), end()), kept in a ring so that dropping head rows is O(1)
// and no erase ever runs on the per-round hot path (erasing from the front
// of a vector every TRIM_CHUNK rows would memmove the whole window).
//
// Invariants:
//  * rows are contiguous in position: the row of position p (head <= p < end)
//    lives in slot (head_slot + (p - head)) % capacity;
//  * the first reserve_back() reserves the whole bound the Stager will ever
//    need (W + TRIM_CHUNK + B + 1 rows) as address space: pages become
//    resident only as rows are first written (touched_ tracks the high-water
//    slot), so a short context costs only what it holds, and the ring never
//    grows, copies or re-linearises on the hot path;
//  * capacity only grows past that (re-linearising) if asked for more rows
//    than it has free slots, which the Stager's horizon rule never does;
//  * the bytes are shared-owned (storage()): a zero-copy view of staged rows
//    (Stager::draft_view) keeps them alive after the ring lets them go, so a
//    stale view reads rows that were replaced, never freed memory;
//  * an external ring (external-row mode) keeps the same bookkeeping (head,
//    size, capacity, slot arithmetic) but no bytes: its owner holds the rows
//    at the ring indices this class computes, so its capacity is exactly the
//    first reservation and never grows (growing would renumber every slot);
//  * a ring with tokens (a chain drafter's Stager) keeps one int32 token id
//    per slot beside the row, in both kinds of ring (an external one holds
//    the ids, not the rows): every call that moves, copies, re-linearises or
//    compacts rows does the same to their ids, so the id of position p is
//    always the one written with p's row.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "dspark/byte_buffer.hpp"

namespace dspark {

// A run of consecutive slots: [first, first + count).
struct SlotRun {
    std::int64_t first = 0;
    std::int64_t count = 0;
};

// A copy the owner of external rows applies: rows [src, src + count) to
// [dst, dst + count). Moves apply in the order given; the two ranges of one
// move never overlap, so a plain copy (memcpy, cudaMemcpy, tensor copy_) is
// correct, and an earlier move never overwrites a row a later one reads.
struct SlotMove {
    std::int64_t src = 0;
    std::int64_t dst = 0;
    std::int64_t count = 0;
};

// The row copies of `n` moves, in order (a later move reads what an earlier
// one wrote, as applying fork / shift moves one by one does), from the table
// `src` (src_rows rows of row_bytes) to the table `dst` (dst_rows rows; the
// same table for fork / shift moves). An owner applies a batch's moves in one
// call instead of one copy per move. Every move is checked before any row is
// copied (std::invalid_argument names the first one outside a table).
void copy_slot_rows(const SlotMove* moves, std::size_t n, const std::uint8_t* src, std::int64_t src_rows,
                    std::uint8_t* dst, std::int64_t dst_rows, std::size_t row_bytes);

class FeatureBuffer {
public:
    // A writable run of free slots for rows about to be appended: `rows`
    // slots from ring index `slot` (data is null in an external ring).
    struct Span {
        std::uint8_t* data = nullptr;
        std::size_t rows = 0;
        std::size_t slot = 0;
    };

    FeatureBuffer() = default;
    explicit FeatureBuffer(std::size_t row_bytes, bool external = false, bool with_tokens = false)
        : row_bytes_(row_bytes), external_(external), with_tokens_(with_tokens) {}
    // A moved-from ring is empty (capacity 0), never a dangling view.
    FeatureBuffer(FeatureBuffer&& o) noexcept { *this = std::move(o); }
    FeatureBuffer& operator=(FeatureBuffer&& o) noexcept {
        if (this != &o) {
            row_bytes_ = o.row_bytes_;
            external_ = o.external_;
            with_tokens_ = o.with_tokens_;
            data_ = std::move(o.data_);
            tokens_ = std::move(o.tokens_);
            o.tokens_.clear();
            cap_ = std::exchange(o.cap_, 0);
            touched_ = std::exchange(o.touched_, 0);
            head_slot_ = std::exchange(o.head_slot_, 0);
            head_pos_ = std::exchange(o.head_pos_, 0);
            count_ = std::exchange(o.count_, 0);
        }
        return *this;
    }
    FeatureBuffer(const FeatureBuffer&) = delete;
    FeatureBuffer& operator=(const FeatureBuffer&) = delete;

    std::size_t row_bytes() const noexcept { return row_bytes_; }
    std::int64_t head() const noexcept { return head_pos_; }
    std::int64_t end() const noexcept { return head_pos_ + static_cast<std::int64_t>(count_); }
    std::size_t size() const noexcept { return count_; }
    std::size_t capacity() const noexcept { return cap_; }
    bool external() const noexcept { return external_; }
    bool with_tokens() const noexcept { return with_tokens_; }
    // Address space reserved, and the part of it ever written (resident);
    // 0 for an external ring, which holds no bytes.
    std::size_t bytes_reserved() const noexcept { return external_ ? 0 : cap_ * row_bytes_; }
    std::size_t bytes_touched() const noexcept { return external_ ? 0 : touched_ * row_bytes_; }

    // Forget every row; the next row appended is at position `pos`. Keeps the
    // allocation (a server reuses its slots).
    void reset(std::int64_t pos) noexcept;

    // Ensure n more rows fit without dropping any. The first call reserves
    // max(size() + n, reserve_rows) rows; later growth (only past that) at
    // least doubles. An external ring reserves exactly reserve_rows and
    // throws std::logic_error where a held one would grow.
    void reserve_back(std::size_t n, std::size_t reserve_rows);
    // Up to two spans covering the next n free slots (call reserve_back first).
    void back_spans(std::size_t n, Span& first, Span& second) noexcept;
    // The n rows written into back_spans(n) become part of the buffer.
    void commit_back(std::size_t n) noexcept { count_ += n; }
    // Writable bytes of slots [0, n) (n <= capacity(), held ring) whatever
    // rows the ring holds: a restore writes a snapshot's rows there before it
    // knows they are intact, so the caller makes sure no row it may still
    // need lives in those slots. reset(pos) + commit_back(n) then makes them
    // the ring's rows (the layout every emptied ring takes: head at slot 0).
    std::uint8_t* front_slots(std::size_t n) noexcept {
        touched_ = n > touched_ ? n : touched_;
        return bytes();
    }

    // Drop rows below new_head (clamped to [head, end]).
    void drop_front(std::int64_t new_head) noexcept;
    // Drop rows at and above new_end (clamped to [head, end]).
    void drop_back(std::int64_t new_end) noexcept;

    // Copy rows [from, to) (inside [head, end)) to dst, contiguous, oldest first
    // (nothing in an external ring).
    void copy_out(std::int64_t from, std::int64_t to, std::uint8_t* dst) const noexcept;
    // Copy the row of position `from` over the row of position `to` (both
    // inside [head, end), different; an external ring copies only the token).
    void copy_row(std::int64_t from, std::int64_t to) noexcept;

    // The token ids beside the rows (a ring with tokens; no-ops otherwise):
    // write the ids of positions [from, from + n), read those of [from, to)
    // (all inside [head, end); set_tokens also right after commit_back).
    void set_tokens(std::int64_t from, const std::int32_t* ids, std::size_t n) noexcept;
    void copy_tokens_out(std::int64_t from, std::int64_t to, std::int32_t* dst) const noexcept;
    // The ids by ring index (a ring with tokens; the device step hands them
    // over by slot, stager_device_step.cpp): size_tokens makes room for the
    // ids of `cap` slots (it allocates, so a caller sizes before it changes
    // anything: set_marks may bring back a ring the ids never had room for);
    // slot_tokens are the ids by ring index (the id of ring index k at [k]).
    void size_tokens(std::size_t cap) {
        if (with_tokens_ && tokens_.size() < cap) tokens_.resize(cap, 0);
    }
    const std::int32_t* slot_tokens() const noexcept { return tokens_.data(); }
    std::int32_t* slot_tokens() noexcept { return tokens_.data(); }
    // Every slot's id, and putting them back (with the marks they were taken with).
    std::vector<std::int32_t> save_tokens() const { return tokens_; }
    void restore_tokens(std::vector<std::int32_t>&& ids) noexcept { tokens_ = std::move(ids); }
    // Calls f(data, bytes) for each contiguous run (at most two) holding rows
    // [from, to) (inside [head, end)), oldest first.
    template <class F>
    void for_each_run(std::int64_t from, std::int64_t to, F&& f) const {
        if (to <= from) return;
        const std::size_t n = static_cast<std::size_t>(to - from);
        const std::size_t s = slot(from);
        const std::size_t run = n < cap_ - s ? n : cap_ - s;
        f(static_cast<const std::uint8_t*>(bytes() + s * row_bytes_), run * row_bytes_);
        if (run < n) f(static_cast<const std::uint8_t*>(bytes()), (n - run) * row_bytes_);
    }

    // The ring indices of rows [from, to) (inside [head, end)), plus `base`:
    // at most two runs (the ring wraps at most once); unused runs are empty.
    void runs(std::int64_t from, std::int64_t to, std::int64_t base, SlotRun out[2]) const noexcept;

    // Keep rows [from, lo) and [hi, end) and renumber them from new_head:
    // rows below `from` and rows [lo, hi) go (all clamped to [head, end]).
    // The front rows stay in their slots; the tail rows move down to follow
    // them, and when both are non-empty the copies (ring indices + base) are
    // appended to `moves`, in the order they must apply, each at most
    // hi - lo rows so that its source and destination never overlap. (When
    // one side is empty nothing moves.) Rows of a held ring are moved here.
    // Allocates before it changes anything.
    void compact(std::int64_t from, std::int64_t lo, std::int64_t hi, std::int64_t new_head, std::int64_t base,
                 std::vector<SlotMove>& moves);

    // The whole bookkeeping of the ring: for an external ring (no bytes) all
    // there is of it, so set_marks(marks()) puts it back exactly (a
    // cancelled reservation). A held ring's bytes are not part of it.
    struct Marks {
        std::size_t cap = 0, touched = 0, head_slot = 0, count = 0;
        std::int64_t head_pos = 0;
    };
    Marks marks() const noexcept { return {cap_, touched_, head_slot_, count_, head_pos_}; }
    void set_marks(const Marks& m) noexcept {
        cap_ = m.cap;
        touched_ = m.touched;
        head_slot_ = m.head_slot;
        count_ = m.count;
        head_pos_ = m.head_pos;
    }

    // Whether the bytes [p, p + n) share one with the ring's slots (a
    // zero-copy view of its rows handed back as input, even a stale one).
    bool overlaps(const void* p, std::size_t n) const noexcept {
        const auto a = reinterpret_cast<std::uintptr_t>(p), b = reinterpret_cast<std::uintptr_t>(bytes());
        return b != 0 && n != 0 && a < b + cap_ * row_bytes_ && b < a + n;
    }

    // The ring's bytes, shared: whoever holds this keeps them allocated (a
    // zero-copy view of staged rows). Null before the first reservation and
    // in an external ring.
    std::shared_ptr<const void> storage() const noexcept { return data_; }

    // The ring index of position pos (head <= pos < end).
    std::size_t slot(std::int64_t pos) const noexcept {
        std::size_t s = head_slot_ + static_cast<std::size_t>(pos - head_pos_);
        return s >= cap_ ? s - cap_ : s;
    }

private:
    std::size_t row_bytes_ = 0;
    bool external_ = false;  // bookkeeping only: the rows live with the owner
    bool with_tokens_ = false;
    std::uint8_t* bytes() const noexcept { return data_ ? data_->data() : nullptr; }

    // cap_ * row_bytes_ (never zero-filled: rows are written before read);
    // shared with the views storage() handed out.
    std::shared_ptr<ByteVec> data_;
    // One token id per slot (cap_ of them in a ring with tokens, else none).
    std::vector<std::int32_t> tokens_;
    std::size_t cap_ = 0;             // rows
    std::size_t touched_ = 0;         // slots [0, touched_) have been written
    std::size_t head_slot_ = 0;
    std::int64_t head_pos_ = 0;
    std::size_t count_ = 0;
};

}  // namespace dspark
