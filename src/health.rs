//! Health for orchestrators: what a `/healthz` (alive) and a `/readyz` (can make progress)
//! endpoint answer.
//!
//! [`Consumer::health`](crate::Consumer::health) returns a [`Health`] handle before the
//! consumer runs; clone it into a web server and call [`Health::report`] per request. A
//! report is a snapshot of:
//!
//! | field | from |
//! |---|---|
//! | [`state`](HealthReport::state) | not started, running, stopped (`run` returned) |
//! | [`database_reachable`](HealthReport::database_reachable) | the runtime: `false` from a failed transaction that found the database unavailable until the next one succeeds |
//! | [`intake_paused`](HealthReport::intake_paused) | the runtime pauses intake while the database is unreachable (nothing is received, nothing acked) |
//! | [`broker`](HealthReport::broker) | the source, if it reports ([`SourceHealth::set_connected`]); [`BrokerStatus::Unknown`] otherwise |
//! | [`assigned`](HealthReport::assigned) | the source, if it reports ([`SourceHealth::set_assigned`]): Kafka partitions; `None` otherwise |
//! | [`lanes`](HealthReport::lanes) | the runtime: per lane with unsettled deliveries (and lanes recently active or assigned), how many, the oldest one's age, the time since the lane last settled something, and whether it is **stalled**: deliveries waiting and no progress for longer than [`stall_after`](Health::stall_after) |
//! | [`source_problems`](HealthReport::source_problems) | the source, if it reports ([`SourceHealth::set_problems`]): what keeps it from consuming that the rest does not show (Kafka: a held partition, an assignment waiting for the database, a dead-letter topic that does not exist) |
//!
//! [`HealthReport::is_alive`] is `false` only once the consumer stopped. [`HealthReport::is_ready`]
//! also needs the consumer running, the database reachable, the broker not known to be
//! disconnected, no lane stalled and no problem reported by the source. A consumer with no partitions assigned (more members than
//! partitions, or while joining the group) is ready: not-ready would hold a rolling deployment
//! of such standby members forever.
//!
//! An outbox [`Relay`](crate::outbox::Relay) has its own, smaller report: [`RelayHealth`].
//!
//! Reading a report takes one short lock; the per-message cost of tracking is one uncontended
//! lock when a delivery is received and one when it is settled.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default for [`Health::stall_after`]: 5 minutes, longer than the default retry backoff
/// ceiling, so a message retried in place does not read as a stall.
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(300);

/// Idle lanes (nothing unsettled, not assigned) are forgotten once more than this many lanes
/// are tracked, so key-level lanes cannot grow the map without bound.
const MAX_IDLE_LANES: usize = 1024;

/// A cheap, cloneable view of one consumer's health; see the [module docs](self).
///
/// It stays valid after the consumer is dropped or stopped (it then reports
/// [`RunState::Stopped`]).
#[derive(Clone)]
pub struct Health {
    state: Arc<State>,
    stall_after: Duration,
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Health")
            .field("consumer", &self.state.consumer)
            .field("stall_after", &self.stall_after)
            .finish_non_exhaustive()
    }
}

impl Health {
    pub(crate) fn new(state: Arc<State>) -> Self {
        Health {
            state,
            stall_after: DEFAULT_STALL_AFTER,
        }
    }

    /// A handle reporting lanes as stalled after `threshold` without progress while
    /// deliveries wait. Default: [`DEFAULT_STALL_AFTER`]. Set it above the longest retry
    /// backoff and the longest handler run you expect.
    #[must_use]
    pub fn stall_after(mut self, threshold: Duration) -> Self {
        self.stall_after = threshold;
        self
    }

    /// A snapshot of the consumer's health now.
    pub fn report(&self) -> HealthReport {
        self.state.report(self.stall_after)
    }
}

/// Whether [`Consumer::run`](crate::Consumer::run) is going.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// Built, `run` not called yet.
    NotStarted,
    /// Running.
    Running,
    /// `run` returned (source finished, shutdown, or a fatal error) or its future was dropped.
    Stopped,
}

