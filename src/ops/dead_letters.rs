//! Dead letters: listing, reading, requeueing and discarding them.
//!
//! Rows are never deleted here. A requeue stamps `requeued_at` (and counts), a discard stamps
//! `discarded_at` with the operator's reason; a dead letter is *pending* while neither is set.
//!
//! # Requeue
//!
//! [`Requeue::begin`] locks the dead letter in a transaction and, only if the message's inbox
//! row is `dead_lettered` with the same fingerprint, reopens it (`retrying`, attempts reset),
//! so the consumer's claim succeeds when the copy arrives. Any other row is left alone: a
//! `processed` row makes the copy a duplicate, which is exactly what a second requeue must
//! give. The caller publishes the copy while the transaction is open and then
//! [commits](Requeue::commit); a consumer that receives the copy first waits on the row lock,
//! then sees the reopened row.

use sqlx::{Postgres, Row as _, Transaction};

use super::{on_db, Db, Timestamp};
use crate::message::Headers;
use crate::store::InboxStatus;

/// A recorded dead letter.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterRow {
    /// Its identifier.
    pub id: i64,
    /// Consumer name.
    pub consumer: String,
    /// Message ID, when the message had a usable one.
    pub message_id: Option<String>,
    /// The ID strategy's label (`cloudevents`, `header:x-id`, `offset`, …).
    pub id_strategy: Option<String>,
    /// Payload fingerprint.
    pub fingerprint: Option<Vec<u8>>,
    /// Machine-readable reason (`permanent_error`, `conflict`, …).
    pub reason: String,
    /// The error text.
    pub error: String,
    /// Attempts made.
    pub attempts: i32,
    /// The original payload.
    pub payload: Vec<u8>,
    /// The original headers as stored (a JSON array of `{name, value}`, `*_hex` when binary).
    pub headers: serde_json::Value,
    /// `messaging.system` of the origin: `kafka`, `rabbitmq`, …
    pub source_system: String,
    /// Topic or queue.
    pub destination: String,
    /// Kafka partition.
    pub source_partition: Option<i32>,
    /// Kafka offset.
    pub source_offset: Option<i64>,
    /// When it was recorded.
    pub dead_lettered_at: Timestamp,
    /// When it was last requeued.
    pub requeued_at: Option<Timestamp>,
    /// How many times it was requeued.
    pub requeue_count: i32,
    /// When it was discarded.
    pub discarded_at: Option<Timestamp>,
    /// Why it was discarded.
    pub discard_reason: Option<String>,
    /// The message's size as received (payload bytes); `None` for rows older than the column.
    pub payload_size: Option<i64>,
    /// SHA-256 of the payload as received.
    pub payload_sha256: Option<Vec<u8>>,
    /// The stored payload or headers are a cut copy (over `dead_letter_payload_limit`): the
    /// row cannot be republished; the original is in the broker until its retention.
    pub truncated: bool,
}

impl DeadLetterRow {
    /// `pending`, `requeued` or `discarded`.
    pub fn state(&self) -> &'static str {
        if self.discarded_at.is_some() {
            "discarded"
        } else if self.requeued_at.is_some() {
            "requeued"
        } else {
            "pending"
        }
    }

    /// The original headers, decoded from their stored form.
    pub fn original_headers(&self) -> Headers {
        headers_from_json(&self.headers)
    }
}

/// The columns [`from_row!`] reads, times as epoch milliseconds.
fn columns(db: Db<'_>) -> String {
    format!(
        "id, consumer, message_id, id_strategy, fingerprint, reason, error, attempts, payload, headers,
         source_system, destination, source_partition, source_offset, {}, {}, requeue_count, {},
         discard_reason, payload_size, payload_sha256, truncated",
        db.ms("dead_lettered_at"),
        db.ms("requeued_at"),
        db.ms("discarded_at"),
    )
}

/// A [`DeadLetterRow`] from a row of [`columns`], on either backend's row type.
macro_rules! from_row {
    ($r:expr) => {{
        let r = $r;
        Ok::<_, sqlx::Error>(DeadLetterRow {
            id: r.try_get(0)?,
            consumer: r.try_get(1)?,
            message_id: r.try_get(2)?,
            id_strategy: r.try_get(3)?,
            fingerprint: r.try_get(4)?,
            reason: r.try_get(5)?,
            error: r.try_get(6)?,
            attempts: r.try_get(7)?,
            payload: r.try_get(8)?,
            headers: r.try_get(9)?,
            source_system: r.try_get(10)?,
            destination: r.try_get(11)?,
            source_partition: r.try_get(12)?,
            source_offset: r.try_get(13)?,
            dead_lettered_at: Timestamp(r.try_get(14)?),
            requeued_at: r.try_get::<Option<i64>, _>(15)?.map(Timestamp),
            requeue_count: r.try_get(16)?,
            discarded_at: r.try_get::<Option<i64>, _>(17)?.map(Timestamp),
            discard_reason: r.try_get(18)?,
            payload_size: r.try_get(19)?,
            payload_sha256: r.try_get(20)?,
            truncated: r.try_get(21)?,
        })
    }};
}

