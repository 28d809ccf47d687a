#include "dspark/feature_buffer.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace dspark {

void FeatureBuffer::reset(std::int64_t pos) noexcept {
    head_pos_ = pos;
    head_slot_ = 0;
    count_ = 0;
}

void FeatureBuffer::reserve_back(std::size_t n, std::size_t reserve_rows) {
    const std::size_t need = count_ + n;
    if (need <= cap_) return;
    const std::size_t new_cap = std::max({need, reserve_rows, cap_ * 2});
    ByteVec fresh(new_cap * row_bytes_);  // address space; not touched here
    // Re-linearise: the oldest row goes to slot 0.
    if (count_ != 0) copy_out(head_pos_, end(), fresh.data());
    data_.swap(fresh);
    cap_ = new_cap;
    head_slot_ = 0;
    touched_ = count_;
}

void FeatureBuffer::back_spans(std::size_t n, Span& first, Span& second) noexcept {
    const std::size_t tail = count_ == 0 ? head_slot_ : slot(end() - 1) + 1;
    const std::size_t start = tail >= cap_ ? tail - cap_ : tail;
    const std::size_t run = std::min(n, cap_ - start);
    first = {data_.data() + start * row_bytes_, run};
    second = {data_.data(), n - run};
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
    if (to <= from) return;
    const std::size_t n = static_cast<std::size_t>(to - from);
    const std::size_t s = slot(from);
    const std::size_t run = std::min(n, cap_ - s);
    std::memcpy(dst, data_.data() + s * row_bytes_, run * row_bytes_);
    if (run < n) std::memcpy(dst + run * row_bytes_, data_.data(), (n - run) * row_bytes_);
}

}  // namespace dspark
