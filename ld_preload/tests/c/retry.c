/* Run under LD_PRELOAD=libmemquota.so MEMQUOTA_LIMIT=256m by ld_preload/tests/preload.rs:
 * retry blocks through the C ABI (memquota_retry_begin / _end / _block,
 * memquota_last_refusal, memquota_scope_reserve's -EAGAIN and -E2BIG). Prints
 * key=value lines the test checks; a CHECK that fails exits with 3. Nothing is printed
 * while a thread is attached (stdio's buffer would be charged to its scope).
 * `retry ends` runs issue 30's cases instead: a scope ended under its blocked
 * threads, and a block ended by a thread-exit destructor after memquota's exit flush. */
#include "../../include/memquota.h"
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "sampler.h"

/* Weak: resolved from the preloaded library at load time (the program is linked
 * without it). */
#pragma weak memquota_scope_begin
#pragma weak memquota_scope_end
#pragma weak memquota_scope_attach
#pragma weak memquota_scope_detach
#pragma weak memquota_scope_reserve
#pragma weak memquota_scope_release
#pragma weak memquota_retry_begin
#pragma weak memquota_retry_end
#pragma weak memquota_retry_block
#pragma weak memquota_last_refusal
#pragma weak memquota_stats_json

#define MIB ((size_t)1 << 20)
#define TASKS 4

/* ---- the API's edges ---------------------------------------------------------- */

static void edges(void) {
    char report[512];
    /* Outside any block. */
    CHECK(memquota_retry_end() == -EPERM);
    CHECK(memquota_retry_block() == -EPERM);
    CHECK(memquota_last_refusal() == -EPERM);

    /* An ended scope: nothing begins, the thread is left as it was. */
    uint64_t gone = memquota_scope_begin("gone", 90, 0);
    CHECK(memquota_scope_end(gone, NULL, 0) == 0);
    CHECK(memquota_retry_begin(gone) == -EINVAL);
    CHECK(memquota_retry_begin(0) == -EINVAL);
    CHECK(memquota_scope_detach() == EINVAL); /* attached to nothing */
    CHECK(memquota_retry_end() == -EPERM);

    /* Nesting: each end gives back the scope its begin found. */
    uint64_t s1 = memquota_scope_begin("outer", 91, 0), s2 = memquota_scope_begin("inner", 92, 0);
    CHECK(memquota_scope_attach(s1) == 0);
    CHECK(memquota_retry_begin(s2) == 0);
    CHECK(memquota_retry_begin(s1) == 0);
    CHECK(memquota_retry_begin(s2) == 0);
    CHECK(memquota_last_refusal() == MEMQUOTA_REFUSAL_NONE);
    CHECK(memquota_retry_block() == 0); /* no rollback pending: at once */
    CHECK(memquota_retry_end() == 0);
    CHECK(memquota_retry_end() == 0);
    CHECK(memquota_retry_end() == 0);
    CHECK(memquota_retry_end() == -EPERM);
    CHECK(memquota_last_refusal() == -EPERM);
    /* Back in s1, where the thread was: a big block is charged to it, not to s2. */
    void *p = malloc(3 * MIB);
    CHECK(p != NULL);
    CHECK(memquota_scope_detach() == 0);
    int64_t leaked1 = memquota_scope_end(s1, report, sizeof report);
    int64_t leaked2 = memquota_scope_end(s2, report, sizeof report);
    free(p);
    printf("nested_leaked=%lld,%lld\n", (long long)leaked1, (long long)leaked2);

    /* Depth. */
    uint64_t s = memquota_scope_begin("deep", 93, 0);
    int depth = 0;
    while (depth < 100 && memquota_retry_begin(s) == 0) depth++;
    CHECK(memquota_retry_begin(s) == -EOVERFLOW);
    for (int i = 0; i < depth; i++) CHECK(memquota_retry_end() == 0);
    CHECK(memquota_retry_end() == -EPERM);
    CHECK(memquota_scope_end(s, NULL, 0) == 0);
    printf("max_depth=%d\n", depth);
}

/* A figure of the stats JSON (-1 if missing). */

/* A thread that exits inside a retry block leaves it. */
static void *exits_inside(void *scope) {
    CHECK(memquota_retry_begin(*(uint64_t *)scope) == 0);
    CHECK(memquota_retry_begin(*(uint64_t *)scope) == 0);
    return NULL;
}

