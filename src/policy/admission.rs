//! Admission against the process budget: grant under the limit by compare-and-swap,
//! over-commit small requests within a bound, run or await synchronous reclaims while
//! they help, draw on the emergency reserve for a thread refused before, and otherwise
//! refuse with a report. Also the counting-only admission of `Enforcement::Gates` and
//! the check that makes a thread tight past the limit. "Heap" below is everything
//! outside the native account the budget counts: the heap figure, and untracked
//! memory under `Untracked::Count` (`heap_probe::outside`).

use crate::base::config::OnOom;
use crate::base::quota::{Pressure, Quota};
use crate::base::settings::{self, policing_allocations, quota};
use crate::ledger::threads::{self, Face, Local, ACCOUNT};
use crate::policy::coordinator::{SyncOutcome, Throttle};
use crate::policy::heap_probe;
use crate::policy::purge;
use crate::policy::reclaim;
use crate::policy::report::{self, Refusal};
use crate::policy::reserve;
use std::cell::Cell;

/// Sync reclaims one request may go through before it is refused.
const MAX_SYNC_ROUNDS: u32 = 2;

/// The process account's room for one charge, for a request whose size is known only
/// under the pool lock (a scope's change of `held`). The ceiling is read first, with no
/// lock held (the heap probe may run a user's function); [`take`](Room::take) is then
/// a compare-and-swap, made under the pool lock so that the scope's figures and the
/// account move in one step; [`granted`](Room::granted), once the lock is released,
/// asks for a reclaim or a purge.
pub(crate) struct Room {
    quota: Quota,
    heap: i64,
    ceiling: i64,
    /// The last charge asked for (0: none yet).
    asked: Cell<i64>,
    /// The total after a charge taken, or the total that left no room.
    native: Cell<i64>,
    taken: Cell<bool>,
}

impl Room {
    fn at(quota: Quota, heap: i64, ceiling: i64) -> Room {
        Room { quota, heap, ceiling, asked: Cell::new(0), native: Cell::new(0), taken: Cell::new(false) }
    }

    /// Room under the limit.
    pub(crate) fn under_limit() -> Room {
        let (quota, heap) = (quota(), heap_probe::outside());
        Room::at(quota, heap, quota.native_ceiling(heap))
    }

    /// Room within the over-commit bound (the limit plus a sixteenth of it, as small
    /// requests under `refuse_min`): a lone budget's last resort.
    pub(crate) fn within_overcommit() -> Room {
        let (quota, heap) = (quota(), heap_probe::outside());
        Room::at(quota, heap, quota.overcommit_ceiling(heap))
    }

    /// Moves the account by `dh`: a credit always, a charge only if the total stays at
    /// or under the ceiling. Atomics only (no lock, allocation or call out), so it may
    /// run under the pool lock.
    pub(crate) fn take(&self, dh: i64) -> bool {
        self.asked.set(dh);
        if dh <= 0 {
            ACCOUNT.add(dh);
            return true;
        }
        let (taken, native) = match ACCOUNT.try_add(dh, self.ceiling) {
            Ok(native) => (true, native),
            Err(native) => (false, native),
        };
        self.taken.set(taken);
        self.native.set(native);
        taken
    }

    /// After a charge was taken, with no lock held: asks for a background reclaim or a
    /// purge as a grant does (`ask_for_room`).
    pub(crate) fn granted(&self) {
        if self.taken.get() {
            ask_for_room(self.quota, self.native.get(), self.heap);
        }
    }

    /// One try of `take` against this room, and a grant's requests if it took.
    fn try_with(&self, take: &mut impl FnMut(&Room) -> Take) -> Take {
        let taken = take(self);
        if taken == Take::Taken {
            self.granted();
        }
        taken
    }

    /// [`granted`](Room::granted) for a grant within the over-commit bound: counted as
    /// an over-commit when it left the process past the limit.
    pub(crate) fn overcommitted(&self) {
        if self.taken.get() && self.quota.pressure(self.native.get(), self.heap) == Pressure::Hard {
            threads::note_overcommit();
        }
        self.granted();
    }
}

