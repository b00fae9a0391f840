//! jemalloc's size classes, computed in a few instructions instead of a call to
//! `nallocx` on every malloc. Checked against `nallocx` before first use ([`self_check`],
//! from the preload's constructor); any mismatch (a jemalloc built with another
//! quantum or page size) switches to `nallocx`.

use std::sync::atomic::{AtomicBool, AtomicU16, Ordering::Relaxed};

static USE_NALLOCX: AtomicBool = AtomicBool::new(false);
/// Requests under this are looked up in [`SMALL`].
pub const SMALL_MAX: usize = 4096;
/// jemalloc's usable size of `malloc(n)` for `n < SMALL_MAX`, at index `(n + 7) / 8`
/// (every size class up to 4 KiB is a multiple of 8, as in jemalloc's own lookup
/// table), filled from `nallocx` by [`self_check`] at load; 0 until then.
static SMALL: [AtomicU16; SMALL_MAX / 8 + 1] = [const { AtomicU16::new(0) }; SMALL_MAX / 8 + 1];

/// The usable size jemalloc gives a `malloc(n)`, `n < SMALL_MAX`: one load. 0 before
/// the table is filled (the caller then takes its general path).
#[inline(always)]
pub fn small_usable(n: usize) -> usize {
    debug_assert!(n < SMALL_MAX);
    SMALL[(n + 7) >> 3].load(Relaxed) as usize
}
/// Sizes above this ask jemalloc: past 32 KiB its large classes are spaced
/// differently (32769 gets 36864), and such requests are rare and slow anyway.
const COMPUTED_MAX: usize = 32 << 10;

/// The usable size jemalloc gives a `malloc(n)`; 0 if `n` is too large to allocate.
#[inline(always)]
pub fn usable(n: usize) -> usize {
    if n <= COMPUTED_MAX && !USE_NALLOCX.load(Relaxed) {
        computed(n)
    } else {
        // SAFETY: nallocx has no preconditions; flags 0 is plain malloc.
        unsafe { tikv_jemalloc_sys::nallocx(n.max(1), 0) }
    }
}

/// 8; multiples of 16 up to 128; then four classes per doubling.
#[inline(always)]
fn computed(n: usize) -> usize {
    if n <= 8 {
        8
    } else if n <= 128 {
        (n + 15) & !15
    } else {
        let k = usize::BITS - (n - 1).leading_zeros(); // 2^(k-1) < n <= 2^k
        let step = 1usize << (k - 3);
        (n + step - 1) & !(step - 1)
    }
}

/// Fills [`SMALL`] from `nallocx`, then compares the computed classes with jemalloc's;
/// on any difference, use jemalloc's.
pub fn self_check() -> bool {
    for (i, slot) in SMALL.iter().enumerate() {
        // SAFETY: nallocx has no preconditions; flags 0 is plain malloc.
        let size = unsafe { tikv_jemalloc_sys::nallocx((i << 3).max(1), 0) };
        // Under 4 KiB every class is exact in a u16; anything else stays 0 (general path).
        slot.store(u16::try_from(size).unwrap_or(0), Relaxed);
    }
    // SAFETY: nallocx has no preconditions.
    let ok = (0..=COMPUTED_MAX).all(|n| computed(n) == unsafe { tikv_jemalloc_sys::nallocx(n.max(1), 0) });
    if !ok {
        USE_NALLOCX.store(true, Relaxed);
    }
    ok
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_small_table_matches_jemalloc() {
        super::self_check();
        for n in 0..super::SMALL_MAX {
            // SAFETY: nallocx has no preconditions.
            let j = unsafe { tikv_jemalloc_sys::nallocx(n.max(1), 0) };
            assert_eq!(super::small_usable(n), j, "size {n}");
        }
    }

    #[test]
    fn matches_jemalloc_exhaustively_to_4_mib() {
        assert!(super::self_check(), "the computed classes differ from this jemalloc's");
        for n in 0..=(4usize << 20) {
            // SAFETY: nallocx has no preconditions.
            let j = unsafe { tikv_jemalloc_sys::nallocx(n.max(1), 0) };
            assert_eq!(super::usable(n), j, "size {n}");
        }
    }
}
