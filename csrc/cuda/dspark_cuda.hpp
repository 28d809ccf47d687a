// CUDA row conversion: quantize / dequantize contiguous runs of rows on the
// GPU, byte for byte what the CPU path (dspark/row_format.hpp) produces.
//
// This header does not include cuda_runtime.h (streams are `void*`, a
// cudaStream_t; nullptr is the legacy default stream), so it can be used from
// code built by a plain C++ compiler (the Cython binding). The functions live
// in the static library `dspark_cuda` (CMake option DSPARK_CUDA), which links
// the CUDA runtime statically: on a machine without a GPU or driver,
// cuda_device_count() is 0 and every conversion throws std::runtime_error.
//
// Errors are exceptions, never aborts: bad arguments throw what the CPU API
// throws (ConfigError / TypeError / std::invalid_argument, see errors.hpp);
// pointers that are not device memory, or on different devices, throw
// std::invalid_argument; CUDA failures (no device, launch errors, bad stream)
// throw std::runtime_error carrying cudaGetErrorName / cudaGetErrorString.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "dspark/row_format.hpp"

namespace dspark {

// Number of CUDA devices; 0 (not an error) when there is no GPU, no driver,
// or the driver is too old for this runtime. Never throws.
int cuda_device_count() noexcept;

// Why cuda_device_count() is 0 ("" when it is not): the CUDA error name and
// string (e.g. "cudaErrorNoDevice: no CUDA-capable device is detected").
std::string cuda_unavailable_reason();

// CUDA runtime version this library was built with and the driver's
// version (0 when no driver), as 1000 * major + 10 * minor.
int cuda_runtime_version() noexcept;
int cuda_driver_version() noexcept;

// Device ordinal the memory at `p` lives on: >= 0 for device (or managed)
// memory, -1 for host memory (pageable or pinned) or an unknown pointer.
int cuda_pointer_device(const void* p);

// True in a DSPARK_CUDA=EMULATE build: the "devices" are host memory and
// the kernels run on the CPU under the warp model (csrc/tests/cuda_emulation/).
bool cuda_is_emulated() noexcept;

// "NVIDIA H100 80GB HBM3 (sm_90)"-style description of device `dev`.
std::string cuda_device_name(int dev);

// Encode n_rows contiguous rows (`dim` elements of type `in` each, on the
// device) into `dst` (device, row_bytes(out, dim) bytes a row): one kernel
// launch for the whole run, enqueued on `stream` on the device that owns
// `src` (which must also own `dst`).
//
// Policies as encode_rows() with bounds encode_bounds(out, staged): rows
// that will be staged as a narrower type (`staged`, e.g. f32 storage staged
// as f16) are held to that type's limit too, exactly as a Stager's process()
// holds them. Under NonFinite::Error with report_nonfinite, the flat index of
// the first input that cannot be staged (non-finite, or |x| >= the limit; or
// -1) is copied back, which synchronizes `stream`; with report_nonfinite
// false (or another policy) nothing is copied back, the call returns -1 at
// once and the conversion is asynchronous with respect to the host.
std::int64_t encode_rows_cuda(const void* src, ElemType in, void* dst, Storage out, std::size_t n_rows,
                              std::size_t dim, NonFinite policy, void* stream, bool report_nonfinite = true,
                              ElemType staged = ElemType::F32);

// Decode n_rows rows stored as `in` (device) into `dst` (device, element type
// `out`): exact to f32, then one RNE step to f16 / bf16; same format in and
// out is a device-to-device copy. One launch, asynchronous on `stream`.
void decode_rows_cuda(const void* src, Storage in, void* dst, ElemType out, std::size_t n_rows, std::size_t dim,
                      void* stream);

// Small helpers for the binding and the tests. `device` (>= 0) is made
// current for the call, since the stream handles 0 / 1 / 2 name the
// legacy / per-thread default stream of the current device; -1 keeps the
// caller's current device.
void cuda_stream_synchronize(void* stream, int device);
// Copy `n` bytes from device memory to host memory (synchronous; on the
// legacy default stream of the device owning `dev_src`).
void cuda_copy_to_host(void* host_dst, const void* dev_src, std::size_t n);
// Copy `n` bytes of host memory to the device, ordered on `stream`. The host
// buffer may be reused as soon as the call returns (pageable memory is staged
// before it returns; pinned, registered or managed memory is waited for).
void cuda_copy_to_device(void* dev_dst, const void* host_src, std::size_t n, void* stream);
// Plain device memory for callers without an array library: cudaMalloc on
// `device` (throws std::runtime_error, e.g. out of memory) / cudaFree
// (never throws; nullptr is a no-op).
void* cuda_alloc(std::size_t n, int device);
void cuda_release(void* p) noexcept;
// Device-to-device copy of `n` bytes on `stream` (asynchronous).
void cuda_copy_device(void* dst, const void* src, std::size_t n, void* stream);
// Make `waiter` wait (on the device) for the work enqueued so far on
// `producer`; both are streams of `device` (see above).
void cuda_stream_wait(void* waiter, void* producer, int device);

}  // namespace dspark
