//! The JVMTI agent: `java -agentpath:/path/libmemquota.so=limit=4g,...`, given by the
//! same path as the preload so that the JVM reuses the preloaded object and there is
//! one budget. It
//!
//! * applies its options over the `MEMQUOTA_*` environment;
//! * switches the budget to [`Enforcement::Gates`]: the JVM's own mallocs (GC
//!   workers, the VM thread, compilers, class loading) are counted but never wait and
//!   are never refused, since a failed one kills the JVM; the gate is
//!   `Unsafe.allocateMemory` (direct buffers, Spark's off-heap pages), see
//!   `gate.rs`;
//! * hands the JVM to [`memquota_core::jvm::install`] at VM start (heap figures and
//!   the GC as the reclaim), and tells it of every finished GC.
//!
//! JVMTI has no Rust bindings of standing, and the agent needs six functions of it:
//! they are declared here by their slot in the function table of `jvmti.h`.

use crate::process::init;
use jni::sys::{jclass, jint, jmethodID, jobject as jthread, JNIEnv, JavaVM, JNI_ERR, JNI_OK};
use libc::{c_char, c_int, c_uchar, c_void};
use memquota_core::seam::process::vars;
use memquota_core::{Config, Enforcement, Error};
use std::ffi::CStr;

type Jvmti = *mut *const *const c_void;

const JVMTI_VERSION_11: jint = 0x300B_0000;
const JVMTI_ENABLE: c_int = 1;
const EVENT_VM_INIT: c_int = 50;
const EVENT_NATIVE_METHOD_BIND: c_int = 67;
const EVENT_GC_FINISH: c_int = 82;
/// Slots in `jvmtiInterface_1` (1-based, as numbered in `jvmti.h`).
const SET_EVENT_NOTIFICATION_MODE: usize = 2;
const DEALLOCATE: usize = 47;
const GET_CLASS_SIGNATURE: usize = 48;
const GET_METHOD_NAME: usize = 64;
const GET_METHOD_DECLARING_CLASS: usize = 65;
const SET_EVENT_CALLBACKS: usize = 122;
const ADD_CAPABILITIES: usize = 142;
/// `jvmtiEventCallbacks` holds one pointer per event from VM_INIT (50) to 86.
const CALLBACK_SLOTS: usize = 37;

/// The agent's options and the settings they stand for.
const OPTIONS: [(&str, &str); 5] = [
    ("limit", vars::LIMIT),
    ("heap", vars::HEAP),
    ("soft", vars::SOFT_RATIO),
    ("on_oom", vars::ON_OOM),
    ("refuse_min", vars::REFUSE_MIN),
];
const STATS_FILE_OPTION: &str = "stats_file";

/// The function in slot `n` of the JVMTI table.
///
/// # Safety
/// `env` is a live JVMTI environment and `F` the function type of slot `n`.
unsafe fn function<F: Copy>(env: Jvmti, n: usize) -> F {
    // SAFETY: `env` points at the table pointer; slot n - 1 is within the table.
    let slot = unsafe { (*env).add(n - 1) };
    // SAFETY: the caller names the slot's type; a function pointer is pointer-sized.
    unsafe { std::mem::transmute_copy::<*const c_void, F>(&*slot) }
}

/// Called by the JVM for `-agentpath:...=OPTIONS`.
///
/// # Safety
/// Called by the JVM with its own arguments.
#[cfg_attr(not(test), no_mangle)]
#[allow(non_snake_case)] // the name JVMTI looks up
pub unsafe extern "system" fn Agent_OnLoad(vm: *mut JavaVM, options: *const c_char, _: *mut c_void) -> jint {
    let options = if options.is_null() {
        String::new()
    } else {
        // SAFETY: the JVM passes a NUL-terminated string.
        unsafe { CStr::from_ptr(options) }.to_string_lossy().into_owned()
    };
    if !preloaded() {
        memquota_core::seam::text::write_stderr(&not_preloaded_message());
        return JNI_ERR;
    }
    if let Err(message) = configure(&options) {
        memquota_core::seam::text::write_stderr(&format!("{message}\n"));
        return JNI_ERR;
    }
    // SAFETY: `vm` is the JVM's own pointer, valid during Agent_OnLoad.
    match unsafe { hook_events(vm) } {
        Ok(()) => JNI_OK,
        Err(why) => {
            memquota_core::seam::text::write_stderr(&format!("memquota agent: {why}\n"));
            JNI_ERR
        }
    }
}

/// Whether the process's `malloc` is this library's: the agent is only half a budget
/// without it. Compared by the object that defines it, since inside this library
/// `malloc` names whatever the dynamic linker bound, not necessarily our own.
fn preloaded() -> bool {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name.
    let global = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"malloc".as_ptr()) };
    !global.is_null() && init::object_base(global) == init::object_base(preloaded as *const c_void)
}

fn not_preloaded_message() -> String {
    let path = init::own_path().unwrap_or_else(|| "/path/to/libmemquota.so".into());
    format!(
        "memquota agent: libmemquota.so is not preloaded, so the JVM's native memory would not be counted. \
         Give the same library to both:\n  LD_PRELOAD={path} java -agentpath:{path}=limit=4g ...\n"
    )
}

