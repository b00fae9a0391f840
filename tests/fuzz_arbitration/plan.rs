//! Plans, generated from the seed alone: a session (the limit and settings all its
//! plans share) and each plan's tasks, threads and steps; the parts a minimisation
//! drops.

use crate::*;

/// splitmix64: spreads consecutive seeds over the xorshift generator's state.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) | 1
}

/// A seed's process: its limit and settings, the same for all its plans (the
/// account's peak is the process's).
#[derive(Clone, Copy, Debug)]
pub struct Session {
    pub seed: u64,
    pub limit: u64,
    pub refuse_min: u64,
    /// Short waits (share 200 ms, retry watchdog 2 s) or the defaults (2 s, 10 s).
    pub short_waits: bool,
}

impl Session {
    pub fn new(seed: u64) -> Session {
        let mut rng = Rng(mix(seed));
        Session {
            seed,
            limit: [32, 48, 64, 96, 128][rng.below(5) as usize] * MIB,
            refuse_min: if rng.below(3) == 0 { 64 * KIB } else { 0 },
            short_waits: rng.below(4) != 0,
        }
    }

    /// Untracked memory is reported, not counted: what is fuzzed is arbitration over
    /// the native account.
    pub fn config(&self) -> Config {
        Config::new().limit(self.limit).refuse_min(self.refuse_min).untracked(Untracked::Report)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Churn,
    Retry,
    Split,
    Budget,
    Lone,
    Reserve,
    Pool,
    Cache,
    Fork,
    Reinit,
    ProbeLocked,
}

pub const KINDS: [&str; 11] = [
    "churn",
    "retry",
    "split",
    "budget",
    "lone",
    "reserve",
    "pool",
    "cache",
    "fork",
    "reinit",
    "probe-locked",
];

pub fn kind_name(k: usize) -> &'static str {
    KINDS.get(k).copied().unwrap_or("done")
}

/// One step of a thread. Sizes in KiB.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    /// Allocate, grow, shrink and free blocks of 1 B - 4 MiB, attached to the scope
    /// or under the task's published budget or nowhere, handing some to the next
    /// task's threads to free and freeing what they hand over.
    Churn { ops: u16 },
    /// `with_retry`: `bufs` buffers held together, then maybe a nested block.
    Retry { bufs: u8, kib: u32, nested: bool },
    /// `with_split_retry` over `rows` rows; pieces must come back in input order.
    Split { rows: u16, row_kib: u32 },
    /// A budget of `est` for a need of `need` (borrowing the difference), maybe
    /// shared with the task's other threads, maybe freed early, maybe in a retry block.
    Budget { est_kib: u32, need_kib: u32, try_free: bool, share: bool, in_retry: bool },
    /// A budget of nothing: its need over-commits when it is alone.
    Lone { need_kib: u32 },
    /// A reservation (the scope's or a consumer's, exact or partial), used by
    /// allocations, shrunk, released.
    Reserve { kib: u32, partial: bool, consumer: bool, in_retry: bool },
    /// An engine's pool: grows a reservation with `grow_unchecked` when the account
    /// says there is room, shrinks it when not.
    Pool { rounds: u8, kib: u32 },
    /// Refills the task's spillable caches (a consumer's reservation and a buffer).
    Cache { kib: u32 },
    /// `fork`, attached to the scope or under a budget; the child checks and exits.
    Fork { under_budget: bool },
    /// `memquota::init` again, 64 times, at the limit (and, in plans with forks,
    /// while others fork: the child's `init` must return).
    Reinit,
    /// Holds the heap probe's lock while entering and leaving a retry block (known
    /// `probe_lock`).
    ProbeLocked,
}

impl Step {
    pub fn kind(self) -> Kind {
        match self {
            Step::Churn { .. } => Kind::Churn,
            Step::Retry { .. } => Kind::Retry,
            Step::Split { .. } => Kind::Split,
            Step::Budget { .. } => Kind::Budget,
            Step::Lone { .. } => Kind::Lone,
            Step::Reserve { .. } => Kind::Reserve,
            Step::Pool { .. } => Kind::Pool,
            Step::Cache { .. } => Kind::Cache,
            Step::Fork { .. } => Kind::Fork,
            Step::Reinit => Kind::Reinit,
            Step::ProbeLocked => Kind::ProbeLocked,
        }
    }

