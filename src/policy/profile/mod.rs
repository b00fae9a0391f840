//! Allocation sites: jemalloc's own heap profile, read without a heap.
//!
//! jemalloc (built with `--enable-prof`) samples allocations byte-weighted, one per
//! `2^lg_prof_sample` bytes on average, keeps each sampled block's stack until the
//! block is freed (a sampled small block is promoted to a page-aligned extent of its
//! own, so its free finds it at no cost to other frees), and writes the live samples
//! on `prof.dump`. memquota turns it on at one sample per 512 KiB (Go's rate, the
//! default; `MEMQUOTA_PROFILE_SAMPLE` sets another, 0 turns it off), captures the
//! stacks itself (`backtrace`: the unwind tables' rules
//! read once per return address and kept, libgcc's unwinder for the rest, the
//! allocator's own frames left out), and reads the top sites at a refusal: the dump
//! goes to a memfd and is parsed line by line in a fixed buffer, so the refusing
//! thread allocates nothing through the counted paths (jemalloc's own bookkeeping of
//! the dump uses its internal arena). Frames are return addresses shown as the
//! object and its address (`OBJECT+0xADDR`, what `addr2line -e OBJECT` reads): names
//! need symbol tables and allocation, so they are left to a reader with a heap
//! (`memquota run`, a test, pprof reading the profile `pprof` encodes for the
//! endpoint and the flight recorder). docs/design.md, "Allocation sites". `hook`
//! captures the stacks (walked by `unwind`), `dump` reads the dump (the one parser of
//! heap_v2) and writes the sites, `pprof` encodes the profile.

mod dump;
mod hook;
mod pprof;
mod unwind;

pub use dump::{write_scope_sites, write_site_comments, write_sites, write_unreserved_sites, Sites};
pub use hook::skips_function;
pub use pprof::heap_profile;

use crate::base::sync::{
    AtomicBool, AtomicU64,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};

/// jemalloc's options compiled into the program (`malloc_conf`, with the prefix of
/// memquota's jemalloc): profiling possible from jemalloc's start (`opt.prof` cannot
/// be turned on later), no sample taken until `init` or the sampler thread applies the
/// rate (`MEMQUOTA_PROFILE_SAMPLE`, 512 KiB by default).
/// The variables jemalloc reads after it (`_RJEM_MALLOC_CONF`, and `MALLOC_CONF`
/// under the preload) still win. A program that compiles in its own
/// `_rjem_malloc_conf` turns the crate's default features (`profile`) off.
#[cfg(feature = "profile")]
#[no_mangle]
#[used]
pub static _rjem_malloc_conf: Options = Options(c"prof:true,prof_active:false,lg_prof_sample:19".as_ptr());

/// A `const char *` jemalloc reads.
#[repr(transparent)]
pub struct Options(*const libc::c_char);

// SAFETY: it points at a string literal, immutable for the life of the process.
unsafe impl Sync for Options {}

/// The profile is on (jemalloc's `opt.prof`, active).
static ON: AtomicBool = AtomicBool::new(false);
/// A [`configure`] is applying the settings (a window a fork child resets).
static APPLYING: AtomicBool = AtomicBool::new(false);
/// The stack hook is installed and the allocator's frames learned.
static SET_UP: AtomicBool = AtomicBool::new(false);
/// The mean sampling interval in force, in bytes.
static RATE: AtomicU64 = AtomicU64::new(0);

/// Whether jemalloc can profile (`opt.prof`: built with profiling, not turned off by
/// the options it read at its start).
pub fn available() -> bool {
    ctl_read::<bool>(b"opt.prof\0") == Some(true)
}

/// Whether the profile is being taken.
pub fn enabled() -> bool {
    ON.load(Acquire)
}

fn ctl_read<T: Copy>(name: &[u8]) -> Option<T> {
    // SAFETY: `name` is NUL-terminated, and each caller names a control of type T.
    unsafe { tikv_jemalloc_ctl::raw::read::<T>(name) }.ok()
}

fn ctl_write<T>(name: &[u8], value: T) -> bool {
    // SAFETY: as `ctl_read`: a NUL-terminated name of a control of type T.
    unsafe { tikv_jemalloc_ctl::raw::write::<T>(name, value) }.is_ok()
}

