//! Defects of the Rust face, one check each, each in a process of its own (a hang or
//! an abort fails that check alone; the budget, scopes and hooks are process-wide).
//! Every check prints what it measured before it asserts, and a watchdog ends a check
//! that hangs with exit 70 and what it saw.

mod support;

use memquota::{Config, Error, HeapBytes, HeapProbe, MemoryManager, QuotaAlloc, Reservation};
use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};
use support::{Size, KIB, MIB};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

/// A check's own watchdog budget; the parent kills the child at twice that.
const BUDGET: Duration = Duration::from_secs(10);
/// Longer than any step that must not wait should take, even on a loaded machine.
const NO_WAIT: Duration = Duration::from_millis(250);

fn main() {
    support::run_isolated(
        &[
            (
                "scope_reservations_at_the_process_limit_never_hang",
                scope_reservations_at_the_process_limit_never_hang,
            ),
            ("no_false_oom_while_a_reclaim_can_make_room", no_false_oom_while_a_reclaim_can_make_room),
            ("last_report_returns_while_refusals_happen", last_report_returns_while_refusals_happen),
            (
                "attached_small_allocation_below_its_min_share_does_not_wait",
                attached_small_allocation_below_its_min_share_does_not_wait,
            ),
            (
                "attached_small_allocation_past_its_full_share_is_not_refused",
                attached_small_allocation_past_its_full_share_is_not_refused,
            ),
            (
                "panicking_heap_probe_does_not_unwind_out_of_the_allocator",
                panicking_heap_probe_does_not_unwind_out_of_the_allocator,
            ),
            (
                "spill_callback_returning_u64_max_keeps_stats_sane",
                spill_callback_returning_u64_max_keeps_stats_sane,
            ),
            (
                "reclaim_callback_allocations_are_never_policed",
                reclaim_callback_allocations_are_never_policed,
            ),
            ("service_thread_started_at_the_limit_lives", service_thread_started_at_the_limit_lives),
            (
                "a_fork_from_a_spill_callback_keeps_its_wait_counted",
                a_fork_from_a_spill_callback_keeps_its_wait_counted,
            ),
            ("a_panicking_report_hook_is_caught_and_counted", a_panicking_report_hook_is_caught_and_counted),
            ("init_again_at_the_limit_does_not_abort", init_again_at_the_limit_does_not_abort),
            (
                "init_in_a_fork_child_does_not_walk_the_loaders_list",
                init_in_a_fork_child_does_not_walk_the_loaders_list,
            ),
        ],
        BUDGET,
    );
}

fn mm() -> &'static MemoryManager {
    MemoryManager::global()
}

fn try_alloc(bytes: u64) -> Option<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(bytes as usize).ok()?;
    Some(v)
}

/// Cache blocks of 1 MiB that reclaim callbacks drop.
static CACHE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn fill_cache(mib: usize) {
    let mut cache = CACHE.lock().unwrap();
    cache.reserve_exact(mib);
    for _ in 0..mib {
        cache.push(vec![7u8; MIB as usize]);
    }
}

/// Drops cache blocks worth at least `need` bytes (try_lock: the allocating thread may
/// hold the cache). Returns what it dropped.
fn shrink_cache(need: usize) -> usize {
    let Ok(mut cache) = CACHE.try_lock() else { return 0 };
    let mut freed = 0;
    while freed < need {
        let Some(b) = cache.pop() else { break };
        freed += b.len();
    }
    freed
}

fn print_first_report() {
    let r = support::first_report();
    if !r.is_empty() {
        println!("  the first full report:");
        for l in r.lines() {
            println!("  | {l}");
        }
    }
}

// ---- a process-wide hang on the scope pool's spin lock ------------------------------

