//! The malloc family's exported symbols: the tables of C entry points (`malloc` ...
//! `malloc_info`, glibc's internal names) and the naked code of `malloc` and `free`,
//! each with the test that keeps a lazy call a tail call into jemalloc; what is
//! counted leaves for `charge.rs`.
//!
//! Exported with `#[cfg_attr(not(test), no_mangle)]` so this crate's own unit tests
//! do not interpose themselves.

use crate::malloc::charge::{
    alloc_aligned, alloc_counted, deferred, enomem, errno, free_counted, resize_by, set_errno,
    zeroed_counted, Resize, LAZY_FREE,
};
use crate::malloc::thread::{slot, Slot};
use libc::{c_int, c_void, size_t};
use memquota_core::seam::{hot, scopes};
use std::ptr::null_mut;
use tikv_jemalloc_sys as jem;

const PAGE: usize = 4096;

/// Where the thread's [`hot::Bulk::lazy_below`] sits in its slot, for the entries below.
const LAZY_BELOW: usize = std::mem::offset_of!(Slot, bulk) + std::mem::offset_of!(hot::Bulk, lazy_below);

/// The code of `malloc`: under [`hot::SMALL_MAX`] on a lazy thread, a jump into jemalloc,
/// charged in bulk later (`lazy.rs`); otherwise counted, out of line
/// ([`alloc_counted`]). Four instructions, every way out a direct jump, no stack
/// frame. Written out because the compiler cannot do the same (its count:
/// docs/benchmarks.md, session 10): it compares the size with [`hot::SMALL_MAX`] and then
/// tests the lazy flag, where one compare with [`hot::Bulk::lazy_below`] does both;
/// it computes the slot's address (thread pointer plus the GOT's offset) to read one
/// field of it, where the initial-exec sequence reads the field at the offset itself
/// (`fs:[offset + field]`); and a call to a C function goes through the GOT unless
/// the linker may relax the load, which Rust's relocations do not allow.
///
/// The compiler gives naked code no unwind info, and a profiler or a `backtrace()`
/// from a signal handler stops at a PC it cannot unwind: `.cfi_startproc` gives the
/// code an FDE. The code never moves the stack, so the CIE's rule (the return address
/// on top of it) holds at every instruction and the FDE needs no rule of its own.
macro_rules! malloc_code {
    () => {
        std::arch::naked_asm!(
            ".cfi_startproc",
            "mov rax, qword ptr [rip + memquota_preload_local@GOTTPOFF]",
            "cmp rdi, qword ptr fs:[rax + {lazy_below}]",
            "jae {counted}",
            "jmp {jemalloc}",
            ".cfi_endproc",
            lazy_below = const LAZY_BELOW,
            counted = sym alloc_counted,
            jemalloc = sym jem::malloc,
        )
    };
}

/// The code of `free`: while the thread's frees are lazy, a jump to [`LAZY_FREE`]
/// (jemalloc, which takes null too, until a scope begins); otherwise counted, out of
/// line. Four instructions, no stack frame, an FDE; written out for the reasons
/// given at [`malloc_code`].
macro_rules! free_code {
    () => {
        std::arch::naked_asm!(
            ".cfi_startproc",
            "mov rax, qword ptr [rip + memquota_preload_local@GOTTPOFF]",
            "cmp qword ptr fs:[rax + {lazy_below}], 0",
            "je {counted}",
            "jmp qword ptr [rip + {lazy_free}]",
            ".cfi_endproc",
            lazy_below = const LAZY_BELOW,
            counted = sym free_counted,
            lazy_free = sym LAZY_FREE,
        )
    };
}

/// `realloc`.
///
/// # Safety
/// `p` is null, or a live block of this allocator (from the malloc family or C++
/// `new`) not given back since. Unless this returns null with `n > 0` (`p` then
/// stays live), `p` is given back and not used after.
unsafe fn resize(p: *mut c_void, n: size_t) -> *mut c_void {
    if p.is_null() {
        // SAFETY: no precondition.
        return unsafe { alloc(n) };
    }
    if n == 0 {
        // SAFETY: `p` is non-null here, so a live block of this allocator (this
        // function's contract); a realloc to 0 gives it back, so it is not used after.
        unsafe { release(p) }; // glibc: realloc(p, 0) frees p and returns NULL
        return null_mut();
    }
    let s = slot();
    if (n as u64) < s.bulk.lazy_below.get() && !scopes::scopes_used() {
        // Under SMALL_MAX on a lazy thread, before any scope (as for `free`: an owner
        // record must be found): counted in bulk (`lazy.rs`), with the hook put off
        // until both totals have moved. Moved or in place, jemalloc adds the block's
        // new usable size to the thread's total of allocated bytes and its old one to
        // the freed total, so the new size waits within the lead, like a lazy
        // `malloc`'s, and the old within the lag, like a lazy `free`'s.
        // SAFETY: `p` is non-null here, so a live jemalloc block (this function's
        // contract), n >= 1.
        return deferred(s, || unsafe { jem::realloc(p, n) });
    }
    // SAFETY: `p` is non-null and `n` non-zero here; the rest is this function's contract.
    unsafe { resize_by(p, n, Resize::Realloc) }
}

