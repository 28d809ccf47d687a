// The row-format CUDA kernels and their per-format launch dispatch.
//
// Included by row_format_cuda.cu (nvcc) and, as plain C++, by the host test
// csrc/tests/test_cuda_kernels.cpp and the DSPARK_CUDA=EMULATE build, which
// first include csrc/cuda/emulated/kernel_emulation.hpp: a host model of the
// execution subset these kernels use (grid-stride indexing, warp ballot /
// shuffles / __ffs, atomicMin; no shared memory, no __syncthreads). So the
// tests run this very source, lanes in lock step, against the CPU bytes.
// Keep the kernels inside that subset; anything else will not compile there.
//
// Exactness: all float arithmetic goes through block_math.cuh (see there).
//
// Launch shape: one launch per contiguous run of rows (n_rows * dim elements;
// rows and q blocks are contiguous, so a run is a flat array of elements or
// of 32-element blocks). Element kernels use one thread per element; the
// quantizers one warp per block (lane j owns element j: coalesced loads,
// a 5-step shuffle reduction for the block's scale, coalesced stores). Every
// loop over work is grid-stride, so any grid size gives the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "block_math.cuh"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#elif !defined(DSPARK_CUDA_EMULATION)
#error "row_format_kernels.cuh needs nvcc or csrc/cuda/emulated/kernel_emulation.hpp"
#endif

namespace dspark {
namespace kernels {

using namespace bm;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 256;  // threads per block (8 warps)

// ---------------------------------------------------------------- kernels ---

// f32 / f16 / bf16 -> f32 / f16 / bf16 storage. Same type under NF_ERROR is a
// raw copy (as the CPU's memcpy: even a signalling NaN keeps its bits).
template <int IN, int OUT>
__global__ void __launch_bounds__(kThreads) k_encode_float(const void* __restrict__ src, void* __restrict__ dst,
                                                           std::size_t n, int policy,
                                                           unsigned long long* __restrict__ bad) {
    const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = load_elem(src, IN, i);
        if (policy == NF_ERROR) {
            if (bad != nullptr && is_nonfinite(v)) atomicMin(bad, static_cast<unsigned long long>(i));
            if (IN == OUT) {
                if (IN == E_F32)
                    static_cast<std::uint32_t*>(dst)[i] = static_cast<const std::uint32_t*>(src)[i];
                else
                    static_cast<std::uint16_t*>(dst)[i] = static_cast<const std::uint16_t*>(src)[i];
                continue;
            }
        } else {
            v = apply_policy(v, policy);
        }
        store_elem(dst, OUT, i, v);
    }
}

// f32 / f16 / bf16 -> q8_0 / q4_0: one warp per 32-element block.
template <int IN, int Q>
__global__ void __launch_bounds__(kThreads) k_quantize(const void* __restrict__ src, std::uint8_t* __restrict__ dst,
                                                       std::size_t n_blocks, int policy,
                                                       unsigned long long* __restrict__ bad) {
    const int lane = static_cast<int>(threadIdx.x & 31u);
    const std::size_t warp = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const std::size_t n_warps = (static_cast<std::size_t>(gridDim.x) * blockDim.x) >> 5;
    for (std::size_t b = warp; b < n_blocks; b += n_warps) {  // warp-uniform loop
        const std::size_t i = b * bm::QK + static_cast<std::size_t>(lane);
        float v = load_elem(src, IN, i);
        if (policy == NF_ERROR) {
            const unsigned m = __ballot_sync(kFull, is_nonfinite(v));
            if (m != 0u && bad != nullptr && lane == __ffs(m) - 1)
                atomicMin(bad, static_cast<unsigned long long>(i));
        } else {
            v = apply_policy(v, policy);
        }
        const unsigned nan_lanes = __ballot_sync(kFull, is_nan(v));
        if (Q == S_Q8_0) {
            float amax;
            if (nan_lanes != 0u) {
                amax = abs_f(__shfl_sync(kFull, v, __ffs(nan_lanes) - 1));
            } else {
                amax = abs_f(v);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) amax = q8_amax_combine(amax, __shfl_xor_sync(kFull, amax, o));
            }
            const Scales s = q8_scales(amax);
            std::uint8_t* blk = dst + b * Q8_BLOCK;
            blk[2 + lane] = q8_quant(v, s.id);
            if (lane == 0) {
                const std::uint16_t dh = f32_to_f16(s.d);
                blk[0] = static_cast<std::uint8_t>(dh & 0xff);
                blk[1] = static_cast<std::uint8_t>(dh >> 8);
            }
        } else {
            float max;
            if (nan_lanes != 0u) {
                max = __shfl_sync(kFull, v, __ffs(nan_lanes) - 1);
            } else {
                ArgMax p{abs_f(v), lane};
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const ArgMax q{__shfl_xor_sync(kFull, p.a, o), __shfl_xor_sync(kFull, p.j, o)};
                    p = q4_argmax_combine(p, q);
                }
                const float w = __shfl_sync(kFull, v, p.j);
                max = p.a == 0.0f ? 0.0f : w;
            }
            const Scales s = q4_scales(max);
            const std::uint32_t q = q4_quant(v, s.id);
            const std::uint32_t hi = __shfl_down_sync(kFull, q, 16);
            std::uint8_t* blk = dst + b * Q4_BLOCK;
            if (lane < bm::QK / 2) blk[2 + lane] = static_cast<std::uint8_t>(q | (hi << 4));
            if (lane == 0) {
                const std::uint16_t dh = f32_to_f16(s.d);
                blk[0] = static_cast<std::uint8_t>(dh & 0xff);
                blk[1] = static_cast<std::uint8_t>(dh >> 8);
            }
        }
    }
}

