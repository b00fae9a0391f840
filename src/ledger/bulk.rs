//! Counting a thread's calls into jemalloc in bulk, after the fact, from jemalloc's own
//! per-thread totals: what lets a face's fast path leave by a plain (tail) call into
//! jemalloc (the preload's `free` and small `malloc`, `calloc` and `realloc`).
//!
//! A counted call charges or credits the ledger around its call into jemalloc, and
//! needs a stack frame to keep its size across the call. While a thread is *lazy*
//! ([`Bulk::lazy_below`]), a face's small calls only call jemalloc, and what they took
//! and gave back is found later as the movement of jemalloc's totals of bytes the
//! thread allocated and freed (`thread.allocatedp`, `thread.deallocatedp`) since it
//! last settled ([`Bulk::allocated_base`], [`Bulk::freed_base`]):
//!
//! * jemalloc calls the face's hook on the thread every [`interval`] bytes it
//!   allocates and every interval it frees (`experimental.hooks.thread_event`, its
//!   per-thread user event, registered once by [`register`]); the hook calls
//!   [`on_event`], which counts what is owed;
//! * the ledger takes what is owed ([`unseen`]) wherever it takes the thread's delta:
//!   every slow path, flush, scope change, and the exit flush.
//!
//! Counted this way, a block counts as its usable size (jemalloc's size class), so
//! every other path of a face that has lazy calls counts usable sizes too: a block
//! charged as it is taken and freed lazily nets to zero.
//!
//! jemalloc fires the event on the call that crosses the interval, after it. So after
//! every call a lazy thread's allocations not yet counted are under its *lead*, one
//! interval plus the largest lazy allocation ([`SMALL_MAX`], [`lead`]), which the ledger
//! keeps out of the thread's room for charges: what it charged since its last flush
//! plus what waits stays under its slack, and the account is never lower than the
//! ledger's bound allows. Its frees not yet credited are under one interval (its *lag*,
//! part of the error bound on the side where the account is high), and nothing once it
//! has flushed.
//!
//! jemalloc postpones its event while the thread is inside the hook, or while its
//! state is being set up or torn down. Calls made then wait for the next event or
//! flush: a thread's state is set up before it turns lazy (see [`Bulk::armed`]), and
//! jemalloc's totals keep their values through its thread clean-up (a call after it
//! reincarnates the thread's state without resetting them), so the exit flush, whenever
//! it runs, finds what is owed.
//!
//! What keeps the count exact:
//!
//! * Every other jemalloc call that moves a total on a lazy thread is counted by its
//!   caller (a big block, an aligned one, a counted `realloc`) or was never charged:
//!   it runs in [`guarded`] or [`measured`], which add its movement to the bases; the
//!   hook, should it fire inside such a call, only notes that it did
//!   ([`Bulk::missed`]), and the bulk count follows once the caller has counted its
//!   own ([`catch_up`]). The same guard keeps the hook's own slow path from moving the
//!   totals a caller reads around its call.
//! * Only a thread whose slack is at least twice the interval is lazy, so its lead
//!   and its lag each fit its slack: a fresh thread, a tight one (past the limit,
//!   where every operation is exact), an exited one, and every thread once the limit
//!   is lowered far enough count each call as it happens. The ledger tells the face at
//!   every change of slack ([`rearm`]), with the delta just taken, and what is still
//!   owed then goes with the answer.
//! * Only a thread whose hook has fired is lazy ([`Bulk::armed`]): jemalloc arms the
//!   event for threads whose state it sets up after the registration, and for the
//!   registering thread; a thread that existed before would see its first event only
//!   at jemalloc's next own event.

use crate::base::size_class::SMALL_MAX;
use crate::base::sync::{AtomicU64, Ordering::*};
use crate::ledger::threads::Lazy;
use std::cell::Cell;
use tikv_jemalloc_sys as jem;

/// One thread's bulk-counting state. All-zero bytes are the valid initial state (not
/// lazy, totals not found), so it can live in a zero-initialised TLS block.
#[repr(C)]
pub struct Bulk {
    /// This thread's `thread.allocatedp` (null until found).
    pub allocated: Cell<*const u64>,
    /// This thread's `thread.deallocatedp` (null until found).
    pub deallocated: Cell<*const u64>,
    /// [`SMALL_MAX`] while the thread is lazy, 0 otherwise: a face's fast path makes a
    /// request lazy with one compare, `size < lazy_below`.
    pub lazy_below: Cell<u64>,
    /// The hook has fired on this thread (or it registered the hook): jemalloc has
    /// armed its event here.
    pub armed: Cell<bool>,
    /// Inside a call whose caller counts its own bytes ([`guarded`], [`measured`],
    /// [`deferred`]): the hook only notes that it fired.
    pub guard: Cell<bool>,
    /// The hook fired under the guard: [`catch_up`] counts after the call.
    pub missed: Cell<bool>,
    /// jemalloc's allocated total when this thread last settled, plus what counted
    /// calls moved since.
    pub allocated_base: Cell<u64>,
    /// The same for the freed total.
    pub freed_base: Cell<u64>,
}

