//! A query that plans again when what it asked for cannot fit the budget: the
//! spark-rapids retry, applied to a whole query, and, before it runs, a plan chosen
//! join by join from DataFusion's estimates against what the budget leaves the query.
//! DataFusion cannot spill some operators
//! (a hash join's build side above all); when [`MemquotaPool`] refuses one of them,
//! spilling cannot make room and the query fails. [`collect_query`] then runs it again
//! from its logical plan with a more frugal physical plan: sort-merge joins, which
//! spill, then also smaller batches and merge reservations, so that every sort and
//! merge holds less. The hash join stays the plan wherever it fits: it is tried first,
//! and it is faster.

use crate::estimate::{address, joins_to_spill};
use crate::pool::MemquotaPool;
use crate::query::QueryScope;
use datafusion::arrow::compute::SortOptions;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::session_state::{SessionState, SessionStateBuilder};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::joins::{HashJoinExec, SortMergeJoinExec};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{collect, ExecutionPlan};
use datafusion::prelude::{DataFrame, SessionConfig};
use std::any::Any;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// How many times a query is run again at most: one plan per rung of [`rungs`].
pub const MAX_RETRIES: usize = 2;

/// What [`collect_query`] returns: the batches, and the plan that produced them (for
/// its metrics: spills, rows, times).
#[derive(Debug)]
#[non_exhaustive]
pub struct Collected {
    /// The query's result.
    pub batches: Vec<RecordBatch>,
    /// The physical plan of the run that completed.
    pub plan: Arc<dyn ExecutionPlan>,
    /// Runs that failed on a refusal no spill could answer, each followed by a run
    /// with a more frugal plan.
    pub retries: u64,
    /// Plans changed before they ran (0 or 1): the estimate of the first plan's hash
    /// joins did not fit the room the budget left the query, so the joins that did
    /// not fit ran as sort-merge joins.
    pub replans: u64,
    /// The joins so changed: hash joins planned as sort-merge joins.
    pub replanned_joins: u64,
}

/// One plan to try: a name for the scope's report, and the session settings.
struct Rung {
    what: String,
    config: SessionConfig,
}

/// What the most frugal plan's sorts reserve for their merges, and its batch size:
/// DataFusion's 10 MiB per sort and 8192 rows a batch leave too little for the sorts
/// of a plan of sort-merge joins (TPC-H queries 10 and 18 at 128 MiB fail in them;
/// with these, they complete: docs/benchmarks.md).
const FRUGAL_SORT_RESERVATION: usize = 2 << 20;
const FRUGAL_BATCH: usize = 2048;

/// The plans, from the one asked for to the most frugal: sort-merge joins (which
/// spill, where a hash join's build side cannot), then also smaller merge reservations
/// and batches (each sort and each merge of spill files holds less).
fn rungs(config: &SessionConfig) -> Vec<Rung> {
    let mut out = vec![Rung { what: String::new(), config: config.clone() }];
    let mut frugal = config.clone();
    if frugal.options().optimizer.prefer_hash_join {
        frugal.options_mut().optimizer.prefer_hash_join = false;
        out.push(Rung { what: "sort-merge joins".into(), config: frugal.clone() });
    }
    let reservation = frugal.options().execution.sort_spill_reservation_bytes.min(FRUGAL_SORT_RESERVATION);
    frugal.options_mut().execution.sort_spill_reservation_bytes = reservation;
    let batch = frugal.batch_size().min(FRUGAL_BATCH);
    let frugal = frugal.with_batch_size(batch);
    // Short: memquota keeps 48 bytes of a scope's name.
    out.push(Rung { what: "sort-merge, small batches".into(), config: frugal });
    out.truncate(MAX_RETRIES + 1);
    out
}

/// The runtime's [`MemquotaPool`], if that is its pool.
fn memquota_pool(state: &SessionState) -> Option<&MemquotaPool> {
    let pool: &dyn Any = state.runtime_env().memory_pool.as_ref();
    pool.downcast_ref::<MemquotaPool>()
}

/// Runs `physical` to its end.
async fn run(state: &SessionState, physical: &Arc<dyn ExecutionPlan>) -> Result<Vec<RecordBatch>> {
    collect(Arc::clone(physical), Arc::new(TaskContext::from(state))).await
}

