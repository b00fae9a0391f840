//! The settings store: what the configuration decided, in atomics the slow path reads
//! with relaxed loads. A thread that sees a mix of old and new values for one request
//! decides on a consistent-enough quota, and the next request sees the new one. Also
//! the first-use configuration from `MEMQUOTA_*`, as jemalloc reads `MALLOC_CONF`.

use crate::base::config::{Config, HeapMode, Limit, OnOom, Untracked};
use crate::base::quota::{threshold_for, Quota, MIN_THRESHOLD};
use crate::base::sync::unmodelled::{AtomicBool, AtomicI64, AtomicU64, AtomicU8};
use crate::base::sync::{OnceLock, Ordering::*};
use std::time::Duration;

const UNCONFIGURED: u8 = 0;
const CONFIGURING: u8 = 1;
const READY: u8 = 2;

/// Where the limit comes from: a number of bytes (the user's, never changed but by
/// the user), the machine's limit (the default), or a percentage of it. The last two
/// follow the cgroup's limit when it changes (`container.rs`).
const FIXED: u8 = 0;
const MACHINE: u8 = 1;
const PERCENT: u8 = 2;

struct Settings {
    state: AtomicU8,
    limit: AtomicI64,
    soft: AtomicI64,
    /// The per-thread flush threshold threads pick up at their next flush.
    threshold: AtomicU64,
    heap_used: AtomicBool,
    abort: AtomicBool,
    wait_ms: AtomicU64,
    interval_ms: AtomicU64,
    refuse_min: AtomicU64,
    background_interval_ms: AtomicU64,
    report_window_ms: AtomicU64,
    /// `Untracked::Count` when true.
    count_untracked: AtomicBool,
    /// `Enforcement::Allocations` when true.
    police_allocations: AtomicBool,
    /// The purge interval in milliseconds (0: off).
    purge_interval_ms: AtomicU64,
    /// [`FIXED`], [`MACHINE`] or [`PERCENT`].
    limit_source: AtomicU8,
    /// Under [`PERCENT`]: the percentage, as `f64` bits.
    percent: AtomicU64,
    /// The soft threshold as a fraction of the limit, as `f64` bits.
    soft_ratio: AtomicU64,
    /// A cap on the soft threshold: the cgroup's `memory.high` (`i64::MAX`: none).
    soft_cap: AtomicI64,
    /// The allocation-site profile's mean bytes between samples (0: off).
    profile_sample: AtomicU64,
}

/// `Config::new`'s soft ratio, 0.85, as `f64` bits (`f64::to_bits` is not `const`
/// at the crate's MSRV; a unit test checks the value).
const DEFAULT_SOFT_RATIO_BITS: u64 = 0x3FEB_3333_3333_3333;

static SETTINGS: Settings = Settings {
    state: AtomicU8::new(UNCONFIGURED),
    limit: AtomicI64::new(i64::MAX),
    soft: AtomicI64::new(i64::MAX),
    threshold: AtomicU64::new(MIN_THRESHOLD),
    heap_used: AtomicBool::new(false),
    abort: AtomicBool::new(false),
    wait_ms: AtomicU64::new(5000),
    interval_ms: AtomicU64::new(10),
    refuse_min: AtomicU64::new(0),
    background_interval_ms: AtomicU64::new(0),
    report_window_ms: AtomicU64::new(1000),
    count_untracked: AtomicBool::new(false),
    police_allocations: AtomicBool::new(true),
    purge_interval_ms: AtomicU64::new(10_000),
    limit_source: AtomicU8::new(MACHINE),
    percent: AtomicU64::new(0),
    soft_ratio: AtomicU64::new(DEFAULT_SOFT_RATIO_BITS),
    soft_cap: AtomicI64::new(i64::MAX),
    profile_sample: AtomicU64::new(crate::base::config::DEFAULT_PROFILE_SAMPLE),
};

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Applies `config` with its limit resolved to `limit` bytes, waiting out a
/// first-use configuration another thread may be running (it must not overwrite this
/// one afterwards).
pub(crate) fn configure(config: &Config, limit: u64) {
    let first = loop {
        match SETTINGS.state.compare_exchange(UNCONFIGURED, CONFIGURING, Acquire, Relaxed) {
            Ok(_) => break true,
            Err(CONFIGURING) => std::thread::yield_now(),
            Err(_) => break false,
        }
    };
    if first {
        in_window(Window::Configure);
    }
    apply(config, limit);
    SETTINGS.state.store(READY, Release);
}

