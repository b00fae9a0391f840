/* memquota's sampler thread starts with the library. Its start frees a block the
 * loading thread allocated for it and allocates one of its own, each charged at once:
 * a program that checks memquota's count exactly takes its base once the sampler has
 * registered ("threads", which counts it, reaches 2), or one of those lands between
 * two of its checks (seen: 32 bytes short, on a loaded machine). Returns at once
 * without the preload. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C"
#endif
size_t memquota_stats_json(char *buf, size_t len) __attribute__((weak));

static void wait_for_sampler(void) {
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
