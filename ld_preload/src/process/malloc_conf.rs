//! `MALLOC_CONF`, the variable every jemalloc user knows, for memquota's jemalloc,
//! which is built with the `_rjem_` prefix and so reads only `_RJEM_MALLOC_CONF`.
//!
//! jemalloc reads its options once, when it starts: at the first allocation in the
//! process, which comes before this library's constructor (another library's
//! constructor allocates first: libselinux's for `ls`, libstdc++'s emergency pool for
//! any C++ program). So the options cannot be handed over from the constructor, nor
//! from any one entry point. Instead the link wraps jemalloc's only call to
//! `secure_getenv` (`build.rs`): when jemalloc, starting, asks for
//! `_RJEM_MALLOC_CONF`, it is given `MALLOC_CONF` and `_RJEM_MALLOC_CONF` joined by a
//! comma. jemalloc parses both, the prefixed one last, so it wins an option both set,
//! and every option takes effect exactly as if jemalloc had read `MALLOC_CONF` itself,
//! whichever call started it. jemalloc names the options it does not know itself
//! (`<jemalloc>: Invalid conf pair: ...`); the constructor names the ones that have
//! no effect under memquota ([`warn_about_what_has_no_effect`]).

use libc::c_char;
use memquota_core::seam::{process, text};
use std::cell::UnsafeCell;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering::*};

/// The variable jemalloc asks for: its own prefix, then `MALLOC_CONF`.
const JEMALLOC_VAR: &CStr = c"_RJEM_MALLOC_CONF";
/// The variable jemalloc users know.
const MALLOC_CONF: &CStr = c"MALLOC_CONF";

/// Room for both variables, a comma and the NUL.
const CAPACITY: usize = 4096;

/// The joined options jemalloc is handed when both variables are set.
struct Joined(UnsafeCell<[u8; CAPACITY]>);

// SAFETY: written only by the one caller that set `ASKED` (jemalloc starting, under
// its initialisation lock), before the pointer is handed to jemalloc; never written
// after, and read only through that pointer.
unsafe impl Sync for Joined {}

static JOINED: Joined = Joined(UnsafeCell::new([0; CAPACITY]));
/// jemalloc asked for its variable (it does once, when it starts).
static ASKED: AtomicBool = AtomicBool::new(false);
/// Both variables did not fit in [`JOINED`]: jemalloc got `_RJEM_MALLOC_CONF` alone.
static TOO_LONG: AtomicBool = AtomicBool::new(false);

/// Writes the pieces joined by commas and a NUL into `buf`; false (nothing usable
/// written) if they do not fit.
fn join_into(buf: &mut [u8], pieces: &[&[u8]]) -> bool {
    let mut len = 0;
    for (i, piece) in pieces.iter().enumerate() {
        let comma = usize::from(i > 0);
        if len + comma + piece.len() >= buf.len() {
            return false;
        }
        if comma == 1 {
            buf[len] = b',';
        }
        buf[len + comma..len + comma + piece.len()].copy_from_slice(piece);
        len += comma + piece.len();
    }
    buf[len] = 0;
    true
}

/// What jemalloc is given for its variable: memquota's own option if neither string
/// chooses how jemalloc purges ([`process::added_jemalloc_options`]), then `plain`
/// (`MALLOC_CONF`), then `prefixed` (`_RJEM_MALLOC_CONF`, what it would have got),
/// either of them null when unset. Allocates nothing: jemalloc is starting.
///
/// # Safety
/// `plain` and `prefixed` are null or NUL-terminated strings that live as long as the
/// process's environment. Called once (the caller holds `ASKED`).
unsafe fn options_for_jemalloc(plain: *const c_char, prefixed: *mut c_char) -> *mut c_char {
    let set = |p: *const c_char| {
        // SAFETY: null or a NUL-terminated string (this function's contract).
        unsafe { as_cstr(p) }.filter(|s| !s.is_empty()).map(CStr::to_bytes)
    };
    let (first, second) = (set(plain), set(prefixed.cast_const()));
    // SAFETY: JOINED is written only here (see its Sync impl): the caller set ASKED.
    let buf = unsafe { &mut *JOINED.0.get() };
    if let Some(ours) = process::added_jemalloc_options(&[text(first), text(second)]) {
        let mut pieces: [&[u8]; 3] = [ours.as_bytes(), b"", b""];
        let mut n = 1;
        for piece in [first, second].into_iter().flatten() {
            pieces[n] = piece;
            n += 1;
        }
        if join_into(buf, &pieces[..n]) {
            return buf.as_mut_ptr().cast();
        }
        // Too long with memquota's option: the user's options alone, as below.
    }
    match (first, second) {
        (Some(first), Some(second)) => {
            if join_into(buf, &[first, second]) {
                buf.as_mut_ptr().cast()
            } else {
                TOO_LONG.store(true, Relaxed);
                prefixed
            }
        }
        (Some(_), None) => plain.cast_mut(),
        (None, _) => prefixed,
    }
}

