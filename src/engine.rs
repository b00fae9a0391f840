//! The policy engine: the slow path every face shares. It settles the thread's
//! delta, admits a request against the quota, runs or awaits a reclaim, and refuses
//! with a report. Also the process-wide settings and the public control functions.

use crate::config::{Config, HeapMode, OnOom};
use crate::error::Result;
use crate::gc::{Coordinator, Run, SyncOutcome, Throttle, Timing};
use crate::heap_probe;
use crate::ledger::{self, Face, Local, ACCOUNT};
use crate::quota::{Pressure, Quota};
use crate::report::{self, Refusal};
use crate::rust_face::RUST_FACE;
use crate::stats::{JemallocStats, Stats};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU64, AtomicU8, Ordering::*};
use std::time::Duration;

/// A reclaim callback: asked to free about `need` bytes.
pub type ReclaimFn = dyn Fn(usize) + Send + Sync;

/// Sync reclaims one request may go through before it is refused.
const MAX_SYNC_ROUNDS: u32 = 2;

const UNCONFIGURED: u8 = 0;
const CONFIGURING: u8 = 1;
const READY: u8 = 2;

/// The settings the slow path reads. Written by `init`, read with relaxed loads: a
/// thread that sees a mix of old and new values for one request decides on a
/// consistent-enough quota, and the next request sees the new one.
struct Settings {
    state: AtomicU8,
    limit: AtomicI64,
    soft: AtomicI64,
    heap_used: AtomicBool,
    abort: AtomicBool,
    wait_ms: AtomicU64,
    interval_ms: AtomicU64,
    refuse_min: AtomicU64,
    background_interval_ms: AtomicU64,
    /// [`Enforcement::Allocations`] when true.
    police_allocations: AtomicBool,
}

static SETTINGS: Settings = Settings {
    state: AtomicU8::new(UNCONFIGURED),
    limit: AtomicI64::new(i64::MAX),
    soft: AtomicI64::new(i64::MAX),
    heap_used: AtomicBool::new(false),
    abort: AtomicBool::new(false),
    wait_ms: AtomicU64::new(5000),
    interval_ms: AtomicU64::new(10),
    refuse_min: AtomicU64::new(0),
    background_interval_ms: AtomicU64::new(0),
    police_allocations: AtomicBool::new(true),
};

static COORDINATOR: Coordinator = Coordinator::new();
static OOMS: AtomicU64 = AtomicU64::new(0);
static OVERCOMMITS: AtomicU64 = AtomicU64::new(0);
/// The face whose threads the background worker and `flush` use: the last one seen on
/// the slow path (one per process copy of this crate in practice).
static FACE: AtomicPtr<Face> = AtomicPtr::new(&RUST_FACE as *const Face as *mut Face);
/// A leaked `Box<Box<ReclaimFn>>`, never freed: another thread may be running the
/// previous callback when a new one is installed.
static RECLAIM: AtomicPtr<Box<ReclaimFn>> = AtomicPtr::new(std::ptr::null_mut());
static WORKER_STARTED: AtomicBool = AtomicBool::new(false);
static METRICS_STARTED: AtomicBool = AtomicBool::new(false);

