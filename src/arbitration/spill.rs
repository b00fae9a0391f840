//! Spillable consumers: their callbacks, the order Spark spills them in, and the
//! check that a callback does not reserve memory itself.
//!
//! The figures of a consumer (its reservations, spills) live in the pool; the
//! callbacks live here, each an `Arc` taken out under a spin lock and called with no
//! lock held. A callback runs on the thread that needs memory, inside memquota's slow
//! path: what it allocates is charged but never refused and never waits, and what it
//! frees or releases is seen at once.

use crate::base::sync::{Arc, AtomicUsize, Ordering::Relaxed};
use crate::ledger::tables::pool::{Pool, MAX_CONSUMERS, POOL};
use crate::ledger::tables::spin::SpinLock;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A spill callback: asked to free about `target` bytes, returns the bytes it freed.
pub type SpillFn = dyn Fn(u64) -> u64 + Send + Sync;

type Slot = Option<(u64, Arc<SpillFn>)>;

static CALLBACKS: SpinLock<[Slot; MAX_CONSUMERS]> = SpinLock::new([const { None }; MAX_CONSUMERS]);

/// Threads running a spill callback right now (`pthread_self`), so `reserve` can tell.
static SPILLING: [AtomicUsize; 8] = [const { AtomicUsize::new(0) }; 8];

fn slot(key: u64) -> usize {
    (key & 0xffff) as usize
}

pub(crate) fn register(key: u64, callback: Arc<SpillFn>) {
    let old = CALLBACKS.lock()[slot(key)].replace((key, callback));
    drop_caught(old); // outside the lock: dropping may free memory
}

/// Drops a callback (its captured values, when it is the last holder) with a panic in
/// a `Drop` of theirs caught, as a panic in the callback itself is: the last holder
/// can be an allocating thread in the slow path, which must not unwind.
fn drop_caught<T>(callback: T) {
    let _ = catch_unwind(AssertUnwindSafe(move || drop(callback)));
}

pub(crate) fn unregister(key: u64) {
    let old = {
        let mut c = CALLBACKS.lock();
        match &c[slot(key)] {
            Some((k, _)) if *k == key => c[slot(key)].take(),
            _ => None,
        }
    };
    drop_caught(old);
}

/// Drops the callbacks whose consumer is gone (its scope ended).
pub(crate) fn forget_dead() {
    for i in 0..MAX_CONSUMERS {
        let Some(key) = CALLBACKS.lock()[i].as_ref().map(|(k, _)| *k) else { continue };
        if POOL.lock().consumer(key).is_none() {
            unregister(key);
        }
    }
}

/// The registry's part of a fork's prepare handler.
pub(crate) fn before_fork() {
    CALLBACKS.hold_for_fork();
}

/// The registry's part of a fork's parent and child handlers. In the child, the
/// marks of threads that did not survive the fork are cleared.
///
/// # Safety
/// As [`SpinLock::force_unlock`].
pub(crate) unsafe fn after_fork(child: bool) {
    if child {
        let me = me();
        for s in &SPILLING {
            let _ = s.fetch_update(Relaxed, Relaxed, |t| (t != me && t != 0).then_some(0));
        }
    }
    // SAFETY: forwarded contract.
    unsafe { CALLBACKS.force_unlock() };
}

fn callback(key: u64) -> Option<Arc<SpillFn>> {
    match &CALLBACKS.lock()[slot(key)] {
        Some((k, f)) if *k == key => Some(Arc::clone(f)),
        _ => None,
    }
}

fn me() -> usize {
    // SAFETY: pthread_self has no preconditions and never fails.
    unsafe { libc::pthread_self() as usize }
}

/// Whether the calling thread is inside a spill callback.
pub(crate) fn in_spill() -> bool {
    let me = me();
    SPILLING.iter().any(|s| s.load(Relaxed) == me)
}

