// Stager: the per-sequence staging state machine of docs/design.md section 2.
//
// The pure-Python twin (src/dspark_core/reference/stager.py) spells out the
// same rules; this implementation must match it op for op (the hypothesis
// state machine in tests/ checks plans, rows, exceptions, their messages and
// state after every call). Differences are physical only: rows live in a ring
// (FeatureBuffer), rows below the horizon are dropped lazily in TRIM_CHUNK
// chunks, and a long prefill never holds more than the rows a later round can
// stage.
//
// Every rule of the contract lives here once: the limits, the argument checks
// and their order (design.md 2.1), strict mode and the protocol-mismatch
// report. The Python binding and the C ABI add no rule: they convert their
// callers' arguments and the results, turn errors into their callers' kind
// (exceptions, status codes), and the binding logs the mismatch reports the
// core makes.
//
// Thread safety: each sequence has its own mutex. A call takes the locks of
// the sequences it touches (fork: two; a batch: every sequence of it) in
// increasing id order, so calls on different sequences from different
// threads run in parallel and no two calls can deadlock; the Stager-wide
// counters (round ids, move serials) are atomics taken while those locks are
// held, so for calls on a common sequence their order is the calls' order.
// Other locks (the spare ring's, a prefix store's, the buffer pool's) are
// only ever taken after sequence locks. The Python binding releases the GIL
// around every call that moves rows (commit and accept, a few counters, keep
// it). Every rejected call throws before it changes any state.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dspark/byte_buffer.hpp"
#include "dspark/field_list.hpp"
#include "dspark/feature_buffer.hpp"
#include "dspark/row_format.hpp"
#include "dspark/step_math.hpp"

namespace dspark {

class PrefixStore;  // dspark/prefix_store.hpp
struct KeyChain;
struct PrefixHit;
struct PrefixPlannedBlock;
struct PrefixBatchBlocks;  // a publish batch's new blocks (stager_prefix.cpp)

// Head rows below the horizon are dropped once this many have piled up.
inline constexpr std::int64_t TRIM_CHUNK = 512;
// Positions stay below this so that pos + block never overflows.
inline constexpr std::int64_t MAX_POSITION = std::int64_t(1) << 62;
// Upper bounds of the configuration: drafter positions are int32 in a plan and
// the snapshot header stores window, feature_dim and row_bytes as u32.
inline constexpr std::int64_t MAX_WINDOW = std::int64_t(1) << 30;
inline constexpr std::int64_t MAX_FEATURE_DIM = std::int64_t(1) << 28;
// Upper bound on max_seqs: a sanity limit (sequences allocate nothing until
// they first receive rows), and global slots s * ring_rows stay far from
// overflow.
inline constexpr std::int64_t MAX_SEQS_LIMIT = std::int64_t(1) << 16;

// K: the rows a rebase keeps (== W / 2, since W > 2B). The binding publishes
// it (StagerConfig.w_keep, plan_context); the Stager and the prefix store's
// keep rule use it.
inline constexpr std::int64_t w_keep(std::int64_t block_size, std::int64_t window) noexcept {
    return window / 2 < window - block_size ? window / 2 : window - block_size;
}
// The rows a sequence ever holds, the slots of its ring: W + TRIM_CHUNK + B + 1
// (live rows stay <= W + B; dead head rows go once TRIM_CHUNK pile up).
inline constexpr std::int64_t ring_rows(std::int64_t block_size, std::int64_t window) noexcept {
    return window + TRIM_CHUNK + block_size + 1;
}
// The most nodes a tree verify batch holds (Stager::process_tree): the
// tentative rows a linear verify batch brings, which ring_rows has room for.
inline constexpr std::int64_t max_tree_nodes(std::int64_t block_size) noexcept { return block_size + 1; }

// Who holds the row bytes. Held: the Stager keeps every row in its own ring
// and plans carry the rows. External: the Stager runs the same state machine
// over the same ring bookkeeping but holds no bytes; process() returns the
// slot where the owner writes each row, plans carry the slots of their rows,
// and lifecycle operations that move rows return the copies to apply. Slots
// are global: seq * ring_rows() + ring index, one table of
// max_seqs * ring_rows() rows that the owner allocates.
enum class RowMode : std::uint8_t { Held = 0, External = 1 };
inline constexpr int ROW_MODE_COUNT = 2;
// "held", "external"; nullptr past the last mode (the binding enumerates them).
const char* row_mode_name(RowMode m) noexcept;

// The drafter the rows serve. Block (DSpark / DFlash): a round stages its
// context rows and a block of B queries. Chain (EAGLE-3, EAGLE, MTP heads):
// the drafter consumes each row with the id of the token after it into its
// own cache, then drafts one token per step; the core keeps, beside every
// row, the id of the token the target read at the row's position (process
// takes them), and a plan's staged rows come with theirs (Stager::tokens), so
// the drafter pairs row p with the id of p + 1 (the newest row: the token the
// round drafts from). The windows, rebases and recoveries are the same.
enum class DrafterKind : std::uint8_t { Block = 0, Chain = 1 };
inline constexpr int DRAFTER_KIND_COUNT = 2;
// "block", "chain"; nullptr past the last kind.
const char* drafter_kind_name(DrafterKind k) noexcept;

// The rows' configuration: what a row holds and which rows a round stages.
// A Stager has these and its own fields below; a PrefixStore has these of
// the Stagers it serves (prefix_store.hpp), and only those Stagers share it.
struct RowOptions {
    std::int64_t feature_dim = 0;
    std::int64_t block_size = 0;
    std::int64_t window = 0;
    Storage storage = Storage::F32;
    NonFinite nonfinite = NonFinite::Error;
    // The element type plans are staged out in: rows must stay finite after
    // that last narrowing too (an f32-stored 9e4 staged as f16 is +inf).
    ElemType stage = ElemType::F32;
    RowMode rows = RowMode::Held;
};

struct StagerOptions : RowOptions {
    DrafterKind kind = DrafterKind::Block;
    std::int64_t max_seqs = 1;
    std::int64_t max_failures = 3;
    // A draft whose n_past disagrees with the buffered rows (an out-of-protocol
    // call, docs/protocol.md section 3) throws StateError instead of skipping.
    bool strict = false;
};

// Throws ConfigError naming the first unusable value (the order: each field
// >= 1, the codes, W > 2B, the limits, whole q blocks). The Stager's
// constructor runs it; StagerConfig (Python) and dspark_stager_create run
// nothing else.
void check_options(const StagerOptions& options);

// Why draft() staged nothing, in the order the reasons are checked.
// Why draft opened no round. DraftingOff: the server turned drafting off for
// the request (disable); rows keep flowing, and enable drafts at once.
enum class Skip : std::uint8_t { None = 0, Disabled = 1, Empty = 2, NoContext = 3, MissingRows = 4, DraftingOff = 5 };

enum class FailStage : std::uint8_t { Decode = 0, Crop = 1 };

// One sequence's round, as planned by draft(). Context rows are the absolute
// positions [first_row, start), staged at drafter positions
// [first_row - pos_base, start - pos_base); the block follows at
// [start - pos_base, start - pos_base + B); crop_from == start - pos_base.
// The fields the C ABI's dspark_plan mirrors (copied through this list;
// dspark_plan adds rows_mode and the slot runs as arrays).
#define DSPARK_ROUND_PLAN_FIELDS(X)  \
    X(std::int64_t, seq)             \
    X(std::uint64_t, round)          \
    X(Skip, skip)                    \
    X(bool, rebase)                  \
    X(bool, clear_cache)             \
    X(std::int64_t, start)           \
    X(std::int64_t, pos_base)        \
    X(std::int64_t, first_row)       \
    X(std::int64_t, n_rows)          \
    X(std::int64_t, crop_from)
struct RoundPlan {
    // round: the round this plan opened, unique within its Stager (from 1),
    // 0 for a skip. An owner of external rows reads plan.slot_runs only while
    // open_round_id(seq) is this round (later writes may reuse the slots).
    DSPARK_ROUND_PLAN_FIELDS(DSPARK_DECLARE_FIELD)
    // A protocol mismatch (docs/protocol.md section 3): the sequence holds rows
    // and is not disabled, but start is not its buffered end `end` (newest row
    // + 1). Only a non-strict Stager returns such a plan (a skip); report is
    // set on the sequence's first mismatch since its last begin(): log that one.
    bool mismatch = false;
    bool report_mismatch = false;
    std::int64_t end = 0;
    // The slots of the n_rows staged rows, in plan order (both modes): at
    // most two runs, the second starting at the sequence's first slot.
    SlotRun slot_runs[2];
    // A skip's: no drafter positions (the list's defaults are zero).
    RoundPlan() noexcept : pos_base(-1), crop_from(-1) {}
};

// A round's staged rows where they lie in the sequence's ring (draft_view):
// in storage format, oldest first, in at most two runs (the second starts at
// the ring's first slot when the rows wrap); run k is rows[k] rows at data[k].
// The runs stay valid until the next call that may change the sequence's rows
// (any call on it but commit, fail and the read-only ones) or the Stager's
// destruction. `keep` shares the ring's bytes: holding it keeps them allocated
// (a stale view then reads rows that replaced its own, never freed memory).
struct RowView {
    const std::uint8_t* data[2] = {nullptr, nullptr};
    std::size_t rows[2] = {0, 0};
    std::shared_ptr<const void> keep;
};

// Protocol state of one sequence (the reference's state() dict), and its
// counters since the last begin(): each field listed once, as
// X(type, name). The structs, the C ABI's copies (dspark_state and
// dspark_stats must have a field of each name), and the binding's dicts
// (through SEQ_STATE_FIELDS / SEQ_STATS_FIELDS) all come from these lists.
#define DSPARK_SEQ_STATE_FIELDS(X)         \
    X(bool, started)                       \
    X(std::int64_t, end)                   \
    X(std::int64_t, horizon)               \
    X(std::int64_t, n_cache)               \
    X(std::int64_t, pos_base)              \
    X(std::int64_t, n_retained)            \
    X(std::int64_t, n_pending)             \
    X(bool, open_round)                    \
    X(std::int64_t, consecutive_failures)  \
    X(bool, disabled)                      \
    X(bool, restage_owed)                  \
    X(bool, first_round)                   \
    X(std::int64_t, tentative_rows)        \
    X(bool, reservation_open)              \
    X(bool, drafting_off)                  \
    X(std::int64_t, tree_nodes)

// Counters since the sequence's last begin().
//  rounds / commits / failures / rebases / skips: calls that opened a round,
//    closed it either way, rebased, or skipped;
//  staged_rows / restaged_rows: context rows handed out (all / on rebases);
//  trims / trimmed_rows: head drops of rows below the horizon;
//  live_rows: rows that can still be staged (end - horizon);
//  rows / peak_rows: rows physically held (live + untrimmed dead head);
//  bytes / peak_bytes: ring memory written so far (resident);
//  reserved_bytes: ring address space reserved (the bound, untouched until used);
//  skips_<reason>: the skips of each reason (Skip), summing to skips;
//  verified_rounds / accepted_tokens: the rounds whose verify count arrived
//    (an accept after a committed round's verify rows) and their counts
//    summed: the histogram's total and sum (Stager::accepted; filled on read).
#define DSPARK_SEQ_STATS_FIELDS(X)      \
    X(std::int64_t, rounds)             \
    X(std::int64_t, commits)            \
    X(std::int64_t, failures)           \
    X(std::int64_t, rebases)            \
    X(std::int64_t, staged_rows)        \
    X(std::int64_t, restaged_rows)      \
    X(std::int64_t, skips)              \
    X(std::int64_t, trims)              \
    X(std::int64_t, trimmed_rows)       \
    X(std::int64_t, live_rows)          \
    X(std::int64_t, rows)               \
    X(std::int64_t, peak_rows)          \
    X(std::int64_t, bytes)              \
    X(std::int64_t, peak_bytes)         \
    X(std::int64_t, reserved_bytes)     \
    X(std::int64_t, skips_disabled)     \
    X(std::int64_t, skips_empty)        \
    X(std::int64_t, skips_no_context)   \
    X(std::int64_t, skips_missing_rows) \
    X(std::int64_t, skips_drafting_off) \
    X(std::int64_t, verified_rounds)    \
    X(std::int64_t, accepted_tokens)
// The fields of the list that are levels, not counters, as X(name): a
// Stager's totals add the gauges over the sequences holding rows now and take
// the peaks' maximum over every sequence since the Stager began; every other
// field is a counter, added over every sequence since then (monotonic).
#define DSPARK_SEQ_STATS_GAUGES(X) X(live_rows) X(rows) X(bytes) X(reserved_bytes)
#define DSPARK_SEQ_STATS_PEAKS(X) X(peak_rows) X(peak_bytes)

struct SeqState {
    DSPARK_SEQ_STATE_FIELDS(DSPARK_DECLARE_FIELD)
};
struct SeqStats {
    DSPARK_SEQ_STATS_FIELDS(DSPARK_DECLARE_FIELD)
};

// A Stager's metrics (Stager::totals), all read at one moment: stats as
// DSPARK_SEQ_STATS_GAUGES / _PEAKS say; accepted[k]: the verified rounds
// with k accepted drafts (block_size + 1 buckets), over every sequence since
// the Stager began; started: the sequences holding rows now. A sequence with
// a reservation open counts as before it (cancel puts those fields back).
struct StagerTotals {
    SeqStats stats;
    std::vector<std::int64_t> accepted;
    std::int64_t started = 0;
};

// The tables of SeqState / SeqStats (field_list.hpp).
extern const FieldInfo SEQ_STATE_FIELDS[];
extern const FieldInfo SEQ_STATS_FIELDS[];
// The names of DSPARK_SEQ_STATS_GAUGES / _PEAKS, null-terminated (an exporter
// types every other stats field as a counter).
extern const char* const SEQ_STATS_GAUGES[];
extern const char* const SEQ_STATS_PEAKS[];
// device_step::Config's fields (DSPARK_STEP_CONFIG_FIELDS, step_math.hpp)
// and device_step::Outputs' (DSPARK_STEP_OUTPUT_FIELDS).
extern const FieldInfo STEP_CONFIG_FIELDS[];
extern const device_step::OutputInfo STEP_OUTPUTS[];
// The step state's field names (DSPARK_STEP_FIELDS), in column order,
// null-terminated: the histogram's block + 1 columns follow them.
extern const char* const STEP_STATE_FIELDS[];

class Stager {
public:
    // Throws ConfigError for an unusable configuration (check_options).
    explicit Stager(const StagerOptions& options);

