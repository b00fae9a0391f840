//! Budget-aware purging (docs/design.md, "Purging"), each check in a process of its
//! own with the defaults a user gets (only the limit set):
//!
//! * under a tight budget, resident memory follows allocated memory: the freed pages
//!   of a large working set do not stay resident next to a new one that fills the
//!   budget; also with blocks of 1 MiB and more in jemalloc's one shared arena, as
//!   the preload starts jemalloc (`purge::added_jemalloc_options`): its freed blocks
//!   stay dirty far from the limit, and go past it;
//! * far from the limit, no page is purged on an allocating thread (jemalloc's own
//!   count of purged pages, against the purge service's);
//! * a user's own jemalloc decay option wins (and then jemalloc purges inline, which
//!   the same count sees: the check above could fail);
//! * a fork child, which has no purge service, gets jemalloc's own decay back;
//! * far from the limit, freed pages go back to the system after the purge interval;
//! * between the soft threshold and the limit dirty pages stay for reuse, and past
//!   the limit only the fullest arenas are purged, for the excess;
//! * a block granted but not yet written (counted, not yet resident) does not hide
//!   the dirty pages: they go before its pages are written.

mod support;

use memquota::{Config, QuotaAlloc};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use support::{Size, KIB, MIB};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

fn main() {
    support::run_isolated_with_env(
        &[
            ("resident_follows_allocated_under_a_tight_budget", resident_follows_allocated, &[]),
            (
                "resident_follows_allocated_with_large_blocks_in_one_shared_arena",
                resident_follows_allocated_in_one_arena,
                &[("_RJEM_MALLOC_CONF", "oversize_threshold:1048576")],
            ),
            ("far_from_the_limit_nothing_purges_inline", far_from_the_limit_nothing_purges_inline, &[]),
            (
                "a_users_own_decay_wins_and_purges_inline",
                a_users_own_decay_wins,
                &[("_RJEM_MALLOC_CONF", "dirty_decay_ms:10000")],
            ),
            ("a_fork_child_gets_jemallocs_decay_back", a_fork_child_gets_jemallocs_decay_back, &[]),
            (
                "dirty_pages_go_back_after_the_purge_interval",
                dirty_pages_go_back_after_the_purge_interval,
                &[],
            ),
            (
                "dirty_pages_use_the_room_under_the_limit_and_only_the_excess_goes",
                dirty_pages_use_the_room_under_the_limit,
                &[],
            ),
            (
                "a_block_not_yet_written_does_not_hide_the_dirty_pages",
                a_block_not_yet_written_does_not_hide_the_dirty_pages,
                &[],
            ),
        ],
        Duration::from_secs(60),
    );
}

/// jemalloc's decay for arenas created from now on.
fn arenas_dirty_decay_ms() -> isize {
    // SAFETY: `arenas.dirty_decay_ms` is an `ssize_t`.
    unsafe { tikv_jemalloc_ctl::raw::read::<isize>(b"arenas.dirty_decay_ms\0") }.unwrap()
}

/// A program's working set: 1 MiB blocks, every page written.
fn working_set(bytes: u64) -> Vec<Vec<u8>> {
    (0..bytes / MIB).map(|_| vec![1u8; MIB as usize]).collect()
}

/// [`resident_follows_allocated`] with the working set's 1 MiB blocks in jemalloc's
/// huge arena, which jemalloc would purge at once under a decay of its own.
fn resident_follows_allocated_in_one_arena() {
    // SAFETY: `opt.oversize_threshold` is a size_t.
    let threshold = unsafe { tikv_jemalloc_ctl::raw::read::<usize>(b"opt.oversize_threshold\0") }.unwrap();
    assert_eq!(threshold, MIB as usize, "_RJEM_MALLOC_CONF reached jemalloc");
    resident_follows_allocated();
}

