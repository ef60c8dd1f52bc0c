//! **txinbox-amqp: each RabbitMQ delivery is acknowledged only after its inbox row and the
//! handler's effects committed in one database transaction: at-least-once delivery becomes
//! effectively-once effects.**
//!
//! ```no_run
//! use txinbox::{Consumer, Context, Handler, HandlerError, Message, PostgresInbox};
//! use txinbox_amqp::{AmqpConfig, AmqpSource};
//!
//! struct Payments;
//!
//! #[txinbox::async_trait]
//! impl Handler<txinbox::sqlx::Postgres> for Payments {
//!     async fn handle(&self, cx: &mut Context<'_, txinbox::sqlx::Postgres>, msg: &Message) -> Result<(), HandlerError> {
//!         txinbox::sqlx::query("INSERT INTO payments (id, body) VALUES ($1, $2)")
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
//!     let config = AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f", "payments").prefetch(64);
//!     let source = AmqpSource::connect(config).await?; // an AmqpError: `?` keeps it as the cause
//!     Consumer::builder("payments")
//!         .source(source)
//!         .inbox(inbox)
//!         .handler(Payments)
//!         .build()?
//!         .run_until(async {
//!             tokio::signal::ctrl_c().await.ok();
//!         })
//!         .await
//! }
//! ```
//!
//! [`AmqpSource`] consumes one queue for a txinbox [`Consumer`](txinbox::Consumer) over lapin
//! (AMQP 0.9.1). Connecting fails with an [`AmqpError`], which says whether retrying can help.
//!
//! # What happens on the broker
//!
//! | situation | RabbitMQ |
//! |---|---|
//! | processed, or a duplicate | `basic.ack` on the delivery's own channel, coalesced: `multiple` for a run of settled deliveries, never past one that is not settled (see [`AmqpDelivery`]) |
//! | transient failure | a copy goes to `<queue>.retry` with `expiration` = the retry delay, confirmed, then the original is acked; on expiry the retry queue (a quorum queue, [`retry_queue_arguments`]) dead-letters the copy back to the work queue, at least once. Attempts are counted in the inbox database, not in `x-delivery-count` |
//! | permanent failure, attempts exhausted, conflict, undecodable, no message ID | a copy goes to `<queue>.dlq` with [`headers`] `x-txinbox-reason`, `x-txinbox-error`, `x-txinbox-original-queue`, confirmed, then the original is acked; without the original headers if they would not fit in a frame beside these ([`headers::HEADERS`]), without the payload if the broker refuses its size ([`headers::PAYLOAD`]) |
//! | the ack (or a copy) does not reach the broker | `settle` fails; the message is redelivered and the inbox deduplicates it |
//! | connection or channel lost, server `basic.cancel` | the supervisor reconnects with backoff, re-declares the topology, re-applies `basic.qos`, consumes again; deliveries of the old channel are never acked on the new one |
//! | a delivery dropped unsettled | nothing is sent, and no `multiple` ack covers it; redelivered when its channel closes |
//! | the channel lost with settled acks not yet sent | those `settle` calls fail; the messages are redelivered and the inbox skips them as duplicates |
//!
//! Dead-lettering publishes with confirms rather than rejecting to a dead-letter exchange: a
//! classic queue's dead-lettering is at-most-once and cannot add the reason headers.
//!
//! # Outbox publisher
//!
//! [`AmqpPublisher`] publishes the rows of txinbox's transactional outbox
//! ([`txinbox::outbox`]) for a [`txinbox::outbox::Relay`]: publisher confirms, `mandatory`
//! (unroutable = not published), persistent, one at a time on one channel; the row's ID as
//! `message_id` property, the [`txinbox::outbox::ID_HEADER`] header and the CloudEvents
//! `cloudEvents:id` (with `cloudEvents:specversion`, `:source`, `:type`), its key as
//! [`headers::KEY`].
//!
//! # Message identity
//!
//! [`IdStrategy::Native`](txinbox::IdStrategy::Native) (the default) reads the `message_id`
//! property. Other strategies work on the converted headers and payload:
//! `IdStrategy::Header(name)`, `IdStrategy::CloudEvents` (AMQP binding headers
//! `cloudEvents:id` / `cloudEvents_id`, or a structured JSON event), `IdStrategy::JsonPointer`.
//! A message without an ID is dead-lettered with reason `missing_id`; the queue keeps flowing.
//!
//! Header values are bytes: strings as they are (UTF-8), byte arrays raw, numbers, booleans,
//! decimals and timestamps in their decimal string form, arrays and tables as compact JSON.
//!
//! # Ordering
//!
//! Competing consumers by default: every delivery is [`Lane::Unordered`](txinbox::source::Lane). With
//! [`AmqpConfig::lane_header`], deliveries carrying that header are processed in order per
//! header value — within one consumer instance only, and not across a retry (a retried message
//! comes back behind later ones).
//!
//! # Retry queue caveat
//!
//! RabbitMQ expires per-message TTLs only at the head of a queue: a retry with a short delay
//! queued behind one with a long delay waits for it. The delay is a lower bound; with a
//! [`RetryPolicy`](txinbox::RetryPolicy) whose `max_delay` is modest this stretches little.
//!
//! # Broker settings worth knowing
//!
//! - `consumer_timeout` (30 min by default): a delivery unacknowledged that long makes the
//!   broker close the channel. Keep handlers far below it; the supervisor treats the close like
//!   any loss.
//!
//! # TLS
//!
//! `amqps://` verifies the broker's certificate (chain and host name) against the system's root
//! certificates, and the CA of [`AmqpTls::ca_file`] when set; [`AmqpTls::client_certificate`]
//! presents a client certificate, e.g. to log in with it (`?auth_mechanism=external`). The
//! source ([`AmqpConfig::tls`]), the publisher ([`AmqpPublisher::connect_with_tls`]) and the
//! `txinbox` CLI open every connection through [`AmqpTls::connect`], whose errors say what to
//! change (an untrusted CA, a host name the certificate does not list, `amqp://` to a TLS port).
//!
//! # Quorum queues
//!
//! [`AmqpConfig::queue_type`] declares the work and dead-letter queues as quorum queues (the
//! retry queue is one anyway). A queue that exists with other arguments is refused at connect
//! with RabbitMQ's text, which names the argument (`inequivalent arg 'x-queue-type'`), and what
//! to set; `declare_topology(false)` uses queues as they are.
//!
//! | | quorum queue | txinbox |
//! |---|---|---|
//! | a handler's transient failure | — | counted in the database; a copy through the retry queue, then an ack (the broker's `x-delivery-count` does not move) |
//! | attempts exhausted, permanent failure | — | dead letter recorded in the database, a copy to `<queue>.dlq`, then an ack |
//! | a consumer dies or loses its connection | every unacknowledged delivery is given back, `x-delivery-count` + 1 | the inbox deduplicates what was committed |
//! | `x-delivery-count` + 1 reaches the delivery limit | the next give-back drops the message (or dead-letters it to the queue's own DLX) | the delivery is replaced by a fresh copy before the handler sees it ([`AmqpConfig::delivery_limit`]) |
//!
//! RabbitMQ 4 gives quorum queues a `delivery-limit` of 20 by default (3.x: none); see
//! [`AmqpConfig::delivery_limit`] for what the fresh copy cannot cover (consumers dying again
//! and again before they reach a prefetched message) and how to turn the limit off.
//!
//! # Observability
//!
//! Reconnects are logged with `tracing` (warn on loss, info on recovery); metrics go through
//! the `metrics` facade, see [`telemetry`]. Nothing is installed by this crate. The URI's
//! password is never logged.

