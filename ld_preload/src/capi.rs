//! The `memquota_*` C ABI, declared in `include/memquota.h`.

use crate::malloc::charge::FACE;
use crate::malloc::thread;
use libc::{c_char, c_int, c_void, size_t};
use memquota_core::seam::{
    scopes::{self, Rollback},
    slow,
    text::SliceWriter,
};
use memquota_core::{Error, HeapBytes};
use std::ffi::CStr;
use std::fmt::Write;

/// Writes the stats as one JSON object into `buf` (NUL-terminated, cut to `len`), like
/// `snprintf`. Returns the length of the whole text, without the NUL: a return value
/// `>= len` means the text was cut. The calling thread's delta is flushed first.
///
/// # Safety
/// `buf` is null with `len` 0, or valid for `len` bytes.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memquota_stats_json(buf: *mut c_char, len: size_t) -> size_t {
    slow::flush_thread(&FACE);
    let stats = memquota_core::stats();
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        write_whole(buf, len, |w| {
            let _ = memquota_core::write_json(w, &stats);
        })
    }
}

/// Writes `text` into `buf` like `snprintf`, the caller's contract being that of
/// [`memquota_stats_json`]. Returns the length of the whole text.
///
/// # Safety
/// `buf` is null with `len` 0, or valid for `len` bytes.
unsafe fn write_whole(buf: *mut c_char, len: size_t, text: impl FnOnce(&mut SliceWriter<'_>)) -> size_t {
    let out: &mut [u8] = if buf.is_null() || len == 0 {
        &mut []
    } else {
        // SAFETY: the caller's contract; the last byte is kept for the NUL.
        unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) }
    };
    let room = out.len().saturating_sub(1);
    let mut w = SliceWriter::new(&mut out[..room]);
    text(&mut w);
    let full = w.len();
    if !out.is_empty() {
        out[full.min(room)] = 0;
    }
    full
}

/// Writes the live task scopes and the scope manager's totals as one JSON object
/// (`"scopes"`: an array with each scope's name, id and figures) into `buf`, like
/// [`memquota_stats_json`]. The calling thread's delta is flushed first.
///
/// # Safety
/// `buf` is null with `len` 0, or valid for `len` bytes.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memquota_scopes_json(buf: *mut c_char, len: size_t) -> size_t {
    slow::flush_thread(&FACE);
    let snap = memquota_core::MemoryManager::global().snapshot();
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        write_whole(buf, len, |w| {
            let _ = memquota_core::write_scopes_json(w, &snap);
        })
    }
}

/// Writes the figures an OOM report shows, as they are now (limit, native and heap,
/// reclaims, scopes, jemalloc's view), into `buf` like [`memquota_stats_json`]. Not a
/// refusal: nothing is counted.
///
/// # Safety
/// `buf` is null with `len` 0, or valid for `len` bytes.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memquota_report_now(buf: *mut c_char, len: size_t) -> size_t {
    slow::flush_thread(&FACE);
    let text = memquota_core::report_now();
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        write_whole(buf, len, |w| {
            let _ = w.write_str(&text);
        })
    }
}

/// A reclaim callback for `memquota_on_reclaim` that only signals: it writes `need`
/// as one native-endian `uint64_t` to the file descriptor `ctx` (an eventfd, or the
/// non-blocking write end of a pipe) and returns. A runtime whose reclaim must run on
/// a thread of its own (Python's, which needs the interpreter lock that the
/// allocating thread may hold) waits on the other end. A full pipe drops the
/// signal: one already waits there.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_notify_fd(need: size_t, ctx: *mut c_void) {
    let fd = ctx as usize as c_int;
    let bytes = (need as u64).to_ne_bytes();
    // SAFETY: `bytes` is valid for its length; a bad descriptor only fails the write.
    let _ = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
}

/// Sets the heap figures that count against the budget (from a JVM, say).
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_set_heap_bytes(committed: u64, used: u64) {
    memquota_core::set_heap_bytes(HeapBytes::new(committed, used));
}

/// Sets the limit in bytes. Returns 0, or `EINVAL` for 0.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_set_limit(bytes: u64) -> c_int {
    if bytes == 0 {
        return libc::EINVAL;
    }
    memquota_core::set_limit(bytes);
    0
}

/// Flushes the calling thread's unflushed delta.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_flush() {
    slow::flush_thread(&FACE);
}

/// A C reclaim callback and its context.
pub type ReclaimCallback = unsafe extern "C" fn(need: size_t, ctx: *mut c_void);

