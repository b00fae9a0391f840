//! Budget-aware purging: when jemalloc's freed pages go back to the system.
//!
//! jemalloc keeps the pages of freed blocks resident ("dirty") for reuse. By default
//! it purges them on a 10 s decay, inline on whichever thread allocates next, and at
//! once when a freed extent of 8 MiB or more coalesces: a program that allocates and
//! frees large blocks pays a page fault for each page it uses again (docs/benchmarks.md,
//! the large-block loop). memquota holds the budget, so it knows when resident memory
//! matters:
//!
//! * Far from the limit nothing purges on an allocating thread: jemalloc's
//!   time-based purging is off (`dirty_decay_ms` and `muzzy_decay_ms` -1 on every
//!   arena, which also turns off the eager purge of large extents).
//! * The purge service (the sampler thread of `sampler.rs`, every 50 ms, every
//!   10 ms while the process is past its soft threshold, and at once when asked)
//!   purges when the process's resident memory as it sees it passes the limit with
//!   at least [`Quota::dirty_floor`] dirty, the fullest arenas until the excess is
//!   covered (below the limit dirty pages may use the room the budget's own bytes
//!   leave); every arena after every reclaim;
//!   under container pressure ([`under_pressure`]); and when dirty pages have waited
//!   a whole purge interval (`MEMQUOTA_PURGE_INTERVAL`). Its view: native + counted
//!   heap + the resident bytes the budget does not count: the process's anonymous
//!   RSS past those two (dirty pages, jemalloc's metadata, and untracked memory even
//!   under `MEMQUOTA_UNTRACKED=report`: resident whether counted or not). A grant on
//!   the slow path that finds the last measurement past the limit wakes it at once.
//! * A user's own decay or background-thread options win (`MALLOC_CONF`,
//!   `_RJEM_MALLOC_CONF`, a compiled-in `malloc_conf`, or a value set at run time
//!   before memquota looked): jemalloc's decay is left as they set it and there is no
//!   interval purge; the budget's purges still run.
//! * A fork child has no service thread: its first slow path gives jemalloc its own
//!   decay back.
//!
//! No lock of memquota's is held while jemalloc purges, and the service thread is
//! exempt (its allocations are charged, never refused or made to wait).

use crate::base::quota::Quota;
use crate::base::stats::{ctl, JemallocStats};
use crate::base::sync::{AtomicBool, AtomicU64, AtomicU8, OnceLock, Ordering::*};
use std::ffi::CStr;
use std::thread::Thread;
use std::time::{Duration, Instant};

/// Why a purge ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Native, heap and uncounted resident bytes passed the limit.
    Budget = 0,
    /// A reclaim ran: what it freed leaves the process.
    Reclaim = 1,
    /// Container memory pressure.
    Pressure = 2,
    /// Dirty pages waited a whole purge interval.
    Idle = 3,
}

impl Kind {
    const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// Who runs jemalloc's purging.
const UNDECIDED: u8 = 0;
const DECIDING: u8 = 1;
/// memquota: decay off, the service purges.
const OURS: u8 = 2;
/// The user's own jemalloc options.
const USERS: u8 = 3;
/// jemalloc's own decay, given back in a fork child.
const RESTORED: u8 = 4;

static DECAY: AtomicU8 = AtomicU8::new(UNDECIDED);
/// Set by the fork child handler while jemalloc's decay still waits to be restored.
static ORPHANED: AtomicBool = AtomicBool::new(false);
/// The service thread, woken by [`request`].
static SERVICE: OnceLock<Thread> = OnceLock::new();
/// Requests not served yet: one [`Kind::bit`] each.
static REQUESTS: AtomicU8 = AtomicU8::new(0);
/// The service's last measurement of the resident bytes the budget does not count
/// ([`uncounted`]) and of jemalloc's dirty bytes, for the slow path's check.
static UNCOUNTED: AtomicU64 = AtomicU64::new(0);
static DIRTY: AtomicU64 = AtomicU64::new(0);
/// Purges run, by [`Kind`], and the bytes they returned.
static PURGES: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];
static PURGED: AtomicU64 = AtomicU64::new(0);

