// An emulated CUDA runtime: the subset of the CUDA runtime API that
// csrc/cuda/*.cu call, over host memory, so that the whole
// CUDA path (host code, kernels through kernel_emulation.hpp, the `_cuda`
// extension and dspark_core.cuda) builds and runs on a machine without a GPU.
//
// Built only with DSPARK_CUDA=EMULATE (tests and CI; never a release build):
// this directory is put first on the include path, so row_format_cuda.cu's
// `#include <cuda_runtime.h>` finds this file.
//
// The model:
//  * DSPARK_CUDA_EMULATED_DEVICES devices (default 2, so the wrong-device
//    checks run; 0 models a machine without a GPU: cudaErrorNoDevice);
//  * "device memory" is host memory from cudaMalloc / cudaMallocAsync,
//    recorded with its device; cudaPointerGetAttributes reports it as
//    cudaMemoryTypeDevice and anything else as cudaMemoryTypeUnregistered
//    (what CUDA >= 11 says of pageable host memory);
//  * copies (2-D, strided ones too) and memsets check that their device side
//    lies inside a live allocation (cudaErrorInvalidValue otherwise, as a GPU
//    would fault);
//  * every operation runs at once, in call order, whatever the stream: a
//    valid schedule of any stream-ordered program, so ordering bugs between
//    streams are NOT detectable here;
//  * streams are handles only (cudaStreamCreateWithFlags); a stream can be
//    captured into a graph and the graph launched (kernel_emulation.hpp's
//    Capture: launches, device-to-device copies and memsets are recorded;
//    synchronizations, allocations and host transfers during a capture fail
//    with cudaErrorStreamCaptureUnsupported and invalidate it);
//  * errors are reported CUDA-style: returned, and kept for cudaGetLastError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernel_emulation.hpp"

enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorIllegalState = 401,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
};

enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
};
constexpr unsigned cudaStreamNonBlocking = 1;

enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3,
};

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

struct cudaPointerAttributes {
    cudaMemoryType type;
    int device;
    void* devicePointer;
    void* hostPointer;
};

struct cudaDeviceProp {
    char name[256];
    int major;
    int minor;
    int multiProcessorCount;
};

struct dspark_emu_event {};
using cudaEvent_t = dspark_emu_event*;
struct dspark_emu_stream {
    int device;
};
// A captured graph and its executable form: the recorded operations, in order.
struct dspark_emu_graph {
    std::vector<std::function<void()>> ops;
};
using cudaGraph_t = dspark_emu_graph*;
using cudaGraphExec_t = dspark_emu_graph*;
constexpr unsigned cudaEventDisableTiming = 2;

namespace dspark_emu {

// Emulated "SM" count: small, so that grid_for()'s cap is reached and the
// kernels' grid-stride loops run more than once on modest inputs.
constexpr int EMULATED_SMS = 2;
constexpr int EMULATED_VERSION = 13000;  // reported runtime and driver version
constexpr std::size_t ALLOC_ALIGN = 256;  // cudaMalloc's alignment

struct Runtime {
    std::mutex m;
    int devices = -1;
    std::map<std::uintptr_t, std::pair<std::size_t, int>> allocs;  // base -> (bytes, device)
};

inline Runtime& runtime() {
    static Runtime r;
    return r;
}

// The calling thread's current device and last error (per host thread, as in CUDA).
inline int& current_device() {
    static thread_local int d = 0;
    return d;
}

inline cudaError_t& last_error() {
    static thread_local cudaError_t e = cudaSuccess;
    return e;
}

inline int device_total() {
    Runtime& r = runtime();
    if (r.devices < 0) {
        const char* env = std::getenv("DSPARK_CUDA_EMULATED_DEVICES");
        r.devices = env != nullptr ? std::atoi(env) : 2;
        if (r.devices < 0) r.devices = 0;
    }
    return r.devices;
}

inline cudaError_t fail(cudaError_t e) {
    last_error() = e;
    return e;
}

// The allocation holding [p, p + n), as (device, found).
inline bool find_alloc(const void* p, std::size_t n, int* device) {
    Runtime& r = runtime();
    const auto u = reinterpret_cast<std::uintptr_t>(p);
    auto it = r.allocs.upper_bound(u);
    if (it == r.allocs.begin()) return false;
    --it;
    const std::size_t off = u - it->first, size = it->second.first;
    if (off >= size || n > size - off) return false;
    if (device != nullptr) *device = it->second.second;
    return true;
}

inline cudaError_t alloc(void** p, std::size_t n) {
    Runtime& r = runtime();
    if (p == nullptr) return fail(cudaErrorInvalidValue);
    if (device_total() == 0) return fail(cudaErrorNoDevice);
    if (n > SIZE_MAX / 2) return fail(cudaErrorMemoryAllocation);  // as a GPU would: far beyond any memory
    void* q = std::aligned_alloc(ALLOC_ALIGN, (n + ALLOC_ALIGN - 1) / ALLOC_ALIGN * ALLOC_ALIGN + ALLOC_ALIGN);
    if (q == nullptr) return fail(cudaErrorMemoryAllocation);
    r.allocs[reinterpret_cast<std::uintptr_t>(q)] = {n == 0 ? 1 : n, current_device()};
    *p = q;
    return cudaSuccess;
}

inline cudaError_t release(void* p) {
    Runtime& r = runtime();
    if (p == nullptr) return cudaSuccess;
    auto it = r.allocs.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == r.allocs.end()) return fail(cudaErrorInvalidValue);
    r.allocs.erase(it);
    std::free(p);
    return cudaSuccess;
}

