//! Shared by the harness-less test binaries: a tiny runner that prints the closing
//! line cargo's summary readers know, and a deterministic RNG.
#![allow(dead_code)]

use std::time::Instant;

/// Waits (polling, no sleeping; at most 30 s) until memquota's sampler thread has
/// finished starting: its start-up allocates and frees a little, charged like any
/// thread's, and a check that compares the process account before and after must
/// not see it (a delayed start landed in such a window now and then under load).
pub fn wait_for_sampler() {
    let start = Instant::now();
    while memquota::stats().sampler_passes < 2 {
        assert!(start.elapsed().as_secs() < 30, "the sampler thread never completed two passes");
        std::thread::yield_now();
    }
}

/// Runs the named checks in order, printing one line each, then `N passed; M failed`.
/// Exits non-zero if any failed. A check fails by panicking.
pub fn run(checks: &[(&str, fn())]) {
    // A failing check prints a message and maybe a backtrace, which allocates; under
    // a tight test budget that could be refused mid-print. Lift the limit first, except
    // for a panic a check plants in a callback (its message says "on purpose"): that
    // one is caught by memquota, and the limit must stay for what the check asserts.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>().is_some_and(|m| m.contains("on purpose")) {
            return;
        }
        memquota::set_limit(1 << 50);
        report(info)
    }));
    let mut failed = 0;
    for (name, check) in checks {
        let started = Instant::now();
        let ok = std::panic::catch_unwind(check).is_ok();
        println!(
            "test {name} ... {} ({} ms)",
            if ok { "ok" } else { "FAILED" },
            started.elapsed().as_millis()
        );
        failed += usize::from(!ok);
    }
    println!(
        "\ntest result: {}. {} passed; {failed} failed",
        if failed == 0 { "ok" } else { "FAILED" },
        checks.len() - failed
    );
    if failed > 0 {
        std::process::exit(101);
    }
}

/// xorshift64*: deterministic, allocation-free.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Mostly small sizes, some up to 256 KiB, a few up to 2 MiB: crosses every
    /// threshold the ledger can have.
    pub fn size(&mut self) -> usize {
        (match self.below(100) {
            0..=79 => 1 + self.below(512),
            80..=97 => 1 + self.below(256 << 10),
            _ => 1 + self.below(2 << 20),
        }) as usize
    }
}
