//! C++ `operator new` and `operator delete`: all 20, or the counts break (a jemalloc
//! that owns `new` while we own only `free` drove the counters to -25 GB).
//!
//! A refused throwing `new` calls the installed new-handler and throws
//! `std::bad_alloc`, like libstdc++'s own, with the C++ runtime of the calling code,
//! found at run time among the loaded objects (`cxx_runtime.rs`): this library must
//! not depend on one.

use crate::malloc::cxx_runtime::{no_runtime, Runtime};
use crate::malloc::exports::{cxx_alloc, cxx_free};
use libc::{c_void, size_t};

fn new_or_throw(n: size_t, align: Option<size_t>) -> *mut c_void {
    let p = cxx_alloc(n, align);
    if !p.is_null() {
        return p;
    }
    refused(n, align)
}

/// libstdc++'s `operator new` loop past a refusal: retry while a new-handler is
/// installed, else throw `std::bad_alloc`; with no C++ runtime loaded, abort.
#[cold]
#[inline(never)]
fn refused(n: size_t, align: Option<size_t>) -> *mut c_void {
    let Some(runtime) = Runtime::of_caller() else { no_runtime() };
    loop {
        let Some(handler) = runtime.new_handler() else { runtime.throw_bad_alloc() };
        // SAFETY: the handler the program installed; it frees memory, throws, or ends
        // the program.
        unsafe { handler() };
        let p = cxx_alloc(n, align);
        if !p.is_null() {
            return p;
        }
    }
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
