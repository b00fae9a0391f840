//! The stack hook jemalloc calls for each sampled allocation: `unwind`'s walk (each
//! frame's rule read once and kept), libgcc's unwinder for what it declines, the
//! allocator's own frames left out (those in memquota's object when it is a library,
//! else the functions learned by allocating from functions of known address).

use crate::base::sync::{
    AtomicU32, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
use libc::{c_int, c_uint, c_void};

/// Allocator functions the stacks leave out, learned at start-up.
const SKIP: usize = 48;
/// The deepest stack kept: Go's heap profile keeps 32 frames too. The unwinder's cost
/// is per frame, so a deep server stack costs no more than this.
const DEPTH: usize = 32;

/// `jemalloc.h`'s `prof_backtrace_hook_t`.
pub(super) type BacktraceHook = unsafe extern "C" fn(*mut *mut c_void, *mut c_uint, c_uint);

// libgcc's unwinder (libgcc_s, which std links): the same one jemalloc uses by default;
// here for the stacks `unwind` declines and for calibration.
type UnwindTrace = extern "C" fn(*mut c_void, *mut c_void) -> c_int;
extern "C" {
    fn _Unwind_Backtrace(trace: UnwindTrace, arg: *mut c_void) -> c_int;
    fn _Unwind_GetIP(ctx: *mut c_void) -> usize;
    fn _Unwind_GetRegionStart(ctx: *mut c_void) -> usize;
}
const URC_NO_REASON: c_int = 0;
const URC_END_OF_STACK: c_int = 5;

/// Entry addresses of the functions every sampled stack starts with (the hook, the
/// profiler's, jemalloc's entry points, the face's allocator): learned by
/// [`calibrate`], read by the hook with no lock.
static SKIP_STARTS: [AtomicUsize; SKIP] = [const { AtomicUsize::new(0) }; SKIP];
static SKIP_LEN: AtomicUsize = AtomicUsize::new(0);
/// The address range of the object memquota is in, when it is a library of its own
/// (the preload): every frame there is the allocator's. 0..0 otherwise.
static OWN_LO: AtomicUsize = AtomicUsize::new(0);
static OWN_HI: AtomicUsize = AtomicUsize::new(0);
/// While [`calibrate`] runs: the entry of the function whose allocations it makes.
static CALIBRATING: AtomicUsize = AtomicUsize::new(0);
/// Samples taken from the function [`CALIBRATING`] names.
static LEARNED: AtomicU32 = AtomicU32::new(0);
/// Finds the object this code is in: when it is not the program itself, every frame
/// in it is the allocator's (the preload), and the stacks leave them out.
pub(super) fn own_object() {
    struct Found {
        addr: usize,
        lo: usize,
        hi: usize,
        main: bool,
    }
    extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid info for the call, and `data` is the
        // `Found` handed to it below, borrowed by nothing else meanwhile.
        let (info, found) = unsafe { (&*info, &mut *data.cast::<Found>()) };
        let (mut lo, mut hi) = (usize::MAX, 0);
        for i in 0..usize::from(info.dlpi_phnum) {
            // SAFETY: dlpi_phdr holds dlpi_phnum headers.
            let ph = unsafe { &*info.dlpi_phdr.add(i) };
            if ph.p_type == libc::PT_LOAD {
                let start = info.dlpi_addr as usize + ph.p_vaddr as usize;
                lo = lo.min(start);
                hi = hi.max(start + ph.p_memsz as usize);
            }
        }
        if (lo..hi).contains(&found.addr) {
            // SAFETY: dlpi_name is a NUL-terminated string (empty for the program).
            let name = unsafe { std::ffi::CStr::from_ptr(info.dlpi_name) };
            found.main = name.to_bytes().is_empty();
            found.lo = lo;
            found.hi = hi;
            return 1;
        }
        0
    }
    let mut found = Found { addr: own_object as *const () as usize, lo: 0, hi: 0, main: true };
    // SAFETY: `each` matches the callback type and only reads what the loader passes.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut found as *mut Found).cast()) };
    if !found.main && found.hi > found.lo {
        OWN_LO.store(found.lo, Relaxed);
        OWN_HI.store(found.hi, Release);
    }
}