/// A set variable's options as text; a string that is not UTF-8 is one jemalloc
/// rejects, so it chooses nothing.
fn text(options: Option<&[u8]>) -> &str {
    std::str::from_utf8(options.unwrap_or_default()).unwrap_or_default()
}

/// # Safety
/// `p` is null or a NUL-terminated string that outlives `'a`.
unsafe fn as_cstr<'a>(p: *const c_char) -> Option<&'a CStr> {
    // SAFETY: non-null here, so NUL-terminated and live (this function's contract).
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) })
}

/// The wrapper the link puts in front of jemalloc's `secure_getenv` (build.rs).
/// Not in this crate's unit tests: their link has no `--wrap`.
#[cfg(not(test))]
mod wrap {
    use super::*;

    extern "C" {
        /// The real `secure_getenv`, as the linker's `--wrap` names it.
        fn __real_secure_getenv(name: *const c_char) -> *mut c_char;
    }

    // `__wrap_secure_getenv`, hidden: the link resolves jemalloc's call to it, and it
    // stays out of the library's exports (a `#[no_mangle]` function would not).
    std::arch::global_asm!(
        ".pushsection .text.__wrap_secure_getenv,\"ax\",@progbits",
        ".globl __wrap_secure_getenv",
        ".hidden __wrap_secure_getenv",
        ".type __wrap_secure_getenv,@function",
        "__wrap_secure_getenv:",
        "jmp {wrapped}",
        ".size __wrap_secure_getenv, . - __wrap_secure_getenv",
        ".popsection",
        wrapped = sym secure_getenv,
    );

    /// `secure_getenv` as jemalloc sees it: its own variable comes with `MALLOC_CONF`
    /// in front, the first time it is asked for (when jemalloc starts).
    extern "C" fn secure_getenv(name: *const c_char) -> *mut c_char {
        // SAFETY: the caller's argument, passed on: a NUL-terminated name.
        let value = unsafe { __real_secure_getenv(name) };
        // SAFETY: secure_getenv's argument is null or a NUL-terminated name.
        if unsafe { as_cstr(name) } != Some(JEMALLOC_VAR) || ASKED.swap(true, AcqRel) {
            return value;
        }
        // SAFETY: a NUL-terminated name.
        let plain = unsafe { __real_secure_getenv(MALLOC_CONF.as_ptr()) };
        // SAFETY: both are null or strings in the environment; this caller set ASKED.
        unsafe { options_for_jemalloc(plain, value) }
    }
}

/// An option that jemalloc accepts but that has no effect under memquota: its name,
/// the values that are what memquota does anyway, and why.
struct NoEffect {
    name: &'static str,
    harmless: &'static [&'static str],
    why: &'static str,
}

const NO_EFFECT: &[NoEffect] = &[NoEffect {
    name: "zero_realloc",
    harmless: &["free"],
    why: "realloc(p, 0) frees p and returns NULL, as glibc's does",
}];

/// The `name:value` pairs of a jemalloc options string that have no effect here.
fn no_effect_in(options: &str) -> impl Iterator<Item = (&str, &'static str)> {
    options.split(',').filter_map(|pair| {
        let (name, value) = pair.split_once(':')?;
        let rule = NO_EFFECT.iter().find(|r| r.name == name)?;
        (!rule.harmless.contains(&value)).then_some((pair, rule.why))
    })
}

/// The constructor's part, after jemalloc has started: one line on stderr for each
/// setting that was given but does not take effect.
pub(crate) fn warn_about_what_has_no_effect() {
    let env = |var: &CStr| {
        let name = var.to_str().unwrap_or_default();
        std::env::var(name).ok().filter(|v| !v.is_empty())
    };
    let plain = env(MALLOC_CONF);
    if let Some(value) = &plain {
        if !ASKED.load(Acquire) {
            warn(&format!(
                "memquota: MALLOC_CONF={value:?} ignored: this jemalloc did not read its options from the environment\n"
            ));
        } else if TOO_LONG.load(Relaxed) {
            warn(&format!(
                "memquota: MALLOC_CONF ignored: with _RJEM_MALLOC_CONF it is longer than {} bytes\n",
                CAPACITY - 2
            ));
        }
    }
    for (var, value) in [("MALLOC_CONF", plain), ("_RJEM_MALLOC_CONF", env(JEMALLOC_VAR))] {
        for (pair, why) in no_effect_in(value.as_deref().unwrap_or_default()) {
            warn(&format!("memquota: {var}: {pair} has no effect: {why}\n"));
        }
    }
    if let Some(options) = programs_malloc_conf() {
        warn(&format!(
            "memquota: the program's malloc_conf {options:?} is for the jemalloc it was linked with, which memquota's replaces: ignored (set MALLOC_CONF instead)\n"
        ));
    }
}

