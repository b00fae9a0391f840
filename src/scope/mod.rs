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
mod lock;
mod owner;
mod pool;
mod spill;

pub use owner::OWNED_MIN;
pub use pool::{MAX_CONSUMERS, MAX_SCOPES};
pub use spill::SpillFn;

use crate::engine;
use crate::error::{Error, Result};
use crate::ledger::{self, Face, ACCOUNT};
use pool::{Ask, Scope, POOL};
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// Adds `d` bytes of a thread in scope `handle` (0: none) to that scope; returns the
/// change the process account must see. On the slow path only.
pub(crate) fn attribute(handle: u64, d: i64) -> i64 {
    if handle == 0 || d == 0 {
        return d;
    }
    let dh = POOL.lock().attribute(handle, d);
    if d < 0 {
        admit::wake();
    }
    dh
}

/// A thread left scope `handle` by exiting.
pub(crate) fn thread_exited(handle: u64) {
    if handle != 0 {
        POOL.lock().detach(handle);
    }
}

/// A charge of `bytes` on a thread attached to `handle`, from `charge_slow` (busy).
pub(crate) fn admit_attached(l: &ledger::Local, face: &Face, handle: u64, bytes: i64) -> bool {
    match admit::acquire(l, face, handle, Ask::Alloc(bytes as u64), false) {
        admit::Outcome::Granted(_) => true,
        admit::Outcome::Refused => false,
        admit::Outcome::Ended => engine::admit(l, face, bytes),
    }
}

/// The scope tree for the OOM report.
pub(crate) fn write_tree(w: &mut impl fmt::Write) -> fmt::Result {
    let refusing = admit::REFUSING.swap(0, Relaxed);
    let p = POOL.lock();
    if let Some(s) = p.scope(refusing) {
        writeln!(w, "  refused for scope {:?} (id {})", s.name, s.id)?;
    }
    p.write_tree(w)
}

/// Releases the scope locks in a `fork` child.
///
/// # Safety
/// Only in the child, before it starts any thread.
pub(crate) unsafe fn after_fork_child() {
    // SAFETY: forwarded contract.
    unsafe {
        POOL.force_unlock();
        owner::after_fork_child();
    }
}

// ---- faces: owner records of big blocks --------------------------------------------

