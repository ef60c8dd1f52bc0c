//! How a [`Consumer`] is configured: [`ConsumerBuilder`], its defaults, and the checks
//! [`ConsumerBuilder::build`] runs before anything starts.

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;

use super::retention::Retention;
use super::shared::{Shared, CONTENTION_COOLDOWN};
use super::Consumer;
use crate::error::Error;
use crate::handler::Handler;
use crate::health;
use crate::message::{Fingerprint, IdStrategy};
use crate::position::{ConsumerPositions, PositionStore};
use crate::retry::RetryPolicy;
use crate::source::MessageSource;
use crate::store::{InboxStore, StoreError};
use crate::telemetry;

/// Default for [`ConsumerBuilder::concurrency`].
pub const DEFAULT_CONCURRENCY: usize = 8;
/// Default for [`ConsumerBuilder::max_in_flight`]: two full batches per concurrent transaction
/// (2 × [`DEFAULT_CONCURRENCY`] × [`DEFAULT_BATCH_SIZE`], rounded up), one committing and one
/// waiting, so a transaction that finishes finds a full batch queued. With room for only one
/// batch each, the queue runs dry whenever transactions finish together and the next ones
/// start with a few messages. Measured with the benchmark (300,000 messages): 3,652
/// transactions at 1024, 407 of them for a lone message; 3,019 at 2048, 16 of them lone.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 2048;
/// Default for [`ConsumerBuilder::max_message_bytes`]: 1 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1024 * 1024;
/// Default for [`ConsumerBuilder::batch_size`]: up to 100 messages share one transaction.
pub const DEFAULT_BATCH_SIZE: usize = 100;

/// Default for [`ConsumerBuilder::batch_linger`]: zero, a batch is what is already queued.
pub const DEFAULT_BATCH_LINGER: Duration = Duration::ZERO;

/// Default for [`ConsumerBuilder::batch_max_duration`]: none, a batch takes up to
/// [`batch_size`](ConsumerBuilder::batch_size) messages however long their handlers take.
pub const DEFAULT_BATCH_MAX_DURATION: Option<Duration> = None;

/// Configuration and wiring for a [`Consumer`]; see [`Consumer::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until .build()"]
pub struct ConsumerBuilder<Src = (), St = (), H = ()> {
    name: String,
    retention: Option<Retention>,
    source: Src,
    inbox: St,
    handler: H,
    id_strategy: Option<IdStrategy>,
    fingerprint: Fingerprint,
    retry: RetryPolicy,
    concurrency: usize,
    max_in_flight: usize,
    max_message_bytes: usize,
    dead_letter_payload_limit: Option<usize>,
    batch_size: usize,
    batch_linger: Duration,
    batch_max_duration: Option<Duration>,
    track_lanes: bool,
}

impl Consumer<(), (), ()> {
    /// Starts building a consumer called `name`.
    ///
    /// The name is half of every inbox key: two consumers with different names process the
    /// same message independently; instances of one service must share a name. It is stored as
    /// data, never interpolated into SQL: 1 to 128 characters of `A-Z a-z 0-9 . _ - :`.
    pub fn builder(name: impl Into<String>) -> ConsumerBuilder {
        ConsumerBuilder {
            name: name.into(),
            retention: None,
            source: (),
            inbox: (),
            handler: (),
            id_strategy: None,
            fingerprint: Fingerprint::default(),
            retry: RetryPolicy::default(),
            concurrency: DEFAULT_CONCURRENCY,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            dead_letter_payload_limit: None,
            batch_size: DEFAULT_BATCH_SIZE,
            batch_linger: DEFAULT_BATCH_LINGER,
            batch_max_duration: DEFAULT_BATCH_MAX_DURATION,
            track_lanes: true,
        }
    }
}

impl<Src, St, H> ConsumerBuilder<Src, St, H> {
    /// Where messages come from.
    pub fn source<S2: MessageSource>(self, source: S2) -> ConsumerBuilder<S2, St, H> {
        ConsumerBuilder {
            name: self.name,
            retention: self.retention,
            source,
            inbox: self.inbox,
            handler: self.handler,
            id_strategy: self.id_strategy,
            fingerprint: self.fingerprint,
            retry: self.retry,
            concurrency: self.concurrency,
            max_in_flight: self.max_in_flight,
            max_message_bytes: self.max_message_bytes,
            dead_letter_payload_limit: self.dead_letter_payload_limit,
            batch_size: self.batch_size,
            batch_linger: self.batch_linger,
            batch_max_duration: self.batch_max_duration,
            track_lanes: self.track_lanes,
        }
    }