/// jemalloc's defaults (5.3): `opt.dirty_decay_ms`, `opt.muzzy_decay_ms`.
const DEFAULT_DIRTY_DECAY_MS: isize = 10_000;
const DEFAULT_MUZZY_DECAY_MS: isize = 0;
/// The options through which a user chooses how jemalloc purges.
const PURGING_OPTIONS: [&str; 3] = ["dirty_decay_ms", "muzzy_decay_ms", "background_thread"];
/// The option that sends blocks of 1 MiB and more to one shared arena (jemalloc's
/// "huge" arena; its default is 8 MiB), added by [`added_jemalloc_options`].
const SHARED_LARGE_ARENA: &str = "oversize_threshold:1048576";

/// The jemalloc option the preload puts in front of jemalloc's options strings when it
/// starts (`ld_preload/src/process/malloc_conf.rs`; the Rust face's jemalloc has started before
/// memquota can say anything): blocks of 1 MiB and more share one arena, so that a
/// block one thread frees is a dirty page any thread can use again. Under a tight
/// budget the service purges what passes the limit; with each thread's large blocks
/// in its own arena, more of them wait unused, and more are purged and faulted back.
/// It takes page faults down on the JVM benchmark's agent run (docs/benchmarks.md,
/// "Figures behind the code"). None if a string already chooses how jemalloc purges or
/// sets the threshold: under a user's decay, jemalloc purges that arena's freed blocks
/// at once (its eager purge of huge blocks), which made the large-block loop several
/// times slower with the threshold at 1 MiB. Allocates nothing: it runs while
/// jemalloc starts.
pub fn added_jemalloc_options(strings: &[&str]) -> Option<&'static str> {
    let chooses = |s: &&str| names_purging(s) || names(s, &["oversize_threshold"]);
    (!strings.iter().any(chooses)).then_some(SHARED_LARGE_ARENA)
}

/// Asks the service for a purge of kind `kind` (at most one wake per kind until it is
/// served). Takes no lock and does not allocate.
pub(crate) fn request(kind: Kind) {
    let bit = kind.bit();
    // A load first: near the limit every slow path may come here.
    if REQUESTS.load(Relaxed) & bit != 0 || REQUESTS.fetch_or(bit, AcqRel) & bit != 0 {
        return;
    }
    if let Some(service) = SERVICE.get() {
        service.unpark();
    }
}

/// Wakes the service thread for a pass now (the flight recorder's request). Takes no
/// lock and does not allocate.
pub(crate) fn wake_service() {
    if let Some(service) = SERVICE.get() {
        service.unpark();
    }
}

/// The container-pressure path's entry (`container.rs`: the cgroup's anonymous
/// memory past its line, a PSI event): purge now, in the background.
pub(crate) fn under_pressure() {
    request(Kind::Pressure);
}

/// After a grant left `native` next to `outside` (what the budget counts beside
/// it): wakes the service when the last measurement of the resident bytes the budget
/// does not count puts the process past its limit and jemalloc's dirty pages are
/// worth a purge. Two relaxed loads otherwise.
pub(crate) fn after_grant(quota: Quota, native: i64, outside: i64) {
    let dirty = DIRTY.load(Relaxed);
    if dirty >= quota.dirty_floor() && past(quota, quota.limit, native, outside, UNCOUNTED.load(Relaxed)) {
        request(Kind::Budget);
    }
}

/// Resident bytes the budget does not count: the process's anonymous RSS past
/// `native` + `outside` (jemalloc's dirty pages and metadata, untracked memory), as
/// the kernel counts it, kept up by [`still_resident`] from `before` (the kernel's
/// count at the service's last pass) while a new block is not yet written.
/// jemalloc's own `resident` is an upper bound: it counts the untouched pages it pads
/// large blocks with (a 1 MiB block takes a 1.25 MiB extent). Without `/proc`,
/// jemalloc's unused bytes and the last sample of untracked memory unless the budget
/// counts it. Returns the estimate and the kernel's count (0 without `/proc`).
fn uncounted(je: &JemallocStats, native: i64, outside: i64, before: u64) -> (u64, u64) {
    let anon = crate::base::host::anon_rss();
    if anon > 0 {
        let now = anon.saturating_sub(u64::try_from(native.saturating_add(outside)).unwrap_or(0));
        return (still_resident(now, before, je.dirty), now);
    }
    let untracked =
        if crate::base::settings::count_untracked() { 0 } else { crate::policy::heap_probe::untracked() };
    (je.unused().saturating_add(untracked), 0)
}

