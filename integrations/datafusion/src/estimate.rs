//! What a physical plan's hash joins will hold at once, estimated before it runs from
//! DataFusion's statistics: the planner's own row counts for each build side (a hash
//! join cannot spill its build side, so this is the part of a plan that either fits
//! or fails).
//!
//! The rows of a build side are estimated here rather than taken from DataFusion's
//! join estimates: without distinct counts (which row counts alone do not give, nor
//! most Parquet files) DataFusion takes a join's output for the smaller input's size,
//! so a build side that is the output of a join of a big table comes out a hundred
//! times too small (TPC-H query 7: 10,000 rows for a build side of 1.8 M). Here a
//! join of a key to a foreign key (TPC-H's every join) yields the foreign-key side's
//! rows, fewer by the part of its rows the key side's filters kept; a semi or anti
//! join at most its kept side's, a cross join the product; a filter keeps DataFusion's
//! own selectivity; an aggregate at most its input's.
//!
//! A hash join holds its build side (its left input, collected) for as long as it
//! probes, and it pulls its probe side only once built: so a join holds its build side
//! together with whatever its probe side's joins hold, while its build side's own
//! joins are finished before it probes. Once built, and before it probes, it copies its
//! batches into one (DataFusion's `concat_batches`, unreserved) and then drops them.
//! The estimate follows that: the largest of "building", "built, plus the copy" and
//! "built, plus the probe side's" for each join; other operators add up their inputs'
//! (a union runs them together).

use datafusion::arrow::datatypes::{DataType, Schema};
use datafusion::common::JoinType;
use datafusion::error::Result;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, SortMergeJoinExec};
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

/// Estimates what `plan`'s hash joins hold at once, the joins of `spilling` (by
/// address) taken as joins that spill (sort-merge joins): they hold no build side.
fn build_sides_but(plan: &dyn ExecutionPlan, spilling: &[*const ()]) -> Result<BuildSides> {
    let stats = StatisticsContext::new();
    let mut out = BuildSides::default();
    out.bytes = held(plan, &stats, spilling, &mut out)?;
    Ok(out)
}

/// An operator's address, to tell the same node of a plan from an equal one.
pub(crate) fn address(plan: &dyn ExecutionPlan) -> *const () {
    std::ptr::from_ref(plan).cast()
}

/// A build side too small to be worth a sort-merge join: below it a hash join is kept
/// whatever the estimate (as a sort-merge join it would sort its probe side, often a
/// big one, to save less than this).
const SMALL_BUILD: u64 = 1 << 20;

