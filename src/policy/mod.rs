//! Layer 2, policy: what the process budget does when a request does not fit. Admission
//! against the limit (`admission`), the emergency reserve (`reserve`), reclaims and
//! their coordinator (`reclaim`, `coordinator`), the refusal's report (`report`, with a
//! `snapshot` of every figure), where the heap figure comes from (`heap_probe`), and the
//! sampler thread: untracked memory, purging, the container's view and the flight
//! recorder's records (`sampler`, `purge`, `container`, `flight`).

#[cfg(not(loom))]
pub(crate) mod admission;
#[cfg(not(loom))]
pub(crate) mod container;
pub(crate) mod coordinator;
#[cfg(not(loom))]
pub(crate) mod flight;
#[cfg(not(loom))]
pub(crate) mod heap_probe;
#[cfg(not(loom))]
pub(crate) mod profile;
#[cfg(not(loom))]
pub(crate) mod purge;
#[cfg(not(loom))]
pub(crate) mod reclaim;
#[cfg(not(loom))]
pub(crate) mod report;
#[cfg(not(loom))]
pub(crate) mod reserve;
#[cfg(not(loom))]
pub(crate) mod sampler;
#[cfg(not(loom))]
pub(crate) mod snapshot;
