//! [`SqliteInbox`]: the inbox in SQLite, for services whose business data lives in SQLite and
//! for zero-setup demos; and [`migrate`].
//!
//! Same semantics as [`PostgresInbox`](crate::PostgresInbox). SQLite has one writer at a time,
//! so every message transaction starts with `BEGIN IMMEDIATE`: it takes the write lock up
//! front (waiting up to the busy timeout), which makes the inbox claim the serialisation point
//! just as PostgreSQL's unique index is, and rules out lock-upgrade deadlocks.

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{Connection, Sqlite, Transaction};

use super::{Claim, DeadLetterOutcome, DeadLetterRecord, Entry, InboxStore, StoreError, Taken};
use crate::dead_letter::DeadLetterReason;
use crate::position::Position;

/// The embedded SQLite migrations, with their ledger in `txinbox_sqlx_migrations`.
pub fn migrator() -> sqlx::migrate::Migrator {
    let mut m = sqlx::migrate!("./migrations/sqlite");
    m.dangerous_set_table_name("txinbox_sqlx_migrations");
    m
}

/// Applies txinbox's SQLite migrations. Idempotent; the ledger is `txinbox_sqlx_migrations`,
/// apart from the application's own `_sqlx_migrations`.
pub async fn migrate(pool: &SqlitePool) -> Result<(), sqlx::migrate::MigrateError> {
    migrator().run(pool).await
}

/// The inbox in SQLite.
#[derive(Debug, Clone)]
pub struct SqliteInbox {
    pool: SqlitePool,
}

impl SqliteInbox {
    /// Runs `sql` ([`SAVE_POSITION`] or [`ADVANCE_POSITION`]) for `p`.
    async fn write_position(
        &self,
        sql: &'static str,
        conn: &mut SqliteConnection,
        consumer: &str,
        p: &Position,
    ) -> Result<(), StoreError> {
        sqlx::query(sql)
            .bind(consumer)
            .bind(&*p.source)
            .bind(&*p.lane)
            .bind(p.next)
            .execute(conn)
            .await
            .map_err(|e| self.classify(e))?;
        Ok(())
    }

    /// An inbox on an existing pool whose options went through
    /// [`connect_options`](Self::connect_options). Run [`migrate`] once before consuming.
    ///
    /// Give the pool the check [`open`](Self::open) gives its own, so that a connection left
    /// counting a transaction it no longer has is closed rather than handed out again (its
    /// next BEGIN would fail, and stop the consumer):
    /// `SqlitePoolOptions::new().before_acquire(|conn, _| Box::pin(async move { Ok(!conn.is_in_transaction()) }))`
    /// (with `sqlx::Connection` in scope).
    pub fn new(pool: SqlitePool) -> Self {
        SqliteInbox { pool }
    }