/// The uncounted resident bytes: `now` as the kernel counts them, or `before` (its
/// count at the service's last pass) as far as jemalloc still holds that many dirty
/// bytes. A block counts in `native` as soon as it is granted, but in the anonymous
/// RSS only once its pages are written: right after a large grant the kernel's count
/// of the uncounted bytes drops, though no page left, and the pages about to be
/// written come on top of the dirty ones. Under memquota's purging (no decay) dirty
/// pages leave only by a purge, after which `before` is measured anew, or by reuse,
/// which lowers `dirty`. jemalloc's `dirty` alone would not do: it counts the
/// untouched pages of its extents too (the "Purging" section of docs/design.md).
/// Read the kernel's count only, TPC-H query 18 at 256 MiB went 0.05 L past the limit
/// in anonymous memory (the median of 5 runs; docs/benchmarks.md, "Peak RSS: the
/// anonymous part and the code pages"). Pure.
fn still_resident(now: u64, before: u64, dirty: u64) -> u64 {
    now.max(before.min(dirty))
}

/// The service's view of the process: native + outside + `uncounted` resident bytes.
fn resident(native: i64, outside: i64, uncounted: u64) -> i64 {
    native.saturating_add(outside).saturating_add(i64::try_from(uncounted).unwrap_or(i64::MAX))
}

/// Whether the [`resident`] view is past `line` (the limit or the soft threshold of
/// `quota`; no line without a limit).
fn past(quota: Quota, line: i64, native: i64, outside: i64, uncounted: u64) -> bool {
    quota.limit != i64::MAX && resident(native, outside, uncounted) > line
}

/// What one pass of the service saw.
#[derive(Clone, Copy, Debug)]
struct Seen {
    requests: u8,
    quota: Quota,
    native: i64,
    outside: i64,
    uncounted: u64,
    dirty: u64,
    /// Since the last purge (or the service's start).
    idle_for: Duration,
    interval: Option<Duration>,
    ours: bool,
}

impl Seen {
    /// How far the [`resident`] view stands past the limit.
    fn excess(&self) -> u64 {
        let over = resident(self.native, self.outside, self.uncounted).saturating_sub(self.quota.limit);
        u64::try_from(over).unwrap_or(0)
    }
}

/// Whether to purge now, and why: the policy, pure.
fn decide(s: &Seen) -> Option<Kind> {
    if s.dirty == 0 {
        None
    } else if s.requests & Kind::Pressure.bit() != 0 {
        Some(Kind::Pressure)
    } else if s.requests & Kind::Reclaim.bit() != 0 {
        Some(Kind::Reclaim)
    } else if s.dirty >= s.quota.dirty_floor()
        && past(s.quota, s.quota.limit, s.native, s.outside, s.uncounted)
    {
        Some(Kind::Budget)
    } else if s.ours && s.interval.is_some_and(|i| s.idle_for >= i) {
        Some(Kind::Idle)
    } else {
        None
    }
}

/// The service's period while native + heap + uncounted bytes are past the soft
/// threshold: short enough that a budget kept full peaks no higher than under
/// jemalloc's own decay, with fewer page faults (docs/benchmarks.md, "Figures behind
/// the code").
const CROWDED_PERIOD: Duration = Duration::from_millis(10);

/// The purge service's state, kept by its thread.
pub(crate) struct Service {
    last_purge: Instant,
    /// The last pass found the process past the soft threshold.
    crowded: bool,
    /// The kernel's count of the uncounted resident bytes at the last pass (after
    /// its purge).
    uncounted: u64,
}

