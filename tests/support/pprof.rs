//! A heap profile read back by a real pprof reader: the Go toolchain's `go tool pprof`
//! (Debian's `golang-go`, which scripts/test.sh installs). Shared by the tests of the
//! Rust face (tests/sites.rs), of the preload (ld_preload/tests/preload.rs) and of the
//! command (cli/tests/run.rs), each of which includes this file by its path.
#![allow(dead_code)] // each test binary uses its own part

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;

/// `GET path` from the endpoint at `addr`: the status line and the body.
pub fn get(addr: &str, path: &str) -> (String, Vec<u8>) {
    let mut s = std::net::TcpStream::connect(addr).expect("the endpoint accepts");
    s.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes()).unwrap();
    let mut response = Vec::new();
    s.read_to_end(&mut response).expect("a response");
    let head_end = response.windows(4).position(|w| w == b"\r\n\r\n").expect("an HTTP response") + 4;
    let head = String::from_utf8_lossy(&response[..head_end]);
    (head.lines().next().unwrap_or_default().to_string(), response[head_end..].to_vec())
}

/// `go tool pprof -top -sample_index=INDEX FILE`'s rows: each function's cumulative
/// value (its own and its callees', so that a site is found whatever the compiler
/// inlined into it) in bytes or objects, and the tool's whole output.
pub fn top(file: &Path, index: &str) -> (Vec<(u64, String)>, String) {
    let out = Command::new("go")
        .args(["tool", "pprof", "-top", &format!("-sample_index={index}")])
        .arg(file)
        .env("HOME", std::env::temp_dir())
        .output()
        .expect("`go` runs: install Debian's golang-go (scripts/test.sh does)");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "go tool pprof failed:\n{text}");
    let rows = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("flat"))
        .skip(1)
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            (words.len() >= 6).then(|| (value(words[3]), words[5..].join(" ")))
        })
        .collect();
    (rows, text)
}

/// `46.35MB`, `512kB`, `3B`, `728`: pprof's units are powers of 1024.
fn value(s: &str) -> u64 {
    let digits = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let n: f64 = digits.parse().unwrap_or(0.0);
    let scale = match &s[digits.len()..] {
        "kB" => 1u64 << 10,
        "MB" => 1 << 20,
        "GB" => 1 << 30,
        "TB" => 1 << 40,
        _ => 1,
    };
    (n * scale as f64) as u64
}

/// The cumulative value of the first row whose function's name contains `function`.
pub fn cum(rows: &[(u64, String)], function: &str) -> Option<u64> {
    rows.iter().find(|(_, name)| name.contains(function)).map(|(v, _)| *v)
}
