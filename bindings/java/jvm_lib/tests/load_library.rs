//! The library mode from the JVM's side: `java` loads libmemquota_jni_demo.so with
//! `System.loadLibrary`, and java/JniDemo.java makes heap garbage, asks for native
//! memory that fits only after a GC, then for more than can ever fit. Run again under
//! the preload, the process holds two budgets and must say so.
//!
//! Needs `java` and `javac` (scripts/test.sh installs them); the second run needs
//! the preload, built by `cargo build --release` in the repository root (or named by
//! `MEMQUOTA_PRELOAD_SO`). Nothing here is skipped: a missing piece fails the test.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

const MIB: u64 = 1 << 20;
/// Heap garbage made live first, so the heap commits at least this much.
const GARBAGE_MIB: u64 = 256;
/// Room beside the heap when the limit is set; the request needs `ASK - HEADROOM`
/// more, which only a GC that shrinks the heap gives.
const HEADROOM_MIB: u64 = 64;
const ASK_MIB: u64 = 128;
const WARNING: &str = "memquota: warning: two budgets in one process";

/// Where cargo put this test binary and the library it built for it:
/// `<target>/<profile>/deps` (a library built for the tests is not copied up to
/// `<target>/<profile>`).
fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent().expect("<target>/<profile>/deps/<test>").to_path_buf()
}

/// The directory holding the library, checked to hold it.
fn library_dir() -> PathBuf {
    let dir = deps_dir();
    let lib = dir.join("libmemquota_jni_demo.so");
    assert!(lib.is_file(), "{} is missing: cargo test builds it as this package's library", lib.display());
    dir
}

/// JniDemo compiled once into `<target>/<profile>/jni-demo-classes`.
fn classes() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = deps_dir().with_file_name("jni-demo-classes");
        std::fs::create_dir_all(&out).expect("a directory for the classes");
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("java/JniDemo.java");
        let javac = Command::new("javac")
            .arg("-d")
            .arg(&out)
            .arg(&source)
            .output()
            .expect("javac must be installed (scripts/test.sh installs default-jdk-headless)");
        assert!(javac.status.success(), "javac failed:\n{}", String::from_utf8_lossy(&javac.stderr));
        out
    })
}

/// Runs JniDemo under `timeout`, with `preload` as LD_PRELOAD if given. `timeout`
/// stays outside the preload: a broken preload would hang a preloaded `timeout` too.
fn run_demo(preload: Option<&Path>) -> (Output, String, String) {
    let mut cmd = Command::new("timeout");
    cmd.arg("120").arg("env");
    if let Some(so) = preload {
        cmd.arg(format!("LD_PRELOAD={}", so.display()));
    }
    cmd.args(["java", "-Xms16m", "-Xmx1g", "-XX:+UseG1GC"])
        .arg(format!("-Djava.library.path={}", library_dir().display()))
        .arg("-cp")
        .arg(classes())
        .arg("JniDemo")
        .args([GARBAGE_MIB, HEADROOM_MIB, ASK_MIB].map(|n| n.to_string()))
        .env_remove("LD_PRELOAD")
        .env_remove("MEMQUOTA_LIMIT");
    let out = cmd.output().expect("timeout and java must be installed");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("--- stdout\n{stdout}--- stderr\n{stderr}---");
    (out, stdout, stderr)
}

fn value(stdout: &str, key: &str) -> u64 {
    let prefix = format!("{key}=");
    let line = stdout.lines().find_map(|l| l.strip_prefix(&prefix));
    line.unwrap_or_else(|| panic!("no {key}= line")).parse().unwrap_or_else(|e| panic!("{key}: {e}"))
}

