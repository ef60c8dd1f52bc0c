//! [`Relay`]: publishes committed outbox rows through a [`Publisher`] and marks them.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use metrics::{Counter, Gauge};
use sqlx::postgres::{PgListener, PgPool};
use sqlx::Row;

use super::{OutboxMessage, PublishError, Publisher, NOTIFY_CHANNEL};
use crate::message::Headers;
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
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Longest wait for one broker confirmation before it counts as a failed attempt, and
    /// how long a round keeps starting new publishes (rows not started by then wait for the
    /// next round, no attempt counted). Default 20 s. The claim transaction stays open while
    /// publishing — up to twice this — so keep twice this below the pool's
    /// `idle_in_transaction_session_timeout` (60 s with `PostgresInbox::connect_options`).
    /// A round the server cuts off is not lost: its rows are published again.
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
pub struct Relay<P> {
    pool: PgPool,
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

struct Claimed {
    id: i64,
    attempts: i32,
    message: OutboxMessage,
}

enum Outcome {
    Published,
    Failed(PublishError),
    NotAttempted,
}

const CLAIM_HEADS: &str = "\
SELECT o.id, o.attempts, o.message_id, o.destination, o.message_key, o.payload, o.header_names, o.header_values
FROM txinbox.outbox o
WHERE o.status = 'pending' AND o.next_attempt_at <= now()
  AND (o.message_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM txinbox.outbox p
        WHERE p.status = 'pending' AND p.destination = o.destination
          AND p.message_key = o.message_key AND p.id < o.id))
ORDER BY o.id
LIMIT $1
FOR UPDATE OF o SKIP LOCKED";

// The later rows of keys whose head this transaction holds. Nobody else can hold them: another
// relay would have to hold their head first. (`FOR UPDATE` re-checks `status` if a row changed.)
// This statement sees a newer snapshot than the head claim: a row with a lower ID than the head
// may have committed since (IDs are taken at insert, not commit). Then the head is not the
// key's oldest pending row any more, and the key gets no followers this round — otherwise rows
// written after that late row committed would be published before it.
const CLAIM_FOLLOWERS: &str = "\
SELECT o.id, o.attempts, o.message_id, o.destination, o.message_key, o.payload, o.header_names, o.header_values
FROM txinbox.outbox o
JOIN unnest($1::text[], $2::bytea[], $3::bigint[]) AS h(destination, message_key, head)
  ON o.destination = h.destination AND o.message_key = h.message_key AND o.id > h.head
WHERE o.status = 'pending'
  AND NOT EXISTS (
        SELECT 1 FROM txinbox.outbox p
        WHERE p.status = 'pending' AND p.destination = h.destination
          AND p.message_key = h.message_key AND p.id < h.head)
ORDER BY o.id
LIMIT $4
FOR UPDATE OF o";

const MARK_PUBLISHED: &str = "\
UPDATE txinbox.outbox
SET status = 'published', published_at = now(), attempts = attempts + 1, last_error = NULL
WHERE id = ANY($1)";

const MARK_FAILED: &str = "\
UPDATE txinbox.outbox
SET attempts = attempts + 1, last_error = $2,
    next_attempt_at = now() + make_interval(secs => $3),
    status = CASE WHEN $4 THEN 'dead_lettered' ELSE 'pending' END
WHERE id = $1";

const PURGE: &str = "\
DELETE FROM txinbox.outbox WHERE id IN (
    SELECT id FROM txinbox.outbox
    WHERE status = 'published' AND published_at < now() - make_interval(secs => $1)
    ORDER BY published_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED)";

const BACKLOG: &str = "\
SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at))::float8, 0)
FROM txinbox.outbox WHERE status = 'pending'";

/// Longest pause between rounds while the broker looks unavailable.
const MAX_OUTAGE_PAUSE: Duration = Duration::from_secs(30);

