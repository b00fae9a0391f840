//! The metrics endpoint: scraped and parsed with a real Prometheus parser, fed bad
//! requests, slow clients and 200 connections held open, while this program keeps
//! allocating normally.

mod support;

use memquota::{Config, QuotaAlloc};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use support::run;

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

fn main() {
    run(&[
        ("scrape_parses_as_prometheus_and_json_matches", scrape_parses),
        ("bad_requests_get_errors_and_the_server_lives", bad_requests),
        ("held_open_connections_do_not_disturb_the_host", held_open_connections),
        ("scopes_are_scraped_with_labels", scopes_are_scraped),
    ]);
}

fn addr() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        memquota::init(Config::new().limit(1 << 30)).unwrap();
        memquota::serve_metrics("127.0.0.1:0").unwrap()
    })
}

/// Sends `request` raw and returns the whole response (the server closes).
fn exchange(request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn body(response: &str) -> &str {
    response.split_once("\r\n\r\n").map_or("", |(_, b)| b)
}

fn scrape_parses() {
    let _keep = vec![1u8; 3 << 20];
    memquota::flush_thread();
    let response = exchange(b"GET /metrics HTTP/1.0\r\n\r\n");
    assert!(response.starts_with("HTTP/1.0 200 OK\r\n"), "{response}");
    assert!(response.contains("Content-Type: text/plain; version=0.0.4"));
    let lines = body(&response).lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text");
    let value = |name: &str| {
        scrape.samples.iter().find(|s| s.metric == name).map(|s| match s.value {
            prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => f64::NAN,
        })
    };
    for name in [
        "memquota_limit_bytes",
        "memquota_headroom_bytes",
        "memquota_native_bytes",
        "memquota_native_peak_bytes",
        "memquota_overcommit_bytes",
        "memquota_heap_committed_bytes",
        "memquota_heap_used_bytes",
        "memquota_reclaimed_bytes_total",
        "memquota_oom_total",
        "memquota_jemalloc_allocated_bytes",
        "memquota_jemalloc_active_bytes",
        "memquota_jemalloc_resident_bytes",
        "memquota_jemalloc_retained_bytes",
        "memquota_process_rss_bytes",
        "memquota_untracked_bytes",
    ] {
        assert!(value(name).is_some(), "{name} missing");
    }
    assert_eq!(value("memquota_limit_bytes"), Some((1u64 << 30) as f64));
    assert!(value("memquota_native_bytes").unwrap() >= (3 << 20) as f64);
    let kinds: Vec<_> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == "memquota_reclaims_total")
        .filter_map(|s| s.labels.get("kind").map(str::to_owned))
        .collect();
    assert_eq!(kinds, ["sync", "background"]);
    assert!(scrape.docs.contains_key("memquota_native_bytes"), "HELP lines");
    let json = exchange(b"GET /stats.json HTTP/1.0\r\n\r\n");
    assert!(json.contains("Content-Type: application/json"));
    let j = body(&json);
    assert!(j.starts_with('{') && j.ends_with('}') && j.contains("\"limit_bytes\":1073741824"), "{j}");
}

fn scopes_are_scraped() {
    let task = memquota::MemoryManager::global().begin("scraped task", 77, 0).unwrap();
    let r = task.reserve(5 << 20).unwrap();
    let response = exchange(b"GET /metrics HTTP/1.0\r\n\r\n");
    let lines = body(&response).lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text");
    let held = scrape
        .samples
        .iter()
        .find(|s| s.metric == "memquota_scope_held_bytes" && s.labels.get("id") == Some("77"))
        .expect("the scope's series");
    // (Escaping is pinned by export's unit test: this parser does not unescape.)
    assert_eq!(held.labels.get("scope"), Some("scraped task"));
    assert!(matches!(held.value, prometheus_parse::Value::Gauge(v) if v == (5u64 << 20) as f64));
    let json = exchange(b"GET /scopes.json HTTP/1.0\r\n\r\n");
    let j = body(&json);
    assert!(j.contains("{\"name\":\"scraped task\",\"id\":77,\"priority\":0,\"held_bytes\":5242880"), "{j}");
    drop(r);
    assert!(!task.end().is_leak());
}

fn bad_requests() {
    assert!(exchange(b"GET /nope HTTP/1.0\r\n\r\n").starts_with("HTTP/1.0 404"));
    assert!(exchange(b"POST /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.0 405"));
    assert!(exchange(b"\r\n\r\n").starts_with("HTTP/1.0 400"));
    assert!(exchange(&[b'A'; 5000]).starts_with("HTTP/1.0 431"));
    assert!(exchange(&[0xff, 0xfe, 0, 1, b'\n', b'\n']).starts_with("HTTP/1.0 4"));
    // A slow client: half a request line, then silence. It is dropped after the
    // read timeout; meanwhile, and after, scrapes are answered.
    let mut slow = TcpStream::connect(addr()).unwrap();
    slow.write_all(b"GET /met").unwrap();
    // A client that connects and leaves at once.
    drop(TcpStream::connect(addr()).unwrap());
    assert!(exchange(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").starts_with("HTTP/1.0 200"));
    drop(slow);
}

fn held_open_connections() {
    let held: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(addr()).unwrap()).collect();
    // The host keeps working at full speed meanwhile: allocations are not blocked.
    let started = Instant::now();
    let mut sum = 0usize;
    for i in 0..200_000 {
        let v = vec![i as u8; 64 + i % 512];
        sum += v.len();
    }
    assert!(sum > 0);
    let took = started.elapsed();
    drop(held);
    // Once they are gone the endpoint answers again (bounded retries: the workers
    // first drain the queued idle connections, each after its read timeout).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = exchange(b"GET /metrics HTTP/1.0\r\n\r\n");
        if r.starts_with("HTTP/1.0 200") {
            break;
        }
        assert!(r.starts_with("HTTP/1.0 503") || r.is_empty(), "{r}");
        assert!(Instant::now() < deadline, "the endpoint never recovered");
        std::thread::yield_now();
    }
    println!("  200 held-open connections; the host's 200k allocations took {took:?}");
}
