//! A real Spark job under the budget: `tests/spark/job.py` (PySpark, off-heap Tungsten
//! pages malloc'd through `Unsafe.allocateMemory`) run with libmemquota.so preloaded
//! into the JVMs Spark starts, each run under an outer `timeout`.
//!
//! Needs `cargo build --release` and the venv of `scripts/spark-venv.sh` (scripts/test.sh
//! runs both). There is no skip: without the venv every test here fails, saying how to
//! make it. `MEMQUOTA_SPARK_PYTHON` names another python with pyspark.
//!
//! The tests run one at a time (each Spark run takes both cores and ~1 GB).

mod common;

use common::{inherited_vars, lib, text, venv_python, Metrics};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

/// THE SWITCH: flip to `true` once the JVMTI agent (`Agent_OnLoad`) is in
/// libmemquota.so. The driver then also gets `-agentpath:<lib>=<AGENT_OPTIONS…>`, the
/// limit and the stats file move into the agent's options, and the heap and reclaim
/// figures are asserted. Before the agent, `-agentpath` fails the JVM with "Could not
/// find Agent_OnLoad".
const AGENT: bool = true;

/// Spark's page size: one malloc per page. Far above MEMQUOTA_REFUSE_MIN (4 MiB), so
/// the budget may refuse a page.
const PAGE: &str = "64m";
const PAGE_BYTES: f64 = (64u64 << 20) as f64;
/// Room for the job: native peaks of 225-400 MiB measured with 64 MiB pages, and the
/// driver's heap (-Xmx512m) on top once the agent counts it.
const ENOUGH: &str = if AGENT { "2g" } else { "1g" };
/// Too small for one page: the driver JVM holds about 75 MiB of native memory before
/// its first page (measured: 71-73 MiB at the first refusal), so no 64 MiB page fits,
/// while the JVM's own small mallocs keep 50 MiB of room (they are never refused below
/// REFUSE_MIN until the over-commit allowance, a sixteenth of the limit, is spent: a
/// refused compiler malloc would crash the JVM instead of failing the job).
const TOO_SMALL: &str = "128m";

const PREFIX: &str = "memquota-spark-job:";

/// A fresh directory for one run's stats files and the JVM's crash files, if any.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memquota-spark-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs job.py with `args` and `env` under `timeout`, in `dir`. The python process is
/// never preloaded (job.py sets LD_PRELOAD for the JVM it starts), and `output()`
/// returns only when every process holding its pipes is gone: the driver JVM too.
fn job(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/spark/job.py");
    let mut cmd = Command::new("timeout");
    // GNU timeout signals its whole process group: the JVMs go too.
    cmd.args(["-k", "10", "240", "env"]);
    for (k, v) in env {
        cmd.arg(format!("{k}={v}"));
    }
    cmd.arg(venv_python("MEMQUOTA_SPARK_PYTHON", "spark-venv", "pyspark"))
        .arg(script)
        .args(["--page-size", PAGE, "--preload"])
        .arg(lib())
        .args(args);
    for var in inherited_vars().chain(["MEMQUOTA_STATS_INTERVAL", "LD_PRELOAD"]).chain([
        "SPARK_HOME",
        "PYSPARK_PYTHON",
        "PYSPARK_SUBMIT_ARGS",
        "MEMQUOTA_SO",
        "MEMQUOTA_AGENT_OPTIONS",
    ]) {
        cmd.env_remove(var);
    }
    let started = std::time::Instant::now();
    let out = cmd.current_dir(dir).output().unwrap();
    eprintln!("spark job {args:?} {env:?}: {:?} in {:.1} s", out.status, started.elapsed().as_secs_f64());
    out
}

