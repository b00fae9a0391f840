/* A thread that samples memquota's tracked total about every millisecond (pacing
 * only): the highest sample in max_sample, their count in samples. One at a time:
 * monitor_start resets both, monitor_end stops and joins it. Include after sampler.h
 * (it needs stat_of and CHECK). */
#include <pthread.h>
#include <stdatomic.h>

static atomic_int monitor_stop;
static atomic_ullong max_sample, samples;
static pthread_t monitor_thread;

static void *monitor(void *arg) {
    (void)arg;
    while (!atomic_load(&monitor_stop)) {
        unsigned long long n = stat_of("native_bytes");
        if (n > atomic_load(&max_sample)) atomic_store(&max_sample, n);
        atomic_fetch_add(&samples, 1);
        usleep(1000); /* pacing */
    }
    return NULL;
}

static void monitor_start(void) {
    atomic_store(&monitor_stop, 0);
    atomic_store(&max_sample, 0);
    atomic_store(&samples, 0);
    CHECK(pthread_create(&monitor_thread, NULL, monitor, NULL) == 0);
}

static void monitor_end(void) {
    atomic_store(&monitor_stop, 1);
    pthread_join(monitor_thread, NULL);
}
