//! A query's life as a memquota scope: begun before it plans, attached on every poll
//! of its future and of every task it spawns, ended when it is done. The report, the
//! stats and the fair share then speak of queries.

use crate::attach::{in_scope, install_tracer};
use datafusion::error::{DataFusionError, Result};
use memquota::{MemoryManager, ScopeReport};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Runs `query` (a future that plans and executes, such as `DataFrame::collect`) in a
/// memquota scope of its own named `name`: its allocations, those of the tasks it
/// spawns, and the reservations it makes through [`MemquotaPool`](crate::MemquotaPool)
/// are charged to the scope, which counts for one in the fair share. Returns the
/// query's result; what the result itself holds stays in the process account after the
/// scope ends.
///
/// # Errors
/// The query's own error, or `ResourcesExhausted` when memquota's scope table (256
/// live scopes) is full.
pub async fn run_query<T>(name: &str, query: impl Future<Output = Result<T>>) -> Result<T> {
    let scope = QueryScope::begin(name)?;
    let out = scope.run(query).await;
    // What the results still hold is no leak: they are handed to the caller.
    let _ = scope.end();
    out
}

/// A query's scope, for a caller that wants its figures or to end it later than
/// [`run_query`] does.
#[derive(Debug)]
pub struct QueryScope {
    scope: memquota::TaskScope,
}

impl QueryScope {
    /// Begins a scope named `name` (and installs the [`ScopeTracer`](crate::ScopeTracer)
    /// if no tracer is set yet).
    ///
    /// # Errors
    /// `ResourcesExhausted` when memquota's scope table is full.
    pub fn begin(name: &str) -> Result<QueryScope> {
        install_tracer();
        let id = NEXT_ID.fetch_add(1, Relaxed);
        let scope = MemoryManager::global().begin(name, id, 0).map_err(|e| {
            DataFusionError::ResourcesExhausted(format!("{e}: cannot begin a scope for {name}"))
        })?;
        Ok(QueryScope { scope })
    }

    /// The scope's handle (for its figures, or to attach other work to it).
    pub fn handle(&self) -> memquota::ScopeHandle {
        self.scope.handle()
    }

    /// The scope's figures now (held, peak, allocated, reserved, threads).
    pub fn stats(&self) -> Option<memquota::ScopeStats> {
        self.scope.stats()
    }

    /// `fut` (a future or a stream, such as `DataFrame::execute_stream`'s) attached to
    /// the scope on every poll.
    pub fn run<F>(&self, fut: F) -> crate::InScope<F> {
        in_scope(self.scope.handle(), fut)
    }

    /// Ends the scope; its report says what it still held (what the query's results
    /// hold is counted for the process from then on).
    pub fn end(self) -> ScopeReport {
        self.scope.end()
    }
}
