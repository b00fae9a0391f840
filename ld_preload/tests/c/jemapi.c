/* A program linked with Debian's libjemalloc (-ljemalloc) that uses jemalloc's own
 * API, the way Redis does. ld_preload/tests/preload.rs runs it without the preload
 * (Debian's jemalloc serves it) and with LD_PRELOAD=libmemquota.so (memquota's serves
 * every call), and compares stdout: it prints only what both must agree on.
 * Under the preload (memquota_stats_json resolves) it also checks memquota's count
 * after every call and says "memquota: exact ..." on stderr.
 * jemapi MODE: api | threads | oom | conf
 * Built with -DPROGRAM_MALLOC_CONF, it also compiles options in for the jemalloc it
 * links, the way jemalloc documents: memquota's jemalloc cannot read them, and says so. */
#define _GNU_SOURCE
#include <jemalloc/jemalloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include "sampler.h"

#ifdef PROGRAM_MALLOC_CONF
const char *malloc_conf = "narenas:1";
#endif

static int preloaded(void) { return memquota_stats_json != NULL; }

/* memquota's tracked native bytes (the calling thread flushed first); -1 without it. */
static long long native(void) {
    if (!preloaded()) return -1;
    char buf[4096];
    size_t n = memquota_stats_json(buf, sizeof buf);
    CHECK(n < sizeof buf);
    char *at = strstr(buf, "\"native_bytes\":");
    CHECK(at != NULL);
    return strtoll(at + strlen("\"native_bytes\":"), NULL, 10);
}

/* Under the preload: memquota counts exactly `expect` bytes more than at `base`. */
static long long base;
static long long expect;
#define COUNTED() do { if (preloaded()) { long long now_ = native() - base; \
    if (now_ != expect) { fprintf(stderr, "line %d: memquota counts %lld, live blocks %lld\n", \
        __LINE__, now_, expect); exit(3); } } } while (0)

static size_t ctl_size(const char *name) {
    size_t v = 0, len = sizeof v;
    CHECK(mallctl(name, &v, &len, NULL, 0) == 0);
    return v;
}
static unsigned ctl_unsigned(const char *name) {
    unsigned v = 0;
    size_t len = sizeof v;
    CHECK(mallctl(name, &v, &len, NULL, 0) == 0);
    return v;
}
static ssize_t ctl_ssize(const char *name) {
    ssize_t v = 0;
    size_t len = sizeof v;
    CHECK(mallctl(name, &v, &len, NULL, 0) == 0);
    return v;
}
static int ctl_bool(const char *name) {
    _Bool v = 0;
    size_t len = sizeof v;
    CHECK(mallctl(name, &v, &len, NULL, 0) == 0);
    return v;
}
static void refresh(void) {
    uint64_t epoch = 1;
    size_t len = sizeof epoch;
    CHECK(mallctl("epoch", &epoch, &len, &epoch, len) == 0);
}

static int all_zero(const unsigned char *p, size_t from, size_t to) {
    for (size_t i = from; i < to; i++)
        if (p[i]) return 0;
    return 1;
}

static void stats_cb(void *opaque, const char *s) { *(size_t *)opaque += strlen(s); }

