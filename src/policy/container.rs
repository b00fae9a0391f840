//! The container's view: the process's memory cgroup and the kernel's memory
//! pressure, watched by the sampler thread (`sampler.rs`), never on the allocation
//! path.
//!
//! * **The limit follows the cgroup's.** A limit the user did not give in bytes (the
//!   default, the cgroup's limit, or a percentage of it) moves when the cgroup's
//!   limit moves; a limit in bytes, or one set with `set_limit`, never does.
//! * **`memory.high` (v2) caps the soft threshold**: `min(limit x soft ratio, high)`.
//! * **The cgroup's anonymous memory** (v2 `anon`, v1 `total_rss`; never its page
//!   cache, which the kernel drops before it kills) past its line, `min(cgroup limit x
//!   soft ratio, memory.high)`, asks for a background reclaim of the excess and a
//!   purge of jemalloc's dirty pages. It sees what the budget cannot: memory other
//!   processes of the cgroup hold, and this one's untracked memory when it is only
//!   reported.
//! * **Memory pressure**: a PSI trigger (`cgroup.rs`) that fires asks for a
//!   background reclaim and a purge too.
//!
//! The cgroup's files are read every [`PERIOD`]; the PSI trigger is polled on every
//! pass of the sampler (one `poll` that does not wait: the kernel latches the event).

use crate::base::cgroup::{Cgroup, Figures, Pressure};
use crate::base::quota::Quota;
use crate::base::settings;
use crate::base::stats::{ContainerStats, PressureSource};
use crate::base::sync::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use crate::ledger::threads::ACCOUNT;
use crate::policy::heap_probe;
use crate::policy::purge;
use crate::policy::reclaim;
use std::time::{Duration, Instant};

/// Time between two readings of the cgroup's files (the sampler may pass more often).
pub(crate) const PERIOD: Duration = Duration::from_millis(50);

/// The last reading, for `stats()`: 0 stands for none.
static VERSION: AtomicU8 = AtomicU8::new(0);
static LIMIT: AtomicU64 = AtomicU64::new(0);
static HIGH: AtomicU64 = AtomicU64::new(0);
static ANON: AtomicU64 = AtomicU64::new(0);
static ANON_PEAK: AtomicU64 = AtomicU64::new(0);
/// Times the budget's limit moved with the cgroup's.
static LIMIT_CHANGES: AtomicU64 = AtomicU64::new(0);
/// Background reclaims (and purges) asked for because the anon figure passed its line.
static ANON_REQUESTS: AtomicU64 = AtomicU64::new(0);
/// PSI trigger events (each asked for a background reclaim and a purge).
static PRESSURE_EVENTS: AtomicU64 = AtomicU64::new(0);
/// `PressureSource as u8`, and the trigger's window.
static PSI: AtomicU8 = AtomicU8::new(PressureSource::Unavailable as u8);
static PSI_WINDOW_MS: AtomicU32 = AtomicU32::new(0);
/// Whether a watch ran in this process (none in a fork child).
static WATCHED: AtomicBool = AtomicBool::new(false);

/// The sampler thread's watch over the cgroup and the pressure trigger.
pub(crate) struct Watch {
    cgroup: Option<Cgroup>,
    pressure: Option<Pressure>,
    /// The cgroup's limit at the last reading (`None` inside: no limit); `None`
    /// before the first.
    last_limit: Option<Option<u64>>,
    next: Instant,
}

impl Watch {
    /// On the sampler thread, once: finds the cgroup and arms the pressure trigger.
    /// Allocates nothing (`Cgroup::find`): the sampler is charged for every byte
    /// at once, and a transient allocation would show in the process account.
    pub(crate) fn start() -> Watch {
        let cgroup = Cgroup::find();
        VERSION.store(cgroup.as_ref().map_or(0, |c| c.version as u8), Relaxed);
        let pressure = Pressure::arm().ok();
        if let Some(p) = &pressure {
            PSI.store(source_of(p) as u8, Relaxed);
            PSI_WINDOW_MS.store(p.window_ms, Relaxed);
        }
        WATCHED.store(true, Relaxed);
        Watch { cgroup, pressure, last_limit: None, next: Instant::now() }
    }

