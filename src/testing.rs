//! Unit tests for your [`Handler`]: [`HandlerTest`] runs it against one message on a real
//! store, through the consumer's own processing path, and tells you how the delivery ended
//! (feature `testing`).
//!
//! ```toml
//! [dev-dependencies]
//! txinbox = { version = "0.1", features = ["testing"] }
//! ```
//!
//! Each [`deliver`](HandlerTest::deliver) builds a [`Consumer`] on the store you chose, feeds
//! it the message from an in-process source and runs it until the message is settled: the
//! inbox claim, your handler in the inbox transaction, the check before COMMIT, the retry
//! policy and the dead-letter records are the ones production runs. You then look at the
//! database (your effects, the outbox rows) and at the [`Outcome`]:
//!
//! | outcome | when | inbox |
//! |---|---|---|
//! | [`Outcome::Applied`] | the handler returned `Ok` and its effects committed | row processed, effects committed |
//! | [`Outcome::Duplicate`] | the message was processed before: the handler did not run | unchanged |
//! | [`Outcome::Retry`] | a transient error with attempts left | rolled back, attempt counted |
//! | [`Outcome::DeadLettered`] | a permanent or undecodable error, attempts exhausted, a conflict, no ID | rolled back, dead letter recorded |
//!
//! A [`Retry`](Outcome::Retry) is not retried by the harness: deliver the message again to
//! run the next attempt (the attempt count lives in the database, as in production).
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # mod example {
//! use txinbox::testing::{HandlerTest, Outcome};
//! use txinbox::{Context, Handler, HandlerError, Message};
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
//! impl Handler<txinbox::sqlx::Sqlite> for Deposits {
//!     async fn handle(&self, cx: &mut Context<'_, txinbox::sqlx::Sqlite>, msg: &Message) -> Result<(), HandlerError> {
//!         let deposit: Deposit = msg.json()?;
//!         txinbox::sqlx::query("UPDATE accounts SET balance = balance + ?1 WHERE id = ?2")
//!             .bind(deposit.amount)
//!             .bind(&deposit.account)
//!             .execute(cx.db())
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! pub async fn deposits_apply_once() -> Result<(), txinbox::Error> {
//!     let test = HandlerTest::sqlite(Deposits).await?;
//!     test.execute("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER NOT NULL);
//!                   INSERT INTO accounts VALUES ('alice', 0)").await?;
//!
//!     let deposit = test.message("evt-1", r#"{"account": "alice", "amount": 5}"#);
//!     assert_eq!(test.deliver(deposit.clone()).await?, Outcome::Applied { attempt: 1 });
//!     assert_eq!(test.deliver(deposit).await?, Outcome::Duplicate);
//!
//!     let garbage = test.message("evt-2", "not json");
//!     assert!(test.deliver(garbage).await?.is_dead_lettered("undecodable"));
//!
//!     let (balance,): (i64,) = txinbox::sqlx::query_as("SELECT balance FROM accounts WHERE id = 'alice'")
//!         .fetch_one(test.pool())
//!         .await?;
//!     assert_eq!(balance, 5);
//!     Ok(())
//! }
//! # }
//! # #[cfg(feature = "sqlite")]
//! # tokio::runtime::Runtime::new().unwrap().block_on(example::deposits_apply_once()).unwrap();
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use crate::dead_letter::{DeadLetter, DeadLetterReason};
use crate::error::Error;
use crate::handler::{BatchContext, BatchHandler, BatchMessage, Context, Handler, HandlerError};
use crate::message::{Fingerprint, IdStrategy, Message, Origin};
use crate::retry::RetryPolicy;
use crate::source::{
    Capabilities, Delivery, Lane, MessageSource, RetryMode, SettleError, Settlement, SourceError,
};
use crate::store::InboxStore;
use crate::Consumer;

/// How a delivery ended: what the consumer told the broker, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler returned `Ok` on this attempt (counting from 1) and its effects committed
    /// with the inbox row; the broker was acknowledged.
    Applied {
        /// Which attempt it was.
        attempt: u32,
    },
    /// The inbox had processed this message already: the handler did not run, nothing was
    /// written; the broker was acknowledged.
    Duplicate,
    /// The handler failed transiently with attempts left: everything was rolled back, the
    /// attempt was counted, and the broker was asked to redeliver. Deliver the message again
    /// for the next attempt.
    Retry {
        /// The attempt that failed.
        attempt: u32,
        /// The delay the retry policy chose (with jitter).
        after: Duration,
    },
    /// The message was dead-lettered, and the dead letter recorded in the database: a
    /// permanent or undecodable error, attempts exhausted, a conflicting payload under a known
    /// ID, no ID, too large, no route.
    DeadLettered(DeadLetter),
}

