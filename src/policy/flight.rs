//! The flight recorder's hand-off (`MEMQUOTA_PROFILE_DIR`): a refusing thread asks for
//! a record, the sampler thread writes it. The refusing thread is inside the
//! allocator: it must not allocate through the counted paths, take a lock a writer
//! may hold, or wait unbounded. So it only bumps a counter and wakes the sampler
//! thread (a service thread: it allocates freely, counted, never refused), then waits
//! for that record at most [`RECORD_WAIT`]: a program may abort or crash right after
//! the NULL it gets, and the record is what is left of that moment. The writer itself
//! (what goes in the directory) is the process layer's (`process/recorder.rs`), set
//! once at `init`.

use crate::base::sync::{
    AtomicBool, AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};
use std::time::{Duration, Instant};

/// The longest a refusing thread waits for its record. Writing one takes
/// milliseconds (a dump of the profile, five small files); the bound is for a sampler
/// thread held up elsewhere (a purge, a slow disk, a machine whose cores are all busy:
/// on 2 loaded cores a 1 s bound lost the record in 3 of 7 runs of
/// `tests/no_alloc.rs`), after which the refusal returns and the record is written
/// when the thread comes to it. It is paid once per report window, only with a
/// recorder set.
pub(crate) const RECORD_WAIT: Duration = Duration::from_secs(5);

/// The writer: a `fn(u64)` (the record's number) as an address; 0: no recorder.
static WRITER: AtomicUsize = AtomicUsize::new(0);
/// Records asked for, and the last one written (or given up).
static REQUESTED: AtomicU64 = AtomicU64::new(0);
static DONE: AtomicU64 = AtomicU64::new(0);
/// A sampler thread serves records in this process (not in a fork child, where the
/// thread did not survive: a refusal there asks for none).
static SERVED: AtomicBool = AtomicBool::new(false);

/// Installs the writer the sampler thread calls for each record asked for.
pub(crate) fn set_writer(write: fn(u64)) {
    WRITER.store(write as usize, Release);
}

/// On the refusing thread, after its report is out: asks for a record and waits for
/// it, at most [`RECORD_WAIT`]. No allocation, no lock: an atomic counter, a wake-up
/// of the sampler thread, short sleeps. Nothing when no recorder is installed or no
/// sampler thread serves.
pub(crate) fn record() {
    if WRITER.load(Acquire) == 0 || !SERVED.load(Acquire) {
        return;
    }
    let n = REQUESTED.fetch_add(1, AcqRel) + 1;
    super::purge::wake_service();
    let Some(deadline) = Instant::now().checked_add(RECORD_WAIT) else { return };
    let mut pause = Duration::from_micros(50);
    while DONE.load(Acquire) < n {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(2));
    }
}

/// Once the sampler thread is started: records are served from now on (by its next
/// pass, if it has not run yet).
pub(crate) fn serving() {
    SERVED.store(true, Release);
}

/// On the sampler thread, once per pass: writes the record asked for last, if it is
/// not written yet (several asked for meanwhile are one record: the latest moment).
pub(crate) fn serve() {
    let asked = REQUESTED.load(Acquire);
    if asked <= DONE.load(Relaxed) {
        return;
    }
    let writer = WRITER.load(Acquire);
    if writer != 0 {
        // SAFETY: WRITER only ever holds 0 or a `fn(u64)` stored by `set_writer`.
        let write: fn(u64) = unsafe { std::mem::transmute::<usize, fn(u64)>(writer) };
        write(asked);
    }
    DONE.store(asked, Release);
}

/// In a fork child: no sampler thread serves records.
pub(crate) fn after_fork_child() {
    SERVED.store(false, Relaxed);
}
