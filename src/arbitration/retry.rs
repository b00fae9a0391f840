//! Work that completes under pressure: retry blocks. Inside [`with_retry`] a request
//! that does not fit after spills and reclaims waits for memory to be freed instead of
//! failing; when every active task is blocked the machine (`tables::retry`) rolls the
//! youngest back (`Error::RetryOom`: its attempt unwinds, waits until further notice,
//! and runs again) or, when only one task is still short, makes it split its input
//! (`Error::SplitAndRetryOom`, which [`with_split_retry`] answers by splitting). A
//! watchdog bounds every wait: a request blocked longer than the retry wait is refused
//! with the report, as outside a retry block. See docs/scopes.md, "Retry blocks".

use super::handles::{AttachGuard, TaskScope};
use super::{attach_raw, detach_raw};
use crate::base::error::{Error, Result};
use crate::base::settings::quota;
use crate::base::sync::{AtomicU64, MutexGuard, Ordering::Relaxed};
use crate::ledger::tables::pool::POOL;
use crate::ledger::tables::retry::{active_tasks, machine, rank_of, Active, Machine, Rollback, State};
use crate::ledger::tables::signal::{self, Waiter};
use crate::ledger::tables::MAX_SCOPES;
use crate::ledger::threads::{self, Face, Local, ACCOUNT};
use crate::policy::heap_probe;
use std::time::{Duration, Instant};

/// Attempts one thread may run again after rollbacks before the error is returned.
pub const MAX_RETRIES: u32 = 500;
/// How often a waiting thread looks again without a signal: a free on the fast path
/// (a thread's delta under its slack) does not signal.
const POLL: Duration = Duration::from_millis(10);
/// The watchdog: the longest a request in a retry block stays blocked, in ms.
static RETRY_WAIT_MS: AtomicU64 = AtomicU64::new(10_000);

/// Sets the longest a request in a retry block waits for memory before it is refused
/// with the report (the watchdog; default 10 s).
pub(crate) fn set_retry_wait(d: Duration) {
    RETRY_WAIT_MS.store(u64::try_from(d.as_millis()).unwrap_or(u64::MAX), Relaxed);
}

fn retry_wait() -> Duration {
    Duration::from_millis(RETRY_WAIT_MS.load(Relaxed))
}

/// How a blocked request ended.
pub(crate) enum Verdict {
    /// Room appeared: try the request again.
    Again,
    /// The machine chose this thread, or its scope ended: the request fails with the
    /// rollback.
    Rolled(Rollback),
    /// The watchdog ended the wait: refuse, with the report.
    TimedOut,
}

/// Whether the calling thread is in a retry block.
pub(crate) fn in_block(l: &Local) -> bool {
    threads::retry_slot(l).is_some()
}

/// A request in a retry block went past spills to the process budget's own
/// admission (reclaims): the thread is allocating.
pub(crate) fn note_allocating(l: &Local) {
    if let Some(i) = threads::retry_slot(l) {
        machine().set(i, State::Allocating);
    }
}

/// A request in a retry block was granted: the thread runs on.
pub(crate) fn note_granted(l: &Local) {
    if let Some(i) = threads::retry_slot(l) {
        let mut m = machine();
        if m.state(i) == State::Allocating {
            m.set(i, State::Running);
        }
    }
}

/// Takes a request the machine made of slot `i`, if any.
fn take_request(m: &mut Machine, i: usize) -> Option<Verdict> {
    let r = match m.state(i) {
        State::RollbackRequested => {
            m.set(i, State::RollingBack);
            m.totals.rollbacks += 1;
            Rollback::Retry
        }
        State::SplitRequested => {
            m.set(i, State::Running);
            m.totals.splits += 1;
            Rollback::Split
        }
        _ => return None,
    };
    m.set_last(i, Some(r));
    Some(Verdict::Rolled(r))
}

/// What the budget counts beside the native account (the heap probe), read before the
/// machine is locked: the probe may be user code (a JNI call, a function that takes
/// the user's locks), and a thread holding such a lock may be on its way into the
/// machine. Read on a busy-marked thread: a probe function that allocates is charged,
/// never policed, so it cannot come back to the machine.
fn outside() -> i64 {
    heap_probe::outside()
}