/* ---- four tasks under a tight limit: a rollback ------------------------------- */

struct task {
    uint64_t id;
    int by_malloc;  /* take the memory with malloc, else with memquota_scope_reserve */
    int attempts;   /* attempts run */
    int rolled;     /* rollbacks seen: -EAGAIN, or NULL with MEMQUOTA_REFUSAL_ROLLBACK */
    int null_errno; /* errno of a NULL from malloc */
    int order;      /* finishing position */
};

static pthread_barrier_t held;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int finished;

/* 32 MiB for `scope`: a block (`*block`) or a reservation. 0, or how it was refused:
 * a MEMQUOTA_REFUSAL_* code. */
static int take(struct task *t, uint64_t scope, void **block) {
    if (t->by_malloc) {
        errno = 0;
        *block = malloc(32 * MIB);
        if (*block != NULL) return 0;
        t->null_errno = errno;
        return memquota_last_refusal();
    }
    *block = NULL;
    int64_t got = memquota_scope_reserve(scope, 32 * MIB, 0);
    if (got == (int64_t)(32 * MIB)) return 0;
    CHECK(got == -EAGAIN || got == -E2BIG);
    return got == -EAGAIN ? MEMQUOTA_REFUSAL_ROLLBACK : MEMQUOTA_REFUSAL_SPLIT;
}

static void give(uint64_t scope, void *block) {
    if (block != NULL) free(block);
    else memquota_scope_release(scope, 32 * MIB);
}

/* Each task takes 32 MiB, waits for all to hold theirs (its first attempt only), then
 * takes 32 MiB more. On a rollback it gives its first back, waits in BUFN, runs again. */
static void *task_main(void *arg) {
    struct task *t = arg;
    uint64_t scope = memquota_scope_begin("c-retry", t->id, 0);
    CHECK(scope != 0);
    CHECK(memquota_retry_begin(scope) == 0);
    for (;;) {
        t->attempts++;
        void *a = NULL, *b = NULL;
        int why = take(t, scope, &a);
        if (why == 0 && t->attempts == 1) pthread_barrier_wait(&held);
        if (why == 0) {
            why = take(t, scope, &b);
            if (why == 0) {
                give(scope, b);
                give(scope, a);
                break;
            }
            give(scope, a); /* the attempt frees what it holds */
        }
        CHECK(why == MEMQUOTA_REFUSAL_ROLLBACK);
        t->rolled++;
        CHECK(memquota_retry_block() == 0);
    }
    CHECK(memquota_retry_end() == 0);
    CHECK(memquota_scope_end(scope, NULL, 0) == 0);
    pthread_mutex_lock(&lock);
    t->order = finished++;
    pthread_mutex_unlock(&lock);
    return NULL;
}

static void rollbacks(const char *name, int by_malloc) {
    struct task tasks[TASKS];
    pthread_t th[TASKS];
    finished = 0;
    CHECK(pthread_barrier_init(&held, NULL, TASKS) == 0);
    for (int i = 0; i < TASKS; i++) {
        tasks[i] = (struct task){.id = (uint64_t)i, .by_malloc = by_malloc};
        CHECK(pthread_create(&th[i], NULL, task_main, &tasks[i]) == 0);
    }
    for (int i = 0; i < TASKS; i++) CHECK(pthread_join(th[i], NULL) == 0);
    pthread_barrier_destroy(&held);
    for (int i = 0; i < TASKS; i++) {
        printf("%s_task%d=attempts %d rolled %d order %d errno %d\n", name, i, tasks[i].attempts,
               tasks[i].rolled, tasks[i].order, tasks[i].null_errno);
    }
}

/* ---- one task, an input bigger than the room: splits --------------------------- */

