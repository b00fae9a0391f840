//! Allocator overhead: `QuotaAlloc<Jemalloc>` against bare jemalloc and the system
//! allocator, measured in the same run.
//!
//!     cargo bench --bench alloc                       # full run, about 30 s
//!     MEMQUOTA_BENCH_QUICK=1 cargo bench --bench alloc # smoke run, seconds
//!     cargo bench --bench alloc -- mixed              # only workloads whose name contains "mixed"
//!
//! A custom harness (`harness = false`), on purpose: the three allocators are called
//! directly through `GlobalAlloc` on static instances, from one generic workload
//! function per workload, so each allocator gets its own monomorphised copy of the
//! loop (no dynamic dispatch hiding the fraction of a nanosecond the quota ledger
//! adds). The allocators are run interleaved, J Q S, Q S J, S J Q, ..., for several
//! rounds, and the median of each is compared: on a shared, noisy machine only ratios
//! within one run mean anything, never absolute times.
//!
//! ns/op is the wall time of a run divided by the operations one thread performs, so
//! perfect scaling from 1 to 2 threads shows the same ns/op.
//!
//! Environment:
//! * `MEMQUOTA_BENCH_QUICK=1`: a twentieth of the operations and 3 rounds (smoke test).
//! * `MEMQUOTA_BENCH_ROUNDS=N`: rounds per allocator (default 7, quick 3).
//! * `MEMQUOTA_BENCH_DIVIDE=N`: 1/N of the operations (quick: 20).
//! * `MEMQUOTA_BENCH_THREADS=N`: only this thread count (default: 1, then 2).
//! * `MEMQUOTA_BENCH_ONLY=J|Q|S|QS`: profiling mode: one run of one allocator per
//!   workload, no comparison (for `perf stat` / `perf record`); QS is Q with the
//!   threads attached to a task scope.
//! * `MEMQUOTA_BENCH_CLOCK=cpu`: time each run by its threads' CPU time (the largest
//!   of them) instead of wall time: on a machine other jobs load, a thread's time off
//!   the CPU then does not count. Cache and scheduler effects of the other jobs still do.
//! * `MEMQUOTA_BENCH_SHIM=1`: call each allocator through `#[inline(never)]` functions,
//!   the way a program reaches its `#[global_allocator]` (`__rust_alloc` and
//!   `__rg_alloc` are calls unless cross-crate LTO inlines them), instead of inlining
//!   its methods into the workload loops. Inlined, a wrapper's branches change how the
//!   loop around them is scheduled and its registers allocated: a `QuotaAlloc` whose
//!   checks always pass and touch no memory measured 1.04x bare jemalloc there.
//! * `MEMQUOTA_BENCH_SCOPES=0|only`: skip, or run only, the second table, scope
//!   attribution: the same `QuotaAlloc` with its threads in no scope (Q) and attached
//!   to a task scope (QS), interleaved in the same way. Target: QS/Q <= 1.03.
//!
//! Not run in CI: it takes minutes and its numbers are only meaningful side by side.

use memquota::{Config, Jemalloc, MemoryManager, QuotaAlloc, ScopeHandle};
use std::alloc::{handle_alloc_error, GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

// The bench binary keeps Rust's default global allocator (the system one) on purpose.
// Everything measured goes through the statics below, called directly; the harness's
// own allocations (threads, ring arrays, queues, result tables) all happen outside the
// timed regions, and with the default allocator they never touch jemalloc's arenas and
// thread caches nor the quota ledger, so the J and Q runs see exactly the workload's
// traffic and nothing else. Making the global allocator `QuotaAlloc` would not change
// what Q measures (the statics bypass `#[global_allocator]`), only add noise to it.

/// The allocator under test.
static Q: QuotaAlloc = QuotaAlloc::new();
/// The baseline: the same jemalloc, without the quota ledger.
static J: Jemalloc = Jemalloc;
/// For reference: glibc malloc (or whatever the platform's is).
static S: System = System;

/// An allocator reached through calls that are never inlined (`MEMQUOTA_BENCH_SHIM=1`),
/// like the `__rust_alloc` shim in front of a `#[global_allocator]`: the shim names
/// its static ([`Named`]), as `__rg_alloc` names the program's, and takes no pointer
/// to it. (Forwarding through `&self` cost `QuotaAlloc` three register moves per call
/// that a program never pays: its slow-path calls use `self`, so the compiler kept the
/// argument, where it dropped bare jemalloc's.)
struct Shim<A>(PhantomData<A>);

/// One of the statics under test, reached by name.
trait Named: GlobalAlloc + Sync + 'static {
    fn get() -> &'static Self;
}

