//! A table that tells the planner how many rows it has, as a Parquet file's metadata
//! or a catalog's statistics do: the generated tables of the tests and benchmarks have
//! none of their own (DataFusion's `StreamingTable` gives no statistics), so without
//! this their plans are those of a planner that knows nothing (joins in the order the
//! query names them) and `collect_query` has no estimate to plan with.

use memquota_datafusion::datafusion;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::stats::Precision;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::Statistics;
use datafusion::datasource::TableType;
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::statistics::StatisticsArgs;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PhysicalExpr, PlanProperties};
use std::fmt;
use std::sync::Arc;

/// `table` with `rows` rows (`exact`: the count is known, not estimated).
pub fn with_rows(table: Arc<dyn TableProvider>, rows: usize, exact: bool) -> Arc<dyn TableProvider> {
    Arc::new(Counted { table, rows: precision(rows, exact) })
}

fn precision(rows: usize, exact: bool) -> Precision<usize> {
    if exact {
        Precision::Exact(rows)
    } else {
        Precision::Inexact(rows)
    }
}

#[derive(Debug)]
struct Counted {
    table: Arc<dyn TableProvider>,
    rows: Precision<usize>,
}

#[async_trait]
impl TableProvider for Counted {
    fn schema(&self) -> SchemaRef {
        self.table.schema()
    }

    fn table_type(&self) -> TableType {
        self.table.table_type()
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = self.table.scan(state, projection, filters, limit).await?;
        Ok(Arc::new(CountedExec { input, rows: self.rows }))
    }

    fn statistics(&self) -> Option<Statistics> {
        let mut stats = Statistics::new_unknown(&self.schema());
        stats.num_rows = self.rows;
        Some(stats)
    }
}

/// The table's scan, with its row count as its statistics.
#[derive(Debug)]
struct CountedExec {
    input: Arc<dyn ExecutionPlan>,
    rows: Precision<usize>,
}

impl DisplayAs for CountedExec {
    fn fmt_as(&self, _: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CountedExec: rows={:?}", self.rows)
    }
}

impl ExecutionPlan for CountedExec {
    fn name(&self) -> &str {
        "CountedExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let input = children.pop().unwrap_or_else(|| Arc::clone(&self.input));
        Ok(Arc::new(CountedExec { input, rows: self.rows }))
    }

    fn execute(&self, partition: usize, context: Arc<TaskContext>) -> Result<SendableRecordBatchStream> {
        self.input.execute(partition, context)
    }

    fn statistics_from_inputs(
        &self,
        _: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        let mut stats = Statistics::new_unknown(&self.schema());
        stats.num_rows = match args.partition() {
            None => self.rows,
            // The rows spread evenly over the partitions, as the generators split them.
            Some(_) => {
                let parts = self.properties().partitioning.partition_count().max(1);
                self.rows.get_value().map_or(Precision::Absent, |&n| Precision::Inexact(n / parts))
            }
        };
        Ok(Arc::new(stats))
    }
}
