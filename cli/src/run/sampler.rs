//! The stats sampler: the program's stats file, read whenever it has been replaced,
//! into the timeline, the last snapshot and the peaks of the summary.

use super::PRELOAD_NAME;
use crate::plot::Point;
use crate::snapshot::Snapshot;
use crate::units::bytes;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Instant, SystemTime};

/// Reads the stats file whenever the program has replaced it.
pub(super) struct Sampler {
    path: PathBuf,
    start_wall: SystemTime,
    started: Instant,
    /// (inode, mtime, size) of the last file read: each write is a new file (rename).
    last_key: Option<(u64, i64, i64, u64)>,
    pub(super) points: Vec<Point>,
    pub(super) last: Option<Snapshot>,
    /// The last file's text: its comment lines carry the top sites at exit.
    pub(super) last_text: String,
    peak_native: u64,
    peak_heap: u64,
    peak_untracked: u64,
}

impl Sampler {
    pub(super) fn new(path: PathBuf, start_wall: SystemTime, started: Instant) -> Sampler {
        Sampler {
            path,
            start_wall,
            started,
            last_key: None,
            points: Vec::new(),
            last: None,
            last_text: String::new(),
            peak_native: 0,
            peak_heap: 0,
            peak_untracked: 0,
        }
    }

    /// Takes a sample if the file is new since the last one.
    pub(super) fn poll(&mut self) {
        let Ok(mut file) = File::open(&self.path) else { return };
        let Ok(meta) = file.metadata() else { return };
        let key = (meta.ino(), meta.mtime(), meta.mtime_nsec(), meta.size());
        if self.last_key == Some(key) {
            return;
        }
        let mut text = String::new();
        if file.read_to_string(&mut text).is_err() {
            return;
        }
        self.last_key = Some(key);
        let Ok(s) = Snapshot::parse(&text) else { return };
        self.last_text = text.clone();
        // When it was written, by its mtime, if that is sane; else now.
        let now = self.started.elapsed().as_secs_f64();
        let written = meta
            .modified()
            .ok()
            .and_then(|m| m.duration_since(self.start_wall).ok())
            .map(|d| d.as_secs_f64())
            .filter(|&t| t <= now + 0.5)
            .unwrap_or(now);
        let t = written.max(self.points.last().map_or(0.0, |p| p.t));
        self.points.push(Point {
            t,
            native: s.native,
            heap_committed: s.heap_committed,
            limit: s.limit,
            headroom: s.headroom,
            reclaims: s.reclaims(),
            ooms: s.ooms,
        });
        self.peak_native = self.peak_native.max(s.native_peak).max(s.native);
        self.peak_heap = self.peak_heap.max(s.heap_committed);
        self.peak_untracked = self.peak_untracked.max(s.untracked);
        self.last = Some(s);
    }

    /// The summary table's rows.
    pub(super) fn summary(&self) -> String {
        let Some(s) = &self.last else {
            return format!(
                "  no stats: {PRELOAD_NAME} wrote none (it writes every interval and at exit(), not \
                 at _exit()), or was not loaded (static and setuid programs ignore LD_PRELOAD)\n"
            );
        };
        let rows = [
            ("limit", s.limit_text()),
            ("peak native", bytes(self.peak_native)),
            ("peak heap", format!("{} committed", bytes(self.peak_heap))),
            (
                "reclaims",
                format!(
                    "{} ({} sync, {} background), freed {}",
                    s.reclaims(),
                    s.reclaims_sync,
                    s.reclaims_background,
                    bytes(s.reclaimed_bytes)
                ),
            ),
            ("refusals", s.ooms.to_string()),
            (
                "untracked RSS",
                format!("{} at the end, {} at most", bytes(s.untracked), bytes(self.peak_untracked)),
            ),
            ("samples", self.points.len().to_string()),
        ];
        rows.iter().map(|(name, value)| format!("  {name:<16} {value}\n")).collect()
    }
}