/// Marks the calling thread as spilling while alive (if a mark is free).
struct Spilling(Option<&'static AtomicUsize>);

impl Spilling {
    fn mark() -> Spilling {
        let me = me();
        Spilling(SPILLING.iter().find(|s| s.compare_exchange(0, me, Relaxed, Relaxed).is_ok()))
    }
}

impl Drop for Spilling {
    fn drop(&mut self) {
        if let Some(s) = self.0 {
            s.store(0, Relaxed);
        }
    }
}

/// Runs consumer `key`'s callback for `target` bytes with no lock held; counts it.
/// A panic in the callback is caught and counts as nothing freed.
pub(crate) fn run(key: u64, target: u64) -> u64 {
    let Some(f) = callback(key) else { return 0 };
    let freed = {
        let _mark = Spilling::mark();
        catch_unwind(AssertUnwindSafe(|| f(target))).unwrap_or(0)
    };
    POOL.lock().note_spill(key, freed);
    drop_caught(f);
    freed
}

/// Where a request is in Spark's spill order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// The same scope's other consumers: the smallest that covers the gap, else the
    /// largest.
    Own,
    /// The requesting consumer itself, last of its scope.
    Requester,
    /// Other scopes' consumers: lowest priority first, largest first within it.
    Others,
    Done,
}

/// One request's walk through the consumers; each is asked at most once.
pub(crate) struct Cursor {
    scope: u64,
    requester: u64,
    phase: Phase,
    tried: [u64; MAX_CONSUMERS / 64],
}

impl Cursor {
    pub(crate) fn new(scope: u64, requester: u64) -> Cursor {
        Cursor { scope, requester, phase: Phase::Own, tried: [0; MAX_CONSUMERS / 64] }
    }

    fn tried(&self, key: u64) -> bool {
        let i = slot(key);
        self.tried[i / 64] & (1 << (i % 64)) != 0
    }

    fn mark(&mut self, key: u64) -> u64 {
        let i = slot(key);
        self.tried[i / 64] |= 1 << (i % 64);
        key
    }

    /// The next consumer to spill for a `gap`, within the scope only if `own_only`.
    pub(crate) fn next(&mut self, pool: &Pool, gap: u64, own_only: bool) -> Option<u64> {
        let scope_slot = slot(self.scope);
        loop {
            match self.phase {
                Phase::Own => {
                    let candidates = pool
                        .consumers_of(scope_slot)
                        .filter(|(k, c)| *k != self.requester && c.used > 0 && !self.tried(*k));
                    if let Some(k) = spark_pick(candidates.map(|(k, c)| (k, c.used as u64)), gap) {
                        return Some(self.mark(k));
                    }
                    self.phase = Phase::Requester;
                }
                Phase::Requester => {
                    self.phase = Phase::Others;
                    if pool.consumer(self.requester).is_some() && !self.tried(self.requester) {
                        return Some(self.mark(self.requester));
                    }
                }
                Phase::Others if own_only => return None,
                Phase::Others => {
                    let mut best: Option<(i32, i64, u64)> = None;
                    for (k, c) in pool.consumers() {
                        if usize::from(c.scope) == scope_slot || c.used <= 0 || self.tried(k) {
                            continue;
                        }
                        let Some(h) = pool.handle_of(usize::from(c.scope)) else { continue };
                        let prio = pool.scope(h).map_or(0, |s| s.priority);
                        // Lowest priority first, then the largest.
                        if best.map_or(true, |(p, u, _)| (prio, -c.used) < (p, -u)) {
                            best = Some((prio, c.used, k));
                        }
                    }
                    match best {
                        Some((_, _, k)) => return Some(self.mark(k)),
                        None => self.phase = Phase::Done,
                    }
                }
                Phase::Done => return None,
            }
        }
    }
}

/// Spark's TaskMemoryManager choice: the smallest consumer that covers `gap`, else the
/// largest.
fn spark_pick(candidates: impl Iterator<Item = (u64, u64)>, gap: u64) -> Option<u64> {
    let mut covering: Option<(u64, u64)> = None;
    let mut largest: Option<(u64, u64)> = None;
    for (k, used) in candidates {
        if used >= gap && covering.map_or(true, |(_, u)| used < u) {
            covering = Some((k, used));
        }
        if largest.map_or(true, |(_, u)| used > u) {
            largest = Some((k, used));
        }
    }
    covering.or(largest).map(|(k, _)| k)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::spark_pick;

    #[test]
    fn smallest_covering_else_largest() {
        let c = [(1, 10), (2, 30), (3, 50)];
        assert_eq!(spark_pick(c.into_iter(), 25), Some(2));
        assert_eq!(spark_pick(c.into_iter(), 30), Some(2));
        assert_eq!(spark_pick(c.into_iter(), 60), Some(3));
        assert_eq!(spark_pick(c.into_iter(), 1), Some(1));
        assert_eq!(spark_pick(std::iter::empty(), 1), None);
    }
}
