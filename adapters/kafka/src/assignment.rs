//! [`KafkaSource`] and [`KafkaDelivery`]: the poller thread, rebalance handling, offset storing
//! and dead-letter producing.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, RebalanceProtocol};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::{mpsc, oneshot};
use txinbox::{
    Capabilities, DeadLetter, Delivery, Headers, IdStrategy, InboxStore, Lane, Message, MessageSource,
    Origin, Position, RetryMode, SettleError, Settlement, SourceError, StoreError,
};

use crate::config::{masked_error, KafkaConfig, MissingPosition};
use crate::produce::{self, Failure};
use crate::ready::Ready;
use crate::tracker::{Generation, Partition};
use crate::{headers, metrics_names};

/// How long one `poll` waits; also the longest delay before a settled offset is stored.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long one attempt to load database positions may take during an assignment.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the database positions of blocked partitions are read again.
const BLOCKED_RECHECK: Duration = Duration::from_secs(2);
/// How long one attempt to read the group's committed offsets may take during an assignment.
const COMMITTED_TIMEOUT: Duration = Duration::from_secs(10);
/// A dead letter waiting on a transient failure logs a warning on its first failure and then
/// on every this many.
const DEAD_LETTER_WARN_EVERY: u32 = 10;

/// Where a source reads the positions its consumer stored with its effects.
///
/// Implemented for every [`InboxStore`] (through
/// [`InboxStore::load_positions`]); pass the consumer's store, e.g. `inbox.clone()`.
pub trait PositionStore: Send + Sync + 'static {
    /// The stored next offsets of `consumer` in `topic`: partition number as text → next
    /// offset.
    fn load<'a>(
        &'a self,
        consumer: &'a str,
        topic: &'a str,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, StoreError>>;

    /// Records that `consumer` reads `topic` of `system` (`kafka`) through consumer group
    /// `group`; returns the group already recorded when it is a different one (see
    /// [`InboxStore::record_subscription`]). The default records nothing.
    fn record_subscription<'a>(
        &'a self,
        consumer: &'a str,
        system: &'a str,
        topic: &'a str,
        group: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>> {
        let _ = (consumer, system, topic, group);
        Box::pin(async { Ok(None) })
    }
}

impl<S: InboxStore> PositionStore for S {
    fn load<'a>(
        &'a self,
        consumer: &'a str,
        topic: &'a str,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, StoreError>> {
        self.load_positions(consumer, topic)
    }

    fn record_subscription<'a>(
        &'a self,
        consumer: &'a str,
        system: &'a str,
        topic: &'a str,
        group: &'a str,
    ) -> BoxFuture<'a, Result<Option<String>, StoreError>> {
        InboxStore::record_subscription(self, consumer, system, topic, group)
    }
}

/// A Kafka consumer-group member as a [`MessageSource`].
///
/// - **Lanes**: one per topic-partition (`Lane::Ordered("topic/partition")`): partitions are
///   processed concurrently, each in offset order.
/// - **Offsets**: `enable.auto.offset.store=false`; a partition's stored offset is its highest
///   contiguous settled offset + 1, so nothing is stored for a message whose transaction has not
///   committed. Stored offsets reach the group through librdkafka's auto-commit (for lag tools)
///   and synchronously on revocation and close.
/// - **Positions**: [`Delivery::position`] is `(topic, partition, offset + 1)`, which the runtime
///   stores with the effects. On assignment each partition starts at the database position when
///   there is one. That makes a crash between the database commit and the offset commit, and a
///   database restore, resume exactly where the database's state ends. Without one: at
///   `auto.offset.reset` when the group has no committed offset either, else as
///   [`KafkaConfig::on_missing_position`] says (default: hold the partition until a position is
///   written). The consumer group is recorded with the consumer name on assignment; another
///   group already recorded for the name stops the source.
/// - **Rebalances** (eager and cooperative-sticky) run on the poller thread: a revocation stops
///   handing out the revoked partitions' messages, waits up to
///   [`revoke_timeout`](KafkaConfig::revoke_timeout) for their in-flight messages, stores and
///   commits synchronously, then gives them up. Lost assignments and `_STATE` errors are benign
///   (the new owner redelivers, the inbox deduplicates) and logged at info.
/// - **Partitions take turns**: what the poller fetched is handed out one partition at a time
///   in rotation, never one partition's whole backlog first (each partition is a lane that runs
///   one transaction at a time, so a backlog handed out first would hold every in-flight slot
///   while the other lanes idle). Within a partition, offset order.
/// - **Backpressure**: a partition with [`max_buffered_per_partition`](KafkaConfig::max_buffered_per_partition)
///   unsettled messages is paused, and resumed at half of that; the poller keeps polling.
/// - **Dead letters** go to `<topic>.dlq` (or the configured topic) with the original key,
///   payload and headers plus `txinbox.dlq.*` headers ([`headers`](crate::headers)); the
///   original offset is stored only after the broker confirmed the dead letter. Too large: a
///   copy without the payload, then without the original headers. Refused for good: logged,
///   counted, settled (the database's row is the record). Transient: retried while assigned.
pub struct KafkaSource {
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Result<Item, SourceError>>,
    /// What `rx` held when `receive` last looked, by partition: handed out in turn.
    ready: Ready<Item>,
    poller_done: Option<oneshot::Receiver<()>>,
}

impl fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSource")
            .field("group", &self.shared.config.group_id)
            .field("topics", &self.shared.config.topics)
            .finish_non_exhaustive()
    }
}

/// State shared by the source, the poller thread, the rebalance callback and the deliveries.
struct Shared {
    config: KafkaConfig,
    state: Mutex<State>,
    /// Notified whenever a delivery is settled or dropped (revocations wait on it).
    settled: Condvar,
    /// Set by `close` or drop: the poller leaves its loop.
    stop: AtomicBool,
    producer: FutureProducer,
    /// A reason to stop the consumer found inside a rebalance callback (which cannot return
    /// one); the poller hands it to `receive`.
    fatal: Mutex<Option<String>>,
    /// Where assignments and the broker connection are reported, once the consumer attached it.
    health: OnceLock<txinbox::health::SourceHealth>,
}

struct State {
    partitions: HashMap<Arc<str>, HashMap<i32, Partition>>,
    next_epoch: u64,
    /// The consumer name (a label of the blocked-partitions gauge).
    consumer: Arc<str>,
}

impl State {
    fn new(consumer: &str) -> Self {
        State {
            partitions: HashMap::new(),
            next_epoch: 0,
            consumer: consumer.into(),
        }
    }

    fn get_mut(&mut self, topic: &str, partition: i32) -> Option<&mut Partition> {
        self.partitions.get_mut(topic)?.get_mut(&partition)
    }

    fn remove(&mut self, topic: &str, partition: i32) -> Option<Partition> {
        let parts = self.partitions.get_mut(topic)?;
        let p = parts.remove(&partition);
        if parts.is_empty() {
            self.partitions.remove(topic);
        }
        if let Some(p) = &p {
            self.set_blocked(p, false);
        }
        p
    }