/// Configures the budget, overriding what was read from `MEMQUOTA_*` on first use.
/// May be called again to change it. Starts the metrics endpoint if the
/// configuration names an address (once per process).
///
/// # Errors
/// [`Error::BadConfig`](crate::Error::BadConfig) for out-of-range values; nothing is
/// changed then.
pub fn init(config: Config) -> Result<()> {
    let limit = config.resolve_limit()?;
    // An allocation on another thread may be reading the environment right now;
    // let it finish so it cannot overwrite this configuration afterwards.
    while SETTINGS
        .state
        .compare_exchange(UNCONFIGURED, CONFIGURING, Acquire, Relaxed)
        .is_err_and(|s| s == CONFIGURING)
    {
        std::thread::yield_now();
    }
    apply(&config, limit);
    SETTINGS.state.store(READY, Release);
    crate::fork::install();
    crate::rendezvous::check();
    if let Some(addr) = config.metrics_addr_setting() {
        if !METRICS_STARTED.swap(true, AcqRel) {
            if let Err(e) = crate::endpoint::serve_metrics(addr) {
                METRICS_STARTED.store(false, Release);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Changes only the limit, keeping the soft ratio as a fraction of it.
pub fn set_limit(bytes: u64) {
    ensure_configured();
    let old = quota();
    let ratio = if old.limit == i64::MAX {
        Config::new().soft_ratio_setting()
    } else {
        old.soft as f64 / old.limit as f64
    };
    let q = Quota::new(bytes, ratio);
    store_quota(q);
}

fn apply(config: &Config, limit: u64) {
    store_quota(Quota::new(limit, config.soft_ratio_setting()));
    SETTINGS.heap_used.store(config.heap_setting() == HeapMode::Used, Relaxed);
    SETTINGS.abort.store(config.on_oom_setting() == OnOom::Abort, Relaxed);
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    SETTINGS.wait_ms.store(ms(config.reclaim_wait_setting()), Relaxed);
    SETTINGS.interval_ms.store(ms(config.reclaim_interval_setting()), Relaxed);
    SETTINGS.refuse_min.store(config.refuse_min_setting(), Relaxed);
    report::set_window(config.report_window_setting());
}

fn store_quota(q: Quota) {
    SETTINGS.limit.store(q.limit, Relaxed);
    SETTINGS.soft.store(q.soft, Relaxed);
    ledger::set_threshold(ledger::threshold_for(q.limit as u64));
}

fn quota() -> Quota {
    Quota { limit: SETTINGS.limit.load(Relaxed), soft: SETTINGS.soft.load(Relaxed) }
}

fn timing() -> Timing {
    Timing {
        wait: Duration::from_millis(SETTINGS.wait_ms.load(Relaxed)),
        min_interval: Duration::from_millis(SETTINGS.interval_ms.load(Relaxed)),
        background_interval: Duration::from_millis(SETTINGS.background_interval_ms.load(Relaxed)),
    }
}

fn heap_mode() -> HeapMode {
    if SETTINGS.heap_used.load(Relaxed) {
        HeapMode::Used
    } else {
        HeapMode::Committed
    }
}

/// Reads `MEMQUOTA_*` the first time any slow path runs, as jemalloc reads
/// `MALLOC_CONF`. A bad value must never leave the process silently unlimited: it
/// prints the error and exits with status 2.
#[inline]
pub(crate) fn ensure_configured() {
    if SETTINGS.state.load(Acquire) != READY {
        configure_from_env();
    }
}

#[cold]
fn configure_from_env() {
    if SETTINGS.state.compare_exchange(UNCONFIGURED, CONFIGURING, Acquire, Relaxed).is_err() {
        return; // configured, or being configured by another thread: unlimited till then
    }
    match Config::from_env().and_then(|c| c.resolve_limit().map(|limit| (c, limit))) {
        Ok((config, limit)) => {
            apply(&config, limit);
            crate::fork::install();
        }
        Err(e) => {
            report::write_stderr(&format!("{e}\n"));
            std::process::exit(2);
        }
    }
    SETTINGS.state.store(READY, Release);
}

/// Registers the reclaim ("GC") callback, replacing any earlier one. It is called
/// with the number of bytes wanted, on the thread that needs them (synchronous
/// reclaim) or on the `memquota-reclaim` thread (background reclaim), never twice at
/// once. It may allocate: that is charged and never triggers another reclaim. A
/// panic in it is caught and counted. What it freed is measured, not trusted.
///
/// Registering resets the futility suspension: the record of the old callback says
/// nothing about the new one. The old callback is leaked, not dropped, since another
/// thread may be running it.
pub fn on_reclaim<F: Fn(usize) + Send + Sync + 'static>(callback: F) {
    let boxed: Box<Box<ReclaimFn>> = Box::new(Box::new(callback));
    RECLAIM.store(Box::into_raw(boxed), Release);
    COORDINATOR.reset_futility();
}

fn reclaimer() -> Option<&'static ReclaimFn> {
    let p = RECLAIM.load(Acquire);
    // SAFETY: RECLAIM holds null or a pointer from `Box::into_raw` that is never freed.
    unsafe { p.as_ref() }.map(|b| &**b)
}

pub(crate) fn face() -> &'static Face {
    // SAFETY: FACE only ever holds pointers to `&'static Face` values.
    unsafe { &*FACE.load(Relaxed) }
}

/// The slow path of a charge of `bytes` (either sign) on a thread of `face`. Returns
/// whether the caller may go ahead; only positive charges can be refused.
#[cold]
#[inline(never)]
pub fn charge_slow(face: &'static Face, bytes: i64) -> bool {
    let Some(l) = (face.local)() else {
        ACCOUNT.add(bytes); // a thread with no state left: counted, never policed
        return true;
    };
    let Some(_busy) = ledger::enter(l) else {
        ledger::charge_nested(l, bytes);
        return true;
    };
    if !std::ptr::eq(FACE.load(Relaxed), face) {
        FACE.store(face as *const Face as *mut Face, Relaxed);
    }
    if face.configure_from_env {
        ensure_configured();
    }
    let flushed = ledger::settle(l, face);
    ACCOUNT.add(flushed);
    let granted = decide(l, face, bytes);
    // Past the ceiling the thread goes tight (no fast path) until a slow path finds
    // the account back under it: the ledger's bound on usage past the limit.
    let over = past_ceiling();
    if over && (flushed > 0 || (granted && bytes > 0)) {
        OVERCOMMITS.fetch_add(1, Relaxed);
    }
    ACCOUNT.add(ledger::rearm(l, over));
    granted
}

/// The decision on a charge of `bytes`, the thread's delta already settled.
fn decide(l: &Local, face: &Face, bytes: i64) -> bool {
    if bytes <= 0 {
        ACCOUNT.add(ledger::attribute(l, bytes));
        return true;
    }
    // What a gate charged already for this allocation ([`make_room`]): the account
    // has it, the scope does not yet.
    let prepaid = ledger::use_prepaid(l, bytes as u64) as i64;
    if prepaid > 0 {
        ACCOUNT.add(ledger::attribute(l, prepaid) - prepaid);
    }
    let bytes = bytes - prepaid;
    if bytes == 0 {
        return true;
    }
    match ledger::scope_of(l) {
        0 => admit(l, face, bytes),
        // Under Enforcement::Gates an allocation is never refused, not even by its
        // scope's share: it is charged to the scope and counted.
        scope if !policing_allocations() => {
            count_only(crate::scope::attribute(scope, bytes));
            true
        }
        // A small request never waits for its scope's share and is never refused by
        // it: charged to the scope, then admitted by the process budget like any
        // small request (over-commit within its bound).
        scope if (bytes as u64) < SETTINGS.refuse_min.load(Relaxed) => {
            let dh = crate::scope::attribute(scope, bytes);
            if dh <= 0 {
                ACCOUNT.add(dh);
                return true;
            }
            if admit_as(l, face, dh, OnOom::Abort) {
                return true;
            }
            ACCOUNT.add(crate::scope::attribute(scope, -bytes) + dh);
            false
        }
        scope => crate::scope::admit_attached(l, face, scope, bytes),
    }
}

/// Whether native plus counted heap is past the hard limit while allocations are
/// policed (under [`Enforcement::Gates`] nothing waits on the fast path's behalf).
fn past_ceiling() -> bool {
    let quota = quota();
    quota.limit != i64::MAX
        && policing_allocations()
        && ACCOUNT.native().saturating_add(heap_probe::read().counted(heap_mode())) > quota.limit
}

/// Makes `face` the one the background worker, `flush` and the fork handlers use,
/// before any of its threads reaches the slow path (a preloaded library's
/// constructor).
pub fn adopt(face: &'static Face) {
    FACE.store(face as *const Face as *mut Face, Relaxed);
}

/// The engine's part of a fork's prepare handler.
pub(crate) fn before_fork() {
    // SAFETY: from the prepare handler, followed by `after_fork` (fork.rs).
    unsafe { COORDINATOR.before_fork() };
}

/// The engine's part of a fork's parent and child handlers. In the child the
/// background worker and the parent's other threads do not exist.
///
/// # Safety
/// Only from the parent or child handler of the fork whose prepare handler called
/// [`before_fork`].
pub(crate) unsafe fn after_fork(child: bool) {
    // SAFETY: forwarded contract.
    unsafe { COORDINATOR.after_fork(child) };
    if child {
        WORKER_STARTED.store(false, Relaxed);
        ledger::after_fork_child((face().local)());
    }
}

/// Exempts the calling thread from the policy for the rest of its life: its
/// allocations are charged but never refused and never wait for a reclaim. For
/// memquota's own service threads.
pub(crate) fn exempt_this_thread() {
    if let Some(l) = (face().local)() {
        std::mem::forget(ledger::enter(l));
    }
}

/// Where the budget is enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enforcement {
    /// Every allocation may wait for a reclaim and be refused (the default).
    Allocations,
    /// Allocations are only counted (and ask for a background reclaim under
    /// pressure); only explicit gates, [`make_room`], wait and refuse. For a process
    /// whose own threads die on a failed malloc, a JVM: its gate is
    /// `Unsafe.allocateMemory`, whose callers handle the refusal.
    Gates,
}