/// Every scope with threads attached, with its room now. Read with the machine
/// locked, after the states: a thread shown waiting has given back what it had freed
/// by then. `outside` is [`outside`], read just before the lock.
struct Tasks {
    active: [Active; MAX_SCOPES],
    n: usize,
}

impl Tasks {
    fn now(outside: i64) -> Tasks {
        let mut t = Tasks { active: [Active::default(); MAX_SCOPES], n: 0 };
        t.n = active_tasks(&mut t.active, quota().headroom(ACCOUNT.native(), outside));
        t
    }

    fn get(&self) -> &[Active] {
        &self.active[..self.n]
    }
}

/// Whether scope `task` has ended: nothing the machine reads would ever wake its
/// waiters (an ended task is in no list), so they must look themselves. `end` wakes
/// them.
fn ended(task: u64) -> bool {
    rank_of(task).is_none()
}

/// A blocked request whose scope ended: fails with [`Rollback::Ended`]
/// ([`Error::ScopeEnded`]; `memquota_last_refusal` says so), the thread running on.
fn scope_ended(m: &mut Machine, i: usize) -> Verdict {
    m.set(i, State::Running);
    m.totals.scope_ended += 1;
    m.set_last(i, Some(Rollback::Ended));
    Verdict::Rolled(Rollback::Ended)
}

/// Runs the deadlock rule; true if it acted (the waiters were woken to see it).
fn resolve(mut m: MutexGuard<'_, Machine>, tasks: &Tasks) -> bool {
    let acted = m.resolve(tasks.get()).is_some();
    drop(m);
    if acted {
        signal::wake();
    }
    acted
}

/// A request of `need` bytes for scope `task` that did not fit after spills and
/// reclaims, on a thread in a retry block: waits for memory to be freed. Called busy,
/// with no lock held; `first` for the request's first wait (what the stats count).
pub(crate) fn block(l: &Local, task: u64, need: u64, first: bool) -> Verdict {
    let Some(i) = threads::retry_slot(l) else { return Verdict::TimedOut };
    // A request larger than the whole pool, or than its scope's cap, can never fit:
    // it splits at once. Blocked, it would count as a task short that rolling others
    // back could help, and the youngest would be rolled back again and again.
    let (pool, held, cap) = {
        let p = POOL.lock();
        let s = p.scope(task);
        (p.share().pool, s.map_or(0, |s| s.held), s.map_or(i64::MAX, |s| s.cap))
    };
    let (pool, held) = (u64::try_from(pool).unwrap_or(0), u64::try_from(held).unwrap_or(0));
    if need > pool || need > u64::try_from(cap).unwrap_or(0) {
        let mut m = machine();
        m.totals.splits += 1;
        m.set_last(i, Some(Rollback::Split));
        return Verdict::Rolled(Rollback::Split);
    }
    let rank = rank_of(task).unwrap_or((u64::MAX, u64::MAX));
    let _waiter = Waiter::new(threads::waiting(l));
    machine().block(i, task, rank, need, held.min(pool - need), first);
    let deadline = Instant::now() + retry_wait();
    let mut waited = false;
    loop {
        let seen = signal::generation();
        let outside = outside();
        let mut m = machine();
        if ended(task) {
            return scope_ended(&mut m, i);
        }
        let tasks = Tasks::now(outside);
        if let Some(v) = take_request(&mut m, i) {
            return v;
        }
        if waited && m.may_proceed(i, tasks.get()) {
            m.set(i, State::Allocating);
            return Verdict::Again;
        }
        if Instant::now() >= deadline {
            m.set(i, State::Running);
            m.totals.timeouts += 1;
            return Verdict::TimedOut;
        }
        if resolve(m, &tasks) {
            continue;
        }
        signal::wait_for_free(seen, deadline.min(Instant::now() + POLL));
        waited = true;
    }
}

