/* Threads racing into the limit, each writing through the NULL it gets, as a program
 * that does not check does: the process dies on the first refused thread's write.
 *
 *   refusal_race THREADS BLOCK [held]
 *
 * THREADS threads meet at a barrier, then allocate BLOCK-byte blocks, kept, until one
 * is refused, and write through the NULL.
 *
 * With "held", the first refusal's report is held up until every thread has been
 * refused: before the threads start, stderr (a pipe the test reads) is filled up, so
 * the report cannot be written until the test reads the pipe, and a watcher thread
 * prints "refused=THREADS" on stdout once memquota has counted THREADS refusals; the
 * test starts reading stderr only then. A refused thread that returns while the report
 * is still being written kills the process before it is, and the watcher's line never
 * comes. Run by ld_preload/tests/limit.rs under LD_PRELOAD=libmemquota.so. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "sampler.h"

static pthread_barrier_t start;
static size_t block;

static void *racer(void *arg) {
    (void)arg;
    pthread_barrier_wait(&start);
    for (;;) {
        char *p = malloc(block);
        *(volatile char *)p = 1; /* no check: a NULL is a crash here */
        p[block - 1] = 1;
    }
    return NULL;
}

static unsigned long long refusals(void) {
    char buf[8192];
    size_t n = memquota_stats_json(buf, sizeof buf);
    CHECK(n < sizeof buf);
    const char *at = strstr(buf, "\"oom_total\":");
    CHECK(at != NULL);
    return strtoull(at + strlen("\"oom_total\":"), NULL, 10);
}

/* Fills the pipe on stderr: the next write to it waits for the reader. */
static void fill_stderr(void) {
    int flags = fcntl(2, F_GETFL);
    CHECK(flags >= 0 && fcntl(2, F_SETFL, flags | O_NONBLOCK) == 0);
    static const char line[] = "filler: the pipe is full until the test reads it .........\n";
    for (;;) {
        ssize_t n = write(2, line, sizeof line - 1);
        if (n < 0 && errno == EAGAIN) break;
        CHECK(n == (ssize_t)sizeof line - 1);
    }
    CHECK(fcntl(2, F_SETFL, flags) == 0);
}

int main(int argc, char **argv) {
    CHECK(argc >= 3);
    int threads = atoi(argv[1]);
    block = strtoull(argv[2], NULL, 10);
    int held = argc > 3 && strcmp(argv[3], "held") == 0;
    CHECK(threads > 0 && threads <= 64 && block > 0);
    CHECK(!held || memquota_stats_json != NULL);
    if (held) fill_stderr();
    pthread_t t[64];
    CHECK(pthread_barrier_init(&start, NULL, (unsigned)threads) == 0);
    for (int i = 0; i < threads; i++) CHECK(pthread_create(&t[i], NULL, racer, NULL) == 0);
    if (held) {
        /* The watcher: says when every racer has been refused. */
        while (refusals() < (unsigned long long)threads) usleep(1000); /* pacing */
        printf("refused=%d\n", threads);
        fflush(stdout);
    }
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    return 0; /* never reached: a racer crashes the process */
}
