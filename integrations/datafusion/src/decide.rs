//! The pool's decision on one `try_grow`, as plain arithmetic over figures read
//! beforehand: what the process and the query's scope really hold (allocations and
//! reservations in one account, `max(allocated, reserved)` per scope) against the
//! limit and the query's fair share.
//!
//! Every request leaves a margin under the limit (and under the share) for what
//! DataFusion allocates without reserving it: batches in flight, a spill's sorted
//! copy, merge buffers being read; nothing refuses those, so the margin is what keeps
//! real memory under the limit. DataFusion's operators also mostly ask *after* they
//! allocated (a hash table doubles, then its reservation is resized), so a spiller
//! holding more than a little is refused while there is still room for its next step
//! of that size.

use memquota::ScopeAccount;

/// What the decision reads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Figures {
    /// The process budget's room under the limit (`memquota::budget`), 0 past it.
    pub(crate) headroom: u64,
    /// The limit.
    pub(crate) limit: u64,
    /// The query's scope, if the consumer was registered in one.
    pub(crate) scope: Option<ScopeAccount>,
}

/// The request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    /// Bytes asked for.
    pub(crate) additional: u64,
    /// Whether the consumer spills when refused.
    pub(crate) can_spill: bool,
    /// What this reservation holds already.
    pub(crate) held_by_reservation: u64,
    /// Whether the operator later copies what the reservation holds without reserving
    /// the copy ([`copies_what_it_holds`]).
    pub(crate) copies: bool,
}

/// Whether DataFusion's consumer `name` copies what it reserved, once, without
/// reserving the copy: a hash join's build side (`HashJoinInput`, `HashJoinInput[N]`)
/// collects its batches, reserving each, then concatenates them into one batch
/// (`concat_batches` in DataFusion 55's `collect_left_input`) before it drops them.
/// Measured: TPC-H query 21 at 1 GiB held 147 MiB past its reservations at that moment
/// (the concatenated copies of two build sides, by the allocation-site profile), where
/// every other operator of the 22 queries held at most 46 MiB unreserved
/// (docs/datafusion.md, "What DataFusion does not reserve").
pub(crate) fn copies_what_it_holds(name: &str) -> bool {
    name.starts_with("HashJoinInput")
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The process: `need` new bytes against `room` left under the limit, of which the
    /// request must leave `keep`: the margin, and for a spiller `step`, room for its
    /// next step (0: none).
    Process { need: u64, room: u64, keep: u64, step: u64 },
    /// The query's scope: it would hold `held` against `line` (its fair share less the
    /// margin, and for a spiller room for its next step).
    Share { held: u64, line: u64, share: u64 },
}

/// The margin under the limit every request leaves for what DataFusion allocates
/// without reserving it: a fraction of the limit (and of a query's share), at most
/// `cap` bytes, chosen by measurement (docs/datafusion.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Margin {
    pub(crate) fraction: f64,
    pub(crate) cap: u64,
}

impl Margin {
    pub(crate) fn of(self, bytes: u64) -> u64 {
        ((bytes as f64 * self.fraction) as u64).min(self.cap)
    }
}

/// A reservation of at most this part of the limit is not sent to spill: it would
/// free little, and DataFusion cannot spill some such phases (the second buffer of a
/// merge, the replay of spilled aggregates).
const SMALL: u64 = 32;

/// Grants or refuses `r`. A grant is only the decision: the caller then charges the
/// reservation to the scope, where it and the allocations it covers count once.
pub(crate) fn decide(f: &Figures, r: &Request, margin: Margin) -> Result<(), Refusal> {
    if r.additional == 0 {
        return Ok(());
    }
    // New bytes the account takes: outside a scope memquota cannot tell a reservation
    // from the allocations it covers, so all of it.
    let (need, held_after) = match f.scope {
        Some(s) => {
            let held_after = held_for(s.allocated, s.reserved.saturating_add(r.additional));
            (held_after.saturating_sub(s.held), Some(held_after))
        }
        None => (r.additional, None),
    };
    // 1. Every request leaves the margin under the limit and under the share: the
    //    memory between the line and the limit is for what DataFusion allocates without
    //    reserving it, which nothing refuses. Strictly under: at the line even a
    //    request its allocations already cover is refused, so an operator that
    //    reserves after allocating stops there.
    let margin_bytes = margin.of(f.limit);
    if need.saturating_add(margin_bytes) >= f.headroom {
        return Err(Refusal::Process { need, room: f.headroom, keep: margin_bytes, step: 0 });
    }
    let share_line = f.scope.map(|s| s.share.saturating_sub(margin.of(s.share)));
    if let (Some(s), Some(held), Some(line)) = (f.scope, held_after, share_line) {
        if held > line {
            return Err(Refusal::Share { held, line, share: s.share });
        }
    }
    // 2. A spiller holding more than a little also leaves room for its next step,
    //    which is at most what it holds (a hash table doubles); an operator that will
    //    copy what it holds, room for the copy.
    let own = r.held_by_reservation.saturating_add(r.additional);
    if !(r.can_spill || r.copies) || r.held_by_reservation == 0 || own <= f.limit / SMALL {
        return Ok(());
    }
    // A build side's copy is of what it collected before this request (its last
    // request is for its table, which is not copied). The copy comes on top of the
    // margin: the batches in flight the margin is for go on while it is made.
    let step = if r.copies { r.held_by_reservation } else { own };
    let keep = margin_bytes.saturating_add(step);
    if need.saturating_add(keep) >= f.headroom {
        return Err(Refusal::Process { need, room: f.headroom, keep, step });
    }
    if let (Some(s), Some(held), Some(line)) = (f.scope, held_after, share_line) {
        if held.saturating_add(step) > line {
            return Err(Refusal::Share { held, line: line.saturating_sub(step), share: s.share });
        }
    }
    Ok(())
}

