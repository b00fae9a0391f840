//! The ledger: counting only. Each thread keeps a signed delta of the bytes it
//! allocated minus the bytes it freed; the delta is flushed to the process
//! [`Account`] when its magnitude would reach the thread's slack, at thread exit, and
//! on [`flush`]. No lock, no allocation, no syscall and no shared write on the fast
//! path: one subtract from a thread-local counter and a branch.
//!
//! Error bound: after every operation `|delta| < slack`, so the process total differs
//! from the true sum of live allocation sizes by less than the sum of the live
//! threads' slacks, itself at most `live_threads() * threshold`. A face may also let a
//! thread's calls wait before they reach the ledger (the preload's lazy `free` and
//! small `malloc`, tail calls into jemalloc counted in bulk), as the face declares
//! ([`Face::lazy`]):
//!
//! * frees, less than the thread's *lag* each, never more than its slack. They only
//!   make the total high, never low;
//! * allocations, less than the thread's *lead*, which the ledger takes out of the
//!   thread's room for charges: what it charged since its last flush plus what waits
//!   stays under its slack, so the low side of the bound does not move.
//!
//! So the total is within `(-slacks, slacks + lags)` of the truth, [`error_bound`] the
//! sum, at most `2 * live_threads() * threshold`. A thread picks up a new threshold at
//! its next flush; every flush, settle and exit takes what the face kept waiting with
//! the delta ([`Face::unseen`]).
//!
//! Over the limit: a flush adds the pending delta unconditionally (that memory is
//! already taken), and a thread leaves the slow path with its slack only while the
//! account is at or under the ceiling (`limit - heap`); past it the thread is *tight*
//! (slack 0: every allocation and free goes to the slow path, where admission is a
//! compare-and-swap against the ceiling) until a slow path finds the account under it
//! again. A thread adds at most one slack past the ceiling before it turns tight, and
//! cannot loosen while the account stays past it, so native plus heap stays at or
//! under `limit + error_bound()` for any program, including one that keeps
//! allocating after refusals (plus the over-commit allowance for requests under
//! `refuse_min`, and the emergency reserve refused threads draw on, `reserve.rs`).
//! The threshold is `clamp(limit / 4096, 4 KiB, 1 MiB)`: never looser
//! than ClickHouse's `clamp(tracked / 16, 4 KiB, 4 MiB)` once a process holds a
//! 256th of its limit.
//!
//! The per-thread state is a plain [`Local`] that each face keeps in thread-local
//! storage of its own ([`Face`]): the Rust face in `rust_face.rs`, the preload in
//! initial-exec TLS.
//!
//! Scopes (task memory managers, `arbitration/`) plug in here: a per-thread "current
//! scope" slot beside `delta`. Every flush attributes the delta to that scope, and a
//! thread that changes scope settles its delta into the old one first, so the fast
//! path stays exactly as it is.

mod rust_tls;

pub(crate) use rust_tls::{with as with_rust_local, RUST_FACE};

use crate::base::settings::threshold;
use crate::base::sync::{AtomicI64, AtomicPtr, AtomicU64, Ordering::Relaxed};
use crate::ledger::account::Account;
use crate::ledger::tables;
use std::cell::Cell;

/// The process's tracked native bytes.
pub(crate) static ACCOUNT: Account = Account::new();
/// Threads whose delta may be non-zero: registered and not yet exited.
static LIVE_THREADS: AtomicI64 = AtomicI64::new(0);
/// The sum of the live threads' allowances (their slack when not tight): the bound on
/// the unflushed error and on how far past the limit flushes can take the account.
/// After a `fork` it keeps the allowances of the threads that did not survive it:
/// what they had not flushed is in the child's memory, uncounted.
static SLACK_SUM: AtomicU64 = AtomicU64::new(0);
/// The sum of the live threads' lags: the most their faces' frees may wait before
/// they reach the ledger (the preload's frees, credited in bulk; see [`Face`]). Part
/// of the error bound on one side only: a free not yet credited leaves the account
/// above what is really in use, never below. Kept after a `fork` for the threads that
/// did not survive it, like [`SLACK_SUM`].
static LAG_SUM: AtomicU64 = AtomicU64::new(0);
/// Grants that left native plus heap past the limit.
static OVERCOMMITS: AtomicU64 = AtomicU64::new(0);
/// The face whose threads the background worker, `flush_thread` and the fork handlers
/// use: the last one seen on the slow path, or the one adopted; the Rust face until
/// then.
static FACE: AtomicPtr<Face> = AtomicPtr::new(&RUST_FACE as *const Face as *mut Face);

