//! A spin lock for the scope tables. The allocation path takes it (a flush of an
//! attached thread's delta), so it must never allocate, never park through a
//! library that may allocate on first use, and be releasable in a `fork` child. Every
//! critical section under it is a few loads, stores and compares, or a copy into a
//! fixed buffer: nothing in it allocates, frees or calls foreign code.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering::*};

pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    data: UnsafeCell<T>,
}

// SAFETY: the data is reached only through a guard, and a guard exists for at most
// one thread at a time (the `locked` flag, taken with Acquire, released with Release).
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) const fn new(data: T) -> SpinLock<T> {
        SpinLock { locked: AtomicBool::new(false), data: UnsafeCell::new(data) }
    }

    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        let mut spins = 0u32;
        while self.locked.compare_exchange_weak(false, true, Acquire, Relaxed).is_err() {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // Two cores: let the holder run instead of burning its time slice.
                std::thread::yield_now();
            }
        }
        SpinGuard { lock: self }
    }

    /// Releases the lock a vanished thread held.
    ///
    /// # Safety
    /// Only in a `fork` child before it starts any thread: the holder does not exist
    /// there, so nothing is inside the critical section.
    pub(crate) unsafe fn force_unlock(&self) {
        self.locked.store(false, Release);
    }
}

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
        self.lock.locked.store(false, Release);
    }
}
