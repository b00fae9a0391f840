//! How the malloc family charges: the counted paths the entry points of
//! `exports.rs` leave for (a small `malloc` on a thread that is not lazy, a big one, a
//! counted `free`), the primitives jemalloc's API, the C++ operators and the library's
//! own allocations use, each charging usable bytes before memory is taken and crediting
//! them after it is given back, and the preload's [`FACE`] for the shared slow path.
//!
//! The table, the slow path and the counted `free` are one knot of calls, kept in one
//! module: the table's `scopes_began` points lazy frees at [`free_guarded`], whose
//! credit may take the slow path, which goes through the table. Under it sit the
//! thread's slot (`thread.rs`) and the bulk guards (`lazy.rs`); over it the exported
//! symbols, jemalloc's API, the C++ operators, and the other faces.

use crate::malloc::lazy;
use crate::malloc::thread::{self, local, local_opt, register_exit, slot, Slot};
use libc::{c_int, c_void, size_t};
use memquota_core::seam::hot::{small_usable, usable, SMALL_MAX};
use memquota_core::seam::{
    hot::{self, bulk, Face},
    scopes, slow,
};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering::Relaxed};
use tikv_jemalloc_sys as jem;

/// The preload's face for the shared slow path.
pub(crate) static FACE: Face = Face {
    local: local_opt,
    register_exit,
    configure_from_env: false,
    unseen: lazy::unseen,
    lazy: lazy::rearm,
    scopes_began,
};

pub(crate) fn errno() -> c_int {
    // SAFETY: __errno_location has no preconditions.
    let e = unsafe { libc::__errno_location() };
    // SAFETY: it points to this thread's errno, valid and aligned while the thread lives.
    unsafe { *e }
}

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location has no preconditions.
    let p = unsafe { libc::__errno_location() };
    // SAFETY: it points to this thread's errno, valid and aligned while the thread
    // lives, and written only by this thread.
    unsafe { *p = e };
}

/// Charges `bytes` before memory is taken; false: refused (the report is written).
#[inline(always)]
pub(crate) fn charge(bytes: usize) -> bool {
    hot::try_charge(local(), bytes as u64) || slow(bytes as i64)
}

/// Credits `bytes` after memory is given back.
#[inline(always)]
pub(crate) fn credit(bytes: usize) {
    if !hot::try_credit(local(), bytes as u64) {
        slow(-(bytes as i64));
    }
}

/// Counts what a lazy thread's calls took minus what they gave back (`lazy.rs`),
/// after the fact: a charge is never refused.
pub(crate) fn count_in_bulk(bytes: i64) {
    let left = hot::record_in_bulk(local(), bytes);
    if left > 0 {
        taken_slow(left as usize);
    } else if left < 0 {
        slow(left);
    }
}

/// [`count_in_bulk`]'s slow path for a charge, keeping errno: it runs inside the
/// jemalloc call that crossed the hook's interval, whose caller may read errno after.
#[cold]
#[inline(never)]
fn taken_slow(bytes: usize) {
    let saved = errno();
    slow::charge_taken(&FACE, bytes as i64);
    set_errno(saved);
}

// What a lazy thread's calls took and gave back (`lazy.rs`) reaches the ledger
// through [`count_in_bulk`]: from jemalloc's hook, and after every guarded call.

/// Registers the hook with jemalloc, every half `threshold` bytes allocated and
/// freed. From the constructor, once jemalloc's control tree is set up.
pub(crate) fn register(threshold: u64) {
    bulk::register(&slot().bulk, threshold / 2, on_event);
}

/// jemalloc's per-thread event (see [`bulk::on_event`]).
extern "C" fn on_event(_is_alloc: bool, _allocated: u64, _deallocated: u64) {
    bulk::on_event(&slot().bulk, count_in_bulk);
}

/// [`bulk::deferred`] on the thread's slot.
#[inline(always)]
pub(crate) fn deferred<R>(s: &Slot, call: impl FnOnce() -> R) -> R {
    bulk::deferred(&s.bulk, count_in_bulk, call)
}

