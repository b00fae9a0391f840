//! Stats as text for the outside world: Prometheus exposition and JSON. Both write
//! into any `fmt::Write`, so a caller can render into a fixed buffer without a heap.

use crate::arbitration::{ScopeSnapshot, ScopeStats};
use crate::base::config::HeapMode;
use crate::base::stats::{PressureSource, Stats};
use std::fmt::{self, Write};

/// Every metric name, in one place: what this module writes and what the `memquota`
/// command reads back.
pub mod metric {
    #[allow(missing_docs)]
    pub const EMERGENCY_GRANTS_TOTAL: &str = "memquota_emergency_grants_total";
    #[allow(missing_docs)]
    pub const EMERGENCY_RESERVE_BYTES: &str = "memquota_emergency_reserve_bytes";
    #[allow(missing_docs)]
    pub const ERROR_BOUND_BYTES: &str = "memquota_error_bound_bytes";
    #[allow(missing_docs)]
    pub const HEADROOM_BYTES: &str = "memquota_headroom_bytes";
    #[allow(missing_docs)]
    pub const HEAP_COMMITTED_BYTES: &str = "memquota_heap_committed_bytes";
    #[allow(missing_docs)]
    pub const HEAP_PROBE_PANICS_TOTAL: &str = "memquota_heap_probe_panics_total";
    #[allow(missing_docs)]
    pub const HEAP_USED_BYTES: &str = "memquota_heap_used_bytes";
    #[allow(missing_docs)]
    pub const REPORT_HOOK_PANICS_TOTAL: &str = "memquota_report_hook_panics_total";
    #[allow(missing_docs)]
    pub const JEMALLOC_ACTIVE_BYTES: &str = "memquota_jemalloc_active_bytes";
    #[allow(missing_docs)]
    pub const JEMALLOC_ALLOCATED_BYTES: &str = "memquota_jemalloc_allocated_bytes";
    #[allow(missing_docs)]
    pub const JEMALLOC_RESIDENT_BYTES: &str = "memquota_jemalloc_resident_bytes";
    #[allow(missing_docs)]
    pub const JEMALLOC_RETAINED_BYTES: &str = "memquota_jemalloc_retained_bytes";
    #[allow(missing_docs)]
    pub const JEMALLOC_DIRTY_BYTES: &str = "memquota_jemalloc_dirty_bytes";
    #[allow(missing_docs)]
    pub const JEMALLOC_UNUSED_BYTES: &str = "memquota_jemalloc_unused_bytes";
    #[allow(missing_docs)]
    pub const JEMALLOC_PURGED_BYTES_TOTAL: &str = "memquota_jemalloc_purged_bytes_total";
    #[allow(missing_docs)]
    pub const LIMIT_BYTES: &str = "memquota_limit_bytes";
    #[allow(missing_docs)]
    pub const NATIVE_BYTES: &str = "memquota_native_bytes";
    #[allow(missing_docs)]
    pub const NATIVE_PEAK_BYTES: &str = "memquota_native_peak_bytes";
    #[allow(missing_docs)]
    pub const OOM_REPORTS_TOTAL: &str = "memquota_oom_reports_total";
    #[allow(missing_docs)]
    pub const OOM_TOTAL: &str = "memquota_oom_total";
    #[allow(missing_docs)]
    pub const OVERCOMMIT_BYTES: &str = "memquota_overcommit_bytes";
    #[allow(missing_docs)]
    pub const OVERCOMMIT_TOTAL: &str = "memquota_overcommit_total";
    #[allow(missing_docs)]
    pub const PROCESS_RSS_BYTES: &str = "memquota_process_rss_bytes";
    #[allow(missing_docs)]
    pub const PURGED_BYTES_TOTAL: &str = "memquota_purged_bytes_total";
    #[allow(missing_docs)]
    pub const PURGES_TOTAL: &str = "memquota_purges_total";
    #[allow(missing_docs)]
    pub const RECLAIM_PANICS_TOTAL: &str = "memquota_reclaim_panics_total";
    #[allow(missing_docs)]
    pub const RECLAIMED_BYTES_TOTAL: &str = "memquota_reclaimed_bytes_total";
    #[allow(missing_docs)]
    pub const RECLAIMS_THROTTLED_TOTAL: &str = "memquota_reclaims_throttled_total";
    #[allow(missing_docs)]
    pub const RECLAIMS_TOTAL: &str = "memquota_reclaims_total";
    #[allow(missing_docs)]
    pub const RETRY_TOTAL: &str = "memquota_retry_total";
    #[allow(missing_docs)]
    pub const BLOCKED_THREADS: &str = "memquota_blocked_threads";
    #[allow(missing_docs)]
    pub const RETRY_THREADS: &str = "memquota_retry_threads";
    #[allow(missing_docs)]
    pub const RETRY_WAITS_TOTAL: &str = "memquota_retry_waits_total";
    #[allow(missing_docs)]
    pub const RETRY_TIMEOUTS_TOTAL: &str = "memquota_retry_timeouts_total";
    #[allow(missing_docs)]
    pub const SCOPE_ALLOCATED_BYTES: &str = "memquota_scope_allocated_bytes";
    #[allow(missing_docs)]
    pub const SCOPE_BUDGETS_TOTAL: &str = "memquota_scope_budgets_total";
    #[allow(missing_docs)]
    pub const SCOPE_BUDGET_BORROWED_BYTES_TOTAL: &str = "memquota_scope_budget_borrowed_bytes_total";
    #[allow(missing_docs)]
    pub const SCOPE_BUDGET_FREED_EARLY_BYTES_TOTAL: &str = "memquota_scope_budget_freed_early_bytes_total";
    #[allow(missing_docs)]
    pub const SCOPE_BUDGET_OVERCOMMIT_BYTES_TOTAL: &str = "memquota_scope_budget_overcommit_bytes_total";
    #[allow(missing_docs)]
    pub const SCOPE_CONSUMER_BYTES: &str = "memquota_scope_consumer_bytes";
    #[allow(missing_docs)]
    pub const SCOPE_CONSUMER_SPILLS_TOTAL: &str = "memquota_scope_consumer_spills_total";
    #[allow(missing_docs)]
    pub const SCOPE_HELD_BYTES: &str = "memquota_scope_held_bytes";
    #[allow(missing_docs)]
    pub const SCOPE_LEAKED_BYTES_TOTAL: &str = "memquota_scope_leaked_bytes_total";
    #[allow(missing_docs)]
    pub const SCOPE_PEAK_BYTES: &str = "memquota_scope_peak_bytes";
    #[allow(missing_docs)]
    pub const SCOPE_POOL_BYTES: &str = "memquota_scope_pool_bytes";
    #[allow(missing_docs)]
    pub const SCOPE_REFUSALS_TOTAL: &str = "memquota_scope_refusals_total";
    #[allow(missing_docs)]
    pub const SCOPE_RESERVE_IN_SPILL_TOTAL: &str = "memquota_scope_reserve_in_spill_total";
    #[allow(missing_docs)]
    pub const SCOPE_RESERVED_BYTES: &str = "memquota_scope_reserved_bytes";
    #[allow(missing_docs)]
    pub const SCOPE_SHARE_BYTES: &str = "memquota_scope_share_bytes";
    #[allow(missing_docs)]
    pub const SCOPE_SPILLED_BYTES_TOTAL: &str = "memquota_scope_spilled_bytes_total";
    #[allow(missing_docs)]
    pub const SCOPE_SPILLS_TOTAL: &str = "memquota_scope_spills_total";
    #[allow(missing_docs)]
    pub const SCOPE_THREADS: &str = "memquota_scope_threads";
    #[allow(missing_docs)]
    pub const SCOPE_WAITS_TOTAL: &str = "memquota_scope_waits_total";
    #[allow(missing_docs)]
    pub const SCOPES_ACTIVE: &str = "memquota_scopes_active";
    #[allow(missing_docs)]
    pub const SOFT_LIMIT_BYTES: &str = "memquota_soft_limit_bytes";
    #[allow(missing_docs)]
    pub const UNTRACKED_BYTES: &str = "memquota_untracked_bytes";
    #[allow(missing_docs)]
    pub const UNTRACKED_PEAK_BYTES: &str = "memquota_untracked_peak_bytes";
    #[allow(missing_docs)]
    pub const PROCESS_RSS_PEAK_BYTES: &str = "memquota_process_rss_peak_bytes";
    #[allow(missing_docs)]
    pub const CGROUP_VERSION: &str = "memquota_cgroup_version";
    #[allow(missing_docs)]
    pub const CGROUP_LIMIT_BYTES: &str = "memquota_cgroup_limit_bytes";
    #[allow(missing_docs)]
    pub const CGROUP_HIGH_BYTES: &str = "memquota_cgroup_high_bytes";
    #[allow(missing_docs)]
    pub const CGROUP_ANON_BYTES: &str = "memquota_cgroup_anon_bytes";
    #[allow(missing_docs)]
    pub const CGROUP_ANON_PEAK_BYTES: &str = "memquota_cgroup_anon_peak_bytes";
    #[allow(missing_docs)]
    pub const CGROUP_LIMIT_CHANGES_TOTAL: &str = "memquota_cgroup_limit_changes_total";
    #[allow(missing_docs)]
    pub const CONTAINER_REQUESTS_TOTAL: &str = "memquota_container_requests_total";
    #[allow(missing_docs)]
    pub const PRESSURE_WATCH: &str = "memquota_pressure_watch";
}

