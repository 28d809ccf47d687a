# cython: language_level=3
"""Thin Cython wrappers over the C++ row-format conversions (dspark/row_format.hpp).

Private module: use :mod:`dspark_core.formats`. Every function takes
C-contiguous numpy arrays, checks shapes and dtypes with the GIL held, and
releases the GIL around the C++ conversion.
"""
import numpy as np

from dspark_core.rows import _bf16

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.string cimport memcpy
from libcpp.string_view cimport string_view

from dspark_core._ext._lib_row_format cimport (
    Storage, ElemType, NonFinite, EncodeBounds, encode_bounds as c_encode_bounds,
    row_bytes as c_row_bytes, elem_bytes as c_elem_bytes, storage_from_name, storage_name,
    storage_block_elems, nonfinite_name, STORAGE_COUNT,
    encode_rows, decode_rows, find_nonfinite as c_find_nonfinite, staged_as_stored as c_staged_as_stored,
    dspark_set_error_types, find_unencodable,
    KernelFamily, KERNEL_ENV as C_KERNEL_ENV, KERNEL_ENV_DEPRECATED as C_KERNEL_ENV_DEPRECATED,
    kernel_family_name, kernel_path_name, kernel_path_count, kernel_path_from_name, kernel_path_supported,
    best_kernel_path, active_kernel_path, set_kernel_path, kernel_name, kernel_origin,
    kernel_env_status as c_kernel_env_status, kernel_env_deprecated as c_kernel_env_deprecated,
)
from dspark_core._ext._lib_row_format cimport ELEM_TYPE_COUNT, elem_name
from dspark_core._ext._lib_stager cimport (
    Skip, FailStage, RowMode, DrafterKind, StagerOptions, skip_name, fail_stage_name, row_mode_name,
    drafter_kind_name, check_options,
    TRIM_CHUNK as C_TRIM_CHUNK, MAX_POSITION as C_MAX_POSITION, MAX_WINDOW as C_MAX_WINDOW,
    MAX_FEATURE_DIM as C_MAX_FEATURE_DIM, MAX_SEQS_LIMIT as C_MAX_SEQS_LIMIT, w_keep as c_w_keep,
    ring_rows as c_ring_rows,
    FieldInfo, SEQ_STATE_FIELDS as C_SEQ_STATE_FIELDS, SEQ_STATS_FIELDS as C_SEQ_STATS_FIELDS,
    SEQ_STATS_GAUGES as C_SEQ_STATS_GAUGES, SEQ_STATS_PEAKS as C_SEQ_STATS_PEAKS,
    STEP_CONFIG_FIELDS as C_STEP_CONFIG_FIELDS, STEP_OUTPUTS as C_STEP_OUTPUTS,
    STEP_STATE_FIELDS as C_STEP_STATE_FIELDS,
    BATCH_META_ROWS as C_BATCH_META_ROWS, BATCH_FLAG_ROWS as C_BATCH_FLAG_ROWS, pad_rows as c_pad_rows,
    paged_rows as c_paged_rows,
    ROUND_PLAN_FIELDS as C_ROUND_PLAN_FIELDS,
)
from dspark_core._ext._lib_prefix_store cimport (
    PREFIX_HIT_FIELDS as C_PREFIX_HIT_FIELDS, PREFIX_STATS_FIELDS as C_PREFIX_STATS_FIELDS,
)
from dspark_core.errors import ConfigError, StateError

cnp.import_array()
dspark_set_error_types(ConfigError, StateError)

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
# bfloat16 (ml_dtypes) is loaded when first used (dspark_core.rows._bf16).
_U8 = np.dtype(np.uint8)

# The core's name tables, enumerated from its enums (dspark_core.stager.core_tables
# publishes and checks them): index == the C++ enum value.
STORAGES = tuple(storage_name(<Storage><uint8_t>i).decode() for i in range(STORAGE_COUNT))
#: (elements, bytes) of one block of each storage.
STORAGE_BLOCKS = tuple(
    (storage_block_elems(<Storage><uint8_t>i), c_row_bytes(<Storage><uint8_t>i, storage_block_elems(<Storage><uint8_t>i)))
    for i in range(STORAGE_COUNT))


cdef tuple _names(const char* (*name)(int) noexcept, int first):
    """Names of values ``first, first + 1, ...`` up to the first null / empty one."""
    out = []
    cdef const char* n
    for i in range(first, 256):
        n = name(i)
        if n == NULL or n[0] == 0:
            break
        out.append(n.decode())
    return tuple(out)


