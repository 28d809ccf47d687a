// The device step's kernel: a warp per entry of the step. Lane 0 runs the
// entry's step_one (dspark/step_math.hpp), the function the CPU twin
// (Stager::step_many) runs, over the step state in device memory; the warp
// then writes the entry's padded context rows (up to W - B of them: a
// rebase's) together, 32 at a time.
//
// Entries touch disjoint state: an entry whose id appears earlier in the
// batch is a DUPLICATE and reads nothing of the state (lane 0 scans the
// entries before its own: the CPU twin's rule, so both agree on which entry
// of a repeated id steps). A step is at most a few thousand entries, so the
// scan costs far less than the launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "row_format_kernels.cuh"  // kThreads, kFull, global_thread, launch; DSPARK_HD
#include "dspark/step_math.hpp"

namespace dspark {
namespace kernels {

constexpr int kWarp = 32;

// A 64-bit value from lane 0 to the whole warp (shuffles move 32 bits).
__device__ __forceinline__ std::int64_t from_lane0(std::int64_t v) {
    const auto u = static_cast<std::uint64_t>(v);
    const std::uint32_t lo = __shfl_sync(kFull, static_cast<std::uint32_t>(u), 0);
    const std::uint32_t hi = __shfl_sync(kFull, static_cast<std::uint32_t>(u >> 32), 0);
    return static_cast<std::int64_t>((static_cast<std::uint64_t>(hi) << 32) | lo);
}

// T: the sampler's accept count type (int32 or int64).
template <class T>
__global__ void __launch_bounds__(kThreads) k_step(device_step::Config c, std::int64_t* state, const std::int64_t* seqs,
                                                  const T* counts, std::size_t n, device_step::Outputs out) {
    const std::size_t lane = threadIdx.x % kWarp;
    const std::size_t warps = grid_threads() / kWarp;
    // The loop is uniform across a warp (i is the warp's): every lane reaches the shuffles.
    for (std::size_t i = global_thread() / kWarp; i < n; i += warps) {
        device_step::Rows w;
        if (lane == 0) {
            const std::int64_t q = seqs[i];
            bool dup = false;
            if (q >= 0 && q < c.max_seqs)
                for (std::size_t j = 0; j < i && !dup; ++j) dup = seqs[j] == q;
            device_step::Plan p;
            const std::int32_t status = device_step::step_one(c, state, out, static_cast<std::int64_t>(i), q,
                                                       static_cast<std::int64_t>(counts[i]), dup, p);
            w = device_step::rows_of(status, p);
        }
        w.n_rows = from_lane0(w.n_rows);
        w.run_first0 = from_lane0(w.run_first0);
        w.run_count0 = from_lane0(w.run_count0);
        w.run_first1 = from_lane0(w.run_first1);
        w.pos0 = from_lane0(w.pos0);
        device_step::write_rows(c, out, static_cast<std::int64_t>(i), w, static_cast<std::int64_t>(lane), kWarp);
    }
}

// The CSR rows of a step's batch (device_step::rows_after_step): two
// launches, both graph-safe. k_step_rows_scan (one warp) writes row_offsets,
// the exclusive scan of every entry's rows over `capacity` entries (those
// past n: 0): each lane counts a contiguous chunk of ceil(capacity / 32)
// entries, a warp scan of the 32 sums, then each lane writes its chunk's
// offsets (the counts read again: the loads are cached). k_step_rows_write (a
// warp per entry, as k_step) then writes each entry's rows at its offset.

// v from lane `src` (any lane, as __shfl_sync), 64 bits.
__device__ __forceinline__ std::int64_t shfl64(std::int64_t v, int src) {
    const auto u = static_cast<std::uint64_t>(v);
    const std::uint32_t lo = __shfl_sync(kFull, static_cast<std::uint32_t>(u), src);
    const std::uint32_t hi = __shfl_sync(kFull, static_cast<std::uint32_t>(u >> 32), src);
    return static_cast<std::int64_t>((static_cast<std::uint64_t>(hi) << 32) | lo);
}

__device__ __forceinline__ std::int64_t entry_rows(const device_step::Config& c, const std::int64_t* state,
                                                   const std::int64_t* seqs, std::size_t n,
                                                   const device_step::Outputs& out, std::size_t i) {
    return i < n ? device_step::rows_after_step(c, state, out, static_cast<std::int64_t>(i), seqs[i]).n_rows : 0;
}

__global__ void __launch_bounds__(kThreads) k_step_rows_scan(device_step::Config c, const std::int64_t* state,
                                                            const std::int64_t* seqs, std::size_t n,
                                                            device_step::Outputs out, std::size_t capacity,
                                                            device_step::CsrRows rows) {
    if (blockIdx.x != 0 || threadIdx.x >= static_cast<unsigned>(kWarp)) return;  // one warp: the whole warp stays
    const int lane = static_cast<int>(threadIdx.x);
    const std::size_t per = (capacity + kWarp - 1) / kWarp;
    const std::size_t lo = device_step::imin(static_cast<std::int64_t>(per) * lane, static_cast<std::int64_t>(capacity));
    const std::size_t hi = device_step::imin(static_cast<std::int64_t>(lo + per), static_cast<std::int64_t>(capacity));
    std::int64_t sum = 0;
    for (std::size_t i = lo; i < hi; ++i) sum += entry_rows(c, state, seqs, n, out, i);
    std::int64_t incl = sum;  // inclusive scan of the lanes' sums
    for (int d = 1; d < kWarp; d *= 2) {
        const std::int64_t v = shfl64(incl, lane - d);
        if (lane >= d) incl += v;
    }
    std::int64_t at = incl - sum;
    for (std::size_t i = lo; i < hi; ++i) {
        rows.row_offsets[i] = at;
        at += entry_rows(c, state, seqs, n, out, i);
    }
    if (lane == kWarp - 1) rows.row_offsets[capacity] = incl;
}

__global__ void __launch_bounds__(kThreads) k_step_rows_write(device_step::Config c, const std::int64_t* state,
                                                             const std::int64_t* seqs, std::size_t n,
                                                             device_step::Outputs out, std::size_t capacity,
                                                             device_step::CsrRows rows) {
    const std::int64_t lane = threadIdx.x % kWarp;
    const std::size_t warps = grid_threads() / kWarp;
    const std::int64_t room = static_cast<std::int64_t>(capacity) * c.max_rows;
    for (std::size_t i = global_thread() / kWarp; i < n; i += warps) {
        device_step::Rows w =
            device_step::rows_after_step(c, state, out, static_cast<std::int64_t>(i), seqs[i]);  // every lane alike
        const std::int64_t at = rows.row_offsets[i];
        // The scan's offsets bound the rows too (its counts are these: a guard only).
        w.n_rows = device_step::iclamp(device_step::imin(w.n_rows, rows.row_offsets[i + 1] - at), 0,
                                       device_step::imax(room - at, 0));
        if (at < 0) w.n_rows = 0;
        device_step::write_csr_rows(rows, at, w, lane, kWarp);
    }
}

}  // namespace kernels
}  // namespace dspark