/// Which dead letters to list.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this consumer's.
    pub consumer: Option<String>,
    /// Only with this reason.
    pub reason: Option<String>,
    /// Only recorded at or after this time.
    pub since: Option<Timestamp>,
    /// Only in this state: `pending`, `requeued` or `discarded`.
    pub state: Option<String>,
    /// At most this many, newest first.
    pub limit: i64,
}

/// Dead letters matching `filter`, newest first.
pub async fn list<'a>(db: impl Into<Db<'a>>, filter: &Filter) -> Result<Vec<DeadLetterRow>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "SELECT {} FROM {}
         WHERE (CAST($1 AS text) IS NULL OR consumer = $1)
           AND (CAST($2 AS text) IS NULL OR reason = $2)
           AND (CAST($3 AS bigint) IS NULL OR dead_lettered_at >= {})
           AND (CAST($4 AS text) IS NULL
                OR ($4 = 'discarded' AND discarded_at IS NOT NULL)
                OR ($4 = 'requeued' AND discarded_at IS NULL AND requeued_at IS NOT NULL)
                OR ($4 = 'pending' AND discarded_at IS NULL AND requeued_at IS NULL))
         ORDER BY id DESC LIMIT $5",
        columns(db),
        db.table("dead_letters"),
        db.at_ms("$3"),
    );
    on_db!(db, pool => {
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&filter.consumer)
            .bind(&filter.reason)
            .bind(filter.since.map(|t| t.0))
            .bind(&filter.state)
            .bind(filter.limit)
            .fetch_all(pool)
            .await?;
        rows.iter().map(|r| from_row!(r)).collect()
    })
}

/// One dead letter by its identifier.
pub async fn get<'a>(db: impl Into<Db<'a>>, id: i64) -> Result<Option<DeadLetterRow>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "SELECT {} FROM {} WHERE id = $1",
        columns(db),
        db.table("dead_letters")
    );
    on_db!(db, pool => {
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(pool)
            .await?;
        row.as_ref().map(|r| from_row!(r)).transpose()
    })
}

/// Marks a dead letter discarded with `reason`, keeping the row. Returns the row as it is now,
/// or `None` if there is no such dead letter. Discarding twice keeps the first time and reason.
pub async fn discard<'a>(
    db: impl Into<Db<'a>>,
    id: i64,
    reason: &str,
) -> Result<Option<DeadLetterRow>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "UPDATE {} SET discarded_at = {}, discard_reason = $2
         WHERE id = $1 AND discarded_at IS NULL",
        db.table("dead_letters"),
        db.now()
    );
    on_db!(db, pool => {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(reason)
            .execute(pool)
            .await?;
    });
    get(db, id).await
}

/// Other consumers with stored positions in `source` (Kafka: they read the same topic, so a
/// requeued copy reaches them too) whose inbox holds no row for `message_id`: they would take
/// the copy for a new message.
pub async fn readers_without_row<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    source: &str,
    message_id: &str,
) -> Result<Vec<String>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "SELECT DISTINCT p.consumer FROM {} p
         WHERE p.source = $2 AND p.consumer <> $1
           AND NOT EXISTS (SELECT 1 FROM {} i
                           WHERE i.consumer = p.consumer AND i.message_id = $3)
         ORDER BY p.consumer",
        db.table("positions"),
        db.table("inbox"),
    );
    on_db!(db, pool => {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .bind(source)
            .bind(message_id)
            .fetch_all(pool)
            .await
    })
}

