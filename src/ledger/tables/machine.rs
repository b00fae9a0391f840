//! The retry state machine's table, pure (no statics, no locks: the loom models in
//! `loom_tests.rs` drive it under loom's mutex), after spark-rapids-jni's `SparkResourceAdaptor`:
//! the state of every thread inside a retry block (`with_retry`), the task (scope) it
//! works for, and the rule that breaks a deadlock when every active task is blocked.
//!
//! The states and their moves:
//!
//! ```text
//! Running --request does not fit--> Allocating --still short--> Blocked
//! Blocked --a free makes room, highest priority first--> Allocating
//! Blocked --every task blocked, lowest priority--> RollbackRequested --> RollingBack
//! RollingBack --its attempt unwound (with_retry)--> Bufn
//! Bufn --room for what it failed on, nothing of higher priority blocked or in Bufn--> Running
//! Blocked --every task blocked, only one of them short--> SplitRequested
//! Bufn --every task rolled back--> Running (the highest priority first)
//! ```
//!
//! Priority: an older task outranks a younger one: the smaller id, then the earlier
//! begin. A task is blocked when every thread attached to it is `Blocked` or `Bufn`
//! (threads attached outside a retry block count as running: they may free).
//!
//! The table is fixed (no allocation) and guarded by a std mutex (a futex word): the
//! machine is only consulted once a request has failed to fit after spills and
//! reclaims, far from the fast path.

use crate::base::stats::RetryStats;

/// Threads that can be inside retry blocks at once; more run without the machine
/// (their requests refused as outside a retry block), counted in `unregistered`.
#[cfg(not(loom))]
pub const MAX_RETRY_THREADS: usize = 512;
/// Under loom, a table that fits the modelled threads' small stacks.
#[cfg(loom)]
pub const MAX_RETRY_THREADS: usize = 8;

/// A retry-block thread's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// A free slot.
    Free,
    /// Working.
    Running,
    /// Its request did not fit after spills and reclaims; trying the process again.
    Allocating,
    /// Waiting for memory to be freed.
    Blocked,
    /// Chosen to roll back; its request fails with `RetryOom` when it wakes.
    RollbackRequested,
    /// Its request failed with `RetryOom`: unwinding its attempt, freeing what it held.
    RollingBack,
    /// Rolled back, blocked until further notice: waits until a higher-priority task
    /// frees or finishes before running its attempt again.
    Bufn,
    /// Chosen to split its input; its request fails with `SplitAndRetryOom`.
    SplitRequested,
}

/// The states in the order [`Machine::counts`] lists them.
const STATES: [State; 7] = [
    State::Running,
    State::Allocating,
    State::Blocked,
    State::RollbackRequested,
    State::RollingBack,
    State::Bufn,
    State::SplitRequested,
];

impl State {
    /// Waiting on others: what makes a task blocked.
    fn waiting(self) -> bool {
        matches!(self, State::Blocked | State::Bufn)
    }
}

/// How a request in a retry block failed, for `Error::RetryOom` /
/// `Error::SplitAndRetryOom` / `Error::ScopeEnded` and `memquota_last_refusal`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rollback {
    /// Roll the attempt back and run it again.
    Retry,
    /// Split the input and run each piece.
    Split,
    /// Its scope ended while it waited: `Error::ScopeEnded`.
    Ended,
}

/// A task's rank: smaller is older, and outranks larger.
pub type Rank = (u64, u64);

/// A scope with threads attached, as the machine sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Active {
    /// The scope's handle.
    pub task: u64,
    /// Threads attached to it.
    pub attached: u32,
    /// The most it may grow now: its share's room, and the process headroom.
    pub room: u64,
}

/// Whether slot `s`'s need fits its task's room.
fn fits(s: &Slot, active: &[Active]) -> bool {
    active.iter().find(|a| a.task == s.task).is_some_and(|a| s.need <= a.room)
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    state: State,
    /// The scope (task) the thread works for.
    task: u64,
    rank: Rank,
    /// The bytes of the request it is blocked on (or, in `Bufn`, failed on).
    need: u64,
    /// What its attempt needed when it last blocked: its task's charge then plus the
    /// request. A rolled-back thread waits for that much room, not just the request,
    /// so it does not start an attempt that must roll back again.
    attempt: u64,
    /// Nested retry blocks on this thread.
    depth: u32,
    /// How its last refusal in the block went: a rollback, a split, or (`None`) a
    /// plain refusal or none since its attempt began.
    last: Option<Rollback>,
    /// Rollbacks since its outermost block began: the bound of the raw API
    /// (`retry_block_raw`), whose attempts are the caller's loop.
    rollbacks: u32,
}

