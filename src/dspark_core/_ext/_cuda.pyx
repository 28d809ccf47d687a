# cython: language_level=3
"""Thin Cython wrappers over the CUDA row conversions (csrc/cuda/dspark_cuda.hpp).

Private module, built only with DSPARK_CUDA: use :mod:`dspark_core.cuda`.
Everything here takes raw device pointers (ints), sizes, enum codes and a
stream handle (int, 0 = the legacy default stream); the public module does
the array-protocol parsing and checking. The GIL is released around every
CUDA call.
"""
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t
from libcpp cimport bool as cbool
from libcpp.string cimport string

from dspark_core._ext._lib_row_format cimport Storage, ElemType, NonFinite, dspark_set_error_types
from dspark_core._ext._lib_stager cimport (
    StepConfig, StepOutputs, StepCsrRows, STEP_CONFIG_FIELDS, STEP_OUTPUTS, step_columns,
)
from dspark_core._ext._lib_cuda cimport (
    device_step_cuda, device_step_rows_cuda, step_columns_to_device_cuda, step_columns_to_host_cuda,
)
from dspark_core._ext._lib_cuda cimport (
    cuda_device_count, cuda_is_emulated, cuda_unavailable_reason, cuda_runtime_version, cuda_driver_version,
    cuda_pointer_device, cuda_device_name, encode_rows_cuda, decode_rows_cuda,
    cuda_stream_synchronize, cuda_copy_to_host, cuda_copy_to_device, cuda_stream_wait,
    cuda_alloc, cuda_release, cuda_copy_device,
    BATCH_STATUS_WORDS, batch_status_reset_cuda, check_rows_cuda, scatter_rows_cuda, gather_rows_cuda,
    cuda_stream_create, cuda_stream_destroy, cuda_graph_begin_capture, cuda_graph_end_capture,
    cuda_graph_launch, cuda_graph_destroy, cuda_emulated_launches,
)
from dspark_core._ext import _row_format
from dspark_core.errors import ConfigError, StateError

dspark_set_error_types(ConfigError, StateError)


cdef extern from *:
    """
    #include <stdint.h>
    /* DLPack (unversioned, ABI 0.x) as produced by __dlpack__() without max_version. */
    typedef struct { int32_t device_type; int32_t device_id; } dspark_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } dspark_DLDataType;
    typedef struct {
        void* data; dspark_DLDevice device; int32_t ndim; dspark_DLDataType dtype;
        int64_t* shape; int64_t* strides; uint64_t byte_offset;
    } dspark_DLTensor;
    typedef struct dspark_DLManagedTensor {
        dspark_DLTensor dl_tensor; void* manager_ctx; void (*deleter)(struct dspark_DLManagedTensor*);
    } dspark_DLManagedTensor;
    """
    ctypedef struct dspark_DLDevice:
        int device_type
        int device_id
    ctypedef struct dspark_DLDataType:
        uint8_t code
        uint8_t bits
        unsigned short lanes
    ctypedef struct dspark_DLTensor:
        void* data
        dspark_DLDevice device
        int ndim
        dspark_DLDataType dtype
        int64_t* shape
        int64_t* strides
        unsigned long long byte_offset
    ctypedef struct dspark_DLManagedTensor:
        dspark_DLTensor dl_tensor


def device_count():
    """Number of CUDA devices (0 without a GPU or driver; never raises)."""
    return cuda_device_count()


def emulated():
    """True in a DSPARK_CUDA=EMULATE (test) build: devices are host memory."""
    return cuda_is_emulated()


def unavailable_reason():
    """Why device_count() is 0 ("" when it is not)."""
    return cuda_unavailable_reason().decode("utf-8", "replace")


def runtime_version():
    return cuda_runtime_version()


def driver_version():
    return cuda_driver_version()


def pointer_device(uintptr_t ptr):
    """Device ordinal owning ``ptr``, or -1 for host / unknown memory."""
    cdef int d
    with nogil:
        d = cuda_pointer_device(<const void*>ptr)
    return d


def device_name(int dev):
    return cuda_device_name(dev).decode("utf-8", "replace")


def encode(uintptr_t src, int in_code, uintptr_t dst, int storage_code, size_t n_rows, size_t dim,
           int policy_code, bint report, uintptr_t stream, int staged_code=0):
    """encode_rows_cuda; returns the first flat index that cannot be staged as
    ``staged_code`` (non-finite, or beyond encode_bounds(storage, staged)), or -1."""
    cdef int64_t bad
    cdef cbool rep = report
    with nogil:
        bad = encode_rows_cuda(<const void*>src, <ElemType><uint8_t>in_code, <void*>dst,
                               <Storage><uint8_t>storage_code, n_rows, dim,
                               <NonFinite><uint8_t>policy_code, <void*>stream, rep,
                               <ElemType><uint8_t>staged_code)
    return bad


