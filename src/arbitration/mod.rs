//! Task memory managers inside the allocator: scoped budgets, spillable consumers
//! and fair share, after Spark's TaskMemoryManager / ExecutionMemoryPool and Gluten's
//! MemoryManager. See `docs/scopes.md`.
//!
//! * A thread attached to a scope (an RAII [`AttachGuard`]) has its allocations
//!   charged to the scope as well as to the process. The fast path does not change:
//!   the ledger's `Local` holds the thread's current scope, its delta is settled into
//!   the old scope when the thread attaches or detaches, and every flush of the delta
//!   is attributed to the scope the thread is in.
//! * Big blocks ([`OWNED_MIN`] and up) carry an owner record, so a free on any thread
//!   credits the scope that allocated them. Smaller blocks credit the scope of the
//!   thread that frees them.
//! * Explicit reservations and allocations share one account: a scope is charged the
//!   larger of what it allocated and what it reserved.
//! * Resources live here, in fixed tables; callers hold plain handles
//!   ([`ScopeHandle`], [`Consumer`]) that go stale, harmlessly, when the scope ends.

mod admit;
mod budget;
mod figures;
mod handles;
mod retry;
mod spill;

pub use budget::{Budget, BudgetStats};
pub use figures::{ConsumerStats, ScopeAccount, ScopeReport, ScopeSnapshot, ScopeStats};
pub use handles::{AttachGuard, Consumer, Reservation, ScopeHandle, TaskScope};
pub use retry::{
    last_refusal_raw, retry_begin_raw, retry_block_raw, retry_end_raw, with_retry, with_split_retry,
    MAX_RETRIES,
};

use crate::base::error::{Error, Result};
use crate::base::sync::Ordering::Acquire;
use crate::ledger::tables::pool::{Ask, POOL};
use crate::ledger::tables::retry::Rollback;
use crate::ledger::tables::{attribute, owner, signal, OWNED_MIN};
use crate::ledger::threads::{self, Face, ACCOUNT};
use std::time::Duration;

/// A charge of `bytes` on a thread attached to `handle`, from `charge_slow` (busy).
pub(crate) fn admit_attached(l: &threads::Local, face: &Face, handle: u64, bytes: i64) -> bool {
    match admit::acquire(l, face, handle, Ask::Alloc(bytes as u64), false) {
        admit::Outcome::Granted(_) => true,
        admit::Outcome::Refused | admit::Outcome::Rolled(_) | admit::Outcome::Short => false,
        admit::Outcome::Ended => crate::policy::admission::admit(l, face, bytes),
    }
}

/// A gate's request (`make_room`) of `bytes` on a thread in a retry block (busy):
/// admitted by the thread's scope like an allocation (share, spills, blocking, the
/// retry machine) and charged there and to the process, for the allocation that
/// follows to use up. `None`: the thread is in no retry block, or its scope ended:
/// the process's gate decides.
pub(crate) fn gate_in_block(l: &threads::Local, face: &Face, bytes: u64) -> Option<bool> {
    let handle = threads::scope_of(l);
    if handle == 0 || !retry::in_block(l) {
        return None;
    }
    match admit::acquire(l, face, handle, Ask::Alloc(bytes), false) {
        admit::Outcome::Granted(granted) => {
            threads::prepay_scoped(l, granted);
            Some(true)
        }
        admit::Outcome::Ended => None,
        admit::Outcome::Refused | admit::Outcome::Rolled(_) | admit::Outcome::Short => Some(false),
    }
}

/// The scopes' part of a fork's prepare handler: takes their locks.
pub(crate) fn before_fork() {
    crate::ledger::tables::retry::before_fork();
    signal::before_fork();
    POOL.hold_for_fork();
    owner::before_fork();
    spill::before_fork();
}