/// Learns the allocator's frames: allocations from functions of known address are
/// made until each kind has been sampled, and every function between the hook and
/// them is the allocator's (jemalloc's entry points and profiler, the face's
/// `GlobalAlloc` or the preload's exports). Each entry of the Rust face has two paths:
/// a block its fast path takes goes from `__rust_alloc` (the face inlined in it) to
/// jemalloc, one its slow path takes leaves `__rust_alloc` by a tail call (no frame of
/// it on the stack). Big blocks (1 MiB: at most 16 per kind) always take the slow
/// path; small ones (256 bytes, at most 16 MiB of them per kind) the fast path but once
/// per slack the thread allocates, one in 16 at the least slack (4 KiB), so a small
/// kind learns from 4 samples. A rate far above the default (a sample all but certain
/// at it) learns nothing, and its stacks start inside the allocator. So does a program
/// whose global allocator does not reach memquota's jemalloc (the bench's dispatcher,
/// `QuotaAlloc::wrap(System)`): one small block that leaves jemalloc's count of the
/// thread's bytes where it was tells, and nothing more is tried (the tries would take
/// tens of milliseconds for nothing).
pub(super) fn calibrate() {
    let allocated = || super::ctl_read::<u64>(b"thread.allocated\0");
    let before = allocated();
    calibrate_small();
    if let (Some(before), Some(after)) = (before, allocated()) {
        if after == before {
            return;
        }
    }
    // The zeroed big block first: it takes fresh pages, which jemalloc knows are
    // zero. After the plain one it took that block's dirty pages, and zeroed them: a
    // megabyte written, half a millisecond of the set-up.
    let kinds: [(fn(), u32, u32); 6] = [
        (calibrate_zeroed, 16, 1),
        (calibrate_alloc, 16, 1),
        (calibrate_small, SMALL_TRIES, 4),
        (calibrate_small_zeroed, SMALL_TRIES, 4),
        (calibrate_realloc, 16, 1),
        (calibrate_small_realloc, SMALL_TRIES / 16, 4),
    ];
    for (f, tries, samples) in kinds {
        LEARNED.store(0, Relaxed);
        CALIBRATING.store(f as *const () as usize, Release);
        for _ in 0..tries {
            f();
            if LEARNED.load(Acquire) >= samples {
                break;
            }
        }
    }
    CALIBRATING.store(0, Release);
}

const CALIBRATION_SIZE: usize = 1 << 20;
/// The small blocks' size: below the least slack (4 KiB) many times over.
const SMALL_SIZE: usize = 256;
const SMALL_TRIES: u32 = (16 << 20) / SMALL_SIZE as u32;

#[inline(never)]
fn calibrate_alloc() {
    let layout =
        std::alloc::Layout::from_size_align(CALIBRATION_SIZE, 16).unwrap_or(std::alloc::Layout::new::<u64>());
    // SAFETY: a non-zero size; freed with the same layout.
    let p = unsafe { std::alloc::alloc(layout) };
    if !p.is_null() {
        // SAFETY: allocated just above with this layout.
        unsafe { std::alloc::dealloc(std::hint::black_box(p), layout) };
    }
}

#[inline(never)]
fn calibrate_small() {
    let layout = std::alloc::Layout::new::<[u64; SMALL_SIZE / 8]>();
    // SAFETY: a non-zero size; freed with the same layout.
    let p = unsafe { std::alloc::alloc(layout) };
    if !p.is_null() {
        // SAFETY: allocated just above with this layout.
        unsafe { std::alloc::dealloc(std::hint::black_box(p), layout) };
    }
}

#[inline(never)]
fn calibrate_small_zeroed() {
    let layout = std::alloc::Layout::new::<[u64; SMALL_SIZE / 8]>();
    // SAFETY: a non-zero size; freed with the same layout.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if !p.is_null() {
        // SAFETY: allocated just above with this layout.
        unsafe { std::alloc::dealloc(std::hint::black_box(p), layout) };
    }
}

