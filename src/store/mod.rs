//! The inbox store: where message IDs, attempts, dead letters and source positions live.
//!
//! [`InboxStore`] is what the runtime needs from a database, and this module holds what an
//! implementation works with. [`PostgresInbox`](crate::PostgresInbox) (feature `postgres`) and
//! [`SqliteInbox`](crate::SqliteInbox) (feature `sqlite`) implement it; both on by default.

use std::fmt;

use async_trait::async_trait;

use crate::dead_letter::DeadLetterReason;
use crate::message::{Headers, Message, MessageId, Origin};
use crate::position::Position;

#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

/// Longest error text stored, in bytes; longer texts are cut at a character boundary.
pub const MAX_ERROR_LEN: usize = 2048;

/// The connection type of a store's database.
pub type Connection<S> = <<S as InboxStore>::Db as sqlx::Database>::Connection;

/// A database that can hold an inbox.
///
/// # Contract
///
/// - [`claim`](InboxStore::claim) is the deduplication decision. It must be one atomic
///   statement (insert-or-claim with the key's unique index), the first of its transaction, in
///   READ COMMITTED. A concurrent claim of the same key blocks on the index until the first
///   transaction ends, then sees its outcome. Never check-then-insert.
/// - [`record_failure`](InboxStore::record_failure) and
///   [`dead_letter`](InboxStore::dead_letter) run in their own short transactions, after the
///   message's transaction has rolled back.
/// - No method is wrapped in a timeout or a cancellable `select!` by the runtime; an
///   implementation must not need one to make progress either (use server-side timeouts).
#[async_trait]
pub trait InboxStore: Send + Sync + 'static {
    /// The sqlx database; handlers receive its connection.
    type Db: sqlx::Database;

    /// Opens the message's transaction.
    async fn begin(&self) -> Result<sqlx::Transaction<'static, Self::Db>, StoreError>;

    /// Commits the message's transaction. An error means the outcome is unknown: the runtime
    /// never acknowledges such a message; its next trip goes through [`claim`](Self::claim).
    async fn commit(&self, tx: sqlx::Transaction<'static, Self::Db>) -> Result<(), StoreError>;

    /// Rolls the message's transaction back. The runtime rolls back through this, never
    /// through `tx.rollback()`, so that a store can make sure the connection goes back to the
    /// pool clean even when a handler ended the transaction itself. Errors are the store's to
    /// absorb: the transaction's work is gone either way. The default is `tx.rollback()`.
    async fn rollback(&self, tx: sqlx::Transaction<'static, Self::Db>) {
        drop(tx.rollback().await);
    }

    /// Inserts the inbox row for `entry` as processed, or claims a row left `retrying` by an
    /// earlier failed attempt with the same fingerprint. Otherwise reports a duplicate or a
    /// conflict and changes nothing.
    async fn claim(&self, conn: &mut Connection<Self>, entry: &Entry<'_>) -> Result<Claim, StoreError>;

    /// Checks, just before COMMIT, that the transaction is still open and still holds the row
    /// [`claim`](Self::claim) inserted: *this* transaction's row, not merely a row. `Ok(false)`
    /// when it does not: on PostgreSQL a failed statement the handler ignored aborts the
    /// transaction, and COMMIT would then roll back *without an error*, so the runtime would
    /// ack a message whose effects are gone. A handler that ended the transaction itself (a
    /// `ROLLBACK` on its connection) leaves the connection in autocommit, where another
    /// worker may meanwhile have committed a redelivery of the same message: its row exists,
    /// and a check of the row alone would pass for a transaction that is gone.
    async fn confirm(&self, conn: &mut Connection<Self>, entry: &Entry<'_>) -> Result<bool, StoreError>;

    /// Claims several entries in one transaction, as if [`claim`](Self::claim) ran for each in
    /// order: the result has one [`Claim`] per entry, in the same order. This is the batch's
    /// deduplication decision and the first statement of its transaction (micro-batching, see
    /// the consumer's `batch_size`).
    ///
    /// The same key may occur more than once: a later occurrence sees the row as the earlier
    /// ones left it, so it is a [`Duplicate`](Claim::Duplicate) of a claimed first occurrence
    /// with the same fingerprint, or a [`Conflict`](Claim::Conflict) with another one; the call
    /// must not fail because of it. A later occurrence whose outcome depends on a row an earlier
    /// occurrence could not claim (a `retrying` row) may be reported as
    /// `Duplicate(InboxStatus::Retrying)`: the runtime then claims it on its own.
    ///
    /// The default runs [`claim`](Self::claim) once per entry in the one transaction (same
    /// semantics, one round trip each); [`PostgresInbox`](crate::PostgresInbox) claims the whole
    /// batch with one `INSERT … SELECT FROM UNNEST(…) ON CONFLICT` statement.
    async fn claim_batch(
        &self,
        conn: &mut Connection<Self>,
        entries: &[Entry<'_>],
    ) -> Result<Vec<Claim>, StoreError> {
        let mut claims = Vec::with_capacity(entries.len());
        for entry in entries {
            claims.push(self.claim(conn, entry).await?);
        }
        Ok(claims)
    }

    /// [`confirm`](Self::confirm) for a batch: `Ok(false)` unless the transaction is still live
    /// and still holds the rows the batch claimed as new (`entries`, distinct keys).
    ///
    /// A batch's claim is one statement in one transaction, so its rows stand or fall together:
    /// a failed statement aborts the transaction and a handler that ends the transaction itself
    /// takes them all. (A batch bounded by its duration claims in chunks; the runtime checks the
    /// transaction before each further chunk, so a later chunk is never claimed outside it.) The
    /// default therefore probes one row, the first, and costs one index lookup whatever the
    /// batch size.
    async fn confirm_batch(
        &self,
        conn: &mut Connection<Self>,
        entries: &[Entry<'_>],
    ) -> Result<bool, StoreError> {
        match entries.first() {
            Some(first) => self.confirm(conn, first).await,
            None => Ok(true),
        }
    }

    /// The last step before COMMIT: [`confirm_batch`](Self::confirm_batch) for `entries`, then,
    /// only if it confirms, [`save_position`](Self::save_position) for each of `positions`
    /// (distinct lanes, in the order given: callers sort them so that two transactions lock
    /// position rows in one order). `Ok(false)` writes no position.
    ///
    /// One step so that a store can do it in one round trip: a source with positions (Kafka)
    /// otherwise pays a statement per transaction more than one without. The check comes first
    /// and gates the write because a handler that ended the transaction itself leaves the
    /// connection outside any transaction: a position written there would commit on its own,
    /// past a message whose effects were rolled back.
    ///
    /// The default runs the two in turn; [`PostgresInbox`](crate::PostgresInbox) runs them as
    /// one statement.
    async fn confirm_and_save_positions(
        &self,
        conn: &mut Connection<Self>,
        entries: &[Entry<'_>],
        consumer: &str,
        positions: &[Position],
    ) -> Result<bool, StoreError> {
        if !self.confirm_batch(conn, entries).await? {
            return Ok(false);
        }
        for p in positions {
            self.save_position(conn, consumer, p).await?;
        }
        Ok(true)
    }

    /// Stores `position.next` as the consumer's next position for the position's lane.
    async fn save_position(
        &self,
        conn: &mut Connection<Self>,
        consumer: &str,
        position: &Position,
    ) -> Result<(), StoreError>;

    /// As [`save_position`](Self::save_position), but never moves a stored position back: for
    /// a save that may come late, after the lane has moved on elsewhere (the position past a
    /// dead letter, stored once the broker confirmed its copy). The default saves as
    /// `save_position` does; the stores of this crate override it.
    async fn advance_position(
        &self,
        conn: &mut Connection<Self>,
        consumer: &str,
        position: &Position,
    ) -> Result<(), StoreError> {
        self.save_position(conn, consumer, position).await
    }

    /// Counts duplicate deliveries, one per entry (an ID listed twice counts twice), in the
    /// duplicates' transaction (with their position, if any), in one statement whatever the
    /// number of entries. All entries belong to one consumer. Read by operators
    /// (`txinbox status`); changes no status.
    async fn record_duplicates(
        &self,
        conn: &mut Connection<Self>,
        entries: &[Entry<'_>],
    ) -> Result<(), StoreError>;

    /// Counts a failed attempt and keeps its error, in its own transaction. Returns the number of
    /// attempts now recorded, or `None` if the key has meanwhile become terminal (another
    /// consumer processed or dead-lettered it).
    async fn record_failure(&self, entry: &Entry<'_>, error: &str) -> Result<Option<u32>, StoreError>;

    /// Records a dead letter in its own transaction: the original message (payload and headers
    /// cut to [`DeadLetterRecord::payload_limit`], with the payload's size and SHA-256), reason
    /// and error; marks the inbox row `dead_lettered` when the message has a usable ID and is
    /// not a conflict. If the key turns out to be taken meanwhile, records accordingly: see
    /// [`DeadLetterOutcome`].
    ///
    /// Idempotent: while a dead letter is pending (neither requeued nor discarded), a second
    /// one for the same consumer and source position (destination, partition, offset), or a
    /// second conflict of the same consumer, ID and fingerprint, records nothing and reports
    /// [`DeadLetterOutcome::AlreadyDeadLettered`].
    ///
    /// It does not move the source position: the broker has not yet confirmed its own
    /// dead-letter copy, and a restart must see the message again (as a duplicate of a dead
    /// letter, which is sent to the broker's dead-letter destination again). The runtime moves
    /// the position once the broker confirmed the copy.
    async fn dead_letter(&self, record: &DeadLetterRecord<'_>) -> Result<DeadLetterOutcome, StoreError>;

    /// The reason and error of the latest dead letter recorded for this message, if any.
    async fn dead_letter_of(
        &self,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<(String, String)>, StoreError>;

    /// The stored next positions of `consumer` in `source`, by lane (Kafka: partition number
    /// as text → next offset). An adapter reads them when it is assigned lanes, so consumption
    /// resumes exactly where the database's state ends, also after a database restore.
    async fn load_positions(&self, consumer: &str, source: &str) -> Result<Vec<(String, i64)>, StoreError>;

    /// Records that `consumer` reads `source` (a Kafka topic) of `system` (`kafka`) through
    /// `subscription` (the Kafka consumer group), so operators' tools know the group without
    /// being told, and so one consumer name is never shared by two subscriptions. A source
    /// calls it when it is assigned lanes.
    ///
    /// Returns the subscription already recorded when it is a **different** one, and records
    /// nothing then: two groups under one consumer name share one inbox and one set of
    /// positions, so each would skip the other's messages as duplicates; the source refuses
    /// to go on. `txinbox positions rebind` records a new group on purpose.
    ///
    /// The default records nothing (a store without the table).
    async fn record_subscription(
        &self,
        consumer: &str,
        system: &str,
        source: &str,
        subscription: &str,
    ) -> Result<Option<String>, StoreError> {
        let _ = (consumer, system, source, subscription);
        Ok(None)
    }

    /// Checks, once when a consumer starts, the database settings the guarantee relies on, and
    /// returns a warning (what is off, what it risks, what to set) for each that is not as
    /// needed. The runtime logs them; it does not refuse to run for them. A fatal error (a
    /// server the store cannot work with at all, such as PostgreSQL before 13) stops the
    /// consumer; any other error is logged at debug and ignored (the first transaction finds an
    /// outage). The default checks nothing.
    ///
    /// The guarantee needs a COMMIT to be durable before the broker is acknowledged: with
    /// PostgreSQL's `synchronous_commit = off` (or `fsync = off`), or SQLite below
    /// `synchronous = FULL`, a crash of the server or machine can lose transactions whose
    /// messages were already acknowledged, and those messages are lost.
    async fn preflight(&self) -> Result<Vec<String>, StoreError> {
        Ok(Vec::new())
    }

    /// The pool's connection limit, so the consumer can refuse a concurrency the pool cannot
    /// serve. `None` if unknown.
    fn max_connections(&self) -> Option<u32> {
        None
    }

    /// The database the consumer's retention deletes from
    /// ([`ConsumerBuilder::retention`](crate::ConsumerBuilder::retention)): the stores of this
    /// crate return their pool, and the janitor runs the same statements as `txinbox purge`
    /// ([`ops::retention`](crate::ops::retention)) on it. The default, `None`, makes
    /// `.retention(…)` refused when the consumer is built: a store of its own schema purges its
    /// own way.
    #[cfg(feature = "postgres")]
    fn retention_pool(&self) -> Option<crate::ops::DbPool> {
        None
    }
}

/// The inbox key and what is stored with it.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    /// Consumer name (first half of the key).
    pub consumer: &'a str,
    /// Message ID (second half of the key) and the strategy that derived it.
    pub id: &'a MessageId,
    /// SHA-256 fingerprint of the payload.
    pub fingerprint: &'a [u8; 32],
    /// Source coordinates, kept for operators.
    pub origin: &'a Origin,
}

/// The outcome of [`InboxStore::claim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// The key is ours for this transaction; `attempt` counts earlier failed attempts + 1.
    New {
        /// 1-based attempt number.
        attempt: u32,
    },
    /// Already processed or dead-lettered, with the same fingerprint.
    Duplicate(InboxStatus),
    /// The key exists with a different fingerprint.
    Conflict,
}

impl Claim {
    /// The outcome when the claim statement changed nothing, from the key's
    /// `(status, fingerprint)` as read right after it.
    pub(crate) fn from_existing(
        row: Option<(String, Vec<u8>)>,
        entry: &Entry<'_>,
    ) -> Result<Claim, StoreError> {
        match row {
            Some((_, fp)) if fp != entry.fingerprint[..] => Ok(Claim::Conflict),
            Some((status, _)) => Ok(Claim::Duplicate(
                InboxStatus::parse(&status).unwrap_or(InboxStatus::Processed),
            )),
            // The row was purged between the two statements: retry the claim from scratch.
            None => Err(StoreError::contention(
                "inbox row vanished during claim (concurrent purge)",
            )),
        }
    }
}

/// Resolves a batch claim from what one set-based statement saw: `claimed` holds the attempt of
/// every key the statement inserted or took over, `existing` the `(status, fingerprint)` of
/// every other key (read after the statement). Each key was sent once, for its first
/// occurrence; later occurrences are decided against the row as the earlier ones left it.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn resolve_batch(
    entries: &[Entry<'_>],
    claimed: &std::collections::HashMap<&str, u32>,
    existing: &std::collections::HashMap<String, (String, Vec<u8>)>,
) -> Result<Vec<Claim>, StoreError> {
    // Per key: the row's (status, fingerprint) after the occurrences decided so far. Kept only
    // when a key repeats (the claimed and existing rows then cover fewer keys than there are
    // entries): the common batch has none, and hashing every ID into it cost more than the rest
    // of this function. Left empty, it answers every lookup without hashing.
    let repeats = claimed.len() + existing.len() < entries.len();
    let mut rows: std::collections::HashMap<&str, (InboxStatus, [u8; 32])> = std::collections::HashMap::new();
    let mut claims = Vec::with_capacity(entries.len());
    for entry in entries {
        let key = entry.id.as_str();
        let claim = match rows.get(key) {
            // A later occurrence of a key seen earlier in this batch.
            Some((_, fp)) if fp != entry.fingerprint => Claim::Conflict,
            Some((status, _)) => Claim::Duplicate(*status),
            None => match claimed.get(key) {
                Some(&attempt) => Claim::New { attempt },
                None => Claim::from_existing(existing.get(key).cloned(), entry)?,
            },
        };
        if repeats && !rows.contains_key(key) {
            let row = match claim {
                Claim::New { .. } => (InboxStatus::Processed, *entry.fingerprint),
                _ => {
                    let (status, fp) = existing.get(key).expect("decided from an existing row");
                    let mut fingerprint = [0u8; 32];
                    if fp.len() == 32 {
                        fingerprint.copy_from_slice(fp);
                    }
                    let status = InboxStatus::parse(status).unwrap_or(InboxStatus::Processed);
                    (status, fingerprint)
                }
            };
            rows.insert(key, row);
        }
        claims.push(claim);
    }
    Ok(claims)
}

/// The state of an inbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxStatus {
    /// Effects committed.
    Processed,
    /// Failed transiently; will be claimed again by the next attempt.
    Retrying,
    /// Dead-lettered; a redelivery is acknowledged as a duplicate.
    DeadLettered,
}

impl InboxStatus {
    /// The status as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            InboxStatus::Processed => "processed",
            InboxStatus::Retrying => "retrying",
            InboxStatus::DeadLettered => "dead_lettered",
        }
    }

    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "processed" => Some(InboxStatus::Processed),
            "retrying" => Some(InboxStatus::Retrying),
            "dead_lettered" => Some(InboxStatus::DeadLettered),
            _ => None,
        }
    }
}

/// Everything [`InboxStore::dead_letter`] records.
#[derive(Debug)]
pub struct DeadLetterRecord<'a> {
    /// Consumer name.
    pub consumer: &'a str,
    /// The inbox entry, when the message has a usable ID.
    pub entry: Option<Entry<'a>>,
    /// The original message: payload and headers are stored as received.
    pub message: &'a Message,
    /// Why.
    pub reason: DeadLetterReason,
    /// The error, already truncated.
    pub error: &'a str,
    /// Attempts made (0 when the handler never ran).
    pub attempts: u32,
    /// Most bytes of the payload stored, and most bytes of headers (names and values); the
    /// rest is cut and the row says so, with the payload's full size and SHA-256. The runtime
    /// passes [`ConsumerBuilder::dead_letter_payload_limit`](crate::ConsumerBuilder::dead_letter_payload_limit).
    pub payload_limit: usize,
}

impl DeadLetterRecord<'_> {
    /// What of the message is stored: payload and headers cut to
    /// [`payload_limit`](Self::payload_limit), the payload's full size and SHA-256.
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) fn stored(&self) -> StoredMessage<'_> {
        use sha2::{Digest, Sha256};
        let payload = &self.message.payload()[..];
        let kept = &payload[..payload.len().min(self.payload_limit)];
        let (headers, headers_cut) = headers_json_within(self.message.headers(), self.payload_limit);
        StoredMessage {
            payload: kept,
            headers,
            size: payload.len() as i64,
            sha256: Sha256::digest(payload).into(),
            truncated: kept.len() < payload.len() || headers_cut,
        }
    }
}

