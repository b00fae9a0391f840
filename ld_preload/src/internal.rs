//! The library's own Rust allocations (configuration, the stats file, the report
//! hook's strings) go straight to jemalloc, never back through the exported
//! `malloc`: counted with no policy, so they can neither be refused nor start a
//! reclaim, wherever they happen.

use crate::tls::FACE;
use memquota_core::face;
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
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let f = flags(&layout);
        // SAFETY: a Layout's size is non-zero for GlobalAlloc::alloc; `f` encodes a
        // power-of-two alignment.
        let p = unsafe { jem::mallocx(layout.size(), f) };
        if !p.is_null() {
            // SAFETY: as above.
            face::record(&FACE, unsafe { jem::nallocx(layout.size(), f) } as i64);
        }
        p.cast()
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let f = flags(&layout);
        // SAFETY: `ptr` came from `alloc` with this layout, so these flags and size.
        let usable = unsafe { jem::nallocx(layout.size(), f) };
        // SAFETY: as above.
        unsafe { jem::sdallocx(ptr.cast(), layout.size(), f) };
        face::record(&FACE, -(usable as i64));
    }
}