    /// Whether the step runs in a retry block (where rollbacks and splits are answers).
    pub fn in_block(self) -> bool {
        match self {
            Step::Retry { .. } | Step::Split { .. } | Step::ProbeLocked => true,
            Step::Budget { in_retry, .. } | Step::Reserve { in_retry, .. } => in_retry,
            _ => false,
        }
    }
}

/// What a spillable consumer's callback does besides freeing its cache.
#[derive(Clone, Copy, Debug)]
pub struct SpillPlan {
    /// A scratch buffer allocated on every other call (0: none).
    pub scratch_kib: u32,
    /// Panics on every n-th call (0: never).
    pub panic_every: u8,
    /// Tries to reserve on every third call (must be refused with `ReserveInSpill`).
    pub reserve_inside: bool,
    /// Forks on every fifth call (known `fork_race`).
    pub fork_inside: bool,
}

#[derive(Clone, Debug)]
pub struct TaskPlan {
    pub priority: i32,
    pub cap_kib: Option<u32>,
    pub consumers: u8,
    pub spill: SpillPlan,
    pub threads: Vec<Vec<Step>>,
}

/// Velox's task abort: one task's scope ended under its threads.
#[derive(Clone, Copy, Debug)]
pub struct Killer {
    pub task: usize,
    pub after_ms: u32,
    /// End it once one of its threads has waited in a retry block for a while.
    pub when_blocked: bool,
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub index: usize,
    /// Held by the main thread outside any scope during the plan.
    pub outside_kib: u32,
    /// A process reclaim callback with a cache to free.
    pub reclaim: bool,
    pub hook_panics: bool,
    pub probe_lock: bool,
    pub killer: Option<Killer>,
    /// Threads go through their steps again and again until this long has passed
    /// (each does one pass at least).
    pub millis: u32,
    pub tasks: Vec<TaskPlan>,
}

pub fn coin(rng: &mut Rng) -> bool {
    rng.below(2) == 0
}

/// KiB between `lo` and `hi` bytes (at least 1).
pub fn kib_between(rng: &mut Rng, lo: u64, hi: u64) -> u32 {
    ((lo + rng.below(hi.saturating_sub(lo).max(1))) / KIB).max(1) as u32
}

impl Plan {
    pub fn generate(s: &Session, index: usize, known: Known) -> Plan {
        // Every draw is made whatever the known defects reached: a seed's plan is the
        // same with them on or off, but for their own parts (a minimisation's indices
        // stay valid).
        let mut rng = Rng(mix(s.seed.wrapping_mul(1_000_003).wrapping_add(index as u64)));
        let l = s.limit;
        let forks = rng.below(3) == 0;
        let probe_lock = rng.below(3) == 0 && known.probe_lock;
        let ntasks = 1 + rng.below(5) as usize;
        let mut workers = 0;
        let mut tasks = Vec::new();
        for _ in 0..ntasks {
            let nthreads = (1 + rng.below(3) as usize).min(MAX_WORKERS - workers).max(1);
            workers += nthreads;
            let threads = (0..nthreads)
                .map(|_| {
                    let n = 3 + rng.below(8);
                    (0..n).map(|_| step(&mut rng, l, forks, probe_lock)).collect()
                })
                .collect();
            tasks.push(TaskPlan {
                priority: rng.below(3) as i32,
                cap_kib: (rng.below(5) == 0).then(|| kib_between(&mut rng, l / 4, l / 2)),
                consumers: rng.below(3) as u8,
                spill: SpillPlan {
                    scratch_kib: [0, 16, 64][rng.below(3) as usize],
                    panic_every: [0, 0, 2, 3, 5][rng.below(5) as usize],
                    reserve_inside: rng.below(3) == 0,
                    // A fork child that goes on from a callback may wait in the
                    // machine for vanished threads: short waits only.
                    fork_inside: rng.below(3) == 0 && known.fork_race && s.short_waits,
                },
                threads,
            });
            if workers >= MAX_WORKERS {
                break;
            }
        }
        let ntasks = tasks.len();
        let killer = (rng.below(10) < 4).then(|| Killer {
            task: rng.below(ntasks as u64) as usize,
            after_ms: 5 + rng.below(500) as u32,
            // On main a thread blocked there sleeps until the retry watchdog: with the
            // default 10 s only when that defect is being checked.
            when_blocked: coin(&mut rng) && (s.short_waits || known.end_wake),
        });
        Plan {
            index,
            outside_kib: if rng.below(3) == 0 { 0 } else { (l * rng.below(8) / 16 / KIB) as u32 },
            reclaim: coin(&mut rng),
            hook_panics: rng.below(3) == 0 && known.hook_panic,
            probe_lock,
            killer,
            millis: 200 + rng.below(1000) as u32,
            tasks,
        }
    }

