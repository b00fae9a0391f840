//! A real JVM under libmemquota.so as preload and agent: the heap counts, GCs make
//! room for native memory, refusals are `OutOfMemoryError`s, flags come back, and
//! the agent speaks up about bad options and flags. Java sources are compiled here
//! with javac; every JVM runs under an outer `timeout`.
//!
//! Needs `cargo build --release` first (scripts/test.sh does it) and a JDK.

mod common;

use common::{assert_ok, build_dir, inherited_vars, lib, said, text};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The compiled classes: org.memquota's and the workloads.
fn classes() -> &'static Path {
    static CLASSES: OnceLock<PathBuf> = OnceLock::new();
    CLASSES.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let out = build_dir("jvm");
        let package = root.join("../bindings/java/org/memquota");
        let javac = Command::new("javac")
            .arg("-d")
            .arg(&out)
            .args(["MemQuota.java", "RetryOOM.java", "SplitAndRetryOOM.java"].map(|f| package.join(f)))
            .arg(root.join("tests/java/JvmWorkload.java"))
            .output()
            .expect("javac is missing: scripts/test.sh installs a JDK");
        assert_ok(&javac, "javac");
        out
    })
}

/// `java jvm_flags -agentpath:lib=agent -cp classes args`, preloaded, under `timeout`.
fn java(jvm_flags: &[&str], agent: &str, args: &[&str]) -> Output {
    java_with_env(&[], jvm_flags, agent, args)
}

/// [`java`] with `env` set (and no other `MEMQUOTA_*` from ours).
fn java_with_env(env: &[(&str, &str)], jvm_flags: &[&str], agent: &str, args: &[&str]) -> Output {
    let so = lib();
    let mut cmd = Command::new("timeout");
    cmd.arg("120").arg("env").arg(format!("LD_PRELOAD={}", so.display()));
    for (k, v) in env {
        cmd.arg(format!("{k}={v}"));
    }
    cmd.arg("java").args(jvm_flags);
    cmd.arg(format!("-agentpath:{}={agent}", so.display())).arg("-cp").arg(classes()).args(args);
    for var in inherited_vars() {
        cmd.env_remove(var);
    }
    cmd.output().unwrap()
}

