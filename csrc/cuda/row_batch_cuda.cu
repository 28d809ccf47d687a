// Host side of the index-driven batches (row_batch_cuda.hpp): argument
// checks, device handling and the launches of row_batch_kernels.cuh. Built
// with the library's exactness flags (CMakeLists.txt; the ctest
// cuda_ptx_exactness checks this file's PTX as well).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "row_batch_kernels.cuh"  // before dspark/row_format.hpp (see cuda_host.hpp)
#include "cuda_host.hpp"
#include "row_batch_cuda.hpp"

namespace dspark {
namespace {

using namespace kernels;
using namespace cuda_host;

static_assert(BATCH_STATUS_WORDS == static_cast<std::size_t>(kStatusWords) && BATCH_BAD_VALUE == kBadValue &&
                  BATCH_BAD_SLOT == kBadSlot && BATCH_STATUS_NONE == kNone,
              "the status layout of row_batch_cuda.hpp is the kernels'");

void check_policy(NonFinite policy) {
    if (static_cast<unsigned>(policy) >= static_cast<unsigned>(NONFINITE_COUNT))
        throw std::invalid_argument("dspark cuda: unknown non-finite policy code");
}

// The device owning `p` (device memory required), and that it is `dev` when dev >= 0.
int device_of(const void* p, int dev, const char* fn, const char* what) {
    if (p == nullptr) throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the " + what + " is null");
    const int d = cuda_pointer_device(p);
    if (d < 0)
        throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the " + what + " is not CUDA device memory");
    if (dev >= 0 && d != dev)
        throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the " + what + " is on device " +
                                    std::to_string(d) + ", the rows on device " + std::to_string(dev));
    return d;
}

// The device of a batch: rows and table on one device, slots and status on it too.
int batch_device(const void* rows, const void* table, const std::int64_t* slots, const std::uint64_t* status,
                 const char* fn) {
    const int dev = common_device(rows, table, fn);
    if (slots != nullptr) {
        (void)device_of(slots, dev, fn, "slot array");
        check_aligned(slots, sizeof(std::int64_t), fn, "slot array");
    }
    if (status != nullptr) {
        (void)device_of(status, dev, fn, "status");
        check_aligned(status, sizeof(std::uint64_t), fn, "status");
    }
    return dev;
}

void check_storage_alignment(const void* p, Storage s, const char* fn, const char* what) {
    if (s == Storage::F32) check_aligned(p, 4, fn, what);
    if (s == Storage::F16 || s == Storage::BF16) check_aligned(p, 2, fn, what);
}

std::uint32_t limit_of(Storage s, ElemType staged) {
    const float limit = encode_bounds(s, staged).limit;
    std::uint32_t bits = 0;
    std::memcpy(&bits, &limit, sizeof bits);
    return bits;
}

// Blocks for a batch: one per (row, kSegment elements), capped as grid_for.
unsigned batch_blocks(std::size_t n_rows, std::size_t dim, int dev) {
    return grid_for(n_rows * ((dim + kSegment - 1) / kSegment) * static_cast<std::size_t>(kThreads), dev);
}

unsigned long long* words(std::uint64_t* status) { return reinterpret_cast<unsigned long long*>(status); }

}  // namespace

void batch_status_reset_cuda(std::uint64_t* status, void* stream) {
    require_device();
    const int dev = device_of(status, -1, "batch_status_reset_cuda", "status");
    check_aligned(status, sizeof(std::uint64_t), "batch_status_reset_cuda", "status");
    DeviceGuard guard(dev);
    DSPARK_CK(cudaMemsetAsync(status, 0xff, BATCH_STATUS_WORDS * sizeof(std::uint64_t), static_cast<cudaStream_t>(stream)),
              "cudaMemsetAsync (batch status)");
}

