/* A program with a cache it can drop and memory it cannot, run by
 * ld_preload/tests/cgroup.rs in a memory cgroup of its own, with and without the
 * preload.
 *
 *   cgroup PINNED_MIB CACHE_MIB MAPPED_MIB BIG_MIB
 *
 * 1. Prints "ready limit=<the budget's limit, 0 without memquota>" and reads a line
 *    from stdin: the test has changed the cgroup's limit and writes the new one.
 *    Under memquota it waits (bounded) until the budget's limit has followed.
 * 2. Maps and touches MAPPED_MIB itself, as a private allocator does: memory the
 *    budget does not count (MEMQUOTA_UNTRACKED=report) but the cgroup does.
 * 3. Allocates PINNED_MIB in 8 MiB blocks it keeps and CACHE_MIB in 8 MiB blocks its
 *    reclaim callback may free, touching every page.
 * 4. Under memquota waits (bounded) for a first reclaim.
 * 5. Asks malloc for BIG_MIB and touches it.
 *
 * Prints "limit_after=<bytes> reclaims=<callback calls> big=granted|refused", then
 * "stats <the budget's JSON>". Without memquota nothing frees the cache.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define BLOCK (8u << 20)
#define MAX_BLOCKS 256

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static void *cache[MAX_BLOCKS];
static int cached;
static int reclaims;
static size_t (*stats)(char *, size_t);
static char json[16384];

/* Drops cached blocks until `need` bytes are freed. Never called while the main
 * thread holds the lock: the main thread takes it only around its own bookkeeping,
 * never around malloc. */
static void on_reclaim(size_t need, void *ctx) {
    (void)ctx;
    size_t freed = 0;
    pthread_mutex_lock(&lock);
    while (freed < need && cached > 0) {
        free(cache[--cached]);
        freed += BLOCK;
    }
    pthread_mutex_unlock(&lock);
    __atomic_add_fetch(&reclaims, 1, __ATOMIC_SEQ_CST);
}

static unsigned long long field(const char *name) {
    char key[64];
    snprintf(key, sizeof key, "\"%s\":", name);
    if (!stats || stats(json, sizeof json) >= sizeof json) return 0;
    const char *at = strstr(json, key);
    return at ? strtoull(at + strlen(key), NULL, 10) : 0;
}

/* Waits up to 10 s, in 10 ms steps, for `done` to hold: a bound on a condition the
 * program observes, not a timing assumption. */
static int wait_for(int (*done)(unsigned long long), unsigned long long arg) {
    for (int i = 0; i < 1000; i++) {
        if (done(arg)) return 1;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return done(arg);
}

static int limit_is(unsigned long long want) { return field("limit_bytes") == want; }
static int reclaimed(unsigned long long n) { return (unsigned long long)__atomic_load_n(&reclaims, __ATOMIC_SEQ_CST) >= n; }

static void *block(void) {
    void *p = malloc(BLOCK);
    if (p) memset(p, 1, BLOCK);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 5) return 2;
    size_t pinned = (size_t)atoi(argv[1]) << 20, cache_bytes = (size_t)atoi(argv[2]) << 20;
    size_t mapped = (size_t)atoi(argv[3]) << 20, big = (size_t)atoi(argv[4]) << 20;
    void (*on)(void (*)(size_t, void *), void *) = dlsym(RTLD_DEFAULT, "memquota_on_reclaim");
    stats = (size_t(*)(char *, size_t))dlsym(RTLD_DEFAULT, "memquota_stats_json");
    if (on) on(on_reclaim, NULL);

    printf("ready limit=%llu\n", field("limit_bytes"));
    fflush(stdout);
    unsigned long long new_limit = 0;
    if (scanf("%llu", &new_limit) != 1) return 3;
    if (stats && !wait_for(limit_is, new_limit)) {
        printf("the limit did not follow the cgroup's: %llu\n", field("limit_bytes"));
        return 4;
    }

    if (mapped) {
        char *m = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return 5;
        memset(m, 1, mapped);
    }
    static void *kept[MAX_BLOCKS];
    for (size_t i = 0; i < pinned / BLOCK && i < MAX_BLOCKS; i++) {
        if (!(kept[i] = block())) {
            printf("pinned block %zu refused\n", i);
            return 6;
        }
    }
    for (size_t i = 0; i < cache_bytes / BLOCK; i++) {
        void *p = block();
        if (!p) break;
        pthread_mutex_lock(&lock);
        if (cached < MAX_BLOCKS) cache[cached++] = p;
        pthread_mutex_unlock(&lock);
    }
    if (stats && !wait_for(reclaimed, 1)) {
        printf("no reclaim came: %s\n", json);
        return 7;
    }
    void *p = malloc(big);
    if (p) memset(p, 2, big);
    printf("limit_after=%llu reclaims=%d big=%s\n", field("limit_bytes"), __atomic_load_n(&reclaims, __ATOMIC_SEQ_CST),
           p ? "granted" : "refused");
    if (stats) printf("stats %s\n", json);
    return 0;
}
