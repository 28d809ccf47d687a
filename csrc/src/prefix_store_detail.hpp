// What prefix_store.cpp and prefix_block_format.cpp share: the error of a
// rejected argument, the configuration as message text, and how a block's
// kept rows lie in its pages. Internal to the core (not installed).
#pragma once
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "dspark/prefix_store.hpp"

namespace dspark {

namespace prefix_detail {

[[noreturn]] inline void bad(const std::string& why) { throw std::invalid_argument(why); }

inline std::string fingerprint_text(std::int64_t dim, Storage st, NonFinite nf, ElemType stage, std::int64_t window,
                                    std::int64_t block) {
    const char* nf_name = nonfinite_name(nf);
    return "feature_dim=" + std::to_string(dim) + ", storage=" + storage_name(st) +
           ", nonfinite=" + (nf_name ? nf_name : "?") + ", stage_dtype=" + elem_name(stage) +
           ", window=" + std::to_string(window) + ", block_size=" + std::to_string(block);
}

}  // namespace prefix_detail

template <class F>
void PrefixStore::for_each_piece(const SlotRun& run, const std::vector<std::int64_t>& pages, F&& f) const {
    // Kept row t (position run.first + t) is row t % page_rows of page t / page_rows.
    for (std::int64_t t = 0; t < run.count;) {
        const std::int64_t off = t % page_rows_;
        const std::int64_t n = std::min(run.count - t, page_rows_ - off);
        f(Piece{run.first + t, n, pages[static_cast<std::size_t>(t / page_rows_)], off});
        t += n;
    }
}

}  // namespace dspark
