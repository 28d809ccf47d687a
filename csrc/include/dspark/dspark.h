/* dspark.h: the C ABI of the dspark_core staging core.
 *
 * A plain C (C99) interface over the C++ Stager and row formats, for servers
 * that are not Python: C, C++ built with another compiler or standard
 * library, Go through cgo, Rust through FFI. docs/c_api.md documents every
 * call and the ownership of every buffer; the rules in short:
 *
 *  - Every call returns a dspark_status (0 = DSPARK_OK). No C++ exception
 *    crosses this interface. On failure the calling thread's message is
 *    dspark_last_error(); a rejected call changes nothing.
 *  - The library never keeps a pointer the caller passed in, and never frees
 *    one. Buffers the caller passes are read or written during the call only.
 *  - A dspark_stager is safe to use from several threads at once, except
 *    dspark_stager_destroy, which must be the last call. Each sequence has
 *    its own lock: calls on different sequences run in parallel.
 *  - Batch calls (*_many) take the sequences as an id array (each id once)
 *    and, where rows come with them, the rows of all sequences as one flat
 *    array with offsets (cu_seqlens style: n + 1 entries rising from 0 to
 *    `total`; the rows of seqs[i] are [offsets[i], offsets[i + 1])). Each is
 *    one call of the core, checked whole first: a rejected batch changes
 *    nothing, and an error about one sequence is its per-sequence call's
 *    message prefixed with the call and the sequence, e.g.
 *    "commit_many: seqs[2] (sequence 7): ".
 *  - Integers that name a choice (storage, dtype, ...) are int32_t codes,
 *    never C enums, so their size is fixed across compilers and languages.
 */
#ifndef DSPARK_DSPARK_H
#define DSPARK_DSPARK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(_WIN32)
#define DSPARK_API
#else
#define DSPARK_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Raised when a struct or a call's meaning changes incompatibly (new fields
 * appended to a struct with a struct_size do not change it). */
#define DSPARK_ABI_VERSION 1

/* ---- status codes ------------------------------------------------------ */
typedef int32_t dspark_status;
enum {
    DSPARK_OK = 0,
    DSPARK_E_INVALID_ARGUMENT = 1, /* a bad value: position, count, range, non-finite row (Python ValueError) */
    DSPARK_E_CONFIG = 2,           /* an unusable configuration (Python ConfigError) */
    DSPARK_E_STATE = 3,            /* wrong protocol state, e.g. an open round (Python StateError) */
    DSPARK_E_TYPE = 4,             /* an unknown dtype / storage code where a kind is chosen (Python TypeError) */
    DSPARK_E_NULL_POINTER = 5,     /* a required pointer was NULL */
    DSPARK_E_BUFFER_TOO_SMALL = 6, /* an output buffer is too small; the needed size is reported */
    DSPARK_E_OUT_OF_MEMORY = 7,    /* an allocation failed (Python MemoryError) */
    DSPARK_E_UNSUPPORTED = 8,      /* valid, but not supported by this build / version */
    DSPARK_E_INTERNAL = 9          /* a broken invariant inside the library (a bug: please report) */
};

/* ---- codes --------------------------------------------------------------- */
/* Storage formats of the feature buffer (GGML layouts for q8_0 / q4_0). */
enum {
    DSPARK_STORAGE_F32 = 0,
    DSPARK_STORAGE_F16 = 1,
    DSPARK_STORAGE_BF16 = 2,
    DSPARK_STORAGE_Q8_0 = 3,
    DSPARK_STORAGE_Q4_0 = 4
};
/* Element types of plain float rows (input rows, decoded output rows), and
 * DSPARK_DTYPE_STORAGE: "the stager's storage bytes as they are" (draft). */
enum {
    DSPARK_DTYPE_STORAGE = -1,
    DSPARK_DTYPE_F32 = 0,
    DSPARK_DTYPE_F16 = 1,
    DSPARK_DTYPE_BF16 = 2
};
/* What encoding does with values it cannot encode as finite values: NaN,
 * +-Inf, and finite values whose encoding overflows (f16 >= 65520, a q block
 * whose scale overflows, ...; docs/c_api.md). */
enum {
    DSPARK_NONFINITE_ERROR = 0,     /* process: reject the call; encode_rows: convert, report the first one */
    DSPARK_NONFINITE_ZERO = 1,      /* unencodable -> 0 */
    DSPARK_NONFINITE_CLAMP_F16 = 2, /* NaN -> 0, clamp to [-65504, 65504] (and to the format's range) */
    DSPARK_NONFINITE_CLAMP = 3      /* NaN -> 0, clamp to the largest magnitude the format encodes */
};
/* Which drafter step failed (dspark_fail). */
enum { DSPARK_FAIL_DECODE = 0, DSPARK_FAIL_CROP = 1 };
/* Why a draft staged nothing (dspark_plan.skip). */
enum {
    DSPARK_SKIP_NONE = 0, /* not skipped: the plan opened a round */
    DSPARK_SKIP_DISABLED = 1,
    DSPARK_SKIP_EMPTY = 2,
    DSPARK_SKIP_NO_CONTEXT = 3,
    DSPARK_SKIP_MISSING_ROWS = 4,
    DSPARK_SKIP_DRAFTING_OFF = 5 /* the request's drafting is turned off (dspark_disable) */
};
/* Who holds the staged rows. HELD: the stager holds them, process takes the
 * rows and draft copies them into a caller buffer. EXTERNAL: the caller owns
 * a table of max_seqs * ring_rows rows (dspark_ring_rows) and the stager
 * holds no row bytes: dspark_process_external hands out the slot of each row,
 * plans name the slots of their rows (dspark_plan.slot_first / slot_count),
 * and fork / shift report the copies to apply (dspark_last_moves).
 * docs/external_rows.md has the owner's duties. */
enum { DSPARK_ROWS_HELD = 0, DSPARK_ROWS_EXTERNAL = 1 };
/* The drafter the rows serve. BLOCK (DSpark / DFlash): a round stages context
 * rows and a block of queries. CHAIN (EAGLE-3, EAGLE, MTP): the drafter pairs
 * each row with the id of the token after it; the stager keeps, beside each
 * row, the id of the token the target read at its position (the *_tokens
 * process calls take them; a CHAIN stager refuses the plain ones) and hands
 * them back with dspark_tokens (a prefix hit takes the prompt's ids:
 * dspark_prefix_hit_tokens; a tree verify batch, dspark_process_tree_tokens;
 * a reservation, dspark_reserve_tokens). The device step serves both: a
 * CHAIN stager's ids travel in a slot token table (dspark_to_device_tokens,
 * dspark_to_host_tokens). */
enum { DSPARK_KIND_BLOCK = 0, DSPARK_KIND_CHAIN = 1 };

/* ---- structs ------------------------------------------------------------- */
/* A Stager's configuration. Initialise with dspark_config_init (which sets
 * struct_size and the defaults), then set the fields. Later versions append
 * fields; the library reads only the first struct_size bytes and gives any
 * field past them its default, so old callers keep working. */