cdef const char* _nonfinite_name(int i) noexcept:
    return nonfinite_name(<NonFinite><uint8_t>i)


cdef const char* _skip_name(int i) noexcept:
    return skip_name(<Skip><uint8_t>i)


cdef const char* _fail_stage_name(int i) noexcept:
    return fail_stage_name(<FailStage><uint8_t>i)


cdef const char* _row_mode_name(int i) noexcept:
    return row_mode_name(<RowMode><uint8_t>i)


cdef const char* _drafter_kind_name(int i) noexcept:
    return drafter_kind_name(<DrafterKind><uint8_t>i)


NONFINITE_POLICIES = _names(_nonfinite_name, 0)
SKIP_REASONS = _names(_skip_name, 1)  # Skip::None (0) is no reason
FAIL_STAGES = _names(_fail_stage_name, 0)
ROW_MODES = _names(_row_mode_name, 0)
#: The drafters the rows serve (dspark::DrafterKind): "block", "chain".
DRAFTER_KINDS = _names(_drafter_kind_name, 0)
#: Element types rows come in and are staged out in (numpy names; dspark::ElemType).
ELEM_TYPES = tuple(elem_name(<ElemType><uint8_t>i).decode() for i in range(ELEM_TYPE_COUNT))

cdef tuple _name_list(const char* const* names):
    out = []
    cdef size_t i = 0
    while names[i] != NULL:
        out.append(names[i].decode())
        i += 1
    return tuple(out)


cdef tuple _field_names(const FieldInfo* f):
    out = []
    cdef size_t i = 0
    while f[i].name != NULL:
        out.append(f[i].name.decode())
        i += 1
    return tuple(out)


# The fields of the core's listed records, in order (their X-macro lists:
# dspark/stager.hpp, dspark/prefix_store.hpp): the keys of Stager.state() /
# stats() and PrefixStore.stats(), the fields of PrefixHit.
SEQ_STATE_FIELDS = _field_names(C_SEQ_STATE_FIELDS)
SEQ_STATS_FIELDS = _field_names(C_SEQ_STATS_FIELDS)
PREFIX_HIT_FIELDS = _field_names(C_PREFIX_HIT_FIELDS)
PREFIX_STATS_FIELDS = _field_names(C_PREFIX_STATS_FIELDS)
# The device step's constants (Stager.step_config()'s keys, the CUDA binding's order).
STEP_CONFIG_FIELDS = _field_names(C_STEP_CONFIG_FIELDS)


cdef tuple _step_outputs():
    out = []
    cdef size_t i = 0
    while C_STEP_OUTPUTS[i].name != NULL:
        out.append((C_STEP_OUTPUTS[i].name.decode(), C_STEP_OUTPUTS[i].elem_bytes, C_STEP_OUTPUTS[i].shape.decode()))
        i += 1
    return tuple(out)


# The device step's outputs, in order: (name, element bytes, shape) (DSPARK_STEP_OUTPUT_FIELDS;
# the shape in units "n", "max_rows", "block", "block+1").
STEP_OUTPUTS = _step_outputs()
# The step state's fields, in column order (DSPARK_STEP_FIELDS): Stager.step_state's first rows.
STEP_STATE_FIELDS = _name_list(C_STEP_STATE_FIELDS)

# The rows of a batch plan's two packed arrays, in order (dspark/stager.hpp,
# pack_plans): int64 ``meta`` (the last row row_offsets) and uint8 ``flags``.
BATCH_META_ROWS = _name_list(C_BATCH_META_ROWS)
BATCH_FLAG_ROWS = _name_list(C_BATCH_FLAG_ROWS)
# The fields of the core's round plan (DSPARK_ROUND_PLAN_FIELDS), which StagePlan carries.
ROUND_PLAN_FIELDS = _name_list(C_ROUND_PLAN_FIELDS)
# The stats fields that are levels (DSPARK_SEQ_STATS_GAUGES / _PEAKS); every other one is a
# counter (Stager.totals() adds it up over every sequence since the Stager began).
SEQ_STATS_GAUGES = _name_list(C_SEQ_STATS_GAUGES)
SEQ_STATS_PEAKS = _name_list(C_SEQ_STATS_PEAKS)

# The core's limits (dspark/stager.hpp).
TRIM_CHUNK = C_TRIM_CHUNK
MAX_POSITION = C_MAX_POSITION
MAX_WINDOW = C_MAX_WINDOW
MAX_FEATURE_DIM = C_MAX_FEATURE_DIM
MAX_SEQS_LIMIT = C_MAX_SEQS_LIMIT