/// A small block grown and shrunk 8 times: of the bytes it allocates, 96% are
/// `realloc`'s, so the samples of this kind are all but certainly some of them.
#[inline(never)]
fn calibrate_small_realloc() {
    let small = std::alloc::Layout::new::<[u64; SMALL_SIZE / 16]>();
    // SAFETY: a non-zero size.
    let p = unsafe { std::alloc::alloc(small) };
    if p.is_null() {
        return;
    }
    let mut block = (p, small);
    'resizing: for _ in 0..8 {
        for size in [SMALL_SIZE, SMALL_SIZE / 2] {
            // SAFETY: `block` is live with its layout; the new size is non-zero and
            // fits isize.
            let q = unsafe { std::alloc::realloc(std::hint::black_box(block.0), block.1, size) };
            if q.is_null() {
                break 'resizing;
            }
            block = (q, std::alloc::Layout::from_size_align(size, small.align()).unwrap_or(small));
        }
    }
    // SAFETY: live with its layout, freed once.
    unsafe { std::alloc::dealloc(std::hint::black_box(block.0), block.1) };
}

#[inline(never)]
fn calibrate_zeroed() {
    let layout =
        std::alloc::Layout::from_size_align(CALIBRATION_SIZE, 16).unwrap_or(std::alloc::Layout::new::<u64>());
    // SAFETY: a non-zero size; freed with the same layout.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if !p.is_null() {
        // SAFETY: allocated just above with this layout.
        unsafe { std::alloc::dealloc(std::hint::black_box(p), layout) };
    }
}

#[inline(never)]
fn calibrate_realloc() {
    let small = std::alloc::Layout::new::<[u64; 2]>();
    // SAFETY: a non-zero size.
    let p = unsafe { std::alloc::alloc(small) };
    if p.is_null() {
        return;
    }
    // SAFETY: `p` is live with `small`; the new size is non-zero and fits isize.
    let q = unsafe { std::alloc::realloc(std::hint::black_box(p), small, CALIBRATION_SIZE) };
    let (block, layout) = if q.is_null() {
        (p, small)
    } else {
        (q, std::alloc::Layout::from_size_align(CALIBRATION_SIZE, small.align()).unwrap_or(small))
    };
    // SAFETY: live with `layout`, freed once.
    unsafe { std::alloc::dealloc(std::hint::black_box(block), layout) };
}

/// Whether the stacks leave out the function that starts at `start`, learned as the
/// allocator's (a test's view of the calibration).
pub fn skips_function(start: usize) -> bool {
    skipped(start)
}

fn skipped(start: usize) -> bool {
    let n = SKIP_LEN.load(Acquire).min(SKIP);
    SKIP_STARTS[..n].iter().any(|s| s.load(Relaxed) == start)
}

fn learn(starts: &[usize]) {
    for &s in starts {
        if s == 0 || skipped(s) {
            continue;
        }
        let n = SKIP_LEN.load(Relaxed);
        if n < SKIP {
            SKIP_STARTS[n].store(s, Relaxed);
            SKIP_LEN.store(n + 1, Release);
        }
    }
}

/// One stack walk's state.
struct Walk {
    vec: *mut *mut c_void,
    max: usize,
    n: usize,
    skipping: bool,
    calibrating: usize,
    seen: [usize; SKIP],
    nseen: usize,
}