    const StagerOptions& options() const noexcept { return opt_; }
    std::int64_t w_keep() const noexcept { return w_keep_; }
    std::size_t row_bytes() const noexcept { return row_bytes_; }
    bool external() const noexcept { return opt_.rows == RowMode::External; }
    // Slots per sequence (W + TRIM_CHUNK + B + 1): sequence s owns global
    // slots [s * ring_rows(), (s + 1) * ring_rows()).
    std::int64_t ring_rows() const noexcept { return static_cast<std::int64_t>(ring_rows_); }
    // The most context rows one plan stages: W - B (a round that does not
    // rebase has start - pos_base + B <= W; a rebase stages w_keep <= W - B).
    std::int64_t max_plan_rows() const noexcept { return opt_.window - opt_.block_size; }

    // What a call needs of its sequence's state (design.md 2.1 step 2):
    // Ready: no open round, no reservation and no tree verify batch (every
    // call but the ones below); Open: an open round (commit, fail);
    // Reserved: a reservation (confirm, cancel); Any: nothing (end); Tree:
    // a tree verify batch (accept_path).
    enum class Need : std::uint8_t { Ready = 0, Open = 1, Reserved = 2, Any = 3, Tree = 4 };
    // The checks every call starts with (design.md 2.1 steps 1-2): `seq`
    // exists (std::invalid_argument), and its state is what the call needs
    // (StateError). For a wrapper whose own argument conversion failed: these
    // errors come first, then its own. The calls below make them themselves.
    void check_sequence(std::int64_t seq, Need need = Need::Ready) const;
    void check_sequence(std::int64_t seq, bool open_round) const {
        check_sequence(seq, open_round ? Need::Open : Need::Ready);
    }
    // The same for n sequences of a batch call named `call`: every id
    // exists, then each state, as the batch call itself checks them (its
    // errors prefixed "<call>: seqs[i] (sequence s): ").
    void check_batch(const char* call, const std::int64_t* seqs, std::size_t n, Need need = Need::Ready) const;
    // check_sequence for a call that needs no open round / an open round.
    void check_ready(std::int64_t seq) const { check_sequence(seq, Need::Ready); }
    void check_open(std::int64_t seq) const { check_sequence(seq, Need::Open); }

