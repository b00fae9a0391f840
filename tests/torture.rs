//! A seeded torture of the Rust face at a limit it keeps hitting: phases in which 2-8
//! threads allocate (1 B - 4 MiB), reallocate, free each other's blocks (sent over
//! channels), keep going after refusals, attach to task scopes and reserve in them,
//! while reclaim callbacks free a cache, allocate, and panic; some phases fork from
//! among the busy threads. After every phase:
//!
//! * the bound: the peak (`stats().native_peak`) and every sample of `stats().native`
//!   stay at or under `limit + (threads + 1) * threshold` (+ `limit / 16` when
//!   `refuse_min > 0`, + the emergency reserve refused threads draw on, + what the
//!   callbacks allocate at once);
//! * exact at quiescence: tracked bytes equal the requested sizes of the live
//!   allocations, counted by a wrapper around the global allocator;
//! * `stats().ooms` moved by exactly the refusals the program saw;
//! * reports inform without flooding: a few full reports per second at most;
//! * every fork child worked and exited 0; nothing hung (a watchdog fails the run).
//!
//! `MEMQUOTA_TORTURE_SEED=n` repeats a run's plan.

mod support;

use memquota::{Config, Error, MemoryManager, QuotaAlloc, Reservation, ScopeHandle, TaskScope, Untracked};
use std::alloc::{GlobalAlloc, Layout};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};
use support::{Line, Monitor, Reports, Rng, Size, KIB, MIB};

/// The Rust face, with the truth beside it: the sum of live allocation sizes.
#[global_allocator]
static GLOBAL: Counting = Counting(QuotaAlloc::new());

/// Requested bytes of the live allocations, counted around the real allocator: what
/// `stats().native` must equal at quiescence.
static LIVE: AtomicI64 = AtomicI64::new(0);

struct Counting(QuotaAlloc);

// SAFETY: every method forwards to the inner allocator with the caller's arguments
// unchanged; the counting around the calls never touches the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as i64, Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as i64, Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { self.0.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as i64, Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, forwarded.
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(new_size as i64 - layout.size() as i64, Relaxed);
        }
        p
    }
}

const LIMIT: u64 = 64 * MIB;
const PHASES: usize = 8;
const PHASE_TIME: Duration = Duration::from_millis(2500);
/// The watchdog's budget per phase: the phase, plus bounded waits (a scope's wait for
/// its share is 2 s, a reclaim wait 5 s), with a wide margin.
const PHASE_BUDGET: Duration = Duration::from_secs(20);
const MAX_WORKERS: usize = 8;
/// Blocks a worker holds at most.
const LIVE_CAP: usize = 48;
const CHANNEL_CAP: usize = 64;
/// The cache the reclaim callback frees, refilled at each phase's start.
const CACHE_MIB: usize = 16;
/// The most a reclaim callback allocates at once (its transient buffer), plus what a
/// panic allocates while it unwinds.
const CALLBACK_HOLDS: u64 = 64 * KIB + 4 * KIB;
/// Threads alive besides the workers: main, the monitor, the watchdog, the
/// `memquota-reclaim` worker.
const SERVICE_THREADS: u64 = 4;
/// How long the parent waits for a fork child.
const CHILD_TIMEOUT: Duration = Duration::from_secs(10);

/// Cache blocks of 1 MiB that a reclaim callback may drop.
static CACHE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
/// Callbacks run while ENABLED; IN_CALLBACK counts those inside.
static ENABLED: AtomicBool = AtomicBool::new(false);
static IN_CALLBACK: AtomicUsize = AtomicUsize::new(0);
static CALLS: AtomicU64 = AtomicU64::new(0);
static PANICS: AtomicU64 = AtomicU64::new(0);
/// Allocations of the callbacks that were refused (they must never be).
static CALLBACK_REFUSED: AtomicU64 = AtomicU64::new(0);
/// For the watchdog: the phase, and each worker's operations so far.
static PHASE: AtomicUsize = AtomicUsize::new(usize::MAX);
static OPS: [AtomicU64; MAX_WORKERS] = [const { AtomicU64::new(0) }; MAX_WORKERS];

