//! The one place the crate names its synchronisation primitives, so the pure parts
//! (the account and the reclaim coordinator) can be model-checked by loom with
//! `RUSTFLAGS="--cfg loom"`. Outside loom the locks are parking_lot's: no poisoning,
//! and `force_unlock` lets a `fork` child release a lock a vanished thread held.

use std::time::Duration;

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicI64, AtomicU64},
    Condvar, Mutex, MutexGuard,
};

#[cfg(not(loom))]
pub(crate) use parking_lot::{Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicI64, AtomicU64};

/// Locks `m`.
#[cfg(not(loom))]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

/// Waits on `cv`, releasing the lock meanwhile.
#[cfg(not(loom))]
pub(crate) fn wait<'a, T>(cv: &Condvar, mut g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(&mut g);
    g
}

/// Waits on `cv` for at most `timeout`.
#[cfg(not(loom))]
pub(crate) fn wait_timeout<'a, T>(
    cv: &Condvar,
    mut g: MutexGuard<'a, T>,
    timeout: Duration,
) -> MutexGuard<'a, T> {
    let _ = cv.wait_for(&mut g, timeout);
    g
}

/// Releases whatever lock a vanished thread held on `m`.
///
/// # Safety
/// Only in a `fork` child, before it starts any thread: the thread that held the lock
/// does not exist there, so nothing can be inside the critical section.
#[cfg(not(loom))]
pub(crate) unsafe fn unlock_in_fork_child<T>(m: &Mutex<T>) {
    if m.is_locked() {
        // SAFETY: per the contract, no thread of this process holds the lock.
        unsafe { m.force_unlock() };
    }
}

#[cfg(loom)]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(loom)]
pub(crate) fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(|p| p.into_inner())
}

#[cfg(loom)]
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
