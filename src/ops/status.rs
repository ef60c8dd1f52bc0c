//! What the inbox holds, per consumer, and where each consumer resumes.

use super::{on_db, Db, Timestamp};

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

/// The counters per consumer, one query text for both stores (grouped aggregates joined to
/// the names, rather than PostgreSQL's LATERAL, which SQLite lacks).
fn summary_sql(db: Db<'_>) -> String {
    let (inbox, dead, positions, retention, subscriptions) = (
        db.table("inbox"),
        db.table("dead_letters"),
        db.table("positions"),
        db.table("retention"),
        db.table("subscriptions"),
    );
    let oldest = db.ms("min(first_seen_at)");
    let horizon = db.ms("r.purged_before");
    format!(
        "WITH names AS (
            SELECT DISTINCT consumer FROM {inbox}
            UNION SELECT consumer FROM {dead}
            UNION SELECT consumer FROM {positions}
            UNION SELECT consumer FROM {retention}
            UNION SELECT consumer FROM {subscriptions})
        SELECT n.consumer,
            coalesce(i.processed, 0), coalesce(i.retrying, 0), coalesce(i.dead_lettered, 0),
            coalesce(i.duplicates, 0), coalesce(d.conflicts, 0), coalesce(d.total, 0),
            coalesce(d.pending, 0), i.oldest, {horizon}
        FROM names n
        LEFT JOIN (
            SELECT consumer,
                   count(*) FILTER (WHERE status = 'processed') AS processed,
                   count(*) FILTER (WHERE status = 'retrying') AS retrying,
                   count(*) FILTER (WHERE status = 'dead_lettered') AS dead_lettered,
                   CAST(sum(duplicates) AS bigint) AS duplicates,
                   {oldest} AS oldest
            FROM {inbox} GROUP BY consumer) i ON i.consumer = n.consumer
        LEFT JOIN (
            SELECT consumer, count(*) AS total,
                   count(*) FILTER (WHERE reason = 'conflict') AS conflicts,
                   count(*) FILTER (WHERE requeued_at IS NULL AND discarded_at IS NULL) AS pending
            FROM {dead} GROUP BY consumer) d ON d.consumer = n.consumer
        LEFT JOIN {retention} r ON r.consumer = n.consumer
        WHERE CAST($1 AS text) IS NULL OR n.consumer = $1
        ORDER BY n.consumer"
    )
}

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
pub async fn consumers<'a>(
    db: impl Into<Db<'a>>,
    consumer: Option<&str>,
) -> Result<Vec<ConsumerSummary>, sqlx::Error> {
    let db = db.into();
    let sql = summary_sql(db);
    let rows: Vec<SummaryRow> = on_db!(db, pool => {
        sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(consumer).fetch_all(pool).await?
    });
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
pub async fn positions<'a>(
    db: impl Into<Db<'a>>,
    consumer: Option<&str>,
    source: Option<&str>,
) -> Result<Vec<StoredPosition>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "SELECT consumer, source, lane, next_position, {} FROM {}
         WHERE (CAST($1 AS text) IS NULL OR consumer = $1) AND (CAST($2 AS text) IS NULL OR source = $2)
         ORDER BY consumer, source, length(lane), lane",
        db.ms("updated_at"),
        db.table("positions"),
    );
    let rows: Vec<(String, String, String, i64, i64)> = on_db!(db, pool => {
        sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .bind(source)
            .fetch_all(pool)
            .await?
    });
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
