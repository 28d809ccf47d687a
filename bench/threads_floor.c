/* threads_floor.c: bench/bench_threads.py's rounds through the C ABI from C
 * threads (no interpreter, no GIL): what the core itself gives two threads
 * working on two sequences of one Stager.
 *
 *   threads_floor STORAGE D B W ACCEPT ROUNDS TRIALS STAGGER CPU0 CPU1 [MODE]
 *
 * Two sequences, each prefilled with 64 rows and warmed up until its ring
 * has wrapped, the second for STAGGER more rounds (so that the two need not
 * rebase at the same moment); then TRIALS times, alternating: 1 thread
 * running ROUNDS rounds of each sequence in turn, and 2 threads (one per
 * sequence, started together) running ROUNDS rounds each. A round: draft
 * (storage rows into a buffer), commit, process B + 1 float32 rows, accept
 * ACCEPT. CPU0 / CPU1 >= 0: worker q is pinned to CPUq and the 1-thread runs
 * (on the main thread) to CPU0; -1: unpinned.
 * MODE: "copy" (default: dspark_draft copies the staged rows out), "view"
 * (dspark_draft_view: no copy), or "bytes" / "bytes-view": the rounds make
 * the same copies without the core (the ceiling the memory system allows):
 * B + 1 f32 rows into a ring of their own, and ("bytes" only) the rows a
 * draft stages out of it (the accepted ones; at a rebase, by the same rule
 * as the core, min(W/2, W - B) rows, with non-temporal stores as the core's
 * copy of 8 MiB or more makes them). The bytes modes need f32 (STORAGE 0).
 * Prints one line per trial: "threads wall_ns cpu_ns" (cpu: the threads'
 * CLOCK_THREAD_CPUTIME_ID). Built by bench/bench_threads.py. */
