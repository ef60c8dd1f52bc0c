//! **Test support for txinbox: one scratch-database helper, and the conformance suites that every
//! `MessageSource`/`Delivery` and every outbox publisher runs.**
//!
//! - [`database`]: a fresh PostgreSQL database per test, migrated, dropped by the next run.
//! - [`cluster`]: a private PostgreSQL server a test may stop and start (outages), or that
//!   speaks TLS only.
//! - [`tls`]: a test certificate authority and the server and client certificates it issues,
//!   as PEM files, for TLS listeners a test starts.
//! - [`ledger`]: a deposit handler that is not idempotent, so a message applied twice shows.
//! - [`output`]: run a binary, capture what it prints, and search it for a secret in every
//!   form (plain, percent-encoded, base64, pieces).
//! - [`conformance`]: the contracts of `txinbox::MessageSource`, `txinbox::Delivery` and
//!   `txinbox::outbox::Publisher`, written once as tests that take the implementation under test.
//!   The in-memory broker, Kafka and RabbitMQ adapters run them; a third-party adapter runs them
//!   the same way.
//!
//! To unit-test your own handler, txinbox's `testing::HandlerTest` (feature `testing`) is
//! enough; with a scratch database from here:
//!
//! ```no_run
//! use txinbox::testing::{HandlerTest, Outcome};
//! use txinbox::{Context, Handler, HandlerError, Message, PostgresInbox};
//! use txinbox_testing::database::TestDatabase;
//!
//! struct Orders;
//!
//! #[txinbox::async_trait]
//! impl Handler<txinbox::sqlx::Postgres> for Orders {
//!     async fn handle(&self, cx: &mut Context<'_, txinbox::sqlx::Postgres>, _: &Message) -> Result<(), HandlerError> {
//!         txinbox::sqlx::query("INSERT INTO orders (id) VALUES ($1)")
//!             .bind(cx.message_id().as_str())
//!             .execute(cx.db())
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! #[tokio::test]
//! async fn orders_apply_once() -> Result<(), txinbox::Error> {
//!     let db = TestDatabase::new("orders_t").await; // a fresh database at DATABASE_URL, migrated
//!     txinbox::sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY)").execute(db.pool()).await?;
//!     let test = HandlerTest::new(PostgresInbox::new(db.pool().clone()), Orders);
//!     let order = test.message("order-1", "{}");
//!     assert_eq!(test.deliver(order.clone()).await?, Outcome::Applied { attempt: 1 });
//!     assert_eq!(test.deliver(order).await?, Outcome::Duplicate);
//!     db.drop_database().await;
//!     Ok(())
//! }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
// Library crates only: a `pub` item must be reachable from the crate root, so the public API
// is what the root and its public modules show (tests, tools and binaries have none).
#![warn(unreachable_pub)]

pub mod cluster;
pub mod conformance;
pub mod database;
pub mod ledger;
pub mod output;
pub mod tls;
