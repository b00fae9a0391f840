//! The 22 TPC-H queries under a memory limit, pool against pool: `cargo bench --bench
//! tpch -- --limits 128m,256m` (in `integrations/datafusion`; `-- --help` for the
//! options). Tables are generated while they are scanned (`data.rs`: nothing is held
//! but the query's own state), each query and configuration runs in a process of its
//! own (this binary runs itself with `--child`), and each result is checked against
//! the unbounded run's (a hash of its sorted rows).
//!
//! Configurations: DataFusion's `GreedyMemoryPool` and `FairSpillPool` on plain
//! jemalloc (the second with DataFusion's default join choice and with
//! `prefer_hash_join = false`, as their users can set), and `MemquotaPool` on
//! `QuotaAlloc`, its queries run with `run_query` (`memquota`) or with
//! `collect_query`, which plans again when a join cannot fit (`memquota-replan`).
//!
//! Per query and configuration: completed or why not, peak RSS / L, its part over the
//! idle runtime's RSS, cold (the session built, before the query) and warm (after the
//! query, its memory freed and purged: DataFusion's code is paged in by then), the
//! peaks of the anonymous and of the file-backed resident bytes, wall time, spills,
//! and the replans and retries `collect_query` made; under `MemquotaPool` also the
//! peak of the tracked native bytes and of what DataFusion allocated past its
//! reservations (read every millisecond). The `MEMQUOTA_*` variables apply to the
//! `MemquotaPool` runs (`MEMQUOTA_PROFILE_SAMPLE`, `MEMQUOTA_METRICS_ADDR` for a heap
//! profile while a query runs). Printed as markdown
//! tables; `--svg FILE` also plots queries completed against the limit per pool.
//!
//! `--streams N`: N streams of the queries at once in one process at each limit (a
//! server: one runtime, one pool, each stream the queries in its own rotated order),
//! against each query alone at L / N: which completed in the streams, which failed
//! there though they complete alone at L / N, and the process's peak RSS.

#[path = "../shared/counted.rs"]
mod counted;
#[path = "data.rs"]
mod data;
#[path = "../shared/either.rs"]
mod either;
#[path = "../shared/idle.rs"]
mod idle;
#[path = "queries.rs"]
mod queries;
#[path = "svg.rs"]
mod svg;

use memquota_datafusion::datafusion;
use memquota_datafusion::{collect_query, run_query, MemquotaPool};

use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::display::array_value_to_string;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::{FairSpillPool, GreedyMemoryPool, MemoryPool, UnboundedMemoryPool};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::physical_plan::{collect, ExecutionPlan};
use datafusion::prelude::{SessionConfig, SessionContext};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: either::Either = either::Either;

const MIB: u64 = 1 << 20;

/// The configurations, in the order of the tables' columns.
const POOLS: [&str; 5] = ["greedy", "fair", "fair-smj", "memquota", "memquota-replan"];

const USAGE: &str = "usage: cargo bench --bench tpch -- [options]
  --limits L,L..     limits, such as 128m,256m,1g (default 128m,256m)
  --fractions F,F..  limits as fractions of each query's unbounded peak RSS, such as 0.33,0.5
                     (instead of --limits)
  --pools P,P..      of greedy, fair, fair-smj, memquota, memquota-replan (default: all)
  --queries Q,Q..    query numbers or ranges, such as 1-22 or 9,18,21 (default 1-22)
  --sf X             TPC-H scale factor (default 1)
  --partitions N     target partitions and table partitions (default 2)
  --margin F         MemquotaPool's margin, a fraction of the limit (default: the pool's, 0.2)
  --timeout S        seconds before a case is killed and counted as failed (default 900)
  --room-wait S      MemquotaPool's wait for room, in seconds (default: the pool's, 2; 0: none)
  --streams N        also N streams of the queries at once in one process at each limit,
                     against each query alone at limit / N (default 1: off)
  --no-stats         tables without row counts (the planner then joins in the query's order,
                     and collect_query has no estimate to plan by before a run)
  --svg FILE         also plot queries completed against the limit, per pool";

// ---- the child: one query under one configuration, figures on stdout --------------

struct Case {
    pool: String,
    /// MemquotaPool's margin; `None`: its default.
    margin: Option<f64>,
    /// 0: no limit.
    limit: u64,
    /// One query, or with `streams` > 1 each stream's list (rotated per stream).
    queries: Vec<usize>,
    scale: f64,
    partitions: usize,
    streams: usize,
    /// MemquotaPool's wait for room; `None`: its default.
    room_wait: Option<f64>,
    /// The tables give their row counts.
    stats: bool,
}