def decode(uintptr_t src, int storage_code, uintptr_t dst, int out_code, size_t n_rows, size_t dim,
           uintptr_t stream):
    """decode_rows_cuda (asynchronous on ``stream``)."""
    with nogil:
        decode_rows_cuda(<const void*>src, <Storage><uint8_t>storage_code, <void*>dst,
                         <ElemType><uint8_t>out_code, n_rows, dim, <void*>stream)


def synchronize(uintptr_t stream, int device=-1):
    """cudaStreamSynchronize(stream), with ``device`` current (-1: the current one)."""
    with nogil:
        cuda_stream_synchronize(<void*>stream, device)


def copy_to_host(uintptr_t src, size_t nbytes):
    """``nbytes`` bytes of device memory at ``src`` as a bytes object (synchronous)."""
    cdef bytearray buf = bytearray(nbytes)
    cdef char* p = buf
    with nogil:
        cuda_copy_to_host(<void*>p, <const void*>src, nbytes)
    return bytes(buf)


def copy_to_device(uintptr_t dst, const uint8_t[::1] host not None, uintptr_t stream):
    """Copy a contiguous host buffer to device memory at ``dst`` on ``stream``."""
    cdef size_t n = host.shape[0]
    cdef const void* sp = &host[0] if n > 0 else NULL
    with nogil:
        cuda_copy_to_device(<void*>dst, sp, n, <void*>stream)


def stream_wait(uintptr_t waiter, uintptr_t producer, int device=-1):
    """Make ``waiter`` wait for the work enqueued so far on ``producer`` (streams of ``device``)."""
    with nogil:
        cuda_stream_wait(<void*>waiter, <void*>producer, device)


def dlpack_info(capsule):
    """Read (without consuming) an unversioned DLPack capsule.

    Returns ``(ptr, device_type, device_id, shape, strides, (code, bits, lanes))``;
    ``ptr`` includes ``byte_offset``; ``strides`` (in elements) is None for a
    compact row-major tensor. The capsule must be kept alive while ``ptr`` is
    used; it is not renamed, so its destructor releases the tensor.
    """
    if not PyCapsule_IsValid(capsule, b"dltensor"):
        raise TypeError("expected an unconsumed DLPack capsule named 'dltensor'")
    cdef dspark_DLManagedTensor* m = <dspark_DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
    cdef dspark_DLTensor* t = &m.dl_tensor
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = None if t.strides == NULL else tuple(int(t.strides[i]) for i in range(t.ndim))
    ptr = <uintptr_t>t.data + <uintptr_t>t.byte_offset
    return (ptr, t.device.device_type, t.device.device_id, shape, strides,
            (t.dtype.code, t.dtype.bits, t.dtype.lanes))


def copy_device(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream):
    """Device-to-device copy (asynchronous on ``stream``)."""
    with nogil:
        cuda_copy_device(<void*>dst, <const void*>src, nbytes, <void*>stream)


cdef class Allocation:
    """``nbytes`` of device memory on ``device`` (cudaMalloc), freed with the object."""
    cdef void* _p
    cdef readonly size_t nbytes
    cdef readonly int device

    def __cinit__(self, size_t nbytes, int device=0):
        self._p = NULL
        self.nbytes = nbytes
        self.device = device
        with nogil:
            self._p = cuda_alloc(nbytes, device)

    def __dealloc__(self):
        cuda_release(self._p)
        self._p = NULL

    @property
    def ptr(self):
        return <uintptr_t>self._p


# ------------------------------------------------------------------ batches ---

#: uint64 words of a batch's status (row_batch_cuda.hpp): [first bad value, first bad slot row].
STATUS_WORDS = BATCH_STATUS_WORDS


def batch_status_reset(uintptr_t status, uintptr_t stream):
    """batch_status_reset_cuda: both status words to "nothing reported" (a memset on ``stream``)."""
    with nogil:
        batch_status_reset_cuda(<uint64_t*>status, <void*>stream)


def check_rows(uintptr_t src, int in_code, size_t n_rows, size_t dim, uintptr_t slots, size_t table_rows,
               int storage_code, int staged_code, uintptr_t status, uintptr_t stream):
    """check_rows_cuda (``slots`` 0: check every row). One launch, read-only."""
    with nogil:
        check_rows_cuda(<const void*>src, <ElemType><uint8_t>in_code, n_rows, dim, <const int64_t*>slots,
                        table_rows, <Storage><uint8_t>storage_code, <ElemType><uint8_t>staged_code,
                        <uint64_t*>status, <void*>stream)


