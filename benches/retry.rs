//! Work that completes under pressure: N tasks whose peaks together exceed the budget,
//! run three ways in one process, interleaved, for several rounds:
//!
//! * **U**: no limit (the time the work takes when memory is not the problem);
//! * **P**: a limit, plain requests: a task whose buffer is refused fails;
//! * **R**: the same limit, each task in `with_retry`: requests wait, the youngest
//!   task rolls back when all are stuck.
//!
//! Run:
//!
//!     cargo bench --bench retry                      # 8 tasks x 3 x 24 MiB, 192 MiB, 5 rounds
//!     MEMQUOTA_BENCH_ROUNDS=3 cargo bench --bench retry
//!
//! Prints, per mode, the median wall time, tasks completed, and the retry machine's
//! counts; then R/U (target <= 1.5, with every task completed). Not run in CI.

use memquota::{with_retry, MemoryManager, QuotaAlloc};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

const MIB: u64 = 1 << 20;
const TASKS: u64 = 8;
const BUFFERS: usize = 3;
const BUFFER: u64 = 24 * MIB;
const LIMIT: u64 = 192 * MIB;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Unlimited,
    Plain,
    Retry,
}

/// One task's work: three buffers taken one after another, each filled and read
/// (every page touched), all held together at the end.
fn work(seed: u64) -> memquota::Result<u64> {
    let mut held: Vec<Vec<u64>> = Vec::with_capacity(BUFFERS);
    let mut sum = 0u64;
    for b in 0..BUFFERS as u64 {
        let words = (BUFFER / 8) as usize;
        let mut v: Vec<u64> = Vec::new();
        v.try_reserve_exact(words)?;
        v.extend((0..words as u64).map(|i| i ^ seed ^ b));
        sum = sum.wrapping_add(v.iter().step_by(512).sum::<u64>());
        held.push(v);
    }
    Ok(sum)
}

struct Run {
    wall: Duration,
    completed: u64,
}

fn run(mode: Mode, round: u64) -> Run {
    memquota::set_limit(if mode == Mode::Unlimited { 64 << 30 } else { LIMIT });
    let start = Arc::new(Barrier::new(TASKS as usize));
    let completed = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let threads: Vec<_> = (0..TASKS)
        .map(|id| {
            let (start, completed) = (Arc::clone(&start), Arc::clone(&completed));
            std::thread::spawn(move || {
                let scope = MemoryManager::global().begin("bench", round * TASKS + id, 0).unwrap();
                start.wait();
                let r = match mode {
                    Mode::Retry => with_retry(&scope, || work(id)),
                    _ => {
                        let _a = scope.attach().unwrap();
                        work(id)
                    }
                };
                if r.is_ok() {
                    completed.fetch_add(1, Relaxed);
                }
                drop(scope);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    Run { wall: t0.elapsed(), completed: completed.load(Relaxed) }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let rounds: u64 = std::env::var("MEMQUOTA_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    memquota::init(memquota::Config::new().limit(LIMIT)).unwrap();
    // Refusals in P are expected: count them, do not print a report for each.
    memquota::set_report_hook(|_| {});
    println!(
        "{TASKS} tasks x {BUFFERS} x {} MiB (peaks {} MiB together) under {} MiB; {rounds} rounds, interleaved",
        BUFFER / MIB,
        TASKS * BUFFERS as u64 * BUFFER / MIB,
        LIMIT / MIB
    );
    let modes = [Mode::Unlimited, Mode::Plain, Mode::Retry];
    let mut walls: [Vec<Duration>; 3] = Default::default();
    let mut done = [0u64; 3];
    let before = memquota::stats().retry;
    for round in 0..rounds {
        for k in 0..3 {
            let m = (k + round as usize) % 3;
            let r = run(modes[m], round);
            walls[m].push(r.wall);
            done[m] += r.completed;
        }
    }
    let after = memquota::stats().retry;
    let total = rounds * TASKS;
    let med: Vec<Duration> = walls.iter().map(|w| median(w.clone())).collect();
    for (m, mode) in modes.iter().enumerate() {
        println!(
            "{:>10?}: median wall {:>8.1} ms, completed {:>3} of {total}",
            mode,
            med[m].as_secs_f64() * 1e3,
            done[m]
        );
    }
    println!(
        "retry machine (R): waits {}, rollbacks {}, retries {}, splits {}, watchdog refusals {}",
        after.waits - before.waits,
        after.rollbacks - before.rollbacks,
        after.retries - before.retries,
        after.splits - before.splits,
        after.timeouts - before.timeouts
    );
    println!(
        "R/U wall {:.2} (target <= 1.5, every task completed: {})",
        med[2].as_secs_f64() / med[0].as_secs_f64(),
        done[2] == total
    );
}
