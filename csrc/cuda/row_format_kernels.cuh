// The row-format CUDA kernels and their per-format launch dispatch.
//
// Included by row_format_cuda.cu (nvcc) and, as plain C++, by the host test
// csrc/tests/test_cuda_kernels.cpp and the DSPARK_CUDA=EMULATE build, which
// first include csrc/tests/cuda_emulation/kernel_emulation.hpp: a host model of the
// execution subset these kernels use (grid-stride indexing, warp ballot /
// shuffles / __ffs, atomicMin; no shared memory, no __syncthreads). So the
// tests run this very source, lanes in lock step, against the CPU bytes.
// Keep the kernels inside that subset; anything else will not compile there.
//
// Exactness: all float arithmetic goes through block_math.cuh (see there).
//
// Launch shape: one launch per contiguous run of rows (n_rows * dim elements;
// rows and q blocks are contiguous, so a run is a flat array of elements or
// of 32-element blocks). Element kernels take 4 elements a thread (vector
// accesses where aligned); the quantizers 8 lanes per block (a lane owns 4 consecutive elements: one
// vector load, a 3-step shuffle reduction for the block's scale). Every loop
// over work is grid-stride, so any grid size gives the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "block_math.cuh"

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#elif !defined(DSPARK_CUDA_EMULATION)
#error "row_format_kernels.cuh needs nvcc or csrc/tests/cuda_emulation/kernel_emulation.hpp"
#endif