/// The part of a dead-lettered message a store writes; see [`DeadLetterRecord::stored`].
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) struct StoredMessage<'a> {
    pub(crate) payload: &'a [u8],
    pub(crate) headers: serde_json::Value,
    pub(crate) size: i64,
    pub(crate) sha256: [u8; 32],
    pub(crate) truncated: bool,
}

/// The outcome of [`InboxStore::dead_letter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterOutcome {
    /// Recorded with the requested reason.
    Recorded,
    /// The key was meanwhile taken by another payload (another delivery with the same ID
    /// committed first): recorded as a `conflict` instead.
    RecordedAsConflict,
    /// This very message is already dead-lettered: the same ID and fingerprint (e.g. an
    /// earlier COMMIT whose outcome looked unknown had in fact succeeded), or a pending dead
    /// letter at the same source position (a restart or replay read the record again), or a
    /// pending conflict of the same ID and fingerprint. Nothing new is recorded; the broker is
    /// still told to dead-letter it.
    AlreadyDeadLettered,
    /// Another consumer instance processed this message meanwhile: nothing recorded, the
    /// delivery is a duplicate.
    AlreadyProcessed,
}

/// A database failure, classified.
///
/// Its text names the store when the store classified it (`inbox database (PostgreSQL) …`,
/// `inbox database (SQLite) …`), and a missing txinbox table says which `migrate` to run.
/// The driver's error is its [`source()`](std::error::Error::source).
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    store: Option<Store>,
    source: Box<dyn std::error::Error + Send + Sync>,
}