def w_keep(int64_t block_size, int64_t window):
    """K, the rows a rebase keeps, of a configuration (``dspark::w_keep``)."""
    return c_w_keep(block_size, window)


def ring_rows(int64_t block_size, int64_t window):
    """The rows a sequence ever holds, its ring's slots, of a configuration (``dspark::ring_rows``)."""
    return c_ring_rows(block_size, window)


def check_stager_options(int64_t feature_dim, int64_t block_size, int64_t window, int64_t max_seqs, int storage,
                         int64_t max_failures, int nonfinite, int stage_dtype, int rows, int kind=0):
    """The core's check of a Stager configuration (codes are table indices):
    ConfigError naming the first unusable value, as the Stager's constructor raises."""
    cdef StagerOptions o
    o.feature_dim = feature_dim
    o.block_size = block_size
    o.window = window
    o.max_seqs = max_seqs
    o.storage = <Storage><uint8_t>storage
    o.max_failures = max_failures
    o.nonfinite = <NonFinite><uint8_t>nonfinite
    o.stage = <ElemType><uint8_t>stage_dtype
    o.rows = <RowMode><uint8_t>rows
    o.kind = <DrafterKind><uint8_t>kind
    check_options(o)

# Python-side codes of the C++ NonFinite enum. "keep" is the conversion-only
# policy: convert as-is and report nothing (Error's code).
_POLICIES = {"keep": 0, **{name: i for i, name in enumerate(NONFINITE_POLICIES)}}


cdef Storage _storage(str name) except *:
    cdef bytes b = name.encode("utf-8")
    return storage_from_name(string_view(<const char*>b, len(b)))


cdef ElemType _elem_of_dtype(dt, str what) except *:
    dt = _bf16.as_dtype(dt)
    if dt == _F32:
        return ElemType.F32
    if dt == _F16:
        return ElemType.F16
    if _bf16.is_bf16(dt):
        return ElemType.BF16
    raise TypeError(f"{what}: dtype {dt} is not supported (expected float32, float16 or bfloat16)")


cdef inline void* _ptr(cnp.ndarray a):
    return cnp.PyArray_DATA(a)


cdef cnp.ndarray _output(cnp.ndarray out, dt, tuple shape, str what):
    """``out`` checked to be a writeable C-contiguous ``dt`` array of ``shape``, or a new one."""
    if out is None:
        return np.empty(shape, dtype=dt)
    if out.dtype != dt or tuple((<object>out).shape) != shape or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{what}: out must be a writeable C-contiguous {dt} array of shape {shape}")
    return out


def row_bytes(str storage, size_t dim):
    """Bytes of one row of ``dim`` elements stored as ``storage``."""
    return c_row_bytes(_storage(storage), dim)


def storage_out_dtype(str storage):
    """numpy dtype of :func:`encode`'s output for ``storage``."""
    cdef Storage s = _storage(storage)
    if s == Storage.F32:
        return _F32
    if s == Storage.F16:
        return _F16
    if s == Storage.BF16:
        return _bf16.dtype()
    return _U8


