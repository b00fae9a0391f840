//! Two budgets in one process, loudly. A shared object that links this crate holds
//! its own budget: a JNI library with its own [`QuotaAlloc`](crate::QuotaAlloc)
//! loaded into a JVM that runs under the preload, or two such libraries, give the
//! process two limits, each blind to the other's allocations. [`check`] finds the
//! other copies and says so on stderr, in one line, once per set of copies.
//!
//! Every copy exports one data symbol, [`BUDGET`]. That is an exported symbol outside
//! `ld_preload/`, on purpose: a JNI library is `dlopen`ed `RTLD_LOCAL`, so nothing in
//! the global scope (`dlsym(RTLD_DEFAULT, ..)`) can see it; only a symbol in its own
//! dynamic table, looked up through a handle to it, tells another copy it is there.
//! It is data, not a function, and no code here names it: an exported symbol is
//! interposable, so in a library loaded after the preload `&BUDGET` would be the
//! preload's marker. Each copy finds its own object through a private static instead,
//! and every marker through `dlsym`. (An executable does not export it, so a Rust
//! program's own copy is seen only by itself, which is enough: it sees the others.)

use crate::base::sync::{AtomicBool, AtomicU8, Ordering::Relaxed};
use crate::base::text::write_stderr;

/// This copy's marker, found by the others with `dlsym`. 0 until a warning has named
/// this copy; then 1, so that a set of copies is reported once, by whichever looks
/// first. Never used by name (see the module docs).
#[export_name = "memquota_budget"]
pub static BUDGET: AtomicU8 = AtomicU8::new(0);

/// Set in a `fork` child: it has the parent's objects, which the parent looked
/// through, and the dynamic loader's lock may be held there for ever by a thread that
/// did not survive the fork (one walking the list of objects: another `init`, an
/// unwinding panic, a backtrace), so a look would wait for it.
static FORK_CHILD: AtomicBool = AtomicBool::new(false);

/// The fork child handler's part: no look from here on.
pub(crate) fn after_fork_child() {
    FORK_CHILD.store(true, Relaxed);
}

/// Looks through every loaded object for another copy's [`BUDGET`] and warns if some
/// copy involved has not been named in a warning yet. Not for the allocation path:
/// it calls the dynamic loader, which takes its lock and may allocate (charged as
/// usual). Not in a fork child (see [`FORK_CHILD`]).
pub(crate) fn check() {
    if FORK_CHILD.load(Relaxed) {
        return;
    }
    #[cfg(target_os = "linux")]
    linux::check();
}

#[cfg(target_os = "linux")]
mod linux {
    use super::write_stderr;
    use crate::base::sync::{AtomicBool, AtomicU8, Ordering::*};
    use libc::{c_int, c_void, dl_phdr_info, size_t};
    use std::ffi::{CStr, CString};

    const MARKER: &CStr = c"memquota_budget";
    /// Exported by `libmemquota.so` (the preload and JVMTI agent) alone.
    const PRELOAD_SYMBOL: &CStr = c"memquota_stats_json";

    /// Not exported, so never interposed: its address is in this copy's object.
    static ANCHOR: AtomicBool = AtomicBool::new(false);

    /// A copy of the budget: the object that holds it and its marker, if exported.
    struct Copy {
        base: *mut c_void,
        file: String,
        marker: Option<*const AtomicU8>,
        preload: bool,
    }

    impl Copy {
        fn warned(&self) -> bool {
            match self.marker {
                // SAFETY: a marker is another copy's `BUDGET`, an `AtomicU8` in an
                // object still loaded: no copy dlcloses another, and the handle this
                // came through was open when `dlsym` returned it.
                Some(m) => unsafe { &*m }.load(Acquire) != 0,
                None => ANCHOR.load(Acquire),
            }
        }

        fn mark_warned(&self) {
            match self.marker {
                // SAFETY: as in `warned`.
                Some(m) => unsafe { &*m }.store(1, Release),
                None => ANCHOR.store(true, Release),
            }
        }
    }

