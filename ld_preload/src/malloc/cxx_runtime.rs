//! The C++ runtime a refused `new` throws `std::bad_alloc` with, and whose
//! new-handler it calls, found among the loaded objects when a `new` is refused: this
//! library must not depend on a C++ runtime, and the program's may be private to a
//! library loaded with `RTLD_LOCAL` (how Python loads every C++ extension), where
//! `dlsym(RTLD_DEFAULT)` does not see it.
//!
//! The runtime is the first of these three that defines everything a throw needs,
//! taken whole from one scope:
//!
//! 1. the global scope (`RTLD_DEFAULT`): a runtime the program was linked with, or
//!    one loaded `RTLD_GLOBAL`. The loader binds every object's references to the
//!    global scope before its own dependencies, so a library's `catch` clause and
//!    personality routine use that runtime even when the library was linked with
//!    another (seen: a libc++ library loaded `RTLD_LOCAL` into a libstdc++ program
//!    catches libstdc++'s `bad_alloc` and terminates on libc++abi's own);
//! 2. the calling code's, when the global scope has none: the first frame of the
//!    stack outside this library names the object that called `operator new`, and
//!    `dlsym` on that object's handle searches the object and its dependencies, the
//!    runtime it was linked with. With two libraries loaded `RTLD_LOCAL`, one on
//!    libstdc++ and one on libc++, each gets its own;
//! 3. each loaded libstdc++ or libc++, in load order, in its own scope: for a caller
//!    whose frame cannot be walked to (code with no unwind info) or whose own runtime
//!    is hidden (linked statically), the exception is still thrown where a `catch`
//!    compares type names.
//!
//! A library loaded with `RTLD_DEEPBIND` binds its own dependencies first; a refusal in
//! one, with another runtime in the global scope, gets the global one.
//!
//! With none, the process aborts, saying so on stderr. Nothing is cached: a runtime
//! can be loaded after a refusal, and this runs only when a `new` was refused.
//!
//! No lock of this library is held here, and none is taken: the loader's locks are
//! taken by `dladdr`, `dlopen`, `dlsym` and `dl_iterate_phdr` (the stack walk's too,
//! as the throw's own unwinding does), one at a time: never `dlopen` inside
//! `dl_iterate_phdr`'s callback, where its write lock is held (a `dlopen` on another
//! thread takes the two the other way round). What the loader allocates (an
//! error message when a `dlsym` finds nothing, the search list of an object it opens
//! by name for the first time) goes through the exported `malloc` under the ledger's
//! busy mark (counted, never refused), never through `operator new`, so it cannot
//! come back here.

use crate::malloc::thread::local;
use libc::{c_char, c_int, c_void, size_t};
use memquota_core::seam::hot;
use std::ffi::CStr;
use std::ptr::null_mut;

/// A program's new-handler.
pub(crate) type Handler = unsafe extern "C-unwind" fn();

/// One C++ runtime's entries for a throw of `std::bad_alloc`, all from one scope.
pub(crate) struct Runtime {
    /// `std::get_new_handler()`, absent from runtimes older than C++11.
    get_new_handler: Option<unsafe extern "C" fn() -> Option<Handler>>,
    /// `__cxa_get_globals()`: the thread's exception state, made on first use.
    get_globals: Option<unsafe extern "C" fn() -> *mut c_void>,
    allocate_exception: unsafe extern "C" fn(size_t) -> *mut *const c_void,
    throw: unsafe extern "C-unwind" fn(*mut c_void, *mut c_void, *mut c_void) -> !,
    /// `std::bad_alloc`'s typeinfo, vtable and destructor.
    typeinfo: *mut c_void,
    vtable: *const *const c_void,
    destructor: *mut c_void,
}