    /// Forgets every partition (eager rebalance).
    fn clear(&mut self) {
        let all: Vec<Partition> = self
            .partitions
            .drain()
            .flat_map(|(_, parts)| parts.into_values())
            .collect();
        for p in &all {
            self.set_blocked(p, false);
        }
    }

    /// Counts `p` into (`true`) or out of (`false`, only if it was blocked) the
    /// blocked-partitions gauge.
    fn set_blocked(&self, p: &Partition, blocked: bool) {
        if !blocked && p.blocked.is_none() {
            return;
        }
        self.count_blocked(&p.topic, blocked);
    }

    fn count_blocked(&self, topic: &str, blocked: bool) {
        let gauge = metrics::gauge!(
            metrics_names::PARTITIONS_BLOCKED,
            "consumer" => self.consumer.to_string(),
            "topic" => topic.to_owned()
        );
        if blocked {
            gauge.increment(1.0);
        } else {
            gauge.decrement(1.0);
        }
    }

    /// The blocked partitions, by topic.
    fn blocked(&self) -> Vec<(Arc<str>, i32)> {
        self.partitions
            .iter()
            .flat_map(|(t, parts)| {
                parts
                    .iter()
                    .filter(|(_, p)| p.blocked.is_some())
                    .map(|(n, _)| (t.clone(), *n))
            })
            .collect()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the bookkeeping half-updated in a way
        // that matters for safety: offsets only move forward on settle.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Reports the partitions assigned now to the consumer's health, if it is attached.
    fn report_assignment(&self) {
        if let Some(health) = self.health.get() {
            let lanes: Vec<Arc<str>> = self
                .lock()
                .partitions
                .values()
                .flat_map(|parts| parts.values().map(|p| p.lane.clone()))
                .collect();
            health.set_assigned(lanes);
        }
    }

    fn is_assigned(&self, topic: &str, partition: i32, epoch: u64) -> bool {
        self.lock()
            .get_mut(topic, partition)
            .is_some_and(|p| p.epoch() == epoch)
    }
}

/// A message on its way from the poller to [`KafkaSource::receive`].
struct Item {
    topic: Arc<str>,
    partition: i32,
    offset: i64,
    timestamp: Option<i64>,
    generation: Arc<Generation>,
    lane: Arc<str>,
    message: Message,
}

impl KafkaSource {
    /// Creates the consumer, subscribes and starts the poller thread.
    ///
    /// `positions` is where the consumer's positions are stored: pass its inbox store
    /// (`inbox.clone()`). Must be called inside a Tokio runtime: position loads during
    /// rebalances run on it.
    pub fn new(config: KafkaConfig, positions: impl PositionStore) -> Result<Self, txinbox::Error> {
        config.validate().map_err(txinbox::Error::Config)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            txinbox::Error::Config("KafkaSource::new must be called inside a Tokio runtime".into())
        })?;
        let producer_config = config.producer_config();
        let producer: FutureProducer = producer_config.create().map_err(|e| {
            txinbox::Error::Config(format!(
                "creating the dead-letter producer failed: {}",
                masked_error(&e, &producer_config)
            ))
        })?;
        let shared = Arc::new(Shared {
            config: config.clone(),
            state: Mutex::new(State::new(&config.consumer_name)),
            settled: Condvar::new(),
            stop: AtomicBool::new(false),
            producer,
            fatal: Mutex::new(None),
            health: OnceLock::new(),
        });
        let context = PollerContext {
            shared: shared.clone(),
            positions: Arc::new(positions),
            runtime,
            last_error: Mutex::new(String::new()),
            lag_reported: Mutex::new(Vec::new()),
        };
        let consumer_config = config.consumer_config();
        let consumer: BaseConsumer<PollerContext> =
            consumer_config.create_with_context(context).map_err(|e| {
                txinbox::Error::Config(format!(
                    "creating the Kafka consumer failed: {}",
                    masked_error(&e, &consumer_config)
                ))
            })?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| txinbox::Error::Config(format!("subscribing to {topics:?} failed: {e}")))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = oneshot::channel();
        let poller_shared = shared.clone();
        static POLLERS: AtomicU64 = AtomicU64::new(0);
        std::thread::Builder::new()
            .name(format!(
                "txinbox-kafka-poll-{}",
                POLLERS.fetch_add(1, Ordering::Relaxed)
            ))
            .spawn(move || {
                poll_loop(consumer, &poller_shared, &tx);
                let _ = done_tx.send(());
            })
            .map_err(|e| txinbox::Error::Config(format!("starting the poller thread failed: {e}")))?;
        Ok(KafkaSource {
            shared,
            rx,
            ready: Ready::default(),
            poller_done: Some(done_rx),
        })
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        // Without close (the consumer's future was dropped, like a crash): the poller stops,
        // commits what was stored (only offsets whose transactions committed) and leaves.
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

#[async_trait]
impl MessageSource for KafkaSource {
    type Delivery = KafkaDelivery;

    async fn receive(&mut self) -> Result<Option<KafkaDelivery>, SourceError> {
        loop {
            // Everything the poller handed over so far goes into per-partition queues, which
            // are served in turn (see `ready`): one partition's backlog must not take every
            // in-flight slot while the other partitions' lanes wait.
            loop {
                match self.rx.try_recv() {
                    Ok(Ok(item)) => self.ready.push(item.lane.clone(), item),
                    Ok(Err(e)) => return Err(e),
                    Err(_) => break, // empty, or the poller is gone: `recv` below says which
                }
            }
            // NOTE: cancellation safe: an item stays in `ready` or in the channel until it is
            // returned (or found stale).
            let item = match self.ready.pop() {
                Some(item) => item,
                None => match self.rx.recv().await {
                    Some(Ok(item)) => item,
                    Some(Err(e)) => return Err(e),
                    None if self.shared.stopping() => return Ok(None),
                    None => return Err(SourceError::fatal("the Kafka poller thread stopped")),
                },
            };
            let mut state = self.shared.lock();
            let Some(p) = state.get_mut(&item.topic, item.partition) else {
                continue; // revoked: the new owner delivers it
            };
            if p.epoch() != item.generation.epoch {
                continue;
            }
            if p.revoking {
                p.discard_buffered();
                continue;
            }
            p.hand_out();
            drop(state);
            return Ok(Some(KafkaDelivery {
                message: item.message,
                lane: item.lane,
                topic: item.topic,
                partition: item.partition,
                offset: item.offset,
                timestamp: item.timestamp,
                generation: item.generation,
                shared: self.shared.clone(),
                settled: false,
            }));
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            system: "kafka",
            retry: RetryMode::InPlace,
            default_id_strategy: IdStrategy::CloudEvents,
        }
    }

    /// Reports the assigned partitions (`topic/partition`) after every rebalance, and the
    /// broker connection from librdkafka's statistics (connected while any broker is up).
    fn attach_health(&mut self, health: txinbox::health::SourceHealth) {
        if self.shared.health.set(health).is_ok() {
            self.shared.report_assignment();
        }
    }

    /// [`KafkaConfig::new`]'s `consumer_name`: the consumer refuses to build under another.
    fn positions_consumer(&self) -> Option<&str> {
        Some(&self.shared.config.consumer_name)
    }

