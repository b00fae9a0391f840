//! The retry state machine's home: the one [`Machine`] (`machine.rs`) behind a std
//! mutex, its figures, the rooms of the tasks it sees, and its fork handlers. The
//! table is only consulted once a request has failed to fit after spills and
//! reclaims, far from the fast path.

pub use super::machine::{Active, Machine, Rank, Rollback, State};

use super::pool::POOL;
use crate::base::stats::RetryStats;
use crate::base::sync::{lock, ForkHeld};
use crate::base::sync::{Mutex, MutexGuard};

static MACHINE: Mutex<Machine> = Mutex::new(Machine::new());
static HELD: ForkHeld<MutexGuard<'static, Machine>> = ForkHeld::new();

/// The machine, locked. Lock order: the machine, then the pool's spin lock; never the
/// other way.
pub(crate) fn machine() -> MutexGuard<'static, Machine> {
    lock(&MACHINE)
}

/// The machine's figures.
pub(crate) fn stats() -> RetryStats {
    let m = machine();
    let [running, allocating, blocked, rollback_requested, rolling_back, bufn, split_requested] = m.counts();
    RetryStats {
        running,
        allocating,
        blocked,
        rollback_requested,
        rolling_back,
        bufn,
        split_requested,
        ..m.totals
    }
}

/// Every scope with threads attached, into `out`, each with its room: what its share
/// allows, at most `headroom`. Returns how many.
pub(crate) fn active_tasks(out: &mut [Active; super::MAX_SCOPES], headroom: u64) -> usize {
    let p = POOL.lock();
    let share = p.share_among(super::pool::Among::Busy);
    let mut n = 0;
    for (task, s) in p.scopes() {
        if s.attached > 0 && n < out.len() {
            let room = u64::try_from(share.room(s.held, s.cap)).unwrap_or(0).min(headroom);
            out[n] = Active { task, attached: s.attached, room };
            n += 1;
        }
    }
    n
}

/// A scope's rank (id, then begin order); `None`: it has ended.
pub(crate) fn rank_of(handle: u64) -> Option<Rank> {
    POOL.lock().scope(handle).map(|s| (s.id, s.gen))
}

/// The machine's part of a fork's prepare handler.
pub(crate) fn before_fork() {
    // SAFETY: a guard of MACHINE, just taken.
    unsafe { HELD.keep(lock(&MACHINE)) };
}

/// The machine's part of a fork's parent and child handlers; in the child only the
/// forking thread's slot (`survivor`) stays.
///
/// # Safety
/// On the thread whose prepare handler called [`before_fork`], once.
pub(crate) unsafe fn after_fork(child: bool, survivor: Option<usize>) {
    // SAFETY: forwarded contract.
    unsafe {
        HELD.release_after(|m| {
            if child {
                m.keep_only(survivor);
            }
        })
    };
}
