//! The transactional outbox (PostgreSQL): messages a handler wants to send are written as rows
//! in the same transaction as its effects, and a [`Relay`] publishes them afterwards, at least
//! once, through a broker-neutral [`Publisher`].
//!
//! A handler that publishes directly to a broker breaks effectively-once processing: a retried
//! attempt publishes twice, a rolled-back attempt publishes a message for effects that never
//! happened. With the outbox the rows commit (or roll back) with the effects, the relay
//! publishes committed rows, and the next consumer's inbox turns the relay's occasional
//! republication into a duplicate — because every copy carries the same message ID.
//!
//! ```no_run
//! use txinbox::outbox::OutboxMessage;
//! use txinbox::{Context, Handler, HandlerError, Message};
//!
//! struct PlaceOrder;
//!
//! #[txinbox::async_trait]
//! impl Handler<sqlx::Postgres> for PlaceOrder {
//!     async fn handle(&self, cx: &mut Context<'_, sqlx::Postgres>, msg: &Message) -> Result<(), HandlerError> {
//!         sqlx::query("INSERT INTO orders (id) VALUES ($1)")
//!             .bind(cx.message_id().as_str())
//!             .execute(cx.db())
//!             .await?;
//!         // Same incoming message + same step name = same ID on every retry.
//!         let event = OutboxMessage::new(cx.derive_id("order-placed"), "orders.placed", msg.payload().clone())
//!             .with_key("customer-42");
//!         cx.outbox(&event).await?;
//!         Ok(())
//!     }
//! }
//! ```
//!
//! Outside a consumer, write on any sqlx transaction: `outbox::write(&mut *tx, &message)`.
//!
//! # Guarantees
//!
//! - A row exists exactly when the transaction that wrote it committed.
//! - Every committed row is published at least once (or dead-lettered after bounded attempts),
//!   with its message ID: Kafka header [`ID_HEADER`], AMQP `message_id` property and
//!   [`ID_HEADER`] header. Consumers deduplicate on it (`IdStrategy::Header(ID_HEADER)`).
//! - Order: rows with the same `(destination, key)` are published in the order of their row
//!   IDs (the order their transactions inserted them; rows written by *concurrent*
//!   transactions for one key have no defined order). A row that fails is retried before any
//!   later row of its key is attempted; dead-lettering it lets the key move on. Rows without a
//!   key are published in no particular order.
//! - Several relays may run on one outbox: a key is published by one relay at a time (except
//!   that a row committed after a later row of its key was claimed may be published alongside
//!   the rows of transactions it overlapped with; see [`Relay`]).
//!
//! PostgreSQL only: the relay relies on `FOR UPDATE SKIP LOCKED` and `LISTEN/NOTIFY`.

mod relay;

pub use relay::{Backlog, Relay, RelayConfig, RelayError, RelayRound};

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::message::{hex, Headers, MAX_ID_LEN};

/// The header that carries an outbox message's ID on the broker (Kafka record header; AMQP
/// header, besides the `message_id` property). A downstream consumer deduplicates with
/// `IdStrategy::Header(txinbox::outbox::ID_HEADER.into())`.
pub const ID_HEADER: &str = "message-id";

/// The PostgreSQL `NOTIFY` channel a trigger on `txinbox.outbox` signals after each inserting
/// statement (delivered when its transaction commits).
pub const NOTIFY_CHANNEL: &str = "txinbox_outbox";

/// Derives a downstream message ID from the ID of the message being handled and a step name:
/// the lowercase hex SHA-256 of `parent ‖ 0x00 ‖ step`.
///
/// Deterministic, so a retried handler writes the same IDs; the `0x00` separator keeps
/// `("ab", "c")` and `("a", "bc")` apart. Use a distinct step per message a handler emits
/// (`"shipped"`, `"line-3"`). Chains compose: the IDs of a pipeline's later stages derive from
/// earlier ones.
pub fn derive_id(parent: &str, step: &str) -> String {
    let mut h = Sha256::new();
    h.update(parent.as_bytes());
    h.update([0u8]);
    h.update(step.as_bytes());
    hex(&h.finalize())
}

/// One message to publish: ID, destination (Kafka topic; AMQP routing key), optional key
/// (Kafka record key and partition; the ordering unit), payload and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    message_id: String,
    destination: String,
    key: Option<Bytes>,
    payload: Bytes,
    headers: Headers,
}

impl OutboxMessage {
    /// A message with this ID (usually [`derive_id`] / `Context::derive_id`), destination and
    /// payload, no key, no headers.
    pub fn new(
        message_id: impl Into<String>,
        destination: impl Into<String>,
        payload: impl Into<Bytes>,
    ) -> Self {
        OutboxMessage {
            message_id: message_id.into(),
            destination: destination.into(),
            key: None,
            payload: payload.into(),
            headers: Headers::new(),
        }
    }

    /// Sets the key: the Kafka record key (which selects the partition) and the ordering unit.
    pub fn with_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the headers. A header named [`ID_HEADER`] is replaced by the message ID on publish.
    pub fn with_headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// The message ID.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }

    /// Kafka topic, or AMQP routing key.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// The key, if any.
    pub fn key(&self) -> Option<&Bytes> {
        self.key.as_ref()
    }