/// A figure of /proc/self/status, in bytes.
fn proc_status(key: &str) -> u64 {
    figure(&std::fs::read_to_string("/proc/self/status").unwrap_or_default(), key)
}

/// The figure `key` of a /proc status text, in bytes (0 if absent).
fn figure(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

fn child(c: &Case) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut config = SessionConfig::from_env()?.with_target_partitions(c.partitions);
    let limit = c.limit as usize;
    let mut memquota_pool = None;
    let pool: Arc<dyn MemoryPool> = match c.pool.as_str() {
        "unbounded" => Arc::new(UnboundedMemoryPool::default()),
        "greedy" => Arc::new(GreedyMemoryPool::new(limit)),
        "fair" => Arc::new(FairSpillPool::new(limit)),
        "fair-smj" => {
            config.options_mut().optimizer.prefer_hash_join = false;
            Arc::new(FairSpillPool::new(limit))
        }
        "memquota" | "memquota-replan" => {
            memquota::init(memquota::Config::from_env().expect("valid MEMQUOTA_* variables").limit(c.limit))
                .expect("a valid limit");
            let mut p = c.margin.map_or_else(MemquotaPool::new, MemquotaPool::with_margin);
            if let Some(w) = c.room_wait {
                p = p.with_room_wait(Duration::from_secs_f64(w));
            }
            let p = Arc::new(p);
            memquota_pool = Some(Arc::clone(&p));
            p
        }
        other => panic!("no pool {other}"),
    };
    let mut rt = RuntimeEnvBuilder::new().with_memory_pool(pool);
    if memquota_pool.is_some() {
        rt = rt.with_disk_manager_builder(memquota_datafusion::disk_manager_builder()?);
    }
    let ctx = SessionContext::new_with_config_rt(config, rt.build_arc()?);
    data::register(&ctx, c.scale, c.partitions, c.stats)?;
    println!("idle {}", proc_status("VmRSS:"));
    let (idle_anon, idle_file) = resident_split();
    println!("idle-anon {idle_anon}");
    println!("idle-file {idle_file}");
    if c.streams > 1 {
        return streams(c, &runtime, &ctx, memquota_pool.as_deref());
    }
    let q = c.queries[0];
    let watch = Watch::start(memquota_pool.clone());
    let started = Instant::now();
    let out = runtime.block_on(run_one(&ctx, &c.pool, &queries::query(q, c.scale), &format!("TPC-H q{q}")));
    let wall = started.elapsed();
    match out {
        Ok((batches, plan)) => {
            let (rows, hash) = digest(&batches)?;
            println!("status ok");
            println!("rows {rows}");
            println!("hash {hash:016x}");
            println!("spills {}", spills(plan.as_ref()));
        }
        Err(e) => {
            println!("status failed");
            let root = e.find_root();
            println!("why {}", short_reason(&root.to_string()));
            for line in root.to_string().lines().take(12) {
                println!("error {line}");
            }
        }
    }
    println!("wall {}", wall.as_secs_f64());
    println!("rss {}", proc_status("VmHWM:"));
    let peaks = watch.stop();
    // The idle runtime once warm: the session as before the query, DataFusion's code
    // paged in by the run, the query's memory freed and purged (as `benches/query.rs`).
    println!("warm {}", idle::idle_rss());
    println!("anon {}", peaks.anon);
    println!("file {}", peaks.file);
    if memquota_pool.is_some() {
        println!("unreserved {}", peaks.unreserved);
        println!("tracked {}", peaks.tracked);
    }
    if let Some(p) = memquota_pool {
        println!("retries {}", p.retries());
        println!("replans {}", p.stats().replans);
        println!("replanned-joins {}", p.stats().replanned_joins);
        println!("refusals {}", p.refusals());
    }
    Ok(())
}

/// Read every millisecond while a query runs: the peaks of the process's anonymous
/// and file-backed resident bytes (`/proc/self/status`: VmHWM says only their sum, and
/// the file-backed part is the binary's code, paged in as the query first runs it);
/// under `MemquotaPool` also the highest of what the process held past the pool's
/// reservations (tracked native bytes less the bytes reserved) over what it held so
/// before the query, which is what DataFusion allocated without reserving it at its
/// peak, and the highest tracked native bytes.
struct Watch {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Peaks>,
}

/// What a [`Watch`] saw, in bytes.
#[derive(Default)]
struct Peaks {
    anon: u64,
    file: u64,
    unreserved: u64,
    tracked: u64,
}

/// The process's anonymous and file-backed resident bytes (shared memory counts as
/// file-backed).
fn resident_split() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    (figure(&status, "RssAnon:"), figure(&status, "RssFile:") + figure(&status, "RssShmem:"))
}

