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

use super::{on_db, Db, DbPool, Timestamp};

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
/// condition on `i`, an inbox row; see the [module docs](self).
fn purgeable(db: Db<'_>) -> String {
    format!(
        "i.consumer = $1 AND i.status <> 'retrying'
    AND i.processed_at < {}
    AND NOT EXISTS (SELECT 1 FROM {} p
                    WHERE p.consumer = i.consumer AND p.source = i.destination
                      AND p.lane = CAST(i.source_partition AS text) AND p.next_position <= i.source_offset)",
        db.at_ms("$2"),
        db.table("positions"),
    )
}

/// The guard on a purge window, shared by `txinbox purge` and the consumer's retention
/// ([`ConsumerBuilder::retention`](crate::ConsumerBuilder::retention)): a window shorter than
/// the dedup window ([`DEFAULT_WINDOW`]) is refused unless `force`d; a forced one, and one
/// shorter than `broker_retention` (what the broker keeps and can replay, when known), come back
/// as warnings to show. The error and the warnings say what to change.
pub fn check_window(
    window: Duration,
    force: bool,
    broker_retention: Option<Duration>,
) -> Result<Vec<String>, String> {
    let shown = show(window);
    let dedup_window = show(DEFAULT_WINDOW);
    let mut warnings = Vec::new();
    if window < DEFAULT_WINDOW {
        if !force {
            return Err(format!(
                "a retention window of {shown} is inside the dedup window ({dedup_window}): an ID purged this early no longer deduplicates, so a redelivery, replay or requeue of its message runs the handler again. Keep at least the broker's retention plus the longest redelivery horizon, or force it if re-applying such messages is acceptable"
            ));
        }
        warnings.push(format!(
            "{shown} is inside the dedup window ({dedup_window}): redeliveries of purged IDs are applied again"
        ));
    }
    if let Some(broker) = broker_retention.filter(|b| window < *b) {
        warnings.push(format!(
            "the retention window ({shown}) is shorter than the broker's retention ({}): a replay or a group reset can re-read messages whose inbox rows are gone, and they are applied again; keep the window at least the broker's retention",
            show(broker)
        ));
    }
    Ok(warnings)
}

/// A duration as `7d`, `36h`, `90min` or `45s`: the largest unit that divides it.
fn show(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => format!("{}ms", d.as_millis()),
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s % 60 == 0 => format!("{}min", s / 60),
        s => format!("{s}s"),
    }
}

/// The cutoff of a purge with `window`: the database's clock minus `window`.
pub async fn cutoff<'a>(db: impl Into<Db<'a>>, window: Duration) -> Result<Timestamp, sqlx::Error> {
    let db = db.into();
    let now = format!("SELECT {}", db.now_ms());
    let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
    let now: i64 = on_db!(db, pool => sqlx::query_scalar(sqlx::AssertSqlSafe(now)).fetch_one(pool).await?);
    Ok(Timestamp(now.saturating_sub(window_ms)))
}

/// Computes the cutoff (the database's clock minus `window`) and counts the rows it covers.
pub async fn plan<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    window: Duration,
) -> Result<PurgePlan, sqlx::Error> {
    let db = db.into();
    let cutoff = cutoff(db, window).await?;
    let count = format!(
        "SELECT count(*) FROM {} i WHERE {}",
        db.table("inbox"),
        purgeable(db)
    );
    on_db!(db, pool => {
        let candidates: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(count))
            .bind(consumer)
            .bind(cutoff.0)
            .fetch_one(pool)
            .await?;
        Ok(PurgePlan { cutoff, candidates })
    })
}

/// Whether a purge of `consumer` with `cutoff` would delete anything (stops at the first row).
async fn any_purgeable(db: Db<'_>, consumer: &str, cutoff: Timestamp) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {} i WHERE {})",
        db.table("inbox"),
        purgeable(db)
    );
    on_db!(db, pool => {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .bind(cutoff.0)
            .fetch_one(pool)
            .await
    })
}

