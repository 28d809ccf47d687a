// Host side of the CUDA row conversion (dspark_cuda.hpp): argument checks,
// device and stream handling, the non-finite flag and error translation. The
// kernels and their dispatch are in row_format_kernels.cuh.
//
// Exactness: the library is built with -fmad=false --ftz=false
// --prec-div=true --prec-sqrt=true and never -use_fast_math (CMakeLists.txt;
// the ctest cuda_ptx_exactness checks the generated PTX), so the kernels'
// bytes equal the CPU scalar path's (verified on the host by
// csrc/tests/test_cuda_kernels.cpp and on a GPU by tests/test_cuda.py).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "cuda_host.hpp"
#include "row_format_kernels.cuh"
#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"
#include "dspark_cuda.hpp"

namespace dspark {
namespace {

using namespace kernels;
using namespace cuda_host;

constexpr unsigned long long kNoBad = ~0ull;  // the flag's value when every input is finite

// A device word for the first non-finite index, stream-ordered.
class BadFlag {
public:
    explicit BadFlag(cudaStream_t s) : s_(s) {
        cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&p_), sizeof(unsigned long long), s_);
        if (e == cudaErrorNotSupported) {  // no stream-ordered allocator: plain cudaMalloc
            (void)cudaGetLastError();
            async_ = false;
            e = cudaMalloc(reinterpret_cast<void**>(&p_), sizeof(unsigned long long));
        }
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            p_ = nullptr;
            throw_cuda(e, "allocating the non-finite flag");
        }
        const cudaError_t m = cudaMemsetAsync(p_, 0xff, sizeof(unsigned long long), s_);
        if (m != cudaSuccess) {
            release();
            throw_cuda(m, "cudaMemsetAsync");
        }
    }
    ~BadFlag() { release(); }
    BadFlag(const BadFlag&) = delete;
    BadFlag& operator=(const BadFlag&) = delete;
    unsigned long long* get() const { return p_; }
    // Copies the flag back (synchronizing the stream) and frees it.
    std::int64_t read() {
        unsigned long long h = kNoBad;
        DSPARK_CK(cudaMemcpyAsync(&h, p_, sizeof h, cudaMemcpyDeviceToHost, s_), "reading the non-finite flag");
        release();
        DSPARK_CK(cudaStreamSynchronize(s_), "cudaStreamSynchronize");
        return h == kNoBad ? -1 : static_cast<std::int64_t>(h);
    }

private:
    void release() noexcept {
        if (p_ != nullptr) {
            if (async_) (void)cudaFreeAsync(p_, s_);
            else (void)cudaFree(p_);
            p_ = nullptr;
        }
    }
    cudaStream_t s_;
    unsigned long long* p_ = nullptr;
    bool async_ = true;
};

}  // namespace

// ------------------------------------------------------------- public API ---

int cuda_device_count() noexcept {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

std::string cuda_unavailable_reason() {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        std::string r = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
        if (e == cudaErrorInsufficientDriver) r += " (no NVIDIA driver found, or it is older than the runtime)";
        return r;
    }
    return n > 0 ? std::string() : std::string("no CUDA-capable device is detected");
}

bool cuda_is_emulated() noexcept {
#if defined(DSPARK_CUDA_EMULATION)
    return true;
#else
    return false;
#endif
}

int cuda_runtime_version() noexcept {
    int v = 0;
    if (cudaRuntimeGetVersion(&v) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return v;
}

int cuda_driver_version() noexcept {
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return v;
}

int cuda_pointer_device(const void* p) {
    if (p == nullptr) return -1;
    require_device();
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (e == cudaErrorInvalidValue) return -1;  // not a CUDA allocation
        throw_cuda(e, "cudaPointerGetAttributes");
    }
    if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return a.device;
    return -1;
}

