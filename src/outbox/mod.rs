//! The transactional outbox (PostgreSQL and SQLite): messages a handler wants to send are
//! written as rows in the same transaction as its effects, and a [`Relay`] publishes them
//! afterwards, at least once, through a broker-neutral [`Publisher`].
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
//!         // Same consumer + same incoming message + same step name = same ID on every retry.
//!         let event = OutboxMessage::new(cx.derive_id("order-placed"), "orders.placed", msg.payload().clone())
//!             .with_key("customer-42");
//!         cx.outbox(&event).await?;
//!         Ok(())
//!     }
//! }
//! ```
//!
//! Outside a consumer, write on any sqlx transaction: `outbox::write(&mut *tx, &message)`, with an
//! ID from `outbox::derive_id(scope, parent, step)` or your own.
//!
//! # Guarantees
//!
//! - A row exists exactly when the transaction that wrote it committed.
//! - Every committed row is published at least once (or dead-lettered after bounded attempts),
//!   with its message ID: header [`ID_HEADER`], the CloudEvents `id` in binary mode (Kafka
//!   `ce_id`, AMQP `cloudEvents:id`) with `specversion`, `source` and `type`
//!   ([`OutboxMessage::broker_headers`]), and on AMQP the `message_id` property. Consumers
//!   deduplicate on it; the Kafka and AMQP sources do with their default settings.
//! - Order: rows with the same `(destination, key)` are published in the order of their row
//!   IDs (the order their transactions inserted them; rows written by *concurrent*
//!   transactions for one key have no defined order). A row that fails is retried before any
//!   later row of its key is attempted; dead-lettering it lets the key move on. Rows without a
//!   key are published in no particular order.
//! - Several relays may run on one outbox: a key is published by one relay at a time (except
//!   that a row committed after a later row of its key was claimed may be published alongside
//!   the rows of transactions it overlapped with, and on SQLite that a round stalled past its
//!   lease may share its rows with the next; see [`Relay`]).
//!
//! # PostgreSQL and SQLite
//!
//! On PostgreSQL the outbox is `txinbox.outbox` ([`postgres::migrate`](crate::postgres::migrate)); a relay claims
//! rows with `FOR UPDATE SKIP LOCKED` inside the transaction that marks them and is woken by
//! `LISTEN/NOTIFY`. On SQLite it is `txinbox_outbox` ([`sqlite::migrate`](crate::sqlite::migrate));
//! SQLite has one writer and no notifications, so a relay takes a time-limited *lease* on the
//! rows it claims (a short write transaction), publishes with no lock held (writers are not
//! blocked while the broker confirms), marks the rows in a second short transaction, and looks
//! for new rows every `poll_interval`. The guarantees above hold on both; what differs is in
//! [`Relay`] ("SQLite").

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod relay;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use relay::{Backlog, OutboxPool, Relay, RelayConfig, RelayError, RelayRound};

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};

use crate::message::{hex, Headers, MAX_ID_LEN};

/// The header that carries an outbox message's ID on the broker (Kafka record header; AMQP
/// header, besides the `message_id` property), as does the CloudEvents `id` attribute (see
/// [`OutboxMessage::broker_headers`]). A downstream consumer deduplicates on either:
/// `IdStrategy::Header(txinbox::outbox::ID_HEADER.into())`, or the default strategies of the
/// Kafka (CloudEvents) and AMQP (`message_id`) sources.
pub const ID_HEADER: &str = "message-id";

/// The CloudEvents `specversion` a published message carries unless its headers say another.
pub const CLOUDEVENTS_SPEC_VERSION: &str = "1.0";

/// The CloudEvents `source` a published message carries unless its headers or its publisher
/// (`KafkaPublisherBuilder::source`, `AmqpPublisher::source`) say another: the outbox that
/// assigned the ID, within which IDs are unique. Name your service instead where consumers
/// look at it.
pub const DEFAULT_SOURCE: &str = "urn:txinbox:outbox";

