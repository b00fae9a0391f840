//! `memquota run`: the program under libmemquota.so, its stats file polled into a
//! timeline, a live status line, a summary, and its exit status passed through.

use crate::plot::{self, Point};
use crate::snapshot::Snapshot;
use crate::units::{self, bytes};
use crate::Failure;
use std::ffi::OsString;
use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
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

/// `-agentpath:` for the preload (the agent reads the budget from the same
/// `MEMQUOTA_*` variables), before any JAVA_TOOL_OPTIONS already set. The path has no
/// space: `find_preload` refuses one, and the JVM splits these options on spaces.
fn java_tool_options(preload: &Path) -> OsString {
    let mut v = OsString::from("-agentpath:");
    v.push(preload);
    if let Some(old) = std::env::var_os("JAVA_TOOL_OPTIONS").filter(|v| !v.is_empty()) {
        v.push(" ");
        v.push(old);
    }
    v
}

/// The last terminating signal (SIGTERM, SIGHUP) sent to us, to forward to the program.
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn remember_signal(sig: libc::c_int) {
    PENDING_SIGNAL.store(sig, Ordering::Relaxed); // async-signal-safe: one atomic store
}

/// Runs the program to its end and returns its status, with everything of ours
/// (temporary files, the status line) cleaned up and the summary printed.
pub fn run(args: RunArgs) -> Result<ExitStatus, Failure> {
    let preload = find_preload(args.preload.as_deref())?;
    if let Some(svg) = &args.plot {
        check_directory("--plot", svg)?;
    }
    let (stats_path, _temp) = match &args.stats_file {
        Some(path) => (prepare_stats_file(path)?, None),
        None => {
            let dir = TempDir::new().map_err(|e| format!("cannot make a temporary directory: {e}"))?;
            (dir.0.join("stats.prom"), Some(dir))
        }
    };
    let shown = command_line(&args.command);

    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..]);
    let ld_preload = match std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        Some(old) => {
            let mut v = preload.clone().into_os_string();
            v.push(":");
            v.push(old);
            v
        }
        None => preload.clone().into_os_string(),
    };
    cmd.env("LD_PRELOAD", ld_preload)
        .env("MEMQUOTA_STATS_FILE", &stats_path)
        .env("MEMQUOTA_STATS_INTERVAL", format!("{}ms", args.interval.as_millis()));
    if let Some(limit) = &args.limit {
        cmd.env("MEMQUOTA_LIMIT", limit);
    }
    if args.jvm {
        cmd.env("JAVA_TOOL_OPTIONS", java_tool_options(&preload));
    }

    forward_signals();
    // A terminal's Ctrl-C and Ctrl-\ reach the program too (same process group): we
    // outlive them to report, then pass its fate on. Ignored only after the spawn (the
    // program would inherit an ignored disposition), blocked until then, and unblocked
    // in the program before its exec.
    let terminal_signals = terminal_signal_set();
    // SAFETY: the closure runs in the child between fork and exec, and only calls
    // pthread_sigmask (async-signal-safe) on a set copied into it.
    unsafe {
        cmd.pre_exec(move || {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &terminal_signals, std::ptr::null_mut());
            Ok(())
        })
    };
    // SAFETY: changes this thread's mask only, with an initialised set.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &terminal_signals, std::ptr::null_mut()) };
    let start_wall = SystemTime::now();
    let started = Instant::now();
    let spawned = cmd.spawn();
    ignore_and_unblock(&terminal_signals);
    let mut child = spawned.map_err(|e| Failure {
        code: if e.kind() == std::io::ErrorKind::NotFound { 127 } else { 126 },
        message: format!("cannot run {}: {e}", args.command[0].to_string_lossy()),
    })?;

    let pid = child.id() as libc::pid_t;
    let (exited_tx, exited) = mpsc::channel();
    std::thread::spawn(move || {
        wait_without_reaping(pid);
        let _ = exited_tx.send(());
    });

    let mut sampler = Sampler::new(stats_path.clone(), start_wall, started);
    let mut status_line = StatusLine::new();
    loop {
        // Wakes at once when the program exits; else every interval.
        if !matches!(exited.recv_timeout(args.interval), Err(mpsc::RecvTimeoutError::Timeout)) {
            break;
        }
        let sig = PENDING_SIGNAL.swap(0, Ordering::Relaxed);
        if sig != 0 {
            // SAFETY: kill has no memory preconditions. `pid` is our unreaped child
            // (reaped only below, by `child.wait`), so it names no other process.
            unsafe { libc::kill(pid, sig) };
        }
        sampler.poll();
        status_line.show(sampler.last.as_ref());
    }
    let status = child.wait().map_err(|e| format!("waiting for the program failed: {e}"))?;
    let elapsed = started.elapsed();
    sampler.poll(); // the exit write, if the program lived to make it
    status_line.clear();

    let mut summary =
        format!("memquota: {shown} {} after {:.1} s\n", describe(status), elapsed.as_secs_f64());
    summary.push_str(&sampler.summary());
    if args.stats_file.is_some() {
        summary.push_str(&format!("  {:<16} {}\n", "stats file", stats_path.display()));
    }
    if let Some(svg) = &args.plot {
        if sampler.points.is_empty() {
            summary.push_str(&format!("  {:<16} not written: no samples\n", "plot"));
        } else {
            let limit = sampler.last.map(|s| s.limit_text()).unwrap_or_default();
            let title = format!("memquota run: {} (limit {limit})", shorten(&shown, 70));
            match plot::write_svg(svg, &title, &sampler.points) {
                Ok(()) => summary.push_str(&format!("  {:<16} {}\n", "plot", svg.display())),
                Err(e) => summary.push_str(&format!("  {:<16} {e}\n", "plot")),
            }
        }
    }
    let _ = std::io::stderr().write_all(summary.as_bytes());
    Ok(status)
}

