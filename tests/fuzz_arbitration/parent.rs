//! The parent: one process per seed (a crash or a hang fails that seed alone) until
//! the time is up, each seed's summary line summed, failing seeds printed with the
//! command that runs them again.

use crate::*;

/// Runs seeds, each in a process of its own, until the time is up; prints what
/// failed and how to run it again.
pub fn run() -> ! {
    let secs = std::env::var(SECS_VAR).ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_SECS);
    let only: Option<u64> = std::env::var(SEED_VAR).ok().and_then(|s| s.parse().ok());
    let verbose = std::env::var(VERBOSE_VAR).is_ok_and(|v| !v.is_empty() && v != "0");
    let known = Known::from_env();
    let known_list: Vec<&str> = known.names().collect();
    println!(
        "fuzz_arbitration: {}, {PLANS_PER_SEED} plans per seed; known defects enabled: {}",
        match only {
            Some(seed) => format!("seed {seed} only"),
            None => format!("seeds from 1 for {secs} s ({SECS_VAR})"),
        },
        if known_list.is_empty() { "none".to_owned() } else { known_list.join(",") }
    );
    let started = Instant::now();
    let mut totals = Summary::default();
    let mut failed: Vec<u64> = Vec::new();
    let mut seed = only.unwrap_or(1);
    loop {
        let t0 = Instant::now();
        let (ok, out, why) = run_seed(seed);
        let summary = out.lines().find_map(Summary::parse).unwrap_or_default();
        totals.add(&summary);
        totals.seeds += 1;
        if ok {
            println!("seed {seed}: ok in {:.1} s: {summary}", t0.elapsed().as_secs_f64());
            if verbose {
                support::print_indented("output", out.as_bytes());
            }
        } else {
            failed.push(seed);
            println!("seed {seed}: FAILED ({why}) after {:.1} s; its output:", t0.elapsed().as_secs_f64());
            support::print_indented("output", out.as_bytes());
            println!("  re-run: {}", rerun_command(seed));
        }
        if only.is_some() || started.elapsed() >= Duration::from_secs(secs) {
            break;
        }
        seed += 1;
    }
    println!(
        "\nfuzz_arbitration: {} seeds, {} plans in {:.1} s: {totals}",
        totals.seeds,
        totals.plans,
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        println!("\nfailing seeds: {failed:?}");
        for s in &failed {
            println!("  {}", rerun_command(*s));
        }
    }
    support::summary(1, if failed.is_empty() { &[] } else { &["fuzz_arbitration"] });
    std::process::exit(0)
}

pub fn rerun_command(seed: u64) -> String {
    let known: Vec<&str> = Known::from_env().names().collect();
    let known = if known.is_empty() { String::new() } else { format!("{KNOWN_VAR}={} ", known.join(",")) };
    format!("{SEED_VAR}={seed} {known}cargo test --release --test fuzz_arbitration")
}

/// Runs one seed's process. Its success, its output (stdout then stderr), and why it
/// failed.
pub fn run_seed(seed: u64) -> (bool, String, String) {
    let mut cmd = Command::new(std::env::current_exe().expect("own path"));
    cmd.env(CHILD_VAR, seed.to_string());
    // Its watchdog ends it first; this bound is for a watchdog that could not.
    let bound = PLAN_BUDGET * PLANS_PER_SEED as u32 + Duration::from_secs(20);
    let (out, killed) = support::output_within(&mut cmd, bound);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    use std::os::unix::process::ExitStatusExt;
    let why = match (killed, out.status.code(), out.status.signal()) {
        (true, _, _) => format!("killed after {} s", bound.as_secs()),
        (_, Some(0), _) => String::new(),
        (_, Some(support::HUNG), _) => "hung: the watchdog fired".into(),
        (_, Some(c), _) => format!("exit {c}"),
        (_, _, Some(libc::SIGABRT)) => "aborted (SIGABRT)".into(),
        (_, _, Some(s)) => format!("killed by signal {s}"),
        _ => format!("{:?}", out.status),
    };
    (!killed && out.status.success(), text, why)
}

/// What a seed's plans did, summed: the last line of its output, and the run's total.
#[derive(Clone, Copy, Debug, Default)]
pub struct Summary {
    pub seeds: u64,
    pub plans: u64,
    pub steps: u64,
    pub ok: u64,
    pub refused: u64,
    pub rollbacks: u64,
    pub splits: u64,
    pub ended: u64,
    pub forks: u64,
    pub scopes_ended_early: u64,
    pub machine_waits: u64,
    pub machine_rollbacks: u64,
    pub machine_splits: u64,
    pub machine_timeouts: u64,
    pub overcommits: u64,
    pub spills: u64,
    pub budget_table_full: u64,
    pub known_seen: u64,
}

impl Summary {
    pub const PREFIX: &'static str = "fuzz-summary:";

    pub fn fields(&mut self) -> [(&'static str, &mut u64); 17] {
        [
            ("plans", &mut self.plans),
            ("steps", &mut self.steps),
            ("ok", &mut self.ok),
            ("refused", &mut self.refused),
            ("rollbacks", &mut self.rollbacks),
            ("splits", &mut self.splits),
            ("ended", &mut self.ended),
            ("forks", &mut self.forks),
            ("early_ends", &mut self.scopes_ended_early),
            ("machine_waits", &mut self.machine_waits),
            ("machine_rollbacks", &mut self.machine_rollbacks),
            ("machine_splits", &mut self.machine_splits),
            ("machine_timeouts", &mut self.machine_timeouts),
            ("overcommits", &mut self.overcommits),
            ("spills", &mut self.spills),
            ("budget_table_full", &mut self.budget_table_full),
            ("known_seen", &mut self.known_seen),
        ]
    }

    pub fn parse(line: &str) -> Option<Summary> {
        let rest = line.strip_prefix(Summary::PREFIX)?;
        let mut s = Summary::default();
        for kv in rest.split_whitespace() {
            let (k, v) = kv.split_once('=')?;
            for (name, field) in s.fields() {
                if name == k {
                    *field = v.parse().ok()?;
                }
            }
        }
        Some(s)
    }

    pub fn add(&mut self, other: &Summary) {
        let mut o = *other;
        let theirs: Vec<u64> = o.fields().iter().map(|(_, v)| **v).collect();
        for ((_, mine), v) in self.fields().into_iter().zip(theirs) {
            *mine += v;
        }
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = *self;
        for (i, (k, v)) in s.fields().into_iter().enumerate() {
            write!(f, "{}{k}={v}", if i == 0 { "" } else { " " })?;
        }
        Ok(())
    }
}