/// The scopes' part of a fork's parent and child handlers: releases their locks; in
/// the child, forgets the waiters and spills of threads that did not survive it, and
/// keeps the forking thread's.
///
/// # Safety
/// Only from the parent or child handler of the fork whose prepare handler called
/// [`before_fork`].
pub(crate) unsafe fn after_fork(child: bool) {
    // SAFETY: forwarded contract, in the reverse order of `before_fork`.
    unsafe {
        spill::after_fork(child);
        owner::after_fork();
        POOL.force_unlock();
        if child {
            // The vanished threads are attached nowhere: a task they served is not
            // busy in the child, and the retry machine must not wait on them.
            POOL.lock().after_fork_child(threads::this_thread().map_or(0, threads::scope_of));
        }
        let me = threads::this_thread();
        signal::after_fork(child, me.map_or(0, |l| threads::waiting(l).get()));
        let survivor = me.and_then(threads::retry_slot);
        crate::ledger::tables::retry::after_fork(child, survivor);
    }
}

// ---- faces: owner records of big blocks --------------------------------------------

/// Whether any scope has begun in this process: from then on big blocks may carry
/// owner records, so a face must look for one when such a block is freed. Never goes
/// back to false. A free of a block with a record reads true here whenever the block
/// reached the freeing thread by a synchronising hand-over: the record was written
/// after its writer read true. Acquire (a plain load on x86): whoever reads true has
/// also seen the face told, [`begin_raw`]'s `scopes_began` before the flag's store.
#[inline(always)]
pub fn scopes_used() -> bool {
    crate::ledger::tables::pool::SCOPES_USED.load(Acquire)
}

/// After a block of `size` bytes at `ptr` was allocated through the slow path: gives
/// it an owner record if it is big (a no-op otherwise, and before any scope exists).
pub fn note_alloc(face: &'static Face, ptr: usize, size: u64) {
    if size < OWNED_MIN || !scopes_used() {
        return;
    }
    let handle = (face.local)().map_or(0, threads::scope_of);
    owner::insert(ptr, handle, size);
}

/// Before (or just after) a block of `size` bytes at `ptr` is freed, when the fast
/// path did not take the credit: if the block has an owner record, credits its owner
/// and the process, and returns true; false: the caller credits as usual.
pub fn note_free(ptr: usize, size: u64) -> bool {
    if size < OWNED_MIN {
        return false;
    }
    let Some((handle, recorded)) = owner::take(ptr) else { return false };
    let r = recorded as i64;
    ACCOUNT.add(attribute(handle, -r) + r - size as i64);
    true
}

/// Before a `realloc` of the block at `ptr` (`old` bytes, to become `new`): its owner
/// record, if any, moves its bytes to the calling thread's scope. Pass the result to
/// [`note_realloc_end`]. `None`: the move was refused (with a report), and the realloc
/// must fail, the block staying where it is.
///
/// A move can raise the process account: when the old scope's reservation still
/// covers what it held, the new scope is charged the block on top. For a realloc
/// that grows, such a rise is admitted like an allocation (against the limit, with
/// reclaims). A realloc that shrinks is never refused (callers such as
/// `Vec::shrink_to_fit` cannot handle it): its move is counted unchecked, the one
/// rise past the limit the ledger's bound does not cover, at most one block.
pub fn note_realloc_begin(face: &'static Face, ptr: usize, old: u64, new: u64) -> Option<bool> {
    if old < OWNED_MIN {
        return Some(false);
    }
    let Some((owner, recorded)) = owner::take(ptr) else { return Some(false) };
    let l = (face.local)();
    let me = l.map_or(0, threads::scope_of);
    if owner == me {
        return Some(true);
    }
    let r = recorded as i64;
    let dh = attribute(owner, -r) + attribute(me, r);
    if dh <= 0 || new <= old {
        ACCOUNT.add(dh);
        return Some(true);
    }
    let granted = match l.and_then(|l| threads::enter(l).map(|busy| (l, busy))) {
        Some((l, _busy)) => {
            crate::policy::admission::admit_as(l, face, dh, crate::base::config::OnOom::Abort)
        }
        // Inside our own slow path (a callback's realloc): counted, never policed.
        None => {
            ACCOUNT.add(dh);
            true
        }
    };
    if granted {
        return Some(true);
    }
    // Refused: the block goes back to its owner; `dh` was never added, and the way
    // back is what the account must see with it (the scopes may have moved meanwhile).
    let back = attribute(me, -r) + attribute(owner, r);
    ACCOUNT.add(dh + back);
    owner::insert(ptr, owner, recorded);
    None
}

