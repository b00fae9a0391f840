/* Measurement tool (not part of the library): an LD_PRELOAD shim over glibc that
 * counts malloc/calloc/realloc request sizes in power-of-two buckets and prints the
 * histogram and the largest request at exit. Used to choose the preload's default
 * MEMQUOTA_REFUSE_MIN; see docs/preload.md.
 *
 *   gcc -O2 -shared -fPIC -o /tmp/malloc_hist.so malloc_hist.c -ldl
 *   LD_PRELOAD=/tmp/malloc_hist.so java -version
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

static _Atomic unsigned long buckets[64];
static _Atomic size_t largest;

static void note(size_t n) {
    int b = n ? 63 - __builtin_clzl(n) : 0;
    atomic_fetch_add_explicit(&buckets[b], 1, memory_order_relaxed);
    size_t l = atomic_load_explicit(&largest, memory_order_relaxed);
    while (n > l && !atomic_compare_exchange_weak(&largest, &l, n)) {}
}

void *malloc(size_t n) { note(n); return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { note(a * b); return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { note(n); return __libc_realloc(p, n); }

__attribute__((destructor)) static void report(void) {
    char line[128];
    int len = snprintf(line, sizeof line, "malloc_hist pid %d: largest request %zu bytes\n", getpid(), largest);
    write(2, line, len);
    for (int b = 0; b < 64; b++) {
        if (!buckets[b]) continue;
        len = snprintf(line, sizeof line, "  [2^%2d, 2^%2d): %lu\n", b, b + 1, buckets[b]);
        write(2, line, len);
    }
}