/// After an attempt rolled back: waits until further notice (BUFN), until there is
/// room for what it failed on and no thread of an older task is blocked (a task
/// ending makes both true), or the machine resumes it. Never longer than the retry
/// wait. [`Error::ScopeEnded`] at once when the thread's own scope ends.
fn wait_until_further_notice(l: &Local, i: usize, task: u64) -> Result<()> {
    let _busy = threads::enter(l);
    let _waiter = Waiter::new(threads::waiting(l));
    let _yielding = Yielding::new(task);
    machine().set(i, State::Bufn);
    let deadline = Instant::now() + retry_wait();
    loop {
        let seen = signal::generation();
        let outside = outside();
        let mut m = machine();
        if ended(task) {
            m.set(i, State::Running);
            m.totals.scope_ended += 1;
            return Err(Error::ScopeEnded);
        }
        let tasks = Tasks::now(outside);
        let resumed = m.state(i) == State::Running;
        if resumed || Instant::now() >= deadline || m.may_resume(i, tasks.get()) {
            m.set(i, State::Running);
            return Ok(());
        }
        if resolve(m, &tasks) {
            continue;
        }
        signal::wait_for_free(seen, deadline.min(Instant::now() + POLL));
    }
}

/// A thread of `task` waiting until further notice: the task yields its fair share
/// while all its threads do.
struct Yielding(u64);

impl Yielding {
    fn new(task: u64) -> Yielding {
        POOL.lock().set_yielding(task, true);
        signal::wake(); // the others' share grew
        Yielding(task)
    }
}

impl Drop for Yielding {
    fn drop(&mut self) {
        POOL.lock().set_yielding(self.0, false);
    }
}

/// An attempt begins on slot `i`: it runs, with no refusal yet.
fn start_attempt(i: usize) {
    let mut m = machine();
    m.set(i, State::Running);
    m.set_last(i, None);
}

/// After slot `i`'s attempt rolled back, its `rollbacks`-th time: waits until further
/// notice, then lets it run again; past [`MAX_RETRIES`], gives up.
fn wait_to_retry(l: &Local, i: usize, task: u64, rollbacks: u32) -> Result<()> {
    if rollbacks > MAX_RETRIES {
        machine().totals.retry_limit += 1;
        return Err(Error::RetryOom);
    }
    wait_until_further_notice(l, i, task)?;
    machine().totals.retries += 1;
    Ok(())
}

/// Enters the machine for a retry block on scope `handle`: a slot for the thread's
/// outermost block (none if the table is full, or if the thread is past its exit
/// flush, which gives slots back: its requests are then refused as outside a block),
/// the same slot one level deeper for a nested one.
fn enter_machine(l: &Local, handle: u64) -> Result<Option<usize>> {
    match threads::retry_slot(l) {
        Some(i) => {
            machine().nest(i);
            Ok(Some(i))
        }
        None if !threads::has_exit_flush(l) => Ok(None),
        None => {
            let rank = rank_of(handle).ok_or(Error::ScopeEnded)?;
            let slot = machine().register(handle, rank);
            threads::set_retry_slot(l, slot);
            Ok(slot)
        }
    }
}

/// Leaves one level of the thread's retry blocks; the slot is freed with the
/// outermost.
fn leave_machine(l: &Local, slot: Option<usize>) {
    if let Some(i) = slot {
        if machine().leave(i) {
            threads::set_retry_slot(l, None);
        }
        // Others may wait on this thread's task being blocked; it no longer is.
        signal::wake();
    }
}

/// The calling thread inside a retry block: attached to the scope, with a slot in the
/// machine (or none if its table is full: then requests are refused as outside).
struct Block {
    l: &'static Local,
    task: u64,
    slot: Option<usize>,
    _attached: AttachGuard,
}

impl Block {
    fn enter(scope: &TaskScope) -> Result<Block> {
        let attached = scope.attach()?;
        let l = threads::this_thread().ok_or(Error::ScopeEnded)?;
        let handle = scope.handle().as_raw();
        let slot = enter_machine(l, handle)?;
        Ok(Block { l, task: handle, slot, _attached: attached })
    }

