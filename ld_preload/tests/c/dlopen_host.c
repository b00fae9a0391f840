/* Loads a library with dlopen, not LD_PRELOAD, so its constructor runs under the
 * dynamic loader's lock, as a JVM loading an -agentpath library does.
 *
 *   dlopen_host LIBRARY
 *       prints "loaded" (or dlerror's text) and exits. */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: dlopen_host LIBRARY\n");
        return 2;
    }
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    printf("%s\n", h ? "loaded" : dlerror());
    return h ? 0 : 1;
}
