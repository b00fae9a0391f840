//! One snapshot of the budget, read from the Prometheus text the library writes
//! (`memquota::write_prometheus`: the stats file and `GET /metrics`).

use crate::units::bytes;
use memquota_core::seam::text::{metric, StatsWriter};
use prometheus_parse::{Scrape, Value};
use std::fmt::Write;

/// The figures of one snapshot. A metric the text lacks reads as 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub limit: u64,
    pub soft_limit: u64,
    pub headroom: u64,
    pub native: u64,
    pub native_peak: u64,
    pub overcommit: u64,
    pub heap_committed: u64,
    pub heap_used: u64,
    pub reclaims_sync: u64,
    pub reclaims_background: u64,
    pub reclaimed_bytes: u64,
    pub reclaim_panics: u64,
    pub reclaims_throttled: u64,
    pub ooms: u64,
    pub oom_reports: u64,
    pub overcommits: u64,
    pub error_bound: u64,
    pub jemalloc_allocated: u64,
    pub jemalloc_active: u64,
    pub jemalloc_resident: u64,
    pub jemalloc_retained: u64,
    pub process_rss: u64,
    pub process_rss_peak: u64,
    pub untracked: u64,
    /// The process a stats file's first line names (an endpoint's text has none).
    pub writer: Option<StatsWriter>,
}

