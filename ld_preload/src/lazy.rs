//! `free`, and small `malloc`, `calloc` and `realloc`, as plain calls into jemalloc,
//! counted in bulk.
//!
//! A counted call reads jemalloc's per-thread total of bytes allocated or freed
//! around its call into jemalloc, or looks the size up first, and needs a stack frame
//! to keep what it read across the call. While a thread is *lazy*, `free`, and
//! `malloc`, `calloc` and `realloc` to under [`SMALL_MAX`] bytes, only call jemalloc
//! (`free`, `malloc` and `calloc` by a jump; `realloc` with the hook put off until it
//! returns, [`deferred`]), and what they took and gave back is found later as the
//! movement of those same totals since the thread last settled
//! (`Slot::allocated_base`, `Slot::freed_base`):
//!
//! * jemalloc calls [`on_event`] on the thread every [`interval`] bytes it allocates
//!   and every interval it frees (`experimental.hooks.thread_event`, its per-thread
//!   user event, registered at load by [`register`]): the hook counts what is owed;
//! * the ledger takes what is owed ([`unseen`]) wherever it takes the thread's delta:
//!   every slow path, flush, scope change, and the exit flush.
//!
//! jemalloc fires the event on the call that crosses the interval, after it. So after
//! every call a lazy thread's allocations not yet counted are under its *lead*, one
//! interval plus the largest lazy `malloc`, `calloc` or `realloc` ([`lead`]), which the
//! ledger keeps out of the thread's room for charges: what it charged since its last
//! flush plus what waits stays under its slack, and the account is never lower than the
//! ledger's bound allows. Its frees not yet credited are under one interval (its *lag*,
//! part of the error bound on the side where the account is high), and nothing once it
//! has flushed. The interval is half the threshold at load, so that the lead fits the
//! slack with room for charges beside it; under 64 MiB limits ([`MIN_INTERVAL`]) there is
//! no hook and no lazy call.
//!
//! jemalloc postpones its event while the thread is inside the hook, or while its
//! state is being set up or torn down. Calls made then wait for the next event or
//! flush: a thread's state is set up before it turns lazy (see `armed` below), and it
//! is torn down when the thread exits, by jemalloc's own thread-specific-data
//! destructor, which runs before memquota's exit flush (its key is created first).
//! Allocations that destructors run between the two make on an exiting thread wait
//! for that exit flush.
//!
//! What keeps the count exact:
//!
//! * Every other jemalloc call that moves a total is counted by its caller (a
//!   `malloc`, `calloc` or `realloc` to a big block, aligned and `mallocx` blocks,
//!   `rallocx`'s blocks, `xallocx`, a counted free once a scope exists) or was never
//!   charged (a refused `mallocx`'s block), or is the library's own (counted by
//!   `internal.rs`): it runs in [`guarded`] or [`measured`], which add its movement to
//!   the bases; the hook, should it fire inside such a call, only notes that it did
//!   (`missed`), and the bulk count follows once the caller has counted its own
//!   ([`catch_up`]). The same guard keeps the hook's own slow path from moving the
//!   allocated total that `mallocx` and `realloc` read around their calls.
//! * A block with an owner record (2 MiB and up, once a scope exists) must credit the
//!   scope that owns it: no free is lazy once [`face::scopes_used`], which never goes
//!   back, and no thread turns lazy after it. Until then no thread is attached to a
//!   scope, so every lazy call is the process's; a thread that attaches settles first.
//! * Only a thread whose slack is at least twice the interval is lazy, so its lead
//!   and its lag each fit its slack: a fresh thread, a tight one (past the limit,
//!   where every operation is exact), an exited one, and every thread once the limit
//!   is lowered under the one at load count each call as it happens. The ledger tells
//!   the face at every change of slack ([`rearm`]), with the delta just taken, and
//!   what is still owed then goes with the answer.
//! * Only a thread whose hook has fired is lazy (`Slot::armed`): jemalloc arms the
//!   event for threads whose state it sets up after the registration, and for the
//!   registering thread; a thread that existed before would see its first event only
//!   at jemalloc's next own event.
//! * jemalloc's totals only grow, and keep their values through its thread clean-up
//!   (a call after it reincarnates the thread's state without resetting them), so the
//!   exit flush, whenever it runs, finds what is owed.

