//! The library's own Rust allocations (configuration, the stats file, the report
//! hook's strings) go straight to jemalloc, never back through the exported
//! `malloc`: counted with no policy, so they can neither be refused nor start a
//! reclaim, wherever they happen.

use crate::malloc::charge::FACE;
use memquota_core::seam::slow;
use std::alloc::{GlobalAlloc, Layout};
use tikv_jemalloc_sys as jem;

struct Internal;

#[global_allocator]
static INTERNAL: Internal = Internal;

/// `MALLOCX_ALIGN`, only when the alignment exceeds what malloc guarantees.
fn flags(layout: &Layout) -> libc::c_int {
    if layout.align() <= 16 {
        0
    } else {
        layout.align().trailing_zeros() as libc::c_int
    }
}

// SAFETY: every method forwards to jemalloc's sized API with the layout's size and
// alignment, which is what GlobalAlloc requires; the accounting never touches memory.
unsafe impl GlobalAlloc for Internal {
    /// # Safety
    /// [`GlobalAlloc::alloc`]'s: `layout` has a non-zero size.
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let f = flags(&layout);
        // Recorded just below, so outside the bulk count of lazy calls.
        let s = crate::malloc::thread::slot();
        // SAFETY: the size is non-zero (this function's contract); `f` encodes a
        // power-of-two alignment, or none.
        let p = crate::malloc::lazy::guarded(s, || unsafe { jem::mallocx(layout.size(), f) });
        if !p.is_null() {
            // SAFETY: nallocx has no preconditions; with mallocx's size and flags it
            // gives the usable size just allocated.
            slow::record(&FACE, unsafe { jem::nallocx(layout.size(), f) } as i64);
        }
        crate::malloc::charge::catch_up(s);
        p.cast()
    }

    /// # Safety
    /// [`GlobalAlloc::dealloc`]'s: `ptr` is a live block from this allocator's `alloc`
    /// with this same `layout`.
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let f = flags(&layout);
        // SAFETY: nallocx has no preconditions; with `alloc`'s size and flags (the same
        // layout, this function's contract) it gives the usable size `alloc` recorded.
        let usable = unsafe { jem::nallocx(layout.size(), f) };
        // Recorded just below, so outside the bulk count of lazy calls.
        let s = crate::malloc::thread::slot();
        // SAFETY: `ptr` is live and came from `alloc` with this layout (this function's
        // contract), so from mallocx with this size and these flags.
        crate::malloc::lazy::guarded(s, || unsafe { jem::sdallocx(ptr.cast(), layout.size(), f) });
        slow::record(&FACE, -(usable as i64));
        crate::malloc::charge::catch_up(s);
    }
}
