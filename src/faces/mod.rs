//! Layer 7, the faces inside this crate: the Rust global allocator (`alloc`) and the
//! JVM driver of a Rust library loaded into a JVM (`jvm`). Like the faces outside it
//! (the preload, the command, the engine pools), they reach the core through the seam
//! only.

pub(crate) mod alloc;
#[cfg(feature = "jvm")]
pub mod jvm;
