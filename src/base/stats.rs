//! A snapshot of the budget that never allocates.

use crate::base::config::HeapMode;

/// Heap bytes as a runtime reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeapBytes {
    /// Committed by the runtime (the JVM's `Runtime.totalMemory()`).
    pub committed: u64,
    /// In use (`totalMemory() - freeMemory()`).
    pub used: u64,
}

impl HeapBytes {
    /// Heap figures: `committed` by the runtime, `used` of it.
    pub const fn new(committed: u64, used: u64) -> HeapBytes {
        HeapBytes { committed, used }
    }

    /// The figure the budget counts under `mode`, as a signed byte count.
    pub(crate) fn counted(self, mode: HeapMode) -> i64 {
        let v = match mode {
            HeapMode::Committed => self.committed,
            HeapMode::Used => self.used,
        };
        i64::try_from(v).unwrap_or(i64::MAX)
    }
}

/// The process account's main figures, read cheaply ([`process_account`](crate::process_account)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProcessAccount {
    /// The hard limit (`u64::MAX`: none).
    pub limit: u64,
    /// Native bytes tracked (flushed).
    pub native: u64,
    /// What else counts against the limit: the heap figure, and untracked memory under
    /// `MEMQUOTA_UNTRACKED=count`.
    pub outside: u64,
    /// Room left under the limit: `limit - native - outside`, 0 past it.
    pub headroom: u64,
}

/// jemalloc's own view, refreshed (the heavy `epoch` advance) by [`stats`](crate::base::stats)
/// and the OOM report only, never on the allocation path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct JemallocStats {
    /// Bytes in live allocations (`stats.allocated`).
    pub allocated: u64,
    /// Bytes in active pages (`stats.active`).
    pub active: u64,
    /// Bytes in physically resident pages (`stats.resident`).
    pub resident: u64,
    /// Bytes retained as virtual memory, not returned to the OS (`stats.retained`).
    pub retained: u64,
    /// Bytes in active extents mapped by the allocator (`stats.mapped`).
    pub mapped: u64,
    /// Bytes in dirty pages: freed blocks' pages jemalloc keeps resident for reuse,
    /// what a purge returns (`stats.arenas.<all>.pdirty` pages).
    pub dirty: u64,
    /// Bytes jemalloc has purged since it started, whoever asked: memquota's purge
    /// service, jemalloc's own decay on an allocating thread, `malloc_trim`
    /// (`stats.arenas.<all>.dirty_purged` plus `muzzy_purged` pages).
    pub purged: u64,
}

impl JemallocStats {
    /// Reads jemalloc's statistics after advancing its epoch. Zeros if jemalloc's
    /// statistics are unavailable.
    pub fn read() -> JemallocStats {
        use tikv_jemalloc_ctl::{epoch, stats};
        if epoch::advance().is_err() {
            return JemallocStats::default();
        }
        let get = |r: tikv_jemalloc_ctl::Result<usize>| r.map_or(0, |v| v as u64);
        JemallocStats {
            allocated: get(stats::allocated::read()),
            active: get(stats::active::read()),
            resident: get(stats::resident::read()),
            retained: get(stats::retained::read()),
            mapped: get(stats::mapped::read()),
            dirty: ctl::<usize>(c"stats.arenas.4096.pdirty").unwrap_or(0) as u64,
            purged: ctl::<u64>(c"stats.arenas.4096.dirty_purged")
                .unwrap_or(0)
                .saturating_add(ctl::<u64>(c"stats.arenas.4096.muzzy_purged").unwrap_or(0)),
        }
        .in_bytes(page_size())
    }

    /// Resident bytes that hold no live allocation: dirty pages, jemalloc's metadata,
    /// the free part of partly used pages (`resident - allocated`).
    pub fn unused(&self) -> u64 {
        self.resident.saturating_sub(self.allocated)
    }

    /// `dirty` and `purged` are read in pages.
    fn in_bytes(mut self, page: u64) -> JemallocStats {
        self.dirty = self.dirty.saturating_mul(page);
        self.purged = self.purged.saturating_mul(page);
        self
    }
}

/// jemalloc's page size (`arenas.page`); 4 KiB if it cannot say.
pub(crate) fn page_size() -> u64 {
    ctl::<usize>(c"arenas.page").map_or(4096, |p| p as u64)
}

/// An integer type every bit pattern of which is a value: what a jemalloc control is
/// read into.
pub(crate) trait CtlInteger: Copy {}
impl CtlInteger for usize {}
impl CtlInteger for isize {}
impl CtlInteger for u64 {}
impl CtlInteger for u32 {}
impl CtlInteger for u8 {}

