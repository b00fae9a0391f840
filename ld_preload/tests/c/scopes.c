/* Run under LD_PRELOAD=libmemquota.so by ld_preload/tests/preload.rs: drives the
 * scope C ABI. Prints key=value lines the test checks. Nothing is printed while a
 * thread is attached (stdio's buffer would be charged to the scope). */
#include "../../include/memquota.h"
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "sampler.h"

/* Weak: resolved from the preloaded library at load time (the program is linked
 * without it). */
#pragma weak memquota_scope_begin
#pragma weak memquota_scope_end
#pragma weak memquota_scope_attach
#pragma weak memquota_scope_detach
#pragma weak memquota_scope_reserve
#pragma weak memquota_scope_release

#define BIG (3u << 20)

static uint64_t task;

/* A helper thread working for the task: attached, it allocates a big block and
 * small ones, frees the small ones, and hands the big one back. */
static void *helper(void *arg) {
    (void)arg;
    CHECK(memquota_scope_attach(task) == 0);
    void *big = malloc(BIG);
    void *small[10];
    for (int i = 0; i < 10; i++) small[i] = malloc(1000);
    for (int i = 0; i < 10; i++) free(small[i]);
    CHECK(memquota_scope_detach() == 0);
    return big;
}

/* A thread in no scope frees what the task allocated. */
static void *freer(void *p) {
    free(p);
    return NULL;
}

int main(void) {
    char report[1024];
    CHECK(memquota_scope_begin != NULL); /* the preload is really there */
    task = memquota_scope_begin("c-task", 42, 1);
    CHECK(task != 0);
    CHECK(memquota_scope_detach() == EINVAL); /* not attached */

    /* The task's own thread. */
    static void *small[100];
    CHECK(memquota_scope_attach(task) == 0);
    for (int i = 0; i < 100; i++) small[i] = malloc(1000); /* 1024 usable each */
    void *big = malloc(BIG);
    CHECK(memquota_scope_detach() == 0);

    /* Cross-thread frees of big blocks credit the task. */
    pthread_t t;
    CHECK(pthread_create(&t, NULL, freer, big) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    void *big2 = NULL;
    CHECK(pthread_create(&t, NULL, helper, NULL) == 0);
    CHECK(pthread_join(t, &big2) == 0);
    CHECK(big2 != NULL);
    free(big2);

    /* Reservations. */
    int64_t got = memquota_scope_reserve(task, 8u << 20, 0);
    printf("reserve=%lld\n", (long long)got);
    CHECK(memquota_scope_release(task, 8u << 20) == 0);
    got = memquota_scope_reserve(task, 1u << 20, 1);
    printf("partial=%lld\n", (long long)got);
    /* Left reserved on purpose: the end report names it. */

    int64_t leaked = memquota_scope_end(task, report, sizeof report);
    printf("leaked=%lld\n", (long long)leaked);
    printf("report=%s\n", report);
    printf("end_again=%lld\n", (long long)memquota_scope_end(task, NULL, 0));
    printf("attach_ended=%d\n", memquota_scope_attach(task));
    printf("reserve_ended=%lld\n", (long long)memquota_scope_reserve(task, 1, 0));
    for (int i = 0; i < 100; i++) free(small[i]);

    /* Work outside any task, in a short-lived scope of its own. */
    uint64_t conv = memquota_scope_begin("conversion", 7, 0);
    CHECK(memquota_scope_attach(conv) == 0);
    char *buf = malloc(5u << 20);
    memset(buf, 1, 5u << 20);
    char *again = realloc(buf, 9u << 20);
    CHECK(again != NULL);
    free(again);
    CHECK(memquota_scope_detach() == 0);
    printf("conversion_leaked=%lld\n", (long long)memquota_scope_end(conv, report, sizeof report));
    return 0;
}