    async fn close(mut self) -> Result<(), SourceError> {
        self.shared.stop.store(true, Ordering::SeqCst);
        let timeout = self.shared.config.close_timeout;
        if let Some(done) = self.poller_done.take() {
            if tokio::time::timeout(timeout, done).await.is_err() {
                tracing::warn!(
                    ?timeout,
                    "the Kafka consumer did not close in time; leaving it to close in the background"
                );
            }
        }
        // The producer's drop flushes and joins its thread: not on a runtime worker.
        let shared = self.shared.clone();
        drop(self);
        let _ = tokio::task::spawn_blocking(move || drop(shared)).await;
        Ok(())
    }
}

/// One Kafka record and the right to settle it.
pub struct KafkaDelivery {
    message: Message,
    lane: Arc<str>,
    topic: Arc<str>,
    partition: i32,
    offset: i64,
    timestamp: Option<i64>,
    generation: Arc<Generation>,
    shared: Arc<Shared>,
    settled: bool,
}

impl fmt::Debug for KafkaDelivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaDelivery")
            .field("topic", &self.topic)
            .field("partition", &self.partition)
            .field("offset", &self.offset)
            .finish_non_exhaustive()
    }
}

impl KafkaDelivery {
    /// The record's topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The record's partition.
    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// The record's offset.
    pub fn offset(&self) -> i64 {
        self.offset
    }

    /// The record's timestamp in milliseconds since the epoch, if it has one.
    pub fn timestamp(&self) -> Option<i64> {
        self.timestamp
    }

    fn not_assigned(&self) -> SettleError {
        SettleError::new(format!(
            "partition {}/{} is no longer assigned to this member; offset {} is not stored (the new owner redelivers it and the inbox deduplicates)",
            self.topic, self.partition, self.offset
        ))
    }

