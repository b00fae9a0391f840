//! C++ `operator new` and `operator delete`: all 20, or the counts break (a jemalloc
//! that owns `new` while we own only `free` drove the counters to -25 GB).
//!
//! A refused throwing `new` calls the installed new-handler, like libstdc++, and
//! throws `std::bad_alloc` through `__cxa_throw`, found at run time: a C++ program
//! has libstdc++ loaded, and this library must not depend on it.

use crate::malloc::{cxx_alloc, cxx_free};
use libc::{c_void, size_t};

type Handler = unsafe extern "C-unwind" fn();

/// The address of the C++ runtime's symbol `name`, or null. A plain lookup, so a
/// safe function: using what it returns is where the contracts are.
fn symbol(name: &std::ffi::CStr) -> *mut c_void {
    // SAFETY: dlsym's only requirement: RTLD_DEFAULT and a NUL-terminated name.
    unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
}

/// libstdc++'s `operator new` loop: retry while a new-handler is installed, else
/// throw `std::bad_alloc`.
fn new_or_throw(n: size_t, align: Option<size_t>) -> *mut c_void {
    loop {
        let p = cxx_alloc(n, align);
        if !p.is_null() {
            return p;
        }
        let get = symbol(c"_ZSt15get_new_handlerv");
        if !get.is_null() {
            // SAFETY: the non-null address of `std::get_new_handler()`, which has this
            // signature (Itanium ABI: no arguments, returns a nullable function pointer).
            let get: unsafe extern "C" fn() -> Option<Handler> = unsafe { std::mem::transmute(get) };
            // SAFETY: `std::get_new_handler()` has no preconditions.
            if let Some(handler) = unsafe { get() } {
                // SAFETY: the handler the program installed; it frees memory or throws.
                unsafe { handler() };
                continue;
            }
        }
        throw_bad_alloc();
    }
}

fn throw_bad_alloc() -> ! {
    let (alloc, throw, tinfo, vtable, dtor) = (
        symbol(c"__cxa_allocate_exception"),
        symbol(c"__cxa_throw"),
        symbol(c"_ZTISt9bad_alloc"),
        symbol(c"_ZTVSt9bad_alloc"),
        symbol(c"_ZNSt9bad_allocD1Ev"),
    );
    if [alloc, throw, tinfo, vtable, dtor].iter().any(|p| p.is_null()) {
        // No C++ runtime to throw with: the report is out; stop here.
        std::process::abort();
    }
    // The Itanium C++ ABI: allocate the exception, construct a bad_alloc in it (its
    // only member is the vtable pointer), and throw it with its typeinfo and destructor.
    // SAFETY: the non-null address of `__cxa_allocate_exception`, which has this signature.
    let alloc: unsafe extern "C" fn(size_t) -> *mut *const c_void = unsafe { std::mem::transmute(alloc) };
    // SAFETY: the non-null address of `__cxa_throw`, which has this signature and unwinds.
    let throw: unsafe extern "C-unwind" fn(*mut c_void, *mut c_void, *mut c_void) -> ! =
        unsafe { std::mem::transmute(throw) };
    // SAFETY: __cxa_allocate_exception takes any size; it returns room for the object or
    // terminates the program itself.
    let obj = unsafe { alloc(std::mem::size_of::<*const c_void>()) };
    // SAFETY: a class's vtable pointer points two words into its vtable, past
    // offset-to-top and typeinfo: within bad_alloc's vtable, which is longer.
    let vptr = unsafe { (vtable as *const *const c_void).add(2) };
    // SAFETY: `obj` is the fresh exception object, aligned and sized for one pointer.
    unsafe { *obj = vptr.cast() };
    // SAFETY: `obj` holds a constructed bad_alloc; `tinfo` and `dtor` are its typeinfo
    // and destructor, as __cxa_throw requires. It does not return.
    unsafe { throw(obj.cast(), tinfo, dtor) }
}

macro_rules! new_operators {
    ($( $name:ident($($arg:ident: $ty:ty),*) = $body:expr; )*) => {$(
        /// A C++ `operator new` (Itanium ABI name).
        ///
        /// # Safety
        /// None for the call. The block goes back only to this allocator.
        #[allow(non_snake_case)]
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C-unwind" fn $name($($arg: $ty),*) -> *mut c_void {
            $body
        }
    )*};
}

macro_rules! delete_operators {
    ($( $name:ident($p:ident: *mut c_void $(, $arg:ident: $ty:ty)*); )*) => {$(
        /// A C++ `operator delete` (Itanium ABI name): the size and alignment, where
        /// given, are not relied on; they come from jemalloc.
        ///
        /// # Safety
        /// The pointer is null, or a live block of this allocator (from C++ `new` or
        /// the malloc family) not given back since; it is not used after.
        #[allow(non_snake_case)]
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C-unwind" fn $name($p: *mut c_void $(, $arg: $ty)*) {
            // SAFETY: this operator's contract is cxx_free's.
            unsafe { cxx_free($p) }
        }
    )*};
}

new_operators! {
    // new, new[]
    _Znwm(n: size_t) = new_or_throw(n, None);
    _Znam(n: size_t) = new_or_throw(n, None);
    // nothrow
    _ZnwmRKSt9nothrow_t(n: size_t, _t: *const c_void) = cxx_alloc(n, None);
    _ZnamRKSt9nothrow_t(n: size_t, _t: *const c_void) = cxx_alloc(n, None);
    // aligned
    _ZnwmSt11align_val_t(n: size_t, a: size_t) = new_or_throw(n, Some(a));
    _ZnamSt11align_val_t(n: size_t, a: size_t) = new_or_throw(n, Some(a));
    _ZnwmSt11align_val_tRKSt9nothrow_t(n: size_t, a: size_t, _t: *const c_void) = cxx_alloc(n, Some(a));
    _ZnamSt11align_val_tRKSt9nothrow_t(n: size_t, a: size_t, _t: *const c_void) = cxx_alloc(n, Some(a));
}

// delete, delete[]: plain, sized, nothrow, aligned
delete_operators! {
    _ZdlPv(p: *mut c_void);
    _ZdaPv(p: *mut c_void);
    _ZdlPvm(p: *mut c_void, _n: size_t);
    _ZdaPvm(p: *mut c_void, _n: size_t);
    _ZdlPvRKSt9nothrow_t(p: *mut c_void, _t: *const c_void);
    _ZdaPvRKSt9nothrow_t(p: *mut c_void, _t: *const c_void);
    _ZdlPvSt11align_val_t(p: *mut c_void, _a: size_t);
    _ZdaPvSt11align_val_t(p: *mut c_void, _a: size_t);
    _ZdlPvmSt11align_val_t(p: *mut c_void, _n: size_t, _a: size_t);
    _ZdaPvmSt11align_val_t(p: *mut c_void, _n: size_t, _a: size_t);
    _ZdlPvSt11align_val_tRKSt9nothrow_t(p: *mut c_void, _a: size_t, _t: *const c_void);
    _ZdaPvSt11align_val_tRKSt9nothrow_t(p: *mut c_void, _a: size_t, _t: *const c_void);
}
