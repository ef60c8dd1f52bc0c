//! What the scheduler and every message task share: the configuration in force, the database's
//! health, the adaptive batch size, shutdown and the fatal error.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::health;
use crate::message::{Fingerprint, IdStrategy};
use crate::retry::RetryPolicy;
use crate::source::RetryMode;
use crate::telemetry;

/// How long micro-batching stays off after a batch lost a lock conflict (deadlock,
/// serialization failure, lock timeout) before it grows back.
pub(super) const CONTENTION_COOLDOWN: Duration = Duration::from_secs(5);

/// State shared by the scheduler and every message task.
pub(crate) struct Shared<St, H> {
    pub(crate) name: Arc<str>,
    pub(crate) system: &'static str,
    pub(crate) retry_mode: RetryMode,
    pub(crate) store: St,
    pub(crate) handler: H,
    pub(crate) id_strategy: IdStrategy,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) retry: RetryPolicy,
    pub(crate) max_message_bytes: usize,
    pub(crate) dead_letter_payload_limit: usize,
    pub(super) batch_size: usize,
    /// The batch size in force: `batch_size`, halved by each batch cut by lock contention and
    /// grown back by committed batches (see [`Shared::batch_limit`]).
    pub(super) batch_limit: AtomicUsize,
    /// When a batch was last cut by lock contention, in ms since `started` (0: never).
    pub(super) contended_at: AtomicU64,
    pub(super) started: std::time::Instant,
    pub(super) batch_linger: Duration,
    /// [`ConsumerBuilder::batch_max_duration`](super::ConsumerBuilder::batch_max_duration);
    /// `None` for a batch handler.
    pub(super) batch_max_duration: Option<Duration>,
    /// The handlers' recent pace (see [`Pace`]). Sizes a bounded batch's chunks.
    pub(super) handler_pace: Pace,
    pub(crate) concurrency: Semaphore,
    pub(super) concurrency_limit: usize,
    /// `max_in_flight / concurrency` (at least 1): what the shared queue can hold for each
    /// transaction slot, so the most a "full" batch can wait for (see [`Scheduler::pump`](super::scheduler::Scheduler::pump)).
    pub(super) full_batch: usize,
    /// `false` while the inbox database is unreachable: intake pauses.
    pub(super) healthy: watch::Sender<bool>,
    /// What [`Consumer::health`](super::Consumer::health) reports.
    pub(super) health: Arc<health::State>,
    pub(crate) shutdown: CancellationToken,
    pub(super) fatal: Mutex<Option<Error>>,
    pub(crate) metrics: telemetry::Metrics,
}

impl<St, H> Shared<St, H> {
    pub(crate) fn set_healthy(&self, healthy: bool) {
        self.health.set_database(healthy);
        let changed = self
            .healthy
            .send_if_modified(|h| std::mem::replace(h, healthy) != healthy);
        if changed && healthy {
            tracing::info!(consumer = %self.name, "inbox database reachable again; intake resumes");
        } else if changed {
            tracing::warn!(consumer = %self.name, "inbox database unreachable; intake paused, nothing is acknowledged until it returns");
        }
    }

    pub(super) async fn wait_healthy(&self) {
        let mut rx = self.healthy.subscribe();
        tokio::select! {
            _ = rx.wait_for(|h| *h) => {}
            _ = self.shutdown.cancelled() => {}
        }
    }

    /// Stops the consumer with `error`: intake stops, in-flight work drains.
    pub(crate) fn fail(&self, error: Error) {
        tracing::error!(consumer = %self.name, %error, "stopping consumer");
        self.fatal.lock().unwrap().get_or_insert(error);
        self.shutdown.cancel();
    }

    /// How many messages a batch may hold now. Batches of different lanes whose handlers write
    /// the same rows in different orders deadlock (each costing PostgreSQL's
    /// `deadlock_timeout`, 1 s by default), and the more rows a transaction holds the likelier
    /// that is. So a batch cut by lock contention turns batching off (size 1) for
    /// [`CONTENTION_COOLDOWN`]; after it, every transaction that ends without a lock conflict
    /// (a batch, or a message alone: at size 1 there are no batches) grows the size by an
    /// eighth (at least 1) back up to `batch_size`.
    pub(crate) fn batch_limit(&self) -> usize {
        self.batch_limit.load(Ordering::Relaxed)
    }

