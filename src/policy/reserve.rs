//! The emergency reserve: after a refusal, the refused thread may take small requests
//! past it, from a bounded reserve, so that a program's out-of-memory handler that
//! allocates (a server's allocator wrapper writing its crash report, a log line built
//! in memory of its own) finishes once instead of being refused in turn and running
//! again inside itself. The JVM keeps a reserve for the same reason.
//!
//! * **Who.** Only a thread refused in the current *epoch* (its ledger state holds
//!   the epoch of its last refusal), and only requests of at most [`DRAW_MAX`].
//! * **How much.** [`size_for`] the limit: a 64th of it, at most [`RESERVE_MAX`]. A
//!   crash report takes KiB to tens of KiB (`ld_preload/tests/c/oom_log.c`: about
//!   12 KiB; Debian's redis-server 7.0 wrote a report of about 10 KB, INFO and client
//!   list included), so a megabyte serves several; a 64th keeps a small limit's bound close
//!   (16 MiB: 256 KiB), and at 1 MiB it is one thread's slack at the largest flush
//!   threshold.
//! * **Counted.** A draw is charged to the account (and the thread's scope) like any
//!   grant, by compare-and-swap against the ceiling that refused it (the over-commit
//!   ceiling for a request under `refuse_min`) plus the reserve's size: the reserve
//!   raises the refused thread's ceiling, it never lets a charge skip the account.
//!   So the bound on usage
//!   past the limit grows by the reserve's size, exactly, however draws race. What is
//!   left of the reserve (its size minus what was drawn since the last refill) must
//!   hold the request too: a thread that lives on past the limit cannot keep drawing
//!   as others free.
//! * **Refilled** when a slow path finds native plus heap back at or under the limit
//!   (with something drawn): the reserve is whole again and a new epoch begins, in
//!   which only threads refused from then on may draw (and the thread whose slow path
//!   refilled it, if it could: a refusal of a large request under the limit is
//!   followed by its handler on that thread).
//!
//! Exported: what is left (`memquota_emergency_reserve_bytes`) and the draws
//! (`memquota_emergency_grants_total`).

use crate::base::sync::{AtomicU32, AtomicU64, Ordering::Relaxed};
use crate::ledger::threads::{self, Local};

/// The reserve's largest size.
pub const RESERVE_MAX: u64 = 1 << 20;
/// The largest request the reserve serves: a handler's strings and buffers, not the
/// program's own work.
pub const DRAW_MAX: u64 = 64 << 10;

/// Bytes drawn since the last refill (may pass the size by racing draws; what is
/// left saturates at 0, and the account's ceiling holds either way).
static DRAWN: AtomicU64 = AtomicU64::new(0);
/// Draws so far.
static GRANTS: AtomicU64 = AtomicU64::new(0);
/// The current epoch (never 0, which marks a thread never refused).
static EPOCH: AtomicU32 = AtomicU32::new(1);

/// The emergency reserve's size for a limit of `limit` bytes: a 64th of it, at most
/// [`RESERVE_MAX`].
pub fn size_for(limit: u64) -> u64 {
    (limit / 64).min(RESERVE_MAX)
}

fn size(limit: i64) -> u64 {
    size_for(u64::try_from(limit).unwrap_or(0))
}

/// What is left of the reserve under a limit of `limit` bytes.
pub(crate) fn left(limit: i64) -> u64 {
    size(limit).saturating_sub(DRAWN.load(Relaxed))
}

/// Draws so far.
pub(crate) fn grants() -> u64 {
    GRANTS.load(Relaxed)
}

/// A refusal on the thread of `l`: it may draw on the reserve until the next refill.
pub(crate) fn note_refused(l: &Local) {
    threads::set_refused_in(l, EPOCH.load(Relaxed));
}

/// How far past the ceiling that refused it a draw of `bytes` may take the account:
/// the reserve's whole size (what the draws since the account was last under the
/// limit have taken is in the account already), if the thread of `l` may draw, the
/// request is small enough and what is left of the reserve holds it (None otherwise).
pub(crate) fn room_for(l: &Local, bytes: i64, limit: i64) -> Option<i64> {
    let bytes = u64::try_from(bytes).ok().filter(|&b| b > 0 && b <= DRAW_MAX)?;
    if threads::refused_in(l) != EPOCH.load(Relaxed) || bytes > left(limit) {
        return None;
    }
    Some(i64::try_from(size(limit)).unwrap_or(i64::MAX))
}

/// A draw of `bytes` was charged.
pub(crate) fn drew(bytes: i64) {
    DRAWN.fetch_add(u64::try_from(bytes).unwrap_or(0), Relaxed);
    GRANTS.fetch_add(1, Relaxed);
}

/// The slow path on the thread of `l` found native plus heap at or under the limit:
/// if anything was drawn, the reserve is whole again and a new epoch begins. The
/// calling thread keeps its right to draw if it had one (a refusal under the limit,
/// a large request, is followed by its handler on this thread).
pub(crate) fn refill(l: &Local) {
    if DRAWN.load(Relaxed) == 0 {
        return;
    }
    DRAWN.store(0, Relaxed);
    let was = EPOCH.load(Relaxed);
    let mut next = was.wrapping_add(1);
    if next == 0 {
        next = 1;
    }
    // A racing refill that already moved it on is as good.
    let _ = EPOCH.compare_exchange(was, next, Relaxed, Relaxed);
    if threads::refused_in(l) == was {
        threads::set_refused_in(l, EPOCH.load(Relaxed));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_size_is_a_64th_of_the_limit_at_most_a_mebibyte() {
        assert_eq!(size_for(16 << 20), 256 << 10);
        assert_eq!(size_for(64 << 20), 1 << 20);
        assert_eq!(size_for(8 << 30), 1 << 20);
        assert_eq!(size_for(0), 0);
        assert_eq!(size(i64::MAX), 1 << 20);
        assert_eq!(size(-1), 0);
    }

    #[test]
    fn only_a_thread_refused_in_this_epoch_draws_and_a_refill_begins_a_new_one() {
        const LIMIT: i64 = 64 << 20;
        const KIB: i64 = 1 << 10;
        let (a, b, fresh) = (Local::new(), Local::new(), Local::new());
        note_refused(&a);
        note_refused(&b);
        assert_eq!(room_for(&fresh, 100, LIMIT), None, "never refused");
        assert_eq!(room_for(&a, 100, LIMIT), Some(1 << 20), "the whole size past the ceiling");
        assert_eq!(room_for(&a, DRAW_MAX as i64 + 1, LIMIT), None, "over the cap");
        assert_eq!(room_for(&a, 0, LIMIT), None);
        drew(1000 * KIB);
        assert_eq!(left(LIMIT), 24 << 10);
        assert_eq!(room_for(&b, 32 * KIB, LIMIT), None, "more than is left");
        assert_eq!(room_for(&b, 24 * KIB, LIMIT), Some(1 << 20));
        // Back under the limit on a's thread: whole again, a new epoch; a keeps its
        // right (its handler follows its refusal), b's ended.
        refill(&a);
        assert_eq!(left(LIMIT), 1 << 20);
        assert!(room_for(&a, 100, LIMIT).is_some());
        assert_eq!(room_for(&b, 100, LIMIT), None, "refused in an epoch that ended");
        // Nothing drawn: no new epoch.
        note_refused(&b);
        refill(&a);
        assert!(room_for(&b, 100, LIMIT).is_some());
        assert_eq!(grants(), 1);
    }
}
