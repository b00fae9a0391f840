//! `memquota`: run a program under the memquota budget (libmemquota.so) and watch it,
//! or read a snapshot of a budget from a stats file or a metrics endpoint.
//!
//! Exit status: `run` passes the program's on (its code, or its signal); memquota's
//! own failures (bad flags, no preload, nothing to read) exit with 2, a program that
//! cannot be started with 127 (not found) or 126.

mod fetch;
mod plot;
mod profile;
mod run;
mod snapshot;
mod symbols;
mod tree;
mod units;

use clap::{Parser, Subcommand};
use std::io::Write;

#[derive(Parser, Debug)]
#[command(
    name = "memquota",
    version,
    about = "One memory budget for a process: run a program under it, watch it, plot it"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a program under libmemquota.so: a live status line, a summary at the end,
    /// an optional SVG timeline; its exit status (or signal) passed through.
    #[command(
        override_usage = "memquota run [OPTIONS] -- CMD [ARGS]...",
        after_help = "Example: memquota run --limit 2g --plot timeline.svg -- java -jar app.jar"
    )]
    Run(run::RunArgs),
    /// Print a snapshot of the budget from a stats file (MEMQUOTA_STATS_FILE) or a
    /// metrics endpoint (MEMQUOTA_METRICS_ADDR, such as 127.0.0.1:9464); of a process
    /// tree from a directory of stats files (MEMQUOTA_STATS_FILE=DIR/ or a path with
    /// %p) or several files: a row per process and the sums.
    #[command(
        after_help = "Example: MEMQUOTA_STATS_FILE=/tmp/mq/ memquota run -- server; memquota stat /tmp/mq"
    )]
    Stat {
        /// Stats files or directories of them, or one endpoint: HOST:PORT or
        /// http://HOST:PORT[/PATH].
        #[arg(value_name = "FILE|DIR|ADDR", required = true)]
        sources: Vec<String>,
    },
    /// Print the top sites of a running program's live memory from its heap profile
    /// (GET /debug/pprof/heap on MEMQUOTA_METRICS_ADDR; the profile is on by default,
    /// off with MEMQUOTA_PROFILE_SAMPLE=0), named by addr2line; or write the profile
    /// for pprof (--out).
    #[command(
        after_help = "Examples: memquota profile 127.0.0.1:9464 --top 20\n          memquota profile 127.0.0.1:9464 --out heap.pb.gz && go tool pprof -top heap.pb.gz"
    )]
    Profile(profile::ProfileArgs),
}

/// A failure of memquota itself, with the exit code it ends with.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure { code: 2, message }
    }
}

fn stat(sources: &[String]) -> Result<(), Failure> {
    let one = |source: &str| -> Result<snapshot::Snapshot, Failure> {
        let text = fetch::read(source)?;
        Ok(snapshot::Snapshot::parse(&text).map_err(|e| format!("{source}: {e}"))?)
    };
    let out = match sources {
        [source] if !std::path::Path::new(source).is_dir() => {
            format!("memquota stats from {source}\n{}", one(source)?.table())
        }
        _ => {
            let mut members = Vec::new();
            for source in sources {
                for file in tree::files(source)? {
                    members.push(tree::Member { snapshot: one(&file)?, source: file });
                }
            }
            let from = sources.join(" ");
            format!("memquota stats of {} processes from {from}\n{}", members.len(), tree::table(&members))
        }
    };
    let _ = std::io::stdout().write_all(out.as_bytes());
    Ok(())
}

fn main() {
    let result = match Cli::parse().command {
        Cmd::Run(args) => run::run(args).map(|status| run::pass_through(status)),
        Cmd::Stat { sources } => stat(&sources),
        Cmd::Profile(args) => profile::profile(&args),
    };
    if let Err(Failure { code, message }) = result {
        let _ = writeln!(std::io::stderr(), "memquota: {message}");
        std::process::exit(code);
    }
}