impl Watch {
    fn start(pool: Option<Arc<MemquotaPool>>) -> Watch {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let unreserved =
            move || pool.as_ref().map(|p| memquota::process_account().native as i64 - p.reserved() as i64);
        let idle = unreserved();
        let thread = std::thread::spawn(move || {
            let mut peaks = Peaks::default();
            let mut peak_unreserved = idle;
            while !s.load(Relaxed) {
                let (anon, file) = resident_split();
                peaks.anon = peaks.anon.max(anon);
                peaks.file = peaks.file.max(file);
                peak_unreserved = peak_unreserved.max(unreserved());
                if idle.is_some() {
                    peaks.tracked = peaks.tracked.max(memquota::process_account().native);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            peaks.unreserved =
                peak_unreserved.zip(idle).map_or(0, |(p, i)| u64::try_from(p - i).unwrap_or(0));
            peaks
        });
        Watch { stop, thread }
    }

    fn stop(self) -> Peaks {
        self.stop.store(true, Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// One query under `pool`'s way of running it: plain, `run_query`, or `collect_query`.
async fn run_one(
    ctx: &SessionContext,
    pool: &str,
    sql: &str,
    name: &str,
) -> Result<(Vec<RecordBatch>, Arc<dyn ExecutionPlan>)> {
    let plain = async {
        let plan = ctx.sql(sql).await?.create_physical_plan().await?;
        let batches = collect(Arc::clone(&plan), ctx.task_ctx()).await?;
        Ok::<_, DataFusionError>((batches, plan))
    };
    match pool {
        "memquota" => run_query(name, plain).await,
        "memquota-replan" => {
            let done = collect_query(name, ctx.sql(sql).await?).await?;
            Ok((done.batches, done.plan))
        }
        _ => plain.await,
    }
}

/// `c.streams` streams of `c.queries` at once on one runtime, stream `s` starting at
/// the `s * n / streams`-th query; a line `result STREAM QUERY ...` per query run.
fn streams(
    c: &Case,
    runtime: &tokio::runtime::Runtime,
    ctx: &SessionContext,
    pool: Option<&MemquotaPool>,
) -> Result<()> {
    let started = Instant::now();
    let n = c.queries.len();
    let tasks: Vec<_> = (0..c.streams)
        .map(|s| {
            let (ctx, pool, scale) = (ctx.clone(), c.pool.clone(), c.scale);
            let order: Vec<usize> = (0..n).map(|i| c.queries[(i + s * n / c.streams) % n]).collect();
            runtime.spawn(async move {
                let mut lines = Vec::new();
                for q in order {
                    let t = Instant::now();
                    let out =
                        run_one(&ctx, &pool, &queries::query(q, scale), &format!("stream {s} q{q}")).await;
                    let wall = t.elapsed().as_secs_f64();
                    lines.push(match out.and_then(|(b, plan)| Ok((digest(&b)?, spills(plan.as_ref())))) {
                        Ok(((rows, hash), sp)) => format!("result {s} {q} ok {wall} {rows} {hash:016x} {sp}"),
                        Err(e) => format!(
                            "result {s} {q} failed {wall} {}",
                            short_reason(&e.find_root().to_string())
                        ),
                    });
                }
                lines
            })
        })
        .collect();
    for t in tasks {
        for line in runtime.block_on(t).map_err(|e| DataFusionError::External(Box::new(e)))? {
            println!("{line}");
        }
    }
    println!("wall {}", started.elapsed().as_secs_f64());
    println!("rss {}", proc_status("VmHWM:"));
    if let Some(p) = pool {
        let s = p.stats();
        println!("retries {}", s.retries);
        println!("replans {}", s.replans);
        println!("refusals {}", s.refusals);
        println!("waits {}", s.waits);
        println!("waits-with-room {}", s.waits_with_room);
        println!("heaviest-failed {}", s.heaviest_failed);
    }
    Ok(())
}

/// The consumer a refusal names ("... for HashJoinInput[0] with ..." in DataFusion's
/// pools, "... for HashJoinInput#12 with ..." in memquota's), else the message's start.
fn short_reason(message: &str) -> String {
    let first = message.lines().next().unwrap_or_default();
    if let Some(rest) = first.split(" for ").nth(1) {
        if let Some((consumer, _)) = rest.split_once(" with ") {
            let name = consumer.split(['[', '#']).next().unwrap_or(consumer);
            return name.to_owned();
        }
    }
    first.chars().take(60).collect()
}

/// Row count and a hash of the sorted rows, each row its cells as DataFusion prints
/// them.
fn digest(batches: &[RecordBatch]) -> Result<(usize, u64)> {
    let mut rows = Vec::new();
    for b in batches {
        for i in 0..b.num_rows() {
            let mut row = String::new();
            for col in b.columns() {
                row.push_str(&array_value_to_string(col, i)?);
                row.push('|');
            }
            rows.push(row);
        }
    }
    rows.sort();
    let mut h = DefaultHasher::new();
    rows.hash(&mut h);
    Ok((rows.len(), h.finish()))
}

/// Spill files written over the whole plan.
fn spills(plan: &dyn ExecutionPlan) -> usize {
    let own = plan.metrics().and_then(|m| m.spill_count()).unwrap_or(0);
    own + plan.children().into_iter().map(|c| spills(c.as_ref())).sum::<usize>()
}

// ---- the parent ---------------------------------------------------------------------

/// What a child reported.
#[derive(Clone, Debug, Default)]
struct Run {
    ok: bool,
    why: String,
    hash: String,
    rows: u64,
    rss: u64,
    idle: u64,
    /// The idle runtime's RSS once warm: after the query, its memory freed and purged.
    warm: u64,
    /// The peaks of the anonymous and of the file-backed resident bytes, and their
    /// values in the idle runtime.
    anon: u64,
    file: u64,
    idle_anon: u64,
    idle_file: u64,
    wall: f64,
    spills: u64,
    retries: u64,
    replans: u64,
    /// Joins the replans made sort-merge joins.
    replanned_joins: u64,
    /// `MemquotaPool` only: the peak of what was allocated past the reservations, and
    /// of the tracked native bytes.
    unreserved: u64,
    tracked: u64,
    /// With streams: each query run, and the pool's waits.
    results: Vec<StreamResult>,
    waits: u64,
    waits_with_room: u64,
    heaviest_failed: u64,
}

/// One query run of a stream.
#[derive(Clone, Debug, Default)]
struct StreamResult {
    stream: usize,
    query: usize,
    ok: bool,
    wall: f64,
    rows: u64,
    hash: String,
    why: String,
}

impl StreamResult {
    /// `STREAM QUERY ok WALL ROWS HASH SPILLS` or `STREAM QUERY failed WALL WHY`.
    fn parse(line: &str) -> Option<StreamResult> {
        let mut p = line.splitn(5, ' ');
        let (stream, query, status, wall) = (p.next()?, p.next()?, p.next()?, p.next()?);
        let rest = p.next().unwrap_or_default();
        let mut r = StreamResult {
            stream: stream.parse().ok()?,
            query: query.parse().ok()?,
            ok: status == "ok",
            wall: wall.parse().ok()?,
            ..StreamResult::default()
        };
        if r.ok {
            let mut f = rest.split(' ');
            r.rows = f.next()?.parse().ok()?;
            r.hash = f.next()?.to_owned();
        } else {
            r.why = rest.to_owned();
        }
        Some(r)
    }
}

struct Options {
    limits: Vec<u64>,
    fractions: Vec<f64>,
    pools: Vec<String>,
    queries: Vec<usize>,
    scale: f64,
    partitions: usize,
    timeout: Duration,
    svg: Option<String>,
    margin: Option<f64>,
    streams: usize,
    room_wait: Option<f64>,
    stats: bool,
}

fn size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim().to_ascii_lowercase();
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => s.split_at(i),
        None => (s.as_str(), "m"),
    };
    let n: f64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let unit = match unit.trim_end_matches("ib").trim_end_matches('b') {
        "k" => 1 << 10,
        "m" => MIB,
        "g" => 1 << 30,
        _ => return Err(format!("bad size {s:?}: expected a number with k, m or g")),
    };
    Ok((n * unit as f64) as u64)
}

fn query_list(s: &str) -> std::result::Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let bad = || format!("bad query list {s:?}");
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| bad())?),
        }
    }
    if out.iter().any(|&q| !(1..=22).contains(&q)) {
        return Err(format!("queries are 1 to 22: {s:?}"));
    }
    Ok(out)
}

