//! Sizes and durations on the command line, and bytes for people.

use std::time::Duration;

/// Checks a `--limit` the way the preload reads `MEMQUOTA_LIMIT` (memquota's
/// `parse_limit`): bytes, `512k`, `512m`, `8g`, `1t` (binary units, optional `b`/`ib`,
/// any case), or a percentage of the machine in (0, 100]. Returns the text unchanged,
/// for the preload to read.
pub fn parse_limit(s: &str) -> Result<String, String> {
    let ok = match s.trim().strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().is_ok_and(|p| p > 0.0 && p <= 100.0),
        None => parse_size(s).is_some_and(|b| b > 0),
    };
    if ok {
        Ok(s.trim().to_string())
    } else {
        Err("expected a size above zero (512m, 2g, 1073741824) or a percentage of RAM (75%)".into())
    }
}

/// Digits, then an optional binary unit: `k`, `m`, `g`, `t`, with an optional `b` or `ib`.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim().to_ascii_lowercase();
    let digits_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits_end);
    let num: u64 = num.parse().ok()?;
    let unit = unit.trim();
    let unit = unit.strip_suffix("ib").or_else(|| unit.strip_suffix('b')).unwrap_or(unit);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return None,
    };
    num.checked_mul(1u64 << shift)
}

/// The least interval the preload accepts for `MEMQUOTA_STATS_INTERVAL`.
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);

/// `250ms` or `2s`, at least 10ms. The unit is required: the preload reads a bare
/// number as seconds and the Rust configuration as milliseconds.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let ms = match s.strip_suffix("ms") {
        Some(n) => n.trim().parse::<u64>().ok(),
        None => s.strip_suffix('s').and_then(|n| n.trim().parse::<u64>().ok()?.checked_mul(1000)),
    };
    match ms.map(Duration::from_millis) {
        Some(d) if d >= MIN_INTERVAL => Ok(d),
        _ => Err("expected a duration of at least 10ms, with its unit (100ms, 2s)".into()),
    }
}

/// `512 B`, `4.0 KiB`, `12.3 MiB`, `2.0 GiB`.
pub fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
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
        assert_eq!(parse_size("4k"), Some(4096));
        assert_eq!(parse_size("2G"), Some(2 << 30));
    }

    #[test]
    fn intervals() {
        assert_eq!(parse_interval("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_interval("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_interval("10ms"), Ok(MIN_INTERVAL));
        for bad in ["9ms", "100", "0s", "fast", "1.5s", "ms"] {
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