/// The hash joins of `plan` to plan as sort-merge joins (which spill), by their
/// addresses, and the plan's hash joins: none when the plan fits `room`. Otherwise
/// the joins left hash joins must fit a quarter of `room`: half of it is for the
/// sort-merge joins' sorts, which run beside them and which a refused build side
/// cannot make spill (a sort that fitted in memory holds its rows until they are
/// merged), and the estimate of a build side can be short by nearly half (its strings
/// wider than the width taken for them: TPC-H query 10's customers held more than
/// 1.6 times their estimate). Every join whose build side alone passes that is changed, then
/// one at a time the join whose change lowers the estimate most (when none lowers it,
/// as with two equal joins on paths of their own, the biggest), until the rest fits:
/// the joins that fit stay hash joins, the faster join. Joins that a sort-merge join
/// cannot replace are kept (a null-aware anti join, a join with a row limit), and so
/// are build sides under [`SMALL_BUILD`].
pub(crate) fn joins_to_spill(plan: &dyn ExecutionPlan, room: u64) -> Result<(Vec<*const ()>, usize)> {
    let mut candidates = Vec::new();
    hash_joins(plan, &mut candidates);
    let joins = candidates.len();
    let mut now = build_sides_but(plan, &[])?.bytes;
    if now <= room {
        return Ok((Vec::new(), joins));
    }
    let target = room / 4;
    let stats = StatisticsContext::new();
    let mut sized = Vec::new();
    for join in candidates {
        let own = rows(join.left().as_ref(), &stats)?.map_or(0, |r| table_bytes(r, &join.left().schema()));
        if !join.null_aware && join.fetch().is_none() && own >= SMALL_BUILD {
            sized.push((address(join), own));
        }
    }
    let (mut spilling, mut sized): (Vec<_>, Vec<_>) = sized.into_iter().partition(|&(_, own)| own > target);
    let mut spilling: Vec<*const ()> = spilling.drain(..).map(|(a, _)| a).collect();
    now = build_sides_but(plan, &spilling)?.bytes;
    while now > target && !sized.is_empty() {
        let mut best: Option<(u64, u64, usize)> = None;
        for (i, &(join, own)) in sized.iter().enumerate() {
            let mut with = spilling.clone();
            with.push(join);
            let bytes = build_sides_but(plan, &with)?.bytes;
            if best.is_none_or(|b| (bytes, u64::MAX - own) < (b.0, u64::MAX - b.1)) {
                best = Some((bytes, own, i));
            }
        }
        let Some((bytes, _, i)) = best else { break };
        let i = if bytes < now { i } else { (0..sized.len()).max_by_key(|&i| sized[i].1).unwrap_or(i) };
        spilling.push(sized.swap_remove(i).0);
        now = build_sides_but(plan, &spilling)?.bytes;
    }
    Ok((spilling, joins))
}

fn hash_joins<'a>(plan: &'a dyn ExecutionPlan, out: &mut Vec<&'a HashJoinExec>) {
    if let Some(join) = plan.downcast_ref::<HashJoinExec>() {
        out.push(join);
    }
    for child in plan.children() {
        hash_joins(child.as_ref(), out);
    }
}

fn held(
    plan: &dyn ExecutionPlan,
    stats: &StatisticsContext,
    spilling: &[*const ()],
    out: &mut BuildSides,
) -> Result<u64> {
    let join = plan.downcast_ref::<HashJoinExec>().filter(|_| !spilling.contains(&address(plan)));
    if let Some(join) = join {
        out.joins += 1;
        let building = held(join.left().as_ref(), stats, spilling, out)?;
        let probing = held(join.right().as_ref(), stats, spilling, out)?;
        let (built, copy) = match rows(join.left().as_ref(), stats)? {
            Some(rows) => {
                let schema = join.left().schema();
                (table_bytes(rows, &schema), rows.saturating_mul(row_width(&schema)))
            }
            None => {
                out.unknown += 1;
                (0, 0)
            }
        };
        // Once collected, its batches are copied into one before they are dropped, and
        // before the probe side starts.
        return Ok(building.max(built.saturating_add(copy)).max(built.saturating_add(probing)));
    }
    let mut sum = 0u64;
    for child in plan.children() {
        sum = sum.saturating_add(held(child.as_ref(), stats, spilling, out)?);
    }
    Ok(sum)
}

/// A build side's bytes in a hash join: its batches (its rows times the schema's
/// width) and the table over its rows.
fn table_bytes(rows: u64, schema: &Schema) -> u64 {
    rows.saturating_mul(row_width(schema).saturating_add(TABLE_BYTES_PER_ROW))
}

/// How many rows `plan` yields, as the module says; `None` where a source gives no row
/// count.
fn rows(plan: &dyn ExecutionPlan, stats: &StatisticsContext) -> Result<Option<u64>> {
    Ok(count(plan, stats)?.map(|c| c.rows))
}

/// A plan's rows, and its rows before any filter (its sources', through the joins'
/// larger sides): their ratio is how much of its base a side keeps.
#[derive(Clone, Copy, Debug)]
struct Count {
    rows: u64,
    base: u64,
}

impl Count {
    fn kept(self) -> f64 {
        if self.base == 0 {
            1.0
        } else {
            (self.rows as f64 / self.base as f64).min(1.0)
        }
    }
}