/// A physical optimizer rule, run right after DataFusion's join selection: the hash
/// joins that, by DataFusion's estimates, would hold more than `room` (their build
/// sides, which cannot spill) become sort-merge joins, which spill; the joins that fit
/// stay hash joins ([`joins_to_spill`]). DataFusion's later rules then give each
/// sort-merge join the hash partitioning and the sorts it requires, as they do for a
/// session without hash joins. A join whose build side has no row count is taken to
/// fit (it is tried, and a refusal retries the query).
#[derive(Debug)]
struct FitJoins {
    room: u64,
    /// Joins made sort-merge joins, and hash joins in the plan, by the last run.
    replanned: AtomicUsize,
    joins: AtomicUsize,
}

impl FitJoins {
    const NAME: &str = "memquota_fit_joins";

    /// The state `state` with this rule after its join selection; `None` when it has
    /// none (a session of its own rules: its plan is left as it is).
    fn add_to(self: &Arc<Self>, state: &SessionState) -> Option<SessionState> {
        let mut rules = state.physical_optimizers().to_vec();
        let at = rules.iter().position(|r| r.name() == "join_selection")? + 1;
        rules.insert(at, Arc::clone(self) as _);
        Some(
            SessionStateBuilder::new_from_existing(state.clone())
                .with_config(state.config().clone().with_create_default_catalog_and_schema(false))
                .with_physical_optimizer_rules(rules)
                .build(),
        )
    }
}

