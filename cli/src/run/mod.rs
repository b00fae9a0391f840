//! `memquota run`: the program under libmemquota.so, its stats file polled into a
//! timeline, a live status line, a summary, and its exit status passed through.

mod env;
mod exit_status;
mod paths;
mod sampler;
mod signals;
mod status_line;
mod summary;

pub use exit_status::pass_through;

use crate::units;
use crate::Failure;
use paths::TempDir;
use sampler::Sampler;
use status_line::StatusLine;
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

/// The preload's file name, looked for next to this executable.
pub const PRELOAD_NAME: &str = "libmemquota.so";

/// Runs a program under the memquota budget.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The limit on native plus heap bytes: 512m, 2g, 75% (of RAM). Without it,
    /// MEMQUOTA_LIMIT from the environment, else the cgroup limit, else RAM.
    #[arg(long, value_name = "SIZE", value_parser = units::parse_limit)]
    limit: Option<String>,

    /// Keep the stats (Prometheus text, rewritten every interval) in this file
    /// [default: a temporary file, removed at the end].
    #[arg(long, value_name = "FILE")]
    stats_file: Option<PathBuf>,

    /// Write the timeline of the run as an SVG: native, heap, limit, headroom, with
    /// reclaims and refusals marked.
    #[arg(long, value_name = "SVG")]
    plot: Option<PathBuf>,

    /// How often the program writes its stats and this command reads them (at least 10ms).
    #[arg(long, value_name = "DURATION", default_value = "100ms", value_parser = units::parse_interval)]
    interval: Duration,

    /// The preload library [default: libmemquota.so next to this executable].
    #[arg(long, value_name = "PATH")]
    preload: Option<PathBuf>,

    /// Load the preload as a JVMTI agent too, into every JVM the program starts
    /// (through JAVA_TOOL_OPTIONS): the heap counts in the budget, and GCs make room
    /// for native memory (docs/jvm.md).
    #[arg(long)]
    jvm: bool,

    /// The program and its arguments, after `--`.
    #[arg(value_name = "CMD", required = true, trailing_var_arg = true)]
    command: Vec<OsString>,
}

/// Runs the program to its end and returns its status, with everything of ours
/// (temporary files, the status line) cleaned up and the summary printed.
pub fn run(args: RunArgs) -> Result<ExitStatus, Failure> {
    let preload = paths::find_preload(args.preload.as_deref())?;
    if let Some(svg) = &args.plot {
        paths::check_directory("--plot", svg)?;
    }
    let (stats_path, _temp) = match &args.stats_file {
        Some(path) => (paths::prepare_stats_file(path)?, None),
        None => {
            let dir = TempDir::new().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
            (dir.0.join("stats.prom"), Some(dir))
        }
    };
    let shown = summary::command_line(&args.command);

    let mut cmd = env::command(&args, &preload, &stats_path);
    signals::forward_signals();
    let terminal_signals = signals::block_terminal_signals(&mut cmd);
    let start_wall = SystemTime::now();
    let started = Instant::now();
    let spawned = cmd.spawn();
    signals::ignore_and_unblock(&terminal_signals);
    let mut child = spawned.map_err(|e| Failure {
        code: if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 },
        message: format!("cannot run {}: {e}", args.command[0].to_string_lossy()),
    })?;

    let pid = child.id() as libc::pid_t;
    let (exited_tx, exited) = mpsc::channel();
    std::thread::spawn(move || {
        signals::wait_without_reaping(pid);
        let _ = exited_tx.send(());
    });

    let mut sampler = Sampler::new(stats_path.clone(), start_wall, started);
    let mut status_line = StatusLine::new();
    loop {
        // Wakes at once when the program exits; else every interval.
        if !matches!(exited.recv_timeout(args.interval), Err(mpsc::RecvTimeoutError::Timeout)) {
            break;
        }
        // Before `child.wait` below: the pid is still the program's.
        signals::forward_pending(pid);
        sampler.poll();
        status_line.show(sampler.last.as_ref());
    }
    let status = child.wait().map_err(|e| format!("waiting for the program failed: {e}"))?;
    let elapsed = started.elapsed();
    sampler.poll(); // the exit write, if the program lived to make it
    status_line.clear();

    let summary = summary::summary(&args, &shown, status, elapsed, &sampler, &stats_path);
    let _ = std::io::stderr().write_all(summary.as_bytes());
    Ok(status)
}
