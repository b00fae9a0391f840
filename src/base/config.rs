//! Configuration: one [`Config`] with a builder, read from the environment by one
//! function, with sizes parsed in one place.

use crate::base::error::{Error, Result};
use crate::base::host;
use std::time::Duration;

/// Every `MEMQUOTA_*` variable name, in one place: the core's, and those only the
/// `LD_PRELOAD` library and the `memquota` command read.
pub mod vars {
    /// The hard limit.
    pub const LIMIT: &str = "MEMQUOTA_LIMIT";
    /// The soft threshold as a fraction of the limit.
    pub const SOFT_RATIO: &str = "MEMQUOTA_SOFT_RATIO";
    /// What a refusal does.
    pub const ON_OOM: &str = "MEMQUOTA_ON_OOM";
    /// Which heap figure counts.
    pub const HEAP: &str = "MEMQUOTA_HEAP";
    /// The bounded wait for a reclaim in flight.
    pub const RECLAIM_WAIT: &str = "MEMQUOTA_RECLAIM_WAIT";
    /// The least time between two reclaims.
    pub const RECLAIM_INTERVAL: &str = "MEMQUOTA_RECLAIM_INTERVAL";
    /// The smallest request that may be refused.
    pub const REFUSE_MIN: &str = "MEMQUOTA_REFUSE_MIN";
    /// Where to serve `/metrics`.
    pub const METRICS_ADDR: &str = "MEMQUOTA_METRICS_ADDR";
    /// The OOM report window.
    pub const REPORT_WINDOW: &str = "MEMQUOTA_REPORT_WINDOW";
    /// Whether memory memquota does not allocate counts against the limit.
    pub const UNTRACKED: &str = "MEMQUOTA_UNTRACKED";
    /// How long jemalloc's dirty pages may stay resident far from the limit.
    pub const PURGE_INTERVAL: &str = "MEMQUOTA_PURGE_INTERVAL";
    /// The preload's stats file.
    pub const STATS_FILE: &str = "MEMQUOTA_STATS_FILE";
    /// How often the preload writes the stats file.
    pub const STATS_INTERVAL: &str = "MEMQUOTA_STATS_INTERVAL";
    /// The preload's summary at exit.
    pub const REPORT: &str = "MEMQUOTA_REPORT";
    /// The pid the preload's summary speaks for (set by the preload).
    pub const REPORT_PID: &str = "MEMQUOTA_REPORT_PID";
    /// The mean bytes between two samples of the allocation-site profile (0: off).
    pub const PROFILE_SAMPLE: &str = "MEMQUOTA_PROFILE_SAMPLE";
    /// The flight recorder's directory.
    pub const PROFILE_DIR: &str = "MEMQUOTA_PROFILE_DIR";
}

use vars::*;

/// Environment variables read by [`Config::from_env`], with the forms each accepts.
pub const ENV_VARS: [(&str, &str); 13] = [
    (LIMIT, LIMIT_FORMS),
    (SOFT_RATIO, SOFT_FORMS),
    (ON_OOM, ON_OOM_FORMS),
    (HEAP, HEAP_FORMS),
    (RECLAIM_WAIT, DURATION_FORMS),
    (RECLAIM_INTERVAL, DURATION_FORMS),
    (REFUSE_MIN, SIZE_FORMS),
    (METRICS_ADDR, METRICS_FORMS),
    (REPORT_WINDOW, DURATION_FORMS),
    (UNTRACKED, UNTRACKED_FORMS),
    (PURGE_INTERVAL, PURGE_INTERVAL_FORMS),
    (PROFILE_SAMPLE, PROFILE_SAMPLE_FORMS),
    (PROFILE_DIR, PROFILE_DIR_FORMS),
];

/// The allocation-site profile's default mean bytes between two samples: 512 KiB, Go's
/// and jemalloc's. On by default, judged on what the programs users run pay for it
/// (docs/design.md, "On by default, at Go's rate"); `0` turns it off.
pub const DEFAULT_PROFILE_SAMPLE: u64 = 512 << 10;

/// The shortest stats interval (`MEMQUOTA_STATS_INTERVAL`, `memquota run
/// --interval`): a floor that keeps a sampler from spinning.
pub const MIN_STATS_INTERVAL: Duration = Duration::from_millis(10);

