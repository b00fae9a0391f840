//! A spin lock for the scope tables. The allocation path takes it (a flush of an
//! attached thread's delta), so it must never allocate, never park through a
//! library that may allocate on first use, and be releasable in a `fork` child. Every
//! critical section under it is a few loads, stores and compares (a grant's
//! compare-and-swap on the process account among them), or a copy into a fixed
//! buffer: nothing in it allocates, frees or calls foreign code.
//!
//! Taking it twice on one thread would spin forever (a guard kept alive across a call
//! that reaches the report, which reads the tables): the lock knows its holder, and a
//! second take by the holder aborts with a message instead of hanging the process.

use crate::base::sync::{spin_loop, yield_now, AtomicBool, AtomicUsize, Ordering::*};
use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};

pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    /// The holder's `pthread_self`, 0 when free. Only the holder stores its own id
    /// here, so a thread that reads its own id holds the lock.
    holder: AtomicUsize,
    data: UnsafeCell<T>,
}

#[cfg(not(loom))]
fn me() -> usize {
    // SAFETY: pthread_self has no preconditions and never fails.
    unsafe { libc::pthread_self() as usize }
}

/// Under loom the model's threads share one OS thread: the address of a loom
/// thread-local tells the live ones apart.
#[cfg(loom)]
fn me() -> usize {
    loom::thread_local!(static ME: u8 = 0);
    ME.with(|me| me as *const u8 as usize)
}

// SAFETY: the data is reached only through a guard, and a guard exists for at most
// one thread at a time (the `locked` flag, taken with Acquire, released with Release).
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    #[cfg(not(loom))]
    pub(crate) const fn new(data: T) -> SpinLock<T> {
        SpinLock { locked: AtomicBool::new(false), holder: AtomicUsize::new(0), data: UnsafeCell::new(data) }
    }

    #[cfg(loom)]
    pub(crate) fn new(data: T) -> SpinLock<T> {
        SpinLock { locked: AtomicBool::new(false), holder: AtomicUsize::new(0), data: UnsafeCell::new(data) }
    }

    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        let me = me();
        if self.holder.load(Relaxed) == me {
            taken_twice();
        }
        let mut spins = 0u32;
        while self.locked.compare_exchange_weak(false, true, Acquire, Relaxed).is_err() {
            spins += 1;
            if spins < 64 {
                spin_loop();
            } else {
                // Two cores: let the holder run instead of burning its time slice.
                yield_now();
            }
        }
        self.holder.store(me, Relaxed);
        SpinGuard { lock: self }
    }

    /// Takes the lock for a `fork` and keeps it past this call: a prepare handler's
    /// step, undone by [`force_unlock`](Self::force_unlock) in the parent and child.
    pub(crate) fn hold_for_fork(&self) {
        std::mem::forget(self.lock());
    }

    /// Releases the lock [`hold_for_fork`](Self::hold_for_fork) kept.
    ///
    /// # Safety
    /// Only from a fork's parent or child handler, on the thread whose prepare handler
    /// held the lock: nothing else is inside the critical section.
    pub(crate) unsafe fn force_unlock(&self) {
        self.holder.store(0, Relaxed);
        self.locked.store(false, Release);
    }
}

#[cold]
fn taken_twice() -> ! {
    crate::base::text::write_stderr(
        "memquota: bug: a scope-table lock taken twice by one thread; aborting\n",
    );
    std::process::abort();
}

#[clippy::has_significant_drop]
pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock: no other reference to the data exists.
        unsafe { &*self.lock.data.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this the only one on this thread.
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.holder.store(0, Relaxed);
        self.lock.locked.store(false, Release);
    }
}