/// The checks both runs share: the GC made room, the refusal reached Java with the
/// report, and the JVM exited 0.
fn check_demo(out: &Output, stdout: &str) {
    assert_eq!(out.status.code(), Some(0), "the JVM must exit 0");
    assert!(stdout.contains("\nDONE\n"), "the program must run to its end");
    let (before, after) = (value(stdout, "HEAP_BEFORE"), value(stdout, "HEAP_AFTER"));
    assert!(before >= GARBAGE_MIB * MIB, "the garbage must grow the heap: {before} committed");
    assert!(
        before - after > (ASK_MIB - HEADROOM_MIB) * MIB,
        "the GC must shrink the heap by more than the request needed: {before} -> {after}"
    );
    assert_eq!(value(stdout, "FIT"), ASK_MIB * MIB);
    assert!(value(stdout, "GCS") >= 1, "a GC must have made the room");
    assert!(value(stdout, "SYNC_RECLAIMS") >= 1, "the request must have waited for a reclaim");
    let limit = value(stdout, "LIMIT");
    assert_eq!(value(stdout, "REFUSED"), limit, "a request as big as the limit must be refused");
    let report = stdout.split("REPORT_BEGIN\n").nth(1).and_then(|r| r.split("REPORT_END").next());
    let report = report.expect("the OutOfMemoryError's message");
    assert!(
        report.starts_with(&format!("memquota: allocation refused: {}", limit / MIB)),
        "the OutOfMemoryError must carry the report:\n{report}"
    );
    assert!(report.contains("heap committed"), "the report names the heap:\n{report}");
}

#[test]
fn gc_makes_room_and_refusal_is_an_out_of_memory_error() {
    let (out, stdout, stderr) = run_demo(None);
    check_demo(&out, &stdout);
    assert!(!stderr.contains(WARNING), "one budget: no warning expected:\n{stderr}");
}

#[test]
fn a_library_budget_under_the_preload_warns_of_two_budgets() {
    let preload = std::env::var_os("MEMQUOTA_PRELOAD_SO").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../target/release/libmemquota.so")
    });
    let preload = std::fs::canonicalize(&preload).unwrap_or_else(|_| {
        panic!(
            "{} is missing: run `cargo build --release` in the repository root, or set MEMQUOTA_PRELOAD_SO",
            preload.display()
        )
    });
    let (out, stdout, stderr) = run_demo(Some(&preload));
    // The library's own budget works as before: the preload's does not see it.
    check_demo(&out, &stdout);
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.starts_with(WARNING)).collect();
    assert_eq!(warnings.len(), 1, "exactly one warning line expected:\n{stderr}");
    let warning = warnings[0];
    assert!(warning.contains("libmemquota_jni_demo.so"), "the warning names the library: {warning}");
    assert!(warning.contains("libmemquota.so (the LD_PRELOAD library"), "and the preload: {warning}");
    assert!(warning.contains("keep one"), "and says what to do: {warning}");
}

#[test]
fn two_libraries_with_their_own_budgets_warn_once() {
    // A second copy of the library under another name: two objects, each with its
    // own QuotaAlloc and its own `JNI_OnLoad` calling `memquota::jvm::install`.
    let first = library_dir().join("libmemquota_jni_demo.so");
    let second = deps_dir().with_file_name("libmemquota_jni_demo_copy.so");
    std::fs::copy(&first, &second).expect("copy the library");
    let out = Command::new("timeout")
        .args(["120", "java", "-Xms16m", "-Xmx256m", "-cp"])
        .arg(classes())
        .args(["JniDemo", "two"])
        .args([&first, &second])
        .env_remove("LD_PRELOAD")
        .output()
        .expect("timeout and java must be installed");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("--- stdout\n{stdout}--- stderr\n{stderr}---");
    assert_eq!(out.status.code(), Some(0), "the JVM must exit 0");
    assert!(stdout.contains("LOADED_TWO"), "both copies must load");
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.starts_with(WARNING)).collect();
    assert_eq!(warnings.len(), 1, "exactly one warning line expected:\n{stderr}");
    let warning = warnings[0];
    assert!(
        warning.contains("libmemquota_jni_demo_copy.so (a memquota::QuotaAlloc, this copy)"),
        "the second copy warns, naming itself: {warning}"
    );
    assert!(warning.contains("libmemquota_jni_demo.so (a memquota::QuotaAlloc)"), "and the first: {warning}");
    assert!(warning.contains("give memquota::QuotaAlloc to one library only"), "and what to do: {warning}");
}