    /// Produces the dead letter and waits for the broker's confirmation.
    ///
    /// - Too large for the producer or the topic: the copy leaves the payload out, then the
    ///   original headers too, with headers saying so ([`headers::PAYLOAD`]).
    /// - Refused for good (authorization, invalid topic, still too large): logged at ERROR,
    ///   counted ([`metrics_names::DEAD_LETTERS_REFUSED`]) and settled: the runtime has
    ///   already recorded the dead letter in the database, which is the record; the partition
    ///   goes on.
    /// - Transient: retried while the partition stays assigned (fail closed), counted in the
    ///   gauge [`metrics_names::DEAD_LETTERS_WAITING`] and logged with the partition on the
    ///   first failure and every [`DEAD_LETTER_WARN_EVERY`] after it.
    async fn produce_dead_letter(&self, dl: &DeadLetter) -> Result<(), SettleError> {
        let config = &self.shared.config;
        let topic = config.dead_letter_topic_for(&self.topic);
        let mut form = Form::Whole;
        let mut digest: Option<(String, String)> = None;
        let mut failures: u32 = 0;
        let mut waiting: Option<Waiting> = None;
        loop {
            if form != Form::Whole && digest.is_none() {
                let payload = self.message.payload();
                digest = Some((payload.len().to_string(), sha256_hex(payload)));
            }
            let (failure, error, code) = match self.try_produce(&topic, dl, form, digest.as_ref()).await {
                Ok(()) => {
                    metrics::counter!(metrics_names::DEAD_LETTERS_PRODUCED, "topic" => topic.clone())
                        .increment(1);
                    if form != Form::Whole {
                        metrics::counter!(metrics_names::DEAD_LETTERS_REDUCED, "topic" => topic.clone(), "form" => form.name())
                            .increment(1);
                    }
                    if failures > 0 {
                        tracing::info!(dead_letter_topic = %topic, topic = %self.topic, partition = self.partition, offset = self.offset, failures, "dead letter confirmed after transient failures; the partition goes on");
                    }
                    return Ok(());
                }
                Err(failed) => failed,
            };
            match failure {
                Failure::TooLarge if form.smaller().is_some() => {
                    let smaller = form.smaller().unwrap_or(form);
                    tracing::warn!(
                        dead_letter_topic = %topic,
                        topic = %self.topic,
                        partition = self.partition,
                        offset = self.offset,
                        %error,
                        form = smaller.name(),
                        "the dead letter is too large for the dead-letter topic; sending a reduced copy (the database's dead_letters row keeps the payload up to dead_letter_payload_limit; beyond it, the whole record is only on the source topic until its retention)"
                    );
                    form = smaller;
                    continue;
                }
                Failure::TooLarge | Failure::Refused => {
                    tracing::error!(
                        dead_letter_topic = %topic,
                        topic = %self.topic,
                        partition = self.partition,
                        offset = self.offset,
                        %error,
                        "the dead-letter topic refused the dead letter for good; the database's dead_letters row is its record and the partition goes on; fix the topic (ACLs, name, max.message.bytes) and requeue it from the database if needed"
                    );
                    metrics::counter!(metrics_names::DEAD_LETTERS_REFUSED, "topic" => topic.clone(), "code" => code)
                        .increment(1);
                    return Ok(());
                }
                Failure::Transient => {}
            }
            failures += 1;
            if self.shared.stopping()
                || !self
                    .shared
                    .is_assigned(&self.topic, self.partition, self.generation.epoch)
            {
                return Err(SettleError::new(format!(
                    "dead letter to {topic} not confirmed ({error}); offset {} of {}/{} is not stored",
                    self.offset, self.topic, self.partition
                )));
            }
            if waiting.is_none() {
                waiting = Some(Waiting::new(topic.clone()));
            }
            let delay = Duration::from_millis(100 * 2u64.pow(failures.min(6))).min(Duration::from_secs(5));
            if failures == 1 || failures.is_multiple_of(DEAD_LETTER_WARN_EVERY) {
                tracing::warn!(
                    dead_letter_topic = %topic,
                    topic = %self.topic,
                    partition = self.partition,
                    offset = self.offset,
                    %error,
                    failures,
                    "producing a dead letter failed; the partition waits for it (fail closed) and it is retried"
                );
            } else {
                tracing::debug!(dead_letter_topic = %topic, %error, failures, ?delay, "producing a dead letter failed; retrying");
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// One attempt: `Err((how it failed, error text))`.
    async fn try_produce(
        &self,
        topic: &str,
        dl: &DeadLetter,
        form: Form,
        digest: Option<&(String, String)>,
    ) -> Result<(), (Failure, String, String)> {
        let failed = |e: KafkaError| {
            let code = e
                .rdkafka_error_code()
                .map_or_else(|| "none".to_owned(), |c| format!("{c:?}"));
            (produce::classify(&e), e.to_string(), code)
        };
        let record = self.dead_letter_record(topic, dl, form, digest);
        let delivery = self
            .shared
            .producer
            .send_result(record)
            .map_err(|(e, _)| failed(e))?;
        let wait = self.shared.config.dead_letter_timeout + Duration::from_secs(5);
        let transient = |text: String| (Failure::Transient, text, "none".to_owned());
        match tokio::time::timeout(wait, delivery).await {
            Ok(Ok(Ok(_))) => Ok(()),
            Ok(Ok(Err((e, _)))) => Err(failed(e)),
            Ok(Err(_)) => Err(transient("the dead-letter producer was dropped".to_owned())),
            Err(_) => Err(transient(format!("no delivery report within {wait:?}"))),
        }
    }

    fn dead_letter_record<'a>(
        &'a self,
        topic: &'a str,
        dl: &'a DeadLetter,
        form: Form,
        digest: Option<&'a (String, String)>,
    ) -> FutureRecord<'a, [u8], [u8]> {
        let mut h = OwnedHeaders::new_with_capacity(self.message.headers().len() + 11);
        if form != Form::HeadersOmitted {
            for (key, value) in self.message.headers().iter() {
                h = h.insert(Header {
                    key,
                    value: Some(value),
                });
            }
        }
        let partition = self.partition.to_string();
        let offset = self.offset.to_string();
        let timestamp = self.timestamp.map(|t| t.to_string()).unwrap_or_default();
        let fields: [(&str, &str); 7] = [
            (headers::REASON, dl.reason.as_str()),
            (headers::ERROR, &dl.error),
            (headers::TOPIC, &self.topic),
            (headers::PARTITION, &partition),
            (headers::OFFSET, &offset),
            (headers::TIMESTAMP, &timestamp),
            (headers::CONSUMER, &self.shared.config.consumer_name),
        ];
        for (key, value) in fields {
            h = h.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        if form != Form::Whole {
            let (size, sha256) = match digest {
                Some((size, sha256)) => (size.as_str(), sha256.as_str()),
                None => ("", ""),
            };
            for (key, value) in [
                (headers::PAYLOAD, "omitted"),
                (headers::ORIGINAL_SIZE, size),
                (headers::ORIGINAL_SHA256, sha256),
            ] {
                h = h.insert(Header {
                    key,
                    value: Some(value.as_bytes()),
                });
            }
        }
        if form == Form::HeadersOmitted {
            h = h.insert(Header {
                key: headers::HEADERS,
                value: Some("omitted".as_bytes()),
            });
        }
        let mut record = FutureRecord::to(topic).headers(h);
        if form == Form::Whole {
            record = record.payload(self.message.payload().as_ref());
        }
        if let Some(key) = self.message.key() {
            record = record.key(key.as_ref());
        }
        record
    }
}

/// The form of a dead-letter copy: whole, or cut down because the whole one was too large.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// Key, payload and headers of the original, plus the `txinbox.dlq.*` headers.
    Whole,
    /// Without the payload; its size and SHA-256 in headers.
    PayloadOmitted,
    /// Without the payload and the original headers.
    HeadersOmitted,
}

impl Form {
    fn smaller(self) -> Option<Form> {
        match self {
            Form::Whole => Some(Form::PayloadOmitted),
            Form::PayloadOmitted => Some(Form::HeadersOmitted),
            Form::HeadersOmitted => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Form::Whole => "whole",
            Form::PayloadOmitted => "payload_omitted",
            Form::HeadersOmitted => "headers_omitted",
        }
    }
}

/// One dead letter counted in [`metrics_names::DEAD_LETTERS_WAITING`] while it lives (also
/// when the settlement is dropped: shutdown, revocation).
struct Waiting {
    topic: String,
}

impl Waiting {
    fn new(topic: String) -> Self {
        metrics::gauge!(metrics_names::DEAD_LETTERS_WAITING, "topic" => topic.clone()).increment(1.0);
        Waiting { topic }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        metrics::gauge!(metrics_names::DEAD_LETTERS_WAITING, "topic" => self.topic.clone()).decrement(1.0);
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    use std::fmt::Write as _;
    let digest = sha2::Sha256::digest(bytes);
    let mut hex = String::with_capacity(64);
    for b in digest {
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

#[async_trait]
impl Delivery for KafkaDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    fn lane(&self) -> Lane {
        Lane::Ordered(self.lane.clone())
    }

    fn assignment(&self) -> Option<u64> {
        Some(self.generation.epoch)
    }

    fn position(&self) -> Option<Position> {
        // An earlier offset of this partition was dropped unsettled (shutdown during an in-place
        // retry): storing this one's position would make a restart skip it. Leave the database
        // position where it is; the restart redelivers from there and the inbox deduplicates.
        if self.generation.has_hole_below(self.offset) {
            return None;
        }
        Some(Position {
            source: self.topic.clone(),
            lane: self.partition.to_string().into(),
            next: self.offset + 1,
        })
    }

    async fn settle(mut self, settlement: Settlement) -> Result<(), SettleError> {
        match settlement {
            Settlement::Ack => {}
            Settlement::DeadLetter(dl) => self.produce_dead_letter(&dl).await?,
            Settlement::Retry { .. } => {
                return Err(SettleError::new(
                    "Kafka cannot redeliver one record later (the source's RetryMode is InPlace); the offset is not stored",
                ));
            }
        }
        let mut state = self.shared.lock();
        match state.get_mut(&self.topic, self.partition) {
            Some(p) if p.epoch() == self.generation.epoch => {
                p.settle(self.offset);
                self.settled = true;
                drop(state);
                self.shared.settled.notify_all();
                Ok(())
            }
            _ => {
                // Nothing to track any more: not an abandonment of the current assignment.
                self.settled = true;
                Err(self.not_assigned())
            }
        }
    }
}

impl Drop for KafkaDelivery {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        {
            let mut state = self.shared.lock();
            match state.get_mut(&self.topic, self.partition) {
                Some(p) if p.epoch() == self.generation.epoch => p.abandon(self.offset),
                // Revoked already: no tracker, but the later deliveries of this assignment
                // still in the runtime must not report positions past this one.
                _ => self.generation.abandon(self.offset),
            }
        }
        self.shared.settled.notify_all();
    }
}

/// The consumer's context: rebalance callbacks run in it, on the poller thread.
struct PollerContext {
    shared: Arc<Shared>,
    positions: Arc<dyn PositionStore>,
    runtime: tokio::runtime::Handle,
    last_error: Mutex<String>,
    /// The partitions whose lag gauge was last set (zeroed once no longer assigned).
    lag_reported: Mutex<Vec<(Arc<str>, i32)>>,
}

impl ClientContext for PollerContext {
    fn error(&self, error: KafkaError, reason: &str) {
        // Broker disconnects and the like: librdkafka retries by itself. Log each new one once.
        let text = format!("{error}: {reason}");
        let mut last = self.last_error.lock().unwrap_or_else(|e| e.into_inner());
        if *last != text {
            tracing::warn!(%error, reason, "librdkafka error");
            *last = text;
        }
    }

