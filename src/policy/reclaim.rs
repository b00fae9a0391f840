//! Reclaims: the registered callback, the one coordinator that decides when it runs
//! (`coordinator.rs`), the background worker, and the measure of what a run freed.

use crate::base::settings;
use crate::base::sync::{AtomicBool, AtomicPtr, Ordering::*};
use crate::ledger::threads::{self, Face, Local, ACCOUNT};
use crate::policy::coordinator::{
    Coordinator, Counts, ReclaimRecord, Run, SyncOutcome, Throttle, Timing, HISTORY,
};
use crate::policy::heap_probe;
use crate::policy::purge;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A reclaim callback: asked to free about `need` bytes.
type ReclaimFn = dyn Fn(usize) + Send + Sync;

static COORDINATOR: Coordinator = Coordinator::new();
/// A leaked `Box<Box<ReclaimFn>>`, never freed: another thread may be running the
/// previous callback when a new one is installed.
static RECLAIM: AtomicPtr<Box<ReclaimFn>> = AtomicPtr::new(std::ptr::null_mut());
static WORKER_STARTED: AtomicBool = AtomicBool::new(false);

/// Registers the reclaim ("GC") callback, replacing any earlier one. It is called
/// with the number of bytes wanted, on the thread that needs them (synchronous
/// reclaim) or on the `memquota-reclaim` thread (background reclaim), never twice at
/// once. It may allocate: that is charged and never triggers another reclaim. A
/// panic in it is caught and counted. What it freed is measured, not trusted.
///
/// Registering resets the futility suspension: the record of the old callback says
/// nothing about the new one. The old callback is leaked, not dropped, since another
/// thread may be running it.
pub fn on_reclaim<F: Fn(usize) + Send + Sync + 'static>(callback: F) {
    let boxed: Box<Box<ReclaimFn>> = Box::new(Box::new(callback));
    RECLAIM.store(Box::into_raw(boxed), Release);
    COORDINATOR.reset_futility();
}

/// Unregisters the reclaim callback.
pub fn clear_reclaim() {
    RECLAIM.store(std::ptr::null_mut(), Release);
}

fn reclaimer() -> Option<&'static ReclaimFn> {
    let p = RECLAIM.load(Acquire);
    // SAFETY: RECLAIM holds null or a pointer from `Box::into_raw` that is never freed.
    unsafe { p.as_ref() }.map(|b| &**b)
}

/// Whether a callback is registered.
pub(crate) fn has_reclaimer() -> bool {
    reclaimer().is_some()
}

fn timing() -> Timing {
    Timing {
        wait: settings::reclaim_wait(),
        min_interval: settings::reclaim_interval(),
        background_interval: settings::background_interval(),
    }
}

/// Asks for a synchronous reclaim of `need` bytes on the calling thread (busy-marked
/// by the caller): runs it here, or waits for the one in flight.
pub(crate) fn sync(l: &Local, face: &Face, need: u64) -> SyncOutcome {
    COORDINATOR.reclaim_sync(need, timing(), |need| run(l, face, need))
}

/// The counters of the reclaims so far.
pub(crate) fn counts() -> &'static Counts {
    &COORDINATOR.counts
}

/// The last reclaims, newest first.
pub(crate) fn history() -> [Option<ReclaimRecord>; HISTORY] {
    COORDINATOR.history()
}

/// Whether reclaims are held back now, and why.
pub(crate) fn throttled() -> Option<Throttle> {
    COORDINATOR.throttled(timing())
}

/// Native plus counted heap bytes, with this thread's delta flushed first.
fn used_now(l: &Local, face: &Face) -> i64 {
    let native = ACCOUNT.add(threads::settle(l, face));
    native.saturating_add(heap_probe::outside())
}

/// Runs the callback on this thread, with the busy mark held by the caller, and
/// measures what it freed. Then asks for a purge, so that what it freed leaves the
/// process's resident memory too.
fn run(l: &Local, face: &Face, need: u64) -> Run {
    let Some(callback) = reclaimer() else {
        return Run { freed: 0, panicked: false };
    };
    let before = used_now(l, face);
    let need = usize::try_from(need).unwrap_or(usize::MAX);
    let panicked = catch_unwind(AssertUnwindSafe(|| callback(need))).is_err();
    let after = used_now(l, face);
    purge::request(purge::Kind::Reclaim);
    Run { freed: u64::try_from(before.saturating_sub(after)).unwrap_or(0), panicked }
}

/// Queues a background reclaim of `need` bytes (de-duplicated, throttled), starting
/// the `memquota-reclaim` worker on first use.
pub(crate) fn request_background(need: u64) {
    if reclaimer().is_none() || !COORDINATOR.request_background(need, timing()) {
        return;
    }
    if !WORKER_STARTED.swap(true, AcqRel) {
        // This thread exists to reclaim: its own allocations are charged but never
        // wait for a reclaim.
        let spawned = threads::spawn_service("memquota-reclaim", || {
            let face = threads::face();
            let Some(l) = (face.local)() else { return };
            loop {
                COORDINATOR.serve_background(|need| run(l, face, need));
            }
        });
        if spawned.is_err() {
            WORKER_STARTED.store(false, Release);
        }
    }
}

/// The reclaims' part of a fork's prepare handler.
pub(crate) fn before_fork() {
    // SAFETY: from the prepare handler, followed by `after_fork` (fork.rs).
    unsafe { COORDINATOR.before_fork() };
}

/// The reclaims' part of a fork's parent and child handlers. In the child the
/// background worker does not exist.
///
/// # Safety
/// Only from the parent or child handler of the fork whose prepare handler called
/// [`before_fork`].
pub(crate) unsafe fn after_fork(child: bool) {
    // SAFETY: forwarded contract.
    unsafe { COORDINATOR.after_fork(child) };
    if child {
        WORKER_STARTED.store(false, Relaxed);
    }
}
