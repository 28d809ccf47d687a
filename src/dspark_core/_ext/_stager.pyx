# cython: language_level=3
"""Thin Cython wrapper of the C++ Stager (dspark/stager.hpp).

Argument *types* are normalised here with the same helpers the reference twin
uses (``_args``), so both raise the same exceptions; every *value* is checked
again by the C++ core, which never trusts its caller. Copies and conversions
run with the GIL released; the core's mutex makes concurrent calls safe.
"""
import functools
import logging

import numpy as np

cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.utility cimport move
from libcpp.vector cimport vector

from dspark_core._ext._lib_row_format cimport Storage, ElemType, NonFinite, dspark_set_error_types
from dspark_core._ext._lib_stager cimport (
    Stager as CStager, StagerOptions, RoundPlan, ByteVec, BufferPool, SeqState, SeqStats, Skip, FailStage,
    RowMode, SlotMove, advise_huge_pages,
    TRIM_CHUNK as C_TRIM_CHUNK, MAX_POSITION as C_MAX_POSITION,
    CrcPath, crc32c as c_crc32c, crc_path_supported, active_crc_path, set_crc_path, crc_path_name,
)

from dspark_core._args import (
    as_count, as_encoded, as_index, as_positions, as_rows, check_rows_given, readable_bytes, require_held_rows,
    row_dtype_code, writable_bytes,
)
from dspark_core.config import STORAGES, NONFINITE_POLICIES, ROW_MODES, STAGE_DTYPES, StagerConfig
from dspark_core.errors import ConfigError, StateError
from dspark_core.protocol_mismatch import MismatchGuard
from dspark_core.slot_moves import SlotMoves, no_moves
from dspark_core.stage_plan import DISABLED_WARNING, FAIL_STAGES, SKIP_REASONS, BatchPlan, StagePlan
from dspark_core._ext import _row_format
from dspark_core.stager_copy import reduce_stager

cnp.import_array()
dspark_set_error_types(ConfigError, StateError)

#: The core's lazy-trim chunk (rows); equals ``config.TRIM_CHUNK``.
TRIM_CHUNK = C_TRIM_CHUNK
MAX_POSITION = C_MAX_POSITION

logger = logging.getLogger("dspark_core")

# Core enum order: Skip::None, then SKIP_REASONS; FailStage follows FAIL_STAGES.
_SKIPS = (None, *SKIP_REASONS)
_FAIL_STAGES = {name: <FailStage><uint8_t>i for i, name in enumerate(FAIL_STAGES)}
_U8 = np.dtype(np.uint8)
_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)


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


# -- CRC-32C of snapshot format v2 (the core's dispatched kernels) -------------
_CRC_PATHS = {"portable": CrcPath.Portable, "sse4.2": CrcPath.Sse42}


def crc32c(data, crc=0):
    """CRC-32C (Castagnoli) of a bytes-like object, chained from ``crc``, on the active path."""
    cdef const uint8_t[::1] view = readable_bytes(data)
    cdef size_t n = view.shape[0]
    cdef const uint8_t* p = &view[0] if n else NULL
    cdef uint32_t c = as_index("crc", crc) & 0xFFFFFFFF
    with nogil:
        c = c_crc32c(c, p, n)
    return c


def crc32c_paths():
    """Names of the CRC-32C kernels this CPU and build support."""
    return tuple(name for name, p in _CRC_PATHS.items() if crc_path_supported(p))


def crc32c_path():
    """Name of the active CRC-32C kernel ("sse4.2" or "portable")."""
    return crc_path_name(active_crc_path()).decode()


def set_crc32c_path(name):
    """Switch the CRC-32C kernel (process-wide); ``ValueError`` for an unknown or unsupported one."""
    if name not in _CRC_PATHS:
        raise ValueError(f"unknown CRC-32C path {name!r}; use one of {tuple(_CRC_PATHS)}")
    set_crc_path(_CRC_PATHS[name])


cdef inline bint _plain_positions(x):
    """A C-contiguous 1-D int64 ndarray (the hot path's positions)."""
    if type(x) is not np.ndarray:
        return False
    cdef cnp.ndarray a = <cnp.ndarray>x
    return (cnp.PyArray_NDIM(a) == 1 and cnp.PyArray_TYPE(a) == cnp.NPY_INT64 and cnp.PyArray_IS_C_CONTIGUOUS(a)
            and cnp.PyArray_ISNOTSWAPPED(a))


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
        if flags & PyBUF_WRITABLE:
            raise BufferError("staged rows are read-only")
        self._shape[0] = <Py_ssize_t>self.v.size()
        self._strides[0] = 1
        b.buf = <void*>self.v.data()
        b.format = "B"
        b.internal = NULL
        b.itemsize = 1
        b.len = self._shape[0]
        b.ndim = 1
        b.obj = self
        b.readonly = 1  # plans are read-only views (as the reference's are)
        b.shape = self._shape
        b.strides = self._strides
        b.suboffsets = NULL

    def __releasebuffer__(self, Py_buffer* b):
        pass


