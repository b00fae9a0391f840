//! The stats file (`MEMQUOTA_STATS_FILE`, or the agent's `stats_file=`): Prometheus
//! text, replaced atomically, that speaks for the biggest process running.
//!
//! Children inherit `MEMQUOTA_STATS_FILE` with `LD_PRELOAD`, and every preloaded
//! process writes it. A small child must not replace the figures of the process
//! that matters: Spark's executor deletes its directories with `rm -rf` from a
//! shutdown hook, and that `rm`, preloaded too, wrote its own 4 MiB figures over
//! the executor's while the executor was still exiting. So the file's first line
//! names its writer (`text::StatsWriter`: pid, start time, peak RSS), and a process
//! leaves the file as it is when another process with a higher peak RSS wrote it and
//! still runs. At exit it also leaves a file that a bigger process wrote since this
//! one began writing stats, even if that process has ended: a parent's last figures
//! do not replace its bigger child's. A file left by an earlier run is replaced.
//!
//! A process tree (a server that forks a process per connection) is seen whole with
//! one file per process: `%p` in the path stands for the pid, as in a core pattern,
//! and a path that names a directory holds `memquota.<pid>.prom` for each process.
//! The path is expanded at each write, so a fork child writes its own file.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use memquota_core::seam::{process, text::StatsWriter as Writer};

/// When this process began writing stats (its first stats path; a fork child keeps
/// its parent's).
static STARTED: OnceLock<SystemTime> = OnceLock::new();

/// File times come from the kernel's coarse clock, which lags the clock `STARTED`
/// reads by up to a few ticks: a write this close before `STARTED` counts as since.
const CLOCK_SLACK: Duration = Duration::from_millis(20);

/// Why a process writes the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum When {
    /// Every interval, while it runs.
    Interval,
    /// Its last write, at exit.
    Exit,
}

/// Whether `me` leaves, at `when`, a file that `other` wrote: another process,
/// bigger, that still runs, or (at exit) wrote since `me` began writing stats.
fn yields(me: &Writer, other: &Writer, when: When, other_runs: bool, written_since: bool) -> bool {
    !me.is(other) && other.rss_peak > me.rss_peak && (other_runs || (when == When::Exit && written_since))
}

/// Marks when this process began writing stats; later calls keep the first time.
pub(crate) fn started() {
    STARTED.get_or_init(SystemTime::now);
}

/// The file name a process writes in a directory given as the path.
pub(crate) fn file_in_directory(pid: u32) -> String {
    format!("memquota.{pid}.prom")
}

/// Checks the path given (`MEMQUOTA_STATS_FILE`, `stats_file=`): `%` may only start
/// `%p` (the pid) or `%%` (a percent sign). A path ending in `/` names a directory,
/// made here if it does not exist (a failure to make it shows as no file, as any
/// other write error does).
pub(crate) fn check(given: &str) -> Result<(), String> {
    let mut chars = given.chars();
    while let Some(c) = chars.next() {
        if c == '%' && !matches!(chars.next(), Some('p' | '%')) {
            return Err(format!(
                "bad stats file path {given:?}: a % must start %p (the process id) or %% (a percent sign)"
            ));
        }
    }
    if given.ends_with('/') {
        let _ = std::fs::create_dir_all(given);
    }
    Ok(())
}

/// The file `pid` writes for the path given: `%p` expanded, and in a directory (one
/// that exists, or a path ending in `/`) the file of its own.
pub(crate) fn path_for(given: &str, pid: u32) -> String {
    let mut path = String::with_capacity(given.len() + 8);
    let mut chars = given.chars();
    while let Some(c) = chars.next() {
        match c {
            '%' => match chars.next() {
                Some('p') => path.push_str(&pid.to_string()),
                // `%%`, and what `check` refused (never reached: the load failed).
                Some(other) => path.push(other),
                None => path.push('%'),
            },
            c => path.push(c),
        }
    }
    if path.ends_with('/') {
        path.push_str(&file_in_directory(pid));
    } else if std::path::Path::new(&path).is_dir() {
        path = format!("{path}/{}", file_in_directory(pid));
    }
    path
}