#if defined(__linux__)
#define _GNU_SOURCE /* pthread_setaffinity_np */
#else
#define _POSIX_C_SOURCE 200112L /* clock_gettime, pthread barriers under -std=c99 */
#endif

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dspark/dspark.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#define TRY(call)                                                                                   \
    do {                                                                                            \
        dspark_status s_ = (call);                                                                  \
        if (s_ != DSPARK_OK) {                                                                      \
            fprintf(stderr, "%s: %s (%s)\n", #call, dspark_status_name(s_), dspark_last_error()); \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

static int64_t ns_of(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

typedef struct {
    dspark_stager* st; /* NULL: the "bytes" model */
    int view;          /* draft without copying the staged rows out */
    int64_t seq, n_past, B, D, acc, rounds, cpu_ns, t0_ns, t1_ns;
    int cpu; /* the CPU this worker is pinned to, or -1 */
    float* verify;
    uint8_t* out;
    size_t cap;
    pthread_barrier_t* go;
    /* The model's own ring (W + 512 + B + 1 rows, as the core's), its drafter
     * window base and the first row not yet staged. */
    uint8_t* ring;
    int64_t ring_rows, W, pos_base, staged;
} worker;

#define STREAM_MIN_BYTES ((size_t)8 << 20) /* as the core (row_format_kernels.hpp) */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* 128 bytes per iteration, 32-byte-aligned streaming stores after a peel. */
__attribute__((target("avx2"))) static void stream_copy(uint8_t* d, const uint8_t* s, size_t n) {
    size_t i = (32 - ((uintptr_t)d & 31)) & 31;
    if (i > n) i = n;
    memcpy(d, s, i);
    for (; i + 128 <= n; i += 128) {
        __m256i u0 = _mm256_loadu_si256((const __m256i*)(s + i)), u1 = _mm256_loadu_si256((const __m256i*)(s + i + 32));
        __m256i u2 = _mm256_loadu_si256((const __m256i*)(s + i + 64)), u3 = _mm256_loadu_si256((const __m256i*)(s + i + 96));
        _mm256_stream_si256((__m256i*)(d + i), u0);
        _mm256_stream_si256((__m256i*)(d + i + 32), u1);
        _mm256_stream_si256((__m256i*)(d + i + 64), u2);
        _mm256_stream_si256((__m256i*)(d + i + 96), u3);
    }
    _mm_sfence();
    memcpy(d + i, s + i, n - i);
}
#else
static void stream_copy(uint8_t* d, const uint8_t* s, size_t n) { memcpy(d, s, n); }
#endif

/* Rows [from, from + n) of the model's ring to dst, or back (to_ring). */
static void ring_copy(worker* w, int64_t from, int64_t n, uint8_t* other, int to_ring) {
    const size_t rb = (size_t)w->D * sizeof(float);
    for (int64_t i = 0; i < n;) {
        const int64_t slot = (from + i) % w->ring_rows;
        int64_t run = w->ring_rows - slot;
        if (run > n - i) run = n - i;
        uint8_t* r = w->ring + (size_t)slot * rb;
        uint8_t* o = other + (size_t)i * rb;
        const size_t bytes = (size_t)run * rb;
        if (to_ring) memcpy(r, o, bytes);
        else if (n * rb >= STREAM_MIN_BYTES) stream_copy(o, r, bytes);
        else memcpy(o, r, bytes);
        i += run;
    }
}

static void model_rounds(worker* w, int64_t k) {
    const int64_t keep = w->W / 2 < w->W - w->B ? w->W / 2 : w->W - w->B;
    for (int64_t r = 0; r < k; ++r) {
        int64_t lo = w->staged;
        if (w->n_past - w->pos_base + w->B > w->W) lo = w->pos_base = w->n_past - keep; /* a rebase */
        if ((size_t)(w->n_past - lo) * (size_t)w->D * sizeof(float) > w->cap) {
            free(w->out);
            w->cap = (size_t)(w->n_past - lo) * (size_t)w->D * sizeof(float);
            w->out = malloc(w->cap);
        }
        if (!w->view) ring_copy(w, lo, w->n_past - lo, w->out, 0);
        w->staged = w->n_past;
        ring_copy(w, w->n_past, w->B + 1, (uint8_t*)w->verify, 1);
        w->n_past += w->acc + 1;
    }
}

static void rounds(worker* w, int64_t k) {
    if (w->st == NULL) {
        model_rounds(w, k);
        return;
    }
    int64_t pos[64];
    dspark_plan plan;
    size_t written = 0;
    const void* run_data[2];
    size_t run_rows[2];
    for (int64_t r = 0; r < k; ++r) {
        dspark_status s = w->view
            ? dspark_draft_view(w->st, w->seq, w->n_past, &plan, run_data, run_rows)
            : dspark_draft(w->st, w->seq, w->n_past, DSPARK_DTYPE_STORAGE, w->out, w->cap, &plan, &written);
        if (s == DSPARK_E_BUFFER_TOO_SMALL) { /* a rebase: grow the buffer */
            free(w->out);
            w->cap = written;
            w->out = malloc(w->cap);
            s = dspark_draft(w->st, w->seq, w->n_past, DSPARK_DTYPE_STORAGE, w->out, w->cap, &plan, &written);
        }
        TRY(s);
        if (plan.skip == DSPARK_SKIP_NONE) TRY(dspark_commit(w->st, w->seq));
        for (int64_t i = 0; i <= w->B; ++i) pos[i] = w->n_past + i;
        TRY(dspark_process(w->st, w->seq, pos, (size_t)(w->B + 1), w->verify, DSPARK_DTYPE_F32,
                           (size_t)((w->B + 1) * w->D) * sizeof(float)));
        TRY(dspark_accept(w->st, w->seq, w->acc));
        w->n_past += w->acc + 1;
    }
}

/* Pin the calling thread to one CPU (no-op for cpu < 0 or off Linux): in a
 * trial of tens of milliseconds, the scheduler's first placement of two
 * freshly woken threads (often both on the waker's CPU, until a balance
 * moves one) would be measured instead of the rounds. */
static void pin(int cpu) {
#if defined(__linux__)
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
#else
    (void)cpu;
#endif
}

static void* thread_main(void* arg) {
    worker* w = arg;
    pin(w->cpu);
    pthread_barrier_wait(w->go);
    w->t0_ns = ns_of(CLOCK_MONOTONIC);
    const int64_t c0 = ns_of(CLOCK_THREAD_CPUTIME_ID);
    rounds(w, w->rounds);
    w->cpu_ns = ns_of(CLOCK_THREAD_CPUTIME_ID) - c0;
    w->t1_ns = ns_of(CLOCK_MONOTONIC);
    return NULL;
}

int main(int argc, char** argv) {
    const char* mode = argc == 12 ? argv[11] : "copy";
    const int known = !strcmp(mode, "copy") || !strcmp(mode, "view") || !strcmp(mode, "bytes") ||
                      !strcmp(mode, "bytes-view");
    if ((argc != 11 && argc != 12) || !known) {
        fprintf(stderr, "usage: threads_floor STORAGE D B W ACCEPT ROUNDS TRIALS STAGGER CPU0 CPU1 "
                        "[copy|view|bytes|bytes-view]\n");
        return 2;
    }
    const int model = !strncmp(mode, "bytes", 5), view = strstr(mode, "view") != NULL;
    const int32_t storage = atoi(argv[1]);
    const int64_t D = atoll(argv[2]), B = atoll(argv[3]), W = atoll(argv[4]), acc = atoll(argv[5]);
    const int64_t k = atoll(argv[6]), trials = atoll(argv[7]), stagger = atoll(argv[8]);
    const int cpus[2] = {atoi(argv[9]), atoi(argv[10])};
    if (B + 1 > 64 || (model && storage != DSPARK_STORAGE_F32)) return 2;
    dspark_config c;
    dspark_config_init(&c);
    c.feature_dim = D;
    c.block_size = B;
    c.window = W;
    c.max_seqs = 2;
    c.storage = storage;
    dspark_stager* st = NULL;
    TRY(dspark_stager_create(&c, &st));
    int64_t ring = 0;
    size_t row_bytes = 0;
    TRY(dspark_ring_rows(st, &ring));
    TRY(dspark_stager_row_bytes(st, &row_bytes));
    const int64_t prefill = 64;
    float* rows = malloc((size_t)(prefill * D) * sizeof(float));
    for (int64_t i = 0; i < prefill * D; ++i) {
        const uint32_t h = (uint32_t)(i * 2654435761u);
        rows[i] = (i % D) == 7 ? 3.0e3f : ((float)(h % 2001u) - 1000.0f) / 400.0f;
    }
    worker w[2];
    pthread_barrier_t go;
    int64_t pos[64];
    for (int q = 0; q < 2; ++q) {
        memset(&w[q], 0, sizeof w[q]);
        w[q].st = model ? NULL : st;
        w[q].view = view;
        w[q].W = W;
        w[q].ring_rows = ring;
        if (model) { /* huge pages, as the core's ring (byte_buffer.hpp) */
            const size_t bytes = ((size_t)ring * row_bytes + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
            if (posix_memalign((void**)&w[q].ring, (size_t)2 << 20, bytes) != 0) return 1;
#if defined(MADV_HUGEPAGE)
            (void)madvise(w[q].ring, bytes, MADV_HUGEPAGE);
#endif
        }
        w[q].seq = q;
        w[q].B = B;
        w[q].D = D;
        w[q].acc = acc;
        w[q].rounds = k;
        w[q].verify = rows; /* read only: both threads may share it */
        w[q].cap = (size_t)(B + 1) * row_bytes;
        w[q].out = malloc(w[q].cap);
        w[q].go = &go;
        w[q].cpu = cpus[q];
        for (int64_t i = 0; i < prefill; ++i) pos[i % 64] = i;
        if (model) ring_copy(&w[q], 0, prefill, (uint8_t*)rows, 1);
        else TRY(dspark_process(st, q, pos, (size_t)prefill, rows, DSPARK_DTYPE_F32, (size_t)(prefill * D) * sizeof(float)));
        w[q].n_past = w[q].staged = prefill;
        /* Warm-up: the ring wraps (no first touches later), the second sequence STAGGER rounds further. */
        rounds(&w[q], ring / (acc + 1) + 16 + q * stagger);
    }
    pin(cpus[0]);
    for (int64_t t = 0; t < trials; ++t) {
        /* 1 thread: both sequences' rounds in turn. */
        int64_t t0 = ns_of(CLOCK_MONOTONIC), c0 = ns_of(CLOCK_THREAD_CPUTIME_ID);
        rounds(&w[0], k);
        rounds(&w[1], k);
        printf("1 %lld %lld\n", (long long)(ns_of(CLOCK_MONOTONIC) - t0),
               (long long)(ns_of(CLOCK_THREAD_CPUTIME_ID) - c0));
        /* 2 threads: one per sequence, started together. */
        pthread_t th[2];
        pthread_barrier_init(&go, NULL, 3);
        for (int q = 0; q < 2; ++q) pthread_create(&th[q], NULL, thread_main, &w[q]);
        pthread_barrier_wait(&go);
        for (int q = 0; q < 2; ++q) pthread_join(th[q], NULL);
        /* The span from the first worker's start to the last one's end (the
         * main thread may be scheduled late after the barrier on 2 cores). */
        const int64_t first = w[0].t0_ns < w[1].t0_ns ? w[0].t0_ns : w[1].t0_ns;
        const int64_t last = w[0].t1_ns > w[1].t1_ns ? w[0].t1_ns : w[1].t1_ns;
        printf("2 %lld %lld\n", (long long)(last - first), (long long)(w[0].cpu_ns + w[1].cpu_ns));
        pthread_barrier_destroy(&go);
    }
    dspark_stager_destroy(st);
    free(w[0].ring);
    free(w[1].ring);
    free(rows);
    free(w[0].out);
    free(w[1].out);
    return 0;
}