std::string cuda_device_name(int dev) {
    require_device();
    cudaDeviceProp prop{};
    DSPARK_CK(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties(" + std::to_string(dev) + ")");
    return std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")";
}

std::int64_t encode_rows_cuda(const void* src, ElemType in, void* dst, Storage out, std::size_t n_rows,
                              std::size_t dim, NonFinite policy, void* stream, bool report_nonfinite,
                              ElemType staged) {
    check_elem(in);
    check_elem(staged);
    if (static_cast<unsigned>(policy) >= static_cast<unsigned>(NONFINITE_COUNT)) throw std::invalid_argument("dspark cuda: unknown non-finite policy code");
    (void)row_bytes(out, dim);  // validates the storage code and dim for q formats
    const std::size_t n = checked_elems(n_rows, dim);
    if (n == 0) return -1;
    if (src == nullptr || dst == nullptr) throw std::invalid_argument("dspark cuda: encode_rows_cuda: null pointer");
    require_device();
    const int dev = common_device(src, dst, "encode_rows_cuda");
    check_aligned(src, elem_bytes(in), "encode_rows_cuda", "source");
    if (out == Storage::F32) check_aligned(dst, 4, "encode_rows_cuda", "destination");
    if (out == Storage::F16 || out == Storage::BF16) check_aligned(dst, 2, "encode_rows_cuda", "destination");
    DeviceGuard guard(dev);
    const auto s = static_cast<cudaStream_t>(stream);
    const bool want = policy == NonFinite::Error && report_nonfinite;

    (void)cudaGetLastError();  // clear a stale non-sticky error so we report our own
    std::optional<BadFlag> flag;
    if (want) flag.emplace(s);
    const int pol = static_cast<int>(policy);
    // The limit as bits: the storage's own, or tighter for a narrower staged type.
    const float limit_f = encode_bounds(out, staged).limit;
    std::uint32_t limit = 0;
    std::memcpy(&limit, &limit_f, sizeof limit);
    unsigned long long* bad = flag ? flag->get() : nullptr;
    const unsigned grid_e = grid_for((n + kChunk - 1) / kChunk, dev);  // a thread per 4 elements
    const unsigned grid_q = grid_for((n + kElemsPerLane - 1) / kElemsPerLane, dev);  // a lane per 4 elements
    switch (in) {
        case ElemType::F32: launch_encode_in<E_F32>(static_cast<int>(out), src, dst, n, pol, bad, grid_e, grid_q, s, limit); break;
        case ElemType::F16: launch_encode_in<E_F16>(static_cast<int>(out), src, dst, n, pol, bad, grid_e, grid_q, s, limit); break;
        case ElemType::BF16: launch_encode_in<E_BF16>(static_cast<int>(out), src, dst, n, pol, bad, grid_e, grid_q, s, limit); break;
    }
    DSPARK_CK(cudaGetLastError(), std::string("launching the ") + storage_name(out) + " encode kernel");
    return flag ? flag->read() : -1;
}

void decode_rows_cuda(const void* src, Storage in, void* dst, ElemType out, std::size_t n_rows, std::size_t dim,
                      void* stream) {
    check_elem(out);
    (void)row_bytes(in, dim);
    const std::size_t n = checked_elems(n_rows, dim);
    if (n == 0) return;
    if (src == nullptr || dst == nullptr) throw std::invalid_argument("dspark cuda: decode_rows_cuda: null pointer");
    require_device();
    const int dev = common_device(src, dst, "decode_rows_cuda");
    if (in == Storage::F32) check_aligned(src, 4, "decode_rows_cuda", "source");
    if (in == Storage::F16 || in == Storage::BF16) check_aligned(src, 2, "decode_rows_cuda", "source");
    check_aligned(dst, elem_bytes(out), "decode_rows_cuda", "destination");
    DeviceGuard guard(dev);
    const auto s = static_cast<cudaStream_t>(stream);
    (void)cudaGetLastError();
    if (static_cast<int>(in) == static_cast<int>(out)) {  // same format: bytes as they are
        DSPARK_CK(cudaMemcpyAsync(dst, src, n * elem_bytes(out), cudaMemcpyDeviceToDevice, s),
                  "cudaMemcpyAsync (device to device)");
        return;
    }
    const unsigned grid = grid_for((n + kChunk - 1) / kChunk, dev);  // a thread per 4 elements
    switch (out) {
        case ElemType::F32: launch_decode_out<E_F32>(static_cast<int>(in), src, dst, n, grid, s); break;
        case ElemType::F16: launch_decode_out<E_F16>(static_cast<int>(in), src, dst, n, grid, s); break;
        case ElemType::BF16: launch_decode_out<E_BF16>(static_cast<int>(in), src, dst, n, grid, s); break;
    }
    DSPARK_CK(cudaGetLastError(), std::string("launching the ") + storage_name(in) + " decode kernel");
}

void cuda_stream_synchronize(void* stream, int device) {
    require_device();
    std::optional<DeviceGuard> guard;
    if (device >= 0) guard.emplace(device);
    DSPARK_CK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

void cuda_copy_to_host(void* host_dst, const void* dev_src, std::size_t n) {
    if (n == 0) return;
    require_device();
    const int dev = cuda_pointer_device(dev_src);
    if (dev < 0) throw std::invalid_argument("dspark cuda: cuda_copy_to_host: the source is not CUDA device memory");
    DeviceGuard guard(dev);
    DSPARK_CK(cudaMemcpy(host_dst, dev_src, n, cudaMemcpyDeviceToHost), "cudaMemcpy (device to host)");
}

void cuda_copy_to_device(void* dev_dst, const void* host_src, std::size_t n, void* stream) {
    if (n == 0) return;
    require_device();
    const int dev = cuda_pointer_device(dev_dst);
    if (dev < 0) throw std::invalid_argument("dspark cuda: cuda_copy_to_device: the destination is not CUDA device memory");
    DeviceGuard guard(dev);
    const auto s = static_cast<cudaStream_t>(stream);
    // Only plain pageable memory is staged before cudaMemcpyAsync returns;
    // for anything the driver knows (pinned, registered, managed) the copy is
    // asynchronous, so wait for it to keep the reuse promise.
    cudaPointerAttributes a{};
    const bool known = cudaPointerGetAttributes(&a, host_src) == cudaSuccess && a.type != cudaMemoryTypeUnregistered;
    (void)cudaGetLastError();
    DSPARK_CK(cudaMemcpyAsync(dev_dst, host_src, n, known ? cudaMemcpyDefault : cudaMemcpyHostToDevice, s),
              "cudaMemcpyAsync (host to device)");
    if (known) DSPARK_CK(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

void* cuda_alloc(std::size_t n, int device) {
    require_device();
    DeviceGuard guard(device);
    void* p = nullptr;
    DSPARK_CK(cudaMalloc(&p, n == 0 ? 1 : n), "cudaMalloc(" + std::to_string(n) + " bytes)");
    return p;
}

void cuda_release(void* p) noexcept {
    if (p == nullptr) return;
    if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
}

void cuda_copy_device(void* dst, const void* src, std::size_t n, void* stream) {
    if (n == 0) return;
    require_device();
    const int dev = common_device(src, dst, "cuda_copy_device");
    DeviceGuard guard(dev);
    DSPARK_CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)),
              "cudaMemcpyAsync (device to device)");
}

void cuda_stream_wait(void* waiter, void* producer, int device) {
    if (waiter == producer) return;
    require_device();
    std::optional<DeviceGuard> guard;
    if (device >= 0) guard.emplace(device);
    cudaEvent_t ev = nullptr;
    DSPARK_CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    cudaError_t e = cudaEventRecord(ev, static_cast<cudaStream_t>(producer));
    if (e == cudaSuccess) e = cudaStreamWaitEvent(static_cast<cudaStream_t>(waiter), ev, 0);
    (void)cudaEventDestroy(ev);
    DSPARK_CK(e, "ordering streams (cudaEventRecord / cudaStreamWaitEvent)");
}

}  // namespace dspark
