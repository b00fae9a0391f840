//! Budgets bound to allocations (`TaskScope::budget`): a runner's estimate drawn from
//! its scope's share ahead of its work, used up by what its threads allocate and
//! given back to the budget when they free (no callbacks, no decay). The arithmetic
//! lives in `tables/budget.rs`; admission (borrowing a deficit ahead of new budgets,
//! a lone budget's over-commit) in `admit.rs`.

use super::handles::{AttachGuard, ScopeHandle, TaskScope};
use super::reserve_raw;
use crate::base::error::{Error, Result};
use crate::ledger::tables::pool::POOL;
use crate::ledger::tables::signal;
use crate::ledger::threads::{self, ACCOUNT};

/// A budget drawn from a scope for one runner (an async reader, a build side).
/// Threads attached under it ([`Budget::attach`], or its [`handle`](Budget::handle)
/// from a pool thread) allocate from it first; past its grant they borrow from the
/// pool. Dropping it returns what its use does not cover; blocks its threads still
/// hold stay with the scope and credit it when freed.
#[derive(Debug)]
#[must_use = "the budget is returned to the pool when dropped"]
pub struct Budget {
    key: u64,
}

/// A budget's figures now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BudgetStats {
    /// What the pool granted: the estimate, less what [`Budget::try_free`] returned.
    pub granted: u64,
    /// What its threads allocated and have not freed (flushed; never below zero: what
    /// they free past it credits the scope's own use, then the process).
    pub used: i64,
    /// The most its use went past its grant: the deficit it borrowed.
    pub borrowed: u64,
}

impl TaskScope {
    /// Draws a budget of `estimate` bytes from the scope (see [`ScopeHandle::budget`]).
    ///
    /// # Errors
    /// As [`ScopeHandle::budget`].
    pub fn budget(&self, estimate: u64) -> Result<Budget> {
        self.handle().budget(estimate)
    }
}

impl ScopeHandle {
    /// Draws a budget of `estimate` bytes from the scope, admitted as a reservation
    /// (spills, the fair share, waits, reclaims; inside a retry block it may block or
    /// roll back). A new budget waits behind runners borrowing a deficit.
    ///
    /// # Errors
    /// As [`ScopeHandle::reserve`]; [`Error::TooManyScopes`] when
    /// `MAX_BUDGETS` (256) budgets are alive or draining.
    pub fn budget(self, estimate: u64) -> Result<Budget> {
        let key = {
            let mut p = POOL.lock();
            if p.scope(self.as_raw()).is_none() {
                return Err(Error::ScopeEnded);
            }
            p.begin_budget(self.as_raw()).ok_or(Error::TooManyScopes)?
        };
        let budget = Budget { key };
        reserve_raw(threads::face(), key, estimate, 0, false)?;
        Ok(budget)
    }
}

impl Budget {
    /// A handle that attaches threads under the budget, for pool threads serving the
    /// runner; it goes stale when the budget ends (attaching then fails).
    pub fn handle(&self) -> ScopeHandle {
        ScopeHandle::from_raw(self.key)
    }

    /// Attaches the calling thread under the budget (see [`ScopeHandle::attach`]).
    ///
    /// # Errors
    /// [`Error::ScopeEnded`] when its scope has ended.
    pub fn attach(&self) -> Result<AttachGuard> {
        self.handle().attach()
    }

    /// Returns up to `bytes` of the grant its use does not cover to the pool now: the
    /// over-claimed part, once the runner knows its real need. Returns the bytes
    /// returned.
    pub fn try_free(&self, bytes: u64) -> u64 {
        let (given, dh) = POOL.lock().free_budget(self.key, bytes);
        ACCOUNT.add(dh);
        if given > 0 {
            signal::wake();
        }
        given
    }

    /// Its figures; `None` once its scope has ended.
    pub fn stats(&self) -> Option<BudgetStats> {
        POOL.lock().budget_figures(self.key).map(|(granted, used, borrowed)| BudgetStats {
            granted: u64::try_from(granted).unwrap_or(0),
            used,
            borrowed: u64::try_from(borrowed).unwrap_or(0),
        })
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        let dh = POOL.lock().end_budget(self.key);
        ACCOUNT.add(dh);
        signal::wake();
    }
}
