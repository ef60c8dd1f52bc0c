//! **txinbox: the inbox row and the handler's effects commit in one database transaction, and the
//! broker is acknowledged only after that commit — at-least-once delivery becomes
//! effectively-once effects.**
//!
//! For each delivered message a [`Consumer`] derives the message's ID, opens a transaction,
//! inserts `(consumer, message ID)` into the inbox table, runs your [`Handler`] on the same
//! transaction, commits, and only then settles the delivery with the broker. A redelivered
//! message finds its ID in the inbox and is acknowledged without running the handler.
//!
//! | situation | inbox | broker |
//! |---|---|---|
//! | handler `Ok` | row committed with the effects | ack |
//! | duplicate (same ID, same payload fingerprint) | unchanged | ack, counted |
//! | conflict (same ID, other payload) | unchanged, dead letter recorded | dead-letter, counted |
//! | transient error, attempts left | rolled back, attempt counted apart | retry after backoff |
//! | permanent error, attempts exhausted, undecodable, no ID, too large | rolled back, dead letter recorded | dead-letter |
//! | handler panics | rolled back | treated as transient |
//! | redelivery of a dead-lettered message | unchanged | dead-letter again (recorded reason), not recorded again |
//! | commit ok, ack lost | committed | none: the redelivery is a duplicate |
//! | COMMIT outcome unknown | unknown | none: the redelivery or the next attempt decides |
//! | process killed anywhere | open transaction rolled back by PostgreSQL | none: redelivery |
//! | database unreachable | nothing written | nothing acked; intake pauses, resumes by itself |
//! | lock conflict (deadlock, serialization failure, lock timeout, SQLite busy) | rolled back | re-run after a backoff, no attempt counted |
//! | oversized message or ID | not read beyond the limit | dead-lettered (`too_large`, `invalid_id`), stored cut with its size and SHA-256 |
//!
//! # Pieces
//!
//! - [`MessageSource`] / [`Delivery`]: what a broker adapter implements (`txinbox-kafka`,
//!   `txinbox-amqp`, or [`memory::MemoryBroker`] with feature `memory`).
//! - [`Handler`] / [`Context`] / [`HandlerError`]: your code, given the open transaction;
//!   [`Router`] to run several handlers in one consumer, by message type or destination.
//! - [`BatchHandler`]: optional bulk form of a handler for micro-batches (one `UNNEST` or
//!   `COPY` for all new messages of a batch); batching itself is on by default
//!   ([`ConsumerBuilder::batch_size`]).
//! - [`InboxStore`]: where the inbox lives; [`PostgresInbox`] (feature `postgres`) or
//!   [`SqliteInbox`] (feature `sqlite`).
//! - [`RetryPolicy`], [`IdStrategy`], [`Fingerprint`]: the knobs.
//! - [`redact`]: how connection strings and secret properties are kept out of logs and errors.
//! - [`ops`] (feature `postgres`): the operator queries behind the `txinbox` CLI (status,
//!   retention, replay positions, dead letters).
//!
//! # Features
//!
//! | feature | default | what |
//! |---|---|---|
//! | `postgres` | yes | [`PostgresInbox`], [`migrate`] |
//! | `sqlite` | yes | [`SqliteInbox`], [`migrate_sqlite`]: the embedded store (bundled SQLite) |
//! | `memory` | yes | [`memory::MemoryBroker`], an in-process at-least-once broker with fault injection |
//! | `otel` | no | [`otel`]: W3C trace context across hops: a delivery's span is a child of the producer's, outbox rows carry the writer's context to the next consumer |
//! | `crash-points` | no | [`crash`]: named points where a test build aborts the process on request |
//!
//! [`outbox`] is the transactional outbox, on PostgreSQL and SQLite: rows written with the
//! effects, published at least once by a [`outbox::Relay`] (Kafka and AMQP publishers in the
//! adapters).
//!
//! # Observability
//!
//! Each message runs in a `txinbox.process` span carrying OpenTelemetry messaging attributes
//! (`messaging.system`, `messaging.destination.name`, `messaging.message.id`,
//! `messaging.consumer.group.name`, partition and offset where known) plus `txinbox.attempt` and
//! `txinbox.outcome`. With feature `otel` the span continues the producer's trace (`traceparent`
//! header) and outbox messages carry it on (see [`otel`]). Metrics go through the `metrics` facade; see [`telemetry`] for names. The
//! library never installs a subscriber, recorder or exporter.

mod consumer;
pub mod crash;
mod dead_letter;
mod error;
mod handler;
pub mod health;
mod message;
#[cfg(feature = "postgres")]
pub mod ops;
mod position;
pub mod redact;
mod retry;
mod router;
mod source;
mod store;
pub mod telemetry;

#[cfg(feature = "memory")]
pub mod memory;
#[cfg(feature = "otel")]
pub mod otel;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub mod outbox;

pub use consumer::{
    Consumer, ConsumerBuilder, DEFAULT_CONCURRENCY, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_MESSAGE_BYTES,
};
pub use consumer::{DEFAULT_BATCH_LINGER, DEFAULT_BATCH_SIZE};
pub use dead_letter::{DeadLetter, DeadLetterReason};
pub use error::Error;
pub use handler::{BatchContext, BatchHandler, BatchMessage};
pub use handler::{Context, Handler, HandlerError};
pub use message::{Fingerprint, Headers, IdError, IdStrategy, Message, MessageId, Origin, MAX_ID_LEN};
pub use position::{ConsumerPositions, Position, PositionStore};
pub use retry::{Backoff, RetryPolicy};
pub use router::Router;
pub use source::{
    Capabilities, Delivery, Lane, MessageSource, RetryMode, SettleError, Settlement, SourceError,
};
pub use store::{
    is_lock_conflict, Claim, Connection, DeadLetterOutcome, DeadLetterRecord, Entry, InboxStatus, InboxStore,
    StoreError, MAX_ERROR_LEN,
};

#[cfg(feature = "postgres")]
pub use store::postgres::{migrate, migrator, PostgresInbox, SCHEMA};
#[cfg(feature = "sqlite")]
pub use store::sqlite::{migrate_sqlite, sqlite_migrator, SqliteInbox};

/// Re-exported so handlers and adapters use the same versions as txinbox.
pub use async_trait::async_trait;
pub use sqlx;
