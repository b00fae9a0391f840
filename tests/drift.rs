//! Invariants 2 and 3: exact zero drift at quiescence, and a bounded error between
//! flushes, with the real global allocator.

mod support;

use memquota::{Config, QuotaAlloc};
use std::sync::atomic::{AtomicI64, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Barrier};
use support::{run, Rng};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

const THREADS: usize = 8;
const LIMIT: u64 = 16 << 30;

fn main() {
    // A generous limit: these checks are about counting, not refusing.
    memquota::init(Config::new().limit(LIMIT)).unwrap();
    run(&[
        ("zero_drift_at_quiescence", zero_drift_at_quiescence),
        ("error_bound_holds_between_flushes", error_bound_holds_between_flushes),
    ]);
}

/// One round of churn: every thread allocates, grows and shrinks buffers, and sends
/// a share of them to its neighbour, which frees them. Returns the ops done.
fn churn(ops_per_thread: usize, seed: u64) -> usize {
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..THREADS {
        let (tx, rx) = mpsc::channel::<Vec<Vec<u8>>>();
        senders.push(tx);
        receivers.push(rx);
    }
    let handles: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(i, rx)| {
            let tx = senders[(i + 1) % THREADS].clone();
            std::thread::spawn(move || {
                let mut rng = Rng(seed + i as u64 * 7919);
                let mut live: Vec<Vec<u8>> = Vec::new();
                let mut outgoing = Vec::new();
                for _ in 0..ops_per_thread {
                    match rng.below(10) {
                        0..=3 => {
                            let mut v = Vec::with_capacity(rng.size());
                            v.push(1u8);
                            live.push(v);
                        }
                        4 if !live.is_empty() => {
                            let k = rng.below(live.len() as u64) as usize;
                            let extra = rng.size();
                            let cap = live[k].capacity();
                            live[k].reserve_exact(cap + extra); // realloc up
                        }
                        5 if !live.is_empty() => {
                            let k = rng.below(live.len() as u64) as usize;
                            live[k].shrink_to_fit(); // realloc down to len 1
                        }
                        6 if !live.is_empty() => {
                            let k = rng.below(live.len() as u64) as usize;
                            outgoing.push(live.swap_remove(k));
                            if outgoing.len() == 32 {
                                let _ = tx.send(std::mem::take(&mut outgoing));
                            }
                        }
                        _ if !live.is_empty() => {
                            let k = rng.below(live.len() as u64) as usize;
                            live.swap_remove(k);
                        }
                        _ => {}
                    }
                    while let Ok(batch) = rx.try_recv() {
                        drop(batch); // frees memory another thread allocated
                    }
                }
                let _ = tx.send(outgoing);
                drop(tx);
                // Drain until every sender is gone: memory from the neighbour is freed here.
                for batch in rx {
                    drop(batch);
                }
                drop(live);
            })
        })
        .collect();
    drop(senders);
    for h in handles {
        h.join().unwrap();
    }
    ops_per_thread * THREADS
}

fn zero_drift_at_quiescence() {
    // Warm-up: lets std create whatever it keeps for the process's lifetime.
    churn(1000, 1);
    memquota::flush_thread();
    let before = memquota::stats();
    let ops = churn(150_000, 42);
    memquota::flush_thread();
    let after = memquota::stats();
    println!("  {ops} ops on {THREADS} threads; tracked before {} after {}", before.native, after.native);
    assert!(ops >= 1_000_000);
    assert_eq!(after.native, before.native, "tracked bytes drifted");
    assert!(after.native_peak > before.native + (1 << 20), "the churn should have raised the peak");
    assert_eq!(after.threads, before.threads, "exited threads must deregister");
}

fn error_bound_holds_between_flushes() {
    const ROUNDS: usize = 40;
    let live_bytes: Arc<Vec<AtomicI64>> = Arc::new((0..THREADS).map(|_| AtomicI64::new(0)).collect());
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let threshold = memquota::seam::process::threshold_for(LIMIT);
    assert_eq!(memquota::stats().threshold, threshold);
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let live_bytes = Arc::clone(&live_bytes);
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut rng = Rng(99 + i as u64);
                let mut live: Vec<Vec<u8>> = Vec::with_capacity(100_000);
                let mut held: i64 = 0;
                memquota::flush_thread();
                barrier.wait(); // A: everything this thread set up is flushed
                barrier.wait(); // A2: main has read the baseline
                for _ in 0..ROUNDS {
                    for _ in 0..2000 {
                        if live.len() < live.capacity() && (live.is_empty() || rng.below(3) != 0) {
                            let n = rng.size();
                            held += n as i64;
                            live.push(Vec::with_capacity(n));
                        } else {
                            let k = rng.below(live.len() as u64) as usize;
                            held -= live.swap_remove(k).capacity() as i64;
                        }
                        let pending = memquota::thread_pending();
                        assert!(
                            pending.unsigned_abs() < threshold,
                            "a thread's delta passed its slack: {pending}"
                        );
                    }
                    live_bytes[i].store(held, SeqCst);
                    barrier.wait(); // B: main inspects
                    barrier.wait(); // C: go on
                }
                drop(live);
            })
        })
        .collect();
    barrier.wait(); // A
    memquota::flush_thread();
    let base = memquota::stats().native as i64;
    barrier.wait(); // A2
    let (mut worst, mut bound_then) = (0i64, 0);
    for _ in 0..ROUNDS {
        barrier.wait(); // B
        let s = memquota::stats();
        let truth = base + live_bytes.iter().map(|b| b.load(SeqCst)).sum::<i64>();
        let error = (s.native as i64 - truth).abs();
        if error >= worst {
            (worst, bound_then) = (error, s.error_bound);
        }
        assert!(
            error as u64 <= s.error_bound,
            "error {error} exceeds the bound {}: tracked {} truth {truth} base {base}",
            s.error_bound,
            s.native
        );
        assert!(s.error_bound <= s.threads * threshold);
        barrier.wait(); // C
    }
    for h in handles {
        h.join().unwrap();
    }
    println!("  worst error {worst} bytes against a bound of {bound_then} ({THREADS} workers + main, threshold {threshold})");
}
