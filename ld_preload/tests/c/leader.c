/* A process whose main thread has ended while another thread runs: the main thread
 * calls pthread_exit, which leaves it a zombie in /proc ("Z") until the whole
 * process exits. The other thread reads its standard input until it closes, then
 * ends the process. */
#include <pthread.h>
#include <unistd.h>

static void *until_stdin_closes(void *arg) {
    char c;
    (void)arg;
    while (read(0, &c, 1) > 0) {
    }
    _exit(0);
}

int main(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, until_stdin_closes, NULL) != 0) {
        return 1;
    }
    pthread_exit(NULL);
}