typedef struct dspark_config {
    uint32_t struct_size;  /* sizeof(dspark_config) as the caller compiled it */
    int32_t storage;       /* DSPARK_STORAGE_*; default F32 */
    int64_t feature_dim;   /* D, elements of a row; q formats need D % 32 == 0 */
    int64_t block_size;    /* B, drafter block size */
    int64_t window;        /* W, drafter positions [0, W); W > 2 * B */
    int64_t max_seqs;      /* sequence ids 0 .. max_seqs - 1; default 1, at most 65536 */
    int64_t max_failures;  /* consecutive failures that disable a sequence; default 3 */
    int32_t nonfinite;     /* DSPARK_NONFINITE_*; default ERROR */
    int32_t stage_dtype;   /* DSPARK_DTYPE_F32/F16/BF16 the drafter takes rows in: under ERROR, process
                              rejects rows that would not stay finite in it; default F32 */
    int32_t strict;        /* 1: a draft whose n_past does not match the buffered rows (it would skip
                              with MISSING_ROWS) fails with DSPARK_E_STATE instead; default 0 */
    int32_t rows_mode;     /* DSPARK_ROWS_HELD (default) or DSPARK_ROWS_EXTERNAL */
    int32_t kind;          /* DSPARK_KIND_BLOCK (default) or DSPARK_KIND_CHAIN */
} dspark_config;

/* One sequence's round as planned by dspark_draft. Context rows are the
 * absolute positions [first_row, start), staged at drafter positions
 * [first_row - pos_base, start - pos_base); the block follows at
 * [crop_from, crop_from + block_size), crop_from == start - pos_base. */
typedef struct dspark_plan {
    int64_t seq;
    int64_t start;
    int64_t pos_base;    /* -1 when skipped */
    int64_t first_row;
    int64_t n_rows;      /* context rows staged (0 when skipped) */
    int64_t crop_from;   /* -1 when skipped */
    int32_t skip;        /* DSPARK_SKIP_*; NONE means a round is now open */
    int32_t rebase;      /* 1: the drafter cache is restaged from position 0 */
    int32_t clear_cache; /* 1: clear the drafter cache before staging */
    int32_t rows_mode;   /* HELD: rows went into the caller's buffer; EXTERNAL: they are at the slots */
    /* The global slots of the n_rows context rows, in plan order (both
     * modes): run k is slots [slot_first[k], slot_first[k] + slot_count[k]);
     * run 1 (count 0 when unused) follows run 0 when the ring wraps. Zero
     * counts when skipped. */
    int64_t slot_first[2];
    int64_t slot_count[2];
    /* The round the plan opened (0 when skipped): an owner of external rows
     * reads the slots only while dspark_open_round_ids still gives this id
     * for seq (a later round may reuse them). Took the place of a reserved
     * field: the struct's size and layout are unchanged. */
    uint64_t round;
    int64_t reserved[1]; /* zero */
} dspark_plan;

/* A copy the owner of external rows applies: table rows [src, src + count)
 * to [dst, dst + count). Apply in the order given; the two ranges of one move
 * never overlap, and no move overwrites a row a later one reads. */
typedef struct dspark_slot_move {
    int64_t src;
    int64_t dst;
    int64_t count;
} dspark_slot_move;

/* Protocol state of one sequence (Python: Stager.state()). Set struct_size
 * (dspark_state_init); the library fills at most struct_size bytes. */
typedef struct dspark_state {
    uint32_t struct_size;
    int32_t started, open_round, disabled, restage_owed, first_round;
    int64_t end, horizon, n_cache, pos_base, n_retained, n_pending;
    int64_t consecutive_failures, tentative_rows;
    int32_t reservation_open; /* 1 between dspark_reserve and dspark_confirm / dspark_cancel */
    int32_t drafting_off;     /* 1 between dspark_disable and dspark_enable (or the next begin) */
    int64_t tree_nodes;       /* the nodes of a tree verify batch until dspark_accept_path, else 0 */
} dspark_state;

/* Counters since the sequence's last begin (Python: Stager.stats()). Set
 * struct_size (dspark_stats_init); the library fills at most struct_size bytes.
 * skips_<reason>: the skips of each reason (sum: skips); verified_rounds /
 * accepted_tokens: the rounds whose verify count arrived and their accepted
 * drafts summed (dspark_accepted_get's histogram's total and sum). */
typedef struct dspark_stats {
    uint32_t struct_size;
    uint32_t reserved0;
    int64_t rounds, commits, failures, rebases, staged_rows, restaged_rows, skips;
    int64_t trims, trimmed_rows, live_rows, rows, peak_rows, bytes, peak_bytes, reserved_bytes;
    int64_t skips_disabled, skips_empty, skips_no_context, skips_missing_rows, skips_drafting_off;
    int64_t verified_rounds, accepted_tokens;
} dspark_stats;

/* The defaults, with struct_size = sizeof as compiled by the caller. */
static inline void dspark_config_init(dspark_config* c) {
    memset(c, 0, sizeof *c);
    c->struct_size = (uint32_t)sizeof(dspark_config);
    c->storage = DSPARK_STORAGE_F32;
    c->max_seqs = 1;
    c->max_failures = 3;
    c->nonfinite = DSPARK_NONFINITE_ERROR;
    c->stage_dtype = DSPARK_DTYPE_F32;
    c->strict = 0;
    c->rows_mode = DSPARK_ROWS_HELD;
    c->kind = DSPARK_KIND_BLOCK;
}
static inline void dspark_state_init(dspark_state* s) {
    memset(s, 0, sizeof *s);
    s->struct_size = (uint32_t)sizeof(dspark_state);
}
static inline void dspark_stats_init(dspark_stats* s) {
    memset(s, 0, sizeof *s);
    s->struct_size = (uint32_t)sizeof(dspark_stats);
}

/* ---- library ------------------------------------------------------------- */
DSPARK_API const char* dspark_version(void);      /* "0.1.0": the package version */
DSPARK_API int32_t dspark_abi_version(void);      /* DSPARK_ABI_VERSION of the library */
/* Message of the last failed call on this thread ("" after a successful
 * one). Valid until this thread's next dspark_* call. */
DSPARK_API const char* dspark_last_error(void);
DSPARK_API const char* dspark_status_name(dspark_status status);  /* "DSPARK_E_STATE", ... */

/* ---- stager lifecycle ---------------------------------------------------- */
typedef struct dspark_stager dspark_stager; /* opaque */

/* *out receives a new Stager (NULL on failure). */
DSPARK_API dspark_status dspark_stager_create(const dspark_config* config, dspark_stager** out);
/* Frees the Stager; NULL is allowed (no-op). No call may use it afterwards. */
DSPARK_API void dspark_stager_destroy(dspark_stager* st);
/* The effective configuration (defaults filled in); fills struct_size bytes. */
DSPARK_API dspark_status dspark_stager_config(const dspark_stager* st, dspark_config* out);
/* Bytes of one stored row (storage format). */
DSPARK_API dspark_status dspark_stager_row_bytes(const dspark_stager* st, size_t* out);
/* The most context rows one plan can stage (window - block_size). */
DSPARK_API dspark_status dspark_stager_max_plan_rows(const dspark_stager* st, int64_t* out);
/* Slots per sequence (both modes): sequence s owns the global slots
 * [s * ring_rows, (s + 1) * ring_rows); an external-row table has
 * max_seqs * ring_rows rows. */
