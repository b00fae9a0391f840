//! `free`, and small `malloc`, `calloc` and `realloc`, as plain calls into jemalloc,
//! counted in bulk (the machinery and why it is exact: `memquota_core`'s `bulk.rs`).
//! What is the preload's own:
//!
//! * the hook is registered from the constructor (`charge::register`), every half
//!   threshold at load bytes, so that the lead fits the slack with room for charges
//!   beside it; under 64 MiB limits there is no hook and no lazy call;
//! * `free` cannot know a block's size without a lookup, and a block with an owner
//!   record (2 MiB and up, once a scope exists) must credit the scope that owns it: no
//!   free is lazy once [`scopes::scopes_used`], which never goes back, and no thread
//!   turns lazy after it. Until then no thread is attached to a scope, so every lazy
//!   call is the process's; a thread that attaches settles first;
//! * every other jemalloc call that moves a total is counted by its caller (a big
//!   `malloc`, `calloc` or `realloc`, aligned and `mallocx` blocks, `rallocx`'s blocks,
//!   `xallocx`, a counted free once a scope exists) or was never charged (a refused
//!   `mallocx`'s block), or is the library's own (counted by
//!   `process/internal_alloc.rs`): all run [`guarded`] or [`measured`];
//! * a thread's jemalloc state is torn down when it exits, by jemalloc's own
//!   thread-specific-data destructor, which runs before memquota's exit flush (its key
//!   is created first). Allocations that destructors run between the two make on an
//!   exiting thread wait for that exit flush, which finds them in the totals.
//!
//! Here: the guards and the face's hooks, on the thread's slot. What a lazy thread's
//! calls took and gave back is handed to the ledger by `charge.rs` (`count_in_bulk`,
//! from the hook and `catch_up`), which this module is below.

use crate::malloc::thread::{slot, Slot};
use memquota_core::seam::{
    hot::{bulk, Lazy},
    scopes,
};

/// `Face::unseen`: what the calling thread owes, handed to the ledger.
pub(crate) fn unseen() -> i64 {
    bulk::unseen(&slot().bulk)
}

/// `Face::lazy`: lazy while the slack allows it and no scope has begun.
pub(crate) fn rearm(slack: u64) -> Lazy {
    bulk::rearm(&slot().bulk, slack, !scopes::scopes_used())
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
