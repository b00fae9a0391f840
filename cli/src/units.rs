//! Sizes and durations on the command line, and bytes for people.

use std::time::Duration;

/// Checks a `--limit` with the core's `parse_limit`, the parser `MEMQUOTA_LIMIT` goes
/// through. Returns the text unchanged, for the preload to read.
pub fn parse_limit(s: &str) -> Result<String, String> {
    match memquota_core::seam::process::parse_limit(s.trim()) {
        Some(_) => Ok(s.trim().to_string()),
        None => Err("expected a size above zero (512m, 2g, 1073741824) or a percentage of RAM (75%)".into()),
    }
}

/// The least interval the preload accepts for `MEMQUOTA_STATS_INTERVAL`.
pub const MIN_INTERVAL: Duration = memquota_core::seam::process::MIN_STATS_INTERVAL;

/// `250ms`, `2s` or bare milliseconds (the core's `parse_duration`), at least 10ms.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    match memquota_core::seam::process::parse_duration(s) {
        Some(d) if d >= MIN_INTERVAL => Ok(d),
        _ => Err("expected a duration of at least 10ms (100ms, 2s)".into()),
    }
}

/// `512 B`, `4.0 KiB`, `12.3 MiB`, `2.0 GiB`: the core's byte format, short form.
pub fn bytes(b: u64) -> String {
    format!("{:#}", memquota_core::seam::text::Size(b))
}

/// Bytes as MiB, for the plot's axis.
pub fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits() {
        for ok in ["2g", "512M", "1073741824", "8GiB", "64mb", "75%", "100%", " 1t "] {
            assert!(parse_limit(ok).is_ok(), "{ok}");
        }
        for bad in ["", "0", "0g", "lots", "2x", "-1g", "0%", "101%", "%", "99999999999999t"] {
            assert!(parse_limit(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn intervals() {
        assert_eq!(parse_interval("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_interval("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_interval("10ms"), Ok(MIN_INTERVAL));
        assert_eq!(parse_interval("250"), Ok(Duration::from_millis(250)), "bare milliseconds");
        for bad in ["9ms", "0s", "fast", "1.5s", "ms"] {
            assert!(parse_interval(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn human_bytes() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(4096), "4.0 KiB");
        assert_eq!(bytes(64 << 20), "64.0 MiB");
        assert_eq!(bytes(3 << 29), "1.5 GiB");
    }
}
