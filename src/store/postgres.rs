//! [`PostgresInbox`]: the inbox in PostgreSQL, and [`migrate`].

use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};

use super::{Claim, DeadLetterOutcome, DeadLetterRecord, Entry, InboxStore, StoreError, Taken};
use crate::dead_letter::DeadLetterReason;
use crate::position::Position;
use std::collections::{HashMap, HashSet};

/// The schema that holds txinbox's tables and its migration ledger.
pub const SCHEMA: &str = "txinbox";

/// The embedded migrations, with their ledger in `txinbox._sqlx_migrations`.
///
/// Prefer [`migrate`]. This is public for `#[sqlx::test(migrator = ...)]`-style use and for
/// teams that copy `migrations/postgres/*.sql` into their own migration tool instead.
pub fn migrator() -> sqlx::migrate::Migrator {
    let mut m = sqlx::migrate!("./migrations/postgres");
    m.create_schema(SCHEMA);
    m.dangerous_set_table_name("txinbox._sqlx_migrations");
    m
}

/// Applies txinbox's migrations to the database behind `pool`.
///
/// Idempotent, safe to run from several processes at once (sqlx takes an advisory lock), and
/// independent of the application's own sqlx migrations: the ledger is
/// `txinbox._sqlx_migrations`, never `public._sqlx_migrations`.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    migrator().run(pool).await
}

/// The inbox in PostgreSQL (13 or later: a consumer on an older server stops at its start).
///
/// Build it on your application's pool with [`PostgresInbox::new`], or let
/// [`PostgresInbox::connect`] build a pool with the recommended server-side timeouts.
#[derive(Debug, Clone)]
pub struct PostgresInbox {
    pool: PgPool,
}

impl PostgresInbox {
    /// Runs `sql` ([`SAVE_POSITION`] or [`ADVANCE_POSITION`]) for `p`.
    async fn write_position(
        &self,
        sql: &'static str,
        conn: &mut PgConnection,
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

    /// An inbox on an existing pool. Run [`migrate`] once before consuming.
    ///
    /// The pool should set `idle_in_transaction_session_timeout` (see
    /// [`PostgresInbox::connect_options`]): a session stuck in a transaction is then ended by
    /// the server, which is the only safe timeout for a transaction.
    pub fn new(pool: PgPool) -> Self {
        PostgresInbox { pool }
    }

    /// Connects with [`connect_options`](Self::connect_options) applied to `url` and a pool of
    /// `max_connections`. The URL never appears in errors or logs.
    ///
    /// TLS is set in the URL as libpq's: `sslmode` (`disable`, `prefer` (the default: TLS when
    /// the server offers it, unverified), `require` (TLS, unverified), `verify-ca`,
    /// `verify-full`), `sslrootcert` (the CA certificate file; the system's root certificates
    /// are trusted as well), `sslcert` and `sslkey` (a client certificate). With txinbox's
    /// `tls` feature (on by default). A managed database wants
    /// `?sslmode=verify-full&sslrootcert=/path/to/provider-ca.pem`.
    ///
    /// A refused TLS connection (unknown CA, a certificate for another host, plaintext to a
    /// TLS-only server) is a fatal error that says what to change
    /// ([`tls_refusal`](crate::store::tls_refusal)); an unreachable server is unavailable.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let options: PgConnectOptions = url.parse().map_err(|_| {
            StoreError::fatal("the PostgreSQL connection string does not parse; expected postgres://user@host:port/database (with TLS: ?sslmode=verify-full&sslrootcert=/path/to/ca.pem)")
        })?;
        check_tls_files(url).map_err(StoreError::fatal)?;
        Self::connect_with(options, max_connections).await
    }

    /// [`connect`](Self::connect) with options built in code (`PgConnectOptions::ssl_mode`,
    /// `ssl_root_cert`, `ssl_client_cert`, `ssl_client_key`, …) instead of a URL. Connects one
    /// connection before it returns, so a wrong address, password or certificate shows here.
    pub async fn connect_with(options: PgConnectOptions, max_connections: u32) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(Self::connect_options(options))
            .await
            .map_err(classify)?;
        Ok(PostgresInbox { pool })
    }

    /// Adds the server-side safety nets txinbox relies on instead of client-side timeouts:
    /// `idle_in_transaction_session_timeout = 60s` (a stuck transaction is ended by the server)
    /// and `lock_timeout = 30s` (a duplicate never waits forever behind a stuck first delivery).
    pub fn connect_options(options: PgConnectOptions) -> PgConnectOptions {
        options.options([
            ("idle_in_transaction_session_timeout", "60s"),
            ("lock_timeout", "30s"),
        ])
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
            )).in_store(super::Store::Postgres);
        }
        classify(e)
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

