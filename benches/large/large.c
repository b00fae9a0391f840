/* The large-block loop (benches/large/run.sh): each op frees a random one of a few
 * live blocks and allocates a new 1-8 MiB block in its place, writing one byte in
 * every 4 KiB page of it, as a query engine's batch buffers do. What jemalloc's page
 * purging costs shows here: a purged page is a page fault when it is used again.
 *
 *   large THREADS OPS [SLOTS]      (SLOTS live blocks per thread, default 4)
 *
 * Prints one line: ns per op (wall time / OPS per thread), minor page faults, peak
 * RSS in KiB, and the RSS in KiB once a worker has freed its blocks, before it exits
 * (what the allocator keeps resident, outside any budget; the largest any worker
 * saw). jemalloc purges an arena when its last thread exits, so that is measured
 * before.
 *
 *   gcc -O2 -pthread benches/large/large.c -o /tmp/large
 *   LD_PRELOAD=$PWD/target/release/libmemquota.so /tmp/large 1 3000
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

static long ops;
static int slots = 4;
static long rss_kib(void);
static _Atomic long freed_rss;

static inline unsigned long next(unsigned long *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

static void *worker(void *arg) {
    unsigned long s = 0x9E3779B97F4A7C15ul * (1 + (long)arg);
    char *live[64] = {0};
    for (long i = 0; i < ops; i++) {
        unsigned long r = next(&s);
        int k = r % slots;
        free(live[k]);
        size_t size = (1ul << 20) + (r >> 16) % (7ul << 20); /* 1 MiB to 8 MiB */
        char *p = malloc(size);
        if (!p) { fprintf(stderr, "malloc(%zu) failed\n", size); exit(1); }
        for (size_t off = 0; off < size; off += 4096) p[off] = (char)i;
        live[k] = p;
    }
    for (int k = 0; k < slots; k++) free(live[k]);
    long rss = rss_kib();
    for (long seen = freed_rss; rss > seen && !__atomic_compare_exchange_n(&freed_rss, &seen, rss, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);) {}
    return NULL;
}

/* Resident KiB now, from /proc/self/statm. */
static long rss_kib(void) {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return -1;
    if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = -1;
    fclose(f);
    return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: large THREADS OPS [SLOTS]\n"); return 2; }
    int threads = atoi(argv[1]);
    ops = atol(argv[2]);
    if (argc > 3) slots = atoi(argv[3]);
    if (threads < 1 || threads > 16 || ops < 1 || slots < 1 || slots > 64) { fprintf(stderr, "bad arguments\n"); return 2; }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    pthread_t t[16];
    for (long i = 0; i < threads; i++) pthread_create(&t[i], NULL, worker, (void *)i);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    printf("%.1f %ld %ld %ld\n", ns / ops, ru.ru_minflt, ru.ru_maxrss, (long)freed_rss);
    return 0;
}