impl Runtime {
    /// The runtime whose `bad_alloc` the code that called `operator new` catches (see
    /// the module's docs for the order), or `None` when no loaded object has one.
    pub(crate) fn of_caller() -> Option<Runtime> {
        // The loader allocates as it looks (an error message for each miss, its
        // per-thread error state): under the busy mark, those few bytes are counted and
        // never refused, or a refusal of every small malloc (past the over-commit bound)
        // makes dlopen fail with "out of memory" and the runtime go unfound. No user
        // code runs until the mark is dropped.
        let _busy = hot::enter(local());
        // SAFETY: RTLD_DEFAULT is a valid scope for dlsym.
        unsafe { in_scope(libc::RTLD_DEFAULT) }.or_else(caller_scope).or_else(loaded_runtimes)
    }

    /// The new-handler the program installed in this runtime, if any.
    pub(crate) fn new_handler(&self) -> Option<Handler> {
        // SAFETY: `std::get_new_handler()` has no preconditions.
        self.get_new_handler.and_then(|get| unsafe { get() })
    }

    /// Throws `std::bad_alloc` with this runtime, as its own `operator new` does.
    pub(crate) fn throw_bad_alloc(&self) -> ! {
        // The Itanium C++ ABI: allocate the exception, construct a bad_alloc in it (its
        // only member is the vtable pointer), and throw it with its typeinfo and
        // destructor.
        let obj = {
            // The runtime allocates to throw: the exception object, and at a thread's
            // first throw its exception state, which for a runtime loaded by dlopen
            // lives in dynamic TLS that glibc mallocs at first use, and a NULL there is
            // fatal ("cannot allocate memory for thread-local data": DuckDB's worker
            // threads under a limit that refused every small malloc). Both are made
            // here under the ledger's busy mark, where a malloc is counted and never
            // refused, as in the slow path's own: an exception object and one TLS
            // block, a few hundred bytes per throw. The new-handler runs without it.
            let _busy = hot::enter(local());
            if let Some(get) = self.get_globals {
                // SAFETY: `__cxa_get_globals()` has no preconditions.
                unsafe { get() };
            }
            // SAFETY: __cxa_allocate_exception takes any size; it returns room for the
            // object or terminates the program itself.
            unsafe { (self.allocate_exception)(std::mem::size_of::<*const c_void>()) }
        };
        // SAFETY: a class's vtable pointer points two words into its vtable, past
        // offset-to-top and typeinfo: within bad_alloc's vtable, which is longer.
        let vptr = unsafe { self.vtable.add(2) };
        // SAFETY: `obj` is the fresh exception object, aligned and sized for one pointer.
        unsafe { *obj = vptr.cast() };
        // SAFETY: `obj` holds a constructed bad_alloc; `typeinfo` and `destructor` are
        // its typeinfo and destructor in the same runtime, as __cxa_throw requires. It
        // does not return.
        unsafe { (self.throw)(obj.cast(), self.typeinfo, self.destructor) }
    }
}

/// `dlsym(handle, name)`, or null; a miss's error message is cleared, so that the
/// program's next `dlerror()` does not report a lookup it never made.
///
/// # Safety
/// `handle` is `RTLD_DEFAULT` or a handle from `dlopen` not closed yet.
unsafe fn symbol(handle: *mut c_void, name: &CStr) -> *mut c_void {
    // SAFETY: a valid handle (this function's contract) and a NUL-terminated name.
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if p.is_null() {
        // SAFETY: dlerror has no preconditions.
        unsafe { libc::dlerror() };
    }
    p
}