/// One full report is shown in the output, from the first phase that failed.
static REPORT_SHOWN: AtomicBool = AtomicBool::new(false);

/// The payload of the callbacks' planned panics; the panic hook stays quiet for it.
struct PlannedPanic;

#[derive(Clone, Copy, Debug)]
struct Plan {
    workers: usize,
    refuse_min: u64,
    scopes: bool,
    forks: bool,
}

#[derive(Clone, Copy, Debug, Default)]
struct WorkerOut {
    ops: u64,
    granted: u64,
    errs: u64,
    reserve_refused: u64,
    reserve_other: u64,
    sent: u64,
    received: u64,
    forks: u64,
    /// Fork children that failed: the first failure's code (exit status, 1000 + signal,
    /// or 2000: timed out and killed).
    fork_failures: u64,
    fork_first_failure: i32,
}

/// The budget of every phase. Untracked memory (this process's thread stacks and
/// std's own, sampled every 50 ms) is reported, not counted: what is tortured here is
/// the ledger's bound on native memory, and a budget that moved with the samples
/// would refuse the test's own infallible setup allocations now and then.
fn config() -> Config {
    Config::new().limit(LIMIT).untracked(Untracked::Report)
}

fn main() {
    let seed =
        std::env::var("MEMQUOTA_TORTURE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_0001);
    println!("torture: seed {seed} (MEMQUOTA_TORTURE_SEED={seed} repeats this plan)");
    // The planned panics are quiet; any other lifts the limit (printing it allocates).
    support::lift_limit_on_panic(|p| p.is::<PlannedPanic>());
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(status);
    CACHE.lock().unwrap().reserve_exact(CACHE_MIB);
    memquota::on_reclaim(reclaim);

    let mut rng = Rng(seed);
    // Half the phases without scopes, then half with; refuse_min alternates; the seed
    // picks the thread counts and which further phases fork (phases 1 and 5 always do).
    let plans: Vec<Plan> = (0..PHASES)
        .map(|i| Plan {
            workers: 2 + rng.below(7) as usize,
            refuse_min: if i % 2 == 0 { 0 } else { 256 * KIB },
            scopes: i >= PHASES / 2,
            forks: i % (PHASES / 2) == 1 || rng.below(2) == 0,
        })
        .collect();

    // A warm-up under the phases' limit (the peak is the process's, never reset, so it
    // must not be raised past the bound here): lets std and memquota make whatever
    // they keep for the process's lifetime (thread-locals, the reclaim worker, panic
    // state).
    memquota::init(config()).unwrap();
    let warm = Plan { workers: MAX_WORKERS, refuse_min: 0, scopes: false, forks: false };
    let started = Instant::now();
    run_phase(usize::MAX, warm, seed ^ 0xabcd, Duration::from_millis(300));
    println!("warm-up: {} ms", started.elapsed().as_millis());
    warm_up_service_paths();

    let started = Instant::now();
    let mut failures: Vec<String> = Vec::new();
    let mut overcommit_allowed = false;
    for (i, plan) in plans.iter().enumerate() {
        memquota::init(config().refuse_min(plan.refuse_min)).unwrap();
        overcommit_allowed |= plan.refuse_min > 0;
        let r = run_phase(i, *plan, seed.wrapping_add(i as u64 * 7919), PHASE_TIME);
        failures.extend(r.check(i, *plan, overcommit_allowed));
    }
    memquota::set_limit(1 << 50);
    println!("torture: {} phases in {} ms", PHASES, started.elapsed().as_millis());
    if !failures.is_empty() {
        println!("\nfailures:");
        for f in &failures {
            println!("  {f}");
        }
    }
    let name = format!("torture (seed {seed})");
    let failed: &[&str] = if failures.is_empty() { &[] } else { &[&name] };
    support::summary(1, failed);
}

/// What the phases would otherwise make for good in their first measured round: the
/// panic machinery's state and the `memquota-reclaim` thread (started by the first
/// grant past the soft threshold).
fn warm_up_service_paths() {
    let _ = std::panic::catch_unwind(|| std::panic::panic_any(PlannedPanic));
    memquota::init(config()).unwrap();
    // The warm-up hit the limit: a fresh registration forgets its futile reclaims.
    memquota::on_reclaim(reclaim);
    let before = memquota::stats().reclaims_background;
    let mut past_soft: Vec<u8> = Vec::new();
    past_soft.try_reserve_exact((LIMIT * 9 / 10) as usize).expect("room under the limit");
    let deadline = Instant::now() + Duration::from_secs(10);
    while memquota::stats().reclaims_background == before {
        assert!(Instant::now() < deadline, "no background reclaim ran past the soft threshold");
        std::thread::yield_now();
    }
    drop(past_soft);
}

/// What the watchdog prints if a phase hangs.
fn status(l: &mut Line) {
    let _ = write!(l, "  phase {}; worker operations:", PHASE.load(SeqCst) as isize);
    for ops in &OPS {
        let _ = write!(l, " {}", ops.load(SeqCst));
    }
    let s = memquota::stats();
    let _ = writeln!(
        l,
        "\n  tracked now {}, peak {}, limit {}, ooms {}, full reports so far {}; callbacks {} ({} inside now)",
        Size(s.native),
        Size(s.native_peak),
        Size(s.limit),
        s.ooms,
        support::FULL_REPORTS.load(SeqCst),
        CALLS.load(SeqCst),
        IN_CALLBACK.load(SeqCst)
    );
}

/// The reclaim callback: drops cache blocks (try_lock: the allocating thread may hold
/// the cache), sometimes allocates a transient buffer first, sometimes panics after.
fn reclaim(need: usize) {
    IN_CALLBACK.fetch_add(1, SeqCst);
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            IN_CALLBACK.fetch_sub(1, SeqCst);
        }
    }
    let _leave = Leave;
    if !ENABLED.load(SeqCst) {
        return;
    }
    let n = CALLS.fetch_add(1, SeqCst);
    if n % 3 == 1 {
        // Fallible, so that a refusal here (there must be none: a callback's bytes are
        // counted, never policed) is counted instead of aborting the run.
        let mut scratch: Vec<u8> = Vec::new();
        match scratch.try_reserve_exact(64 * KIB as usize) {
            Ok(()) => scratch.push(1),
            Err(_) => {
                CALLBACK_REFUSED.fetch_add(1, SeqCst);
            }
        }
        std::hint::black_box(&scratch);
    }
    if let Ok(mut cache) = CACHE.try_lock() {
        let mut freed = 0;
        while freed < need {
            let Some(block) = cache.pop() else { break };
            freed += block.len();
        }
    }
    if n % 5 == 4 {
        PANICS.fetch_add(1, SeqCst);
        std::panic::panic_any(PlannedPanic);
    }
}

