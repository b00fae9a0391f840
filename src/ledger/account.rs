//! The shared side of the ledger: the process's tracked native bytes and their peak.
//!
//! Signed on purpose (the `cap` crate's bug: a failed unsigned `fetch_sub` wrapped
//! and let another thread over-allocate). Between flushes a thread that frees what
//! another allocated can push the sum below zero by at most the error bound; readers
//! clamp at zero, nothing wraps.

use crate::base::sync::AtomicI64;
use crate::base::sync::Ordering::Relaxed;

/// Process-wide counters. Aligned to its own 128-byte block (two cache lines, which is
/// what the adjacent-line prefetcher pulls in) because every flush of every thread
/// writes here, and the read-mostly settings beside it must not share the line.
#[repr(align(128))]
pub(crate) struct Account {
    native: AtomicI64,
    peak: AtomicI64,
}

impl Account {
    #[cfg(not(loom))]
    pub(crate) const fn new() -> Account {
        Account { native: AtomicI64::new(0), peak: AtomicI64::new(0) }
    }

    #[cfg(loom)]
    pub(crate) fn new() -> Account {
        Account { native: AtomicI64::new(0), peak: AtomicI64::new(0) }
    }

    /// Adds `bytes` (either sign) unconditionally; returns the new total.
    pub(crate) fn add(&self, bytes: i64) -> i64 {
        if bytes == 0 {
            return self.native.load(Relaxed);
        }
        let now = self.native.fetch_add(bytes, Relaxed).wrapping_add(bytes);
        if bytes > 0 {
            self.raise_peak(now);
        }
        now
    }

    /// Adds `bytes > 0` only if the total stays at or under `ceiling`. Compare-and-swap,
    /// so no thread ever observes a total that was granted past the ceiling, and a
    /// refused request leaves no trace for a racing thread to trip over.
    ///
    /// Returns the new total, or the total that did not leave room.
    pub(crate) fn try_add(&self, bytes: i64, ceiling: i64) -> Result<i64, i64> {
        let mut cur = self.native.load(Relaxed);
        loop {
            let new = cur.saturating_add(bytes);
            if new > ceiling {
                return Err(cur);
            }
            match self.native.compare_exchange_weak(cur, new, Relaxed, Relaxed) {
                Ok(_) => {
                    self.raise_peak(new);
                    return Ok(new);
                }
                Err(seen) => cur = seen,
            }
        }
    }

    /// A plain load first: the peak rarely moves, and `fetch_max` is a CAS loop.
    fn raise_peak(&self, candidate: i64) {
        if candidate > self.peak.load(Relaxed) {
            self.peak.fetch_max(candidate, Relaxed);
        }
    }

    /// The raw signed total (may dip below zero between flushes).
    pub(crate) fn native(&self) -> i64 {
        self.native.load(Relaxed)
    }

    /// The highest total ever granted.
    pub(crate) fn peak(&self) -> i64 {
        self.peak.load(Relaxed)
    }
}