/// The broker connection as the source reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerStatus {
    /// The source does not report (the default), or has not yet.
    Unknown,
    /// Connected.
    Connected,
    /// Not connected: the source is reconnecting.
    Disconnected,
}

/// A snapshot of one consumer's health; see [`Health::report`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HealthReport {
    /// The consumer's name.
    pub consumer: String,
    /// Whether the consumer runs.
    pub state: RunState,
    /// Whether the inbox database was reachable at the last transaction.
    pub database_reachable: bool,
    /// Whether intake is paused for a database outage.
    pub intake_paused: bool,
    /// The broker connection, as the source reports it.
    pub broker: BrokerStatus,
    /// The lanes (Kafka: `topic/partition`) the broker assigned to this member, if the source
    /// reports assignments; `Some(empty)` means nothing is assigned.
    pub assigned: Option<Vec<String>>,
    /// Lanes with unsettled deliveries, lanes that were recently active and assigned lanes,
    /// sorted by lane.
    pub lanes: Vec<LaneHealth>,
    /// What the source reports keeps it from consuming ([`SourceHealth::set_problems`]), one
    /// line each: a held partition, an assignment waiting for the database, a dead-letter
    /// destination that does not exist. Each makes the consumer not ready.
    pub source_problems: Vec<String>,
}

/// One lane in a [`HealthReport`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaneHealth {
    /// The lane key (`topic/partition` for Kafka); `None` for unordered deliveries.
    pub lane: Option<String>,
    /// Deliveries received and not yet settled (queued or being processed).
    pub unsettled: usize,
    /// How long the oldest unsettled delivery has been received.
    pub oldest_unsettled: Option<Duration>,
    /// Time since the lane last settled a delivery (or gave one up unsettled, at shutdown or
    /// behind a stopped delivery); `None` if it never did.
    pub since_progress: Option<Duration>,
    /// Deliveries wait and the lane made no progress for longer than the stall threshold.
    pub stalled: bool,
}

impl HealthReport {
    /// Alive: the consumer has not stopped. What `/healthz` answers.
    pub fn is_alive(&self) -> bool {
        self.state != RunState::Stopped
    }

    /// Ready: it can make progress. What `/readyz` answers; [`problems`](Self::problems) says
    /// why not.
    pub fn is_ready(&self) -> bool {
        self.problems().is_empty()
    }

    /// Why the consumer is not ready, one line each; empty when it is.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        match self.state {
            RunState::NotStarted => problems.push("not started".to_owned()),
            RunState::Stopped => problems.push("stopped".to_owned()),
            RunState::Running => {}
        }
        if !self.database_reachable {
            problems.push("inbox database unreachable; intake paused".to_owned());
        }
        if self.broker == BrokerStatus::Disconnected {
            problems.push("broker disconnected".to_owned());
        }
        for lane in self.lanes.iter().filter(|l| l.stalled) {
            problems.push(format!(
                "lane {} stalled: {} unsettled, no progress for {:?}",
                lane.lane.as_deref().unwrap_or("(unordered)"),
                lane.unsettled,
                lane.since_progress.or(lane.oldest_unsettled).unwrap_or_default()
            ));
        }
        problems.extend(self.source_problems.iter().cloned());
        problems
    }
}

/// What a [`MessageSource`](crate::MessageSource) reports about its broker; given to it by
/// [`MessageSource::attach_health`](crate::MessageSource::attach_health). Cheap to clone and
/// to call from any thread (a poller thread, a rebalance callback).
#[derive(Clone, Default)]
pub struct SourceHealth(Arc<SourceState>);

#[derive(Default)]
struct SourceState {
    /// 0 unknown, 1 connected, 2 disconnected.
    connected: AtomicU8,
    assigned: Mutex<Option<Vec<Arc<str>>>>,
    /// By kind, see [`SourceHealth::set_problems`].
    problems: Mutex<BTreeMap<String, Vec<String>>>,
}

