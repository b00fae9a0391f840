/* Two known sites of live memory under a 64 MiB limit: big_site holds 48 MiB in
 * 64 KiB blocks (the counted path), small_site 8 MiB in 2 KiB blocks (a lazy thread's
 * path straight into jemalloc); churn_site allocates and frees 256 MiB first, so it
 * holds nothing. Then 32 MiB are asked for and refused: the report on stderr names
 * the top sites. With the argument `hold`, nothing is refused: the sites' blocks are
 * held, "held" is printed, and the program waits for its stdin to close (a test reads
 * the heap profile from the metrics endpoint meanwhile). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__attribute__((noinline)) void *big_site(void) {
    void *p = malloc(64 << 10);
    if (p) memset(p, 1, 64 << 10);
    return p;
}

__attribute__((noinline)) void *small_site(void) {
    void *p = malloc(2 << 10);
    if (p) memset(p, 2, 2 << 10);
    return p;
}

__attribute__((noinline)) void churn_site(void) {
    void *p = malloc(64 << 10);
    if (p) memset(p, 3, 64);
    /* The block escapes: without it gcc -O1 deletes the malloc, memset and free as
     * dead (churn_site was a bare `ret`), and nothing was ever allocated here. */
    __asm__ volatile("" : : "r"(p) : "memory");
    free(p);
}

int main(int argc, char **argv) {
    static void *held[768 + 4096];
    for (int i = 0; i < 4096; i++) churn_site();
    for (int i = 0; i < 768; i++) held[i] = big_site();
    for (int i = 0; i < 4096; i++) held[768 + i] = small_site();
    if (argc > 1 && strcmp(argv[1], "hold") == 0) {
        printf("held\n");
        fflush(stdout);
        while (getchar() != EOF) {}
        for (int i = 0; i < 768 + 4096; i++) free(held[i]);
        return 0;
    }
    void *p = malloc(32 << 20);
    printf("32 MiB %s\n", p ? "granted" : "refused");
    for (int i = 0; i < 768 + 4096; i++) free(held[i]);
    free(p);
    return 0;
}
