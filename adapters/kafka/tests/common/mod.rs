//! Shared test support: a fresh database per test, a non-idempotent deposit handler, a plain
//! rdkafka producer, and a consumer runner.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Executor, Postgres};
use txinbox::sqlx;
use txinbox::{async_trait, Context, Handler, HandlerError, Message};
use txinbox_kafka::{KafkaConfig, KafkaSource};

pub const CONSUMER: &str = "deposits-service";

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,txinbox=warn,txinbox_kafka=info".into()),
        )
        .with_thread_names(true)
        .with_test_writer()
        .try_init();
}

pub fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database created for one test, with txinbox migrated and the demo tables created.
pub struct TestDb {
    pub pool: PgPool,
    pub name: String,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);
static CLEANED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

impl TestDb {
    pub async fn new() -> TestDb {
        let admin: PgConnectOptions = admin_url().parse().expect("DATABASE_URL parses");
        let name = format!(
            "txinbox_kafka_t_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let mut conn = admin
            .connect()
            .await
            .expect("connect to DATABASE_URL (is PostgreSQL running? scripts/test starts it)");
        CLEANED
            .get_or_init(|| async {
                // Databases left by earlier runs of these tests (a failed test keeps its own), and
                // only those nobody is connected to: another test process may be using its own.
                let stale: Vec<String> = sqlx::query_scalar(
                    "SELECT datname FROM pg_database d WHERE datname LIKE 'txinbox\\_kafka\\_t\\_%' AND datname NOT LIKE $1
                       AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)",
                )
                .bind(format!("txinbox_kafka_t_{}_%", std::process::id()))
                .fetch_all(&mut admin.connect().await.unwrap())
                .await
                .unwrap();
                let mut c = admin.connect().await.unwrap();
                for db in stale {
                    let _ = c
                        .execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db}")))
                        .await;
                }
            })
            .await;
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        Self::open(&name, true).await
    }

    /// Connects to an existing test database (`setup`: migrate and create the tables).
    pub async fn open(name: &str, setup: bool) -> TestDb {
        let admin: PgConnectOptions = admin_url().parse().expect("DATABASE_URL parses");
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(txinbox::PostgresInbox::connect_options(admin.database(name)))
            .await
            .expect("connect to the test database");
        if setup {
            txinbox::postgres::migrate(&pool).await.expect("migrate");
            pool.execute(
                "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
                 CREATE TABLE effects (seq bigserial PRIMARY KEY, message_id text NOT NULL,
                                       topic text NOT NULL, part integer NOT NULL, off bigint NOT NULL,
                                       amount bigint NOT NULL, run integer NOT NULL);",
            )
            .await
            .unwrap();
        }
        TestDb {
            pool,
            name: name.to_owned(),
        }
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

/// A deposit as the tests publish it.
#[derive(serde::Deserialize)]
struct Deposit {
    account: String,
    amount: i64,
}

pub fn deposit(account: &str, amount: i64) -> String {
    format!(r#"{{"account":"{account}","amount":{amount}}}"#)
}

/// A non-idempotent handler: `balance = balance + amount`, plus one `effects` row per
/// application, tagged with `run`.
#[derive(Clone)]
pub struct DepositHandler {
    pub run: i32,
    pub hold: Duration,
    /// Handler calls, re-runs included (a transaction that lost a lock conflict runs again).
    pub calls: Arc<AtomicUsize>,
    /// The message IDs it was called with.
    pub seen: Arc<Mutex<HashSet<String>>>,
}

impl DepositHandler {
    pub fn new(run: i32) -> Self {
        DepositHandler {
            run,
            hold: Duration::ZERO,
            calls: Arc::default(),
            seen: Arc::default(),
        }
    }

    pub fn holding(mut self, d: Duration) -> Self {
        self.hold = d;
        self
    }
}

#[async_trait]
impl Handler<Postgres> for DepositHandler {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.seen
            .lock()
            .unwrap()
            .insert(cx.message_id().as_str().to_owned());
        let d: Deposit = msg.json()?;
        sqlx::query(
            "INSERT INTO accounts (id, balance) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        )
        .bind(&d.account)
        .bind(d.amount)
        .execute(cx.db())
        .await?;
        let origin = msg.origin();
        sqlx::query(
            "INSERT INTO effects (message_id, topic, part, off, amount, run) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(cx.message_id().as_str())
        .bind(&*origin.destination)
        .bind(origin.partition.unwrap_or(-1))
        .bind(origin.offset.unwrap_or(-1))
        .bind(d.amount)
        .bind(self.run)
        .execute(cx.db())
        .await?;
        if !self.hold.is_zero() {
            tokio::time::sleep(self.hold).await;
        }
        Ok(())
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
        let inner = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("message.timeout.ms", "60000")
            .set("linger.ms", "5")
            .create()
            .expect("create producer");
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
    KafkaConfig::new(brokers, group, CONSUMER)
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
}

impl Running {
    /// Starts a consumer with `config` and `handler` on `db`.
    pub fn start(db: &TestDb, config: KafkaConfig, handler: DepositHandler) -> Running {
        let inbox = db.inbox();
        let source = KafkaSource::new(config, inbox.clone()).expect("kafka source");
        let consumer = txinbox::Consumer::builder(CONSUMER)
            .source(source)
            .inbox(inbox)
            .handler(handler)
            .concurrency(6)
            .max_in_flight(64)
            .build()
            .expect("consumer");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run_until(async {
            let _ = stopped.await;
        }));
        Running {
            stop: Some(stop),
            task,
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
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "reader")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
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
