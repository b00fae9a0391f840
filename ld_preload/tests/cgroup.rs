//! The container's view (issue 13, item 2): a C program with a cache it can drop, 96
//! MiB of memory it cannot and 24 MiB it maps itself runs in a memory cgroup of its
//! own. The test lowers the cgroup's limit from 1 GiB to 192 MiB once the program has
//! started, then the program asks for 96 MiB more.
//!
//! * Without memquota the kernel's OOM killer kills it (SIGKILL, the cgroup's
//!   `oom_kill` count goes up).
//! * Under the preload, with no `MEMQUOTA_LIMIT`, its budget follows the cgroup's
//!   limit down; the cgroup's anonymous memory, past its line while the budget's own
//!   figures are not (the mapped memory is only reported), asks for a background
//!   reclaim; the big request is refused after a synchronous reclaim, with a report,
//!   and the kernel kills nothing.
//!
//! Needs root and a memory cgroup controller (v2 where it is mounted with it, else
//! v1), `cargo build --release` first, and gcc. Where a cgroup cannot be made the
//! test fails, loudly: it is part of CI, and a skip would hide that it never ran.

mod common;

use common::{build_dir, compile, inherited_vars, lib, said, text};
use std::ffi::CString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The cgroup's limit at the start, and the one the test lowers it to.
const FIRST_LIMIT: u64 = 1 << 30;
const LIMIT: u64 = 192 * MIB;
/// The program's arguments: pinned, cache, mapped, then the big request, in MiB.
/// Pinned + cache (152 MiB) stay under the budget's soft threshold (163.2 MiB);
/// with the mapping the cgroup's anon (about 180 MiB) passes its line (the same
/// 163.2 MiB) but not the limit. Pinned + big (208 MiB) cannot fit.
const ARGS: [&str; 4] = ["112", "40", "24", "96"];

fn program() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| {
        let exe = build_dir("cgroup").join("cgroup");
        compile("gcc", &["-O1", "-g", "-Wall", "cgroup.c", "-ldl", "-lpthread"], &exe);
        exe
    })
}

/// A memory cgroup made for one run, removed (its processes killed first) when
/// dropped, on failure too.
struct TestCgroup {
    dir: PathBuf,
    v2: bool,
}

/// `mountinfo`'s mount point of the first mount of `fstype` whose super options
/// satisfy `opts`.
fn mount_point(fstype: &str, opts: impl Fn(&str) -> bool) -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts.lines().find_map(|line| {
        let f: Vec<&str> = line.split(' ').collect();
        let dash = f.iter().position(|x| *x == "-")?;
        (f.get(dash + 1) == Some(&fstype) && opts(f.get(dash + 3).unwrap_or(&"")))
            .then(|| PathBuf::from(f[4]))
    })
}

/// This process's path in the hierarchy whose `/proc/self/cgroup` line matches.
fn own_path(matches: impl Fn(&str) -> bool) -> Option<String> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    membership.lines().find_map(|l| {
        let mut p = l.splitn(3, ':');
        let (_, controllers, path) = (p.next()?, p.next()?, p.next()?);
        matches(controllers).then(|| path.trim_start_matches('/').to_owned())
    })
}

fn write(path: &Path, value: &str) {
    std::fs::write(path, value).unwrap_or_else(|e| panic!("writing {value:?} to {}: {e}", path.display()));
}

