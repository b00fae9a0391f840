//! Allocation sites in the Rust face's OOM report (docs/design.md, "Allocation
//! sites"), one check each in a process of its own: jemalloc starts able to profile
//! (the `profile` feature compiles its options in), and `MEMQUOTA_PROFILE_SAMPLE`, read
//! by `Config::from_env`, turns sampling on. The report's frames are `OBJECT+ADDR`; this test names them
//! with `addr2line`, as `memquota run` does. The preload's side is
//! `ld_preload/tests/preload.rs` (`tests/c/sites.c`).

#[path = "support/pprof.rs"]
mod pprof;
mod support;

use memquota::{Config, MemoryManager, QuotaAlloc};
use std::hint::black_box;
use std::process::Command;
use std::time::Duration;
use support::{KIB, MIB};

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

fn main() {
    support::run_isolated_with_env(
        &[
            (
                "a_refusal_names_the_two_sites_holding_the_memory",
                a_refusal_names_the_two_sites_holding_the_memory,
                FINE,
            ),
            ("memory_freed_leaves_the_sites", memory_freed_leaves_the_sites, FINE),
            ("each_scope_names_its_own_sites", each_scope_names_its_own_sites, FINE),
            (
                "profile_sample_0_turns_the_profile_off",
                profile_sample_0_turns_the_profile_off,
                &[("MEMQUOTA_PROFILE_SAMPLE", "0")],
            ),
            (
                "the_endpoints_heap_profile_is_read_by_pprof",
                the_endpoints_heap_profile_is_read_by_pprof,
                FINE,
            ),
            ("a_refusal_leaves_a_flight_record", a_refusal_leaves_a_flight_record, FINE),
            ("the_profile_is_on_by_default", the_profile_is_on_by_default, &[]),
            ("a_refusal_on_a_thread_with_a_48_kib_stack_writes_its_report", a_refusal_on_a_small_stack, &[]),
            ("the_rust_faces_entry_points_are_learned", the_rust_faces_entry_points_are_learned, &[]),
            (
                "a_small_block_sites_stack_starts_in_its_function",
                a_small_block_sites_stack_starts_in_its_function,
                &[],
            ),
            (
                "the_endpoint_says_how_to_turn_the_profile_on",
                the_endpoint_says_how_to_turn_the_profile_on,
                &[("MEMQUOTA_PROFILE_SAMPLE", "0")],
            ),
        ],
        Duration::from_secs(60),
    );
}

/// One sample per 16 KiB: the estimates are random, and 8 MiB at the default 512 KiB
/// is about 16 samples, whose count is off by more than a quarter about one run in
/// three; at 16 KiB, 512 samples, more than five standard deviations.
const FINE: &[(&str, &str)] = &[("MEMQUOTA_PROFILE_SAMPLE", "16k")];

/// 64 KiB blocks from one function.
#[inline(never)]
fn big_site(n: usize) -> Vec<Vec<u8>> {
    // A loop of its own rather than a `collect`, which the compiler may make a tail
    // call: then no frame of this function is in the stack.
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(black_box(vec![1u8; 64 * KIB as usize]));
    }
    black_box(held)
}

/// 4 KiB blocks from another.
#[inline(never)]
fn small_site(n: usize) -> Vec<Vec<u8>> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(black_box(vec![2u8; 4 * KIB as usize]));
    }
    black_box(held)
}

/// Blocks allocated and freed at once: never live.
#[inline(never)]
fn churn_site(n: usize) {
    for _ in 0..n {
        black_box(vec![3u8; 64 * KIB as usize]);
    }
}

/// Fills a 64 MiB budget with 48 MiB from `big_site` and 8 MiB from `small_site`,
/// then asks for 32 MiB: the report of the refusal.
fn refused_report() -> String {
    let config = Config::from_env().expect("the environment's configuration").limit(64 * MIB);
    memquota::init(config).unwrap();
    memquota::set_report_hook(|_| {});
    let big = big_site(768);
    let small = small_site(2048);
    let mut v: Vec<u8> = Vec::new();
    assert!(v.try_reserve_exact(32 * MIB as usize).is_err(), "32 MiB past 56 MiB held is refused at 64 MiB");
    let report = memquota::last_report().expect("a report");
    drop((big, small));
    report
}

/// One site of a report: estimated bytes, and its frames named by addr2line.
struct Site {
    bytes: u64,
    names: Vec<String>,
}

