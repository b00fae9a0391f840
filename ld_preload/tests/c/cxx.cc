// Sized and aligned new/delete keep the counters exact; a huge new throws bad_alloc.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>
#include <string>
#include "sampler.h"
static unsigned long long native() {
    char buf[4096];
    if (!memquota_stats_json) { std::puts("no preload"); std::exit(3); }
    memquota_stats_json(buf, sizeof buf);
    const char *at = std::strstr(buf, "\"native_bytes\":");
    return std::strtoull(at + 15, nullptr, 10);
}
struct alignas(64) Wide { char x[200]; };
struct alignas(256) Huge { char x[1000]; };
int main(int argc, char **argv) {
    wait_for_sampler(); // before the base is taken
    unsigned long long before = native();
    {
        std::vector<std::string> v;
        for (int i = 0; i < 10000; i++) v.emplace_back(std::string(i % 300, 'x'));
        Wide *w = new Wide; delete w;                         // aligned, sized delete
        Huge *h = new Huge[7]; delete[] h;                    // aligned array
        int *a = new int[1000]; delete[] a;
        long *l = new (std::nothrow) long(5); delete l;
        void *raw = ::operator new(123); ::operator delete(raw, 123);            // sized
        void *al = ::operator new(500, std::align_val_t(128));
        ::operator delete(al, 500, std::align_val_t(128));                       // sized aligned
        void *nt = ::operator new[](77, std::align_val_t(32), std::nothrow);
        ::operator delete[](nt, std::align_val_t(32), std::nothrow);
    }
    unsigned long long after = native();
    std::printf("native_before=%llu native_after=%llu\n", before, after);
    if (after != before) return 1;
    if (argc > 1) {  // "throw": a refused new throws std::bad_alloc
        try {
            char *p = new char[(size_t)1 << 40];
            std::printf("granted %p\n", (void *)p);
            return 1;
        } catch (const std::bad_alloc &e) {
            std::printf("bad_alloc caught: %s\n", e.what());
        }
    }
    return 0;
}
