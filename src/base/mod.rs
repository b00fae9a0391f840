//! Layer 0, base: what every layer above reads and nothing here decides. Settings and
//! their parsing, pure budget arithmetic, the figures, text without a heap, the sync
//! primitives (the one place they are named, so loom can replace them), and what the
//! host and its cgroup say.

pub(crate) mod cgroup;
pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod host;
pub(crate) mod quota;
pub(crate) mod settings;
#[cfg(not(loom))]
pub(crate) mod size_class;
pub(crate) mod stats;
pub(crate) mod sync;
pub(crate) mod text;
