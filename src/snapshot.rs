//! The budget at one moment: the figures every layer keeps, read into one [`Stats`].

use crate::heap_probe;
use crate::ledger::{self, ACCOUNT};
use crate::quota::Quota;
use crate::reclaim;
use crate::report;
use crate::settings::{self, heap_mode, quota};
use crate::stats::{JemallocStats, Stats};
use std::sync::atomic::Ordering::Relaxed;

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
    let purges = crate::purge::counts();
    Stats {
        limit,
        soft_limit,
        native: unsigned(native),
        native_peak: unsigned(ACCOUNT.peak()),
        heap,
        heap_mode: mode,
        headroom: quota.headroom(native, outside),
        overcommit: Quota::excess(native.max(0), outside, quota.limit),
        overcommits: ledger::overcommits(),
        refuse_min: settings::refuse_min(),
        reclaims_sync: counts.sync.load(Relaxed),
        reclaims_background: counts.background.load(Relaxed),
        reclaim_panics: counts.panics.load(Relaxed),
        heap_probe_panics: heap_probe::panics(),
        reclaims_throttled: counts.throttled.load(Relaxed),
        reclaimed_bytes: counts.freed.load(Relaxed),
        purges_budget: purges.budget,
        purges_reclaim: purges.reclaim,
        purges_pressure: purges.pressure,
        purges_idle: purges.idle,
        purged_bytes: purges.bytes,
        purging_by_memquota: crate::purge::by_memquota(),
        ooms: report::refusals(),
        reports: report::full_reports(),
        error_bound: ledger::error_bound(),
        threads: ledger::live_threads(),
        threshold: settings::threshold(),
        jemalloc: JemallocStats::read(),
        process_rss: crate::host::process_rss(),
        process_rss_peak: crate::host::peak_rss(),
        untracked: crate::heap_probe::untracked(),
        untracked_peak: crate::heap_probe::untracked_peak(),
        untracked_counted: settings::count_untracked(),
        retry: crate::tables::retry::stats(),
        container: crate::container::stats(),
    }
}
