// The device step's kernel: one thread per entry of the step runs that
// entry's step_one (dspark/step_math.hpp), the function the CPU twin
// (Stager::step_many) runs, over the step state in device memory.
//
// Entries touch disjoint state: an entry whose id appears earlier in the
// batch is a DUPLICATE and reads nothing of the state (each thread scans the
// entries before its own: the CPU twin's rule, so both agree on which entry
// of a repeated id steps). A step is at most a few thousand entries, so the
// scan costs far less than the launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "row_format_kernels.cuh"  // kThreads, global_thread, launch; DSPARK_HD
#include "dspark/step_math.hpp"

namespace dspark {
namespace kernels {

// T: the sampler's accept count type (int32 or int64).
template <class T>
__global__ void __launch_bounds__(kThreads) k_step(step::Config c, std::int64_t* state, const std::int64_t* seqs,
                                                  const T* counts, std::size_t n, step::Outputs out) {
    for (std::size_t i = global_thread(); i < n; i += grid_threads()) {
        const std::int64_t q = seqs[i];
        bool dup = false;
        if (q >= 0 && q < c.max_seqs)
            for (std::size_t j = 0; j < i && !dup; ++j) dup = seqs[j] == q;
        (void)step::step_one(c, state, out, static_cast<std::int64_t>(i), q, static_cast<std::int64_t>(counts[i]), dup);
    }
}

}  // namespace kernels
}  // namespace dspark
