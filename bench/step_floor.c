/* step_floor.c: one server step through the C ABI's batch calls, in C: the
 * floor bench/bench_step.py compares the Python calls with (the core's own
 * work, no interpreter).
 *
 *   step_floor MODE N D B W STORAGE ACCEPT WARMUP STEPS
 *
 * MODE: held | external. N sequences each get a prefill of B + 1 rows and one
 * round; then every step, for all N sequences at once:
 *
 *   process the B verify rows of each (held: bf16 rows, one flat array;
 *   external: the slots), accept ACCEPT of them, draft at the new end
 *   (held: rows into one buffer), commit.
 *
 * Prints one line per timed step: "step process accept draft commit" in ns
 * (CLOCK_MONOTONIC). Exit status 0, or 1 with the library's message.
 * Built by bench/bench_step.py against the installed package's SDK. */
/* clock_gettime under -std=c99 */
#define _POSIX_C_SOURCE 199309L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dspark/dspark.h"

#define TRY(call)                                                                                   \
    do {                                                                                            \
        dspark_status s_ = (call);                                                                  \
        if (s_ != DSPARK_OK) {                                                                      \
            fprintf(stderr, "%s: %s (%s)\n", #call, dspark_status_name(s_), dspark_last_error()); \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void* xmalloc(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* bf16 of an activation-like value: noise, a massive channel (col 3). */
static uint16_t bf16_of(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

int main(int argc, char** argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: step_floor held|external N D B W STORAGE ACCEPT WARMUP STEPS\n");
        return 2;
    }
    const int external = strcmp(argv[1], "external") == 0;
    const int64_t n = atoll(argv[2]), D = atoll(argv[3]), B = atoll(argv[4]), W = atoll(argv[5]);
    const int32_t storage = atoi(argv[6]);
    const int64_t acc = atoll(argv[7]), warmup = atoll(argv[8]), steps = atoll(argv[9]);
    const size_t N = (size_t)n, total = (size_t)(n * B);

    dspark_config c;
    dspark_config_init(&c);
    c.feature_dim = D;
    c.block_size = B;
    c.window = W;
    c.max_seqs = n;
    c.storage = storage;
    c.rows_mode = external ? DSPARK_ROWS_EXTERNAL : DSPARK_ROWS_HELD;
    dspark_stager* st = NULL;
    TRY(dspark_stager_create(&c, &st));
    size_t row_bytes = 0;
    TRY(dspark_stager_row_bytes(st, &row_bytes));

    int64_t* seqs = xmalloc(N * sizeof *seqs);
    int64_t* n_past = xmalloc(N * sizeof *n_past);
    int64_t* accepts = xmalloc(N * sizeof *accepts);
    int64_t* cu = xmalloc((N + 1) * sizeof *cu);
    int64_t* pos = xmalloc((total + (size_t)B + 1) * sizeof *pos);
    int64_t* slots = xmalloc((total + (size_t)B + 1) * sizeof *slots);
    dspark_plan* plans = xmalloc(N * sizeof *plans);
    /* The verify rows: one flat bf16 array reused every step (the values do
     * not change the work). Held mode only. */
    const size_t row_elems = (size_t)D, in_bytes = external ? 0 : total * row_elems * 2;
    uint16_t* rows = xmalloc(in_bytes + (size_t)(B + 1) * row_elems * 2);
    for (size_t i = 0; i < (external ? 0 : total + (size_t)B + 1) * row_elems; ++i) {
        const uint32_t h = (uint32_t)(i * 2654435761u);
        const float v = (i % row_elems) == 3 ? 1.0e4f : ((float)(h % 2001u) - 1000.0f) / 400.0f;
        rows[i] = bf16_of(v);
    }
    size_t cap = N * (size_t)(B + 1) * row_bytes;
    uint8_t* out = xmalloc(cap);

    /* Prefill B + 1 rows and one round per sequence. */
    for (size_t i = 0; i < N; ++i) {
        seqs[i] = (int64_t)i;
        for (int64_t k = 0; k <= B; ++k) pos[k] = k;
        if (external)
            TRY(dspark_process_external(st, seqs[i], pos, (size_t)(B + 1), slots));
        else
            TRY(dspark_process(st, seqs[i], pos, (size_t)(B + 1), rows, DSPARK_DTYPE_BF16,
                               (size_t)(B + 1) * row_elems * 2));
        n_past[i] = B + 1;
        accepts[i] = acc;
        cu[i] = (int64_t)i * B;
    }
    cu[N] = (int64_t)total;
    size_t written = 0;
    TRY(dspark_draft_many(st, seqs, n_past, N, DSPARK_DTYPE_STORAGE, out, cap, plans, &written));
    TRY(dspark_commit_many(st, seqs, N));

    for (int64_t t = 0; t < warmup + steps; ++t) {
        const int64_t t0 = now_ns();
        for (size_t i = 0; i < N; ++i)
            for (int64_t k = 0; k < B; ++k) pos[i * (size_t)B + (size_t)k] = n_past[i] + k;
        if (external)
            TRY(dspark_process_external_many(st, seqs, N, cu, pos, total, slots));
        else
            TRY(dspark_process_many(st, seqs, N, cu, pos, total, rows, DSPARK_DTYPE_BF16, in_bytes));
        const int64_t t1 = now_ns();
        TRY(dspark_accept_many(st, seqs, accepts, N));
        for (size_t i = 0; i < N; ++i) n_past[i] += acc + 1;
        const int64_t t2 = now_ns();
        dspark_status s = dspark_draft_many(st, seqs, n_past, N, DSPARK_DTYPE_STORAGE, out, cap, plans, &written);
        if (s == DSPARK_E_BUFFER_TOO_SMALL) { /* a rebase stages more rows: grow, as the binding's pool does */
            free(out);
            cap = written;
            out = xmalloc(cap);
            s = dspark_draft_many(st, seqs, n_past, N, DSPARK_DTYPE_STORAGE, out, cap, plans, &written);
        }
        TRY(s);
        const int64_t t3 = now_ns();
        TRY(dspark_commit_many(st, seqs, N));
        const int64_t t4 = now_ns();
        if (t >= warmup)
            printf("%lld %lld %lld %lld %lld\n", (long long)(t4 - t0), (long long)(t1 - t0), (long long)(t2 - t1),
                   (long long)(t3 - t2), (long long)(t4 - t3));
    }
    dspark_stager_destroy(st);
    free(seqs);
    free(n_past);
    free(accepts);
    free(cu);
    free(pos);
    free(slots);
    free(plans);
    free(rows);
    free(out);
    return 0;
}