impl Service {
    /// On the service thread, once: registers it for wake-ups and takes jemalloc's
    /// purging over (unless the user's options say how to purge).
    pub(crate) fn start() -> Service {
        let _ = SERVICE.set(std::thread::current());
        take_over_decay();
        Service { last_purge: Instant::now(), crowded: false, uncounted: 0 }
    }

    /// One pass over `je`, jemalloc's statistics read just now: purges if
    /// [`decide`] says so, and publishes what the slow path checks.
    pub(crate) fn serve(&mut self, je: &JemallocStats) {
        let requests = REQUESTS.swap(0, AcqRel);
        let (native, outside) =
            (crate::ledger::threads::ACCOUNT.native(), crate::policy::heap_probe::outside());
        let (estimate, kernels) = uncounted(je, native, outside, self.uncounted);
        let seen = Seen {
            requests,
            quota: crate::base::settings::quota(),
            native,
            outside,
            uncounted: estimate,
            dirty: je.dirty,
            idle_for: self.last_purge.elapsed(),
            interval: crate::base::settings::purge_interval(),
            ours: DECAY.load(Acquire) == OURS,
        };
        let now = match decide(&seen) {
            Some(kind) => {
                // Past the limit only the excess (and a floor's margin) goes: the
                // other arenas' dirty pages stay for reuse.
                let want =
                    (kind == Kind::Budget).then(|| seen.excess().saturating_add(seen.quota.dirty_floor()));
                let after = purge(kind, je, want);
                self.last_purge = Instant::now();
                after
            }
            None => *je,
        };
        let (uncounted, kernels) = uncounted(&now, native, outside, kernels);
        // The kernel's count, not the estimate: a block not yet written is written
        // within a pass or two, and a carried estimate would outlive the dirty
        // pages' reuse.
        self.uncounted = kernels;
        UNCOUNTED.store(uncounted, Relaxed);
        DIRTY.store(now.dirty, Relaxed);
        self.crowded = past(seen.quota, seen.quota.soft, seen.native, seen.outside, uncounted);
    }

    /// Parks the service thread until its next pass: after `period`, or
    /// [`CROWDED_PERIOD`] past the soft threshold, or when a request comes.
    pub(crate) fn wait(&self, period: Duration) {
        if REQUESTS.load(Acquire) == 0 {
            let period = if self.crowded { period.min(CROWDED_PERIOD) } else { period };
            // A period, woken early by `request`: a spurious return only means an
            // early pass.
            std::thread::park_timeout(period);
        }
    }
}

/// Purges the dirty pages of every arena, or with `want`, of the arenas with the most
/// until at least `want` bytes go; counts it, and returns the statistics after.
/// Allocates nothing: the service's allocations are charged like any thread's, and
/// a block in flight would show in the exact checks of a quiet process.
fn purge(kind: Kind, before: &JemallocStats, want: Option<u64>) -> JemallocStats {
    match want {
        None => {
            let _ = by_index(c"arena.0.purge", 1, MALLCTL_ARENAS_ALL, |mib| ctl_by_mib(mib, &mut ()));
        }
        Some(want) => {
            let mut got = 0u64;
            // The fullest, again while less than `want` went (the statistics are
            // read anew after each purge, so a purged arena reads empty).
            while got < want {
                let arenas = ctl::<u32>(c"arenas.narenas").unwrap_or(0);
                let Some((arena, bytes)) = fullest(arenas, dirty_by_arena) else { break };
                let _ = by_index(c"arena.0.purge", 1, arena, |mib| ctl_by_mib(mib, &mut ()));
                got = got.saturating_add(bytes);
                let _ = tikv_jemalloc_ctl::epoch::advance();
            }
        }
    }
    let after = JemallocStats::read();
    PURGES[kind as usize].fetch_add(1, Relaxed);
    PURGED.fetch_add(after.purged.saturating_sub(before.purged), Relaxed);
    after
}

/// jemalloc's name for all arenas at once in `arena.<i>.*` and `stats.arenas.<i>.*`.
const MALLCTL_ARENAS_ALL: u32 = 4096;