    /// Where the inbox lives (and where the handler's effects are written).
    pub fn inbox<S2: InboxStore>(self, inbox: S2) -> ConsumerBuilder<Src, S2, H> {
        ConsumerBuilder {
            name: self.name,
            retention: self.retention,
            source: self.source,
            inbox,
            handler: self.handler,
            id_strategy: self.id_strategy,
            fingerprint: self.fingerprint,
            retry: self.retry,
            concurrency: self.concurrency,
            max_in_flight: self.max_in_flight,
            max_message_bytes: self.max_message_bytes,
            dead_letter_payload_limit: self.dead_letter_payload_limit,
            batch_size: self.batch_size,
            batch_linger: self.batch_linger,
            batch_max_duration: self.batch_max_duration,
            track_lanes: self.track_lanes,
        }
    }

    /// The user code run for every new message.
    pub fn handler<H2>(self, handler: H2) -> ConsumerBuilder<Src, St, H2> {
        ConsumerBuilder {
            name: self.name,
            retention: self.retention,
            source: self.source,
            inbox: self.inbox,
            handler,
            id_strategy: self.id_strategy,
            fingerprint: self.fingerprint,
            retry: self.retry,
            concurrency: self.concurrency,
            max_in_flight: self.max_in_flight,
            max_message_bytes: self.max_message_bytes,
            dead_letter_payload_limit: self.dead_letter_payload_limit,
            batch_size: self.batch_size,
            batch_linger: self.batch_linger,
            batch_max_duration: self.batch_max_duration,
            track_lanes: self.track_lanes,
        }
    }

    /// How message IDs are derived. Default: the source's
    /// [`default_id_strategy`](crate::source::Capabilities::default_id_strategy).
    pub fn id_strategy(mut self, strategy: IdStrategy) -> Self {
        self.id_strategy = Some(strategy);
        self
    }

    /// How payload fingerprints are computed. Default: SHA-256 of the bytes.
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// Retry schedule for transient handler failures. Default: [`RetryPolicy::default`].
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How many messages are processed at the same time (each holds one database connection).
    /// Must not exceed the pool's `max_connections`. Default: 8.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }

    /// How many deliveries may be received and not yet settled; intake waits beyond it.
    /// Default: 2048. Batches are taken from what is received, so keep it near
    /// `2 × concurrency × batch_size` for full batches (see [`DEFAULT_MAX_IN_FLIGHT`]).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Most messages of one lane that share a transaction (micro-batching). A task takes what
    /// is already queued for its lane, up to this many; `1` turns batching off. Default: 100.
    ///
    /// A batch is processed as if its messages ran one at a time in lane order: one batched
    /// inbox claim, the handler for each new message (or [`BatchHandler`](crate::handler::BatchHandler)
    /// once for all of them), one position, one COMMIT, then every delivery is settled. If a
    /// message needs the one-message path (its handler failed, a conflict, a redelivered dead
    /// letter), the batch is rolled back and re-run without it: the messages before it as a
    /// batch, it alone (where its attempt counts, retries or dead-letters), then the rest. If
    /// the culprit cannot be known (the check before COMMIT or the COMMIT failed, a batch
    /// handler failed), each message of the batch runs alone.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// How long a lane with fewer than [`batch_size`](Self::batch_size) queued messages waits
    /// for more before its transaction starts. Default: zero: batches form from what queues up
    /// while the previous transaction of the lane commits, and a lone message is never delayed.
    pub fn batch_linger(mut self, linger: Duration) -> Self {
        self.batch_linger = linger;
        self
    }

