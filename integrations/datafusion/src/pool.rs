//! [`MemquotaPool`]: DataFusion's `MemoryPool` on memquota's budget. It keeps a table
//! of DataFusion's consumers (the scope each was registered in, a memquota reservation
//! on that scope, sizes and peaks for the error message), and decides each `try_grow`
//! with `decide` over figures read at that moment.

use crate::decide::{copies_what_it_holds, decide, Figures, Margin, Refusal, Request};
use crate::exhausted;
use crate::room::{self, Room, Waited};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation};
use memquota::{Enforcement, MemoryManager, Reservation, ScopeHandle};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// The margin every request leaves under the limit (and under a query's share) for
/// what DataFusion allocates without reserving it (batches in flight, a spill's sorted
/// copy, merge buffers being read), as a part of the limit. Chosen by measurement: at
/// 20% the example's query peaks at 47-50 MiB tracked under 64 MiB (docs/datafusion.md).
pub const DEFAULT_MARGIN: f64 = 0.2;

/// The most [`MemquotaPool::new`]'s margin keeps, whatever the limit: what DataFusion
/// allocates without reserving it does not grow with the limit. Measured on the 22
/// TPC-H queries (SF 1, 2 partitions) at 128 MiB, 256 MiB and 1 GiB: at most 46 MiB
/// past the reservations, but for hash joins' build sides, whose copy a build side's
/// own requests make room for (docs/datafusion.md, "What DataFusion does not reserve").
pub const DEFAULT_MARGIN_CAP: u64 = 64 << 20;

/// How long a request of a query under its fair share waits, at most, for queries over
/// theirs to make room when the process is short (see [`MemquotaPool`]).
pub const DEFAULT_ROOM_WAIT: Duration = Duration::from_secs(2);

/// A DataFusion [`MemoryPool`] that decides on what the process really holds.
///
/// Every `try_grow` is admitted against memquota's budget: native memory tracked by
/// the allocator (every allocation, reserved or not) plus the heap, with the query's
/// reservations in the same account as its allocations (a scope is charged the larger
/// of the two, so a reservation and the allocations it covers count once).
///
/// * Past the limit, or past its query's fair share, every request is refused, even
///   one its allocations already cover (DataFusion mostly reserves after allocating).
/// * A spillable consumer's reservation is refused earlier, so that its operator
///   spills: when the margin and room for its next step (as large as what it holds:
///   a hash table doubles) no longer fit under the limit, or under its query's share.
///   Reservations holding nothing or under 1/32 of the limit go up to the limit:
///   refusing them frees little, and some phases cannot spill (a merge's first
///   buffers, the replay of spilled aggregates).
/// * Several queries at once: when the process is short while the requesting query
///   is under its fair share and another query is over its own, the request waits (at
///   most [`DEFAULT_ROOM_WAIT`], woken by every release) for the memory that query's
///   next growth frees: it is refused, being over its share, so its operator spills,
///   or fails (the query furthest over its share gives way, not the one that asked
///   last). The waiting thread hands its tokio worker's other tasks on
///   (`block_in_place`); on a current-thread runtime nothing waits.
/// * A request that spilling cannot answer and that does not fit fails with
///   `ResourcesExhausted`, carrying the queries (what each holds against its fair
///   share, and for whom a query gives way), the largest consumers and memquota's
///   figures.
///
/// Run each query with [`run_query`](crate::run_query) so it is a memquota scope: its
/// allocations are then told from other queries', and each query gets its fair share
/// of the budget. Outside a scope a request is decided as if all of it were new. Give
/// the runtime [`disk_manager_builder`](crate::disk_manager_builder) too, so reading
/// spill files back is charged to the query.
///
/// Creating the pool switches memquota to [`Enforcement::Gates`]: the allocator counts
/// every allocation but refuses none, because an infallible Rust allocation that is
/// refused aborts the process. The pool's refusals are what keep memory under the
/// limit. Resident memory follows what is allocated through memquota's own purging
/// (freed pages go back to the system once the process passes its soft threshold).
pub struct MemquotaPool {
    margin: Margin,
    consumers: Mutex<HashMap<usize, Tracked>>,
    refusals: AtomicU64,
    /// Refusals that spilling cannot answer (a consumer that cannot spill, or a spiller
    /// holding nothing), by the raw handle of their query's scope, for `collect_query`
    /// to tell a plan that cannot fit from one that spills.
    unspillable: Mutex<HashMap<u64, u64>>,
    retries: AtomicU64,
    replans: AtomicU64,
    replanned_joins: AtomicU64,
    room: Room,
    room_wait: Duration,
}

