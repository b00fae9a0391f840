//! An arbitration fuzzer, in the spirit of Velox's memory-arbitration fuzzer: random
//! plans of tasks run at once under a limit they keep hitting. Each task is a scope
//! with one to three threads; each thread runs a list of steps drawn from what an
//! engine does with memquota: plain churn (allocations, reallocations, blocks handed
//! to another task's thread to free), retry blocks (`with_retry`, nested) and
//! split-retry blocks (`with_split_retry`), budgets bound to allocations (borrowing,
//! `try_free`, shared with a pool thread, a lone budget's over-commit), reservations
//! (exact and partial, a consumer's, in and out of retry blocks), an engine's pool
//! (a reservation grown with `grow_unchecked` after reading the account, shrunk when
//! it "spills"), spillable consumers whose callbacks allocate, try to reserve and
//! panic, a process reclaim callback that does the same, forks (attached to a scope
//! or under a budget; the child initialises, allocates, runs a retry block and a
//! budget and ends a scope, within a bound), and scopes ended under their running
//! and waiting threads (`seam::scopes::end_raw`, what the C ABI and Java's `scopeEnd` call:
//! Velox's task abort).
//!
//! Every step either completes or fails with memquota's own error, and only with
//! one that fits where it ran (`RetryOom`/`SplitAndRetryOom` inside retry blocks,
//! `ScopeEnded` only once the scope was ended). After each plan:
//!
//! * the bound: every sample of the account (about every millisecond) and its peak
//!   stay within `limit + (threads + 1) x threshold` (the ledger's error bound, as
//!   `tests/torture.rs` counts it) + `limit / 16` (the over-commit bound, when small
//!   requests or lone budgets may over-commit) + the emergency reserve refused
//!   threads draw on (a 64th of the limit, at most 1 MiB) + what callbacks hold at
//!   once + one pool growth (`grow_unchecked`, decided on the account under the
//!   pools' lock: others' grants between the look and the growth);
//! * exact at quiescence: `stats().native` equals the live bytes, counted by a
//!   wrapper around the global allocator;
//! * the retry machine is idle, no scope shows a thread attached once its threads
//!   are joined, and once they ended no scope is left, and no owner record;
//! * callbacks' allocations were never refused, a reservation inside a spill was
//!   refused with `ReserveInSpill`, every fork child exited 0 in time;
//! * nothing hung: a watchdog prints the seed, the plan and where each thread is,
//!   then ends the process; an infallible allocation refused (which aborts) prints
//!   the same first.
//!
//! The parent process runs one child process per seed (a fresh budget each, a crash
//! fails that seed alone), seeds 1, 2, ... until `MEMQUOTA_FUZZ_SECS` (default 60)
//! have passed; each seed runs `PLANS_PER_SEED` plans under one limit, and each plan
//! runs for 0.2-1.2 s. A failing seed prints itself and the command that re-runs it
//! (`MEMQUOTA_FUZZ_SEED=n`; `MEMQUOTA_FUZZ_VERBOSE=1` prints every seed's output).
//! `MEMQUOTA_FUZZ_KNOWN=name,...` (or `all`) turns on the plans and checks that reach
//! defects not fixed yet (see [`Known`]). To minimise a failing plan,
//! `MEMQUOTA_FUZZ_PLAN=k` runs only plan k of the seed, `MEMQUOTA_FUZZ_REPEAT=n` runs
//! it n times, and `MEMQUOTA_FUZZ_DROP=0,1.2,3.0.4,killer` drops tasks, threads, steps
//! and the killer from it.
//!
//! Modules: `parent` (the seeds' processes), `child` (a seed's), `plan` (generation),
//! `run` (one plan: set-up, quiescence, the checks), `worker` (the steps, the
//! killer), `callbacks` (and forks), `watch` (what the watchdog prints).

#[path = "../support/mod.rs"]
mod support;

mod callbacks;
mod child;
mod parent;
mod plan;
mod run;
mod watch;
mod worker;

pub use callbacks::*;
pub use parent::*;
pub use plan::*;
pub use run::*;
pub use watch::*;
pub use worker::*;

use memquota::{
    with_retry, with_split_retry, AttachGuard, Config, Consumer, Error, HeapBytes, HeapProbe, MemoryManager,
    QuotaAlloc, Reservation, ScopeHandle, TaskScope, Untracked,
};
use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::fmt::{self, Write as _};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Mutex, OnceLock};
use std::time::{Duration, Instant};
use support::{Line, Rng, Size, KIB, MIB};

// ---- the allocator, with the truth beside it ------------------------------------------