impl Named for QuotaAlloc {
    fn get() -> &'static Self {
        &Q
    }
}

impl Named for Jemalloc {
    fn get() -> &'static Self {
        &J
    }
}

impl Named for System {
    fn get() -> &'static Self {
        &S
    }
}

// SAFETY: every method forwards to the named allocator's with the same arguments.
unsafe impl<A: Named> GlobalAlloc for Shim<A> {
    #[inline(never)]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        unsafe { A::get().alloc(layout) }
    }

    #[inline(never)]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { A::get().dealloc(ptr, layout) }
    }

    #[inline(never)]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        unsafe { A::get().realloc(ptr, layout, new_size) }
    }
}

static SHIM_Q: Shim<QuotaAlloc> = Shim(PhantomData);
static SHIM_J: Shim<Jemalloc> = Shim(PhantomData);
static SHIM_S: Shim<System> = Shim(PhantomData);

/// One run of allocator `which` (0: J, 1: Q, 2: S), through shims if asked.
fn run_one(which: usize, w: Workload, threads: usize, ops: u64) -> Duration {
    match (env_flag("MEMQUOTA_BENCH_SHIM"), which) {
        (false, 0) => run(&J, w, threads, ops),
        (false, 1) => run(&Q, w, threads, ops),
        (false, _) => run(&S, w, threads, ops),
        (true, 0) => run(&SHIM_J, w, threads, ops),
        (true, 1) => run(&SHIM_Q, w, threads, ops),
        (true, _) => run(&SHIM_S, w, threads, ops),
    }
}

/// Live objects per thread in the churn workloads (a power of two).
const RING: usize = 1024;
/// Pointers per batch in the producer/consumer workload.
const BATCH: usize = 256;
/// Batches in flight between producer and consumer.
const SLOTS: usize = 16;
/// Alignment of every allocation: the common case for Rust objects.
const ALIGN: usize = 8;
/// Smallest and largest "small" object.
const SMALL_MIN: usize = 16;
const SMALL_MAX: usize = 256;
/// Smallest and largest "large" object in the mixed workload.
const LARGE_MIN: usize = 64 << 10;
const LARGE_MAX: usize = 1 << 20;
/// Small objects are grown by `realloc` (doubling) while under this size.
const GROW_MAX: usize = 8 << 10;

/// xorshift64: cheap, deterministic, good enough to pick sizes and slots.
struct Rng(u64);