/// [`bulk::catch_up`] on the thread's slot.
#[inline(always)]
pub(crate) fn catch_up(s: &Slot) {
    bulk::catch_up(&s.bulk, count_in_bulk);
}

/// The shared slow path, keeping errno: `free` must not change it, and a granted
/// `malloc` has no business changing it either.
#[cold]
#[inline(never)]
pub(crate) fn slow(bytes: i64) -> bool {
    let saved = errno();
    let ok = slow::charge_slow(&FACE, bytes);
    if slot().bulk.allocated.get().is_null() {
        thread::find_totals(); // a thread that could not find them on its first
    }
    set_errno(saved);
    ok
}

pub(crate) fn enomem() -> *mut c_void {
    set_errno(libc::ENOMEM);
    null_mut()
}

/// `mallocx` requests under this, with an alignment under it too, are charged just
/// after jemalloc serves them, by how much its per-thread total of allocated bytes
/// moved: the flags (alignment) change the size class, and `nallocx` would be a second
/// call. Larger ones are charged before memory is taken.
const CHARGE_AFTER_MAX: usize = 4096;

/// A `malloc` that is not lazy: a big one ([`charge_first`]), or a small one on a thread
/// that is not lazy, charged before memory is taken (`extern "C"`, like the other cold
/// exits of `malloc`, so that it cannot unwind; `malloc` reaches it by a jump). The
/// usable size of a small one is one table load, and only the call to jemalloc needs a
/// stack frame (to keep the size for a refund if jemalloc fails), where reading
/// jemalloc's per-thread total before and after the call would keep the thread's slot,
/// the total's address and its old value across it. Every other way out is a tail
/// call. The call to jemalloc needs no guard: only a slow path
/// makes a thread lazy, and the charge leaves by [`missed`] for it.
#[inline(never)]
pub(crate) extern "C" fn alloc_counted(n: size_t) -> *mut c_void {
    if n >= SMALL_MAX {
        return charge_first(n);
    }
    let s = slot();
    let size = small_usable(n);
    if size != 0 {
        if !hot::charge_or_miss(&s.local, size as u64) {
            return missed(n, size);
        }
        // SAFETY: plain jemalloc malloc.
        let p = unsafe { jem::malloc(n) };
        if p.is_null() {
            return refund(size);
        }
        return p;
    }
    charge_first(n)
}

/// A small `malloc` whose charge missed the fast path: take the miss back, then
/// charge through the slow path. `extern "C"`, like the other cold exits of
/// `malloc`, so that it cannot unwind: the caller then needs no landing pad and
/// reaches it by a jump.
#[cold]
#[inline(never)]
extern "C" fn missed(n: size_t, size: usize) -> *mut c_void {
    hot::undo_charge(local(), size as u64);
    charge_first(n)
}

/// Gives back the charge of an allocation jemalloc failed.
#[cold]
#[inline(never)]
extern "C" fn refund(size: usize) -> *mut c_void {
    credit(size);
    enomem()
}

/// `mallocx`: under [`CHARGE_AFTER_MAX`] with an alignment under it too, charged just
/// after; otherwise before memory is taken, with `nallocx`.
///
/// # Safety
/// `n >= 1` and the flags are valid for jemalloc's `mallocx` (an arena or tcache they
/// name exists).
#[inline(always)]
pub(crate) unsafe fn alloc_flags(n: size_t, flags: c_int) -> *mut c_void {
    let s = slot();
    let total = s.bulk.allocated.get();
    // The alignment is `MALLOCX_LG_ALIGN`, the low six bits of the flags.
    if n < CHARGE_AFTER_MAX && 1usize << (flags & 63) < CHARGE_AFTER_MAX && !total.is_null() {
        // SAFETY: `total` is this thread's thread.allocatedp (just read from its slot);
        // this function's contract is charge_after's.
        return unsafe { charge_after(s, total, n, flags) };
    }
    // SAFETY: nallocx has no preconditions; with mallocx's size and flags it gives the
    // usable size mallocx will return.
    let size = unsafe { jem::nallocx(n, flags) };
    // SAFETY: n >= 1 and valid flags (this function's contract).
    charged(size, || unsafe { jem::mallocx(n, flags) })
}

