//! Allocation sites: jemalloc's own heap profile, read without a heap.
//!
//! jemalloc (built with `--enable-prof`) samples allocations byte-weighted, one per
//! `2^lg_prof_sample` bytes on average, keeps each sampled block's stack until the
//! block is freed (a sampled small block is promoted to a page-aligned extent of its
//! own, so its free finds it at no cost to other frees), and writes the live samples
//! on `prof.dump`. memquota turns it on by default (`MEMQUOTA_PROFILE_SAMPLE`, 512 KiB;
//! `0` turns it off), captures the stacks itself (`backtrace`: libgcc's unwinder, the
//! allocator's own frames left out), and reads the top sites at a refusal: the dump
//! goes to a memfd and is parsed line by line in a fixed buffer, so the refusing
//! thread allocates nothing through the counted paths (jemalloc's own bookkeeping of
//! the dump uses its internal arena). Frames are return addresses shown as the
//! object and its address (`OBJECT+0xADDR`, what `addr2line -e OBJECT` reads): names
//! need symbol tables and allocation, so they are left to a reader with a heap
//! (`memquota run`, a test, a later pprof export). docs/design.md, "Allocation sites".

use crate::base::sync::{
    AtomicBool, AtomicU64, AtomicUsize,
    Ordering::{AcqRel, Acquire, Relaxed, Release},
};
use crate::base::text::Size;
use libc::{c_int, c_uint, c_void};
use std::fmt::{self, Write};

/// Sites a report names.
pub const TOP: usize = 5;
/// Frames kept per site, innermost first.
pub const FRAMES: usize = 4;
/// Objects (executables, libraries) the sites' frames may lie in.
const OBJECTS: usize = 8;
/// The longest object path kept.
const PATH: usize = 192;
/// Allocator functions the stacks leave out, learned at start-up.
const SKIP: usize = 48;
/// The deepest stack kept: Go's heap profile keeps 32 frames too. The unwinder's cost
/// is per frame, so a deep server stack costs no more than this.
const DEPTH: usize = 32;

/// jemalloc's options compiled into the program (`malloc_conf`, with the prefix of
/// memquota's jemalloc): profiling on from jemalloc's start, since `opt.prof` cannot
/// be turned on later. The variables jemalloc reads after it (`_RJEM_MALLOC_CONF`,
/// and `MALLOC_CONF` under the preload) still win; `MEMQUOTA_PROFILE_SAMPLE` sets the
/// rate or turns sampling off once memquota runs. A program that compiles in its own
/// `_rjem_malloc_conf` turns off the crate's `profile` feature (a default one).
#[cfg(feature = "profile")]
#[no_mangle]
#[used]
pub static _rjem_malloc_conf: Options = Options(c"prof:true,prof_active:true,lg_prof_sample:19".as_ptr());

/// A `const char *` jemalloc reads.
#[repr(transparent)]
pub struct Options(*const libc::c_char);

// SAFETY: it points at a string literal, immutable for the life of the process.
unsafe impl Sync for Options {}

/// `jemalloc.h`'s `prof_backtrace_hook_t`.
type BacktraceHook = unsafe extern "C" fn(*mut *mut c_void, *mut c_uint, c_uint);

// libgcc's unwinder (libgcc_s, which std links): the same one jemalloc uses by default.
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
static LEARNED: AtomicBool = AtomicBool::new(false);
/// The profile is on (jemalloc's `opt.prof`, active).
static ON: AtomicBool = AtomicBool::new(false);
static CONFIGURED: AtomicBool = AtomicBool::new(false);
/// The mean sampling interval in force, in bytes.
static RATE: AtomicU64 = AtomicU64::new(0);

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

