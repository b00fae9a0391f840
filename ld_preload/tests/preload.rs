//! libmemquota.so under LD_PRELOAD: C and C++ programs compiled here and run with the
//! library preloaded, each under an outer `timeout` (a broken preload would hang a
//! preloaded `timeout` too), and real programs whose output must not change.
//!
//! Needs `cargo build --release` first (scripts/test.sh does it), gcc, g++, binutils
//! (`nm`, `readelf`), Debian's libjemalloc-dev for the jemalloc API tests, and
//! libc++-dev and libc++abi-dev for the test with two private C++ runtimes
//! (scripts/test.sh installs them).

mod common;
#[path = "../../tests/support/pprof.rs"]
mod pprof;

use common::{assert_ok, build_dir, compile, inherited_vars, lib, said, text, Metrics};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

struct Built {
    probe: PathBuf,
    scopes: PathBuf,
    retry: PathBuf,
    tls_lib: PathBuf,
    cxx: PathBuf,
    lazy: PathBuf,
    leader: PathBuf,
    unwind: PathBuf,
    sites: PathBuf,
}

fn built() -> &'static Built {
    static BUILT: OnceLock<Built> = OnceLock::new();
    BUILT.get_or_init(|| {
        let out = build_dir("preload");
        let b = Built {
            probe: out.join("probe"),
            scopes: out.join("scopes"),
            retry: out.join("retry"),
            tls_lib: out.join("libtls.so"),
            cxx: out.join("cxx"),
            lazy: out.join("lazy"),
            leader: out.join("leader"),
            unwind: out.join("unwind"),
            sites: out.join("sites"),
        };
        compile("gcc", &["-O1", "-g", "-Wall", "-pthread", "scopes.c"], &b.scopes);
        compile("gcc", &["-O1", "-g", "-Wall", "-Werror", "-pthread", "retry.c"], &b.retry);
        compile("gcc", &["-O1", "-g", "-w", "-pthread", "probe.c", "-ldl"], &b.probe);
        compile("gcc", &["-O1", "-shared", "-fPIC", "tls_lib.c"], &b.tls_lib);
        compile("g++", &["-O1", "-std=c++17", "cxx.cc"], &b.cxx);
        compile("gcc", &["-O1", "-g", "-Wall", "-Werror", "-pthread", "lazy.c"], &b.lazy);
        compile("gcc", &["-O1", "-g", "-Wall", "-Werror", "-pthread", "leader.c"], &b.leader);
        compile("gcc", &["-O1", "-g", "-Wall", "-Werror", "unwind.c"], &b.unwind);
        compile("gcc", &["-O1", "-g", "-Wall", "-Werror", "sites.c"], &b.sites);
        b
    })
}

/// Programs linked with Debian's jemalloc (`-ljemalloc`): `jemapi` uses jemalloc's
/// own API; `jemapi_conf` also compiles a `malloc_conf` in.
struct LinkedWithJemalloc {
    jemapi: PathBuf,
    jemapi_conf: PathBuf,
}

fn linked_with_jemalloc() -> &'static LinkedWithJemalloc {
    static BUILT: OnceLock<LinkedWithJemalloc> = OnceLock::new();
    BUILT.get_or_init(|| {
        assert!(
            Path::new("/usr/include/jemalloc/jemalloc.h").exists(),
            "jemalloc's header is missing: install libjemalloc-dev (scripts/test.sh does)"
        );
        let out = build_dir("jemapi");
        let b = LinkedWithJemalloc { jemapi: out.join("jemapi"), jemapi_conf: out.join("jemapi_conf") };
        let flags = ["-O1", "-g", "-Wall", "-Werror", "-pthread"];
        compile("gcc", &[&flags[..], &["jemapi.c", "-ljemalloc"]].concat(), &b.jemapi);
        compile(
            "gcc",
            &[&flags[..], &["-DPROGRAM_MALLOC_CONF", "jemapi.c", "-ljemalloc"]].concat(),
            &b.jemapi_conf,
        );
        b
    })
}

/// The jemalloc variables a test must not inherit either.
const JEMALLOC_VARS: [&str; 2] = ["MALLOC_CONF", "_RJEM_MALLOC_CONF"];

/// Runs `program args` with `env` set and no preload, under `timeout`.
fn plain(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "10", "120", "env"]);
    for (k, v) in env {
        cmd.arg(format!("{k}={v}"));
    }
    for var in inherited_vars().chain(JEMALLOC_VARS).chain(["LD_PRELOAD"]) {
        cmd.env_remove(var);
    }
    cmd.arg(program).args(args).output().unwrap()
}

/// Runs `program args` with the library preloaded and `env` set, under `timeout 120`
/// (and a KILL 10 s later: a program deadlocked with its signals blocked ignores TERM).
fn preloaded(program: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "10", "120", "env"]).arg(format!("LD_PRELOAD={}", lib().display()));
    for (k, v) in env {
        cmd.arg(format!("{k}={v}"));
    }
    for var in inherited_vars().chain(JEMALLOC_VARS) {
        cmd.env_remove(var);
    }
    cmd.arg(program).args(args).output().unwrap()
}

fn probe(mode: &[&str], env: &[(&str, &str)]) -> Output {
    preloaded(&built().probe, mode, env)
}

/// The exported functions' names.
fn exports() -> BTreeSet<String> {
    entry_addresses().into_keys().collect()
}

/// Where each exported function starts, by name.
fn entry_addresses() -> BTreeMap<String, u64> {
    entry_extents().into_iter().map(|(name, (at, _))| (name, at)).collect()
}

/// Where each exported function starts and how many bytes of code it has, by name.
fn entry_extents() -> BTreeMap<String, (u64, u64)> {
    let out = Command::new("nm").args(["-D", "-S", "--defined-only"]).arg(lib()).output().unwrap();
    assert_ok(&out, "nm");
    let hex = |v: &str| u64::from_str_radix(v, 16).unwrap();
    text(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f[..] {
                [at, size, "T", name] => Some((name.to_owned(), (hex(at), hex(size)))),
                [at, "T", name] => Some((name.to_owned(), (hex(at), 0))),
                _ => None,
            }
        })
        .collect()
}

/// The code ranges that the library's unwind table describes: one per FDE in
/// `readelf --debug-dump=frames`, as `start..end`.
fn unwind_ranges() -> Vec<std::ops::Range<u64>> {
    let out = Command::new("readelf").arg("--debug-dump=frames").arg(lib()).output().unwrap();
    assert_ok(&out, "readelf --debug-dump=frames");
    let ranges: Vec<_> = text(&out.stdout)
        .lines()
        .filter(|l| l.contains(" FDE "))
        .filter_map(|l| {
            let (lo, hi) = l.split_once("pc=")?.1.split_once("..")?;
            Some(u64::from_str_radix(lo, 16).unwrap()..u64::from_str_radix(hi.trim(), 16).unwrap())
        })
        .collect();
    assert!(!ranges.is_empty(), "no FDE in readelf's output:\n{}", text(&out.stdout));
    ranges
}

/// A profiler that samples a PC inside a function with no unwind info, or a
/// `backtrace()` from a signal handler that lands there, stops at it. malloc and free
/// are written in assembly (`src/malloc/exports.rs`), where the compiler adds none by
/// itself: every exported function's code must lie inside one FDE.
#[test]
fn every_exported_function_has_unwind_info() {
    let fdes = unwind_ranges();
    let missing: Vec<String> = entry_extents()
        .into_iter()
        .filter(|(_, (at, size))| !fdes.iter().any(|r| r.start <= *at && at + size.max(&1) <= r.end))
        .map(|(name, (at, size))| format!("{name} at {at:#x} ({size} bytes)"))
        .collect();
    assert!(missing.is_empty(), "exported functions no FDE covers: {missing:#?}");
}

