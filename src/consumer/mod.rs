//! The runtime: [`Consumer`] pulls deliveries, runs each through the inbox pipeline
//! ([`single`]) and settles it.
//!
//! Scheduling: one intake task calls [`MessageSource::receive`] while fewer than
//! `max_in_flight` deliveries are unsettled and the database is healthy. The scheduler queues
//! deliveries per [`Lane::Ordered`] lane and runs one task per lane at a time, so a lane is
//! processed in receive order while different lanes run concurrently. [`Lane::Unordered`]
//! deliveries share one queue served by up to `concurrency` tasks. At most `concurrency`
//! transactions are open at once (a semaphore).
//!
//! Micro-batching: a task takes what is already queued for its lane, up to `batch_size`
//! deliveries, and processes them in one transaction ([`single::process_batch`]). With a
//! `batch_linger`, a lane with fewer queued waits up to that long for more before it starts.
//! Under load a lane's queue fills while its previous transaction commits, so batches form by
//! themselves; an idle consumer sends a lone message at once.

mod single;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::handler::Handler;
use crate::health::{self, Health};
use crate::message::{Fingerprint, IdStrategy};
use crate::retry::{backoff_ceiling, RetryPolicy};
use crate::source::{Lane, MessageSource, RetryMode, SourceError};
use crate::store::InboxStore;
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
/// How long micro-batching stays off after a batch lost a lock conflict (deadlock,
/// serialization failure, lock timeout) before it grows back.
const CONTENTION_COOLDOWN: Duration = Duration::from_secs(5);
/// How long queued unordered messages wait for a running transaction to end (and take them)
/// before another transaction starts with less than a full batch (see [`Scheduler::pump`]).
const FULL_BATCH_WAIT: Duration = Duration::from_millis(10);
/// Default for [`ConsumerBuilder::batch_linger`]: zero, a batch is what is already queued.
pub const DEFAULT_BATCH_LINGER: Duration = Duration::ZERO;

/// A consumer: one source, one inbox store, one handler.
///
/// Built with [`Consumer::builder`], started with [`Consumer::run`] or
/// [`Consumer::run_until`].
pub struct Consumer<Src, St, H> {
    source: Src,
    shared: Arc<Shared<St, H>>,
    max_in_flight: usize,
}

impl<Src, St, H> std::fmt::Debug for Consumer<Src, St, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("name", &self.shared.name)
            .field("system", &self.shared.system)
            .field("id_strategy", &self.shared.id_strategy)
            .field("concurrency", &self.shared.concurrency_limit)
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

/// Configuration and wiring for a [`Consumer`]; see [`Consumer::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until .build()"]
pub struct ConsumerBuilder<Src = (), St = (), H = ()> {
    name: String,
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
        }
    }
}

impl<Src, St, H> ConsumerBuilder<Src, St, H> {
    /// Where messages come from.
    pub fn source<S2: MessageSource>(self, source: S2) -> ConsumerBuilder<S2, St, H> {
        ConsumerBuilder {
            name: self.name,
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
        }
    }

    /// Where the inbox lives (and where the handler's effects are written).
    pub fn inbox<S2: InboxStore>(self, inbox: S2) -> ConsumerBuilder<Src, S2, H> {
        ConsumerBuilder {
            name: self.name,
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
        }
    }

    /// The user code run for every new message.
    pub fn handler<H2>(self, handler: H2) -> ConsumerBuilder<Src, St, H2> {
        ConsumerBuilder {
            name: self.name,
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
        }
    }