static void api(void) {
    printf("api\n"); /* stdout's buffer, allocated before the count starts */
    base = native();
    expect = 0;

    /* mallocx: plain, aligned and zeroed, no tcache, big and aligned. */
    void *a = mallocx(100, 0);
    CHECK(a != NULL && sallocx(a, 0) == nallocx(100, 0));
    expect += sallocx(a, 0);
    COUNTED();
    unsigned char *b = mallocx(5000, MALLOCX_ALIGN(4096) | MALLOCX_ZERO);
    CHECK(b != NULL && ((uintptr_t)b & 4095) == 0 && all_zero(b, 0, 5000));
    CHECK(sallocx(b, 0) == nallocx(5000, MALLOCX_ALIGN(4096)));
    expect += sallocx(b, 0);
    COUNTED();
    void *c = mallocx(1 << 20, MALLOCX_TCACHE_NONE);
    CHECK(c != NULL);
    memset(c, 1, 1 << 20);
    expect += sallocx(c, 0);
    COUNTED();
    void *d = mallocx(3 << 20, MALLOCX_LG_ALIGN(16));
    CHECK(d != NULL && ((uintptr_t)d & 0xffff) == 0);
    expect += sallocx(d, 0);
    COUNTED();
    printf("mallocx sizes %zu %zu %zu %zu\n", sallocx(a, 0), sallocx(b, 0), sallocx(c, 0), sallocx(d, 0));
    /* Sizes both jemallocs class alike (5.3.1's large classes are finer than 5.3.0's). */
    printf("nallocx %zu %zu %zu %zu\n", nallocx(1, 0), nallocx(4097, 0), nallocx(100, MALLOCX_LG_ALIGN(12)),
           nallocx(4 << 20, MALLOCX_LG_ALIGN(16)));

    /* An arena of the program's own, through mallctl: the block lands in it. */
    unsigned arena = 0, found = 0;
    size_t len = sizeof arena;
    CHECK(mallctl("arenas.create", &arena, &len, NULL, 0) == 0);
    void *e = mallocx(200, MALLOCX_ARENA(arena) | MALLOCX_TCACHE_NONE);
    CHECK(e != NULL);
    expect += sallocx(e, 0);
    COUNTED();
    len = sizeof found;
    CHECK(mallctl("arenas.lookup", &found, &len, &e, sizeof e) == 0);
    printf("arena honoured %d\n", found == arena);

    /* rallocx: grow across classes, shrink, grow zeroed. */
    size_t old = sallocx(a, 0);
    a = rallocx(a, 10000, 0);
    CHECK(a != NULL);
    expect += (long long)sallocx(a, 0) - (long long)old;
    COUNTED();
    old = sallocx(a, 0);
    a = rallocx(a, 50, 0);
    CHECK(a != NULL);
    expect += (long long)sallocx(a, 0) - (long long)old;
    COUNTED();
    unsigned char *f = mallocx(64, 0);
    CHECK(f != NULL);
    expect += sallocx(f, 0);
    memset(f, 0xff, 64);
    old = sallocx(f, 0);
    f = rallocx(f, 8192, MALLOCX_ZERO);
    CHECK(f != NULL && f[63] == 0xff && all_zero(f, old, 8192));
    expect += (long long)sallocx(f, 0) - (long long)old;
    COUNTED();
    printf("rallocx sizes %zu %zu\n", sallocx(a, 0), sallocx(f, 0));

    /* xallocx: in place only. Shrink the 1 MiB block, grow it back, ask for
     * extra; it never moves, and its size is what xallocx says. */
    old = sallocx(c, 0);
    size_t r = xallocx(c, 512 << 10, 0, 0);
    CHECK(r == sallocx(c, 0));
    expect += (long long)r - (long long)old;
    COUNTED();
    int shrank = r < old;
    old = r;
    r = xallocx(c, 1 << 20, 0, 0);
    CHECK(r == sallocx(c, 0) && (r == old || r >= (1 << 20)));
    expect += (long long)r - (long long)old;
    COUNTED();
    if (preloaded()) CHECK(r >= (1 << 20)); /* memquota's jemalloc grows it in place */
    old = r;
    r = xallocx(c, 1 << 20, 256 << 10, MALLOCX_ZERO);
    CHECK(r == sallocx(c, 0) && r >= old && r <= (1 << 20) + (256 << 10));
    CHECK(all_zero(c, old, r));
    expect += (long long)r - (long long)old;
    COUNTED();
    old = sallocx(d, 0);
    r = xallocx(d, 1 << 20, 0, MALLOCX_LG_ALIGN(16));
    CHECK(r == sallocx(d, 0));
    expect += (long long)r - (long long)old;
    COUNTED();
    r = xallocx(a, 8, 0, 0); /* small: no change possible across classes */
    CHECK(r == sallocx(a, 0));
    printf("xallocx shrank %d, sizes consistent 1\n", shrank);

    /* Statistics through mallctl, by name and by MIB: the allocator that serves
     * this program's malloc is the one its mallctl reads. */
    refresh();
    size_t before = ctl_size("stats.allocated");
    void *g = malloc(8 << 20);
    CHECK(g != NULL);
    memset(g, 2, 8 << 20);
    expect += malloc_usable_size(g);
    COUNTED();
    refresh();
    size_t after = ctl_size("stats.allocated");
    size_t mib[4], miblen = 4, by_mib = 0;
    CHECK(mallctlnametomib("stats.allocated", mib, &miblen) == 0 && miblen == 2);
    len = sizeof by_mib;
    CHECK(mallctlbymib(mib, miblen, &by_mib, &len, NULL, 0) == 0);
    printf("stats.allocated sees malloc %d, by mib %d\n", after >= before + (6 << 20), by_mib == after);
    size_t printed = 0;
    malloc_stats_print(stats_cb, &printed, "J");
    printf("malloc_stats_print wrote %d\n", printed > 1000);

    /* dallocx and sdallocx, with the flags the blocks were allocated with. */
    expect -= sallocx(e, 0);
    dallocx(e, MALLOCX_TCACHE_NONE);
    COUNTED();
    expect -= sallocx(b, 0);
    sdallocx(b, 5000, MALLOCX_ALIGN(4096));
    COUNTED();
    expect -= sallocx(a, 0);
    sdallocx(a, 50, 0);
    COUNTED();
    expect -= sallocx(c, 0);
    dallocx(c, 0);
    COUNTED();
    expect -= sallocx(d, 0);
    sdallocx(d, sallocx(d, 0), MALLOCX_LG_ALIGN(16));
    COUNTED();
    expect -= sallocx(f, 0);
    dallocx(f, 0);
    COUNTED();
    expect -= malloc_usable_size(g);
    free(g);
    COUNTED();
    if (preloaded()) fprintf(stderr, "memquota: exact after api (%lld bytes at the start and the end)\n", base);
}

