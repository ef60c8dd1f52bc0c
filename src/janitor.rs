//! Retention that runs itself: a [`Janitor`] deletes the old rows of one table in small batches,
//! pausing between them, on a schedule, until it is told to stop.
//!
//! One mechanism serves every table txinbox lets grow: the consumer's inbox
//! ([`ConsumerBuilder::retention`](crate::ConsumerBuilder::retention)), the outbox's published
//! rows ([`Relay`](crate::outbox::Relay)'s retention) and `txinbox-http`'s expired
//! Idempotency-Key records (`txinbox_http::janitor`). What differs per table is only *which*
//! rows may go, a [`Sweep`]; the loop, its batch size and pause, its metrics and its shutdown
//! are this module's.
//!
//! # A pass
//!
//! [`Sweep::start_pass`] (the inbox records its retention horizon there), then
//! [`Sweep::delete_batch`] until a batch deletes fewer rows than the batch size, with
//! [`Schedule::pause`] between batches; then the oldest row's age is read for the gauge. A pass
//! runs at once when the janitor starts, then every [`Schedule::interval`].
//!
//! # Low priority and short transactions
//!
//! Each batch is one statement in a transaction of its own (autocommit): no lock, snapshot or
//! dead tuple is held across batches, so VACUUM can reclaim what the previous batches deleted
//! while the janitor goes on, and a batch never waits long for, or makes wait, the
//! application's transactions. The pause leaves the database to the application between
//! batches; at most `batch` rows per `pause` (plus the statement's time) are deleted.
//!
//! # Stopping
//!
//! [`Janitor::run`] returns when its [`CancellationToken`] is cancelled: during a pause or the
//! interval at once, otherwise after the statement in flight (a statement is never abandoned
//! midway). A failed pass is logged and tried again after the interval; nothing is lost, the
//! rows are still there.
//!
//! # Metrics
//!
//! | metric | kind | meaning |
//! |---|---|---|
//! | `txinbox_retention_deleted_total` | counter | rows deleted by retention |
//! | `txinbox_retention_oldest_row_age_seconds` | gauge | age of the oldest row retention looks at, read after each pass (0 when none); see each [`Sweep`] for its clock |
//! | `txinbox_retention_batch_duration_seconds` | histogram | time one batch's `DELETE` took |
//!
//! Each carries the label `table` (`inbox`, `outbox`, `http_idempotency`) and its owner's label
//! (`consumer` for the inbox, `relay` for the outbox).

use std::fmt;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use metrics::{Counter, Gauge, Histogram};
use tokio_util::sync::CancellationToken;

use crate::telemetry;

/// Which rows of one table may be deleted, one batch at a time. Implemented for the inbox, the
/// outbox and `txinbox-http`'s idempotency records; a [`Janitor`] runs it.
///
/// # Contract
///
/// - [`delete_batch`](Sweep::delete_batch) is **one short statement** in a transaction of its
///   own that deletes at most `batch` rows and re-checks, on each row it deletes, that the row
///   may still go (a row changed meanwhile by the application is left alone).
/// - Deleting nothing is `Ok(0)`: a pass ends at the first batch that deletes fewer than `batch`.
#[async_trait]
pub trait Sweep: Send + Sync + 'static {
    /// Runs once at the start of each pass, before the first batch: fixes what the pass may
    /// delete (the inbox computes its cutoff from the database's clock and records the
    /// retention horizon). The default does nothing.
    async fn start_pass(&self) -> Result<(), sqlx::Error> {
        Ok(())
    }

    /// Deletes up to `batch` rows that may go, in one statement; returns how many.
    async fn delete_batch(&self, batch: u32) -> Result<u64, sqlx::Error>;

    /// Age of the oldest row retention looks at, by the clock it cuts on (`None` when there is
    /// none), for `txinbox_retention_oldest_row_age_seconds`. It should be an index lookup:
    /// it runs after every pass.
    async fn oldest_age(&self) -> Result<Option<Duration>, sqlx::Error>;
}

/// When and how fast a [`Janitor`] deletes. See [`Schedule::default`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// Time between the end of one pass and the start of the next.
    pub interval: Duration,
    /// Most rows one `DELETE` removes (at least 1).
    pub batch: u32,
    /// Wait between two batches of a pass: what the application gets of the database while a
    /// backlog is deleted.
    pub pause: Duration,
}

/// Default [`Schedule::interval`]: a pass a minute.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);
/// Default [`Schedule::batch`]: 1,000 rows per `DELETE`.
pub const DEFAULT_BATCH: u32 = 1_000;
/// Default [`Schedule::pause`]: 50 ms between batches, so a backlog is deleted at most at about
/// 20,000 rows a second per janitor (fewer as each `DELETE` takes its own time).
pub const DEFAULT_PAUSE: Duration = Duration::from_millis(50);

impl Default for Schedule {
    /// A pass every [`DEFAULT_INTERVAL`], [`DEFAULT_BATCH`] rows per `DELETE`,
    /// [`DEFAULT_PAUSE`] between batches.
    fn default() -> Self {
        Schedule {
            interval: DEFAULT_INTERVAL,
            batch: DEFAULT_BATCH,
            pause: DEFAULT_PAUSE,
        }
    }
}

impl Schedule {
    /// Checks the schedule; the error says what to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.batch == 0 {
            return Err("retention batch must be at least 1 row".into());
        }
        if self.interval.is_zero() {
            return Err("retention interval must be above zero".into());
        }
        Ok(())
    }
}

