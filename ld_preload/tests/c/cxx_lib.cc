// A C++ library that a C host loads with dlopen (tests/c/cxx_host.c): its C++ runtime
// is then the library's dependency, private to it under RTLD_LOCAL (how Python loads
// every C++ extension). Each function says what a refused `new` did.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <pthread.h>
#include <unistd.h>

// Where blocks go so that the compiler cannot elide a new/delete pair.
static char *volatile sink;

// A refused `new`, caught where the program expects it.
extern "C" const char *refused_new(void) {
    try {
        sink = new char[(size_t)1 << 30];
        delete[] sink;
        return "granted";
    } catch (const std::bad_alloc &) {
        return "caught";
    }
}

static char *reserve;
static int handler_calls;

// What a program's new-handler is for: give memory back, so that `new` tries again.
static void free_the_reserve() {
    handler_calls++;
    delete[] reserve;
    reserve = nullptr;
    std::set_new_handler(nullptr);
}

// A `new` refused while a 40 MiB reserve is held, granted once the program's
// new-handler frees it (the caller runs this under a 64 MiB limit).
extern "C" const char *new_handler_frees_a_reserve(void) {
    static char said[128];
    reserve = new char[40 << 20];
    std::memset(reserve, 1, 40 << 20);
    std::set_new_handler(free_the_reserve);
    try {
        sink = new char[48 << 20];
        std::memset(sink, 1, 48 << 20);
        delete[] sink;
        std::snprintf(said, sizeof said, "granted after %d handler call(s)", handler_calls);
    } catch (const std::bad_alloc &) {
        std::snprintf(said, sizeof said, "caught after %d handler call(s)", handler_calls);
    }
    return said;
}

// A thread's first throw, from a `new` in libstdc++'s own code (std::string's growth
// is compiled there): the runtime is looked up while every small malloc is refused
// (the loader allocates to open a dependency it has not opened by name before), and
// it throws on a thread whose exception state does not exist yet (for a runtime
// loaded by dlopen, dynamic TLS that glibc mallocs at first use; a NULL there is fatal:
// "cannot allocate memory for thread-local data").
static int go[2];
static const char *fresh_said;

static void *refuse_in_fresh_thread(void *) {
    char wait;
    if (read(go[0], &wait, 1) != 1) return nullptr;
    try {
        std::string s;
        s.reserve((size_t)1 << 30);
        fresh_said = "granted";
    } catch (const std::bad_alloc &) {
        fresh_said = "caught";
    }
    return nullptr;
}

// The account is filled with blocks from 1 MiB down to 16 bytes, each size until
// malloc returns NULL, so that a small malloc is refused too; the thread is made
// before (making one allocates) and refused after.
extern "C" const char *first_throw_of_a_thread_when_every_malloc_is_refused(void) {
    static void *held[4096];
    size_t n = 0;
    pthread_t thread;
    if (pipe(go) != 0 || pthread_create(&thread, nullptr, refuse_in_fresh_thread, nullptr) != 0)
        return "setup failed";
    for (size_t size = 1 << 20; size >= 16; size /= 2)
        while (n < 4096 && (held[n] = std::malloc(size)) != nullptr) n++;
    bool filled = n < 4096 && std::malloc(16) == nullptr;
    if (write(go[1], "g", 1) != 1) return "setup failed";
    pthread_join(thread, nullptr);
    while (n > 0) std::free(held[--n]);
    return filled ? fresh_said : "could not fill the account";
}
