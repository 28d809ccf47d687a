#include "dspark/feature_buffer.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "row_format_kernels.hpp"

#include <string>

namespace dspark {

void copy_slot_rows(const SlotMove* moves, std::size_t n, const std::uint8_t* src, std::int64_t src_rows,
                    std::uint8_t* dst, std::int64_t dst_rows, std::size_t row_bytes) {
    for (std::size_t i = 0; i < n; ++i) {
        const SlotMove& m = moves[i];
        // Written so that no sum overflows: count > 0, so src <= src_rows - count keeps src + count in range.
        if (!(m.count > 0 && m.src >= 0 && m.count <= src_rows && m.src <= src_rows - m.count && m.dst >= 0 &&
              m.count <= dst_rows && m.dst <= dst_rows - m.count))
            throw std::invalid_argument("move " + std::to_string(i) + " [" + std::to_string(m.src) + ", " +
                                        std::to_string(m.dst) + ", " + std::to_string(m.count) +
                                        "] is outside the tables");
    }
    for (std::size_t i = 0; i < n; ++i) {
        const SlotMove& m = moves[i];
        std::memmove(dst + static_cast<std::size_t>(m.dst) * row_bytes, src + static_cast<std::size_t>(m.src) * row_bytes,
                     static_cast<std::size_t>(m.count) * row_bytes);
    }
}

void FeatureBuffer::reset(std::int64_t pos) noexcept {
    head_pos_ = pos;
    head_slot_ = 0;
    count_ = 0;
}

void FeatureBuffer::reserve_back(std::size_t n, std::size_t reserve_rows) {
    const std::size_t need = count_ + n;
    if (need <= cap_) return;
    if (external_) {
        // The owner's table has exactly reserve_rows slots for this ring.
        if (cap_ != 0 || need > reserve_rows)
            throw std::logic_error("dspark internal error: an external ring would outgrow its slots");
        cap_ = reserve_rows;
        head_slot_ = 0;
        if (with_tokens_) tokens_.assign(cap_, 0);
        return;
    }
    const std::size_t new_cap = std::max({need, reserve_rows, cap_ * 2});
    // Address space, not touched here; a fresh allocation (never resized in
    // place), so a view of the old bytes keeps them.
    auto fresh = std::make_shared<ByteVec>(new_cap * row_bytes_);
    std::vector<std::int32_t> ids(with_tokens_ ? new_cap : 0);
    // Re-linearise: the oldest row goes to slot 0.
    if (count_ != 0) copy_out(head_pos_, end(), fresh->data());
    if (count_ != 0) copy_tokens_out(head_pos_, end(), ids.data());
    data_ = std::move(fresh);
    tokens_ = std::move(ids);
    cap_ = new_cap;
    head_slot_ = 0;
    touched_ = count_;
}

void FeatureBuffer::back_spans(std::size_t n, Span& first, Span& second) noexcept {
    const std::size_t tail = count_ == 0 ? head_slot_ : slot(end() - 1) + 1;
    const std::size_t start = tail >= cap_ ? tail - cap_ : tail;
    const std::size_t run = std::min(n, cap_ - start);
    std::uint8_t* base = external_ ? nullptr : bytes();
    first = {base ? base + start * row_bytes_ : nullptr, run, start};
    second = {base, n - run, 0};
    touched_ = std::max({touched_, start + run, n - run});
}

void FeatureBuffer::drop_front(std::int64_t new_head) noexcept {
    new_head = std::clamp(new_head, head_pos_, end());
    const std::size_t k = static_cast<std::size_t>(new_head - head_pos_);
    if (k == 0) return;
    head_slot_ = count_ == k ? 0 : slot(new_head);
    head_pos_ = new_head;
    count_ -= k;
}

void FeatureBuffer::drop_back(std::int64_t new_end) noexcept {
    new_end = std::clamp(new_end, head_pos_, end());
    count_ = static_cast<std::size_t>(new_end - head_pos_);
}

void FeatureBuffer::copy_out(std::int64_t from, std::int64_t to, std::uint8_t* dst) const noexcept {
    if (to <= from || external_) return;
    const std::size_t n = static_cast<std::size_t>(to - from);
    const std::size_t s = slot(from);
    const std::size_t run = std::min(n, cap_ - s);
    // A rebase's W/2 rows stream past the cache (detail::copy_bytes).
    detail::copy_bytes(dst, bytes() + s * row_bytes_, run * row_bytes_);
    if (run < n) detail::copy_bytes(dst + run * row_bytes_, bytes(), (n - run) * row_bytes_);
}

void FeatureBuffer::copy_row(std::int64_t from, std::int64_t to) noexcept {
    if (with_tokens_) tokens_[slot(to)] = tokens_[slot(from)];
    if (external_) return;
    std::memcpy(bytes() + slot(to) * row_bytes_, bytes() + slot(from) * row_bytes_, row_bytes_);
}

void FeatureBuffer::set_tokens(std::int64_t from, const std::int32_t* ids, std::size_t n) noexcept {
    if (!with_tokens_ || n == 0) return;
    const std::size_t s = slot(from);
    const std::size_t run = std::min(n, cap_ - s);
    std::copy(ids, ids + run, tokens_.begin() + static_cast<std::ptrdiff_t>(s));
    std::copy(ids + run, ids + n, tokens_.begin());
}

void FeatureBuffer::copy_tokens_out(std::int64_t from, std::int64_t to, std::int32_t* dst) const noexcept {
    if (!with_tokens_ || to <= from) return;
    const std::size_t n = static_cast<std::size_t>(to - from);
    const std::size_t s = slot(from);
    const std::size_t run = std::min(n, cap_ - s);
    std::copy(tokens_.begin() + static_cast<std::ptrdiff_t>(s), tokens_.begin() + static_cast<std::ptrdiff_t>(s + run),
              dst);
    std::copy(tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(n - run), dst + run);
}

void FeatureBuffer::runs(std::int64_t from, std::int64_t to, std::int64_t base, SlotRun out[2]) const noexcept {
    out[0] = out[1] = SlotRun{};
    if (to <= from) return;
    const std::size_t n = static_cast<std::size_t>(to - from);
    const std::size_t s = slot(from);
    const std::size_t run = std::min(n, cap_ - s);
    out[0] = {base + static_cast<std::int64_t>(s), static_cast<std::int64_t>(run)};
    if (run < n) out[1] = {base, static_cast<std::int64_t>(n - run)};
}

void FeatureBuffer::compact(std::int64_t from, std::int64_t lo, std::int64_t hi, std::int64_t new_head,
                            std::int64_t base, std::vector<SlotMove>& moves) {
    from = std::clamp(from, head_pos_, end());
    lo = std::clamp(lo, from, end());
    hi = std::clamp(hi, lo, end());
    const std::size_t n_front = static_cast<std::size_t>(lo - from);
    const std::size_t n_gap = static_cast<std::size_t>(hi - lo);
    const std::size_t n_tail = static_cast<std::size_t>(end() - hi);
    // Plan the copies first (the only allocation). Tail row i goes from ring
    // offset (hi - head) + i down to (lo - head) + i: copying in increasing
    // order never overwrites a row still to be read, and pieces of at most
    // n_gap rows that never straddle the ring's end have disjoint ranges.
    const std::size_t first_move = moves.size();
    if (n_front && n_gap && n_tail) {
        std::size_t src = slot(hi), dst = slot(lo), left = n_tail;
        while (left) {
            const std::size_t run = std::min({left, n_gap, cap_ - src, cap_ - dst});
            moves.push_back({base + static_cast<std::int64_t>(src), base + static_cast<std::int64_t>(dst),
                             static_cast<std::int64_t>(run)});
            src = src + run == cap_ ? 0 : src + run;
            dst = dst + run == cap_ ? 0 : dst + run;
            left -= run;
        }
    }
    const std::size_t first = n_front ? slot(from) : n_tail ? slot(hi) : 0;
    for (std::size_t i = first_move; i < moves.size(); ++i) {
        const SlotMove& m = moves[i];
        const auto src = static_cast<std::size_t>(m.src - base), dst = static_cast<std::size_t>(m.dst - base);
        const auto count = static_cast<std::size_t>(m.count);
        if (!external_) std::memcpy(bytes() + dst * row_bytes_, bytes() + src * row_bytes_, count * row_bytes_);
        if (with_tokens_) std::copy_n(tokens_.begin() + static_cast<std::ptrdiff_t>(src), count,
                                      tokens_.begin() + static_cast<std::ptrdiff_t>(dst));
    }
    count_ = n_front + n_tail;
    head_slot_ = count_ ? first : 0;
    head_pos_ = new_head;
}

}  // namespace dspark
