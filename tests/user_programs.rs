//! Programs that behave like those a user found: they keep allocating after
//! refusals. Each runs in a process of its own and must keep tracked bytes within
//! `limit + (threads + 1) * threshold + reserve` (refuse_min is 0 here, the Rust
//! face's default; the emergency reserve is what refused threads may draw on), count
//! every refusal once, and write only a few full reports.

mod support;

use memquota::{Config, QuotaAlloc};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use support::{Monitor, Reports, Rng, Size, KIB, MIB};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

fn main() {
    support::run_isolated(
        &[
            ("try_reserve_exact_8000_in_a_loop_at_64m", try_reserve_exact_8000_in_a_loop_at_64m),
            (
                "eight_threads_hammering_an_8m_limit_for_a_second",
                eight_threads_hammering_an_8m_limit_for_a_second,
            ),
        ],
        Duration::from_secs(30),
    );
}

/// Threads alive besides the program's own: main, the monitor, the watchdog.
const SERVICE_THREADS: u64 = 3;

struct Outcome {
    threads: u64,
    granted_bytes: u64,
    errs: u64,
    elapsed: Duration,
    samples: support::Samples,
    reports: Reports,
    ooms: u64,
}

/// Prints the figures, then asserts the bound, the count and the reports.
fn judge(o: Outcome) {
    let s = memquota::stats();
    let threads = o.threads.max(o.samples.max_threads);
    let reserve = memquota::seam::slow::emergency_reserve_for(s.limit);
    let bound = s.limit + (threads + 1) * s.threshold + reserve;
    let secs = o.elapsed.as_secs_f64();
    let full_allowed = 2 + 2 * secs.ceil() as u64;
    println!(
        "  {} granted, {} refusals, in {} ms; peak {} (limit {} + ({threads} threads + 1) x {} + reserve {} \
         = {}); max sampled {} over {} samples",
        Size(o.granted_bytes),
        o.errs,
        o.elapsed.as_millis(),
        Size(s.native_peak),
        Size(s.limit),
        s.threshold,
        Size(reserve),
        Size(bound),
        Size(o.samples.max_native),
        o.samples.count
    );
    println!(
        "  ooms +{}; full reports {} ({} hook calls, {} bytes; at most {full_allowed} full and 64 KiB allowed)",
        o.ooms, o.reports.full, o.reports.calls, o.reports.bytes
    );
    let first = support::first_report();
    if let Some(line) = first.lines().find(|l| l.contains("native tracked")) {
        println!("  the first full report said:{line}");
    }
    assert!(
        s.native_peak <= bound,
        "the peak {} passed limit + bound {} by {}",
        Size(s.native_peak),
        Size(bound),
        Size(s.native_peak - bound)
    );
    assert!(o.samples.max_native <= bound, "a sample saw {}", Size(o.samples.max_native));
    assert_eq!(o.ooms, o.errs, "stats().ooms counts each refusal the program saw, once");
    assert!(o.reports.full <= full_allowed, "{} full reports in {secs:.1} s", o.reports.full);
    assert!(o.reports.bytes <= 64 * KIB, "{} bytes of reports in {secs:.1} s", o.reports.bytes);
}

/// `Vec::try_reserve_exact(8000)` 200,000 times at a 64 MiB limit, keeping what it
/// gets and going on after each `Err`.
fn try_reserve_exact_8000_in_a_loop_at_64m() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    let mut held: Vec<Vec<u8>> = Vec::with_capacity(200_000);
    let monitor = Monitor::start();
    let (ooms0, reports0) = (memquota::stats().ooms, Reports::now());
    let started = Instant::now();
    let (mut granted, mut errs) = (0u64, 0u64);
    for _ in 0..200_000 {
        let mut v: Vec<u8> = Vec::new();
        match v.try_reserve_exact(8000) {
            Ok(()) => {
                granted += 8000;
                held.push(v);
            }
            Err(_) => errs += 1,
        }
    }
    let elapsed = started.elapsed();
    let samples = monitor.stop();
    let (ooms, reports) = (memquota::stats().ooms - ooms0, Reports::now().since(reports0));
    drop(held);
    judge(Outcome {
        threads: SERVICE_THREADS,
        granted_bytes: granted,
        errs,
        elapsed,
        samples,
        reports,
        ooms,
    });
}

static OPS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

/// Eight threads allocate 1 KiB - 1 MiB blocks (keeping the last 16 each) at an
/// 8 MiB limit for a second.
fn eight_threads_hammering_an_8m_limit_for_a_second() {
    const THREADS: usize = 8;
    memquota::init(Config::new().limit(8 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    support::watchdog(|l| {
        use std::fmt::Write;
        let _ = write!(l, "  operations per thread:");
        for o in &OPS {
            let _ = write!(l, " {}", o.load(SeqCst));
        }
        let _ = writeln!(l);
    });
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let monitor = Monitor::start();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let barrier = Arc::clone(&barrier);
            let mut ring: Vec<Vec<u8>> = Vec::with_capacity(16);
            std::thread::spawn(move || {
                let mut rng = Rng(0x4a11_0000 + t as u64);
                let (mut granted, mut errs) = (0u64, 0u64);
                barrier.wait();
                let deadline = Instant::now() + Duration::from_secs(1);
                while Instant::now() < deadline {
                    OPS[t].fetch_add(1, SeqCst);
                    let size = 1024 + rng.below(MIB - 1024) as usize;
                    let mut v: Vec<u8> = Vec::new();
                    match v.try_reserve_exact(size) {
                        Ok(()) => {
                            granted += size as u64;
                            if ring.len() == ring.capacity() {
                                ring.remove(0);
                            }
                            ring.push(v);
                        }
                        Err(_) => errs += 1,
                    }
                }
                drop(ring);
                (granted, errs)
            })
        })
        .collect();
    let (ooms0, reports0) = (memquota::stats().ooms, Reports::now());
    let started = Instant::now();
    barrier.wait();
    let results: Vec<(u64, u64)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let elapsed = started.elapsed();
    let samples = monitor.stop();
    let (ooms, reports) = (memquota::stats().ooms - ooms0, Reports::now().since(reports0));
    judge(Outcome {
        threads: THREADS as u64 + SERVICE_THREADS,
        granted_bytes: results.iter().map(|r| r.0).sum(),
        errs: results.iter().map(|r| r.1).sum(),
        elapsed,
        samples,
        reports,
        ooms,
    });
}