    /// Opens (creating if missing) the database file at `path` with
    /// [`connect_options`](Self::connect_options) and a pool of `max_connections`.
    pub async fn open(path: impl AsRef<Path>, max_connections: u32) -> Result<Self, StoreError> {
        let options =
            Self::connect_options(SqliteConnectOptions::new().filename(path).create_if_missing(true));
        let pool = SqlitePoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(30))
            // A connection sqlx still counts a transaction on, though SQLite ended it (a
            // handler's ROLLBACK on a path that rolls back around `rollback`, such as the HTTP
            // layer's; a COMMIT SQLite rolled back itself on a full disk): closed, not handed
            // out. Its next BEGIN would fail with `InvalidSavePointStatement`, fatal to a
            // consumer. By acquire time the release's ping has run any ROLLBACK sqlx queued.
            .before_acquire(|conn, _| Box::pin(async move { Ok(!conn.is_in_transaction()) }))
            .connect_with(options)
            .await
            .map_err(classify)?;
        Ok(SqliteInbox { pool })
    }

    /// The settings the inbox relies on: WAL journal (readers never block the writer),
    /// `synchronous = FULL` (a commit is durable before the broker is acked) and a 30 s busy
    /// timeout (a writer waits for the lock instead of failing).
    pub fn connect_options(options: SqliteConnectOptions) -> SqliteConnectOptions {
        options
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(30))
    }

    /// [`classify`], except that a pool timeout while every connection is checked out is an
    /// overload (busy), not an outage: the pool could not hand out a connection because all of
    /// them were in use, not because the server was unreachable. (A timeout while connections
    /// sit idle, or while the pool is below its size, comes from connecting: an outage.)
    fn classify(&self, e: sqlx::Error) -> StoreError {
        let saturated =
            self.pool.num_idle() == 0 && self.pool.size() >= self.pool.options().get_max_connections();
        if matches!(e, sqlx::Error::PoolTimedOut) && saturated {
            return StoreError::busy(format!(
                "every one of the pool's {} connections stayed in use for the whole acquire timeout (the pool is too small for its load: the consumer's concurrency plus whatever else the application runs on it)",
                self.pool.size()
            )).in_store(super::Store::Sqlite);
        }
        classify(e)
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

/// A savepoint set right after `BEGIN IMMEDIATE`: `confirm`'s proof that the transaction it
/// checks is the one `begin` opened. A handler that ended the transaction (`ROLLBACK` on its
/// connection), even one that began another after it, took the savepoint with it. COMMIT
/// commits through it; ROLLBACK rolls back through it.
const OPEN_MARK: &str = "SAVEPOINT txinbox_open";

/// Releases [`OPEN_MARK`], failing with "no such savepoint" if it is gone, and sets it again.
const CHECK_OPEN_MARK: &str = "RELEASE txinbox_open; SAVEPOINT txinbox_open";

const CLAIM: &str = "\
INSERT INTO txinbox_inbox
    (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at,
     source_system, destination, source_partition, source_offset)
VALUES (?1, ?2, ?3, ?4, 'processed', 1, CAST(unixepoch('subsec') * 1000 AS INTEGER), ?5, ?6, ?7, ?8)
ON CONFLICT (consumer, message_id) DO UPDATE
    SET status = 'processed', attempts = txinbox_inbox.attempts + 1, processed_at = excluded.processed_at
    WHERE txinbox_inbox.status = 'retrying' AND txinbox_inbox.fingerprint = excluded.fingerprint
RETURNING attempts";

const RECORD_FAILURE: &str = "\
INSERT INTO txinbox_inbox
    (consumer, message_id, id_strategy, fingerprint, status, attempts, last_error,
     source_system, destination, source_partition, source_offset)
VALUES (?1, ?2, ?3, ?4, 'retrying', 1, ?9, ?5, ?6, ?7, ?8)
ON CONFLICT (consumer, message_id) DO UPDATE
    SET attempts = txinbox_inbox.attempts + 1, last_error = excluded.last_error
    WHERE txinbox_inbox.status = 'retrying' AND txinbox_inbox.fingerprint = excluded.fingerprint
RETURNING attempts";

const MARK_DEAD: &str = "\
INSERT INTO txinbox_inbox
    (consumer, message_id, id_strategy, fingerprint, status, attempts, last_error, processed_at,
     source_system, destination, source_partition, source_offset)
VALUES (?1, ?2, ?3, ?4, 'dead_lettered', ?10, ?9, CAST(unixepoch('subsec') * 1000 AS INTEGER), ?5, ?6, ?7, ?8)
ON CONFLICT (consumer, message_id) DO UPDATE
    SET status = 'dead_lettered', attempts = excluded.attempts,
        last_error = excluded.last_error, processed_at = excluded.processed_at
    WHERE txinbox_inbox.status = 'retrying' AND txinbox_inbox.fingerprint = excluded.fingerprint";

/// See the PostgreSQL store's statement of the same name.
const INSERT_DEAD_LETTER: &str = "\
INSERT INTO txinbox_dead_letters
    (consumer, message_id, id_strategy, fingerprint, reason, error, attempts, payload, headers,
     source_system, destination, source_partition, source_offset, payload_size, payload_sha256,
     truncated)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)
ON CONFLICT DO NOTHING
RETURNING id";

