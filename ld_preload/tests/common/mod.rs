//! What the preload's test binaries share: the library's path, output text, and
//! assertions that print what the program said.
#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// target/release/libmemquota.so, next to this test's own deps/ directory.
pub fn lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let so = exe.parent().unwrap().parent().unwrap().join("libmemquota.so");
    assert!(so.exists(), "{} is missing: run `cargo build --release` first", so.display());
    so
}

/// A directory of this test process's own for the programs it builds:
/// `memquota-<what>-tests-<pid>` in the temporary directory.
pub fn build_dir(what: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("memquota-{what}-tests-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    out
}

/// `compiler args... -o out`, run in tests/c (where `sampler.h` is).
pub fn compile(compiler: &str, args: &[&str], out: &Path) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
    let status = Command::new(compiler).current_dir(&src).args(args).arg("-o").arg(out).status().unwrap();
    assert!(status.success(), "{compiler} {args:?} -o {} failed", out.display());
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
    memquota_core::seam::process::ENV_VARS.iter().map(|(v, _)| *v).chain([
        "MEMQUOTA_REPORT",
        "MEMQUOTA_REPORT_PID",
        "MEMQUOTA_STATS_FILE",
    ])
}

/// Parsed Prometheus text: a stats file or a scrape of the endpoint.
pub struct Metrics(prometheus_parse::Scrape);

impl Metrics {
    pub fn parse(body: &str) -> Metrics {
        Metrics(prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).unwrap())
    }

    /// The stats file at `path`; `context` says what the program did, for the message
    /// when there is none.
    pub fn read(path: &std::path::Path, context: impl FnOnce() -> String) -> Metrics {
        match std::fs::read_to_string(path) {
            Ok(body) => Metrics::parse(&body),
            Err(e) => panic!("stats file {}: {e}\n{}", path.display(), context()),
        }
    }

    /// The value of `name`, which must be there (its first sample, whatever its labels).
    pub fn get(&self, name: &str) -> f64 {
        self.labelled(name, None)
    }

    /// The value of `name` with the label `kind` (any sample when `None`).
    pub fn labelled(&self, name: &str, kind: Option<&str>) -> f64 {
        self.find(name, kind).unwrap_or_else(|| panic!("no {name} {kind:?} in the stats"))
    }

    /// The value of `name`, if a sample has it.
    pub fn find(&self, name: &str, kind: Option<&str>) -> Option<f64> {
        let sample = self
            .0
            .samples
            .iter()
            .find(|s| s.metric == name && (kind.is_none() || s.labels.get("kind") == kind))?;
        match sample.value {
            prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Counter(v) => Some(v),
            _ => panic!("{name}: not a gauge or counter"),
        }
    }
}

/// The python of `target/<venv>` (made by `scripts/<venv>.sh`), or of the variable
/// `var` when set; a loud failure that says how to make it when it is missing: the
/// tests that need it never skip.
pub fn venv_python(var: &str, venv: &str, needs: &str) -> PathBuf {
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let py = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join("target").join(venv).join("bin/python"));
    assert!(
        py.exists(),
        "\n\n*** {} is missing: these tests need {needs}. Run\n\n    scripts/{venv}.sh\n\n\
         (scripts/test.sh does), or set {var} to a python with {needs}. ***\n",
        py.display()
    );
    py
}
