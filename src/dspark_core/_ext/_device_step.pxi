# The device step's binding (dspark/stager.hpp, "the device step";
# dspark/step_math.hpp), part of the _stager module (included at the end of
# _stager.pyx: the Stager's methods to_device, to_host, step_many,
# check_step call these). Thin, as the Stager's: it converts, checks the
# output arrays the core writes through raw pointers, releases the GIL and
# calls once; every rule and message is the core's.
from dspark_core._ext._lib_stager cimport (
    StepOutputs, StepConfig, StepCsrRows, step_columns, STEP_CONFIG_FIELDS, STEP_OUTPUTS,
)

from dspark_core.stager import device_step as _device_step


cdef int32_t* _table_data(table, size_t* n):
    """A slot token table's ids and their count (NULL and 0 for None)."""
    if table is None:
        n[0] = 0
        return NULL
    n[0] = cnp.PyArray_DIM(<cnp.ndarray>table, 0)
    return <int32_t*>cnp.PyArray_DATA(<cnp.ndarray>table)


def _step_to_device(Stager st, seqs, tokens):
    sv = st._ids("to_device", seqs)
    cdef size_t n = cnp.PyArray_DIM(sv, 0)
    table = as_token_table("to_device", tokens, True)
    cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
    cdef size_t nt
    cdef int32_t* tp = _table_data(table, &nt)
    with nogil:
        st._core.to_device(sp, n, tp, nt)


def _step_to_host(Stager st, seqs, outcomes, tokens):
    sv = st._ids("to_host", seqs)
    cdef size_t n = cnp.PyArray_DIM(sv, 0)
    codes = outcome_codes("to_host", outcomes, sv, FAIL_STAGES, batch_context)
    table = as_token_table("to_host", tokens, False)
    cdef cnp.ndarray disabled = np.zeros(n, _I64)
    cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
    cdef const int32_t* op = NULL
    if codes is not None:
        op = <const int32_t*>cnp.PyArray_DATA(<cnp.ndarray>codes)
    cdef int64_t* dp = <int64_t*>cnp.PyArray_DATA(disabled)
    cdef size_t nt
    cdef const int32_t* tp = _table_data(table, &nt)
    with nogil:
        st._core.to_host(sp, n, op, dp, tp, nt)
    for i in np.flatnonzero(disabled).tolist():
        log_disabled(int(sv[i]), int(disabled[i]), FAIL_STAGES[int(codes[i])])
    return disabled


def _step_layout(Stager st):
    cdef StepConfig c = st._core.step_config()
    return step_columns(c), c.max_rows


def _step_many(Stager st, seqs, n_accepted, out):
    sv = st._ids("step_many", seqs)
    cdef size_t n = cnp.PyArray_DIM(sv, 0)
    av = batch_ints("step_many", "n_accepted", n_accepted, n)
    cdef StepConfig c = st._core.step_config()
    if out is None:
        out = _device_step.StepOutputs.empty(n, c.max_rows, c.block)
    elif not isinstance(out, _device_step.StepOutputs):
        raise TypeError(f"step_many: out must be a StepOutputs, got {type(out).__name__}")
    # The arrays checked are the ones written through, held here for the call
    # (the base class's reader: a subclass cannot swap it).
    arrays = _device_step.StepOutputs.checked_arrays(out, n, c.max_rows, c.block)
    cdef size_t capacity = cnp.PyArray_DIM(<cnp.ndarray>arrays[0], 0)
    if capacity > n:  # a fixed-capacity step: the entries past the batch are padding
        sv = np.concatenate([sv, np.full(capacity - n, _device_step.PADDING_ID, _I64)])
        av = np.concatenate([av, np.full(capacity - n, -1, _I64)])
        n = capacity
    cdef StepOutputs o  # every pointer from the core's output list (None: NULL, not written)
    cdef char* base = <char*>&o
    cdef size_t k = 0
    while STEP_OUTPUTS[k].name != NULL:
        arr = arrays[k]
        (<void**>(base + STEP_OUTPUTS[k].offset))[0] = NULL if arr is None else cnp.PyArray_DATA(<cnp.ndarray>arr)
        k += 1
    cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
    cdef const int64_t* ap = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>av)
    with nogil:
        st._core.step_many(sp, ap, n, o)
    return out


def _step_rows(Stager st, seqs, out, rows):
    sv = st._ids("step_rows", seqs)
    cdef size_t n = cnp.PyArray_DIM(sv, 0)
    cdef StepConfig c = st._core.step_config()
    if not isinstance(out, _device_step.StepOutputs):
        raise TypeError(f"step_rows: out must be a StepOutputs, got {type(out).__name__}")
    arrays = _device_step.StepOutputs.checked_plan_arrays(out, n)
    if rows is None:
        rows = _device_step.StepRows.empty(cnp.PyArray_DIM(<cnp.ndarray>arrays[0], 0), c.max_rows)
    elif not isinstance(rows, _device_step.StepRows):
        raise TypeError(f"step_rows: rows must be a StepRows, got {type(rows).__name__}")
    # Checked once and held for the call, as step_many's outputs.
    flat = _device_step.StepRows.checked_arrays(rows, n, c.max_rows)
    cdef size_t capacity = cnp.PyArray_DIM(<cnp.ndarray>flat[0], 0) - 1
    cdef StepOutputs o
    cdef char* base = <char*>&o
    cdef size_t k = 0
    while STEP_OUTPUTS[k].name != NULL:
        arr = arrays[k]
        (<void**>(base + STEP_OUTPUTS[k].offset))[0] = NULL if arr is None else cnp.PyArray_DATA(<cnp.ndarray>arr)
        k += 1
    cdef StepCsrRows r
    r.row_offsets = <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>flat[0])
    r.row_slots = NULL
    r.row_positions = NULL
    if flat[1] is not None:
        r.row_slots = <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>flat[1])
    if flat[2] is not None:
        r.row_positions = <int32_t*>cnp.PyArray_DATA(<cnp.ndarray>flat[2])
    cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
    with nogil:
        st._core.step_rows(sp, n, o, capacity, r)
    return rows


def _step_check(Stager st, seqs, statuses):
    sv = st._ids("check_step", seqs)
    cdef size_t n = cnp.PyArray_DIM(sv, 0)
    arr = np.ascontiguousarray(statuses, _I32)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ValueError(f"check_step: {n} sequences for statuses of shape {arr.shape}")
    cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
    cdef const int32_t* tp = <const int32_t*>cnp.PyArray_DATA(<cnp.ndarray>arr)
    with nogil:
        st._core.check_step(sp, tp, n)


def _step_config(Stager st):
    cdef StepConfig c = st._core.step_config()
    return _fields_dict(&c, STEP_CONFIG_FIELDS, _row_format.STEP_CONFIG_FIELDS)


def _step_state(Stager st):
    """The host step state as an int64 (columns, max_seqs) array over the Stager's own memory
    (the array keeps the Stager alive)."""
    cdef int64_t* p = st._core.step_state()
    cdef StepConfig c = st._core.step_config()
    cdef cnp.npy_intp dims[2]
    dims[0] = step_columns(c)
    dims[1] = c.max_seqs
    arr = cnp.PyArray_SimpleNewFromData(2, dims, cnp.NPY_INT64, <void*>p)
    cnp.set_array_base(arr, st)
    return arr