/// The driver's budget for one local-mode run: as agent options, or as environment.
fn driver_budget(limit: &str, stats: &Path) -> (Vec<String>, Vec<(&'static str, String)>) {
    if AGENT {
        // Only the driver JVM writes the agent's stats file.
        let opts = format!("limit={limit},heap=committed,stats_file={}", stats.display());
        (vec!["--agent-options".into(), opts], vec![])
    } else {
        // Every preloaded process writes this file (the launcher JVM, shells) unless
        // a bigger one running wrote it: the driver JVM's figures are what stays.
        (
            vec![],
            vec![("MEMQUOTA_LIMIT", limit.to_owned()), ("MEMQUOTA_STATS_FILE", stats.display().to_string())],
        )
    }
}

fn run_local(name: &str, limit: &str) -> (Output, Stats) {
    let dir = scratch(name);
    let stats = dir.join("driver.prom");
    let (args, env) = driver_budget(limit, &stats);
    let args: Vec<&str> = args.iter().map(String::as_str).chain(["--master", "local[2]"]).collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let out = job(&dir, &args, &env);
    let stats = Stats::read(&stats, &out);
    let _ = std::fs::remove_dir_all(&dir);
    (out, stats)
}

fn show(out: &Output) -> String {
    let stderr = text(&out.stderr);
    // The JVM's logs run long: the end says what happened.
    let tail: String =
        stderr.lines().rev().take(80).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    format!("{:?}\nstdout:\n{}\nstderr (last 80 lines):\n{tail}", out.status, text(&out.stdout))
}

/// A parsed stats file.
struct Stats(Metrics);

impl std::ops::Deref for Stats {
    type Target = Metrics;
    fn deref(&self) -> &Metrics {
        &self.0
    }
}

impl Stats {
    fn read(path: &Path, out: &Output) -> Stats {
        let stats = Stats(Metrics::read(path, || show(out)));
        let mib = |name: &str| stats.get(name) / (1 << 20) as f64;
        eprintln!(
            "{}: native {:.1} MiB (peak {:.1}), heap committed {:.1} MiB, refusals {}, RSS {:.1} MiB",
            path.display(),
            mib("memquota_native_bytes"),
            mib("memquota_native_peak_bytes"),
            mib("memquota_heap_committed_bytes"),
            stats.get("memquota_oom_total"),
            mib("memquota_process_rss_bytes"),
        );
        stats
    }

    /// The file was written by a JVM, not by one of the small preloaded processes
    /// around it (shells, the launcher).
    fn assert_from_a_jvm(&self, limit: &str) {
        assert_eq!(
            self.get("memquota_limit_bytes"),
            memquota_core::seam::process::parse_size(limit).unwrap() as f64
        );
        let rss = self.get("memquota_process_rss_bytes");
        assert!(rss > 150.0 * (1 << 20) as f64, "RSS {rss}: the stats file is not the JVM's");
    }

    fn assert_heap_and_reclaims_consistent(&self) {
        let committed = self.get("memquota_heap_committed_bytes");
        let used = self.get("memquota_heap_used_bytes");
        assert!(committed > 0.0, "heap committed {committed}");
        assert!(used > 0.0 && used <= committed, "heap used {used}, committed {committed}");
        assert_eq!(self.get("memquota_reclaim_panics_total"), 0.0);
        let reclaims = self.labelled("memquota_reclaims_total", Some("sync"))
            + self.labelled("memquota_reclaims_total", Some("background"));
        if reclaims == 0.0 {
            assert_eq!(self.get("memquota_reclaimed_bytes_total"), 0.0, "bytes freed by no reclaim");
        }
    }
}

#[test]
fn spark_job_is_correct_under_the_budget_and_its_pages_are_counted() {
    let (out, stats) = run_local("ok", ENOUGH);
    assert!(out.status.success(), "{}", show(&out));
    let stdout = text(&out.stdout);
    assert!(stdout.contains(&format!("{PREFIX} OK rows=")), "{}", show(&out));
    assert!(!text(&out.stderr).contains("memquota: allocation refused"), "{}", show(&out));

    stats.assert_from_a_jvm(ENOUGH);
    assert!(stats.get("memquota_native_bytes") > 0.0);
    // The JVM alone stays near 80 MiB; two tasks at once hold 64 MiB pages on top.
    let peak = stats.get("memquota_native_peak_bytes");
    assert!(peak >= 80.0 * (1 << 20) as f64 + PAGE_BYTES, "native peak {peak}: no Tungsten page counted?");
    assert_eq!(stats.get("memquota_oom_total"), 0.0, "refusals in a run that passed");
    if AGENT {
        stats.assert_heap_and_reclaims_consistent();
    }
}

#[test]
fn spark_job_over_the_budget_fails_with_the_report_not_a_kill() {
    let (out, stats) = run_local("too-small", TOO_SMALL);
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    // job.py exits 2 when Spark fails the job, and 3 when the JVM went away (a refused
    // internal malloc kills HotSpot: an hs_err file); a timeout is 124, a signal none.
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(stdout.contains(&format!("{PREFIX} FAILED: Py4JJavaError")), "{}", show(&out));
    assert!(stdout.contains("SparkOutOfMemoryError"), "{}", show(&out));
    assert!(!stderr.contains("A fatal error has been detected by the Java Runtime"), "{}", show(&out));
    // The page is what is refused, with our report, and Java sees OutOfMemoryError.
    assert!(stderr.contains("memquota: allocation refused: 64.0 MiB (67108864) requested"), "{}", show(&out));
    assert!(stderr.contains("limit            128.0 MiB (134217728)"), "{}", show(&out));
    // With the agent the gate throws, carrying the report; without it, the JDK throws
    // when malloc returns NULL.
    let java_sees = if AGENT {
        "java.lang.OutOfMemoryError: memquota: allocation refused: 64.0 MiB (67108864) requested"
    } else {
        "java.lang.OutOfMemoryError: Unable to allocate 67108864 bytes"
    };
    assert!(stderr.contains(java_sees), "{}", show(&out));

    stats.assert_from_a_jvm(TOO_SMALL);
    let refusals = stats.get("memquota_oom_total");
    // Reports as the refusal wrote them, at the start of a line; with the agent, Java
    // stack traces repeat them after "java.lang.OutOfMemoryError: ".
    // Every refusal is counted; within a report window only the first writes a full
    // report (the rest are summed up in the next one).
    let reports = stderr.lines().filter(|l| l.starts_with("memquota: allocation refused")).count() as f64;
    let written = stats.get("memquota_oom_reports_total");
    assert!(
        refusals >= 1.0 && reports >= 1.0 && reports == written && reports <= refusals,
        "{refusals} refusals counted, {written} reports counted, {reports} reports printed"
    );
    if AGENT {
        stats.assert_heap_and_reclaims_consistent();
        // A page is refused only after a GC was run or turned away.
        let tried = stats.labelled("memquota_reclaims_total", Some("sync"))
            + stats.get("memquota_reclaims_throttled_total");
        assert!(tried >= 1.0, "refused with no reclaim tried");
    }
}

/// The executor's stderr file, from the directory job.py printed.
fn executor_stderr(out: &Output) -> String {
    let stdout = text(&out.stdout);
    let dir = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{PREFIX} executor logs in ")))
        .unwrap_or_else(|| panic!("no executor log directory printed\n{}", show(out)));
    let file = Path::new(dir).join("0/stderr");
    let log =
        std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}\n{}", file.display(), show(out)));
    let _ = std::fs::remove_dir_all(dir);
    log
}

