//! The heap probe: where the outside part of the budget (a JVM heap, or any other
//! figure) comes from. None, a value pushed from outside, or a user function. Also
//! the last sample of untracked memory (`sampler.rs` takes it), so that
//! [`outside`] gives the whole of what the budget counts beside the native account.

use crate::base::stats::HeapBytes;
use crate::base::sync::{
    AtomicPtr, AtomicU64, AtomicU8,
    Ordering::{Acquire, Relaxed, Release},
};

/// A function that reports the heap. Called from the allocator's slow path (a few
/// times per flush and per refused request) and by [`stats`](crate::base::stats): it must be
/// cheap, must not block on other threads' allocations, and should not allocate. A
/// panic in it is caught, counted, and the last figures it gave stand in.
type ProbeFn = dyn Fn() -> HeapBytes + Send + Sync;

/// Where heap figures come from.
pub enum HeapProbe {
    /// No heap: the budget is native memory alone.
    None,
    /// The last values given to [`set_heap_bytes`].
    Pushed,
    /// A function called whenever a figure is needed.
    Function(Box<dyn Fn() -> HeapBytes + Send + Sync>),
}

impl std::fmt::Debug for HeapProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HeapProbe::None => "HeapProbe::None",
            HeapProbe::Pushed => "HeapProbe::Pushed",
            HeapProbe::Function(_) => "HeapProbe::Function(..)",
        })
    }
}

const NONE: u8 = 0;
const PUSHED: u8 = 1;
const FUNCTION: u8 = 2;

static MODE: AtomicU8 = AtomicU8::new(NONE);
static COMMITTED: AtomicU64 = AtomicU64::new(0);
static USED: AtomicU64 = AtomicU64::new(0);
/// A leaked `Box<Box<ProbeFn>>`: a reader on another thread may still be calling the
/// old function when a new one is installed, so functions are never freed.
static FUNC: AtomicPtr<Box<ProbeFn>> = AtomicPtr::new(std::ptr::null_mut());
/// Calls of the probe function that panicked (caught).
static PROBE_PANICS: AtomicU64 = AtomicU64::new(0);

/// Calls of a probe function that panicked.
pub(crate) fn panics() -> u64 {
    PROBE_PANICS.load(Relaxed)
}

/// Chooses where heap figures come from.
pub fn set_heap_probe(probe: HeapProbe) {
    match probe {
        HeapProbe::None => MODE.store(NONE, Relaxed),
        HeapProbe::Pushed => MODE.store(PUSHED, Relaxed),
        HeapProbe::Function(f) => {
            FUNC.store(Box::into_raw(Box::new(f)), Release);
            MODE.store(FUNCTION, Relaxed);
        }
    }
}

/// Pushes heap figures (from a JVM after each GC, for instance). Switches the probe
/// from [`HeapProbe::None`] to [`HeapProbe::Pushed`]; an installed function wins over
/// pushed values.
pub fn set_heap_bytes(heap: HeapBytes) {
    COMMITTED.store(heap.committed, Relaxed);
    USED.store(heap.used, Relaxed);
    let _ = MODE.compare_exchange(NONE, PUSHED, Relaxed, Relaxed);
}

/// The heap figures now.
pub(crate) fn read() -> HeapBytes {
    match MODE.load(Relaxed) {
        PUSHED => HeapBytes { committed: COMMITTED.load(Relaxed), used: USED.load(Relaxed) },
        FUNCTION => {
            let f = FUNC.load(Acquire);
            // SAFETY: FUNC only ever holds null or a pointer from `Box::into_raw` that is
            // never freed (see FUNC), and MODE is set to FUNCTION after the store.
            let Some(f) = (unsafe { f.as_ref() }) else { return HeapBytes::default() };
            // A panic must not unwind out of the allocator: the last good figures
            // stand in for a probe that panicked.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                Ok(heap) => {
                    COMMITTED.store(heap.committed, Relaxed);
                    USED.store(heap.used, Relaxed);
                    heap
                }
                Err(_) => {
                    PROBE_PANICS.fetch_add(1, Relaxed);
                    HeapBytes { committed: COMMITTED.load(Relaxed), used: USED.load(Relaxed) }
                }
            }
        }
        _ => HeapBytes::default(),
    }
}

static UNTRACKED: AtomicU64 = AtomicU64::new(0);
static UNTRACKED_PEAK: AtomicU64 = AtomicU64::new(0);

/// Records a sample of untracked memory.
pub(crate) fn set_untracked(bytes: u64) {
    UNTRACKED.store(bytes, Relaxed);
    UNTRACKED_PEAK.fetch_max(bytes, Relaxed);
}

/// A fork child's untracked figure, its peak forgotten with the parent's samples.
pub(crate) fn set_untracked_after_fork(bytes: u64) {
    UNTRACKED.store(bytes, Relaxed);
    UNTRACKED_PEAK.store(bytes, Relaxed);
}

/// Untracked bytes at the last sample.
pub(crate) fn untracked() -> u64 {
    UNTRACKED.load(Relaxed)
}

/// The most untracked bytes a sample has seen.
pub(crate) fn untracked_peak() -> u64 {
    UNTRACKED_PEAK.load(Relaxed)
}

/// What the budget counts beside the native account: the heap figure and, under
/// `Untracked::Count`, the untracked bytes.
pub(crate) fn outside() -> i64 {
    let heap = read().counted(crate::base::settings::heap_mode());
    let untracked = if crate::base::settings::count_untracked() { untracked() } else { 0 };
    heap.saturating_add(i64::try_from(untracked).unwrap_or(i64::MAX))
}
