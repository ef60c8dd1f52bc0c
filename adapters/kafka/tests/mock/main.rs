//! txinbox-kafka against librdkafka's mock cluster and a real PostgreSQL: rebalances, injected
//! offset-commit errors, broker outage, a crash between the database commit and the offset
//! commit, a database restore, dead letters. Every check is made in PostgreSQL.
//!
//! Needs `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`); no Kafka.

#[path = "../common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use common::*;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::mocking::MockCluster;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use txinbox::sqlx;

/// librdkafka's mock cluster on its own thread (it is `!Send`), driven by commands.
struct Mock {
    bootstrap: String,
    commands: std_mpsc::Sender<Command>,
    thread: Option<std::thread::JoinHandle<()>>,
}

enum Command {
    Topic(String, i32, std_mpsc::Sender<()>),
    RequestErrors(RDKafkaApiKey, Vec<RDKafkaRespErr>, std_mpsc::Sender<()>),
    BrokerDown(i32, std_mpsc::Sender<()>),
    BrokerUp(i32, std_mpsc::Sender<()>),
    TopicError(String, RDKafkaRespErr, std_mpsc::Sender<()>),
}

impl Mock {
    fn start(brokers: i32) -> Mock {
        let (commands, rx) = std_mpsc::channel::<Command>();
        let (ready, bootstrap) = std_mpsc::channel();
        let thread = std::thread::spawn(move || {
            let cluster = MockCluster::new(brokers).expect("mock cluster");
            ready.send(cluster.bootstrap_servers()).unwrap();
            for command in rx {
                match command {
                    Command::Topic(name, partitions, done) => {
                        cluster.create_topic(&name, partitions, 1).unwrap();
                        let _ = done.send(());
                    }
                    Command::RequestErrors(api, errors, done) => {
                        cluster.request_errors(api, &errors);
                        let _ = done.send(());
                    }
                    Command::BrokerDown(id, done) => {
                        cluster.broker_down(id).unwrap();
                        let _ = done.send(());
                    }
                    Command::BrokerUp(id, done) => {
                        cluster.broker_up(id).unwrap();
                        let _ = done.send(());
                    }
                    Command::TopicError(name, error, done) => {
                        cluster.topic_error(&name, error).unwrap();
                        let _ = done.send(());
                    }
                }
            }
        });
        Mock {
            bootstrap: bootstrap.recv().unwrap(),
            commands,
            thread: Some(thread),
        }
    }

    fn call(&self, make: impl FnOnce(std_mpsc::Sender<()>) -> Command) {
        let (done, wait) = std_mpsc::channel();
        self.commands.send(make(done)).unwrap();
        wait.recv().unwrap();
    }

    fn topic(&self, name: &str, partitions: i32) {
        self.call(|d| Command::Topic(name.into(), partitions, d));
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        let (dead, _) = std_mpsc::channel();
        self.commands = dead;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The group's committed offsets for `topic` (partitions 0..n), `None` where nothing is
/// committed.
fn group_offsets(brokers: &str, group: &str, topic: &str, partitions: i32) -> BTreeMap<i32, Option<i64>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    (0..partitions)
        .map(|p| {
            let offset = match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => Some(o),
                _ => None,
            };
            (p, offset)
        })
        .collect()
}

fn setup(partitions: i32) -> (Mock, String) {
    setup_topic("deposits", partitions)
}

/// Like [`setup`] with a topic name of the test's own (metrics are labelled by topic and the
/// recorder is shared by the tests of this binary).
fn setup_topic(name: &str, partitions: i32) -> (Mock, String) {
    init_tracing();
    let mock = Mock::start(1);
    let topic = name.to_string();
    mock.topic(&topic, partitions);
    mock.topic(&format!("{topic}.dlq"), 1);
    (mock, topic)
}

