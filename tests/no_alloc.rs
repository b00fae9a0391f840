//! `stats()` and the OOM report never allocate, nor does the refusing thread's hand-off
//! to the flight recorder (which the sampler thread writes). The global allocator here is
//! `QuotaAlloc` over a counting wrapper of jemalloc, so every allocation that reaches
//! the backing allocator on this thread is seen, and the allocation-site profile (on by
//! default) samples the program's blocks: the refusal reads the top sites.

mod support;

use memquota::{Config, Jemalloc, QuotaAlloc};
use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use support::run;

struct Counting;

thread_local! {
    static CALLS: Cell<u64> = const { Cell::new(0) };
}

fn calls() -> u64 {
    CALLS.with(Cell::get)
}

// SAFETY: forwards to jemalloc unchanged; the counter is a const thread-local Cell.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        CALLS.with(|c| c.set(c.get() + 1));
        // SAFETY: the caller upholds `alloc`'s contract.
        unsafe { Jemalloc.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller upholds `dealloc`'s contract.
        unsafe { Jemalloc.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        CALLS.with(|c| c.set(c.get() + 1));
        // SAFETY: the caller upholds `realloc`'s contract.
        unsafe { Jemalloc.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: QuotaAlloc<Counting> = QuotaAlloc::wrap(Counting);

fn records() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("memquota-no-alloc-records-{}", std::process::id()))
}

fn main() {
    memquota::init(Config::new().limit(32 << 20).profile_dir(records().to_str().unwrap())).unwrap();
    run(&[("stats_never_allocates", stats_never_allocates), ("refusal_and_report_never_allocate", refusal)]);
}

fn stats_never_allocates() {
    let _warm = memquota::stats();
    let before = calls();
    let s = memquota::stats();
    assert_eq!(calls(), before, "stats() allocated");
    assert_eq!(s.limit, 32 << 20);
}

fn refusal() {
    // The default hook (write(2) to stderr) and no reclaim callback: the path from the
    // refused request to the returned error is memquota's alone. 8 MiB held in 64 KiB
    // blocks: the profile (on by default, one sample per 512 KiB) has live samples, about
    // 15, so the refusal reads the top sites too (none at all: about e^-15).
    let held: Vec<Vec<u8>> = (0..128).map(|_| std::hint::black_box(vec![1u8; 64 << 10])).collect();
    let mut v: Vec<u8> = Vec::new();
    let before = calls();
    let refused = v.try_reserve_exact(64 << 20).is_err();
    let during = calls() - before;
    assert!(refused);
    assert_eq!(during, 0, "the refusal path allocated {during} times");
    let report = memquota::last_report().unwrap();
    assert!(report.contains("64.0 MiB (67108864) requested"), "{report}");
    let mut sites = report.lines().skip_while(|l| !l.trim_start().starts_with("top sites"));
    assert!(
        sites.nth(1).is_some_and(|l| l.contains("% ")),
        "the refusal named the profile's top sites:\n{report}"
    );
    drop(held);
    // The hand-off ran: the sampler thread wrote the record the refusal waited for.
    let written = std::fs::read_dir(records()).map(|d| d.count()).unwrap_or(0);
    let _ = std::fs::remove_dir_all(records());
    assert_eq!(written, 1, "one flight record");
}
