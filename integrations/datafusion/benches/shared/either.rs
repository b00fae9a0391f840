//! The benchmarks' allocator: memquota's `QuotaAlloc`, or plain jemalloc for the
//! configurations that run DataFusion's own pools alone. Chosen once per process.

use memquota::{Jemalloc, QuotaAlloc};
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

/// The allocator of this process: memquota's, or plain jemalloc for the baseline.
/// Chosen once, first thing in `main`, before any other thread exists; both are the
/// same jemalloc underneath, so a block allocated by one before the switch may be
/// freed by the other.
pub struct Either;

/// memquota's allocator, over the same jemalloc.
static QUOTA: QuotaAlloc = QuotaAlloc::new();
/// Plain jemalloc when set (before the first allocation of any other thread).
pub static PLAIN: AtomicBool = AtomicBool::new(false);

// SAFETY: every call forwards to one of two `GlobalAlloc`s over the same jemalloc,
// with the caller's arguments and contract unchanged.
unsafe impl GlobalAlloc for Either {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if PLAIN.load(Relaxed) {
            // SAFETY: forwarded contract.
            unsafe { Jemalloc.alloc(layout) }
        } else {
            // SAFETY: forwarded contract.
            unsafe { QUOTA.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if PLAIN.load(Relaxed) {
            // SAFETY: forwarded contract.
            unsafe { Jemalloc.alloc_zeroed(layout) }
        } else {
            // SAFETY: forwarded contract.
            unsafe { QUOTA.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if PLAIN.load(Relaxed) {
            // SAFETY: forwarded contract; the same jemalloc allocated `ptr`.
            unsafe { Jemalloc.dealloc(ptr, layout) }
        } else {
            // SAFETY: forwarded contract; the same jemalloc allocated `ptr`.
            unsafe { QUOTA.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if PLAIN.load(Relaxed) {
            // SAFETY: forwarded contract; the same jemalloc allocated `ptr`.
            unsafe { Jemalloc.realloc(ptr, layout, new_size) }
        } else {
            // SAFETY: forwarded contract; the same jemalloc allocated `ptr`.
            unsafe { QUOTA.realloc(ptr, layout, new_size) }
        }
    }
}
