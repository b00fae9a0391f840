//! Making room for a query under its fair share when the process is short because
//! other queries hold more than theirs: a server runs several queries on one runtime,
//! a query that began alone grew to the whole budget, and the next one to begin finds
//! the process full although it asks for less than its share.
//!
//! The query over its share is refused at its every request already (`decide`, rule
//! 1: past its share line): its next growth spills its operator, or fails it. What was
//! missing is time for that to happen: the refused query under its share *waits*,
//! bounded, for the memory the heavy query's spill or failure frees, woken by every
//! release (a reservation shrunk, a consumer gone), instead of failing at once while
//! the query that holds the memory goes on. The heavy query is marked until its next
//! request, so its refusal says for whom it gives way, and the pool counts the asks,
//! the waits, the waits that ended in room and the queries failed as the heaviest.

use memquota::{MemoryManager, ScopeHandle};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{fence, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A query (a memquota scope) against its fair share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Query {
    /// The scope's raw handle.
    pub(crate) handle: u64,
    /// The name it was begun with (`run_query`'s).
    pub(crate) name: String,
    /// What it is charged: `max(allocated, reserved)`.
    pub(crate) held: u64,
    /// Its fair share now (or its cap, if lower).
    pub(crate) share: u64,
}

impl Query {
    /// Bytes held past the share.
    pub(crate) fn over(&self) -> u64 {
        self.held.saturating_sub(self.share)
    }
}

/// Every live query with what it holds against its share. Allocates (memquota's
/// snapshot): for refusals only, never for a grant.
pub(crate) fn queries() -> Vec<Query> {
    MemoryManager::global()
        .snapshot()
        .scopes
        .into_iter()
        .map(|s| {
            let share = ScopeHandle::from_raw(s.handle).account().map_or(0, |a| a.share);
            Query { handle: s.handle, name: s.name, held: s.held, share }
        })
        .collect()
}

/// The query furthest over its share among `queries`, other than `not`; none when no
/// other query is over its share.
pub(crate) fn heaviest(queries: &[Query], not: u64) -> Option<&Query> {
    queries.iter().filter(|q| q.handle != not && q.over() > 0).max_by_key(|q| (q.over(), q.handle))
}

/// Marks kept before those of ended queries are dropped.
const MARKS_KEPT: usize = 64;

#[derive(Default)]
struct State {
    /// Heavy queries someone waited for, until their next request: the last waiter's
    /// query, for the heavy query's error.
    marks: HashMap<u64, String>,
    /// Heavy queries a wait timed out on: nobody waits for them again until they ask
    /// for memory themselves (until then they are in a phase that does not grow, and
    /// waiting would only slow the queries under their share).
    unanswered: HashSet<u64>,
}

/// The counts of [`Room`], as the pool's stats report them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) spill_asks: u64,
    pub(crate) waits: u64,
    pub(crate) waits_with_room: u64,
    pub(crate) heaviest_failed: u64,
    pub(crate) waiting: u64,
}

/// The waits, the marks and their counts.
#[derive(Default)]
pub(crate) struct Room {
    state: Mutex<State>,
    /// Notified after every release while a request waits.
    freed: Condvar,
    waiting: AtomicU64,
    /// `state.unanswered` is not empty: a request then looks (and takes the lock).
    any_unanswered: AtomicU64,
    spill_asks: AtomicU64,
    waits: AtomicU64,
    waits_with_room: AtomicU64,
    heaviest_failed: AtomicU64,
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waited {
    /// The request was granted.
    Room,
    /// The deadline passed first, after this long.
    InVain(Duration),
}

impl Room {
    fn state(&self) -> MutexGuard<'_, State> {
        // Marks and a set of handles: a panic elsewhere under the lock leaves nothing
        // inconsistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn counts(&self) -> Counts {
        Counts {
            spill_asks: self.spill_asks.load(Relaxed),
            waits: self.waits.load(Relaxed),
            waits_with_room: self.waits_with_room.load(Relaxed),
            heaviest_failed: self.heaviest_failed.load(Relaxed),
            waiting: self.waiting.load(Relaxed),
        }
    }

    /// After memory was released (a shrink, a consumer gone): wakes the waiters, if
    /// any. Called with no lock of the pool held.
    pub(crate) fn released(&self) {
        // Pairs with the waiter's increment before its first decision: either the
        // waiter's decision sees this release, or this sees the waiter.
        fence(SeqCst);
        if self.waiting.load(SeqCst) > 0 {
            let _st = self.state();
            self.freed.notify_all();
        }
    }

    /// Whether a wait timed out on a query that has not asked for memory since.
    pub(crate) fn any_unanswered(&self) -> bool {
        self.any_unanswered.load(Relaxed) > 0
    }

    /// `scope` asks for memory: it answers any wait that timed out on it.
    pub(crate) fn asking(&self, scope: u64) {
        if self.any_unanswered() {
            let mut st = self.state();
            st.unanswered.remove(&scope);
            self.any_unanswered.store(st.unanswered.len() as u64, Relaxed);
        }
    }