/// Runs `f` on the MIB of the control `name` with its component `at` set to `index`
/// (`arena.0.purge`, component 1): no name to format, nothing allocated.
fn by_index<T>(name: &CStr, at: usize, index: u32, f: impl FnOnce(&[usize]) -> Option<T>) -> Option<T> {
    let mut mib = [0usize; 4];
    let mut len = mib.len();
    // SAFETY: a NUL-terminated name; jemalloc writes at most `len` components to
    // `mib` and the number written to `len`.
    if unsafe { tikv_jemalloc_sys::mallctlnametomib(name.as_ptr(), mib.as_mut_ptr(), &mut len) } != 0
        || at >= len
    {
        return None;
    }
    mib[at] = index as usize;
    f(&mib[..len])
}

/// Reads a control by MIB into `value` (nothing for `()`, a control that only acts).
fn ctl_by_mib<T>(mib: &[usize], value: &mut T) -> Option<()> {
    let mut size = std::mem::size_of::<T>();
    let (old, old_len) = if size == 0 {
        (std::ptr::null_mut(), std::ptr::null_mut())
    } else {
        (std::ptr::from_mut(value).cast(), std::ptr::from_mut(&mut size))
    };
    // SAFETY: a MIB jemalloc made; `old` is null or points to a `T` of `size` bytes,
    // the size of the statistic read (jemalloc refuses a size that differs); no input.
    let done = unsafe {
        tikv_jemalloc_sys::mallctlbymib(mib.as_ptr(), mib.len(), old, old_len, std::ptr::null_mut(), 0)
    };
    (done == 0).then_some(())
}

/// Arena `arena`'s dirty bytes, from the statistics of the last `epoch`; `None` for
/// an arena never made.
fn dirty_by_arena(arena: u32) -> Option<u64> {
    let mut pages = 0usize;
    by_index(c"stats.arenas.0.pdirty", 2, arena, |mib| ctl_by_mib(mib, &mut pages))?;
    Some((pages as u64).saturating_mul(crate::base::stats::page_size()))
}

/// The arena with the most dirty bytes, and how many, among the first `arenas`, as
/// `dirty` reads them; `None` if none has any. Purging the fullest first, as few
/// pages leave as it takes and the others stay for reuse. Pure.
fn fullest(arenas: u32, dirty: impl Fn(u32) -> Option<u64>) -> Option<(u32, u64)> {
    (0..arenas)
        .filter_map(|i| Some((i, dirty(i)?)))
        .filter(|&(_, bytes)| bytes > 0)
        .max_by_key(|&(_, bytes)| bytes)
}

/// The purges so far.
pub(crate) struct Counts {
    pub(crate) budget: u64,
    pub(crate) reclaim: u64,
    pub(crate) pressure: u64,
    pub(crate) idle: u64,
    /// Bytes they returned.
    pub(crate) bytes: u64,
}

/// The purges run so far, by kind, and the bytes they returned.
pub(crate) fn counts() -> Counts {
    let n = |k: Kind| PURGES[k as usize].load(Relaxed);
    Counts {
        budget: n(Kind::Budget),
        reclaim: n(Kind::Reclaim),
        pressure: n(Kind::Pressure),
        idle: n(Kind::Idle),
        bytes: PURGED.load(Relaxed),
    }
}

/// Whether memquota runs jemalloc's purging (rather than the user's options).
pub(crate) fn by_memquota() -> bool {
    DECAY.load(Acquire) == OURS
}

/// Turns jemalloc's time-based purging off, unless the user chose how jemalloc
/// purges; once per process. Call it only where the purge service runs or is about to
/// start, outside any jemalloc call. A second caller waits for the first to decide.
pub(crate) fn take_over_decay() {
    if DECAY.compare_exchange(UNDECIDED, DECIDING, AcqRel, Acquire).is_err() {
        while DECAY.load(Acquire) == DECIDING {
            std::thread::yield_now();
        }
        return;
    }
    crate::base::settings::in_window(crate::base::settings::Window::DecayDecision);
    let decided = if users_own_purging() {
        USERS
    } else {
        set_decay(-1, -1);
        OURS
    };
    DECAY.store(decided, Release);
}