    /// Runs on the poller thread (during `poll`) every `statistics.interval.ms`: sets the lag
    /// gauges and reports the broker connection. Reads only what the statistics carry and the
    /// in-memory positions; never blocks on the network.
    fn stats(&self, statistics: rdkafka::Statistics) {
        if let Some(health) = self.shared.health.get() {
            let up = statistics
                .brokers
                .values()
                .any(|b| b.nodeid >= 0 && b.state == "UP");
            health.set_connected(up);
        }
        let mut now = Vec::new();
        let consumer = {
            let state = self.shared.lock();
            for (topic, parts) in &state.partitions {
                let Some(stats) = statistics.topics.get(&**topic) else {
                    continue;
                };
                for (n, p) in parts {
                    let (Some(position), Some(ps)) = (p.position(), stats.partitions.get(n)) else {
                        continue;
                    };
                    if ps.hi_offset < 0 || p.blocked.is_some() {
                        continue;
                    }
                    now.push((topic.clone(), *n, (ps.hi_offset - position).max(0)));
                }
            }
            state.consumer.clone()
        };
        let gauge = |topic: &str, partition: i32| {
            metrics::gauge!(
                metrics_names::LAG,
                "consumer" => consumer.to_string(),
                "topic" => topic.to_owned(),
                "partition" => partition.to_string()
            )
        };
        let mut reported = self.lag_reported.lock().unwrap_or_else(|e| e.into_inner());
        for (topic, partition) in reported.iter() {
            if !now.iter().any(|(t, p, _)| t == topic && p == partition) {
                gauge(topic, *partition).set(0.0);
            }
        }
        reported.clear();
        for (topic, partition, lag) in now {
            gauge(&topic, partition).set(lag as f64);
            reported.push((topic, partition));
        }
    }
}

impl ConsumerContext for PollerContext {
    fn rebalance(&self, consumer: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
        self.rebalance_inner(consumer, err, tpl);
        self.shared.report_assignment();
    }

    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => tracing::trace!(count = offsets.count(), "offsets committed to the group"),
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => tracing::info!(
                error = %e,
                "group offset commit failed; harmless: positions live in the database, and a later commit catches up"
            ),
        }
    }
}

