//! Stored positions against the broker's view: which group a consumer reads a source through,
//! what each partition's stored position says next to the group's committed offset and the
//! watermarks, and writing positions on purpose (adopting the group's offsets, setting them to
//! the earliest retained offset or to an offset, recording a new group).
//!
//! The database position is what a Kafka consumer starts an assigned partition from. When it
//! has none but the group has committed an offset (a database restored from a backup taken
//! before the partition was first processed, or a new database), the consumer does not guess:
//! it refuses the partition until an operator chooses, with `txinbox positions adopt` (the
//! group's offsets are done: e.g. moving an existing service onto txinbox) or `txinbox
//! positions set --to-earliest` (re-read everything the broker still holds; the inbox skips
//! what is already applied). This module holds the store side of those commands; nothing here
//! talks to a broker: the caller passes what the broker said.
//!
//! The group comes from `txinbox.subscriptions`, which a Kafka source fills when it is assigned
//! partitions ([`InboxStore::record_subscription`](crate::InboxStore::record_subscription)).
//! [`resolve_group`] is the one rule every tool applies to it.

use std::collections::BTreeMap;
use std::fmt;

use super::{on_db, Db, Timestamp};

/// The `source_system` under which a Kafka source records its subscription.
pub const KAFKA: &str = "kafka";

/// The subscription (Kafka: consumer group) recorded for `consumer` reading `source` of
/// `system`, if any.
pub async fn subscription<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    system: &str,
    source: &str,
) -> Result<Option<String>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "SELECT subscription FROM {}
         WHERE consumer = $1 AND source_system = $2 AND source = $3",
        db.table("subscriptions")
    );
    on_db!(db, pool => {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .bind(system)
            .bind(source)
            .fetch_optional(pool)
            .await
    })
}

/// The sources of `system` that `consumer` has a recorded subscription for, with it, by source.
pub async fn subscriptions<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    system: &str,
) -> Result<BTreeMap<String, String>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "SELECT source, subscription FROM {}
         WHERE consumer = $1 AND source_system = $2 ORDER BY source",
        db.table("subscriptions")
    );
    let rows: Vec<(String, String)> = on_db!(db, pool => {
        sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .bind(system)
            .fetch_all(pool)
            .await?
    });
    Ok(rows.into_iter().collect())
}

/// Records `subscription` for `consumer` reading `source` of `system` on purpose, replacing
/// whatever was recorded (`txinbox positions rebind`). Returns the subscription it replaced.
///
/// A running source that reads through the old group refuses to go on once it sees the new one
/// recorded: stop the consumers first, rebind, start them with the new group.
pub async fn rebind<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    system: &str,
    source: &str,
    subscription: &str,
) -> Result<Option<String>, sqlx::Error> {
    let db = db.into();
    let table = db.table("subscriptions");
    let lock = if db.is_sqlite() { "" } else { " FOR UPDATE" };
    let read = format!(
        "SELECT subscription FROM {table}
         WHERE consumer = $1 AND source_system = $2 AND source = $3{lock}"
    );
    let write = format!(
        "INSERT INTO {table} (consumer, source_system, source, subscription)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (consumer, source_system, source) DO UPDATE
             SET subscription = EXCLUDED.subscription, first_seen_at = {now}, last_seen_at = {now}",
        now = db.now()
    );
    // SQLite: BEGIN IMMEDIATE takes the write lock before the read, as FOR UPDATE does.
    on_db!(db, pool => {
        let mut tx = if db.is_sqlite() { pool.begin_with("BEGIN IMMEDIATE").await? } else { pool.begin().await? };
        let before: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(read))
            .bind(consumer)
            .bind(system)
            .bind(source)
            .fetch_optional(&mut *tx)
            .await?;
        sqlx::query(sqlx::AssertSqlSafe(write))
            .bind(consumer)
            .bind(system)
            .bind(source)
            .bind(subscription)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(before)
    })
}

