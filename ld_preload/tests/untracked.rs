//! Memory the preload does not allocate (issue 13): a C program maps and touches
//! anonymous memory itself, as a private allocator does. The sampler sees it as
//! untracked; counted (`MEMQUOTA_UNTRACKED=count`) it leaves less room for malloc, which is then
//! refused after a reclaim was tried, with a report that says where the memory is.
//!
//! Needs `cargo build --release` first (scripts/test.sh does it) and gcc.

mod common;

use common::{build_dir, compile, inherited_vars, lib, said, text};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

const MIB: u64 = 1 << 20;

fn mapper() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let exe = build_dir("untracked").join("mapper");
        compile("gcc", &["-O1", "-g", "-Wall", "mapper.c", "-ldl"], &exe);
        exe
    })
}

/// Runs the mapper under the preload with a 64 MiB limit: it maps `map` MiB, then
/// asks malloc for `ask` MiB.
fn run(map: u64, ask: u64, env: &[(&str, &str)]) -> (Output, u64, u32, bool) {
    let mut cmd = Command::new("timeout");
    cmd.arg("60").arg("env").arg(format!("LD_PRELOAD={}", lib().display())).arg("MEMQUOTA_LIMIT=64m");
    for (k, v) in env {
        cmd.arg(format!("{k}={v}"));
    }
    for var in inherited_vars() {
        cmd.env_remove(var);
    }
    let out = cmd.arg(mapper()).arg(map.to_string()).arg(ask.to_string()).output().unwrap();
    assert!(out.status.success(), "{}", said(&out));
    let stdout = text(&out.stdout);
    let field = |name: &str| -> String {
        stdout
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")).map(str::to_owned))
            .unwrap_or_else(|| panic!("no {name}= in {}", said(&out)))
    };
    let untracked = field("untracked").parse().unwrap();
    let reclaims = field("reclaims").parse().unwrap();
    let granted = field("malloc") == "granted";
    (out, untracked, reclaims, granted)
}

#[test]
fn mapped_memory_is_untracked_and_counted_so_malloc_is_refused_after_a_reclaim() {
    let (out, untracked, reclaims, granted) = run(48, 32, &[("MEMQUOTA_UNTRACKED", "count")]);
    assert!(untracked >= 40 * MIB, "the sampler saw {untracked} of 48 MiB: {}", said(&out));
    assert!(!granted, "48 MiB mapped + 32 MiB asked must not fit 64 MiB: {}", said(&out));
    assert!(reclaims >= 1, "a reclaim is tried before the refusal: {}", said(&out));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("memquota: allocation refused: 32.0 MiB"), "{stderr}");
    assert!(stderr.contains("untracked        4"), "the report shows the untracked part: {stderr}");
    assert!(stderr.contains("counted against the limit"), "{stderr}");
}

#[test]
fn reported_only_untracked_memory_leaves_the_budget_alone() {
    // The default.
    let (out, untracked, _, granted) = run(48, 32, &[]);
    assert!(untracked >= 40 * MIB, "the sampler saw {untracked} of 48 MiB: {}", said(&out));
    assert!(granted, "not counted, the mapping leaves malloc its 64 MiB: {}", said(&out));
}

#[test]
fn without_the_mapping_the_same_malloc_fits() {
    let (out, untracked, _, granted) = run(0, 32, &[("MEMQUOTA_UNTRACKED", "count")]);
    assert!(untracked < 16 * MIB, "a small C program has little untracked memory: {}", said(&out));
    assert!(granted, "{}", said(&out));
}

#[test]
fn the_exit_summary_warns_when_most_memory_is_untracked() {
    let (out, _, _, _) = run(48, 1, &[("MEMQUOTA_REPORT", "exit")]);
    let stderr = text(&out.stderr);
    assert!(stderr.contains("untracked      "), "{stderr}");
    assert!(stderr.contains("process RSS    "), "{stderr}");
    assert!(
        stderr.contains("most of this process's memory comes from an allocator memquota does not see"),
        "{stderr}"
    );
}
