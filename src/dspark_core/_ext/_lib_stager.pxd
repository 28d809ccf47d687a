# cython: language_level=3
# Declarations of the C++ Stager API (csrc/include/dspark/stager.hpp).
# Declarations only: the wrapper lives in _stager.pyx.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libcpp.string cimport string
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.utility cimport pair
from libcpp.vector cimport vector

from dspark_core._ext._lib_row_format cimport Storage, ElemType, NonFinite, dspark_translate_exception


cdef extern from "dspark/step_math.hpp" nogil:
    # One entry of the step's output list (STEP_OUTPUTS): name, pointer offset in Outputs, element bytes, shape.
    cdef cppclass StepOutputInfo "dspark::device_step::OutputInfo":
        const char* name
        size_t offset
        size_t elem_bytes
        const char* shape
    # Where a device step writes its answers (any pointer but status may be NULL).
    cdef cppclass StepOutputs "dspark::device_step::Outputs":
        int32_t* status
        int32_t* skip
        int32_t* flags
        int64_t* start
        int64_t* pos_base
        int64_t* crop_from
        int64_t* n_rows
        int64_t* row_slots
        int32_t* row_positions
        int32_t* block_positions
        int64_t* verify_slots
    cdef cppclass StepConfig "dspark::device_step::Config":
        int64_t block
        int64_t window
        int64_t w_keep
        int64_t ring_rows
        int64_t max_seqs
        int64_t max_rows
        int64_t trim_chunk
        int64_t max_position
    # Where a CSR pass writes (Stager::step_rows; row_slots / row_positions may be NULL).
    cdef cppclass StepCsrRows "dspark::device_step::CsrRows":
        int64_t* row_offsets
        int64_t* row_slots
        int32_t* row_positions
    int STEP_FIELD_COUNT "dspark::device_step::FIELD_COUNT"
    int64_t step_columns "dspark::device_step::columns"(const StepConfig& c)


# Stager::snapshot_alloc's allocator: runs with no core lock held (it may take the GIL).
ctypedef uint8_t* (*SnapshotAlloc)(size_t bytes, void* ctx) noexcept nogil

