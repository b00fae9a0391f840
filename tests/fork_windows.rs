//! A fork while another thread is inside one of memquota's first-use windows, each
//! check in a process of its own: the first configuration (from `MEMQUOTA_*` or
//! `init`), the decision on who runs jemalloc's purging, and applying the profile's
//! settings (on the sampler thread, and again in `init`). The thread in the window
//! set a flag that makes every other thread wait for it to end; it does not survive
//! the fork, so the child must not wait for it: `memquota::init()` in the child must
//! return. Before the fix the child spun for ever.
//!
//! A window lasts microseconds and comes once per process, at its first allocations
//! through memquota. This binary's allocator sends every call straight to jemalloc
//! until a check turns memquota on, once the threads it needs are running; the test
//! point `memquota::seam::process::set_window_hook` then parks the thread that enters the
//! window while another thread forks. The forking thread waits for its child with a
//! deadline and kills it: the check fails, it does not hang.

mod support;

use memquota::seam::process::{set_window_hook, Window};
use memquota::{Config, Jemalloc, QuotaAlloc};
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, Ordering::SeqCst};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::Duration;

/// Jemalloc until [`ON`], memquota's allocator from then on. Both take and give back
/// jemalloc's blocks, so a block may be freed by the other (a block taken before
/// memquota counted is credited when freed: these checks read no figures).
struct Late;

static ON: AtomicBool = AtomicBool::new(false);
static QUOTA: QuotaAlloc = QuotaAlloc::new();