/// The runtime whose entries `dlsym` finds through `handle`: in the object and its
/// dependencies for a `dlopen` handle, in the global scope for `RTLD_DEFAULT`.
///
/// # Safety
/// `handle` is `RTLD_DEFAULT` or a handle from `dlopen` not closed yet.
unsafe fn in_scope(handle: *mut c_void) -> Option<Runtime> {
    // SAFETY: a valid handle (this function's contract), for each lookup below.
    let find = |name: &CStr| Some(unsafe { symbol(handle, name) }).filter(|p| !p.is_null());
    // The one a C program has none of first: each miss costs the loader an error message.
    let throw = find(c"__cxa_throw")?;
    let allocate_exception = find(c"__cxa_allocate_exception")?;
    let typeinfo = find(c"_ZTISt9bad_alloc")?;
    let vtable = find(c"_ZTVSt9bad_alloc")?;
    let destructor = find(c"_ZNSt9bad_allocD1Ev")?;
    let get_new_handler = find(c"_ZSt15get_new_handlerv");
    let get_globals = find(c"__cxa_get_globals");
    Some(Runtime {
        // SAFETY: the address of `std::get_new_handler()`, which has this signature
        // (Itanium ABI: no arguments, returns a nullable function pointer).
        get_new_handler: get_new_handler.map(|p| unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> Option<Handler>>(p)
        }),
        // SAFETY: the address of `__cxa_get_globals()`, which has this signature (no
        // arguments, returns the thread's `__cxa_eh_globals`).
        get_globals: get_globals
            .map(|p| unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> *mut c_void>(p) }),
        // SAFETY: the address of `__cxa_allocate_exception`, which has this signature.
        allocate_exception: unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn(size_t) -> *mut *const c_void>(
                allocate_exception,
            )
        },
        // SAFETY: the address of `__cxa_throw`, which has this signature and unwinds.
        throw: unsafe {
            std::mem::transmute::<
                *mut c_void,
                unsafe extern "C-unwind" fn(*mut c_void, *mut c_void, *mut c_void) -> !,
            >(throw)
        },
        typeinfo,
        vtable: vtable.cast(),
        destructor,
    })
}

/// The runtime `name`'s object was linked with, if that object is loaded (`dlopen`
/// with `RTLD_NOLOAD` loads nothing); null: the main program, whose scope is the
/// global one.
///
/// # Safety
/// `name` is null or a NUL-terminated string.
unsafe fn runtime_of_object(name: *const c_char) -> Option<Runtime> {
    // SAFETY: null or a NUL-terminated name (this function's contract); NOLOAD only
    // takes a reference to an object already loaded.
    let handle = unsafe { libc::dlopen(name, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        // SAFETY: dlerror has no preconditions.
        unsafe { libc::dlerror() };
        return None;
    }
    // SAFETY: `handle` is open until the dlclose below.
    let runtime = unsafe { in_scope(handle) };
    // SAFETY: the reference taken above. The object stays loaded after (it was before
    // the dlopen), and so do the entries found in its scope.
    unsafe { libc::dlclose(handle) };
    runtime
}

/// The first three fields of glibc's `struct link_map` (`<link.h>`), the public ones.
#[repr(C)]
struct LinkMap {
    addr: usize,
    name: *const c_char,
    dynamic: *mut c_void,
}

/// `dladdr1`'s request for the object's `struct link_map` (`<dlfcn.h>`).
const RTLD_DL_LINKMAP: c_int = 2;

/// The runtime of the object that called `operator new`.
fn caller_scope() -> Option<Runtime> {
    let pc = caller_pc()?;
    // SAFETY: Dl_info is a plain C struct; zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let mut map: *mut LinkMap = null_mut();
    // SAFETY: valid out-pointers; with RTLD_DL_LINKMAP glibc stores the object's
    // link_map in `map`.
    let found = unsafe { libc::dladdr1(pc, &mut info, (&raw mut map).cast(), RTLD_DL_LINKMAP) };
    if found == 0 || map.is_null() {
        return None;
    }
    // SAFETY: a live link_map (the object holds the caller's frame, so it stays
    // loaded); its name is NUL-terminated, empty for the main program.
    let name = unsafe { (*map).name };
    // SAFETY: as above: null or NUL-terminated.
    let main = name.is_null() || unsafe { *name } == 0;
    // SAFETY: null or a NUL-terminated name.
    unsafe { runtime_of_object(if main { std::ptr::null() } else { name }) }
}

unsafe extern "C" {
    // libgcc_s's unwinder, which the library links already (Rust's std needs it).
    fn _Unwind_Backtrace(trace: extern "C" fn(*mut c_void, *mut c_void) -> c_int, arg: *mut c_void) -> c_int;
    fn _Unwind_GetIP(context: *mut c_void) -> usize;
}

/// `_Unwind_Reason_Code`: go on, or stop.
const URC_NO_REASON: c_int = 0;
const URC_NORMAL_STOP: c_int = 4;

/// The state of [`caller_pc`]'s walk.
struct Walk {
    /// Where this library is loaded.
    own: *mut c_void,
    /// The first PC outside it, once found.
    pc: *const c_void,
}

/// Where `addr`'s object is loaded, or null when no object holds it.
fn object_base(addr: *const c_void) -> *mut c_void {
    // SAFETY: Dl_info is a plain C struct; zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr takes any address and a valid out-pointer.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 {
        return null_mut();
    }
    info.dli_fbase
}

