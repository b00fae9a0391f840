//! Retry blocks (`with_retry`, `with_split_retry`): work that completes under
//! pressure. Each check runs in a process of its own (the budget is process-wide),
//! with the defaults a user gets (the 10 s watchdog, the 2 s share wait), except the
//! watchdog's own check. Preconditions are forced with barriers, never hoped for.

mod support;

use memquota::{with_retry, with_split_retry, Config, Error, MemoryManager, QuotaAlloc, TaskScope};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::{Duration, Instant};
use support::{buffer, KIB, MIB};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

const BUDGET: Duration = Duration::from_secs(60);

fn main() {
    support::run_isolated(
        &[
            ("four_tasks_complete_where_plain_refusal_fails", four_tasks_complete_where_plain_refusal_fails),
            ("a_deadlock_rolls_the_youngest_back", a_deadlock_rolls_the_youngest_back),
            (
                "split_retry_fits_an_input_larger_than_the_limit",
                split_retry_fits_an_input_larger_than_the_limit,
            ),
            ("the_only_short_task_splits_instead_of_waiting", the_only_short_task_splits_instead_of_waiting),
            ("the_watchdog_ends_a_wait_with_the_report", the_watchdog_ends_a_wait_with_the_report),
            ("pool_threads_count_as_their_task", pool_threads_count_as_their_task),
            ("random_schedules_always_complete", random_schedules_always_complete),
            (
                "callbacks_that_allocate_and_panic_inside_retry_blocks",
                callbacks_that_allocate_and_panic_inside_retry_blocks,
            ),
            (
                "a_fork_while_a_thread_is_blocked_leaves_a_working_child",
                a_fork_while_a_thread_is_blocked_leaves_a_working_child,
            ),
            (
                "a_heap_probe_that_takes_a_user_lock_never_deadlocks_the_machine",
                a_heap_probe_that_takes_a_user_lock_never_deadlocks_the_machine,
            ),
            (
                "ending_a_scope_wakes_its_blocked_threads_at_once",
                ending_a_scope_wakes_its_blocked_threads_at_once,
            ),
            (
                "ending_a_scope_wakes_its_thread_waiting_to_retry",
                ending_a_scope_wakes_its_thread_waiting_to_retry,
            ),
            (
                "split_retry_keeps_its_lists_at_the_limit_without_aborting",
                split_retry_keeps_its_lists_at_the_limit_without_aborting,
            ),
            (
                "a_request_over_its_cap_splits_at_once_and_rolls_no_one_back",
                a_request_over_its_cap_splits_at_once_and_rolls_no_one_back,
            ),
        ],
        BUDGET,
    );
}

fn mm() -> &'static MemoryManager {
    MemoryManager::global()
}

/// One attempt of the task: 3 x 16 MiB held at once. On the first attempt
/// every task holds two buffers before any asks for its third (`go`); each then holds
/// its third until all four have asked for theirs (`asked`), so the requests overlap
/// whatever the scheduling: on a loaded machine a task could otherwise finish and free
/// before the next one asked, and none would have to wait. Polled, no sleeping; the
/// tasks still short are blocked in memquota meanwhile, and a task that holds its
/// buffer here is running, so no deadlock is declared.
fn three_buffers(go: &Barrier, asked: &AtomicUsize, first: &mut bool) -> memquota::Result<usize> {
    let a = buffer(16 * MIB)?;
    let b = buffer(16 * MIB)?;
    if std::mem::take(first) {
        go.wait();
        asked.fetch_add(1, SeqCst);
    }
    let c = buffer(16 * MIB)?;
    while asked.load(SeqCst) < 4 {
        std::thread::yield_now();
    }
    Ok(a.len() + b.len() + c.len())
}

