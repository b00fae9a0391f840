//! The main job in a few seconds: a budget, a cache that shrinks when the budget
//! asks it to (the "GC"), a refused allocation with its report, and the stats.
//!
//!     cargo run --release --example demo

use memquota::{Config, QuotaAlloc, Stats};
use std::sync::Mutex;

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

const MIB: usize = 1 << 20;

/// A cache of 1 MiB blocks that can give memory back.
static CACHE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn show(label: &str, s: &Stats) {
    println!(
        "{label:<28} native {:>4} MiB  limit {:>4} MiB  headroom {:>4} MiB  reclaims {} (freed {} MiB)  refusals {}",
        s.native / MIB as u64,
        s.limit / MIB as u64,
        s.headroom / MIB as u64,
        s.reclaims_sync + s.reclaims_background,
        s.reclaimed_bytes / MIB as u64,
        s.ooms
    );
}

fn main() -> memquota::Result<()> {
    // MEMQUOTA_* variables still apply; the demo pins the limit so its story holds.
    memquota::init(Config::from_env()?.limit(256 * MIB as u64))?;
    memquota::on_reclaim(|need| {
        // try_lock: the thread that needs room may hold the cache lock itself.
        let Ok(mut cache) = CACHE.try_lock() else { return };
        let mut freed = 0;
        while freed < need {
            let Some(block) = cache.pop() else { break };
            freed += block.len();
        }
        println!("  reclaim callback: asked for {} MiB, dropped {} MiB of cache", need / MIB, freed / MIB);
    });
    show("start", &memquota::stats());

    for _ in 0..150 {
        CACHE.lock().unwrap().push(vec![1u8; MIB]);
    }
    show("cache filled (150 MiB)", &memquota::stats());

    println!("allocating a 120 MiB working buffer: over the 256 MiB limit, so the cache must shrink");
    let work = vec![2u8; 120 * MIB];
    show("working buffer granted", &memquota::stats());
    println!("  cache now holds {} MiB", CACHE.lock().unwrap().len());

    println!("asking for 1 GiB with try_reserve: no reclaim can make that much room");
    let mut huge: Vec<u8> = Vec::new();
    match huge.try_reserve(1 << 30) {
        Ok(()) => fail("1 GiB was granted under a 256 MiB limit"),
        Err(e) => println!("  refused as expected: {e}"),
    }
    drop(work);
    memquota::flush_thread();
    let s = memquota::stats();
    show("after dropping the buffer", &s);
    println!("\nfull stats: {s:#?}");
    if s.reclaims_sync + s.reclaims_background == 0 || s.ooms == 0 {
        fail("the story needs at least one reclaim and one refusal");
    }
    Ok(())
}

/// The demo doubles as a smoke test (scripts/test.sh runs it): it fails loudly when
/// its story does not hold.
fn fail(why: &str) -> ! {
    eprintln!("demo: {why}");
    std::process::exit(1);
}
