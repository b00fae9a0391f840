//! The native methods of `org.memquota.MemQuota` (java/org/memquota/MemQuota.java).

#![allow(non_snake_case)] // JNI names the functions after the Java class.

use crate::tls::FACE;
use jni::objects::JClass;
use jni::sys::{jlong, jstring};
use jni::JNIEnv;
use memquota_core::face;

/// `MemQuota.statsJson()`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_statsJson(env: JNIEnv, _: JClass) -> jstring {
    face::flush_thread(&FACE);
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
    face::flush_thread(&FACE);
}

/// `MemQuota.gcCount()`.
#[cfg_attr(not(test), no_mangle)]
pub extern "system" fn Java_org_memquota_MemQuota_gcCount(_: JNIEnv, _: JClass) -> jlong {
    jlong::try_from(memquota_core::jvm::gcs()).unwrap_or(jlong::MAX)
}