impl Bulk {
    /// A thread's initial state (all zeros).
    pub const fn new() -> Bulk {
        Bulk {
            allocated: Cell::new(std::ptr::null()),
            deallocated: Cell::new(std::ptr::null()),
            lazy_below: Cell::new(0),
            armed: Cell::new(false),
            guard: Cell::new(false),
            missed: Cell::new(false),
            allocated_base: Cell::new(0),
            freed_base: Cell::new(0),
        }
    }

    /// Whether the thread's small calls go uncounted for now.
    #[inline(always)]
    pub fn lazy(&self) -> bool {
        self.lazy_below.get() != 0
    }

    fn set_lazy(&self, on: bool) {
        self.lazy_below.set(if on { SMALL_MAX as u64 } else { 0 });
    }
}

impl Default for Bulk {
    fn default() -> Self {
        Bulk::new()
    }
}

/// The hook's interval in bytes; 0 until it is registered (no thread is lazy then).
static INTERVAL: AtomicU64 = AtomicU64::new(0);

/// No hook under this interval: it would fire every few dozen small calls, and the
/// lead would leave no room for charges. From 8 KiB (a 64 MiB limit) up, lazy calls
/// cost fewer instructions than counting each call (docs/benchmarks.md, "Figures
/// behind the code").
pub const MIN_INTERVAL: u64 = 8 << 10;

/// The hook's interval: the most a lazy thread's frees wait for their credit.
pub fn interval() -> u64 {
    INTERVAL.load(Acquire)
}

/// The most a lazy thread's allocations wait for their charge: jemalloc's event
/// fires on the call that crosses the interval, and a lazy allocation takes at most
/// [`SMALL_MAX`] usable bytes.
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

/// Registers `hook` with jemalloc, every `interval` bytes allocated and freed, for
/// the calling thread's `b` and every thread after. Once per process: jemalloc
/// cannot unregister. Under [`MIN_INTERVAL`], or on failure (no such control, its
/// four slots taken), nothing is registered and no thread is ever lazy.
pub fn register(
    b: &Bulk,
    interval: u64,
    hook: extern "C" fn(is_alloc: bool, allocated: u64, deallocated: u64),
) -> bool {
    if interval < MIN_INTERVAL || INTERVAL.load(Acquire) != 0 {
        return false;
    }
    let hook = UserHook { callback: hook, interval, is_alloc_only: false };
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
    if rc != 0 {
        return false;
    }
    // jemalloc armed the event for the registering thread.
    b.armed.set(true);
    // Release: a thread that reads the interval sees jemalloc's registration.
    INTERVAL.store(interval, Release);
    true
}

/// Finds the calling thread's totals (`thread.allocatedp`, `thread.deallocatedp`);
/// they stay null if jemalloc cannot say. Only once jemalloc's control tree can be
/// used (the preload waits for its constructor).
pub fn find_totals(b: &Bulk) {
    b.allocated.set(counter(c"thread.allocatedp"));
    b.deallocated.set(counter(c"thread.deallocatedp"));
}

