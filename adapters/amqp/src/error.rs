//! [`AmqpError`]: what can go wrong while configuring or connecting.

use std::fmt;

use txinbox::source::SourceError;

/// A configuration or broker error from [`AmqpSource::connect`](crate::AmqpSource::connect)
/// or [`AmqpPublisher::connect`](crate::AmqpPublisher::connect).
///
/// [`is_transient`](Self::is_transient) says whether trying again can help, `source()` is
/// lapin's error, and `?` turns it into a [`txinbox::Error`] (a [`txinbox::Error::Source`]
/// that keeps this error as its cause).
#[derive(Debug)]
#[non_exhaustive]
pub enum AmqpError {
    /// The configuration is invalid; the message says what to change.
    Config(String),
    /// The broker refused or could not be reached.
    Broker {
        /// What was being done: `connect`, `declare queue`, `basic.consume`, …
        context: String,
        /// Whether retrying cannot help (bad credentials, unknown vhost or queue, a queue
        /// declared with other arguments).
        fatal: bool,
        /// The driver's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl AmqpError {
    /// Whether retrying cannot help.
    pub fn is_fatal(&self) -> bool {
        match self {
            AmqpError::Config(_) => true,
            AmqpError::Broker { fatal, .. } => *fatal,
        }
    }

    /// Whether trying again may succeed (the opposite of [`is_fatal`](Self::is_fatal)), as
    /// [`SourceError::is_transient`] and [`txinbox::store::StoreError::is_transient`] say it.
    pub fn is_transient(&self) -> bool {
        !self.is_fatal()
    }
}

impl fmt::Display for AmqpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AmqpError::Config(m) => write!(f, "invalid AMQP configuration: {m}"),
            AmqpError::Broker { context, source, .. } => write!(f, "AMQP {context} failed: {source}"),
        }
    }
}

impl std::error::Error for AmqpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AmqpError::Config(_) => None,
            AmqpError::Broker { source, .. } => Some(&**source),
        }
    }
}

/// A driver error with what to do about it: `Display` is the error, then the advice; `source`
/// is the error.
#[derive(Debug)]
pub(crate) struct Advised {
    error: lapin::Error,
    advice: String,
}

impl Advised {
    pub(crate) fn new(error: lapin::Error, advice: String) -> Advised {
        Advised { error, advice }
    }
}

impl fmt::Display for Advised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}; {}", self.error, self.advice)
    }
}

impl std::error::Error for Advised {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<AmqpError> for txinbox::Error {
    fn from(e: AmqpError) -> Self {
        let e = if e.is_fatal() {
            SourceError::fatal(e)
        } else {
            SourceError::transient(e)
        };
        txinbox::Error::Source(e)
    }
}
