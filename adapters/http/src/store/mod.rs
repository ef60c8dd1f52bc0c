//! Where idempotency records live: [`Backend`], implemented for PostgreSQL
//! (`txinbox.http_idempotency`) and SQLite (`txinbox_http_idempotency`).

use std::future::Future;
use std::time::Duration;

use txinbox::janitor::{Janitor, Schedule, Sweep};
use txinbox::sqlx::{self, Pool, Postgres, Sqlite, Transaction};

pub(crate) mod postgres;
pub(crate) mod sqlite;

/// A stored response.
#[doc(hidden)]
#[derive(Debug)]
pub struct Stored {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) status: i16,
    pub(crate) header_names: Vec<String>,
    pub(crate) header_values: Vec<Vec<u8>>,
    pub(crate) body: Option<Vec<u8>>,
}

/// The record's key.
#[doc(hidden)]
#[derive(Debug)]
pub struct Scope<'a> {
    pub(crate) principal: &'a str,
    pub(crate) route: &'a str,
    pub(crate) key: &'a str,
}

/// What the claim decided.
#[doc(hidden)]
#[derive(Debug)]
pub enum Claimed {
    /// This transaction holds the key: run the handler.
    New,
    /// A committed, unexpired record holds it.
    Existing(Stored),
    /// The record kept changing under us (purged, expired and taken over); retry later.
    Unsettled,
}

/// A response to store.
#[doc(hidden)]
#[derive(Debug)]
pub struct Response<'a> {
    pub(crate) status: u16,
    pub(crate) header_names: Vec<&'a str>,
    pub(crate) header_values: Vec<&'a [u8]>,
    pub(crate) body: Option<&'a [u8]>,
    pub(crate) body_size: i64,
}

/// How a database error answers the client.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Lost a lock conflict ([`txinbox::store::is_lock_conflict`]): waited longer than the lock wait
    /// for the key's row (another request holds it), a deadlock or a serialization failure
    /// (409, retry later).
    LockWait,
    /// Unreachable, overloaded, shutting down, a lost connection, SQLite busy (503).
    Unavailable,
    /// The transaction was aborted by an earlier failed statement (PostgreSQL 25P02).
    Aborted,
    /// Anything else: a bug or a missing migration (500).
    Fatal,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Postgres {}
    impl Sealed for super::Sqlite {}
}

/// A database that can hold idempotency records: `sqlx::Postgres` or `sqlx::Sqlite`
/// (sealed). Run `txinbox::postgres::migrate` / `txinbox::sqlite::migrate` first.
///
/// | | PostgreSQL | SQLite |
/// |---|---|---|
/// | transaction | `BEGIN; SET LOCAL lock_timeout = <lock_wait>` | `BEGIN IMMEDIATE`: one writer at a time |
/// | concurrent duplicate | blocks on the key's row up to the lock wait, then replays or 409 | waits for the write lock (the pool's `busy_timeout`), then replays; 503 after the busy timeout |
/// | handler ignores a failed statement run on `IdempotentTx` | the transaction is aborted: 500, nothing committed | SQLite does not abort the transaction, but `IdempotentTx` saw the failure: 500, nothing committed |
/// | handler ignores a failed statement run on the connection itself (reached by deref) | the transaction is aborted: 500, nothing committed | not seen: what succeeded commits |
pub trait Backend: sqlx::Database + txinbox::TrackedDatabase + sealed::Sealed {
    #[doc(hidden)]
    fn begin(
        pool: &Pool<Self>,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn claim<'a>(
        conn: &'a mut Self::Connection,
        scope: &'a Scope<'a>,
        fingerprint: &'a [u8; 32],
        ttl: Duration,
    ) -> impl Future<Output = Result<Claimed, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    fn store<'a>(
        conn: &'a mut Self::Connection,
        scope: &'a Scope<'a>,
        response: &'a Response<'a>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    fn classify(e: &sqlx::Error) -> Failure;

    #[doc(hidden)]
    fn purge_batch(pool: &Pool<Self>, batch: i64) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    #[doc(hidden)]
    fn overdue(pool: &Pool<Self>) -> impl Future<Output = Result<Option<f64>, sqlx::Error>> + Send;
}

