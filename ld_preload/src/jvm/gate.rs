//! The JVM's gate: `jdk.internal.misc.Unsafe.allocateMemory0` and
//! `reallocateMemory0`, the natives under `ByteBuffer.allocateDirect` and
//! `Unsafe.allocateMemory` (Spark's off-heap pages), replaced as the JVM binds them.
//!
//! The gate runs where waiting is safe: the thread has called a native method, so it
//! is in native state and a GC's safepoint does not wait for it. There it waits, if
//! need be, for the GC that makes room ([`slow::make_room`]); if room cannot be made
//! it throws `OutOfMemoryError` carrying the report, which callers of these methods
//! handle. The gate charges the request to the budget as it lets it through, so
//! gates on many threads cannot all pass on the same room; the malloc that follows
//! uses that charge up ([`slow::end_gate`] returns what it did not). Then the JVM's
//! own native runs, in VM state, and its malloc is counted
//! like every other: under [`Enforcement::Gates`](memquota_core::Enforcement) no
//! malloc waits or is refused, since one made in VM state could hold up a safepoint.
//!
//! On a thread in a retry block (`MemQuota.withRetry`) the gate's request takes part
//! in the retry machine: it blocks instead of failing, and when the machine rolls the
//! thread back or tells it to split, the gate throws `org.memquota.RetryOOM` or
//! `org.memquota.SplitAndRetryOOM` (both `OutOfMemoryError`s) instead of the plain
//! error.

use crate::malloc::charge::FACE;
use jni::objects::{GlobalRef, JClass};
use jni::sys::{jlong, jobject, JNIEnv};
use libc::c_void;
use memquota_core::seam::{
    scopes::{self, Rollback},
    slow,
};
use memquota_core::Error;
use std::sync::atomic::{AtomicPtr, Ordering::*};
use std::sync::OnceLock;
use tikv_jemalloc_sys as jem;

type Allocate = unsafe extern "system" fn(*mut JNIEnv, jobject, jlong) -> jlong;
type Reallocate = unsafe extern "system" fn(*mut JNIEnv, jobject, jlong, jlong) -> jlong;

/// The JVM's own natives, saved when the gates replaced them.
static ALLOCATE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static REALLOCATE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// The gate for `Unsafe`'s native `name`, saving `original`; `None` for methods
/// that allocate nothing.
pub(crate) fn gate_for(name: &str, original: *mut c_void) -> Option<*mut c_void> {
    let (saved, gate) = match name {
        "allocateMemory0" => (&ALLOCATE, allocate_memory0 as Allocate as *mut c_void),
        "reallocateMemory0" => (&REALLOCATE, reallocate_memory0 as Reallocate as *mut c_void),
        _ => return None,
    };
    saved.store(original, Release);
    Some(gate)
}

/// Whether `allocateMemory0` is gated.
pub(crate) fn installed() -> bool {
    !ALLOCATE.load(Acquire).is_null()
}

/// The gate bound in place of `Unsafe.allocateMemory0`.
///
/// # Safety
/// Called only by the JVM, as that native: `env` is the calling thread's live JNIEnv
/// and `unsafe_` the receiver, and `gate_for` saved the original native first.
unsafe extern "system" fn allocate_memory0(env: *mut JNIEnv, unsafe_: jobject, bytes: jlong) -> jlong {
    if bytes > 0 && !slow::make_room(&FACE, bytes as u64) {
        // SAFETY: `env` is the calling thread's live JNIEnv (this function's contract).
        unsafe { throw_oom(env) };
        return 0;
    }
    // SAFETY: ALLOCATE holds the JVM's native of this very signature: this gate is
    // only bound after `gate_for` saved it (this function's contract).
    let original: Allocate = unsafe { std::mem::transmute::<*mut c_void, Allocate>(ALLOCATE.load(Acquire)) };
    // SAFETY: forwarding the JVM's own arguments (this function's contract) to its own
    // native.
    let address = unsafe { original(env, unsafe_, bytes) };
    slow::end_gate(&FACE);
    address
}