/// From the fork child handler: a first configuration another thread was running
/// when the process forked never ends in the child (that thread is gone), and
/// [`configure`] would wait for it for ever. The child has never been configured:
/// its next slow path, or `init`, configures it. Allocates nothing.
pub(crate) fn after_fork_child() {
    let _ = SETTINGS.state.compare_exchange(CONFIGURING, UNCONFIGURED, Relaxed, Relaxed);
}

/// A step of the first use that one thread takes while the others wait for it to end
/// (they spin on a flag it set, so a fork child handler must reset that flag: the
/// thread that set it does not survive the fork).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Window {
    /// The first configuration, from `MEMQUOTA_*` or `init`.
    Configure,
    /// The decision on who runs jemalloc's purging (`purge.rs`).
    DecayDecision,
    /// Applying the profile's settings (`policy/profile`).
    ProfileSettings,
}

static WINDOW_HOOK: OnceLock<fn(Window)> = OnceLock::new();

/// A test point, not part of the API: `hook` runs inside each [`Window`], on the
/// thread that holds it, once the flag that makes other threads wait is set. A test
/// parks that thread there and forks from another one (`tests/fork_windows.rs`): a
/// window a fork cuts short otherwise lasts microseconds and happens once per
/// process. Set once per process (false if a hook was set before). A panic in the
/// hook is caught. It may run inside the allocator (a first configuration on the
/// slow path, busy-marked; the decision on the exempt sampler thread): what it
/// allocates there is charged, never refused.
pub fn set_window_hook(hook: fn(Window)) -> bool {
    WINDOW_HOOK.set(hook).is_ok()
}

/// Calls the test point's hook, if one is set ([`set_window_hook`]).
pub(crate) fn in_window(window: Window) {
    if let Some(hook) = WINDOW_HOOK.get() {
        let _ = std::panic::catch_unwind(|| hook(window));
    }
}

fn apply(config: &Config, limit: u64) {
    let (source, percent) = match config.limit_setting() {
        None => (MACHINE, 0.0),
        Some(Limit::Percent(p)) => (PERCENT, p),
        Some(Limit::Bytes(_)) => (FIXED, 0.0),
    };
    SETTINGS.limit_source.store(source, Relaxed);
    SETTINGS.percent.store(percent.to_bits(), Relaxed);
    SETTINGS.soft_ratio.store(config.soft_ratio_setting().to_bits(), Relaxed);
    store_quota(limit);
    SETTINGS.heap_used.store(config.heap_setting() == HeapMode::Used, Relaxed);
    SETTINGS.abort.store(config.on_oom_setting() == OnOom::Abort, Relaxed);
    SETTINGS.wait_ms.store(ms(config.reclaim_wait_setting()), Relaxed);
    SETTINGS.interval_ms.store(ms(config.reclaim_interval_setting()), Relaxed);
    SETTINGS.refuse_min.store(config.refuse_min_setting(), Relaxed);
    SETTINGS.report_window_ms.store(ms(config.report_window_setting()), Relaxed);
    SETTINGS.count_untracked.store(config.untracked_setting() == Untracked::Count, Relaxed);
    SETTINGS.purge_interval_ms.store(config.purge_interval_setting().map_or(0, |i| ms(i).max(1)), Relaxed);
    SETTINGS.profile_sample.store(config.profile_sample_setting(), Relaxed);
}

/// The allocation-site profile's mean bytes between samples (0: off).
pub(crate) fn profile_sample() -> u64 {
    SETTINGS.profile_sample.load(Relaxed)
}

