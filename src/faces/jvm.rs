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
//! A reclaim round first runs one `System.gc()` under the user's flags and waits for
//! the JVM's reference handler to run the cleaners it found: the native memory of
//! dead direct buffers, and whatever heap the JVM gives back by its own ratios, may
//! already meet the request. Only if it falls short does the round shrink the heap,
//! Gluten's dynamic sizing without its faults: lower MinHeapFreeRatio and
//! MaxHeapFreeRatio so the heap may shrink, `System.gc()`, again while the heap keeps
//! shrinking and the request is not met (at most [`MAX_GCS`] times), then restore
//! **both** flags to the values read just before, on every way out of the round (a
//! failed heap read or GC included). A restore the JVM refuses is retried at each
//! wake-up of the driver, and the next round restores those values, never the
//! lowered ones it would read. A heap shrunk when native garbage would have done
//! grows straight back: a page fault for each page, and more collections while it
//! is small.
//!
//! Used by the preload's JVMTI agent and by a Rust library loaded into a JVM (call
//! [`install`] from `JNI_OnLoad`).

use crate::seam::process;
use crate::seam::sync::{
    lock, wait_timeout, AtomicBool, AtomicU64, Condvar, ForkHeld, Mutex, MutexGuard, OnceLock, Ordering::*,
};
use crate::seam::text::write_stderr;
use crate::{set_heap_bytes, HeapBytes};
use jni::objects::{JObject, JString, JValue};
use jni::{JNIEnv, JavaVM};
use std::time::Duration;

/// How often the driver reads the heap when nothing else wakes it.
pub const POLL: Duration = Duration::from_millis(100);
/// The longest a reclaim callback waits for the driver's GC round.
pub const GC_WAIT: Duration = Duration::from_secs(30);
/// `System.gc()` calls in one reclaim's shrink of the heap, at most (after the
/// round's first GC).
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
static REQUESTS_HELD: ForkHeld<MutexGuard<'static, Requests>> = ForkHeld::new();
/// Set in a `fork` child: the driver thread did not survive the fork, and no GC round
/// asked for would ever be answered.
static DRIVER_GONE: AtomicBool = AtomicBool::new(false);
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
    process::check_second_budget();
    process::add_face_handlers(process::FaceHandlers { before: before_fork, after: after_fork });
    let vm = env.get_java_vm().map_err(jvm_error)?;
    warn_if_cannot_shrink(env);
    let heap = read_heap(env).map_err(jvm_error)?;
    set_heap_bytes(heap);
    process::spawn_service("memquota-jvm", move || drive(vm))
        .map_err(|e| crate::Error::Jvm(format!("cannot start the driver thread: {e}")))?;
    let _ = INSTALLED.set(());
    process::set_background_interval(BACKGROUND_GAP);
    crate::on_reclaim(request_gc);
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

/// The driver's part of a fork's prepare handler: takes the request lock.
fn before_fork() {
    // SAFETY: a guard of REQUESTS, just taken.
    unsafe { REQUESTS_HELD.keep(lock(&REQUESTS)) };
}

/// The driver's part of a fork's parent and child handlers. The child has no driver
/// thread: its reclaims return at once instead of waiting for a GC nobody runs.
///
/// # Safety
/// On the thread whose prepare handler called [`before_fork`], once.
unsafe fn after_fork(child: bool) {
    if child {
        DRIVER_GONE.store(true, Relaxed);
    }
    // SAFETY: forwarded contract.
    unsafe {
        REQUESTS_HELD.release_after(|r| {
            if child {
                r.done = r.asked;
            }
        })
    };
}

/// The reclaim callback: asks the driver for a GC round and waits for it.
fn request_gc(need: usize) {
    if DRIVER_GONE.load(Relaxed) {
        return;
    }
    let mut r = lock(&REQUESTS);
    r.asked += 1;
    let ticket = r.asked;
    r.need = r.need.max(need as u64);
    WAKE.notify_one();
    let deadline = std::time::Instant::now() + GC_WAIT;
    while r.done < ticket {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return;
        }
        r = wait_timeout(&DONE, r, left);
    }
}

