//! The callbacks a plan installs (consumers' spills, the process reclaim, the report
//! hook, the heap probe), which allocate, reserve, fork and panic on plan; forks and
//! what their children check.

use crate::*;

/// The payload of planned panics; the panic hook stays quiet for it.
pub struct PlannedPanic;

/// Callbacks do their work only while a plan runs (and never in a fork child).
pub static ENABLED: AtomicBool = AtomicBool::new(false);
pub static IN_CHILD: AtomicBool = AtomicBool::new(false);
/// Set in a child forked from inside a spill callback: it checks and exits at its
/// next checkpoint.
pub static CHILD_PENDING: AtomicBool = AtomicBool::new(false);
pub static IN_CALLBACK: AtomicUsize = AtomicUsize::new(0);
pub static SPILLS: AtomicU64 = AtomicU64::new(0);
pub static RECLAIMS: AtomicU64 = AtomicU64::new(0);
pub static PANICS: AtomicU64 = AtomicU64::new(0);
/// Allocations of callbacks that were refused (there must be none).
pub static CALLBACK_REFUSED: AtomicU64 = AtomicU64::new(0);
/// Reservations inside a spill that got anything but `ReserveInSpill`.
pub static SPILL_RESERVE_WRONG: AtomicU64 = AtomicU64::new(0);
pub static SPILL_RESERVE_REFUSED: AtomicU64 = AtomicU64::new(0);
/// Forks from callbacks: made, and failed (a child's code, or 2000: timed out).
pub static CALLBACK_FORKS: AtomicU64 = AtomicU64::new(0);
pub static CALLBACK_FORK_FAILED: AtomicI64 = AtomicI64::new(0);
pub static HOOK_PANICS: AtomicBool = AtomicBool::new(false);
pub static HOOK_CALLS: AtomicU64 = AtomicU64::new(0);
/// The heap probe's lock (known `probe_lock`).
pub static PROBE_LOCK: Mutex<()> = Mutex::new(());
/// The process reclaim callback's cache: 1 MiB blocks.
pub static RECLAIM_CACHE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

pub struct InCallback;

impl InCallback {
    pub fn enter() -> InCallback {
        IN_CALLBACK.fetch_add(1, SeqCst);
        InCallback
    }
}

impl Drop for InCallback {
    fn drop(&mut self) {
        IN_CALLBACK.fetch_sub(1, SeqCst);
    }
}

/// A scratch buffer, allocated fallibly: a refusal is counted (callbacks' bytes are
/// charged, never policed).
pub fn scratch(kib: u32) {
    let mut v: Vec<u8> = Vec::new();
    if fallibly(|| v.try_reserve_exact(kib as usize * KIB as usize)).is_err() {
        CALLBACK_REFUSED.fetch_add(1, SeqCst);
        return;
    }
    v.push(1);
    std::hint::black_box(&v);
}

pub type Cache = Mutex<Vec<(Reservation, Vec<u8>)>>;

/// A consumer's spill: frees cache entries (try_lock: the requesting thread may hold
/// the cache), and on plan allocates, tries to reserve, forks, panics.
pub fn spill(cache: &Cache, how: SpillPlan, scope: ScopeHandle, target: u64) -> u64 {
    let _in = InCallback::enter();
    if !ENABLED.load(SeqCst) || IN_CHILD.load(SeqCst) {
        return 0;
    }
    let n = SPILLS.fetch_add(1, SeqCst);
    if how.scratch_kib > 0 && n % 2 == 0 {
        scratch(how.scratch_kib);
    }
    if how.reserve_inside && n % 3 == 0 {
        match scope.reserve(4 * KIB) {
            Err(Error::ReserveInSpill { .. }) => SPILL_RESERVE_REFUSED.fetch_add(1, SeqCst),
            _ => SPILL_RESERVE_WRONG.fetch_add(1, SeqCst),
        };
    }
    if how.fork_inside && n % 5 == 0 {
        fork_from_callback();
    }
    let mut freed = 0;
    if let Ok(mut entries) = cache.try_lock() {
        while freed < target {
            let Some((r, buf)) = entries.pop() else { break };
            freed += buf.capacity() as u64;
            drop((r, buf));
        }
    }
    if how.panic_every > 0 && n % u64::from(how.panic_every) == 0 {
        PANICS.fetch_add(1, SeqCst);
        std::panic::panic_any(PlannedPanic);
    }
    freed
}

/// The process reclaim callback: frees cache blocks, sometimes allocates first,
/// sometimes panics after.
pub fn reclaim(need: usize) {
    let _in = InCallback::enter();
    if !ENABLED.load(SeqCst) || IN_CHILD.load(SeqCst) {
        return;
    }
    let n = RECLAIMS.fetch_add(1, SeqCst);
    if n % 3 == 1 {
        scratch(64);
    }
    if let Ok(mut cache) = RECLAIM_CACHE.try_lock() {
        let mut freed = 0;
        while freed < need {
            let Some(block) = cache.pop() else { break };
            freed += block.capacity();
        }
    }
    if n % 4 == 3 {
        PANICS.fetch_add(1, SeqCst);
        std::panic::panic_any(PlannedPanic);
    }
}

/// The report hook: counts, and on plans with `hook_panics` (known `hook_panic`)
/// panics on every third call.
pub fn hook(report: &str) {
    support::counting_hook(report);
    let n = HOOK_CALLS.fetch_add(1, SeqCst);
    if HOOK_PANICS.load(SeqCst) && n % 3 == 0 {
        PANICS.fetch_add(1, SeqCst);
        std::panic::panic_any(PlannedPanic);
    }
}

