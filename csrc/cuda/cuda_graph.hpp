// Streams and CUDA graphs, for the tests and benchmarks that capture the
// library's asynchronous calls (row_batch_cuda.hpp) into a graph and replay
// it. A server uses its own framework's graphs (torch.cuda.CUDAGraph,
// cupy's graphs); these are the minimum to check, without one, that a call
// really can be captured: a capture fails when anything in it synchronizes,
// allocates or copies from / to host memory.
#pragma once
#include <cstdint>

namespace dspark {

// A new non-blocking stream of `device` / its release (nullptr: no-op).
void* cuda_stream_create(int device);
void cuda_stream_destroy(void* stream) noexcept;

// Start capturing `stream` (thread-local capture mode: this thread's calls
// that cannot be captured fail and invalidate the capture).
void cuda_graph_begin_capture(void* stream, int device);
// End the capture of `stream` and instantiate it: the executable graph
// (release with cuda_graph_destroy). Throws std::runtime_error when the
// capture was invalidated (the capture is ended either way).
void* cuda_graph_end_capture(void* stream, int device);
// Launch an executable graph on `stream` (asynchronous).
void cuda_graph_launch(void* graph, void* stream, int device);
void cuda_graph_destroy(void* graph) noexcept;

// Kernel launches the emulated device has run so far (DSPARK_CUDA=EMULATE
// builds: a graph's launches count when it is launched, not when captured);
// -1 on a real device.
std::int64_t cuda_emulated_launches() noexcept;

}  // namespace dspark
