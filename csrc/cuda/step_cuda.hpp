// The device step on the GPU (dspark/step_math.hpp; docs/protocol.md "The
// device step"): one launch runs the step of a whole batch over the step
// state in device memory, reading the rejection sampler's accept counts where
// they are, and writes every entry's status word, plan, gather slots and
// positions (padded) and verify slots into device arrays.
//
// Made for a captured CUDA graph: the call is asynchronous on `stream`,
// allocates nothing, copies nothing to or from the host and never
// synchronizes. The state is the host state's layout (Stager::step_state():
// device_step::columns(c) columns of c.max_seqs int64: the fields, then the
// acceptance histogram's c.block + 1 buckets; zero = not handed over); the
// caller copies the columns of the sequences it hands over to the device
// after Stager::to_device, and back before Stager::to_host and to the device
// again after it (their `live` column is 0 then: a later step names them
// NOT_ON_DEVICE instead of stepping a stale copy): step_columns_to_device_cuda
// and step_columns_to_host_cuda, which move those sequences' columns only, so
// that a step of another sequence running meanwhile is neither raced nor undone.
//
// Errors (null or host pointers, misaligned pointers, pointers on different
// devices, a count type that is neither 4 nor 8 bytes, a sequence id out of
// range, a launch or copy failure) are exceptions, as
// dspark_cuda.hpp; what a step cannot decide is a status word.
#pragma once
#include <cstddef>
#include <cstdint>

#include "dspark/step_math.hpp"

namespace dspark {

// One step of the n entries (seqs[i], n_accepted[i]): n_accepted holds int32
// (count_bytes 4) or int64 (8) values, -1 for an entry not in this step. Every
// pointer is device memory on one device (out's may be null but status). n = 0:
// nothing is launched.
void device_step_cuda(const device_step::Config& c, std::int64_t* state, const std::int64_t* seqs, const void* n_accepted,
                      int count_bytes, std::size_t n, const device_step::Outputs& out, void* stream);

// The CSR rows of the batch a device_step_cuda on `stream` just stepped
// (Stager::step_rows's, on the device; docs/protocol.md 2.10): seqs / n and
// `out` as that step's (out.status, skip, start, n_rows and pos_base
// required), rows for `capacity` >= n entries (row_offsets: capacity + 1;
// row_slots / row_positions: capacity * max_rows, null: not written). Two
// launches (the offsets' scan, then the rows), asynchronous on `stream`,
// capturable. capacity 0 with n 0 still writes row_offsets[0].
void device_step_rows_cuda(const device_step::Config& c, const std::int64_t* state, const std::int64_t* seqs,
                           std::size_t n, const device_step::Outputs& out, std::size_t capacity,
                           const device_step::CsrRows& rows, void* stream);

// The step-state columns of the n sequences `seqs` (ids in [0, c.max_seqs);
// repeats allowed) from the host state `host` (the same layout as `state`:
// Stager::step_state()) into the device state `state`, enqueued on `stream`:
// one strided copy per run of consecutive ids, nothing else of either state
// touched. `host` may be reused once the call returns. Enqueue it on the
// stream the steps run on, so that it lands after the steps before it and
// before the steps after it.
void step_columns_to_device_cuda(const device_step::Config& c, std::int64_t* state, const std::int64_t* host,
                                 const std::int64_t* seqs, std::size_t n, void* stream);

// The reverse: those sequences' columns of the device state into `host`,
// ordered on `stream` after the steps enqueued there before; returns once
// `host` holds them (it synchronizes `stream`).
void step_columns_to_host_cuda(const device_step::Config& c, const std::int64_t* state, std::int64_t* host,
                               const std::int64_t* seqs, std::size_t n, void* stream);

}  // namespace dspark