/// Why no group could be settled on: see [`resolve_group`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupError {
    /// `--group` names another group than the one the consumer recorded.
    Disagrees {
        /// What the operator passed.
        given: String,
        /// What the consumer recorded.
        recorded: String,
    },
    /// Nothing recorded and nothing passed.
    Unknown,
}

impl GroupError {
    /// The error as an operator reads it, for `consumer` reading `topic`.
    pub fn explain(&self, consumer: &str, topic: &str) -> String {
        match self {
            GroupError::Disagrees { given, recorded } => format!(
                "--group {given} is not the group consumer {consumer} reads {topic} through: it recorded group {recorded} (txinbox.subscriptions). Pass --group {recorded} or leave it out; if the consumer really moved to {given}, record that first with `txinbox positions rebind --consumer {consumer} --topic {topic} --group {given}`"
            ),
            GroupError::Unknown => format!(
                "no Kafka group is recorded for consumer {consumer} on topic {topic} (txinbox.subscriptions is filled when a consumer is assigned partitions): pass --group with the group.id the consumer uses"
            ),
        }
    }
}

/// The group to use: the recorded one, which `given` (an operator's `--group`) must agree with;
/// `given` only when nothing is recorded. Never a guess such as the consumer name.
pub fn resolve_group(recorded: Option<&str>, given: Option<&str>) -> Result<String, GroupError> {
    match (recorded, given) {
        (Some(r), Some(g)) if r != g => Err(GroupError::Disagrees {
            given: g.to_owned(),
            recorded: r.to_owned(),
        }),
        (Some(r), _) => Ok(r.to_owned()),
        (None, Some(g)) => Ok(g.to_owned()),
        (None, None) => Err(GroupError::Unknown),
    }
}

/// What the database and the broker say about one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionView {
    /// Partition.
    pub partition: i32,
    /// The stored next offset (`txinbox.positions`), if any.
    pub database_position: Option<i64>,
    /// The group's committed offset, if any.
    pub group_offset: Option<i64>,
    /// The earliest offset the broker still holds.
    pub low: i64,
    /// The offset the next record will get.
    pub high: i64,
}

/// How a partition's stored position stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PositionStatus {
    /// Stored, within the watermarks, not behind the group.
    Ok,
    /// Stored and ahead of the group's committed offset (the group commit lags the database:
    /// normal while consuming).
    AheadOfGroup,
    /// Stored but behind the group's committed offset: the consumer re-reads the records in
    /// between (applied ones are skipped by the inbox). Expected after a database restore.
    BehindGroup,
    /// No stored position but a committed group offset: a Kafka consumer refuses the partition
    /// (`positions adopt` or `positions set --to-earliest` decide).
    MissingInDb,
    /// Neither: the consumer starts by `auto.offset.reset`.
    Unstarted,
    /// Stored below the low watermark: the records in between were deleted by the broker
    /// before the consumer processed them. A Kafka consumer holds the partition (by default:
    /// `RetentionGap::Refuse`) until another position is written.
    BelowLowWatermark,
    /// Stored beyond the high watermark (topic recreated or truncated?).
    BeyondHighWatermark,
}

impl PositionStatus {
    /// Stable name, for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            PositionStatus::Ok => "ok",
            PositionStatus::AheadOfGroup => "ahead-of-group",
            PositionStatus::BehindGroup => "behind-group",
            PositionStatus::MissingInDb => "missing-in-db",
            PositionStatus::Unstarted => "unstarted",
            PositionStatus::BelowLowWatermark => "below-low-watermark",
            PositionStatus::BeyondHighWatermark => "beyond-high-watermark",
        }
    }

    /// What it means for the operator, in a few words.
    pub fn meaning(self) -> &'static str {
        match self {
            PositionStatus::Ok => "resumes here",
            PositionStatus::AheadOfGroup => "resumes here; the group commit lags",
            PositionStatus::BehindGroup => {
                "resumes here and re-reads up to the group offset; the inbox skips what is applied"
            }
            PositionStatus::MissingInDb => {
                "would be refused: run `txinbox positions adopt` or `txinbox positions set --to-earliest`"
            }
            PositionStatus::Unstarted => {
                "starts at the group's offset 0 if it committed one, else by auto.offset.reset"
            }
            PositionStatus::BelowLowWatermark => {
                "would be held: records before the low watermark were deleted by the broker unprocessed; `txinbox positions set --to-earliest` accepts the gap"
            }
            PositionStatus::BeyondHighWatermark => "beyond the end of the partition",
        }
    }
}