/// After a block of `size` bytes at `ptr` was allocated through the slow path: gives
/// it an owner record if it is big (a no-op otherwise, and before any scope exists).
pub fn note_alloc(face: &'static Face, ptr: usize, size: u64) {
    if size < OWNED_MIN || !pool::SCOPES_USED.load(Relaxed) {
        return;
    }
    let handle = (face.local)().map_or(0, ledger::scope_of);
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

/// Before a `realloc` of the block at `ptr` (`old` bytes): its owner record, if any,
/// moves its bytes to the calling thread's scope. Pass the result to
/// [`note_realloc_end`].
pub fn note_realloc_begin(face: &'static Face, ptr: usize, old: u64) -> bool {
    if old < OWNED_MIN {
        return false;
    }
    let Some((owner, recorded)) = owner::take(ptr) else { return false };
    let me = (face.local)().map_or(0, ledger::scope_of);
    if owner != me {
        let r = recorded as i64;
        ACCOUNT.add(attribute(owner, -r) + attribute(me, r));
    }
    true
}

/// After the `realloc` begun with [`note_realloc_begin`]: records the new block
/// (`new_ptr`, 0 if the realloc failed) for the calling thread's scope.
pub fn note_realloc_end(face: &'static Face, old_ptr: usize, new_ptr: usize, old: u64, new: u64, had: bool) {
    if new_ptr != 0 {
        note_alloc(face, new_ptr, new);
    } else if had {
        let handle = (face.local)().map_or(0, ledger::scope_of);
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
        Ok(TaskScope { handle: ScopeHandle(handle) })
    }

    /// Sets the execution pool the fair share divides; 0 (the default): the limit.
    pub fn set_pool(&self, bytes: u64) {
        POOL.lock().set_pool_bytes(bytes);
    }

    /// The longest a request below its minimum share waits for memory to be freed
    /// (default 2 s).
    pub fn set_wait(&self, wait: Duration) {
        admit::set_wait(wait);
    }

    /// The calling thread's scope, if it is attached to a live one.
    pub fn current(&self) -> Option<ScopeHandle> {
        let handle = (engine::face().local)().map_or(0, ledger::scope_of);
        POOL.lock().scope(handle).is_some().then_some(ScopeHandle(handle))
    }

    /// Every live scope with its consumers, and the totals. Allocates (outside any
    /// lock): not for the allocation path.
    pub fn snapshot(&self) -> ScopeSnapshot {
        snapshot()
    }
}

/// Begins a scope; its raw handle.
///
/// # Errors
/// [`Error::TooManyScopes`].
pub fn begin_raw(name: &str, id: u64, priority: i32) -> Result<u64> {
    POOL.lock().begin(name, id, priority).ok_or(Error::TooManyScopes)
}

/// Ends a scope: what it still holds goes to the process account (reported as a
/// leak), its reservations and consumers are released.
///
/// # Errors
/// [`Error::ScopeEnded`] if it already ended.
pub fn end_raw(handle: u64) -> Result<ScopeReport> {
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
    admit::wake();
    if !consumers.is_empty() {
        spill::forget_dead();
    }
    Ok(ScopeReport::new(&s, &consumers))
}

/// Attaches the calling thread of `face` to `handle`; returns the scope it was in.
///
/// # Errors
/// [`Error::ScopeEnded`].
pub fn attach_raw(face: &'static Face, handle: u64) -> Result<u64> {
    let l = (face.local)().ok_or(Error::ScopeEnded)?;
    if !POOL.lock().attach(handle) {
        return Err(Error::ScopeEnded);
    }
    let _busy = ledger::enter(l);
    let prev = ledger::switch_scope(l, face, handle);
    if prev != 0 {
        POOL.lock().detach(prev);
    }
    Ok(prev)
}

/// Moves the calling thread of `face` from its scope to `to` (0: none, or a scope
/// that has ended). Returns the scope it left.
pub fn detach_raw(face: &'static Face, to: u64) -> u64 {
    let Some(l) = (face.local)() else { return 0 };
    let to = if to != 0 && POOL.lock().attach(to) { to } else { 0 };
    let _busy = ledger::enter(l);
    let left = ledger::switch_scope(l, face, to);
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
    let busy = ledger::enter(l);
    if busy.is_none() || spill::in_spill() {
        POOL.lock().totals.reserve_in_spill += 1;
        crate::report::note(format_args!(
            "memquota: a spill or reclaim callback tried to reserve {bytes} bytes: refused \
             (a callback must free memory, not reserve it)\n"
        ));
        return Err(Error::ReserveInSpill { requested: bytes });
    }
    if face.configure_from_env {
        engine::ensure_configured();
    }
    match admit::acquire(l, face, handle, Ask::Reserve { bytes, consumer }, partial) {
        admit::Outcome::Granted(g) => Ok(g),
        admit::Outcome::Ended => Err(Error::ScopeEnded),
        admit::Outcome::Refused => Err(Error::Refused { requested: bytes }),
    }
}

/// Gives back `bytes` of scope `handle`'s reservations (of consumer `consumer`).
pub fn release_raw(handle: u64, bytes: u64, consumer: u64) {
    let d = POOL.lock().apply(handle, Ask::Reserve { bytes, consumer }, bytes, -1);
    ACCOUNT.add(d);
    admit::wake();
}

fn snapshot() -> ScopeSnapshot {
    let mut scopes: Vec<(u64, Scope)> = Vec::with_capacity(MAX_SCOPES);
    let mut consumers: Vec<(u64, pool::Consumer)> = Vec::with_capacity(MAX_CONSUMERS);
    let (totals, share) = {
        let p = POOL.lock();
        scopes.extend(p.scopes().map(|(h, s)| (h, *s)));
        consumers.extend(p.consumers().map(|(k, c)| (k, *c)));
        (p.totals, p.share())
    };
    ScopeSnapshot {
        pool: u64::try_from(share.pool).unwrap_or(0),
        share: u64::try_from(share.max_per()).unwrap_or(0),
        begun: totals.begun,
        ended: totals.ended,
        leaked_bytes: totals.leaked_bytes,
        spills: totals.spills,
        spilled_bytes: totals.spilled_bytes,
        waits: totals.waits,
        refusals: totals.refusals,
        reserve_in_spill: totals.reserve_in_spill,
        owner_records: owner::len() as u64,
        owner_overflows: owner::OVERFLOWS.load(Relaxed),
        scopes: scopes
            .iter()
            .map(|(h, s)| {
                let mine = consumers.iter().filter(|(_, c)| u64::from(c.scope) == h & 0xffff);
                ScopeStats::new(*h, s, mine.map(|(_, c)| ConsumerStats::new(c)).collect())
            })
            .collect(),
    }
}

// ---- handles ---------------------------------------------------------------------

/// A running scope. Ends when dropped (a leak is then written to the report hook);
/// [`TaskScope::end`] ends it and returns the report instead.
#[derive(Debug)]
pub struct TaskScope {
    handle: ScopeHandle,
}

impl TaskScope {
    /// A copyable handle, for helper threads; it goes stale when the scope ends.
    pub fn handle(&self) -> ScopeHandle {
        self.handle
    }

    /// Attaches the calling thread (see [`ScopeHandle::attach`]).
    ///
    /// # Errors
    /// As [`ScopeHandle::attach`].
    pub fn attach(&self) -> Result<AttachGuard> {
        self.handle.attach()
    }

    /// Reserves exactly `bytes` (see [`ScopeHandle::reserve`]).
    ///
    /// # Errors
    /// As [`ScopeHandle::reserve`].
    pub fn reserve(&self, bytes: u64) -> Result<Reservation> {
        self.handle.reserve(bytes)
    }

    /// Reserves up to `bytes` (see [`ScopeHandle::reserve_up_to`]).
    ///
    /// # Errors
    /// As [`ScopeHandle::reserve`].
    pub fn reserve_up_to(&self, bytes: u64) -> Result<Reservation> {
        self.handle.reserve_up_to(bytes)
    }

    /// Registers a spillable consumer: `spill(target)` is asked to free about
    /// `target` bytes and returns what it freed. It runs on the thread that needs
    /// memory, with no memquota lock held; it must not reserve memory (that fails with
    /// [`Error::ReserveInSpill`] and is reported), and should use `try_lock` on
    /// anything the requesting thread may hold.
    ///
    /// # Errors
    /// [`Error::ScopeEnded`], or [`Error::TooManyScopes`] when [`MAX_CONSUMERS`] exist.
    pub fn consumer(
        &self,
        name: &str,
        spill: impl Fn(u64) -> u64 + Send + Sync + 'static,
    ) -> Result<Consumer> {
        let callback: Arc<SpillFn> = Arc::new(spill);
        let key = {
            let mut p = POOL.lock();
            if p.scope(self.handle.0).is_none() {
                return Err(Error::ScopeEnded);
            }
            p.add_consumer(self.handle.0, name).ok_or(Error::TooManyScopes)?
        };
        spill::register(key, callback);
        Ok(Consumer { key, scope: self.handle })
    }

    /// Sets or clears a hard cap on what the scope may hold (Gluten's isolation).
    pub fn set_cap(&self, cap: Option<u64>) {
        POOL.lock().set_cap(self.handle.0, cap);
    }

    /// The scope's figures now.
    pub fn stats(&self) -> Option<ScopeStats> {
        snapshot().scopes.into_iter().find(|s| s.handle == self.handle.0)
    }

    /// Ends the scope; returns what it still held (a leak, if anything).
    pub fn end(self) -> ScopeReport {
        let handle = self.handle.0;
        std::mem::forget(self);
        end_raw(handle).unwrap_or_default()
    }
}

impl Drop for TaskScope {
    fn drop(&mut self) {
        if let Ok(report) = end_raw(self.handle.0) {
            if report.is_leak() {
                crate::report::note(format_args!("{report}\n"));
            }
        }
    }
}

/// A scope's plain id: `Copy`, `Send`, stale (harmlessly) once the scope ends. The
/// raw value is what the C ABI passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScopeHandle(u64);

impl ScopeHandle {
    /// From a raw value (the C ABI's).
    pub fn from_raw(raw: u64) -> ScopeHandle {
        ScopeHandle(raw)
    }

    /// The raw value.
    pub fn as_raw(self) -> u64 {
        self.0
    }

    /// Whether the scope is still running.
    pub fn is_live(self) -> bool {
        POOL.lock().scope(self.0).is_some()
    }

    /// Attaches the calling thread: its allocations are charged to the scope until
    /// the guard drops, which puts the thread back in its previous scope. The thread's
    /// unflushed bytes are settled into the scope it leaves.
    ///
    /// # Errors
    /// [`Error::ScopeEnded`].
    pub fn attach(self) -> Result<AttachGuard> {
        let face = engine::face();
        let prev = attach_raw(face, self.0)?;
        Ok(AttachGuard { face, prev, _not_send: PhantomData })
    }

    /// Reserves exactly `bytes`, spilling, waiting for the fair share and reclaiming
    /// as needed. The reservation is a floor under the scope's charge: allocations of
    /// attached threads use it up before they charge anything new.
    ///
    /// # Errors
    /// [`Error::Refused`] (with an OOM report), [`Error::ScopeEnded`],
    /// [`Error::ReserveInSpill`].
    pub fn reserve(self, bytes: u64) -> Result<Reservation> {
        reserve_raw(engine::face(), self.0, bytes, 0, false).map(|g| Reservation::new(self, 0, g))
    }

    /// Reserves up to `bytes`: the most the fair share allows once spills are
    /// exhausted (maybe 0), as Spark grants part of a request.
    ///
    /// # Errors
    /// As [`reserve`](Self::reserve).
    pub fn reserve_up_to(self, bytes: u64) -> Result<Reservation> {
        reserve_raw(engine::face(), self.0, bytes, 0, true).map(|g| Reservation::new(self, 0, g))
    }
}

/// The calling thread's attachment to a scope; drop to detach. Not `Send`: it belongs
/// to the thread it attached.
#[must_use = "the thread detaches when the guard drops"]
pub struct AttachGuard {
    face: &'static Face,
    prev: u64,
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for AttachGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttachGuard").field("prev", &self.prev).finish_non_exhaustive()
    }
}