/// What the unwind info is for, checked end to end: the trap flag single-steps
/// malloc and free, and at each of their instructions `backtrace()` from the
/// SIGTRAP handler must reach the caller's return address (tests/c/unwind.c).
#[test]
fn backtrace_from_a_signal_handler_inside_malloc_and_free_reaches_their_caller() {
    let out = preloaded(&built().unwind, &[], &[]);
    assert_ok(&out, "unwind");
    let stdout = text(&out.stdout);
    for name in ["malloc", "free"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("no {name} line: {}", common::said(&out)));
        let numbers: Vec<u32> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
        let [stepped, unwound] = numbers[..] else { panic!("{line}") };
        assert!(stepped > 0 && !line.contains("never left"), "{line}");
        assert_eq!(unwound, stepped, "{line}");
    }
}

/// Where `malloc` and `free` start in a cache line moved the small-object benchmark
/// by 7-15% at the same instruction count (docs/benchmarks.md, "Code placement").
/// Their assembly is placed by a section of its own per entry that memquota aligns
/// (`src/malloc/exports.rs`); this fails if a build puts the alignment and the code apart.
#[test]
fn malloc_and_free_start_on_a_cache_line() {
    let at = entry_addresses();
    for name in ["malloc", "free", "__libc_malloc", "__libc_free", "cfree"] {
        let a = at[name];
        assert_eq!(a % 64, 0, "{name} starts at {a:#x}, {} bytes into a 64-byte line", a % 64);
    }
}

/// jemalloc's own API, as `libjemalloc.so.2` exports it.
const JEMALLOC_API: [&str; 11] = [
    "mallocx",
    "rallocx",
    "xallocx",
    "sallocx",
    "dallocx",
    "sdallocx",
    "nallocx",
    "mallctl",
    "mallctlnametomib",
    "mallctlbymib",
    "malloc_stats_print",
];

#[test]
fn exports_the_full_malloc_family_jemallocs_api_and_all_20_cxx_operators() {
    let have = exports();
    let required = [
        "malloc",
        "free",
        "calloc",
        "realloc",
        "reallocarray",
        "posix_memalign",
        "aligned_alloc",
        "memalign",
        "valloc",
        "pvalloc",
        "malloc_usable_size",
        "cfree",
        "__libc_malloc",
        "__libc_calloc",
        "__libc_realloc",
        "__libc_free",
        "__libc_memalign",
        "__libc_valloc",
        "__libc_pvalloc",
        "__posix_memalign",
        "free_sized",
        "free_aligned_sized",
        "mallopt",
        "malloc_trim",
        "mallinfo",
        "mallinfo2",
        "malloc_stats",
        "malloc_info",
    ];
    for name in required.into_iter().chain(JEMALLOC_API) {
        assert!(have.contains(name), "{name} is not exported");
    }
    let cxx: Vec<_> = have.iter().filter(|n| n.starts_with("_Zn") || n.starts_with("_Zd")).collect();
    assert_eq!(cxx.len(), 20, "all 20 operators or none: {cxx:?}");
    // Nothing of jemalloc's internals leaks out, prefixed or not, nor the link's
    // wrapper of secure_getenv (malloc_conf.rs).
    let stray: Vec<_> = have
        .iter()
        .filter(|n| ["je_", "_rjem_", "__wrap_", "__real_"].iter().any(|p| n.starts_with(p)))
        .collect();
    assert!(stray.is_empty(), "stray exports: {stray:?}");
}

#[test]
fn exports_every_function_debians_libjemalloc_exports() {
    let debian = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";
    assert!(
        Path::new(debian).exists(),
        "{debian} is missing: install libjemalloc-dev (scripts/test.sh does)"
    );
    let out = Command::new("nm").args(["-D", "--defined-only", debian]).output().unwrap();
    assert_ok(&out, "nm libjemalloc.so.2");
    let theirs: BTreeSet<String> = text(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, kind, name) = (f.next()?, f.next()?, f.next()?);
            (kind == "T").then(|| name.to_owned())
        })
        .collect();
    assert!(theirs.len() >= 30 && theirs.contains("mallocx"), "the list is read: {theirs:?}");
    let missing: Vec<_> = theirs.difference(&exports()).cloned().collect();
    assert!(
        missing.is_empty(),
        "a program linked with jemalloc would reach a second jemalloc for {missing:?}"
    );
}

#[test]
fn header_matches_the_c_abi_exports() {
    let header =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/memquota.h")).unwrap();
    let declared: BTreeSet<String> = header
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("memquota_") && *w != "memquota_reclaim_fn")
        .map(str::to_owned)
        .collect();
    let exported: BTreeSet<String> = exports().into_iter().filter(|n| n.starts_with("memquota_")).collect();
    assert_eq!(declared, exported);
    for name in
        ["memquota_stats_json", "memquota_set_heap_bytes", "memquota_set_limit", "memquota_on_reclaim"]
    {
        assert!(exported.contains(name), "{name}");
    }
}

#[test]
fn scopes_through_the_c_abi() {
    let out = preloaded(&built().scopes, &[], &[]);
    assert_ok(&out, "scopes");
    let stdout = text(&out.stdout);
    let value = |key: &str| value_of(&stdout, key);
    assert_eq!(value("reserve"), (8 << 20).to_string());
    assert_eq!(value("partial"), (1 << 20).to_string());
    // 100 blocks of 1000 bytes (1024 usable) are left; both big blocks were freed on
    // other threads and credited to the task.
    assert_eq!(value("leaked"), (100 * 1024).to_string(), "{stdout}");
    let report = value("report");
    assert!(
        report.contains("scope \"c-task\" (id 42) ended; managed memory leak detected: 100.0 KiB"),
        "{report}"
    );
    assert!(report.contains("1.0 MiB (1048576) still reserved"), "{report}");
    assert_eq!(value("end_again"), (-libc::EINVAL).to_string());
    assert_eq!(value("attach_ended"), libc::EINVAL.to_string());
    assert_eq!(value("reserve_ended"), (-libc::EINVAL).to_string());
    assert_eq!(value("conversion_leaked"), "0", "{stdout}");
}