void check_rows_cuda(const void* src, ElemType in, std::size_t n_rows, std::size_t dim, const std::int64_t* slots,
                     std::size_t table_rows, Storage storage, ElemType staged, std::uint64_t* status, void* stream) {
    check_elem(in);
    check_elem(staged);
    (void)row_bytes(storage, dim);
    (void)checked_elems(n_rows, dim);
    if (n_rows == 0 || dim == 0) return;
    if (status == nullptr) throw std::invalid_argument("dspark cuda: check_rows_cuda: the status is null");
    require_device();
    const int dev = batch_device(src, status, slots, status, "check_rows_cuda");
    check_aligned(src, elem_bytes(in), "check_rows_cuda", "source");
    DeviceGuard guard(dev);
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();
    const unsigned grid = batch_blocks(n_rows, dim, dev);
    const std::uint32_t limit = limit_of(storage, staged);
    switch (in) {
        case ElemType::F32: launch(k_check_rows<E_F32>, grid, s, src, n_rows, dim, slots, table_rows, limit, words(status)); break;
        case ElemType::F16: launch(k_check_rows<E_F16>, grid, s, src, n_rows, dim, slots, table_rows, limit, words(status)); break;
        case ElemType::BF16: launch(k_check_rows<E_BF16>, grid, s, src, n_rows, dim, slots, table_rows, limit, words(status)); break;
    }
    DSPARK_CK(cudaGetLastError(), "launching the batch check kernel");
}

void scatter_rows_cuda(const void* src, ElemType in, std::size_t n_rows, std::size_t dim, const std::int64_t* slots,
                       void* table, Storage storage, std::size_t table_rows, NonFinite policy, ElemType staged,
                       std::uint64_t* status, bool gated, void* stream) {
    check_elem(in);
    check_elem(staged);
    check_policy(policy);
    (void)row_bytes(storage, dim);
    (void)checked_elems(n_rows, dim);
    if (gated && status == nullptr)
        throw std::invalid_argument("dspark cuda: scatter_rows_cuda: a gated write needs the status of its check");
    if (n_rows == 0 || dim == 0) return;
    if (slots == nullptr) throw std::invalid_argument("dspark cuda: scatter_rows_cuda: the slot array is null");
    require_device();
    const int dev = batch_device(src, table, slots, status, "scatter_rows_cuda");
    check_aligned(src, elem_bytes(in), "scatter_rows_cuda", "source");
    check_storage_alignment(table, storage, "scatter_rows_cuda", "table");
    DeviceGuard guard(dev);
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();
    const unsigned grid = batch_blocks(n_rows, dim, dev);
    const std::uint32_t limit = limit_of(storage, staged);
    const int pol = static_cast<int>(policy);
    const unsigned long long* gate = gated ? words(status) : nullptr;
    const int out = static_cast<int>(storage);
    switch (in) {
        case ElemType::F32: launch_scatter_in<E_F32>(out, src, n_rows, dim, slots, table, table_rows, pol, limit, gate, words(status), grid, s); break;
        case ElemType::F16: launch_scatter_in<E_F16>(out, src, n_rows, dim, slots, table, table_rows, pol, limit, gate, words(status), grid, s); break;
        case ElemType::BF16: launch_scatter_in<E_BF16>(out, src, n_rows, dim, slots, table, table_rows, pol, limit, gate, words(status), grid, s); break;
    }
    DSPARK_CK(cudaGetLastError(), std::string("launching the ") + storage_name(storage) + " batch write kernel");
}

void gather_rows_cuda(const void* table, Storage storage, std::size_t table_rows, std::size_t dim,
                      const std::int64_t* slots, std::size_t n_rows, void* dst, ElemType out, std::uint64_t* status,
                      void* stream) {
    check_elem(out);
    (void)row_bytes(storage, dim);
    (void)checked_elems(n_rows, dim);
    if (n_rows == 0 || dim == 0) return;
    if (slots == nullptr) throw std::invalid_argument("dspark cuda: gather_rows_cuda: the slot array is null");
    require_device();
    const int dev = batch_device(dst, table, slots, status, "gather_rows_cuda");
    check_storage_alignment(table, storage, "gather_rows_cuda", "table");
    check_aligned(dst, elem_bytes(out), "gather_rows_cuda", "destination");
    DeviceGuard guard(dev);
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();
    const unsigned grid = batch_blocks(n_rows, dim, dev);
    const int in = static_cast<int>(storage);
    switch (out) {
        case ElemType::F32: launch_gather_out<E_F32>(in, table, table_rows, dim, slots, n_rows, dst, words(status), grid, s); break;
        case ElemType::F16: launch_gather_out<E_F16>(in, table, table_rows, dim, slots, n_rows, dst, words(status), grid, s); break;
        case ElemType::BF16: launch_gather_out<E_BF16>(in, table, table_rows, dim, slots, n_rows, dst, words(status), grid, s); break;
    }
    DSPARK_CK(cudaGetLastError(), std::string("launching the ") + storage_name(storage) + " batch gather kernel");
}

}  // namespace dspark
