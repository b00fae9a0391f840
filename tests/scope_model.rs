//! Property test of the scope pool against a model: random programs of begin / end /
//! reserve (exact or partial) / release / cap / allocate and free big blocks while
//! attached, and small blocks allocated outside any scope and freed in one, run
//! through a `QuotaAlloc` over `System` on one thread (this binary's global allocator
//! is the plain system one, so the only charges are the program's). After every step
//! each scope's allocated, reserved and held bytes, and the process total, equal the
//! model's exactly. The rule for frees: a scope's use never goes below zero, what is
//! freed past it is credited to the process.

use memquota::{MemoryManager, QuotaAlloc, Reservation, TaskScope};
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::time::Duration;

static QUOTA: QuotaAlloc<System> = QuotaAlloc::wrap(System);
const MIB: u64 = 1 << 20;
const POOL: i64 = 64 << 20;

#[derive(Clone, Debug)]
enum Op {
    Begin,
    End(usize),
    Reserve(usize, u64, bool),
    Release(usize),
    Cap(usize, Option<u64>),
    Alloc(usize, u64),
    Free(usize),
    /// A small block (no owner record) allocated outside any scope.
    Outside(u64),
    /// One freed by a thread attached to a scope.
    FreeOutside(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let mib = 1u64..40;
    prop_oneof![
        2 => Just(Op::Begin),
        1 => any::<usize>().prop_map(Op::End),
        4 => (any::<usize>(), mib.clone(), any::<bool>()).prop_map(|(i, m, p)| Op::Reserve(i, m * MIB, p)),
        2 => any::<usize>().prop_map(Op::Release),
        1 => (any::<usize>(), proptest::option::of(mib.clone())).prop_map(|(i, c)| Op::Cap(i, c.map(|m| m * MIB))),
        3 => (any::<usize>(), 2u64..9).prop_map(|(i, m)| Op::Alloc(i, m * MIB)),
        2 => any::<usize>().prop_map(Op::Free),
        2 => (1u64..8).prop_map(|k| Op::Outside(k * (256 << 10))),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(i, k)| Op::FreeOutside(i, k)),
    ]
}

struct Model {
    used: i64,
    reserved: i64,
    cap: i64,
    /// It has held memory or had a thread attached.
    started: bool,
}

impl Model {
    fn held(&self) -> i64 {
        held_for(self.used, self.reserved)
    }
}

/// A scope's charge: its use never goes below zero ([`credit`]).
fn held_for(used: i64, reserved: i64) -> i64 {
    used.max(reserved)
}

/// A free of `size` bytes credited to a scope that used `used`: its use goes down to
/// zero at most; what was never its is the process's.
fn credit(used: &mut i64, size: u64) {
    *used -= (size as i64).min(*used);
}

fn layout(size: u64) -> Layout {
    Layout::from_size_align(size as usize, 8).unwrap()
}

fn native() -> i64 {
    memquota::flush_thread();
    memquota::stats().native as i64
}