/// Issue 11: retry blocks from C, with the defaults a user gets. Four tasks, each in a
/// retry block, hold 32 MiB beside 100 MiB held outside any scope under 256 MiB, then
/// each asks for 32 MiB more (a barrier makes every task hold its first before any
/// asks): none fits, every task is blocked, and the youngest is rolled back, seen as
/// `-EAGAIN` from `memquota_scope_reserve` in one round and as a null from malloc
/// with `memquota_last_refusal() == MEMQUOTA_REFUSAL_ROLLBACK` in the other; it frees
/// its first block, waits in `memquota_retry_block` and completes; every task does.
/// Then one task's input that cannot fit splits (`-E2BIG`) into pieces that do,
/// in order; a malloc bigger than the pool is a null with `MEMQUOTA_REFUSAL_SPLIT`,
/// and a later plain refusal reads as `MEMQUOTA_REFUSAL_NONE`. Also the edges: codes
/// outside a block, an ended scope, nesting, depth, a thread exiting inside a block.
#[test]
fn retry_blocks_through_the_c_abi_roll_back_split_and_complete() {
    let out = preloaded(&built().retry, &[], &[("MEMQUOTA_LIMIT", "256m")]);
    assert_ok(&out, "retry");
    let stdout = text(&out.stdout);
    let value = |key: &str| value_of(&stdout, key);
    let field = |line: &str, name: &str| -> i64 {
        let at =
            line.find(&format!("{name} ")).unwrap_or_else(|| panic!("no {name} in {line}")) + name.len() + 1;
        line[at..].split(' ').next().unwrap().parse().unwrap()
    };
    let stat = |name: &str| -> u64 {
        let json = value("stats");
        let key = format!("\"{name}\":");
        let at = json.find(&key).unwrap_or_else(|| panic!("no {key} in {json}")) + key.len();
        json[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    // The edges. The 3 MiB block taken after three nested blocks ended went to the
    // scope the thread was in before them.
    assert_eq!(value("nested_leaked"), format!("{},0", 3 << 20), "{stdout}");
    assert_eq!(value("max_depth"), "16");
    assert_eq!(value("exited_inside"), "running 0 blocks 0", "the exited thread's slot is free");
    for round in ["reserve", "malloc"] {
        let task = |i: usize| value(&format!("{round}_task{i}"));
        // Which task gets memory first once the youngest gave way is a race between
        // the woken ones (the machine ranks who may try, the account's CAS decides):
        // not asserted. Who rolls back is the machine's rule.
        assert_eq!(field(&task(0), "rolled"), 0, "{round}: the oldest is never rolled back: {stdout}");
        let youngest = task(3);
        assert!(field(&youngest, "rolled") >= 1, "{round}: the youngest rolls back: {stdout}");
        for i in 0..4 {
            assert_eq!(field(&task(i), "attempts"), field(&task(i), "rolled") + 1, "{stdout}");
        }
        if round == "malloc" {
            assert_eq!(field(&youngest, "errno"), i64::from(libc::ENOMEM), "malloc keeps its contract");
        }
    }
    assert_eq!(value("pieces"), "0..32,32..64", "whole pieces, in order: {stdout}");
    assert_eq!(value("e2big"), "1");
    let (split, none) = (2, 0); // MEMQUOTA_REFUSAL_SPLIT, MEMQUOTA_REFUSAL_NONE
    assert_eq!(
        value("huge"),
        format!("null errno {} why {split} after_block {none}", libc::ENOMEM),
        "{stdout}"
    );
    assert_eq!(value("plain"), format!("null why {none}"), "a plain refusal is not a split: {stdout}");
    // Every task completed: no watchdog, and the one refusal is the plain one above.
    assert!(stat("retry_total_retry") >= 2, "{stdout}");
    assert_eq!(stat("retry_timeouts_total"), 0, "{stdout}");
    assert_eq!(stat("oom_total"), 1, "{stdout}");
    assert_eq!(stat("retry_threads_running") + stat("blocked_threads"), 0, "every block ended");
}

/// Issue 30, item 5, through the C ABI (`retry.c ends`). A scope ends while two of its
/// threads wait in retry blocks (a malloc and a reservation of 200 MiB beside 100 MiB
/// held outside, under 256 MiB; a third thread attached outside any block keeps the
/// machine from acting, so only the 10 s watchdog would end the waits): both wake at
/// once, the malloc with NULL, `ENOMEM` and `MEMQUOTA_REFUSAL_SCOPE_ENDED`, the
/// reservation with `-EINVAL`. Then a thread attached to S for its life ends a retry
/// block of T from a thread-specific-data destructor that runs after the preload's
/// exit flush: the dead thread must not be put back into S, which would narrow a new
/// scope's fair share to half the pool for ever.
#[test]
fn ends_from_elsewhere_wake_waiters_and_leave_no_thread_attached() {
    let out = preloaded(&built().retry, &["ends"], &[("MEMQUOTA_LIMIT", "256m")]);
    assert_ok(&out, "retry ends");
    let stdout = text(&out.stdout);
    let value = |key: &str| value_of(&stdout, key);
    let ms = |line: &str| -> u64 { line.rsplit(' ').next().unwrap().parse().unwrap() };
    println!("{stdout}");
    let scope_ended = 3; // MEMQUOTA_REFUSAL_SCOPE_ENDED
    let (malloc, reserve) = (value("ended_malloc"), value("ended_reserve"));
    assert!(
        malloc.starts_with(&format!("granted 0 errno {} why {scope_ended} ms ", libc::ENOMEM)),
        "{stdout}"
    );
    assert!(reserve.starts_with(&format!("got {} why {scope_ended} ms ", -libc::EINVAL)), "{stdout}");
    assert!(ms(&malloc) < 2000 && ms(&reserve) < 2000, "woken at once, not by the watchdog: {stdout}");
    assert_eq!(value("late_end"), format!("rc 0 after_flush 1 share {}", 200 << 20), "{stdout}");
}

#[test]
fn every_entry_point_is_counted_exactly_and_behaves_like_glibc() {
    let out = probe(&["entry"], &[]);
    assert_ok(&out, "entry");
    assert!(text(&out.stdout).starts_with("native_before="));
}

#[test]
fn cross_thread_frees_are_exact() {
    assert_ok(&probe(&["threads"], &[]), "threads");
}

/// `lazy.c MODE` under a 1 GiB limit (threshold 256 KiB, the hook's interval 128 KiB),
/// checked: it ran to its end.
fn lazy(mode: &str) {
    let out = preloaded(&built().lazy, &[mode], &[("MEMQUOTA_LIMIT", "1g")]);
    assert_ok(&out, mode);
    assert_eq!(text(&out.stdout), format!("ok {mode}\n"));
}

/// Frees credited in bulk (`lazy_free.rs`): four threads, each lazy, free ~35 MiB
/// another thread allocated and stay alive: the count is off by less than their slacks
/// and lags (the hook credited them as they freed), exact once each flushes; a second
/// round freed just before they exit is exact after the join (the exit flush).
#[test]
fn lazy_frees_of_other_threads_blocks_lag_by_less_than_the_interval_and_flush_exactly() {
    lazy("threads");
}

/// Small mallocs charged in bulk (`lazy.rs`): a lazy thread allocates ~180 MiB, four
/// blocks in five under 4 KiB (tail calls into jemalloc) and the rest charged before
/// they are taken, and holds it. At each of 600 looks memquota counts less than is
/// held by less than the thread's slack (what waits for jemalloc's hook is kept out of
/// its room for charges), and more by less than its lag; exact once it flushes, and
/// after it frees everything lazily and exits.
#[test]
fn lazy_mallocs_are_counted_short_by_less_than_the_slack_and_flush_exactly() {
    lazy("mallocs");
}

/// Lazy threads mixing realloc (grow, shrink, move, to 0, of other threads' blocks),
/// calloc and aligned blocks with their frees: exact once each flushes, and after they
/// exit.
/// Lazy reallocs that take the account past the limit (`lazy.c past`): jemalloc's
/// `realloc` fires its allocated total's event before it adds the old size to the
/// freed total; the hook that turns the thread eager there must not leave that old
/// size uncounted. Exact after the flush and after the exit.
#[test]
fn lazy_reallocs_past_the_limit_are_exact() {
    lazy("past");
}

#[test]
fn lazy_frees_mixed_with_realloc_are_exact() {
    lazy("realloc");
}

/// A thread lazy before any scope begins frees a scope's big block: its owner record
/// credits the scope (the scope ends holding nothing). A lazy thread that attaches to a
/// scope with frees not yet credited: they are the process's, not the scope's.
#[test]
fn lazy_frees_leave_scopes_exact() {
    lazy("scopes");
}

/// A lazy thread under a limit lowered so far that its new slack is under the hook's
/// interval: its next slow path ends its lazy frees, so no thread's lag passes its
/// slack (the error bound shrinks with the limit), and the count stays exact.
#[test]
fn a_lowered_limit_ends_lazy_frees() {
    lazy("limit");
}

#[test]
fn fork_child_allocates_and_parent_is_unaffected() {
    assert_ok(&probe(&["fork"], &[]), "fork");
}

#[test]
fn thread_exit_storm_is_exact() {
    assert_ok(&probe(&["storm"], &[]), "storm");
}

#[test]
fn dlopen_of_a_library_with_tls_does_not_recurse() {
    let lib = built().tls_lib.to_str().unwrap().to_owned();
    let out = probe(&["dlopen", &lib], &[]);
    assert_ok(&out, "dlopen");
    assert!(text(&out.stdout).contains("dlopen ok"));
}

#[test]
fn over_the_limit_malloc_returns_null_with_a_report() {
    let out = probe(&["oom"], &[("MEMQUOTA_LIMIT", "256m")]);
    assert_ok(&out, "oom");
    let stdout = text(&out.stdout);
    assert!(stdout.contains("refused_errno=ENOMEM"), "{stdout}");
    let granted: u32 = stdout.split("granted=").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!((1..=4).contains(&granted), "{granted} blocks of 64 MiB under 256 MiB");
    let stderr = text(&out.stderr);
    assert!(stderr.contains("memquota: allocation refused: 64.0 MiB (67108864) requested"), "{stderr}");
    assert!(stderr.contains("limit            256.0 MiB"), "{stderr}");
}

#[test]
fn abort_policy_prints_the_report_and_aborts() {
    let out = probe(&["oom"], &[("MEMQUOTA_LIMIT", "256m"), ("MEMQUOTA_ON_OOM", "abort")]);
    use std::os::unix::process::ExitStatusExt;
    // `timeout` passes the child's signal on as 128 + signal.
    let aborted =
        out.status.signal() == Some(libc::SIGABRT) || out.status.code() == Some(128 + libc::SIGABRT);
    assert!(aborted, "{:?}", out.status);
    assert!(text(&out.stderr).contains("policy           abort"));
}

#[test]
fn bad_env_values_exit_2_with_one_clear_line() {
    for (var, value) in [
        ("MEMQUOTA_LIMIT", "lots"),
        ("MEMQUOTA_ON_OOM", "maybe"),
        ("MEMQUOTA_SOFT_RATIO", "7"),
        ("MEMQUOTA_REFUSE_MIN", "small"),
        ("MEMQUOTA_STATS_INTERVAL", "1ms"),
        ("MEMQUOTA_REPORT", "sometimes"),
    ] {
        let out = probe(&["entry"], &[(var, value)]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {stderr}");
        assert!(out.stdout.is_empty(), "{var}={value}: the program ran");
        assert!(stderr.contains(var) && stderr.contains(value) && stderr.contains("expected"), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
    }
}

#[test]
fn stats_file_and_exit_report() {
    let file = std::env::temp_dir().join(format!("memquota-stats-{}.prom", std::process::id()));
    let out = probe(
        &["threads"],
        &[
            ("MEMQUOTA_STATS_FILE", file.to_str().unwrap()),
            ("MEMQUOTA_REPORT", "exit"),
            ("MEMQUOTA_LIMIT", "2g"),
        ],
    );
    assert_ok(&out, "threads with stats");
    let prom = std::fs::read_to_string(&file).unwrap();
    for metric in
        ["memquota_limit_bytes 2147483648", "memquota_native_peak_bytes", "memquota_process_rss_bytes"]
    {
        assert!(prom.contains(metric), "{metric} missing:\n{prom}");
    }
    assert!(text(&out.stderr).contains("memquota summary"), "{}", text(&out.stderr));
    let _ = std::fs::remove_file(file);
}

#[test]
fn a_smaller_process_leaves_the_stats_file_of_a_bigger_one() {
    use std::time::{Duration, SystemTime};
    let file = std::env::temp_dir().join(format!("memquota-stats-owner-{}.prom", std::process::id()));
    let env = [("MEMQUOTA_STATS_FILE", file.to_str().unwrap()), ("MEMQUOTA_LIMIT", "2g")];
    // This test process plays the bigger one (Spark's executor, say): it runs, and its
    // peak RSS is far above what `true` reaches. `true` writes once, at exit.
    let me = std::process::id();
    let start = memquota_core::seam::process::running_since(me).unwrap();
    let by = |start: u64, rss_peak: u64| {
        format!("# memquota writer pid={me} start={start} rss_peak={rss_peak}\nmemquota_limit_bytes 1\n")
    };
    // The file as `before`, last written at `when` (a minute ago: before `true`
    // starts; in a minute: after), then `true` run with it.
    let run_true = |before: &str, when: SystemTime| {
        std::fs::write(&file, before).unwrap();
        std::fs::File::options().write(true).open(&file).unwrap().set_modified(when).unwrap();
        assert_ok(&preloaded(Path::new("true"), &[], &env), "true");
        std::fs::read_to_string(&file).unwrap()
    };
    let (earlier, later) =
        (SystemTime::now() - Duration::from_secs(60), SystemTime::now() + Duration::from_secs(60));
    let bigger = by(start, 1 << 40);
    assert_eq!(
        run_true(&bigger, earlier),
        bigger,
        "a smaller child replaced a running bigger process's figures"
    );
    // A bigger process that ended (another process had this pid: another start time)
    // after writing since `true` started: its last figures stay.
    let ended = by(start + 1, 1 << 40);
    assert_eq!(
        run_true(&ended, later),
        ended,
        "a smaller process's exit replaced a bigger one's last figures"
    );
    // Replaced: that bigger process wrote before `true` started (an earlier run), or
    // the writer is smaller.
    for (before, when) in [(ended, earlier), (by(start, 1), later)] {
        let after = run_true(&before, when);
        let first = after.lines().next().unwrap();
        assert!(
            first.starts_with("# memquota writer pid=") && !first.contains(&format!("pid={me} ")),
            "{after}"
        );
        assert_eq!(Metrics::parse(&after).get("memquota_limit_bytes"), (2u64 << 30) as f64, "{after}");
    }
    let _ = std::fs::remove_file(file);
}

/// A stats file's writer is still running while any of its threads runs: a process
/// whose main thread called `pthread_exit` shows as a zombie in `/proc` (state `Z`)
/// until its last thread ends, and the stats file must not take it for one that has
/// exited (`host::running_since`, which `stats_file.rs` asks).
#[test]
fn a_process_whose_main_thread_ended_still_runs() {
    use memquota_core::seam::process::running_since;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let mut child = Command::new(&built().leader).stdin(Stdio::piped()).spawn().unwrap();
    let pid = child.id();
    let start = running_since(pid).expect("the child runs");
    // The precondition, waited for with a deadline: the main thread has ended.
    let state = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while state() != 'Z' {
        assert!(Instant::now() < deadline, "the main thread did not end in 10 s");
        std::thread::sleep(Duration::from_millis(5)); // polling the state, with a deadline
    }
    assert_eq!(running_since(pid), Some(start), "a process with a thread running was read as ended");
    // Closing its input lets its other thread end the process.
    drop(child.stdin.take());
    // Waits for the exit without reaping: the process stays a zombie until wait().
    // SAFETY: siginfo_t is plain old data; waitid writes it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid on our own child, with a valid out-pointer.
    let r = unsafe { libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT) };
    assert_eq!(r, 0);
    assert_eq!(running_since(pid), None, "an exited process was read as running");
    assert!(child.wait().unwrap().success());
}

/// The pids of the exit summaries in `stderr`, in order.
fn summaries(stderr: &str) -> Vec<u32> {
    stderr
        .split("memquota summary (pid ")
        .skip(1)
        .map(|rest| rest.split(')').next().unwrap().parse().unwrap())
        .collect()
}

/// The number after `key ` on a line of `stdout`.
fn pid_after(stdout: &str, key: &str) -> u32 {
    let line = stdout.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("{key}: {stdout}"));
    line.trim().parse().unwrap()
}

#[test]
fn the_exit_summary_survives_programs_that_close_stderr_at_exit() {
    // Both close stdout and stderr in an atexit handler that runs before ours.
    for program in ["ls", "/bin/echo"] {
        let out = preloaded(Path::new(program), &["/"], &[("MEMQUOTA_REPORT", "exit")]);
        assert_ok(&out, program);
        let stderr = text(&out.stderr);
        assert_eq!(summaries(&stderr).len(), 1, "{program}: {stderr}");
    }
}

#[test]
fn the_exit_summary_of_a_shell_is_the_top_process_only() {
    // Two children, exec'd with the preload and the variable inherited, that keep
    // their stderr open to the end (so a summary of theirs would show); the shell's
    // last command is a builtin, so the shell itself exits (not exec'd away).
    let probe = built().probe.display();
    let script = format!("{probe} entry >/dev/null; {probe} threads >/dev/null; echo top $$");
    let script = script.as_str();
    let out = preloaded(Path::new("bash"), &["-c", script], &[("MEMQUOTA_REPORT", "exit")]);
    assert_ok(&out, "bash");
    let top = pid_after(&text(&out.stdout), "top ");
    assert_eq!(summaries(&text(&out.stderr)), [top], "{}", text(&out.stderr));
    // Each child may opt in.
    let out = preloaded(Path::new("bash"), &["-c", script], &[("MEMQUOTA_REPORT", "exit-all")]);
    assert_ok(&out, "bash");
    let top = pid_after(&text(&out.stdout), "top ");
    let pids = summaries(&text(&out.stderr));
    assert_eq!(pids.len(), 3, "{}", text(&out.stderr));
    assert_eq!(pids.iter().collect::<BTreeSet<_>>().len(), 3, "three processes: {pids:?}");
    assert_eq!(pids.last(), Some(&top), "the shell exits last: {pids:?}");
}

#[test]
fn the_exit_summary_of_a_forking_program_is_the_parents_only() {
    // The child ends with exit(), so it runs the atexit handler it inherited.
    let out = probe(&["fork_exit"], &[("MEMQUOTA_REPORT", "exit")]);
    assert_ok(&out, "fork_exit");
    let parent = pid_after(&text(&out.stdout), "parent ");
    assert_eq!(summaries(&text(&out.stderr)), [parent], "{}", text(&out.stderr));
    let out = probe(&["fork_exit"], &[("MEMQUOTA_REPORT", "exit-all")]);
    assert_ok(&out, "fork_exit");
    let pids = summaries(&text(&out.stderr));
    assert_eq!(pids.len(), 2, "{}", text(&out.stderr));
    assert_eq!(pids.last(), Some(&pid_after(&text(&out.stdout), "parent ")));
}

#[test]
fn cxx_sized_and_aligned_new_delete_are_exact_and_refusal_throws_bad_alloc() {
    let out = preloaded(&built().cxx, &["throw"], &[("MEMQUOTA_LIMIT", "1g")]);
    assert_ok(&out, "cxx");
    let stdout = text(&out.stdout);
    assert!(stdout.contains("bad_alloc caught"), "{stdout}");
}

/// A C host with no C++ runtime of its own (tests/c/cxx_host.c) and the C++ library it
/// dlopens (tests/c/cxx_lib.cc), built on libstdc++ with g++; `libcxx` is the same
/// library built on LLVM's libc++, when [`cxx_on_libcxx`] asks for it.
struct CxxHost {
    host: PathBuf,
    libstdcxx: PathBuf,
}

fn cxx_host() -> &'static CxxHost {
    static BUILT: OnceLock<CxxHost> = OnceLock::new();
    BUILT.get_or_init(|| {
        let out = build_dir("cxx-host");
        let b = CxxHost { host: out.join("cxx_host"), libstdcxx: out.join("libcxx_lib.so") };
        compile("gcc", &["-O1", "-g", "-Wall", "-Werror", "cxx_host.c", "-ldl"], &b.host);
        compile("g++", &["-O1", "-std=c++17", "-shared", "-fPIC", "-pthread", "cxx_lib.cc"], &b.libstdcxx);
        b
    })
}

/// tests/c/cxx_lib.cc on LLVM's libc++ (Debian's libc++-dev and libc++abi-dev), built
/// by g++ with libc++'s headers: no clang needed.
fn cxx_on_libcxx() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        assert!(
            Path::new("/usr/include/c++/v1/new").exists(),
            "libc++'s headers are missing: install libc++-dev and libc++abi-dev (scripts/test.sh does)"
        );
        let lib = build_dir("cxx-host").join("libcxx_lib_on_libcxx.so");
        let flags =
            ["-O1", "-std=c++17", "-shared", "-fPIC", "-nostdinc++", "-isystem", "/usr/include/c++/v1"];
        let link = ["-nodefaultlibs", "cxx_lib.cc", "-lc++", "-lc++abi", "-lc", "-lgcc_s"];
        compile("g++", &[&flags[..], &link[..]].concat(), &lib);
        lib
    })
}