/// How a broker names the CloudEvents attributes of a message in binary content mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloudEventsBinding {
    /// The Kafka protocol binding: record headers `ce_<attribute>`.
    Kafka,
    /// The AMQP binding: application properties (RabbitMQ headers) `cloudEvents:<attribute>`.
    Amqp,
}

impl CloudEventsBinding {
    fn prefix(self) -> &'static str {
        match self {
            CloudEventsBinding::Kafka => "ce_",
            CloudEventsBinding::Amqp => "cloudEvents:",
        }
    }
}

/// The header names a CloudEvents attribute goes by in binary mode on any broker: Kafka
/// `ce_`, AMQP `cloudEvents:` and its older `cloudEvents_` spelling.
fn attribute_names(attribute: &str) -> [String; 3] {
    [
        format!("ce_{attribute}"),
        format!("cloudEvents:{attribute}"),
        format!("cloudEvents_{attribute}"),
    ]
}

/// The databases an outbox can live in: [`sqlx::Postgres`] (feature `postgres`) and
/// [`sqlx::Sqlite`] (feature `sqlite`). Sealed: [`write()`] and [`Relay`] know their SQL.
pub trait OutboxDatabase: sqlx::Database + sealed::Sealed {}

pub(crate) mod sealed {
    use super::*;

    /// For the row holding a message's ID: whether its destination, key and payload are the
    /// same as the message's.
    pub(crate) type Differs = (bool, bool, bool);

    /// The database-specific half of [`write()`](super::write).
    pub trait Sealed {
        /// Inserts the row, or finds the one that holds its ID and says whether destination,
        /// key and payload are the same (`None`: the identical message is there already).
        fn insert<'e, 'c: 'e, E>(
            executor: E,
            message: &'e OutboxMessage,
            headers: &'e Headers,
        ) -> BoxFuture<'e, Result<Option<Differs>, sqlx::Error>>
        where
            E: sqlx::Executor<'c, Database = Self> + 'e,
            Self: sqlx::Database;
    }
}

/// The PostgreSQL `NOTIFY` channel a trigger on `txinbox.outbox` signals after each inserting
/// statement (delivered when its transaction commits).
#[cfg(feature = "postgres")]
pub const NOTIFY_CHANNEL: &str = "txinbox_outbox";