/// Age of `consumer`'s oldest terminal inbox row, by `processed_at` (one lookup along
/// `inbox_processed_at_idx`); `None` when it has none.
pub async fn oldest_terminal_age<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
) -> Result<Option<Duration>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "SELECT {now} - {oldest} FROM {inbox} i
         WHERE i.consumer = $1 AND i.status <> 'retrying' AND i.processed_at IS NOT NULL
         ORDER BY i.processed_at LIMIT 1",
        now = db.now_ms(),
        oldest = db.ms("i.processed_at"),
        inbox = db.table("inbox"),
    );
    let age: Option<i64> = on_db!(db, pool => {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .fetch_optional(pool)
            .await?
    });
    Ok(age.map(|ms| Duration::from_millis(ms.max(0) as u64)))
}

/// The consumer's inbox as a [`Sweep`](crate::janitor::Sweep): each pass computes its cutoff
/// from the database's clock, records the horizon ([`record_horizon`]) and deletes with
/// [`delete_batch`], the same statements as `txinbox purge`, so the same rows are kept (see
/// the [module docs](self)). Its oldest-row clock is `processed_at`.
#[derive(Debug)]
pub struct InboxSweep {
    pool: DbPool,
    consumer: String,
    window: Duration,
    cutoff: std::sync::Mutex<Option<Timestamp>>,
}

impl InboxSweep {
    /// Purges `consumer`'s rows older than `window` in `pool`'s database. A window inside the
    /// dedup window is refused, with the error of [`check_window`]; [`forced`](Self::forced)
    /// takes it anyway.
    pub fn new(pool: DbPool, consumer: impl Into<String>, window: Duration) -> Result<Self, String> {
        check_window(window, false, None)?;
        Ok(Self::forced(pool, consumer, window))
    }

    /// As [`new`](Self::new), without the guard: a redelivery, replay or requeue of a message
    /// whose row this purged runs its handler again. For tests, and for an operator who has
    /// decided that is acceptable (the consumer's `Retention::force`).
    pub fn forced(pool: DbPool, consumer: impl Into<String>, window: Duration) -> Self {
        InboxSweep {
            pool,
            consumer: consumer.into(),
            window,
            cutoff: std::sync::Mutex::new(None),
        }
    }
}

#[async_trait::async_trait]
impl crate::janitor::Sweep for InboxSweep {
    async fn start_pass(&self) -> Result<(), sqlx::Error> {
        let db = self.pool.db();
        let cutoff = cutoff(db, self.window).await?;
        // As `txinbox purge`: the horizon moves only when something will be deleted. Moved on
        // every pass, it would refuse every `txinbox positions set/adopt` whose confirmation
        // spans a pass ("a purge moved the retention horizon while the plan was made").
        if !any_purgeable(db, &self.consumer, cutoff).await? {
            *self.cutoff.lock().unwrap() = None;
            return Ok(());
        }
        // The horizon first: a replay checked meanwhile already refuses the purged range.
        record_horizon(db, &self.consumer, cutoff).await?;
        *self.cutoff.lock().unwrap() = Some(cutoff);
        Ok(())
    }

    async fn delete_batch(&self, batch: u32) -> Result<u64, sqlx::Error> {
        let Some(cutoff) = *self.cutoff.lock().unwrap() else {
            return Ok(0);
        };
        delete_batch(self.pool.db(), &self.consumer, cutoff, i64::from(batch)).await
    }

    async fn oldest_age(&self) -> Result<Option<Duration>, sqlx::Error> {
        oldest_terminal_age(self.pool.db(), &self.consumer).await
    }
}

/// The transaction-scoped lock that orders a purge's horizon against a replay's positions
/// (PostgreSQL; on SQLite, the write transaction begun with `BEGIN IMMEDIATE` is that lock).
pub(crate) const HORIZON_LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('txinbox.retention/' || $1, 0))";

