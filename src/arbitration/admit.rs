//! Admission of a scope's request: the fair share, Spark's spill order, bounded
//! waits woken on free, then the process budget (with its reclaim and report).
//!
//! Runs with the calling thread busy-marked (inside `charge_slow`, or `reserve`
//! marks it): spill callbacks and reclaims may allocate, charged and never policed.
//! No lock is held across a callback, a wait, or a reclaim.
//!
//! A grant changes the scope's figures and charges the process account in one step,
//! under the pool lock ([`Room::take`] inside `Pool::try_grant`): figures the account
//! has not taken are never seen by another thread, so a free under the same budget or
//! reservation is always credited against figures the account agrees with, and a
//! refused request leaves no trace (no undo; no peak or borrowing it never had).

use super::retry::{self, Verdict};
use super::spill::{self, Cursor};
use crate::base::config::OnOom;
use crate::ledger::tables::pool::{Among, Ask, Decision, POOL};
use crate::ledger::tables::retry::Rollback;
use crate::ledger::tables::set_refusing;
use crate::ledger::tables::signal::{self, Waiter};
use crate::ledger::threads::{self, Face, Local, ACCOUNT};
use crate::policy::admission::{self, Room, Take};
use std::time::Instant;

pub(crate) enum Outcome {
    Granted(u64),
    Ended,
    Refused,
    /// In a retry block, chosen by the machine: fail with the rollback.
    Rolled(Rollback),
    /// In a retry block, short: block (never leaves `acquire`).
    Short,
}

/// Why the last look came up short.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Short {
    Scope,
    Process,
}

/// The share a request on this thread is admitted by: in a retry block, among the
/// scopes with work under way (see `Among::Busy`).
fn among(l: &Local) -> Among {
    if retry::in_block(l) {
        Among::Busy
    } else {
        Among::Begun
    }
}

/// Admits `ask` for scope `handle` on the calling thread (busy-marked by the caller).
pub(crate) fn acquire(l: &Local, face: &Face, handle: u64, ask: Ask, partial: bool) -> Outcome {
    let outcome = look(l, face, handle, ask, partial);
    if matches!(outcome, Outcome::Granted(_)) && retry::in_block(l) {
        retry::note_granted(l);
    }
    outcome
}

