//! Stats as text for the outside world: Prometheus exposition and JSON. Both write
//! into any `fmt::Write`, so a caller can render into a fixed buffer without a heap.

use crate::config::HeapMode;
use crate::stats::Stats;
use std::fmt::{self, Write};

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
fn metrics(s: &Stats) -> [(Metric, &'static str, u64); 22] {
    let limit = if s.limit == u64::MAX { 0 } else { s.limit };
    [
        (
            gauge("memquota_limit_bytes", "The hard limit on native plus counted heap bytes (0: none)."),
            "",
            limit,
        ),
        (
            gauge("memquota_soft_limit_bytes", "Past this, reclaims run in the background."),
            "",
            s.soft_limit.min(limit),
        ),
        (gauge("memquota_headroom_bytes", "Bytes left under the limit."), "", s.headroom),
        (gauge("memquota_native_bytes", "Native bytes tracked."), "", s.native),
        (gauge("memquota_native_peak_bytes", "The highest native total granted."), "", s.native_peak),
        (
            gauge("memquota_overcommit_bytes", "Bytes over the limit granted to small requests."),
            "",
            s.overcommit,
        ),
        (
            gauge("memquota_heap_committed_bytes", "Heap committed, from the heap probe."),
            "",
            s.heap.committed,
        ),
        (gauge("memquota_heap_used_bytes", "Heap used, from the heap probe."), "", s.heap.used),
        (
            counter("memquota_reclaims_total", "Reclaims (GCs) run, by kind."),
            "{kind=\"sync\"}",
            s.reclaims_sync,
        ),
        (counter("memquota_reclaims_total", ""), "{kind=\"background\"}", s.reclaims_background),
        (
            counter("memquota_reclaimed_bytes_total", "Bytes the reclaims were measured to free."),
            "",
            s.reclaimed_bytes,
        ),
        (counter("memquota_reclaim_panics_total", "Reclaim callbacks that panicked."), "", s.reclaim_panics),
        (
            counter(
                "memquota_reclaims_throttled_total",
                "Reclaim requests turned away by the rate limit or the futility suspension.",
            ),
            "",
            s.reclaims_throttled,
        ),
        (counter("memquota_oom_total", "Allocations refused."), "", s.ooms),
        (counter("memquota_overcommit_total", "Small requests granted past the limit."), "", s.overcommits),
        (gauge("memquota_error_bound_bytes", "Bound on unflushed per-thread deltas."), "", s.error_bound),
        (gauge("memquota_jemalloc_allocated_bytes", "jemalloc stats.allocated."), "", s.jemalloc.allocated),
        (gauge("memquota_jemalloc_active_bytes", "jemalloc stats.active."), "", s.jemalloc.active),
        (gauge("memquota_jemalloc_resident_bytes", "jemalloc stats.resident."), "", s.jemalloc.resident),
        (gauge("memquota_jemalloc_retained_bytes", "jemalloc stats.retained."), "", s.jemalloc.retained),
        (gauge("memquota_process_rss_bytes", "Resident set size of the process."), "", s.process_rss),
        (
            gauge("memquota_untracked_bytes", "RSS minus native tracked minus committed heap."),
            "",
            s.untracked(),
        ),
    ]
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
                let kind = labels.trim_start_matches("{kind=\"").trim_end_matches("\"}");
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

/// A `fmt::Write` over a byte slice that counts what did not fit, for C callers that
/// want `snprintf` semantics: the text is cut, the count is the full length.
pub struct SliceWriter<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl<'a> SliceWriter<'a> {
    /// Writes into `buf`.
    pub fn new(buf: &'a mut [u8]) -> Self {
        SliceWriter { buf, len: 0 }
    }

    /// Bytes the whole text takes (may exceed the buffer).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Write for SliceWriter<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let start = self.len.min(self.buf.len());
        let take = s.len().min(self.buf.len() - start);
        self.buf[start..start + take].copy_from_slice(&s.as_bytes()[..take]);
        self.len += s.len();
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

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
    }

    #[test]
    fn slice_writer_cuts_and_counts() {
        let mut buf = [0u8; 4];
        let mut w = SliceWriter::new(&mut buf);
        w.write_str("abcdef").unwrap();
        assert_eq!(w.len(), 6);
        assert_eq!(&buf, b"abcd");
    }
}