/// Refills the cache as far as the budget lets it, less a margin: fallibly, since it
/// runs at a limit the phases keep hitting, where an infallible allocation would abort
/// the process.
fn fill_cache() {
    let mut cache = CACHE.lock().unwrap();
    // Leave room for the phase's own setup (its scopes, channels, threads), whose
    // allocations are infallible.
    while cache.len() < CACHE_MIB && memquota::stats().headroom > 8 * MIB {
        let mut block: Vec<u8> = Vec::new();
        if block.try_reserve_exact(MIB as usize).is_err() {
            break;
        }
        block.resize(MIB as usize, 7);
        cache.push(block);
    }
}

/// Sizes from 1 B to 4 MiB, most of them small (those are what walk past a limit).
fn size(rng: &mut Rng) -> usize {
    (match rng.below(100) {
        0..=54 => 1 + rng.below(512),
        55..=79 => 1 + rng.below(64 << 10),
        80..=96 => 1 + rng.below(1 << 20),
        _ => 1 + rng.below(4 << 20),
    }) as usize
}

struct PhaseResult {
    workers: Vec<WorkerOut>,
    samples: support::Samples,
    stats_before: memquota::Stats,
    stats_after: memquota::Stats,
    expected_native: u64,
    reports: Reports,
    first_report: String,
    elapsed: Duration,
    callbacks: u64,
    panics: u64,
    callback_refused: u64,
}

