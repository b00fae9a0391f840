//! The one place the crate names its synchronisation primitives, so the pure parts
//! (the account, the reclaim coordinator, the retry machine) can be model-checked by
//! loom with `RUSTFLAGS="--cfg loom"`: no other file of `src/` names a path of
//! `std::sync` or `core::sync` (the test below checks it). Outside loom everything
//! here is std's, re-exported: the same types, the same code. Outside loom the locks
//! are std's: futex words with no
//! global state, so a `fork` child can use them once the fork handlers (`fork.rs`)
//! have released them. (parking_lot keeps a process-wide table of parked threads
//! whose buckets a vanished thread may hold, and may hand a released lock to a waiter
//! that does not exist in the child.) A poisoned lock is used as it is: the data
//! under these locks is plain counters and records, valid after any panic.
//!
//! Under loom the names loom has are loom's. loom's atomics and locks have no `const
//! fn new`, so a `static` of them does not build under loom: the modules that keep
//! such statics are built only without loom (the `#[cfg(not(loom))]` of the layers'
//! `mod.rs`), and a module built under loom that needs a static atomic takes it
//! from [`unmodelled`], std's under both.

use std::cell::UnsafeCell;
use std::time::Duration;

// Under loom only the models' modules are built, which use a few of these names.
#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::{
    atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU16, AtomicU32, AtomicU64, AtomicU8, AtomicUsize},
    Arc, Condvar, Mutex, MutexGuard,
};

#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU16, AtomicU32, AtomicU64, AtomicU8, AtomicUsize},
    Arc, Condvar, Mutex, MutexGuard,
};

/// loom's `Ordering` is std's.
pub(crate) use std::sync::atomic::Ordering;

/// What a spin loop does while it waits: under loom, yields to the other model
/// threads (a loop that does not would be explored forever).
#[cfg(loom)]
pub(crate) use loom::{hint::spin_loop, thread::yield_now};
#[cfg(not(loom))]
pub(crate) use std::{hint::spin_loop, thread::yield_now};

/// std's under loom too: loom has no `OnceLock`, and its `mpsc` no `sync_channel`.
/// Their users (the settings' hook, the fork handlers' table, the purge thread, the
/// JVM driver, the metrics endpoint) sit outside the models.
#[cfg_attr(loom, allow(unused_imports))]
pub(crate) use std::sync::{mpsc, OnceLock};

/// std's atomics under loom too, for what a model must not see: the statics of a
/// module built under loom (`settings`: loom's atomics have no `const fn new`) and
/// counters that add up over all of a model's executions (`loom_tests`).
pub(crate) mod unmodelled {
    #[cfg(all(loom, test))]
    pub(crate) use std::sync::atomic::AtomicUsize;
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8};
}

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

#[cfg(all(test, not(loom)))]
mod tests {
    use std::fs;
    use std::path::Path;

    /// Every `std::sync` / `core::sync` path of `src/`, outside this file, as
    /// `file:line: text`, written out or inside a `use std::{...}` group. Comments
    /// do not count.
    fn direct_uses(dir: &Path, out: &mut Vec<String>) {
        let mut entries: Vec<_> = fs::read_dir(dir).expect("src/ is readable").flatten().collect();
        entries.sort_by_key(|e| e.path());
        for e in entries {
            let path = e.path();
            if path.is_dir() {
                direct_uses(&path, out);
            } else if path.extension().is_some_and(|x| x == "rs") && !path.ends_with("base/sync.rs") {
                let text = fs::read_to_string(&path).expect("a source file is readable");
                // Inside a `use std::{...}` or `use core::{...}` group, where `sync::`
                // stands alone.
                let mut in_group = false;
                for (n, line) in text.lines().enumerate() {
                    let code = line.split("//").next().unwrap_or("");
                    if ["use std::{", "use core::{"].iter().any(|p| code.contains(p)) {
                        in_group = true;
                    }
                    let grouped = in_group
                        && code.split(|c: char| !c.is_alphanumeric() && c != '_').any(|w| w == "sync");
                    if grouped || ["std::sync", "core::sync"].iter().any(|p| code.contains(p)) {
                        out.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                    }
                    if code.contains(';') {
                        in_group = false;
                    }
                }
            }
        }
    }

    /// The claim of this module's first line: no other file of the crate names a
    /// synchronisation primitive of std or core, so loom sees every one this module
    /// swaps.
    #[test]
    fn sync_primitives_are_named_here_only() {
        let mut found = Vec::new();
        direct_uses(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut found);
        assert!(found.is_empty(), "std/core sync paths outside src/base/sync.rs:\n{}", found.join("\n"));
    }
}
