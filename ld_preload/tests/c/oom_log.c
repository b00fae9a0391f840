/* A server's allocator wrapper at its budget, the way an in-memory server's zmalloc
 * does it: on NULL the wrapper calls the server's out-of-memory handler, which writes
 * a crash report built in memory it allocates through the same wrapper (a header, an
 * info section grown piece by piece, the allocator's figures, then the whole text
 * joined), writes it to stderr and aborts. There is no recursion guard: if the
 * report's own allocations are refused too, the handler runs again inside itself, as
 * the server's does.
 *
 *   oom_log BLOCK   allocate BLOCK-byte blocks, kept, until one is refused
 *
 * Run by ld_preload/tests/limit.rs under LD_PRELOAD=libmemquota.so MEMQUOTA_LIMIT=64m.
 * The handler's report starts with the START marker and ends with the END marker; its
 * "memquota:" line holds memquota_stats_json's figures as they were while the handler
 * ran. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

size_t memquota_stats_json(char *buf, size_t len) __attribute__((weak));

#define START "=== SERVER OOM REPORT START ==="
#define END "=== SERVER OOM REPORT END ==="

static unsigned long long blocks, held;

static void *zmalloc(size_t n);

/* A string of its own, as the server's string library makes one. */
static char *zprintf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *s = zmalloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return s;
}

/* Appends to a string grown by doubling, as the server's INFO text grows. */
static char *zcat(char *s, size_t *cap, const char *more) {
    size_t len = strlen(s), add = strlen(more);
    if (len + add + 1 > *cap) {
        size_t grown = *cap;
        while (len + add + 1 > grown) grown *= 2;
        char *t = zmalloc(grown);
        memcpy(t, s, len + 1);
        free(s);
        s = t;
        *cap = grown;
    }
    memcpy(s + len, more, add + 1);
    return s;
}

static void oom_handler(size_t wanted) {
    /* The marker goes out first, from a stack buffer (stderr is unbuffered): one per
     * run of the handler, so the test counts them. */
    fprintf(stderr, "%s (%zu bytes wanted)\n", START, wanted);
    char *head = zprintf("server aborting for OUT OF MEMORY: allocating %zu bytes, pid %d\n", wanted, (int)getpid());
    size_t cap = 64;
    char *info = zmalloc(cap);
    info[0] = '\0';
    for (int i = 0; i < 48; i++) {
        char line[96];
        snprintf(line, sizeof line, "info_field_%02d:%llu\n", i, held / (unsigned long long)(i + 1));
        info = zcat(info, &cap, line);
    }
    char *figures = zmalloc(8192);
    strcpy(figures, "memquota: ");
    if (memquota_stats_json != NULL) memquota_stats_json(figures + 10, 8192 - 11);
    char *all = zprintf("%s# Memory\nused_memory:%llu\nblocks:%llu\n%s%s\n", head, held, blocks, info, figures);
    fputs(all, stderr);
    fprintf(stderr, "%s\n", END);
    abort();
}

static void *zmalloc(size_t n) {
    void *p = malloc(n);
    if (p == NULL) oom_handler(n);
    return p;
}

int main(int argc, char **argv) {
    size_t block = argc > 1 ? strtoull(argv[1], NULL, 10) : 1024;
    for (;;) {
        char *p = zmalloc(block);
        memset(p, 1, block);
        blocks++;
        held += block;
    }
}
