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
    /// The scope has ended (or the handle never named one). Also what a request blocked
    /// in a retry block, or a thread waiting there to run its attempt again, gets when
    /// its scope ends under it (at once).
    ScopeEnded,
    /// The scope or consumer table is full.
    TooManyScopes,
    /// A reservation was refused: spills, waits and reclaims made too little room.
    Refused {
        /// The bytes asked for.
        requested: u64,
    },
    /// Inside a retry block (`with_retry`): every task was blocked and this one, the
    /// youngest, was chosen to roll back. Free what the attempt holds and return the
    /// error; the block runs the attempt again.
    RetryOom,
    /// Inside a retry block: this task cannot fit even with every other task rolled
    /// back, or its request exceeds the whole pool. Split the input and try again
    /// (`with_split_retry` does).
    SplitAndRetryOom,
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
            Error::RetryOom => f.write_str("memquota: rolled back to free memory for older tasks: retry"),
            Error::SplitAndRetryOom => f.write_str(
                "memquota: does not fit even with younger tasks rolled back: split the input and retry",
            ),
            Error::ReserveInSpill { requested } => {
                write!(f, "memquota: a spill callback tried to reserve {requested} bytes")
            }
        }
    }
}

impl std::error::Error for Error {}

/// `Result` with memquota's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
