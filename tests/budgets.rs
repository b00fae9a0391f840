//! Budgets bound to allocations (`TaskScope::budget`, seed 001): async readers with
//! estimates below and above their real need, an over-claim returned early, a
//! borrower served ahead of new budgets, a lone budget's bounded over-commit. Each
//! check runs in a process of its own (the budget is process-wide); preconditions are
//! forced (barriers, observed waits), never hoped for.

mod support;

use memquota::{Config, Error, MemoryManager, QuotaAlloc};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::Duration;
use support::{buffer, MIB};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

fn main() {
    support::run_isolated(
        &[
            (
                "readers_draw_on_their_budgets_and_the_pool_returns_to_zero",
                readers_draw_on_their_budgets_and_the_pool_returns_to_zero,
            ),
            ("try_free_returns_the_over_claim_at_once", try_free_returns_the_over_claim_at_once),
            ("a_borrower_goes_ahead_of_a_new_budget", a_borrower_goes_ahead_of_a_new_budget),
            ("a_lone_budget_overcommits_within_the_bound", a_lone_budget_overcommits_within_the_bound),
        ],
        Duration::from_secs(60),
    );
}

fn mm() -> &'static MemoryManager {
    MemoryManager::global()
}

fn native() -> i64 {
    memquota::flush_thread();
    memquota::stats().native as i64
}

/// The slack a test tolerates on figures that small bookkeeping allocations (the
/// channel's nodes, thread start-up) also move.
const SLACK: i64 = MIB as i64;

/// Four readers, estimates below and above what they read: each holds its buffers (4
/// MiB, owner-recorded) at once, then hands them to a consumer thread attached
/// nowhere, which frees them. While they hold, the scope is charged each budget's
/// larger of grant and use, and the under-estimated ones borrowed the difference.
/// Once every buffer is gone and the budgets dropped, the scope holds nothing and the
/// process is back where it started.
fn readers_draw_on_their_budgets_and_the_pool_returns_to_zero() {
    memquota::init(Config::new().limit(512 * MIB)).unwrap();
    let before = native();
    let scope = mm().begin("scan", 1, 0).unwrap();
    // (estimate, need) in MiB.
    let plans: [(u64, u64); 4] = [(16, 24), (32, 16), (8, 32), (24, 24)];
    let (tx, rx) = mpsc::channel::<Vec<Vec<u8>>>();
    let consumer = std::thread::spawn(move || {
        for batch in rx {
            drop(batch);
        }
    });
    let holding = Arc::new(Barrier::new(plans.len() + 1));
    let checked = Arc::new(Barrier::new(plans.len() + 1));
    let readers: Vec<_> = plans
        .iter()
        .map(|&(estimate, need)| {
            let (h, tx) = (scope.handle(), tx.clone());
            let (holding, checked) = (Arc::clone(&holding), Arc::clone(&checked));
            std::thread::spawn(move || {
                let budget = h.budget(estimate * MIB).unwrap();
                let batch: Vec<Vec<u8>> = {
                    let _under = budget.attach().unwrap();
                    let batch = (0..need / 4).map(|_| buffer(4 * MIB).unwrap()).collect();
                    memquota::flush_thread();
                    batch
                };
                let s = budget.stats().unwrap();
                holding.wait();
                checked.wait();
                tx.send(batch).unwrap();
                (estimate, need, s, budget)
            })
        })
        .collect();
    drop(tx);
    holding.wait();
    let held = scope.stats().unwrap().held as i64;
    let charged: u64 = plans.iter().map(|&(e, n)| e.max(n) * MIB).sum();
    assert!((held - charged as i64).abs() <= SLACK, "held {held}, budgets charged {charged}");
    checked.wait();
    let budgets: Vec<_> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    consumer.join().unwrap();
    for (estimate, need, s, budget) in &budgets {
        assert_eq!(s.granted, estimate * MIB);
        assert!((s.used - (need * MIB) as i64).abs() <= SLACK, "used {} of {need} MiB", s.used);
        let borrowed = need.saturating_sub(*estimate) * MIB;
        assert!(
            (s.borrowed as i64 - borrowed as i64).abs() <= SLACK,
            "borrowed {} of {borrowed}",
            s.borrowed
        );
        let now = budget.stats().unwrap();
        assert!(now.used < SLACK, "freed on another thread, credited to the budget: used {}", now.used);
    }
    let snap = mm().snapshot();
    assert_eq!(snap.budgets, 4);
    assert!(snap.budget_borrowed_bytes >= (8 + 24) * MIB - 2 * SLACK as u64);
    drop(budgets);
    let s = scope.stats().unwrap();
    assert_eq!(s.reserved, 0);
    assert!((s.held as i64) < SLACK && s.held as i64 == s.allocated.max(0), "scope after: {s:?}");
    drop(scope);
    let after = native();
    assert!((after - before).abs() <= SLACK, "native {before} before, {after} after");
}

