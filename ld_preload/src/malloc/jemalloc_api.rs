//! jemalloc's own API, unprefixed, over memquota's jemalloc: a program linked with
//! `libjemalloc.so.2` (Redis is) reaches this jemalloc with every call, not only
//! `malloc` and `free`, and is charged for all of them in usable bytes, like the
//! malloc family.
//!
//! Without these, such a program's `mallocx`/`sdallocx` reached a second jemalloc
//! (the linked one) with blocks of the first: wrong `sallocx`, then a crash; its
//! `mallctl` read the idle second copy's statistics.
//!
//! * `mallocx`: charged like `malloc` (after, by jemalloc's per-thread total, under
//!   4 KiB with an alignment under 4 KiB; before, with `nallocx`, otherwise); the flags
//!   (alignment, zero, tcache, arena) go to jemalloc unchanged.
//! * `rallocx`: like `realloc`, the growth charged before, corrected after.
//! * `xallocx`: in place; the most it may grow to is charged before, the part it did
//!   not take is credited after, and a shrink is credited.
//! * `dallocx`, `sdallocx`: credited like `free`, by jemalloc's per-thread total.
//! * `sallocx`, `nallocx`: pure. `mallctl`, `mallctlnametomib`, `mallctlbymib`,
//!   `malloc_stats_print`: passed through, so statistics are this jemalloc's.
//!
//! jemalloc leaves a size of 0 undefined for `mallocx`, `rallocx` and `xallocx`; here
//! it is 1. `rallocx` of null is `mallocx`, `dallocx`/`sdallocx` of null do nothing.
//! A refusal is NULL (`mallocx`, `rallocx`, with `errno` ENOMEM) or no change
//! (`xallocx`), with the report, like any other.

use crate::malloc::charge::{alloc_flags, catch_up, charge, release_by, resize_by, GiveBack, Resize, FACE};
use crate::malloc::lazy;
use libc::{c_char, c_int, c_void, size_t};
use memquota_core::seam::{scopes, slow};
use tikv_jemalloc_sys as jem;

/// jemalloc's `mallocx`.
///
/// # Safety
/// The flags are valid for jemalloc's `mallocx`: an arena or tcache they name exists.
/// The block goes back only to this allocator.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mallocx(size: size_t, flags: c_int) -> *mut c_void {
    // SAFETY: a size of at least 1 and the caller's flags, valid (this function's contract).
    unsafe { alloc_flags(size.max(1), flags) }
}

/// jemalloc's `rallocx`: `realloc` with jemalloc's flags. Null on failure, `ptr` then
/// untouched.
///
/// # Safety
/// `ptr` is null or a live block of this allocator, not given back since; the flags are
/// valid for jemalloc's `rallocx`. Unless this returns null, `ptr` is given back and
/// not used after.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn rallocx(ptr: *mut c_void, size: size_t, flags: c_int) -> *mut c_void {
    if ptr.is_null() {
        // SAFETY: the caller's flags, valid for mallocx as for rallocx (this function's
        // contract).
        return unsafe { mallocx(size, flags) };
    }
    // SAFETY: `ptr` is a live block (this function's contract and non-null here), the
    // size at least 1, the caller's flags valid.
    unsafe { resize_by(ptr, size.max(1), Resize::Rallocx(flags)) }
}

/// jemalloc's `xallocx`: resizes `ptr` in place to at least `size` and at most
/// `size + extra` bytes if it can, and returns its usable size, changed or not.
///
/// The most it may become is charged before; what it did not take, or gave back,
/// is credited after. If the budget refuses that growth, the block is not resized
/// (the refusal is reported like any other) and its size is returned.
///
/// # Safety
/// `ptr` is a live block of this allocator, not given back since; the flags are valid
/// for jemalloc's `xallocx`.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn xallocx(ptr: *mut c_void, size: size_t, extra: size_t, flags: c_int) -> size_t {
    // SAFETY: `ptr` is a live jemalloc block (this function's contract).
    let old = unsafe { jem::sallocx(ptr, 0) };
    let size = size.max(1);
    // SAFETY: nallocx has no preconditions.
    let least = unsafe { jem::nallocx(size, flags) };
    if least == 0 {
        return old; // past jemalloc's largest class: jemalloc would not resize either
    }
    // SAFETY: nallocx has no preconditions.
    let most = size.checked_add(extra).map_or(0, |n| unsafe { jem::nallocx(n, flags) });
    // An extra past jemalloc's largest class is not asked for: it could not be charged.
    let (extra, most) = if most == 0 { (0, least) } else { (extra, most) };
    let big = old.max(most) as u64 >= scopes::OWNED_MIN;
    // A big block's owner record moves to the calling thread's scope, as for realloc.
    let had = match big {
        true => match scopes::note_realloc_begin(&FACE, ptr as usize, old as u64, most as u64) {
            Some(had) => had,
            None => return old, // the move to this thread's scope was refused
        },
        false => false,
    };
    let grow = most.saturating_sub(old);
    if grow > 0 && !charge(grow) {
        if had {
            scopes::note_realloc_end(&FACE, ptr as usize, 0, old as u64, 0, had);
        }
        return old;
    }
    // A resize in place moves jemalloc's total of freed bytes by the old size: credited
    // below (in `now - counted`), not in bulk.
    let s = crate::malloc::thread::slot();
    // SAFETY: `ptr` is a live jemalloc block, size >= 1, the caller's flags valid (this
    // function's contract).
    let now = lazy::guarded(s, || unsafe { jem::xallocx(ptr, size, extra, flags) });
    let counted = old + grow;
    if now != counted {
        slow::record(&FACE, now as i64 - counted as i64);
    }
    if big {
        scopes::note_realloc_end(&FACE, ptr as usize, ptr as usize, old as u64, now as u64, had);
    }
    catch_up(s);
    now
}