struct Registered {
    callback: ReclaimCallback,
    ctx: *mut c_void,
}

// SAFETY: the C caller registers a callback and context that may be used from any
// thread (the header says so); we only pass the pointer back.
unsafe impl Send for Registered {}
// SAFETY: shared references to it only read the two fields and pass them back to C,
// and the C caller made them safe to use from any thread (the header says so).
unsafe impl Sync for Registered {}

/// Registers the reclaim callback, called with the bytes wanted and `ctx`, from the
/// allocating thread or the background reclaim thread, never twice at once. NULL
/// unregisters.
///
/// # Safety
/// `callback` and `ctx` must be usable from any thread until replaced.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memquota_on_reclaim(callback: Option<ReclaimCallback>, ctx: *mut c_void) {
    match callback {
        None => memquota_core::clear_reclaim(),
        Some(callback) => {
            let r = Registered { callback, ctx };
            memquota_core::on_reclaim(move |need| {
                let r = &r;
                // SAFETY: the registrant's contract.
                unsafe { (r.callback)(need, r.ctx) }
            });
        }
    }
}

/// Writes `text` into `buf` like `snprintf` (cut, NUL-terminated when `len > 0`).
///
/// # Safety
/// `buf` is null with `len` 0, or valid for `len` bytes.
unsafe fn write_c(buf: *mut c_char, len: size_t, text: impl std::fmt::Display) {
    if buf.is_null() || len == 0 {
        return;
    }
    // SAFETY: the caller's contract.
    let out = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) };
    let room = len - 1;
    let mut w = SliceWriter::new(&mut out[..room]);
    let _ = write!(w, "{text}");
    let end = w.len().min(room);
    out[end] = 0;
}

/// Begins a scope (a task) named `name` (may be null) with an id and a priority
/// (lower is spilled first by other scopes). Returns its handle, or 0 if too many
/// scopes are alive.
///
/// # Safety
/// `name` is null or a NUL-terminated string.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memquota_scope_begin(name: *const c_char, id: u64, priority: i32) -> u64 {
    let name = if name.is_null() {
        ""
    } else {
        // SAFETY: the caller's contract.
        unsafe { CStr::from_ptr(name) }.to_str().unwrap_or("")
    };
    scopes::begin_raw(name, id, priority).unwrap_or(0)
}

/// Ends a scope. Returns the bytes its threads allocated and nobody freed (a leak,
/// now counted for the process), or `-EINVAL` for a scope that is not running. The
/// report (what it still held and reserved, attached threads, consumers) is written
/// into `report` like `snprintf`.
///
/// # Safety
/// `report` is null with `len` 0, or valid for `len` bytes.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memquota_scope_end(scope: u64, report: *mut c_char, len: size_t) -> i64 {
    match scopes::end_raw(scope) {
        Ok(r) => {
            // SAFETY: the caller's contract.
            unsafe { write_c(report, len, &r) };
            i64::try_from(r.leaked_bytes).unwrap_or(i64::MAX)
        }
        Err(_) => -i64::from(libc::EINVAL),
    }
}

/// Attaches the calling thread to a scope: its allocations are charged to it until
/// `memquota_scope_detach`. Replaces any scope the thread was in. Returns 0, or
/// `EINVAL` for a scope that is not running.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_scope_attach(scope: u64) -> c_int {
    match scopes::attach_raw(&FACE, scope) {
        Ok(_) => 0,
        Err(_) => libc::EINVAL,
    }
}

/// Detaches the calling thread from its scope. Returns 0, or `EINVAL` if it was in
/// none.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_scope_detach() -> c_int {
    if scopes::detach_raw(&FACE, 0) != 0 {
        0
    } else {
        libc::EINVAL
    }
}

/// Reserves `bytes` for a scope; with `partial` non-zero, as much as its fair share
/// allows. May spill consumers and wait (bounded) for memory to be freed. Returns the
/// bytes granted, or `-ENOMEM` (refused, with an OOM report), `-EINVAL` (scope not
/// running), `-EDEADLK` (called from a spill or reclaim callback); in a retry block
/// it blocks instead of failing, and returns `-EAGAIN` when the retry machine rolled
/// the thread back, `-E2BIG` when it asks the thread to split its input, `-EINVAL`
/// at once when the scope ends while it waits.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_scope_reserve(scope: u64, bytes: u64, partial: c_int) -> i64 {
    match scopes::reserve_raw(&FACE, scope, bytes, 0, partial != 0) {
        Ok(granted) => i64::try_from(granted).unwrap_or(i64::MAX),
        Err(Error::ScopeEnded) => -i64::from(libc::EINVAL),
        Err(Error::ReserveInSpill { .. }) => -i64::from(libc::EDEADLK),
        Err(Error::RetryOom) => -i64::from(libc::EAGAIN),
        Err(Error::SplitAndRetryOom) => -i64::from(libc::E2BIG),
        Err(_) => -i64::from(libc::ENOMEM),
    }
}