/// Gives jemalloc its own decay back after [`take_over_decay`] took it for a service
/// thread that then could not start: nothing would purge otherwise.
pub(crate) fn give_back_decay() {
    if DECAY.compare_exchange(OURS, RESTORED, AcqRel, Acquire).is_ok() {
        restore_decay();
    }
}

/// jemalloc's decay as its options (or defaults) set it.
fn restore_decay() {
    let dirty = ctl::<isize>(c"opt.dirty_decay_ms").unwrap_or(DEFAULT_DIRTY_DECAY_MS);
    let muzzy = ctl::<isize>(c"opt.muzzy_decay_ms").unwrap_or(DEFAULT_MUZZY_DECAY_MS);
    set_decay(dirty, muzzy);
}

/// From the fork child handler: the service thread did not survive the fork.
/// Allocates nothing and calls no jemalloc (its locks may still be held).
///
/// A decision another thread was making when the process forked never ends in the
/// child, and [`take_over_decay`] (the child's `init`) would wait for it for ever. It
/// may have turned the decay off on some arenas already: the child takes it as made
/// for memquota, so its first slow path gives jemalloc its own decay back.
pub(crate) fn after_fork_child() {
    let _ = DECAY.compare_exchange(DECIDING, OURS, Relaxed, Relaxed);
    if DECAY.load(Relaxed) == OURS {
        ORPHANED.store(true, Relaxed);
    }
}

/// From the slow path, outside any jemalloc call: in a fork child whose decay
/// memquota had turned off, gives jemalloc its own decay back (nothing purges there
/// otherwise). One relaxed load elsewhere.
pub(crate) fn settle_after_fork() {
    if ORPHANED.load(Relaxed) && ORPHANED.swap(false, AcqRel) {
        restore_decay();
        DECAY.store(RESTORED, Release);
    }
}

/// Whether the user told jemalloc how to purge: a decay or background-thread option
/// that differs from jemalloc's default or is named in any of its options strings,
/// or a decay changed at run time.
fn users_own_purging() -> bool {
    let opt_dirty = ctl::<isize>(c"opt.dirty_decay_ms");
    let opt_muzzy = ctl::<isize>(c"opt.muzzy_decay_ms");
    let changed = opt_dirty != Some(DEFAULT_DIRTY_DECAY_MS)
        || opt_muzzy != Some(DEFAULT_MUZZY_DECAY_MS)
        || ctl::<isize>(c"arenas.dirty_decay_ms") != opt_dirty
        || ctl::<isize>(c"arenas.muzzy_decay_ms") != opt_muzzy
        || ctl::<u8>(c"opt.background_thread") == Some(1)
        || ctl::<u8>(c"background_thread") == Some(1);
    changed || options_strings().iter().any(|s| names_purging(s))
}

/// jemalloc's options strings: built in (`config.malloc_conf`), the program's
/// `_rjem_malloc_conf`, and the variables (the preload hands jemalloc `MALLOC_CONF`
/// too, `ld_preload/src/process/malloc_conf.rs`).
fn options_strings() -> Vec<String> {
    let mut found = Vec::new();
    // SAFETY: `config.malloc_conf` is a `const char *`, a NUL-terminated string.
    if let Ok(built_in) = unsafe { tikv_jemalloc_ctl::raw::read_str(b"config.malloc_conf\0") } {
        found.push(String::from_utf8_lossy(built_in.strip_suffix(b"\0").unwrap_or(built_in)).into_owned());
    }
    // SAFETY: jemalloc reads this variable as null or a NUL-terminated string that
    // lives as long as the program.
    if let Some(p) = unsafe { tikv_jemalloc_sys::malloc_conf } {
        // SAFETY: as above: non-null here, NUL-terminated.
        found.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
    }
    for var in ["MALLOC_CONF", "_RJEM_MALLOC_CONF"] {
        if let Some(v) = std::env::var_os(var) {
            found.push(v.to_string_lossy().into_owned());
        }
    }
    found
}

/// Whether a jemalloc options string (`name:value,...`) sets a purging option.
fn names_purging(options: &str) -> bool {
    names(options, &PURGING_OPTIONS)
}

