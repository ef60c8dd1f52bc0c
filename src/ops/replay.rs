//! Replay support: what the inbox says about a range of messages, and moving the stored
//! positions a restarting consumer starts from.
//!
//! Replay never re-applies an applied message because the consumer's inbox deduplicates every
//! replayed delivery; this module only predicts (for a dry run) what the consumer will do, with
//! the consumer's own [`IdStrategy`](crate::IdStrategy) and [`Fingerprint`](crate::message::Fingerprint).

use std::collections::HashMap;

use super::{on_db, Db, Timestamp};
use crate::store::InboxStatus;

/// What the consumer will do with one replayed message, judged from the inbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// No inbox row: the handler runs.
    New,
    /// Processed with the same fingerprint: skipped as a duplicate.
    Applied,
    /// Dead-lettered with the same fingerprint: dead-lettered again, the handler does not run.
    DeadLettered,
    /// A failed attempt is recorded: the handler runs again (as a retry).
    Retrying,
    /// The ID is taken by a different payload: dead-lettered as a conflict.
    Conflicting,
    /// No ID under the strategy: dead-lettered as `missing_id`.
    MissingId,
}

impl Verdict {
    /// Stable lower-case name, for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::New => "new",
            Verdict::Applied => "applied",
            Verdict::DeadLettered => "dead_lettered",
            Verdict::Retrying => "retrying",
            Verdict::Conflicting => "conflicting",
            Verdict::MissingId => "missing_id",
        }
    }

    /// The verdict for a message with `fingerprint` whose inbox row is `row`.
    pub fn of(row: Option<&InboxRow>, fingerprint: &[u8; 32]) -> Verdict {
        match row {
            None => Verdict::New,
            Some(r) if r.fingerprint != fingerprint[..] => Verdict::Conflicting,
            Some(r) => match r.status {
                InboxStatus::Processed => Verdict::Applied,
                InboxStatus::DeadLettered => Verdict::DeadLettered,
                InboxStatus::Retrying => Verdict::Retrying,
            },
        }
    }
}

/// An inbox row's status and fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxRow {
    /// Status.
    pub status: InboxStatus,
    /// SHA-256 fingerprint of the payload that claimed the ID.
    pub fingerprint: Vec<u8>,
}

/// Checks that `strategy` (an [`IdStrategy::label`](crate::IdStrategy::label)) is what
/// `consumer` derives IDs with: `None` if one of its inbox rows carries that label or it has no
/// rows; otherwise `Some` label its rows do carry. A dry run with another strategy compares IDs
/// the consumer never stored.
pub async fn other_strategy<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    strategy: &str,
) -> Result<Option<String>, sqlx::Error> {
    let db = db.into();
    let inbox = db.table("inbox");
    let sql = format!(
        "SELECT (SELECT id_strategy FROM {inbox} WHERE consumer = $1 AND id_strategy = $2 LIMIT 1),
                (SELECT id_strategy FROM {inbox} WHERE consumer = $1 LIMIT 1)"
    );
    let (matching, any): (Option<String>, Option<String>) = on_db!(db, pool => {
        sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(consumer)
            .bind(strategy)
            .fetch_one(pool)
            .await?
    });
    Ok(if matching.is_some() { None } else { any })
}

/// The inbox rows of `consumer` for `ids`, by ID (IDs without a row are absent).
pub async fn lookup<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    ids: &[String],
) -> Result<HashMap<String, InboxRow>, sqlx::Error> {
    let db = db.into();
    let sql = format!(
        "SELECT message_id, status, fingerprint FROM {} WHERE consumer = $1 AND message_id {}",
        db.table("inbox"),
        // SQLite has no arrays: the IDs travel as one JSON array.
        if db.is_sqlite() {
            "IN (SELECT value FROM json_each($2))"
        } else {
            "= ANY($2)"
        }
    );
    let rows: Vec<(String, String, Vec<u8>)> = match db {
        Db::Postgres(pool) => {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(consumer)
                .bind(ids)
                .fetch_all(pool)
                .await?
        }
        #[cfg(feature = "sqlite")]
        Db::Sqlite(pool) => {
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(consumer)
                .bind(serde_json::to_string(ids).expect("strings serialize"))
                .fetch_all(pool)
                .await?
        }
    };
    Ok(rows
        .into_iter()
        .filter_map(|(id, status, fingerprint)| {
            Some((
                id,
                InboxRow {
                    status: InboxStatus::parse(&status)?,
                    fingerprint,
                },
            ))
        })
        .collect())
}

/// Sets `consumer`'s next positions in `source` (lane → next position) in one transaction,
/// provided the retention horizon is still `checked_horizon`, the one the caller checked the
/// replay range against. Returns `false`, changing nothing, when a purge has moved the horizon
/// since (the range may have lost inbox rows: check again). The horizon is read under the lock
/// [`record_horizon`](super::retention::record_horizon) takes (on SQLite: the write lock of a
/// `BEGIN IMMEDIATE` transaction), so a purge cannot slip between the check and the commit.
///
/// A consumer reads the positions when it is (re)assigned the lane; a running consumer
/// overwrites them with its own progress, so move positions only while the consumer is stopped.
pub async fn set_positions<'a>(
    db: impl Into<Db<'a>>,
    consumer: &str,
    source: &str,
    positions: &[(String, i64)],
    checked_horizon: Option<Timestamp>,
) -> Result<bool, sqlx::Error> {
    let db = db.into();
    let horizon_sql = super::retention::horizon_sql(db);
    let save = format!(
        "INSERT INTO {} (consumer, source, lane, next_position)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (consumer, source, lane) DO UPDATE
             SET next_position = EXCLUDED.next_position, updated_at = {}",
        db.table("positions"),
        db.now()
    );
    macro_rules! run {
        ($tx:ident) => {{
            let horizon: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(horizon_sql))
                .bind(consumer)
                .fetch_optional(&mut *$tx)
                .await?;
            if horizon.map(Timestamp) != checked_horizon {
                $tx.rollback().await?;
                return Ok(false);
            }
            for (lane, next) in positions {
                sqlx::query(sqlx::AssertSqlSafe(save.clone()))
                    .bind(consumer)
                    .bind(source)
                    .bind(lane)
                    .bind(next)
                    .execute(&mut *$tx)
                    .await?;
            }
            $tx.commit().await?;
            Ok(true)
        }};
    }
    match db {
        Db::Postgres(pool) => {
            let mut tx = pool.begin().await?;
            sqlx::query(super::retention::HORIZON_LOCK)
                .bind(consumer)
                .execute(&mut *tx)
                .await?;
            run!(tx)
        }
        #[cfg(feature = "sqlite")]
        Db::Sqlite(pool) => {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
            run!(tx)
        }
    }
}
