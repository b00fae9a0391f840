//! Queries at once on one runtime under one limit (issue 31, item 4), each case in a
//! process of its own (the budget is process-wide): this binary runs itself with
//! `--case NAME LIMIT_MIB`, and the child prints what it saw for the parent to check.
//!
//! The heavy query is a stand-in for an operator's state, grown through the runtime's
//! pool as DataFusion's operators grow theirs (a spillable reservation like an
//! aggregate's, one that cannot spill like a hash join's build side), so that what it
//! holds, and when it grows again, is forced rather than hoped for: it fills the
//! budget while it runs alone, then waits at a gate. The light query is a real one, a
//! hash join (whose build side cannot spill) well within its fair share. The gate
//! opens once the light query's request waits in the pool (or the light query has
//! ended: on a pool that does not wait it fails at once):
//!
//! * the heavy query holds a spillable reservation: asked to spill, it spills at its
//!   next growth, and the light query completes;
//! * it holds only memory it cannot spill: its next growth fails it, with an error
//!   that names it and the query it gives way to, and the light query completes;
//! * a query that cannot fit at all, alone, fails at once with an error naming it and
//!   what holds the memory, and the next query on the same runtime completes.

mod harness;
#[path = "../examples/query/workload.rs"]
mod workload;

use harness::Seen;
use memquota_datafusion::datafusion::error::{DataFusionError, Result};
use memquota_datafusion::datafusion::execution::memory_pool::{
    MemoryConsumer, MemoryPool, MemoryReservation,
};
use memquota_datafusion::{run_query, MemquotaPool};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: memquota::QuotaAlloc = memquota::QuotaAlloc::new();

const MIB: u64 = 1 << 20;
const LIMIT_MIB: u64 = 128;
/// Rows of each side of the light query's join: its hash-join build side fits its
/// share of 128 MiB (it fits 64 MiB alone: tests/queries.rs).
const LIGHT_ROWS: u64 = 500_000;
/// The heavy query grows by this much a request.
const CHUNK: usize = 1 << 20;
/// Its spillable reservation, grown first: a spiller holding `r` is refused when
/// `r` + the margin (20% of the limit) + `r` no longer fit, so 40 MiB fits 128 MiB.
const SPILLABLE: u64 = 40 * MIB;
/// How long a request may wait for room here: far longer than the heavy query takes
/// to reach its next growth once its gate is open, so that the outcome never depends
/// on the machine's speed (a wait ends as soon as a release makes room).
const ROOM_WAIT: Duration = Duration::from_secs(60);

/// Memory an operator holds: a reservation and the bytes it covers.
struct Held {
    reservation: MemoryReservation,
    bytes: Vec<Vec<u8>>,
}

impl Held {
    fn new(pool: &Arc<dyn MemoryPool>, name: &str, can_spill: bool) -> Held {
        Held {
            reservation: MemoryConsumer::new(name).with_can_spill(can_spill).register(pool),
            bytes: Vec::new(),
        }
    }

    /// One chunk more, reserved then allocated (and touched).
    fn grow(&mut self) -> Result<()> {
        self.reservation.try_grow(CHUNK)?;
        self.bytes.push(vec![1u8; CHUNK]);
        Ok(())
    }

    /// What a spill does: the memory goes (to disk, in an operator), the reservation
    /// with it.
    fn spill(&mut self) {
        self.bytes.clear();
        self.reservation.free();
    }
}

/// The heavy query: `spillable` bytes in a spiller, then a consumer that cannot spill
/// grown until the pool refuses it (the budget is full) or `fixed_cap` is reached
/// (`strict`: a refusal then fails the query); sends what it holds on `held`, waits
/// for `go`, then grows once more: the spiller if it has one (spilling when refused),
/// else the other consumer (failing when refused). Returns its spills.
async fn heavy(
    pool: Arc<dyn MemoryPool>,
    spillable: u64,
    fixed_cap: u64,
    strict: bool,
    held: mpsc::Sender<u64>,
    go: tokio::sync::oneshot::Receiver<()>,
) -> Result<u64> {
    let mut spiller = Held::new(&pool, "HeavySpiller", true);
    while (spiller.reservation.size() as u64) < spillable {
        spiller.grow()?;
    }
    let mut fixed = Held::new(&pool, "HeavyBuildSide", false);
    while (fixed.reservation.size() as u64) < fixed_cap {
        match fixed.grow() {
            Ok(()) => {}
            Err(e) if strict => return Err(e),
            Err(_) => break,
        }
    }
    let _ = held.send((spiller.reservation.size() + fixed.reservation.size()) as u64);
    let _ = go.await;
    let mut spills = 0;
    if spillable > 0 {
        if spiller.grow().is_err() {
            spiller.spill();
            spills += 1;
        }
    } else {
        fixed.grow()?;
    }
    Ok(spills)
}

