//! `free` as a tail call into jemalloc, its bytes credited in bulk.
//!
//! A free that reads jemalloc's per-thread total of freed bytes before and after its
//! call needs a stack frame to keep what it read across the call (19 instructions, three
//! registers saved). While a thread's frees are *lazy*, `free` only jumps to jemalloc,
//! and what it gave back is found later as the movement of that same total since the
//! thread last settled (`Slot::base`):
//!
//! * jemalloc calls [`on_event`] on the thread every [`interval`] bytes it allocates
//!   and every interval it frees (`experimental.hooks.thread_event`, its per-thread
//!   user event, registered at load by [`register`]): the hook credits what is owed;
//! * the ledger takes what is owed ([`unseen`]) wherever it takes the thread's delta:
//!   every slow path, flush, scope change, and the exit flush.
//!
//! So after every free a thread owes less than one interval (the ledger's *lag*,
//! part of its error bound, on the side where the account is high), and nothing once
//! it has flushed. (jemalloc postpones its event while the thread is inside the hook,
//! or its state is being set up or torn down: frees made then wait for the next event
//! or flush.) The interval is the threshold at load; under 64 MiB limits
//! ([`MIN_INTERVAL`]) there is no hook and no lazy free.
//!
//! What keeps the count exact:
//!
//! * Every other jemalloc call that moves the total is credited by its caller
//!   (realloc's old block, xallocx, a counted free once a scope exists) or was never
//!   charged (a refused mallocx's block), or is the library's own (counted by
//!   `internal.rs`): it runs in [`guarded`] or [`measured`], which add its movement to
//!   `base`; the hook, should it fire inside such a call, only notes that it did
//!   (`missed`), and the bulk credit follows once the caller has credited its own
//!   ([`catch_up`]). The same guard keeps the hook's own slow path from moving the
//!   allocated total that `mallocx` and `realloc` read around their calls.
//! * A block with an owner record (2 MiB and up, once a scope exists) must credit the
//!   scope that owns it: no free is lazy once [`face::scopes_used`], which never goes
//!   back. Until then no thread is attached to a scope, so every lazy free is the
//!   process's; a thread that attaches settles first.
//! * Only a thread whose slack is at least the interval is lazy, so its lag never
//!   passes its slack: a fresh thread, a tight one (past the limit, where every
//!   operation is exact), an exited one, and every thread once the limit is lowered
//!   under the one at load credit each free as it happens. The ledger tells the face
//!   at every change of slack ([`rearm`]), with the delta just taken, and what is
//!   still owed then goes with the answer.
//! * Only a thread whose hook has fired is lazy (`Slot::armed`): jemalloc arms the
//!   event for threads whose state it sets up after the registration, and for the
//!   registering thread; a thread that existed before would see its first event only
//!   at jemalloc's next own event.
//! * jemalloc's totals only grow, and keep their values through its thread clean-up
//!   (a free after it reincarnates the thread's state without resetting them), so
//!   the exit flush, whenever it runs, finds what is owed.

use crate::malloc::credit;
use crate::tls::{slot, Slot};
use memquota_core::face::{self, LazyFrees};
use std::sync::atomic::{AtomicU64, Ordering::*};
use tikv_jemalloc_sys as jem;

/// The hook's interval in bytes; 0 until it is registered (no thread is lazy then).
static INTERVAL: AtomicU64 = AtomicU64::new(0);

/// No hook under this interval (limits under 64 MiB, whose threshold is smaller): it
/// would fire every few dozen small frees, and each firing credits more than the
/// thread's slack, a slow path. Measured on `benches/preload/churn.c 1 1000000 small`
/// (instructions per malloc + free against counting each free): 4 KiB +18, 8 KiB +3,
/// 16 KiB -4, 32 KiB -8, 64 KiB -11, 1 MiB -12.
const MIN_INTERVAL: u64 = 16 << 10;

/// The hook's interval: the most a lazy thread's frees wait for their credit.
fn interval() -> u64 {
    INTERVAL.load(Acquire)
}

/// jemalloc's `user_hook_object_t` (`thread_event_registry.h`).
#[repr(C)]
struct UserHook {
    callback: extern "C" fn(is_alloc: bool, allocated: u64, deallocated: u64),
    interval: u64,
    is_alloc_only: bool,
}

/// Registers the hook with jemalloc, every `interval` bytes allocated and freed: the
/// threshold at load, so that frees wait for their credit no longer than allocations
/// wait for their flush. From the constructor, once jemalloc's control tree is set up;
/// under [`MIN_INTERVAL`], or on failure (no such control, its four slots taken), no
/// thread is ever lazy.
pub(crate) fn register(interval: u64) {
    if interval < MIN_INTERVAL {
        return;
    }
    let hook = UserHook { callback: on_event, interval, is_alloc_only: false };
    // SAFETY: a NUL-terminated control name whose new value is a user_hook_object_t,
    // which jemalloc copies: `hook` and its size describe one. No old value is read.
    let rc = unsafe {
        jem::mallctl(
            c"experimental.hooks.thread_event".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            (&hook as *const UserHook).cast_mut().cast(),
            std::mem::size_of::<UserHook>(),
        )
    };
    if rc == 0 {
        // jemalloc armed the event for the registering thread.
        slot().armed.set(true);
        // Release: a thread that reads the interval sees jemalloc's registration.
        INTERVAL.store(interval, Release);
    }
}