/// Ends this process the way the program ended: the same exit code, or the same
/// signal (re-raised on ourselves with its default action, without a core dump),
/// falling back to 128 + the signal number.
pub fn pass_through(status: ExitStatus) -> ! {
    if let Some(code) = status.code() {
        std::process::exit(code);
    }
    if let Some(sig) = status.signal() {
        let _ = std::io::stderr().flush();
        // SAFETY: plain libc calls on valid, initialised arguments. Resetting the
        // disposition and unblocking the signal makes `raise` end the process (the
        // only other thread, the waiter, has returned).
        unsafe {
            let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::setrlimit(libc::RLIMIT_CORE, &no_core);
            libc::signal(sig, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, sig);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::raise(sig);
        }
        std::process::exit(128 + sig);
    }
    std::process::exit(1)
}

/// `--preload`, or libmemquota.so next to this executable; absolute, and usable in
/// LD_PRELOAD (which splits on spaces and colons).
fn find_preload(given: Option<&Path>) -> Result<PathBuf, Failure> {
    let path = match given {
        Some(p) => p.to_path_buf(),
        None => {
            let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable: {e}"))?;
            exe.parent().unwrap_or(Path::new("/")).join(PRELOAD_NAME)
        }
    };
    if !path.is_file() {
        let how = match given {
            Some(_) => "check --preload".to_string(),
            None => "it belongs next to the memquota executable (`cargo build --release` puts both \
                     in target/release/), or pass --preload PATH"
                .to_string(),
        };
        return Err(format!("the preload library {} is missing: {how}", path.display()).into());
    }
    let path = path.canonicalize().map_err(|e| format!("the preload library {}: {e}", path.display()))?;
    let text = path.to_string_lossy();
    if text.contains([' ', ':']) {
        return Err(format!(
            "the preload library's path {text} has a space or a colon, which LD_PRELOAD cannot \
             hold: move it, or pass --preload with another path"
        )
        .into());
    }
    Ok(path)
}

/// Makes `--stats-file` absolute (the program may change directory) and removes a
/// stale one, so that nothing from an earlier run is read as this run's.
fn prepare_stats_file(path: &Path) -> Result<PathBuf, Failure> {
    let path = std::env::current_dir().map_err(|e| format!("no current directory: {e}"))?.join(path);
    check_directory("--stats-file", &path)?;
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(format!("--stats-file {}: cannot replace it: {e}", path.display()).into())
        }
        _ => Ok(path),
    }
}

/// Fails unless the directory `path` is to be written in exists.
fn check_directory(flag: &str, path: &Path) -> Result<(), Failure> {
    let dir = match path.parent() {
        Some(d) if d.as_os_str().is_empty() => Path::new("."),
        Some(d) => d,
        None => Path::new("/"),
    };
    if dir.is_dir() {
        Ok(())
    } else {
        Err(format!("{flag} {}: the directory {} does not exist", path.display(), dir.display()).into())
    }
}