/// Sets the profile up once, from the sampler thread (a service thread: its
/// allocations are charged, never refused): installs the stack hook, learns the
/// allocator's own frames, and applies `sample` (bytes; 0 turns sampling off). Does
/// nothing when jemalloc does not profile (`opt.prof` false).
pub(crate) fn configure(sample: u64) {
    if CONFIGURED.swap(true, AcqRel) {
        return;
    }
    if ctl_read::<bool>(b"opt.prof\0") != Some(true) {
        return;
    }
    if sample == 0 {
        ctl_write(b"prof.active\0", false);
        return;
    }
    let hook: BacktraceHook = backtrace;
    own_object();
    if !ctl_write(b"experimental.hooks.prof_backtrace\0", hook) {
        return;
    }
    let lg = nearest_lg(sample);
    if ctl_read::<usize>(b"prof.lg_sample\0") != Some(lg) {
        ctl_write(b"prof.reset\0", lg);
    }
    ctl_write(b"prof.active\0", true);
    RATE.store(1 << lg, Relaxed);
    // In a library of its own (the preload, a JNI library) every allocator frame is
    // in that object. In the program itself, the allocator's functions are learned,
    // on a thread of its own, an ordinary one: the caller may be a service thread,
    // whose allocations all take the face's slow path, and a face's fast path has
    // frames of its own to learn. (Never in a library: its `init` may run under the
    // loader's lock, which a new thread's start takes.)
    if OWN_HI.load(Acquire) == 0 {
        let learner = std::thread::Builder::new().name("memquota-sites".into()).spawn(calibrate);
        if let Ok(learner) = learner {
            let _ = learner.join();
        }
    }
    ON.store(true, Release);
}

/// jemalloc takes the mean as a power of two: the nearest one, at most 2^40.
fn nearest_lg(sample: u64) -> usize {
    let lg = 63 - sample.max(1).leading_zeros();
    let up = sample - (1u64 << lg) > (1u64 << lg) / 2;
    (lg + u32::from(up)).min(40) as usize
}

/// Finds the object this code is in: when it is not the program itself, every frame
/// in it is the allocator's (the preload), and the stacks leave them out.
fn own_object() {
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
/// made until one of each kind has been sampled, and every function between the hook
/// and them is the allocator's (jemalloc's entry points and profiler, the face's
/// `GlobalAlloc` or the preload's exports). At most 16 MiB in 1 MiB blocks per kind,
/// and 2 MiB in 4 KiB ones: a sample is all but certain at the default rate. A rate
/// far above it, or a program whose global allocator is not memquota's (then these
/// never reach jemalloc), learns nothing, and its stacks start inside the allocator.
fn calibrate() {
    // Small blocks too: a face may reach jemalloc by another path for them (the Rust
    // face's fast path, the preload's lazy jump).
    let kinds: [(fn(), u32); 4] =
        [(calibrate_alloc, 16), (calibrate_small, 512), (calibrate_zeroed, 16), (calibrate_realloc, 16)];
    for (f, tries) in kinds {
        LEARNED.store(false, Relaxed);
        CALIBRATING.store(f as *const () as usize, Release);
        for _ in 0..tries {
            f();
            if LEARNED.load(Acquire) {
                break;
            }
        }
    }
    CALIBRATING.store(0, Release);
}

const CALIBRATION_SIZE: usize = 1 << 20;

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
    let layout = std::alloc::Layout::new::<[u64; 512]>();
    // SAFETY: a non-zero size; freed with the same layout.
    let p = unsafe { std::alloc::alloc(layout) };
    if !p.is_null() {
        // SAFETY: allocated just above with this layout.
        unsafe { std::alloc::dealloc(std::hint::black_box(p), layout) };
    }
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
    if w.calibrating != 0 {
        if start == w.calibrating {
            learn(&w.seen[..w.nseen]);
            LEARNED.store(true, Release);
            w.calibrating = 0;
        } else if w.nseen < SKIP {
            w.seen[w.nseen] = start;
            w.nseen += 1;
        }
    }
    if w.skipping {
        let own = (OWN_LO.load(Relaxed)..OWN_HI.load(Acquire)).contains(&ip);
        if own || start == backtrace as *const () as usize || skipped(start) {
            return URC_NO_REASON;
        }
        w.skipping = false;
    }
    if w.n >= w.max {
        return URC_END_OF_STACK;
    }
    // SAFETY: `vec` holds `max` slots (the hook's contract) and n < max.
    unsafe { *w.vec.add(w.n) = ip as *mut c_void };
    w.n += 1;
    URC_NO_REASON
}