    /// One pass of the sampler: the pressure trigger, and the cgroup's files once
    /// per [`PERIOD`]. Allocates nothing.
    pub(crate) fn pass(&mut self) {
        if let Some(p) = &self.pressure {
            match p.fired() {
                Some(true) => {
                    PRESSURE_EVENTS.fetch_add(1, Relaxed);
                    let (native, outside) = (ACCOUNT.native(), heap_probe::outside());
                    ask(pressure_need(settings::quota(), native, outside));
                }
                Some(false) => {}
                None => {
                    // Its cgroup went away: nothing more will come from it.
                    self.pressure = None;
                    PSI.store(PressureSource::Unavailable as u8, Relaxed);
                }
            }
        }
        let now = Instant::now();
        let Some(cgroup) = self.cgroup.as_ref().filter(|_| now >= self.next) else { return };
        self.next = now + PERIOD;
        let f = cgroup.read();
        LIMIT.store(f.limit.unwrap_or(0), Relaxed);
        HIGH.store(f.high.unwrap_or(0), Relaxed);
        ANON.store(f.anon.unwrap_or(0), Relaxed);
        ANON_PEAK.fetch_max(f.anon.unwrap_or(0), Relaxed);
        if self.last_limit != Some(f.limit) {
            // The configuration resolved the machine's limit at start (the cgroup's,
            // else RAM): a first reading with no cgroup limit has nothing to add.
            // Physical RAM (whose reading allocates) is read only when a cgroup's
            // limit is lifted.
            let machine = match (f.limit, self.last_limit) {
                (Some(limit), _) => Some(limit),
                (None, Some(Some(_))) => Some(crate::base::host::physical_ram()),
                (None, _) => None,
            };
            if machine.is_some_and(settings::follow_machine_limit) {
                LIMIT_CHANGES.fetch_add(1, Relaxed);
            }
            self.last_limit = Some(f.limit);
        }
        settings::set_soft_cap(f.high);
        if let Some(excess) = anon_excess(&f, settings::soft_ratio()) {
            ANON_REQUESTS.fetch_add(1, Relaxed);
            ask(excess);
        }
    }
}

fn source_of(p: &Pressure) -> PressureSource {
    match p.source {
        crate::base::cgroup::PsiSource::Cgroup => PressureSource::Cgroup,
        crate::base::cgroup::PsiSource::System => PressureSource::System,
    }
}

/// A background reclaim of `need` bytes, and a purge of jemalloc's dirty pages.
fn ask(need: u64) {
    reclaim::request_background(need);
    purge::under_pressure();
}

/// How far the cgroup's anonymous memory is past its line, `min(limit x ratio,
/// memory.high)`, if it is. No line without a limit or `memory.high`.
fn anon_excess(f: &Figures, ratio: f64) -> Option<u64> {
    let by_limit = f.limit.map(|l| Quota::new(l, ratio).soft.max(0) as u64);
    let line = match (by_limit, f.high) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b)?,
    };
    f.anon?.checked_sub(line).filter(|&e| e > 0)
}

/// What a pressure event asks the reclaim for: the excess past the soft threshold,
/// and at least the band between it and the limit. The kernel is stalling for
/// memory: the budget's own figures may not show why.
fn pressure_need(quota: Quota, native: i64, outside: i64) -> u64 {
    let band = u64::try_from(quota.limit.saturating_sub(quota.soft)).unwrap_or(0);
    Quota::excess(native, outside, quota.soft).max(band)
}

/// In a fork child: the sampler thread, and with it the watch, did not survive.
pub(crate) fn after_fork_child() {
    WATCHED.store(false, Relaxed);
    PSI.store(PressureSource::Unavailable as u8, Relaxed);
}

/// The container's figures for `stats()`.
pub(crate) fn stats() -> ContainerStats {
    let watched = WATCHED.load(Relaxed);
    ContainerStats {
        cgroup_version: if watched { VERSION.load(Relaxed) } else { 0 },
        limit: LIMIT.load(Relaxed),
        high: HIGH.load(Relaxed),
        anon: ANON.load(Relaxed),
        anon_peak: ANON_PEAK.load(Relaxed),
        limit_follows: settings::limit_follows_machine(),
        limit_changes: LIMIT_CHANGES.load(Relaxed),
        anon_requests: ANON_REQUESTS.load(Relaxed),
        pressure_events: PRESSURE_EVENTS.load(Relaxed),
        pressure: match PSI.load(Relaxed) {
            1 => PressureSource::Cgroup,
            2 => PressureSource::System,
            _ => PressureSource::Unavailable,
        },
        pressure_window_ms: PSI_WINDOW_MS.load(Relaxed),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn anon_past_its_line_asks_for_the_excess() {
        let f = Figures { limit: Some(100 * MIB), high: None, anon: Some(90 * MIB) };
        // The line is 85 MiB at the default ratio.
        assert_eq!(anon_excess(&f, 0.85), Some(90 * MIB - Quota::new(100 * MIB, 0.85).soft as u64));
        assert_eq!(anon_excess(&Figures { anon: Some(80 * MIB), ..f }, 0.85), None);
        // memory.high lowers the line; alone it is the line.
        assert_eq!(anon_excess(&Figures { high: Some(60 * MIB), ..f }, 0.85), Some(30 * MIB));
        assert_eq!(anon_excess(&Figures { limit: None, high: Some(60 * MIB), ..f }, 0.85), Some(30 * MIB));
        // No limit, no line; no figure, nothing to say.
        assert_eq!(anon_excess(&Figures { limit: None, ..f }, 0.85), None);
        assert_eq!(anon_excess(&Figures { anon: None, ..f }, 0.85), None);
    }

    #[test]
    fn a_pressure_event_asks_for_at_least_the_soft_band() {
        let q = Quota::new(100 * MIB, 0.80);
        assert_eq!(pressure_need(q, 10 * MIB as i64, 0), 20 * MIB);
        assert_eq!(pressure_need(q, 90 * MIB as i64, 20 * MIB as i64), 30 * MIB);
        assert_eq!(pressure_need(Quota::new(u64::MAX, 1.0), 0, 0), 0);
    }
}