use metric::*;

/// One metric: name, type, help, value. `kind` labels go in the name's suffix.
struct Metric {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
}

const fn gauge(name: &'static str, help: &'static str) -> Metric {
    Metric { name, kind: "gauge", help }
}

const fn counter(name: &'static str, help: &'static str) -> Metric {
    Metric { name, kind: "counter", help }
}

/// The metrics in exposition order, with their values taken from a snapshot.
fn metrics(s: &Stats) -> [(Metric, &'static str, u64); 59] {
    let limit = if s.limit == u64::MAX { 0 } else { s.limit };
    let c = &s.container;
    [
        (
            gauge(LIMIT_BYTES, "The hard limit on native plus counted heap bytes (0: none)."),
            "",
            limit,
        ),
        (
            gauge(SOFT_LIMIT_BYTES, "Past this, reclaims run in the background."),
            "",
            s.soft_limit.min(limit),
        ),
        (gauge(HEADROOM_BYTES, "Bytes left under the limit."), "", s.headroom),
        (gauge(NATIVE_BYTES, "Native bytes tracked."), "", s.native),
        (gauge(NATIVE_PEAK_BYTES, "The highest native total granted."), "", s.native_peak),
        (
            gauge(OVERCOMMIT_BYTES, "Bytes past the limit now (native plus counted heap)."),
            "",
            s.overcommit,
        ),
        (
            gauge(HEAP_COMMITTED_BYTES, "Heap committed, from the heap probe."),
            "",
            s.heap.committed,
        ),
        (gauge(HEAP_USED_BYTES, "Heap used, from the heap probe."), "", s.heap.used),
        (
            counter(RECLAIMS_TOTAL, "Reclaims (GCs) run, by kind."),
            "{kind=\"sync\"}",
            s.reclaims_sync,
        ),
        (counter(RECLAIMS_TOTAL, ""), "{kind=\"background\"}", s.reclaims_background),
        (
            counter(RECLAIMED_BYTES_TOTAL, "Bytes the reclaims were measured to free."),
            "",
            s.reclaimed_bytes,
        ),
        (counter(RECLAIM_PANICS_TOTAL, "Reclaim callbacks that panicked."), "", s.reclaim_panics),
        (
            counter(
                RECLAIMS_THROTTLED_TOTAL,
                "Reclaim requests turned away by the rate limit or the futility suspension.",
            ),
            "",
            s.reclaims_throttled,
        ),
        (counter(OOM_TOTAL, "Allocations refused."), "", s.ooms),
        (
            counter(OOM_REPORTS_TOTAL, "Full OOM reports written (the other refusals were summed up)."),
            "",
            s.reports,
        ),
        (
            counter(OVERCOMMIT_TOTAL, "Grants that left native plus heap past the limit."),
            "",
            s.overcommits,
        ),
        (
            gauge(
                EMERGENCY_RESERVE_BYTES,
                "What is left of the emergency reserve refused threads may draw on (whole again under the limit).",
            ),
            "",
            s.emergency_reserve_bytes,
        ),
        (
            counter(EMERGENCY_GRANTS_TOTAL, "Small requests of refused threads granted from the emergency reserve."),
            "",
            s.emergency_grants,
        ),
        (
            gauge(
                ERROR_BOUND_BYTES,
                "Bound on unflushed per-thread deltas, and on usage past the limit from memory already taken.",
            ),
            "",
            s.error_bound,
        ),
        (
            counter(HEAP_PROBE_PANICS_TOTAL, "Heap probe calls that panicked (caught)."),
            "",
            s.heap_probe_panics,
        ),
        (
            counter(REPORT_HOOK_PANICS_TOTAL, "Report hook calls that panicked (caught)."),
            "",
            s.report_hook_panics,
        ),
        (gauge(JEMALLOC_ALLOCATED_BYTES, "jemalloc stats.allocated."), "", s.jemalloc.allocated),
        (gauge(JEMALLOC_ACTIVE_BYTES, "jemalloc stats.active."), "", s.jemalloc.active),
        (gauge(JEMALLOC_RESIDENT_BYTES, "jemalloc stats.resident."), "", s.jemalloc.resident),
        (gauge(JEMALLOC_RETAINED_BYTES, "jemalloc stats.retained."), "", s.jemalloc.retained),
        (
            gauge(JEMALLOC_DIRTY_BYTES, "Bytes in jemalloc's dirty pages: freed, still resident, purgeable."),
            "",
            s.jemalloc.dirty,
        ),
        (
            gauge(
                JEMALLOC_UNUSED_BYTES,
                "jemalloc resident minus allocated: dirty pages, metadata, free parts of pages. Purged near the limit.",
            ),
            "",
            s.jemalloc.unused(),
        ),
        (
            counter(JEMALLOC_PURGED_BYTES_TOTAL, "Bytes jemalloc purged, whoever asked (memquota, its decay, malloc_trim)."),
            "",
            s.jemalloc.purged,
        ),
        (
            counter(PURGES_TOTAL, "Purges of jemalloc's dirty pages by memquota's purge service, by why."),
            "{kind=\"budget\"}",
            s.purges_budget,
        ),
        (counter(PURGES_TOTAL, ""), "{kind=\"reclaim\"}", s.purges_reclaim),
        (counter(PURGES_TOTAL, ""), "{kind=\"pressure\"}", s.purges_pressure),
        (counter(PURGES_TOTAL, ""), "{kind=\"idle\"}", s.purges_idle),
        (
            counter(PURGED_BYTES_TOTAL, "Bytes memquota's purges returned to the system."),
            "",
            s.purged_bytes,
        ),
        (gauge(PROCESS_RSS_BYTES, "Resident set size of the process."), "", s.process_rss),
        (gauge(PROCESS_RSS_PEAK_BYTES, "The highest resident set size of the process."), "", s.process_rss_peak),
        (
            gauge(
                UNTRACKED_BYTES,
                "Resident memory memquota does not allocate: anonymous RSS minus jemalloc's minus the heap committed.",
            ),
            "",
            s.untracked,
        ),
        (gauge(UNTRACKED_PEAK_BYTES, "The most untracked memory sampled."), "", s.untracked_peak),
        (
            gauge(CGROUP_VERSION, "The memory cgroup version the container figures come from (0: none)."),
            "",
            u64::from(c.cgroup_version),
        ),
        (gauge(CGROUP_LIMIT_BYTES, "The memory cgroup's tightest limit (0: none)."), "", c.limit),
        (
            gauge(CGROUP_HIGH_BYTES, "The cgroup's tightest memory.high (0: none); it caps the soft threshold."),
            "",
            c.high,
        ),
        (
            gauge(CGROUP_ANON_BYTES, "Anonymous memory charged to the cgroup (all its processes; no page cache)."),
            "",
            c.anon,
        ),
        (gauge(CGROUP_ANON_PEAK_BYTES, "The most anonymous memory the cgroup was read to hold."), "", c.anon_peak),
        (
            counter(CGROUP_LIMIT_CHANGES_TOTAL, "Times the limit moved with the cgroup's."),
            "",
            c.limit_changes,
        ),
        (
            counter(
                CONTAINER_REQUESTS_TOTAL,
                "Background reclaims and purges asked for by the container's view, by cause.",
            ),
            "{cause=\"anon\"}",
            c.anon_requests,
        ),
        (counter(CONTAINER_REQUESTS_TOTAL, ""), "{cause=\"pressure\"}", c.pressure_events),
        (
            gauge(PRESSURE_WATCH, "1 where a PSI trigger watches memory pressure (none: not watched)."),
            "{source=\"cgroup\"}",
            u64::from(c.pressure == PressureSource::Cgroup),
        ),
        (gauge(PRESSURE_WATCH, ""), "{source=\"system\"}", u64::from(c.pressure == PressureSource::System)),
        (
            counter(RETRY_TOTAL, "Attempts in retry blocks rolled back (retry) or told to split (split)."),
            "{kind=\"retry\"}",
            s.retry.rollbacks,
        ),
        (counter(RETRY_TOTAL, ""), "{kind=\"split\"}", s.retry.splits),
        (gauge(BLOCKED_THREADS, "Threads in retry blocks waiting for memory to be freed."), "", s.retry.blocked),
        (
            gauge(RETRY_THREADS, "Threads in retry blocks, by state."),
            "{state=\"running\"}",
            s.retry.running,
        ),
        (gauge(RETRY_THREADS, ""), "{state=\"allocating\"}", s.retry.allocating),
        (gauge(RETRY_THREADS, ""), "{state=\"blocked\"}", s.retry.blocked),
        (gauge(RETRY_THREADS, ""), "{state=\"rollback_requested\"}", s.retry.rollback_requested),
        (gauge(RETRY_THREADS, ""), "{state=\"rolling_back\"}", s.retry.rolling_back),
        (gauge(RETRY_THREADS, ""), "{state=\"bufn\"}", s.retry.bufn),
        (gauge(RETRY_THREADS, ""), "{state=\"split_requested\"}", s.retry.split_requested),
        (
            counter(RETRY_WAITS_TOTAL, "Requests in retry blocks that waited for memory instead of failing."),
            "",
            s.retry.waits,
        ),
        (
            counter(RETRY_TIMEOUTS_TOTAL, "Waits in retry blocks the watchdog ended with a refusal."),
            "",
            s.retry.timeouts,
        ),
    ]
}

/// The process that wrote a stats file, named on the file's first line (a comment to
/// Prometheus parsers): `# memquota writer pid=<pid> start=<ticks> rss_peak=<bytes>`.
/// The preload writes it; the `memquota` command reads it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatsWriter {
    /// Its pid.
    pub pid: u32,
    /// When it started, in clock ticks since boot (`host::running_since`): with the
    /// pid, it names one process even after the pid is reused. 0: unknown.
    pub start: u64,
    /// Its peak resident set size, in bytes.
    pub rss_peak: u64,
}