// q8_0 / q4_0 -> f32 / f16 / bf16: one thread per element.
template <int Q, int OUT>
__global__ void __launch_bounds__(kThreads) k_dequantize(const std::uint8_t* __restrict__ src, void* __restrict__ dst,
                                                         std::size_t n) {
    const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const std::size_t b = i / bm::QK;
        const int j = static_cast<int>(i % bm::QK);
        const std::uint8_t* blk = src + b * (Q == S_Q8_0 ? Q8_BLOCK : Q4_BLOCK);
        const float d = block_scale(blk);
        const float v = Q == S_Q8_0 ? q8_dequant(blk, d, j) : q4_dequant(blk, d, j);
        store_elem(dst, OUT, i, v);
    }
}

// f32 / f16 / bf16 storage -> another float type: widen exactly, one RNE step.
template <int IN, int OUT>
__global__ void __launch_bounds__(kThreads) k_decode_float(const void* __restrict__ src, void* __restrict__ dst,
                                                           std::size_t n) {
    const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
        store_elem(dst, OUT, i, load_elem(src, IN, i));
}

// ---------------------------------------------------------------- launch ---

// kernel<<<grid, kThreads, 0, stream>>>(args...) on the device; the host
// emulation runs the same kernel body thread by thread.
template <class... P, class... A>
void launch(void (*kernel)(P...), unsigned grid, cudaStream_t stream, A... args) {
#if defined(__CUDACC__)
    kernel<<<grid, kThreads, 0, stream>>>(args...);
#else
    (void)stream;
    ::dspark_emu::launch(grid, kThreads, [&] { kernel(args...); });
#endif
}

// Encode a run of n elements of type IN into storage `out` (a Storage code).
// grid_e sizes the element kernels, grid_q the quantizers (a warp per block).
template <int IN>
void launch_encode_in(int out, const void* src, void* dst, std::size_t n, int policy, unsigned long long* bad,
                      unsigned grid_e, unsigned grid_q, cudaStream_t s) {
    auto* d8 = static_cast<std::uint8_t*>(dst);
    switch (out) {
        case S_F32: launch(k_encode_float<IN, E_F32>, grid_e, s, src, dst, n, policy, bad); break;
        case S_F16: launch(k_encode_float<IN, E_F16>, grid_e, s, src, dst, n, policy, bad); break;
        case S_BF16: launch(k_encode_float<IN, E_BF16>, grid_e, s, src, dst, n, policy, bad); break;
        case S_Q8_0: launch(k_quantize<IN, S_Q8_0>, grid_q, s, src, d8, n / QK, policy, bad); break;
        case S_Q4_0: launch(k_quantize<IN, S_Q4_0>, grid_q, s, src, d8, n / QK, policy, bad); break;
        default: break;
    }
}

// Decode a run of n elements stored as `in` (a Storage code other than OUT's
// own format: the caller copies bytes for that) into element type OUT.
template <int OUT>
void launch_decode_out(int in, const void* src, void* dst, std::size_t n, unsigned grid, cudaStream_t s) {
    const auto* s8 = static_cast<const std::uint8_t*>(src);
    switch (in) {
        case S_F32: launch(k_decode_float<E_F32, OUT>, grid, s, src, dst, n); break;
        case S_F16: launch(k_decode_float<E_F16, OUT>, grid, s, src, dst, n); break;
        case S_BF16: launch(k_decode_float<E_BF16, OUT>, grid, s, src, dst, n); break;
        case S_Q8_0: launch(k_dequantize<S_Q8_0, OUT>, grid, s, s8, dst, n); break;
        case S_Q4_0: launch(k_dequantize<S_Q4_0, OUT>, grid, s, s8, dst, n); break;
        default: break;
    }
}

}  // namespace kernels
}  // namespace dspark
