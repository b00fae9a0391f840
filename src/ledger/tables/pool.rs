//! The scope tables and their arithmetic, under one spin lock: per scope what its
//! threads allocated (`used`), what it reserved (`reserved`) and what it is charged
//! (`held`), per consumer its reservations, and the fair-share rule.
//!
//! One account, never double counted: a scope is charged `held = max(used, reserved)`
//! (plus its budgets' charges). Allocations first consume the scope's unused
//! reservation; only past it do they raise `held`. The process account holds the
//! unscoped bytes plus every scope's `held`, so a change of `held` is the change the
//! process account must see, and this module returns it to the caller to add, with
//! what a credit passes to the process unscoped: a use never goes below zero (see
//! [`change`]), so a reservation never covers less of a scope's allocations than
//! they are. A request that
//! must fit the account hands [`Pool::try_grant`] (or [`Pool::apply_charged`]) the
//! charge to make, which runs under the lock: the figures change only if the account
//! takes their change, and no free can be credited in between.

use super::budget::{self, Entry, FIRST_INDEX, MAX_BUDGETS};
use super::spin::SpinLock;
use super::tags;
use crate::base::sync::{
    AtomicBool, AtomicU64,
    Ordering::{Relaxed, Release},
};
use crate::base::text::SignedSize;
use std::fmt::{self, Write};

/// Scopes alive at once.
pub const MAX_SCOPES: usize = 256;
/// Consumers registered at once, over all scopes.
pub const MAX_CONSUMERS: usize = 1024;
const NAME: usize = 48;

/// Set by the first scope: from then on big blocks get owner records. Read through
/// [`crate::arbitration::scopes_used`]; the face hears of it first, from
/// [`crate::arbitration::begin_raw`] ([`Face::scopes_began`](crate::ledger::threads::Face::scopes_began)).
pub(crate) static SCOPES_USED: AtomicBool = AtomicBool::new(false);
/// Scopes begun so far, readable without the lock (the OOM report's flood control
/// tells a new scope from a repeat).
pub(crate) static BEGUN: AtomicU64 = AtomicU64::new(0);

pub(crate) static POOL: SpinLock<Pool> = SpinLock::new(Pool::new());

/// A name in a fixed buffer, cut at a character boundary.
#[derive(Clone, Copy)]
pub(crate) struct Name {
    bytes: [u8; NAME],
    len: u8,
}

impl Name {
    const EMPTY: Name = Name { bytes: [0; NAME], len: 0 };

    pub(crate) fn new(s: &str) -> Name {
        let mut take = s.len().min(NAME);
        while !s.is_char_boundary(take) {
            take -= 1;
        }
        let mut n = Name::EMPTY;
        n.bytes[..take].copy_from_slice(&s.as_bytes()[..take]);
        n.len = take as u8;
        n
    }

    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or("")
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

/// What one scope holds. Plain data, copied out for reports and stats.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scope {
    pub(crate) gen: u64,
    pub(crate) live: bool,
    pub(crate) id: u64,
    pub(crate) priority: i32,
    pub(crate) name: Name,
    pub(crate) used: i64,
    pub(crate) reserved: i64,
    /// Of `used`, what threads attached under its live budgets allocated.
    pub(crate) in_budgets: i64,
    /// What its live budgets are charged: each the larger of its grant and its use.
    pub(crate) budgets: i64,
    pub(crate) held: i64,
    pub(crate) peak: i64,
    pub(crate) cap: i64,
    pub(crate) attached: u32,
    /// Attached threads rolled back and waiting until further notice (retry blocks).
    pub(crate) yielding: u32,
    /// It has held memory or had a thread attached.
    pub(crate) started: bool,
    pub(crate) waits: u64,
    pub(crate) refusals: u64,
}

impl Scope {
    const EMPTY: Scope = Scope {
        gen: 0,
        live: false,
        id: 0,
        priority: 0,
        name: Name::EMPTY,
        used: 0,
        reserved: 0,
        in_budgets: 0,
        budgets: 0,
        held: 0,
        peak: 0,
        cap: i64::MAX,
        attached: 0,
        yielding: 0,
        started: false,
        waits: 0,
        refusals: 0,
    };

    /// Every attached thread is rolled back, waiting (see `Pool::set_yielding`).
    fn yields(&self) -> bool {
        self.live && self.attached > 0 && self.yielding >= self.attached
    }

    /// Whether the scope takes part in the fair share: live and not yielding, from its
    /// begin until it is idle (holding nothing, no thread attached) after it started
    /// work. Tasks that begin together share from the start, whatever order their
    /// first requests come in; a task whose work is done and whose memory is released
    /// (Spark removes it from its pool then) no longer narrows the others' share,
    /// even before its scope ends.
    fn competes(&self) -> bool {
        self.live && !self.yields() && (self.busy() || !self.started)
    }

    /// Holding memory or with a thread attached.
    fn busy(&self) -> bool {
        self.held > 0 || self.attached > 0
    }

    /// Whether the scope takes part in the share that retry blocks see: Spark's rule
    /// (busy and not yielding). A scope begun but not started does not narrow it: a
    /// retry block waits for memory that running tasks hold, never for tasks that
    /// have not started, and its deadlock rule sees only the tasks with threads.
    fn competes_busy(&self) -> bool {
        self.live && !self.yields() && self.busy()
    }

    /// Whether the scope takes part in a share among `among`.
    fn counts(&self, among: Among) -> bool {
        match among {
            Among::Begun => self.competes(),
            Among::Busy => self.competes_busy(),
        }
    }

    /// The charge for `used` allocated (never below zero) and `reserved` reserved bytes.
    pub(crate) fn held_for(used: i64, reserved: i64) -> i64 {
        used.max(reserved)
    }

