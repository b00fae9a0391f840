//! `free`, and small `malloc`, `calloc` and `realloc`, as plain calls into jemalloc,
//! counted in bulk (the machinery and why it is exact: `memquota_core`'s `bulk.rs`).
//! What is the preload's own:
//!
//! * the hook is registered from the constructor, every half threshold at load bytes,
//!   so that the lead fits the slack with room for charges beside it; under 64 MiB
//!   limits there is no hook and no lazy call;
//! * `free` cannot know a block's size without a lookup, and a block with an owner
//!   record (2 MiB and up, once a scope exists) must credit the scope that owns it: no
//!   free is lazy once [`face::scopes_used`], which never goes back, and no thread
//!   turns lazy after it. Until then no thread is attached to a scope, so every lazy
//!   call is the process's; a thread that attaches settles first;
//! * every other jemalloc call that moves a total is counted by its caller (a big
//!   `malloc`, `calloc` or `realloc`, aligned and `mallocx` blocks, `rallocx`'s blocks,
//!   `xallocx`, a counted free once a scope exists) or was never charged (a refused
//!   `mallocx`'s block), or is the library's own (counted by `internal.rs`): all run
//!   [`guarded`] or [`measured`];
//! * a thread's jemalloc state is torn down when it exits, by jemalloc's own
//!   thread-specific-data destructor, which runs before memquota's exit flush (its key
//!   is created first). Allocations that destructors run between the two make on an
//!   exiting thread wait for that exit flush, which finds them in the totals.

use crate::malloc::charge::count_in_bulk;
use crate::malloc::thread::{slot, Slot};
use memquota_core::face::{self, bulk, Lazy};

/// Registers the hook with jemalloc, every half `threshold` bytes allocated and
/// freed. From the constructor, once jemalloc's control tree is set up.
pub(crate) fn register(threshold: u64) {
    bulk::register(&slot().bulk, threshold / 2, on_event);
}

/// jemalloc's per-thread event (see [`bulk::on_event`]).
extern "C" fn on_event(_is_alloc: bool, _allocated: u64, _deallocated: u64) {
    bulk::on_event(&slot().bulk, count_in_bulk);
}

/// [`face::Face::unseen`]: what the calling thread owes, handed to the ledger.
pub(crate) fn unseen() -> i64 {
    bulk::unseen(&slot().bulk)
}

/// [`face::Face::lazy`]: lazy while the slack allows it and no scope has begun.
pub(crate) fn rearm(slack: u64) -> Lazy {
    bulk::rearm(&slot().bulk, slack, !face::scopes_used())
}

/// [`bulk::guarded`] on the thread's slot.
#[inline(always)]
pub(crate) fn guarded<R>(s: &Slot, call: impl FnOnce() -> R) -> R {
    bulk::guarded(&s.bulk, call)
}

/// [`bulk::measured`] on the thread's slot.
///
/// # Safety
/// `total` is the calling thread's `thread.deallocatedp` (non-null).
#[inline(always)]
pub(crate) unsafe fn measured<R>(s: &Slot, total: *const u64, call: impl FnOnce() -> R) -> (R, u64) {
    // SAFETY: this function's contract.
    unsafe { bulk::measured(&s.bulk, total, call) }
}

/// [`bulk::deferred`] on the thread's slot.
#[inline(always)]
pub(crate) fn deferred<R>(s: &Slot, call: impl FnOnce() -> R) -> R {
    bulk::deferred(&s.bulk, count_in_bulk, call)
}

/// [`bulk::catch_up`] on the thread's slot.
#[inline(always)]
pub(crate) fn catch_up(s: &Slot) {
    bulk::catch_up(&s.bulk, count_in_bulk);
}