/// Records that `consumer`'s inbox may have lost rows that became terminal before `cutoff`
/// (never moves an existing horizon backwards). Call it before [`delete_batch`].
pub async fn record_horizon<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    cutoff: Timestamp,
) -> Result<(), sqlx::Error> {
    let db = db.into();
    let table = db.table("retention");
    let greatest = if db.is_sqlite() { "max" } else { "greatest" };
    let upsert = format!(
        "INSERT INTO {table} (consumer, purged_before)
         VALUES ($1, {at})
         ON CONFLICT (consumer) DO UPDATE
             SET purged_before = {greatest}({table}.purged_before, EXCLUDED.purged_before),
                 purged_at = {now}",
        at = db.at_ms("$2"),
        now = db.now(),
    );
    match db {
        Db::Postgres(pool) => {
            let mut tx = pool.begin().await?;
            sqlx::query(HORIZON_LOCK).bind(consumer).execute(&mut *tx).await?;
            sqlx::query(sqlx::AssertSqlSafe(upsert))
                .bind(consumer)
                .bind(cutoff.0)
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }
        #[cfg(feature = "sqlite")]
        Db::Sqlite(pool) => {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            sqlx::query(sqlx::AssertSqlSafe(upsert))
                .bind(consumer)
                .bind(cutoff.0)
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }
    }
}

/// Deletes up to `batch` rows of `consumer` that a purge with `cutoff` may delete (see the
/// [module docs](self)), in one statement. Returns how many were deleted; 0 means done.
pub async fn delete_batch<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    cutoff: Timestamp,
    batch: i64,
) -> Result<u64, sqlx::Error> {
    let db = db.into();
    let (inbox, cond) = (db.table("inbox"), purgeable(db));
    // The batch is picked oldest first along inbox_processed_at_idx. On PostgreSQL it is
    // deleted through the primary key as an array, not a join, so the cost follows the batch,
    // not the table; SQLite runs the IN subselect once. The outer WHERE re-checks the
    // condition: a row that changed since the subselect read it (e.g. reopened by a requeue)
    // is skipped.
    let pick = format!("SELECT i.message_id FROM {inbox} i WHERE {cond} ORDER BY i.processed_at LIMIT $3");
    let pick = if db.is_sqlite() {
        format!("IN ({pick})")
    } else {
        format!("= ANY(ARRAY({pick}))")
    };
    let sql = format!("DELETE FROM {inbox} AS i WHERE i.message_id {pick} AND {cond}");
    let count = format!(
        "UPDATE {} SET rows_purged = rows_purged + $2 WHERE consumer = $1",
        db.table("retention")
    );
    on_db!(db, pool => {
        let n = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .bind(cutoff.0)
            .bind(batch)
            .execute(pool)
            .await?
            .rows_affected();
        if n > 0 {
            sqlx::query(sqlx::AssertSqlSafe(count))
                .bind(consumer)
                .bind(n as i64)
                .execute(pool)
                .await?;
        }
        Ok(n)
    })
}

/// Reads the retention horizon of consumer `$1` in epoch milliseconds.
pub(crate) fn horizon_sql(db: Db<'_>) -> String {
    format!(
        "SELECT {} FROM {} WHERE consumer = $1",
        db.ms("purged_before"),
        db.table("retention")
    )
}

/// The retention horizon of `consumer`: see [`record_horizon`]. `None` if never purged.
pub async fn horizon<'a>(db: impl Into<Db<'a>>, consumer: &str) -> Result<Option<Timestamp>, sqlx::Error> {
    let db = db.into();
    let sql = horizon_sql(db);
    let h: Option<i64> = on_db!(db, pool => {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .fetch_optional(pool)
            .await?
    });
    Ok(h.map(Timestamp))
}

/// The consumers that have inbox rows.
pub async fn consumers<'a>(db: impl Into<Db<'a>>) -> Result<Vec<String>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "SELECT DISTINCT consumer FROM {} ORDER BY consumer",
        db.table("inbox")
    );
    on_db!(db, pool => sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_all(pool).await)
}