impl fmt::Debug for SourceHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceHealth")
            .field("broker", &self.broker())
            .finish_non_exhaustive()
    }
}

impl SourceHealth {
    /// Reports the broker connection up or down.
    pub fn set_connected(&self, connected: bool) {
        self.0
            .connected
            .store(if connected { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// Reports the lanes the broker assigned to this member (the same keys as
    /// [`Lane::Ordered`](crate::source::Lane::Ordered)); replaces the previous report.
    pub fn set_assigned<I, L>(&self, lanes: I)
    where
        I: IntoIterator<Item = L>,
        L: Into<Arc<str>>,
    {
        let mut lanes: Vec<Arc<str>> = lanes.into_iter().map(Into::into).collect();
        lanes.sort();
        *self.0.assigned.lock().unwrap() = Some(lanes);
    }

    /// Reports what keeps the source from consuming, for one `kind` of trouble (a name the
    /// source chooses, e.g. `held-partitions`): replaces what was reported for `kind` before;
    /// an empty list clears it. While anything is reported the consumer is not ready, and
    /// [`HealthReport::problems`] lists each line, so each should name the cause and the way
    /// out. Meant for what the rest of the report cannot show: a partition held on purpose, an
    /// assignment waiting for the database, a dead-letter destination that does not exist.
    pub fn set_problems<I, S>(&self, kind: &str, problems: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let problems: Vec<String> = problems.into_iter().map(Into::into).collect();
        let mut all = self.0.problems.lock().unwrap_or_else(|e| e.into_inner());
        if problems.is_empty() {
            all.remove(kind);
        } else {
            all.insert(kind.to_owned(), problems);
        }
    }

    fn problems(&self) -> Vec<String> {
        let all = self.0.problems.lock().unwrap_or_else(|e| e.into_inner());
        all.values().flatten().cloned().collect()
    }

    fn broker(&self) -> BrokerStatus {
        match self.0.connected.load(Ordering::Relaxed) {
            1 => BrokerStatus::Connected,
            2 => BrokerStatus::Disconnected,
            _ => BrokerStatus::Unknown,
        }
    }

    fn assigned(&self) -> Option<Vec<Arc<str>>> {
        self.0.assigned.lock().unwrap().clone()
    }
}

/// The runtime's side: written by the consumer, read by [`Health`].
pub(crate) struct State {
    consumer: Arc<str>,
    /// 0 not started, 1 running, 2 stopped.
    run: AtomicU8,
    database: AtomicBool,
    pub(crate) source: SourceHealth,
    lanes: Mutex<HashMap<Option<Arc<str>>, LaneStat>>,
    /// Whether `lanes` is kept; `false` only for the benchmark's cost row.
    track_lanes: bool,
}

#[derive(Default)]
struct LaneStat {
    unsettled: usize,
    /// Receive instants of the unsettled deliveries with their counts, oldest first. Deliveries
    /// come in time order, so a new one goes at the back; a settled one is found by binary
    /// search and counted down. Emptied entries leave from the front, and are swept from the
    /// middle once they outnumber the rest (deliveries settle out of order), so that what a
    /// lane holds stays proportional to what it has unsettled. (A `BTreeMap` did the same with
    /// a node search and an insert or removal per delivery: most of what tracking cost.)
    received: VecDeque<(Instant, usize)>,
    last_progress: Option<Instant>,
    /// When the lane last went from nothing unsettled to something.
    busy_since: Option<Instant>,
}

/// One lane's numbers, for the gauges.
pub(crate) struct LaneSample {
    pub(crate) lane: Option<Arc<str>>,
    pub(crate) oldest_unsettled: Duration,
}

impl State {
    pub(crate) fn new(consumer: Arc<str>, track_lanes: bool) -> Self {
        State {
            track_lanes,
            consumer,
            run: AtomicU8::new(0),
            database: AtomicBool::new(true),
            source: SourceHealth::default(),
            lanes: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn set_running(&self, running: bool) {
        self.run.store(if running { 1 } else { 2 }, Ordering::Relaxed);
    }

    pub(crate) fn set_database(&self, reachable: bool) {
        self.database.store(reachable, Ordering::Relaxed);
    }

    /// A delivery of `lane` was received at `at`.
    pub(crate) fn received(&self, lane: &Option<Arc<str>>, at: Instant) {
        if !self.track_lanes {
            return;
        }
        let mut lanes = self.lanes.lock().unwrap();
        // NOTE: a lookup first: the common case neither clones the lane's key nor hashes it twice.
        let stat = match lanes.get_mut(lane) {
            Some(stat) => stat,
            None => {
                if lanes.len() >= MAX_IDLE_LANES {
                    let assigned = self.source.assigned().unwrap_or_default();
                    lanes.retain(|k, s| s.unsettled > 0 || k.as_ref().is_some_and(|k| assigned.contains(k)));
                }
                lanes.entry(lane.clone()).or_default()
            }
        };
        if stat.unsettled == 0 {
            stat.busy_since = Some(at);
        }
        stat.unsettled += 1;
        match stat.received.back_mut() {
            Some((last, n)) if *last == at => *n += 1,
            Some((last, _)) if *last > at => {
                // Out of order (never from the intake loop, whose instants only grow).
                let i = stat.received.partition_point(|(t, _)| *t < at);
                match stat.received.get_mut(i) {
                    Some((t, n)) if *t == at => *n += 1,
                    _ => stat.received.insert(i, (at, 1)),
                }
            }
            _ => stat.received.push_back((at, 1)),
        }
    }

    /// A delivery of `lane` received at `at` was settled, or given up unsettled.
    pub(crate) fn settled(&self, lane: &Option<Arc<str>>, at: Instant) {
        if !self.track_lanes {
            return;
        }
        let mut lanes = self.lanes.lock().unwrap();
        let Some(stat) = lanes.get_mut(lane) else {
            return;
        };
        stat.unsettled = stat.unsettled.saturating_sub(1);
        let i = stat.received.partition_point(|(t, _)| *t < at);
        if let Some((t, n)) = stat.received.get_mut(i) {
            if *t == at && *n > 0 {
                *n -= 1;
            }
        }
        while matches!(stat.received.front(), Some((_, 0))) {
            stat.received.pop_front();
        }
        if stat.received.len() > 2 * stat.unsettled + 64 {
            stat.received.retain(|(_, n)| *n > 0);
        }
        stat.last_progress = Some(Instant::now());
    }

    /// Per lane: the age of its oldest unsettled delivery (zero when none).
    pub(crate) fn sample(&self) -> Vec<LaneSample> {
        let now = Instant::now();
        let lanes = self.lanes.lock().unwrap();
        lanes
            .iter()
            .map(|(lane, stat)| LaneSample {
                lane: lane.clone(),
                oldest_unsettled: stat.oldest(now).unwrap_or_default(),
            })
            .collect()
    }

    fn report(&self, stall_after: Duration) -> HealthReport {
        let now = Instant::now();
        let assigned = self.source.assigned();
        let mut lanes: Vec<LaneHealth> = {
            let stats = self.lanes.lock().unwrap();
            let mut lanes: Vec<LaneHealth> = stats
                .iter()
                .map(|(lane, stat)| LaneHealth {
                    lane: lane.as_deref().map(str::to_owned),
                    unsettled: stat.unsettled,
                    oldest_unsettled: stat.oldest(now),
                    since_progress: stat.last_progress.map(|t| now - t),
                    stalled: stat.stalled(now, stall_after),
                })
                .collect();
            for lane in assigned.iter().flatten() {
                if !stats.contains_key(&Some(lane.clone())) {
                    lanes.push(LaneHealth {
                        lane: Some(lane.to_string()),
                        unsettled: 0,
                        oldest_unsettled: None,
                        since_progress: None,
                        stalled: false,
                    });
                }
            }
            lanes
        };
        lanes.sort_by(|a, b| a.lane.cmp(&b.lane));
        let database_reachable = self.database.load(Ordering::Relaxed);
        HealthReport {
            consumer: self.consumer.to_string(),
            state: run_state(&self.run),
            database_reachable,
            intake_paused: !database_reachable,
            broker: self.source.broker(),
            assigned: assigned.map(|a| a.iter().map(|l| l.to_string()).collect()),
            lanes,
            source_problems: self.source.problems(),
        }
    }
}

impl LaneStat {
    fn oldest(&self, now: Instant) -> Option<Duration> {
        self.received.front().map(|(t, _)| now - *t)
    }

    fn stalled(&self, now: Instant, stall_after: Duration) -> bool {
        if self.unsettled == 0 {
            return false;
        }
        let since = match (self.last_progress, self.busy_since) {
            (Some(p), Some(b)) => p.max(b),
            (p, b) => p.or(b).unwrap_or(now),
        };
        now - since > stall_after
    }
}

/// A cheap, cloneable view of an outbox relay's health, from
/// [`Relay::health`](crate::outbox::Relay::health); stays valid after the relay stops.
///
/// The relay records it after every round of [`Relay::run_until`](crate::outbox::Relay::run_until):
/// whether the round reached the database, and whether the broker took its publishes.
#[derive(Clone)]
pub struct RelayHealth(pub(crate) Arc<RelayState>);

impl fmt::Debug for RelayHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayHealth")
            .field("relay", &self.0.name)
            .finish_non_exhaustive()
    }
}

impl RelayHealth {
    /// A snapshot of the relay's health now.
    pub fn report(&self) -> RelayReport {
        let s = &self.0;
        RelayReport {
            relay: s.name.to_string(),
            state: run_state(&s.run),
            database_reachable: s.database.load(Ordering::Relaxed),
            broker: match s.broker.load(Ordering::Relaxed) {
                1 => BrokerStatus::Connected,
                2 => BrokerStatus::Disconnected,
                _ => BrokerStatus::Unknown,
            },
            since_last_round: s.last_round.lock().unwrap().map(|t| t.elapsed()),
            round_error: s.round_error.lock().unwrap().clone(),
        }
    }
}

/// A snapshot of an outbox relay's health; see [`RelayHealth::report`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayReport {
    /// The relay's name.
    pub relay: String,
    /// Whether the relay runs.
    pub state: RunState,
    /// Whether the last round reached the database (`true` before the first).
    pub database_reachable: bool,
    /// `Disconnected` after a round in which every publish failed transiently (the broker looks
    /// unavailable), `Connected` after one the broker confirmed a publish in; `Unknown` before.
    pub broker: BrokerStatus,
    /// Time since the last round that reached the database.
    pub since_last_round: Option<Duration>,
    /// Why the last round failed, when the database was reachable but the round failed anyway
    /// (a missing table, a permission); `None` after a round that succeeded.
    pub round_error: Option<String>,
}

impl RelayReport {
    /// Alive: the relay has not stopped.
    pub fn is_alive(&self) -> bool {
        self.state != RunState::Stopped
    }

    /// Ready: running, the database reachable, the broker not known to be unavailable.
    pub fn is_ready(&self) -> bool {
        self.problems().is_empty()
    }

    /// Why the relay is not ready, one line each; empty when it is.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        match self.state {
            RunState::NotStarted => problems.push("not started".to_owned()),
            RunState::Stopped => problems.push("stopped".to_owned()),
            RunState::Running => {}
        }
        if !self.database_reachable {
            problems.push("outbox database unreachable".to_owned());
        }
        if let Some(e) = &self.round_error {
            problems.push(format!("outbox rounds fail: {e}"));
        }
        if self.broker == BrokerStatus::Disconnected {
            problems.push("broker unavailable: publishes fail".to_owned());
        }
        problems
    }
}

