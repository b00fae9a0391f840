//! Process services.

mod exit_report;
pub(crate) mod init;
mod internal_alloc;
pub(crate) mod malloc_conf;
pub(crate) mod stats_file;
