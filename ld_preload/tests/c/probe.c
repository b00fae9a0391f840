/* Run under LD_PRELOAD=libmemquota.so by ld_preload/tests/preload.rs.
 * probe MODE: entry | threads | fork | fork_exit | storm | oom | dlopen LIB
 * Prints "native_before=N native_after=M" where it checks exactness. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include "sampler.h"

/* Not all of these are declared (or defined) by this glibc: weak, so the preload's
 * definitions are what they resolve to, and the checks fail if it has none. */
#define W __attribute__((weak))
W void *__libc_malloc(size_t);
W void *__libc_calloc(size_t, size_t);
W void *__libc_realloc(void *, size_t);
W void __libc_free(void *);
W void *__libc_memalign(size_t, size_t);
W void *__libc_valloc(size_t);
W void *__libc_pvalloc(size_t);
W int __posix_memalign(void **, size_t, size_t);
W void cfree(void *);
W void free_sized(void *, size_t);
W void free_aligned_sized(void *, size_t, size_t);

static unsigned long long native(void) { return stat_of("native_bytes"); }

static void entry(void) {
    CHECK(__libc_malloc && __libc_calloc && __libc_realloc && __libc_free && __libc_memalign);
    CHECK(__libc_valloc && __libc_pvalloc && __posix_memalign && cfree && free_sized && free_aligned_sized);
    unsigned long long before = native();
    void *p[32]; int k = 0;
    p[k++] = malloc(100);
    p[k++] = calloc(10, 100);
    p[k++] = realloc(NULL, 300);
    p[k] = realloc(malloc(10), 5000); k++;
    p[k] = realloc(malloc(100000), 50); k++;
    p[k++] = reallocarray(NULL, 7, 9);
    p[k++] = aligned_alloc(64, 640);
    p[k++] = memalign(4096, 100);
    p[k++] = memalign(48, 100); /* not a power of two: rounded up, as glibc does */
    p[k++] = valloc(10);
    p[k++] = pvalloc(10);
    p[k++] = __libc_malloc(11);
    p[k++] = __libc_calloc(3, 3);
    p[k] = __libc_realloc(__libc_malloc(5), 500); k++;
    p[k++] = __libc_memalign(256, 10);
    p[k++] = __libc_valloc(10);
    p[k++] = __libc_pvalloc(5000);
    void *q = NULL;
    CHECK(posix_memalign(&q, 128, 1000) == 0); p[k++] = q;
    CHECK(__posix_memalign(&q, 32, 10) == 0); p[k++] = q;
    for (int i = 0; i < k; i++) CHECK(p[i] != NULL);
    CHECK(((uintptr_t)p[6] & 63) == 0 && ((uintptr_t)p[7] & 4095) == 0 && ((uintptr_t)p[8] & 63) == 0);
    CHECK(malloc_usable_size(p[0]) >= 100);
    CHECK(native() > before + 100000 / 100); /* counted */
    /* glibc semantics */
    errno = 0;
    CHECK(calloc(SIZE_MAX / 2, 4) == NULL && errno == ENOMEM);
    CHECK(reallocarray(NULL, SIZE_MAX / 2, 4) == NULL && errno == ENOMEM);
    CHECK(posix_memalign(&q, 24, 10) == EINVAL);
    CHECK(posix_memalign(&q, 3, 10) == EINVAL);
    errno = 0;
    CHECK(aligned_alloc(24, 48) == NULL && errno == EINVAL);
    CHECK(realloc(malloc(10), 0) == NULL);
    errno = 12345;
    free(NULL);
    free(p[--k]);
    CHECK(errno == 12345); /* free keeps errno */
    cfree(p[--k]);
    __libc_free(p[--k]);
    free_sized(p[--k], 0);
    free_aligned_sized(p[--k], 256, 10);
    while (k > 0) free(p[--k]);
    CHECK(mallopt(M_ARENA_MAX, 1) == 1);
    CHECK(malloc_trim(0) == 1);
    struct mallinfo2 mi = mallinfo2();
    CHECK(mi.uordblks > 0);
    unsigned long long after = native();
    printf("native_before=%llu native_after=%llu\n", before, after);
    CHECK(after == before);
}

#define THREADS 8
#define PER 20000
static void *slots[THREADS][PER];
static size_t sizes[THREADS][PER];
static void *alloc_thread(void *arg) {
    long t = (long)arg; unsigned s = 12345 + t;
    for (int i = 0; i < PER; i++) {
        s = s * 1103515245 + 12345;
        size_t n = (s >> 8) % 3 == 0 ? (s >> 4) % 70000 : (s >> 4) % 300;
        sizes[t][i] = n;
        slots[t][i] = (s & 1) ? malloc(n) : calloc(1, n);
    }
    return NULL;
}
static void *free_thread(void *arg) {
    long t = (long)arg;
    for (int i = 0; i < PER; i++) free(slots[(t + 1) % THREADS][i]); /* another thread's memory */
    return NULL;
}
static void run_threads(void *(*f)(void *)) {
    pthread_t th[THREADS];
    for (long t = 0; t < THREADS; t++) CHECK(pthread_create(&th[t], NULL, f, (void *)t) == 0);
    for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
}
/* glibc keeps exited threads' stacks, and their DTVs (allocated with calloc), in a
 * cache: a warm-up round fills it so the measured round allocates no new DTV. */
