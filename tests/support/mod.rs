//! What the harness-less stress and defect binaries share: text written to stderr
//! without allocating, a watchdog that fails loudly instead of hanging CI, a report
//! hook that counts full reports, a monitor that samples the tracked total, and a
//! runner that gives each check a process of its own with a deadline.
//!
//! Everything that may run while the allocator refuses, waits or is stuck (the
//! watchdog, the hook, the monitor's loop) works in fixed buffers and atomics.
#![allow(dead_code)] // each test binary uses its own part

use std::fmt::{self, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// How every full OOM report begins.
pub const FULL_REPORT: &str = "memquota: allocation refused";

// ---- text without a heap ------------------------------------------------------------

/// A line (or a few) of text on the stack, written to stderr with write(2).
pub struct Line {
    buf: [u8; 4096],
    len: usize,
}

impl Line {
    pub const fn new() -> Line {
        Line { buf: [0; 4096], len: 0 }
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("<cut>")
    }

    pub fn emit(&self) {
        write_fd(libc::STDERR_FILENO, self.as_str().as_bytes());
    }
}

impl Default for Line {
    fn default() -> Self {
        Line::new()
    }
}

impl Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let mut n = s.len().min(self.buf.len() - self.len);
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

fn write_fd(fd: i32, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: the pointer and length describe the live `bytes` slice.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

/// Writes formatted text to stderr without allocating (usable while the allocator
/// refuses or is stuck).
pub fn say(args: fmt::Arguments<'_>) {
    let mut l = Line::new();
    let _ = l.write_fmt(args);
    l.emit();
}

/// Bytes as `12.3 MiB (12897484)`.
pub struct Size(pub u64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1} MiB ({})", self.0 as f64 / MIB as f64, self.0)
    }
}

// ---- the watchdog -------------------------------------------------------------------

static START: OnceLock<Instant> = OnceLock::new();
static WATCHDOG: OnceLock<Thread> = OnceLock::new();
/// Milliseconds since START after which the watchdog fires (u64::MAX: disarmed).
static DEADLINE_MS: AtomicU64 = AtomicU64::new(u64::MAX);
static ARMED_AT_MS: AtomicU64 = AtomicU64::new(0);
static WHAT: Mutex<&'static str> = Mutex::new("");
/// A `fn(&mut Line)` that writes what the test saw so far.
static STATUS: AtomicUsize = AtomicUsize::new(0);

/// The watchdog's exit status: the check hung.
pub const HUNG: i32 = 70;

fn now_ms() -> u64 {
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// Starts the process's watchdog thread (once). When an armed deadline passes it
/// writes what was running and `status`'s account of what the test saw, then ends
/// the process with [`HUNG`]: a stuck allocator fails the test, never CI.
pub fn watchdog(status: fn(&mut Line)) {
    STATUS.store(status as usize, SeqCst);
    if WATCHDOG.get().is_some() {
        return;
    }
    now_ms();
    let t = spawn_running("watchdog", || {
        loop {
            // Nothing below allocates: with its start-up bytes flushed, this thread
            // leaves nothing unflushed for a check of exactness at quiescence.
            memquota::flush_thread();
            let deadline = DEADLINE_MS.load(SeqCst);
            let now = now_ms();
            if now >= deadline {
                fire(now);
            }
            // A timed park, woken early by `arm`: no allocation, no lock.
            thread::park_timeout(Duration::from_millis(deadline.saturating_sub(now).min(1000)));
        }
    });
    let _ = WATCHDOG.set(t.thread().clone());
}

/// Starts a thread of the test's own and returns once it runs: a test that fills the
/// budget next must not see the thread's start-up allocation (std copies its name on
/// the new thread) refused there, which aborts the process.
fn spawn_running<T: Send + 'static>(name: &str, body: impl FnOnce() -> T + Send + 'static) -> JoinHandle<T> {
    let spawner = thread::current();
    let ready = Arc::new(AtomicBool::new(false));
    let running = Arc::clone(&ready);
    let handle = thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            running.store(true, SeqCst);
            spawner.unpark();
            body()
        })
        .unwrap_or_else(|e| panic!("spawn the {name}: {e}"));
    while !ready.load(SeqCst) {
        thread::park();
    }
    handle
}

fn fire(now: u64) -> ! {
    let mut l = Line::new();
    let what = WHAT.try_lock().map(|w| *w).unwrap_or("?");
    let _ = writeln!(
        l,
        "\nWATCHDOG: {what:?} still running {} ms after it started: failing instead of hanging",
        now.saturating_sub(ARMED_AT_MS.load(SeqCst))
    );
    let status = STATUS.load(SeqCst);
    if status != 0 {
        // SAFETY: STATUS only ever holds 0 or a `fn(&mut Line)` stored by `watchdog`.
        let f: fn(&mut Line) = unsafe { std::mem::transmute::<usize, fn(&mut Line)>(status) };
        f(&mut l);
    }
    l.emit();
    // SAFETY: _exit has no preconditions; the process is stuck, nothing may run.
    unsafe { libc::_exit(HUNG) }
}