const LIMIT_FORMS: &str = "a size in bytes (1073741824), with a unit (512k, 512m, 8g, 1t; \
    binary units, optional b/ib suffix), or a percentage of the machine's limit (75%)";
const SOFT_FORMS: &str = "a number greater than 0 and at most 1 (0.85)";
const ON_OOM_FORMS: &str = "null or abort";
const HEAP_FORMS: &str = "committed or used";
const SIZE_FORMS: &str = "a size in bytes (65536) or with a binary unit (64k, 1m)";
const METRICS_FORMS: &str = "an address to serve /metrics on, like 127.0.0.1:9464";
const UNTRACKED_FORMS: &str = "count or report";
const DURATION_FORMS: &str = "a duration: 250ms, 2s, or a bare number of milliseconds";
const PROFILE_SAMPLE_FORMS: &str =
    "a size in bytes (524288) or with a binary unit (512k, 1m), rounded to a power of two; 0 turns the profile off";
const PROFILE_DIR_FORMS: &str = "a directory path (created if missing) for the flight recorder's records";
const PURGE_INTERVAL_FORMS: &str =
    "a duration of at least 100ms (10s, 500ms, or a bare number of milliseconds), or off";

/// The shortest purge interval: the purge service wakes every 50 ms at most, and a
/// purge every few milliseconds would bring back the page faults purging costs
/// (docs/design.md, "Purging").
pub(crate) const MIN_PURGE_INTERVAL: Duration = Duration::from_millis(100);

/// Where the budget's size comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Limit {
    /// A fixed number of bytes.
    Bytes(u64),
    /// A percentage (0 < p <= 100) of the machine's limit: the cgroup memory limit if
    /// one is set, else physical RAM.
    Percent(f64),
}

/// What happens when an allocation is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnOom {
    /// Return null: `try_reserve` gets `Err`, an infallible allocation reaches
    /// `handle_alloc_error`. The report is written first.
    #[default]
    Null,
    /// Write the report, then abort the process.
    Abort,
}

/// Which heap figure counts against the budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HeapMode {
    /// Heap memory the runtime has committed (the JVM's `Runtime.totalMemory()`):
    /// what the operating system sees, and so what a container limit sees.
    #[default]
    Committed,
    /// Heap memory in use by live and not-yet-collected objects: less conservative,
    /// fewer false refusals right after the heap grew (Gluten #13044).
    Used,
}

/// What happens to resident memory memquota does not allocate (an engine's private
/// allocator, `mmap`, thread stacks), sampled from the process's anonymous RSS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Untracked {
    /// It counts against the limit: `native + heap + untracked <= limit`.
    Count,
    /// It is sampled and reported, but leaves the budget alone (the default: next to a
    /// JVM heap the estimate spikes after a GC, when the committed heap drops at once
    /// and the resident pages later, and counting the spike would start more GCs).
    #[default]
    Report,
}

/// The whole configuration. Start from [`Config::new`] (defaults) or
/// [`Config::from_env`], adjust with the builder methods, and pass it to
/// [`init`](crate::init).
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    limit: Option<Limit>,
    soft_ratio: f64,
    on_oom: OnOom,
    heap: HeapMode,
    reclaim_wait: Duration,
    reclaim_interval: Duration,
    refuse_min: u64,
    metrics_addr: Option<String>,
    report_window: Duration,
    untracked: Untracked,
    purge_interval: Option<Duration>,
    profile_sample: u64,
    profile_dir: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config::new()
    }
}

impl Config {
    /// Defaults: the machine's limit, soft threshold at 0.85, `null` on OOM, committed
    /// heap counted, waits for a reclaim in flight bounded at 5 s, at most one reclaim
    /// per 10 ms, every request refusable (`refuse_min` 0), one full OOM report per
    /// 1 s window, dirty pages purged after at most 10 s far from the limit, the
    /// allocation-site profile sampled once per 512 KiB allocated.
    pub const fn new() -> Config {
        Config {
            limit: None,
            soft_ratio: 0.85,
            on_oom: OnOom::Null,
            heap: HeapMode::Committed,
            reclaim_wait: Duration::from_secs(5),
            reclaim_interval: Duration::from_millis(10),
            refuse_min: 0,
            metrics_addr: None,
            report_window: Duration::from_secs(1),
            untracked: Untracked::Report,
            purge_interval: Some(Duration::from_secs(10)),
            profile_sample: DEFAULT_PROFILE_SAMPLE,
            profile_dir: None,
        }
    }