    void begin(std::int64_t seq);
    // n rows at positions[0..n) of element type `type`, contiguous rows of
    // feature_dim elements (held mode only).
    // tokens (a chain drafter's Stager: required, else must be null): the
    // id of the token the target read at each row's position, >= 0; kept
    // beside the row. The same in every process call below and its batch.
    void process(std::int64_t seq, const std::int64_t* positions, std::size_t n, const void* rows,
                 ElemType type, const std::int32_t* tokens = nullptr);
    // n rows already in storage format (n * row_bytes bytes; held mode only).
    void process_encoded(std::int64_t seq, const std::int64_t* positions, std::size_t n,
                         const std::uint8_t* data, std::size_t nbytes, const std::int32_t* tokens = nullptr);
    // External mode: accept n rows at positions[0..n) that the owner holds;
    // slots_out[i] is the global slot where the owner writes row i, or -1 for
    // a row below the horizon that no round can stage (the owner need not
    // write it). At most two runs of consecutive slots. The core never sees
    // the rows, so it cannot check them for NaN / Inf: the owner does, before
    // this call (DeviceRing validates first, then calls this).
    void process_external(std::int64_t seq, const std::int64_t* positions, std::size_t n, std::int64_t* slots_out,
                          const std::int32_t* tokens = nullptr);
    // The token ids kept beside the rows of positions [from, to) (a chain
    // drafter's Stager; every position stageable: [horizon, end), buffered_positions),
    // oldest first. A plan's staged rows are [first_row, start).
    void tokens(std::int64_t seq, std::int64_t from, std::int64_t to, std::int32_t* out) const;
    DrafterKind kind() const noexcept { return opt_.kind; }
    // Every check process_external (or process, with rows) would make, in
    // its order, without changing anything: an owner of external rows runs
    // it before it looks at the rows it is about to write.
    void check_process(std::int64_t seq, const std::int64_t* positions, std::size_t n,
                       const std::int32_t* tokens = nullptr) const;
    // The same for a batch: every check process_many / process_external_many
    // would make of seqs, offsets and positions, in their order and with
    // their messages ("process_many: seqs[i] ..."), changing nothing.
    void check_process_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                            const std::int64_t* positions, std::size_t total,
                            const std::int32_t* tokens = nullptr) const;
    // Plans a round and appends its rows (storage format; nothing in external
    // mode) to `rows_out`.
    RoundPlan draft(std::int64_t seq, std::int64_t n_past, ByteVec& rows_out);
    // One plan per sequence; rows of all of them appended to `rows_out` in order.
    void draft_many(const std::int64_t* seqs, const std::int64_t* n_pasts, std::size_t n,
                    std::vector<RoundPlan>& plans, ByteVec& rows_out);
    // Where draft_into / draft_many_into put the staged rows. Called exactly
    // once per call, under the Stager's lock, after every check and plan and
    // before any state changes, with the plans; returns room for the rows of
    // all of them in plan order (sum of n_rows * row_bytes() bytes, any
    // alignment), or throws to reject the call, which then changes nothing.
    // Never called in external-row mode (no rows: plans carry slot_runs).
    using RowSink = std::function<std::uint8_t*(const RoundPlan* plans, std::size_t n)>;
    RoundPlan draft_into(std::int64_t seq, std::int64_t n_past, const RowSink& sink);
    void draft_many_into(const std::int64_t* seqs, const std::int64_t* n_pasts, std::size_t n,
                         std::vector<RoundPlan>& plans, const RowSink& sink);
    // draft() without the copy (held mode): the plan, and in `view` its rows
    // where they lie in the ring (RowView says for how long they stay there).
    // A rebase hands the drafter W/2 rows without moving 2 x W/2 rows' bytes.
    RoundPlan draft_view(std::int64_t seq, std::int64_t n_past, RowView& view);
    // draft_many without the copy (held mode): one plan per sequence, and in
    // views[i] the rows of plans[i] where they lie in the ring (as draft_view;
    // empty for a skipped plan). Checked whole, as draft_many. `call` names
    // the call in error messages (a binding that serves it as draft_many says so).
    void draft_many_view(const std::int64_t* seqs, const std::int64_t* n_pasts, std::size_t n,
                         std::vector<RoundPlan>& plans, std::vector<RowView>& views,
                         const char* call = "draft_many_view");
    // The plan draft() would make now; changes nothing (the same checks as
    // draft, strict mode's included).
    RoundPlan peek(std::int64_t seq, std::int64_t n_past) const;
    void commit(std::int64_t seq);
    // Returns the consecutive-failure count when this failure disabled the
    // sequence (log it once), else 0.
    std::int64_t fail(std::int64_t seq, FailStage stage);
    void accept(std::int64_t seq, std::int64_t n_accepted);

