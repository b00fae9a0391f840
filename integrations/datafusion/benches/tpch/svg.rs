//! A line plot of queries completed against the limit, one line per pool, as plain SVG
//! text (a few lines of markup do not earn a plotting crate).

use std::fmt::Write;

const COLOURS: [&str; 6] = ["#d62728", "#ff7f0e", "#9467bd", "#1f77b4", "#2ca02c", "#8c564b"];
const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 60.0;
/// Room for the legend.
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

/// `series`: (pool, [(x, queries completed)]), y from 0 to `of`.
pub fn plot(title: &str, x_label: &str, of: usize, series: &[(String, Vec<(f64, usize)>)]) -> String {
    let xs: Vec<f64> = series.iter().flat_map(|(_, p)| p.iter().map(|&(x, _)| x)).collect();
    let (x0, x1) = xs.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let (x0, x1) = if x1 > x0 { (x0, x1) } else { (x0 - 1.0, x0 + 1.0) };
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let px = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
    let py = |y: usize| TOP + ph - y as f64 / of.max(1) as f64 * ph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{title}</text>"#,
        LEFT + pw / 2.0
    );
    // Axes, the y grid every few queries, a tick at each limit.
    let _ =
        writeln!(s, r#"<path d="M{LEFT},{TOP} V{} H{}" fill="none" stroke="black"/>"#, TOP + ph, LEFT + pw);
    let step = if of > 10 { 2 } else { 1 };
    for y in (0..=of).step_by(step) {
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" x2="{}" y1="{y0}" y2="{y0}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{y}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            py(y) + 4.0,
            y0 = py(y)
        );
    }
    let mut ticks = xs.clone();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    for x in ticks {
        let _ = writeln!(s, r#"<text x="{}" y="{}" text-anchor="middle">{x}</text>"#, px(x), TOP + ph + 18.0);
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text>"#,
        LEFT + pw / 2.0,
        H - 10.0
    );
    for (i, (name, points)) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        // Lines of equal counts would hide each other: each is nudged a little.
        let nudge = (i as f64 - series.len() as f64 / 2.0) * 1.5;
        let path: Vec<String> =
            points.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y) + nudge)).collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for &(x, y) in points {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{colour}"/>"#,
                px(x),
                py(y) + nudge
            );
        }
        let ly = TOP + 10.0 + i as f64 * 20.0;
        let _ = writeln!(
            s,
            r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{colour}" stroke-width="2"/><text x="{}" y="{}">{name}</text>"#,
            W - RIGHT + 20.0,
            W - RIGHT + 45.0,
            W - RIGHT + 52.0,
            ly + 4.0
        );
    }
    s.push_str("</svg>\n");
    s
}