    /// The defaults, overridden by any `MEMQUOTA_*` variable that is set.
    ///
    /// # Errors
    /// [`Error::BadEnv`] naming the variable, its value and the accepted forms.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|var| std::env::var_os(var).map(|v| v.to_string_lossy().into_owned()))
    }

    /// [`from_env`](Config::from_env) over any lookup function (tests, agent options).
    ///
    /// # Errors
    /// As [`from_env`](Config::from_env).
    pub fn from_lookup(get: impl Fn(&'static str) -> Option<String>) -> Result<Config> {
        fn read<T>(
            get: &impl Fn(&'static str) -> Option<String>,
            var: &'static str,
            accepted: &'static str,
            parse: impl Fn(&str) -> Option<T>,
        ) -> Result<Option<T>> {
            match get(var) {
                None => Ok(None),
                Some(value) => match parse(value.trim()) {
                    Some(v) => Ok(Some(v)),
                    None => Err(Error::BadEnv { var, value, accepted }),
                },
            }
        }
        let mut c = Config::new();
        c.limit = read(&get, LIMIT, LIMIT_FORMS, parse_limit)?;
        if let Some(r) = read(&get, SOFT_RATIO, SOFT_FORMS, parse_ratio)? {
            c.soft_ratio = r;
        }
        if let Some(o) = read(&get, ON_OOM, ON_OOM_FORMS, |s| match s {
            "null" => Some(OnOom::Null),
            "abort" => Some(OnOom::Abort),
            _ => None,
        })? {
            c.on_oom = o;
        }
        if let Some(h) = read(&get, HEAP, HEAP_FORMS, |s| match s {
            "committed" => Some(HeapMode::Committed),
            "used" => Some(HeapMode::Used),
            _ => None,
        })? {
            c.heap = h;
        }
        if let Some(d) = read(&get, RECLAIM_WAIT, DURATION_FORMS, parse_duration)? {
            c.reclaim_wait = d;
        }
        if let Some(d) = read(&get, RECLAIM_INTERVAL, DURATION_FORMS, parse_duration)? {
            c.reclaim_interval = d;
        }
        if let Some(n) = read(&get, REFUSE_MIN, SIZE_FORMS, parse_size)? {
            c.refuse_min = n;
        }
        if let Some(d) = read(&get, REPORT_WINDOW, DURATION_FORMS, parse_duration)? {
            c.report_window = d;
        }
        if let Some(u) = read(&get, UNTRACKED, UNTRACKED_FORMS, |s| match s {
            "count" => Some(Untracked::Count),
            "report" => Some(Untracked::Report),
            _ => None,
        })? {
            c.untracked = u;
        }
        if let Some(i) = read(&get, PURGE_INTERVAL, PURGE_INTERVAL_FORMS, parse_purge_interval)? {
            c.purge_interval = i;
        }
        if let Some(n) = read(&get, PROFILE_SAMPLE, PROFILE_SAMPLE_FORMS, parse_size)? {
            c.profile_sample = n;
        }
        c.profile_dir =
            read(&get, PROFILE_DIR, PROFILE_DIR_FORMS, |s| (!s.is_empty()).then(|| s.to_owned()))?;
        c.metrics_addr = read(&get, METRICS_ADDR, METRICS_FORMS, |s| {
            s.parse::<std::net::SocketAddr>().is_ok().then(|| s.to_owned())
        })?;
        Ok(c)
    }

    /// A fixed limit in bytes.
    pub fn limit(mut self, bytes: u64) -> Config {
        self.limit = Some(Limit::Bytes(bytes));
        self
    }

    /// A limit as a percentage of the machine's limit (cgroup, else RAM).
    pub fn limit_percent(mut self, percent: f64) -> Config {
        self.limit = Some(Limit::Percent(percent));
        self
    }

    /// The soft threshold as a fraction of the limit, in (0, 1].
    pub fn soft_ratio(mut self, ratio: f64) -> Config {
        self.soft_ratio = ratio;
        self
    }

    /// What a refusal does.
    pub fn on_oom(mut self, policy: OnOom) -> Config {
        self.on_oom = policy;
        self
    }

    /// Which heap figure counts.
    pub fn heap(mut self, mode: HeapMode) -> Config {
        self.heap = mode;
        self
    }

    /// How long a thread waits for a reclaim that another thread is running.
    pub fn reclaim_wait(mut self, wait: Duration) -> Config {
        self.reclaim_wait = wait;
        self
    }

    /// The least time between the end of one reclaim and the start of the next.
    pub fn reclaim_interval(mut self, interval: Duration) -> Config {
        self.reclaim_interval = interval;
        self
    }

    /// The smallest request that may be refused. Smaller ones past the limit are
    /// granted (over-commit, bounded by a sixteenth of the limit), counted, and ask for
    /// a background reclaim instead of waiting for one: for hosts (a JVM, C++ code)
    /// that die when an internal malloc fails.
    pub fn refuse_min(mut self, bytes: u64) -> Config {
        self.refuse_min = bytes;
        self
    }

    /// The OOM report window: the first refusal writes a full report, later ones
    /// within the window are counted and summarised in one line (0: every refusal
    /// writes a full report).
    pub fn report_window(mut self, window: Duration) -> Config {
        self.report_window = window;
        self
    }

    /// Serve `GET /metrics` and `GET /stats.json` on this address once
    /// [`init`](crate::init) runs (`127.0.0.1:9464`; loopback unless you say otherwise).
    pub fn metrics_addr(mut self, addr: &str) -> Config {
        self.metrics_addr = Some(addr.to_owned());
        self
    }

    /// The flight recorder (`MEMQUOTA_PROFILE_DIR`): the first refusal, and the first
    /// full report after each report window, write a directory here holding the heap
    /// profile (pprof), the stats and scopes as JSON, the container's figures and the
    /// report (docs/observability.md, "The flight recorder").
    pub fn profile_dir(mut self, dir: &str) -> Config {
        self.profile_dir = Some(dir.to_owned());
        self
    }

    /// The flight recorder's directory, if any.
    pub fn profile_dir_setting(&self) -> Option<&str> {
        self.profile_dir.as_deref()
    }

    /// The metrics address, if any.
    pub fn metrics_addr_setting(&self) -> Option<&str> {
        self.metrics_addr.as_deref()
    }

    /// Takes the metrics address out, so [`init`](crate::init) does not start the
    /// endpoint and the caller can start it with its own error handling.
    pub fn take_metrics_addr(&mut self) -> Option<String> {
        self.metrics_addr.take()
    }

    /// The smallest request that may be refused.
    pub fn refuse_min_setting(&self) -> u64 {
        self.refuse_min
    }

    /// The limit as configured (`None`: the machine's limit).
    pub fn limit_setting(&self) -> Option<Limit> {
        self.limit
    }

    /// The soft ratio.
    pub fn soft_ratio_setting(&self) -> f64 {
        self.soft_ratio
    }

    /// The OOM policy.
    pub fn on_oom_setting(&self) -> OnOom {
        self.on_oom
    }

    /// The heap figure that counts.
    pub fn heap_setting(&self) -> HeapMode {
        self.heap
    }

    /// The bounded wait for a reclaim in flight.
    pub fn reclaim_wait_setting(&self) -> Duration {
        self.reclaim_wait
    }

    /// The least time between reclaims.
    pub fn reclaim_interval_setting(&self) -> Duration {
        self.reclaim_interval
    }

    /// Whether untracked memory counts against the limit.
    pub fn untracked(mut self, mode: Untracked) -> Config {
        self.untracked = mode;
        self
    }

    /// The untracked-memory mode.
    pub fn untracked_setting(&self) -> Untracked {
        self.untracked
    }

    /// How long jemalloc's dirty pages (freed memory it keeps resident for reuse) may
    /// stay resident while the process is far from its limit: the purge service
    /// returns them once they have been there this long (`None`: only when the budget
    /// needs it: near the limit, after a reclaim, under pressure). At least 100 ms
    /// ([`resolve_limit`](Config::resolve_limit) says so). A user's own jemalloc decay
    /// options replace it (docs/design.md, "Purging").
    pub fn purge_interval(mut self, interval: Option<Duration>) -> Config {
        self.purge_interval = interval;
        self
    }

    /// The purge interval (`None`: off).
    pub fn purge_interval_setting(&self) -> Option<Duration> {
        self.purge_interval
    }

    /// The mean bytes allocated between two samples of the allocation-site profile,
    /// rounded to a power of two (jemalloc's `lg_prof_sample`); 0 turns the profile
    /// off. [`DEFAULT_PROFILE_SAMPLE`] (512 KiB) unless set. Applied once, when the
    /// sampler thread starts (docs/design.md, "Allocation sites").
    pub fn profile_sample(mut self, bytes: u64) -> Config {
        self.profile_sample = bytes;
        self
    }

    /// The profile's mean bytes between two samples (0: off).
    pub fn profile_sample_setting(&self) -> u64 {
        self.profile_sample
    }

    /// The OOM report window.
    pub fn report_window_setting(&self) -> Duration {
        self.report_window
    }

    /// Checks ranges and resolves the limit to bytes.
    ///
    /// # Errors
    /// [`Error::BadConfig`] for a zero limit, a percentage outside (0, 100], a soft
    /// ratio outside (0, 1], or a purge interval under 100 ms.
    pub fn resolve_limit(&self) -> Result<u64> {
        if !(self.soft_ratio > 0.0 && self.soft_ratio <= 1.0) {
            return Err(Error::BadConfig {
                setting: "soft_ratio",
                reason: format!("{} is not in (0, 1]", self.soft_ratio),
            });
        }
        if let Some(i) = self.purge_interval.filter(|i| *i < MIN_PURGE_INTERVAL) {
            return Err(Error::BadConfig {
                setting: "purge_interval",
                reason: format!("{i:?} is under {MIN_PURGE_INTERVAL:?} (None turns it off)"),
            });
        }
        match self.limit {
            None => Ok(host::memory_limit()),
            Some(Limit::Bytes(0)) => {
                Err(Error::BadConfig { setting: "limit", reason: "0 bytes leaves no room at all".into() })
            }
            Some(Limit::Bytes(b)) => Ok(b),
            Some(Limit::Percent(p)) if p > 0.0 && p <= 100.0 => {
                Ok(((host::memory_limit() as f64) * p / 100.0) as u64)
            }
            Some(Limit::Percent(p)) => {
                Err(Error::BadConfig { setting: "limit", reason: format!("{p}% is not in (0, 100]") })
            }
        }
    }
}

/// Parses `1073741824`, `512k`, `512m`, `8g`, `1t` (binary units, case-insensitive,
/// optional `b`/`ib`), or `75%`. Zero and overflow are rejected.
pub fn parse_limit(s: &str) -> Option<Limit> {
    if let Some(p) = s.strip_suffix('%') {
        let p: f64 = p.trim().parse().ok()?;
        return (p > 0.0 && p <= 100.0).then_some(Limit::Percent(p));
    }
    parse_size(s).filter(|&b| b > 0).map(Limit::Bytes)
}

/// Parses a byte size: digits, then an optional binary unit.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim().to_ascii_lowercase();
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits_end);
    let num: u64 = num.parse().ok()?;
    let unit = unit.trim();
    let unit = unit.strip_suffix("ib").or_else(|| unit.strip_suffix('b')).unwrap_or(unit);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return None,
    };
    num.checked_mul(1u64 << shift)
}

