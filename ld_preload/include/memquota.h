/* memquota: the C ABI of libmemquota.so.
 *
 * Load the library with LD_PRELOAD (it then also replaces malloc) and call these
 * directly, or look them up with dlsym(RTLD_DEFAULT, ...) to work with or without it.
 */
#ifndef MEMQUOTA_H
#define MEMQUOTA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the budget's statistics as one JSON object into buf (always NUL-terminated
 * when len > 0), like snprintf: returns the length of the whole text without the NUL;
 * a result >= len means it was cut. The calling thread's pending count is flushed
 * first. Keys: limit_bytes, native_bytes, native_peak_bytes, headroom_bytes,
 * heap_committed_bytes, heap_used_bytes, oom_total, reclaims_total_sync, ... */
size_t memquota_stats_json(char *buf, size_t len);

/* The live task scopes and the scope manager's totals as one JSON object, written
 * like memquota_stats_json. Keys: pool_bytes, share_bytes, begun, ended, ...,
 * "scopes": [{"name", "id", "priority", "held_bytes", "peak_bytes",
 * "allocated_bytes", "reserved_bytes", "threads", ..., "consumers": [...]}]. */
size_t memquota_scopes_json(char *buf, size_t len);

/* The figures an OOM report shows, as they are now (limit, native and heap,
 * reclaims, scopes, jemalloc's view), written like memquota_stats_json. Not a
 * refusal: nothing is counted. */
size_t memquota_report_now(char *buf, size_t len);

/* Sets the heap figures that count against the budget (a JVM's committed and used
 * heap, say). Which one counts is MEMQUOTA_HEAP (committed by default). */
void memquota_set_heap_bytes(uint64_t committed, uint64_t used);

/* Sets the limit in bytes. Returns 0, or EINVAL for 0. */
int memquota_set_limit(uint64_t bytes);

/* Flushes the calling thread's pending count to the process totals. */
void memquota_flush(void);

/* The reclaim ("GC") callback: asked to free about `need` bytes. Called on the
 * allocating thread (over the limit) or on the memquota-reclaim thread (past the
 * soft threshold), never twice at once. It may allocate; that is counted and never
 * refused. Must be safe to call from any thread. */
typedef void (*memquota_reclaim_fn)(size_t need, void *ctx);

/* Registers the reclaim callback with its context; NULL unregisters. */
void memquota_on_reclaim(memquota_reclaim_fn callback, void *ctx);

/* A reclaim callback that only signals, for runtimes whose reclaim must run on a
 * thread of their own (Python: the allocating thread may hold the interpreter lock):
 * writes `need` as one native-endian uint64_t to the file descriptor
 * (int)(intptr_t)ctx, an eventfd or the non-blocking write end of a pipe, and
 * returns. Register it with memquota_on_reclaim(memquota_notify_fd, (void *)fd).
 * It frees nothing itself, so the reclaim that called it measures nothing freed. */
void memquota_notify_fd(size_t need, void *ctx);

/* Task scopes (task memory managers; docs/scopes.md). A scope is a plain uint64_t
 * handle; it goes stale, harmlessly, when the scope ends. */

/* Begins a scope named `name` (may be NULL) with an id and a priority (lower is
 * spilled first by other scopes). Returns its handle, or 0 if too many are alive. */
uint64_t memquota_scope_begin(const char *name, uint64_t id, int32_t priority);

/* Ends a scope. Returns the bytes its threads allocated and nobody freed (a leak,
 * now counted for the process), or -EINVAL. Writes the report into `report` like
 * snprintf (may be NULL with len 0). */
int64_t memquota_scope_end(uint64_t scope, char *report, size_t len);

/* Attaches the calling thread: its allocations are charged to the scope (and the
 * process) until detached. Replaces the thread's scope, if any. 0, or EINVAL. */
int memquota_scope_attach(uint64_t scope);

/* Detaches the calling thread. 0, or EINVAL if it was in no scope. */
int memquota_scope_detach(void);

/* Reserves `bytes` for the scope (partial != 0: as much as its fair share allows);
 * allocations of its threads use the reservation before they charge anything new.
 * Returns the bytes granted, or -ENOMEM (refused, with a report), -EINVAL, or
 * -EDEADLK (from inside a spill or reclaim callback). In a retry block (below) it
 * waits for memory instead of failing, and returns -EAGAIN when the thread is rolled
 * back, -E2BIG when it must split its input, -EINVAL at once when the scope ends while
 * it waits. */