fn resident_follows_allocated() {
    const LIMIT: u64 = 256 * MIB;
    memquota::init(Config::new().limit(LIMIT)).unwrap();
    assert_eq!(arenas_dirty_decay_ms(), -1, "far from the limit jemalloc does not purge by time");
    let baseline = memquota::seam::process::process_rss();
    // A working set of 200 MiB, freed: its pages stay resident, dirty (no purge by
    // time), in this thread's arena (or the huge arena).
    drop(working_set(200 * MIB));
    let dirty = memquota::stats().jemalloc.dirty;
    assert!(dirty >= 150 * MIB, "the freed working set is dirty: {}", Size(dirty));
    // Another thread (another arena, and blocks under 1 MiB: the pages above are not
    // reused) allocates up to the limit, writing every page, until it is refused.
    let filled = std::thread::spawn(|| {
        let mut blocks: Vec<Vec<u8>> = Vec::with_capacity(8192);
        loop {
            let mut b = Vec::new();
            if b.try_reserve_exact(64 * KIB as usize).is_err() {
                return blocks;
            }
            b.resize(64 * KIB as usize, 1);
            blocks.push(b);
        }
    })
    .join()
    .unwrap();
    let held = filled.len() as u64 * 64 * KIB;
    // Without a purge the process would hold limit + 200 MiB. What jemalloc cannot
    // purge (its metadata, the free parts of pages: a 64 KiB block takes 68 KiB of
    // pages) is its own overhead, not dirty pages: it is allowed, measured. The purge
    // service runs off this thread: wait for it, with a deadline.
    let floor = 1 << 20; // the dirty floor at a 256 MiB limit
    let deadline = Instant::now() + Duration::from_secs(5);
    let (rss, bound, s) = loop {
        let s = memquota::stats();
        let pinned = s.jemalloc.unused() - s.jemalloc.dirty.min(s.jemalloc.unused());
        let bound = LIMIT + baseline + pinned + floor;
        let rss = memquota::seam::process::process_rss();
        if rss <= bound || Instant::now() >= deadline {
            break (rss, bound, s);
        }
        std::thread::sleep(Duration::from_millis(10)); // polling, with a deadline
    };
    println!(
        "  baseline {}, held {}, RSS {} (peak {}) against {} (limit + baseline + jemalloc's \
         unpurgeable {} + floor 1 MiB); dirty {}; purges: {} budget, {} idle, {} returned",
        Size(baseline),
        Size(held),
        Size(rss),
        Size(s.process_rss_peak),
        Size(bound),
        Size(s.jemalloc.unused() - s.jemalloc.dirty.min(s.jemalloc.unused())),
        Size(s.jemalloc.dirty),
        s.purges_budget,
        s.purges_idle,
        Size(s.purged_bytes),
    );
    assert!(held >= LIMIT - 16 * MIB, "the filler got to the limit: {}", Size(held));
    assert!(rss <= bound, "dirty pages pushed the process past its limit: RSS {}", Size(rss));
    assert!(s.purges_budget >= 1 && s.purged_bytes >= 150 * MIB, "the budget purged the working set");
    drop(filled);
}

/// Runs the large-block loop (benches/large: 1-8 MiB blocks, four live, every page
/// written) on two threads, and returns the bytes jemalloc purged meanwhile that
/// memquota's purge service did not: purged on the allocating threads. Measured
/// while the threads are still alive: jemalloc purges an arena when the last thread
/// using it exits (after its last allocation), whatever its decay.
fn purged_inline_by_the_loop(rounds: u32) -> (u64, memquota::Stats) {
    let done = Arc::new(Barrier::new(3));
    let measured = Arc::new(Barrier::new(3));
    let before = memquota::stats();
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let (done, measured) = (Arc::clone(&done), Arc::clone(&measured));
            std::thread::spawn(move || {
                let mut s = 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(t + 1);
                let mut live: Vec<Vec<u8>> = Vec::new();
                for i in 0..rounds as usize {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    let size = MIB + (s >> 16) % (7 * MIB);
                    let block = vec![i as u8; size as usize];
                    if live.len() == 4 {
                        live[i % 4] = block;
                    } else {
                        live.push(block);
                    }
                }
                drop(live);
                done.wait();
                measured.wait();
            })
        })
        .collect();
    done.wait();
    let after = memquota::stats();
    measured.wait();
    for t in threads {
        t.join().unwrap();
    }
    let by_jemalloc = after.jemalloc.purged - before.jemalloc.purged;
    let by_service = after.purged_bytes - before.purged_bytes;
    println!("  jemalloc purged {}, of which the purge service {}", Size(by_jemalloc), Size(by_service));
    (by_jemalloc - by_service, after)
}

fn far_from_the_limit_nothing_purges_inline() {
    memquota::init(Config::new().limit(8 << 30)).unwrap();
    let (inline, s) = purged_inline_by_the_loop(2000);
    assert!(s.purging_by_memquota);
    assert_eq!(inline, 0, "pages were purged on the allocating threads: {}", Size(inline));
}

fn a_users_own_decay_wins() {
    memquota::init(Config::new().limit(8 << 30)).unwrap();
    assert_eq!(arenas_dirty_decay_ms(), 10_000, "_RJEM_MALLOC_CONF set it");
    let (inline, s) = purged_inline_by_the_loop(2000);
    assert!(!s.purging_by_memquota);
    // jemalloc's decay purges on the allocating threads, as the user chose: the count
    // the check above relies on sees it.
    assert!(inline > 0, "jemalloc's decay purged nothing inline");
}

