//! A stack walk for the sampled allocations that reads each frame's unwind rule once:
//! the rule libgcc would compute from a return address's FDE (where the caller's stack
//! pointer, return address and `rbp` are) is kept in a table keyed by the return
//! address and its object, so a warm stack costs a table probe and two loads per
//! frame instead of a search and an interpretation of the DWARF call-frame program.
//! x86-64 only. Anything outside the common rules (a CFA or register given by an
//! expression, a signal frame, a frame in code registered at run time, a CFA not
//! above the stack pointer) hands the whole walk back to libgcc's unwinder, whose
//! frames this walk reproduces exactly (the test below compares them).
//!
//! Safe inside the allocator: no allocation, no lock (the table is a seqlock per slot
//! whose writer gives up rather than wait), and each frame's object is found with
//! glibc's `_dl_find_object` (lock-free; once per run of frames in one object): a rule
//! is used only for the object it was read from (its unwind table's address and the
//! end of its mapping), so a library unloaded and another loaded at its address does
//! not inherit its rules.

// The walk reads x86-64's registers; elsewhere it declines and libgcc walks.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use crate::base::sync::{
    AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
use libc::{c_int, c_void};

/// Slots of the rule table: a program's sampled stacks pass through a few thousand
/// distinct return addresses at most; a collision only costs a re-read.
const SLOTS: usize = 4096;

/// A frame's rule, packed in a word: `KIND` bits, then whether the CFA is `rbp`-based
/// (else `rsp`), the CFA's offset (i32), where `rbp` was saved (i16 from the CFA, 0:
/// not saved), where the return address is (i8 from the CFA).
const STEP: u64 = 1;
const END: u64 = 2;
const FALLBACK: u64 = 3;
const KIND: u64 = 3;
const CFA_RBP: u64 = 4;

/// glibc's `struct dl_find_object` (x86-64).
#[repr(C)]
struct DlFindObject {
    flags: u64,
    map_start: usize,
    map_end: usize,
    link_map: *mut c_void,
    eh_frame: usize,
    reserved: [u64; 7],
}

type FindObject = unsafe extern "C" fn(*mut c_void, *mut DlFindObject) -> c_int;

extern "C" {
    // libgcc's: the FDE that covers `pc`, `bases` = [text, data, function start].
    fn _Unwind_Find_FDE(pc: *mut c_void, bases: *mut [usize; 3]) -> *const u8;
}

/// glibc's `_dl_find_object` (2.35 and later), looked up at set-up: without it the
/// walk is libgcc's.
static FIND_OBJECT: AtomicUsize = AtomicUsize::new(0);

/// Looks up `_dl_find_object`; false if glibc has none (then [`walk`] declines).
pub(super) fn set_up() -> bool {
    // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the global scope.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_dl_find_object".as_ptr()) };
    FIND_OBJECT.store(f as usize, Release);
    !f.is_null()
}

struct Slot {
    /// Odd while a writer fills the slot.
    seq: AtomicU64,
    ip: AtomicUsize,
    object: AtomicUsize,
    object_end: AtomicUsize,
    rule: AtomicU64,
    start: AtomicUsize,
}

static TABLE: [Slot; SLOTS] = [const {
    Slot {
        seq: AtomicU64::new(0),
        ip: AtomicUsize::new(0),
        object: AtomicUsize::new(0),
        object_end: AtomicUsize::new(0),
        rule: AtomicU64::new(0),
        start: AtomicUsize::new(0),
    }
}; SLOTS];

