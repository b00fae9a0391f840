//! The reclaim ("GC") coordinator: decides whether a reclaim runs, never what it does.
//!
//! * Single-flight: at most one reclaim, sync or background, is in flight. A thread
//!   that needs room while one runs waits for its result (bounded), then re-checks.
//! * Rate-limited: no reclaim starts within `min_interval` of the end of the last one.
//!   A synchronous request inside the interval waits it out (within its bounded
//!   wait) and then runs: the rate limit slows reclaims, it never refuses for them.
//! * Suspended while futile: after [`FUTILE_RUNS`] reclaims of one kind in a row that
//!   each freed less than they were asked for, reclaims of that kind pause for a
//!   back-off that doubles up to [`MAX_SUSPEND`] (Gluten's GC storms, #10937), and
//!   both kinds resume on the first good one. Futile background reclaims (a callback
//!   that found its cache busy) never suspend synchronous ones; futile synchronous
//!   ones also hold background requests back.
//! * Background requests are de-duplicated: one pending at a time.
//!
//! The reclaim itself is a closure handed in by the caller, and this type holds no
//! lock while it runs, so a callback may allocate, or take its own locks, freely.

use crate::base::sync::Ordering::Relaxed;
use crate::base::sync::{lock, wait, wait_timeout, AtomicU64, Condvar, ForkHeld, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How many past reclaims are kept for the OOM report.
pub(crate) const HISTORY: usize = 8;
/// Reclaims in a row that free too little before reclaims are suspended.
pub(crate) const FUTILE_RUNS: u32 = 3;
/// The first suspension; it doubles with each further futile reclaim.
pub(crate) const FIRST_SUSPEND: Duration = Duration::from_millis(250);
/// The longest suspension.
pub(crate) const MAX_SUSPEND: Duration = Duration::from_secs(30);

/// Which path asked for a reclaim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReclaimKind {
    /// An allocation over the hard limit waited for it.
    Sync,
    /// Requested past the soft threshold; the allocation did not wait.
    Background,
}

/// One finished reclaim.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReclaimRecord {
    /// Which path asked for it.
    pub(crate) kind: ReclaimKind,
    /// Bytes it was asked to free.
    pub(crate) need: u64,
    /// Bytes it was measured to free (native plus counted heap, before minus after).
    pub(crate) freed: u64,
    /// How long the callback ran.
    pub(crate) took: Duration,
    /// Whether the callback panicked (the panic was caught).
    pub(crate) panicked: bool,
    /// When it ended.
    pub(crate) ended: Instant,
}

/// What the caller's reclaim closure reports back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) freed: u64,
    pub(crate) panicked: bool,
}

/// Why no reclaim ran for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Throttle {
    /// The last reclaim ended less than `min_interval` ago.
    RateLimited,
    /// Recent reclaims freed too little; reclaims are paused.
    Suspended,
}

/// The result of a synchronous request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SyncOutcome {
    /// This thread ran the reclaim.
    Ran(Run),
    /// Another thread's reclaim finished while this one waited.
    Waited,
    /// Another thread's reclaim did not finish within the wait bound.
    TimedOut,
    /// No reclaim was started.
    Throttled(Throttle),
}

/// Timing knobs, read from the configuration on each request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    pub(crate) wait: Duration,
    pub(crate) min_interval: Duration,
    /// The least time from the end of any reclaim to the start of a background one:
    /// a runtime whose reclaim is costly (a JVM's full GC) asks for more than
    /// `min_interval` here, and synchronous requests are not held up by it.
    pub(crate) background_interval: Duration,
}

/// One kind's record of futile reclaims.
#[derive(Clone, Copy)]
struct Futility {
    streak: u32,
    suspended_until: Option<Instant>,
}

impl Futility {
    const NONE: Futility = Futility { streak: 0, suspended_until: None };

    fn suspended(&self, now: Instant) -> bool {
        self.suspended_until.is_some_and(|until| now < until)
    }

    fn record_futile(&mut self, ended: Instant) {
        self.streak = self.streak.saturating_add(1);
        if self.streak >= FUTILE_RUNS {
            self.suspended_until = Some(ended + suspension(self.streak));
        }
    }
}