    /// Changes its figures with `f`; returns the change of `held`. Its budgets'
    /// allocations are charged to them; the rest of `used` first consumes the
    /// reservations.
    pub(crate) fn update(&mut self, f: impl FnOnce(&mut Scope)) -> i64 {
        f(self);
        let held = Scope::held_for(self.used.saturating_sub(self.in_budgets), self.reserved)
            .saturating_add(self.budgets);
        let dh = held.saturating_sub(self.held);
        self.held = held;
        self.peak = self.peak.max(held);
        dh
    }
}

/// A spillable consumer's figures (its callback lives in `spill.rs`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Consumer {
    pub(crate) gen: u64,
    pub(crate) live: bool,
    pub(crate) scope: u16,
    pub(crate) name: Name,
    pub(crate) used: i64,
    pub(crate) peak: i64,
    pub(crate) spills: u64,
    pub(crate) spilled: u64,
}

impl Consumer {
    const EMPTY: Consumer = Consumer {
        gen: 0,
        live: false,
        scope: 0,
        name: Name::EMPTY,
        used: 0,
        peak: 0,
        spills: 0,
        spilled: 0,
    };
}

/// What a request asks of its scope.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Ask {
    /// Bytes an attached thread allocates: all or nothing.
    Alloc(u64),
    /// An explicit reservation, maybe for a consumer (key 0: none).
    Reserve { bytes: u64, consumer: u64 },
}

impl Ask {
    pub(crate) fn bytes(&self) -> u64 {
        match *self {
            Ask::Alloc(b) | Ask::Reserve { bytes: b, .. } => b,
        }
    }

    pub(crate) fn consumer(&self) -> u64 {
        match *self {
            Ask::Alloc(_) => 0,
            Ask::Reserve { consumer, .. } => consumer,
        }
    }
}

/// The outcome of one look at the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The scope has ended (or never was).
    Ended,
    /// Applied: `granted` bytes, and `held` moved by `dh` (the process account's share),
    /// which the charge took.
    Granted { granted: u64, dh: i64 },
    /// The share grants it, the process account does not: the charge refused `gap`
    /// bytes of `held`, and nothing changed.
    Over { gap: u64 },
    /// Below its minimum share and short: wait for memory to be freed (Spark's rule).
    Wait { gap: u64 },
    /// Short by `gap` bytes of charge.
    Short { gap: u64 },
}

/// Which scopes a share divides the pool among.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Among {
    /// From begin until idle after started work ([`Scope::competes`]): the fair share.
    Begun,
    /// Holding memory or with a thread attached ([`Scope::competes_busy`]): what a
    /// thread in a retry block is admitted by, and what the retry machine's rooms use.
    Busy,
}

impl Among {
    const ALL: [Among; 2] = [Among::Begun, Among::Busy];
}

/// Spark's ExecutionMemoryPool rule for one scope among `active`: it may hold up to
/// `pool / active` (and its own cap), and one below `pool / (2 * active)` that cannot
/// get memory waits instead of failing. Pure arithmetic.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Share {
    pub(crate) pool: i64,
    pub(crate) active: u32,
    pub(crate) held_sum: i64,
}

impl Share {
    pub(crate) fn max_per(&self) -> i64 {
        self.pool / i64::from(self.active.max(1))
    }

    pub(crate) fn min_per(&self) -> i64 {
        self.pool / (2 * i64::from(self.active.max(1)))
    }

    /// The most `held` may still grow for a scope holding `held` under `cap`.
    pub(crate) fn room(&self, held: i64, cap: i64) -> i64 {
        let own = self.max_per().min(cap).saturating_sub(held.max(0));
        let free = self.pool.saturating_sub(self.held_sum.max(0));
        own.min(free).max(0)
    }
}

/// Adds `g` bytes allocated (`alloc`) or reserved to scope `s`, through budget `b`
/// when the request is one of its threads'; returns the change of `held` and the
/// bytes that pass to the process account unscoped. A live budget's allocations draw
/// on its grant, and a reservation on it grants it more; a draining budget's blocks
/// are the scope's own.
///
/// A credit never takes a use below zero: a live budget's use takes what it can,
/// then the scope's own use, and the rest passes to the process. What a thread frees
/// past what its budget and scope allocated is memory they never had (allocated
/// outside the scope or before it began: a plan built outside a query, dropped inside
/// its scope), so it is the process's to credit. Driven below zero, a use would hide
/// under a reservation or a grant: the process account would miss the free while
/// the reservation covers it, or the next allocations would refill the use first and
/// be charged on top of the reservation.
fn change(s: &mut Scope, b: Option<&mut Entry>, alloc: bool, g: i64) -> (i64, i64) {
    let own = s.used.saturating_sub(s.in_budgets);
    match b {
        Some(b) if b.live => {
            let (g, past) = if alloc { down_to_zero(b.used, g) } else { (g, 0) };
            let (mine, passed) = down_to_zero(own, past);
            let dc = if alloc { b.allocate(g) } else { b.grant(g) };
            let dh = s.update(|s| {
                if alloc {
                    s.used = s.used.saturating_add(g).saturating_add(mine);
                    s.in_budgets = s.in_budgets.saturating_add(g);
                }
                s.budgets += dc;
            });
            (dh, passed)
        }
        Some(b) if alloc => {
            let (g, passed) = down_to_zero(own, g);
            b.allocate(down_to_zero(b.used, g).0);
            (s.update(|s| s.used = s.used.saturating_add(g)), passed)
        }
        _ if alloc => {
            let (g, passed) = down_to_zero(own, g);
            (s.update(|s| s.used = s.used.saturating_add(g)), passed)
        }
        _ => (s.update(|s| s.reserved = s.reserved.saturating_add(g).max(0)), 0),
    }
}

/// Splits a change `g` of a use `used` into what the use takes and what passes on:
/// all of a charge; of a credit, what takes the use down to zero.
fn down_to_zero(used: i64, g: i64) -> (i64, i64) {
    let take = g.max(used.max(0).saturating_neg());
    (take, g - take)
}

