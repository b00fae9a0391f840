//! C++ `operator new` and `operator delete`: all 20, or the counts break (a jemalloc
//! that owns `new` while we own only `free` drove the counters to -25 GB).
//!
//! A refused throwing `new` calls the installed new-handler, like libstdc++, and
//! throws `std::bad_alloc` through `__cxa_throw`, found at run time: a C++ program
//! has libstdc++ loaded, and this library must not depend on it.

use crate::malloc::{cxx_alloc, cxx_free};
use libc::{c_void, size_t};

type Handler = unsafe extern "C-unwind" fn();

unsafe fn symbol(name: &std::ffi::CStr) -> *mut c_void {
    // SAFETY: RTLD_DEFAULT with a NUL-terminated name.
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
        // SAFETY: `std::get_new_handler()` has this signature.
        let get = unsafe { symbol(c"_ZSt15get_new_handlerv") };
        if !get.is_null() {
            // SAFETY: as above.
            let get: unsafe extern "C" fn() -> Option<Handler> = unsafe { std::mem::transmute(get) };
            // SAFETY: calling the program's own new-handler, as libstdc++ would.
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
    // SAFETY: symbol lookups by NUL-terminated names.
    let (alloc, throw, tinfo, vtable, dtor) = unsafe {
        (
            symbol(c"__cxa_allocate_exception"),
            symbol(c"__cxa_throw"),
            symbol(c"_ZTISt9bad_alloc"),
            symbol(c"_ZTVSt9bad_alloc"),
            symbol(c"_ZNSt9bad_allocD1Ev"),
        )
    };
    if [alloc, throw, tinfo, vtable, dtor].iter().any(|p| p.is_null()) {
        // No C++ runtime to throw with: the report is out; stop here.
        std::process::abort();
    }
    // SAFETY: the Itanium C++ ABI: allocate the exception, construct a bad_alloc
    // (its only member is the vtable pointer, which points two words into the vtable,
    // past offset-to-top and typeinfo), and throw it with its typeinfo and destructor.
    unsafe {
        let alloc: unsafe extern "C" fn(size_t) -> *mut *const c_void = std::mem::transmute(alloc);
        let throw: unsafe extern "C-unwind" fn(*mut c_void, *mut c_void, *mut c_void) -> ! =
            std::mem::transmute(throw);
        let obj = alloc(std::mem::size_of::<*const c_void>());
        *obj = (vtable as *const *const c_void).add(2).cast();
        throw(obj.cast(), tinfo, dtor)
    }
}

macro_rules! operators {
    ($( $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $body:expr; )*) => {$(
        /// A C++ allocation operator (Itanium ABI name).
        ///
        /// # Safety
        /// As the C++ operator.
        #[allow(non_snake_case)]
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C-unwind" fn $name($($arg: $ty),*) -> $ret {
            $body
        }
    )*};
}

operators! {
    // new, new[]
    _Znwm(n: size_t) -> *mut c_void = new_or_throw(n, None);
    _Znam(n: size_t) -> *mut c_void = new_or_throw(n, None);
    // nothrow
    _ZnwmRKSt9nothrow_t(n: size_t, _t: *const c_void) -> *mut c_void = cxx_alloc(n, None);
    _ZnamRKSt9nothrow_t(n: size_t, _t: *const c_void) -> *mut c_void = cxx_alloc(n, None);
    // aligned
    _ZnwmSt11align_val_t(n: size_t, a: size_t) -> *mut c_void = new_or_throw(n, Some(a));
    _ZnamSt11align_val_t(n: size_t, a: size_t) -> *mut c_void = new_or_throw(n, Some(a));
    _ZnwmSt11align_val_tRKSt9nothrow_t(n: size_t, a: size_t, _t: *const c_void) -> *mut c_void = cxx_alloc(n, Some(a));
    _ZnamSt11align_val_tRKSt9nothrow_t(n: size_t, a: size_t, _t: *const c_void) -> *mut c_void = cxx_alloc(n, Some(a));
    // delete, delete[]: the size and alignment come from jemalloc
    _ZdlPv(p: *mut c_void) -> () = cxx_free(p);
    _ZdaPv(p: *mut c_void) -> () = cxx_free(p);
    _ZdlPvm(p: *mut c_void, _n: size_t) -> () = cxx_free(p);
    _ZdaPvm(p: *mut c_void, _n: size_t) -> () = cxx_free(p);
    _ZdlPvRKSt9nothrow_t(p: *mut c_void, _t: *const c_void) -> () = cxx_free(p);
    _ZdaPvRKSt9nothrow_t(p: *mut c_void, _t: *const c_void) -> () = cxx_free(p);
    _ZdlPvSt11align_val_t(p: *mut c_void, _a: size_t) -> () = cxx_free(p);
    _ZdaPvSt11align_val_t(p: *mut c_void, _a: size_t) -> () = cxx_free(p);
    _ZdlPvmSt11align_val_t(p: *mut c_void, _n: size_t, _a: size_t) -> () = cxx_free(p);
    _ZdaPvmSt11align_val_t(p: *mut c_void, _n: size_t, _a: size_t) -> () = cxx_free(p);
    _ZdlPvSt11align_val_tRKSt9nothrow_t(p: *mut c_void, _a: size_t, _t: *const c_void) -> () = cxx_free(p);
    _ZdaPvSt11align_val_tRKSt9nothrow_t(p: *mut c_void, _a: size_t, _t: *const c_void) -> () = cxx_free(p);
}
