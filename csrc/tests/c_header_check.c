/* dspark.h compiled as strict C99 (-Wpedantic -Werror) and linked into a C
 * program: a round trip through create / process / draft / commit and the
 * q4_0 row format. The C++ tests (test_c_api.cpp) cover the error paths. */
#include <stdio.h>
#include <string.h>

#include "dspark/dspark.h"

#define D 32
#define EXPECT(cond)                                                                     \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            printf("%s:%d: EXPECT(%s) failed: %s\n", __FILE__, __LINE__, #cond, dspark_last_error()); \
            return 1;                                                                    \
        }                                                                                \
    } while (0)

int main(void) {
    dspark_config c;
    dspark_stager* st = NULL;
    float rows[5 * D], out[20 * D], dec[5 * D];
    int64_t pos[5];
    unsigned char q[5 * 18];
    dspark_plan plan;
    size_t written = 0, rb = 0;
    int64_t bad = 0;
    int i;

    for (i = 0; i < 5 * D; ++i) rows[i] = (float)(i % 17) - 8.0f + (i % D == 3 ? 4096.0f : 0.0f);
    for (i = 0; i < 5; ++i) pos[i] = i;

    dspark_config_init(&c);
    c.feature_dim = D;
    c.block_size = 7;
    c.window = 20;
    EXPECT(dspark_stager_create(&c, &st) == DSPARK_OK);
    EXPECT(dspark_process(st, 0, pos, 5, rows, DSPARK_DTYPE_F32, sizeof rows) == DSPARK_OK);
    EXPECT(dspark_draft(st, 0, 5, DSPARK_DTYPE_F32, out, sizeof out, &plan, &written) == DSPARK_OK);
    EXPECT(plan.skip == DSPARK_SKIP_NONE && plan.n_rows == 5 && plan.clear_cache == 1 && plan.crop_from == 5);
    EXPECT(written == sizeof rows && memcmp(out, rows, sizeof rows) == 0);
    EXPECT(dspark_process(st, 0, pos, 5, rows, DSPARK_DTYPE_F32, sizeof rows) == DSPARK_E_STATE);
    EXPECT(strstr(dspark_last_error(), "open round") != NULL);
    EXPECT(dspark_commit(st, 0) == DSPARK_OK);
    dspark_stager_destroy(st);

    /* External rows: slots instead of rows, moves through dspark_last_moves. */
    {
        int64_t slots[5], ring = 0, first[2], count[2];
        const dspark_slot_move* moves = NULL;
        size_t n_moves = 0;
        c.rows_mode = DSPARK_ROWS_EXTERNAL;
        c.max_seqs = 2;
        st = NULL;
        EXPECT(dspark_stager_create(&c, &st) == DSPARK_OK);
        EXPECT(dspark_ring_rows(st, &ring) == DSPARK_OK && ring > 20);
        EXPECT(dspark_process(st, 0, pos, 5, rows, DSPARK_DTYPE_F32, sizeof rows) == DSPARK_E_INVALID_ARGUMENT);
        EXPECT(dspark_process_external(st, 0, pos, 5, slots) == DSPARK_OK);
        EXPECT(slots[0] == 0 && slots[4] == 4);
        EXPECT(dspark_draft(st, 0, 5, DSPARK_DTYPE_STORAGE, NULL, 0, &plan, &written) == DSPARK_OK);
        EXPECT(written == 0 && plan.rows_mode == DSPARK_ROWS_EXTERNAL && plan.n_rows == 5);
        EXPECT(plan.slot_first[0] == 0 && plan.slot_count[0] == 5 && plan.slot_count[1] == 0);
        EXPECT(dspark_commit(st, 0) == DSPARK_OK);
        EXPECT(dspark_fork(st, 0, 1) == DSPARK_OK);
        EXPECT(dspark_last_moves(&moves, &n_moves) == DSPARK_OK && n_moves == 1);
        EXPECT(moves[0].src == 0 && moves[0].dst == ring && moves[0].count == 5);
        EXPECT(dspark_live_slots(st, 1, first, count) == DSPARK_OK && first[0] == ring && count[0] == 5);
        EXPECT(dspark_last_restore_runs(first, count) == DSPARK_OK && count[0] == 0 && count[1] == 0);
        dspark_stager_destroy(st);
    }

    EXPECT(dspark_row_bytes(DSPARK_STORAGE_Q4_0, D, &rb) == DSPARK_OK && rb == 18);
    EXPECT(dspark_encode_rows(rows, DSPARK_DTYPE_F32, sizeof rows, 5, D, DSPARK_STORAGE_Q4_0, DSPARK_NONFINITE_ERROR, q,
                              sizeof q, &bad) == DSPARK_OK && bad == -1);
    EXPECT(dspark_decode_rows(q, DSPARK_STORAGE_Q4_0, sizeof q, 5, D, dec, DSPARK_DTYPE_F32, sizeof dec) == DSPARK_OK);
    /* q4_0 of a row with a 4096 channel: that channel survives within one step. */
    EXPECT(dec[3] > 3800.0f && dec[3] < 4400.0f);
    printf("dspark %s (ABI %d): C header check passed\n", dspark_version(), (int)dspark_abi_version());
    return 0;
}