impl Drop for AttachGuard {
    fn drop(&mut self) {
        detach_raw(self.face, self.prev);
    }
}

/// Reserved bytes of a scope; released on drop.
#[derive(Debug)]
#[must_use = "the reservation is released when dropped"]
pub struct Reservation {
    scope: ScopeHandle,
    consumer: u64,
    bytes: u64,
}

impl Reservation {
    fn new(scope: ScopeHandle, consumer: u64, bytes: u64) -> Reservation {
        Reservation { scope, consumer, bytes }
    }

    /// The bytes granted.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Gives back `bytes` of it now (at most what it holds).
    pub fn shrink(&mut self, bytes: u64) {
        let b = bytes.min(self.bytes);
        self.bytes -= b;
        release_raw(self.scope.0, b, self.consumer);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            release_raw(self.scope.0, self.bytes, self.consumer);
        }
    }
}

/// A spillable consumer's handle; the consumer lives in the manager until its scope
/// ends or [`Consumer::unregister`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Consumer {
    key: u64,
    scope: ScopeHandle,
}

impl Consumer {
    /// Reserves exactly `bytes` for this consumer: counted in its size (which the
    /// spill order reads) and its scope's charge.
    ///
    /// # Errors
    /// As [`ScopeHandle::reserve`].
    pub fn reserve(self, bytes: u64) -> Result<Reservation> {
        reserve_raw(engine::face(), self.scope.0, bytes, self.key, false)
            .map(|g| Reservation::new(self.scope, self.key, g))
    }

