//! The handles callers hold: a running scope (`TaskScope`), its plain id
//! (`ScopeHandle`), the RAII attachment and reservation guards, and a consumer's id.
//! They own nothing in the manager: each is a key into its tables, stale (harmlessly)
//! once the scope ends.

use super::figures::{snapshot, ConsumerStats, ScopeAccount, ScopeReport, ScopeStats};
use super::spill::{self, SpillFn};
use super::{attach_raw, detach_raw, end_raw, release_raw, reserve_raw};
use crate::base::error::{Error, Result};
use crate::base::sync::Arc;
use crate::ledger::tables::pool::{Among, Ask, POOL};
use crate::ledger::threads::Face;
use crate::ledger::threads::ACCOUNT;
use std::fmt;
use std::marker::PhantomData;

/// A running scope. Ends when dropped (a leak is then written to the report hook);
/// [`TaskScope::end`] ends it and returns the report instead.
#[derive(Debug)]
pub struct TaskScope {
    handle: ScopeHandle,
}

impl TaskScope {
    pub(crate) fn new(handle: ScopeHandle) -> TaskScope {
        TaskScope { handle }
    }

    /// A copyable handle, for helper threads; it goes stale when the scope ends.
    pub fn handle(&self) -> ScopeHandle {
        self.handle
    }

    /// Attaches the calling thread (see [`ScopeHandle::attach`]).
    ///
    /// # Errors
    /// As [`ScopeHandle::attach`].
    pub fn attach(&self) -> Result<AttachGuard> {
        self.handle.attach()
    }

    /// Reserves exactly `bytes` (see [`ScopeHandle::reserve`]).
    ///
    /// # Errors
    /// As [`ScopeHandle::reserve`].
    pub fn reserve(&self, bytes: u64) -> Result<Reservation> {
        self.handle.reserve(bytes)
    }

    /// Reserves up to `bytes` (see [`ScopeHandle::reserve_up_to`]).
    ///
    /// # Errors
    /// As [`ScopeHandle::reserve`].
    pub fn reserve_up_to(&self, bytes: u64) -> Result<Reservation> {
        self.handle.reserve_up_to(bytes)
    }

    /// Registers a spillable consumer: `spill(target)` is asked to free about
    /// `target` bytes and returns what it freed. It runs on the thread that needs
    /// memory, with no memquota lock held; it must not reserve memory (that fails with
    /// [`Error::ReserveInSpill`] and is reported), and should use `try_lock` on
    /// anything the requesting thread may hold.
    ///
    /// # Errors
    /// [`Error::ScopeEnded`], or [`Error::TooManyScopes`] when [`MAX_CONSUMERS`] exist.
    pub fn consumer(
        &self,
        name: &str,
        spill: impl Fn(u64) -> u64 + Send + Sync + 'static,
    ) -> Result<Consumer> {
        let callback: Arc<SpillFn> = Arc::new(spill);
        let key = {
            let mut p = POOL.lock();
            if p.scope(self.handle.0).is_none() {
                return Err(Error::ScopeEnded);
            }
            p.add_consumer(self.handle.0, name).ok_or(Error::TooManyScopes)?
        };
        spill::register(key, callback);
        Ok(Consumer { key, scope: self.handle })
    }

    /// Sets or clears a hard cap on what the scope may hold (Gluten's isolation).
    pub fn set_cap(&self, cap: Option<u64>) {
        POOL.lock().set_cap(self.handle.0, cap);
    }

    /// The scope's figures now.
    pub fn stats(&self) -> Option<ScopeStats> {
        crate::ledger::threads::unpoliced(snapshot).scopes.into_iter().find(|s| s.handle == self.handle.0)
    }

    /// Ends the scope; returns what it still held (a leak, if anything).
    pub fn end(self) -> ScopeReport {
        let handle = self.handle.0;
        std::mem::forget(self);
        end_raw(handle).unwrap_or_default()
    }
}

impl Drop for TaskScope {
    fn drop(&mut self) {
        if let Ok(report) = end_raw(self.handle.0) {
            if report.is_leak() {
                crate::policy::report::note(format_args!("{report}\n"));
            }
        }
    }
}

/// A scope's plain id: `Copy`, `Send`, stale (harmlessly) once the scope ends. The
/// raw value is what the C ABI passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScopeHandle(u64);

impl ScopeHandle {
    /// From a raw value (the C ABI's).
    pub fn from_raw(raw: u64) -> ScopeHandle {
        ScopeHandle(raw)
    }

    /// The raw value.
    pub fn as_raw(self) -> u64 {
        self.0
    }

    /// The scope's unreserved bytes by allocation site, one line per site, the most
    /// first (at most 3): what its threads allocated, still live, while the scope's
    /// allocations went past what its reservations cover, so an engine can name the
    /// code that allocates without reserving (`"{estimate} unreserved of {live} live
    /// OBJECT+ADDR <- ..."`, frames innermost first, for `addr2line -f -e OBJECT
    /// ADDR`). Estimated from the allocation-site profile (`MEMQUOTA_PROFILE_SAMPLE`);
    /// `None` when it is off or the scope has ended, an empty string when no such
    /// allocation of the scope was sampled. Reads the profile (a dump to a memfd):
    /// for an error path, not for every request.
    pub fn unreserved_sites(self) -> Option<String> {
        let scope = POOL.lock().tag_scope(self.0)?;
        let sites = crate::policy::profile::Sites::read_for(Some(scope))?;
        crate::ledger::threads::unpoliced(|| {
            let mut out = String::new();
            if let Some(one) = sites.scope(scope) {
                let _ = crate::policy::profile::write_unreserved_sites(&mut out, &sites, one, "");
            }
            Some(out)
        })
    }

