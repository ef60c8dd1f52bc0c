//! Shared test support: a fresh database per test with the deposit ledger (`txinbox_testing`),
//! a plain rdkafka producer, and a consumer runner.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sqlx::postgres::PgPool;
use txinbox::sqlx;
use txinbox_kafka::{KafkaConfig, KafkaSource};
use txinbox_testing::database::TestDatabase;
pub use txinbox_testing::ledger::{deposit, DepositHandler};

pub const CONSUMER: &str = "deposits-service";

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,txinbox=warn,txinbox_kafka=info".into()),
        )
        .with_thread_names(true)
        .with_test_writer()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .try_init();
}

/// A database created for one test, with txinbox migrated and the demo tables created.
pub struct TestDb {
    pub pool: PgPool,
    pub name: String,
    /// A URL of the database (`DATABASE_URL` with its name).
    pub url: String,
    database: TestDatabase,
}

impl TestDb {
    pub async fn new() -> TestDb {
        Self::create("txinbox_kafka_t").await
    }

    /// A new database named `<prefix>_…`, migrated, with the demo tables.
    pub async fn create(prefix: &str) -> TestDb {
        let database = TestDatabase::builder(prefix).max_connections(10).create().await;
        txinbox_testing::ledger::create_tables(database.pool()).await;
        Self::from(database)
    }

    /// Connects to a database [`create`](Self::create) made (in a parent process).
    pub async fn open(name: &str) -> TestDb {
        Self::from(
            TestDatabase::builder("txinbox_kafka_t")
                .max_connections(10)
                .open(name)
                .await,
        )
    }

    fn from(database: TestDatabase) -> TestDb {
        TestDb {
            pool: database.pool().clone(),
            name: database.name().to_owned(),
            url: database.url().to_owned(),
            database,
        }
    }

    /// Drops the database (at the end of a passing test).
    pub async fn drop_db(self) {
        drop(self.pool);
        self.database.drop_database().await;
    }

    pub fn inbox(&self) -> txinbox::PostgresInbox {
        txinbox::PostgresInbox::new(self.pool.clone())
    }