    /// Reserves up to `bytes` for this consumer.
    ///
    /// # Errors
    /// As [`ScopeHandle::reserve`].
    pub fn reserve_up_to(self, bytes: u64) -> Result<Reservation> {
        reserve_raw(engine::face(), self.scope.0, bytes, self.key, true)
            .map(|g| Reservation::new(self.scope, self.key, g))
    }

    /// The consumer's figures now.
    pub fn stats(self) -> Option<ConsumerStats> {
        POOL.lock().consumer(self.key).copied().map(|c| ConsumerStats::new(&c))
    }

    /// Removes the consumer (its reservations stay with the scope until dropped).
    pub fn unregister(self) {
        POOL.lock().remove_consumer(self.key);
        spill::unregister(self.key);
    }
}

// ---- figures ---------------------------------------------------------------------

/// One scope's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScopeStats {
    /// The raw handle.
    pub handle: u64,
    /// The name given at begin.
    pub name: String,
    /// The id given at begin.
    pub id: u64,
    /// The priority given at begin.
    pub priority: i32,
    /// What the scope is charged: the larger of allocated and reserved.
    pub held: u64,
    /// The highest `held`.
    pub peak: u64,
    /// Bytes its threads allocated minus freed (flushed). May be negative when its
    /// threads freed other scopes' small blocks.
    pub allocated: i64,
    /// Bytes reserved.
    pub reserved: u64,
    /// The hard cap, if any.
    pub cap: Option<u64>,
    /// Threads attached now.
    pub threads: u32,
    /// Times a request waited for its fair share.
    pub waits: u64,
    /// Requests refused.
    pub refusals: u64,
    /// Its consumers.
    pub consumers: Vec<ConsumerStats>,
}

