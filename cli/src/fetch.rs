//! Where `memquota stat` and `memquota profile` read from: a file, or a metrics
//! endpoint over plain HTTP/1.0 (`GET /metrics`, `GET /debug/pprof/heap`), with
//! timeouts and a size cap.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::{Duration, Instant};

/// How long connecting, and then the whole exchange, may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// The most we read from an endpoint (the exposition is about 3 KiB).
const MAX_RESPONSE: usize = 4 << 20;

/// Reads the Prometheus text from `source`: a file if one exists at that path, else
/// an endpoint given as `HOST:PORT` or `http://HOST:PORT[/PATH]`.
pub fn read(source: &str) -> Result<String, String> {
    let path = Path::new(source);
    if path.exists() {
        return std::fs::read_to_string(path).map_err(|e| format!("cannot read {source}: {e}"));
    }
    read_bytes(source, "/metrics").map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// The bytes at `source`: a file if one exists at that path, else what an endpoint
/// given as `HOST:PORT` (then `GET default_path`) or `http://HOST:PORT[/PATH]` answers.
pub fn read_bytes(source: &str, default_path: &str) -> Result<Vec<u8>, String> {
    let path = Path::new(source);
    if path.exists() {
        return std::fs::read(path).map_err(|e| format!("cannot read {source}: {e}"));
    }
    let (authority, request_path) = split_url(source, default_path);
    let addrs: Vec<SocketAddr> = match authority.to_socket_addrs() {
        Ok(addrs) => addrs.collect(),
        Err(_) => {
            return Err(format!(
                "{source}: no such file, and not an endpoint address (HOST:PORT, such as 127.0.0.1:9464)"
            ))
        }
    };
    get(authority, &addrs, request_path).map_err(|e| format!("{source}: no such file, and {e}"))
}

/// `http://127.0.0.1:9464/metrics` -> (`127.0.0.1:9464`, `/metrics`); a bare address
/// gets `default_path`.
fn split_url<'a>(source: &'a str, default_path: &'a str) -> (&'a str, &'a str) {
    let rest = source.strip_prefix("http://").unwrap_or(source);
    match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, default_path),
    }
}

fn get(authority: &str, addrs: &[SocketAddr], path: &str) -> Result<Vec<u8>, String> {
    let mut last = String::from("it resolves to no address");
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(addr, TIMEOUT) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = format!("connecting to {addr} failed: {e}"),
        }
    }
    let mut stream = stream.ok_or(last)?;
    let deadline = Instant::now() + TIMEOUT;
    let io = |e: std::io::Error| format!("reading from {authority} failed: {e}");
    stream.set_write_timeout(Some(TIMEOUT)).map_err(io)?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(io)?;
    let mut response = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("{authority} did not answer within {} s", TIMEOUT.as_secs()));
        }
        stream.set_read_timeout(Some(left)).map_err(io)?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) if response.len() + n > MAX_RESPONSE => {
                return Err(format!("{authority} sent more than {} MiB", MAX_RESPONSE >> 20))
            }
            Ok(n) => response.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(format!("{authority} did not answer within {} s", TIMEOUT.as_secs()))
            }
            Err(e) => return Err(io(e)),
        }
    }
    body(&response).map_err(|e| format!("{authority} {e}"))
}

/// The body of a complete HTTP/1.x response, if its status is 200; else the status
/// and the first line of what the endpoint said.
fn body(response: &[u8]) -> Result<Vec<u8>, String> {
    let end = response.windows(4).position(|w| w == b"\r\n\r\n").ok_or("sent no HTTP response")?;
    let head = String::from_utf8_lossy(&response[..end]);
    let body = &response[end + 4..];
    let status = head.lines().next().unwrap_or_default();
    let mut words = status.split_whitespace();
    match (words.next(), words.next()) {
        (Some(v), Some("200")) if v.starts_with("HTTP/1.") => Ok(body.to_vec()),
        (Some(v), Some(_)) if v.starts_with("HTTP/1.") => {
            let said = String::from_utf8_lossy(body);
            match said.lines().next().filter(|l| !l.is_empty()) {
                Some(line) => Err(format!("answered {status:?}: {line}")),
                None => Err(format!("answered {status:?}")),
            }
        }
        _ => Err("sent no HTTP response".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(split_url("127.0.0.1:9464", "/metrics"), ("127.0.0.1:9464", "/metrics"));
        assert_eq!(split_url("http://localhost:80/m", "/metrics"), ("localhost:80", "/m"));
        assert_eq!(split_url("http://[::1]:9464", "/debug/pprof/heap"), ("[::1]:9464", "/debug/pprof/heap"));
    }

    #[test]
    fn responses() {
        assert_eq!(body(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\na 1\n").unwrap(), b"a 1\n");
        assert!(body(b"HTTP/1.1 404 Not Found\r\n\r\n").unwrap_err().contains("404"));
        let off =
            body(b"HTTP/1.0 503 Service Unavailable\r\n\r\nthe heap profile is off: set X\n").unwrap_err();
        assert!(
            off.ends_with("\"HTTP/1.0 503 Service Unavailable\": the heap profile is off: set X"),
            "{off}"
        );
        assert!(body(b"SSH-2.0-OpenSSH\r\n").is_err());
        assert!(body(b"").is_err());
    }
}
