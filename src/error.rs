//! [`Error`]: why a consumer could not be built or had to stop.

use std::fmt;

use crate::source::SourceError;
use crate::store::StoreError;

/// Why a consumer could not be built, or stopped.
///
/// Per-message failures never surface here: they become retries or dead letters.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid; the message says what to change.
    Config(String),
    /// The source failed in a way retrying cannot fix.
    Source(SourceError),
    /// The inbox database failed in a way retrying cannot fix (for example the migrations were
    /// not applied).
    Store(StoreError),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Config(msg) => write!(f, "invalid consumer configuration: {msg}"),
            Error::Source(e) => write!(f, "consumer stopped: {e}"),
            Error::Store(e) => write!(
                f,
                "consumer stopped: {e} (if a table is missing, run txinbox::postgres::migrate first)"
            ),
        }
    }
}

impl std::error::Error for Error {}
