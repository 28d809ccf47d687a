// DSPARK_CUDA=EMULATE: cuda_graph.cu compiled as C++ against the emulated runtime
// (see row_format_cuda_emulated.cpp). Tests only.
#include "../../cuda/cuda_graph.cu"
