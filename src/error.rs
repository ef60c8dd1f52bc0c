//! [`Error`]: why a consumer, a relay or their set-up could not go on.

use std::fmt;

use crate::source::SourceError;
use crate::store::StoreError;

/// Why a consumer or a relay could not be built or had to stop, or why setting one up failed.
///
/// Per-message failures never surface here: they become retries or dead letters.
///
/// Every error of txinbox and its adapters converts into it with `?` (the adapters implement
/// `From` for their own errors), so a `main` that connects the store, applies the migrations,
/// creates a source and runs the consumer can return `Result<(), txinbox::Error>`. The error
/// it wraps stays reachable through [`source()`](std::error::Error::source), and that error's
/// cause after it:
///
/// ```no_run
/// # #[cfg(all(feature = "postgres", feature = "memory"))]
/// # mod run {
/// use txinbox::{Consumer, Context, Handler, HandlerError, Message, PostgresInbox};
///
/// struct Noop;
///
/// #[txinbox::async_trait]
/// impl Handler<txinbox::sqlx::Postgres> for Noop {
///     async fn handle(&self, _: &mut Context<'_, txinbox::sqlx::Postgres>, _: &Message) -> Result<(), HandlerError> {
///         Ok(())
///     }
/// }
///
/// async fn run() -> Result<(), txinbox::Error> {
///     let inbox = PostgresInbox::connect("postgres://postgres@127.0.0.1:5432/app", 10).await?; // StoreError
///     txinbox::postgres::migrate(inbox.pool()).await?; // MigrateError
///     let broker = txinbox::memory::MemoryBroker::new("deposits");
///     Consumer::builder("deposits")
///         .source(broker.source())
///         .inbox(inbox)
///         .handler(Noop)
///         .build()? // Error::Config
///         .run()
///         .await // Error::Source, Error::Store
/// }
/// # }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid (the consumer's, or the service's around it); the message
    /// says what to change.
    Config(String),
    /// The source failed in a way retrying cannot fix, or could not be created (an adapter's
    /// error, such as `txinbox_kafka::KafkaError`, is this error's `source()`).
    Source(SourceError),
    /// The database failed in a way retrying cannot fix (for example the migrations were not
    /// applied: the message says which `migrate` to run), or could not be reached at start.
    Store(StoreError),
    /// Applying txinbox's migrations ([`postgres::migrate`](crate::postgres::migrate),
    /// [`sqlite::migrate`](crate::sqlite::migrate)) failed.
    Migrate(sqlx::migrate::MigrateError),
    /// An outbox relay could not start or had to stop.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    Relay(crate::outbox::RelayError),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Config(msg) => write!(f, "invalid configuration: {msg}"),
            Error::Source(e) => write!(f, "{e}"),
            Error::Store(e) => write!(f, "{e}"),
            Error::Migrate(e) => write!(f, "applying txinbox's migrations failed: {e}"),
            #[cfg(any(feature = "postgres", feature = "sqlite"))]
            Error::Relay(e) => write!(f, "outbox relay: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Config(_) => None,
            Error::Source(e) => Some(e),
            Error::Store(e) => Some(e),
            Error::Migrate(e) => Some(e),
            #[cfg(any(feature = "postgres", feature = "sqlite"))]
            Error::Relay(e) => Some(e),
        }
    }
}

impl From<SourceError> for Error {
    fn from(e: SourceError) -> Self {
        Error::Source(e)
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Store(e)
    }
}

/// A database error of your own statements (creating your tables in `main`, say), classified
/// as the stores classify theirs: a [`Error::Store`] whose text names the database.
impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Store(crate::store::classify(e))
    }
}

impl From<sqlx::migrate::MigrateError> for Error {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        Error::Migrate(e)
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl From<crate::outbox::RelayError> for Error {
    fn from(e: crate::outbox::RelayError) -> Self {
        Error::Relay(e)
    }
}