use crate::malloc::count_in_bulk;
use crate::size_class::SMALL_MAX;
use crate::tls::{slot, Slot};
use memquota_core::face::{self, Lazy};
use std::sync::atomic::{AtomicU64, Ordering::*};
use tikv_jemalloc_sys as jem;

/// The hook's interval in bytes; 0 until it is registered (no thread is lazy then).
static INTERVAL: AtomicU64 = AtomicU64::new(0);

/// No hook under this interval (limits under 64 MiB, whose threshold is under twice
/// it): it would fire every few dozen small calls, and the lead would leave no room
/// for charges. At 8 KiB (a 64 MiB limit) lazy calls save 11-12 instructions per
/// malloc + free against counting each call (`benches/preload/churn.c 1 1000000`,
/// callgrind: `small` 147.9 -> 136.2, `mixed` 232.7 -> 220.7).
const MIN_INTERVAL: u64 = 8 << 10;

/// The hook's interval: the most a lazy thread's frees wait for their credit.
fn interval() -> u64 {
    INTERVAL.load(Acquire)
}

/// The most a lazy thread's allocations wait for their charge: jemalloc's event
/// fires on the call that crosses the interval, and a lazy `malloc`, `calloc` or
/// `realloc` takes at most [`SMALL_MAX`] usable bytes.
fn lead(interval: u64) -> u64 {
    interval + SMALL_MAX as u64
}

/// jemalloc's `user_hook_object_t` (`thread_event_registry.h`).
#[repr(C)]
struct UserHook {
    callback: extern "C" fn(is_alloc: bool, allocated: u64, deallocated: u64),
    interval: u64,
    is_alloc_only: bool,
}

