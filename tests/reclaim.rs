//! The policy end to end with the real global allocator: heap probe, reclaim
//! callbacks (allocating, panicking, slow and contended, background), the OOM
//! report, and the futility suspension. One process, checks run in order: they share
//! the budget, so each one sets the configuration it needs.

mod support;

use memquota::{Config, HeapBytes, HeapMode, HeapProbe, QuotaAlloc};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::Duration;
use support::run;

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

const MIB: usize = 1 << 20;

/// Memory a callback can give back, in 1 MiB blocks.
static CACHE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
/// What the report hook received last.
static REPORTS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn main() {
    memquota::set_report_hook(|r| REPORTS.lock().unwrap().push(r.to_owned()));
    run(&[
        ("heap_probe_counts_against_the_limit", heap_probe_counts_against_the_limit),
        ("reclaim_that_shrinks_the_heap_makes_room", reclaim_that_shrinks_the_heap_makes_room),
        ("callback_may_allocate_without_recursing", callback_may_allocate_without_recursing),
        ("exactly_one_reclaim_in_flight", exactly_one_reclaim_in_flight),
        ("background_reclaim_is_deduplicated", background_reclaim_is_deduplicated),
        ("oom_try_reserve_errs_with_a_report", oom_try_reserve_errs_with_a_report),
        ("panicking_callback_is_caught_and_counted", panicking_callback_is_caught_and_counted),
        ("futile_reclaims_are_suspended", futile_reclaims_are_suspended),
        ("small_requests_overcommit_within_a_bound", small_requests_overcommit_within_a_bound),
    ]);
}

/// A budget with no soft threshold (no background reclaims to race with the check)
/// and no rate limit.
fn configure(limit: usize) -> Config {
    let c = Config::new()
        .limit(limit as u64)
        .soft_ratio(1.0)
        .reclaim_interval(Duration::ZERO)
        .report_window(Duration::ZERO);
    memquota::init(c.clone()).unwrap();
    c
}

fn fill_cache(mib: usize) {
    let mut cache = CACHE.lock().unwrap();
    for _ in 0..mib {
        cache.push(vec![7u8; MIB]);
    }
}

/// Drops cache blocks worth at least `need` bytes; returns what it dropped.
fn shrink_cache(need: usize) -> usize {
    let Ok(mut cache) = CACHE.try_lock() else { return 0 };
    let mut freed = 0;
    while freed < need {
        let Some(b) = cache.pop() else { break };
        freed += b.len();
    }
    freed
}

fn try_alloc(bytes: usize) -> Option<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(bytes).ok()?;
    Some(v)
}

fn heap_probe_counts_against_the_limit() {
    configure(64 * MIB);
    memquota::set_heap_bytes(HeapBytes::new(48 * MIB as u64, 8 * MIB as u64));
    let s = memquota::stats();
    assert_eq!(s.heap.committed, 48 * MIB as u64);
    // At most: nothing native may be counted yet (the sampler thread's first allocations
    // race this check).
    assert!(s.headroom <= 16 * MIB as u64, "{s:?}");
    assert!(try_alloc(20 * MIB).is_none(), "48 MiB committed heap + 20 MiB native > 64 MiB");

    memquota::init(Config::new().limit(64 * MIB as u64).soft_ratio(1.0).heap(HeapMode::Used)).unwrap();
    assert!(try_alloc(20 * MIB).is_some(), "only 8 MiB of heap is used");

    memquota::set_heap_probe(HeapProbe::Function(Box::new(|| {
        HeapBytes::new(60 * MIB as u64, 60 * MIB as u64)
    })));
    assert!(try_alloc(8 * MIB).is_none(), "the probe function says 60 MiB");
    memquota::set_heap_probe(HeapProbe::None);
    assert!(try_alloc(20 * MIB).is_some(), "no heap counted any more");
    assert_eq!(memquota::stats().heap, HeapBytes::default());
}

fn reclaim_that_shrinks_the_heap_makes_room() {
    configure(64 * MIB);
    memquota::set_heap_bytes(HeapBytes::new(48 * MIB as u64, 40 * MIB as u64));
    // The "GC": the heap shrinks to 8 MiB committed.
    memquota::on_reclaim(|_| memquota::set_heap_bytes(HeapBytes::new(8 * MIB as u64, 4 * MIB as u64)));
    let before = memquota::stats();
    assert!(try_alloc(20 * MIB).is_some(), "the GC shrank the heap, so there is room");
    let after = memquota::stats();
    assert_eq!(after.reclaims_sync, before.reclaims_sync + 1);
    assert_eq!(after.reclaimed_bytes - before.reclaimed_bytes, 40 * MIB as u64, "freed = heap shrink");
    assert_eq!(after.ooms, before.ooms);
    memquota::set_heap_probe(HeapProbe::None);
}

