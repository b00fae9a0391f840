//! Task scopes through the real global allocator: the three shapes of work with exact
//! per-scope accounting after cross-thread frees, a task that ends while its helper
//! still allocates, leak reports, one account for reservations and allocations (and
//! for frees of memory allocated outside a scope),
//! Spark's spill order, and the fair share with 1 to 8 scopes.
//!
//! Harness-less and serial: scopes, limits and the report hook are process-wide.
//! Bookkeeping (vectors of pointers) is allocated before a thread attaches, so what
//! a scope is charged is exactly what the check allocated.

mod support;

use memquota::{Config, Error, MemoryManager, OnOom, QuotaAlloc, Reservation, ScopeHandle, ScopeStats};
use std::alloc::Layout;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Barrier, Mutex, OnceLock};
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

const MIB: u64 = 1 << 20;
const BIG: usize = 3 << 20;

fn mm() -> &'static MemoryManager {
    MemoryManager::global()
}

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, 8).unwrap()
}

fn alloc(size: usize) -> usize {
    // SAFETY: a non-zero size.
    let p = std::hint::black_box(unsafe { std::alloc::alloc(layout(size)) });
    assert!(!p.is_null());
    p as usize
}

fn free(p: usize, size: usize) {
    // SAFETY: `p` came from `alloc(size)`.
    unsafe { std::alloc::dealloc(p as *mut u8, layout(size)) }
}

/// A scope's figures, after flushing the calling thread.
fn stats(h: ScopeHandle) -> ScopeStats {
    memquota::flush_thread();
    mm().snapshot().scopes.into_iter().find(|s| s.handle == h.as_raw()).expect("scope is live")
}

/// Process native bytes as this thread sees them.
fn native() -> i64 {
    memquota::flush_thread();
    memquota::stats().native as i64
}

fn sum(blocks: &[(usize, usize)]) -> i64 {
    blocks.iter().map(|b| b.1 as i64).sum()
}

/// Polls a condition other threads will make true (no sleeping), failing after 30 s.
fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

static NOTES: Mutex<String> = Mutex::new(String::new());

fn capture(text: &str) {
    if let Ok(mut n) = NOTES.try_lock() {
        n.push_str(text);
    }
}

fn quiet(_: &str) {}

fn work_on_the_tasks_own_thread() {
    let scope = mm().begin("own-thread", 1, 0).unwrap();
    let h = scope.handle();
    let mut blocks = Vec::with_capacity(1100);
    let guard = scope.attach().unwrap();
    for i in 0..1000 {
        blocks.push((alloc(100 + i), 100 + i));
    }
    blocks.push((alloc(BIG), BIG));
    for (p, s) in blocks.drain(400..700) {
        free(p, s);
    }
    drop(guard);
    assert_eq!(stats(h).allocated, sum(&blocks), "exact after the guard settled the delta");
    assert_eq!(stats(h).threads, 0);
    assert_eq!(mm().current(), None);
    let guard = scope.attach().unwrap();
    assert_eq!(mm().current(), Some(h));
    for (p, s) in blocks.drain(..) {
        free(p, s);
    }
    drop(guard);
    let s = stats(h);
    assert_eq!(s.allocated, 0);
    assert!(s.peak >= 1000 * 100 + BIG as u64, "{s:?}");
    let report = scope.end();
    assert!(!report.is_leak(), "{report}");
}

fn helper_threads_and_cross_thread_frees() {
    let task = mm().begin("helpers", 2, 0).unwrap();
    let other = mm().begin("other", 3, 0).unwrap();
    let h = task.handle();
    let helper = |h: ScopeHandle, n: usize| {
        std::thread::spawn(move || {
            let mut v = Vec::with_capacity(n + 4);
            let _g = h.attach().unwrap();
            for _ in 0..4 {
                v.push((alloc(BIG), BIG));
            }
            for i in 0..n {
                v.push((alloc(64 + i), 64 + i));
            }
            v
        })
    };
    let mut blocks = helper(h, 200).join().unwrap();
    blocks.extend(helper(h, 300).join().unwrap());
    assert_eq!(stats(h).allocated, sum(&blocks));
    let (big, small): (Vec<_>, Vec<_>) = blocks.into_iter().partition(|b| b.1 == BIG);
    // The main thread, in no scope, frees two big blocks: their owner records credit
    // the task. A thread of another scope frees the other two: the same.
    for &(p, s) in &big[..2] {
        free(p, s);
    }
    assert_eq!(stats(h).allocated, sum(&small) + (big.len() as i64 - 2) * BIG as i64);
    let g = other.attach().unwrap();
    for &(p, s) in &big[2..] {
        free(p, s);
    }
    drop(g);
    assert_eq!(stats(h).allocated, sum(&small));
    assert_eq!(stats(other.handle()).allocated, 0, "big frees never credit the freeing scope");
    // Another helper of the task frees the small blocks (and then, detached, the
    // vector the main thread allocated: a small block credits the freeing thread's
    // scope).
    std::thread::spawn(move || {
        let g = h.attach().unwrap();
        for &(p, s) in &small {
            free(p, s);
        }
        drop(g);
        drop(small);
    })
    .join()
    .unwrap();
    assert_eq!(stats(h).allocated, 0);
    assert!(!task.end().is_leak());
    assert!(!other.end().is_leak());
}

