//! Sample tags: what the profile's stack hook learns of the allocating thread's scope
//! without the pool's lock. The hook runs inside jemalloc for a sampled allocation; it
//! may take no lock a callback can hold and allocate nothing, so the pool publishes,
//! under its lock, one word per scope slot and per budget slot that the hook reads
//! with a load: the tag of the slot's owner (its slot, the low bits of its generation,
//! whether its allocations now go past what its reservations cover) and the owner's
//! generation, so that a thread's stale handle tags nothing.
//!
//! A tag is below 4096, an address no code lies at: the hook appends it as the
//! stack's last frame, and a reader of the dump tells it from a return address by that
//! alone (docs/design.md, "Allocation sites").

use super::budget::{Entry, FIRST_INDEX, MAX_BUDGETS};
use super::pool::{Scope, MAX_SCOPES};
use crate::base::sync::{AtomicU32, Ordering::Relaxed};

/// A tag's bit for "past what the reservations cover".
const UNRESERVED: u16 = 1 << 8;
/// Of a tag, the scope's slot and its generation's low bits: the scope it names.
const SCOPE_MASK: u16 = 0xff | (3 << 9);

/// Per scope slot: `generation << 16 | tag` of its live scope, 0 when free.
static SCOPES: [AtomicU32; MAX_SCOPES] = [const { AtomicU32::new(0) }; MAX_SCOPES];
/// Per budget slot: `generation << 16 | tag` of its scope, the unreserved bit its own
/// (its threads allocate past its grant), 0 when free.
static BUDGETS: [AtomicU32; MAX_BUDGETS] = [const { AtomicU32::new(0) }; MAX_BUDGETS];

/// The tag of the scope in slot `index` of generation `gen`, `unreserved` or not:
/// `1 + (slot | unreserved << 8 | (gen & 3) << 9)`, in 1..=2048, never 0.
pub(crate) fn tag(index: usize, gen: u64, unreserved: bool) -> u16 {
    1 + ((index as u16 & 0xff) | if unreserved { UNRESERVED } else { 0 } | ((gen & 3) as u16) << 9)
}

/// A tag's scope (its slot and generation bits, without the unreserved bit), and
/// whether the allocation went past the scope's reservations. `None` for 0 and for
/// anything that is no tag.
pub fn decode(tag: u64) -> Option<(u16, bool)> {
    if tag == 0 || tag > 2048 {
        return None;
    }
    let t = (tag - 1) as u16;
    Some((t & SCOPE_MASK, t & UNRESERVED != 0))
}

/// The scope part of the tags of the scope in slot `index` of generation `gen`, as
/// [`decode`] returns it.
pub(crate) fn scope_part(index: usize, gen: u64) -> u16 {
    (tag(index, gen, false) - 1) & SCOPE_MASK
}

fn word(gen: u64, tag: u16) -> u32 {
    ((gen as u32 & 0xffff) << 16) | u32::from(tag)
}

/// Publishes the tag of the scope in slot `index` (`None`: the slot is free). Under
/// the pool's lock. Its allocations go past its reservations when its own use (what
/// its budgets' threads allocate aside) exceeds what it reserved.
pub(super) fn publish_scope(index: usize, s: Option<&Scope>) {
    let w = s.map_or(0, |s| {
        let own = s.used.saturating_sub(s.in_budgets);
        word(s.gen, tag(index, s.gen, own > s.reserved))
    });
    if let Some(slot) = SCOPES.get(index) {
        if slot.load(Relaxed) != w {
            slot.store(w, Relaxed);
        }
    }
}

/// Publishes the tag of the budget in slot `slot` (`None`: free), drawn from the scope
/// in slot `index` of generation `scope_gen`. A live budget's threads allocate past its
/// reservation once its use passes its grant; a draining one's blocks are its scope's,
/// and take `scope_unreserved`.
pub(super) fn publish_budget(
    slot: usize,
    b: Option<&Entry>,
    index: usize,
    scope_gen: u64,
    scope_unreserved: bool,
) {
    let w = b.filter(|b| !b.free()).map_or(0, |b| {
        let unreserved = if b.live { b.used > b.granted } else { scope_unreserved };
        word(b.gen, tag(index, scope_gen, unreserved))
    });
    if let Some(s) = BUDGETS.get(slot) {
        if s.load(Relaxed) != w {
            s.store(w, Relaxed);
        }
    }
}

/// The tag of a thread in scope or budget `handle` (0: none) now, 0 if none: one load,
/// no lock, for the stack hook.
#[inline]
pub(crate) fn sample_tag(handle: u64) -> u16 {
    if handle == 0 {
        return 0;
    }
    let index = (handle & 0xffff) as usize;
    let slot = if index >= FIRST_INDEX { BUDGETS.get(index - FIRST_INDEX) } else { SCOPES.get(index) };
    let w = slot.map_or(0, |s| s.load(Relaxed));
    if w == 0 || u64::from(w >> 16) != (handle >> 16) & 0xffff {
        return 0;
    }
    w as u16
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn tags_are_below_a_page_and_decode_to_their_scope() {
        for index in [0, 1, 255] {
            for gen in [1, 2, 3, 4, 1 << 40] {
                for unreserved in [false, true] {
                    let t = tag(index, gen, unreserved);
                    assert!((1..4096).contains(&t), "{t}");
                    assert_eq!(decode(u64::from(t)), Some((scope_part(index, gen), unreserved)));
                }
            }
        }
        assert_ne!(scope_part(3, 1), scope_part(3, 2), "a slot's next scope is told apart");
        assert_eq!(decode(0), None);
        assert_eq!(decode(4096), None);
    }
}