impl<P: Publisher> Relay<P> {
    /// A relay over the outbox in `pool`'s database (run [`migrate`](crate::migrate) first),
    /// publishing through `publisher`.
    ///
    /// Metric handles are resolved here: install your recorder before.
    pub fn new(pool: PgPool, publisher: P, config: RelayConfig) -> Result<Self, RelayError> {
        config.validate().map_err(RelayError::Config)?;
        let metrics = Metrics::new(&config.name);
        Ok(Relay {
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
        let mut listener: Option<PgListener> = None;
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
                    tx = self.pool.begin() => match tx {
                        Ok(tx) => self.round(tx).await,
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

    async fn listen(&self) -> Option<PgListener> {
        let result = async {
            let mut l = PgListener::connect_with(&self.pool).await?;
            l.listen(NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(l)
        }
        .await;
        match result {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::info!(relay = %self.config.name, error = %e, "outbox LISTEN failed; polling every {:?}", self.config.poll_interval);
                None
            }
        }
    }

    /// One round: claim due rows, publish them, mark them, commit. Returns what it did.
    /// Safe to call from several relays at once.
    pub async fn relay_once(&self) -> Result<RelayRound, sqlx::Error> {
        self.round(self.pool.begin().await?).await
    }

    async fn round(
        &self,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    ) -> Result<RelayRound, sqlx::Error> {
        let mut rows = sqlx::query(CLAIM_HEADS)
            .bind(self.config.batch_size as i64)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .map(claimed)
            .collect::<Result<Vec<_>, _>>()?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(RelayRound::default());
        }
        let room = self.config.batch_size.saturating_sub(rows.len());
        let keyed: Vec<&Claimed> = rows.iter().filter(|r| r.message.key.is_some()).collect();
        if room > 0 && !keyed.is_empty() {
            let destinations: Vec<&str> = keyed.iter().map(|r| r.message.destination.as_str()).collect();
            let keys: Vec<&[u8]> = keyed
                .iter()
                .map(|r| r.message.key.as_deref().unwrap_or_default())
                .collect();
            let heads: Vec<i64> = keyed.iter().map(|r| r.id).collect();
            let followers = sqlx::query(CLAIM_FOLLOWERS)
                .bind(destinations)
                .bind(keys)
                .bind(heads)
                .bind(room as i64)
                .fetch_all(&mut *tx)
                .await?;
            for row in followers {
                rows.push(claimed(row)?);
            }
        }
        rows.sort_by_key(|r| r.id);

        let outcomes = self.publish_all(&rows).await;
        let mut round = RelayRound {
            claimed: rows.len(),
            ..RelayRound::default()
        };
        let published: Vec<i64> = rows
            .iter()
            .zip(&outcomes)
            .filter(|(_, o)| matches!(o, Outcome::Published))
            .map(|(r, _)| r.id)
            .collect();
        if !published.is_empty() {
            crate::crash::hit(crate::crash::RELAY_PUBLISHED);
            sqlx::query(MARK_PUBLISHED)
                .bind(&published)
                .execute(&mut *tx)
                .await?;
        }
        let failures: Vec<&PublishError> = outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Failed(e) => Some(e),
                _ => None,
            })
            .collect();
        // A broker outage is not the rows' fault: it must not burn their attempts (and
        // dead-letter every key's head after a long outage). One failing row alone is counted.
        round.broker_unavailable =
            published.is_empty() && failures.len() >= 2 && failures.iter().all(|e| !e.is_permanent());
        if round.broker_unavailable {
            tracing::warn!(relay = %self.config.name, failed = failures.len(), error = %failures[0],
                "every publish of the round failed; is the broker unavailable? attempts not counted");
        }
        for (row, outcome) in rows.iter().zip(&outcomes) {
            let Outcome::Failed(e) = outcome else { continue };
            if round.broker_unavailable {
                round.failed += 1;
                continue;
            }
            let attempt = row.attempts.max(0) as u32 + 1;
            let dead = e.is_permanent() || self.config.retry.exhausted(attempt);
            let delay = self.config.retry.delay(attempt, None);
            sqlx::query(MARK_FAILED)
                .bind(row.id)
                .bind(crate::store::clean_text(&e.to_string()))
                .bind(delay.as_secs_f64())
                .bind(dead)
                .execute(&mut *tx)
                .await?;
            round.failed += 1;
            if dead {
                round.dead_lettered += 1;
                tracing::error!(relay = %self.config.name, message_id = %row.message.message_id, attempt, error = %e,
                    "outbox row dead-lettered; later rows of its key are published now");
            } else {
                tracing::warn!(relay = %self.config.name, message_id = %row.message.message_id, attempt, error = %e,
                    retry_in = ?delay, "outbox publish failed; retrying");
            }
        }
        tx.commit().await?;
        round.published = published.len();
        self.metrics.published.increment(round.published as u64);
        self.metrics.failures.increment(round.failed as u64);
        self.metrics.dead_letters.increment(round.dead_lettered as u64);
        Ok(round)
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
        let mut total = 0;
        loop {
            let deleted = sqlx::query(PURGE)
                .bind(self.config.retention.as_secs_f64())
                .bind(self.config.retention_batch as i64)
                .execute(&self.pool)
                .await?
                .rows_affected();
            total += deleted;
            if deleted < self.config.retention_batch as u64 {
                return Ok(total);
            }
        }
    }

    /// Counts pending rows and the age of the oldest, and sets the gauges.
    pub async fn refresh_metrics(&self) -> Result<Backlog, sqlx::Error> {
        let (pending, age): (i64, f64) = sqlx::query_as(BACKLOG).fetch_one(&self.pool).await?;
        self.metrics.pending.set(pending as f64);
        self.metrics.oldest_age.set(age);
        Ok(Backlog {
            pending,
            oldest_pending_age: Duration::from_secs_f64(age.max(0.0)),
        })
    }
}

/// Completes on a notification (having read every one queued behind it: one round serves them
/// all) or when the listener fails (it is dropped; the relay listens again). Never without a
/// listener. Cancellation-safe.
///
/// The listener must be read even when the relay is busy or pausing: the server backend of an
/// unread listener blocks on its socket and holds back the server's NOTIFY queue for every
/// database, and once that queue is full every writer's COMMIT fails.
async fn notified(listener: &mut Option<PgListener>) {
    let Some(l) = listener.as_mut() else {
        return std::future::pending().await;
    };
    match l.recv().await {
        Ok(_) => while l.next_buffered().is_some() {},
        Err(e) => {
            tracing::info!(error = %e, "outbox LISTEN connection lost; polling until it is back");
            *listener = None;
        }
    }
}

/// Reads the notifications already received, without waiting (see [`notified`]).
fn read_queued(listener: &mut Option<PgListener>) {
    let Some(l) = listener.as_mut() else { return };
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

fn claimed(row: sqlx::postgres::PgRow) -> Result<Claimed, sqlx::Error> {
    let names: Vec<String> = row.try_get("header_names")?;
    let values: Vec<Vec<u8>> = row.try_get("header_values")?;
    let mut headers = Headers::new();
    for (n, v) in names.into_iter().zip(values) {
        headers.insert(n, v);
    }
    let key: Option<Vec<u8>> = row.try_get("message_key")?;
    let payload: Vec<u8> = row.try_get("payload")?;
    Ok(Claimed {
        id: row.try_get("id")?,
        attempts: row.try_get("attempts")?,
        message: OutboxMessage {
            message_id: row.try_get("message_id")?,
            destination: row.try_get("destination")?,
            key: key.map(Bytes::from),
            payload: Bytes::from(payload),
            headers,
        },
    })
}