/// `mallocx(n, flags)` of a small block, then charges what jemalloc's per-thread total
/// of allocated bytes moved by; refused, the block goes straight back.
///
/// # Safety
/// `total` is the calling thread's `thread.allocatedp` (from its slot, non-null);
/// `n >= 1` and the flags are valid for jemalloc's `mallocx`.
#[inline(always)]
unsafe fn charge_after(s: &Slot, total: *const u64, n: size_t, flags: c_int) -> *mut c_void {
    // Guarded: jemalloc's hook waits until the total is read, so its movement is this
    // call's alone.
    let (p, size) = lazy::guarded(s, || {
        // SAFETY: `total` points into this thread's jemalloc state (thread.allocatedp),
        // valid while the thread lives, written only by it (this function's contract).
        let before = unsafe { total.read_volatile() };
        // SAFETY: n >= 1 and valid flags (this function's contract).
        let p = unsafe { jem::mallocx(n, flags) };
        // SAFETY: as for `before`; jemalloc has just written it, on this thread.
        (p, (unsafe { total.read_volatile() }).wrapping_sub(before) as usize)
    });
    if p.is_null() {
        catch_up(s);
        return enomem();
    }
    if hot::try_charge(&s.local, size as u64) || slow(size as i64) {
        catch_up(s);
        return p;
    }
    // Refused: give the few bytes back uncounted (they were never charged), outside
    // the bulk credit of lazy frees.
    // SAFETY: `p` is the live block just allocated with these flags, `size` its usable
    // size.
    lazy::guarded(s, || unsafe { jem::sdallocx(p, size, flags) });
    catch_up(s);
    enomem()
}

/// `malloc`, charging the usable size of `n` before memory is taken. `extern "C"`
/// for the same reason as [`missed`].
#[cold]
extern "C" fn charge_first(n: size_t) -> *mut c_void {
    // SAFETY: plain jemalloc malloc.
    charged(usable(n), || unsafe { jem::malloc(n) })
}

/// Charges `size` usable bytes (0: too large to allocate), then lets `take` allocate
/// (guarded: on a lazy thread its bytes stay out of the bulk count); gives the charge
/// back if jemalloc fails.
pub(crate) fn charged(size: usize, take: impl FnOnce() -> *mut c_void) -> *mut c_void {
    if size == 0 {
        return enomem();
    }
    if !hot::try_charge(local(), size as u64) {
        return charged_slow(size, take);
    }
    let p = taken(take);
    if p.is_null() {
        credit(size);
        return enomem();
    }
    p
}

/// `take`, guarded, then what the hook put off meanwhile (`lazy.rs`).
#[inline(always)]
fn taken(take: impl FnOnce() -> *mut c_void) -> *mut c_void {
    let s = slot();
    let p = lazy::guarded(s, take);
    catch_up(s);
    p
}

/// [`charged`] past the fast path: a big block also gets its owner record, so a free
/// on any thread credits the scope that allocated it.
#[cold]
#[inline(never)]
fn charged_slow(size: usize, take: impl FnOnce() -> *mut c_void) -> *mut c_void {
    if !slow(size as i64) {
        return enomem();
    }
    let p = taken(take);
    if p.is_null() {
        credit(size);
        return enomem();
    }
    scopes::note_alloc(&FACE, p as usize, size as u64);
    p
}

/// Credits the `size` bytes of the block `free` just gave back (in `Slot::freeing`);
/// the slow path first looks for the block's owner record.
#[inline(always)]
fn credit_freed(s: &Slot, size: usize) {
    if !hot::try_credit(&s.local, size as u64) {
        credit_freed_slow(size);
    }
}