impl Outcome {
    /// Whether the handler's effects committed.
    pub fn is_applied(&self) -> bool {
        matches!(self, Outcome::Applied { .. })
    }

    /// Whether the message was dead-lettered with `reason` (as recorded:
    /// [`DeadLetterReason::as_str`], e.g. `undecodable`, `permanent_error`,
    /// `attempts_exhausted`, `conflict`).
    pub fn is_dead_lettered(&self, reason: &str) -> bool {
        matches!(self, Outcome::DeadLettered(dl) if dl.reason.as_str() == reason)
    }

    /// The dead letter's reason, if it was dead-lettered.
    pub fn dead_letter_reason(&self) -> Option<DeadLetterReason> {
        match self {
            Outcome::DeadLettered(dl) => Some(dl.reason),
            _ => None,
        }
    }
}

/// A handler under test, on a real store: see the [module documentation](self).
///
/// Built with [`HandlerTest::sqlite`] (a scratch SQLite file, removed on drop),
/// [`HandlerTest::postgres`] (a database you name) or [`HandlerTest::new`] (any migrated
/// store). Settings that change what the consumer decides are the consumer's own:
/// [`consumer`](Self::consumer), [`id_strategy`](Self::id_strategy),
/// [`retry_policy`](Self::retry_policy), [`fingerprint`](Self::fingerprint).
pub struct HandlerTest<St, H> {
    inbox: St,
    handler: Arc<H>,
    name: String,
    id_strategy: IdStrategy,
    retry: RetryPolicy,
    fingerprint: Fingerprint,
    timeout: Duration,
    _scratch: Option<Scratch>,
}

impl<St: std::fmt::Debug, H> std::fmt::Debug for HandlerTest<St, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerTest")
            .field("inbox", &self.inbox)
            .field("consumer", &self.name)
            .field("id_strategy", &self.id_strategy)
            .finish_non_exhaustive()
    }
}

/// A consumer name no other `HandlerTest` of this process uses, so tests sharing a database
/// do not see each other's inbox rows.
fn unique_name() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "handler-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