fn run_phase(i: usize, plan: Plan, seed: u64, time: Duration) -> PhaseResult {
    PHASE.store(i, SeqCst);
    for o in &OPS {
        o.store(0, SeqCst);
    }
    support::arm("a torture phase", PHASE_BUDGET);
    fill_cache();
    let mut scopes: Vec<TaskScope> = if plan.scopes {
        (0..plan.workers).map(|w| MemoryManager::global().begin("torture", w as u64, 0).unwrap()).collect()
    } else {
        Vec::new()
    };
    let calls0 = (CALLS.load(SeqCst), PANICS.load(SeqCst), CALLBACK_REFUSED.load(SeqCst));
    let mut workers: Vec<WorkerOut> = Vec::with_capacity(plan.workers);
    ENABLED.store(true, SeqCst);
    memquota::flush_thread();
    let stats_before = memquota::stats();
    let reports_before = Reports::now();
    support::forget_first_report();
    let started = Instant::now();

    // Everything a worker needs is allocated here, before any of them runs: once they
    // do, an infallible allocation could be refused and abort the run.
    let mut senders = Vec::with_capacity(plan.workers);
    let mut receivers = Vec::with_capacity(plan.workers);
    for _ in 0..plan.workers {
        let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(CHANNEL_CAP);
        senders.push(tx);
        receivers.push(rx);
    }
    let barrier = Arc::new(Barrier::new(plan.workers + 1));
    let monitor = Monitor::start();
    let handles: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(w, rx)| {
            let tx = senders[(w + 1) % plan.workers].clone();
            let live = Vec::with_capacity(LIVE_CAP);
            let scope = scopes.get(w).map(|s| s.handle());
            let barrier = Arc::clone(&barrier);
            let rng = Rng(seed.wrapping_mul(31).wrapping_add(w as u64 + 1) | 1);
            std::thread::spawn(move || worker(w, plan, rng, tx, rx, live, scope, &barrier, time))
        })
        .collect();
    drop(senders);
    barrier.wait();
    for h in handles {
        workers.push(h.join().expect("a worker panicked"));
    }
    let elapsed = started.elapsed();
    let samples = monitor.stop();
    drop(barrier);

    // Quiescence: no callback runs from here on, and every thread's bytes are flushed.
    ENABLED.store(false, SeqCst);
    let deadline = Instant::now() + Duration::from_secs(10);
    while IN_CALLBACK.load(SeqCst) > 0 {
        assert!(Instant::now() < deadline, "a reclaim callback did not return");
        std::thread::yield_now();
    }
    for s in scopes.drain(..) {
        let _ = s.end();
    }
    let reports = Reports::now().since(reports_before);
    memquota::flush_thread();
    let stats_after = memquota::stats();
    let expected_native = LIVE.load(SeqCst) as u64;
    let first_report = support::first_report();
    drop(scopes);
    support::disarm();
    PhaseResult {
        workers,
        samples,
        stats_before,
        stats_after,
        expected_native,
        reports,
        first_report,
        elapsed,
        callbacks: CALLS.load(SeqCst) - calls0.0,
        panics: PANICS.load(SeqCst) - calls0.1,
        callback_refused: CALLBACK_REFUSED.load(SeqCst) - calls0.2,
    }
}