fn options(args: &[String]) -> std::result::Result<Options, String> {
    let mut o = Options {
        limits: vec![128 * MIB, 256 * MIB],
        fractions: Vec::new(),
        pools: POOLS.iter().map(|p| p.to_string()).collect(),
        queries: (1..=22).collect(),
        scale: 1.0,
        partitions: 2,
        timeout: Duration::from_secs(900),
        svg: None,
        margin: None,
        streams: 1,
        room_wait: None,
        stats: true,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{arg} needs a value\n{USAGE}"));
        match arg.as_str() {
            "--limits" => o.limits = value()?.split(',').map(size).collect::<std::result::Result<_, _>>()?,
            "--fractions" => {
                let v = value()?;
                o.fractions = v
                    .split(',')
                    .map(|f| f.parse().ok().filter(|&f: &f64| f > 0.0).ok_or(format!("bad fraction {f:?}")))
                    .collect::<std::result::Result<_, _>>()?;
            }
            "--pools" => {
                o.pools = value()?.split(',').map(str::to_owned).collect();
                if let Some(p) = o.pools.iter().find(|p| !POOLS.contains(&p.as_str())) {
                    return Err(format!("no pool {p:?}\n{USAGE}"));
                }
            }
            "--queries" => o.queries = query_list(&value()?)?,
            "--sf" => o.scale = value()?.parse().ok().filter(|&s: &f64| s > 0.0).ok_or("bad --sf")?,
            "--partitions" => {
                o.partitions = value()?.parse::<usize>().ok().filter(|&n| n > 0).ok_or("bad --partitions")?
            }
            "--timeout" => o.timeout = Duration::from_secs(value()?.parse().map_err(|_| "bad --timeout")?),
            "--svg" => o.svg = Some(value()?),
            "--no-stats" => o.stats = false,
            "--room-wait" => {
                o.room_wait =
                    Some(value()?.parse::<f64>().ok().filter(|w| *w >= 0.0).ok_or("bad --room-wait")?)
            }
            "--streams" => {
                o.streams = value()?.parse::<usize>().ok().filter(|&n| n > 0).ok_or("bad --streams")?
            }
            "--margin" => {
                o.margin = Some(
                    value()?.parse::<f64>().ok().filter(|m| (0.0..0.9).contains(m)).ok_or("bad --margin")?,
                )
            }
            // cargo bench passes --bench to the binary.
            "--bench" => {}
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(o)
}

/// Runs one case in a child process: one query, or `streams` streams of `queries`.
fn run(o: &Options, pool: &str, limit: u64, queries: &[usize], streams: usize) -> Run {
    // Named by this process: two benchmark runs at once (from two worktrees) must not
    // read each other's children.
    let (dir, me) = (std::env::temp_dir(), std::process::id());
    let (out_path, err_path) = (
        dir.join(format!("memquota-tpch-child-{me}.out")),
        dir.join(format!("memquota-tpch-child-{me}.err")),
    );
    let spawned = Command::new(std::env::current_exe().expect("this binary"))
        .args([
            "--child",
            pool,
            &limit.to_string(),
            &queries.iter().map(|q| q.to_string()).collect::<Vec<_>>().join(","),
            &o.scale.to_string(),
            &o.partitions.to_string(),
            &o.margin.map_or("default".to_owned(), |m| m.to_string()),
            &streams.to_string(),
            &o.room_wait.map_or("default".to_owned(), |w| w.to_string()),
            if o.stats { "stats" } else { "no-stats" },
        ])
        .stdout(std::fs::File::create(&out_path).expect("a temporary file"))
        .stderr(std::fs::File::create(&err_path).expect("a temporary file"))
        .stdin(Stdio::null())
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => return Run { why: format!("spawn: {e}"), ..Run::default() },
    };
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if started.elapsed() > o.timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(_) => break None,
        }
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let get = |key: &str| field(&stdout, key);
    let num = |key: &str| get(key).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let mut r = Run {
        ok: get("status") == Some("ok"),
        why: get("why").unwrap_or_default().to_owned(),
        hash: get("hash").unwrap_or_default().to_owned(),
        rows: num("rows") as u64,
        rss: num("rss") as u64,
        idle: num("idle") as u64,
        warm: num("warm") as u64,
        anon: num("anon") as u64,
        file: num("file") as u64,
        idle_anon: num("idle-anon") as u64,
        idle_file: num("idle-file") as u64,
        wall: num("wall"),
        spills: num("spills") as u64,
        retries: num("retries") as u64,
        replans: num("replans") as u64,
        replanned_joins: num("replanned-joins") as u64,
        unreserved: num("unreserved") as u64,
        tracked: num("tracked") as u64,
        results: stdout.lines().filter_map(|l| StreamResult::parse(l.strip_prefix("result ")?)).collect(),
        waits: num("waits") as u64,
        waits_with_room: num("waits-with-room") as u64,
        heaviest_failed: num("heaviest-failed") as u64,
    };
    match status {
        None => {
            r.ok = false;
            r.why = format!("killed after {} s", o.timeout.as_secs());
            r.wall = started.elapsed().as_secs_f64();
        }
        Some(s) if !s.success() => {
            r.ok = false;
            let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
            r.why = format!("crashed ({s}): {}", last.chars().take(80).collect::<String>());
            r.wall = started.elapsed().as_secs_f64();
        }
        Some(_) => {}
    }
    let _ = (std::fs::remove_file(&out_path), std::fs::remove_file(&err_path));
    r
}