    pub(super) fn check() {
        let anchor: *const c_void = std::ptr::from_ref(&ANCHOR).cast();
        let Some((own_base, own_file)) = object_of(anchor) else { return };
        let mut own = Copy { base: own_base, file: own_file, marker: None, preload: false };
        let Some(names) = loaded_objects() else { return };
        let mut others: Vec<Copy> = Vec::new();
        for name in &names {
            // SAFETY: `name` is a NUL-terminated path; RTLD_NOLOAD never loads or
            // initialises anything, it only returns a handle to an object already
            // loaded (or null), which is closed below.
            let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
            if handle.is_null() {
                continue;
            }
            // SAFETY: `handle` is a live handle from dlopen; the name is NUL-terminated.
            let marker = unsafe { libc::dlsym(handle, MARKER.as_ptr()) }.cast_const();
            // SAFETY: `handle` is a live handle from dlopen; the name is NUL-terminated.
            let preload = unsafe { libc::dlsym(handle, PRELOAD_SYMBOL.as_ptr()) }.cast_const();
            // SAFETY: `handle` came from the successful dlopen above and is closed once.
            unsafe { libc::dlclose(handle) };
            // dlsym also searches the object's dependencies: the same marker can be
            // found through several handles, and in another object than `name`.
            let Some((base, file)) = (!marker.is_null()).then(|| object_of(marker)).flatten() else {
                continue;
            };
            let preload = !preload.is_null() && object_of(preload).is_some_and(|(b, _)| b == base);
            let copy = Copy { base, file, marker: Some(marker.cast()), preload };
            if base == own.base {
                own = copy;
            } else if !others.iter().any(|c| c.base == base) {
                others.push(copy);
            }
        }
        if others.is_empty() || (own.warned() && others.iter().all(Copy::warned)) {
            return;
        }
        own.mark_warned();
        others.iter().for_each(Copy::mark_warned);
        write_stderr(&message(&own, &others));
    }

    fn message(own: &Copy, others: &[Copy]) -> String {
        let kind = |c: &Copy| {
            if c.preload {
                "the LD_PRELOAD library / JVMTI agent"
            } else {
                "a memquota::QuotaAlloc"
            }
        };
        let mut text =
            format!("memquota: warning: two budgets in one process: {} ({}, this copy)", own.file, kind(own));
        for other in others {
            text.push_str(&format!(" and {} ({})", other.file, kind(other)));
        }
        text.push_str(" each hold their own limit and none sees the others' allocations; ");
        if own.preload || others.iter().any(|c| c.preload) {
            text.push_str(
                "keep one: under the preload, build the library with the system allocator instead of \
                 memquota::QuotaAlloc (its mallocs are then counted by the preload) and do not call \
                 memquota::jvm::install (the agent drives the JVM), or run without LD_PRELOAD\n",
            );
        } else {
            text.push_str(
                "keep one: give memquota::QuotaAlloc to one library only, or link the Rust code into one \
                 library\n",
            );
        }
        text
    }

    /// The load address and path of the object that holds `addr`.
    fn object_of(addr: *const c_void) -> Option<(*mut c_void, String)> {
        let (base, file) = crate::base::host::object_of(addr as usize)?;
        let file = file.unwrap_or_else(|| {
            std::env::current_exe().map_or_else(|_| "the program".into(), |p| p.display().to_string())
        });
        Some((base as *mut c_void, file))
    }

    /// The file names of the loaded objects (the program itself has none), copied so
    /// that no loader lock is held while they are opened. Nothing is allocated while
    /// the loader's lock is held: one pass measures, the second copies into a buffer
    /// allocated in between (an object loaded meanwhile may be left out).
    fn loaded_objects() -> Option<Vec<CString>> {
        let mut names = Names { buf: Vec::new(), need: 0 };
        // SAFETY: the callback reads `info` only during the call; `data` is `names`,
        // borrowed for the call's duration.
        unsafe { libc::dl_iterate_phdr(Some(collect), std::ptr::from_mut(&mut names).cast()) };
        names.buf.try_reserve_exact(names.need + 4096).ok()?;
        // SAFETY: the callback reads `info` only during the call; `data` is `names`,
        // borrowed for the call's duration.
        unsafe { libc::dl_iterate_phdr(Some(collect), std::ptr::from_mut(&mut names).cast()) };
        let list = names.buf.split(|&b| b == 0).filter(|n| !n.is_empty());
        Some(list.filter_map(|n| CString::new(n).ok()).collect())
    }

    /// Names NUL-separated in `buf`, within its capacity; `need` is the room wanted.
    struct Names {
        buf: Vec<u8>,
        need: usize,
    }

    unsafe extern "C" fn collect(info: *mut dl_phdr_info, _: size_t, data: *mut c_void) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid `info` and our `data` (see above).
        let (info, names) = unsafe { (&*info, &mut *data.cast::<Names>()) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: the loader's NUL-terminated name, valid during the callback.
        let name = unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes_with_nul();
        if name.len() > 1 {
            names.need += name.len();
            if names.buf.capacity() - names.buf.len() >= name.len() {
                names.buf.extend_from_slice(name); // within capacity: no allocation
            }
        }
        0
    }
}