static RESERVED: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Four threads, each in its own scope, reserve 3 x 16 MiB one after another under a
/// 256 MiB limit with 100 MiB held outside any scope: 9 reservations fit, 3 do not.
/// The refusals must come back as errors, not hang the process.
fn scope_reservations_at_the_process_limit_never_hang() {
    memquota::init(Config::new().limit(256 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|l| {
        let _ = write!(l, "  reservations done per thread:");
        for r in &RESERVED {
            let _ = write!(l, " {}", r.load(SeqCst));
        }
        let _ = writeln!(l, " (of 3 each); refusals so far {}", memquota::stats().ooms);
    });
    let outside: Vec<u8> = std::hint::black_box(Vec::with_capacity(100 * MIB as usize));
    let ooms0 = memquota::stats().ooms;
    let started = Instant::now();
    let barrier = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let scope = mm().begin("reserver", i as u64, 0).unwrap();
                let mut held: Vec<Reservation> = Vec::with_capacity(3);
                let (mut refused, mut other) = (0, 0);
                barrier.wait();
                for _ in 0..3 {
                    match scope.reserve(16 * MIB) {
                        Ok(r) => held.push(r),
                        Err(Error::Refused { .. }) => refused += 1,
                        Err(_) => other += 1,
                    }
                    RESERVED[i].fetch_add(1, SeqCst);
                }
                barrier.wait(); // every request is in before any memory is given back
                let granted = held.len();
                drop(held);
                scope.end();
                (granted, refused, other)
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let elapsed = started.elapsed();
    let granted: usize = results.iter().map(|r| r.0).sum();
    let refused: usize = results.iter().map(|r| r.1).sum();
    let other: usize = results.iter().map(|r| r.2).sum();
    let ooms = memquota::stats().ooms - ooms0;
    println!(
        "  {granted} granted, {refused} refused, {other} other errors, ooms +{ooms}, in {} ms",
        elapsed.as_millis()
    );
    drop(outside);
    assert_eq!(
        (granted, refused, other),
        (9, 3, 0),
        "100 MiB + 9 x 16 MiB fit under 256 MiB, a tenth does not"
    );
    assert_eq!(ooms, 3, "each refusal is counted once");
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
}

// ---- false OOMs while a reclaim could make room -------------------------------------

/// Default settings but the limit: 60 MiB held, a 64 MiB cache the reclaim callback
/// drops, 128 MiB limit. Twenty times, two threads released together each ask for
/// 16 MiB, then free it. There is always room to reclaim: nothing may be refused.
fn no_false_oom_while_a_reclaim_can_make_room() {
    const ROUNDS: usize = 20;
    static DONE: AtomicU64 = AtomicU64::new(0);
    memquota::init(Config::new().limit(128 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|l| {
        let _ = writeln!(l, "  requests done: {}", DONE.load(SeqCst));
    });
    let held: Vec<u8> = Vec::with_capacity(60 * MIB as usize);
    fill_cache(64);
    memquota::on_reclaim(|need| {
        shrink_cache(need);
    });
    let before = memquota::stats();
    let barrier = Arc::new(Barrier::new(2));
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut refused_rounds = Vec::with_capacity(ROUNDS);
                for round in 0..ROUNDS {
                    barrier.wait();
                    let got = try_alloc(16 * MIB);
                    DONE.fetch_add(1, SeqCst);
                    if got.is_none() {
                        refused_rounds.push((round, t));
                    }
                    barrier.wait(); // both asked; now both free
                    drop(got);
                }
                refused_rounds
            })
        })
        .collect();
    let refused: Vec<(usize, usize)> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    let after = memquota::stats();
    println!(
        "  {} of {} requests refused (rounds, thread: {refused:?}); reclaims {} sync, {} background, \
         {} throttled; cache left {} MiB",
        refused.len(),
        2 * ROUNDS,
        after.reclaims_sync - before.reclaims_sync,
        after.reclaims_background - before.reclaims_background,
        after.reclaims_throttled - before.reclaims_throttled,
        CACHE.lock().unwrap().len()
    );
    print_first_report();
    drop(held);
    assert!(refused.is_empty(), "{} false OOMs: the cache could always have made room", refused.len());
}

// ---- last_report() while refusals happen --------------------------------------------

static ROUND: AtomicU64 = AtomicU64::new(0);

