//! A plan's threads: each runs its task's steps with fallible requests only; the
//! killer ends a task's scope under them.

use crate::*;

/// The engine pools' lock.
pub static POOL_DECISIONS: Mutex<()> = Mutex::new(());

/// A task while its plan runs: its scope and what its threads share.
pub struct TaskCtx {
    pub scope: TaskScope,
    pub handle: ScopeHandle,
    pub ended: AtomicBool,
    pub consumers: Vec<Consumer>,
    pub caches: Vec<Arc<Cache>>,
    /// Blocks other tasks' threads handed over, for this task's threads to free.
    pub mailbox: Mutex<Vec<Vec<u8>>>,
    /// A budget a thread published for the task's other threads: (raw handle, 0:
    /// none; generation).
    pub shared: Mutex<(u64, u64)>,
}

/// What every thread of a plan reads.
pub struct Ctx<'p> {
    pub session: Session,
    pub known: Known,
    pub plan: &'p Plan,
    pub tasks: Vec<TaskCtx>,
    /// After it no thread starts a step past its first pass; after `hard`, none.
    pub deadline: Instant,
    pub hard: Instant,
}

/// What ended a step unexpectedly.
#[derive(Clone)]
pub struct Unexpected {
    pub step: usize,
    pub kind: Kind,
    pub what: &'static str,
    pub error: Option<Error>,
    pub ended: bool,
}

impl fmt::Display for Unexpected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} ({}): {}", self.step, KINDS[self.kind as usize], self.what)?;
        if let Some(e) = &self.error {
            write!(f, ": {e:?}")?;
        }
        if self.ended {
            f.write_str(" (its scope had been ended)")?;
        }
        Ok(())
    }
}

/// What a worker did: its steps' outcomes.
#[derive(Clone, Default)]
pub struct WorkerOut {
    pub task: usize,
    pub steps: u64,
    pub skipped: u64,
    pub ok: u64,
    pub refused: u64,
    pub rollbacks: u64,
    pub splits: u64,
    pub ended: u64,
    /// Refusals single operations of churn and pools met and went on after.
    pub op_refused: u64,
    pub unexpected: u64,
    pub first_unexpected: Option<Unexpected>,
    /// Budgets refused with `TooManyScopes` (known `budget_slots`).
    pub budget_table_full: u64,
    /// The first step whose retry block gave up (`RetryOom` past `MAX_RETRIES`).
    pub gave_up: Option<(usize, Kind)>,
    pub forks: u64,
    pub fork_failures: u64,
    pub first_fork_failure: i64,
}

/// A plan's thread: one of its task's step lists, gone through until the plan's time.
pub struct Worker<'c, 'p> {
    pub ctx: &'c Ctx<'p>,
    pub w: usize,
    pub task: usize,
    pub thread: usize,
    pub rng: Rng,
    pub live: Vec<Vec<u8>>,
    pub out: WorkerOut,
    pub step: usize,
    pub kind: Kind,
}

/// Inside a retry-block attempt (for the killer's measure of waits).
pub struct InBlock;

impl InBlock {
    pub fn enter() -> InBlock {
        BLOCK_DEPTH.with(|d| d.set(d.get() + 1));
        InBlock
    }
}

impl Drop for InBlock {
    fn drop(&mut self) {
        BLOCK_DEPTH.with(|d| d.set(d.get() - 1));
    }
}

/// `bytes` taken fallibly (at least 1), untouched but one byte; `?` maps a refusal
/// to memquota's error (a rollback or split inside a retry block). Marks a worker
/// in a retry block as in a request meanwhile.
pub fn buffer(bytes: u64) -> memquota::Result<Vec<u8>> {
    let mut v: Vec<u8> = Vec::new();
    let w = WORKER.with(Cell::get);
    let watched = w < MAX_WORKERS && BLOCK_DEPTH.with(Cell::get) > 0;
    if watched {
        REQ_SINCE[w].store(now_ms() + 1, SeqCst);
    }
    let r = fallibly(|| v.try_reserve_exact(bytes.max(1) as usize));
    if watched {
        REQ_SINCE[w].store(0, SeqCst);
    }
    checkpoint();
    r?;
    v.push(1);
    Ok(v)
}

