//! Property test of the ledger and quota against a model: random programs of
//! alloc / alloc_zeroed / realloc / free / flush / limit changes, run through a
//! `QuotaAlloc` over `System` on one thread. This binary's global allocator is the
//! plain system one, so the only charges are the ones the program makes.

use memquota::{Config, QuotaAlloc, Untracked};
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};

static QUOTA: QuotaAlloc<System> = QuotaAlloc::wrap(System);

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    AllocZeroed(usize),
    Realloc(usize, usize),
    Free(usize),
    Flush,
    /// Sets the limit to the live bytes plus this much room.
    Limit(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![4 => 1usize..512, 3 => 512usize..(64 << 10), 1 => (64usize << 10)..(1 << 20)];
    prop_oneof![
        4 => size.clone().prop_map(Op::Alloc),
        1 => size.clone().prop_map(Op::AllocZeroed),
        2 => (any::<usize>(), size).prop_map(|(i, s)| Op::Realloc(i, s)),
        3 => any::<usize>().prop_map(Op::Free),
        1 => Just(Op::Flush),
        1 => (0usize..(4 << 20)).prop_map(Op::Limit),
    ]
}

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, 8).unwrap()
}

/// Tracked bytes as this thread sees them: flushed plus its own pending delta.
fn tracked() -> i64 {
    memquota::stats().native as i64 + memquota::thread_pending()
}

thread_local! {
    /// Whether this thread was ever refused: it may draw on the emergency reserve.
    static REFUSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn check(ops: Vec<Op>) -> Result<(), TestCaseError> {
    memquota::set_report_hook(|_| {}); // refusals are expected here, by the thousand
    let mut limit: u64 = 1 << 20;
    // The model is of the ledger and the quota: untracked memory (this process's own
    // System allocations, sampled every 50 ms) is reported, not counted.
    memquota::init(Config::new().limit(limit).untracked(Untracked::Report)).unwrap();
    memquota::flush_thread();
    // Normally 0; more if an earlier failing case (while proptest shrinks) left
    // blocks behind.
    let base = tracked() as u64;
    let mut live: Vec<(*mut u8, usize)> = Vec::new();
    let mut model: u64 = 0;
    // A thread keeps the slack it got at its last flush: the largest since a change.
    let mut slack = memquota::seam::process::threshold_for(limit);
    // Grants are checked at flushes. A flush adds the pending delta unconditionally
    // (that memory is already taken), so the flushed total may pass the limit by less
    // than the slack, and the next deltas by less than the slack again: usage stays
    // under the ceiling plus twice the slack, where the ceiling is the limit or, after
    // the limit was lowered under the flushed total, that total. Once a request was
    // refused, the thread may also draw small ones on the emergency reserve, past the
    // ceiling by at most the reserve's size; the right lasts until the reserve is next
    // refilled, so a refusal in an earlier case counts too.
    let mut ceiling = limit;
    for op in ops {
        let before = model;
        let refused_for = match op {
            Op::Alloc(n) | Op::AllocZeroed(n) => {
                // SAFETY: n >= 1, align 8.
                let p = unsafe {
                    if matches!(op, Op::Alloc(_)) {
                        QUOTA.alloc(layout(n))
                    } else {
                        QUOTA.alloc_zeroed(layout(n))
                    }
                };
                if p.is_null() {
                    Some(n as u64)
                } else {
                    live.push((p, n));
                    model += n as u64;
                    None
                }
            }
            Op::Realloc(i, n) if !live.is_empty() => {
                let k = i % live.len();
                let (p, old) = live[k];
                // SAFETY: p is live from QUOTA with layout(old); n >= 1.
                let q = unsafe { QUOTA.realloc(p, layout(old), n) };
                if q.is_null() {
                    Some(n.saturating_sub(old) as u64)
                } else {
                    live[k] = (q, n);
                    model = model - old as u64 + n as u64;
                    None
                }
            }
            Op::Free(i) if !live.is_empty() => {
                let (p, n) = live.swap_remove(i % live.len());
                // SAFETY: p is live from QUOTA with layout(n).
                unsafe { QUOTA.dealloc(p, layout(n)) };
                model -= n as u64;
                None
            }
            Op::Flush => {
                memquota::flush_thread();
                prop_assert_eq!(memquota::thread_pending(), 0);
                None
            }
            Op::Limit(room) => {
                limit = base + model + room as u64 + 1;
                memquota::set_limit(limit);
                slack = slack.max(memquota::seam::process::threshold_for(limit));
                ceiling = limit.max(memquota::stats().native);
                None
            }
            _ => None,
        };
        if refused_for.is_some() {
            REFUSED.set(true);
        }
        let reserve = if REFUSED.get() { memquota::seam::slow::emergency_reserve_for(limit) } else { 0 };
        // Exact at every step: invariant 2 on one thread.
        prop_assert_eq!(tracked() - base as i64, model as i64, "after {:?}", op);
        // Invariant 3: the unflushed part stays under the slack.
        prop_assert!(memquota::thread_pending().unsigned_abs() < slack);
        match refused_for {
            // Refused only when the request really did not fit (no reclaim here).
            Some(n) => prop_assert!(
                base + before + n > limit,
                "refused {} with {} of {} used",
                n,
                base + before,
                limit
            ),
            None => prop_assert!(
                base + model < ceiling + 2 * slack + reserve || model <= before,
                "{} granted over {} (limit {}, flushed {}, pending {}, slack {}, reserve {})",
                base + model,
                ceiling,
                limit,
                memquota::stats().native,
                memquota::thread_pending(),
                slack,
                reserve
            ),
        }
    }
    for (p, n) in live {
        // SAFETY: p is live from QUOTA with layout(n).
        unsafe { QUOTA.dealloc(p, layout(n)) };
    }
    memquota::flush_thread();
    prop_assert_eq!(tracked(), base as i64);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn ledger_and_quota_match_the_model(ops in prop::collection::vec(op(), 1..400)) {
        check(ops)?;
    }
}