#[global_allocator]
static GLOBAL: Counting = Counting(QuotaAlloc::new());

/// Requested bytes of the live allocations: what `stats().native` must equal at
/// quiescence.
pub static LIVE: AtomicI64 = AtomicI64::new(0);

thread_local! {
    /// Set around the fuzzer's own fallible requests (`try_reserve`): a null there is
    /// an answer; anywhere else it is an infallible allocation refused, which aborts.
    static FALLIBLE: Cell<bool> = const { Cell::new(false) };
    /// The worker this thread is (`usize::MAX`: none).
    static WORKER: Cell<usize> = const { Cell::new(usize::MAX) };
    /// Retry-block attempts the thread is inside.
    static BLOCK_DEPTH: Cell<u32> = const { Cell::new(0) };
}

pub struct Counting(QuotaAlloc);

impl Counting {
    /// After a call that asked for `size` bytes and, if it succeeded, moved the
    /// live bytes by `delta`.
    fn counted(&self, p: *mut u8, size: usize, delta: i64) -> *mut u8 {
        if p.is_null() {
            if !FALLIBLE.with(Cell::get) {
                infallible_refused(size);
            }
        } else {
            LIVE.fetch_add(delta, Relaxed);
        }
        p
    }
}

// SAFETY: every method forwards to the inner allocator with the caller's arguments
// unchanged; the counting around the calls never touches the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { self.0.alloc(layout) };
        self.counted(p, layout.size(), layout.size() as i64)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { self.0.alloc_zeroed(layout) };
        self.counted(p, layout.size(), layout.size() as i64)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { self.0.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as i64, Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        self.counted(p, new_size, new_size as i64 - layout.size() as i64)
    }
}

/// Runs `f` with the thread's allocations marked fallible (a refusal is an answer).
pub fn fallibly<T>(f: impl FnOnce() -> T) -> T {
    let before = FALLIBLE.with(|c| c.replace(true));
    let r = f();
    FALLIBLE.with(|c| c.set(before));
    r
}

/// An infallible allocation was refused: std aborts the process next. Says where,
/// without allocating, so the seed and the plan are known.
pub fn infallible_refused(bytes: usize) {
    let w = WORKER.with(Cell::get);
    let mut l = Line::new();
    let _ = write!(l, "\nFAILED: an infallible allocation of {bytes} bytes was refused on ");
    if w < MAX_WORKERS {
        let _ = write!(
            l,
            "worker {w} (task {}, step {}, {})",
            W_TASK[w].load(SeqCst),
            W_STEP[w].load(SeqCst),
            kind_name(W_KIND[w].load(SeqCst))
        );
    } else {
        let _ = write!(l, "a thread that is no worker");
    }
    let _ = writeln!(l, ": the process aborts next");
    rerun_line(&mut l);
    l.emit();
}

// ---- configuration --------------------------------------------------------------------

pub const CHILD_VAR: &str = "MEMQUOTA_FUZZ_CHILD";
pub const SECS_VAR: &str = "MEMQUOTA_FUZZ_SECS";
pub const SEED_VAR: &str = "MEMQUOTA_FUZZ_SEED";
pub const KNOWN_VAR: &str = "MEMQUOTA_FUZZ_KNOWN";
pub const VERBOSE_VAR: &str = "MEMQUOTA_FUZZ_VERBOSE";
/// Minimising: run only this plan of the seed, this many times, with these parts
/// dropped (`t`: task t, `t.h`: its thread h, `t.h.s`: that thread's step s,
/// `killer`; comma-separated, indices of the generated plan).
pub const PLAN_VAR: &str = "MEMQUOTA_FUZZ_PLAN";
pub const REPEAT_VAR: &str = "MEMQUOTA_FUZZ_REPEAT";
pub const DROP_VAR: &str = "MEMQUOTA_FUZZ_DROP";
/// How long a run goes on starting new seeds, by default.
pub const DEFAULT_SECS: u64 = 60;
/// Plans run one after the other in a seed's process, under the seed's limit.
pub const PLANS_PER_SEED: usize = 4;
/// After this long a thread starts no new step, even in its first pass.
pub const PLAN_TIME_MAX: Duration = Duration::from_secs(3);
/// Forks a worker makes at most in a plan.
pub const MAX_FORKS: u64 = 2;
/// The watchdog's budget per plan: its time plus bounded waits (the retry watchdog's
/// 10 s, the share wait's 2 s, a fork child's 20 s), with a margin.
pub const PLAN_BUDGET: Duration = Duration::from_secs(40);
/// How long a parent waits for a fork child.
pub const CHILD_TIMEOUT: Duration = Duration::from_secs(20);
/// How soon a thread blocked in a retry block of a scope that ends must return.
pub const WAKE_BOUND: Duration = Duration::from_millis(500);