fn print_outcome(key: &str, out: &Result<u64>) {
    match out.as_ref().map_err(DataFusionError::find_root) {
        Ok(n) => println!("{key} completed {n}"),
        Err(DataFusionError::ResourcesExhausted(message)) => {
            println!("{key} ResourcesExhausted");
            for line in message.lines() {
                println!("{key}-message {line}");
            }
        }
        Err(e) => println!("{key} other-error {}", e.to_string().replace('\n', " | ")),
    }
}

// ---- the child: one case, figures on stdout ---------------------------------------

fn child(case: &str, limit_mib: u64) -> Result<()> {
    memquota::init(memquota::Config::new().limit(limit_mib * MIB)).expect("a valid limit");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let pool = Arc::new(MemquotaPool::new().with_room_wait(ROOM_WAIT));
    let ctx = workload::session(pool.clone(), true)?;
    let dyn_pool: Arc<dyn MemoryPool> = pool.clone();
    let light = |ctx: &memquota_datafusion::datafusion::prelude::SessionContext| {
        let ctx = ctx.clone();
        runtime.spawn(async move {
            run_query("light", async { workload::run_join(&ctx, LIGHT_ROWS).await.map(|n| n as u64) }).await
        })
    };
    match case {
        "heavy-spills" | "heavy-fails" => {
            let spillable = if case == "heavy-spills" { SPILLABLE } else { 0 };
            let (held_tx, held_rx) = mpsc::channel();
            let (go, gate) = tokio::sync::oneshot::channel();
            let heavy = runtime.spawn(run_query(
                "heavy",
                heavy(Arc::clone(&dyn_pool), spillable, 2 * limit_mib * MIB, false, held_tx, gate),
            ));
            // The heavy query holds the budget, alone, before the light one begins.
            let held = held_rx.recv().unwrap_or(0);
            println!("heavy-held {held}");
            let refusals_before = pool.refusals();
            let light = light(&ctx);
            // The gate opens once the light query's request waits (or it has ended).
            // Polled: the pool has no signal for a wait, and the outcome does not hang
            // on this loop's pace, only on its condition.
            let deadline = Instant::now() + Duration::from_secs(120);
            while pool.stats().waiting == 0 && !light.is_finished() {
                assert!(Instant::now() < deadline, "the light query neither waited nor ended in 120 s");
                std::thread::sleep(Duration::from_millis(1));
            }
            println!("waited-before-the-gate {}", u8::from(pool.stats().waiting > 0));
            println!("light-refusals-before-the-gate {}", pool.refusals() - refusals_before);
            let _ = go.send(());
            let light = runtime.block_on(light).expect("the light query's task");
            let heavy = runtime.block_on(heavy).expect("the heavy query's task");
            print_outcome("light", &light);
            print_outcome("heavy", &heavy);
        }
        "unfittable-then-next" => {
            let (held_tx, _held_rx) = mpsc::channel();
            let (_go, gate) = tokio::sync::oneshot::channel();
            let too_big = runtime.block_on(runtime.spawn(run_query(
                "too big",
                heavy(Arc::clone(&dyn_pool), 0, 2 * limit_mib * MIB, true, held_tx, gate),
            )));
            print_outcome("too-big", &too_big.expect("its task"));
            let next = runtime.block_on(light(&ctx)).expect("the next query's task");
            print_outcome("light", &next);
        }
        other => panic!("no case {other}"),
    }
    let s = pool.stats();
    println!("waits {}", s.waits);
    println!("waits-with-room {}", s.waits_with_room);
    println!("spill-asks {}", s.spill_asks);
    println!("heaviest-failed {}", s.heaviest_failed);
    println!("refusals {}", s.refusals);
    let m = memquota::stats();
    println!("native-peak {}", m.native_peak);
    println!("error-bound {}", m.error_bound);
    println!("rss-peak {}", m.process_rss_peak);
    Ok(())
}