static void splits(void) {
    uint64_t scope = memquota_scope_begin("c-split", 10, 0);
    CHECK(memquota_retry_begin(scope) == 0);

    /* 64 rows of 4 MiB, each piece's reservation at once; a piece told to split is
     * cut in two, the halves processed in order (a stack, the next piece last). */
    int todo[64][2], n = 0, done[64][2], d = 0, e2big = 0;
    todo[n][0] = 0, todo[n][1] = 64, n++;
    while (n > 0) {
        int lo = todo[n - 1][0], hi = todo[n - 1][1];
        n--;
        int64_t want = (int64_t)(hi - lo) * 4 * (int64_t)MIB;
        int64_t got = memquota_scope_reserve(scope, (uint64_t)want, 0);
        if (got == -E2BIG) {
            e2big++;
            CHECK(hi - lo >= 2 && n + 2 <= 64);
            int mid = lo + (hi - lo) / 2;
            todo[n][0] = mid, todo[n][1] = hi, n++;
            todo[n][0] = lo, todo[n][1] = mid, n++;
            continue;
        }
        CHECK(got == want);
        memquota_scope_release(scope, (uint64_t)got);
        done[d][0] = lo, done[d][1] = hi, d++;
    }

    /* malloc keeps NULL + ENOMEM; the thread can ask which refusal it was. 300 MiB is
     * more than the whole pool (the limit): it splits at once. */
    errno = 0;
    void *huge = malloc(300 * MIB);
    int huge_errno = errno, huge_why = memquota_last_refusal();
    CHECK(memquota_retry_block() == 0); /* a split is not a rollback: at once */
    int after_block = memquota_last_refusal();
    CHECK(malloc(300 * MIB) == NULL);
    CHECK(memquota_last_refusal() == MEMQUOTA_REFUSAL_SPLIT);

    /* A plain refusal: small blocks (under MEMQUOTA_REFUSE_MIN, which never wait)
     * until the over-commit bound refuses one. */
    static void *small[400];
    int k = 0;
    while (k < 400 && (small[k] = malloc(MIB)) != NULL) k++;
    int plain_why = memquota_last_refusal();
    for (int i = 0; i < k; i++) free(small[i]);

    CHECK(memquota_retry_end() == 0);
    CHECK(memquota_scope_end(scope, NULL, 0) == 0);
    printf("pieces=");
    for (int i = 0; i < d; i++) printf("%s%d..%d", i ? "," : "", done[i][0], done[i][1]);
    printf("\ne2big=%d\n", e2big);
    printf("huge=%s errno %d why %d after_block %d\n", huge == NULL ? "null" : "granted", huge_errno, huge_why,
           after_block);
    printf("plain=%s why %d\n", k < 400 ? "null" : "granted", plain_why);
}

/* ---- issue 30: ends that come from elsewhere ----------------------------------- */

/* A thread in a retry block of `scope` whose 200 MiB request blocks (by malloc, or
 * by reservation), and how its wait ended. */
struct waiter {
    uint64_t scope;
    int by_malloc;
    int64_t got; /* the reservation's result; for malloc 1 (granted) or 0 (NULL) */
    int err;     /* errno of malloc's NULL */
    int why;     /* memquota_last_refusal() after the request */
    long long woke;
};

static void *wait_in_block(void *arg) {
    struct waiter *w = arg;
    CHECK(memquota_retry_begin(w->scope) == 0);
    if (w->by_malloc) {
        errno = 0;
        void *p = malloc(200 * MIB);
        w->err = errno;
        w->got = p != NULL;
        free(p);
    } else {
        w->got = memquota_scope_reserve(w->scope, 200 * MIB, 0);
    }
    w->why = memquota_last_refusal();
    w->woke = now_ms();
    CHECK(memquota_retry_end() == 0);
    return NULL;
}

static pthread_barrier_t holder_in, holder_out;

/* Attached to the scope outside any retry block: it may free, so the scope is never
 * blocked and the machine never acts on its waiters. */
static void *hold_attached(void *scope) {
    CHECK(memquota_scope_attach(*(uint64_t *)scope) == 0);
    pthread_barrier_wait(&holder_in);
    pthread_barrier_wait(&holder_out);
    CHECK(memquota_scope_detach() == 0);
    return NULL;
}

/* 100 MiB held outside any scope: the scope's 200 MiB requests wait, for the watchdog
 * (10 s) at most, unless something ends them. The scope ends: both wake at once. */