pub(crate) struct Pool {
    scopes: [Scope; MAX_SCOPES],
    consumers: [Consumer; MAX_CONSUMERS],
    budgets: [Entry; MAX_BUDGETS],
    /// Live budgets, over all scopes.
    budgets_live: u32,
    /// Budgets whose runner waits to borrow a deficit: new budgets wait behind them.
    pub(crate) borrowers: u32,
    /// Live scopes.
    live: u32,
    /// Scopes that take part in each share (`Scope::counts`), indexed by `Among`.
    competing: [u32; 2],
    held_sum: i64,
    /// The execution pool in bytes; 0: the process limit.
    pool_bytes: i64,
    next_gen: u64,
    pub(crate) totals: Totals,
}

/// Process-wide scope counters.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Totals {
    pub(crate) begun: u64,
    pub(crate) ended: u64,
    pub(crate) leaked_bytes: u64,
    pub(crate) spills: u64,
    pub(crate) spilled_bytes: u64,
    pub(crate) reserve_in_spill: u64,
    pub(crate) waits: u64,
    pub(crate) refusals: u64,
    /// Budgets begun.
    pub(crate) budgets: u64,
    /// Bytes budgets' runners borrowed past their grants (each budget's largest deficit).
    pub(crate) borrowed_bytes: u64,
    /// Bytes returned early by `Budget::try_free`.
    pub(crate) freed_early_bytes: u64,
    /// Grants to a lone budget past the limit, and their bytes.
    pub(crate) budget_overcommits: u64,
    pub(crate) budget_overcommit_bytes: u64,
}

fn key(gen: u64, index: usize) -> u64 {
    gen << 16 | index as u64
}

fn index(key: u64) -> usize {
    (key & 0xffff) as usize
}

impl Pool {
    const fn new() -> Pool {
        Pool {
            scopes: [Scope::EMPTY; MAX_SCOPES],
            consumers: [Consumer::EMPTY; MAX_CONSUMERS],
            budgets: [Entry::EMPTY; MAX_BUDGETS],
            budgets_live: 0,
            borrowers: 0,
            live: 0,
            competing: [0; 2],
            held_sum: 0,
            pool_bytes: 0,
            next_gen: 1,
            totals: Totals {
                begun: 0,
                ended: 0,
                leaked_bytes: 0,
                spills: 0,
                spilled_bytes: 0,
                reserve_in_spill: 0,
                waits: 0,
                refusals: 0,
                budgets: 0,
                borrowed_bytes: 0,
                freed_early_bytes: 0,
                budget_overcommits: 0,
                budget_overcommit_bytes: 0,
            },
        }
    }

    fn gen(&mut self) -> u64 {
        let g = self.next_gen;
        self.next_gen += 1;
        g
    }

    /// The scope of `handle`: itself, or the scope a budget (live or draining) was
    /// drawn from.
    pub(crate) fn task_of(&self, handle: u64) -> u64 {
        self.budget(handle).map_or(handle, |b| b.scope)
    }

    /// The live or draining budget of key `handle`.
    fn budget(&self, handle: u64) -> Option<&Entry> {
        let b = self.budgets.get(budget::slot_of(handle)?)?;
        (!b.free() && b.gen == handle >> 16).then_some(b)
    }

    fn budget_mut(&mut self, handle: u64) -> Option<&mut Entry> {
        let b = self.budgets.get_mut(budget::slot_of(handle)?)?;
        (!b.free() && b.gen == handle >> 16).then_some(b)
    }

    /// The scope of `handle` (a budget's: the scope it was drawn from), if live.
    pub(crate) fn scope(&self, handle: u64) -> Option<&Scope> {
        let handle = self.task_of(handle);
        let s = self.scopes.get(index(handle))?;
        (handle != 0 && s.live && s.gen == handle >> 16).then_some(s)
    }

    fn scope_mut(&mut self, handle: u64) -> Option<&mut Scope> {
        let handle = self.task_of(handle);
        let s = self.scopes.get_mut(index(handle))?;
        (handle != 0 && s.live && s.gen == handle >> 16).then_some(s)
    }

    pub(crate) fn consumer(&self, key: u64) -> Option<&Consumer> {
        let c = self.consumers.get(index(key))?;
        (key != 0 && c.live && c.gen == key >> 16).then_some(c)
    }

    fn consumer_mut(&mut self, key: u64) -> Option<&mut Consumer> {
        let c = self.consumers.get_mut(index(key))?;
        (key != 0 && c.live && c.gen == key >> 16).then_some(c)
    }

    /// The scope part of the sample tags of the scope of `handle` (a budget's: the
    /// scope it was drawn from), as `tags::decode` gives it, if live.
    pub(crate) fn tag_scope(&self, handle: u64) -> Option<u16> {
        let scope_key = self.task_of(handle);
        self.scope(scope_key).map(|s| super::tags::scope_part(index(scope_key), s.gen))
    }

    /// The handle of a scope's slot index, if live.
    pub(crate) fn handle_of(&self, index: usize) -> Option<u64> {
        let s = &self.scopes[index];
        s.live.then(|| key(s.gen, index))
    }

    pub(crate) fn begin(&mut self, name: &str, id: u64, priority: i32) -> Option<u64> {
        let i = self.scopes.iter().position(|s| !s.live)?;
        let gen = self.gen();
        self.scopes[i] = Scope { gen, live: true, id, priority, name: Name::new(name), ..Scope::EMPTY };
        self.live += 1;
        self.competing[Among::Begun as usize] += 1; // begun, not started: not busy
        self.totals.begun += 1;
        BEGUN.fetch_add(1, Relaxed);
        SCOPES_USED.store(true, Release);
        tags::publish_scope(i, Some(&self.scopes[i]));
        Some(key(gen, i))
    }