/// Which store an error came from, for its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Store {
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "sqlite")]
    Sqlite,
}

impl Store {
    fn name(self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            Store::Postgres => "PostgreSQL",
            #[cfg(feature = "sqlite")]
            Store::Sqlite => "SQLite",
        }
    }

    fn migrate(self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            Store::Postgres => "txinbox::postgres::migrate",
            #[cfg(feature = "sqlite")]
            Store::Sqlite => "txinbox::sqlite::migrate",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreErrorKind {
    Unavailable,
    Contention,
    Busy,
    Fatal,
}

/// Whether a database error is a lock conflict with another transaction: a deadlock, a
/// serialization failure or a lock timeout on PostgreSQL (`40P01`, `40001`, `55P03`),
/// `SQLITE_BUSY` or `SQLITE_LOCKED` on SQLite. The one classification of contention: the
/// stores use it for their own statements, [`HandlerError`](crate::HandlerError) for a
/// handler's (the runtime re-runs such a transaction without counting an attempt), and
/// `txinbox-http` for its idempotency store (409, retry later, not "unavailable").
///
/// Not contention: a statement timeout or a session ended for idling in a transaction. Those
/// may be the message's own doing (a slow query, a handler waiting on a remote call), so they
/// count as attempts and end in a dead letter rather than a loop.
pub fn is_lock_conflict(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else {
        return false;
    };
    #[cfg(feature = "postgres")]
    if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        return matches!(pg.code(), "40P01" | "40001" | "55P03");
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        // Extended result codes keep the primary code in the low byte.
        let primary = db.code().and_then(|c| c.parse::<i32>().ok()).map(|c| c & 0xff);
        return matches!(primary, Some(5 | 6));
    }
    let _ = db;
    false
}