/// The account at the limit, nothing to reclaim, a refusal has happened: then
/// `last_report()`, which allocates its copy (about 900 bytes) while refusals take the
/// same lock. With a 200-byte allocation between calls, the thread's unflushed count
/// walks through its whole range in steps smaller than the copy, so one of the copies
/// reaches the slow path at the limit: it must still return the report.
fn last_report_returns_while_refusals_happen() {
    memquota::init(Config::new().limit(16 * MIB)).unwrap(); // threshold 4 KiB
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|l| {
        let _ = writeln!(l, "  last_report() call {} did not return", ROUND.load(SeqCst));
    });
    let mut held: Vec<Vec<u8>> = Vec::with_capacity(40_000);
    // Stdout's buffer is allocated on first use, infallibly: before the limit is hit.
    println!("  filling the budget");
    for size in [MIB, 64 * KIB, 4 * KIB, KIB] {
        while let Some(v) = try_alloc(size) {
            held.push(v);
        }
    }
    let s = memquota::stats();
    println!("  at the limit: tracked {} of {}, {} refusals", Size(s.native), Size(s.limit), s.ooms);
    assert!(s.ooms > 0, "the fill ends with a refusal");
    let mut calls = 0;
    for round in 0..64 {
        ROUND.store(round, SeqCst);
        let report = memquota::last_report();
        calls += 1;
        // The last report, full or a one-line summary of refusals within its window.
        assert!(report.as_deref().is_some_and(|r| r.contains("refused")), "round {round}: {report:?}");
        drop(report); // the next step must not be what crosses the thread's slack
        if let Some(v) = try_alloc(200) {
            if held.len() < held.capacity() {
                held.push(v);
            }
        }
    }
    println!("  {calls} calls returned the report; {} refusals in all", memquota::stats().ooms);
}

// ---- a scope-attached thread's small allocation -------------------------------------

/// The longest single allocation, and how many were refused, of `n` allocations of
/// `size` bytes on this (attached) thread.
fn small_allocations(n: usize, size: u64) -> (Duration, usize, Vec<Vec<u8>>) {
    let mut kept = Vec::with_capacity(n);
    let (mut longest, mut refused) = (Duration::ZERO, 0);
    for _ in 0..n {
        let t = Instant::now();
        let got = try_alloc(size);
        longest = longest.max(t.elapsed());
        match got {
            Some(v) => kept.push(v),
            None => refused += 1,
        }
    }
    (longest, refused, kept)
}

