//! The budget at one moment: the figures every layer keeps, read into one [`Stats`].

use crate::base::quota::Quota;
use crate::base::settings::{self, heap_mode, quota};
use crate::base::stats::{JemallocStats, ProcessAccount, Stats};
use crate::base::sync::Ordering::Relaxed;
use crate::ledger::threads::{self, ACCOUNT};
use crate::policy::heap_probe;
use crate::policy::reclaim;
use crate::policy::report;

/// A snapshot of the budget. Never allocates (unless a heap probe function does), and
/// takes no lock that the allocation path holds; it advances jemalloc's statistics
/// epoch, which is too heavy for a hot loop.
pub fn stats() -> Stats {
    let quota = quota();
    let mode = heap_mode();
    let heap = heap_probe::read();
    let native = ACCOUNT.native();
    let counts = reclaim::counts();
    let unsigned = |v: i64| u64::try_from(v).unwrap_or(0);
    let limit = if quota.limit == i64::MAX { u64::MAX } else { unsigned(quota.limit) };
    let soft_limit = if quota.soft == i64::MAX { u64::MAX } else { unsigned(quota.soft) };
    let outside = heap_probe::outside();
    let purges = crate::policy::purge::counts();
    Stats {
        limit,
        soft_limit,
        native: unsigned(native),
        native_peak: unsigned(ACCOUNT.peak()),
        heap,
        heap_mode: mode,
        headroom: quota.headroom(native, outside),
        overcommit: Quota::excess(native.max(0), outside, quota.limit),
        overcommits: threads::overcommits(),
        emergency_reserve_bytes: crate::policy::reserve::left(quota.limit),
        emergency_grants: crate::policy::reserve::grants(),
        refuse_min: settings::refuse_min(),
        reclaims_sync: counts.sync.load(Relaxed),
        reclaims_background: counts.background.load(Relaxed),
        reclaim_panics: counts.panics.load(Relaxed),
        heap_probe_panics: heap_probe::panics(),
        report_hook_panics: report::hook_panics(),
        reclaims_throttled: counts.throttled.load(Relaxed),
        reclaimed_bytes: counts.freed.load(Relaxed),
        purges_budget: purges.budget,
        purges_reclaim: purges.reclaim,
        purges_pressure: purges.pressure,
        purges_idle: purges.idle,
        purged_bytes: purges.bytes,
        purging_by_memquota: crate::policy::purge::by_memquota(),
        ooms: report::refusals(),
        reports: report::full_reports(),
        error_bound: threads::error_bound(),
        threads: threads::live_threads(),
        threshold: settings::threshold(),
        jemalloc: JemallocStats::read(),
        process_rss: crate::base::host::process_rss(),
        process_rss_peak: crate::base::host::peak_rss(),
        untracked: crate::policy::heap_probe::untracked(),
        untracked_peak: crate::policy::heap_probe::untracked_peak(),
        untracked_counted: settings::count_untracked(),
        sampler_passes: crate::policy::sampler::passes(),
        retry: crate::ledger::tables::retry::stats(),
        container: crate::policy::container::stats(),
    }
}

/// The budget's main figures now. Cheap, unlike [`stats`]: no jemalloc epoch, no
/// `/proc` read, no allocation, so an engine's memory pool may read them on every
/// request. The calling thread's unflushed bytes
/// ([`thread_pending`](crate::thread_pending)) are not in them.
pub fn process_account() -> ProcessAccount {
    let quota = quota();
    let native = ACCOUNT.native();
    let outside = heap_probe::outside();
    ProcessAccount {
        limit: if quota.limit == i64::MAX { u64::MAX } else { u64::try_from(quota.limit).unwrap_or(0) },
        native: u64::try_from(native).unwrap_or(0),
        outside: u64::try_from(outside).unwrap_or(0),
        headroom: quota.headroom(native, outside),
    }
}

/// The figures an OOM report shows, as they are now: limit, native and heap, reclaims,
/// the task scopes with their consumers, jemalloc's own view. Not a refusal: nothing is
/// counted and the report hook is not called. For a face that refuses on its own
/// terms (an engine's memory pool) and words the first line itself. Allocates, and
/// advances jemalloc's statistics epoch (as [`stats`] does): not for a hot loop.
pub fn report_now() -> String {
    let refusal = report::Refusal {
        requested: 0,
        stats: stats(),
        history: reclaim::history(),
        throttle: reclaim::throttled(),
        has_reclaimer: reclaim::has_reclaimer(),
        policy: crate::base::config::OnOom::Null,
    };
    let text = report::render_figures(&refusal);
    threads::unpoliced(|| text.as_str().to_owned())
}

/// What the budget holds: the native account plus what it counts beside it (the heap
/// figure and, under `Untracked::Count`, the untracked bytes).
#[cfg_attr(not(feature = "jvm"), allow(dead_code))] // the JVM face's
pub(crate) fn native_and_outside() -> i64 {
    crate::ledger::threads::ACCOUNT.native().saturating_add(crate::policy::heap_probe::outside())
}
