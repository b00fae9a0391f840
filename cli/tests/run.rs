//! The `memquota` command end to end: C programs (tests/c/workload.c) and `java
//! -version` run under `memquota run` with the real preload, `--plot`, `memquota stat`
//! on a file and on an endpoint, `memquota profile` on the endpoint of a program
//! holding two sites' memory (ld_preload/tests/c/sites.c), and the errors.
//!
//! Needs `cargo build --release` first (libmemquota.so next to the memquota binary;
//! scripts/test.sh does it), gcc, java, and util-linux's `script` (a terminal for the
//! status line). Every run is under an outer `timeout`, or a watchdog where the test
//! must signal memquota itself.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

#[path = "../../tests/support/pprof.rs"]
mod pprof;

const MEMQUOTA: &str = env!("CARGO_BIN_EXE_memquota");

/// libmemquota.so next to the memquota binary, where `memquota run` looks for it.
fn preload() -> PathBuf {
    let so = Path::new(MEMQUOTA).parent().unwrap().join("libmemquota.so");
    assert!(so.exists(), "{} is missing: run `cargo build --release` first", so.display());
    so.canonicalize().unwrap()
}

/// A fresh directory for one test's files.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memquota-cli-tests-{}", std::process::id())).join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// tests/c/workload.c, compiled once per test binary.
fn workload() -> &'static str {
    static BUILT: OnceLock<String> = OnceLock::new();
    BUILT.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/workload.c");
        let out = scratch("bin").join("workload");
        let status = Command::new("gcc")
            .args(["-O1", "-Wall", "-pthread"])
            .arg(&src)
            .arg("-o")
            .arg(&out)
            .status()
            .unwrap();
        assert!(status.success(), "gcc {} failed", src.display());
        out.to_str().unwrap().to_string()
    })
}