    /// Ends a scope: returns its last figures and the process account's change (its
    /// unused reservation goes away; what it still holds stays, unscoped).
    pub(crate) fn end(&mut self, handle: u64) -> Option<(Scope, i64)> {
        if budget::slot_of(handle).is_some() {
            return None; // a budget's key names no scope to end
        }
        let s = *self.scope(handle)?;
        let slot = index(handle);
        self.scopes[slot].live = false;
        self.live -= 1;
        for among in Among::ALL {
            self.competing[among as usize] -= u32::from(s.counts(among));
        }
        self.held_sum -= s.held;
        self.totals.ended += 1;
        self.totals.leaked_bytes += u64::try_from(s.used).unwrap_or(0);
        for c in self.consumers.iter_mut().filter(|c| c.live && usize::from(c.scope) == slot) {
            c.live = false;
        }
        // Its budgets end with it: their grants go, their blocks are unscoped now (in
        // its leak), and their keys go stale.
        for (j, b) in self.budgets.iter_mut().enumerate().filter(|(_, b)| b.scope == handle && !b.free()) {
            if b.live {
                self.budgets_live -= 1;
                self.totals.borrowed_bytes += u64::try_from(b.borrowed).unwrap_or(0);
            }
            *b = Entry { gen: b.gen, ..Entry::EMPTY };
            tags::publish_budget(j, None, slot, 0, false);
        }
        tags::publish_scope(slot, None);
        Some((s, s.used - s.held))
    }

    pub(crate) fn set_cap(&mut self, handle: u64, cap: Option<u64>) -> bool {
        let Some(s) = self.scope_mut(handle) else { return false };
        s.cap = cap.map_or(i64::MAX, |c| i64::try_from(c).unwrap_or(i64::MAX));
        true
    }

    pub(crate) fn set_pool_bytes(&mut self, bytes: u64) {
        self.pool_bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
    }

    /// The fair share among the scopes that compete for the pool.
    pub(crate) fn share(&self) -> Share {
        self.share_among(Among::Begun)
    }

    /// The share among the scopes that compete for the pool under `among`'s rule.
    pub(crate) fn share_among(&self, among: Among) -> Share {
        let pool = if self.pool_bytes > 0 { self.pool_bytes } else { crate::base::settings::quota().limit };
        Share { pool, active: self.competing[among as usize], held_sum: self.held_sum }
    }

    /// The share as scope `handle` sees it when it asks: a scope that asks competes,
    /// idle or not.
    pub(crate) fn share_for(&self, handle: u64, among: Among) -> Share {
        let mut share = self.share_among(among);
        if self.scope(handle).is_some_and(|s| !s.counts(among)) {
            share.active += 1;
        }
        share
    }

    /// Applies `change` to scope `handle`, keeping the count of competing scopes.
    /// Returns what `change` returned; `None`: the scope has ended.
    fn with_count<R>(&mut self, handle: u64, change: impl FnOnce(&mut Scope) -> R) -> Option<R> {
        let s = self.scope_mut(handle)?;
        let before = Among::ALL.map(|among| s.counts(among));
        let r = change(s);
        s.started |= s.busy();
        let after = Among::ALL.map(|among| s.counts(among));
        for k in 0..Among::ALL.len() {
            self.competing[k] = self.competing[k] + u32::from(after[k]) - u32::from(before[k]);
        }
        Some(r)
    }

    /// A thread of scope `handle` enters (`true`) or leaves a wait until further
    /// notice. A scope whose every attached thread waits so yields: like a task that
    /// released its memory in Spark, it is not active for the fair share, so the
    /// tasks still running may use the pool.
    pub(crate) fn set_yielding(&mut self, handle: u64, on: bool) {
        self.with_count(handle, |s| {
            s.yielding = if on { s.yielding + 1 } else { s.yielding.saturating_sub(1) };
        });
    }

    /// Adds `d` bytes an attached thread allocated (or, negative, freed) to its scope.
    /// Returns the process account's change: `d` itself if the scope has ended, and
    /// all of a credit past the scope's use (see [`change`]).
    pub(crate) fn attribute(&mut self, handle: u64, d: i64) -> i64 {
        self.step(handle, true, d).unwrap_or(d)
    }

    /// Adds `g` bytes allocated (`alloc`) or reserved by `handle` (a scope or a
    /// budget) to the tables; returns the change the process account must see (of
    /// `held`, and a credit past the uses, [`change`]), `None` if the scope has ended.
    /// A budget's allocations draw on its grant; a reservation on a budget grants it
    /// more (or, negative, returns part of it).
    fn step(&mut self, handle: u64, alloc: bool, g: i64) -> Option<i64> {
        let scope_key = self.task_of(handle);
        self.scope(scope_key)?;
        let mut b = self.budget(handle).copied();
        let (dh, passed) = self.with_count(scope_key, |s| change(s, b.as_mut(), alloc, g))?;
        if let (Some(mut b), Some(slot)) = (b, budget::slot_of(handle)) {
            b.clear_if_free();
            self.budgets[slot] = b;
        }
        self.held_sum += dh;
        self.publish_tags(scope_key, handle);
        Some(dh + passed)
    }

    /// Publishes the sample tags (`tags.rs`) of scope `scope_key` and, when `handle`
    /// is a budget's key, of that budget: after every change of their figures.
    fn publish_tags(&self, scope_key: u64, handle: u64) {
        let i = index(scope_key);
        let s = self.scope(scope_key);
        // An ended scope's slot was cleared by `end`, and may hold a new scope now.
        if s.is_some() {
            tags::publish_scope(i, s);
        }
        if let Some(slot) = budget::slot_of(handle) {
            let (gen, unreserved) =
                s.map_or((0, false), |s| (s.gen, s.used.saturating_sub(s.in_budgets) > s.reserved));
            tags::publish_budget(slot, self.budgets.get(slot), i, gen, unreserved);
        }
    }

    /// Begins a budget drawn from scope `handle`, granted nothing yet; its key.
    pub(crate) fn begin_budget(&mut self, handle: u64) -> Option<u64> {
        let scope = self.task_of(handle);
        self.scope(scope)?;
        let i = self.budgets.iter().position(Entry::free)?;
        let gen = self.gen();
        self.budgets[i] = Entry { gen, live: true, scope, ..Entry::EMPTY };
        self.budgets_live += 1;
        self.totals.budgets += 1;
        self.publish_tags(scope, key(gen, FIRST_INDEX + i));
        Some(key(gen, FIRST_INDEX + i))
    }

