//! [`Relay`]: publishes committed outbox rows through a [`Publisher`] and marks them.
//!
//! One file per question: [`config`] (how a relay is configured), [`round`] (what one round
//! claims, publishes and marks), [`listen`] (how the relay is woken), [`upkeep`] (retention, a
//! [janitor](crate::janitor) beside the rounds, and the gauges between rounds), [`metrics`] (what a relay reports).

mod config;
mod listen;
mod metrics;
mod round;
mod upkeep;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "postgres")]
use sqlx::postgres::PgPool;
#[cfg(feature = "sqlite")]
use sqlx::sqlite::SqlitePool;

pub use self::metrics::Backlog;
pub use config::{RelayConfig, RelayError};
pub use round::RelayRound;
pub(super) use round::{Claimed, Settlement};

use self::metrics::Metrics;
use super::Publisher;
use crate::consumer::backoff::store_backoff;
use listen::{notified, read_queued, Listener};

/// Publishes pending outbox rows through a [`Publisher`], marks them published, retries
/// failures with backoff, dead-letters rows after bounded attempts, and deletes published rows
/// after the retention window.
///
/// # How a round works
///
/// One transaction: claim up to `batch_size` rows, publish them (rows of one
/// `(destination, key)` one after another, different keys concurrently), then mark each row
/// published, or count its failed attempt (with the next attempt's time, or dead-lettered), and
/// COMMIT. The row locks are held while publishing. A relay that dies after the broker
/// confirmed but before COMMIT leaves the rows pending: they are published again (same message
/// ID), and the downstream inbox drops the copy. That is the at-least-once half of the
/// contract; the crash point [`crash::RELAY_PUBLISHED`](crate::crash::RELAY_PUBLISHED) sits
/// exactly there.
///
/// # Order with several relays
///
/// A round claims only the **head** of each key — the oldest pending row, when no earlier row
/// of its key is pending and it is due — with `FOR UPDATE SKIP LOCKED`, then the later pending
/// rows of the claimed keys. Another relay sees the locked head as the head of that key too
/// and skips it, so it cannot take any later row of that key: one key is published by one
/// relay at a time, in row order. A failed row stays the head (with its next attempt time),
/// so nothing of its key overtakes it until it is published or dead-lettered.
///
/// Row IDs are taken at insert, not at commit: a row whose transaction commits after a later
/// row of its key was claimed becomes a new head. It may then be published after, or (by another
/// relay) alongside, the rows of transactions it overlapped with — those have no defined order —
/// but never after rows written once it had committed.
///
/// # Waking
///
/// `LISTEN txinbox_outbox` (a trigger notifies on insert; delivered at commit) wakes the relay
/// at once; every `poll_interval` it looks anyway (lost notifications, retries coming due).
/// A database error pauses the relay and it tries again; it never gives up on its own. An
/// unavailable database ([`store::is_unavailable`](crate::store::is_unavailable): unreachable,
/// refusing connections, sessions ended; the rule the consumer and txinbox-http share) is
/// waited out with a growing pause (at least `poll_interval`, growing to 5 s) and reported as
/// "outbox database unreachable"; no attempt is counted against a row for it (a round whose
/// marks cannot be written leaves its rows as they were, to be published again). Any other
/// failure (a missing table, a permission) is logged as an error and reported with its cause,
/// and the relay tries again after `poll_interval`.
/// The listener is read also while the relay drains a backlog or pauses for a broker outage:
/// an unread listener would hold back the server's NOTIFY queue until writers' commits fail.
///
/// # Broker outages
///
/// When every publish of a round fails transiently, for at least two rows, the relay takes the
/// broker as unavailable: no attempt is counted against the rows (an outage must not
/// dead-letter the head of every key) and rounds are spaced out, doubling from
/// `poll_interval` up to 30 s, until a publish succeeds, or until a round with nothing of its
/// own to publish (with several relays, another one may take every new row) finds the broker
/// answering again ([`Publisher::probe`]; a publisher that cannot tell puts the relay's
/// report back to unknown: it has no evidence either way). A single failing row, alone in its
/// round, is counted as usual — so is a row that fails while others succeed. (Rows of several
/// keys that all fail for their own reasons, with nothing else pending, look like an outage
/// too: they wait, uncounted, until other rows are published beside them.)
///
/// The limit: a round with one failing row tells an outage from a bad row by nothing, so it is
/// counted. That is every round of an outbox whose due rows all share one key (its later rows
/// wait behind the head), and of a quiet one (one row at a time). There an outage longer than
/// the retry policy's attempts — with the defaults, roughly 5 to 15 minutes including the
/// publisher's own timeouts — dead-letters the head, and the key's later rows overtake it.
/// Size [`RelayConfig::retry_policy`] for the longest broker outage such an outbox must ride
/// out.
///
/// # Connections
///
/// A running relay holds two connections of its pool: the listener's, and the round's
/// transaction (held while publishing: a round starts no publish after `publish_timeout`, and
/// each publish is bounded by it, so at most about twice that). Retention takes a third for
/// each of its `DELETE`s (a statement of its own, no transaction held between them).
///
/// # SQLite
///
/// SQLite has one writer and no `NOTIFY`. A round claims its rows in a short `BEGIN IMMEDIATE`
/// transaction (taken only when a plain read finds a due row, so idle polls never take the
/// write lock) that sets a lease on them (`leased_until`: twice `publish_timeout` plus 10 s,
/// longer than a round can publish) and a random token; it publishes with no lock held — the
/// application's writers are not blocked while the broker confirms — and marks, in a second
/// short transaction, the rows that still carry its token. What is different from PostgreSQL:
///
/// - New rows are found by polling, every `poll_interval` (default 1 s).
/// - A relay that dies holding a claim does not release it: its rows are published again once
///   the lease runs out (about 50 s with the defaults), not at once. So is a claim dropped by
///   shutdown between its COMMIT and its return, and a [`relay_once`](Self::relay_once) that
///   the caller cancels.
/// - Marking waits out a busy database (the write lock held past the busy timeout, no free
///   connection), retrying until the lease runs out; only then is the round an error, and its
///   confirmed rows are published again after the lease.
/// - A round that outlives its lease (a stalled process) loses its rows to the next relay that
///   claims them: both may publish them (a duplicate the downstream inbox drops, and the order
///   of that key is not guaranteed across the two), but the stalled round's late marks change
///   nothing — a failure it saw cannot dead-letter a row the other relay published.
/// - A key whose pending rows include a leased one is not claimed by anyone else, so a row put
///   back before them (a dead letter set to `pending` again) waits until that claim ends.
/// - Row IDs follow commit order (one writer), so the late-committing row described above does
///   not exist.
/// - A relay's rounds hold one connection at a time, and none while publishing; with
///   retention on, its janitor takes a second one while a `DELETE` runs.
pub struct Relay<P> {
    pool: OutboxPool,
    publisher: Arc<P>,
    config: RelayConfig,
    metrics: Metrics,
    health: Arc<crate::health::RelayState>,
    /// Retention of published rows: runs beside the rounds while the relay runs.
    janitor: Arc<crate::janitor::Janitor>,
}

