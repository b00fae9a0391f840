//! The scope tables, at the ledger's level: what each task scope holds, the owner
//! records of big blocks, the spin lock that guards them, and the free signal. The
//! ledger attributes every flush to the flushing thread's scope here, so attribution
//! flows down; the arbitration above (`arbitration/`) reads and changes the same tables.

pub(crate) mod budget;
pub(crate) mod machine;
pub(crate) mod owner;
pub(crate) mod pool;
pub(crate) mod retry;
pub(crate) mod signal;
pub(crate) mod spin;
pub(crate) mod tags;

pub use owner::OWNED_MIN;
pub(crate) use pool::MAX_SCOPES;

use crate::base::sync::{AtomicU64, Ordering::Relaxed};
use pool::POOL;
use std::fmt;

/// The scope whose request is being refused, for the report (0: none).
static REFUSING: AtomicU64 = AtomicU64::new(0);

/// Adds `d` bytes of a thread in scope `handle` (0: none) to that scope; returns the
/// change the process account must see. On the slow path only.
pub(crate) fn attribute(handle: u64, d: i64) -> i64 {
    if handle == 0 || d == 0 {
        return d;
    }
    let dh = POOL.lock().attribute(handle, d);
    if d < 0 {
        signal::wake();
    }
    dh
}

/// Adds `d > 0` bytes a thread in scope `handle` (0: none) allocates, if `charge`
/// takes the change the process account must see: the scope's figures and the account
/// move in one step under the pool lock (`Pool::apply_charged`), or neither does.
/// Whether it took.
pub(crate) fn attribute_charged(handle: u64, d: i64, charge: impl FnOnce(i64) -> bool) -> bool {
    if handle == 0 {
        return charge(d);
    }
    let bytes = u64::try_from(d).unwrap_or(0);
    POOL.lock().apply_charged(handle, pool::Ask::Alloc(bytes), bytes, charge).is_ok()
}

/// A thread left scope `handle` by exiting.
pub(crate) fn thread_exited(handle: u64) {
    if handle != 0 {
        POOL.lock().detach(handle);
    }
}

/// Scopes begun so far.
pub(crate) fn begun() -> u64 {
    pool::BEGUN.load(Relaxed)
}

/// Names `handle` (0: none) as the scope whose request the next report is about.
pub(crate) fn set_refusing(handle: u64) {
    REFUSING.store(handle, Relaxed);
}

/// The scope tree for the OOM report, led by the scope being refused, if any.
/// `sites` writes a scope's allocation sites under its line, given the scope part of
/// its sample tags (`tags::scope_part`); it runs under the tables' lock, so it may
/// only format what was read before.
pub(crate) fn write_tree<W: fmt::Write>(
    w: &mut W,
    sites: &mut dyn FnMut(&mut W, u16) -> fmt::Result,
) -> fmt::Result {
    let refusing = REFUSING.swap(0, Relaxed);
    // The machine before the pool: its lock comes first.
    let r = retry::stats();
    if r.blocks_entered > 0 {
        writeln!(
            w,
            "  retry blocks: {} running, {} allocating, {} blocked, {} rolling back, {} waiting until further notice; \
             {} rollbacks, {} splits, {} waits, {} watchdog refusals",
            r.running,
            r.allocating,
            r.blocked,
            r.rollback_requested + r.rolling_back,
            r.bufn,
            r.rollbacks,
            r.splits,
            r.waits,
            r.timeouts
        )?;
    }
    let p = POOL.lock();
    if let Some(s) = p.scope(refusing) {
        writeln!(w, "  refused for scope {:?} (id {})", s.name, s.id)?;
    }
    p.write_tree(w, sites)
}