/// Chooses where the budget is enforced.
pub fn set_enforcement(e: Enforcement) {
    SETTINGS.police_allocations.store(e == Enforcement::Allocations, Relaxed);
}

/// A gate: waits for reclaims until `bytes` more would fit the budget, without
/// charging them (the allocation that follows is charged as usual). Returns false,
/// with an OOM report written, if they will not fit. Flushes the calling thread's
/// delta first. Call it only where waiting is safe: never with a lock held that a
/// reclaim needs (in a JVM, from a thread in native state, never in VM state).
///
/// Requests under `refuse_min` always pass, with no wait, whatever the over-commit:
/// they are counted when taken, like every allocation under
/// [`Enforcement::Gates`]. A JVM's own code treats a failed small
/// `Unsafe.allocateMemory` as fatal (seen: a 2 KiB NIO path buffer refused in a
/// Spark task took the whole JVM down through its uncaught-exception handler).
pub fn make_room(face: &'static Face, bytes: u64) -> bool {
    if bytes < SETTINGS.refuse_min.load(Relaxed) {
        return true;
    }
    let Some(l) = (face.local)() else { return true };
    let Some(_busy) = ledger::enter(l) else { return true };
    if face.configure_from_env {
        ensure_configured();
    }
    ACCOUNT.add(ledger::settle(l, face));
    let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
    // Charged here, under the ceiling, so gates on N threads cannot all pass on the
    // same room; the allocation that follows on this thread uses the charge up
    // ([`end_gate`] gives back what it did not use).
    let granted = police(l, face, bytes, OnOom::Abort, |ceiling| ACCOUNT.try_add(bytes, ceiling));
    if granted {
        ledger::prepay(l, bytes as u64);
    }
    granted
}