/// jemalloc's stack hook: the return addresses of the sampled allocation's stack,
/// innermost first, from its caller on. libgcc's unwinder reads the unwind tables
/// (frame pointers are not needed), takes no lock of memquota's and allocates
/// nothing (glibc 2.35 and later find a frame's table with `_dl_find_object`,
/// without the loader's lock).
///
/// # Safety
/// Called by jemalloc with `vec` holding `max` slots and `len` writable.
unsafe extern "C" fn backtrace(vec: *mut *mut c_void, len: *mut c_uint, max: c_uint) {
    let mut walk = Walk {
        vec,
        max: (max as usize).min(DEPTH),
        n: 0,
        skipping: true,
        calibrating: CALIBRATING.load(Acquire),
        seen: [0; SKIP],
        nseen: 0,
    };
    // SAFETY: `step` only touches `walk`, which outlives the call.
    unsafe { _Unwind_Backtrace(step, (&mut walk as *mut Walk).cast()) };
    // SAFETY: the hook's contract.
    unsafe { *len = walk.n as c_uint };
}

/// A frame of a site: its return address, and where it lies.
#[derive(Clone, Copy, Default, Debug)]
pub struct Frame {
    /// The return address.
    pub addr: u64,
    /// The object's index in [`Sites`] (`u8::MAX`: not in a file).
    pub object: u8,
    /// The address in the object's own terms (what `addr2line -e OBJECT` takes) of
    /// the call: the return address minus one, less the object's load address.
    pub rel: u64,
}

/// One site: a stack and what is live from it.
#[derive(Clone, Copy, Default, Debug)]
pub struct Site {
    /// Estimated live bytes.
    pub bytes: u64,
    /// Estimated live blocks.
    pub blocks: u64,
    /// The innermost frames outside the allocator.
    pub frames: [Frame; FRAMES],
    /// How many of `frames` are set.
    pub depth: usize,
}

/// The top sites of live memory, read from the profile in fixed storage.
#[derive(Clone, Copy, Debug)]
pub struct Sites {
    /// The mean bytes between samples the profile was taken at.
    pub rate: u64,
    /// Estimated live bytes in all sampled stacks.
    pub total: u64,
    /// The top sites, largest first.
    pub sites: [Site; TOP],
    /// How many of `sites` are set.
    pub len: usize,
    paths: [[u8; PATH]; OBJECTS],
    path_len: [u8; OBJECTS],
    objects: usize,
}

impl Default for Sites {
    fn default() -> Self {
        Sites::new()
    }
}

impl Sites {
    /// None.
    pub const fn new() -> Sites {
        const SITE: Site = Site {
            bytes: 0,
            blocks: 0,
            frames: [Frame { addr: 0, object: u8::MAX, rel: 0 }; FRAMES],
            depth: 0,
        };
        Sites {
            rate: 0,
            total: 0,
            sites: [SITE; TOP],
            len: 0,
            paths: [[0; PATH]; OBJECTS],
            path_len: [0; OBJECTS],
            objects: 0,
        }
    }

    /// The path of object `i` of a frame.
    pub fn object(&self, i: u8) -> Option<&str> {
        let i = usize::from(i);
        (i < self.objects)
            .then(|| std::str::from_utf8(&self.paths[i][..usize::from(self.path_len[i])]).unwrap_or("?"))
    }

    fn intern(&mut self, path: &[u8]) -> u8 {
        let path = &path[..path.len().min(PATH)];
        for i in 0..self.objects {
            if &self.paths[i][..usize::from(self.path_len[i])] == path {
                return i as u8;
            }
        }
        if self.objects == OBJECTS {
            return u8::MAX;
        }
        let i = self.objects;
        self.paths[i][..path.len()].copy_from_slice(path);
        self.path_len[i] = path.len() as u8;
        self.objects += 1;
        i as u8
    }