impl StatsWriter {
    const TAG: &'static str = "# memquota writer ";

    /// The first line of a stats file this process writes, with its newline.
    pub fn line(&self) -> String {
        format!("{}pid={} start={} rss_peak={}\n", Self::TAG, self.pid, self.start, self.rss_peak)
    }

    /// The writer the first line of `text` names, if it names one.
    pub fn parse(text: &str) -> Option<StatsWriter> {
        let mut fields = text.lines().next()?.strip_prefix(Self::TAG)?.split(' ');
        let mut value =
            |key: &str| -> Option<u64> { fields.next()?.strip_prefix(key)?.strip_prefix('=')?.parse().ok() };
        let pid = u32::try_from(value("pid")?).ok()?;
        Some(StatsWriter { pid, start: value("start")?, rss_peak: value("rss_peak")? })
    }

    /// Whether both name the same process (a process after an `exec` is the same).
    pub fn is(&self, other: &StatsWriter) -> bool {
        self.pid == other.pid && self.start == other.start
    }
}

/// Writes `s` in the Prometheus text exposition format (version 0.0.4).
pub fn write_prometheus(w: &mut impl Write, s: &Stats) -> fmt::Result {
    for (m, labels, value) in metrics(s) {
        if !m.help.is_empty() {
            writeln!(w, "# HELP {} {}", m.name, m.help)?;
            writeln!(w, "# TYPE {} {}", m.name, m.kind)?;
        }
        writeln!(w, "{}{labels} {value}", m.name)?;
    }
    Ok(())
}

