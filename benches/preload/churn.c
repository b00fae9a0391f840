/* Multi-threaded malloc benchmark for LD_PRELOAD comparisons (benches/preload/run.sh).
 * churn THREADS OPS WORKLOAD   WORKLOAD: small | mixed | xthread
 * Prints ns per op (one malloc + one free) for the whole run: wall time, or with
 * CHURN_CLOCK=cpu the process's CPU time divided by the threads (time off the CPU,
 * on a machine other jobs load, then does not count). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RING 1024
static long ops;
static int workload;

static inline unsigned long next(unsigned long *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

static size_t size_for(unsigned long r) {
    if (workload == 1 && (r & 63) == 0) return 65536 + (r >> 8) % (1 << 20);  /* 1 in 64 large */
    return 16 + (r >> 8) % 241;
}

static void *worker(void *arg) {
    unsigned long s = 0x9E3779B97F4A7C15ul * (1 + (long)arg);
    void *ring[RING] = {0};
    for (long i = 0; i < ops; i++) {
        unsigned long r = next(&s);
        int k = r % RING;
        free(ring[k]);
        ring[k] = malloc(size_for(r));
        *(char *)ring[k] = 1;
    }
    for (int k = 0; k < RING; k++) free(ring[k]);
    return NULL;
}

/* xthread: thread 2i allocates batches, thread 2i+1 frees them. */
#define BATCH 256
#define SLOTS 64
struct lane { void *_Atomic batches[SLOTS][BATCH]; _Atomic long head, tail; };
static struct lane lanes[16];
static void *producer(void *arg) {
    struct lane *l = &lanes[(long)arg];
    unsigned long s = 12345 + (long)arg;
    for (long i = 0; i < ops / BATCH; i++) {
        while (l->head - l->tail >= SLOTS) sched_yield();
        long slot = l->head % SLOTS;
        for (int j = 0; j < BATCH; j++) { void *p = malloc(size_for(next(&s))); *(char *)p = 1; l->batches[slot][j] = p; }
        l->head++;
    }
    return NULL;
}
static void *consumer(void *arg) {
    struct lane *l = &lanes[(long)arg];
    for (long i = 0; i < ops / BATCH; i++) {
        while (l->tail == l->head) sched_yield();
        long slot = l->tail % SLOTS;
        for (int j = 0; j < BATCH; j++) free(l->batches[slot][j]);
        l->tail++;
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: churn THREADS OPS small|mixed|xthread\n"); return 2; }
    int threads = atoi(argv[1]);
    ops = atol(argv[2]);
    workload = !strcmp(argv[3], "mixed") ? 1 : !strcmp(argv[3], "xthread") ? 2 : 0;
    pthread_t th[32];
    const char *clk = getenv("CHURN_CLOCK");
    int cpu = clk && !strcmp(clk, "cpu");
    clockid_t id = cpu ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC;
    struct timespec a, b;
    clock_gettime(id, &a);
    if (workload == 2) {
        for (long t = 0; t < threads; t++) {
            pthread_create(&th[2 * t], NULL, producer, (void *)t);
            pthread_create(&th[2 * t + 1], NULL, consumer, (void *)t);
        }
        for (int t = 0; t < 2 * threads; t++) pthread_join(th[t], NULL);
    } else {
        for (long t = 0; t < threads; t++) pthread_create(&th[t], NULL, worker, (void *)t);
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    }
    clock_gettime(id, &b);
    double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    if (cpu) ns /= workload == 2 ? 2 * threads : threads;
    printf("%.3f\n", ns / ops);
    return 0;
}
