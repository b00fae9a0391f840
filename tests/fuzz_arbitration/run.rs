//! One plan: set up, run, bring to quiescence, check.

use crate::*;
/// What the manager still has once every scope ended and every block was freed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Left {
    /// Live scopes.
    pub scopes: usize,
    /// Scopes begun, ever, less those ended.
    pub not_ended: u64,
    /// Big blocks with an owner record.
    pub owner_records: u64,
}

pub struct PlanResult {
    pub outs: Vec<Result<WorkerOut, String>>,
    pub kill: Option<KillOut>,
    pub samples: support::Samples,
    pub before: memquota::Stats,
    pub after: memquota::Stats,
    pub spills_before: u64,
    pub expected_native: i64,
    pub elapsed: Duration,
    pub retry_idle: bool,
    pub retry_left: memquota::RetryStats,
    pub attached_after_join: Vec<u32>,
    pub left: Left,
    pub callback_refused: u64,
    pub spill_reserve_wrong: u64,
    pub callback_forks: u64,
    pub callback_fork_failed: i64,
    /// What the bound allows past the limit for this plan.
    pub allowance: u64,
}

pub fn run_plan(s: &Session, plan: &Plan, known: Known) -> PlanResult {
    let mm = MemoryManager::global();
    if s.short_waits {
        mm.set_wait(Duration::from_millis(200));
        mm.set_retry_wait(Duration::from_secs(2));
    } else {
        mm.set_wait(Duration::from_secs(2));
        mm.set_retry_wait(Duration::from_secs(10));
    }
    // The reclaim cache, as far as the budget lets it.
    if plan.reclaim {
        let mut cache = RECLAIM_CACHE.lock().unwrap();
        while cache.len() < cache.capacity() && (cache.len() as u64) < s.limit / 8 / MIB {
            match buffer(MIB) {
                Ok(b) => cache.push(b),
                Err(_) => break,
            }
        }
    }
    if plan.probe_lock {
        memquota::set_heap_probe(HeapProbe::Function(Box::new(probe)));
    }
    let outside = if plan.outside_kib > 0 { buffer(u64::from(plan.outside_kib) * KIB).ok() } else { None };

    let tasks: Vec<TaskCtx> = plan
        .tasks
        .iter()
        .enumerate()
        .map(|(i, tp)| {
            let id = (plan.index * 16 + i) as u64;
            let scope = mm.begin("fuzz", id, tp.priority).expect("a scope");
            if let Some(cap) = tp.cap_kib {
                scope.set_cap(Some(u64::from(cap) * KIB));
            }
            let handle = scope.handle();
            let caches: Vec<Arc<Cache>> =
                (0..tp.consumers).map(|_| Arc::new(Mutex::new(Vec::with_capacity(CACHE_CAP)))).collect();
            let consumers = caches
                .iter()
                .map(|c| {
                    let (cache, how) = (Arc::clone(c), tp.spill);
                    scope
                        .consumer("cache", move |target| spill(&cache, how, handle, target))
                        .expect("a consumer")
                })
                .collect();
            TaskCtx {
                scope,
                handle,
                ended: AtomicBool::new(false),
                consumers,
                caches,
                mailbox: Mutex::new(Vec::with_capacity(MAILBOX_CAP)),
                shared: Mutex::new((0, 0)),
            }
        })
        .collect();
    let workers: Vec<(usize, usize)> = plan
        .tasks
        .iter()
        .enumerate()
        .flat_map(|(t, tp)| (0..tp.threads.len()).map(move |k| (t, k)))
        .collect();
    N_WORKERS.store(workers.len(), SeqCst);
    for w in 0..MAX_WORKERS {
        W_DONE[w].store(w >= workers.len(), SeqCst);
        W_OPS[w].store(0, SeqCst);
        W_STEP[w].store(0, SeqCst);
        REQ_SINCE[w].store(0, SeqCst);
    }
    let lives: Vec<Vec<Vec<u8>>> = workers.iter().map(|_| Vec::with_capacity(LIVE_CAP)).collect();
    let counters =
        (CALLBACK_REFUSED.load(SeqCst), SPILL_RESERVE_WRONG.load(SeqCst), CALLBACK_FORKS.load(SeqCst));
    CALLBACK_FORK_FAILED.store(0, SeqCst);
    let spills_before = SPILLS.load(SeqCst);
    HOOK_PANICS.store(plan.hook_panics, SeqCst);
    ENABLED.store(true, SeqCst);
    let barrier = Barrier::new(workers.len() + 1 + usize::from(plan.killer.is_some()));
    let far = Instant::now() + Duration::from_secs(3600);
    let mut ctx = Ctx { session: *s, known, plan, tasks, deadline: far, hard: far };
    memquota::flush_thread();
    let before = memquota::stats();
    let monitor = support::Monitor::start();
    let started = Instant::now();
    ctx.deadline = started + Duration::from_millis(u64::from(plan.millis));
    ctx.hard = started + PLAN_TIME_MAX;
    let ctx = ctx;

    let (outs, kill) = std::thread::scope(|sc| {
        let ctx = &ctx;
        let barrier = &barrier;
        let handles: Vec<_> = workers
            .iter()
            .zip(lives)
            .enumerate()
            .map(|(w, (&(task, thread), live))| {
                let rng = Rng(mix(s.seed ^ (plan.index as u64) << 20 ^ (w as u64) << 40));
                let worker = Worker {
                    ctx,
                    w,
                    task,
                    thread,
                    rng,
                    live,
                    out: WorkerOut::default(),
                    step: 0,
                    kind: Kind::Churn,
                };
                sc.spawn(move || worker.run(barrier))
            })
            .collect();
        let killer = plan.killer.map(|k| {
            let workers = &workers;
            sc.spawn(move || kill_task(ctx, k, workers, barrier))
        });
        barrier.wait();
        let outs: Vec<Result<WorkerOut, String>> = handles
            .into_iter()
            .map(|h| {
                h.join().map_err(|p| {
                    if p.is::<PlannedPanic>() {
                        return "a callback's planned panic came out of memquota".to_owned();
                    }
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_else(|| "a panic".into())
                })
            })
            .collect();
        let kill = killer.map(|k| k.join().expect("the killer panicked"));
        (outs, kill)
    });
    let elapsed = started.elapsed();
    let samples = monitor.stop();

    // Quiescence: no callback runs from here on.
    ENABLED.store(false, SeqCst);
    HOOK_PANICS.store(false, SeqCst);
    let deadline = Instant::now() + Duration::from_secs(10);
    while IN_CALLBACK.load(SeqCst) > 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    let retry_left = memquota::stats().retry;
    let retry_idle = retry_left.running
        + retry_left.allocating
        + retry_left.blocked
        + retry_left.rollback_requested
        + retry_left.rolling_back
        + retry_left.bufn
        + retry_left.split_requested
        == 0;
    let attached_after_join: Vec<u32> =
        ctx.tasks.iter().map(|t| t.scope.stats().map_or(0, |s| s.threads)).collect();
    for t in ctx.tasks {
        let TaskCtx { scope, caches, mailbox, consumers, .. } = t;
        drop(scope.end());
        drop(consumers);
        drop(caches);
        drop(mailbox);
    }
    drop(outside);
    RECLAIM_CACHE.lock().unwrap().clear();
    if plan.probe_lock {
        memquota::set_heap_probe(HeapProbe::None);
    }
    let snap = mm.snapshot();
    let left = Left {
        scopes: snap.scopes.len(),
        not_ended: snap.begun - snap.ended,
        owner_records: snap.owner_records,
    };
    drop(snap);
    memquota::flush_thread();
    let after = memquota::stats();
    let expected_native = LIVE.load(SeqCst);

    let nworkers = workers.len() as u64;
    let pool_grow = plan
        .steps()
        .filter_map(|st| match st {
            Step::Pool { kib, .. } => Some(u64::from(kib) * KIB),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let overcommit = s.refuse_min > 0
        || plan.steps().any(|st| matches!(st, Step::Budget { .. } | Step::Lone { .. } | Step::Fork { .. }));
    let threads = samples.max_threads.max(nworkers + SERVICE_THREADS);
    let allowance = (threads + 1) * after.threshold
        + if overcommit { s.limit / 16 } else { 0 }
        + nworkers * CALLBACK_HOLDS
        + pool_grow
        + emergency_reserve(s.limit)
        + MISC;
    PlanResult {
        outs,
        kill,
        samples,
        before,
        after,
        spills_before,
        expected_native,
        elapsed,
        retry_idle,
        retry_left,
        attached_after_join,
        left,
        callback_refused: CALLBACK_REFUSED.load(SeqCst) - counters.0,
        spill_reserve_wrong: SPILL_RESERVE_WRONG.load(SeqCst) - counters.1,
        callback_forks: CALLBACK_FORKS.load(SeqCst) - counters.2,
        callback_fork_failed: CALLBACK_FORK_FAILED.load(SeqCst),
        allowance,
    }
}

impl PlanResult {
    /// Prints the plan's figures and returns what broke the contract.
    pub fn check(
        &self,
        s: &Session,
        plan: &Plan,
        known: Known,
        peak_allow: u64,
        totals: &mut Summary,
    ) -> Vec<String> {
        let mut t = WorkerOut::default();
        let mut unexpected: Vec<String> = Vec::new();
        let mut panicked: Vec<String> = Vec::new();
        for (w, o) in self.outs.iter().enumerate() {
            match o {
                Ok(o) => {
                    t.steps += o.steps;
                    t.skipped += o.skipped;
                    t.ok += o.ok;
                    t.refused += o.refused;
                    t.rollbacks += o.rollbacks;
                    t.splits += o.splits;
                    t.ended += o.ended;
                    t.op_refused += o.op_refused;
                    t.unexpected += o.unexpected;
                    t.forks += o.forks;
                    t.fork_failures += o.fork_failures;
                    t.budget_table_full += o.budget_table_full;
                    if let Some((step, kind)) = o.gave_up {
                        println!(
                            "  worker {w} (task {}): step {step} ({kind:?}) gave up past MAX_RETRIES",
                            o.task
                        );
                    }
                    if let Some(u) = &o.first_unexpected {
                        unexpected.push(format!("worker {w}: {} unexpected, the first at {u}", o.unexpected));
                    }
                    if o.fork_failures > 0 {
                        unexpected.push(format!(
                            "worker {w}: {} of {} fork children failed, the first with {} ({})",
                            o.fork_failures,
                            o.forks,
                            o.first_fork_failure,
                            describe_child(o.first_fork_failure)
                        ));
                    }
                }
                Err(p) => panicked.push(format!("worker {w} panicked: {p}")),
            }
        }
        let (before, after) = (&self.before, &self.after);
        let bound = s.limit + self.allowance;
        let peak_bound = s.limit + peak_allow;
        let spills = SPILLS.load(SeqCst) - self.spills_before;
        let m = |f: fn(&memquota::RetryStats) -> u64| f(&after.retry) - f(&before.retry);
        println!(
            "plan {}: {} tasks, {} workers, {} ms: {} steps ({} of the first pass skipped): {} ok, {} refused, \
             {} rolled back, {} split, {} ended with their scope; {} operations refused and gone on",
            plan.index,
            plan.tasks.len(),
            self.outs.len(),
            self.elapsed.as_millis(),
            t.steps,
            t.skipped,
            t.ok,
            t.refused,
            t.rollbacks,
            t.splits,
            t.ended,
            t.op_refused,
        );
        println!(
            "  machine: waits {}, rollbacks {}, retries {}, splits {}, timeouts {}, past MAX_RETRIES {}; ooms {}, over-commits {}, \
             spills {spills}, forks {} (+{} from callbacks); killer {:?}",
            m(|r| r.waits),
            m(|r| r.rollbacks),
            m(|r| r.retries),
            m(|r| r.splits),
            m(|r| r.timeouts),
            m(|r| r.retry_limit),
            after.ooms - before.ooms,
            after.overcommits - before.overcommits,
            t.forks,
            self.callback_forks,
            self.kill,
        );
        println!(
            "  most sampled {} over {} samples (bound {}), peak {} (bound {}); tracked at quiescence {} \
             (live {})",
            Size(self.samples.max_native),
            self.samples.count,
            Size(bound),
            Size(after.native_peak),
            Size(peak_bound),
            after.native,
            self.expected_native,
        );
        let mut bad = Vec::new();
        let mut fail = |what: String| {
            println!("  FAILED: {what}");
            bad.push(format!("plan {}: {what}", plan.index));
        };
        for p in panicked {
            fail(p);
        }
        for u in unexpected {
            fail(u);
        }
        if self.samples.max_native > bound {
            fail(format!(
                "a sample saw {} past the limit + bound {}",
                Size(self.samples.max_native),
                Size(bound)
            ));
        }
        if after.native_peak > peak_bound {
            fail(format!(
                "the peak {} passed the limit + bound {}",
                Size(after.native_peak),
                Size(peak_bound)
            ));
        }
        if after.native as i64 != self.expected_native {
            fail(format!(
                "drift at quiescence: tracked {} != {} live (off by {})",
                after.native,
                self.expected_native,
                after.native as i64 - self.expected_native
            ));
        }
        if m(|r| r.retry_limit) > 0 {
            let what = format!(
                "{} retry blocks gave up after MAX_RETRIES rollbacks in {} ms (rollbacks that free nothing the \
                 older task waits for; known defect retry_loops, new)",
                m(|r| r.retry_limit),
                self.elapsed.as_millis()
            );
            if known.retry_loops {
                fail(what);
            } else {
                println!("  known defect seen: {what}");
                totals.known_seen += 1;
            }
        }
        if !self.retry_idle {
            fail(format!("the retry machine is not idle once every thread left: {:?}", self.retry_left));
        }
        if self.attached_after_join.iter().any(|&n| n != 0) {
            fail(format!(
                "scopes still show threads attached once theirs were joined: {:?}",
                self.attached_after_join
            ));
        }
        if self.left != Left::default() {
            fail(format!("after every scope ended and every block was freed: {:?}", self.left));
        }
        if self.callback_refused > 0 {
            fail(format!(
                "{} allocations of callbacks were refused (counted, never policed)",
                self.callback_refused
            ));
        }
        if self.spill_reserve_wrong > 0 {
            fail(format!(
                "{} reservations inside a spill were not refused with ReserveInSpill",
                self.spill_reserve_wrong
            ));
        }
        if self.callback_fork_failed != 0 {
            fail(format!(
                "a child forked from a spill callback failed: {} ({})",
                self.callback_fork_failed,
                describe_child(self.callback_fork_failed)
            ));
        }
        if t.budget_table_full > 0 {
            println!(
                "  known defect seen: {} budgets refused with TooManyScopes: the table is full of budgets \
                 draining blocks freed outside them (known defect budget_slots, new)",
                t.budget_table_full
            );
            totals.known_seen += 1;
        }
        if let Some(k) = self.kill {
            if k.waiting > 0 && k.wake_ms > WAKE_BOUND.as_millis() as u64 {
                let what = format!(
                    "a scope ended under {} threads waiting in retry blocks; they returned after {} ms \
                     (known defect end_wake, issue 30 item 5)",
                    k.waiting, k.wake_ms
                );
                if known.end_wake {
                    fail(what);
                } else {
                    println!("  known defect seen: {what}");
                    totals.known_seen += 1;
                }
            }
        }
        totals.plans += 1;
        totals.steps += t.steps;
        totals.ok += t.ok;
        totals.refused += t.refused;
        totals.rollbacks += t.rollbacks;
        totals.splits += t.splits;
        totals.ended += t.ended;
        totals.forks += t.forks + self.callback_forks;
        totals.scopes_ended_early += u64::from(self.kill.is_some_and(|k| k.ended));
        totals.machine_waits += m(|r| r.waits);
        totals.machine_rollbacks += m(|r| r.rollbacks);
        totals.machine_splits += m(|r| r.splits);
        totals.machine_timeouts += m(|r| r.timeouts);
        totals.overcommits += after.overcommits - before.overcommits;
        totals.spills += spills;
        totals.budget_table_full += t.budget_table_full;
        bad
    }
}
