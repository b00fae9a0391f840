//! The native methods of `org.memquota.MemQuota` (bindings/java/org/memquota/MemQuota.java).

#![allow(non_snake_case)] // JNI names the functions after the Java class.

use crate::malloc::charge::FACE;
use jni::objects::{JClass, JString};
use jni::sys::{jboolean, jint, jlong, jstring};
use jni::JNIEnv;
use memquota_core::seam::{
    scopes::{self, Rollback},
    slow,
};
use memquota_core::Error;

/// `MemQuota.statsJson()`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_statsJson(env: JNIEnv, _: JClass) -> jstring {
    slow::flush_thread(&FACE);
    let mut json = String::with_capacity(2048);
    let _ = memquota_core::write_json(&mut json, &memquota_core::stats());
    env.new_string(json).map_or(std::ptr::null_mut(), |s| s.into_raw())
}

/// `MemQuota.limit()`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_limit(_: JNIEnv, _: JClass) -> jlong {
    jlong::try_from(memquota_core::stats().limit).unwrap_or(jlong::MAX)
}

/// `MemQuota.setLimit0(long)`; the Java side has checked the value.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_setLimit0(_: JNIEnv, _: JClass, bytes: jlong) {
    memquota_core::set_limit(u64::try_from(bytes).unwrap_or(1));
}

/// `MemQuota.flush()`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_flush(_: JNIEnv, _: JClass) {
    slow::flush_thread(&FACE);
}

/// `MemQuota.gcCount()`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_gcCount(_: JNIEnv, _: JClass) -> jlong {
    jlong::try_from(memquota_core::jvm::gcs()).unwrap_or(jlong::MAX)
}

/// Throws `class` with `message` (a pending exception is left as it is).
fn throw(env: &mut JNIEnv, class: &str, message: &str) {
    if !env.exception_check().unwrap_or(true) {
        let _ = env.throw_new(class, message);
    }
}

/// `MemQuota.scopeBegin(String, long, int)`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_scopeBegin(
    mut env: JNIEnv,
    _: JClass,
    name: JString,
    id: jlong,
    priority: jint,
) -> jlong {
    let name: String = if name.is_null() {
        String::new()
    } else {
        match env.get_string(&name) {
            Ok(s) => s.into(),
            Err(_) => return 0, // the JVM has thrown
        }
    };
    match scopes::begin_raw(&name, id as u64, priority) {
        Ok(handle) => handle as jlong,
        Err(e) => {
            throw(&mut env, "java/lang/IllegalStateException", &e.to_string());
            0
        }
    }
}

/// `MemQuota.scopeEnd(long)`: the scope's report.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_scopeEnd(
    mut env: JNIEnv,
    _: JClass,
    scope: jlong,
) -> jstring {
    match scopes::end_raw(scope as u64) {
        Ok(report) => env.new_string(report.to_string()).map_or(std::ptr::null_mut(), |s| s.into_raw()),
        Err(e) => {
            throw(&mut env, "java/lang/IllegalArgumentException", &e.to_string());
            std::ptr::null_mut()
        }
    }
}

/// `MemQuota.scopeAttach(long)`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_scopeAttach(mut env: JNIEnv, _: JClass, scope: jlong) {
    if let Err(e) = scopes::attach_raw(&FACE, scope as u64) {
        throw(&mut env, "java/lang/IllegalArgumentException", &e.to_string());
    }
}

/// `MemQuota.scopeDetach()`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_scopeDetach(_: JNIEnv, _: JClass) {
    scopes::detach_raw(&FACE, 0);
}

/// `MemQuota.scopeReserve(long, long, boolean)`: a refusal is an `OutOfMemoryError`
/// carrying the report; in a retry block, the retry machine's decisions are
/// `RetryOOM` and `SplitAndRetryOOM`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_scopeReserve(
    mut env: JNIEnv,
    _: JClass,
    scope: jlong,
    bytes: jlong,
    partial: jboolean,
) -> jlong {
    let Ok(bytes) = u64::try_from(bytes) else {
        throw(&mut env, "java/lang/IllegalArgumentException", "memquota: a reservation cannot be negative");
        return 0;
    };
    match scopes::reserve_raw(&FACE, scope as u64, bytes, 0, partial != 0) {
        Ok(granted) => jlong::try_from(granted).unwrap_or(jlong::MAX),
        Err(Error::Refused { .. }) => {
            crate::jvm::gate::throw_refusal(&mut env);
            0
        }
        Err(Error::RetryOom) => {
            crate::jvm::gate::throw_rollback(&mut env, Rollback::Retry);
            0
        }
        Err(Error::SplitAndRetryOom) => {
            crate::jvm::gate::throw_rollback(&mut env, Rollback::Split);
            0
        }
        Err(e @ Error::ReserveInSpill { .. }) => {
            throw(&mut env, "java/lang/IllegalStateException", &e.to_string());
            0
        }
        Err(e) => {
            throw(&mut env, "java/lang/IllegalArgumentException", &e.to_string());
            0
        }
    }
}

/// `MemQuota.scopeRelease(long, long)`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_scopeRelease(
    _: JNIEnv,
    _: JClass,
    scope: jlong,
    bytes: jlong,
) {
    scopes::release_raw(scope as u64, u64::try_from(bytes).unwrap_or(0), 0);
}

// ---- retry blocks: the primitives of `MemQuota.withRetry` / `withSplitRetry` ------

/// `MemQuota.retryBegin(long)`: `memquota_retry_begin`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_retryBegin(mut env: JNIEnv, _: JClass, scope: jlong) {
    if !crate::jvm::gate::remember_retry_classes(&mut env) {
        return; // NoClassDefFoundError: no block begins
    }
    match crate::capi::memquota_retry_begin(scope as u64) {
        0 => {}
        e if e == -libc::EOVERFLOW => throw(
            &mut env,
            "java/lang/IllegalStateException",
            "memquota: retry blocks nested too deep on this thread",
        ),
        _ => throw(&mut env, "java/lang/IllegalArgumentException", &Error::ScopeEnded.to_string()),
    }
}

/// `MemQuota.retryEnd()`: `memquota_retry_end`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_retryEnd(mut env: JNIEnv, _: JClass) {
    if crate::capi::memquota_retry_end() != 0 {
        throw(&mut env, "java/lang/IllegalStateException", NOT_IN_A_BLOCK);
    }
}

/// `MemQuota.retryBlock()`: `memquota_retry_block`; false: give up. The block's scope
/// ended: `IllegalStateException`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_retryBlock(mut env: JNIEnv, _: JClass) -> jboolean {
    match crate::capi::memquota_retry_block() {
        0 => 1,
        e if e == -libc::EPERM => {
            throw(&mut env, "java/lang/IllegalStateException", NOT_IN_A_BLOCK);
            0
        }
        e if e == -libc::EINVAL => {
            throw(&mut env, "java/lang/IllegalStateException", &Error::ScopeEnded.to_string());
            0
        }
        _ => 0,
    }
}

/// `MemQuota.lastRefusal()`: `memquota_last_refusal`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_lastRefusal(_: JNIEnv, _: JClass) -> jint {
    crate::capi::memquota_last_refusal()
}

const NOT_IN_A_BLOCK: &str = "memquota: this thread is in no retry block";