/// After the `realloc` begun with [`note_realloc_begin`]: records the new block
/// (`new_ptr`, 0 if the realloc failed) for the calling thread's scope.
pub fn note_realloc_end(face: &'static Face, old_ptr: usize, new_ptr: usize, old: u64, new: u64, had: bool) {
    if new_ptr != 0 {
        note_alloc(face, new_ptr, new);
    } else if had {
        let handle = (face.local)().map_or(0, threads::scope_of);
        owner::insert(old_ptr, handle, old);
    }
}

// ---- the manager -----------------------------------------------------------------

/// The process's task memory manager: one per process, like the budget it divides.
#[derive(Debug)]
pub struct MemoryManager {
    _private: (),
}

static MANAGER: MemoryManager = MemoryManager { _private: () };

impl MemoryManager {
    /// The manager.
    pub fn global() -> &'static MemoryManager {
        &MANAGER
    }

    /// Begins a scope (a task) with a name (cut to 48 bytes), an id and a priority
    /// (lower is spilled first by other scopes' requests).
    ///
    /// # Errors
    /// [`Error::TooManyScopes`] when [`MAX_SCOPES`] are alive.
    pub fn begin(&self, name: &str, id: u64, priority: i32) -> Result<TaskScope> {
        let handle = begin_raw(name, id, priority)?;
        Ok(TaskScope::new(ScopeHandle::from_raw(handle)))
    }

    /// Sets the execution pool the fair share divides; 0 (the default): the limit.
    pub fn set_pool(&self, bytes: u64) {
        POOL.lock().set_pool_bytes(bytes);
    }

    /// The longest a request in a retry block ([`with_retry`]) stays blocked before
    /// it is refused with the report: the watchdog (default 10 s).
    pub fn set_retry_wait(&self, wait: Duration) {
        retry::set_retry_wait(wait);
    }

    /// The longest a request below its minimum share waits for memory to be freed
    /// (default 2 s).
    pub fn set_wait(&self, wait: Duration) {
        signal::set_wait(wait);
    }

    /// The calling thread's scope, if it is attached to a live one.
    pub fn current(&self) -> Option<ScopeHandle> {
        let handle = (crate::ledger::threads::face().local)().map_or(0, threads::scope_of);
        let p = POOL.lock();
        p.scope(handle).is_some().then(|| ScopeHandle::from_raw(p.task_of(handle)))
    }

    /// Every live scope with its consumers, and the totals. Allocates (outside any
    /// lock, charged but never refused): not for the allocation path.
    pub fn snapshot(&self) -> ScopeSnapshot {
        threads::unpoliced(figures::snapshot)
    }
}

/// Begins a scope; its raw handle.
///
/// # Errors
/// [`Error::TooManyScopes`].
pub fn begin_raw(name: &str, id: u64, priority: i32) -> Result<u64> {
    // Before the flag's store (Release, in `begin`): a thread that reads the flag
    // true, and writes owner records from then on, has seen the face told, and so has
    // any thread its blocks reach.
    (threads::face().scopes_began)();
    POOL.lock().begin(name, id, priority).ok_or(Error::TooManyScopes)
}

/// Ends a scope: what it still holds goes to the process account (reported as a
/// leak), its reservations and consumers are released.
///
/// # Errors
/// [`Error::ScopeEnded`] if it already ended.
pub fn end_raw(handle: u64) -> Result<ScopeReport> {
    // A scope may end while the process is at its limit: our bookkeeping's
    // allocations are charged, never refused (an infallible one would abort).
    threads::unpoliced(|| end(handle))
}

fn end(handle: u64) -> Result<ScopeReport> {
    let mut consumers = Vec::with_capacity(64);
    let (s, delta) = {
        let mut p = POOL.lock();
        let slot = (handle & 0xffff) as usize;
        if p.scope(handle).is_some() {
            for (_, c) in p.consumers_of(slot).take(consumers.capacity()) {
                consumers.push(*c); // within capacity: no allocation under the lock
            }
        }
        p.end(handle).ok_or(Error::ScopeEnded)?
    };
    ACCOUNT.add(delta);
    signal::wake();
    if !consumers.is_empty() {
        spill::forget_dead();
    }
    Ok(ScopeReport::new(&s, &consumers))
}

