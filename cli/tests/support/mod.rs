//! Test support: a fresh database per test, a unique topic per test, the deposit ledger's
//! handler (`txinbox_testing`) run by a real txinbox consumer on the Kafka or AMQP adapter, and
//! a runner for the built `txinbox` binary.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use txinbox::sqlx::postgres::PgPool;
use txinbox::sqlx::{self, Executor};
use txinbox_kafka::rdkafka;
use txinbox_kafka::{KafkaConfig, KafkaSource};
use txinbox_testing::database::TestDatabase;
pub use txinbox_testing::ledger::{deposit, DepositHandler};

/// The PostgreSQL server the tests' databases are made on (`DATABASE_URL`).
pub fn admin_url() -> String {
    txinbox_testing::database::server_url()
}

/// The Kafka brokers, or `None` (test skipped) outside CI. Under CI a missing broker fails.
pub fn brokers() -> Option<String> {
    match std::env::var("KAFKA_BROKERS") {
        Ok(b) => Some(b),
        Err(_) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "KAFKA_BROKERS must be set in CI (scripts/test sets it)"
            );
            eprintln!("SKIPPED: KAFKA_BROKERS is not set (source scripts/lib/tansu.sh and run ensure_tansu)");
            None
        }
    }
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

fn unique(prefix: &str) -> String {
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis();
    format!(
        "{prefix}_{}_{}_{stamp}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    )
}

/// A database created for one test, migrated, with the demo tables.
pub struct TestDb {
    pub pool: PgPool,
    pub url: String,
}

impl TestDb {
    pub async fn new() -> TestDb {
        Self::create(true).await
    }

    /// A new database; `setup`: migrate txinbox and create the demo tables.
    pub async fn create(setup: bool) -> TestDb {
        let db = TestDatabase::builder("txinbox_cli_t")
            .max_connections(12)
            .migrate(setup)
            .create()
            .await;
        let (pool, url) = (db.pool().clone(), db.url().to_owned());
        if !setup {
            return TestDb { pool, url };
        }
        txinbox_testing::ledger::create_tables(&pool).await;
        TestDb { pool, url }
    }

    pub async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn exec(&self, sql: &str) {
        self.pool
            .execute(sqlx::AssertSqlSafe(sql.to_owned()))
            .await
            .unwrap();
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

    /// Asserts no message was applied twice; returns how many distinct ones were applied.
    pub async fn assert_none_twice(&self) -> usize {
        let apps = self.applications().await;
        let twice: Vec<_> = apps.iter().filter(|(_, n)| **n > 1).collect();
        assert!(twice.is_empty(), "applied more than once: {twice:?}");
        apps.len()
    }

    /// Waits until `sql` (a scalar) reaches at least `n`.
    pub async fn wait_for(&self, sql: &str, n: i64, within: Duration) {
        let started = Instant::now();
        loop {
            let v = self.scalar(sql).await;
            if v >= n {
                return;
            }
            assert!(
                started.elapsed() < within,
                "`{sql}` is {v}, expected {n} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn position(&self, consumer: &str, topic: &str, partition: i32) -> Option<i64> {
        sqlx::query_scalar(
            "SELECT next_position FROM txinbox.positions WHERE consumer = $1 AND source = $2 AND lane = $3",
        )
        .bind(consumer)
        .bind(topic)
        .bind(partition.to_string())
        .fetch_optional(&self.pool)
        .await
        .unwrap()
    }
}

/// Creates a unique topic with `partitions` and its `.dlq` topic; returns its name.
pub async fn create_topic(brokers: &str, partitions: i32) -> String {
    let topic = unique("cli").replace('_', "-");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let created = admin
        .create_topics(
            &[
                NewTopic::new(&topic, partitions, TopicReplication::Fixed(1)),
                NewTopic::new(&format!("{topic}.dlq"), 1, TopicReplication::Fixed(1)),
            ],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topics");
    for r in created {
        r.expect("topic created");
    }
    topic
}

/// A plain rdkafka producer, outside the framework.
pub struct Producer(FutureProducer);

impl Producer {
    pub fn new(brokers: &str) -> Producer {
        Producer(
            ClientConfig::new()
                .set("bootstrap.servers", brokers)
                .set("message.timeout.ms", "30000")
                .create()
                .expect("producer"),
        )
    }

    /// Sends one deposit with CloudEvents ID `id` to `partition` and waits for its report.
    pub async fn send(&self, topic: &str, partition: i32, id: &str, payload: &str) {
        let headers = OwnedHeaders::new().insert(Header {
            key: "ce_id",
            value: Some(id),
        });
        self.0
            .send(
                FutureRecord::to(topic)
                    .key(id)
                    .payload(payload)
                    .partition(partition)
                    .headers(headers),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produce");
    }

    /// Sends deposits `prefix-0..n` (amount i+1, account `acct-{i%5}`) to `partition`.
    pub async fn deposits(&self, topic: &str, partition: i32, prefix: &str, n: usize) {
        for i in 0..n {
            self.send(
                topic,
                partition,
                &format!("{prefix}-{i}"),
                &deposit(&format!("acct-{}", i % 5), i as i64 + 1),
            )
            .await;
        }
    }
}

/// The ledger's deposit handler, failing permanently for accounts listed in `blocked` (the
/// "cause" an operator fixes before requeueing).
fn handler() -> DepositHandler {
    DepositHandler::default().refusing_blocked()
}

/// A running txinbox consumer (Kafka adapter, PostgreSQL inbox).
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), txinbox::Error>>,
}

impl Running {
    pub fn start(db: &TestDb, brokers: &str, consumer: &str, topic: &str) -> Running {
        let config = KafkaConfig::new(brokers, consumer)
            .topic(topic)
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("auto.commit.interval.ms", "200")
            .set("auto.offset.reset", "earliest")
            .revoke_timeout(Duration::from_secs(5))
            .close_timeout(Duration::from_secs(15));
        let inbox = txinbox::PostgresInbox::new(db.pool.clone());
        let source = KafkaSource::new(config).expect("kafka source");
        let consumer = txinbox::Consumer::builder(consumer)
            .source(source)
            .inbox(inbox)
            .handler(handler())
            .concurrency(4)
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

    /// A consumer of RabbitMQ queue `queue` (the adapter declares it, `.retry` and `.dlq`).
    pub async fn start_amqp(db: &TestDb, url: &str, consumer: &str, queue: &str) -> Running {
        let config = txinbox_amqp::AmqpConfig::new(url, queue).publish_timeout(Duration::from_secs(5));
        let source = txinbox_amqp::AmqpSource::connect(config)
            .await
            .expect("AmqpSource connects (is RabbitMQ running? scripts/test starts it)");
        let consumer = txinbox::Consumer::builder(consumer)
            .source(source)
            .inbox(txinbox::PostgresInbox::new(db.pool.clone()))
            .handler(handler())
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

    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .expect("consumer stops within 30 s")
            .expect("consumer task")
            .expect("consumer ran without a fatal error");
    }
}

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// `AMQPS_URL`, default `amqps://guest:guest@127.0.0.1:5671/%2f`: the TLS-only RabbitMQ node
/// `scripts/test` starts (`ensure_rabbitmq_tls`).
pub fn amqps_url() -> String {
    std::env::var("AMQPS_URL").unwrap_or_else(|_| "amqps://guest:guest@127.0.0.1:5671/%2f".into())
}

/// `$TXINBOX_TLS_DIR/<name>` (default `/var/lib/txinbox/tls`, made by `ensure_test_certs`);
/// panics saying what to run when it is missing.
pub fn tls_file(name: &str) -> String {
    let dir = std::env::var("TXINBOX_TLS_DIR").unwrap_or_else(|_| "/var/lib/txinbox/tls".into());
    let path = std::path::Path::new(&dir).join(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/test's setup (ensure_test_certs and ensure_rabbitmq_tls)",
        path.display()
    );
    path.display().to_string()
}

/// Publishes `payload` to `queue` (default exchange) with AMQP `message_id` = `id`, confirmed.
pub async fn amqp_publish(url: &str, queue: &str, id: &str, payload: &str) {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .expect("connect to AMQP_URL");
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            payload.as_bytes(),
            lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(id.into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack(), "published");
    let _ = conn.close(200, "done".into()).await;
}

/// Deletes `queue` and its `.retry` and `.dlq` queues.
pub async fn amqp_delete(url: &str, queue: &str) {
    use lapin::options::QueueDeleteOptions;
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .expect("connect to AMQP_URL");
    let channel = conn.create_channel().await.unwrap();
    for q in [queue.to_owned(), format!("{queue}.retry"), format!("{queue}.dlq")] {
        let _ = channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "done".into()).await;
}

/// The result of one run of the `txinbox` binary.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// stdout parsed as JSON (for `--json` runs).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}): {}\nstderr: {}",
                self.stdout, self.stderr
            )
        })
    }

    /// Asserts exit code 0 and returns the JSON output.
    pub fn ok(&self) -> serde_json::Value {
        assert_eq!(self.code, 0, "txinbox failed: {self:?}");
        self.json()
    }
}