/// Makes `face` the process's face (see [`FACE`]).
pub(crate) fn adopt(face: &'static Face) {
    if !std::ptr::eq(FACE.load(Relaxed), face) {
        FACE.store(face as *const Face as *mut Face, Relaxed);
    }
}

/// The process's face (see [`FACE`]).
pub(crate) fn face() -> &'static Face {
    // SAFETY: FACE only ever holds pointers to `&'static Face` values.
    unsafe { &*FACE.load(Relaxed) }
}

/// The calling thread's state under the process's face.
pub(crate) fn this_thread() -> Option<&'static Local> {
    (face().local)()
}

/// Starts one of memquota's own service threads, exempt from the policy before its
/// first allocation. A thread of its own (`pthread_create`), not std's: std's start-up
/// code allocates on the new thread before the body runs (it copies the thread's name,
/// and it registers a TLS destructor for the spawn hooks, whose node glibc allocates
/// and aborts the process if it cannot: "failed to register TLS destructor"), so a
/// sampler, stats writer or reclaim worker whose thread started after the budget
/// filled was refused there. The kernel gets `name` (truncated to its 15 bytes), so
/// `top`, `ps` and debuggers show it. A panic in `body` ends the thread only.
pub fn spawn_service(name: &str, body: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    let mut kernel_name = [0u8; 16];
    let n = name.len().min(kernel_name.len() - 1);
    kernel_name[..n].copy_from_slice(&name.as_bytes()[..n]);
    let start: Box<dyn FnOnce() + Send> = Box::new(move || {
        crate::base::host::name_this_thread(&kernel_name);
        body()
    });
    let arg = Box::into_raw(Box::new(start));
    let mut thread: libc::pthread_t = 0;
    // SAFETY: `thread` is a valid out-pointer, null attributes are the defaults, and
    // `service_main` takes ownership of `arg` (a leaked box of the body) when it runs.
    let rc = unsafe { libc::pthread_create(&mut thread, std::ptr::null(), service_main, arg.cast()) };
    if rc != 0 {
        // SAFETY: no thread was created: the box is still ours, taken back once.
        drop(unsafe { Box::from_raw(arg) });
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    // SAFETY: a thread just created and joined by no one.
    unsafe { libc::pthread_detach(thread) };
    Ok(())
}

/// A service thread's first code: exempt, then the body [`spawn_service`] boxed.
extern "C" fn service_main(arg: *mut libc::c_void) -> *mut libc::c_void {
    // Busy before anything else, so that what the thread's start-up allocates and
    // frees (the box around its body, std's handle of the thread) goes straight to the
    // account before the thread registers: a program that checks the count exactly
    // once the thread is registered (tests/c/sampler.h) sees none of it.
    if let Some(l) = this_thread() {
        std::mem::forget(enter(l));
    }
    // SAFETY: `arg` is the box `spawn_service` leaked for this thread, taken once.
    let body: Box<dyn FnOnce() + Send> = *unsafe { Box::from_raw(arg.cast::<Box<dyn FnOnce() + Send>>()) };
    drop(std::thread::current());
    exempt_this_thread();
    // A panic must not unwind out of an `extern "C"` function (an abort).
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    std::ptr::null_mut()
}

/// Exempts the calling thread from the policy for the rest of its life: its
/// allocations are charged but never refused and never wait for a reclaim. For
/// memquota's own service threads, which never flush on their own: each of their
/// allocations and frees goes straight to the account (slack 0), so the process is
/// exact at quiescence without them.
fn exempt_this_thread() {
    let Some(l) = this_thread() else { return };
    if l.phase.get() == Phase::Fresh {
        // Registered like any thread, so that its exit is accounted for.
        let registered = face();
        ACCOUNT.add(settle(l, registered));
    }
    // Busy for good (it may be already: `service_main`).
    std::mem::forget(enter(l));
    ACCOUNT.add(rearm(l, true));
}

/// Runs `f` with the calling thread busy-marked: what memquota's own bookkeeping
/// allocates there (a scope's report, a snapshot, a copy of the last report) is
/// charged but never refused, so a call made at the limit cannot abort the process
/// through an infallible allocation of ours.
pub(crate) fn unpoliced<R>(f: impl FnOnce() -> R) -> R {
    let _busy = this_thread().and_then(enter);
    f()
}

/// Counts a grant that left native plus heap past the limit.
pub(crate) fn note_overcommit() {
    OVERCOMMITS.fetch_add(1, Relaxed);
}

/// Grants so far that left native plus heap past the limit.
pub(crate) fn overcommits() -> u64 {
    OVERCOMMITS.load(Relaxed)
}

pub(crate) fn live_threads() -> u64 {
    u64::try_from(LIVE_THREADS.load(Relaxed)).unwrap_or(0)
}

/// The current bound on `|tracked - true live bytes|`: the live threads' slacks, and
/// on the side where the account is high, their lags.
pub(crate) fn error_bound() -> u64 {
    SLACK_SUM.load(Relaxed).saturating_add(LAG_SUM.load(Relaxed))
}

#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Phase {
    /// Has not reached the slow path yet: slack 0, so its first operation does.
    Fresh = 0,
    /// Registered: its delta is flushed at exit.
    Live,
    /// Its exit flush ran: slack 0, so every later operation (another TLS destructor
    /// freeing memory) goes straight to the account.
    Exited,
}