    fn insert(&mut self, site: Site) {
        let at = self.sites[..self.len].iter().position(|s| s.bytes < site.bytes).unwrap_or(self.len);
        if at >= TOP {
            return;
        }
        let end = self.len.min(TOP - 1);
        self.sites.copy_within(at..end, at + 1);
        self.sites[at] = site;
        self.len = (self.len + 1).min(TOP);
    }

    /// The live profile now, or None when it is off or cannot be read. Allocates
    /// nothing through the counted paths: the dump goes to a memfd, read back in a
    /// fixed buffer on the stack.
    pub fn read() -> Option<Sites> {
        if !enabled() {
            return None;
        }
        // SAFETY: a NUL-terminated name; flags as memfd_create takes them.
        let fd = unsafe { libc::memfd_create(c"memquota-profile".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        let mut path = [0u8; 40];
        let mut w = crate::base::text::SliceWriter::new(&mut path[..39]);
        let _ = write!(w, "/proc/self/fd/{fd}");
        let name = path.as_ptr().cast::<libc::c_char>();
        // SAFETY: `prof.dump` takes a `const char *`, here a NUL-terminated path (the
        // buffer's last byte stays 0) that outlives the call.
        let dumped = unsafe { tikv_jemalloc_ctl::raw::write(b"prof.dump\0", name) }.is_ok();
        let sites = if dumped { parse_fd(fd, RATE.load(Relaxed)) } else { None };
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(fd) };
        sites
    }
}

/// Reads a heap_v2 dump from `fd` (from its start) line by line.
fn parse_fd(fd: c_int, rate: u64) -> Option<Sites> {
    let mut parser = Parser {
        sites: Sites::new(),
        pooled: [Site::default(); POOL],
        pool_len: 0,
        rate,
        stack: [0; FRAMES],
        depth: 0,
        in_stack: false,
        maps: false,
        skip_rest: false,
        base_path: [0; PATH],
        base_len: 0,
        base: 0,
    };
    parser.sites.rate = rate;
    let mut buf = [0u8; 8192];
    let mut have = 0usize;
    let mut offset: i64 = 0;
    loop {
        // SAFETY: reads into the free part of `buf`.
        let n = unsafe { libc::pread(fd, buf[have..].as_mut_ptr().cast(), buf.len() - have, offset) };
        if n < 0 {
            return None;
        }
        let n = n as usize;
        offset += n as i64;
        have += n;
        let mut start = 0;
        while let Some(end) = buf[start..have].iter().position(|&b| b == b'\n') {
            parser.line(&buf[start..start + end]);
            start += end + 1;
        }
        if n == 0 {
            if start < have {
                parser.line(&buf[start..have]);
            }
            parser.rank();
            break;
        }
        if start == 0 && have == buf.len() {
            // A line longer than the buffer (a stack of hundreds of frames): its head
            // is enough, the rest is dropped.
            parser.line(&buf[..have]);
            parser.skip_rest = true;
            have = 0;
            continue;
        }
        buf.copy_within(start..have, 0);
        have -= start;
    }
    Some(parser.sites)
}

/// Sites a dump's records are gathered into before the top ones are kept.
const POOL: usize = 32;

struct Parser {
    sites: Sites,
    pooled: [Site; POOL],
    pool_len: usize,
    rate: u64,
    /// The stack of the record being read.
    stack: [u64; FRAMES],
    depth: usize,
    in_stack: bool,
    maps: bool,
    skip_rest: bool,
    /// The last object seen at file offset 0: its path and load address.
    base_path: [u8; PATH],
    base_len: usize,
    base: u64,
}

fn hex(s: &[u8]) -> Option<u64> {
    let s = s.strip_prefix(b"0x").unwrap_or(s);
    if s.is_empty() || s.len() > 16 {
        return None;
    }
    let mut v = 0u64;
    for &c in s {
        v = (v << 4) | u64::from((c as char).to_digit(16)? as u8);
    }
    Some(v)
}

fn dec(s: &[u8]) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    let mut v = 0u64;
    for &c in s {
        v = v.checked_mul(10)?.checked_add(u64::from((c as char).to_digit(10)? as u8))?;
    }
    Some(v)
}

