//! What happens around a refusal, in the Rust face, one check each in a process of its
//! own: the emergency reserve a refused thread draws on (its out-of-memory handler's
//! allocations), and a refusal that waits for the report in progress on another
//! thread. The preload's side, with C programs that crash or abort as real ones do, is
//! in `ld_preload/tests/limit.rs`.

mod support;

use memquota::{Config, QuotaAlloc};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Barrier;
use std::time::{Duration, Instant};
use support::{Size, KIB, MIB};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

const BUDGET: Duration = Duration::from_secs(10);

fn main() {
    support::run_isolated(
        &[
            (
                "a_refused_thread_draws_small_requests_on_the_emergency_reserve",
                a_refused_thread_draws_small_requests_on_the_emergency_reserve,
            ),
            ("a_refusal_waits_for_the_report_in_progress", a_refusal_waits_for_the_report_in_progress),
        ],
        BUDGET,
    );
}

fn try_alloc(bytes: u64) -> Option<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(bytes as usize).ok()?;
    Some(v)
}

/// 70 MiB held, then the limit lowered to the account, so the budget is full with no
/// refusal yet (a reserve of 1 MiB). A thread never refused before is refused 32 KiB
/// (over its slack: on the slow path); the same request then succeeds on it, drawn on
/// the reserve, and so does one of 64 KiB (not 64 KiB and a byte), and more until the
/// reserve is spent: never past `limit + reserve`. Once the budget is freed, the
/// reserve is whole again. Nothing on the main thread allocates while the budget is
/// full (it was never refused: an infallible allocation there would abort).
fn a_refused_thread_draws_small_requests_on_the_emergency_reserve() {
    memquota::init(Config::new().limit(256 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    println!("  holding 70 MiB, then lowering the limit to the account");
    let held: Vec<Vec<u8>> = (0..70).map(|_| vec![1u8; MIB as usize]).collect();
    let full = Barrier::new(2);
    let done = std::thread::scope(|s| {
        let drawer = s.spawn(|| {
            let mut drawn = Vec::with_capacity(128);
            full.wait();
            memquota::flush_thread(); // the new limit's slack: 32 KiB is over it
            let first = try_alloc(32 * KIB).is_some();
            let again = try_alloc(32 * KIB);
            let cap = try_alloc(memquota::seam::slow::EMERGENCY_DRAW_MAX);
            let over_cap = try_alloc(memquota::seam::slow::EMERGENCY_DRAW_MAX + 1).is_some();
            while let Some(v) = try_alloc(32 * KIB) {
                drawn.push(v);
            }
            memquota::flush_thread();
            let s = memquota::stats();
            (first, again.is_some(), cap.is_some(), over_cap, drawn.len() as u64, s)
        });
        memquota::flush_thread();
        memquota::set_limit(memquota::stats().native);
        full.wait();
        drawer.join().unwrap()
    });
    let (first, again, cap, over_cap, drawn, after) = done;
    let limit = after.limit;
    let reserve = memquota::seam::slow::emergency_reserve_for(limit);
    println!(
        "  limit {}, reserve {}; another thread: 32 KiB {first}, again {again}, 64 KiB {cap}, 64 KiB + 1 \
         {over_cap}, then {drawn} x 32 KiB; {} grants, reserve {} left, native {} (limit + reserve {})",
        Size(limit),
        Size(reserve),
        after.emergency_grants,
        Size(after.emergency_reserve_bytes),
        Size(after.native),
        Size(limit + reserve)
    );
    assert_eq!(reserve, MIB, "a 64th of the limit, at most 1 MiB");
    assert!(!first, "a thread never refused may not draw: refused");
    assert!(again && cap, "the refused thread draws its small requests on the reserve");
    assert!(!over_cap, "a request over the cap is refused");
    assert_eq!(after.emergency_grants, 2 + drawn, "each draw counted");
    let spent = 32 * KIB + memquota::seam::slow::EMERGENCY_DRAW_MAX + drawn * 32 * KIB;
    assert_eq!(after.emergency_reserve_bytes, reserve - spent, "what is left");
    assert!(after.native <= limit + reserve, "never past limit + reserve: {}", Size(after.native));
    // The draws went on until the reserve or the account's ceiling (which the other
    // threads' few bytes count against too) had no room for one more.
    assert!(
        after.emergency_reserve_bytes < 32 * KIB || after.native + 32 * KIB > limit + reserve,
        "the draws ended with room for more"
    );
    assert!(spent > reserve - 64 * KIB, "the reserve is spent: {spent} of {reserve}");
    assert!(after.overcommits >= after.emergency_grants, "each draw left the account past the limit");
    drop(held);
    // The frees reach the slow path, which finds the account under the limit.
    let refilled = memquota::stats();
    println!("  after the frees: reserve {} left", Size(refilled.emergency_reserve_bytes));
    assert_eq!(refilled.emergency_reserve_bytes, reserve, "whole again under the limit");
}

/// Set by the report hook just before it returns.
static HOOK_RETURNED: AtomicBool = AtomicBool::new(false);
/// Refusals the hook saw counted before it returned.
static SEEN_BY_HOOK: AtomicU64 = AtomicU64::new(0);
/// Refused threads whose refusal returned before the hook had.
static EARLY: AtomicU64 = AtomicU64::new(0);
const RACERS: u64 = 4;

/// The first report's hook holds on until every racer has been refused (at most 5 s):
/// the report is in progress while the others are refused. Allocation-free.
fn holding_hook(report: &str) {
    support::counting_hook(report);
    let t = Instant::now();
    while memquota::stats().ooms < RACERS && t.elapsed() < Duration::from_secs(5) {
        std::thread::yield_now();
    }
    SEEN_BY_HOOK.store(memquota::stats().ooms, SeqCst);
    HOOK_RETURNED.store(true, SeqCst);
}

/// 16 MiB, four threads allocate 1 MiB blocks from a barrier until each is refused;
/// the first refusal's hook holds on until all four are counted. None of the other
/// refusals may return before the report is handed over: a program that crashes on
/// its NULL would take the report down with it.
fn a_refusal_waits_for_the_report_in_progress() {
    memquota::init(Config::new().limit(16 * MIB)).unwrap();
    memquota::set_report_hook(holding_hook);
    support::watchdog(|l| {
        let _ = writeln!(l, "  the hook saw {} refusals", SEEN_BY_HOOK.load(SeqCst));
    });
    let start = Barrier::new(RACERS as usize);
    let held: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
        let racers: Vec<_> = (0..RACERS)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::with_capacity(32);
                    start.wait();
                    while let Some(v) = try_alloc(MIB) {
                        mine.push(v);
                    }
                    if !HOOK_RETURNED.load(SeqCst) {
                        EARLY.fetch_add(1, SeqCst);
                    }
                    mine
                })
            })
            .collect();
        racers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let s = memquota::stats();
    println!(
        "  {} refusals, {} full reports; the hook saw {} refusals counted; {} returned before it",
        s.ooms,
        s.reports,
        SEEN_BY_HOOK.load(SeqCst),
        EARLY.load(SeqCst)
    );
    assert_eq!(
        SEEN_BY_HOOK.load(SeqCst),
        RACERS,
        "the precondition: all refused while the report was in progress"
    );
    assert_eq!(s.reports, 1, "one full report, the others counted");
    assert_eq!(EARLY.load(SeqCst), 0, "no refusal returned before the report in progress was handed over");
    drop(held);
}