fn work_outside_any_task_in_a_short_lived_scope() {
    let before = native();
    for round in 0..3u64 {
        let scope = mm().begin("driver-conversion", 100 + round, 0).unwrap();
        let g = scope.attach().unwrap();
        // Over the thread's slack, so the peak is seen (it is sampled at flushes).
        let rows: Vec<u64> = (0..200_000).collect();
        let text = format!("{rows:?}");
        assert!(text.len() > 200_000);
        drop((rows, text));
        drop(g);
        let report = scope.end();
        assert!(!report.is_leak(), "{report}");
        assert!(report.peak >= 1_600_000, "{report:?}");
    }
    assert_eq!(native(), before, "the process account is exact too");
}

fn a_task_ends_while_its_helper_still_allocates() {
    let before = native();
    let task = mm().begin("ending", 4, 0).unwrap();
    let h = task.handle();
    let sync = Arc::new(Barrier::new(2));
    let s2 = Arc::clone(&sync);
    let helper = std::thread::spawn(move || {
        let mut v = Vec::with_capacity(8);
        let g = h.attach().unwrap();
        v.push((alloc(1000), 1000));
        v.push((alloc(BIG), BIG));
        memquota::flush_thread();
        s2.wait(); // the task ends now
        s2.wait();
        for i in 0..2000 {
            let p = alloc(512 + i);
            free(p, 512 + i);
        }
        v.push((alloc(BIG), BIG));
        v.push((alloc(5000), 5000));
        memquota::flush_thread();
        s2.wait(); // checked
        s2.wait();
        for (p, s) in v {
            free(p, s);
        }
        drop(g); // detaching from an ended scope is harmless
    });
    sync.wait();
    let report = task.end();
    assert_eq!(report.threads, 1, "{report}");
    assert_eq!(report.leaked_bytes, 1000 + BIG as u64, "{report}");
    assert!(!h.is_live());
    let fresh = mm().begin("fresh", 5, 0).unwrap();
    sync.wait();
    sync.wait();
    assert_eq!(stats(fresh.handle()).allocated, 0, "an ended scope's helper charges nobody else");
    sync.wait();
    helper.join().unwrap();
    assert_eq!(stats(fresh.handle()).allocated, 0);
    assert!(!fresh.end().is_leak());
    drop((report, sync));
    assert_eq!(native(), before, "what the ended task left went to the process and came back exactly");
}

fn leak_reports_name_what_is_still_held() {
    let before = native();
    let scope = mm().begin("leaky", 6, 0).unwrap();
    let sorter = scope.consumer("sorter", |_| 0).unwrap();
    std::mem::forget(sorter.reserve(MIB).unwrap());
    let g = scope.attach().unwrap();
    let p = alloc(300_000);
    drop(g);
    let report = scope.end();
    assert_eq!(report.leaked_bytes, 300_000);
    assert_eq!(report.reserved, MIB);
    assert_eq!(report.consumers.len(), 1);
    assert_eq!((report.consumers[0].name.as_str(), report.consumers[0].used), ("sorter", MIB));
    let text = report.to_string();
    assert!(text.contains("\"leaky\" (id 6)") && text.contains("managed memory leak detected"), "{text}");
    assert!(text.contains("consumer \"sorter\" holds 1.0 MiB"), "{text}");
    drop((report, text));
    // The leak is the process's now; the unused reservation is gone.
    assert_eq!(native() - before, 300_000);
    free(p, 300_000);
    assert_eq!(native(), before);
    let after = mm().snapshot();
    assert!(after.leaked_bytes >= 300_000);

    // Dropped without `end`: the report goes to the hook.
    let old = memquota::set_report_hook(capture);
    let scope = mm().begin("dropped", 7, 0).unwrap();
    let g = scope.attach().unwrap();
    let q = alloc(4096);
    drop(g);
    drop(scope);
    memquota::set_report_hook(old);
    free(q, 4096);
    let notes = std::mem::take(&mut *NOTES.lock().unwrap());
    assert!(notes.contains("\"dropped\" (id 7) ended; managed memory leak detected: 4.0 KiB"), "{notes}");
}