def scatter_rows(uintptr_t src, int in_code, size_t n_rows, size_t dim, uintptr_t slots, uintptr_t table,
                 int storage_code, size_t table_rows, int policy_code, int staged_code, uintptr_t status,
                 bint gated, uintptr_t stream):
    """scatter_rows_cuda (``status`` 0: none). One launch."""
    cdef cbool g = gated
    with nogil:
        scatter_rows_cuda(<const void*>src, <ElemType><uint8_t>in_code, n_rows, dim, <const int64_t*>slots,
                          <void*>table, <Storage><uint8_t>storage_code, table_rows,
                          <NonFinite><uint8_t>policy_code, <ElemType><uint8_t>staged_code, <uint64_t*>status, g,
                          <void*>stream)


def gather_rows(uintptr_t table, int storage_code, size_t table_rows, size_t dim, uintptr_t slots, size_t n_rows,
                uintptr_t dst, int out_code, uintptr_t status, uintptr_t stream):
    """gather_rows_cuda (``status`` 0: none). One launch."""
    with nogil:
        gather_rows_cuda(<const void*>table, <Storage><uint8_t>storage_code, table_rows, dim,
                         <const int64_t*>slots, n_rows, <void*>dst, <ElemType><uint8_t>out_code,
                         <uint64_t*>status, <void*>stream)


# ------------------------------------------------------- streams and graphs ---


def emulated_launches():
    """Kernel launches the emulated device ran so far (-1 on a real device)."""
    return cuda_emulated_launches()


cdef class Stream:
    """A non-blocking CUDA stream of ``device`` (tests, benchmarks), destroyed with the object."""
    cdef void* _s
    cdef readonly int device

    def __cinit__(self, int device=0):
        self._s = NULL
        self.device = device
        with nogil:
            self._s = cuda_stream_create(device)

    def __dealloc__(self):
        cuda_stream_destroy(self._s)
        self._s = NULL

    @property
    def handle(self):
        return <uintptr_t>self._s


cdef class Graph:
    """A CUDA graph captured from a stream (:func:`capture_begin` / :func:`capture_end`), instantiated."""
    cdef void* _g
    cdef readonly int device

    def __cinit__(self):
        self._g = NULL
        self.device = 0

    def __dealloc__(self):
        cuda_graph_destroy(self._g)
        self._g = NULL

    def launch(self, uintptr_t stream):
        """Replay the graph on ``stream`` (asynchronous)."""
        with nogil:
            cuda_graph_launch(self._g, <void*>stream, self.device)


def capture_begin(uintptr_t stream, int device=0):
    """Start capturing ``stream`` (not the legacy default stream) into a graph."""
    with nogil:
        cuda_graph_begin_capture(<void*>stream, device)


def capture_end(uintptr_t stream, int device=0):
    """End the capture of ``stream``: the instantiated :class:`Graph` (RuntimeError when a call in the
    capture could not be captured: a synchronization, an allocation, a host copy)."""
    cdef Graph g = Graph.__new__(Graph)
    cdef void* exe = NULL
    with nogil:
        exe = cuda_graph_end_capture(<void*>stream, device)
    g._g = exe
    g.device = device
    return g


# ------------------------------------------------------------- device step ---

#: The order of ``device_step``'s ``config`` (Stager.step_config's keys: the core's
#: DSPARK_STEP_CONFIG_FIELDS) and ``outputs``.
STEP_CONFIG_KEYS = _row_format.STEP_CONFIG_FIELDS
STEP_OUTPUT_KEYS = tuple(name for name, _, _ in _row_format.STEP_OUTPUTS)


cdef StepConfig _config_of(tuple config) except *:
    """A StepConfig from the values of STEP_CONFIG_KEYS, field by field from the core's table (all int64)."""
    if len(config) != len(STEP_CONFIG_KEYS):
        raise ValueError("device_step: config must follow STEP_CONFIG_KEYS")
    cdef StepConfig c
    cdef char* base = <char*>&c
    cdef size_t k = 0
    while STEP_CONFIG_FIELDS[k].name != NULL:
        (<int64_t*>(base + STEP_CONFIG_FIELDS[k].offset))[0] = config[k]
        k += 1
    return c


