//! The outbox on SQLite (`txinbox_outbox`): the insert behind [`write`](super::write) and the
//! relay's statements.
//!
//! SQLite has one writer. Holding it while a broker confirms would stop every other writer (the
//! application's own transactions) for up to the publish timeout, so a round works in three
//! steps: a short `BEGIN IMMEDIATE` transaction claims due rows by setting `leased_until` and a
//! random `lease_token`; the rows are published with no lock held; a second short transaction
//! marks the rows that still carry the token and clears the lease. A row whose lease ran out
//! (its relay died or stalled) is claimed again, as PostgreSQL's row locks are released when a
//! relay's connection dies; the stalled relay's late marks then change nothing.

use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{Row, Sqlite, SqliteConnection};

use super::relay::{Claimed, Settlement};
use super::{sealed, OutboxDatabase, OutboxMessage};
use crate::message::Headers;

impl OutboxDatabase for Sqlite {}

/// See PostgreSQL's INSERT: the identical message again returns no row; a row holding the ID
/// with another destination, key or payload is touched (a no-op update) so that it is returned.
const INSERT: &str = "\
INSERT INTO txinbox_outbox (message_id, destination, message_key, payload, headers)
VALUES (?1, ?2, ?3, ?4, ?5)
ON CONFLICT (message_id) DO UPDATE SET message_id = excluded.message_id
    WHERE txinbox_outbox.destination <> excluded.destination
       OR txinbox_outbox.message_key IS NOT excluded.message_key
       OR txinbox_outbox.payload <> excluded.payload
RETURNING destination = ?2, message_key IS ?3, payload = ?4";

impl sealed::Sealed for Sqlite {
    fn insert<'e, 'c: 'e, E>(
        executor: E,
        message: &'e OutboxMessage,
        headers: &'e Headers,
    ) -> BoxFuture<'e, Result<Option<sealed::Differs>, sqlx::Error>>
    where
        E: sqlx::Executor<'c, Database = Self> + 'e,
    {
        Box::pin(
            sqlx::query_as(INSERT)
                .bind(&message.message_id)
                .bind(&message.destination)
                .bind(message.key.as_deref())
                .bind(message.payload.as_ref())
                .bind(crate::store::headers_json(headers).to_string())
                .fetch_optional(executor),
        )
    }
}

/// The current time in Unix milliseconds, as the migration's defaults take it.
macro_rules! now_ms {
    () => {
        "CAST(unixepoch('subsec') * 1000 AS INTEGER)"
    };
}

/// Whether any row could be claimed: read without the write lock, so an idle relay's polls never
/// take it (the application's writers wait for nobody).
const ANY_DUE: &str = concat!(
    "SELECT EXISTS (SELECT 1 FROM txinbox_outbox
     WHERE status = 'pending' AND next_attempt_at <= ",
    now_ms!(),
    " AND (leased_until IS NULL OR leased_until <= ",
    now_ms!(),
    "))"
);

