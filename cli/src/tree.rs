//! `memquota stat` over a process tree: the stats files of several processes (a
//! directory that `MEMQUOTA_STATS_FILE=DIR/` or a `%p` path filled, or files named
//! one by one), a row for each process and their sum. Each process has a budget of
//! its own (a fork child inherits the limit, not the parent's account), so the sum
//! says what the tree held, not what one budget allowed.

use crate::snapshot::Snapshot;
use crate::units::bytes;
use std::fmt::Write;
use std::path::Path;

/// One process's figures, with the file they came from.
pub struct Member {
    pub source: String,
    pub snapshot: Snapshot,
}

/// The stats files `source` stands for: the regular files of a directory (sorted by
/// name, without the temporary files of a write in progress), or the path itself.
pub fn files(source: &str) -> Result<Vec<String>, String> {
    let path = Path::new(source);
    if !path.is_dir() {
        return Ok(vec![source.to_owned()]);
    }
    let entries = std::fs::read_dir(path).map_err(|e| format!("cannot read the directory {source}: {e}"))?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.path().to_string_lossy().into_owned())
        .filter(|p| !p.contains(".tmp."))
        .collect();
    names.sort();
    if names.is_empty() {
        return Err(format!("{source}: a directory with no stats files in it"));
    }
    Ok(names)
}

/// Whether the process a snapshot's writer line names still runs (None: no writer line).
fn running(s: &Snapshot) -> Option<bool> {
    let w = s.writer?;
    Some(memquota_core::seam::process::running_since(w.pid) == Some(w.start) && w.start != 0)
}

/// The table: a row per process, then the sums.
pub fn table(members: &[Member]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "  {:<8} {:<8} {:>10} {:>10} {:>11} {:>10} {:>9} {:>8}",
        "pid", "state", "limit", "native", "native peak", "RSS peak", "refusals", "reports"
    );
    let mut sum = Snapshot::default();
    let mut rss_peaks = 0u64;
    for m in members {
        let s = &m.snapshot;
        let (pid, rss_peak) = match s.writer {
            Some(w) => (w.pid.to_string(), w.rss_peak.max(s.process_rss_peak)),
            None => ("?".to_owned(), s.process_rss_peak),
        };
        let state = match running(s) {
            Some(true) => "running",
            Some(false) => "ended",
            None => "?",
        };
        let _ = writeln!(
            t,
            "  {pid:<8} {state:<8} {:>10} {:>10} {:>11} {:>10} {:>9} {:>8}  {}",
            s.limit_text(),
            bytes(s.native),
            bytes(s.native_peak),
            bytes(rss_peak),
            s.ooms,
            s.oom_reports,
            m.source
        );
        sum.native += s.native;
        sum.native_peak += s.native_peak;
        sum.ooms += s.ooms;
        sum.oom_reports += s.oom_reports;
        rss_peaks += rss_peak;
    }
    let _ = writeln!(
        t,
        "  {:<8} {:<8} {:>10} {:>10} {:>11} {:>10} {:>9} {:>8}",
        "total",
        format!("{} proc", members.len()),
        "",
        bytes(sum.native),
        bytes(sum.native_peak),
        bytes(rss_peaks),
        sum.ooms,
        sum.oom_reports
    );
    t.push_str(
        "  Each process has a budget of its own. The peaks are summed: at most what the tree\n  \
         held at once, since the processes peaked at different times.\n",
    );
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use memquota_core::seam::text::StatsWriter;

    fn member(pid: u32, native: u64, ooms: u64) -> Member {
        let writer = StatsWriter { pid, start: 0, rss_peak: 10 << 20 };
        let snapshot = Snapshot {
            native,
            native_peak: 2 * native,
            ooms,
            oom_reports: 1,
            writer: Some(writer),
            ..Snapshot::default()
        };
        Member { source: format!("memquota.{pid}.prom"), snapshot }
    }

    #[test]
    fn the_table_sums_the_processes() {
        let t = table(&[member(11, 1 << 20, 3), member(12, 3 << 20, 4)]);
        let total = t.lines().find(|l| l.trim_start().starts_with("total")).unwrap();
        let cells: Vec<&str> = total.split_whitespace().collect();
        assert_eq!(cells, ["total", "2", "proc", "4.0", "MiB", "8.0", "MiB", "20.0", "MiB", "7", "2"], "{t}");
        assert!(t.contains("memquota.11.prom") && t.contains("memquota.12.prom"), "{t}");
    }
}
