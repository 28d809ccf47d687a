// Host side of the device step (step_cuda.hpp): argument checks, device
// handling and the one launch of step_kernels.cuh. Nothing in the step
// allocates, copies or synchronizes, so the call can be captured into a CUDA
// graph; the hand-overs' column copies (outside a graph) come after it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "step_kernels.cuh"  // before dspark headers (see cuda_host.hpp)
#include "cuda_host.hpp"
#include "step_cuda.hpp"

namespace dspark {
namespace {

using namespace cuda_host;

// `p` is device memory on `dev`, aligned for T (null allowed when optional).
template <class T>
void on_device(const T* p, int dev, const char* what, bool optional = true) {
    if (p == nullptr) {
        if (optional) return;
        throw std::invalid_argument(std::string("dspark cuda: device_step_cuda: the ") + what + " is null");
    }
    const int d = cuda_pointer_device(p);
    if (d < 0)
        throw std::invalid_argument(std::string("dspark cuda: device_step_cuda: the ") + what +
                                    " is not CUDA device memory");
    if (d != dev)
        throw std::invalid_argument(std::string("dspark cuda: device_step_cuda: the ") + what + " is on device " +
                                    std::to_string(d) + ", the step state on device " + std::to_string(dev));
    check_aligned(p, sizeof(T), "device_step_cuda", what);
}

constexpr std::size_t kWord = sizeof(std::int64_t);  // one step-state value

// The device owning the step state `state` (checked: device memory, aligned).
int state_device(const void* state, const char* fn) {
    if (state == nullptr) throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the step state is null");
    const int dev = cuda_pointer_device(state);
    if (dev < 0)
        throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the step state is not CUDA device memory");
    check_aligned(state, kWord, fn, "step state");
    return dev;
}

// The host state: host memory, aligned.
void check_host_state(const void* host, const char* fn) {
    if (host == nullptr) throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the host step state is null");
    if (cuda_pointer_device(host) >= 0)
        throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the host step state is device memory");
    check_aligned(host, kWord, fn, "host step state");
}

// The handed sequences as runs of consecutive ids (first, count), each id once;
// std::invalid_argument naming an id outside [0, max_seqs).
std::vector<std::pair<std::int64_t, std::int64_t>> id_runs(const device_step::Config& c, const std::int64_t* seqs,
                                                          std::size_t n, const char* fn) {
    if (seqs == nullptr) throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the sequence ids are null");
    std::vector<std::int64_t> ids(seqs, seqs + n);
    for (std::size_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= c.max_seqs)
            throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": seqs[" + std::to_string(i) + "] is " +
                                        std::to_string(ids[i]) + ", outside 0.." + std::to_string(c.max_seqs - 1));
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    std::vector<std::pair<std::int64_t, std::int64_t>> runs;
    for (const std::int64_t q : ids) {
        if (!runs.empty() && runs.back().first + runs.back().second == q) ++runs.back().second;
        else runs.emplace_back(q, 1);
    }
    return runs;
}

// Each run's columns between `src` and `dst` (both the state's layout: a column's
// values of every sequence one pitch apart), as one strided copy on `s`.
void copy_runs(std::int64_t* dst, const std::int64_t* src, const device_step::Config& c,
               const std::vector<std::pair<std::int64_t, std::int64_t>>& runs, cudaMemcpyKind kind, cudaStream_t s) {
    const auto pitch = static_cast<std::size_t>(c.max_seqs) * kWord;
    const auto height = static_cast<std::size_t>(device_step::columns(c));
    for (const auto& r : runs)
        DSPARK_CK(cudaMemcpy2DAsync(dst + r.first, pitch, src + r.first, pitch, static_cast<std::size_t>(r.second) * kWord,
                                    height, kind, s),
                  "cudaMemcpy2DAsync (step-state columns)");
}

// What both directions check before a copy (the device, the host state, the
// ids): the device owning the state, and the ids' runs.
struct ColumnCopy {
    int device;
    std::vector<std::pair<std::int64_t, std::int64_t>> runs;
};
ColumnCopy column_copy(const device_step::Config& c, const void* state, const void* host, const std::int64_t* seqs,
                       std::size_t n, const char* fn) {
    require_device();
    ColumnCopy cc;
    cc.device = state_device(state, fn);
    check_host_state(host, fn);
    cc.runs = id_runs(c, seqs, n, fn);
    return cc;
}

}  // namespace