// ---- the parent ---------------------------------------------------------------------

/// What a child printed: its lines by first word.
fn run_child(case: &str) -> Seen {
    let (seen, took) = harness::run_child(case, LIMIT_MIB);
    println!(
        "  {case} at {LIMIT_MIB} MiB: {:.1} s, tracked peak {:.1} MiB, RSS peak {:.1} MiB, {} waits ({} ended in room), {} refusals",
        took.as_secs_f64(),
        seen.num("native-peak") as f64 / MIB as f64,
        seen.num("rss-peak") as f64 / MIB as f64,
        seen.num("waits"),
        seen.num("waits-with-room"),
        seen.num("refusals"),
    );
    seen
}

/// The light query completed with the right answer, having waited for room.
fn the_light_query_waited_and_completed(seen: &Seen) {
    let held = seen.num("heavy-held");
    assert!(held > LIMIT_MIB * MIB / 2, "the heavy query holds {held}, not past its share\n{}", seen.text);
    assert_eq!(seen.num("waited-before-the-gate"), 1, "the light query did not wait for room\n{}", seen.text);
    assert_eq!(
        seen.one("light"),
        format!("completed {}", workload::join_count(LIGHT_ROWS)),
        "the light query\n{}",
        seen.text
    );
    assert!(seen.num("waits-with-room") >= 1, "{}", seen.text);
    let (peak, bound) = (seen.num("native-peak"), seen.num("error-bound"));
    assert!(peak <= LIMIT_MIB * MIB + bound, "tracked peak {peak}\n{}", seen.text);
}

fn the_heavy_query_spills_and_the_light_one_completes() {
    let seen = run_child("heavy-spills");
    the_light_query_waited_and_completed(&seen);
    assert_eq!(seen.one("heavy"), "completed 1", "the heavy query spilled once\n{}", seen.text);
    assert!(seen.num("spill-asks") >= 1, "the heavy query was asked to spill\n{}", seen.text);
    assert_eq!(seen.num("heaviest-failed"), 0, "{}", seen.text);
}

fn the_heavy_query_gives_way_and_the_light_one_completes() {
    let seen = run_child("heavy-fails");
    the_light_query_waited_and_completed(&seen);
    assert_eq!(seen.one("heavy"), "ResourcesExhausted", "{}", seen.text);
    let message = seen.message("heavy");
    for part in [
        "HeavyBuildSide",
        "query \"heavy\" holds",
        "query \"light\" waited for room: the query furthest over its share gives way and fails",
        "Queries (held against the fair share):",
        "(this request's)",
        "Top memory consumers",
    ] {
        assert!(message.contains(part), "no {part:?} in the heavy query's error:\n{message}");
    }
    assert_eq!(seen.num("heaviest-failed"), 1, "{}", seen.text);
    assert_eq!(seen.num("spill-asks"), 0, "nothing to spill\n{}", seen.text);
}

fn a_query_that_cannot_fit_fails_naming_it_and_the_next_runs() {
    let seen = run_child("unfittable-then-next");
    assert_eq!(seen.one("too-big"), "ResourcesExhausted", "{}", seen.text);
    let message = seen.message("too-big");
    for part in ["HeavyBuildSide", "query \"too big\" holds", "(this request's)", "Top memory consumers"] {
        assert!(message.contains(part), "no {part:?} in the error:\n{message}");
    }
    assert_eq!(seen.num("waits"), 0, "a query alone waits for nobody\n{}", seen.text);
    assert_eq!(
        seen.one("light"),
        format!("completed {}", workload::join_count(LIGHT_ROWS)),
        "the next query\n{}",
        seen.text
    );
}

fn main() {
    harness::main(
        child,
        &[
            (
                "the_heavy_query_spills_and_the_light_one_completes",
                &the_heavy_query_spills_and_the_light_one_completes,
            ),
            (
                "the_heavy_query_gives_way_and_the_light_one_completes",
                &the_heavy_query_gives_way_and_the_light_one_completes,
            ),
            (
                "a_query_that_cannot_fit_fails_naming_it_and_the_next_runs",
                &a_query_that_cannot_fit_fails_naming_it_and_the_next_runs,
            ),
        ],
    );
}