    // -- tree verification (docs/design.md 2.11) ---------------------------------
    // A verify batch whose rows are the nodes of a draft tree, processed as
    // one batch: node 0 is the root (the token `last`, at n_past, which must
    // be the sequence's end), parents[0] == -1 and 0 <= parents[i] < i (a
    // parent comes before its child, so there is no cycle), and node i
    // stands at position n_past + depth(i). At most max_tree_nodes(B) = B + 1
    // nodes: the most tentative rows the ring's tail room holds, as for a
    // linear verify batch. It is the first rows after a round's draft (or
    // after its accept, as a linear batch's rows would be): the tree's rows
    // are the tentative rows. The rows lie in the
    // ring in node order; until accept_path keeps one root-to-node path the
    // sequence holds the tree, and every call on it but accept_path, end,
    // disable and enable (and the read-only ones) is a StateError.
    // tokens (a chain drafter's Stager: required, else null): each node's
    // token id, as process takes them (the node's row keeps it; accept_path
    // moves it with the row).
    void process_tree(std::int64_t seq, std::int64_t n_past, const std::int64_t* parents, std::size_t n,
                      const void* rows, ElemType type, const std::int32_t* tokens = nullptr);
    // Every check process_tree / process_tree_external makes of the sequence,
    // n_past and the parents, in its order, changing nothing (an owner of
    // external rows runs it before it looks at the rows, as check_process).
    void check_process_tree(std::int64_t seq, std::int64_t n_past, const std::int64_t* parents, std::size_t n,
                            const std::int32_t* tokens = nullptr) const;
    // External mode: slots_out[i] is the global slot where the owner writes
    // node i's row (at most two runs of consecutive slots, as process_external's).
    void process_tree_external(std::int64_t seq, std::int64_t n_past, const std::int64_t* parents,
                               std::size_t n, std::int64_t* slots_out, const std::int32_t* tokens = nullptr);
    // Keeps the rows of the accepted path nodes[0..n) (nodes[0] == 0, each
    // node the child of the one before it) at the consecutive positions
    // n_past .. n_past + n - 1 and drops every other node's: what
    // accept(seq, n - 1) does after a linear batch (a chain-shaped tree is
    // exactly that, and counts n - 1 accepted drafts). Returns the copies
    // that compact the path, numbered as shift's (*serial); held mode has
    // applied them. A bad path is an error that changes nothing.
    std::vector<SlotMove> accept_path(std::int64_t seq, const std::int64_t* nodes, std::size_t n,
                                      std::uint64_t* serial = nullptr);
    // process_tree for seqs[0..n) (checked whole, as every batch): the tree of
    // seqs[i] is parents[offsets[i] .. offsets[i + 1]) rooted at n_pasts[i],
    // its rows those rows of `rows` (held) or its slots those of slots_out.
    void process_tree_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                           const std::int64_t* n_pasts, const std::int64_t* parents, std::size_t total,
                           const void* rows, ElemType type, const std::int32_t* tokens = nullptr);
    // `call`: the call's name in errors (a binding serves this as process_tree_many).
    void process_tree_external_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                                    const std::int64_t* n_pasts, const std::int64_t* parents, std::size_t total,
                                    std::int64_t* slots_out, const char* call = "process_tree_external_many",
                                    const std::int32_t* tokens = nullptr);
    // accept_path for seqs[0..n) (checked whole, as every batch): the path of
    // seqs[i] is nodes[offsets[i] .. offsets[i + 1]). The moves of all of
    // them, in batch order, under one serial.
    std::vector<SlotMove> accept_path_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                                           const std::int64_t* nodes, std::size_t total,
                                           std::uint64_t* serial = nullptr);

    // -- batches (docs/design.md 2.9) -----------------------------------------
    // One call for the n sequences seqs[0..n) (ids unique), each sequence as
    // its per-sequence call would treat it. A batch is checked whole, step by
    // step in the order of design.md 2.1 (every id, then every state, then
    // the values sequence by sequence, contents last), and a rejected batch
    // changes nothing. An error about one sequence is its per-sequence
    // call's error prefixed with "<call>: seqs[i] (sequence s): ". Rows are
    // flat, as in a varlen batch: the rows of seqs[i] are rows
    // [offsets[i], offsets[i + 1]) of `positions`, `rows` and `slots_out`
    // (offsets: n + 1 entries rising from 0 to `total`, cu_seqlens style).
    // tokens: flat as the rows (a chain drafter's Stager; else null).
    void process_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                      const std::int64_t* positions, std::size_t total, const void* rows, ElemType type,
                      const std::int32_t* tokens = nullptr);
    // `call`: as draft_many_view's (a binding serves this as process_many).
    void process_external_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                               const std::int64_t* positions, std::size_t total, std::int64_t* slots_out);
    void process_external_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                               const std::int64_t* positions, std::size_t total, std::int64_t* slots_out,
                               const char* call, const std::int32_t* tokens = nullptr);
    void accept_many(const std::int64_t* seqs, const std::int64_t* n_accepted, std::size_t n);
    void commit_many(const std::int64_t* seqs, std::size_t n);
    // disabled_after (optional, n entries): what fail() returns, per sequence.
    void fail_many(const std::int64_t* seqs, const FailStage* stages, std::size_t n, std::int64_t* disabled_after);

    // -- slots before the rows (external mode; docs/external_rows.md) ----------
    // reserve makes process_external's checks and hands out its slots before
    // the rows exist (a GPU server computes where its capture kernel writes
    // before it launches the target's forward). The sequence then holds a
    // reservation: every call on it but confirm, cancel and end is a
    // StateError. confirm: the owner wrote the rows (the state is what
    // process_external would have left); cancel: they never came (the
    // forward was aborted), and the sequence is exactly as before reserve.
    // tokens: a chain drafter's Stager's ids (as process_external's).
    void reserve(std::int64_t seq, const std::int64_t* positions, std::size_t n, std::int64_t* slots_out,
                 const std::int32_t* tokens = nullptr);
    void reserve_many(const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                      const std::int64_t* positions, std::size_t total, std::int64_t* slots_out,
                      const std::int32_t* tokens = nullptr);
    void confirm(std::int64_t seq);
    void cancel(std::int64_t seq);
    void confirm_many(const std::int64_t* seqs, std::size_t n);
    void cancel_many(const std::int64_t* seqs, std::size_t n);

    // -- a request's end ---------------------------------------------------------
    // Ends the sequence's request in any state (an open round or a
    // reservation is dropped: the abort path) and frees its ring (begin keeps
    // it for the next request): the sequence is as a new Stager's.
    void end(std::int64_t seq);
    void end_many(const std::int64_t* seqs, std::size_t n);

    // Drafting per request: disable turns it off (every draft then skips with
    // Skip::DraftingOff, the round's rows still processed and trimmed as
    // always), enable turns it back on (the next draft plans at once: a rebase
    // when the rows outgrew the window meanwhile). Any state, handed over to
    // the device step too (its steps then skip with SKIP_DRAFTING_OFF); idempotent. The switch belongs to the request:
    // begin, end and a prefix start clear it; fork copies it; snapshots carry
    // it. The batched forms check every id first and change nothing on an
    // error.
    void disable(std::int64_t seq);
    void enable(std::int64_t seq);
    void disable_many(const std::int64_t* seqs, std::size_t n);
    void enable_many(const std::int64_t* seqs, std::size_t n);

    void rollback(std::int64_t seq, std::int64_t n_past);
    // shift and fork return the copies an owner of external rows applies, in
    // order (see SlotMove); in held mode the core has applied them itself and
    // returns them for the record. Empty when nothing moves. *serial (when
    // given) receives the moves' place in this Stager's one sequence of
    // table changes (from 1; see moves_issued), or 0 when nothing moves.
    std::vector<SlotMove> shift(std::int64_t seq, std::int64_t n_keep, std::int64_t n_discard,
                                std::uint64_t* serial = nullptr);
    std::vector<SlotMove> fork(std::int64_t src, std::int64_t dst, std::uint64_t* serial = nullptr);
    // Snapshots (format v2, layout in snapshot.cpp): the sequence's state as
    // checksummed bytes another Stager of the same configuration restores.
    // snapshot_size is the exact size snapshot_into writes; snapshot_into
    // writes into dst (cap bytes) in one pass over the rows and returns the
    // bytes written, or throws BufferTooSmall, writing nothing, when cap is
    // too small. restore reads versions 1 and 2 straight from `data` (no copy
    // first) and throws std::invalid_argument for damaged, foreign or
    // inconsistent data, leaving the sequence untouched.
    // External-row mode: a snapshot carries the bookkeeping only (content flag
    // "external rows"; the owner saves the rows at live_slots(seq) itself),
    // and restore fills runs_out (when given) with the slots where the owner
    // puts those rows back, oldest first, and *serial with their place among
    // the table changes (0 in held mode or when no row comes back). A
    // snapshot of the other mode is rejected like damaged data
    // (std::invalid_argument, nothing changed).
    std::size_t snapshot_size(std::int64_t seq) const;
    std::size_t snapshot_into(std::int64_t seq, std::uint8_t* dst, std::size_t cap) const;
    // A snapshot into memory the caller allocates: alloc(bytes, ctx) returns
    // `bytes` writable bytes (null: std::bad_alloc) and runs with no lock of
    // this Stager held, so it may take the caller's own locks (a GIL) without
    // deadlocking a thread that holds those and waits for the sequence. If
    // another thread changed the sequence's size in between, the core sizes
    // and allocates again (the retry lives here, once). Returns the bytes
    // written, all of the last allocation.
    using SnapshotAlloc = std::uint8_t* (*)(std::size_t bytes, void* ctx);
    std::size_t snapshot_alloc(std::int64_t seq, SnapshotAlloc alloc, void* ctx) const;
    std::vector<std::uint8_t> snapshot(std::int64_t seq) const;
    void restore(std::int64_t seq, const std::uint8_t* data, std::size_t nbytes, SlotRun* runs_out = nullptr,
                 std::uint64_t* serial = nullptr);
    // Every check restore makes (the sequence, the data; held mode: the rows'
    // checksum too), nothing changed: the rows the snapshot brings back
    // (end - horizon of a started sequence, else 0). An owner of external rows
    // checks the rows it was given against this before restore changes anything.
    std::int64_t check_restore(std::int64_t seq, const std::uint8_t* data, std::size_t nbytes) const;

    SeqState state(std::int64_t seq) const;
    // The slots of the stageable rows [horizon, end), oldest first, as at most
    // two runs (both modes): what an owner of external rows saves with a
    // snapshot of the sequence.
    void live_slots(std::int64_t seq, SlotRun out[2]) const;
    SeqStats stats(std::int64_t seq) const;
    // The sequence's histogram of accepted drafts per verified round since
    // its last begin (stats' verified_rounds): block_size + 1 counts, k
    // accepted drafts at [k]. A round is verified by the first accept that
    // acts (its verify rows arrived) after its commit and before the next
    // draft; the drafts that accept keeps pick the bucket (the count the
    // server passed, or fewer when fewer verify rows arrived).
    std::vector<std::int64_t> accepted(std::int64_t seq) const;
    // accepted of seqs[0..n) into out[i * (block_size + 1) + k], all read at
    // one moment (a batch's: every id checked, and none on the device,
    // before anything is written; "accepted_many: seqs[i] ...").
    void accepted_many(const std::int64_t* seqs, std::size_t n, std::int64_t* out) const;
    // The Stager's metrics (StagerTotals), read at one moment: each sequence
    // locked in turn. Sequences on the device count as of their handover
    // until to_host brings their steps back.
    StagerTotals totals() const;
    // The round open on `seq` (RoundPlan::round), or 0 when none is.
    std::uint64_t open_round_id(std::int64_t seq) const;
    // open_round_id of seqs[0..n) into out[0..n), all read at one moment (a
    // batch's: ids checked first, "open_round_ids: seqs[i] ...").
    void open_round_ids(const std::int64_t* seqs, std::size_t n, std::uint64_t* out) const;
    // Table changes numbered so far (the serial of the last one): non-empty
    // moves of fork / shift and, in external-row mode, the slots of a restore
    // that brings rows back. An owner applies them in serial order.
    std::uint64_t moves_issued() const noexcept { return serials_.load(std::memory_order_acquire); }
    // The call that issued the newest table change ("fork", "shift",
    // "restore", "publish_prefix", "start_from_prefix"; "" before the first):
    // an owner that finds a change unapplied names it.
    const char* last_change() const noexcept { return last_change_.load(std::memory_order_acquire); }
    // The serial of the newest table change that copies rows into or out of
    // the slots of any of seqs[0..n) (0: none yet; ids checked first,
    // "changes_of: seqs[i] ..."). An owner that has applied fewer changes
    // than this refuses to write or gather those sequences' rows: their
    // slots still lack rows the Stager counts on (a prefix hit's, a fork's),
    // or hold rows a publish has yet to copy out.
    std::uint64_t changes_of(const std::int64_t* seqs, std::size_t n) const;

    // -- prefix store (stager_prefix.cpp; dspark/prefix_store.hpp, docs/prefix_cache.md) --
    // Both take this Stager's mutex, then the store's (the lock order). Their
    // checks, in order: the sequence (steps 1-2 of design.md 2.1), the
    // store's configuration (ConfigError), the keys and positions, the
    // sequence's rows (publish), then the rows of blocks already held.
    //
    // Records the rows of seq's final positions [start, end) in `store` under
    // `keys`, one key per block of store.block_tokens positions (the last
    // block may be partial); only the rows a later hit can need are kept.
    // The rows must still be held: publish each block when the server hands
    // it over. External-row mode: returns the copies from this Stager's
    // table (src) to the store's table (dst), numbered among this Stager's
    // table changes (*serial, as fork's; 0 when nothing moves); held mode:
    // empty (the rows were copied).
    std::vector<SlotMove> publish_prefix(std::int64_t seq, PrefixStore& store, const KeyChain& keys,
                                         std::int64_t start, std::int64_t end, std::uint64_t* serial = nullptr);
    // Starts seq afresh (as begin() does) from a prefix-cache hit of the
    // first n_tokens positions (`keys`: the chain of their blocks): its ring
    // receives the rows the store holds, so that the first round stages what
    // a full prefill would have; the server prefills from hit.replay_from.
    // External-row mode: `moves` (required; may be null in held mode)
    // receives the copies from the store's table (src) to this Stager's
    // table (dst), numbered as publish_prefix's (*serial). `tokens` (a chain
    // drafter's Stager: required; else null): the ids of positions [0,
    // n_tokens), the prompt the keys were made of (the store keeps rows, not
    // ids); the rows the hit brings back get theirs.
    PrefixHit start_from_prefix(std::int64_t seq, PrefixStore& store, const KeyChain& keys, std::int64_t n_tokens,
                                std::vector<SlotMove>* moves, std::uint64_t* serial = nullptr,
                                const std::int32_t* tokens = nullptr);

    // The positions [lo, hi) whose rows publish_prefix can take from seq
    // now: the rows it still holds (from its horizon) that are final (below
    // what an accept may still drop). A block inside the range publishes; a
    // block reaching below lo only where the keep rule drops its rows there
    // (a block longer than K ending past W - B); one reaching past hi never.
    // {0, 0} for a sequence holding no rows. The sequence checks are
    // publish_prefix's (a ready sequence).
    std::pair<std::int64_t, std::int64_t> publishable(std::int64_t seq) const;

    // A step's publishes in one call: publish_prefix of seqs[i]'s blocks
    // [starts[i], ends[i]) under keys[i], in batch order, as a loop would.
    // Checked whole before anything changes (a rejected batch changes
    // nothing): the ids, the locks, every sequence's state, unique ids, then
    // each entry's checks against the store as the call found it
    // ("publish_many: seqs[i] (sequence s): " + publish_prefix's error;
    // a block new to the store that an earlier entry adds counts as held, so
    // a later entry of its key refreshes it: the same positions and, held
    // mode, the same rows where it still holds them), and room for the
    // batch beside the blocks it must keep. Where a loop would fail
    // part-way (an earlier entry evicting a block that a later one refreshes
    // from rows it no longer holds), the batch keeps that block and evicts
    // the next least recently used one. External rows: the copies of every
    // entry in order, one table change (*serial) of every sequence.
    std::vector<SlotMove> publish_prefix_many(const std::int64_t* seqs, std::size_t n, PrefixStore& store,
                                              const KeyChain* keys, const std::int64_t* starts,
                                              const std::int64_t* ends, std::uint64_t* serial = nullptr);
    // start_from_prefix for several sequences: seqs[i] from the hit of
    // n_tokens[i] positions under keys[i]. Every hit is checked and planned,
    // and every ring it needs allocated, before any changes (a rejected
    // batch changes nothing; "hit_many: seqs[i] ..."); then applied in batch
    // order, equal to a loop. hits[i]: seqs[i]'s hit. External rows: `moves`
    // (required) the copies of them all in order, one table change (*serial).
    // tokens: each sequence's ids (as start_from_prefix's), flat in batch order.
    void start_from_prefix_many(const std::int64_t* seqs, std::size_t n, PrefixStore& store, const KeyChain* keys,
                                const std::int64_t* n_tokens, std::vector<PrefixHit>& hits,
                                std::vector<SlotMove>* moves, std::uint64_t* serial = nullptr,
                                const std::int32_t* tokens = nullptr);

    // Where draft() takes large output buffers from; give them back with
    // pool()->give(std::move(buffer)) once the caller is done with them.
    const std::shared_ptr<BufferPool>& pool() const noexcept { return pool_; }

    // -- the device step (stager_device_step.cpp; dspark/step_math.hpp;
    // docs/protocol.md "The device step"). External-row mode only.
    //
    // to_device hands seqs[0..n) over to the step: their fields go into the
    // step state (step_state()) and every other call on them (process,
    // reserve, accept, draft, begin, fork, shift, rollback, snapshot,
    // restore, prefix hits and publishes, state(), ...; not end, which ends
    // it, nor the metrics, which read its step state, nor disable / enable,
    // which write its drafting_off column) raises
    // StateError naming to_host until they come back. Each must be started
    // and hold no tree (StateError), in any state but a held-mode one: ready,
    // a round open (the next step commits it) or rows reserved (the next
    // step confirms them). Checked whole (ids, states, uniqueness); a
    // rejected call changes nothing.
    //
    // tokens (a chain drafter's Stager: required, else must be null): the
    // slot token table, max_seqs * ring_rows() int32 (n_tokens of them)
    // indexed by global slot, the slots of the step's row_slots and
    // verify_slots. A step never moves a row, so an id stays at its row's
    // slot: to_device writes each sequence's ids at its rows' slots (the
    // reservation's `before` rows too) and -1 at the rest of its
    // ring_rows() slots (other sequences' slots are not touched); between
    // steps the server writes each verify row's id at its verify slot (the
    // verify batch's input ids: last, then the drafts) and reads the staged
    // rows' ids at their row_slots; to_host reads them back.
    void to_device(const std::int64_t* seqs, std::size_t n, std::int32_t* tokens = nullptr,
                   std::size_t n_tokens = 0);
    // Brings seqs[0..n) back: the Stager is then exactly what the
    // per-sequence calls of their steps would have made it (confirm,
    // accept, draft, commit, reserve each step), with the round the last
    // step opened resolved by outcomes[i]: -1 (or a null `outcomes`): the
    // drafter ran, commit; a FailStage code: it failed, fail(stage)
    // (disabled_after[i]: fail's answer; 0 otherwise). A sequence comes
    // back in the ready or reserved state, never with an open round.
    // Checks (nothing changes when one fails): ids, each on the device
    // (StateError), uniqueness, the outcomes (a failure needs an open
    // round), then the step state's consistency (std::invalid_argument:
    // damaged). Then, with every sequence back, a fault a step recorded
    // (a bad accept count, ...) is raised as the core's own error, naming
    // the sequence: its step changed nothing, the sequence is back.
    // tokens (a chain drafter's Stager: required, else null): the slot token
    // table (as to_device's), read at the slots of each sequence's rows
    // (those of the reservation's `before` too) after the step state's
    // checks; an id < 0 there (a verify row whose id the server never
    // wrote: to_device leaves -1) is std::invalid_argument naming the row,
    // and nothing is brought back.
    void to_host(const std::int64_t* seqs, std::size_t n, const std::int32_t* outcomes = nullptr,
                 std::int64_t* disabled_after = nullptr, const std::int32_t* tokens = nullptr,
                 std::size_t n_tokens = 0);
    // The CPU twin of the device step: one step of entries
    // (seqs[i], n_accepted[i]) over the host step state, answers in `out`
    // (device_step::Outputs; out.status is required). A per-entry problem is a
    // status word, never an exception; std::invalid_argument only for a
    // held-mode Stager or a null out.status (nothing changes).
    void step_many(const std::int64_t* seqs, const std::int64_t* n_accepted, std::size_t n,
                   const device_step::Outputs& out);
    // Raises the error of the first entry whose status (as step_many wrote
    // it) is an error, named "step_many: seqs[i] (sequence s): ..."; returns
    // when none is.
    void check_step(const std::int64_t* seqs, const std::int32_t* statuses, std::size_t n) const;
    // The CSR rows of the batch step_many just stepped (the unpadded layout's
    // gather; device_step::rows_after_step): seqs / n and `out` as that step's
    // (out.status, skip, start, n_rows and pos_base required), into `rows`
    // for `capacity` entries (at least n; the entries past n are padding, 0
    // rows): row_offsets[0 .. capacity] (required), and entry i's slots and
    // drafter positions at [row_offsets[i], row_offsets[i + 1]) of row_slots /
    // row_positions (capacity * max_rows elements each; null: not written;
    // the elements past row_offsets[capacity] are left as they were). An
    // entry whose plan its ring does not hold has 0 rows.
    // std::invalid_argument for a held-mode Stager or capacity < n, NullPointer
    // for a null required pointer (nothing written).
    void step_rows(const std::int64_t* seqs, std::size_t n, const device_step::Outputs& out, std::size_t capacity,
                   const device_step::CsrRows& rows);
    // The constants the step's math needs (device_step::Config).
    device_step::Config step_config() const noexcept;
    // The host step state: device_step::columns() * max_seqs int64, field-major
    // (column f of sequence s at [f * max_seqs + s]: the fields, then the
    // acceptance histogram's block_size + 1 buckets). A device owner copies
    // the columns of handed-over sequences to its device copy after
    // to_device and back before to_host.
    std::int64_t* step_state();
    // Whether seq is handed over (to_device .. to_host).
    bool on_device(std::int64_t seq) const;