/// Writes `s` as one JSON object with the same figures (names without the
/// `memquota_` prefix; the reclaim kinds as separate keys).
pub fn write_json(w: &mut impl Write, s: &Stats) -> fmt::Result {
    w.write_char('{')?;
    for (i, (m, labels, value)) in metrics(s).into_iter().enumerate() {
        let name = m.name.trim_start_matches("memquota_");
        let sep = if i == 0 { "" } else { "," };
        match labels {
            "" => write!(w, "{sep}\"{name}\":{value}")?,
            _ => {
                // `{label="value"}`: the value joins the name.
                let value_of = labels.split_once("=\"").map_or(labels, |(_, v)| v);
                let kind = value_of.trim_end_matches("\"}");
                write!(w, "{sep}\"{name}_{kind}\":{value}")?
            }
        }
    }
    let heap = match s.heap_mode {
        HeapMode::Committed => "committed",
        HeapMode::Used => "used",
    };
    write!(w, ",\"heap_counted\":\"{heap}\",\"threads\":{},\"refuse_min\":{}}}", s.threads, s.refuse_min)
}

/// Writes `s` escaped for a Prometheus label value or a JSON string (the two agree on
/// `\\`, `\"` and `\n`; other control characters become spaces).
fn escaped(w: &mut impl Write, s: &str) -> fmt::Result {
    for c in s.chars() {
        match c {
            '\\' => w.write_str("\\\\")?,
            '"' => w.write_str("\\\"")?,
            '\n' => w.write_str("\\n")?,
            c if c.is_control() => w.write_char(' ')?,
            c => w.write_char(c)?,
        }
    }
    Ok(())
}