/// `?2`: the duplicates' IDs as a JSON array, repeats included.
const RECORD_DUPLICATES: &str = "\
UPDATE txinbox_inbox
SET duplicates = duplicates + (SELECT count(*) FROM json_each(?2) WHERE value = txinbox_inbox.message_id)
WHERE consumer = ?1 AND message_id IN (SELECT value FROM json_each(?2))";

const SAVE_POSITION: &str = "\
INSERT INTO txinbox_positions (consumer, source, lane, next_position)
VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (consumer, source, lane) DO UPDATE
    SET next_position = excluded.next_position,
        updated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// [`SAVE_POSITION`] that never moves a stored position back.
const ADVANCE_POSITION: &str = "\
INSERT INTO txinbox_positions (consumer, source, lane, next_position)
VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (consumer, source, lane) DO UPDATE
    SET next_position = excluded.next_position,
        updated_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)
    WHERE txinbox_positions.next_position < excluded.next_position";

/// See the PostgreSQL store's statement of the same name.
const RECORD_SUBSCRIPTION: &str = "\
INSERT INTO txinbox_subscriptions (consumer, source_system, source, subscription)
VALUES (?1, ?2, ?3, ?4)
ON CONFLICT (consumer, source_system, source) DO UPDATE
    SET last_seen_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)
    WHERE txinbox_subscriptions.subscription = excluded.subscription
RETURNING 1";

macro_rules! bind_entry {
    ($q:expr, $e:expr) => {{
        let e: &Entry<'_> = $e;
        $q.bind(e.consumer)
            .bind(e.id.as_str())
            .bind(e.id.strategy())
            .bind(&e.fingerprint[..])
            .bind(e.origin.system)
            .bind(&*e.origin.destination)
            .bind(e.origin.partition)
            .bind(e.origin.offset)
    }};
}

#[async_trait]
impl InboxStore for SqliteInbox {
    type Db = Sqlite;