    /// Drops the parts `spec` names (see [`DROP_VAR`]).
    pub fn drop_parts(&mut self, spec: &str) {
        if spec.split(',').any(|p| p.trim() == "killer") {
            self.killer = None;
        }
        let mut parts: Vec<Vec<usize>> = spec
            .split(',')
            .filter(|p| !p.trim().is_empty() && p.trim() != "killer")
            .map(|p| p.trim().split('.').map(|n| n.parse().expect("a drop index")).collect())
            .collect();
        // Deepest and last first, so earlier indices stay valid.
        parts.sort_by(|a, b| b.len().cmp(&a.len()).then(b.cmp(a)));
        for p in parts {
            match p[..] {
                [t, h, s] => {
                    let steps = &mut self.tasks[t].threads[h];
                    if s < steps.len() {
                        steps.remove(s);
                    }
                }
                [t, h] => self.tasks[t].threads[h].clear(),
                [t] => self.tasks[t].threads.iter_mut().for_each(Vec::clear),
                _ => panic!("bad drop spec {spec:?}"),
            }
        }
        // Threads with nothing to do go, and tasks with no thread.
        for t in &mut self.tasks {
            t.threads.retain(|steps| !steps.is_empty());
        }
        let mut kept = 0;
        let map: Vec<Option<usize>> = self
            .tasks
            .iter()
            .map(|tp| {
                kept += usize::from(!tp.threads.is_empty());
                (!tp.threads.is_empty()).then(|| kept - 1)
            })
            .collect();
        self.tasks.retain(|tp| !tp.threads.is_empty());
        self.killer = self.killer.and_then(|k| map[k.task].map(|task| Killer { task, ..k }));
    }

    pub fn steps(&self) -> impl Iterator<Item = Step> + '_ {
        self.tasks.iter().flat_map(|t| t.threads.iter().flatten().copied())
    }
}

pub fn step(rng: &mut Rng, l: u64, forks: bool, probe_lock: bool) -> Step {
    let locked = rng.below(6) == 0;
    if probe_lock && locked {
        return Step::ProbeLocked;
    }
    loop {
        return match rng.below(100) {
            0..=17 => Step::Churn { ops: 50 + rng.below(350) as u16 },
            18..=35 => Step::Retry {
                bufs: 1 + rng.below(4) as u8,
                kib: kib_between(rng, l / 32, l / 4),
                nested: rng.below(5) == 0,
            },
            36..=45 => {
                let rows = 2 + rng.below(63);
                let total = l / 4 + rng.below(2 * l);
                Step::Split { rows: rows as u16, row_kib: (total / rows / KIB).max(1) as u32 }
            }
            46..=59 => Step::Budget {
                est_kib: kib_between(rng, 0, l / 4),
                need_kib: kib_between(rng, l / 64, l / 3),
                try_free: coin(rng),
                share: coin(rng),
                in_retry: rng.below(3) == 0,
            },
            60..=64 => Step::Lone { need_kib: kib_between(rng, l / 64, l / 8) },
            65..=74 => Step::Reserve {
                kib: kib_between(rng, l / 16, l / 2),
                partial: coin(rng),
                consumer: coin(rng),
                in_retry: rng.below(3) == 0,
            },
            75..=82 => Step::Pool { rounds: 4 + rng.below(28) as u8, kib: kib_between(rng, l / 256, l / 16) },
            83..=90 => Step::Cache { kib: kib_between(rng, l / 64, l / 8) },
            91..=94 if forks => Step::Fork { under_budget: coin(rng) },
            95..=97 => Step::Reinit,
            _ => continue,
        };
    }
}
