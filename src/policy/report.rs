//! The OOM report: built in a fixed buffer on the stack, with no heap allocation, and
//! handed to a replaceable hook (default: stderr).
//!
//! Reports inform without flooding. The first refusal writes a full report and opens
//! a window (`MEMQUOTA_REPORT_WINDOW`, 1 s by default); later refusals in the window
//! are only counted, and the next full report starts with one line that sums them up.
//! A material change (a new scope began, a reclaim freed nothing, the limit moved)
//! writes a full report inside the window too, at most [`PER_WINDOW`] per window. A
//! refusal while another thread's report is being written is counted, never reported
//! in turn, and waits for that report to be handed to the hook before it returns (at
//! most [`WRITER_WAIT`]): a program that crashes on the NULL would otherwise take the
//! report down with it. The counters stay exact: every refusal counts. The first full
//! report of a window also asks the flight recorder for a record (`flight.rs`).

use crate::base::config::{HeapMode, OnOom};
use crate::base::stats::{ContainerStats, PressureSource, Stats};
use crate::base::sync::{
    lock, AtomicBool, AtomicU64, AtomicUsize, ForkHeld, Mutex, MutexGuard,
    Ordering::{Acquire, Relaxed, Release},
};
use crate::base::text::{write_stderr, FixedBuf, Size};
use crate::policy::coordinator::{ReclaimKind, ReclaimRecord, Throttle, HISTORY};
use crate::policy::profile::{self, Sites};
use std::fmt::{self, Write};
use std::time::{Duration, Instant};

/// A receiver of OOM reports. Called on the refusing thread, inside the allocator,
/// with no lock of memquota's held: it may allocate (that is charged, never refused)
/// and should be quick. A panic in it is caught and counted
/// (`Stats::report_hook_panics`); the refusal goes on as usual.
pub type ReportHook = fn(&str);

static HOOK: Mutex<ReportHook> = Mutex::new(write_stderr);
static LAST: Mutex<FixedBuf> = Mutex::new(FixedBuf::new());
/// The top sites of the last full report (none before one).
static LAST_SITES: Mutex<Sites> = Mutex::new(Sites::new());

/// Full reports a window may hold: the first, and those that material changes bring.
pub(crate) const PER_WINDOW: u32 = 2;

/// What the refusal path knows of the process's state, for telling a material change.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Mark {
    /// Scopes begun so far.
    pub(crate) scopes: u64,
    /// Reclaims so far that freed nothing.
    pub(crate) futile: u64,
    /// The limit.
    pub(crate) limit: i64,
}

/// The refusals a window has held back from the hook.
#[derive(Clone, Copy, Default)]
pub(crate) struct Quiet {
    /// How many.
    pub(crate) count: u64,
    /// Bytes they asked for in all.
    pub(crate) bytes: u64,
    /// The largest.
    pub(crate) largest: u64,
    /// When the window they fell in opened.
    pub(crate) since: Option<Instant>,
}

struct Flood {
    /// When the current window opened (None: never).
    opened: Option<Instant>,
    /// Full reports written in the current window.
    full: u32,
    /// When the last full report was written.
    last_full: Option<Instant>,
    mark: Mark,
    quiet: Quiet,
}

static FLOOD: Mutex<Flood> = Mutex::new(Flood {
    opened: None,
    full: 0,
    last_full: None,
    mark: Mark { scopes: 0, futile: 0, limit: 0 },
    quiet: Quiet { count: 0, bytes: 0, largest: 0, since: None },
});
/// Set while a full report is being written.
static WRITING: AtomicBool = AtomicBool::new(false);
/// The thread writing it (the address of its ledger state; 0: none known).
static WRITER: AtomicUsize = AtomicUsize::new(0);
/// Full reports whose writing has ended (handed to the hook, or given up).
static TURNS_ENDED: AtomicU64 = AtomicU64::new(0);
/// The longest a refused thread waits for another thread's report in progress. A
/// report takes microseconds to build and as long as its hook takes to write it; the
/// bound is for a hook that cannot go on (a full pipe nobody reads, a lock the waiting
/// thread's caller holds), after which the refusal returns all the same.
pub(crate) const WRITER_WAIT: Duration = Duration::from_secs(1);
static FULL_REPORTS: AtomicU64 = AtomicU64::new(0);
static REFUSALS: AtomicU64 = AtomicU64::new(0);
static HOOK_PANICS: AtomicU64 = AtomicU64::new(0);