struct State {
    in_flight: bool,
    /// Bumped when a reclaim ends: waiters compare it to know theirs finished.
    generation: u64,
    last_end: Option<Instant>,
    sync_futility: Futility,
    background_futility: Futility,
    /// Bytes asked for by the pending background request; 0 when none is pending.
    background_need: u64,
    history: [Option<ReclaimRecord>; HISTORY],
    next: usize,
}

/// Counters readable without the lock.
pub(crate) struct Counts {
    pub(crate) sync: AtomicU64,
    pub(crate) background: AtomicU64,
    pub(crate) panics: AtomicU64,
    pub(crate) freed: AtomicU64,
    pub(crate) throttled: AtomicU64,
    /// Reclaims that freed nothing.
    pub(crate) futile: AtomicU64,
}

/// The coordinator. One static instance serves the process.
pub(crate) struct Coordinator {
    state: Mutex<State>,
    /// Signalled when a reclaim ends.
    ended: Condvar,
    /// Signalled when a background request is queued.
    queued: Condvar,
    pub(crate) counts: Counts,
    /// The state's guard across a `fork`.
    fork: ForkHeld<MutexGuard<'static, State>>,
}

macro_rules! coordinator_new {
    () => {
        Coordinator {
            state: Mutex::new(State {
                in_flight: false,
                generation: 0,
                last_end: None,
                sync_futility: Futility::NONE,
                background_futility: Futility::NONE,
                background_need: 0,
                history: [None; HISTORY],
                next: 0,
            }),
            ended: Condvar::new(),
            queued: Condvar::new(),
            fork: ForkHeld::new(),
            counts: Counts {
                sync: AtomicU64::new(0),
                background: AtomicU64::new(0),
                panics: AtomicU64::new(0),
                freed: AtomicU64::new(0),
                throttled: AtomicU64::new(0),
                futile: AtomicU64::new(0),
            },
        }
    };
}

impl Coordinator {
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Coordinator {
        coordinator_new!()
    }

    #[cfg(loom)]
    pub(crate) fn new() -> Coordinator {
        coordinator_new!()
    }

