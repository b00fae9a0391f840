//! The Rust face's thread state: a `const`, drop-free `thread_local!` for the ledger
//! (no lazy initialisation and no destructor registration on the fast path,
//! rust-lang/rust #116390), and a second one with a destructor, touched once per
//! thread from the slow path, for the exit flush.

use super::{thread_exit, Face, Local};

thread_local! {
    static LOCAL: Local = const { Local::new() };
    static EXIT_FLUSH: ExitFlush = const { ExitFlush };
}

struct ExitFlush;

impl Drop for ExitFlush {
    fn drop(&mut self) {
        let _ = LOCAL.try_with(thread_exit);
    }
}

/// The Rust face.
pub(crate) static RUST_FACE: Face = Face {
    local,
    register_exit,
    configure_from_env: true,
    unseen: super::nothing_unseen,
    lazy: super::never_lazy,
    scopes_began: super::no_skipped_lookups,
};

/// The calling thread's state.
#[inline(always)]
pub(crate) fn with<R>(f: impl FnOnce(&Local) -> R) -> Option<R> {
    LOCAL.try_with(f).ok()
}

fn local() -> Option<&'static Local> {
    // SAFETY: a `const` thread-local without `Drop` is never torn down before its
    // thread ends, and the reference is only used on this thread (Face's contract).
    LOCAL.try_with(|l| unsafe { &*(l as *const Local) }).ok()
}

fn register_exit() -> bool {
    EXIT_FLUSH.try_with(|_| ()).is_ok()
}