/// The relay's side: written by the relay, read by [`RelayHealth`].
pub(crate) struct RelayState {
    name: Arc<str>,
    run: AtomicU8,
    database: AtomicBool,
    broker: AtomicU8,
    last_round: Mutex<Option<Instant>>,
    round_error: Mutex<Option<String>>,
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl RelayState {
    pub(crate) fn new(name: &str) -> Self {
        RelayState {
            name: name.into(),
            run: AtomicU8::new(0),
            database: AtomicBool::new(true),
            broker: AtomicU8::new(0),
            last_round: Mutex::new(None),
            round_error: Mutex::new(None),
        }
    }

    pub(crate) fn set_running(&self, running: bool) {
        self.run.store(if running { 1 } else { 2 }, Ordering::Relaxed);
    }

    /// What the relay found out about the broker outside a round's publishes (see
    /// [`Publisher::probe`](crate::outbox::Publisher::probe)).
    pub(crate) fn set_broker(&self, status: BrokerStatus) {
        let value = match status {
            BrokerStatus::Unknown => 0,
            BrokerStatus::Connected => 1,
            BrokerStatus::Disconnected => 2,
        };
        self.broker.store(value, Ordering::Relaxed);
    }

    /// A round ended: `Some((published, broker_unavailable))` if it reached the database.
    pub(crate) fn round(&self, ended: Option<(usize, bool)>) {
        *self.round_error.lock().unwrap() = None;
        match ended {
            None => self.database.store(false, Ordering::Relaxed),
            Some((published, broker_unavailable)) => {
                self.database.store(true, Ordering::Relaxed);
                *self.last_round.lock().unwrap() = Some(Instant::now());
                if broker_unavailable {
                    self.broker.store(2, Ordering::Relaxed);
                } else if published > 0 {
                    self.broker.store(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl RelayState {
    /// A round reached the database and failed for another reason (see
    /// [`RelayReport::round_error`]).
    pub(crate) fn round_failed(&self, error: &str) {
        self.database.store(true, Ordering::Relaxed);
        *self.round_error.lock().unwrap() = Some(error.to_owned());
    }
}

fn run_state(run: &AtomicU8) -> RunState {
    match run.load(Ordering::Relaxed) {
        0 => RunState::NotStarted,
        1 => RunState::Running,
        _ => RunState::Stopped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(report: &HealthReport) -> &LaneHealth {
        &report.lanes[0]
    }

    /// The oldest unsettled delivery is tracked through settlements in any order, and a lane
    /// whose oldest delivery stays unsettled keeps only what is unsettled, not every delivery
    /// settled after it.
    #[test]
    fn the_oldest_unsettled_survives_out_of_order_settlement_in_bounded_memory() {
        let state = State::new("c".into(), true);
        let key: Option<Arc<str>> = None;
        let base = Instant::now() - Duration::from_secs(100);
        let at = |s: u64| base + Duration::from_secs(10 * s);
        // The oldest unsettled delivery's age, in whole tens of seconds since `base` (its `s`).
        let oldest = || {
            let age = state.sample()[0].oldest_unsettled;
            ((Instant::now() - age) - base).as_secs_f64() / 10.0
        };
        state.received(&key, at(1));
        state.received(&key, at(3));
        state.received(&key, at(3));
        state.received(&key, at(2)); // out of order
        state.settled(&key, at(1));
        assert_eq!(oldest().round(), 2.0, "the out-of-order one is now the oldest");
        state.settled(&key, at(2));
        state.settled(&key, at(3));
        assert_eq!(oldest().round(), 3.0, "one of the two at 3 is left");
        // at(3) stays unsettled while 10,000 later deliveries come and go.
        for i in 0..10_000 {
            let t = at(4) + Duration::from_micros(i);
            state.received(&key, t);
            state.settled(&key, t);
        }
        assert_eq!(oldest().round(), 3.0);
        let held = state.lanes.lock().unwrap()[&key].received.len();
        assert!(held <= 2 + 64, "{held} entries held for one unsettled delivery");
        state.settled(&key, at(3));
        assert_eq!(state.sample()[0].oldest_unsettled, Duration::ZERO);
    }

    #[test]
    fn a_lane_is_stalled_only_while_deliveries_wait_without_progress() {
        let state = State::new("c".into(), true);
        state.set_running(true);
        let key = Some(Arc::<str>::from("t/0"));
        let long_ago = Instant::now() - Duration::from_secs(60);
        state.received(&key, long_ago);
        let report = state.report(Duration::from_secs(5));
        assert!(lane(&report).stalled && !report.is_ready(), "{report:?}");
        assert_eq!(lane(&report).unsettled, 1);
        assert!(lane(&report).oldest_unsettled.unwrap() >= Duration::from_secs(60));
        state.settled(&key, long_ago);
        let report = state.report(Duration::from_secs(5));
        assert!(!lane(&report).stalled && report.is_ready(), "{report:?}");
        assert_eq!(lane(&report).oldest_unsettled, None);
        assert!(lane(&report).since_progress.is_some());
    }

    /// A lane idle for an hour that receives a delivery now is not stalled at once: the
    /// clock starts when it got busy, not at its last progress.
    #[test]
    fn an_idle_lane_that_gets_busy_is_not_stalled_at_once() {
        let state = State::new("c".into(), true);
        state.set_running(true);
        let key = Some(Arc::<str>::from("t/0"));
        state.received(&key, Instant::now());
        state.settled(&key, Instant::now());
        state.lanes.lock().unwrap().get_mut(&key).unwrap().last_progress =
            Some(Instant::now() - Duration::from_secs(3600));
        state.received(&key, Instant::now());
        let report = state.report(Duration::from_secs(5));
        assert!(!lane(&report).stalled, "{report:?}");
    }

    /// What a source reports it cannot do makes the consumer not ready, each line listed; a
    /// kind reported again replaces its lines, an empty report clears them.
    #[test]
    fn problems_the_source_reports_make_the_consumer_not_ready_until_cleared() {
        let state = State::new("c".into(), true);
        state.set_running(true);
        assert!(state.report(DEFAULT_STALL_AFTER).is_ready());
        state
            .source
            .set_problems("held", ["t/1 held: no database position"]);
        state
            .source
            .set_problems("dead-letters", ["dead-letter topic t.dlq does not exist"]);
        let report = state.report(DEFAULT_STALL_AFTER);
        assert!(!report.is_ready(), "{report:?}");
        assert_eq!(
            report.problems(),
            [
                "dead-letter topic t.dlq does not exist",
                "t/1 held: no database position"
            ]
        );
        state
            .source
            .set_problems("held", ["t/2 held: no database position"]);
        assert_eq!(
            state.report(DEFAULT_STALL_AFTER).source_problems,
            [
                "dead-letter topic t.dlq does not exist",
                "t/2 held: no database position"
            ]
        );
        state.source.set_problems("held", Vec::<String>::new());
        state.source.set_problems("dead-letters", Vec::<String>::new());
        assert!(state.report(DEFAULT_STALL_AFTER).is_ready());
    }

    #[test]
    fn idle_lanes_are_forgotten_past_the_cap_but_busy_and_assigned_ones_stay() {
        let state = State::new("c".into(), true);
        state.source.set_assigned(["assigned"]);
        let now = Instant::now();
        let busy = Some(Arc::<str>::from("busy"));
        state.received(&busy, now);
        let assigned = Some(Arc::<str>::from("assigned"));
        state.received(&assigned, now);
        state.settled(&assigned, now);
        for i in 0..MAX_IDLE_LANES + 10 {
            let key = Some(Arc::<str>::from(format!("k{i}")));
            state.received(&key, now);
            state.settled(&key, now);
        }
        let lanes = state.lanes.lock().unwrap();
        assert!(lanes.len() <= MAX_IDLE_LANES + 1, "{}", lanes.len());
        assert!(lanes.contains_key(&busy) && lanes.contains_key(&assigned));
    }
}
