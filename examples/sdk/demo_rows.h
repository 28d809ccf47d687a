/* The rows the SDK examples feed their stagers: deterministic, activation-like
 * (small noise, massive channels, a huge-norm first row) and exactly
 * representable in float32, so that C, C++ and Python (window_loop.py computes the
 * same values) hold the same bits. Also FNV-1a 64, which the examples print
 * for the staged and converted bytes. */
#ifndef DSPARK_EXAMPLES_DEMO_ROWS_H
#define DSPARK_EXAMPLES_DEMO_ROWS_H

#include <stddef.h>
#include <stdint.h>

/* The window loop: B = 7, W = 20, a 5-row prompt, then 7 verify rounds. */
#define DEMO_BLOCK 7
#define DEMO_WINDOW 20
#define DEMO_PROMPT 5
#define DEMO_ROUNDS 8
static const int64_t DEMO_ACCEPTS[DEMO_ROUNDS - 1] = {7, 3, 0, 7, 5, 1, 4};

/* Element `col` of the row at position `pos`, sent in round `version`. */
static inline float demo_value(int64_t pos, int64_t col, int64_t version) {
    const int64_t k = (pos * 7919 + col * 104729 + version * 15485863) % 2001 - 1000;
    float v = (float)k / 256.0f;                     /* noise, |v| < 4 */
    if (col % 29 == 5) v += 4096.0f + (float)pos;    /* massive channels */
    if (pos == 0) v *= 64.0f;                        /* huge-norm first row */
    return v;
}

static inline void demo_rows(float* out, int64_t first_pos, int64_t n, int64_t dim, int64_t version) {
    int64_t i, c;
    for (i = 0; i < n; ++i)
        for (c = 0; c < dim; ++c) out[i * dim + c] = demo_value(first_pos + i, c, version);
}

static inline uint64_t demo_fnv1a(const void* data, size_t n) {
    const unsigned char* p = (const unsigned char*)data;
    uint64_t h = 0xcbf29ce484222325ull;
    size_t i;
    for (i = 0; i < n; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

#endif
