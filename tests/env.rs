//! Invariant 8: configuration errors are loud. `QuotaAlloc` reads `MEMQUOTA_*` on
//! first use; a bad value prints one line naming the variable, the value and the
//! accepted forms, and exits with status 2. The checks run this binary again as a
//! child with the environment under test.

mod support;

use memquota::QuotaAlloc;
use std::process::{Command, Output};
use support::run;

#[global_allocator]
static GLOBAL: QuotaAlloc = QuotaAlloc::new();

const CHILD: &str = "MEMQUOTA_TEST_CHILD";

fn main() {
    if let Ok(what) = std::env::var(CHILD) {
        child(&what);
        return;
    }
    run(&[
        ("bad_values_exit_2_naming_variable_value_and_forms", bad_values_exit_2),
        ("good_values_configure_the_allocator", good_values_configure),
        ("abort_policy_aborts_with_a_report", abort_policy_aborts_with_a_report),
    ]);
}

/// What the child does once the allocator has configured itself from the env.
fn child(what: &str) {
    let v: Vec<u8> = Vec::with_capacity(1 << 20); // reaches the slow path for sure
    drop(v);
    match what {
        "stats" => {
            let s = memquota::stats();
            println!("limit={} soft={} heap={:?}", s.limit, s.soft_limit, s.heap_mode);
        }
        "oom" => {
            let v: Vec<u8> = std::hint::black_box(Vec::with_capacity(64 << 20));
            println!("granted {}", v.capacity());
        }
        _ => unreachable!("{what}"),
    }
}

fn spawn(what: &str, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    for (var, _) in memquota::seam::process::ENV_VARS {
        cmd.env_remove(var);
    }
    cmd.env(CHILD, what).envs(env.iter().copied());
    cmd.output().unwrap()
}

fn bad_values_exit_2() {
    for (var, value) in [
        ("MEMQUOTA_LIMIT", "lots"),
        ("MEMQUOTA_LIMIT", "0"),
        ("MEMQUOTA_LIMIT", "150%"),
        ("MEMQUOTA_SOFT_RATIO", "2"),
        ("MEMQUOTA_ON_OOM", "explode"),
        ("MEMQUOTA_HEAP", "max"),
        ("MEMQUOTA_RECLAIM_WAIT", "forever"),
        ("MEMQUOTA_PURGE_INTERVAL", "10ms"),
        ("MEMQUOTA_PROFILE_SAMPLE", "often"),
    ] {
        let out = spawn("stats", &[(var, value)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {err}");
        assert!(out.stdout.is_empty(), "{var}={value}: the program ran unlimited");
        let forms = memquota::seam::process::ENV_VARS.iter().find(|(v, _)| *v == var).unwrap().1;
        assert!(err.contains(var) && err.contains(value) && err.contains(forms), "{var}={value}: {err}");
        assert_eq!(err.lines().count(), 1, "one clear line: {err}");
    }
}

fn good_values_configure() {
    let out = spawn(
        "stats",
        &[("MEMQUOTA_LIMIT", "512m"), ("MEMQUOTA_SOFT_RATIO", "0.5"), ("MEMQUOTA_HEAP", "used")],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.trim(), format!("limit={} soft={} heap=Used", 512u64 << 20, 256u64 << 20));
    // No MEMQUOTA_LIMIT: the machine's limit, never "unlimited".
    let out = spawn("stats", &[]);
    let expected = format!("limit={} ", memquota::seam::process::memory_limit());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(&expected));
}

fn abort_policy_aborts_with_a_report() {
    let out = spawn("oom", &[("MEMQUOTA_LIMIT", "16m"), ("MEMQUOTA_ON_OOM", "abort")]);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{:?}", out.status);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("allocation refused: 64.0 MiB (67108864) requested"), "{err}");
    assert!(err.contains("policy           abort"), "{err}");
    assert!(out.stdout.is_empty());
    let out = spawn("oom", &[("MEMQUOTA_LIMIT", "16m")]);
    // The null policy: `Vec::with_capacity` is infallible, so Rust's OOM handler aborts
    // after our report.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("policy           null") && err.contains("memory allocation of 67108864 bytes failed"),
        "{err}"
    );
}