/// One thread's ledger state. A face keeps one per thread in thread-local storage of
/// its choosing (see [`Face`]). All-zero bytes are the valid initial state, so it can
/// live in a zero-initialised TLS block.
#[repr(C)]
pub struct Local {
    /// `slack - lead` minus the bytes this thread allocated since its last flush: what
    /// its fast path may still charge. Kept above zero, so each charge is one subtract
    /// and a branch on its flags, and touches nothing else.
    up: Cell<u64>,
    /// `slack` minus the bytes this thread freed since its last flush: what its fast
    /// path may still credit. Kept above zero. The delta is `down - up - lead`; with
    /// both in `(0, slack]`, `|delta| < slack`, and what the face keeps waiting adds
    /// less than `lead` to it.
    down: Cell<u64>,
    /// The thread's slack: its allowance, or 0 while tight, `Fresh` or `Exited`, so
    /// every change goes slow.
    slack: Cell<u64>,
    /// The slack the thread is entitled to, counted in [`SLACK_SUM`]: the threshold
    /// while `Live`, else 0.
    allowance: Cell<u64>,
    /// Bytes already charged to the account by a gate ([`prepay`]) for the
    /// allocation that follows it on this thread.
    prepaid: Cell<u64>,
    phase: Cell<Phase>,
    /// The account was past the ceiling when this thread last left the slow path:
    /// its slack is 0 until a slow path finds it under the ceiling again.
    tight: Cell<bool>,
    /// Set while this thread runs memquota's own slow path (policy, reclaim callback,
    /// report): allocations made there are charged but never policed.
    busy: Cell<bool>,
    /// The scope this thread is attached to (a raw scope handle; 0: none). Read on the
    /// slow path only.
    scope: Cell<u64>,
    /// The thread's slot in the retry machine plus one (0: not in a retry block).
    /// Read on the slow path only.
    retry: Cell<u32>,
    /// Requests of this thread that may wait for a free, alive now (the free signal's
    /// waiters): a fork child's count of waiters starts from the forking thread's.
    /// Read on the slow path only.
    waiting: Cell<u32>,
    /// The emergency reserve's epoch in which this thread was last refused (0:
    /// never): it may draw on the reserve while the epoch lasts (`reserve.rs`). Read
    /// on the slow path only.
    refused: Cell<u32>,
    /// Bytes a gate in a retry block charged to the thread's scope and the account
    /// for the allocation that follows it ([`prepay_scoped`]).
    prepaid_scoped: Cell<u64>,
    /// The most this thread's frees may wait before its face hands them to the ledger
    /// ([`Face::lazy`]), counted in [`LAG_SUM`].
    lag: Cell<u64>,
    /// The most this thread's allocations may wait before its face hands them to the
    /// ledger ([`Face::lazy`]), kept out of `up`.
    lead: Cell<u64>,
}

