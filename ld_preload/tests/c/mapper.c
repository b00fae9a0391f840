/* Maps and touches anonymous memory itself, as a private allocator does, then asks
 * malloc for more. Under the preload the mapping is untracked memory: the sampler
 * sees it, and with MEMQUOTA_UNTRACKED=count it leaves less room for malloc.
 *
 *   mapper MAP_MIB ASK_MIB
 *
 * Prints: untracked=<bytes the stats showed> reclaims=<callback calls> malloc=granted|refused
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef void (*reclaim_fn)(size_t need, void *ctx);
static int reclaims;
static void on_reclaim(size_t need, void *ctx) {
    (void)need;
    (void)ctx;
    __atomic_add_fetch(&reclaims, 1, __ATOMIC_SEQ_CST);
}

static unsigned long long untracked(size_t (*stats)(char *, size_t)) {
    char buf[8192];
    if (!stats || stats(buf, sizeof buf) >= sizeof buf) return 0;
    const char *at = strstr(buf, "\"untracked_bytes\":");
    return at ? strtoull(at + strlen("\"untracked_bytes\":"), NULL, 10) : 0;
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    size_t map = (size_t)atoi(argv[1]) << 20, ask = (size_t)atoi(argv[2]) << 20;
    void (*on)(reclaim_fn, void *) = (void (*)(reclaim_fn, void *))dlsym(RTLD_DEFAULT, "memquota_on_reclaim");
    size_t (*stats)(char *, size_t) = (size_t(*)(char *, size_t))dlsym(RTLD_DEFAULT, "memquota_stats_json");
    if (on) on(on_reclaim, NULL);
    if (map) {
        char *m = mmap(NULL, map, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return 3;
        memset(m, 1, map);
    }
    /* Wait (bounded, 5 s) until a sample has seen most of the mapping. */
    unsigned long long seen = untracked(stats);
    for (int i = 0; map && stats && seen + (8u << 20) < map && i < 500; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
        seen = untracked(stats);
    }
    void *p = malloc(ask);
    if (p) memset(p, 2, ask);
    printf("untracked=%llu reclaims=%d malloc=%s\n", seen, __atomic_load_n(&reclaims, __ATOMIC_SEQ_CST),
           p ? "granted" : "refused");
    free(p);
    return 0;
}
