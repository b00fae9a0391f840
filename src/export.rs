//! Stats as text for the outside world: Prometheus exposition and JSON. Both write
//! into any `fmt::Write`, so a caller can render into a fixed buffer without a heap.

use crate::config::HeapMode;
use crate::scope::{ScopeSnapshot, ScopeStats};
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
fn metrics(s: &Stats) -> [(Metric, &'static str, u64); 24] {
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
            gauge("memquota_overcommit_bytes", "Bytes past the limit now (native plus counted heap)."),
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
        (
            counter("memquota_oom_reports_total", "Full OOM reports written (the other refusals were summed up)."),
            "",
            s.reports,
        ),
        (
            counter("memquota_overcommit_total", "Grants that left native plus heap past the limit."),
            "",
            s.overcommits,
        ),
        (
            gauge(
                "memquota_error_bound_bytes",
                "Bound on unflushed per-thread deltas, and on usage past the limit from memory already taken.",
            ),
            "",
            s.error_bound,
        ),
        (
            counter("memquota_heap_probe_panics_total", "Heap probe calls that panicked (caught)."),
            "",
            s.heap_probe_panics,
        ),
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
        ("memquota_scope_held_bytes", i(s.held)),
        ("memquota_scope_peak_bytes", i(s.peak)),
        ("memquota_scope_allocated_bytes", s.allocated),
        ("memquota_scope_reserved_bytes", i(s.reserved)),
        ("memquota_scope_threads", i64::from(s.threads)),
        ("memquota_scope_waits_total", i(s.waits)),
        ("memquota_scope_refusals_total", i(s.refusals)),
    ]
}

const SCOPE_HELP: [(&str, &str, &str); 9] = [
    (
        "memquota_scope_held_bytes",
        "gauge",
        "What the scope is charged: the larger of allocated and reserved.",
    ),
    ("memquota_scope_peak_bytes", "gauge", "The highest charge of the scope."),
    ("memquota_scope_allocated_bytes", "gauge", "Bytes the scope's threads allocated minus freed (flushed)."),
    ("memquota_scope_reserved_bytes", "gauge", "Bytes the scope reserved explicitly."),
    ("memquota_scope_threads", "gauge", "Threads attached to the scope."),
    ("memquota_scope_waits_total", "counter", "Requests of the scope that waited for their fair share."),
    ("memquota_scope_refusals_total", "counter", "Requests of the scope refused."),
    ("memquota_scope_consumer_bytes", "gauge", "Bytes a spillable consumer reserved."),
    ("memquota_scope_consumer_spills_total", "counter", "Times a consumer was asked to spill."),
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
    let totals: [(&str, &str, &str, u64); 7] = [
        ("memquota_scopes_active", "gauge", "Scopes running.", snap.scopes.len() as u64),
        ("memquota_scope_pool_bytes", "gauge", "The execution pool the fair share divides.", snap.pool),
        ("memquota_scope_share_bytes", "gauge", "Each scope's fair share now.", snap.share),
        (
            "memquota_scope_leaked_bytes_total",
            "counter",
            "Bytes scopes still held when they ended.",
            snap.leaked_bytes,
        ),
        ("memquota_scope_spills_total", "counter", "Spill callbacks run.", snap.spills),
        (
            "memquota_scope_spilled_bytes_total",
            "counter",
            "Bytes spill callbacks said they freed.",
            snap.spilled_bytes,
        ),
        (
            "memquota_scope_reserve_in_spill_total",
            "counter",
            "Reservations refused inside a callback.",
            snap.reserve_in_spill,
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
        "{{\"pool_bytes\":{},\"share_bytes\":{},\"begun\":{},\"ended\":{},\"leaked_bytes\":{},\"spills\":{},\"spilled_bytes\":{},\"waits\":{},\"refusals\":{},\"reserve_in_spill\":{},\"owner_records\":{},\"owner_overflows\":{},\"scopes\":[",
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
        snap.owner_overflows
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
    fn scopes_export_with_labels() {
        let snap = ScopeSnapshot {
            pool: 1000,
            scopes: vec![ScopeStats {
                name: "stage \"1\"".into(),
                id: 7,
                held: 300,
                allocated: 200,
                reserved: 300,
                consumers: vec![crate::scope::ConsumerStats {
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
        let mut w = SliceWriter::new(&mut buf);
        w.write_str("abcdef").unwrap();
        assert_eq!(w.len(), 6);
        assert_eq!(&buf, b"abcd");
    }
}
