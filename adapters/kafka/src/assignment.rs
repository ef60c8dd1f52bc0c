//! Rebalances, on the poller thread: where assigned partitions start (database position, group
//! offset, [`MissingPosition`], a database position behind the broker's retention: see
//! `retention`), how revoked ones drain and commit, and how held partitions are released once
//! a (new) database position appears.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, RebalanceProtocol};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};
use txinbox::position::ConsumerPositions;
use txinbox::retry::Backoff;
use txinbox::store::StoreError;

use crate::config::MissingPosition;
use crate::poller::PollerContext;
use crate::retention::{self, Start};
use crate::state::{problem, Shared, State};
use crate::telemetry;
use crate::tracker::{Hold, Partition};

/// How long one attempt to load database positions may take during an assignment.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the database positions of blocked partitions are read again.
const BLOCKED_RECHECK: Duration = Duration::from_secs(2);
/// Between failed store calls during an assignment: 200 ms doubling to 5 s.
const STORE_BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
/// How long one attempt to read the group's committed offsets may take during an assignment.
const COMMITTED_TIMEOUT: Duration = Duration::from_secs(10);
/// How long reading a partition's low watermark may take during an assignment.
const WATERMARK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long reading a held partition's low watermark may take when it is checked again (on the
/// poller thread, between polls).
const RECHECK_WATERMARK_TIMEOUT: Duration = Duration::from_secs(1);