/// pprof's and jeprof's scaling of a sampled count: each block of `avg` bytes was
/// sampled with probability `1 - exp(-avg / rate)`.
fn unsample(count: u64, bytes: u64, rate: u64) -> (u64, u64) {
    if count == 0 || rate == 0 {
        return (count, bytes);
    }
    let avg = bytes as f64 / count as f64;
    let p = 1.0 - (-avg / rate as f64).exp();
    if p <= 0.0 {
        return (count, bytes);
    }
    ((count as f64 / p) as u64, (bytes as f64 / p) as u64)
}

impl Parser {
    fn line(&mut self, line: &[u8]) {
        if self.skip_rest {
            self.skip_rest = false;
            return;
        }
        if self.maps {
            self.map_line(line);
        } else if let Some(rest) = line.strip_prefix(b"heap_v2/") {
            if let Some(r) = dec(rest) {
                self.rate = r;
                self.sites.rate = r;
            }
        } else if let Some(rest) = line.strip_prefix(b"@ ") {
            self.depth = 0;
            for word in rest.split(|&b| b == b' ') {
                if self.depth == FRAMES {
                    break;
                }
                if let Some(a) = hex(word) {
                    self.stack[self.depth] = a;
                    self.depth += 1;
                }
            }
            self.in_stack = true;
        } else if let Some(rest) = line.strip_prefix(b"  t*: ") {
            // "count: bytes [accumulated]"
            let mut parts = rest.split(|&b| b == b':' || b == b' ' || b == b'[').filter(|p| !p.is_empty());
            let (Some(count), Some(bytes)) = (parts.next().and_then(dec), parts.next().and_then(dec)) else {
                return;
            };
            let (blocks, bytes) = unsample(count, bytes, self.rate);
            if self.in_stack {
                self.sites.total = self.sites.total.saturating_add(bytes);
                let mut site = Site { bytes, blocks, depth: self.depth, ..Site::default() };
                for (f, &a) in site.frames.iter_mut().zip(&self.stack[..self.depth]) {
                    *f = Frame { addr: a, object: u8::MAX, rel: 0 };
                }
                self.pool(site);
                self.in_stack = false;
            }
            // The header's own total is left: the records' are each scaled by their
            // own mean size.
        } else if line == b"MAPPED_LIBRARIES:" {
            self.rank();
            self.maps = true;
        }
    }

    /// Adds a record to the pool of sites: two stacks whose frames after the first
    /// are the same are one site (the same callers, down to the function that called
    /// the allocator: a function may reach it by two calls, a face's fast and slow
    /// paths, and then two return addresses differ in the first frame only). When the
    /// pool is full, a record larger than its smallest site replaces it.
    fn pool(&mut self, site: Site) {
        let same = |a: &Site| {
            a.depth == site.depth
                && a.frames[usize::from(a.depth > 1)..a.depth]
                    .iter()
                    .zip(&site.frames[usize::from(site.depth > 1)..site.depth])
                    .all(|(x, y)| x.addr == y.addr)
        };
        if let Some(p) = self.pooled[..self.pool_len].iter_mut().find(|p| same(p)) {
            if site.bytes > p.bytes {
                p.frames = site.frames;
            }
            p.bytes = p.bytes.saturating_add(site.bytes);
            p.blocks = p.blocks.saturating_add(site.blocks);
        } else if self.pool_len < POOL {
            self.pooled[self.pool_len] = site;
            self.pool_len += 1;
        } else if let Some(smallest) = self.pooled.iter_mut().min_by_key(|p| p.bytes) {
            if smallest.bytes < site.bytes {
                *smallest = site;
            }
        }
    }

    /// The pool's top sites, once every record is in.
    fn rank(&mut self) {
        for i in 0..self.pool_len {
            let site = self.pooled[i];
            self.sites.insert(site);
        }
        self.pool_len = 0;
    }