/// What one try to charge a request did ([`try_admit_with`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    Taken,
    /// The account had no room: nothing changed.
    Short,
    /// The request is no longer the account's to admit (its scope's share refuses it,
    /// or its scope ended): nothing changed, no reclaim.
    Off,
}

impl Take {
    /// A plain charge's try: taken, or short of room.
    pub(crate) fn of(taken: bool) -> Take {
        if taken {
            Take::Taken
        } else {
            Take::Short
        }
    }
}

/// After a grant: past the soft threshold (or the limit), asks for a background
/// reclaim of the excess over the soft threshold; and for a purge when jemalloc's
/// unused resident pages would take the process past it (`purge.rs`). The one place
/// a grant decides either.
fn ask_for_room(quota: Quota, native: i64, heap: i64) {
    purge::after_grant(quota, native, heap);
    if quota.pressure(native, heap) != Pressure::Low {
        reclaim::request_background(Quota::excess(native, heap, quota.soft));
    }
}

/// Whether native plus counted heap is past the hard limit while allocations are
/// policed (under `Enforcement::Gates` nothing waits on the fast path's behalf).
pub(crate) fn past_ceiling() -> bool {
    let quota = quota();
    quota.limit != i64::MAX
        && policing_allocations()
        && ACCOUNT.native().saturating_add(heap_probe::outside()) > quota.limit
}

/// An allocation's admission: policed, or under `Enforcement::Gates` only counted.
pub(crate) fn admit(l: &Local, face: &Face, bytes: i64) -> bool {
    if !policing_allocations() {
        count_only(bytes);
        return true;
    }
    admit_as(l, face, bytes, OnOom::Abort)
}

/// `Enforcement::Gates`: the allocation is taken; under pressure a background
/// reclaim is asked for, and a grant past the limit is counted as an over-commit.
pub(crate) fn count_only(bytes: i64) {
    if taken(bytes) == Pressure::Hard {
        threads::note_overcommit();
    }
}

/// Counts `bytes` already taken, with no decision, and asks for room as a grant
/// would; returns the pressure they left.
pub(crate) fn taken(bytes: i64) -> Pressure {
    let quota = quota();
    let heap = heap_probe::outside();
    let native = ACCOUNT.add(bytes);
    ask_for_room(quota, native, heap);
    quota.pressure(native, heap)
}

/// The policy, whatever the enforcement (a scope's explicit reservation and a JVM
/// gate are gates of their own). `worst` caps the OOM policy: `OnOom::Null` for a
/// request that reports failure itself (a scope's explicit reservation) and must
/// never abort.
pub(crate) fn admit_as(l: &Local, face: &Face, bytes: i64, worst: OnOom) -> bool {
    match try_admit(l, face, bytes) {
        Ok(()) => true,
        Err(throttle) => refuse(bytes, throttle, worst),
    }
}

/// [`admit_as`] up to the refusal: grants, over-commits or reclaims; `Err` (with what
/// throttled the reclaims, if anything did) when `bytes` still do not fit, nothing
/// counted or reported.
pub(crate) fn try_admit(l: &Local, face: &Face, bytes: i64) -> Result<(), Option<Throttle>> {
    try_admit_with(l, face, |room| Take::of(room.take(bytes)))
}