// ---- retry blocks (docs/scopes.md, "Retry blocks") ---------------------------------

/// `memquota_last_refusal`: no rollback or split since the attempt began (a null
/// from malloc then was a plain refusal).
pub const MEMQUOTA_REFUSAL_NONE: c_int = 0;
/// `memquota_last_refusal`: rolled back; free what the attempt holds, call
/// `memquota_retry_block`, run the attempt again.
pub const MEMQUOTA_REFUSAL_ROLLBACK: c_int = 1;
/// `memquota_last_refusal`: split the input and process each piece.
pub const MEMQUOTA_REFUSAL_SPLIT: c_int = 2;
/// `memquota_last_refusal`: the block's scope ended while the request waited; the
/// attempt cannot go on (end the block).
pub const MEMQUOTA_REFUSAL_SCOPE_ENDED: c_int = 3;

/// Begins a retry block on the calling thread: attaches it to `scope` (until the
/// block ends) and enters the retry machine; blocks nest. Returns 0, `-EINVAL` (scope
/// not running), or `-EOVERFLOW` (blocks nested deeper than
/// [`thread::RETRY_MAX_DEPTH`]).
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_retry_begin(scope: u64) -> c_int {
    let nest = &thread::slot().retry;
    if nest.full() {
        return -libc::EOVERFLOW;
    }
    match scopes::retry_begin_raw(&FACE, scope) {
        Ok(prev) => {
            nest.push(prev);
            0
        }
        Err(_) => -libc::EINVAL,
    }
}

/// Ends the calling thread's innermost retry block: back to the scope it was
/// attached to when the block began. Returns 0, or `-EPERM` if it is in none.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_retry_end() -> c_int {
    match thread::slot().retry.pop() {
        Some(prev) => {
            scopes::retry_end_raw(&FACE, prev);
            0
        }
        None => -libc::EPERM,
    }
}

/// After a rollback (`-EAGAIN`, or a null with `MEMQUOTA_REFUSAL_ROLLBACK`), once the
/// attempt freed what it held: waits until the thread may run its attempt again (no
/// older task blocked, room for what it failed on). Returns 0 (at once if no rollback
/// is pending): run the attempt; `-ENOMEM`: the thread rolled back more than
/// `MEMQUOTA_MAX_RETRIES` times in its outermost block, give up; `-EINVAL`: the
/// block's scope ended (at once, also while the thread waits); `-EPERM`: the thread
/// is in no retry block.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_retry_block() -> c_int {
    if !thread::slot().retry.inside() {
        return -libc::EPERM;
    }
    match scopes::retry_block_raw(&FACE) {
        Ok(()) => 0,
        Err(Error::ScopeEnded) => -libc::EINVAL,
        Err(_) => -libc::ENOMEM,
    }
}

/// How the calling thread's last refusal in its retry block went:
/// [`MEMQUOTA_REFUSAL_ROLLBACK`], [`MEMQUOTA_REFUSAL_SPLIT`],
/// [`MEMQUOTA_REFUSAL_SCOPE_ENDED`], or [`MEMQUOTA_REFUSAL_NONE`]; `-EPERM` if it is
/// in no retry block.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_last_refusal() -> c_int {
    if !thread::slot().retry.inside() {
        return -libc::EPERM;
    }
    match scopes::last_refusal_raw(&FACE) {
        Some(Rollback::Retry) => MEMQUOTA_REFUSAL_ROLLBACK,
        Some(Rollback::Split) => MEMQUOTA_REFUSAL_SPLIT,
        Some(Rollback::Ended) => MEMQUOTA_REFUSAL_SCOPE_ENDED,
        None => MEMQUOTA_REFUSAL_NONE,
    }
}

/// Gives back `bytes` a scope reserved. Returns 0.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_scope_release(scope: u64, bytes: u64) -> c_int {
    scopes::release_raw(scope, bytes, 0);
    0
}
