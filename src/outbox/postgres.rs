//! The outbox on PostgreSQL (`txinbox.outbox`): the insert behind [`write`](super::write) and
//! the relay's statements. A round claims its rows with `FOR UPDATE SKIP LOCKED` and marks them
//! in the same transaction, so the row locks are the claim.

use bytes::Bytes;
use futures::future::BoxFuture;
use sqlx::postgres::{PgListener, PgPool, PgRow};
use sqlx::{Postgres, Row, Transaction};

use super::relay::{Claimed, Settlement};
use super::{sealed, OutboxDatabase, OutboxMessage, NOTIFY_CHANNEL};
use crate::message::Headers;

impl OutboxDatabase for Postgres {}

/// Inserts the row, or, when its ID is taken by a row with another destination, key or payload,
/// touches that row (a no-op update, so the statement can report it) and returns what differs.
/// The same message written again returns no row. ON CONFLICT DO UPDATE, unlike a separate
/// read, sees a conflicting row that a concurrent transaction committed while this one waited.
const INSERT: &str = "\
INSERT INTO txinbox.outbox AS o (message_id, destination, message_key, payload, header_names, header_values)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (message_id) DO UPDATE SET message_id = EXCLUDED.message_id
    WHERE o.destination <> EXCLUDED.destination
       OR o.message_key IS DISTINCT FROM EXCLUDED.message_key
       OR o.payload <> EXCLUDED.payload
RETURNING o.destination = $2, o.message_key IS NOT DISTINCT FROM $3, o.payload = $4";

impl sealed::Sealed for Postgres {
    fn insert<'e, 'c: 'e, E>(
        executor: E,
        message: &'e OutboxMessage,
        headers: &'e Headers,
    ) -> BoxFuture<'e, Result<Option<sealed::Differs>, sqlx::Error>>
    where
        E: sqlx::Executor<'c, Database = Self> + 'e,
    {
        let (names, values): (Vec<&str>, Vec<&[u8]>) = headers.iter().unzip();
        Box::pin(
            sqlx::query_as(INSERT)
                .bind(&message.message_id)
                .bind(&message.destination)
                .bind(message.key.as_deref())
                .bind(message.payload.as_ref())
                .bind(names)
                .bind(values)
                .fetch_optional(executor),
        )
    }
}

const CLAIM_HEADS: &str = "\
SELECT o.id, o.attempts, o.message_id, o.destination, o.message_key, o.payload, o.header_names, o.header_values
FROM txinbox.outbox o
WHERE o.status = 'pending' AND o.next_attempt_at <= now()
  AND (o.message_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM txinbox.outbox p
        WHERE p.status = 'pending' AND p.destination = o.destination
          AND p.message_key = o.message_key AND p.id < o.id))
ORDER BY o.id
LIMIT $1
FOR UPDATE OF o SKIP LOCKED";

// The later rows of keys whose head this transaction holds. Nobody else can hold them: another
// relay would have to hold their head first. (`FOR UPDATE` re-checks `status` if a row changed.)
// This statement sees a newer snapshot than the head claim: a row with a lower ID than the head
// may have committed since (IDs are taken at insert, not commit). Then the head is not the
// key's oldest pending row any more, and the key gets no followers this round — otherwise rows
// written after that late row committed would be published before it.
const CLAIM_FOLLOWERS: &str = "\
SELECT o.id, o.attempts, o.message_id, o.destination, o.message_key, o.payload, o.header_names, o.header_values
FROM txinbox.outbox o
JOIN unnest($1::text[], $2::bytea[], $3::bigint[]) AS h(destination, message_key, head)
  ON o.destination = h.destination AND o.message_key = h.message_key AND o.id > h.head
WHERE o.status = 'pending'
  AND NOT EXISTS (
        SELECT 1 FROM txinbox.outbox p
        WHERE p.status = 'pending' AND p.destination = h.destination
          AND p.message_key = h.message_key AND p.id < h.head)
ORDER BY o.id
LIMIT $4
FOR UPDATE OF o";

const MARK_PUBLISHED: &str = "\
UPDATE txinbox.outbox
SET status = 'published', published_at = now(), attempts = attempts + 1, last_error = NULL
WHERE id = ANY($1)";

const MARK_FAILED: &str = "\
UPDATE txinbox.outbox
SET attempts = attempts + 1, last_error = $2,
    next_attempt_at = now() + make_interval(secs => $3),
    status = CASE WHEN $4 THEN 'dead_lettered' ELSE 'pending' END
