// Streams and graphs for tests and benchmarks (cuda_graph.hpp).
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "cuda_graph.hpp"
#include "cuda_host.hpp"

namespace dspark {

using namespace cuda_host;

void* cuda_stream_create(int device) {
    require_device();
    DeviceGuard guard(device);
    cudaStream_t s = nullptr;
    DSPARK_CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
}

void cuda_stream_destroy(void* stream) noexcept {
    if (stream == nullptr) return;
    if (cudaStreamDestroy(static_cast<cudaStream_t>(stream)) != cudaSuccess) (void)cudaGetLastError();
}

void cuda_graph_begin_capture(void* stream, int device) {
    require_device();
    if (stream == nullptr)
        throw std::invalid_argument("dspark cuda: cuda_graph_begin_capture: the legacy default stream cannot be captured");
    DeviceGuard guard(device);
    DSPARK_CK(cudaStreamBeginCapture(static_cast<cudaStream_t>(stream), cudaStreamCaptureModeThreadLocal),
              "cudaStreamBeginCapture");
}

void* cuda_graph_end_capture(void* stream, int device) {
    require_device();
    DeviceGuard guard(device);
    cudaGraph_t graph = nullptr;
    DSPARK_CK(cudaStreamEndCapture(static_cast<cudaStream_t>(stream), &graph),
              "cudaStreamEndCapture (a call in the capture could not be captured)");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    DSPARK_CK(e, "cudaGraphInstantiate");
    return exec;
}

void cuda_graph_launch(void* graph, void* stream, int device) {
    if (graph == nullptr) throw std::invalid_argument("dspark cuda: cuda_graph_launch: no graph");
    require_device();
    DeviceGuard guard(device);
    DSPARK_CK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), static_cast<cudaStream_t>(stream)),
              "cudaGraphLaunch");
}

void cuda_graph_destroy(void* graph) noexcept {
    if (graph == nullptr) return;
    if (cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)) != cudaSuccess) (void)cudaGetLastError();
}

std::int64_t cuda_emulated_launches() noexcept {
#if defined(DSPARK_CUDA_EMULATION)
    return static_cast<std::int64_t>(::dspark_emu::launch_count());
#else
    return -1;
#endif
}

}  // namespace dspark