/// The driver thread's body.
fn drive(vm: JavaVM) {
    let mut env = match vm.attach_current_thread_as_daemon() {
        Ok(env) => env,
        Err(e) => {
            write_stderr(&format!("memquota: the JVM driver thread cannot attach: {e}\n"));
            return;
        }
    };
    let mut owed = None;
    loop {
        let round = {
            let mut r = lock(&REQUESTS);
            if r.asked == r.done && !GC_SEEN.load(Acquire) {
                r = wait_timeout(&WAKE, r, POLL);
            }
            (r.asked > r.done).then(|| (r.asked, std::mem::take(&mut r.need)))
        };
        GC_SEEN.store(false, Relaxed);
        // A JVM left with our lowered ratios would shrink and regrow its heap on
        // every GC: try again at every wake-up until the user's values are back.
        restore_owed(&mut env, &mut owed);
        if let Some((ticket, need)) = round {
            reclaim(&mut env, need, &mut owed);
            let mut r = lock(&REQUESTS);
            r.done = ticket;
            DONE.notify_all();
        } else if let Ok(heap) = read_heap(&mut env) {
            set_heap_bytes(heap);
        }
        let _ = env.exception_clear();
    }
}

/// What a reclaim round needs of the JVM. The driver's is the JVM itself; the unit
/// tests' is a model whose calls fail on demand, to pin that the free ratios come
/// back on every path out of a round.
trait Vm {
    /// Reads the heap and pushes the figures to the budget; `None` if the JVM cannot
    /// say now.
    fn heap(&mut self) -> Option<HeapBytes>;
    /// A HotSpot flag's value.
    fn flag(&mut self, name: &str) -> Option<String>;
    /// Sets a manageable HotSpot flag; `false` if the JVM refused.
    fn set_flag(&mut self, name: &str, value: &str) -> bool;
    /// `System.gc()`, counted in [`gcs`]; `false` if it threw.
    fn gc(&mut self) -> bool;
    /// Waits for the cleaners the last GC found to run (they free direct buffers'
    /// native memory on the JVM's reference handler thread, after the GC returns).
    fn settle(&mut self);
    /// Native + counted heap bytes, the heap read now; `None` if the JVM cannot say.
    fn footprint(&mut self) -> Option<u64>;
}

impl Vm for JNIEnv<'_> {
    fn heap(&mut self) -> Option<HeapBytes> {
        let heap = read_heap(self).ok()?;
        set_heap_bytes(heap);
        Some(heap)
    }

    fn flag(&mut self, name: &str) -> Option<String> {
        vm_option(self, name)
    }

    fn set_flag(&mut self, name: &str, value: &str) -> bool {
        set_vm_option(self, name, value)
    }

    fn gc(&mut self) -> bool {
        let done = self.call_static_method("java/lang/System", "gc", "()V", &[]).is_ok();
        if done {
            GCS.fetch_add(1, Relaxed);
        }
        done
    }

    fn settle(&mut self) {
        // `Reference.waitForReferenceProcessing` (JDK 9 and later; private, which
        // JNI does not check) is what `Bits.reserveMemory` waits on: `true` while
        // the handler made progress. Bounded; a JVM without it only makes the
        // round's measure conservative.
        for _ in 0..SETTLE_TRIES {
            let progress =
                self.call_static_method("java/lang/ref/Reference", "waitForReferenceProcessing", "()Z", &[]);
            if !progress.and_then(|v| v.z()).unwrap_or(false) {
                let _ = self.exception_clear();
                return;
            }
        }
    }

    fn footprint(&mut self) -> Option<u64> {
        self.heap()?;
        u64::try_from(process::native_and_outside()).ok()
    }
}

/// How many times a round asks the reference handler whether it is still busy.
const SETTLE_TRIES: u32 = 16;

/// MinHeapFreeRatio and MaxHeapFreeRatio as the user set them.
#[derive(Clone, Debug, PartialEq)]
struct Ratios {
    min: String,
    max: String,
}

impl Ratios {
    /// Sets both flags back to these values, Max first: the user's Max is at least
    /// their Min and at least the lowered Min, so each step keeps Min <= Max, from
    /// whatever state a round left. Stops at the first refusal (the second set could
    /// only break the order).
    fn restore(&self, vm: &mut impl Vm) -> bool {
        vm.set_flag(MAX_RATIO, &self.max) && vm.set_flag(MIN_RATIO, &self.min)
    }
}

/// The free ratios lowered for one round, put back when it is dropped: on every way
/// out of the round, an early return or a panic included.
struct Lowered<'a, V: Vm> {
    vm: &'a mut V,
    /// `None`: the flags were not touched (their values could not be read, so they
    /// could not have been put back).
    saved: Option<Ratios>,
    /// Where a restore that failed leaves the values it owes.
    owed: &'a mut Option<Ratios>,
}

