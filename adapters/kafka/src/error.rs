//! [`KafkaError`]: what can go wrong while configuring or creating a Kafka client.

use std::fmt;

use txinbox::source::SourceError;

/// A configuration or client error from [`KafkaSource::new`](crate::KafkaSource::new) or
/// [`KafkaPublisherBuilder::build`](crate::KafkaPublisherBuilder::build).
///
/// The same shape as `txinbox_amqp::AmqpError`: [`is_transient`](Self::is_transient) says
/// whether trying again can help, `source()` is librdkafka's error (secret property values
/// masked), and `?` turns it into a [`txinbox::Error`] (a [`txinbox::Error::Source`] that keeps
/// this error as its cause).
#[derive(Debug)]
#[non_exhaustive]
pub enum KafkaError {
    /// The configuration is invalid; the message says what to change.
    Config(String),
    /// librdkafka refused the configuration, or a client could not be set up.
    Client {
        /// What was being done: `creating the consumer`, `subscribing to ["payments"]`, …
        context: String,
        /// Whether retrying cannot help (a property librdkafka refuses, a topic name it
        /// rejects).
        fatal: bool,
        /// librdkafka's error, with secret property values masked.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl KafkaError {
    /// Whether retrying cannot help.
    pub fn is_fatal(&self) -> bool {
        match self {
            KafkaError::Config(_) => true,
            KafkaError::Client { fatal, .. } => *fatal,
        }
    }

    /// Whether trying again may succeed (the opposite of [`is_fatal`](Self::is_fatal)), as
    /// [`SourceError::is_transient`] and [`txinbox::store::StoreError::is_transient`] say it.
    pub fn is_transient(&self) -> bool {
        !self.is_fatal()
    }
}

impl fmt::Display for KafkaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KafkaError::Config(m) => write!(f, "invalid Kafka configuration: {m}"),
            KafkaError::Client { context, source, .. } => write!(f, "Kafka: {context} failed: {source}"),
        }
    }
}

impl std::error::Error for KafkaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KafkaError::Config(_) => None,
            KafkaError::Client { source, .. } => Some(&**source),
        }
    }
}

impl From<KafkaError> for txinbox::Error {
    fn from(e: KafkaError) -> Self {
        let e = if e.is_fatal() {
            SourceError::fatal(e)
        } else {
            SourceError::transient(e)
        };
        txinbox::Error::Source(e)
    }
}