cdef class Stager:
    """Windowed drafter staging for ``config.max_seqs`` sequences (C++ core).

    See docs/protocol.md for the round protocol (docs/design.md section 2 for its rules)::

        st.begin(seq)
        st.process(seq, positions, rows)   # after every target decode
        plan = st.draft(seq, n_past)       # -> StagePlan (plan.skip = reason)
        st.commit(seq) / st.fail(seq, stage)
        st.accept(seq, n_accepted)         # after verification

    A rejected call raises (``ValueError``, ``TypeError``, ``StateError``) and
    changes no state. Safe to call from several threads.
    """

    cdef CStager* _core
    cdef readonly object config
    cdef int64_t _D
    cdef int64_t _B
    cdef int64_t _max_seqs
    cdef size_t _row_bytes
    cdef object _stage_dtype
    cdef bint _view_rows
    cdef bint _external
    cdef object _decoder
    cdef object _mismatch
    cdef int64_t _moves_issued

    def __cinit__(self, config):
        if not isinstance(config, StagerConfig):
            raise TypeError(f"config must be a StagerConfig, got {type(config).__name__}")
        cdef StagerOptions o
        o.feature_dim = config.feature_dim
        o.block_size = config.block_size
        o.window = config.window
        o.max_seqs = config.max_seqs
        o.storage = <Storage><uint8_t>STORAGES.index(config.storage)
        o.max_failures = config.max_failures
        o.nonfinite = <NonFinite><uint8_t>NONFINITE_POLICIES.index(config.nonfinite)
        o.stage = <ElemType><uint8_t>STAGE_DTYPES.index(config.stage_dtype)
        o.rows = <RowMode><uint8_t>ROW_MODES.index(config.rows)
        self._core = new CStager(o)
        self._external = o.rows == RowMode.External
        self.config = config
        self._D = config.feature_dim
        self._B = config.block_size
        self._max_seqs = config.max_seqs
        self._row_bytes = self._core.row_bytes()
        self._stage_dtype = config.numpy_stage_dtype
        # Staged rows are a free view of the encoded bytes when formats agree.
        self._view_rows = (config.storage, config.stage_dtype) in (
            ("f32", "float32"), ("f16", "float16"), ("bf16", "bfloat16"))
        # Otherwise plan.rows decodes lazily with this (built once, not per plan).
        self._decoder = None if self._view_rows else functools.partial(
            _row_format.decode, storage=config.storage, dim=self._D, out_dtype=self._stage_dtype)
        self._mismatch = MismatchGuard(config.strict)

    def __dealloc__(self):
        del self._core

    def __reduce__(self):
        """Pickle / deepcopy: the config plus every sequence's snapshot (``stager_copy``)."""
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
        """Non-empty move arrays ``fork`` / ``shift`` have returned so far (the
        last one's ``serial``): an owner applies them in that order."""
        return self._moves_issued

    cdef object _moves(self, vector[SlotMove]& v):
        if v.size() == 0:
            return no_moves(self)
        self._moves_issued += 1
        return SlotMoves.wrap(_moves_array(v), self, self._moves_issued)

    cdef int64_t _seq(self, seq) except -1:
        i = seq if type(seq) is int else as_index("seq", seq)
        if not 0 <= i < self._max_seqs:
            raise ValueError(f"unknown sequence {i} (this Stager has sequences 0..{self._max_seqs - 1})")
        return i

    cdef object _plan(self, RoundPlan& p, object data, size_t offset):
        cdef int64_t n = p.n_rows
        if <int>p.skip != 0:  # dspark::Skip::None
            return StagePlan.skipped(p.seq, p.start, _SKIPS[<int>p.skip], feature_dim=self._D,
                                     row_bytes=self._row_bytes, stage_dtype=self._stage_dtype,
                                     external=self._external)
        lo = p.first_row - p.pos_base
        if self._external:
            return StagePlan(
                seq=p.seq, start=p.start, skip=None, rebase=p.rebase, clear_cache=p.clear_cache,
                positions=np.arange(lo, lo + n, dtype=_I32),
                block_positions=np.arange(p.crop_from, p.crop_from + self._B, dtype=_I32),
                crop_from=p.crop_from, pos_base=p.pos_base, encoded_rows=None, slots=_plan_slots(p),
                external=True, source=self)
        enc = data[offset: offset + n * self._row_bytes].reshape(n, self._row_bytes)
        return StagePlan(
            seq=p.seq, start=p.start, skip=None, rebase=p.rebase, clear_cache=p.clear_cache,
            positions=np.arange(lo, lo + n, dtype=_I32),
            block_positions=np.arange(p.crop_from, p.crop_from + self._B, dtype=_I32),
            crop_from=p.crop_from, pos_base=p.pos_base, encoded_rows=enc,
            rows=enc.view(self._stage_dtype).reshape(n, self._D) if self._view_rows else None,
            decode=self._decoder, slots=_plan_slots(p))

    # -- round protocol ---------------------------------------------------
    def begin(self, seq):
        """Reset ``seq`` for a new request (re-enables a disabled sequence)."""
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.begin(s)
        self._mismatch.reset(s)

    def process(self, seq, positions, rows=None):
        """Buffer the target's capture rows (float32/float16/bfloat16, ``(n, D)``) at ``positions``.

        Held mode: returns None. The rows are read with the GIL released:
        another thread must not write to ``rows`` during the call.

        External-row mode (``rows="external"``): pass no rows; returns the
        int64 slot where the owner writes each row (same order as
        ``positions``; -1 for a row below the horizon, which no round can
        stage and need not be written). The core never sees the rows, so the
        owner checks them for NaN / Inf first (``DeviceRing.write`` does).
        """
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.check_ready(s)
        check_rows_given(self._external, rows)
        if self._external:
            return self._process_external(s, positions)
        cdef ElemType t
        if _plain_positions(positions) and _plain_rows(rows, self._D, &t) and \
                cnp.PyArray_DIM(<cnp.ndarray>rows, 0) == cnp.PyArray_DIM(<cnp.ndarray>positions, 0):
            # Fast path: C-contiguous int64 positions and float32/float16 rows of
            # the right width; every value is checked by the core.
            pos, arr = positions, rows
        else:
            pos = as_positions(positions)
            arr = as_rows(rows, self._D)
            if arr.shape[0] != pos.shape[0]:
                raise ValueError(f"{pos.shape[0]} positions for {arr.shape[0]} rows")
            t = <ElemType><uint8_t>row_dtype_code(arr.dtype)
        cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>pos, 0)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(pos)
        cdef const void* rp = cnp.PyArray_DATA(arr)
        with nogil:
            self._core.process(s, pp, n, rp, t)

    cdef object _process_external(self, int64_t s, positions):
        pos = positions if _plain_positions(positions) else as_positions(positions)
        cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>pos, 0)
        cdef cnp.ndarray slots = np.empty(n, _I64)
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(pos)
        cdef int64_t* sp = <int64_t*>cnp.PyArray_DATA(slots)
        with nogil:
            self._core.process_external(s, pp, n, sp)
        return slots

    def process_encoded(self, seq, positions, data):
        """Buffer rows already in storage format: uint8 ``(n, row_bytes)`` (or ``n * row_bytes`` flat).

        The bytes are stored as given. Under ``nonfinite="error"`` a row whose
        stored values (f32 / f16 / bf16) or block scales (q8_0 / q4_0) are not
        finite is rejected; the ``"zero"`` and ``"clamp_f16"`` policies do not
        rewrite encoded rows.
        """
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.check_ready(s)
        require_held_rows(self._external, "process_encoded")
        pos = as_positions(positions)
        buf = as_encoded(data, pos.shape[0], self._row_bytes)
        cdef size_t n = pos.shape[0]
        cdef size_t nbytes = buf.shape[0]
        cdef const int64_t* pp = <const int64_t*>cnp.PyArray_DATA(pos)
        cdef const uint8_t* dp = <const uint8_t*>cnp.PyArray_DATA(buf)
        with nogil:
            self._core.process_encoded(s, pp, n, dp, nbytes)

    def draft(self, seq, n_past):
        """Plan this round for a target at ``n_past``: a :class:`StagePlan` (opens a round unless skipped)."""
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.check_ready(s)
        cdef int64_t start = n_past if type(n_past) is int and 0 <= n_past < C_MAX_POSITION else as_count("n_past", n_past)
        if self._mismatch.strict:
            self._mismatch.check(s, start, self.state(s))
        cdef _Bytes out = _Bytes()
        out.pool = self._core.pool()
        cdef RoundPlan p
        with nogil:
            p = self._core.draft(s, start, out.v)
        if <int>p.skip == <int>Skip.MissingRows:
            self._mismatch.skipped(s, start, self._core.state(s).end)
        return self._plan(p, np.frombuffer(out, _U8), 0)

    def draft_many(self, seqs, n_pasts):
        """Plans for several sequences as one drafter batch (:class:`BatchPlan`)."""
        seq_list = [as_index("seq", x) for x in seqs]
        past_list = [as_index("n_past", x) for x in n_pasts]
        if len(seq_list) != len(past_list):
            raise ValueError(f"{len(seq_list)} sequences for {len(past_list)} n_past values")
        for x in seq_list:
            self._seq(x)
        cdef int64_t xs
        for x in seq_list:
            xs = x
            with nogil:
                self._core.check_ready(xs)
        if len(set(seq_list)) != len(seq_list):
            raise ValueError("draft_many: sequence ids must be unique")
        for x in past_list:
            as_count("n_past", x)
        if self._mismatch.strict:  # before anything opens: a rejected batch changes nothing
            for x, p in zip(seq_list, past_list):
                self._mismatch.check(x, p, self.state(x))
        sv = np.asarray(seq_list, dtype=np.int64)
        pv = np.asarray(past_list, dtype=np.int64)
        cdef size_t n = len(seq_list)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* np_ = <const int64_t*>cnp.PyArray_DATA(pv)
        cdef vector[RoundPlan] plans
        cdef _Bytes out = _Bytes()
        out.pool = self._core.pool()
        with nogil:
            self._core.draft_many(sp, np_, n, plans, out.v)
        data = np.frombuffer(out, _U8)
        result = []
        cdef size_t offset = 0
        cdef size_t i
        for i in range(plans.size()):
            if <int>plans[i].skip == <int>Skip.MissingRows:
                self._mismatch.skipped(plans[i].seq, plans[i].start, self._core.state(plans[i].seq).end)
            result.append(self._plan(plans[i], data, offset))
            offset += plans[i].n_rows * self._row_bytes
        return BatchPlan(result, feature_dim=self._D, row_bytes=self._row_bytes, stage_dtype=self._stage_dtype,
                         external=self._external)

    def commit(self, seq):
        """The drafter decode and crop of the open round succeeded."""
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.commit(s)

    def fail(self, seq, stage="decode"):
        """The drafter ``stage`` ("decode" or "crop") failed: the next round restages cleanly."""
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.check_open(s)
        if not isinstance(stage, str) or stage not in _FAIL_STAGES:
            raise ValueError(f"stage must be one of {FAIL_STAGES}, got {stage!r}")
        cdef FailStage fs = _FAIL_STAGES[stage]
        cdef int64_t disabled_after
        with nogil:
            disabled_after = self._core.fail(s, fs)
        if disabled_after:
            logger.warning(DISABLED_WARNING, s, disabled_after, stage)

    def accept(self, seq, n_accepted):
        """Keep the rows of the accepted tokens (``n_accepted + 1``) of the last verify batch."""
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.check_ready(s)
        n_acc = as_index("n_accepted", n_accepted)
        if not 0 <= n_acc <= self._B:
            raise ValueError(f"n_accepted must be in [0, {self._B}], got {n_acc}")
        cdef int64_t n = n_acc
        with nogil:
            self._core.accept(s, n)

    # -- lifecycle ----------------------------------------------------------
    def rollback(self, seq, n_past):
        """The target rolled back to ``n_past``: drop rows ``>= n_past`` (restage if the cache reached past it)."""
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.check_ready(s)
        cdef int64_t p = as_count("n_past", n_past)
        with nogil:
            self._core.rollback(s, p)

    def shift(self, seq, n_keep, n_discard):
        """Mirror the target's context shift: drop ``[n_keep, n_keep + n_discard)``, move later rows down.

        Returns the copies the owner of external rows applies, a
        :class:`~dspark_core.slot_moves.SlotMoves` ((n, 3) int64
        ``[src_slot, dst_slot, count]`` rows, in order; each a plain copy:
        source and destination never overlap); empty when nothing moves.
        Held mode: the core has applied them itself.
        """
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.check_ready(s)
        cdef int64_t k = as_count("n_keep", n_keep)
        cdef int64_t d = as_count("n_discard", n_discard)
        cdef vector[SlotMove] moves
        with nogil:
            moves = self._core.shift(s, k, d)
        return self._moves(moves)

    def fork(self, src, dst):
        """Give ``dst`` an independent copy of ``src``'s state; ``dst`` restages on its next round.

        Returns the copies of ``src``'s rows into ``dst``'s slots, as
        :meth:`shift` does ((n, 3) int64, at most two rows).
        """
        cdef int64_t a = self._seq(as_index("src", src))
        cdef int64_t b = self._seq(as_index("dst", dst))
        cdef vector[SlotMove] moves
        with nogil:
            moves = self._core.fork(a, b)
        return self._moves(moves)

    def snapshot_size(self, seq):
        """Bytes ``snapshot(seq)`` returns and ``snapshot_into(seq, ...)`` writes."""
        cdef int64_t s = self._seq(seq)
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
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.check_ready(s)
        cdef uint8_t[::1] out = writable_bytes(buffer)
        cdef size_t cap = out.shape[0]
        cdef uint8_t* dp = &out[0] if cap else NULL
        cdef size_t n
        with nogil:
            n = self._core.snapshot_into(s, dp, cap)
        return n

    def snapshot(self, seq):
        """The sequence's state as versioned, checksummed bytes (``snapshot_format``)."""
        cdef int64_t s = self._seq(seq)
        cdef size_t n, written
        cdef char* dp
        while True:
            with nogil:
                n = self._core.snapshot_size(s)
            out = PyBytes_FromStringAndSize(NULL, n)  # written in place, no second copy
            dp = PyBytes_AS_STRING(out)
            advise_huge_pages(dp, n)  # fresh memory: fault it in 2 MiB at a time
            try:
                with nogil:
                    written = self._core.snapshot_into(s, <uint8_t*>dp, n)
            except ValueError:
                if self.snapshot_size(s) != n:
                    continue  # another thread changed the sequence in between
                raise
            return out if written == n else out[:written]

    def restore(self, seq, data):
        """Replace the sequence's state with a snapshot; bad data raises ValueError and changes nothing.

        External-row mode: the snapshot carries the bookkeeping only; returns
        the int64 slots where the owner puts the saved rows back (the rows of
        ``live_slots(seq)`` at snapshot time, oldest first). A snapshot of the
        other row mode is a ValueError. Held mode: returns None.

        ``data`` is any buffer (bytes, bytearray, memoryview, ndarray, mmap),
        read in place with the GIL released: another thread must not write to
        it during the call.
        """
        cdef int64_t s = self._seq(seq)
        with nogil:
            self._core.check_ready(s)
        cdef const uint8_t[::1] raw = readable_bytes(data)
        cdef size_t n = raw.shape[0]
        cdef const uint8_t* dp = &raw[0] if n else NULL
        cdef RoundPlan p
        with nogil:
            self._core.restore(s, dp, n, p.slot_runs)
        return _plan_slots(p) if self._external else None

    # -- introspection ------------------------------------------------------
    def state(self, seq):
        """The sequence's protocol state as a dict (the same keys as the reference's)."""
        cdef int64_t s = self._seq(seq)
        cdef SeqState st
        with nogil:
            st = self._core.state(s)
        return {
            "started": st.started, "end": st.end, "horizon": st.horizon, "n_cache": st.n_cache,
            "pos_base": st.pos_base, "n_retained": st.n_retained, "n_pending": st.n_pending,
            "open_round": st.open_round, "consecutive_failures": st.consecutive_failures,
            "disabled": st.disabled, "restage_owed": st.restage_owed, "first_round": st.first_round,
            "tentative_rows": st.tentative_rows,
        }

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
        resident only when written). The reference twin keeps every counter
        but the three byte counts with the same values (it models the ring's
        lazy trims as bookkeeping).
        """
        cdef int64_t s = self._seq(seq)
        cdef SeqStats t
        with nogil:
            t = self._core.stats(s)
        return {
            "rounds": t.rounds, "commits": t.commits, "failures": t.failures, "rebases": t.rebases,
            "staged_rows": t.staged_rows, "restaged_rows": t.restaged_rows, "skips": t.skips,
            "trims": t.trims, "trimmed_rows": t.trimmed_rows, "live_rows": t.live_rows, "rows": t.rows,
            "peak_rows": t.peak_rows,
            "bytes": t.bytes, "peak_bytes": t.peak_bytes, "reserved_bytes": t.reserved_bytes,
        }

    def live_slots(self, seq):
        """Slots of the stageable rows ``[horizon, end)``, oldest first (int64; both modes).

        What an owner of external rows saves alongside ``snapshot(seq)``.
        """
        cdef int64_t s = self._seq(seq)
        cdef RoundPlan p
        with nogil:
            self._core.live_slots(s, p.slot_runs)
        return _plan_slots(p)

    def buffered_positions(self, seq):
        """``(horizon, end)``: the absolute positions that can still be staged."""
        st = self.state(seq)
        return (st["horizon"], st["end"]) if st["started"] else (0, 0)



# The prefix store (PrefixStore): its own file, compiled into this module
# because its Stager-side calls need the Stager's C++ object.
include "_prefix_store.pxi"