fn reservations_and_allocations_share_one_account() {
    let scope = mm().begin("reserving", 8, 0).unwrap();
    let h = scope.handle();
    let mut blocks = Vec::with_capacity(4);
    let n0 = native();
    let r = scope.reserve(10 * MIB).unwrap();
    assert_eq!(native() - n0, 10 << 20);
    let g = scope.attach().unwrap();
    blocks.push((alloc(4 << 20), 4 << 20));
    memquota::flush_thread();
    assert_eq!(native() - n0, 10 << 20, "the allocation used the reservation");
    blocks.push((alloc(8 << 20), 8 << 20));
    memquota::flush_thread();
    assert_eq!(native() - n0, 12 << 20, "only what passes the reservation is new");
    drop(g);
    let s = stats(h);
    assert_eq!((s.allocated, s.reserved, s.held), (12 << 20, 10 * MIB, 12 * MIB));
    drop((s, r));
    assert_eq!(native() - n0, 12 << 20, "releasing a used-up reservation costs nothing");
    let g = scope.attach().unwrap();
    for &(p, s) in &blocks {
        free(p, s);
    }
    drop(g);
    assert_eq!(native(), n0);
    assert_eq!(stats(h).held, 0);
    drop(blocks);
    assert!(!scope.end().is_leak());
}

static LOG: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// A consumer holding one reservation that its spill gives back whole.
fn spillable(scope: &memquota::TaskScope, name: &'static str, bytes: u64) -> memquota::Consumer {
    let held: Arc<Mutex<Option<Reservation>>> = Arc::new(Mutex::new(None));
    let h2 = Arc::clone(&held);
    let c = scope
        .consumer(name, move |_target| {
            LOG.lock().unwrap().push(name);
            h2.lock().unwrap().take().map_or(0, |r| r.bytes())
        })
        .unwrap();
    *held.lock().unwrap() = Some(c.reserve(bytes).unwrap());
    c
}

/// A value a spill callback captures that panics when dropped.
struct PanicsOnDrop;

impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        panic!("a spill callback's value panicked in Drop, on purpose");
    }
}

static SELF_UNREGISTERING: OnceLock<memquota::Consumer> = OnceLock::new();

/// A callback that unregisters its own consumer leaves the spill that runs it the last
/// holder: its captured values drop there, inside a request (in the allocator's slow
/// path, for an attached thread's allocation). A panic in their `Drop` is caught, as a
/// panic in the callback is.
fn a_spill_callbacks_values_that_panic_in_drop_never_unwind_out_of_a_request() {
    memquota::set_report_hook(quiet);
    let scope = mm().begin("drop-panic", 41, 0).unwrap();
    scope.set_cap(Some(64 * MIB));
    let held: Arc<Mutex<Option<Reservation>>> = Arc::new(Mutex::new(None));
    let h2 = Arc::clone(&held);
    let value = PanicsOnDrop;
    let c = scope
        .consumer("self-unregistering", move |_target| {
            let _ = &value;
            if let Some(me) = SELF_UNREGISTERING.get() {
                me.unregister();
            }
            h2.lock().unwrap().take().map_or(0, |r| r.bytes())
        })
        .unwrap();
    SELF_UNREGISTERING.set(c).unwrap();
    *held.lock().unwrap() = Some(c.reserve(40 * MIB).unwrap());
    let asked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| scope.reserve(40 * MIB)));
    let granted = asked.expect("the Drop's panic unwound out of the request");
    let r = granted.expect("granted once the spill gave its 40 MiB back");
    assert_eq!(r.bytes(), 40 * MIB);
    drop(r);
    assert!(!scope.end().is_leak());
}

fn spill_order_and_counts() {
    memquota::set_report_hook(quiet);
    // Same scope: the smallest that covers the gap, else the largest.
    let a = mm().begin("spill-a", 9, 0).unwrap();
    a.set_cap(Some(100 * MIB));
    let a1 = spillable(&a, "a1", 10 * MIB);
    let a2 = spillable(&a, "a2", 30 * MIB);
    let a3 = spillable(&a, "a3", 50 * MIB);
    LOG.lock().unwrap().clear();
    let r1 = a.reserve(35 * MIB).unwrap();
    assert_eq!(*LOG.lock().unwrap(), ["a2"]);
    let r2 = a.reserve(60 * MIB).unwrap();
    assert_eq!(*LOG.lock().unwrap(), ["a2", "a3", "a1"]);
    for c in [a1, a2, a3] {
        let s = c.stats().unwrap();
        assert_eq!((s.spills, s.used), (1, 0), "{s:?}");
    }
    assert_eq!(a2.stats().unwrap().spilled_bytes, 30 << 20);
    assert!(a.reserve(10 * MIB).is_err(), "nothing left to spill: refused");
    // The OOM report names the scope tree: scopes, then consumers, current and peak.
    let report = memquota::last_report().unwrap();
    assert!(report.contains("refused for scope \"spill-a\" (id 9)"), "{report}");
    assert!(report.contains("scope \"spill-a\" id 9 prio 0: held 95.0 MiB"), "{report}");
    assert!(report.contains("consumer \"a3\": 0 B (peak 50.0 MiB (52428800)), spilled 1 times"), "{report}");
    drop((r1, r2));

    // The requester itself comes last in its scope.
    let b = mm().begin("spill-b", 10, 0).unwrap();
    b.set_cap(Some(40 * MIB));
    let _b1 = spillable(&b, "b1", 10 * MIB);
    let r = spillable(&b, "r", 20 * MIB);
    LOG.lock().unwrap().clear();
    let got = r.reserve(25 * MIB).unwrap();
    assert_eq!(*LOG.lock().unwrap(), ["b1", "r"]);
    assert_eq!(r.stats().unwrap().used, 25 << 20);
    drop(got);

    // Then other scopes' consumers, lowest priority first, when the process is short.
    let c = mm().begin("spill-c", 11, 0).unwrap();
    let d = mm().begin("spill-d", 12, 5).unwrap();
    let c1 = spillable(&c, "c1", 40 * MIB);
    // c1's 40 MiB are in the account already: d's 40 do not fit under 20 more. The
    // pool is set apart from the limit so that the share is not what binds.
    mm().set_pool(1 << 30);
    memquota::set_limit(native() as u64 + 20 * MIB);
    LOG.lock().unwrap().clear();
    let got = d.reserve(40 * MIB);
    memquota::set_limit(1 << 50);
    mm().set_pool(0);
    assert!(got.is_ok(), "{got:?}");
    assert_eq!(*LOG.lock().unwrap(), ["c1"]);
    assert_eq!(c1.stats().unwrap().spills, 1);
    drop(got);
    for s in [a, b, c, d] {
        s.end();
    }
    assert!(mm().snapshot().spills >= 6);
    memquota::set_report_hook(memquota::seam::text::write_stderr);
}

