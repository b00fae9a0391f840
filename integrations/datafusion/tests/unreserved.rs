//! Unreserved bytes by site (issue 32, item 4): a query whose operator of our own
//! allocates without reserving shows those bytes at that operator's site, in the
//! query's `unreserved_sites` and in the pool's `ResourcesExhausted`; an operator that
//! reserves before it allocates does not. In a child process of its own (the budget
//! and the profile are process-wide), with memquota's profile sampling one per 16 KiB
//! (`Config::profile_sample`; the package's `profile` feature builds jemalloc able to
//! profile). The child prints what it saw; the parent names the frames with
//! `addr2line`, as a user would.
//!
//! The operator is a source: one batch of one row, made after it allocated. It holds
//! what it allocated until the test drops it, so the memory is live when the profile
//! is read.

mod harness;

use harness::Seen;
use memquota_datafusion::datafusion;
use memquota_datafusion::{MemquotaPool, QueryScope};

use datafusion::arrow::array::{ArrayRef, Int64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::catalog::streaming::StreamingTable;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::prelude::{SessionConfig, SessionContext};
use std::hint::black_box;
use std::process::Command;
use std::sync::{Arc, Mutex};

#[global_allocator]
static GLOBAL: memquota::QuotaAlloc = memquota::QuotaAlloc::new();

const MIB: u64 = 1 << 20;
const BLOCK: usize = 64 << 10;

fn main() {
    harness::main(child, &[("an_operator_that_does_not_reserve_shows_at_its_site", &check)]);
}

/// Blocks the operator allocates without reserving them. The package is built
/// without debug information, so `addr2line` names a frame by its symbol: the
/// `black_box` after the call keeps it from being a tail call, which would leave this
/// function out of the stack.
#[inline(never)]
fn unreserved_site(bytes: u64) -> Vec<Vec<u8>> {
    black_box((0..bytes / BLOCK as u64).map(|_| black_box(vec![7u8; BLOCK])).collect())
}

/// Blocks the operator allocates inside what it reserved.
#[inline(never)]
fn reserved_site(bytes: u64) -> Vec<Vec<u8>> {
    black_box((0..bytes / BLOCK as u64).map(|_| black_box(vec![8u8; BLOCK])).collect())
}

/// What the operator holds: its blocks and its reservations.
#[derive(Default)]
struct Held {
    blocks: Vec<Vec<Vec<u8>>>,
    reservations: Vec<MemoryReservation>,
}

/// The operator: reserves `reserve` and allocates `reserved` bytes inside it, then
/// allocates `unreserved` bytes without reserving, then asks for `ask` bytes more (a
/// consumer that cannot spill): refused, that fails the query.
#[derive(Debug)]
struct Allocating {
    schema: SchemaRef,
    reserve: u64,
    reserved: u64,
    unreserved: u64,
    ask: u64,
    held: Arc<Mutex<Held>>,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} block lists", self.blocks.len())
    }
}

impl Allocating {
    fn run(&self, ctx: &TaskContext) -> Result<RecordBatch> {
        let pool = ctx.memory_pool();
        let mut held = self.held.lock().unwrap();
        let reservation = MemoryConsumer::new("Allocating").register(pool);
        reservation.try_grow(self.reserve as usize)?;
        held.reservations.push(reservation);
        held.blocks.push(reserved_site(self.reserved));
        held.blocks.push(unreserved_site(self.unreserved));
        let more = MemoryConsumer::new("Allocating, more").register(pool);
        more.try_grow(self.ask as usize)?;
        held.reservations.push(more);
        let column: ArrayRef = Arc::new(Int64Array::from(vec![1]));
        Ok(RecordBatch::try_new(Arc::clone(&self.schema), vec![column])?)
    }
}

impl PartitionStream for Allocating {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let me = Allocating { schema: Arc::clone(&self.schema), held: Arc::clone(&self.held), ..*self };
        let batch = futures::stream::once(async move { me.run(&ctx) });
        Box::pin(RecordBatchStreamAdapter::new(Arc::clone(&self.schema), batch))
    }
}