/// The case: 256 MiB, 100 MiB held outside any scope, 4 tasks each needing
/// 3 x 16 MiB at once. All hold 2 buffers before any takes its third (a barrier), so
/// 4 x 48 MiB cannot be held together: plain requests are refused; in retry blocks
/// every task waits its turn and completes.
fn four_tasks_complete_where_plain_refusal_fails() {
    memquota::init(Config::new().limit(256 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    let _outside = buffer(100 * MIB).unwrap();

    // Plain requests: the third buffers are asked for while every task holds its two.
    let (go, done) = (Arc::new(Barrier::new(4)), Arc::new(Barrier::new(4)));
    let refused: usize = (0..4u64)
        .map(|id| {
            let (go, done) = (Arc::clone(&go), Arc::clone(&done));
            std::thread::spawn(move || {
                let scope = mm().begin("plain", id, 0).unwrap();
                let _a = scope.attach().unwrap();
                let held = [buffer(16 * MIB), buffer(16 * MIB)];
                go.wait();
                let third = buffer(16 * MIB);
                done.wait(); // nothing is given back before every request is in
                held.iter().chain([&third]).filter(|b| b.is_err()).count()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .sum();
    support::say(format_args!("plain: {refused} of 12 buffers refused\n"));
    assert!(refused >= 1, "the precondition: plain requests must be refused here");

    // The same in retry blocks.
    let before = memquota::stats();
    let (go, asked) = (Arc::new(Barrier::new(4)), Arc::new(AtomicUsize::new(0)));
    let results: Vec<_> = (0..4u64)
        .map(|id| {
            let (go, asked) = (Arc::clone(&go), Arc::clone(&asked));
            std::thread::spawn(move || {
                let scope = mm().begin("retry", id, 0).unwrap();
                let mut first = true;
                let r = with_retry(&scope, || three_buffers(&go, &asked, &mut first));
                assert!(!scope.end().is_leak());
                r
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let s = memquota::stats();
    support::say(format_args!(
        "retry: {results:?}; waits {}, rollbacks {}, splits {}, timeouts {}, refusals {}\n",
        s.retry.waits - before.retry.waits,
        s.retry.rollbacks - before.retry.rollbacks,
        s.retry.splits - before.retry.splits,
        s.retry.timeouts - before.retry.timeouts,
        s.ooms - before.ooms,
    ));
    for r in &results {
        assert_eq!(r.as_ref().ok(), Some(&(48 * MIB as usize)), "every task completes: {results:?}");
    }
    assert!(s.retry.waits > before.retry.waits, "some task had to wait");
    assert_eq!(s.ooms, before.ooms, "no request refused");
    assert_eq!(s.retry.timeouts, 0);
    assert_eq!(s.retry.blocked + s.retry.running + s.retry.bufn, 0, "every thread left its block");
}

/// 4 tasks hold 32 MiB each beside 100 MiB outside (228 of 256), then each wants 32
/// MiB more: every task is blocked. The youngest rolls back, the oldest goes first.
fn a_deadlock_rolls_the_youngest_back() {
    memquota::init(Config::new().limit(256 * MIB)).unwrap();
    let _outside = buffer(100 * MIB).unwrap();
    let go = Arc::new(Barrier::new(4));
    let finished = Arc::new(Mutex::new(Vec::new()));
    let rolled = Arc::new([const { AtomicU64::new(0) }; 4]);
    let threads: Vec<_> = (0..4u64)
        .map(|id| {
            let (go, finished, rolled) = (Arc::clone(&go), Arc::clone(&finished), Arc::clone(&rolled));
            std::thread::spawn(move || {
                let scope = mm().begin("deadlock", id, 0).unwrap();
                let mut first = true;
                let r = with_retry(&scope, || {
                    let a = buffer(32 * MIB)?;
                    if std::mem::take(&mut first) {
                        go.wait();
                    }
                    let b = buffer(32 * MIB).inspect_err(|e| {
                        if *e == Error::RetryOom {
                            rolled[id as usize].fetch_add(1, SeqCst);
                        }
                    })?;
                    // Done, counted while it still holds both buffers: after it frees
                    // them, a younger task may be granted and finish before this
                    // thread is scheduled again.
                    finished.lock().unwrap().push(id);
                    Ok(a.len() + b.len())
                });
                r
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let order = finished.lock().unwrap().clone();
    let rolled: Vec<u64> = rolled.iter().map(|r| r.load(SeqCst)).collect();
    let s = memquota::stats();
    support::say(format_args!(
        "results {results:?}; finished in order {order:?}; rollbacks per task {rolled:?}; \
         machine: waits {}, rollbacks {}, retries {}, splits {}\n",
        s.retry.waits, s.retry.rollbacks, s.retry.retries, s.retry.splits
    ));
    assert!(results.iter().all(|r| r == &Ok(64 * MIB as usize)), "all complete");
    assert!(s.retry.rollbacks >= 1, "the deadlock was broken by a rollback");
    assert_eq!(rolled[0], 0, "the oldest task is never rolled back");
    assert!(rolled[3] >= 1, "the youngest task rolled back first");
    assert_eq!(order[0], 0, "the oldest task finishes first");
    assert_eq!(s.retry.timeouts + s.ooms, 0, "no watchdog, no refusal");
}

/// 64 rows of 4 MiB each (256 MiB in all) under a 128 MiB limit: one attempt cannot
/// fit, pieces do; the results come back in input order.
fn split_retry_fits_an_input_larger_than_the_limit() {
    memquota::init(Config::new().limit(128 * MIB)).unwrap();
    let scope = mm().begin("splitter", 1, 0).unwrap();
    let largest = AtomicU64::new(0);
    let pieces = with_split_retry(
        &scope,
        0..64u64,
        |r| {
            let mid = r.start + (r.end - r.start) / 2;
            vec![r.start..mid, mid..r.end]
        },
        |rows| {
            let buf = buffer((rows.end - rows.start) * 4 * MIB)?;
            largest.fetch_max(buf.len() as u64, SeqCst);
            Ok(rows.clone())
        },
    )
    .unwrap();
    support::say(format_args!("pieces {pieces:?}; largest {} MiB\n", largest.load(SeqCst) / MIB));
    let flat: Vec<u64> = pieces.iter().flat_map(|r| r.clone()).collect();
    assert_eq!(flat, (0..64).collect::<Vec<_>>(), "every row once, in order");
    assert!(pieces.len() >= 4, "split at least down to quarters");
    assert!(largest.load(SeqCst) < 128 * MIB);
    assert_eq!(memquota::stats().ooms, 0);
}

/// `with_split_retry` at the limit: its own lists (the pieces to do, the results) are
/// memquota's bookkeeping, charged but never refused. The account is past the limit
/// (a reservation grown unchecked, as an engine's pool grows one) and the thread
/// tight (a request was just refused), so each allocation is admitted alone; the
/// attempt itself allocates nothing. Before, the list's first allocation was refused
/// (a split, no memory to wait for) and the process aborted in `handle_alloc_error`
/// (tests/fuzz_arbitration/ found it: an 8-byte allocation of a piece's result).
fn split_retry_keeps_its_lists_at_the_limit_without_aborting() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    let holder = mm().begin("pool", 1, 0).unwrap();
    let mut pool = holder.reserve(MIB).unwrap();
    pool.grow_unchecked(64 * MIB);
    assert!(buffer(MIB).is_err(), "the precondition: past the limit, requests are refused");
    let scope = mm().begin("splitter", 2, 0).unwrap();
    let rows = with_split_retry(&scope, 0..8u64, |r| vec![r], |rows| Ok(rows.end - rows.start));
    let past = memquota::stats().native > 64 * MIB;
    drop(pool);
    assert!(past, "the precondition: the account stayed past the limit");
    assert_eq!(rows, Ok(vec![8]), "one piece, completed");
}

/// A request in a retry block larger than its own scope's cap can never fit: it splits
/// at once, as one larger than the pool, and never blocks. Blocked, it counted as a
/// task short that rolling others back could help: a younger task holding 8 MiB
/// outside its attempt was rolled back again and again, its `with_split_retry` calls
/// giving up after 500 rollbacks in tens of milliseconds each (19 of 29 in 0.6 s;
/// tests/fuzz_arbitration/ found it).
fn a_request_over_its_cap_splits_at_once_and_rolls_no_one_back() {
    memquota::init(Config::new().limit(48 * MIB).refuse_min(64 * KIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    mm().set_wait(Duration::from_millis(200));
    mm().set_retry_wait(Duration::from_secs(2));
    let capped = mm().begin("capped", 1, 0).unwrap();
    capped.set_cap(Some(13 * MIB));
    let waits = memquota::stats().retry.waits;
    let alone = with_retry(&capped, || capped.reserve(14 * MIB).map(drop));
    let waited = memquota::stats().retry.waits - waits;
    // The same request again and again, beside a younger task that splits its rows.
    let before = memquota::stats().retry;
    let stop = AtomicBool::new(false);
    let (calls, gave_up) = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(SeqCst) {
                let _ = with_retry(&capped, || capped.reserve(14 * MIB).map(drop));
            }
        });
        let splitter = mm().begin("splitter", 2, 0).unwrap();
        let held = {
            let _attached = splitter.attach().unwrap();
            buffer(8 * MIB).unwrap()
        };
        let (mut calls, mut gave_up) = (0, 0);
        let started = Instant::now();
        while started.elapsed() < Duration::from_millis(600) {
            let r = with_split_retry(
                &splitter,
                0..11u64,
                |r| {
                    let m = r.start + (r.end - r.start) / 2;
                    if r.end - r.start < 2 {
                        vec![]
                    } else {
                        vec![r.start..m, m..r.end]
                    }
                },
                |rows| buffer((rows.end - rows.start) * 1536 * KIB).map(|_| rows.clone()),
            );
            calls += 1;
            gave_up += u64::from(r == Err(Error::RetryOom));
        }
        stop.store(true, SeqCst);
        drop(held);
        (calls, gave_up)
    });
    let s = memquota::stats().retry;
    support::say(format_args!(
        "alone: {alone:?} after {waited} waits; beside it: {gave_up} of {calls} split-retry calls gave up; \
         machine rollbacks {}, past MAX_RETRIES {}\n",
        s.rollbacks - before.rollbacks,
        s.retry_limit - before.retry_limit
    ));
    assert_eq!(alone, Err(Error::SplitAndRetryOom));
    assert_eq!(waited, 0, "over its cap: split at once, never blocked");
    assert_eq!((gave_up, s.retry_limit - before.retry_limit), (0, 0), "no one rolled back past MAX_RETRIES");
}

/// One task, 100 MiB outside it: a 200 MiB request fits the pool but never the
/// headroom, and no other task can free anything. It is split, not left to the
/// watchdog.
fn the_only_short_task_splits_instead_of_waiting() {
    memquota::init(Config::new().limit(256 * MIB)).unwrap();
    let _outside = buffer(100 * MIB).unwrap();
    let scope = mm().begin("alone", 1, 0).unwrap();
    let r = with_retry(&scope, || buffer(200 * MIB).map(|b| b.len()));
    let s = memquota::stats();
    support::say(format_args!(
        "{r:?}; waits {}, splits {}, timeouts {}\n",
        s.retry.waits, s.retry.splits, s.retry.timeouts
    ));
    assert_eq!(r, Err(Error::SplitAndRetryOom));
    assert_eq!(s.retry.timeouts, 0, "decided by the machine, not the watchdog");
    assert_eq!(s.retry.waits, 1);
}

/// A thread attached to the task outside any retry block holds memory and may free
/// it: the task is never "blocked", so the machine never acts; the watchdog ends the
/// wait with a refusal and the report.
fn the_watchdog_ends_a_wait_with_the_report() {
    memquota::init(Config::new().limit(256 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    mm().set_retry_wait(Duration::from_millis(300));
    let scope = mm().begin("watched", 1, 0).unwrap();
    let (held, release) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let handle = scope.handle();
    let holder = {
        let (held, release) = (Arc::clone(&held), Arc::clone(&release));
        std::thread::spawn(move || {
            let _a = handle.attach().unwrap();
            let b = buffer(200 * MIB).unwrap();
            held.wait();
            release.wait();
            drop(b);
        })
    };
    held.wait();
    let r = with_retry(&scope, || buffer(100 * MIB).map(|b| b.len()));
    release.wait();
    holder.join().unwrap();
    let s = memquota::stats();
    support::say(format_args!("{r:?}; timeouts {}, reports {}\n", s.retry.timeouts, s.reports));
    assert_eq!(r, Err(Error::Refused { requested: 0 }));
    assert_eq!(s.retry.timeouts, 1);
    assert_eq!(s.ooms, 1, "refused once, as outside a retry block");
    assert!(support::first_report().contains("retry blocks:"), "the report shows the machine");
}

/// Shape 2 of docs/scopes.md: a pool thread attached to a task counts as the task's.
/// Two tasks, each with its own thread and a pool thread, all four blocked: the
/// younger task (both its threads) rolls back, the older completes.
fn pool_threads_count_as_their_task() {
    memquota::init(Config::new().limit(256 * MIB)).unwrap();
    let _outside = buffer(100 * MIB).unwrap();
    let go = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..2u64)
        .flat_map(|id| {
            let scope = Arc::new(mm().begin("task", id, 0).unwrap());
            (0..2).map(move |_| (id, Arc::clone(&scope)))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|(id, scope)| {
            let go = Arc::clone(&go);
            std::thread::spawn(move || {
                let mut first = true;
                with_retry(&scope, || {
                    let a = buffer(32 * MIB)?;
                    if std::mem::take(&mut first) {
                        go.wait();
                    }
                    let b = buffer(32 * MIB)?;
                    Ok((id, a.len() + b.len()))
                })
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let s = memquota::stats();
    support::say(format_args!("{results:?}; rollbacks {}, waits {}\n", s.retry.rollbacks, s.retry.waits));
    assert!(results.iter().all(|r| r.as_ref().is_ok_and(|&(_, n)| n == 64 * MIB as usize)));
    assert!(s.retry.rollbacks >= 1);
    assert_eq!(s.retry.timeouts + s.ooms, 0);
}

/// Random tasks x threads x needs under a tight budget: every schedule terminates,
/// every task completes (splitting where it must), nothing is refused, and the oldest
/// task is never rolled back.
fn random_schedules_always_complete() {
    memquota::init(Config::new().limit(192 * MIB)).unwrap();
    let mut runner =
        TestRunner::new(PropConfig { cases: 24, failure_persistence: None, ..PropConfig::default() });
    let cases = AtomicUsize::new(0);
    // First buffers, all taken before a barrier, fit together under every task's
    // share (at most 2 x 16 MiB of 192 / 4) so no thread waits at the barrier for one
    // that is blocked; the second ones overlap.
    let schedule = (2usize..5, 1usize..3, prop::collection::vec((4u64..16, 4u64..96), 8));
    runner
        .run(&schedule, |(tasks, threads, needs)| {
            cases.fetch_add(1, SeqCst);
            let before = memquota::stats();
            let go = Arc::new(Barrier::new(tasks * threads));
            let oldest_rolled = Arc::new(AtomicU64::new(0));
            let mut joins = Vec::new();
            for t in 0..tasks {
                let scope: Arc<TaskScope> = Arc::new(mm().begin("prop", t as u64, 0).unwrap());
                for k in 0..threads {
                    let (first_mib, second_mib) = needs[(t * threads + k) % needs.len()];
                    let (go, scope, oldest_rolled) =
                        (Arc::clone(&go), Arc::clone(&scope), Arc::clone(&oldest_rolled));
                    joins.push(std::thread::spawn(move || {
                        let mut first = true;
                        with_split_retry(
                            &scope,
                            second_mib,
                            |mib| vec![mib / 2, mib - mib / 2],
                            |&mib| {
                                let a = buffer(first_mib * MIB);
                                if std::mem::take(&mut first) {
                                    go.wait();
                                }
                                let b = buffer(mib * MIB);
                                for r in [&a, &b] {
                                    if t == 0 && matches!(r, Err(Error::RetryOom)) {
                                        oldest_rolled.fetch_add(1, SeqCst);
                                    }
                                }
                                Ok(a?.len() + b?.len())
                            },
                        )
                    }));
                }
            }
            let results: Vec<_> = joins.into_iter().map(|j| j.join().unwrap()).collect();
            let s = memquota::stats();
            prop_assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
            prop_assert_eq!(s.ooms, before.ooms);
            prop_assert_eq!(s.retry.timeouts, before.retry.timeouts);
            prop_assert_eq!(oldest_rolled.load(SeqCst), 0);
            Ok(())
        })
        .unwrap();
    let s = memquota::stats();
    support::say(format_args!(
        "{} schedules: waits {}, rollbacks {}, retries {}, splits {}\n",
        cases.load(SeqCst),
        s.retry.waits,
        s.retry.rollbacks,
        s.retry.retries,
        s.retry.splits
    ));
}

/// `fork` while another thread is blocked in a retry block: the child has only the
/// forking thread, the machine's lock is free and the vanished thread's slot is gone,
/// so a retry block in the child runs, blocks and splits as in a fresh process.
fn a_fork_while_a_thread_is_blocked_leaves_a_working_child() {
    memquota::init(Config::new().limit(256 * MIB)).unwrap();
    let _outside = buffer(100 * MIB).unwrap();
    let scope = Arc::new(mm().begin("parent", 1, 0).unwrap());
    // A thread attached outside any retry block holds 100 MiB: it may free, so the
    // blocked thread stays blocked (no rollback, no split) until it does.
    let (held, release) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let holder = {
        let (handle, held, release) = (scope.handle(), Arc::clone(&held), Arc::clone(&release));
        std::thread::spawn(move || {
            let a = handle.attach().unwrap();
            let b = buffer(100 * MIB).unwrap();
            held.wait();
            release.wait();
            drop((b, a));
        })
    };
    held.wait();
    let blocked = {
        let scope = Arc::clone(&scope);
        std::thread::spawn(move || with_retry(&scope, || buffer(100 * MIB).map(|b| b.len())))
    };
    // The precondition, forced: the thread is blocked when the process forks.
    while memquota::stats().retry.blocked == 0 {
        std::thread::yield_now();
    }
    // SAFETY: fork has no memory preconditions; the child allocates only through our
    // allocator (whose fork handlers ran) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let s = memquota::stats().retry;
        let child = mm().begin("child", 2, 0).unwrap();
        let r = with_retry(&child, || buffer(200 * MIB).map(|b| b.len()));
        let ok = s.blocked == 0 && r == Err(Error::SplitAndRetryOom);
        // SAFETY: _exit ends the child without running the parent's destructors.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let code = support::wait_child(pid, Duration::from_secs(20));
    release.wait();
    holder.join().unwrap();
    let r = blocked.join().unwrap();
    support::say(format_args!("child exit {code:?}; parent's blocked thread: {r:?}\n"));
    assert_eq!(code, Some(0), "the child saw no blocked thread and its own block split");
    assert_eq!(r, Ok(100 * MIB as usize), "the parent's thread completes once the holder frees");
}

/// The four tasks (3 x 16 MiB each at once, 100 MiB held outside, 256 MiB), with
/// callbacks that misbehave: each task's spillable consumer (a 4 MiB cache, reserved
/// for it) allocates, then panics on every other call and frees its cache on the
/// others; the process's reclaim
/// callback allocates and panics every time. Every task still completes in its retry
/// block, the panics are caught, nothing is refused and every thread leaves its block.
fn callbacks_that_allocate_and_panic_inside_retry_blocks() {
    memquota::init(Config::new().limit(256 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    let reclaims = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&reclaims);
    memquota::on_reclaim(move |_| {
        counted.fetch_add(1, SeqCst);
        let scratch = vec![7u8; 64 << 10];
        std::hint::black_box(&scratch);
        panic!("a reclaim callback allocates, then panics on purpose");
    });
    let _outside = buffer(100 * MIB).unwrap();
    let before = memquota::stats();
    let spill_calls = Arc::new(AtomicUsize::new(0));
    let (go, asked) = (Arc::new(Barrier::new(4)), Arc::new(AtomicUsize::new(0)));
    let results: Vec<_> = (0..4u64)
        .map(|id| {
            let (go, asked, calls) = (Arc::clone(&go), Arc::clone(&asked), Arc::clone(&spill_calls));
            std::thread::spawn(move || {
                let scope = mm().begin("misbehaving", id, 0).unwrap();
                type Cache = Option<(memquota::Reservation, Vec<u8>)>;
                let cache: Arc<Mutex<Cache>> = Arc::new(Mutex::new(None));
                let held = Arc::clone(&cache);
                let consumer = scope
                    .consumer("cache", move |_| {
                        let n = calls.fetch_add(1, SeqCst);
                        let scratch = vec![1u8; 32 << 10];
                        std::hint::black_box(&scratch);
                        if n % 2 == 0 {
                            panic!("a spill callback allocates, then panics on purpose");
                        }
                        let Ok(mut held) = held.try_lock() else { return 0 };
                        held.take().map_or(0, |(_, c)| c.len() as u64)
                    })
                    .unwrap();
                let mut first = true;
                let r = with_retry(&scope, || {
                    if cache.lock().unwrap().is_none() {
                        let reservation = consumer.reserve(4 * MIB)?;
                        *cache.lock().unwrap() = Some((reservation, buffer(4 * MIB)?));
                    }
                    three_buffers(&go, &asked, &mut first)
                });
                cache.lock().unwrap().take();
                r
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let s = memquota::stats();
    support::say(format_args!(
        "{results:?}; spill calls {}, reclaims {}, waits {}, rollbacks {}, refusals {}\n",
        spill_calls.load(SeqCst),
        reclaims.load(SeqCst),
        s.retry.waits - before.retry.waits,
        s.retry.rollbacks - before.retry.rollbacks,
        s.ooms - before.ooms,
    ));
    for r in &results {
        assert_eq!(r.as_ref().ok(), Some(&(48 * MIB as usize)), "every task completes: {results:?}");
    }
    assert!(spill_calls.load(SeqCst) > 0, "the precondition: the spill callbacks ran");
    assert_eq!(s.ooms, before.ooms, "no request refused");
    assert_eq!(s.retry.timeouts, 0);
    assert_eq!(s.retry.blocked + s.retry.running + s.retry.bufn, 0, "every thread left its block");
}

/// Waits for `n` results on `rx` until `deadline`; a check whose threads hang (a
/// deadlock, a wait nothing ends) fails here with what it was waiting for, instead of
/// hanging until the watchdog.
fn results_by<T>(rx: &mpsc::Receiver<T>, n: usize, deadline: Instant, what: &str) -> Vec<T> {
    let mut got = Vec::new();
    while got.len() < n {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(r) => got.push(r),
            Err(_) => {
                support::say(format_args!("FAILED: {what}: {} of {n} threads returned in time\n", got.len()));
                // SAFETY: _exit ends the process without running anything that could
                // wait on the stuck threads.
                unsafe { libc::_exit(1) };
            }
        }
    }
    got
}

/// The user's lock that the heap probe takes for a moment.
static USER_LOCK: Mutex<()> = Mutex::new(());
/// Set on the blocked thread's first call of the probe (`B`'s thread id as a number).
static B_THREAD: AtomicU64 = AtomicU64::new(0);
/// The blocked thread is inside the probe, waiting for the user's lock.
static B_IN_PROBE: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// This thread holds the user's lock: the probe must not take it again.
    static HOLDS_USER_LOCK: Cell<bool> = const { Cell::new(false) };
}

fn thread_number() -> u64 {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() as u64 }
}

/// The user's heap probe: takes the user's lock for a moment (unless its thread holds
/// it already), as a JVM face's probe takes the JVM's locks through JNI.
fn probe_under_the_users_lock() -> memquota::HeapBytes {
    if HOLDS_USER_LOCK.with(Cell::get) {
        return memquota::HeapBytes::default();
    }
    let me = thread_number();
    if me == B_THREAD.load(SeqCst) {
        B_IN_PROBE.store(true, SeqCst);
    }
    let guard = USER_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if me == B_THREAD.load(SeqCst) {
        B_IN_PROBE.store(false, SeqCst);
    }
    drop(guard);
    memquota::HeapBytes::default()
}

/// Issue 30, item 4: the retry machine's lock must never be held while user code (the
/// heap probe) runs. Task A holds 40 MiB in a retry block under 64 MiB; task B's
/// 40 MiB blocks, waiting for it; thread C takes the user's lock L that the heap probe
/// takes, waits until B is inside the probe (waiting for L), and then, still holding
/// L, reads the stats and enters a retry block. With the probe called under the
/// machine's lock, B holds the machine waiting for L and C holds L waiting for the
/// machine: all three hang. Every thread must return.
fn a_heap_probe_that_takes_a_user_lock_never_deadlocks_the_machine() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_heap_probe(memquota::HeapProbe::Function(Box::new(probe_under_the_users_lock)));
    let (tx, rx) = mpsc::channel::<(&'static str, memquota::Result<usize>)>();
    let (a_holds, c_done) = (Arc::new(Barrier::new(2)), Arc::new(AtomicBool::new(false)));
    let a = {
        let (tx, a_holds, c_done) = (tx.clone(), Arc::clone(&a_holds), Arc::clone(&c_done));
        std::thread::spawn(move || {
            let scope = mm().begin("holder", 1, 0).unwrap();
            let mut first = true;
            let r = with_retry(&scope, || {
                let held = buffer(40 * MIB)?;
                if std::mem::take(&mut first) {
                    a_holds.wait();
                    while !c_done.load(SeqCst) {
                        std::thread::yield_now();
                    }
                }
                Ok(held.len())
            });
            let _ = tx.send(("A", r));
        })
    };
    a_holds.wait();
    let b = {
        let tx = tx.clone();
        std::thread::spawn(move || {
            B_THREAD.store(thread_number(), SeqCst);
            let scope = mm().begin("waiter", 2, 0).unwrap();
            let r = with_retry(&scope, || buffer(40 * MIB).map(|b| b.len()));
            let _ = tx.send(("B", r));
        })
    };
    // The precondition, forced: B is blocked in the machine before C takes L.
    while memquota::stats().retry.blocked == 0 {
        std::thread::yield_now();
    }
    let c = {
        let (tx, c_done) = (tx.clone(), Arc::clone(&c_done));
        std::thread::spawn(move || {
            let scope = mm().begin("lock holder", 3, 0).unwrap();
            let guard = USER_LOCK.lock().unwrap();
            HOLDS_USER_LOCK.with(|h| h.set(true));
            // The precondition, forced: B is inside the probe, waiting for L.
            while !B_IN_PROBE.load(SeqCst) {
                std::thread::yield_now();
            }
            let blocked = memquota::stats().retry.blocked;
            let r = with_retry(&scope, || Ok(blocked as usize));
            HOLDS_USER_LOCK.with(|h| h.set(false));
            drop(guard);
            c_done.store(true, SeqCst);
            let _ = tx.send(("C", r));
        })
    };
    drop(tx);
    let mut results = results_by(&rx, 3, Instant::now() + Duration::from_secs(20), "A, B and C");
    for t in [a, b, c] {
        t.join().unwrap();
    }
    results.sort_by_key(|r| r.0);
    support::say(format_args!("{results:?}\n"));
    assert_eq!(
        results,
        [("A", Ok(40 * MIB as usize)), ("B", Ok(40 * MIB as usize)), ("C", Ok(1))],
        "C saw B blocked; every task completes"
    );
}

/// 40 MiB of 64 held outside any scope; a thread attached to the scope outside any
/// retry block (it may free, so the scope is never blocked and the machine never acts);
/// the scope's 40 MiB requests in retry blocks block, an allocation and a reservation.
/// Nothing but the watchdog (10 s) would end their waits. The scope ends (as
/// `memquota_scope_end` ends it from another thread): both wake at once with
/// `Error::ScopeEnded`.
fn ending_a_scope_wakes_its_blocked_threads_at_once() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    let outside = buffer(40 * MIB).unwrap();
    let scope = Arc::new(mm().begin("ended under its waiters", 1, 0).unwrap());
    let handle = scope.handle();
    let (held, release) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let holder = {
        let (held, release) = (Arc::clone(&held), Arc::clone(&release));
        std::thread::spawn(move || {
            let a = handle.attach().unwrap();
            held.wait();
            release.wait();
            drop(a);
        })
    };
    held.wait();
    let (tx, rx) = mpsc::channel();
    let waiters: Vec<_> = ["allocation", "reservation"]
        .into_iter()
        .map(|what| {
            let (scope, tx) = (Arc::clone(&scope), tx.clone());
            std::thread::spawn(move || {
                let r = with_retry(&scope, || match what {
                    "allocation" => buffer(40 * MIB).map(|b| b.len()),
                    _ => scope.reserve(40 * MIB).map(|r| r.bytes() as usize),
                });
                let _ = tx.send((what, r, Instant::now()));
            })
        })
        .collect();
    drop(tx);
    // The precondition, forced: both wait in the machine.
    while memquota::stats().retry.blocked < 2 {
        std::thread::yield_now();
    }
    let before = memquota::stats();
    let ended = Instant::now();
    memquota::seam::scopes::end_raw(handle.as_raw()).unwrap();
    let mut results = results_by(&rx, 2, ended + Duration::from_secs(2), "the waiters of an ended scope");
    release.wait();
    holder.join().unwrap();
    for w in waiters {
        w.join().unwrap();
    }
    drop(outside);
    results.sort_by_key(|r| r.0);
    let s = memquota::stats();
    support::say(format_args!(
        "{:?}; woken after {:?} ms; timeouts {}, refusals {}\n",
        results.iter().map(|r| (r.0, &r.1)).collect::<Vec<_>>(),
        results.iter().map(|r| r.2.saturating_duration_since(ended).as_millis()).collect::<Vec<_>>(),
        s.retry.timeouts - before.retry.timeouts,
        s.ooms - before.ooms
    ));
    for (what, r, _) in &results {
        assert_eq!(r, &Err(Error::ScopeEnded), "{what}: the error says the scope ended");
    }
    assert_eq!(s.retry.timeouts, before.retry.timeouts, "no watchdog");
    assert_eq!(s.retry.scope_ended - before.retry.scope_ended, 2, "both waits ended by the scope's end");
    assert_eq!(s.retry.blocked + s.retry.running + s.retry.bufn, 0, "every thread left its block");
}

/// A rolled-back thread waits until further notice (BUFN) while an older task holds the
/// room it needs; its scope ends meanwhile: it wakes at once, and its retry block
/// returns `Error::ScopeEnded` instead of running the attempt again.
fn ending_a_scope_wakes_its_thread_waiting_to_retry() {
    memquota::init(Config::new().limit(64 * MIB)).unwrap();
    memquota::set_report_hook(support::counting_hook);
    // Both tasks hold 24 MiB, then each asks for 24 more (72 of 64): both blocked, the
    // younger rolls back and waits; the older completes its second buffer and holds
    // 48 MiB until told, so the younger's 24 MiB never fit meanwhile.
    let (go, older_holds, release) =
        (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
    let older = {
        let (go, older_holds, release) = (Arc::clone(&go), Arc::clone(&older_holds), Arc::clone(&release));
        std::thread::spawn(move || {
            let scope = mm().begin("older", 1, 0).unwrap();
            let mut first = true;
            with_retry(&scope, || {
                let a = buffer(24 * MIB)?;
                let once = std::mem::take(&mut first);
                if once {
                    go.wait();
                }
                let b = buffer(24 * MIB)?;
                if once {
                    older_holds.wait();
                    release.wait();
                }
                Ok(a.len() + b.len())
            })
        })
    };
    let younger_scope: Arc<Mutex<Option<u64>>> = Arc::new(Mutex::new(None));
    let (tx, rx) = mpsc::channel();
    let younger = {
        let (go, tx, younger_scope) = (Arc::clone(&go), tx.clone(), Arc::clone(&younger_scope));
        std::thread::spawn(move || {
            let scope = mm().begin("younger", 2, 0).unwrap();
            *younger_scope.lock().unwrap() = Some(scope.handle().as_raw());
            let mut first = true;
            let r = with_retry(&scope, || {
                let a = buffer(24 * MIB)?;
                if std::mem::take(&mut first) {
                    go.wait();
                }
                let b = buffer(24 * MIB)?;
                Ok(a.len() + b.len())
            });
            let _ = tx.send((r, Instant::now()));
        })
    };
    drop(tx);
    older_holds.wait();
    // The precondition, forced: the younger is rolled back and waiting.
    while memquota::stats().retry.bufn == 0 {
        std::thread::yield_now();
    }
    let handle = younger_scope.lock().unwrap().expect("the younger scope began");
    let ended = Instant::now();
    memquota::seam::scopes::end_raw(handle).unwrap();
    let results =
        results_by(&rx, 1, ended + Duration::from_secs(2), "the rolled-back thread of an ended scope");
    release.wait();
    let older = older.join().unwrap();
    younger.join().unwrap();
    let (r, woke) = &results[0];
    let s = memquota::stats();
    support::say(format_args!(
        "younger: {r:?} after {} ms; older: {older:?}; rollbacks {}, retries {}, timeouts {}\n",
        woke.saturating_duration_since(ended).as_millis(),
        s.retry.rollbacks,
        s.retry.retries,
        s.retry.timeouts
    ));
    assert_eq!(r, &Err(Error::ScopeEnded), "the error says the scope ended");
    assert_eq!(older, Ok(48 * MIB as usize));
    assert!(s.retry.rollbacks >= 1, "the precondition: the younger rolled back");
    assert_eq!(s.retry.timeouts, 0, "no watchdog");
    assert_eq!(s.retry.scope_ended, 1, "the wait ended by the scope's end");
    assert_eq!(s.retry.blocked + s.retry.running + s.retry.bufn, 0, "every thread left its block");
}
