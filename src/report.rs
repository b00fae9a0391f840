//! The OOM report: built in a fixed buffer on the stack, with no heap allocation, and
//! handed to a replaceable hook (default: stderr).

use crate::config::{HeapMode, OnOom};
use crate::gc::{ReclaimKind, ReclaimRecord, Throttle, HISTORY};
use crate::stats::Stats;
use crate::sync::{lock, Mutex};
use std::fmt::{self, Write};
use std::time::Instant;

/// Bytes a report may take; longer text is cut.
pub const REPORT_CAPACITY: usize = 4096;

/// A receiver of OOM reports. Called on the refusing thread, inside the allocator:
/// it may allocate (that is charged, never refused), must not panic, and should be
/// quick.
pub type ReportHook = fn(&str);

static HOOK: Mutex<ReportHook> = Mutex::new(write_stderr);
static LAST: Mutex<FixedBuf> = Mutex::new(FixedBuf::new());

/// Replaces the report hook; returns the previous one.
pub fn set_report_hook(hook: ReportHook) -> ReportHook {
    std::mem::replace(&mut *lock(&HOOK), hook)
}

/// The default hook: one `write(2)` per chunk to standard error, no buffering, no
/// allocation.
pub fn write_stderr(report: &str) {
    let mut bytes = report.as_bytes();
    while !bytes.is_empty() {
        // SAFETY: the pointer and length describe the live `bytes` slice.
        let n = unsafe { libc::write(libc::STDERR_FILENO, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

/// Releases the report locks in a `fork` child.
///
/// # Safety
/// As [`unlock_in_fork_child`](crate::sync::unlock_in_fork_child).
pub(crate) unsafe fn after_fork_child() {
    // SAFETY: forwarded contract.
    unsafe {
        crate::sync::unlock_in_fork_child(&HOOK);
        crate::sync::unlock_in_fork_child(&LAST);
    }
}

/// The most recent OOM report, if any allocation was refused.
pub fn last_report() -> Option<String> {
    let last = lock(&LAST);
    (!last.as_str().is_empty()).then(|| last.as_str().to_owned())
}

/// What the report needs to know about the refusal.
pub(crate) struct Refusal {
    pub(crate) requested: u64,
    pub(crate) stats: Stats,
    pub(crate) history: [Option<ReclaimRecord>; HISTORY],
    pub(crate) throttle: Option<Throttle>,
    pub(crate) has_reclaimer: bool,
    pub(crate) policy: OnOom,
}

/// Hands a short notice (a scope's leak, a callback that reserved) to the hook,
/// formatted in a fixed buffer.
pub(crate) fn note(args: fmt::Arguments<'_>) {
    let mut buf = FixedBuf::new();
    let _ = buf.write_fmt(args);
    let hook = *lock(&HOOK);
    hook(buf.as_str());
}

/// Writes the report and hands it to the hook.
pub(crate) fn emit(refusal: &Refusal) {
    let mut buf = FixedBuf::new();
    let _ = write_report(&mut buf, refusal);
    *lock(&LAST) = buf;
    let hook = *lock(&HOOK);
    hook(buf.as_str());
}

fn write_report(w: &mut impl Write, r: &Refusal) -> fmt::Result {
    let s = &r.stats;
    let counted = match s.heap_mode {
        HeapMode::Committed => "committed",
        HeapMode::Used => "used",
    };
    writeln!(w, "memquota: allocation refused: {} requested", Size(r.requested))?;
    writeln!(w, "  limit            {}  (soft threshold {})", Size(s.limit), Size(s.soft_limit))?;
    writeln!(
        w,
        "  native tracked   {}  (peak {}, +/- {} unflushed)",
        Size(s.native),
        Size(s.native_peak),
        Size(s.error_bound)
    )?;
    writeln!(w, "  heap committed   {}", Size(s.heap.committed))?;
    writeln!(w, "  heap used        {}  (counted: {counted})", Size(s.heap.used))?;
    writeln!(w, "  headroom         {}", Size(s.headroom))?;
    writeln!(
        w,
        "  reclaims         {} sync, {} background, {} panicked, {} throttled; freed {} in all",
        s.reclaims_sync,
        s.reclaims_background,
        s.reclaim_panics,
        s.reclaims_throttled,
        Size(s.reclaimed_bytes)
    )?;
    if !r.has_reclaimer {
        writeln!(w, "  no reclaim callback is registered (memquota::on_reclaim)")?;
    }
    match r.throttle {
        Some(Throttle::Suspended) => {
            writeln!(w, "  reclaims are suspended: the recent ones freed too little")?
        }
        Some(Throttle::RateLimited) => writeln!(w, "  a reclaim ran moments ago; its result stands")?,
        None => {}
    }
    let now = Instant::now();
    for rec in r.history.iter().flatten() {
        let kind = match rec.kind {
            ReclaimKind::Sync => "sync",
            ReclaimKind::Background => "background",
        };
        writeln!(
            w,
            "    {kind:<10} asked {}  freed {}  took {} ms  {} ms ago{}",
            Size(rec.need),
            Size(rec.freed),
            rec.took.as_millis(),
            now.saturating_duration_since(rec.ended).as_millis(),
            if rec.panicked { "  (callback panicked)" } else { "" }
        )?;
    }
    crate::scope::write_tree(w)?;
    let j = &s.jemalloc;
    writeln!(
        w,
        "  jemalloc         allocated {}  active {}  resident {}",
        Size(j.allocated),
        Size(j.active),
        Size(j.resident)
    )?;
    match r.policy {
        OnOom::Null => {
            writeln!(w, "  policy           null: the allocation returns null (MEMQUOTA_ON_OOM=abort aborts)")
        }
        OnOom::Abort => writeln!(w, "  policy           abort"),
    }
}

/// A byte count shown as `1.5 GiB (1610612736)`.
pub(crate) struct Size(pub(crate) u64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let b = self.0;
        if b == u64::MAX {
            return f.write_str("unlimited");
        }
        let mut unit = 0;
        while unit + 1 < UNITS.len() && b >> (10 * (unit + 1)) > 0 {
            unit += 1;
        }
        if unit == 0 {
            write!(f, "{b} B")
        } else {
            // Tenths in integers: float formatting would do too, this is exact.
            let scaled = (b as u128 * 10) >> (10 * unit);
            write!(f, "{}.{} {} ({b})", scaled / 10, scaled % 10, UNITS[unit])
        }
    }
}

/// A fixed-capacity text buffer: `fmt::Write` without a heap. Text past the capacity
/// is dropped at a character boundary.
#[derive(Clone, Copy)]
pub(crate) struct FixedBuf {
    bytes: [u8; REPORT_CAPACITY],
    len: usize,
}

impl FixedBuf {
    pub(crate) const fn new() -> FixedBuf {
        FixedBuf { bytes: [0; REPORT_CAPACITY], len: 0 }
    }

    pub(crate) fn as_str(&self) -> &str {
        // Only whole `str` pieces cut at char boundaries are ever copied in.
        std::str::from_utf8(&self.bytes[..self.len]).unwrap_or("")
    }
}

impl Write for FixedBuf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = REPORT_CAPACITY - self.len;
        let mut take = s.len().min(room);
        while !s.is_char_boundary(take) {
            take -= 1;
        }
        self.bytes[self.len..self.len + take].copy_from_slice(&s.as_bytes()[..take]);
        self.len += take;
        if take < s.len() {
            Err(fmt::Error)
        } else {
            Ok(())
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_well() {
        assert_eq!(Size(512).to_string(), "512 B");
        assert_eq!(Size(1536).to_string(), "1.5 KiB (1536)");
        assert_eq!(Size(8 << 30).to_string(), "8.0 GiB (8589934592)");
        assert_eq!(Size(u64::MAX).to_string(), "unlimited");
    }

    #[test]
    fn fixed_buf_truncates_at_char_boundary() {
        let mut b = FixedBuf::new();
        let long = "é".repeat(REPORT_CAPACITY);
        assert!(b.write_str(&long).is_err());
        assert_eq!(b.as_str().len(), REPORT_CAPACITY);
        assert!(b.as_str().chars().all(|c| c == 'é'));
    }
}
