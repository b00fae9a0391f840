//! The free signal: requests waiting for their scope's share sleep here, and any
//! change that lowers a scope's charge wakes them. It sits beside the tables because
//! a flush of a thread's delta (the ledger) is such a change.

use crate::base::sync::{
    lock, wait_timeout, AtomicU32, AtomicU64, Condvar, ForkHeld, Mutex, MutexGuard, Ordering::*,
};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// Requests in flight that may wait ([`Waiter`]s alive); a free wakes waiters only
/// when there are any.
static WAITERS: AtomicU32 = AtomicU32::new(0);
/// Bumped by a free while someone may wait.
static FREE_GEN: AtomicU64 = AtomicU64::new(0);
// std's futex-based lock and condvar: they never allocate.
static WAIT: Mutex<()> = Mutex::new(());
static FREED: Condvar = Condvar::new();
static WAIT_HELD: ForkHeld<MutexGuard<'static, ()>> = ForkHeld::new();
/// The longest a request waits for its fair share, in milliseconds.
static WAIT_MS: AtomicU64 = AtomicU64::new(2000);
/// The longest a request below its share waits.
pub(crate) fn set_wait(d: Duration) {
    WAIT_MS.store(u64::try_from(d.as_millis()).unwrap_or(u64::MAX), Relaxed);
}

/// The wait lock's part of a fork's prepare handler.
pub(crate) fn before_fork() {
    // SAFETY: a guard of WAIT, just taken.
    unsafe { WAIT_HELD.keep(lock(&WAIT)) };
}

/// The wait lock's part of a fork's parent and child handlers. In the child the
/// waiters are the `survivors` the forking thread holds ([`Waiter::new`]'s count on
/// it): the threads that held the others are gone, and a waiter the forking thread
/// holds (a fork from a spill callback, inside a request that waited) is dropped in
/// the child too, so the count must keep it or it wraps below zero there.
///
/// # Safety
/// On the thread whose prepare handler called [`before_fork`], once.
pub(crate) unsafe fn after_fork(child: bool, survivors: u32) {
    if child {
        WAITERS.store(survivors, SeqCst);
    }
    // SAFETY: forwarded contract.
    unsafe { WAIT_HELD.release() };
}

/// Called after a scope's charge went down: wakes requests waiting for their share.
pub(crate) fn wake() {
    if WAITERS.load(SeqCst) > 0 {
        FREE_GEN.fetch_add(1, SeqCst);
        let _g = lock(&WAIT);
        FREED.notify_all();
    }
}

pub(crate) fn wait_for_free(seen: u64, deadline: Instant) {
    let mut g = lock(&WAIT);
    while FREE_GEN.load(SeqCst) == seen {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        g = wait_timeout(&FREED, g, deadline - now);
    }
}

/// A request that may wait: registered while alive, so frees know to wake it.
pub(crate) struct Waiter<'a> {
    /// The owning thread's count of the waiters it holds (kept in its ledger state),
    /// what a fork child's count starts from.
    mine: &'a Cell<u32>,
}

impl<'a> Waiter<'a> {
    /// Registers a waiter of the calling thread, whose count of waiters is `mine`.
    pub(crate) fn new(mine: &'a Cell<u32>) -> Waiter<'a> {
        mine.set(mine.get().saturating_add(1));
        WAITERS.fetch_add(1, SeqCst);
        Waiter { mine }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        WAITERS.fetch_sub(1, SeqCst);
        self.mine.set(self.mine.get().saturating_sub(1));
    }
}

/// The free generation now: a waiter reads it before its last look, and waits only
/// while it is unchanged.
pub(crate) fn generation() -> u64 {
    FREE_GEN.load(SeqCst)
}

/// The longest a request below its share waits.
pub(crate) fn wait_bound() -> Duration {
    Duration::from_millis(WAIT_MS.load(Relaxed))
}