    /// Whether a wait for `heavy` timed out and it has not asked for memory since.
    pub(crate) fn is_unanswered(&self, heavy: u64) -> bool {
        self.any_unanswered.load(Relaxed) > 0 && self.state().unanswered.contains(&heavy)
    }

    /// `scope` was refused: the query that waited for it to give way, if one did
    /// since its last request (the mark goes). `fails`: the refusal fails its operator,
    /// so it fails as the heaviest (counted).
    pub(crate) fn take_mark(&self, scope: u64, fails: bool) -> Option<String> {
        let waiter = self.state().marks.remove(&scope)?;
        if fails {
            self.heaviest_failed.fetch_add(1, Relaxed);
        }
        Some(waiter)
    }

    /// Waits until `attempt` grants the request or `wait` has passed, woken by every
    /// release, with `heavy` marked as given way to by `for_query` until its next
    /// request (and asked to spill, counted, when `spill`). Blocks the calling thread:
    /// the caller hands its tokio worker's other tasks on first.
    pub(crate) fn wait(
        &self,
        heavy: u64,
        for_query: &str,
        spill: bool,
        wait: Duration,
        mut attempt: impl FnMut() -> bool,
    ) -> Waited {
        let started = Instant::now();
        let deadline = started + wait;
        let mut st = self.state();
        self.waiting.fetch_add(1, SeqCst);
        self.waits.fetch_add(1, Relaxed);
        if spill {
            self.spill_asks.fetch_add(1, Relaxed);
        }
        if st.marks.len() >= MARKS_KEPT {
            st.marks.retain(|&raw, _| ScopeHandle::from_raw(raw).is_live());
        }
        // Kept after the wait: the heavy query's next request may come after the
        // waiter found room elsewhere, and it is refused all the same.
        st.marks.insert(heavy, for_query.to_owned());
        // Decided under the lock a release takes to notify: none is missed between a
        // decision and the wait.
        let granted = loop {
            if attempt() {
                break true;
            }
            let now = Instant::now();
            if now >= deadline {
                break false;
            }
            st = self.freed.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        };
        self.waiting.fetch_sub(1, SeqCst);
        if granted {
            self.waits_with_room.fetch_add(1, Relaxed);
            Waited::Room
        } else {
            st.unanswered.insert(heavy);
            self.any_unanswered.store(st.unanswered.len() as u64, Relaxed);
            Waited::InVain(started.elapsed())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn q(handle: u64, held: u64, share: u64) -> Query {
        Query { handle, name: format!("q{handle}"), held, share }
    }

    #[test]
    fn the_heaviest_is_the_furthest_over_its_share_and_never_the_asker() {
        let qs = [q(1, 90, 64), q(2, 70, 32), q(3, 10, 64)];
        assert_eq!(heaviest(&qs, 3).map(|q| q.handle), Some(2), "38 over beats 26 over");
        assert_eq!(heaviest(&qs, 2).map(|q| q.handle), Some(1));
        assert_eq!(heaviest(&[q(1, 64, 64), q(2, 10, 64)], 2), None, "at its share is not over it");
    }

    #[test]
    fn a_wait_ends_in_room_when_a_release_makes_it() {
        let room = Arc::new(Room::default());
        let free = Arc::new(AtomicU64::new(0));
        let waiter = {
            let (room, free) = (Arc::clone(&room), Arc::clone(&free));
            std::thread::spawn(move || {
                room.wait(7, "light", true, Duration::from_secs(60), || free.load(SeqCst) > 0)
            })
        };
        // Released only once the waiter is in: the precondition is forced, not hoped.
        while room.counts().waiting == 0 {
            std::thread::yield_now();
        }
        free.store(1, SeqCst);
        room.released();
        assert_eq!(waiter.join().expect("the waiter"), Waited::Room);
        assert_eq!(
            room.counts(),
            Counts { spill_asks: 1, waits: 1, waits_with_room: 1, heaviest_failed: 0, waiting: 0 }
        );
        assert!(!room.is_unanswered(7));
        // The heavy query's next refusal says for whom it gave way, once.
        assert_eq!(room.take_mark(7, true).as_deref(), Some("light"));
        assert_eq!(room.take_mark(7, true), None, "the mark goes with its next request");
        assert_eq!(room.counts().heaviest_failed, 1);
    }

    #[test]
    fn a_wait_in_vain_is_not_repeated_until_the_heavy_query_asks() {
        let room = Room::default();
        assert!(matches!(room.wait(9, "light", false, Duration::ZERO, || false), Waited::InVain(_)));
        assert!(room.is_unanswered(9));
        room.asking(9);
        assert!(!room.is_unanswered(9));
        assert_eq!(room.counts().waits_with_room, 0);
    }
}
