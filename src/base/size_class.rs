//! jemalloc's size classes, computed in a few instructions instead of a call to
//! `nallocx` on every malloc. Checked against `nallocx` before first use ([`self_check`],
//! from the preload's constructor); any mismatch (a jemalloc built with another
//! quantum or page size) switches to `nallocx`.

use crate::base::sync::{AtomicBool, AtomicU16, Ordering::Relaxed};

static USE_NALLOCX: AtomicBool = AtomicBool::new(false);
/// Requests under this are looked up in [`SMALL`].
pub const SMALL_MAX: usize = 4096;
/// jemalloc's usable size of `malloc(n)` for `n < SMALL_MAX`, at index `(n + 7) / 8`
/// (every size class up to 4 KiB is a multiple of 8, as in jemalloc's own lookup
/// table), filled by [`self_check`] at load (from the computed classes once they
/// agree with `nallocx`, else from `nallocx`); 0 until then.
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

/// Compares the computed classes with jemalloc's, switching to `nallocx` on any
/// difference, then fills [`SMALL`]. Both are non-decreasing step functions, so they
/// agree on every size up to [`COMPUTED_MAX`] once `nallocx` gives each computed class
/// for the class itself and for the size just past the class before it: 80-odd calls,
/// where comparing every size took 33,000 (1.9 M instructions at load). Returns
/// whether they agreed.
pub fn self_check() -> bool {
    // SAFETY: nallocx has no preconditions; flags 0 is plain malloc.
    let nallocx = |n: usize| unsafe { tikv_jemalloc_sys::nallocx(n, 0) };
    let ok = agrees(nallocx);
    if !ok {
        USE_NALLOCX.store(true, Relaxed);
    }
    for (i, slot) in SMALL.iter().enumerate() {
        let n = (i << 3).max(1);
        let size = if ok { computed(n) } else { nallocx(n) };
        // Under 4 KiB every class is exact in a u16; anything else stays 0 (general path).
        slot.store(u16::try_from(size).unwrap_or(0), Relaxed);
    }
    ok
}

/// Whether `nallocx`, a non-decreasing map from sizes to classes, is [`computed`] on
/// every size up to [`COMPUTED_MAX`], asked at two sizes per class.
fn agrees(nallocx: impl Fn(usize) -> usize) -> bool {
    let mut first = 1;
    while first <= COMPUTED_MAX {
        let class = computed(first);
        if nallocx(first) != class || nallocx(class) != class {
            return false;
        }
        first = class + 1;
    }
    true
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_check_finds_classes_that_differ_anywhere() {
        assert!(super::agrees(super::computed));
        // Another quantum (8 bytes: 24 is a class), and another page size (16 KiB:
        // the classes past 16 KiB step by 16 KiB), each wrong on part of the range only.
        let quantum_8 = |n: usize| if n <= 128 { (n + 7) & !7 } else { super::computed(n) };
        let page_16k = |n: usize| {
            if n <= 16 << 10 {
                super::computed(n)
            } else {
                (n + (16 << 10) - 1) & !((16 << 10) - 1)
            }
        };
        assert!(!super::agrees(quantum_8));
        assert!(!super::agrees(page_16k));
    }

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