pub const MAX_WORKERS: usize = 16;
pub const LIVE_CAP: usize = 16;
pub const MAILBOX_CAP: usize = 32;
pub const CACHE_CAP: usize = 8;
/// Threads alive besides the workers: main, the monitor, the watchdog, the sampler,
/// the reclaim worker, the killer.
pub const SERVICE_THREADS: u64 = 6;
/// The most a callback holds at once: its scratch buffer, plus what a panic
/// allocates while it unwinds.
pub const CALLBACK_HOLDS: u64 = 64 * KIB + 4 * KIB;
/// memquota's own bookkeeping, counted but never policed (a scope's end lists its
/// consumers).
pub const MISC: u64 = 64 * KIB;
/// The emergency reserve refused threads draw on past the ceiling: a 64th of the
/// limit, at most 1 MiB.
pub fn emergency_reserve(limit: u64) -> u64 {
    (limit / 64).min(MIB)
}
/// Blocks of this size and up carry owner records; a shrinking realloc of one moves
/// it unchecked, so churn shrinks only smaller ones.
pub const OWNED_MIN: usize = 2 << 20;

/// Defects the fuzzer reaches with plans or checks of their own: four issue 30 names
/// (its items 4 and 5) and one found here, fixed and so on by default ([`FIXED`]), and
/// one found here and not fixed yet, off unless named in `MEMQUOTA_FUZZ_KNOWN` (or
/// `all`); list it in [`FIXED`] once its fix merges.
#[derive(Clone, Copy, Debug, Default)]
pub struct Known {
    /// 4: a heap probe that takes a user lock, while a thread holding that lock
    /// enters and leaves a retry block (the machine's mutex is taken around the
    /// probe): a hang.
    probe_lock: bool,
    /// 4: a report hook that panics: it unwinds out of the allocator (an abort).
    hook_panic: bool,
    /// 5: a scope ended while one of its threads is blocked in a retry block: the
    /// thread must return at once (within [`WAKE_BOUND`]), not at the retry watchdog.
    end_wake: bool,
    /// 5: forks from inside spill callbacks (a live waiter) and while another thread
    /// re-configures (`init`): the child's `init` must not spin.
    fork_race: bool,
    /// New (found here): a budget whose small block is freed outside it (by another
    /// thread, or after its thread detached) drains until its scope ends; 256 of
    /// them fill the process's budget table, and every budget after them, of any
    /// scope, fails with `TooManyScopes`. Off: that error from a budget is counted
    /// as seen, not failed.
    budget_slots: bool,
    /// Found here, fixed: a retry block whose rollbacks could not free what an older
    /// task waited for gave up after `MAX_RETRIES` rollbacks in well under a second
    /// (a younger task resumed ahead of an older one rolled back; an older task
    /// short of its own cap). Off: counted as seen.
    retry_loops: bool,
}

/// The known defects whose fixes have merged: on by default.
pub const FIXED: &[&str] = &["probe_lock", "hook_panic", "end_wake", "fork_race", "retry_loops"];
pub const KNOWN_NAMES: [&str; 6] =
    ["probe_lock", "hook_panic", "end_wake", "fork_race", "budget_slots", "retry_loops"];

impl Known {
    fn from_env() -> Known {
        let list = std::env::var(KNOWN_VAR).unwrap_or_default();
        let on = |name: &str| {
            FIXED.contains(&name) || list.split(',').map(str::trim).any(|w| w == name || w == "all")
        };
        Known {
            probe_lock: on("probe_lock"),
            hook_panic: on("hook_panic"),
            end_wake: on("end_wake"),
            fork_race: on("fork_race"),
            budget_slots: on("budget_slots"),
            retry_loops: on("retry_loops"),
        }
    }

    fn names(self) -> impl Iterator<Item = &'static str> {
        let on = [
            self.probe_lock,
            self.hook_panic,
            self.end_wake,
            self.fork_race,
            self.budget_slots,
            self.retry_loops,
        ];
        KNOWN_NAMES.into_iter().zip(on).filter(|&(_, on)| on).map(|(n, _)| n)
    }
}

fn main() {
    match std::env::var(CHILD_VAR).ok().and_then(|s| s.parse().ok()) {
        Some(seed) => child::run(seed),
        None => parent::run(),
    }
}
