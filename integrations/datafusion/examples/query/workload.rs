//! The example's query, shared by the example, the tests and the benchmark: data
//! generated on the fly (no files), a group-by with a count, a sum and a string max
//! over about a million groups, then the top 5 by sum. Also the same answer computed
//! in plain Rust, to check DataFusion's against.
#![allow(dead_code)] // each user takes its part

use memquota_datafusion::datafusion;

use datafusion::arrow::array::{ArrayRef, Int64Array, StringBuilder};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::display::array_value_to_string;
use datafusion::catalog::streaming::StreamingTable;
use datafusion::error::Result;
use datafusion::execution::memory_pool::MemoryPool;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::functions_aggregate::expr_fn::{count, max, sum};
use datafusion::logical_expr::JoinType;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::physical_plan::{collect, ExecutionPlan};
use datafusion::prelude::{col, lit, DataFrame, SessionConfig, SessionContext};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rows of the example's table.
pub const ROWS: u64 = 20_000_000;
/// Its partitions (and DataFusion's target partitions).
pub const PARTITIONS: usize = 2;
/// `GROUP BY v % GROUPS`.
pub const GROUPS: i64 = 1_000_003;
const BATCH: u64 = 8192;
/// Values are 40-bit: sums of ~20 of them per group stay far from overflow.
const VALUE_MASK: u64 = (1 << 40) - 1;

/// The value of row `i`: a fixed pseudo-random 40-bit number (splitmix64).
pub fn value(i: u64) -> i64 {
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) & VALUE_MASK) as i64
}

/// The string of value `v`: fixed width, so the string max is the value max.
pub fn label(v: i64) -> String {
    format!("s{v:019}")
}

fn write_label(v: i64, out: &mut [u8; 20]) {
    out[0] = b's';
    let mut v = v as u64;
    for slot in out[1..].iter_mut().rev() {
        *slot = b'0' + (v % 10) as u8;
        v /= 10;
    }
}

/// One row of the result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub k: i64,
    pub n: i64,
    pub total: i64,
    pub top: String,
}

impl std::fmt::Display for Row {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {} {}", self.k, self.n, self.total, self.top)
    }
}

impl std::str::FromStr for Row {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Row, String> {
        let p: Vec<&str> = s.split_whitespace().collect();
        let num = |i: usize| p.get(i).and_then(|x| x.parse().ok()).ok_or_else(|| format!("bad row {s:?}"));
        Ok(Row { k: num(0)?, n: num(1)?, total: num(2)?, top: p.get(3).ok_or("no max")?.to_string() })
    }
}

/// A partition of the generated table: rows `start..end`, in batches made as they are
/// read.
#[derive(Debug)]
struct Generated {
    schema: SchemaRef,
    start: u64,
    end: u64,
}

impl PartitionStream for Generated {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let schema = Arc::clone(&self.schema);
        let (start, end) = (self.start, self.end);
        let batches = (start..end).step_by(BATCH as usize).map(move |from| {
            let to = (from + BATCH).min(end);
            let n = (to - from) as usize;
            let values: Vec<i64> = (from..to).map(value).collect();
            let mut labels = StringBuilder::with_capacity(n, n * 20);
            let mut buf = [0u8; 20];
            for &v in &values {
                write_label(v, &mut buf);
                // The digits and 's' are ASCII.
                labels.append_value(std::str::from_utf8(&buf).expect("ASCII"));
            }
            let columns: Vec<ArrayRef> = vec![Arc::new(Int64Array::from(values)), Arc::new(labels.finish())];
            Ok(RecordBatch::try_new(Arc::clone(&schema), columns)?)
        });
        Box::pin(RecordBatchStreamAdapter::new(Arc::clone(&self.schema), futures::stream::iter(batches)))
    }
}

/// The generated table: columns `value`, `label` named `v`, `s` (or as given), `rows`
/// rows over `partitions` partitions.
pub fn table(rows: u64, partitions: usize, names: (&str, &str)) -> Result<Arc<StreamingTable>> {
    let schema = Arc::new(Schema::new(vec![
        Field::new(names.0, DataType::Int64, false),
        Field::new(names.1, DataType::Utf8, false),
    ]));
    let per = rows / partitions as u64;
    let parts = (0..partitions as u64)
        .map(|p| {
            let end = if p + 1 == partitions as u64 { rows } else { (p + 1) * per };
            Arc::new(Generated { schema: Arc::clone(&schema), start: p * per, end })
                as Arc<dyn PartitionStream>
        })
        .collect();
    Ok(Arc::new(StreamingTable::try_new(schema, parts)?))
}

/// A session on `pool` with `PARTITIONS` target partitions and DataFusion's defaults
/// otherwise; spills go to the system's temporary directory, read back on the polling
/// thread when `scoped_spills` (memquota-datafusion's `disk_manager_builder`), else
/// DataFusion's own way.
pub fn session(pool: Arc<dyn MemoryPool>, scoped_spills: bool) -> Result<SessionContext> {
    let mut runtime = RuntimeEnvBuilder::new().with_memory_pool(pool);
    if scoped_spills {
        runtime = runtime.with_disk_manager_builder(memquota_datafusion::disk_manager_builder()?);
    }
    Ok(SessionContext::new_with_config_rt(
        SessionConfig::new().with_target_partitions(PARTITIONS),
        runtime.build_arc()?,
    ))
}