/// One frame of [`caller_pc`]'s walk.
extern "C" fn frame(context: *mut c_void, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Walk` that caller_pc passed, alive for the walk.
    let walk = unsafe { &mut *arg.cast::<Walk>() };
    // SAFETY: the unwinder's context for this frame.
    let ip = unsafe { _Unwind_GetIP(context) };
    if ip == 0 {
        return URC_NO_REASON;
    }
    // A return address: the call before it is the caller's, and may end its code.
    let pc = (ip - 1) as *const c_void;
    if object_base(pc) == walk.own {
        return URC_NO_REASON;
    }
    walk.pc = pc;
    URC_NORMAL_STOP
}

/// The first PC on this thread's stack outside this library: in the code that called
/// `operator new`, inlined or not. `None` when the walk ends before (code with no
/// unwind info), or at a PC no object holds (generated code).
fn caller_pc() -> Option<*const c_void> {
    let mut walk = Walk { own: object_base(caller_pc as *const c_void), pc: std::ptr::null() };
    // SAFETY: `frame` reads only `walk`, which outlives the call.
    unsafe { _Unwind_Backtrace(frame, (&raw mut walk).cast()) };
    Some(walk.pc).filter(|pc| !pc.is_null() && !object_base(*pc).is_null())
}

/// How many C++ runtimes [`loaded_runtimes`] tries, and the longest path it copies.
const CANDIDATES: usize = 4;
const PATH_MAX: usize = 1024;

/// The paths of the loaded C++ runtimes, copied out of the loader's list.
struct Candidates {
    paths: [[u8; PATH_MAX]; CANDIDATES],
    count: usize,
}

/// One object of [`loaded_runtimes`]'s `dl_iterate_phdr`: copies its path if it is a
/// libstdc++ or a libc++ (`libc++abi` included). Runs under the loader's write lock:
/// no call into the loader here.
extern "C" fn each_object(info: *mut libc::dl_phdr_info, _size: size_t, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Candidates` that loaded_runtimes passed, alive for the walk.
    let found = unsafe { &mut *arg.cast::<Candidates>() };
    // SAFETY: the loader's description of a loaded object, valid during the callback.
    let name = unsafe { (*info).dlpi_name };
    if name.is_null() {
        return 0;
    }
    // SAFETY: a NUL-terminated path (empty for the main program).
    let path = unsafe { CStr::from_ptr(name) }.to_bytes_with_nul();
    let file = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
    if !(file.starts_with(b"libstdc++") || file.starts_with(b"libc++")) || path.len() > PATH_MAX {
        return 0;
    }
    found.paths[found.count][..path.len()].copy_from_slice(path);
    found.count += 1;
    c_int::from(found.count == CANDIDATES)
}

/// The first loaded libstdc++ or libc++, in load order, that defines every entry.
fn loaded_runtimes() -> Option<Runtime> {
    let mut found = Candidates { paths: [[0; PATH_MAX]; CANDIDATES], count: 0 };
    // SAFETY: `each_object` reads only `found`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each_object), (&raw mut found).cast()) };
    found.paths[..found.count].iter().find_map(|path| {
        // SAFETY: a NUL-terminated path, copied whole by each_object.
        unsafe { runtime_of_object(path.as_ptr().cast()) }
    })
}

/// A refused `new` with no C++ runtime to throw with: say so, then abort (the
/// refusal's own report is out already).
pub(crate) fn no_runtime() -> ! {
    memquota_core::seam::text::write_stderr(
        "memquota: a C++ operator new was refused and no C++ runtime (libstdc++, libc++) was \
         found among the loaded objects to throw std::bad_alloc with; aborting\n",
    );
    std::process::abort()
}