impl TestCgroup {
    /// Under this process's own memory cgroup: v2 where the cgroup2 mount offers the
    /// memory controller, else v1.
    fn create(name: &str, limit: u64) -> TestCgroup {
        let v2_root = mount_point("cgroup2", |_| true).filter(|m| {
            std::fs::read_to_string(m.join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"))
        });
        let (parent, v2) = match v2_root {
            Some(root) => {
                let parent = root.join(own_path(str::is_empty).unwrap_or_default());
                // The parent hands the controller down (a non-root cgroup with
                // processes of its own refuses: the mkdir or limit below then fails).
                let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory");
                (parent, true)
            }
            None => {
                let root =
                    mount_point("cgroup", |o| o.split(',').any(|o| o == "memory")).unwrap_or_else(|| {
                        panic!(
                            "no memory cgroup controller is mounted (v2 or v1): this test needs one, as root"
                        )
                    });
                (root.join(own_path(|c| c.split(',').any(|c| c == "memory")).unwrap_or_default()), false)
            }
        };
        let dir = parent.join(format!("memquota-test-{name}-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir(&dir) {
            panic!(
                "cannot make a memory cgroup at {}: {e} (the test needs root and a writable cgroup)",
                dir.display()
            );
        }
        let cg = TestCgroup { dir, v2 };
        if v2 {
            write(&cg.dir.join("memory.swap.max"), "0");
        }
        cg.set_limit(limit);
        cg
    }

    /// Sets the limit on memory and on memory + swap (so that nothing swaps: the
    /// kernel kills at the limit, as on these machines, which have no swap).
    fn set_limit(&self, bytes: u64) {
        if self.v2 {
            return write(&self.dir.join("memory.max"), &bytes.to_string());
        }
        let memsw = self.dir.join("memory.memsw.limit_in_bytes");
        let mem = self.dir.join("memory.limit_in_bytes");
        // memory + swap may never be under memory alone: raise it first, lower it last.
        let old: u64 = std::fs::read_to_string(&mem).unwrap().trim().parse().unwrap();
        if memsw.exists() && bytes > old {
            write(&memsw, &bytes.to_string());
        }
        write(&mem, &bytes.to_string());
        if memsw.exists() && bytes <= old {
            write(&memsw, &bytes.to_string());
        }
    }

    /// Processes the kernel's OOM killer killed in this cgroup.
    fn oom_kills(&self) -> u64 {
        let file = if self.v2 { "memory.events" } else { "memory.oom_control" };
        let text = std::fs::read_to_string(self.dir.join(file)).unwrap();
        let line = text.lines().find(|l| l.starts_with("oom_kill ")).expect("an oom_kill line");
        line["oom_kill ".len()..].trim().parse().unwrap()
    }

    fn procs(&self) -> Vec<i32> {
        let text = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        text.lines().filter_map(|l| l.trim().parse().ok()).collect()
    }

    /// Runs `cmd` inside the cgroup: the child moves itself in before it execs.
    fn spawn(&self, cmd: &mut Command) -> std::process::Child {
        let procs =
            CString::new(self.dir.join("cgroup.procs").into_os_string().into_encoded_bytes()).unwrap();
        // SAFETY: the closure runs in the forked child before exec, and only makes
        // async-signal-safe calls (open, write, close) on a path built before the fork;
        // it allocates nothing. Writing "0" moves the writing process.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
                Ok(())
            })
        };
        cmd.spawn().expect("spawning into the cgroup")
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Whatever is left (a failed run) is killed; the directory goes once empty.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let procs = self.procs();
            for pid in &procs {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
            if std::fs::remove_dir(&self.dir).is_ok() || Instant::now() > deadline {
                break;
            }
            // Killed processes leave the cgroup when they are reaped: a bounded wait
            // for cleanup, not a synchronisation of the test.
            std::thread::sleep(Duration::from_millis(10));
        }
        if self.dir.exists() && !std::thread::panicking() {
            panic!("could not remove {}", self.dir.display());
        }
    }
}

/// What one run left.
struct Run {
    out: Output,
    /// The budget's limit the program saw before the cgroup's changed.
    ready_limit: u64,
    oom_kills: u64,
}

