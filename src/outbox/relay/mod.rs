//! [`Relay`]: publishes committed outbox rows through a [`Publisher`] and marks them.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{Counter, Gauge};
#[cfg(feature = "postgres")]
use sqlx::postgres::{PgListener, PgPool};
#[cfg(feature = "sqlite")]
use sqlx::sqlite::SqlitePool;

use super::{OutboxMessage, PublishError, Publisher};
use crate::retry::RetryPolicy;
use crate::telemetry;

/// How a [`Relay`] runs. Every field has a default; see each setter.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    name: String,
    batch_size: usize,
    poll_interval: Duration,
    publish_timeout: Duration,
    retry: RetryPolicy,
    retention: Duration,
    retention_interval: Duration,
    retention_batch: usize,
    metrics_interval: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            name: "outbox".into(),
            batch_size: 256,
            poll_interval: Duration::from_secs(1),
            publish_timeout: Duration::from_secs(20),
            retry: RetryPolicy::default()
                .max_attempts(20)
                .initial_delay(Duration::from_millis(500))
                .max_delay(Duration::from_secs(60)),
            retention: Duration::from_secs(24 * 3600),
            retention_interval: Duration::from_secs(60),
            retention_batch: 1000,
            metrics_interval: Duration::from_secs(5),
        }
    }
}

impl RelayConfig {
    /// The relay's name, the `relay` label of its metrics. Default `outbox`.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Most rows claimed (and published) per transaction. Default 256.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// How often the relay looks for due rows without a notification: the fallback when a
    /// `NOTIFY` is lost (listener reconnect) and the clock for retries coming due. Default 1 s.
    /// On SQLite, which has no notifications, this is how long a new row can wait.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Longest wait for one broker confirmation before it counts as a failed attempt, and
    /// how long a round keeps starting new publishes (rows not started by then wait for the
    /// next round, no attempt counted). Default 20 s. The claim transaction stays open while
    /// publishing — up to twice this — so keep twice this below the pool's
    /// `idle_in_transaction_session_timeout` (60 s with `PostgresInbox::connect_options`).
    /// A round the server cuts off is not lost: its rows are published again. On SQLite a
    /// round's claim (its lease) lasts twice this plus 10 s.
    pub fn publish_timeout(mut self, d: Duration) -> Self {
        self.publish_timeout = d;
        self
    }

    /// Attempts and backoff per row. Default 20 attempts, 500 ms initial delay, 60 s maximum.
    /// A row whose attempts are exhausted is dead-lettered (status `dead_lettered`, with its
    /// last error), which lets the later rows of its key go.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How long published rows are kept before retention deletes them. Default 24 h.
    /// Dead-lettered rows are never deleted by the relay.
    pub fn retention(mut self, d: Duration) -> Self {
        self.retention = d;
        self
    }

    /// How often retention runs, and how many rows one `DELETE` removes. Defaults 60 s, 1000.
    pub fn retention_schedule(mut self, every: Duration, batch: usize) -> Self {
        self.retention_interval = every;
        self.retention_batch = batch;
        self
    }

    /// How often the pending-rows gauges are refreshed. Default 5 s.
    pub fn metrics_interval(mut self, d: Duration) -> Self {
        self.metrics_interval = d;
        self
    }

    fn validate(&self) -> Result<(), String> {
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return Err(format!(
                "RelayConfig::batch_size is {}; use 1..=10000",
                self.batch_size
            ));
        }
        if self.retention_batch == 0 {
            return Err("RelayConfig::retention_schedule batch must be at least 1".into());
        }
        for (what, d) in [
            ("poll_interval", self.poll_interval),
            ("publish_timeout", self.publish_timeout),
            ("retention_schedule interval", self.retention_interval),
            ("metrics_interval", self.metrics_interval),
        ] {
            if d.is_zero() {
                return Err(format!("RelayConfig::{what} must be above zero"));
            }
        }
        self.retry.validate()
    }
}

/// Why a relay could not start or had to stop.
#[derive(Debug)]
#[non_exhaustive]
pub enum RelayError {
    /// The configuration is invalid; the message says what to change.
    Config(String),
}

impl fmt::Display for RelayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RelayError::Config(m) => write!(f, "invalid relay configuration: {m}"),
        }
    }
}

