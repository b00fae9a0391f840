//! Memory memquota does not allocate: an engine's private allocator, `mmap`, thread
//! stacks, a C library's own malloc. A sampler thread reads the process's anonymous
//! resident memory every [`INTERVAL`], off the allocation path, and calls what is
//! neither jemalloc's (tracked allocations and jemalloc's own overhead) nor the heap
//! *untracked*. Under `Untracked::Count` (`MEMQUOTA_UNTRACKED=count`; the default is
//! `Report`) it counts against the limit
//! with native and heap, and a sample past the soft threshold asks for a background
//! reclaim: what memquota does see (tracked caches, a JVM's heap) makes room for what
//! it does not. The same thread is the purge service (`purge.rs`): it reads
//! jemalloc's statistics once per pass for both, and a purge request wakes it early;
//! and it watches the container (`container.rs`): the cgroup's files and the PSI
//! trigger. It writes the flight recorder's records too (`flight.rs`).

use crate::base::host;
use crate::base::quota::Quota;
use crate::base::settings;
use crate::base::stats::JemallocStats;
use crate::base::sync::{AtomicBool, AtomicU64, Ordering::*};
use crate::ledger::threads::{self, ACCOUNT};
use crate::policy::container;
use crate::policy::heap_probe;
use crate::policy::purge;
use crate::policy::reclaim;
use std::time::Duration;

/// Time between two samples. A sample (a `statm` read and jemalloc's statistics
/// epoch) costs tens of microseconds: well under 0.1% of a core at this rate.
pub(crate) const INTERVAL: Duration = Duration::from_millis(50);

static STARTED: AtomicBool = AtomicBool::new(false);
/// Passes completed (`Stats::sampler_passes`).
static PASSES: AtomicU64 = AtomicU64::new(0);

/// Passes the sampler has completed.
pub(crate) fn passes() -> u64 {
    PASSES.load(Relaxed)
}

/// Whether the sampler thread was started (or is being started).
pub(crate) fn started() -> bool {
    STARTED.load(Acquire)
}

/// Starts the sampler thread, once per process (not in a fork child). Returns
/// whether it runs (or was started before).
pub(crate) fn ensure_sampling() -> bool {
    // A load first, as fork::install: this runs on every thread's first allocation.
    if STARTED.load(Relaxed) || STARTED.swap(true, AcqRel) {
        return true;
    }
    // Its own few allocations are charged, never refused, never made to wait.
    let spawned = threads::spawn_service("memquota-sampler", || {
        // The thread that started this one configures the process right after (a
        // first slow path, or `init`): the profile's rate is part of that.
        while !crate::base::settings::configured() {
            crate::base::settings::ensure_configured();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        super::profile::configure();
        let mut purger = purge::Service::start();
        let mut watch = None;
        loop {
            let jemalloc = JemallocStats::read();
            sample(&jemalloc);
            purger.serve(&jemalloc);
            // After the first pass: its sample and purge decision come as soon as
            // the thread starts, as they did before the watch existed.
            watch.get_or_insert_with(container::Watch::start).pass();
            // Last: the record's stats are this pass's.
            super::flight::serve();
            PASSES.fetch_add(1, Relaxed);
            purger.wait(INTERVAL);
        }
    });
    match spawned {
        // Said here, not by the thread when it first runs: a refusal right after
        // `init` (before the new thread ran) must ask for its record too.
        Ok(_) => super::flight::serving(),
        Err(_) => STARTED.store(false, Release),
    }
    spawned.is_ok()
}

/// In a fork child: the sampler thread did not survive the fork, and the parent's
/// figure says nothing of the child. The child does not start one of its own from
/// inside an allocation (a fork child should do little before it execs, and an exec
/// starts a new process that samples): its untracked figure is 0.
pub(crate) fn after_fork_child() {
    STARTED.store(true, Relaxed);
    super::flight::after_fork_child();
    heap_probe::set_untracked_after_fork(0);
    container::after_fork_child();
}

/// A sample now, for a figure that must be current (the preload's exit summary: the
/// last periodic sample may be 50 ms old, and a program that just freed an engine's
/// memory would show it still held). Reads jemalloc's statistics and `/proc`.
/// Only the figure: no reclaim is asked for.
pub fn sample_now() {
    measure(&JemallocStats::read());
}

/// One sample: the figure, then under `Untracked::Count` a background reclaim when
/// the budget is past its soft threshold.
fn sample(je: &JemallocStats) {
    if !measure(je) {
        return;
    }
    if settings::count_untracked() {
        let quota = settings::quota();
        let outside = heap_probe::outside();
        let native = ACCOUNT.native();
        if native.saturating_add(outside) > quota.soft {
            reclaim::request_background(Quota::excess(native, outside, quota.soft));
        }
    }
}

/// Sets the untracked figure: anonymous RSS, minus what jemalloc holds (at least the
/// tracked total, for a backing allocator without jemalloc's statistics), minus the
/// heap committed. False when there is no `/proc` to read.
fn measure(je: &JemallocStats) -> bool {
    let anon = host::anon_rss();
    if anon == 0 {
        return false;
    }
    let native = u64::try_from(ACCOUNT.native()).unwrap_or(0);
    let jemalloc = je.resident.max(native);
    let heap = heap_probe::read().committed;
    heap_probe::set_untracked(anon.saturating_sub(jemalloc).saturating_sub(heap));
    true
}
