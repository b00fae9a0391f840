//! `fork()` from a multi-threaded process. A prepare handler takes every lock that
//! memquota's paths take, in one fixed order, so that no other thread is inside one of
//! them when the process is copied; the parent handler releases them; the child
//! handler releases them too, after resetting what the threads that did not survive
//! the fork left behind (a reclaim in flight, waiters, the background worker, the
//! live-thread count, a first configuration or purge decision under way, which the
//! child would otherwise wait for for ever). What those threads had not flushed stays
//! in the child's error bound (`ledger::after_fork_child`). What the forking thread
//! holds itself (its waiters, its spill mark, its retry slot) stays.
//!
//! None of the handlers allocates: jemalloc's own fork handlers hold its locks around
//! ours when ours were registered first.

use crate::{ledger, reclaim};
use std::sync::atomic::{
    AtomicBool,
    Ordering::{AcqRel, Relaxed},
};

static INSTALLED: AtomicBool = AtomicBool::new(false);

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
    #[cfg(feature = "jvm")]
    crate::jvm::before_fork();
    reclaim::before_fork();
    crate::report::before_fork();
    crate::scope::before_fork();
}

extern "C" fn parent() {
    // SAFETY: the parent handler of the fork whose prepare handler took the locks,
    // on the same thread.
    unsafe {
        crate::scope::after_fork(false);
        crate::report::after_fork(false);
        reclaim::after_fork(false);
        #[cfg(feature = "jvm")]
        crate::jvm::after_fork(false);
    }
}

extern "C" fn child() {
    // The dynamic loader's lock may be held for ever here: `init` looks no more.
    crate::rendezvous::after_fork_child();
    // SAFETY: the child handler of the fork whose prepare handler took the locks, on
    // the only thread the child has.
    unsafe {
        crate::scope::after_fork(true);
        crate::report::after_fork(true);
        reclaim::after_fork(true);
        crate::settings::after_fork_child();
        crate::untracked::after_fork_child();
        crate::purge::after_fork_child();
        ledger::after_fork_child(ledger::this_thread());
        #[cfg(feature = "jvm")]
        crate::jvm::after_fork(true);
    }
}
