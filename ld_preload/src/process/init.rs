//! Load time: configuration from the environment (read once, loud on error), the
//! fork handler, the stats file and the exit report (`exit_report.rs` decides which
//! process prints it).

use crate::malloc::charge::FACE;
use crate::process::exit_report::{self, Report};
use crate::process::stats_file::{self, When};
use memquota_core::seam::{hot, process, slow, text};
use memquota_core::{Config, Stats};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering::*};
use std::time::Duration;

/// The preload's default `MEMQUOTA_REFUSE_MIN`: smaller requests are never refused
/// (bounded over-commit instead). See docs/preload.md for the measurement behind it.
const DEFAULT_REFUSE_MIN: u64 = 4 << 20;

use memquota_core::seam::process::vars::{STATS_FILE, STATS_INTERVAL};

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;

struct Settings {
    stats_file: Option<String>,
    interval: Duration,
    report: Report,
}

/// The stats file's path: from `MEMQUOTA_STATS_FILE`, replaced by the agent's
/// `stats_file=` option. A leaked `String` (null: none), read with no lock: a `fork`
/// while another thread read it under a lock would leave the child's lock held, and
/// its exit would hang. A replaced path is leaked (it happens at most twice).
static STATS_PATH: AtomicPtr<String> = AtomicPtr::new(std::ptr::null_mut());
/// Nanoseconds between two writes of the stats file.
static INTERVAL_NS: AtomicU64 = AtomicU64::new(1_000_000_000);
static WRITER_STARTED: AtomicBool = AtomicBool::new(false);
static AT_EXIT_REGISTERED: AtomicBool = AtomicBool::new(false);

fn fail(message: &str) -> ! {
    memquota_core::seam::text::write_stderr(&format!("{message}\n"));
    // SAFETY: _exit has no preconditions; no atexit handler may run half-configured.
    unsafe { libc::_exit(2) }
}