/// Whether the settings are in place (configured from `init` or the environment).
pub(crate) fn configured() -> bool {
    SETTINGS.state.load(Acquire) == READY
}

/// Whether untracked memory counts against the limit.
pub(crate) fn count_untracked() -> bool {
    SETTINGS.count_untracked.load(Relaxed)
}

/// How long dirty pages may stay resident far from the limit (`None`: off).
pub(crate) fn purge_interval() -> Option<Duration> {
    match SETTINGS.purge_interval_ms.load(Relaxed) {
        0 => None,
        ms => Some(Duration::from_millis(ms)),
    }
}

/// Reads `MEMQUOTA_*` the first time any slow path runs. A bad value must never leave
/// the process silently unlimited: it prints the error and exits with status 2.
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
    in_window(Window::Configure);
    match Config::from_env().and_then(|c| c.resolve_limit().map(|limit| (c, limit))) {
        Ok((config, limit)) => apply(&config, limit),
        Err(e) => {
            crate::base::text::write_stderr(&format!("{e}\n"));
            std::process::exit(2);
        }
    }
    SETTINGS.state.store(READY, Release);
}

/// Changes only the limit, keeping the soft ratio as a fraction of it. A limit set
/// here is the user's: it no longer follows the cgroup's.
pub fn set_limit(bytes: u64) {
    ensure_configured();
    SETTINGS.limit_source.store(FIXED, Relaxed);
    store_quota(bytes);
}

/// The soft threshold as a fraction of the limit.
pub(crate) fn soft_ratio() -> f64 {
    f64::from_bits(SETTINGS.soft_ratio.load(Relaxed))
}

/// Whether the limit follows the machine's (the default, or a percentage of it).
pub(crate) fn limit_follows_machine() -> bool {
    SETTINGS.limit_source.load(Relaxed) != FIXED
}

/// The machine's limit is now `machine` bytes (the cgroup's limit, else RAM): a
/// limit that follows it moves. Returns whether the limit changed. Not before the
/// configuration is read (it would overwrite this).
pub(crate) fn follow_machine_limit(machine: u64) -> bool {
    if SETTINGS.state.load(Acquire) != READY {
        return false;
    }
    let percent = f64::from_bits(SETTINGS.percent.load(Relaxed));
    let Some(limit) = followed(SETTINGS.limit_source.load(Relaxed), percent, machine) else { return false };
    if i64::try_from(limit).unwrap_or(i64::MAX) == SETTINGS.limit.load(Relaxed) {
        return false;
    }
    store_quota(limit);
    true
}

/// The limit a limit from `source` takes when the machine's is `machine` bytes, as
/// `Config::resolve_limit` computes it at start (`None`: a fixed limit stays).
fn followed(source: u8, percent: f64, machine: u64) -> Option<u64> {
    let limit = match source {
        MACHINE => machine,
        PERCENT => ((machine as f64) * percent / 100.0) as u64,
        _ => return None,
    };
    Some(limit.max(1))
}

/// Caps the soft threshold at `cap` bytes (the cgroup's `memory.high`), or lifts the
/// cap: the soft threshold is then `min(limit x soft ratio, cap)`.
pub(crate) fn set_soft_cap(cap: Option<u64>) {
    let cap = cap.map_or(i64::MAX, |c| i64::try_from(c).unwrap_or(i64::MAX));
    if SETTINGS.soft_cap.swap(cap, Relaxed) != cap {
        store_quota(u64::try_from(SETTINGS.limit.load(Relaxed)).unwrap_or(0));
    }
}

/// Stores the limit with the soft threshold that goes with it: the soft ratio of
/// it, capped by `memory.high`. A reader may see one writer's limit with another's
/// soft threshold for one request, as with every setting here.
fn store_quota(limit: u64) {
    let q = Quota::new(limit, soft_ratio()).soft_capped(SETTINGS.soft_cap.load(Relaxed));
    SETTINGS.limit.store(q.limit, Relaxed);
    SETTINGS.soft.store(q.soft, Relaxed);
    SETTINGS.threshold.store(threshold_for(q.limit as u64), Relaxed);
}