const CLAIM: &str = "\
INSERT INTO txinbox.inbox AS i
    (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at,
     source_system, destination, source_partition, source_offset)
VALUES ($1, $2, $3, $4, 'processed', 1, now(), $5, $6, $7, $8)
ON CONFLICT (consumer, message_id) DO UPDATE
    SET status = 'processed', attempts = i.attempts + 1, processed_at = now()
    WHERE i.status = 'retrying' AND i.fingerprint = EXCLUDED.fingerprint
RETURNING i.attempts";

/// The batch claim: [`CLAIM`] for many keys in one statement. Keys arrive once each (first
/// occurrences) and are inserted in key order, so concurrent batches take their row locks in
/// the same order and cannot deadlock on each other.
const CLAIM_BATCH: &str = "\
INSERT INTO txinbox.inbox AS i
    (consumer, message_id, id_strategy, fingerprint, status, attempts, processed_at,
     source_system, destination, source_partition, source_offset)
SELECT $1, t.message_id, t.id_strategy, t.fingerprint, 'processed', 1, now(),
       t.source_system, t.destination, t.source_partition, t.source_offset
FROM UNNEST($2::text[], $3::text[], $4::bytea[], $5::text[], $6::text[], $7::int4[], $8::int8[])
    AS t(message_id, id_strategy, fingerprint, source_system, destination, source_partition, source_offset)
ORDER BY t.message_id
ON CONFLICT (consumer, message_id) DO UPDATE
    SET status = 'processed', attempts = i.attempts + 1, processed_at = now()
    WHERE i.status = 'retrying' AND i.fingerprint = EXCLUDED.fingerprint
RETURNING i.message_id, i.attempts";

const RECORD_FAILURE: &str = "\
INSERT INTO txinbox.inbox AS i
    (consumer, message_id, id_strategy, fingerprint, status, attempts, last_error,
     source_system, destination, source_partition, source_offset)
VALUES ($1, $2, $3, $4, 'retrying', 1, $9, $5, $6, $7, $8)
ON CONFLICT (consumer, message_id) DO UPDATE
    SET attempts = i.attempts + 1, last_error = EXCLUDED.last_error
    WHERE i.status = 'retrying' AND i.fingerprint = EXCLUDED.fingerprint
RETURNING i.attempts";

const MARK_DEAD: &str = "\
INSERT INTO txinbox.inbox AS i
    (consumer, message_id, id_strategy, fingerprint, status, attempts, last_error, processed_at,
     source_system, destination, source_partition, source_offset)
VALUES ($1, $2, $3, $4, 'dead_lettered', $10, $9, now(), $5, $6, $7, $8)
ON CONFLICT (consumer, message_id) DO UPDATE
    SET status = 'dead_lettered', attempts = EXCLUDED.attempts,
        last_error = EXCLUDED.last_error, processed_at = now()
    WHERE i.status = 'retrying' AND i.fingerprint = EXCLUDED.fingerprint";