pub fn pause(rng: &mut Rng) {
    for _ in 0..rng.below(8) {
        std::thread::yield_now();
    }
}

/// Sizes from 1 B to 4 MiB, most of them small.
pub fn churn_size(rng: &mut Rng) -> u64 {
    match rng.below(100) {
        0..=54 => 1 + rng.below(512),
        55..=79 => 1 + rng.below(64 << 10),
        80..=96 => 1 + rng.below(1 << 20),
        _ => 1 + rng.below(4 << 20),
    }
}

/// Publishes a budget's handle for the task's other threads; withdrawn on drop
/// (before the budget, declared after it, ends).
pub struct Published<'a>(&'a Mutex<(u64, u64)>);

impl<'a> Published<'a> {
    pub fn new(slot: &'a Mutex<(u64, u64)>, handle: ScopeHandle) -> Published<'a> {
        let mut s = slot.lock().unwrap();
        *s = (handle.as_raw(), s.1 + 1);
        Published(slot)
    }
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        let mut s = self.0.lock().unwrap();
        *s = (0, s.1 + 1);
    }
}

impl<'c, 'p> Worker<'c, 'p> {
    pub fn t(&self) -> &'c TaskCtx {
        &self.ctx.tasks[self.task]
    }

    pub fn ended(&self) -> bool {
        self.t().ended.load(SeqCst)
    }

    /// Forks a worker makes at most in a plan: more when forks race re-configuration
    /// (known `fork_race`).
    pub fn max_forks(&self) -> u64 {
        if self.ctx.known.fork_race {
            4 * MAX_FORKS
        } else {
            MAX_FORKS
        }
    }

    pub fn limit(&self) -> u64 {
        self.ctx.session.limit
    }

    pub fn unexpected(&mut self, what: &'static str, error: Option<Error>) {
        self.out.unexpected += 1;
        if self.out.first_unexpected.is_none() {
            self.out.first_unexpected =
                Some(Unexpected { step: self.step, kind: self.kind, what, error, ended: self.ended() });
        }
    }

    /// A step's result: memquota's own error, and one that fits where it ran.
    pub fn record(&mut self, r: memquota::Result<()>, in_block: bool) {
        match r {
            Ok(()) => self.out.ok += 1,
            Err(Error::Refused { .. }) => self.out.refused += 1,
            Err(Error::RetryOom) if in_block => {
                self.out.rollbacks += 1;
                self.out.gave_up.get_or_insert((self.step, self.kind));
            }
            Err(Error::SplitAndRetryOom) if in_block => self.out.splits += 1,
            Err(Error::ScopeEnded) if self.ended() => self.out.ended += 1,
            Err(Error::TooManyScopes)
                if !self.ctx.known.budget_slots
                    && matches!(self.kind, Kind::Budget | Kind::Lone | Kind::Fork) =>
            {
                self.out.budget_table_full += 1;
            }
            Err(e) => self.unexpected("the step's result", Some(e)),
        }
    }

    /// An operation that goes on after a refusal (churn, a pool's growth).
    pub fn op_failed(&mut self, e: Error) {
        match e {
            Error::Refused { .. } => self.out.op_refused += 1,
            Error::ScopeEnded if self.ended() => self.out.ended += 1,
            e => self.unexpected("an operation's result", Some(e)),
        }
    }

    pub fn run(mut self, barrier: &Barrier) -> WorkerOut {
        WORKER.with(|c| c.set(self.w));
        W_TASK[self.w].store(self.task, SeqCst);
        self.out.task = self.task;
        barrier.wait();
        let steps = &self.ctx.plan.tasks[self.task].threads[self.thread];
        'passes: for pass in 0.. {
            for (i, &step) in steps.iter().enumerate() {
                let now = Instant::now();
                // A task whose scope ended stops after the step it was in (Velox's
                // abort); the others go on until the plan's time.
                if now >= self.ctx.hard || (pass > 0 && now >= self.ctx.deadline) || self.ended() {
                    if pass == 0 && !self.ended() {
                        self.out.skipped += (steps.len() - i) as u64;
                    }
                    break 'passes;
                }
                self.step = i;
                self.kind = step.kind();
                W_STEP[self.w].store(i, SeqCst);
                W_KIND[self.w].store(self.kind as usize, SeqCst);
                checkpoint();
                let r = self.run_step(step);
                checkpoint();
                self.out.steps += 1;
                self.record(r, step.in_block());
            }
        }
        W_KIND[self.w].store(usize::MAX, SeqCst);
        self.live.clear();
        W_DONE[self.w].store(true, SeqCst);
        self.out
    }

    pub fn run_step(&mut self, step: Step) -> memquota::Result<()> {
        match step {
            Step::Churn { ops } => self.churn(ops),
            Step::Retry { bufs, kib, nested } => self.retry(bufs, kib, nested),
            Step::Split { rows, row_kib } => self.split(rows, row_kib),
            Step::Budget { est_kib, need_kib, try_free, share, in_retry } => {
                let (est, need) = (u64::from(est_kib) * KIB, u64::from(need_kib) * KIB);
                if in_retry {
                    let ctx = self.ctx;
                    with_retry(&ctx.tasks[self.task].scope, || {
                        let _b = InBlock::enter();
                        self.budget(est, need, try_free, share)
                    })
                } else {
                    self.budget(est, need, try_free, share)
                }
            }
            Step::Lone { need_kib } => self.lone(u64::from(need_kib) * KIB),
            Step::Reserve { kib, partial, consumer, in_retry } => {
                let bytes = u64::from(kib) * KIB;
                if in_retry {
                    let ctx = self.ctx;
                    with_retry(&ctx.tasks[self.task].scope, || {
                        let _b = InBlock::enter();
                        self.reserve(bytes, partial, consumer)
                    })
                } else {
                    self.reserve(bytes, partial, consumer)
                }
            }
            Step::Pool { rounds, kib } => self.pool(rounds, u64::from(kib) * KIB),
            Step::Cache { kib } => self.cache(u64::from(kib) * KIB),
            Step::Fork { under_budget } if self.out.forks < self.max_forks() => self.fork(under_budget),
            Step::Fork { .. } => Ok(()),
            // A burst, so that another thread's fork lands inside one now and then.
            Step::Reinit => (0..64).try_for_each(|_| memquota::init(self.ctx.session.config())),
            Step::ProbeLocked => {
                let ctx = self.ctx;
                let g = PROBE_LOCK.lock();
                // Held a moment before the block begins: long enough for a waiter to
                // call the probe under the retry machine's lock.
                pause(&mut self.rng);
                let r = with_retry(&ctx.tasks[self.task].scope, || Ok(()));
                drop(g);
                r
            }
        }
    }

    pub fn bump(&mut self) {
        W_OPS[self.w].fetch_add(1, Relaxed);
    }

    pub fn keep(&mut self, v: Vec<u8>) {
        if self.live.len() == self.live.capacity() {
            let k = self.rng.below(self.live.len() as u64) as usize;
            self.live.swap_remove(k);
        }
        self.live.push(v);
    }

    /// Hands a block to the next task's threads to free (or frees it here when
    /// their mailbox is full or busy).
    pub fn hand_over(&mut self, v: Vec<u8>) {
        let tasks = &self.ctx.tasks;
        let next = &tasks[(self.task + 1) % tasks.len()];
        let Ok(mut mb) = next.mailbox.try_lock() else { return };
        if mb.len() < mb.capacity() {
            mb.push(v);
        }
    }

    /// Frees what other tasks' threads handed over (outside the mailbox's lock).
    pub fn drain_mailbox(&mut self) {
        for _ in 0..4 {
            let Ok(mut mb) = self.t().mailbox.try_lock() else { return };
            let Some(v) = mb.pop() else { return };
            drop(mb);
            drop(v);
        }
    }

    /// Attaches the thread under the task's published budget (half the time, when
    /// there is one) or to its scope.
    /// Attaches the thread under the task's published budget (half the time, when
    /// there is one: the guard comes with true) or to its scope.
    pub fn attach_somewhere(&mut self) -> Option<(AttachGuard, bool)> {
        let t = self.t();
        if coin(&mut self.rng) {
            let (raw, gen) = *t.shared.lock().unwrap();
            if raw != 0 {
                match ScopeHandle::from_raw(raw).attach() {
                    Ok(g) => return Some((g, true)),
                    // Withdrawn and ended since it was read: a stale handle.
                    Err(Error::ScopeEnded) if t.shared.lock().unwrap().1 != gen || self.ended() => {}
                    Err(e) => self.unexpected("attach under a published budget", Some(e)),
                }
            }
        }
        match t.handle.attach() {
            Ok(g) => Some((g, false)),
            Err(e) => {
                self.op_failed(e);
                None
            }
        }
    }

    pub fn churn(&mut self, ops: u16) -> memquota::Result<()> {
        let mut attached: Option<(AttachGuard, bool)> = None;
        // Blocks taken under a budget, freed before the thread leaves it: one freed
        // outside would keep the budget's slot draining (known `budget_slots`), and
        // the table would fill within a plan.
        let mut under_budget: [Option<Vec<u8>>; 4] = Default::default();
        let keep_apart = !self.ctx.known.budget_slots;
        for _ in 0..ops {
            checkpoint();
            self.bump();
            self.drain_mailbox();
            let n = self.live.len() as u64;
            let pick = |rng: &mut Rng| rng.below(n.max(1)) as usize;
            match self.rng.below(100) {
                0..=39 => match buffer(churn_size(&mut self.rng)) {
                    Ok(v) if keep_apart && attached.as_ref().is_some_and(|a| a.1) => {
                        let k = self.rng.below(under_budget.len() as u64) as usize;
                        under_budget[k] = Some(v);
                    }
                    Ok(v) => self.keep(v),
                    Err(e) => self.op_failed(e),
                },
                40..=49 if n > 0 => {
                    let k = pick(&mut self.rng);
                    let extra = churn_size(&mut self.rng) as usize;
                    let v = &mut self.live[k];
                    let grow = v.capacity() - v.len() + extra;
                    let r = fallibly(|| v.try_reserve_exact(grow));
                    checkpoint();
                    if let Err(e) = r {
                        self.op_failed(e.into());
                    }
                }
                50..=54 if n > 0 => {
                    let k = pick(&mut self.rng);
                    if self.live[k].capacity() < OWNED_MIN {
                        self.live[k].shrink_to_fit();
                    }
                }
                55..=64 if n > 0 => {
                    let k = pick(&mut self.rng);
                    let v = self.live.swap_remove(k);
                    self.hand_over(v);
                }
                65..=84 if n > 0 => {
                    let k = pick(&mut self.rng);
                    self.live.swap_remove(k);
                }
                85..=94 => {
                    attached = match attached.take() {
                        Some(g) => {
                            under_budget = Default::default();
                            drop(g);
                            None
                        }
                        None => self.attach_somewhere(),
                    };
                }
                _ => {}
            }
        }
        drop(under_budget);
        drop(attached);
        Ok(())
    }

    pub fn retry(&mut self, bufs: u8, kib: u32, nested: bool) -> memquota::Result<()> {
        let ctx = self.ctx;
        let scope = &ctx.tasks[self.task].scope;
        let size = u64::from(kib) * KIB;
        let rng = &mut self.rng;
        with_retry(scope, || {
            let _b = InBlock::enter();
            let mut held: [Option<Vec<u8>>; 4] = Default::default();
            for slot in held.iter_mut().take(usize::from(bufs)) {
                *slot = Some(buffer(size)?);
                pause(rng);
            }
            if nested {
                with_retry(scope, || {
                    let _b = InBlock::enter();
                    buffer(size / 2).map(drop)
                })?;
            }
            Ok(())
        })
    }

    pub fn split(&mut self, rows: u16, row_kib: u32) -> memquota::Result<()> {
        let ctx = self.ctx;
        let row = u64::from(row_kib) * KIB;
        let rng = &mut self.rng;
        let pieces = with_split_retry(
            &ctx.tasks[self.task].scope,
            (0u32, u32::from(rows)),
            |(a, b)| {
                // Built fallibly: fewer than two pieces ends the block with a split.
                let mut v = Vec::new();
                if b - a >= 2 && fallibly(|| v.try_reserve_exact(2)).is_ok() {
                    let m = a + (b - a) / 2;
                    v.push((a, m));
                    v.push((m, b));
                }
                v
            },
            |&(a, b)| {
                let _b = InBlock::enter();
                let held = buffer(u64::from(b - a) * row)?;
                pause(rng);
                drop(held);
                Ok((a, b))
            },
        )?;
        let mut at = 0;
        for &(a, b) in &pieces {
            if a != at || b <= a {
                self.unexpected("with_split_retry's pieces are not the input in order", None);
                break;
            }
            at = b;
        }
        if at != u32::from(rows) {
            self.unexpected("with_split_retry's pieces do not cover the input", None);
        }
        Ok(())
    }

    pub fn budget(&mut self, est: u64, need: u64, try_free: bool, share: bool) -> memquota::Result<()> {
        let t = self.t();
        let budget = t.handle.budget(est)?;
        let _published = share.then(|| Published::new(&t.shared, budget.handle()));
        let under = budget.attach()?;
        let chunks = 1 + self.rng.below(4) as usize;
        let mut held: [Option<Vec<u8>>; 4] = Default::default();
        for slot in held.iter_mut().take(chunks) {
            *slot = Some(buffer(need / chunks as u64)?);
            pause(&mut self.rng);
        }
        if try_free {
            let ask = self.rng.below(est + 1);
            if budget.try_free(ask) > ask {
                self.unexpected("try_free gave back more than it was asked", None);
            }
        }
        if budget.stats().is_some_and(|s| s.granted > est) {
            self.unexpected("a budget was granted more than its estimate", None);
        }
        // One block freed on another task's thread: a big one credits this budget
        // through its owner record (a small one keeps it draining: known
        // `budget_slots`).
        let owned = held[0].as_ref().is_some_and(|v| v.capacity() >= OWNED_MIN);
        if self.ctx.known.budget_slots || (owned && coin(&mut self.rng)) {
            if let Some(v) = held[0].take() {
                self.hand_over(v);
            }
        }
        drop(held);
        drop(under);
        Ok(())
    }

    pub fn lone(&mut self, need: u64) -> memquota::Result<()> {
        let budget = self.t().handle.budget(0)?;
        let _under = budget.attach()?;
        let held = buffer(need)?;
        pause(&mut self.rng);
        drop(held);
        Ok(())
    }

    pub fn reserve(&mut self, bytes: u64, partial: bool, consumer: bool) -> memquota::Result<()> {
        let t = self.t();
        let mut r = match (consumer, t.consumers.first()) {
            (true, Some(c)) if partial => c.reserve_up_to(bytes)?,
            (true, Some(c)) => c.reserve(bytes)?,
            _ if partial => t.handle.reserve_up_to(bytes)?,
            _ => t.handle.reserve(bytes)?,
        };
        if r.bytes() > bytes || (!partial && r.bytes() != bytes) {
            self.unexpected("a reservation granted other than it was asked", None);
        }
        let _attached = t.handle.attach()?;
        let granted = r.bytes();
        if granted > 0 {
            // Allocations of an attached thread use the reservation first.
            let n = 1 + self.rng.below(3);
            let mut held: [Option<Vec<u8>>; 3] = Default::default();
            for slot in held.iter_mut().take(n as usize) {
                *slot = Some(buffer(granted / n)?);
                pause(&mut self.rng);
            }
            r.shrink(self.rng.below(granted + 1));
            drop(held);
        }
        drop(r);
        Ok(())
    }

    /// An engine's pool deciding on its own figures, as memquota-datafusion does.
    pub fn pool(&mut self, rounds: u8, kib: u64) -> memquota::Result<()> {
        let t = self.t();
        let mut r = t.handle.reserve_up_to(kib)?;
        let _attached = t.handle.attach()?;
        let mut held: [Option<Vec<u8>>; 8] = Default::default();
        for _ in 0..rounds {
            checkpoint();
            self.bump();
            let want = 1 + self.rng.below(kib);
            // One decision at a time, as a pool under its own lock: what passes the
            // limit is what others were granted between its look and its growth.
            let decision = POOL_DECISIONS.lock().unwrap();
            let (Some(acc), pa) = (t.handle.account(), memquota::process_account()) else {
                return Err(Error::ScopeEnded);
            };
            let k = self.rng.below(held.len() as u64) as usize;
            let grew = acc.held + want <= acc.share && pa.headroom >= want && held[k].is_none();
            if grew {
                r.grow_unchecked(want);
            }
            drop(decision);
            if grew {
                match buffer(want) {
                    Ok(v) => held[k] = Some(v),
                    Err(e) => {
                        r.shrink(want);
                        self.op_failed(e);
                    }
                }
            } else {
                // Spill: give back half of what it holds.
                for slot in held.iter_mut().step_by(2) {
                    if let Some(v) = slot.take() {
                        r.shrink(v.capacity() as u64);
                    }
                }
            }
        }
        drop(held);
        drop(r);
        Ok(())
    }

    pub fn cache(&mut self, bytes: u64) -> memquota::Result<()> {
        let t = self.t();
        if t.consumers.is_empty() {
            return Ok(());
        }
        let _attached = t.handle.attach()?;
        for (c, cache) in t.consumers.iter().zip(&t.caches) {
            let r = c.reserve(bytes)?;
            let v = buffer(bytes)?;
            let mut entries = cache.lock().unwrap();
            let old = (entries.len() == entries.capacity()).then(|| entries.swap_remove(0));
            entries.push((r, v));
            drop(entries);
            drop(old);
        }
        Ok(())
    }

    pub fn fork(&mut self, under_budget: bool) -> memquota::Result<()> {
        let t = self.t();
        let budget = if under_budget { Some(t.handle.budget(self.limit() / 32)?) } else { None };
        let _attached = match &budget {
            Some(b) => b.attach()?,
            None => t.handle.attach()?,
        };
        let held = buffer(self.limit() / 64);
        let code = fork_and_wait(child_full);
        drop(held);
        self.out.forks += 1;
        if code != 0 {
            self.out.fork_failures += 1;
            if self.out.first_fork_failure == 0 {
                self.out.first_fork_failure = i64::from(code);
            }
        }
        Ok(())
    }
}
/// Ends one task's scope under its threads, at a planned moment or once one of them
/// has waited in a retry block for 20 ms; measures how long the threads waiting then
/// take to return.
#[derive(Clone, Copy, Debug, Default)]
pub struct KillOut {
    pub ended: bool,
    pub waiting: usize,
    pub wake_ms: u64,
}

