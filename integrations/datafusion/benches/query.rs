//! The example's query at limits L of 64, 128 and 256 MiB: DataFusion's
//! `FairSpillPool(L)` alone (plain jemalloc, no memquota) against `MemquotaPool` with
//! `QuotaAlloc` at L. Each configuration runs in a process of its own (the allocator
//! and the budget are process-wide), one after the other. `cargo bench --bench query`
//! (add `-- --rounds N` to repeat each; the table shows the median wall time and the
//! largest peak).
//!
//! Targets (issue 12): under `MemquotaPool`, peak RSS at most 1.15 L + the idle
//! runtime's RSS; wall time within 1.3x `FairSpillPool`'s at the same L. The idle
//! runtime is measured twice: cold (runtime and session built, before the query) and
//! warm (after the query, its memory freed and purged: DataFusion's code is paged in
//! by then, 20-25 MiB of it). The target is checked against the warm figure.

#[path = "../examples/query/workload.rs"]
mod workload;

#[path = "shared/either.rs"]
mod either;

#[path = "shared/idle.rs"]
mod idle;

use memquota_datafusion::datafusion::execution::memory_pool::{FairSpillPool, MemoryPool};
use memquota_datafusion::{run_query, MemquotaPool};
use std::process::Command;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

#[global_allocator]
static GLOBAL: either::Either = either::Either;

const MIB: u64 = 1 << 20;
const LIMITS: [u64; 3] = [64, 128, 256];

/// One configuration's run, in this (child) process; figures on stdout.
fn child(pool: &str, limit_mib: u64) -> memquota_datafusion::datafusion::error::Result<()> {
    let limit = limit_mib * MIB;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let fair = pool == "fair";
    let (pool, memquota): (Arc<dyn MemoryPool>, Option<Arc<MemquotaPool>>) = match pool {
        "fair" => (Arc::new(FairSpillPool::new(limit as usize)), None),
        _ => {
            memquota::init(memquota::Config::new().limit(limit)).expect("a valid limit");
            let p = Arc::new(MemquotaPool::new());
            (p.clone(), Some(p))
        }
    };
    let ctx = workload::session(pool, !fair)?;
    let idle = memquota::stats().process_rss;
    let query = workload::run(&ctx, workload::ROWS);
    let out = match memquota {
        Some(_) => runtime.block_on(run_query("bench", query))?,
        None => runtime.block_on(query)?,
    };
    let s = memquota::stats();
    assert_eq!(out.rows, workload::expected(workload::ROWS), "a wrong answer");
    // The idle runtime once warm: DataFusion's code paged in by the run, its memory
    // freed and purged.
    drop(ctx);
    println!("warm {}", idle::idle_rss());
    println!("idle {idle}");
    println!("rss {}", s.process_rss_peak);
    println!("wall {}", out.elapsed.as_secs_f64());
    println!("spills {}", out.spills);
    println!("tracked {}", memquota.as_ref().map_or(0, |_| s.native_peak));
    println!("refusals {}", memquota.as_ref().map_or(0, |p| p.refusals()));
    println!("spilled {}", out.spilled_bytes);
    Ok(())
}

#[derive(Default, Clone, Copy)]
struct Figures {
    idle: f64,
    warm: f64,
    rss: f64,
    wall: f64,
    spills: f64,
    tracked: f64,
    refusals: f64,
}

fn run(pool: &str, limit_mib: u64) -> Figures {
    let out = Command::new(std::env::current_exe().expect("this binary"))
        .args(["--child", pool, &limit_mib.to_string()])
        .output()
        .expect("the child runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{pool} at {limit_mib} MiB: {}\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let get = |key: &str| -> f64 {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("no {key} in:\n{stdout}"))
    };
    Figures {
        idle: get("idle "),
        warm: get("warm "),
        rss: get("rss "),
        wall: get("wall "),
        spills: get("spills "),
        tracked: get("tracked "),
        refusals: get("refusals "),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        let pool = args[i + 1].clone();
        either::PLAIN.store(pool == "fair", Relaxed);
        let limit: u64 = args[i + 2].parse().expect("a limit in MiB");
        if let Err(e) = child(&pool, limit) {
            eprintln!("{pool} at {limit} MiB failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    let rounds: usize =
        args.iter().position(|a| a == "--rounds").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(1);
    println!(
        "{} rows, {} partitions, GROUP BY v % {}; {rounds} round(s) per configuration, each in its own process",
        workload::ROWS,
        workload::PARTITIONS,
        workload::GROUPS
    );
    println!(
        "{:>5} | {:>8} {:>5} {:>6} {:>6} | {:>8} {:>5} {:>8} {:>8} {:>11} {:>11} {:>6} {:>6} {:>7} {:>9} | {:>6}",
        "L", "fair RSS", "/L", "wall s", "spills", "mq RSS", "/L", "idle", "warm", "(RSS-idle)", "(RSS-warm)", "wall s",
        "spills", "refused", "tracked", "wall x"
    );
    let mut missed = Vec::new();
    for limit in LIMITS {
        let mut fair = Vec::new();
        let mut mq = Vec::new();
        for _ in 0..rounds {
            fair.push(run("fair", limit));
            mq.push(run("memquota", limit));
        }
        let max = |v: &[Figures], f: &dyn Fn(&Figures) -> f64| v.iter().map(f).fold(0.0, f64::max);
        let l = (limit * MIB) as f64;
        let mib = |b: f64| format!("{:.1}Mi", b / MIB as f64);
        let (fw, mw) =
            (median(fair.iter().map(|f| f.wall).collect()), median(mq.iter().map(|f| f.wall).collect()));
        let mq_rss = max(&mq, &|f| f.rss);
        // Each run against its own idle figures, the worst run shown.
        let over_idle = max(&mq, &|f| (f.rss - f.idle) / l);
        let over_warm = max(&mq, &|f| (f.rss - f.warm) / l);
        println!(
            "{:>3}Mi | {:>8} {:>5.2} {:>6.2} {:>6} | {:>8} {:>5.2} {:>8} {:>8} {:>9.2} L {:>9.2} L {:>6.2} {:>6} {:>7} {:>7.2} L | {:>6.2}",
            limit,
            mib(max(&fair, &|f| f.rss)),
            max(&fair, &|f| f.rss) / l,
            fw,
            max(&fair, &|f| f.spills),
            mib(mq_rss),
            mq_rss / l,
            mib(max(&mq, &|f| f.idle)),
            mib(max(&mq, &|f| f.warm)),
            over_idle,
            over_warm,
            mw,
            max(&mq, &|f| f.spills),
            max(&mq, &|f| f.refusals),
            max(&mq, &|f| f.tracked) / l,
            mw / fw,
        );
        if over_warm > 1.15 {
            missed.push(format!("{limit} MiB: peak RSS {} > 1.15 L + the warm idle runtime", mib(mq_rss)));
        }
        if mw > 1.3 * fw {
            missed.push(format!("{limit} MiB: wall {mw:.2} s > 1.3 x {fw:.2} s"));
        }
    }
    if missed.is_empty() {
        println!(
            "targets met: peak RSS <= 1.15 L + the warm idle runtime's RSS, wall <= 1.3 x FairSpillPool"
        );
    } else {
        for m in &missed {
            println!("target missed: {m}");
        }
    }
}
