// DSPARK_CUDA=EMULATE: step_cuda.cu compiled as C++ against the emulated runtime
// (see row_format_cuda_emulated.cpp). Tests only.
#include "../../cuda/step_cuda.cu"