fn a_fork_child_gets_jemallocs_decay_back() {
    memquota::init(Config::new().limit(1 << 30)).unwrap();
    assert_eq!(arenas_dirty_decay_ms(), -1);
    // SAFETY: the child only allocates (memquota's fork handlers leave its locks
    // usable), reads a jemalloc control and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let v: Vec<u8> = Vec::with_capacity(4 * MIB as usize); // a slow path
        std::hint::black_box(&v);
        let code = if arenas_dirty_decay_ms() == 10_000 { 0 } else { 1 };
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    let status = support::wait_child(pid, Duration::from_secs(10)).expect("the child exits");
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
    assert_eq!(arenas_dirty_decay_ms(), -1, "the parent keeps its purge service");
}

fn dirty_pages_go_back_after_the_purge_interval() {
    let interval = Duration::from_millis(200);
    memquota::init(Config::new().limit(1 << 30).purge_interval(Some(interval))).unwrap();
    drop(working_set(64 * MIB));
    // The service purges what stayed dirty for a whole interval (it may have purged
    // once already since it started: poll for the freed pages, with a deadline).
    let deadline = Instant::now() + Duration::from_secs(10);
    let s = loop {
        let s = memquota::stats();
        if (s.purges_idle >= 1 && s.purged_bytes >= 48 * MIB && s.jemalloc.dirty < MIB)
            || Instant::now() >= deadline
        {
            break s;
        }
        std::thread::sleep(Duration::from_millis(10)); // polling, with a deadline
    };
    println!(
        "  {} idle purges returned {}; dirty now {}",
        s.purges_idle,
        Size(s.purged_bytes),
        Size(s.jemalloc.dirty)
    );
    assert!(s.purges_idle >= 1 && s.purged_bytes >= 48 * MIB, "the freed 64 MiB went back");
    assert!(s.jemalloc.dirty < MIB, "dirty pages left: {}", Size(s.jemalloc.dirty));
    assert_eq!(s.purges_budget, 0, "far from the limit");
}

/// A thread bound to a jemalloc arena of its own that allocates `bytes` of 1 MiB
/// blocks, writes them and frees them: they stay there, dirty, while the thread
/// lives (jemalloc purges an arena whose last thread exits). Returns the arena and a
/// sender whose drop lets the thread end.
fn dirty_in_a_new_arena(bytes: u64) -> (u32, std::sync::mpsc::Sender<()>) {
    let (arena_tx, arena_rx) = std::sync::mpsc::channel();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        // SAFETY: `arenas.create` makes an arena and gives its index, an `unsigned`;
        // `thread.arena` takes one.
        let arena = unsafe { tikv_jemalloc_ctl::raw::read::<u32>(b"arenas.create\0") }.unwrap();
        // SAFETY: as above.
        unsafe { tikv_jemalloc_ctl::raw::write::<u32>(b"thread.arena\0", arena) }.unwrap();
        drop(working_set(bytes));
        arena_tx.send(arena).unwrap();
        let _ = end_rx.recv();
    });
    (arena_rx.recv().unwrap(), end_tx)
}

/// An arena's dirty bytes now.
fn arena_dirty(arena: u32) -> u64 {
    tikv_jemalloc_ctl::epoch::advance().unwrap();
    let name = format!("stats.arenas.{arena}.pdirty\0");
    // SAFETY: a NUL-terminated name of a `size_t` statistic.
    let pages = unsafe { tikv_jemalloc_ctl::raw::read::<usize>(name.as_bytes()) }.unwrap();
    pages as u64 * 4 * KIB
}

/// Waits until the purge service has made `n` more passes (its own count), with a
/// deadline.
fn sampler_passes(n: u64) {
    let until = memquota::stats().sampler_passes + n;
    let deadline = Instant::now() + Duration::from_secs(10);
    while memquota::stats().sampler_passes < until {
        assert!(Instant::now() < deadline, "the purge service made no pass for 10 s");
        std::thread::sleep(Duration::from_millis(5)); // polling its count, with a deadline
    }
}

/// The purge service's view of the process: native + the resident bytes the budget
/// does not count, the anonymous RSS past it.
fn view(s: &memquota::Stats) -> u64 {
    s.native.max(memquota::seam::process::anon_rss())
}

