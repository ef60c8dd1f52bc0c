//! Health for orchestrators against a real PostgreSQL: readiness follows the database, a lane
//! blocked on a lock is reported stalled (and its oldest unsettled delivery ages in the gauge),
//! and what a source reports (connection, assignment) shows up in the report.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics_util::debugging::DebugValue;
use txinbox::health::{BrokerStatus, Health, HealthReport, RunState, SourceHealth};
use txinbox::memory::{MemoryBroker, MemoryDelivery, MemorySource};
use txinbox::{source::Capabilities, source::SourceError, Consumer, MessageSource};

use super::metrics::snapshotter;
use super::support::{deposit_in_lane, DepositHandler, PrivateCluster, TestDb};

/// Polls `health` until `pred` holds, or panics with the last report after `within`.
async fn wait_for(health: &Health, within: Duration, what: &str, pred: impl Fn(&HealthReport) -> bool) {
    let deadline = Instant::now() + within;
    loop {
        let report = health.report();
        if pred(&report) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: last report {report:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The database stops (the private cluster refuses connections): the consumer reports the
/// database unreachable, intake paused and not ready, yet alive (an orchestrator must not
/// restart it for an outage it rides out); once the server is back it is ready again. After
/// `run` returns it is not alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readiness_follows_the_database() {
    let cluster = PrivateCluster::start();
    let db = TestDb::on(cluster.options(), 4).await;
    let broker = MemoryBroker::new("payments");
    let consumer = Consumer::builder("health-db")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .concurrency(2)
        .build()
        .unwrap();
    let health = consumer.health();
    let before = health.report();
    assert_eq!(before.state, RunState::NotStarted);
    assert!(before.is_alive() && !before.is_ready(), "{before:#?}");
    assert_eq!(
        before.broker,
        BrokerStatus::Unknown,
        "the memory source does not report"
    );
    assert_eq!(before.assigned, None);

    let run = tokio::spawn(consumer.run());
    let publisher = {
        let broker = broker.clone();
        tokio::spawn(async move {
            for i in 0u64.. {
                broker.publish(format!("evt-{i}"), deposit_in_lane("alice", 1, "-", i));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    wait_for(
        &health,
        Duration::from_secs(10),
        "ready while the database is up",
        |r| r.is_ready() && r.lanes.iter().any(|l| l.since_progress.is_some()),
    )
    .await;

    cluster.down();
    wait_for(
        &health,
        Duration::from_secs(20),
        "not ready while the database refuses connections",
        |r| !r.database_reachable && r.intake_paused && !r.is_ready() && r.is_alive(),
    )
    .await;
    let report = health.report();
    assert!(
        report
            .problems()
            .iter()
            .any(|p| p.contains("database unreachable")),
        "{:?}",
        report.problems()
    );

    cluster.up();
    wait_for(
        &health,
        Duration::from_secs(30),
        "ready again once the database is back",
        |r| r.is_ready() && r.database_reachable && !r.intake_paused,
    )
    .await;

    publisher.abort();
    broker.close();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("drains after close")
        .unwrap()
        .unwrap();
    let after = health.report();
    assert_eq!(after.state, RunState::Stopped);
    assert!(!after.is_alive() && !after.is_ready());
}

/// A handler blocked on a row lock held elsewhere holds its lane: with messages waiting and no
/// progress past the threshold the lane is reported stalled (and the consumer not ready), the
/// age of its oldest unsettled delivery shows in `txinbox_lane_oldest_unsettled_age_seconds`;
/// once the lock is released the lane drains and is no longer stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lane_blocked_on_a_lock_is_reported_stalled() {
    snapshotter();
    let db = TestDb::new(10).await;
    sqlx::query("INSERT INTO accounts (id, balance) VALUES ('alice', 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM accounts WHERE id = 'alice' FOR UPDATE")
        .execute(&mut *lock)
        .await
        .unwrap();

    let broker = MemoryBroker::new("payments");
    for i in 0..3u64 {
        broker.publish_in_lane(
            "payments/0",
            format!("evt-{i}"),
            deposit_in_lane("alice", 1, "payments/0", i),
        );
    }
    broker.publish_in_lane(
        "payments/1",
        "evt-other",
        deposit_in_lane("bob", 1, "payments/1", 0),
    );
    let consumer = Consumer::builder("health-stall")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .batch_size(1)
        .concurrency(4)
        .build()
        .unwrap();
    let health = consumer.health().stall_after(Duration::from_millis(500));
    let run = tokio::spawn(consumer.run());

    wait_for(
        &health,
        Duration::from_secs(10),
        "the blocked lane is stalled",
        |r| {
            r.lanes
                .iter()
                .any(|l| l.lane.as_deref() == Some("payments/0") && l.stalled && l.unsettled == 3)
        },
    )
    .await;
    let report = health.report();
    assert!(!report.is_ready(), "a stalled lane is not ready: {report:#?}");
    assert!(report.database_reachable, "a lock is not an outage");
    let other = report
        .lanes
        .iter()
        .find(|l| l.lane.as_deref() == Some("payments/1"))
        .unwrap();
    assert!(
        !other.stalled && other.unsettled == 0 && other.since_progress.is_some(),
        "{other:?}"
    );
    assert!(
        report
            .problems()
            .iter()
            .any(|p| p.contains("lane payments/0 stalled")),
        "{:?}",
        report.problems()
    );
    // The default threshold (5 minutes) does not call it stalled yet.
    assert!(Health::clone(&health)
        .stall_after(Duration::from_secs(300))
        .report()
        .is_ready());

    // The gauge is refreshed every 5 s.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if lane_age("health-stall", "payments/0").is_some_and(|age| age >= 1.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the oldest-unsettled gauge of the blocked lane ages"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    lock.rollback().await.unwrap();
    wait_for(
        &health,
        Duration::from_secs(10),
        "the lane drains once the lock is gone",
        |r| r.is_ready() && r.lanes.iter().all(|l| l.unsettled == 0 && !l.stalled),
    )
    .await;
    broker.close();
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(db.balance("alice").await, 3);
    assert_eq!(
        lane_age("health-stall", "payments/0"),
        Some(0.0),
        "zeroed at shutdown"
    );
}

/// The latest `txinbox_lane_oldest_unsettled_age_seconds` of `consumer`'s `lane` (the
/// recorder resets gauges when read: 0 unless set since the previous read).
fn lane_age(consumer: &str, lane: &str) -> Option<f64> {
    static LAST: Mutex<Vec<(String, String, f64)>> = Mutex::new(Vec::new());
    let mut last = LAST.lock().unwrap();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        if key.key().name() != txinbox::telemetry::LANE_OLDEST_UNSETTLED_AGE {
            continue;
        }
        let label = |k: &str| {
            key.key()
                .labels()
                .find(|l| l.key() == k)
                .map(|l| l.value().to_owned())
        };
        if let (DebugValue::Gauge(g), Some(c), Some(l)) = (value, label("consumer"), label("lane")) {
            last.retain(|(lc, ll, _)| !(lc == &c && ll == &l));
            last.push((c, l, g.into_inner()));
        }
    }
    last.iter()
        .find(|(c, l, _)| c == consumer && l == lane)
        .map(|(.., v)| *v)
}

/// A memory source that reports its broker status and assignment like a Kafka source would,
/// through the handle the consumer attaches.
struct ReportingSource {
    inner: MemorySource,
    handle: Arc<Mutex<Option<SourceHealth>>>,
}

#[txinbox::async_trait]
impl MessageSource for ReportingSource {
    type Delivery = MemoryDelivery;

    async fn receive(&mut self) -> Result<Option<MemoryDelivery>, SourceError> {
        self.inner.receive().await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn attach_health(&mut self, health: SourceHealth) {
        health.set_connected(true);
        health.set_assigned(Vec::<String>::new());
        *self.handle.lock().unwrap() = Some(health);
    }

    async fn close(self) -> Result<(), SourceError> {
        self.inner.close().await
    }
}

/// A source that has assigned nothing is reported as such and is still ready (a standby member
/// must not hold a rolling deployment); an assignment shows its lanes; a broker the source
/// reports disconnected makes the consumer not ready.
#[tokio::test]
async fn what_the_source_reports_is_in_the_report() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    let handle = Arc::new(Mutex::new(None));
    let consumer = Consumer::builder("health-source")
        .source(ReportingSource {
            inner: broker.source(),
            handle: handle.clone(),
        })
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .build()
        .unwrap();
    let health = consumer.health();
    let source: SourceHealth = handle.lock().unwrap().clone().expect("attached when built");
    let run = tokio::spawn(consumer.run());

    wait_for(&health, Duration::from_secs(5), "running", |r| {
        r.state == RunState::Running
    })
    .await;
    let report = health.report();
    assert_eq!(report.assigned, Some(vec![]), "nothing assigned");
    assert!(report.lanes.is_empty());
    assert_eq!(report.broker, BrokerStatus::Connected);
    assert!(
        report.is_ready(),
        "no assignment is not a reason to be unready: {report:#?}"
    );

    source.set_assigned(["payments/1", "payments/0"]);
    let report = health.report();
    assert_eq!(
        report.assigned,
        Some(vec!["payments/0".to_owned(), "payments/1".to_owned()])
    );
    let lanes: Vec<_> = report.lanes.iter().map(|l| l.lane.clone().unwrap()).collect();
    assert_eq!(lanes, ["payments/0", "payments/1"]);
    assert!(report
        .lanes
        .iter()
        .all(|l| l.unsettled == 0 && l.since_progress.is_none()));

    source.set_connected(false);
    let report = health.report();
    assert_eq!(report.broker, BrokerStatus::Disconnected);
    assert!(!report.is_ready());
    assert!(report.is_alive());
    assert_eq!(report.problems(), ["broker disconnected"]);

    broker.close();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