impl<P> fmt::Debug for Relay<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The database an outbox lives in, for [`Relay::new`]: a `PgPool` or a `SqlitePool` converts
/// into it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum OutboxPool {
    /// `txinbox.outbox` in PostgreSQL ([`postgres::migrate`](crate::postgres::migrate)).
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
    /// `txinbox_outbox` in SQLite ([`sqlite::migrate`](crate::sqlite::migrate)).
    #[cfg(feature = "sqlite")]
    Sqlite(SqlitePool),
}

#[cfg(feature = "postgres")]
impl From<PgPool> for OutboxPool {
    fn from(pool: PgPool) -> Self {
        OutboxPool::Postgres(pool)
    }
}

#[cfg(feature = "sqlite")]
impl From<SqlitePool> for OutboxPool {
    fn from(pool: SqlitePool) -> Self {
        OutboxPool::Sqlite(pool)
    }
}

/// Longest pause between rounds while the broker looks unavailable.
const MAX_OUTAGE_PAUSE: Duration = Duration::from_secs(30);

impl<P: Publisher> Relay<P> {
    /// A relay over the outbox in `pool`'s database — a `PgPool` (run
    /// [`postgres::migrate`](crate::postgres::migrate) first) or a `SqlitePool` (run
    /// [`sqlite::migrate`](crate::sqlite::migrate) first) — publishing through `publisher`.
    ///
    /// Metric handles are resolved here: install your recorder before.
    pub fn new(pool: impl Into<OutboxPool>, publisher: P, config: RelayConfig) -> Result<Self, RelayError> {
        config.validate().map_err(RelayError::Config)?;
        let metrics = Metrics::new(&config.name);
        let pool = pool.into();
        let schedule = crate::janitor::Schedule {
            interval: config.retention_interval,
            batch: u32::try_from(config.retention_batch).unwrap_or(u32::MAX),
            ..crate::janitor::Schedule::default()
        };
        let sweep = upkeep::OutboxSweep {
            pool: pool.clone(),
            retention: config.retention,
        };
        let janitor = crate::janitor::Janitor::new(sweep, schedule, "outbox", Some(("relay", &config.name)))
            .map_err(RelayError::Config)?;
        Ok(Relay {
            janitor: Arc::new(janitor),
            pool,
            publisher: Arc::new(publisher),
            health: Arc::new(crate::health::RelayState::new(&config.name)),
            config,
            metrics,
        })
    }

