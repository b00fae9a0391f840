//! Process services: load time (configuration, fork handler), the exit summary, the
//! stats file, `MALLOC_CONF` for the preload's jemalloc, and the library's own Rust
//! allocations.
//!
//! `init` uses the other three services below it; `exit_report`, `stats_file` and
//! `malloc_conf` use nothing of this crate; `init` and `internal_alloc` use
//! `malloc`'s slot, guards and table.

mod exit_report;
pub(crate) mod init;
mod internal_alloc;
pub(crate) mod malloc_conf;
pub(crate) mod stats_file;
