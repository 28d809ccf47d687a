// Index-driven batches of rows on the GPU: one launch writes (encodes) or
// gathers (decodes) the rows of a whole batch of sequences at a flat array of
// table slots, byte for byte what the CPU path (dspark/row_format.hpp) and
// the run conversions of dspark_cuda.hpp produce.
//
// Made for a batching server's step, and for CUDA graphs: every call here is
// asynchronous on `stream`, allocates nothing, copies nothing to or from the
// host and never synchronizes, so it can be captured into a graph and
// replayed with new slot values in the same device arrays (fixed shapes).
//
// A batch: `n_rows` rows of `dim` elements, contiguous (row r at element
// r * dim), and `slots`, one int64 per row in device memory: the table row
// the row is written to / read from; -1 skips the row (padding of a
// fixed-shape [N, max_rows] batch, or a row below the horizon): a write
// leaves the table alone, a gather writes a row of zeros. The table is
// `table_rows` rows of row_bytes(storage, dim) bytes.
//
// Status words: nullptr, or BATCH_STATUS_WORDS uint64 in device memory that
// the caller resets (batch_status_reset_cuda) and reads back when it likes:
//   [BATCH_BAD_VALUE] the first flat index r * dim + c of an input value that
//                     cannot be staged (check_rows_cuda);
//   [BATCH_BAD_SLOT]  the first row whose slot is outside [-1, table_rows):
//                     a bug of the caller that the device cannot raise; the
//                     row is skipped (nothing outside the table is touched).
// BATCH_STATUS_NONE in a word: nothing reported.
//
// Errors (bad codes, shapes, pointers that are not device memory or on
// different devices, launch failures) are exceptions, as dspark_cuda.hpp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "dspark/row_format.hpp"

namespace dspark {

constexpr std::size_t BATCH_STATUS_WORDS = 2;
constexpr std::size_t BATCH_BAD_VALUE = 0;
constexpr std::size_t BATCH_BAD_SLOT = 1;
constexpr std::uint64_t BATCH_STATUS_NONE = ~0ull;

// Set the status words to BATCH_STATUS_NONE (a memset on `stream`).
void batch_status_reset_cuda(std::uint64_t* status, void* stream);

// Read-only check of the rows against encode_bounds(storage, staged), as a
// Stager's process() under nonfinite="error": reports the first value that
// cannot be staged into status[BATCH_BAD_VALUE] and the first out-of-table
// slot into status[BATCH_BAD_SLOT]. `slots` may be nullptr (check every row,
// no slot check); otherwise rows whose slot is -1 are not checked. One launch.
void check_rows_cuda(const void* src, ElemType in, std::size_t n_rows, std::size_t dim, const std::int64_t* slots,
                     std::size_t table_rows, Storage storage, ElemType staged, std::uint64_t* status, void* stream);

// Encode row r into table row slots[r] under `policy` with bounds
// encode_bounds(storage, staged) (as encode_rows_cuda). One launch.
//
// `gated`: do nothing when `status` (required then) holds a report, i.e.
// when check_rows_cuda over the same batch, enqueued before on the same
// stream, found a bad value or slot: the nonfinite="error" write that changes
// nothing when it is rejected, without a host synchronization (check, then
// gated write). Under NonFinite::Error a write that is not gated encodes
// what it is given (check first). Out-of-table slots are reported in
// `status` when it is not nullptr.
void scatter_rows_cuda(const void* src, ElemType in, std::size_t n_rows, std::size_t dim, const std::int64_t* slots,
                       void* table, Storage storage, std::size_t table_rows, NonFinite policy, ElemType staged,
                       std::uint64_t* status, bool gated, void* stream);

// Decode table row slots[r] into row r of `dst` (element type `out`; exact to
// f32, then one RNE step; the same format is copied bit for bit); rows whose
// slot is -1 (or outside the table) become zeros. One launch.
void gather_rows_cuda(const void* table, Storage storage, std::size_t table_rows, std::size_t dim,
                      const std::int64_t* slots, std::size_t n_rows, void* dst, ElemType out, std::uint64_t* status,
                      void* stream);

}  // namespace dspark
