//! Layer 6, the seam: the one interface between the core (layers 0 to 5) and its faces.
//! Every face uses it and nothing else of the core but the public API at the crate
//! root: the Rust allocator and the JVM driver in `faces/` (`tests/layers.rs` checks
//! that), and, outside this crate, the `LD_PRELOAD` library, the command and the tests,
//! with the `seam` feature on. It is not part of the API and may change in any release.
//!
//! Grouped by role:
//! * [`hot`]: the per-thread state and the charges a face runs on every call;
//! * [`slow`]: where a face goes when the hot path says no;
//! * [`scopes`]: the raw scope functions the C ABI and Java wrap, and the notes a face
//!   takes of big blocks so that any thread's free credits their scope;
//! * [`process`]: configuration, the host's figures, service threads, fork and test
//!   points;
//! * [`text`]: writing without a heap, and the names of the metrics.
//!
//! A face other than the Rust allocator keeps a [`hot::Local`] per thread, tries
//! [`hot::try_charge`] / [`hot::try_credit`] on every call, and calls
//! [`slow::charge_slow`] when they say no.

/// The fast path: a face's per-thread [`Local`](hot::Local) and its charges, bulk
/// counting from jemalloc's per-thread totals, jemalloc's size classes.
pub mod hot {
    /// Bulk counting from jemalloc's per-thread totals (`ledger/bulk.rs`).
    pub mod bulk {
        pub use crate::ledger::bulk::*;
    }
    pub use crate::base::size_class::{self_check, small_usable, usable, SMALL_MAX};
    pub use crate::ledger::bulk::Bulk;
    pub use crate::ledger::threads::{
        charge_or_miss, enter, record_in_bulk, thread_exit, try_charge, try_credit, undo_charge, Face, Lazy,
        Local,
    };
    pub(crate) use crate::ledger::threads::{with_rust_local, RUST_FACE};
}

/// The slow path: settle, decide, re-arm; the gates; the emergency reserve's sizes.
pub mod slow {
    pub use crate::policy::reserve::{size_for as emergency_reserve_for, DRAW_MAX as EMERGENCY_DRAW_MAX};
    pub use crate::slow_path::{charge_slow, charge_taken, end_gate, flush_thread, make_room, record};
}

/// Task scopes through raw handles (the C ABI, Java), and the owner notes of big blocks.
pub mod scopes {
    pub use crate::arbitration::{
        attach_raw, begin_raw, detach_raw, end_raw, last_refusal_raw, note_alloc, note_free,
        note_realloc_begin, note_realloc_end, release_raw, reserve_raw, retry_begin_raw, retry_block_raw,
        retry_end_raw, scopes_used,
    };
    pub use crate::ledger::tables::retry::Rollback;
    pub use crate::ledger::tables::OWNED_MIN;
}

/// The process: configuration and its variables, the host's figures, service threads,
/// the threshold arithmetic, jemalloc's options, fork handlers and test points.
pub mod process {
    pub use crate::base::config::{
        parse_duration, parse_limit, parse_size, vars, ENV_VARS, MIN_STATS_INTERVAL,
    };
    pub use crate::base::host::{anon_rss, memory_limit, object_of, process_rss, running_since};
    pub use crate::base::quota::threshold_for;
    pub use crate::base::settings::{set_window_hook, Window};
    pub use crate::ledger::threads::spawn_service;
    pub use crate::policy::profile::skips_function as profile_skips_function;
    pub use crate::policy::purge::added_jemalloc_options;
    pub(crate) use crate::policy::sampler::ensure_sampling;
    pub use crate::policy::sampler::sample_now as sample_untracked;
    pub use crate::process::control::adopt;
    pub(crate) use crate::process::fork::install as install_fork_handlers;
    // The JVM driver's alone (`faces/jvm.rs`, the `jvm` feature).
    #[cfg(feature = "jvm")]
    pub(crate) use crate::{
        base::settings::set_background_interval,
        policy::snapshot::native_and_outside,
        process::fork::{add_face_handlers, FaceHandlers},
        process::rendezvous::check as check_second_budget,
    };
}

/// Text without a heap (stderr, file descriptors, byte counts), the exit summary's
/// parts, and the names of the metrics.
pub mod text {
    pub use crate::base::text::{write_fd, write_stderr, Size, SliceWriter};
    pub use crate::policy::profile::{write_site_comments, write_sites, Sites};
    pub use crate::policy::report::{flush_quiet, summary_sites, write_container, write_untracked_note};
    pub use crate::process::export::{metric, StatsWriter};
}

/// The sync primitives, for the faces inside this crate (so that loom can replace
/// them): the JVM driver's.
#[cfg(feature = "jvm")]
pub(crate) mod sync {
    pub(crate) use crate::base::sync::*;
}
