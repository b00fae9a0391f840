//! Layer 1, the ledger: who holds what. Per-thread deltas and their flush
//! (`threads`), the process account they flush into (`account`), bulk counting from
//! jemalloc's own per-thread totals (`bulk`), and the scope tables that every flush is
//! attributed to (`tables`).

pub(crate) mod account;
#[cfg(not(loom))]
pub(crate) mod bulk;
#[cfg(not(loom))]
pub(crate) mod tables;
#[cfg(not(loom))]
pub(crate) mod threads;

// Under loom, of the tables only the pure retry machine and the spin lock (their loom
// models).
#[cfg(loom)]
pub(crate) mod tables {
    #[path = "machine.rs"]
    pub(crate) mod machine;
    #[path = "spin.rs"]
    pub(crate) mod spin;
}
