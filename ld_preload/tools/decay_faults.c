/* Measurement tool (not part of the library): what jemalloc's purging costs. A loop
 * allocates 1-8 MiB, touches every page and frees it (four blocks live at a time),
 * then prints its minor page faults, peak RSS, time, and the RSS left once every
 * block is freed (what jemalloc keeps resident, outside any budget). Used for the purging
 * trade-off in docs/preload.md ("jemalloc's options: MALLOC_CONF").
 *
 *   gcc -O2 -o /tmp/decay_faults decay_faults.c
 *   LD_PRELOAD=$PWD/target/release/libmemquota.so MALLOC_CONF=dirty_decay_ms:0 /tmp/decay_faults
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* Resident bytes now, from /proc/self/statm. */
static double rss_mib(void) {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f || fscanf(f, "%ld %ld", &pages, &resident) != 2) return -1;
    fclose(f);
    return resident * (double)sysconf(_SC_PAGESIZE) / (1 << 20);
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 20000;
    unsigned s = 1;
    void *live[4] = {0};
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < rounds; i++) {
        s = s * 1103515245 + 12345;
        size_t n = (1 << 20) + (s >> 8) % (7 << 20);
        char *p = malloc(n);
        if (!p) return 1;
        for (size_t o = 0; o < n; o += 4096) p[o] = (char)i;
        free(live[i % 4]);
        live[i % 4] = p;
    }
    for (int i = 0; i < 4; i++) free(live[i]);
    clock_gettime(CLOCK_MONOTONIC, &b);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("minor faults %ld  peak RSS %.1f MiB  %.2f s  RSS after freeing all %.1f MiB\n", ru.ru_minflt,
           ru.ru_maxrss / 1024.0, (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9,
           rss_mib());
    return 0;
}