/// The report's sites, each frame (`OBJECT+ADDR`, or `+ADDR` in the object of the
/// frame before) named by `addr2line -f -i`.
fn sites(report: &str) -> Vec<Site> {
    let mut lines = report.lines().skip_while(|l| !l.trim_start().starts_with("top sites"));
    assert!(lines.next().is_some(), "the report names its top sites:\n{report}");
    let mut out = Vec::new();
    for line in lines.take_while(|l| l.starts_with("    ")) {
        // "    42.6 MiB (44622215)  85.0%  /obj+0x11cd <- +0x1084 <- /lib+0x27249"
        let bytes: u64 =
            line.split(['(', ')']).nth(1).and_then(|b| b.parse().ok()).expect("bytes in parentheses");
        let frames = line.split_once('%').expect("a share").1;
        out.push(Site { bytes, names: names(frames) });
    }
    out
}

fn named(site: &Site, function: &str) -> bool {
    site.names.iter().any(|n| n.contains(function))
}

fn within(bytes: u64, expected: u64) -> bool {
    bytes >= expected * 3 / 4 && bytes <= expected * 5 / 4
}

/// The two sites come first, named, their estimates within 25% of what they hold.
fn a_refusal_names_the_two_sites_holding_the_memory() {
    let report = refused_report();
    println!("{report}");
    let sites = sites(&report);
    assert!(sites.len() >= 2, "two sites at least:\n{report}");
    for s in &sites {
        println!("  {} bytes: {:?}", s.bytes, s.names);
    }
    assert!(named(&sites[0], "big_site"), "the first site is big_site:\n{report}");
    assert!(within(sites[0].bytes, 48 * MIB), "big_site's 48 MiB within 25%: {}", sites[0].bytes);
    assert!(named(&sites[1], "small_site"), "the second site is small_site:\n{report}");
    assert!(within(sites[1].bytes, 8 * MIB), "small_site's 8 MiB within 25%: {}", sites[1].bytes);
}

/// 256 MiB allocated and freed from one function before the budget fills: the
/// profile is of live memory, so that function is not among the sites.
fn memory_freed_leaves_the_sites() {
    churn_site(4096);
    let report = refused_report();
    let sites = sites(&report);
    for s in &sites {
        println!("  {} bytes: {:?}", s.bytes, s.names);
    }
    assert!(named(&sites[0], "big_site") && named(&sites[1], "small_site"), "{report}");
    assert!(!sites.iter().any(|s| named(s, "churn_site")), "freed memory is not live:\n{report}");
}

/// No `MEMQUOTA_*` variable (the runner clears the shell's): the profile samples at its
/// default rate, one per 512 KiB, and a refusal's report names the site. At that rate
/// big_site's 768 blocks of 64 KiB are each sampled with probability 1 - e^(-1/8), about
/// 90 samples: the estimate's spread is about 10%, so 50% is five of it, not luck.
fn the_profile_is_on_by_default() {
    let report = refused_report();
    println!("{report}");
    let sites = sites(&report);
    assert!(!sites.is_empty() && named(&sites[0], "big_site"), "the first site is big_site:\n{report}");
    let bytes = sites[0].bytes;
    assert!((24 * MIB..=72 * MIB).contains(&bytes), "big_site's 48 MiB within 50%: {bytes}\n{report}");
}

/// The refusal's report, its sites read from the profile, is written on the refused
/// thread's stack: 24-28 KiB of it in a small program (a thread with 24 KiB
/// overflows, one with 28 KiB completes). The dump reader's storage is mapped, not
/// on the stack (`profile::dump::Scratch`), and the sites read go straight into the
/// slot `last_report_sites` reads: with both on the stack, a thread needed
/// 56-64 KiB, and this test failed. 48 KiB leaves a program's own frames some room;
/// musl's default thread stack is 128 KiB.
fn a_refusal_on_a_small_stack() {
    let thread = std::thread::Builder::new().stack_size(48 << 10).spawn(refused_report).unwrap();
    let report = thread.join().expect("the refused thread ran to its end");
    let sites = sites(&report);
    assert!(!sites.is_empty() && named(&sites[0], "big_site"), "the first site is big_site:\n{report}");
}

/// 64-byte blocks from one function, held: small blocks, which the Rust face takes on
/// its fast path. Boxed: each its own block.
#[allow(clippy::vec_box)]
#[inline(never)]
fn tiny_site(n: usize) -> Vec<Box<[u8; 64]>> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(black_box(Box::new([6u8; 64])));
    }
    black_box(held)
}