/// The gate bound in place of `Unsafe.reallocateMemory0`.
///
/// # Safety
/// Called only by the JVM, as that native: `env` is the calling thread's live JNIEnv,
/// `unsafe_` the receiver, `address` 0 or a live block `allocateMemory0` returned, and
/// `gate_for` saved the original native first.
unsafe extern "system" fn reallocate_memory0(
    env: *mut JNIEnv,
    unsafe_: jobject,
    address: jlong,
    bytes: jlong,
) -> jlong {
    let old = if address == 0 {
        0
    } else {
        // SAFETY: a non-zero `address` is a live block Unsafe's allocateMemory returned,
        // so one of this allocator's (this function's contract).
        unsafe { jem::malloc_usable_size(address as usize as *const c_void) }
    };
    let growth = u64::try_from(bytes).unwrap_or(0).saturating_sub(old as u64);
    if growth > 0 && !slow::make_room(&FACE, growth) {
        // SAFETY: `env` is the calling thread's live JNIEnv (this function's contract).
        unsafe { throw_oom(env) };
        return 0;
    }
    // SAFETY: REALLOCATE holds the JVM's native of this very signature: this gate is
    // only bound after `gate_for` saved it (this function's contract).
    let original: Reallocate =
        unsafe { std::mem::transmute::<*mut c_void, Reallocate>(REALLOCATE.load(Acquire)) };
    // SAFETY: forwarding the JVM's own arguments (this function's contract) to its own
    // native.
    let moved = unsafe { original(env, unsafe_, address, bytes) };
    slow::end_gate(&FACE);
    moved
}

/// Throws what a refused gate throws: `RetryOOM` or `SplitAndRetryOOM` when the
/// retry machine chose the thread, else `java.lang.OutOfMemoryError` with the
/// refusal's report as its message.
///
/// # Safety
/// `env` is the calling thread's live JNIEnv.
unsafe fn throw_oom(env: *mut JNIEnv) {
    // SAFETY: the caller's contract.
    if let Ok(mut env) = unsafe { jni::JNIEnv::from_raw(env) } {
        match scopes::last_refusal_raw(&FACE) {
            Some(r) => throw_rollback(&mut env, r),
            None => throw_refusal(&mut env),
        }
    }
}

/// `org.memquota.RetryOOM` and `SplitAndRetryOOM`, found by `MemQuota`'s first
/// `retryBegin`. The gate cannot look them up itself: a native's `FindClass` uses
/// the loader of the class that declares it, and `Unsafe`'s is the boot loader,
/// which does not see the application's classes.
static RETRY_CLASSES: OnceLock<[GlobalRef; 2]> = OnceLock::new();

/// Finds and keeps the retry errors' classes (from a native of `MemQuota`, whose
/// loader sees them). False if one cannot be found: its `NoClassDefFoundError` is
/// pending.
pub(crate) fn remember_retry_classes(env: &mut jni::JNIEnv) -> bool {
    if RETRY_CLASSES.get().is_some() {
        return true;
    }
    let mut global = |name: &str| -> Option<GlobalRef> {
        let class = env.find_class(name).ok()?;
        env.new_global_ref(class).ok()
    };
    let Some(retry) = global("org/memquota/RetryOOM") else { return false };
    let Some(split) = global("org/memquota/SplitAndRetryOOM") else { return false };
    let _ = RETRY_CLASSES.set([retry, split]);
    true
}

/// Throws `org.memquota.RetryOOM` or `SplitAndRetryOOM` for the retry machine's
/// decision `r` (a plain `OutOfMemoryError` with the same message if their classes
/// were never found); for a request whose scope ended while it waited, a plain
/// `OutOfMemoryError` that says so (not a rollback: the attempt must not run again).
pub(crate) fn throw_rollback(env: &mut jni::JNIEnv, r: Rollback) {
    let (k, message) = match r {
        Rollback::Retry => (Some(0), Error::RetryOom.to_string()),
        Rollback::Split => (Some(1), Error::SplitAndRetryOom.to_string()),
        Rollback::Ended => (None, Error::ScopeEnded.to_string()),
    };
    let _ = match k.and_then(|k| RETRY_CLASSES.get().map(|classes| &classes[k])) {
        Some(class) => {
            let class: &JClass = class.as_obj().into();
            env.throw_new(class, &message)
        }
        None => env.throw_new("java/lang/OutOfMemoryError", &message),
    };
}

/// Throws `java.lang.OutOfMemoryError` carrying the last refusal's report: how a
/// refusal at any of our JNI entry points reaches Java.
pub(crate) fn throw_refusal(env: &mut jni::JNIEnv) {
    let report = memquota_core::last_report().unwrap_or_else(|| "memquota: allocation refused".into());
    let _ = env.throw_new("java/lang/OutOfMemoryError", report.trim_end());
}
