# cython: language_level=3
# Declarations of the C++ Stager API (csrc/include/dspark/stager.hpp).
# Declarations only: the wrapper lives in _stager.pyx.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libcpp.string cimport string
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.vector cimport vector

from dspark_core._ext._lib_row_format cimport Storage, ElemType, NonFinite, dspark_translate_exception


cdef extern from "dspark/stager.hpp" namespace "dspark" nogil:
    int64_t TRIM_CHUNK
    int64_t MAX_POSITION
    int64_t MAX_WINDOW
    int64_t MAX_FEATURE_DIM
    int64_t MAX_SEQS_LIMIT
    int ROW_MODE_COUNT
    int FAIL_STAGE_COUNT

    # std::vector<uint8_t> with an allocator that skips zero-filling.
    cdef cppclass ByteVec:
        uint8_t* data()
        size_t size()

    void advise_huge_pages(void* p, size_t n)

    cdef cppclass BufferPool:
        void give(ByteVec v)
        size_t pooled_bytes()

    enum class RowMode(uint8_t):
        Held
        External

    cdef cppclass SlotRun:
        int64_t first
        int64_t count

    cdef cppclass SlotMove:
        int64_t src
        int64_t dst
        int64_t count

    cdef cppclass StagerOptions:
        int64_t feature_dim
        int64_t block_size
        int64_t window
        int64_t max_seqs
        Storage storage
        int64_t max_failures
        NonFinite nonfinite
        ElemType stage
        RowMode rows
        bool strict

    void check_options(const StagerOptions& options) except +dspark_translate_exception

    # dspark::Skip::None (0) cannot be named from Cython: compare <int>skip with 0.
    enum class Skip(uint8_t):
        Disabled
        Empty
        NoContext
        MissingRows

    enum class FailStage(uint8_t):
        Decode
        Crop

    cdef cppclass RoundPlan:
        int64_t seq
        uint64_t round
        Skip skip
        bool mismatch
        bool report_mismatch
        int64_t end
        bool rebase
        bool clear_cache
        int64_t start
        int64_t pos_base
        int64_t first_row
        int64_t n_rows
        int64_t crop_from
        SlotRun slot_runs[2]

    # Read field by field through SEQ_STATE_FIELDS / SEQ_STATS_FIELDS (the
    # core's one list of each; see stager.hpp).
    cdef cppclass SeqState:
        pass

    cdef cppclass SeqStats:
        pass

    cdef cppclass FieldInfo:
        const char* name
        size_t offset
        bool is_bool

    const FieldInfo* SEQ_STATE_FIELDS
    const FieldInfo* SEQ_STATS_FIELDS

    cdef cppclass Stager:
        Stager(const StagerOptions& options) except +dspark_translate_exception
        int64_t w_keep()
        size_t row_bytes()
        int64_t ring_rows()
        uint64_t moves_issued()
        void check_sequences(const int64_t* seqs, size_t n, bool open_round) except +dspark_translate_exception
        void check_process(int64_t seq, const int64_t* positions, size_t n) except +dspark_translate_exception
        void begin(int64_t seq) except +dspark_translate_exception
        void process(int64_t seq, const int64_t* positions, size_t n, const void* rows,
                     ElemType type) except +dspark_translate_exception
        void process_encoded(int64_t seq, const int64_t* positions, size_t n, const uint8_t* data,
                             size_t nbytes) except +dspark_translate_exception
        void process_external(int64_t seq, const int64_t* positions, size_t n,
                              int64_t* slots_out) except +dspark_translate_exception
        RoundPlan draft(int64_t seq, int64_t n_past, ByteVec& rows_out) except +dspark_translate_exception
        void draft_many(const int64_t* seqs, const int64_t* n_pasts, size_t n, vector[RoundPlan]& plans,
                        ByteVec& rows_out) except +dspark_translate_exception
        void commit(int64_t seq) except +dspark_translate_exception
        int64_t fail(int64_t seq, FailStage stage) except +dspark_translate_exception
        void accept(int64_t seq, int64_t n_accepted) except +dspark_translate_exception
        void rollback(int64_t seq, int64_t n_past) except +dspark_translate_exception
        vector[SlotMove] shift(int64_t seq, int64_t n_keep, int64_t n_discard,
                               uint64_t* serial) except +dspark_translate_exception
        vector[SlotMove] fork(int64_t src, int64_t dst, uint64_t* serial) except +dspark_translate_exception
        size_t snapshot_size(int64_t seq) except +dspark_translate_exception
        size_t snapshot_into(int64_t seq, uint8_t* dst, size_t cap) except +dspark_translate_exception
        vector[uint8_t] snapshot(int64_t seq) except +dspark_translate_exception
        void restore(int64_t seq, const uint8_t* data, size_t nbytes, SlotRun* runs_out,
                     uint64_t* serial) except +dspark_translate_exception
        SeqState state(int64_t seq) except +dspark_translate_exception
        void live_slots(int64_t seq, SlotRun* out) except +dspark_translate_exception
        SeqStats stats(int64_t seq) except +dspark_translate_exception
        uint64_t open_round_id(int64_t seq) except +dspark_translate_exception
        const shared_ptr[BufferPool]& pool()

    # "" for Skip::None and past the last reason; nullptr past the last stage / mode.
    const char* skip_name(Skip s)
    const char* fail_stage_name(FailStage s)
    const char* row_mode_name(RowMode m)
    string mismatch_cause(int64_t n_past, int64_t end) except +dspark_translate_exception


# Its path switch is the dispatch registry's (_lib_row_format.pxd).
cdef extern from "dspark/crc32c.hpp" namespace "dspark" nogil:
    uint32_t crc32c(uint32_t crc, const void* data, size_t n)