/// Does nothing when a pending dead letter of the same source position, or the same pending
/// conflict, is recorded already (the partial unique indexes `dead_letters_position_key` and
/// `dead_letters_conflict_key`); then no row comes back.
const INSERT_DEAD_LETTER: &str = "\
INSERT INTO txinbox.dead_letters
    (consumer, message_id, id_strategy, fingerprint, reason, error, attempts, payload, headers,
     source_system, destination, source_partition, source_offset, payload_size, payload_sha256,
     truncated)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)
ON CONFLICT DO NOTHING
RETURNING id";

/// `$2`: the duplicates' IDs, repeats included. The rows are already locked by the claim.
const RECORD_DUPLICATES: &str = "\
UPDATE txinbox.inbox AS i SET duplicates = i.duplicates + d.n
FROM (SELECT id, count(*) AS n FROM UNNEST($2::text[]) AS id GROUP BY id) AS d
WHERE i.consumer = $1 AND i.message_id = d.id";

/// Records (`$1` consumer, `$2` system, `$3` source, `$4` subscription) unless another
/// subscription is recorded for the source: then no row comes back.
const RECORD_SUBSCRIPTION: &str = "\
INSERT INTO txinbox.subscriptions AS s (consumer, source_system, source, subscription)
VALUES ($1, $2, $3, $4)
ON CONFLICT (consumer, source_system, source) DO UPDATE SET last_seen_at = now()
    WHERE s.subscription = EXCLUDED.subscription
RETURNING 1";

/// Stores a lane's next position (`$1` consumer, `$2` source, `$3` lane, `$4` next); also
/// what `ops::replay` writes.
pub(crate) const SAVE_POSITION: &str = "\
INSERT INTO txinbox.positions (consumer, source, lane, next_position)
VALUES ($1, $2, $3, $4)
ON CONFLICT (consumer, source, lane) DO UPDATE
    SET next_position = EXCLUDED.next_position, updated_at = now()";

/// `server_version_num` of the oldest PostgreSQL the store works with: 13, for [`HELD`]'s
/// `pg_current_xact_id_if_assigned()`. Checked by `preflight`, which stops a consumer on an
/// older server before its messages fail the check one attempt after another.
const MIN_SERVER_VERSION: u32 = 130000;

/// Whether the transaction on this connection holds the row of `$1` consumer, `$2` message ID
/// as processed: the row's version was written by this very transaction (`xmin`), not merely
/// committed by someone. A handler that ended the transaction (a `ROLLBACK` on the connection
/// it was handed) leaves the connection in autocommit, where the row may still exist: another
/// worker committed a redelivery of the same message meanwhile. Checking the row alone then
/// passed, and the rest of a batch was acknowledged without its effects. In autocommit
/// `pg_current_xact_id_if_assigned()` is NULL, so the check is NULL, which is not true.
///
/// The status is compared in the select list, not the WHERE clause: `status = 'processed'`
/// implies the partial index's `status <> 'retrying'`, and a plan cached while the table was
/// small can then pick that index and filter every row of the consumer, a check that grows with
/// the inbox. Without it, only the primary key can answer. `xmin` is in the same heap tuple.
const HELD: &str = "\
SELECT status = 'processed' AND xmin = pg_current_xact_id_if_assigned()::xid
FROM txinbox.inbox WHERE consumer = $1 AND message_id = $2";

/// `confirm` and [`SAVE_POSITION`] for several lanes in one statement (`$1` consumer and `$2`
/// message ID of the entry to confirm, `$3` the positions' consumer, `$4`..`$6` their sources,
/// lanes and next positions, written in the order given). The positions are written only if
/// the transaction holds the entry's row as processed ([`HELD`]'s check); `ok` says whether it
/// does.
const CONFIRM_AND_SAVE_POSITIONS: &str = "\
WITH held AS (
    SELECT status = 'processed' AND xmin = pg_current_xact_id_if_assigned()::xid AS ok
    FROM txinbox.inbox WHERE consumer = $1 AND message_id = $2
), saved AS (
    INSERT INTO txinbox.positions (consumer, source, lane, next_position)
    SELECT $3, t.source, t.lane, t.next
    FROM UNNEST($4::text[], $5::text[], $6::int8[]) WITH ORDINALITY AS t(source, lane, next, n)
    WHERE (SELECT ok FROM held)
    ORDER BY t.n
    ON CONFLICT (consumer, source, lane) DO UPDATE
        SET next_position = EXCLUDED.next_position, updated_at = now()
    RETURNING 1
)
SELECT COALESCE((SELECT ok FROM held), false), (SELECT count(*) FROM saved)";