fn a_spill_callback_must_not_reserve() {
    let old = memquota::set_report_hook(capture);
    let scope = mm().begin("greedy-spill", 13, 0).unwrap();
    scope.set_cap(Some(10 * MIB));
    let h = scope.handle();
    let seen: Arc<Mutex<Option<memquota::Result<Reservation>>>> = Arc::new(Mutex::new(None));
    let s2 = Arc::clone(&seen);
    let c = scope.consumer("cheat", move |_| {
        *s2.lock().unwrap() = Some(h.reserve(MIB));
        0
    });
    let c = c.unwrap();
    let _held = c.reserve(8 * MIB).unwrap();
    let before = mm().snapshot().reserve_in_spill;
    assert!(scope.reserve(4 * MIB).is_err());
    memquota::set_report_hook(old);
    let got = seen.lock().unwrap().take();
    assert!(matches!(got, Some(Err(Error::ReserveInSpill { requested })) if requested == MIB), "{got:?}");
    assert_eq!(mm().snapshot().reserve_in_spill, before + 1);
    let notes = std::mem::take(&mut *NOTES.lock().unwrap());
    assert!(notes.contains("a spill or reclaim callback tried to reserve 1048576 bytes"), "{notes}");
    drop(_held);
    scope.end();
}

fn fair_share_with_1_to_8_scopes() {
    const POOL: u64 = 840 * MIB; // divisible by 1..=8
    mm().set_pool(POOL);
    mm().set_wait(Duration::from_secs(30));
    memquota::set_report_hook(quiet);
    for n in 1..=8u64 {
        // Greedy: every scope takes 1 MiB at a time until refused; each ends with
        // exactly its share, none more, none starved.
        let scopes: Vec<_> = (0..n).map(|i| mm().begin("greedy", i, 0).unwrap()).collect();
        let threads: Vec<_> = scopes
            .iter()
            .map(|s| {
                let h = s.handle();
                std::thread::spawn(move || {
                    let mut got = Vec::with_capacity(900);
                    while let Ok(r) = h.reserve(MIB) {
                        got.push(r);
                    }
                    got
                })
            })
            .collect();
        let held: Vec<Vec<Reservation>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for (s, got) in scopes.iter().zip(&held) {
            assert_eq!(got.len() as u64 * MIB, POOL / n, "n = {n}");
            assert_eq!(s.stats().unwrap().held, POOL / n);
        }
        drop(held);
        for s in scopes {
            s.end();
        }

        if n == 1 {
            continue;
        }
        // Waiting: one scope took the whole pool while alone; the n - 1 that come
        // after are below their minimum share and wait, and wake when it frees.
        let first = mm().begin("first", 0, 0).unwrap();
        let all = first.reserve(POOL).unwrap();
        let waits0 = mm().snapshot().waits;
        let late: Vec<_> = (1..n).map(|i| mm().begin("late", i, 0).unwrap()).collect();
        let want = POOL / (2 * n);
        let threads: Vec<_> = late
            .iter()
            .map(|s| {
                let h = s.handle();
                std::thread::spawn(move || h.reserve(want))
            })
            .collect();
        until("every late scope to wait", || mm().snapshot().waits >= waits0 + n - 1);
        for s in &late {
            assert_eq!(s.stats().unwrap().held, 0, "nothing granted while the pool is full");
        }
        drop(all); // wakes them
        let got: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for (s, r) in late.iter().zip(&got) {
            assert_eq!(r.as_ref().map(|r| r.bytes()).ok(), Some(want), "n = {n}");
            let st = s.stats().unwrap();
            assert!(st.waits >= 1 && st.held <= POOL / n, "{st:?}");
        }
        drop(got);
        for s in late {
            s.end();
        }
        first.end();
    }
    memquota::set_report_hook(memquota::seam::text::write_stderr);
    mm().set_pool(0);
    mm().set_wait(Duration::from_secs(2));
}