/// Refuse-min 1 MiB; a pool of 64 MiB that another scope has reserved whole. A thread
/// attached to a second scope, which holds nothing (below its minimum share), makes
/// 3 allocations of 64 KiB (each reaches the slow path): none may wait or be refused.
fn attached_small_allocation_below_its_min_share_does_not_wait() {
    memquota::init(Config::new().limit(256 * MIB).refuse_min(MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|_| {});
    mm().set_pool(64 * MIB);
    let hog = mm().begin("hog", 1, 0).unwrap();
    let all = hog.reserve(64 * MIB).unwrap();
    let late = mm().begin("late", 2, 0).unwrap();
    let g = late.attach().unwrap();
    let (longest, refused, kept) = small_allocations(3, 64 * KIB);
    drop(g);
    println!("  3 allocations of 64 KiB: the longest took {} ms, {refused} refused", longest.as_millis());
    drop((kept, all));
    late.end();
    hog.end();
    assert_eq!(refused, 0, "a request under refuse_min is never refused");
    assert!(longest < NO_WAIT, "a request under refuse_min never waits: one took {longest:?}");
}

/// Refuse-min 1 MiB; two scopes share a 64 MiB pool (32 MiB each). The attached
/// thread's scope reserved its whole share and used it; 16 more allocations of 64 KiB
/// (under refuse_min) must be granted at once, as over-commit.
fn attached_small_allocation_past_its_full_share_is_not_refused() {
    memquota::init(Config::new().limit(256 * MIB).refuse_min(MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|_| {});
    mm().set_pool(64 * MIB);
    let other = mm().begin("other", 1, 0).unwrap();
    let full = mm().begin("full", 2, 0).unwrap();
    let share = full.reserve(32 * MIB).unwrap();
    let g = full.attach().unwrap();
    let used = try_alloc(32 * MIB).expect("covered by the reservation");
    let (longest, refused, kept) = small_allocations(16, 64 * KIB);
    drop(g);
    println!(
        "  16 allocations of 64 KiB past a full share: the longest took {} ms, {refused} refused",
        longest.as_millis()
    );
    let g = full.attach().unwrap();
    drop((kept, used));
    drop(g);
    drop(share);
    full.end();
    other.end();
    assert_eq!(refused, 0, "a request under refuse_min is never refused");
    assert!(longest < NO_WAIT, "a request under refuse_min never waits: one took {longest:?}");
}

// ---- a panicking heap probe ---------------------------------------------------------

struct ProbePanic;
static PROBE_CALLS: AtomicU64 = AtomicU64::new(0);
static RECLAIMS: AtomicU64 = AtomicU64::new(0);

/// A heap-probe function that panics. Allocations that reach the slow path (and read
/// the probe) must not unwind out of the global allocator, and a later reclaim must
/// still run and make room.
fn panicking_heap_probe_does_not_unwind_out_of_the_allocator() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|l| {
        let _ = writeln!(l, "  probe called {} times", PROBE_CALLS.load(SeqCst));
    });
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().is::<ProbePanic>() {
            support::say(format_args!("  (the heap probe panicked, call {})\n", PROBE_CALLS.load(SeqCst)));
        } else {
            memquota::set_limit(1 << 50);
            default(info);
        }
    }));
    fill_cache(40);
    memquota::on_reclaim(|need| {
        RECLAIMS.fetch_add(1, SeqCst);
        shrink_cache(need);
    });
    memquota::set_heap_probe(HeapProbe::Function(Box::new(|| {
        PROBE_CALLS.fetch_add(1, SeqCst);
        std::panic::panic_any(ProbePanic)
    })));
    // Each measured allocation has its own catch; the outer one catches a panic out of
    // any other allocation made while the probe is installed.
    // Called through an opaque pointer: the allocator's entry points are declared not
    // to unwind, so a direct call would let the compiler drop the catch around it, and
    // an escaping panic would fly past every catch_unwind of this check.
    let alloc: fn(u64) -> Option<Vec<u8>> = std::hint::black_box(try_alloc);
    let measured = catch_unwind(|| {
        // Under the limit: 8 allocations of 2 MiB, each on the slow path.
        let (mut escaped, mut granted, mut refused) = (0, 0, 0);
        for _ in 0..8 {
            match catch_unwind(|| alloc(2 * MIB).map(drop)) {
                Err(_) => escaped += 1,
                Ok(Some(())) => granted += 1,
                Ok(None) => refused += 1,
            }
        }
        // Over the limit: 40 MiB more than the room left, with 40 MiB of cache to drop.
        let big = match catch_unwind(|| alloc(40 * MIB).map(drop)) {
            Err(_) => "a panic escaped",
            Ok(Some(())) => "granted",
            Ok(None) => "refused",
        };
        (escaped, granted, refused, big)
    });
    let calls = PROBE_CALLS.load(SeqCst);
    memquota::set_heap_probe(HeapProbe::None);
    memquota::set_heap_bytes(HeapBytes::default());
    let reclaims = RECLAIMS.load(SeqCst);
    match measured {
        Err(_) => {
            println!("  probe called {calls} times; a panic escaped an allocation outside the measured ones")
        }
        Ok((escaped, granted, refused, big)) => println!(
            "  probe called {calls} times; 2 MiB x 8: {granted} granted, {refused} refused, {escaped} panics \
             escaped the allocator; 40 MiB over the limit: {big}; reclaims run {reclaims}"
        ),
    }
    assert!(calls > 0, "the probe was read");
    let Ok((escaped, _, _, big)) = measured else { panic!("a panic unwound out of the global allocator") };
    assert_eq!(escaped, 0, "a panic unwound out of the global allocator");
    assert_ne!(big, "a panic escaped", "a panic unwound out of the global allocator (over the limit)");
    assert!(reclaims > 0, "no reclaim ran after the probe panicked");
    assert_eq!(big, "granted", "the reclaim could make room: the request must be granted");
}

// ---- a spill callback that returns u64::MAX -----------------------------------------

/// A consumer whose spill gives back its one reservation and says how much.
fn honest(scope: &memquota::TaskScope, bytes: u64) -> memquota::Consumer {
    let held: Arc<Mutex<Option<Reservation>>> = Arc::new(Mutex::new(None));
    let h2 = Arc::clone(&held);
    let c = scope.consumer("honest", move |_| h2.lock().unwrap().take().map_or(0, |r| r.bytes())).unwrap();
    *held.lock().unwrap() = Some(c.reserve(bytes).unwrap());
    c
}