/// After the allocation a granted [`make_room`] let through: credits the part of the
/// gate's charge that the allocation did not use (all of it, if the allocation
/// failed or was served on the fast path).
pub fn end_gate(face: &'static Face) {
    if let Some(l) = (face.local)() {
        let left = ledger::take_prepaid(l);
        if left > 0 {
            let left = i64::try_from(left).unwrap_or(i64::MAX);
            ACCOUNT.add(-left);
        }
    }
}

/// Spaces background reclaims at least `gap` after the end of the previous reclaim,
/// for a runtime whose reclaim is costly (the JVM driver sets its own). Synchronous
/// reclaims keep the configured minimum interval.
pub(crate) fn set_background_interval(gap: Duration) {
    let ms = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX);
    SETTINGS.background_interval_ms.store(ms, Relaxed);
}

/// Unregisters the reclaim callback.
pub fn clear_reclaim() {
    RECLAIM.store(std::ptr::null_mut(), Release);
}

/// Records bytes that are already taken (or given back) on a thread of `face`, with
/// no policy: for corrections after the fact, such as a `realloc` that landed in a
/// different size class than estimated.
pub fn record(face: &'static Face, bytes: i64) {
    match (face.local)() {
        Some(l) => ledger::charge_nested(l, bytes),
        None => {
            ACCOUNT.add(bytes);
        }
    }
}

/// Flushes the calling thread's delta to the process account.
pub fn flush_thread(face: &'static Face) {
    if let Some(l) = (face.local)() {
        ACCOUNT.add(ledger::settle(l, face));
    }
}

/// The hard limit in bytes (`i64::MAX`: none), for the scopes' execution pool.
pub(crate) fn limit_bytes() -> i64 {
    quota().limit
}

/// Adds `bytes` to the process account if that stays under the limit, with no
/// reclaim and no report: a scope's first try before it spills.
pub(crate) fn fits(bytes: i64) -> bool {
    let quota = quota();
    let heap = heap_probe::read().counted(heap_mode());
    let taken = ACCOUNT.try_add(bytes, quota.native_ceiling(heap));
    if let Ok(native) = taken {
        reclaim_if_past_soft(quota, native, heap);
    }
    taken.is_ok()
}