    pub async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap()
    }

    /// Distinct message IDs with at least one effect.
    pub async fn applied(&self) -> i64 {
        self.scalar("SELECT count(DISTINCT message_id) FROM effects")
            .await
    }

    /// Applications per message ID.
    pub async fn applications(&self) -> HashMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>("SELECT message_id, count(*) FROM effects GROUP BY message_id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
            .into_iter()
            .collect()
    }

    /// The stored next offsets of [`CONSUMER`] in `topic`, by partition.
    pub async fn positions(&self, topic: &str) -> BTreeMap<i32, i64> {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT lane, next_position FROM txinbox.positions WHERE consumer = $1 AND source = $2",
        )
        .bind(CONSUMER)
        .bind(topic)
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|(lane, next)| (lane.parse().unwrap(), next))
        .collect()
    }

    /// Waits until `n` distinct message IDs are applied.
    pub async fn wait_applied(&self, n: i64, within: Duration) {
        let started = Instant::now();
        loop {
            let applied = self.applied().await;
            if applied >= n {
                return;
            }
            assert!(
                started.elapsed() < within,
                "only {applied} of {n} messages applied after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every expected ID applied exactly once, nothing else applied, balances add up.
    pub async fn assert_exactly_once(&self, expected: &Published) {
        let applications = self.applications().await;
        let twice: Vec<_> = applications.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "applied more than once: {twice:?}");
        let missing: Vec<_> = expected
            .amounts
            .keys()
            .filter(|id| !applications.contains_key(*id))
            .take(20)
            .collect();
        assert!(missing.is_empty(), "never applied: {missing:?}");
        let unexpected: Vec<_> = applications
            .keys()
            .filter(|id| !expected.amounts.contains_key(*id))
            .take(20)
            .collect();
        assert!(
            unexpected.is_empty(),
            "applied but never published: {unexpected:?}"
        );
        let balance = self
            .scalar("SELECT coalesce(sum(balance), 0)::bigint FROM accounts")
            .await;
        assert_eq!(balance, expected.amounts.values().sum::<i64>(), "sum of balances");
    }
}

/// What was published: amount per unique message ID.
#[derive(Debug, Default, Clone)]
pub struct Published {
    pub amounts: HashMap<String, i64>,
    pub records: usize,
}

/// A plain rdkafka producer, outside the framework.
pub struct Producer {
    inner: FutureProducer,
}

impl Producer {
    pub fn new(brokers: &str) -> Producer {
        Producer::with(brokers, &[])
    }

    /// A producer with extra librdkafka `properties` (security settings).
    pub fn with(brokers: &str, properties: &[(&str, String)]) -> Producer {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", brokers)
            .set("message.timeout.ms", "60000")
            .set("linger.ms", "5");
        for (k, v) in properties {
            config.set(*k, v);
        }
        let inner = config.create().expect("create producer");
        Producer { inner }
    }

    /// Sends one record and waits for its delivery report.
    pub async fn send(
        &self,
        topic: &str,
        partition: Option<i32>,
        key: &str,
        id: Option<&str>,
        payload: &str,
    ) {
        let mut headers = OwnedHeaders::new();
        if let Some(id) = id {
            headers = headers.insert(Header {
                key: "ce_id",
                value: Some(id),
            });
        }
        let mut record = FutureRecord::to(topic).key(key).payload(payload).headers(headers);
        if let Some(p) = partition {
            record = record.partition(p);
        }
        self.inner
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| e)
            .expect("produce");
    }

    /// Publishes `n` deposits (IDs `prefix-i`, account by key) round-robin over `partitions`,
    /// re-sending every `dup_every`-th one again (same ID and payload) right after it, to the
    /// next partition (so the copies race each other). Waits for all delivery reports.
    pub async fn deposits(
        &self,
        topic: &str,
        partitions: i32,
        prefix: &str,
        n: usize,
        dup_every: usize,
    ) -> Published {
        let mut published = Published::default();
        let mut futures = Vec::new();
        let mut pending: Vec<(String, i32, String)> = Vec::new();
        for i in 0..n {
            let id = format!("{prefix}-{i}");
            let amount = (i % 97) as i64 + 1;
            let partition = (i % partitions as usize) as i32;
            let payload = deposit(&format!("acct-{}", i % 7), amount);
            published.amounts.insert(id.clone(), amount);
            pending.push((id.clone(), partition, payload.clone()));
            if dup_every > 0 && i % dup_every == dup_every - 1 {
                pending.push((id, (partition + 1) % partitions, payload));
            }
        }
        for (id, partition, payload) in pending {
            let record = || {
                let headers = OwnedHeaders::new().insert(Header {
                    key: "ce_id",
                    value: Some(&id),
                });
                FutureRecord::to(topic)
                    .key(&id)
                    .payload(&payload)
                    .partition(partition)
                    .headers(headers)
            };
            loop {
                match self.inner.send_result(record()) {
                    Ok(f) => {
                        futures.push(f);
                        break;
                    }
                    Err((e, _)) => {
                        assert!(
                            matches!(
                                e,
                                rdkafka::error::KafkaError::MessageProduction(
                                    rdkafka::types::RDKafkaErrorCode::QueueFull
                                )
                            ),
                            "produce: {e}"
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            published.records += 1;
        }
        for f in futures {
            f.await
                .expect("delivery report")
                .map_err(|(e, _)| e)
                .expect("delivered");
        }
        published
    }
}

/// Consumer configuration used by the tests: short session timeout, quick commits.
pub fn kafka_config(brokers: &str, group: &str, topic: &str) -> KafkaConfig {
    KafkaConfig::new(brokers, group)
        .topic(topic)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("auto.commit.interval.ms", "200")
        .revoke_timeout(Duration::from_secs(5))
        .close_timeout(Duration::from_secs(15))
}

/// A running consumer.
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), txinbox::Error>>,
    /// The consumer's health.
    pub health: txinbox::health::Health,
}

impl Running {
    /// Starts a consumer with `config` and `handler` on `db`.
    pub fn start(db: &TestDb, config: KafkaConfig, handler: DepositHandler) -> Running {
        let inbox = db.inbox();
        let source = KafkaSource::new(config).expect("kafka source");
        let consumer = txinbox::Consumer::builder(CONSUMER)
            .source(source)
            .inbox(inbox)
            .handler(handler)
            .concurrency(6)
            .max_in_flight(64)
            .build()
            .expect("consumer");
        let health = consumer.health();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run_until(async {
            let _ = stopped.await;
        }));
        Running {
            stop: Some(stop),
            task,
            health,
        }
    }

    /// Waits until the consumer's health report satisfies `check`; panics with the last report
    /// after `within`.
    pub async fn wait_health(
        &self,
        within: Duration,
        what: &str,
        check: impl Fn(&txinbox::health::HealthReport) -> bool,
    ) -> txinbox::health::HealthReport {
        let started = Instant::now();
        loop {
            let report = self.health.report();
            if check(&report) {
                return report;
            }
            assert!(
                started.elapsed() < within,
                "timed out after {within:?} waiting until {what}; last report: {report:#?}, problems: {:?}",
                report.problems()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Graceful shutdown; the consumer must stop cleanly within 30 s.
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .expect("consumer stops within 30 s")
            .expect("consumer task")
            .expect("consumer ran without a fatal error");
    }
}

impl Running {
    /// Waits for the consumer to stop by itself with an error, and returns it.
    pub async fn failure(mut self, within: Duration) -> txinbox::Error {
        let result = tokio::time::timeout(within, &mut self.task)
            .await
            .expect("the consumer fails within the time given")
            .expect("consumer task");
        match result {
            Err(e) => e,
            Ok(()) => panic!("the consumer stopped without an error"),
        }
    }
}

/// Reads every record of `topic` from the beginning (without a group), until `n` or `within`.
pub fn read_all(
    brokers: &str,
    topic: &str,
    partitions: i32,
    n: usize,
    within: Duration,
) -> Vec<rdkafka::message::OwnedMessage> {
    read_all_with(brokers, &[], topic, partitions, n, within)
}

/// [`read_all`] with extra librdkafka `properties` (security settings).
pub fn read_all_with(
    brokers: &str,
    properties: &[(&str, String)],
    topic: &str,
    partitions: i32,
    n: usize,
    within: Duration,
) -> Vec<rdkafka::message::OwnedMessage> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("group.id", "reader")
        .set("enable.auto.commit", "false");
    for (k, v) in properties {
        config.set(*k, v);
    }
    let consumer: BaseConsumer = config.create().unwrap();
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let started = Instant::now();
    let mut out = Vec::new();
    while out.len() < n && started.elapsed() < within {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            out.push(m.detach());
        }
    }
    out
}

/// The value of header `name` of `m`, as text.
pub fn header(m: &rdkafka::message::OwnedMessage, name: &str) -> Option<String> {
    let hs = m.headers()?;
    hs.iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .map(|v| String::from_utf8_lossy(v).into_owned())
}
