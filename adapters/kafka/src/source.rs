//! [`KafkaSource`]: creates the consumer and its poller thread, hands out what the poller
//! received (partitions in turn) and closes.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use async_trait::async_trait;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::FutureProducer;
use tokio::sync::{mpsc, oneshot};
use txinbox::position::ConsumerPositions;
use txinbox::source::{Capabilities, RetryMode, SourceError};
use txinbox::{IdStrategy, MessageSource};

use crate::config::{masked_error, KafkaConfig};
use crate::connection::ConnectionContext;
use crate::delivery::KafkaDelivery;
use crate::error::KafkaError;
use crate::poller::{poll_loop, PollerContext};
use crate::ready::Ready;
use crate::state::{Item, Shared, State};

/// A Kafka consumer-group member as a [`MessageSource`].
///
/// - **Lanes**: by default one per topic-partition (`Lane::Ordered("topic/partition")`):
///   partitions are processed concurrently, each in offset order. With
///   [`KafkaConfig::ordering`] one per record key within a partition, or none: then a
///   partition's records settle out of order and its offset and database position move only to
///   the contiguous settled prefix ([`Delivery::position_to_store`]), stored again when the
///   partition is given up or quiet.
/// - **Offsets**: `enable.auto.offset.store=false`; a partition's stored offset is its highest
///   contiguous settled offset + 1, so nothing is stored for a message whose transaction has not
///   committed. Stored offsets reach the group through librdkafka's auto-commit (for lag tools)
///   and synchronously on revocation and close.
/// - **Positions**: [`Delivery::position`] is `(topic, partition, offset + 1)`, which the runtime
///   stores with the effects under partition ordering. On assignment each partition starts at
///   the database position when there is one. That makes a crash between the database commit and the offset commit, and a
///   database restore, resume exactly where the database's state ends. Without one: at
///   `auto.offset.reset` when the group has no committed offset either, else as
///   [`KafkaConfig::on_missing_position`] says (default: hold the partition until a position is
///   written). The positions read are those of the consumer the source is given to: it hands
///   over its name and store when it is built ([`MessageSource::attach_positions`]), and the
///   source does not join the group before. The consumer group is recorded with the consumer
///   name on assignment; another group already recorded for the name stops the source.
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
///
/// [`Delivery::position`]: txinbox::Delivery::position
/// [`Delivery::position_to_store`]: txinbox::Delivery::position_to_store
pub struct KafkaSource {
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Result<Item, SourceError>>,
    /// What `rx` held when `receive` last looked, by partition: handed out in turn.
    ready: Ready<Item>,
    /// Lets the poller thread start polling, once the consumer's positions are attached;
    /// dropped unsent (close, drop), it lets the thread end without having polled.
    start_poller: Option<std::sync::mpsc::SyncSender<()>>,
    poller_done: Option<oneshot::Receiver<()>>,
    /// Set when a second, different consumer was attached: the source would read one
    /// consumer's positions while another writes its own, so `receive` refuses to go on.
    attached_twice: Option<String>,
    /// Where the dead-letter topics are looked up once the source starts.
    runtime: tokio::runtime::Handle,
}