/// Runs the program in a fresh cgroup, `preload` or not: starts it at the first
/// limit, lowers the limit once it is ready, tells it the new one.
fn run(name: &str, preload: bool) -> Run {
    // One at a time: the plain run's OOM kill stalls tasks for memory, which the
    // system's PSI (the other run's trigger) may report.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let cg = TestCgroup::create(name, FIRST_LIMIT);
    let mut cmd = Command::new("timeout");
    cmd.arg("60");
    if preload {
        cmd.arg("env").arg(format!("LD_PRELOAD={}", lib().display()));
    }
    for var in inherited_vars() {
        cmd.env_remove(var);
    }
    cmd.arg(program()).args(ARGS).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cg.spawn(&mut cmd);
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    let ready_limit = first
        .strip_prefix("ready limit=")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("the program did not start: {first:?}"));
    cg.set_limit(LIMIT);
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{LIMIT}").unwrap();
    drop(stdin);
    let mut rest = first;
    stdout.read_to_string(&mut rest).unwrap();
    let mut stderr = Vec::new();
    child.stderr.take().unwrap().read_to_end(&mut stderr).unwrap();
    let status = child.wait().unwrap();
    let out = Output { status, stdout: rest.into_bytes(), stderr };
    let oom_kills = cg.oom_kills();
    Run { out, ready_limit, oom_kills }
}

/// A number in the program's `stats {...}` JSON line.
fn stat(out: &Output, key: &str) -> u64 {
    let stdout = text(&out.stdout);
    let json = stdout
        .lines()
        .find_map(|l| l.strip_prefix("stats "))
        .unwrap_or_else(|| panic!("no stats: {}", said(out)));
    let at = json.find(&format!("\"{key}\":")).unwrap_or_else(|| panic!("no {key} in {json}"));
    let digits: String = json[at + key.len() + 3..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().unwrap()
}

#[test]
fn without_memquota_the_kernel_kills_it() {
    let run = run("plain", false);
    assert_eq!(run.out.status.signal(), Some(libc::SIGKILL), "{}", said(&run.out));
    assert!(run.oom_kills >= 1, "the cgroup's OOM killer acted: {}", said(&run.out));
    assert!(!text(&run.out.stdout).contains("big="), "{}", said(&run.out));
}

#[test]
fn under_the_preload_it_gets_reclaims_and_a_refusal_instead() {
    let run = run("preload", true);
    let out = &run.out;
    assert!(out.status.success(), "not killed, no error: {}", said(out));
    assert_eq!(run.oom_kills, 0, "the kernel killed nothing: {}", said(out));
    // The budget followed the cgroup's limit at start and when it changed.
    assert_eq!(run.ready_limit, FIRST_LIMIT, "{}", said(out));
    assert_eq!(stat(out, "limit_bytes"), LIMIT, "{}", said(out));
    assert_eq!(stat(out, "cgroup_limit_bytes"), LIMIT);
    assert!(stat(out, "cgroup_limit_changes_total") >= 1);
    // Only the container's view could ask for the background reclaim: the budget's
    // own figures stayed under its soft threshold (the mapping is only reported).
    let soft = stat(out, "soft_limit_bytes");
    assert!(stat(out, "native_peak_bytes") < soft, "{}", said(out));
    assert!(stat(out, "reclaims_total_background") >= 1, "{}", said(out));
    // The cgroup's anon past its line asks, unless a PSI event asked first: the
    // system's PSI, all a v1 process has, reports other processes stalling for
    // memory too (the first reclaim then leaves the anon under its line).
    let (anon, pressure) =
        (stat(out, "container_requests_total_anon"), stat(out, "container_requests_total_pressure"));
    if pressure == 0 {
        assert!(anon >= 1, "{}", said(out));
        assert!(stat(out, "cgroup_anon_peak_bytes") > soft, "{}", said(out));
    }
    // The big request was refused after a synchronous reclaim, with a report.
    let stdout = text(&out.stdout);
    assert!(stdout.contains("big=refused"), "{}", said(out));
    assert!(stat(out, "reclaims_total_sync") >= 1 && stat(out, "oom_total") == 1, "{}", said(out));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("memquota: allocation refused: 96.0 MiB"), "{stderr}");
    assert!(stderr.contains("the limit follows it"), "the report shows the cgroup: {stderr}");
    // Memory pressure is watched wherever the kernel offers PSI.
    if Path::new("/proc/pressure/memory").exists() {
        let watched = stat(out, "pressure_watch_system") + stat(out, "pressure_watch_cgroup");
        assert_eq!(watched, 1, "a PSI trigger is armed: {}", said(out));
    }
}