fn an_allocation_waits_for_its_share_and_wakes_on_free() {
    const POOL: u64 = 64 * MIB;
    mm().set_pool(POOL);
    mm().set_wait(Duration::from_secs(30));
    let first = mm().begin("first", 1, 0).unwrap();
    let all = first.reserve(POOL).unwrap();
    let late = mm().begin("late", 2, 0).unwrap();
    let h = late.handle();
    let waits0 = late.stats().unwrap().waits;
    // An attached thread's big allocation reaches the slow path, finds the pool full
    // while its scope holds nothing (below 1/2N), and waits inside the allocator.
    let t = std::thread::spawn(move || {
        let g = h.attach().unwrap();
        let p = alloc(8 << 20);
        drop(g);
        p
    });
    until("the allocation to wait", || late.stats().unwrap().waits > waits0);
    assert_eq!(late.stats().unwrap().allocated, 0);
    drop(all); // a free wakes it
    let p = t.join().unwrap();
    assert_eq!(late.stats().unwrap().allocated, 8 << 20);
    free(p, 8 << 20); // on a thread in no scope: the owner record credits `late`
    assert_eq!(late.stats().unwrap().allocated, 0);
    first.end();
    late.end();
    mm().set_pool(0);
    mm().set_wait(Duration::from_secs(2));
}

fn vectors_grown_by_realloc_are_credited_wherever_freed() {
    let a = mm().begin("grower", 1, 0).unwrap();
    let b = mm().begin("mover", 2, 0).unwrap();
    let g = a.attach().unwrap();
    let mut v: Vec<u8> = Vec::new();
    for i in 0..(6 << 20) {
        v.push(i as u8); // doubling reallocs: small, then past 2 MiB with a record
    }
    drop(g);
    let cap = v.capacity() as i64;
    assert_eq!(stats(a.handle()).allocated, cap);
    // Freed on a thread in no scope: the record credits the scope that grew it.
    std::thread::spawn(move || drop(v)).join().unwrap();
    assert_eq!(stats(a.handle()).allocated, 0);

    // A big block reallocated by a thread of another scope moves there with it.
    let g = a.attach().unwrap();
    let p = alloc(BIG);
    drop(g);
    let g = b.attach().unwrap();
    // SAFETY: `p` came from `alloc(BIG)`.
    let q = unsafe { std::alloc::realloc(p as *mut u8, layout(BIG), 2 * BIG) } as usize;
    drop(g);
    assert_eq!((stats(a.handle()).allocated, stats(b.handle()).allocated), (0, 2 * BIG as i64));
    free(q, 2 * BIG);
    assert_eq!(stats(b.handle()).allocated, 0);
    a.end();
    b.end();
}

fn a_thread_that_exits_attached_leaves_its_scope() {
    // What the thread runtime frees on a thread after its closure (the closure's box,
    // allocated by the spawning thread) is credited to the scope the thread is still
    // in: the small-block rule. Measure it with a thread that does nothing else but
    // keep a block of its own (a credit past the scope's use would go to the process).
    const KEPT: usize = 4096;
    let baseline = mm().begin("baseline", 1, 0).unwrap();
    let hb = baseline.handle();
    let kept = std::thread::spawn(move || {
        std::mem::forget(hb.attach().unwrap());
        alloc(KEPT)
    })
    .join()
    .unwrap();
    let runtime = stats(hb).allocated - KEPT as i64;
    assert!((-256..=0).contains(&runtime), "{runtime}");
    baseline.end();
    free(kept, KEPT);

    let scope = mm().begin("exiting", 1, 0).unwrap();
    let h = scope.handle();
    std::thread::spawn(move || {
        std::mem::forget(h.attach().unwrap()); // never detached
        let p = alloc(1000);
        free(p, 1000);
        let _leaked = alloc(2000); // never freed: flushed at thread exit
    })
    .join()
    .unwrap();
    let s = stats(h);
    assert_eq!((s.threads, s.allocated), (0, 2000 + runtime), "the exit flush settled it");
    assert_eq!(scope.end().leaked_bytes as i64, 2000 + runtime);
}

/// The guard in a late destructor was dropped after the exit flush (the thread had no
/// slack left).
static LATE_AFTER_THE_EXIT_FLUSH: AtomicBool = AtomicBool::new(false);