    /// How long a batch's transaction may run before it takes no more messages: for handlers
    /// that wait on slow I/O, whose batches would otherwise hold a transaction, a connection
    /// and every message's acknowledgement for `batch_size` handler runs. Default: none
    /// ([`DEFAULT_BATCH_MAX_DURATION`]).
    ///
    /// The contract: a batch claims no message once this long has passed since its
    /// transaction began; it commits the messages it took, and the lane's next transaction
    /// takes the rest, in order. Messages are claimed in chunks sized to the time left at the
    /// pace of the latest batch's handlers (one message while no pace is known), so a batch
    /// runs past the duration by at most its last chunk, and by more only if its handlers
    /// become slower than they were. Each chunk after the first costs one more claim
    /// statement; with fast handlers the first chunk is the whole batch. A task also takes
    /// from the queue only as many messages as the duration fits at that pace, so on the
    /// unordered queue the rest start in other transactions beside it (up to
    /// [`concurrency`](Self::concurrency)) instead of after it. It bounds batches of
    /// a per-message [`Handler`]; a [`BatchHandler`](crate::handler::BatchHandler) receives
    /// its batch in one call, which nothing interrupts.
    pub fn batch_max_duration(mut self, max: Duration) -> Self {
        self.batch_max_duration = Some(max);
        self
    }

    /// Not part of the API: turns off the per-lane health tracking (what
    /// [`HealthReport::lanes`](crate::health::HealthReport::lanes) and the lane gauges show,
    /// one short lock when a delivery is received and one when it is settled), so that the
    /// benchmark can measure what that tracking costs. A report then lists no lane and none
    /// is ever stalled.
    #[doc(hidden)]
    pub fn untracked_lanes_for_benchmarks(mut self) -> Self {
        self.track_lanes = false;
        self
    }

    /// Largest accepted payload plus headers, in bytes. Larger messages are dead-lettered with
    /// reason `too_large` without running the handler, and without reading the payload (an ID
    /// strategy that needs it, such as a JSON pointer, finds no ID). Default: 1 MiB.
    pub fn max_message_bytes(mut self, n: usize) -> Self {
        self.max_message_bytes = n;
        self
    }

    /// Most bytes of a dead letter's payload, and of its headers, stored in the database's
    /// `dead_letters` table; the rest is cut, and the row records the payload's full size and
    /// SHA-256 and that it was cut (such a dead letter cannot be requeued from the database;
    /// the original stays in the broker until its retention). Default:
    /// [`max_message_bytes`](Self::max_message_bytes), so every message the consumer accepts
    /// is stored whole and only `too_large` ones are cut.
    pub fn dead_letter_payload_limit(mut self, n: usize) -> Self {
        self.dead_letter_payload_limit = Some(n);
        self
    }

    /// Purges the inbox while the consumer runs: terminal rows older than the window are
    /// deleted in small batches by a task that starts and stops with the consumer (see
    /// [`Retention`] and [`janitor`](crate::janitor)). Off by default: an ID purged no longer
    /// deduplicates, so the window is a decision about the broker's retention and redelivery
    /// horizon that only the application can make; `txinbox purge` does the same on demand.
    /// A window under the dedup window (7 days) is refused by [`build`](Self::build) unless
    /// [`Retention::force`]d. Needs one of txinbox's stores.
    pub fn retention(mut self, retention: impl Into<Retention>) -> Self {
        self.retention = Some(retention.into());
        self
    }
}