impl Snapshot {
    /// Parses Prometheus text exposition. Fails when it is not that format or holds
    /// no memquota metric at all.
    pub fn parse(text: &str) -> Result<Snapshot, String> {
        let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
            .map_err(|e| format!("not Prometheus text: {e}"))?;
        let mut s = Snapshot { writer: StatsWriter::parse(text), ..Snapshot::default() };
        let mut known = 0;
        for sample in &scrape.samples {
            let value = match sample.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
                _ => continue,
            };
            // `as` saturates: NaN and negatives read as 0.
            let value = value as u64;
            let field = match (sample.metric.as_str(), sample.labels.get("kind")) {
                (metric::LIMIT_BYTES, _) => &mut s.limit,
                (metric::SOFT_LIMIT_BYTES, _) => &mut s.soft_limit,
                (metric::HEADROOM_BYTES, _) => &mut s.headroom,
                (metric::NATIVE_BYTES, _) => &mut s.native,
                (metric::NATIVE_PEAK_BYTES, _) => &mut s.native_peak,
                (metric::OVERCOMMIT_BYTES, _) => &mut s.overcommit,
                (metric::HEAP_COMMITTED_BYTES, _) => &mut s.heap_committed,
                (metric::HEAP_USED_BYTES, _) => &mut s.heap_used,
                (metric::RECLAIMS_TOTAL, Some("sync")) => &mut s.reclaims_sync,
                (metric::RECLAIMS_TOTAL, Some("background")) => &mut s.reclaims_background,
                (metric::RECLAIMED_BYTES_TOTAL, _) => &mut s.reclaimed_bytes,
                (metric::RECLAIM_PANICS_TOTAL, _) => &mut s.reclaim_panics,
                (metric::RECLAIMS_THROTTLED_TOTAL, _) => &mut s.reclaims_throttled,
                (metric::OOM_TOTAL, _) => &mut s.ooms,
                (metric::OOM_REPORTS_TOTAL, _) => &mut s.oom_reports,
                (metric::OVERCOMMIT_TOTAL, _) => &mut s.overcommits,
                (metric::ERROR_BOUND_BYTES, _) => &mut s.error_bound,
                (metric::JEMALLOC_ALLOCATED_BYTES, _) => &mut s.jemalloc_allocated,
                (metric::JEMALLOC_ACTIVE_BYTES, _) => &mut s.jemalloc_active,
                (metric::JEMALLOC_RESIDENT_BYTES, _) => &mut s.jemalloc_resident,
                (metric::JEMALLOC_RETAINED_BYTES, _) => &mut s.jemalloc_retained,
                (metric::PROCESS_RSS_BYTES, _) => &mut s.process_rss,
                (metric::PROCESS_RSS_PEAK_BYTES, _) => &mut s.process_rss_peak,
                (metric::UNTRACKED_BYTES, _) => &mut s.untracked,
                _ => continue,
            };
            *field = value;
            known += 1;
        }
        if known == 0 {
            return Err("no memquota_* metrics in it".into());
        }
        Ok(s)
    }

    /// Reclaims of both kinds.
    pub fn reclaims(&self) -> u64 {
        self.reclaims_sync + self.reclaims_background
    }

    /// The limit for people: 0 means none.
    pub fn limit_text(&self) -> String {
        match self.limit {
            0 => "none".into(),
            l => bytes(l),
        }
    }

    /// The snapshot as an aligned table, for `memquota stat`.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let mut row = |name: &str, value: String| {
            let _ = writeln!(t, "  {name:<16} {value}");
        };
        if let Some(w) = self.writer {
            row("written by", format!("pid {}  (peak RSS {})", w.pid, bytes(w.rss_peak)));
        }
        row("limit", format!("{}  (soft threshold {})", self.limit_text(), bytes(self.soft_limit)));
        row("headroom", bytes(self.headroom));
        row(
            "native",
            format!(
                "{}  (peak {}, +/- {} unflushed)",
                bytes(self.native),
                bytes(self.native_peak),
                bytes(self.error_bound)
            ),
        );
        row("heap", format!("{} committed, {} used", bytes(self.heap_committed), bytes(self.heap_used)));
        row(
            "reclaims",
            format!(
                "{} sync, {} background; freed {}  ({} panicked, {} throttled)",
                self.reclaims_sync,
                self.reclaims_background,
                bytes(self.reclaimed_bytes),
                self.reclaim_panics,
                self.reclaims_throttled
            ),
        );
        row("refusals", self.ooms.to_string());
        row(
            "over-commit",
            format!("{} now, {} grants past the limit", bytes(self.overcommit), self.overcommits),
        );
        row(
            "jemalloc",
            format!(
                "allocated {}, active {}, resident {}, retained {}",
                bytes(self.jemalloc_allocated),
                bytes(self.jemalloc_active),
                bytes(self.jemalloc_resident),
                bytes(self.jemalloc_retained)
            ),
        );
        row("process RSS", format!("{}  ({} untracked)", bytes(self.process_rss), bytes(self.untracked)));
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# HELP memquota_limit_bytes The hard limit on native plus counted heap bytes (0: none).
# TYPE memquota_limit_bytes gauge
memquota_limit_bytes 268435456
# HELP memquota_native_bytes Native bytes tracked.
# TYPE memquota_native_bytes gauge
memquota_native_bytes 125836852
# HELP memquota_reclaims_total Reclaims (GCs) run, by kind.
# TYPE memquota_reclaims_total counter
memquota_reclaims_total{kind=\"sync\"} 2
memquota_reclaims_total{kind=\"background\"} 3
# HELP memquota_oom_total Allocations refused.
# TYPE memquota_oom_total counter
memquota_oom_total 1
some_other_metric 7
";

    #[test]
    fn parses_the_exposition() {
        let s = Snapshot::parse(TEXT).unwrap();
        assert_eq!(s.limit, 256 << 20);
        assert_eq!(s.native, 125836852);
        assert_eq!((s.reclaims_sync, s.reclaims_background, s.reclaims()), (2, 3, 5));
        assert_eq!(s.ooms, 1);
        assert_eq!(s.heap_committed, 0);
        let table = s.table();
        assert!(table.contains("limit            256.0 MiB"), "{table}");
        assert!(table.contains("reclaims         2 sync, 3 background"), "{table}");
        assert!(table.contains("refusals         1\n"), "{table}");
    }

    #[test]
    fn rejects_what_is_not_ours() {
        assert!(Snapshot::parse("").is_err());
        assert!(Snapshot::parse("<html>hello</html>").is_err());
        assert!(Snapshot::parse("up 1\n").is_err());
    }
}