/// The value of the child's line `key value`.
fn field<'a>(stdout: &'a str, key: &str) -> Option<&'a str> {
    stdout.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
}

fn mib(bytes: u64) -> String {
    format!("{:.0}", bytes as f64 / MIB as f64)
}

/// At one limit, by pool then query: the limit (bytes) and the run.
type AtLimit = BTreeMap<String, BTreeMap<usize, (u64, Run)>>;

/// One limit: absolute, or a fraction of each query's unbounded peak.
#[derive(Clone, Copy)]
enum Limit {
    Bytes(u64),
    Fraction(f64),
}

impl Limit {
    fn of(self, unbounded_peak: u64) -> u64 {
        match self {
            Limit::Bytes(b) => b,
            // Whole MiB, so the figure is readable and repeatable.
            Limit::Fraction(f) => ((unbounded_peak as f64 * f) as u64 / MIB).max(1) * MIB,
        }
    }

    fn label(self) -> String {
        match self {
            Limit::Bytes(b) => format!("{} MiB", mib(b)),
            Limit::Fraction(f) => format!("{f} x unbounded peak"),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        let pool = args[i + 1].clone();
        either::PLAIN.store(!pool.starts_with("memquota"), Relaxed);
        let case = Case {
            pool,
            limit: args[i + 2].parse().expect("a limit in bytes"),
            queries: args[i + 3].split(',').map(|q| q.parse().expect("a query number")).collect(),
            scale: args[i + 4].parse().expect("a scale factor"),
            partitions: args[i + 5].parse().expect("partitions"),
            margin: args[i + 6].parse().ok(),
            streams: args.get(i + 7).and_then(|n| n.parse().ok()).unwrap_or(1),
            room_wait: args.get(i + 8).and_then(|w| w.parse().ok()),
            stats: args.get(i + 9).is_none_or(|s| s == "stats"),
        };
        if let Err(e) = child(&case) {
            println!("status failed");
            println!("why setup: {}", e.to_string().lines().next().unwrap_or_default());
            std::process::exit(1);
        }
        return;
    }
    let o = match options(&args[1..]) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let limits: Vec<Limit> = if o.fractions.is_empty() {
        o.limits.iter().map(|&b| Limit::Bytes(b)).collect()
    } else {
        o.fractions.iter().map(|&f| Limit::Fraction(f)).collect()
    };
    let total = match o.streams {
        1 => o.queries.len() * (1 + limits.len() * o.pools.len()),
        _ => o.queries.len() + limits.len() * o.pools.len() * (o.queries.len() + 1),
    };
    let started = Instant::now();
    let mut done = 0usize;
    let mut progress = |what: &str, r: &Run| {
        done += 1;
        let elapsed = started.elapsed().as_secs_f64();
        let eta = elapsed / done as f64 * (total - done) as f64;
        eprintln!(
            "[{done}/{total} {:.0} s, about {:.0} min left] {what}: {}",
            elapsed,
            eta / 60.0,
            if r.ok {
                format!("ok, peak RSS {} MiB, {:.1} s, {} spills", mib(r.rss), r.wall, r.spills)
            } else {
                format!("failed: {}", r.why)
            }
        );
    };
    // The unbounded runs: the expected results and each query's peak.
    let mut unbounded = BTreeMap::new();
    for &q in &o.queries {
        let r = run(&o, "unbounded", 0, &[q], 1);
        progress(&format!("q{q} unbounded"), &r);
        unbounded.insert(q, r);
    }
    if o.streams > 1 {
        streams_runs(&o, &limits, &unbounded, &mut progress);
        return;
    }
    // results[limit][pool][query]
    let mut results: Vec<AtLimit> = Vec::new();
    for &limit in &limits {
        let mut by_pool = BTreeMap::new();
        for pool in &o.pools {
            let mut by_query = BTreeMap::new();
            for &q in &o.queries {
                let base = &unbounded[&q];
                let l = limit.of(base.rss);
                let r = checked(run(&o, pool, l, &[q], 1), base);
                progress(&format!("q{q} {pool} at {} MiB", mib(l)), &r);
                by_query.insert(q, (l, r));
            }
            by_pool.insert(pool.clone(), by_query);
        }
        results.push(by_pool);
    }
    print!("{}", report(&o, &limits, &unbounded, &results));
    if let Some(path) = &o.svg {
        let series: Vec<(String, Vec<(f64, usize)>)> = o
            .pools
            .iter()
            .map(|pool| {
                let points = limits
                    .iter()
                    .zip(&results)
                    .map(|(limit, by_pool)| {
                        let x = match limit {
                            Limit::Bytes(b) => *b as f64 / MIB as f64,
                            Limit::Fraction(f) => *f,
                        };
                        (x, by_pool[pool].values().filter(|(_, r)| r.ok).count())
                    })
                    .collect();
                (pool.clone(), points)
            })
            .collect();
        let x_label = match limits.first() {
            Some(Limit::Fraction(_)) => "limit / the query's unbounded peak RSS",
            _ => "limit (MiB)",
        };
        let title = format!(
            "TPC-H SF {}, {} partitions: queries completed (of {})",
            o.scale,
            o.partitions,
            o.queries.len()
        );
        match std::fs::write(path, svg::plot(&title, x_label, o.queries.len(), &series)) {
            Ok(()) => eprintln!("plot written to {path}"),
            Err(e) => eprintln!("cannot write {path}: {e}"),
        }
    }
}

/// Whether `r` completed with the unbounded run's result.
fn checked(mut r: Run, base: &Run) -> Run {
    if r.ok && (!base.ok || r.hash != base.hash || r.rows != base.rows) {
        r.ok = false;
        r.why = if base.ok { "wrong result".into() } else { "no unbounded result".into() };
    }
    r
}

/// `--streams N`: at each limit and pool, each query alone at L / N, then the N
/// streams at once at L; a markdown table of both.
fn streams_runs(
    o: &Options,
    limits: &[Limit],
    unbounded: &BTreeMap<usize, Run>,
    progress: &mut dyn FnMut(&str, &Run),
) {
    let n = o.streams;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nTPC-H SF {}, {} partitions, {} queries: {n} streams at once in one process at L (each stream the queries in its own rotated order), against each query alone at L / {n} in a process of its own; peak RSS is the process's (VmHWM){}\n",
        o.scale,
        o.partitions,
        o.queries.len(),
        o.margin.map_or(String::new(), |m| format!("; MemquotaPool's margin {m}"))
            + &o.room_wait.map_or(String::new(), |w| format!("; MemquotaPool's wait for room {w} s"))
    );
    let _ = writeln!(
        s,
        "| limit | pool | alone at L / {n}: completed | in {n} streams: completed | failed in the streams, complete alone | peak RSS / L | (peak - idle RSS) / L | wall | waits (ended in room) | gave way | retries |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
    for &limit in limits {
        for pool in &o.pools {
            let mut alone = BTreeMap::new();
            for &q in &o.queries {
                let l = limit.of(unbounded[&q].rss) / n as u64;
                let r = checked(run(o, pool, l, &[q], 1), &unbounded[&q]);
                progress(&format!("q{q} {pool} alone at {} MiB", mib(l)), &r);
                alone.insert(q, r.ok);
            }
            // One process for all the streams: a fraction limit takes the largest peak.
            let l = o.queries.iter().map(|q| limit.of(unbounded[q].rss)).max().unwrap_or(0);
            let r = run(o, pool, l, &o.queries, n);
            let mut failed_here = Vec::new();
            let mut ok = 0;
            for res in &r.results {
                let base = &unbounded[&res.query];
                let good = res.ok && base.ok && res.hash == base.hash && res.rows == base.rows;
                ok += usize::from(good);
                if !good && alone.get(&res.query) == Some(&true) {
                    let why = if res.ok { "wrong result" } else { res.why.as_str() };
                    failed_here.push(format!("q{} (stream {}: {why})", res.query, res.stream));
                }
            }
            let summary = Run {
                ok: r.ok || r.results.len() == o.queries.len() * n,
                why: if r.results.len() < o.queries.len() * n { r.why.clone() } else { String::new() },
                ..r.clone()
            };
            progress(&format!("{n} streams {pool} at {} MiB", mib(l)), &summary);
            let _ = writeln!(
                s,
                "| {} | {pool} | {} of {} | {ok} of {}{} | {} | {:.2} | {:.2} | {:.1} s (longest query {:.1} s) | {} ({}) | {} | {} |",
                limit.label(),
                alone.values().filter(|&&ok| ok).count(),
                alone.len(),
                o.queries.len() * n,
                if summary.why.is_empty() { String::new() } else { format!(" ({})", summary.why) },
                if failed_here.is_empty() { "none".to_owned() } else { failed_here.join(", ") },
                r.rss as f64 / l as f64,
                r.rss.saturating_sub(r.idle) as f64 / l as f64,
                r.wall,
                r.results.iter().map(|x| x.wall).fold(0.0, f64::max),
                r.waits,
                r.waits_with_room,
                r.heaviest_failed,
                r.retries,
            );
        }
    }
    print!("{s}");
}

/// The markdown tables: a summary per limit and pool, then each query.
fn report(o: &Options, limits: &[Limit], unbounded: &BTreeMap<usize, Run>, results: &[AtLimit]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nTPC-H SF {}, {} partitions, {} queries, each in a process of its own; tables {}; peak RSS is the process's (VmHWM), L the limit{}\n",
        o.scale,
        o.partitions,
        o.queries.len(),
        if o.stats { "with row counts" } else { "without statistics" },
        o.margin.map_or(String::new(), |m| format!("; MemquotaPool's margin {m}"))
    );
    let _ = writeln!(
        s,
        "| limit | pool | completed | worst peak RSS / L | worst (peak - idle RSS) / L | worst (peak - warm idle RSS) / L | wall of those completed | spills | replans | retries |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for (limit, by_pool) in limits.iter().zip(results) {
        for (pool, by_query) in by_pool {
            let ok: Vec<&(u64, Run)> = by_query.values().filter(|(_, r)| r.ok).collect();
            let worst = ok.iter().map(|(l, r)| r.rss as f64 / *l as f64).fold(0.0, f64::max);
            let worst_over = |idle: &dyn Fn(&Run) -> u64| {
                ok.iter().map(|(l, r)| r.rss.saturating_sub(idle(r)) as f64 / *l as f64).fold(0.0, f64::max)
            };
            let (worst_over_idle, worst_over_warm) = (worst_over(&|r| r.idle), worst_over(&|r| r.warm));
            let sum = |f: &dyn Fn(&Run) -> u64| by_query.values().map(|(_, r)| f(r)).sum::<u64>();
            let _ = writeln!(
                s,
                "| {} | {pool} | {} of {} | {worst:.2} | {worst_over_idle:.2} | {worst_over_warm:.2} | {:.1} s | {} | {} | {} |",
                limit.label(),
                ok.len(),
                by_query.len(),
                ok.iter().map(|(_, r)| r.wall).sum::<f64>(),
                sum(&|r| r.spills),
                sum(&|r| r.replans),
                sum(&|r| r.retries),
            );
        }
    }
    for (limit, by_pool) in limits.iter().zip(results) {
        let _ = writeln!(
            s,
            "\nAt {}: peak RSS / L ((peak - idle RSS) / L; w: (peak - warm idle RSS) / L), wall time, the anonymous resident bytes' peak \
             over their idle value / L (a), MiB of code and other file-backed pages paged in past the idle \
             runtime's (f), spills (s), replans (p, with the joins made sort-merge joins), retries (r); \
             memquota only: peak tracked native bytes / L (t), MiB \
             allocated past the reservations at their peak (u); or why it failed\n",
            limit.label()
        );
        let pools: Vec<&String> = by_pool.keys().collect();
        let _ = write!(s, "| query | unbounded peak, wall |");
        for p in &pools {
            let _ = write!(s, " {p} |");
        }
        let _ = write!(s, "\n|---|---|");
        for _ in &pools {
            let _ = write!(s, "---|");
        }
        s.push('\n');
        for q in &o.queries {
            let base = &unbounded[q];
            let _ = write!(
                s,
                "| {q} | {} |",
                if base.ok { format!("{} MiB, {:.1} s", mib(base.rss), base.wall) } else { base.why.clone() }
            );
            for p in &pools {
                let (l, r) = &by_pool[*p][q];
                let cell = if r.ok {
                    let mut c = format!(
                        "{:.2} L ({:.2}; w {:.2}), {:.1} s",
                        r.rss as f64 / *l as f64,
                        r.rss.saturating_sub(r.idle) as f64 / *l as f64,
                        r.rss.saturating_sub(r.warm) as f64 / *l as f64,
                        r.wall
                    );
                    if r.anon > 0 {
                        let _ = write!(
                            c,
                            ", a {:.2}, f {}",
                            r.anon.saturating_sub(r.idle_anon) as f64 / *l as f64,
                            mib(r.file.saturating_sub(r.idle_file))
                        );
                    }
                    for (n, tag) in [(r.spills, "s"), (r.replans, "p"), (r.retries, "r")] {
                        if n > 0 {
                            let _ = write!(c, ", {n}{tag}");
                        }
                    }
                    if r.replanned_joins > 0 {
                        let _ = write!(c, " ({} joins)", r.replanned_joins);
                    }
                    if r.tracked > 0 {
                        let _ = write!(c, ", t {:.2}, u {}", r.tracked as f64 / *l as f64, mib(r.unreserved));
                    }
                    c
                } else {
                    format!("**failed**: {}", r.why)
                };
                let _ = write!(s, " {cell} |");
            }
            s.push('\n');
        }
    }
    s
}
