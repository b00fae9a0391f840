//! `fork()` from a multi-threaded process. A prepare handler takes every lock that
//! memquota's paths take, in one fixed order, so that no other thread is inside one of
//! them when the process is copied; the parent handler releases them; the child
//! handler releases them too, after resetting what the threads that did not survive
//! the fork left behind (a reclaim in flight, waiters, the background worker, the
//! live-thread count, a first configuration or purge decision under way, which the
//! child would otherwise wait for for ever). What those threads had not flushed stays
//! in the child's error bound (`threads::after_fork_child`). What the forking thread
//! holds itself (its waiters, its spill mark, its retry slot) stays.
//!
//! None of the handlers allocates: jemalloc's own fork handlers hold its locks around
//! ours when ours were registered first.

use crate::base::sync::{
    AtomicBool, OnceLock,
    Ordering::{AcqRel, Relaxed},
};
use crate::ledger::threads;
use crate::policy::reclaim;

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// A face's own fork handlers (the JVM driver's): registered from above, so this layer
/// never names a face. `before` runs first in prepare, `after` last in parent and child.
pub(crate) struct FaceHandlers {
    pub before: fn(),
    /// # Safety
    /// Called only from the parent or child handler of the fork whose prepare handler
    /// ran `before`, on the same thread.
    pub after: unsafe fn(child: bool),
}

static FACE: OnceLock<FaceHandlers> = OnceLock::new();

/// Registers a face's fork handlers; the first registration wins (there is one face
/// with handlers, the JVM driver, installed once).
#[cfg_attr(not(feature = "jvm"), allow(dead_code))] // the JVM face's
pub(crate) fn add_face_handlers(handlers: FaceHandlers) {
    let _ = FACE.set(handlers);
}

/// Registers the fork handlers, once per process.
pub(crate) fn install() {
    // A load first: every thread's first allocation comes here, and a swap would
    // write the shared line each time.
    if INSTALLED.load(Relaxed) || INSTALLED.swap(true, AcqRel) {
        return;
    }
    // SAFETY: registering plain extern "C" handlers, which stay valid for the life of
    // the process (this crate is never unloaded while its allocator is in use).
    unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
}

extern "C" fn prepare() {
    if let Some(face) = FACE.get() {
        (face.before)();
    }
    reclaim::before_fork();
    crate::policy::report::before_fork();
    crate::arbitration::before_fork();
}

extern "C" fn parent() {
    // SAFETY: the parent handler of the fork whose prepare handler took the locks,
    // on the same thread.
    unsafe {
        crate::arbitration::after_fork(false);
        crate::policy::report::after_fork(false);
        reclaim::after_fork(false);
        if let Some(face) = FACE.get() {
            (face.after)(false);
        }
    }
}

extern "C" fn child() {
    // The dynamic loader's lock may be held for ever here: `init` looks no more.
    crate::process::rendezvous::after_fork_child();
    // SAFETY: the child handler of the fork whose prepare handler took the locks, on
    // the only thread the child has.
    unsafe {
        crate::arbitration::after_fork(true);
        crate::policy::report::after_fork(true);
        reclaim::after_fork(true);
        crate::base::settings::after_fork_child();
        crate::policy::sampler::after_fork_child();
        crate::policy::purge::after_fork_child();
        crate::policy::profile::after_fork_child();
        threads::after_fork_child(threads::this_thread());
        if let Some(face) = FACE.get() {
            (face.after)(true);
        }
    }
}