impl Slot {
    const FREE: Slot = Slot {
        state: State::Free,
        task: 0,
        rank: (0, 0),
        need: 0,
        attempt: 0,
        depth: 0,
        last: None,
        rollbacks: 0,
    };
}

/// What the deadlock rule decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Roll this slot's attempt back.
    Rollback(usize),
    /// Make this slot split its input.
    Split(usize),
    /// Let this rolled-back slot run again.
    Resume(usize),
}

/// The table.
pub struct Machine {
    slots: [Slot; MAX_RETRY_THREADS],
    /// Slots in use: a bound on the scans.
    high: usize,
    /// The counters (the per-state thread counts are filled in by [`stats`]).
    pub totals: RetryStats,
}

impl Machine {
    /// An empty table.
    pub const fn new() -> Machine {
        Machine { slots: [Slot::FREE; MAX_RETRY_THREADS], high: 0, totals: RetryStats::ZERO }
    }

    fn used(&self) -> impl Iterator<Item = (usize, &Slot)> {
        self.slots[..self.high].iter().enumerate().filter(|(_, s)| s.state != State::Free)
    }

    /// Takes a slot for a thread entering its first retry block; `None`: full.
    pub fn register(&mut self, task: u64, rank: Rank) -> Option<usize> {
        self.totals.blocks_entered += 1;
        let Some(i) = self.slots.iter().position(|s| s.state == State::Free) else {
            self.totals.unregistered += 1;
            return None;
        };
        self.slots[i] = Slot { state: State::Running, task, rank, depth: 1, ..Slot::FREE };
        self.high = self.high.max(i + 1);
        Some(i)
    }

    /// A nested retry block on the thread of slot `i`.
    pub fn nest(&mut self, i: usize) {
        self.totals.blocks_entered += 1;
        self.slots[i].depth += 1;
    }

    /// Leaves a retry block; the slot is freed when the outermost one ends. Returns
    /// whether it was.
    pub fn leave(&mut self, i: usize) -> bool {
        let s = &mut self.slots[i];
        s.depth = s.depth.saturating_sub(1);
        if s.depth > 0 {
            return false;
        }
        self.free(i);
        true
    }

    /// Frees slot `i` whatever its depth: its thread exited inside a block.
    pub fn free(&mut self, i: usize) {
        self.slots[i] = Slot::FREE;
        while self.high > 0 && self.slots[self.high - 1].state == State::Free {
            self.high -= 1;
        }
    }

    /// The task slot `i` last blocked for (or entered its first block for).
    pub fn task(&self, i: usize) -> u64 {
        self.slots[i].task
    }

    /// Counts a rollback of slot `i`'s attempt; returns the rollbacks since its
    /// outermost block began.
    pub fn count_rollback(&mut self, i: usize) -> u32 {
        let s = &mut self.slots[i];
        s.rollbacks = s.rollbacks.saturating_add(1);
        s.rollbacks
    }

    /// Slot `i`'s state.
    pub fn state(&self, i: usize) -> State {
        self.slots[i].state
    }

    /// Moves slot `i` to `state`.
    pub fn set(&mut self, i: usize, state: State) {
        self.slots[i].state = state;
    }

    /// Records the request slot `i` is about to block on (`first`: its first wait),
    /// its task holding `held` bytes.
    pub fn block(&mut self, i: usize, task: u64, rank: Rank, need: u64, held: u64, first: bool) {
        let s = &mut self.slots[i];
        *s = Slot { state: State::Blocked, task, rank, need, attempt: held.saturating_add(need), ..*s };
        self.totals.waits += u64::from(first);
    }

    /// Records how slot `i`'s last refusal went (`None`: a plain refusal, as outside
    /// a retry block, or none since its attempt began).
    pub fn set_last(&mut self, i: usize, last: Option<Rollback>) {
        self.slots[i].last = last;
    }

    /// How slot `i`'s last refusal went.
    pub fn last(&self, i: usize) -> Option<Rollback> {
        self.slots[i].last
    }

    /// Whether a `Blocked` slot `i` may try again: its need fits its task's room, and
    /// no higher-priority `Blocked` slot's need fits its own (the highest-priority
    /// waiter that fits goes first).
    pub fn may_proceed(&self, i: usize, active: &[Active]) -> bool {
        let me = &self.slots[i];
        fits(me, active)
            && !self
                .used()
                .any(|(j, s)| j != i && s.state == State::Blocked && s.rank < me.rank && fits(s, active))
    }

