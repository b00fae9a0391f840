//! The preload's per-thread state, in initial-exec TLS.
//!
//! A Rust `thread_local!` in a cdylib is global-dynamic TLS: every access may call
//! `__tls_get_addr`, which after a `dlopen` may call malloc, which is us (bytehound
//! #131). So the ledger's `Local` lives in a `.tbss` block of our own, reached with
//! the initial-exec sequence (`%fs:0` plus a GOT-held offset): no call, no
//! allocation, valid from the thread's first instruction to its last. The exit flush
//! is a pthread key destructor, which runs before the thread's TLS goes away.

use memquota_core::seam::hot::{self, Bulk, Local};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::*};

/// What the preload keeps per thread: the ledger, and where jemalloc keeps this
/// thread's running total of bytes freed, so `free` can learn a block's size from
/// jemalloc's own bookkeeping instead of a second lookup.
#[repr(C)]
pub(crate) struct Slot {
    pub(crate) local: Local,
    /// The block `free` is giving back, for its slow path's owner lookup (a store
    /// costs the fast path less than keeping the pointer live across the call).
    pub(crate) freeing: Cell<*mut libc::c_void>,
    /// Bulk counting (`lazy.rs`): while the thread is lazy, frees and small mallocs are
    /// tail calls into jemalloc, counted from its per-thread totals. Its totals are
    /// null until the thread's first slow path.
    pub(crate) bulk: Bulk,
    /// The thread's retry blocks begun through the C ABI or the Java class.
    pub(crate) retry: RetryNest,
}

/// Retry blocks nest at most this deep on one thread (`MEMQUOTA_RETRY_MAX_DEPTH` in
/// memquota.h).
pub(crate) const RETRY_MAX_DEPTH: usize = 16;

/// A thread's nested retry blocks: for each, the scope the thread was attached to
/// before it began, which its end gives back (as the Rust guard's drop does).
#[repr(C)]
pub(crate) struct RetryNest {
    depth: Cell<u32>,
    prev: [Cell<u64>; RETRY_MAX_DEPTH],
}

impl RetryNest {
    /// Whether another block would nest too deep.
    pub(crate) fn full(&self) -> bool {
        self.depth.get() as usize >= RETRY_MAX_DEPTH
    }

    /// Records a block that began with the thread attached to `prev` (ignored if
    /// [`full`](Self::full)).
    pub(crate) fn push(&self, prev: u64) {
        let d = self.depth.get() as usize;
        if d < RETRY_MAX_DEPTH {
            self.prev[d].set(prev);
            self.depth.set(d as u32 + 1);
        }
    }

    /// The innermost block's `prev`, and it is gone; `None`: the thread is in none.
    pub(crate) fn pop(&self) -> Option<u64> {
        let d = (self.depth.get() as usize).checked_sub(1)?;
        self.depth.set(d as u32);
        Some(self.prev[d].get())
    }

    /// Whether the thread is in a retry block.
    pub(crate) fn inside(&self) -> bool {
        self.depth.get() > 0
    }
}

#[cfg(not(target_arch = "x86_64"))]
compile_error!("the preload's initial-exec TLS access is written for x86_64");

const SLOT: usize = 320;
const _: () = assert!(std::mem::size_of::<Slot>() <= SLOT && std::mem::align_of::<Slot>() <= 64);

// A zero-filled, 64-byte-aligned TLS slot of SLOT bytes. All-zero bytes are a fresh `Slot`
// (and an empty `RetryNest`).
// `.hidden`: shared by our object files, invisible to other modules.
std::arch::global_asm!(
    ".pushsection .tbss,\"awT\",@nobits",
    ".balign 64",
    ".globl memquota_preload_local",
    ".hidden memquota_preload_local",
    ".type memquota_preload_local,@object",
    ".size memquota_preload_local,{size}",
    "memquota_preload_local:",
    ".zero {size}",
    ".popsection",
    size = const SLOT,
);

/// The calling thread's ledger state.
#[inline(always)]
pub(crate) fn local() -> &'static Local {
    &slot().local
}