int64_t memquota_scope_reserve(uint64_t scope, uint64_t bytes, int partial);

/* Gives back `bytes` the scope reserved. Returns 0. */
int memquota_scope_release(uint64_t scope, uint64_t bytes);

/* Retry blocks: work that completes under pressure (docs/scopes.md, "Retry blocks").
 * Inside one, a reservation, or an allocation of MEMQUOTA_REFUSE_MIN or more (4 MiB
 * by default), that does not fit after spills and reclaims waits for memory to be
 * freed instead of failing; smaller allocations keep their rule.
 * When every task is blocked the youngest is rolled back: its request fails, it frees
 * what its attempt holds, calls memquota_retry_block() and runs the attempt again.
 * When a task is the only one still short (or asks for more than the whole pool) it
 * is told to split its input. A wait ends after 10 s at most with a plain refusal.
 *
 *     if (memquota_retry_begin(scope) != 0) ...;
 *     for (;;) {
 *         int64_t got = memquota_scope_reserve(scope, need, 0);   // or malloc
 *         if (got >= 0) { work(); memquota_scope_release(scope, got); break; }
 *         free_what_the_attempt_holds();
 *         if (got == -EAGAIN && memquota_retry_block() == 0) continue;
 *         if (got == -E2BIG) { split_the_input(); continue; }
 *         fail();
 *     }
 *     memquota_retry_end();
 */

/* How deep retry blocks nest on one thread. */
#define MEMQUOTA_RETRY_MAX_DEPTH 16
/* Rollbacks a thread may go through in its outermost block before
 * memquota_retry_block() gives up. */
#define MEMQUOTA_MAX_RETRIES 500

/* Begins a retry block on the calling thread: attaches it to `scope` until the block
 * ends, and enters the retry machine (priority: the older task, by id then begin,
 * goes first). Blocks nest. Returns 0, -EINVAL (the scope is not running), or
 * -EOVERFLOW (nested deeper than MEMQUOTA_RETRY_MAX_DEPTH). */
int memquota_retry_begin(uint64_t scope);

/* Ends the calling thread's innermost retry block: the thread is attached again to
 * the scope it was in when the block began (or to none). Returns 0, or -EPERM if the
 * thread is in no retry block. A thread that exits inside a block leaves it. */
int memquota_retry_end(void);

/* After a rollback, once the attempt has freed what it held: waits until the thread
 * may run its attempt again (until further notice: no older task is blocked and
 * there is room for what the attempt failed on; bounded like every wait). Returns 0
 * (at once if no rollback is pending): run the attempt again; -ENOMEM: the thread was
 * rolled back more than MEMQUOTA_MAX_RETRIES times in its outermost block, give up;
 * -EINVAL: the block's scope ended (at once, also while the thread waits), end the
 * block; -EPERM: the thread is in no retry block. */
int memquota_retry_block(void);

/* memquota_last_refusal(): no rollback or split since the attempt began (a NULL then
 * was a plain refusal, as outside a retry block). */
#define MEMQUOTA_REFUSAL_NONE 0
/* memquota_last_refusal(): rolled back (what -EAGAIN says): free what the attempt
 * holds, call memquota_retry_block(), run the attempt again. */
#define MEMQUOTA_REFUSAL_ROLLBACK 1
/* memquota_last_refusal(): split the input and process each piece (what -E2BIG
 * says). */
#define MEMQUOTA_REFUSAL_SPLIT 2
/* memquota_last_refusal(): the block's scope ended while the request waited (what
 * memquota_scope_reserve's -EINVAL says there): the attempt cannot go on, end the
 * block. */
#define MEMQUOTA_REFUSAL_SCOPE_ENDED 3

/* malloc and the rest keep their contract in a retry block (NULL and errno ENOMEM);
 * this says how the calling thread's last refusal in its retry block went:
 * MEMQUOTA_REFUSAL_ROLLBACK, MEMQUOTA_REFUSAL_SPLIT, MEMQUOTA_REFUSAL_SCOPE_ENDED or
 * MEMQUOTA_REFUSAL_NONE; -EPERM
 * if the thread is in no retry block. A new attempt (memquota_retry_begin,
 * memquota_retry_block) starts from MEMQUOTA_REFUSAL_NONE. */
int memquota_last_refusal(void);

#ifdef __cplusplus
}
#endif

#endif /* MEMQUOTA_H */
