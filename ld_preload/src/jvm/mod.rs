//! The JVM face: `-agentpath:libmemquota.so` (the JVMTI agent), the gates in front of
//! `Unsafe.allocateMemory0`/`reallocateMemory0`, and the natives of
//! `org.memquota.MemQuota` (bindings/java/org/memquota/).
//!
//! `agent` uses `gate` and the process services (`init`, `stats_file`); `natives`
//! uses `gate` and the C ABI (retry blocks); `gate` uses only `malloc::charge`'s table.

pub mod agent;
mod gate;
pub mod natives;
