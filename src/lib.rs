//! **txinbox: the inbox row and the handler's effects commit in one database transaction, and the
//! broker is acknowledged only after that commit — at-least-once delivery becomes
//! effectively-once effects.**
//!
//! For each delivered message a [`Consumer`] derives the message's ID, opens a transaction,
//! inserts `(consumer, message ID)` into the inbox table, runs your [`Handler`] on the same
//! transaction, commits, and only then settles the delivery with the broker. A redelivered
//! message finds its ID in the inbox and is acknowledged without running the handler.
//!
//! ```
//! use txinbox::memory::MemoryBroker;
//! use txinbox::sqlx::{self, Sqlite};
//! use txinbox::{Consumer, Context, Handler, HandlerError, Message, SqliteInbox};
//!
//! #[derive(serde::Deserialize)]
//! struct Deposit {
//!     account: String,
//!     amount: i64,
//! }
//!
//! struct Deposits;
//!
//! #[txinbox::async_trait]
//! impl Handler<Sqlite> for Deposits {
//!     async fn handle(&self, cx: &mut Context<'_, Sqlite>, msg: &Message) -> Result<(), HandlerError> {
//!         let deposit: Deposit = msg.json()?; // undecodable: dead-lettered, never retried
//!         sqlx::query("UPDATE accounts SET balance = balance + ?1 WHERE id = ?2")
//!             .bind(deposit.amount)
//!             .bind(&deposit.account)
//!             .execute(cx.db()) // the inbox transaction
//!             .await?; // a database error is transient: rolled back, retried with backoff
//!         Ok(())
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), txinbox::Error> {
//!     # let dir = std::env::temp_dir().join(format!("txinbox-doc-{}", std::process::id()));
//!     # std::fs::create_dir_all(&dir).unwrap();
//!     let inbox = SqliteInbox::open(dir.join("app.db"), 8).await?;
//!     txinbox::sqlite::migrate(inbox.pool()).await?;
//!     sqlx::raw_sql("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL);
//!                    INSERT INTO accounts VALUES ('alice', 0)")
//!         .execute(inbox.pool())
//!         .await?;
//!
//!     // Any MessageSource: txinbox-kafka, txinbox-amqp, or the in-memory broker (feature `memory`).
//!     let broker = MemoryBroker::new("deposits");
//!     broker.publish("deposit-1", r#"{"account": "alice", "amount": 5}"#);
//!     broker.publish("deposit-1", r#"{"account": "alice", "amount": 5}"#); // delivered twice
//!     broker.close();
//!     Consumer::builder("deposits")
//!         .source(broker.source())
//!         .inbox(inbox.clone())
//!         .handler(Deposits)
//!         .build()?
//!         .run() // until the source is finished; `run_until(signal)` in a service
//!         .await?;
//!
//!     let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 'alice'")
//!         .fetch_one(inbox.pool())
//!         .await?;
//!     assert_eq!(balance, 5); // applied once
//!     # std::fs::remove_dir_all(&dir).ok();
//!     Ok(())
//! }
//! ```
//!
//! Kafka and PostgreSQL, a service in production shape, and a test for a handler
//! (`txinbox::testing::HandlerTest`, feature `testing`): the repository's README and its
//! `examples/service`.
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
//!   `txinbox-amqp`, or [`memory::MemoryBroker`] with feature `memory`); the rest of an adapter
//!   author's vocabulary is in [`source`].
//! - [`Handler`] / [`Context`] / [`HandlerError`]: your code, given the open transaction;
//!   [`Router`] to run several handlers in one consumer, by message type or destination.
//! - [`handler::BatchHandler`]: optional bulk form of a handler for micro-batches (one `UNNEST` or
//!   `COPY` for all new messages of a batch); batching itself is on by default
//!   ([`ConsumerBuilder::batch_size`]).
//! - [`InboxStore`]: where the inbox lives; [`PostgresInbox`] (feature `postgres`, module
//!   [`postgres`] with its migrations) or [`SqliteInbox`] (feature `sqlite`, module [`sqlite`]);
//!   what a store implementation works with is in [`store`].
//! - [`RetryPolicy`], [`IdStrategy`], [`message::Fingerprint`]: the knobs; the defaults are in
//!   [`consumer`].
//! - [`redact`]: how connection strings and secret properties are kept out of logs and errors.
//! - [`ops`] (feature `postgres`): the operator queries behind the `txinbox` CLI (status,
//!   retention, replay positions, dead letters).
//!
//! # Features
//!
//! | feature | default | what |
//! |---|---|---|
//! | `postgres` | yes | [`PostgresInbox`], [`postgres::migrate`] |
//! | `sqlite` | yes | [`SqliteInbox`], [`sqlite::migrate`]: the embedded store (bundled SQLite) |
//! | `memory` | yes | [`memory::MemoryBroker`], an in-process at-least-once broker with fault injection |
//! | `testing` | no | `testing::HandlerTest`: run your handler through the consumer on a real store, check its effects and outcome |
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
//! header) and outbox messages carry it on (see [`otel`]). Metrics go through the `metrics`
//! facade; see [`telemetry`] for names. The library never installs a subscriber, recorder or
//! exporter.
//!
//! # The root and the modules
//!
//! The root holds what every user of the crate names: the consumer, the handler, the message,
//! the stores, the errors. Everything else sits in a module by concern, as in sqlx:
//! [`consumer`] (defaults), [`handler`] (batch forms), [`message`] (identity, fingerprint,
//! headers, origin), [`source`] (what an adapter implements and reports), [`position`] (the
//! positions a consumer stores and hands to its source), [`dead_letter`] (what a dead letter
//! carries, and why), [`retry`] (retry policy, backoff), [`store`] (what an inbox store
//! implements), [`postgres`] and [`sqlite`] (the stores and their migrations), [`outbox`],
//! [`health`], [`telemetry`], [`redact`], [`ops`].

#![cfg_attr(docsrs, feature(doc_cfg))]
// Library crates only: a `pub` item must be reachable from the crate root, so the public API
// is what the root and its public modules show (tests, tools and binaries have none).
#![warn(unreachable_pub)]

pub mod consumer;
#[cfg(feature = "crash-points")]
pub mod crash;
#[cfg(not(feature = "crash-points"))]
pub(crate) mod crash;
pub mod dead_letter;
mod error;
pub mod handler;
pub mod health;
pub mod janitor;
pub mod message;
#[cfg(feature = "postgres")]
pub mod ops;
pub mod position;
pub mod redact;
pub mod retry;
mod router;
pub mod settings;
pub mod source;
pub mod store;
pub mod telemetry;
mod tracked;

#[cfg(feature = "memory")]
pub mod memory;
#[cfg(feature = "otel")]
pub mod otel;
pub mod outbox;
#[cfg(feature = "testing")]
pub mod testing;

/// The PostgreSQL inbox store and its embedded migrations (feature `postgres`).
///
/// The migrations create schema [`SCHEMA`](crate::postgres::SCHEMA) and keep their ledger in
/// `txinbox._sqlx_migrations`, apart from the application's own.
#[cfg(feature = "postgres")]
pub mod postgres {
    pub use crate::store::postgres::{check_tls_files, migrate, migrator, PostgresInbox, SCHEMA};
}

/// The embedded SQLite inbox store and its migrations (feature `sqlite`).
///
/// The migrations keep their ledger in `txinbox_sqlx_migrations`, apart from the
/// application's own `_sqlx_migrations`.
#[cfg(feature = "sqlite")]
pub mod sqlite {
    pub use crate::store::sqlite::{migrate, migrator, SqliteInbox};
}

pub use consumer::{Consumer, ConsumerBuilder};
pub use error::Error;
pub use handler::{Context, Handler, HandlerError};
pub use message::{IdStrategy, Message, MessageId};
pub use retry::RetryPolicy;
pub use router::Router;
pub use source::{Delivery, MessageSource};
pub use store::InboxStore;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub use tracked::TrackedDatabase;
pub use tracked::{StatementFailed, TrackedTransaction};

#[cfg(feature = "postgres")]
pub use store::postgres::PostgresInbox;
#[cfg(feature = "sqlite")]
pub use store::sqlite::SqliteInbox;

/// Re-exported so handlers and adapters use the same versions as txinbox.
pub use async_trait::async_trait;
pub use sqlx;