    /// Ends budget `key`: its unused grant goes back to the pool, and what its threads
    /// still hold stays with its scope (credited when freed). Returns the change of
    /// `held`.
    pub(crate) fn end_budget(&mut self, key: u64) -> i64 {
        let Some(b) = self.budget(key).copied().filter(|b| b.live) else { return 0 };
        self.budgets_live -= 1;
        self.totals.borrowed_bytes += u64::try_from(b.borrowed).unwrap_or(0);
        if let Some(e) = self.budget_mut(key) {
            e.live = false;
            e.clear_if_free();
        }
        let dh = self.with_count(b.scope, |s| {
            s.update(|s| {
                s.in_budgets -= b.used;
                s.budgets -= b.charge();
            })
        });
        let dh = dh.unwrap_or(0);
        self.held_sum += dh;
        self.publish_tags(b.scope, key);
        dh
    }

    /// Returns up to `bytes` of budget `key`'s grant its use does not cover; the
    /// bytes returned and the change of `held`.
    pub(crate) fn free_budget(&mut self, key: u64, bytes: u64) -> (u64, i64) {
        let Some(give) = self.budget(key).filter(|b| b.live).map(|b| b.unused(bytes)) else { return (0, 0) };
        let dh = self.step(key, false, -give).unwrap_or(0);
        self.totals.freed_early_bytes += give as u64;
        (give as u64, dh)
    }

    /// Budget `key`'s figures: granted, used, borrowed; `None` once it ended.
    pub(crate) fn budget_figures(&self, key: u64) -> Option<(i64, i64, i64)> {
        self.budget(key).filter(|b| b.live).map(|b| (b.granted, b.used, b.borrowed))
    }

    /// Whether `key` is a live budget, the only one in flight: its runner may
    /// over-commit, so one always makes progress.
    pub(crate) fn lone_budget(&self, key: u64) -> bool {
        self.budget(key).is_some_and(|b| b.live) && self.budgets_live == 1
    }

    /// Bytes borrowed past their grants: ended budgets' largest deficits and live
    /// budgets' so far.
    pub(crate) fn borrowed_bytes(&self) -> u64 {
        let live: i64 = self.budgets.iter().filter(|b| b.live).map(|b| b.borrowed).sum();
        self.totals.borrowed_bytes + u64::try_from(live).unwrap_or(0)
    }

    /// Whether `key` is a live budget and other budgets are in flight: a runner short
    /// of its deficit then waits for them to free.
    pub(crate) fn others_in_flight(&self, key: u64) -> bool {
        self.is_budget(key) && self.budgets_live > 1
    }

    /// Whether `key` is a live budget.
    pub(crate) fn is_budget(&self, key: u64) -> bool {
        self.budget(key).is_some_and(|b| b.live)
    }

    /// In a `fork` child only the forking thread exists: it is the one thread
    /// attached anywhere (to `survivor`, 0: none), and nothing waits: no runner
    /// borrows, so no new budget waits behind one.
    pub(crate) fn after_fork_child(&mut self, survivor: u64) {
        self.borrowers = 0;
        let task = self.task_of(survivor);
        for (i, s) in self.scopes.iter_mut().enumerate() {
            s.attached = u32::from(s.live && key(s.gen, i) == task);
            s.yielding = 0;
        }
        for (i, b) in self.budgets.iter_mut().enumerate() {
            b.attached = u32::from(!b.free() && key(b.gen, FIRST_INDEX + i) == survivor);
            b.clear_if_free();
        }
        self.competing = Among::ALL.map(|among| self.scopes.iter().map(|s| u32::from(s.counts(among))).sum());
    }

    pub(crate) fn attach(&mut self, handle: u64) -> bool {
        if budget::slot_of(handle).is_some() && !self.is_budget(handle) {
            return false; // an ended budget takes no new threads
        }
        let attached = self.with_count(handle, |s| s.attached += 1).is_some();
        if let Some(b) = self.budget_mut(handle).filter(|_| attached) {
            b.attached += 1;
        }
        attached
    }

    pub(crate) fn detach(&mut self, handle: u64) {
        self.with_count(handle, |s| s.attached = s.attached.saturating_sub(1));
        if let Some(b) = self.budget_mut(handle) {
            b.attached = b.attached.saturating_sub(1);
            b.clear_if_free();
        }
    }

    pub(crate) fn add_consumer(&mut self, handle: u64, name: &str) -> Option<u64> {
        self.scope(handle)?;
        let scope = index(handle) as u16;
        let i = self.consumers.iter().position(|c| !c.live)?;
        let gen = self.gen();
        self.consumers[i] = Consumer { gen, live: true, scope, name: Name::new(name), ..Consumer::EMPTY };
        Some(key(gen, i))
    }

    pub(crate) fn remove_consumer(&mut self, key: u64) {
        if let Some(c) = self.consumer_mut(key) {
            c.live = false;
        }
    }

