# The prefix store's binding (dspark/prefix_store.hpp), part of the _stager
# module (included at the end of _stager.pyx) because its Stager-side calls
# need the Stager's C++ object. Thin, as the Stager's: it converts (keys with
# prefix.keys, integers and rows with stager._args), releases the GIL and calls;
# every rule and message is the core's. A conversion that fails on a call
# that names a sequence lets the core's sequence checks speak first
# (Stager._converted: docs/design.md 2.1).
from dspark_core._ext._lib_prefix_store cimport (
    PrefixStore as CPrefixStore, PrefixStoreOptions, KeyChain, PrefixHit as CPrefixHit, PrefixBlockInfo,
    PrefixStats, StagerPrefixSide, PREFIX_HIT_FIELDS, PREFIX_STATS_FIELDS,
)
from libc.string cimport memcpy
from libcpp.string cimport string

from dspark_core.prefix import hit as _prefix_hit
from dspark_core.stager._args import as_rows
from dspark_core.prefix.hit import PrefixHit, PrefixHits, PrefixMoves, no_prefix_moves
from dspark_core.prefix.keys import as_block_rows, as_block_data, as_key, as_key_chain, as_key_chains
from dspark_core.prefix.keys import KeyBatch
from cpython.long cimport PyLong_AsUnsignedLongLong

# An int key's bytes (prefix.keys.as_key: 64-bit two's complement) and where int keys end.
cdef enum:
    KEY_INT_BYTES = 8
_KEY_INT_END = 1 << 64

# A non-NULL pointer for rows given as an empty buffer (the core tells "no
# rows" from "empty rows").
cdef uint8_t _NO_BYTES = 0
# PrefixHit's fields and stats()' keys: the core's field lists (prefix_store.hpp), in order.
_PREFIX_HIT_FIELDS = _row_format.PREFIX_HIT_FIELDS
_PREFIX_STATS_FIELDS = _row_format.PREFIX_STATS_FIELDS


cdef object _chain(object converted, KeyChain* out):
    """Fill ``out`` with a view of a converted chain ``(bytes, offsets)``; returns what keeps it alive."""
    data, offsets = converted
    cdef const uint8_t[::1] d = data
    cdef cnp.ndarray o = <cnp.ndarray>offsets
    out.n = o.shape[0] - 1
    out.bytes = &d[0] if d.shape[0] else NULL
    out.offsets = <const size_t*>cnp.PyArray_DATA(o)
    return converted


cdef extern from "Python.h":
    int PyObject_GenericSetDict(object o, object value, void* context) except -1

_new_object = object.__new__


cdef object _hit(CPrefixHit& h, object moves):
    # A PrefixHit (a frozen dataclass) given its instance dict at once, the core's fields and the
    # moves: its __init__ sets each field through object.__setattr__, and hit_many's 64 results
    # cost more than its core call that way.
    cdef dict fields = _fields_dict(&h, PREFIX_HIT_FIELDS, _PREFIX_HIT_FIELDS)
    fields["moves"] = moves
    hit = _new_object(PrefixHit)
    PyObject_GenericSetDict(hit, fields, NULL)
    return hit


cdef void _chains(object batch, vector[KeyChain]& out):
    """Views of a converted batch of chains (prefix.keys.KeyBatch), one KeyChain each."""
    data, offsets, byte_start, off_start, count = batch
    cdef const uint8_t[::1] d = data
    cdef const uint8_t* base = &d[0] if d.shape[0] else NULL
    cdef cnp.ndarray o = <cnp.ndarray>offsets
    cdef const size_t* op = <const size_t*>cnp.PyArray_DATA(o)
    cdef const size_t* bs = <const size_t*>cnp.PyArray_DATA(<cnp.ndarray>byte_start)
    cdef const size_t* os = <const size_t*>cnp.PyArray_DATA(<cnp.ndarray>off_start)
    cdef const size_t* cnt = <const size_t*>cnp.PyArray_DATA(<cnp.ndarray>count)
    cdef size_t n = cnp.PyArray_DIM(<cnp.ndarray>count, 0), i
    out.resize(n)
    for i in range(n):
        out[i].n = cnt[i]
        out[i].bytes = base + bs[i] if base != NULL else NULL
        out[i].offsets = op + os[i] if cnt[i] else NULL