fn callback_may_allocate_without_recursing() {
    static IN_CALLBACK: AtomicBool = AtomicBool::new(false);
    static REENTERED: AtomicBool = AtomicBool::new(false);
    static KEPT: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
    configure(64 * MIB);
    fill_cache(40);
    memquota::on_reclaim(|need| {
        if IN_CALLBACK.swap(true, SeqCst) {
            REENTERED.store(true, SeqCst);
        }
        // Allocates 4 MiB while the budget is exhausted, before freeing anything:
        // charged, never refused, never a nested reclaim.
        KEPT.lock().unwrap().push(vec![1u8; 4 * MIB]);
        shrink_cache(need + 4 * MIB);
        IN_CALLBACK.store(false, SeqCst);
    });
    let before = memquota::stats();
    let work = try_alloc(40 * MIB).expect("the cache shrinks to make room");
    let after = memquota::stats();
    assert!(!REENTERED.load(SeqCst), "a reclaim ran inside a reclaim");
    assert_eq!(after.reclaims_sync, before.reclaims_sync + 1);
    assert_eq!(KEPT.lock().unwrap().len(), 1, "the callback's allocation succeeded");
    assert!(after.native >= 44 * MIB as u64, "the callback's 4 MiB is charged: {}", after.native);
    drop(work);
    KEPT.lock().unwrap().clear();
    CACHE.lock().unwrap().clear();
}

fn exactly_one_reclaim_in_flight() {
    const THREADS: usize = 8;
    static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
    static MAX_IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    configure(128 * MIB);
    fill_cache(100);
    memquota::on_reclaim(|need| {
        let now = IN_FLIGHT.fetch_add(1, SeqCst) + 1;
        MAX_IN_FLIGHT.fetch_max(now, SeqCst);
        CALLS.fetch_add(1, SeqCst);
        // A slow reclaim (a JVM GC takes tens of milliseconds), so that the other
        // threads arrive while it runs and must wait for it.
        std::thread::sleep(Duration::from_millis(50));
        shrink_cache(need + 32 * MIB);
        IN_FLIGHT.fetch_sub(1, SeqCst);
    });
    let before = memquota::stats();
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                let held = try_alloc(8 * MIB);
                barrier.wait(); // hold it until every thread has asked: 164 MiB wanted
                held.is_some()
            })
        })
        .collect();
    let granted = handles.into_iter().map(|h| h.join().unwrap()).filter(|&ok| ok).count();
    let after = memquota::stats();
    println!("  {} reclaims for {THREADS} threads over the limit at once", CALLS.load(SeqCst));
    assert_eq!(MAX_IN_FLIGHT.load(SeqCst), 1, "two reclaims ran at once");
    assert_eq!(granted, THREADS, "every thread got its memory after the reclaims");
    assert_eq!(after.ooms, before.ooms);
    assert!(CALLS.load(SeqCst) >= 1 && CALLS.load(SeqCst) < THREADS, "waiters should share reclaims");
    CACHE.lock().unwrap().clear();
}

fn background_reclaim_is_deduplicated() {
    let (started_tx, started_rx) = mpsc::channel::<String>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let hooks = Mutex::new((started_tx, release_rx, done_tx));
    memquota::init(Config::new().limit(64 * MIB as u64).soft_ratio(0.5).reclaim_interval(Duration::ZERO))
        .unwrap();
    memquota::on_reclaim(move |_| {
        let h = hooks.lock().unwrap();
        // memquota's threads carry their name for the kernel (std's copy of a name
        // is an allocation on the new thread before it could be exempted).
        let name =
            std::fs::read_to_string("/proc/thread-self/comm").unwrap_or_default().trim_end().to_owned();
        h.0.send(name).unwrap();
        h.1.recv_timeout(Duration::from_secs(30)).unwrap();
        h.2.send(()).unwrap();
    });
    let before = memquota::stats();
    let mut held = vec![try_alloc(40 * MIB).expect("under the hard limit")];
    let who = started_rx.recv_timeout(Duration::from_secs(30)).expect("a background reclaim starts");
    assert_eq!(who, "memquota-reclai", "the kernel keeps 15 bytes of the name");
    // While it runs, more allocations past the soft threshold ask again: de-duplicated.
    for _ in 0..5 {
        held.push(try_alloc(MIB).expect("still under the hard limit"));
    }
    release_tx.send(()).unwrap();
    done_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    drop(held);
    memquota::flush_thread();
    let after = memquota::stats();
    assert_eq!(started_rx.try_recv().ok(), None, "a second background reclaim started");
    assert_eq!(after.reclaims_sync, before.reclaims_sync, "nothing waited");
    assert_eq!(after.ooms, before.ooms);
    // The record is written just after the callback returns.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while memquota::stats().reclaims_background == before.reclaims_background {
        assert!(std::time::Instant::now() < deadline, "the background reclaim was never recorded");
        std::thread::yield_now();
    }
    assert_eq!(memquota::stats().reclaims_background, before.reclaims_background + 1);
}

