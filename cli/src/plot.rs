//! `--plot`: the timeline of a run as an SVG, drawn with plotters.

use crate::units::mib;
use plotters::prelude::*;
use std::path::Path;

/// One sample of the timeline.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Point {
    /// Seconds since the program started.
    pub t: f64,
    pub native: u64,
    pub heap_committed: u64,
    pub limit: u64,
    pub headroom: u64,
    /// Reclaims run so far (both kinds).
    pub reclaims: u64,
    /// Allocations refused so far.
    pub ooms: u64,
}

/// The samples at which a counter went up (the process starts at zero), with how
/// many events each one holds.
pub fn increases(points: &[Point], counter: impl Fn(&Point) -> u64) -> Vec<(Point, u64)> {
    let mut before = 0;
    let mut out = Vec::new();
    for p in points {
        let now = counter(p);
        if now > before {
            out.push((*p, now - before));
        }
        before = before.max(now);
    }
    out
}

const NATIVE: RGBColor = RGBColor(31, 119, 180);
const HEAP: RGBColor = RGBColor(255, 127, 14);
const LIMIT: RGBColor = RGBColor(214, 39, 40);
const HEADROOM: RGBColor = RGBColor(44, 160, 44);
const RECLAIM: RGBColor = RGBColor(148, 103, 189);

/// Writes the timeline of `points` to `path`: native, heap committed, limit and
/// headroom in MiB over seconds, with reclaims (triangles) and refusals (crosses)
/// marked on the native line where their counters went up.
pub fn write_svg(path: &Path, title: &str, points: &[Point]) -> Result<(), String> {
    draw(path, title, points).map_err(|e| format!("cannot write the plot {}: {e}", path.display()))
}

fn draw(path: &Path, title: &str, points: &[Point]) -> Result<(), Box<dyn std::error::Error>> {
    let t_max = points.iter().map(|p| p.t).fold(0.0, f64::max).max(0.1);
    let y_max = points
        .iter()
        .map(|p| mib(p.limit.max(p.native.saturating_add(p.heap_committed)).max(p.headroom)))
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.08;
    let has_limit = points.iter().any(|p| p.limit > 0);

    let root = SVGBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(0.0..t_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("MiB")
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .x_label_formatter(&|t| format!("{t:.1}"))
        .y_label_formatter(&|m| format!("{m:.0}"))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;

    let line = |color: RGBColor| ShapeStyle::from(color).stroke_width(2);
    let legend_line =
        |color: RGBColor| move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 20, y)], line(color));
    let series = |f: fn(&Point) -> u64| points.iter().map(move |p| (p.t, mib(f(p))));

    chart
        .draw_series(LineSeries::new(series(|p| p.native), line(NATIVE)))?
        .label("native")
        .legend(legend_line(NATIVE));
    chart
        .draw_series(LineSeries::new(series(|p| p.heap_committed), line(HEAP)))?
        .label("heap committed")
        .legend(legend_line(HEAP));
    if has_limit {
        chart
            .draw_series(DashedLineSeries::new(series(|p| p.limit), 8, 5, line(LIMIT)))?
            .label("limit")
            .legend(legend_line(LIMIT));
        chart
            .draw_series(LineSeries::new(series(|p| p.headroom), ShapeStyle::from(HEADROOM).stroke_width(1)))?
            .label("headroom")
            .legend(legend_line(HEADROOM));
    }

    let reclaims = increases(points, |p| p.reclaims);
    if !reclaims.is_empty() {
        let n: u64 = reclaims.iter().map(|(_, n)| n).sum();
        chart
            .draw_series(
                reclaims.iter().map(|(p, _)| TriangleMarker::new((p.t, mib(p.native)), 6, RECLAIM.filled())),
            )?
            .label(format!("reclaims ({n})"))
            .legend(|(x, y)| TriangleMarker::new((x + 10, y), 6, RECLAIM.filled()));
    }
    let refusals = increases(points, |p| p.ooms);
    if !refusals.is_empty() {
        let n: u64 = refusals.iter().map(|(_, n)| n).sum();
        chart
            .draw_series(
                refusals.iter().map(|(p, _)| {
                    Cross::new((p.t, mib(p.native)), 7, ShapeStyle::from(BLACK).stroke_width(2))
                }),
            )?
            .label(format!("refusals ({n})"))
            .legend(|(x, y)| Cross::new((x + 10, y), 7, ShapeStyle::from(BLACK).stroke_width(2)));
    }

    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn increases_count_from_zero() {
        let p = |t, ooms| Point { t, ooms, ..Point::default() };
        let points = [p(0.1, 0), p(0.2, 2), p(0.3, 2), p(0.4, 3)];
        let ups: Vec<(f64, u64)> = increases(&points, |p| p.ooms).iter().map(|(p, n)| (p.t, *n)).collect();
        assert_eq!(ups, [(0.2, 2), (0.4, 1)]);
        let first = [p(0.5, 1)];
        assert_eq!(increases(&first, |p| p.ooms).len(), 1);
    }
}