private:
    struct SnapshotFields;  // snapshot.cpp
    // A snapshot's header read and checked against this Stager (std::invalid_argument).
    SnapshotFields read_snapshot(const std::uint8_t* data, std::size_t nbytes) const;
    // A sequence's fields (what a cancelled reservation puts back).
    struct SeqFields {
        bool started = false;
        std::int64_t end = 0;       // next expected position
        std::int64_t horizon = 0;   // oldest stageable position
        std::int64_t n_cache = 0;   // drafter cache holds [pos_base, n_cache)
        std::int64_t pos_base = 0;
        bool restage_owed = false;
        bool first_round = true;
        bool disabled = false;
        std::int64_t failures = 0;
        bool accept_open = false;   // rows since the last draft may be dropped by accept
        std::int64_t tentative = 0;
        bool open = false;
        std::uint64_t round = 0;    // the open round's id
        std::int64_t open_start = 0, open_base = 0;
        // A protocol mismatch was reported since begin() (report it once);
        // kept by fork (of the child), shift and restore, as by the slot.
        bool mismatch_reported = false;
        // A committed round whose verify count has not arrived: the next
        // accept that acts counts in the histogram (Stager::accepted); the
        // next draft (skipped or not) ends it. Invariant: it counts only
        // while accept_open; whatever closes that (rollback, shift, too many
        // rows) needs no clear of its own, since only open_round reopens it,
        // and every draft clears this.
        bool verify_owed = false;
        SeqStats stats;
    };
    // One per cache line: threads working on different sequences never
    // write to a line another sequence's fields share.
    struct alignas(64) Seq : SeqFields {
        FeatureBuffer buf;
        // A reservation (reserve .. confirm / cancel), and the fields and the
        // ring's bookkeeping before it (cancel puts them back; an external
        // ring holds no bytes, so its marks are the whole ring).
        bool reserved = false;
        SeqFields before;
        FeatureBuffer::Marks before_marks;
        // A chain drafter's ids by slot before a reservation that took slots
        // of rows cancel puts back (one longer than the ring's free slots: a
        // long prefill chunk); empty when it took none.
        std::vector<std::int32_t> before_tokens;
        // Handed over to the device step: its fields live in the step state.
        bool on_device = false;
        // The last step state of it read whole (at to_device, and whenever its
        // metrics are read): what its metrics fall back to if a server damages
        // the state, so they never go back. Under the sequence's lock.
        mutable device_step::Regs last_whole{};
        mutable std::vector<std::int64_t> last_whole_hist;
        // The request's drafting switch (disable / enable): outside SeqFields,
        // so a cancelled reservation does not undo a switch made after it.
        bool drafting_off = false;
        // An open tree verify batch (process_tree .. accept_path): its nodes'
        // parents, empty when there is none. Invariant: non-empty only while
        // accept_open and tentative == tree.size() (its rows are the
        // tentative ones, the root at end - tentative); every call that
        // could change those needs Ready, which refuses an open tree.
        std::vector<std::int64_t> tree;
    };
    // Each sequence's mutex, on a line of its own.
    struct alignas(64) SeqMutex {
        std::mutex m;
    };
    class BatchLock;     // the locks of a batch's sequences (stager_batch.hpp)
    class CheckedBatch;  // a batch's sequences, checked and locked (stager_batch.hpp)
    struct PrefixOps;  // the prefix store's changes of a sequence (stager_prefix.cpp)
    struct Append;    // one sequence's rows, checked and not yet committed

    // -- locks: a call locks before its state checks; ids are checked first
    // (unknown ids lock nothing). The lock of one sequence, and of two in id
    // order (one when they are the same).
    std::unique_lock<std::mutex> lock_seq(std::int64_t seq) const;
    std::pair<std::unique_lock<std::mutex>, std::unique_lock<std::mutex>> lock_pair(std::int64_t a,
                                                                                     std::int64_t b) const;

    // -- validation (design.md 2.1): each call's checks in order, no side effects.
    const Seq& get(std::int64_t seq) const;
    // The state check of step 2 (call under the sequence's lock).
    const Seq& needs(std::int64_t seq, Need need) const;
    const Seq& ready(std::int64_t seq) const { return needs(seq, Need::Ready); }
    const Seq& opened(std::int64_t seq) const { return needs(seq, Need::Open); }
    // A batch's steps 1 (every id: call before locking) and 2 (every state).
    void check_ids(const char* call, const std::int64_t* seqs, std::size_t n) const;
    void check_states(const char* call, const std::int64_t* seqs, std::size_t n, Need need) const;
    // A batch's uniqueness (step 4, first), and its offsets (n + 1 from 0 to total).
    void check_unique(const char* call, const BatchLock& lock, const std::int64_t* seqs, std::size_t n) const;
    static void check_offsets(const char* call, const std::int64_t* offsets, std::size_t n, std::size_t total);
    // A checked sequence, to change (the checks above took it const).
    Seq& mut(const Seq& s) noexcept { return const_cast<Seq&>(s); }
    // Throws std::invalid_argument unless the Stager runs in `mode`; `instead`
    // (default: the other mode's process call) says what to do instead.
    void require_mode(RowMode mode, const char* call, const char* instead = nullptr) const;
    std::int64_t validate_positions(std::int64_t seq_id, const Seq& s, const std::int64_t* positions,
                                    std::size_t n) const;
    // draft's checks and plan: n_past's range, the plan, strict mode.
    RoundPlan check_draft(std::int64_t seq, const Seq& s, std::int64_t n_past) const;
    // A draft batch's checks after its ids (the batch's locks held), and its
    // plans; `views`: held mode is required (draft_many_view).
    std::vector<RoundPlan> plan_batch(const char* call, const BatchLock& lock, const std::int64_t* seqs,
                                      const std::int64_t* n_pasts, std::size_t n, bool views) const;
    // The rows a checked, unskipped plan stages, where they lie in the ring.
    RowView view_of(const Seq& s, const RoundPlan& p) const;
    void check_accept(std::int64_t n_accepted) const;
    // process_tree's checks after the sequence's state (stager_tree.cpp):
    // the sequence takes a tree now, the parents, n_past. Returns the rows'
    // positions as process sees them (n_past .. n_past + n - 1: one ring
    // slot per node).
    std::vector<std::int64_t> check_tree(std::int64_t seq_id, const Seq& s, std::int64_t n_past,
                                         const std::int64_t* parents, std::size_t n) const;
    // process_tree_many and its external form up to the rows: the batch's
    // checks in their order, each sequence's tree (its positions' first in p0).
    std::vector<std::vector<std::int64_t>> check_tree_many(const char* call, const std::vector<std::int64_t>& seqs,
                                                           const std::vector<std::int64_t>& cu,
                                                           const std::int64_t* n_pasts, const std::int64_t* parents,
                                                           std::size_t total, std::vector<std::int64_t>& p0) const;
    // process_tree_many and its external form: the batch locked and checked
    // (the mode's too), then append(seqs, offsets, p0, ids) adds the rows (the
    // positions of seqs[i]'s nodes start at p0[i]; ids: the checked token
    // ids, flat, or null), then each tree is kept.
    using TreeAppend = std::function<void(const std::vector<std::int64_t>& seqs, const std::vector<std::int64_t>& cu,
                                          const std::vector<std::int64_t>& p0, const std::int32_t* tokens)>;
    void tree_batch(const char* call, RowMode mode, const char* instead, const std::int64_t* seqs, std::size_t n,
                    const std::int64_t* offsets, const std::int64_t* n_pasts, const std::int64_t* parents,
                    std::size_t total, const std::int32_t* tokens, const TreeAppend& append);
    // accept_path's checks of a path against the sequence's tree.
    void check_path(const Seq& s, const std::int64_t* nodes, std::size_t n) const;
    // accept_path on a checked sequence: compacts the path, appends the copies.
    void accept_path_seq(std::int64_t seq_id, Seq& s, const std::int64_t* nodes, std::size_t n,
                         std::vector<SlotMove>& moves);
    // process's append of checked rows (process, process_tree).
    void append_held(std::int64_t seq, Seq& s, std::int64_t p0, std::size_t n, const void* rows, ElemType type,
                     const std::int32_t* tokens = nullptr);
    // process_many's appends of checked rows (the batch locked, its positions checked: the
    // rows of seqs[i] start at p0[i]): every sequence's rows checked, then all appended.
    void append_held_many(const char* call, const std::vector<std::int64_t>& seqs, const std::vector<std::int64_t>& cu,
                          const std::vector<std::int64_t>& p0, std::size_t total, const void* rows, ElemType type,
                          const std::int32_t* tokens = nullptr);
    // The token ids of n rows, checked (`call` names the batch, or null):
    // present, and each >= 0, exactly when this Stager keeps tokens
    // (std::invalid_argument). A private copy, checked after it was taken,
    // so ids the caller's buffer changes meanwhile are never kept unchecked
    // (data(): null when none were given).
    struct TokenIds {
        std::vector<std::int32_t> ids;
        bool given = false;
        const std::int32_t* data() const noexcept { return given ? ids.data() : nullptr; }
    };
    TokenIds check_tokens(const char* call, const std::int32_t* tokens, std::size_t n) const;
    // confirm's check of a chain drafter's reservation: every reserved row
    // has its id (std::invalid_argument: one that came back from the device
    // step unwritten, which only cancel takes back).
    void check_confirmable(std::int64_t seq, const Seq& s) const;
    // The device step's slot token table (to_device / to_host): present, and
    // max_seqs * ring_rows() long, exactly when this Stager keeps tokens
    // (std::invalid_argument naming `call`).
    void check_token_table(const char* call, const void* tokens, std::size_t n_tokens) const;
    void check_shift(const Seq& s, std::int64_t n_keep, std::int64_t n_discard) const;
    // publish_prefix's checks after the sequence's (stager_prefix.cpp, under
    // the store's mutex): the store, its plan of the publish, the sequence's
    // rows, the rows of blocks already held. `batch` (publish_prefix_many):
    // the blocks new to the store that earlier entries add, which this entry
    // finds held, as in a loop. Returns the plan (against the store as found).
    std::vector<PrefixPlannedBlock> check_publish_prefix(std::int64_t seq, const Seq& s, const PrefixStore& store,
                                                         const KeyChain& keys, std::int64_t start, std::int64_t end,
                                                         const PrefixBatchBlocks* batch = nullptr) const;

    std::int64_t firm_end(const SeqFields& s) const noexcept;
    std::int64_t horizon_after(const SeqFields& s) const noexcept;
    void advance_horizon(Seq& s) noexcept;
    // Drop head rows below new_head (all below the horizon), counting a trim.
    static void trim_head(Seq& s, std::int64_t new_head) noexcept;
    static void note_size(Seq& s) noexcept;
    void fresh_seq(Seq& s) const;
    // Folds the counters of a sequence of this Stager into the totals of the
    // ended ones and zeroes its histogram: before anything resets its stats
    // (begin, end, fork into it, restore, a prefix start).
    void retire_stats(const Seq& s) const;
    // The sequence's histogram row in accepted_ (block_size + 1 counts).
    std::int64_t* accepted_row(const Seq& s) const noexcept;
    // stats with the fields filled on read (live_rows and the histogram's);
    // `settled`: as before an open reservation (what totals count: a
    // reservation's trims and peaks become theirs when it is confirmed, and
    // a cancel takes back nothing they counted, so they never go back).
    // A handed-over sequence's are read from the step state (stats_on_device).
    SeqStats stats_of(const Seq& s, bool settled = false) const;
    SeqStats stats_of_fields(const SeqFields& f, const std::int64_t* histogram) const;
    // A handed-over sequence's stats and histogram (block_size + 1 counts into
    // `histogram`) from the step state, as its steps made them (as a to_host
    // would bring them back, the open round not committed), or as it was
    // handed over where its state is damaged (stager_device_step.cpp).
    SeqStats stats_on_device(const Seq& s, bool settled, std::int64_t* histogram) const;
    // A handed-over sequence's step fields and histogram as they may be
    // trusted: the step state's when whole (remembered in last_whole), else
    // the last whole ones seen.
    device_step::Regs trusted_regs(const Seq& s, std::int64_t* histogram) const;
    void histogram_of(const Seq& s, std::int64_t* out) const;
    // The next serial of a table change (call under the lock of every
    // sequence the change touches, so that serial order is execution order).
    // `call`: the change's call (a string literal), for last_change();
    // `seq` (and `other`, unless -1): the sequences whose slots the change
    // copies into or out of (a fork: both), for changes_of().
    std::uint64_t next_serial(const char* call, std::int64_t seq, std::int64_t other = -1) noexcept {
        const std::int64_t seqs[2] = {seq, other};
        return next_serial(call, seqs, other >= 0 ? 2 : 1);
    }
    // The same for a batch's change: every sequence of seqs[0..n).
    std::uint64_t next_serial(const char* call, const std::int64_t* seqs, std::size_t n) noexcept {
        last_change_.store(call, std::memory_order_release);
        const std::uint64_t k = serials_.fetch_add(1, std::memory_order_acq_rel) + 1;
        for (std::size_t i = 0; i < n; ++i) changed_[static_cast<std::size_t>(seqs[i])].store(k, std::memory_order_release);
        return k;
    }

    // An append in two halves, so a batch checks every sequence's rows
    // before any changes: prepare_append makes the checks (and, when the rows
    // fit in free slots, converts them there: a rejection leaves every row
    // as it was); commit_append makes them the sequence's rows.
    template <class Encode, class Value>
    Append prepare_append(std::int64_t seq_id, Seq& s, std::int64_t p0, std::size_t n, Encode&& encode,
                          Value&& value, bool fallible);
    template <class Encode>
    void commit_append(std::int64_t seq_id, Seq& s, Append& g, Encode&& encode, std::int64_t* slots_out);
    // Where an append reads its input bytes [rows, rows + nbytes): there,
    // or a private copy (into `copy`) when they lie in the ring of one of
    // the call's sequences (a draft(copy=False) view handed back, even a
    // stale one), since commit_append may trim those very slots and convert
    // into them after the checks have passed. Call after the checks.
    const std::uint8_t* unaliased_input(const void* rows, std::size_t nbytes, const std::int64_t* seqs, std::size_t n,
                                        std::vector<std::uint8_t>& copy) const;
    // process_external, reserve and their batches: check every sequence's
    // positions, then append them all (reserve: remembering each state first).
    void append_external(const char* call, const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                         const std::int64_t* positions, std::size_t total, std::int64_t* slots_out, bool reserve,
                         const std::int32_t* tokens);
    // process_external and reserve: the sequence's lock and check, then append_external.
    void external_one(std::int64_t seq, const std::int64_t* positions, std::size_t n, std::int64_t* slots_out,
                      bool reserve, const std::int32_t* tokens);
    // process_external_many and reserve_many: the batch's checks and locks, then append_external.
    void external_many(const char* call, const std::int64_t* seqs, std::size_t n, const std::int64_t* offsets,
                       const std::int64_t* positions, std::size_t total, std::int64_t* slots_out, bool reserve,
                       const std::int32_t* tokens);
    // One sequence's whole state as begin() leaves it (its ring kept), or as
    // a new Stager's (ring freed: end); returns the ring to free outside the lock.
    FeatureBuffer end_seq(Seq& s) const;
    // The changes of commit / fail / accept / confirm / cancel on a checked sequence.
    void commit_seq(Seq& s) noexcept;
    std::int64_t fail_seq(Seq& s) noexcept;
    void accept_seq(Seq& s, std::int64_t n_accepted) noexcept;
    // The verify's end (accept, accept_path): the first `keep` (>= 1) of the
    // tentative rows stay, the rest go; the round's verify is counted.
    void keep_tentative(Seq& s, std::int64_t keep) noexcept;
    static void end_reservation(Seq& s, bool keep) noexcept;
    std::string unstageable_message(std::int64_t seq, std::int64_t p0, std::int64_t flat, float value) const;
    std::int64_t slot_base(std::int64_t seq) const noexcept { return seq * static_cast<std::int64_t>(ring_rows_); }
    FeatureBuffer new_ring() const { return FeatureBuffer(row_bytes_, external(), opt_.kind == DrafterKind::Chain); }
    RoundPlan plan_round(std::int64_t seq_id, const Seq& s, std::int64_t start) const;
    void open_round(Seq& s, RoundPlan& p, std::uint8_t* out) noexcept;
    std::uint8_t* grow_rows(ByteVec& rows_out, const RoundPlan* plans, std::size_t n) const;
    FeatureBuffer ring_for(FeatureBuffer& reuse, std::int64_t pos, std::size_t n) const;
    // With `crc`, the rows are also checksummed (CRC-32C chained from *crc) in the same pass.
    void append_rows(FeatureBuffer& ring, const std::uint8_t* rows, std::size_t n,
                     std::uint32_t* crc = nullptr) const;
    std::size_t snapshot_bytes(const Seq& s) const noexcept;
    void write_snapshot(const Seq& s, std::uint8_t* dst) const noexcept;

    StagerOptions opt_;
    std::int64_t w_keep_;
    std::size_t row_bytes_;
    EncodeBounds bounds_;  // what process() accepts: encode_bounds(storage, stage)
    std::size_t ring_rows_;  // dspark::ring_rows(B, W)
    std::vector<Seq> seqs_;
    // accepted_[s * (block_size + 1) + k]: sequence s's verified rounds with
    // k accepted drafts (Stager::accepted). Beside the sequences, not in
    // them: a Seq's fields are copied whole (a reservation's `before`), and
    // this row is guarded by the sequence's lock as its fields are.
    mutable std::vector<std::int64_t> accepted_;
    // The counters and histogram of the sequences whose stats were reset
    // (retire_stats), so totals() stay monotonic. Its mutex is taken after
    // sequence locks (totals() holds all of them while reading).
    struct Retired {
        std::mutex m;
        SeqStats stats;
        std::vector<std::int64_t> accepted;
    };
    mutable Retired retired_;
    // Held mode: the ring a restore over a busy slot checksums and copies the
    // snapshot's rows into before swapping it in (snapshot.cpp); the replaced
    // ring becomes the spare. Empty until the first such restore.
    FeatureBuffer spare_;
    std::mutex spare_mu_;  // guards spare_; taken after a sequence's lock
    std::shared_ptr<BufferPool> pool_ = std::make_shared<BufferPool>();
    // Stager-wide counters, taken while the touched sequences are locked:
    // rounds opened (RoundPlan::round) and table changes (serials).
    std::atomic<std::uint64_t> rounds_{0};
    std::atomic<std::uint64_t> serials_{0};
    std::atomic<const char*> last_change_{""};
    // changed_[s]: the serial of the newest table change into or out of
    // sequence s's slots. Beside the sequences, not in them: a Seq is replaced whole by
    // restore / fork / a prefix hit, and this must outlive that (and begin).
    std::unique_ptr<std::atomic<std::uint64_t>[]> changed_;
    std::unique_ptr<SeqMutex[]> locks_;  // locks_[s] guards seqs_[s]
    // The device step's host state (step_state()), allocated on first use;
    // a sequence's columns are guarded by its lock.
    std::once_flag step_once_;
    std::unique_ptr<std::int64_t[]> step_state_;
    // A Seq's fields to and from the step state (stager_device_step.cpp).
    friend struct StepIO;
    // StateError for a sequence handed over to the device step (call under its lock).
    void refuse_on_device(std::int64_t seq, const Seq& s) const;
    // end / end_many of a handed-over sequence: it leaves the step state
    // (stager_device_step.cpp), its counters with it.
    void leave_step(std::int64_t seq, Seq& s) noexcept;
    void switch_drafting(std::int64_t seq, Seq& s, bool off) noexcept;
    // disable_many / enable_many: every id checked (and not on the device) before any switch changes.
    void set_drafting(const char* call, const std::int64_t* seqs, std::size_t n, bool off);
};