/// The host, under a 64 MiB limit, calling `function` of each library loaded `how`
/// (`local` or `global`); its output must be one line per library, `<lib> <function>:
/// <what it said>`, and what each said is returned in order.
fn cxx_host_says(how: &str, function: &str, libraries: &[&Path]) -> Vec<String> {
    let mut args = vec![how, function];
    args.extend(libraries.iter().map(|l| l.to_str().unwrap()));
    let out = preloaded(&cxx_host().host, &args, &[("MEMQUOTA_LIMIT", "64m")]);
    assert_ok(&out, &format!("cxx_host {args:?}"));
    let stdout = text(&out.stdout);
    libraries
        .iter()
        .map(|lib| {
            let prefix = format!("{} {function}: ", lib.display());
            let line = stdout.lines().find(|l| l.starts_with(&prefix));
            line.unwrap_or_else(|| panic!("no {prefix:?} line: {}", common::said(&out)))[prefix.len()..]
                .to_owned()
        })
        .collect()
}

/// Python loads every C++ extension `RTLD_LOCAL`: its C++ runtime is then invisible to
/// `dlsym(RTLD_DEFAULT)`, and a refused `new` found nothing to throw with (it aborted).
#[test]
fn a_refused_new_in_a_cxx_library_loaded_rtld_local_is_caught() {
    let said = cxx_host_says("local", "refused_new", &[&cxx_host().libstdcxx]);
    assert_eq!(said, ["caught"]);
}

