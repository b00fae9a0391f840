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
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::BadEnv { var, value, accepted } => {
                write!(f, "memquota: bad {var}={value:?}: expected {accepted}")
            }
            Error::BadConfig { setting, reason } => write!(f, "memquota: bad {setting}: {reason}"),
            Error::Jvm(why) => write!(f, "memquota: JVM: {why}"),
        }
    }
}

impl std::error::Error for Error {}

/// `Result` with memquota's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