/// A budget of 96 MiB under 128 MiB leaves no room for a 48 MiB reservation; once the
/// runner knows it needs 16 MiB, `try_free` returns the other 80 at once and the
/// reservation fits.
fn try_free_returns_the_over_claim_at_once() {
    memquota::init(Config::new().limit(128 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    let scope = mm().begin("reader", 1, 0).unwrap();
    let budget = scope.budget(96 * MIB).unwrap();
    assert!(matches!(scope.reserve(48 * MIB), Err(Error::Refused { .. })), "the over-claim is in the way");
    let read = {
        let _under = budget.attach().unwrap();
        buffer(16 * MIB).unwrap()
    };
    let held = scope.stats().unwrap().held;
    assert_eq!(budget.try_free(96 * MIB), 80 * MIB, "all but what its use covers");
    let freed = held - scope.stats().unwrap().held;
    assert_eq!(freed, 80 * MIB, "returned to the pool at once");
    let r = scope.reserve(48 * MIB).expect("fits once the over-claim is back");
    assert_eq!(mm().snapshot().budget_freed_early_bytes, 80 * MIB);
    drop((r, read, budget));
}

/// 96 MiB, 40 MiB held outside any scope. Runner 1 (an 8 MiB estimate) needs 34 MiB
/// more: it waits to borrow while runner 2's 30 MiB budget is in flight. A new budget
/// of 16 MiB would fit in the 18 MiB left, and taking it would leave runner 1 short
/// even after runner 2 finishes; it waits behind the borrower instead. When runner 2
/// ends, runner 1 is served first, and the new budget once runner 1 has freed.
fn a_borrower_goes_ahead_of_a_new_budget() {
    memquota::init(Config::new().limit(96 * MIB)).unwrap();
    // Long enough that the waits end by being served, on any machine.
    mm().set_wait(Duration::from_secs(30));
    let outside = buffer(40 * MIB).unwrap();
    let scope = mm().begin("scan", 1, 0).unwrap();
    let runner2 = scope.budget(30 * MIB).unwrap();
    let order = Arc::new(Mutex::new(Vec::<&str>::new()));
    let waits = || mm().snapshot().waits;
    let w0 = waits();
    let runner1 = {
        let (h, order) = (scope.handle(), Arc::clone(&order));
        std::thread::spawn(move || {
            let budget = h.budget(8 * MIB).unwrap();
            let _under = budget.attach().unwrap();
            let read = buffer(42 * MIB).expect("the borrower is served");
            order.lock().unwrap().push("runner 1 borrowed its deficit");
            drop(read);
        })
    };
    while waits() == w0 {
        std::thread::yield_now(); // until runner 1 waits to borrow
    }
    let w1 = waits();
    let newcomer_started = Arc::new(AtomicBool::new(false));
    let newcomer = {
        let (h, order, started) = (scope.handle(), Arc::clone(&order), Arc::clone(&newcomer_started));
        std::thread::spawn(move || {
            started.store(true, SeqCst);
            let budget = h.budget(16 * MIB).expect("the new budget is served after the borrower");
            order.lock().unwrap().push("the new budget");
            drop(budget);
        })
    };
    while waits() == w1 {
        std::thread::yield_now(); // until the new budget waits too (it would fit now)
    }
    assert!(newcomer_started.load(SeqCst));
    assert_eq!(order.lock().unwrap().len(), 0, "neither is served while runner 2 is in flight");
    drop(runner2);
    runner1.join().unwrap();
    newcomer.join().unwrap();
    assert_eq!(*order.lock().unwrap(), ["runner 1 borrowed its deficit", "the new budget"]);
    drop(outside);
}

/// 64 MiB, 56 MiB held outside any scope, one budget of nothing in flight: its
/// runner's 10 MiB is granted past the limit (one runner always progresses), within
/// the bound (limit + limit/16), counted; past the bound it is refused. With a second
/// budget in flight the same request is not over-committed.
fn a_lone_budget_overcommits_within_the_bound() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    let limit = 64 * MIB as i64;
    let outside = buffer(56 * MIB).unwrap();
    let scope = mm().begin("scan", 1, 0).unwrap();
    let lone = scope.budget(0).unwrap();
    let under = lone.attach().unwrap();
    let first = buffer(10 * MIB).expect("a lone budget over-commits");
    let n = native();
    assert!(n > limit && n <= limit + limit / 16, "past the limit, within the bound: {n}");
    let snap = mm().snapshot();
    assert_eq!(snap.budget_overcommits, 1);
    assert!(snap.budget_overcommit_bytes >= 9 * MIB, "{}", snap.budget_overcommit_bytes);
    assert!(memquota::stats().overcommit > 0 || memquota::stats().overcommits > 0);
    assert!(matches!(buffer(4 * MIB), Err(Error::Refused { .. })), "past the bound: refused");
    drop(first);
    drop(under);
    mm().set_wait(Duration::from_millis(200)); // the refusal is the point here
    let _other = scope.budget(0).unwrap();
    let _under = lone.attach().unwrap();
    assert!(matches!(buffer(10 * MIB), Err(Error::Refused { .. })), "not alone: no over-commit");
    assert_eq!(mm().snapshot().budget_overcommits, 1);
    drop(outside);
}