#[test]
fn a_refused_new_in_a_cxx_library_loaded_rtld_global_is_caught() {
    let said = cxx_host_says("global", "refused_new", &[&cxx_host().libstdcxx]);
    assert_eq!(said, ["caught"]);
}

/// The library's new-handler frees a 40 MiB reserve under a 64 MiB limit: the `new`
/// it was refused for is then granted, after one call.
#[test]
fn the_new_handler_of_a_private_cxx_runtime_is_honoured() {
    let said = cxx_host_says("local", "new_handler_frees_a_reserve", &[&cxx_host().libstdcxx]);
    assert_eq!(said, ["granted after 1 handler call(s)"]);
}

/// A refused `new` when every small malloc is refused too (the account filled past the
/// over-commit bound), in libstdc++'s own code, on a thread that never threw: the
/// lookup's own allocations (the loader opening a dependency by name for the first
/// time) and the throw's (the thread's exception state, in dynamic TLS that glibc
/// mallocs at first use) are never refused. Loaded `RTLD_LOCAL`, the runtime went
/// unfound ("no C++ runtime"); `RTLD_GLOBAL`, glibc died on the TLS ("cannot
/// allocate memory for thread-local data"): DuckDB's worker threads did.
#[test]
fn the_first_throw_of_a_thread_is_caught_when_every_malloc_is_refused() {
    for how in ["local", "global"] {
        let said = cxx_host_says(
            how,
            "first_throw_of_a_thread_when_every_malloc_is_refused",
            &[&cxx_host().libstdcxx],
        );
        assert_eq!(said, ["caught"], "{how}");
    }
}

/// Two libraries loaded `RTLD_LOCAL`, one on libstdc++ and one on libc++ (two Python
/// extensions): each must get its own runtime's `bad_alloc`, the one its `catch`
/// matches, whichever was loaded first. The first runtime in load order for both
/// terminated one of them.
#[test]
fn two_private_cxx_runtimes_each_catch_their_own_bad_alloc() {
    let (gnu, llvm) = (cxx_host().libstdcxx.as_path(), cxx_on_libcxx().as_path());
    for order in [[gnu, llvm], [llvm, gnu]] {
        assert_eq!(cxx_host_says("local", "refused_new", &order), ["caught", "caught"], "{order:?}");
        let said = cxx_host_says("local", "new_handler_frees_a_reserve", &order);
        assert_eq!(said, ["granted after 1 handler call(s)"; 2], "{order:?}");
    }
}

/// With no C++ runtime loaded there is nothing to throw with: the process aborts, and
/// says why (it aborted with the report alone before).
#[test]
fn a_refused_new_with_no_cxx_runtime_loaded_says_so_and_aborts() {
    let out = preloaded(&cxx_host().host, &["new"], &[("MEMQUOTA_LIMIT", "64m")]);
    use std::os::unix::process::ExitStatusExt;
    // `timeout` passes the child's signal on as 128 + signal.
    let aborted =
        out.status.signal() == Some(libc::SIGABRT) || out.status.code() == Some(128 + libc::SIGABRT);
    assert!(aborted, "{}", common::said(&out));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("memquota: allocation refused"), "{stderr}");
    assert!(
        stderr.contains(
            "memquota: a C++ operator new was refused and no C++ runtime (libstdc++, libc++) was found among \
             the loaded objects to throw std::bad_alloc with; aborting"
        ),
        "{stderr}"
    );
}