cdef extern from "dspark/stager.hpp" namespace "dspark" nogil:
    int64_t TRIM_CHUNK
    int64_t MAX_POSITION
    int64_t MAX_WINDOW
    int64_t MAX_FEATURE_DIM
    int64_t MAX_SEQS_LIMIT
    int64_t w_keep(int64_t block_size, int64_t window)
    int64_t ring_rows(int64_t block_size, int64_t window)
    int ROW_MODE_COUNT
    int FAIL_STAGE_COUNT

    # std::vector<uint8_t> with an allocator that skips zero-filling.
    cdef cppclass ByteVec:
        uint8_t* data()
        size_t size()
        void resize(size_t n) except +

    void advise_huge_pages(void* p, size_t n)

    cdef cppclass BufferPool:
        void grow(ByteVec& v, size_t nbytes) except +
        void give(ByteVec v)
        size_t pooled_bytes()

    enum class RowMode(uint8_t):
        Held
        External

    enum class DrafterKind(uint8_t):
        Block
        Chain

    cdef cppclass SlotRun:
        int64_t first
        int64_t count

    cdef cppclass SlotMove:
        int64_t src
        int64_t dst
        int64_t count

    void copy_slot_rows(const SlotMove* moves, size_t n, const uint8_t* src, int64_t src_rows, uint8_t* dst,
                        int64_t dst_rows, size_t row_bytes) except +dspark_translate_exception

    cdef cppclass RowOptions:
        int64_t feature_dim
        int64_t block_size
        int64_t window
        Storage storage
        NonFinite nonfinite
        ElemType stage
        RowMode rows

    cdef cppclass StagerOptions(RowOptions):
        DrafterKind kind
        int64_t max_seqs
        int64_t max_failures
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

    cdef cppclass RowView:
        const uint8_t* data[2]
        size_t rows[2]
        shared_ptr[const void] keep

    # Read field by field through SEQ_STATE_FIELDS / SEQ_STATS_FIELDS (the
    # core's one list of each; see stager.hpp).
    cdef cppclass SeqState:
        pass

    cdef cppclass SeqStats:
        pass

    cdef cppclass StagerTotals:
        SeqStats stats
        vector[int64_t] accepted
        int64_t started

    cdef cppclass FieldInfo:
        const char* name
        size_t offset
        bool is_bool

    const FieldInfo* SEQ_STATE_FIELDS
    const FieldInfo* SEQ_STATS_FIELDS
    const char* const* SEQ_STATS_GAUGES
    const char* const* SEQ_STATS_PEAKS
    const FieldInfo* STEP_CONFIG_FIELDS
    const StepOutputInfo* STEP_OUTPUTS
    const char* const* STEP_STATE_FIELDS

    # What a call needs of a sequence's state (Stager::Need).
    enum class Need "dspark::Stager::Need"(uint8_t):
        Ready
        Open
        Reserved
        Any
        Tree

    cdef cppclass Stager:
        Stager(const StagerOptions& options) except +dspark_translate_exception
        int64_t w_keep()
        size_t row_bytes()
        int64_t ring_rows()
        int64_t max_plan_rows()
        uint64_t moves_issued()
        const char* last_change()
        uint64_t changes_of(const int64_t* seqs, size_t n) except +dspark_translate_exception
        void check_sequence(int64_t seq, Need need) except +dspark_translate_exception
        void check_batch(const char* call, const int64_t* seqs, size_t n, Need need) except +dspark_translate_exception
        void check_process(int64_t seq, const int64_t* positions, size_t n,
                           const int32_t* tokens) except +dspark_translate_exception
        void check_process_many(const int64_t* seqs, size_t n, const int64_t* offsets, const int64_t* positions,
                                size_t total, const int32_t* tokens) except +dspark_translate_exception
        void begin(int64_t seq) except +dspark_translate_exception
        void process(int64_t seq, const int64_t* positions, size_t n, const void* rows,
                     ElemType type, const int32_t* tokens) except +dspark_translate_exception
        void process_encoded(int64_t seq, const int64_t* positions, size_t n, const uint8_t* data,
                             size_t nbytes, const int32_t* tokens) except +dspark_translate_exception
        void process_external(int64_t seq, const int64_t* positions, size_t n,
                              int64_t* slots_out, const int32_t* tokens) except +dspark_translate_exception
        void tokens(int64_t seq, int64_t start, int64_t stop, int32_t* out) except +dspark_translate_exception
        RoundPlan draft(int64_t seq, int64_t n_past, ByteVec& rows_out) except +dspark_translate_exception
        RoundPlan draft_view(int64_t seq, int64_t n_past, RowView& view) except +dspark_translate_exception
        void draft_many(const int64_t* seqs, const int64_t* n_pasts, size_t n, vector[RoundPlan]& plans,
                        ByteVec& rows_out) except +dspark_translate_exception
        void draft_many_view(const int64_t* seqs, const int64_t* n_pasts, size_t n, vector[RoundPlan]& plans,
                             vector[RowView]& views, const char* call) except +dspark_translate_exception
        void commit(int64_t seq) except +dspark_translate_exception
        int64_t fail(int64_t seq, FailStage stage) except +dspark_translate_exception
        void accept(int64_t seq, int64_t n_accepted) except +dspark_translate_exception
        void process_tree(int64_t seq, int64_t n_past, const int64_t* parents, size_t n, const void* rows,
                          ElemType type, const int32_t* tokens) except +dspark_translate_exception
        void process_tree_external(int64_t seq, int64_t n_past, const int64_t* parents, size_t n,
                                   int64_t* slots_out, const int32_t* tokens) except +dspark_translate_exception
        void check_process_tree(int64_t seq, int64_t n_past, const int64_t* parents,
                                size_t n, const int32_t* tokens) except +dspark_translate_exception
        void process_tree_many(const int64_t* seqs, size_t n, const int64_t* cu_seqlens, const int64_t* n_pasts,
                               const int64_t* parents, size_t total, const void* rows,
                               ElemType type, const int32_t* tokens) except +dspark_translate_exception
        void process_tree_external_many(const int64_t* seqs, size_t n, const int64_t* cu_seqlens,
                                        const int64_t* n_pasts, const int64_t* parents, size_t total,
                                        int64_t* slots_out, const char* call,
                                        const int32_t* tokens) except +dspark_translate_exception
        vector[SlotMove] accept_path(int64_t seq, const int64_t* nodes, size_t n,
                                     uint64_t* serial) except +dspark_translate_exception
        vector[SlotMove] accept_path_many(const int64_t* seqs, size_t n, const int64_t* cu_seqlens,
                                          const int64_t* nodes, size_t total,
                                          uint64_t* serial) except +dspark_translate_exception
        void process_many(const int64_t* seqs, size_t n, const int64_t* cu_seqlens, const int64_t* positions,
                          size_t total, const void* rows, ElemType type,
                          const int32_t* tokens) except +dspark_translate_exception
        void process_external_many(const int64_t* seqs, size_t n, const int64_t* cu_seqlens,
                                   const int64_t* positions, size_t total, int64_t* slots_out,
                                   const char* call, const int32_t* tokens) except +dspark_translate_exception
        void accept_many(const int64_t* seqs, const int64_t* n_accepted, size_t n) except +dspark_translate_exception
        void commit_many(const int64_t* seqs, size_t n) except +dspark_translate_exception
        void fail_many(const int64_t* seqs, const FailStage* stages, size_t n,
                       int64_t* disabled_after) except +dspark_translate_exception
        void reserve(int64_t seq, const int64_t* positions, size_t n,
                     int64_t* slots_out, const int32_t* tokens) except +dspark_translate_exception
        void reserve_many(const int64_t* seqs, size_t n, const int64_t* cu_seqlens, const int64_t* positions,
                          size_t total, int64_t* slots_out, const int32_t* tokens) except +dspark_translate_exception
        void confirm(int64_t seq) except +dspark_translate_exception
        void cancel(int64_t seq) except +dspark_translate_exception
        void confirm_many(const int64_t* seqs, size_t n) except +dspark_translate_exception
        void cancel_many(const int64_t* seqs, size_t n) except +dspark_translate_exception
        void end(int64_t seq) except +dspark_translate_exception
        void end_many(const int64_t* seqs, size_t n) except +dspark_translate_exception
        void disable(int64_t seq) except +dspark_translate_exception
        void enable(int64_t seq) except +dspark_translate_exception
        void disable_many(const int64_t* seqs, size_t n) except +dspark_translate_exception
        void enable_many(const int64_t* seqs, size_t n) except +dspark_translate_exception
        void rollback(int64_t seq, int64_t n_past) except +dspark_translate_exception
        vector[SlotMove] shift(int64_t seq, int64_t n_keep, int64_t n_discard,
                               uint64_t* serial) except +dspark_translate_exception
        vector[SlotMove] fork(int64_t src, int64_t dst, uint64_t* serial) except +dspark_translate_exception
        size_t snapshot_size(int64_t seq) except +dspark_translate_exception
        size_t snapshot_into(int64_t seq, uint8_t* dst, size_t cap) except +dspark_translate_exception
        vector[uint8_t] snapshot(int64_t seq) except +dspark_translate_exception
        size_t snapshot_alloc(int64_t seq, SnapshotAlloc alloc, void* ctx) except +dspark_translate_exception
        void restore(int64_t seq, const uint8_t* data, size_t nbytes, SlotRun* runs_out,
                     uint64_t* serial) except +dspark_translate_exception
        int64_t check_restore(int64_t seq, const uint8_t* data, size_t nbytes) except +dspark_translate_exception
        SeqState state(int64_t seq) except +dspark_translate_exception
        void live_slots(int64_t seq, SlotRun* out) except +dspark_translate_exception
        pair[int64_t, int64_t] publishable(int64_t seq) except +dspark_translate_exception
        SeqStats stats(int64_t seq) except +dspark_translate_exception
        vector[int64_t] accepted(int64_t seq) except +dspark_translate_exception
        void accepted_many(const int64_t* seqs, size_t n, int64_t* out) except +dspark_translate_exception
        StagerTotals totals() except +dspark_translate_exception
        uint64_t open_round_id(int64_t seq) except +dspark_translate_exception
        void open_round_ids(const int64_t* seqs, size_t n, uint64_t* out) except +dspark_translate_exception
        # the device step (stager_device_step.cpp)
        void to_device(const int64_t* seqs, size_t n, int32_t* tokens,
                       size_t n_tokens) except +dspark_translate_exception
        void to_host(const int64_t* seqs, size_t n, const int32_t* outcomes, int64_t* disabled_after,
                     const int32_t* tokens, size_t n_tokens) except +dspark_translate_exception
        void step_many(const int64_t* seqs, const int64_t* n_accepted, size_t n,
                       const StepOutputs& out) except +dspark_translate_exception
        void check_step(const int64_t* seqs, const int32_t* statuses, size_t n) except +dspark_translate_exception
        void step_rows(const int64_t* seqs, size_t n, const StepOutputs& out, size_t capacity,
                       const StepCsrRows& rows) except +dspark_translate_exception
        StepConfig step_config()
        bool on_device(int64_t seq) except +dspark_translate_exception
        int64_t* step_state() except +dspark_translate_exception
        const shared_ptr[BufferPool]& pool()

    # "" for Skip::None and past the last reason; nullptr past the last stage / mode.
    const char* skip_name(Skip s)
    const char* fail_stage_name(FailStage s)
    const char* row_mode_name(RowMode m)
    const char* drafter_kind_name(DrafterKind k)
    string mismatch_cause(int64_t n_past, int64_t end) except +dspark_translate_exception
    void plan_rows(const RoundPlan* plans, size_t n, int64_t* row_offsets, int32_t* positions, int64_t* slots)
    # The batch plan's rows (names null-terminated) and its one packer.
    const char* const* BATCH_META_ROWS
    const char* const* BATCH_FLAG_ROWS
    const char* const* ROUND_PLAN_FIELDS
    void pack_plans(const RoundPlan* plans, size_t n, int64_t* meta, uint8_t* flags, int32_t* positions,
                    int64_t* slots)
    void pad_rows(const int64_t* seqs, size_t n, const int64_t* row_offsets, const int32_t* values, size_t total,
                  size_t max_rows, int32_t* out) except +dspark_translate_exception
    void pad_rows(const int64_t* seqs, size_t n, const int64_t* row_offsets, const int64_t* values, size_t total,
                  size_t max_rows, int64_t* out) except +dspark_translate_exception
    void paged_rows(const int64_t* seqs, size_t n, const int64_t* pos_base, const int64_t* row_offsets,
                    const int32_t* positions, size_t total, const int32_t* block_tables, size_t m, size_t table_stride,
                    int64_t block_tokens, int32_t null_block, int32_t* shifted_out,
                    int64_t* slots_out) except +dspark_translate_exception
    string batch_context(const char* call, size_t i, int64_t seq) except +dspark_translate_exception


# Its path switch is the dispatch registry's (_lib_row_format.pxd).
cdef extern from "dspark/crc32c.hpp" namespace "dspark" nogil:
    uint32_t crc32c(uint32_t crc, const void* data, size_t n)
