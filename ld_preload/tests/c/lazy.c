/* Run under LD_PRELOAD=libmemquota.so MEMQUOTA_LIMIT=1g by ld_preload/tests/preload.rs:
 * frees and small mallocs counted in bulk (ld_preload/src/malloc/lazy.rs). A thread is lazy
 * (its frees and its mallocs under 4 KiB are tail calls into jemalloc, counted every
 * interval by jemalloc's hook and at each flush) once it is loose and jemalloc's hook
 * has fired on it; each mode first makes its threads lazy and checks that they are
 * (each lazy thread adds its lag, the interval, to memquota's error bound), then
 * checks the counts.
 *
 * lazy threads | mallocs | realloc | past | scopes | limit. Prints "ok MODE" at the end. */
#define _GNU_SOURCE
#include "../../include/memquota.h"
#include "sampler.h"
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#pragma weak memquota_stats_json
#pragma weak memquota_flush
#pragma weak memquota_set_limit
#pragma weak memquota_scope_begin
#pragma weak memquota_scope_end
#pragma weak memquota_scope_attach
#pragma weak memquota_scope_detach

#define CHECKV(c, fmt, ...) do { if (!(c)) { fprintf(stderr, "CHECK failed line %d: %s: " fmt "\n", __LINE__, #c, __VA_ARGS__); exit(3); } } while (0)

/* MEMQUOTA_LIMIT=1g: the threshold (every thread's slack) is limit / 4096, the hook's
 * interval (every lazy thread's lag) half that. */
#define THRESHOLD (256ll << 10)
#define INTERVAL (THRESHOLD / 2)

static long long native(void) { return stat_of("native_bytes"); }
static long long error_bound(void) { return stat_of("error_bound_bytes"); }

/* memquota's sampler thread registers (its slack joins the error bound) once it has
 * started: the bounds below are measured after that (wait_for_sampler). */

/* glibc caches exited threads' stacks and DTVs: warm the cache so that the measured
 * rounds allocate none. */