/// The child: 128 MiB. A query reserves 32 MiB and allocates 24 MiB inside it, then
/// 48 MiB without reserving, then asks to reserve 112 MiB more, which does not fit (a
/// reservation covers the allocations past the others first: the query would hold
/// 144 MiB).
fn child(_case: &str, limit_mib: u64) -> Result<()> {
    memquota::init(memquota::Config::new().limit(limit_mib * MIB).profile_sample(16 << 10)).expect("a limit");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let pool = Arc::new(MemquotaPool::new());
    let ctx = SessionContext::new_with_config_rt(
        SessionConfig::new(),
        RuntimeEnvBuilder::new().with_memory_pool(pool).build_arc()?,
    );
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
    let held = Arc::new(Mutex::new(Held::default()));
    let op = Allocating {
        schema: Arc::clone(&schema),
        reserve: 32 * MIB,
        reserved: 24 * MIB,
        unreserved: 48 * MIB,
        ask: 112 * MIB,
        held: Arc::clone(&held),
    };
    let table = Arc::new(StreamingTable::try_new(schema, vec![Arc::new(op) as Arc<dyn PartitionStream>])?);
    let scope = QueryScope::begin("allocating")?;
    let failed = runtime.block_on(scope.run(async { ctx.read_table(table)?.collect().await }));
    match failed.as_ref().map_err(DataFusionError::find_root) {
        Err(DataFusionError::ResourcesExhausted(message)) => {
            for line in message.lines() {
                println!("message {line}");
            }
        }
        Err(e) => println!("other-error {}", e.to_string().replace('\n', " | ")),
        Ok(_) => println!("completed"),
    }
    // What the operator allocated is still live: the scope's own figures.
    for line in scope.handle().unreserved_sites().unwrap_or_default().lines() {
        println!("unreserved {line}");
    }
    for line in memquota::report_now().lines() {
        println!("report {line}");
    }
    drop(held);
    let _ = scope.end();
    Ok(())
}

/// A site line: its unreserved bytes (the first figure in parentheses) and its frames
/// named by `addr2line -f -i`.
fn site(line: &str) -> (u64, Vec<String>) {
    let bytes = line.split(['(', ')']).nth(1).and_then(|b| b.parse().ok()).expect("bytes in parentheses");
    let frames = line.split_once(" live ").expect("frames after ' live '").1;
    let mut object = String::new();
    let mut names = Vec::new();
    for frame in frames.split("<-").map(str::trim) {
        let (obj, addr) = frame.rsplit_once('+').expect("OBJECT+ADDR");
        if !obj.is_empty() {
            object = obj.to_string();
        }
        let out = Command::new("addr2line")
            .args(["-f", "-i", "-C", "-e", &object, addr])
            .output()
            .expect("addr2line");
        names.extend(String::from_utf8_lossy(&out.stdout).lines().step_by(2).map(str::to_string));
    }
    (bytes, names)
}

/// The sites of `lines` that name `function`, with their unreserved bytes.
fn naming(lines: &[&str], function: &str) -> Vec<u64> {
    lines
        .iter()
        .map(|l| site(l))
        .filter(|(_, names)| names.iter().any(|n| n.contains(function)))
        .map(|(b, _)| b)
        .collect()
}

fn check() {
    let (seen, _) = harness::run_child("allocating", 128);
    let seen: &Seen = &seen;
    println!("{}", seen.text);
    assert!(seen.all("completed").is_empty() && seen.all("other-error").is_empty(), "{}", seen.text);
    // The pool's error: the query's unreserved bytes, at the operator's site.
    let message = seen.all("message");
    let at =
        message.iter().position(|l| l.starts_with("Unreserved bytes of this query")).unwrap_or_else(|| {
            panic!("the error names the query's unreserved bytes:\n{}", seen.text);
        });
    let in_error: Vec<&str> = message[at + 1..].iter().take_while(|l| l.starts_with("  ")).copied().collect();
    let from_scope = seen.all("unreserved");
    for lines in [&in_error, &from_scope] {
        let unreserved = naming(lines, "::unreserved_site");
        assert_eq!(unreserved.len(), 1, "unreserved_site named once in {lines:?}\n{}", seen.text);
        // Of its 48 MiB, the first 8 went under what the query had reserved and not
        // used (32 MiB reserved, 24 used): 40 MiB unreserved, within a quarter.
        let (lo, hi) = (30 * MIB, 50 * MIB);
        assert!((lo..=hi).contains(&unreserved[0]), "about 40 MiB unreserved: {}", unreserved[0]);
        assert!(
            naming(lines, "::reserved_site").is_empty(),
            "the reserving site is not unreserved: {lines:?}"
        );
    }
    // The report's tree has the operator's reserving site under the query, with none
    // of its bytes unreserved: the site was sampled, and told apart.
    let report = seen.all("report");
    let tree: Vec<&str> = report
        .iter()
        .skip_while(|l| !l.contains("scope \"allocating\""))
        .skip(1)
        .take_while(|l| l.starts_with("      "))
        .copied()
        .collect();
    let reserved_line = tree
        .iter()
        .find(|l| {
            l.contains(" unreserved) ") && site_in_tree(l).iter().any(|n| n.contains("::reserved_site"))
        })
        .unwrap_or_else(|| panic!("the tree names reserved_site under the query:\n{}", seen.text));
    assert!(
        reserved_line.contains("(0 B unreserved)"),
        "none of reserved_site's bytes unreserved: {reserved_line}"
    );
}

/// A tree's site line (`BYTES (N) (U unreserved) FRAMES`): its frames, named.
fn site_in_tree(line: &str) -> Vec<String> {
    let frames = line.split_once(" unreserved) ").expect("a site line").1;
    site(&format!("(0) live {frames}")).1
}