impl PollerContext {
    fn rebalance_inner(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(consumer.rebalance_protocol(), RebalanceProtocol::Cooperative);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => self.assign(consumer, tpl, cooperative),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => self.revoke(consumer, tpl, cooperative),
            other => {
                tracing::warn!(error = ?other, "rebalance error; dropping the assignment");
                metrics::counter!(metrics_names::REBALANCES, "kind" => "error").increment(1);
                self.forget(tpl, cooperative);
                let result = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = result {
                    tracing::info!(error = %e, "unassign after a rebalance error failed");
                }
            }
        }
    }

    fn assign(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList, cooperative: bool) {
        metrics::counter!(metrics_names::REBALANCES, "kind" => "assign").increment(1);
        let mut tpl = tpl.clone();
        let config = &self.shared.config;
        let topics: BTreeSet<String> = tpl.elements().iter().map(|e| e.topic().to_owned()).collect();
        // The rebalance must be completed with an (empty) assignment when it is not taken:
        // returning without one leaves librdkafka waiting for the assign call, and then closing
        // the consumer never finishes.
        let take_nothing = || {
            let nothing = TopicPartitionList::new();
            let done = if cooperative {
                consumer.incremental_assign(&nothing)
            } else {
                consumer.assign(&nothing)
            };
            if let Err(e) = done {
                tracing::info!(error = %e, "completing the rebalance with an empty assignment failed");
            }
        };
        for topic in &topics {
            let group = config.group_id.clone();
            let Some(recorded) = self.store_call(
                topic,
                "recording the consumer group",
                move |store, consumer, topic| {
                    let group = group.clone();
                    Box::pin(async move {
                        store
                            .record_subscription(&consumer, "kafka", &topic, &group)
                            .await
                    })
                },
            ) else {
                tracing::info!("stopping: assignment not taken");
                take_nothing();
                return;
            };
            if let Some(other) = recorded {
                let text = format!(
                    "consumer {:?} reads topic {topic:?} through consumer group {other:?} (recorded in the database), not {:?}: two groups under one consumer name share one inbox and one set of positions, and each would skip the other's messages as duplicates. Give this service its own consumer name, or move the consumer to the new group on purpose with `txinbox positions rebind`",
                    config.consumer_name, config.group_id
                );
                tracing::error!(error = %text, "refusing the assignment");
                *self.shared.fatal.lock().unwrap_or_else(|e| e.into_inner()) = Some(text);
                take_nothing();
                return;
            }
        }
        let mut from_db = Vec::new();
        let mut starts: HashMap<(String, i32), i64> = HashMap::new();
        for topic in &topics {
            let Some(positions) =
                self.store_call(topic, "loading database positions", |store, consumer, topic| {
                    Box::pin(async move { store.load(&consumer, &topic).await })
                })
            else {
                tracing::info!("stopping: assignment not taken");
                take_nothing();
                return;
            };
            for (lane, next) in positions {
                let Ok(partition) = lane.parse::<i32>() else {
                    continue;
                };
                if tpl.find_partition(topic, partition).is_some() {
                    if let Err(e) = tpl.set_partition_offset(topic, partition, Offset::Offset(next)) {
                        tracing::warn!(%topic, partition, error = %e, "could not set a start offset");
                        continue;
                    }
                    from_db.push(format!("{topic}/{partition}@{next}"));
                    starts.insert((topic.clone(), partition), next);
                }
            }
        }
        let blocked = self.without_position(consumer, &mut tpl, &starts);
        let assigned: Vec<String> = tpl
            .elements()
            .iter()
            .map(|e| format!("{}/{}", e.topic(), e.partition()))
            .collect();
        let mut hold = TopicPartitionList::new();
        {
            let mut state = self.shared.lock();
            if !cooperative {
                state.clear();
            }
            for e in tpl.elements() {
                state.next_epoch += 1;
                let epoch = state.next_epoch;
                let topic: Arc<str> = e.topic().into();
                let mut partition = Partition::new(epoch, topic.clone(), e.partition());
                if let Some(next) = starts.get(&(e.topic().to_owned(), e.partition())) {
                    // Everything below the database position is done: store it for the group
                    // commit at once, so the group's offset catches up after a crash between
                    // the database commit and the offset commit even if nothing new arrives.
                    partition.start_at(*next);
                }
                if let Some(group_offset) = blocked.get(&(e.topic().to_owned(), e.partition())) {
                    partition.blocked = Some(*group_offset);
                    state.set_blocked(&partition, true);
                    hold.add_partition(e.topic(), e.partition());
                }
                if let Some(old) = state
                    .partitions
                    .entry(topic)
                    .or_default()
                    .insert(e.partition(), partition)
                {
                    state.set_blocked(&old, false);
                }
            }
        }
        let result = if cooperative {
            consumer.incremental_assign(&tpl)
        } else {
            consumer.assign(&tpl)
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "assigning partitions failed");
        }
        // Paused partitions stay paused across reassignment: start every new one resumed,
        // except those held for a missing database position.
        if let Err(e) = consumer.resume(&tpl) {
            tracing::debug!(error = %e, "resuming newly assigned partitions failed");
        }
        if hold.count() > 0 {
            if let Err(e) = consumer.pause(&hold) {
                tracing::warn!(error = %e, "pausing partitions without a database position failed; their messages are dropped until they have one");
            }
        }
        tracing::info!(
            partitions = ?assigned,
            from_database = ?from_db,
            held = hold.count(),
            "partitions assigned (those without a database position: see on_missing_position)"
        );
    }

    /// Decides where the partitions of `tpl` without a database position start, by
    /// [`KafkaConfig::on_missing_position`], and sets it in `tpl`. Returns the partitions to
    /// hold (`Refuse`), with the group's offset (`None`: it could not be read).
    fn without_position(
        &self,
        consumer: &BaseConsumer<Self>,
        tpl: &mut TopicPartitionList,
        starts: &HashMap<(String, i32), i64>,
    ) -> HashMap<(String, i32), Option<i64>> {
        let config = &self.shared.config;
        let policy = config.on_missing_position;
        let mut missing = TopicPartitionList::new();
        for e in tpl.elements() {
            if !starts.contains_key(&(e.topic().to_owned(), e.partition())) {
                missing.add_partition(e.topic(), e.partition());
            }
        }
        let mut blocked = HashMap::new();
        if missing.count() == 0 || policy == MissingPosition::AdoptGroupOffset {
            // Adopt: the group's committed offset, else auto.offset.reset (librdkafka's own
            // choice for an assignment without an offset).
            if missing.count() > 0 {
                tracing::info!(
                    partitions = missing.count(),
                    "partitions without a database position start at the group's offset (on_missing_position = adopt)"
                );
            }
            return blocked;
        }
        let committed = self.committed(consumer, &missing);
        for e in missing.elements() {
            let (topic, partition) = (e.topic(), e.partition());
            let group_offset = match committed
                .as_ref()
                .and_then(|c| c.get(&(topic.to_owned(), partition)))
            {
                // Nothing the group passed: auto.offset.reset applies, as it always did, set
                // here rather than left to librdkafka's own later fetch of the group's offset.
                Some(None) => {
                    if let Err(e) = tpl.set_partition_offset(topic, partition, config.reset_offset()) {
                        tracing::warn!(%topic, partition, error = %e, "could not set a start offset");
                    }
                    continue;
                }
                Some(Some(o)) => Some(*o),
                // Could not be read: held (Refuse) until it can be, or a position is written.
                None => None,
            };
            match policy {
                MissingPosition::Earliest => {
                    tracing::warn!(
                        %topic,
                        partition,
                        group = %config.group_id,
                        group_offset = ?group_offset,
                        "the database has no position for this partition and the group has passed records of it: starting at the earliest retained offset (on_missing_position = earliest); the inbox drops what was applied already"
                    );
                    if let Err(e) = tpl.set_partition_offset(topic, partition, Offset::Beginning) {
                        tracing::warn!(%topic, partition, error = %e, "could not set a start offset");
                    }
                }
                _ => {
                    let shown = group_offset
                        .map_or_else(|| "unknown (it could not be read)".to_owned(), |o| o.to_string());
                    tracing::error!(
                        %topic,
                        partition,
                        group = %config.group_id,
                        consumer = %config.consumer_name,
                        group_offset = %shown,
                        "NOT consuming {topic}/{partition}: consumer group {:?} has committed offset {shown} but the database has no position for consumer {:?} (restored from a dump taken before this partition was first processed, or a fresh database?). Starting at the group's offset would skip the effects of everything before it. Ways out: start it from the earliest retained offset (KafkaConfig::on_missing_position(MissingPosition::Earliest), or `txinbox positions set --to-earliest`), or count everything before the group's offset as done (MissingPosition::AdoptGroupOffset, or `txinbox positions adopt`). A position written to the database is picked up within {BLOCKED_RECHECK:?}, without a restart",
                        config.group_id,
                        config.consumer_name,
                    );
                    // Assigned (the group keeps it here) and paused at once; nothing of it is
                    // handed out while it is blocked.
                    let start = group_offset.map_or(Offset::Invalid, Offset::Offset);
                    if let Err(e) = tpl.set_partition_offset(topic, partition, start) {
                        tracing::warn!(%topic, partition, error = %e, "could not set a start offset");
                    }
                    blocked.insert((topic.to_owned(), partition), group_offset);
                }
            }
        }
        blocked
    }

    /// The group's committed offsets of `partitions` (`None` for those without one), or `None`
    /// if they could not be read. Runs on the poller thread, inside the rebalance callback.
    fn committed(
        &self,
        consumer: &BaseConsumer<Self>,
        partitions: &TopicPartitionList,
    ) -> Option<HashMap<(String, i32), Option<i64>>> {
        for attempt in 1..=3 {
            if self.shared.stopping() {
                return None;
            }
            match consumer.committed_offsets(partitions.clone(), COMMITTED_TIMEOUT) {
                Ok(committed) => {
                    return Some(
                        committed
                            .elements()
                            .iter()
                            // A partition whose offset came back with an error is left out: its
                            // offset is unknown, not absent.
                            .filter(|e| match e.error() {
                                Ok(()) => true,
                                Err(error) => {
                                    tracing::warn!(topic = e.topic(), partition = e.partition(), %error, "reading the group's committed offset of a partition failed");
                                    false
                                }
                            })
                            .map(|e| {
                                let offset = match e.offset() {
                                    // A group offset of 0 passed nothing.
                                    Offset::Offset(o) if o > 0 => Some(o),
                                    _ => None,
                                };
                                ((e.topic().to_owned(), e.partition()), offset)
                            })
                            .collect(),
                    );
                }
                Err(e) => tracing::warn!(attempt, error = %e, "reading the group's committed offsets failed"),
            }
        }
        None
    }

    fn revoke(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList, cooperative: bool) {
        metrics::counter!(metrics_names::REBALANCES, "kind" => "revoke").increment(1);
        let lost = consumer.assignment_lost();
        let keys: Vec<(String, i32)> = tpl
            .elements()
            .iter()
            .map(|e| (e.topic().to_owned(), e.partition()))
            .collect();
        let mut state = self.shared.lock();
        for (topic, partition) in &keys {
            if let Some(p) = state.get_mut(topic, *partition) {
                p.revoking = true;
            }
        }
        if !lost && !self.shared.stopping() {
            let timeout = self.shared.config.revoke_timeout;
            let busy = |st: &mut State| {
                keys.iter()
                    .any(|(t, p)| st.get_mut(t, *p).is_some_and(|p| p.in_flight > 0))
            };
            state = self
                .shared
                .settled
                .wait_timeout_while(state, timeout, busy)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let mut commit = TopicPartitionList::new();
        let mut still_running = 0;
        for (topic, partition) in &keys {
            if let Some(p) = state.remove(topic, *partition) {
                still_running += p.in_flight;
                if let Some(next) = p.done_next() {
                    let _ = commit.add_partition_offset(topic, *partition, Offset::Offset(next));
                }
            }
        }
        drop(state);
        // The revoked partitions are drained, their final offsets not yet committed: a crash
        // here must leave the new owner to start from the database positions.
        txinbox::crash::hit(txinbox::crash::REBALANCE);
        if lost {
            tracing::info!(
                partitions = ?keys,
                "assignment lost: nothing committed; the new owner redelivers from the database position and the inbox deduplicates"
            );
        } else {
            if still_running > 0 {
                tracing::warn!(
                    still_running,
                    timeout = ?self.shared.config.revoke_timeout,
                    "revocation did not drain in time; those messages finish but their offsets are not stored (the new owner redelivers, the inbox deduplicates)"
                );
            }
            if self.shared.config.group_commits() && commit.count() > 0 {
                if let Err(e) = consumer.store_offsets(&commit) {
                    tracing::info!(error = %e, "storing final offsets on revoke failed (benign)");
                }
                match consumer.commit(&commit, CommitMode::Sync) {
                    Ok(()) => tracing::debug!(count = commit.count(), "final offsets committed on revoke"),
                    Err(e) => tracing::info!(
                        error = %e,
                        "committing final offsets on revoke failed; harmless: the database positions decide where the next owner starts"
                    ),
                }
            }
            tracing::info!(partitions = ?keys, "partitions revoked");
        }
        let result = if cooperative {
            consumer.incremental_unassign(tpl)
        } else {
            consumer.unassign()
        };
        if let Err(e) = result {
            tracing::info!(error = %e, "unassign failed");
        }
    }

    fn forget(&self, tpl: &TopicPartitionList, cooperative: bool) {
        let mut state = self.shared.lock();
        if cooperative {
            for e in tpl.elements() {
                state.remove(e.topic(), e.partition());
            }
        } else {
            state.clear();
        }
        drop(state);
        self.shared.settled.notify_all();
    }

    /// Runs a store operation for `topic` on the runtime and waits for it, retrying while the
    /// database is unavailable (fail closed). `None`: the source is stopping.
    fn store_call<T: Send + 'static>(
        &self,
        topic: &str,
        what: &str,
        op: impl Fn(Arc<dyn PositionStore>, String, String) -> BoxFuture<'static, Result<T, StoreError>>,
    ) -> Option<T> {
        let mut failures: u32 = 0;
        loop {
            if self.shared.stopping() {
                return None;
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let call = op(
                self.positions.clone(),
                self.shared.config.consumer_name.clone(),
                topic.to_owned(),
            );
            self.runtime.spawn(async move {
                let _ = tx.send(call.await);
            });
            let started = Instant::now();
            let error = loop {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(Ok(value)) => return Some(value),
                    Ok(Err(e)) => break e.to_string(),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) if started.elapsed() < LOAD_TIMEOUT => {
                        if self.shared.stopping() {
                            return None;
                        }
                    }
                    Err(e) => break format!("no answer within {LOAD_TIMEOUT:?}: {e}"),
                }
            };
            failures += 1;
            let delay = Duration::from_millis(100 * 2u64.pow(failures.min(6))).min(Duration::from_secs(5));
            tracing::warn!(
                %topic,
                %error,
                ?delay,
                "{what} failed; the assignment waits (fail closed)"
            );
            std::thread::sleep(delay);
        }
    }
}

