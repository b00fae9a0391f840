//! Budgets bound to allocations (seed 001, spark-rapids' async readers): a part of a
//! scope's pool drawn ahead for one runner. What threads attached under the budget
//! allocate draws on it first and gives back to it when freed; past its grant the
//! runner borrows from the pool. Plain data and arithmetic; the pool keeps the table
//! and the scope's sums ([`Scope::in_budgets`](super::pool::Scope), `budgets`).
//!
//! A budget's handle is a key like a scope's, with its slot index above
//! [`FIRST_INDEX`], so a thread attached under it carries it where a scope handle
//! goes (the ledger's `Local`, owner records) and every table lookup resolves it to
//! its scope.

/// Budgets alive (or draining: ended, their blocks not all freed yet) at once.
pub const MAX_BUDGETS: usize = 256;
/// Budget keys' slot indices start here; scope indices stay below.
pub(crate) const FIRST_INDEX: usize = 0x8000;

/// One budget's figures.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    pub(crate) gen: u64,
    /// Running: its handle draws on it. Ended with blocks out or threads attached:
    /// draining, its blocks still credit its scope when freed and its threads detach
    /// from its scope.
    pub(crate) live: bool,
    /// The scope it was drawn from.
    pub(crate) scope: u64,
    /// What the pool granted it (the estimate, less what [`Budget::try_free`](crate::Budget::try_free) returned).
    pub(crate) granted: i64,
    /// What its threads allocated and have not freed.
    pub(crate) used: i64,
    pub(crate) peak: i64,
    /// The most it went past its grant: the deficit it borrowed.
    pub(crate) borrowed: i64,
    /// Threads attached under it.
    pub(crate) attached: u32,
}

impl Entry {
    pub(crate) const EMPTY: Entry =
        Entry { gen: 0, live: false, scope: 0, granted: 0, used: 0, peak: 0, borrowed: 0, attached: 0 };

    /// What the budget is charged: the larger of its grant and its use.
    pub(crate) fn charge(&self) -> i64 {
        self.granted.max(self.used)
    }

    /// Ended with blocks still out or threads still attached.
    pub(crate) fn draining(&self) -> bool {
        !self.live && (self.used > 0 || self.attached > 0)
    }

    /// Whether its slot may take a new budget.
    pub(crate) fn free(&self) -> bool {
        !self.live && !self.draining()
    }

    /// Clears a slot that is free (keeping its generation, so old keys stay stale).
    pub(crate) fn clear_if_free(&mut self) {
        if self.free() {
            *self = Entry { gen: self.gen, ..Entry::EMPTY };
        }
    }

    /// Adds `d` allocated (or, negative, freed) bytes; returns the change of its charge.
    pub(crate) fn allocate(&mut self, d: i64) -> i64 {
        let before = self.charge();
        self.used = self.used.saturating_add(d);
        self.peak = self.peak.max(self.used);
        self.borrowed = self.borrowed.max(self.used.saturating_sub(self.granted));
        self.charge() - before
    }

    /// Adds `g` granted (or, negative, returned) bytes; returns the change of its charge.
    pub(crate) fn grant(&mut self, g: i64) -> i64 {
        let before = self.charge();
        self.granted = self.granted.saturating_add(g).max(0);
        self.charge() - before
    }

    /// What [`Budget::try_free`](crate::Budget::try_free) may return of `bytes` now: the grant its use does not cover.
    pub(crate) fn unused(&self, bytes: u64) -> i64 {
        let spare = self.granted.saturating_sub(self.used.max(0)).max(0);
        spare.min(i64::try_from(bytes).unwrap_or(i64::MAX))
    }
}

/// The slot index of a budget key, if it is one.
pub(crate) fn slot_of(key: u64) -> Option<usize> {
    let i = (key & 0xffff) as usize;
    (i >= FIRST_INDEX).then(|| i - FIRST_INDEX)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn use_draws_on_the_grant_then_borrows() {
        let mut e = Entry { live: true, scope: 1, ..Entry::EMPTY };
        assert_eq!(e.grant(100), 100);
        assert_eq!(e.allocate(60), 0, "inside the grant: no new charge");
        assert_eq!(e.allocate(70), 30, "past it: the deficit is borrowed");
        assert_eq!((e.borrowed, e.charge()), (30, 130));
        assert_eq!(e.allocate(-130), -30, "freed: back to the grant, nothing returned");
        assert_eq!(e.unused(1000), 100);
        assert_eq!(e.grant(-e.unused(40)), -40, "try_free returns at once");
        assert_eq!((e.charge(), e.borrowed), (60, 30));
    }

    #[test]
    fn an_ended_budget_drains_while_its_blocks_live() {
        let mut e = Entry { live: true, scope: 1, granted: 10, used: 50, ..Entry::EMPTY };
        e.live = false;
        assert!(e.draining() && !e.free());
        e.allocate(-50);
        assert!(e.free());
        e.attached = 1;
        assert!(e.draining(), "a thread still attached under it");
    }

    #[test]
    fn keys_above_the_scopes_are_budgets() {
        assert_eq!(slot_of(7 << 16 | 3), None);
        assert_eq!(slot_of(7 << 16 | (FIRST_INDEX as u64 + 3)), Some(3));
    }
}
