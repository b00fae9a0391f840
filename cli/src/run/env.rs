//! The program's command and environment: the preload in LD_PRELOAD, where and how
//! often to write the stats, the limit, and the JVM agent.

use super::RunArgs;
use memquota_core::seam::process::vars;
use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

/// The program of `args`, with the environment that puts it under `preload`, writing
/// its stats to `stats_path`.
pub(super) fn command(args: &RunArgs, preload: &Path, stats_path: &Path) -> Command {
    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..]);
    let ld_preload = match std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        Some(old) => {
            let mut v = preload.to_path_buf().into_os_string();
            v.push(":");
            v.push(old);
            v
        }
        None => preload.to_path_buf().into_os_string(),
    };
    cmd.env("LD_PRELOAD", ld_preload)
        .env(vars::STATS_FILE, stats_path)
        .env(vars::STATS_INTERVAL, format!("{}ms", args.interval.as_millis()));
    if let Some(limit) = &args.limit {
        cmd.env(vars::LIMIT, limit);
    }
    if args.jvm {
        cmd.env("JAVA_TOOL_OPTIONS", java_tool_options(preload));
    }
    cmd
}

/// `-agentpath:` for the preload (the agent reads the budget from the same
/// `MEMQUOTA_*` variables), before any JAVA_TOOL_OPTIONS already set. The path has no
/// space: `find_preload` refuses one, and the JVM splits these options on spaces.
fn java_tool_options(preload: &Path) -> OsString {
    let mut v = OsString::from("-agentpath:");
    v.push(preload);
    if let Some(old) = std::env::var_os("JAVA_TOOL_OPTIONS").filter(|v| !v.is_empty()) {
        v.push(" ");
        v.push(old);
    }
    v
}
