//! Keeping the inbox bounded: deleting terminal rows older than a window, in small batches.
//!
//! # The window
//!
//! An inbox row is what makes a redelivery a duplicate. Once it is purged, a redelivery of
//! that message runs the handler again. So the window must be at least the longest time a
//! message can still be redelivered: the broker's retention (a replay or a consumer group
//! reset can re-read anything the broker still holds) plus the longest redelivery horizon
//! (retry backoff, dead-letter requeues, producers that resend). [`DEFAULT_WINDOW`] is 7 days,
//! Kafka's default `retention.ms`.
//!
//! # What is purged
//!
//! Rows whose status is terminal (`processed` or `dead_lettered`) and whose `processed_at`
//! (when they became terminal) is older than the cutoff. Never `retrying` rows: they hold a
//! message that has not finished. A purged `dead_lettered` row is like a purged `processed`
//! one: a redelivery would run the handler. The `dead_letters` table itself is not purged.
//!
//! # Concurrency
//!
//! Each batch is one short `DELETE` that re-checks status and age on the rows it deletes, so a
//! row a consumer is touching meanwhile (a duplicate being counted, a requeue reopening it)
//! is either left alone or deleted after that transaction ends; rows inside the window are
//! never candidates. The horizon is recorded *before* the first delete, so a replay checked
//! concurrently already sees it.

use std::time::Duration;

use sqlx::PgPool;

use super::{ms, Timestamp};

/// Default purge window: 7 days (Kafka's default topic retention).
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);

/// Default number of rows deleted per statement.
pub const DEFAULT_BATCH: i64 = 5_000;

/// What a purge of one consumer would delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PurgePlan {
    /// Terminal rows that became terminal before this are deleted.
    pub cutoff: Timestamp,
    /// How many rows qualify now.
    pub candidates: i64,
}

/// Computes the cutoff (the database's `now()` minus `window`) and counts the rows it covers.
pub async fn plan(pool: &PgPool, consumer: &str, window: Duration) -> Result<PurgePlan, sqlx::Error> {
    let (cutoff, candidates): (i64, i64) = sqlx::query_as(concat!(
        "WITH c AS (SELECT now() - make_interval(secs => $2::float8) AS cutoff)
         SELECT ",
        ms!("c.cutoff"),
        ", (SELECT count(*) FROM txinbox.inbox
             WHERE consumer = $1 AND status <> 'retrying' AND processed_at < c.cutoff)
         FROM c"
    ))
    .bind(consumer)
    .bind(window.as_secs_f64())
    .fetch_one(pool)
    .await?;
    Ok(PurgePlan {
        cutoff: Timestamp(cutoff),
        candidates,
    })
}

/// Records that `consumer`'s inbox may have lost rows that became terminal before `cutoff`
/// (never moves an existing horizon backwards). Call it before [`delete_batch`].
pub async fn record_horizon(pool: &PgPool, consumer: &str, cutoff: Timestamp) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO txinbox.retention (consumer, purged_before)
         VALUES ($1, to_timestamp($2::float8 / 1000))
         ON CONFLICT (consumer) DO UPDATE
             SET purged_before = greatest(txinbox.retention.purged_before, EXCLUDED.purged_before),
                 purged_at = now()",
    )
    .bind(consumer)
    .bind(cutoff.0 as f64)
    .execute(pool)
    .await?;
    Ok(())
}

/// Deletes up to `batch` terminal rows of `consumer` that became terminal before `cutoff`, in
/// one statement. Returns how many were deleted; 0 means done.
pub async fn delete_batch(
    pool: &PgPool,
    consumer: &str,
    cutoff: Timestamp,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    // The outer WHERE re-checks status and age: a row that changed since the subselect read it
    // (e.g. reopened by a requeue) is skipped.
    let done = sqlx::query(
        "DELETE FROM txinbox.inbox i
         USING (SELECT message_id FROM txinbox.inbox
                WHERE consumer = $1 AND status <> 'retrying'
                  AND processed_at < to_timestamp($2::float8 / 1000)
                LIMIT $3) old
         WHERE i.consumer = $1 AND i.message_id = old.message_id
           AND i.status <> 'retrying' AND i.processed_at < to_timestamp($2::float8 / 1000)",
    )
    .bind(consumer)
    .bind(cutoff.0 as f64)
    .bind(batch)
    .execute(pool)
    .await?;
    let n = done.rows_affected();
    if n > 0 {
        sqlx::query("UPDATE txinbox.retention SET rows_purged = rows_purged + $2 WHERE consumer = $1")
            .bind(consumer)
            .bind(n as i64)
            .execute(pool)
            .await?;
    }
    Ok(n)
}

/// The retention horizon of `consumer`: see [`record_horizon`]. `None` if never purged.
pub async fn horizon(pool: &PgPool, consumer: &str) -> Result<Option<Timestamp>, sqlx::Error> {
    let h: Option<i64> = sqlx::query_scalar(concat!(
        "SELECT ",
        ms!("purged_before"),
        " FROM txinbox.retention WHERE consumer = $1"
    ))
    .bind(consumer)
    .fetch_optional(pool)
    .await?;
    Ok(h.map(Timestamp))
}

/// The consumers that have inbox rows.
pub async fn consumers(pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT DISTINCT consumer FROM txinbox.inbox ORDER BY consumer")
        .fetch_all(pool)
        .await
}
