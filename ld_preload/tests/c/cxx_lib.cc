// A C++ library that a C host loads with dlopen (tests/c/cxx_host.c): its C++ runtime
// is then the library's dependency, private to it under RTLD_LOCAL (how Python loads
// every C++ extension). Each function says what a refused `new` did.
#include <cstdio>
#include <cstring>
#include <new>

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