fn slot(ip: usize) -> &'static Slot {
    &TABLE[((ip as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as usize % SLOTS]
}

/// The object a walk met last: a frame of this thread's stack keeps its object
/// loaded while the walk runs, so another frame in its range is in the same object.
#[derive(Clone, Copy)]
struct Object {
    lo: usize,
    hi: usize,
    eh_frame: usize,
}

/// The rule for the frame whose return address is `ip`, and its function's start.
fn rule(ip: usize, find: FindObject, last: &mut Object) -> (u64, usize) {
    let pc = ip - 1;
    let found = if (last.lo..last.hi).contains(&pc) {
        true
    } else {
        // SAFETY: all-zero is a valid `dl_find_object` (integers and pointers).
        let mut obj: DlFindObject = unsafe { std::mem::zeroed() };
        // SAFETY: `find` is glibc's `_dl_find_object`, which only reads the loader's
        // lock-free table and writes `obj`.
        let found = unsafe { find(pc as *mut c_void, &mut obj) } == 0;
        *last = if found {
            Object { lo: obj.map_start, hi: obj.map_end, eh_frame: obj.eh_frame }
        } else {
            Object { lo: 0, hi: 0, eh_frame: 0 }
        };
        found
    };
    let (object, object_end) = (last.eh_frame, last.hi);
    let s = slot(ip);
    let seq = s.seq.load(Acquire);
    if seq & 1 == 0 && found {
        let (k, o, r, st) =
            (s.ip.load(Acquire), s.object.load(Acquire), s.rule.load(Acquire), s.start.load(Acquire));
        let e = s.object_end.load(Acquire);
        if s.seq.load(Relaxed) == seq && k == ip && o == object && e == object_end && r != 0 {
            return (r, st);
        }
    }
    let mut bases = [0usize; 3];
    // SAFETY: libgcc's lookup: lock-free with glibc's `_dl_find_object` for loaded
    // objects; it writes `bases` only.
    let fde = unsafe { _Unwind_Find_FDE(pc as *mut c_void, &mut bases) };
    if fde.is_null() {
        // libgcc ends the walk here too, unless `ip` is the signal return trampoline.
        // SAFETY: `ip` is a return address libgcc would read the same bytes at.
        return (if unsafe { sigreturn_at(ip) } { FALLBACK } else { END }, 0);
    }
    // SAFETY: `fde` is the FDE libgcc found for `pc`, in a loaded object's tables.
    let r = unsafe { interpret(fde, bases[2], ip) };
    // Only a rule read from the object's own tables is kept: frames registered at run
    // time (a JIT's) can be deregistered with no object going away.
    if found
        && (last.lo..last.hi).contains(&(fde as usize))
        && seq & 1 == 0
        && s.seq.compare_exchange(seq, seq + 1, Acquire, Relaxed).is_ok()
    {
        s.ip.store(ip, Release);
        s.object.store(object, Release);
        s.object_end.store(object_end, Release);
        s.rule.store(r, Release);
        s.start.store(bases[2], Release);
        s.seq.store(seq + 2, Release);
    }
    (r, bases[2])
}

/// Whether `pc` holds `mov $15, %rax; syscall` (`rt_sigreturn`), what libgcc's
/// fallback recognises where no FDE is found.
///
/// # Safety
/// `pc` is a return address of the stack being walked: mapped code.
unsafe fn sigreturn_at(pc: usize) -> bool {
    // SAFETY: the caller's contract; unaligned reads of code bytes.
    unsafe {
        std::ptr::read_unaligned(pc as *const u8) == 0x48
            && std::ptr::read_unaligned((pc + 1) as *const u64) == 0x050f_0000_000f_c0c7
    }
}

/// Reads the LEB128 numbers and fixed fields of a CIE or FDE.
struct Reader {
    p: *const u8,
    end: *const u8,
}

impl Reader {
    fn more(&self) -> bool {
        self.p < self.end
    }
    fn u8(&mut self) -> Option<u8> {
        if !self.more() {
            return None;
        }
        // SAFETY: p < end, inside the section.
        let b = unsafe { *self.p };
        // SAFETY: at most one past the byte just read.
        self.p = unsafe { self.p.add(1) };
        Some(b)
    }
    fn fixed(&mut self, n: usize) -> Option<u64> {
        let mut v = 0u64;
        for i in 0..n {
            v |= u64::from(self.u8()?) << (8 * i);
        }
        Some(v)
    }
    fn uleb(&mut self) -> Option<u64> {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let b = self.u8()?;
            if shift < 64 {
                v |= u64::from(b & 0x7f) << shift;
            }
            shift += 7;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
    }
    fn sleb(&mut self) -> Option<i64> {
        let (mut v, mut shift) = (0i64, 0);
        loop {
            let b = self.u8()?;
            if shift < 64 {
                v |= i64::from(b & 0x7f) << shift;
            }
            shift += 7;
            if b & 0x80 == 0 {
                if shift < 64 && b & 0x40 != 0 {
                    v |= -1i64 << shift;
                }
                return Some(v);
            }
        }
    }
    fn skip(&mut self, n: u64) -> Option<()> {
        if n > (self.end as usize - self.p as usize) as u64 {
            return None;
        }
        // SAFETY: within [p, end].
        self.p = unsafe { self.p.add(n as usize) };
        Some(())
    }
    /// Skips a pointer of DWARF EH encoding `enc`.
    fn pointer(&mut self, enc: u8) -> Option<()> {
        match enc & 0x0f {
            0x00 | 0x04 | 0x0c => self.skip(8),
            0x02 | 0x0a => self.skip(2),
            0x03 | 0x0b => self.skip(4),
            0x01 => self.uleb().map(drop),
            0x09 => self.sleb().map(drop),
            _ => None,
        }
    }
}

/// Where a register of interest is, per the CFA program.
#[derive(Clone, Copy, PartialEq)]
enum Reg {
    Same,
    At(i64),
    Undefined,
    Other,
}

#[derive(Clone, Copy)]
struct State {
    cfa_reg: u64,
    cfa_off: i64,
    cfa_expr: bool,
    rbp: Reg,
    ra: Reg,
    rsp: Reg,
}

const RBP: u64 = 6;
const RSP: u64 = 7;
const RA: u64 = 16;

impl State {
    fn set(&mut self, reg: u64, how: Reg) {
        match reg {
            RBP => self.rbp = how,
            RA => self.ra = how,
            RSP => self.rsp = if how == Reg::Same { Reg::Same } else { Reg::Other },
            _ => {}
        }
    }
    fn restore(&mut self, reg: u64, initial: &State) {
        match reg {
            RBP => self.rbp = initial.rbp,
            RA => self.ra = initial.ra,
            RSP => self.rsp = initial.rsp,
            _ => {}
        }
    }
}

/// The rule at return address `ip` of the FDE at `fde` (function start `start`), as
/// libgcc's `uw_frame_state_for` computes it, packed; [`FALLBACK`] for what it does
/// not handle.
///
/// # Safety
/// `fde` points at an FDE in a loaded object's `.eh_frame`.
unsafe fn interpret(fde: *const u8, start: usize, ip: usize) -> u64 {
    // SAFETY: the caller's contract.
    unsafe { interpret_fde(fde, start, ip) }.unwrap_or(FALLBACK)
}

/// # Safety
/// As [`interpret`].
unsafe fn interpret_fde(fde: *const u8, start: usize, ip: usize) -> Option<u64> {
    // SAFETY: an FDE starts with its 4-byte length and its CIE pointer.
    let (len, cie_ptr) = unsafe {
        (std::ptr::read_unaligned(fde as *const u32), std::ptr::read_unaligned(fde.add(4) as *const u32))
    };
    if len == u32::MAX || cie_ptr == 0 {
        return None;
    }
    // SAFETY: the CIE pointer is the distance back from its own field to the CIE.
    let cie = unsafe { fde.add(4).sub(cie_ptr as usize) };
    // SAFETY: a CIE starts with its 4-byte length.
    let cie_len = unsafe { std::ptr::read_unaligned(cie as *const u32) };
    if cie_len == u32::MAX {
        return None;
    }
    // SAFETY: both records lie within `.eh_frame`, their lengths as given.
    let mut c = Reader { p: unsafe { cie.add(8) }, end: unsafe { cie.add(4 + cie_len as usize) } };
    let version = c.u8()?;
    let mut aug = [0u8; 8];
    let mut n = 0;
    loop {
        let b = c.u8()?;
        if b == 0 {
            break;
        }
        if n == aug.len() {
            return None;
        }
        aug[n] = b;
        n += 1;
    }
    let aug = &aug[..n];
    let code_align = c.uleb()?;
    let data_align = c.sleb()?;
    let ra_reg = if version == 1 { u64::from(c.u8()?) } else { c.uleb()? };
    if ra_reg != RA {
        return None;
    }
    let mut fde_enc = 0u8;
    if aug.first() == Some(&b'z') {
        let data = c.uleb()?;
        let mut a = Reader { p: c.p, end: c.p.wrapping_add(data as usize) };
        for &ch in &aug[1..] {
            match ch {
                b'L' => a.skip(1)?,
                b'R' => fde_enc = a.u8()?,
                b'P' => {
                    let enc = a.u8()?;
                    a.pointer(enc)?
                }
                // A signal frame: libgcc's, whose rules this walk does not keep.
                _ => return None,
            }
        }
        c.skip(data)?;
    } else if !aug.is_empty() {
        return None;
    }
    // libgcc's start: every register unsaved (its value in the callee), the return
    // address too (a CIE that does not say where it is: this walk declines).
    let mut initial =
        State { cfa_reg: RSP, cfa_off: 0, cfa_expr: false, rbp: Reg::Same, ra: Reg::Same, rsp: Reg::Same };
    let unset = initial;
    run(&mut c, &mut initial, &unset, code_align, data_align, start, usize::MAX)?;
    // SAFETY: the FDE's own extent.
    let mut f = Reader { p: unsafe { fde.add(8) }, end: unsafe { fde.add(4 + len as usize) } };
    f.pointer(fde_enc)?;
    f.pointer(fde_enc & 0x0f)?;
    if aug.first() == Some(&b'z') {
        let data = f.uleb()?;
        f.skip(data)?;
    }
    let mut state = initial;
    run(&mut f, &mut state, &initial, code_align, data_align, start, ip)?;
    pack(&state)
}

/// Runs a CFA program while its location is before `ip` (libgcc's bound for a return
/// address), into `s`; `initial` is the CIE's state, for `DW_CFA_restore`.
fn run(
    r: &mut Reader,
    s: &mut State,
    initial: &State,
    code: u64,
    data: i64,
    start: usize,
    ip: usize,
) -> Option<()> {
    let mut loc = start;
    let mut saved = [*s; 4];
    let mut depth = 0;
    while r.more() && loc < ip {
        let op = r.u8()?;
        let low = u64::from(op & 0x3f);
        match op >> 6 {
            1 => loc = loc.wrapping_add((low * code) as usize),
            2 => s.set(low, Reg::At(r.uleb()? as i64 * data)),
            3 => s.restore(low, initial),
            _ => match op {
                0x00 | 0x2e => {
                    if op == 0x2e {
                        r.uleb()?;
                    }
                }
                0x02 => loc = loc.wrapping_add((r.fixed(1)? * code) as usize),
                0x03 => loc = loc.wrapping_add((r.fixed(2)? * code) as usize),
                0x04 => loc = loc.wrapping_add((r.fixed(4)? * code) as usize),
                0x05 => {
                    let reg = r.uleb()?;
                    s.set(reg, Reg::At(r.uleb()? as i64 * data));
                }
                0x06 => {
                    let reg = r.uleb()?;
                    s.restore(reg, initial);
                }
                0x07 => {
                    let reg = r.uleb()?;
                    s.set(reg, if reg == RA { Reg::Undefined } else { Reg::Other });
                }
                0x08 => s.set(r.uleb()?, Reg::Same),
                0x09 => {
                    let reg = r.uleb()?;
                    r.uleb()?;
                    s.set(reg, Reg::Other);
                }
                0x0a => {
                    if depth == saved.len() {
                        return None;
                    }
                    saved[depth] = *s;
                    depth += 1;
                }
                0x0b => {
                    if depth == 0 {
                        return None;
                    }
                    depth -= 1;
                    // The CFA too, as libgcc does (an epilogue in mid-function relies on it).
                    *s = saved[depth];
                }
                0x0c => {
                    s.cfa_reg = r.uleb()?;
                    s.cfa_off = r.uleb()? as i64;
                    s.cfa_expr = false;
                }
                0x0d => {
                    s.cfa_reg = r.uleb()?;
                    s.cfa_expr = false;
                }
                0x0e => s.cfa_off = r.uleb()? as i64,
                0x0f => {
                    let n = r.uleb()?;
                    r.skip(n)?;
                    s.cfa_expr = true;
                }
                0x10 | 0x16 => {
                    let reg = r.uleb()?;
                    let n = r.uleb()?;
                    r.skip(n)?;
                    s.set(reg, Reg::Other);
                }
                0x11 => {
                    let reg = r.uleb()?;
                    s.set(reg, Reg::At(r.sleb()? * data));
                }
                0x12 => {
                    s.cfa_reg = r.uleb()?;
                    s.cfa_off = r.sleb()? * data;
                    s.cfa_expr = false;
                }
                0x13 => s.cfa_off = r.sleb()? * data,
                0x14 => {
                    let reg = r.uleb()?;
                    r.uleb()?;
                    s.set(reg, Reg::Other);
                }
                0x15 => {
                    let reg = r.uleb()?;
                    r.sleb()?;
                    s.set(reg, Reg::Other);
                }
                0x2f => {
                    let reg = r.uleb()?;
                    s.set(reg, Reg::At(-(r.uleb()? as i64) * data));
                }
                _ => return None,
            },
        }
    }
    Some(())
}

fn pack(s: &State) -> Option<u64> {
    if s.cfa_expr || s.rsp != Reg::Same || !(s.cfa_reg == RSP || s.cfa_reg == RBP) {
        return None;
    }
    let ra = match s.ra {
        Reg::Undefined => return Some(END),
        Reg::At(off) => i8::try_from(off).ok()?,
        _ => return None,
    };
    let rbp = match s.rbp {
        Reg::Same => 0,
        Reg::At(off) if off != 0 => i16::try_from(off).ok()?,
        _ => return None,
    };
    let cfa = i32::try_from(s.cfa_off).ok()?;
    let base = if s.cfa_reg == RBP { CFA_RBP } else { 0 };
    Some(STEP | base | u64::from(cfa as u32) << 8 | u64::from(rbp as u16) << 40 | u64::from(ra as u8) << 56)
}

/// Walks the stack of its caller, handing `visit` each frame's return address and
/// function start (0 where no FDE is found), innermost first, from the caller's own
/// frame: the frames libgcc's `_Unwind_Backtrace` gives its callback when called
/// where this is. `visit` returns false to stop. False if the walk could not be done
/// here (no `_dl_find_object`, a frame whose rule it does not handle): then `visit`
/// may have seen some frames, and the caller walks again with libgcc.
#[cfg(target_arch = "x86_64")]
#[inline(never)]
pub(super) fn walk(visit: &mut dyn FnMut(usize, usize) -> bool) -> bool {
    let f = FIND_OBJECT.load(Acquire);
    if f == 0 {
        return false;
    }
    // SAFETY: stored by `set_up` from dlsym's result for `_dl_find_object`.
    let find: FindObject = unsafe { std::mem::transmute::<usize, FindObject>(f) };
    let (mut sp, mut bp, here): (usize, usize, usize);
    // SAFETY: reads registers and an address; touches no memory or flags.
    unsafe {
        std::arch::asm!("lea {here}, [rip]", "mov {sp}, rsp", "mov {bp}, rbp",
            here = out(reg) here, sp = out(reg) sp, bp = out(reg) bp,
            options(nomem, nostack, preserves_flags));
    }
    // `here` is an instruction of this function with the stack as read: the rule at
    // it is the one a return address just past it would look up.
    let mut ip = here + 1;
    let mut own = true;
    let mut last = Object { lo: 0, hi: 0, eh_frame: 0 };
    loop {
        if ip == 0 {
            return true;
        }
        let (rule, start) = self::rule(ip, find, &mut last);
        let kind = rule & KIND;
        if kind == FALLBACK {
            return false;
        }
        if !own && !visit(ip, start) {
            return true;
        }
        own = false;
        if kind == END {
            return true;
        }
        let base = if rule & CFA_RBP != 0 { bp } else { sp };
        let cfa = base.wrapping_add_signed(i64::from((rule >> 8) as u32 as i32) as isize);
        // The caller's frame is above this one: anything else is a rule this walk got
        // wrong, and libgcc does the walk.
        if cfa <= sp || cfa - sp > 1 << 26 {
            return false;
        }
        let ra_at = cfa.wrapping_add_signed(isize::from((rule >> 56) as u8 as i8));
        let rbp_off = (rule >> 40) as u16 as i16;
        // SAFETY: the rule is the frame's own (its FDE's, as libgcc reads it), so the
        // return address and the saved rbp are in this thread's stack, below the CFA.
        unsafe {
            if rbp_off != 0 {
                bp = std::ptr::read(cfa.wrapping_add_signed(isize::from(rbp_off)) as *const usize);
            }
            ip = std::ptr::read(ra_at as *const usize);
        }
        sp = cfa;
    }
}

/// Elsewhere the registers this walk reads are not there: libgcc walks.
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn walk(_visit: &mut dyn FnMut(usize, usize) -> bool) -> bool {
    false
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    type UnwindTrace = extern "C" fn(*mut c_void, *mut c_void) -> c_int;
    extern "C" {
        fn _Unwind_Backtrace(trace: UnwindTrace, arg: *mut c_void) -> c_int;
        fn _Unwind_GetIP(ctx: *mut c_void) -> usize;
        fn _Unwind_GetRegionStart(ctx: *mut c_void) -> usize;
    }

    type Frames = Vec<(usize, usize)>;

    extern "C" fn collect(ctx: *mut c_void, arg: *mut c_void) -> c_int {
        // SAFETY: `arg` is the `Frames` passed below; `ctx` libgcc's frame context.
        let (frames, ip, start) =
            unsafe { (&mut *arg.cast::<Frames>(), _Unwind_GetIP(ctx), _Unwind_GetRegionStart(ctx)) };
        if ip == 0 {
            return 5;
        }
        frames.push((ip, start));
        0
    }

    /// libgcc's frames and this walk's (twice: the rules read, then from the table),
    /// each from the same function.
    #[inline(never)]
    fn both() -> [Frames; 3] {
        let mut libgcc = Frames::new();
        // SAFETY: `collect` only pushes to `libgcc`, which outlives the call.
        unsafe { _Unwind_Backtrace(collect, (&mut libgcc as *mut Frames).cast()) };
        let mut walks = [Frames::new(), Frames::new()];
        for w in &mut walks {
            let done = walk(&mut |ip, start| {
                w.push((ip, start));
                true
            });
            assert!(done, "the walk declined a stack of Rust and glibc frames");
        }
        let [a, b] = walks;
        [libgcc, a, b]
    }

    static SEEN: crate::base::sync::Mutex<Vec<[Frames; 3]>> = crate::base::sync::Mutex::new(Vec::new());

    extern "C" fn compare(a: *const c_void, b: *const c_void) -> c_int {
        let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
        if seen.is_empty() {
            seen.push(std::hint::black_box(both()));
        }
        // SAFETY: qsort passes two elements of the `[u64; 2]` below.
        unsafe { (*a.cast::<u64>()).cmp(&*b.cast::<u64>()) as c_int }
    }

    #[inline(never)]
    fn inner() -> [Frames; 3] {
        std::hint::black_box(both())
    }

    #[inline(never)]
    fn outer() -> [Frames; 3] {
        std::hint::black_box(inner())
    }

    fn same(frames: &[Frames; 3]) {
        let [libgcc, cold, warm] = frames;
        assert!(libgcc.len() >= 4, "a stack of at least the test's functions: {libgcc:x?}");
        // The first frame is `both` itself, at its calls of each walk; every other is
        // the same.
        for walk in [cold, warm] {
            assert_eq!(libgcc.len(), walk.len(), "libgcc {libgcc:x?}\nwalk {walk:x?}");
            assert_eq!(libgcc[0].1, walk[0].1);
            assert_eq!(libgcc[1..], walk[1..], "libgcc {libgcc:x?}\nwalk {walk:x?}");
        }
    }

    #[test]
    fn the_walk_gives_libgccs_frames() {
        assert!(set_up(), "glibc has _dl_find_object (2.35 and later)");
        same(&outer());
        // Through C code built by gcc: glibc's qsort calling back.
        let mut v = [2u64, 1];
        // SAFETY: two u64 elements, compared by `compare`.
        unsafe { libc::qsort(v.as_mut_ptr().cast(), 2, 8, Some(compare)) };
        let frames = SEEN.lock().unwrap_or_else(|e| e.into_inner()).pop().expect("qsort called back");
        let in_libc = |ip: usize| -> bool {
            // SAFETY: all-zero is a valid Dl_info; dladdr writes it for a mapped address.
            let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            if unsafe { libc::dladdr(ip as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
                return false;
            }
            // SAFETY: dli_fname is the object's NUL-terminated name.
            let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
            name.to_bytes().windows(7).any(|w| w == b"libc.so")
        };
        assert!(frames[0].iter().any(|&(ip, _)| in_libc(ip)), "qsort's frames: {:x?}", frames[0]);
        same(&frames);
    }

    #[test]
    fn a_rule_packs_and_declines_what_it_cannot_keep() {
        let base = State {
            cfa_reg: RSP,
            cfa_off: 16,
            cfa_expr: false,
            rbp: Reg::At(-16),
            ra: Reg::At(-8),
            rsp: Reg::Same,
        };
        let r = pack(&base).expect("a push rbp frame");
        assert_eq!(r & KIND, STEP);
        assert_eq!((r >> 8) as u32 as i32, 16);
        assert_eq!((r >> 40) as u16 as i16, -16);
        assert_eq!((r >> 56) as u8 as i8, -8);
        assert_eq!(pack(&State { ra: Reg::Undefined, ..base }), Some(END));
        assert_eq!(pack(&State { cfa_expr: true, ..base }), None);
        assert_eq!(pack(&State { cfa_reg: 10, ..base }), None);
        assert_eq!(pack(&State { rbp: Reg::Other, ..base }), None);
    }
}