    /// Whether a rolled-back slot `i` may run its attempt again: there is room for
    /// what the attempt needed, no thread of a task at least as old is blocked, and
    /// none of an older task waits rolled back. An older one waiting for more room
    /// than there is goes first (the deadlock rule resumes it when nothing else can
    /// go on): were the younger to run, it would block behind the older one and be
    /// rolled back again at once, its attempts spent in a loop that frees nothing.
    pub fn may_resume(&self, i: usize, active: &[Active]) -> bool {
        let me = &self.slots[i];
        let room = active.iter().find(|a| a.task == me.task).map_or(0, |a| a.room);
        me.attempt <= room
            && !self.used().any(|(j, s)| {
                j != i
                    && ((s.state == State::Blocked && s.rank <= me.rank)
                        || (s.state == State::Bufn && s.rank < me.rank))
            })
    }

    /// Counts of threads per state, in the order of [`STATES`].
    pub fn counts(&self) -> [u64; STATES.len()] {
        let mut n = [0; STATES.len()];
        for (_, s) in self.used() {
            if let Some(k) = STATES.iter().position(|&st| st == s.state) {
                n[k] += 1;
            }
        }
        n
    }

    /// The deadlock rule, given every scope with threads attached (`active`). When
    /// every active task is blocked and no waiter can go on (none fits its room): with
    /// two or more tasks short, or one while an older task waits rolled back, the
    /// lowest-priority blocked thread rolls back (what it frees may let the older one
    /// run); with one task short and none older, its highest-priority blocked thread
    /// splits (nothing else can free memory for it); with none (all rolled back), the
    /// highest-priority rolled-back thread runs again. Applies the action and returns
    /// it; `None`: something can progress.
    pub fn resolve(&mut self, active: &[Active]) -> Option<Action> {
        if active.is_empty() {
            return None;
        }
        for a in active {
            let waiting = self.used().filter(|(_, s)| s.task == a.task && s.state.waiting()).count();
            if (waiting as u64) < u64::from(a.attached) {
                return None; // a thread of this task can still free memory
            }
        }
        if self.used().any(|(i, s)| {
            (s.state == State::Blocked && self.may_proceed(i, active))
                || (s.state == State::Bufn && self.may_resume(i, active))
        }) {
            return None; // a waiter can go on: it will see so when it wakes
        }
        // Blocked threads of tasks that are active; a task's rank is its threads'.
        let blocked = || {
            self.used().filter(|(_, s)| s.state == State::Blocked && active.iter().any(|a| a.task == s.task))
        };
        let lowest = blocked().max_by_key(|(i, s)| (s.rank, *i)).map(|(i, _)| i);
        let highest = blocked().min_by_key(|(i, s)| (s.rank, *i)).map(|(i, _)| i);
        let older_rolled_back = |h: usize| {
            let rank = self.slots[h].rank;
            self.used().any(|(_, s)| s.state == State::Bufn && s.rank < rank)
        };
        let action = match (highest, lowest) {
            (Some(h), Some(l)) if self.slots[h].task != self.slots[l].task || older_rolled_back(h) => {
                Action::Rollback(l)
            }
            (Some(h), _) => Action::Split(h),
            (None, _) => {
                let bufn = self
                    .used()
                    .filter(|(_, s)| s.state == State::Bufn)
                    .min_by_key(|(i, s)| (s.rank, *i))
                    .map(|(i, _)| i)?;
                Action::Resume(bufn)
            }
        };
        match action {
            Action::Rollback(i) => self.slots[i].state = State::RollbackRequested,
            Action::Split(i) => self.slots[i].state = State::SplitRequested,
            Action::Resume(i) => self.slots[i].state = State::Running,
        }
        Some(action)
    }

    /// In a `fork` child only the forking thread survives: every other slot is freed.
    pub fn keep_only(&mut self, survivor: Option<usize>) {
        for (i, s) in self.slots.iter_mut().enumerate() {
            if Some(i) != survivor {
                *s = Slot::FREE;
            }
        }
        self.high = survivor.map_or(0, |i| i + 1);
    }
}