/// A private directory for the default stats file, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> std::io::Result<TempDir> {
        let nanos =
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
        let mut attempt = 0u32;
        loop {
            let dir =
                std::env::temp_dir().join(format!("memquota-run-{}-{nanos}-{attempt}", std::process::id()));
            // 0700 and "create", never "open existing": no one else can plant a file in it.
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(TempDir(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => attempt += 1,
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn forward_signals() {
    for sig in [libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `action` is fully initialised (zeroed, then the handler, flags and an
        // empty mask); the handler only stores to an atomic, which is async-signal-safe.
        // exec resets a handled signal to its default, so the program is unaffected.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = remember_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

const TERMINAL_SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGQUIT];

fn terminal_signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises `set`; sigaddset only writes it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in TERMINAL_SIGNALS {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

fn ignore_and_unblock(set: &libc::sigset_t) {
    // SAFETY: setting SIG_IGN has no preconditions (a signal pending meanwhile is
    // discarded); `set` is the initialised set blocked above.
    unsafe {
        for sig in TERMINAL_SIGNALS {
            libc::signal(sig, libc::SIG_IGN);
        }
        libc::pthread_sigmask(libc::SIG_UNBLOCK, set, std::ptr::null_mut());
    }
}

/// Blocks until the child `pid` has exited, leaving it unreaped (WNOWAIT), so that
/// its pid cannot be reused while we may still signal it.
fn wait_without_reaping(pid: libc::pid_t) {
    loop {
        // SAFETY: `info` is a valid, writable siginfo_t for waitid to fill.
        let r = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOWAIT)
        };
        if r == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// Reads the stats file whenever the program has replaced it.
struct Sampler {
    path: PathBuf,
    start_wall: SystemTime,
    started: Instant,
    /// (inode, mtime, size) of the last file read: each write is a new file (rename).
    last_key: Option<(u64, i64, i64, u64)>,
    points: Vec<Point>,
    last: Option<Snapshot>,
    peak_native: u64,
    peak_heap: u64,
    peak_untracked: u64,
}

impl Sampler {
    fn new(path: PathBuf, start_wall: SystemTime, started: Instant) -> Sampler {
        Sampler {
            path,
            start_wall,
            started,
            last_key: None,
            points: Vec::new(),
            last: None,
            peak_native: 0,
            peak_heap: 0,
            peak_untracked: 0,
        }
    }

    /// Takes a sample if the file is new since the last one.
    fn poll(&mut self) {
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
    fn summary(&self) -> String {
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

/// The live one-line status, on standard error when that is a terminal.
struct StatusLine {
    on: bool,
    shown: bool,
}

impl StatusLine {
    fn new() -> StatusLine {
        StatusLine { on: std::io::stderr().is_terminal(), shown: false }
    }

    fn show(&mut self, s: Option<&Snapshot>) {
        let (true, Some(s)) = (self.on, s) else { return };
        let mut line = format!(
            "memquota: native {}  heap {}  limit {}  reclaims {}  OOMs {}",
            bytes(s.native),
            bytes(s.heap_committed),
            s.limit_text(),
            s.reclaims(),
            s.ooms
        );
        line.truncate(terminal_width().saturating_sub(1).max(20)); // ASCII: any cut is a boundary
        let _ = std::io::stderr().write_all(format!("\r{line}\x1b[K").as_bytes());
        self.shown = true;
    }

    fn clear(&mut self) {
        if self.shown {
            let _ = std::io::stderr().write_all(b"\r\x1b[K");
            self.shown = false;
        }
    }
}

fn terminal_width() -> usize {
    // SAFETY: TIOCGWINSZ writes one winsize into the valid, zeroed `ws`.
    let ws = unsafe {
        let mut ws: libc::winsize = std::mem::zeroed();
        (libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut ws) == 0).then_some(ws)
    };
    ws.map(|ws| ws.ws_col as usize).filter(|&c| c > 0).unwrap_or(80)
}

/// `exited with status 0`, `was killed by signal 15 (SIGTERM)`.
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!(
            "was killed by signal {sig} ({}){}",
            signal_name(sig),
            if status.core_dumped() { ", core dumped" } else { "" }
        ),
        _ => format!("ended ({status})"),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => "signal",
    }
}

/// The command line for people, in backquotes.
fn command_line(command: &[OsString]) -> String {
    let words: Vec<String> = command
        .iter()
        .map(|w| {
            let w = w.to_string_lossy();
            if w.is_empty() || w.contains(|c: char| c.is_whitespace() || "'\"\\$`".contains(c)) {
                format!("'{}'", w.replace('\'', "'\\''"))
            } else {
                w.into_owned()
            }
        })
        .collect();
    format!("`{}`", words.join(" "))
}

fn shorten(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_quote_what_a_shell_would_split() {
        let cmd: Vec<OsString> = ["java", "-version", "a b", "it's"].iter().map(OsString::from).collect();
        assert_eq!(command_line(&cmd), r"`java -version 'a b' 'it'\''s'`");
        assert_eq!(shorten("abcdef", 3), "abc...");
        assert_eq!(shorten("abc", 3), "abc");
    }

    #[test]
    fn statuses_read_like_a_shell() {
        assert_eq!(describe(ExitStatus::from_raw(7 << 8)), "exited with status 7");
        assert_eq!(describe(ExitStatus::from_raw(libc::SIGTERM)), "was killed by signal 15 (SIGTERM)");
    }
}