impl<Src, St, H> ConsumerBuilder<Src, St, H>
where
    Src: MessageSource,
    St: InboxStore,
    H: Handler<St::Db>,
{
    /// Validates the configuration and builds the consumer.
    pub fn build(self) -> Result<Consumer<Src, St, H>, Error> {
        validate_name(&self.name).map_err(Error::Config)?;
        let caps = self.source.capabilities();
        let id_strategy = self.id_strategy.unwrap_or(caps.default_id_strategy);
        id_strategy.validate().map_err(Error::Config)?;
        self.retry.validate().map_err(Error::Config)?;
        if self.concurrency == 0 {
            return Err(Error::Config("concurrency must be at least 1".into()));
        }
        if let Some(max) = self.inbox.max_connections() {
            if self.concurrency > max as usize {
                return Err(Error::Config(format!(
                    "concurrency ({}) exceeds the database pool's max_connections ({max}): every \
                     message in progress holds a connection; raise max_connections or lower concurrency",
                    self.concurrency
                )));
            }
        }
        if self.max_in_flight < self.concurrency {
            return Err(Error::Config(format!(
                "max_in_flight ({}) must be at least concurrency ({})",
                self.max_in_flight, self.concurrency
            )));
        }
        if self.batch_size == 0 {
            return Err(Error::Config(
                "batch_size must be at least 1 (1 turns micro-batching off)".into(),
            ));
        }
        if self
            .batch_max_duration
            .is_some_and(|d| d < Duration::from_millis(1))
        {
            return Err(Error::Config(
                "batch_max_duration must be at least 1 ms (a shorter one would bound every batch to one message: batch_size 1 says that)".into(),
            ));
        }
        // A batch handler receives its batch in one call, which nothing interrupts: the bound
        // neither cuts nor sizes its batches (nor does a lone message's pace shrink them).
        let batch_max_duration = self.batch_max_duration.filter(|_| self.handler.batch().is_none());
        if self.max_message_bytes == 0 {
            return Err(Error::Config("max_message_bytes must be at least 1".into()));
        }
        let janitor = match self.retention {
            Some(retention) => Some(retention.janitor(&self.name, &self.inbox)?),
            None => None,
        };
        let (healthy, _) = watch::channel(true);
        let name: Arc<str> = self.name.into();
        let health = Arc::new(health::State::new(name.clone(), self.track_lanes));
        let shared = Arc::new(Shared {
            metrics: telemetry::Metrics::new(&name),
            name: name.clone(),
            system: caps.system,
            retry_mode: caps.retry,
            store: self.inbox,
            handler: self.handler,
            id_strategy,
            fingerprint: self.fingerprint,
            retry: self.retry,
            max_message_bytes: self.max_message_bytes,
            dead_letter_payload_limit: self.dead_letter_payload_limit.unwrap_or(self.max_message_bytes),
            batch_size: self.batch_size,
            batch_limit: AtomicUsize::new(self.batch_size),
            contended_at: AtomicU64::new(0),
            started: std::time::Instant::now() - CONTENTION_COOLDOWN,
            batch_linger: self.batch_linger,
            batch_max_duration,
            handler_pace: Default::default(),
            concurrency: Semaphore::new(self.concurrency),
            concurrency_limit: self.concurrency,
            full_batch: (self.max_in_flight / self.concurrency).max(1),
            healthy,
            health: health.clone(),
            shutdown: CancellationToken::new(),
            fatal: Mutex::new(None),
        });
        // The hand-over: the source learns whose positions it reads, and where, from the
        // consumer itself, so the two cannot name different consumers.
        let mut source = self.source;
        source.attach_health(health.source.clone());
        source.attach_positions(ConsumerPositions::new(name, InboxPositions(shared.clone())));
        Ok(Consumer {
            source,
            max_in_flight: self.max_in_flight,
            shared,
            janitor,
        })
    }
}

/// The consumer's inbox store as the [`PositionStore`] its source reads: the store lives in
/// [`Shared`], so the source shares it rather than a copy.
struct InboxPositions<St, H>(Arc<Shared<St, H>>);

#[async_trait]
impl<St, H> PositionStore for InboxPositions<St, H>
where
    St: InboxStore,
    H: Send + Sync + 'static,
{
    async fn load(&self, consumer: &str, source: &str) -> Result<Vec<(String, i64)>, StoreError> {
        self.0.store.load_positions(consumer, source).await
    }

    async fn record_subscription(
        &self,
        consumer: &str,
        system: &str,
        source: &str,
        subscription: &str,
    ) -> Result<Option<String>, StoreError> {
        self.0
            .store
            .record_subscription(consumer, system, source, subscription)
            .await
    }

    async fn advance(&self, consumer: &str, position: &crate::position::Position) -> Result<(), StoreError> {
        PositionStore::advance(&self.0.store, consumer, position).await
    }
}

fn validate_name(name: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':');
    if name.is_empty() || name.len() > 128 {
        return Err(format!(
            "consumer name must be 1 to 128 characters long, got {}",
            name.len()
        ));
    }
    if let Some(bad) = name.chars().find(|c| !ok_char(*c)) {
        return Err(format!(
            "consumer name {name:?} contains {bad:?}; use only A-Z a-z 0-9 . _ - :"
        ));
    }
    Ok(())
}