/// Applies the agent's options over the environment's `MEMQUOTA_*` settings.
fn configure(options: &str) -> Result<(), String> {
    let mut given: Vec<(&str, String)> = Vec::new();
    let mut stats_file = None;
    for item in options.split(',').filter(|s| !s.is_empty()) {
        let (key, value) = item.split_once('=').ok_or_else(|| {
            format!("memquota agent: option {item:?} has no value: expected key=value, e.g. limit=4g")
        })?;
        if key == STATS_FILE_OPTION {
            crate::process::stats_file::check(value).map_err(|e| format!("memquota agent: {e}"))?;
            stats_file = Some(value.to_owned()).filter(|v| !v.is_empty());
            continue;
        }
        let Some(&(_, var)) = OPTIONS.iter().find(|(k, _)| *k == key) else {
            let known: Vec<&str> = OPTIONS.iter().map(|(k, _)| *k).chain([STATS_FILE_OPTION]).collect();
            return Err(format!(
                "memquota agent: unknown option {key:?}; known options: {}",
                known.join(", ")
            ));
        };
        given.push((var, value.to_owned()));
    }
    let lookup = |var: &'static str| {
        given
            .iter()
            .rev()
            .find(|(v, _)| *v == var)
            .map(|(_, value)| value.clone())
            .or_else(|| init::env_lookup(var))
    };
    let mut config = Config::from_lookup(init::with_preload_defaults(lookup)).map_err(|e| match e {
        Error::BadEnv { var, value, accepted } => {
            let option = OPTIONS.iter().find(|(_, v)| *v == var).map_or(var, |(k, _)| k);
            format!("memquota agent: bad option {option}={value:?}: expected {accepted}")
        }
        other => other.to_string(),
    })?;
    config.take_metrics_addr(); // the preload's constructor started it, if asked
    memquota_core::init(config).map_err(|e| e.to_string())?;
    memquota_core::set_enforcement(Enforcement::Gates);
    if let Some(path) = stats_file {
        init::write_stats_to(path);
    }
    Ok(())
}

/// Asks for the events the agent needs and installs its callbacks.
///
/// # Safety
/// `vm` is a live `JavaVM*` in the OnLoad phase.
unsafe fn hook_events(vm: *mut JavaVM) -> Result<(), String> {
    let mut env: *mut c_void = std::ptr::null_mut();
    // SAFETY: `vm` is live; GetEnv is always present in the invoke interface.
    let got = unsafe { ((**vm).GetEnv.ok_or("no GetEnv")?)(vm, &mut env, JVMTI_VERSION_11) };
    if got != JNI_OK || env.is_null() {
        return Err(format!("JVMTI 11 is not available (GetEnv returned {got})"));
    }
    let env: Jvmti = env.cast();
    // jvmtiCapabilities is 128 bits of flags. Bit 30: native method bind events; 31:
    // garbage collection events; 41: early VM start, so that the bind events of
    // `Unsafe`'s natives, which come before VM start, may ask a method its name.
    let mut caps = [0u32; 4];
    caps[0] = 1 << 30 | 1 << 31;
    caps[1] = 1 << (41 - 32);
    type AddCaps = unsafe extern "system" fn(Jvmti, *const [u32; 4]) -> c_int;
    // SAFETY: slot ADD_CAPABILITIES has this type; `caps` has the struct's layout.
    let err = unsafe { function::<AddCaps>(env, ADD_CAPABILITIES)(env, &caps) };
    if err != 0 {
        return Err(format!("the JVM refused the capabilities the agent needs (JVMTI error {err})"));
    }
    let mut callbacks: [*const c_void; CALLBACK_SLOTS] = [std::ptr::null(); CALLBACK_SLOTS];
    callbacks[(EVENT_VM_INIT - 50) as usize] = vm_init as *const c_void;
    callbacks[(EVENT_NATIVE_METHOD_BIND - 50) as usize] = native_method_bind as *const c_void;
    callbacks[(EVENT_GC_FINISH - 50) as usize] = gc_finish as *const c_void;
    type SetCallbacks = unsafe extern "system" fn(Jvmti, *const c_void, jint) -> c_int;
    let size = std::mem::size_of_val(&callbacks) as jint;
    // SAFETY: slot SET_EVENT_CALLBACKS has this type; the array has the struct's layout.
    let err =
        unsafe { function::<SetCallbacks>(env, SET_EVENT_CALLBACKS)(env, callbacks.as_ptr().cast(), size) };
    if err != 0 {
        return Err(format!("cannot set event callbacks (JVMTI error {err})"));
    }
    type SetMode = unsafe extern "C" fn(Jvmti, c_int, c_int, jthread, ...) -> c_int;
    for event in [EVENT_VM_INIT, EVENT_NATIVE_METHOD_BIND, EVENT_GC_FINISH] {
        // SAFETY: slot SET_EVENT_NOTIFICATION_MODE has this (variadic) type.
        let err = unsafe {
            function::<SetMode>(env, SET_EVENT_NOTIFICATION_MODE)(
                env,
                JVMTI_ENABLE,
                event,
                std::ptr::null_mut(),
            )
        };
        if err != 0 {
            return Err(format!("cannot enable JVMTI event {event} (error {err})"));
        }
    }
    Ok(())
}