DSPARK_API dspark_status dspark_ring_rows(const dspark_stager* st, int64_t* out);

/* ---- the round protocol -------------------------------------------------- */
DSPARK_API dspark_status dspark_begin(dspark_stager* st, int64_t seq);
/* n rows of feature_dim elements of `dtype` (DSPARK_DTYPE_F32/F16/BF16) at
 * positions[0..n); rows_bytes must be n * feature_dim * element size. */
DSPARK_API dspark_status dspark_process(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                        const void* rows, int32_t dtype, size_t rows_bytes);
/* n rows already in storage format; nbytes must be n * row_bytes. Both
 * process calls are for HELD mode (DSPARK_E_INVALID_ARGUMENT on an EXTERNAL
 * stager). */
DSPARK_API dspark_status dspark_process_encoded(dspark_stager* st, int64_t seq, const int64_t* positions,
                                                size_t n, const void* data, size_t nbytes);
/* EXTERNAL mode: accepts rows at positions[0..n) that the caller holds;
 * slots_out[i] (n entries, written on success only) receives the global slot
 * where the caller writes row i, or -1 for a row below the horizon that no
 * round can stage (not needed). At most two runs of consecutive slots. The
 * library never sees these rows: check them for NaN / Inf before this call.
 * DSPARK_E_INVALID_ARGUMENT on a HELD stager. */
DSPARK_API dspark_status dspark_process_external(dspark_stager* st, int64_t seq, const int64_t* positions,
                                                 size_t n, int64_t* slots_out);
/* dspark_process, dspark_process_encoded and dspark_process_external with
 * tokens[0..n): the id of the token the target read at each row's position
 * (>= 0), kept beside the row. Required by a CHAIN stager, NULL for a BLOCK
 * one (else DSPARK_E_INVALID_ARGUMENT, nothing appended). */
DSPARK_API dspark_status dspark_process_tokens(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                               const void* rows, int32_t dtype, size_t rows_bytes,
                                               const int32_t* tokens);
DSPARK_API dspark_status dspark_process_encoded_tokens(dspark_stager* st, int64_t seq, const int64_t* positions,
                                                       size_t n, const void* data, size_t nbytes,
                                                       const int32_t* tokens);
DSPARK_API dspark_status dspark_process_external_tokens(dspark_stager* st, int64_t seq, const int64_t* positions,
                                                        size_t n, int64_t* slots_out, const int32_t* tokens);
/* CHAIN stager: out[0..to - from) receives the token ids kept beside the rows
 * of positions [from, to), every one held (a plan's staged rows are
 * [first_row, start)). A chain drafter pairs row p with the id of p + 1; the
 * newest row's is the token the round drafts from. */
DSPARK_API dspark_status dspark_tokens(const dspark_stager* st, int64_t seq, int64_t from, int64_t to, int32_t* out);
/* Bytes dspark_draft would write for (seq, n_past) now, in `rows_dtype`
 * (DSPARK_DTYPE_STORAGE or F32/F16/BF16); changes nothing. */
DSPARK_API dspark_status dspark_draft_size(const dspark_stager* st, int64_t seq, int64_t n_past,
                                           int32_t rows_dtype, size_t* bytes);
/* Plans a round into *plan and writes its context rows (plan->n_rows rows,
 * in `rows_dtype`) to rows[0 .. *rows_written). rows may be NULL when
 * rows_capacity is 0. When the rows do not fit: DSPARK_E_BUFFER_TOO_SMALL,
 * *rows_written = the bytes needed, nothing changed. rows_written may be NULL.
 * EXTERNAL mode: no rows are written (rows_dtype, rows and rows_capacity are
 * ignored, *rows_written = 0); the rows are at plan->slot_first / slot_count
 * (dspark_draft_size reports 0). */
DSPARK_API dspark_status dspark_draft(dspark_stager* st, int64_t seq, int64_t n_past, int32_t rows_dtype,
                                      void* rows, size_t rows_capacity, dspark_plan* plan, size_t* rows_written);
/* dspark_draft without the copy (HELD mode): plans a round into *plan and
 * points run_data[k] at run_rows[k] of its context rows where they lie in the
 * sequence's ring, in storage format (dspark_stager_row_bytes each), oldest
 * first: run 1 (0 rows, NULL when unused) follows run 0 when the ring wraps.
 * The runs stay valid until the next call that may change seq's rows (any
 * call on seq but dspark_commit, dspark_fail and the read-only calls) or
 * dspark_stager_destroy: read them (or launch their upload) before the verify
 * batch is processed. A rebase then hands over W/2 rows without copying them.
 * EXTERNAL mode: DSPARK_E_INVALID_ARGUMENT (the rows are at the slots). */
DSPARK_API dspark_status dspark_draft_view(dspark_stager* st, int64_t seq, int64_t n_past, dspark_plan* plan,
                                           const void* run_data[2], size_t run_rows[2]);
/* One plan per sequence (ids unique) into plans[0..n); the rows of all plans
 * follow each other in `rows`, plan order. All or nothing. */
DSPARK_API dspark_status dspark_draft_many(dspark_stager* st, const int64_t* seqs, const int64_t* n_pasts, size_t n,
                                           int32_t rows_dtype, void* rows, size_t rows_capacity, dspark_plan* plans,
                                           size_t* rows_written);
/* dspark_draft_many without the copy (HELD mode): one plan per sequence into
 * plans[0..n), and the context rows of plans[i] where they lie in the ring,
 * as dspark_draft_view gives them: run k at run_data[2 * i + k], run_rows[2 *
 * i + k] rows (0 rows, NULL when unused or skipped). run_data and run_rows
 * have 2 * n entries. The runs stay valid as dspark_draft_view's do, each
 * sequence's until the next call that may change its rows. All or nothing.
 * EXTERNAL mode: DSPARK_E_INVALID_ARGUMENT. */
DSPARK_API dspark_status dspark_draft_many_view(dspark_stager* st, const int64_t* seqs, const int64_t* n_pasts,
                                                size_t n, dspark_plan* plans, const void** run_data,
                                                size_t* run_rows);
DSPARK_API dspark_status dspark_commit(dspark_stager* st, int64_t seq);
/* stage: DSPARK_FAIL_DECODE / CROP. *disabled_after (may be NULL) receives
 * the consecutive-failure count when this failure disabled the sequence, else 0. */
DSPARK_API dspark_status dspark_fail(dspark_stager* st, int64_t seq, int32_t stage, int64_t* disabled_after);
DSPARK_API dspark_status dspark_accept(dspark_stager* st, int64_t seq, int64_t n_accepted);

/* ---- tree verification (Python: Stager.process_tree / accept_path) ------- */
/* A verify batch of the n nodes of a draft tree, the first rows after a
 * round's draft (or its accept): node 0 is the root (the token `last`, at
 * n_past, the sequence's end), parents[0] = -1 and 0 <= parents[i] < i,
 * node i at position n_past + depth(i); 1 <= n <= block_size + 1. rows: n rows as for dspark_process.
 * Until dspark_accept_path the sequence holds the tree (every other call on
 * it but dspark_end, dspark_disable / dspark_enable and the read-only ones
 * is DSPARK_E_STATE). HELD mode. */