/// A settings lookup (the environment, or the agent's options over it) with the
/// preload's defaults for what it leaves unsaid. The default goes into the lookup,
/// not onto the `Config` it builds: a `Config` cannot tell an explicit 0 from an
/// unset value, and `refuse_min=0` must mean 0.
pub(crate) fn with_preload_defaults(
    get: impl Fn(&'static str) -> Option<String>,
) -> impl Fn(&'static str) -> Option<String> {
    move |var| {
        get(var).or_else(|| {
            (var == memquota_core::seam::process::vars::REFUSE_MIN).then(|| DEFAULT_REFUSE_MIN.to_string())
        })
    }
}

/// The environment, as `Config::from_env` reads it.
pub(crate) fn env_lookup(var: &'static str) -> Option<String> {
    std::env::var_os(var).map(|v| v.to_string_lossy().into_owned())
}

extern "C" fn on_load() {
    hot::self_check(); // jemalloc has started by now, if it had not
    crate::malloc::thread::ctl_ready();
    crate::process::malloc_conf::warn_about_what_has_no_effect();
    let mut config =
        Config::from_lookup(with_preload_defaults(env_lookup)).unwrap_or_else(|e| fail(&e.to_string()));
    let metrics = config.take_metrics_addr();
    process::adopt(&FACE);
    memquota_core::init(config).unwrap_or_else(|e| fail(&e.to_string()));
    crate::malloc::charge::register(process::threshold_for(memquota_core::process_account().limit));
    if let Some(addr) = metrics {
        // Children inherit the variable with LD_PRELOAD, and the first process holds
        // the port: a failed bind is a warning, not a reason to stop the program.
        // (The variable stays: a wrapper that execs the real program, keeping its
        // pid, must hand the endpoint on.)
        if let Err(e) = memquota_core::serve_metrics(&addr) {
            let why = match e {
                memquota_core::Error::BadConfig { reason, .. } => reason,
                other => other.to_string(),
            };
            let pid = std::process::id();
            memquota_core::seam::text::write_stderr(&format!(
                "memquota: metrics endpoint not started in pid {pid}: {why}\n"
            ));
        }
    }
    let settings = read_settings().unwrap_or_else(|e| fail(&e));
    // SAFETY: registering a plain extern "C" handler (the core registers its own, for
    // its locks, from `init`).
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
    INTERVAL_NS.store(u64::try_from(settings.interval.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    if exit_report::arm(settings.report) {
        register_at_exit();
    }
    if let Some(path) = settings.stats_file {
        write_stats_to(path);
    }
}

/// Writes the stats to `path` every interval and at exit (replacing any earlier path).
pub(crate) fn write_stats_to(path: String) {
    stats_file::started();
    STATS_PATH.store(Box::into_raw(Box::new(path)), Release);
    register_at_exit();
    if WRITER_STARTED.swap(true, AcqRel) {
        return;
    }
    // Charged, never refused or made to wait.
    let _ = process::spawn_service("memquota-stats", || loop {
        // A period, not a synchronisation.
        std::thread::sleep(Duration::from_nanos(INTERVAL_NS.load(Relaxed)));
        write_stats_file(When::Interval);
    });
}

fn register_at_exit() {
    if !AT_EXIT_REGISTERED.swap(true, AcqRel) {
        // SAFETY: registering a plain extern "C" handler.
        unsafe { libc::atexit(at_exit) };
    }
}

/// The load address of the object that contains `addr`.
pub(crate) fn object_base(addr: *const libc::c_void) -> Option<usize> {
    process::object_of(addr as usize).map(|(base, _)| base)
}

/// The path this library was loaded from, as the dynamic linker saw it.
pub(crate) fn own_path() -> Option<String> {
    let (_, path) = process::object_of(own_path as *const () as usize)?;
    std::fs::canonicalize(path?).ok().map(|p| p.to_string_lossy().into_owned())
}

fn read_settings() -> Result<Settings, String> {
    let stats_file = std::env::var(STATS_FILE).ok().filter(|p| !p.is_empty());
    if let Some(path) = &stats_file {
        stats_file::check(path).map_err(|e| format!("memquota: {STATS_FILE}: {e}"))?;
    }
    let interval = match std::env::var(STATS_INTERVAL) {
        Err(_) => Duration::from_secs(1),
        Ok(v) => parse_interval(&v).ok_or_else(|| {
            format!("memquota: bad {STATS_INTERVAL}={v:?}: expected a duration (500ms, 2s, or bare milliseconds) of at least 10ms")
        })?,
    };
    let report = exit_report::read_setting()?;
    Ok(Settings { stats_file, interval, report })
}

fn parse_interval(v: &str) -> Option<Duration> {
    process::parse_duration(v).filter(|d| *d >= process::MIN_STATS_INTERVAL)
}

/// Writes the Prometheus text to the stats file (`stats_file.rs`).
fn write_stats_file(when: When) {
    // SAFETY: STATS_PATH holds null or a `Box::into_raw` pointer that is never freed.
    let Some(path) = (unsafe { STATS_PATH.load(Acquire).as_ref() }) else { return };
    slow::flush_thread(&FACE);
    let stats = memquota_core::stats();
    // At exit the top sites too, for `memquota run`'s summary to name.
    let sites = if when == When::Exit { text::summary_sites() } else { None };
    stats_file::write(path, when, stats.process_rss_peak, |text| {
        let _ = memquota_core::write_prometheus(text, &stats);
        if let Some((sites, at)) = &sites {
            let _ = text::write_site_comments(text, sites, at);
        }
    });
}

extern "C" fn at_exit() {
    slow::flush_thread(&FACE);
    // Refusals a report window only counted are summed up before the program ends.
    text::flush_quiet();
    // The untracked figure as it is at exit, not as the last periodic sample saw it.
    process::sample_untracked();
    write_stats_file(When::Exit);
    exit_report::write_at_exit(|| summary(&memquota_core::stats()));
}

/// A byte count for the summary: `64.0 MiB`.
fn size(b: u64) -> String {
    format!("{:#}", text::Size(b))
}

fn summary(s: &Stats) -> String {
    let mut text = format!(
        "memquota summary (pid {})\n  limit          {}\n  native         {} now, {} peak\n  heap           {} committed, {} used\n  untracked      {} now, {} peak ({})\n  process RSS    {} now, {} peak\n  reclaims       {} sync, {} background, freed {}\n  purges         {} near the limit, {} after reclaims, {} under pressure, {} idle; returned {}\n  refusals       {} ({} full reports)\n  over-commit    {} grants past the limit\n",
        std::process::id(),
        size(s.limit),
        size(s.native),
        size(s.native_peak),
        size(s.heap.committed),
        size(s.heap.used),
        size(s.untracked),
        size(s.untracked_peak),
        if s.untracked_counted { "counted" } else { "reported only" },
        size(s.process_rss),
        size(s.process_rss_peak),
        s.reclaims_sync,
        s.reclaims_background,
        size(s.reclaimed_bytes),
        s.purges_budget,
        s.purges_reclaim,
        s.purges_pressure,
        s.purges_idle,
        size(s.purged_bytes),
        s.ooms,
        s.reports,
        s.overcommits,
    );
    text.push_str("  cgroup         ");
    let _ = text::write_container(&mut text, &s.container);
    let _ = text::write_untracked_note(&mut text, s.untracked_peak, s.native_peak, s);
    if let Some((sites, at)) = text::summary_sites() {
        let _ = text::write_sites(&mut text, &sites, &format!("top sites ({at})"));
    }
    text
}

/// The preload's own fork child handler (the core registers its own for its locks).
/// Allocates nothing: jemalloc's handlers may still hold its locks around ours.
extern "C" fn after_fork_child() {
    crate::malloc::thread::after_fork_child();
    exit_report::after_fork_child();
}