    /// Looks at the pool for `ask` on `handle` and, if the share grants it, applies it
    /// if `charge` takes the change of `held` ([`apply_charged`](Pool::apply_charged));
    /// with `partial`, a reservation may be granted less than asked. With `may_wait`,
    /// a scope below its minimum share that comes up short is told to wait.
    pub(crate) fn try_grant(
        &mut self,
        handle: u64,
        ask: Ask,
        partial: bool,
        may_wait: bool,
        among: Among,
        charge: impl FnOnce(i64) -> bool,
    ) -> Decision {
        let share = self.share_for(handle, among);
        let Some(s) = self.scope(handle) else { return Decision::Ended };
        let (plain, reserved, held, cap) = (s.used.saturating_sub(s.in_budgets), s.reserved, s.held, s.cap);
        let alloc = matches!(ask, Ask::Alloc(_));
        let need = self.cost(handle, ask, ask.bytes());
        let budget = self.is_budget(handle);
        let room = share.room(held, cap);
        let granted = if need <= room {
            ask.bytes()
        } else if partial && !alloc && !budget {
            // The part already covered by allocations costs nothing more.
            let covered = plain.max(0).saturating_sub(reserved).max(0);
            u64::try_from(covered.saturating_add(room)).unwrap_or(0).min(ask.bytes())
        } else {
            0
        };
        let gap = u64::try_from(need.saturating_sub(room)).unwrap_or(0);
        // Waiting helps when the pool is short, not when the scope's own cap is.
        let capped = cap.saturating_sub(held.max(0)) < need;
        // A new budget waits behind the runners borrowing a deficit (seed 001); a
        // budget short of room waits in `admit.rs`, which counts the borrowers.
        if budget && !alloc && need > 0 && self.borrowers > 0 {
            let gap = gap.max(1);
            return if may_wait { Decision::Wait { gap } } else { Decision::Short { gap } };
        }
        if may_wait && !capped && granted < ask.bytes() && held.max(0).saturating_add(room) < share.min_per()
        {
            return Decision::Wait { gap };
        }
        if granted == 0 && ask.bytes() > 0 {
            return Decision::Short { gap };
        }
        match self.apply_charged(handle, ask, granted, charge) {
            Ok(dh) => Decision::Granted { granted, dh },
            Err(dh) => Decision::Over { gap: u64::try_from(dh).unwrap_or(0) },
        }
    }

    /// The change of `held` that applying `granted` bytes of `ask` would make (see
    /// [`apply`](Pool::apply)), the tables untouched.
    fn cost(&self, handle: u64, ask: Ask, granted: u64) -> i64 {
        let g = i64::try_from(granted).unwrap_or(i64::MAX);
        let alloc = matches!(ask, Ask::Alloc(_));
        match self.scope(handle) {
            Some(s) => {
                let (dh, passed) = change(&mut { *s }, self.budget(handle).copied().as_mut(), alloc, g);
                dh + passed
            }
            None if alloc => g,
            None => 0,
        }
    }

    /// Applies `granted` bytes of `ask` if `charge` takes the change of `held` they
    /// make, the process account's share: `Ok` with it, applied; `Err` with it,
    /// refused, and the tables untouched (no peak, no borrowing, no consumer's peak).
    /// `charge` runs under this lock: it may only move the process account (a
    /// compare-and-swap), never allocate, wait or call out.
    pub(crate) fn apply_charged(
        &mut self,
        handle: u64,
        ask: Ask,
        granted: u64,
        charge: impl FnOnce(i64) -> bool,
    ) -> Result<i64, i64> {
        let dh = self.cost(handle, ask, granted);
        if !charge(dh) {
            return Err(dh);
        }
        let applied = self.apply(handle, ask, granted, 1);
        debug_assert_eq!(applied, dh, "the cost is what applying it changes");
        Ok(dh)
    }

    /// Applies (`sign` 1) or undoes (`sign` -1) `granted` bytes of `ask`. Returns the
    /// change of `held` (the scope has ended: the bytes are unscoped, and the change is
    /// what the process account sees of an allocation, nothing of a reservation).
    pub(crate) fn apply(&mut self, handle: u64, ask: Ask, granted: u64, sign: i64) -> i64 {
        let g = i64::try_from(granted).unwrap_or(i64::MAX) * sign;
        if let Ask::Reserve { consumer, .. } = ask {
            if let Some(c) = self.consumer_mut(consumer) {
                c.used += g;
                c.peak = c.peak.max(c.used);
            }
        }
        let alloc = matches!(ask, Ask::Alloc(_));
        self.step(handle, alloc, g).unwrap_or(if alloc { g } else { 0 })
    }

    pub(crate) fn note_wait(&mut self, handle: u64) {
        self.totals.waits += 1;
        if let Some(s) = self.scope_mut(handle) {
            s.waits += 1;
        }
    }

    pub(crate) fn note_refusal(&mut self, handle: u64) {
        self.totals.refusals += 1;
        if let Some(s) = self.scope_mut(handle) {
            s.refusals += 1;
        }
    }

    pub(crate) fn note_spill(&mut self, key: u64, freed: u64) {
        // `freed` is what a user's callback says it freed: never trusted to fit.
        self.totals.spills += 1;
        self.totals.spilled_bytes = self.totals.spilled_bytes.saturating_add(freed);
        if let Some(c) = self.consumer_mut(key) {
            c.spills += 1;
            c.spilled = c.spilled.saturating_add(freed);
        }
    }

    pub(crate) fn scopes(&self) -> impl Iterator<Item = (u64, &Scope)> {
        self.scopes.iter().enumerate().filter(|(_, s)| s.live).map(|(i, s)| (key(s.gen, i), s))
    }

    pub(crate) fn consumers(&self) -> impl Iterator<Item = (u64, &Consumer)> {
        self.consumers.iter().enumerate().filter(|(_, c)| c.live).map(|(i, c)| (key(c.gen, i), c))
    }

    /// The consumers of the scope in slot `scope`.
    pub(crate) fn consumers_of(&self, scope: usize) -> impl Iterator<Item = (u64, &Consumer)> {
        self.consumers().filter(move |(_, c)| usize::from(c.scope) == scope)
    }