/// A site of small blocks, at the default rate and the least slack (a 16 MiB limit):
/// its stack starts in the function that allocates, not in the allocator
/// (`__rust_alloc`, `QuotaAlloc::alloc`, `Jemalloc::alloc`), whose frames would take
/// the places of the caller's. The first frame's names (addr2line's inlined chain of
/// one return address) end with `tiny_site`.
fn a_small_block_sites_stack_starts_in_its_function() {
    // A small limit: a thread's slack is then its least, 4 KiB (`ledger::threads`).
    let config = Config::from_env().expect("the environment's configuration").limit(16 * MIB);
    memquota::init(config).unwrap();
    memquota::set_report_hook(|_| {});
    // 8 MiB in 64-byte blocks, and the 1 MiB of the vector that holds them.
    let tiny = tiny_site(128 * 1024);
    let mut v: Vec<u8> = Vec::new();
    assert!(v.try_reserve_exact(16 * MIB as usize).is_err(), "16 MiB past 9 MiB held is refused at 16 MiB");
    let report = memquota::last_report().expect("a report");
    drop(tiny);
    println!("{report}");
    let line =
        report.lines().skip_while(|l| !l.trim_start().starts_with("top sites")).nth(1).expect("a first site");
    let frames = line.split_once('%').expect("a share").1;
    let first = frame_names(frames).into_iter().next().expect("a frame");
    assert!(
        first.last().is_some_and(|f| f.contains("tiny_site")),
        "the first site's first frame is in tiny_site, not the allocator: {first:?}\n{report}"
    );
}

/// The profile's set-up learns every entry of the Rust face (`__rust_alloc`,
/// `__rust_alloc_zeroed`, `__rust_realloc`, the face inlined in each) as the
/// allocator's, whatever path its calibration's samples took: a stack that reaches
/// jemalloc from code that calls them (another crate's, std's) would otherwise start
/// with them, the face's frames in the places of the caller's. At the default rate and
/// the least slack (a 16 MiB limit), where a small block takes the slow path (a tail
/// call out of the entry, so no frame of it) once in 16. The entries' addresses come
/// from this program's symbol table (`nm`).
fn the_rust_faces_entry_points_are_learned() {
    memquota::init(Config::from_env().expect("the environment's configuration").limit(16 * MIB)).unwrap();
    let exe = std::env::current_exe().unwrap();
    let nm = Command::new("nm").args(["-C", "--defined-only"]).arg(&exe).output().expect("nm");
    let symbols = String::from_utf8_lossy(&nm.stdout);
    let address = |name: &str| -> Option<usize> {
        symbols.lines().find_map(|l| {
            let mut f = l.splitn(3, ' ');
            let (addr, _, sym) = (f.next()?, f.next()?, f.next()?);
            (sym == name || sym.rsplit("::").next() == Some(name))
                .then(|| usize::from_str_radix(addr, 16).ok())?
        })
    };
    let here = address("sites::the_rust_faces_entry_points_are_learned").expect("this function in nm");
    let base = the_rust_faces_entry_points_are_learned as *const () as usize - here;
    for entry in ["__rust_alloc", "__rust_alloc_zeroed", "__rust_realloc"] {
        let at = address(entry).unwrap_or_else(|| panic!("{entry} in nm"));
        assert!(
            memquota::seam::process::profile_skips_function(base + at),
            "{entry} is learned as the allocator's"
        );
    }
}

/// `MEMQUOTA_PROFILE_SAMPLE=0`: no profile, and the report says nothing of sites.
fn profile_sample_0_turns_the_profile_off() {
    let report = refused_report();
    assert!(!report.contains("top sites"), "{report}");
    assert!(report.contains("native tracked"), "{report}");
}

/// `GET /debug/pprof/heap` while the two sites hold their memory: `go tool pprof`
/// reads the profile, names both functions (from the program's own symbols, found
/// through the mapping's path and build ID), and its estimates are within 25%.
fn the_endpoints_heap_profile_is_read_by_pprof() {
    memquota::init(Config::from_env().expect("the environment's configuration").limit(256 * MIB)).unwrap();
    let addr = memquota::serve_metrics("127.0.0.1:0").expect("an endpoint").to_string();
    let big = big_site(768);
    let small = small_site(2048);
    let (status, body) = pprof::get(&addr, "/debug/pprof/heap");
    drop((big, small));
    assert_eq!(status, "HTTP/1.0 200 OK", "{}", String::from_utf8_lossy(&body));
    let file = std::env::temp_dir().join(format!("memquota-sites-{}.pb.gz", std::process::id()));
    std::fs::write(&file, &body).unwrap();
    let (rows, text) = pprof::top(&file, "inuse_space");
    let _ = std::fs::remove_file(&file);
    println!("{text}");
    let big = pprof::cum(&rows, "big_site").unwrap_or_else(|| panic!("pprof names big_site:\n{text}"));
    let small = pprof::cum(&rows, "small_site").unwrap_or_else(|| panic!("pprof names small_site:\n{text}"));
    assert!(within(big, 48 * MIB), "big_site's 48 MiB within 25%: {big}\n{text}");
    assert!(within(small, 8 * MIB), "small_site's 8 MiB within 25%: {small}\n{text}");
}