cdef object _int_key_batch(object keys, size_t n):
    """A batch of chains of plain ``int`` keys (the common case: hashes) as a
    ``prefix_keys.KeyBatch``, converted here without a Python object per key
    (a batch call's conversion cost as much as its core call). None when
    anything is not that, or a key is outside [-2**63, 2**64): then
    ``as_key_chains`` converts, and names what is wrong."""
    if (type(keys) is not list and type(keys) is not tuple) or <size_t>len(keys) != n:
        return None
    cdef size_t i, total = 0, width = 0, m, at = 0, b
    for c in keys:
        if type(c) is not list and type(c) is not tuple:
            return None
        m = len(c)
        total += m
        width = max(width, m)
    cdef cnp.ndarray count = np.empty(n, np.uintp), byte_start = np.empty(n, np.uintp)
    cdef size_t* cp = <size_t*>cnp.PyArray_DATA(count)
    cdef size_t* bp = <size_t*>cnp.PyArray_DATA(byte_start)
    data = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(total * KEY_INT_BYTES))
    cdef uint8_t* out = <uint8_t*>PyBytes_AS_STRING(data)
    cdef int overflow = 0
    cdef long long v
    cdef uint64_t u
    i = 0
    for c in keys:
        bp[i] = at * KEY_INT_BYTES
        cp[i] = len(c)
        for k in c:
            if type(k) is not int:
                return None
            v = PyLong_AsLongLongAndOverflow(k, &overflow)
            if overflow < 0:
                return None
            if overflow > 0:  # [2**63, 2**64): the same 64-bit hash as its negative twin
                if k >= _KEY_INT_END:
                    return None
                u = PyLong_AsUnsignedLongLong(k)
            else:
                u = <uint64_t>v
            for b in range(KEY_INT_BYTES):  # little-endian on every host
                out[at * KEY_INT_BYTES + b] = <uint8_t>(u >> (8 * b))
            at += 1
        i += 1
    return KeyBatch(data, np.arange(width + 1, dtype=np.uintp) * KEY_INT_BYTES, byte_start,
                    np.zeros(n, np.uintp), count)


cdef Stager _stager_arg(stager):
    if not isinstance(stager, Stager):
        raise TypeError(f"stager must be a dspark_core.Stager, got {type(stager).__name__}")
    return <Stager>stager


cdef object _slots_array(vector[int64_t]& v):
    cdef cnp.ndarray out = np.empty(v.size(), _I64)
    if v.size():
        memcpy(cnp.PyArray_DATA(out), v.data(), v.size() * sizeof(int64_t))
    return out