DSPARK_API dspark_status dspark_process_tree(dspark_stager* st, int64_t seq, int64_t n_past, const int64_t* parents,
                                             size_t n, const void* rows, int32_t dtype, size_t rows_bytes);
/* EXTERNAL mode: slots_out[i] (n entries) receives the global slot of node
 * i's row, as dspark_process_external's. */
DSPARK_API dspark_status dspark_process_tree_external(dspark_stager* st, int64_t seq, int64_t n_past,
                                                      const int64_t* parents, size_t n, int64_t* slots_out);
/* dspark_process_tree for n sequences: the tree of seqs[i] is
 * parents[offsets[i] .. offsets[i + 1]) rooted at n_pasts[i], its rows those
 * rows of `rows` (total rows, rows_bytes bytes). Checked whole. HELD mode. */
DSPARK_API dspark_status dspark_process_tree_many(dspark_stager* st, const int64_t* seqs, size_t n,
                                                  const int64_t* offsets, const int64_t* n_pasts,
                                                  const int64_t* parents, size_t total, const void* rows,
                                                  int32_t dtype, size_t rows_bytes);
/* EXTERNAL mode: slots_out[0..total) receives each node's slot. */
DSPARK_API dspark_status dspark_process_tree_external_many(dspark_stager* st, const int64_t* seqs, size_t n,
                                                           const int64_t* offsets, const int64_t* n_pasts,
                                                           const int64_t* parents, size_t total, int64_t* slots_out);
/* The four above with each node's token id (tokens[0..n), a batch's flat as
 * its nodes): a CHAIN stager's (dspark_process_tokens). */
DSPARK_API dspark_status dspark_process_tree_tokens(dspark_stager* st, int64_t seq, int64_t n_past,
                                                    const int64_t* parents, size_t n, const void* rows, int32_t dtype,
                                                    size_t rows_bytes, const int32_t* tokens);
DSPARK_API dspark_status dspark_process_tree_external_tokens(dspark_stager* st, int64_t seq, int64_t n_past,
                                                             const int64_t* parents, size_t n, int64_t* slots_out,
                                                             const int32_t* tokens);
DSPARK_API dspark_status dspark_process_tree_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                                         const int64_t* offsets, const int64_t* n_pasts,
                                                         const int64_t* parents, size_t total, const void* rows,
                                                         int32_t dtype, size_t rows_bytes, const int32_t* tokens);
DSPARK_API dspark_status dspark_process_tree_external_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                                                  const int64_t* offsets, const int64_t* n_pasts,
                                                                  const int64_t* parents, size_t total,
                                                                  int64_t* slots_out, const int32_t* tokens);
/* Keeps the accepted path nodes[0..n) (nodes[0] = 0, each node the child of
 * the one before) at positions n_past .. n_past + n - 1, drops the other
 * nodes: dspark_accept(seq, n - 1) of a chain. The copies that compact the
 * path (HELD: applied; EXTERNAL: to apply, in order) become this thread's
 * last moves (dspark_last_moves). */
DSPARK_API dspark_status dspark_accept_path(dspark_stager* st, int64_t seq, const int64_t* nodes, size_t n);
/* dspark_accept_path for n sequences: the path of seqs[i] is
 * nodes[offsets[i] .. offsets[i + 1]) (offsets: n + 1 entries, never NULL);
 * the moves of all of them, in order, become this thread's last moves. */
DSPARK_API dspark_status dspark_accept_path_many(dspark_stager* st, const int64_t* seqs, size_t n,
                                                 const int64_t* offsets, const int64_t* nodes, size_t total);

/* ---- batches (one call per server step) ---------------------------------- */
/* dspark_process for n sequences: positions[0..total) and rows (total rows
 * of feature_dim `dtype` elements, rows_bytes bytes) are flat, the rows of
 * seqs[i] at [offsets[i], offsets[i + 1]). offsets has n + 1 entries and is
 * never NULL (n = 0: {0}); seqs, positions and rows may be NULL when empty.
 * HELD mode. */
DSPARK_API dspark_status dspark_process_many(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                             const int64_t* positions, size_t total, const void* rows, int32_t dtype,
                                             size_t rows_bytes);
/* dspark_process_external for n sequences: slots_out[0..total) receives the
 * slot of each flat row (or -1), written on success only. EXTERNAL mode. */
DSPARK_API dspark_status dspark_process_external_many(dspark_stager* st, const int64_t* seqs, size_t n,
                                                      const int64_t* offsets, const int64_t* positions, size_t total,
                                                      int64_t* slots_out);
/* The two above with tokens[0..total), flat as the rows (dspark_process_tokens). */
DSPARK_API dspark_status dspark_process_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                                    const int64_t* offsets, const int64_t* positions, size_t total,
                                                    const void* rows, int32_t dtype, size_t rows_bytes,
                                                    const int32_t* tokens);
DSPARK_API dspark_status dspark_process_external_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                                             const int64_t* offsets, const int64_t* positions,
                                                             size_t total, int64_t* slots_out, const int32_t* tokens);
/* dspark_accept(seqs[i], n_accepted[i]) for each i. */
DSPARK_API dspark_status dspark_accept_many(dspark_stager* st, const int64_t* seqs, const int64_t* n_accepted,
                                            size_t n);
/* dspark_commit of n sequences, each with an open round. */
DSPARK_API dspark_status dspark_commit_many(dspark_stager* st, const int64_t* seqs, size_t n);
/* dspark_fail(seqs[i], stages[i]) for each i; disabled_after (may be NULL)
 * receives n entries: what dspark_fail reports per sequence. */
DSPARK_API dspark_status dspark_fail_many(dspark_stager* st, const int64_t* seqs, const int32_t* stages, size_t n,
                                          int64_t* disabled_after);

/* ---- slots before the rows (EXTERNAL mode; docs/external_rows.md) -------- */
/* dspark_reserve: dspark_process_external's checks and slots before the rows
 * exist (a GPU server computes where its capture kernel writes before it
 * launches the forward). The sequence then holds a reservation: every call
 * on it but confirm, cancel and end is DSPARK_E_STATE. dspark_confirm: the
 * rows were written (the state is what dspark_process_external leaves);
 * dspark_cancel: they never came, and the sequence is as before reserve. */
DSPARK_API dspark_status dspark_reserve(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                        int64_t* slots_out);
DSPARK_API dspark_status dspark_reserve_many(dspark_stager* st, const int64_t* seqs, size_t n, const int64_t* offsets,
                                             const int64_t* positions, size_t total, int64_t* slots_out);
/* The two above with the rows' token ids (a CHAIN stager's, as dspark_process_external_tokens). */
DSPARK_API dspark_status dspark_reserve_tokens(dspark_stager* st, int64_t seq, const int64_t* positions, size_t n,
                                               int64_t* slots_out, const int32_t* tokens);
DSPARK_API dspark_status dspark_reserve_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                                    const int64_t* offsets, const int64_t* positions, size_t total,
                                                    int64_t* slots_out, const int32_t* tokens);
DSPARK_API dspark_status dspark_confirm(dspark_stager* st, int64_t seq);
DSPARK_API dspark_status dspark_cancel(dspark_stager* st, int64_t seq);
DSPARK_API dspark_status dspark_confirm_many(dspark_stager* st, const int64_t* seqs, size_t n);
DSPARK_API dspark_status dspark_cancel_many(dspark_stager* st, const int64_t* seqs, size_t n);

