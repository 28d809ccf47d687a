// Index-driven row conversion: one launch moves the rows of a whole batch of
// sequences between a flat array of rows and the slots of a row table.
//
// A batch is `n_rows` rows (row r at `src + r * dim` elements, or written to
// `dst + r * dim`) and one int64 slot per row, in device memory: the table
// row it goes to or comes from. Slot -1 skips the row (padding of a
// fixed-shape batch, or a row below the horizon): a write leaves the table
// alone, a gather writes zeros. A slot outside [-1, table_rows) is a caller's
// bug the device cannot raise: the row is skipped the same way (no access
// outside the table) and the row's index is reported in the status words.
//
// Status words (2 x u64 in device memory, set to kNone before the batch):
//   [kBadValue] the first flat input index r * dim + c whose value cannot be
//               staged (check kernel: non-finite, or |x| >= the limit);
//   [kBadSlot]  the first row whose slot is outside [-1, table_rows).
// A gated write does nothing when either word is set (the check kernel ran
// before it on the same stream): a rejected batch changes nothing, without a
// host synchronization, so the pair can live in a captured CUDA graph.
//
// Work split: a unit is (row, segment of kSegment elements); a thread block
// takes a unit per step (grid-stride over units), so the row's slot is read
// once per unit and the division by the segment count happens once per block
// step. Element kernels give each thread 4 elements of the segment (vector
// accesses where the row's base is aligned, as the run kernels); the
// quantizers give each warp 4 q blocks (quantize4 of row_format_kernels.cuh).
// Rows of a q storage are whole blocks (dim % 32 == 0); rows of a float
// storage may end in a partial chunk, done element by element.
//
// The per-element and per-block work is the run kernels' own (encode4,
// quantize4, dequant4, load4 / store4 / copy4), so a batch gives byte for
// byte the bytes of the run kernels and of the CPU path.
#pragma once

#include <cstddef>
#include <cstdint>

#include "row_format_kernels.cuh"

