//! `MEMQUOTA_REPORT`: the one-screen summary at exit, for the process it was set for.
//!
//! Children and fork children inherit the variable with `LD_PRELOAD`, and a shell
//! script or a test suite would print a summary per process (CPython's suite went from
//! 1 to 24 failures under the preload for that alone). So `exit` speaks for one
//! process: the first to see it records its pid in `MEMQUOTA_REPORT_PID`, which its
//! children inherit; a process reports only if that pid is its own (itself, or itself
//! after an `exec`, which keeps the pid). `exit-all` is the explicit opt-in for every
//! process.
//!
//! The summary is written to a copy of stderr made at load time: `ls` and
//! `/bin/echo` close stdout and stderr in an atexit handler, which runs before ours
//! (handlers run in reverse order of registration, and ours is registered before
//! `main`).

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering::*};

use memquota_core::seam::process::vars::{REPORT, REPORT_PID};

/// Which processes print the summary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Report {
    None,
    /// The process `MEMQUOTA_REPORT=exit` was set for, not its children.
    Top,
    /// Every process that inherits `MEMQUOTA_REPORT=exit-all`.
    Every,
}

/// The pid the summary speaks for (0: none; `u32::MAX`: any, under `exit-all`).
static REPORTER: AtomicU32 = AtomicU32::new(0);
/// The copy of stderr the summary goes to (-1: none), and the file it was a copy of
/// (device, inode), to tell at exit whether the program closed the number and it now
/// names something else.
static KEPT_FD: AtomicI32 = AtomicI32::new(-1);
static KEPT_DEV: AtomicU64 = AtomicU64::new(0);
static KEPT_INO: AtomicU64 = AtomicU64::new(0);
/// The copy goes at or above this number: out of the way of the low numbers programs
/// open, close and `dup2` onto (shells use 10 and up for their own redirections).
const KEPT_FD_MIN: libc::c_int = 100;

/// `MEMQUOTA_REPORT` as set.
///
/// # Errors
/// The one-line message for a bad value.
pub(crate) fn read_setting() -> Result<Report, String> {
    match std::env::var(REPORT).as_deref() {
        Err(_) | Ok("") | Ok("none") => Ok(Report::None),
        Ok("exit") => Ok(Report::Top),
        Ok("exit-all") => Ok(Report::Every),
        Ok(v) => Err(format!("memquota: bad {REPORT}={v:?}: expected exit, exit-all or none")),
    }
}

/// Decides at load time whether this process prints the summary at exit and, if it
/// does, keeps its copy of stderr. Returns whether it does. Runs in the library's
/// constructor, before `main` and any thread of the program: nothing else reads the
/// environment yet.
pub(crate) fn arm(report: Report) -> bool {
    let pid = std::process::id();
    let reporter = match report {
        Report::None => return false,
        Report::Every => u32::MAX,
        Report::Top => match std::env::var(REPORT_PID).ok().and_then(|v| v.parse::<u32>().ok()) {
            Some(top) if top != pid => return false,
            Some(_) => pid, // the top process, after an exec
            None => {
                std::env::set_var(REPORT_PID, pid.to_string());
                pid
            }
        },
    };
    REPORTER.store(reporter, Relaxed);
    keep_stderr();
    true
}

/// Copies fd 2 to a high, close-on-exec number: an exec'd program must not inherit it
/// (it would hold a pipe's write end open for as long as it runs).
fn keep_stderr() {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) only reads fd 2 and makes a new descriptor.
    let mut fd = unsafe { libc::fcntl(libc::STDERR_FILENO, libc::F_DUPFD_CLOEXEC, KEPT_FD_MIN) };
    if fd < 0 {
        // RLIMIT_NOFILE at or under KEPT_FD_MIN: any free number will do.
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) only reads fd 2 and makes a new descriptor.
        fd = unsafe { libc::fcntl(libc::STDERR_FILENO, libc::F_DUPFD_CLOEXEC, 3) };
    }
    let Some((dev, ino)) = identity(fd) else { return };
    KEPT_DEV.store(dev, Relaxed);
    KEPT_INO.store(ino, Relaxed);
    KEPT_FD.store(fd, Release);
}

/// The (device, inode) of the file `fd` is open on.
fn identity(fd: libc::c_int) -> Option<(u64, u64)> {
    if fd < 0 {
        return None;
    }
    // SAFETY: `stat` is plain old data; all-zero is a valid value for fstat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes only the valid out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some((st.st_dev, st.st_ino))
}

/// In a fork child: it is not the process `exit` was set for, so it stays silent and
/// gives its copy of stderr back (a daemon that forks and closes fd 2 must not keep
/// its parent's pipe open through us). Under `exit-all` it reports too, and keeps it.
/// Async-signal-safe: atomics and `close`.
pub(crate) fn after_fork_child() {
    if REPORTER.load(Relaxed) == u32::MAX {
        return;
    }
    REPORTER.store(0, Relaxed);
    let fd = KEPT_FD.swap(-1, AcqRel);
    if fd >= 0 {
        // SAFETY: `fd` is our own descriptor, which no other code of the child knows.
        unsafe { libc::close(fd) };
    }
}

/// Writes the summary, if this process is the one it speaks for. The pid is compared
/// again here: a child made without the fork handlers (`vfork`, a raw `clone`) that
/// calls `exit` runs our handler with our memory but its own pid.
pub(crate) fn write_at_exit(summary: impl FnOnce() -> String) {
    let reporter = REPORTER.load(Relaxed);
    if reporter == 0 || (reporter != u32::MAX && reporter != std::process::id()) {
        return;
    }
    let text = summary();
    let fd = KEPT_FD.load(Acquire);
    let same = identity(fd).is_some_and(|id| id == (KEPT_DEV.load(Relaxed), KEPT_INO.load(Relaxed)));
    // Our copy, unless the program closed that number (it may now name another file):
    // then fd 2, as well as it can be.
    memquota_core::seam::text::write_fd(if same { fd } else { libc::STDERR_FILENO }, &text);
}
