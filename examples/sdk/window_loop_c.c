/* The window loop and a q4_0 round trip through the C ABI (dspark/dspark.h).
 *
 * Build against an installed wheel (nothing from the source tree):
 *   INC=$(python -c 'import dspark_core; print(dspark_core.get_include())')
 *   LIB=$(python -c 'import dspark_core; print(dspark_core.get_library_dir())')
 *   cc -std=c99 -O2 window_loop_c.c -I"$INC" -L"$LIB" -ldspark_core -Wl,-rpath,"$LIB" -lstdc++ -lm -lpthread -o window_loop_c
 * Prints the same lines as window_loop.py (the Python API) and window_loop_cpp.cpp. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "demo_rows.h"
#include "dspark/dspark.h"

#define CHECK(call)                                                                                        \
    do {                                                                                                   \
        dspark_status s_ = (call);                                                                         \
        if (s_ != DSPARK_OK) {                                                                             \
            fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call, dspark_status_name(s_),    \
                    dspark_last_error());                                                                  \
            exit(1);                                                                                       \
        }                                                                                                  \
    } while (0)

static void window_loop(const char* name, int32_t storage, int64_t dim) {
    dspark_config cfg;
    dspark_stager* st = NULL;
    dspark_plan plan;
    dspark_stats stats;
    int64_t max_rows = 0, n_past = DEMO_PROMPT, positions[DEMO_BLOCK + 1], accepted[DEMO_BLOCK + 1], i;
    float *rows, *staged;
    size_t written = 0;
    int rnd;

    dspark_config_init(&cfg);
    cfg.feature_dim = dim;
    cfg.block_size = DEMO_BLOCK;
    cfg.window = DEMO_WINDOW;
    cfg.storage = storage;
    CHECK(dspark_stager_create(&cfg, &st));
    /* One staging buffer for any plan: a plan stages at most window - block rows. */
    CHECK(dspark_stager_max_plan_rows(st, &max_rows));
    rows = malloc(sizeof(float) * (size_t)((DEMO_BLOCK + 1) * dim));
    staged = malloc(sizeof(float) * (size_t)(max_rows * dim));
    if (!rows || !staged) exit(1);

    CHECK(dspark_begin(st, 0));
    for (i = 0; i < DEMO_PROMPT; ++i) positions[i] = i;
    demo_rows(rows, 0, DEMO_PROMPT, dim, 0);
    CHECK(dspark_process(st, 0, positions, DEMO_PROMPT, rows, DSPARK_DTYPE_F32,
                         sizeof(float) * (size_t)(DEMO_PROMPT * dim)));
    for (rnd = 0; rnd < DEMO_ROUNDS; ++rnd) {
        CHECK(dspark_draft(st, 0, n_past, DSPARK_DTYPE_F32, staged, sizeof(float) * (size_t)(max_rows * dim), &plan,
                           &written));
        printf("loop %s round=%d start=%lld rebase=%d clear_cache=%d pos_base=%lld first_row=%lld n_rows=%lld "
               "crop_from=%lld rows_fnv=%016llx\n",
               name, rnd, (long long)plan.start, (int)plan.rebase, (int)plan.clear_cache, (long long)plan.pos_base,
               (long long)plan.first_row, (long long)plan.n_rows, (long long)plan.crop_from,
               (unsigned long long)demo_fnv1a(staged, written));
        CHECK(dspark_commit(st, 0));
        if (rnd == DEMO_ROUNDS - 1) break;
        /* Verification captures B + 1 rows at [start, start + B + 1); the target accepts n. */
        for (i = 0; i <= DEMO_BLOCK; ++i) positions[i] = n_past + i;
        demo_rows(rows, n_past, DEMO_BLOCK + 1, dim, rnd + 1);
        CHECK(dspark_process(st, 0, positions, DEMO_BLOCK + 1, rows, DSPARK_DTYPE_F32,
                             sizeof(float) * (size_t)((DEMO_BLOCK + 1) * dim)));
        CHECK(dspark_accept(st, 0, DEMO_ACCEPTS[rnd]));
        n_past += DEMO_ACCEPTS[rnd] + 1;
    }
    dspark_stats_init(&stats);
    CHECK(dspark_stats_get(st, 0, &stats));
    printf("loop %s stats rounds=%lld commits=%lld rebases=%lld staged_rows=%lld restaged_rows=%lld\n", name,
           (long long)stats.rounds, (long long)stats.commits, (long long)stats.rebases, (long long)stats.staged_rows,
           (long long)stats.restaged_rows);
    /* Accepted drafts per verified round (the commit of the last round has no verify yet). */
    CHECK(dspark_accepted_get(st, 0, accepted, DEMO_BLOCK + 1));
    printf("loop %s accepted", name);
    for (i = 0; i <= DEMO_BLOCK; ++i) printf(" %lld", (long long)accepted[i]);
    printf(" verified_rounds=%lld\n", (long long)stats.verified_rounds);
    free(rows);
    free(staged);
    dspark_stager_destroy(st);
}

static void q4_0_round_trip(void) {
    enum { N = 6, DIM = 64 };
    float rows[N * DIM], decoded[N * DIM];
    unsigned char* encoded;
    size_t rb = 0;
    int64_t first_bad = 0, nan_first_bad = 0;

    demo_rows(rows, 0, N, DIM, 99);
    CHECK(dspark_row_bytes(DSPARK_STORAGE_Q4_0, DIM, &rb));
    encoded = malloc(N * rb);
    if (!encoded) exit(1);
    CHECK(dspark_encode_rows(rows, DSPARK_DTYPE_F32, sizeof rows, N, DIM, DSPARK_STORAGE_Q4_0, DSPARK_NONFINITE_ERROR,
                             encoded, N * rb, &first_bad));
    CHECK(dspark_decode_rows(encoded, DSPARK_STORAGE_Q4_0, N * rb, N, DIM, decoded, DSPARK_DTYPE_F32, sizeof decoded));
    printf("q4_0 rows=%d dim=%d row_bytes=%zu encoded_fnv=%016llx decoded_fnv=%016llx first_bad=%lld\n", N, DIM, rb,
           (unsigned long long)demo_fnv1a(encoded, N * rb), (unsigned long long)demo_fnv1a(decoded, sizeof decoded),
           (long long)first_bad);
    /* A NaN at row 2, column 17: still converted, its flat index reported. */
    rows[2 * DIM + 17] = (float)NAN;
    CHECK(dspark_encode_rows(rows, DSPARK_DTYPE_F32, sizeof rows, N, DIM, DSPARK_STORAGE_Q4_0, DSPARK_NONFINITE_ERROR,
                             encoded, N * rb, &nan_first_bad));
    printf("q4_0 nan first_bad=%lld\n", (long long)nan_first_bad);
    free(encoded);
}

int main(void) {
    window_loop("f32", DSPARK_STORAGE_F32, 32);
    window_loop("q4_0", DSPARK_STORAGE_Q4_0, 64);
    q4_0_round_trip();
    return 0;
}