/* ---- the device step (EXTERNAL mode; docs/protocol.md "The device step") -
 * A server hands sequences over (dspark_to_device); each step then runs for
 * the whole batch over the step state without the host: commit the round the
 * last step opened, confirm its verify rows, accept(n_accepted[i]), plan the
 * next round at n_past = end as dspark_draft would, and reserve the next
 * verify batch's slots. dspark_step_many is the CPU twin over the host state
 * (dspark_step_state); the CUDA kernel runs the same math over a device copy.
 * Every other call on a handed-over sequence but dspark_end is
 * DSPARK_E_STATE until dspark_to_host brings it back. Per-entry problems are
 * status words (DSPARK_STEP_*), never a failed call; dspark_check_step turns
 * them into the core's errors. The step trusts no field of the state before
 * checking it: a state a server damaged is DSPARK_STEP_DAMAGED, never a write
 * out of bounds, and dspark_to_host refuses it (end the sequence). Every
 * typed buffer must be aligned for its type (DSPARK_E_INVALID_ARGUMENT). */
enum {
    DSPARK_STEP_OK = 0, /* stepped */
    DSPARK_STEP_NOT_IN_STEP = 1, /* n_accepted -1: the sequence sat this step out */
    DSPARK_STEP_FIRST_ERROR = 16, /* from here on: an error, the step changed nothing for it */
    DSPARK_STEP_NOT_ON_DEVICE = 16, /* an unknown id, or a sequence not handed over */
    DSPARK_STEP_DUPLICATE = 17, /* the id appears earlier in the same step */
    DSPARK_STEP_BAD_COUNT = 18, /* n_accepted outside [-1, B]: sticky until to_host */
    DSPARK_STEP_POSITION_LIMIT = 19, /* the verify rows would pass 2**62 - 1: sticky */
    DSPARK_STEP_INTERNAL = 20, /* a broken invariant: sticky */
    DSPARK_STEP_DAMAGED = 21, /* the step state breaks a rule (a server's copy back went wrong): sticky, no write */
};
/* A fixed-capacity step's padding entry: id DSPARK_STEP_PADDING_ID with
 * n_accepted -1 is DSPARK_STEP_NOT_IN_STEP and changes nothing (a graph
 * captured for N entries serves any batch of at most N). */
#define DSPARK_STEP_PADDING_ID (-1)
enum {
    DSPARK_STEP_REBASE = 1, /* flags: the round rebases */
    DSPARK_STEP_CLEAR_CACHE = 2, /* flags: clear the drafter's cache of the sequence first */
};

/* Where a step writes entry i's answers; every pointer but status may be
 * NULL (not written). max_rows is dspark_step_layout's; B the block size.
 * An entry not stepped reads skip -1 and -1 (n_rows 0, flags 0) everywhere. */
typedef struct dspark_step_out {
    int32_t* status;          /* [n] DSPARK_STEP_* */
    int32_t* skip;            /* [n] DSPARK_SKIP_* code (none or no_context), -1 when not stepped */
    int32_t* flags;           /* [n] DSPARK_STEP_REBASE | DSPARK_STEP_CLEAR_CACHE */
    int64_t* start;           /* [n] the round's n_past */
    int64_t* pos_base;        /* [n] -1 for a skip */
    int64_t* crop_from;       /* [n] -1 for a skip */
    int64_t* n_rows;          /* [n] context rows staged */
    int64_t* row_slots;       /* [n * max_rows] the context rows' global slots, -1 padding */
    int32_t* row_positions;   /* [n * max_rows] their drafter positions, -1 padding */
    int32_t* block_positions; /* [n * B] the block's drafter positions, -1 for a skip */
    int64_t* verify_slots;    /* [n * (B + 1)] the next verify rows' slots, -1 unused */
} dspark_step_out;

/* The Stager's constants the step's math needs, which a device owner passes
 * to its kernel (Python: Stager.step_config). Set struct_size
 * (dspark_step_config_init); the library fills at most struct_size bytes. */
typedef struct dspark_step_config {
    uint32_t struct_size;
    uint32_t reserved0;
    int64_t block, window, w_keep, ring_rows, max_seqs, max_rows, trim_chunk, max_position;
} dspark_step_config;
static inline void dspark_step_config_init(dspark_step_config* c) {
    memset(c, 0, sizeof *c);
    c->struct_size = (uint32_t)sizeof(dspark_step_config);
}
DSPARK_API dspark_status dspark_step_config_get(const dspark_stager* st, dspark_step_config* out);
/* Whether seq is handed over (between dspark_to_device and dspark_to_host):
 * *on is 1 or 0 (Python: Stager.on_device). */
DSPARK_API dspark_status dspark_on_device(const dspark_stager* st, int64_t seq, int32_t* on);
/* The step state's shape: *fields int64 columns of max_seqs entries each
 * (field-major: the step's fields, then the acceptance histogram's B + 1
 * buckets), and the padded plan width (W - B). Either pointer may be NULL. */
DSPARK_API dspark_status dspark_step_layout(const dspark_stager* st, int64_t* fields, int64_t* max_rows);
/* The host step state (fields * max_seqs int64): a device owner copies the
 * columns of handed-over sequences to its device copy after dspark_to_device
 * and back before dspark_to_host. */
DSPARK_API dspark_status dspark_step_state(dspark_stager* st, int64_t** state);
/* Hands seqs over: each started, holding no tree verify batch, not on the
 * device already (a disabled sequence, or one whose drafting is off, steps
 * with DSPARK_SKIP_DISABLED / DSPARK_SKIP_DRAFTING_OFF); checked whole,
 * nothing changes on an error. */
DSPARK_API dspark_status dspark_to_device(dspark_stager* st, const int64_t* seqs, size_t n);
/* Brings seqs back, the last step's round resolved by outcomes[i] (NULL: all
 * -1): -1 the drafter ran (commit), DSPARK_FAIL_* it failed (fail). Each
 * comes back ready or reserved. disabled_after (may be NULL): fail's answer,
 * 0 otherwise. A fault a step recorded (DSPARK_STEP_BAD_COUNT, ...) is
 * reported after every sequence is back, as that error's status. */
DSPARK_API dspark_status dspark_to_host(dspark_stager* st, const int64_t* seqs, size_t n, const int32_t* outcomes,
                                        int64_t* disabled_after);
/* A chain drafter's Stager (DSPARK_KIND_CHAIN) hands its rows' token ids
 * over by slot: tokens is the slot token table, n_tokens = max_seqs *
 * ring_rows int32 indexed by global slot (the slots of the step's
 * row_slots and verify_slots). dspark_to_device_tokens writes each
 * sequence's ids at its rows' slots and -1 at the rest of its ring_rows
 * slots; between steps the server writes each verify row's id at its
 * verify slot (the verify batch's input ids) and reads the staged rows'
 * ids at their row_slots; dspark_to_host_tokens reads them back. An id < 0
 * at a row's slot is DSPARK_E_INVALID_ARGUMENT naming it, and nothing is
 * brought back; only the last step's verify rows may come back unwritten,
 * which dspark_confirm then refuses (cancel them). The plain forms refuse a
 * chain drafter's Stager, the _tokens forms a block drafter's. */