/// The real python binary (`python3` may be a pyenv shell wrapper).
fn python() -> PathBuf {
    let out = Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().unwrap();
    PathBuf::from(text(&out.stdout).trim())
}

fn same_output(program: &Path, args: &[&str]) {
    let plain = Command::new(program).args(args).output().unwrap();
    assert_ok(&plain, "without the preload");
    let under = preloaded(program, args, &[("MEMQUOTA_LIMIT", "4g")]);
    assert_ok(&under, "under the preload");
    assert_eq!(text(&under.stdout), text(&plain.stdout), "{} changed its output", program.display());
}

#[test]
fn python_gives_the_same_output() {
    let work = "import json, hashlib\nd = [{'k': i, 'v': str(i) * 20} for i in range(200000)]\ns = json.dumps(d)\nprint(len(s), hashlib.sha256(s.encode()).hexdigest())\nprint(sorted(set(x['v'][:3] for x in d))[:5])";
    same_output(&python(), &["-c", work]);
}

#[test]
fn sort_gives_the_same_output() {
    let input = std::env::temp_dir().join(format!("memquota-sort-{}.txt", std::process::id()));
    let mut s = String::new();
    let mut x: u64 = 88172645463325252;
    for _ in 0..400_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(&format!("{:016x} {}\n", x, x % 1000));
    }
    std::fs::write(&input, s).unwrap();
    same_output(Path::new("sort"), &["-S", "64M", input.to_str().unwrap()]);
    let _ = std::fs::remove_file(input);
}

#[test]
fn gcc_compiles_the_same_object() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/probe.c");
    let dir = std::env::temp_dir();
    let (a, b) = (dir.join("mq-plain.o"), dir.join("mq-preload.o"));
    let plain = Command::new("gcc").args(["-O2", "-c"]).arg(&src).arg("-o").arg(&a).output().unwrap();
    assert_ok(&plain, "gcc");
    let under =
        preloaded(Path::new("gcc"), &["-O2", "-c", src.to_str().unwrap(), "-o", b.to_str().unwrap()], &[]);
    assert_ok(&under, "gcc under the preload");
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "objects differ");
}

#[test]
fn java_version_runs() {
    let plain = Command::new("java").arg("-version").output().unwrap();
    let under = preloaded(Path::new("java"), &["-version"], &[]);
    assert_ok(&under, "java -version");
    assert_eq!(text(&under.stderr), text(&plain.stderr));
}

#[test]
fn metrics_endpoint_is_scraped_from_another_process() {
    // A free loopback port (released just before the child binds it).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let stop = std::env::temp_dir().join(format!("memquota-serve-stop-{}", std::process::id()));
    let _ = std::fs::remove_file(&stop);
    let mut cmd = Command::new("timeout");
    cmd.arg("120").arg("env").arg(format!("LD_PRELOAD={}", lib().display()));
    cmd.arg(format!("MEMQUOTA_METRICS_ADDR={addr}")).arg("MEMQUOTA_LIMIT=1g");
    cmd.arg(&built().probe).arg("serve").arg(&stop);
    let child =
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let response = loop {
        if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
            use std::io::{Read, Write};
            s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
            s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            break out;
        }
        assert!(std::time::Instant::now() < deadline, "the endpoint never came up");
        std::thread::yield_now();
    };
    std::fs::write(&stop, b"").unwrap();
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_file(&stop);
    assert_ok(&out, "serve");
    assert!(response.starts_with("HTTP/1.0 200 OK"), "{response}");
    let body = response.split_once("\r\n\r\n").unwrap().1;
    let scrape = Metrics::parse(body);
    let get = |name: &str| scrape.find(name, None);
    assert_eq!(get("memquota_limit_bytes"), Some((1u64 << 30) as f64));
    assert!(get("memquota_native_peak_bytes").unwrap() > 0.0);
    assert!(get("memquota_process_rss_bytes").unwrap() > 0.0);
}

#[test]
fn a_taken_metrics_port_warns_and_the_program_runs() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = holder.local_addr().unwrap().to_string();
    let out = probe(&["entry"], &[("MEMQUOTA_METRICS_ADDR", &addr)]);
    assert_ok(&out, "entry with a taken port");
    let stderr = text(&out.stderr);
    assert!(stderr.contains("metrics endpoint not started") && stderr.contains(&addr), "{stderr}");
    let out = probe(&["entry"], &[("MEMQUOTA_METRICS_ADDR", "not-an-address")]);
    assert_eq!(out.status.code(), Some(2), "a malformed address is a configuration error");
    assert!(text(&out.stderr).contains("MEMQUOTA_METRICS_ADDR"));
}

/// The lines of `out`'s stdout, checked: the program ran to its end.
fn stdout_of(out: &Output, what: &str) -> String {
    assert_ok(out, what);
    text(&out.stdout)
}

#[test]
fn a_program_linked_with_jemalloc_gets_the_same_output_and_exact_counts() {
    let exe = &linked_with_jemalloc().jemapi;
    for mode in ["api", "threads"] {
        let alone = stdout_of(&plain(exe, &[mode], &[]), mode);
        // The profile off: jemalloc resizes no sampled block in place (`xallocx`
        // leaves it as it is, which its contract allows), and the program checks that
        // its blocks shrink and grow in place.
        let under = preloaded(exe, &[mode], &[("MEMQUOTA_PROFILE_SAMPLE", "0")]);
        assert_eq!(stdout_of(&under, mode), alone, "{mode}: the output changed under the preload");
        // Its checks of memquota's count after every call ran, and held.
        let stderr = text(&under.stderr);
        assert!(stderr.contains(&format!("memquota: exact after {mode}")), "{mode}: {stderr}");
    }
    let alone = stdout_of(&plain(exe, &["api"], &[]), "api");
    for line in ["arena honoured 1", "stats.allocated sees malloc 1, by mib 1", "malloc_stats_print wrote 1"]
    {
        assert!(alone.contains(line), "{line}: {alone}");
    }
}