    /// The payload.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The headers, in order.
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    fn validate(&self) -> Result<(), WriteError> {
        let invalid = |m: String| Err(WriteError::Invalid(m));
        if self.message_id.is_empty() {
            return invalid("the outbox message ID is empty".into());
        }
        if self.message_id.len() > MAX_ID_LEN {
            return invalid(format!(
                "the outbox message ID is {} bytes long; the limit is {MAX_ID_LEN}",
                self.message_id.len()
            ));
        }
        if self.destination.is_empty() {
            return invalid(format!(
                "outbox message {}: the destination is empty",
                self.message_id
            ));
        }
        let nul = |s: &str| s.contains('\0');
        if nul(&self.message_id) || nul(&self.destination) || self.headers.iter().any(|(n, _)| nul(n)) {
            return invalid(format!(
                "outbox message {:?}: ID, destination and header names cannot contain NUL (PostgreSQL text)",
                self.message_id
            ));
        }
        Ok(())
    }
}

/// Why [`write()`] wrote nothing.
#[derive(Debug)]
#[non_exhaustive]
pub enum WriteError {
    /// The message cannot be stored (empty or overlong ID, empty destination, NUL in text).
    Invalid(String),
    /// The database refused the insert; the transaction is aborted (was `txinbox::migrate`
    /// run?).
    Database(sqlx::Error),
}

impl fmt::Display for WriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WriteError::Invalid(m) => write!(f, "invalid outbox message: {m}"),
            WriteError::Database(e) => write!(
                f,
                "writing the outbox row failed: {e} (if txinbox.outbox is missing, run txinbox::migrate)"
            ),
        }
    }
}

impl std::error::Error for WriteError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WriteError::Invalid(_) => None,
            WriteError::Database(e) => Some(e),
        }
    }
}

const INSERT: &str = "\
INSERT INTO txinbox.outbox (message_id, destination, message_key, payload, header_names, header_values)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (message_id) DO NOTHING";

/// Writes `message` into the outbox on `executor` — normally the handler's transaction
/// (`cx.db()`, or use `Context::outbox`) or any sqlx transaction (`&mut *tx`). The row is
/// published only if that transaction commits.
///
/// Returns `true` if a row was inserted, `false` if a row with this message ID exists already
/// (nothing is written; the first write wins even if its payload differs). That makes a
/// handler that writes the same derived ID twice harmless. Once the relay's retention has
/// deleted the published row, the same ID can be written again and is published again: the
/// downstream inbox deduplicates it.
pub async fn write<'c, E>(executor: E, message: &OutboxMessage) -> Result<bool, WriteError>
where
    E: sqlx::Executor<'c, Database = sqlx::Postgres>,
{
    message.validate()?;
    let (names, values): (Vec<&str>, Vec<&[u8]>) = message.headers.iter().unzip();
    let done = sqlx::query(INSERT)
        .bind(&message.message_id)
        .bind(&message.destination)
        .bind(message.key.as_deref())
        .bind(message.payload.as_ref())
        .bind(names)
        .bind(values)
        .execute(executor)
        .await
        .map_err(WriteError::Database)?;
    Ok(done.rows_affected() == 1)
}

/// Why a [`Publisher`] did not get a broker confirmation.
#[derive(Debug)]
pub struct PublishError {
    permanent: bool,
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl PublishError {
    /// A failure a later attempt may not repeat (broker unreachable, timeout, not confirmed):
    /// the row is retried with backoff.
    pub fn transient(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        PublishError {
            permanent: false,
            source: source.into(),
        }
    }

    /// A failure no retry can fix (the message is too large, the destination is invalid):
    /// the row is dead-lettered at once.
    pub fn permanent(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        PublishError {
            permanent: true,
            source: source.into(),
        }
    }

    /// Whether retrying cannot help.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)
    }
}

impl std::error::Error for PublishError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// Sends outbox messages to a broker. Implemented by `txinbox-kafka`'s `KafkaPublisher` and
/// `txinbox-amqp`'s `AmqpPublisher`.
///
/// Contract:
/// - [`publish`](Self::publish) returns `Ok` only once the broker has **confirmed** the message
///   durably (Kafka: delivery report with `acks=all`; AMQP: publisher confirm, not returned as
///   unroutable). Anything else is an `Err`, including "maybe sent" (a timeout): the relay then
///   publishes the row again later, and consumers deduplicate on the message ID.
/// - The message ID travels with the message ([`ID_HEADER`]; on AMQP also `message_id`).
/// - The relay calls `publish` concurrently for different `(destination, key)` units, but
///   never for two messages of the same unit at once: it awaits each before the next. A
///   publisher must therefore keep nothing else in order.
/// - Cancellation: the relay may drop the future (shutdown, its own `publish_timeout`); a
///   dropped publish counts as not confirmed. Implementations should bound their own wait
///   below the relay's `publish_timeout`.
#[async_trait]
pub trait Publisher: Send + Sync + 'static {
    /// Publishes `message` and waits for the broker's confirmation.
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_ids_are_stable_and_separated() {
        let a = derive_id("order-1", "shipped");
        assert_eq!(a, derive_id("order-1", "shipped"));
        assert_eq!(a.len(), 64);
        assert_ne!(a, derive_id("order-1", "billed"));
        assert_ne!(a, derive_id("order-2", "shipped"));
        assert_ne!(derive_id("ab", "c"), derive_id("a", "bc"));
        // Pinned: changing the derivation would change IDs already in flight.
        let mut h = Sha256::new();
        h.update(b"order-1\0shipped");
        assert_eq!(a, hex(&h.finalize()));
    }

    #[test]
    fn invalid_messages_say_what_is_wrong() {
        let bad = |m: OutboxMessage, needle: &str| {
            let e = m.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        };
        bad(OutboxMessage::new("", "t", "p"), "empty");
        bad(OutboxMessage::new("x".repeat(MAX_ID_LEN + 1), "t", "p"), "limit");
        bad(OutboxMessage::new("id", "", "p"), "destination");
        bad(OutboxMessage::new("i\0d", "t", "p"), "NUL");
        assert!(OutboxMessage::new("id", "t", "p").validate().is_ok());
    }
}