/// A scope's charge for `allocated` and `reserved` bytes, as memquota computes it.
fn held_for(allocated: i64, reserved: u64) -> u64 {
    let allocated = u64::try_from(allocated).unwrap_or(0);
    allocated.max(reserved)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const M: Margin = Margin { fraction: 0.2, cap: u64::MAX };

    fn account(allocated: i64, reserved: u64, share: u64) -> ScopeAccount {
        let mut a = ScopeAccount::default();
        a.allocated = allocated;
        a.reserved = reserved;
        a.held = held_for(allocated, reserved);
        a.share = share;
        a
    }

    /// A query alone under a 100 MiB limit, the process holding what the scope holds.
    fn alone(allocated: i64, reserved: u64) -> Figures {
        let s = account(allocated, reserved, 100 * MIB);
        Figures { headroom: 100 * MIB - s.held, limit: 100 * MIB, scope: Some(s) }
    }

    fn spiller(additional: u64, holds: u64) -> Request {
        Request { additional, can_spill: true, held_by_reservation: holds, copies: false }
    }

    fn fixed(additional: u64) -> Request {
        Request { additional, can_spill: false, held_by_reservation: 0, copies: false }
    }

    fn build_side(additional: u64, holds: u64) -> Request {
        Request { additional, can_spill: false, held_by_reservation: holds, copies: true }
    }

    #[test]
    fn a_reservation_its_allocations_cover_costs_nothing() {
        // The scope allocated 40 MiB and reserved 10; 20 more are covered: no new
        // bytes, and 30 of its own + 20 margin fit the 60 left.
        let f = alone(40 << 20, 10 * MIB);
        assert_eq!(decide(&f, &fixed(20 * MIB), M), Ok(()));
        assert_eq!(decide(&f, &spiller(20 * MIB, 10 * MIB), M), Ok(()));
        // 35 more: 5 new, 45 its own + 20 margin >= 60 left: refused, it spills.
        assert_eq!(
            decide(&f, &spiller(35 * MIB, 10 * MIB), M),
            Err(Refusal::Process { need: 5 * MIB, room: 60 * MIB, keep: 65 * MIB, step: 45 * MIB })
        );
        // An unspillable consumer may take them: 5 + 20 < 60.
        assert_eq!(decide(&f, &fixed(35 * MIB), M), Ok(()));
    }

    #[test]
    fn a_spiller_leaves_room_for_its_next_doubling() {
        // A hash table of 16 MiB just doubled to 32 (already allocated), 60 MiB held:
        // another doubling would not fit with the margin, so it spills now.
        let f = alone(60 << 20, 16 * MIB);
        assert!(matches!(decide(&f, &spiller(16 * MIB, 16 * MIB), M), Err(Refusal::Process { need: 0, .. })));
        // At 30 MiB held the same step still leaves room for the next one.
        let f = alone(30 << 20, 16 * MIB);
        assert_eq!(decide(&f, &spiller(16 * MIB, 16 * MIB), M), Ok(()));
    }

    #[test]
    fn a_build_side_leaves_room_for_its_copy() {
        // 30 MiB collected and reserved: a table of 10 more, the copy of the 30 and the
        // margin fit in the 70 left.
        assert_eq!(decide(&alone(30 << 20, 30 * MIB), &build_side(10 * MIB, 30 * MIB), M), Ok(()));
        // At 40 MiB the table, the copy and the margin no longer fit the 60 left; a
        // consumer that makes no copy still gets the table's 10.
        assert_eq!(
            decide(&alone(40 << 20, 40 * MIB), &build_side(10 * MIB, 40 * MIB), M),
            Err(Refusal::Process { need: 10 * MIB, room: 60 * MIB, keep: 60 * MIB, step: 40 * MIB })
        );
        assert_eq!(decide(&alone(40 << 20, 40 * MIB), &fixed(10 * MIB), M), Ok(()));
        // Under a fair share of 50 the line is 40, less the copy.
        let s = account(20 << 20, 20 * MIB, 50 * MIB);
        let f = Figures { headroom: 80 * MIB, limit: 100 * MIB, scope: Some(s) };
        assert_eq!(
            decide(&f, &build_side(2 * MIB, 20 * MIB), M),
            Err(Refusal::Share { held: 22 * MIB, line: 20 * MIB, share: 50 * MIB })
        );
        assert_eq!(decide(&f, &fixed(2 * MIB), M), Ok(()));
    }

    #[test]
    fn the_margin_is_a_part_of_the_limit_up_to_its_cap() {
        let m = Margin { fraction: 0.2, cap: 64 * MIB };
        assert_eq!(m.of(100 * MIB), 20 * MIB);
        assert_eq!(m.of(1024 * MIB), 64 * MIB);
        // At 1 GiB a fixed request may come within 64 MiB of the limit, not 205.
        let f = Figures { headroom: 200 * MIB, limit: 1024 * MIB, scope: None };
        assert_eq!(decide(&f, &fixed(130 * MIB), m), Ok(()));
        assert!(decide(&f, &fixed(130 * MIB), M).is_err());
    }

    #[test]
    fn hash_join_build_sides_are_the_consumers_that_copy() {
        assert!(copies_what_it_holds("HashJoinInput"));
        assert!(copies_what_it_holds("HashJoinInput[1]"));
        assert!(!copies_what_it_holds("ExternalSorter[0]"));
        assert!(!copies_what_it_holds("GroupedHashAggregateStream[0]"));
    }

    #[test]
    fn past_the_line_everything_is_refused() {
        let f = Figures { headroom: 0, limit: 100 * MIB, scope: Some(account(120 << 20, 0, 100 * MIB)) };
        assert_eq!(
            decide(&f, &fixed(1), M),
            Err(Refusal::Process { need: 0, room: 0, keep: 20 * MIB, step: 0 })
        );
        assert!(decide(&f, &spiller(1, 0), M).is_err());
        assert!(decide(&f, &spiller(1, 10 * MIB), M).is_err());
        assert_eq!(decide(&f, &fixed(0), M), Ok(()), "nothing asked, nothing refused");
    }

    #[test]
    fn small_or_empty_reservations_are_not_sent_to_spill() {
        // 70 of 100 MiB held, 30 left, 10 of them above the margin: a merge's first
        // buffers (holding nothing) and a replay's small table (under 100/32) go on; a
        // spiller of 8 MiB leaves room for its next step and spills.
        let f = alone(70 << 20, 70 * MIB);
        assert_eq!(decide(&f, &spiller(4 * MIB, 0), M), Ok(()));
        assert_eq!(decide(&f, &spiller(MIB / 2, MIB / 2), M), Ok(()));
        assert!(decide(&f, &spiller(4 * MIB, 4 * MIB), M).is_err(), "4 + 20 + 8 >= 30");
        // In the margin every request is refused.
        let f = alone(85 << 20, 85 * MIB);
        assert!(decide(&f, &spiller(MIB / 2, 0), M).is_err());
        assert!(decide(&f, &fixed(MIB / 2), M).is_err());
    }

    #[test]
    fn the_fair_share_binds_every_request_and_spillers_before_it() {
        // Two queries share 100 MiB: 50 each. This one holds 20 MiB, reserved and
        // allocated, 10 of it in one spiller.
        let s = account(20 << 20, 20 * MIB, 50 * MIB);
        let f = Figures { headroom: 60 * MIB, limit: 100 * MIB, scope: Some(s) };
        // The spiller's line: 40 MiB (the share less 20%), less its next step.
        assert_eq!(decide(&f, &spiller(4 * MIB, 10 * MIB), M), Ok(()), "24 + 14 <= 40");
        assert_eq!(
            decide(&f, &spiller(8 * MIB, 10 * MIB), M),
            Err(Refusal::Share { held: 28 * MIB, line: 22 * MIB, share: 50 * MIB })
        );
        assert_eq!(decide(&f, &fixed(20 * MIB), M), Ok(()), "unspillable: the share less the margin");
        assert_eq!(
            decide(&f, &fixed(21 * MIB), M),
            Err(Refusal::Share { held: 41 * MIB, line: 40 * MIB, share: 50 * MIB })
        );
    }

    #[test]
    fn outside_a_scope_all_of_it_is_new() {
        let f = Figures { headroom: 30 * MIB, limit: 100 * MIB, scope: None };
        assert_eq!(decide(&f, &fixed(9 * MIB), M), Ok(()), "9 + 20 < 30");
        assert!(decide(&f, &fixed(10 * MIB), M).is_err());
        // 2 new + 20 margin + 12 its own >= 30.
        assert!(decide(&f, &spiller(2 * MIB, 10 * MIB), M).is_err());
        assert_eq!(decide(&f, &spiller(2 * MIB, 4 * MIB), M), Ok(()), "2 + 20 + 6 < 30");
    }
}