/// `calloc`: under [`hot::SMALL_MAX`] bytes on a lazy thread, like `malloc`'s
/// ([`malloc_code`]) a tail call into jemalloc, charged in bulk later (`lazy.rs`);
/// otherwise counted, out of line. No stack frame.
#[inline(always)]
fn zeroed(count: size_t, size: size_t) -> *mut c_void {
    if let Some(total) = count.checked_mul(size) {
        if (total as u64) < slot().bulk.lazy_below.get() {
            // SAFETY: plain jemalloc calloc of a product that does not overflow.
            return unsafe { jem::calloc(count, size) };
        }
    }
    zeroed_counted(count, size)
}

/// glibc's `memalign`: an alignment that is not a power of two is rounded up.
fn memalign_glibc(align: size_t, n: size_t) -> *mut c_void {
    let align = align.max(1);
    if align > usize::MAX / 2 + 1 {
        set_errno(libc::EINVAL);
        return null_mut();
    }
    alloc_aligned(align.next_power_of_two(), n)
}

fn pvalloc_pages(n: size_t) -> *mut c_void {
    let Some(rounded) = n.max(1).checked_add(PAGE - 1) else {
        return enomem();
    };
    alloc_aligned(PAGE, rounded & !(PAGE - 1))
}

/// Each entry states its own `# Safety`: the contract its callers rely on, and that
/// the SAFETY comments in its body cite.
macro_rules! export {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $body:expr; )*) => {$(
        $(#[$doc])*
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            $body
        }
    )*};
}

