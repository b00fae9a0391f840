//! The `memquota_*` C ABI, declared in `include/memquota.h`.

use crate::tls::FACE;
use libc::{c_char, c_int, c_void, size_t};
use memquota_core::{face, HeapBytes, SliceWriter};

/// Writes the stats as one JSON object into `buf` (NUL-terminated, cut to `len`), like
/// `snprintf`. Returns the length of the whole text, without the NUL: a return value
/// `>= len` means the text was cut. The calling thread's delta is flushed first.
///
/// # Safety
/// `buf` is null with `len` 0, or valid for `len` bytes.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn memquota_stats_json(buf: *mut c_char, len: size_t) -> size_t {
    face::flush_thread(&FACE);
    let stats = memquota_core::stats();
    let out: &mut [u8] = if buf.is_null() || len == 0 {
        &mut []
    } else {
        // SAFETY: the caller's contract; the last byte is kept for the NUL.
        unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) }
    };
    let room = out.len().saturating_sub(1);
    let mut w = SliceWriter::new(&mut out[..room]);
    let _ = memquota_core::write_json(&mut w, &stats);
    let full = w.len();
    if !out.is_empty() {
        out[full.min(room)] = 0;
    }
    full
}

/// Sets the heap figures that count against the budget (from a JVM, say).
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn memquota_set_heap_bytes(committed: u64, used: u64) {
    memquota_core::set_heap_bytes(HeapBytes { committed, used });
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
    face::flush_thread(&FACE);
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
// SAFETY: as above.
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
