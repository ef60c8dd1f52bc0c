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
//! message that has not finished. Never a row of a Kafka record at or after the consumer's
//! stored position in its partition: a (re)starting consumer reads that record again and needs
//! the row to recognise it. Such rows are every row a replay moved the position back over, and
//! a dead letter whose copy the broker has not confirmed yet: recording a dead letter does not
//! move the position ([`InboxStore::dead_letter`]); the runtime moves it past the record, in a
//! transaction of its own, once the broker confirmed the dead-letter copy. A purged
//! `dead_lettered` row is like a purged `processed` one: a redelivery would run the handler.
//! The `dead_letters` table itself is not purged.
//!
//! The window is the **dedup window**: `txinbox purge` refuses one shorter than
//! [`DEFAULT_WINDOW`] unless forced.
//!
//! [`InboxStore::dead_letter`]: crate::InboxStore::dead_letter
//!
//! # Concurrency
//!
//! Each batch is one short `DELETE` that re-checks status and age on the rows it deletes, so a
//! row a consumer is touching meanwhile (a duplicate being counted, a requeue reopening it)
//! is either left alone or deleted after that transaction ends; rows inside the window are
//! never candidates. The horizon is recorded *before* the first delete, under a lock that
//! [`set_positions`](super::replay::set_positions) also takes: a replay either moves its
//! positions first (and the deletes, which skip rows at or after a stored position, leave its
//! range alone) or sees the new horizon and refuses.

use std::time::Duration;

use sqlx::PgPool;

use super::{ms, Timestamp};

/// Default purge window and the documented dedup window: 7 days (Kafka's default topic
/// retention). `txinbox purge` refuses a shorter one unless `--force`.
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

/// Which rows of consumer `$1` a purge with cutoff `$2` (epoch milliseconds) may delete, as a
/// condition on `i`, a `txinbox.inbox` row; see the [module docs](self).
const PURGEABLE: &str = "i.consumer = $1 AND i.status <> 'retrying'
    AND i.processed_at < to_timestamp($2::float8 / 1000)
    AND NOT EXISTS (SELECT 1 FROM txinbox.positions p
                    WHERE p.consumer = i.consumer AND p.source = i.destination
                      AND p.lane = i.source_partition::text AND p.next_position <= i.source_offset)";

/// Computes the cutoff (the database's `now()` minus `window`) and counts the rows it covers.
pub async fn plan(pool: &PgPool, consumer: &str, window: Duration) -> Result<PurgePlan, sqlx::Error> {
    let cutoff: i64 = sqlx::query_scalar(concat!(
        "SELECT ",
        ms!("now() - make_interval(secs => $1::float8)")
    ))
    .bind(window.as_secs_f64())
    .fetch_one(pool)
    .await?;
    let sql = format!("SELECT count(*) FROM txinbox.inbox i WHERE {PURGEABLE}");
    let candidates: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(consumer)
        .bind(cutoff as f64)
        .fetch_one(pool)
        .await?;
    Ok(PurgePlan {
        cutoff: Timestamp(cutoff),
        candidates,
    })
}

/// The transaction-scoped lock that orders a purge's horizon against a replay's positions.
pub(crate) const HORIZON_LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('txinbox.retention/' || $1, 0))";

/// Records that `consumer`'s inbox may have lost rows that became terminal before `cutoff`
/// (never moves an existing horizon backwards). Call it before [`delete_batch`].
pub async fn record_horizon(pool: &PgPool, consumer: &str, cutoff: Timestamp) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(HORIZON_LOCK).bind(consumer).execute(&mut *tx).await?;
    sqlx::query(
        "INSERT INTO txinbox.retention (consumer, purged_before)
         VALUES ($1, to_timestamp($2::float8 / 1000))
         ON CONFLICT (consumer) DO UPDATE
             SET purged_before = greatest(txinbox.retention.purged_before, EXCLUDED.purged_before),
                 purged_at = now()",
    )
    .bind(consumer)
    .bind(cutoff.0 as f64)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Deletes up to `batch` rows of `consumer` that a purge with `cutoff` may delete (see the
/// [module docs](self)), in one statement. Returns how many were deleted; 0 means done.
pub async fn delete_batch(
    pool: &PgPool,
    consumer: &str,
    cutoff: Timestamp,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    // The batch is picked oldest first along inbox_processed_at_idx and deleted through the
    // primary key (an array, not a join, so the cost follows the batch, not the table). The
    // outer WHERE re-checks the condition: a row that changed since the subselect read it
    // (e.g. reopened by a requeue) is skipped.
    let sql = format!(
        "DELETE FROM txinbox.inbox i
         WHERE i.message_id = ANY(ARRAY(
                   SELECT i.message_id FROM txinbox.inbox i WHERE {PURGEABLE}
                   ORDER BY i.processed_at LIMIT $3))
           AND {PURGEABLE}"
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql))
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

/// Reads the retention horizon of consumer `$1` in epoch milliseconds.
pub(crate) const HORIZON: &str = concat!(
    "SELECT ",
    ms!("purged_before"),
    " FROM txinbox.retention WHERE consumer = $1"
);

/// The retention horizon of `consumer`: see [`record_horizon`]. `None` if never purged.
pub async fn horizon(pool: &PgPool, consumer: &str) -> Result<Option<Timestamp>, sqlx::Error> {
    let h: Option<i64> = sqlx::query_scalar(HORIZON)
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
