//! Returning freed memory to the system: jemalloc keeps freed pages ("dirty") for
//! seconds before it gives them back, so right after a spill the process's resident
//! memory still holds what the spill freed. An arena purge gives them back at once, so
//! resident memory follows what is allocated. A plain `arena.<ALL>.purge` mallctl (a
//! budget-aware purge of memquota's own is on its way; this does not depend on it).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Instant;

/// jemalloc's `MALLCTL_ARENAS_ALL`: every arena.
const PURGE_ALL: &std::ffi::CStr = c"arena.4096.purge";

/// The least time between two purges: a purge walks every arena, and spills can come
/// in bursts.
const MIN_GAP_MS: u64 = 20;

static LAST_MS: AtomicU64 = AtomicU64::new(0);
static PURGES: AtomicU64 = AtomicU64::new(0);

fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + MIN_GAP_MS
}

/// Purges every arena's dirty pages, unless another purge ran in the last
/// [`MIN_GAP_MS`]. Returns whether it purged.
pub(crate) fn purge() -> bool {
    let now = now_ms();
    let last = LAST_MS.load(Relaxed);
    if now < last + MIN_GAP_MS || LAST_MS.compare_exchange(last, now, Relaxed, Relaxed).is_err() {
        return false;
    }
    // SAFETY: a void mallctl of jemalloc's documented namespace: a NUL-terminated
    // name, and no old or new value (null pointers, length 0), as `arena.<i>.purge`
    // requires.
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    PURGES.fetch_add(u64::from(rc == 0), Relaxed);
    rc == 0
}

/// Purges done so far.
pub(crate) fn purges() -> u64 {
    PURGES.load(Relaxed)
}