pub fn kill_task(ctx: &Ctx<'_>, k: Killer, workers: &[(usize, usize)], barrier: &Barrier) -> KillOut {
    barrier.wait();
    let mine: Vec<usize> = (0..workers.len()).filter(|&w| workers[w].0 == k.task).collect();
    let t0 = Instant::now();
    let all_done = || mine.iter().all(|&w| W_DONE[w].load(SeqCst));
    let waiting_since = |w: usize, ms: u64| {
        let s = REQ_SINCE[w].load(SeqCst);
        s > 0 && now_ms().saturating_sub(s - 1) >= ms
    };
    loop {
        let due = if k.when_blocked {
            mine.iter().any(|&w| waiting_since(w, 20)) || t0.elapsed() > Duration::from_secs(2)
        } else {
            t0.elapsed() >= Duration::from_millis(u64::from(k.after_ms))
        };
        if due || all_done() {
            break;
        }
        std::thread::park_timeout(Duration::from_millis(1));
    }
    let task = &ctx.tasks[k.task];
    let waiting: Vec<(usize, u64)> =
        mine.iter().filter(|&&w| waiting_since(w, 20)).map(|&w| (w, REQ_SINCE[w].load(SeqCst))).collect();
    task.ended.store(true, SeqCst);
    let ended_at = Instant::now();
    let ended = memquota::seam::scopes::end_raw(task.handle.as_raw()).is_ok();
    // The waiting threads' requests return (their marks change).
    while waiting.iter().any(|&(w, since)| REQ_SINCE[w].load(SeqCst) == since)
        && ended_at.elapsed() < Duration::from_secs(15)
    {
        std::thread::park_timeout(Duration::from_millis(1));
    }
    KillOut { ended, waiting: waiting.len(), wake_ms: ended_at.elapsed().as_millis() as u64 }
}