/// A thread-specific-data key whose destructor drops the `AttachGuard` its value holds:
/// glibc runs such destructors after every thread-local destructor, memquota's exit
/// flush among them, as a C library's clean-up of a thread would.
fn late_key() -> libc::pthread_key_t {
    static KEY: OnceLock<libc::pthread_key_t> = OnceLock::new();
    *KEY.get_or_init(|| {
        let mut key = 0;
        // SAFETY: `key` is a valid out-pointer; the destructor has the signature asked for.
        assert_eq!(unsafe { libc::pthread_key_create(&mut key, Some(drop_late_guard)) }, 0);
        key
    })
}

extern "C" fn drop_late_guard(value: *mut libc::c_void) {
    // Past its exit flush a thread has no slack: a charge is flushed at once.
    memquota::flush_thread();
    let probe = std::hint::black_box(Box::new([0u8; 100]));
    LATE_AFTER_THE_EXIT_FLUSH.store(memquota::thread_pending() == 0, SeqCst);
    drop(probe);
    // SAFETY: the key's values are only ever `Box<AttachGuard>`s leaked on this thread.
    drop(unsafe { Box::from_raw(value.cast::<memquota::AttachGuard>()) });
}

/// Issue 30, item 5: a thread attached to S for its life moves to T with a guard that
/// a thread-specific-data destructor drops after memquota's exit flush. The guard's drop must
/// not put the dead thread back into S: S would count a thread for ever, stay busy, and
/// narrow every other scope's fair share.
fn a_guard_dropped_after_the_exit_flush_leaves_no_thread_attached() {
    memquota::set_report_hook(quiet);
    mm().set_pool(100 * MIB);
    let s = mm().begin("attached for life", 1, 0).unwrap();
    let t = mm().begin("late guard", 2, 0).unwrap();
    let (hs, ht) = (s.handle(), t.handle());
    std::thread::spawn(move || {
        std::mem::forget(hs.attach().unwrap());
        let p = alloc(1000);
        free(p, 1000);
        let late = Box::into_raw(Box::new(ht.attach().unwrap()));
        // SAFETY: the key exists; its destructor takes the box back.
        assert_eq!(unsafe { libc::pthread_setspecific(late_key(), late.cast()) }, 0);
    })
    .join()
    .unwrap();
    let after_flush = LATE_AFTER_THE_EXIT_FLUSH.load(SeqCst);
    let (ss, ts) = (stats(hs), stats(ht));
    t.end();
    let asker = mm().begin("asker", 3, 0).unwrap();
    let got = asker.reserve_up_to(80 * MIB).unwrap().bytes();
    println!(
        "  guard dropped after the exit flush: {after_flush}; threads attached: S {}, T {}; \
         a new scope's share of 100 MiB: {} MiB",
        ss.threads,
        ts.threads,
        got / MIB
    );
    assert!(after_flush, "the precondition: the guard dropped after the exit flush");
    assert_eq!((ss.threads, ts.threads), (0, 0), "the dead thread is attached nowhere");
    assert_eq!(got, 80 * MIB, "S is idle: it does not narrow the share");
    asker.end();
    s.end();
    mm().set_pool(0);
    memquota::set_report_hook(memquota::seam::text::write_stderr);
}

fn a_refused_reservation_never_aborts() {
    // Under MEMQUOTA_ON_OOM=abort a refused allocation aborts; a refused reservation
    // returns its error (with a report), at the scope level and the process level.
    memquota::init(Config::new().limit(1 << 50).on_oom(OnOom::Abort)).unwrap();
    memquota::set_report_hook(quiet);
    let scope = mm().begin("no-abort", 1, 0).unwrap();
    scope.set_cap(Some(MIB));
    let ooms = memquota::stats().ooms;
    assert!(matches!(scope.reserve(2 * MIB), Err(Error::Refused { requested }) if requested == 2 * MIB));
    scope.set_cap(None);
    memquota::set_limit(native() as u64 + MIB);
    let got = scope.reserve(64 * MIB);
    memquota::init(Config::new().limit(1 << 50)).unwrap();
    memquota::set_report_hook(memquota::seam::text::write_stderr);
    assert!(matches!(got, Err(Error::Refused { .. })), "{got:?}");
    assert_eq!(memquota::stats().ooms, ooms + 2, "both counted and reported");
    scope.end();
}

fn partial_grants_for_explicit_reservations() {
    memquota::set_report_hook(quiet);
    mm().set_pool(100 * MIB);
    let a = mm().begin("partial-a", 1, 0).unwrap();
    let b = mm().begin("partial-b", 2, 0).unwrap();
    let r = a.reserve_up_to(80 * MIB).unwrap();
    assert_eq!(r.bytes(), 50 * MIB, "half the pool each");
    assert!(a.reserve(1).is_err() || a.stats().unwrap().held <= 50 * MIB);
    let rb = b.reserve_up_to(20 * MIB).unwrap();
    assert_eq!(rb.bytes(), 20 * MIB);
    drop((r, rb));
    a.end();
    b.end();
    mm().set_pool(0);
    memquota::set_report_hook(memquota::seam::text::write_stderr);
}