    /// Asks for a synchronous reclaim of `need` bytes; `run` performs it on this
    /// thread if this thread is the one to run it.
    pub(crate) fn reclaim_sync(
        &self,
        need: u64,
        timing: Timing,
        run: impl FnOnce(u64) -> Run,
    ) -> SyncOutcome {
        let deadline = Instant::now() + timing.wait;
        let mut st = lock(&self.state);
        loop {
            if st.in_flight {
                let generation = st.generation;
                while st.in_flight && st.generation == generation {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return SyncOutcome::TimedOut;
                    }
                    st = wait_timeout(&self.ended, st, left);
                }
                return SyncOutcome::Waited;
            }
            let now = Instant::now();
            if st.sync_futility.suspended(now) {
                self.counts.throttled.fetch_add(1, Relaxed);
                return SyncOutcome::Throttled(Throttle::Suspended);
            }
            // Inside the rate limit: wait it out, then look again (another thread may
            // have started a reclaim meanwhile).
            let Some(until) = st.last_end.map(|end| end + timing.min_interval).filter(|u| now < *u) else {
                break;
            };
            if until > deadline {
                self.counts.throttled.fetch_add(1, Relaxed);
                return SyncOutcome::Throttled(Throttle::RateLimited);
            }
            st = wait_timeout(&self.ended, st, until - now);
        }
        st.in_flight = true;
        drop(st);
        let started = Instant::now();
        let result = run(need);
        self.finish(ReclaimKind::Sync, need, started, result);
        SyncOutcome::Ran(result)
    }

    /// Queues a background reclaim of `need` bytes unless one is pending or running,
    /// or reclaims are throttled. Returns whether a request was queued (and so a
    /// worker must be woken).
    pub(crate) fn request_background(&self, need: u64, timing: Timing) -> bool {
        let mut st = lock(&self.state);
        if st.in_flight || st.background_need != 0 {
            return false;
        }
        let now = Instant::now();
        let recent =
            st.last_end.is_some_and(|end| now.saturating_duration_since(end) < timing.background_interval);
        if recent || st.background_futility.suspended(now) || throttle(&st, timing, now).is_some() {
            return false;
        }
        st.background_need = need.max(1);
        drop(st);
        self.queued.notify_one();
        true
    }

    /// Blocks the background worker until a request is queued, runs it through `run`
    /// unless a synchronous reclaim took its place, and returns what ran.
    pub(crate) fn serve_background(&self, run: impl FnOnce(u64) -> Run) -> Option<Run> {
        let mut st = lock(&self.state);
        while st.background_need == 0 {
            st = wait(&self.queued, st);
        }
        let need = std::mem::take(&mut st.background_need);
        if st.in_flight {
            return None; // a sync reclaim is already doing the job
        }
        st.in_flight = true;
        drop(st);
        let started = Instant::now();
        let result = run(need);
        self.finish(ReclaimKind::Background, need, started, result);
        Some(result)
    }

    fn finish(&self, kind: ReclaimKind, need: u64, started: Instant, run: Run) {
        let ended = Instant::now();
        let counter = match kind {
            ReclaimKind::Sync => &self.counts.sync,
            ReclaimKind::Background => &self.counts.background,
        };
        counter.fetch_add(1, Relaxed);
        self.counts.freed.fetch_add(run.freed, Relaxed);
        if run.panicked {
            self.counts.panics.fetch_add(1, Relaxed);
        }
        let mut st = lock(&self.state);
        st.in_flight = false;
        st.generation = st.generation.wrapping_add(1);
        st.last_end = Some(ended);
        if run.freed == 0 {
            self.counts.futile.fetch_add(1, Relaxed);
        }
        if run.freed >= need && !run.panicked {
            st.sync_futility = Futility::NONE;
            st.background_futility = Futility::NONE;
        } else {
            match kind {
                ReclaimKind::Sync => st.sync_futility.record_futile(ended),
                ReclaimKind::Background => st.background_futility.record_futile(ended),
            }
        }
        let slot = st.next;
        st.history[slot] = Some(ReclaimRecord {
            kind,
            need,
            freed: run.freed,
            took: ended.saturating_duration_since(started),
            panicked: run.panicked,
            ended,
        });
        st.next = (slot + 1) % HISTORY;
        drop(st);
        self.ended.notify_all();
    }

    /// A `fork` prepare handler's step: takes the lock, so no other thread is inside
    /// it when the process is copied.
    ///
    /// # Safety
    /// Only from a prepare handler, followed by [`after_fork`](Self::after_fork) on the
    /// same thread.
    #[cfg(not(loom))]
    pub(crate) unsafe fn before_fork(&'static self) {
        let guard = lock(&self.state);
        // SAFETY: a guard of this slot's lock, just taken.
        unsafe { self.fork.keep(guard) };
    }

    /// Releases the lock taken by [`before_fork`](Self::before_fork). In the child,
    /// first forgets what the parent's vanished threads were doing: a reclaim in
    /// flight, a queued background request (the worker does not exist there).
    ///
    /// # Safety
    /// Only from the parent or child handler of the fork whose prepare handler called
    /// `before_fork`.
    #[cfg(not(loom))]
    pub(crate) unsafe fn after_fork(&'static self, child: bool) {
        // SAFETY: the forking thread, between before_fork and now (the contract).
        unsafe {
            self.fork.release_after(|st| {
                if child {
                    st.in_flight = false;
                    st.background_need = 0;
                }
            })
        };
    }

    /// Forgets the futility record: a new callback deserves a fresh start.
    pub(crate) fn reset_futility(&self) {
        let mut st = lock(&self.state);
        st.sync_futility = Futility::NONE;
        st.background_futility = Futility::NONE;
    }

    /// The last reclaims, newest first.
    pub(crate) fn history(&self) -> [Option<ReclaimRecord>; HISTORY] {
        let st = lock(&self.state);
        let mut out = [None; HISTORY];
        for (i, slot) in out.iter_mut().enumerate() {
            *slot = st.history[(st.next + HISTORY - 1 - i) % HISTORY];
        }
        out
    }

    /// Whether reclaims are currently suspended or rate-limited, and why.
    pub(crate) fn throttled(&self, timing: Timing) -> Option<Throttle> {
        throttle(&lock(&self.state), timing, Instant::now())
    }
}

/// What holds a reclaim back now: a suspension after futile synchronous reclaims (which
/// holds both kinds back), or the rate limit.
fn throttle(st: &State, timing: Timing, now: Instant) -> Option<Throttle> {
    if st.sync_futility.suspended(now) {
        return Some(Throttle::Suspended);
    }
    if st.last_end.is_some_and(|end| now.saturating_duration_since(end) < timing.min_interval) {
        return Some(Throttle::RateLimited);
    }
    None
}

