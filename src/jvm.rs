//! The JVM side of the budget (feature `jvm`): the heap counts, and the GC is the
//! reclaim. [`install`] starts one driver thread, attached to the JVM as a daemon,
//! that
//!
//! * reads the heap's committed and used bytes (`Runtime.totalMemory()` and
//!   `freeMemory()`) every [`POLL`], after every GC it is told of
//!   ([`gc_finished`]), and after each GC it runs, and pushes them to the budget;
//! * runs the GCs the budget asks for. A GC is never run on the allocating thread and
//!   never inside malloc: the reclaim callback posts a request and waits (bounded by
//!   [`GC_WAIT`]) while this thread does the work.
//!
//! A reclaim is Gluten's dynamic sizing without its faults: lower MinHeapFreeRatio
//! and MaxHeapFreeRatio so the heap may shrink, `System.gc()`, again while the heap
//! keeps shrinking and the request is not met (at most [`MAX_GCS`] times), then
//! restore **both** flags to the values read just before.
//!
//! Used by the preload's JVMTI agent and by a Rust library loaded into a JVM (call
//! [`install`] from `JNI_OnLoad`).

use crate::engine;
use crate::heap_probe::{set_heap_bytes, HeapBytes};
use crate::report::write_stderr;
use jni::objects::{JObject, JString, JValue};
use jni::{JNIEnv, JavaVM};
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::OnceLock;
use std::time::Duration;

/// How often the driver reads the heap when nothing else wakes it.
pub const POLL: Duration = Duration::from_millis(100);
/// The longest a reclaim callback waits for the driver's GC round.
pub const GC_WAIT: Duration = Duration::from_secs(30);
/// `System.gc()` calls in one reclaim, at most.
pub const MAX_GCS: u32 = 4;
/// The least time between a GC and a background one: a full GC is costly, and a
/// heap that churns above the soft threshold would otherwise be collected back to
/// back. Requests that must be met now (a refused allocation) are not held up.
pub const BACKGROUND_GAP: Duration = Duration::from_secs(1);
/// The free ratios a reclaim sets while it runs (Gluten's value).
const SHRINK_RATIO: &str = "5";

const MIN_RATIO: &str = "MinHeapFreeRatio";
const MAX_RATIO: &str = "MaxHeapFreeRatio";

/// Requests from the reclaim callback to the driver, and the driver's answers.
struct Requests {
    /// GC rounds asked for (a ticket number), and the largest `need` among them.
    asked: u64,
    need: u64,
    /// GC rounds finished: a waiter with ticket `t` is done when `done >= t`.
    done: u64,
}

static REQUESTS: Mutex<Requests> = Mutex::new(Requests { asked: 0, need: 0, done: 0 });
static WAKE: Condvar = Condvar::new();
static DONE: Condvar = Condvar::new();
/// Set by [`gc_finished`]: read the heap now.
static GC_SEEN: AtomicBool = AtomicBool::new(false);
static INSTALLED: OnceLock<()> = OnceLock::new();
/// `System.gc()` calls the driver made.
static GCS: AtomicU64 = AtomicU64::new(0);

/// Counts the heap in the budget and makes the GC its reclaim, for the JVM `env`
/// belongs to. Checks the JVM's flags first and warns, on stderr, about the ones
/// that keep the heap from shrinking. Once per process: later calls do nothing.
///
/// # Errors
/// [`Error::Jvm`](crate::Error::Jvm) when the JVM cannot be reached or the driver
/// thread cannot start.
pub fn install(env: &mut JNIEnv) -> crate::Result<()> {
    if INSTALLED.get().is_some() {
        return Ok(());
    }
    crate::rendezvous::check();
    let vm = env.get_java_vm().map_err(jvm_error)?;
    warn_if_cannot_shrink(env);
    let heap = read_heap(env).map_err(jvm_error)?;
    set_heap_bytes(heap);
    std::thread::Builder::new()
        .name("memquota-jvm".into())
        .spawn(move || drive(vm))
        .map_err(|e| crate::Error::Jvm(format!("cannot start the driver thread: {e}")))?;
    let _ = INSTALLED.set(());
    engine::set_background_interval(BACKGROUND_GAP);
    engine::on_reclaim(request_gc);
    Ok(())
}

/// Tells the driver a GC just finished, so it reads the heap now. Allocates nothing
/// and takes no lock: safe in a JVMTI `GarbageCollectionFinish` callback.
pub fn gc_finished() {
    GC_SEEN.store(true, Release);
    WAKE.notify_one();
}

/// `System.gc()` calls made for the budget so far.
pub fn gcs() -> u64 {
    GCS.load(Relaxed)
}

fn jvm_error(e: jni::errors::Error) -> crate::Error {
    crate::Error::Jvm(e.to_string())
}

/// The reclaim callback: asks the driver for a GC round and waits for it.
fn request_gc(need: usize) {
    let mut r = REQUESTS.lock();
    r.asked += 1;
    let ticket = r.asked;
    r.need = r.need.max(need as u64);
    WAKE.notify_one();
    let deadline = std::time::Instant::now() + GC_WAIT;
    while r.done < ticket {
        if DONE.wait_until(&mut r, deadline).timed_out() {
            return;
        }
    }
}

