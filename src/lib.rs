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

// The layers, bottom up: each uses only itself and the layers before it here
// (docs/design.md has the picture; tests/layers.rs checks every `crate::` path
// against it).
//
// 0: settings, arithmetic, figures, text, sync primitives, the host.
mod base;
// 1: per-thread deltas, the process account, the scope tables.
mod ledger;
// 2: admission, reclaims, the report, the sampler thread, purging.
mod policy;
// 3: task scopes: fair share, spills, retry blocks.
#[cfg(not(loom))]
mod arbitration;
// 4: the one entry a face calls when its fast path says no.
#[cfg(not(loom))]
mod slow_path;
// 5: init, fork handlers, the second-budget check, export and the metrics endpoint.
#[cfg(not(loom))]
mod process;
// 6: the seam, the faces' one way in; sealed unless the `seam` feature asks for it
// (memquota's own artifacts and tests do).
#[cfg(all(feature = "seam", not(loom)))]
#[doc(hidden)]
pub mod seam;
#[cfg(all(not(feature = "seam"), not(loom)))]
#[allow(unused_imports)]
mod seam;
// 7: the faces in this crate: the Rust allocator, the JVM driver.
#[cfg(not(loom))]
mod faces;

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
    pub use crate::ledger::bulk::Bulk;
    /// Bulk counting from jemalloc's per-thread totals (`bulk.rs`).
    pub mod bulk {
        pub use crate::ledger::bulk::*;
    }
    pub use crate::arbitration::{
        attach_raw, begin_raw, detach_raw, end_raw, last_refusal_raw, note_alloc, note_free,
        note_realloc_begin, note_realloc_end, release_raw, reserve_raw, retry_begin_raw, retry_block_raw,
        retry_end_raw, scopes_used,
    };
    pub use crate::base::config::{
        parse_duration, parse_limit, parse_size, vars, ENV_VARS, MIN_STATS_INTERVAL,
    };
    pub use crate::base::host::{
        anon_rss, cgroup_limit, memory_limit, object_of, physical_ram, process_rss, running_since,
    };
    pub use crate::base::quota::{threshold_for, MAX_THRESHOLD, MIN_THRESHOLD};
    pub use crate::base::settings::{set_window_hook, Window};
    pub use crate::base::size_class::{self_check, small_usable, usable, SMALL_MAX};
    pub use crate::base::text::{write_fd, write_stderr, FixedBuf, SignedSize, Size, SliceWriter, CAPACITY};
    pub use crate::ledger::tables::retry::Rollback;
    pub use crate::ledger::tables::{MAX_BUDGETS, MAX_CONSUMERS, MAX_SCOPES, OWNED_MIN};
    pub use crate::ledger::threads::{
        charge_or_miss, enter, record_in_bulk, spawn_service, thread_exit, try_charge, try_credit,
        undo_charge, Busy, Face, Lazy, Local,
    };
    pub use crate::policy::purge::added_jemalloc_options;
    pub use crate::policy::report::{flush_quiet, write_container, write_untracked_note};
    pub use crate::policy::reserve::{size_for as emergency_reserve_for, DRAW_MAX as EMERGENCY_DRAW_MAX};
    pub use crate::policy::sampler::sample_now as sample_untracked;
    pub use crate::process::control::adopt;
    pub use crate::process::endpoint::DEFAULT_METRICS_ADDR;
    pub use crate::process::export::{metric, StatsWriter};
    pub use crate::slow_path::{charge_slow, charge_taken, end_gate, flush_thread, make_room, record};
}

pub use base::config::{Config, HeapMode, Limit, OnOom, Untracked};
pub use base::error::{Error, Result};
pub use tikv_jemallocator::Jemalloc;

#[cfg(all(feature = "jvm", not(loom)))]
pub use faces::jvm;

#[cfg(not(loom))]
pub use {
    arbitration::{
        with_retry, with_split_retry, AttachGuard, Budget, BudgetStats, Consumer, ConsumerStats,
        MemoryManager, Reservation, ScopeAccount, ScopeHandle, ScopeReport, ScopeSnapshot, ScopeStats,
        TaskScope, MAX_RETRIES,
    },
    base::settings::{set_enforcement, set_limit, Enforcement},
    base::stats::{
        ContainerStats, HeapBytes, JemallocStats, PressureSource, ProcessAccount, RetryStats, Stats,
    },
    faces::alloc::QuotaAlloc,
    policy::heap_probe::{set_heap_bytes, set_heap_probe, HeapProbe},
    policy::reclaim::{clear_reclaim, on_reclaim},
    policy::report::{last_report, set_report_hook, ReportHook},
    policy::snapshot::{process_account, report_now, stats},
    process::control::{flush_thread, init, thread_pending},
    process::endpoint::serve_metrics,
    process::export::{write_json, write_prometheus, write_scopes_json, write_scopes_prometheus},
};