#[test]
fn jemalloc_api_refusals_are_null_or_no_change_with_a_report() {
    let out = preloaded(&linked_with_jemalloc().jemapi, &["oom"], &[("MEMQUOTA_LIMIT", "256m")]);
    let stdout = stdout_of(&out, "oom");
    for line in [
        "mallocx refused 1",
        "zeroed mallocx refused 1",
        "rallocx refused 1, block kept 1",
        "xallocx unchanged 1",
        "xallocx with extra unchanged 1",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    let stderr = text(&out.stderr);
    assert!(stderr.contains("memquota: allocation refused: 512.0 MiB (536870912) requested"), "{stderr}");
    assert!(stderr.contains("memquota: exact after oom"), "{stderr}");
}

/// The `conf` mode's output under the preload with `env`, checked.
fn conf_under(env: &[(&str, &str)]) -> (String, String) {
    let out = preloaded(&linked_with_jemalloc().jemapi, &["conf"], env);
    (stdout_of(&out, &format!("conf {env:?}")), text(&out.stderr))
}

#[test]
fn malloc_conf_is_honoured_and_read_back_through_mallctl() {
    // The defaults, then dirty_decay_ms:0 by MALLOC_CONF: read back from memquota's
    // jemalloc (its statistics see the program's malloc), and freed pages are purged
    // at once instead of kept. By default memquota runs the purging (no decay: its
    // purge service purges, src/policy/purge.rs), settled before the program's main, and
    // blocks from 1 MiB on share one arena; a user's own decay keeps jemalloc's 8 MiB.
    let (defaults, _) = conf_under(&[]);
    for line in [
        "opt.oversize_threshold 1048576",
        "opt.dirty_decay_ms 10000",
        "arenas.dirty_decay_ms -1",
        "stats.allocated sees malloc 1",
        "dirty pages after free kept",
    ] {
        assert!(defaults.contains(line), "{line}: {defaults}");
    }
    // A user's own decay wins over memquota's, even one that says jemalloc's default.
    let (stdout, _) = conf_under(&[("MALLOC_CONF", "dirty_decay_ms:10000")]);
    assert!(stdout.contains("arenas.dirty_decay_ms 10000"), "{stdout}");
    let set = [("MALLOC_CONF", "dirty_decay_ms:0")];
    let (stdout, stderr) = conf_under(&set);
    for line in [
        "opt.oversize_threshold 8388608",
        "opt.dirty_decay_ms 0",
        "arenas.dirty_decay_ms 0",
        "stats.allocated sees malloc 1",
        "dirty pages after free none",
    ] {
        assert!(stdout.contains(line), "{line}: {stdout}");
    }
    assert!(!stderr.contains("memquota:") && !stderr.contains("<jemalloc>"), "{stderr}");
    // What Debian's jemalloc does with the same setting.
    assert_eq!(stdout_of(&plain(&linked_with_jemalloc().jemapi, &["conf"], &set), "conf"), stdout);
    // The prefixed variable still works, and wins an option both set.
    let (stdout, _) = conf_under(&[("_RJEM_MALLOC_CONF", "dirty_decay_ms:0")]);
    assert!(stdout.contains("opt.dirty_decay_ms 0"), "{stdout}");
    // A threshold of the user's own wins over memquota's, alone or with other options.
    for (var, value) in [
        ("MALLOC_CONF", "oversize_threshold:2097152"),
        ("_RJEM_MALLOC_CONF", "narenas:2,oversize_threshold:2097152"),
    ] {
        let (stdout, _) = conf_under(&[(var, value)]);
        assert!(
            stdout.contains("opt.oversize_threshold 2097152") && stdout.contains("arenas.dirty_decay_ms -1"),
            "{stdout}"
        );
    }
    let (stdout, _) = conf_under(&[("MALLOC_CONF", "narenas:2")]);
    assert!(
        stdout.contains("opt.oversize_threshold 1048576") && stdout.contains("opt.narenas 2"),
        "{stdout}"
    );
    let (stdout, _) = conf_under(&[
        ("MALLOC_CONF", "muzzy_decay_ms:1000,dirty_decay_ms:0"),
        ("_RJEM_MALLOC_CONF", "dirty_decay_ms:5000"),
    ]);
    assert!(
        stdout.contains("opt.dirty_decay_ms 5000") && stdout.contains("opt.muzzy_decay_ms 1000"),
        "{stdout}"
    );
}

#[test]
fn malloc_conf_background_threads_start_without_a_deadlock() {
    // jemalloc starts its background thread from its first allocation, holding a
    // lock that its first mallctl takes too: memquota's must not be that mallctl.
    // In a C++ program that first allocation is libstdc++'s emergency pool (71 KiB,
    // whose size class the preload asks of nallocx, which starts jemalloc), before the
    // library's constructor; it deadlocked with either variable.
    let (stdout, _) = conf_under(&[("MALLOC_CONF", "background_thread:true")]);
    assert!(stdout.contains("opt.background_thread 1"), "{stdout}");
    assert!(stdout.contains("stats.allocated sees malloc 1"), "memquota's jemalloc answered: {stdout}");
    for var in JEMALLOC_VARS {
        let env = [(var, "background_thread:true"), ("MEMQUOTA_LIMIT", "1g")];
        // No deadlock is what this checks: the exact counts of these programs may be
        // off by the 320-byte TLS block jemalloc gives a background thread that starts
        // between two of their readings (a real, counted allocation).
        for (what, out) in [
            ("C++ with background threads", preloaded(&built().cxx, &[], &env)),
            ("entry with background threads", probe(&["entry"], &env)),
        ] {
            assert!(out.status.code().is_some_and(|c| c != 124), "{what}: {out:?}");
        }
    }
}

#[test]
fn malloc_conf_settings_without_effect_are_named() {
    // memquota's realloc(p, 0) frees, whatever jemalloc was told.
    let (_, stderr) = conf_under(&[("MALLOC_CONF", "zero_realloc:alloc,dirty_decay_ms:0")]);
    assert!(
        stderr.contains("memquota: MALLOC_CONF: zero_realloc:alloc has no effect: realloc(p, 0) frees p"),
        "{stderr}"
    );
    // jemalloc names what it does not know (it knows `prof`: it is built with
    // profiling, for the allocation sites).
    let (_, stderr) = conf_under(&[("MALLOC_CONF", "no_such_option:true")]);
    assert!(stderr.contains("<jemalloc>: Invalid conf pair: no_such_option:true"), "{stderr}");
    // Options compiled into the program are for the jemalloc it links.
    let out = preloaded(&linked_with_jemalloc().jemapi_conf, &["conf"], &[]);
    assert_ok(&out, "jemapi_conf");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("memquota: the program's malloc_conf \"narenas:1\" is for the jemalloc"),
        "{stderr}"
    );
}

/// `dlopen`ed rather than preloaded (a JVM's `-agentpath` without `LD_PRELOAD`), the
/// library's constructor runs under the loader's lock. It must not wait there for its
/// own service thread, whose first jemalloc call can take that lock (jemalloc looks
/// `pthread_create` up with `dlsym`): before the fix about half these loads hung for
/// ever, so 40 in a row would not all finish.
#[test]
fn a_dlopened_library_never_waits_under_the_loader_lock_for_its_service_thread() {
    let host = build_dir("dlopen").join("dlopen_host");
    compile("gcc", &["-O1", "-Wall", "-Werror", "dlopen_host.c", "-ldl"], &host);
    for run in 0..40 {
        let out = Command::new("timeout")
            .arg("10")
            .arg(&host)
            .arg(lib())
            .env("MEMQUOTA_LIMIT", "1g")
            // Room in the static TLS block for the library's initial-exec TLS, as a
            // `dlopen` of it needs.
            .env("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=16384")
            .output()
            .unwrap();
        assert!(out.status.success() && text(&out.stdout).contains("loaded"), "load {run}: {}", said(&out));
    }
}

/// The report's top sites (`tests/c/sites.c`): estimated bytes and the frames named
/// by `addr2line`, as `memquota run` names them.
fn report_sites(report: &str) -> Vec<(u64, Vec<String>)> {
    let mut lines = report.lines().skip_while(|l| !l.trim_start().starts_with("top sites"));
    assert!(lines.next().is_some(), "the report names its top sites:\n{report}");
    lines
        .take_while(|l| l.starts_with("    "))
        .map(|line| {
            let bytes = line.split(['(', ')']).nth(1).and_then(|b| b.parse().ok()).expect("bytes");
            let mut object = String::new();
            let mut names = Vec::new();
            for frame in line.split_once('%').expect("a share").1.split("<-").map(str::trim) {
                let (obj, addr) = frame.rsplit_once('+').expect("OBJECT+ADDR");
                if !obj.is_empty() {
                    object = obj.to_string();
                }
                let out = Command::new("addr2line").args(["-f", "-i", "-e", &object, addr]).output().unwrap();
                names.extend(text(&out.stdout).lines().step_by(2).map(str::to_string));
            }
            (bytes, names)
        })
        .collect()
}

/// A C program refused at its limit: the report names the two functions that hold
/// the memory, first and second, with estimates within 25% of the 48 and 8 MiB they
/// hold (one through the counted path, one through a lazy thread's jump into
/// jemalloc), and not the one whose 256 MiB were freed. One sample per 16 KiB: at the
/// default 512 KiB the 8 MiB are about 16 samples, a count off by more than a quarter
/// about one run in three (tests/sites.rs says more).
#[test]
fn the_report_names_the_sites_that_hold_the_memory() {
    let out =
        preloaded(&built().sites, &[], &[("MEMQUOTA_LIMIT", "64m"), ("MEMQUOTA_PROFILE_SAMPLE", "16k")]);
    assert_ok(&out, "sites");
    assert!(text(&out.stdout).contains("32 MiB refused"), "{}", text(&out.stdout));
    let report = text(&out.stderr);
    let sites = report_sites(&report);
    let within = |bytes: u64, mib: u64| bytes >= (mib << 20) * 3 / 4 && bytes <= (mib << 20) * 5 / 4;
    let named = |i: usize, f: &str| sites.get(i).is_some_and(|s| s.1.iter().any(|n| n == f));
    assert!(named(0, "big_site") && within(sites[0].0, 48), "big_site first, ~48 MiB:\n{report}");
    assert!(named(1, "small_site") && within(sites[1].0, 8), "small_site second, ~8 MiB:\n{report}");
    assert!(
        !sites.iter().any(|s| s.1.iter().any(|n| n == "churn_site")),
        "freed memory is not live:\n{report}"
    );
}