/// The driver thread's body.
fn drive(vm: JavaVM) {
    engine::exempt_this_thread();
    let mut env = match vm.attach_current_thread_as_daemon() {
        Ok(env) => env,
        Err(e) => {
            write_stderr(&format!("memquota: the JVM driver thread cannot attach: {e}\n"));
            return;
        }
    };
    loop {
        let round = {
            let mut r = REQUESTS.lock();
            if r.asked == r.done && !GC_SEEN.load(Acquire) {
                WAKE.wait_for(&mut r, POLL);
            }
            (r.asked > r.done).then(|| (r.asked, std::mem::take(&mut r.need)))
        };
        GC_SEEN.store(false, Relaxed);
        if let Some((ticket, need)) = round {
            shrink(&mut env, need);
            let mut r = REQUESTS.lock();
            r.done = ticket;
            DONE.notify_all();
        } else if let Ok(heap) = read_heap(&mut env) {
            set_heap_bytes(heap);
        }
        let _ = env.exception_clear();
    }
}

/// One reclaim round: free ratios down, GCs while the heap shrinks, ratios back.
fn shrink(env: &mut JNIEnv, need: u64) {
    let saved = (vm_option(env, MIN_RATIO), vm_option(env, MAX_RATIO));
    // Min first on the way down and last on the way up: Max may never be set below
    // Min.
    set_vm_option(env, MIN_RATIO, SHRINK_RATIO);
    set_vm_option(env, MAX_RATIO, SHRINK_RATIO);
    let Ok(start) = read_heap(env) else { return };
    let mut last = start.committed;
    for _ in 0..MAX_GCS {
        if env.call_static_method("java/lang/System", "gc", "()V", &[]).is_err() {
            break;
        }
        GCS.fetch_add(1, Relaxed);
        let Ok(heap) = read_heap(env) else { break };
        set_heap_bytes(heap);
        if start.committed.saturating_sub(heap.committed) >= need || heap.committed >= last {
            break;
        }
        last = heap.committed;
    }
    if let (Some(min), Some(max)) = saved {
        set_vm_option(env, MAX_RATIO, &max);
        set_vm_option(env, MIN_RATIO, &min);
    }
}

/// The heap's committed and used bytes.
fn read_heap(env: &mut JNIEnv) -> jni::errors::Result<HeapBytes> {
    env.with_local_frame(4, |env| {
        let rt =
            env.call_static_method("java/lang/Runtime", "getRuntime", "()Ljava/lang/Runtime;", &[])?.l()?;
        let total = env.call_method(&rt, "totalMemory", "()J", &[])?.j()?;
        let free = env.call_method(&rt, "freeMemory", "()J", &[])?.j()?;
        let committed = u64::try_from(total).unwrap_or(0);
        Ok(HeapBytes { committed, used: committed.saturating_sub(u64::try_from(free).unwrap_or(0)) })
    })
}

/// Warns about the flags under which a GC cannot give heap memory back.
fn warn_if_cannot_shrink(env: &mut JNIEnv) {
    let warn = |what: &str| write_stderr(&format!("memquota: warning: {what}\n"));
    let initial = vm_option(env, "InitialHeapSize");
    let max = vm_option(env, "MaxHeapSize");
    if let (Some(initial), Some(max)) = (&initial, &max) {
        if initial == max {
            warn("-Xms equals -Xmx: the heap cannot shrink to make room for native memory");
        }
    }
    if vm_option(env, "DisableExplicitGC").as_deref() == Some("true") {
        warn("-XX:+DisableExplicitGC: System.gc() does nothing, so memquota cannot reclaim heap for native memory");
    }
    if vm_option(env, "ExplicitGCInvokesConcurrent").as_deref() == Some("true") {
        warn("-XX:+ExplicitGCInvokesConcurrent: System.gc() returns before the heap shrinks; native requests may be refused");
    }
}

/// A HotSpot flag's value through `HotSpotDiagnosticMXBean.getVMOption`.
fn vm_option(env: &mut JNIEnv, name: &str) -> Option<String> {
    let value = env.with_local_frame(8, |env| -> jni::errors::Result<String> {
        let bean = diagnostic_bean(env)?;
        let jname = env.new_string(name)?;
        let option = env
            .call_method(
                &bean,
                "getVMOption",
                "(Ljava/lang/String;)Lcom/sun/management/VMOption;",
                &[JValue::Object(&jname)],
            )?
            .l()?;
        let value = JString::from(env.call_method(&option, "getValue", "()Ljava/lang/String;", &[])?.l()?);
        let value: String = env.get_string(&value)?.into();
        Ok(value)
    });
    if value.is_err() {
        let _ = env.exception_clear();
    }
    value.ok()
}

/// Sets a manageable HotSpot flag; warns if the JVM refuses.
fn set_vm_option(env: &mut JNIEnv, name: &str, value: &str) {
    let done = env.with_local_frame(8, |env| -> jni::errors::Result<()> {
        let bean = diagnostic_bean(env)?;
        let (jname, jvalue) = (env.new_string(name)?, env.new_string(value)?);
        env.call_method(
            &bean,
            "setVMOption",
            "(Ljava/lang/String;Ljava/lang/String;)V",
            &[JValue::Object(&jname), JValue::Object(&jvalue)],
        )?;
        Ok(())
    });
    if let Err(e) = done {
        let _ = env.exception_clear();
        write_stderr(&format!("memquota: warning: cannot set -XX:{name}={value}: {e}\n"));
    }
}

fn diagnostic_bean<'l>(env: &mut JNIEnv<'l>) -> jni::errors::Result<JObject<'l>> {
    let class = env.find_class("com/sun/management/HotSpotDiagnosticMXBean")?;
    env.call_static_method(
        "java/lang/management/ManagementFactory",
        "getPlatformMXBean",
        "(Ljava/lang/Class;)Ljava/lang/management/PlatformManagedObject;",
        &[JValue::Object(&class)],
    )?
    .l()
}
