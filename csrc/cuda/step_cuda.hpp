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
// NOT_ON_DEVICE instead of stepping a stale copy).
//
// Errors (null or host pointers, pointers on different devices, a count type
// that is neither 4 nor 8 bytes, a launch failure) are exceptions, as
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

}  // namespace dspark