/// The pool's counts ([`MemquotaPool::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Requests refused: each one made its operator spill, or failed it.
    pub refusals: u64,
    /// Queries run again with a more frugal plan by
    /// [`collect_query`](crate::collect_query).
    pub retries: u64,
    /// Queries [`collect_query`](crate::collect_query) planned with sort-merge joins
    /// before running them: the estimate of their hash joins' build sides did not fit
    /// the room the budget left them, so the joins that did not fit became sort-merge
    /// joins.
    pub replans: u64,
    /// The joins of those queries planned as sort-merge joins instead of hash joins.
    pub replanned_joins: u64,
    /// Waits that found the query they waited for holding spillable reservations: it
    /// was asked to spill, at its next growth.
    pub spill_asks: u64,
    /// Requests of a query under its fair share that waited for a query over its share
    /// to make room.
    pub waits: u64,
    /// Of those, the waits that ended in room (the request was granted).
    pub waits_with_room: u64,
    /// Queries failed as the heaviest: refused, while another query waited for them, a
    /// request their operator could not answer by spilling.
    pub heaviest_failed: u64,
    /// Requests waiting now.
    pub waiting: u64,
}

/// Scopes with unspillable refusals kept before those of ended scopes are dropped
/// (queries run with `run_query` never take theirs).
const UNSPILLABLE_KEPT: usize = 256;

/// A DataFusion consumer as the pool sees it.
struct Tracked {
    name: String,
    can_spill: bool,
    /// The query's scope it was registered in.
    scope: Option<ScopeHandle>,
    /// Its bytes in that scope; `None` outside a scope.
    charge: Option<Reservation>,
    reserved: u64,
    peak: u64,
}

impl MemquotaPool {
    /// A pool on the process budget (`memquota::init`, or the `MEMQUOTA_*` variables),
    /// with the measured margin: [`DEFAULT_MARGIN`] of the limit, at most
    /// [`DEFAULT_MARGIN_CAP`].
    pub fn new() -> MemquotaPool {
        MemquotaPool::with(Margin { fraction: DEFAULT_MARGIN, cap: DEFAULT_MARGIN_CAP })
    }

    /// A pool whose requests leave `margin` (a fraction of the limit and of a query's
    /// share, clamped to [0, 0.9], with no cap) for the memory DataFusion does not
    /// reserve.
    pub fn with_margin(margin: f64) -> MemquotaPool {
        MemquotaPool::with(Margin { fraction: margin.clamp(0.0, 0.9), cap: u64::MAX })
    }

    fn with(margin: Margin) -> MemquotaPool {
        memquota::set_enforcement(Enforcement::Gates);
        crate::install_tracer();
        MemquotaPool {
            margin,
            consumers: Mutex::new(HashMap::new()),
            refusals: AtomicU64::new(0),
            unspillable: Mutex::new(HashMap::new()),
            retries: AtomicU64::new(0),
            replans: AtomicU64::new(0),
            replanned_joins: AtomicU64::new(0),
            room: Room::default(),
            room_wait: DEFAULT_ROOM_WAIT,
        }
    }

    /// The same pool, whose requests wait at most `wait` for queries over their fair
    /// share to make room ([`DEFAULT_ROOM_WAIT`] by default; zero: never wait).
    pub fn with_room_wait(mut self, wait: Duration) -> MemquotaPool {
        self.room_wait = wait;
        self
    }

    /// The pool's counts now.
    pub fn stats(&self) -> PoolStats {
        let room = self.room.counts();
        PoolStats {
            refusals: self.refusals(),
            retries: self.retries(),
            replans: self.replans.load(Relaxed),
            replanned_joins: self.replanned_joins.load(Relaxed),
            spill_asks: room.spill_asks,
            waits: room.waits,
            waits_with_room: room.waits_with_room,
            heaviest_failed: room.heaviest_failed,
            waiting: room.waiting,
        }
    }