impl<'a, V: Vm> Lowered<'a, V> {
    /// Lowers both ratios to [`SHRINK_RATIO`], Min first (Max may never be set below
    /// Min). The values to restore are those a failed restore still owes, if any:
    /// read now, they would be our own lowered ones (Gluten #13093).
    fn lower(vm: &'a mut V, owed: &'a mut Option<Ratios>) -> Self {
        let saved =
            owed.take().or_else(|| Some(Ratios { min: vm.flag(MIN_RATIO)?, max: vm.flag(MAX_RATIO)? }));
        let lowered = Lowered { vm, saved, owed };
        // Through the guard: if the second set is refused, the first is still undone.
        if lowered.saved.is_some() && lowered.vm.set_flag(MIN_RATIO, SHRINK_RATIO) {
            lowered.vm.set_flag(MAX_RATIO, SHRINK_RATIO);
        }
        lowered
    }
}

impl<V: Vm> Drop for Lowered<'_, V> {
    fn drop(&mut self) {
        if let Some(saved) = self.saved.take() {
            if !saved.restore(self.vm) {
                *self.owed = Some(saved);
            }
        }
    }
}

/// Retries a restore a round could not finish.
fn restore_owed(vm: &mut impl Vm, owed: &mut Option<Ratios>) {
    if let Some(ratios) = owed.take() {
        if !ratios.restore(vm) {
            *owed = Some(ratios);
        }
    }
}

/// One reclaim round: a GC under the user's ratios, and a [`shrink`] for what it
/// left of `need`. A footprint that cannot be read counts as nothing freed.
fn reclaim(vm: &mut impl Vm, need: u64, owed: &mut Option<Ratios>) {
    let Some(before) = vm.footprint() else { return shrink(vm, need, owed) };
    if !vm.gc() {
        return;
    }
    vm.settle();
    let freed = vm.footprint().map_or(0, |after| before.saturating_sub(after));
    if freed < need {
        shrink(vm, need - freed, owed);
    }
}

/// Free ratios down, GCs while the heap shrinks, ratios back. Ratios that cannot be
/// read are left alone, and the GCs run anyway: they still free what they can.
fn shrink(vm: &mut impl Vm, need: u64, owed: &mut Option<Ratios>) {
    let lowered = Lowered::lower(vm, owed);
    collect(&mut *lowered.vm, need);
}

