//! Attribution across tokio's worker threads: a future (or stream) that attaches its
//! scope for the length of every `poll`, and a DataFusion `JoinSetTracer` that gives
//! every task DataFusion spawns the scope of the thread that spawned it.
//!
//! A query's work hops between worker threads at every `.await`, and DataFusion runs
//! partitions as tasks of their own (`SpawnedTask`, `JoinSet`, `spawn_blocking` for
//! spill files). Attaching per poll, rather than per thread, charges each piece of
//! that work to the query it belongs to, whichever thread runs it.

use datafusion::common::runtime::{set_join_set_tracer, JoinSetTracer};
use futures::future::BoxFuture;
use futures::Stream;
use memquota::{MemoryManager, ScopeHandle};
use std::any::Any;
use std::future::Future;
use std::mem::ManuallyDrop;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

/// A future or stream whose every poll, and its drop, runs attached to a memquota
/// scope. Made by [`in_scope`].
#[must_use = "futures and streams do nothing unless polled"]
pub struct InScope<F> {
    scope: ScopeHandle,
    // Dropped by hand in `Drop`, attached, so what it frees credits the scope.
    inner: ManuallyDrop<F>,
}

impl<F> std::fmt::Debug for InScope<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InScope").field("scope", &self.scope).finish_non_exhaustive()
    }
}

/// Runs `inner` (a future or a stream) attached to `scope` on every poll, whichever
/// thread polls it. A scope that has ended is simply not attached.
pub fn in_scope<F>(scope: ScopeHandle, inner: F) -> InScope<F> {
    InScope { scope, inner: ManuallyDrop::new(inner) }
}

impl<F> InScope<F> {
    /// The inner future, pinned, with the handle.
    fn project(self: Pin<&mut Self>) -> (ScopeHandle, Pin<&mut F>) {
        // SAFETY: `inner` is structurally pinned: it is never moved out of `self`
        // (only dropped in place, in `Drop`), `InScope` has no `Unpin` impl of its own
        // (it is `Unpin` only when `F` is), and `scope` is a `Copy` value never pinned.
        unsafe {
            let this = self.get_unchecked_mut();
            (this.scope, Pin::new_unchecked(&mut *this.inner))
        }
    }
}

impl<F: Future> Future for InScope<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let (scope, inner) = self.project();
        let _attached = scope.attach().ok();
        inner.poll(cx)
    }
}

impl<S: Stream> Stream for InScope<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let (scope, inner) = self.project();
        let _attached = scope.attach().ok();
        inner.poll_next(cx)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (*self.inner).size_hint()
    }
}

impl<F> Drop for InScope<F> {
    fn drop(&mut self) {
        let _attached = self.scope.attach().ok();
        // SAFETY: `inner` is dropped exactly once, here, in place (as pinning
        // requires), and never used again.
        unsafe { ManuallyDrop::drop(&mut self.inner) }
    }
}

/// A DataFusion [`JoinSetTracer`]: every task DataFusion spawns (partitions, spill
/// readers) runs in the scope the spawning thread was attached to, on every poll.
/// [`install_tracer`] installs it; a program with a tracer of its own can call this
/// one's methods from its own.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScopeTracer;

impl JoinSetTracer for ScopeTracer {
    fn trace_future(
        &self,
        fut: BoxFuture<'static, Box<dyn Any + Send>>,
    ) -> BoxFuture<'static, Box<dyn Any + Send>> {
        match MemoryManager::global().current() {
            Some(scope) => Box::pin(in_scope(scope, fut)),
            None => fut,
        }
    }

    fn trace_block(
        &self,
        f: Box<dyn FnOnce() -> Box<dyn Any + Send> + Send>,
    ) -> Box<dyn FnOnce() -> Box<dyn Any + Send> + Send> {
        match MemoryManager::global().current() {
            Some(scope) => Box::new(move || {
                let _attached = scope.attach().ok();
                f()
            }),
            None => f,
        }
    }
}

static INSTALLED: OnceLock<bool> = OnceLock::new();

/// Installs [`ScopeTracer`] as DataFusion's process-wide `JoinSetTracer`, once.
/// Returns whether it is the one installed: false when the program set a tracer of
/// its own first (DataFusion allows one), which should then call [`ScopeTracer`].
pub fn install_tracer() -> bool {
    *INSTALLED.get_or_init(|| set_join_set_tracer(&ScopeTracer).is_ok())
}