/// The address of one of the calling thread's totals; null on failure.
fn counter(name: &std::ffi::CStr) -> *const u64 {
    let mut p: *const u64 = std::ptr::null();
    let mut len = std::mem::size_of::<*const u64>();
    // SAFETY: a NUL-terminated control name whose value is a pointer; `p` and `len`
    // describe a buffer of that size. No new value is written.
    let rc = unsafe {
        jem::mallctl(name.as_ptr(), (&mut p as *mut *const u64).cast(), &mut len, std::ptr::null_mut(), 0)
    };
    if rc == 0 {
        p
    } else {
        std::ptr::null()
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
fn take(b: &Bulk) -> i64 {
    let (allocated, freed) = (b.allocated.get(), b.deallocated.get());
    if allocated.is_null() || freed.is_null() {
        return 0;
    }
    // SAFETY: non-null here, so this thread's thread.allocatedp and thread.deallocatedp.
    let (taken, given) = unsafe { (read(allocated), read(freed)) };
    let owed = taken.wrapping_sub(b.allocated_base.replace(taken));
    let paid = given.wrapping_sub(b.freed_base.replace(given));
    owed.wrapping_sub(paid) as i64
}

/// Counts what the thread owes with `count`.
fn settle(b: &Bulk, count: fn(i64)) {
    let owed = take(b);
    if owed != 0 {
        count(owed);
    }
}

/// The body of a face's hook: jemalloc's per-thread event, on the thread whose total
/// moved, from inside one of its calls, after its work (no lock of jemalloc's held).
/// `count` hands what is owed to the ledger (never refused: it is already taken).
pub fn on_event(b: &Bulk, count: fn(i64)) {
    b.armed.set(true);
    if !b.lazy() {
        return;
    }
    if b.guard.get() {
        b.missed.set(true); // inside a call its caller counts: after it
        return;
    }
    settle(b, count);
}

/// [`crate::ledger::threads::Face::unseen`]: what the calling thread owes, handed to the ledger.
pub fn unseen(b: &Bulk) -> i64 {
    if !b.lazy() || b.guard.get() {
        return 0;
    }
    take(b)
}

/// [`crate::ledger::threads::Face::lazy`]: the calling thread's slack is now `slack`, its delta
/// just taken. Lazy while its slack is at least twice the interval (loose, and the
/// limit not lowered far since the registration: its lead and its lag each fit its
/// slack), armed, with its totals found, and `allowed` by the face.
pub fn rearm(b: &Bulk, slack: u64, allowed: bool) -> Lazy {
    let interval = interval();
    let (allocated, freed) = (b.allocated.get(), b.deallocated.get());
    let want = allowed
        && interval != 0
        && slack >= 2 * interval
        && b.armed.get()
        && !allocated.is_null()
        && !freed.is_null();
    let was = b.lazy();
    if want && !was {
        // SAFETY: non-null here, so this thread's thread.allocatedp and
        // thread.deallocatedp.
        unsafe {
            b.allocated_base.set(read(allocated));
            b.freed_base.set(read(freed));
        }
        b.set_lazy(true);
    } else if was && !want {
        let unseen = take(b);
        b.set_lazy(false);
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
pub fn guarded<R>(b: &Bulk, call: impl FnOnce() -> R) -> R {
    let total = b.deallocated.get();
    if !b.lazy() || total.is_null() {
        return call();
    }
    // SAFETY: non-null here, so this thread's thread.deallocatedp.
    unsafe { measured(b, total, call) }.0
}

/// [`guarded`], with how far `call` moved jemalloc's total of bytes freed by this
/// thread; a thread that is not lazy only measures.
///
/// # Safety
/// `total` is the calling thread's `thread.deallocatedp` (non-null).
#[inline(always)]
pub unsafe fn measured<R>(b: &Bulk, total: *const u64, call: impl FnOnce() -> R) -> (R, u64) {
    if !b.lazy() {
        // SAFETY: this function's contract.
        let before = unsafe { read(total) };
        let r = call();
        // SAFETY: as for `before`; jemalloc has just written it, on this thread.
        return (r, (unsafe { read(total) }).wrapping_sub(before));
    }
    // A lazy thread has found both totals (`rearm`).
    let allocated = b.allocated.get();
    b.guard.set(true);
    // SAFETY: `total` by this function's contract; `allocated` is this thread's
    // thread.allocatedp, non-null on a lazy thread.
    let (taken, given) = unsafe { (read(allocated), read(total)) };
    let r = call();
    // SAFETY: as just above; jemalloc has just written them, on this thread.
    let (took, gave) = unsafe { (read(allocated).wrapping_sub(taken), read(total).wrapping_sub(given)) };
    // What the call moved is its caller's to count.
    b.allocated_base.set(b.allocated_base.get().wrapping_add(took));
    b.freed_base.set(b.freed_base.get().wrapping_add(gave));
    b.guard.set(false);
    (r, gave)
}

/// Runs `call`, a lazy jemalloc call that moves both totals, with the hook put off
/// until it returns; what it moved stays in the bulk count, which `count` takes if
/// the hook fired meanwhile. jemalloc's `realloc` adds the new block's usable size to
/// the allocated total, then the old block's to the freed total, each with its event:
/// a hook run between the two could turn the thread eager (past the limit), and the
/// second movement would then be counted by no one (the C torture caught it: 512 to
/// 3,584 bytes too many at quiescence).
#[inline(always)]
pub fn deferred<R>(b: &Bulk, count: fn(i64), call: impl FnOnce() -> R) -> R {
    // Inside a guarded call, the guard stays and that call's own catch-up counts.
    let outer = b.guard.replace(true);
    let r = call();
    b.guard.set(outer);
    if !outer {
        catch_up(b, count);
    }
    r
}

/// After a [`guarded`], [`measured`] or [`deferred`] call and its caller's own count:
/// counts what the hook put off while the call ran, with `count`.
#[inline(always)]
pub fn catch_up(b: &Bulk, count: fn(i64)) {
    if b.missed.get() {
        caught_up(b, count);
    }
}

#[cold]
#[inline(never)]
fn caught_up(b: &Bulk, count: fn(i64)) {
    b.missed.set(false);
    settle(b, count);
}