/// Whether a database error means the database is unavailable: it cannot be reached, refuses
/// connections, or ended the session. Not the work's fault, and not to be counted against it:
/// retry later, on a new connection, once the database is back. The one classification of an
/// outage: the stores use it for their own statements (intake pauses), the consumer for a
/// handler's errors (no attempt is counted), the outbox relay for its rounds (the health
/// report says "database unreachable"), `txinbox-http` for its answer (503 with
/// `Retry-After`) and the `txinbox` CLI for its exit code (3).
///
/// | | unavailable |
/// |---|---|
/// | any store | I/O errors, a pool timeout (no connection within the acquire timeout) or a closed pool, a crashed worker |
/// | PostgreSQL | class `08` (connection exception); `57P01` admin shutdown (`pg_terminate_backend`, a fast shutdown), `57P02` crash of another backend, `57P03` starting up or shutting down, and the rest of `57P` (database dropped, idle session timeout: the session is gone); `53300` too many connections (`max_connections`, or the role's or the database's `CONNECTION LIMIT`); `53100` disk full; `55000` **only** when fatal, which is a refused connection (`ALLOW_CONNECTIONS false`: "database … is not currently accepting connections"), as a statement's `55000` (object not in prerequisite state) is the statement's own; a protocol error (the connection is out of step) |
/// | SQLite | `SQLITE_IOERR`, `SQLITE_FULL` (disk full), `SQLITE_CANTOPEN` (the file cannot be opened) |
///
/// Not unavailable: a lost lock conflict ([`is_lock_conflict`]: `SQLITE_BUSY` and
/// `SQLITE_LOCKED` included), a statement timeout, everything the database answered about
/// the statement itself (a constraint, a missing table, a permission), and a refused TLS
/// connection ([`tls_refusal`]: a certificate signed by a CA the client does not trust or
/// issued for another host, a server without TLS, plaintext to a TLS-only server): that is a
/// configuration error, which does not go away by waiting, like a wrong password. At start,
/// connecting fails with it; a running consumer that meets it (the server's certificate was
/// replaced by one the client does not trust) stops and reports it rather than pausing
/// intake forever. A TLS connection the network breaks (reset, closed mid-handshake) is an
/// I/O error: unavailable.
///
/// Failing closed has a price: a handler whose own statement ends its session (it terminates
/// its own backend, or crashes the server) is retried without limit, as an outage would be.
pub fn is_unavailable(e: &sqlx::Error) -> bool {
    if tls_refusal(e).is_some() {
        return false;
    }
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => {
            #[cfg(feature = "postgres")]
            if let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
                let code = pg.code();
                return code.starts_with("08")
                    || code.starts_with("57P")
                    || matches!(code, "53300" | "53100")
                    || (code == "55000" && pg.severity() == sqlx::postgres::PgSeverity::Fatal);
            }
            #[cfg(feature = "sqlite")]
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                // Extended result codes keep the primary code in the low byte.
                let primary = db.code().and_then(|c| c.parse::<i32>().ok()).map(|c| c & 0xff);
                return matches!(primary, Some(10 | 13 | 14));
            }
            let _ = db;
            false
        }
        _ => false,
    }
}