    /// Whether the scope is still running.
    pub fn is_live(self) -> bool {
        POOL.lock().scope(self.0).is_some()
    }

    /// The scope's account and share now (`None` once it ended). Never allocates: cheap
    /// enough for every request of an engine's memory pool that decides on its own
    /// (memquota-datafusion). Attached threads' unflushed bytes are not in it.
    pub fn account(self) -> Option<ScopeAccount> {
        let p = POOL.lock();
        // The share as the scope sees it when it asks: a scope that asks competes.
        let share = p.share_for(self.0, Among::Begun);
        p.scope(self.0).map(|s| ScopeAccount::new(s, share))
    }

    /// Attaches the calling thread: its allocations are charged to the scope until
    /// the guard drops, which puts the thread back in its previous scope. The thread's
    /// unflushed bytes are settled into the scope it leaves.
    ///
    /// # Errors
    /// [`Error::ScopeEnded`].
    pub fn attach(self) -> Result<AttachGuard> {
        let face = crate::ledger::threads::face();
        let prev = attach_raw(face, self.0)?;
        Ok(AttachGuard { face, prev, _not_send: PhantomData })
    }

    /// Reserves exactly `bytes`, spilling, waiting for the fair share and reclaiming
    /// as needed. The reservation is a floor under the scope's charge: allocations of
    /// attached threads use it up before they charge anything new.
    ///
    /// # Errors
    /// [`Error::Refused`] (with an OOM report), [`Error::ScopeEnded`],
    /// [`Error::ReserveInSpill`].
    pub fn reserve(self, bytes: u64) -> Result<Reservation> {
        reserve_raw(crate::ledger::threads::face(), self.0, bytes, 0, false)
            .map(|g| Reservation::new(self, 0, g))
    }

    /// Reserves up to `bytes`: the most the fair share allows once spills are
    /// exhausted (maybe 0), as Spark grants part of a request.
    ///
    /// # Errors
    /// As [`reserve`](Self::reserve).
    pub fn reserve_up_to(self, bytes: u64) -> Result<Reservation> {
        reserve_raw(crate::ledger::threads::face(), self.0, bytes, 0, true)
            .map(|g| Reservation::new(self, 0, g))
    }
}

/// The calling thread's attachment to a scope; drop to detach. Not `Send`: it belongs
/// to the thread it attached.
#[must_use = "the thread detaches when the guard drops"]
pub struct AttachGuard {
    face: &'static Face,
    prev: u64,
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for AttachGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttachGuard").field("prev", &self.prev).finish_non_exhaustive()
    }
}

impl Drop for AttachGuard {
    fn drop(&mut self) {
        detach_raw(self.face, self.prev);
    }
}

/// Reserved bytes of a scope; released on drop.
#[derive(Debug)]
#[must_use = "the reservation is released when dropped"]
pub struct Reservation {
    scope: ScopeHandle,
    consumer: u64,
    bytes: u64,
}

impl Reservation {
    fn new(scope: ScopeHandle, consumer: u64, bytes: u64) -> Reservation {
        Reservation { scope, consumer, bytes }
    }

    /// The bytes granted.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adds `bytes` to the reservation with no admission: counted at once in its scope's
    /// and the process's account (past the soft threshold a background reclaim is asked
    /// for, as for an allocation under [`Enforcement::Gates`](crate::Enforcement::Gates)),
    /// never refused, never waiting, no spill asked for. For a caller that decided on
    /// its own figures ([`ScopeHandle::account`], [`budget`](crate::budget)), such
    /// as an engine's memory pool whose refusals make its operators spill. After the
    /// scope ended it counts for nothing.
    pub fn grow_unchecked(&mut self, bytes: u64) {
        let ask = Ask::Reserve { bytes, consumer: self.consumer };
        let dh = POOL.lock().apply(self.scope.0, ask, bytes, 1);
        if dh > 0 {
            crate::policy::admission::count_only(dh);
        } else {
            ACCOUNT.add(dh);
        }
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// Gives back `bytes` of it now (at most what it holds).
    pub fn shrink(&mut self, bytes: u64) {
        let b = bytes.min(self.bytes);
        self.bytes -= b;
        release_raw(self.scope.0, b, self.consumer);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            release_raw(self.scope.0, self.bytes, self.consumer);
        }
    }
}

/// A spillable consumer's handle; the consumer lives in the manager until its scope
/// ends or [`Consumer::unregister`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Consumer {
    key: u64,
    scope: ScopeHandle,
}

impl Consumer {
    /// Reserves exactly `bytes` for this consumer: counted in its size (which the
    /// spill order reads) and its scope's charge.
    ///
    /// # Errors
    /// As [`ScopeHandle::reserve`].
    pub fn reserve(self, bytes: u64) -> Result<Reservation> {
        reserve_raw(crate::ledger::threads::face(), self.scope.0, bytes, self.key, false)
            .map(|g| Reservation::new(self.scope, self.key, g))
    }

    /// Reserves up to `bytes` for this consumer.
    ///
    /// # Errors
    /// As [`ScopeHandle::reserve`].
    pub fn reserve_up_to(self, bytes: u64) -> Result<Reservation> {
        reserve_raw(crate::ledger::threads::face(), self.scope.0, bytes, self.key, true)
            .map(|g| Reservation::new(self.scope, self.key, g))
    }

    /// The consumer's figures now.
    pub fn stats(self) -> Option<ConsumerStats> {
        POOL.lock().consumer(self.key).copied().map(|c| ConsumerStats::new(&c))
    }

    /// Removes the consumer (its reservations stay with the scope until dropped).
    pub fn unregister(self) {
        POOL.lock().remove_consumer(self.key);
        spill::unregister(self.key);
    }
}
