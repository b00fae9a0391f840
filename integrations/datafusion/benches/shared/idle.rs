//! The idle runtime's resident memory once warm, for the example and the benchmarks.

/// The process's resident memory once jemalloc's freed pages are returned (every
/// arena purged): after a run, the idle runtime with DataFusion's code paged in.
pub fn idle_rss() -> u64 {
    // SAFETY: a void mallctl of jemalloc's namespace: a NUL-terminated name, and no old
    // or new value, as `arena.<i>.purge` requires.
    let _ = unsafe {
        tikv_jemalloc_sys::mallctl(
            c"arena.4096.purge".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    memquota::stats().process_rss
}