#[cold]
#[inline(never)]
fn credit_freed_slow(size: usize) {
    let p = slot().freeing.get();
    let saved = errno();
    let owned = scopes::note_free(p as usize, size as u64);
    set_errno(saved);
    if !owned {
        slow(-(size as i64));
    }
}

/// Allocates with an alignment that is a power of two.
pub(crate) fn alloc_aligned(align: usize, n: size_t) -> *mut c_void {
    let flags = align.trailing_zeros() as c_int; // MALLOCX_ALIGN(align)
    let n = n.max(1);
    // SAFETY: nallocx has no preconditions.
    let size = unsafe { jem::nallocx(n, flags) };
    // SAFETY: n >= 1 and flags encode a power-of-two alignment.
    charged(size, || unsafe { jem::mallocx(n, flags) })
}

/// How a block goes back to jemalloc.
#[derive(Clone, Copy)]
pub(crate) enum GiveBack {
    /// `free(p)`.
    Free,
    /// `dallocx(p, flags)`.
    Dallocx(c_int),
    /// `sdallocx(p, size, flags)`.
    Sdallocx(size_t, c_int),
}

impl GiveBack {
    /// Gives `p` back.
    ///
    /// # Safety
    /// `p` is a live jemalloc block, not used after; for [`GiveBack::Dallocx`] and
    /// [`GiveBack::Sdallocx`], the flags (and the size) describe it as jemalloc's
    /// `dallocx` and `sdallocx` require.
    #[inline(always)]
    unsafe fn call(self, p: *mut c_void) {
        match self {
            // SAFETY: a live jemalloc block (this function's contract).
            GiveBack::Free => unsafe { jem::free(p) },
            // SAFETY: a live jemalloc block, valid flags (this function's contract).
            GiveBack::Dallocx(flags) => unsafe { jem::dallocx(p, flags) },
            // SAFETY: a live jemalloc block, its size and flags (this function's contract).
            GiveBack::Sdallocx(size, flags) => unsafe { jem::sdallocx(p, size, flags) },
        }
    }
}

/// Where a lazy thread's `free` goes: jemalloc's `free` (credited in bulk later,
/// `lazy.rs`) until the first scope begins, [`free_guarded`] from then on
/// ([`scopes_began`]). One indirect jump through it is the lazy `free`'s test for
/// scopes, with no compare of the scopes flag and no branch.
pub(crate) static LAZY_FREE: AtomicPtr<()> = AtomicPtr::new(jem::free as *mut ());

/// The face's [`Face::scopes_began`](hot::Face::scopes_began): big blocks get owner
/// records from now on, so a lazy `free` looks its block's owner up. Stored before
/// the scopes flag (Release), so a thread that writes a record (after reading the
/// flag true, Acquire) has seen it, and so has the thread that frees the block, which
/// got it from the writer. Stored once: every `free` reads this line.
pub(crate) fn scopes_began() {
    let guarded = free_guarded as *mut ();
    if LAZY_FREE.load(Relaxed) != guarded {
        LAZY_FREE.store(guarded, Relaxed);
    }
}

/// `free` on a thread whose frees are not lazy, out of line so that the lazy `free`
/// needs no stack frame: its caller reaches it by a jump (`extern "C"`, so it cannot
/// unwind and the caller needs no landing pad).
///
/// # Safety
/// The calling thread's frees are not lazy; `p` is null, or a live block of this
/// allocator (from the malloc family or C++ `new`) not given back since; it is not
/// used after.
#[inline(never)]
pub(crate) unsafe extern "C" fn free_counted(p: *mut c_void) {
    // SAFETY: this function's contract is release_counted's for `free`; the slot is
    // this thread's.
    unsafe { release_counted::<false>(slot(), p, GiveBack::Free) }
}

/// `free` on a lazy thread once a scope has begun (it turns lazy frees off at its next
/// slow path): counted, outside the bulk credit.
///
/// # Safety
/// As [`free_counted`], for a thread whose frees are lazy.
#[cold]
#[inline(never)]
unsafe extern "C" fn free_guarded(p: *mut c_void) {
    // SAFETY: this function's contract is release_counted's for `free`; the slot is
    // this thread's.
    unsafe { release_counted::<true>(slot(), p, GiveBack::Free) }
}

