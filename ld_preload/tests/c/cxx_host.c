/* A C host with no C++ runtime of its own, under the preload.
 *
 *   cxx_host local|global FUNCTION LIBRARY...
 *       dlopens each C++ LIBRARY (tests/c/cxx_lib.cc), RTLD_LOCAL or RTLD_GLOBAL, then
 *       calls FUNCTION of each in that order and prints what it says;
 *   cxx_host new
 *       calls the preload's operator new for 1 GiB with no C++ runtime loaded. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#define MAX_LIBRARIES 4

int main(int argc, char **argv) {
    /* The precondition of both: no C++ runtime before the libraries. */
    if (dlsym(RTLD_DEFAULT, "__cxa_throw") != NULL) {
        printf("the host has a C++ runtime of its own\n");
        return 3;
    }
    if (argc == 2 && strcmp(argv[1], "new") == 0) {
        void *(*operator_new)(size_t) = (void *(*)(size_t))dlsym(RTLD_DEFAULT, "_Znwm");
        if (operator_new == NULL) {
            printf("no operator new: run under the preload\n");
            return 3;
        }
        printf("operator new returned %p\n", operator_new((size_t)1 << 30));
        return 1;
    }
    if (argc < 4 || argc - 3 > MAX_LIBRARIES) {
        fprintf(stderr, "usage: %s local|global FUNCTION LIBRARY... | %s new\n", argv[0], argv[0]);
        return 2;
    }
    int global = strcmp(argv[1], "global") == 0;
    void *libs[MAX_LIBRARIES];
    for (int i = 3; i < argc; i++) {
        libs[i - 3] = dlopen(argv[i], RTLD_NOW | (global ? RTLD_GLOBAL : RTLD_LOCAL));
        if (libs[i - 3] == NULL) {
            fprintf(stderr, "dlopen: %s\n", dlerror());
            return 3;
        }
    }
    /* Loaded RTLD_LOCAL, the libraries' runtimes are invisible to RTLD_DEFAULT. */
    if ((dlsym(RTLD_DEFAULT, "__cxa_throw") != NULL) != global) {
        printf("__cxa_throw is %svisible to RTLD_DEFAULT\n", global ? "not " : "");
        return 3;
    }
    for (int i = 3; i < argc; i++) {
        const char *(*f)(void) = (const char *(*)(void))dlsym(libs[i - 3], argv[2]);
        if (f == NULL) {
            fprintf(stderr, "dlsym: %s\n", dlerror());
            return 3;
        }
        printf("%s %s: %s\n", argv[i], argv[2], f());
        fflush(stdout);
    }
    return 0;
}