DSPARK_API dspark_status dspark_to_device_tokens(dspark_stager* st, const int64_t* seqs, size_t n, int32_t* tokens,
                                                 size_t n_tokens);
DSPARK_API dspark_status dspark_to_host_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                               const int32_t* outcomes, int64_t* disabled_after,
                                               const int32_t* tokens, size_t n_tokens);
/* One step of the n entries (seqs[i], n_accepted[i]) over the host state. */
DSPARK_API dspark_status dspark_step_many(dspark_stager* st, const int64_t* seqs, const int64_t* n_accepted, size_t n,
                                          const dspark_step_out* out);
/* The error of the first entry whose status is one (DSPARK_OK when none). */
DSPARK_API dspark_status dspark_check_step(const dspark_stager* st, const int64_t* seqs, const int32_t* statuses,
                                           size_t n);
/* The CSR rows of the batch the last dspark_step_many stepped: the unpadded
 * layout's gather in one call (docs/protocol.md 2.10, "the CSR rows").
 * seqs / n and out as that step's (out->status, skip, start, n_rows and
 * pos_base required; the padded row_slots / row_positions may be NULL),
 * for capacity >= n entries (those past n: padding, 0 rows). Writes
 * row_offsets [capacity + 1] (required) and entry i's context rows at
 * [row_offsets[i], row_offsets[i + 1]) of row_slots [capacity * max_rows]
 * (int64 global slots) and row_positions [capacity * max_rows] (int32
 * drafter positions), either NULL: not written; the elements past
 * row_offsets[capacity] are left as they were. An entry not stepped,
 * skipped, or whose plan its ring does not hold (a stale out) has 0 rows.
 * DSPARK_E_INVALID_ARGUMENT (capacity < n, HELD mode, a misaligned
 * buffer), DSPARK_E_NULL_POINTER: nothing written. */
DSPARK_API dspark_status dspark_step_rows(dspark_stager* st, const int64_t* seqs, size_t n, const dspark_step_out* out,
                                          size_t capacity, int64_t* row_offsets, int64_t* row_slots,
                                          int32_t* row_positions);

/* ---- a request's end ----------------------------------------------------- */
/* Ends seq's request in any state (an open round or a reservation is
 * dropped: the abort path; a handed-over sequence leaves the device step,
 * its counters with it) and frees its ring (dspark_begin keeps it for the
 * next request): the sequence is as a new Stager's. */
DSPARK_API dspark_status dspark_end(dspark_stager* st, int64_t seq);
DSPARK_API dspark_status dspark_end_many(dspark_stager* st, const int64_t* seqs, size_t n);

/* ---- drafting per request -------------------------------------------------
 * dspark_disable turns drafting off for seq's request: every dspark_draft then
 * skips with DSPARK_SKIP_DRAFTING_OFF while its rows keep being processed;
 * dspark_enable turns it back on (the next draft plans at once, rebasing if the
 * rows outgrew the window meanwhile). Any state; on a handed-over sequence it
 * writes the host step state's drafting_off column (a device owner copies
 * that column to its device copy: the device step then skips with
 * DSPARK_SKIP_DRAFTING_OFF); idempotent. Cleared by dspark_begin / dspark_end and a prefix start,
 * copied by dspark_fork, carried by snapshots. The _many forms check every id
 * first and change nothing on an error. */
DSPARK_API dspark_status dspark_disable(dspark_stager* st, int64_t seq);
DSPARK_API dspark_status dspark_enable(dspark_stager* st, int64_t seq);
DSPARK_API dspark_status dspark_disable_many(dspark_stager* st, const int64_t* seqs, size_t n);
DSPARK_API dspark_status dspark_enable_many(dspark_stager* st, const int64_t* seqs, size_t n);

/* ---- lifecycle ----------------------------------------------------------- */
DSPARK_API dspark_status dspark_rollback(dspark_stager* st, int64_t seq, int64_t n_past);
/* shift and fork record the slot copies they made (HELD: applied already,
 * for the record) or that the caller must apply (EXTERNAL) as this thread's
 * last moves: see dspark_last_moves. */
DSPARK_API dspark_status dspark_shift(dspark_stager* st, int64_t seq, int64_t n_keep, int64_t n_discard);
DSPARK_API dspark_status dspark_fork(dspark_stager* st, int64_t src, int64_t dst);
/* The moves of this thread's last dspark_fork / dspark_shift / dspark_accept_path(_many) call (n = 0
 * when nothing moved or that call failed; before any such call too). *moves
 * points into the library's thread-local storage: read-only, not to be freed,
 * valid until this thread's next dspark_fork / dspark_shift (or
 * dspark_prefix_publish / dspark_prefix_hit, which record theirs here too). */
DSPARK_API dspark_status dspark_last_moves(const dspark_slot_move** moves, size_t* n);
/* The slots of the stageable rows [horizon, end) of seq, oldest first, as
 * two runs (count 0 when unused): in EXTERNAL mode, the rows the caller saves
 * with a snapshot (which then carries the bookkeeping only). */
DSPARK_API dspark_status dspark_live_slots(const dspark_stager* st, int64_t seq, int64_t first[2],
                                           int64_t count[2]);
/* Snapshot bytes of one sequence (format of dspark_core.stager.snapshot_format). */
DSPARK_API dspark_status dspark_snapshot_size(const dspark_stager* st, int64_t seq, size_t* bytes);
/* Writes the snapshot to out[0 .. *written). Too small: DSPARK_E_BUFFER_TOO_SMALL,
 * *written = the bytes needed. */
DSPARK_API dspark_status dspark_snapshot(const dspark_stager* st, int64_t seq, void* out, size_t capacity,
                                         size_t* written);
/* Restores seq from a snapshot of the same mode (a snapshot of the other
 * mode is DSPARK_E_INVALID_ARGUMENT). Records where the restored rows
 * [horizon, end) live as this thread's last restore runs (EXTERNAL: where
 * the caller puts the saved rows back, in order): dspark_last_restore_runs. */
DSPARK_API dspark_status dspark_restore(dspark_stager* st, int64_t seq, const void* data, size_t nbytes);
/* The runs of this thread's last dspark_restore call: run k is the slots
 * [first[k], first[k] + count[k]); counts 0 when that call failed or before
 * any. Kept until this thread's next dspark_restore. */
DSPARK_API dspark_status dspark_last_restore_runs(int64_t first[2], int64_t count[2]);

/* ---- introspection ------------------------------------------------------- */
DSPARK_API dspark_status dspark_state_get(const dspark_stager* st, int64_t seq, dspark_state* out);
DSPARK_API dspark_status dspark_stats_get(const dspark_stager* st, int64_t seq, dspark_stats* out);
/* The sequence's accepted drafts per verified round since its last begin
 * (Python: Stager.accepted()): out[k] = the rounds with k accepted, for k in
 * [0, block_size]; n must be at least block_size + 1
 * (DSPARK_E_BUFFER_TOO_SMALL otherwise, nothing written). */