fn oom_try_reserve_errs_with_a_report() {
    configure(64 * MIB);
    memquota::on_reclaim(|need| {
        shrink_cache(need);
    });
    let before = memquota::stats();
    REPORTS.lock().unwrap().clear();
    let mut v: Vec<u8> = Vec::new();
    assert!(v.try_reserve_exact(1 << 30).is_err());
    let after = memquota::stats();
    assert_eq!(after.ooms, before.ooms + 1);
    assert!(after.reclaims_sync > before.reclaims_sync, "a reclaim was tried before refusing");
    let reports = REPORTS.lock().unwrap().clone();
    assert_eq!(reports.len(), 1, "one report per refusal");
    let r = &reports[0];
    for needle in [
        "allocation refused: 1.0 GiB (1073741824) requested",
        "limit            64.0 MiB (67108864)",
        "native tracked",
        "heap committed",
        "heap used",
        "reclaims",
        "sync       asked",
        "jemalloc         allocated",
        "resident",
        "policy           null",
    ] {
        assert!(r.contains(needle), "report lacks {needle:?}:\n{r}");
    }
    // The hook got it after the summary of any refusal an earlier window only counted.
    let last = memquota::last_report().unwrap();
    assert!(r.ends_with(last.as_str()), "{last}");
}

fn panicking_callback_is_caught_and_counted() {
    configure(64 * MIB);
    memquota::on_reclaim(|_| panic!("reclaim callback panics on purpose"));
    let before = memquota::stats();
    REPORTS.lock().unwrap().clear();
    assert!(try_alloc(128 * MIB).is_none());
    let after = memquota::stats();
    assert_eq!(after.reclaim_panics, before.reclaim_panics + 1);
    assert_eq!(after.ooms, before.ooms + 1);
    assert!(REPORTS.lock().unwrap()[0].contains("(callback panicked)"));
    assert!(try_alloc(MIB).is_some(), "the allocator still works");
}

fn futile_reclaims_are_suspended() {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    configure(64 * MIB);
    memquota::on_reclaim(|_| {
        CALLS.fetch_add(1, SeqCst);
    });
    let before = memquota::stats();
    let started = std::time::Instant::now();
    for _ in 0..50 {
        assert!(try_alloc(128 * MIB).is_none());
    }
    let after = memquota::stats();
    assert_eq!(after.ooms, before.ooms + 50);
    // Three futile reclaims, then a 250 ms suspension that doubles: on a very slow
    // machine one more may fit in per elapsed suspension.
    let calls = CALLS.load(SeqCst);
    let allowance = 3 + started.elapsed().as_millis() as usize / 250;
    println!("  {calls} reclaims for 50 refusals");
    assert!((3..=allowance).contains(&calls), "a GC storm: {calls} reclaims for 50 refusals");
    assert!(after.reclaims_throttled - before.reclaims_throttled >= 50 - allowance as u64);
    let last = memquota::last_report().unwrap();
    assert!(last.contains("suspended"), "{last}");
}

fn small_requests_overcommit_within_a_bound() {
    const LIMIT: usize = 64 * MIB;
    memquota::init(Config::new().limit(LIMIT as u64).soft_ratio(1.0).refuse_min(MIB as u64)).unwrap();
    let before = memquota::stats();
    let mut held = Vec::with_capacity(256);
    // Up to the limit with large blocks, then 512 KiB blocks (under refuse_min) past it.
    while let Some(v) = try_alloc(4 * MIB) {
        held.push(v);
    }
    // Under 4 MiB of room is left, so at most one 2 MiB block fits; 2 MiB is over
    // refuse_min, so no more are granted past the limit (the over-commit would give
    // two more).
    let mut mid = 0;
    while let Some(v) = try_alloc(2 * MIB) {
        held.push(v);
        mid += 1;
        assert!(mid <= 1, "2 MiB is over refuse_min: refused at the limit");
    }
    let mut small = 0;
    while let Some(v) = try_alloc(512 << 10) {
        held.push(v);
        small += 1;
        assert!(small < 1000, "over-commit is unbounded");
    }
    let after = memquota::stats();
    println!("  {small} small grants past the limit; over-commit {} bytes", after.overcommit);
    assert!(small >= 7, "a sixteenth of 64 MiB holds at least 7 blocks of 512 KiB");
    assert!(after.overcommit > 0 && after.overcommit <= (LIMIT / 16) as u64, "{}", after.overcommit);
    // The first few may still have fitted under the limit.
    let overcommits = after.overcommits - before.overcommits;
    assert!((7..=small).contains(&overcommits), "{overcommits} of {small}");
    assert_eq!(after.refuse_min, MIB as u64);
    drop(held);
}