impl Rng {
    fn new(thread: usize) -> Rng {
        Rng(0x9E37_79B9_7F4A_7C15 ^ (thread as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    #[inline(always)]
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

#[inline(always)]
fn layout(size: usize) -> Layout {
    debug_assert!((1..=LARGE_MAX).contains(&size));
    // SAFETY: ALIGN is a power of two and every size used here is at most 1 MiB, far
    // from overflowing isize when rounded up to ALIGN.
    unsafe { Layout::from_size_align_unchecked(size, ALIGN) }
}

/// Allocates `size` bytes and writes one byte, so the block is really used.
#[inline(always)]
fn alloc_touch<A: GlobalAlloc>(a: &A, size: usize) -> *mut u8 {
    let layout = layout(size);
    // SAFETY: `layout` has a non-zero size.
    let p = unsafe { a.alloc(layout) };
    if p.is_null() {
        handle_alloc_error(layout);
    }
    // SAFETY: `p` is a fresh block of `size >= 1` writable bytes.
    unsafe { p.write(size as u8) };
    black_box(p)
}

/// Frees a block of `size` bytes.
///
/// # Safety
/// `p` came from `alloc_touch(a, size)` or `grow_touch(a, _, _, size)`, and is not
/// used again.
#[inline(always)]
unsafe fn free<A: GlobalAlloc>(a: &A, p: *mut u8, size: usize) {
    // SAFETY: the caller guarantees `p` is a live block from `a` with `layout(size)`.
    unsafe { a.dealloc(p, layout(size)) }
}

/// Grows a block of `old` bytes to `new` bytes and writes its last byte.
///
/// # Safety
/// As for [`free`] with `size = old`; `p` is replaced by the returned block.
#[inline(always)]
unsafe fn grow_touch<A: GlobalAlloc>(a: &A, p: *mut u8, old: usize, new: usize) -> *mut u8 {
    // SAFETY: the caller guarantees `p` is a live block from `a` with `layout(old)`,
    // and `new` is non-zero and, rounded up to ALIGN, far below isize::MAX.
    let q = unsafe { a.realloc(p, layout(old), new) };
    if q.is_null() {
        handle_alloc_error(layout(new));
    }
    // SAFETY: `q` is a block of `new >= 1` writable bytes.
    unsafe { q.add(new - 1).write(new as u8) };
    black_box(q)
}

#[inline(always)]
fn small_size(r: u64) -> usize {
    SMALL_MIN + (r % (SMALL_MAX - SMALL_MIN + 1) as u64) as usize
}

#[inline(always)]
fn large_size(r: u64) -> usize {
    LARGE_MIN + (r % (LARGE_MAX - LARGE_MIN + 1) as u64) as usize
}

/// A ring of live blocks owned by one thread. Fixed-size arrays, so indexing with
/// `i & (RING - 1)` needs no bounds check.
struct Live {
    ptrs: Box<[*mut u8; RING]>,
    sizes: Box<[usize; RING]>,
}

impl Live {
    /// Fills the ring (untimed) with blocks sized as `size` picks.
    fn fill<A: GlobalAlloc>(a: &A, rng: &mut Rng, size: impl Fn(u64) -> usize) -> Live {
        let mut live = Live { ptrs: Box::new([std::ptr::null_mut(); RING]), sizes: Box::new([0; RING]) };
        for i in 0..RING {
            let s = size(rng.next());
            live.ptrs[i] = alloc_touch(a, s);
            live.sizes[i] = s;
        }
        live
    }

    fn free_all<A: GlobalAlloc>(self, a: &A) {
        for (&p, &s) in self.ptrs.iter().zip(self.sizes.iter()) {
            // SAFETY: the ring holds live blocks from `a` with their sizes, and is
            // consumed here.
            unsafe { free(a, p, s) };
        }
    }
}

/// Workload 1: replace a random one of RING live small blocks, `ops` times.
fn small_churn<A: GlobalAlloc>(a: &A, rng: &mut Rng, live: &mut Live, ops: u64) {
    // A local copy stays in a register across the allocator calls.
    let mut rng = Rng(rng.0);
    for _ in 0..ops {
        let r = rng.next();
        let i = (r as usize) & (RING - 1);
        // SAFETY: slot `i` holds a live block from `a` of that size; it is
        // overwritten just below.
        unsafe { free(a, live.ptrs[i], live.sizes[i]) };
        let s = small_size(r >> 10);
        live.ptrs[i] = alloc_touch(a, s);
        live.sizes[i] = s;
    }
}

/// The mixed workload's size distribution: 1 in 64 large, the rest small.
#[inline(always)]
fn mixed_size(r: u64) -> usize {
    if r & 63 == 0 {
        large_size(r >> 6)
    } else {
        small_size(r >> 6)
    }
}

/// Workload 2: like `small_churn`, but 1 in 64 new blocks is 64 KiB..1 MiB, and 1 op
/// in 8 grows a block below 8 KiB to twice its size with `realloc` instead.
fn mixed_churn<A: GlobalAlloc>(a: &A, rng: &mut Rng, live: &mut Live, ops: u64) {
    let mut rng = Rng(rng.0);
    for _ in 0..ops {
        let r = rng.next();
        let i = (r as usize) & (RING - 1);
        let old = live.sizes[i];
        if (r >> 10) & 7 == 0 && old < GROW_MAX {
            // SAFETY: slot `i` holds a live block from `a` of `old` bytes; it is
            // replaced by the grown one.
            live.ptrs[i] = unsafe { grow_touch(a, live.ptrs[i], old, old * 2) };
            live.sizes[i] = old * 2;
        } else {
            // SAFETY: as above; the slot is overwritten just below.
            unsafe { free(a, live.ptrs[i], old) };
            let s = mixed_size(r >> 13);
            live.ptrs[i] = alloc_touch(a, s);
            live.sizes[i] = s;
        }
    }
}

/// A single-producer single-consumer queue of batches of (pointer, size), spinning
/// (then yielding) when full or empty: no syscall and no allocation once built, so
/// its cost stays small next to the 256 allocations and frees of a batch.
struct Queue {
    /// Batches published by the producer.
    head: Padded<AtomicUsize>,
    /// Batches freed by the consumer.
    tail: Padded<AtomicUsize>,
    slots: Vec<Batch>,
}

#[repr(align(128))]
struct Padded<T>(T);

struct Batch {
    ptrs: [AtomicUsize; BATCH],
    sizes: [AtomicUsize; BATCH],
}

impl Queue {
    fn new() -> Queue {
        let batch = || Batch {
            ptrs: std::array::from_fn(|_| AtomicUsize::new(0)),
            sizes: std::array::from_fn(|_| AtomicUsize::new(0)),
        };
        Queue {
            head: Padded(AtomicUsize::new(0)),
            tail: Padded(AtomicUsize::new(0)),
            slots: (0..SLOTS).map(|_| batch()).collect(),
        }
    }

    /// Allocates one batch and publishes it, waiting while the queue is full.
    fn produce<A: GlobalAlloc>(&self, a: &A, rng: &mut Rng) {
        let h = self.head.0.load(Ordering::Relaxed);
        wait(|| h - self.tail.0.load(Ordering::Acquire) < SLOTS);
        let b = &self.slots[h % SLOTS];
        let mut r = Rng(rng.0);
        for k in 0..BATCH {
            let s = small_size(r.next());
            b.ptrs[k].store(alloc_touch(a, s) as usize, Ordering::Relaxed);
            b.sizes[k].store(s, Ordering::Relaxed);
        }
        rng.0 = r.0;
        self.head.0.store(h + 1, Ordering::Release);
    }

    /// Frees the oldest batch, waiting while the queue is empty.
    fn consume<A: GlobalAlloc>(&self, a: &A) {
        let t = self.tail.0.load(Ordering::Relaxed);
        wait(|| self.head.0.load(Ordering::Acquire) != t);
        let b = &self.slots[t % SLOTS];
        for k in 0..BATCH {
            let p = b.ptrs[k].load(Ordering::Relaxed) as *mut u8;
            // SAFETY: the producer stored a live block from `a` and its size in slot
            // `k` of batch `t` before publishing it (Release/Acquire on `head`), and
            // does not touch the batch again until `tail` passes it.
            unsafe { free(a, p, b.sizes[k].load(Ordering::Relaxed)) };
        }
        self.tail.0.store(t + 1, Ordering::Release);
    }
}

fn wait(ready: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        if spins < 100 {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Workload {
    Small,
    Mixed,
    ProdCons,
}

impl Workload {
    const ALL: [Workload; 3] = [Workload::Small, Workload::Mixed, Workload::ProdCons];

    fn name(self) -> &'static str {
        match self {
            Workload::Small => "small-churn",
            Workload::Mixed => "mixed-sizes",
            Workload::ProdCons => "prod-cons",
        }
    }

    /// Operations per thread in one full-size run, each about 50-200 ms here.
    fn ops(self) -> u64 {
        match self {
            Workload::Small => 20_000_000,
            Workload::Mixed => 4_000_000,
            Workload::ProdCons => 10_000_000,
        }
    }
}

/// One timed run of `w` on `threads` fresh threads; returns the wall time from the
/// first thread's start to the last thread's end. An op is one allocation and one
/// free (or one realloc); each thread does `ops` of them, except in the two-thread
/// producer/consumer run, where `ops` blocks go from one thread to the other.
fn run<A: GlobalAlloc + Sync>(a: &'static A, w: Workload, threads: usize, ops: u64) -> Duration {
    run_in(a, w, threads, ops, None)
}

/// [`run`], with every thread attached to `task` for the whole run (fill, timed loop
/// and teardown) when one is given.
fn run_in<A: GlobalAlloc + Sync>(
    a: &'static A,
    w: Workload,
    threads: usize,
    ops: u64,
    task: Option<ScopeHandle>,
) -> Duration {
    let barrier = Barrier::new(threads);
    let queue = Queue::new();
    let batches = ops / BATCH as u64;
    let cpu = cpu_clock();
    let spans: Vec<(Instant, Instant, Duration)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, queue) = (&barrier, &queue);
                scope.spawn(move || {
                    let _attached = task.map(|h| h.attach().expect("the bench scope is live"));
                    let mut rng = Rng::new(t);
                    match w {
                        Workload::Small | Workload::Mixed => {
                            let size = if w == Workload::Small { small_size } else { mixed_size };
                            let mut live = Live::fill(a, &mut rng, size);
                            barrier.wait();
                            let (start, cpu_start) = (Instant::now(), thread_cpu());
                            if w == Workload::Small {
                                small_churn(a, &mut rng, &mut live, ops);
                            } else {
                                mixed_churn(a, &mut rng, &mut live, ops);
                            }
                            let (end, cpu_end) = (Instant::now(), thread_cpu());
                            live.free_all(a);
                            (start, end, cpu_end - cpu_start)
                        }
                        Workload::ProdCons => {
                            barrier.wait();
                            let (start, cpu_start) = (Instant::now(), thread_cpu());
                            for _ in 0..batches {
                                match (threads, t) {
                                    (1, _) => {
                                        queue.produce(a, &mut rng);
                                        queue.consume(a);
                                    }
                                    (_, 0) => queue.produce(a, &mut rng),
                                    _ => queue.consume(a),
                                }
                            }
                            (start, Instant::now(), thread_cpu() - cpu_start)
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("bench thread panicked")).collect()
    });
    if cpu {
        return spans.iter().map(|s| s.2).max().expect("at least one thread");
    }
    let start = spans.iter().map(|s| s.0).min().expect("at least one thread");
    let end = spans.iter().map(|s| s.1).max().expect("at least one thread");
    end - start
}

/// Whether runs are timed by CPU time (`MEMQUOTA_BENCH_CLOCK=cpu`).
fn cpu_clock() -> bool {
    std::env::var("MEMQUOTA_BENCH_CLOCK").is_ok_and(|v| v == "cpu")
}

/// The calling thread's CPU time.
fn thread_cpu() -> Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec to write; CLOCK_THREAD_CPUTIME_ID always exists
    // on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn smallest(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The smallest and largest of `v`.
fn range(v: &[f64]) -> (f64, f64) {
    (smallest(v), v.iter().copied().fold(0.0, f64::max))
}

struct Row {
    workload: &'static str,
    threads: usize,
    /// Median ns per op of J, Q, S.
    ns: [f64; 3],
    /// Smallest and largest per-round Q/J (same round, adjacent runs).
    qj_range: (f64, f64),
    /// Q's fastest run over J's fastest: the runs the machine's load added least to.
    fastest: f64,
}

fn env_flag(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| !v.is_empty() && v != "0")
}

fn main() {
    // A large limit: this measures the ledger's overhead, never a refusal. At 16 GiB the
    // per-thread threshold is its 1 MiB maximum.
    // MEMQUOTA_PROFILE_SAMPLE (bytes, or with k or m), as the preload reads it: the
    // allocation-site profile's rate; unset, the default (512 KiB).
    let config = Config::new().limit(16 << 30);
    let config = match std::env::var("MEMQUOTA_PROFILE_SAMPLE") {
        Ok(v) => {
            let (n, unit) = match v.strip_suffix(['k', 'K']) {
                Some(n) => (n, 1 << 10),
                None => v.strip_suffix(['m', 'M']).map_or((v.as_str(), 1), |n| (n, 1 << 20)),
            };
            config.profile_sample(n.parse::<u64>().expect("MEMQUOTA_PROFILE_SAMPLE: a size") * unit)
        }
        Err(_) => config,
    };
    memquota::init(config).expect("memquota::init");

    let quick = env_flag("MEMQUOTA_BENCH_QUICK");
    let rounds: usize = match std::env::var("MEMQUOTA_BENCH_ROUNDS") {
        Ok(v) => v.parse().expect("MEMQUOTA_BENCH_ROUNDS: a number"),
        Err(_) if quick => 3,
        Err(_) => 7,
    }
    .max(1);
    let scale: u64 = match std::env::var("MEMQUOTA_BENCH_DIVIDE") {
        Ok(v) => v.parse().ok().filter(|&n| n > 0).expect("MEMQUOTA_BENCH_DIVIDE: a number above 0"),
        Err(_) if quick => 20,
        Err(_) => 1,
    };
    // `cargo bench` passes `--bench`; any other non-flag argument filters workloads.
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let selected = |w: Workload| filters.is_empty() || filters.iter().any(|f| w.name().contains(f));
    let thread_counts: Vec<usize> = match std::env::var("MEMQUOTA_BENCH_THREADS") {
        Ok(v) => vec![v.parse().expect("MEMQUOTA_BENCH_THREADS: a number")],
        Err(_) => vec![1, 2],
    };

    // Profiling mode: one allocator only, no comparison, e.g. under `perf stat`.
    if let Ok(only) = std::env::var("MEMQUOTA_BENCH_ONLY") {
        for w in Workload::ALL.into_iter().filter(|&w| selected(w)) {
            for &threads in &thread_counts {
                let ops = w.ops() / scale;
                let d = match only.to_ascii_uppercase().as_str() {
                    "J" => run_one(0, w, threads, ops),
                    "Q" => run_one(1, w, threads, ops),
                    "S" => run_one(2, w, threads, ops),
                    "QS" => {
                        let task = MemoryManager::global().begin("bench", 1, 0).expect("a scope");
                        let d = run_in(&Q, w, threads, ops, Some(task.handle()));
                        task.end();
                        d
                    }
                    _ => panic!("MEMQUOTA_BENCH_ONLY: J, Q, S or QS"),
                };
                let ns = d.as_nanos() as f64 / ops as f64;
                println!("{only} {} {threads} thread(s): {ns:.2} ns/op, {ops} ops", w.name());
            }
        }
        return;
    }

    if std::env::var("MEMQUOTA_BENCH_SCOPES").is_ok_and(|v| v == "only") {
        scope_table(rounds, scale, &selected, &thread_counts);
        return;
    }
    println!("memquota allocator benchmark: J = bare jemalloc, Q = QuotaAlloc<Jemalloc>, S = System");
    println!(
        "{rounds} rounds of one run per allocator, interleaved and rotated (J Q S, Q S J, ...); \
         medians shown.\nThis is meant for a shared, noisy machine: absolute times are noise, only \
         the ratios within this run matter."
    );
    println!(
        "threshold {} KiB per thread, {} cores available{}{}",
        memquota::seam::process::threshold_for(16 << 30) >> 10,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        if quick { ", QUICK mode (1/20 of the ops)" } else { "" },
        if cpu_clock() { ", timed by thread CPU time" } else { "" }
    );
    if env_flag("MEMQUOTA_BENCH_SHIM") {
        println!("allocators called through #[inline(never)] shims, as through __rust_alloc");
    }
    println!();
    println!(
        "{:<12} {:>3} {:>9} {:>9} {:>9} {:>7} {:>7} {:>7}  {:>13} {:>8}",
        "workload", "thr", "J ns/op", "Q ns/op", "S ns/op", "Q/J", "S/J", "Q-J ns", "Q/J rounds", "fastest"
    );

    let mut rows = Vec::new();
    for w in Workload::ALL.into_iter().filter(|&w| selected(w)) {
        for &threads in &thread_counts {
            let ops = w.ops() / scale;
            // Warm-up: page in the code and let every allocator grow its arenas once.
            for which in 0..3 {
                run_one(which, w, threads, ops / 4);
            }
            let mut times: [Vec<f64>; 3] = Default::default();
            for round in 0..rounds {
                // Interleaved, and rotated each round (J Q S, Q S J, S J Q, ...) so no
                // allocator always runs right after the same other one.
                for k in 0..3 {
                    let which = (round + k) % 3;
                    let d = run_one(which, w, threads, ops);
                    times[which].push(d.as_nanos() as f64 / ops as f64);
                }
            }
            let ratios: Vec<f64> = times[1].iter().zip(&times[0]).map(|(q, j)| q / j).collect();
            let row = Row {
                workload: w.name(),
                threads,
                ns: [median(&times[0]), median(&times[1]), median(&times[2])],
                qj_range: range(&ratios),
                fastest: smallest(&times[1]) / smallest(&times[0]),
            };
            println!(
                "{:<12} {:>3} {:>9.2} {:>9.2} {:>9.2} {:>7.3} {:>7.3} {:>7.2}  {:>5.3}..{:<5.3} {:>8.3}",
                row.workload,
                row.threads,
                row.ns[0],
                row.ns[1],
                row.ns[2],
                row.ns[1] / row.ns[0],
                row.ns[2] / row.ns[0],
                row.ns[1] - row.ns[0],
                row.qj_range.0,
                row.qj_range.1,
                row.fastest,
            );
            rows.push(row);
        }
    }

    let worst = rows
        .iter()
        .max_by(|a, b| (a.ns[1] / a.ns[0]).total_cmp(&(b.ns[1] / b.ns[0])))
        .expect("no workload matched the filter");
    let ratio = worst.ns[1] / worst.ns[0];
    let verdict = if ratio <= 1.02 {
        "meets the 1.02x aim"
    } else if ratio <= 1.05 {
        "meets the 1.05x target, not the 1.02x aim"
    } else {
        "OVER the 1.05x target"
    };
    println!();
    println!(
        "worst Q/J: {ratio:.3} ({} at {} thread{}): {verdict}",
        worst.workload,
        worst.threads,
        if worst.threads == 1 { "" } else { "s" }
    );

    if std::env::var("MEMQUOTA_BENCH_SCOPES").is_ok_and(|v| v == "0") {
        return;
    }
    scope_table(rounds, scale, &selected, &thread_counts);
}

/// The cost of scope attribution: Q with its threads in no scope against Q with them
/// attached to one task scope, interleaved (Q QS, QS Q, ...), medians compared.
fn scope_table(rounds: usize, scale: u64, selected: &dyn Fn(Workload) -> bool, thread_counts: &[usize]) {
    let task = MemoryManager::global().begin("bench", 1, 0).expect("a scope");
    let h = Some(task.handle());
    println!();
    println!("scope attribution: Q = threads in no scope, QS = threads attached to one task scope");
    println!(
        "{:<12} {:>3} {:>9} {:>9} {:>7}  {:>13}",
        "workload", "thr", "Q ns/op", "QS ns/op", "QS/Q", "QS/Q rounds"
    );
    let mut worst: (f64, &str, usize) = (0.0, "", 0);
    for w in Workload::ALL.into_iter().filter(|&w| selected(w)) {
        for &threads in thread_counts {
            let ops = w.ops() / scale;
            run_in(&Q, w, threads, ops / 4, None);
            run_in(&Q, w, threads, ops / 4, h);
            let mut times: [Vec<f64>; 2] = Default::default();
            for round in 0..rounds {
                for k in 0..2 {
                    let which = (round + k) % 2;
                    let d = run_in(&Q, w, threads, ops, if which == 0 { None } else { h });
                    times[which].push(d.as_nanos() as f64 / ops as f64);
                }
            }
            let ratios: Vec<f64> = times[1].iter().zip(&times[0]).map(|(s, q)| s / q).collect();
            let (lo, hi) = range(&ratios);
            let (q, qs) = (median(&times[0]), median(&times[1]));
            println!(
                "{:<12} {:>3} {:>9.2} {:>9.2} {:>7.3}  {:>5.3}..{:<5.3}",
                w.name(),
                threads,
                q,
                qs,
                qs / q,
                lo,
                hi
            );
            if qs / q > worst.0 {
                worst = (qs / q, w.name(), threads);
            }
        }
    }
    let stats = task.stats().expect("live");
    assert_eq!(stats.allocated, 0, "every run freed what it allocated: the scope is back to 0");
    let verdict = if worst.0 <= 1.03 { "meets the 1.03x target" } else { "OVER the 1.03x target" };
    println!();
    println!("worst QS/Q: {:.3} ({} at {} thread(s)): {verdict}", worst.0, worst.1, worst.2);
    assert!(!task.end().is_leak());
}