DSPARK_API dspark_status dspark_accepted_get(const dspark_stager* st, int64_t seq, int64_t* out, size_t n);
/* dspark_accepted_get of seqs[0..n) at one moment (Python: Stager.accepted_many()):
 * sequence i's histogram at out[i * (block_size + 1)]; out_n (int64 entries)
 * must be at least n * (block_size + 1) (DSPARK_E_BUFFER_TOO_SMALL otherwise).
 * Every id is checked before anything is written. */
DSPARK_API dspark_status dspark_accepted_many(const dspark_stager* st, const int64_t* seqs, size_t n, int64_t* out,
                                              size_t out_n);
/* The Stager's metrics at one moment (Python: Stager.totals()): counters over
 * every sequence since the Stager was made (monotonic), the gauges (live_rows,
 * rows, bytes, reserved_bytes) over the sequences holding rows now, the peaks
 * the largest any sequence reached; accepted (NULL: not written, else n >=
 * block_size + 1, DSPARK_E_BUFFER_TOO_SMALL otherwise) the histogram over
 * every sequence; started (NULL: not written) the sequences holding rows now.
 * A sequence with a reservation open counts as before it. */
DSPARK_API dspark_status dspark_totals_get(const dspark_stager* st, dspark_stats* out, int64_t* accepted, size_t n,
                                           int64_t* started);
/* The round open on each of seqs[0..n) (dspark_plan.round), or 0 where none
 * is, into out[0..n), read at one moment under the sequences' locks. */
DSPARK_API dspark_status dspark_open_round_ids(const dspark_stager* st, const int64_t* seqs, size_t n,
                                               uint64_t* out);

/* ---- row formats (no Stager needed; thread-safe) ------------------------- */
/* Bytes of one row of `dim` elements in `storage` (q formats: dim % 32 == 0). */
DSPARK_API dspark_status dspark_row_bytes(int32_t storage, size_t dim, size_t* out);
/* Encodes n_rows rows of dim `src_dtype` elements (src_bytes bytes) into
 * dst (dst_capacity >= n_rows * row_bytes). Under DSPARK_NONFINITE_ERROR
 * every row is still converted and *first_bad (may be NULL) receives the
 * flat index of the first non-finite input element, or -1; it is -1 under
 * the other policies. src and dst must not overlap. */
DSPARK_API dspark_status dspark_encode_rows(const void* src, int32_t src_dtype, size_t src_bytes, size_t n_rows,
                                            size_t dim, int32_t storage, int32_t nonfinite, void* dst,
                                            size_t dst_capacity, int64_t* first_bad);
/* Decodes n_rows rows stored as `storage` (src_bytes == n_rows * row_bytes)
 * into dst as `dst_dtype` (dst_capacity >= n_rows * dim * element size). */
DSPARK_API dspark_status dspark_decode_rows(const void* src, int32_t storage, size_t src_bytes, size_t n_rows,
                                            size_t dim, void* dst, int32_t dst_dtype, size_t dst_capacity);

/* ---- prefix store (docs/prefix_cache.md) --------------------------------- */
/* Encoded rows of cached prompt prefixes, under the server's own prefix-cache
 * block keys, so that a prefix-cache hit restages what a full prefill would
 * have and a miss costs a replay of at most K = w_keep positions. A store
 * takes the configuration of the stager it is created for; stagers of that
 * configuration share it (dspark_prefix_publish / _hit refuse others with
 * DSPARK_E_CONFIG). Thread-safe: calls that take a stager and a store lock
 * the stager first, then the store.
 *
 * Keys are opaque byte strings of 1..64 bytes (a SHA-256 block hash, a
 * uint64 hash as 8 bytes, ...). A chain of n keys (blocks 0 .. n-1 of a
 * prompt, block i covering positions [i * block_tokens, (i + 1) *
 * block_tokens), the last one possibly partial) is passed as one byte array
 * and n + 1 offsets: key i is keys[key_offsets[i] .. key_offsets[i + 1]),
 * key_offsets[0] == 0. */
typedef struct dspark_prefix_store dspark_prefix_store; /* opaque */

/* What a hit at n_tokens found: the sequence holds rows [first_row,
 * replay_from) and the server prefills from replay_from (== n_tokens when
 * nothing is missing; never below n_tokens - K). need_first: the first row
 * a full prefill's first round could stage; origin: the sequence's pos_base
 * and n_cache; exact: its first rounds equal a full prefill's. */
typedef struct dspark_prefix_hit_result {
    int64_t n_tokens, need_first, first_row, replay_from, rows, origin, blocks_found;
    int32_t exact;
    int32_t reserved0;
} dspark_prefix_hit_result;

/* Counters of a store (Python: PrefixStore.stats()). Set struct_size
 * (dspark_prefix_stats_init); the library fills at most struct_size bytes. */
typedef struct dspark_prefix_stats {
    uint32_t struct_size;
    uint32_t reserved0;
    int64_t blocks, pages, bytes, resident_bytes, key_bytes;
    int64_t published, republished, evicted_lru, evicted_by_key;
    int64_t hits, full_hits, hit_rows, replayed_tokens;
} dspark_prefix_stats;

static inline void dspark_prefix_stats_init(dspark_prefix_stats* s) {
    memset(s, 0, sizeof *s);
    s->struct_size = (uint32_t)sizeof(dspark_prefix_stats);
}

/* *out receives a store for stagers of like's configuration (rows mode
 * included): block_tokens per prefix block (1 .. 2**30), at most
 * budget_bytes of rows (EXTERNAL: the size of the caller's table,
 * dspark_prefix_store_layout). DSPARK_E_CONFIG when the budget is smaller
 * than one block. */
DSPARK_API dspark_status dspark_prefix_store_create(const dspark_stager* like, int64_t block_tokens,
                                                    int64_t budget_bytes, dspark_prefix_store** out);
/* Frees the store; NULL is allowed. No call may use it afterwards. */
DSPARK_API void dspark_prefix_store_destroy(dspark_prefix_store* store);
/* Rows per page, pages the budget holds, and rows of an EXTERNAL store's
 * table (n_pages * page_rows; slot page * page_rows + i). Any may be NULL. */
DSPARK_API dspark_status dspark_prefix_store_layout(const dspark_prefix_store* store, int64_t* page_rows,
                                                    int64_t* n_pages, int64_t* table_rows);
/* Records the final rows [start, end) of seq under the chain's keys (start a
 * block boundary; one key per block). EXTERNAL: the copies from the stager's
 * table (src) to the store's (dst) are this thread's last moves
 * (dspark_last_moves; apply them in order with the stager's fork / shift
 * moves); HELD: none. */
DSPARK_API dspark_status dspark_prefix_publish(dspark_stager* st, int64_t seq, dspark_prefix_store* store,
                                               const uint8_t* keys, const size_t* key_offsets, size_t n_keys,
                                               int64_t start, int64_t end);
/* Starts seq afresh from a hit of n_tokens positions (the chain of their
 * ceil(n_tokens / block_tokens) blocks); *out (may be NULL) receives what it
 * found. EXTERNAL: the copies from the store's table (src) to the stager's
 * (dst) are this thread's last moves. */
DSPARK_API dspark_status dspark_prefix_hit(dspark_stager* st, int64_t seq, dspark_prefix_store* store,
                                           const uint8_t* keys, const size_t* key_offsets, size_t n_keys,
                                           int64_t n_tokens, dspark_prefix_hit_result* out);
