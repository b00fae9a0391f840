//! The slow path: the one entry every face calls when its fast path says no. It
//! settles the thread's delta, decides (an attached thread's request goes to its
//! scope's admission, any other to the process budget's), and re-arms the thread:
//! tight past the limit, loose under it.

use crate::base::config::OnOom;
use crate::base::settings::{self, ensure_configured, policing_allocations};
use crate::ledger::tables;
use crate::ledger::threads::{self, Face, Local, ACCOUNT};
use crate::policy::admission::{self, admit, count_only, past_ceiling, Take};
use crate::policy::purge;
use crate::policy::reserve;

/// The slow path of a charge of `bytes` (either sign) on a thread of `face`. Returns
/// whether the caller may go ahead; only positive charges can be refused.
#[cold]
#[inline(never)]
pub fn charge_slow(face: &'static Face, bytes: i64) -> bool {
    visit(face, bytes, false)
}

/// Charges `bytes` that a thread of `face` has already taken (its face counted them
/// in bulk, after the fact): never refused, never waiting. Like any grant it asks for
/// a reclaim past the soft threshold, and past the ceiling the thread goes tight.
#[cold]
#[inline(never)]
pub fn charge_taken(face: &'static Face, bytes: i64) {
    visit(face, bytes, true);
}

/// A slow path: settles the thread's delta, then charges `bytes` with the policy's
/// decision, or (`taken`) counts them as they are.
fn visit(face: &'static Face, bytes: i64, taken: bool) -> bool {
    let Some(l) = (face.local)() else {
        ACCOUNT.add(bytes); // a thread with no state left: counted, never policed
        return true;
    };
    let Some(_busy) = threads::enter(l) else {
        threads::charge_nested(l, bytes);
        return true;
    };
    threads::adopt(face);
    if face.configure_from_env {
        ensure_configured();
    }
    purge::settle_after_fork();
    let flushed = threads::settle(l, face);
    ACCOUNT.add(flushed);
    let granted = if taken && bytes > 0 {
        admission::taken(threads::attribute(l, bytes));
        true
    } else {
        decide(l, face, bytes)
    };
    // Past the ceiling the thread goes tight (no fast path) until a slow path finds
    // the account back under it: the ledger's bound on usage past the limit.
    let over = past_ceiling();
    if over && (flushed > 0 || (granted && bytes > 0)) {
        threads::note_overcommit();
    } else if !over {
        // Back at or under the limit: the emergency reserve is whole again.
        reserve::refill(l);
    }
    ACCOUNT.add(threads::rearm(l, over));
    granted
}

/// The decision on a charge of `bytes`, the thread's delta already settled.
fn decide(l: &Local, face: &Face, bytes: i64) -> bool {
    if bytes <= 0 {
        ACCOUNT.add(threads::attribute(l, bytes));
        return true;
    }
    // What a gate charged already for this allocation ([`make_room`]): in a retry
    // block the scope and the account have it; otherwise the account has it, the
    // scope does not yet.
    let scoped = threads::use_prepaid_scoped(l, bytes as u64) as i64;
    let prepaid = threads::use_prepaid(l, (bytes - scoped) as u64) as i64;
    if prepaid > 0 {
        ACCOUNT.add(threads::attribute(l, prepaid) - prepaid);
    }
    let bytes = bytes - scoped - prepaid;
    if bytes == 0 {
        return true;
    }
    match threads::scope_of(l) {
        0 => admit(l, face, bytes),
        // Under Enforcement::Gates an allocation is never refused, not even by its
        // scope's share: it is charged to the scope and counted.
        scope if !policing_allocations() => {
            count_only(tables::attribute(scope, bytes));
            true
        }
        // A small request never waits for its scope's share and is never refused by
        // it: admitted by the process budget like any small request (over-commit
        // within its bound), its change of the scope's charge taken by the account in
        // the same step as the scope's figures.
        scope if (bytes as u64) < settings::refuse_min() => {
            let admitted = admission::try_admit_with(l, face, |room| {
                Take::of(tables::attribute_charged(scope, bytes, |dh| room.take(dh)))
            });
            match admitted {
                Ok(()) => true,
                Err(throttle) => admission::refuse(bytes, throttle, OnOom::Abort),
            }
        }
        scope => crate::arbitration::admit_attached(l, face, scope, bytes),
    }
}

/// A gate: waits for reclaims until `bytes` more fit the budget, and charges them
/// there, under the limit, so gates on many threads cannot all pass on the same room.
/// The allocation that follows on this thread uses the charge up ([`end_gate`] gives
/// back what it did not use). Returns false, with an OOM report written, if they will
/// not fit. On a thread in a retry block the scope admits the request instead, and
/// charges it there too: it may block, and it fails with no report when the retry
/// machine rolls the thread back or tells it to split. Call it only where waiting is safe: never with a lock held that a reclaim
/// needs (in a JVM, from a thread in native state, never in VM state).
///
/// Requests under `refuse_min` always pass, with no wait and no charge, whatever the
/// over-commit: they are counted when taken, like every allocation under
/// `Enforcement::Gates`. A JVM's own code treats a failed small
/// `Unsafe.allocateMemory` as fatal (seen: a 2 KiB NIO path buffer refused in a Spark
/// task took the whole JVM down through its uncaught-exception handler).
pub fn make_room(face: &'static Face, bytes: u64) -> bool {
    if bytes < settings::refuse_min() {
        return true;
    }
    let Some(l) = (face.local)() else { return true };
    let Some(_busy) = threads::enter(l) else { return true };
    if face.configure_from_env {
        ensure_configured();
    }
    ACCOUNT.add(threads::settle(l, face));
    // In a retry block the request takes part in the retry machine: it blocks
    // instead of failing, and fails when the machine rolls the thread back or asks
    // it to split (`last_refusal_raw` says which).
    if let Some(granted) = crate::arbitration::gate_in_block(l, face, bytes) {
        return granted;
    }
    let granted = admission::admit_as(l, face, i64::try_from(bytes).unwrap_or(i64::MAX), OnOom::Abort);
    if granted {
        threads::prepay(l, bytes);
    }
    granted
}

/// After the allocation a granted [`make_room`] let through: credits the part of the
/// gate's charge that the allocation did not use (all of it, if the allocation
/// failed or was served on the fast path), to the scope as well in a retry block.
pub fn end_gate(face: &'static Face) {
    if let Some(l) = (face.local)() {
        let left = threads::take_prepaid(l);
        if left > 0 {
            ACCOUNT.add(-i64::try_from(left).unwrap_or(i64::MAX));
        }
        ACCOUNT.add(threads::give_back_prepaid_scoped(l));
    }
}

/// Records bytes that are already taken (or given back) on a thread of `face`, with
/// no policy: for corrections after the fact, such as a `realloc` that landed in a
/// different size class than estimated.
pub fn record(face: &'static Face, bytes: i64) {
    match (face.local)() {
        Some(l) => threads::charge_nested(l, bytes),
        None => {
            ACCOUNT.add(bytes);
        }
    }
}

/// Flushes the calling thread's delta to the process account.
pub fn flush_thread(face: &'static Face) {
    if let Some(l) = (face.local)() {
        ACCOUNT.add(threads::settle(l, face));
    }
}