impl Local {
    /// A fresh thread's state (all zeros).
    pub const fn new() -> Local {
        Local {
            up: Cell::new(0),
            down: Cell::new(0),
            slack: Cell::new(0),
            allowance: Cell::new(0),
            prepaid: Cell::new(0),
            phase: Cell::new(Phase::Fresh),
            tight: Cell::new(false),
            busy: Cell::new(false),
            scope: Cell::new(0),
            retry: Cell::new(0),
            waiting: Cell::new(0),
            refused: Cell::new(0),
            prepaid_scoped: Cell::new(0),
            lag: Cell::new(0),
            lead: Cell::new(0),
        }
    }
}

impl Default for Local {
    fn default() -> Self {
        Local::new()
    }
}

/// How a face reaches the calling thread's state. The Rust face uses a `thread_local!`;
/// a preloaded library, whose Rust thread-locals would be global-dynamic TLS (a call
/// to `__tls_get_addr`, which may call malloc), brings initial-exec TLS of its own.
pub struct Face {
    /// The calling thread's state; `None` if the thread has none any more.
    pub local: fn() -> Option<&'static Local>,
    /// Arranges for [`thread_exit`] to run when the calling thread exits; false if it
    /// cannot be arranged (the thread is already exiting). May allocate.
    pub register_exit: fn() -> bool,
    /// Whether the first slow path reads `MEMQUOTA_*` itself. A preloaded library
    /// says no: its first malloc may come before libc has set up the environment,
    /// and it configures the budget from its load-time constructor instead (no limit
    /// is enforced before that).
    pub configure_from_env: bool,
    /// Bytes the calling thread allocated minus bytes it gave back that the face has
    /// not handed to the ledger yet, handed over now (the face forgets them). Called
    /// on that thread wherever the ledger takes its delta, so every flush, settle and
    /// exit counts them. A face that counts every call as it happens returns 0.
    pub unseen: fn() -> i64,
    /// The calling thread's slack is now `slack` (0: fresh, tight or exited): the face
    /// says whether its calls may go uncounted for a while, and how far. Called on
    /// that thread after each change, with its delta just taken (or, on its first
    /// visit, still zero).
    pub lazy: fn(slack: u64) -> Lazy,
    /// A scope is beginning: big blocks get owner records from the moment
    /// [`crate::arbitration::scopes_used`] reads true, so a face whose calls skip the owner
    /// lookup must stop skipping it now. Called on the thread that begins the scope,
    /// each time one begins, before the scopes flag is set.
    pub scopes_began: fn(),
}

/// A face's answer to a new slack ([`Face::lazy`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Lazy {
    /// The most the thread's frees may now wait, in bytes, before the face hands them
    /// over through [`Face::unseen`] (0: every free is credited as it happens). Added
    /// to the error bound while the thread lives.
    pub lag: u64,
    /// The most the thread's allocations may now wait before the face hands them
    /// over (0: every allocation is charged as it happens). Under the slack: the
    /// ledger takes it out of the thread's room for charges.
    pub lead: u64,
    /// Bytes allocated minus bytes freed since the delta was taken that the face
    /// hands over with this answer (it stops deferring them): counted to the thread's
    /// scope at once.
    pub unseen: i64,
}

/// The Rust face counts every call as it happens.
pub(crate) fn nothing_unseen() -> i64 {
    0
}

/// The Rust face counts every call as it happens.
pub(crate) fn never_lazy(_slack: u64) -> Lazy {
    Lazy::default()
}