impl PositionStatus {
    /// Whether a Kafka consumer holds such a partition with its default policies
    /// (`MissingPosition::Refuse`, `RetentionGap::Refuse`): assigned but paused, its database
    /// position never written by the consumer, until an operator writes one (which it picks up
    /// within seconds). Running members are therefore no reason to refuse writing it.
    pub fn held_by_consumer(self) -> bool {
        matches!(
            self,
            PositionStatus::MissingInDb | PositionStatus::BelowLowWatermark
        )
    }
}

impl fmt::Display for PositionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartitionView {
    /// How the stored position stands.
    pub fn status(&self) -> PositionStatus {
        match (self.database_position, self.group_offset) {
            // A group offset of 0 passed nothing: the consumer starts such a partition at
            // auto.offset.reset, it does not refuse it.
            (None, Some(g)) if g > 0 => PositionStatus::MissingInDb,
            (None, _) => PositionStatus::Unstarted,
            (Some(p), _) if p < self.low => PositionStatus::BelowLowWatermark,
            (Some(p), _) if p > self.high => PositionStatus::BeyondHighWatermark,
            (Some(p), Some(g)) if p < g => PositionStatus::BehindGroup,
            (Some(p), Some(g)) if p > g => PositionStatus::AheadOfGroup,
            (Some(_), _) => PositionStatus::Ok,
        }
    }
}

/// One stored position to write: `partition` from `from` (what the plan saw; `None`: no row)
/// to `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// Partition.
    pub partition: i32,
    /// The stored position the plan saw.
    pub from: Option<i64>,
    /// The position to store.
    pub to: i64,
}

/// A partition a plan leaves alone, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skip {
    /// Partition.
    pub partition: i32,
    /// Why.
    pub reason: String,
}

/// What `positions adopt` would write: the group's committed offset as the stored position of
/// every partition of `views` that has none (every one that has a group offset, with
/// `overwrite`). Partitions without a group offset, or whose position already equals it, are
/// skipped with a reason.
pub fn adopt_plan(views: &[PartitionView], overwrite: bool) -> (Vec<Change>, Vec<Skip>) {
    let mut changes = Vec::new();
    let mut skips = Vec::new();
    for v in views {
        let skip = |reason: String| Skip {
            partition: v.partition,
            reason,
        };
        match (v.database_position, v.group_offset) {
            (_, None) => skips.push(skip("the group has no committed offset".into())),
            (Some(p), Some(g)) if p == g => {
                skips.push(skip(format!("already stored at the group offset {g}")))
            }
            (Some(p), Some(_)) if !overwrite => skips.push(skip(format!(
                "already has a database position ({p}); --force overwrites it"
            ))),
            (from, Some(g)) => changes.push(Change {
                partition: v.partition,
                from,
                to: g,
            }),
        }
    }
    (changes, skips)
}

/// What `positions set` would write: `target(view)` for every partition of `views` whose
/// stored position differs from it.
pub fn set_plan(views: &[PartitionView], target: impl Fn(&PartitionView) -> i64) -> (Vec<Change>, Vec<Skip>) {
    let mut changes = Vec::new();
    let mut skips = Vec::new();
    for v in views {
        let to = target(v);
        if v.database_position == Some(to) {
            skips.push(Skip {
                partition: v.partition,
                reason: format!("already stored at {to}"),
            });
        } else {
            changes.push(Change {
                partition: v.partition,
                from: v.database_position,
                to,
            });
        }
    }
    (changes, skips)
}