/// Whether a jemalloc options string sets one of `options`.
fn names(options: &str, among: &[&str]) -> bool {
    options.split(',').any(|pair| among.contains(&pair.split(':').next().unwrap_or("").trim()))
}

/// Sets the decay of arenas created from now on and of every existing one.
fn set_decay(dirty_ms: isize, muzzy_ms: isize) {
    write_ctl(c"arenas.dirty_decay_ms", dirty_ms);
    write_ctl(c"arenas.muzzy_decay_ms", muzzy_ms);
    let arenas = ctl::<u32>(c"arenas.narenas").unwrap_or(0);
    for (name, ms) in [(c"arena.0.dirty_decay_ms", dirty_ms), (c"arena.0.muzzy_decay_ms", muzzy_ms)] {
        let mut mib = [0usize; 3];
        if tikv_jemalloc_ctl::raw::name_to_mib(name.to_bytes_with_nul(), &mut mib).is_err() {
            continue;
        }
        for i in 0..arenas as usize {
            mib[1] = i;
            // SAFETY: an `arena.<i>.*_decay_ms` control takes an `ssize_t`. An arena
            // not created yet answers EFAULT: it will take `arenas.*_decay_ms`.
            let _ = unsafe { tikv_jemalloc_ctl::raw::write_mib(&mib, ms) };
        }
    }
}