fn count(plan: &dyn ExecutionPlan, stats: &StatisticsContext) -> Result<Option<Count>> {
    let children = plan.children();
    let mut input = Vec::with_capacity(children.len());
    for child in &children {
        input.push(count(child.as_ref(), stats)?);
    }
    let own = || -> Result<Option<Count>> {
        let s = stats.compute(plan, &StatisticsArgs::new())?;
        Ok(s.num_rows.get_value().map(|&n| Count { rows: n as u64, base: n as u64 }))
    };
    Ok(match input.as_slice() {
        [] => own()?,
        // An input without a count (a source wrapped in an operator that gives one):
        // the operator's own estimate.
        [None] => own()?,
        [Some(c)] => Some(match plan.downcast_ref::<FilterExec>() {
            // DataFusion's selectivity: its estimate of the filter against its input's.
            Some(filter) => {
                let before = stats.compute(filter.input().as_ref(), &StatisticsArgs::new())?;
                let after = stats.compute(plan, &StatisticsArgs::new())?;
                match (before.num_rows.get_value(), after.num_rows.get_value()) {
                    (Some(&b), Some(&a)) if b > 0 => {
                        Count { rows: (c.rows as f64 * (a as f64 / b as f64).min(1.0)) as u64, ..*c }
                    }
                    _ => *c,
                }
            }
            // A limit keeps at most its own estimate; others at most their input.
            None => match own()? {
                Some(o) if plan.fetch().is_some() => Count { rows: c.rows.min(o.rows), ..*c },
                _ => *c,
            },
        }),
        [Some(l), Some(r)] => Some(join_count(plan, *l, *r)),
        many => {
            let known: Option<Vec<Count>> = many.iter().copied().collect();
            known
                .map(|k| Count { rows: k.iter().map(|c| c.rows).sum(), base: k.iter().map(|c| c.base).sum() })
        }
    })
}

/// A join of `l` and `r`: a key joined to a foreign key (TPC-H's every join) yields
/// the foreign-key side's rows, fewer by the part of its base the key side kept (a
/// filtered dimension keeps that part of the facts); the key side is the one of the
/// smaller base. Semi and anti joins keep at most their side; outer joins keep their
/// outer side whole; a cross join yields the product, a union the sum.
fn join_count(plan: &dyn ExecutionPlan, l: Count, r: Count) -> Count {
    let join_type = plan
        .downcast_ref::<HashJoinExec>()
        .map(|j| *j.join_type())
        .or_else(|| plan.downcast_ref::<SortMergeJoinExec>().map(|j| j.join_type()));
    let (facts, key) = if l.base >= r.base { (l, r) } else { (r, l) };
    let fk = Count { rows: (facts.rows as f64 * key.kept()) as u64, base: facts.base };
    match join_type {
        Some(JoinType::LeftSemi | JoinType::LeftAnti | JoinType::LeftMark) => l,
        Some(JoinType::RightSemi | JoinType::RightAnti | JoinType::RightMark) => r,
        Some(JoinType::Inner) => fk,
        Some(JoinType::Left) => Count { rows: fk.rows.max(l.rows), ..fk },
        Some(JoinType::Right) => Count { rows: fk.rows.max(r.rows), ..fk },
        Some(JoinType::Full) => Count { rows: fk.rows.max(l.rows).max(r.rows), ..fk },
        None if plan.name().contains("Cross") || plan.name().contains("NestedLoop") => {
            Count { rows: l.rows.saturating_mul(r.rows), base: l.base.saturating_mul(r.base) }
        }
        None if plan.name().contains("Union") || plan.name().contains("Interleave") => {
            Count { rows: l.rows.saturating_add(r.rows), base: l.base.saturating_add(r.base) }
        }
        None => fk,
    }
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
        assert_eq!(table_bytes(1000, &schema()), 1000 * (44 + TABLE_BYTES_PER_ROW));
    }
}
