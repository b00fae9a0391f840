//! The TPC-H tables as DataFusion tables generated while they are scanned: each
//! partition of a scan runs `tpchgen`'s generator for its share of the rows and turns
//! them into Arrow batches as the query pulls them. No file, no download, and nothing
//! held in memory but what the query itself keeps, and the generator's text pool.
//!
//! The text pool is what comments are cut from. dbgen's is 300 MiB, more than the
//! limits measured; this one is 8 MiB, made once per process before any query
//! (counted in the idle runtime). Comments then differ from dbgen's (they are cut
//! from a shorter text, at other offsets): results are checked against the same
//! data's unbounded run, not against TPC-H's answer set.
#![allow(dead_code)] // the benchmark and the tests each take their part

use memquota_datafusion::datafusion;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::error::ArrowError;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::streaming::StreamingTable;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::prelude::SessionContext;
use std::sync::{Arc, OnceLock};
use tpchgen::distribution::Distributions;
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator, PartSuppGenerator,
    RegionGenerator, SupplierGenerator,
};
use tpchgen::text::TextPool;
use tpchgen_arrow::{
    CustomerArrow, LineItemArrow, NationArrow, OrderArrow, PartArrow, PartSuppArrow, RegionArrow,
    SupplierArrow,
};

/// The eight tables.
pub const TABLES: [&str; 8] =
    ["lineitem", "orders", "customer", "part", "partsupp", "supplier", "nation", "region"];

/// Rows per generated batch: DataFusion's default batch size.
const BATCH: usize = 8192;

/// Bytes of the text pool.
pub const TEXT_POOL: i32 = 8 << 20;

static POOL: OnceLock<TextPool> = OnceLock::new();

/// The text pool, made on first use.
pub fn text_pool() -> &'static TextPool {
    POOL.get_or_init(|| TextPool::new(TEXT_POOL, Distributions::static_default()))
}

type Batches = Box<dyn Iterator<Item = std::result::Result<RecordBatch, ArrowError>> + Send>;

/// One partition of one table: part `part` of `parts` (1-based, as dbgen counts).
#[derive(Debug)]
struct Generated {
    table: &'static str,
    scale: f64,
    part: i32,
    parts: i32,
    schema: SchemaRef,
}

fn schema(table: &str) -> SchemaRef {
    match table {
        "lineitem" => LineItemArrow::schema_ref(),
        "orders" => OrderArrow::schema_ref(),
        "customer" => CustomerArrow::schema_ref(),
        "part" => PartArrow::schema_ref(),
        "partsupp" => PartSuppArrow::schema_ref(),
        "supplier" => SupplierArrow::schema_ref(),
        "nation" => NationArrow::schema_ref(),
        "region" => RegionArrow::schema_ref(),
        other => panic!("no TPC-H table {other}"),
    }
}

impl Generated {
    fn batches(&self) -> Batches {
        let (sf, part, parts) = (self.scale, self.part, self.parts);
        let (d, t) = (Distributions::static_default(), text_pool());
        match self.table {
            "lineitem" => Box::new(
                LineItemArrow::new(LineItemGenerator::new_with_distributions_and_text_pool(
                    sf, part, parts, d, t,
                ))
                .with_batch_size(BATCH),
            ),
            "orders" => Box::new(
                OrderArrow::new(OrderGenerator::new_with_distributions_and_text_pool(sf, part, parts, d, t))
                    .with_batch_size(BATCH),
            ),
            "customer" => Box::new(
                CustomerArrow::new(CustomerGenerator::new_with_distributions_and_text_pool(
                    sf, part, parts, d, t,
                ))
                .with_batch_size(BATCH),
            ),
            "part" => Box::new(
                PartArrow::new(PartGenerator::new_with_distributions_and_text_pool(sf, part, parts, d, t))
                    .with_batch_size(BATCH),
            ),
            "partsupp" => Box::new(
                PartSuppArrow::new(PartSuppGenerator::new_with_text_pool(sf, part, parts, t))
                    .with_batch_size(BATCH),
            ),
            "supplier" => Box::new(
                SupplierArrow::new(SupplierGenerator::new_with_distributions_and_text_pool(
                    sf, part, parts, d, t,
                ))
                .with_batch_size(BATCH),
            ),
            "nation" => Box::new(
                NationArrow::new(NationGenerator::new_with_distributions_and_text_pool(d, t))
                    .with_batch_size(BATCH),
            ),
            "region" => Box::new(
                RegionArrow::new(RegionGenerator::new_with_distributions_and_text_pool(d, t))
                    .with_batch_size(BATCH),
            ),
            other => panic!("no TPC-H table {other}"),
        }
    }
}

impl PartitionStream for Generated {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let batches = self.batches().map(|b| b.map_err(DataFusionError::from));
        Box::pin(RecordBatchStreamAdapter::new(Arc::clone(&self.schema), futures::stream::iter(batches)))
    }
}

/// `table` at scale factor `scale` over `partitions` partitions (nation and region,
/// which the generator does not split, in one).
pub fn table(table: &'static str, scale: f64, partitions: usize) -> Result<Arc<StreamingTable>> {
    let schema = schema(table);
    let parts = if matches!(table, "nation" | "region") { 1 } else { partitions.max(1) as i32 };
    let streams = (1..=parts)
        .map(|part| {
            Arc::new(Generated { table, scale, part, parts, schema: Arc::clone(&schema) })
                as Arc<dyn PartitionStream>
        })
        .collect();
    Ok(Arc::new(StreamingTable::try_new(schema, streams)?))
}

/// `table`'s rows at scale factor `scale`, and whether the count is exact: the
/// generator's own count, but for lineitem (1 to 7 lines an order: about 4 an order).
fn rows(table: &str, scale: f64) -> (usize, bool) {
    let count = |n: i64| n.max(0) as usize;
    match table {
        "nation" => (25, true),
        "region" => (5, true),
        "part" => (count(PartGenerator::calculate_row_count(scale, 1, 1)), true),
        "supplier" => (count(SupplierGenerator::calculate_row_count(scale, 1, 1)), true),
        "partsupp" => (count(PartSuppGenerator::calculate_row_count(scale, 1, 1)), true),
        "customer" => (count(CustomerGenerator::calculate_row_count(scale, 1, 1)), true),
        "orders" => (count(OrderGenerator::calculate_row_count(scale, 1, 1)), true),
        "lineitem" => (count(OrderGenerator::calculate_row_count(scale, 1, 1)) * 4, false),
        other => panic!("no TPC-H table {other}"),
    }
}

/// Registers the eight tables in `ctx` (and makes the text pool); with `stats`, each
/// tells the planner its row count, as Parquet files' metadata would
/// (`counted::with_rows`), else it gives no statistics (`StreamingTable`'s).
pub fn register(ctx: &SessionContext, scale: f64, partitions: usize, stats: bool) -> Result<()> {
    text_pool();
    for name in TABLES {
        let t = table(name, scale, partitions)?;
        if stats {
            let (n, exact) = rows(name, scale);
            ctx.register_table(name, crate::counted::with_rows(t, n, exact))?;
        } else {
            ctx.register_table(name, t)?;
        }
    }
    Ok(())
}
