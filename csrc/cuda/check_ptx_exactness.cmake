# ctest cuda_ptx_exactness: cmake -DPTX=<file.ptx> [-DKERNELS=<n>] -P check_ptx_exactness.cmake
#
# The kernels' bytes equal the CPU path's only if every float operation is a
# single IEEE round-to-nearest-even operation with subnormals kept. This reads
# the PTX nvcc generated for row_format_cuda.cu (with the library's own flags)
# and fails on any instruction that breaks that: a fused multiply-add on
# floats (a contracted a * b + c), an approximate operation (div / rcp / sqrt
# .approx, as -use_fast_math emits) or a flush-to-zero variant (.ftz).
# It also checks the file holds all its kernels (KERNELS, default 30: the run
# conversions of row_format_cuda.cu), so an empty PTX cannot pass,
# and that no kernel keeps an array in local memory (ld/st.local: a
# dynamically indexed per-thread array, slow memory traffic in a kernel meant
# to run at HBM bandwidth).
cmake_minimum_required(VERSION 3.20)
if(NOT PTX OR NOT EXISTS "${PTX}")
  message(FATAL_ERROR "cuda_ptx_exactness: no PTX file (PTX='${PTX}')")
endif()
file(READ "${PTX}" ptx)

# row_format_cuda.cu: encode_float 3x3, quantize 3x2, dequantize 2x3, decode_float 3x3;
# row_batch_cuda.cu: check 3, scatter_float 3x3, scatter_quant 3x2, gather_float 3x3, gather_quant 2x3.
if(NOT KERNELS)
  set(KERNELS 30)
endif()
set(expected_kernels ${KERNELS})
string(REGEX MATCHALL "\\.entry[ \t]+[A-Za-z0-9_]+" entries "${ptx}")
list(LENGTH entries n_entries)
if(NOT n_entries EQUAL expected_kernels)
  message(FATAL_ERROR "cuda_ptx_exactness: ${n_entries} kernels in ${PTX}, expected ${expected_kernels}")
endif()

string(REGEX MATCHALL "(fma|mad)(\\.[a-z0-9]+)*\\.(f16|bf16|f16x2|bf16x2|f32|f64)" fused "${ptx}")
string(REGEX MATCHALL "[a-z]+(\\.[a-z0-9]+)*\\.approx(\\.[a-z0-9]+)*" approx "${ptx}")
string(REGEX MATCHALL "[a-z]+(\\.[a-z0-9]+)*\\.ftz(\\.[a-z0-9]+)*" ftz "${ptx}")
string(REGEX MATCHALL "(ld|st)\\.local(\\.[a-z0-9]+)*" local "${ptx}")
set(bad ${fused} ${approx} ${ftz} ${local})
if(bad)
  list(REMOVE_DUPLICATES bad)
  string(REPLACE ";" ", " bad "${bad}")
  message(FATAL_ERROR "cuda_ptx_exactness: inexact float or local-memory instructions in ${PTX}: ${bad}")
endif()
# The exact operations the kernels rely on are really there.
foreach(op "div.rn.f32" "mul.rn.f32" "add.rn.f32" "cvt.rzi.s32.f32")
  string(FIND "${ptx}" "${op}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "cuda_ptx_exactness: expected '${op}' in ${PTX}")
  endif()
endforeach()
message(STATUS "cuda_ptx_exactness: ${n_entries} kernels, no fused, approximate or flush-to-zero float "
               "instruction, no local memory")