/// Attaches the calling thread of `face` to `handle`; returns the scope it was in. A
/// thread past its exit flush (in a thread-exit destructor that runs after it) is
/// attached nowhere, since nothing would detach it: its allocations go to the process
/// account.
///
/// # Errors
/// [`Error::ScopeEnded`].
pub fn attach_raw(face: &'static Face, handle: u64) -> Result<u64> {
    let l = (face.local)().ok_or(Error::ScopeEnded)?;
    if !POOL.lock().attach(handle) {
        return Err(Error::ScopeEnded);
    }
    let _busy = threads::enter(l);
    let Some(prev) = threads::switch_scope(l, face, handle) else {
        // Past the thread's exit flush: it stays in no scope, its allocations go to
        // the process account.
        POOL.lock().detach(handle);
        return Ok(threads::scope_of(l));
    };
    if prev != 0 {
        POOL.lock().detach(prev);
    }
    Ok(prev)
}

/// Moves the calling thread of `face` from its scope to `to` (0: none, or a scope
/// that has ended; none too for a thread past its exit flush). Returns the scope it
/// left.
pub fn detach_raw(face: &'static Face, to: u64) -> u64 {
    let Some(l) = (face.local)() else { return 0 };
    let to = if to != 0 && POOL.lock().attach(to) { to } else { 0 };
    let _busy = threads::enter(l);
    let Some(left) = threads::switch_scope(l, face, to) else {
        // Past the thread's exit flush (which left it in no scope): it goes back to
        // none, not to `to`, which it would never leave.
        POOL.lock().detach(to);
        return 0;
    };
    if left != 0 {
        POOL.lock().detach(left);
    }
    left
}

/// Reserves `bytes` for scope `handle` (for consumer `consumer`, 0: none) on the
/// calling thread of `face`; with `partial`, grants what the fair share allows.
/// Returns the bytes granted.
///
/// # Errors
/// [`Error::ReserveInSpill`] from a spill or reclaim callback; [`Error::ScopeEnded`];
/// [`Error::Refused`] when neither spills, waits nor reclaims made room (with an
/// OOM report).
pub fn reserve_raw(
    face: &'static Face,
    handle: u64,
    bytes: u64,
    consumer: u64,
    partial: bool,
) -> Result<u64> {
    let l = (face.local)().ok_or(Error::ScopeEnded)?;
    let busy = threads::enter(l);
    if busy.is_none() || spill::in_spill() {
        POOL.lock().totals.reserve_in_spill += 1;
        crate::policy::report::note(format_args!(
            "memquota: a spill or reclaim callback tried to reserve {bytes} bytes: refused \
             (a callback must free memory, not reserve it)\n"
        ));
        return Err(Error::ReserveInSpill { requested: bytes });
    }
    if face.configure_from_env {
        crate::base::settings::ensure_configured();
    }
    match admit::acquire(l, face, handle, Ask::Reserve { bytes, consumer }, partial) {
        admit::Outcome::Granted(g) => Ok(g),
        admit::Outcome::Ended => Err(Error::ScopeEnded),
        admit::Outcome::Refused | admit::Outcome::Short => Err(Error::Refused { requested: bytes }),
        admit::Outcome::Rolled(Rollback::Retry) => Err(Error::RetryOom),
        admit::Outcome::Rolled(Rollback::Split) => Err(Error::SplitAndRetryOom),
        admit::Outcome::Rolled(Rollback::Ended) => Err(Error::ScopeEnded),
    }
}

/// Gives back `bytes` of scope `handle`'s reservations (of consumer `consumer`).
pub fn release_raw(handle: u64, bytes: u64, consumer: u64) {
    let d = POOL.lock().apply(handle, Ask::Reserve { bytes, consumer }, bytes, -1);
    ACCOUNT.add(d);
    signal::wake();
}