/// Runs the built `txinbox` binary with `args`, `DATABASE_URL` = `db_url` and `KAFKA_BROKERS` =
/// `brokers` (unset when `None`).
pub async fn txinbox(db_url: &str, brokers: Option<&str>, args: &[&str]) -> Run {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_txinbox"));
    // No terminal on stdin, as in CI: a command that needs confirmation must refuse, not wait.
    cmd.args(args)
        .env("DATABASE_URL", db_url)
        .env_remove("KAFKA_BROKERS")
        .stdin(std::process::Stdio::null());
    if let Some(b) = brokers {
        cmd.env("KAFKA_BROKERS", b);
    }
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("txinbox finishes within 120 s")
        .expect("run txinbox");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Commits `offsets` (partition, next offset) of `topic` for consumer group `group`, as a
/// consumer of that group would have.
pub fn commit_group(brokers: &str, group: &str, topic: &str, offsets: &[(i32, i64)]) {
    use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer for the group");
    let mut tpl = rdkafka::TopicPartitionList::new();
    for (p, o) in offsets {
        tpl.add_partition_offset(topic, *p, rdkafka::Offset::Offset(*o))
            .unwrap();
    }
    c.commit(&tpl, CommitMode::Sync).expect("group offsets committed");
}

/// Records that `consumer` reads `topic` through Kafka group `group`, as the Kafka source does
/// when it is assigned partitions.
pub async fn record_subscription(db: &TestDb, consumer: &str, topic: &str, group: &str) {
    use txinbox::InboxStore;
    let other = txinbox::PostgresInbox::new(db.pool.clone())
        .record_subscription(consumer, "kafka", topic, group)
        .await
        .expect("record subscription");
    assert_eq!(other, None, "no other group recorded");
}

/// Stores `consumer`'s next position in `topic`/`partition`.
pub async fn store_position(db: &TestDb, consumer: &str, topic: &str, partition: i32, next: i64) {
    db.exec(&format!(
        "INSERT INTO txinbox.positions (consumer, source, lane, next_position)
         VALUES ('{consumer}', '{topic}', '{partition}', {next})
         ON CONFLICT (consumer, source, lane) DO UPDATE SET next_position = EXCLUDED.next_position"
    ))
    .await;
}

/// A consumer name unique to this process and moment.
pub fn consumer_name() -> String {
    unique("svc").replace('_', "-")
}

/// Inserts `n` terminal inbox rows of `consumer` that finished `days` days ago.
pub async fn old_rows(db: &TestDb, consumer: &str, n: i64, days: i64) {
    db.exec(&format!(
        "INSERT INTO txinbox.inbox (consumer, message_id, id_strategy, fingerprint, status, attempts,
                                    first_seen_at, processed_at, source_system, destination)
         SELECT '{consumer}', 'old-{days}-' || i, 'cloudevents', sha256(i::text::bytea), 'processed', 1,
                now() - interval '{days} days', now() - interval '{days} days', 'kafka', 't'
         FROM generate_series(1, {n}) i"
    ))
    .await;
}

/// Inbox rows of `consumer`.
pub async fn inbox_rows(db: &TestDb, consumer: &str) -> i64 {
    db.scalar(&format!(
        "SELECT count(*) FROM txinbox.inbox WHERE consumer = '{consumer}'"
    ))
    .await
}

/// A migrated SQLite file of the embedded store for one test, removed when dropped; `url` is
/// what `--database-url` takes (`sqlite:path`).
pub struct SqliteDb {
    pub pool: txinbox::sqlx::SqlitePool,
    pub url: String,
    path: std::path::PathBuf,
}

impl SqliteDb {
    pub async fn new() -> SqliteDb {
        let path = std::env::temp_dir().join(format!("{}.db", unique("txinbox_cli_sqlite")));
        let inbox = txinbox::SqliteInbox::open(&path, 4)
            .await
            .expect("open the SQLite file");
        txinbox::sqlite::migrate(inbox.pool())
            .await
            .expect("migrate SQLite");
        SqliteDb {
            pool: inbox.pool().clone(),
            url: format!("sqlite:{}", path.display()),
            path,
        }
    }

    pub async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

impl Drop for SqliteDb {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}