impl fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSource")
            .field("group", &self.shared.config.group_id)
            .field("topics", &self.shared.config.topics)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// Creates the consumer, subscribes and starts the poller thread, which polls (joins the
    /// group) once the source is given to a consumer: [`ConsumerBuilder::build`] hands it the
    /// consumer's name and store, from which it reads the consumer's positions on assignment.
    /// To drive the source without a consumer, call
    /// [`attach_positions`](MessageSource::attach_positions) yourself before `receive`.
    ///
    /// Must be called inside a Tokio runtime: position loads during rebalances run on it.
    ///
    /// [`ConsumerBuilder::build`]: txinbox::ConsumerBuilder::build
    pub fn new(config: KafkaConfig) -> Result<Self, KafkaError> {
        config.validate().map_err(KafkaError::Config)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            KafkaError::Config("KafkaSource::new must be called inside a Tokio runtime".into())
        })?;
        let mut producer_config = config.producer_config();
        let producer_context = ConnectionContext::new(&mut producer_config);
        let producer: FutureProducer<ConnectionContext> = producer_config
            .create_with_context(producer_context)
            .map_err(|e| KafkaError::Client {
                context: "creating the dead-letter producer".into(),
                fatal: true,
                source: masked_error(&e, &producer_config).into(),
            })?;
        let shared = Arc::new(Shared {
            config: config.clone(),
            state: Mutex::new(State::new()),
            settled: Condvar::new(),
            stop: AtomicBool::new(false),
            producer,
            fatal: Mutex::new(None),
            health: OnceLock::new(),
            positions: OnceLock::new(),
        });
        let mut consumer_config = config.consumer_config();
        let context = PollerContext {
            shared: shared.clone(),
            runtime: runtime.clone(),
            connection: ConnectionContext::new(&mut consumer_config),
            last_error: Mutex::new(String::new()),
            lag_reported: Mutex::new(Vec::new()),
        };
        let consumer: BaseConsumer<PollerContext> =
            consumer_config
                .create_with_context(context)
                .map_err(|e| KafkaError::Client {
                    context: "creating the consumer".into(),
                    fatal: true,
                    source: masked_error(&e, &consumer_config).into(),
                })?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics).map_err(|e| KafkaError::Client {
            context: format!("subscribing to {topics:?}"),
            fatal: true,
            source: e.into(),
        })?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = oneshot::channel();
        let (start_tx, start_rx) = std::sync::mpsc::sync_channel(1);
        let poller_shared = shared.clone();
        static POLLERS: AtomicU64 = AtomicU64::new(0);
        std::thread::Builder::new()
            .name(format!(
                "txinbox-kafka-poll-{}",
                POLLERS.fetch_add(1, Ordering::Relaxed)
            ))
            .spawn(move || {
                // Nothing is polled before the consumer's positions are attached: an
                // assignment starts each partition at the consumer's database position.
                if start_rx.recv().is_ok() {
                    poll_loop(consumer, &poller_shared, &tx);
                }
                let _ = done_tx.send(());
            })
            .map_err(|e| KafkaError::Client {
                context: "starting the poller thread".into(),
                fatal: false,
                source: e.into(),
            })?;
        Ok(KafkaSource {
            shared,
            rx,
            ready: Ready::default(),
            start_poller: Some(start_tx),
            attached_twice: None,
            poller_done: Some(done_rx),
            runtime,
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
        if let Some(conflict) = &self.attached_twice {
            return Err(SourceError::fatal(conflict.clone()));
        }
        if self.shared.positions.get().is_none() {
            return Err(SourceError::fatal(
                "the Kafka source has no consumer to read positions for: give it to \
                 txinbox::Consumer::builder(..).source(..), whose build attaches the consumer's \
                 name and store, or call MessageSource::attach_positions before receive",
            ));
        }
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
                order: item.order,
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

    /// Takes the consumer's name and store: partitions start at this consumer's database
    /// positions, its name labels the metrics and dead letters. The poller starts polling
    /// (joins the group) now. Only the first call counts; a later call with another
    /// consumer's name makes every `receive` fail (fatal), as reading one consumer's
    /// positions for another would restart partitions from the wrong place.
    fn attach_positions(&mut self, positions: ConsumerPositions) {
        let name: Arc<str> = positions.consumer().into();
        if let Err(refused) = self.shared.positions.set(positions) {
            if refused.consumer() != self.shared.consumer_name() {
                // Fail closed: reading one consumer's positions while another commits its own
                // would restart every partition from the wrong place.
                let text = format!(
                    "the Kafka source was given to consumer \"{}\" after it had been attached to \
                     consumer \"{}\": a source reads the positions of one consumer only; give \
                     each consumer a source of its own and do not call attach_positions yourself \
                     on a source you hand to Consumer::builder",
                    refused.consumer(),
                    self.shared.consumer_name()
                );
                tracing::error!("{text}");
                self.attached_twice = Some(text);
            }
            return;
        }
        self.shared.lock().consumer = name;
        if let Some(start) = self.start_poller.take() {
            let _ = start.send(());
            crate::dead_letter::watch_topics(&self.shared, &self.runtime);
        }
    }

    async fn close(mut self) -> Result<(), SourceError> {
        // Everything received is settled by now: store where each partition's settled prefix
        // ends while the partitions are still ours (key and unordered ordering only).
        let assigned: Vec<(Arc<str>, i32)> = self
            .shared
            .lock()
            .partitions
            .iter()
            .flat_map(|(t, parts)| parts.keys().map(|n| (t.clone(), *n)))
            .collect();
        let prefixes = self.shared.settled_prefixes(assigned);
        self.shared.store_prefixes(prefixes).await;
        self.shared.stop.store(true, Ordering::SeqCst);
        // Never attached: the poller ends without having polled.
        drop(self.start_poller.take());
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
