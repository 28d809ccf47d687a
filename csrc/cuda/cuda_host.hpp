// Host-side helpers of the CUDA library's .cu files (not installed, not part
// of the API): CUDA error translation, the device guard, argument checks and
// grid sizing. Errors are exceptions, never aborts (dspark_cuda.hpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

// The kernels first: their `using namespace bm` would make bm::QK ambiguous
// with dspark::QK (row_format.hpp) in names looked up after both are declared.
#include "row_format_kernels.cuh"
#include "dspark/errors.hpp"
#include "dspark/row_format.hpp"
#include "dspark_cuda.hpp"

namespace dspark {
namespace cuda_host {

// ------------------------------------------------------------------ host ---

[[noreturn]] inline void throw_cuda(cudaError_t e, const std::string& what) {
    throw std::runtime_error("dspark cuda: " + what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

#define DSPARK_CK(expr, what)                          \
    do {                                               \
        const cudaError_t e_ = (expr);                 \
        if (e_ != cudaSuccess) {                       \
            (void)cudaGetLastError();                  \
            throw_cuda(e_, what);                      \
        }                                              \
    } while (0)

inline void require_device() {
    if (cuda_device_count() <= 0)
        throw std::runtime_error("dspark cuda: no CUDA device available (" + cuda_unavailable_reason() + ")");
}

// Makes `dev` current for the scope, restoring the caller's device after.
class DeviceGuard {
public:
    explicit DeviceGuard(int dev) {
        DSPARK_CK(cudaGetDevice(&prev_), "cudaGetDevice");
        if (prev_ != dev) {
            DSPARK_CK(cudaSetDevice(dev), "cudaSetDevice(" + std::to_string(dev) + ")");
            changed_ = true;
        }
    }
    ~DeviceGuard() {
        if (changed_) (void)cudaSetDevice(prev_);
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;

private:
    int prev_ = 0;
    bool changed_ = false;
};

// The device owning both buffers; std::invalid_argument when either is host
// memory or they live on different devices.
inline int common_device(const void* src, const void* dst, const char* fn) {
    const int ds = cuda_pointer_device(src);
    const int dd = cuda_pointer_device(dst);
    if (ds < 0)
        throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the source is not CUDA device memory");
    if (dd < 0)
        throw std::invalid_argument(std::string("dspark cuda: ") + fn +
                                    ": the destination is not CUDA device memory");
    if (ds != dd)
        throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the source is on device " +
                                    std::to_string(ds) + " but the destination on device " + std::to_string(dd));
    return ds;
}

inline void check_aligned(const void* p, std::size_t align, const char* fn, const char* what) {
    if (reinterpret_cast<std::uintptr_t>(p) % align != 0)
        throw std::invalid_argument(std::string("dspark cuda: ") + fn + ": the " + what + " pointer is not " +
                                    std::to_string(align) + "-byte aligned");
}

inline std::size_t checked_elems(std::size_t n_rows, std::size_t dim) {
    if (dim != 0 && n_rows > std::numeric_limits<std::size_t>::max() / dim / 4)
        throw std::invalid_argument("dspark cuda: n_rows * dim overflows");
    return n_rows * dim;
}

inline void check_elem(ElemType t) {
    if (static_cast<unsigned>(t) > 2u)
        throw TypeError("dspark cuda: unknown element type code " + std::to_string(static_cast<unsigned>(t)));
}

inline unsigned grid_for(std::size_t threads, int dev) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) {
        (void)cudaGetLastError();
        sms = 80;
    }
    const std::size_t want = (threads + kernels::kThreads - 1) / kernels::kThreads;
    const std::size_t cap = static_cast<std::size_t>(sms) * 16;  // ~2 waves of 8 resident blocks; grid-stride after
    return static_cast<unsigned>(want < cap ? (want == 0 ? 1 : want) : cap);
}

}  // namespace cuda_host
}  // namespace dspark