static void *idle(void *arg) { return arg; }
static void warm_thread_cache(int n) {
    pthread_t th[16];
    for (int i = 0; i < n; i++) CHECK(pthread_create(&th[i], NULL, idle, NULL) == 0);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

/* Churns small blocks until the calling thread is lazy: jemalloc's hook has fired on
 * it (every interval allocated or freed) and a slow path has run since (every slack
 * allocated or freed). Balanced: it ends owing nothing it allocated. */
static void become_lazy(void) {
    void *ring[256] = {0};
    for (int i = 0; i < 200000; i++) {
        int k = i & 255;
        free(ring[k]);
        ring[k] = malloc(16 + (i * 37) % 600);
    }
    for (int k = 0; k < 256; k++) free(ring[k]);
}

static unsigned long next(unsigned long *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

/* ---- threads: many threads free blocks another allocated ------------------------ */

#define FREERS 4
#define PER (40000)
static void *blocks[FREERS][2][PER];
static long long usable_of[FREERS][2];
static pthread_barrier_t bar;

static void fill(int t, int round, unsigned long seed) {
    unsigned long s = seed;
    long long sum = 0;
    for (int i = 0; i < PER; i++) {
        unsigned long r = next(&s);
        size_t n = r % 97 == 0 ? 5000 + r % 60000 : 16 + r % 1000; /* small and medium */
        void *p = r & 1 ? malloc(n) : calloc(1, n);
        CHECK(p != NULL);
        blocks[t][round][i] = p;
        sum += malloc_usable_size(p);
    }
    usable_of[t][round] = sum;
}

/* A thread that only frees (after it became lazy): round 0 freed while it stays alive,
 * round 1 freed just before it exits without a flush of its own. */
static void *freer(void *arg) {
    long t = (long)arg;
    become_lazy();
    pthread_barrier_wait(&bar); /* 1: lazy */
    for (int i = 0; i < PER; i++) free(blocks[t][0][i]);
    pthread_barrier_wait(&bar); /* 2: round 0 freed, not flushed */
    pthread_barrier_wait(&bar); /* 3: main has looked */
    memquota_flush();
    pthread_barrier_wait(&bar); /* 4: flushed */
    pthread_barrier_wait(&bar); /* 5: main has looked */
    for (int i = 0; i < PER; i++) free(blocks[t][1][i]);
    return NULL;
}

static void threads(void) {
    warm_thread_cache(FREERS);
    wait_for_sampler();
    long long base = native(), bound0 = error_bound();
    for (int t = 0; t < FREERS; t++)
        for (int round = 0; round < 2; round++) fill(t, round, 0x9E3779B97F4A7C15ul * (t + 1) + round);
    long long held = 0;
    for (int t = 0; t < FREERS; t++) held += usable_of[t][0] + usable_of[t][1];
    CHECK(native() == base + held);
    CHECK(pthread_barrier_init(&bar, NULL, FREERS + 1) == 0);
    pthread_t th[FREERS];
    for (long t = 0; t < FREERS; t++) CHECK(pthread_create(&th[t], NULL, freer, (void *)t) == 0);
    pthread_barrier_wait(&bar); /* 1 */
    /* Each freer is live (its slack) and lazy (its lag). */
    long long bound = error_bound();
    CHECKV(bound >= bound0 + FREERS * (THRESHOLD + INTERVAL), "bound %lld, was %lld", bound, bound0);
    pthread_barrier_wait(&bar); /* 2 */
    /* Round 0 was freed lazily by threads that have not flushed: what memquota counts
     * is off by less than each thread's slack (what it allocated last, unflushed) and
     * lag (what it freed last, not credited), far from the 4 x ~35 MiB freed: the hook
     * credited them while they freed. */
    long long truth = base + held;
    for (int t = 0; t < FREERS; t++) truth -= usable_of[t][0];
    long long off = llabs(native() - truth);
    CHECKV(off < FREERS * (THRESHOLD + INTERVAL), "off by %lld", off);
    CHECKV(off <= error_bound(), "off by %lld, bound %lld", off, error_bound());
    pthread_barrier_wait(&bar); /* 3 */
    pthread_barrier_wait(&bar); /* 4 */
    /* Each flushed itself: exact. */
    CHECKV(native() == truth, "native %lld, true %lld", native(), truth);
    pthread_barrier_wait(&bar); /* 5 */
    for (int t = 0; t < FREERS; t++) pthread_join(th[t], NULL);
    /* Round 1 was freed lazily just before each thread exited: its exit flush counted
     * what it owed. */
    CHECKV(native() == base, "native %lld, base %lld", native(), base);
    CHECKV(error_bound() == bound0, "bound %lld, was %lld", error_bound(), bound0);
}

/* ---- realloc: realloc, calloc, aligned blocks, mixed with lazy frees ------------- */

#define WORKERS 3
#define RING 512
static void *rings[WORKERS][RING];

/* Each worker churns its own ring with every kind of call, then reallocs, grows,
 * shrinks and frees the blocks of the worker before it (across threads). */
static void *mixer(void *arg) {
    long t = (long)arg;
    unsigned long s = 77 + t;
    become_lazy();
    pthread_barrier_wait(&bar); /* 1: lazy */
    void **ring = rings[t];
    for (int i = 0; i < 300000; i++) {
        unsigned long r = next(&s);
        int k = r % RING;
        size_t n = r % 997 == 0 ? (2u << 20) + r % (2u << 20) : r % 61 == 0 ? 4096 + r % 300000 : 1 + r % 2000;
        switch ((r >> 20) % 8) {
        case 0: free(ring[k]); ring[k] = malloc(n); break;
        case 1: free(ring[k]); ring[k] = calloc(1, n); break;
        case 2: ring[k] = realloc(ring[k], n); break; /* null: malloc; grow, shrink, move */
        case 3: ring[k] = realloc(ring[k], 1 + n / 16); break;
        case 4: free(ring[k]); CHECK(posix_memalign(&ring[k], 64 << (r % 4), n) == 0); break;
        case 5: free(ring[k]); ring[k] = aligned_alloc(4096, 4096 * (1 + r % 4)); break;
        case 6: if (ring[k]) CHECK(realloc(ring[k], 0) == NULL); ring[k] = NULL; break; /* frees */
        default: free(ring[k]); ring[k] = NULL; break;
        }
        CHECK(ring[k] != NULL || (r >> 20) % 8 >= 6);
    }
    pthread_barrier_wait(&bar); /* 2: own rings churned */
    void **prev = rings[(t + WORKERS - 1) % WORKERS];
    for (int k = 0; k < RING; k++) {
        unsigned long r = next(&s);
        if (k % 3 == 0) prev[k] = realloc(prev[k], 1 + r % 200000); /* another thread's block */
        else if (k % 3 == 1) { free(prev[k]); prev[k] = NULL; }
    }
    memquota_flush();
    pthread_barrier_wait(&bar); /* 3: the previous worker's ring reworked, flushed */
    pthread_barrier_wait(&bar); /* 4: main has counted */
    for (int k = 0; k < RING; k++) free(prev[k]); /* lazily, then exit: no flush */
    return NULL;
}

static long long live_usable(void) {
    long long sum = 0;
    for (int t = 0; t < WORKERS; t++)
        for (int k = 0; k < RING; k++)
            if (rings[t][k]) sum += malloc_usable_size(rings[t][k]);
    return sum;
}

static void reallocs(void) {
    warm_thread_cache(WORKERS);
    wait_for_sampler();
    long long base = native(), bound0 = error_bound();
    CHECK(pthread_barrier_init(&bar, NULL, WORKERS + 1) == 0);
    pthread_t th[WORKERS];
    for (long t = 0; t < WORKERS; t++) CHECK(pthread_create(&th[t], NULL, mixer, (void *)t) == 0);
    pthread_barrier_wait(&bar); /* 1 */
    CHECKV(error_bound() >= bound0 + WORKERS * (THRESHOLD + INTERVAL), "bound %lld, was %lld", error_bound(), bound0);
    pthread_barrier_wait(&bar); /* 2 */
    pthread_barrier_wait(&bar); /* 3 */
    long long live = live_usable();
    CHECKV(native() == base + live, "native %lld, expected %lld", native(), base + live);
    pthread_barrier_wait(&bar); /* 4 */
    for (int t = 0; t < WORKERS; t++) pthread_join(th[t], NULL);
    CHECKV(native() == base, "native %lld, base %lld", native(), base);
}

/* One helper thread, `f`, which makes itself lazy and then waits at the barrier (1):
 * started after the thread cache is warm for `warm` threads and the sampler runs, with
 * the native total and error bound from before it (`base`, `bound0`); once it is lazy
 * the bound counts its lag too (its slack and its lag). */
static pthread_t start_lazy(void *(*f)(void *), int warm, long long *base, long long *bound0) {
    warm_thread_cache(warm);
    wait_for_sampler();
    *base = native();
    *bound0 = error_bound();
    CHECK(pthread_barrier_init(&bar, NULL, 2) == 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, f, NULL) == 0);
    pthread_barrier_wait(&bar); /* 1 */
    CHECKV(error_bound() >= *bound0 + THRESHOLD + INTERVAL, "bound %lld, was %lld", error_bound(), *bound0);
    return th;
}

/* ---- mallocs: small mallocs charged in bulk ------------------------------------- */

#define ALLOCS 30000
#define LOOK_EVERY 50
static void *held[ALLOCS];
static long long held_usable;

/* Lazy, it allocates blocks under 4 KiB (tail calls, charged in bulk; malloc and, one
 * in five, calloc) and from 4 KiB up (charged before they are taken) and holds them, stopping every LOOK_EVERY for
 * main to look; then it flushes; then it frees them all and exits without a flush. */
static void *allocator(void *arg) {
    (void)arg;
    unsigned long s = 4242;
    become_lazy();
    pthread_barrier_wait(&bar); /* 1: lazy */
    for (int i = 0; i < ALLOCS; i++) {
        unsigned long r = next(&s);
        size_t n = r % 5 == 0 ? 4096 + r % 20000 : 1 + r % 4095;
        if (r % 5 == 1) { /* calloc, lazy too under 4 KiB: count x size = n */
            size_t count = 1 + r % 3;
            n = 1 + r % (4095 / count);
            held[i] = calloc(count, n);
            CHECK(held[i] != NULL);
            for (size_t k = 0; k < count * n; k++) CHECK(((char *)held[i])[k] == 0);
        } else {
            held[i] = malloc(n);
        }
        CHECK(held[i] != NULL);
        held_usable += malloc_usable_size(held[i]);
        if (i % LOOK_EVERY == LOOK_EVERY - 1) {
            pthread_barrier_wait(&bar); /* main looks */
            pthread_barrier_wait(&bar);
        }
    }
    memquota_flush();
    pthread_barrier_wait(&bar); /* 2: flushed */
    pthread_barrier_wait(&bar); /* 3: main has looked */
    for (int i = 0; i < ALLOCS; i++) free(held[i]);
    return NULL;
}

/* While the allocator holds what it allocated and has not flushed, memquota counts
 * less than is held by less than its slack, at every look: what waits for the hook
 * (its lead) is kept out of its room for charges. Never lower, and the mallocs were
 * counted as they went (about 180 MiB in all), not only at the flush: exact after it,
 * and after its exit. */
static void mallocs(void) {
    long long base, bound0;
    pthread_t th = start_lazy(allocator, 1, &base, &bound0);
    long long worst = 0;
    for (int look = 0; look < ALLOCS / LOOK_EVERY; look++) {
        pthread_barrier_wait(&bar); /* the allocator waits */
        long long under = base + held_usable - native();
        /* Above by at most its lag: frees of become_lazy's ring, not yet credited. */
        CHECKV(under > -INTERVAL, "look %d: counted %lld more than is held", look, -under);
        CHECKV(under < THRESHOLD, "look %d: counted %lld less than is held, slack %lld", look, under, THRESHOLD);
        if (under > worst) worst = under;
        pthread_barrier_wait(&bar);
    }
    pthread_barrier_wait(&bar); /* 2 */
    CHECKV(native() == base + held_usable, "native %lld, held %lld", native(), base + held_usable);
    pthread_barrier_wait(&bar); /* 3 */
    pthread_join(th, NULL);
    CHECKV(native() == base, "native %lld, base %lld", native(), base);
    fprintf(stderr, "mallocs: at most %lld counted short while held, slack %lld\n", worst, THRESHOLD);
}

/* ---- scopes: a lazy thread once scopes exist ------------------------------------ */

#define BIG (4u << 20)
static void *handed;
static uint64_t task;

/* Lazy before any scope exists. Then, without a slow path of its own in between (its
 * flag still says lazy), it frees a big block a scope allocated: the block's owner
 * record must credit that scope, so the free must not be lazy. */
static void *late_freer(void *arg) {
    (void)arg;
    become_lazy();
    pthread_barrier_wait(&bar); /* 1: lazy */
    pthread_barrier_wait(&bar); /* 2: the scope's block is handed over */
    free(handed);
    pthread_barrier_wait(&bar); /* 3: freed */
    return NULL;
}

/* Lazy, it frees small blocks (owed, not credited), then attaches to a scope: what it
 * owed is the process's, not the scope's. */
static void *attacher(void *arg) {
    (void)arg;
    void *mine[64];
    for (int i = 0; i < 64; i++) mine[i] = malloc(1000); /* 1024 usable */
    become_lazy();
    pthread_barrier_wait(&bar); /* 1: lazy */
    for (int i = 0; i < 64; i++) free(mine[i]); /* 64 KiB owed, under the interval */
    CHECK(memquota_scope_attach(task) == 0);
    for (int i = 0; i < 64; i++) mine[i] = malloc(2000); /* the scope's */
    for (int i = 0; i < 32; i++) free(mine[i]);
    free(malloc(300 << 10)); /* past the interval: jemalloc's hook fires while attached */
    CHECK(memquota_scope_detach() == 0);
    pthread_barrier_wait(&bar); /* 2 */
    for (int i = 32; i < 64; i++) free(mine[i]); /* the scope's leak, freed after it ended */
    return NULL;
}

static void scopes(void) {
    char report[1024];
    long long base, bound0;
    pthread_t th = start_lazy(late_freer, 2, &base, &bound0);
    task = memquota_scope_begin("lazy-task", 1, 0);
    CHECK(task != 0);
    CHECK(memquota_scope_attach(task) == 0);
    handed = malloc(BIG);
    memset(handed, 1, 4096);
    CHECK(memquota_scope_detach() == 0);
    pthread_barrier_wait(&bar); /* 2 */
    pthread_barrier_wait(&bar); /* 3 */
    pthread_join(th, NULL);
    long long leaked = memquota_scope_end(task, report, sizeof report);
    CHECKV(leaked == 0, "the scope still holds %lld: %s", leaked, report);
    CHECKV(native() == base, "native %lld, base %lld", native(), base);

    task = memquota_scope_begin("attached-task", 2, 0);
    CHECK(task != 0);
    CHECK(pthread_create(&th, NULL, attacher, NULL) == 0);
    pthread_barrier_wait(&bar); /* 1 */
    pthread_barrier_wait(&bar); /* 2 */
    leaked = memquota_scope_end(task, report, sizeof report);
    CHECKV(leaked == 32 * 2048, "the scope holds %lld, not its 32 blocks: %s", leaked, report);
    pthread_join(th, NULL);
    CHECKV(native() == base, "native %lld, base %lld", native(), base);
}

/* ---- past: lazy reallocs that take the process past the limit --------------------- */

/* jemalloc's realloc adds the new size to the allocated total, fires that total's
 * event, then adds the old size to the freed total. Here every event fires inside a
 * realloc, one of them takes the account past the limit and turns the thread eager:
 * the old size its realloc frees must still be counted (memquota puts the hook off
 * until the call returns). */
#define GROWN 12000
static void *grown[GROWN];
static void *grower(void *arg) {
    (void)arg;
    for (int i = 0; i < GROWN; i++) CHECK((grown[i] = malloc(16)) != NULL);
    become_lazy();
    pthread_barrier_wait(&bar); /* 1: lazy, its blocks taken */
    pthread_barrier_wait(&bar); /* 2: main has filled the budget */
    for (size_t n = 500; n < 4096; n += 500)
        for (int i = 0; i < GROWN; i++) CHECK((grown[i] = realloc(grown[i], n)) != NULL);
    for (int i = 0; i < GROWN; i++) free(grown[i]);
    memquota_flush();
    pthread_barrier_wait(&bar); /* 3: freed, flushed */
    pthread_barrier_wait(&bar); /* 4: main has looked */
    return NULL;
}

static void past(void) {
    long long base, bound0;
    pthread_t th = start_lazy(grower, 1, &base, &bound0);
    /* The budget full but for 16 MiB (untouched pages: no resident cost); the reallocs
     * grow the thread's blocks by ~40 MiB. */
    size_t fill = (1ll << 30) - (size_t)native() - (16 << 20);
    void *big = malloc(fill);
    CHECK(big != NULL);
    long long overcommits = stat_of("overcommit_total");
    pthread_barrier_wait(&bar); /* 2 */
    pthread_barrier_wait(&bar); /* 3 */
    /* The precondition: the reallocs took the account past the limit. */
    CHECKV(stat_of("overcommit_total") > overcommits, "overcommits %lld, were %lld", stat_of("overcommit_total"),
           overcommits);
    free(big);
    memquota_flush();
    CHECKV(native() == base, "native %lld, base %lld", native(), base);
    pthread_barrier_wait(&bar); /* 4 */
    pthread_join(th, NULL);
    CHECKV(native() == base, "native %lld, base %lld", native(), base);
}

/* ---- limit: a lowered limit ends lazy frees ---------------------------------------- */

/* Lazy under 1g; once the limit is 128m (threshold 32 KiB, under twice the hook's
 * 128 KiB interval) its next slow path ends its lazy calls: no thread's lead or lag
 * passes its slack. */
static void *lowered(void *arg) {
    (void)arg;
    become_lazy();
    pthread_barrier_wait(&bar); /* 1: lazy */
    pthread_barrier_wait(&bar); /* 2: the limit is lowered */
    become_lazy();              /* slow paths: the new threshold, and no lazy frees */
    memquota_flush();
    pthread_barrier_wait(&bar); /* 3: flushed */
    pthread_barrier_wait(&bar); /* 4: main has looked */
    return NULL;
}

static void limit(void) {
    long long base, bound0;
    pthread_t th = start_lazy(lowered, 1, &base, &bound0);
    CHECK(memquota_set_limit(128ll << 20) == 0);
    pthread_barrier_wait(&bar); /* 2 */
    pthread_barrier_wait(&bar); /* 3 */
    /* The thread and the main thread (flushed by the call) have a 32 KiB slack and no
     * lag; memquota's own threads count at most their old 256 KiB slack. */
    long long bound = error_bound();
    CHECKV(bound <= bound0 - THRESHOLD + 2 * (32 << 10), "bound %lld, was %lld before the thread", bound, bound0);
    CHECKV(native() == base, "native %lld, base %lld", native(), base);
    pthread_barrier_wait(&bar); /* 4 */
    pthread_join(th, NULL);
    CHECKV(native() == base, "native %lld, base %lld", native(), base);
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    CHECK(memquota_flush != NULL && memquota_scope_begin != NULL);
    if (!strcmp(argv[1], "threads")) threads();
    else if (!strcmp(argv[1], "mallocs")) mallocs();
    else if (!strcmp(argv[1], "realloc")) reallocs();
    else if (!strcmp(argv[1], "past")) past();
    else if (!strcmp(argv[1], "scopes")) scopes();
    else if (!strcmp(argv[1], "limit")) limit();
    else return 4;
    printf("ok %s\n", argv[1]);
    return 0;
}