/// `System.gc()` while the heap keeps shrinking and `need` is not met, at most
/// [`MAX_GCS`] times.
fn collect(vm: &mut impl Vm, need: u64) {
    let Some(start) = vm.heap() else { return };
    let mut last = start.committed;
    for _ in 0..MAX_GCS {
        if !vm.gc() {
            return;
        }
        let Some(heap) = vm.heap() else { return };
        if start.committed.saturating_sub(heap.committed) >= need || heap.committed >= last {
            return;
        }
        last = heap.committed;
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

/// Sets a manageable HotSpot flag; warns and returns `false` if the JVM refuses.
fn set_vm_option(env: &mut JNIEnv, name: &str, value: &str) -> bool {
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
    if let Err(e) = &done {
        let _ = env.exception_clear();
        write_stderr(&format!("memquota: warning: cannot set -XX:{name}={value}: {e}\n"));
    }
    done.is_ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A JVM as a reclaim round sees it: two flags with HotSpot's constraint
    /// (Min <= Max, else `setVMOption` throws), a heap that each GC shrinks, and calls
    /// that fail on demand.
    struct Model {
        min: u32,
        max: u32,
        committed: u64,
        /// Each GC gives back this much of the heap.
        gc_frees: u64,
        /// Native bytes, and the part of them the next GC finds dead: freed when
        /// the round settles (the cleaners run after the GC).
        native: u64,
        native_garbage: u64,
        found: u64,
        settles: u32,
        /// Heap reads that succeed before every later one fails (`None`: all succeed).
        heap_reads_ok: Option<u32>,
        flag_reads_fail: bool,
        sets_fail: bool,
        gc_panics: bool,
        gcs: u32,
        sets: Vec<(&'static str, u32)>,
    }

    impl Model {
        /// `-XX:MinHeapFreeRatio=20 -XX:MaxHeapFreeRatio=60`, 600 MiB committed.
        fn new() -> Self {
            Model {
                min: 20,
                max: 60,
                committed: 600 * MIB,
                gc_frees: 100 * MIB,
                native: 300 * MIB,
                native_garbage: 0,
                found: 0,
                settles: 0,
                heap_reads_ok: None,
                flag_reads_fail: false,
                sets_fail: false,
                gc_panics: false,
                gcs: 0,
                sets: Vec::new(),
            }
        }

        fn ratios(&self) -> (u32, u32) {
            (self.min, self.max)
        }
    }

    impl Vm for Model {
        fn heap(&mut self) -> Option<HeapBytes> {
            match &mut self.heap_reads_ok {
                Some(0) => return None,
                Some(n) => *n -= 1,
                None => {}
            }
            Some(HeapBytes { committed: self.committed, used: self.committed / 2 })
        }

        fn flag(&mut self, name: &str) -> Option<String> {
            if self.flag_reads_fail {
                return None;
            }
            Some(if name == MIN_RATIO { self.min } else { self.max }.to_string())
        }

        fn set_flag(&mut self, name: &str, value: &str) -> bool {
            let value: u32 = value.parse().unwrap();
            let (min, max) = if name == MIN_RATIO { (value, self.max) } else { (self.min, value) };
            if self.sets_fail || min > max {
                return false;
            }
            (self.min, self.max) = (min, max);
            self.sets.push((if name == MIN_RATIO { MIN_RATIO } else { MAX_RATIO }, value));
            true
        }

        fn gc(&mut self) -> bool {
            assert!(!self.gc_panics, "a GC that panics");
            self.gcs += 1;
            self.committed = self.committed.saturating_sub(self.gc_frees);
            self.found += std::mem::take(&mut self.native_garbage);
            true
        }

        fn settle(&mut self) {
            self.settles += 1;
            self.native -= std::mem::take(&mut self.found);
        }

        fn footprint(&mut self) -> Option<u64> {
            Some(self.heap()?.committed + self.native)
        }
    }

    /// What the model's flags were set to, in order.
    fn lowered_then_restored() -> Vec<(&'static str, u32)> {
        vec![(MIN_RATIO, 5), (MAX_RATIO, 5), (MAX_RATIO, 60), (MIN_RATIO, 20)]
    }

    #[test]
    fn a_round_lowers_both_ratios_collects_until_the_need_is_met_and_restores_both() {
        let (mut vm, mut owed) = (Model::new(), None);
        shrink(&mut vm, 250 * MIB, &mut owed);
        assert_eq!(vm.gcs, 3, "100 MiB a GC: the third meets 250 MiB");
        assert_eq!(vm.sets, lowered_then_restored());
        assert_eq!(vm.ratios(), (20, 60));
        assert_eq!(owed, None);
    }

    #[test]
    fn native_garbage_that_meets_the_need_leaves_the_heap_alone() {
        let (mut vm, mut owed) = (Model::new(), None);
        vm.native_garbage = 200 * MIB;
        reclaim(&mut vm, 250 * MIB, &mut owed);
        assert_eq!((vm.gcs, vm.settles), (1, 1), "200 MiB of dead buffers + 100 MiB of heap meet 250 MiB");
        assert_eq!(vm.sets, [], "the ratios were never lowered");
        assert_eq!(vm.native, 100 * MIB);
    }

    #[test]
    fn a_first_gc_that_frees_too_little_goes_on_to_shrink_the_heap_for_the_rest() {
        let (mut vm, mut owed) = (Model::new(), None);
        vm.native_garbage = 30 * MIB;
        reclaim(&mut vm, 250 * MIB, &mut owed);
        // The first GC freed 130 MiB (counted once the cleaners ran); the shrink's
        // first GC gives 100 MiB more, its second the last 20.
        assert_eq!(vm.gcs, 3);
        assert_eq!(vm.sets, lowered_then_restored());
        assert_eq!(vm.ratios(), (20, 60));
        assert_eq!(owed, None);
    }

    #[test]
    fn a_round_that_cannot_read_the_heap_shrinks_as_before() {
        let (mut vm, mut owed) = (Model::new(), None);
        vm.heap_reads_ok = Some(0);
        vm.native_garbage = 300 * MIB;
        reclaim(&mut vm, 250 * MIB, &mut owed);
        assert_eq!(vm.gcs, 0, "no figure to stop on: the shrink's own read fails too");
        assert_eq!(vm.ratios(), (20, 60));
        assert_eq!(vm.sets, lowered_then_restored());
    }

    #[test]
    fn a_heap_read_that_fails_before_any_gc_still_restores_both_ratios() {
        let (mut vm, mut owed) = (Model::new(), None);
        vm.heap_reads_ok = Some(0);
        shrink(&mut vm, 250 * MIB, &mut owed);
        assert_eq!(vm.gcs, 0);
        assert_eq!(vm.ratios(), (20, 60), "the flags must read back as the user's");
        assert_eq!(vm.sets, lowered_then_restored());
        // The next round saves the user's values, not ours.
        vm.heap_reads_ok = None;
        vm.sets.clear();
        shrink(&mut vm, 250 * MIB, &mut owed);
        assert_eq!(vm.sets, lowered_then_restored());
        assert_eq!(vm.ratios(), (20, 60));
    }

    #[test]
    fn a_heap_read_that_fails_after_a_gc_still_restores_both_ratios() {
        let (mut vm, mut owed) = (Model::new(), None);
        vm.heap_reads_ok = Some(1);
        shrink(&mut vm, 250 * MIB, &mut owed);
        assert_eq!(vm.gcs, 1, "the read after the first GC failed: no second GC");
        assert_eq!(vm.ratios(), (20, 60));
        assert_eq!(vm.sets, lowered_then_restored());
    }

    #[test]
    fn ratios_that_cannot_be_read_are_never_touched_but_the_gcs_still_run() {
        let (mut vm, mut owed) = (Model::new(), None);
        vm.flag_reads_fail = true;
        shrink(&mut vm, 250 * MIB, &mut owed);
        assert_eq!(vm.sets, [], "a flag that could not be saved must not be lowered");
        assert_eq!(vm.ratios(), (20, 60));
        assert_eq!(vm.gcs, 3);
    }

    #[test]
    fn a_refused_restore_is_owed_retried_and_never_saved_as_the_users_values() {
        let mut owed = None;
        // The two sets that lower pass; the restore is refused (on a full heap,
        // `setVMOption`'s string arguments cannot even be made).
        let mut refusing = RefuseAfter { vm: Model::new(), sets_left: 2 };
        shrink(&mut refusing, 250 * MIB, &mut owed);
        assert_eq!(refusing.vm.ratios(), (5, 5), "the model refused the restore");
        assert_eq!(owed, Some(Ratios { min: "20".into(), max: "60".into() }));
        // The next round, with the JVM still refusing, saves what it owes, not 5/5.
        refusing.vm.sets.clear();
        shrink(&mut refusing, 250 * MIB, &mut owed);
        assert_eq!(owed, Some(Ratios { min: "20".into(), max: "60".into() }));
        // Once the JVM takes sets again, the driver's retry puts the user's values back.
        refusing.sets_left = u32::MAX;
        restore_owed(&mut refusing, &mut owed);
        assert_eq!(refusing.vm.ratios(), (20, 60));
        assert_eq!(owed, None);
        // And a round after that saves 20/60 again.
        refusing.vm.sets.clear();
        shrink(&mut refusing, 250 * MIB, &mut owed);
        assert_eq!(refusing.vm.sets, lowered_then_restored());
    }

    #[test]
    fn the_round_after_a_refused_restore_puts_the_users_values_back() {
        let mut owed = None;
        let mut refusing = RefuseAfter { vm: Model::new(), sets_left: 2 };
        shrink(&mut refusing, 250 * MIB, &mut owed);
        assert_eq!(refusing.vm.ratios(), (5, 5));
        refusing.sets_left = u32::MAX;
        refusing.vm.sets.clear();
        shrink(&mut refusing, 250 * MIB, &mut owed);
        assert_eq!(refusing.vm.ratios(), (20, 60), "restored to the owed values, not to the 5/5 it found");
        assert_eq!(owed, None);
    }

    /// A model whose `set_flag` succeeds `sets_left` times, then fails.
    struct RefuseAfter {
        vm: Model,
        sets_left: u32,
    }

    impl Vm for RefuseAfter {
        fn heap(&mut self) -> Option<HeapBytes> {
            self.vm.heap()
        }
        fn flag(&mut self, name: &str) -> Option<String> {
            self.vm.flag(name)
        }
        fn set_flag(&mut self, name: &str, value: &str) -> bool {
            self.vm.sets_fail = self.sets_left == 0;
            self.sets_left = self.sets_left.saturating_sub(1);
            self.vm.set_flag(name, value)
        }
        fn gc(&mut self) -> bool {
            self.vm.gc()
        }
        fn settle(&mut self) {
            self.vm.settle()
        }
        fn footprint(&mut self) -> Option<u64> {
            self.vm.footprint()
        }
    }

    #[test]
    fn a_round_that_panics_still_restores_both_ratios() {
        let (mut vm, mut owed) = (Model::new(), None);
        vm.gc_panics = true;
        let unwound =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| shrink(&mut vm, 250 * MIB, &mut owed)));
        assert!(unwound.is_err());
        assert_eq!(vm.ratios(), (20, 60));
        assert_eq!(vm.sets, lowered_then_restored());
    }
}