static void *idle(void *arg) { return arg; }
static void warm_thread_cache(int n) {
    pthread_t th[64];
    for (int i = 0; i < n; i++) CHECK(pthread_create(&th[i], NULL, idle, NULL) == 0);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
}

static void threads(void) {
    warm_thread_cache(THREADS);
    unsigned long long before = native();
    run_threads(alloc_thread);
    unsigned long long mid = native();
    run_threads(free_thread);
    unsigned long long after = native();
    printf("native_before=%llu native_after=%llu mid=%llu\n", before, after, mid);
    CHECK(mid > before + 1000000);
    CHECK(after == before);
}

static void forks(void) {
    void *keep = malloc(1 << 20);
    unsigned long long before = native();
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        unsigned long long c0 = native();
        void *p = malloc(3 << 20);
        CHECK(p != NULL && native() >= c0 + (3 << 20));
        free(p);
        CHECK(native() == c0);
        pthread_t th; /* a thread in the child works too */
        CHECK(pthread_create(&th, NULL, alloc_thread, (void *)0) == 0);
        pthread_join(th, NULL);
        _exit(0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    unsigned long long after = native();
    printf("native_before=%llu native_after=%llu\n", before, after);
    CHECK(after == before);
    free(keep);
}

/* A fork child that ends with exit(), not _exit(): it runs the atexit handlers it
 * inherited, the preload's exit report among them. Prints the parent's pid. */
static void fork_exit(void) {
    printf("parent %d\n", (int)getpid());
    fflush(stdout);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        free(malloc(3 << 20));
        exit(0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* A key created after the preload's: its destructor runs after the preload's exit
 * flush, and allocates and frees then. */
static pthread_key_t late_key;
static void late_destructor(void *p) {
    free(p);                       /* memory from the thread's life */
    void *q = malloc(5000);        /* and a fresh block, after the flush */
    free(q);
}
static void *short_life(void *arg) {
    (void)arg;
    void *a = malloc(1000), *b = malloc(100000);
    free(a);
    pthread_setspecific(late_key, malloc(777));
    return b; /* freed by the joiner */
}
static void storm(void) {
    CHECK(pthread_key_create(&late_key, late_destructor) == 0);
    warm_thread_cache(40);
    unsigned long long before = native();
    for (int round = 0; round < 50; round++) {
        pthread_t th[40];
        for (int i = 0; i < 40; i++) CHECK(pthread_create(&th[i], NULL, short_life, NULL) == 0);
        for (int i = 0; i < 40; i++) { void *r; pthread_join(th[i], &r); free(r); }
    }
    unsigned long long after = native();
    printf("native_before=%llu native_after=%llu\n", before, after);
    CHECK(after == before);
}

static void oom(void) {
    int got = 0;
    for (;;) {
        errno = 0;
        void *p = malloc(64 << 20);
        if (!p) { CHECK(errno == ENOMEM); break; }
        memset(p, 1, 4096);
        got++;
        CHECK(got < 100);
    }
    printf("granted=%d refused_errno=ENOMEM ooms=%llu\n", got, stat_of("oom_total"));
    CHECK(stat_of("oom_total") >= 1);
}

typedef int (*touch_fn)(int);
static touch_fn touch;
static void *tls_thread(void *arg) {
    long t = (long)arg;
    for (int i = 0; i < 100; i++) { void *p = malloc(64 + i); CHECK(touch((int)t + i) > 0); free(p); }
    return NULL;
}
static void dl(const char *lib) {
    pthread_t th[4];
    /* threads exist before the dlopen: their TLS for the library is set up lazily,
     * inside __tls_get_addr, which may call malloc. */
    void *h = dlopen(lib, RTLD_NOW);
    CHECK(h != NULL);
    touch = (touch_fn)dlsym(h, "tls_touch");
    CHECK(touch != NULL);
    for (long t = 0; t < 4; t++) CHECK(pthread_create(&th[t], NULL, tls_thread, (void *)t) == 0);
    for (int t = 0; t < 4; t++) pthread_join(th[t], NULL);
    CHECK(touch(1) > 0);
    printf("dlopen ok\n");
}

/* Allocates and frees until `stop` exists (at most 60 s), so that another process
 * can scrape the metrics endpoint meanwhile. */
static void serve(const char *stop) {
    for (int i = 0; i < 60000; i++) {
        void *p[64];
        for (int k = 0; k < 64; k++) p[k] = malloc(1000 + k * 100);
        for (int k = 0; k < 64; k++) free(p[k]);
        if (access(stop, F_OK) == 0) { printf("stopped\n"); return; }
        usleep(1000); /* pace the loop; the stop file is the synchronisation */
    }
    CHECK(!"never told to stop");
}

int main(int argc, char **argv) {
    CHECK(argc >= 2);
    wait_for_sampler(); /* before any base is taken */
    if (!strcmp(argv[1], "entry")) entry();
    else if (!strcmp(argv[1], "threads")) threads();
    else if (!strcmp(argv[1], "fork")) forks();
    else if (!strcmp(argv[1], "fork_exit")) fork_exit();
    else if (!strcmp(argv[1], "storm")) storm();
    else if (!strcmp(argv[1], "oom")) oom();
    else if (!strcmp(argv[1], "dlopen")) dl(argv[2]);
    else if (!strcmp(argv[1], "serve")) serve(argv[2]);
    else return 4;
    return 0;
}