impl PhaseResult {
    /// Prints the phase's figures and returns what broke the contract.
    fn check(&self, i: usize, plan: Plan, overcommit_allowed: bool) -> Vec<String> {
        let t = self.workers.iter().fold(WorkerOut::default(), |mut a, w| {
            a.ops += w.ops;
            a.granted += w.granted;
            a.errs += w.errs;
            a.reserve_refused += w.reserve_refused;
            a.reserve_other += w.reserve_other;
            a.sent += w.sent;
            a.received += w.received;
            a.forks += w.forks;
            a.fork_failures += w.fork_failures;
            if a.fork_first_failure == 0 {
                a.fork_first_failure = w.fork_first_failure;
            }
            a
        });
        let after = &self.stats_after;
        let threshold = after.threshold;
        let threads = (plan.workers as u64 + SERVICE_THREADS).max(self.samples.max_threads);
        let allowance = |overcommit: bool| {
            (threads + 1) * threshold
                + if overcommit { LIMIT / 16 } else { 0 }
                + memquota::seam::slow::emergency_reserve_for(LIMIT)
                + CALLBACK_HOLDS
        };
        let bound = LIMIT + allowance(plan.refuse_min > 0);
        let peak_bound = LIMIT + allowance(overcommit_allowed);
        let ooms = after.ooms - self.stats_before.ooms;
        let seen_refusals = t.errs + t.reserve_refused + self.callback_refused;
        let secs = self.elapsed.as_secs_f64();
        let full_allowed = 2 + 2 * secs.ceil() as u64;
        println!(
            "phase {i}: {} workers, refuse_min {}, scopes {}, forks {}: {} ops in {} ms, {} granted, \
             {} Errs + {} refused reservations ({} other errors), {} sent across threads",
            plan.workers,
            plan.refuse_min,
            plan.scopes,
            plan.forks,
            t.ops,
            self.elapsed.as_millis(),
            t.granted,
            t.errs,
            t.reserve_refused,
            t.reserve_other,
            t.sent,
        );
        println!(
            "  peak {} (bound {}: limit + ({threads} threads + 1) x {threshold}{} + {CALLBACK_HOLDS}); \
             max sampled {} over {} samples (bound {})",
            Size(after.native_peak),
            Size(peak_bound),
            if overcommit_allowed { " + limit/16" } else { "" },
            Size(self.samples.max_native),
            self.samples.count,
            Size(bound),
        );
        println!(
            "  ooms +{ooms} (program saw {seen_refusals}); full reports {} ({} hook calls, {} bytes; allowed {full_allowed}); \
             callbacks {} ({} panicked, {} of their allocations refused); forks {} ({} failed, first code {}); tracked at quiescence {} (expected {})",
            self.reports.full,
            self.reports.calls,
            self.reports.bytes,
            self.callbacks,
            self.panics,
            self.callback_refused,
            t.forks,
            t.fork_failures,
            t.fork_first_failure,
            after.native,
            self.expected_native,
        );
        let mut bad = Vec::new();
        let mut fail = |what: String| {
            println!("  FAILED: {what}");
            bad.push(format!("phase {i}: {what}"));
        };
        if after.native_peak > peak_bound {
            fail(format!(
                "peak {} passed limit + bound {} by {}",
                Size(after.native_peak),
                Size(peak_bound),
                Size(after.native_peak - peak_bound)
            ));
        }
        if self.samples.max_native > bound {
            fail(format!("a sample saw {} > limit + bound {}", Size(self.samples.max_native), Size(bound)));
        }
        if after.native != self.expected_native {
            fail(format!(
                "not exact at quiescence: tracked {} != {} expected (off by {})",
                after.native,
                self.expected_native,
                after.native as i64 - self.expected_native as i64
            ));
        }
        if ooms != seen_refusals {
            fail(format!("stats().ooms moved by {ooms}, the program saw {seen_refusals} refusals"));
        }
        if self.reports.full > full_allowed {
            fail(format!("{} full reports in {secs:.1} s (at most {full_allowed})", self.reports.full));
        }
        if self.reports.bytes > 64 * KIB {
            fail(format!("{} bytes of reports in {secs:.1} s (at most 64 KiB)", self.reports.bytes));
        }
        if self.callback_refused > 0 {
            fail(format!(
                "{} allocations of reclaim callbacks were refused (counted, never policed)",
                self.callback_refused
            ));
        }
        if t.fork_failures > 0 {
            fail(format!(
                "{} of {} fork children failed (first: {})",
                t.fork_failures,
                t.forks,
                describe_child(t.fork_first_failure)
            ));
        }
        if plan.forks && t.forks == 0 {
            fail("no fork happened in a fork phase".into());
        }
        if !bad.is_empty() && !self.first_report.is_empty() && !REPORT_SHOWN.swap(true, SeqCst) {
            println!("  the phase's first full report:");
            for l in self.first_report.lines() {
                println!("  | {l}");
            }
        }
        bad
    }
}