/// `memquota ARGS` with no MEMQUOTA_* or LD_PRELOAD from our environment.
fn command(program: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(program);
    cmd.args(args).stdin(Stdio::null()).env_remove("LD_PRELOAD");
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("MEMQUOTA_") {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// Runs `memquota ARGS` under `timeout` (which passes an exit code or a signal on).
fn memquota(args: &[&str]) -> Output {
    let mut all = vec!["-k", "5", "60", MEMQUOTA];
    all.extend_from_slice(args);
    let out = command("timeout", &all).output().unwrap();
    assert_ne!(out.status.code(), Some(124), "timed out: memquota {args:?}\n{}", text(&out.stderr));
    out
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The value of a summary or `stat` row: `  NAME<padding> VALUE`, from the summary
/// (which comes last) when there is one, not from a refusal report before it.
fn row(output: &str, name: &str) -> String {
    let output = output.rfind("memquota: `").map_or(output, |i| &output[i..]);
    let prefix = format!("  {name:<16} ");
    let line = output.lines().find(|l| l.starts_with(&prefix));
    line.unwrap_or_else(|| panic!("no {name:?} row in:\n{output}"))[prefix.len()..].to_string()
}

/// `64.0 MiB` -> 64.0 (MiB).
fn mib(value: &str) -> f64 {
    let mut words = value.split_whitespace();
    let n: f64 = words.next().unwrap().parse().unwrap();
    let scale = match words.next().unwrap() {
        "B" => 1.0 / (1 << 20) as f64,
        "KiB" => 1.0 / 1024.0,
        "MiB" => 1.0,
        "GiB" => 1024.0,
        u => panic!("unit {u} in {value:?}"),
    };
    n * scale
}

#[test]
fn run_passes_a_normal_exit_through_with_a_summary() {
    let out = command("timeout", &["60", "env", "LD_PRELOAD=libm.so.6", MEMQUOTA])
        .args(["run", "--limit", "256m", "--", workload(), "exit", "0"])
        .output()
        .unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    // Ours first, then what was there; the program really ran under it.
    let expected = format!("LD_PRELOAD={}:libm.so.6\n", preload().display());
    assert!(stdout.contains(&expected), "{stdout}");
    assert!(stderr.contains("` exited with status 0 after "), "{stderr}");
    assert_eq!(row(&stderr, "limit"), "256.0 MiB");
    let peak = mib(&row(&stderr, "peak native"));
    assert!((64.0..72.0).contains(&peak), "peak native {peak} MiB for 16 blocks of 4 MiB:\n{stderr}");
    assert_eq!(row(&stderr, "refusals"), "0");
    assert!(row(&stderr, "reclaims").starts_with("0 "), "{stderr}");
    assert!(row(&stderr, "samples").parse::<u32>().unwrap() >= 1);
    assert!(!stderr.contains('\r'), "a status line, though stderr is not a terminal:\n{stderr:?}");

    let out = memquota(&["run", "--limit", "256m", "--", workload(), "exit", "7"]);
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("` exited with status 7 after "));
}

#[test]
fn run_shows_a_refusal_and_passes_its_exit_code() {
    let dir = scratch("refusal");
    let stats = dir.join("stats.prom");
    let out = run_refusing(&stats);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    // The program's own choice when malloc says NULL: 42.
    assert_eq!(out.status.code(), Some(42), "{stdout}{stderr}");
    assert!(stdout.contains("malloc(256 MiB) returned NULL"), "{stdout}");
    assert!(stderr.contains("memquota: allocation refused: 256.0 MiB (268435456) requested"), "{stderr}");
    assert_eq!(row(&stderr, "refusals"), "1");
    assert_eq!(row(&stderr, "limit"), "64.0 MiB");
    assert_eq!(row(&stderr, "stats file"), stats.display().to_string());
    // The stats file stays, holding the final figures.
    let kept = std::fs::read_to_string(&stats).unwrap();
    assert!(kept.lines().any(|l| l == "memquota_oom_total 1"), "{kept}");
}

#[test]
fn run_passes_a_signal_through() {
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGKILL, "SIGKILL")] {
        let out = memquota(&["run", "--interval", "20ms", "--", workload(), "signal", &sig.to_string()]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.signal(), Some(sig), "{:?}\n{stderr}", out.status);
        assert!(stderr.contains(&format!("` was killed by signal {sig} ({name}) after ")), "{stderr}");
        // No exit write: the figures come from the samples taken while it ran.
        let peak = mib(&row(&stderr, "peak native"));
        assert!(peak >= 32.0, "peak native {peak} MiB with 32 MiB held:\n{stderr}");
    }
}