/// Back-off after `streak` futile reclaims in a row (`streak >= FUTILE_RUNS`).
pub(crate) fn suspension(streak: u32) -> Duration {
    let doublings = streak.saturating_sub(FUTILE_RUNS).min(16);
    FIRST_SUSPEND.saturating_mul(1 << doublings).min(MAX_SUSPEND)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const NOW: Timing = Timing {
        wait: Duration::from_secs(5),
        min_interval: Duration::ZERO,
        background_interval: Duration::ZERO,
    };

    fn futile(_: u64) -> Run {
        Run { freed: 0, panicked: false }
    }

    #[test]
    fn futile_reclaims_suspend_then_a_good_one_resumes() {
        let c = Coordinator::new();
        for _ in 0..FUTILE_RUNS {
            assert!(matches!(c.reclaim_sync(10, NOW, futile), SyncOutcome::Ran(_)));
        }
        assert_eq!(c.reclaim_sync(10, NOW, futile), SyncOutcome::Throttled(Throttle::Suspended));
        assert!(!c.request_background(10, NOW), "suspension covers background requests too");
        assert_eq!(c.counts.sync.load(Relaxed), u64::from(FUTILE_RUNS));
        assert_eq!(c.counts.throttled.load(Relaxed), 1);
        // Pretend the suspension ran out: a reclaim that frees enough resets the streak.
        lock(&c.state).sync_futility.suspended_until = None;
        let good = |need| Run { freed: need, panicked: false };
        assert!(matches!(c.reclaim_sync(10, NOW, good), SyncOutcome::Ran(_)));
        assert!(matches!(c.reclaim_sync(10, NOW, futile), SyncOutcome::Ran(_)));
        let h = c.history();
        assert_eq!(h[0].map(|r| r.freed), Some(0), "newest first");
        assert_eq!(h[1].map(|r| r.freed), Some(10));
    }

    #[test]
    fn rate_limit_delays_a_second_reclaim_within_the_wait() {
        let c = Coordinator::new();
        let timing = |wait, interval| Timing {
            wait: Duration::from_millis(wait),
            min_interval: Duration::from_millis(interval),
            background_interval: Duration::ZERO,
        };
        let good = |n| Run { freed: n, panicked: false };
        assert!(matches!(c.reclaim_sync(1, timing(1000, 3_600_000), good), SyncOutcome::Ran(_)));
        // An interval longer than the wait: turned away, never held past the wait.
        assert_eq!(
            c.reclaim_sync(1, timing(1000, 3_600_000), futile),
            SyncOutcome::Throttled(Throttle::RateLimited)
        );
        // An interval within the wait: the request waits it out and runs.
        let asked = Instant::now();
        assert!(matches!(c.reclaim_sync(1, timing(5000, 30), good), SyncOutcome::Ran(_)));
        let waited = asked.elapsed();
        let ended = c.history()[1].expect("the first reclaim is recorded").ended;
        assert!(
            c.history()[0].expect("the second one too").ended >= ended + Duration::from_millis(30),
            "ran inside the interval (waited {waited:?})"
        );
    }

    #[test]
    fn futile_background_reclaims_never_suspend_sync_ones() {
        let c = Coordinator::new();
        for _ in 0..FUTILE_RUNS {
            assert!(c.request_background(10, NOW));
            assert!(c.serve_background(futile).is_some());
        }
        assert!(!c.request_background(10, NOW), "futile background reclaims suspend background ones");
        assert!(matches!(c.reclaim_sync(10, NOW, futile), SyncOutcome::Ran(_)), "but never sync ones");
    }

    #[test]
    fn background_requests_are_deduplicated() {
        let c = Coordinator::new();
        assert!(c.request_background(5, NOW));
        assert!(!c.request_background(7, NOW));
        let ran = c.serve_background(|need| Run { freed: need, panicked: false });
        assert_eq!(ran, Some(Run { freed: 5, panicked: false }));
        assert_eq!(c.counts.background.load(Relaxed), 1);
        assert!(c.request_background(7, NOW), "a new request is accepted once served");
    }

    #[test]
    fn suspension_doubles_and_is_capped() {
        assert_eq!(suspension(FUTILE_RUNS), FIRST_SUSPEND);
        assert_eq!(suspension(FUTILE_RUNS + 1), FIRST_SUSPEND * 2);
        assert_eq!(suspension(u32::MAX), MAX_SUSPEND);
    }
}
