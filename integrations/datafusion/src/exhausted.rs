//! The text of a refusal: DataFusion's `ResourcesExhausted` message, with why memquota
//! refused, the queries (what each holds against its fair share, and for whom one gives
//! way), the largest consumers (as DataFusion's `TrackConsumersPool` lists them), the
//! query's unreserved bytes by site (with memquota's allocation-site profile on) and
//! memquota's report figures (the budget, the queries' scopes, jemalloc's view).

use crate::decide::{Refusal, Request};
use crate::room::Query;
use datafusion::execution::memory_pool::{human_readable_size, MemoryConsumer};
use std::fmt::Write;
use std::time::Duration;

/// Consumers listed in a refusal.
const TOP: usize = 5;

/// One consumer, for the list.
pub(crate) struct Line<'a> {
    pub(crate) id: usize,
    pub(crate) name: &'a str,
    pub(crate) can_spill: bool,
    pub(crate) reserved: u64,
    pub(crate) peak: u64,
}

fn size(bytes: u64) -> String {
    human_readable_size(usize::try_from(bytes).unwrap_or(usize::MAX))
}

/// The largest consumers by what they reserve now, one a line.
pub(crate) fn top_consumers<'a>(lines: impl Iterator<Item = Line<'a>>) -> String {
    let mut all: Vec<Line<'a>> = lines.collect();
    all.sort_by(|a, b| b.reserved.cmp(&a.reserved).then(a.id.cmp(&b.id)));
    let mut out = String::new();
    for l in all.iter().take(TOP) {
        let _ = writeln!(
            out,
            "  {}#{}(can spill: {}) consumed {}, peak {}",
            l.name,
            l.id,
            l.can_spill,
            size(l.reserved),
            size(l.peak)
        );
    }
    out
}

/// The query's unreserved bytes by site (`ScopeHandle::unreserved_sites`' lines), under
/// a heading that says how to read them; nothing when no such allocation was sampled.
pub(crate) fn unreserved(sites: &str) -> String {
    if sites.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "Unreserved bytes of this query by site (live, allocated while the query held more than it \
         reserved; estimated from memquota's profile, frames innermost first, OBJECT+ADDR for \
         addr2line -f -e OBJECT ADDR):\n",
    );
    for line in sites.lines() {
        let _ = writeln!(out, "  {line}");
    }
    out
}

/// The queries, heaviest past its share first, one a line; `this` is the refused
/// request's.
pub(crate) fn queries(all: &[Query], this: Option<u64>) -> String {
    let mut sorted: Vec<&Query> = all.iter().collect();
    sorted.sort_by(|a, b| b.over().cmp(&a.over()).then(b.held.cmp(&a.held)).then(a.handle.cmp(&b.handle)));
    let mut out = String::new();
    for q in sorted {
        let _ = writeln!(
            out,
            "  query \"{}\" holds {} of its fair share {}{}{}",
            q.name,
            size(q.held),
            size(q.share),
            if q.over() > 0 { format!(", {} over it", size(q.over())) } else { String::new() },
            if Some(q.handle) == this { " (this request's)" } else { "" }
        );
    }
    out
}

fn named(all: &[Query], scope: u64) -> (&str, u64, u64) {
    all.iter().find(|q| q.handle == scope).map_or(("?", 0, 0), |q| (q.name.as_str(), q.held, q.share))
}

/// Why a query over its share is refused after `waiter` waited for it: it gives way.
pub(crate) fn giving_way(all: &[Query], scope: u64, waiter: &str, fails: bool) -> String {
    let (name, held, share) = named(all, scope);
    format!(
        "; query \"{name}\" holds {}, past its fair share of {}, and query \"{waiter}\" waited for \
         room: {}",
        size(held),
        size(share),
        if fails {
            "the query furthest over its share gives way and fails"
        } else {
            "this spiller is asked to spill"
        }
    )
}

/// Why a query under its share fails after waiting for room.
pub(crate) fn waited_in_vain(all: &[Query], scope: u64, waited: Duration) -> String {
    let (name, held, share) = named(all, scope);
    format!(
        "; query \"{name}\" (holding {} of its fair share {}) waited {:.1} s for the queries over \
         their share to make room, in vain",
        size(held),
        size(share),
        waited.as_secs_f64()
    )
}

/// The whole message: `note` follows the reason, `queries` comes before the consumers.
pub(crate) fn message(
    consumer: &MemoryConsumer,
    holds: u64,
    request: &Request,
    why: Refusal,
    note: &str,
    queries: &str,
    top: &str,
) -> String {
    let mut m = format!(
        "Failed to allocate additional {} for {} with {} already allocated for this reservation - ",
        size(request.additional),
        consumer.name(),
        size(holds),
    );
    let _ = match why {
        Refusal::Process { need, room, .. } if need >= room => write!(
            m,
            "memquota: the process would pass its limit ({} new, {} left under it)",
            size(need),
            size(room)
        ),
        Refusal::Process { need, room, keep, step } => write!(
            m,
            "memquota: {} new, {} left under the limit, of which {} stays free (the margin for \
             memory DataFusion does not reserve{})",
            size(need),
            size(room),
            size(keep),
            match step {
                0 => String::new(),
                step if request.copies => format!(", and {} for the copy this build side makes", size(step)),
                step => format!(", and {} for this spiller's next step", size(step)),
            }
        ),
        Refusal::Share { held, line, share } => write!(
            m,
            "memquota: the query would hold {} past {}, what its fair share of {} allows{}",
            size(held),
            size(line),
            size(share),
            if request.can_spill {
                " this spiller"
            } else if request.copies {
                " this build side and its copy"
            } else {
                ""
            }
        ),
    };
    m.push_str(note);
    if !queries.is_empty() {
        let _ = write!(m, "\nQueries (held against the fair share):\n{}", queries.trim_end_matches('\n'));
    }
    let _ = write!(m, "\nTop memory consumers (across reservations):\n{top}memquota's figures:\n");
    m.push_str(&memquota::report_now());
    m
}