    /// How message IDs are derived. Default: the source's
    /// [`default_id_strategy`](crate::Capabilities::default_id_strategy).
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
    /// inbox claim, the handler for each new message (or [`BatchHandler`](crate::BatchHandler)
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
        if let Some(theirs) = self.source.positions_consumer() {
            if theirs != self.name {
                return Err(Error::Config(format!(
                    "the source reads positions stored by consumer {theirs:?}, but this consumer is {:?} \
                     and stores them under its own name: the source would never find them, and every \
                     restart would start from the broker's offsets. Give both the same name (for \
                     Kafka: KafkaConfig::new's consumer_name and Consumer::builder's name)",
                    self.name
                )));
            }
        }
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
        if self.max_message_bytes == 0 {
            return Err(Error::Config("max_message_bytes must be at least 1".into()));
        }
        let (healthy, _) = watch::channel(true);
        let name: Arc<str> = self.name.into();
        let health = Arc::new(health::State::new(name.clone()));
        let mut source = self.source;
        source.attach_health(health.source.clone());
        Ok(Consumer {
            source,
            max_in_flight: self.max_in_flight,
            shared: Arc::new(Shared {
                metrics: telemetry::Metrics::new(&name),
                name,
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
                concurrency: Semaphore::new(self.concurrency),
                concurrency_limit: self.concurrency,
                full_batch: (self.max_in_flight / self.concurrency).max(1),
                healthy,
                health,
                shutdown: CancellationToken::new(),
                fatal: Mutex::new(None),
            }),
        })
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
    batch_size: usize,
    /// The batch size in force: `batch_size`, halved by each batch cut by lock contention and
    /// grown back by committed batches (see [`Shared::batch_limit`]).
    batch_limit: AtomicUsize,
    /// When a batch was last cut by lock contention, in ms since `started` (0: never).
    contended_at: AtomicU64,
    started: std::time::Instant,
    batch_linger: Duration,
    pub(crate) concurrency: Semaphore,
    concurrency_limit: usize,
    /// `max_in_flight / concurrency` (at least 1): what the shared queue can hold for each
    /// transaction slot, so the most a "full" batch can wait for (see [`Scheduler::pump`]).
    full_batch: usize,
    /// `false` while the inbox database is unreachable: intake pauses.
    healthy: watch::Sender<bool>,
    /// What [`Consumer::health`] reports.
    health: Arc<health::State>,
    pub(crate) shutdown: CancellationToken,
    fatal: Mutex<Option<Error>>,
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

    async fn wait_healthy(&self) {
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

    /// Sleeps `delay`, or returns `false` at once if shutdown starts.
    pub(crate) async fn sleep(&self, delay: Duration) -> bool {
        tokio::select! {
            _ = tokio::time::sleep(delay) => true,
            _ = self.shutdown.cancelled() => false,
        }
    }
}

/// Backoff for an unavailable inbox database: 100 ms doubling to 5 s, 50–100 % jitter.
pub(crate) fn store_backoff(attempt: u32) -> Duration {
    backoff_ceiling(Duration::from_millis(100), Duration::from_secs(5), attempt)
        .mul_f64(0.5 + fastrand::f64() / 2.0)
}

/// Backoff before re-running a transaction that lost a lock conflict: 10 ms doubling to 1 s,
/// 50–100 % jitter. Short, because the transaction it collided with usually ends within
/// milliseconds; jittered, so the two do not collide again in step.
pub(crate) fn contention_backoff(conflicts: u32) -> Duration {
    backoff_ceiling(Duration::from_millis(10), Duration::from_secs(1), conflicts)
        .mul_f64(0.5 + fastrand::f64() / 2.0)
}

/// A received delivery and the in-flight slot it occupies until its task ends.
struct InFlight<D> {
    delivery: D,
    _slot: Slot,
}

struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: metrics::Gauge,
    health: Arc<health::State>,
    lane: LaneKey,
    received: Instant,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
        self.health.settled(&self.lane, self.received);
    }
}

/// How often the per-lane gauges ([`telemetry::LANE_OLDEST_UNSETTLED_AGE`]) are refreshed.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// Marks the consumer stopped for [`Health`] when `run_until` ends or its future is dropped.
struct StoppedOnDrop(Arc<health::State>);

impl Drop for StoppedOnDrop {
    fn drop(&mut self) {
        self.0.set_running(false);
    }
}

impl<Src, St, H> Consumer<Src, St, H> {
    /// A handle reporting this consumer's health (database reachable, intake paused, broker
    /// connected, lanes assigned, progress and stalls per lane); see [`crate::health`].
    ///
    /// Take it before [`run`](Self::run), which consumes the consumer. It is cheap to clone and
    /// stays valid after the consumer stops (then reporting it stopped).
    pub fn health(&self) -> Health {
        Health::new(self.shared.health.clone())
    }
}

