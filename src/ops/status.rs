//! What the inbox holds, per consumer, and where each consumer resumes.

use sqlx::PgPool;

use super::{ms, Timestamp};

/// Counters of one consumer's inbox and dead letters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerSummary {
    /// Consumer name.
    pub consumer: String,
    /// Inbox rows with status `processed` (still retained).
    pub processed: i64,
    /// Inbox rows with status `retrying`.
    pub retrying: i64,
    /// Inbox rows with status `dead_lettered`.
    pub dead_lettered: i64,
    /// Duplicate deliveries absorbed by the retained rows.
    pub duplicates: i64,
    /// Dead letters with reason `conflict` (same ID, other payload).
    pub conflicts: i64,
    /// All dead letters recorded.
    pub dead_letters: i64,
    /// Dead letters neither requeued nor discarded.
    pub dead_letters_pending: i64,
    /// When the oldest retained inbox row was first seen.
    pub oldest_retained: Option<Timestamp>,
    /// What `purge` deleted up to: messages that became terminal before it may be re-applied
    /// if redelivered. `None` when never purged.
    pub retention_horizon: Option<Timestamp>,
}

const SUMMARY: &str = concat!(
    "WITH names AS (
        SELECT DISTINCT consumer FROM txinbox.inbox
        UNION SELECT consumer FROM txinbox.dead_letters
        UNION SELECT consumer FROM txinbox.positions
        UNION SELECT consumer FROM txinbox.retention
        UNION SELECT consumer FROM txinbox.subscriptions)
    SELECT n.consumer,
        coalesce(i.processed, 0), coalesce(i.retrying, 0), coalesce(i.dead_lettered, 0),
        coalesce(i.duplicates, 0), coalesce(d.conflicts, 0), coalesce(d.total, 0),
        coalesce(d.pending, 0), i.oldest, r.horizon
    FROM names n
    LEFT JOIN LATERAL (
        SELECT count(*) FILTER (WHERE status = 'processed') AS processed,
               count(*) FILTER (WHERE status = 'retrying') AS retrying,
               count(*) FILTER (WHERE status = 'dead_lettered') AS dead_lettered,
               sum(duplicates)::bigint AS duplicates,
               ",
    ms!("min(first_seen_at)"),
    " AS oldest
        FROM txinbox.inbox WHERE consumer = n.consumer) i ON true
    LEFT JOIN LATERAL (
        SELECT count(*) AS total,
               count(*) FILTER (WHERE reason = 'conflict') AS conflicts,
               count(*) FILTER (WHERE requeued_at IS NULL AND discarded_at IS NULL) AS pending
        FROM txinbox.dead_letters WHERE consumer = n.consumer) d ON true
    LEFT JOIN LATERAL (
        SELECT ",
    ms!("purged_before"),
    " AS horizon FROM txinbox.retention WHERE consumer = n.consumer) r ON true
    WHERE $1::text IS NULL OR n.consumer = $1
    ORDER BY n.consumer"
);

type SummaryRow = (
    String,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
);

/// Counters for every consumer the database knows (or only `consumer`), by name.
pub async fn consumers(pool: &PgPool, consumer: Option<&str>) -> Result<Vec<ConsumerSummary>, sqlx::Error> {
    let rows: Vec<SummaryRow> = sqlx::query_as(SUMMARY).bind(consumer).fetch_all(pool).await?;
    Ok(rows
        .into_iter()
        .map(|r| ConsumerSummary {
            consumer: r.0,
            processed: r.1,
            retrying: r.2,
            dead_lettered: r.3,
            duplicates: r.4,
            conflicts: r.5,
            dead_letters: r.6,
            dead_letters_pending: r.7,
            oldest_retained: r.8.map(Timestamp),
            retention_horizon: r.9.map(Timestamp),
        })
        .collect())
}

/// A consumer's stored next position in one lane of one source (Kafka: topic, partition).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPosition {
    /// Consumer name.
    pub consumer: String,
    /// Source (Kafka: topic).
    pub source: String,
    /// Lane (Kafka: partition number as text).
    pub lane: String,
    /// The next position the consumer starts from (Kafka: offset).
    pub next_position: i64,
    /// When it was last written.
    pub updated_at: Timestamp,
}

/// Stored positions, optionally of one consumer and one source, ordered by consumer, source
/// and lane (numerically where lanes are numbers).
pub async fn positions(
    pool: &PgPool,
    consumer: Option<&str>,
    source: Option<&str>,
) -> Result<Vec<StoredPosition>, sqlx::Error> {
    let rows: Vec<(String, String, String, i64, i64)> = sqlx::query_as(concat!(
        "SELECT consumer, source, lane, next_position, ",
        ms!("updated_at"),
        " FROM txinbox.positions
         WHERE ($1::text IS NULL OR consumer = $1) AND ($2::text IS NULL OR source = $2)
         ORDER BY consumer, source, length(lane), lane"
    ))
    .bind(consumer)
    .bind(source)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| StoredPosition {
            consumer: r.0,
            source: r.1,
            lane: r.2,
            next_position: r.3,
            updated_at: Timestamp(r.4),
        })
        .collect())
}
