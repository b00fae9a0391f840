//! The flight recorder's records (`MEMQUOTA_PROFILE_DIR`): what the process looked
//! like when the budget refused. Written on the sampler thread (`policy/flight.rs`
//! hands the request over from the refusing thread), which may allocate: one
//! directory per record, `memquota-PID-N`, made under a temporary name and renamed
//! when complete, so a reader never sees half a record:
//!
//! * `heap.pb.gz`: the heap profile, as `GET /debug/pprof/heap` serves it (or
//!   `heap.txt` saying why there is none);
//! * `stats.json`, `scopes.json`: as the endpoint's `/stats.json` and `/scopes.json`;
//! * `container.json`: the container's figures (cgroup, memory pressure);
//! * `report.txt`: the report of the refusal.

use crate::base::stats::{ContainerStats, PressureSource};
use crate::base::sync::OnceLock;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

static DIR: OnceLock<PathBuf> = OnceLock::new();

/// Records into `dir` from now on (the first directory given wins).
pub(crate) fn install(dir: &str) {
    if DIR.set(PathBuf::from(dir)).is_ok() {
        crate::policy::flight::set_writer(write);
    }
}

/// Writes record `n`; a failure is said once on stderr per record.
fn write(n: u64) {
    let Some(dir) = DIR.get() else { return };
    if let Err(e) = write_record(dir, n) {
        crate::base::text::write_stderr(&format!(
            "memquota: the flight recorder could not write to {} (MEMQUOTA_PROFILE_DIR): {e}\n",
            dir.display()
        ));
    }
}

fn write_record(dir: &Path, n: u64) -> std::io::Result<PathBuf> {
    let pid = std::process::id();
    let name = format!("memquota-{pid}-{n}");
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::create_dir_all(&tmp)?;
    let stats = crate::policy::snapshot::stats();
    let mut text = String::with_capacity(4096);
    let _ = crate::process::export::write_json(&mut text, &stats);
    std::fs::write(tmp.join("stats.json"), &text)?;
    text.clear();
    let _ = crate::process::export::write_scopes_json(&mut text, &crate::MemoryManager::global().snapshot());
    std::fs::write(tmp.join("scopes.json"), &text)?;
    std::fs::write(tmp.join("container.json"), container_json(&stats.container))?;
    let report = crate::policy::report::last_report().unwrap_or_default();
    std::fs::write(tmp.join("report.txt"), report)?;
    match crate::policy::profile::heap_profile() {
        Some(profile) => std::fs::write(tmp.join("heap.pb.gz"), profile)?,
        None => std::fs::write(
            tmp.join("heap.txt"),
            if crate::policy::profile::available() {
                "no heap profile: MEMQUOTA_PROFILE_SAMPLE was set to 0 (the default, 512k, samples once per 512 KiB \
                 allocated, as Go does)\n"
            } else {
                "no heap profile: jemalloc is built without profiling (the memquota crate's `profile` feature), \
                 or MALLOC_CONF / _RJEM_MALLOC_CONF set prof:false\n"
            },
        )?,
    }
    let done = dir.join(&name);
    std::fs::rename(&tmp, &done)?;
    Ok(done)
}

/// The container's figures as one JSON object.
fn container_json(c: &ContainerStats) -> String {
    let pressure = match c.pressure {
        PressureSource::Unavailable => "unavailable",
        PressureSource::Cgroup => "cgroup",
        PressureSource::System => "system",
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{{\"cgroup_version\":{},\"limit_bytes\":{},\"high_bytes\":{},\"anon_bytes\":{},\"anon_peak_bytes\":{},\
         \"limit_follows\":{},\"limit_changes\":{},\"anon_requests\":{},\"pressure_events\":{},\
         \"pressure_source\":\"{pressure}\",\"pressure_window_ms\":{}}}",
        c.cgroup_version,
        c.limit,
        c.high,
        c.anon,
        c.anon_peak,
        c.limit_follows,
        c.limit_changes,
        c.anon_requests,
        c.pressure_events,
        c.pressure_window_ms,
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_containers_figures_are_one_json_object() {
        let c = ContainerStats {
            cgroup_version: 2,
            limit: 1 << 30,
            pressure: PressureSource::Cgroup,
            ..Default::default()
        };
        let text = container_json(&c);
        assert!(text.starts_with("{\"cgroup_version\":2,\"limit_bytes\":1073741824,"), "{text}");
        assert!(text.contains("\"pressure_source\":\"cgroup\""), "{text}");
        assert!(text.ends_with("}\n"), "{text}");
    }
}
