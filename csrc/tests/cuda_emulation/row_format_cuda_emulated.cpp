// DSPARK_CUDA=EMULATE: row_format_cuda.cu compiled as C++ against the
// emulated runtime (cuda_runtime.h here, found first on the include path)
// and the kernel execution model (kernel_emulation.hpp). Tests only.
#include "../../cuda/row_format_cuda.cu"