impl<Src, St, H> Consumer<Src, St, H>
where
    Src: MessageSource,
    St: InboxStore,
    H: Handler<St::Db>,
{
    /// Runs until the source is finished ([`MessageSource::receive`] returns `Ok(None)`) or a
    /// fatal error; see [`run_until`](Self::run_until).
    pub async fn run(self) -> Result<(), Error> {
        self.run_until(std::future::pending::<()>()).await
    }

    /// Runs until `shutdown` completes, the source is finished, or a fatal error.
    ///
    /// Shutdown is graceful: intake stops, every received delivery is processed and settled
    /// (deliveries waiting for an in-place retry are left unsettled and will be redelivered),
    /// then the source is closed. Transactions are never cancelled midway.
    ///
    /// If the future returned here is dropped instead, in-progress message tasks are aborted:
    /// their transactions roll back and their deliveries stay unsettled, to be redelivered. With
    /// sqlx 0.9.0 an abort that lands while `BEGIN` is in flight can return a connection to the
    /// pool inside a transaction (sqlx #4393); keep `idle_in_transaction_session_timeout` set
    /// ([`PostgresInbox::connect_options`](crate::PostgresInbox::connect_options)) and shut down
    /// through `shutdown` rather than by dropping.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
        let Consumer {
            source,
            shared,
            max_in_flight,
        } = self;
        shared.health.set_running(true);
        let _stopped = StoppedOnDrop(shared.health.clone());
        let gauges = tokio::spawn(refresh_gauges(
            shared.health.clone(),
            shared.name.clone(),
            shared.shutdown.clone(),
        ));
        let _gauges = AbortOnDrop(gauges);
        let preflight = shared.clone();
        tokio::spawn(async move {
            // Best effort and off the start path: a database that is down now is found by the
            // first transaction, which fails closed.
            match preflight.store.preflight().await {
                Ok(warnings) => {
                    for warning in warnings {
                        tracing::warn!(consumer = %preflight.name, %warning, "inbox database setting puts the guarantee at risk");
                    }
                }
                Err(e) => {
                    tracing::debug!(consumer = %preflight.name, error = %e, "checking the inbox database's settings failed")
                }
            }
        });
        let (tx, mut rx) = mpsc::unbounded_channel();
        let intake = tokio::spawn(intake(source, shared.clone(), max_in_flight, tx));
        // If this future is dropped (the caller's "crash"), stop intake too.
        let _stop_intake = shared.shutdown.clone().drop_guard();

        let mut tasks = JoinSet::new();
        let mut sched = Scheduler {
            lanes: HashMap::new(),
            task_lanes: HashMap::new(),
            stopped_lanes: HashMap::new(),
            lingering: FuturesUnordered::new(),
            generation: 0,
        };
        let mut intake_open = true;
        tokio::pin!(shutdown);
        let mut signalled = false;

        while intake_open || !tasks.is_empty() || !sched.lingering.is_empty() {
            tokio::select! {
                _ = &mut shutdown, if !signalled => {
                    signalled = true;
                    tracing::info!(consumer = %shared.name, "shutdown requested: stopping intake and draining");
                    shared.shutdown.cancel();
                }
                item = rx.recv(), if intake_open => match item {
                    Some(item) => {
                        let key = match crate::source::Delivery::lane(&item.delivery) {
                            Lane::Unordered => None,
                            Lane::Ordered(key) => Some(key),
                        };
                        if key.as_ref().is_some_and(|k| sched.stays_stopped(k, &item.delivery)) {
                            drop(item); // unsettled: redelivered after the delivery it must follow
                        } else {
                            sched.lanes.entry(key.clone()).or_default().queue.push_back(item);
                            sched.pump(&key, &mut tasks, &shared);
                        }
                    }
                    None => intake_open = false,
                },
                Some((key, generation)) = sched.lingering.next(), if !sched.lingering.is_empty() => {
                    if let Some(lane) = sched.lanes.get_mut(&key) {
                        if lane.linger == Linger::Waiting(generation) {
                            lane.linger = Linger::Expired;
                            sched.pump(&key, &mut tasks, &shared);
                        }
                    }
                }
                Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    let (id, end) = match done {
                        Ok((id, end)) => (id, end),
                        Err(e) => {
                            // A bug in txinbox or an adapter, not in the handler (handler panics
                            // are caught). The delivery was dropped unsettled and will be
                            // redelivered; stop rather than run its lane out of order.
                            let error = SourceError::fatal(format!("message task failed: {e}"));
                            shared.fail(Error::Source(error));
                            (e.id(), single::LaneEnd::Stopped(single::Stop::for_good()))
                        }
                    };
                    if let Some(key) = sched.task_lanes.remove(&id) {
                        let lane = sched.lanes.get_mut(&key).expect("a running lane has a queue");
                        lane.running -= 1;
                        match &key {
                            Some(ordered) => match end {
                                single::LaneEnd::Done => sched.pump(&key, &mut tasks, &shared),
                                single::LaneEnd::Stopped(stop) => {
                                    // Queued behind the stop: dropped unsettled, unless the lane
                                    // was started over meanwhile (then it goes on from there).
                                    let queue = &mut lane.queue;
                                    match queue.iter().position(|i| stop.starts_over(&i.delivery)) {
                                        Some(k) => {
                                            queue.drain(..k);
                                            sched.pump(&key, &mut tasks, &shared);
                                        }
                                        None => {
                                            sched.lanes.remove(&key);
                                            sched.stopped_lanes.insert(ordered.clone(), stop);
                                        }
                                    }
                                }
                            },
                            _ => sched.pump(&key, &mut tasks, &shared),
                        }
                    }
                }
            }
        }

        let source = intake
            .await
            .map_err(|e| Error::Source(SourceError::fatal(format!("intake task failed: {e}"))))?;
        if let Err(e) = source.close().await {
            tracing::warn!(consumer = %shared.name, error = %e, "closing the source failed");
        }
        let fatal = shared.fatal.lock().unwrap().take();
        match fatal {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// A lane's key in the scheduler: `None` is the shared queue of unordered deliveries.
type LaneKey = Option<Arc<str>>;

/// A running linger: resolves to its lane and the generation that started it.
type LingerTimer = Pin<Box<dyn Future<Output = (LaneKey, u64)> + Send>>;

/// The per-lane queues and the tasks serving them.
struct Scheduler<D> {
    lanes: HashMap<LaneKey, LaneQueue<D>>,
    task_lanes: HashMap<tokio::task::Id, LaneKey>,
    /// Lanes whose delivery was left unsettled: nothing after it may run (it would overtake
    /// it), so their later deliveries are dropped unsettled too and will be redelivered. With
    /// where it stopped: see [`Scheduler::stays_stopped`].
    stopped_lanes: HashMap<Arc<str>, single::Stop>,
    /// Linger timers: the lane and the generation that started it.
    lingering: FuturesUnordered<LingerTimer>,
    generation: u64,
}

struct LaneQueue<D> {
    queue: VecDeque<InFlight<D>>,
    running: usize,
    linger: Linger,
}

impl<D> Default for LaneQueue<D> {
    fn default() -> Self {
        LaneQueue {
            queue: VecDeque::new(),
            running: 0,
            linger: Linger::Idle,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Linger {
    Idle,
    /// A timer of this generation runs; the lane waits for more deliveries.
    Waiting(u64),
    /// The timer fired: start with what is queued.
    Expired,
}

impl<D: crate::source::Delivery> Scheduler<D> {
    /// Whether `delivery` of stopped lane `key` must be dropped: until the source starts the
    /// lane over ([`single::Stop::starts_over`]: another assignment of the lane, or a
    /// delivery at or before where it stopped).
    fn stays_stopped(&mut self, key: &Arc<str>, delivery: &D) -> bool {
        let Some(stop) = self.stopped_lanes.get(key) else {
            return false;
        };
        let again = stop.starts_over(delivery);
        if again {
            tracing::info!(lane = %key, "a stopped lane is delivered again from before where it stopped; it runs again");
            self.stopped_lanes.remove(key);
        }
        !again
    }

    /// Starts tasks for `key` while it has queued deliveries and room to run: one task at a time
    /// for an ordered lane, up to `concurrency` for the unordered queue. Each task takes up to
    /// `batch_size` queued deliveries. Forgets a lane that has nothing queued or running.
    fn pump<St, H>(
        &mut self,
        key: &LaneKey,
        tasks: &mut JoinSet<single::LaneEnd>,
        shared: &Arc<Shared<St, H>>,
    ) where
        St: InboxStore,
        H: Handler<St::Db>,
    {
        let Some(lane) = self.lanes.get_mut(key) else {
            return;
        };
        let max_running = if key.is_some() {
            1
        } else {
            shared.concurrency_limit
        };
        while lane.running < max_running && !lane.queue.is_empty() {
            let limit = shared.batch_limit();
            // The shared queue starts a second transaction only with a full batch, or after
            // FULL_BATCH_WAIT: a few messages each in several concurrent transactions cost the
            // database (and the CPU it may share with the broker) far more per message than one
            // transaction of dozens, and the running one usually ends and takes them first.
            // Under load the queue fills, so all `concurrency` transactions still run; with slow
            // handlers the wait ends and they run side by side as before. (Full: as much as
            // max_in_flight leaves each transaction slot, if that is less than a batch.)
            let wait = if key.is_none() && lane.running > 0 && lane.queue.len() < limit.min(shared.full_batch)
            {
                Some(shared.batch_linger.max(FULL_BATCH_WAIT))
            } else if lane.queue.len() < limit && !shared.batch_linger.is_zero() {
                Some(shared.batch_linger)
            } else {
                None
            };
            if let Some(wait) = wait {
                match lane.linger {
                    Linger::Idle => {
                        self.generation += 1;
                        let (generation, key) = (self.generation, key.clone());
                        lane.linger = Linger::Waiting(generation);
                        self.lingering.push(Box::pin(async move {
                            tokio::time::sleep(wait).await;
                            (key, generation)
                        }));
                        break;
                    }
                    Linger::Waiting(_) => break,
                    Linger::Expired => {}
                }
            }
            lane.linger = Linger::Idle;
            let n = lane.queue.len().min(limit);
            let batch: Vec<InFlight<D>> = lane.queue.drain(..n).collect();
            lane.running += 1;
            let shared = shared.clone();
            let id = tasks
                .spawn(async move {
                    let (deliveries, _slots): (Vec<D>, Vec<Slot>) =
                        batch.into_iter().map(|i| (i.delivery, i._slot)).unzip();
                    single::process_batch(&shared, deliveries).await
                })
                .id();
            self.task_lanes.insert(id, key.clone());
        }
        if lane.running == 0 && lane.queue.is_empty() {
            self.lanes.remove(key);
        }
    }
}

/// Receives while there is room and the database is healthy; returns the source at the end.
async fn intake<Src: MessageSource, St, H>(
    mut source: Src,
    shared: Arc<Shared<St, H>>,
    max_in_flight: usize,
    tx: mpsc::UnboundedSender<InFlight<Src::Delivery>>,
) -> Src {
    let slots = Arc::new(Semaphore::new(max_in_flight));
    let gauge = shared.metrics.in_flight.clone();
    let mut errors = 0u32;
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("semaphore is never closed"),
            _ = shared.shutdown.cancelled() => break,
        };
        shared.wait_healthy().await;
        // NOTE: `receive` is cancellation safe by contract; dropping it on shutdown loses nothing.
        let received = tokio::select! {
            biased;
            _ = shared.shutdown.cancelled() => break,
            r = source.receive() => r,
        };
        match received {
            Ok(Some(delivery)) => {
                errors = 0;
                gauge.increment(1.0);
                let lane = match crate::source::Delivery::lane(&delivery) {
                    Lane::Unordered => None,
                    Lane::Ordered(key) => Some(key),
                };
                let received = Instant::now();
                shared.health.received(&lane, received);
                let slot = Slot {
                    _permit: permit,
                    gauge: gauge.clone(),
                    health: shared.health.clone(),
                    lane,
                    received,
                };
                if tx
                    .send(InFlight {
                        delivery,
                        _slot: slot,
                    })
                    .is_err()
                {
                    break;
                }
            }
            Ok(None) => {
                tracing::info!(consumer = %shared.name, "source finished");
                break;
            }
            Err(e) if e.is_transient() => {
                errors += 1;
                let delay = store_backoff(errors);
                tracing::warn!(consumer = %shared.name, error = %e, ?delay, "receive failed; retrying");
                if !shared.sleep(delay).await {
                    break;
                }
            }
            Err(e) => {
                shared.fail(Error::Source(e));
                break;
            }
        }
    }
    source
}

/// Aborts a background task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Sets [`telemetry::LANE_OLDEST_UNSETTLED_AGE`] per lane every [`GAUGE_INTERVAL`] until
/// shutdown, and zero for lanes that had a value and are gone.
async fn refresh_gauges(health: Arc<health::State>, consumer: Arc<str>, shutdown: CancellationToken) {
    let mut known: HashMap<LaneKey, metrics::Gauge> = HashMap::new();
    let mut tick = tokio::time::interval(GAUGE_INTERVAL);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => break,
        }
        let samples = health.sample();
        let mut seen = std::collections::HashSet::new();
        for sample in samples {
            let gauge = known.entry(sample.lane.clone()).or_insert_with(|| {
                let lane = sample.lane.as_deref().unwrap_or("").to_owned();
                metrics::gauge!(telemetry::LANE_OLDEST_UNSETTLED_AGE, "consumer" => consumer.to_string(), "lane" => lane)
            });
            gauge.set(sample.oldest_unsettled.as_secs_f64());
            seen.insert(sample.lane);
        }
        known.retain(|lane, gauge| {
            let keep = seen.contains(lane);
            if !keep {
                gauge.set(0.0);
            }
            keep
        });
    }
    for gauge in known.values() {
        gauge.set(0.0);
    }
}