/// The Rust face looks every big block's owner up (`QuotaAlloc::dealloc`'s slow path).
pub(crate) fn no_skipped_lookups() {}

/// Records a charge of `bytes` if the thread's allocations since its last flush stay
/// under its slack (so an allocation at or above the threshold always goes to the
/// slow path, before memory is taken). Returns false when the caller must take the
/// slow path; nothing was recorded then.
///
/// Allocations and frees are counted apart, each against the slack: one compare per
/// call, where keeping the net delta between two bounds needed two counters updated
/// (or a second compare) per call. A thread that allocates and frees in balance
/// therefore reaches the slow path once per `slack` bytes allocated (and once per
/// `slack` freed) instead of never: a flush of a delta near zero, 150-odd
/// instructions per megabyte at the largest threshold.
#[inline(always)]
pub fn try_charge(l: &Local, bytes: u64) -> bool {
    take(&l.up, bytes)
}

/// [`try_charge`] for a fast path that leaves by a tail call on a miss (the preload's
/// `malloc`): on false the charge is still recorded, and the miss path must call
/// [`undo_charge`] with the same `bytes` before anything else touches the ledger.
/// Putting the bytes back inline cost that `malloc` a stack frame to keep its
/// argument across the call.
#[inline(always)]
pub fn charge_or_miss(l: &Local, bytes: u64) -> bool {
    subtract(&l.up, bytes)
}

/// Takes back the charge a false [`charge_or_miss`] left recorded.
pub fn undo_charge(l: &Local, bytes: u64) {
    give_back(&l.up, bytes);
}

/// Records a credit of `bytes` if the thread's frees since its last flush stay under
/// its slack.
#[inline(always)]
pub fn try_credit(l: &Local, bytes: u64) -> bool {
    take(&l.down, bytes)
}

/// Records `bytes` (either sign) that a face counted in bulk, after the calls that
/// took and gave them back ([`Face::lazy`]): a credit first gives back the room for
/// charges the thread used since its last flush, a charge the room for credits, and
/// only the rest takes from its own room. Returns what it could not record (0: all
/// of it), for the slow path.
///
/// The rooms stay in `(0, slack - lead]` and `(0, slack]`, so the delta keeps its
/// bounds. What changes is when a thread flushes: one whose big blocks are charged as
/// they are taken while its frees wait for the face (the preload's lazy `free`) got
/// its room for charges back only at a flush, every `slack` bytes it allocated; now
/// each bulk credit gives it back, and it flushes when its net delta nears the slack.
/// Off the fast path (once per interval), so the second step costs nothing there.
pub fn record_in_bulk(l: &Local, bytes: i64) -> i64 {
    let slack = l.slack.get();
    let (own, other, other_full) = match bytes < 0 {
        true => (&l.down, &l.up, slack - l.lead.get()),
        false => (&l.up, &l.down, slack),
    };
    let n = bytes.unsigned_abs();
    let back = other_full.saturating_sub(other.get()).min(n);
    other.set(other.get() + back);
    let rest = n - back;
    if rest == 0 || take(own, rest) {
        return 0;
    }
    if bytes < 0 {
        -(rest as i64)
    } else {
        rest as i64
    }
}

/// Takes `bytes` from `room` if that leaves some; otherwise leaves it as it was.
///
/// Subtracts and stores first, then checks the flags, and puts the bytes back out of
/// line when they did not fit: x86 does the common case in one read-modify-write
/// instruction and a branch, where a check before the store took a load, a subtract,
/// the branch and a store (the disassembly of `benches/alloc.rs`).
#[inline(always)]
fn take(room: &Cell<u64>, bytes: u64) -> bool {
    let fits = subtract(room, bytes);
    if !fits {
        give_back(room, bytes);
    }
    fits
}

/// Subtracts `bytes` from `room` and stores the result whatever it is; true if some
/// room is left.
#[inline(always)]
fn subtract(room: &Cell<u64>, bytes: u64) -> bool {
    let (left, borrow) = room.get().overflowing_sub(bytes);
    room.set(left);
    !borrow && left != 0
}

