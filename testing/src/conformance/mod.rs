//! Conformance suites: the documented contracts of sources, deliveries, publishers and inbox
//! stores, written once as tests that take the implementation under test.
//!
//! | suite | contract | the implementation provides | in this workspace, run by |
//! |---|---|---|---|
//! | [`source`] | [`MessageSource`](txinbox::MessageSource), [`Delivery`](txinbox::Delivery) | a [`source::Harness`]: a fresh topic or queue per case, a way to publish into it, to open a source on it, to read its dead letters | `tests/source_conformance.rs` (memory broker), `adapters/kafka/tests/conformance.rs`, `adapters/amqp/tests/conformance.rs` |
//! | [`publisher`] | [`outbox::Publisher`](txinbox::outbox::Publisher) | a [`publisher::Harness`]: the publisher, a fresh destination per case and a way to read it back | the Kafka and RabbitMQ `tests/conformance.rs` |
//! | [`store`] | [`InboxStore`](txinbox::InboxStore) | a migrated store plus two read-back queries | `tests/store_conformance.rs` (PostgreSQL, SQLite) |
//!
//! Like Watermill's `tests.TestPubSub`, each suite is a list of cases, each an `async fn` that
//! panics when the implementation breaks the contract. Run them as one test per case with the
//! macros ([`source_conformance!`](crate::source_conformance),
//! [`publisher_conformance!`](crate::publisher_conformance)) so a failure names the case, or
//! all at once with `run_all`.
//!
//! A case the implementation cannot take part in (a source whose [`RetryMode`] is
//! [`InPlace`](txinbox::source::RetryMode::InPlace) is never asked to redeliver later; a harness that cannot
//! read dead letters back) **passes with a printed `SKIPPED` line** saying why; run with
//! `--nocapture` to see them. It never passes silently.
//!
//! # A third-party source
//!
//! A harness gives each case a stream of its own. This one wraps txinbox's in-memory broker;
//! yours creates a topic or queue with a unique name, publishes with your broker's client, and
//! opens your source on it (see `adapters/kafka/tests/conformance.rs` for a complete one).
//!
//! ```no_run
//! use txinbox::memory::{MemoryBroker, MemorySource};
//! use txinbox_testing::conformance::source::{Features, Harness, TestMessage};
//!
//! struct MyHarness {
//!     broker: MemoryBroker, // your broker client and the case's topic or queue
//! }
//!
//! #[txinbox::async_trait]
//! impl Harness for MyHarness {
//!     type Source = MemorySource; // your source
//!
//!     fn features(&self) -> Features {
//!         // Does a dropped delivery come back before the source is closed?
//!         Features::default().redelivers_while_open(true)
//!     }
//!     async fn publish(&self, m: TestMessage) {
//!         // publish m.payload with m.headers (and m.key, m.id) into the case's stream
//!         self.broker.publish_with(m.key.as_deref(), Some(m.id), m.headers, m.payload.into());
//!     }
//!     async fn open(&self) -> MemorySource {
//!         // a new member of the case's subscription (same group, same queue)
//!         self.broker.source()
//!     }
//!     // Optional: `dead_letters` (else those checks are skipped), `cleanup`.
//! }
//!
//! async fn harness(case: &'static str) -> MyHarness {
//!     MyHarness { broker: MemoryBroker::new(case) }
//! }
//!
//! // One #[tokio::test] per case, named after it (the test crate needs tokio).
//! txinbox_testing::source_conformance!(harness);
//! # fn main() {}
//! ```
//!
//! [`RetryMode`]: txinbox::source::RetryMode

pub mod publisher;
pub mod source;
pub mod store;

use std::time::Duration;

/// Prints the line that says a case (or a part of one) was skipped, and why.
pub(crate) fn skipped(case: &str, why: &str) {
    eprintln!("SKIPPED {case}: {why}");
}

/// Runs `f` to completion or panics naming `what` after `limit`.
pub(crate) async fn within<T>(limit: Duration, what: &str, f: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(limit, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: did not finish within {limit:?}"),
    }
}