inline cudaError_t copy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
    if (n == 0) return cudaSuccess;
    if (dst == nullptr || src == nullptr) return fail(cudaErrorInvalidValue);
    const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if ((dst_dev && !find_alloc(dst, n, nullptr)) || (src_dev && !find_alloc(src, n, nullptr)))
        return fail(cudaErrorInvalidValue);
    std::memmove(dst, src, n);
    return cudaSuccess;
}

}  // namespace dspark_emu

inline const char* cudaGetErrorName(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
        case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
        case cudaErrorNoDevice: return "cudaErrorNoDevice";
        case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
        case cudaErrorNotSupported: return "cudaErrorNotSupported";
        case cudaErrorIllegalState: return "cudaErrorIllegalState";
        case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
        case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    }
    return "cudaErrorUnknown";
}

inline const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
        case cudaErrorNoDevice: return "no CUDA-capable device is detected (emulated)";
        case cudaErrorInvalidDevice: return "invalid device ordinal";
        case cudaErrorNotSupported: return "operation not supported";
        case cudaErrorIllegalState: return "the operation would result in an illegal state";
        case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
        case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    }
    return "unknown error";
}

#define DSPARK_EMU_LOCK std::lock_guard<std::mutex> dspark_emu_lock_(dspark_emu::runtime().m)

inline cudaError_t cudaGetLastError() {
    const cudaError_t e = dspark_emu::last_error();
    dspark_emu::last_error() = cudaSuccess;
    return e;
}

