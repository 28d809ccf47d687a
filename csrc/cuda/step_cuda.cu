// Host side of the device step (step_cuda.hpp): argument checks, device
// handling and the one launch of step_kernels.cuh. Nothing here allocates,
// copies or synchronizes, so the call can be captured into a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "step_kernels.cuh"  // before dspark headers (see cuda_host.hpp)
#include "cuda_host.hpp"
#include "step_cuda.hpp"

namespace dspark {
namespace {

using namespace cuda_host;

// `p` is device memory on `dev`, aligned for T (null allowed when optional).
template <class T>
void on_device(const T* p, int dev, const char* what, bool optional = true) {
    if (p == nullptr) {
        if (optional) return;
        throw std::invalid_argument(std::string("dspark cuda: device_step_cuda: the ") + what + " is null");
    }
    const int d = cuda_pointer_device(p);
    if (d < 0)
        throw std::invalid_argument(std::string("dspark cuda: device_step_cuda: the ") + what +
                                    " is not CUDA device memory");
    if (d != dev)
        throw std::invalid_argument(std::string("dspark cuda: device_step_cuda: the ") + what + " is on device " +
                                    std::to_string(d) + ", the step state on device " + std::to_string(dev));
    check_aligned(p, sizeof(T), "device_step_cuda", what);
}

}  // namespace

void device_step_cuda(const device_step::Config& c, std::int64_t* state, const std::int64_t* seqs, const void* n_accepted,
                      int count_bytes, std::size_t n, const device_step::Outputs& out, void* stream) {
    if (count_bytes != 4 && count_bytes != 8)
        throw std::invalid_argument("dspark cuda: device_step_cuda: accept counts must be int32 or int64, got " +
                                    std::to_string(count_bytes) + "-byte values");
    if (n == 0) return;
    require_device();
    if (state == nullptr) throw std::invalid_argument("dspark cuda: device_step_cuda: the step state is null");
    const int dev = cuda_pointer_device(state);
    if (dev < 0) throw std::invalid_argument("dspark cuda: device_step_cuda: the step state is not CUDA device memory");
    on_device(state, dev, "step state", false);
    on_device(seqs, dev, "sequence ids", false);
    if (count_bytes == 4) on_device(static_cast<const std::int32_t*>(n_accepted), dev, "accept counts", false);
    else on_device(static_cast<const std::int64_t*>(n_accepted), dev, "accept counts", false);
    on_device(out.status, dev, "status array", false);
    on_device(out.skip, dev, "skip array");
    on_device(out.flags, dev, "flags array");
    on_device(out.start, dev, "start array");
    on_device(out.pos_base, dev, "pos_base array");
    on_device(out.crop_from, dev, "crop_from array");
    on_device(out.n_rows, dev, "n_rows array");
    on_device(out.row_slots, dev, "row slot array");
    on_device(out.row_positions, dev, "row position array");
    on_device(out.block_positions, dev, "block position array");
    on_device(out.verify_slots, dev, "verify slot array");
    DeviceGuard guard(dev);
    const auto s = static_cast<cudaStream_t>(stream);
    const unsigned grid = grid_for(n * kernels::kWarp, dev);  // a warp per entry
    if (count_bytes == 4)
        kernels::launch(kernels::k_step<std::int32_t>, grid, s, c, state, seqs,
                        static_cast<const std::int32_t*>(n_accepted), n, out);
    else
        kernels::launch(kernels::k_step<std::int64_t>, grid, s, c, state, seqs,
                        static_cast<const std::int64_t*>(n_accepted), n, out);
    DSPARK_CK(cudaGetLastError(), "launching the device step kernel");
}

}  // namespace dspark