def encode(cnp.ndarray src not None, str storage, str nonfinite="error", cnp.ndarray out=None, staged=np.float32):
    """Encode the rows of a C-contiguous (n, dim) float32/float16/bfloat16 array.

    Returns ``(encoded, first_bad)``: ``encoded`` is (n, dim) of the storage's
    float dtype for f32/f16/bf16 and uint8 (n, row_bytes) for q formats;
    ``first_bad`` is the flat index of the first NaN/Inf input under
    ``nonfinite="error"``/``"keep"`` (-1 when all finite; always -1 under
    ``"zero"``/``"clamp_f16"``). The whole input is converted either way,
    except into a caller's ``out`` under ``"error"``: that is checked first
    and left untouched when the input has an unencodable value.

    ``staged``: the dtype the rows will be staged in (a Stager's
    ``stage_dtype``); bounds are ``encode_bounds(storage, staged)``, as the
    Stager's ``process`` holds its rows to (float32: the storage's own).
    """
    cdef ElemType et = _elem_of_dtype(src.dtype, "encode")
    cdef Storage s = _storage(storage)
    cdef EncodeBounds eb = c_encode_bounds(s, _elem_of_dtype(staged, "encode staged"))
    if nonfinite not in _POLICIES:
        raise ValueError(f"nonfinite must be one of {tuple(_POLICIES)}, got {nonfinite!r}")
    cdef NonFinite pol = <NonFinite><int>_POLICIES[nonfinite]
    if src.ndim != 2:
        raise ValueError(f"encode: expected a 2-D (n_rows, dim) array, got shape {(<object>src).shape}")
    if not src.flags.c_contiguous:
        raise ValueError("encode: the input must be C-contiguous")
    cdef size_t n = <size_t>src.shape[0]
    cdef size_t dim = <size_t>src.shape[1]
    cdef size_t rb = c_row_bytes(s, dim)
    if s == Storage.Q8_0 or s == Storage.Q4_0:
        shape = (n, rb)
    else:
        shape = (n, dim)
    dt = storage_out_dtype(storage)
    # A caller's out must survive a rejected call, and the fused check reports
    # only after writing. Whichever moves fewer bytes: q formats (output at
    # most 34/128 of the f32 input) save out and put it back on a rejection;
    # float storages check the input first (one read of it). A fresh output
    # has nothing to protect and keeps the single fused pass.
    cdef bint protect = out is not None and nonfinite == "error"
    cdef bint save = protect and (s == Storage.Q8_0 or s == Storage.Q4_0)
    out = _output(out, dt, shape, "encode")
    cdef const void* sp = _ptr(src)
    cdef void* dp = _ptr(out)
    cdef size_t out_bytes = <size_t>out.nbytes
    cdef cnp.ndarray saved = np.empty(out_bytes if save else 0, _U8)
    cdef void* kp = _ptr(saved)
    cdef int64_t bad = -1
    cdef float limit = eb.limit if protect and not save else 0.0
    with nogil:
        if save:
            memcpy(kp, dp, out_bytes)
        elif protect:
            bad = find_unencodable(sp, et, n * dim, limit)
        if bad < 0:
            bad = encode_rows(sp, et, dp, s, n, dim, pol, eb)
            if save and bad >= 0:
                memcpy(dp, kp, out_bytes)  # rejected: out as it was
    return out, bad


def bounds(str storage, staged=np.float32):
    """``(limit, clamp_to)`` of ``storage`` decoded to ``staged``: ``|x| < limit``
    stays finite; ``clamp_to`` is the largest magnitude that does."""
    cdef EncodeBounds b = c_encode_bounds(_storage(storage), _elem_of_dtype(staged, "bounds"))
    return float(b.limit), float(b.clamp_to)


def decode(cnp.ndarray data not None, str storage, size_t dim, out_dtype=np.float32, cnp.ndarray out=None):
    """Decode rows stored as ``storage`` (``dim`` elements each).

    ``data`` is any C-contiguous array holding whole rows (uint8 (n, row_bytes),
    or the storage's float dtype (n, dim)); the row count is
    ``data.nbytes // row_bytes``. Output is (n, dim) of ``out_dtype``
    (float32, float16 or bfloat16), written into ``out`` when given.
    """
    cdef Storage s = _storage(storage)
    cdef ElemType et = _elem_of_dtype(out_dtype, "decode out_dtype")
    cdef size_t rb = c_row_bytes(s, dim)
    if not data.flags.c_contiguous:
        raise ValueError("decode: the data must be C-contiguous")
    cdef size_t nbytes = <size_t>data.nbytes
    if rb == 0 or nbytes % rb != 0:
        raise ValueError(f"decode: {nbytes} bytes is not a whole number of {storage} rows of dim {dim} "
                         f"({rb} bytes each)")
    cdef size_t n = nbytes // rb
    dt = _F32 if et == ElemType.F32 else (_F16 if et == ElemType.F16 else _bf16.dtype())
    shape = (n, dim)
    out = _output(out, dt, shape, "decode")
    cdef const void* sp = _ptr(data)
    cdef void* dp = _ptr(out)
    with nogil:
        decode_rows(sp, s, dp, et, n, dim)
    return out


def staged_as_stored(str storage, stage_dtype):
    """The core's rule: rows of ``storage`` staged as ``stage_dtype`` are their stored
    bytes viewed as that dtype (nothing to decode)."""
    return c_staged_as_stored(_storage(storage), _elem_of_dtype(stage_dtype, "staged_as_stored"))


_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)