/// What to change when a connection's TLS was refused, on either side, or `None` when `e` is
/// not such a refusal. The one place that reads sqlx's and rustls's TLS errors: the stores
/// report it ([`StoreError`] fatal, with this advice), [`is_unavailable`] leaves it out, and the
/// CLI and the examples print it.
///
/// | refusal | advice |
/// |---|---|
/// | the server's certificate is signed by a CA this client does not trust (rustls `UnknownIssuer`) | set `sslrootcert` to the provider's CA bundle |
/// | the certificate is not valid for the host connected to | connect with a name the certificate names, or `sslmode=verify-ca` |
/// | expired or not yet valid, bad signature, wrong purpose, other certificate errors | what rustls says, and to check the server's certificate and `sslrootcert` |
/// | the server sent a handshake alert (an untrusted client certificate, no common TLS version) | `sslcert` and `sslkey` |
/// | `cert` authentication without a client certificate, or with another user's | `sslcert` and `sslkey`; the certificate's common name |
/// | the server does not speak TLS while `sslmode` requires it | enable `ssl` on the server, or `sslmode=prefer` for a local one |
/// | plaintext to a TLS-only server (`hostssl`: "no pg_hba.conf entry … no encryption") | `sslmode=verify-full&sslrootcert=…` or `sslmode=require` |
/// | a client certificate without its key, or a key file without a key | `sslcert` and `sslkey` together |
/// | any other TLS set-up error of sqlx (a certificate file that is not PEM) | `sslrootcert`, `sslcert`, `sslkey` |
/// | txinbox built without its `tls` feature | the feature |
pub fn tls_refusal(e: &sqlx::Error) -> Option<String> {
    const FILES: &str = "check sslrootcert, sslcert and sslkey";
    match e {
        // sqlx's own: the server answered `N` to the SSLRequest, a file it could not use,
        // a build without TLS.
        sqlx::Error::Tls(inner) => {
            let text = inner.to_string();
            Some(if text.contains("server does not support TLS") {
                "the server does not accept TLS connections, but the URL's sslmode requires TLS: \
                 enable ssl on the server (a managed database always has it), or use \
                 sslmode=prefer or disable for a local development server"
                    .to_owned()
            } else if text.contains("without TLS support") {
                "TLS is required by the URL's sslmode, but txinbox was built without its `tls` \
                 feature: enable it (it is on by default)"
                    .to_owned()
            } else {
                format!("TLS could not be set up: {text} ({FILES})")
            })
        }
        // sqlx's check of the client certificate's files.
        sqlx::Error::Configuration(inner)
            if inner.to_string().contains("user auth key and certs")
                || inner.to_string().contains("no keys found") =>
        {
            Some(format!(
                "the client certificate is incomplete: {inner} (give sslcert and sslkey together, \
                 sslkey a PEM private key)"
            ))
        }
        // rustls's, inside the I/O error of a refused handshake.
        sqlx::Error::Io(io) => {
            #[cfg(feature = "tls")]
            if let Some(tls) = io.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
                return rustls_refusal(tls);
            }
            let _ = io;
            None
        }
        // PostgreSQL's own: no `host` line of pg_hba.conf for a plaintext connection, only
        // `hostssl` ones.
        sqlx::Error::Database(db)
            if db.code().as_deref() == Some("28000") && db.message().contains("no encryption") =>
        {
            Some(
                "the server accepts TLS connections only, and this one was plaintext: add \
                 sslmode=verify-full&sslrootcert=<the server's CA certificate> to the URL (or \
                 sslmode=require, which encrypts without checking the certificate)"
                    .to_owned(),
            )
        }
        // `cert` authentication (`hostssl … cert`): no client certificate, or one whose
        // common name is another role.
        sqlx::Error::Database(db)
            if db.code().as_deref() == Some("28000") && db.message().contains("client certificate") =>
        {
            Some(
                "the server requires a client certificate for this user: set sslcert and sslkey \
                 in the URL to a certificate (and its key) issued by a CA the server trusts"
                    .to_owned(),
            )
        }
        sqlx::Error::Database(db)
            if db.code().as_deref() == Some("28000")
                && db.message().starts_with("certificate authentication failed") =>
        {
            Some(
                "the client certificate is not this user's: its common name (CN) must be the \
                 user name of the URL (or be mapped to it in the server's pg_ident.conf)"
                    .to_owned(),
            )
        }
        _ => None,
    }
}