/// Gives a block back `how`: lazily like [`release`]'s `free`, or counted.
///
/// # Safety
/// `p` is null, or a live block of this allocator (from the malloc family, jemalloc's
/// API or C++ `new`) not given back since, that [`GiveBack::call`] may give back
/// `how`; it is not used after.
#[inline(always)]
pub(crate) unsafe fn release_by(p: *mut c_void, how: GiveBack) {
    if p.is_null() {
        return;
    }
    let s = slot();
    if !s.bulk.lazy() {
        // SAFETY: this function's contract is release_counted's; `s` is this thread's
        // slot, whose frees are not lazy.
        return unsafe { release_counted::<false>(s, p, how) };
    }
    if scopes::scopes_used() {
        // SAFETY: as above, for a thread whose frees are lazy.
        return unsafe { release_counted::<true>(s, p, how) };
    }
    // SAFETY: `p` is non-null here, so a live block `how` may give back (this
    // function's contract), not used after.
    unsafe { how.call(p) }
}

/// Gives a block back `how` and credits its size: what jemalloc's per-thread total
/// of freed bytes moved by, so the free costs jemalloc's own lookup and nothing more.
/// Before the thread's first slow path has found that total, ask `sallocx` (a second
/// lookup). `LAZY`: the thread's frees are lazy, so the call is kept out of their bulk
/// credit (`lazy::measured`).
///
/// # Safety
/// `s` is the calling thread's slot, whose frees are lazy exactly when `LAZY`; `p` is
/// null, or a live block of this allocator (from the malloc family, jemalloc's API or
/// C++ `new`) not given back since, that [`GiveBack::call`] may give back `how`; it is
/// not used after.
#[inline(always)]
unsafe fn release_counted<const LAZY: bool>(s: &Slot, p: *mut c_void, how: GiveBack) {
    if p.is_null() {
        return;
    }
    s.freeing.set(p);
    let freed = s.bulk.deallocated.get();
    let size = if freed.is_null() {
        // SAFETY: `p` is non-null here, so a live jemalloc block (this function's contract).
        let size = unsafe { jem::sallocx(p, 0) };
        // SAFETY: a live block `how` may give back (this function's contract), not
        // used after.
        unsafe { how.call(p) };
        size
    } else if LAZY {
        // SAFETY: `freed` is this thread's thread.deallocatedp (from its own slot, this
        // function's contract) and non-null here; `p` is non-null, so a live block `how`
        // may give back (this function's contract), not used after.
        (unsafe { lazy::measured(s, freed, || how.call(p)) }).1 as usize
    } else {
        // SAFETY: `freed` points into this thread's jemalloc state (thread.deallocatedp),
        // valid while the thread lives; jemalloc writes it only on this thread.
        let before = unsafe { freed.read_volatile() };
        // SAFETY: `p` is non-null here, so a live block `how` may give back (this
        // function's contract), not used after.
        unsafe { how.call(p) };
        // SAFETY: `freed` still points into this thread's jemalloc state, which lives
        // as long as the thread; jemalloc has just written it, on this thread.
        (unsafe { freed.read_volatile() }).wrapping_sub(before) as usize
    };
    credit_freed(s, size);
    if LAZY {
        catch_up(s);
    }
}

/// The jemalloc call that moves a block.
#[derive(Clone, Copy)]
pub(crate) enum Resize {
    /// `realloc(p, n)`.
    Realloc,
    /// `rallocx(p, n, flags)`.
    Rallocx(c_int),
}

