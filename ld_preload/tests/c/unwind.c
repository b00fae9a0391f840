/* A profiler's view of malloc and free: backtrace() from a signal handler while the
 * interrupted PC is inside them must reach their caller. Deterministic: the trap flag
 * single-steps the call, so the handler runs on every instruction of the entry.
 *
 * For each of malloc and free: the number of instructions stepped inside the entry,
 * and how many of those backtraces held the caller's return address. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>

#define TRAP_FLAG 0x100

/* The entry being stepped, and what the handler saw of it. */
static uintptr_t entry;
static uintptr_t caller_ra;
static volatile int inside, unwound, left;

/* The entries are 64-byte aligned and shorter than a line: a PC in [entry, entry + 64)
 * is inside the entry; the first outside it is past its jump. */
static void on_step(int sig, siginfo_t *info, void *ctx) {
    (void)sig;
    (void)info;
    ucontext_t *uc = ctx;
    uintptr_t pc = (uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
    if (pc - entry < 64) {
        if (pc == entry) /* first instruction: the return address is on top of the stack */
            caller_ra = *(uintptr_t *)uc->uc_mcontext.gregs[REG_RSP];
        inside++;
        void *frames[64];
        int n = backtrace(frames, 64);
        for (int i = 0; i < n; i++)
            if ((uintptr_t)frames[i] == caller_ra) {
                unwound++;
                break;
            }
    } else if (inside > 0) {
        left = 1;
        uc->uc_mcontext.gregs[REG_EFL] &= ~TRAP_FLAG;
    }
}

static void step_on(void) { __asm__ volatile("pushfq; orq %0, (%%rsp); popfq" ::"i"(TRAP_FLAG) : "memory", "cc"); }

static void *(*volatile malloc_fn)(size_t);
static void (*volatile free_fn)(void *);

static void report(const char *name) {
    printf("%s: %d instructions stepped, %d unwound to the caller%s\n", name, inside, unwound,
           left ? "" : " (never left)");
}

int main(void) {
    void *warm[4];
    backtrace(warm, 4); /* its first call loads libgcc_s: not in a signal handler */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_step;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGTRAP, &sa, NULL);
    malloc_fn = (void *(*)(size_t))dlsym(RTLD_DEFAULT, "malloc");
    free_fn = (void (*)(void *))dlsym(RTLD_DEFAULT, "free");

    entry = (uintptr_t)malloc_fn;
    step_on();
    void *p = malloc_fn(24);
    report("malloc");

    inside = unwound = left = 0;
    entry = (uintptr_t)free_fn;
    step_on();
    free_fn(p);
    report("free");
    return 0;
}
