//! **txinbox-kafka: each record's inbox row, its handler's effects and its partition's next
//! offset commit in one database transaction, and the offset reaches Kafka only after that
//! commit: a Kafka consumer group with effectively-once effects.**
//!
//! ```no_run
//! use txinbox::{Consumer, Context, Handler, HandlerError, Message, PostgresInbox};
//! use txinbox_kafka::{KafkaConfig, KafkaSource};
//!
//! struct Deposits;
//!
//! #[txinbox::async_trait]
//! impl Handler<txinbox::sqlx::Postgres> for Deposits {
//!     async fn handle(&self, cx: &mut Context<'_, txinbox::sqlx::Postgres>, msg: &Message) -> Result<(), HandlerError> {
//!         txinbox::sqlx::query("INSERT INTO deposits (id, body) VALUES ($1, $2)")
//!             .bind(cx.message_id().as_str())
//!             .bind(&msg.payload()[..])
//!             .execute(cx.db()) // the inbox transaction
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), txinbox::Error> {
//!     let inbox = PostgresInbox::connect("postgres://postgres@127.0.0.1:5432/postgres", 10).await?;
//!     txinbox::postgres::migrate(inbox.pool()).await?;
//!     let config = KafkaConfig::new("127.0.0.1:9092", "payments").topic("deposits");
//!     let source = KafkaSource::new(config)?; // a KafkaError: `?` keeps it as the cause
//!     Consumer::builder("payments-service") // the source reads this consumer's positions
//!         .source(source)
//!         .inbox(inbox)
//!         .handler(Deposits)
//!         .build()?
//!         .run_until(async {
//!             tokio::signal::ctrl_c().await.ok();
//!         })
//!         .await
//! }
//! ```
//!
//! [`KafkaSource`] implements [`txinbox::MessageSource`] over rdkafka (bundled, statically
//! linked librdkafka 2.12.1). Give it to a [`txinbox::Consumer`] together with a
//! [`txinbox::PostgresInbox`]; each record's inbox row, its effects *and its partition's next
//! offset* commit in one transaction, and the offset is stored in Kafka only after that commit.
//! Each record's timestamp, with its type, is the message's
//! [`timestamp`](txinbox::Message::timestamp). Creating a source or a publisher fails with a
//! [`KafkaError`], which says whether retrying can help.
//!
//! [`KafkaPublisher`] publishes the rows of txinbox's transactional outbox
//! ([`txinbox::outbox`]) for a [`txinbox::outbox::Relay`]: idempotent producer, `acks=all`,
//! `Ok` only on a delivery report, the row's key as the record key (per-key order = partition
//! order), the message ID in the [`txinbox::outbox::ID_HEADER`] header and as the CloudEvents
//! `ce_id` (with `ce_specversion`, `ce_source`, `ce_type`), which a [`KafkaSource`] reads by
//! default.
//!
//! # Health and lag
//!
//! The source reports to the consumer's [`txinbox::health::Health`] the partitions assigned
//! (`topic/partition`, after every rebalance) and the broker connection (from librdkafka's
//! statistics: connected while any broker is up). [`telemetry::LAG`] is the high
//! watermark minus the database position per partition, from the same statistics, every
//! `statistics.interval.ms` (5 s unless set). Both are read on the poller thread without
//! network calls.
//!
//! # What it guarantees
//!
//! | situation | what happens |
//! |---|---|
//! | crash after the database commit, before the offset commit | the restart resumes at the database position: nothing re-applied, nothing skipped |
//! | database restored from a backup | the restart resumes where the restored database ends: the lost messages are applied again, once |
//! | a partition the group has committed but the database has no position for (a dump taken before it was first processed, a fresh database) | by [`KafkaConfig::on_missing_position`]: held with an ERROR until a position is written (default, [`MissingPosition::Refuse`]), or from the earliest offset, or from the group's offset; never silently skipped |
//! | a database position below the broker's low watermark (retention deleted records never processed) | by [`KafkaConfig::on_retention_gap`]: ERROR naming the offsets lost, counted in [`telemetry::OFFSETS_DELETED_UNPROCESSED`], then held until another position is written (default, [`RetentionGap::Refuse`]) or started at the earliest retained offset; never `auto.offset.reset` in silence |
//! | neither a database position nor a group offset | `auto.offset.reset` (default `earliest`); a group offset of 0 starts at the earliest retained offset |
//! | a held partition, an assignment waiting for the database, a dead-letter topic the broker says does not exist (looked up at start) | the consumer's health is not ready, with a problem naming the cause ([`txinbox::health::HealthReport::source_problems`]) |
//! | rebalance (eager or cooperative-sticky) | revoked partitions stop, drain (bounded), commit, then move; the new owner starts at the database position |
//! | offset commit fails (`REBALANCE_IN_PROGRESS`, `ILLEGAL_GENERATION`, `_STATE`, broker down) | logged at info; the database position decides where the next owner starts |
//! | message without an ID under the ID strategy | dead-lettered with reason `missing_id`, never processed undeduplicated |
//! | handler error: permanent, undecodable payload, attempts exhausted | dead letter on `<topic>.dlq` with `txinbox.dlq.*` headers, confirmed before the offset is stored; the partition moves on |
//! | dead letter too large for the dead-letter topic | a copy without the payload (size and SHA-256 in headers), then without the original headers too; the partition moves on |
//! | dead-letter topic refuses for good (authorization, invalid topic) | ERROR, counted in [`telemetry::DEAD_LETTERS_REFUSED`]; the database's dead-letter row is the record; the partition moves on |
//! | dead-letter topic unavailable (transient) | retried while assigned (fail closed), visible in [`telemetry::DEAD_LETTERS_WAITING`] and a WARN with the partition |
//! | the brokers refuse the connection (a CA that is not trusted, a certificate for another host, a client certificate required, a SASL login refused, plaintext at a TLS listener) | librdkafka retries; the consumer is not ready with a `kafka-connection` problem that says what to change, in librdkafka's words ([`ConnectionContext`]); nothing is acked or skipped |
//! | two consumer groups under one consumer name | the source stops with a fatal error (they would share one inbox and skip each other's messages) |
//! | shutdown | intake stops, in-flight messages finish, final offsets are committed synchronously, the consumer leaves the group off the async runtime within [`KafkaConfig::close_timeout`] |
//!
//! # Limits
//!
//! - Lanes are whole partitions; key sub-lanes inside a partition are not implemented.
//! - The database positions belong to the consumer *name*: two services reading one topic need
//!   two consumer names (and two group ids).
//! - Loading positions at assignment retries while the database is down (fail closed, reported
//!   not ready); if that exceeds `max.poll.interval.ms`, librdkafka leaves the group and rejoins
//!   later.
//! - The low watermark is compared with the database position on assignment only: a consumer
//!   that falls behind retention while it runs gets librdkafka's `auto.offset.reset`.
//! - `Debug` output and client-creation errors mask secret property values
//!   ([`txinbox::redact`]).

#![cfg_attr(docsrs, feature(doc_cfg))]
// Library crates only: a `pub` item must be reachable from the crate root, so the public API
// is what the root and its public modules show (tests, tools and binaries have none).
#![warn(unreachable_pub)]

mod assignment;
mod config;
mod connection;
mod dead_letter;
mod delivery;
mod error;
mod poller;
mod produce;
mod publisher;
mod ready;
mod retention;
mod source;
mod state;
mod tracker;

pub use config::{
    parse_properties, KafkaConfig, Keyless, MissingPosition, Ordering, RetentionGap, DEFAULT_CLOSE_TIMEOUT,
    DEFAULT_DEAD_LETTER_TIMEOUT, DEFAULT_MAX_BUFFERED_PER_PARTITION, DEFAULT_REVOKE_TIMEOUT,
};
pub use connection::ConnectionContext;
pub use delivery::KafkaDelivery;
pub use error::KafkaError;
pub use publisher::{KafkaPublisher, KafkaPublisherBuilder, DEFAULT_DELIVERY_TIMEOUT};
pub use source::KafkaSource;

/// The rdkafka this crate is built with, for a service's own Kafka clients and types
/// (`rdkafka::ClientConfig`, admin calls): one rdkafka in the build, with the features this
/// crate enables (`ssl`, `zstd`, …). rdkafka-sys links librdkafka, so a dependency graph can
/// hold only one rdkafka-sys anyway; a service that names `rdkafka = "0.39"` itself shares this
/// one and may add features to it (Cargo unifies them).
pub use rdkafka;

/// Headers added to every dead-letter record (besides the original record's headers).
pub mod headers {
    /// Machine-readable reason: `permanent_error`, `undecodable`, `missing_id`, `conflict`, …
    pub const REASON: &str = "txinbox.dlq.reason";
    /// The error text.
    pub const ERROR: &str = "txinbox.dlq.error";
    /// The original topic.
    pub const TOPIC: &str = "txinbox.dlq.original.topic";
    /// The original partition (decimal).
    pub const PARTITION: &str = "txinbox.dlq.original.partition";
    /// The original offset (decimal).
    pub const OFFSET: &str = "txinbox.dlq.original.offset";
    /// The original record timestamp in milliseconds since the epoch (decimal; empty if none).
    pub const TIMESTAMP: &str = "txinbox.dlq.original.timestamp";
    /// The txinbox consumer name that dead-lettered the record.
    pub const CONSUMER: &str = "txinbox.dlq.consumer";
    /// `omitted` when the copy carries no payload: the whole record was too large for the
    /// dead-letter producer or topic. [`ORIGINAL_SIZE`] and [`ORIGINAL_SHA256`] describe it;
    /// the database's `txinbox.dead_letters` row holds the payload (up to its cap).
    pub const PAYLOAD: &str = "txinbox.dlq.payload";
    /// `omitted` when the copy does not carry the original record's headers either (still too
    /// large without the payload).
    pub const HEADERS: &str = "txinbox.dlq.headers";
    /// The original payload's size in bytes (decimal), when the payload is omitted.
    pub const ORIGINAL_SIZE: &str = "txinbox.dlq.original.size";
    /// The SHA-256 of the original payload (lowercase hex), when the payload is omitted.
    pub const ORIGINAL_SHA256: &str = "txinbox.dlq.original.sha256";
}

/// Metric names this crate records (through the `metrics` facade).
pub mod telemetry {
    /// Counter, label `kind` (`assign`, `revoke`, `error`): rebalance callbacks.
    pub const REBALANCES: &str = "txinbox_kafka_rebalances_total";
    /// Counter: partitions paused because too many of their messages were unsettled.
    pub const PAUSES: &str = "txinbox_kafka_partition_pauses_total";
    /// Counter, label `topic`: dead letters produced and confirmed.
    pub const DEAD_LETTERS_PRODUCED: &str = "txinbox_kafka_dead_letters_produced_total";
    /// Counter, labels `topic` (the dead-letter topic) and `form` (`payload_omitted`,
    /// `headers_omitted`): dead letters confirmed in a reduced form because the whole record
    /// was too large (see [`headers::PAYLOAD`](crate::headers::PAYLOAD)).
    pub const DEAD_LETTERS_REDUCED: &str = "txinbox_kafka_dead_letters_reduced_total";
    /// Counter, labels `topic` (the dead-letter topic) and `code`: dead letters the topic
    /// refused for good (authorization, invalid topic, still too large without payload and
    /// headers). The database's dead-letter row is the record; the partition goes on. Alert
    /// on any increase.
    pub const DEAD_LETTERS_REFUSED: &str = "txinbox_kafka_dead_letters_refused_total";
    /// Gauge, label `topic` (the dead-letter topic): dead letters waiting for the topic after a
    /// transient produce failure (broker down, timeout). Each holds its partition (fail
    /// closed) until it is confirmed or the partition is revoked. Alert when it stays above 0.
    pub const DEAD_LETTERS_WAITING: &str = "txinbox_kafka_dead_letters_waiting";
    /// Gauge, labels `consumer` and `topic`: partitions held because the group has a committed
    /// offset and the database no position for them
    /// ([`MissingPosition::Refuse`](crate::MissingPosition::Refuse)), or because their
    /// database position is behind the broker's retention
    /// ([`RetentionGap::Refuse`](crate::RetentionGap::Refuse)). Alert when above 0.
    pub const PARTITIONS_BLOCKED: &str = "txinbox_kafka_partitions_blocked";
    /// Counter, labels `consumer`, `topic` and `partition`: offsets between a partition's
    /// database position and the broker's low watermark, found when the partition was assigned
    /// (or a held one got a new position): records retention deleted before the consumer
    /// processed them ([`RetentionGap`](crate::RetentionGap)). Counted each time a gap is found,
    /// so a held partition found again after a rebalance counts again. Alert on any increase.
    pub const OFFSETS_DELETED_UNPROCESSED: &str = "txinbox_kafka_offsets_deleted_unprocessed_total";
    /// Gauge, labels `consumer`, `topic` and `partition`: the partition's high watermark minus
    /// the consumer's database position (the next offset its effects committed; before any,
    /// the first offset received), i.e. messages not yet processed. From librdkafka's
    /// statistics every `statistics.interval.ms` (default here: 5 s); 0 once the partition is
    /// no longer assigned to this member. Alert when it keeps growing.
    pub const LAG: &str = "txinbox_kafka_lag";
}
