//! What one round does: claim due rows, publish them (each key in order, keys concurrently),
//! decide what each outcome means, and mark the rows.

use std::collections::HashMap;
use std::time::Duration;

#[cfg(feature = "sqlite")]
use sqlx::sqlite::SqlitePool;

use super::{OutboxPool, Relay};
use crate::outbox::{OutboxMessage, PublishError, Publisher};

/// What one [`Relay::relay_once`] round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayRound {
    /// Rows claimed (locked) in this round.
    pub claimed: usize,
    /// Rows the broker confirmed and that were marked published.
    pub published: usize,
    /// Publish attempts that failed (retried later or dead-lettered).
    pub failed: usize,
    /// Rows dead-lettered in this round.
    pub dead_lettered: usize,
    /// Every publish of the round failed transiently, for at least two rows: taken as the
    /// broker being unavailable, so no attempt was counted against the rows.
    pub broker_unavailable: bool,
}

/// A claimed row.
pub(in crate::outbox) struct Claimed {
    pub(in crate::outbox) id: i64,
    pub(in crate::outbox) attempts: i32,
    pub(in crate::outbox) message: OutboxMessage,
}

/// What a round writes back.
#[derive(Default)]
pub(in crate::outbox) struct Settlement {
    /// Confirmed by the broker: marked published.
    pub(in crate::outbox) published: Vec<i64>,
    /// Failed attempts that count.
    pub(in crate::outbox) failed: Vec<FailedRow>,
    /// Claimed but not attempted, or failed during a broker outage (not counted): claimed again
    /// by the next round. (PostgreSQL: the COMMIT unlocks them; SQLite: their lease is cleared.)
    pub(in crate::outbox) released: Vec<i64>,
}

pub(in crate::outbox) struct FailedRow {
    pub(in crate::outbox) id: i64,
    pub(in crate::outbox) error: String,
    pub(in crate::outbox) retry_in: Duration,
    pub(in crate::outbox) dead: bool,
}

/// A round's claim between publishing and marking.
pub(super) enum Claim {
    /// The transaction holding the row locks; the marks go into it.
    #[cfg(feature = "postgres")]
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
    /// The rows are leased; the marks are a transaction of their own.
    #[cfg(feature = "sqlite")]
    Sqlite {
        pool: SqlitePool,
        token: crate::outbox::sqlite::LeaseToken,
        /// When the lease runs out: marking is retried (database busy) until then.
        until: tokio::time::Instant,
    },
}

enum Outcome {
    Published,
    Failed(PublishError),
    NotAttempted,
}

impl<P: Publisher> Relay<P> {
    /// One round: claim due rows, publish them, mark them. Returns what it did.
    /// Safe to call from several relays at once.
    pub async fn relay_once(&self) -> Result<RelayRound, sqlx::Error> {
        let (rows, claim) = self.claim().await?;
        self.finish(rows, claim).await
    }