impl std::error::Error for RelayError {}

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

/// The outbox's backlog, as the gauges report it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backlog {
    /// Rows with status `pending`.
    pub pending: i64,
    /// Age of the oldest pending row (zero when none).
    pub oldest_pending_age: Duration,
}

struct Metrics {
    published: Counter,
    failures: Counter,
    dead_letters: Counter,
    pending: Gauge,
    oldest_age: Gauge,
}

impl Metrics {
    fn new(relay: &str) -> Self {
        use metrics::{describe_counter, describe_gauge, Unit};
        describe_gauge!(telemetry::OUTBOX_PENDING, "Outbox rows waiting to be published");
        describe_gauge!(
            telemetry::OUTBOX_OLDEST_PENDING_AGE,
            Unit::Seconds,
            "Age of the oldest pending outbox row"
        );
        describe_counter!(telemetry::OUTBOX_PUBLISHED, "Outbox rows published and marked");
        describe_counter!(
            telemetry::OUTBOX_PUBLISH_FAILURES,
            "Outbox publish attempts not confirmed by the broker"
        );
        describe_counter!(telemetry::OUTBOX_DEAD_LETTERS, "Outbox rows dead-lettered");
        let label = || [("relay", relay.to_owned())];
        Metrics {
            published: metrics::counter!(telemetry::OUTBOX_PUBLISHED, &label()),
            failures: metrics::counter!(telemetry::OUTBOX_PUBLISH_FAILURES, &label()),
            dead_letters: metrics::counter!(telemetry::OUTBOX_DEAD_LETTERS, &label()),
            pending: metrics::gauge!(telemetry::OUTBOX_PENDING, &label()),
            oldest_age: metrics::gauge!(telemetry::OUTBOX_OLDEST_PENDING_AGE, &label()),
        }
    }
}

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
/// A database error pauses the relay for `poll_interval` and it tries again; it never gives up
/// on its own.
/// The listener is read also while the relay drains a backlog or pauses for a broker outage:
/// an unread listener would hold back the server's NOTIFY queue until writers' commits fail.
///
/// # Broker outages
///
/// When every publish of a round fails transiently, for at least two rows, the relay takes the
/// broker as unavailable: no attempt is counted against the rows (an outage must not
/// dead-letter the head of every key) and rounds are spaced out, doubling from
/// `poll_interval` up to 30 s, until a publish succeeds. A single failing row, alone in its
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
/// each publish is bounded by it, so at most about twice that).
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
/// - A relay holds one connection at a time, and none while publishing.
pub struct Relay<P> {
    pool: OutboxPool,
    publisher: Arc<P>,
    config: RelayConfig,
    metrics: Metrics,
    health: Arc<crate::health::RelayState>,
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
    /// `txinbox.outbox` in PostgreSQL ([`migrate`](crate::migrate)).
    #[cfg(feature = "postgres")]
    Postgres(PgPool),
    /// `txinbox_outbox` in SQLite ([`migrate_sqlite`](crate::migrate_sqlite)).
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

/// A claimed row.
pub(super) struct Claimed {
    pub(super) id: i64,
    pub(super) attempts: i32,
    pub(super) message: OutboxMessage,
}

/// What a round writes back.
#[derive(Default)]
pub(super) struct Settlement {
    /// Confirmed by the broker: marked published.
    pub(super) published: Vec<i64>,
    /// Failed attempts that count.
    pub(super) failed: Vec<FailedRow>,
    /// Claimed but not attempted, or failed during a broker outage (not counted): claimed again
    /// by the next round. (PostgreSQL: the COMMIT unlocks them; SQLite: their lease is cleared.)
    pub(super) released: Vec<i64>,
}

pub(super) struct FailedRow {
    pub(super) id: i64,
    pub(super) error: String,
    pub(super) retry_in: Duration,
    pub(super) dead: bool,
}

/// A round's claim between publishing and marking.
enum Claim {
    /// The transaction holding the row locks; the marks go into it.
    #[cfg(feature = "postgres")]
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
    /// The rows are leased; the marks are a transaction of their own.
    #[cfg(feature = "sqlite")]
    Sqlite {
        pool: SqlitePool,
        token: super::sqlite::LeaseToken,
        /// When the lease runs out: marking is retried (database busy) until then.
        until: tokio::time::Instant,
    },
}

enum Outcome {
    Published,
    Failed(PublishError),
    NotAttempted,
}

/// Longest pause between rounds while the broker looks unavailable.
const MAX_OUTAGE_PAUSE: Duration = Duration::from_secs(30);

impl<P: Publisher> Relay<P> {
    /// A relay over the outbox in `pool`'s database — a `PgPool` (run
    /// [`migrate`](crate::migrate) first) or a `SqlitePool` (run
    /// [`migrate_sqlite`](crate::migrate_sqlite) first) — publishing through `publisher`.
    ///
    /// Metric handles are resolved here: install your recorder before.
    pub fn new(pool: impl Into<OutboxPool>, publisher: P, config: RelayConfig) -> Result<Self, RelayError> {
        config.validate().map_err(RelayError::Config)?;
        let metrics = Metrics::new(&config.name);
        Ok(Relay {
            pool: pool.into(),
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
        let mut last_purge = far_past;
        let mut last_metrics = far_past;
        // While the broker looks unavailable, rounds are spaced out (doubling, up to 30 s) and
        // notifications do not shorten the pause.
        let mut outage_pause: Option<Duration> = None;
        loop {
            // Waits for the database (up to the pool's acquire timeout while it is unreachable)
            // give way to shutdown; a round that has its connection finishes.
            if listener.is_none() {
                tokio::select! {
                    biased;
                    () = &mut shutdown => return Ok(()),
                    l = self.listen() => listener = l,
                }
            }
            // Drain: full rounds mean there may be more. Retention and the gauges run between
            // rounds on their schedules, also during a long drain (when the backlog gauges
            // matter most).
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
                    () = self.run_due_upkeep(&mut last_metrics, &mut last_purge) => {}
                }
                self.health.round(
                    result
                        .as_ref()
                        .ok()
                        .map(|round| (round.published, round.broker_unavailable)),
                );
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
                        }
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(relay = %self.config.name, error = %e, "outbox relay round failed; retrying after the poll interval");
                        break;
                    }
                }
                if futures::FutureExt::now_or_never(&mut shutdown).is_some() {
                    return Ok(());
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
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = notified(&mut listener) => {}
                () = tokio::time::sleep(self.config.poll_interval) => {}
            }
        }
    }

    /// Refreshes the gauges and runs retention, each if its interval has passed.
    async fn run_due_upkeep(&self, last_metrics: &mut Instant, last_purge: &mut Instant) {
        if last_metrics.elapsed() >= self.config.metrics_interval {
            *last_metrics = Instant::now();
            if let Err(e) = self.refresh_metrics().await {
                tracing::debug!(relay = %self.config.name, error = %e, "outbox backlog query failed");
            }
        }
        if last_purge.elapsed() >= self.config.retention_interval {
            *last_purge = Instant::now();
            if let Err(e) = self.purge_published().await {
                tracing::warn!(relay = %self.config.name, error = %e, "outbox retention failed; retrying on schedule");
            }
        }
    }

    /// Listens for new rows; `None` on SQLite (no notifications: the relay polls).
    async fn listen(&self) -> Option<Listener> {
        match &self.pool {
            #[cfg(feature = "postgres")]
            OutboxPool::Postgres(pool) => match super::postgres::listen(pool).await {
                Ok(l) => Some(l),
                Err(e) => {
                    tracing::info!(relay = %self.config.name, error = %e, "outbox LISTEN failed; polling every {:?}", self.config.poll_interval);
                    None
                }
            },
            #[cfg(feature = "sqlite")]
            OutboxPool::Sqlite(_) => None,
        }
    }

    /// One round: claim due rows, publish them, mark them. Returns what it did.
    /// Safe to call from several relays at once.
    pub async fn relay_once(&self) -> Result<RelayRound, sqlx::Error> {
        let (rows, claim) = self.claim().await?;
        self.finish(rows, claim).await
    }

    /// Claims due rows. Cancellation-safe: a claim dropped before it returns is rolled back
    /// (on SQLite, dropped between its COMMIT and its return, the rows wait for their lease to
    /// run out).
    async fn claim(&self) -> Result<(Vec<Claimed>, Claim), sqlx::Error> {
        let limit = self.config.batch_size;
        match &self.pool {
            #[cfg(feature = "postgres")]
            OutboxPool::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let rows = super::postgres::claim(&mut tx, limit).await?;
                Ok((rows, Claim::Postgres(tx)))
            }
            #[cfg(feature = "sqlite")]
            OutboxPool::Sqlite(pool) => {
                let now = tokio::time::Instant::now();
                let until = now.checked_add(self.lease()).unwrap_or(now);
                let (rows, token) = super::sqlite::claim(pool, limit, self.lease()).await?;
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
    async fn finish(&self, rows: Vec<Claimed>, claim: Claim) -> Result<RelayRound, sqlx::Error> {
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
                super::postgres::settle(&mut tx, &settlement).await?;
                tx.commit().await?;
            }
            #[cfg(feature = "sqlite")]
            Claim::Sqlite { pool, token, until } => {
                super::sqlite::settle(&pool, &settlement, token, until).await?
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

    /// Deletes published rows older than the retention window, in batches of the configured
    /// size. Returns how many were deleted.
    pub async fn purge_published(&self) -> Result<u64, sqlx::Error> {
        let (retention, batch) = (self.config.retention, self.config.retention_batch);
        let mut total = 0;
        loop {
            let deleted = match &self.pool {
                #[cfg(feature = "postgres")]
                OutboxPool::Postgres(pool) => {
                    super::postgres::purge(pool, retention.as_secs_f64(), batch).await?
                }
                #[cfg(feature = "sqlite")]
                OutboxPool::Sqlite(pool) => super::sqlite::purge_published(pool, retention, batch).await?,
            };
            total += deleted;
            if deleted < self.config.retention_batch as u64 {
                return Ok(total);
            }
        }
    }

    /// Counts pending rows and the age of the oldest, and sets the gauges.
    pub async fn refresh_metrics(&self) -> Result<Backlog, sqlx::Error> {
        let (pending, age) = match &self.pool {
            #[cfg(feature = "postgres")]
            OutboxPool::Postgres(pool) => super::postgres::backlog(pool).await?,
            #[cfg(feature = "sqlite")]
            OutboxPool::Sqlite(pool) => super::sqlite::backlog(pool).await?,
        };
        self.metrics.pending.set(pending as f64);
        self.metrics.oldest_age.set(age);
        Ok(Backlog {
            pending,
            oldest_pending_age: Duration::from_secs_f64(age.max(0.0)),
        })
    }
}

/// A `LISTEN` connection (PostgreSQL only; SQLite has no notifications).
#[cfg(feature = "postgres")]
type Listener = PgListener;
#[cfg(not(feature = "postgres"))]
enum Listener {}

/// Completes on a notification (having read every one queued behind it: one round serves them
/// all) or when the listener fails (it is dropped; the relay listens again). Never without a
/// listener. Cancellation-safe.
///
/// The listener must be read even when the relay is busy or pausing: the server backend of an
/// unread listener blocks on its socket and holds back the server's NOTIFY queue for every
/// database, and once that queue is full every writer's COMMIT fails.
async fn notified(listener: &mut Option<Listener>) {
    let Some(l) = listener.as_mut() else {
        return std::future::pending().await;
    };
    #[cfg(not(feature = "postgres"))]
    match *l {}
    #[cfg(feature = "postgres")]
    match l.recv().await {
        Ok(_) => while l.next_buffered().is_some() {},
        Err(e) => {
            tracing::info!(error = %e, "outbox LISTEN connection lost; polling until it is back");
            *listener = None;
        }
    }
}

/// Reads the notifications already received, without waiting (see [`notified`]).
fn read_queued(listener: &mut Option<Listener>) {
    let Some(l) = listener.as_mut() else { return };
    #[cfg(not(feature = "postgres"))]
    match *l {}
    #[cfg(feature = "postgres")]
    loop {
        match futures::FutureExt::now_or_never(l.try_recv()) {
            Some(Ok(_)) => {}
            Some(Err(_)) => {
                *listener = None;
                return;
            }
            None => return,
        }
    }
}