/// Applies the settings' rate (`MEMQUOTA_PROFILE_SAMPLE`, bytes; 0: no samples), from
/// `init` (after it stored its settings) or, for a program that never calls it, the
/// sampler thread (a service thread: its allocations are charged, never refused).
/// One caller at a time, each reading the rate when its turn comes, so the last one
/// applies the latest settings whatever order the two run in. The first rate sets the
/// profile up: installs the stack hook and learns the allocator's own frames; later
/// calls only change the rate or stop sampling. `init` returns once a set-up under way
/// on the sampler thread is done, so that what the program measures after it is not
/// moved by the allocations that learn the allocator's frames. Does nothing when
/// jemalloc does not profile (`opt.prof` false).
pub(crate) fn configure() {
    while APPLYING.compare_exchange(false, true, Acquire, Relaxed).is_err() {
        // A set-up learns the allocator's frames on a thread it starts and joins:
        // milliseconds, once per process.
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    crate::base::settings::in_window(crate::base::settings::Window::ProfileSettings);
    let sample = crate::base::settings::profile_sample();
    if ctl_read::<bool>(b"opt.prof\0") != Some(true) {
        // jemalloc does not profile: nothing to apply.
    } else if sample == 0 {
        if ON.swap(false, AcqRel) {
            ctl_write(b"prof.active\0", false);
        }
    } else if SET_UP.load(Relaxed) {
        sample_at(sample);
        ON.store(true, Release);
    } else if set_up(sample) {
        SET_UP.store(true, Relaxed);
    }
    APPLYING.store(false, Release);
}

/// From the fork child handler: a [`configure`] another thread was running when the
/// process forked never ends in the child (that thread is gone), and the child's next
/// one (its `init`) would wait for it for ever. Allocates nothing.
pub(crate) fn after_fork_child() {
    APPLYING.store(false, Relaxed);
}

/// The first set-up: the hook, the rate, the allocator's frames. False if jemalloc
/// refused the hook.
fn set_up(sample: u64) -> bool {
    let hook: hook::BacktraceHook = hook::backtrace;
    hook::own_object();
    hook::prepare();
    if !ctl_write(b"experimental.hooks.prof_backtrace\0", hook) {
        return false;
    }
    sample_at(sample);
    // In a library of its own (the preload, a JNI library) every allocator frame is
    // in that object. In the program itself, the allocator's functions are learned,
    // on a thread of its own, an ordinary one: the caller may be a service thread,
    // whose allocations all take the face's slow path, and a face's fast path has
    // frames of its own to learn. (Never in a library: its `init` may run under the
    // loader's lock, which a new thread's start takes.)
    if !hook::in_library() {
        let learner = std::thread::Builder::new().name("memquota-sites".into()).spawn(hook::calibrate);
        if let Ok(learner) = learner {
            let _ = learner.join();
        }
    }
    ON.store(true, Release);
    true
}

/// Samples once per `sample` bytes on average (the nearest power of two); a new rate
/// resets the profile, so that it holds samples at one rate only.
fn sample_at(sample: u64) {
    let lg = nearest_lg(sample);
    if ctl_read::<usize>(b"prof.lg_sample\0") != Some(lg) {
        ctl_write(b"prof.reset\0", lg);
    }
    ctl_write(b"prof.active\0", true);
    RATE.store(1 << lg, Relaxed);
}

/// jemalloc takes the mean as a power of two: the nearest one, at most 2^40.
fn nearest_lg(sample: u64) -> usize {
    let lg = 63 - sample.max(1).leading_zeros();
    let up = sample - (1u64 << lg) > (1u64 << lg) / 2;
    (lg + u32::from(up)).min(40) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nearest_power_of_two_is_jemallocs_rate() {
        assert_eq!(nearest_lg(512 << 10), 19);
        assert_eq!(nearest_lg(700 << 10), 19, "700 KiB is nearer 512 KiB than 1 MiB");
        assert_eq!(nearest_lg(800 << 10), 20);
        assert_eq!(nearest_lg(1), 0);
        assert_eq!(nearest_lg(u64::MAX), 40);
    }
}