/// The poller thread: polls, hands messages over, stores settled offsets, pauses and resumes;
/// rebalance callbacks run inside `poll`. On stop: final store and commit, unsubscribe, close.
fn poll_loop(
    consumer: BaseConsumer<PollerContext>,
    shared: &Arc<Shared>,
    tx: &mpsc::UnboundedSender<Result<Item, SourceError>>,
) {
    let mut last_housekeeping = Instant::now();
    let mut recheck = Recheck::default();
    while !shared.stopping() && !tx.is_closed() {
        if last_housekeeping.elapsed() >= POLL_INTERVAL {
            housekeeping(&consumer, shared);
            recheck.run(&consumer, shared);
            last_housekeeping = Instant::now();
        }
        match consumer.poll(POLL_INTERVAL) {
            None => {}
            Some(Ok(m)) => on_message(shared, tx, &m),
            Some(Err(e)) => on_poll_error(&consumer, tx, e),
        }
        if let Some(reason) = shared.fatal.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(Err(SourceError::fatal(reason)));
        }
    }
    housekeeping(&consumer, shared);
    if shared.config.group_commits() {
        match consumer.commit_consumer_state(CommitMode::Sync) {
            Ok(()) => tracing::debug!("final offsets committed"),
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                tracing::info!(error = %e, "final offset commit failed (benign: positions live in the database)")
            }
        }
    }
    consumer.unsubscribe();
    // Dropping closes the consumer (leaves the group, runs the final revocation); it blocks,
    // which is why it happens here and not on a runtime worker.
    drop(consumer);
    tracing::debug!("Kafka consumer closed");
}

fn on_message(
    shared: &Shared,
    tx: &mpsc::UnboundedSender<Result<Item, SourceError>>,
    m: &BorrowedMessage<'_>,
) {
    let (partition, offset) = (m.partition(), m.offset());
    let (topic, generation, lane) = {
        let mut state = shared.lock();
        let Some(p) = state.get_mut(m.topic(), partition) else {
            return; // not (or no longer) assigned to us
        };
        if p.revoking || p.blocked.is_some() {
            return;
        }
        if !p.receive(offset) {
            tracing::debug!(
                topic = m.topic(),
                partition,
                offset,
                "ignoring an already received offset"
            );
            return;
        }
        (p.topic.clone(), p.generation.clone(), p.lane.clone())
    };
    // Copy out of librdkafka's buffer now: a BorrowedMessage must not outlive this poll.
    let mut headers = Headers::new();
    if let Some(hs) = m.headers() {
        for h in hs.iter() {
            headers.insert(h.key, h.value.map(<[u8]>::to_vec).unwrap_or_default());
        }
    }
    let origin = Origin::new("kafka", topic.clone()).at(partition, offset);
    let mut message =
        Message::new(m.payload().map(<[u8]>::to_vec).unwrap_or_default(), origin).with_headers(headers);
    if let Some(key) = m.key() {
        message = message.with_key(key.to_vec());
    }
    let item = Item {
        topic,
        partition,
        offset,
        timestamp: m.timestamp().to_millis(),
        generation,
        lane,
        message,
    };
    // If the source is gone the loop ends at its next check.
    let _ = tx.send(Ok(item));
}

fn on_poll_error(
    consumer: &BaseConsumer<PollerContext>,
    tx: &mpsc::UnboundedSender<Result<Item, SourceError>>,
    e: KafkaError,
) {
    if e.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal) {
        let reason = consumer
            .client()
            .fatal_error()
            .map(|(code, text)| format!("{code:?}: {text}"))
            .unwrap_or_default();
        tracing::error!(error = %e, %reason, "fatal Kafka consumer error");
        let _ = tx.send(Err(SourceError::fatal(format!(
            "fatal Kafka consumer error: {e} {reason}"
        ))));
        return;
    }
    consumer.context().error(e, "consume");
}

