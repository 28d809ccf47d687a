# cython: language_level=3
"""Thin Cython wrapper of the C++ Stager (dspark/stager.hpp).

The binding converts Python objects to what the core takes (``_args``: types,
array shapes), releases the GIL and calls. Every rule (sequence ids, round
state, value ranges, positions, strict mode, the limits) is the core's and
is not checked here; a conversion that fails lets the core's sequence checks
speak first (``_sequence_errors_first``: docs/design.md 2.1). The core
locks each call's sequences (one mutex per sequence), so calls on different
sequences from different threads run in parallel (docs/design.md 2.9).
"""

import numpy as np

cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.utility cimport move, pair
from libcpp.vector cimport vector

from dspark_core._ext._lib_row_format cimport (
    Storage, ElemType, NonFinite, dspark_set_error_types, decode_rows, staged_as_stored,
)
from dspark_core._ext._lib_stager cimport (
    Stager as CStager, StagerOptions, RoundPlan, RowView, ByteVec, BufferPool, SeqState, SeqStats, Skip, FailStage,
    DrafterKind, RowMode, RowOptions, SlotMove, FieldInfo, Need, SEQ_STATE_FIELDS, pack_plans, SEQ_STATS_FIELDS, StagerTotals, advise_huge_pages, mismatch_cause,
    TRIM_CHUNK as C_TRIM_CHUNK, MAX_POSITION as C_MAX_POSITION,
    crc32c as c_crc32c, batch_context as c_batch_context,
    copy_slot_rows as copy_slot_rows_core,
)

from dspark_core.stager._args import (
    as_choice, as_index, as_int64, as_nodes, as_parents, as_positions, as_seq_ids, as_token_table, as_tokens,
    batch_ints,
    batch_paths_args,
    batch_rows_args, batch_tree_args, encoded_args, fail_stage_codes, tree_args, outcome_codes, process_args, readable_bytes, row_dtype_code, view_args, writable_bytes,
)
from dspark_core.stager.config import DRAFTER_KINDS, STORAGES, NONFINITE_POLICIES, ROW_MODES, STAGE_DTYPES, StagerConfig
from dspark_core.errors import ConfigError, StateError
from dspark_core.stager.protocol_mismatch import log_disabled, log_mismatch
from dspark_core.rows.slot_moves import RestoredSlots, SlotMoves, no_moves
from dspark_core.stager.stage_plan import DISABLED_WARNING, FAIL_STAGES, SKIP_REASONS, BatchContext, BatchPlan, StagePlan
from dspark_core._ext import _row_format
from dspark_core.stager import totals as _totals
from dspark_core.stager.pickling import reduce_stager

cnp.import_array()
dspark_set_error_types(ConfigError, StateError)

#: The core's lazy-trim chunk (rows) and position limit (``core_tables`` publishes them).
TRIM_CHUNK = C_TRIM_CHUNK
MAX_POSITION = C_MAX_POSITION


# Core enum order: Skip::None, then SKIP_REASONS; FailStage follows FAIL_STAGES.
_SKIPS = (None, *SKIP_REASONS)
_FAIL_STAGES = {name: <FailStage><uint8_t>i for i, name in enumerate(FAIL_STAGES)}
_U8 = np.dtype(np.uint8)
_I32 = np.dtype(np.int32)
# Rows of the core's batch layout (pack_plans).
cdef size_t _META_ROWS = len(_row_format.BATCH_META_ROWS)
cdef size_t _FLAG_ROWS = len(_row_format.BATCH_FLAG_ROWS)
_I64 = np.dtype(np.int64)
# The batch calls that take only sequence ids (Stager._on_seqs).
cdef enum _SeqsCall:
    _COMMIT_MANY
    _CONFIRM_MANY
    _CANCEL_MANY
    _END_MANY
    _DISABLE_MANY
    _ENABLE_MANY


# The keys of state() / stats(): the core's field lists (stager.hpp), in order.
_STATE_FIELDS = _row_format.SEQ_STATE_FIELDS
_STATS_FIELDS = _row_format.SEQ_STATS_FIELDS


cdef dict _fields_dict(const void* record, const FieldInfo* f, tuple names):
    """A listed record (SeqState, SeqStats, PrefixHit, PrefixStats) as a dict, field by field from the core's table."""
    cdef dict out = {}
    cdef const char* base = <const char*>record
    cdef size_t i = 0
    while f[i].name != NULL:
        if f[i].is_bool:
            out[names[i]] = (<const bool*>(base + f[i].offset))[0]
        else:
            out[names[i]] = (<const int64_t*>(base + f[i].offset))[0]
        i += 1
    return out


cdef inline int64_t _i64(name, value) except? -1:
    """An integer argument: a Python int that fits int64 directly, anything else through ``as_int64``."""
    cdef int overflow = 0
    cdef long long v
    if type(value) is int:
        v = PyLong_AsLongLongAndOverflow(value, &overflow)
        if not overflow:
            return v
    return as_int64(name, value)


cdef int _set_row_options(RowOptions* o, object config) except -1:
    """The rows' configuration of a StagerConfig (a Stager's and its prefix store's)."""
    o.feature_dim = _i64("feature_dim", config.feature_dim)
    o.block_size = _i64("block_size", config.block_size)
    o.window = _i64("window", config.window)
    o.storage = <Storage><uint8_t>STORAGES.index(config.storage)
    o.nonfinite = <NonFinite><uint8_t>NONFINITE_POLICIES.index(config.nonfinite)
    o.stage = <ElemType><uint8_t>STAGE_DTYPES.index(config.stage_dtype)
    o.rows = <RowMode><uint8_t>ROW_MODES.index(config.rows)
    return 0


cdef inline const int32_t* _ids_ptr(object ids):
    """The data of an int32 array of token ids, NULL for None."""
    if ids is None:
        return NULL
    return <const int32_t*>cnp.PyArray_DATA(<cnp.ndarray>ids)


cdef object _moves_array(vector[SlotMove]& v):
    """(n, 3) int64 ``[src_slot, dst_slot, count]`` rows, in the order they apply."""
    cdef cnp.ndarray out = np.empty((v.size(), 3), _I64)
    cdef int64_t* p = <int64_t*>cnp.PyArray_DATA(out)
    cdef size_t i
    for i in range(v.size()):
        p[3 * i] = v[i].src
        p[3 * i + 1] = v[i].dst
        p[3 * i + 2] = v[i].count
    return out


cdef object _plan_slots(RoundPlan& p):
    """The plan's slots, in plan order, from its (at most two) runs."""
    cdef int64_t a = p.slot_runs[0].count, b = p.slot_runs[1].count
    cdef cnp.ndarray out = np.empty(a + b, _I64)
    cdef int64_t* q = <int64_t*>cnp.PyArray_DATA(out)
    cdef int64_t i, f0 = p.slot_runs[0].first, f1 = p.slot_runs[1].first
    for i in range(a):
        q[i] = f0 + i
    for i in range(b):
        q[a + i] = f1 + i
    return out


# -- CRC-32C of snapshot format v2 (the core's dispatched kernels; the path
# switch is the registry's, dspark_core.kernels) ------------------------------


def crc32c(data, crc=0):
    """CRC-32C (Castagnoli) of a bytes-like object, chained from ``crc``, on the active path."""
    cdef const uint8_t[::1] view = readable_bytes(data)
    cdef size_t n = view.shape[0]
    cdef const uint8_t* p = &view[0] if n else NULL
    cdef uint32_t c = as_index("crc", crc) & 0xFFFFFFFF
    with nogil:
        c = c_crc32c(c, p, n)
    return c


def copy_slot_rows(src, dst, moves):
    """The row copies of ``moves`` (``(n, 3)`` int64 ``[src, dst, count]``, applied in order) from
    the table ``src`` to the table ``dst`` (C-contiguous uint8 ``(rows, row_bytes)`` of one width;
    ``dst`` may be ``src``). Every move is checked first (ValueError: nothing copied). An owner's
    copies of one table change in one call, the GIL released."""
    cdef cnp.ndarray s, d, m
    for name, t in (("src", src), ("dst", dst)):
        if not (isinstance(t, np.ndarray) and t.dtype == np.uint8 and t.ndim == 2 and t.flags.c_contiguous):
            raise TypeError(f"copy_slot_rows: {name} must be a C-contiguous 2-D uint8 table")
    s, d = src, dst
    if s.shape[1] != d.shape[1]:
        raise ValueError(f"copy_slot_rows: rows of {s.shape[1]} and {d.shape[1]} bytes")
    if not d.flags.writeable:
        raise ValueError("copy_slot_rows: dst is read-only")
    m = np.ascontiguousarray(moves, np.int64)
    if m.ndim != 2 or m.shape[1] != 3:
        raise ValueError(f"copy_slot_rows: moves must be (n, 3), got shape {np.shape(m)}")
    cdef const SlotMove* mp = <const SlotMove*>cnp.PyArray_DATA(m)
    cdef size_t n = m.shape[0], row_bytes = s.shape[1]
    cdef const uint8_t* sp = <const uint8_t*>cnp.PyArray_DATA(s)
    cdef uint8_t* dp = <uint8_t*>cnp.PyArray_DATA(d)
    cdef int64_t src_rows = s.shape[0], dst_rows = d.shape[0]
    with nogil:
        copy_slot_rows_core(mp, n, sp, src_rows, dp, dst_rows, row_bytes)