/// local-cluster[1,1,1024]: a standalone master and worker inside the driver, one
/// executor JVM launched by the worker. Only the executor is preloaded, through
/// `spark.executorEnv.LD_PRELOAD`, and its budget comes through executorEnv too.
fn run_cluster(name: &str, limit: &str) -> (Output, PathBuf) {
    let dir = scratch(name);
    let stats = dir.join("executor.prom");
    let mut args = vec![
        "--master".to_owned(),
        "local-cluster[1,1,1024]".to_owned(),
        "--executor-preload-only".to_owned(),
        "--executor-env".to_owned(),
        format!("MEMQUOTA_STATS_FILE={}", stats.display()),
    ];
    if AGENT {
        args.extend(["--agent-options".to_owned(), format!("limit={limit},heap=committed")]);
    } else {
        args.extend(["--executor-env".to_owned(), format!("MEMQUOTA_LIMIT={limit}")]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    (job(&dir, &args, &[]), stats)
}

#[test]
fn executors_launched_by_spark_get_the_budget_through_executor_env() {
    let (out, stats_file) = run_cluster("cluster", ENOUGH);
    assert!(out.status.success(), "{}", show(&out));
    assert!(text(&out.stdout).contains(&format!("{PREFIX} OK rows=")), "{}", show(&out));
    // The driver is not preloaded: this file is the executor's. The executor rewrote
    // it every second while it ran; the small processes it starts (the `rm -rf` of
    // its shutdown hook, which may still run when the driver's stop() returns) leave
    // it to the bigger executor.
    let stats = Stats::read(&stats_file, &out);
    let _ = std::fs::remove_dir_all(stats_file.parent().unwrap());
    stats.assert_from_a_jvm(ENOUGH);
    let peak = stats.get("memquota_native_peak_bytes");
    assert!(peak >= PAGE_BYTES, "executor native peak {peak}: no Tungsten page counted?");
    assert_eq!(stats.get("memquota_oom_total"), 0.0);
    let log = executor_stderr(&out);
    assert!(!log.contains("memquota: allocation refused"), "{log}");

    // The same job with an executor budget too small for one page: the report is in
    // the executor's log, and the job fails cleanly.
    let (out, stats) = run_cluster("cluster-too-small", TOO_SMALL);
    let _ = std::fs::remove_dir_all(stats.parent().unwrap());
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(text(&out.stdout).contains("SparkOutOfMemoryError"), "{}", show(&out));
    let log = executor_stderr(&out);
    assert!(log.contains("memquota: allocation refused: 64.0 MiB (67108864) requested"), "{log}");
    assert!(!text(&out.stderr).contains("memquota:"), "the driver is not preloaded\n{}", show(&out));
}