// A batch of plans as flat arrays (docs/design.md 2.9; batch_layout.cpp).
// plan_rows: CSR, the context rows of plans[i] are rows [row_offsets[i],
// row_offsets[i + 1]) of `positions` (drafter positions) and `slots` (global
// slots); row_offsets has n + 1 entries, the other two sum(n_rows). Any
// output array may be null (not written).
void plan_rows(const RoundPlan* plans, std::size_t n, std::int64_t* row_offsets, std::int32_t* positions,
               std::int64_t* slots) noexcept;
// The per-sequence columns of a batch plan (the Python BatchPlan's arrays),
// one list each so the binding and BatchPlan name rows through it: int64 rows
// of `meta` (n + 1 columns; the last row, row_offsets, fills all of them, the
// others their first n) and uint8 rows of `flags` (n columns). X(column, field).
#define DSPARK_BATCH_META_ROWS(X) \
    X(seqs, seq)                  \
    X(start, start)               \
    X(pos_base, pos_base)         \
    X(crop_from, crop_from)       \
    X(round, round)
#define DSPARK_BATCH_FLAG_ROWS(X) \
    X(skip_code, skip)            \
    X(rebase, rebase)             \
    X(clear_cache, clear_cache)
// The row names, in order, null-terminated; BATCH_META_ROWS ends with
// "row_offsets" (plan_rows' offsets, the last row of meta).
extern const char* const BATCH_META_ROWS[];
// The names of DSPARK_ROUND_PLAN_FIELDS, in order, null-terminated: a binding
// checks that its plan type carries each of them.
extern const char* const ROUND_PLAN_FIELDS[];
extern const char* const BATCH_FLAG_ROWS[];
// plans as a batch: meta int64 [meta rows][n + 1], flags uint8 [flag rows][n],
// and plan_rows' positions and slots (the plans' n_rows summed).
void pack_plans(const RoundPlan* plans, std::size_t n, std::int64_t* meta, std::uint8_t* flags,
                std::int32_t* positions, std::int64_t* slots) noexcept;
