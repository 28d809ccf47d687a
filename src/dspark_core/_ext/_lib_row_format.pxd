# cython: language_level=3
# Declarations of the C++ row-format API (csrc/include/dspark/row_format.hpp)
# and of the binding's exception translator. Declarations only: the wrappers
# live in _row_format.pyx.
from libc.stdint cimport int64_t, uint8_t
from libcpp cimport bool
from libcpp.string_view cimport string_view


cdef extern from "_errors.hpp" nogil:
    # Maps dspark::ConfigError -> dspark_core.ConfigError, StateError ->
    # StateError, TypeError -> TypeError, std::invalid_argument -> ValueError,
    # std::bad_alloc -> MemoryError, anything else -> RuntimeError.
    void dspark_translate_exception()
    # Registers the Python exception classes (once, at module import).
    void dspark_set_error_types(object config_error, object state_error) with gil


cdef extern from "dspark/row_format.hpp" namespace "dspark" nogil:
    size_t QK
    size_t Q8_0_BLOCK_BYTES
    size_t Q4_0_BLOCK_BYTES
    int STORAGE_COUNT

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

    enum class NonFinite(uint8_t):
        Error
        Zero
        ClampF16
        Clamp

    enum class SimdPath(uint8_t):
        Scalar
        Avx2
        Avx512

    enum class SimdEnv(uint8_t):
        Unset
        Used
        Unknown
        Unsupported

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
    Storage storage_from_name(string_view name) except +dspark_translate_exception

    int64_t encode_rows(const void* src, ElemType in_, void* dst, Storage out, size_t n_rows,
                        size_t dim, NonFinite policy) except +dspark_translate_exception
    int64_t encode_rows(const void* src, ElemType in_, void* dst, Storage out, size_t n_rows,
                        size_t dim, NonFinite policy, EncodeBounds bounds) except +dspark_translate_exception
    int64_t find_nonfinite(const void* src, ElemType in_, size_t n_elems) except +dspark_translate_exception
    void decode_rows(const void* src, Storage in_, void* dst, ElemType out, size_t n_rows,
                     size_t dim) except +dspark_translate_exception

    bool simd_supported(SimdPath p)
    SimdPath best_simd_path()
    SimdPath active_simd_path()
    void set_simd_path(SimdPath p) except +dspark_translate_exception
    const char* simd_path_name(SimdPath p)
    SimdEnv simd_env_status()