impl Default for Machine {
    fn default() -> Self {
        Machine::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine_with(slots: &[(u64, Rank, State, u64)]) -> Machine {
        let mut m = Machine::new();
        for &(task, rank, state, need) in slots {
            let i = m.register(task, rank).expect("room");
            m.block(i, task, rank, need, 0, true);
            m.set(i, state);
        }
        m
    }

    /// Tasks 1.. with one thread attached each and `room` bytes of room.
    fn active(tasks: &[u64], room: u64) -> Vec<Active> {
        tasks.iter().map(|&task| Active { task, attached: 1, room }).collect()
    }

    #[test]
    fn a_running_thread_means_no_deadlock() {
        let mut m = machine_with(&[(1, (1, 1), State::Blocked, 10), (2, (2, 2), State::Blocked, 10)]);
        // Task 2 has a second thread attached outside the machine: it may free.
        let mut a = active(&[1, 2], 0);
        a[1].attached = 2;
        assert_eq!(m.resolve(&a), None);
    }

    #[test]
    fn no_deadlock_while_a_waiter_fits() {
        let mut m = machine_with(&[(1, (1, 1), State::Blocked, 10), (2, (2, 2), State::Blocked, 30)]);
        assert_eq!(m.resolve(&active(&[1, 2], 10)), None, "task 1 fits and will go on");
        assert_eq!(m.resolve(&active(&[1, 2], 9)), Some(Action::Rollback(1)));
    }

    #[test]
    fn the_youngest_blocked_task_rolls_back() {
        let mut m = machine_with(&[
            (1, (1, 1), State::Blocked, 10),
            (3, (3, 3), State::Blocked, 10),
            (2, (2, 2), State::Blocked, 10),
        ]);
        let a = active(&[1, 2, 3], 0);
        assert_eq!(m.resolve(&a), Some(Action::Rollback(1)));
        assert_eq!(m.state(1), State::RollbackRequested);
        // The rolled-back thread unwinds: nothing can be decided until it waits again.
        assert_eq!(m.resolve(&a), None);
    }

    #[test]
    fn the_last_task_short_splits_and_rolled_back_ones_resume_in_order() {
        let mut m = machine_with(&[
            (2, (2, 2), State::Bufn, 10),
            (1, (1, 1), State::Blocked, 10),
            (3, (3, 3), State::Bufn, 10),
        ]);
        assert_eq!(m.resolve(&active(&[1, 2, 3], 0)), Some(Action::Split(1)));
        // A younger task short while an older one waits rolled back: it rolls back
        // (what it frees may let the older run), never splits.
        let mut m = machine_with(&[(1, (1, 1), State::Bufn, 10), (2, (2, 2), State::Blocked, 10)]);
        assert_eq!(m.resolve(&active(&[1, 2], 0)), Some(Action::Rollback(1)));
        let mut m = machine_with(&[(2, (2, 2), State::Bufn, 10), (3, (3, 3), State::Bufn, 10)]);
        assert_eq!(m.resolve(&active(&[2, 3], 0)), Some(Action::Resume(0)));
        assert_eq!(m.state(0), State::Running);
    }

    /// Task 1 waits rolled back for more room than there is; task 2, younger and
    /// rolled back too, would fit. Resumed first, it blocked behind task 1 and was
    /// rolled back again at once: tests/fuzz_arbitration/ saw a task spend its 500
    /// rollbacks in 20-200 ms and fail. It waits; when nothing else can go on, the
    /// older runs again first.
    #[test]
    fn a_rolled_back_task_resumes_behind_older_rolled_back_ones() {
        let mut m = machine_with(&[(1, (1, 1), State::Bufn, 30), (2, (2, 2), State::Bufn, 10)]);
        let a = active(&[1, 2], 20);
        assert!(!m.may_resume(1, &a), "the younger waits behind the older");
        assert!(!m.may_resume(0, &a), "the older has no room yet");
        assert_eq!(m.resolve(&a), Some(Action::Resume(0)), "the older runs again first");
        assert!(m.may_resume(1, &a), "then the younger may");
        // Threads of one task do not wait for each other.
        let m = machine_with(&[(1, (1, 1), State::Bufn, 30), (1, (1, 1), State::Bufn, 10)]);
        assert!(m.may_resume(1, &active(&[1], 20)));
    }

    #[test]
    fn the_highest_priority_waiter_that_fits_goes_first() {
        let m = machine_with(&[(2, (2, 2), State::Blocked, 10), (1, (1, 1), State::Blocked, 30)]);
        assert!(!m.may_proceed(0, &active(&[1, 2], 30)), "the older task fits and goes first");
        assert!(m.may_proceed(0, &active(&[1, 2], 20)), "the older task does not fit yet: the younger may");
        assert!(m.may_proceed(1, &active(&[1, 2], 30)));
        assert!(!m.may_proceed(1, &[]), "a task that is not active has no room");
    }

    #[test]
    fn slots_are_reused_and_nesting_counts() {
        let mut m = Machine::new();
        let a = m.register(1, (1, 1)).unwrap();
        m.nest(a);
        assert_eq!((m.count_rollback(a), m.count_rollback(a)), (1, 2));
        assert!(!m.leave(a));
        assert!(m.leave(a));
        assert_eq!(m.register(2, (2, 2)), Some(a));
        assert_eq!(m.count_rollback(a), 1, "a new block counts from zero");
        assert_eq!(m.totals.blocks_entered, 3);
        // A thread that exits inside nested blocks frees its slot at once.
        m.nest(a);
        m.free(a);
        assert_eq!(m.counts().iter().sum::<u64>(), 0);
        assert_eq!(m.register(3, (3, 3)), Some(a));
    }
}