extern "C" fn step(ctx: *mut c_void, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Walk` `backtrace` handed to `_Unwind_Backtrace`, used by
    // nothing else while it runs.
    let w = unsafe { &mut *arg.cast::<Walk>() };
    // SAFETY: `ctx` is the unwinder's context for this frame.
    let ip = unsafe { _Unwind_GetIP(ctx) };
    if ip == 0 {
        return URC_END_OF_STACK;
    }
    // SAFETY: as above.
    let start = unsafe { _Unwind_GetRegionStart(ctx) };
    if w.visit(ip, start) {
        URC_NO_REASON
    } else {
        URC_END_OF_STACK
    }
}

impl Walk {
    /// One frame, innermost first (its return address, its function's start): false
    /// once the stack is full.
    fn visit(&mut self, ip: usize, start: usize) -> bool {
        if ip == 0 {
            return false;
        }
        if self.calibrating != 0 {
            if start == self.calibrating {
                learn(&self.seen[..self.nseen]);
                LEARNED.fetch_add(1, Release);
                self.calibrating = 0;
            } else if self.nseen < SKIP {
                self.seen[self.nseen] = start;
                self.nseen += 1;
            }
        }
        if self.skipping {
            let own = (OWN_LO.load(Relaxed)..OWN_HI.load(Acquire)).contains(&ip);
            if own || start == backtrace as *const () as usize || skipped(start) {
                return true;
            }
            self.skipping = false;
        }
        if self.n >= self.max {
            return false;
        }
        // SAFETY: `vec` holds `max` slots (the hook's contract) and n < max.
        unsafe { *self.vec.add(self.n) = ip as *mut c_void };
        self.n += 1;
        true
    }
}

/// Prepares the walk: false if it will be libgcc's on every sample.
pub(super) fn prepare() -> bool {
    super::unwind::set_up()
}

/// jemalloc's stack hook: the return addresses of the sampled allocation's stack,
/// innermost first, from its caller on, and, for a thread in a scope, the scope's
/// tag as the last frame (below 4096: no code lies there; `ledger::tables::tags`).
/// The walk is `unwind`'s (the frames' rules read once and kept) and, for a stack it
/// declines, libgcc's unwinder. Both read the unwind tables (frame pointers are not
/// needed), take no lock of memquota's and allocate nothing (glibc 2.35 and later
/// find a frame's table with `_dl_find_object`, without the loader's lock); the tag
/// is two loads.
///
/// # Safety
/// Called by jemalloc with `vec` holding `max` slots and `len` writable.
pub(super) unsafe extern "C" fn backtrace(vec: *mut *mut c_void, len: *mut c_uint, max: c_uint) {
    let mut walk = Walk {
        vec,
        max: (max as usize).min(DEPTH),
        n: 0,
        skipping: true,
        calibrating: CALIBRATING.load(Acquire),
        seen: [0; SKIP],
        nseen: 0,
    };
    // Calibration learns function starts from libgcc's own walk.
    if walk.calibrating != 0 || !super::unwind::walk(&mut |ip, start| walk.visit(ip, start)) {
        (walk.n, walk.skipping) = (0, true);
        // SAFETY: `step` only touches `walk`, which outlives the call.
        unsafe { _Unwind_Backtrace(step, (&mut walk as *mut Walk).cast()) };
    }
    // After the walk, and out of line: this frame, which the unwinder reads at every
    // sample, keeps the shape it had without the tag (measured: a tag read before the
    // walk cost 500 more instructions a sample in libgcc's CFA interpreter). A stack
    // of `max` frames gives its outermost one up for the tag.
    let tag = scope_tag();
    if tag != 0 && walk.max > 0 {
        let at = walk.n.min(walk.max - 1);
        // SAFETY: `vec` holds `max` slots (the hook's contract) and at < max.
        unsafe { *vec.add(at) = usize::from(tag) as *mut c_void };
        walk.n = at + 1;
    }
    // SAFETY: the hook's contract.
    unsafe { *len = walk.n as c_uint };
}

/// The sample tag of the calling thread's scope (0: in none): its thread state (a
/// thread-local with no destructor to register) and one load of the scope tables'
/// published tags, no lock.
#[inline(never)]
fn scope_tag() -> u16 {
    crate::ledger::threads::this_thread()
        .map_or(0, |l| crate::ledger::tables::tags::sample_tag(crate::ledger::threads::scope_of(l)))
}

/// Whether memquota is in a library of its own (the preload, a JNI library): then
/// every frame in that object is the allocator's, and nothing needs learning.
pub(super) fn in_library() -> bool {
    OWN_HI.load(Acquire) != 0
}