#[cold]
#[inline(never)]
fn give_back(room: &Cell<u64>, bytes: u64) {
    room.set(room.get().wrapping_add(bytes));
}

/// Charged minus credited since the last reset: `up` starts at `slack - lead`,
/// `down` at `slack`.
fn delta(l: &Local) -> i64 {
    l.down.get().wrapping_sub(l.up.get()).wrapping_sub(l.lead.get()) as i64
}

/// Takes the thread's delta, with what its face has not handed over yet.
fn take_delta(l: &Local) -> i64 {
    let unseen = (face().unseen)();
    let d = delta(l).wrapping_add(unseen);
    reset(l, l.slack.get());
    d
}

/// Gives the thread its whole slack on both sides, less its face's lead on the side
/// of charges: its delta is zero after.
fn reset(l: &Local, slack: u64) {
    l.up.set(slack - l.lead.get());
    l.down.set(slack);
}

/// Marks the thread busy in memquota's slow path for the guard's lifetime.
/// `None` if it already is: the caller is nested inside our own slow path.
pub fn enter(l: &Local) -> Option<Busy<'_>> {
    // Not `then_some(Busy(l))`: that builds the guard either way, and dropping the
    // unused one would clear the mark the outer slow path still holds.
    if l.busy.replace(true) {
        None
    } else {
        Some(Busy(l))
    }
}

/// RAII for [`enter`]: clears the busy mark on drop, also on unwind.
pub struct Busy<'a>(&'a Local);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.set(false);
    }
}

/// Takes the thread's delta, registering the thread (for the exit flush) on its first
/// visit and refreshing its allowance; a tight thread stays tight. The caller adds
/// the result to the account.
pub(crate) fn settle(l: &Local, face: &Face) -> i64 {
    if l.phase.get() == Phase::Fresh {
        l.phase.set(Phase::Live);
        LIVE_THREADS.fetch_add(1, Relaxed);
        // A fresh thread's delta is 0 (all went slow). Registering may allocate: with
        // the slack now set, those allocations land in the delta taken just below.
        set_allowance(l, threshold());
        if !(face.register_exit)() {
            l.phase.set(Phase::Exited);
            LIVE_THREADS.fetch_sub(1, Relaxed);
        }
    }
    let d = take_delta(l);
    set_allowance(l, if l.phase.get() == Phase::Live { threshold() } else { 0 });
    tables::attribute(l.scope.get(), d)
}

/// Ends a slow path: takes the delta (what the thread's own callbacks allocated on
/// the fast path meanwhile) and makes the thread tight if the account is past the
/// ceiling (`over`), loose otherwise. The caller adds the result to the account.
/// A thread whose tightness does not change keeps the slack its [`settle`] set (or a
/// nested one, a reclaim's): taking the delta gives it back whole, and its face
/// answers again at its next slow path.
pub(crate) fn rearm(l: &Local, over: bool) -> i64 {
    let d = take_delta(l);
    if l.tight.replace(over) != over {
        set_allowance(l, l.allowance.get());
    }
    tables::attribute(l.scope.get(), d)
}

/// Records that a gate charged `bytes` to the account for the allocation that
/// follows on this thread.
pub(crate) fn prepay(l: &Local, bytes: u64) {
    l.prepaid.set(l.prepaid.get().saturating_add(bytes));
}

/// Takes up to `bytes` of the thread's prepaid charge; returns what it took.
pub(crate) fn use_prepaid(l: &Local, bytes: u64) -> u64 {
    let have = l.prepaid.get();
    let took = have.min(bytes);
    l.prepaid.set(have - took);
    took
}

/// Takes what is left of the thread's prepaid charge (to be credited back).
pub(crate) fn take_prepaid(l: &Local) -> u64 {
    l.prepaid.replace(0)
}

/// Records that a gate in a retry block charged `bytes` to the thread's scope and to
/// the account for the allocation that follows on this thread.
pub(crate) fn prepay_scoped(l: &Local, bytes: u64) {
    l.prepaid_scoped.set(l.prepaid_scoped.get().saturating_add(bytes));
}

