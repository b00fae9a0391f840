/* A server that forks a process per connection, run under the preload by
 * cli/tests/run.rs for `memquota stat` over a process tree.
 *
 *   forking_server N BLOCKS   forks N "connections"; each asks for BLOCKS blocks of
 *                             8 MiB (held, touched), counts the NULLs it gets, prints
 *                             "refused <count>" and exits 0; the parent waits for
 *                             them all, then does the same itself.
 *
 * Every process ends with exit(), so the preload writes its stats file at exit. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define BLOCK (8UL << 20)

static int connection(int blocks) {
    void *held[256];
    int refused = 0, n = 0;
    for (int i = 0; i < blocks && i < 256; i++) {
        void *p = malloc(BLOCK);
        if (!p) {
            refused++;
            continue;
        }
        memset(p, 1, BLOCK);
        held[n++] = p;
    }
    printf("refused %d\n", refused);
    fflush(stdout);
    for (int i = 0; i < n; i++) free(held[i]);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: forking_server N BLOCKS\n");
        return 2;
    }
    int n = atoi(argv[1]), blocks = atoi(argv[2]);
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid < 0) return 3;
        if (pid == 0) exit(connection(blocks));
        int status;
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 4;
    }
    return connection(blocks);
}
