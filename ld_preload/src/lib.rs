//! `libmemquota.so`: the memquota budget for any program, by `LD_PRELOAD`.
//!
//! The only crate of the workspace that exports C symbols: the malloc family over
//! jemalloc's prefixed `_rjem_*` functions, jemalloc's own API (`mallocx`, `mallctl`,
//! ...) for programs linked with jemalloc, C++ `operator new`/`delete`, and the
//! `memquota_*` C ABI of `include/memquota.h`. The quota engine is the `memquota`
//! library's; this crate only translates. jemalloc takes its options from
//! `MALLOC_CONF` as well as its own `_RJEM_MALLOC_CONF` (`process/malloc_conf.rs`).
//!
//! Accounting is in jemalloc's usable sizes, taken from jemalloc's per-thread totals
//! of bytes allocated and freed. On a lazy thread (`malloc/lazy.rs`) `free` and `malloc`
//! under 4 KiB are tail calls into jemalloc, counted in bulk from jemalloc's event
//! hook and at every flush. Elsewhere `free(p)` credits what the freed total moved by
//! across the call, and `malloc(n)` under 4 KiB charges a size class from a table
//! filled at load (checked against `nallocx`), before memory is taken; neither costs a size
//! lookup. Larger requests are charged before memory is taken, with the size class
//! computed (checked against `nallocx` at load) or asked of `nallocx`.
//!
//! One folder per face, and the services they share:
//!
//! | path | face | uses |
//! | --- | --- | --- |
//! | `jvm/` | the JVM: the JVMTI agent, the `Unsafe` gates, `org.memquota.MemQuota`'s natives | `capi`, `process`, `malloc` |
//! | `capi.rs` | the `memquota_*` C ABI of `include/memquota.h` | `malloc` |
//! | `process/` | process services: load time, fork, the exit summary, the stats file, `MALLOC_CONF`, the library's own allocations | `malloc` |
//! | `malloc/` | the malloc family, C++ `new`/`delete`, jemalloc's API; the per-thread slot, the charging code and the `FACE` table every face charges through | nothing of this crate |
//!
//! Imports go down the table, never up: faces -> process services -> malloc's
//! primitives. No module imports one that imports it back.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod capi;
pub mod jvm;
pub mod malloc;
mod process;
