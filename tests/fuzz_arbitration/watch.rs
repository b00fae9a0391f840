//! What the watchdog and the refusal message read while the process may be stuck:
//! atomics and fixed buffers, never a lock they wait for or an allocation.

use crate::*;

pub static SEED: AtomicU64 = AtomicU64::new(0);
pub static PLAN_NO: AtomicUsize = AtomicUsize::new(usize::MAX);
/// `MEMQUOTA_FUZZ_KNOWN=...` as the seed's process was given it, for the re-run line.
pub static KNOWN_ENV: OnceLock<String> = OnceLock::new();
pub static W_TASK: [AtomicUsize; MAX_WORKERS] = [const { AtomicUsize::new(0) }; MAX_WORKERS];
pub static W_STEP: [AtomicUsize; MAX_WORKERS] = [const { AtomicUsize::new(0) }; MAX_WORKERS];
pub static W_KIND: [AtomicUsize; MAX_WORKERS] = [const { AtomicUsize::new(usize::MAX) }; MAX_WORKERS];
pub static W_OPS: [AtomicU64; MAX_WORKERS] = [const { AtomicU64::new(0) }; MAX_WORKERS];
/// Milliseconds since the epoch + 1 while a worker is in a request inside a retry
/// block, 0 otherwise.
pub static REQ_SINCE: [AtomicU64; MAX_WORKERS] = [const { AtomicU64::new(0) }; MAX_WORKERS];
pub static W_DONE: [AtomicBool; MAX_WORKERS] = [const { AtomicBool::new(true) }; MAX_WORKERS];
pub static N_WORKERS: AtomicUsize = AtomicUsize::new(0);

/// The plan being run, as text, for the watchdog (it cannot format while stuck).
pub struct PlanText {
    pub buf: [u8; 16384],
    pub len: usize,
}

impl fmt::Write for PlanText {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

pub static PLAN_TEXT: Mutex<PlanText> = Mutex::new(PlanText { buf: [0; 16384], len: 0 });

pub fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64
}

pub fn write_stderr(bytes: &[u8]) {
    let mut bytes = bytes;
    while !bytes.is_empty() {
        // SAFETY: the pointer and length describe the live `bytes` slice.
        let n = unsafe { libc::write(libc::STDERR_FILENO, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

pub fn rerun_line(l: &mut Line) {
    let seed = SEED.load(SeqCst);
    let known = KNOWN_ENV.get().map_or("", String::as_str);
    let _ = writeln!(
        l,
        "  seed {seed}, plan {}; re-run: {SEED_VAR}={seed} {}cargo test --release --test fuzz_arbitration",
        PLAN_NO.load(SeqCst) as isize,
        known
    );
}

/// The watchdog's account of a stuck plan: the seed, the command to re-run it, the
/// plan, and where every worker is. Reads atomics and try-locks only.
pub fn status(l: &mut Line) {
    let mut head = Line::new();
    rerun_line(&mut head);
    head.emit();
    if let Ok(p) = PLAN_TEXT.try_lock() {
        write_stderr(b"  plan: ");
        write_stderr(&p.buf[..p.len]);
        write_stderr(b"\n");
    }
    let _ = writeln!(l, "  workers (task, step, kind, ops, in a retry request since ms):");
    let now = now_ms();
    for w in 0..N_WORKERS.load(SeqCst).min(MAX_WORKERS) {
        let since = REQ_SINCE[w].load(SeqCst);
        let _ = writeln!(
            l,
            "    {w}: task {}, step {}, {}, {} ops{}",
            W_TASK[w].load(SeqCst),
            W_STEP[w].load(SeqCst),
            kind_name(W_KIND[w].load(SeqCst)),
            W_OPS[w].load(SeqCst),
            if since > 0 { ", blocked" } else { "" },
        );
        if since > 0 {
            let _ = writeln!(l, "       for {} ms", now.saturating_sub(since - 1));
        }
    }
    let _ = writeln!(
        l,
        "  tracked now {}, most seen {}",
        Size(support::SEEN_NATIVE.load(SeqCst)),
        Size(support::SEEN_MAX_NATIVE.load(SeqCst))
    );
}