// SAFETY: every call is forwarded, with its contract, to one of two allocators over the
// same jemalloc, which accept each other's blocks.
unsafe impl GlobalAlloc for Late {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if ON.load(SeqCst) {
            // SAFETY: forwarded contract.
            unsafe { QUOTA.alloc(layout) }
        } else {
            // SAFETY: forwarded contract.
            unsafe { Jemalloc.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if ON.load(SeqCst) {
            // SAFETY: forwarded contract.
            unsafe { QUOTA.alloc_zeroed(layout) }
        } else {
            // SAFETY: forwarded contract.
            unsafe { Jemalloc.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if ON.load(SeqCst) {
            // SAFETY: forwarded contract; QUOTA frees into the same jemalloc.
            unsafe { QUOTA.dealloc(ptr, layout) }
        } else {
            // SAFETY: forwarded contract.
            unsafe { Jemalloc.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if ON.load(SeqCst) {
            // SAFETY: forwarded contract; QUOTA reallocates in the same jemalloc.
            unsafe { QUOTA.realloc(ptr, layout, new_size) }
        } else {
            // SAFETY: forwarded contract.
            unsafe { Jemalloc.realloc(ptr, layout, new_size) }
        }
    }
}

#[global_allocator]
static GLOBAL: Late = Late;

/// How long the forking thread waits for its child's `init()`: far past what it takes.
const CHILD_DEADLINE: Duration = Duration::from_secs(5);
const BUDGET: Duration = Duration::from_secs(10);

fn main() {
    support::run_isolated(
        &[
            ("a_fork_inside_the_first_configuration", a_fork_inside_the_first_configuration),
            ("a_fork_inside_the_purge_decision", a_fork_inside_the_purge_decision),
            ("a_fork_inside_the_profile_settings", a_fork_inside_the_profile_settings),
        ],
        BUDGET,
    );
}

/// The window to fork in: [`Window::Configure`] (1), [`Window::DecayDecision`] (2) or
/// [`Window::ProfileSettings`] (3).
static WANTED: AtomicU8 = AtomicU8::new(0);
/// The hook parked a thread in the wanted window (once).
static FIRED: AtomicBool = AtomicBool::new(false);
/// The forker: told to fork by the hook.
static FORKER: OnceLock<Thread> = OnceLock::new();
static GO: AtomicBool = AtomicBool::new(false);
/// The forker is running its own code: its thread's start, which frees what the
/// spawn handed it, is over (had memquota been on by then, that free would have been
/// the first use, with the forker itself parked in the window).
static READY: AtomicBool = AtomicBool::new(false);
static IN_CHILD: AtomicBool = AtomicBool::new(false);
/// The child's wait status; -1: killed at the deadline; -2: not yet known.
static STATUS: AtomicI64 = AtomicI64::new(-2);

fn code(w: Window) -> u8 {
    match w {
        Window::Configure => 1,
        Window::DecayDecision => 2,
        Window::ProfileSettings => 3,
        _ => 0,
    }
}

/// Inside a window, on the thread that holds it: in the wanted one (once, in the
/// parent), has the forker fork and waits for the outcome there.
fn hook(w: Window) {
    if IN_CHILD.load(SeqCst) || code(w) != WANTED.load(SeqCst) || FIRED.swap(true, SeqCst) {
        return;
    }
    GO.store(true, SeqCst);
    if let Some(forker) = FORKER.get() {
        forker.unpark();
    }
    // Bounded: the forker kills its child at the deadline.
    while STATUS.load(SeqCst) == -2 {
        std::thread::yield_now();
    }
}

fn forker() {
    READY.store(true, SeqCst);
    while !GO.load(SeqCst) {
        std::thread::park();
    }
    // SAFETY: fork has no memory preconditions; the child runs `init` on this thread
    // and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        IN_CHILD.store(true, SeqCst);
        let ok = memquota::init(Config::new()).is_ok();
        // SAFETY: _exit ends the fork child at once, without the parent's exit code.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    assert!(pid > 0, "fork failed");
    let status = support::wait_child(pid, CHILD_DEADLINE);
    STATUS.store(status.map_or(-1, i64::from), SeqCst);
}

/// Turns memquota on with the forker waiting, the hook set for `window`; returns the
/// child's wait status (`None`: killed at the deadline).
fn fork_inside(window: Window) -> Option<i32> {
    WANTED.store(code(window), SeqCst);
    let forker = std::thread::spawn(forker);
    let _ = FORKER.set(forker.thread().clone());
    while !READY.load(SeqCst) {
        std::thread::yield_now(); // a poll, bounded by the watchdog
    }
    assert!(set_window_hook(hook), "the hook is set once per process");
    ON.store(true, SeqCst);
    // The process's first allocation through memquota: it configures (the first
    // window) and starts the sampler thread, which applies the profile's settings
    // (the third) and then decides on purging (the second).
    drop(std::hint::black_box(Box::new(1u64)));
    while STATUS.load(SeqCst) == -2 {
        std::thread::yield_now(); // a poll, bounded by the forker's deadline
    }
    forker.join().expect("the forker");
    let status = STATUS.load(SeqCst);
    println!(
        "  the child's init() {}",
        if status == -1 {
            format!("still ran after {} s: killed", CHILD_DEADLINE.as_secs())
        } else {
            format!("returned (wait status {status})")
        }
    );
    (status >= 0).then_some(status as i32)
}

fn exited_0(status: Option<i32>) -> bool {
    status.is_some_and(|s| libc::WIFEXITED(s) && libc::WEXITSTATUS(s) == 0)
}

/// The first configuration, from `MEMQUOTA_*` on the process's first allocation, cut
/// by a fork: the child's `init()` waited for it for ever.
fn a_fork_inside_the_first_configuration() {
    assert!(exited_0(fork_inside(Window::Configure)), "init() in the fork child did not return");
}

/// The sampler thread deciding who runs jemalloc's purging, cut by a fork: the
/// child's `init()` waited for the decision for ever.
fn a_fork_inside_the_purge_decision() {
    assert!(exited_0(fork_inside(Window::DecayDecision)), "init() in the fork child did not return");
}

/// The sampler thread applying the profile's settings (`MEMQUOTA_PROFILE_SAMPLE`), cut
/// by a fork: the child's `init()`, which applies them too, waited for ever.
fn a_fork_inside_the_profile_settings() {
    assert!(exited_0(fork_inside(Window::ProfileSettings)), "init() in the fork child did not return");
}