    /// `start-end perms offset dev inode path`: the frames of the kept sites that lie
    /// in this mapping get their object and address.
    fn map_line(&mut self, line: &[u8]) {
        let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
        let (Some(range), Some(_perms), Some(off), Some(_dev), Some(_inode)) =
            (fields.next(), fields.next(), fields.next(), fields.next(), fields.next())
        else {
            return;
        };
        let path = fields.next().unwrap_or_default();
        let Some(dash) = range.iter().position(|&b| b == b'-') else { return };
        let (Some(start), Some(end), Some(off)) = (hex(&range[..dash]), hex(&range[dash + 1..]), hex(off))
        else {
            return;
        };
        if path.is_empty() || path[0] != b'/' {
            return;
        }
        if off == 0 {
            let n = path.len().min(PATH);
            self.base_path[..n].copy_from_slice(&path[..n]);
            self.base_len = n;
            self.base = start;
        }
        let load = if self.base_path[..self.base_len] == path[..path.len().min(PATH)] {
            self.base
        } else {
            start.wrapping_sub(off)
        };
        for i in 0..self.sites.len {
            for j in 0..self.sites.sites[i].depth {
                let a = self.sites.sites[i].frames[j].addr;
                if a >= start && a < end && self.sites.sites[i].frames[j].object == u8::MAX {
                    let object = self.sites.intern(path);
                    let f = &mut self.sites.sites[i].frames[j];
                    f.object = object;
                    f.rel = a.wrapping_sub(1).wrapping_sub(load);
                }
            }
        }
    }
}

/// The sites as the report's lines: each site's estimated bytes and share, its
/// frames innermost first as `OBJECT+0xADDR` (a frame in the same object as the one
/// before it as `+0xADDR`).
pub fn write_sites(w: &mut impl Write, s: &Sites, label: &str) -> fmt::Result {
    if s.len == 0 {
        return writeln!(w, "  {label:<16} none sampled (1 sample per {:#} allocated)", Size(s.rate));
    }
    writeln!(
        w,
        "  {label:<16} of {:#} live, estimated from samples (1 per {:#} allocated); frames innermost first, \
         OBJECT+ADDR for addr2line -f -e OBJECT ADDR",
        Size(s.total),
        Size(s.rate)
    )?;
    for site in &s.sites[..s.len] {
        let share = if s.total > 0 { site.bytes as f64 * 100.0 / s.total as f64 } else { 0.0 };
        write!(w, "    {} in {} blocks  {share:.1}% ", Size(site.bytes), site.blocks)?;
        let mut last = u8::MAX;
        for (k, f) in site.frames[..site.depth].iter().enumerate() {
            if k > 0 {
                w.write_str(" <-")?;
            }
            match s.object(f.object) {
                Some(_) if f.object == last => write!(w, " +{:#x}", f.rel)?,
                Some(path) => write!(w, " {path}+{:#x}", f.rel)?,
                None => write!(w, " {:#x}", f.addr)?,
            }
            last = f.object;
        }
        w.write_char('\n')?;
    }
    Ok(())
}

