# cython: language_level=3
# Declarations of the CUDA row-conversion API (csrc/cuda/dspark_cuda.hpp).
# Declarations only: the wrappers live in _cuda.pyx. Built only when the
# package is configured with DSPARK_CUDA=AUTO (and nvcc is found), ON or
# EMULATE (tests: an emulated device in host memory).
from libc.stdint cimport int64_t, uint64_t
from libcpp cimport bool
from libcpp.string cimport string

from dspark_core._ext._lib_row_format cimport Storage, ElemType, NonFinite, dspark_translate_exception


cdef extern from "dspark_cuda.hpp" namespace "dspark" nogil:
    int cuda_device_count()
    bool cuda_is_emulated()
    string cuda_unavailable_reason() except +dspark_translate_exception
    int cuda_runtime_version()
    int cuda_driver_version()
    int cuda_pointer_device(const void* p) except +dspark_translate_exception
    string cuda_device_name(int dev) except +dspark_translate_exception

    int64_t encode_rows_cuda(const void* src, ElemType in_, void* dst, Storage out, size_t n_rows,
                             size_t dim, NonFinite policy, void* stream,
                             bool report_nonfinite, ElemType staged) except +dspark_translate_exception
    void decode_rows_cuda(const void* src, Storage in_, void* dst, ElemType out, size_t n_rows,
                          size_t dim, void* stream) except +dspark_translate_exception

    void cuda_stream_synchronize(void* stream, int device) except +dspark_translate_exception
    void cuda_copy_to_host(void* host_dst, const void* dev_src, size_t n) except +dspark_translate_exception
    void cuda_copy_to_device(void* dev_dst, const void* host_src, size_t n, void* stream) except +dspark_translate_exception
    void* cuda_alloc(size_t n, int device) except +dspark_translate_exception
    void cuda_release(void* p)
    void cuda_copy_device(void* dst, const void* src, size_t n, void* stream) except +dspark_translate_exception
    void cuda_stream_wait(void* waiter, void* producer, int device) except +dspark_translate_exception


cdef extern from "row_batch_cuda.hpp" namespace "dspark" nogil:
    const size_t BATCH_STATUS_WORDS
    void batch_status_reset_cuda(uint64_t* status, void* stream) except +dspark_translate_exception
    void check_rows_cuda(const void* src, ElemType in_, size_t n_rows, size_t dim, const int64_t* slots,
                         size_t table_rows, Storage storage, ElemType staged, uint64_t* status,
                         void* stream) except +dspark_translate_exception
    void scatter_rows_cuda(const void* src, ElemType in_, size_t n_rows, size_t dim, const int64_t* slots,
                           void* table, Storage storage, size_t table_rows, NonFinite policy, ElemType staged,
                           uint64_t* status, bool gated, void* stream) except +dspark_translate_exception
    void gather_rows_cuda(const void* table, Storage storage, size_t table_rows, size_t dim, const int64_t* slots,
                          size_t n_rows, void* dst, ElemType out, uint64_t* status,
                          void* stream) except +dspark_translate_exception


cdef extern from "cuda_graph.hpp" namespace "dspark" nogil:
    void* cuda_stream_create(int device) except +dspark_translate_exception
    void cuda_stream_destroy(void* stream)
    void cuda_graph_begin_capture(void* stream, int device) except +dspark_translate_exception
    void* cuda_graph_end_capture(void* stream, int device) except +dspark_translate_exception
    void cuda_graph_launch(void* graph, void* stream, int device) except +dspark_translate_exception
    void cuda_graph_destroy(void* graph)
    int64_t cuda_emulated_launches()


from dspark_core._ext._lib_stager cimport StepConfig, StepOutputs, StepCsrRows


cdef extern from "step_cuda.hpp" namespace "dspark" nogil:
    void device_step_cuda(const StepConfig& c, int64_t* state, const int64_t* seqs, const void* n_accepted,
                          int count_bytes, size_t n, const StepOutputs& out,
                          void* stream) except +dspark_translate_exception
    void device_step_rows_cuda(const StepConfig& c, const int64_t* state, const int64_t* seqs, size_t n,
                               const StepOutputs& out, size_t capacity, const StepCsrRows& rows,
                               void* stream) except +dspark_translate_exception
    void step_columns_to_device_cuda(const StepConfig& c, int64_t* state, const int64_t* host, const int64_t* seqs,
                                     size_t n, void* stream) except +dspark_translate_exception
    void step_columns_to_host_cuda(const StepConfig& c, const int64_t* state, int64_t* host, const int64_t* seqs,
                                   size_t n, void* stream) except +dspark_translate_exception