/// Takes up to `bytes` of the thread's scoped prepaid charge; returns what it took.
pub(crate) fn use_prepaid_scoped(l: &Local, bytes: u64) -> u64 {
    let have = l.prepaid_scoped.get();
    let took = have.min(bytes);
    l.prepaid_scoped.set(have - took);
    took
}

/// Takes what is left of the thread's scoped prepaid charge; returns the change the
/// account must see to give it back (to the thread's scope, and the process).
pub(crate) fn give_back_prepaid_scoped(l: &Local) -> i64 {
    let left = i64::try_from(l.prepaid_scoped.replace(0)).unwrap_or(i64::MAX);
    tables::attribute(l.scope.get(), -left)
}

/// The raw handle of the thread's scope (0: none).
pub(crate) fn scope_of(l: &Local) -> u64 {
    l.scope.get()
}

/// The thread's slot in the retry machine, if it is in a retry block.
pub(crate) fn retry_slot(l: &Local) -> Option<usize> {
    l.retry.get().checked_sub(1).map(|i| i as usize)
}

/// The thread's count of its requests that may wait for a free
/// ([`tables::signal::Waiter`]).
pub(crate) fn waiting(l: &Local) -> &Cell<u32> {
    &l.waiting
}

/// Sets (or, `None`, clears) the thread's slot in the retry machine.
pub(crate) fn set_retry_slot(l: &Local, slot: Option<usize>) {
    l.retry.set(slot.map_or(0, |i| i as u32 + 1));
}

/// The emergency reserve's epoch in which the thread was last refused (0: never).
pub(crate) fn refused_in(l: &Local) -> u32 {
    l.refused.get()
}

/// Records that the thread was refused in the emergency reserve's epoch `epoch`.
pub(crate) fn set_refused_in(l: &Local, epoch: u32) {
    l.refused.set(epoch);
}

/// Attributes `bytes` charged on the slow path to the thread's scope; returns the
/// change the process account must see.
pub(crate) fn attribute(l: &Local, bytes: i64) -> i64 {
    tables::attribute(l.scope.get(), bytes)
}

/// Moves the thread to scope `to`, settling its delta into the scope it leaves (and
/// that into the account). Returns the scope it left; `None`, the thread left where it
/// is, when `to` is a scope and the thread has no exit flush to come: its flush ran
/// already (a thread-exit destructor that runs after it detaches or ends a retry
/// block) or could not be registered. Nothing would take such a thread out of `to`
/// again, and its scope would count it attached for ever.
pub(crate) fn switch_scope(l: &Local, face: &Face, to: u64) -> Option<u64> {
    ACCOUNT.add(settle(l, face));
    if to != 0 && !has_exit_flush(l) {
        return None;
    }
    Some(l.scope.replace(to))
}

/// Whether the thread's exit flush is still to come (it is registered, and has not
/// run): only such a thread may join a scope or the retry machine, whose places the
/// flush gives back. A fresh thread registers at its first slow path ([`settle`]).
pub(crate) fn has_exit_flush(l: &Local) -> bool {
    l.phase.get() != Phase::Exited
}

/// The exit flush: moves the thread's delta to the account and makes every later
/// operation on this thread go straight to it.
pub fn thread_exit(l: &Local) {
    if l.phase.replace(Phase::Exited) == Phase::Live {
        LIVE_THREADS.fetch_sub(1, Relaxed);
    }
    let back = give_back_prepaid_scoped(l);
    let scope = l.scope.replace(0);
    let prepaid = i64::try_from(take_prepaid(l)).unwrap_or(i64::MAX);
    ACCOUNT.add(tables::attribute(scope, take_delta(l)) - prepaid + back);
    tables::thread_exited(scope);
    // A thread that exits inside a retry block (a C or Java caller that never ended
    // it) gives its slot back: the machine would count it as running for ever.
    if let Some(i) = retry_slot(l) {
        set_retry_slot(l, None);
        tables::retry::machine().free(i);
        tables::signal::wake();
    }
    l.tight.set(false);
    set_allowance(l, 0);
}