    /// Adapts [`batch_limit`](Self::batch_limit) to how a batch, or a message alone, ended.
    pub(crate) fn batch_contended(&self, contended: bool) {
        let now = self.started.elapsed().as_millis() as u64;
        if contended {
            self.contended_at.store(now, Ordering::Relaxed);
            self.batch_limit.store(1, Ordering::Relaxed);
            return;
        }
        let since = now.saturating_sub(self.contended_at.load(Ordering::Relaxed));
        if self.batch_limit() < self.batch_size && since >= CONTENTION_COOLDOWN.as_millis() as u64 {
            let max = self.batch_size;
            let _ = self
                .batch_limit
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some((n + (n / 8).max(1)).min(max))
                });
        }
    }

    /// How many queued messages a task takes for its transactions: the
    /// [`batch_limit`](Self::batch_limit), or fewer when a `batch_max_duration` fits fewer at
    /// the handlers' recent pace. What a bounded batch would not reach then stays queued for
    /// the lane's next task, which on the unordered queue can run beside it.
    pub(super) fn batch_take(&self) -> usize {
        let limit = self.batch_limit();
        let pace = self.handler_pace.get();
        match self.batch_max_duration {
            Some(max) if pace > 0 => {
                let fits = usize::try_from(max.as_nanos() / u128::from(pace)).unwrap_or(usize::MAX);
                limit.min(fits.max(1))
            }
            _ => limit,
        }
    }

    /// How many more messages a batch bounded by its duration claims with `time_left` until the
    /// duration has passed, of `left` not yet claimed and `taken` already claimed: as many as
    /// the handlers' recent pace fits (at least one: the duration has not passed). While no
    /// pace is known (no handler has run yet: a fresh consumer, or a replay of duplicates), as
    /// many as were taken already, at least one: the chunks double, so a batch of duplicates
    /// costs a few claim statements, not one per message.
    pub(super) fn chunk_for(&self, time_left: Duration, left: usize, taken: usize) -> usize {
        let pace = self.handler_pace.get();
        let fits = if pace == 0 {
            taken
        } else {
            usize::try_from(time_left.as_nanos() / u128::from(pace)).unwrap_or(usize::MAX)
        };
        fits.clamp(1, left.max(1))
    }

    /// Records the pace of a bounded batch's handlers: `calls` calls took `total`.
    pub(super) fn note_handler_pace(&self, total: Duration, calls: u32) {
        if calls > 0 {
            let nanos = (total.as_nanos() / u128::from(calls)).clamp(1, u128::from(u64::MAX)) as u64;
            self.handler_pace.note(nanos);
        }
    }

    /// Sleeps `delay`, or returns `false` at once if shutdown starts.
    pub(crate) async fn sleep(&self, delay: Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = self.shutdown.cancelled() => false,
        }
    }
}

/// The handlers' pace: the slowest mean handler call of the last [`Pace::SAMPLES`] bounded
/// batches (or lone calls), in nanoseconds; 0 while none was measured. The slowest, so that a
/// few fast calls (events a handler ignores, returning at once) do not size the next batch of
/// slow ones far past its duration; of the last few only, so that one slow outlier (a cold
/// cache on the first call) is forgotten after a few batches.
#[derive(Debug, Default)]
pub(crate) struct Pace(Mutex<PaceSamples>);

#[derive(Debug, Default)]
struct PaceSamples {
    samples: [u64; Pace::SAMPLES],
    next: usize,
}

impl Pace {
    const SAMPLES: usize = 4;

    pub(super) fn get(&self) -> u64 {
        let samples = self.0.lock().unwrap_or_else(|e| e.into_inner());
        samples.samples.iter().copied().max().unwrap_or(0)
    }

    pub(super) fn note(&self, nanos: u64) {
        let mut samples = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = samples.next;
        samples.samples[i] = nanos;
        samples.next = (i + 1) % Self::SAMPLES;
    }
}