/// With the profile off the endpoint answers 503 and names the variable that turns
/// it on.
fn the_endpoint_says_how_to_turn_the_profile_on() {
    memquota::init(Config::from_env().expect("the environment's configuration").limit(256 * MIB)).unwrap();
    let addr = memquota::serve_metrics("127.0.0.1:0").expect("an endpoint").to_string();
    let (status, body) = pprof::get(&addr, "/debug/pprof/heap");
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, "HTTP/1.0 503 Service Unavailable", "{body}");
    assert!(body.contains("MEMQUOTA_PROFILE_SAMPLE"), "{body}");
}

/// The flight recorder (`Config::profile_dir`, `MEMQUOTA_PROFILE_DIR`): the first
/// refusal writes one directory, complete when the refusal returns (the refusing
/// thread waits for it, bounded), with the profile pprof reads, the stats, the scopes,
/// the container's figures and the report; a second refusal in the report window
/// writes none; the first one after the window closes writes the next.
fn a_refusal_leaves_a_flight_record() {
    let dir = std::env::temp_dir().join(format!("memquota-flight-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = Config::from_env().expect("the environment's configuration").limit(64 * MIB);
    let config = config.profile_dir(dir.to_str().unwrap()).report_window(Duration::from_secs(60));
    memquota::init(config.clone()).unwrap();
    memquota::set_report_hook(|_| {});
    let big = big_site(768);
    let small = small_site(2048);
    let records = || {
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let mut v: Vec<u8> = Vec::new();
    assert!(v.try_reserve_exact(32 * MIB as usize).is_err());
    assert_eq!(records(), vec![format!("memquota-{}-1", std::process::id())], "one record, complete");
    assert!(v.try_reserve_exact(32 * MIB as usize).is_err());
    assert_eq!(records().len(), 1, "a refusal inside the report window writes no record");
    let record = dir.join(&records()[0]);
    let mut files: Vec<String> = std::fs::read_dir(&record)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["container.json", "heap.pb.gz", "report.txt", "scopes.json", "stats.json"]);
    let read = |f: &str| std::fs::read_to_string(record.join(f)).unwrap();
    assert!(
        read("report.txt").starts_with("memquota: allocation refused: 32.0 MiB"),
        "{}",
        read("report.txt")
    );
    assert!(read("stats.json").contains("\"oom_total\":1,"), "{}", read("stats.json"));
    assert!(read("scopes.json").starts_with("{\"pool_bytes\":"), "{}", read("scopes.json"));
    assert!(read("container.json").starts_with("{\"cgroup_version\":"), "{}", read("container.json"));
    let (rows, top) = pprof::top(&record.join("heap.pb.gz"), "inuse_space");
    assert!(pprof::cum(&rows, "big_site").is_some_and(|b| within(b, 48 * MIB)), "{top}");
    assert!(pprof::cum(&rows, "small_site").is_some_and(|b| within(b, 8 * MIB)), "{top}");
    // The window closes (a window changed applies at once, from when it opened).
    memquota::init(config.report_window(Duration::from_millis(1))).unwrap();
    std::thread::sleep(Duration::from_millis(2));
    assert!(v.try_reserve_exact(32 * MIB as usize).is_err());
    assert_eq!(records().len(), 2, "the first report of the next window writes the next record");
    drop((big, small));
    let _ = std::fs::remove_dir_all(&dir);
}

/// 64 KiB blocks from the first scope's function.
#[inline(never)]
fn reader_site(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|_| black_box(vec![4u8; 64 * KIB as usize])).collect()
}

/// 64 KiB blocks from the second scope's function.
#[inline(never)]
fn writer_site(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|_| black_box(vec![5u8; 64 * KIB as usize])).collect()
}

/// A scope's part of a report's tree: the sites under its line, each with its
/// unreserved estimate.
struct ScopeSite {
    bytes: u64,
    unreserved: u64,
    names: Vec<String>,
}