/// jemalloc's total of bytes freed by this thread.
///
/// # Safety
/// `total` is the calling thread's `thread.deallocatedp` (non-null).
#[inline(always)]
unsafe fn read(total: *const u64) -> u64 {
    // SAFETY: this thread's jemalloc state, valid while the thread lives and written
    // only by it (this function's contract).
    unsafe { total.read_volatile() }
}

/// What the thread owes: freed since `base`, not credited. `base` moves up to now.
fn take(s: &Slot) -> u64 {
    let total = s.deallocated.get();
    if total.is_null() {
        return 0;
    }
    // SAFETY: a non-null `deallocated` is this thread's thread.deallocatedp.
    let now = unsafe { read(total) };
    let owed = now.wrapping_sub(s.base.get());
    s.base.set(now);
    owed
}

/// Credits what the thread owes.
fn settle(s: &Slot) {
    let owed = take(s);
    if owed != 0 {
        credit(owed as usize);
    }
}

/// jemalloc's per-thread event, on the thread whose total moved, from inside one of
/// its calls (no lock of jemalloc's held).
extern "C" fn on_event(_is_alloc: bool, _allocated: u64, _deallocated: u64) {
    let s = slot();
    s.armed.set(true);
    if !s.lazy.get() {
        return;
    }
    if s.guard.get() {
        s.missed.set(true); // inside a call whose frees its caller credits: after it
        return;
    }
    settle(s);
}

/// [`face::Face::unseen_frees`]: what the calling thread owes, handed to the ledger.
pub(crate) fn unseen() -> u64 {
    let s = slot();
    if !s.lazy.get() || s.guard.get() {
        return 0;
    }
    take(s)
}

/// [`face::Face::lazy_frees`]: the calling thread's slack is now `slack`, its delta
/// just taken. Lazy while its slack is at least the interval (loose, and the limit not
/// lowered since load: a thread's lag never passes its slack), armed, with its totals
/// found, and no scope begun.
pub(crate) fn rearm(slack: u64) -> LazyFrees {
    let s = slot();
    let interval = interval();
    let total = s.deallocated.get();
    let want =
        interval != 0 && slack >= interval && s.armed.get() && !total.is_null() && !face::scopes_used();
    let was = s.lazy.get();
    if want && !was {
        // SAFETY: non-null here, so this thread's thread.deallocatedp.
        s.base.set(unsafe { read(total) });
        s.lazy.set(true);
    } else if was && !want {
        let unseen = take(s);
        s.lazy.set(false);
        return LazyFrees { lag: 0, unseen };
    }
    LazyFrees { lag: if want { interval } else { 0 }, unseen: 0 }
}

/// Runs `call` around a jemalloc call that may give memory back whose bytes the
/// caller credits itself (or never charged): they stay out of the bulk credit. The
/// hook waits while `call` runs, so `call` may read jemalloc's per-thread totals
/// around its jemalloc call and trust their movement to be that call's alone; what
/// the hook would have credited then follows with [`catch_up`], which the caller
/// calls once it has credited its own bytes.
#[inline(always)]
pub(crate) fn guarded<R>(s: &Slot, call: impl FnOnce() -> R) -> R {
    let total = s.deallocated.get();
    if !s.lazy.get() || total.is_null() {
        return call();
    }
    // SAFETY: non-null here, so this thread's thread.deallocatedp.
    unsafe { measured(s, total, call) }.0
}

/// [`guarded`], with how far `call` moved jemalloc's total of bytes freed by this
/// thread; a thread whose frees are not lazy only measures.
///
/// # Safety
/// `total` is the calling thread's `thread.deallocatedp` (non-null).
#[inline(always)]
pub(crate) unsafe fn measured<R>(s: &Slot, total: *const u64, call: impl FnOnce() -> R) -> (R, u64) {
    let lazy = s.lazy.get();
    if lazy {
        s.guard.set(true);
    }
    // SAFETY: this function's contract.
    let before = unsafe { read(total) };
    let r = call();
    // SAFETY: as for `before`; jemalloc has just written it, on this thread.
    let moved = (unsafe { read(total) }).wrapping_sub(before);
    if lazy {
        // What the call moved is its caller's to credit.
        s.base.set(s.base.get().wrapping_add(moved));
        s.guard.set(false);
    }
    (r, moved)
}

/// After a [`guarded`] or [`measured`] call and its caller's own credit: credits what
/// the hook put off while the call ran.
#[inline(always)]
pub(crate) fn catch_up(s: &Slot) {
    if s.missed.get() {
        caught_up(s);
    }
}

#[cold]
#[inline(never)]
fn caught_up(s: &Slot) {
    s.missed.set(false);
    settle(s);
}