/// Past the soft threshold (or the limit), asks for a background reclaim of the
/// excess over the soft threshold: the one place a grant decides that.
fn reclaim_if_past_soft(quota: Quota, native: i64, heap: i64) {
    if quota.pressure(native, heap) != Pressure::Low {
        request_background(Quota::excess(native, heap, quota.soft));
    }
}

/// Whether allocations themselves are policed ([`Enforcement::Allocations`]).
pub(crate) fn policing_allocations() -> bool {
    SETTINGS.police_allocations.load(Relaxed)
}

/// An allocation's admission: policed, or under [`Enforcement::Gates`] only counted.
pub(crate) fn admit(l: &Local, face: &Face, bytes: i64) -> bool {
    if !policing_allocations() {
        count_only(bytes);
        return true;
    }
    admit_as(l, face, bytes, OnOom::Abort)
}

/// [`Enforcement::Gates`]: the allocation is taken; under pressure a background
/// reclaim is asked for, and a grant past the limit is counted as an over-commit.
pub(crate) fn count_only(bytes: i64) {
    let quota = quota();
    let heap = heap_probe::read().counted(heap_mode());
    let native = ACCOUNT.add(bytes);
    if quota.pressure(native, heap) == Pressure::Hard {
        OVERCOMMITS.fetch_add(1, Relaxed);
    }
    reclaim_if_past_soft(quota, native, heap);
}

/// The policy, whatever the enforcement (a scope's explicit reservation is a gate of
/// its own). `worst` caps the OOM policy: `OnOom::Null` for a request that reports
/// failure itself (a scope's explicit reservation) and must never abort.
pub(crate) fn admit_as(l: &Local, face: &Face, bytes: i64, worst: OnOom) -> bool {
    police(l, face, bytes, worst, |ceiling| ACCOUNT.try_add(bytes, ceiling))
}

/// Admits `bytes` through `take(ceiling)` (which takes them, or only checks that they
/// fit: `Ok(new total)` or `Err(total that left no room)`), running synchronous
/// reclaims while they help, and refuses with a report otherwise.
fn police(
    l: &Local,
    face: &Face,
    bytes: i64,
    worst: OnOom,
    take: impl Fn(i64) -> std::result::Result<i64, i64>,
) -> bool {
    let quota = quota();
    let mode = heap_mode();
    let mut throttle = None;
    let mut round = 0;
    loop {
        let heap = heap_probe::read().counted(mode);
        let native = match take(quota.native_ceiling(heap)) {
            Ok(native) => {
                reclaim_if_past_soft(quota, native, heap);
                return true;
            }
            Err(native) => native,
        };
        // A small request is never refused while the over-commit stays bounded: the
        // threads that make them (a JVM's, C++ code) die on a failed malloc. It never
        // waits for a reclaim either; it asks for one in the background.
        if (bytes as u64) < SETTINGS.refuse_min.load(Relaxed) {
            if let Ok(native) = take(quota.overcommit_ceiling(heap)) {
                // Counted as an over-commit by the caller, which sees the account
                // past the limit.
                reclaim_if_past_soft(quota, native, heap);
                return true;
            }
        }
        if round == MAX_SYNC_ROUNDS || reclaimer().is_none() {
            break;
        }
        round += 1;
        let need = Quota::excess(native.saturating_add(bytes), heap, quota.limit);
        match COORDINATOR.reclaim_sync(need, timing(), |need| run_reclaim(l, face, need)) {
            // Another round only while reclaims keep making progress.
            SyncOutcome::Ran(run) if run.panicked || run.freed == 0 => break,
            SyncOutcome::Ran(_) | SyncOutcome::Waited => continue,
            SyncOutcome::TimedOut => break,
            SyncOutcome::Throttled(why) => {
                throttle = Some(why);
                break;
            }
        }
    }
    refuse(bytes, throttle, worst)
}

