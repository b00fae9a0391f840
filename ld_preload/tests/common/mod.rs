//! What the preload's test binaries share: the library's path, output text, and
//! assertions that print what the program said.
#![allow(dead_code)] // each test binary uses its own part

use std::path::PathBuf;
use std::process::Output;

/// target/release/libmemquota.so, next to this test's own deps/ directory.
pub fn lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let so = exe.parent().unwrap().parent().unwrap().join("libmemquota.so");
    assert!(so.exists(), "{} is missing: run `cargo build --release` first", so.display());
    so
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Stdout and stderr, for assertion messages.
pub fn said(out: &Output) -> String {
    format!("status: {:?}\nstdout:\n{}\nstderr:\n{}", out.status, text(&out.stdout), text(&out.stderr))
}

pub fn assert_ok(out: &Output, what: &str) {
    assert!(out.status.success(), "{what}: {}", said(out));
}

/// The `MEMQUOTA_*` variables a test must not inherit from the shell that runs it.
pub fn inherited_vars() -> impl Iterator<Item = &'static str> {
    memquota_core::face::ENV_VARS.iter().map(|(v, _)| *v).chain([
        "MEMQUOTA_REPORT",
        "MEMQUOTA_REPORT_PID",
        "MEMQUOTA_STATS_FILE",
    ])
}