// The padded layout from CSR rows: rows [row_offsets[i], row_offsets[i + 1])
// of `values` (`total` entries) into row i of the [n, max_rows] array `out`,
// the rest -1 (seqs: the batch's ids, for the std::invalid_argument naming a
// sequence with more than max_rows rows). row_offsets must rise from 0 to
// total (std::invalid_argument).
void pad_rows(const std::int64_t* seqs, std::size_t n, const std::int64_t* row_offsets, const std::int32_t* values,
              std::size_t total, std::size_t max_rows, std::int32_t* out);
void pad_rows(const std::int64_t* seqs, std::size_t n, const std::int64_t* row_offsets, const std::int64_t* values,
              std::size_t total, std::size_t max_rows, std::int64_t* out);

// The paged layout (a paged KV cache, as vLLM's and SGLang's): a windowed
// drafter's KV for drafter position p of plan i lives in the request's own
// blocks from its window's start, slot_base + p with slot_base = pos_base[i]
// rounded down to a KV block of `block_tokens` positions. Plan i's block
// table (block_tables + i * table_stride, m entries) shifted left by
// pos_base[i] / block_tokens goes to shifted_out[i * m .. i * m + m), the
// columns past the table reading `null_block` (a skipped plan, pos_base < 0:
// every column); the context row r of the CSR rows [row_offsets[i],
// row_offsets[i + 1]) at drafter position p = positions[r] gets the KV slot
// slots_out[r] = shifted[i][p / block_tokens] * block_tokens + p % block_tokens.
// std::invalid_argument, nothing written: block_tokens < 1, row_offsets not
// rising from 0 to `total`, a skipped plan with rows, or a row whose position
// is negative or whose block lies past the m columns ("paged: seqs[i] ...";
// seqs: the batch's ids, for that message). Either output may be null (not written).
void paged_rows(const std::int64_t* seqs, std::size_t n, const std::int64_t* pos_base, const std::int64_t* row_offsets,
                const std::int32_t* positions, std::size_t total, const std::int32_t* block_tables, std::size_t m,
                std::size_t table_stride, std::int64_t block_tokens, std::int32_t null_block, std::int32_t* shifted_out,
                std::int64_t* slots_out);

// "<call>: seqs[i] (sequence s): ": what a batch call's error about one of
// its sequences starts with (the per-sequence call's error follows).
std::string batch_context(const char* call, std::size_t i, std::int64_t seq);

// Why draft at n_past found rows ending at `end` (newest row end - 1), in words
// a server engineer can act on: the cause part of strict mode's StateError
// and of the protocol-mismatch warning.
std::string mismatch_cause(std::int64_t n_past, std::int64_t end);

// "disabled", "empty", "no_context", "missing_rows"; "" for Skip::None and for
// a value past the last reason (the binding enumerates the reasons with it).
const char* skip_name(Skip s) noexcept;
// "decode", "crop"; nullptr for a value past the last stage.
const char* fail_stage_name(FailStage s) noexcept;
inline constexpr int FAIL_STAGE_COUNT = 2;

}  // namespace dspark