    /// The scope tree for an OOM report: every live scope, then its consumers, each
    /// with current and peak bytes, then what `sites` writes for it (given the scope
    /// part of its sample tags). Writes into a fixed buffer: no allocation.
    pub(crate) fn write_tree<W: Write>(
        &self,
        w: &mut W,
        sites: &mut dyn FnMut(&mut W, u16) -> fmt::Result,
    ) -> fmt::Result {
        if self.live == 0 {
            return Ok(());
        }
        let share = self.share();
        writeln!(
            w,
            "  scopes           {} live, {} sharing the pool {}, share {} each (min {})",
            self.live,
            self.competing[Among::Begun as usize],
            SignedSize(share.pool),
            SignedSize(share.max_per()),
            SignedSize(share.min_per())
        )?;
        for (i, s) in self.scopes.iter().enumerate().filter(|(_, s)| s.live) {
            writeln!(
                w,
                "    scope {:?} id {} prio {}: held {} (peak {}), allocated {}, reserved {}, {} threads",
                s.name,
                s.id,
                s.priority,
                SignedSize(s.held),
                SignedSize(s.peak),
                SignedSize(s.used),
                SignedSize(s.reserved),
                s.attached
            )?;
            for b in self.budgets.iter().filter(|b| b.live && b.scope == key(s.gen, i)) {
                writeln!(
                    w,
                    "      budget: granted {}, used {}, borrowed {}, {} threads",
                    SignedSize(b.granted),
                    SignedSize(b.used),
                    SignedSize(b.borrowed),
                    b.attached
                )?;
            }
            for (_, c) in self.consumers_of(i) {
                writeln!(
                    w,
                    "      consumer {:?}: {} (peak {}), spilled {} times, {}",
                    c.name,
                    SignedSize(c.used),
                    SignedSize(c.peak),
                    c.spills,
                    crate::base::text::Size(c.spilled)
                )?;
            }
            sites(w, super::tags::scope_part(i, s.gen))?;
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A pool of 1000 bytes with one scope begun.
    fn one_scope() -> (Pool, u64) {
        let mut p = Pool::new();
        p.set_pool_bytes(1000);
        let h = p.begin("t", 1, 0).unwrap();
        (p, h)
    }

    /// A charge the process account always takes.
    const ANY: fn(i64) -> bool = |_| true;

    #[test]
    fn held_is_the_larger_of_used_and_reserved() {
        assert_eq!(Scope::held_for(10, 30), 30);
        assert_eq!(Scope::held_for(40, 30), 40);
    }

    #[test]
    fn a_credit_past_the_use_passes_to_the_process() {
        let (mut p, h) = one_scope();
        let r = Ask::Reserve { bytes: 100, consumer: 0 };
        assert!(matches!(p.try_grant(h, r, false, true, Among::Begun, ANY), Decision::Granted { .. }));
        assert_eq!(p.attribute(h, 30), 0, "inside the reservation");
        // Freed: 30 of its own (under the reservation), 20 it never allocated.
        assert_eq!(p.attribute(h, -50), -20, "what it never allocated credits the process");
        assert_eq!(p.scope(h).map(|s| (s.used, s.held)), Some((0, 100)));
        assert_eq!(p.attribute(h, 100), 0, "the reservation covers all it allocates next");
        assert_eq!(p.scope(h).map(|s| (s.used, s.held)), Some((100, 100)));
        // Through a budget: its use first, then the scope's own, then the process.
        let b = p.begin_budget(h).unwrap();
        let grant = Ask::Reserve { bytes: 40, consumer: 0 };
        assert!(matches!(p.try_grant(b, grant, false, true, Among::Begun, ANY), Decision::Granted { .. }));
        assert_eq!(p.attribute(b, 10), 0, "inside the grant");
        assert_eq!(p.attribute(b, -200), -90, "10 of the budget's, 100 of the scope's, 90 past both");
        assert_eq!(p.budget_figures(b), Some((40, 0, 0)));
        assert_eq!(p.scope(h).map(|s| (s.used, s.in_budgets, s.held)), Some((0, 0, 140)));
        assert_eq!(p.attribute(b, 40), 0, "the grant covers all the budget allocates next");
        assert_eq!(p.end_budget(b), -40, "its blocks stay with the scope, under its reservation");
        assert_eq!(p.attribute(b, -60), -20, "a draining budget's blocks are the scope's own");
        assert_eq!(p.scope(h).map(|s| (s.used, s.held)), Some((0, 100)));
        assert_eq!(p.held_sum, 100);
    }

    #[test]
    fn share_follows_spark() {
        let s = Share { pool: 800, active: 4, held_sum: 500 };
        assert_eq!((s.max_per(), s.min_per()), (200, 100));
        assert_eq!(s.room(50, i64::MAX), 150);
        assert_eq!(s.room(50, 120), 70);
        assert_eq!(Share { held_sum: 780, ..s }.room(50, i64::MAX), 20);
        assert_eq!(s.room(250, i64::MAX), 0);
    }

    #[test]
    fn allocations_consume_the_reservation_first() {
        let (mut p, h) = one_scope();
        let r = Ask::Reserve { bytes: 300, consumer: 0 };
        assert_eq!(
            p.try_grant(h, r, false, true, Among::Begun, ANY),
            Decision::Granted { granted: 300, dh: 300 }
        );
        assert_eq!(p.attribute(h, 200), 0, "inside the reservation: no new charge");
        assert_eq!(p.attribute(h, 150), 50);
        assert_eq!(p.apply(h, r, 300, -1), 0, "allocations exceed it: releasing costs nothing");
        assert_eq!(p.scope(h).unwrap().held, 350);
        assert_eq!(p.end(h).map(|(s, d)| (s.used, d)), Some((350, 0)));
    }

    #[test]
    fn budgets_draw_first_and_drain_into_their_scope() {
        let (mut p, h) = one_scope();
        let b = p.begin_budget(h).unwrap();
        assert_eq!(p.task_of(b), h);
        let grant = Ask::Reserve { bytes: 100, consumer: 0 };
        assert_eq!(
            p.try_grant(b, grant, false, true, Among::Begun, ANY),
            Decision::Granted { granted: 100, dh: 100 }
        );
        let r = Ask::Reserve { bytes: 50, consumer: 0 };
        assert_eq!(
            p.try_grant(h, r, false, true, Among::Begun, ANY),
            Decision::Granted { granted: 50, dh: 50 }
        );
        assert_eq!(p.attribute(b, 80), 0, "the budget's use draws on its grant, not the reservation");
        assert_eq!(p.attribute(h, 30), 0, "the scope's own use draws on the reservation");
        assert_eq!(p.attribute(b, 40), 20, "past its grant the budget borrows");
        assert_eq!(p.scope(h).unwrap().held, 120 + 50);
        assert_eq!(p.free_budget(b, 1000), (0, 0), "nothing over-claimed while it borrows");
        assert_eq!(p.attribute(b, -100), -20, "freed: back to its grant");
        assert_eq!(p.free_budget(b, 50), (50, -50));
        assert!(p.attach(b));
        // Its 20 live bytes stay with the scope, covered now by the 50 reserved.
        assert_eq!(p.end_budget(b), -50, "its grant goes back");
        assert!(!p.attach(b), "an ended budget takes no thread");
        assert_eq!(p.attribute(b, -20), 0, "a draining block credits the scope, under its reservation");
        p.detach(b);
        assert_eq!(p.scope(h).map(|s| (s.used, s.held, s.attached)), Some((30, 50, 0)));
        assert_eq!(p.attribute(b, 5), 5, "a drained budget's key is stale");
    }

    #[test]
    fn a_scope_ends_its_budgets() {
        let (mut p, h) = one_scope();
        let b = p.begin_budget(h).unwrap();
        let grant = Ask::Reserve { bytes: 100, consumer: 0 };
        assert!(matches!(p.try_grant(b, grant, false, true, Among::Begun, ANY), Decision::Granted { .. }));
        assert_eq!(p.attribute(b, 30), 0);
        assert!(p.end(b).is_none(), "a budget's key ends no scope");
        assert!(p.lone_budget(b));
        assert_eq!(p.end(h).map(|(s, d)| (s.used, d)), Some((30, -70)), "the grant goes, the use is a leak");
        assert!(!p.is_budget(b) && !p.lone_budget(b) && p.budgets_live == 0);
        assert_eq!(p.attribute(b, -30), -30, "its blocks are unscoped now");
        assert_eq!(p.end_budget(b), 0, "dropping the Budget afterwards changes nothing");
    }

    #[test]
    fn a_refused_charge_leaves_no_trace() {
        let (mut p, h) = one_scope();
        let b = p.begin_budget(h).unwrap();
        let c = p.add_consumer(h, "c").unwrap();
        let grant = Ask::Reserve { bytes: 100, consumer: 0 };
        assert!(matches!(p.try_grant(b, grant, false, true, Among::Begun, ANY), Decision::Granted { .. }));
        let figures = |p: &Pool| {
            let (s, e, k) = (p.scope(h).unwrap(), p.budget(b).unwrap(), p.consumer(c).unwrap());
            (s.held, s.peak, s.used, s.reserved, e.used, e.peak, e.borrowed, k.used, k.peak, p.held_sum)
        };
        let before = figures(&p);
        let mut asked = 0;
        let refuse = |dh| {
            asked = dh;
            false
        };
        let past_the_grant = p.try_grant(b, Ask::Alloc(300), false, true, Among::Begun, refuse);
        assert_eq!(
            (past_the_grant, asked),
            (Decision::Over { gap: 200 }, 200),
            "asked for what passes the grant"
        );
        let reserve = Ask::Reserve { bytes: 50, consumer: c };
        assert_eq!(p.try_grant(h, reserve, false, true, Among::Begun, |_| false), Decision::Over { gap: 50 });
        assert_eq!(p.apply_charged(b, Ask::Alloc(150), 150, |_| false), Err(50));
        assert_eq!(figures(&p), before, "no peak, no borrowing, no consumer's peak");
        assert_eq!(p.apply_charged(b, Ask::Alloc(150), 150, ANY), Ok(50), "taken: applied");
        assert_eq!(p.budget_figures(b), Some((100, 150, 50)));
    }

    #[test]
    fn partial_grants_and_waits() {
        let mut p = Pool::new();
        p.set_pool_bytes(1000);
        let a = p.begin("a", 1, 0).unwrap();
        let b = p.begin("b", 2, 0).unwrap();
        let ask = |bytes| Ask::Reserve { bytes, consumer: 0 };
        assert!(matches!(
            p.try_grant(a, ask(700), false, true, Among::Begun, ANY),
            Decision::Short { gap: 200 }
        ));
        assert_eq!(
            p.try_grant(a, ask(700), true, true, Among::Begun, ANY),
            Decision::Granted { granted: 500, dh: 500 }
        );
        assert_eq!(p.attribute(a, 800), 300, "allocations past the share are charged anyway");
        // b holds nothing, below 1/2N = 250, and only 200 are free: it waits
        assert_eq!(p.try_grant(b, ask(600), true, true, Among::Begun, ANY), Decision::Wait { gap: 400 });
        assert_eq!(
            p.try_grant(b, ask(200), false, true, Among::Begun, ANY),
            Decision::Granted { granted: 200, dh: 200 }
        );
    }

    #[test]
    fn retry_blocks_share_among_busy_scopes_only() {
        let mut p = Pool::new();
        p.set_pool_bytes(1000);
        let a = p.begin("a", 1, 0).unwrap();
        let b = p.begin("b", 2, 0).unwrap();
        let ask = |bytes| Ask::Reserve { bytes, consumer: 0 };
        // b has begun but not started: it narrows the fair share, not a retry block's.
        assert!(matches!(p.try_grant(a, ask(600), false, false, Among::Begun, ANY), Decision::Short { .. }));
        assert!(matches!(p.try_grant(a, ask(600), false, false, Among::Busy, ANY), Decision::Granted { .. }));
        // Once b has a thread attached, it counts for both.
        assert!(p.attach(b));
        assert_eq!(p.share_among(Among::Busy).active, 2);
        assert_eq!(p.share_among(Among::Begun).active, 2);
        // Idle after its work: it counts for neither.
        p.detach(b);
        assert_eq!((p.share_among(Among::Busy).active, p.share_among(Among::Begun).active), (1, 1));
    }
}