/// The number after `key` in `text` (e.g. `"memquota gcs "`).
fn number_after(text: &str, key: &str) -> u64 {
    let at = text.find(key).unwrap_or_else(|| panic!("no {key:?} in:\n{text}")) + key.len();
    text[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

/// A field of the `stats {...}` JSON line the workloads print.
fn stat(text: &str, field: &str) -> u64 {
    stat_of(text, "stats", field)
}

/// A field of the `label {...}` JSON line the workloads print.
fn stat_of(text: &str, label: &str, field: &str) -> u64 {
    let start = format!("{label} {{");
    let json = &text[text.find(&start).unwrap_or_else(|| panic!("no {start} in:\n{text}"))..];
    number_after(json, &format!("\"{field}\":"))
}

#[test]
fn a_gc_shrinks_the_heap_to_make_room_for_direct_buffers_and_d_restores_both_flags() {
    const MIB: u64 = 1 << 20;
    const DIRECT: u64 = 200;
    const SHORT: u64 = 100;
    // 450 MiB of garbage grows the heap under a budget it cannot reach (so no reclaim
    // runs yet); then the workload sets the limit, from the budget's own figures, so
    // that 200 MiB of direct buffers fit only once the heap gives back 100 MiB. G1
    // with no concurrent cycle: a Remark would shrink the heap on its own, and then
    // the room would not be the GC we ran.
    let flags = [
        "-XX:+UseG1GC",
        "-XX:-G1UseAdaptiveIHOP",
        "-XX:InitiatingHeapOccupancyPercent=100",
        "-Xms64m",
        "-Xmx1g",
        "-XX:MinHeapFreeRatio=20",
        "-XX:MaxHeapFreeRatio=60",
    ];
    let args = ["JvmWorkload", "shrink", "450", &DIRECT.to_string(), &SHORT.to_string()];
    let out = java(&flags, "limit=2g", &args);
    assert_ok(&out, "shrink");
    let stdout = text(&out.stdout);
    // The precondition, on the figures the gate judges by: the buffers do not fit.
    let (limit, native, heap) = (
        stat_of(&stdout, "budget", "limit_bytes"),
        stat_of(&stdout, "budget", "native_bytes"),
        stat_of(&stdout, "budget", "heap_committed_bytes"),
    );
    assert!(native + heap + DIRECT * MIB > limit, "the buffers must not fit at first: {}", said(&out));
    assert!(stdout.contains(&format!("direct {DIRECT} MiB ok")), "{}", said(&out));
    let grown = number_after(&stdout, "heap committed grown ");
    let after = number_after(&stdout, ", after ");
    assert!(after + SHORT <= grown, "the heap must have given back the buffers' room: {}", said(&out));
    assert!(number_after(&stdout, "memquota gcs ") >= 1, "{}", said(&out));
    assert!(stat(&stdout, "reclaims_total_sync") + stat(&stdout, "reclaims_total_background") >= 1);
    assert_eq!(stat(&stdout, "oom_total"), 0, "{}", said(&out));
    // (d): both ratios are back to the values given on the command line.
    assert!(stdout.contains("ratios before 20/60 after 20/60"), "{}", said(&out));
}

#[test]
fn b_a_live_heap_too_big_refuses_with_an_out_of_memory_error_and_the_jvm_goes_on() {
    let out = java(&["-Xms64m", "-Xmx1g"], "limit=600m", &["JvmWorkload", "refuse", "450", "200"]);
    assert_ok(&out, "refuse");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        stdout.contains("refused: memquota: allocation refused: 200.0 MiB (209715200) requested"),
        "{}",
        said(&out)
    );
    assert!(stdout.contains("live 7200 arrays still held"), "{}", said(&out));
    assert!(stdout.contains("after refusal: direct 1048576"), "{}", said(&out));
    // The report went to stderr too, with the heap in it.
    assert!(stderr.contains("memquota: allocation refused") && stderr.contains("heap committed"), "{stderr}");
}

#[test]
fn c_eight_threads_mixing_heap_and_direct_buffers_make_progress_with_bounded_gcs() {
    let seconds = 20;
    let out =
        java(&["-Xms64m", "-Xmx512m"], "limit=1g", &["JvmWorkload", "mixed", &seconds.to_string(), "8"]);
    assert_ok(&out, "mixed");
    let stdout = text(&out.stdout);
    assert_eq!(number_after(&stdout, " ooms "), 0, "no false OOM: {}", said(&out));
    assert!(number_after(&stdout, "mixed direct ops ") > 100, "{}", said(&out));
    let (sync, background) =
        (stat(&stdout, "reclaims_total_sync"), stat(&stdout, "reclaims_total_background"));
    let gcs = number_after(&stdout, "memquota gcs ");
    // Each reclaim runs at most 4 GCs, and background ones are at least a second
    // apart.
    assert!(gcs <= 4 * (sync + background), "{gcs} GCs for {sync} + {background} reclaims");
    assert!(background <= seconds + 1, "{background} background reclaims in {seconds} s");
    assert_eq!(stat(&stdout, "oom_total"), 0);
}

#[test]
fn e_flags_that_keep_the_heap_from_shrinking_are_warned_about() {
    let flags = ["-Xms256m", "-Xmx256m", "-XX:+DisableExplicitGC", "-XX:+ExplicitGCInvokesConcurrent"];
    let out = java(&flags, "limit=2g", &["-version"]);
    assert_ok(&out, "java -version");
    let stderr = text(&out.stderr);
    for warning in [
        "memquota: warning: -Xms equals -Xmx",
        "memquota: warning: -XX:+DisableExplicitGC",
        "memquota: warning: -XX:+ExplicitGCInvokesConcurrent",
    ] {
        assert!(stderr.contains(warning), "no {warning:?} in:\n{stderr}");
    }
    let quiet = java(&["-Xms64m", "-Xmx256m"], "limit=2g", &["-version"]);
    assert!(!text(&quiet.stderr).contains("memquota: warning"), "{}", said(&quiet));
}

#[test]
fn f_bad_agent_options_stop_the_jvm_with_a_clear_error() {
    for (options, expected) in [
        ("limit=lots", "memquota agent: bad option limit=\"lots\": expected"),
        ("heap=some", "memquota agent: bad option heap=\"some\": expected committed or used"),
        ("colour=blue", "memquota agent: unknown option \"colour\"; known options: limit, heap, soft, on_oom, refuse_min, stats_file"),
        ("limit", "memquota agent: option \"limit\" has no value"),
    ] {
        let out = java(&[], options, &["-version"]);
        assert!(!out.status.success(), "{options}: {}", said(&out));
        assert!(text(&out.stderr).contains(expected), "{options}: {}", said(&out));
    }
}

#[test]
fn an_explicit_refuse_min_of_zero_means_zero_from_the_option_or_the_environment() {
    /// Agent options, environment, and the refuse_min the budget must run with.
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], u64);
    let cases: [Case; 5] = [
        ("limit=1g", &[], 4 << 20), // the preload's default, when nothing says otherwise
        ("limit=1g,refuse_min=0", &[], 0),
        ("limit=1g", &[("MEMQUOTA_REFUSE_MIN", "0")], 0),
        ("limit=1g,refuse_min=0", &[("MEMQUOTA_REFUSE_MIN", "8m")], 0), // the option wins
        ("limit=1g,refuse_min=64k", &[], 64 << 10),
    ];
    for (agent, env, expected) in cases {
        let out = java_with_env(env, &["-Xmx256m"], agent, &["JvmWorkload", "stats"]);
        assert_ok(&out, agent);
        assert_eq!(stat(&text(&out.stdout), "refuse_min"), expected, "{agent} {env:?}: {}", said(&out));
    }
}