/* A step's publishes in one call: seqs[i]'s blocks [starts[i], ends[i])
 * under chain i, as a loop of dspark_prefix_publish in batch order. The n
 * chains share one key array: chain i is the keys key_offsets[c] ..
 * key_offsets[c + m] of `keys` (c = chain_offsets[i], m = chain_offsets[i +
 * 1] - c; chain_offsets has n + 1 entries rising from 0). Checked whole
 * first: a rejected batch changes nothing, and its message names the entry
 * ("publish_many: seqs[i] (sequence s): ..."); a block new to the store in
 * two entries is added by the first and refreshed by the later ones, as a
 * loop would. EXTERNAL: the copies of every entry, in order, are this
 * thread's last moves (one table change). */
DSPARK_API dspark_status dspark_prefix_publish_many(dspark_stager* st, const int64_t* seqs, size_t n,
                                                    dspark_prefix_store* store, const uint8_t* keys,
                                                    const size_t* key_offsets, const size_t* chain_offsets,
                                                    const int64_t* starts, const int64_t* ends);
/* dspark_prefix_hit for several sequences: seqs[i] from a hit of n_tokens[i]
 * positions under chain i (the chains as dspark_prefix_publish_many's), as a
 * loop in batch order; out[i] (out may be NULL) receives seqs[i]'s hit.
 * Every hit is checked and planned first (a rejected batch changes
 * nothing). EXTERNAL: the copies of them all are this thread's last moves
 * (one table change). */
DSPARK_API dspark_status dspark_prefix_hit_many(dspark_stager* st, const int64_t* seqs, size_t n,
                                                dspark_prefix_store* store, const uint8_t* keys,
                                                const size_t* key_offsets, const size_t* chain_offsets,
                                                const int64_t* n_tokens, dspark_prefix_hit_result* out);
/* dspark_prefix_hit and dspark_prefix_hit_many with the prompt's token ids:
 * tokens[0..n_tokens) (the batch: flat, n_tokens[0] + n_tokens[1] + ...), the
 * positions the keys were made of. Required by a CHAIN stager (the store keeps
 * rows, not ids: the rows a hit brings back take theirs from here), NULL for
 * a BLOCK one. */
DSPARK_API dspark_status dspark_prefix_hit_tokens(dspark_stager* st, int64_t seq, dspark_prefix_store* store,
                                                  const uint8_t* keys, const size_t* key_offsets, size_t n_keys,
                                                  int64_t n_tokens, const int32_t* tokens,
                                                  dspark_prefix_hit_result* out);
DSPARK_API dspark_status dspark_prefix_hit_many_tokens(dspark_stager* st, const int64_t* seqs, size_t n,
                                                       dspark_prefix_store* store, const uint8_t* keys,
                                                       const size_t* key_offsets, const size_t* chain_offsets,
                                                       const int64_t* n_tokens, const int32_t* tokens,
                                                       dspark_prefix_hit_result* out);
/* What dspark_prefix_hit would find now; changes nothing. */
DSPARK_API dspark_status dspark_prefix_lookup(const dspark_prefix_store* store, const uint8_t* keys,
                                              const size_t* key_offsets, size_t n_keys, int64_t n_tokens,
                                              dspark_prefix_hit_result* out);
/* HELD: records rows [start, end) given by the caller ((end - start) rows of
 * feature_dim `dtype` elements, rows_bytes bytes): for blocks a stager no
 * longer holds (a prefill chunk longer than W - K). */
DSPARK_API dspark_status dspark_prefix_publish_rows(dspark_prefix_store* store, const uint8_t* keys,
                                                    const size_t* key_offsets, size_t n_keys, int64_t start,
                                                    int64_t end, const void* rows, int32_t dtype, size_t rows_bytes);
/* EXTERNAL: as publish_rows, the caller writing the rows: slots_out[i]
 * (end - start entries; slots_capacity is its size) receives the table slot
 * of position start + i, or -1 (a row the store does not keep, or a block it
 * already holds). Too small: DSPARK_E_BUFFER_TOO_SMALL, nothing changed. */
DSPARK_API dspark_status dspark_prefix_publish_slots(dspark_prefix_store* store, const uint8_t* keys,
                                                     const size_t* key_offsets, size_t n_keys, int64_t start,
                                                     int64_t end, int64_t* slots_out, size_t slots_capacity);
/* Drops the blocks with these keys (the server's KV cache dropped them);
 * *n_evicted (may be NULL) receives how many were held. */
DSPARK_API dspark_status dspark_prefix_evict(dspark_prefix_store* store, const uint8_t* keys,
                                             const size_t* key_offsets, size_t n_keys, int64_t* n_evicted);
DSPARK_API dspark_status dspark_prefix_clear(dspark_prefix_store* store);
/* Blocks held. */
DSPARK_API dspark_status dspark_prefix_count(const dspark_prefix_store* store, size_t* n);
/* The keys held, least recently used first, as bytes + offsets (n_keys + 1
 * of them). Too small: DSPARK_E_BUFFER_TOO_SMALL, *n_keys and *bytes_needed
 * say what is needed, nothing is written. */
DSPARK_API dspark_status dspark_prefix_keys(const dspark_prefix_store* store, uint8_t* bytes, size_t bytes_capacity,
                                            size_t* key_offsets, size_t offsets_capacity, size_t* n_keys,
                                            size_t* bytes_needed);
DSPARK_API dspark_status dspark_prefix_stats_get(const dspark_prefix_store* store, dspark_prefix_stats* out);
/* The table slots of a block's kept rows, in position order (EXTERNAL: what
 * to read for dspark_prefix_export). Too small: DSPARK_E_BUFFER_TOO_SMALL,
 * *n = the slots needed. */
DSPARK_API dspark_status dspark_prefix_block_slots(const dspark_prefix_store* store, const uint8_t* key,
                                                   size_t key_len, int64_t* slots, size_t capacity, size_t* n);
/* The block as checksummed bytes another process imports (layout:
 * dspark_core.prefix.block_format). EXTERNAL: rows are the block's rows as
 * read from its slots (HELD: NULL, 0). Too small: DSPARK_E_BUFFER_TOO_SMALL,
 * *written = the bytes needed. */
DSPARK_API dspark_status dspark_prefix_export(const dspark_prefix_store* store, const uint8_t* key, size_t key_len,
                                              const void* rows, size_t rows_bytes, void* out, size_t capacity,
                                              size_t* written);
/* Adds the block in data; damaged or foreign data is DSPARK_E_INVALID_ARGUMENT
 * and changes nothing. EXTERNAL: slots_out receives where the caller writes
 * the data's rows (in order; -1 when the block was held already), *n_slots
 * (may be NULL) their number, checked after the data (too small:
 * DSPARK_E_BUFFER_TOO_SMALL, nothing changed); HELD: no slots (*n_slots = 0),
 * slots_out may be NULL. */
DSPARK_API dspark_status dspark_prefix_import(dspark_prefix_store* store, const void* data, size_t nbytes,
                                              int64_t* slots_out, size_t slots_capacity, size_t* n_slots);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* DSPARK_DSPARK_H */
