// What the Stager's batch calls share (stager*.cpp): their locks, their
// per-sequence errors and their argument copies. Internal to
// the core (not installed).
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "dspark/errors.hpp"
#include "dspark/stager.hpp"

namespace dspark {

// The locks of a batch's sequences (ids checked already), each once, taken in
// increasing id order from a bitmap of the ids: O(n + max_seqs / 64), which
// also finds the first repeated id (a batch names each sequence once: the
// caller reports it, in its order of checks).
class Stager::BatchLock {
public:
    BatchLock(const Stager& st, const std::int64_t* seqs, std::size_t n) : st_(st), repeat_(n) {
        const std::size_t words = static_cast<std::size_t>(st.opt_.max_seqs + 63) / 64;
        thread_local std::vector<std::uint64_t> bits;  // all zero between calls
        if (bits.size() < words) bits.resize(words);   // may throw: nothing is locked yet
        order_.reserve(n);
        for (std::size_t i = 0; i < n; ++i) {
            const auto id = static_cast<std::uint64_t>(seqs[i]);
            const std::uint64_t bit = std::uint64_t(1) << (id & 63);
            if (bits[id >> 6] & bit) {
                if (repeat_ == n) repeat_ = i;
            } else {
                bits[id >> 6] |= bit;
            }
        }
        for (std::size_t w = 0; w < words; ++w) {
            for (std::uint64_t u = bits[w]; u; u &= u - 1) order_.push_back(static_cast<std::int64_t>(w * 64 + lowest_bit(u)));
            bits[w] = 0;
        }
        std::size_t locked = 0;
        try {
            for (; locked < order_.size(); ++locked) st_.locks_[static_cast<std::size_t>(order_[locked])].m.lock();
        } catch (...) {
            while (locked) st_.locks_[static_cast<std::size_t>(order_[--locked])].m.unlock();
            throw;
        }
    }
    ~BatchLock() {
        for (auto it = order_.rbegin(); it != order_.rend(); ++it) st_.locks_[static_cast<std::size_t>(*it)].m.unlock();
    }
    BatchLock(const BatchLock&) = delete;
    BatchLock& operator=(const BatchLock&) = delete;

    // The index of the first id that repeats an earlier one, or n.
    std::size_t repeat() const noexcept { return repeat_; }

private:
    static unsigned lowest_bit(std::uint64_t u) noexcept {
#if defined(__GNUC__) || defined(__clang__)
        return static_cast<unsigned>(__builtin_ctzll(u));
#else
        unsigned k = 0;
        while (!(u & 1)) u >>= 1, ++k;
        return k;
#endif
    }

    const Stager& st_;
    std::vector<std::int64_t> order_;
    std::size_t repeat_;
};

namespace detail {

// How an error names one sequence: "sequence <id>".
inline std::string seq_msg(std::int64_t seq) { return "sequence " + std::to_string(seq); }

// How an error names an id outside 0..max_seqs - 1 (Stager::get, the step's status words).
inline std::string unknown_sequence(std::int64_t seq, std::int64_t max_seqs) {
    return "unknown sequence " + std::to_string(seq) + " (this Stager has sequences 0.." +
           std::to_string(max_seqs - 1) + ")";
}

// Runs one sequence's check (or step) of a batch call; an error it throws
// comes out as the same kind of error, prefixed "<call>: seqs[i] (sequence s): "
// (the per-sequence call's error, named).
template <class F>
auto in_batch(const char* call, std::size_t i, std::int64_t seq, F&& f) -> decltype(f()) {
    try {
        return f();
    } catch (...) {
        rethrow_with_prefix(batch_context(call, i, seq));
    }
}

// A batch's per-sequence arguments, read once: the caller's arrays may change
// under a released GIL, the checked values and the ones used must not differ.
inline std::vector<std::int64_t> copy_of(const std::int64_t* p, std::size_t n) {
    return n ? std::vector<std::int64_t>(p, p + n) : std::vector<std::int64_t>();
}

}  // namespace detail

// A batch call's sequences through the checks every batch call makes, in
// their order: the ids (a copy: the caller's array may be an output of the
// call), then, under the batch's locks (held while this lives), each
// sequence's state and no id named twice.
class Stager::CheckedBatch {
public:
    CheckedBatch(const Stager& st, const char* call, const std::int64_t* seqs, std::size_t n, Need need)
        : seqs_(checked_ids(st, call, seqs, n)), lock_(st, seqs_.data(), n) {
        st.check_states(call, seqs_.data(), n, need);
        st.check_unique(call, lock_, seqs_.data(), n);
    }
    const std::vector<std::int64_t>& seqs() const noexcept { return seqs_; }
    const BatchLock& lock() const noexcept { return lock_; }

private:
    static std::vector<std::int64_t> checked_ids(const Stager& st, const char* call, const std::int64_t* seqs,
                                                 std::size_t n) {
        std::vector<std::int64_t> v = detail::copy_of(seqs, n);
        st.check_ids(call, v.data(), n);
        return v;
    }

    std::vector<std::int64_t> seqs_;
    BatchLock lock_;
};

}  // namespace dspark