static void ended_under_waiters(void) {
    void *outside = malloc(100 * MIB);
    CHECK(outside != NULL);
    uint64_t scope = memquota_scope_begin("ended under its waiters", 30, 0);
    pthread_t holder, th[2];
    CHECK(pthread_barrier_init(&holder_in, NULL, 2) == 0 && pthread_barrier_init(&holder_out, NULL, 2) == 0);
    CHECK(pthread_create(&holder, NULL, hold_attached, &scope) == 0);
    pthread_barrier_wait(&holder_in);
    struct waiter w[2] = {{.scope = scope, .by_malloc = 1}, {.scope = scope, .by_malloc = 0}};
    for (int i = 0; i < 2; i++) CHECK(pthread_create(&th[i], NULL, wait_in_block, &w[i]) == 0);
    while (stat_of("blocked_threads") < 2) sched_yield(); /* both wait in the machine */
    long long ended = now_ms();
    CHECK(memquota_scope_end(scope, NULL, 0) == 0);
    for (int i = 0; i < 2; i++) CHECK(pthread_join(th[i], NULL) == 0);
    pthread_barrier_wait(&holder_out);
    CHECK(pthread_join(holder, NULL) == 0);
    free(outside);
    printf("ended_malloc=granted %lld errno %d why %d ms %lld\n", (long long)w[0].got, w[0].err, w[0].why,
           w[0].woke - ended);
    printf("ended_reserve=got %lld why %d ms %lld\n", (long long)w[1].got, w[1].why, w[1].woke - ended);
}

static pthread_key_t late_key;
static long long threads_alive, threads_in_destructor;
static int late_end_rc = -1;

/* Runs after the preload's exit flush: its key was created before ours, and glibc runs
 * a thread's destructors in the order of their keys. */
static void end_block_late(void *value) {
    (void)value;
    threads_in_destructor = stat_of("threads");
    late_end_rc = memquota_retry_end();
}

/* Attached to `s` for its life, then in a retry block of `t`, which a destructor ends
 * after the exit flush: that must not put the dead thread back into `s`. */
static void *late_thread(void *scopes) {
    uint64_t *st = scopes;
    CHECK(memquota_scope_attach(st[0]) == 0);
    free(malloc(1000));
    CHECK(memquota_retry_begin(st[1]) == 0);
    threads_alive = stat_of("threads");
    CHECK(pthread_setspecific(late_key, st) == 0);
    return NULL;
}

static void block_ended_after_the_exit_flush(void) {
    CHECK(pthread_key_create(&late_key, end_block_late) == 0);
    uint64_t st[2] = {memquota_scope_begin("attached for life", 31, 0), memquota_scope_begin("late end", 32, 0)};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, late_thread, st) == 0);
    CHECK(pthread_join(th, NULL) == 0);
    CHECK(memquota_scope_end(st[1], NULL, 0) == 0);
    /* A scope idle after its work (no memory, no thread) leaves the fair share: a new
     * one may take 200 of the 256 MiB. One the dead thread stayed in narrows it. */
    uint64_t asker = memquota_scope_begin("asker", 33, 0);
    int64_t got = memquota_scope_reserve(asker, 200 * MIB, 1);
    CHECK(got > 0);
    memquota_scope_release(asker, (uint64_t)got);
    CHECK(memquota_scope_end(asker, NULL, 0) == 0);
    CHECK(memquota_scope_end(st[0], NULL, 0) == 0);
    printf("late_end=rc %d after_flush %d share %lld\n", late_end_rc, threads_in_destructor == threads_alive - 1,
           (long long)got);
}

int main(int argc, char **argv) {
    CHECK(memquota_retry_begin != NULL); /* the preload is really there */
    if (argc > 1 && strcmp(argv[1], "ends") == 0) {
        ended_under_waiters();
        block_ended_after_the_exit_flush();
        return 0;
    }
    edges();

    uint64_t left = memquota_scope_begin("left", 80, 0);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, exits_inside, &left) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    printf("exited_inside=running %lld blocks %lld\n", stat_of("retry_threads_running"),
           stat_of("retry_threads_blocked"));

    /* 100 MiB held outside any scope: with 4 x 32 MiB held in scopes, 28 MiB of the
     * 256 are left, and no task's second 32 MiB fits until one gives way. */
    void *outside = malloc(100 * MIB);
    CHECK(outside != NULL);
    rollbacks("reserve", 0);
    rollbacks("malloc", 1);
    splits();
    free(outside);
    CHECK(memquota_scope_end(left, NULL, 0) == 0);

    static char json[8192];
    memquota_stats_json(json, sizeof json);
    printf("stats=%s\n", json);
    return 0;
}
