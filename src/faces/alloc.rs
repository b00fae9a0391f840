//! The Rust face: `QuotaAlloc`, a `#[global_allocator]` that charges every
//! allocation against the budget before the backing allocator sees it.

use crate::seam::hot::{self, with_rust_local, RUST_FACE};
use crate::seam::scopes::{self, OWNED_MIN};
use crate::seam::{process, slow::charge_slow};
use std::alloc::{GlobalAlloc, Layout};
use tikv_jemallocator::Jemalloc;

/// A global allocator that charges every allocation against the process budget.
///
/// ```no_run
/// #[global_allocator]
/// static GLOBAL: memquota::QuotaAlloc = memquota::QuotaAlloc::new();
/// ```
///
/// Generic over the backing allocator so tests and miri can run it over
/// [`std::alloc::System`]: `QuotaAlloc::wrap(std::alloc::System)`.
///
/// Sizes are taken from the [`Layout`], never looked up: tracked bytes are requested
/// bytes, not the size class jemalloc rounds them to.
#[derive(Debug)]
pub struct QuotaAlloc<A = Jemalloc> {
    inner: A,
}

impl QuotaAlloc<Jemalloc> {
    /// jemalloc underneath.
    pub const fn new() -> Self {
        QuotaAlloc { inner: Jemalloc }
    }
}

impl Default for QuotaAlloc<Jemalloc> {
    fn default() -> Self {
        Self::new()
    }
}

impl<A> QuotaAlloc<A> {
    /// Any allocator underneath.
    pub const fn wrap(inner: A) -> Self {
        QuotaAlloc { inner }
    }
}

/// Charges `bytes` before memory is taken. False: refused (the report is written).
#[inline(always)]
fn charge(bytes: usize) -> bool {
    // Layout sizes never exceed isize::MAX, so the casts are exact.
    with_rust_local(|l| hot::try_charge(l, bytes as u64)) == Some(true)
        || charge_slow(&RUST_FACE, bytes as i64)
}

/// Credits `bytes` after memory is given back (or was never taken).
#[inline(always)]
fn credit(bytes: usize) {
    if with_rust_local(|l| hot::try_credit(l, bytes as u64)) != Some(true) {
        charge_slow(&RUST_FACE, -(bytes as i64));
    }
}

/// Whether the fast path took the charge of `bytes`. On false a miss may be left
/// recorded: the caller's slow path starts with [`undo_miss`]. Putting the bytes back
/// here, a call `alloc` cannot make in tail position, made its whole fast path keep
/// registers across it (three pushes per call, `MEMQUOTA_BENCH_SHIM=1` disassembly).
#[inline(always)]
fn charged_fast(bytes: usize) -> bool {
    // Layout sizes never exceed isize::MAX, so the casts are exact.
    with_rust_local(|l| hot::charge_or_miss(l, bytes as u64)) == Some(true)
}

/// Takes back the miss a false [`charged_fast`] left recorded.
fn undo_miss(bytes: usize) {
    with_rust_local(|l| hot::undo_charge(l, bytes as u64));
}

/// Gives the charge of a failed allocation back.
#[inline(always)]
fn taken(p: *mut u8, size: usize) -> *mut u8 {
    if p.is_null() {
        refund(size);
    }
    p
}

/// Out of line, so that only the size, not the ledger's thread-local address, stays
/// live across the backing allocator's call: fewer registers saved in `alloc` (the
/// shim table of `benches/alloc.rs`, docs/benchmarks.md).
#[cold]
#[inline(never)]
fn refund(size: usize) {
    credit(size);
}