impl<St, H> HandlerTest<St, H>
where
    St: InboxStore + Clone,
    H: Handler<St::Db>,
{
    /// `handler` on `inbox`, whose database has txinbox's migrations applied.
    pub fn new(inbox: St, handler: H) -> Self {
        HandlerTest {
            inbox,
            handler: Arc::new(handler),
            name: unique_name(),
            id_strategy: IdStrategy::Native,
            retry: RetryPolicy::default(),
            fingerprint: Fingerprint::default(),
            timeout: Duration::from_secs(60),
            _scratch: None,
        }
    }

    /// The consumer's name ([`Context::consumer`], the scope of [`Context::derive_id`]).
    /// Default: a name unique to this test, so that tests sharing a database stay apart.
    pub fn consumer(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// How message IDs are derived. Default: [`IdStrategy::Native`], the ID
    /// [`message`](Self::message) sets; use your production strategy (e.g.
    /// [`IdStrategy::CloudEvents`] for Kafka) with messages built as your producer does.
    pub fn id_strategy(mut self, strategy: IdStrategy) -> Self {
        self.id_strategy = strategy;
        self
    }

    /// The retry policy. Default: [`RetryPolicy::default`].
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How payload fingerprints are computed. Default: SHA-256 of the bytes.
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// How long [`deliver`](Self::deliver) waits for the message to be settled before it
    /// gives up (a database that is not reachable, a handler that never returns). Default 60 s.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The store.
    pub fn inbox(&self) -> &St {
        &self.inbox
    }

    /// A message with this payload whose ID under [`IdStrategy::Native`] (the default) is `id`.
    /// Add a key, headers or a timestamp with [`Message`]'s `with_*` methods.
    pub fn message(&self, id: &str, payload: impl Into<bytes::Bytes>) -> Message {
        Message::new(payload, Origin::new("test", "handler-test")).with_native_id(id)
    }

    /// Runs `message` through the consumer: ID, inbox claim, your handler in the inbox
    /// transaction, COMMIT or rollback, retry policy, dead-letter record; returns how the
    /// delivery ended.
    ///
    /// `Err` when the consumer stops (a missing table: run the migrations) or the message is
    /// not settled within the [`timeout`](Self::timeout).
    pub async fn deliver(&self, message: Message) -> Result<Outcome, Error> {
        let source = OneMessage {
            message: Some(message),
            settled: Arc::new(Mutex::new(None)),
        };
        let settled = source.settled.clone();
        let calls = Arc::new(Mutex::new(Calls::default()));
        let handler = Observed {
            inner: self.handler.clone(),
            calls: calls.clone(),
        };
        let consumer = Consumer::builder(self.name.clone())
            .source(source)
            .inbox(self.inbox.clone())
            .handler(handler)
            .id_strategy(self.id_strategy.clone())
            .retry_policy(self.retry.clone())
            .fingerprint(self.fingerprint)
            .concurrency(1)
            .max_in_flight(1)
            .build()?;
        let timeout = self.timeout;
        consumer.run_until(tokio::time::sleep(timeout)).await?;
        let settlement = settled.lock().unwrap_or_else(|e| e.into_inner()).take();
        let calls = calls.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match settlement {
            Some(Settlement::Ack) => match calls.last_ok_attempt {
                Some(attempt) => Ok(Outcome::Applied { attempt }),
                None => Ok(Outcome::Duplicate),
            },
            Some(Settlement::Retry { after }) => Ok(Outcome::Retry {
                attempt: calls.last_attempt.unwrap_or(0),
                after,
            }),
            Some(Settlement::DeadLetter(dl)) => Ok(Outcome::DeadLettered(dl)),
            None => Err(Error::Source(SourceError::fatal(format!(
                "HandlerTest: the message was not settled within {timeout:?} (is the database \
                 reachable? does the handler return?); raise it with HandlerTest::timeout"
            )))),
        }
    }
}

#[cfg(feature = "sqlite")]
impl<H: Handler<sqlx::Sqlite>> HandlerTest<crate::SqliteInbox, H> {
    /// `handler` on a scratch SQLite database (a file in the temporary directory, with
    /// txinbox's migrations applied), removed when the test is dropped. Create your own
    /// tables with [`execute`](Self::execute).
    pub async fn sqlite(handler: H) -> Result<Self, Error> {
        let scratch = Scratch::new();
        let inbox = crate::SqliteInbox::open(&scratch.path, 4).await?;
        crate::sqlite::migrate(inbox.pool()).await?;
        let mut test = HandlerTest::new(inbox, handler);
        test._scratch = Some(scratch);
        Ok(test)
    }

    /// The database's pool, to set up tables and rows and to check the handler's effects.
    pub fn pool(&self) -> &sqlx::SqlitePool {
        self.inbox.pool()
    }

    /// Runs `sql` (one or more statements) on the database: tables and rows the handler needs.
    pub async fn execute(&self, sql: &str) -> Result<(), Error> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(self.pool())
            .await?;
        Ok(())
    }
}

#[cfg(feature = "postgres")]
impl<H: Handler<sqlx::Postgres>> HandlerTest<crate::PostgresInbox, H> {
    /// `handler` on the PostgreSQL database at `url`, with txinbox's migrations applied (they
    /// are idempotent). Its inbox rows are under a consumer name of this test's own; your
    /// tables are yours to set up and clean.
    pub async fn postgres(url: &str, handler: H) -> Result<Self, Error> {
        let inbox = crate::PostgresInbox::connect(url, 4).await?;
        crate::postgres::migrate(inbox.pool()).await?;
        Ok(HandlerTest::new(inbox, handler))
    }

