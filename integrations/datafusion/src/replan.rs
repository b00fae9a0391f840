//! A query that plans again when what it asked for cannot fit the budget: the
//! spark-rapids retry, applied to a whole query, and, before it runs, a plan chosen
//! from DataFusion's estimates against what the budget leaves the query. DataFusion cannot spill some operators
//! (a hash join's build side above all); when [`MemquotaPool`] refuses one of them,
//! spilling cannot make room and the query fails. [`collect_query`] then runs it again
//! from its logical plan with a more frugal physical plan: sort-merge joins, which
//! spill, then also smaller batches and merge reservations, so that every sort and
//! merge holds less. The hash join stays the plan wherever it fits: it is tried first,
//! and it is faster.

use crate::pool::MemquotaPool;
use crate::query::QueryScope;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::session_state::{SessionState, SessionStateBuilder};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::{collect, ExecutionPlan};
use datafusion::prelude::{DataFrame, SessionConfig};
use std::any::Any;
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
    /// Plans set aside before they ran (0 or 1): the estimate of the first plan's hash
    /// joins did not fit the room the budget left the query, so it ran with
    /// sort-merge joins.
    pub replans: u64,
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

/// Whether the first plan's hash joins, by DataFusion's estimates, would hold more
/// than the budget leaves `scope`'s query: then the next rung's plan runs instead. A
/// join whose build side has no row count is taken to fit (it is tried, and a refusal
/// retries it).
fn too_big(pool: &MemquotaPool, scope: &QueryScope, physical: &dyn ExecutionPlan) -> bool {
    let Ok(sides) = crate::estimate::build_sides(physical) else { return false };
    sides.joins > 0 && sides.bytes > pool.room_for(scope.handle())
}

/// Runs the query `df` to its end as a memquota scope named `name` (as
/// [`run_query`](crate::run_query) does) and collects its result, with a plan that
/// fits the budget:
///
/// * **Before it runs**, when DataFusion's statistics say the plan's hash joins would
///   hold more than the budget leaves the query (their build sides, which cannot
///   spill, against the room under the limit and under its fair share, less the
///   pool's margin), the query is planned with sort-merge joins instead, which spill
///   ([`Collected::replans`], [`PoolStats::replans`](crate::PoolStats::replans)); its
///   scope is named `"{name} (replanned: sort-merge joins)"`. Without row counts (a
///   table that gives none) the hash joins are tried.
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
    let mut i = 0;
    loop {
        let rung = &rungs[i];
        let state = match i {
            0 => state.clone(),
            // The retry's state shares the session's catalogs: with the session's own
            // config it would register a new, empty default catalog over them, and
            // every later query of the session would find no table.
            _ => SessionStateBuilder::new_from_existing(state.clone())
                .with_config(rung.config.clone().with_create_default_catalog_and_schema(false))
                .build(),
        };
        let scope = QueryScope::begin(&match (i, replans) {
            (0, _) => name.to_owned(),
            (1, 1) => format!("{name} (replanned: {})", rung.what),
            _ => format!("{name} (retry {i}: {})", rung.what),
        })?;
        let handle = scope.handle();
        let physical = scope.run(state.create_physical_plan(&plan)).await?;
        if let Some(p) = pool.filter(|p| i == 0 && rungs.len() > 1 && too_big(p, &scope, physical.as_ref())) {
            p.note_replan();
            replans += 1;
            i += 1;
            let _ = scope.end();
            continue;
        }
        let out = scope.run(run(&state, &physical)).await;
        let unspillable = pool.map_or(0, |p| p.take_unspillable_refusals(handle));
        // What the results hold is handed to the caller, not leaked.
        let _ = scope.end();
        match out {
            Ok(batches) => return Ok(Collected { batches, plan: physical, retries, replans }),
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