// SAFETY: every method forwards to `inner` with the caller's arguments unchanged, so
// `inner`'s GlobalAlloc guarantees carry over; the accounting around the calls never
// touches the memory and never unwinds (the slow path catches callback panics).
unsafe impl<A: GlobalAlloc> GlobalAlloc for QuotaAlloc<A> {
    // Scopes cost the fast paths one instruction per free and none per allocation
    // (instruction counts, docs/benchmarks.md): `dealloc` keeps the pointer for its
    // slow path's owner lookup. The slow path of `alloc` is a method taking the layout
    // by value: a closure over it passed out of line cost instructions on every call,
    // and so did crediting before the free.

    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !charged_fast(layout.size()) {
            // SAFETY: forwarded contract.
            return unsafe { self.alloc_slow(layout, false) };
        }
        // SAFETY: the caller upholds `alloc`'s contract for `layout`.
        taken(unsafe { self.inner.alloc(layout) }, layout.size())
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !charged_fast(layout.size()) {
            // SAFETY: forwarded contract.
            return unsafe { self.alloc_slow(layout, true) };
        }
        // SAFETY: the caller upholds `alloc_zeroed`'s contract for `layout`.
        taken(unsafe { self.inner.alloc_zeroed(layout) }, layout.size())
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if with_rust_local(|l| hot::try_credit(l, layout.size() as u64)) != Some(true) {
            // SAFETY: forwarded contract.
            return unsafe { self.dealloc_slow(ptr, layout) };
        }
        // SAFETY: the caller guarantees `ptr` came from this allocator with `layout`.
        unsafe { self.inner.dealloc(ptr, layout) };
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old_size = layout.size();
        if old_size.max(new_size) as u64 >= OWNED_MIN {
            // SAFETY: forwarded contract.
            return unsafe { self.realloc_big(ptr, layout, new_size) };
        }
        // SAFETY: forwarded contract.
        unsafe { self.realloc_counted(ptr, layout, new_size) }
    }
}

impl<A: GlobalAlloc> QuotaAlloc<A> {
    /// `dealloc` past the fast path: the block is given back first, then its owner
    /// record (if it is big and has one) says whom to credit.
    ///
    /// # Safety
    /// As [`GlobalAlloc::dealloc`].
    #[cold]
    #[inline(never)]
    unsafe fn dealloc_slow(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { self.inner.dealloc(ptr, layout) };
        if !scopes::note_free(ptr as usize, layout.size() as u64) {
            charge_slow(&RUST_FACE, -(layout.size() as i64));
        }
    }

    /// `alloc` past the fast path (a miss of [`charged_fast`]): the policy, then the
    /// allocation, then a big block's owner record.
    ///
    /// # Safety
    /// As [`GlobalAlloc::alloc`].
    #[cold]
    #[inline(never)]
    unsafe fn alloc_slow(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        undo_miss(layout.size());
        // Every thread's first allocation comes here: the process's first installs the
        // fork handlers and starts the sampler, for a program that never calls `init`.
        process::install_fork_handlers();
        process::ensure_sampling();
        if !charge_slow(&RUST_FACE, layout.size() as i64) {
            return std::ptr::null_mut();
        }
        let p = if zeroed {
            // SAFETY: forwarded contract.
            unsafe { self.inner.alloc_zeroed(layout) }
        } else {
            // SAFETY: forwarded contract.
            unsafe { self.inner.alloc(layout) }
        };
        if p.is_null() {
            credit(layout.size());
        } else {
            scopes::note_alloc(&RUST_FACE, p as usize, layout.size() as u64);
        }
        p
    }

    /// A `realloc` from or to a big block: its owner record follows it to the
    /// calling thread's scope.
    ///
    /// # Safety
    /// As [`GlobalAlloc::realloc`].
    #[cold]
    #[inline(never)]
    unsafe fn realloc_big(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old_size = layout.size();
        let Some(had) =
            scopes::note_realloc_begin(&RUST_FACE, ptr as usize, old_size as u64, new_size as u64)
        else {
            return std::ptr::null_mut(); // the move to this thread's scope was refused
        };
        // SAFETY: forwarded contract.
        let p = unsafe { self.realloc_counted(ptr, layout, new_size) };
        scopes::note_realloc_end(&RUST_FACE, ptr as usize, p as usize, old_size as u64, new_size as u64, had);
        p
    }

    /// The accounting of a `realloc`: the growth charged before, the shrink credited
    /// after.
    ///
    /// # Safety
    /// As [`GlobalAlloc::realloc`].
    #[inline(always)]
    unsafe fn realloc_counted(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old_size = layout.size();
        if new_size > old_size {
            let growth = new_size - old_size;
            if !charge(growth) {
                return std::ptr::null_mut();
            }
            // SAFETY: the caller upholds `realloc`'s contract.
            let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
            if p.is_null() {
                credit(growth);
            }
            p
        } else {
            // SAFETY: the caller upholds `realloc`'s contract.
            let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
            if !p.is_null() {
                credit(old_size - new_size);
            }
            p
        }
    }
}