    /// Claims due rows. Cancellation-safe: a claim dropped before it returns is rolled back
    /// (on SQLite, dropped between its COMMIT and its return, the rows wait for their lease to
    /// run out).
    pub(super) async fn claim(&self) -> Result<(Vec<Claimed>, Claim), sqlx::Error> {
        let limit = self.config.batch_size;
        match &self.pool {
            #[cfg(feature = "postgres")]
            OutboxPool::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let rows = crate::outbox::postgres::claim(&mut tx, limit).await?;
                Ok((rows, Claim::Postgres(tx)))
            }
            #[cfg(feature = "sqlite")]
            OutboxPool::Sqlite(pool) => {
                let now = tokio::time::Instant::now();
                let until = now.checked_add(self.lease()).unwrap_or(now);
                let (rows, token) = crate::outbox::sqlite::claim(pool, limit, self.lease()).await?;
                let claim = Claim::Sqlite {
                    pool: pool.clone(),
                    token,
                    until,
                };
                Ok((rows, claim))
            }
        }
    }

    /// How long a SQLite claim lasts: longer than a round can take (it starts no publish after
    /// `publish_timeout` and each is bounded by it), with room to mark the rows.
    #[cfg(feature = "sqlite")]
    fn lease(&self) -> Duration {
        self.config
            .publish_timeout
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(10))
    }

    /// Publishes the claimed rows and marks them. Not to be cancelled once started (the run
    /// loop never does): a dropped round publishes its rows again later.
    pub(super) async fn finish(&self, rows: Vec<Claimed>, claim: Claim) -> Result<RelayRound, sqlx::Error> {
        if rows.is_empty() {
            match claim {
                #[cfg(feature = "postgres")]
                Claim::Postgres(tx) => tx.commit().await?,
                #[cfg(feature = "sqlite")]
                Claim::Sqlite { .. } => {}
            }
            return Ok(RelayRound::default());
        }
        let outcomes = self.publish_all(&rows).await;
        let (settlement, mut round) = self.settlement(&rows, outcomes);
        if !settlement.published.is_empty() {
            crate::crash::hit(crate::crash::RELAY_PUBLISHED);
        }
        match claim {
            #[cfg(feature = "postgres")]
            Claim::Postgres(mut tx) => {
                crate::outbox::postgres::settle(&mut tx, &settlement).await?;
                tx.commit().await?;
            }
            #[cfg(feature = "sqlite")]
            Claim::Sqlite { pool, token, until } => {
                crate::outbox::sqlite::settle(&pool, &settlement, token, until).await?
            }
        }
        round.published = settlement.published.len();
        self.metrics.published.increment(round.published as u64);
        self.metrics.failures.increment(round.failed as u64);
        self.metrics.dead_letters.increment(round.dead_lettered as u64);
        Ok(round)
    }

    /// Decides what the outcomes mean for each row (and logs the failures).
    fn settlement(&self, rows: &[Claimed], outcomes: Vec<Outcome>) -> (Settlement, RelayRound) {
        let mut round = RelayRound {
            claimed: rows.len(),
            ..RelayRound::default()
        };
        let mut settlement = Settlement::default();
        let failures = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Failed(_)))
            .count();
        let published = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Published))
            .count();
        // A broker outage is not the rows' fault: it must not burn their attempts (and
        // dead-letter every key's head after a long outage). One failing row alone is counted.
        round.broker_unavailable = published == 0
            && failures >= 2
            && outcomes
                .iter()
                .all(|o| !matches!(o, Outcome::Failed(e) if e.is_permanent()));
        for (row, outcome) in rows.iter().zip(outcomes) {
            let e = match outcome {
                Outcome::Published => {
                    settlement.published.push(row.id);
                    continue;
                }
                Outcome::NotAttempted => {
                    settlement.released.push(row.id);
                    continue;
                }
                Outcome::Failed(e) => e,
            };
            round.failed += 1;
            if round.broker_unavailable {
                if round.failed == 1 {
                    tracing::warn!(relay = %self.config.name, failed = failures, error = %e,
                        "every publish of the round failed; is the broker unavailable? attempts not counted");
                }
                settlement.released.push(row.id);
                continue;
            }
            let attempt = row.attempts.max(0) as u32 + 1;
            let dead = e.is_permanent() || self.config.retry.exhausted(attempt);
            let retry_in = self.config.retry.delay(attempt, None);
            if dead {
                round.dead_lettered += 1;
                tracing::error!(relay = %self.config.name, message_id = %row.message.message_id, attempt, error = %e,
                    "outbox row dead-lettered; later rows of its key are published now");
            } else {
                tracing::warn!(relay = %self.config.name, message_id = %row.message.message_id, attempt, error = %e,
                    retry_in = ?retry_in, "outbox publish failed; retrying");
            }
            settlement.failed.push(FailedRow {
                id: row.id,
                error: crate::store::clean_text(&e.to_string()),
                retry_in,
                dead,
            });
        }
        (settlement, round)
    }

    /// Publishes claimed rows (in `id` order): each `(destination, key)` unit in order, stopping
    /// at its first failure; units concurrently; rows without a key each on their own.
    async fn publish_all(&self, rows: &[Claimed]) -> Vec<Outcome> {
        let mut units: Vec<Vec<usize>> = Vec::new();
        let mut unit_of: HashMap<(&str, &[u8]), usize> = HashMap::new();
        for (i, row) in rows.iter().enumerate() {
            match row.message.key.as_deref() {
                Some(key) => {
                    let unit = *unit_of.entry((&row.message.destination, key)).or_insert_with(|| {
                        units.push(Vec::new());
                        units.len() - 1
                    });
                    units[unit].push(i);
                }
                None => units.push(vec![i]),
            }
        }
        let deadline = tokio::time::Instant::now() + self.config.publish_timeout;
        let results = futures::future::join_all(units.into_iter().map(|unit| async move {
            let mut out = Vec::with_capacity(unit.len());
            let mut failed = false;
            for i in unit {
                if failed || tokio::time::Instant::now() >= deadline {
                    out.push((i, Outcome::NotAttempted));
                    continue;
                }
                let message = &rows[i].message;
                let result =
                    tokio::time::timeout(self.config.publish_timeout, self.publisher.publish(message))
                        .await
                        .unwrap_or_else(|_| {
                            Err(PublishError::transient(format!(
                                "no broker confirmation within {:?} (RelayConfig::publish_timeout)",
                                self.config.publish_timeout
                            )))
                        });
                match result {
                    Ok(()) => out.push((i, Outcome::Published)),
                    Err(e) => {
                        failed = true;
                        out.push((i, Outcome::Failed(e)));
                    }
                }
            }
            out
        }))
        .await;
        let mut outcomes: Vec<Outcome> = rows.iter().map(|_| Outcome::NotAttempted).collect();
        for (i, outcome) in results.into_iter().flatten() {
            outcomes[i] = outcome;
        }
        outcomes
    }
}