/// The open transaction of a [`Requeue`], on either backend.
#[derive(Debug)]
enum RequeueTx {
    Postgres(Transaction<'static, Postgres>),
    #[cfg(feature = "sqlite")]
    Sqlite(Transaction<'static, sqlx::Sqlite>),
}

/// A requeue in progress: the dead letter is locked; see the [module docs](self).
#[derive(Debug)]
pub struct Requeue {
    tx: RequeueTx,
    /// The dead letter, as read under the lock.
    pub row: DeadLetterRow,
    /// The inbox row's status before the requeue (`None`: no row, e.g. purged).
    pub inbox_before: Option<InboxStatus>,
    /// Whether the inbox row was reopened (it was `dead_lettered` with the same fingerprint).
    pub reopened: bool,
}

impl Requeue {
    /// Locks dead letter `id` and reopens its inbox row if it is `dead_lettered` with the same
    /// fingerprint. `None` if there is no such dead letter. Nothing is visible to others until
    /// [`commit`](Self::commit); dropping the value rolls everything back.
    ///
    /// PostgreSQL locks the two rows (`FOR UPDATE`); SQLite has no row locks, so the
    /// transaction begins with `BEGIN IMMEDIATE` and holds the database's write lock: a
    /// consumer's claim of the copy waits (its busy timeout) until the commit.
    pub async fn begin<'a>(db: impl Into<Db<'a>>, id: i64) -> Result<Option<Requeue>, sqlx::Error> {
        let db = db.into();
        let lock = if db.is_sqlite() { "" } else { " FOR UPDATE" };
        let (dead, inbox) = (db.table("dead_letters"), db.table("inbox"));
        let read = format!("SELECT {} FROM {dead} WHERE id = $1{lock}", columns(db));
        // Lock the inbox row too, so the consumer's claim of the copy waits for our commit.
        let read_inbox =
            format!("SELECT status, fingerprint FROM {inbox} WHERE consumer = $1 AND message_id = $2{lock}");
        let reopen = format!(
            "UPDATE {inbox}
             SET status = 'retrying', attempts = 0, processed_at = NULL,
                 last_error = 'requeued from dead letter ' || $3
             WHERE consumer = $1 AND message_id = $2 AND status = 'dead_lettered'"
        );
        let stamp = format!(
            "UPDATE {dead} SET requeued_at = {}, requeue_count = requeue_count + 1 WHERE id = $1",
            db.now()
        );
        macro_rules! run {
            ($tx:ident, $wrap:expr) => {{
                let found = sqlx::query(sqlx::AssertSqlSafe(read))
                    .bind(id)
                    .fetch_optional(&mut *$tx)
                    .await?;
                let Some(row) = found.as_ref().map(|r| from_row!(r)).transpose()? else {
                    return Ok(None);
                };
                let mut inbox_before = None;
                let mut reopened = false;
                if let Some(message_id) = &row.message_id {
                    let existing: Option<(String, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(read_inbox))
                        .bind(&row.consumer)
                        .bind(message_id)
                        .fetch_optional(&mut *$tx)
                        .await?;
                    if let Some((status, fingerprint)) = existing {
                        inbox_before = InboxStatus::parse(&status);
                        if inbox_before == Some(InboxStatus::DeadLettered)
                            && Some(&fingerprint) == row.fingerprint.as_ref()
                        {
                            sqlx::query(sqlx::AssertSqlSafe(reopen))
                                .bind(&row.consumer)
                                .bind(message_id)
                                .bind(id.to_string())
                                .execute(&mut *$tx)
                                .await?;
                            reopened = true;
                        }
                    }
                }
                sqlx::query(sqlx::AssertSqlSafe(stamp))
                    .bind(id)
                    .execute(&mut *$tx)
                    .await?;
                Ok(Some(Requeue {
                    tx: $wrap($tx),
                    row,
                    inbox_before,
                    reopened,
                }))
            }};
        }
        match db {
            Db::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                run!(tx, RequeueTx::Postgres)
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite(pool) => {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                run!(tx, RequeueTx::Sqlite)
            }
        }
    }

    /// Makes the reopening and the requeue stamp durable. Call it after the copy was published.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        match self.tx {
            RequeueTx::Postgres(tx) => tx.commit().await,
            #[cfg(feature = "sqlite")]
            RequeueTx::Sqlite(tx) => tx.commit().await,
        }
    }
}

/// Decodes headers stored by the inbox store (`[{"name": .., "value": ..}]`, with `name_hex` /
/// `value_hex` for bytes that were not UTF-8) back into [`Headers`]. Entries it cannot read are
/// skipped.
pub fn headers_from_json(stored: &serde_json::Value) -> Headers {
    crate::store::headers_from_json(stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_headers_decode_back_including_binary_values() {
        let h = Headers::new()
            .with("ce_id", "abc")
            .with("bin", &b"\xff\x00"[..])
            .with("nul", &b"a\0b"[..]);
        let stored = crate::store::headers_json(&h);
        assert_eq!(headers_from_json(&stored), h);
        assert!(headers_from_json(&serde_json::json!({"not": "an array"})).is_empty());
    }
}