/// The heap probe of plans with `probe_lock`: takes a user lock for a moment.
pub fn probe() -> HeapBytes {
    let _g = PROBE_LOCK.lock();
    HeapBytes::new(0, 0)
}

// ---- forks -----------------------------------------------------------------------------

/// Forks; the child runs `child` and exits with its code. The child's code, 1000 +
/// a signal, 2000 if it did not exit within [`CHILD_TIMEOUT`] (killed), 3000 if no
/// child was made.
pub fn fork_and_wait(child: fn() -> i32) -> i32 {
    // SAFETY: fork has no preconditions. The child runs only `child` (the allocator,
    // memquota, atomics, no lock of the fuzzer's) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        IN_CHILD.store(true, SeqCst);
        let code = child();
        // SAFETY: _exit ends the child at once, running nothing of the parent's.
        unsafe { libc::_exit(code) };
    }
    if pid < 0 {
        return 3000;
    }
    match support::wait_child(pid, CHILD_TIMEOUT) {
        None => 2000,
        Some(st) if libc::WIFEXITED(st) => libc::WEXITSTATUS(st),
        Some(st) if libc::WIFSIGNALED(st) => 1000 + libc::WTERMSIG(st),
        Some(_) => 2001,
    }
}

/// In a fork child: the parent's reclaim callback and heap probe go before anything
/// asks for them. The probe takes the fuzzer's lock, which a thread that did not
/// survive the fork may have held.
pub fn forget_parents_callbacks() {
    memquota::clear_reclaim();
    memquota::set_heap_probe(HeapProbe::None);
}

pub fn native() -> u64 {
    memquota::flush_thread();
    memquota::stats().native
}

/// A fork child at a clean point: raises its limit with `init`, allocates, runs a
/// retry block and a budget in a scope of its own, ends it, and is back where it
/// started. 0, or the code of the first check that failed.
pub fn child_full() -> i32 {
    forget_parents_callbacks();
    let base = native();
    if memquota::init(Config::new().limit(base + 128 * MIB).untracked(Untracked::Report)).is_err() {
        return 10;
    }
    let started = Instant::now();
    let s0 = native();
    let Ok(task) = MemoryManager::global().begin("child", 1 << 40, 0) else { return 11 };
    {
        let Ok(_attached) = task.attach() else { return 12 };
        let Ok(v) = buffer(2 * MIB) else { return 13 };
        drop(v);
    }
    match with_retry(&task, || buffer(2 * MIB).map(|b| b.capacity())) {
        Ok(n) if n == 2 * MIB as usize => {}
        _ => return 14,
    }
    {
        let Ok(budget) = task.budget(MIB) else { return 15 };
        let Ok(_under) = budget.attach() else { return 16 };
        let Ok(v) = buffer(3 * MIB) else { return 17 };
        drop(v);
    }
    drop(task.end());
    if started.elapsed() > Duration::from_secs(5) {
        return 18; // it waited (for threads that did not survive the fork)
    }
    if native() != s0 {
        return 19;
    }
    0
}

/// A fork child that went on from a spill callback (its waiter live, its request
/// unfinished) to its next checkpoint: `init` must return, and a scope of its own
/// allocates and ends (the thread's own scope may be past its share: the parent's
/// scopes are all there).
pub fn child_light() -> i32 {
    forget_parents_callbacks();
    let base = native();
    if memquota::init(Config::new().limit(base + 128 * MIB).untracked(Untracked::Report)).is_err() {
        return 30;
    }
    let Ok(task) = MemoryManager::global().begin("child", 1 << 41, 0) else { return 32 };
    {
        let Ok(_attached) = task.attach() else { return 33 };
        let Ok(v) = buffer(MIB) else { return 31 };
        drop(v);
    }
    drop(task.end());
    0
}

pub fn fork_from_callback() {
    // SAFETY: as `fork_and_wait`; the child returns from the callback into memquota's
    // admission (what a fork from a spill does) and exits at its next checkpoint.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        IN_CHILD.store(true, SeqCst);
        CHILD_PENDING.store(true, SeqCst);
        // Before the request it returns into asks for the heap figure.
        forget_parents_callbacks();
        return;
    }
    CALLBACK_FORKS.fetch_add(1, SeqCst);
    let code = if pid < 0 {
        3000
    } else {
        match support::wait_child(pid, CHILD_TIMEOUT) {
            None => 2000,
            Some(st) if libc::WIFEXITED(st) => libc::WEXITSTATUS(st),
            Some(st) if libc::WIFSIGNALED(st) => 1000 + libc::WTERMSIG(st),
            Some(_) => 2001,
        }
    };
    if code != 0 {
        let _ = CALLBACK_FORK_FAILED.compare_exchange(0, i64::from(code), SeqCst, SeqCst);
    }
}

/// In a child forked from a callback: checks and exits here.
pub fn checkpoint() {
    if CHILD_PENDING.load(Relaxed) && CHILD_PENDING.swap(false, SeqCst) {
        let code = child_light();
        // SAFETY: _exit ends the child at once.
        unsafe { libc::_exit(code) };
    }
}

pub fn describe_child(code: i64) -> &'static str {
    match code {
        10 | 30 => "init failed",
        11 | 32 => "a new scope refused",
        12 | 33 => "attaching to the new scope failed",
        13 | 31 => "a small allocation refused under a raised limit",
        14 => "a retry block in a scope of its own did not complete",
        15 => "a new budget refused",
        16 => "attaching under the new budget failed",
        17 => "an allocation under the new budget refused",
        18 => "it took longer than 5 s (a wait for vanished threads)",
        19 => "its account is not back where it started",
        2000 => "it did not exit within 20 s (killed)",
        3000 => "fork failed",
        c if c > 1000 => "killed by a signal (1000 + signal)",
        _ => "unknown",
    }
}