/// [`tls_refusal`] for rustls's error: `None` for what is not about certificates or the
/// handshake's agreement (those stay I/O errors, retried as outages).
#[cfg(feature = "tls")]
fn rustls_refusal(e: &rustls::Error) -> Option<String> {
    use rustls::{AlertDescription as A, CertificateError as C};
    const CHECK: &str = "check the server's certificate and the URL's sslrootcert";
    Some(match e {
        rustls::Error::InvalidCertificate(C::UnknownIssuer) => {
            "the server's certificate is signed by a certificate authority this client does not \
             trust (unknown CA): set sslrootcert in the URL to your provider's CA bundle \
             (sslmode=verify-full&sslrootcert=/path/to/ca.pem), or install that CA in the \
             system's trust store"
                .to_owned()
        }
        rustls::Error::InvalidCertificate(C::NotValidForNameContext { expected, presented }) => {
            format!(
                "the server's certificate is not valid for host {} (it names {}): connect with a \
                 host name the certificate names, or use sslmode=verify-ca, which checks the CA \
                 but not the name",
                expected.to_str(),
                if presented.is_empty() {
                    "no host".to_owned()
                } else {
                    presented
                        .iter()
                        .map(|name| bare_name(name))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            )
        }
        rustls::Error::InvalidCertificate(C::NotValidForName) => {
            "the server's certificate is not valid for the host connected to: connect with a host \
             name the certificate names, or use sslmode=verify-ca, which checks the CA but not \
             the name"
                .to_owned()
        }
        rustls::Error::InvalidCertificate(other) => {
            format!("the server's certificate was refused: {other:?} ({CHECK})")
        }
        rustls::Error::NoCertificatesPresented => {
            format!("the server presented no certificate ({CHECK})")
        }
        rustls::Error::AlertReceived(
            alert @ (A::BadCertificate
            | A::UnsupportedCertificate
            | A::CertificateRevoked
            | A::CertificateExpired
            | A::CertificateUnknown
            | A::UnknownCA
            | A::AccessDenied
            | A::CertificateRequired
            | A::HandshakeFailure
            | A::ProtocolVersion
            | A::InsufficientSecurity),
        ) => format!(
            "the server refused the TLS handshake ({alert:?}): it may require a client \
             certificate it trusts (sslcert and sslkey in the URL) or a TLS version or cipher \
             this client does not offer"
        ),
        rustls::Error::PeerIncompatible(why) => format!(
            "the server's TLS is incompatible with this client ({why:?}): it needs TLS 1.2 or \
             1.3 with a modern cipher suite"
        ),
        _ => return None,
    })
}

/// A name as rustls presents it (`DnsName("db.example.com")`, `IpAddress(10.0.0.1)`), bare.
#[cfg(feature = "tls")]
fn bare_name(presented: &str) -> &str {
    for (open, close) in [("DnsName(\"", "\")"), ("IpAddress(", ")")] {
        if let Some(inner) = presented.strip_prefix(open).and_then(|p| p.strip_suffix(close)) {
            return inner;
        }
    }
    presented
}

/// A refused TLS connection ([`tls_refusal`]): the advice, then the driver's error.
#[derive(Debug)]
struct Refusal {
    advice: String,
    source: sqlx::Error,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.advice, self.source)
    }
}