void step_columns_to_device_cuda(const device_step::Config& c, std::int64_t* state, const std::int64_t* host,
                                 const std::int64_t* seqs, std::size_t n, void* stream) {
    if (n == 0) return;
    const ColumnCopy cc = column_copy(c, state, host, seqs, n, "step_columns_to_device_cuda");
    DeviceGuard guard(cc.device);
    const auto s = static_cast<cudaStream_t>(stream);
    // Pageable memory is staged before the copy returns; memory the driver knows
    // (pinned, registered) is read later, so wait for it (the reuse promise).
    cudaPointerAttributes a{};
    const bool known = cudaPointerGetAttributes(&a, host) == cudaSuccess && a.type != cudaMemoryTypeUnregistered;
    (void)cudaGetLastError();
    copy_runs(state, host, c, cc.runs, cudaMemcpyHostToDevice, s);
    if (known) DSPARK_CK(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

void step_columns_to_host_cuda(const device_step::Config& c, const std::int64_t* state, std::int64_t* host,
                               const std::int64_t* seqs, std::size_t n, void* stream) {
    if (n == 0) return;
    const ColumnCopy cc = column_copy(c, state, host, seqs, n, "step_columns_to_host_cuda");
    DeviceGuard guard(cc.device);
    const auto s = static_cast<cudaStream_t>(stream);
    copy_runs(host, state, c, cc.runs, cudaMemcpyDeviceToHost, s);
    DSPARK_CK(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

void device_step_cuda(const device_step::Config& c, std::int64_t* state, const std::int64_t* seqs, const void* n_accepted,
                      int count_bytes, std::size_t n, const device_step::Outputs& out, void* stream) {
    if (count_bytes != 4 && count_bytes != 8)
        throw std::invalid_argument("dspark cuda: device_step_cuda: accept counts must be int32 or int64, got " +
                                    std::to_string(count_bytes) + "-byte values");
    if (n == 0) return;
    require_device();
    if (state == nullptr) throw std::invalid_argument("dspark cuda: device_step_cuda: the step state is null");
    const int dev = cuda_pointer_device(state);
    if (dev < 0) throw std::invalid_argument("dspark cuda: device_step_cuda: the step state is not CUDA device memory");
    on_device(state, dev, "step state", false);
    on_device(seqs, dev, "sequence ids", false);
    if (count_bytes == 4) on_device(static_cast<const std::int32_t*>(n_accepted), dev, "accept counts", false);
    else on_device(static_cast<const std::int64_t*>(n_accepted), dev, "accept counts", false);
    on_device(out.status, dev, "status array", false);
    on_device(out.skip, dev, "skip array");
    on_device(out.flags, dev, "flags array");
    on_device(out.start, dev, "start array");
    on_device(out.pos_base, dev, "pos_base array");
    on_device(out.crop_from, dev, "crop_from array");
    on_device(out.n_rows, dev, "n_rows array");
    on_device(out.row_slots, dev, "row slot array");
    on_device(out.row_positions, dev, "row position array");
    on_device(out.block_positions, dev, "block position array");
    on_device(out.verify_slots, dev, "verify slot array");
    DeviceGuard guard(dev);
    const auto s = static_cast<cudaStream_t>(stream);
    const unsigned grid = grid_for(n * kernels::kWarp, dev);  // a warp per entry
    if (count_bytes == 4)
        kernels::launch(kernels::k_step<std::int32_t>, grid, s, c, state, seqs,
                        static_cast<const std::int32_t*>(n_accepted), n, out);
    else
        kernels::launch(kernels::k_step<std::int64_t>, grid, s, c, state, seqs,
                        static_cast<const std::int64_t*>(n_accepted), n, out);
    DSPARK_CK(cudaGetLastError(), "launching the device step kernel");
}

void device_step_rows_cuda(const device_step::Config& c, const std::int64_t* state, const std::int64_t* seqs,
                           std::size_t n, const device_step::Outputs& out, std::size_t capacity,
                           const device_step::CsrRows& rows, void* stream) {
    if (capacity < n)
        throw std::invalid_argument("dspark cuda: device_step_rows_cuda: rows for " + std::to_string(capacity) +
                                    " entries, a batch of " + std::to_string(n));
    require_device();
    if (state == nullptr) throw std::invalid_argument("dspark cuda: device_step_rows_cuda: the step state is null");
    const int dev = cuda_pointer_device(state);
    if (dev < 0)
        throw std::invalid_argument("dspark cuda: device_step_rows_cuda: the step state is not CUDA device memory");
    on_device(state, dev, "step state", false);
    on_device(rows.row_offsets, dev, "row offset array", false);
    on_device(rows.row_slots, dev, "CSR row slot array");
    on_device(rows.row_positions, dev, "CSR row position array");
    if (n) {
        on_device(seqs, dev, "sequence ids", false);
        on_device(out.status, dev, "status array", false);
        on_device(out.skip, dev, "skip array", false);
        on_device(out.start, dev, "start array", false);
        on_device(out.n_rows, dev, "n_rows array", false);
        on_device(out.pos_base, dev, "pos_base array", false);
    }
    DeviceGuard guard(dev);
    const auto s = static_cast<cudaStream_t>(stream);
    kernels::launch(kernels::k_step_rows_scan, 1, s, c, state, seqs, n, out, capacity, rows);
    DSPARK_CK(cudaGetLastError(), "launching the CSR rows' scan kernel");
    if (n == 0) return;
    kernels::launch(kernels::k_step_rows_write, grid_for(n * kernels::kWarp, dev), s, c, state, seqs, n, out, capacity,
                    rows);
    DSPARK_CK(cudaGetLastError(), "launching the CSR rows' kernel");
}

}  // namespace dspark