def pad_rows(seqs, row_offsets, values, max_rows, out):
    """The core's padded layout (``BatchPlan.padded``): CSR rows of ``values`` (int32 or
    int64) into the rows of ``out`` (``(len(seqs), max_rows)``, the same dtype), the rest -1;
    ValueError (naming the sequence) when one has more than ``max_rows`` rows, ``out``
    then unwritten."""
    cdef cnp.ndarray sv = np.ascontiguousarray(seqs, _I64)
    cdef cnp.ndarray cu = np.ascontiguousarray(row_offsets, _I64)
    cdef cnp.ndarray v = np.ascontiguousarray(values)
    cdef cnp.ndarray o = out
    cdef size_t n = sv.shape[0], m = max_rows, total = v.shape[0]
    if cu.ndim != 1 or cu.shape[0] != n + 1 or v.ndim != 1 or o.dtype != v.dtype or not o.flags.c_contiguous \
            or o.ndim != 2 or o.shape[0] != n or o.shape[1] != m or not o.flags.writeable:
        raise ValueError("pad_rows: inconsistent shapes")
    cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
    cdef const int64_t* cp = <const int64_t*>cnp.PyArray_DATA(cu)
    if v.dtype == _I32:
        with nogil:
            c_pad_rows(sp, n, cp, <const int32_t*>cnp.PyArray_DATA(v), total, m, <int32_t*>cnp.PyArray_DATA(o))
    elif v.dtype == _I64:
        with nogil:
            c_pad_rows(sp, n, cp, <const int64_t*>cnp.PyArray_DATA(v), total, m, <int64_t*>cnp.PyArray_DATA(o))
    else:
        raise TypeError(f"pad_rows: values must be int32 or int64, got {v.dtype}")


cdef cnp.ndarray _writable_out(out, dtype, shape, str name):
    """An output the core writes through a raw pointer: exactly ``dtype`` and ``shape``, C-contiguous, writable."""
    if not isinstance(out, cnp.ndarray) or out.dtype != dtype or out.shape != shape \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"paged: {name} must be a writable C-contiguous {dtype} array of shape {shape}")
    return out


def paged_rows(seqs, pos_base, row_offsets, positions, block_tables, block_tokens, null_block, tables_out, slots_out):
    """The core's paged layout (``BatchPlan.paged``): each plan's block table (int32 ``(N, M)``)
    shifted to its window's first block into ``tables_out`` (int32 ``(N, M)``) and each context
    row's KV slot into ``slots_out`` (int64, one per row); either may be None (not written).
    ValueError (naming the sequence) for a row outside its table, nothing written."""
    cdef cnp.ndarray sv = np.ascontiguousarray(seqs, _I64)
    cdef cnp.ndarray pb = np.ascontiguousarray(pos_base, _I64)
    cdef cnp.ndarray cu = np.ascontiguousarray(row_offsets, _I64)
    cdef cnp.ndarray pv = np.ascontiguousarray(positions, _I32)
    cdef cnp.ndarray bt = np.asarray(block_tables)
    cdef size_t n = sv.shape[0]
    if bt.ndim != 2 or bt.dtype != _I32 or bt.shape[0] != n:
        raise ValueError(f"paged: block_tables must be int32 of shape ({n}, M), got {bt.dtype} of shape "
                         f"{(<object>bt).shape}")
    if bt.shape[1] > 1 and bt.strides[1] != 4 or bt.strides[0] < 0 or bt.strides[0] % 4:
        bt = np.ascontiguousarray(bt)  # the core reads rows of consecutive ids at a whole-id stride
    cdef size_t m = bt.shape[1], total = pv.shape[0]
    cdef size_t stride = bt.strides[0] // 4 if n > 1 else m
    if sv.ndim != 1 or pb.ndim != 1 or pb.shape[0] != n or cu.ndim != 1 or cu.shape[0] != n + 1 or pv.ndim != 1:
        raise ValueError("paged: inconsistent shapes")
    cdef int64_t tokens = block_tokens
    cdef int32_t null = null_block
    cdef int32_t* tp = NULL
    cdef int64_t* op = NULL
    if tables_out is not None:
        tp = <int32_t*>cnp.PyArray_DATA(_writable_out(tables_out, _I32, (n, m), "tables_out"))
    if slots_out is not None:
        op = <int64_t*>cnp.PyArray_DATA(_writable_out(slots_out, _I64, (total,), "slots_out"))
    with nogil:
        c_paged_rows(<const int64_t*>cnp.PyArray_DATA(sv), n, <const int64_t*>cnp.PyArray_DATA(pb),
                     <const int64_t*>cnp.PyArray_DATA(cu), <const int32_t*>cnp.PyArray_DATA(pv), total,
                     <const int32_t*>cnp.PyArray_DATA(bt), m, stride, tokens, null, tp, op)