impl std::error::Error for Refusal {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// `e` classified by the store whose database answered it (the PostgreSQL or SQLite rules,
/// naming the store); an error without a database answer (I/O, a pool timeout) by the rules
/// every store shares.
pub(crate) fn classify(e: sqlx::Error) -> StoreError {
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    if let sqlx::Error::Database(db) = &e {
        #[cfg(feature = "postgres")]
        if db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().is_some() {
            return postgres::classify(e);
        }
        #[cfg(feature = "sqlite")]
        if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
            return sqlite::classify(e);
        }
    }
    let e = match StoreError::from_tls_refusal(e) {
        Ok(refused) => return refused,
        Err(e) => e,
    };
    if is_lock_conflict(&e) {
        StoreError::contention(e)
    } else if is_unavailable(&e) {
        StoreError::transient(e)
    } else {
        StoreError::fatal(e)
    }
}

impl StoreError {
    /// `e` as a fatal error that says what to change, when it is a refused TLS connection
    /// ([`tls_refusal`]); otherwise `e` back.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn from_tls_refusal(e: sqlx::Error) -> Result<StoreError, sqlx::Error> {
        match tls_refusal(&e) {
            Some(advice) => Ok(StoreError::fatal(Refusal { advice, source: e })),
            None => Err(e),
        }
    }

    /// The database cannot be reached or cannot serve: connection lost, server restarting, pool
    /// exhausted. The runtime pauses intake and retries with backoff.
    pub fn transient(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError {
            kind: StoreErrorKind::Unavailable,
            store: None,
            source: source.into(),
        }
    }

    /// The database is fine but this transaction lost a lock conflict with another one:
    /// serialization failure, deadlock, lock timeout, SQLite busy. The work is re-run with
    /// backoff, without counting an attempt; intake goes on.
    pub fn contention(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError {
            kind: StoreErrorKind::Contention,
            store: None,
            source: source.into(),
        }
    }

    /// The database is up but could not serve this in time: a statement timeout, a session
    /// ended for idling in a transaction, a pool whose every connection is busy. Retried with
    /// backoff; intake goes on, and it is not reported as an outage. When it happens inside a
    /// message's transaction it counts as an attempt (it may be the message's own doing).
    pub fn busy(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError {
            kind: StoreErrorKind::Busy,
            store: None,
            source: source.into(),
        }
    }

    /// A failure that will not go away by itself (missing table, permission denied): the
    /// consumer stops and reports it.
    pub fn fatal(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError {
            kind: StoreErrorKind::Fatal,
            store: None,
            source: source.into(),
        }
    }

    /// The same error, as one of `store`'s: its text names the store.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn in_store(mut self, store: Store) -> Self {
        self.store = Some(store);
        self
    }

    /// Whether the cause is a missing table or schema of the store (the migrations were not
    /// applied): PostgreSQL `42P01` or `3F000`, SQLite "no such table".
    fn missing_table(&self) -> bool {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&*self.source);
        while let Some(e) = cause {
            if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>() {
                return matches!(db.code().as_deref(), Some("42P01" | "3F000"))
                    || db.message().starts_with("no such table");
            }
            cause = e.source();
        }
        false
    }

    /// Whether the runtime should back off and retry.
    pub fn is_transient(&self) -> bool {
        self.kind != StoreErrorKind::Fatal
    }

    /// Whether the database itself is unavailable (as opposed to contention): intake pauses.
    pub fn is_unavailable(&self) -> bool {
        self.kind == StoreErrorKind::Unavailable
    }

    /// Whether the statement lost a lock conflict with another transaction (deadlock,
    /// serialization failure, lock timeout): re-run the work, the database is fine, and the
    /// message is not to blame.
    pub fn is_contention(&self) -> bool {
        self.kind == StoreErrorKind::Contention
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let database = match self.store {
            Some(store) => format!("inbox database ({})", store.name()),
            None => "inbox database".to_owned(),
        };
        match self.kind {
            StoreErrorKind::Unavailable => {
                write!(f, "{database} unavailable (will retry): {}", self.source)
            }
            StoreErrorKind::Contention => {
                write!(
                    f,
                    "{database}: the transaction lost a lock conflict (will retry): {}",
                    self.source
                )
            }
            StoreErrorKind::Busy => {
                write!(f, "{database} busy (will retry): {}", self.source)
            }
            StoreErrorKind::Fatal => {
                write!(f, "{database} error: {}", self.source)?;
                match self.store {
                    Some(store) if self.missing_table() => {
                        write!(f, " (a txinbox table is missing: run {} first)", store.migrate())
                    }
                    _ => Ok(()),
                }
            }
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// What a store's `dead_letter` does when marking the inbox row changed nothing: the key is
/// taken. `row` is the key's `(status, fingerprint)` as read after the failed mark.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) enum Taken {
    /// Record the dead letter as a conflict, with this error text.
    AsConflict(String),
    /// Record nothing; report this outcome.
    Skip(DeadLetterOutcome),
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl Taken {
    pub(crate) fn decide(
        row: Option<(String, Vec<u8>)>,
        entry: &Entry<'_>,
        error: &str,
    ) -> Result<Taken, StoreError> {
        match row {
            Some((_, fp)) if fp != entry.fingerprint[..] => Ok(Taken::AsConflict(clean_text(&format!(
                "message ID {} was taken by a different payload meanwhile; this one failed with: {error}",
                entry.id
            )))),
            Some((status, _)) if status == InboxStatus::DeadLettered.as_str() => {
                Ok(Taken::Skip(DeadLetterOutcome::AlreadyDeadLettered))
            }
            Some(_) => Ok(Taken::Skip(DeadLetterOutcome::AlreadyProcessed)),
            None => Err(StoreError::contention(
                "inbox row vanished while dead-lettering (concurrent purge)",
            )),
        }
    }
}

/// Cuts `s` to at most [`MAX_ERROR_LEN`] bytes at a character boundary and drops NUL
/// characters, which PostgreSQL text cannot hold.
pub(crate) fn clean_text(s: &str) -> String {
    let mut end = s.len().min(MAX_ERROR_LEN);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].replace('\0', "")
}

/// [`headers_json`] of the headers, in order, while their names and values add up to at most
/// `limit` bytes; `true` if some were left out.
fn headers_json_within(headers: &Headers, limit: usize) -> (serde_json::Value, bool) {
    if headers.byte_len() <= limit {
        return (headers_json(headers), false);
    }
    let mut budget = limit;
    let mut kept = Headers::new();
    for (name, value) in headers.iter() {
        let size = name.len() + value.len();
        if size > budget {
            break;
        }
        budget -= size;
        kept.insert(name, value.to_vec());
    }
    (headers_json(&kept), true)
}

#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
/// Headers as a JSON array of `{"name": .., "value": ..}`. A name or value that is not valid
/// UTF-8, or contains NUL (which `jsonb` rejects), is stored hex-encoded under `name_hex` /
/// `value_hex` instead, so nothing is lost.
pub(crate) fn headers_json(headers: &Headers) -> serde_json::Value {
    fn field(obj: &mut serde_json::Map<String, serde_json::Value>, key: &str, bytes: &[u8]) {
        match std::str::from_utf8(bytes) {
            Ok(s) if !s.contains('\0') => {
                obj.insert(key.into(), s.into());
            }
            _ => {
                obj.insert(format!("{key}_hex"), crate::message::hex(bytes).into());
            }
        }
    }
    headers
        .iter()
        .map(|(name, value)| {
            let mut obj = serde_json::Map::new();
            field(&mut obj, "name", name.as_bytes());
            field(&mut obj, "value", value);
            serde_json::Value::Object(obj)
        })
        .collect()
}

/// [`headers_json`] read back: entries it cannot read are skipped.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(crate) fn headers_from_json(stored: &serde_json::Value) -> Headers {
    fn field(obj: &serde_json::Map<String, serde_json::Value>, key: &str) -> Option<Vec<u8>> {
        if let Some(s) = obj.get(key).and_then(|v| v.as_str()) {
            return Some(s.as_bytes().to_vec());
        }
        let hex = obj.get(&format!("{key}_hex"))?.as_str()?;
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
            .collect()
    }
    let mut headers = Headers::new();
    for entry in stored.as_array().into_iter().flatten() {
        let Some(obj) = entry.as_object() else { continue };
        if let (Some(name), Some(value)) = (field(obj, "name"), field(obj, "value")) {
            headers.insert(String::from_utf8_lossy(&name).into_owned(), value);
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_text_truncates_on_char_boundaries_and_drops_nul() {
        let long = "é".repeat(MAX_ERROR_LEN); // 2 bytes each
        let cut = clean_text(&long);
        assert!(cut.len() <= MAX_ERROR_LEN);
        assert!(cut.chars().all(|c| c == 'é'));
        assert_eq!(clean_text("a\0b"), "ab");
    }

    #[test]
    fn headers_that_are_not_clean_utf8_are_kept_as_hex() {
        let h = Headers::new()
            .with("ce_id", "abc")
            .with("bin", &b"\xff\x00"[..])
            .with("nul", "a\0b");
        let j = headers_json(&h);
        assert_eq!(j[0]["value"], "abc");
        assert_eq!(j[1]["value_hex"], "ff00");
        assert_eq!(j[2]["value_hex"], "610062");
        assert!(j[1].get("value").is_none());
    }
}