/// Writes an `ssize_t` control (jemalloc refuses a value of another size).
fn write_ctl(name: &CStr, value: isize) {
    // SAFETY: a NUL-terminated name and a plain value jemalloc copies if its size fits.
    let _ = unsafe { tikv_jemalloc_ctl::raw::write::<isize>(name.to_bytes_with_nul(), value) };
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn seen() -> Seen {
        Seen {
            requests: 0,
            quota: Quota::new(1 << 30, 0.85),
            native: 100 << 20,
            outside: 0,
            uncounted: 64 << 20,
            dirty: 60 << 20,
            idle_for: Duration::from_secs(1),
            interval: Some(Duration::from_secs(10)),
            ours: true,
        }
    }

    #[test]
    fn far_from_the_limit_nothing_purges_until_the_interval() {
        assert_eq!(decide(&seen()), None);
        let s = Seen { idle_for: Duration::from_secs(10), ..seen() };
        assert_eq!(decide(&s), Some(Kind::Idle));
        assert_eq!(decide(&Seen { interval: None, ..s }), None, "interval off");
        assert_eq!(decide(&Seen { ours: false, ..s }), None, "the user's decay replaces it");
        assert_eq!(decide(&Seen { dirty: 0, ..s }), None, "nothing to purge");
    }

    #[test]
    fn dirty_pages_may_fill_the_room_under_the_limit_and_no_more() {
        let q = Quota::new(1 << 30, 0.85);
        // 900 MiB native + 100 MiB uncounted: past the soft threshold (870.4 MiB), not
        // past the limit. The dirty pages use room the budget does not: no purge.
        let between = Seen { native: 900 << 20, uncounted: 100 << 20, ..seen() };
        assert_eq!(decide(&between), None);
        // 990 MiB native + 60 MiB uncounted (dirty pages included) > 1 GiB: purge.
        let past_it = Seen { native: 990 << 20, uncounted: 60 << 20, ..seen() };
        assert_eq!(decide(&past_it), Some(Kind::Budget));
        // The heap counts, and so does untracked memory in the uncounted bytes; the
        // user's own decay does not stop a budget purge.
        let heap =
            Seen { native: 500 << 20, outside: 500 << 20, uncounted: 100 << 20, ours: false, ..seen() };
        assert_eq!(decide(&heap), Some(Kind::Budget));
        // Under the floor (a 256th of the limit, 4 MiB here) a purge is not worth it.
        assert_eq!(q.dirty_floor(), 4 * MIB);
        assert_eq!(decide(&Seen { dirty: 4 * MIB - 1, ..past_it }), None);
        assert_eq!(decide(&Seen { dirty: 4 * MIB, ..past_it }), Some(Kind::Budget));
        // No limit: never past it.
        assert_eq!(decide(&Seen { quota: Quota::new(u64::MAX, 0.85), native: i64::MAX, ..past_it }), None);
    }

    #[test]
    fn a_block_not_yet_written_does_not_hide_the_dirty_pages() {
        // The last pass: 42 MiB resident past the counted bytes, 52 MiB dirty. A
        // 31 MiB block is granted and not yet written: the kernel's count drops to
        // 11 MiB, no page having left. The 42 MiB still count.
        assert_eq!(still_resident(11 * MIB, 42 * MIB, 52 * MIB), 42 * MIB);
        // The block reused 30 MiB of the dirty pages: as far as they are gone.
        assert_eq!(still_resident(11 * MIB, 42 * MIB, 22 * MIB), 22 * MIB);
        // More past the counted bytes now than before: the kernel's count.
        assert_eq!(still_resident(60 * MIB, 42 * MIB, 52 * MIB), 60 * MIB);
        // jemalloc's dirty bytes alone, which count untouched pages too, never raise
        // the kernel's count.
        assert_eq!(still_resident(184 * MIB, 184 * MIB, 296 * MIB), 184 * MIB);
        assert_eq!(still_resident(5 * MIB, 0, 296 * MIB), 5 * MIB);
    }

    #[test]
    fn past_the_limit_the_fullest_arena_goes_first() {
        let dirty = [Some(10 * MIB), Some(40 * MIB), Some(0), None, Some(25 * MIB)];
        let read = |i: u32| dirty.get(i as usize).copied().flatten();
        assert_eq!(fullest(5, read), Some((1, 40 * MIB)));
        assert_eq!(fullest(5, |_| Some(0)), None, "never an arena with nothing dirty");
        assert_eq!(fullest(5, |_| None), None);
        // The excess counts native, the heap and the uncounted bytes over the limit.
        let s = Seen { native: 1000 << 20, outside: 20 << 20, uncounted: 30 << 20, ..seen() };
        assert_eq!(s.excess(), 26 * MIB);
        assert_eq!(seen().excess(), 0, "under the limit");
    }

    #[test]
    fn requests_purge_whatever_is_dirty() {
        under_pressure();
        let requests = REQUESTS.swap(0, AcqRel);
        assert_eq!(decide(&Seen { requests, dirty: 4096, ..seen() }), Some(Kind::Pressure));
        let reclaim = Kind::Reclaim.bit();
        assert_eq!(decide(&Seen { requests: reclaim, dirty: 4096, ..seen() }), Some(Kind::Reclaim));
        assert_eq!(decide(&Seen { requests: reclaim, dirty: 0, ..seen() }), None);
    }

    #[test]
    fn floors_scale_with_the_limit() {
        assert_eq!(Quota::new(64 << 20, 0.85).dirty_floor(), MIB);
        assert_eq!(Quota::new(16 << 30, 0.85).dirty_floor(), 64 * MIB);
        assert_eq!(Quota::new(u64::MAX, 0.85).dirty_floor(), 64 * MIB);
    }

    #[test]
    fn purging_options_are_recognised_by_name() {
        assert!(names_purging("narenas:2,dirty_decay_ms:10000"));
        assert!(names_purging("background_thread:true"));
        assert!(names_purging(" muzzy_decay_ms:0"));
        assert!(!names_purging("narenas:2,tcache:false"));
        assert!(!names_purging(""));
    }

    #[test]
    fn large_blocks_share_an_arena_unless_the_user_chose_how_jemalloc_purges() {
        assert_eq!(added_jemalloc_options(&[]), Some(SHARED_LARGE_ARENA));
        assert_eq!(added_jemalloc_options(&["narenas:2", ""]), Some(SHARED_LARGE_ARENA));
        assert_eq!(added_jemalloc_options(&["narenas:2", "dirty_decay_ms:10000"]), None);
        assert_eq!(added_jemalloc_options(&["background_thread:true"]), None);
        assert_eq!(
            added_jemalloc_options(&["tcache:false,oversize_threshold:0"]),
            None,
            "the user's own threshold"
        );
    }
}