fn an_engine_pool_reads_the_account_and_grows_unchecked() {
    // What memquota-datafusion's pool stands on: a cheap account with the share, the
    // process budget, a reservation grown with no admission, and the report's figures
    // written on demand without counting a refusal.
    memquota::set_report_hook(quiet);
    mm().set_pool(100 * MIB);
    let a = mm().begin("engine-a", 1, 0).unwrap();
    let b = mm().begin("engine-b", 2, 0).unwrap();
    let (h, n0) = (a.handle(), native());
    let acc = h.account().unwrap();
    assert_eq!((acc.held, acc.allocated, acc.reserved, acc.share), (0, 0, 0, 50 * MIB));
    let mut r = a.reserve(0).unwrap();
    r.grow_unchecked(10 * MIB);
    assert_eq!(native() - n0, 10 << 20, "counted in the process at once");
    assert_eq!(b.handle().account().unwrap().share, 50 * MIB, "both compete");
    // Covered by allocations: the account grows by what passes the reservation only.
    let g = a.attach().unwrap();
    let p = alloc(BIG + (8 << 20));
    memquota::flush_thread();
    drop(g);
    let acc = h.account().unwrap();
    assert_eq!((acc.reserved, acc.allocated), (10 * MIB, BIG as i64 + (8 << 20)));
    assert_eq!(acc.held, BIG as u64 + 8 * MIB);
    assert_eq!(native() - n0, acc.held as i64);
    // Past the share and the limit alike: never refused, never waiting, never reported.
    let ooms = memquota::stats().ooms;
    let limit = native() as u64 + MIB;
    memquota::set_limit(limit);
    r.grow_unchecked(200 * MIB);
    let account = memquota::process_account();
    assert_eq!(
        (account.headroom, account.limit, account.native),
        (0, limit, native() as u64),
        "past the limit"
    );
    let acc = h.account().unwrap();
    assert_eq!((acc.reserved, acc.held), (210 * MIB, 210 * MIB));
    assert!(memquota::stats().overcommit > 0);
    let figures = memquota::report_now();
    assert!(figures.contains("  limit ") && figures.contains("\"engine-a\""), "{figures}");
    assert!(!figures.contains("allocation refused"), "{figures}");
    assert_eq!(memquota::stats().ooms, ooms, "figures on demand are no refusal");
    drop((figures, r));
    memquota::set_limit(1 << 50);
    let account = memquota::process_account();
    assert_eq!(account.headroom, (1 << 50) - account.native - account.outside);
    assert_eq!(native() - n0, BIG as i64 + (8 << 20), "released down to the allocations");
    let g = a.attach().unwrap();
    free(p, BIG + (8 << 20));
    drop(g);
    assert_eq!(native(), n0);
    assert_eq!(b.handle().account().unwrap().share, 100 * MIB, "a finished scope does not compete");
    assert!(!a.end().is_leak());
    assert_eq!(h.account(), None, "an ended scope has no account");
    b.end();
    mm().set_pool(0);
    memquota::set_report_hook(memquota::seam::text::write_stderr);
}

/// Who shares the pool: a scope counts from its begin (tasks that start together share
/// from the start) until it is idle after it started work (its memory released, no
/// thread attached), as a Spark task leaves its pool when it releases its memory.
fn a_finished_scope_no_longer_narrows_the_share() {
    memquota::set_report_hook(quiet);
    mm().set_pool(100 * MIB);
    let done = mm().begin("done", 1, 0).unwrap();
    let b = mm().begin("running", 2, 0).unwrap();
    // Begun, nothing done yet: it counts.
    let r = b.reserve_up_to(80 * MIB).unwrap();
    assert_eq!(r.bytes(), 50 * MIB, "a scope that has not started work still counts");
    drop(r);
    // Its work done: held, then released.
    drop(done.reserve(10 * MIB).unwrap());
    let r = b.reserve_up_to(80 * MIB).unwrap();
    assert_eq!(r.bytes(), 80 * MIB, "a finished scope does not count");
    drop(r);
    // A thread attached to it again: it counts again, holding nothing.
    {
        let _g = done.attach().unwrap();
        let r = b.reserve_up_to(80 * MIB).unwrap();
        assert_eq!(r.bytes(), 50 * MIB, "a scope with a thread attached counts");
    }
    // When it asks, it counts: half the pool while the other holds half.
    let rb = b.reserve(50 * MIB).unwrap();
    let r = done.reserve_up_to(80 * MIB).unwrap();
    assert_eq!(r.bytes(), 50 * MIB, "the scope that asks counts");
    drop((r, rb));
    done.end();
    b.end();
    mm().set_pool(0);
    memquota::set_report_hook(memquota::seam::text::write_stderr);
}