/// The options a program linked with jemalloc compiled in (`const char *malloc_conf
/// = "..."`): read by that jemalloc, which memquota's replaces.
fn programs_malloc_conf() -> Option<String> {
    // SAFETY: a lookup by a NUL-terminated name; RTLD_DEFAULT searches the program and
    // its libraries. Not this library: it does not export the name.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"malloc_conf".as_ptr()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: jemalloc's `malloc_conf` is a `const char *` variable, so `sym` points to
    // a readable, aligned pointer.
    let value = unsafe { *sym.cast::<*const c_char>() };
    // SAFETY: jemalloc reads that pointer as a NUL-terminated string, or null.
    let options = unsafe { as_cstr(value) }?;
    Some(options.to_string_lossy().into_owned()).filter(|s| !s.is_empty())
}

fn warn(line: &str) {
    text::write_stderr(line);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_with_commas_and_a_nul_or_not_at_all() {
        let mut buf = [0xffu8; 16];
        assert!(!join_into(&mut buf, &[b"narenas:1", b"tcache:false"]), "22 bytes do not fit in 16");
        assert!(join_into(&mut buf, &[b"a:1", b"b:2"]));
        assert_eq!(&buf[..8], b"a:1,b:2\0");
        assert!(join_into(&mut buf, &[b"a:1", b"b:2", b"c:3"]));
        assert_eq!(&buf[..12], b"a:1,b:2,c:3\0");
        let mut exact = [0u8; 8];
        assert!(join_into(&mut exact, &[b"a:1", b"b:2"]), "7 bytes and the NUL fit in 8");
        assert!(!join_into(&mut exact, &[b"a:1", b"b:22"]));
    }

    #[test]
    fn jemalloc_gets_memquotas_option_then_both_variables_the_prefixed_one_last() {
        let plain = c"dirty_decay_ms:0,narenas:2";
        let prefixed = c"dirty_decay_ms:5000".to_owned().into_raw();
        let neutral = c"tcache:false".to_owned().into_raw();
        let null = std::ptr::null_mut();
        let join = |a: *const c_char, b: *mut c_char| {
            // SAFETY: null or NUL-terminated strings that outlive the test; no other test
            // calls this, and each result is read before the next call writes JOINED.
            unsafe { options_for_jemalloc(a, b) }
        };
        let got = |p: *mut c_char| {
            // SAFETY: options_for_jemalloc returns one of its arguments or JOINED, all
            // NUL-terminated and alive for this test.
            unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned()
        };
        let ours = process::added_jemalloc_options(&[]).unwrap();
        // A user who chose how jemalloc purges gets exactly their options.
        assert_eq!(join(null, prefixed), prefixed, "unchanged");
        assert_eq!(join(c"".as_ptr(), prefixed), prefixed, "empty is unset");
        assert_eq!(got(join(plain.as_ptr(), null)), "dirty_decay_ms:0,narenas:2");
        assert_eq!(got(join(plain.as_ptr(), prefixed)), "dirty_decay_ms:0,narenas:2,dirty_decay_ms:5000");
        assert_eq!(got(join(c"narenas:2".as_ptr(), prefixed)), "narenas:2,dirty_decay_ms:5000");
        // Otherwise memquota's option comes first, so that the user's win.
        assert_eq!(got(join(null, null)), ours);
        assert_eq!(got(join(c"".as_ptr(), neutral)), format!("{ours},tcache:false"));
        assert_eq!(got(join(c"narenas:2".as_ptr(), neutral)), format!("{ours},narenas:2,tcache:false"));
        assert!(!TOO_LONG.load(Relaxed));
        // When memquota's option does not fit beside them, the user's alone.
        let long = std::ffi::CString::new(format!("narenas:{}", "1".repeat(CAPACITY - 12))).unwrap();
        assert_eq!(join(long.as_ptr(), null), long.as_ptr().cast_mut(), "MALLOC_CONF alone fits");
        assert!(!TOO_LONG.load(Relaxed));
        // SAFETY: from into_raw above, not used after.
        drop(unsafe { std::ffi::CString::from_raw(prefixed) });
        // SAFETY: as above.
        drop(unsafe { std::ffi::CString::from_raw(neutral) });
    }

    #[test]
    fn only_options_without_effect_are_named() {
        let found: Vec<_> =
            no_effect_in("dirty_decay_ms:0,zero_realloc:alloc,narenas:2,zero_realloc:free").collect();
        assert_eq!(found, [("zero_realloc:alloc", NO_EFFECT[0].why)]);
        assert_eq!(no_effect_in("").count(), 0);
        assert_eq!(no_effect_in("zero_realloc").count(), 0, "not a pair: jemalloc says so itself");
    }
}
