//! The one place the crate names its synchronisation primitives, so the pure parts
//! (the account and the reclaim coordinator) can be model-checked by loom with
//! `RUSTFLAGS="--cfg loom"`. Everything on the allocation path is built from these.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicI64, AtomicU64},
    Condvar, Mutex, MutexGuard,
};

#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicI64, AtomicU64},
    Condvar, Mutex, MutexGuard,
};

/// Locks without caring about poisoning: the data behind our mutexes stays
/// consistent at every await point, and a panic elsewhere must not disable the
/// allocator.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}
