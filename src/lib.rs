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

// Modules in layers: each uses only its own layer and those below it (docs/design.md
// has the picture; tests/layers.rs checks the `use crate::` lines against it).
//
// base
mod cgroup;
mod config;
mod error;
mod host;
mod quota;
mod settings;
#[cfg(not(loom))]
mod size_class;
mod stats;
mod sync;
mod text;
// ledger
mod account;
#[cfg(not(loom))]
mod bulk;
#[cfg(not(loom))]
mod ledger;
#[cfg(not(loom))]
mod tables;
// Under loom, of the tables only the pure retry machine (its loom model).
#[cfg(loom)]
mod tables {
    #[path = "machine.rs"]
    pub(crate) mod machine;
}
// policy
#[cfg(not(loom))]
mod admission;
#[cfg(not(loom))]
mod container;
mod gc;
#[cfg(not(loom))]
mod heap_probe;
#[cfg(not(loom))]
mod purge;
#[cfg(not(loom))]
mod reclaim;
#[cfg(not(loom))]
mod report;
#[cfg(not(loom))]
mod reserve;
#[cfg(not(loom))]
mod snapshot;
#[cfg(not(loom))]
mod untracked;
// arbitration
#[cfg(not(loom))]
mod scope;
// slow path
#[cfg(not(loom))]
mod slow_path;
// faces and control
#[cfg(not(loom))]
mod alloc;
#[cfg(not(loom))]
mod control;
#[cfg(not(loom))]
mod endpoint;
#[cfg(not(loom))]
mod export;
#[cfg(not(loom))]
mod fork;
#[cfg(all(feature = "jvm", not(loom)))]
pub mod jvm;
#[cfg(not(loom))]
mod rendezvous;

#[cfg(all(test, loom))]
mod loom_tests;

/// Not part of the API: what memquota's own artifacts (the `LD_PRELOAD` library, the
/// `memquota` command, the tests) reach for below the user-facing surface. It may
/// change in any release.
///
/// A face other than the Rust allocator keeps a [`face::Local`] per thread, tries
/// [`face::try_charge`] / [`face::try_credit`] on every call, and calls
/// [`face::charge_slow`] when they say no.
#[doc(hidden)]
#[cfg(not(loom))]
pub mod face {
    pub use crate::bulk::Bulk;
    /// Bulk counting from jemalloc's per-thread totals (`bulk.rs`).
    pub mod bulk {
        pub use crate::bulk::*;
    }
    pub use crate::config::{parse_duration, parse_limit, parse_size, vars, ENV_VARS, MIN_STATS_INTERVAL};
    pub use crate::control::adopt;
    pub use crate::endpoint::DEFAULT_METRICS_ADDR;
    pub use crate::export::{metric, StatsWriter};
    pub use crate::host::{
        anon_rss, cgroup_limit, memory_limit, object_of, physical_ram, process_rss, running_since,
    };
    pub use crate::ledger::{
        charge_or_miss, enter, record_in_bulk, spawn_service, thread_exit, try_charge, try_credit,
        undo_charge, Busy, Face, Lazy, Local,
    };
    pub use crate::purge::added_jemalloc_options;
    pub use crate::quota::{threshold_for, MAX_THRESHOLD, MIN_THRESHOLD};
    pub use crate::report::{flush_quiet, write_container, write_untracked_note};
    pub use crate::reserve::{size_for as emergency_reserve_for, DRAW_MAX as EMERGENCY_DRAW_MAX};
    pub use crate::scope::{
        attach_raw, begin_raw, detach_raw, end_raw, last_refusal_raw, note_alloc, note_free,
        note_realloc_begin, note_realloc_end, release_raw, reserve_raw, retry_begin_raw, retry_block_raw,
        retry_end_raw, scopes_used,
    };
    pub use crate::settings::{set_window_hook, Window};
    pub use crate::size_class::{self_check, small_usable, usable, SMALL_MAX};
    pub use crate::slow_path::{charge_slow, charge_taken, end_gate, flush_thread, make_room, record};
    pub use crate::tables::retry::Rollback;
    pub use crate::tables::{MAX_BUDGETS, MAX_CONSUMERS, MAX_SCOPES, OWNED_MIN};
    pub use crate::text::{write_fd, write_stderr, FixedBuf, SignedSize, Size, SliceWriter, CAPACITY};
    pub use crate::untracked::sample_now as sample_untracked;
}

pub use config::{Config, HeapMode, Limit, OnOom, Untracked};
pub use error::{Error, Result};
pub use tikv_jemallocator::Jemalloc;

#[cfg(not(loom))]
pub use {
    alloc::QuotaAlloc,
    control::{flush_thread, init, thread_pending},
    endpoint::serve_metrics,
    export::{write_json, write_prometheus, write_scopes_json, write_scopes_prometheus},
    heap_probe::{set_heap_bytes, set_heap_probe, HeapProbe},
    reclaim::{clear_reclaim, on_reclaim},
    report::{last_report, set_report_hook, ReportHook},
    scope::{
        with_retry, with_split_retry, AttachGuard, Budget, BudgetStats, Consumer, ConsumerStats,
        MemoryManager, Reservation, ScopeAccount, ScopeHandle, ScopeReport, ScopeSnapshot, ScopeStats,
        TaskScope, MAX_RETRIES,
    },
    settings::{set_enforcement, set_limit, Enforcement},
    snapshot::{process_account, report_now, stats},
    stats::{ContainerStats, HeapBytes, JemallocStats, PressureSource, ProcessAccount, RetryStats, Stats},
};