/// No `MEMQUOTA_PROFILE_SAMPLE`: the profile samples at its default rate, one per 512
/// KiB, and the refusal's report names big_site first. Its 768 blocks of 64 KiB are
/// each sampled with probability 1 - e^(-1/8), about 90 samples: the estimate's spread
/// is about 10%, so 50% is five of it, not luck.
#[test]
fn the_profile_is_on_by_default() {
    let out = preloaded(&built().sites, &[], &[("MEMQUOTA_LIMIT", "64m")]);
    assert_ok(&out, "sites");
    assert!(text(&out.stdout).contains("32 MiB refused"), "{}", text(&out.stdout));
    let report = text(&out.stderr);
    assert!(report.contains("(1 per 512.0 KiB allocated)"), "the default rate:\n{report}");
    let sites = report_sites(&report);
    let first = sites.first().unwrap_or_else(|| panic!("the report names its top sites:\n{report}"));
    assert!(first.1.iter().any(|n| n == "big_site"), "big_site first:\n{report}");
    assert!(((24 << 20)..=(72 << 20)).contains(&first.0), "big_site's 48 MiB within 50%:\n{report}");
}

/// `GET /debug/pprof/heap` on the preload's endpoint while `tests/c/sites.c` holds its
/// two sites' memory (`hold`): `go tool pprof` reads the profile, names both functions
/// from the program's symbols (the mapping's path and build ID) and estimates each
/// within 25%.
#[test]
fn the_endpoints_heap_profile_is_read_by_pprof() {
    use std::io::{BufRead, BufReader};
    // A free loopback port (released just before the child binds it).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut cmd = Command::new("timeout");
    cmd.arg("120").arg("env").arg(format!("LD_PRELOAD={}", lib().display()));
    cmd.args([&format!("MEMQUOTA_METRICS_ADDR={addr}"), "MEMQUOTA_LIMIT=1g", "MEMQUOTA_PROFILE_SAMPLE=16k"]);
    cmd.arg(&built().sites).arg("hold");
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line, "held\n", "the program holds its sites' memory");
    // The endpoint is bound by the preload's constructor, before main.
    let (status, body) = pprof::get(&addr, "/debug/pprof/heap");
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert_ok(&out, "sites hold");
    assert_eq!(status, "HTTP/1.0 200 OK", "{}", text(&body));
    let file = build_dir("preload").join("heap.pb.gz");
    std::fs::write(&file, &body).unwrap();
    let (rows, top) = pprof::top(&file, "inuse_space");
    println!("{top}");
    let within = |bytes: u64, mib: u64| bytes >= (mib << 20) * 3 / 4 && bytes <= (mib << 20) * 5 / 4;
    let big = pprof::cum(&rows, "big_site").unwrap_or_else(|| panic!("pprof names big_site:\n{top}"));
    let small = pprof::cum(&rows, "small_site").unwrap_or_else(|| panic!("pprof names small_site:\n{top}"));
    assert!(within(big, 48), "big_site's 48 MiB within 25%: {big}\n{top}");
    assert!(within(small, 8), "small_site's 8 MiB within 25%: {small}\n{top}");
}

/// `MEMQUOTA_PROFILE_DIR`: `tests/c/sites.c`'s one refusal leaves one record, complete
/// although the program ends right after the NULL (the refusing thread waits for it,
/// bounded): the profile names both sites for `go tool pprof`, and the stats, scopes,
/// container's figures and report are there.
#[test]
fn a_refusal_leaves_a_flight_record() {
    let dir = build_dir("flight").join("records");
    let _ = std::fs::remove_dir_all(&dir);
    let env = [
        ("MEMQUOTA_LIMIT", "64m"),
        ("MEMQUOTA_PROFILE_SAMPLE", "16k"),
        ("MEMQUOTA_PROFILE_DIR", dir.to_str().unwrap()),
    ];
    let out = preloaded(&built().sites, &[], &env);
    assert_ok(&out, "sites");
    let records: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(records.len(), 1, "one record: {records:?}");
    let name = records[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("memquota-") && name.ends_with("-1"), "{name}");
    let mut files: Vec<String> = std::fs::read_dir(&records[0])
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["container.json", "heap.pb.gz", "report.txt", "scopes.json", "stats.json"]);
    let read = |f: &str| std::fs::read_to_string(records[0].join(f)).unwrap();
    assert_eq!(read("report.txt"), text(&out.stderr), "the record holds the report the program printed");
    assert!(read("stats.json").contains("\"oom_total\":1,"), "{}", read("stats.json"));
    let (rows, top) = pprof::top(&records[0].join("heap.pb.gz"), "inuse_space");
    let within = |bytes: u64, mib: u64| bytes >= (mib << 20) * 3 / 4 && bytes <= (mib << 20) * 5 / 4;
    assert!(pprof::cum(&rows, "big_site").is_some_and(|b| within(b, 48)), "{top}");
    assert!(pprof::cum(&rows, "small_site").is_some_and(|b| within(b, 8)), "{top}");
}

/// `MEMQUOTA_ON_OOM=abort`: the process aborts at the refusal, after its record is
/// written.
#[test]
fn an_aborting_refusal_leaves_its_flight_record() {
    use std::os::unix::process::ExitStatusExt;
    let dir = build_dir("flight-abort").join("records");
    let _ = std::fs::remove_dir_all(&dir);
    let env = [
        ("MEMQUOTA_LIMIT", "64m"),
        ("MEMQUOTA_ON_OOM", "abort"),
        ("MEMQUOTA_PROFILE_SAMPLE", "16k"),
        ("MEMQUOTA_PROFILE_DIR", dir.to_str().unwrap()),
    ];
    let out = preloaded(&built().sites, &[], &env);
    let aborted =
        out.status.signal() == Some(libc::SIGABRT) || out.status.code() == Some(128 + libc::SIGABRT);
    assert!(aborted, "{}", said(&out));
    let records: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(records.len(), 1, "one record: {records:?}");
    assert!(records[0].join("heap.pb.gz").exists() && records[0].join("report.txt").exists(), "{records:?}");
}

/// The exit summary (`MEMQUOTA_REPORT=exit`) names the sites of the last refusal, and
/// the stats file carries them for `memquota run` (`# memquota site` lines).
#[test]
fn the_exit_summary_and_the_stats_file_name_the_sites_of_the_last_refusal() {
    let dir = std::env::temp_dir().join(format!("memquota-sites-stats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let stats = dir.join("stats.prom");
    let env = [
        ("MEMQUOTA_LIMIT", "64m"),
        ("MEMQUOTA_PROFILE_SAMPLE", "16k"),
        ("MEMQUOTA_REPORT", "exit"),
        ("MEMQUOTA_STATS_FILE", stats.to_str().unwrap()),
    ];
    let out = preloaded(&built().sites, &[], &env);
    assert_ok(&out, "sites");
    let stderr = text(&out.stderr);
    let summary = &stderr[stderr.find("memquota summary").expect("a summary")..];
    assert!(summary.contains("top sites (at the last refusal)"), "{summary}");
    let sites = report_sites(summary);
    assert!(sites.first().is_some_and(|s| s.1.iter().any(|n| n == "big_site")), "{summary}");
    let file = std::fs::read_to_string(&stats).unwrap();
    assert!(file.contains("# memquota sites at the last refusal;"), "{file}");
    let first = file.lines().find(|l| l.starts_with("# memquota site ")).expect("a site line");
    let frame = first.split_whitespace().nth(5).expect("a frame");
    let (object, addr) = frame.rsplit_once('+').unwrap();
    let named = Command::new("addr2line").args(["-f", "-e", object, addr]).output().unwrap();
    assert_eq!(text(&named.stdout).lines().next(), Some("big_site"), "{first}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The value of the `KEY=VALUE` line a test program printed for `key`.
fn value_of(stdout: &str, key: &str) -> String {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in:\n{stdout}"));
    line[key.len() + 1..].to_owned()
}