/// The entries whose whole body is [`malloc_code`] or [`free_code`]: each its own
/// copy, so that a call reaches jemalloc with no jump of memquota's between, and
/// each at the start of a 64-byte line. Where they start in a line moves the
/// small-object benchmark at the same instruction count (docs/benchmarks.md, "Code
/// placement"), and function alignment (`.cargo/config.toml`) does not reach
/// code written in assembly: each entry's section holds the alignment beside the
/// code, which sits at the section's start. `tests/preload.rs` checks where they
/// start.
macro_rules! naked_entries {
    ($( $(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $code:ident; )*) => {$(
        $(#[$attr])*
        #[unsafe(naked)]
        #[link_section = concat!(".text.memquota.", stringify!($name))]
        $vis unsafe extern "C" fn $name($($arg: $ty),*) $(-> $ret)? {
            $code!()
        }
        std::arch::global_asm!(concat!(
            ".pushsection .text.memquota.", stringify!($name), ",\"ax\",@progbits\n",
            ".balign 64\n",
            ".popsection",
        ));
    )*};
}

naked_entries! {
    /// `malloc` for the library's own callers.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    pub(crate) fn alloc(_n: size_t) -> *mut c_void = malloc_code;
    /// `free` for the library's own callers.
    ///
    /// # Safety
    /// `p` is null, or a live block of this allocator (from the malloc family or C++
    /// `new`) not given back since; it is not used after.
    pub(crate) fn release(_p: *mut c_void) = free_code;
    /// C's `malloc`.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    #[cfg_attr(not(test), no_mangle)]
    pub fn malloc(_n: size_t) -> *mut c_void = malloc_code;
    /// glibc's internal `malloc`.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    #[cfg_attr(not(test), no_mangle)]
    pub fn __libc_malloc(_n: size_t) -> *mut c_void = malloc_code;
    /// C's `free`.
    ///
    /// # Safety
    /// `p` is null, or a live block of this allocator not given back since; it is not
    /// used after.
    #[cfg_attr(not(test), no_mangle)]
    pub fn free(_p: *mut c_void) = free_code;
    /// The old name of `free`.
    ///
    /// # Safety
    /// As `free`: `p` is null, or a live block of this allocator not given back since;
    /// it is not used after.
    #[cfg_attr(not(test), no_mangle)]
    pub fn cfree(_p: *mut c_void) = free_code;
    /// glibc's internal `free`.
    ///
    /// # Safety
    /// As `free`: `p` is null, or a live block of this allocator not given back since;
    /// it is not used after.
    #[cfg_attr(not(test), no_mangle)]
    pub fn __libc_free(_p: *mut c_void) = free_code;
    /// C23: the size is a hint; the real size comes from jemalloc.
    ///
    /// # Safety
    /// `p` is null, or a live block of this allocator not given back since; it is not
    /// used after. The size is not relied on.
    #[cfg_attr(not(test), no_mangle)]
    pub fn free_sized(_p: *mut c_void, _size: size_t) = free_code;
    /// C23: as `free_sized`.
    ///
    /// # Safety
    /// `p` is null, or a live block of this allocator not given back since; it is not
    /// used after. The size and alignment are not relied on.
    #[cfg_attr(not(test), no_mangle)]
    pub fn free_aligned_sized(_p: *mut c_void, _align: size_t, _size: size_t) = free_code;
}

export! {
    /// C's `calloc`.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    fn calloc(count: size_t, size: size_t) -> *mut c_void = zeroed(count, size);
    /// glibc's internal `calloc`.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    fn __libc_calloc(count: size_t, size: size_t) -> *mut c_void = zeroed(count, size);
    /// C's `realloc`.
    ///
    /// # Safety
    /// `p` is null, or a live block of this allocator not given back since. Unless this
    /// returns null with `n > 0`, `p` is given back and not used after.
    fn realloc(p: *mut c_void, n: size_t) -> *mut c_void = {
        // SAFETY: realloc's contract is resize's.
        unsafe { resize(p, n) }
    };
    /// glibc's internal `realloc`.
    ///
    /// # Safety
    /// As `realloc`: `p` is null, or a live block of this allocator not given back
    /// since. Unless this returns null with `n > 0`, `p` is given back and not used after.
    fn __libc_realloc(p: *mut c_void, n: size_t) -> *mut c_void = {
        // SAFETY: __libc_realloc's contract is resize's.
        unsafe { resize(p, n) }
    };
    /// `realloc` of `count * size` bytes, failing with ENOMEM if that overflows.
    ///
    /// # Safety
    /// `p` is null, or a live block of this allocator not given back since. Unless this
    /// returns null with a non-zero size, `p` is given back and not used after.
    fn reallocarray(p: *mut c_void, count: size_t, size: size_t) -> *mut c_void = match count.checked_mul(size) {
        Some(n) => {
            // SAFETY: reallocarray's contract is resize's, for the product `n`.
            unsafe { resize(p, n) }
        }
        None => enomem(),
    };
    /// POSIX's `posix_memalign`.
    ///
    /// # Safety
    /// `out` is valid for a write of one pointer. The block goes back only to this
    /// allocator.
    fn posix_memalign(out: *mut *mut c_void, align: size_t, n: size_t) -> c_int = {
        // SAFETY: posix_memalign's contract is aligned_into's.
        unsafe { aligned_into(out, align, n) }
    };
    /// glibc's internal `posix_memalign`.
    ///
    /// # Safety
    /// As `posix_memalign`: `out` is valid for a write of one pointer. The block goes
    /// back only to this allocator.
    fn __posix_memalign(out: *mut *mut c_void, align: size_t, n: size_t) -> c_int = {
        // SAFETY: __posix_memalign's contract is aligned_into's.
        unsafe { aligned_into(out, align, n) }
    };
    /// C's `aligned_alloc`: EINVAL unless the alignment is a power of two.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    fn aligned_alloc(align: size_t, n: size_t) -> *mut c_void = if align.is_power_of_two() {
        alloc_aligned(align, n)
    } else {
        set_errno(libc::EINVAL);
        null_mut()
    };
    /// glibc's `memalign`.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    fn memalign(align: size_t, n: size_t) -> *mut c_void = memalign_glibc(align, n);
    /// glibc's internal `memalign`.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    fn __libc_memalign(align: size_t, n: size_t) -> *mut c_void = memalign_glibc(align, n);
    /// `valloc`: page-aligned.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    fn valloc(n: size_t) -> *mut c_void = alloc_aligned(PAGE, n);
    /// glibc's internal `valloc`.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    fn __libc_valloc(n: size_t) -> *mut c_void = alloc_aligned(PAGE, n);
    /// `pvalloc`: page-aligned, the size rounded up to whole pages.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    fn pvalloc(n: size_t) -> *mut c_void = pvalloc_pages(n);
    /// glibc's internal `pvalloc`.
    ///
    /// # Safety
    /// None for the call. The block goes back only to this allocator.
    fn __libc_pvalloc(n: size_t) -> *mut c_void = pvalloc_pages(n);
    /// The usable size of a block; 0 for null.
    ///
    /// # Safety
    /// `p` is null, or a live block of this allocator.
    fn malloc_usable_size(p: *mut c_void) -> size_t = if p.is_null() {
        0
    } else {
        // SAFETY: `p` is non-null here, so a live jemalloc block (malloc_usable_size's
        // contract).
        unsafe { jem::sallocx(p, 0) }
    };
    /// Accepted and ignored: jemalloc has no glibc tunables. Returns 1 (success).
    ///
    /// # Safety
    /// None.
    fn mallopt(_param: c_int, _value: c_int) -> c_int = 1;
    /// Purges jemalloc's unused dirty pages in every arena. Returns 1.
    ///
    /// # Safety
    /// None.
    fn malloc_trim(_pad: size_t) -> c_int = {
        // SAFETY: a NUL-terminated mallctl name with no input or output.
        unsafe {
            jem::mallctl(c"arena.4096.purge".as_ptr(), null_mut(), null_mut(), null_mut(), 0);
        }
        1
    };
    /// glibc's statistics, from jemalloc's, clamped to `int`.
    ///
    /// # Safety
    /// None.
    fn mallinfo() -> libc::mallinfo = {
        let j = memquota_core::JemallocStats::read();
        let clamp = |v: u64| v.min(i32::MAX as u64) as c_int;
        // SAFETY: mallinfo is a plain C struct of ints; zero is a valid value.
        let mut m: libc::mallinfo = unsafe { std::mem::zeroed() };
        m.arena = clamp(j.mapped);
        m.uordblks = clamp(j.allocated);
        m.fordblks = clamp(j.active.saturating_sub(j.allocated));
        m.keepcost = clamp(j.retained);
        m
    };
    /// glibc's statistics, from jemalloc's.
    ///
    /// # Safety
    /// None.
    fn mallinfo2() -> libc::mallinfo2 = {
        let j = memquota_core::JemallocStats::read();
        // SAFETY: mallinfo2 is a plain C struct of size_t; zero is a valid value.
        let mut m: libc::mallinfo2 = unsafe { std::mem::zeroed() };
        m.arena = j.mapped as usize;
        m.uordblks = j.allocated as usize;
        m.fordblks = j.active.saturating_sub(j.allocated) as usize;
        m.keepcost = j.retained as usize;
        m
    };
    /// jemalloc's statistics on standard error.
    ///
    /// # Safety
    /// None.
    fn malloc_stats() -> () = {
        // SAFETY: null callback and options: jemalloc writes to stderr.
        unsafe { jem::malloc_stats_print(None, null_mut(), std::ptr::null()) }
    };
    /// A minimal document naming the allocator; returns 0.
    ///
    /// # Safety
    /// `stream` is null or an open `FILE`.
    fn malloc_info(_options: c_int, stream: *mut libc::FILE) -> c_int = {
        if !stream.is_null() {
            // SAFETY: `stream` is non-null here, so an open FILE (malloc_info's
            // contract); the string is NUL-terminated.
            unsafe { libc::fputs(c"<malloc version=\"jemalloc-memquota\"></malloc>\n".as_ptr(), stream) };
        }
        0
    };
}

/// `posix_memalign`.
///
/// # Safety
/// `out` is valid for a write of one pointer (it is written only on success).
unsafe fn aligned_into(out: *mut *mut c_void, align: size_t, n: size_t) -> c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<*mut c_void>()) {
        return libc::EINVAL;
    }
    let saved = errno();
    let p = alloc_aligned(align, n);
    set_errno(saved); // posix_memalign reports through its return value only
    if p.is_null() {
        return libc::ENOMEM;
    }
    // SAFETY: `out` is valid for this write (this function's contract).
    unsafe { *out = p };
    0
}

/// For the C++ operators: allocate, or null.
pub(crate) fn cxx_alloc(n: size_t, align: Option<size_t>) -> *mut c_void {
    match align {
        Some(a) if a > 16 => alloc_aligned(a, n),
        // SAFETY: no precondition.
        _ => unsafe { alloc(n) },
    }
}

/// For the C++ `delete` operators.
///
/// # Safety
/// `p` is null, or a live block of this allocator (from C++ `new` or the malloc
/// family) not given back since; it is not used after.
pub(crate) unsafe fn cxx_free(p: *mut c_void) {
    // SAFETY: this function's contract is release's.
    unsafe { release(p) }
}