inline cudaError_t cudaGetDeviceCount(int* n) {
    DSPARK_EMU_LOCK;
    if (n == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    *n = 0;
    if (dspark_emu::device_total() == 0) return dspark_emu::fail(cudaErrorNoDevice);
    *n = dspark_emu::device_total();
    return cudaSuccess;
}

inline cudaError_t cudaGetDevice(int* d) {
    DSPARK_EMU_LOCK;
    if (d == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    if (dspark_emu::device_total() == 0) return dspark_emu::fail(cudaErrorNoDevice);
    *d = dspark_emu::current_device();
    return cudaSuccess;
}

inline cudaError_t cudaSetDevice(int d) {
    DSPARK_EMU_LOCK;
    if (d < 0 || d >= dspark_emu::device_total()) return dspark_emu::fail(cudaErrorInvalidDevice);
    dspark_emu::current_device() = d;
    return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int d) {
    DSPARK_EMU_LOCK;
    if (v == nullptr || attr != cudaDevAttrMultiProcessorCount) return dspark_emu::fail(cudaErrorInvalidValue);
    if (d < 0 || d >= dspark_emu::device_total()) return dspark_emu::fail(cudaErrorInvalidDevice);
    *v = dspark_emu::EMULATED_SMS;
    return cudaSuccess;
}

inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
    DSPARK_EMU_LOCK;
    if (p == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    if (d < 0 || d >= dspark_emu::device_total()) return dspark_emu::fail(cudaErrorInvalidDevice);
    *p = cudaDeviceProp{};
    std::snprintf(p->name, sizeof p->name, "dspark emulated device %d (host memory)", d);
    p->major = 0;
    p->minor = 0;
    p->multiProcessorCount = dspark_emu::EMULATED_SMS;
    return cudaSuccess;
}

inline cudaError_t cudaRuntimeGetVersion(int* v) {
    if (v == nullptr) return cudaErrorInvalidValue;
    *v = dspark_emu::EMULATED_VERSION;
    return cudaSuccess;
}

inline cudaError_t cudaDriverGetVersion(int* v) {
    if (v == nullptr) return cudaErrorInvalidValue;
    *v = dspark_emu::EMULATED_VERSION;
    return cudaSuccess;
}

inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
    DSPARK_EMU_LOCK;
    if (a == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    *a = cudaPointerAttributes{cudaMemoryTypeUnregistered, -1, nullptr, const_cast<void*>(p)};
    int dev = -1;
    if (dspark_emu::find_alloc(p, 1, &dev)) *a = cudaPointerAttributes{cudaMemoryTypeDevice, dev, const_cast<void*>(p), nullptr};
    return cudaSuccess;
}

// Refuse `what` while a stream is being captured (see the header comment).
#define DSPARK_EMU_NOT_IN_CAPTURE(what) \
    if (dspark_emu::refuse_in_capture(what)) return dspark_emu::fail(cudaErrorStreamCaptureUnsupported)

inline cudaError_t cudaMalloc(void** p, std::size_t n) {
    DSPARK_EMU_LOCK;
    DSPARK_EMU_NOT_IN_CAPTURE("cudaMalloc");
    return dspark_emu::alloc(p, n);
}

inline cudaError_t cudaMallocAsync(void** p, std::size_t n, cudaStream_t) {
    DSPARK_EMU_LOCK;
    DSPARK_EMU_NOT_IN_CAPTURE("cudaMallocAsync");
    return dspark_emu::alloc(p, n);
}

inline cudaError_t cudaFree(void* p) {
    DSPARK_EMU_LOCK;
    DSPARK_EMU_NOT_IN_CAPTURE("cudaFree");
    return dspark_emu::release(p);
}

inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
    DSPARK_EMU_LOCK;
    DSPARK_EMU_NOT_IN_CAPTURE("cudaFreeAsync");
    return dspark_emu::release(p);
}

inline cudaError_t cudaMemsetAsync(void* p, int value, std::size_t n, cudaStream_t s) {
    DSPARK_EMU_LOCK;
    if (n == 0) return cudaSuccess;
    if (!dspark_emu::find_alloc(p, n, nullptr)) return dspark_emu::fail(cudaErrorInvalidValue);
    if (dspark_emu::capturing(s)) {
        dspark_emu::capture().ops.emplace_back([p, value, n] { std::memset(p, value, n); });
        return cudaSuccess;
    }
    std::memset(p, value, n);
    return cudaSuccess;
}

inline cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind) {
    DSPARK_EMU_LOCK;
    DSPARK_EMU_NOT_IN_CAPTURE("cudaMemcpy (synchronous)");
    return dspark_emu::copy(dst, src, n, kind);
}

inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t n, cudaMemcpyKind kind, cudaStream_t s) {
    DSPARK_EMU_LOCK;
    if (dspark_emu::capturing(s)) {
        if (kind != cudaMemcpyDeviceToDevice) {
            DSPARK_EMU_NOT_IN_CAPTURE("cudaMemcpyAsync from or to host memory");
        }
        if (n == 0) return cudaSuccess;
        if (!dspark_emu::find_alloc(dst, n, nullptr) || !dspark_emu::find_alloc(src, n, nullptr))
            return dspark_emu::fail(cudaErrorInvalidValue);
        dspark_emu::capture().ops.emplace_back([dst, src, n] { std::memmove(dst, src, n); });
        return cudaSuccess;
    }
    return dspark_emu::copy(dst, src, n, kind);
}