/// [`acquire`]'s looks at the pool, spills, waits and blocks.
fn look(l: &Local, face: &Face, handle: u64, ask: Ask, partial: bool) -> Outcome {
    // A budget's requests spill, block and roll back as its scope's (its task's).
    let task = POOL.lock().task_of(handle);
    let mut cursor = Cursor::new(task, ask.consumer());
    let mut borrowing = Borrowing { on: false, borrower: task != handle && matches!(ask, Ask::Alloc(_)) };
    let mut waited_out = false;
    // In a retry block a request that stays short blocks instead of failing, until
    // the watchdog ends its wait.
    let mut may_block = retry::in_block(l);
    let mut blocked = false;
    // Registered as a waiter, and the deadline set, only once a wait is in view: a
    // request that fits touches neither the shared counter nor the clock.
    let mut waiter: Option<(Waiter<'_>, Instant)> = None;
    loop {
        // What a spill freed on this thread shows up here.
        ACCOUNT.add(threads::settle(l, face));
        let seen = signal::generation();
        let room = Room::under_limit();
        let decision = POOL.lock().try_grant(handle, ask, false, !waited_out, among(l), |dh| room.take(dh));
        let (gap, short) = match decision {
            Decision::Ended => return Outcome::Ended,
            Decision::Granted { granted, .. } => {
                room.granted();
                return Outcome::Granted(granted);
            }
            Decision::Over { gap } => (gap, Short::Process),
            Decision::Wait { gap } if !waited_out => {
                // Spark: a task below its minimum share waits for others to free,
                // after its own consumers have spilled.
                let next = cursor.next(&POOL.lock(), gap, true);
                if let Some(k) = next {
                    spill::run(k, gap);
                    continue;
                }
                waited_out = !wait_for_free(l, handle, seen, &mut waiter);
                continue;
            }
            Decision::Wait { gap } | Decision::Short { gap } => (gap, Short::Scope),
        };
        let next = cursor.next(&POOL.lock(), gap, false);
        if let Some(k) = next {
            spill::run(k, gap);
            continue;
        }
        // Nothing left to spill.
        if partial {
            // Bound first: a guard in an `if let` scrutinee lives through the whole
            // body, and the body reaches the report, which takes the lock again.
            let room = Room::under_limit();
            let decision = POOL.lock().try_grant(handle, ask, true, false, among(l), |dh| room.take(dh));
            if let Decision::Granted { granted, .. } = decision {
                room.granted();
                return Outcome::Granted(granted);
            }
        }
        // A budget short of room waits for other budgets in flight to free (a lone
        // one over-commits in `finish`); one whose runner borrows a deficit counts
        // among the borrowers, which new budgets wait behind. In a retry block it
        // blocks instead.
        if task != handle && !may_block && !waited_out && POOL.lock().others_in_flight(handle) {
            borrowing.start();
            waited_out = !wait_for_free(l, handle, seen, &mut waiter);
            continue;
        }
        match finish(l, face, handle, ask, short, may_block) {
            Outcome::Short => {
                match retry::block(l, task, ask.bytes(), !std::mem::replace(&mut blocked, true)) {
                    Verdict::Again => cursor = Cursor::new(task, ask.consumer()),
                    Verdict::Rolled(r) => return Outcome::Rolled(r),
                    Verdict::TimedOut => may_block = false,
                }
            }
            done => return done,
        }
    }
}

/// One step of a bounded wait for memory to be freed (the share wait, a borrower's):
/// registers the waiter first (then the caller looks again: a free from then on moves
/// the generation), then waits for a free seen after `seen`. False once the wait
/// bound has passed.
fn wait_for_free<'l>(
    l: &'l Local,
    handle: u64,
    seen: u64,
    waiter: &mut Option<(Waiter<'l>, Instant)>,
) -> bool {
    let Some((_, deadline)) = *waiter else {
        *waiter = Some((Waiter::new(threads::waiting(l)), Instant::now() + signal::wait_bound()));
        return true;
    };
    if Instant::now() >= deadline {
        return false;
    }
    POOL.lock().note_wait(handle);
    signal::wait_for_free(seen, deadline);
    true
}

/// A budget's runner short of a deficit: counted among the borrowers while it looks,
/// so new budgets wait behind it.
struct Borrowing {
    on: bool,
    borrower: bool,
}

impl Borrowing {
    fn start(&mut self) {
        if self.borrower && !self.on {
            self.on = true;
            POOL.lock().borrowers += 1;
        }
    }
}

impl Drop for Borrowing {
    fn drop(&mut self) {
        if self.on {
            // Saturating: a fork child forgets the borrowers (a spill callback that
            // forked mid-look would come back here in the child).
            let mut p = POOL.lock();
            p.borrowers = p.borrowers.saturating_sub(1);
            drop(p);
            signal::wake(); // new budgets may go now
        }
    }
}

/// A lone budget (no other in flight) that nothing else could make room for: its
/// request is granted past the limit, within the over-commit bound, so one runner
/// always makes progress (seed 001). Counted and reported as an over-commit.
fn overcommit_lone_budget(handle: u64, ask: Ask) -> Option<u64> {
    let room = Room::within_overcommit();
    {
        let mut p = POOL.lock();
        if !p.lone_budget(handle) {
            return None;
        }
        let dh = p.apply_charged(handle, ask, ask.bytes(), |dh| room.take(dh)).ok()?;
        p.totals.budget_overcommits += 1;
        p.totals.budget_overcommit_bytes += u64::try_from(dh).unwrap_or(0);
    }
    room.overcommitted();
    Some(ask.bytes())
}

/// The last step once spills are exhausted: the process budget's own admission (a
/// reclaim, an over-commit for small requests, or a refusal with a report), or a
/// refusal by the scope's share. With `may_block`, `Outcome::Short` instead of a
/// refusal: nothing counted or reported.
fn finish(l: &Local, face: &Face, handle: u64, ask: Ask, short: Short, may_block: bool) -> Outcome {
    let mut requested = i64::try_from(ask.bytes()).unwrap_or(i64::MAX);
    let mut throttle = None;
    if short == Short::Process {
        set_refusing(handle);
        if may_block {
            retry::note_allocating(l);
        }
        // Each try looks at the pool again and charges what the share grants in the
        // same step; reclaims run between tries, with no lock held.
        let rule = among(l);
        let admitted = admission::try_admit_with(l, face, |room| {
            let decision = POOL.lock().try_grant(handle, ask, false, false, rule, |dh| room.take(dh));
            match decision {
                Decision::Granted { .. } => Take::Taken,
                Decision::Over { gap } => {
                    requested = i64::try_from(gap).unwrap_or(i64::MAX);
                    Take::Short
                }
                Decision::Ended | Decision::Wait { .. } | Decision::Short { .. } => Take::Off,
            }
        });
        match admitted {
            Ok(()) => {
                set_refusing(0);
                return Outcome::Granted(ask.bytes()); // all or nothing: not partial
            }
            Err(t) => throttle = t,
        }
    }
    if let Some(g) = overcommit_lone_budget(handle, ask) {
        set_refusing(0);
        return Outcome::Granted(g);
    }
    if may_block {
        set_refusing(0);
        return Outcome::Short;
    }
    POOL.lock().note_refusal(handle);
    set_refusing(handle);
    admission::refuse(requested, throttle, worst(ask));
    Outcome::Refused
}

/// The OOM policy's reach: an allocation follows it (null or abort); a reservation
/// returns an error and never aborts.
fn worst(ask: Ask) -> OnOom {
    match ask {
        Ask::Alloc(_) => OnOom::Abort,
        Ask::Reserve { .. } => OnOom::Null,
    }
}