/// Refusals so far (each one, reported in full or not).
pub(crate) fn refusals() -> u64 {
    REFUSALS.load(Relaxed)
}

/// Full reports handed to the hook so far.
pub(crate) fn full_reports() -> u64 {
    FULL_REPORTS.load(Relaxed)
}

/// Calls of the report hook that panicked (caught).
pub(crate) fn hook_panics() -> u64 {
    HOOK_PANICS.load(Relaxed)
}

/// Hands `text` to the hook, copied out of its lock first: the hook is user code, and
/// a lock held across it could be one its own thread, or a thread it waits for, needs.
/// A panic must not unwind out of the allocator (or a scope's drop): it is caught and
/// counted.
fn call_hook(text: &str) {
    let hook = *lock(&HOOK);
    if std::panic::catch_unwind(|| hook(text)).is_err() {
        HOOK_PANICS.fetch_add(1, Relaxed);
    }
}

/// The right to write one full report; dropping it ends the writing.
pub(crate) struct Turn {
    /// The refusals held back since the last full report.
    pub(crate) quiet: Quiet,
    /// The first full report of its window: the flight recorder writes a record.
    pub(crate) first: bool,
}

impl Drop for Turn {
    fn drop(&mut self) {
        WRITER.store(0, Relaxed);
        WRITING.store(false, Release);
        TURNS_ENDED.fetch_add(1, Release);
    }
}

/// The calling thread's identity for [`WRITER`]: the address of its ledger state.
fn this_writer() -> usize {
    crate::ledger::threads::this_thread().map_or(0, |l| l as *const crate::ledger::threads::Local as usize)
}