impl PhysicalOptimizerRule for FitJoins {
    fn optimize(&self, plan: Arc<dyn ExecutionPlan>, _: &ConfigOptions) -> Result<Arc<dyn ExecutionPlan>> {
        // Statistics that cannot be computed leave the plan as it is, as a build side
        // without a row count does.
        let Ok((spilling, joins)) = joins_to_spill(plan.as_ref(), self.room) else { return Ok(plan) };
        self.joins.store(joins, Relaxed);
        self.replanned.store(spilling.len(), Relaxed);
        if spilling.is_empty() {
            return Ok(plan);
        }
        // Top down: a node is looked at before any node under it is rebuilt, so its
        // address is still the one the estimate saw.
        plan.transform_down(|node| match node.downcast_ref::<HashJoinExec>() {
            Some(join) if spilling.contains(&address(node.as_ref())) => {
                Ok(Transformed::yes(sort_merge(join)?))
            }
            _ => Ok(Transformed::no(node)),
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        FitJoins::NAME
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// `join` as a sort-merge join of the same inputs, type, keys, filter and null
/// equality, as DataFusion's planner makes one (ascending keys, nulls first); the hash
/// join's embedded projection becomes a `ProjectionExec` over it.
fn sort_merge(join: &HashJoinExec) -> Result<Arc<dyn ExecutionPlan>> {
    let merged: Arc<dyn ExecutionPlan> = Arc::new(SortMergeJoinExec::try_new(
        Arc::clone(join.left()),
        Arc::clone(join.right()),
        join.on().to_vec(),
        join.filter().cloned(),
        *join.join_type(),
        vec![SortOptions::default(); join.on().len()],
        join.null_equality(),
    )?);
    let Some(projection) = join.projection.as_deref() else { return Ok(merged) };
    let schema = merged.schema();
    let columns: Vec<(Arc<dyn PhysicalExpr>, String)> = projection
        .iter()
        .map(|&i| {
            let name = schema.field(i).name();
            (Arc::new(Column::new(name, i)) as Arc<dyn PhysicalExpr>, name.clone())
        })
        .collect();
    Ok(Arc::new(ProjectionExec::try_new(columns, merged)?))
}

/// Runs the query `df` to its end as a memquota scope named `name` (as
/// [`run_query`](crate::run_query) does) and collects its result, with a plan that
/// fits the budget:
///
/// * **Before it runs**, when DataFusion's statistics say the plan's hash joins would
///   hold more than the budget leaves the query (their build sides, which cannot
///   spill, against the room under the limit and under its fair share, less the
///   pool's margin), the joins that do not fit are planned as sort-merge joins, which
///   spill, and the others stay hash joins, fitting a quarter of that room (the rest
///   is for the sort-merge joins' sorts and the estimate's error): docs/datafusion.md,
///   "Before the first run"
///   ([`Collected::replans`], [`PoolStats::replans`](crate::PoolStats::replans);
///   [`Collected::replanned_joins`]). Its scope is named `"{name} (replanned: K of N
///   joins sort-merge)"`. Without row counts (a table that gives none) the hash joins
///   are tried.
/// * **When a run fails** because [`MemquotaPool`] refused a request no spill could
///   answer (an operator that cannot spill, such as `HashJoinInput`, a hash join's
///   build side, or a spiller holding nothing), the query is planned again from its
///   logical plan with sort-merge joins, then also with smaller batches (2048 rows)
///   and merge reservations (2 MiB a sort), and run again: at most [`MAX_RETRIES`]
///   times. Each run is a scope of its own; a retry's is named `"{name} (retry N:
///   sort-merge joins)"` (memquota keeps its first 48 bytes), so memquota's report
///   says which plan ran, and the pool counts it ([`MemquotaPool::retries`]).
///
/// Without a [`MemquotaPool`] as the runtime's pool (or with one wrapped in another
/// pool), the query runs once, as planned.
///
/// # Errors
/// The last run's error: DataFusion's own, or `ResourcesExhausted` from the pool when
/// even the most frugal plan does not fit, or when the refused operator could spill.
pub async fn collect_query(name: &str, df: DataFrame) -> Result<Collected> {
    let (state, plan) = df.into_parts();
    let pool = memquota_pool(&state);
    let rungs = rungs(state.config());
    let mut retries = 0;
    let mut replans = 0;
    let mut replanned_joins = 0;
    let mut i = 0;
    loop {
        let rung = &rungs[i];
        let scope = QueryScope::begin(&match i {
            0 => name.to_owned(),
            _ => format!("{name} (retry {i}: {})", rung.what),
        })?;
        // The first plan's hash joins are held against the room the budget leaves
        // the query; a retry's plan spills wherever it can already.
        let fit = pool.filter(|_| i == 0).map(|p| {
            Arc::new(FitJoins { room: p.room_for(scope.handle()), replanned: 0.into(), joins: 0.into() })
        });
        let state = match (i, fit.as_ref().and_then(|f| f.add_to(&state))) {
            (0, Some(fitted)) => fitted,
            (0, None) => state.clone(),
            // The retry's state shares the session's catalogs: with the session's own
            // config it would register a new, empty default catalog over them, and
            // every later query of the session would find no table.
            _ => SessionStateBuilder::new_from_existing(state.clone())
                .with_config(rung.config.clone().with_create_default_catalog_and_schema(false))
                .build(),
        };
        let physical = scope.run(state.create_physical_plan(&plan)).await?;
        let fitted = fit.map_or((0, 0), |f| (f.replanned.load(Relaxed), f.joins.load(Relaxed)));
        let scope = match (pool, fitted) {
            (Some(p), (k, n)) if k > 0 => {
                p.note_replan(k as u64);
                replans += 1;
                replanned_joins += k as u64;
                let _ = scope.end();
                QueryScope::begin(&format!("{name} (replanned: {k} of {n} joins sort-merge)"))?
            }
            _ => scope,
        };
        let handle = scope.handle();
        let out = scope.run(run(&state, &physical)).await;
        let unspillable = pool.map_or(0, |p| p.take_unspillable_refusals(handle));
        // What the results hold is handed to the caller, not leaked.
        let _ = scope.end();
        match out {
            Ok(batches) => {
                return Ok(Collected { batches, plan: physical, retries, replans, replanned_joins });
            }
            Err(e) if i + 1 < rungs.len() && unspillable > 0 && exhausted(&e) => {
                retries += 1;
                i += 1;
                if let Some(p) = pool {
                    p.note_retry();
                }
            }
            Err(e) => return Err(e),
        }
    }
}

fn exhausted(e: &DataFusionError) -> bool {
    matches!(e.find_root(), DataFusionError::ResourcesExhausted(_))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plans(config: &SessionConfig) -> Vec<(String, bool, usize, usize)> {
        rungs(config)
            .into_iter()
            .map(|r| {
                let o = r.config.options();
                (
                    r.what,
                    o.optimizer.prefer_hash_join,
                    r.config.batch_size(),
                    o.execution.sort_spill_reservation_bytes,
                )
            })
            .collect()
    }

    #[test]
    fn the_hash_join_first_then_sort_merge_then_smaller_batches() {
        let config = SessionConfig::new();
        assert_eq!(
            plans(&config),
            [
                (String::new(), true, 8192, 10 << 20),
                ("sort-merge joins".to_owned(), false, 8192, 10 << 20),
                ("sort-merge, small batches".to_owned(), false, 2048, 2 << 20)
            ]
        );
    }

    #[test]
    fn a_session_without_hash_joins_only_gets_smaller_batches() {
        let mut config = SessionConfig::new().with_batch_size(1024);
        config.options_mut().optimizer.prefer_hash_join = false;
        assert_eq!(
            plans(&config),
            [
                (String::new(), false, 1024, 10 << 20),
                ("sort-merge, small batches".to_owned(), false, 1024, 2 << 20)
            ]
        );
    }
}
