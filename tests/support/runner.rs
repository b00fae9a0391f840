//! The one runner of the harness-less test binaries: each check in this process or in
//! a child process of its own, one line each, then the closing line cargo's summary
//! readers know (`test result: ok. N passed; M failed`).

use super::{arm, disarm, watchdog, HUNG};
use std::any::Any;
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

/// A check, and the environment its process starts with (jemalloc reads its options
/// when it starts: they cannot be set from inside).
pub type Check = (&'static str, fn(), &'static [(&'static str, &'static str)]);

const CHILD_VAR: &str = "MEMQUOTA_TEST_CHILD";

/// Runs the named checks in order in this process. A check fails by panicking.
pub fn run(checks: &[(&'static str, fn())]) {
    run_all(&with_no_env(checks), None);
}

/// Runs each check in a child process of this binary: a fresh allocator state per
/// check, and a hang or an abort fails that check alone. Each child has a watchdog
/// armed at `budget`; the parent kills it at twice that.
pub fn run_isolated(checks: &[(&'static str, fn())], budget: Duration) {
    run_all(&with_no_env(checks), Some(budget));
}

/// [`run_isolated`], each check's process started with its own variables. A check
/// with variables of its own starts without jemalloc's option variables
/// (`MALLOC_CONF`, `_RJEM_MALLOC_CONF`) unless it sets them.
pub fn run_isolated_with_env(checks: &[Check], budget: Duration) {
    run_all(checks, Some(budget));
}

fn with_no_env(checks: &[(&'static str, fn())]) -> Vec<Check> {
    checks.iter().map(|&(name, check)| (name, check, &[][..])).collect()
}

/// The runner: arguments that do not start with `-` select checks by substring; each
/// check prints one line, then [`summary`]. Exits non-zero if any check failed.
fn run_all(checks: &[Check], isolated: Option<Duration>) {
    if let (Some(budget), Ok(name)) = (isolated, std::env::var(CHILD_VAR)) {
        let &(name, check, _) = checks.iter().find(|c| c.0 == name).expect("a known check");
        child(name, check, budget);
    }
    if isolated.is_none() {
        lift_limit_on_panic(planted_in_a_callback);
    }
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut failed = Vec::new();
    let mut ran = 0;
    for &(name, check, env) in checks {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        ran += 1;
        let started = Instant::now();
        let (ok, detail) = match isolated {
            None => (std::panic::catch_unwind(check).is_ok(), String::new()),
            Some(budget) => in_a_child(name, env, budget),
        };
        println!(
            "test {name} ... {} ({} ms{detail})",
            if ok { "ok" } else { "FAILED" },
            started.elapsed().as_millis()
        );
        if !ok {
            failed.push(name);
        }
    }
    summary(ran, &failed);
}

/// Prints cargo's closing line for `ran` checks of which `failed` failed (named when
/// any did), and exits with 101 if any did.
pub fn summary(ran: usize, failed: &[&str]) {
    println!(
        "\ntest result: {}. {} passed; {} failed{}",
        if failed.is_empty() { "ok" } else { "FAILED" },
        ran - failed.len(),
        failed.len(),
        if failed.is_empty() { String::new() } else { format!(": {}", failed.join(", ")) }
    );
    if !failed.is_empty() {
        std::process::exit(101);
    }
}

/// A failing check prints a message and maybe a backtrace, which allocates; under a
/// tight test budget that could be refused mid-print. The hook lifts the limit first,
/// except for a panic the test plants on purpose (`planned` says which): that one is
/// caught by memquota, and the limit must stay for what the check asserts.
pub fn lift_limit_on_panic(planned: fn(&(dyn Any + Send)) -> bool) {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if planned(info.payload()) {
            return;
        }
        memquota::set_limit(1 << 50);
        report(info)
    }));
}

/// A panic a check plants in a callback: its message says "on purpose".
fn planted_in_a_callback(payload: &(dyn Any + Send)) -> bool {
    payload.downcast_ref::<&str>().is_some_and(|m| m.contains("on purpose"))
}

/// Runs `name` in a child process of this binary, prints its output, and says whether
/// it passed and, if not, how it ended.
fn in_a_child(name: &str, env: &[(&str, &str)], budget: Duration) -> (bool, String) {
    let mut cmd = Command::new(std::env::current_exe().expect("own path"));
    cmd.env(CHILD_VAR, name);
    if !env.is_empty() {
        cmd.env_remove("MALLOC_CONF").env_remove("_RJEM_MALLOC_CONF").envs(env.iter().copied());
    }
    let (out, killed) = output_within(&mut cmd, budget * 2);
    print_indented("stdout", &out.stdout);
    print_indented("stderr", &out.stderr);
    let ok = out.status.success() && !killed;
    let detail = if killed {
        format!(", killed after {} s", (budget * 2).as_secs())
    } else if ok {
        String::new()
    } else {
        format!(", {}", describe(out.status))
    };
    (ok, detail)
}

/// Runs `cmd` without memquota's variables from the shell (those set on `cmd` stay),
/// its output captured, and kills it if it still runs after `bound`. Its output, and
/// whether it was killed.
pub fn output_within(cmd: &mut Command, bound: Duration) -> (Output, bool) {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // The shell's, not those the caller set on `cmd` (a check's own variables).
    let set: Vec<std::ffi::OsString> =
        cmd.get_envs().filter(|(_, v)| v.is_some()).map(|(k, _)| k.to_owned()).collect();
    for (var, _) in memquota::seam::process::ENV_VARS {
        if !set.iter().any(|k| k == var) {
            cmd.env_remove(var);
        }
    }
    let child = cmd.spawn().expect("spawn a child process");
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let (out, killed) = match rx.recv_timeout(bound) {
        Ok(out) => (out, false),
        Err(_) => {
            // SAFETY: kill has no memory preconditions; `pid` is our unreaped child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            (rx.recv().expect("the waiter reports"), true)
        }
    };
    (out.expect("wait for the child process"), killed)
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(HUNG), _) => format!("exit {HUNG}: the watchdog fired"),
        (Some(c), _) => format!("exit {c}"),
        (_, Some(s)) => format!("killed by signal {s}"),
        _ => format!("{status:?}"),
    }
}

/// Prints a child's output, indented; a flood is cut to its head and tail.
pub fn print_indented(what: &str, bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    const KEEP: usize = 6000;
    let text = String::from_utf8_lossy(bytes);
    let shown = if text.len() > 2 * KEEP {
        let mut head = KEEP;
        while !text.is_char_boundary(head) {
            head -= 1;
        }
        let mut tail = text.len() - KEEP;
        while !text.is_char_boundary(tail) {
            tail += 1;
        }
        format!("{}\n[... {} bytes cut ...]\n{}", &text[..head], tail - head, &text[tail..])
    } else {
        text.into_owned()
    };
    println!("  [{what}, {} bytes]", bytes.len());
    for l in shown.lines() {
        println!("  | {l}");
    }
}

/// A check's own process: the panic hook of an in-process run, a watchdog armed at
/// `budget`, exit status 0 if the check returned.
fn child(name: &'static str, check: fn(), budget: Duration) -> ! {
    lift_limit_on_panic(planted_in_a_callback);
    watchdog(|_| {});
    arm(name, budget);
    let ok = std::panic::catch_unwind(check).is_ok();
    disarm();
    std::process::exit(if ok { 0 } else { 101 })
}
