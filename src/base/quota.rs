//! Quota: where a request stands against the limit. Pure arithmetic, no state, no
//! allocator: the policy decisions are testable and model-checkable on their own.

/// The smallest per-thread flush threshold.
pub const MIN_THRESHOLD: u64 = 4 << 10;
/// The largest per-thread flush threshold.
pub const MAX_THRESHOLD: u64 = 1 << 20;

/// The per-thread flush threshold for a limit of `limit` bytes: never looser than
/// ClickHouse's `clamp(tracked / 16, 4 KiB, 4 MiB)` once a process holds a 256th of
/// its limit.
pub fn threshold_for(limit: u64) -> u64 {
    (limit / 4096).clamp(MIN_THRESHOLD, MAX_THRESHOLD)
}

/// The two thresholds of the budget, in bytes. `i64` so every sum below is exact:
/// sizes are bounded by `isize::MAX` and limits by `i64::MAX`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Quota {
    /// The hard limit: `native + heap` may not pass it.
    pub(crate) limit: i64,
    /// The soft threshold: past it a background reclaim is requested.
    pub(crate) soft: i64,
}

/// How much pressure a total puts on the quota.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pressure {
    /// At or under the soft threshold.
    Low,
    /// Over the soft threshold, at or under the limit: grant, reclaim in the background.
    Soft,
    /// Over the limit: reclaim synchronously, then refuse.
    Hard,
}

impl Quota {
    /// A quota with the soft threshold at `soft_ratio` of `limit` (clamped to 0..=1).
    pub(crate) fn new(limit: u64, soft_ratio: f64) -> Quota {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let ratio = soft_ratio.clamp(0.0, 1.0);
        // f64 has 53 bits of mantissa: the soft threshold may be off by a few bytes
        // on multi-terabyte limits, which is harmless for a trigger.
        let soft = ((limit as f64) * ratio) as i64;
        Quota { limit, soft: soft.min(limit) }
    }

    /// This quota with its soft threshold at most `cap` (a cgroup's `memory.high`).
    pub(crate) fn soft_capped(self, cap: i64) -> Quota {
        Quota { soft: self.soft.min(cap), ..self }
    }

    /// The most native bytes the hard limit allows next to `heap` heap bytes.
    pub(crate) fn native_ceiling(&self, heap: i64) -> i64 {
        self.limit.saturating_sub(heap)
    }

    /// The most native bytes small requests may take past the limit: the over-commit
    /// is bounded by a sixteenth of the limit.
    pub(crate) fn overcommit_ceiling(&self, heap: i64) -> i64 {
        self.limit.saturating_add(self.limit / 16).saturating_sub(heap)
    }

    /// Classifies a total of native plus heap bytes.
    pub(crate) fn pressure(&self, native: i64, heap: i64) -> Pressure {
        let total = native.saturating_add(heap);
        if total > self.limit {
            Pressure::Hard
        } else if total > self.soft {
            Pressure::Soft
        } else {
            Pressure::Low
        }
    }

    /// Bytes that must be freed for `native + heap` to come back under `threshold`.
    pub(crate) fn excess(native: i64, heap: i64, threshold: i64) -> u64 {
        let over = native.saturating_add(heap).saturating_sub(threshold);
        u64::try_from(over).unwrap_or(0)
    }

    /// The least dirty memory worth a purge near the limit: a 256th of the limit,
    /// between 1 MiB and 64 MiB. Less returns too little to matter, and every purged
    /// page costs a fault when it is used again.
    pub(crate) fn dirty_floor(&self) -> u64 {
        (self.limit.max(0) as u64 / 256).clamp(1 << 20, 64 << 20)
    }

    /// Room left under the hard limit (0 when over).
    pub(crate) fn headroom(&self, native: i64, heap: i64) -> u64 {
        let left = self.limit.saturating_sub(native.max(0).saturating_add(heap));
        u64::try_from(left).unwrap_or(0)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn soft_threshold_follows_ratio() {
        let q = Quota::new(1000, 0.85);
        assert_eq!(q.soft, 850);
        assert_eq!(q.pressure(800, 50), Pressure::Low);
        assert_eq!(q.pressure(800, 51), Pressure::Soft);
        assert_eq!(q.pressure(1000, 0), Pressure::Soft);
        assert_eq!(q.pressure(1000, 1), Pressure::Hard);
    }

    #[test]
    fn memory_high_caps_the_soft_threshold_only_below_it() {
        let q = Quota::new(1000, 0.85);
        assert_eq!(q.soft_capped(600), Quota { limit: 1000, soft: 600 });
        assert_eq!(q.soft_capped(900), q);
        assert_eq!(q.soft_capped(i64::MAX), q);
    }

    #[test]
    fn huge_limits_and_sums_saturate() {
        let q = Quota::new(u64::MAX, 1.0);
        assert_eq!(q.limit, i64::MAX);
        assert_eq!(q.pressure(i64::MAX, i64::MAX), Pressure::Low);
        assert_eq!(q.native_ceiling(-5), i64::MAX);
        assert_eq!(Quota::excess(-10, 3, 100), 0);
        assert_eq!(q.headroom(-10, 0), i64::MAX as u64);
    }
}
