//! Admission against the process budget: grant under the limit by compare-and-swap,
//! over-commit small requests within a bound, run or await synchronous reclaims while
//! they help, and otherwise refuse with a report. Also the counting-only admission of
//! `Enforcement::Gates` and the check that makes a thread tight past the limit. "Heap"
//! below is everything outside the native account the budget counts: the heap
//! figure, and untracked memory under `Untracked::Count` (`untracked::outside`).

use crate::config::OnOom;
use crate::gc::{SyncOutcome, Throttle};
use crate::heap_probe;
use crate::ledger::{self, Face, Local, ACCOUNT};
use crate::purge;
use crate::quota::{Pressure, Quota};
use crate::reclaim;
use crate::report::{self, Refusal};
use crate::settings::{self, policing_allocations, quota};

/// Sync reclaims one request may go through before it is refused.
const MAX_SYNC_ROUNDS: u32 = 2;

/// Adds `bytes` to the process account if that stays under the limit, with no
/// reclaim and no report: a scope's first try before it spills.
pub(crate) fn fits(bytes: i64) -> bool {
    let quota = quota();
    let heap = heap_probe::outside();
    let taken = ACCOUNT.try_add(bytes, quota.native_ceiling(heap));
    if let Ok(native) = taken {
        ask_for_room(quota, native, heap);
    }
    taken.is_ok()
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
    let quota = quota();
    let heap = heap_probe::outside();
    let native = ACCOUNT.add(bytes);
    if quota.pressure(native, heap) == Pressure::Hard {
        ledger::note_overcommit();
    }
    ask_for_room(quota, native, heap);
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
    let quota = quota();
    let mut throttle = None;
    let mut round = 0;
    loop {
        let heap = heap_probe::outside();
        let native = match ACCOUNT.try_add(bytes, quota.native_ceiling(heap)) {
            Ok(native) => {
                ask_for_room(quota, native, heap);
                return Ok(());
            }
            Err(native) => native,
        };
        // A small request is never refused while the over-commit stays bounded: the
        // threads that make them (a JVM's, C++ code) die on a failed malloc. It never
        // waits for a reclaim either; it asks for one in the background. Counted as
        // an over-commit by the slow path, which sees the account past the limit.
        if (bytes as u64) < settings::refuse_min() {
            if let Ok(native) = ACCOUNT.try_add(bytes, quota.overcommit_ceiling(heap)) {
                ask_for_room(quota, native, heap);
                return Ok(());
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
    Err(throttle)
}

/// Counts and reports a refusal (a full report, or a count the next report sums up:
/// see `report`), then aborts if the policy says so and `worst` allows.
pub(crate) fn refuse(bytes: i64, throttle: Option<Throttle>, worst: OnOom) -> bool {
    // In a retry block this refusal is a plain one: what the thread's last refusal
    // was (`memquota_last_refusal`, `From<TryReserveError>`) must not stay the
    // rollback or split of an earlier request.
    if let Some(i) = ledger::this_thread().and_then(ledger::retry_slot) {
        crate::tables::retry::machine().set_last(i, None);
    }
    let abort = settings::abort_on_oom() && worst == OnOom::Abort;
    let policy = if abort { OnOom::Abort } else { OnOom::Null };
    let mark = report::Mark {
        scopes: crate::tables::begun(),
        futile: reclaim::counts().futile.load(std::sync::atomic::Ordering::Relaxed),
        limit: quota().limit,
    };
    if let Some(turn) = report::turn(bytes as u64, mark, abort) {
        report::emit(
            turn,
            &Refusal {
                requested: bytes as u64,
                stats: crate::snapshot::stats(),
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