/// Arms the watchdog: `what` must end within `budget`.
pub fn arm(what: &'static str, budget: Duration) {
    if let Ok(mut w) = WHAT.lock() {
        *w = what;
    }
    let now = now_ms();
    ARMED_AT_MS.store(now, SeqCst);
    DEADLINE_MS.store(now + budget.as_millis() as u64, SeqCst);
    if let Some(t) = WATCHDOG.get() {
        t.unpark();
    }
}

pub fn disarm() {
    DEADLINE_MS.store(u64::MAX, SeqCst);
}

// ---- counting reports ---------------------------------------------------------------

pub static FULL_REPORTS: AtomicU64 = AtomicU64::new(0);
pub static HOOK_CALLS: AtomicU64 = AtomicU64::new(0);
pub static HOOK_BYTES: AtomicU64 = AtomicU64::new(0);
static FIRST_REPORT: Mutex<Line> = Mutex::new(Line::new());
static KEEP_FIRST: AtomicBool = AtomicBool::new(true);

/// A report hook that writes nothing: it counts full reports, other hook calls and
/// their bytes, and keeps the first full report since [`forget_first_report`].
/// Allocation-free and never blocks.
pub fn counting_hook(report: &str) {
    HOOK_CALLS.fetch_add(1, SeqCst);
    HOOK_BYTES.fetch_add(report.len() as u64, SeqCst);
    if report.starts_with(FULL_REPORT) {
        FULL_REPORTS.fetch_add(1, SeqCst);
        if KEEP_FIRST.swap(false, SeqCst) {
            if let Ok(mut l) = FIRST_REPORT.try_lock() {
                *l = Line::new();
                let _ = l.write_str(report);
            }
        }
    }
}

/// The report hook's counts: full reports, all calls, all bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reports {
    pub full: u64,
    pub calls: u64,
    pub bytes: u64,
}

impl Reports {
    pub fn now() -> Reports {
        Reports {
            full: FULL_REPORTS.load(SeqCst),
            calls: HOOK_CALLS.load(SeqCst),
            bytes: HOOK_BYTES.load(SeqCst),
        }
    }

    pub fn since(self, before: Reports) -> Reports {
        Reports {
            full: self.full - before.full,
            calls: self.calls - before.calls,
            bytes: self.bytes - before.bytes,
        }
    }
}

/// The first full report the hook saw since the last call (empty if none).
pub fn first_report() -> String {
    let text = FIRST_REPORT.lock().map(|l| l.as_str().to_owned()).unwrap_or_default();
    forget_first_report();
    text
}

pub fn forget_first_report() {
    if let Ok(mut l) = FIRST_REPORT.lock() {
        *l = Line::new();
    }
    KEEP_FIRST.store(true, SeqCst);
}

// ---- the monitor --------------------------------------------------------------------

/// What the monitor saw.
#[derive(Clone, Copy, Debug, Default)]
pub struct Samples {
    pub count: u64,
    pub max_native: u64,
    pub max_threads: u64,
}

/// The monitor's latest figures, for a watchdog's status.
pub static SEEN_MAX_NATIVE: AtomicU64 = AtomicU64::new(0);
pub static SEEN_NATIVE: AtomicU64 = AtomicU64::new(0);

/// A thread sampling `memquota::stats()` about every millisecond (pacing only).
pub struct Monitor {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Samples>,
}

impl Monitor {
    pub fn start() -> Monitor {
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = Arc::clone(&stop);
        SEEN_MAX_NATIVE.store(0, SeqCst);
        let handle = spawn_running("monitor", move || {
            let mut seen = Samples::default();
            loop {
                let s = memquota::stats();
                seen.count += 1;
                seen.max_native = seen.max_native.max(s.native);
                seen.max_threads = seen.max_threads.max(s.threads);
                SEEN_NATIVE.store(s.native, SeqCst);
                SEEN_MAX_NATIVE.fetch_max(s.native, SeqCst);
                if s2.load(SeqCst) {
                    return seen;
                }
                thread::park_timeout(Duration::from_millis(1));
            }
        });
        Monitor { stop, handle }
    }

    pub fn stop(self) -> Samples {
        self.stop.store(true, SeqCst);
        self.handle.thread().unpark();
        self.handle.join().expect("the monitor panicked")
    }
}

// ---- one process per check ----------------------------------------------------------

const CHILD_VAR: &str = "MEMQUOTA_TEST_CHILD";