/// Reads the jemalloc control `name` (statistics as of the last epoch; `4096` in a
/// name is `MALLCTL_ARENAS_ALL`, all arenas merged). `T` is the control's C type:
/// `usize` for `size_t`, `isize` for `ssize_t`, `u64` for `uint64_t`, `u32` for
/// `unsigned`, `u8` for `bool`. `None` if jemalloc has no such control or its size
/// differs from `T`'s.
pub(crate) fn ctl<T: CtlInteger>(name: &std::ffi::CStr) -> Option<T> {
    // SAFETY: a NUL-terminated name; jemalloc writes the value only if its size is
    // `T`'s (else EINVAL, an `Err` here), and any bit pattern is a valid `T`.
    unsafe { tikv_jemalloc_ctl::raw::read::<T>(name.to_bytes_with_nul()) }.ok()
}

/// The retry machine (`with_retry`): threads in retry blocks by state now, and what
/// it has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryStats {
    /// Threads in retry blocks, working.
    pub running: u64,
    /// Threads whose request went past spills to the process budget (reclaims).
    pub allocating: u64,
    /// Threads waiting for memory to be freed.
    pub blocked: u64,
    /// Threads chosen to roll back that have not woken yet.
    pub rollback_requested: u64,
    /// Threads unwinding a rolled-back attempt.
    pub rolling_back: u64,
    /// Rolled-back threads waiting until further notice.
    pub bufn: u64,
    /// Threads chosen to split that have not woken yet.
    pub split_requested: u64,
    /// Retry blocks entered.
    pub blocks_entered: u64,
    /// Times a request blocked instead of failing.
    pub waits: u64,
    /// Attempts rolled back (`Error::RetryOom`).
    pub rollbacks: u64,
    /// Attempts run again after a rollback.
    pub retries: u64,
    /// Splits asked for (`Error::SplitAndRetryOom`).
    pub splits: u64,
    /// Waits the watchdog ended with a refusal.
    pub timeouts: u64,
    /// Threads that gave up after the most rollbacks allowed.
    pub retry_limit: u64,
    /// Waits ended because the waiting thread's scope ended (`Error::ScopeEnded`).
    pub scope_ended: u64,
    /// Retry blocks run without the machine (its table was full).
    pub unregistered: u64,
}

impl RetryStats {
    pub(crate) const ZERO: RetryStats = RetryStats {
        running: 0,
        allocating: 0,
        blocked: 0,
        rollback_requested: 0,
        rolling_back: 0,
        bufn: 0,
        split_requested: 0,
        blocks_entered: 0,
        waits: 0,
        rollbacks: 0,
        retries: 0,
        splits: 0,
        timeouts: 0,
        retry_limit: 0,
        scope_ended: 0,
        unregistered: 0,
    };
}

/// Where memory pressure is watched (a PSI trigger, `docs/containers.md`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PressureSource {
    /// Not watched: the kernel has no PSI (or it is off), the trigger could not be
    /// armed, or no sampler runs (a fork child).
    #[default]
    Unavailable = 0,
    /// The process's own cgroup v2 `memory.pressure`.
    Cgroup = 1,
    /// The whole system's `/proc/pressure/memory` (a process in cgroup v1 only).
    System = 2,
}

/// The container's view: the process's memory cgroup and memory pressure, as the
/// sampler thread last read them (`docs/containers.md`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContainerStats {
    /// The cgroup version the figures come from: 1, 2, or 0 (none found, or not
    /// watched: a fork child).
    pub cgroup_version: u8,
    /// The cgroup's tightest limit (0: none).
    pub limit: u64,
    /// The cgroup's tightest `memory.high` (v2; 0: none): it caps the soft threshold.
    pub high: u64,
    /// Anonymous memory charged to the cgroup (v2 `anon`, v1 `total_rss`): every
    /// process of it, never its page cache.
    pub anon: u64,
    /// The most anonymous memory read.
    pub anon_peak: u64,
    /// Whether the budget's limit follows the cgroup's (no limit in bytes was given).
    pub limit_follows: bool,
    /// Times the limit moved with the cgroup's.
    pub limit_changes: u64,
    /// Background reclaims and purges asked for because `anon` passed its line,
    /// `min(cgroup limit x soft ratio, memory.high)`.
    pub anon_requests: u64,
    /// PSI trigger events; each asked for a background reclaim and a purge.
    pub pressure_events: u64,
    /// Where memory pressure is watched.
    pub pressure: PressureSource,
    /// The PSI trigger's window in milliseconds (1000, or 2000 without
    /// `CAP_SYS_RESOURCE`).
    pub pressure_window_ms: u32,
}

