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
//! * `profile` (default): jemalloc built with profiling, for the allocation-site
//!   profile (one sample per 512 KiB allocated unless `MEMQUOTA_PROFILE_SAMPLE` or
//!   [`Config::profile_sample`] says otherwise; 0 turns it off). It compiles jemalloc's
//!   options in (`_rjem_malloc_conf`): a program that compiles in its own turns
//!   default features off.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// Under loom only the pure parts are built, and not all of them are exercised.
#![cfg_attr(loom, allow(dead_code))]
// Sealed, the seam leaves the items only the faces outside use unused; the workspace's
// build (the seam on) checks them.
#![cfg_attr(not(feature = "seam"), allow(dead_code))]

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