    /// Runs `f` until it succeeds or fails with anything but a rollback; after each
    /// rollback the thread waits until further notice, at most [`MAX_RETRIES`] times.
    fn run<T>(&self, f: &mut impl FnMut() -> Result<T>) -> Result<T> {
        let mut rollbacks = 0;
        loop {
            if let Some(i) = self.slot {
                start_attempt(i);
            }
            let i = match (f(), self.slot) {
                (Err(Error::RetryOom), Some(i)) => i,
                // Not a rollback, or no machine to wait in: the caller's answer.
                (result, _) => return result,
            };
            rollbacks += 1;
            wait_to_retry(self.l, i, self.task, rollbacks)?;
        }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        leave_machine(self.l, self.slot);
    }
}

/// Runs `f` on the calling thread attached to `scope`, in a retry block: a
/// reservation ([`TaskScope::reserve`], [`Consumer::reserve`](super::Consumer::reserve))
/// or a fallible allocation (`try_reserve`, mapped with `?` through
/// `From<TryReserveError>`) that does not fit after spills and reclaims waits for
/// memory to be freed instead of failing. When every active task is blocked, the
/// youngest is rolled back: its request fails with [`Error::RetryOom`], `f` must
/// return it (with `?`) after dropping what its attempt holds, and `f` runs again
/// once a higher-priority task has freed memory or finished (at most
/// [`MAX_RETRIES`] times). When the task is the only one still short it gets
/// [`Error::SplitAndRetryOom`], returned to the caller: see [`with_split_retry`].
///
/// An infallible allocation (`Vec::push`, `Box::new`) refused in a retry block aborts
/// the process, as outside one: make the attempt's big buffers with `try_reserve`.
///
/// A request blocked in the block, or a thread waiting to run its attempt again, whose
/// scope ends meanwhile (another thread ends it, as `memquota_scope_end` does) wakes
/// at once: the request fails with [`Error::ScopeEnded`] (a `try_reserve` maps to it
/// with `?`), and so does the wait.
///
/// # Errors
/// `f`'s own errors; [`Error::SplitAndRetryOom`]; [`Error::RetryOom`] after
/// [`MAX_RETRIES`] rollbacks; [`Error::Refused`] when the watchdog ends a wait;
/// [`Error::ScopeEnded`] (also when the scope ends while the thread waits).
pub fn with_retry<T>(scope: &TaskScope, mut f: impl FnMut() -> Result<T>) -> Result<T> {
    Block::enter(scope)?.run(&mut f)
}