/// Writes the Prometheus text `render` appends (of a snapshot whose peak RSS is
/// `rss_peak`) to the file `given` names for this process ([`path_for`]), atomically (a temporary file, then a rename), unless the
/// file speaks for a bigger process (see the module's comment). Errors are dropped:
/// the stats file is a view, and the program runs on without it.
pub(crate) fn write(given: &str, when: When, rss_peak: u64, render: impl FnOnce(&mut String)) {
    let pid = std::process::id();
    let path = &path_for(given, pid);
    // Without /proc the writers cannot be told apart (start 0): the file is written.
    let start = process::running_since(pid).unwrap_or(0);
    let me = Writer { pid, start, rss_peak };
    if left_to_another(path, &me, when) {
        return;
    }
    let mut text = me.line();
    render(&mut text);
    // The stats thread and an exit on another thread may write at once: one
    // temporary file each.
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let tmp = format!("{path}.tmp.{pid}.{tid}");
    let written = std::fs::File::create(&tmp).and_then(|mut f| f.write_all(text.as_bytes()));
    if written.is_ok() {
        let _ = std::fs::rename(&tmp, path);
    } else {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Whether the file at `path` was written by a process `me` yields to at `when`.
/// Only a regular file is read, opened without blocking (the path may name a FIFO
/// or a terminal).
fn left_to_another(path: &str, me: &Writer, when: When) -> bool {
    let open = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path);
    let Ok(mut file) = open else { return false };
    let Ok(meta) = file.metadata() else { return false };
    if !meta.is_file() {
        return false;
    }
    let mut head = [0u8; 128];
    let Ok(n) = file.read(&mut head) else { return false };
    let Some(other) = std::str::from_utf8(&head[..n]).ok().and_then(Writer::parse) else { return false };
    let since = *STARTED.get_or_init(SystemTime::now) - CLOCK_SLACK;
    let written_since = meta.modified().is_ok_and(|at| at >= since);
    let runs = process::running_since(other.pid) == Some(other.start);
    yields(me, &other, when, runs, written_since)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_names_one_file_per_process_with_a_pid_or_a_directory() {
        assert_eq!(path_for("/tmp/mq.prom", 42), "/tmp/mq.prom");
        assert_eq!(path_for("/tmp/mq.%p.prom", 42), "/tmp/mq.42.prom");
        assert_eq!(path_for("/tmp/100%%-%p", 7), "/tmp/100%-7");
        assert_eq!(path_for("/no/such/dir/", 7), "/no/such/dir/memquota.7.prom");
        let dir = std::env::temp_dir();
        let want = dir.join("memquota.9.prom");
        assert_eq!(path_for(dir.to_str().unwrap(), 9), want.to_str().unwrap());
        assert!(check("/tmp/a%p%%b").is_ok());
        for bad in ["/tmp/a%d", "/tmp/a%"] {
            let e = check(bad).unwrap_err();
            assert!(e.contains(bad) && e.contains("%p"), "{e}");
        }
    }

    const ME: Writer = Writer { pid: 10, start: 500, rss_peak: 4 << 20 };

    #[test]
    fn a_smaller_process_leaves_a_bigger_ones_file_while_it_runs_and_at_exit_if_written_since() {
        let big = Writer { pid: 11, start: 400, rss_peak: 900 << 20 };
        for when in [When::Interval, When::Exit] {
            assert!(yields(&ME, &big, when, true, false), "{when:?}: the bigger process still runs");
            assert!(
                !yields(&ME, &big, when, false, false),
                "{when:?}: a file from an earlier run is replaced"
            );
        }
        assert!(yields(&ME, &big, When::Exit, false, true), "it wrote after we began, and ended");
        assert!(!yields(&ME, &big, When::Interval, false, true), "a running process updates the file");
    }

    #[test]
    fn a_process_replaces_its_own_file_a_smaller_ones_and_an_equal_ones() {
        for when in [When::Interval, When::Exit] {
            let small = Writer { pid: 11, start: 400, rss_peak: 1 << 20 };
            assert!(!yields(&ME, &small, when, true, true));
            let equal = Writer { rss_peak: ME.rss_peak, ..small };
            assert!(!yields(&ME, &equal, when, true, true));
            // Itself, bigger before an exec (which keeps the pid and the start time); a
            // reused pid never has the same start time.
            let earlier_me = Writer { rss_peak: 900 << 20, ..ME };
            assert!(!yields(&ME, &earlier_me, when, true, true));
            let same_pid_other_process = Writer { start: 1, ..earlier_me };
            assert!(yields(&ME, &same_pid_other_process, when, true, true));
        }
    }
}