fn dirty_pages_use_the_room_under_the_limit() {
    const LIMIT: u64 = 512 * MIB; // soft threshold 435.2 MiB, dirty floor 2 MiB
    memquota::init(Config::new().limit(LIMIT)).unwrap();
    let ((big, _big_lives), (small, _small_lives)) =
        (dirty_in_a_new_arena(150 * MIB), dirty_in_a_new_arena(30 * MIB));
    let (big_dirty, small_dirty) = (arena_dirty(big), arena_dirty(small));
    // Held memory up to halfway between the soft threshold and the limit, as the
    // service sees it (the kernel's count: jemalloc's own also has the untouched
    // pages it pads large blocks with, a 1 MiB block taking a 1.25 MiB extent, and
    // counts the untouched rest of this thread's extents as dirty, about a quarter of
    // what it holds: less than the first arena's 187.5 MiB).
    let mut held = Vec::new();
    while view(&memquota::stats()) < (LIMIT * 85 / 100 + LIMIT) / 2 {
        held.push(vec![1u8; MIB as usize]);
    }
    // Past the soft threshold, under the limit: nothing purges.
    sampler_passes(3);
    let s = memquota::stats();
    println!(
        "  between: native {}, untracked {}, dirty {} ({} and {} in the two arenas), the service's view {}",
        Size(s.native),
        Size(s.untracked),
        Size(s.jemalloc.dirty),
        Size(arena_dirty(big)),
        Size(arena_dirty(small)),
        Size(view(&s))
    );
    assert!(view(&s) > LIMIT * 85 / 100 && view(&s) < LIMIT, "the check's premise: {}", Size(view(&s)));
    assert_eq!(s.purges_budget, 0, "dirty pages under the limit were purged");
    assert_eq!((arena_dirty(big), arena_dirty(small)), (big_dirty, small_dirty));
    // About 24 MiB past the limit: the fuller arena covers it, the other keeps its
    // pages.
    let more = working_set(LIMIT - view(&s) + 24 * MIB);
    let deadline = Instant::now() + Duration::from_secs(5);
    while memquota::stats().purges_budget == 0 {
        assert!(Instant::now() < deadline, "nothing purged 24 MiB past the limit");
        std::thread::sleep(Duration::from_millis(5)); // polling, with a deadline
    }
    sampler_passes(2);
    let s = memquota::stats();
    let (left_big, left_small) = (arena_dirty(big), arena_dirty(small));
    println!(
        "  past: native {}, purges {} budget for {}; dirty left {} of {} and {} of {}; view {}",
        Size(s.native),
        s.purges_budget,
        Size(s.purged_bytes),
        Size(left_big),
        Size(big_dirty),
        Size(left_small),
        Size(small_dirty),
        Size(view(&s))
    );
    assert!(left_big < MIB, "the fuller arena was not purged: {}", Size(left_big));
    assert_eq!(left_small, small_dirty, "the other arena's pages went too");
    assert!(view(&s) <= LIMIT, "past the limit after the purge: {}", Size(view(&s)));
    drop((held, more));
}

fn a_block_not_yet_written_does_not_hide_the_dirty_pages() {
    const LIMIT: u64 = 512 * MIB; // dirty floor 2 MiB
    memquota::init(Config::new().limit(LIMIT)).unwrap();
    let (arena, _lives) = dirty_in_a_new_arena(160 * MIB);
    let dirty = arena_dirty(arena);
    sampler_passes(3);
    let s = memquota::stats();
    assert!(view(&s) < LIMIT * 85 / 100, "the check's premise: {}", Size(view(&s)));
    // A block that takes native and the dirty pages past the limit, its pages not
    // written: counted at once, resident only once written.
    let block: Vec<u8> = Vec::with_capacity((LIMIT - 100 * MIB) as usize);
    let granted = memquota::stats();
    let anon = memquota::seam::process::anon_rss();
    println!(
        "  granted: native {}, anonymous RSS {} (dirty {} in the arena), jemalloc dirty {}",
        Size(granted.native),
        Size(anon),
        Size(dirty),
        Size(granted.jemalloc.dirty)
    );
    assert!(anon < granted.native, "the check's premise: the block's pages are not resident");
    assert!(granted.native + dirty > LIMIT, "the check's premise: native + the dirty pages pass the limit");
    sampler_passes(3);
    let s = memquota::stats();
    let left = arena_dirty(arena);
    println!(
        "  {} passes later: purges {} budget for {}; dirty left in the arena {} of {}",
        3,
        s.purges_budget,
        Size(s.purged_bytes),
        Size(left),
        Size(dirty)
    );
    assert!(s.purges_budget >= 1, "the dirty pages stayed next to the block about to be written");
    assert!(left < MIB, "the arena's dirty pages stayed: {}", Size(left));
    drop(block);
}
