//! What the package's harness-less tests share: each check runs its cases in child
//! processes of the test binary (`--case NAME LIMIT_MIB`, one figure a line on the
//! child's stdout: `KEY VALUE`), and one runner prints cargo's lines.
#![allow(dead_code)] // each test binary uses its own part

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::Command;
use std::time::{Duration, Instant};

/// What a child process saw: its `KEY VALUE` lines, and all it printed.
pub struct Seen {
    pub lines: Vec<(String, String)>,
    pub text: String,
}

impl Seen {
    pub fn all(&self, key: &str) -> Vec<&str> {
        self.lines.iter().filter(|(k, _)| k == key).map(|(_, v)| v.as_str()).collect()
    }

    pub fn one(&self, key: &str) -> &str {
        self.all(key).first().copied().unwrap_or_else(|| panic!("no {key}:\n{}", self.text))
    }

    pub fn num(&self, key: &str) -> u64 {
        self.one(key).parse().unwrap_or_else(|_| panic!("no figure {key}:\n{}", self.text))
    }

    /// Every `KEY` line parsed.
    pub fn parsed<T: std::str::FromStr>(&self, key: &str) -> Vec<T> {
        self.all(key)
            .iter()
            .map(|r| r.parse().unwrap_or_else(|_| panic!("a {key} line:\n{}", self.text)))
            .collect()
    }

    /// The `KEY-message` lines, one text.
    pub fn message(&self, key: &str) -> String {
        self.all(&format!("{key}-message")).join("\n")
    }
}

/// Runs case `case` at `limit_mib` in a child process; what it saw and how long it
/// took. Fails if the child did.
pub fn run_child(case: &str, limit_mib: u64) -> (Seen, Duration) {
    let started = Instant::now();
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--case", case, &limit_mib.to_string()])
        .output()
        .expect("the child runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "case {case} at {limit_mib} MiB: {}\n{text}", out.status);
    let lines = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(' ').map(|(k, v)| (k.to_owned(), v.to_owned())))
        .collect();
    (Seen { lines, text }, started.elapsed())
}

/// The test binary's `main`. Called with `--case NAME LIMIT_MIB`, runs that case in
/// this process with `child` (exit 1 if it fails). Otherwise runs each check that the
/// arguments not starting with `-` select by substring (all without any), prints a
/// line for each and cargo's closing line, and exits 101 if any failed.
pub fn main<E: std::fmt::Display>(child: fn(&str, u64) -> Result<(), E>, checks: &[(&str, &dyn Fn())]) {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--case") {
        let limit = args.get(i + 2).and_then(|l| l.parse().ok()).expect("--case NAME LIMIT_MIB");
        if let Err(e) = child(&args[i + 1], limit) {
            eprintln!("case failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    let filter: Vec<&String> = args.iter().skip(1).filter(|a| !a.starts_with('-')).collect();
    let (mut ran, mut failed) = (0, 0);
    for (name, check) in checks {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        let started = Instant::now();
        let ok = catch_unwind(AssertUnwindSafe(check)).is_ok();
        println!(
            "test {name} ... {} ({} ms)",
            if ok { "ok" } else { "FAILED" },
            started.elapsed().as_millis()
        );
        failed += usize::from(!ok);
    }
    println!(
        "\ntest result: {}. {} passed; {failed} failed",
        if failed == 0 { "ok" } else { "FAILED" },
        ran - failed
    );
    if failed > 0 {
        std::process::exit(101);
    }
}
