# cython: language_level=3
# Declarations of the C++ prefix store (csrc/include/dspark/prefix_store.hpp).
# Declarations only: the wrapper lives in _prefix_store.pxi (part of _stager).
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.vector cimport vector

from dspark_core._ext._lib_row_format cimport Storage, ElemType, NonFinite, dspark_translate_exception
from dspark_core._ext._lib_stager cimport FieldInfo, RowMode, RowOptions, SlotMove, SlotRun


cdef extern from "dspark/prefix_store.hpp" namespace "dspark" nogil:
    size_t PREFIX_MAX_KEY_BYTES

    cdef cppclass PrefixStoreOptions(RowOptions):
        int64_t block_tokens
        int64_t budget_bytes

    cdef cppclass KeyChain:
        const uint8_t* bytes
        const size_t* offsets
        size_t n

    cdef cppclass PrefixHit:
        int64_t n_tokens
        int64_t need_first
        int64_t first_row
        int64_t replay_from
        int64_t rows
        int64_t origin
        bool exact
        int64_t blocks_found

    cdef cppclass PrefixBlockInfo:
        int64_t start
        int64_t end
        SlotRun kept
        int64_t rows
        int64_t pages

    # Read field by field through PREFIX_STATS_FIELDS (the core's list).
    cdef cppclass PrefixStats:
        pass

    const FieldInfo* PREFIX_HIT_FIELDS
    const FieldInfo* PREFIX_STATS_FIELDS

    cdef cppclass PrefixStore:
        PrefixStore(const PrefixStoreOptions& options) except +dspark_translate_exception
        size_t row_bytes()
        int64_t w_keep()
        int64_t page_rows()
        int64_t n_pages()
        int64_t table_rows()
        bool external()
        void publish_rows(const KeyChain& keys, int64_t start, int64_t end, const void* rows, ElemType type,
                          size_t rows_bytes) except +dspark_translate_exception
        vector[int64_t] publish_slots(const KeyChain& keys, int64_t start,
                                      int64_t end) except +dspark_translate_exception
        int64_t evict(const KeyChain& keys) except +dspark_translate_exception
        void clear() except +dspark_translate_exception
        size_t size() except +dspark_translate_exception
        bool contains(string key) except +dspark_translate_exception
        PrefixBlockInfo info(string key) except +dspark_translate_exception
        vector[int64_t] block_slots(string key) except +dspark_translate_exception
        vector[string] keys() except +dspark_translate_exception
        PrefixStats stats() except +dspark_translate_exception
        PrefixHit lookup(const KeyChain& keys, int64_t n_tokens) except +dspark_translate_exception
        size_t export_size(string key) except +dspark_translate_exception
        size_t export_into(string key, uint8_t* dst, size_t cap, const uint8_t* rows,
                           size_t rows_bytes) except +dspark_translate_exception
        vector[int64_t] import_block(const uint8_t* data, size_t n) except +dspark_translate_exception

    # The Stager side of the store: two methods of dspark::Stager (whose full
    # declaration is _lib_stager.Stager), declared here under their own name
    # so that _lib_stager.pxd need not know the store's types. A
    # <StagerPrefixSide*> cast of a _lib_stager.Stager* is the same object.
    cdef cppclass StagerPrefixSide "dspark::Stager":
        vector[SlotMove] publish_prefix(int64_t seq, PrefixStore& store, const KeyChain& keys, int64_t start,
                                        int64_t end, uint64_t* serial) except +dspark_translate_exception
        PrefixHit start_from_prefix(int64_t seq, PrefixStore& store, const KeyChain& keys, int64_t n_tokens,
                                    vector[SlotMove]* moves, uint64_t* serial,
                                    const int32_t* tokens) except +dspark_translate_exception
        vector[SlotMove] publish_prefix_many(const int64_t* seqs, size_t n, PrefixStore& store, const KeyChain* keys,
                                             const int64_t* starts, const int64_t* ends,
                                             uint64_t* serial) except +dspark_translate_exception
        void start_from_prefix_many(const int64_t* seqs, size_t n, PrefixStore& store, const KeyChain* keys,
                                    const int64_t* n_tokens, vector[PrefixHit]& hits, vector[SlotMove]* moves,
                                    uint64_t* serial, const int32_t* tokens) except +dspark_translate_exception