extern "system" fn vm_init(_: Jvmti, jni: *mut JNIEnv, _: jthread) {
    // SAFETY: the JVM passes the VM-init thread's live JNIEnv.
    let Ok(mut env) = (unsafe { jni::JNIEnv::from_raw(jni) }) else { return };
    if let Err(e) = memquota_core::jvm::install(&mut env) {
        memquota_core::seam::text::write_stderr(&format!("{e}\n"));
    }
    if !crate::jvm::gate::installed() {
        memquota_core::seam::text::write_stderr(
            "memquota: warning: Unsafe.allocateMemory could not be gated: native memory is counted but no request is refused\n",
        );
    }
}

extern "system" fn gc_finish(_: Jvmti) {
    memquota_core::jvm::gc_finished();
}

/// Swaps in the gates for `jdk.internal.misc.Unsafe`'s allocation natives as the JVM
/// binds them.
extern "system" fn native_method_bind(
    env: Jvmti,
    _: *mut JNIEnv,
    _: jthread,
    method: jmethodID,
    address: *mut c_void,
    new_address: *mut *mut c_void,
) {
    // SAFETY: `env` is live during the callback and `method` is the method being bound.
    let Some((class, name)) = (unsafe { describe(env, method) }) else { return };
    if class != "Ljdk/internal/misc/Unsafe;" {
        return;
    }
    if let Some(gate) = crate::jvm::gate::gate_for(&name, address) {
        // SAFETY: the JVM passes a writable slot for the replacement address.
        unsafe { *new_address = gate };
    }
}

/// The declaring class's signature and the name of `method`.
///
/// # Safety
/// `env` is live and `method` a valid method id.
unsafe fn describe(env: Jvmti, method: jmethodID) -> Option<(String, String)> {
    type GetName = unsafe extern "system" fn(
        Jvmti,
        jmethodID,
        *mut *mut c_char,
        *mut *mut c_char,
        *mut *mut c_char,
    ) -> c_int;
    type GetClass = unsafe extern "system" fn(Jvmti, jmethodID, *mut jclass) -> c_int;
    type GetSig = unsafe extern "system" fn(Jvmti, jclass, *mut *mut c_char, *mut *mut c_char) -> c_int;
    let mut name: *mut c_char = std::ptr::null_mut();
    let mut class: jclass = std::ptr::null_mut();
    let mut sig: *mut c_char = std::ptr::null_mut();
    let null = std::ptr::null_mut();
    // SAFETY: `env` is live (the contract); slot GET_METHOD_NAME is GetMethodName.
    let get_name = unsafe { function::<GetName>(env, GET_METHOD_NAME) };
    // SAFETY: `method` is valid (the contract); `name` is a valid out-pointer, and
    // JVMTI accepts null for the signature outputs we do not want.
    if unsafe { get_name(env, method, &mut name, null, null) } != 0 {
        return None;
    }
    // SAFETY: `name` was just allocated by this JVMTI environment.
    let name = unsafe { take_string(env, name) };
    // SAFETY: `env` is live; slot GET_METHOD_DECLARING_CLASS is GetMethodDeclaringClass.
    let get_class = unsafe { function::<GetClass>(env, GET_METHOD_DECLARING_CLASS) };
    // SAFETY: `method` is valid (the contract); `class` is a valid out-pointer.
    if unsafe { get_class(env, method, &mut class) } != 0 {
        return None;
    }
    // SAFETY: `env` is live; slot GET_CLASS_SIGNATURE is GetClassSignature.
    let get_sig = unsafe { function::<GetSig>(env, GET_CLASS_SIGNATURE) };
    // SAFETY: `class` was just returned by the JVM; `sig` is a valid out-pointer, and
    // JVMTI accepts null for the generic signature we do not want.
    if unsafe { get_sig(env, class, &mut sig, null) } != 0 {
        return None;
    }
    // SAFETY: `sig` was just allocated by this JVMTI environment.
    let sig = unsafe { take_string(env, sig) };
    Some((sig, name))
}

/// Copies a JVMTI-allocated string and gives it back to the JVM.
///
/// # Safety
/// `s` is null or a string the JVMTI environment `env` allocated.
unsafe fn take_string(env: Jvmti, s: *mut c_char) -> String {
    if s.is_null() {
        return String::new();
    }
    // SAFETY: JVMTI strings are NUL-terminated modified UTF-8.
    let owned = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
    type Dealloc = unsafe extern "system" fn(Jvmti, *mut c_uchar) -> c_int;
    // SAFETY: slot DEALLOCATE has this type; `s` came from this environment.
    unsafe { function::<Dealloc>(env, DEALLOCATE)(env, s.cast()) };
    owned
}