def batch_context(call, i, seq):
    """What a batch call's error about ``seqs[i]`` starts with (the core's words)."""
    return c_batch_context(call.encode(), i, seq).decode()


cdef inline bint _plain_positions(x):
    """A C-contiguous 1-D int64 ndarray (the hot path's positions)."""
    if type(x) is not np.ndarray:
        return False
    cdef cnp.ndarray a = <cnp.ndarray>x
    return (cnp.PyArray_NDIM(a) == 1 and cnp.PyArray_TYPE(a) == cnp.NPY_INT64 and cnp.PyArray_IS_C_CONTIGUOUS(a)
            and cnp.PyArray_ISNOTSWAPPED(a))


cdef inline bint _plain_tokens(x, size_t n):
    """A C-contiguous 1-D int32 ndarray of n ids (the hot path's token ids: no conversion)."""
    if type(x) is not np.ndarray:
        return False
    cdef cnp.ndarray a = <cnp.ndarray>x
    return (cnp.PyArray_NDIM(a) == 1 and cnp.PyArray_TYPE(a) == cnp.NPY_INT32 and cnp.PyArray_IS_C_CONTIGUOUS(a)
            and cnp.PyArray_ISNOTSWAPPED(a) and <size_t>cnp.PyArray_DIM(a, 0) == n)


cdef inline bint _plain_rows(x, int64_t dim, ElemType* t):
    """A C-contiguous (n, dim) float32 / float16 ndarray; sets its element type."""
    if type(x) is not np.ndarray:
        return False
    cdef cnp.ndarray a = <cnp.ndarray>x
    if (cnp.PyArray_NDIM(a) != 2 or cnp.PyArray_DIM(a, 1) != dim or not cnp.PyArray_IS_C_CONTIGUOUS(a)
            or not cnp.PyArray_ISNOTSWAPPED(a)):
        return False
    cdef int typenum = cnp.PyArray_TYPE(a)
    if typenum == cnp.NPY_FLOAT32:
        t[0] = ElemType.F32
    elif typenum == cnp.NPY_FLOAT16:
        t[0] = ElemType.F16
    else:
        return False  # bfloat16 and everything else: the general path
    return True


cdef int _readonly_bytes(Py_buffer* b, int flags, object owner, const void* data, Py_ssize_t* shape,
                         Py_ssize_t* strides) except -1:
    """Fill ``b`` with ``shape[0]`` read-only bytes at ``data`` owned by ``owner``: plans are
    read-only views (as the reference's are), and a writer is refused."""
    if flags & PyBUF_WRITABLE:
        raise BufferError("staged rows are read-only")
    strides[0] = 1
    b.buf = <void*>data
    b.format = "B"
    b.internal = NULL
    b.itemsize = 1
    b.len = shape[0]
    b.ndim = 1
    b.obj = owner
    b.readonly = 1
    b.shape = shape
    b.strides = strides
    b.suboffsets = NULL
    return 0


cdef class _Bytes:
    """A C++ byte vector exposed through the buffer protocol (zero-copy to numpy).

    When the last view of it goes, a large buffer returns to its Stager's
    pool for the next rebase (no fresh pages to fault in and zero).
    """
    cdef ByteVec v
    cdef shared_ptr[BufferPool] pool
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]

    def __dealloc__(self):
        if self.pool:
            self.pool.get().give(move(self.v))

    def __getbuffer__(self, Py_buffer* b, int flags):
        self._shape[0] = <Py_ssize_t>self.v.size()
        _readonly_bytes(b, flags, self, self.v.data(), self._shape, self._strides)

    def __releasebuffer__(self, Py_buffer* b):
        pass


cdef class _RingRows:
    """The ring bytes behind ``draft(copy=False)``'s read-only views: holding the
    core's share of the ring's storage keeps them allocated (the ring may let
    them go: end, restore, the Stager's destruction), so a view outliving its
    rows reads rows that replaced them, never freed memory. Its buffer refuses
    writers, so numpy will not make a view of it writable."""
    cdef shared_ptr[const void] keep
    cdef const uint8_t* data
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]

    def __getbuffer__(self, Py_buffer* b, int flags):
        _readonly_bytes(b, flags, self, self.data, self._shape, self._strides)

    def __releasebuffer__(self, Py_buffer* b):
        pass


cdef tuple _view_runs(RowView& v, size_t row_bytes):
    """A draft_view's runs as read-only uint8 ``(n_k, row_bytes)`` views of the ring (one per non-empty run)."""
    out = []
    cdef _RingRows holder
    cdef cnp.ndarray a
    cdef cnp.npy_intp dims[2]
    cdef int k
    for k in range(2):
        if v.rows[k]:
            holder = _RingRows.__new__(_RingRows)
            holder.keep = v.keep
            holder.data = v.data[k]
            holder._shape[0] = <Py_ssize_t>(v.rows[k] * row_bytes)
            # The array over the ring's bytes, its base the holder (whose buffer refuses
            # writers, so numpy will not let the array be made writable).
            dims[0] = <cnp.npy_intp>v.rows[k]
            dims[1] = <cnp.npy_intp>row_bytes
            a = cnp.PyArray_SimpleNewFromData(2, dims, cnp.NPY_UINT8, <void*>v.data[k])
            cnp.PyArray_CLEARFLAGS(a, cnp.NPY_ARRAY_WRITEABLE)
            cnp.set_array_base(a, holder)
            out.append(a)
    return tuple(out)


cdef class _SnapshotBytes:
    """The bytes object ``snapshot`` returns, made by the core's allocator call."""
    cdef object data


cdef uint8_t* _snapshot_bytes(size_t n, void* ctx) noexcept with gil:
    """Stager::snapshot_alloc's allocator: a bytes object written in place (no second
    copy). The core calls it with none of its locks held, so taking the GIL here
    cannot deadlock; it calls again if the sequence changed size in between."""
    cdef _SnapshotBytes out = <_SnapshotBytes>ctx
    try:
        out.data = PyBytes_FromStringAndSize(NULL, n)
    except MemoryError:
        out.data = None
        return NULL  # the core raises std::bad_alloc: MemoryError
    cdef char* dp = PyBytes_AS_STRING(out.data)
    advise_huge_pages(dp, n)  # fresh memory: fault it in 2 MiB at a time
    return <uint8_t*>dp


cdef class _BatchViews:
    """The rows of ``draft_many(..., copy=False)``: each sequence's runs where they lie in
    its ring (the core's RowViews, which share the rings' storage). A sequence of
    values: ``views[i]`` is the ``i``-th sequence's runs as read-only arrays
    (``_view_runs``), made when read."""
    cdef vector[RowView] views
    cdef size_t row_bytes

    def __len__(self):
        return self.views.size()

    def __getitem__(self, Py_ssize_t i):
        if i < 0 or <size_t>i >= self.views.size():
            raise IndexError(i)
        return _view_runs(self.views[i], self.row_bytes)


# GIL kept by commit, accept and draft(copy=False): they change a few counters
# (the zero-copy draft copies no row, whatever its size), and releasing and
# retaking the GIL costs more than that. Two threads running rounds on their own
# sequences then hand the GIL over twice per round (process, draft) instead of
# four times (bench/bench_threads.py: Python threads, q8_0, 1.10-1.18x -> 1.37-1.42x),
# once with zero-copy drafts.
# Safe: while holding the GIL a call may wait for its sequence's lock, and no
# core call holding a sequence lock ever waits for the GIL.