fn check(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mm = MemoryManager::global();
    mm.set_pool(POOL as u64);
    mm.set_wait(Duration::ZERO);
    memquota::set_report_hook(|_| {}); // refusals are expected
    let base = native();
    let mut scopes: Vec<(TaskScope, Model, Vec<Reservation>)> = Vec::new();
    // Each block with the raw handle of the scope that allocated it.
    let mut blocks: Vec<(*mut u8, u64, u64)> = Vec::new();
    let mut outside: Vec<(*mut u8, u64)> = Vec::new();
    for op in ops {
        let n = scopes.len();
        let room = |scopes: &Vec<(TaskScope, Model, Vec<Reservation>)>, i: usize| {
            let sum: i64 = scopes.iter().map(|s| s.1.held()).sum();
            let m = &scopes[i].1;
            // Sharing the pool: every scope but those idle after they started work
            // (holding nothing; no thread stays attached here between steps), and the
            // one asking.
            let idle = |m: &Model| m.started && m.held() <= 0;
            let sharing = scopes.iter().enumerate().filter(|(j, s)| *j == i || !idle(&s.1)).count();
            let own = (POOL / sharing as i64).min(m.cap) - m.held().max(0);
            own.min(POOL - sum.max(0)).max(0)
        };
        match op {
            Op::Begin if n < 6 => {
                let s = mm.begin("model", n as u64, 0).unwrap();
                scopes.push((s, Model { used: 0, reserved: 0, cap: i64::MAX, started: false }, Vec::new()));
            }
            Op::End(i) if n > 0 => {
                let (s, m, rs) = scopes.remove(i % n);
                let report = s.end();
                prop_assert_eq!(report.leaked_bytes as i64, m.used.max(0));
                drop(rs); // releasing into an ended scope changes nothing
            }
            Op::Reserve(i, bytes, partial) if n > 0 => {
                let i = i % n;
                let r = room(&scopes, i);
                let m = &scopes[i].1;
                let need = held_for(m.used, m.reserved + bytes as i64) - m.held();
                let covered = (m.used.max(0) - m.reserved).max(0);
                let expect = if need <= r {
                    bytes as i64
                } else if partial {
                    (covered + r).min(bytes as i64)
                } else {
                    0
                };
                let got = if partial { scopes[i].0.reserve_up_to(bytes) } else { scopes[i].0.reserve(bytes) };
                match got {
                    Ok(res) => {
                        prop_assert_eq!(res.bytes() as i64, expect);
                        scopes[i].1.reserved += expect;
                        scopes[i].2.push(res);
                    }
                    Err(_) => prop_assert_eq!(expect, 0),
                }
            }
            Op::Release(i) if n > 0 => {
                let i = i % n;
                if let Some(r) = scopes[i].2.pop() {
                    scopes[i].1.reserved -= r.bytes() as i64;
                }
            }
            Op::Cap(i, cap) if n > 0 => {
                let i = i % n;
                scopes[i].0.set_cap(cap);
                scopes[i].1.cap = cap.map_or(i64::MAX, |c| c as i64);
            }
            Op::Alloc(i, size) if n > 0 => {
                let i = i % n;
                let r = room(&scopes, i);
                let m = &scopes[i].1;
                let fits = held_for(m.used + size as i64, m.reserved) - m.held() <= r;
                let g = scopes[i].0.attach().unwrap();
                scopes[i].1.started = true;
                // SAFETY: a non-zero size.
                let p = unsafe { QUOTA.alloc(layout(size)) };
                drop(g);
                prop_assert_eq!(!p.is_null(), fits);
                if fits {
                    scopes[i].1.used += size as i64;
                    blocks.push((p, size, scopes[i].0.handle().as_raw()));
                }
            }
            Op::Free(k) if !blocks.is_empty() => {
                let (p, size, owner) = blocks.swap_remove(k % blocks.len());
                // SAFETY: `p` came from QUOTA.alloc with this layout.
                unsafe { QUOTA.dealloc(p, layout(size)) };
                // Freed here, in no scope: the owner record credits the scope that
                // allocated it, if it still runs.
                if let Some(s) = scopes.iter_mut().find(|s| s.0.handle().as_raw() == owner) {
                    credit(&mut s.1.used, size);
                }
            }
            Op::Outside(size) => {
                // SAFETY: a non-zero size.
                let p = unsafe { QUOTA.alloc(layout(size)) };
                prop_assert!(!p.is_null());
                outside.push((p, size));
            }
            Op::FreeOutside(i, k) if n > 0 && !outside.is_empty() => {
                let i = i % n;
                let (p, size) = outside.swap_remove(k % outside.len());
                let g = scopes[i].0.attach().unwrap();
                scopes[i].1.started = true;
                // SAFETY: `p` came from QUOTA.alloc with this layout.
                unsafe { QUOTA.dealloc(p, layout(size)) };
                drop(g);
                credit(&mut scopes[i].1.used, size);
            }
            _ => {}
        }
        let mut unused = 0;
        for (s, m, _) in &mut scopes {
            m.started |= m.held() > 0;
            let st = s.stats().unwrap();
            prop_assert_eq!(
                (st.allocated, st.reserved as i64, st.held as i64),
                (m.used, m.reserved, m.held())
            );
            unused += m.held() - m.used;
        }
        let live: i64 = blocks.iter().map(|b| b.1 as i64).chain(outside.iter().map(|b| b.1 as i64)).sum();
        prop_assert_eq!(native() - base, live + unused);
    }
    for (s, _, rs) in scopes.drain(..) {
        drop(rs);
        s.end();
    }
    for (p, size, _) in blocks {
        // SAFETY: as above.
        unsafe { QUOTA.dealloc(p, layout(size)) };
    }
    for (p, size) in outside {
        // SAFETY: as above.
        unsafe { QUOTA.dealloc(p, layout(size)) };
    }
    prop_assert_eq!(native(), base);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn scopes_match_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        check(ops)?;
    }
}
