//! [`KafkaSource`] and [`KafkaDelivery`]: the poller thread, rebalance handling, offset storing
//! and dead-letter producing.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
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

use crate::config::KafkaConfig;
use crate::tracker::{Generation, Partition};
use crate::{headers, metrics_names};

/// How long one `poll` waits; also the longest delay before a settled offset is stored.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long one attempt to load database positions may take during an assignment.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);

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
}

impl<S: InboxStore> PositionStore for S {
    fn load<'a>(
        &'a self,
        consumer: &'a str,
        topic: &'a str,
    ) -> BoxFuture<'a, Result<Vec<(String, i64)>, StoreError>> {
        self.load_positions(consumer, topic)
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
///   there is one, else at the group's committed offset, else at `auto.offset.reset`. That makes
///   a crash between the database commit and the offset commit, and a database restore, resume
///   exactly where the database's state ends.
/// - **Rebalances** (eager and cooperative-sticky) run on the poller thread: a revocation stops
///   handing out the revoked partitions' messages, waits up to
///   [`revoke_timeout`](KafkaConfig::revoke_timeout) for their in-flight messages, stores and
///   commits synchronously, then gives them up. Lost assignments and `_STATE` errors are benign
///   (the new owner redelivers, the inbox deduplicates) and logged at info.
/// - **Backpressure**: a partition with [`max_buffered_per_partition`](KafkaConfig::max_buffered_per_partition)
///   unsettled messages is paused, and resumed at half of that; the poller keeps polling.
/// - **Dead letters** go to `<topic>.dlq` (or the configured topic) with the original key,
///   payload and headers plus `txinbox.dlq.*` headers ([`headers`](crate::headers)); the
///   original offset is stored only after the broker confirmed the dead letter.
pub struct KafkaSource {
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Result<Item, SourceError>>,
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
}

#[derive(Default)]
struct State {
    partitions: HashMap<Arc<str>, HashMap<i32, Partition>>,
    next_epoch: u64,
}

impl State {
    fn get_mut(&mut self, topic: &str, partition: i32) -> Option<&mut Partition> {
        self.partitions.get_mut(topic)?.get_mut(&partition)
    }