fn parse_ratio(s: &str) -> Option<f64> {
    let r: f64 = s.parse().ok()?;
    (r > 0.0 && r <= 1.0).then_some(r)
}

/// Parses `off`, or a duration of at least `MIN_PURGE_INTERVAL`.
fn parse_purge_interval(s: &str) -> Option<Option<Duration>> {
    if s == "off" {
        return Some(None);
    }
    parse_duration(s).filter(|d| *d >= MIN_PURGE_INTERVAL).map(Some)
}

/// Parses `250ms`, `2s`, or a bare number of milliseconds.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (num, scale_ms) = match s.strip_suffix("ms") {
        Some(n) => (n, 1),
        None => match s.strip_suffix('s') {
            Some(n) => (n, 1000),
            None => (s, 1),
        },
    };
    let n: u64 = num.trim().parse().ok()?;
    Some(Duration::from_millis(n.checked_mul(scale_ms)?))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&'static str) -> Option<String> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1073741824"), Some(1 << 30));
        assert_eq!(parse_size("512m"), Some(512 << 20));
        assert_eq!(parse_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_size("8G"), Some(8 << 30));
        assert_eq!(parse_size("8gb"), Some(8 << 30));
        assert_eq!(parse_size("1t"), Some(1 << 40));
        assert_eq!(parse_size("4 k"), Some(4096));
        for bad in ["", "m", "1.5g", "-1", "12q", "99999999999999999999", "16777216t"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
        assert_eq!(parse_limit("75%"), Some(Limit::Percent(75.0)));
        assert_eq!(parse_limit("0"), None);
        assert_eq!(parse_limit("0%"), None);
        assert_eq!(parse_limit("101%"), None);
    }

    #[test]
    fn env_overrides_defaults() {
        let c = Config::from_lookup(env(&[
            ("MEMQUOTA_LIMIT", "512m"),
            ("MEMQUOTA_SOFT_RATIO", "0.5"),
            ("MEMQUOTA_ON_OOM", "abort"),
            ("MEMQUOTA_HEAP", "used"),
            ("MEMQUOTA_RECLAIM_WAIT", "250ms"),
            ("MEMQUOTA_RECLAIM_INTERVAL", "2s"),
            ("MEMQUOTA_REFUSE_MIN", "64k"),
            ("MEMQUOTA_PURGE_INTERVAL", "2s"),
        ]))
        .unwrap();
        assert_eq!(c.limit_setting(), Some(Limit::Bytes(512 << 20)));
        assert_eq!(c.soft_ratio_setting(), 0.5);
        assert_eq!(c.on_oom_setting(), OnOom::Abort);
        assert_eq!(c.heap_setting(), HeapMode::Used);
        assert_eq!(c.reclaim_wait_setting(), Duration::from_millis(250));
        assert_eq!(c.reclaim_interval_setting(), Duration::from_secs(2));
        assert_eq!(c.refuse_min_setting(), 64 << 10);
        assert_eq!(c.purge_interval_setting(), Some(Duration::from_secs(2)));
        let off = Config::from_lookup(env(&[("MEMQUOTA_PURGE_INTERVAL", "off")])).unwrap();
        assert_eq!(off.purge_interval_setting(), None);
        assert_eq!(Config::from_lookup(env(&[])).unwrap(), Config::new());
        assert_eq!(Config::new().purge_interval_setting(), Some(Duration::from_secs(10)));
    }

    #[test]
    fn bad_env_names_variable_value_and_forms() {
        for (var, value) in [
            ("MEMQUOTA_LIMIT", "lots"),
            ("MEMQUOTA_SOFT_RATIO", "1.5"),
            ("MEMQUOTA_ON_OOM", "panic"),
            ("MEMQUOTA_HEAP", "max"),
            ("MEMQUOTA_RECLAIM_WAIT", "soon"),
            ("MEMQUOTA_PURGE_INTERVAL", "0"),
            ("MEMQUOTA_PURGE_INTERVAL", "50ms"),
            ("MEMQUOTA_PURGE_INTERVAL", "never"),
        ] {
            let lookup = move |k: &'static str| (k == var).then(|| value.to_string());
            let err = Config::from_lookup(lookup).unwrap_err();
            let text = err.to_string();
            assert!(text.contains(var) && text.contains(value), "{text}");
            let Error::BadEnv { accepted, .. } = err else { panic!("{err:?}") };
            assert!(text.contains(accepted), "{text}");
        }
    }

    #[test]
    fn resolve_checks_ranges() {
        assert_eq!(Config::new().limit(1 << 30).resolve_limit(), Ok(1 << 30));
        assert!(Config::new().limit(0).resolve_limit().is_err());
        assert!(Config::new().soft_ratio(0.0).resolve_limit().is_err());
        assert!(Config::new().limit_percent(150.0).resolve_limit().is_err());
        let fast = Config::new().limit(1 << 30).purge_interval(Some(Duration::from_millis(10)));
        assert!(fast.resolve_limit().is_err());
        assert!(Config::new().limit(1 << 30).purge_interval(None).resolve_limit().is_ok());
        let half = Config::new().limit_percent(50.0).resolve_limit().unwrap();
        assert_eq!(half, host::memory_limit() / 2);
    }
}
