//! The poller thread and the consumer's context: [`poll_loop`] polls, hands messages over,
//! stores settled offsets, pauses and resumes; [`PollerContext`] receives librdkafka's errors,
//! statistics (lag, broker connection), rebalances (see `assignment`) and commit results.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Headers as _, Message as _};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc;
use txinbox::{message::Headers, message::Origin, source::Lane, source::SourceError, Message};

use crate::assignment::Recheck;
use crate::config::{Keyless, Ordering};
use crate::connection::ConnectionContext;
use crate::state::{problem, Item, Shared};
use crate::telemetry;

/// Key and unordered ordering: how long a partition must be quiet before the source stores
/// its settled prefix as the database position itself (see `Partition::take_quiet_flush`).
const QUIET_FLUSH_AFTER: Duration = Duration::from_secs(1);

/// How long one `poll` waits; also the longest delay before a settled offset is stored.
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// The consumer's context: rebalance callbacks run in it, on the poller thread.
pub(crate) struct PollerContext {
    pub(crate) shared: Arc<Shared>,
    pub(crate) runtime: tokio::runtime::Handle,
    /// Reads librdkafka's errors and log lines for problems only a configuration change fixes
    /// (TLS, SASL): reported to the consumer's health until a broker is up.
    pub(crate) connection: ConnectionContext,
    pub(crate) last_error: Mutex<String>,
    /// The partitions whose lag gauge was last set (zeroed once no longer assigned).
    pub(crate) lag_reported: Mutex<Vec<(Arc<str>, i32)>>,
}

impl PollerContext {
    /// Reports a new connection problem found in librdkafka's `text` to the consumer's health.
    fn observe(&self, text: &str) -> bool {
        match self.connection.observe(text) {
            Some(problem) => {
                self.shared.set_problems(problem::CONNECTION, vec![problem]);
                true
            }
            None => false,
        }
    }
}

impl ClientContext for PollerContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        crate::connection::forward_log(level, fac, log_message);
        if fac == "FAIL" {
            self.observe(log_message);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if self.observe(reason) {
            return;
        }
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
            if up && self.connection.problem().is_some() {
                self.connection.clear();
                self.shared
                    .set_problems(problem::CONNECTION, Vec::<String>::new());
            }
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
                telemetry::LAG,
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

/// The poller thread: polls, hands messages over, stores settled offsets, pauses and resumes;
/// rebalance callbacks run inside `poll`. On stop: final store and commit, unsubscribe, close.
pub(crate) fn poll_loop(
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
    if let Some(timestamp) = timestamp(m.timestamp()) {
        message = message.with_timestamp(timestamp);
    }
    let order = order_lane(shared.config.ordering, &lane, m.key());
    let item = Item {
        topic,
        partition,
        offset,
        timestamp: m.timestamp().to_millis(),
        generation,
        lane,
        order,
        message,
    };
    // If the source is gone the loop ends at its next check.
    let _ = tx.send(Ok(item));
}

/// The ordering lane of a record of partition lane `partition` (`topic/partition`) with `key`.
///
/// Under [`Ordering::Key`] a key's lane is the partition's lane, `#` and a 64-bit hash of the
/// key: two keys whose hashes collide share a lane, which costs them concurrency, never order.
/// Keyless records in order share `topic/partition#`, which no hash lane can be.
fn order_lane(ordering: Ordering, partition: &Arc<str>, key: Option<&[u8]>) -> Lane {
    use std::hash::{Hash as _, Hasher as _};
    match (ordering, key) {
        (Ordering::Partition, _) => Lane::Ordered(partition.clone()),
        (Ordering::Unordered, _) | (Ordering::Key(Keyless::Unordered), None) => Lane::Unordered,
        (Ordering::Key(_), Some(key)) => {
            // SipHash with fixed keys: the same lane for the same key for the life of the process
            // (lanes are never persisted).
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            key.hash(&mut hasher);
            Lane::Ordered(format!("{partition}#{:016x}", hasher.finish()).into())
        }
        (Ordering::Key(_), None) => Lane::Ordered(format!("{partition}#").into()),
    }
}

/// The record's timestamp with its type; `None` for a record without one.
fn timestamp(t: rdkafka::Timestamp) -> Option<txinbox::message::Timestamp> {
    use txinbox::message::{Timestamp, TimestampKind};
    match t {
        rdkafka::Timestamp::NotAvailable => None,
        rdkafka::Timestamp::CreateTime(ms) => Some(Timestamp::new(ms, TimestampKind::CreateTime)),
        rdkafka::Timestamp::LogAppendTime(ms) => Some(Timestamp::new(ms, TimestampKind::LogAppendTime)),
    }
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
    let out_of_order = shared.config.ordering != crate::Ordering::Partition;
    let mut flush = Vec::new();
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
                if out_of_order {
                    if let Some(next) = p.take_quiet_flush(QUIET_FLUSH_AFTER) {
                        flush.push(txinbox::position::Position {
                            source: topic.clone(),
                            lane: partition.to_string().into(),
                            next,
                        });
                    }
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
    if !flush.is_empty() {
        let shared = consumer.context().shared.clone();
        consumer
            .context()
            .runtime
            .spawn(async move { shared.store_prefixes(flush).await });
    }
    if store.count() > 0 {
        if let Err(e) = consumer.store_offsets(&store) {
            // _STATE: the partition was revoked meanwhile; the new owner redelivers.
            tracing::info!(error = %e, "storing offsets failed (benign)");
        }
    }
    if pause.count() > 0 {
        metrics::counter!(telemetry::PAUSES).increment(pause.count() as u64);
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