    async fn begin(&self) -> Result<Transaction<'static, Sqlite>, StoreError> {
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| self.classify(e))?;
        // The mark `confirm` looks for: see OPEN_MARK.
        sqlx::raw_sql(OPEN_MARK)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.classify(e))?;
        Ok(tx)
    }

    async fn commit(&self, tx: Transaction<'static, Sqlite>) -> Result<(), StoreError> {
        tx.commit().await.map_err(|e| self.classify(e))
    }

    async fn rollback(&self, mut tx: Transaction<'static, Sqlite>) {
        // NOTE: a handler may have ended the transaction itself (ROLLBACK on its connection).
        // Then sqlx's ROLLBACK fails, sqlx goes on counting the transaction, and the next BEGIN
        // on the connection fails (fatal). So a BEGIN first: refused inside a transaction (the
        // usual case, one in-process statement), it opens one where the handler ended ours,
        // and the ROLLBACK always ends something.
        let _ = sqlx::raw_sql("BEGIN").execute(&mut *tx).await;
        drop(tx.rollback().await);
    }

    async fn claim(&self, conn: &mut SqliteConnection, entry: &Entry<'_>) -> Result<Claim, StoreError> {
        let attempts: Option<i64> = bind_entry!(sqlx::query_scalar(CLAIM), entry)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| self.classify(e))?;
        if let Some(attempt) = attempts {
            return Ok(Claim::New {
                attempt: attempt as u32,
            });
        }
        let row: Option<(String, Vec<u8>)> = sqlx::query_as(
            "SELECT status, fingerprint FROM txinbox_inbox WHERE consumer = ?1 AND message_id = ?2",
        )
        .bind(entry.consumer)
        .bind(entry.id.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| self.classify(e))?;
        Claim::from_existing(row, entry)
    }

    async fn confirm(&self, conn: &mut SqliteConnection, entry: &Entry<'_>) -> Result<bool, StoreError> {
        // SQLite rolls back only a failed statement, not the transaction, but a handler can
        // still end the transaction itself. Then the row alone does not tell: another
        // connection may have committed a redelivery of the message since. The mark does: it
        // is released (and set again, for a later check) only inside the transaction `begin`
        // opened.
        match sqlx::raw_sql(CHECK_OPEN_MARK).execute(&mut *conn).await {
            Ok(_) => {}
            // Gone with the transaction; the caller rolls back through `rollback`, which ends
            // whatever the handler left on the connection.
            Err(sqlx::Error::Database(e)) if e.message().contains("no such savepoint") => return Ok(false),
            Err(e) => return Err(self.classify(e)),
        }
        let found = sqlx::query_scalar::<_, i32>(
            "SELECT 1 FROM txinbox_inbox WHERE consumer = ?1 AND message_id = ?2 AND status = 'processed'",
        )
        .bind(entry.consumer)
        .bind(entry.id.as_str())
        .fetch_optional(conn)
        .await
        .map_err(|e| self.classify(e))?;
        Ok(found.is_some())
    }

    async fn save_position(
        &self,
        conn: &mut SqliteConnection,
        consumer: &str,
        p: &Position,
    ) -> Result<(), StoreError> {
        self.write_position(SAVE_POSITION, conn, consumer, p).await
    }

    async fn advance_position(
        &self,
        conn: &mut SqliteConnection,
        consumer: &str,
        p: &Position,
    ) -> Result<(), StoreError> {
        self.write_position(ADVANCE_POSITION, conn, consumer, p).await
    }

    async fn record_duplicates(
        &self,
        conn: &mut SqliteConnection,
        entries: &[Entry<'_>],
    ) -> Result<(), StoreError> {
        let Some(first) = entries.first() else {
            return Ok(());
        };
        let ids: Vec<&str> = entries.iter().map(|e| e.id.as_str()).collect();
        sqlx::query(RECORD_DUPLICATES)
            .bind(first.consumer)
            .bind(serde_json::to_string(&ids).expect("strings serialize"))
            .execute(conn)
            .await
            .map_err(|e| self.classify(e))?;
        Ok(())
    }

    async fn record_failure(&self, entry: &Entry<'_>, error: &str) -> Result<Option<u32>, StoreError> {
        let attempts: Option<i64> = bind_entry!(sqlx::query_scalar(RECORD_FAILURE), entry)
            .bind(error)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.classify(e))?;
        Ok(attempts.map(|a| a as u32))
    }

    async fn dead_letter(&self, r: &DeadLetterRecord<'_>) -> Result<DeadLetterOutcome, StoreError> {
        let mut tx = self.begin().await?;
        let (mut reason, mut error, mut outcome) =
            (r.reason, r.error.to_owned(), DeadLetterOutcome::Recorded);
        if let Some(entry) = r
            .entry
            .as_ref()
            .filter(|_| r.reason != DeadLetterReason::Conflict)
        {
            let marked = bind_entry!(sqlx::query(MARK_DEAD), entry)
                .bind(r.error)
                .bind(r.attempts as i64)
                .execute(&mut *tx)
                .await
                .map_err(|e| self.classify(e))?;
            if marked.rows_affected() == 0 {
                let row = sqlx::query_as(
                    "SELECT status, fingerprint FROM txinbox_inbox WHERE consumer = ?1 AND message_id = ?2",
                )
                .bind(entry.consumer)
                .bind(entry.id.as_str())
                .fetch_optional(&mut *tx)
                .await
                .map_err(|e| self.classify(e))?;
                match Taken::decide(row, entry, r.error)? {
                    // A message too large to read was fingerprinted by its bytes, which
                    // cannot be compared with a canonical fingerprint: it stays `too_large`.
                    Taken::AsConflict(_) if r.reason == DeadLetterReason::TooLarge => {}
                    Taken::AsConflict(text) => {
                        (reason, error, outcome) = (
                            DeadLetterReason::Conflict,
                            text,
                            DeadLetterOutcome::RecordedAsConflict,
                        )
                    }
                    Taken::Skip(outcome) => {
                        tx.rollback().await.map_err(|e| self.classify(e))?;
                        return Ok(outcome);
                    }
                }
            }
        }
        let o = r.message.origin();
        let stored = r.stored();
        let inserted: Option<i64> = sqlx::query_scalar(INSERT_DEAD_LETTER)
            .bind(r.consumer)
            .bind(r.entry.as_ref().map(|e| e.id.as_str()))
            .bind(r.entry.as_ref().map(|e| e.id.strategy()))
            .bind(r.entry.as_ref().map(|e| &e.fingerprint[..]))
            .bind(reason.as_str())
            .bind(&error)
            .bind(r.attempts as i64)
            .bind(stored.payload)
            .bind(stored.headers.to_string())
            .bind(o.system)
            .bind(&*o.destination)
            .bind(o.partition)
            .bind(o.offset)
            .bind(stored.size)
            .bind(&stored.sha256[..])
            .bind(stored.truncated)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|e| self.classify(e))?;
        self.commit(tx).await?;
        Ok(match inserted {
            Some(_) => outcome,
            None => DeadLetterOutcome::AlreadyDeadLettered,
        })
    }

    async fn dead_letter_of(
        &self,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<(String, String)>, StoreError> {
        sqlx::query_as(
            "SELECT reason, error FROM txinbox_dead_letters WHERE consumer = ?1 AND message_id = ?2 ORDER BY id DESC LIMIT 1",
        )
        .bind(consumer)
        .bind(message_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| self.classify(e))
    }

    async fn load_positions(&self, consumer: &str, source: &str) -> Result<Vec<(String, i64)>, StoreError> {
        sqlx::query_as(
            "SELECT lane, next_position FROM txinbox_positions WHERE consumer = ?1 AND source = ?2",
        )
        .bind(consumer)
        .bind(source)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.classify(e))
    }

    async fn record_subscription(
        &self,
        consumer: &str,
        system: &str,
        source: &str,
        subscription: &str,
    ) -> Result<Option<String>, StoreError> {
        let recorded: Option<i64> = sqlx::query_scalar(RECORD_SUBSCRIPTION)
            .bind(consumer)
            .bind(system)
            .bind(source)
            .bind(subscription)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.classify(e))?;
        if recorded.is_some() {
            return Ok(None);
        }
        sqlx::query_scalar(
            "SELECT subscription FROM txinbox_subscriptions WHERE consumer = ?1 AND source_system = ?2 AND source = ?3",
        )
        .bind(consumer)
        .bind(system)
        .bind(source)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| self.classify(e))
    }

    async fn preflight(&self) -> Result<Vec<String>, StoreError> {
        let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.classify(e))?;
        Ok(if synchronous < 2 {
            vec![format!(
                "SQLite synchronous is {synchronous} (below FULL = 2): a power loss can lose \
                 transactions whose messages were already acknowledged to the broker; open the \
                 pool with SqliteInbox::connect_options (synchronous = FULL)"
            )]
        } else {
            Vec::new()
        })
    }

    fn max_connections(&self) -> Option<u32> {
        Some(self.pool.options().get_max_connections())
    }

    #[cfg(feature = "postgres")]
    fn retention_pool(&self) -> Option<crate::ops::DbPool> {
        Some(crate::ops::DbPool::Sqlite(self.pool.clone()))
    }
}

/// Unavailable ([`is_unavailable`](super::is_unavailable): I/O, a pool timeout, `SQLITE_IOERR`,
/// `SQLITE_FULL` (disk full: fail closed, retry once space is freed), `SQLITE_CANTOPEN`).
/// Contention ([`is_lock_conflict`](super::is_lock_conflict): `SQLITE_BUSY`/`SQLITE_LOCKED`,
/// another writer held the lock past the busy timeout). Everything else (missing table,
/// constraint) is fatal.
pub(crate) fn classify(e: sqlx::Error) -> StoreError {
    classify_kind(e).in_store(super::Store::Sqlite)
}

fn classify_kind(e: sqlx::Error) -> StoreError {
    if super::is_lock_conflict(&e) {
        return StoreError::contention(e);
    }
    if super::is_unavailable(&e) {
        return StoreError::transient(e);
    }
    StoreError::fatal(e)
}