namespace dspark {
namespace kernels {

using namespace bm;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 256;  // threads per block (8 warps)

// ------------------------------------------------------ vector access ---
//
// Every kernel works on chunks of 4 consecutive elements (i % 4 == 0): one
// 16-byte (f32) or 8-byte (f16 / bf16) access a thread where the run's base
// address allows it, so a warp moves 256-512 contiguous bytes per
// instruction (enough bytes in flight to approach HBM bandwidth); element by
// element otherwise. The host emulation runs the same code (vector types
// from kernel_emulation.hpp, accessed through memcpy).

constexpr int kChunk = 4;  // elements per thread per step

template <class V>
__device__ __forceinline__ V vload(const void* p, std::size_t idx) {
#if defined(__CUDACC__)
    return static_cast<const V*>(p)[idx];
#else
    const char* a = static_cast<const char*>(p) + idx * sizeof(V);
    V v{};
    if (::dspark_emu::check_vector_access(a, alignof(V))) std::memcpy(&v, a, sizeof(V));
    return v;
#endif
}

template <class V>
__device__ __forceinline__ void vstore(void* p, std::size_t idx, const V& v) {
#if defined(__CUDACC__)
    static_cast<V*>(p)[idx] = v;
#else
    char* a = static_cast<char*>(p) + idx * sizeof(V);
    if (::dspark_emu::check_vector_access(a, alignof(V))) std::memcpy(a, &v, sizeof(V));
#endif
}

// Whether chunk accesses of element type `et` at `p` can be vector accesses.
__device__ __forceinline__ bool vec_ok(const void* p, int et) {
    return (reinterpret_cast<std::uintptr_t>(p) & (et == E_F32 ? 15u : 7u)) == 0;
}

// Elements i .. i+3 of a run of type `et`, widened exactly to f32.
__device__ __forceinline__ void load4(const void* __restrict__ src, int et, std::size_t i, float v[4]) {
    if (vec_ok(src, et)) {
        if (et == E_F32) {
            const float4 q = vload<float4>(src, i / 4);
            v[0] = q.x;
            v[1] = q.y;
            v[2] = q.z;
            v[3] = q.w;
        } else {
            const uint2 q = vload<uint2>(src, i / 4);
            const std::uint32_t w[2] = {q.x, q.y};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const auto h = static_cast<std::uint16_t>(w[k / 2] >> (16 * (k % 2)));
                v[k] = et == E_F16 ? f16_to_f32(h) : bf16_to_f32(h);
            }
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = load_elem(src, et, i + static_cast<std::size_t>(k));
}

// Store v[0..3] as elements i .. i+3 of type `et` (one RNE step for f16 / bf16).
__device__ __forceinline__ void store4(void* __restrict__ dst, int et, std::size_t i, const float v[4]) {
    if (vec_ok(dst, et)) {
        if (et == E_F32) {
            vstore(dst, i / 4, float4{v[0], v[1], v[2], v[3]});
        } else {
            std::uint32_t h[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) h[k] = et == E_F16 ? f32_to_f16(v[k]) : f32_to_bf16(v[k]);
            vstore(dst, i / 4, uint2{h[0] | (h[1] << 16), h[2] | (h[3] << 16)});
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) store_elem(dst, et, i + static_cast<std::size_t>(k), v[k]);
}

// Elements i .. i+3 copied bit for bit (element type `et`).
__device__ __forceinline__ void copy4(const void* __restrict__ src, void* __restrict__ dst, int et, std::size_t i) {
    if (et == E_F32 && vec_ok(src, et) && vec_ok(dst, et)) {
        vstore(dst, i / 4, vload<uint4>(src, i / 4));
    } else if (et != E_F32 && vec_ok(src, et) && vec_ok(dst, et)) {
        vstore(dst, i / 4, vload<uint2>(src, i / 4));
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (et == E_F32)
                static_cast<std::uint32_t*>(dst)[i + k] = static_cast<const std::uint32_t*>(src)[i + k];
            else
                static_cast<std::uint16_t*>(dst)[i + k] = static_cast<const std::uint16_t*>(src)[i + k];
        }
    }
}

// Thread index and stride of a grid-stride loop over chunks.
__device__ __forceinline__ std::size_t global_thread() {
    return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::size_t grid_threads() { return static_cast<std::size_t>(gridDim.x) * blockDim.x; }

// ---------------------------------------------------------------- kernels ---

// f32 / f16 / bf16 -> f32 / f16 / bf16 storage, a chunk of 4 elements a
// thread per step. Same type under NF_ERROR is a raw copy (as the CPU's
// memcpy: even a signalling NaN keeps its bits).
template <int IN, int OUT>
__device__ __forceinline__ void encode_elem(const void* __restrict__ src, void* __restrict__ dst, std::size_t i,
                                            int policy, std::uint32_t limit, unsigned long long* __restrict__ bad) {
    float v = load_elem(src, IN, i);
    if (policy == NF_ERROR) {
        if (bad != nullptr && beyond(v, limit)) atomicMin(bad, static_cast<unsigned long long>(i));
        if (IN == OUT) {
            if (IN == E_F32)
                static_cast<std::uint32_t*>(dst)[i] = static_cast<const std::uint32_t*>(src)[i];
            else
                static_cast<std::uint16_t*>(dst)[i] = static_cast<const std::uint16_t*>(src)[i];
            return;
        }
    } else {
        v = apply_policy(v, policy, limit);
    }
    store_elem(dst, OUT, i, v);
}

// Elements i .. i+3 (i % 4 == 0) of a run, as encode_elem does each of them
// (the run kernel below and the batch kernels of row_batch_kernels.cuh).
template <int IN, int OUT>
__device__ __forceinline__ void encode4(const void* __restrict__ src, void* __restrict__ dst, std::size_t i,
                                        int policy, std::uint32_t limit, unsigned long long* __restrict__ bad) {
    float v[4];
    load4(src, IN, i, v);
    if (policy == NF_ERROR) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
            if (bad != nullptr && beyond(v[k], limit)) {  // the chunk's first; atomicMin keeps the run's
                atomicMin(bad, static_cast<unsigned long long>(i + static_cast<std::size_t>(k)));
                break;
            }
        if (IN == OUT) {
            copy4(src, dst, IN, i);
            return;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = apply_policy(v[k], policy, limit);
    }
    store4(dst, OUT, i, v);
}

template <int IN, int OUT>
__global__ void __launch_bounds__(kThreads) k_encode_float(const void* __restrict__ src, void* __restrict__ dst,
                                                           std::size_t n, int policy, std::uint32_t limit,
                                                           unsigned long long* __restrict__ bad) {
    const std::size_t full = n / kChunk;  // whole chunks; the n % 4 tail goes element by element
    for (std::size_t c = global_thread(); c < full; c += grid_threads())
        encode4<IN, OUT>(src, dst, c * kChunk, policy, limit, bad);
    const std::size_t t = global_thread();
    if (t < n - full * kChunk) encode_elem<IN, OUT>(src, dst, full * kChunk + t, policy, limit, bad);
}

// Elements per lane in the quantizers: a lane owns 4 consecutive elements of
// a block, 8 lanes (a "group") own one 32-element block, a warp 4 blocks. So
// a warp reads 512 contiguous bytes of f32 per step with one 16-byte load a
// lane, and the per-block scalar work (the two IEEE divisions of the
// scales) is repeated by 8 lanes, not 32.
constexpr int kElemsPerLane = 4;
constexpr int kLanesPerBlock = QK / kElemsPerLane;  // 8
constexpr int kBlocksPerWarp = 32 / kLanesPerBlock;  // 4

// One quantizer step of a warp: its lane `lane` owns elements i .. i+3 of
// `src` (8 lanes a 32-element block, the block's bytes at `blk`). Every lane
// of the warp calls this together (the shuffles need all 32); a lane that is
// not `live` (past the last block, or a skipped row) feeds neutral values and
// writes nothing. Under NF_ERROR the lane's first unencodable element is
// reported to `bad` (when not null) as index i + k.
template <int IN, int Q>
__device__ __forceinline__ void quantize4(const void* __restrict__ src, std::size_t i, std::uint8_t* __restrict__ blk,
                                          bool live, int lane, int policy, std::uint32_t limit,
                                          unsigned long long* __restrict__ bad) {
    const int t = lane % kLanesPerBlock;                       // which 4 elements of the block
    const int group_base = lane / kLanesPerBlock * kLanesPerBlock;  // the block's first lane
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (live) load4(src, IN, i, v);
    // Per lane: the policy, the first non-finite (for the flag) and the
    // first NaN (fully unrolled, so v stays in registers).
    int first_bad = -1;
    bool has_nan = false;
    float my_nan = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        if (policy == NF_ERROR) {
            if (first_bad < 0 && beyond(v[k], limit)) first_bad = k;
        } else {
            v[k] = apply_policy(v[k], policy, limit);
        }
        if (!has_nan && is_nan(v[k])) {
            has_nan = true;
            my_nan = v[k];
        }
    }
    // The lane's first non-finite; atomicMin keeps the run's first.
    if (first_bad >= 0 && bad != nullptr && live)
        atomicMin(bad, static_cast<unsigned long long>(i + static_cast<std::size_t>(first_bad)));
    // The block's first NaN: the first NaN of its lowest lane holding one.
    const unsigned nan_lanes = (__ballot_sync(kFull, has_nan) >> group_base) & 0xffu;
    const int nan_src = nan_lanes != 0u ? group_base + __ffs(static_cast<int>(nan_lanes)) - 1 : lane;
    const float block_nan = __shfl_sync(kFull, my_nan, nan_src);
    if (Q == S_Q8_0) {
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) amax = q8_amax_combine(amax, abs_f(v[k]));
#pragma unroll
        for (int o = kLanesPerBlock / 2; o > 0; o >>= 1)
            amax = q8_amax_combine(amax, __shfl_xor_sync(kFull, amax, o));
        if (nan_lanes != 0u) amax = abs_f(block_nan);
        const Scales s = q8_scales(amax);
        if (live) {
#pragma unroll
            for (int k = 0; k < 4; ++k) blk[2 + t * 4 + k] = q8_quant(v[k], s.id);
            if (t == 0) {
                const std::uint16_t dh = f32_to_f16(s.d);
                blk[0] = static_cast<std::uint8_t>(dh & 0xff);
                blk[1] = static_cast<std::uint8_t>(dh >> 8);
            }
        }
    } else {
        // First element of largest magnitude: (|x|, index in block, x),
        // ties to the lower index.
        ArgMax p{abs_f(v[0]), t * 4};
        float pv = v[0];
#pragma unroll
        for (int k = 1; k < 4; ++k)
            if (abs_f(v[k]) > p.a) {
                p = ArgMax{abs_f(v[k]), t * 4 + k};
                pv = v[k];
            }
#pragma unroll
        for (int o = kLanesPerBlock / 2; o > 0; o >>= 1) {
            const ArgMax q{__shfl_xor_sync(kFull, p.a, o), __shfl_xor_sync(kFull, p.j, o)};
            const float qv = __shfl_xor_sync(kFull, pv, o);
            const ArgMax w = q4_argmax_combine(p, q);
            pv = w.j == p.j ? pv : qv;
            p = w;
        }
        const float max = nan_lanes != 0u ? block_nan : (p.a == 0.0f ? 0.0f : pv);
        const Scales s = q4_scales(max);
        // Four nibbles a lane, one per byte; lane t < 4 holds elements
        // 4t..4t+3, lane t + 4 the high halves 16+4t..16+4t+3.
        std::uint32_t q = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) q |= q4_quant(v[k], s.id) << (8 * k);
        const std::uint32_t hi = __shfl_down_sync(kFull, q, kLanesPerBlock / 2);
        if (live && t < kLanesPerBlock / 2) {
#pragma unroll
            for (int k = 0; k < 4; ++k)
                blk[2 + t * 4 + k] = static_cast<std::uint8_t>(((q >> (8 * k)) & 0xfu) | (((hi >> (8 * k)) & 0xfu) << 4));
            if (t == 0) {
                const std::uint16_t dh = f32_to_f16(s.d);
                blk[0] = static_cast<std::uint8_t>(dh & 0xff);
                blk[1] = static_cast<std::uint8_t>(dh >> 8);
            }
        }
    }
}

// f32 / f16 / bf16 -> q8_0 / q4_0: 8 lanes per 32-element block (see above).
//
// Every warp collective below is executed by all 32 lanes on every step,
// whatever the data (lanes past the last block feed neutral values), so the
// full-mask shuffles are well defined; a block's NaN case is selected after.
template <int IN, int Q>
__global__ void __launch_bounds__(kThreads) k_quantize(const void* __restrict__ src, std::uint8_t* __restrict__ dst,
                                                       std::size_t n_blocks, int policy, std::uint32_t limit,
                                                       unsigned long long* __restrict__ bad) {
    const int lane = static_cast<int>(threadIdx.x & 31u);
    const int group = lane / kLanesPerBlock;  // which of the warp's 4 blocks
    const int t = lane % kLanesPerBlock;      // which 4 elements of it
    const std::size_t warp = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const std::size_t n_warps = (static_cast<std::size_t>(gridDim.x) * blockDim.x) >> 5;
    for (std::size_t b0 = warp * kBlocksPerWarp; b0 < n_blocks; b0 += n_warps * kBlocksPerWarp) {  // warp-uniform
        const std::size_t b = b0 + static_cast<std::size_t>(group);
        quantize4<IN, Q>(src, b * QK + static_cast<std::size_t>(t * kElemsPerLane),
                         dst + b * (Q == S_Q8_0 ? Q8_BLOCK : Q4_BLOCK), b < n_blocks, lane, policy, limit, bad);
    }
}

// q8_0 / q4_0 -> f32 / f16 / bf16: a chunk of 4 elements a thread per step
// (a chunk never straddles a 32-element block).
template <int Q>
__device__ __forceinline__ float dequant_elem(const std::uint8_t* __restrict__ src, std::size_t i) {
    const std::uint8_t* blk = src + (i / QK) * (Q == S_Q8_0 ? Q8_BLOCK : Q4_BLOCK);
    const int j = static_cast<int>(i % QK);
    const float d = block_scale(blk);
    return Q == S_Q8_0 ? q8_dequant(blk, d, j) : q4_dequant(blk, d, j);
}

// Elements i .. i+3 (i % 4 == 0) of a run of q blocks, dequantized to f32.
template <int Q>
__device__ __forceinline__ void dequant4(const std::uint8_t* __restrict__ src, std::size_t i, float v[4]) {
    const std::uint8_t* blk = src + (i / QK) * (Q == S_Q8_0 ? Q8_BLOCK : Q4_BLOCK);
    const int j = static_cast<int>(i % QK);
    const float d = block_scale(blk);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = Q == S_Q8_0 ? q8_dequant(blk, d, j + k) : q4_dequant(blk, d, j + k);
}

template <int Q, int OUT>
__global__ void __launch_bounds__(kThreads) k_dequantize(const std::uint8_t* __restrict__ src, void* __restrict__ dst,
                                                         std::size_t n) {
    const std::size_t full = n / kChunk;  // n is whole blocks, so whole chunks
    for (std::size_t c = global_thread(); c < full; c += grid_threads()) {
        float v[4];
        dequant4<Q>(src, c * kChunk, v);
        store4(dst, OUT, c * kChunk, v);
    }
    const std::size_t t = global_thread();
    if (t < n - full * kChunk) store_elem(dst, OUT, full * kChunk + t, dequant_elem<Q>(src, full * kChunk + t));
}

// f32 / f16 / bf16 storage -> another float type: widen exactly, one RNE step.
template <int IN, int OUT>
__global__ void __launch_bounds__(kThreads) k_decode_float(const void* __restrict__ src, void* __restrict__ dst,
                                                           std::size_t n) {
    const std::size_t full = n / kChunk;
    for (std::size_t c = global_thread(); c < full; c += grid_threads()) {
        float v[4];
        load4(src, IN, c * kChunk, v);
        store4(dst, OUT, c * kChunk, v);
    }
    const std::size_t t = global_thread();
    if (t < n - full * kChunk) store_elem(dst, OUT, full * kChunk + t, load_elem(src, IN, full * kChunk + t));
}

// ---------------------------------------------------------------- launch ---

// kernel<<<grid, kThreads, 0, stream>>>(args...) on the device; the host
// emulation runs the same kernel body thread by thread (or, while `stream`
// is being captured into a graph, records it with its arguments).
template <class... P, class... A>
void launch(void (*kernel)(P...), unsigned grid, cudaStream_t stream, A... args) {
#if defined(__CUDACC__)
    kernel<<<grid, kThreads, 0, stream>>>(args...);
#else
    ::dspark_emu::launch_on(stream, grid, kThreads, [=] { kernel(args...); });
#endif
}

// Encode a run of n elements of type IN into storage `out` (a Storage code).
// grid_e sizes the element kernels, grid_q the quantizers (8 lanes per block).
// `limit` (bits; 0: the storage's own, limit_bits(out)) is what the policy
// and the flag hold values to: encode_bounds(out, staged).limit, never above
// the storage's own.
template <int IN>
void launch_encode_in(int out, const void* src, void* dst, std::size_t n, int policy, unsigned long long* bad,
                      unsigned grid_e, unsigned grid_q, cudaStream_t s, std::uint32_t limit = 0) {
    auto* d8 = static_cast<std::uint8_t*>(dst);
    const std::uint32_t own = limit_bits(out);
    const std::uint32_t lim = limit != 0 && limit < own ? limit : own;  // positive floats order as their bits
    switch (out) {
        case S_F32: launch(k_encode_float<IN, E_F32>, grid_e, s, src, dst, n, policy, lim, bad); break;
        case S_F16: launch(k_encode_float<IN, E_F16>, grid_e, s, src, dst, n, policy, lim, bad); break;
        case S_BF16: launch(k_encode_float<IN, E_BF16>, grid_e, s, src, dst, n, policy, lim, bad); break;
        case S_Q8_0: launch(k_quantize<IN, S_Q8_0>, grid_q, s, src, d8, n / QK, policy, lim, bad); break;
        case S_Q4_0: launch(k_quantize<IN, S_Q4_0>, grid_q, s, src, d8, n / QK, policy, lim, bad); break;
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