impl Backend for Postgres {
    fn begin(
        pool: &Pool<Self>,
        lock_wait: Duration,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send {
        postgres::begin(pool, lock_wait)
    }

    fn claim<'a>(
        conn: &'a mut Self::Connection,
        scope: &'a Scope<'a>,
        fingerprint: &'a [u8; 32],
        ttl: Duration,
    ) -> impl Future<Output = Result<Claimed, sqlx::Error>> + Send + 'a {
        postgres::claim(conn, scope, fingerprint, ttl)
    }

    fn store<'a>(
        conn: &'a mut Self::Connection,
        scope: &'a Scope<'a>,
        response: &'a Response<'a>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
        postgres::store(conn, scope, response)
    }

    fn classify(e: &sqlx::Error) -> Failure {
        postgres::classify(e)
    }

    fn purge_batch(pool: &Pool<Self>, batch: i64) -> impl Future<Output = Result<u64, sqlx::Error>> + Send {
        postgres::purge_batch(pool, batch)
    }

    fn overdue(pool: &Pool<Self>) -> impl Future<Output = Result<Option<f64>, sqlx::Error>> + Send {
        postgres::overdue(pool)
    }
}

impl Backend for Sqlite {
    fn begin(
        pool: &Pool<Self>,
        _lock_wait: Duration,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send {
        sqlite::begin(pool)
    }

    fn claim<'a>(
        conn: &'a mut Self::Connection,
        scope: &'a Scope<'a>,
        fingerprint: &'a [u8; 32],
        ttl: Duration,
    ) -> impl Future<Output = Result<Claimed, sqlx::Error>> + Send + 'a {
        sqlite::claim(conn, scope, fingerprint, ttl)
    }

    fn store<'a>(
        conn: &'a mut Self::Connection,
        scope: &'a Scope<'a>,
        response: &'a Response<'a>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
        sqlite::store(conn, scope, response)
    }

    fn classify(e: &sqlx::Error) -> Failure {
        sqlite::classify(e)
    }

    fn purge_batch(pool: &Pool<Self>, batch: i64) -> impl Future<Output = Result<u64, sqlx::Error>> + Send {
        sqlite::purge_batch(pool, batch)
    }

    fn overdue(pool: &Pool<Self>) -> impl Future<Output = Result<Option<f64>, sqlx::Error>> + Send {
        sqlite::overdue(pool)
    }
}

/// Deletes expired idempotency records, `batch` rows per statement, until none is left;
/// returns how many were deleted. One pass of [`janitor`], without pauses: what
/// `txinbox http purge` runs.
///
/// After expiry a key is new again: a retry with it runs the handler. So the TTL
/// ([`IdempotencyLayer::ttl`](crate::IdempotencyLayer::ttl), 24 h by default) must exceed
/// the longest time a client may retry. Safe to run while requests are served: a record being
/// taken over right now is skipped (PostgreSQL: locked; both: re-checked on delete).
pub async fn purge_expired<DB: Backend>(pool: &Pool<DB>, batch: i64) -> Result<u64, sqlx::Error> {
    let schedule = Schedule {
        batch: u32::try_from(batch.max(1)).unwrap_or(u32::MAX),
        pause: Duration::ZERO,
        ..Schedule::default()
    };
    janitor(pool.clone(), schedule)
        .map_err(|e| sqlx::Error::Configuration(e.into()))?
        .pass()
        .await
}

/// Expired Idempotency-Key records as a [`Sweep`]: deleted in batches, oldest expiry first;
/// its oldest-row clock is the expiry (`txinbox_retention_oldest_row_age_seconds` is how long
/// the earliest expired record has been overdue, 0 when none).
#[derive(Debug)]
pub struct IdempotencySweep<DB: Backend> {
    pool: Pool<DB>,
}

#[txinbox::async_trait]
impl<DB: Backend> Sweep for IdempotencySweep<DB> {
    async fn delete_batch(&self, batch: u32) -> Result<u64, sqlx::Error> {
        DB::purge_batch(&self.pool, i64::from(batch)).await
    }

    async fn oldest_age(&self) -> Result<Option<Duration>, sqlx::Error> {
        Ok(DB::overdue(&self.pool)
            .await?
            .map(|s| Duration::from_secs_f64(s.max(0.0))))
    }
}

/// The retention of Idempotency-Key records while a service runs: a [`Janitor`] (the one
/// mechanism txinbox's inbox and outbox retention use) that deletes expired records on
/// `schedule` (metrics with `table="http_idempotency"`). Run it beside the server:
/// `let running = Arc::new(janitor(pool, Schedule::default())?).spawn();` and
/// `running.stop().await` at shutdown. Deleting expired records changes no answer (an expired
/// key is new again either way): it only frees space.
pub fn janitor<DB: Backend>(pool: Pool<DB>, schedule: Schedule) -> Result<Janitor, String> {
    Janitor::new(IdempotencySweep { pool }, schedule, "http_idempotency", None)
}