#![cfg_attr(docsrs, feature(doc_cfg))]
// Library crates only: a `pub` item must be reachable from the crate root, so the public API
// is what the root and its public modules show (tests, tools and binaries have none).
#![warn(unreachable_pub)]

mod acks;
mod config;
mod confirm;
mod delivery;
mod error;
mod fit;
pub mod headers;
mod publisher;
mod shared;
mod source;
pub mod telemetry;
mod tls;
mod tracker;

pub use config::{
    retry_queue_arguments, AmqpConfig, QueueType, DEFAULT_CONNECT_TIMEOUT, DEFAULT_DELIVERY_LIMIT,
    DEFAULT_PREFETCH, DEFAULT_PUBLISH_TIMEOUT, DEFAULT_RECONNECT_MAX, DEFAULT_RECONNECT_MIN,
    DEFAULT_REQUEUE_DELAY,
};
pub use confirm::{confirmed, Unconfirmed};
pub use delivery::AmqpDelivery;
pub use error::AmqpError;
pub use publisher::{AmqpPublisher, DEFAULT_CHANNELS, DEFAULT_CONFIRM_TIMEOUT};
pub use shared::AmqpMonitor;
pub use source::AmqpSource;
pub use tls::AmqpTls;

/// The lapin version this crate is built against, re-exported for [`AmqpDelivery::properties`].
pub use lapin;