/// A spill callback that frees nothing and returns `u64::MAX`: the counters must not
/// wrap (nothing goes backwards), nothing may panic under the pool's lock, and the
/// request that spilled is refused with an error.
fn spill_callback_returning_u64_max_keeps_stats_sane() {
    memquota::init(Config::new().limit(1 << 34)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|_| {});
    let scope = mm().begin("spilling", 1, 0).unwrap();
    scope.set_cap(Some(16 * MIB));
    let fair = honest(&scope, 8 * MIB);
    let first = scope.reserve(12 * MIB).expect("the honest consumer spills its 8 MiB");
    drop(first);
    let s0 = mm().snapshot();
    let liar = scope.consumer("liar", |_| u64::MAX).unwrap();
    let _lie = liar.reserve(8 * MIB).unwrap();
    let mut rounds = Vec::new();
    for _ in 0..2 {
        let got = catch_unwind(AssertUnwindSafe(|| scope.reserve(12 * MIB)));
        let snap = mm().snapshot();
        let spilled = liar.stats().map(|c| (c.spills, c.spilled_bytes));
        rounds.push((
            got.as_ref().map(|r| r.as_ref().map(|r| r.bytes()).map_err(|e| e.to_string())).ok(),
            snap.spills,
            snap.spilled_bytes,
            spilled,
        ));
        drop(got);
    }
    println!("  before the liar: {} spills, {} bytes spilled in all", s0.spills, s0.spilled_bytes);
    for (i, (got, spills, total, liar)) in rounds.iter().enumerate() {
        println!("  round {i}: reserve -> {got:?}; {spills} spills, {total} bytes spilled in all; liar (spills, bytes) {liar:?}");
    }
    drop(_lie);
    let _ = fair;
    scope.end();
    for (i, (got, _, _, _)) in rounds.iter().enumerate() {
        assert!(got.is_some(), "round {i}: reserve panicked");
        assert!(matches!(got, Some(Err(_))), "round {i}: nothing was freed, the request cannot fit: {got:?}");
    }
    let totals: Vec<u64> = std::iter::once(s0.spilled_bytes).chain(rounds.iter().map(|r| r.2)).collect();
    assert!(
        totals.windows(2).all(|w| w[1] >= w[0]),
        "the total of spilled bytes went backwards (wrapped): {totals:?}"
    );
    let liar_bytes: Vec<u64> = rounds.iter().filter_map(|r| r.3.map(|c| c.1)).collect();
    assert!(
        liar_bytes.windows(2).all(|w| w[1] >= w[0]),
        "the consumer's spilled bytes went backwards (wrapped): {liar_bytes:?}"
    );
    assert_eq!(rounds[1].1, rounds[0].1 + 1, "each spill is counted");
}

// ---- a reclaim callback's allocations ----------------------------------------------

static CB_RUNS: AtomicU64 = AtomicU64::new(0);
static CB_REFUSED: AtomicU64 = AtomicU64::new(0);
static CB_LONGEST_MS: AtomicU64 = AtomicU64::new(0);
static IN_CB: AtomicBool = AtomicBool::new(false);
static REENTERED: AtomicBool = AtomicBool::new(false);

/// A reclaim callback allocates twice (1 MiB each, both on the slow path) before it
/// frees anything, with the budget exhausted: memory the callbacks allocate is counted
/// but never policed, so both are granted at once and no reclaim starts inside.
fn reclaim_callback_allocations_are_never_policed() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|l| {
        let _ = writeln!(
            l,
            "  callback runs {}, its refused allocations {}",
            CB_RUNS.load(SeqCst),
            CB_REFUSED.load(SeqCst)
        );
    });
    // The budget exhausted: 48 MiB of cache, the rest in blocks of 256 KiB.
    fill_cache(48);
    let mut held = Vec::with_capacity(128);
    while let Some(v) = try_alloc(256 * KIB) {
        held.push(v);
    }
    memquota::on_reclaim(|need| {
        if IN_CB.swap(true, SeqCst) {
            REENTERED.store(true, SeqCst);
        }
        CB_RUNS.fetch_add(1, SeqCst);
        let mut scratch = Vec::with_capacity(2);
        for _ in 0..2 {
            let t = Instant::now();
            let got = try_alloc(MIB);
            CB_LONGEST_MS.fetch_max(t.elapsed().as_millis() as u64, SeqCst);
            match got {
                Some(v) => scratch.push(v),
                None => {
                    CB_REFUSED.fetch_add(1, SeqCst);
                }
            }
        }
        shrink_cache(need + 2 * MIB as usize);
        drop(scratch);
        IN_CB.store(false, SeqCst);
    });
    let ooms0 = memquota::stats().ooms;
    let t = Instant::now();
    let got = try_alloc(16 * MIB);
    let took = t.elapsed();
    let ooms = memquota::stats().ooms - ooms0;
    println!(
        "  16 MiB over the limit: {} in {} ms; callback runs {}, its allocations refused {}, the longest took {} ms; \
         a reclaim inside a reclaim: {}; ooms +{ooms}",
        if got.is_some() { "granted" } else { "refused" },
        took.as_millis(),
        CB_RUNS.load(SeqCst),
        CB_REFUSED.load(SeqCst),
        CB_LONGEST_MS.load(SeqCst),
        REENTERED.load(SeqCst)
    );
    drop((got, held));
    assert_eq!(CB_REFUSED.load(SeqCst), 0, "a callback's allocation was refused");
    assert!(!REENTERED.load(SeqCst), "a reclaim ran inside a reclaim");
    assert!(CB_LONGEST_MS.load(SeqCst) < NO_WAIT.as_millis() as u64, "a callback's allocation waited");
    assert_eq!(ooms, 0, "the reclaim made room: nothing is refused");
}