/// Runs memquota in its own process group, calls `poke(pid)` once `ready` holds,
/// and kills the group if it is not over within 30 s.
fn run_and_poke(mut memquota: Command, ready: impl Fn() -> bool, poke: impl FnOnce(i32)) -> Output {
    let args: Vec<_> = memquota.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
    let mut child = memquota.process_group(0).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let pid = child.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        stderr.read_to_end(&mut s).unwrap();
        s
    });
    while !ready() {
        assert!(Instant::now() < deadline, "not ready in 30 s");
        assert!(child.try_wait().unwrap().is_none(), "memquota ended before it was ready");
        std::thread::sleep(Duration::from_millis(5)); // polling a condition, bounded above
    }
    poke(pid);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stdout = Vec::new();
            child.stdout.take().unwrap().read_to_end(&mut stdout).unwrap();
            return Output { status, stdout, stderr: reader.join().unwrap() };
        }
        if Instant::now() > deadline {
            // SAFETY: kill with no memory arguments; the group is memquota's, unreaped.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            panic!("memquota {args:?} still running after 30 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// memquota_native_bytes in a stats file, 0 before there is one.
fn native_bytes(stats: &Path) -> u64 {
    let text = std::fs::read_to_string(stats).unwrap_or_default();
    let value = text.lines().find_map(|l| l.strip_prefix("memquota_native_bytes "));
    value.map_or(0, |v| v.trim().parse().unwrap())
}

#[test]
fn run_forwards_sigterm_and_outlives_a_terminal_ctrl_c() {
    let dir = scratch("forward");
    for (sig, to_group, name) in [(libc::SIGTERM, false, "SIGTERM"), (libc::SIGINT, true, "SIGINT")] {
        let stats = dir.join(format!("{name}.prom"));
        let args = [
            "run",
            "--interval",
            "20ms",
            "--stats-file",
            stats.to_str().unwrap(),
            "--",
            workload(),
            "hold",
            "20",
        ];
        // SIGTERM to memquota alone (a supervisor): forwarded to the program. SIGINT to
        // the whole group (a terminal's Ctrl-C): memquota outlives it and reports.
        let out = run_and_poke(
            command(MEMQUOTA, &args),
            || native_bytes(&stats) >= 32 << 20,
            |pid| {
                let target = if to_group { -pid } else { pid };
                // SAFETY: kill with no memory arguments, to our unreaped child (group).
                assert_eq!(unsafe { libc::kill(target, sig) }, 0);
            },
        );
        let stderr = text(&out.stderr);
        assert_eq!(out.status.signal(), Some(sig), "{:?}\n{stderr}", out.status);
        assert!(stderr.contains(&format!("` was killed by signal {sig} ({name}) after ")), "{stderr}");
        assert!(mib(&row(&stderr, "peak native")) >= 32.0, "{stderr}");
    }
}

#[test]
fn stat_reads_the_endpoint_of_a_running_program() {
    let stats = scratch("stat-live").join("stats.prom");
    let addr = {
        let free = TcpListener::bind("127.0.0.1:0").unwrap();
        free.local_addr().unwrap().to_string()
    };
    let args = ["run", "--limit", "64m", "--interval", "20ms", "--stats-file", stats.to_str().unwrap(), "--"];
    let mut memquota_run = command(MEMQUOTA, &args);
    memquota_run.args([workload(), "hold", "20"]).env("MEMQUOTA_METRICS_ADDR", &addr);
    let mut scraped = None;
    let out = run_and_poke(
        memquota_run,
        || native_bytes(&stats) >= 32 << 20,
        |pid| {
            scraped = Some(memquota(&["stat", &addr]));
            // SAFETY: kill with no memory arguments, to our unreaped child.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        },
    );
    assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{}", text(&out.stderr));
    let scraped = scraped.unwrap();
    let stdout = text(&scraped.stdout);
    assert_eq!(scraped.status.code(), Some(0), "{stdout}{}", text(&scraped.stderr));
    assert!(stdout.starts_with(&format!("memquota stats from {addr}\n")), "{stdout}");
    assert!(row(&stdout, "limit").starts_with("64.0 MiB  "), "{stdout}");
    let native = mib(row(&stdout, "native").split("  ").next().unwrap());
    assert!((32.0..33.0).contains(&native), "native {native} MiB with 32 MiB held: {stdout}");
}

#[test]
fn run_java_version() {
    let out = memquota(&["run", "--limit", "2g", "--", "java", "-version"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains(" version \""), "{stderr}");
    assert!(stderr.contains("`java -version` exited with status 0 after "), "{stderr}");
    assert_eq!(row(&stderr, "limit"), "2.0 GiB");
    assert_eq!(row(&stderr, "refusals"), "0");
    assert!(mib(&row(&stderr, "peak native")) > 1.0, "the JVM mallocs megabytes:\n{stderr}");
}

#[test]
fn run_jvm_loads_the_agent_so_the_heap_counts() {
    let out = memquota(&["run", "--limit", "2g", "--jvm", "--", "java", "-Xms64m", "-Xmx256m", "-version"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("Picked up JAVA_TOOL_OPTIONS: -agentpath:"), "{stderr}");
    assert_eq!(row(&stderr, "limit"), "2.0 GiB");
    // The agent pushed the heap: -Xms64m commits 64 MiB at once.
    let heap = row(&stderr, "peak heap");
    assert!(mib(heap.split(" committed").next().unwrap()) >= 64.0, "{stderr}");
    // Without --jvm the heap is not counted.
    let out = memquota(&["run", "--limit", "2g", "--", "java", "-Xms64m", "-Xmx256m", "-version"]);
    assert_eq!(row(&text(&out.stderr), "peak heap"), "0 B committed", "{}", text(&out.stderr));
}

#[test]
fn plot_writes_an_svg_with_the_series_and_events() {
    let dir = scratch("plot");
    let svg = dir.join("timeline.svg");
    let out = memquota(&[
        "run",
        "--limit",
        "256m",
        "--interval",
        "20ms",
        "--plot",
        svg.to_str().unwrap(),
        "--",
        workload(),
        "timeline",
        "40",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(row(&stderr, "plot"), svg.display().to_string());
    assert!(row(&stderr, "refusals").parse::<u32>().unwrap() >= 1, "{stderr}");

    let xml = std::fs::read_to_string(&svg).unwrap();
    let doc =
        roxmltree::Document::parse(&xml).unwrap_or_else(|e| panic!("{} is not XML: {e}", svg.display()));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for label in ["native", "heap committed", "limit", "headroom", "time (s)", "MiB"] {
        assert!(texts.contains(&label), "no {label:?} in the SVG's texts {texts:?}");
    }
    for event in ["reclaims (", "refusals ("] {
        assert!(texts.iter().any(|t| t.starts_with(event)), "no {event:?} legend in {texts:?}");
    }
    // The native series (its colour) is one line through every sample of a 1 s run.
    let native_points = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke") == Some("#1F77B4"))
        .map(|n| n.attribute("points").unwrap_or("").split_whitespace().count())
        .max()
        .unwrap_or(0);
    assert!(native_points >= 10, "the native line has {native_points} points");
}

#[test]
fn status_line_on_a_terminal_only() {
    // `script` gives memquota a terminal; its output is what the terminal showed.
    let inner = format!("{MEMQUOTA} run --limit 256m --interval 20ms -- {} timeline 12", workload());
    let out = command("timeout", &["60", "script", "-qfec", &inner, "/dev/null"]).output().unwrap();
    let screen = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{screen}");
    let status = screen.split('\r').find(|s| s.starts_with("memquota: native ")).unwrap_or_else(|| {
        panic!("no status line on the terminal: {screen:?}");
    });
    for part in ["  heap ", "  limit 256.0 MiB", "  reclaims ", "  OOMs 0"] {
        assert!(status.contains(part), "{part:?} not in the status line {status:?}");
    }
    // Cleared before the summary.
    let summary = screen.find("memquota: `").unwrap_or_else(|| panic!("no summary: {screen:?}"));
    let last_status = screen[..summary].rfind("memquota: native ").unwrap();
    assert!(screen[last_status..summary].contains("\r\x1b[K"), "not cleared: {screen:?}");
    assert!(!screen[summary..].contains("memquota: native "), "{screen:?}");
}

/// `memquota run --limit 64m` on a program that asks for 256 MiB and exits 42 when
/// malloc says NULL.
fn run_refusing(stats: &Path) -> std::process::Output {
    memquota(&["run", "--limit", "64m", "--stats-file", stats.to_str().unwrap(), "--", workload(), "refuse"])
}

/// The text of a stats file from a real run: limit 64 MiB, one refusal.
fn real_stats_file(dir: &Path) -> PathBuf {
    let stats = dir.join("stats.prom");
    let out = run_refusing(&stats);
    assert_eq!(out.status.code(), Some(42), "{}", text(&out.stderr));
    stats
}

fn assert_stat_output(out: &Output, source: &str) {
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(stdout.starts_with(&format!("memquota stats from {source}\n")), "{stdout}");
    assert!(row(&stdout, "limit").starts_with("64.0 MiB  (soft threshold 54.4 MiB)"), "{stdout}");
    assert_eq!(row(&stdout, "refusals"), "1");
    assert!(row(&stdout, "reclaims").starts_with("0 sync, 0 background"), "{stdout}");
    assert!(mib(row(&stdout, "process RSS").split("  ").next().unwrap()) > 0.5, "{stdout}");
}

#[test]
fn stat_reads_a_stats_file() {
    let stats = real_stats_file(&scratch("stat-file"));
    let source = stats.to_str().unwrap();
    let out = memquota(&["stat", source]);
    assert_stat_output(&out, source);
    // The file names the process whose figures it holds, with its peak RSS, at least
    // the RSS it ended with.
    let stdout = text(&out.stdout);
    let writer = row(&stdout, "written by");
    let (pid, peak) = writer.strip_prefix("pid ").and_then(|w| w.split_once("  (peak RSS ")).unwrap();
    assert!(pid.parse::<u32>().is_ok_and(|p| p > 0), "{writer}");
    let rss = mib(row(&stdout, "process RSS").split("  ").next().unwrap());
    assert!(mib(peak.trim_end_matches(')')) >= rss, "{stdout}");
}

#[test]
fn stat_reads_an_endpoint() {
    let body = std::fs::read_to_string(real_stats_file(&scratch("stat-endpoint"))).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(conn);
        let mut request = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                break;
            }
            request.push_str(&line);
        }
        let mut conn = reader.into_inner();
        let head = "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\r\n";
        conn.write_all(format!("{head}{body}").as_bytes()).unwrap();
        request
    });
    let out = memquota(&["stat", &addr]);
    let request = server.join().unwrap();
    assert!(request.starts_with("GET /metrics HTTP/1.0\r\n"), "{request:?}");
    assert_stat_output(&out, &addr);
}

#[test]
fn stat_says_what_it_could_not_read() {
    let dir = scratch("stat-errors");
    let closed = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let not_prometheus = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/workload.c");
    let missing = dir.join("no-such.prom");
    for (source, says) in [
        (closed.as_str(), "no such file, and connecting to"),
        (missing.to_str().unwrap(), "no such file, and not an endpoint address"),
        (not_prometheus.to_str().unwrap(), "no memquota_* metrics"),
    ] {
        let out = memquota(&["stat", source]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{source}: {stderr}");
        assert!(stderr.starts_with(&format!("memquota: {source}")), "{stderr}");
        assert!(stderr.contains(says), "{source}: {stderr}");
    }
}

#[test]
fn bad_flags_and_a_missing_preload_exit_2_without_running_anything() {
    let dir = scratch("errors");
    let marker = dir.join("ran");
    let touch = ["touch", marker.to_str().unwrap()];
    let cases: Vec<(Vec<&str>, &[&str])> = vec![
        (vec!["run", "--limit", "lots", "--"], &["--limit", "lots", "75%"]),
        (vec!["run", "--limit", "0", "--"], &["--limit", "above zero"]),
        (vec!["run", "--interval", "5ms", "--"], &["--interval", "at least 10ms"]),
        (vec!["run", "--interval", "fast", "--"], &["--interval", "fast"]),
        (vec!["run", "--bogus", "--"], &["--bogus"]),
        (vec!["run", "--limit", "1g"], &["<CMD>"]),
        (vec!["frobnicate"], &["frobnicate"]),
        (
            vec!["run", "--preload", "/nonexistent/libmemquota.so", "--"],
            &["/nonexistent/libmemquota.so is missing"],
        ),
        (vec!["run", "--plot", "/nonexistent/t.svg", "--"], &["--plot", "/nonexistent does not exist"]),
        (
            vec!["run", "--stats-file", "/nonexistent/s.prom", "--"],
            &["--stats-file", "/nonexistent does not exist"],
        ),
    ];
    for (mut args, says) in cases {
        if args.last() == Some(&"--") {
            args.extend_from_slice(&touch);
        }
        let out = memquota(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        for s in says {
            assert!(stderr.contains(s), "{args:?}: {s:?} not in {stderr}");
        }
        assert!(!marker.exists(), "{args:?} ran the program");
    }

    // A memquota with no libmemquota.so beside it.
    let lonely = dir.join("memquota");
    std::fs::copy(MEMQUOTA, &lonely).unwrap();
    let mut args = vec!["run", "--"];
    args.extend_from_slice(&touch);
    let out = command("timeout", &["60", lonely.to_str().unwrap()]).args(&args).output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let expected = format!("the preload library {} is missing", dir.join("libmemquota.so").display());
    assert!(stderr.contains(&expected) && stderr.contains("--preload PATH"), "{stderr}");
    assert!(!marker.exists());

    // A program that is not there: 127, as a shell says.
    let out = memquota(&["run", "--", "/nonexistent/program"]);
    assert_eq!(out.status.code(), Some(127), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("memquota: cannot run /nonexistent/program: "));
}

/// tests/c/forking_server.c run under the preload (no `memquota run`: its stats file
/// path is `stats`), with a limit of 32 MiB: every process asks for 80 MiB in 8 MiB
/// blocks. Returns the refusals the processes saw, in all.
fn forking_server(stats: &str) -> u64 {
    // Built once: two checks run it at once, and one rewriting the program while the
    // other starts it fails that start (EACCES).
    static BIN: OnceLock<std::path::PathBuf> = OnceLock::new();
    let bin = BIN.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/forking_server.c");
        let bin = scratch("bin-server").join("forking_server");
        let status =
            Command::new("gcc").args(["-O1", "-Wall"]).arg(&src).arg("-o").arg(&bin).status().unwrap();
        assert!(status.success(), "gcc {} failed", src.display());
        bin
    });
    let mut cmd = command("timeout", &["60", "env"]);
    cmd.arg(format!("LD_PRELOAD={}", preload().display()))
        .args(["MEMQUOTA_LIMIT=32m", &format!("MEMQUOTA_STATS_FILE={stats}")])
        .arg(bin)
        .args(["3", "10"]);
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let counts: Vec<u64> =
        stdout.lines().filter_map(|l| l.strip_prefix("refused ")).map(|n| n.parse().unwrap()).collect();
    assert_eq!(counts.len(), 4, "{stdout}");
    assert!(counts.iter().all(|&n| n >= 4), "each process is refused: {stdout}");
    counts.iter().sum()
}

/// The `total` row of `memquota stat` over a tree: (processes, refusals, reports).
fn tree_total(out: &Output) -> (u64, u64, u64) {
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    let total =
        stdout.lines().find(|l| l.trim_start().starts_with("total")).unwrap_or_else(|| panic!("{stdout}"));
    let cells: Vec<&str> = total.split_whitespace().collect();
    let n = |i: usize| cells[i].parse::<u64>().unwrap_or_else(|_| panic!("{total}"));
    (n(1), n(cells.len() - 2), n(cells.len() - 1))
}

#[test]
fn stat_sums_a_forking_servers_tree_from_a_directory() {
    let dir = scratch("stat-tree");
    let stats = format!("{}/", dir.join("stats").display());
    let refused = forking_server(&stats);
    let out = memquota(&["stat", &stats]);
    let (processes, refusals, reports) = tree_total(&out);
    assert_eq!((processes, refusals), (4, refused), "{}", text(&out.stdout));
    // Each process writes a full report for its first refusal at least.
    assert!(reports >= 4, "{}", text(&out.stdout));
    let stdout = text(&out.stdout);
    assert_eq!(stdout.lines().filter(|l| l.contains(" ended ")).count(), 4, "{stdout}");
}

#[test]
fn stat_sums_files_named_with_the_pid() {
    let dir = scratch("stat-tree-pid");
    let refused = forking_server(&format!("{}/mq.%p.prom", dir.display()));
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path().to_string_lossy().into_owned())
        .filter(|p| p.ends_with(".prom"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 4, "{files:?}");
    let mut args = vec!["stat"];
    args.extend(files.iter().map(String::as_str));
    assert_eq!(tree_total(&memquota(&args)).1, refused);
}

#[test]
fn a_bad_stats_file_pattern_is_a_clear_error() {
    let mut cmd = command("timeout", &["20", "env"]);
    cmd.arg(format!("LD_PRELOAD={}", preload().display())).args(["MEMQUOTA_STATS_FILE=/tmp/mq.%d", "true"]);
    let out = cmd.output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("MEMQUOTA_STATS_FILE") && err.contains("%p"), "{err}");
}

/// ld_preload/tests/c/sites.c (48 MiB live from `big_site`, 8 MiB from `small_site`)
/// run with `hold` under the preload, its endpoint on a free port, `MEMQUOTA_*` from
/// `env`: runs `poke(ADDR)` while the memory is held, then lets the program end.
fn while_sites_hold<T>(env: &[(&str, &str)], poke: impl FnOnce(&str) -> T) -> T {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let sites = BUILT.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ld_preload/tests/c/sites.c");
        let out = scratch("sites-bin").join("sites");
        let status = Command::new("gcc").args(["-O1", "-g"]).arg(&src).arg("-o").arg(&out).status().unwrap();
        assert!(status.success(), "gcc {} failed", src.display());
        out
    });
    let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    // The preload on the program, not on `timeout`: that would bind the port first.
    let mut cmd = command("timeout", &["120", "env"]);
    cmd.arg(format!("LD_PRELOAD={}", preload().display()));
    cmd.args(["MEMQUOTA_LIMIT=1g".to_string(), format!("MEMQUOTA_METRICS_ADDR={addr}")]);
    cmd.args(env.iter().map(|(k, v)| format!("{k}={v}")));
    cmd.args([sites.to_str().unwrap(), "hold"]);
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line, "held\n");
    let result = poke(&addr);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    result
}