/// Stores offsets that moved, pauses partitions with too many unsettled messages and resumes
/// those that drained to half.
fn housekeeping(consumer: &BaseConsumer<PollerContext>, shared: &Shared) {
    let high = shared.config.max_buffered_per_partition;
    let mut store = TopicPartitionList::new();
    let mut pause = TopicPartitionList::new();
    let mut resume = TopicPartitionList::new();
    {
        let mut state = shared.lock();
        for (topic, parts) in state.partitions.iter_mut() {
            for (partition, p) in parts.iter_mut() {
                if p.revoking || p.blocked.is_some() {
                    continue;
                }
                if let Some(next) = p.take_store() {
                    let _ = store.add_partition_offset(topic, *partition, Offset::Offset(next));
                }
                match p.flow(high) {
                    Some(true) => {
                        pause.add_partition(topic, *partition);
                    }
                    Some(false) => {
                        resume.add_partition(topic, *partition);
                    }
                    None => {}
                }
            }
        }
    }
    if store.count() > 0 {
        if let Err(e) = consumer.store_offsets(&store) {
            // _STATE: the partition was revoked meanwhile; the new owner redelivers.
            tracing::info!(error = %e, "storing offsets failed (benign)");
        }
    }
    if pause.count() > 0 {
        metrics::counter!(metrics_names::PAUSES).increment(pause.count() as u64);
        tracing::debug!(
            partitions = pause.count(),
            "pausing partitions: too many unsettled messages"
        );
        if let Err(e) = consumer.pause(&pause) {
            tracing::info!(error = %e, "pausing partitions failed");
        }
    }
    if resume.count() > 0 {
        tracing::debug!(partitions = resume.count(), "resuming partitions");
        if let Err(e) = consumer.resume(&resume) {
            tracing::info!(error = %e, "resuming partitions failed");
        }
    }
}

/// The answers of one round of position loads, by topic.
type Loaded = Vec<(Arc<str>, Result<Vec<(String, i64)>, StoreError>)>;

/// Re-reads the database positions of blocked partitions every [`BLOCKED_RECHECK`], without
/// blocking the poller: the read runs on the runtime, its answer is picked up by a later turn.
#[derive(Default)]
struct Recheck {
    last: Option<Instant>,
    pending: Option<std::sync::mpsc::Receiver<Loaded>>,
}

impl Recheck {
    fn run(&mut self, consumer: &BaseConsumer<PollerContext>, shared: &Shared) {
        if let Some(rx) = &self.pending {
            match rx.try_recv() {
                Ok(answers) => {
                    self.pending = None;
                    for (topic, answer) in answers {
                        match answer {
                            Ok(positions) => release(consumer, shared, &topic, &positions),
                            Err(e) => {
                                tracing::warn!(%topic, error = %e, "reading the positions of blocked partitions failed; trying again")
                            }
                        }
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => return,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => self.pending = None,
            }
        }
        if self.last.is_some_and(|t| t.elapsed() < BLOCKED_RECHECK) {
            return;
        }
        self.last = Some(Instant::now());
        recheck_unknown_group_offsets(consumer, shared);
        let blocked = shared.lock().blocked();
        if blocked.is_empty() {
            return;
        }
        let topics: BTreeSet<Arc<str>> = blocked.into_iter().map(|(t, _)| t).collect();
        let context = consumer.context();
        let store = context.positions.clone();
        let name = shared.config.consumer_name.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        context.runtime.spawn(async move {
            let mut answers = Vec::new();
            for topic in topics {
                let answer = tokio::time::timeout(LOAD_TIMEOUT, store.load(&name, &topic))
                    .await
                    .unwrap_or_else(|_| {
                        Err(StoreError::transient(format!(
                            "no answer within {LOAD_TIMEOUT:?}"
                        )))
                    });
                answers.push((topic, answer));
            }
            let _ = tx.send(answers);
        });
        self.pending = Some(rx);
    }
}

/// Reads the group's committed offsets of partitions blocked because they could not be read
/// (a coordinator still loading, brokers rolling). Where the group has passed nothing, there
/// was nothing to refuse: the partition starts at `auto.offset.reset`. Where it has, the
/// partition stays held with that offset. On the poller thread, with a short timeout, only
/// while such partitions exist.
fn recheck_unknown_group_offsets(consumer: &BaseConsumer<PollerContext>, shared: &Shared) {
    let unknown: Vec<(Arc<str>, i32)> = {
        let state = shared.lock();
        state
            .partitions
            .iter()
            .flat_map(|(t, ps)| {
                ps.iter()
                    .filter(|(_, p)| p.blocked == Some(None) && !p.revoking)
                    .map(move |(n, _)| (t.clone(), *n))
            })
            .collect()
    };
    if unknown.is_empty() {
        return;
    }
    let mut tpl = TopicPartitionList::new();
    for (topic, partition) in &unknown {
        tpl.add_partition(topic, *partition);
    }
    let committed = match consumer.committed_offsets(tpl, Duration::from_secs(1)) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(error = %e, "the group's committed offsets of held partitions are still unreadable");
            return;
        }
    };
    for e in committed.elements() {
        if e.error().is_err() {
            continue;
        }
        let (topic, partition) = (e.topic(), e.partition());
        match e.offset() {
            Offset::Offset(o) if o > 0 => {
                let mut state = shared.lock();
                if let Some(p) = state
                    .get_mut(topic, partition)
                    .filter(|p| p.blocked == Some(None))
                {
                    p.blocked = Some(Some(o));
                    tracing::error!(%topic, partition, group_offset = o, "held partition: the group's committed offset is {o} and the database has no position (see the earlier error for the ways out)");
                }
            }
            _ => {
                let reset = shared.config.reset_offset();
                if let Err(error) = consumer.seek(topic, partition, reset, Duration::from_secs(5)) {
                    tracing::info!(%topic, partition, %error, "starting a released partition at auto.offset.reset failed; trying again");
                    continue;
                }
                {
                    let mut state = shared.lock();
                    let Some(p) = state.get_mut(topic, partition) else {
                        continue;
                    };
                    if p.blocked.take().is_some() {
                        state.count_blocked(topic, false);
                    }
                }
                let mut one = TopicPartitionList::new();
                one.add_partition(topic, partition);
                if let Err(error) = consumer.resume(&one) {
                    tracing::warn!(%topic, partition, %error, "resuming a released partition failed");
                }
                tracing::warn!(%topic, partition, "the group has passed nothing of this held partition after all: consuming it from auto.offset.reset");
            }
        }
    }
}

/// Starts the blocked partitions of `topic` that now have a database position there.
fn release(
    consumer: &BaseConsumer<PollerContext>,
    shared: &Shared,
    topic: &str,
    positions: &[(String, i64)],
) {
    for (lane, next) in positions {
        let Ok(partition) = lane.parse::<i32>() else {
            continue;
        };
        if !shared
            .lock()
            .get_mut(topic, partition)
            .is_some_and(|p| p.blocked.is_some() && !p.revoking)
        {
            continue;
        }
        if let Err(e) = consumer.seek(topic, partition, Offset::Offset(*next), Duration::from_secs(5)) {
            tracing::info!(%topic, partition, error = %e, "starting a released partition at its database position failed; trying again");
            continue;
        }
        {
            let mut state = shared.lock();
            let Some(p) = state.get_mut(topic, partition) else {
                continue;
            };
            p.start_at(*next);
            if p.blocked.take().is_some() {
                state.count_blocked(topic, false);
            }
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, partition);
        if let Err(e) = consumer.resume(&tpl) {
            tracing::warn!(%topic, partition, error = %e, "resuming a released partition failed");
        }
        tracing::warn!(
            %topic,
            partition,
            next,
            "a database position appeared for a blocked partition: consuming it from there"
        );
    }
}