// ---- memquota's own threads start at the limit ---------------------------------------

static WORKER_RUNS: AtomicU64 = AtomicU64::new(0);
static WORKER_NAME: Mutex<String> = Mutex::new(String::new());

/// The `memquota-reclaim` worker starts on the first background reclaim, that is when
/// the budget is tight. Here the grant that asks for it is the one that fills the
/// budget to the byte (the callback is registered just before it), so the worker
/// starts with no room at all. std's start-up code copied a thread's name on the new
/// thread, an infallible allocation made before the worker could exempt itself:
/// refused there, it aborted the process (the sampler thread did the same, 1 run in
/// 60, in `last_report_returns_while_refusals_happen`).
fn service_thread_started_at_the_limit_lives() {
    memquota::init(Config::new().limit(16 * MIB)).unwrap(); // threshold 4 KiB
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|l| {
        let _ = writeln!(l, "  the reclaim callback ran {} times", WORKER_RUNS.load(SeqCst));
    });
    let mut held: Vec<Vec<u8>> = Vec::with_capacity(40_000);
    println!("  filling the budget");
    for size in [MIB, 64 * KIB, 4 * KIB, KIB] {
        while let Some(v) = try_alloc(size) {
            held.push(v);
        }
    }
    assert!(memquota::stats().ooms > 0, "the fill ends with a refusal");
    drop(held.swap_remove(0)); // a MiB of room
    memquota::flush_thread();
    memquota::on_reclaim(|_| {
        let name = std::fs::read_to_string("/proc/thread-self/comm").unwrap_or_default();
        if let Ok(mut w) = WORKER_NAME.lock() {
            *w = name.trim_end().to_owned();
        }
        WORKER_RUNS.fetch_add(1, SeqCst);
    });
    memquota::flush_thread();
    let s = memquota::stats();
    let (ooms, sync) = (s.ooms, s.reclaims_sync);
    let room = s.limit - s.native;
    assert!(room > 16 * KIB, "room past the thread's slack: {room} bytes");
    held.push(try_alloc(room).expect("exactly the room left"));
    let s = memquota::stats();
    assert!(s.native >= s.limit, "the budget is full: {} of {}", s.native, s.limit);
    // Served as a background reclaim: before the fix the worker's first allocation was
    // refused, ran the callback as a synchronous reclaim of its own, then aborted.
    while memquota::stats().reclaims_background == 0 {
        std::thread::park_timeout(Duration::from_millis(1)); // a poll, bounded by the watchdog
    }
    let after = memquota::stats();
    assert_eq!((after.ooms, after.reclaims_sync), (ooms, sync), "no refusal, no synchronous reclaim");
    // Taken, not cloned: an allocation made holding the lock the callback takes would
    // deadlock if it reached a reclaim (the budget is full).
    let name = std::mem::take(&mut *WORKER_NAME.lock().unwrap());
    println!("  {name:?} ran a reclaim with {} of {} taken", Size(s.native), Size(s.limit));
    assert_eq!(name, "memquota-reclai", "the kernel keeps 15 bytes of the name");
}

// ---- a fork from a spill callback, inside a request that waited ----------------------

/// Set in the fork child by the spill callback; the child's pid in the parent.
static IN_FORK_CHILD: AtomicBool = AtomicBool::new(false);
static FORK_CHILD: AtomicI32 = AtomicI32::new(0);