/* Blocks allocated on one thread, given back on another; threads whose first call
 * is sdallocx or mallocx. */
#define THREADS 4
#define PER 5000
static void *slots[THREADS][PER];
static size_t asked[THREADS][PER];
static int flags_of(unsigned s) {
    switch (s % 4) {
    case 0: return 0;
    case 1: return MALLOCX_ZERO;
    case 2: return MALLOCX_LG_ALIGN(6 + s % 7);
    default: return MALLOCX_TCACHE_NONE;
    }
}
static void *alloc_thread(void *arg) {
    long t = (long)arg;
    unsigned s = 777 + t;
    for (int i = 0; i < PER; i++) {
        s = s * 1103515245 + 12345;
        size_t n = 1 + ((s >> 8) % 5 == 0 ? (s >> 4) % 300000 : (s >> 4) % 600);
        asked[t][i] = n;
        slots[t][i] = mallocx(n, flags_of(i));
        CHECK(slots[t][i] != NULL);
        if (i % 3 == 0) {
            slots[t][i] = rallocx(slots[t][i], n * 2, flags_of(i));
            CHECK(slots[t][i] != NULL);
            asked[t][i] = n * 2;
        }
        if (i % 7 == 0) asked[t][i] = xallocx(slots[t][i], n + 5000, 0, flags_of(i));
    }
    return NULL;
}
static void *free_thread(void *arg) {
    long t = (long)arg, o = (t + 1) % THREADS; /* another thread's blocks */
    for (int i = 0; i < PER; i++) {
        if (i % 2) sdallocx(slots[o][i], asked[o][i], flags_of(i));
        else dallocx(slots[o][i], flags_of(i) & ~MALLOCX_ZERO);
    }
    return NULL;
}
static void *first_call_sdallocx(void *p) {
    sdallocx(p, 70000, 0);
    return NULL;
}
static void *first_call_mallocx(void *arg) {
    (void)arg;
    return mallocx(24, 0);
}
static void run(void *(*fn)(void *)) {
    pthread_t th[THREADS];
    for (long t = 0; t < THREADS; t++) CHECK(pthread_create(&th[t], NULL, fn, (void *)t) == 0);
    for (int t = 0; t < THREADS; t++) CHECK(pthread_join(th[t], NULL) == 0);
}
static void *idle(void *arg) { return arg; }