    fn remove(&mut self, topic: &str, partition: i32) -> Option<Partition> {
        let parts = self.partitions.get_mut(topic)?;
        let p = parts.remove(&partition);
        if parts.is_empty() {
            self.partitions.remove(topic);
        }
        p
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
        let producer: FutureProducer = config
            .producer_config()
            .create()
            .map_err(|e| txinbox::Error::Config(format!("creating the dead-letter producer failed: {e}")))?;
        let shared = Arc::new(Shared {
            config: config.clone(),
            state: Mutex::new(State::default()),
            settled: Condvar::new(),
            stop: AtomicBool::new(false),
            producer,
        });
        let context = PollerContext {
            shared: shared.clone(),
            positions: Arc::new(positions),
            runtime,
            last_error: Mutex::new(String::new()),
        };
        let consumer: BaseConsumer<PollerContext> = config
            .consumer_config()
            .create_with_context(context)
            .map_err(|e| txinbox::Error::Config(format!("creating the Kafka consumer failed: {e}")))?;
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
            // NOTE: cancellation safe: an item stays in the channel until `recv` returns it.
            let item = match self.rx.recv().await {
                Some(Ok(item)) => item,
                Some(Err(e)) => return Err(e),
                None if self.shared.stopping() => return Ok(None),
                None => return Err(SourceError::fatal("the Kafka poller thread stopped")),
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

    /// Produces the dead letter and waits for the broker's confirmation, retrying while the
    /// partition stays assigned.
    async fn produce_dead_letter(&self, dl: &DeadLetter) -> Result<(), SettleError> {
        let config = &self.shared.config;
        let topic = config.dead_letter_topic_for(&self.topic);
        let mut failures: u32 = 0;
        loop {
            let error = match self
                .shared
                .producer
                .send_result(self.dead_letter_record(&topic, dl))
            {
                Ok(delivery) => {
                    let wait = config.dead_letter_timeout + Duration::from_secs(5);
                    match tokio::time::timeout(wait, delivery).await {
                        Ok(Ok(Ok(_))) => {
                            metrics::counter!(metrics_names::DEAD_LETTERS_PRODUCED, "topic" => topic.clone())
                                .increment(1);
                            return Ok(());
                        }
                        Ok(Ok(Err((e, _)))) => e.to_string(),
                        Ok(Err(_)) => "the dead-letter producer was dropped".to_string(),
                        Err(_) => format!("no delivery report within {wait:?}"),
                    }
                }
                Err((e, _)) => e.to_string(),
            };
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
            let delay = Duration::from_millis(100 * 2u64.pow(failures.min(6))).min(Duration::from_secs(5));
            tracing::warn!(%topic, %error, ?delay, "producing a dead letter failed; retrying");
            tokio::time::sleep(delay).await;
        }
    }

    fn dead_letter_record<'a>(&'a self, topic: &'a str, dl: &'a DeadLetter) -> FutureRecord<'a, [u8], [u8]> {
        let mut h = OwnedHeaders::new_with_capacity(self.message.headers().len() + 7);
        for (key, value) in self.message.headers().iter() {
            h = h.insert(Header {
                key,
                value: Some(value),
            });
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
        let mut record = FutureRecord::to(topic)
            .payload(self.message.payload().as_ref())
            .headers(h);
        if let Some(key) = self.message.key() {
            record = record.key(key.as_ref());
        }
        record
    }
}

#[async_trait]
impl Delivery for KafkaDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    fn lane(&self) -> Lane {
        Lane::Ordered(self.lane.clone())
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
                _ => {}
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
}

impl ConsumerContext for PollerContext {
    fn rebalance(&self, consumer: &BaseConsumer<Self>, err: RDKafkaRespErr, tpl: &mut TopicPartitionList) {
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
    fn assign(&self, consumer: &BaseConsumer<Self>, tpl: &TopicPartitionList, cooperative: bool) {
        metrics::counter!(metrics_names::REBALANCES, "kind" => "assign").increment(1);
        let mut tpl = tpl.clone();
        let topics: BTreeSet<String> = tpl.elements().iter().map(|e| e.topic().to_owned()).collect();
        let mut from_db = Vec::new();
        let mut starts: HashMap<(String, i32), i64> = HashMap::new();
        for topic in &topics {
            let Some(positions) = self.load_positions(topic) else {
                // Stopping. The rebalance must still be completed with an (empty) assignment:
                // returning without one leaves librdkafka waiting for the assign call, and then
                // closing the consumer never finishes.
                tracing::info!("stopping: assignment not taken");
                let nothing = TopicPartitionList::new();
                let done = if cooperative {
                    consumer.incremental_assign(&nothing)
                } else {
                    consumer.assign(&nothing)
                };
                if let Err(e) = done {
                    tracing::info!(error = %e, "completing the rebalance with an empty assignment failed");
                }
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
        let assigned: Vec<String> = tpl
            .elements()
            .iter()
            .map(|e| format!("{}/{}", e.topic(), e.partition()))
            .collect();
        {
            let mut state = self.shared.lock();
            if !cooperative {
                state.partitions.clear();
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
                state
                    .partitions
                    .entry(topic)
                    .or_default()
                    .insert(e.partition(), partition);
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
        // Paused partitions stay paused across reassignment: start every new one resumed.
        if let Err(e) = consumer.resume(&tpl) {
            tracing::debug!(error = %e, "resuming newly assigned partitions failed");
        }
        tracing::info!(
            partitions = ?assigned,
            from_database = ?from_db,
            "partitions assigned (others start at the group's offset, else auto.offset.reset)"
        );
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
            state.partitions.clear();
        }
        drop(state);
        self.shared.settled.notify_all();
    }

    /// Loads the database positions of `topic`, retrying while the database is unavailable.
    /// `None`: the source is stopping.
    fn load_positions(&self, topic: &str) -> Option<Vec<(String, i64)>> {
        let mut failures: u32 = 0;
        loop {
            if self.shared.stopping() {
                return None;
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let positions = self.positions.clone();
            let consumer = self.shared.config.consumer_name.clone();
            let owned_topic = topic.to_owned();
            self.runtime.spawn(async move {
                let _ = tx.send(positions.load(&consumer, &owned_topic).await);
            });
            let started = Instant::now();
            let error = loop {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(Ok(positions)) => return Some(positions),
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
                "loading database positions failed; the assignment waits (fail closed)"
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
    while !shared.stopping() && !tx.is_closed() {
        if last_housekeeping.elapsed() >= POLL_INTERVAL {
            housekeeping(&consumer, shared);
            last_housekeeping = Instant::now();
        }
        match consumer.poll(POLL_INTERVAL) {
            None => {}
            Some(Ok(m)) => on_message(shared, tx, &m),
            Some(Err(e)) => on_poll_error(&consumer, tx, e),
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
        if p.revoking {
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
                if p.revoking {
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