/// A request below its share waits for a free (registered as a waiter), waits out its
/// bound, then spills another scope's consumer, whose callback forks: in the child the
/// forking thread still holds the registration, and drops it when the request ends.
/// The child's count of waiters must keep it: it was zeroed, the drop wrapped it to
/// `u32::MAX`, the next waiter's registration brought it back to 0, and frees woke no
/// one: that waiter slept out its whole bound. The parent is checked the same way.
fn a_fork_from_a_spill_callback_keeps_its_wait_counted() {
    const POOL: u64 = 64 * MIB;
    mm().set_pool(POOL);
    mm().set_wait(Duration::from_millis(20)); // waited out: then other scopes spill
    let holder = mm().begin("holder", 1, 0).unwrap();
    let held: Arc<Mutex<Option<Reservation>>> = Arc::new(Mutex::new(None));
    let in_callback = Arc::clone(&held);
    let consumer = holder
        .consumer("forks", move |_target| {
            // SAFETY: fork has no memory preconditions; the child runs this check's
            // code on this thread only, and leaves with _exit.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                IN_FORK_CHILD.store(true, SeqCst);
            } else {
                FORK_CHILD.store(pid, SeqCst);
            }
            in_callback.lock().unwrap().take().map_or(0, |r| r.bytes())
        })
        .unwrap();
    *held.lock().unwrap() = Some(consumer.reserve(POOL).unwrap());
    let asker = mm().begin("asker", 2, 0).unwrap();
    let r = asker.reserve(8 * MIB).expect("granted once the holder spilled");
    assert!(asker.stats().unwrap().waits > 0, "the request waited before the spill");
    drop((r, consumer));
    holder.end();
    asker.end();
    if IN_FORK_CHILD.load(SeqCst) {
        let ok = catch_unwind(a_wait_is_woken_by_a_free).is_ok();
        // SAFETY: _exit ends the fork child at once, without the parent's exit code.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let pid = FORK_CHILD.load(SeqCst);
    assert!(pid > 0, "the spill callback forked");
    let status = support::wait_child(pid, BUDGET / 2);
    let exited = |s: i32| libc::WIFEXITED(s) && libc::WEXITSTATUS(s) == 0;
    assert!(
        status.is_some_and(exited),
        "the fork child failed its check (wait status {status:?}; None: killed)"
    );
    a_wait_is_woken_by_a_free();
}

/// A request below its share (the pool full) waits for a free, and a free wakes it:
/// it returns before its wait bound, which it would otherwise sleep out.
fn a_wait_is_woken_by_a_free() {
    const POOL: u64 = 64 * MIB;
    const BOUND: Duration = Duration::from_secs(3);
    mm().set_pool(POOL);
    mm().set_wait(BOUND);
    let full = mm().begin("full", 1, 0).unwrap();
    let all = full.reserve(POOL).unwrap();
    let late = mm().begin("late", 2, 0).unwrap();
    let h = late.handle();
    let t = std::thread::spawn(move || {
        let started = Instant::now();
        let got = h.reserve(8 * MIB).map(|r| r.bytes());
        (got, started.elapsed())
    });
    while late.stats().unwrap().waits == 0 {
        std::thread::yield_now(); // a poll: the thread counts its wait just before it sleeps
    }
    drop(all); // a free: wakes it
    let (got, took) = t.join().unwrap();
    println!("  pid {}: the waiting request returned after {} ms", std::process::id(), took.as_millis());
    assert_eq!(got.ok(), Some(8 * MIB));
    assert!(took < BOUND, "the free did not wake the waiting request: it slept out its bound");
    full.end();
    late.end();
}

// ---- a panicking report hook --------------------------------------------------------

static HOOK_CALLS: AtomicU64 = AtomicU64::new(0);

fn panicking_hook(_: &str) {
    HOOK_CALLS.fetch_add(1, SeqCst);
    panic!("a report hook panics on purpose");
}

/// Issue 30, item 4: a report hook that panics. The refusal's report, the summary of
/// the refusals a window held back (`flush_quiet`, at a preloaded program's exit) and a
/// scope's leak notice each call it; the panic must not unwind out of the global
/// allocator (an abort) or out of the scope's drop: the allocation is refused as
/// usual, the process goes on, and each panic is counted.
fn a_panicking_report_hook_is_caught_and_counted() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_report_hook(panicking_hook);
    let before = memquota::stats();
    // Through an opaque pointer: the allocator's entry points are declared not to
    // unwind, and a direct call would let the compiler drop the catch around it.
    let alloc: fn(u64) -> Option<Vec<u8>> = std::hint::black_box(try_alloc);
    let refused = [
        catch_unwind(|| alloc(128 * MIB).is_none()).ok(),
        catch_unwind(|| alloc(128 * MIB).is_none()).ok(), // in the window: held back
    ];
    let quiet = catch_unwind(memquota::seam::text::flush_quiet).is_ok();
    let leak = catch_unwind(|| {
        let scope = mm().begin("leaky", 1, 0).unwrap();
        let attached = scope.attach().unwrap();
        std::mem::forget(vec![1u8; 4096]);
        drop(attached);
        drop(scope); // ends it, with a leak notice
    })
    .is_ok();
    let after = memquota::stats();
    let calls = HOOK_CALLS.load(SeqCst);
    memquota::set_report_hook(memquota::seam::text::write_stderr);
    println!(
        "  refusals {refused:?} ({} counted), summary returned: {quiet}, leak notice returned: {leak}; \
         hook called {calls} times",
        after.ooms - before.ooms
    );
    assert_eq!(refused, [Some(true); 2], "each refusal returned null (Err), no panic escaped");
    assert!(quiet && leak, "no panic escaped the summary or the leak notice");
    assert_eq!(after.ooms - before.ooms, 2);
    assert_eq!(calls, 3, "the report, the summary, the leak notice");
    assert_eq!(after.report_hook_panics - before.report_hook_panics, 3, "each panic counted");
}