/// Counts and reports a refusal (a full report, or a count the next report sums up:
/// see `report`), then aborts if the policy says so and `worst` allows.
pub(crate) fn refuse(bytes: i64, throttle: Option<Throttle>, worst: OnOom) -> bool {
    OOMS.fetch_add(1, Relaxed);
    let abort = SETTINGS.abort.load(Relaxed) && worst == OnOom::Abort;
    let policy = if abort { OnOom::Abort } else { OnOom::Null };
    let mark = report::Mark {
        scopes: crate::scope::begun(),
        futile: COORDINATOR.counts.futile.load(Relaxed),
        limit: quota().limit,
    };
    if let Some(turn) = report::turn(bytes as u64, mark, abort) {
        report::emit(
            turn,
            &Refusal {
                requested: bytes as u64,
                stats: stats(),
                history: COORDINATOR.history(),
                throttle: throttle.or_else(|| COORDINATOR.throttled(timing())),
                has_reclaimer: reclaimer().is_some(),
                policy,
            },
        );
    }
    if policy == OnOom::Abort {
        std::process::abort();
    }
    false
}

/// Native plus counted heap bytes, with this thread's delta flushed first.
fn used_now(l: &Local, face: &Face) -> i64 {
    let native = ACCOUNT.add(ledger::settle(l, face));
    native.saturating_add(heap_probe::read().counted(heap_mode()))
}

/// Runs the callback on this thread, with the busy mark held by the caller, and
/// measures what it freed.
fn run_reclaim(l: &Local, face: &Face, need: u64) -> Run {
    let Some(callback) = reclaimer() else {
        return Run { freed: 0, panicked: false };
    };
    let before = used_now(l, face);
    let need = usize::try_from(need).unwrap_or(usize::MAX);
    let panicked = catch_unwind(AssertUnwindSafe(|| callback(need))).is_err();
    let after = used_now(l, face);
    Run { freed: u64::try_from(before.saturating_sub(after)).unwrap_or(0), panicked }
}

fn request_background(need: u64) {
    if reclaimer().is_none() || !COORDINATOR.request_background(need, timing()) {
        return;
    }
    if !WORKER_STARTED.swap(true, AcqRel) {
        let spawned = std::thread::Builder::new().name("memquota-reclaim".into()).spawn(|| {
            let face = face();
            let Some(l) = (face.local)() else { return };
            // This thread exists to reclaim: its own allocations are charged but
            // never wait for a reclaim.
            let _busy = ledger::enter(l);
            loop {
                COORDINATOR.serve_background(|need| run_reclaim(l, face, need));
            }
        });
        if spawned.is_err() {
            WORKER_STARTED.store(false, Release);
        }
    }
}

/// A snapshot of the budget. Never allocates (unless a heap probe function does), and
/// takes no lock that the allocation path holds; it advances jemalloc's statistics
/// epoch, which is too heavy for a hot loop.
pub fn stats() -> Stats {
    let quota = quota();
    let mode = heap_mode();
    let heap = heap_probe::read();
    let native = ACCOUNT.native();
    let counts = &COORDINATOR.counts;
    let unsigned = |v: i64| u64::try_from(v).unwrap_or(0);
    let limit = if quota.limit == i64::MAX { u64::MAX } else { unsigned(quota.limit) };
    let soft_limit = if quota.soft == i64::MAX { u64::MAX } else { unsigned(quota.soft) };
    let counted_heap = heap.counted(mode);
    Stats {
        limit,
        soft_limit,
        native: unsigned(native),
        native_peak: unsigned(ACCOUNT.peak()),
        heap,
        heap_mode: mode,
        headroom: quota.headroom(native, counted_heap),
        overcommit: Quota::excess(native.max(0), counted_heap, quota.limit),
        overcommits: OVERCOMMITS.load(Relaxed),
        refuse_min: SETTINGS.refuse_min.load(Relaxed),
        reclaims_sync: counts.sync.load(Relaxed),
        reclaims_background: counts.background.load(Relaxed),
        reclaim_panics: counts.panics.load(Relaxed),
        heap_probe_panics: heap_probe::panics(),
        reclaims_throttled: counts.throttled.load(Relaxed),
        reclaimed_bytes: counts.freed.load(Relaxed),
        ooms: OOMS.load(Relaxed),
        reports: report::full_reports(),
        error_bound: ledger::error_bound(),
        threads: ledger::live_threads(),
        threshold: ledger::threshold(),
        jemalloc: JemallocStats::read(),
        process_rss: crate::host::process_rss(),
    }
}