    /// Requests refused so far: each one made its operator spill, or failed it.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Relaxed)
    }

    /// Queries run again with a more frugal plan by
    /// [`collect_query`](crate::collect_query) after an operator that cannot spill was
    /// refused.
    pub fn retries(&self) -> u64 {
        self.retries.load(Relaxed)
    }

    pub(crate) fn note_retry(&self) {
        self.retries.fetch_add(1, Relaxed);
    }

    pub(crate) fn note_replan(&self, joins: u64) {
        self.replans.fetch_add(1, Relaxed);
        self.replanned_joins.fetch_add(joins, Relaxed);
    }

    /// What a request of `scope`'s query that cannot spill could be granted now: the
    /// room under the limit and under the query's fair share, each less the margin,
    /// as [`decide`] grants (an estimate of what a plan may hold is held against it).
    pub(crate) fn room_for(&self, scope: ScopeHandle) -> u64 {
        let process = memquota::process_account();
        let room = process.headroom.saturating_sub(self.margin.of(process.limit));
        let share = scope
            .account()
            .map_or(u64::MAX, |s| s.share.saturating_sub(self.margin.of(s.share)).saturating_sub(s.held));
        room.min(share)
    }

    /// Refusals in `scope` that spilling could not answer, since the last call.
    pub(crate) fn take_unspillable_refusals(&self, scope: ScopeHandle) -> u64 {
        self.unspillable_table().remove(&scope.as_raw()).unwrap_or(0)
    }

    fn note_unspillable_refusal(&self, scope: ScopeHandle) {
        let mut t = self.unspillable_table();
        if t.len() >= UNSPILLABLE_KEPT {
            t.retain(|&raw, _| ScopeHandle::from_raw(raw).is_live());
        }
        *t.entry(scope.as_raw()).or_insert(0) += 1;
    }

    fn unspillable_table(&self) -> MutexGuard<'_, HashMap<u64, u64>> {
        // Counts only: a panic elsewhere under the lock leaves nothing inconsistent.
        self.unspillable.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn table(&self) -> MutexGuard<'_, HashMap<usize, Tracked>> {
        // A panic elsewhere under the lock leaves figures, not broken invariants.
        self.consumers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tracked<'a>(table: &'a mut HashMap<usize, Tracked>, consumer: &MemoryConsumer) -> &'a mut Tracked {
        table.entry(consumer.id()).or_insert_with(|| Tracked::new(consumer))
    }

    /// Decides `request` on the figures now and charges it if granted; else why not,
    /// and the consumer's scope.
    fn admit(
        &self,
        consumer: &MemoryConsumer,
        request: &Request,
    ) -> std::result::Result<(), (Option<ScopeHandle>, Refusal)> {
        let mut table = self.table();
        let scope = Self::tracked(&mut table, consumer).scope;
        let account = memquota::process_account();
        let figures = Figures {
            headroom: account.headroom,
            limit: account.limit,
            scope: scope.and_then(ScopeHandle::account),
        };
        decide(&figures, request, self.margin).map_err(|why| (scope, why))?;
        let t = Self::tracked(&mut table, consumer);
        if let Some(r) = t.charge.as_mut() {
            r.grow_unchecked(request.additional);
        }
        t.reserved += request.additional;
        t.peak = t.peak.max(t.reserved);
        Ok(())
    }

    /// Waits for room for `request` of `scope`'s query, refused because the process is
    /// short, when that query is under its fair share and another is over its own (and
    /// has asked for memory since a wait for it last timed out). `None`: no wait.
    fn make_room(&self, consumer: &MemoryConsumer, request: &Request, scope: ScopeHandle) -> Option<Waited> {
        if self.room_wait.is_zero() || !can_block() {
            return None;
        }
        let queries = room::queries();
        let me = queries.iter().find(|q| q.handle == scope.as_raw())?;
        if me.held.saturating_add(request.additional) > me.share {
            return None;
        }
        let heavy = room::heaviest(&queries, scope.as_raw())?;
        if self.room.is_unanswered(heavy.handle) {
            return None;
        }
        let spill = self.holds_spillable(heavy.handle);
        let wait = || {
            self.room
                .wait(heavy.handle, &me.name, spill, self.room_wait, || self.admit(consumer, request).is_ok())
        };
        Some(match tokio::runtime::Handle::try_current() {
            // The worker's other tasks (the heavy query's, maybe) go on elsewhere.
            Ok(_) => tokio::task::block_in_place(wait),
            Err(_) => wait(),
        })
    }

    /// Whether `scope`'s query holds a spillable reservation.
    fn holds_spillable(&self, scope: u64) -> bool {
        self.table()
            .values()
            .any(|t| t.can_spill && t.reserved > 0 && t.scope.map(ScopeHandle::as_raw) == Some(scope))
    }

    fn charge(&self, reservation: &MemoryReservation, bytes: u64) {
        let mut table = self.table();
        let t = Self::tracked(&mut table, reservation.consumer());
        if let Some(r) = t.charge.as_mut() {
            r.grow_unchecked(bytes);
        }
        t.reserved += bytes;
        t.peak = t.peak.max(t.reserved);
    }
}

impl Default for MemquotaPool {
    fn default() -> Self {
        MemquotaPool::new()
    }
}

impl Tracked {
    fn new(consumer: &MemoryConsumer) -> Tracked {
        let scope: Option<ScopeHandle> = MemoryManager::global().current();
        Tracked {
            name: consumer.name().to_owned(),
            can_spill: consumer.can_spill(),
            scope,
            // An empty reservation: nothing to admit.
            charge: scope.and_then(|s| s.reserve(0).ok()),
            reserved: 0,
            peak: 0,
        }
    }
}