WHERE id = $1";

const PURGE: &str = "\
DELETE FROM txinbox.outbox WHERE id IN (
    SELECT id FROM txinbox.outbox
    WHERE status = 'published' AND published_at < now() - make_interval(secs => $1)
    ORDER BY published_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED)";

const BACKLOG: &str = "\
SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at))::float8, 0)
FROM txinbox.outbox WHERE status = 'pending'";

/// Claims up to `limit` due rows in `tx`: the heads of their keys, then the later rows of the
/// claimed keys. Sorted by ID.
pub(super) async fn claim(
    tx: &mut Transaction<'static, Postgres>,
    limit: usize,
) -> Result<Vec<Claimed>, sqlx::Error> {
    let mut rows = sqlx::query(CLAIM_HEADS)
        .bind(limit as i64)
        .fetch_all(&mut **tx)
        .await?
        .into_iter()
        .map(claimed)
        .collect::<Result<Vec<_>, _>>()?;
    let room = limit.saturating_sub(rows.len());
    let keyed: Vec<&Claimed> = rows.iter().filter(|r| r.message.key.is_some()).collect();
    if room > 0 && !keyed.is_empty() {
        let destinations: Vec<&str> = keyed.iter().map(|r| r.message.destination.as_str()).collect();
        let keys: Vec<&[u8]> = keyed
            .iter()
            .map(|r| r.message.key.as_deref().unwrap_or_default())
            .collect();
        let heads: Vec<i64> = keyed.iter().map(|r| r.id).collect();
        let followers = sqlx::query(CLAIM_FOLLOWERS)
            .bind(destinations)
            .bind(keys)
            .bind(heads)
            .bind(room as i64)
            .fetch_all(&mut **tx)
            .await?;
        for row in followers {
            rows.push(claimed(row)?);
        }
    }
    rows.sort_by_key(|r| r.id);
    Ok(rows)
}

/// Marks the round's rows in its transaction (released rows need nothing: COMMIT unlocks them).
pub(super) async fn settle(
    tx: &mut Transaction<'static, Postgres>,
    settlement: &Settlement,
) -> Result<(), sqlx::Error> {
    if !settlement.published.is_empty() {
        sqlx::query(MARK_PUBLISHED)
            .bind(&settlement.published)
            .execute(&mut **tx)
            .await?;
    }
    for failed in &settlement.failed {
        sqlx::query(MARK_FAILED)
            .bind(failed.id)
            .bind(&failed.error)
            .bind(failed.retry_in.as_secs_f64())
            .bind(failed.dead)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

pub(super) async fn purge(pool: &PgPool, retention_secs: f64, batch: usize) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(PURGE)
        .bind(retention_secs)
        .bind(batch as i64)
        .execute(pool)
        .await?
        .rows_affected())
}

/// Seconds since the oldest published row was published, `None` when there is none.
pub(super) async fn oldest_published_age(pool: &PgPool) -> Result<Option<f64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - min(published_at))::float8
         FROM txinbox.outbox WHERE status = 'published'",
    )
    .fetch_one(pool)
    .await
}

pub(super) async fn backlog(pool: &PgPool) -> Result<(i64, f64), sqlx::Error> {
    sqlx::query_as(BACKLOG).fetch_one(pool).await
}

pub(super) async fn listen(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut l = PgListener::connect_with(pool).await?;
    l.listen(NOTIFY_CHANNEL).await?;
    Ok(l)
}

fn claimed(row: PgRow) -> Result<Claimed, sqlx::Error> {
    let names: Vec<String> = row.try_get("header_names")?;
    let values: Vec<Vec<u8>> = row.try_get("header_values")?;
    let mut headers = Headers::new();
    for (n, v) in names.into_iter().zip(values) {
        headers.insert(n, v);
    }
    let key: Option<Vec<u8>> = row.try_get("message_key")?;
    let payload: Vec<u8> = row.try_get("payload")?;
    Ok(Claimed {
        id: row.try_get("id")?,
        attempts: row.try_get("attempts")?,
        message: OutboxMessage {
            message_id: row.try_get("message_id")?,
            destination: row.try_get("destination")?,
            key: key.map(Bytes::from),
            payload: Bytes::from(payload),
            headers,
        },
    })
}
