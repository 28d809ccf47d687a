// DSPARK_CUDA=EMULATE: row_batch_cuda.cu compiled as C++ against the emulated runtime
// (see row_format_cuda_emulated.cpp). Tests only.
#include "../../cuda/row_batch_cuda.cu"