/// Registers the hook with jemalloc, every half `threshold` bytes allocated and
/// freed. From the constructor, once jemalloc's control tree is set up; under
/// [`MIN_INTERVAL`], or on failure (no such control, its four slots taken), no
/// thread is ever lazy.
pub(crate) fn register(threshold: u64) {
    let interval = threshold / 2;
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

/// One of jemalloc's per-thread totals.
///
/// # Safety
/// `total` is the calling thread's `thread.allocatedp` or `thread.deallocatedp`
/// (non-null).
#[inline(always)]
unsafe fn read(total: *const u64) -> u64 {
    // SAFETY: this thread's jemalloc state, valid while the thread lives and written
    // only by it (this function's contract).
    unsafe { total.read_volatile() }
}

/// What the thread owes: allocated since `allocated_base` minus freed since
/// `freed_base`, not counted. Both bases move up to now.
fn take(s: &Slot) -> i64 {
    let (allocated, freed) = (s.allocated.get(), s.deallocated.get());
    if allocated.is_null() || freed.is_null() {
        return 0;
    }
    // SAFETY: non-null here, so this thread's thread.allocatedp and thread.deallocatedp.
    let (taken, given) = unsafe { (read(allocated), read(freed)) };
    let owed = taken.wrapping_sub(s.allocated_base.replace(taken));
    let paid = given.wrapping_sub(s.freed_base.replace(given));
    owed.wrapping_sub(paid) as i64
}

/// Counts what the thread owes.
fn settle(s: &Slot) {
    let owed = take(s);
    if owed != 0 {
        count_in_bulk(owed);
    }
}

/// jemalloc's per-thread event, on the thread whose total moved, from inside one of
/// its calls, after its work (no lock of jemalloc's held).
extern "C" fn on_event(_is_alloc: bool, _allocated: u64, _deallocated: u64) {
    let s = slot();
    s.armed.set(true);
    if !s.lazy() {
        return;
    }
    if s.guard.get() {
        s.missed.set(true); // inside a call its caller counts: after it
        return;
    }
    settle(s);
}

/// [`face::Face::unseen`]: what the calling thread owes, handed to the ledger.
pub(crate) fn unseen() -> i64 {
    let s = slot();
    if !s.lazy() || s.guard.get() {
        return 0;
    }
    take(s)
}

/// [`face::Face::lazy`]: the calling thread's slack is now `slack`, its delta just
/// taken. Lazy while its slack is at least twice the interval (loose, and the limit
/// not lowered since load: its lead and its lag each fit its slack), armed, with its
/// totals found, and no scope begun.
pub(crate) fn rearm(slack: u64) -> Lazy {
    let s = slot();
    let interval = interval();
    let (allocated, freed) = (s.allocated.get(), s.deallocated.get());
    let want = interval != 0
        && slack >= 2 * interval
        && s.armed.get()
        && !allocated.is_null()
        && !freed.is_null()
        && !face::scopes_used();
    let was = s.lazy();
    if want && !was {
        // SAFETY: non-null here, so this thread's thread.allocatedp and
        // thread.deallocatedp.
        unsafe {
            s.allocated_base.set(read(allocated));
            s.freed_base.set(read(freed));
        }
        s.set_lazy(true);
    } else if was && !want {
        let unseen = take(s);
        s.set_lazy(false);
        return Lazy { unseen, ..Lazy::default() };
    }
    match want {
        true => Lazy { lag: interval, lead: lead(interval), unseen: 0 },
        false => Lazy::default(),
    }
}

/// Runs `call` around a jemalloc call whose bytes the caller counts itself (or never
/// charged): they stay out of the bulk count. The hook waits while `call` runs, so
/// `call` may read jemalloc's per-thread totals around its jemalloc call and trust
/// their movement to be that call's alone; what the hook would have counted then
/// follows with [`catch_up`], which the caller calls once it has counted its own
/// bytes.
#[inline(always)]
pub(crate) fn guarded<R>(s: &Slot, call: impl FnOnce() -> R) -> R {
    let total = s.deallocated.get();
    if !s.lazy() || total.is_null() {
        return call();
    }
    // SAFETY: non-null here, so this thread's thread.deallocatedp.
    unsafe { measured(s, total, call) }.0
}

/// [`guarded`], with how far `call` moved jemalloc's total of bytes freed by this
/// thread; a thread that is not lazy only measures.
///
/// # Safety
/// `total` is the calling thread's `thread.deallocatedp` (non-null).
#[inline(always)]
pub(crate) unsafe fn measured<R>(s: &Slot, total: *const u64, call: impl FnOnce() -> R) -> (R, u64) {
    if !s.lazy() {
        // SAFETY: this function's contract.
        let before = unsafe { read(total) };
        let r = call();
        // SAFETY: as for `before`; jemalloc has just written it, on this thread.
        return (r, (unsafe { read(total) }).wrapping_sub(before));
    }
    // A lazy thread has found both totals (`rearm`).
    let allocated = s.allocated.get();
    s.guard.set(true);
    // SAFETY: `total` by this function's contract; `allocated` is this thread's
    // thread.allocatedp, non-null on a lazy thread.
    let (taken, given) = unsafe { (read(allocated), read(total)) };
    let r = call();
    // SAFETY: as just above; jemalloc has just written them, on this thread.
    let (took, gave) = unsafe { (read(allocated).wrapping_sub(taken), read(total).wrapping_sub(given)) };
    // What the call moved is its caller's to count.
    s.allocated_base.set(s.allocated_base.get().wrapping_add(took));
    s.freed_base.set(s.freed_base.get().wrapping_add(gave));
    s.guard.set(false);
    (r, gave)
}

/// Runs `call`, a lazy jemalloc call that moves both totals, with the hook put off
/// until it returns; what it moved stays in the bulk count. jemalloc's `realloc` adds
/// the new block's usable size to the allocated total, then the old block's to the
/// freed total, each with its event: a hook run between the two could turn the thread
/// eager (past the limit), and the second movement would then be counted by no one
/// (the C torture caught it: 512 to 3,584 bytes too many at quiescence).
#[inline(always)]
pub(crate) fn deferred<R>(s: &Slot, call: impl FnOnce() -> R) -> R {
    // Inside a guarded call (none calls it today), the guard stays and that call's
    // own catch-up counts.
    let outer = s.guard.replace(true);
    let r = call();
    s.guard.set(outer);
    if !outer {
        catch_up(s);
    }
    r
}

/// After a [`guarded`], [`measured`] or [`deferred`] call and its caller's own count:
/// counts what the hook put off while the call ran.
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
