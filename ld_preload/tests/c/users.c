/* Programs that behave like those a user found: they keep allocating after malloc
 * returns NULL. Run under LD_PRELOAD=libmemquota.so by ld_preload/tests/limit.rs.
 *
 *   users loop SIZE COUNT [HOW]
 *                             malloc(SIZE) COUNT times, keeping every block; HOW
 *                             calloc: calloc(1, SIZE) instead (checked zeroed);
 *                             realloc: malloc(16) grown by realloc to SIZE (a
 *                             block whose realloc was refused is grown again
 *                             next time, so past the limit realloc is refused)
 *   users handler ROUNDS      a server at its budget whose out-of-memory handler
 *                             allocates (and so runs out of memory itself, and nests)
 *   users hammer THREADS MS   THREADS threads allocate 1 KiB - 1 MiB blocks for MS ms
 *
 * A monitor thread samples the tracked total about every millisecond. The last line
 * on stdout is "key=value ..." for the test to parse: what the program saw. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "sampler.h"
#include "monitor.h"

static void *volatile sink;

/* ---- loop ---- */
enum how { BY_MALLOC, BY_CALLOC, BY_REALLOC };

/* One block of `size` bytes made `how`; NULL when refused (each refusal counted in
 * `nulls`). */
static void *one_block(size_t size, enum how how, unsigned long long *nulls) {
    void *p;
    errno = 0; /* so that the ENOMEM checked below is this call's */
    if (how == BY_CALLOC) {
        p = calloc(1, size);
        if (p && size > 0) CHECK(((unsigned char *)p)[0] == 0 && ((unsigned char *)p)[size - 1] == 0);
    } else if (how == BY_REALLOC) {
        static void *first; /* kept from a refused realloc, grown again next time */
        if (!first && !(first = malloc(16))) {
            CHECK(errno == ENOMEM);
            ++*nulls;
            return NULL;
        }
        errno = 0;
        p = realloc(first, size);
        if (p) first = NULL;
    } else {
        p = malloc(size);
    }
    if (!p) {
        CHECK(errno == ENOMEM);
        ++*nulls;
    }
    return p;
}

static void loop(size_t size, long count, enum how how) {
    unsigned long long granted = 0, nulls = 0;
    monitor_start();
    double t0 = now_ms();
    for (long i = 0; i < count; i++) {
        void *p = one_block(size, how, &nulls);
        if (!p) continue;
        granted += size;
        sink = p; /* kept (leaked) on purpose, as the program that keeps going does */
    }
    double ms = now_ms() - t0;
    monitor_end();
    printf("granted=%llu nulls=%llu threads=2 ms=%.0f max_sample=%llu samples=%llu\n", granted, nulls, ms,
           atomic_load(&max_sample), atomic_load(&samples));
}

/* ---- handler ---- */
/* A server's allocation wrapper: on NULL it runs its out-of-memory handler, which
 * builds a crash report in memory it allocates through the same wrapper; if that
 * fails the handler runs again inside itself, down to the server's own guard. */
static int depth, max_depth;
static unsigned long long handler_calls, nulls_seen;
static void *xmalloc(size_t n);
static void out_of_memory(size_t n) {
    handler_calls++;
    if (depth >= 100) return; /* the server's own recursion guard */
    depth++;
    if (depth > max_depth) max_depth = depth;
    char *report = xmalloc(16384);
    if (report) {
        snprintf(report, 16384, "out of memory: %zu bytes wanted at depth %d", n, depth);
        char *copy = xmalloc(strlen(report) + 1);
        if (copy) {
            strcpy(copy, report);
            free(copy);
        }
        free(report);
    }
    depth--;
}
static void *xmalloc(size_t n) {
    void *p = malloc(n);
    if (!p) {
        nulls_seen++;
        out_of_memory(n);
    }
    return p;
}
static void handler(long rounds) {
    /* The server's small allocations (sessions, caches) have filled the budget: the
     * handler's own 16 KiB is refused too. Then requests of 8 MiB kept in a ring of
     * 16: 128 MiB wanted, so every round is refused and runs the handler. */
    void *ring[16] = {0};
    monitor_start();
    double t0 = now_ms();
    for (;;) {
        void *p = malloc(4096);
        if (!p) {
            nulls_seen++;
            break;
        }
        sink = p; /* the server's own, kept */
    }
    for (long i = 0; i < rounds; i++) {
        int k = (int)(i % 16);
        free(ring[k]);
        ring[k] = xmalloc(8 << 20);
    }
    double ms = now_ms() - t0;
    for (int k = 0; k < 16; k++) free(ring[k]);
    monitor_end();
    printf("nulls=%llu handler_calls=%llu max_depth=%d threads=2 ms=%.0f max_sample=%llu samples=%llu\n", nulls_seen,
           handler_calls, max_depth, ms, atomic_load(&max_sample), atomic_load(&samples));
}

/* ---- hammer ---- */
#define MAX_THREADS 64
static double hammer_until;
static atomic_ullong hammer_nulls, hammer_granted;
static void *hammer_thread(void *arg) {
    uint64_t s = 0x9e3779b97f4a7c15ULL * (uint64_t)((long)arg + 1);
    void *ring[16] = {0};
    unsigned long long nulls = 0, granted = 0;
    for (long i = 0; now_ms() < hammer_until; i++) {
        s ^= s >> 12; s ^= s << 25; s ^= s >> 27;
        size_t n = 1024 + (size_t)((s * 0x2545f4914f6cdd1dULL) % ((1 << 20) - 1024));
        int k = (int)(i % 16);
        free(ring[k]);
        ring[k] = malloc(n);
        if (ring[k]) granted += n; else nulls++;
    }
    for (int k = 0; k < 16; k++) free(ring[k]);
    atomic_fetch_add(&hammer_nulls, nulls);
    atomic_fetch_add(&hammer_granted, granted);
    return NULL;
}
static void hammer(int threads, int ms) {
    pthread_t th[MAX_THREADS];
    CHECK(threads > 0 && threads <= MAX_THREADS);
    monitor_start();
    double t0 = now_ms();
    hammer_until = t0 + ms;
    for (long t = 0; t < threads; t++) CHECK(pthread_create(&th[t], NULL, hammer_thread, (void *)t) == 0);
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    double took = now_ms() - t0;
    monitor_end();
    printf("granted=%llu nulls=%llu threads=%d ms=%.0f max_sample=%llu samples=%llu\n",
           atomic_load(&hammer_granted), atomic_load(&hammer_nulls), threads + 2, took, atomic_load(&max_sample),
           atomic_load(&samples));
}

int main(int argc, char **argv) {
    CHECK(argc >= 3);
    CHECK(memquota_stats_json != NULL); /* the preload is really there */
    setvbuf(stdout, NULL, _IONBF, 0);
    if (!strcmp(argv[1], "loop") && (argc == 4 || argc == 5)) {
        const char *how = argc == 5 ? argv[4] : "malloc";
        enum how h = !strcmp(how, "calloc") ? BY_CALLOC : !strcmp(how, "realloc") ? BY_REALLOC : BY_MALLOC;
        if (h == BY_MALLOC && strcmp(how, "malloc")) return 4;
        loop(strtoul(argv[2], NULL, 10), atol(argv[3]), h);
    }
    else if (!strcmp(argv[1], "handler")) handler(atol(argv[2]));
    else if (!strcmp(argv[1], "hammer") && argc == 4) hammer(atoi(argv[2]), atoi(argv[3]));
    else return 4;
    return 0;
}
