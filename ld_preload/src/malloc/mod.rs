//! The malloc family face.

pub mod charge;
pub mod cxx;
mod cxx_runtime;
pub mod jemalloc_api;
pub(crate) mod lazy;
pub(crate) mod thread;