/// jemalloc's `sallocx`: the usable size of a block.
///
/// # Safety
/// `ptr` is a live block of this allocator.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn sallocx(ptr: *const c_void, flags: c_int) -> size_t {
    // SAFETY: a live jemalloc block (this function's contract).
    unsafe { jem::sallocx(ptr, flags) }
}

/// jemalloc's `dallocx`: `free` with jemalloc's flags (the tcache).
///
/// # Safety
/// `ptr` is null or a live block of this allocator, not given back since, and not used
/// after; the flags are valid for jemalloc's `dallocx`.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn dallocx(ptr: *mut c_void, flags: c_int) {
    // SAFETY: this function's contract is release_by's, for dallocx with these flags.
    unsafe { release_by(ptr, GiveBack::Dallocx(flags)) }
}

/// jemalloc's `sdallocx`: `free` with the block's size and jemalloc's flags.
///
/// # Safety
/// `ptr` is null or a live block of this allocator, not given back since, and not used
/// after; `size` and the flags describe it as jemalloc's `sdallocx` requires (a size
/// between the one asked for and the usable size, the same alignment).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn sdallocx(ptr: *mut c_void, size: size_t, flags: c_int) {
    // SAFETY: this function's contract is release_by's, for sdallocx with this size
    // and these flags.
    unsafe { release_by(ptr, GiveBack::Sdallocx(size, flags)) }
}

/// jemalloc's `nallocx`: the usable size `mallocx(size, flags)` would give; 0 if too
/// large.
///
/// # Safety
/// None.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn nallocx(size: size_t, flags: c_int) -> size_t {
    // SAFETY: nallocx has no preconditions (a size of 0 is made 1, as for mallocx).
    unsafe { jem::nallocx(size.max(1), flags) }
}

/// jemalloc's `mallctl`, on this jemalloc.
///
/// # Safety
/// jemalloc's: `name` is a NUL-terminated string; `oldp`/`oldlenp` and `newp`/`newlen`
/// are null or describe buffers of the type the control reads and writes.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mallctl(
    name: *const c_char,
    oldp: *mut c_void,
    oldlenp: *mut size_t,
    newp: *mut c_void,
    newlen: size_t,
) -> c_int {
    // SAFETY: passed on under the same contract (this function's).
    unsafe { jem::mallctl(name, oldp, oldlenp, newp, newlen) }
}

/// jemalloc's `mallctlnametomib`, on this jemalloc.
///
/// # Safety
/// jemalloc's: `name` is a NUL-terminated string, `mibp` has room for `*miblenp`
/// entries.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mallctlnametomib(
    name: *const c_char,
    mibp: *mut size_t,
    miblenp: *mut size_t,
) -> c_int {
    // SAFETY: passed on under the same contract (this function's).
    unsafe { jem::mallctlnametomib(name, mibp, miblenp) }
}

/// jemalloc's `mallctlbymib`, on this jemalloc.
///
/// # Safety
/// jemalloc's: `mib` holds `miblen` entries; the buffers as for `mallctl`.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mallctlbymib(
    mib: *const size_t,
    miblen: size_t,
    oldp: *mut c_void,
    oldlenp: *mut size_t,
    newp: *mut c_void,
    newlen: size_t,
) -> c_int {
    // SAFETY: passed on under the same contract (this function's).
    unsafe { jem::mallctlbymib(mib, miblen, oldp, oldlenp, newp, newlen) }
}

/// jemalloc's `malloc_stats_print`: this jemalloc's statistics, through `write_cb`
/// (stderr if null).
///
/// # Safety
/// jemalloc's: `write_cb` is null or may be called with `cbopaque` and a string;
/// `opts` is null or a NUL-terminated string.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn malloc_stats_print(
    write_cb: Option<unsafe extern "C" fn(*mut c_void, *const c_char)>,
    cbopaque: *mut c_void,
    opts: *const c_char,
) {
    // SAFETY: passed on under the same contract (this function's).
    unsafe { jem::malloc_stats_print(write_cb, cbopaque, opts) }
}
