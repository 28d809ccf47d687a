# cython: language_level=3
# Declarations of the C++ row-format API (csrc/include/dspark/row_format.hpp)
# and of the binding's exception translator. Declarations only: the wrappers
# live in _row_format.pyx.
from libc.stdint cimport int64_t, uint8_t
from libcpp cimport bool
from libcpp.string_view cimport string_view


cdef extern from "_errors.hpp" nogil:
    # Raises the Python exception of the C++ one being handled: the core's
    # table (DSPARK_ERROR_KINDS in dspark/errors.hpp) decides which.
    void dspark_translate_exception()
    # Registers the Python exception classes (once, at module import).
    void dspark_set_error_types(object config_error, object state_error) with gil


cdef extern from "dspark/row_format.hpp" namespace "dspark" nogil:
    size_t QK
    size_t Q8_0_BLOCK_BYTES
    size_t Q4_0_BLOCK_BYTES
    int STORAGE_COUNT
    int NONFINITE_COUNT
    int ELEM_TYPE_COUNT

    enum class Storage(uint8_t):
        F32
        F16
        BF16
        Q8_0
        Q4_0

    enum class ElemType(uint8_t):
        F32
        F16
        BF16

    bool staged_as_stored(Storage s, ElemType t) noexcept

    enum class NonFinite(uint8_t):
        Error
        Zero
        ClampF16
        Clamp

    cdef cppclass EncodeBounds:
        float limit
        float clamp_to

    EncodeBounds encode_bounds(Storage s, ElemType staged) except +dspark_translate_exception
    int64_t find_unencodable(const void* src, ElemType in_, size_t n_elems, float limit) except +dspark_translate_exception
    size_t row_bytes(Storage s, size_t dim) except +dspark_translate_exception
    size_t elem_bytes(ElemType t)
    const char* storage_name(Storage s)
    size_t storage_block_elems(Storage s) except +dspark_translate_exception
    const char* nonfinite_name(NonFinite p)
    const char* elem_name(ElemType t)
    Storage storage_from_name(string_view name) except +dspark_translate_exception

    int64_t encode_rows(const void* src, ElemType in_, void* dst, Storage out, size_t n_rows,
                        size_t dim, NonFinite policy) except +dspark_translate_exception
    int64_t encode_rows(const void* src, ElemType in_, void* dst, Storage out, size_t n_rows,
                        size_t dim, NonFinite policy, EncodeBounds bounds) except +dspark_translate_exception
    int64_t find_nonfinite(const void* src, ElemType in_, size_t n_elems) except +dspark_translate_exception
    void decode_rows(const void* src, Storage in_, void* dst, ElemType out, size_t n_rows,
                     size_t dim) except +dspark_translate_exception


# The dispatch registry: every runtime-chosen kernel family, its paths, the
# CPU probe and DSPARK_SIMD (the row-format and CRC-32C paths included).
cdef extern from "dspark/dispatch.hpp" namespace "dspark" nogil:
    enum class KernelFamily(uint8_t):
        RowFormat
        Crc32c

    enum class KernelEnv(uint8_t):
        Unset
        Used
        Unknown
        Unsupported

    const char* KERNEL_ENV
    const char* KERNEL_ENV_DEPRECATED
    const char* kernel_family_name(KernelFamily f)
    const char* kernel_path_name(KernelFamily f, int path)
    int kernel_path_count(KernelFamily f)
    int kernel_path_from_name(KernelFamily f, string_view name)
    bool kernel_path_supported(KernelFamily f, int path)
    int best_kernel_path(KernelFamily f)
    int active_kernel_path(KernelFamily f)
    void set_kernel_path(KernelFamily f, int path) except +dspark_translate_exception
    const char* kernel_name(KernelFamily f, int k)
    const char* kernel_origin(KernelFamily f, int k, int path)
    KernelEnv kernel_env_status()
    bool kernel_env_deprecated()
