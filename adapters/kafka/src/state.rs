//! The bookkeeping shared by the source, the poller thread, the rebalance callbacks and the
//! deliveries: [`Shared`], the assigned partitions ([`State`]) and the [`Item`]s on their way to
//! `receive`. One partition's offsets are tracked by [`Partition`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use rdkafka::producer::FutureProducer;
use txinbox::{position::ConsumerPositions, position::Position, Message};

/// How long giving partitions up waits to store their settled positions
/// ([`Shared::store_prefixes`]).
const PREFIX_FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

use crate::config::KafkaConfig;
use crate::connection::ConnectionContext;
use crate::telemetry;
use crate::tracker::{Generation, Partition};

/// The kinds of problem the source reports to the consumer's health
/// ([`SourceHealth::set_problems`](txinbox::health::SourceHealth::set_problems)).
pub(crate) mod problem {
    /// An assignment waiting for the inbox database (the rebalance callback retries).
    pub(crate) const ASSIGNMENT: &str = "kafka-assignment";
    /// Partitions held ([`Hold`](crate::tracker::Hold)).
    pub(crate) const HELD: &str = "kafka-held-partitions";
    /// Dead-letter topics the broker says do not exist.
    pub(crate) const DEAD_LETTER_TOPICS: &str = "kafka-dead-letter-topics";
    /// The brokers refuse the connection in a way only a configuration change fixes (TLS,
    /// SASL, a plaintext client at a TLS listener): [`crate::connection::diagnose`].
    pub(crate) const CONNECTION: &str = "kafka-connection";
}

/// State shared by the source, the poller thread, the rebalance callback and the deliveries.
pub(crate) struct Shared {
    pub(crate) config: KafkaConfig,
    pub(crate) state: Mutex<State>,
    /// Notified whenever a delivery is settled or dropped (revocations wait on it).
    pub(crate) settled: Condvar,
    /// Set by `close` or drop: the poller leaves its loop.
    pub(crate) stop: AtomicBool,
    pub(crate) producer: FutureProducer<ConnectionContext>,
    /// A reason to stop the consumer found inside a rebalance callback (which cannot return
    /// one); the poller hands it to `receive`.
    pub(crate) fatal: Mutex<Option<String>>,
    /// Where assignments and the broker connection are reported, once the consumer attached it.
    pub(crate) health: OnceLock<txinbox::health::SourceHealth>,
    /// The consumer's name and the store of its positions, once the consumer attached them
    /// ([`MessageSource::attach_positions`](txinbox::MessageSource::attach_positions)). The
    /// poller does not poll before: no partition is assigned without them.
    pub(crate) positions: OnceLock<ConsumerPositions>,
}

pub(crate) struct State {
    pub(crate) partitions: HashMap<Arc<str>, HashMap<i32, Partition>>,
    pub(crate) next_epoch: u64,
    /// The consumer name (a label of the blocked-partitions and lag gauges), set when the
    /// consumer attaches its positions.
    pub(crate) consumer: Arc<str>,
}

impl State {
    pub(crate) fn new() -> Self {
        State {
            partitions: HashMap::new(),
            next_epoch: 0,
            consumer: "".into(),
        }
    }

    pub(crate) fn get_mut(&mut self, topic: &str, partition: i32) -> Option<&mut Partition> {
        self.partitions.get_mut(topic)?.get_mut(&partition)
    }