namespace dspark {
namespace kernels {

constexpr unsigned long long kNone = ~0ull;  // a status word's value while nothing was reported
constexpr int kBadValue = 0;
constexpr int kBadSlot = 1;
constexpr int kStatusWords = 2;
constexpr std::size_t kSegment = static_cast<std::size_t>(kThreads) * kChunk;  // elements per unit (1024)

// Bytes of one element of type `et`.
__device__ __forceinline__ std::size_t elem_size(int et) { return et == E_F32 ? 4u : 2u; }

// Element i copied bit for bit (element type `et`).
__device__ __forceinline__ void copy_elem(const void* __restrict__ src, void* __restrict__ dst, int et, std::size_t i) {
    if (et == E_F32)
        static_cast<std::uint32_t*>(dst)[i] = static_cast<const std::uint32_t*>(src)[i];
    else
        static_cast<std::uint16_t*>(dst)[i] = static_cast<const std::uint16_t*>(src)[i];
}

// Units of a batch: rows x segments per row.
__device__ __forceinline__ std::size_t segments_of(std::size_t dim) { return (dim + kSegment - 1) / kSegment; }

// The table row of batch row r, or -1 to skip it. A slot outside
// [-1, table_rows) is reported (when `report`, once per row) and skipped.
__device__ __forceinline__ std::int64_t batch_slot(const std::int64_t* __restrict__ slots, std::size_t r,
                                                   std::size_t table_rows, unsigned long long* __restrict__ status,
                                                   bool report) {
    const std::int64_t s = slots[r];
    if (s >= 0 && static_cast<std::uint64_t>(s) < table_rows) return s;
    if (s != -1 && report && status != nullptr) atomicMin(&status[kBadSlot], static_cast<unsigned long long>(r));
    return -1;
}

// Whether a gated write must do nothing: the check before it reported.
__device__ __forceinline__ bool batch_rejected(const unsigned long long* __restrict__ gate) {
    return gate != nullptr && (gate[kBadValue] != kNone || gate[kBadSlot] != kNone);
}

// ----------------------------------------------------------------- check ---

// Read-only: report into status[kBadValue] the first element of the rows
// whose value cannot be staged (beyond(v, limit)), and into status[kBadSlot]
// the first row with a slot outside the table. With slots == nullptr every
// row is checked; otherwise rows whose slot is -1 are not (padding).
template <int IN>
__global__ void __launch_bounds__(kThreads) k_check_rows(const void* __restrict__ src, std::size_t n_rows,
                                                         std::size_t dim, const std::int64_t* __restrict__ slots,
                                                         std::size_t table_rows, std::uint32_t limit,
                                                         unsigned long long* __restrict__ status) {
    const std::size_t segs = segments_of(dim);
    for (std::size_t u = blockIdx.x; u < n_rows * segs; u += gridDim.x) {  // block-uniform
        const std::size_t r = u / segs;
        const std::size_t j = (u % segs) * kSegment + static_cast<std::size_t>(threadIdx.x) * kChunk;
        if (slots != nullptr && batch_slot(slots, r, table_rows, status, j == 0) < 0) continue;
        if (j >= dim) continue;
        const void* row = static_cast<const char*>(src) + r * dim * elem_size(IN);
        unsigned long long* first = &status[kBadValue];
        if (dim - j >= kChunk) {
            float v[4];
            load4(row, IN, j, v);
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (beyond(v[k], limit)) {  // the chunk's first; atomicMin keeps the batch's
                    atomicMin(first, static_cast<unsigned long long>(r * dim + j + static_cast<std::size_t>(k)));
                    break;
                }
        } else {
            for (std::size_t k = j; k < dim; ++k)
                if (beyond(load_elem(row, IN, k), limit)) {
                    atomicMin(first, static_cast<unsigned long long>(r * dim + k));
                    break;
                }
        }
    }
}

// ----------------------------------------------------------------- write ---

// f32 / f16 / bf16 rows -> f32 / f16 / bf16 table rows at their slots.
template <int IN, int OUT>
__global__ void __launch_bounds__(kThreads) k_scatter_float(const void* __restrict__ src, std::size_t n_rows,
                                                            std::size_t dim, const std::int64_t* __restrict__ slots,
                                                            void* __restrict__ table, std::size_t table_rows,
                                                            int policy, std::uint32_t limit,
                                                            const unsigned long long* __restrict__ gate,
                                                            unsigned long long* __restrict__ status) {
    if (batch_rejected(gate)) return;
    const std::size_t segs = segments_of(dim);
    for (std::size_t u = blockIdx.x; u < n_rows * segs; u += gridDim.x) {  // block-uniform
        const std::size_t r = u / segs;
        const std::size_t j = (u % segs) * kSegment + static_cast<std::size_t>(threadIdx.x) * kChunk;
        const std::int64_t slot = batch_slot(slots, r, table_rows, status, j == 0);
        if (slot < 0 || j >= dim) continue;
        const void* in = static_cast<const char*>(src) + r * dim * elem_size(IN);
        void* out = static_cast<char*>(table) + static_cast<std::size_t>(slot) * dim * elem_size(OUT);
        if (dim - j >= kChunk) {
            encode4<IN, OUT>(in, out, j, policy, limit, nullptr);
        } else {
            for (std::size_t k = j; k < dim; ++k) encode_elem<IN, OUT>(in, out, k, policy, limit, nullptr);
        }
    }
}

// f32 / f16 / bf16 rows -> q8_0 / q4_0 table rows at their slots: every warp
// of the block takes 4 q blocks of the unit's segment (32 per block step).
template <int IN, int Q>
__global__ void __launch_bounds__(kThreads) k_scatter_quant(const void* __restrict__ src, std::size_t n_rows,
                                                            std::size_t dim, const std::int64_t* __restrict__ slots,
                                                            std::uint8_t* __restrict__ table, std::size_t table_rows,
                                                            int policy, std::uint32_t limit,
                                                            const unsigned long long* __restrict__ gate,
                                                            unsigned long long* __restrict__ status) {
    if (batch_rejected(gate)) return;  // grid-uniform: no warp is left at a collective
    constexpr std::size_t kBlockBytes = Q == S_Q8_0 ? Q8_BLOCK : Q4_BLOCK;
    const int lane = static_cast<int>(threadIdx.x & 31u);
    const std::size_t warp = threadIdx.x >> 5;
    const std::size_t segs = segments_of(dim);
    const std::size_t row_blocks = dim / bm::QK;
    const std::size_t row_bytes = row_blocks * kBlockBytes;
    for (std::size_t u = blockIdx.x; u < n_rows * segs; u += gridDim.x) {  // block-uniform, so warp-uniform
        const std::size_t r = u / segs;
        const std::size_t seg = u % segs;
        const std::int64_t slot = batch_slot(slots, r, table_rows, status, seg == 0 && threadIdx.x == 0);
        const std::size_t b = seg * (kSegment / bm::QK) + warp * kBlocksPerWarp + static_cast<std::size_t>(lane / kLanesPerBlock);
        const bool live = slot >= 0 && b < row_blocks;
        const std::size_t i = b * bm::QK + static_cast<std::size_t>(lane % kLanesPerBlock * kElemsPerLane);
        const void* in = static_cast<const char*>(src) + r * dim * elem_size(IN);
        std::uint8_t* blk = table + (slot >= 0 ? static_cast<std::size_t>(slot) * row_bytes + b * kBlockBytes : 0);
        quantize4<IN, Q>(in, i, blk, live, lane, policy, limit, nullptr);
    }
}

// ---------------------------------------------------------------- gather ---

// f32 / f16 / bf16 table rows -> f32 / f16 / bf16 rows (the same format: bit
// for bit, as decode_rows' copy); skipped rows become zeros.
template <int IN, int OUT>
__global__ void __launch_bounds__(kThreads) k_gather_float(const void* __restrict__ table, std::size_t table_rows,
                                                           std::size_t dim, const std::int64_t* __restrict__ slots,
                                                           std::size_t n_rows, void* __restrict__ dst,
                                                           unsigned long long* __restrict__ status) {
    const std::size_t segs = segments_of(dim);
    for (std::size_t u = blockIdx.x; u < n_rows * segs; u += gridDim.x) {  // block-uniform
        const std::size_t r = u / segs;
        const std::size_t j = (u % segs) * kSegment + static_cast<std::size_t>(threadIdx.x) * kChunk;
        const std::int64_t slot = batch_slot(slots, r, table_rows, status, j == 0);
        if (j >= dim) continue;
        void* out = static_cast<char*>(dst) + r * dim * elem_size(OUT);
        const int n = dim - j >= kChunk ? kChunk : static_cast<int>(dim - j);
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (slot < 0) {
            if (n == kChunk) store4(out, OUT, j, v);
            else for (int k = 0; k < n; ++k) store_elem(out, OUT, j + static_cast<std::size_t>(k), 0.0f);
            continue;
        }
        const void* in = static_cast<const char*>(table) + static_cast<std::size_t>(slot) * dim * elem_size(IN);
        if (IN == OUT && n == kChunk) {
            copy4(in, out, IN, j);
        } else if (IN == OUT) {
            for (int k = 0; k < n; ++k) copy_elem(in, out, IN, j + static_cast<std::size_t>(k));
        } else if (n == kChunk) {
            load4(in, IN, j, v);
            store4(out, OUT, j, v);
        } else {
            for (int k = 0; k < n; ++k)
                store_elem(out, OUT, j + static_cast<std::size_t>(k), load_elem(in, IN, j + static_cast<std::size_t>(k)));
        }
    }
}

// q8_0 / q4_0 table rows -> f32 / f16 / bf16 rows; skipped rows become zeros.
template <int Q, int OUT>
__global__ void __launch_bounds__(kThreads) k_gather_quant(const std::uint8_t* __restrict__ table,
                                                           std::size_t table_rows, std::size_t dim,
                                                           const std::int64_t* __restrict__ slots, std::size_t n_rows,
                                                           void* __restrict__ dst,
                                                           unsigned long long* __restrict__ status) {
    const std::size_t segs = segments_of(dim);
    const std::size_t row_bytes = dim / bm::QK * (Q == S_Q8_0 ? Q8_BLOCK : Q4_BLOCK);
    for (std::size_t u = blockIdx.x; u < n_rows * segs; u += gridDim.x) {  // block-uniform
        const std::size_t r = u / segs;
        const std::size_t j = (u % segs) * kSegment + static_cast<std::size_t>(threadIdx.x) * kChunk;
        const std::int64_t slot = batch_slot(slots, r, table_rows, status, j == 0);
        if (j >= dim) continue;  // dim % 32 == 0: whole chunks
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (slot >= 0) dequant4<Q>(table + static_cast<std::size_t>(slot) * row_bytes, j, v);
        store4(static_cast<char*>(dst) + r * dim * elem_size(OUT), OUT, j, v);
    }
}

// ---------------------------------------------------------------- launch ---

// The batch's grid: a block per unit up to ~2 waves of resident blocks
// (grid-stride after), as grid_for() of the run kernels.
inline unsigned batch_grid(std::size_t n_rows, std::size_t dim, unsigned max_blocks) {
    const std::size_t units = n_rows * ((dim + kSegment - 1) / kSegment);
    return static_cast<unsigned>(units < max_blocks ? (units == 0 ? 1 : units) : max_blocks);
}

template <int IN>
void launch_scatter_in(int out, const void* src, std::size_t n_rows, std::size_t dim, const std::int64_t* slots,
                       void* table, std::size_t table_rows, int policy, std::uint32_t limit,
                       const unsigned long long* gate, unsigned long long* status, unsigned grid, cudaStream_t s) {
    auto* t8 = static_cast<std::uint8_t*>(table);
    switch (out) {
        case S_F32: launch(k_scatter_float<IN, E_F32>, grid, s, src, n_rows, dim, slots, table, table_rows, policy, limit, gate, status); break;
        case S_F16: launch(k_scatter_float<IN, E_F16>, grid, s, src, n_rows, dim, slots, table, table_rows, policy, limit, gate, status); break;
        case S_BF16: launch(k_scatter_float<IN, E_BF16>, grid, s, src, n_rows, dim, slots, table, table_rows, policy, limit, gate, status); break;
        case S_Q8_0: launch(k_scatter_quant<IN, S_Q8_0>, grid, s, src, n_rows, dim, slots, t8, table_rows, policy, limit, gate, status); break;
        case S_Q4_0: launch(k_scatter_quant<IN, S_Q4_0>, grid, s, src, n_rows, dim, slots, t8, table_rows, policy, limit, gate, status); break;
        default: break;
    }
}

template <int OUT>
void launch_gather_out(int in, const void* table, std::size_t table_rows, std::size_t dim, const std::int64_t* slots,
                       std::size_t n_rows, void* dst, unsigned long long* status, unsigned grid, cudaStream_t s) {
    const auto* t8 = static_cast<const std::uint8_t*>(table);
    switch (in) {
        case S_F32: launch(k_gather_float<E_F32, OUT>, grid, s, table, table_rows, dim, slots, n_rows, dst, status); break;
        case S_F16: launch(k_gather_float<E_F16, OUT>, grid, s, table, table_rows, dim, slots, n_rows, dst, status); break;
        case S_BF16: launch(k_gather_float<E_BF16, OUT>, grid, s, table, table_rows, dim, slots, n_rows, dst, status); break;
        case S_Q8_0: launch(k_gather_quant<S_Q8_0, OUT>, grid, s, t8, table_rows, dim, slots, n_rows, dst, status); break;
        case S_Q4_0: launch(k_gather_quant<S_Q4_0, OUT>, grid, s, t8, table_rows, dim, slots, n_rows, dst, status); break;
        default: break;
    }
}

}  // namespace kernels
}  // namespace dspark