/// `SELECT v % 1000003 AS k, count(*) AS n, sum(v) AS total, max(s) AS top FROM t
/// GROUP BY k ORDER BY total DESC, k LIMIT 5`.
pub fn group_by(ctx: &SessionContext, rows: u64) -> Result<DataFrame> {
    ctx.read_table(table(rows, PARTITIONS, ("v", "s"))?)?
        .aggregate(
            vec![(col("v") % lit(GROUPS)).alias("k")],
            vec![count(lit(1)).alias("n"), sum(col("v")).alias("total"), max(col("s")).alias("top")],
        )?
        .sort(vec![col("total").sort(false, false), col("k").sort(true, false)])?
        .limit(0, Some(5))
}

/// A join whose build side (all `rows` rows of one table, which DataFusion cannot
/// spill) is far larger than the example's limits: `SELECT count(*) FROM t JOIN u ON
/// v = w`.
pub fn big_join(ctx: &SessionContext, rows: u64) -> Result<DataFrame> {
    let left = ctx.read_table(table(rows, PARTITIONS, ("v", "s"))?)?;
    let right = ctx.read_table(table(rows, PARTITIONS, ("w", "t"))?)?;
    join(left, right)
}

/// `big_join`'s query over any two tables of `table`'s columns.
pub fn join(left: DataFrame, right: DataFrame) -> Result<DataFrame> {
    left.join(right, JoinType::Inner, &["v"], &["w"], None)?.aggregate(vec![], vec![count(lit(1)).alias("n")])
}

/// A join that cannot be planned but as a cross join, whose collected side is all
/// `rows` rows of one table: `SELECT max(v + w) FROM t, u` with `u` of 2 rows.
pub fn cross_join(ctx: &SessionContext, rows: u64) -> Result<DataFrame> {
    let left = ctx.read_table(table(rows, PARTITIONS, ("v", "s"))?)?;
    let right = ctx.read_table(table(2, PARTITIONS, ("w", "t"))?)?;
    left.join(right, JoinType::Inner, &[], &[], None)?
        .aggregate(vec![], vec![max(col("v") + col("w")).alias("m")])
}

/// The first column of the first row of a one-number result.
pub fn number(batches: &[RecordBatch]) -> i64 {
    batches
        .first()
        .and_then(|b| b.column(0).as_any().downcast_ref::<Int64Array>())
        .map_or(i64::MIN, |a| a.value(0))
}

/// `big_join`'s answer in plain Rust: the pairs of rows with equal values.
pub fn join_count(rows: u64) -> i64 {
    let mut values: Vec<i64> = (0..rows).map(value).collect();
    values.sort_unstable();
    values.chunk_by(|a, b| a == b).map(|run| (run.len() * run.len()) as i64).sum()
}

/// `cross_join`'s answer in plain Rust.
pub fn cross_join_max(rows: u64) -> i64 {
    (0..rows).map(value).max().unwrap_or(0) + value(0).max(value(1))
}

/// What a run produced.
#[derive(Debug)]
pub struct Outcome {
    pub rows: Vec<Row>,
    /// Spill files DataFusion wrote, over the whole plan.
    pub spills: usize,
    pub spilled_bytes: usize,
    pub elapsed: Duration,
}

/// Plans and runs the group-by, collecting its result and spill figures.
pub async fn run(ctx: &SessionContext, rows: u64) -> Result<Outcome> {
    let started = Instant::now();
    let plan = group_by(ctx, rows)?.create_physical_plan().await?;
    let batches = collect(Arc::clone(&plan), ctx.task_ctx()).await?;
    let elapsed = started.elapsed();
    let (spills, spilled_bytes) = spill_figures(plan.as_ref());
    Ok(Outcome { rows: rows_of(&batches)?, spills, spilled_bytes, elapsed })
}

/// Runs the join: its row count.
pub async fn run_join(ctx: &SessionContext, rows: u64) -> Result<i64> {
    let batches = big_join(ctx, rows)?.collect().await?;
    Ok(batches
        .first()
        .and_then(|b| b.column(0).as_any().downcast_ref::<Int64Array>())
        .map_or(0, |a| a.value(0)))
}

fn spill_figures(plan: &dyn ExecutionPlan) -> (usize, usize) {
    let own =
        plan.metrics().map_or((0, 0), |m| (m.spill_count().unwrap_or(0), m.spilled_bytes().unwrap_or(0)));
    plan.children().into_iter().fold(own, |(c, b), child| {
        let (cc, cb) = spill_figures(child.as_ref());
        (c + cc, b + cb)
    })
}

fn rows_of(batches: &[RecordBatch]) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for b in batches {
        for i in 0..b.num_rows() {
            let cell = |c: usize| array_value_to_string(b.column(c), i);
            let num = |c: usize| -> Result<i64> {
                cell(c)?.parse().map_err(|e| datafusion::error::DataFusionError::Execution(format!("{e}")))
            };
            rows.push(Row { k: num(0)?, n: num(1)?, total: num(2)?, top: cell(3)? });
        }
    }
    Ok(rows)
}

/// The same answer in plain Rust: per group count, sum and the largest value.
pub fn expected(rows: u64) -> Vec<Row> {
    let g = GROUPS as usize;
    let (mut n, mut total, mut top) = (vec![0i64; g], vec![0i64; g], vec![-1i64; g]);
    for i in 0..rows {
        let v = value(i);
        let k = (v % GROUPS) as usize;
        n[k] += 1;
        total[k] += v;
        top[k] = top[k].max(v);
    }
    let mut keys: Vec<usize> = (0..g).filter(|&k| n[k] > 0).collect();
    keys.sort_by(|&a, &b| total[b].cmp(&total[a]).then(a.cmp(&b)));
    keys.iter().take(5).map(|&k| Row { k: k as i64, n: n[k], total: total[k], top: label(top[k]) }).collect()
}