    /// The database's pool, to set up tables and rows and to check the handler's effects.
    pub fn pool(&self) -> &sqlx::PgPool {
        self.inbox.pool()
    }

    /// Runs `sql` (one or more statements) on the database: tables and rows the handler needs.
    pub async fn execute(&self, sql: &str) -> Result<(), Error> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(self.pool())
            .await?;
        Ok(())
    }
}

/// A scratch SQLite file, removed (with its WAL files) on drop.
#[cfg(feature = "sqlite")]
struct Scratch {
    path: std::path::PathBuf,
}

#[cfg(not(feature = "sqlite"))]
struct Scratch;

#[cfg(feature = "sqlite")]
impl Scratch {
    fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!(
            "txinbox-handler-test-{}-{}-{nanos}.db",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        Scratch { path }
    }
}

#[cfg(feature = "sqlite")]
impl Drop for Scratch {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.path.display()));
        }
    }
}

/// What the handler did during one delivery.
#[derive(Debug, Clone, Default)]
struct Calls {
    /// The attempt of the last run, whatever it returned.
    last_attempt: Option<u32>,
    /// The attempt of the last run, if it returned `Ok`.
    last_ok_attempt: Option<u32>,
}

/// The handler under test, watched: which attempt ran and whether it returned `Ok`. An `Ok`
/// that did not commit (a failed statement, COMMIT failing) ends in a retry, not an ack.
struct Observed<H> {
    inner: Arc<H>,
    calls: Arc<Mutex<Calls>>,
}

impl<H> Observed<H> {
    fn record(&self, attempt: u32, ok: bool) {
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.last_attempt = Some(attempt);
        calls.last_ok_attempt = ok.then_some(attempt);
    }
}

#[async_trait]
impl<DB: sqlx::Database, H: Handler<DB>> Handler<DB> for Observed<H> {
    async fn handle(&self, cx: &mut Context<'_, DB>, msg: &Message) -> Result<(), HandlerError> {
        let attempt = cx.attempt();
        let result = self.inner.handle(cx, msg).await;
        self.record(attempt, result.is_ok());
        result
    }

    fn batch(&self) -> Option<&dyn BatchHandler<DB>> {
        self.inner.batch().map(|_| self as &dyn BatchHandler<DB>)
    }
}

#[async_trait]
impl<DB: sqlx::Database, H: Handler<DB>> BatchHandler<DB> for Observed<H> {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, DB>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        let inner = self
            .inner
            .batch()
            .expect("batch() is Some only when the handler's is");
        let result = inner.handle_batch(cx, batch).await;
        if let Some(m) = batch.last() {
            self.record(m.attempt(), result.is_ok());
        }
        result
    }
}

/// A source of one message that records how it was settled and never redelivers.
struct OneMessage {
    message: Option<Message>,
    settled: Arc<Mutex<Option<Settlement>>>,
}

#[async_trait]
impl MessageSource for OneMessage {
    type Delivery = OneDelivery;

    async fn receive(&mut self) -> Result<Option<OneDelivery>, SourceError> {
        Ok(self.message.take().map(|message| OneDelivery {
            message,
            settled: self.settled.clone(),
        }))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            system: "test",
            retry: RetryMode::Redeliver,
            default_id_strategy: IdStrategy::Native,
        }
    }

    async fn close(self) -> Result<(), SourceError> {
        Ok(())
    }
}

struct OneDelivery {
    message: Message,
    settled: Arc<Mutex<Option<Settlement>>>,
}

#[async_trait]
impl Delivery for OneDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    fn lane(&self) -> Lane {
        Lane::Unordered
    }

    fn position_to_store(&self) -> Option<crate::position::Position> {
        None
    }

    async fn settle(self, settlement: Settlement) -> Result<(), SettleError> {
        *self.settled.lock().unwrap_or_else(|e| e.into_inner()) = Some(settlement);
        Ok(())
    }
}
