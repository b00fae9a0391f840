/* Run under `memquota run` by cli/tests/run.rs (and for docs/img/timeline.svg).
 *
 *   workload exit CODE     allocate and free 64 MiB in 4 MiB blocks, print LD_PRELOAD,
 *                          exit with CODE
 *   workload refuse        ask for 256 MiB (run it with --limit 64m): exit 42 if malloc
 *                          returns NULL, 1 if it does not
 *   workload signal SIG    hold 32 MiB, wait until a stats file written after that
 *                          exists, then raise SIG on itself (exit 3 if none comes in 10 s)
 *   workload hold SECS     hold 32 MiB for SECS seconds, then exit 5 (for a signal to end it)
 *   workload timeline N    N paced steps (25 ms each) for --limit 256m: a pushed "heap"
 *                          that grows, a cache of 4 MiB blocks that the reclaim callback
 *                          shrinks, a 96 MiB request every 20 steps (room is made by a
 *                          reclaim) and a 320 MiB one every 25 (refused); exit 0
 *
 * The memquota C ABI is declared weak: the preload provides it. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024UL * 1024UL)
#define BLOCK (4 * MIB)

typedef void (*memquota_reclaim_fn)(size_t need, void *ctx);
void memquota_set_heap_bytes(uint64_t committed, uint64_t used) __attribute__((weak));
void memquota_on_reclaim(memquota_reclaim_fn callback, void *ctx) __attribute__((weak));

static void pause_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void *touched(size_t n) {
    char *p = malloc(n);
    if (p != NULL) {
        memset(p, 1, n);
    }
    return p;
}

static int run_exit(int code) {
    void *blocks[16];
    for (int i = 0; i < 16; i++) {
        blocks[i] = touched(BLOCK);
        if (blocks[i] == NULL) {
            fprintf(stderr, "workload: block %d refused\n", i);
            return 1;
        }
    }
    for (int i = 0; i < 16; i++) {
        free(blocks[i]);
    }
    const char *preload = getenv("LD_PRELOAD");
    printf("workload: allocated and freed 64 MiB; LD_PRELOAD=%s\n", preload ? preload : "");
    return code;
}

static int run_refuse(void) {
    void *p = malloc(256 * MIB);
    if (p == NULL) {
        printf("workload: malloc(256 MiB) returned NULL\n");
        return 42;
    }
    free(p);
    printf("workload: malloc(256 MiB) was granted\n");
    return 1;
}

static int run_signal(int sig) {
    const char *stats = getenv("MEMQUOTA_STATS_FILE");
    void *held[8];
    for (int i = 0; i < 8; i++) {
        held[i] = touched(BLOCK);
    }
    if (stats == NULL) {
        return 3;
    }
    /* The next file the preload writes shows the 32 MiB held: wait for it. */
    unlink(stats);
    struct stat st;
    int waited = 0;
    while (stat(stats, &st) != 0) {
        if (++waited > 2000) {
            fprintf(stderr, "workload: no stats file %s after 10 s\n", stats);
            return 3;
        }
        pause_ms(5);
    }
    fflush(stdout);
    raise(sig);
    (void)held;
    return 4; /* only if the signal did not end us */
}

static int run_hold(int secs) {
    void *held[8];
    for (int i = 0; i < 8; i++) {
        held[i] = touched(BLOCK);
    }
    for (int i = 0; i < secs * 100; i++) {
        pause_ms(10);
    }
    (void)held;
    return 5;
}

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static void *cache[64];
static int cached;

/* The reclaim callback: drops cached blocks until `need` bytes are freed. It may run
 * on another thread while main holds the lock: try, never wait. */
static void reclaim(size_t need, void *ctx) {
    (void)ctx;
    if (pthread_mutex_trylock(&cache_lock) != 0) {
        return;
    }
    size_t freed = 0;
    while (freed < need && cached > 0) {
        free(cache[--cached]);
        freed += BLOCK;
    }
    pthread_mutex_unlock(&cache_lock);
}

static int run_timeline(int steps) {
    if (memquota_on_reclaim != NULL) {
        memquota_on_reclaim(reclaim, NULL);
    }
    int granted = 0, refused = 0;
    for (int step = 1; step <= steps; step++) {
        uint64_t committed = (32 + (step < 64 ? step : 64)) * MIB;
        uint64_t used = committed / 2 + (uint64_t)(step % 10) * committed / 25;
        if (memquota_set_heap_bytes != NULL) {
            memquota_set_heap_bytes(committed, used);
        }
        void *p = touched(BLOCK);
        pthread_mutex_lock(&cache_lock);
        if (p != NULL && cached < 64) {
            cache[cached++] = p;
            p = NULL;
        }
        pthread_mutex_unlock(&cache_lock);
        free(p);
        if (step % 20 == 0 || step % 25 == 0) {
            size_t want = (step % 25 == 0 ? 320 : 96) * MIB;
            void *big = touched(want);
            big ? granted++ : refused++;
            free(big);
        }
        pause_ms(25);
    }
    printf("workload: %d steps, %d large requests granted, %d refused\n", steps, granted, refused);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 3 && strcmp(argv[1], "exit") == 0) {
        return run_exit(atoi(argv[2]));
    }
    if (argc == 2 && strcmp(argv[1], "refuse") == 0) {
        return run_refuse();
    }
    if (argc == 3 && strcmp(argv[1], "signal") == 0) {
        return run_signal(atoi(argv[2]));
    }
    if (argc == 3 && strcmp(argv[1], "hold") == 0) {
        return run_hold(atoi(argv[2]));
    }
    if (argc == 3 && strcmp(argv[1], "timeline") == 0) {
        return run_timeline(atoi(argv[2]));
    }
    fprintf(stderr, "usage: workload exit CODE | refuse | signal SIG | hold SECS | timeline STEPS\n");
    return 2;
}