fn describe_child(code: i32) -> String {
    match code {
        2000 => "timed out and was killed".into(),
        c if c > 1000 => format!("killed by signal {}", c - 1000),
        11 => "exit 11: could not allocate 1 MiB under a raised limit".into(),
        12 => "exit 12: tracked bytes did not rise by exactly 1 MiB".into(),
        13 => "exit 13: tracked bytes did not come back after the free".into(),
        14 => "exit 14: small allocations and frees were not exact".into(),
        15 => "exit 15: a request over the limit was granted".into(),
        16 => "exit 16: stats().ooms did not count the refusal".into(),
        c => format!("exit {c}"),
    }
}

#[allow(clippy::too_many_arguments)]
fn worker(
    w: usize,
    plan: Plan,
    mut rng: Rng,
    tx: SyncSender<Vec<u8>>,
    rx: Receiver<Vec<u8>>,
    mut live: Vec<Vec<u8>>,
    scope: Option<ScopeHandle>,
    barrier: &Barrier,
    time: Duration,
) -> WorkerOut {
    let mut out = WorkerOut::default();
    let mut reservations: [Option<Reservation>; 4] = [None, None, None, None];
    let mut guard = None;
    barrier.wait();
    let started = Instant::now();
    let deadline = started + time;
    // The first two workers each fork once, half-way through.
    let mut fork_due = plan.forks && w < 2;
    loop {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        out.ops += 1;
        OPS[w].store(out.ops, SeqCst);
        while let Ok(v) = rx.try_recv() {
            out.received += 1;
            drop(v); // memory another thread allocated
        }
        let pick = |rng: &mut Rng, n: usize| rng.below(n as u64) as usize;
        match rng.below(100) {
            0..=39 => {
                let mut v: Vec<u8> = Vec::new();
                match v.try_reserve_exact(size(&mut rng)) {
                    Ok(()) => {
                        out.granted += 1;
                        v.push(1);
                        if live.len() == LIVE_CAP {
                            let k = pick(&mut rng, live.len());
                            live.swap_remove(k);
                        }
                        live.push(v);
                    }
                    Err(_) => out.errs += 1,
                }
            }
            40..=49 if !live.is_empty() => {
                let k = pick(&mut rng, live.len());
                let v = &mut live[k];
                let grow = v.capacity() - v.len() + size(&mut rng);
                match v.try_reserve_exact(grow) {
                    Ok(()) => out.granted += 1,
                    Err(_) => out.errs += 1,
                }
            }
            50..=54 if !live.is_empty() => {
                let k = pick(&mut rng, live.len());
                live[k].shrink_to_fit();
            }
            55..=64 if !live.is_empty() => {
                let k = pick(&mut rng, live.len());
                match tx.try_send(live.swap_remove(k)) {
                    Ok(()) => out.sent += 1,
                    Err(TrySendError::Full(v) | TrySendError::Disconnected(v)) => drop(v),
                }
            }
            65..=84 if !live.is_empty() => {
                let k = pick(&mut rng, live.len());
                live.swap_remove(k);
            }
            85..=89 => {
                if let Some(h) = scope {
                    guard = match guard.take() {
                        Some(g) => {
                            drop(g);
                            None
                        }
                        None => h.attach().ok(),
                    };
                }
            }
            90..=95 => {
                if let Some(h) = scope {
                    let k = pick(&mut rng, reservations.len());
                    reservations[k] = None;
                    match h.reserve(size(&mut rng) as u64) {
                        Ok(r) => reservations[k] = Some(r),
                        Err(Error::Refused { .. }) => out.reserve_refused += 1,
                        Err(_) => out.reserve_other += 1,
                    }
                }
            }
            96..=97 => {
                let k = pick(&mut rng, reservations.len());
                reservations[k] = None;
            }
            _ => {}
        }
        if fork_due && now >= started + time / 2 {
            fork_due = false;
            out.forks += 1;
            // The child checks exact process figures: an attached thread's allocations
            // would first use its scope's reservation, so it forks detached.
            drop(guard.take());
            let code = fork_and_check(&mut live);
            if code != 0 {
                out.fork_failures += 1;
                if out.fork_first_failure == 0 {
                    out.fork_first_failure = code;
                }
            }
        }
    }
    drop(guard);
    reservations = [None, None, None, None];
    drop(reservations);
    drop(live);
    drop(tx);
    // Free whatever the neighbour still sends, until it is done. Yield, not a blocking
    // receive: registering a blocked receiver may allocate, and the others still press
    // on the limit.
    loop {
        match rx.try_recv() {
            Ok(v) => {
                out.received += 1;
                drop(v);
            }
            Err(TryRecvError::Empty) => std::thread::yield_now(),
            Err(TryRecvError::Disconnected) => break,
        }
    }
    out
}

