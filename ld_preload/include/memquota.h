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

#ifdef __cplusplus
}
#endif

#endif /* MEMQUOTA_H */