/// Runs each check in a child process of this binary: a fresh allocator state per
/// check, and a hang or an abort fails that check alone. Each child has a watchdog
/// armed at `budget`; the parent kills it at twice that. Arguments that do not start
/// with `-` select checks by substring. Prints cargo's closing line and exits non-zero
/// if any check failed.
pub fn run_isolated(checks: &[(&'static str, fn())], budget: Duration) {
    let checks: Vec<Check> = checks.iter().map(|&(name, check)| (name, check, &[][..])).collect();
    run_isolated_with_env(&checks, budget);
}

/// A check, and the environment its process starts with (jemalloc reads its options
/// when it starts: they cannot be set from inside).
pub type Check = (&'static str, fn(), &'static [(&'static str, &'static str)]);

/// [`run_isolated`], each check's process started with its own variables. A check
/// with variables of its own starts without jemalloc's option variables
/// (`MALLOC_CONF`, `_RJEM_MALLOC_CONF`) unless it sets them.
pub fn run_isolated_with_env(checks: &[Check], budget: Duration) {
    if let Ok(name) = std::env::var(CHILD_VAR) {
        let &(name, check, _) = checks.iter().find(|c| c.0 == name).expect("a known check");
        child(name, check, budget);
    }
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let exe = std::env::current_exe().expect("own path");
    let mut failed = Vec::new();
    let mut ran = 0;
    for (name, _, env) in checks {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        let started = Instant::now();
        let mut cmd = Command::new(&exe);
        cmd.env(CHILD_VAR, name).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (var, _) in memquota::seam::process::ENV_VARS {
            cmd.env_remove(var);
        }
        if !env.is_empty() {
            cmd.env_remove("MALLOC_CONF").env_remove("_RJEM_MALLOC_CONF").envs(env.iter().copied());
        }
        let child = cmd.spawn().expect("spawn the check");
        let pid = child.id() as i32;
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        let (out, killed) = match rx.recv_timeout(budget * 2) {
            Ok(out) => (out, false),
            Err(_) => {
                // SAFETY: kill has no memory preconditions; `pid` is our unreaped child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                (rx.recv().expect("the waiter reports"), true)
            }
        };
        let out = out.expect("wait for the check");
        print_indented("stdout", &out.stdout);
        print_indented("stderr", &out.stderr);
        let ok = out.status.success() && !killed;
        println!(
            "test {name} ... {} ({} ms{})",
            if ok { "ok" } else { "FAILED" },
            started.elapsed().as_millis(),
            if killed {
                format!(", killed after {} s", (budget * 2).as_secs())
            } else if ok {
                String::new()
            } else {
                format!(", {}", describe(out.status))
            }
        );
        if !ok {
            failed.push(*name);
        }
    }
    println!(
        "\ntest result: {}. {} passed; {} failed{}",
        if failed.is_empty() { "ok" } else { "FAILED" },
        ran - failed.len(),
        failed.len(),
        if failed.is_empty() { String::new() } else { format!(": {}", failed.join(", ")) }
    );
    if !failed.is_empty() {
        std::process::exit(101);
    }
}

fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(HUNG), _) => format!("exit {HUNG}: the watchdog fired"),
        (Some(c), _) => format!("exit {c}"),
        (_, Some(s)) => format!("killed by signal {s}"),
        _ => format!("{status:?}"),
    }
}

/// Prints a child's output, indented; a flood is cut to its head and tail.
pub fn print_indented(what: &str, bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    const KEEP: usize = 6000;
    let text = String::from_utf8_lossy(bytes);
    let shown = if text.len() > 2 * KEEP {
        let mut head = KEEP;
        while !text.is_char_boundary(head) {
            head -= 1;
        }
        let mut tail = text.len() - KEEP;
        while !text.is_char_boundary(tail) {
            tail += 1;
        }
        format!("{}\n[... {} bytes cut ...]\n{}", &text[..head], tail - head, &text[tail..])
    } else {
        text.into_owned()
    };
    println!("  [{what}, {} bytes]", bytes.len());
    for l in shown.lines() {
        println!("  | {l}");
    }
}

fn child(name: &'static str, check: fn(), budget: Duration) -> ! {
    // A failed assertion prints (and allocates) under whatever limit the check set:
    // lift it first, as tests/common does, except for a panic planted in a callback
    // (its message says "on purpose"), which memquota catches: the limit stays.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>().is_some_and(|m| m.contains("on purpose")) {
            return;
        }
        memquota::set_limit(1 << 50);
        report(info)
    }));
    watchdog(|_| {});
    arm(name, budget);
    let ok = std::panic::catch_unwind(check).is_ok();
    disarm();
    std::process::exit(if ok { 0 } else { 101 })
}

/// Waits for the child `pid` at most `timeout` (a pidfd and poll: no sleeping). Kills
/// it if it is still running then. Its wait status, or `None` if it was killed.
pub fn wait_child(pid: libc::pid_t, timeout: Duration) -> Option<i32> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    let mut exited = true;
    if fd >= 0 {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: `p` is one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        exited = n == 1;
        // SAFETY: `fd` is the descriptor pidfd_open returned.
        unsafe { libc::close(fd) };
    }
    if !exited {
        // SAFETY: kill has no memory preconditions; `pid` is our unreaped child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let mut status = 0;
    // SAFETY: `status` is a valid out-pointer; `pid` is our child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    exited.then_some(status)
}

/// `bytes` of memory taken fallibly, every page touched; `?` maps a refusal to
/// memquota's error (a rollback or split inside a retry block).
pub fn buffer(bytes: u64) -> memquota::Result<Vec<u8>> {
    let mut v: Vec<u8> = Vec::new();
    v.try_reserve_exact(bytes as usize)?;
    v.resize(bytes as usize, 1);
    Ok(v)
}