// ---- init again at the limit ----------------------------------------------------------

/// `init` called again while the account is past the limit (a program that configures
/// again while busy): what it allocates itself (the second-budget check's list of
/// loaded objects, their names) is memquota's bookkeeping, charged but never refused.
/// Before, the first of those allocations was refused on a thread made tight by a
/// refusal, and the process aborted in `handle_alloc_error`
/// (tests/fuzz_arbitration/ found it, re-configuring in bursts: 67 and 3072 bytes).
fn init_again_at_the_limit_does_not_abort() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    let holder = mm().begin("pool", 1, 0).unwrap();
    let mut pool = holder.reserve(MIB).unwrap();
    pool.grow_unchecked(64 * MIB); // an engine's pool, past the limit on its own figures
    assert!(try_alloc(MIB).is_none(), "the precondition: past the limit, requests are refused");
    let again = memquota::init(Config::new().limit(64 * MIB));
    let past = memquota::stats().native > 64 * MIB;
    drop(pool);
    println!("  init again past the limit: {again:?}");
    assert!(past, "the precondition: the account stayed past the limit");
    assert!(again.is_ok());
}

// ---- init in a fork child, the dynamic loader's lock held -----------------------------

static WALKING: AtomicBool = AtomicBool::new(false);
static WALK_DONE: AtomicBool = AtomicBool::new(false);

/// A `dl_iterate_phdr` callback that stays inside the loader's walk (its lock held)
/// until told to stop.
extern "C" fn stay_in_the_walk(
    _: *mut libc::dl_phdr_info,
    _: libc::size_t,
    _: *mut libc::c_void,
) -> libc::c_int {
    WALKING.store(true, SeqCst);
    while !WALK_DONE.load(SeqCst) {
        std::thread::yield_now();
    }
    1 // stop the walk
}

/// A fork while another thread walks the dynamic loader's list of objects
/// (`dl_iterate_phdr`: `init`'s check for a second budget, another thread's `init`,
/// unwinding and backtraces all walk it): in the child the loader's lock stays held by
/// a thread that did not survive the fork. `init` in the child must not walk the list
/// again (the child has the parent's objects, which the parent looked through). Before,
/// the child's `init` waited for that lock for ever (tests/fuzz_arbitration/ found it:
/// a fork child's `init` while another thread configured again).
fn init_in_a_fork_child_does_not_walk_the_loaders_list() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    let walker = std::thread::spawn(|| {
        // SAFETY: a valid callback that touches no argument; no data pointer.
        unsafe { libc::dl_iterate_phdr(Some(stay_in_the_walk), std::ptr::null_mut()) }
    });
    while !WALKING.load(SeqCst) {
        std::thread::yield_now(); // bounded by the watchdog
    }
    // SAFETY: fork has no preconditions; the child only calls init and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ok = memquota::init(Config::new().limit(64 * MIB)).is_ok();
        // SAFETY: _exit ends the child without running the parent's destructors.
        unsafe { libc::_exit(i32::from(!ok)) };
    }
    assert!(pid > 0, "fork failed");
    let status = support::wait_child(pid, Duration::from_secs(5));
    WALK_DONE.store(true, SeqCst);
    walker.join().unwrap();
    println!("  the child's init: {status:?} (None: killed after 5 s)");
    assert_eq!(status.map(|s| libc::WIFEXITED(s) && libc::WEXITSTATUS(s) == 0), Some(true), "init returned");
}