impl PollerContext {
    pub(crate) fn rebalance_inner(
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
                metrics::counter!(telemetry::REBALANCES, "kind" => "error").increment(1);
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
        metrics::counter!(telemetry::REBALANCES, "kind" => "assign").increment(1);
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
            let Some(recorded) =
                self.store_call(topic, "recording the consumer group", move |positions, topic| {
                    let group = group.clone();
                    Box::pin(async move { positions.record_subscription("kafka", &topic, &group).await })
                })
            else {
                tracing::info!("stopping: assignment not taken");
                take_nothing();
                return;
            };
            if let Some(other) = recorded {
                let text = format!(
                    "consumer {:?} reads topic {topic:?} through consumer group {other:?} (recorded in the database), not {:?}: two groups under one consumer name share one inbox and one set of positions, and each would skip the other's messages as duplicates. Give this service its own consumer name, or move the consumer to the new group on purpose with `txinbox positions rebind`",
                    self.shared.consumer_name(), config.group_id
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
            let Some(positions) = self.store_call(topic, "loading database positions", |positions, topic| {
                Box::pin(async move { positions.load(&topic).await })
            }) else {
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
        let mut blocked = self.without_position(consumer, &mut tpl, &starts);
        // Partitions whose database position is behind the broker's retention: held, or started
        // at the earliest retained offset (`None`); either way not at the database position.
        let gaps = self.behind_retention(consumer, &mut tpl, &starts);
        blocked.extend(gaps.iter().filter_map(|(k, hold)| Some((k.clone(), (*hold)?))));
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
                let key = (e.topic().to_owned(), e.partition());
                if let Some(next) = starts.get(&key).filter(|_| !gaps.contains_key(&key)) {
                    // Everything below the database position is done: store it for the group
                    // commit at once, so the group's offset catches up after a crash between
                    // the database commit and the offset commit even if nothing new arrives.
                    partition.start_at(*next);
                }
                if let Some(why) = blocked.get(&key) {
                    partition.blocked = Some(*why);
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
        // except those held (no database position, or one behind the broker's retention).
        if let Err(e) = consumer.resume(&tpl) {
            tracing::debug!(error = %e, "resuming newly assigned partitions failed");
        }
        if hold.count() > 0 {
            if let Err(e) = consumer.pause(&hold) {
                tracing::warn!(error = %e, "pausing held partitions failed; their messages are dropped until they are released");
            }
        }
        tracing::info!(
            partitions = ?assigned,
            from_database = ?from_db,
            held = hold.count(),
            "partitions assigned (those without a database position: see on_missing_position; behind the broker's retention: see on_retention_gap)"
        );
    }

    /// Compares the database position of every partition of `tpl` that starts from one with
    /// the broker's low watermark ([`retention::check`]). Returns those that do not start
    /// there: held ones with their [`Hold`] (their start in `tpl` is the earliest offset, never
    /// used while they are paused), and `None` for those that start at the earliest retained
    /// offset ([`RetentionGap::Earliest`](crate::RetentionGap::Earliest)).
    fn behind_retention(
        &self,
        consumer: &BaseConsumer<Self>,
        tpl: &mut TopicPartitionList,
        starts: &HashMap<(String, i32), i64>,
    ) -> HashMap<(String, i32), Option<Hold>> {
        let mut gaps = HashMap::new();
        for ((topic, partition), position) in starts {
            if tpl.find_partition(topic, *partition).is_none() {
                continue;
            }
            let hold = match retention::check(
                consumer,
                &self.shared,
                topic,
                *partition,
                *position,
                WATERMARK_TIMEOUT,
            ) {
                Start::Position => continue,
                Start::Hold(hold) => Some(hold),
                Start::Earliest => None,
            };
            if let Err(e) = tpl.set_partition_offset(topic, *partition, Offset::Beginning) {
                tracing::warn!(%topic, partition, error = %e, "could not set a start offset");
            }
            gaps.insert((topic.clone(), *partition), hold);
        }
        gaps
    }

    /// Decides where the partitions of `tpl` without a database position start, by
    /// [`KafkaConfig::on_missing_position`], and sets it in `tpl`. Returns the partitions to
    /// hold (`Refuse`), with the group's offset (`None`: it could not be read).
    ///
    /// [`KafkaConfig::on_missing_position`]: crate::KafkaConfig::on_missing_position
    fn without_position(
        &self,
        consumer: &BaseConsumer<Self>,
        tpl: &mut TopicPartitionList,
        starts: &HashMap<(String, i32), i64>,
    ) -> HashMap<(String, i32), Hold> {
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
                // Nothing the group passed: it starts where the group is (offset 0: the
                // earliest retained offset), or with no group offset at auto.offset.reset, as
                // it always did, set here rather than left to librdkafka's own later fetch.
                Some(committed @ (None | Some(0))) => {
                    if let Err(e) =
                        tpl.set_partition_offset(topic, partition, start_without_position(*committed, config))
                    {
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
                        consumer = %self.shared.consumer_name(),
                        group_offset = %shown,
                        "NOT consuming {topic}/{partition}: consumer group {:?} has committed offset {shown} but the database has no position for consumer {:?} (restored from a dump taken before this partition was first processed, or a fresh database?). Starting at the group's offset would skip the effects of everything before it. Ways out: start it from the earliest retained offset (KafkaConfig::on_missing_position(MissingPosition::Earliest), or `txinbox positions set --to-earliest`), or count everything before the group's offset as done (MissingPosition::AdoptGroupOffset, or `txinbox positions adopt`). A position written to the database is picked up within {BLOCKED_RECHECK:?}, without a restart",
                        config.group_id,
                        self.shared.consumer_name(),
                    );
                    // Assigned (the group keeps it here) and paused at once; nothing of it is
                    // handed out while it is blocked.
                    let start = group_offset.map_or(Offset::Invalid, Offset::Offset);
                    if let Err(e) = tpl.set_partition_offset(topic, partition, start) {
                        tracing::warn!(%topic, partition, error = %e, "could not set a start offset");
                    }
                    blocked.insert(
                        (topic.to_owned(), partition),
                        Hold::MissingPosition { group_offset },
                    );
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
                                    // 0 is an offset the group committed (it passed nothing,
                                    // but it is at the start), not the absence of one.
                                    Offset::Offset(o) if o >= 0 => Some(o),
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
        metrics::counter!(telemetry::REBALANCES, "kind" => "revoke").increment(1);
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
        drop(state);
        // Key and unordered ordering: the database positions may trail the settled prefix;
        // store it before giving the partitions up, so the next owner does not read settled
        // records again (it would find them duplicates; this saves it the work).
        if !lost {
            let prefixes = self
                .shared
                .settled_prefixes(keys.iter().map(|(t, p)| (Arc::<str>::from(t.as_str()), *p)));
            if !prefixes.is_empty() {
                let shared = self.shared.clone();
                let (done, wait) = std::sync::mpsc::channel();
                self.runtime.spawn(async move {
                    shared.store_prefixes(prefixes).await;
                    let _ = done.send(());
                });
                let _ = wait.recv_timeout(Duration::from_secs(6));
            }
        }
        let mut state = self.shared.lock();
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
        #[cfg(feature = "crash-points")]
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
    /// database is unavailable (fail closed). `None`: the source is stopping (or has no
    /// consumer's positions, which the poller never polls without).
    fn store_call<T: Send + 'static>(
        &self,
        topic: &str,
        what: &str,
        op: impl Fn(ConsumerPositions, String) -> BoxFuture<'static, Result<T, StoreError>>,
    ) -> Option<T> {
        let positions = self.shared.positions.get()?;
        let mut failures: u32 = 0;
        loop {
            if self.shared.stopping() {
                return None;
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let call = op(positions.clone(), topic.to_owned());
            self.runtime.spawn(async move {
                let _ = tx.send(call.await);
            });
            let started = Instant::now();
            let error = loop {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(Ok(value)) => {
                        if failures > 0 {
                            self.shared.set_problems(problem::ASSIGNMENT, Vec::new());
                        }
                        return Some(value);
                    }
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
            let delay = STORE_BACKOFF.ceiling(failures);
            // The rebalance callback waits here, so nothing of the group's assignment is
            // consumed: not ready, and the report says why.
            self.shared.set_problems(
                problem::ASSIGNMENT,
                vec![format!(
                    "Kafka assignment waits for the inbox database: {what} for topic {topic} failed ({error}); no partition is consumed until it succeeds (retried, fail closed)"
                )],
            );
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

/// The answers of one round of position loads, by topic.
type Loaded = Vec<(Arc<str>, Result<Vec<(String, i64)>, StoreError>)>;

/// Re-reads the database positions of blocked partitions every [`BLOCKED_RECHECK`], without
/// blocking the poller: the read runs on the runtime, its answer is picked up by a later turn.
#[derive(Default)]
pub(crate) struct Recheck {
    last: Option<Instant>,
    pending: Option<std::sync::mpsc::Receiver<Loaded>>,
}

impl Recheck {
    pub(crate) fn run(&mut self, consumer: &BaseConsumer<PollerContext>, shared: &Shared) {
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
                    shared.report_held();
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
        shared.report_held();
        let blocked = shared.lock().blocked();
        if blocked.is_empty() {
            return;
        }
        let topics: BTreeSet<Arc<str>> = blocked.into_iter().map(|(t, _)| t).collect();
        let Some(positions) = shared.positions.get().cloned() else {
            return;
        };
        let (tx, rx) = std::sync::mpsc::channel();
        consumer.context().runtime.spawn(async move {
            let mut answers = Vec::new();
            for topic in topics {
                let answer = tokio::time::timeout(LOAD_TIMEOUT, positions.load(&topic))
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

/// Where a partition without a database position starts when the group has passed nothing of
/// it: at the group's offset 0 (the earliest retained offset: records retention deleted before
/// anyone read them are not this consumer's gap), or with no group offset at all by
/// `auto.offset.reset`.
fn start_without_position(group_offset: Option<i64>, config: &crate::KafkaConfig) -> Offset {
    match group_offset {
        Some(_) => Offset::Beginning,
        None => config.reset_offset(),
    }
}

/// Reads the group's committed offsets of partitions blocked because they could not be read
/// (a coordinator still loading, brokers rolling). Where the group has passed nothing, there
/// was nothing to refuse: the partition starts where the group is (offset 0) or at
/// `auto.offset.reset` (no offset). Where it has, the partition stays held with that offset.
/// On the poller thread, with a short timeout, only while such partitions exist.
fn recheck_unknown_group_offsets(consumer: &BaseConsumer<PollerContext>, shared: &Shared) {
    let unknown_offset = Some(Hold::MissingPosition { group_offset: None });
    let unknown: Vec<(Arc<str>, i32)> = {
        let state = shared.lock();
        state
            .partitions
            .iter()
            .flat_map(|(t, ps)| {
                ps.iter()
                    .filter(|(_, p)| p.blocked == unknown_offset && !p.revoking)
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
        let group_offset = match e.offset() {
            Offset::Offset(o) if o > 0 => {
                let mut state = shared.lock();
                if let Some(p) = state
                    .get_mut(topic, partition)
                    .filter(|p| p.blocked == unknown_offset)
                {
                    p.blocked = Some(Hold::MissingPosition {
                        group_offset: Some(o),
                    });
                    tracing::error!(%topic, partition, group_offset = o, "held partition: the group's committed offset is {o} and the database has no position (see the earlier error for the ways out)");
                }
                continue;
            }
            Offset::Offset(0) => Some(0),
            _ => None,
        };
        let start = start_without_position(group_offset, &shared.config);
        if let Err(error) = consumer.seek(topic, partition, start, Duration::from_secs(5)) {
            tracing::info!(%topic, partition, %error, "starting a released partition failed; trying again");
            continue;
        }
        unblock(consumer, shared, topic, partition, None);
        tracing::warn!(%topic, partition, ?start, "the group has passed nothing of this held partition after all: consuming it from {start:?}");
    }
}

/// Starts the blocked partitions of `topic` that now have a usable database position there:
/// one that appeared for a partition held without one, or another one for a partition held
/// behind the broker's retention. Each new position is checked against the low watermark
/// first ([`retention::check`]).
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
        let hold = shared
            .lock()
            .get_mut(topic, partition)
            .filter(|p| !p.revoking)
            .and_then(|p| p.blocked);
        let Some(hold) = hold else {
            continue;
        };
        if let Hold::BehindRetention {
            position,
            low: Some(_),
        } = hold
        {
            if position == *next {
                continue; // the same position, still behind: nothing new to decide
            }
        }
        let start = match retention::check(
            consumer,
            shared,
            topic,
            partition,
            *next,
            RECHECK_WATERMARK_TIMEOUT,
        ) {
            Start::Position => Offset::Offset(*next),
            Start::Earliest => Offset::Beginning,
            Start::Hold(again) => {
                if let Some(p) = shared.lock().get_mut(topic, partition) {
                    p.blocked = Some(again);
                }
                continue;
            }
        };
        if let Err(e) = consumer.seek(topic, partition, start, Duration::from_secs(5)) {
            tracing::info!(%topic, partition, error = %e, "starting a released partition failed; trying again");
            continue;
        }
        let at = match start {
            Offset::Offset(next) => Some(next),
            _ => None,
        };
        unblock(consumer, shared, topic, partition, at);
        tracing::warn!(
            %topic,
            partition,
            next,
            ?start,
            "a database position appeared for a held partition: consuming it from {start:?}"
        );
    }
}

/// Ends the hold of `topic`/`partition` after its consumer was sought to where it starts
/// (`at`: a database position everything below which is done) and resumes it.
fn unblock(
    consumer: &BaseConsumer<PollerContext>,
    shared: &Shared,
    topic: &str,
    partition: i32,
    at: Option<i64>,
) {
    {
        let mut state = shared.lock();
        let Some(p) = state.get_mut(topic, partition) else {
            return;
        };
        if let Some(next) = at {
            p.start_at(next);
        }
        if p.blocked.take().is_some() {
            state.count_blocked(topic, false);
        }
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    if let Err(e) = consumer.resume(&tpl) {
        tracing::warn!(%topic, partition, error = %e, "resuming a released partition failed");
    }
}