/// The sites as comment lines of a Prometheus text (the preload's stats file), for
/// `memquota run` to name: `# memquota site BYTES SHARE% OBJECT+ADDR ...`, every
/// frame with its object, after a `# memquota sites WHEN` line.
pub fn write_site_comments(w: &mut impl Write, s: &Sites, when: &str) -> fmt::Result {
    writeln!(w, "# memquota sites {when}; total {} bytes, 1 sample per {} bytes", s.total, s.rate)?;
    for site in &s.sites[..s.len] {
        let share = if s.total > 0 { site.bytes as f64 * 100.0 / s.total as f64 } else { 0.0 };
        write!(w, "# memquota site {} {share:.1}%", site.bytes)?;
        for f in &site.frames[..site.depth] {
            match s.object(f.object) {
                Some(path) => write!(w, " {path}+{:#x}", f.rel)?,
                None => write!(w, " {:#x}", f.addr)?,
            }
        }
        w.write_char('\n')?;
    }
    Ok(())
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

    /// A dump as jemalloc writes it: the top sites by estimated bytes, each frame
    /// placed in its object (less the load address of the object's first mapping),
    /// scaled as pprof does, the total of every record.
    #[test]
    fn a_dump_is_read_into_its_top_sites() {
        let dump = "heap_v2/524288\n  t*: 99: 6500000 [0: 0]\n  t0: 99: 6500000 [0: 0]\n\
            @ 0x55bc7c53b18e 0x55bc7c53b075 0x7fb552c4524a\n  t*: 50: 3280563 [0: 0]\n  t0: 50: 3280563 [0: 0]\n\
            @ 0x55bc7c53b1be 0x7fb552c4524a\n  t*: 48: 196608 [0: 0]\n\
            @ 0x7f0000000010\n  t*: 1: 64 [0: 0]\n\
            @ 0x55bc7c53b100 0x55bc7c53b075 0x7fb552c4524a\n  t*: 2: 131222 [0: 0]\n\
            \nMAPPED_LIBRARIES:\n\
            55bc7c53a000-55bc7c53b000 r--p 00000000 fe:00 10011056                   /tmp/two\n\
            55bc7c53b000-55bc7c53c000 r-xp 00001000 fe:00 10011056                   /tmp/two\n\
            7fb552c1e000-7fb552c44000 r--p 00000000 fe:00 326606                     /usr/lib/libc.so.6\n\
            7fb552c44000-7fb552d99000 r-xp 00026000 fe:00 326606                     /usr/lib/libc.so.6\n";
        // SAFETY: a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: writes the bytes of `dump` to our own descriptor.
        let n = unsafe { libc::write(fd, dump.as_ptr().cast(), dump.len()) };
        assert_eq!(n, dump.len() as isize);
        let s = parse_fd(fd, 0).expect("parsed");
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(fd) };
        assert_eq!(s.rate, 524288);
        assert_eq!(s.len, 3);
        let first = &s.sites[0];
        // 50 and 2 blocks of about 64 KiB from one function by two calls (the same
        // callers): one site, with the larger record's frames; each block sampled
        // with probability 1 - exp(-size / 524288).
        let p = |count: f64, bytes: f64| 1.0 - (-(bytes / count) / 524288.0f64).exp();
        let (p1, p2) = (p(50.0, 3280563.0), p(2.0, 131222.0));
        assert_eq!(first.bytes, (3280563.0 / p1) as u64 + (131222.0 / p2) as u64);
        assert_eq!(first.blocks, (50.0 / p1) as u64 + (2.0 / p2) as u64);
        assert_eq!(first.depth, 3);
        assert_eq!(s.object(first.frames[0].object), Some("/tmp/two"));
        assert_eq!(first.frames[0].rel, 0x55bc7c53b18e - 1 - 0x55bc7c53a000);
        assert_eq!(s.object(first.frames[2].object), Some("/usr/lib/libc.so.6"));
        assert_eq!(first.frames[2].rel, 0x7fb552c4524a - 1 - 0x7fb552c1e000);
        assert!(s.sites[1].bytes < first.bytes && s.sites[2].bytes < s.sites[1].bytes);
        assert_eq!(s.sites[2].frames[0].object, u8::MAX, "in no file");
        assert_eq!(s.total, s.sites[..3].iter().map(|x| x.bytes).sum::<u64>());
        let mut text = String::new();
        write_sites(&mut text, &s, "top sites").unwrap();
        assert!(text.contains("/tmp/two+0x118d <- +0x1074 <- /usr/lib/libc.so.6+0x27249\n"), "{text}");
        assert!(text.contains(" 0x7f0000000010\n"), "{text}");
        let mut comments = String::new();
        write_site_comments(&mut comments, &s, "live now").unwrap();
        assert!(comments.starts_with("# memquota sites live now;"), "{comments}");
        assert!(
            comments.contains("% /tmp/two+0x118d /tmp/two+0x1074 /usr/lib/libc.so.6+0x27249\n"),
            "{comments}"
        );
    }
}