/// [`with_retry`] over pieces of `input`: when a piece's attempt gets
/// [`Error::SplitAndRetryOom`], `split` cuts it (into two or more pieces, in order)
/// and each is processed in turn. Returns one result per piece processed, in input
/// order.
///
/// # Errors
/// As [`with_retry`]; [`Error::SplitAndRetryOom`] when `split` returns fewer than
/// two pieces.
pub fn with_split_retry<I, T>(
    scope: &TaskScope,
    input: I,
    mut split: impl FnMut(I) -> Vec<I>,
    mut f: impl FnMut(&I) -> Result<T>,
) -> Result<Vec<T>> {
    let block = Block::enter(scope)?;
    // Its own lists are charged, never refused: at the limit, where the pieces run,
    // a refusal of one of their infallible allocations would abort the process.
    let mut todo = threads::unpoliced(|| vec![input]); // a stack: the next piece last
    let mut done = Vec::new();
    while let Some(piece) = todo.pop() {
        match block.run(&mut || f(&piece)) {
            Ok(t) => threads::unpoliced(|| done.push(t)),
            Err(Error::SplitAndRetryOom) => {
                let mut pieces = split(piece);
                if pieces.len() < 2 {
                    return Err(Error::SplitAndRetryOom);
                }
                pieces.reverse();
                threads::unpoliced(|| todo.append(&mut pieces));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// How the calling thread's last refusal in a retry block went: `Some` for a
/// rollback or a split, `None` otherwise (outside a retry block, a plain refusal, or
/// none since the attempt began).
pub(crate) fn last_refusal() -> Option<Rollback> {
    threads::this_thread().and_then(last_refusal_of)
}

fn last_refusal_of(l: &Local) -> Option<Rollback> {
    let i = threads::retry_slot(l)?;
    machine().last(i)
}

// ---- the raw API the C ABI and the Java class wrap --------------------------------
//
// A C or Java caller has no guard: it begins and ends its blocks, and runs its attempt
// again itself after a rollback. The calls below are `with_retry`'s pieces.

/// Enters a retry block on the calling thread of `face`: attaches it to scope `handle`
/// and enters the machine (one level deeper if it is in a block already); a new
/// attempt begins. Returns the scope the thread was attached to before (0: none), to
/// give back to [`retry_end_raw`].
///
/// # Errors
/// [`Error::ScopeEnded`].
pub fn retry_begin_raw(face: &'static Face, handle: u64) -> Result<u64> {
    let l = (face.local)().ok_or(Error::ScopeEnded)?;
    let prev = attach_raw(face, handle)?;
    match enter_machine(l, handle) {
        Ok(slot) => {
            if let Some(i) = slot {
                start_attempt(i);
            }
            Ok(prev)
        }
        Err(e) => {
            detach_raw(face, prev);
            Err(e)
        }
    }
}

/// Leaves the calling thread's innermost retry block (begun with
/// [`retry_begin_raw`], which returned `prev`): out of the machine with the
/// outermost, and back to scope `prev`.
pub fn retry_end_raw(face: &'static Face, prev: u64) {
    if let Some(l) = (face.local)() {
        leave_machine(l, threads::retry_slot(l));
    }
    detach_raw(face, prev);
}

/// After a rollback (a request that failed with [`Error::RetryOom`]) and once the
/// attempt has freed what it held: waits until further notice (BUFN), until there is
/// room for what the attempt failed on and no older task is blocked, then a new
/// attempt begins. Returns at once, the attempt beginning, when no rollback is pending
/// (or the thread is in no block the machine knows).
///
/// # Errors
/// [`Error::RetryOom`] past [`MAX_RETRIES`] rollbacks since the thread's outermost
/// block began: give up. [`Error::ScopeEnded`] when the block's scope ends while the
/// thread waits (at once).
pub fn retry_block_raw(face: &'static Face) -> Result<()> {
    let Some(l) = (face.local)() else { return Ok(()) };
    let Some(i) = threads::retry_slot(l) else { return Ok(()) };
    let (task, rollbacks) = {
        let mut m = machine();
        if m.state(i) != State::RollingBack {
            drop(m);
            start_attempt(i);
            return Ok(());
        }
        (m.task(i), m.count_rollback(i))
    };
    if let Err(e) = wait_to_retry(l, i, task, rollbacks) {
        machine().set(i, State::Running); // it gives up and runs on, to its end
        return Err(e);
    }
    start_attempt(i);
    Ok(())
}

/// How the last refusal on the calling thread of `face` in its retry block went: a
/// rollback, a split, its scope ended while it waited, or `None` (a plain refusal,
/// none since the attempt began, or the thread is in no block the machine knows).
pub fn last_refusal_raw(face: &'static Face) -> Option<Rollback> {
    (face.local)().and_then(last_refusal_of)
}

/// A failed `try_reserve` as memquota's error, so `?` works inside [`with_retry`]:
/// [`Error::RetryOom`] or [`Error::SplitAndRetryOom`] when the allocation failed
/// because the retry machine chose this thread, [`Error::ScopeEnded`] when it failed
/// because the block's scope ended while it waited, else [`Error::Refused`] (with
/// `requested: 0`: the size is not known here).
impl From<std::collections::TryReserveError> for Error {
    fn from(_: std::collections::TryReserveError) -> Error {
        match last_refusal() {
            Some(Rollback::Retry) => Error::RetryOom,
            Some(Rollback::Split) => Error::SplitAndRetryOom,
            Some(Rollback::Ended) => Error::ScopeEnded,
            None => Error::Refused { requested: 0 },
        }
    }
}
