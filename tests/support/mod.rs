//! What the harness-less test binaries share: the runner (`runner.rs`: each check in
//! this process or in one of its own with a deadline), text written to stderr without
//! allocating, a watchdog that fails loudly instead of hanging CI, a report hook that
//! counts full reports, a monitor that samples the tracked total, a wait for the
//! sampler thread, and a deterministic RNG.
//!
//! Everything that may run while the allocator refuses, waits or is stuck (the
//! watchdog, the hook, the monitor's loop) works in fixed buffers and atomics.
#![allow(dead_code, unused_imports)] // each test binary uses its own part

mod runner;

pub use runner::{
    lift_limit_on_panic, output_within, print_indented, run, run_isolated, run_isolated_with_env, summary,
    Check,
};
use std::fmt::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
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
    print_every_stack();
    // SAFETY: _exit has no preconditions; the process is stuck, nothing may run.
    unsafe { libc::_exit(HUNG) }
}

/// Where each thread of this stuck process stands, from gdb (`thread apply all bt`) on
/// stdout, so that a hang seen once says where it was. Allocates nothing here (a stuck
/// allocator may hold its locks): gdb is spawned with arguments built on the
/// stack; gdb writes to stdout, bounded at 60 s. Without gdb (scripts/test.sh installs
/// it) it says so.
fn print_every_stack() {
    const GDB: &[u8] = b"/usr/bin/gdb\0";
    // SAFETY: a NUL-terminated path.
    if unsafe { libc::access(GDB.as_ptr().cast(), libc::X_OK) } != 0 {
        let mut l = Line::new();
        let _ = writeln!(l, "WATCHDOG: no /usr/bin/gdb, so no stacks");
        l.emit();
        return;
    }
    let mut pid = [0u8; 24];
    {
        let mut w = memquota::seam::text::SliceWriter::new(&mut pid);
        let _ = write!(w, "{}\0", std::process::id());
    }
    let args: [&[u8]; 7] = [GDB, b"-p\0", &pid, b"-batch\0", b"-ex\0", b"thread apply all bt 40\0", b"-nx\0"];
    let mut argv = [std::ptr::null::<libc::c_char>(); 8];
    for (slot, arg) in argv.iter_mut().zip(args) {
        *slot = arg.as_ptr().cast();
    }
    extern "C" {
        static environ: *const *const libc::c_char;
    }
    let mut child: libc::pid_t = 0;
    // SAFETY: posix_spawn with no file actions and no attributes runs no fork handler
    // (a stuck thread may hold a lock memquota's would take) and allocates nothing
    // here; the arguments stay valid until it returns.
    let spawned = unsafe {
        libc::posix_spawn(
            &mut child,
            argv[0],
            std::ptr::null(),
            std::ptr::null(),
            argv.as_ptr().cast(),
            environ.cast(),
        )
    };
    if spawned != 0 {
        return;
    }
    for _ in 0..600 {
        let mut status = 0;
        // SAFETY: our own child.
        if unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) } != 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: our own child, stuck.
    unsafe { libc::kill(child, libc::SIGKILL) };
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

/// Waits (polling, no sleeping; at most 30 s) until memquota's sampler thread has
/// finished starting: its start-up allocates and frees a little, charged like any
/// thread's, and a check that compares the process account before and after must
/// not see it (a delayed start landed in such a window now and then under load).
pub fn wait_for_sampler() {
    let start = Instant::now();
    while memquota::stats().sampler_passes < 2 {
        assert!(start.elapsed().as_secs() < 30, "the sampler thread never completed two passes");
        std::thread::yield_now();
    }
}

/// xorshift64*: deterministic, allocation-free.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Mostly small sizes, some up to 256 KiB, a few up to 2 MiB: crosses every
    /// threshold the ledger can have.
    pub fn size(&mut self) -> usize {
        (match self.below(100) {
            0..=79 => 1 + self.below(512),
            80..=97 => 1 + self.below(256 << 10),
            _ => 1 + self.below(2 << 20),
        }) as usize
    }
}