/// Per-scope figures of one scope, in exposition order.
fn scope_metrics(s: &ScopeStats) -> [(&'static str, i64); 7] {
    let i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    [
        (SCOPE_HELD_BYTES, i(s.held)),
        (SCOPE_PEAK_BYTES, i(s.peak)),
        (SCOPE_ALLOCATED_BYTES, s.allocated),
        (SCOPE_RESERVED_BYTES, i(s.reserved)),
        (SCOPE_THREADS, i64::from(s.threads)),
        (SCOPE_WAITS_TOTAL, i(s.waits)),
        (SCOPE_REFUSALS_TOTAL, i(s.refusals)),
    ]
}

const SCOPE_HELP: [(&str, &str, &str); 9] = [
    (SCOPE_HELD_BYTES, "gauge", "What the scope is charged: the larger of allocated and reserved."),
    (SCOPE_PEAK_BYTES, "gauge", "The highest charge of the scope."),
    (SCOPE_ALLOCATED_BYTES, "gauge", "Bytes the scope's threads allocated minus freed (flushed)."),
    (SCOPE_RESERVED_BYTES, "gauge", "Bytes the scope reserved explicitly."),
    (SCOPE_THREADS, "gauge", "Threads attached to the scope."),
    (SCOPE_WAITS_TOTAL, "counter", "Requests of the scope that waited for their fair share."),
    (SCOPE_REFUSALS_TOTAL, "counter", "Requests of the scope refused."),
    (SCOPE_CONSUMER_BYTES, "gauge", "Bytes a spillable consumer reserved."),
    (SCOPE_CONSUMER_SPILLS_TOTAL, "counter", "Times a consumer was asked to spill."),
];

fn scope_label(w: &mut impl Write, s: &ScopeStats) -> fmt::Result {
    w.write_str("scope=\"")?;
    escaped(w, &s.name)?;
    write!(w, "\",id=\"{}\"", s.id)
}

/// Writes per-scope figures in the Prometheus text format, labelled
/// `{scope="name",id="7"}` (consumers add `consumer="name"`), then the manager's
/// totals. Append it to [`write_prometheus`]'s output.
pub fn write_scopes_prometheus(w: &mut impl Write, snap: &ScopeSnapshot) -> fmt::Result {
    let totals: [(&str, &str, &str, u64); 11] = [
        (SCOPES_ACTIVE, "gauge", "Scopes running.", snap.scopes.len() as u64),
        (SCOPE_POOL_BYTES, "gauge", "The execution pool the fair share divides.", snap.pool),
        (SCOPE_SHARE_BYTES, "gauge", "Each scope's fair share now.", snap.share),
        (SCOPE_LEAKED_BYTES_TOTAL, "counter", "Bytes scopes still held when they ended.", snap.leaked_bytes),
        (SCOPE_SPILLS_TOTAL, "counter", "Spill callbacks run.", snap.spills),
        (SCOPE_SPILLED_BYTES_TOTAL, "counter", "Bytes spill callbacks said they freed.", snap.spilled_bytes),
        (
            SCOPE_RESERVE_IN_SPILL_TOTAL,
            "counter",
            "Reservations refused inside a callback.",
            snap.reserve_in_spill,
        ),
        (SCOPE_BUDGETS_TOTAL, "counter", "Budgets drawn from scopes.", snap.budgets),
        (
            SCOPE_BUDGET_BORROWED_BYTES_TOTAL,
            "counter",
            "Bytes budgets' runners borrowed past their grants.",
            snap.budget_borrowed_bytes,
        ),
        (
            SCOPE_BUDGET_FREED_EARLY_BYTES_TOTAL,
            "counter",
            "Bytes of budgets returned early (try_free).",
            snap.budget_freed_early_bytes,
        ),
        (
            SCOPE_BUDGET_OVERCOMMIT_BYTES_TOTAL,
            "counter",
            "Bytes granted past the limit to a lone budget.",
            snap.budget_overcommit_bytes,
        ),
    ];
    for (name, kind, help, value) in totals {
        writeln!(w, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}")?;
    }
    for (k, (name, kind, help)) in SCOPE_HELP.iter().enumerate() {
        writeln!(w, "# HELP {name} {help}\n# TYPE {name} {kind}")?;
        for s in &snap.scopes {
            if k < 7 {
                write!(w, "{name}{{")?;
                scope_label(w, s)?;
                writeln!(w, "}} {}", scope_metrics(s)[k].1)?;
                continue;
            }
            for c in &s.consumers {
                write!(w, "{name}{{")?;
                scope_label(w, s)?;
                w.write_str(",consumer=\"")?;
                escaped(w, &c.name)?;
                writeln!(w, "\"}} {}", if k == 7 { c.used } else { c.spills })?;
            }
        }
    }
    Ok(())
}

/// Writes the scopes as one JSON object: the totals, and `"scopes"`, an array with
/// each scope's figures and its `"consumers"`.
pub fn write_scopes_json(w: &mut impl Write, snap: &ScopeSnapshot) -> fmt::Result {
    write!(
        w,
        "{{\"pool_bytes\":{},\"share_bytes\":{},\"begun\":{},\"ended\":{},\"leaked_bytes\":{},\"spills\":{},\"spilled_bytes\":{},\"waits\":{},\"refusals\":{},\"reserve_in_spill\":{},\"owner_records\":{},\"owner_overflows\":{},\"budgets\":{},\"budget_borrowed_bytes\":{},\"budget_freed_early_bytes\":{},\"budget_overcommits\":{},\"budget_overcommit_bytes\":{},\"scopes\":[",
        snap.pool,
        snap.share,
        snap.begun,
        snap.ended,
        snap.leaked_bytes,
        snap.spills,
        snap.spilled_bytes,
        snap.waits,
        snap.refusals,
        snap.reserve_in_spill,
        snap.owner_records,
        snap.owner_overflows,
        snap.budgets,
        snap.budget_borrowed_bytes,
        snap.budget_freed_early_bytes,
        snap.budget_overcommits,
        snap.budget_overcommit_bytes
    )?;
    for (i, s) in snap.scopes.iter().enumerate() {
        w.write_str(if i == 0 { "{\"name\":\"" } else { ",{\"name\":\"" })?;
        escaped(w, &s.name)?;
        write!(w, "\",\"id\":{},\"priority\":{}", s.id, s.priority)?;
        for (name, value) in scope_metrics(s) {
            write!(w, ",\"{}\":{value}", name.trim_start_matches("memquota_scope_"))?;
        }
        match s.cap {
            Some(cap) => write!(w, ",\"cap_bytes\":{cap}")?,
            None => w.write_str(",\"cap_bytes\":null")?,
        }
        w.write_str(",\"consumers\":[")?;
        for (j, c) in s.consumers.iter().enumerate() {
            w.write_str(if j == 0 { "{\"name\":\"" } else { ",{\"name\":\"" })?;
            escaped(w, &c.name)?;
            write!(
                w,
                "\",\"bytes\":{},\"peak_bytes\":{},\"spills\":{},\"spilled_bytes\":{}}}",
                c.used, c.peak, c.spills, c.spilled_bytes
            )?;
        }
        w.write_str("]}")?;
    }
    w.write_str("]}")
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_writer_line_reads_back() {
        let w = StatsWriter { pid: 4_000_000, start: u64::MAX, rss_peak: 123_456_789 };
        assert_eq!(StatsWriter::parse(&format!("{}# HELP memquota_limit_bytes ...\n", w.line())), Some(w));
        for bad in [
            "",
            "# HELP memquota_limit_bytes The hard limit",
            "memquota_limit_bytes 1\n# memquota writer pid=1 start=2 rss_peak=3",
            "# memquota writer pid=1 start=2",
            "# memquota writer pid=1 start=x rss_peak=3",
            "# memquota writer pid=5000000000 start=2 rss_peak=3",
            "# memquota writer start=2 pid=1 rss_peak=3",
        ] {
            assert_eq!(StatsWriter::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn json_and_prometheus_agree() {
        let mut s =
            Stats { limit: 100, native: 40, reclaims_sync: 2, reclaims_background: 3, ..Stats::default() };
        s.heap.committed = 10;
        let mut prom = String::new();
        write_prometheus(&mut prom, &s).unwrap();
        assert!(prom.contains("memquota_limit_bytes 100\n"));
        assert!(prom.contains("memquota_reclaims_total{kind=\"sync\"} 2\n"));
        assert!(prom.contains("memquota_reclaims_total{kind=\"background\"} 3\n"));
        assert_eq!(prom.matches("# TYPE memquota_reclaims_total counter").count(), 1);
        let mut json = String::new();
        write_json(&mut json, &s).unwrap();
        assert!(json.starts_with("{\"limit_bytes\":100,") && json.ends_with('}'), "{json}");
        assert!(json.contains("\"reclaims_total_sync\":2") && json.contains("\"heap_committed_bytes\":10"));
        assert_eq!(prom.matches("# TYPE memquota_purges_total counter").count(), 1);
        assert!(prom.contains("memquota_purges_total{kind=\"idle\"} 0\n"));
        assert!(json.contains("\"purges_total_budget\":0") && json.contains("\"jemalloc_unused_bytes\":0"));
        s.container.pressure = PressureSource::System;
        s.container.anon_requests = 4;
        let mut prom = String::new();
        write_prometheus(&mut prom, &s).unwrap();
        assert!(prom.contains("memquota_pressure_watch{source=\"system\"} 1\n"), "{prom}");
        assert!(prom.contains("memquota_pressure_watch{source=\"cgroup\"} 0\n"));
        assert!(prom.contains("memquota_container_requests_total{cause=\"anon\"} 4\n"));
        let mut json = String::new();
        write_json(&mut json, &s).unwrap();
        assert!(
            json.contains("\"pressure_watch_system\":1")
                && json.contains("\"container_requests_total_anon\":4")
        );
    }

    #[test]
    fn scopes_export_with_labels() {
        let snap = ScopeSnapshot {
            pool: 1000,
            scopes: vec![ScopeStats {
                name: "stage \"1\"".into(),
                id: 7,
                held: 300,
                allocated: 200,
                reserved: 300,
                consumers: vec![crate::arbitration::ConsumerStats {
                    name: "sort".into(),
                    used: 100,
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut prom = String::new();
        write_scopes_prometheus(&mut prom, &snap).unwrap();
        assert!(
            prom.contains("memquota_scope_held_bytes{scope=\"stage \\\"1\\\"\",id=\"7\"} 300\n"),
            "{prom}"
        );
        assert!(prom.contains(
            "memquota_scope_consumer_bytes{scope=\"stage \\\"1\\\"\",id=\"7\",consumer=\"sort\"} 100\n"
        ));
        assert!(prom.contains("memquota_scopes_active 1\n"));
        let mut json = String::new();
        write_scopes_json(&mut json, &snap).unwrap();
        assert!(
            json.contains(
                "\"scopes\":[{\"name\":\"stage \\\"1\\\"\",\"id\":7,\"priority\":0,\"held_bytes\":300"
            ),
            "{json}"
        );
        assert!(json.contains("\"consumers\":[{\"name\":\"sort\",\"bytes\":100"), "{json}");
    }

    #[test]
    fn slice_writer_cuts_and_counts() {
        let mut buf = [0u8; 4];
        let mut w = crate::base::text::SliceWriter::new(&mut buf);
        w.write_str("abcdef").unwrap();
        assert_eq!(w.len(), 6);
        assert_eq!(&buf, b"abcd");
    }
}
