//! Owner records for big blocks, so a free on any thread credits the scope that
//! allocated the block.
//!
//! A block of at least [`OWNED_MIN`] bytes always takes the slow path on both ends:
//! the fast path only takes charges under the thread's slack (at most
//! `MAX_THRESHOLD`) and credits under twice it. So its record is written and looked
//! up on the slow path only, with the pointer in hand, and the fast path does not
//! change at all. Smaller blocks carry no record: they are counted in the delta of
//! the thread that allocates or frees them, and credited to that thread's scope.
//!
//! A fixed open-addressing table (linear probing, backward-shift deletion) under a
//! spin lock: no allocation. If the same address is freed and reused before the first
//! free removed its record, the oldest record for the address is taken first (the
//! stamp), so at quiescence every record is removed and every scope credited exactly.

use super::spin::SpinLock;
use crate::base::quota::MAX_THRESHOLD;
use crate::base::sync::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Blocks of at least this many bytes get owner records.
pub const OWNED_MIN: u64 = 2 * MAX_THRESHOLD;
const BITS: u32 = 14;
const SLOTS: usize = 1 << BITS;
/// Past this many records new blocks go without one (a 3/4 load keeps probes short).
const MAX_LEN: usize = SLOTS / 4 * 3;

#[derive(Clone, Copy)]
struct Entry {
    ptr: usize,
    handle: u64,
    size: u64,
    stamp: u64,
}

const EMPTY: Entry = Entry { ptr: 0, handle: 0, size: 0, stamp: 0 };

struct Table {
    entries: [Entry; SLOTS],
    stamp: u64,
}

static TABLE: SpinLock<Table> = SpinLock::new(Table { entries: [EMPTY; SLOTS], stamp: 0 });
/// Records in the table (a mirror, read without the lock to skip empty lookups).
static LEN: AtomicUsize = AtomicUsize::new(0);
/// Big blocks that got no record because the table was full.
pub(crate) static OVERFLOWS: AtomicU64 = AtomicU64::new(0);

fn home(ptr: usize) -> usize {
    ((ptr as u64 >> 12).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - BITS)) as usize
}

/// Records that `ptr` (`size` bytes) belongs to `handle` (0: unscoped). False if full.
pub(crate) fn insert(ptr: usize, handle: u64, size: u64) -> bool {
    if LEN.load(Relaxed) >= MAX_LEN {
        OVERFLOWS.fetch_add(1, Relaxed);
        return false;
    }
    let mut t = TABLE.lock();
    t.stamp += 1;
    let stamp = t.stamp;
    let mut i = home(ptr);
    while t.entries[i].ptr != 0 {
        i = (i + 1) & (SLOTS - 1);
    }
    t.entries[i] = Entry { ptr, handle, size, stamp };
    LEN.fetch_add(1, Relaxed);
    true
}

/// Removes the oldest record for `ptr`: its scope and size.
pub(crate) fn take(ptr: usize) -> Option<(u64, u64)> {
    if LEN.load(Relaxed) == 0 {
        return None;
    }
    let mut t = TABLE.lock();
    let mut i = home(ptr);
    let mut found: Option<usize> = None;
    while t.entries[i].ptr != 0 {
        let e = t.entries[i];
        if e.ptr == ptr && found.map_or(true, |f| e.stamp < t.entries[f].stamp) {
            found = Some(i);
        }
        i = (i + 1) & (SLOTS - 1);
    }
    let mut hole = found?;
    let e = t.entries[hole];
    // Backward shift: pull later members of the cluster into the hole when their home
    // position does not lie (cyclically) between the hole and where they sit.
    let mut j = hole;
    loop {
        j = (j + 1) & (SLOTS - 1);
        let next = t.entries[j];
        if next.ptr == 0 {
            break;
        }
        let k = home(next.ptr);
        let stays = if hole <= j { hole < k && k <= j } else { hole < k || k <= j };
        if !stays {
            t.entries[hole] = next;
            hole = j;
        }
    }
    t.entries[hole] = EMPTY;
    LEN.fetch_sub(1, Relaxed);
    Some((e.handle, e.size))
}

/// Records in the table.
pub(crate) fn len() -> usize {
    LEN.load(Relaxed)
}

/// The table's part of a fork's prepare handler.
pub(crate) fn before_fork() {
    TABLE.hold_for_fork();
}

/// The table's part of a fork's parent and child handlers.
///
/// # Safety
/// As [`SpinLock::force_unlock`].
pub(crate) unsafe fn after_fork() {
    // SAFETY: forwarded contract.
    unsafe { TABLE.force_unlock() };
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn colliding_records_come_back_oldest_first() {
        // Same home slot: addresses that differ only above the hashed bits do not
        // exist for a multiplicative hash, so use the same address twice and others.
        let base = 0x7f00_0000_0000usize;
        let ptrs: Vec<usize> = (0..64).map(|i| base + (i << 21)).collect();
        for (n, &p) in ptrs.iter().enumerate() {
            assert!(insert(p, 1, n as u64));
        }
        assert!(insert(ptrs[3], 2, 99));
        for (n, &p) in ptrs.iter().enumerate().rev() {
            assert_eq!(take(p), Some((1, n as u64)));
        }
        assert_eq!(take(ptrs[3]), Some((2, 99)));
        assert_eq!(take(ptrs[3]), None);
    }
}