/// Due heads of their keys (or rows without a key) that no live lease holds. A leased head
/// stays `pending`, so it is still the head of its key: no other relay takes a later row of it.
/// A key with a live lease on any of its pending rows is skipped altogether: a row put back
/// before rows another relay is publishing (a dead letter set to `pending` again) waits until
/// that relay is done, instead of being published alongside them.
const CLAIM_HEADS: &str = concat!(
    "SELECT o.id, o.attempts, o.message_id, o.destination, o.message_key, o.payload, o.headers
     FROM txinbox_outbox o
     WHERE o.status = 'pending' AND o.next_attempt_at <= ",
    now_ms!(),
    "
       AND (o.leased_until IS NULL OR o.leased_until <= ",
    now_ms!(),
    ")
       AND (o.message_key IS NULL OR NOT EXISTS (
             SELECT 1 FROM txinbox_outbox p
             WHERE p.status = 'pending' AND p.destination = o.destination
               AND p.message_key = o.message_key
               AND (p.id < o.id OR p.leased_until > ",
    now_ms!(),
    ")))
     ORDER BY o.id
     LIMIT ?1"
);

/// The later pending rows of one claimed head's key (none of them leased: see CLAIM_HEADS).
const CLAIM_FOLLOWERS: &str = "\
SELECT id, attempts, message_id, destination, message_key, payload, headers
FROM txinbox_outbox
WHERE status = 'pending' AND destination = ?1 AND message_key = ?2 AND id > ?3
ORDER BY id
LIMIT ?4";

const LEASE: &str = concat!(
    "UPDATE txinbox_outbox SET leased_until = ",
    now_ms!(),
    " + ?2, lease_token = ?3
     WHERE id IN (SELECT value FROM json_each(?1))"
);

// The marks touch only rows this claim still holds (same token, still pending): a relay that
// outlived its lease, whose rows another relay has claimed since, changes nothing.
const MARK_PUBLISHED: &str = concat!(
    "UPDATE txinbox_outbox
     SET status = 'published', published_at = ",
    now_ms!(),
    ", attempts = attempts + 1,
         last_error = NULL, leased_until = NULL, lease_token = NULL
     WHERE id IN (SELECT value FROM json_each(?1)) AND lease_token = ?2 AND status = 'pending'"
);

const MARK_FAILED: &str = concat!(
    "UPDATE txinbox_outbox
     SET attempts = attempts + 1, last_error = ?2, next_attempt_at = ",
    now_ms!(),
    " + ?3,
         status = CASE WHEN ?4 THEN 'dead_lettered' ELSE 'pending' END,
         leased_until = NULL, lease_token = NULL
     WHERE id = ?1 AND lease_token = ?5 AND status = 'pending'"
);

const RELEASE: &str = "\
UPDATE txinbox_outbox SET leased_until = NULL, lease_token = NULL
WHERE id IN (SELECT value FROM json_each(?1)) AND lease_token = ?2 AND status = 'pending'";

const PURGE: &str = concat!(
    "DELETE FROM txinbox_outbox WHERE id IN (
         SELECT id FROM txinbox_outbox
         WHERE status = 'published' AND published_at < ",
    now_ms!(),
    " - ?1
         ORDER BY published_at
         LIMIT ?2)"
);

const BACKLOG: &str = concat!(
    "SELECT count(*), coalesce((",
    now_ms!(),
    " - min(created_at)) / 1000.0, 0.0)
     FROM txinbox_outbox WHERE status = 'pending'"
);

/// A duration as SQLite milliseconds, capped (a century) so that `now + d` cannot overflow.
fn millis(d: Duration) -> i64 {
    const CENTURY_MS: u128 = 100 * 365 * 24 * 3600 * 1000;
    d.as_millis().min(CENTURY_MS) as i64
}

async fn begin(pool: &SqlitePool) -> Result<sqlx::Transaction<'static, Sqlite>, sqlx::Error> {
    pool.begin_with("BEGIN IMMEDIATE").await
}

/// One claim's rows: only marks carrying its token change them.
pub(super) type LeaseToken = i64;

/// Claims up to `limit` due rows for `lease_for`: the heads of their keys, then the later rows of
/// the claimed keys, in one write transaction (taken only when a read found a due row). Sorted
/// by ID.
pub(super) async fn claim(
    pool: &SqlitePool,
    limit: usize,
    lease_for: Duration,
) -> Result<(Vec<Claimed>, LeaseToken), sqlx::Error> {
    let token = fastrand::i64(..);
    let due: bool = sqlx::query_scalar(ANY_DUE).fetch_one(pool).await?;
    if !due {
        return Ok((Vec::new(), token));
    }
    let mut tx = begin(pool).await?;
    let mut rows = sqlx::query(CLAIM_HEADS)
        .bind(limit as i64)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(claimed)
        .collect::<Result<Vec<_>, _>>()?;
    if rows.is_empty() {
        tx.commit().await?;
        return Ok((rows, token));
    }
    let heads: Vec<(String, Bytes, i64)> = rows
        .iter()
        .filter_map(|r| Some((r.message.destination.clone(), r.message.key.clone()?, r.id)))
        .collect();
    for (destination, key, head) in heads {
        let room = limit.saturating_sub(rows.len());
        if room == 0 {
            break;
        }
        let followers = sqlx::query(CLAIM_FOLLOWERS)
            .bind(destination)
            .bind(key.as_ref())
            .bind(head)
            .bind(room as i64)
            .fetch_all(&mut *tx)
            .await?;
        for row in followers {
            rows.push(claimed(row)?);
        }
    }
    rows.sort_by_key(|r| r.id);
    sqlx::query(LEASE)
        .bind(json_ids(rows.iter().map(|r| r.id)))
        .bind(millis(lease_for))
        .bind(token)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok((rows, token))
}

/// Marks the round's rows and clears their leases, in one write transaction. The broker has
/// confirmed the published rows, so a busy database (another writer holding the lock past the
/// busy timeout, every connection in use) does not make it give up while the claim lasts: it
/// tries again, with backoff, until `until`. Repeating is harmless: a mark applies once, to
/// rows that still carry `token`.
pub(super) async fn settle(
    pool: &SqlitePool,
    settlement: &Settlement,
    token: LeaseToken,
    until: tokio::time::Instant,
) -> Result<(), sqlx::Error> {
    let mut pause = Duration::from_millis(50);
    loop {
        let result = async {
            let mut tx = begin(pool).await?;
            let marked = mark(&mut tx, settlement, token).await?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>(marked)
        }
        .await;
        match result {
            Ok(marked) => {
                let claimed =
                    settlement.published.len() + settlement.failed.len() + settlement.released.len();
                if (marked as usize) < claimed {
                    tracing::warn!(
                        marked,
                        claimed,
                        "outbox rows were claimed by another relay after this round's lease ran out; \
                         they may be published twice (the downstream inbox drops the copy)"
                    );
                }
                return Ok(());
            }
            Err(e) if worth_waiting_out(&e) && tokio::time::Instant::now() + pause < until => {
                tracing::debug!(error = %e, "marking outbox rows: the database is busy or unavailable; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e),
        }
    }
}

/// SQLite's lock held past the busy timeout ([`is_lock_conflict`](crate::store::is_lock_conflict)),
/// or the database unavailable ([`is_unavailable`](crate::store::is_unavailable): no connection
/// within the acquire timeout, an I/O error, a file that cannot be opened): worth waiting out
/// while the lease lasts, rather than publishing the round's rows again after it.
fn worth_waiting_out(e: &sqlx::Error) -> bool {
    crate::store::is_lock_conflict(e) || crate::store::is_unavailable(e)
}

/// Applies the marks; returns how many rows they changed.
async fn mark(
    conn: &mut SqliteConnection,
    settlement: &Settlement,
    token: LeaseToken,
) -> Result<u64, sqlx::Error> {
    let mut marked = 0;
    if !settlement.published.is_empty() {
        marked += sqlx::query(MARK_PUBLISHED)
            .bind(json_ids(settlement.published.iter().copied()))
            .bind(token)
            .execute(&mut *conn)
            .await?
            .rows_affected();
    }
    for f in &settlement.failed {
        marked += sqlx::query(MARK_FAILED)
            .bind(f.id)
            .bind(&f.error)
            .bind(millis(f.retry_in))
            .bind(f.dead)
            .bind(token)
            .execute(&mut *conn)
            .await?
            .rows_affected();
    }
    if !settlement.released.is_empty() {
        marked += sqlx::query(RELEASE)
            .bind(json_ids(settlement.released.iter().copied()))
            .bind(token)
            .execute(&mut *conn)
            .await?
            .rows_affected();
    }
    Ok(marked)
}

pub(super) async fn purge_published(
    pool: &SqlitePool,
    retention: Duration,
    batch: usize,
) -> Result<u64, sqlx::Error> {
    Ok(sqlx::query(PURGE)
        .bind(millis(retention))
        .bind(batch as i64)
        .execute(pool)
        .await?
        .rows_affected())
}

/// Seconds since the oldest published row was published, `None` when there is none.
pub(super) async fn oldest_published_age(pool: &SqlitePool) -> Result<Option<f64>, sqlx::Error> {
    sqlx::query_scalar(concat!(
        "SELECT (",
        now_ms!(),
        " - min(published_at)) / 1000.0 FROM txinbox_outbox WHERE status = 'published'"
    ))
    .fetch_one(pool)
    .await
}

pub(super) async fn backlog(pool: &SqlitePool) -> Result<(i64, f64), sqlx::Error> {
    sqlx::query_as(BACKLOG).fetch_one(pool).await
}

fn json_ids(ids: impl Iterator<Item = i64>) -> String {
    let ids: Vec<String> = ids.map(|id| id.to_string()).collect();
    format!("[{}]", ids.join(","))
}

fn claimed(row: SqliteRow) -> Result<Claimed, sqlx::Error> {
    let key: Option<Vec<u8>> = row.try_get("message_key")?;
    let payload: Vec<u8> = row.try_get("payload")?;
    let headers: String = row.try_get("headers")?;
    let headers = serde_json::from_str(&headers).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    Ok(Claimed {
        id: row.try_get("id")?,
        attempts: row.try_get("attempts")?,
        message: OutboxMessage {
            message_id: row.try_get("message_id")?,
            destination: row.try_get("destination")?,
            key: key.map(Bytes::from),
            payload: Bytes::from(payload),
            headers: crate::store::headers_from_json(&headers),
        },
    })
}