impl fmt::Debug for MemquotaPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemquotaPool")
            .field("margin", &self.margin.fraction)
            .field("margin_cap", &self.margin.cap)
            .field("reserved", &self.reserved())
            .field("refusals", &self.refusals())
            .field("retries", &self.retries())
            .field("room_wait", &self.room_wait)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl fmt::Display for MemquotaPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "memquota(margin {}% of the limit", self.margin.fraction * 100.0)?;
        match self.margin.cap {
            u64::MAX => write!(f, ")"),
            cap => write!(f, ", at most {} MiB)", cap >> 20),
        }
    }
}

impl MemoryPool for MemquotaPool {
    fn name(&self) -> &str {
        "memquota"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        let t = Tracked::new(consumer);
        self.table().insert(consumer.id(), t);
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        // Its memquota reservation is dropped (released) outside the lock.
        let gone = self.table().remove(&consumer.id());
        drop(gone);
        self.room.released();
    }

    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        self.charge(reservation, additional as u64);
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        let bytes = shrink as u64;
        {
            let mut table = self.table();
            let t = Self::tracked(&mut table, reservation.consumer());
            if let Some(r) = t.charge.as_mut() {
                r.shrink(bytes);
            }
            t.reserved = t.reserved.saturating_sub(bytes);
        }
        self.room.released();
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        // This thread's unflushed bytes, into the account the decision reads.
        memquota::flush_thread();
        let consumer = reservation.consumer();
        let request = Request {
            additional: additional as u64,
            can_spill: consumer.can_spill(),
            held_by_reservation: reservation.size() as u64,
            copies: copies_what_it_holds(consumer.name()),
        };
        if self.room.any_unanswered() {
            // A query a wait timed out on asks again: it may be waited for again.
            let scope = self.table().get(&consumer.id()).and_then(|t| t.scope);
            if let Some(scope) = scope {
                self.room.asking(scope.as_raw());
            }
        }
        let (scope, why) = match self.admit(consumer, &request) {
            Ok(()) => return Ok(()),
            Err(refused) => refused,
        };
        // The process is short while the query may still grow: make room first.
        let mut waited = None;
        if let (Refusal::Process { .. }, Some(scope)) = (why, scope) {
            match self.make_room(consumer, &request, scope) {
                Some(Waited::Room) => return Ok(()),
                Some(Waited::InVain(d)) => waited = Some(d),
                None => {}
            }
        }
        self.refusals.fetch_add(1, Relaxed);
        let top = {
            let table = self.table();
            exhausted::top_consumers(table.iter().map(|(id, t)| exhausted::Line {
                id: *id,
                name: &t.name,
                can_spill: t.can_spill,
                reserved: t.reserved,
                peak: t.peak,
            }))
        };
        // A spiller holding nothing has nothing to spill: its refusal fails its
        // operator as an unspillable one's does.
        let fails = !request.can_spill || request.held_by_reservation == 0;
        let queries = room::queries();
        let this = scope.map(ScopeHandle::as_raw);
        let mut note = String::new();
        if let Some(scope) = scope {
            if fails {
                self.note_unspillable_refusal(scope);
            }
            if let Some(waiter) = self.room.take_mark(scope.as_raw(), fails) {
                note = exhausted::giving_way(&queries, scope.as_raw(), &waiter, fails);
            } else if let Some(d) = waited {
                note = exhausted::waited_in_vain(&queries, scope.as_raw(), d);
            }
        }
        // The query's unreserved sites follow its consumers. They are read from a
        // profile dump: only for a refusal that fails its operator, whose message a
        // user reads (a spiller's refusal makes it spill).
        let mut top = top;
        if let Some(sites) = scope.filter(|_| fails).and_then(ScopeHandle::unreserved_sites) {
            top.push_str(&exhausted::unreserved(&sites));
        }
        Err(DataFusionError::ResourcesExhausted(exhausted::message(
            consumer,
            reservation.size() as u64,
            &request,
            why,
            &note,
            &exhausted::queries(&queries, this),
            &top,
        )))
    }

    fn reserved(&self) -> usize {
        self.table().values().map(|t| t.reserved as usize).sum()
    }

    fn memory_limit(&self) -> MemoryLimit {
        match memquota::process_account().limit {
            u64::MAX => MemoryLimit::Infinite,
            limit => MemoryLimit::Finite(limit as usize),
        }
    }
}

/// Whether the calling thread may block waiting for room: not on a current-thread
/// runtime, whose one thread runs the queries that would make it (and where tokio's
/// `block_in_place` panics).
fn can_block() -> bool {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread,
        Err(_) => true,
    }
}