cdef class PrefixStore:
    """Rows of cached prompt prefixes under the server's prefix-cache keys (docs/prefix_cache.md).

    ``PrefixStore(config, block_tokens, budget_bytes)``: ``config`` is the
    rows' configuration, the :class:`StagerConfig` of every Stager that uses
    the store (feature_dim, storage, window, block_size, nonfinite,
    stage_dtype and rows must match; max_seqs and strict may differ);
    ``block_tokens`` the server's KV block size; ``budget_bytes`` the most
    row memory the store holds (external-row mode: the size of the owner's
    table), at least one block. Least recently used blocks are evicted for
    room. Safe to call from several threads; Stagers sharing the store may be
    used concurrently (lock order: the Stager, then the store)::

        store.publish(st, seq, keys, start, end)   # final rows of blocks [start, end)
        hit = store.hit(st, seq, keys, n_tokens)   # start seq from a prefix-cache hit
        # the server prefills from hit.replay_from (== n_tokens unless rows were missing)
    """

    cdef CPrefixStore* _core
    cdef readonly object config
    cdef readonly int64_t block_tokens
    cdef readonly int64_t budget_bytes
    cdef int64_t _D
    cdef size_t _row_bytes
    cdef bint _external

    def __cinit__(self, config, block_tokens, budget_bytes):
        if not isinstance(config, StagerConfig):
            raise TypeError(f"config must be a StagerConfig, got {type(config).__name__}")
        cdef PrefixStoreOptions o
        _set_row_options(&o, config)
        o.block_tokens = _i64("block_tokens", block_tokens)
        o.budget_bytes = _i64("budget_bytes", budget_bytes)
        self._core = new CPrefixStore(o)  # checks every value (ConfigError)
        self.config = config
        self.block_tokens = o.block_tokens
        self.budget_bytes = o.budget_bytes
        self._D = config.feature_dim
        self._row_bytes = self._core.row_bytes()
        self._external = self._core.external()

    def __dealloc__(self):
        del self._core

    def __repr__(self):
        return (f"PrefixStore(block_tokens={self.block_tokens}, budget_bytes={self.budget_bytes}, "
                f"blocks={len(self)}, storage={self.config.storage!r}, rows={self.config.rows!r})")

    @property
    def row_bytes(self):
        """Bytes of one stored row."""
        return self._row_bytes

    @property
    def w_keep(self):
        """``K``: the rows a hit above ``W - B`` restores."""
        return self._core.w_keep()

    @property
    def page_rows(self):
        """Rows per page (``min(block_tokens, K)``): a block takes ceil(kept rows / page_rows) pages."""
        return self._core.page_rows()

    @property
    def n_pages(self):
        """Pages the budget holds (``budget_bytes // (page_rows * row_bytes)``)."""
        return self._core.n_pages()

    @property
    def table_rows(self):
        """External-row mode: rows of the owner's table (``n_pages * page_rows``)."""
        return self._core.table_rows()

    def publish(self, stager, seq, keys, start, end):
        """Record the final rows of positions ``[start, end)`` of ``seq`` under ``keys``.

        One key per block of ``block_tokens`` positions from ``start`` (a
        block boundary); the last block may be partial (a request's end).
        Publish each block as the server hands it over (its rows must still
        be held: the last ``W`` positions). A block already held under its
        key with the same rows is refreshed; with other rows or positions it
        is a ``ValueError``. External-row mode: returns the copies from the
        Stager's ring table to the store's table (:class:`PrefixMoves`);
        held mode: an empty one.
        """
        cdef Stager st = _stager_arg(stager)
        cdef int64_t s = _i64("seq", seq)
        cdef KeyChain chain
        keep = _chain(st._converted(s, Need.Ready, as_key_chain, (keys,)), &chain)
        cdef int64_t a = st._arg(s, "start", start)
        cdef int64_t b = st._arg(s, "end", end)
        cdef vector[SlotMove] moves
        cdef uint64_t serial = 0
        cdef StagerPrefixSide* side = <StagerPrefixSide*>st._core
        with nogil:
            moves = side.publish_prefix(s, self._core[0], chain, a, b, &serial)
        del keep
        if moves.size() == 0:
            return no_prefix_moves(st, _prefix_hit.PUBLISH, self)
        return PrefixMoves.wrap_prefix(_moves_array(moves), st, serial, _prefix_hit.PUBLISH, self)

    def hit(self, stager, seq, keys, n_tokens, tokens=None):
        """Start ``seq`` (as ``begin`` does) from a prefix-cache hit of its first ``n_tokens`` positions.

        ``tokens`` (a chain drafter's Stager: required; else None): the prompt's ids of
        positions ``[0, n_tokens)``, the tokens the keys were made of: the store keeps rows,
        not ids, and the rows the hit brings back take theirs from here.

        ``keys``: the chain of their blocks (``ceil(n_tokens / block_tokens)``
        keys). The sequence receives the rows the store holds, so that its
        first round stages what a full prefill would have; returns a
        :class:`PrefixHit`: the server prefills from ``hit.replay_from``.
        External-row mode: ``hit.moves`` are the copies from the store's table
        to the Stager's ring table.
        """
        cdef Stager st = _stager_arg(stager)
        cdef int64_t s = _i64("seq", seq)
        cdef KeyChain chain
        keep = _chain(st._converted(s, Need.Ready, as_key_chain, (keys,)), &chain)
        cdef int64_t h = st._arg(s, "n_tokens", n_tokens)
        tokens = st._tokens_arg(s, tokens, h if h > 0 else 0)
        cdef const int32_t* tp = _ids_ptr(tokens)
        cdef vector[SlotMove] moves
        cdef uint64_t serial = 0
        cdef CPrefixHit r
        cdef StagerPrefixSide* side = <StagerPrefixSide*>st._core
        with nogil:
            r = side.start_from_prefix(s, self._core[0], chain, h, &moves, &serial, tp)
        del keep
        if moves.size() == 0:
            out = no_prefix_moves(st, _prefix_hit.HIT, self)
        else:
            out = PrefixMoves.wrap_prefix(_moves_array(moves), st, serial, _prefix_hit.HIT, self)
        return _hit(r, out)

    def publish_many(self, stager, seqs, keys, starts, ends):
        """``publish`` for a step's sequences in one call (the GIL released): the blocks
        ``[starts[i], ends[i])`` of ``seqs[i]`` under the chain ``keys[i]``, in batch order.

        Equal to a loop of ``publish``, checked whole first: a rejected batch changes nothing, and
        an error names the sequence (``"publish_many: seqs[i] (sequence s): ..."``). A block new
        to the store in two entries (a shared prompt's block completed by two requests in one
        step) is added by the first and refreshed by the later ones, as a second ``publish`` of
        it would be (same positions, and the same rows where they still hold them). External-row
        mode: the copies of every entry, one table change (:class:`PrefixMoves`); held mode: an
        empty one.
        """
        cdef Stager st = _stager_arg(stager)
        sv = st._ids("publish_many", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        conv = _int_key_batch(keys, n)
        if conv is None:
            conv = st._batch_converted("publish_many", sv, Need.Ready, as_key_chains, ("publish_many", keys, n))
        a = st._per_seq("publish_many", sv, Need.Ready, "starts", starts)
        b = st._per_seq("publish_many", sv, Need.Ready, "ends", ends)
        cdef vector[KeyChain] chains
        _chains(conv, chains)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* ap = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>a)
        cdef const int64_t* bp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>b)
        cdef vector[SlotMove] moves
        cdef uint64_t serial = 0
        cdef StagerPrefixSide* side = <StagerPrefixSide*>st._core
        with nogil:
            moves = side.publish_prefix_many(sp, n, self._core[0], chains.data(), ap, bp, &serial)
        del conv
        if moves.size() == 0:
            return no_prefix_moves(st, _prefix_hit.PUBLISH, self)
        return PrefixMoves.wrap_prefix(_moves_array(moves), st, serial, _prefix_hit.PUBLISH, self)

    def hit_many(self, stager, seqs, keys, n_tokens, tokens=None):
        """``hit`` for several sequences in one call (the GIL released): ``seqs[i]`` from a hit of
        ``n_tokens[i]`` positions under the chain ``keys[i]``; ``tokens`` (a chain drafter's
        Stager): each one's prompt ids, flat in batch order (``sum(n_tokens)`` of them).

        Equal to a loop of ``hit``; every hit is checked and planned first (a rejected batch
        changes nothing; errors name the sequence). Returns :class:`PrefixHits`: the hits in
        batch order, and ``moves``: the copies of them all (external rows: one table change).
        """
        cdef Stager st = _stager_arg(stager)
        sv = st._ids("hit_many", seqs)
        cdef size_t n = cnp.PyArray_DIM(sv, 0)
        conv = _int_key_batch(keys, n)
        if conv is None:
            conv = st._batch_converted("hit_many", sv, Need.Ready, as_key_chains, ("hit_many", keys, n))
        h = st._per_seq("hit_many", sv, Need.Ready, "n_tokens", n_tokens)
        cdef vector[KeyChain] chains
        _chains(conv, chains)
        cdef const int64_t* sp = <const int64_t*>cnp.PyArray_DATA(sv)
        cdef const int64_t* hp = <const int64_t*>cnp.PyArray_DATA(<cnp.ndarray>h)
        if tokens is not None:  # their count: the hits' n_tokens (a negative one is the core's to refuse)
            tokens = st._flat_tokens_arg("hit_many", sv, tokens, int(np.maximum(h, 0).sum()))
        cdef const int32_t* tp = _ids_ptr(tokens)
        cdef vector[CPrefixHit] hits
        cdef vector[SlotMove] moves
        cdef uint64_t serial = 0
        cdef StagerPrefixSide* side = <StagerPrefixSide*>st._core
        with nogil:
            side.start_from_prefix_many(sp, n, self._core[0], chains.data(), hp, hits, &moves, &serial, tp)
        del conv
        empty = no_prefix_moves(st, _prefix_hit.HIT, self)
        batch = empty if moves.size() == 0 else PrefixMoves.wrap_prefix(_moves_array(moves), st, serial,
                                                                         _prefix_hit.HIT, self)
        return PrefixHits([_hit(hits[i], empty) for i in range(n)], batch)

    def lookup(self, keys, n_tokens):
        """What ``hit`` would find for this chain now (a :class:`PrefixHit`); changes nothing."""
        cdef KeyChain chain
        keep = _chain(as_key_chain(keys), &chain)
        cdef int64_t h = _i64("n_tokens", n_tokens)
        cdef CPrefixHit r
        with nogil:
            r = self._core.lookup(chain, h)
        del keep
        return _hit(r, no_prefix_moves(None, _prefix_hit.HIT, self))

    def publish_rows(self, keys, start, end, rows):
        """Record rows ``[start, end)`` given by the caller (held mode): ``(end - start, feature_dim)``
        float32 / float16 / bfloat16. For blocks whose rows a Stager no longer holds (a prefill chunk
        longer than the window). Only the rows a hit can need are encoded."""
        cdef KeyChain chain
        keep = _chain(as_key_chain(keys), &chain)
        cdef int64_t a = _i64("start", start)
        cdef int64_t b = _i64("end", end)
        arr = as_rows(rows, self._D)
        cdef ElemType t = <ElemType><uint8_t>row_dtype_code(arr.dtype)
        cdef const void* rp = cnp.PyArray_DATA(<cnp.ndarray>arr)
        cdef size_t nbytes = arr.nbytes
        with nogil:
            self._core.publish_rows(chain, a, b, rp, t, nbytes)
        del keep

    def publish_slots(self, keys, start, end):
        """External-row mode: publish blocks ``[start, end)`` whose rows the owner writes itself.

        Returns the int64 slot of the store's table for each position
        (``end - start`` entries; -1 for a row the store does not keep or a
        block it already holds). The core checks the call before it
        allocates them."""
        cdef KeyChain chain
        keep = _chain(as_key_chain(keys), &chain)
        cdef int64_t a = _i64("start", start)
        cdef int64_t b = _i64("end", end)
        cdef vector[int64_t] slots
        with nogil:
            slots = self._core.publish_slots(chain, a, b)
        del keep
        return _slots_array(slots)

    def evict(self, keys):
        """Drop the blocks with these keys (the server's KV cache dropped them); returns how many were held."""
        cdef KeyChain chain
        keep = _chain(as_key_chain(keys), &chain)
        cdef int64_t n
        with nogil:
            n = self._core.evict(chain)
        del keep
        return n

    def clear(self):
        """Drop every block (page memory is kept for reuse); the counters restart."""
        with nogil:
            self._core.clear()

    def __len__(self):
        return self._core.size()

    def __contains__(self, key):
        return self._core.contains(as_key(key))

    def keys(self):
        """Keys held (bytes), least recently used first."""
        cdef vector[string] v = self._core.keys()  # named: Cython must not iterate a temporary
        return [bytes(k) for k in v]

    def info(self, key):
        """One block: ``start``, ``end`` (positions), ``first_row`` and ``rows`` (the kept rows
        ``[first_row, end)``), ``pages``. ``ValueError`` for a key the store does not hold."""
        cdef PrefixBlockInfo i = self._core.info(as_key(key))
        return {"start": i.start, "end": i.end, "first_row": i.kept.first, "rows": i.rows, "pages": i.pages}

    def block_slots(self, key):
        """The table slots of the block's kept rows, in position order (int64)."""
        cdef vector[int64_t] v = self._core.block_slots(as_key(key))
        return _slots_array(v)

    def stats(self):
        """The counters, keyed by the core's list (``_row_format.PREFIX_STATS_FIELDS``; each is
        described at ``PrefixStats`` in dspark/prefix_store.hpp)."""
        cdef PrefixStats t = self._core.stats()
        return _fields_dict(&t, PREFIX_STATS_FIELDS, _PREFIX_STATS_FIELDS)

    def export_block(self, key, rows=None):
        """The block as checksummed bytes another process's store imports (``prefix.block_format``).

        External-row mode: ``rows`` are the block's rows as the owner read
        them from ``block_slots(key)`` (uint8 ``(rows, row_bytes)`` or bytes);
        a held-row store exports its own (no ``rows``)."""
        cdef string k = as_key(key)
        cdef const uint8_t[::1] rv
        cdef const uint8_t* rp = NULL
        cdef size_t rn = 0
        if rows is not None:
            rv = as_block_rows(rows)
            rn = rv.shape[0]
            rp = &rv[0] if rn else &_NO_BYTES
        cdef size_t n = self._core.export_size(k)
        out = PyBytes_FromStringAndSize(NULL, n)
        cdef uint8_t* dp = <uint8_t*>PyBytes_AS_STRING(out)
        with nogil:
            self._core.export_into(k, dp, n, rp, rn)
        return out

    def import_block(self, data):
        """Add the block in ``data`` (from ``export_block``); damaged or foreign data is a ValueError
        and changes nothing. External-row mode: returns the slots where the owner writes the data's
        rows (in order; -1 when the block was already held); held mode: None."""
        cdef const uint8_t[::1] raw = as_block_data(data)
        cdef size_t n = raw.shape[0]
        cdef const uint8_t* dp = &raw[0] if n else NULL
        cdef vector[int64_t] slots
        with nogil:
            slots = self._core.import_block(dp, n)
        if not self._external:
            return None
        return _slots_array(slots)