/// The state of the budget at one moment. Plain data: `Copy`, no heap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// The hard limit in bytes (`u64::MAX` before configuration).
    pub limit: u64,
    /// The soft threshold in bytes.
    pub soft_limit: u64,
    /// Native bytes tracked (flushed deltas; see `error_bound`).
    pub native: u64,
    /// The highest native total ever granted.
    pub native_peak: u64,
    /// Heap figures from the probe.
    pub heap: HeapBytes,
    /// Which heap figure counts against the limit.
    pub heap_mode: HeapMode,
    /// `limit - (native + counted heap)`, 0 when over.
    pub headroom: u64,
    /// Bytes past the limit now: `native + counted heap - limit`, 0 when under. Bounded
    /// by `error_bound`, plus a sixteenth of the limit when `refuse_min` is set, plus
    /// the emergency reserve (a 64th of the limit, at most 1 MiB).
    pub overcommit: u64,
    /// Grants that left the account past the limit: small requests over-committed
    /// under `refuse_min`, draws on the emergency reserve, and flushes of memory
    /// already taken on the fast path.
    pub overcommits: u64,
    /// What is left of the emergency reserve: the bytes a thread refused since the
    /// account was last under the limit may still take past the refusal, in requests
    /// of at most 64 KiB (its out-of-memory handler's). Whole again when the account
    /// is back under the limit.
    pub emergency_reserve_bytes: u64,
    /// Requests granted from the emergency reserve.
    pub emergency_grants: u64,
    /// The smallest request that may be refused.
    pub refuse_min: u64,
    /// Reclaims run synchronously by an allocation over the limit.
    pub reclaims_sync: u64,
    /// Reclaims run in the background past the soft threshold.
    pub reclaims_background: u64,
    /// Reclaim callbacks that panicked (caught).
    pub reclaim_panics: u64,
    /// Calls of a heap probe function that panicked (caught; its last figures stood in).
    pub heap_probe_panics: u64,
    /// Calls of the report hook that panicked (caught; the refusal went on as usual).
    pub report_hook_panics: u64,
    /// Reclaim requests turned away by the rate limit or the futility suspension.
    pub reclaims_throttled: u64,
    /// Bytes the reclaims were measured to free, in total.
    pub reclaimed_bytes: u64,
    /// Purges of jemalloc's dirty pages run by memquota's purge service because
    /// native, heap and jemalloc's unused resident bytes passed the soft threshold.
    pub purges_budget: u64,
    /// Purges run after a reclaim, so that what it freed leaves the process.
    pub purges_reclaim: u64,
    /// Purges asked for by container memory pressure.
    pub purges_pressure: u64,
    /// Purges of dirty pages left resident for a whole purge interval.
    pub purges_idle: u64,
    /// Bytes memquota's purges returned to the system (jemalloc's own count of the
    /// pages they purged). `jemalloc.purged` minus this is what was purged elsewhere:
    /// on allocating threads by jemalloc's decay, or by `malloc_trim`.
    pub purged_bytes: u64,
    /// Whether memquota runs jemalloc's purging (no time-based purging on allocating
    /// threads; the purge service purges), rather than the user's own jemalloc decay
    /// or background-thread options (docs/design.md, "Purging").
    pub purging_by_memquota: bool,
    /// Allocations refused.
    pub ooms: u64,
    /// Full OOM reports written (the rest of the refusals were counted and summed up
    /// in the next report: see `MEMQUOTA_REPORT_WINDOW`).
    pub reports: u64,
    /// The sum of the live threads' flush thresholds: the bound on
    /// `|native - true live bytes|`, and on how far past the limit memory already
    /// taken can carry native plus heap. After a `fork` it keeps the threads that did
    /// not survive it (what they had not flushed was copied, uncounted).
    pub error_bound: u64,
    /// Threads whose delta may be unflushed.
    pub threads: u64,
    /// The per-thread flush threshold in bytes.
    pub threshold: u64,
    /// jemalloc's own statistics.
    pub jemalloc: JemallocStats,
    /// The process's resident set size.
    pub process_rss: u64,
    /// The highest resident set size the process has had (`VmHWM`).
    pub process_rss_peak: u64,
    /// Resident memory memquota does not allocate, at the last sample: anonymous RSS
    /// minus what jemalloc holds minus the heap committed. An engine's private
    /// allocator, `mmap`, thread stacks, a C library's own malloc.
    pub untracked: u64,
    /// The most untracked memory a sample has seen.
    pub untracked_peak: u64,
    /// Whether untracked memory counts against the limit (`MEMQUOTA_UNTRACKED=count`).
    pub untracked_counted: bool,
    /// Passes the sampler thread (untracked memory, purging, the container's view)
    /// has completed. Its start-up allocates and frees a little, charged like any
    /// thread's: from the first pass on, an idle process's account holds still.
    pub sampler_passes: u64,
    /// The retry machine.
    pub retry: RetryStats,
    /// The container's view: cgroup and memory pressure.
    pub container: ContainerStats,
}