// `height` rows of `width` bytes, one pitch apart on either side (CUDA: a pitch
// below the width is cudaErrorInvalidPitchValue; here cudaErrorInvalidValue).
// Each side in device memory must lie inside one live allocation, as a whole.
inline cudaError_t cudaMemcpy2DAsync(void* dst, std::size_t dpitch, const void* src, std::size_t spitch,
                                     std::size_t width, std::size_t height, cudaMemcpyKind kind, cudaStream_t s) {
    DSPARK_EMU_LOCK;
    if (width > dpitch || width > spitch) return dspark_emu::fail(cudaErrorInvalidValue);
    if (width == 0 || height == 0) return cudaSuccess;
    if (dst == nullptr || src == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if ((dst_dev && !dspark_emu::find_alloc(dst, (height - 1) * dpitch + width, nullptr)) ||
        (src_dev && !dspark_emu::find_alloc(src, (height - 1) * spitch + width, nullptr)))
        return dspark_emu::fail(cudaErrorInvalidValue);
    auto run = [dst, dpitch, src, spitch, width, height] {
        for (std::size_t r = 0; r < height; ++r)
            std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
    };
    if (dspark_emu::capturing(s)) {
        if (kind != cudaMemcpyDeviceToDevice) {
            DSPARK_EMU_NOT_IN_CAPTURE("cudaMemcpy2DAsync from or to host memory");
        }
        dspark_emu::capture().ops.emplace_back(run);
        return cudaSuccess;
    }
    run();
    return cudaSuccess;
}

inline cudaError_t cudaStreamSynchronize(cudaStream_t) {
    DSPARK_EMU_LOCK;
    DSPARK_EMU_NOT_IN_CAPTURE("cudaStreamSynchronize");
    return cudaSuccess;
}

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
    DSPARK_EMU_LOCK;
    if (s == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    if (dspark_emu::device_total() == 0) return dspark_emu::fail(cudaErrorNoDevice);
    DSPARK_EMU_NOT_IN_CAPTURE("cudaStreamCreateWithFlags");
    *s = new dspark_emu_stream{dspark_emu::current_device()};
    return cudaSuccess;
}

inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
    DSPARK_EMU_LOCK;
    if (s == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    delete static_cast<dspark_emu_stream*>(s);
    return cudaSuccess;
}

inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
    DSPARK_EMU_LOCK;
    // The legacy default stream cannot be captured; one capture at a time here.
    if (s == nullptr) return dspark_emu::fail(cudaErrorStreamCaptureUnsupported);
    if (dspark_emu::capture().active) return dspark_emu::fail(cudaErrorIllegalState);
    dspark_emu::capture() = dspark_emu::Capture{};
    dspark_emu::capture().active = true;
    dspark_emu::capture().stream = s;
    return cudaSuccess;
}

inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
    DSPARK_EMU_LOCK;
    if (g == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    *g = nullptr;
    dspark_emu::Capture& c = dspark_emu::capture();
    if (!c.active || c.stream != s) return dspark_emu::fail(cudaErrorIllegalState);
    c.active = false;
    if (!c.error.empty()) return dspark_emu::fail(cudaErrorStreamCaptureInvalidated);
    *g = new dspark_emu_graph{std::move(c.ops)};
    c.ops.clear();
    return cudaSuccess;
}

inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* e, cudaGraph_t g, unsigned long long) {
    if (e == nullptr || g == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    *e = new dspark_emu_graph{g->ops};
    return cudaSuccess;
}

inline cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
    if (e == nullptr) return dspark_emu::fail(cudaErrorInvalidValue);
    if (dspark_emu::capturing(s)) return dspark_emu::fail(cudaErrorNotSupported);  // not modelled
    for (const auto& op : e->ops) op();
    return cudaSuccess;
}

inline cudaError_t cudaGraphDestroy(cudaGraph_t g) {
    delete g;
    return cudaSuccess;
}

inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
    delete e;
    return cudaSuccess;
}

inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
    if (e == nullptr) return cudaErrorInvalidValue;
    *e = new dspark_emu_event{};
    return cudaSuccess;
}

inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) { return e == nullptr ? cudaErrorInvalidValue : cudaSuccess; }

inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t e, unsigned) {
    return e == nullptr ? cudaErrorInvalidValue : cudaSuccess;
}

inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}

#undef DSPARK_EMU_NOT_IN_CAPTURE
#undef DSPARK_EMU_LOCK
