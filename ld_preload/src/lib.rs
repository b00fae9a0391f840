//! `libmemquota.so`: the memquota budget for any program, by `LD_PRELOAD`.
//!
//! The only crate of the workspace that exports C symbols: the malloc family over
//! jemalloc's prefixed `_rjem_*` functions, C++ `operator new`/`delete`, and the
//! `memquota_*` C ABI of `include/memquota.h`. The quota engine is the `memquota`
//! library's; this crate only translates.
//!
//! Accounting is in jemalloc's usable sizes: `malloc(n)` charges the size class of
//! `n` (computed, checked against `nallocx` at load), `free(p)` credits
//! `sallocx(p)` and hands the size to `sdallocx`, so jemalloc skips its own lookup.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod capi;
pub mod cxx;
mod init;
mod internal;
pub mod malloc;
mod size_class;
mod tls;
