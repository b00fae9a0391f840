//! The one place the crate names its synchronisation primitives, so the pure parts
//! (the account and the reclaim coordinator) can be model-checked by loom with
//! `RUSTFLAGS="--cfg loom"`. Outside loom the locks are std's: futex words with no
//! global state, so a `fork` child can use them once the fork handlers (`fork.rs`)
//! have released them. (parking_lot keeps a process-wide table of parked threads
//! whose buckets a vanished thread may hold, and may hand a released lock to a waiter
//! that does not exist in the child.) A poisoned lock is used as it is: the data
//! under these locks is plain counters and records, valid after any panic.

use std::cell::UnsafeCell;
use std::time::Duration;

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicI64, AtomicU64},
    Condvar, Mutex, MutexGuard,
};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicI64, AtomicU64};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

/// Locks `m`.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Waits on `cv`, releasing the lock meanwhile.
pub(crate) fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Waits on `cv` for at most `timeout`.
pub(crate) fn wait_timeout<'a, T>(
    cv: &Condvar,
    g: MutexGuard<'a, T>,
    timeout: Duration,
) -> MutexGuard<'a, T> {
    match cv.wait_timeout(g, timeout) {
        Ok((g, _)) => g,
        Err(p) => p.into_inner().0,
    }
}

/// A guard held across a `fork`: taken by the prepare handler, dropped by the parent
/// or child handler, all on the forking thread.
///
/// The slot is only touched by the thread that holds the lock the guard is of (it
/// stores the guard just after taking the lock, and drops it while still holding
/// it), so the lock itself is what keeps two threads out of the slot.
pub(crate) struct ForkHeld<T>(UnsafeCell<Option<T>>);

// SAFETY: see the type's docs: only the holder of the guarded lock reaches the slot.
unsafe impl<T> Sync for ForkHeld<T> {}

impl<T> ForkHeld<T> {
    pub(crate) const fn new() -> ForkHeld<T> {
        ForkHeld(UnsafeCell::new(None))
    }

    /// Keeps `guard` until [`release`](Self::release).
    ///
    /// # Safety
    /// `guard` is a guard of the lock this slot belongs to, just taken by the caller.
    pub(crate) unsafe fn keep(&self, guard: T) {
        // SAFETY: the caller holds the lock (the contract), which is what gives this
        // thread the slot alone.
        unsafe { *self.0.get() = Some(guard) };
    }

    /// Drops the guard kept, releasing its lock, after a last change through it
    /// (`last` is not called if no guard is kept).
    ///
    /// # Safety
    /// Only on the thread that called [`keep`](Self::keep), once.
    pub(crate) unsafe fn release_after(&self, last: impl FnOnce(&mut T)) {
        // SAFETY: the caller holds the lock through the kept guard (the contract).
        if let Some(guard) = unsafe { (*self.0.get()).as_mut() } {
            last(guard);
        }
        // SAFETY: this thread called `keep` and has not released yet (the contract).
        unsafe { self.release() };
    }

    /// Drops the guard kept, releasing its lock.
    ///
    /// # Safety
    /// As [`release_after`](Self::release_after).
    pub(crate) unsafe fn release(&self) {
        // SAFETY: as in `get`; the guard is taken out before it is dropped.
        let guard = unsafe { (*self.0.get()).take() };
        drop(guard);
    }
}
