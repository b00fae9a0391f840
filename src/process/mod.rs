//! Layer 5, process services: `init` and the per-thread controls (`control`), the fork
//! handlers (`fork`), the check for a second budget in the process (`rendezvous`), the
//! figures as Prometheus text and JSON (`export`), the metrics endpoint that serves
//! them (`endpoint`) and the flight recorder's records (`recorder`).

pub(crate) mod control;
pub(crate) mod endpoint;
pub(crate) mod export;
pub(crate) mod fork;
pub(crate) mod recorder;
pub(crate) mod rendezvous;