/// Runs a [`Sweep`] on a [`Schedule`]: see the [module docs](self).
pub struct Janitor {
    sweep: Box<dyn Sweep>,
    schedule: Schedule,
    /// For logs: `inbox of consumer payments`.
    what: String,
    metrics: Metrics,
}

impl fmt::Debug for Janitor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Janitor")
            .field("what", &self.what)
            .field("schedule", &self.schedule)
            .finish_non_exhaustive()
    }
}

impl Janitor {
    /// A janitor running `sweep` on `schedule`. `table` is the metrics' `table` label, `owner`
    /// an optional second label (`("consumer", name)`, `("relay", name)`). Metric handles are
    /// resolved here: install your recorder before.
    pub fn new(
        sweep: impl Sweep,
        schedule: Schedule,
        table: &'static str,
        owner: Option<(&'static str, &str)>,
    ) -> Result<Self, String> {
        schedule.validate()?;
        let what = match owner {
            Some((label, name)) => format!("{table} of {label} {name}"),
            None => table.to_owned(),
        };
        Ok(Janitor {
            sweep: Box::new(sweep),
            schedule,
            what,
            metrics: Metrics::new(table, owner),
        })
    }

    /// The schedule it runs on.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// One pass now: [`Sweep::start_pass`], then batches until one deletes fewer than the
    /// batch size, pausing between them; then the oldest-row gauge. Returns how many rows it
    /// deleted. What `txinbox purge`-like commands and tests call; [`run`](Self::run) repeats it.
    pub async fn pass(&self) -> Result<u64, sqlx::Error> {
        self.pass_until(&CancellationToken::new()).await
    }

    /// [`pass`](Self::pass), stopping early, between two batches, once `stop` is cancelled.
    async fn pass_until(&self, stop: &CancellationToken) -> Result<u64, sqlx::Error> {
        if stop.is_cancelled() {
            return Ok(0);
        }
        self.sweep.start_pass().await?;
        let mut total = 0;
        loop {
            let started = Instant::now();
            let deleted = self.sweep.delete_batch(self.schedule.batch).await?;
            self.metrics.batch_duration.record(started.elapsed());
            self.metrics.deleted.increment(deleted);
            total += deleted;
            if deleted < u64::from(self.schedule.batch) {
                break;
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => break,
                () = tokio::time::sleep(self.schedule.pause) => {}
            }
        }
        match self.sweep.oldest_age().await {
            Ok(age) => self.metrics.oldest_age.set(age.unwrap_or_default().as_secs_f64()),
            Err(e) => {
                tracing::debug!(janitor = %self.what, error = %e, "reading the oldest row's age failed")
            }
        }
        Ok(total)
    }

    /// Runs a pass now and then every [`Schedule::interval`] until `stop` is cancelled (see
    /// [Stopping](self#stopping)). A failed pass is logged and tried again after the interval.
    pub async fn run(&self, stop: CancellationToken) {
        loop {
            match self.pass_until(&stop).await {
                Ok(0) => {}
                Ok(deleted) => tracing::debug!(janitor = %self.what, deleted, "retention pass done"),
                // Counted either way: a janitor that keeps failing (a pool too small for it, a
                // database away for long) lets the table grow, and the oldest-row gauge keeps
                // its last value meanwhile; alert on this counter.
                Err(e) if crate::store::is_unavailable(&e) => {
                    self.metrics.failed.increment(1);
                    tracing::info!(janitor = %self.what, error = %e, "retention pass found the database unavailable; trying again after the interval")
                }
                Err(e) => {
                    self.metrics.failed.increment(1);
                    tracing::warn!(janitor = %self.what, error = %e, "retention pass failed; trying again after the interval")
                }
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => return,
                () = tokio::time::sleep(self.schedule.interval) => {}
            }
        }
    }

    /// [`run`](Self::run) on a task of its own, stopped and awaited by the returned
    /// [`Running`] (or aborted when it is dropped).
    pub fn spawn(self: std::sync::Arc<Self>) -> Running {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move { self.run(token).await });
        Running {
            stop,
            task: Some(task),
        }
    }
}

/// A janitor running on its own task ([`Janitor::spawn`]). [`stop`](Running::stop) ends it
/// gracefully; dropping it aborts the task (a statement in flight is then dropped: it commits
/// or not, on its own).
#[derive(Debug)]
pub struct Running {
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Tells the janitor to stop and waits until it has: after the statement in flight, if
    /// any.
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

struct Metrics {
    deleted: Counter,
    oldest_age: Gauge,
    batch_duration: Histogram,
    failed: Counter,
}

impl Metrics {
    fn new(table: &'static str, owner: Option<(&'static str, &str)>) -> Self {
        telemetry::describe_retention();
        let labels = || {
            let mut labels = vec![("table", table.to_owned())];
            if let Some((label, name)) = owner {
                labels.push((label, name.to_owned()));
            }
            labels
        };
        Metrics {
            deleted: metrics::counter!(telemetry::RETENTION_DELETED, &labels()),
            oldest_age: metrics::gauge!(telemetry::RETENTION_OLDEST_ROW_AGE, &labels()),
            batch_duration: metrics::histogram!(telemetry::RETENTION_BATCH_DURATION, &labels()),
            failed: metrics::counter!(telemetry::RETENTION_FAILED_PASSES, &labels()),
        }
    }
}