    pub(crate) fn remove(&mut self, topic: &str, partition: i32) -> Option<Partition> {
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
    pub(crate) fn clear(&mut self) {
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
    pub(crate) fn set_blocked(&self, p: &Partition, blocked: bool) {
        if !blocked && p.blocked.is_none() {
            return;
        }
        self.count_blocked(&p.topic, blocked);
    }

    pub(crate) fn count_blocked(&self, topic: &str, blocked: bool) {
        let gauge = metrics::gauge!(
            telemetry::PARTITIONS_BLOCKED,
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
    pub(crate) fn blocked(&self) -> Vec<(Arc<str>, i32)> {
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
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the bookkeeping half-updated in a way
        // that matters for safety: offsets only move forward on settle.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The consumer's name: the one whose positions the source reads ("" before the consumer
    /// attached them, when nothing has been received yet).
    pub(crate) fn consumer_name(&self) -> &str {
        self.positions.get().map_or("", ConsumerPositions::consumer)
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Reports `problems` of `kind` (see [`problem`]) to the consumer's health, if it is
    /// attached; an empty list clears them.
    pub(crate) fn set_problems(&self, kind: &str, problems: Vec<String>) {
        if let Some(health) = self.health.get() {
            health.set_problems(kind, problems);
        }
    }

    /// Reports the held partitions, each with its cause and the way out, to the consumer's
    /// health (not ready while any is held).
    pub(crate) fn report_held(&self) {
        if self.health.get().is_none() {
            return;
        }
        let mut held: Vec<(Arc<str>, i32, crate::tracker::Hold)> = self
            .lock()
            .partitions
            .iter()
            .flat_map(|(t, parts)| {
                parts
                    .iter()
                    .filter_map(|(n, p)| Some((t.clone(), *n, p.blocked?)))
            })
            .collect();
        held.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        let lines = held
            .into_iter()
            .map(|(topic, partition, hold)| hold.explain(&topic, partition, &self.config.group_id))
            .collect();
        self.set_problems(problem::HELD, lines);
    }

    /// Reports the partitions assigned now (and the held ones) to the consumer's health, if it
    /// is attached.
    pub(crate) fn report_assignment(&self) {
        self.report_held();
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

    /// Under [`Ordering::Key`](crate::Ordering::Key) and `Unordered`: the settled prefixes of
    /// `partitions` (topic, partition, next) to store as database positions when they are given
    /// up (revocation, close); empty under `Partition`, where each transaction stores an exact
    /// position already.
    pub(crate) fn settled_prefixes(
        &self,
        partitions: impl IntoIterator<Item = (Arc<str>, i32)>,
    ) -> Vec<Position> {
        if self.config.ordering == crate::Ordering::Partition {
            return Vec::new();
        }
        let mut state = self.lock();
        partitions
            .into_iter()
            .filter_map(|(topic, partition)| {
                let next = state.get_mut(&topic, partition)?.done_next()?;
                Some(Position {
                    source: topic,
                    lane: partition.to_string().into(),
                    next,
                })
            })
            .collect()
    }

    /// Stores `prefixes` ([`settled_prefixes`](Self::settled_prefixes)) as the database
    /// positions, forward only, within `PREFIX_FLUSH_TIMEOUT`. Best effort: a position
    /// that is not stored only makes the next reader read settled records again, which the
    /// inbox turns into duplicates.
    pub(crate) async fn store_prefixes(&self, prefixes: Vec<Position>) {
        let Some(positions) = self.positions.get() else {
            return;
        };
        tracing::debug!(?prefixes, "storing the settled positions of partitions given up");
        let mut stored = 0;
        let all = async {
            for p in &prefixes {
                if let Err(e) = positions.advance(p).await {
                    tracing::info!(topic = %p.source, partition = %p.lane, error = %e, "storing the settled position of a partition failed; a restart reads its last records again (duplicates) unless a later write succeeds");
                    break;
                }
                stored += 1;
            }
        };
        if tokio::time::timeout(PREFIX_FLUSH_TIMEOUT, all).await.is_err() {
            tracing::info!(timeout = ?PREFIX_FLUSH_TIMEOUT, "storing the settled positions of partitions took too long; a restart reads their last records again (duplicates) unless a later write succeeds");
        }
        // Those not stored: a partition still assigned flushes them at its next quiet spell.
        if stored < prefixes.len() {
            let mut state = self.lock();
            for p in &prefixes[stored..] {
                if let (Ok(partition), Some(parts)) =
                    (p.lane.parse::<i32>(), state.partitions.get_mut(&p.source))
                {
                    if let Some(part) = parts.get_mut(&partition) {
                        part.flush_failed(p.next);
                    }
                }
            }
        }
    }

    pub(crate) fn is_assigned(&self, topic: &str, partition: i32, epoch: u64) -> bool {
        self.lock()
            .get_mut(topic, partition)
            .is_some_and(|p| p.epoch() == epoch)
    }
}

/// A message on its way from the poller to [`KafkaSource::receive`].
///
/// [`KafkaSource::receive`]: crate::KafkaSource
pub(crate) struct Item {
    pub(crate) topic: Arc<str>,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    pub(crate) timestamp: Option<i64>,
    pub(crate) generation: Arc<Generation>,
    /// The partition's lane (`topic/partition`): what `receive` rotates over and health reports.
    pub(crate) lane: Arc<str>,
    /// The ordering lane ([`KafkaConfig::ordering`](crate::KafkaConfig::ordering)).
    pub(crate) order: txinbox::source::Lane,
    pub(crate) message: Message,
}