/// Forks while the other workers run. The child frees what it inherited from this
/// worker, raises its own limit, allocates and frees with exact counts, is refused a
/// request over a limit it lowers, and exits with a code naming the first check that
/// failed. Returns the child's code (0: all held).
fn fork_and_check(live: &mut Vec<Vec<u8>>) -> i32 {
    // SAFETY: fork has no preconditions. The child only runs the checks below (the
    // allocator, memquota's counters, atomics) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = child_checks(live);
        // SAFETY: _exit ends the child at once, running nothing of the parent's.
        unsafe { libc::_exit(code) };
    }
    if pid < 0 {
        return 3000;
    }
    match support::wait_child(pid, CHILD_TIMEOUT) {
        None => 2000,
        Some(status) if libc::WIFEXITED(status) => libc::WEXITSTATUS(status),
        Some(status) if libc::WIFSIGNALED(status) => 1000 + libc::WTERMSIG(status),
        Some(_) => 2001,
    }
}

fn child_checks(live: &mut Vec<Vec<u8>>) -> i32 {
    // The parent's callback would free the cache here and turn the refusal checked
    // below into a grant.
    ENABLED.store(false, SeqCst);
    memquota::clear_reclaim();
    live.clear();
    memquota::flush_thread();
    let s0 = memquota::stats();
    memquota::set_limit(s0.native + 256 * MIB);
    let mut v: Vec<u8> = Vec::new();
    if v.try_reserve_exact(MIB as usize).is_err() {
        return 11;
    }
    memquota::flush_thread();
    if memquota::stats().native != s0.native + MIB {
        return 12;
    }
    drop(v);
    memquota::flush_thread();
    if memquota::stats().native != s0.native {
        return 13;
    }
    for n in 1..=1000usize {
        let small: Vec<u8> = Vec::with_capacity(n);
        std::hint::black_box(&small);
    }
    memquota::flush_thread();
    if memquota::stats().native != s0.native {
        return 14;
    }
    memquota::set_limit(s0.native + MIB / 2);
    let mut big: Vec<u8> = Vec::new();
    if big.try_reserve_exact(2 * MIB as usize).is_ok() {
        return 15;
    }
    if memquota::stats().ooms != s0.ooms + 1 {
        return 16;
    }
    0
}