/// [`SAVE_POSITION`] that never moves a stored position back.
const ADVANCE_POSITION: &str = "\
INSERT INTO txinbox.positions AS p (consumer, source, lane, next_position)
VALUES ($1, $2, $3, $4)
ON CONFLICT (consumer, source, lane) DO UPDATE
    SET next_position = EXCLUDED.next_position, updated_at = now()
    WHERE p.next_position < EXCLUDED.next_position";

/// Binds an [`Entry`] as `$1`..`$8` (consumer, ID, strategy, fingerprint, system,
/// destination, partition, offset).
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
impl InboxStore for PostgresInbox {
    type Db = Postgres;

    async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        self.pool.begin().await.map_err(|e| self.classify(e))
    }

    async fn commit(&self, tx: Transaction<'static, Postgres>) -> Result<(), StoreError> {
        tx.commit().await.map_err(|e| self.classify(e))
    }

    async fn claim(&self, conn: &mut PgConnection, entry: &Entry<'_>) -> Result<Claim, StoreError> {
        // NOTE: one statement decides. A concurrent claim of the same key blocks on the primary
        // key until the first transaction ends; in READ COMMITTED it then sees the committed row
        // (no update, no row returned) or, after a rollback, inserts.
        let attempts: Option<i32> = bind_entry!(sqlx::query_scalar(CLAIM), entry)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| self.classify(e))?;
        if let Some(attempt) = attempts {
            return Ok(Claim::New {
                attempt: attempt as u32,
            });
        }
        // Not claimed: the row exists, terminal or with another fingerprint. This read runs with
        // a new snapshot, so it sees the row that blocked the insert.
        let row: Option<(String, Vec<u8>)> = sqlx::query_as(
            "SELECT status, fingerprint FROM txinbox.inbox WHERE consumer = $1 AND message_id = $2",
        )
        .bind(entry.consumer)
        .bind(entry.id.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| self.classify(e))?;
        Claim::from_existing(row, entry)
    }

    async fn claim_batch(
        &self,
        conn: &mut PgConnection,
        entries: &[Entry<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        let Some(first) = entries.first() else {
            return Ok(Vec::new());
        };
        let consumer = first.consumer;
        assert!(
            entries.iter().all(|e| e.consumer == consumer),
            "one batch belongs to one consumer"
        );
        // NOTE: ON CONFLICT DO UPDATE cannot touch one row twice in a statement ("command cannot
        // affect row a second time"), so each key is sent once; `resolve_batch` decides later
        // occurrences against the row as the first one left it.
        let mut seen = HashSet::with_capacity(entries.len());
        let unique: Vec<&Entry<'_>> = entries.iter().filter(|e| seen.insert(e.id.as_str())).collect();
        let claimed: Vec<(String, i32)> = sqlx::query_as(CLAIM_BATCH)
            .bind(consumer)
            .bind(unique.iter().map(|e| e.id.as_str()).collect::<Vec<_>>())
            .bind(unique.iter().map(|e| e.id.strategy()).collect::<Vec<_>>())
            .bind(unique.iter().map(|e| &e.fingerprint[..]).collect::<Vec<_>>())
            .bind(unique.iter().map(|e| e.origin.system).collect::<Vec<_>>())
            .bind(unique.iter().map(|e| &*e.origin.destination).collect::<Vec<_>>())
            .bind(unique.iter().map(|e| e.origin.partition).collect::<Vec<_>>())
            .bind(unique.iter().map(|e| e.origin.offset).collect::<Vec<_>>())
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.classify(e))?;
        let claimed: HashMap<&str, u32> = claimed
            .iter()
            .map(|(id, attempts)| (id.as_str(), *attempts as u32))
            .collect();
        let mut existing = HashMap::new();
        if claimed.len() < unique.len() {
            // As in `claim`: a new statement, so a new snapshot that sees the rows that blocked
            // the insert.
            let others: Vec<&str> = unique
                .iter()
                .map(|e| e.id.as_str())
                .filter(|id| !claimed.contains_key(id))
                .collect();
            let rows: Vec<(String, String, Vec<u8>)> = sqlx::query_as(
                "SELECT message_id, status, fingerprint FROM txinbox.inbox WHERE consumer = $1 AND message_id = ANY($2)",
            )
            .bind(consumer)
            .bind(others)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.classify(e))?;
            existing = rows.into_iter().map(|(id, st, fp)| (id, (st, fp))).collect();
        }
        super::resolve_batch(entries, &claimed, &existing)
    }

    async fn confirm(&self, conn: &mut PgConnection, entry: &Entry<'_>) -> Result<bool, StoreError> {
        let held = sqlx::query_scalar::<_, Option<bool>>(HELD)
            .bind(entry.consumer)
            .bind(entry.id.as_str())
            .fetch_optional(conn)
            .await;
        match held {
            Ok(held) => Ok(held.flatten() == Some(true)),
            // 25P02 in_failed_sql_transaction: a statement failed and the handler went on.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P02") => Ok(false),
            Err(e) => Err(self.classify(e)),
        }
    }

    async fn confirm_and_save_positions(
        &self,
        conn: &mut PgConnection,
        entries: &[Entry<'_>],
        consumer: &str,
        positions: &[Position],
    ) -> Result<bool, StoreError> {
        let Some(first) = entries.first() else {
            for p in positions {
                self.save_position(conn, consumer, p).await?;
            }
            return Ok(true);
        };
        if positions.is_empty() {
            return self.confirm(conn, first).await;
        }
        debug_assert!(
            positions.iter().enumerate().all(|(i, p)| positions[..i]
                .iter()
                .all(|q| (&q.source, &q.lane) != (&p.source, &p.lane))),
            "one position per lane: ON CONFLICT DO UPDATE cannot update a row twice"
        );
        let sources: Vec<&str> = positions.iter().map(|p| &*p.source).collect();
        let lanes: Vec<&str> = positions.iter().map(|p| &*p.lane).collect();
        let nexts: Vec<i64> = positions.iter().map(|p| p.next).collect();
        let row = sqlx::query_as::<_, (bool, i64)>(CONFIRM_AND_SAVE_POSITIONS)
            .bind(first.consumer)
            .bind(first.id.as_str())
            .bind(consumer)
            .bind(&sources)
            .bind(&lanes)
            .bind(&nexts)
            .fetch_one(conn)
            .await;
        match row {
            Ok((held, _)) => Ok(held),
            // 25P02 in_failed_sql_transaction: a statement failed and the handler went on.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P02") => Ok(false),
            Err(e) => Err(self.classify(e)),
        }
    }

    async fn save_position(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        p: &Position,
    ) -> Result<(), StoreError> {
        self.write_position(SAVE_POSITION, conn, consumer, p).await
    }

    async fn advance_position(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        p: &Position,
    ) -> Result<(), StoreError> {
        self.write_position(ADVANCE_POSITION, conn, consumer, p).await
    }

    async fn record_duplicates(
        &self,
        conn: &mut PgConnection,
        entries: &[Entry<'_>],
    ) -> Result<(), StoreError> {
        let Some(first) = entries.first() else {
            return Ok(());
        };
        let ids: Vec<&str> = entries.iter().map(|e| e.id.as_str()).collect();
        sqlx::query(RECORD_DUPLICATES)
            .bind(first.consumer)
            .bind(&ids)
            .execute(conn)
            .await
            .map_err(|e| self.classify(e))?;
        Ok(())
    }

    async fn record_failure(&self, entry: &Entry<'_>, error: &str) -> Result<Option<u32>, StoreError> {
        let attempts: Option<i32> = bind_entry!(sqlx::query_scalar(RECORD_FAILURE), entry)
            .bind(error)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.classify(e))?;
        Ok(attempts.map(|a| a as u32))
    }

    async fn dead_letter(&self, r: &DeadLetterRecord<'_>) -> Result<DeadLetterOutcome, StoreError> {
        let mut tx = self.pool.begin().await.map_err(|e| self.classify(e))?;
        let (mut reason, mut error, mut outcome) =
            (r.reason, r.error.to_owned(), DeadLetterOutcome::Recorded);
        if let Some(entry) = r
            .entry
            .as_ref()
            .filter(|_| r.reason != DeadLetterReason::Conflict)
        {
            let marked = bind_entry!(sqlx::query(MARK_DEAD), entry)
                .bind(r.error)
                .bind(r.attempts as i32)
                .execute(&mut *tx)
                .await
                .map_err(|e| self.classify(e))?;
            if marked.rows_affected() == 0 {
                let row = sqlx::query_as(
                    "SELECT status, fingerprint FROM txinbox.inbox WHERE consumer = $1 AND message_id = $2",
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
            .bind(r.attempts as i32)
            .bind(stored.payload)
            .bind(stored.headers)
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
        tx.commit().await.map_err(|e| self.classify(e))?;
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
            "SELECT reason, error FROM txinbox.dead_letters WHERE consumer = $1 AND message_id = $2 ORDER BY id DESC LIMIT 1",
        )
        .bind(consumer)
        .bind(message_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| self.classify(e))
    }

    async fn load_positions(&self, consumer: &str, source: &str) -> Result<Vec<(String, i64)>, StoreError> {
        sqlx::query_as(
            "SELECT lane, next_position FROM txinbox.positions WHERE consumer = $1 AND source = $2",
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
        let recorded: Option<i32> = sqlx::query_scalar(RECORD_SUBSCRIPTION)
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
            "SELECT subscription FROM txinbox.subscriptions WHERE consumer = $1 AND source_system = $2 AND source = $3",
        )
        .bind(consumer)
        .bind(system)
        .bind(source)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| self.classify(e))
    }

    async fn preflight(&self) -> Result<Vec<String>, StoreError> {
        // The server's version comes with the connection (its startup message): no query, no
        // privilege needed.
        let mut conn = self.pool.acquire().await.map_err(|e| self.classify(e))?;
        let version = conn.server_version_num().unwrap_or(u32::MAX);
        if version < MIN_SERVER_VERSION {
            return Err(StoreError::fatal(format!(
                "the inbox's PostgreSQL server is version {}.{} and txinbox needs 13 or later: its check before COMMIT uses pg_current_xact_id_if_assigned(), new in 13, and every transaction would fail it; upgrade the server",
                version / 10000,
                version % 10000,
            ))
            .in_store(super::Store::Postgres));
        }
        // Settings a role cannot read, or a server without them: nothing to warn about.
        let settings: Result<(String, String), _> =
            sqlx::query_as("SELECT current_setting('synchronous_commit'), current_setting('fsync')")
                .fetch_one(&mut *conn)
                .await;
        let (synchronous_commit, fsync) = match settings {
            Ok(settings) => settings,
            Err(e) => {
                tracing::debug!(error = %e, "reading the inbox database's durability settings failed");
                return Ok(Vec::new());
            }
        };
        let mut warnings = Vec::new();
        if synchronous_commit == "off" {
            warnings.push(
                "synchronous_commit is off on the inbox's connections: PostgreSQL reports a COMMIT \
                 before it is durable, so a server crash can lose transactions whose messages were \
                 already acknowledged to the broker, and those messages are lost; set \
                 synchronous_commit = on (remote_apply or on with synchronous standbys) for the \
                 consumer's role or database"
                    .to_owned(),
            );
        }
        if fsync == "off" {
            warnings.push(
                "fsync is off on the inbox's server: a crash can lose or corrupt committed \
                 transactions whose messages were already acknowledged; turn fsync on"
                    .to_owned(),
            );
        }
        Ok(warnings)
    }

    fn max_connections(&self) -> Option<u32> {
        Some(self.pool.options().get_max_connections())
    }

    #[cfg(feature = "postgres")]
    fn retention_pool(&self) -> Option<crate::ops::DbPool> {
        Some(crate::ops::DbPool::Postgres(self.pool.clone()))
    }
}

/// Checks that the certificate and key files a PostgreSQL URL names (`sslrootcert`, `sslcert`,
/// `sslkey` and sqlx's spellings of them) can be read, so a wrong path is reported with its
/// parameter before connecting: sqlx reports it as a bare "No such file or directory", an I/O
/// error that reads like an outage. The error names the parameter and, except for `sslkey`,
/// the path. Inline PEM values and a URL that does not parse pass (connecting reports those).
pub fn check_tls_files(url: &str) -> Result<(), String> {
    let Ok(parsed) = url::Url::parse(url) else {
        return Ok(());
    };
    for (key, value) in parsed.query_pairs() {
        let param = match &*key {
            "sslrootcert" | "ssl-root-cert" | "ssl-ca" => "sslrootcert",
            "sslcert" | "ssl-cert" => "sslcert",
            "sslkey" | "ssl-key" => "sslkey",
            _ => continue,
        };
        if value.trim_start().starts_with("-----BEGIN") {
            continue;
        }
        readable(
            &format!("the PostgreSQL URL's {param}"),
            std::path::Path::new(&*value),
            param == "sslkey",
        )?;
    }
    Ok(())
}

/// `Ok` if the certificate or key file at `path` (what `named` names) can be opened, else the
/// error that says so. A key's path (`key`) is not shown: it may say more than it should (a
/// user's name, a secret's name), as everywhere a URL is shown.
pub(crate) fn readable(named: &str, path: &std::path::Path, key: bool) -> Result<(), String> {
    std::fs::File::open(path).map(drop).map_err(|e| {
        let shown = if key {
            String::new()
        } else {
            format!(" {}", path.display())
        };
        format!("{named}{shown} cannot be read: {e} (give the path of a PEM file this process may read)")
    })
}

/// Sorts sqlx errors into unavailable ([`is_unavailable`](super::is_unavailable): pause intake,
/// retry), contention ([`is_lock_conflict`](super::is_lock_conflict): re-run, no attempt
/// counted), busy (a statement timeout, a session ended for idling in a transaction: retry, not
/// an outage) and fatal (stop and report; a refused TLS connection with what to change,
/// [`tls_refusal`](super::tls_refusal)).
pub(crate) fn classify(e: sqlx::Error) -> StoreError {
    classify_kind(e).in_store(super::Store::Postgres)
}

fn classify_kind(e: sqlx::Error) -> StoreError {
    let e = match StoreError::from_tls_refusal(e) {
        Ok(refused) => return refused,
        Err(e) => e,
    };
    if super::is_lock_conflict(&e) {
        return StoreError::contention(e);
    }
    if super::is_unavailable(&e) {
        return StoreError::transient(e);
    }
    match e.as_database_error().and_then(|db| db.code()).as_deref() {
        Some(
            "57014" // query_canceled (statement_timeout)
            | "25P03", // idle_in_transaction_session_timeout
        ) => StoreError::busy(e),
        _ => StoreError::fatal(e),
    }
}
