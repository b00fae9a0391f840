//! DataFusion on memquota's budget: a `MemoryPool` that decides on what the process
//! really holds, and queries that are memquota scopes.
//!
//! DataFusion's own pools count only what operators choose to reserve; the memory they
//! allocate without reserving (batches in flight, a hash table's growth before it is
//! reported) is invisible to them. memquota's allocator sees every allocation.
//! [`MemquotaPool`] admits each `try_grow` against that truth, so refusals, and so
//! DataFusion's spills, happen when the process is really short.
//!
//! ```no_run
//! use memquota_datafusion::datafusion::execution::runtime_env::RuntimeEnvBuilder;
//! use memquota_datafusion::datafusion::prelude::{SessionConfig, SessionContext};
//! use memquota_datafusion::{disk_manager_builder, run_query, MemquotaPool};
//! use std::sync::Arc;
//!
//! #[global_allocator]
//! static GLOBAL: memquota::QuotaAlloc = memquota::QuotaAlloc::new();
//!
//! # async fn f() -> memquota_datafusion::datafusion::error::Result<()> {
//! memquota::init(memquota::Config::new().limit(128 << 20)).expect("a valid limit");
//! let runtime = RuntimeEnvBuilder::new()
//!     .with_memory_pool(Arc::new(MemquotaPool::new()))
//!     .with_disk_manager_builder(disk_manager_builder()?)
//!     .build_arc()?;
//! let ctx = SessionContext::new_with_config_rt(SessionConfig::new(), runtime);
//! let df = ctx.read_empty()?; // any DataFrame
//! let batches = run_query("query 1", df.collect()).await?;
//! # drop(batches); Ok(()) }
//! ```
//!
//! * [`MemquotaPool`]: the pool (see its docs for the decision, its margin, and how
//!   queries at once make room for each other: a query under its fair share waits,
//!   bounded, while the one furthest over its share spills or gives way), its counts
//!   ([`PoolStats`]), and [`disk_manager_builder`], spill files whose reads are charged
//!   to the query and sorts that merge at most [`SPILL_MERGE_FAN_IN`] of them at once.
//! * [`run_query`], [`QueryScope`]: a query as a memquota scope, attached on every poll
//!   of its future and of each task DataFusion spawns for it ([`ScopeTracer`]), so the
//!   work is charged to its query whichever tokio worker runs it.
//! * [`collect_query`]: a query run as [`run_query`] does, planned with sort-merge
//!   joins before it runs when DataFusion's estimates of its hash joins' build sides
//!   do not fit what the budget leaves it, and run again with a more frugal plan
//!   (sort-merge joins, then smaller batches) when an operator that cannot spill (a
//!   hash join's build side) is refused.
//! * [`in_scope`]: the same for any future or stream.
//! * [`datafusion`]: the DataFusion this crate is built on, so a program links the same
//!   version.
//!
//! docs/datafusion.md in memquota's repository has the design and the measurements.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod attach;
mod decide;
mod estimate;
mod exhausted;
mod pool;
mod query;
mod replan;
mod room;
mod spill_files;

pub use attach::{in_scope, install_tracer, InScope, ScopeTracer};
pub use datafusion;
pub use pool::{MemquotaPool, PoolStats, DEFAULT_MARGIN, DEFAULT_MARGIN_CAP, DEFAULT_ROOM_WAIT};
pub use query::{run_query, QueryScope};
pub use replan::{collect_query, Collected, MAX_RETRIES};
pub use spill_files::{disk_manager_builder, ScopedSpillFiles, SPILL_MERGE_FAN_IN};