/// `memquota profile ADDR --top 20` names the two sites, largest first, each within
/// 25% of what it holds; `--out` writes the profile, which `go tool pprof` reads and
/// `memquota profile FILE` reads back.
#[test]
fn profile_prints_the_top_sites_and_writes_the_profile() {
    let file = scratch("profile").join("heap.pb.gz");
    let (top, written) = while_sites_hold(&[("MEMQUOTA_PROFILE_SAMPLE", "16k")], |addr| {
        (
            memquota(&["profile", addr, "--top", "20"]),
            memquota(&["profile", addr, "--out", file.to_str().unwrap()]),
        )
    });
    let stdout = text(&top.stdout);
    assert_eq!(top.status.code(), Some(0), "{stdout}{}", text(&top.stderr));
    let rows: Vec<&str> = stdout.lines().skip(1).collect();
    assert!(rows.len() >= 2, "{stdout}");
    let within = |row: &str, expected: f64| {
        let words: Vec<&str> = row.split_whitespace().collect();
        let got = mib(&format!("{} {}", words[0], words[1]));
        got >= expected * 0.75 && got <= expected * 1.25
    };
    assert!(rows[0].contains(" big_site (sites.c:") && within(rows[0], 48.0), "{stdout}");
    assert!(rows[1].contains(" small_site (sites.c:") && within(rows[1], 8.0), "{stdout}");
    assert_eq!(written.status.code(), Some(0), "{}", text(&written.stderr));
    assert!(text(&written.stdout).contains(&format!("to {}", file.display())), "{}", text(&written.stdout));
    let (rows, pprof_top) = pprof::top(&file, "inuse_space");
    assert!(pprof::cum(&rows, "big_site").is_some_and(|b| b >= 36 << 20), "{pprof_top}");
    let again = memquota(&["profile", file.to_str().unwrap(), "--top", "1"]);
    let again = text(&again.stdout);
    assert_eq!(again.lines().count(), 2, "a heading and one site: {again}");
    assert!(again.contains(" big_site (sites.c:"), "{again}");
}

/// What cannot be read is said, with exit status 2: a profile turned off
/// (`MEMQUOTA_PROFILE_SAMPLE=0`, and how to turn it on), an address nothing listens
/// on, a file that is not a profile.
#[test]
fn profile_says_what_it_cannot_read() {
    let off = while_sites_hold(&[("MEMQUOTA_PROFILE_SAMPLE", "0")], |addr| memquota(&["profile", addr]));
    let stderr = text(&off.stderr);
    assert_eq!(off.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("503") && stderr.contains("MEMQUOTA_PROFILE_SAMPLE"), "{stderr}");
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let nobody = memquota(&["profile", &closed]);
    assert_eq!(nobody.status.code(), Some(2));
    assert!(
        text(&nobody.stderr).contains(&format!("connecting to {closed} failed")),
        "{}",
        text(&nobody.stderr)
    );
    let not_one = scratch("not-a-profile").join("x.pb.gz");
    std::fs::write(&not_one, b"memquota_native_bytes 1\n").unwrap();
    let out = memquota(&["profile", not_one.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("not a heap profile memquota wrote: it is not gzip"),
        "{}",
        text(&out.stderr)
    );
}