/// Waits, at most [`WRITER_WAIT`], until the report another thread was writing when
/// `seen` turns had ended is handed over (or its writing given up). No lock is held
/// and nothing is allocated: short sleeps, from 20 us doubling to 1 ms.
fn wait_for_writer(seen: u64) {
    let Some(deadline) = Instant::now().checked_add(WRITER_WAIT) else { return };
    let mut pause = Duration::from_micros(20);
    while WRITING.load(Acquire) && TURNS_ENDED.load(Acquire) == seen {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

/// Decides whether a refusal of `requested` bytes writes a full report (`Some`) or is
/// only counted (`None`; [`last_report`] then gives one line for it). `force`: it
/// must be written (the process aborts next).
pub(crate) fn turn(requested: u64, mark: Mark, force: bool) -> Option<Turn> {
    REFUSALS.fetch_add(1, Relaxed);
    let now = Instant::now();
    let mut f = lock(&FLOOD);
    let window = crate::base::settings::report_window();
    // From when the window opened, so a window changed meanwhile applies at once.
    let open = f.opened.and_then(|o| o.checked_add(window)).is_some_and(|closes| now < closes);
    let changed = f.mark != mark && f.full < PER_WINDOW;
    // One writer at a time: a refusal while a report is written is counted only.
    let writing = WRITING.load(Relaxed);
    let seen = TURNS_ENDED.load(Acquire);
    let me = this_writer();
    if !force && (writing || (open && !changed)) {
        let q = &mut f.quiet;
        q.count += 1;
        q.bytes = q.bytes.saturating_add(requested);
        q.largest = q.largest.max(requested);
        q.since.get_or_insert(now);
        let ago = f.last_full.map_or(0, |t| now.saturating_duration_since(t).as_millis());
        drop(f);
        let mut line = FixedBuf::new();
        let _ = writeln!(
            line,
            "memquota: allocation refused: {} requested (counted within the report window; the last \
             full report was written {ago} ms earlier)",
            Size(requested),
        );
        *lock(&LAST) = line;
        // The report in progress is this refusal's report too: the caller may crash
        // on the NULL it gets, so it returns once the report is out. Never for the
        // writer's own thread (a refusal nested in its hook would wait for itself;
        // its busy mark keeps allocations there from being refused anyway).
        if writing && (me == 0 || WRITER.load(Relaxed) != me) {
            wait_for_writer(seen);
        }
        return None;
    }
    if !open {
        f.opened = Some(now);
        f.full = 0;
    }
    f.full += 1;
    f.mark = mark;
    f.last_full = Some(now);
    WRITER.store(me, Relaxed);
    WRITING.store(true, Relaxed);
    Some(Turn { quiet: std::mem::take(&mut f.quiet), first: !open })
}

/// The top sites the last full report named, if a report has named any.
pub fn last_report_sites() -> Option<Sites> {
    let sites = *lock(&LAST_SITES);
    (sites.len > 0).then_some(sites)
}

/// The sites a program's summary names, and when they were read: those of the last
/// full report (what held the memory when the budget refused), else those live now.
pub fn summary_sites() -> Option<(Sites, &'static str)> {
    match last_report_sites() {
        Some(sites) => Some((sites, "at the last refusal")),
        None => Sites::read().map(|sites| (sites, "live now")),
    }
}

/// Hands the summary of refusals held back so far to the hook, if there are any: for
/// a program's exit.
pub fn flush_quiet() {
    let quiet = std::mem::take(&mut lock(&FLOOD).quiet);
    if quiet.count > 0 {
        let mut buf = FixedBuf::new();
        let _ = write_quiet(&mut buf, &quiet);
        call_hook(buf.as_str());
    }
}

fn write_quiet(w: &mut impl Write, q: &Quiet) -> fmt::Result {
    let secs = q.since.map_or(0.0, |t| t.elapsed().as_secs_f64());
    writeln!(
        w,
        "memquota: {} more refusal{} of {} in all in the last {secs:.1} s (largest {}), counted without a report",
        q.count,
        if q.count == 1 { "" } else { "s" },
        Size(q.bytes),
        Size(q.largest),
    )
}

/// Replaces the report hook; returns the previous one.
pub fn set_report_hook(hook: ReportHook) -> ReportHook {
    std::mem::replace(&mut *lock(&HOOK), hook)
}

static FLOOD_HELD: ForkHeld<MutexGuard<'static, Flood>> = ForkHeld::new();
static LAST_HELD: ForkHeld<MutexGuard<'static, FixedBuf>> = ForkHeld::new();
static HOOK_HELD: ForkHeld<MutexGuard<'static, ReportHook>> = ForkHeld::new();
static SITES_HELD: ForkHeld<MutexGuard<'static, Sites>> = ForkHeld::new();

/// The report's part of a fork's prepare handler: takes its locks.
pub(crate) fn before_fork() {
    // SAFETY: each a guard of its slot's lock, just taken.
    unsafe {
        FLOOD_HELD.keep(lock(&FLOOD));
        LAST_HELD.keep(lock(&LAST));
        HOOK_HELD.keep(lock(&HOOK));
        SITES_HELD.keep(lock(&LAST_SITES));
    }
}

/// The report's part of a fork's parent and child handlers: releases its locks. In
/// the child no report is being written (a thread that was writing one is gone).
///
/// # Safety
/// Only from the parent or child handler of the fork whose prepare handler called
/// [`before_fork`].
pub(crate) unsafe fn after_fork(child: bool) {
    if child {
        WRITER.store(0, Relaxed);
        WRITING.store(false, Relaxed);
    }
    // SAFETY: forwarded contract, in the reverse order of `before_fork`.
    unsafe {
        SITES_HELD.release();
        HOOK_HELD.release();
        LAST_HELD.release();
        FLOOD_HELD.release();
    }
}

/// The most recent OOM report, if any allocation was refused: the full report, or a
/// line for a refusal that the report window only counted.
pub fn last_report() -> Option<String> {
    // Copied out first: the String is allocated with no lock held, so a refusal of
    // that allocation (which takes this lock) cannot deadlock.
    let last = *lock(&LAST);
    crate::ledger::threads::unpoliced(|| (!last.as_str().is_empty()).then(|| last.as_str().to_owned()))
}

/// What the report needs to know about the refusal.
pub(crate) struct Refusal {
    pub(crate) requested: u64,
    pub(crate) stats: Stats,
    pub(crate) history: [Option<ReclaimRecord>; HISTORY],
    pub(crate) throttle: Option<Throttle>,
    pub(crate) has_reclaimer: bool,
    pub(crate) policy: OnOom,
}

/// Hands a short notice (a scope's leak, a callback that reserved) to the hook,
/// formatted in a fixed buffer.
pub(crate) fn note(args: fmt::Arguments<'_>) {
    let mut buf = FixedBuf::new();
    let _ = buf.write_fmt(args);
    call_hook(buf.as_str());
}

/// Writes the report, after the summary of the refusals held back before it, and
/// hands it to the hook.
pub(crate) fn emit(turn: Turn, refusal: &Refusal) {
    let mut buf = FixedBuf::new();
    if turn.quiet.count > 0 {
        let _ = write_quiet(&mut buf, &turn.quiet);
    }
    let start = buf.len();
    let _ = write_report(&mut buf, refusal);
    // Straight into the slot, not through a second buffer on this stack.
    {
        let mut last = lock(&LAST);
        last.clear();
        let _ = last.write_str(&buf.as_str()[start..]);
    }
    FULL_REPORTS.fetch_add(1, Relaxed);
    call_hook(buf.as_str());
    let first = turn.first;
    drop(turn);
    // After the turn ends: refusals on other threads wait for the report, not for
    // the record.
    if first {
        crate::policy::flight::record();
    }
}

fn write_report(w: &mut impl Write, r: &Refusal) -> fmt::Result {
    writeln!(w, "memquota: allocation refused: {} requested", Size(r.requested))?;
    // Read before the figures, whose scope tree names each scope's sites under the
    // tables' lock; written last, so that a long list of sites cannot crowd the
    // figures out of the fixed buffer.
    // Read into the slot `last_report_sites` reads, not into a copy on this stack (the
    // refused thread's: 5.5 KB). The slot's lock is held while the figures take the
    // tables' and the scopes' locks: the fork handler takes them in that order too.
    let mut last = lock(&LAST_SITES);
    let read = Sites::read_into(None, &mut last);
    let sites = read.then_some(&*last);
    write_figures(w, r, sites)?;
    match r.policy {
        OnOom::Null => writeln!(
            w,
            "  policy           null: the allocation returns null (MEMQUOTA_ON_OOM=abort aborts)"
        )?,
        OnOom::Abort => writeln!(w, "  policy           abort")?,
    }
    match sites {
        Some(sites) => profile::write_sites(w, sites, "top sites"),
        None => Ok(()),
    }
}

/// The report's figures without its first line and its policy line, for a face that
/// refuses on its own terms and words those itself (`snapshot::report_now`).
/// Each scope's sites come from a dump read here, when the profile is on.
pub(crate) fn render_figures(r: &Refusal) -> FixedBuf {
    let mut buf = FixedBuf::new();
    let _ = write_figures(&mut buf, r, Sites::read().as_ref());
    buf
}

fn write_figures<W: Write>(w: &mut W, r: &Refusal, sites: Option<&Sites>) -> fmt::Result {
    let s = &r.stats;
    let counted = match s.heap_mode {
        HeapMode::Committed => "committed",
        HeapMode::Used => "used",
    };
    writeln!(w, "  limit            {}  (soft threshold {})", Size(s.limit), Size(s.soft_limit))?;
    writeln!(
        w,
        "  native tracked   {}  (peak {}, +/- {} unflushed)",
        Size(s.native),
        Size(s.native_peak),
        Size(s.error_bound)
    )?;
    writeln!(w, "  heap committed   {}", Size(s.heap.committed))?;
    writeln!(w, "  heap used        {}  (counted: {counted})", Size(s.heap.used))?;
    writeln!(
        w,
        "  untracked        {}  (peak {}; {})",
        Size(s.untracked),
        Size(s.untracked_peak),
        if s.untracked_counted { "counted against the limit" } else { "reported only" }
    )?;
    writeln!(w, "  headroom         {}", Size(s.headroom))?;
    writeln!(w, "  refusals         {} in all, {} over-commit grants past the limit", s.ooms, s.overcommits)?;
    writeln!(
        w,
        "  reclaims         {} sync, {} background, {} panicked, {} throttled; freed {} in all",
        s.reclaims_sync,
        s.reclaims_background,
        s.reclaim_panics,
        s.reclaims_throttled,
        Size(s.reclaimed_bytes)
    )?;
    if !r.has_reclaimer {
        writeln!(w, "  no reclaim callback is registered (memquota::on_reclaim)")?;
    }
    match r.throttle {
        Some(Throttle::Suspended) => {
            writeln!(w, "  reclaims are suspended: the recent ones freed too little")?
        }
        Some(Throttle::RateLimited) => writeln!(w, "  a reclaim ran moments ago; its result stands")?,
        None => {}
    }
    let now = Instant::now();
    for rec in r.history.iter().flatten() {
        let kind = match rec.kind {
            ReclaimKind::Sync => "sync",
            ReclaimKind::Background => "background",
        };
        writeln!(
            w,
            "    {kind:<10} asked {}  freed {}  took {} ms  {} ms ago{}",
            Size(rec.need),
            Size(rec.freed),
            rec.took.as_millis(),
            now.saturating_duration_since(rec.ended).as_millis(),
            if rec.panicked { "  (callback panicked)" } else { "" }
        )?;
    }
    write_untracked_note(w, s.untracked, s.native, s)?;
    w.write_str("  cgroup           ")?;
    write_container(w, &s.container)?;
    crate::ledger::tables::write_tree(w, &mut |w: &mut W, scope| match sites {
        Some(s) => s.scope(scope).map_or(Ok(()), |one| profile::write_scope_sites(w, s, one, "      ")),
        None => Ok(()),
    })?;
    let j = &s.jemalloc;
    writeln!(
        w,
        "  jemalloc         allocated {}  active {}  resident {}",
        Size(j.allocated),
        Size(j.active),
        Size(j.resident)
    )
}

/// The container's view on one line (the text after a label), for the report and
/// the preload's exit summary.
pub fn write_container(w: &mut impl Write, c: &ContainerStats) -> fmt::Result {
    match c.cgroup_version {
        0 => w.write_str("none seen")?,
        v => {
            write!(w, "v{v}: limit ")?;
            match c.limit {
                0 => w.write_str("none")?,
                l => write!(w, "{:#}", Size(l))?,
            }
            if c.high != 0 {
                write!(w, ", memory.high {:#}", Size(c.high))?;
            }
            write!(w, ", anon {:#} (peak {:#})", Size(c.anon), Size(c.anon_peak))?;
            if c.limit_follows {
                w.write_str(", the limit follows it")?;
            }
            if c.limit_changes != 0 || c.anon_requests != 0 {
                write!(
                    w,
                    "; {} limit changes, {} reclaims asked for by anon",
                    c.limit_changes, c.anon_requests
                )?;
            }
        }
    }
    match c.pressure {
        PressureSource::Unavailable => w.write_str("; memory pressure not watched (no PSI trigger)")?,
        source => write!(
            w,
            "; memory pressure watched ({} PSI, {} ms window): {} events",
            if source == PressureSource::Cgroup { "the cgroup's" } else { "the system's" },
            c.pressure_window_ms,
            c.pressure_events
        )?,
    }
    w.write_char('\n')
}

/// The loud line when memory memquota does not see is the largest part of the
/// process's (`untracked` against `native` and the heap): its budget then governs the
/// smaller part.
pub fn write_untracked_note(w: &mut impl Write, untracked: u64, native: u64, s: &Stats) -> fmt::Result {
    if untracked > native && untracked > s.heap.committed && untracked >= 16 << 20 {
        writeln!(
            w,
            "  warning: most of this process's memory comes from an allocator memquota does not see \
             ({} untracked against {} native): an engine's private allocator or its own mmap; {}",
            Size(untracked),
            Size(native),
            if s.untracked_counted {
                "it counts against the limit, but only what memquota does see can be reclaimed or refused"
            } else {
                "it is outside the limit (MEMQUOTA_UNTRACKED=report)"
            }
        )?;
    }
    Ok(())
}
