//! A DataFusion query under a memquota budget: `cargo run --release --example query --
//! --limit 128m`. Generates 20 M rows over 2 partitions, groups them by `v % 1000003`
//! (count, sum, string max), prints the top 5 by sum, then the peak RSS, the tracked
//! peak, the spills and the time.

mod workload;

#[path = "../../benches/shared/idle.rs"]
mod idle;

use memquota_datafusion::datafusion::error::Result;
use memquota_datafusion::{MemquotaPool, QueryScope};
use std::process::ExitCode;
use std::sync::Arc;

#[global_allocator]
static GLOBAL: memquota::QuotaAlloc = memquota::QuotaAlloc::new();

const USAGE: &str = "usage: query --limit SIZE [--rows N]
  --limit SIZE  the process budget: 64m, 128m, 1g, 75% (of the machine)
  --rows N      rows to generate (default 20000000)";

struct Args {
    limit: memquota::Config,
    rows: u64,
}

fn parse(mut args: impl Iterator<Item = String>) -> std::result::Result<Args, String> {
    let (mut limit, mut rows) = (None, workload::ROWS);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value\n{USAGE}"));
        match arg.as_str() {
            "--limit" => {
                let given = value()?;
                // memquota's own parser: the forms MEMQUOTA_LIMIT accepts.
                let config =
                    memquota::Config::from_lookup(|var| (var == "MEMQUOTA_LIMIT").then(|| given.clone()))
                        .map_err(|e| match e {
                            memquota::Error::BadEnv { value, accepted, .. } => {
                                format!("bad --limit {value:?}: expected {accepted}")
                            }
                            other => other.to_string(),
                        })?;
                limit = Some(config);
            }
            "--rows" => {
                let given = value()?;
                rows = given
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or(format!("bad --rows {given:?}: expected a positive number of rows"))?;
            }
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let limit = limit.ok_or(format!("--limit is required\n{USAGE}"))?;
    Ok(Args { limit, rows })
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("query: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = memquota::init(args.limit) {
        eprintln!("query: {e}");
        return ExitCode::from(2);
    }
    match run(args.rows) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("query: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(rows: u64) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let pool = Arc::new(MemquotaPool::new());
    let ctx = workload::session(pool.clone(), true)?;
    let idle_rss = memquota::stats().process_rss;
    let limit = memquota::stats().limit;
    println!(
        "{rows} rows, {} partitions: GROUP BY v % {} (count, sum, max of a string), top 5 by sum; limit {}",
        workload::PARTITIONS,
        workload::GROUPS,
        mib(limit)
    );
    let scope = QueryScope::begin("group-by")?;
    let outcome = runtime.block_on(scope.run(workload::run(&ctx, rows)));
    let scope_peak = scope.stats().map_or(0, |s| s.peak);
    drop(scope.end());
    let outcome = outcome?;
    let s = memquota::stats();
    drop(ctx);
    let warm = idle::idle_rss();
    println!("{:>8} {:>4} {:>16} top", "k", "n", "total");
    for r in &outcome.rows {
        println!("{:>8} {:>4} {:>16} {}", r.k, r.n, r.total, r.top);
    }
    println!("time          {:.2} s", outcome.elapsed.as_secs_f64());
    println!(
        "peak RSS      {} = {:.2} x the limit; the idle runtime holds {} before the query, {} after it \
         (code paged in), so {:.2} x the limit above that",
        mib(s.process_rss_peak),
        s.process_rss_peak as f64 / limit as f64,
        mib(idle_rss),
        mib(warm),
        s.process_rss_peak.saturating_sub(warm) as f64 / limit as f64,
    );
    println!(
        "tracked peak  {} in the process (bound {}), {} in the query's scope",
        mib(s.native_peak),
        mib(s.error_bound),
        mib(scope_peak)
    );
    println!(
        "spills        {} files, {} written; the pool refused {} requests",
        outcome.spills,
        mib(outcome.spilled_bytes as u64),
        pool.refusals(),
    );
    Ok(())
}