/// In a `fork` child only the forking thread exists. The live-thread count starts
/// again from it; [`SLACK_SUM`] and [`LAG_SUM`] keep the vanished threads' allowances
/// and lags, since what they had not flushed (or their faces not handed over) was
/// copied into the child and is never counted.
pub(crate) fn after_fork_child(l: Option<&Local>) {
    let live = l.is_some_and(|l| l.phase.get() == Phase::Live);
    LIVE_THREADS.store(i64::from(live), Relaxed);
}

/// Changes a thread's allowance, with its delta at zero, keeping [`SLACK_SUM`]
/// exact, and sets its slack from it. Only the owning thread calls this, so the old
/// value is read and written without a race.
fn set_allowance(l: &Local, allowance: u64) {
    replace_in_sum(&SLACK_SUM, &l.allowance, allowance);
    let slack = if l.tight.get() { 0 } else { allowance };
    l.slack.set(slack);
    let lazy = (face().lazy)(slack);
    replace_in_sum(&LAG_SUM, &l.lag, lazy.lag);
    l.lead.set(lazy.lead.min(slack));
    reset(l, slack);
    if lazy.unseen != 0 {
        ACCOUNT.add(tables::attribute(l.scope.get(), lazy.unseen));
    }
}

/// Sets a thread's part of `sum` to `new`: the sum moves by the difference.
fn replace_in_sum(sum: &AtomicU64, part: &Cell<u64>, new: u64) {
    let old = part.replace(new);
    if new > old {
        sum.fetch_add(new - old, Relaxed);
    } else if old > new {
        sum.fetch_sub(old - new, Relaxed);
    }
}

/// Charges `bytes` from inside our own slow path: straight to the account, no policy.
pub(crate) fn charge_nested(l: &Local, bytes: i64) {
    ACCOUNT.add(tables::attribute(l.scope.get(), take_delta(l).wrapping_add(bytes)));
}

/// The thread's unflushed delta in bytes.
pub fn pending(l: &Local) -> i64 {
    delta(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_counts_give_the_other_room_back_first_and_keep_the_delta_exact() {
        let l = Local::new();
        l.slack.set(1000);
        l.lead.set(300);
        reset(&l, 1000);
        assert_eq!(
            (l.up.get(), l.down.get(), delta(&l)),
            (700, 1000, 0),
            "the lead is out of the charges' room"
        );
        assert!(take(&l.up, 500));
        // A credit gives back the 500 charged first, then takes 100 of its own room.
        assert_eq!(record_in_bulk(&l, -600), 0);
        assert_eq!((l.up.get(), l.down.get(), delta(&l)), (700, 900, -100));
        // A charge gives back the 100 credited first.
        assert_eq!(record_in_bulk(&l, 250), 0);
        assert_eq!((l.up.get(), l.down.get(), delta(&l)), (550, 1000, 150));
        // Past what the rooms hold: what was given back stays recorded, the rest is
        // left for the slow path.
        assert_eq!(record_in_bulk(&l, -1000), 0);
        assert_eq!((l.up.get(), l.down.get(), delta(&l)), (700, 150, -850));
        assert_eq!(record_in_bulk(&l, -200), -200);
        assert_eq!(record_in_bulk(&l, 1600), 750);
        assert_eq!((l.up.get(), l.down.get(), delta(&l)), (700, 1000, 0), "850 given back, 750 left");
        // A tight thread (slack 0) records nothing on the fast path.
        let tight = Local::new();
        assert_eq!(record_in_bulk(&tight, 5), 5);
        assert_eq!(record_in_bulk(&tight, -5), -5);
        assert_eq!(delta(&tight), 0);
    }

    #[test]
    fn a_nested_enter_keeps_the_outer_mark() {
        let l = Local::new();
        let outer = enter(&l).expect("not busy yet");
        assert!(enter(&l).is_none(), "nested inside the slow path");
        assert!(l.busy.get(), "the nested enter must not clear the outer mark");
        drop(outer);
        assert!(!l.busy.get());
    }
}
