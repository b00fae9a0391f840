/* What the preload's C test programs share: CHECK, memquota's figures (stat_of),
 * a monotonic clock (now_ms), and a wait for the sampler thread.
 *
 * memquota's sampler thread starts with the library. Its start frees a block the
 * loading thread allocated for it and allocates one of its own, each charged at once:
 * a program that checks memquota's count exactly takes its base once the sampler has
 * registered ("threads", which counts it, reaches 2), or one of those lands between
 * two of its checks (seen: 32 bytes short, on a loaded machine). wait_for_sampler
 * returns at once without the preload.
 *
 * Functions are static inline: a program that uses none of them compiles clean under
 * -Wall -Werror. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C"
#endif
size_t memquota_stats_json(char *buf, size_t len) __attribute__((weak));

/* A failed check names its line and exits 3. A program whose checks run where atexit
 * handlers must not (a forked child, a watchdog thread) defines CHECK_EXIT as _exit
 * before including this. */
#ifndef CHECK_EXIT
#define CHECK_EXIT exit
#endif
#define CHECK(c) do { if (!(c)) { fprintf(stderr, "CHECK failed line %d: %s\n", __LINE__, #c); CHECK_EXIT(3); } } while (0)

/* The figure `key` of memquota_stats_json (which flushes the calling thread first);
 * a missing preload or figure fails the check. */
static inline long long stat_of(const char *key) {
    char buf[8192], pat[64];
    CHECK(memquota_stats_json != NULL); /* the preload is really there */
    size_t n = memquota_stats_json(buf, sizeof buf);
    CHECK(n < sizeof buf);
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *at = strstr(buf, pat);
    CHECK(at != NULL);
    return strtoll(at + strlen(pat), NULL, 10);
}

/* Milliseconds on the monotonic clock. */
static inline double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static inline void wait_for_sampler(void) {
    if (memquota_stats_json == NULL) return;
    for (int i = 0; i < 30000; i++) { /* 30 s */
        char buf[8192];
        size_t n = memquota_stats_json(buf, sizeof buf);
        const char *at = n < sizeof buf ? strstr(buf, "\"threads\":") : NULL;
        if (at != NULL && strtoll(at + strlen("\"threads\":"), NULL, 10) >= 2) return;
        usleep(1000);
    }
    fprintf(stderr, "memquota's sampler thread did not start in 30 s\n");
    exit(3);
}
