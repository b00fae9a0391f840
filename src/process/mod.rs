//! Layer 5, process services: `init` and the per-thread controls (`control`), the fork
//! handlers (`fork`), the check for a second budget in the process (`rendezvous`), the
//! figures as Prometheus text and JSON (`export`) and the metrics endpoint that serves
//! them (`endpoint`).

pub(crate) mod control;
pub(crate) mod endpoint;
pub(crate) mod export;
pub(crate) mod fork;
pub(crate) mod rendezvous;