/// Issue 10, the gate overshoot. **Fails until the gate reserves what it admits**:
/// today `Unsafe.allocateMemory`'s gate (`ld_preload/src/jvm/gate.rs`, through
/// `make_room` in `src/engine.rs`) checks that a request fits and reserves nothing,
/// so threads that pass the check before any of them has malloc'ed all get in. Each
/// round, 8 threads released by a barrier ask for 96 MiB each under a limit that, once
/// a GC has shrunk the heap, has room for about three; the workload keeps safepoints
/// coming (thread dumps), which hold a thread that passed the check at its entry
/// into the VM, before its malloc is counted. Measured before the fix, 20 rounds at a
/// time: no round over the bound without the safepoints (0 of 60), and 15-30% of
/// rounds over it with them, by up to all 8 requests.
#[test]
fn g_threads_released_together_at_the_gate_pass_the_limit_by_at_most_one_request() {
    const MIB: u64 = 1 << 20;
    const THREADS: u64 = 8;
    const REQUEST: u64 = 96;
    const ROUNDS: usize = 30;
    let args =
        ["JvmWorkload", "burst", &THREADS.to_string(), &REQUEST.to_string(), "200", &ROUNDS.to_string()];
    let out = java(&["-XX:+UseG1GC", "-Xms64m", "-Xmx512m"], "limit=4g,soft=1", &args);
    assert_ok(&out, "burst");
    let stdout = text(&out.stdout);
    let rounds: Vec<&str> = stdout.lines().filter(|l| l.starts_with("round ")).collect();
    assert_eq!(rounds.len(), ROUNDS, "{}", said(&out));
    let over: Vec<String> = rounds
        .iter()
        .filter_map(|line| {
            let (limit, native) = (number_after(line, " limit "), number_after(line, " native "));
            let bound = limit + number_after(line, " error_bound ") + REQUEST * MIB;
            (native > bound).then(|| {
                let past = (native - limit) / MIB;
                format!("{line}: {past} MiB past the limit")
            })
        })
        .collect();
    assert!(
        over.is_empty(),
        "native (every granted request still held) must stay within the limit + error bound + one \
         {REQUEST} MiB request; {} of {ROUNDS} rounds did not:\n{}",
        over.len(),
        over.join("\n")
    );
}

#[test]
fn the_agent_without_the_preload_refuses_and_says_how_to_preload() {
    let so = lib();
    let agent_alone = |tunables: Option<&str>| {
        let mut cmd = Command::new("timeout");
        cmd.arg("60").arg("env");
        if let Some(t) = tunables {
            cmd.arg(format!("GLIBC_TUNABLES={t}"));
        }
        cmd.arg("java").arg(format!("-agentpath:{}=limit=1g", so.display())).arg("-version");
        cmd.output().unwrap()
    };
    // glibc's default static TLS surplus is too small for the preload's initial-exec
    // TLS, so a JVM given the agent alone does not start at all.
    let out = agent_alone(None);
    assert!(!out.status.success(), "{}", said(&out));
    assert!(said(&out).contains("cannot allocate memory in static TLS block"), "{}", said(&out)); // the JVM's own line, on stdout
                                                                                                  // Where the library can be loaded, the agent itself refuses, saying how to preload.
    let out = agent_alone(Some("glibc.rtld.optional_static_tls=16384"));
    assert!(!out.status.success(), "{}", said(&out));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("libmemquota.so is not preloaded"), "{stderr}");
    let path = std::fs::canonicalize(&so).unwrap();
    assert!(stderr.contains(&format!("LD_PRELOAD={}", path.display())), "{stderr}");
}

