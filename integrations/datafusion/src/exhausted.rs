//! The text of a refusal: DataFusion's `ResourcesExhausted` message, with why memquota
//! refused, the largest consumers (as DataFusion's `TrackConsumersPool` lists them) and
//! memquota's report figures (the budget, the queries' scopes, jemalloc's view).

use crate::decide::{Refusal, Request};
use datafusion::execution::memory_pool::{human_readable_size, MemoryConsumer};
use std::fmt::Write;

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

/// The whole message.
pub(crate) fn message(
    consumer: &MemoryConsumer,
    holds: u64,
    request: &Request,
    why: Refusal,
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
                step => format!(", and {} for this spiller's next step", size(step)),
            }
        ),
        Refusal::Share { held, line, share } => write!(
            m,
            "memquota: the query would hold {} past {}, what its fair share of {} allows{}",
            size(held),
            size(line),
            size(share),
            if request.can_spill { " this spiller" } else { "" }
        ),
    };
    let _ = write!(m, "\nTop memory consumers (across reservations):\n{top}memquota's figures:\n");
    m.push_str(&memquota::report_now());
    m
}
