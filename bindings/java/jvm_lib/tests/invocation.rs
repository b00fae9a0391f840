//! The library mode from Rust's side, through the `jni` crate's invocation API: this
//! test binary has `QuotaAlloc` as its global allocator, starts a JVM in its own
//! process, hands it to `memquota::jvm::install`, makes heap garbage, then asks for
//! native memory that fits only after a GC, and then for more than can ever fit.
//!
//! One JVM per process, ever: this is one binary with one test (`harness = false`).
//! libjvm is found through `JAVA_HOME` or, if that is unset, from the `java` on the
//! PATH with its symlinks resolved (`readlink -f $(which java)` is
//! `$JAVA_HOME/bin/java`); then `$JAVA_HOME/lib/server/libjvm.so`.

use jni::objects::JObject;
use jni::{InitArgsBuilder, JNIEnv, JNIVersion, JavaVM};
use memquota::HeapBytes;
use std::path::PathBuf;

#[global_allocator]
static GLOBAL: memquota::QuotaAlloc = memquota::QuotaAlloc::new();

const MIB: u64 = 1 << 20;
/// Below G1's humongous size: 1 MiB arrays would be humongous.
const CHUNK: i32 = 64 << 10;
/// 4096 chunks: 256 MiB of garbage.
const CHUNKS: i32 = 4096;
const HEADROOM: u64 = 64 * MIB;
const ASK: u64 = 128 * MIB;

fn java_home() -> PathBuf {
    if let Some(home) = std::env::var_os("JAVA_HOME") {
        return PathBuf::from(home);
    }
    let path = std::env::var_os("PATH").expect("PATH");
    let java = std::env::split_paths(&path)
        .map(|dir| dir.join("java"))
        .find(|p| p.is_file())
        .expect("no `java` on the PATH and JAVA_HOME unset (scripts/test.sh installs a JDK)");
    let real = std::fs::canonicalize(&java).expect("resolve the java symlinks");
    // <home>/bin/java
    real.parent().and_then(|bin| bin.parent()).expect("java is <home>/bin/java").to_path_buf()
}

/// The heap as the JVM reports it.
fn heap(env: &mut JNIEnv) -> HeapBytes {
    let rt = env
        .call_static_method("java/lang/Runtime", "getRuntime", "()Ljava/lang/Runtime;", &[])
        .and_then(|v| v.l())
        .expect("Runtime.getRuntime()");
    let total = env.call_method(&rt, "totalMemory", "()J", &[]).and_then(|v| v.j()).expect("totalMemory");
    let free = env.call_method(&rt, "freeMemory", "()J", &[]).and_then(|v| v.j()).expect("freeMemory");
    env.delete_local_ref(rt).expect("delete_local_ref");
    let committed = u64::try_from(total).expect("totalMemory >= 0");
    HeapBytes::new(committed, committed - u64::try_from(free).expect("freeMemory >= 0"))
}

/// Makes `CHUNKS` 64 KiB arrays, all live at once in one `byte[][]` so the heap must
/// commit room for them, then drops every reference: garbage, still committed.
fn make_garbage(env: &mut JNIEnv) {
    env.with_local_frame(4, |env| -> jni::errors::Result<()> {
        let all = env.new_object_array(CHUNKS, "[B", JObject::null())?;
        for i in 0..CHUNKS {
            env.with_local_frame(2, |env| -> jni::errors::Result<()> {
                let chunk = env.new_byte_array(CHUNK)?;
                env.set_object_array_element(&all, i, chunk)
            })?;
        }
        Ok(())
    })
    .expect("make the heap garbage");
}

fn main() {
    let home = java_home();
    let libjvm = home.join("lib/server/libjvm.so");
    assert!(libjvm.is_file(), "{} is missing (JAVA_HOME={})", libjvm.display(), home.display());
    let args = InitArgsBuilder::new()
        .version(JNIVersion::V8)
        .option("-Xms16m")
        .option("-Xmx1g")
        .option("-XX:+UseG1GC")
        .build()
        .expect("JVM options");
    let jvm = JavaVM::with_libjvm(args, || Ok(&libjvm)).expect("start the JVM");
    let mut env = jvm.attach_current_thread().expect("attach the main thread");
    memquota::jvm::install(&mut env).expect("memquota::jvm::install");

    make_garbage(&mut env);
    let before = heap(&mut env);
    assert!(before.committed >= u64::from(CHUNKS as u32) * CHUNK as u64, "the heap must grow: {before:?}");
    // The budget judges the next request by these figures, not by the driver's last
    // poll.
    memquota::set_heap_bytes(before);
    memquota::flush_thread();
    let limit = memquota::stats().native + before.committed + HEADROOM;
    memquota::set_limit(limit);

    // Fits only once a GC gives back more than ASK - HEADROOM of the heap.
    let mut fits: Vec<u8> = Vec::new();
    let granted = fits.try_reserve_exact(ASK as usize);
    let stats = memquota::stats();
    let after = heap(&mut env);
    println!(
        "heap committed before {} MiB, after {} MiB (budget's view {} MiB); GCs {}; sync reclaims {}",
        before.committed / MIB,
        after.committed / MIB,
        stats.heap.committed / MIB,
        memquota::jvm::gcs(),
        stats.reclaims_sync
    );
    assert!(granted.is_ok(), "the request must fit after a GC: {:?}", memquota::last_report());
    assert!(stats.reclaims_sync >= 1, "the request must have waited for a reclaim");
    assert!(memquota::jvm::gcs() >= 1, "the reclaim must be a GC");
    assert!(
        before.committed - stats.heap.committed > ASK - HEADROOM,
        "the budget must see the heap shrink by more than the request needed: {} -> {}",
        before.committed,
        stats.heap.committed
    );
    assert!(after.committed < before.committed, "the JVM must report the shrink too");

    // More than the limit: no GC can make room.
    let refusals = memquota::stats().ooms;
    let mut too_big: Vec<u8> = Vec::new();
    let refused = too_big.try_reserve_exact(limit as usize).is_err();
    drop(fits);
    assert!(refused, "a request as big as the limit must be refused");
    assert_eq!(memquota::stats().ooms, refusals + 1, "one refusal counted");
    let report = memquota::last_report().expect("a refusal leaves a report");
    assert!(report.starts_with("memquota: allocation refused"), "the report:\n{report}");
    println!("refused {} MiB with the report:\n{report}", limit / MIB);
    println!("invocation: ok");
}