/// Resizes the live block `p` to `n` bytes `how`: the growth estimated and charged
/// before, corrected to what jemalloc holds after.
///
/// # Safety
/// `p` is a live block of this allocator not given back since, `n >= 1`; for
/// [`Resize::Rallocx`], the flags are valid for jemalloc's `rallocx` (an arena or
/// tcache they name exists). Unless this returns null (`p` then stays live), `p` is
/// given back and not used after.
pub(crate) unsafe fn resize_by(p: *mut c_void, n: size_t, how: Resize) -> *mut c_void {
    // SAFETY: `p` is a live jemalloc block (this function's contract).
    let old = unsafe { jem::sallocx(p, 0) };
    let estimate = match how {
        Resize::Realloc => usable(n),
        // SAFETY: nallocx has no preconditions.
        Resize::Rallocx(flags) => unsafe { jem::nallocx(n, flags) },
    };
    if estimate == 0 {
        return enomem();
    }
    let big = old.max(estimate) as u64 >= scopes::OWNED_MIN;
    // A big block's owner record follows it to the calling thread's scope.
    let had = match big {
        true => match scopes::note_realloc_begin(&FACE, p as usize, old as u64, estimate as u64) {
            Some(had) => had,
            None => return enomem(), // the move to this thread's scope was refused
        },
        false => false,
    };
    let grow = estimate.saturating_sub(old);
    if grow > 0 && !charge(grow) {
        if had {
            scopes::note_realloc_end(&FACE, p as usize, 0, old as u64, 0, had);
        }
        return enomem();
    }
    // jemalloc adds the new block's usable size to this thread's total of allocated
    // bytes when a resize succeeds (moved or in place): read just around the call, its
    // movement is the size the block now has, where a second `sallocx` was a lookup.
    // Guarded: the old block's bytes are credited below (in `now - counted`), not in
    // bulk, and jemalloc's hook waits until the total is read.
    let s = slot();
    let total = s.bulk.allocated.get();
    let (q, moved) = lazy::guarded(s, || {
        let before = if total.is_null() {
            0
        } else {
            // SAFETY: a non-null `allocated` is this thread's thread.allocatedp, valid
            // while the thread lives and written only by it.
            unsafe { total.read_volatile() }
        };
        let q = match how {
            // SAFETY: `p` is a live jemalloc block (this function's contract), n >= 1.
            Resize::Realloc => unsafe { jem::realloc(p, n) },
            // SAFETY: `p` is a live jemalloc block, n >= 1, valid flags (this function's
            // contract).
            Resize::Rallocx(flags) => unsafe { jem::rallocx(p, n, flags) },
        };
        let moved = if total.is_null() {
            0
        } else {
            // SAFETY: as for `before`; jemalloc has just written it, on this thread.
            (unsafe { total.read_volatile() }).wrapping_sub(before) as usize
        };
        (q, moved)
    });
    if q.is_null() {
        if grow > 0 {
            credit(grow);
        }
        if had {
            scopes::note_realloc_end(&FACE, p as usize, 0, old as u64, 0, had);
        }
        catch_up(s);
        return enomem();
    }
    // What is counted now is `old + grow`; make it exactly what jemalloc holds.
    let now = if total.is_null() {
        // SAFETY: `q` is non-null, so the live block jemalloc just returned.
        unsafe { jem::sallocx(q, 0) }
    } else {
        moved
    };
    let counted = old + grow;
    if now < counted {
        credit(counted - now); // a shrink: a credit, on the fast path when it fits
    } else if now > counted {
        slow::record(&FACE, now as i64 - counted as i64);
    }
    if big {
        scopes::note_realloc_end(&FACE, p as usize, q as usize, old as u64, now as u64, had);
    }
    catch_up(s);
    q
}

/// A `calloc` that is not lazy, charged before memory is taken (`extern "C"`, like
/// the cold exits of `malloc`, so that it cannot unwind and `calloc` reaches it by a
/// jump).
#[inline(never)]
pub(crate) extern "C" fn zeroed_counted(count: size_t, size: size_t) -> *mut c_void {
    let Some(total) = count.checked_mul(size) else {
        return enomem();
    };
    // SAFETY: plain jemalloc calloc of a product that does not overflow.
    charged(usable(total), || unsafe { jem::calloc(count, size) })
}