/// [`try_admit`] of a request that `take` charges against the [`Room`] it is given:
/// a scope's, whose change of `held` is computed, charged and applied in one step
/// under the pool lock (`Pool::try_grant`), a new room for each try, so reclaims run
/// between tries with no lock held. The small-request rule and a reclaim's need go
/// by the charge the last try asked for.
pub(crate) fn try_admit_with(
    l: &Local,
    face: &Face,
    mut take: impl FnMut(&Room) -> Take,
) -> Result<(), Option<Throttle>> {
    let quota = quota();
    let mut throttle = None;
    let mut round = 0;
    let mut asked;
    loop {
        let heap = heap_probe::outside();
        let room = Room::at(quota, heap, quota.native_ceiling(heap));
        match room.try_with(&mut take) {
            Take::Taken => return Ok(()),
            Take::Short => {}
            Take::Off => return Err(throttle),
        }
        let (bytes, native) = (room.asked.get(), room.native.get());
        asked = bytes;
        // A small request is never refused while the over-commit stays bounded: the
        // threads that make them (a JVM's, C++ code) die on a failed malloc. It never
        // waits for a reclaim either; it asks for one in the background. Counted as
        // an over-commit by the slow path, which sees the account past the limit.
        if (bytes as u64) < settings::refuse_min() {
            match Room::at(quota, heap, quota.overcommit_ceiling(heap)).try_with(&mut take) {
                Take::Taken => return Ok(()),
                Take::Short => {}
                Take::Off => return Err(throttle),
            }
        }
        if round == MAX_SYNC_ROUNDS || !reclaim::has_reclaimer() {
            break;
        }
        round += 1;
        let need = Quota::excess(native.saturating_add(bytes), heap, quota.limit);
        match reclaim::sync(l, face, need) {
            // Another round only while reclaims keep making progress.
            SyncOutcome::Ran(run) if run.panicked || run.freed == 0 => break,
            SyncOutcome::Ran(_) | SyncOutcome::Waited => continue,
            SyncOutcome::TimedOut => break,
            SyncOutcome::Throttled(why) => {
                throttle = Some(why);
                break;
            }
        }
    }
    if draw(l, quota, asked, &mut take) {
        return Ok(());
    }
    Err(throttle)
}

/// The last resort of a thread refused before (its out-of-memory handler, say): a
/// small request drawn on the emergency reserve (`reserve.rs`), charged against the
/// ceiling that refused it plus the reserve's size. `asked`: the charge the last try
/// asked for.
fn draw(l: &Local, quota: Quota, asked: i64, take: &mut impl FnMut(&Room) -> Take) -> bool {
    let Some(reserve) = reserve::room_for(l, asked, quota.limit) else {
        return false;
    };
    let heap = heap_probe::outside();
    let ceiling = if (asked as u64) < settings::refuse_min() {
        quota.overcommit_ceiling(heap)
    } else {
        quota.native_ceiling(heap)
    };
    let room = Room::at(quota, heap, ceiling.saturating_add(reserve));
    let drawn = room.try_with(take) == Take::Taken;
    if drawn {
        reserve::drew(room.asked.get());
    }
    drawn
}

/// Counts and reports a refusal (a full report, or a count the next report sums up:
/// see `report`), then aborts if the policy says so and `worst` allows.
pub(crate) fn refuse(bytes: i64, throttle: Option<Throttle>, worst: OnOom) -> bool {
    // In a retry block this refusal is a plain one: what the thread's last refusal
    // was (`memquota_last_refusal`, `From<TryReserveError>`) must not stay the
    // rollback or split of an earlier request.
    if let Some(l) = threads::this_thread() {
        if let Some(i) = threads::retry_slot(l) {
            crate::ledger::tables::retry::machine().set_last(i, None);
        }
        // What the thread does next may be its out-of-memory handler: it may draw on
        // the emergency reserve.
        reserve::note_refused(l);
    }
    let abort = settings::abort_on_oom() && worst == OnOom::Abort;
    let policy = if abort { OnOom::Abort } else { OnOom::Null };
    let mark = report::Mark {
        scopes: crate::ledger::tables::begun(),
        futile: reclaim::counts().futile.load(crate::base::sync::Ordering::Relaxed),
        limit: quota().limit,
    };
    if let Some(turn) = report::turn(bytes as u64, mark, abort) {
        report::emit(
            turn,
            &Refusal {
                requested: bytes as u64,
                stats: crate::policy::snapshot::stats(),
                history: reclaim::history(),
                throttle: throttle.or_else(reclaim::throttled),
                has_reclaimer: reclaim::has_reclaimer(),
                policy,
            },
        );
    }
    if policy == OnOom::Abort {
        std::process::abort();
    }
    false
}
