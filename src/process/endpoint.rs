//! The metrics endpoint: `GET /metrics` (Prometheus text), `GET /stats.json`,
//! `GET /scopes.json` and `GET /debug/pprof/heap` (the heap profile, gzipped
//! `profile.proto`) over plain HTTP/1.0 on a loopback address unless told otherwise.
//!
//! Built to never disturb the host: one accept thread hands connections to a few
//! workers through a bounded queue; when the queue is full the connection gets a
//! `503` at once. Every read and write has a short timeout, a request is at most
//! 4 KiB, and the threads are exempt from the budget's policy (their allocations are
//! counted, never refused, never made to wait for a reclaim).

use crate::base::error::{Error, Result};
use crate::base::sync::mpsc::{sync_channel, Receiver, TrySendError};
use crate::base::sync::{Arc, Mutex};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// The address used when none is given: loopback only.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9464";

const WORKERS: usize = 4;
const QUEUE: usize = 64;
const IO_TIMEOUT: Duration = Duration::from_millis(500);
const MAX_REQUEST: usize = 4096;

/// Starts serving the stats on `addr` (`"127.0.0.1:9464"`; port 0 picks a free one)
/// and returns the address bound.
///
/// # Errors
/// [`Error::BadConfig`] if `addr` is not a socket address or cannot be bound.
pub fn serve_metrics(addr: &str) -> Result<SocketAddr> {
    let parsed: SocketAddr = addr.parse().map_err(|_| Error::BadConfig {
        setting: "metrics_addr",
        reason: format!("{addr:?} is not an address like {DEFAULT_METRICS_ADDR}"),
    })?;
    let listener = TcpListener::bind(parsed).map_err(|e| Error::BadConfig {
        setting: "metrics_addr",
        reason: format!("cannot bind {addr}: {e}"),
    })?;
    let bound = listener.local_addr().unwrap_or(parsed);
    let (tx, rx) = sync_channel::<TcpStream>(QUEUE);
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..WORKERS {
        let rx = Arc::clone(&rx);
        spawn(&format!("memquota-http-{i}"), move || worker(&rx));
    }
    spawn("memquota-http", move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            match tx.try_send(conn) {
                Ok(()) => {}
                Err(TrySendError::Full(mut conn)) => {
                    let _ = conn.set_write_timeout(Some(IO_TIMEOUT));
                    let _ = respond(&mut conn, "503 Service Unavailable", "text/plain", b"busy\n");
                }
                Err(TrySendError::Disconnected(_)) => return,
            }
        }
    });
    Ok(bound)
}

fn spawn(name: &str, body: impl FnOnce() + Send + 'static) {
    let _ = crate::ledger::threads::spawn_service(name, body);
}

fn worker(rx: &Mutex<Receiver<TcpStream>>) {
    loop {
        let conn = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(mut conn) = conn else { return };
        let _ = conn.set_read_timeout(Some(IO_TIMEOUT));
        let _ = conn.set_write_timeout(Some(IO_TIMEOUT));
        serve(&mut conn);
    }
}

/// Reads one request (up to the blank line) and answers it.
fn serve(conn: &mut TcpStream) {
    let mut buf = [0u8; MAX_REQUEST];
    let mut len = 0;
    while !buf[..len].windows(4).any(|w| w == b"\r\n\r\n") && !buf[..len].windows(2).any(|w| w == b"\n\n") {
        if len == buf.len() {
            let _ = respond(conn, "431 Request Header Fields Too Large", "text/plain", b"too large\n");
            return;
        }
        match conn.read(&mut buf[len..]) {
            Ok(0) | Err(_) => return, // closed or too slow: nothing to answer
            Ok(n) => len += n,
        }
    }
    let request = String::from_utf8_lossy(&buf[..len]);
    let mut words = request.lines().next().unwrap_or("").split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let _ = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => {
            let mut text = String::with_capacity(4096);
            let _ = crate::process::export::write_prometheus(&mut text, &crate::policy::snapshot::stats());
            let _ = crate::process::export::write_scopes_prometheus(
                &mut text,
                &crate::MemoryManager::global().snapshot(),
            );
            respond(conn, "200 OK", "text/plain; version=0.0.4", text.as_bytes())
        }
        ("GET", "/stats.json") => {
            let mut text = String::with_capacity(2048);
            let _ = crate::process::export::write_json(&mut text, &crate::policy::snapshot::stats());
            respond(conn, "200 OK", "application/json", text.as_bytes())
        }
        ("GET", "/scopes.json") => {
            let mut text = String::with_capacity(2048);
            let _ = crate::process::export::write_scopes_json(
                &mut text,
                &crate::MemoryManager::global().snapshot(),
            );
            respond(conn, "200 OK", "application/json", text.as_bytes())
        }
        ("GET", "/debug/pprof/heap") => match heap_profile() {
            Ok(profile) => respond(conn, "200 OK", "application/octet-stream", &profile),
            Err((status, why)) => respond(conn, status, "text/plain", why.as_bytes()),
        },
        ("GET", _) => respond(
            conn,
            "404 Not Found",
            "text/plain",
            b"try /metrics, /stats.json, /scopes.json or /debug/pprof/heap\n",
        ),
        ("", _) => respond(conn, "400 Bad Request", "text/plain", b"bad request\n"),
        _ => respond(conn, "405 Method Not Allowed", "text/plain", b"GET only\n"),
    };
}

/// The heap profile, or the status and words of why there is none.
fn heap_profile() -> std::result::Result<Vec<u8>, (&'static str, &'static str)> {
    use crate::policy::profile;
    if !profile::available() {
        return Err((
            "404 Not Found",
            "no heap profile in this build: jemalloc is built without profiling (the memquota crate's \
             `profile` feature; libmemquota.so has it), or MALLOC_CONF / _RJEM_MALLOC_CONF set prof:false\n",
        ));
    }
    profile::heap_profile().ok_or((
        "503 Service Unavailable",
        "the heap profile is off: MEMQUOTA_PROFILE_SAMPLE (or Config::profile_sample) was set to 0; \
         unset it (the default, 512k, samples once per 512 KiB allocated, as Go does) or give a rate \
         before the program starts\n",
    ))
}

fn respond(conn: &mut TcpStream, status: &str, kind: &str, body: &[u8]) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.0 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes())?;
    conn.write_all(body)
}