    /// A handle reporting this relay's health (running, database reachable, broker taking
    /// publishes), for `/healthz` and `/readyz`. Take it before
    /// [`run_until`](Self::run_until), which consumes the relay.
    pub fn health(&self) -> crate::health::RelayHealth {
        crate::health::RelayHealth(self.health.clone())
    }

    /// Runs until `shutdown` completes: publishes whatever is due, then waits for a
    /// notification or the poll interval; runs retention and refreshes the gauges on their
    /// schedules. Stops between rounds (a round in progress finishes, bounded by
    /// `publish_timeout`); waits for a connection, retention and the backlog query are
    /// abandoned (nothing is lost: they are repeated by the next run).
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<(), RelayError> {
        struct Stopped(Arc<crate::health::RelayState>);
        impl Drop for Stopped {
            fn drop(&mut self) {
                self.0.set_running(false);
            }
        }
        self.health.set_running(true);
        let _stopped = Stopped(self.health.clone());
        tokio::pin!(shutdown);
        let mut listener: Option<Listener> = None;
        let far_past = Instant::now()
            .checked_sub(Duration::from_secs(3600))
            .unwrap_or_else(Instant::now);
        let mut last_metrics = far_past;
        // Retention runs on its own task while the relay runs (and stops with it).
        let _retention = self.janitor.clone().spawn();
        // While the broker looks unavailable, rounds are spaced out (doubling, up to 30 s) and
        // notifications do not shorten the pause.
        let mut outage_pause: Option<Duration> = None;
        // Consecutive rounds that found the database unavailable: the pause grows with them.
        let mut unavailable_rounds: u32 = 0;
        loop {
            // Set by a round that had nothing of its own to publish while the broker looks
            // unavailable: only the broker itself can say the outage is over.
            let mut ask_broker = false;
            // Waits for the database (up to the pool's acquire timeout while it is unreachable)
            // give way to shutdown; a round that has its connection finishes.
            if listener.is_none() {
                tokio::select! {
                    biased;
                    () = &mut shutdown => return Ok(()),
                    l = self.listen() => listener = l,
                }
            }
            // Drain: full rounds mean there may be more. The gauges refresh between rounds on
            // their schedule, also during a long drain (when they matter most); retention runs
            // on its own task meanwhile.
            loop {
                let result = tokio::select! {
                    biased;
                    () = &mut shutdown => return Ok(()),
                    claim = self.claim() => match claim {
                        Ok((rows, claim)) => self.finish(rows, claim).await,
                        Err(e) => Err(e),
                    },
                };
                tokio::select! {
                    biased;
                    () = &mut shutdown => return Ok(()),
                    () = self.run_due_upkeep(&mut last_metrics) => {}
                }
                match &result {
                    Ok(round) => {
                        if unavailable_rounds > 0 {
                            tracing::info!(relay = %self.config.name, "outbox database reachable again; rounds resume");
                        }
                        unavailable_rounds = 0;
                        self.health
                            .round(Some((round.published, round.broker_unavailable)));
                    }
                    Err(e) => self.round_failed(e, &mut unavailable_rounds),
                }
                match result {
                    Ok(round) if round.broker_unavailable => {
                        let next = outage_pause.map_or(self.config.poll_interval, |p| p * 2);
                        outage_pause = Some(next.min(MAX_OUTAGE_PAUSE.max(self.config.poll_interval)));
                        break;
                    }
                    Ok(round) if round.claimed == self.config.batch_size && round.published > 0 => {
                        outage_pause = None;
                        // The next round serves whatever was notified until now.
                        read_queued(&mut listener);
                    }
                    Ok(round) => {
                        if round.published > 0 {
                            outage_pause = None;
                        } else if round.failed == 0 {
                            ask_broker = outage_pause.is_some();
                        }
                        break;
                    }
                    Err(_) => break,
                }
                if futures::FutureExt::now_or_never(&mut shutdown).is_some() {
                    return Ok(());
                }
            }
            if ask_broker {
                tokio::select! {
                    biased;
                    () = &mut shutdown => return Ok(()),
                    over = self.outage_over() => if over {
                        outage_pause = None;
                    },
                }
            }
            if let Some(pause) = outage_pause {
                // Notifications do not end the pause, but they are read: see `notified`.
                let until = tokio::time::Instant::now() + pause;
                loop {
                    tokio::select! {
                        biased;
                        () = &mut shutdown => return Ok(()),
                        () = tokio::time::sleep_until(until) => break,
                        () = notified(&mut listener) => {}
                    }
                }
                continue;
            }
            let pause = if unavailable_rounds > 0 {
                store_backoff(unavailable_rounds).max(self.config.poll_interval)
            } else {
                self.config.poll_interval
            };
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = notified(&mut listener) => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Logs and reports a failed round. `unavailable_rounds` counts the consecutive rounds
    /// that found the database unavailable: the outage is logged once, when it starts.
    fn round_failed(&self, e: &sqlx::Error, unavailable_rounds: &mut u32) {
        let relay = &self.config.name;
        if crate::store::is_unavailable(e) {
            *unavailable_rounds += 1;
            if *unavailable_rounds == 1 {
                tracing::warn!(%relay, error = %e, "outbox database unavailable; the relay waits for it (rows stay pending, no attempt is counted)");
            } else {
                tracing::debug!(%relay, error = %e, "outbox database still unavailable");
            }
            self.health.round(None);
            return;
        }
        *unavailable_rounds = 0;
        if crate::store::is_lock_conflict(e) {
            // The database is fine; the next round runs after the poll interval.
            tracing::debug!(%relay, error = %e, "outbox relay round lost a lock conflict; retrying after the poll interval");
            return;
        }
        tracing::error!(%relay, error = %e, "outbox relay round failed; retrying after the poll interval");
        self.health.round_failed(&e.to_string());
    }
}

impl<P: Publisher> Relay<P> {
    /// While the broker looks unavailable and a round had nothing of its own to publish (with
    /// several relays, another may take every new row): asks the publisher whether the broker
    /// is back ([`Publisher::probe`]), bounded by `publish_timeout`, and reports the answer.
    /// `true`: the outage is over as far as this relay can tell (the broker answered, or the
    /// publisher cannot tell and the report goes back to unknown).
    async fn outage_over(&self) -> bool {
        use crate::health::BrokerStatus;
        let answer = tokio::time::timeout(self.config.publish_timeout, self.publisher.probe()).await;
        match answer {
            Ok(Some(Ok(()))) => {
                tracing::info!(relay = %self.config.name, "the broker answers again; the outage is over");
                self.health.set_broker(BrokerStatus::Connected);
                true
            }
            Ok(None) => {
                self.health.set_broker(BrokerStatus::Unknown);
                true
            }
            Ok(Some(Err(e))) => {
                tracing::debug!(relay = %self.config.name, error = %e, "the broker still looks unavailable");
                false
            }
            Err(_) => {
                tracing::debug!(relay = %self.config.name, "the broker did not answer within publish_timeout");
                false
            }
        }
    }
}
