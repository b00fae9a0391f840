//! A Rust JNI library with its own memquota budget, as DataFusion Comet would be:
//! `memquota::QuotaAlloc` is its global allocator and `JNI_OnLoad` hands the JVM to
//! `memquota::jvm::install`, so the JVM heap counts in the budget and a GC is the
//! reclaim. The natives are those of `JniDemo` (java/JniDemo.java); the tests in
//! tests/ drive it.

#![allow(non_snake_case)] // JNI names the functions after the Java class.

use jni::objects::JClass;
use jni::sys::{jint, jlong, jstring, JNI_ERR, JNI_VERSION_1_8};
use jni::{JNIEnv, JavaVM};
use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard};

#[global_allocator]
static GLOBAL: memquota::QuotaAlloc = memquota::QuotaAlloc::new();

/// The native memory Java asked for, held until `release()`.
static HELD: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn held() -> MutexGuard<'static, Vec<Vec<u8>>> {
    HELD.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts the JVM heap in this library's budget and makes the GC its reclaim.
///
/// # Safety
/// Called by the JVM with its `JavaVM` pointer.
#[no_mangle]
pub unsafe extern "system" fn JNI_OnLoad(vm: *mut jni::sys::JavaVM, _: *mut c_void) -> jint {
    // SAFETY: the JVM passes a valid JavaVM pointer to JNI_OnLoad.
    let Ok(vm) = (unsafe { JavaVM::from_raw(vm) }) else { return JNI_ERR };
    let Ok(mut env) = vm.get_env() else { return JNI_ERR };
    match memquota::jvm::install(&mut env) {
        Ok(()) => JNI_VERSION_1_8,
        Err(e) => {
            let _ = env.throw_new("java/lang/UnsatisfiedLinkError", e.to_string());
            JNI_ERR
        }
    }
}

/// `JniDemo.allocate(long)`: takes `bytes` of native memory and holds it. A refusal
/// by the budget throws `OutOfMemoryError` carrying the report.
#[no_mangle]
pub extern "system" fn Java_JniDemo_allocate(mut env: JNIEnv, _: JClass, bytes: jlong) {
    let Ok(bytes) = usize::try_from(bytes) else {
        let _ = env.throw_new("java/lang/IllegalArgumentException", "negative size");
        return;
    };
    let refusals = memquota::stats().ooms;
    let mut memory: Vec<u8> = Vec::new();
    match memory.try_reserve_exact(bytes) {
        Ok(()) => held().push(memory),
        Err(e) => {
            let report = match memquota::last_report() {
                Some(report) if memquota::stats().ooms > refusals => report,
                _ => format!("native allocation of {bytes} bytes failed: {e}"),
            };
            let _ = env.throw_new("java/lang/OutOfMemoryError", report);
        }
    }
}

/// `JniDemo.release()`: frees everything `allocate` holds.
#[no_mangle]
pub extern "system" fn Java_JniDemo_release(_: JNIEnv, _: JClass) {
    held().clear();
}

/// `JniDemo.statsJson()`: this library's budget as JSON.
#[no_mangle]
pub extern "system" fn Java_JniDemo_statsJson(env: JNIEnv, _: JClass) -> jstring {
    memquota::flush_thread();
    let mut json = String::with_capacity(2048);
    let _ = memquota::write_json(&mut json, &memquota::stats());
    env.new_string(json).map_or(std::ptr::null_mut(), |s| s.into_raw())
}

/// `JniDemo.gcCount()`: `System.gc()` calls made for the budget.
#[no_mangle]
pub extern "system" fn Java_JniDemo_gcCount(_: JNIEnv, _: JClass) -> jlong {
    jlong::try_from(memquota::jvm::gcs()).unwrap_or(jlong::MAX)
}

/// `JniDemo.syncReclaims()`: reclaims run for a request that did not fit.
#[no_mangle]
pub extern "system" fn Java_JniDemo_syncReclaims(_: JNIEnv, _: JClass) -> jlong {
    jlong::try_from(memquota::stats().reclaims_sync).unwrap_or(jlong::MAX)
}

/// `JniDemo.nativeBytes()`: this library's tracked native bytes, flushed first.
#[no_mangle]
pub extern "system" fn Java_JniDemo_nativeBytes(_: JNIEnv, _: JClass) -> jlong {
    memquota::flush_thread();
    jlong::try_from(memquota::stats().native).unwrap_or(jlong::MAX)
}

/// `JniDemo.setLimit(long)`; the Java side passes a positive value.
#[no_mangle]
pub extern "system" fn Java_JniDemo_setLimit(_: JNIEnv, _: JClass, bytes: jlong) {
    memquota::set_limit(u64::try_from(bytes).unwrap_or(1).max(1));
}

/// `JniDemo.pushHeap(long, long)`: the heap figures now, so that the next request
/// is judged against them and not against the driver's last poll.
#[no_mangle]
pub extern "system" fn Java_JniDemo_pushHeap(_: JNIEnv, _: JClass, committed: jlong, used: jlong) {
    let bytes = |v: jlong| u64::try_from(v).unwrap_or(0);
    memquota::set_heap_bytes(memquota::HeapBytes::new(bytes(committed), bytes(used)));
}