/// How [`apply`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Every change written, in one transaction.
    Done,
    /// Nothing written: a purge moved the retention horizon since the caller checked it.
    HorizonMoved,
    /// Nothing written: the stored position of `partition` is no longer what the plan saw (a
    /// consumer or another operator wrote it meanwhile); plan again.
    Changed {
        /// The partition that changed.
        partition: i32,
        /// What is stored now.
        now: Option<i64>,
    },
}

/// Writes `changes` to `consumer`'s positions in `source` in one transaction, each only if the
/// stored position is still its [`Change::from`], and only if the retention horizon is still
/// `checked_horizon` (read under the lock a purge takes to record it, as
/// [`set_positions`](super::replay::set_positions) does). Anything else writes nothing.
pub async fn apply<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    source: &str,
    changes: &[Change],
    checked_horizon: Option<Timestamp>,
) -> Result<Applied, sqlx::Error> {
    let db = db.into();
    let positions = db.table("positions");
    let horizon_sql = super::retention::horizon_sql(db);
    let insert = format!(
        "INSERT INTO {positions} (consumer, source, lane, next_position)
         VALUES ($1, $2, $3, $4) ON CONFLICT (consumer, source, lane) DO NOTHING"
    );
    let update = format!(
        "UPDATE {positions} SET next_position = $4, updated_at = {}
         WHERE consumer = $1 AND source = $2 AND lane = $3 AND next_position = $5",
        db.now()
    );
    let read =
        format!("SELECT next_position FROM {positions} WHERE consumer = $1 AND source = $2 AND lane = $3");
    on_db!(db, pool => {
        // The horizon is read under the lock a purge takes to record it: PostgreSQL's advisory
        // lock, SQLite's write lock (BEGIN IMMEDIATE).
        let mut tx = if db.is_sqlite() { pool.begin_with("BEGIN IMMEDIATE").await? } else { pool.begin().await? };
        if !db.is_sqlite() {
            sqlx::query(super::retention::HORIZON_LOCK)
                .bind(consumer)
                .execute(&mut *tx)
                .await?;
        }
        let horizon: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(horizon_sql))
            .bind(consumer)
            .fetch_optional(&mut *tx)
            .await?;
        if horizon.map(Timestamp) != checked_horizon {
            tx.rollback().await?;
            return Ok(Applied::HorizonMoved);
        }
        for c in changes {
            let lane = c.partition.to_string();
            let written = match c.from {
                None => sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
                    .bind(consumer)
                    .bind(source)
                    .bind(&lane)
                    .bind(c.to)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected(),
                Some(from) => sqlx::query(sqlx::AssertSqlSafe(update.clone()))
                    .bind(consumer)
                    .bind(source)
                    .bind(&lane)
                    .bind(c.to)
                    .bind(from)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected(),
            };
            if written != 1 {
                let now: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(read))
                    .bind(consumer)
                    .bind(source)
                    .bind(&lane)
                    .fetch_optional(&mut *tx)
                    .await?;
                tx.rollback().await?;
                return Ok(Applied::Changed {
                    partition: c.partition,
                    now,
                });
            }
        }
        tx.commit().await?;
        Ok(Applied::Done)
    })
}

/// `consumer`'s stored positions in `source`, by partition (lanes that are not partition
/// numbers are left out).
pub async fn stored<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    source: &str,
) -> Result<BTreeMap<i32, i64>, sqlx::Error> {
    Ok(super::status::positions(db, Some(consumer), Some(source))
        .await?
        .into_iter()
        .filter_map(|p| Some((p.lane.parse().ok()?, p.next_position)))
        .collect())
}