def find_nonfinite(cnp.ndarray src not None):
    """Flat index of the first NaN/Inf in a C-contiguous float32/float16/bfloat16 array, or -1."""
    cdef ElemType et = _elem_of_dtype(src.dtype, "find_nonfinite")
    if not src.flags.c_contiguous:
        raise ValueError("find_nonfinite: the input must be C-contiguous")
    cdef const void* sp = _ptr(src)
    cdef size_t n = <size_t>src.size
    cdef int64_t r
    with nogil:
        r = c_find_nonfinite(sp, et, n)
    return r


# -- The dispatch registry (dspark/dispatch.hpp) --------------------------------

cdef const char* _family_name(int i) noexcept:
    return kernel_family_name(<KernelFamily><uint8_t>i)


#: Kernel families chosen at run time, in the core's order ("row_format", "crc32c").
KERNEL_FAMILIES = _names(_family_name, 0)
#: The variable that forces paths, and its deprecated CRC-32C-only predecessor.
KERNEL_ENV = C_KERNEL_ENV.decode()
KERNEL_ENV_DEPRECATED = C_KERNEL_ENV_DEPRECATED.decode()
_KERNEL_ENV_STATUS = ("unset", "used", "unknown", "unsupported")  # dspark::KernelEnv order


cdef KernelFamily _family(family) except *:
    if family not in KERNEL_FAMILIES:
        raise ValueError(f"unknown kernel family {family!r} (expected one of {', '.join(KERNEL_FAMILIES)})")
    return <KernelFamily><uint8_t>KERNEL_FAMILIES.index(family)


cdef str _path_name(KernelFamily f, int p):
    return kernel_path_name(f, p).decode()


def kernel_paths(family):
    """Every path name of ``family`` (portable first; other CPUs' paths included)."""
    cdef KernelFamily f = _family(family)
    return tuple(_path_name(f, p) for p in range(kernel_path_count(f)))


def kernel_supported(family):
    """The paths of ``family`` this CPU and build run, portable first."""
    cdef KernelFamily f = _family(family)
    return tuple(_path_name(f, p) for p in range(kernel_path_count(f)) if kernel_path_supported(f, p))


def kernel_best(family):
    """The fastest supported path of ``family``."""
    cdef KernelFamily f = _family(family)
    return _path_name(f, best_kernel_path(f))


def kernel_active(family):
    """The path ``family`` runs now."""
    cdef KernelFamily f = _family(family)
    return _path_name(f, active_kernel_path(f))


def kernel_set(family, str name):
    """Make ``name`` the active path of ``family`` (process-wide).

    ValueError for an unknown name or a path this CPU / build does not support.
    """
    cdef KernelFamily f = _family(family)
    cdef bytes b = name.encode("utf-8")
    cdef int p = kernel_path_from_name(f, string_view(<const char*>b, len(b)))
    if p < 0:
        raise ValueError(f"unknown {family} path {name!r} (expected one of {', '.join(kernel_paths(family))})")
    set_kernel_path(f, p)


def kernel_table(family):
    """``(kernel, path)`` for each kernel of ``family``: whose code the active path runs."""
    cdef KernelFamily f = _family(family)
    cdef int active = active_kernel_path(f)
    out = []
    cdef int k = 0
    while kernel_name(f, k) != NULL:
        out.append((kernel_name(f, k).decode(), kernel_origin(f, k, active).decode()))
        k += 1
    return tuple(out)


def kernel_env_status():
    """What DSPARK_SIMD holds: "unset", "used", "unknown" (a name that is no path) or
    "unsupported" (a path this CPU / build lacks)."""
    return _KERNEL_ENV_STATUS[<int>c_kernel_env_status()]


def kernel_env_deprecated():
    """Whether the deprecated DSPARK_CRC32C is set."""
    return c_kernel_env_deprecated()


# The row-format family under its first names: the old module path
# dspark_core._row_format (0.1.0) had these and still serves them
# (tests/test_public_api.py); dspark_core.formats goes through kernels.

def simd_paths():
    """Names of the row-format paths this CPU and build support, scalar first."""
    return list(kernel_supported("row_format"))


def best_simd_path():
    """Name of the fastest supported row-format path."""
    return kernel_best("row_format")


def active_simd_path():
    """Name of the row-format path conversions use now."""
    return kernel_active("row_format")


def set_simd_path(str name):
    """Make ``name`` ("scalar", "avx2", "avx512", "neon", "neon-bf16") the active row-format path."""
    kernel_set("row_format", name)
