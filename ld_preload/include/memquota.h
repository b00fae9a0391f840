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
 * -EDEADLK (from inside a spill or reclaim callback). */
int64_t memquota_scope_reserve(uint64_t scope, uint64_t bytes, int partial);

/* Gives back `bytes` the scope reserved. Returns 0. */
int memquota_scope_release(uint64_t scope, uint64_t bytes);

#ifdef __cplusplus
}
#endif

#endif /* MEMQUOTA_H */