/// Memory allocated outside any scope and freed by a scope's thread (in DataFusion,
/// a plan built before the query, dropped inside its scope): the free credits the
/// process, whatever the scope reserved. The process account must equal the true
/// bytes: before, the scope's use went 50 MiB below zero, its next 50 MiB refilled
/// it, and the account read 150 MiB against a true 100 MiB while the reservation
/// lived. The same under a budget, whose grant hid the free at once.
fn frees_of_memory_allocated_outside_a_scope_credit_the_process() {
    const BLOCK: usize = 64 << 10; // small: no owner record
    const OUTSIDE: usize = 800; // 50 MiB
                                // The unflushed deltas of other threads (the sampler's) at most.
    const ERROR: i64 = 1 << 20;
    let near = |what: &str, got: i64, want: i64| {
        assert!(
            (got - want).abs() <= ERROR,
            "{what}: the account reads {:.1} MiB past the start against a true {:.1} MiB",
            got as f64 / MIB as f64,
            want as f64 / MIB as f64
        );
    };
    for under_a_budget in [false, true] {
        let mut outside = Vec::with_capacity(OUTSIDE);
        let n0 = native();
        outside.extend((0..OUTSIDE).map(|_| alloc(BLOCK)));
        near("allocated outside", native() - n0, 50 << 20);
        let scope = mm().begin("frees-outside", 1, 0).unwrap();
        // The reservation, or the budget's grant: 100 MiB held for what comes.
        let (r, budget) = if under_a_budget {
            (None, Some(scope.budget(100 * MIB).unwrap()))
        } else {
            (Some(scope.reserve(100 * MIB).unwrap()), None)
        };
        near("reserved", native() - n0, 150 << 20);
        let g = match &budget {
            Some(b) => b.attach().unwrap(),
            None => scope.attach().unwrap(),
        };
        for &p in &outside {
            free(p, BLOCK);
        }
        memquota::flush_thread();
        near("the outside blocks freed in the scope", native() - n0, 100 << 20);
        let big = alloc(100 << 20);
        drop(g);
        near("100 MiB allocated in the scope", native() - n0, 100 << 20);
        let s = stats(scope.handle());
        assert_eq!((s.allocated, s.held), (100 << 20, 100 * MIB), "the scope holds what it allocated");
        free(big, 100 << 20); // its owner record credits the scope
        drop((r, budget));
        near("all freed", native() - n0, 0);
        assert!(!scope.end().is_leak());
        drop(outside);
    }
}

fn main() {
    // Its checks compare the process account exactly: start from a quiet sampler.
    let first = Box::new(0u64); // an allocation starts the sampler
    drop(std::hint::black_box(first));
    support::wait_for_sampler();
    support::run(&[
        ("a_finished_scope_no_longer_narrows_the_share", a_finished_scope_no_longer_narrows_the_share),
        (
            "a_spill_callbacks_values_that_panic_in_drop_never_unwind_out_of_a_request",
            a_spill_callbacks_values_that_panic_in_drop_never_unwind_out_of_a_request,
        ),
        ("work_on_the_tasks_own_thread", work_on_the_tasks_own_thread),
        ("helper_threads_and_cross_thread_frees", helper_threads_and_cross_thread_frees),
        ("work_outside_any_task_in_a_short_lived_scope", work_outside_any_task_in_a_short_lived_scope),
        ("a_task_ends_while_its_helper_still_allocates", a_task_ends_while_its_helper_still_allocates),
        ("leak_reports_name_what_is_still_held", leak_reports_name_what_is_still_held),
        ("reservations_and_allocations_share_one_account", reservations_and_allocations_share_one_account),
        ("spill_order_and_counts", spill_order_and_counts),
        ("a_spill_callback_must_not_reserve", a_spill_callback_must_not_reserve),
        ("fair_share_with_1_to_8_scopes", fair_share_with_1_to_8_scopes),
        (
            "an_allocation_waits_for_its_share_and_wakes_on_free",
            an_allocation_waits_for_its_share_and_wakes_on_free,
        ),
        (
            "vectors_grown_by_realloc_are_credited_wherever_freed",
            vectors_grown_by_realloc_are_credited_wherever_freed,
        ),
        ("a_thread_that_exits_attached_leaves_its_scope", a_thread_that_exits_attached_leaves_its_scope),
        (
            "a_guard_dropped_after_the_exit_flush_leaves_no_thread_attached",
            a_guard_dropped_after_the_exit_flush_leaves_no_thread_attached,
        ),
        ("a_refused_reservation_never_aborts", a_refused_reservation_never_aborts),
        (
            "frees_of_memory_allocated_outside_a_scope_credit_the_process",
            frees_of_memory_allocated_outside_a_scope_credit_the_process,
        ),
        ("partial_grants_for_explicit_reservations", partial_grants_for_explicit_reservations),
        (
            "an_engine_pool_reads_the_account_and_grows_unchecked",
            an_engine_pool_reads_the_account_and_grows_unchecked,
        ),
    ]);
    assert!(memquota::seam::scopes::OWNED_MIN <= BIG as u64);
}