/// The calling thread's slot.
#[inline(always)]
pub(crate) fn slot() -> &'static Slot {
    let p: usize;
    // SAFETY: the initial-exec TLS access sequence for `memquota_preload_local`,
    // defined above: reads the thread pointer and the GOT entry the dynamic linker
    // filled with the slot's offset. No memory is written; the result is the
    // address of this thread's slot, which lives as long as the thread.
    unsafe {
        std::arch::asm!(
            "mov {p}, qword ptr fs:[0]",
            "add {p}, qword ptr [rip + memquota_preload_local@GOTTPOFF]",
            p = out(reg) p,
            // `nomem`: the thread pointer and the GOT entry never change for a thread,
            // so the address may be reused across calls.
            options(pure, nomem, nostack),
        );
    }
    // SAFETY: the slot is zero-initialised (a valid fresh `Slot`: zero ledger, null
    // pointer), suitably aligned, only ever used through this accessor on its thread.
    unsafe { &*(p as *const Slot) }
}

/// [`hot::Face::local`]: the calling thread's ledger state, always there.
pub(crate) fn local_opt() -> Option<&'static Local> {
    Some(local())
}

/// 0: no key yet; 1: being created; 2 + key: ready.
static KEY: AtomicU32 = AtomicU32::new(0);

/// Whether jemalloc's control tree has been set up, so that finding a thread's
/// totals takes no lock. Before, a thread's first slow path may run inside jemalloc's
/// own `pthread_create`: jemalloc starts a background thread (`background_thread:true`)
/// holding its `background_thread_lock`, and the new thread's TLS is `calloc`'ed on
/// the creating thread. The first `mallctl` sets the tree up by reading every
/// background thread's statistics under that same lock: a deadlock. So the tree is set
/// up from the constructor ([`ctl_ready`]), and until then threads leave their totals
/// null (`free` asks `sallocx`, `malloc` charges first) and find them on a later slow
/// path ([`find_totals`]).
static CTL_READY: AtomicBool = AtomicBool::new(false);

/// Points the calling thread's slot at its jemalloc totals, once jemalloc's control
/// tree is set up (a no-op before).
pub(crate) fn find_totals() {
    if CTL_READY.load(Acquire) {
        hot::bulk::find_totals(&slot().bulk);
    }
}

/// From the constructor, outside any jemalloc call: sets jemalloc's control tree up,
/// then lets threads find their totals.
pub(crate) fn ctl_ready() {
    hot::bulk::find_totals(&slot().bulk); // the first mallctl sets the tree up
    CTL_READY.store(true, Release);
}

/// [`hot::Face::register_exit`]: the exit flush, a pthread key destructor.
pub(crate) fn register_exit() -> bool {
    find_totals();
    let key = match KEY.load(Acquire) {
        k if k >= 2 => k - 2,
        _ => match create_key() {
            Some(k) => k,
            None => return false,
        },
    };
    // SAFETY: `key` is a live key; the value only needs to be non-null for the
    // destructor to run.
    unsafe { libc::pthread_setspecific(key, std::ptr::dangling::<libc::c_void>()) == 0 }
}

fn create_key() -> Option<u32> {
    if KEY.compare_exchange(0, 1, AcqRel, Acquire).is_ok() {
        let mut key: libc::pthread_key_t = 0;
        // SAFETY: `key` is a valid out-pointer; `exit_flush` has the signature the
        // destructor needs.
        let rc = unsafe { libc::pthread_key_create(&mut key, Some(exit_flush)) };
        if rc != 0 {
            KEY.store(0, Release);
            return None;
        }
        KEY.store(key + 2, Release);
        return Some(key);
    }
    loop {
        match KEY.load(Acquire) {
            1 => std::hint::spin_loop(),
            0 => return None,
            k => return Some(k - 2),
        }
    }
}

/// A `fork` child handler: a key that a thread which did not survive the fork was
/// creating is never finished there, and the child would spin on it forever. Forget
/// it: the child creates its own.
pub(crate) fn after_fork_child() {
    let _ = KEY.compare_exchange(1, 0, AcqRel, Acquire);
}

extern "C" fn exit_flush(_: *mut libc::c_void) {
    hot::thread_exit(local());
}