impl ScopeStats {
    fn new(handle: u64, s: &Scope, consumers: Vec<ConsumerStats>) -> ScopeStats {
        let u = |v: i64| u64::try_from(v).unwrap_or(0);
        ScopeStats {
            handle,
            name: s.name.as_str().to_owned(),
            id: s.id,
            priority: s.priority,
            held: u(s.held),
            peak: u(s.peak),
            allocated: s.used,
            reserved: u(s.reserved),
            cap: (s.cap != i64::MAX).then(|| u(s.cap)),
            threads: s.attached,
            waits: s.waits,
            refusals: s.refusals,
            consumers,
        }
    }
}

/// One consumer's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// The name given at registration.
    pub name: String,
    /// Bytes it has reserved.
    pub used: u64,
    /// The highest `used`.
    pub peak: u64,
    /// Times it was asked to spill.
    pub spills: u64,
    /// Bytes its spills said they freed.
    pub spilled_bytes: u64,
}

impl ConsumerStats {
    fn new(c: &pool::Consumer) -> ConsumerStats {
        ConsumerStats {
            name: c.name.as_str().to_owned(),
            used: u64::try_from(c.used).unwrap_or(0),
            peak: u64::try_from(c.peak).unwrap_or(0),
            spills: c.spills,
            spilled_bytes: c.spilled,
        }
    }
}

/// Every live scope and the manager's totals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScopeSnapshot {
    /// The execution pool the fair share divides.
    pub pool: u64,
    /// Each scope's share now (pool / active scopes).
    pub share: u64,
    /// Scopes begun, ever.
    pub begun: u64,
    /// Scopes ended, ever.
    pub ended: u64,
    /// Bytes scopes still held when they ended, in all.
    pub leaked_bytes: u64,
    /// Spill callbacks run.
    pub spills: u64,
    /// Bytes they said they freed.
    pub spilled_bytes: u64,
    /// Requests that waited for their share.
    pub waits: u64,
    /// Requests refused by a scope's share or the process budget.
    pub refusals: u64,
    /// Reservations attempted from inside a spill or reclaim callback (refused).
    pub reserve_in_spill: u64,
    /// Big blocks with an owner record now.
    pub owner_records: u64,
    /// Big blocks that got none (table full).
    pub owner_overflows: u64,
    /// The live scopes.
    pub scopes: Vec<ScopeStats>,
}

/// What a scope still held when it ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScopeReport {
    /// The scope's name.
    pub name: String,
    /// The scope's id.
    pub id: u64,
    /// Bytes its threads allocated and nobody freed (handed to the process account).
    pub leaked_bytes: u64,
    /// Reservations never released (released now).
    pub reserved: u64,
    /// The highest charge it reached.
    pub peak: u64,
    /// Threads still attached (their later allocations count for the process only).
    pub threads: u32,
    /// Consumers still registered, with what they held (up to 64).
    pub consumers: Vec<ConsumerStats>,
}

impl ScopeReport {
    fn new(s: &Scope, consumers: &[pool::Consumer]) -> ScopeReport {
        ScopeReport {
            name: s.name.as_str().to_owned(),
            id: s.id,
            leaked_bytes: u64::try_from(s.used).unwrap_or(0),
            reserved: u64::try_from(s.reserved).unwrap_or(0),
            peak: u64::try_from(s.peak).unwrap_or(0),
            threads: s.attached,
            consumers: consumers.iter().map(ConsumerStats::new).collect(),
        }
    }

    /// Whether the scope ended holding memory (allocated or reserved).
    pub fn is_leak(&self) -> bool {
        self.leaked_bytes > 0 || self.reserved > 0
    }
}

impl fmt::Display for ScopeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use crate::report::Size;
        write!(f, "memquota: scope {:?} (id {}) ended", self.name, self.id)?;
        if !self.is_leak() {
            return write!(f, " holding nothing (peak {})", Size(self.peak));
        }
        write!(
            f,
            "; managed memory leak detected: {} still allocated (now counted for the process), {} still reserved (released)",
            Size(self.leaked_bytes),
            Size(self.reserved)
        )?;
        if self.threads > 0 {
            write!(f, ", {} threads still attached", self.threads)?;
        }
        for c in self.consumers.iter().filter(|c| c.used > 0) {
            write!(f, "; consumer {:?} holds {}", c.name, Size(c.used))?;
        }
        Ok(())
    }
}
