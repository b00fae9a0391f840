//! The control functions: configure the budget, check for a second budget in the
//! process, start the metrics endpoint, install the fork handlers.

use crate::base::config::Config;
use crate::base::error::Result;
use crate::base::sync::{AtomicBool, Ordering::*};
use crate::ledger::threads::{self, Face};

static METRICS_STARTED: AtomicBool = AtomicBool::new(false);

/// Configures the budget, overriding what was read from `MEMQUOTA_*` on first use.
/// May be called again to change it, also at the limit (what it allocates itself is
/// counted, never refused). Starts the metrics endpoint if the configuration names
/// an address (once per process).
///
/// # Errors
/// [`Error::BadConfig`](crate::Error::BadConfig) for out-of-range values; nothing is
/// changed then.
pub fn init(config: Config) -> Result<()> {
    // Called again at the limit, its own allocations (the second-budget check's list
    // of objects, a service thread's start) are charged but never refused: an
    // infallible one refused would abort the process.
    threads::unpoliced(|| configure(&config))
}

fn configure(config: &Config) -> Result<()> {
    let limit = config.resolve_limit()?;
    crate::base::settings::configure(config, limit);
    crate::process::fork::install();
    // Here rather than only on the service thread, so that a caller of `init` (the
    // preload's constructor) finds jemalloc's decay settled when it returns; and
    // before that thread starts, so that this one never waits for it: a constructor
    // run by `dlopen` holds the loader's lock, which the service thread's first
    // jemalloc call can need (jemalloc looks `pthread_create` up with `dlsym`). The
    // profile too is set up before the sampler thread starts (it does this for a
    // program that never calls `init`), so that it is set up when `init` returns.
    crate::policy::profile::configure();
    let first = !crate::policy::sampler::started();
    if first {
        crate::policy::purge::take_over_decay();
    }
    if crate::policy::sampler::ensure_sampling() {
        if !first {
            crate::policy::purge::take_over_decay();
        }
    } else if first {
        crate::policy::purge::give_back_decay();
    }
    crate::process::rendezvous::check();
    if let Some(dir) = config.profile_dir_setting() {
        crate::process::recorder::install(dir);
    }
    if let Some(addr) = config.metrics_addr_setting() {
        if !METRICS_STARTED.swap(true, AcqRel) {
            if let Err(e) = crate::process::endpoint::serve_metrics(addr) {
                METRICS_STARTED.store(false, Release);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Flushes the calling thread's unflushed bytes ([`thread_pending`]) to the process
/// account now.
pub fn flush_thread() {
    crate::slow_path::flush_thread(threads::face());
}

/// The calling thread's unflushed bytes: allocated minus freed since its last flush,
/// what [`flush_thread`] would move.
pub fn thread_pending() -> i64 {
    threads::this_thread().map_or(0, threads::pending)
}

/// Makes `face` the one the background worker, `flush_thread` and the fork handlers
/// use, before any of its threads reaches the slow path (a preloaded library's
/// constructor).
pub fn adopt(face: &'static Face) {
    threads::adopt(face);
}