/// The sites the report's tree lists under scope `name`.
fn scope_sites(report: &str, name: &str) -> Vec<ScopeSite> {
    let head = format!("scope \"{name}\"");
    let mut lines = report.lines().skip_while(|l| !l.trim_start().starts_with(&head));
    assert!(lines.next().is_some(), "scope {name} in the tree:\n{report}");
    let mut out = Vec::new();
    for line in lines.take_while(|l| l.starts_with("      ")) {
        // "        24.0 MiB (25165824) (24.0 MiB unreserved) /obj+0x11cd <- +0x1084"
        let Some((head, frames)) = line.split_once(" unreserved) ") else { continue };
        let bytes = head.split(['(', ')']).nth(1).and_then(|b| b.parse().ok()).expect("bytes in parentheses");
        let unreserved = head.rsplit_once('(').map(|(_, u)| u).and_then(parse_size).expect("unreserved");
        out.push(ScopeSite { bytes, unreserved, names: names(frames) });
    }
    out
}

/// "24.0 MiB" as bytes (to a tenth of the unit).
fn parse_size(s: &str) -> Option<u64> {
    let (n, unit) = s.trim().split_once(' ')?;
    let shift = match unit {
        "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => return None,
    };
    Some((n.parse::<f64>().ok()? * (1u64 << shift) as f64) as u64)
}

/// Each frame (`OBJECT+ADDR`, or `+ADDR` in the object of the frame before) named by
/// `addr2line -f -i`.
fn names(frames: &str) -> Vec<String> {
    frame_names(frames).into_iter().flatten().collect()
}

/// Each frame's names, innermost first: the functions inlined at its address, then
/// the one it is in.
fn frame_names(frames: &str) -> Vec<Vec<String>> {
    let mut object = String::new();
    let mut names = Vec::new();
    for frame in frames.split("<-").map(str::trim) {
        let (obj, addr) = frame.rsplit_once('+').expect("OBJECT+ADDR");
        if !obj.is_empty() {
            object = obj.to_string();
        }
        let out = Command::new("addr2line")
            .args(["-f", "-i", "-C", "-e", &object, addr])
            .output()
            .expect("addr2line");
        names.push(String::from_utf8_lossy(&out.stdout).lines().step_by(2).map(str::to_string).collect());
    }
    names
}

/// Two scopes, each allocating from a function of its own: the report's scope tree
/// names each scope's site under it, and not the other's. The first allocates with
/// no reservation (24 MiB unreserved); the second inside the 16 MiB it reserved
/// (none unreserved).
fn each_scope_names_its_own_sites() {
    let config = Config::from_env().expect("the environment's configuration").limit(64 * MIB);
    memquota::init(config).unwrap();
    memquota::set_report_hook(|_| {});
    let mm = MemoryManager::global();
    let reader = mm.begin("reader", 1, 0).unwrap();
    let writer = mm.begin("writer", 2, 0).unwrap();
    let read = {
        let _in = reader.attach().unwrap();
        reader_site(384)
    };
    let reservation = writer.reserve(16 * MIB).unwrap();
    let written = {
        let _in = writer.attach().unwrap();
        writer_site(192)
    };
    let mut v: Vec<u8> = Vec::new();
    assert!(v.try_reserve_exact(32 * MIB as usize).is_err(), "32 MiB past 40 MiB held is refused at 64 MiB");
    let report = memquota::last_report().expect("a report");
    println!("{report}");
    let (r, w) = (scope_sites(&report, "reader"), scope_sites(&report, "writer"));
    for s in r.iter().chain(&w) {
        println!("  {} bytes, {} unreserved: {:?}", s.bytes, s.unreserved, s.names);
    }
    let has = |sites: &[ScopeSite], f: &str| sites.iter().any(|s| s.names.iter().any(|n| n.contains(f)));
    assert!(named_site(&r, "reader_site").is_some(), "the reader's tree names reader_site:\n{report}");
    assert!(!has(&r, "writer_site"), "and not the writer's site:\n{report}");
    assert!(named_site(&w, "writer_site").is_some(), "the writer's tree names writer_site:\n{report}");
    assert!(!has(&w, "reader_site"), "and not the reader's site:\n{report}");
    let rs = named_site(&r, "reader_site").unwrap();
    assert!(within(rs.bytes, 24 * MIB), "reader_site's 24 MiB within 25%: {}", rs.bytes);
    assert!(within(rs.unreserved, 24 * MIB), "all of it unreserved: {}", rs.unreserved);
    let ws = named_site(&w, "writer_site").unwrap();
    assert!(within(ws.bytes, 12 * MIB), "writer_site's 12 MiB within 25%: {}", ws.bytes);
    assert_eq!(ws.unreserved, 0, "inside its reservation:\n{report}");
    drop((read, written, reservation));
}

fn named_site<'a>(sites: &'a [ScopeSite], function: &str) -> Option<&'a ScopeSite> {
    sites.iter().find(|s| s.names.iter().any(|n| n.contains(function)))
}
