#![doc = include_str!("../README.md")]
//!
//! # Feature flags
//!
//! * `disable_initial_exec_tls`: build jemalloc with global-dynamic TLS. Needed by
//!   any artifact that is `dlopen`ed (a JNI library loaded by `System.loadLibrary`, a
//!   Python extension), which otherwise fails to load with "cannot allocate memory
//!   in static TLS block". Leave it off for executables and for the `LD_PRELOAD`
//!   library.
//! * `jvm`: [`jvm::install`] counts a JVM's heap in the budget and makes its GC the
//!   reclaim, for a Rust library loaded into a JVM (call it from `JNI_OnLoad`).
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// Under loom only the pure parts are built, and not all of them are exercised.
#![cfg_attr(loom, allow(dead_code))]

mod account;
mod config;
mod error;
mod gc;
mod host;
mod quota;
mod sync;

#[cfg(not(loom))]
mod alloc;
#[cfg(not(loom))]
mod endpoint;
#[cfg(not(loom))]
mod engine;
#[cfg(not(loom))]
mod export;
#[cfg(not(loom))]
mod fork;
#[cfg(not(loom))]
mod heap_probe;
#[cfg(all(feature = "jvm", not(loom)))]
pub mod jvm;
#[cfg(not(loom))]
mod ledger;
#[cfg(not(loom))]
mod rendezvous;
#[cfg(not(loom))]
mod report;
#[cfg(not(loom))]
mod rust_face;
#[cfg(not(loom))]
mod scope;
#[cfg(not(loom))]
mod stats;

#[cfg(all(test, loom))]
mod loom_tests;

/// For faces other than the Rust allocator (the `LD_PRELOAD` library): the per-thread
/// state and the shared slow path. A face keeps a [`face::Local`] per thread, tries
/// [`face::try_charge`] / [`face::try_credit`] on every call, and calls
/// [`face::charge_slow`] when they say no.
#[cfg(not(loom))]
pub mod face {
    pub use crate::engine::{adopt, charge_slow, end_gate, flush_thread, make_room, record};
    pub use crate::ledger::{enter, pending, thread_exit, try_charge, try_credit, Busy, Face, Local};
    pub use crate::report::flush_quiet;
    pub use crate::scope::{
        attach_raw, begin_raw, detach_raw, end_raw, note_alloc, note_free, note_realloc_begin,
        note_realloc_end, release_raw, reserve_raw, OWNED_MIN,
    };
}

pub use config::{
    parse_duration, parse_limit, parse_size, Config, HeapMode, Limit, OnOom, ENV_VARS, REFUSE_MIN_VAR,
};
pub use error::{Error, Result};
pub use gc::{ReclaimKind, ReclaimRecord, Throttle};
pub use host::{cgroup_limit, memory_limit, physical_ram, process_rss};
pub use tikv_jemallocator::Jemalloc;

#[cfg(not(loom))]
pub use {
    alloc::QuotaAlloc,
    endpoint::{serve_metrics, DEFAULT_METRICS_ADDR},
    engine::{clear_reclaim, init, on_reclaim, set_enforcement, set_limit, stats, Enforcement, ReclaimFn},
    export::{write_json, write_prometheus, write_scopes_json, write_scopes_prometheus, SliceWriter},
    heap_probe::{heap_probe, set_heap_bytes, HeapBytes, HeapProbe, ProbeFn},
    ledger::{threshold_for, MAX_THRESHOLD, MIN_THRESHOLD},
    report::{last_report, set_report_hook, write_stderr, ReportHook, REPORT_CAPACITY},
    rust_face::{flush, thread_pending},
    scope::{
        AttachGuard, Consumer, ConsumerStats, MemoryManager, Reservation, ScopeHandle, ScopeReport,
        ScopeSnapshot, ScopeStats, SpillFn, TaskScope, MAX_CONSUMERS, MAX_SCOPES, OWNED_MIN,
    },
    stats::{JemallocStats, Stats},
};