#[test]
fn the_stats_file_shows_heap_and_native() {
    let file = std::env::temp_dir().join(format!("memquota-jvm-stats-{}.prom", std::process::id()));
    let agent = format!("limit=2g,heap=used,stats_file={}", file.display());
    let out = java(&["-Xms64m", "-Xmx512m"], &agent, &["JvmWorkload", "shrink", "100", "16"]);
    assert_ok(&out, "shrink");
    let prom = std::fs::read_to_string(&file).unwrap();
    let _ = std::fs::remove_file(&file);
    let value = |name: &str| -> f64 {
        prom.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .unwrap_or_else(|| panic!("no {name} in:\n{prom}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(value("memquota_heap_committed_bytes") > 0.0, "{prom}");
    assert!(value("memquota_heap_used_bytes") > 0.0, "{prom}");
    assert!(value("memquota_native_bytes") > 16.0 * 1048576.0, "{prom}");
    assert_eq!(value("memquota_limit_bytes"), 2.0 * 1073741824.0);
}

#[test]
fn task_scopes_from_java_attach_reserve_refuse_and_report_leaks() {
    let out = java(&["-Xmx256m"], "limit=1g", &["JvmWorkload", "scopes"]);
    assert_ok(&out, "scopes");
    let stdout = text(&out.stdout);
    for line in [
        "reserved 16 MiB",
        "reserve refused: memquota: allocation refused: 1.0 GiB (1073741824) requested",
        "report names the scope: true",
        "end: memquota: scope \"task-7\" (id 7) ended; managed memory leak detected: ",
        "16.0 MiB (16777216) still reserved (released)",
        "second end: memquota: the scope has ended",
        "held 4 buffers",
    ] {
        assert!(stdout.contains(line), "no {line:?} in {}", said(&out));
    }
    // The four 8 MiB direct buffers, three from the task's thread and one from its
    // helper, are what the scope still held: 32 MiB and the allocator's rounding.
    let leaked = number_after(&stdout, "managed memory leak detected: ");
    assert!((32..33).contains(&leaked), "leaked {leaked} MiB: {}", said(&out));
}

/// Issue 11: a task in `MemQuota.withRetry` under the agent gets `RetryOOM`, rolls
/// back and completes. Two tasks each hold a 64 MiB block of `Unsafe` memory and ask
/// for a second under a limit set 2.5 blocks above what is counted (the heap cannot
/// move: -Xms equals -Xmx), so neither second block fits and both tasks are blocked:
/// the retry machine rolls the younger back, the older gets its second block first
/// (the younger's attempt cannot start again until it frees both), then the younger
/// runs its attempt again and completes. Nothing is refused.
#[test]
fn a_task_in_with_retry_gets_retry_oom_rolls_back_and_completes() {
    let flags = ["-XX:+UseG1GC", "-Xms128m", "-Xmx128m"];
    let out = java(&flags, "limit=4g", &["JvmWorkload", "retry", "64"]);
    assert_ok(&out, "retry");
    let stdout = text(&out.stdout);
    for line in [
        "end outside a block: memquota: this thread is in no retry block",
        "last refusal outside a block: -1",
        "task 0 2 blocks attempts 1 rolled back 0",
        "task 1 2 blocks attempts 2 rolled back 1",
        "caught org.memquota.RetryOOM is an OutOfMemoryError: true: memquota: rolled back",
        "second blocks granted in order [0, 1]",
    ] {
        assert!(stdout.contains(line), "no {line:?} in {}", said(&out));
    }
    assert_eq!(stat(&stdout, "retry_total_retry"), 1, "{}", said(&out));
    assert!(stat(&stdout, "retry_waits_total") >= 2, "both tasks waited: {}", said(&out));
    assert_eq!(stat(&stdout, "retry_total_split"), 0, "{}", said(&out));
    assert_eq!(stat(&stdout, "retry_timeouts_total"), 0, "{}", said(&out));
    assert_eq!(stat(&stdout, "oom_total"), 0, "{}", said(&out));
}

/// `MemQuota.withSplitRetry` under the agent: 64 rows of 4 MiB under a limit 40 rows
/// above what is counted, one task: the gate throws `SplitAndRetryOOM` (no other task
/// can free anything) and the rows come back in two pieces, in order.
#[test]
fn with_split_retry_from_java_processes_pieces_in_order() {
    let flags = ["-XX:+UseG1GC", "-Xms128m", "-Xmx128m"];
    let out = java(&flags, "limit=4g", &["JvmWorkload", "split", "4"]);
    assert_ok(&out, "split");
    let stdout = text(&out.stdout);
    assert!(stdout.contains("pieces 0..32 32..64\n"), "{}", said(&out));
    assert_eq!(stat(&stdout, "retry_total_split"), 1, "{}", said(&out));
    assert_eq!(stat(&stdout, "retry_timeouts_total") + stat(&stdout, "oom_total"), 0, "{}", said(&out));
}