def device_step(tuple config, uintptr_t state, uintptr_t seqs, uintptr_t counts, int count_bytes, size_t n,
                tuple outputs, uintptr_t stream):
    """device_step_cuda (csrc/cuda/step_cuda.hpp): one launch. ``config``: the values of
    STEP_CONFIG_KEYS; ``outputs``: device pointers in STEP_OUTPUT_KEYS order (0: not written)."""
    if len(config) != len(STEP_CONFIG_KEYS) or len(outputs) != len(STEP_OUTPUT_KEYS):
        raise ValueError("device_step: config and outputs must follow STEP_CONFIG_KEYS / STEP_OUTPUT_KEYS")
    cdef StepConfig c = _config_of(config)
    cdef StepOutputs o  # every pointer by the core's output list (STEP_OUTPUTS: offsets in Outputs)
    cdef char* obase = <char*>&o
    cdef size_t k = 0
    while STEP_OUTPUTS[k].name != NULL:
        (<void**>(obase + STEP_OUTPUTS[k].offset))[0] = <void*><uintptr_t>outputs[k]
        k += 1
    with nogil:
        device_step_cuda(c, <int64_t*>state, <const int64_t*>seqs, <const void*>counts, count_bytes, n, o,
                         <void*>stream)


def device_step_rows(tuple config, uintptr_t state, uintptr_t seqs, size_t n, tuple outputs, size_t capacity,
                     uintptr_t row_offsets, uintptr_t row_slots, uintptr_t row_positions, uintptr_t stream):
    """device_step_rows_cuda (csrc/cuda/step_cuda.hpp): the CSR rows of the batch the last
    step stepped, two launches. ``outputs``: that step's device pointers in STEP_OUTPUT_KEYS
    order; ``row_offsets`` (capacity + 1 int64), ``row_slots`` / ``row_positions``
    (capacity * max_rows int64 / int32; 0: not written)."""
    if len(config) != len(STEP_CONFIG_KEYS) or len(outputs) != len(STEP_OUTPUT_KEYS):
        raise ValueError("device_step_rows: config and outputs must follow STEP_CONFIG_KEYS / STEP_OUTPUT_KEYS")
    cdef StepConfig c = _config_of(config)
    cdef StepOutputs o
    cdef char* obase = <char*>&o
    cdef size_t k = 0
    while STEP_OUTPUTS[k].name != NULL:
        (<void**>(obase + STEP_OUTPUTS[k].offset))[0] = <void*><uintptr_t>outputs[k]
        k += 1
    cdef StepCsrRows r
    r.row_offsets = <int64_t*>row_offsets
    r.row_slots = <int64_t*>row_slots
    r.row_positions = <int32_t*>row_positions
    with nogil:
        device_step_rows_cuda(c, <const int64_t*>state, <const int64_t*>seqs, n, o, capacity, r, <void*>stream)


cdef void _check_host_state(const StepConfig& c, Py_ssize_t rows, Py_ssize_t cols, str fn) except *:
    """The host state must have the device state's layout: (columns, max_seqs)."""
    cdef int64_t want_rows = step_columns(c)
    cdef int64_t want_cols = c.max_seqs
    if rows != want_rows or cols != want_cols:
        raise ValueError(f"{fn}: the host step state must be ({want_rows}, {want_cols}) "
                         f"(Stager.step_state's shape), got ({rows}, {cols})")


def step_columns_to_device(tuple config, uintptr_t state, const int64_t[:, ::1] host not None,
                           const int64_t[::1] seqs not None, uintptr_t stream):
    """step_columns_to_device_cuda: the columns of ``seqs`` of the host step state (int64
    ``(columns, max_seqs)``, Stager.step_state) into the device state, on ``stream``."""
    cdef StepConfig c = _config_of(config)
    _check_host_state(c, host.shape[0], host.shape[1], "step_columns_to_device")
    cdef size_t n = seqs.shape[0]
    if n == 0:
        return
    with nogil:
        step_columns_to_device_cuda(c, <int64_t*>state, &host[0, 0], &seqs[0], n, <void*>stream)


def step_columns_to_host(tuple config, uintptr_t state, int64_t[:, ::1] host not None,
                         const int64_t[::1] seqs not None, uintptr_t stream):
    """step_columns_to_host_cuda: the columns of ``seqs`` of the device state into the host
    step state, ordered on ``stream`` (returns once they are there)."""
    cdef StepConfig c = _config_of(config)
    _check_host_state(c, host.shape[0], host.shape[1], "step_columns_to_host")
    cdef size_t n = seqs.shape[0]
    if n == 0:
        return
    with nogil:
        step_columns_to_host_cuda(c, <const int64_t*>state, &host[0, 0], &seqs[0], n, <void*>stream)