cdef class Stager:
    """Windowed drafter staging for ``config.max_seqs`` sequences (C++ core).

    See docs/protocol.md for the round protocol (docs/design.md section 2 for its rules)::

        st.begin(seq)
        st.process(seq, positions, rows)   # after every target decode
        plan = st.draft(seq, n_past)       # -> StagePlan (plan.skip = reason)
        st.commit(seq) / st.fail(seq, stage)
        st.accept(seq, n_accepted)         # after verification

    A rejected call raises (``ValueError``, ``TypeError``, ``StateError``) and
    changes no state. Safe to call from several threads; calls on different
    sequences run in parallel. Each call has a batched twin for many sequences
    at once (``process_many``, ``draft_many``, ``commit_many``, ...; flat arrays,
    one call into the core: docs/design.md 2.9).
    """

    cdef CStager* _core
    cdef readonly object config
    cdef int64_t _D
    cdef int64_t _B
    cdef size_t _row_bytes
    cdef object _stage_dtype
    cdef bint _view_rows
    cdef bint _external
    cdef bint _chain  # a chain drafter's Stager: token ids beside the rows
    cdef object _decoder
    cdef object _as_rows  # encoded rows -> stage rows: a view when formats agree, else _decoder
    cdef object _batch_ctx  # what every BatchPlan of this Stager shares (made on first draft_many)
    cdef Storage _storage
    cdef ElemType _stage

    def __cinit__(self, config):
        if not isinstance(config, StagerConfig):
            raise TypeError(f"config must be a StagerConfig, got {type(config).__name__}")
        cdef StagerOptions o
        _set_row_options(&o, config)
        o.max_seqs = _i64("max_seqs", config.max_seqs)
        o.max_failures = _i64("max_failures", config.max_failures)
        o.strict = config.strict is True
        o.kind = <DrafterKind><uint8_t>DRAFTER_KINDS.index(config.kind)
        self._core = new CStager(o)  # checks every value (ConfigError), a tampered config's too
        self._external = o.rows == RowMode.External
        self._chain = o.kind == DrafterKind.Chain
        self.config = config
        self._D = o.feature_dim
        self._B = o.block_size
        self._row_bytes = self._core.row_bytes()
        self._stage_dtype = config.numpy_stage_dtype
        # Staged rows are a free view of the encoded bytes when formats agree (the core's rule).
        self._view_rows = staged_as_stored(o.storage, o.stage)
        # Otherwise plan.rows decodes lazily, into a buffer of the Stager's pool.
        self._storage = o.storage
        self._stage = o.stage
        self._decoder = None if self._view_rows else self._decode_rows
        self._as_rows = self._rows_view if self._view_rows else self._decode_rows

    def __dealloc__(self):
        del self._core

    def _rows_view(self, enc):
        """``plan.rows`` of encoded rows ``(n, row_bytes)`` stored in the stage dtype: a free view."""
        return enc.view(self._stage_dtype).reshape(enc.shape[0], self._D)

    def _decode_rows(self, enc):
        """``plan.rows`` of encoded rows ``(n, row_bytes)`` in another format than the stage
        dtype: decoded into a buffer of the Stager's pool (a fresh one would fault in and
        zero new pages each round, under the address-space lock every thread shares)."""
        enc = np.ascontiguousarray(enc, _U8)
        cdef size_t n = enc.shape[0]
        cdef size_t nbytes = n * <size_t>self._D * (<size_t>self._stage_dtype.itemsize)
        cdef _Bytes out = _Bytes()
        out.pool = self._core.pool()
        cdef const void* src = cnp.PyArray_DATA(<cnp.ndarray>enc)
        cdef size_t dim = self._D
        with nogil:
            out.pool.get().grow(out.v, nbytes)
            out.v.resize(nbytes)
            if n:
                decode_rows(src, self._storage, out.v.data(), self._stage, n, dim)
        return np.frombuffer(out, _U8).view(self._stage_dtype).reshape(n, self._D)

    def __reduce__(self):
        """Pickle / deepcopy: the config plus every sequence's snapshot (``stager.pickling``)."""
        return reduce_stager(self)

    def __repr__(self):
        c = self.config
        return (f"Stager(feature_dim={c.feature_dim}, block_size={c.block_size}, window={c.window}, "
                f"max_seqs={c.max_seqs}, storage={c.storage!r}"
                + (", rows='external')" if self._external else ")"))

    @property
    def w_keep(self):
        """Rows kept on a rebase (``K = min(W // 2, W - B)``)."""
        return self._core.w_keep()

    @property
    def ring_rows(self):
        """Ring slots per sequence (``W + TRIM_CHUNK + B + 1``): sequence ``s``
        owns the global slots ``[s * ring_rows, (s + 1) * ring_rows)``; an
        external-row owner allocates ``max_seqs * ring_rows`` rows."""
        return self._core.ring_rows()

    @property
    def moves_issued(self):
        """Table changes numbered so far (the last one's ``serial``): non-empty
        moves of ``fork`` / ``shift`` and, in external-row mode, the slots of a
        ``restore`` that brings rows back. An owner applies them in that order."""
        return self._core.moves_issued()

    @property
    def last_change(self):
        """The call that issued the newest table change (``"fork"``, ``"shift"``,
        ``"restore"``, ``"publish_prefix"``: a prefix store's publish,
        ``"start_from_prefix"``: its hit), ``""`` before the first."""
        return self._core.last_change().decode()

    def open_round_id(self, seq):
        """The round open on ``seq`` (``plan.round`` of its plan), or 0 when none is."""
        cdef int64_t s = _i64("seq", seq)
        cdef uint64_t r
        with nogil:
            r = self._core.open_round_id(s)
        return r

    # -- conversion errors come after the core's sequence checks -----------
    cdef int _sequence_errors_first(self, const int64_t* seqs, size_t n, Need need) except -1:
        """A conversion of this call's arguments failed: raise the core's error for
        its sequence (unknown id, round state) if there is one (design.md 2.1)."""
        err = None
        try:
            with nogil:
                self._core.check_sequence(seqs[0], need)
        except Exception as exc:  # the core's error replaces the conversion's
            err = exc
        if err is not None:
            raise err from None
        return 0

    cdef object _converted(self, int64_t s, Need need, convert, tuple args):
        """``convert(*args)``; when it fails, ``seq``'s own errors come first."""
        try:
            return convert(*args)
        except (TypeError, ValueError):
            self._sequence_errors_first(&s, 1, need)
            raise

    cdef int _batch_errors_first(self, str call, cnp.ndarray sv, Need need) except -1:
        """A conversion of a batch call's arguments failed: raise the core's error for
        its sequences (an unknown id, a state) if there is one, as the call would."""
        cdef bytes name = call.encode()
        cdef const char* cname = name
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        err = None
        try:
            with nogil:
                self._core.check_batch(cname, sp, n, need)
        except Exception as exc:  # the core's error replaces the conversion's
            err = exc
        if err is not None:
            raise err from None
        return 0

    cdef object _batch_converted(self, str call, cnp.ndarray sv, Need need, convert, tuple args):
        """``convert(*args)`` for a batch call; when it fails, its sequences' own errors come first."""
        try:
            return convert(*args)
        except (TypeError, ValueError):
            self._batch_errors_first(call, sv, need)
            raise

    cdef cnp.ndarray _ids(self, str call, seqs):
        """A batch's sequence ids as a 1-D int64 array (the caller's, when it is one)."""
        return seqs if _plain_positions(seqs) else as_seq_ids(call, seqs)

    cdef cnp.ndarray _per_seq(self, str call, cnp.ndarray sv, Need need, str name, values):
        """One int64 value per sequence of the batch (n_pasts, n_accepted)."""
        if _plain_positions(values) and cnp.PyArray_DIM(<cnp.ndarray>values, 0) == cnp.PyArray_DIM(sv, 0):
            return values
        return self._batch_converted(call, sv, need, batch_ints, (call, name, values, cnp.PyArray_DIM(sv, 0)))

    cdef int64_t _arg(self, int64_t s, name, value) except? -1:
        """An integer argument of a call on ``s`` (a conversion error after ``s``'s own errors)."""
        cdef int overflow = 0
        cdef long long v
        if type(value) is int:
            v = PyLong_AsLongLongAndOverflow(value, &overflow)
            if not overflow:
                return v
        return self._converted(s, Need.Ready, as_int64, (name, value))

    cdef object _moves(self, vector[SlotMove]& v, uint64_t serial):
        if v.size() == 0:
            return no_moves(self)
        return SlotMoves.wrap(_moves_array(v), self, serial)

    cdef object _plan(self, RoundPlan& p, object data, size_t offset, tuple runs=None):
        cdef int64_t n = p.n_rows
        if p.report_mismatch:  # the core's report, once per sequence: this layer only logs it
            log_mismatch(p.seq, p.start, _SKIPS[<int>p.skip], p.end - 1, mismatch_cause(p.start, p.end).decode())
        if <int>p.skip != 0:  # dspark::Skip::None
            return StagePlan.skipped(p.seq, p.start, _SKIPS[<int>p.skip], feature_dim=self._D,
                                     row_bytes=self._row_bytes, stage_dtype=self._stage_dtype,
                                     external=self._external, chain=self._chain)
        # The rows: none (external mode), views of the ring (draft(copy=False), `runs`),
        # or `data[offset:]` (the plan's own copy).
        enc = rows = decode = None
        if runs is not None:
            decode = self._as_rows
            if n == 0:  # nothing staged (a rebase onto no context): no run to view
                enc = np.zeros((0, self._row_bytes), _U8)
        elif not self._external:
            enc = data[offset: offset + n * self._row_bytes].reshape(n, self._row_bytes)
            rows = self._rows_view(enc) if self._view_rows else None
            decode = self._decoder
        return StagePlan(
            seq=p.seq, start=p.start, skip=None, rebase=p.rebase, clear_cache=p.clear_cache,
            n_rows=n, block_size=self._B,  # positions and block_positions made on first access
            crop_from=p.crop_from, pos_base=p.pos_base, encoded_rows=enc, rows=rows, decode=decode,
            encoded_runs=runs, slots=_plan_slots(p), external=self._external,
            source=self if self._external else None, round=p.round,
            tokens=self._token_ids(p.seq, p.first_row, p.start) if self._chain else None)

    cdef cnp.ndarray _token_ids(self, int64_t s, int64_t start, int64_t stop):
        """The ids kept beside the rows of ``[start, stop)`` (a chain drafter's Stager)."""
        cdef cnp.ndarray out = np.empty(stop - start if stop > start else 0, _I32)
        cdef int32_t* op = <int32_t*>cnp.PyArray_DATA(out)
        with nogil:
            self._core.tokens(s, start, stop, op)
        return out

    def tokens(self, seq, start, stop):
        """The token ids kept beside the rows of positions ``[start, stop)`` (int32), oldest
        first: a chain drafter's Stager (``kind="chain"``) only, every position stageable
        (inside :meth:`buffered_positions`). A plan's are ``plan.tokens`` already."""
        cdef int64_t s = _i64("seq", seq)
        cdef int64_t a = self._converted(s, Need.Any, as_int64, ("start", start))
        cdef int64_t b = self._converted(s, Need.Any, as_int64, ("stop", stop))
        return self._token_ids(s, a, b)

    # -- round protocol ---------------------------------------------------
    def begin(self, seq):
        """Reset ``seq`` for a new request (re-enables a disabled sequence)."""
        cdef int64_t s = _i64("seq", seq)
        with nogil:
            self._core.begin(s)

    def process(self, seq, positions, rows=None, tokens=None):
        """Buffer the target's capture rows (float32/float16/bfloat16, ``(n, D)``) at ``positions``.

        ``tokens`` (a chain drafter's Stager, ``kind="chain"``: required; else
        must be None): the id of the token the target read at each row's
        position (``n`` integers >= 0), kept beside the row.

        Held mode: returns None. The rows are read with the GIL released:
        another thread must not write to ``rows`` during the call.

        External-row mode (``rows="external"``): pass no rows; returns the
        int64 slot where the owner writes each row (same order as
        ``positions``; -1 for a row below the horizon, which no round can
        stage and need not be written). The core never sees the rows, so the
        owner checks them for NaN / Inf first (``DeviceRing.write`` does).
        """
        cdef int64_t s = _i64("seq", seq)
        cdef ElemType t
        if not self._external and _plain_positions(positions) and _plain_rows(rows, self._D, &t) and \
                cnp.PyArray_DIM(<cnp.ndarray>rows, 0) == cnp.PyArray_DIM(<cnp.ndarray>positions, 0):
            # Fast path: C-contiguous int64 positions and float32/float16 rows of
            # the right width, nothing to convert.
            pos, arr = positions, rows
        else:
            pos, arr = self._converted(s, Need.Ready, process_args, (self._external, self._D, positions, rows))
            if self._external:
                return self._process_external(s, pos, tokens)
            t = <ElemType><uint8_t>row_dtype_code(arr.dtype)
        cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>pos, 0)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(pos)
        cdef const void* rp = cnp.PyArray_DATA(arr)
        tokens = self._tokens_arg(s, tokens, n)
        cdef const int32_t* tp = _ids_ptr(tokens)
        with nogil:
            self._core.process(s, pp, n, rp, t, tp)

    cdef object _tokens_arg(self, int64_t s, tokens, size_t n):
        """``tokens`` as the core reads them (an int32 array, or None), after ``s``'s own errors."""
        if tokens is None or _plain_tokens(tokens, n):
            return tokens
        return self._converted(s, Need.Ready, as_tokens, ("", tokens, n))

    cdef object _flat_tokens_arg(self, str call, cnp.ndarray sv, tokens, size_t total):
        """A batch's flat ``tokens`` as the core reads them (or None), after its sequences' own errors."""
        if tokens is None or _plain_tokens(tokens, total):
            return tokens
        return self._batch_converted(call, sv, Need.Ready, as_tokens, (call, tokens, total))

    cdef object _process_external(self, int64_t s, pos, tokens):
        cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>pos, 0)
        cdef cnp.ndarray slots = np.empty(n, _I64)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(pos)
        cdef int64_t* sp = <int64_t*>cnp.PyArray_DATA(slots)
        tokens = self._tokens_arg(s, tokens, n)
        cdef const int32_t* tp = _ids_ptr(tokens)
        with nogil:
            self._core.process_external(s, pp, n, sp, tp)
        return slots

    def check_process(self, seq, positions, tokens=None):
        """Raise what ``process(seq, positions, ..., tokens=tokens)`` would raise for its
        sequence, positions and token ids, in its order, and change nothing: an owner of
        external rows (``DeviceRing.write``) runs it before it looks at the rows."""
        cdef int64_t s = _i64("seq", seq)
        pos = self._converted(s, Need.Ready, as_positions, (positions,))
        cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>pos, 0)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(pos)
        tokens = self._tokens_arg(s, tokens, n)
        cdef const int32_t* tp = _ids_ptr(tokens)
        with nogil:
            self._core.check_process(s, pp, n, tp)

    def check_process_many(self, seqs, cu_seqlens, positions, tokens=None):
        """Raise what ``process_many(seqs, cu_seqlens, positions, ..., tokens=tokens)`` would
        raise for its sequences, offsets, positions and token ids, in its order, and change
        nothing: an owner of external rows (``write_many``) runs it before it looks at the rows."""
        sv = self._ids("process_many", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        cu, pos, _ = self._batch_converted("process_many", sv, Need.Ready, batch_rows_args,
                                           ("process_many", True, self._D, n, cu_seqlens, positions, None))
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* cp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>cu)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>pos)
        cdef size_t total = cnp.PyArray_DIM(<cnp.ndarray>pos, 0)
        tokens = self._flat_tokens_arg("process_many", sv, tokens, total)
        cdef const int32_t* tp = _ids_ptr(tokens)
        with nogil:
            self._core.check_process_many(sp, n, cp, pp, total, tp)

    def process_encoded(self, seq, positions, data, tokens=None):
        """Buffer rows already in storage format: uint8 ``(n, row_bytes)`` (or ``n * row_bytes`` flat).

        ``tokens``: as for :meth:`process` (a chain drafter's Stager).

        The bytes are stored as given. Under ``nonfinite="error"`` a row whose
        stored values (f32 / f16 / bf16) or block scales (q8_0 / q4_0) are not
        finite is rejected; the ``"zero"`` and ``"clamp_f16"`` policies do not
        rewrite encoded rows.
        """
        cdef int64_t s = _i64("seq", seq)
        pos, buf = self._converted(s, Need.Ready, encoded_args, (self._external, self._row_bytes, positions, data))
        cdef size_t n = pos.shape[0]
        cdef size_t nbytes = buf.shape[0]
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(pos)
        cdef const uint8_t* dp = <const uint8_t*>cnp.PyArray_DATA(buf)
        tokens = self._tokens_arg(s, tokens, n)
        cdef const int32_t* tp = _ids_ptr(tokens)
        with nogil:
            self._core.process_encoded(s, pp, n, dp, nbytes, tp)

    def draft(self, seq, n_past, copy=True):
        """Plan this round for a target at ``n_past``: a :class:`StagePlan` (opens a round unless skipped).

        ``copy=False`` (held mode): no copy of the staged rows. The plan's
        ``encoded_runs`` / ``row_runs`` are then read-only views of the rows
        where they lie in the sequence's ring (at most two runs: the ring
        wraps at most once), so a rebase hands the drafter ``W / 2`` rows
        without moving them. The views hold the rows until the next call that
        may change this sequence's rows (any call on it but ``commit``,
        ``fail`` and the read-only ones): read them, or upload them, before
        the verify batch is processed. A view kept longer reads whatever rows
        replaced its own (it keeps the memory allocated: never a crash).
        ``encoded_rows`` / ``rows`` of such a plan are a view too when the
        rows are one run, else a copy made on first access.
        """
        cdef int64_t s = _i64("seq", seq)
        if copy is not True and not self._converted(s, Need.Ready, view_args, (self._external, copy)):
            return self._draft_view(s, self._arg(s, "n_past", n_past))
        cdef int64_t start = self._arg(s, "n_past", n_past)
        cdef _Bytes out = _Bytes()
        out.pool = self._core.pool()
        cdef RoundPlan p
        with nogil:
            p = self._core.draft(s, start, out.v)
        return self._plan(p, np.frombuffer(out, _U8), 0)

    cdef object _draft_view(self, int64_t s, int64_t start):
        cdef RowView v
        cdef RoundPlan p = self._core.draft_view(s, start, v)  # GIL kept: O(1), no row copied
        return self._plan(p, None, 0, _view_runs(v, self._row_bytes))

    def draft_many(self, seqs, n_pasts, copy=True):
        """``draft`` for several sequences as one drafter batch: a :class:`BatchPlan` of arrays.

        ``seqs``: the sequence ids (1-D integers, each once); ``n_pasts``: one
        ``n_past`` per sequence. One call into the core (GIL released), which
        checks the whole batch first: a rejected batch raises, naming the
        sequence (``draft_many: seqs[i] (sequence s): ...``), and opens no round.

        ``copy=False`` (held mode): no copy of the staged rows, as
        ``draft(copy=False)``: the plan's ``encoded_runs`` / ``row_runs`` are
        read-only views of the rows where they lie in the rings, each
        sequence's valid until the next call that may change its rows.
        """
        sv = self._ids("draft_many", seqs)
        pv = self._per_seq("draft_many", sv, Need.Ready, "n_pasts", n_pasts)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(pv)
        cdef vector[RoundPlan] plans
        cdef _BatchViews views
        if copy is not True and not self._batch_converted("draft_many", sv, Need.Ready, view_args,
                                                          (self._external, copy, "draft_many")):
            views = _BatchViews.__new__(_BatchViews)
            views.row_bytes = self._row_bytes
            with nogil:  # the core names the call as the caller knows it
                self._core.draft_many_view(sp, pp, n, plans, views.views, b"draft_many")
            return self._batch_plan(plans, None, views)
        cdef _Bytes out = _Bytes()
        out.pool = self._core.pool()
        with nogil:
            self._core.draft_many(sp, pp, n, plans, out.v)
        return self._batch_plan(plans, out)

    cdef object _batch_plan(self, vector[RoundPlan]& plans, _Bytes out, _BatchViews views=None):
        """The core's plans as a :class:`BatchPlan` of arrays (one pass in C, a few allocations);
        ``views``: a zero-copy batch's rows (``out`` then None)."""
        cdef size_t n = plans.size(), i
        cdef int64_t total = 0
        cdef int reports = 0
        for i in range(n):
            total += plans[i].n_rows
            reports += plans[i].report_mismatch
        # The core's batch layout (pack_plans; its rows named by BATCH_META_ROWS / BATCH_FLAG_ROWS).
        cdef cnp.ndarray meta = np.empty((_META_ROWS, n + 1), _I64)
        cdef cnp.ndarray flags = np.empty((_FLAG_ROWS, n), _U8)
        cdef cnp.ndarray positions = np.empty(total, _I32)
        cdef cnp.ndarray slots = np.empty(total, _I64)
        with nogil:
            pack_plans(plans.data(), n, <int64_t*>cnp.PyArray_DATA(meta), <uint8_t*>cnp.PyArray_DATA(flags),
                       <int32_t*>cnp.PyArray_DATA(positions), <int64_t*>cnp.PyArray_DATA(slots))
        if reports:  # the core's reports, once per sequence: this layer only logs them
            for i in range(n):
                if plans[i].report_mismatch:
                    log_mismatch(plans[i].seq, plans[i].start, _SKIPS[<int>plans[i].skip], plans[i].end - 1,
                                 mismatch_cause(plans[i].start, plans[i].end).decode())
        enc = None if self._external or out is None else np.frombuffer(out, _U8).reshape(total, self._row_bytes)
        if self._batch_ctx is None:
            self._batch_ctx = BatchContext(self._B, self._D, self._row_bytes, self._stage_dtype,
                                           self._core.max_plan_rows(), self.config.storage, self._view_rows,
                                           self._external, self if self._external else None)
        return BatchPlan.packed(self._batch_ctx, meta, flags, positions, slots, enc, views,
                                self._batch_tokens(plans, total) if self._chain else None)

    cdef cnp.ndarray _batch_tokens(self, vector[RoundPlan]& plans, int64_t total):
        """The token ids beside a batch plan's rows, flat in plan order (a chain drafter's Stager)."""
        cdef cnp.ndarray out = np.empty(total, _I32)
        cdef int32_t* op = <int32_t*>cnp.PyArray_DATA(out)
        cdef size_t i
        with nogil:
            for i in range(plans.size()):
                if plans[i].n_rows:
                    self._core.tokens(plans[i].seq, plans[i].first_row, plans[i].start, op)
                    op += plans[i].n_rows
        return out

    # -- batches: one call for many sequences (docs/design.md 2.9) ------------
    def process_many(self, seqs, cu_seqlens, positions, rows=None, tokens=None):
        """``process`` for the sequences of one target forward, rows flat as in a varlen batch.

        ``tokens`` (a chain drafter's Stager): flat as the rows, one id per row.

        The rows of ``seqs[i]`` are rows ``[cu_seqlens[i], cu_seqlens[i + 1])``
        of ``positions`` (int, ``(total,)``) and, in held mode, of ``rows``
        (``(total, D)`` float32 / float16 / bfloat16); ``cu_seqlens`` has
        ``len(seqs) + 1`` entries rising from 0 to ``total``. One call into
        the core with the GIL released; the whole batch is checked first (a
        rejected batch appends nothing anywhere) and an error names the
        sequence. Held mode: returns None. External-row mode (no rows):
        returns the flat int64 slots, one per row (-1 below the horizon).
        """
        sv = self._ids("process_many", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        cdef ElemType t = ElemType.F32
        if (_plain_positions(cu_seqlens) and _plain_positions(positions)
                and cnp.PyArray_DIM(<cnp.ndarray>cu_seqlens, 0) == n + 1
                and (rows is None if self._external else _plain_rows(rows, self._D, &t)
                     and cnp.PyArray_DIM(<cnp.ndarray>rows, 0) == cnp.PyArray_DIM(<cnp.ndarray>positions, 0))):
            cu, pos, arr = cu_seqlens, positions, rows  # nothing to convert
        else:
            cu, pos, arr = self._batch_converted("process_many", sv, Need.Ready, batch_rows_args,
                                                 ("process_many", self._external, self._D, n, cu_seqlens, positions,
                                                  rows))
            if arr is not None:
                t = <ElemType><uint8_t>row_dtype_code(arr.dtype)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* cp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>cu)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>pos)
        cdef size_t total = cnp.PyArray_DIM(<cnp.ndarray>pos, 0)
        cdef cnp.ndarray slots
        cdef int64_t* op
        cdef const void* rp
        tokens = self._flat_tokens_arg("process_many", sv, tokens, total)
        cdef const int32_t* tp = _ids_ptr(tokens)
        if self._external:
            slots = np.empty(total, _I64)
            op = <int64_t*>cnp.PyArray_DATA(slots)
            with nogil:  # the core names the call as the caller knows it
                self._core.process_external_many(sp, n, cp, pp, total, op, b"process_many", tp)
            return slots
        rp = cnp.PyArray_DATA(<cnp.ndarray>arr)
        with nogil:
            self._core.process_many(sp, n, cp, pp, total, rp, t, tp)

    def accept_many(self, seqs, n_accepted):
        """``accept`` for several sequences: ``n_accepted[i]`` for ``seqs[i]`` (one call, checked whole)."""
        sv = self._ids("accept_many", seqs)
        av = self._per_seq("accept_many", sv, Need.Ready, "n_accepted", n_accepted)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* ap = <const int64_t*>cnp.PyArray_DATA(av)
        with nogil:
            self._core.accept_many(sp, ap, n)

    def commit_many(self, seqs):
        """``commit`` for several sequences (one call, checked whole)."""
        self._on_seqs(_COMMIT_MANY, "commit_many", seqs)

    cdef int _on_seqs(self, _SeqsCall which, str call, seqs) except -1:
        """One of the batch calls that take only sequence ids (``_COMMIT_MANY`` ...)."""
        sv = self._ids(call, seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        with nogil:
            if which == _COMMIT_MANY:
                self._core.commit_many(sp, n)
            elif which == _CONFIRM_MANY:
                self._core.confirm_many(sp, n)
            elif which == _CANCEL_MANY:
                self._core.cancel_many(sp, n)
            elif which == _DISABLE_MANY:
                self._core.disable_many(sp, n)
            elif which == _ENABLE_MANY:
                self._core.enable_many(sp, n)
            else:
                self._core.end_many(sp, n)
        return 0

    def fail_many(self, seqs, stages="decode"):
        """``fail`` for several sequences: ``stages`` is one stage name for all of them, or one
        per sequence (names, or integer codes: the index in ``FAIL_STAGES``). Returns int64
        ``(N,)``: ``fail``'s answer per sequence (its failure count where this failure
        disabled it, else 0), as ``to_host``'s and the C ABI's ``disabled_after``."""
        sv = self._ids("fail_many", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        codes = self._batch_converted("fail_many", sv, Need.Open, fail_stage_codes,
                                      ("fail_many", stages, sv, FAIL_STAGES, batch_context))
        cdef cnp.ndarray disabled = np.zeros(n, _I64)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const FailStage* fp = <const FailStage*>cnp.PyArray_DATA(<cnp.ndarray>codes)
        cdef int64_t* dp = <int64_t*>cnp.PyArray_DATA(disabled)
        with nogil:
            self._core.fail_many(sp, fp, n, dp)
        for i in np.flatnonzero(disabled).tolist():
            log_disabled(int(sv[i]), int(disabled[i]), FAIL_STAGES[int(codes[i])])
        return disabled

    def end(self, seq):
        """The request on ``seq`` is over (finished or aborted): drop its state, whatever it
        is (an open round, a reservation), and free its rows. The sequence is then as a
        new Stager's; the next request on it calls ``begin`` (or ``process``)."""
        cdef int64_t s = _i64("seq", seq)
        with nogil:
            self._core.end(s)

    def end_many(self, seqs):
        """``end`` for several sequences (one call)."""
        self._on_seqs(_END_MANY, "end_many", seqs)

    # -- drafting per request -------------------------------------------------
    def disable(self, seq):
        """Turn drafting off for the request on ``seq``: every ``draft`` then skips with
        ``"drafting_off"`` while its rows keep being processed (and trimmed) as always.
        Any state; on a sequence handed over to the device step it writes the step
        state's ``drafting_off`` column, and its steps skip with ``SKIP_DRAFTING_OFF``
        (a GPU server's device copy needs the same column: ``cuda.DeviceStep.set_drafting``).
        Idempotent. ``begin`` / ``end`` and a prefix start clear it, ``fork`` copies it,
        snapshots carry it."""
        cdef int64_t s = _i64("seq", seq)
        with nogil:
            self._core.disable(s)

    def enable(self, seq):
        """Turn drafting back on for ``seq``: the next ``draft`` plans at once, with the
        context the rows give (a rebase when they outgrew the window meanwhile)."""
        cdef int64_t s = _i64("seq", seq)
        with nogil:
            self._core.enable(s)

    def disable_many(self, seqs):
        """``disable`` for several sequences: every id checked first, nothing changed on an error."""
        self._on_seqs(_DISABLE_MANY, "disable_many", seqs)

    def enable_many(self, seqs):
        """``enable`` for several sequences: every id checked first, nothing changed on an error."""
        self._on_seqs(_ENABLE_MANY, "enable_many", seqs)

    # -- slots before the rows (external-row mode) ----------------------------
    def reserve(self, seq, positions, tokens=None):
        """External-row mode: the slots ``process(seq, positions)`` would return, before the rows exist.

        A GPU server calls it before it launches the target's forward (as it
        computes the KV cache's slot mapping), so that the capture kernel
        writes the rows straight into their slots. The sequence then holds a
        reservation: every call on it but ``confirm``, ``cancel`` and ``end``
        raises ``StateError``. ``confirm(seq)`` once the rows are written (the
        state is then what ``process`` leaves); ``cancel(seq)`` if the forward
        was aborted (the sequence is exactly as before). ``tokens``: a chain
        drafter's Stager's ids, as :meth:`process` takes them.
        """
        cdef int64_t s = _i64("seq", seq)
        pos = self._converted(s, Need.Ready, as_positions, (positions,))
        cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>pos, 0)
        cdef cnp.ndarray slots = np.empty(n, _I64)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>pos)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(slots)
        tokens = self._tokens_arg(s, tokens, n)
        cdef const int32_t* tp = _ids_ptr(tokens)
        with nogil:
            self._core.reserve(s, pp, n, op, tp)
        return slots

    def reserve_many(self, seqs, cu_seqlens, positions, tokens=None):
        """``reserve`` for the sequences of one target forward (flat, as ``process_many``):
        returns the flat int64 slots (``tokens``: flat, a chain drafter's Stager's)."""
        sv = self._ids("reserve_many", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        if _plain_positions(cu_seqlens) and _plain_positions(positions) and \
                cnp.PyArray_DIM(<cnp.ndarray>cu_seqlens, 0) == n + 1:
            cu, pos = cu_seqlens, positions
        else:
            cu, pos, _ = self._batch_converted("reserve_many", sv, Need.Ready, batch_rows_args,
                                               ("reserve_many", True, self._D, n, cu_seqlens, positions, None))
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* cp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>cu)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>pos)
        cdef size_t total = cnp.PyArray_DIM(<cnp.ndarray>pos, 0)
        cdef cnp.ndarray slots = np.empty(total, _I64)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(slots)
        tokens = self._flat_tokens_arg("reserve_many", sv, tokens, total)
        cdef const int32_t* tp = _ids_ptr(tokens)
        with nogil:
            self._core.reserve_many(sp, n, cp, pp, total, op, tp)
        return slots

    def confirm(self, seq):
        """The rows of ``seq``'s reservation are in the owner's table: they are the sequence's now."""
        cdef int64_t s = _i64("seq", seq)
        with nogil:
            self._core.confirm(s)

    def cancel(self, seq):
        """The rows of ``seq``'s reservation never came (the forward was aborted): as if
        ``reserve`` had not been called."""
        cdef int64_t s = _i64("seq", seq)
        with nogil:
            self._core.cancel(s)

    def confirm_many(self, seqs):
        """``confirm`` for several sequences (one call, checked whole)."""
        self._on_seqs(_CONFIRM_MANY, "confirm_many", seqs)

    def cancel_many(self, seqs):
        """``cancel`` for several sequences (one call, checked whole)."""
        self._on_seqs(_CANCEL_MANY, "cancel_many", seqs)

    def open_round_ids(self, seqs):
        """``open_round_id`` of several sequences, as an int64 array (one call)."""
        sv = self._ids("open_round_ids", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        cdef cnp.ndarray out = np.empty(n, _I64)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef uint64_t* op = <uint64_t*>cnp.PyArray_DATA(out)
        with nogil:
            self._core.open_round_ids(sp, n, op)
        return out

    def changes_of(self, seqs):
        """The serial of the newest table change that copies rows into or out of the slots of
        any of ``seqs`` (an array of ids; 0: none yet). An owner that has applied
        fewer changes than this refuses to write or gather those sequences' rows."""
        sv = self._ids("changes_of", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef uint64_t newest
        with nogil:
            newest = self._core.changes_of(sp, n)
        return newest

    def commit(self, seq):
        """The drafter decode and crop of the open round succeeded."""
        cdef int64_t s = _i64("seq", seq)
        self._core.commit(s)  # O(1) bookkeeping: the GIL kept (see above Stager)

    def fail(self, seq, stage="decode"):
        """The drafter ``stage`` ("decode" or "crop") failed: the next round restages cleanly.
        Returns the sequence's failure count when this failure disabled it (drafting off
        until ``begin``: ``max_failures`` in a row), else 0."""
        cdef int64_t s = _i64("seq", seq)
        cdef FailStage fs = _FAIL_STAGES[stage] if isinstance(stage, str) and stage in _FAIL_STAGES \
            else <FailStage><uint8_t>self._converted(s, Need.Open, as_choice, ("stage", stage, FAIL_STAGES))
        cdef int64_t disabled_after
        with nogil:
            disabled_after = self._core.fail(s, fs)
        if disabled_after:
            log_disabled(s, disabled_after, FAIL_STAGES[<int>fs])
        return disabled_after

    def accept(self, seq, n_accepted):
        """Keep the rows of the accepted tokens (``n_accepted + 1``) of the last verify batch."""
        cdef int64_t s = _i64("seq", seq)
        cdef int64_t n = self._arg(s, "n_accepted", n_accepted)
        self._core.accept(s, n)  # O(1) bookkeeping: the GIL kept (see above Stager)

    # -- tree verification (docs/design.md 2.11) ---------------------------
    def process_tree(self, seq, n_past, parents, rows=None, tokens=None):
        """Buffer a tree verify batch: the rows of a draft tree's nodes, the first rows after a round's draft.

        Node 0 is the root (the token ``last``, at ``n_past``, the
        sequence's end); ``parents[i]`` is node i's parent (``parents[0] ==
        -1``, ``0 <= parents[i] < i``) and node i stands at position
        ``n_past + depth(i)``; 1 to ``block_size + 1`` nodes. Until
        :meth:`accept_path` keeps the accepted path, every other call on the
        sequence but ``end``, ``disable`` / ``enable`` and the read-only ones
        raises StateError. Held mode: ``rows`` ``(n, D)`` float32 / float16 /
        bfloat16, returns None. External-row mode (no rows): returns the
        int64 slot where the owner writes each node's row. ``tokens`` (a chain
        drafter's Stager): each node's token id, as :meth:`process` takes them.
        """
        cdef int64_t s = _i64("seq", seq)
        cdef int64_t p = self._arg(s, "n_past", n_past)
        par, arr = self._converted(s, Need.Ready, tree_args, (self._external, self._D, parents, rows))
        cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>par, 0)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>par)
        tokens = self._tokens_arg(s, tokens, n)
        cdef const int32_t* tp = _ids_ptr(tokens)
        cdef cnp.ndarray slots
        cdef int64_t* op
        cdef const void* rp
        cdef ElemType t
        if self._external:
            slots = np.empty(n, _I64)
            op = <int64_t*>cnp.PyArray_DATA(slots)
            with nogil:
                self._core.process_tree_external(s, p, pp, n, op, tp)
            return slots
        t = <ElemType><uint8_t>row_dtype_code(arr.dtype)
        rp = cnp.PyArray_DATA(<cnp.ndarray>arr)
        with nogil:
            self._core.process_tree(s, p, pp, n, rp, t, tp)

    def check_process_tree(self, seq, n_past, parents, tokens=None):
        """Raise what ``process_tree(seq, n_past, parents, ..., tokens=tokens)`` would raise for
        its sequence, root, parents and token ids, in its order, and change nothing: an owner of
        external rows (``DeviceRing.write_tree``) runs it before it looks at the rows."""
        cdef int64_t s = _i64("seq", seq)
        cdef int64_t p = self._arg(s, "n_past", n_past)
        par = self._converted(s, Need.Ready, as_parents, (parents,))
        cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>par, 0)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>par)
        tokens = self._tokens_arg(s, tokens, n)
        cdef const int32_t* tp = _ids_ptr(tokens)
        with nogil:
            self._core.check_process_tree(s, p, pp, n, tp)

    def process_tree_many(self, seqs, cu_seqlens, n_pasts, parents, rows=None, tokens=None):
        """``process_tree`` for several sequences (one call, checked whole): the tree of
        ``seqs[i]`` is ``parents[cu_seqlens[i]:cu_seqlens[i + 1]]`` rooted at ``n_pasts[i]``,
        its rows those rows of ``rows`` (held mode). External-row mode (no rows): returns
        the flat int64 slots, one per node. ``tokens`` (a chain drafter's Stager): flat as
        the nodes."""
        sv = self._ids("process_tree_many", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        cdef ElemType t = ElemType.F32
        if (_plain_positions(cu_seqlens) and _plain_positions(n_pasts) and _plain_positions(parents)
                and cnp.PyArray_DIM(<cnp.ndarray>cu_seqlens, 0) == n + 1
                and cnp.PyArray_DIM(<cnp.ndarray>n_pasts, 0) == n
                and (rows is None if self._external else _plain_rows(rows, self._D, &t)
                     and cnp.PyArray_DIM(<cnp.ndarray>rows, 0) == cnp.PyArray_DIM(<cnp.ndarray>parents, 0))):
            cu, roots, par, arr = cu_seqlens, n_pasts, parents, rows  # nothing to convert
        else:
            cu, roots, par, arr = self._batch_converted(
                "process_tree_many", sv, Need.Ready, batch_tree_args,
                ("process_tree_many", self._external, self._D, n, cu_seqlens, n_pasts, parents, rows))
            if arr is not None:
                t = <ElemType><uint8_t>row_dtype_code(arr.dtype)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* cp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>cu)
        cdef const int64_t* rp_ = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>roots)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>par)
        cdef size_t total = cnp.PyArray_DIM(<cnp.ndarray>par, 0)
        cdef cnp.ndarray slots
        cdef int64_t* op
        cdef const void* xp
        tokens = self._flat_tokens_arg("process_tree_many", sv, tokens, total)
        cdef const int32_t* tp = _ids_ptr(tokens)
        if self._external:
            slots = np.empty(total, _I64)
            op = <int64_t*>cnp.PyArray_DATA(slots)
            with nogil:
                self._core.process_tree_external_many(sp, n, cp, rp_, pp, total, op, b"process_tree_many", tp)
            return slots
        xp = cnp.PyArray_DATA(<cnp.ndarray>arr)
        with nogil:
            self._core.process_tree_many(sp, n, cp, rp_, pp, total, xp, t, tp)

    def accept_path(self, seq, nodes):
        """Keep the accepted path of the tree verify batch: ``nodes`` from the root (0) down,
        each node a child of the one before, at consecutive positions from ``n_past``.

        ``accept(seq, len(nodes) - 1)`` of a chain: the other nodes' rows go.
        Returns the copies that compact the path, as :meth:`shift` does
        (held mode: applied already; external rows: apply them in order).
        """
        cdef int64_t s = _i64("seq", seq)
        nv = nodes if _plain_positions(nodes) else self._converted(s, Need.Tree, as_nodes, (nodes,))
        cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>nv, 0)
        cdef const int64_t* np_ = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>nv)
        cdef vector[SlotMove] moves
        cdef uint64_t serial = 0
        with nogil:
            moves = self._core.accept_path(s, np_, n, &serial)
        return self._moves(moves, serial)

    def accept_path_many(self, seqs, cu_seqlens, nodes):
        """``accept_path`` for several sequences (one call, checked whole): the path of
        ``seqs[i]`` is ``nodes[cu_seqlens[i]:cu_seqlens[i + 1]]``. Returns the copies of all
        of them, in batch order, numbered as one table change."""
        sv = self._ids("accept_path_many", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        if (_plain_positions(cu_seqlens) and _plain_positions(nodes)
                and cnp.PyArray_DIM(<cnp.ndarray>cu_seqlens, 0) == n + 1):
            cu, nv = cu_seqlens, nodes
        else:
            cu, nv = self._batch_converted("accept_path_many", sv, Need.Tree, batch_paths_args,
                                           ("accept_path_many", n, cu_seqlens, nodes))
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* cp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>cu)
        cdef const int64_t* np_ = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>nv)
        cdef size_t total = cnp.PyArray_DIM(<cnp.ndarray>nv, 0)
        cdef vector[SlotMove] moves
        cdef uint64_t serial = 0
        with nogil:
            moves = self._core.accept_path_many(sp, n, cp, np_, total, &serial)
        return self._moves(moves, serial)

    # -- lifecycle ----------------------------------------------------------
    def rollback(self, seq, n_past):
        """The target rolled back to ``n_past``: drop rows ``>= n_past`` (restage if the cache reached past it)."""
        cdef int64_t s = _i64("seq", seq)
        cdef int64_t p = self._arg(s, "n_past", n_past)
        with nogil:
            self._core.rollback(s, p)

    def shift(self, seq, n_keep, n_discard):
        """Mirror the target's context shift: drop ``[n_keep, n_keep + n_discard)``, move later rows down.

        Returns the copies the owner of external rows applies, a
        :class:`~dspark_core.rows.slot_moves.SlotMoves` ((n, 3) int64
        ``[src_slot, dst_slot, count]`` rows, in order; each a plain copy:
        source and destination never overlap); empty when nothing moves.
        Held mode: the core has applied them itself.
        """
        cdef int64_t s = _i64("seq", seq)
        cdef int64_t k = self._arg(s, "n_keep", n_keep)
        cdef int64_t d = self._arg(s, "n_discard", n_discard)
        cdef vector[SlotMove] moves
        cdef uint64_t serial = 0
        with nogil:
            moves = self._core.shift(s, k, d, &serial)
        return self._moves(moves, serial)

    def fork(self, src, dst):
        """Give ``dst`` an independent copy of ``src``'s state; ``dst`` restages on its next round.

        Returns the copies of ``src``'s rows into ``dst``'s slots, as
        :meth:`shift` does ((n, 3) int64, at most two rows).
        """
        cdef int64_t a = _i64("src", src)
        cdef int64_t b = _i64("dst", dst)
        cdef vector[SlotMove] moves
        cdef uint64_t serial = 0
        with nogil:
            moves = self._core.fork(a, b, &serial)
        return self._moves(moves, serial)

    def snapshot_size(self, seq):
        """Bytes ``snapshot(seq)`` returns and ``snapshot_into(seq, ...)`` writes."""
        cdef int64_t s = _i64("seq", seq)
        cdef size_t n
        with nogil:
            n = self._core.snapshot_size(s)
        return n

    def snapshot_into(self, seq, buffer):
        """Write the snapshot (``snapshot_format``) into ``buffer``; returns the bytes written.

        ``buffer`` is any writable C-contiguous buffer (bytearray, ndarray,
        mmap, shared memory), written in place in one pass over the rows with
        the GIL released. Too small (see ``snapshot_size``): ``ValueError``,
        nothing written.
        """
        cdef int64_t s = _i64("seq", seq)
        cdef uint8_t[::1] out = self._converted(s, Need.Ready, writable_bytes, (buffer,))
        cdef size_t cap = out.shape[0]
        cdef uint8_t* dp = &out[0] if cap else NULL
        cdef size_t n
        with nogil:
            n = self._core.snapshot_into(s, dp, cap)
        return n

    def snapshot(self, seq):
        """The sequence's state as versioned, checksummed bytes (``snapshot_format``)."""
        cdef int64_t s = _i64("seq", seq)
        cdef _SnapshotBytes out = _SnapshotBytes()
        with nogil:
            self._core.snapshot_alloc(s, _snapshot_bytes, <void*>out)
        return out.data

    def restore(self, seq, data):
        """Replace the sequence's state with a snapshot; bad data raises ValueError and changes nothing.

        External-row mode: the snapshot carries the bookkeeping only; returns
        the int64 slots where the owner puts the saved rows back (the rows of
        ``live_slots(seq)`` at snapshot time, oldest first), a
        :class:`~dspark_core.rows.slot_moves.RestoredSlots` numbered among the
        table changes (``serial``) like the moves of ``fork`` / ``shift``. A
        snapshot of the other row mode is a ValueError. Held mode: returns None.

        ``data`` is any buffer (bytes, bytearray, memoryview, ndarray, mmap),
        read in place with the GIL released: another thread must not write to
        it during the call.
        """
        cdef int64_t s = _i64("seq", seq)
        cdef const uint8_t[::1] raw = self._converted(s, Need.Ready, readable_bytes, (data,))
        cdef size_t n = raw.shape[0]
        cdef const uint8_t* dp = &raw[0] if n else NULL
        cdef RoundPlan p
        cdef uint64_t serial = 0
        with nogil:
            self._core.restore(s, dp, n, p.slot_runs, &serial)
        return RestoredSlots.wrap(_plan_slots(p), self, serial) if self._external else None

    def check_restore(self, seq, data):
        """Every check ``restore(seq, data)`` makes, changing nothing: the number of rows the
        snapshot brings back (in external-row mode, the rows the owner passes back with it).
        The same errors as ``restore``."""
        cdef int64_t s = _i64("seq", seq)
        cdef const uint8_t[::1] raw = self._converted(s, Need.Ready, readable_bytes, (data,))
        cdef size_t n = raw.shape[0]
        cdef const uint8_t* dp = &raw[0] if n else NULL
        cdef int64_t rows
        with nogil:
            rows = self._core.check_restore(s, dp, n)
        return rows

    # -- introspection ------------------------------------------------------
    def state(self, seq):
        """The sequence's protocol state as a dict (the same keys as the reference's)."""
        cdef int64_t s = _i64("seq", seq)
        cdef SeqState st
        with nogil:
            st = self._core.state(s)
        return _fields_dict(&st, SEQ_STATE_FIELDS, _STATE_FIELDS)

    def stats(self, seq):
        """Counters since the sequence's last ``begin``.

        rounds, commits, failures, rebases, skips: rounds opened, committed,
        failed, rebased, and drafts skipped. staged_rows / restaged_rows:
        context rows staged (all / on rebases). live_rows: rows that can
        still be staged. trims / trimmed_rows: head drops of rows below the
        horizon. rows / peak_rows: rows held (live plus a not-yet-trimmed dead
        head, < TRIM_CHUNK). bytes / peak_bytes:
        ring memory written so far (resident). reserved_bytes: ring address
        space reserved up front (W + TRIM_CHUNK + B + 1 rows; pages become
        resident only when written). skips_<reason>: the skips of each
        reason (``SKIP_REASONS``), summing to skips. verified_rounds /
        accepted_tokens: the rounds whose verify count arrived and their
        accepted drafts summed (``accepted(seq)``'s total and weighted sum).
        The reference twin keeps every counter but the three byte counts with
        the same values (it models the ring's lazy trims as bookkeeping).
        """
        cdef int64_t s = _i64("seq", seq)
        cdef SeqStats t
        with nogil:
            t = self._core.stats(s)
        return _fields_dict(&t, SEQ_STATS_FIELDS, _STATS_FIELDS)

    def accepted(self, seq):
        """The sequence's histogram of accepted drafts per verified round since its last
        ``begin``: int64 ``[block_size + 1]``, the rounds with ``k`` accepted at ``[k]``.

        A round is verified by the first ``accept`` after its ``commit`` that acts (its
        verify rows arrived), before the next ``draft``; the drafts that ``accept`` keeps pick
        the bucket (its count, or fewer when fewer verify rows arrived). Plain decodes (their ``draft`` skipped), failed rounds and rounds
        whose rows a ``rollback`` / ``shift`` dropped count nothing. ``stats(seq)["verified_rounds"]`` is the sum.
        """
        cdef int64_t s = _i64("seq", seq)
        cdef vector[int64_t] h
        with nogil:
            h = self._core.accepted(s)
        return np.asarray(<int64_t[:h.size()]>h.data(), dtype=_I64).copy()

    def accepted_many(self, seqs):
        """``accepted`` of several sequences at one moment: int64 ``[len(seqs), block_size + 1]``
        (every id checked, and none handed over to the device step, before anything is read)."""
        sv = self._ids("accepted_many", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        cdef cnp.ndarray out = np.empty((n, self.config.block_size + 1), _I64)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
        with nogil:
            self._core.accepted_many(sp, n, op)
        return out

    def totals(self):
        """The Stager's metrics at one moment (:class:`~dspark_core.stager.totals.StagerTotals`):
        counters over every sequence since the Stager was made (they never go back), gauges
        over the sequences holding rows now, peaks the largest reached, and the histogram of
        accepted drafts over every sequence. ``dspark_core.metrics.prometheus_text`` serves them.
        """
        cdef StagerTotals t
        with nogil:
            t = self._core.totals()
        accepted = np.asarray(<int64_t[:t.accepted.size()]>t.accepted.data(), dtype=_I64).copy()
        return _totals.StagerTotals(_fields_dict(&t.stats, SEQ_STATS_FIELDS, _STATS_FIELDS), accepted,
                                    int(t.started))

    # -- the device step (_device_step.pxi; docs/protocol.md "The device step") --
    def to_device(self, seqs, tokens=None):
        """External-row mode: hand ``seqs`` over to the device step (``step_many`` or the
        CUDA step run their steps from then on). Every other call on them raises
        ``StateError`` naming ``to_host`` until they come back (but ``end``, the metrics and
        ``disable`` / ``enable``). Each must be started and hold no tree verify batch; a
        disabled sequence or one whose drafting is off steps with a skip (``SKIP_DISABLED``,
        ``SKIP_DRAFTING_OFF``). Checked whole, a rejected call changes nothing.

        ``tokens`` (a chain drafter's Stager: required; else None): the slot token table
        (:meth:`new_token_table`: int32, one id per global slot), into which this writes
        each sequence's ids at its rows' slots and -1 at its other slots. A step never
        moves a row, so between steps the server writes each verify row's id at its
        verify slot (the verify batch's input ids: ``last``, then the drafts) and reads
        the staged rows' ids at their row slots; :meth:`to_host` reads them back."""
        _step_to_device(self, seqs, tokens)

    def to_host(self, seqs, outcomes=None, tokens=None):
        """Bring ``seqs`` back: the Stager is then exactly what the per-sequence calls of
        their steps would have made it. ``outcomes`` resolves the round each last step
        opened: None (all: the drafter ran, commit), or one per sequence, None or a fail
        stage name (``fail``). Returns ``fail``'s disabled counts (0 where none). A fault a
        step recorded (a bad accept count) is raised after every sequence is back.

        ``tokens`` (a chain drafter's Stager: required): the slot token table
        :meth:`to_device` filled, read at the slots of the rows that come back. An id
        below 0 there (a verify row whose id was never written) is a ``ValueError``
        naming the row, and nothing is brought back; only the last step's verify rows
        may come back unwritten (a round whose drafter failed), which ``confirm``
        then refuses: cancel them."""
        return _step_to_host(self, seqs, outcomes, tokens)

    def new_token_table(self):
        """A slot token table for :meth:`to_device` / :meth:`to_host` (a chain drafter's
        Stager): int32, ``max_seqs * ring_rows`` ids, all -1 (no id written)."""
        return np.full(self.config.max_seqs * self.ring_rows, -1, np.int32)

    def step_many(self, seqs, n_accepted, out=None):
        """The CPU twin of the device step for the entries ``(seqs[i], n_accepted[i])``
        (-1: not in this step): one call, GIL released. Returns ``out`` (a
        ``device_step.StepOutputs``, allocated when None) with every entry's status word;
        a per-entry problem is a status, never an exception (``check_step`` raises it)."""
        return _step_many(self, seqs, n_accepted, out)

    def check_step(self, seqs, statuses):
        """Raise the core's error for the first entry whose status is an error."""
        _step_check(self, seqs, statuses)

    def step_rows(self, seqs, out, rows=None):
        """The CSR rows of the batch the last ``step_many(seqs, ..., out=out)`` stepped (the
        unpadded layout's gather, one call, GIL released): into ``rows`` (a
        ``device_step.StepRows``, allocated for ``out``'s capacity when None), entry i's
        context rows at ``[rows.row_offsets[i], rows.row_offsets[i + 1])`` of
        ``rows.row_slots`` / ``rows.row_positions``; an entry not stepped, skipped or
        padding has 0 rows. Returns ``rows``. ``ValueError`` (nothing written): arrays of
        the wrong dtype or shape, a capacity below the batch."""
        return _step_rows(self, seqs, out, rows)

    def on_device(self, seq):
        """Whether ``seq`` is handed over (``to_device`` .. ``to_host``)."""
        cdef int64_t s = _i64("seq", seq)
        return self._core.on_device(s)

    @property
    def step_config(self):
        """The constants the device step's math needs (a dict: block, window, w_keep, ring_rows,
        max_seqs, max_rows, trim_chunk, max_position)."""
        return _step_config(self)

    @property
    def step_state(self):
        """The host step state: int64 ``(columns, max_seqs)``, a view of the Stager's own memory
        (the step's fields, then the acceptance histogram's ``block_size + 1`` buckets).
        A device owner copies the columns of handed-over sequences to its device copy after
        ``to_device`` and back before ``to_host`` (docs/protocol.md 2.10)."""
        return _step_state(self)

    @property
    def step_layout(self):
        """``(columns, max_rows)``: the step state's int64 columns per sequence (fields and
        histogram buckets) and the padded plan width."""
        return _step_layout(self)

    def live_slots(self, seq):
        """Slots of the stageable rows ``[horizon, end)``, oldest first (int64; both modes).

        What an owner of external rows saves alongside ``snapshot(seq)``.
        """
        cdef int64_t s = _i64("seq", seq)
        cdef RoundPlan p
        with nogil:
            self._core.live_slots(s, p.slot_runs)
        return _plan_slots(p)

    def buffered_positions(self, seq):
        """``(horizon, end)``: the absolute positions that can still be staged."""
        st = self.state(seq)
        return (st["horizon"], st["end"]) if st["started"] else (0, 0)

    def publishable(self, seq):
        """``(lo, hi)``: the positions whose rows ``PrefixStore.publish`` can take from ``seq`` now.

        The rows the sequence still holds (from its horizon) that are final (below what an open
        ``accept`` may still drop): a block ``[s, e)`` with ``lo <= s`` and ``e <= hi`` publishes,
        so a server hands over the whole blocks inside the range (a finished request's reply:
        its blocks up to ``hi``). A block reaching past ``hi`` is refused; one reaching below
        ``lo`` too, unless the keep rule drops its rows there (a block longer than ``K`` that
        ends past ``W - B`` keeps its last ``K``; docs/prefix_cache.md). A block the store
        already holds is refreshed whatever the range. ``(0, 0)`` for a sequence holding no
        rows; the sequence checks are ``publish``'s.
        """
        cdef int64_t s = _i64("seq", seq)
        cdef pair[int64_t, int64_t] r
        with nogil:
            r = self._core.publishable(s)
        return (r.first, r.second)


# The prefix store (PrefixStore): its own file, compiled into this module
# because its Stager-side calls need the Stager's C++ object.
include "_prefix_store.pxi"
include "_device_step.pxi"
