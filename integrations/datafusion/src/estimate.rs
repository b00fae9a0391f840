//! What a physical plan's hash joins will hold at once, estimated before it runs from
//! DataFusion's statistics: the planner's own row counts for each build side (a hash
//! join cannot spill its build side, so this is the part of a plan that either fits
//! or fails).
//!
//! A hash join holds its build side (its left input, collected) for as long as it
//! probes, and it pulls its probe side only once built: so a join holds its build side
//! together with whatever its probe side's joins hold, while its build side's own
//! joins are finished before it probes. The estimate follows that: the largest of
//! "building" and "built, plus the probe side's" for each join; other operators add
//! up their inputs' (a union runs them together).

use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::common::Statistics;
use datafusion::error::Result;
use datafusion::physical_plan::joins::HashJoinExec;
use datafusion::physical_plan::statistics::{StatisticsArgs, StatisticsContext};
use datafusion::physical_plan::ExecutionPlan;

/// A row's share of a hash join's table: a hash and a row index in the map (16 bytes,
/// at its 7/8 load) and the next-row chain (8 bytes), rounded up.
const TABLE_BYTES_PER_ROW: u64 = 32;
/// A value of a variable-width column (strings, binaries) when the statistics give
/// rows but no bytes: its offset (4 bytes) and 28 bytes of data.
const VARIABLE_WIDTH: u64 = 32;
/// Any other column without a fixed width (lists, structs, ...).
const OTHER_WIDTH: u64 = 16;

/// The estimate for a plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BuildSides {
    /// Bytes the plan's hash joins hold at once, at most, by the estimate.
    pub(crate) bytes: u64,
    /// Hash joins in the plan.
    pub(crate) joins: usize,
    /// Of those, the joins whose build side has no row count: their bytes are not in
    /// `bytes`.
    pub(crate) unknown: usize,
}

/// Estimates what `plan`'s hash joins hold at once.
pub(crate) fn build_sides(plan: &dyn ExecutionPlan) -> Result<BuildSides> {
    let stats = StatisticsContext::new();
    let mut out = BuildSides::default();
    out.bytes = held(plan, &stats, &mut out)?;
    Ok(out)
}

fn held(plan: &dyn ExecutionPlan, stats: &StatisticsContext, out: &mut BuildSides) -> Result<u64> {
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        out.joins += 1;
        let building = held(join.left().as_ref(), stats, out)?;
        let probing = held(join.right().as_ref(), stats, out)?;
        let left = stats.compute(join.left().as_ref(), &StatisticsArgs::new())?;
        let built = match table_bytes(&left, &join.left().schema()) {
            Some(bytes) => bytes,
            None => {
                out.unknown += 1;
                0
            }
        };
        return Ok(building.max(built.saturating_add(probing)));
    }
    let mut sum = 0u64;
    for child in plan.children() {
        sum = sum.saturating_add(held(child.as_ref(), stats, out)?);
    }
    Ok(sum)
}

/// A build side's bytes in a hash join: its batches (the statistics' bytes, else its
/// rows times the schema's width) and the table over its rows. `None` without a row
/// count.
fn table_bytes(stats: &Statistics, schema: &Schema) -> Option<u64> {
    let rows = *stats.num_rows.get_value()? as u64;
    let data = match stats.total_byte_size.get_value() {
        Some(&bytes) => bytes as u64,
        None => rows.saturating_mul(row_width(schema)),
    };
    Some(data.saturating_add(rows.saturating_mul(TABLE_BYTES_PER_ROW)))
}

/// Bytes per row of `schema`'s columns in Arrow's layout, by type.
fn row_width(schema: &Schema) -> u64 {
    schema
        .fields()
        .iter()
        .map(|f| match f.data_type() {
            DataType::Boolean => 1,
            DataType::Utf8 | DataType::Binary | DataType::Utf8View | DataType::BinaryView => VARIABLE_WIDTH,
            DataType::LargeUtf8 | DataType::LargeBinary => VARIABLE_WIDTH + 4,
            t => t.primitive_width().map_or(OTHER_WIDTH, |w| w as u64),
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::Field;
    use datafusion::common::stats::Precision;

    fn schema() -> Schema {
        Schema::new(vec![
            Field::new("k", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
            Field::new("d", DataType::Date32, false),
        ])
    }

    #[test]
    fn a_row_is_its_columns_widths() {
        assert_eq!(row_width(&schema()), 8 + VARIABLE_WIDTH + 4);
    }

    #[test]
    fn a_build_side_is_its_data_and_its_table() {
        let schema = schema();
        let mut stats = Statistics::new_unknown(&schema);
        assert_eq!(table_bytes(&stats, &schema), None, "no rows: no estimate");
        stats.num_rows = Precision::Inexact(1000);
        assert_eq!(table_bytes(&stats, &schema), Some(1000 * (44 + TABLE_BYTES_PER_ROW)));
        stats.total_byte_size = Precision::Exact(10_000);
        assert_eq!(table_bytes(&stats, &schema), Some(10_000 + 1000 * TABLE_BYTES_PER_ROW));
    }
}
