//! The crate's one error type.

use std::fmt;

/// Everything that can go wrong configuring memquota.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// An environment variable holds a value memquota cannot use.
    BadEnv {
        /// The variable, e.g. `MEMQUOTA_LIMIT`.
        var: &'static str,
        /// The value found.
        value: String,
        /// The forms that are accepted.
        accepted: &'static str,
    },
    /// A value given through the [`Config`](crate::Config) builder is out of range.
    BadConfig {
        /// The setting, e.g. `soft_ratio`.
        setting: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The JVM could not be reached or driven (feature `jvm`).
    Jvm(String),
    /// The scope has ended (or the handle never named one).
    ScopeEnded,
    /// The scope or consumer table is full.
    TooManyScopes,
    /// A reservation was refused: spills, waits and reclaims made too little room.
    Refused {
        /// The bytes asked for.
        requested: u64,
    },
    /// A spill (or reclaim) callback tried to reserve memory itself.
    ReserveInSpill {
        /// The bytes asked for.
        requested: u64,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::BadEnv { var, value, accepted } => {
                write!(f, "memquota: bad {var}={value:?}: expected {accepted}")
            }
            Error::BadConfig { setting, reason } => write!(f, "memquota: bad {setting}: {reason}"),
            Error::Jvm(why) => write!(f, "memquota: JVM: {why}"),
            Error::ScopeEnded => f.write_str("memquota: the scope has ended"),
            Error::TooManyScopes => f.write_str("memquota: too many scopes or consumers"),
            Error::Refused { requested } => write!(f, "memquota: reservation of {requested} bytes refused"),
            Error::ReserveInSpill { requested } => {
                write!(f, "memquota: a spill callback tried to reserve {requested} bytes")
            }
        }
    }
}

impl std::error::Error for Error {}

/// `Result` with memquota's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