/// The limit and the soft threshold.
pub(crate) fn quota() -> Quota {
    Quota { limit: SETTINGS.limit.load(Relaxed), soft: SETTINGS.soft.load(Relaxed) }
}

/// The per-thread flush threshold.
pub(crate) fn threshold() -> u64 {
    SETTINGS.threshold.load(Relaxed)
}

/// Which heap figure counts.
pub(crate) fn heap_mode() -> HeapMode {
    if SETTINGS.heap_used.load(Relaxed) {
        HeapMode::Used
    } else {
        HeapMode::Committed
    }
}

/// Whether a refusal aborts (`MEMQUOTA_ON_OOM=abort`).
pub(crate) fn abort_on_oom() -> bool {
    SETTINGS.abort.load(Relaxed)
}

/// The smallest request that may be refused.
pub(crate) fn refuse_min() -> u64 {
    SETTINGS.refuse_min.load(Relaxed)
}

/// How long a request waits for a reclaim another thread runs.
pub(crate) fn reclaim_wait() -> Duration {
    Duration::from_millis(SETTINGS.wait_ms.load(Relaxed))
}

/// The least time between two reclaims.
pub(crate) fn reclaim_interval() -> Duration {
    Duration::from_millis(SETTINGS.interval_ms.load(Relaxed))
}

/// The least time from the end of a reclaim to the start of a background one.
pub(crate) fn background_interval() -> Duration {
    Duration::from_millis(SETTINGS.background_interval_ms.load(Relaxed))
}

/// Spaces background reclaims at least `gap` after the end of the previous reclaim,
/// for a runtime whose reclaim is costly (the JVM driver sets its own). Synchronous
/// reclaims keep the configured minimum interval.
// Its one caller is the `jvm` feature's driver: a build without it (a plain Rust
// program, memquota-datafusion) would warn.
#[cfg_attr(not(feature = "jvm"), allow(dead_code))]
pub(crate) fn set_background_interval(gap: Duration) {
    SETTINGS.background_interval_ms.store(ms(gap), Relaxed);
}

/// The OOM report window.
pub(crate) fn report_window() -> Duration {
    Duration::from_millis(SETTINGS.report_window_ms.load(Relaxed))
}

/// Where the budget is enforced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enforcement {
    /// Every allocation may wait for a reclaim and be refused (the default).
    Allocations,
    /// Allocations are only counted (and ask for a background reclaim under
    /// pressure); only explicit gates wait and refuse. For a process whose own threads
    /// die on a failed malloc, a JVM: its gate is `Unsafe.allocateMemory`, whose
    /// callers handle the refusal.
    Gates,
}

/// Chooses where the budget is enforced.
pub fn set_enforcement(e: Enforcement) {
    SETTINGS.police_allocations.store(e == Enforcement::Allocations, Relaxed);
}

/// Whether allocations themselves are policed ([`Enforcement::Allocations`]).
pub(crate) fn policing_allocations() -> bool {
    SETTINGS.police_allocations.load(Relaxed)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_default_soft_ratio_is_configs() {
        assert_eq!(DEFAULT_SOFT_RATIO_BITS, Config::new().soft_ratio_setting().to_bits());
    }

    #[test]
    fn a_limit_in_bytes_stays_and_the_others_follow_the_machine() {
        assert_eq!(followed(FIXED, 0.0, 1 << 30), None);
        assert_eq!(followed(MACHINE, 0.0, 1 << 30), Some(1 << 30));
        assert_eq!(followed(PERCENT, 50.0, 1 << 30), Some(1 << 29));
        assert_eq!(followed(PERCENT, 0.0001, 1), Some(1), "never 0");
        // As the start computes it, so that the first reading changes nothing.
        let c = Config::new().limit_percent(75.0);
        assert_eq!(followed(PERCENT, 75.0, crate::base::host::memory_limit()), c.resolve_limit().ok());
    }
}