static void threads(void) {
    printf("threads\n");
    run(idle); /* glibc's thread cache: later threads allocate no new stacks or DTVs */
    base = native();
    expect = 0;
    run(alloc_thread);
    run(free_thread);
    COUNTED();
    pthread_t th;
    void *p = mallocx(70000, 0);
    CHECK(pthread_create(&th, NULL, first_call_sdallocx, p) == 0 && pthread_join(th, NULL) == 0);
    COUNTED();
    void *q = NULL;
    CHECK(pthread_create(&th, NULL, first_call_mallocx, NULL) == 0 && pthread_join(th, &q) == 0);
    CHECK(q != NULL);
    expect += sallocx(q, 0);
    COUNTED();
    dallocx(q, 0);
    expect = 0;
    COUNTED();
    printf("threads done\n");
    if (preloaded()) fprintf(stderr, "memquota: exact after threads\n");
}

/* Under MEMQUOTA_LIMIT=256m: refusals are NULL (or, for xallocx, no change). */
static void oom(void) {
    printf("oom\n");
    base = native();
    expect = 0;
    void *p = mallocx(512 << 20, 0);
    printf("mallocx refused %d\n", p == NULL);
    void *z = mallocx(300 << 20, MALLOCX_ZERO | MALLOCX_ALIGN(4096));
    printf("zeroed mallocx refused %d\n", z == NULL);
    void *q = mallocx(64 << 20, 0);
    CHECK(q != NULL);
    memset(q, 3, 64 << 20);
    expect += sallocx(q, 0);
    COUNTED();
    size_t had = sallocx(q, 0);
    void *r = rallocx(q, 512 << 20, 0);
    printf("rallocx refused %d, block kept %d\n", r == NULL, r == NULL && sallocx(q, 0) == had);
    if (r != NULL) { /* not refused: the program goes on with the moved block */
        expect += (long long)sallocx(r, 0) - (long long)had;
        q = r;
    }
    COUNTED();
    had = sallocx(q, 0);
    size_t x = xallocx(q, 512 << 20, 0, 0);
    printf("xallocx unchanged %d\n", x == had);
    x = xallocx(q, 64 << 20, 512 << 20, 0);
    printf("xallocx with extra unchanged %d\n", x == had);
    expect += (long long)sallocx(q, 0) - (long long)had;
    COUNTED();
    dallocx(q, 0);
    expect = 0;
    COUNTED();
    if (preloaded()) fprintf(stderr, "memquota: exact after oom\n");
}

/* What MALLOC_CONF set, read back through mallctl, and what it does: 32 MiB freed
 * in 1 MiB blocks stay dirty under decay, or are purged at once with
 * dirty_decay_ms:0. (Blocks from the "oversize" threshold on share one arena: 8 MiB
 * by jemalloc's default, 1 MiB by memquota's when it runs the purging.) */
static void conf(void) {
    printf("opt.oversize_threshold %zu\n", ctl_size("opt.oversize_threshold"));
    printf("opt.narenas %u\n", ctl_unsigned("opt.narenas"));
    printf("opt.dirty_decay_ms %zd\n", ctl_ssize("opt.dirty_decay_ms"));
    printf("opt.muzzy_decay_ms %zd\n", ctl_ssize("opt.muzzy_decay_ms"));
    printf("arenas.dirty_decay_ms %zd\n", ctl_ssize("arenas.dirty_decay_ms"));
    printf("opt.background_thread %d\n", ctl_bool("opt.background_thread"));
    refresh();
    size_t before = ctl_size("stats.allocated");
    void *blocks[32];
    for (int i = 0; i < 32; i++) {
        blocks[i] = malloc(1 << 20);
        CHECK(blocks[i] != NULL);
        memset(blocks[i], 4, 1 << 20);
    }
    refresh();
    /* Most of it: flushing thread caches may give back a few KiB of earlier frees. */
    printf("stats.allocated sees malloc %d\n", ctl_size("stats.allocated") >= before + (24 << 20));
    for (int i = 0; i < 32; i++) free(blocks[i]);
    refresh();
    size_t dirty = ctl_size("stats.arenas.4096.pdirty"); /* MALLCTL_ARENAS_ALL */
    printf("dirty pages after free %s\n", dirty >= (16 << 20) / 4096 ? "kept" : dirty == 0 ? "none" : "few");
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "api";
    wait_for_sampler(); /* before any base is taken */
    if (!strcmp(mode, "api")) api();
    else if (!strcmp(mode, "threads")) threads();
    else if (!strcmp(mode, "oom")) oom();
    else if (!strcmp(mode, "conf")) conf();
    else { fprintf(stderr, "unknown mode %s\n", mode); return 2; }
    return 0;
}