/// Derives a downstream message ID from the message being handled: the lowercase hex SHA-256
/// of `len(scope) ‖ scope ‖ len(parent) ‖ parent ‖ step` (lengths as 4-byte big-endian).
///
/// - `scope` is who derives it: in a handler, the consumer name (that is what
///   [`Context::derive_id`](crate::Context::derive_id) passes), so two consumers that handle the
///   same event with the same step name derive two IDs, not one row that drops the other's
///   message; elsewhere any stable name of the writer (a service, an HTTP route).
/// - `parent` is the incoming message's ID; `step` names the message among those the handler
///   emits (`"shipped"`, `"line-3"`).
///
/// Deterministic, so a retried handler writes the same IDs; the length prefixes keep
/// `("ab", "c")` and `("a", "bc")` apart. Chains compose: later stages derive from earlier IDs.
pub fn derive_id(scope: &str, parent: &str, step: &str) -> String {
    let mut h = Sha256::new();
    for part in [scope, parent] {
        h.update((part.len() as u32).to_be_bytes());
        h.update(part.as_bytes());
    }
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

    /// Sets the headers. Headers that carry an ID ([`ID_HEADER`], the CloudEvents `id`) are
    /// replaced by the message ID on publish; see [`broker_headers`](Self::broker_headers).
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

    /// The headers a [`Publisher`] sends with this message on a broker whose CloudEvents
    /// binding is `binding`, so that a consumer finds its ID whichever way it looks: first
    /// [`ID_HEADER`], then the CloudEvents binary-mode attributes under the binding's names
    /// (Kafka `ce_specversion`, `ce_id`, `ce_source`, `ce_type`; AMQP `cloudEvents:…`), then
    /// the message's own headers.
    ///
    /// - `id` is always the message ID: a header of the message that carries another ID
    ///   ([`ID_HEADER`], `ce_id`, `cloudEvents:id`, `cloudEvents_id`) is left out, or a
    ///   consumer could deduplicate two different messages into one.
    /// - `specversion`, `source` and `type` are the message's own if it sets them under any
    ///   binding's name (`ce_type` works on AMQP too; for `type` also a plain `type` header,
    ///   which [`Message::message_type`](crate::Message::message_type) reads), and are never
    ///   overwritten. Otherwise `specversion` is [`CLOUDEVENTS_SPEC_VERSION`], `source` is
    ///   `source` (the publisher's; [`DEFAULT_SOURCE`] if empty) and `type` the destination.
    pub fn broker_headers(&self, binding: CloudEventsBinding, source: &str) -> Headers {
        let own = |attribute: &str| {
            attribute_names(attribute)
                .iter()
                .find_map(|name| self.headers.get(name))
        };
        let source = if source.is_empty() { DEFAULT_SOURCE } else { source };
        let id = self.message_id.as_bytes();
        let attributes: [(&str, &[u8]); 4] = [
            (
                "specversion",
                own("specversion").unwrap_or(CLOUDEVENTS_SPEC_VERSION.as_bytes()),
            ),
            ("id", id),
            ("source", own("source").unwrap_or(source.as_bytes())),
            (
                "type",
                own("type")
                    .or_else(|| self.headers.get("type"))
                    .unwrap_or(self.destination.as_bytes()),
            ),
        ];
        let mut out = Headers::new().with(ID_HEADER, Bytes::copy_from_slice(id));
        let mut written = vec![ID_HEADER.to_owned()];
        for (attribute, value) in attributes {
            let name = format!("{}{attribute}", binding.prefix());
            out.insert(name.clone(), Bytes::copy_from_slice(value));
            written.push(name);
        }
        let carries_an_id = attribute_names("id");
        for (name, value) in self.headers.iter() {
            if !written.iter().any(|w| w == name) && !carries_an_id.iter().any(|n| n == name) {
                out.insert(name, Bytes::copy_from_slice(value));
            }
        }
        out
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
///
/// In a handler, `?` makes [`Invalid`](WriteError::Invalid) and
/// [`Conflict`](WriteError::Conflict) permanent failures (the message is dead-lettered: writing
/// it again cannot succeed) and [`Database`](WriteError::Database) a transient one.
#[derive(Debug)]
#[non_exhaustive]
pub enum WriteError {
    /// The message cannot be stored (empty or overlong ID, empty destination, NUL in text).
    Invalid(String),
    /// A row with this message ID exists with another destination, key or payload: two
    /// different messages got one ID. Nothing was written; the transaction is still usable.
    Conflict {
        /// The message ID both share.
        message_id: String,
        /// What differs: `destination`, `key` or `payload`.
        differs: &'static str,
    },
    /// The database refused the insert (was `txinbox::postgres::migrate` or `txinbox::sqlite::migrate`
    /// run?). PostgreSQL aborts the transaction; SQLite may not, so never commit a transaction
    /// whose outbox write failed: its effects would commit without their message.
    Database(sqlx::Error),
}

impl fmt::Display for WriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WriteError::Invalid(m) => write!(f, "invalid outbox message: {m}"),
            WriteError::Conflict { message_id, differs } => write!(
                f,
                "outbox message ID {message_id} is taken by a message with another {differs}: two \
                 different messages derived one ID (derive each from its own step name; IDs \
                 from derive_id include the consumer)"
            ),
            WriteError::Database(e) => write!(
                f,
                "writing the outbox row failed: {e} (if the outbox table is missing, run \
                 txinbox::postgres::migrate or txinbox::sqlite::migrate)"
            ),
        }
    }
}

impl std::error::Error for WriteError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WriteError::Invalid(_) | WriteError::Conflict { .. } => None,
            WriteError::Database(e) => Some(e),
        }
    }
}