async fn rebalance_mid_stream(strategy: &str) {
    let (mock, topic) = setup(4);
    let db = TestDb::new().await;
    let config = || {
        kafka_config(&mock.bootstrap, "g-rebalance", &topic)
            .set("partition.assignment.strategy", strategy)
            .max_buffered_per_partition(8)
    };
    let slow = |run| {
        DepositHandler::default()
            .tagged(run)
            .holding(Duration::from_millis(3))
    };
    let run_count = |run: i32| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM effects WHERE run = $1")
                .bind(run)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };

    // A producer keeps the stream flowing for the whole test: 20 records every 150 ms.
    let stop_producing = tokio_util_like::Flag::default();
    let background = {
        let brokers = mock.bootstrap.clone();
        let topic = topic.clone();
        let stop = stop_producing.clone();
        tokio::spawn(async move {
            let producer = Producer::new(&brokers);
            let mut all = Published::default();
            let mut batch = 0;
            while !stop.is_set() {
                let p = producer.deposits(&topic, 4, &format!("p{batch}"), 20, 5).await;
                all.records += p.records;
                all.amounts.extend(p.amounts);
                batch += 1;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            all
        })
    };

    let first = Running::start(&db, config(), slow(1));
    db.wait_applied(100, Duration::from_secs(30)).await;

    // A second member joins mid-stream: the first gives up partitions with work in flight.
    let second = Running::start(&db, config(), slow(2));
    wait_for(
        Duration::from_secs(60),
        "the second member applies records",
        || async { run_count(2).await >= 30 },
    )
    .await;

    // It leaves again mid-stream: its partitions move back to the first member.
    let before = run_count(1).await;
    second.stop().await;
    let second_total = run_count(2).await;
    wait_for(Duration::from_secs(60), "the first member takes the partitions back", || async {
        let first_positions = sqlx::query_scalar::<_, i64>(
            "SELECT count(DISTINCT part) FROM effects WHERE run = 1 AND seq > (SELECT coalesce(max(seq), 0) FROM effects WHERE run = 2)",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        first_positions == 4 && run_count(1).await > before + 100
    })
    .await;

    stop_producing.set();
    let expected = background.await.unwrap();
    db.wait_applied(expected.amounts.len() as i64, Duration::from_secs(60))
        .await;
    // Give late redeliveries a chance to (wrongly) apply twice before checking.
    tokio::time::sleep(Duration::from_millis(500)).await;
    first.stop().await;
    assert_eq!(
        run_count(2).await,
        second_total,
        "nothing applied by the second member after it left"
    );

    db.assert_exactly_once(&expected).await;
    let positions = db.positions(&topic).await;
    let total: i64 = positions.values().sum();
    assert_eq!(
        total, expected.records as i64,
        "database positions are at the end of every partition"
    );
    drop(mock);
}

/// Polls `check` every 100 ms until it holds; panics after `within`.
async fn wait_for<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = std::time::Instant::now();
    while !check().await {
        assert!(
            started.elapsed() < within,
            "timed out after {within:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

mod dead_letters;
mod health;
mod metrics;
mod missing_positions;
mod ordering;
mod retention;

mod tokio_util_like {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A shared stop flag.
    #[derive(Clone, Default)]
    pub struct Flag(Arc<AtomicBool>);

    impl Flag {
        pub fn set(&self) {
            self.0.store(true, Ordering::SeqCst);
        }
        pub fn is_set(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eager_rebalance_member_joins_then_leaves() {
    rebalance_mid_stream("range").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cooperative_rebalance_member_joins_then_leaves() {
    rebalance_mid_stream("cooperative-sticky").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn offset_commit_errors_are_harmless() {
    let (mock, topic) = setup(3);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    let config = || kafka_config(&mock.bootstrap, "g-commit-errors", &topic);

    // Every offset commit of the first stretch fails: rebalance in progress, then illegal
    // generation (which makes librdkafka rejoin the group and lose its assignment).
    let errors = vec![
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS,
    ];
    mock.call(|d| Command::RequestErrors(RDKafkaApiKey::OffsetCommit, errors, d));

    let running = Running::start(
        &db,
        config(),
        DepositHandler::default()
            .tagged(1)
            .holding(Duration::from_millis(2)),
    );
    let mut expected = producer.deposits(&topic, 3, "a", 300, 7).await;
    db.wait_applied(300, Duration::from_secs(60)).await;
    // More failing commits, this time on the revocation at shutdown too.
    let errors = vec![RDKafkaRespErr::RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION; 2];
    mock.call(|d| Command::RequestErrors(RDKafkaApiKey::OffsetCommit, errors, d));
    let more = producer.deposits(&topic, 3, "b", 150, 7).await;
    expected.amounts.extend(more.amounts);
    db.wait_applied(450, Duration::from_secs(60)).await;
    running.stop().await;

    // A restart resumes from the database positions whatever the group holds.
    let running = Running::start(&db, config(), DepositHandler::default().tagged(2));
    let more = producer.deposits(&topic, 3, "c", 60, 7).await;
    expected.amounts.extend(more.amounts);
    db.wait_applied(510, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    db.assert_exactly_once(&expected).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_down_then_up() {
    let (mock, topic) = setup(3);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "g-outage", &topic),
        DepositHandler::default()
            .tagged(1)
            .holding(Duration::from_millis(2)),
    );
    let mut expected = producer.deposits(&topic, 3, "a", 200, 9).await;
    db.wait_applied(50, Duration::from_secs(30)).await;

    mock.call(|d| Command::BrokerDown(1, d));
    tokio::time::sleep(Duration::from_secs(3)).await;
    mock.call(|d| Command::BrokerUp(1, d));

    let more = producer.deposits(&topic, 3, "b", 200, 9).await;
    expected.amounts.extend(more.amounts);
    db.wait_applied(400, Duration::from_secs(90)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    db.assert_exactly_once(&expected).await;
}

/// Run by `crash_between_database_commit_and_offset_commit` in a child process, which it kills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process of crash_between_database_commit_and_offset_commit"]
async fn crash_child() {
    let (Ok(brokers), Ok(db)) = (
        std::env::var("TXKAFKA_CHILD_BROKERS"),
        std::env::var("TXKAFKA_CHILD_DB"),
    ) else {
        return;
    };
    init_tracing();
    let db = TestDb::open(&db).await;
    // No periodic group commits: the kill lands after database commits, before any offset commit.
    let config = kafka_config(&brokers, "g-crash", "deposits").set("auto.commit.interval.ms", "3600000");
    let _running = Running::start(
        &db,
        config,
        DepositHandler::default()
            .tagged(1)
            .holding(Duration::from_millis(10)),
    );
    std::future::pending::<()>().await;
}

/// Kills the child process if the test fails before it does.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_between_database_commit_and_offset_commit() {
    let (mock, topic) = setup(2);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    let mut expected = producer.deposits(&topic, 2, "a", 400, 0).await;

    let mut child = KillOnDrop(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["crash_child", "--ignored", "--nocapture", "--test-threads=1"])
            .env("TXKAFKA_CHILD_BROKERS", &mock.bootstrap)
            .env("TXKAFKA_CHILD_DB", &db.name)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start the child consumer"),
    );
    db.wait_applied(120, Duration::from_secs(60)).await;
    child.0.kill().expect("kill -9 the child consumer"); // SIGKILL: no revocation, no commit
    child.0.wait().unwrap();

    let positions = db.positions(&topic).await;
    let group = group_offsets(&mock.bootstrap, "g-crash", &topic, 2);
    let applied = db.applied().await;
    assert!(
        (120..400).contains(&applied),
        "the crash happened mid-stream ({applied} applied)"
    );
    for (p, next) in &positions {
        let committed = group[p];
        assert!(
            committed.is_none_or(|c| c < *next),
            "partition {p}: group offset {committed:?} is behind the database position {next}"
        );
    }

    // Make a redelivery below the database position visible: forget the inbox rows (keep the
    // effects). A restart that resumed from the group offsets (here: nothing committed, so the
    // earliest offset) would apply those messages a second time.
    sqlx::query("DELETE FROM txinbox.inbox")
        .execute(&db.pool)
        .await
        .unwrap();

    let handler = DepositHandler::default().tagged(2);
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "g-crash", &topic),
        handler.clone(),
    );
    let more = producer.deposits(&topic, 2, "b", 100, 0).await;
    expected.amounts.extend(more.amounts);
    db.wait_applied(500, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;

    db.assert_exactly_once(&expected).await;
    let below: i64 =
        sqlx::query_scalar("SELECT count(*) FROM effects WHERE run = 2 AND off < $1 AND part = $2")
            .bind(positions.get(&0).copied().unwrap_or(0))
            .bind(0)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        below, 0,
        "the restart received nothing below the database position"
    );
    // Distinct messages, not calls: the two partitions' transactions update the same accounts,
    // and one that loses a deadlock runs its handlers again.
    assert_eq!(
        handler.seen().len() as i64,
        500 - applied,
        "the restart ran the handler only for messages the crashed consumer had not applied"
    );
}

/// A crash after the database commits and before the offset commit leaves the group offsets
/// behind the database positions. The restart starts at the database positions; with nothing
/// new to consume it must still bring the group offsets there, or lag monitoring reports
/// records that were applied long ago (found by the crash matrix, `tools/chaos`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_offsets_catch_up_with_the_database_positions_without_new_records() {
    let (mock, topic) = setup(2);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    producer.deposits(&topic, 2, "a", 40, 0).await;
    // What the crashed consumer left: every record applied and its position stored with the
    // effects, no group offset committed.
    for partition in 0..2 {
        sqlx::query(
            "INSERT INTO txinbox.positions (consumer, source, lane, next_position) VALUES ($1, $2, $3, 20)",
        )
        .bind(CONSUMER)
        .bind(&topic)
        .bind(partition.to_string())
        .execute(&db.pool)
        .await
        .unwrap();
    }
    assert_eq!(
        group_offsets(&mock.bootstrap, "g-catch-up", &topic, 2),
        BTreeMap::from([(0, None), (1, None)])
    );

    let handler = DepositHandler::default().tagged(2);
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "g-catch-up", &topic),
        handler.clone(),
    );
    // Assigned, started at the database positions, nothing to consume.
    let started = std::time::Instant::now();
    while group_offsets(&mock.bootstrap, "g-catch-up", &topic, 2)
        .values()
        .any(|o| *o != Some(20))
        && started.elapsed() < Duration::from_secs(30)
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    running.stop().await;

    assert_eq!(handler.calls(), 0, "nothing re-applied");
    assert_eq!(
        group_offsets(&mock.bootstrap, "g-catch-up", &topic, 2),
        BTreeMap::from([(0, Some(20)), (1, Some(20))]),
        "the group offsets are at the database positions"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_restore_reapplies_exactly_the_lost_messages() {
    let (mock, topic) = setup(3);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    let config = || kafka_config(&mock.bootstrap, "g-restore", &topic);
    let expected = producer.deposits(&topic, 3, "a", 300, 0).await;

    let running = Running::start(&db, config(), DepositHandler::default().tagged(1));
    db.wait_applied(300, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.stop().await;
    let group = group_offsets(&mock.bootstrap, "g-restore", &topic, 3);
    assert!(
        group.values().all(|o| *o == Some(100)),
        "the group committed the end: {group:?}"
    );

    // "Restore from a backup" taken before the last K = 10 messages of each partition: their
    // effects, inbox rows and the positions go back to what they were then.
    let k = 10;
    let mut lost = HashSet::new();
    for p in 0..3 {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT message_id, off FROM effects WHERE part = $1 ORDER BY off DESC LIMIT $2")
                .bind(p)
                .bind(k)
                .fetch_all(&db.pool)
                .await
                .unwrap();
        let first_lost = rows.iter().map(|(_, off)| *off).min().unwrap();
        let ids: Vec<String> = rows.into_iter().map(|(id, _)| id).collect();
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::query(
            "UPDATE accounts a SET balance = a.balance - s.total
             FROM (SELECT 'acct-' || ((substring(message_id from 3))::int % 7) AS account, sum(amount) AS total
                   FROM effects WHERE message_id = ANY($1) GROUP BY 1) s
             WHERE a.id = s.account",
        )
        .bind(&ids)
        .execute(&mut *tx)
        .await
        .unwrap();
        sqlx::query("DELETE FROM effects WHERE message_id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("DELETE FROM txinbox.inbox WHERE message_id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await
            .unwrap();
        sqlx::query("UPDATE txinbox.positions SET next_position = $1 WHERE source = $2 AND lane = $3")
            .bind(first_lost)
            .bind(&topic)
            .bind(p.to_string())
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        lost.extend(ids);
    }
    assert_eq!(db.applied().await, 270);

    let running = Running::start(&db, config(), DepositHandler::default().tagged(2));
    db.wait_applied(300, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;

    db.assert_exactly_once(&expected).await;
    let reapplied: HashSet<String> = sqlx::query_scalar("SELECT message_id FROM effects WHERE run = 2")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(
        reapplied, lost,
        "exactly the messages lost in the restore were applied again"
    );
    assert!(db.positions(&topic).await.values().all(|n| *n == 100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_payload_and_missing_id_are_dead_lettered() {
    let (mock, topic) = setup(1);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "g-dlq", &topic),
        DepositHandler::default().tagged(1),
    );
    producer
        .send(&topic, Some(0), "k", Some("ok-1"), &deposit("acct-1", 5))
        .await;
    producer
        .send(&topic, Some(0), "k", Some("bad-1"), "{not json")
        .await;
    producer
        .send(&topic, Some(0), "k", None, &deposit("acct-1", 7))
        .await;
    producer
        .send(&topic, Some(0), "k", Some("ok-2"), &deposit("acct-1", 11))
        .await;
    db.wait_applied(2, Duration::from_secs(30)).await;

    let dead = tokio::task::spawn_blocking({
        let brokers = mock.bootstrap.clone();
        move || read_all(&brokers, "deposits.dlq", 1, 2, Duration::from_secs(30))
    })
    .await
    .unwrap();
    assert_eq!(dead.len(), 2, "two dead letters");
    use rdkafka::message::Message as _;
    use txinbox_kafka::headers;
    let by_reason: BTreeMap<String, &rdkafka::message::OwnedMessage> = dead
        .iter()
        .map(|m| (header(m, headers::REASON).unwrap(), m))
        .collect();
    let undecodable = by_reason["undecodable"];
    assert_eq!(
        undecodable.payload(),
        Some(&b"{not json"[..]),
        "original payload kept"
    );
    assert_eq!(header(undecodable, headers::OFFSET).as_deref(), Some("1"));
    assert_eq!(header(undecodable, headers::TOPIC).as_deref(), Some("deposits"));
    assert_eq!(header(undecodable, headers::PARTITION).as_deref(), Some("0"));
    assert_eq!(
        header(undecodable, "ce_id").as_deref(),
        Some("bad-1"),
        "original headers kept"
    );
    assert!(header(undecodable, headers::ERROR).is_some_and(|e| !e.is_empty()));
    assert!(header(undecodable, headers::TIMESTAMP).is_some_and(|t| t.parse::<i64>().is_ok()));
    let missing = by_reason["missing_id"];
    assert_eq!(header(missing, headers::OFFSET).as_deref(), Some("2"));
    assert!(header(missing, headers::ERROR).is_some_and(|e| e.contains("cloudevents")));

    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    let mut expected = Published::default();
    expected.amounts.insert("ok-1".into(), 5);
    expected.amounts.insert("ok-2".into(), 11);
    db.assert_exactly_once(&expected).await;
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 2);
    assert_eq!(
        db.positions(&topic).await[&0],
        4,
        "the partition moved past both dead letters"
    );
    let group = group_offsets(&mock.bootstrap, "g-dlq", &topic, 1);
    assert_eq!(
        group[&0],
        Some(4),
        "offsets stored past the confirmed dead letters"
    );
}

/// The source's own contract, without the runtime: offsets are stored only up to the first
/// delivery dropped unsettled, and later deliveries of that partition withhold their position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_delivery_leaves_its_offset_unstored() {
    use txinbox::{source::Settlement, Delivery, MessageSource};
    let (mock, topic) = setup(1);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    producer.deposits(&topic, 1, "a", 5, 0).await;

    let config = kafka_config(&mock.bootstrap, "g-dropped", &topic);
    let mut source = txinbox_kafka::KafkaSource::new(config).unwrap();
    source.attach_positions(txinbox::position::ConsumerPositions::new(CONSUMER, db.inbox()));
    let mut deliveries = Vec::new();
    for _ in 0..5 {
        let d = tokio::time::timeout(Duration::from_secs(30), source.receive())
            .await
            .expect("a delivery within 30 s")
            .unwrap()
            .unwrap();
        deliveries.push(d);
    }
    let offsets: Vec<i64> = deliveries.iter().map(|d| d.offset()).collect();
    assert_eq!(offsets, [0, 1, 2, 3, 4]);
    let mut it = deliveries.into_iter();
    let (d0, d1, d2, d3, d4) = (
        it.next().unwrap(),
        it.next().unwrap(),
        it.next().unwrap(),
        it.next().unwrap(),
        it.next().unwrap(),
    );
    assert_eq!(d1.position().unwrap().next, 2);
    d1.settle(Settlement::Ack).await.unwrap();
    d0.settle(Settlement::Ack).await.unwrap();
    drop(d2); // e.g. shutdown during an in-place retry
    assert_eq!(
        d3.position(),
        None,
        "no database position past an unsettled offset"
    );
    d3.settle(Settlement::Ack).await.unwrap();
    d4.settle(Settlement::Ack).await.unwrap();
    source.close().await.unwrap();

    let group = group_offsets(&mock.bootstrap, "g-dropped", &topic, 1);
    assert_eq!(
        group[&0],
        Some(2),
        "stored up to the dropped delivery, not past it"
    );
}

/// The record timestamp reaches the handler's `Message`, with its type: the producer's
/// timestamp is `CreateTime`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_timestamp_and_its_type_reach_the_message() {
    use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
    use txinbox::message::{Timestamp, TimestampKind};
    use txinbox::{source::Settlement, Delivery, MessageSource};
    let (mock, topic) = setup(1);
    let db = TestDb::new().await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &mock.bootstrap)
        .create()
        .unwrap();
    let stamped = 1_700_000_000_123;
    let record = FutureRecord::to(&topic).key("k").payload("{}").timestamp(stamped);
    producer
        .send_result(record)
        .map_err(|(e, _)| e)
        .unwrap()
        .await
        .unwrap()
        .unwrap();
    producer.flush(Duration::from_secs(30)).unwrap();

    let config = kafka_config(&mock.bootstrap, "g-timestamp", &topic);
    let mut source = txinbox_kafka::KafkaSource::new(config).unwrap();
    source.attach_positions(txinbox::position::ConsumerPositions::new(CONSUMER, db.inbox()));
    let d = tokio::time::timeout(Duration::from_secs(30), source.receive())
        .await
        .expect("a delivery within 30 s")
        .unwrap()
        .unwrap();
    let timestamp = d.message().timestamp();
    assert_eq!(
        timestamp,
        Some(Timestamp::new(stamped, TimestampKind::CreateTime))
    );
    assert_eq!(
        timestamp.unwrap().to_system_time(),
        std::time::UNIX_EPOCH + Duration::from_millis(stamped as u64)
    );
    d.settle(Settlement::Ack).await.unwrap();
    source.close().await.unwrap();
}

/// A partition's lane runs one transaction at a time, so if one partition's backlog took every
/// in-flight slot the others would wait behind it and batched throughput would be one lane's.
/// Two partitions with a deep backlog each: the first deliveries alternate between them,
/// whichever librdkafka fetched first.
#[tokio::test(flavor = "multi_thread")]
async fn backlogged_partitions_are_handed_out_in_turn() {
    use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
    use txinbox::MessageSource;
    let (mock, topic) = setup_topic("fairness", 2);
    let db = TestDb::new().await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &mock.bootstrap)
        .create()
        .unwrap();
    for partition in 0..2 {
        for i in 0..2000 {
            let key = format!("{partition}-{i}");
            let record = FutureRecord::to(&topic)
                .key(&key)
                .payload(&key)
                .partition(partition);
            producer.send_result(record).map_err(|(e, _)| e).unwrap();
        }
    }
    producer.flush(Duration::from_secs(30)).unwrap();

    let config = kafka_config(&mock.bootstrap, "g-fairness", &topic).max_buffered_per_partition(10_000);
    let mut source = txinbox_kafka::KafkaSource::new(config).unwrap();
    source.attach_positions(txinbox::position::ConsumerPositions::new(CONSUMER, db.inbox()));
    let first = tokio::time::timeout(Duration::from_secs(30), source.receive())
        .await
        .expect("a delivery within 30 s")
        .unwrap()
        .unwrap();
    // Both backlogs fetched (a few milliseconds on the mock cluster) before the rest is taken.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut deliveries = vec![first];
    for _ in 0..99 {
        deliveries.push(source.receive().await.unwrap().unwrap());
    }
    let from_1 = deliveries.iter().filter(|d| d.partition() == 1).count();
    assert!(
        (40..=60).contains(&from_1),
        "of the first 100 deliveries {from_1} came from partition 1 and {} from partition 0: one partition's backlog went first",
        100 - from_1
    );
    drop(deliveries);
    source.close().await.unwrap();
}

/// The source reads the positions of the consumer it is given to, and no other's: the
/// consumer hands over its name and store when it is built. Two consumers' positions in one
/// database, at different offsets: the source starts where its own consumer's says. Without
/// the hand-over it would read none (and start at the beginning), or refuse to receive.
#[tokio::test(flavor = "multi_thread")]
async fn the_source_starts_at_the_positions_of_the_consumer_it_is_given_to() {
    let (mock, topic) = setup_topic("handover", 1);
    let db = TestDb::new().await;
    Producer::new(&mock.bootstrap)
        .deposits(&topic, 1, "h", 6, 0)
        .await;
    for (consumer, next) in [(CONSUMER, 4_i64), ("another-service", 2)] {
        sqlx::query(
            "INSERT INTO txinbox.positions (consumer, source, lane, next_position) VALUES ($1, $2, '0', $3)",
        )
        .bind(consumer)
        .bind(&topic)
        .bind(next)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "g-handover", &topic),
        DepositHandler::default().tagged(1),
    );
    db.wait_applied(2, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    let offsets: Vec<i64> = sqlx::query_scalar("SELECT off FROM effects ORDER BY off")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        offsets,
        [4, 5],
        "started at consumer {CONSUMER}'s position, not another consumer's, not the beginning"
    );
}

/// A source already attached to one consumer and then given to another would read the first
/// one's positions while the second commits its own: every restart would begin at the wrong
/// offsets. It fails closed: the consumer stops with an error naming both, and nothing runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_source_attached_to_another_consumer_refuses_to_run_for_this_one() {
    use txinbox::MessageSource;
    let (mock, topic) = setup_topic("attached-twice", 1);
    let db = TestDb::new().await;
    Producer::new(&mock.bootstrap)
        .deposits(&topic, 1, "h", 3, 0)
        .await;
    let mut source =
        txinbox_kafka::KafkaSource::new(kafka_config(&mock.bootstrap, "g-attached-twice", &topic)).unwrap();
    source.attach_positions(txinbox::position::ConsumerPositions::new(
        "another-service",
        db.inbox(),
    ));
    let consumer = txinbox::Consumer::builder(CONSUMER)
        .source(source)
        .inbox(db.inbox())
        .handler(DepositHandler::default().tagged(1))
        .build()
        .expect("the consumer builds; the source refuses at its first receive");
    let outcome = tokio::time::timeout(Duration::from_secs(30), consumer.run())
        .await
        .expect("the consumer stops by itself");
    let error = outcome
        .expect_err("a source reading another consumer's positions must not run")
        .to_string();
    assert!(
        error.contains("another-service") && error.contains(CONSUMER),
        "the error names both consumers: {error}"
    );
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(applied, 0, "nothing was handled");
}
