//! A seed's process: the budget, the callbacks, the watchdog, then its plans one
//! after the other (or, minimising, one plan again and again with parts dropped).

use crate::*;

fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().is::<PlannedPanic>() {
            return;
        }
        memquota::set_limit(1 << 50);
        let mut l = Line::new();
        let _ = writeln!(l, "\nFAILED: a panic");
        rerun_line(&mut l);
        l.emit();
        default(info)
    }));
}

/// A seed's process: its plans one after the other, each checked once it ends.
pub fn run(seed: u64) -> ! {
    let known = Known::from_env();
    SEED.store(seed, SeqCst);
    let names: Vec<&str> = known.names().collect();
    let _ = KNOWN_ENV.set(if names.is_empty() {
        String::new()
    } else {
        format!("{KNOWN_VAR}={} ", names.join(","))
    });
    epoch();
    install_panic_hook();
    let session = Session::new(seed);
    memquota::init(session.config()).expect("configure");
    memquota::set_report_hook(hook);
    memquota::on_reclaim(reclaim);
    RECLAIM_CACHE.lock().unwrap().reserve_exact(16);
    support::watchdog(status);
    support::wait_for_sampler();
    // The panic machinery's first use allocates for good: not inside a plan.
    let _ = std::panic::catch_unwind(|| std::panic::panic_any(PlannedPanic));
    println!("session {session:?}");
    let mut failures: Vec<String> = Vec::new();
    let mut totals = Summary::default();
    let mut peak_allow = 0;
    // For minimising a failure: one plan only, run again and again, with parts of it
    // dropped.
    let only: Option<usize> = std::env::var(PLAN_VAR).ok().and_then(|s| s.parse().ok());
    let repeat: usize = std::env::var(REPEAT_VAR).ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let drop = std::env::var(DROP_VAR).unwrap_or_default();
    for index in (0..PLANS_PER_SEED).filter(|i| only.map_or(true, |k| k == *i)) {
        let mut plan = Plan::generate(&session, index, known);
        plan.drop_parts(&drop);
        println!("plan {index}: {plan:?}");
        if let Ok(mut t) = PLAN_TEXT.lock() {
            t.len = 0;
            let _ = write!(t, "{plan:?}");
        }
        PLAN_NO.store(index, SeqCst);
        for _ in 0..repeat {
            support::arm("a fuzz plan", PLAN_BUDGET);
            let r = run_plan(&session, &plan, known);
            support::disarm();
            peak_allow = peak_allow.max(r.allowance);
            failures.extend(r.check(&session, &plan, known, peak_allow, &mut totals));
        }
    }
    memquota::set_limit(1 << 50);
    println!("{} {totals}", Summary::PREFIX);
    if failures.is_empty() {
        std::process::exit(0);
    }
    println!("\nfailures (seed {seed}):");
    for f in &failures {
        println!("  {f}");
    }
    std::process::exit(1)
}