impl WriteError {
    /// Whether writing the same message again cannot succeed (an invalid message, a
    /// conflicting ID), as opposed to a database failure.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, WriteError::Database(_))
    }
}

/// Writes `message` into the outbox on `executor` — normally the handler's transaction
/// (`cx.db()`, or use `Context::outbox`) or any sqlx transaction (`&mut *tx`), PostgreSQL or
/// SQLite; on a pool it is a transaction of its own. The row is published only if that
/// transaction commits.
///
/// Returns `true` if a row was inserted, `false` if the same message (same ID, destination,
/// key and payload) is in the outbox already: a handler that writes one derived ID twice is
/// harmless. The same ID with another destination, key or payload is
/// [`WriteError::Conflict`], never a silent no-op: one of two different messages would be
/// lost. Headers are not compared (they may carry per-attempt data, such as trace context).
/// With feature `otel`, the current span's trace context is added to the stored headers
/// (`traceparent`, `tracestate`, unless the message carries a `traceparent` already), so the
/// relay publishes it and the next consumer continues the trace (see [`crate::otel`]).
/// Once the relay's retention has deleted the published row, the same ID can be written
/// again and is published again: the downstream inbox deduplicates it.
pub async fn write<'c, E>(executor: E, message: &OutboxMessage) -> Result<bool, WriteError>
where
    E: sqlx::Executor<'c>,
    E::Database: OutboxDatabase,
{
    message.validate()?;
    #[cfg(feature = "otel")]
    let traced = crate::otel::with_current_context(&message.headers);
    #[cfg(feature = "otel")]
    let headers = traced.as_ref().unwrap_or(&message.headers);
    #[cfg(not(feature = "otel"))]
    let headers = &message.headers;
    let row = <E::Database as sealed::Sealed>::insert(executor, message, headers)
        .await
        .map_err(WriteError::Database)?;
    let differs = match row {
        None => return Ok(false),
        Some((true, true, true)) => return Ok(true),
        Some((false, _, _)) => "destination",
        Some((_, false, _)) => "key",
        Some(_) => "payload",
    };
    Err(WriteError::Conflict {
        message_id: message.message_id.clone(),
        differs,
    })
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
/// - The message ID travels with the message: send the headers of
///   [`OutboxMessage::broker_headers`] ([`ID_HEADER`] and the CloudEvents attributes; on AMQP
///   also the `message_id` property).
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

    /// Whether the broker would take a publish now, found out without publishing anything
    /// (Kafka: a metadata request). `None`: this publisher cannot tell (the default).
    ///
    /// The relay asks only while it reports the broker unavailable and a round had no row of
    /// its own to try (with several relays, another one may take every new row): without an
    /// answer it could only keep reporting the outage until it had a row again. It reports
    /// `Some(Ok(()))` as connected and `None` as unknown (no evidence either way). Bound the
    /// wait below the relay's `publish_timeout`.
    async fn probe(&self) -> Option<Result<(), PublishError>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_ids_are_stable_and_separated() {
        let a = derive_id("billing", "order-1", "shipped");
        assert_eq!(a, derive_id("billing", "order-1", "shipped"));
        assert_eq!(a.len(), 64);
        assert_ne!(a, derive_id("billing", "order-1", "billed"));
        assert_ne!(a, derive_id("billing", "order-2", "shipped"));
        assert_ne!(a, derive_id("shipping", "order-1", "shipped"), "another consumer");
        assert_ne!(derive_id("s", "ab", "c"), derive_id("s", "a", "bc"));
        assert_ne!(derive_id("sa", "b", "c"), derive_id("s", "ab", "c"));
        // Pinned: changing the derivation would change IDs already in flight.
        let mut h = Sha256::new();
        h.update(b"\0\0\0\x07billing\0\0\0\x07order-1shipped");
        assert_eq!(a, hex(&h.finalize()));
    }

    #[test]
    fn published_headers_carry_the_id_as_cloudevents_attributes() {
        let m = OutboxMessage::new("evt-1", "orders.placed", "{}")
            .with_headers(Headers::new().with("traceparent", "00-ab"));
        let h = m.broker_headers(CloudEventsBinding::Kafka, "");
        let got: Vec<(&str, &[u8])> = h.iter().collect();
        let want: Vec<(&str, &[u8])> = vec![
            (ID_HEADER, b"evt-1"),
            ("ce_specversion", b"1.0"),
            ("ce_id", b"evt-1"),
            ("ce_source", DEFAULT_SOURCE.as_bytes()),
            ("ce_type", b"orders.placed"),
            ("traceparent", b"00-ab"),
        ];
        assert_eq!(got, want);
        let h = m.broker_headers(CloudEventsBinding::Amqp, "/billing");
        assert_eq!(h.get_str("cloudEvents:id"), Some("evt-1"));
        assert_eq!(h.get_str("cloudEvents:source"), Some("/billing"));
        assert_eq!(h.get_str("cloudEvents:specversion"), Some("1.0"));
        assert_eq!(h.get_str("cloudEvents:type"), Some("orders.placed"));
        assert_eq!(h.get("ce_id"), None);
    }

    #[test]
    fn the_writers_attributes_are_kept_and_its_ids_replaced() {
        let own = Headers::new()
            .with("ce_type", "order.placed")
            .with("cloudEvents:source", "/shop")
            .with("ce_specversion", "1.0-rc")
            .with("ce_id", "copied-from-the-incoming-event")
            .with("cloudEvents_id", "another")
            .with(ID_HEADER, "forged")
            .with("tenant", "t-1");
        let m = OutboxMessage::new("evt-2", "orders", "{}").with_headers(own);
        for (binding, prefix) in [
            (CloudEventsBinding::Kafka, "ce_"),
            (CloudEventsBinding::Amqp, "cloudEvents:"),
        ] {
            let h = m.broker_headers(binding, "/ignored");
            let attr = |a: &str| h.get_str(&format!("{prefix}{a}")).map(str::to_owned);
            assert_eq!(attr("type").as_deref(), Some("order.placed"), "{binding:?}");
            assert_eq!(attr("source").as_deref(), Some("/shop"), "{binding:?}");
            assert_eq!(attr("specversion").as_deref(), Some("1.0-rc"), "{binding:?}");
            assert_eq!(attr("id").as_deref(), Some("evt-2"), "{binding:?}");
            let id_names = [ID_HEADER, "ce_id", "cloudEvents:id", "cloudEvents_id"];
            let ids: Vec<(&str, &[u8])> = h.iter().filter(|(n, _)| id_names.contains(n)).collect();
            assert_eq!(
                ids.len(),
                2,
                "{binding:?}: {ID_HEADER} and the binding's id: {ids:?}"
            );
            assert!(ids.iter().all(|(_, v)| *v == b"evt-2"), "{binding:?}: {ids:?}");
            assert_eq!(h.get_str("tenant"), Some("t-1"));
            let names: Vec<&str> = h.iter().map(|(n, _)| n).collect();
            let mut unique = names.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), names.len(), "no name twice: {names:?}");
            // What a consumer derives, with the CloudEvents strategy (Kafka's default).
            let msg = crate::Message::new(&b"{}"[..], crate::message::Origin::new("t", "orders"))
                .with_headers(h.clone());
            assert_eq!(
                crate::IdStrategy::CloudEvents.derive(&msg).unwrap().as_str(),
                "evt-2"
            );
            assert_eq!(msg.message_type(), Some("order.placed"));
        }
        let typed = OutboxMessage::new("evt-3", "orders", "{}")
            .with_headers(Headers::new().with("type", "order.cancelled"));
        let h = typed.broker_headers(CloudEventsBinding::Kafka, "");
        assert_eq!(
            h.get_str("ce_type"),
            Some("order.cancelled"),
            "a plain type header counts"
        );
        assert_eq!(h.get_str("type"), Some("order.cancelled"));
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
