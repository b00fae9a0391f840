//! A scope's figures: stats snapshots for export and the report a scope leaves when
//! it ends. Built from copies taken under the pool lock; formatted outside it.

use crate::base::sync::Ordering::Relaxed;
use crate::ledger::tables::owner;
use crate::ledger::tables::pool::{self, Scope, MAX_CONSUMERS, MAX_SCOPES, POOL};
use std::fmt;

pub(crate) fn snapshot() -> ScopeSnapshot {
    let mut scopes: Vec<(u64, Scope)> = Vec::with_capacity(MAX_SCOPES);
    let mut consumers: Vec<(u64, pool::Consumer)> = Vec::with_capacity(MAX_CONSUMERS);
    let (totals, share, borrowed) = {
        let p = POOL.lock();
        scopes.extend(p.scopes().map(|(h, s)| (h, *s)));
        consumers.extend(p.consumers().map(|(k, c)| (k, *c)));
        (p.totals, p.share(), p.borrowed_bytes())
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
        budgets: totals.budgets,
        budget_borrowed_bytes: borrowed,
        budget_freed_early_bytes: totals.freed_early_bytes,
        budget_overcommits: totals.budget_overcommits,
        budget_overcommit_bytes: totals.budget_overcommit_bytes,
        scopes: scopes
            .iter()
            .map(|(h, s)| {
                let mine = consumers.iter().filter(|(_, c)| u64::from(c.scope) == h & 0xffff);
                ScopeStats::new(*h, s, mine.map(|(_, c)| ConsumerStats::new(c)).collect())
            })
            .collect(),
    }
}

/// One scope's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Bytes its threads allocated minus freed (flushed), never below zero: what its
    /// threads free past that (small blocks allocated outside it) credits the process.
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
    pub(crate) fn new(handle: u64, s: &Scope, consumers: Vec<ConsumerStats>) -> ScopeStats {
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

/// A scope's account now and the most its fair share lets it hold: a `Copy` read under
/// the pool's lock, with no allocation, cheap enough for every request of an engine's
/// memory pool that decides for itself ([`ScopeHandle::account`](crate::ScopeHandle::account)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScopeAccount {
    /// What the scope is charged: the larger of `allocated` and `reserved`.
    pub held: u64,
    /// Bytes its threads allocated minus freed (flushed), never below zero: what its
    /// threads free past that (small blocks allocated outside it) credits the process.
    pub allocated: i64,
    /// Bytes reserved.
    pub reserved: u64,
    /// Its fair share of the pool (`pool / competing scopes`, itself counted), or its
    /// cap if lower.
    pub share: u64,
}

impl ScopeAccount {
    pub(crate) fn new(s: &Scope, share: pool::Share) -> ScopeAccount {
        let u = |v: i64| u64::try_from(v).unwrap_or(0);
        ScopeAccount {
            held: u(s.held),
            allocated: s.used,
            reserved: u(s.reserved),
            share: u(share.max_per().min(s.cap)),
        }
    }
}

/// One consumer's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
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
    pub(crate) fn new(c: &pool::Consumer) -> ConsumerStats {
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
#[non_exhaustive]
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
    /// Budgets drawn ([`Budget`](crate::Budget)).
    pub budgets: u64,
    /// Bytes budgets' runners borrowed past their grants (each budget's largest
    /// deficit; live budgets' so far).
    pub budget_borrowed_bytes: u64,
    /// Bytes returned early by [`Budget::try_free`](crate::Budget::try_free).
    pub budget_freed_early_bytes: u64,
    /// Grants to a lone budget past the limit (so one runner progresses), and their
    /// bytes.
    pub budget_overcommits: u64,
    #[allow(missing_docs)]
    pub budget_overcommit_bytes: u64,
    /// The live scopes.
    pub scopes: Vec<ScopeStats>,
}

/// What a scope still held when it ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
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
    pub(crate) fn new(s: &Scope, consumers: &[pool::Consumer]) -> ScopeReport {
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
        use crate::base::text::Size;
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
