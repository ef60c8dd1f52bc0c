//! Test support: a fresh database per test with the deposit ledger (`txinbox_testing`), a queue
//! per test with a confirming publisher, a probe around the source, and `rabbitmqctl` fault
//! injection.

use std::collections::HashMap;
use std::future::Future;
use std::process::Command;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sqlx::postgres::PgPool;
use txinbox::{
    async_trait, source::Capabilities, source::Lane, source::SettleError, source::Settlement,
    source::SourceError, Consumer, Delivery, Message, MessageSource, RetryPolicy,
};
use txinbox_amqp::{AmqpConfig, AmqpMonitor, AmqpSource};
use txinbox_testing::database::TestDatabase;
pub use txinbox_testing::ledger::{deposit, DepositHandler};

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A name unique to this test process and call: `txinbox-amqp-t-<pid>-<n>-<what>`.
pub fn unique(what: &str) -> String {
    format!(
        "txinbox-amqp-t-{}-{}-{what}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    )
}

// ---------------------------------------------------------------------------------------------
// Test isolation: tests that restart the broker or load the machine run alone.

static SUITE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Held by tests that may run alongside others.
pub async fn shared() -> tokio::sync::RwLockReadGuard<'static, ()> {
    SUITE.read().await
}

/// Held by tests that disturb the broker or need the machine for themselves.
pub async fn exclusive() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    SUITE.write().await
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL

/// A database created for one test, with txinbox migrated and the demo tables created.
pub struct TestDb {
    pub pool: PgPool,
    db: TestDatabase,
}

impl TestDb {
    pub async fn new(max_connections: u32) -> TestDb {
        let db = TestDatabase::builder("txinbox_amqp_t")
            .max_connections(max_connections)
            .create()
            .await;
        txinbox_testing::ledger::create_tables(db.pool()).await;
        TestDb {
            pool: db.pool().clone(),
            db,
        }
    }

    pub fn inbox(&self) -> txinbox::PostgresInbox {
        txinbox::PostgresInbox::new(self.pool.clone())
    }

    pub async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap()
    }

    pub async fn balance(&self, account: &str) -> i64 {
        sqlx::query_scalar("SELECT coalesce((SELECT balance FROM accounts WHERE id = $1), 0)")
            .bind(account)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Effects are exactly once: one row per message ID, none twice.
    pub async fn assert_exactly_once(&self, unique_ids: i64) {
        let (rows, distinct): (i64, i64) =
            sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM effects")
                .fetch_one(&self.pool)
                .await
                .unwrap();
        assert_eq!(
            distinct, unique_ids,
            "every unique message ID has an effect (none lost)"
        );
        assert_eq!(rows, unique_ids, "no message ID has two effects (none doubled)");
    }

    /// Drops the database (at the end of a passing test).
    pub async fn drop_db(self) {
        drop(self.pool);
        self.db.drop_database().await;
    }
}

// ---------------------------------------------------------------------------------------------
// RabbitMQ

/// A work queue (plus its `.retry` and `.dlq`) for one test, and a confirming publisher.
pub struct TestQueue {
    pub name: String,
    /// Connection name prefix of this test's consumers (for `close_connections`).
    pub conn_prefix: String,
    conn: Connection,
    channel: Channel,
}

static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

impl TestQueue {
    pub async fn new(what: &str) -> TestQueue {
        let name = unique(what);
        let conn = Connection::connect(
            &amqp_url(),
            ConnectionProperties::default().with_connection_name(format!("{name}-publisher").into()),
        )
        .await
        .expect("connect to AMQP_URL (is RabbitMQ running? scripts/test starts it)");
        let channel = conn.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        SWEPT.get_or_init(|| sweep_stale_queues(&channel)).await;
        // Declared up front so publishing before the first consumer is not lost.
        for q in [name.clone(), format!("{name}.retry"), format!("{name}.dlq")] {
            let args = if q.ends_with(".retry") {
                retry_args(&name)
            } else {
                FieldTable::default()
            };
            channel
                .queue_declare(
                    q.as_str().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    args,
                )
                .await
                .unwrap();
        }
        TestQueue {
            conn_prefix: format!("{name}-consumer"),
            name,
            conn,
            channel,
        }
    }

    /// A source config for this queue with fast reconnects; its connection name carries
    /// `conn_prefix` so the test can close exactly its consumers' connections.
    pub fn config(&self, prefetch: u16) -> AmqpConfig {
        AmqpConfig::new(amqp_url(), &self.name)
            .prefetch(prefetch)
            .connection_name(unique(&self.conn_prefix))
            .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
            .publish_timeout(Duration::from_secs(5))
    }

    /// Publishes persistent messages `(message_id, payload)` and waits for every confirm.
    pub async fn publish_all(&self, messages: &[(Option<String>, String)]) {
        let mut confirms = Vec::with_capacity(messages.len());
        for (id, payload) in messages {
            let mut props = BasicProperties::default().with_delivery_mode(2);
            if let Some(id) = id {
                props = props.with_message_id(id.as_str().into());
            }
            confirms.push(
                self.channel
                    .basic_publish(
                        ShortString::default(),
                        self.name.as_str().into(),
                        BasicPublishOptions::default(),
                        payload.as_bytes(),
                        props,
                    )
                    .await
                    .expect("publish"),
            );
        }
        for c in confirms {
            assert!(
                c.await.expect("publisher confirm").is_ack(),
                "broker confirmed the publish"
            );
        }
    }

    /// Publishes one persistent message with `message_id` and `headers`, and waits for its
    /// confirm.
    pub async fn publish_with_headers(&self, id: &str, payload: &[u8], headers: FieldTable) {
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(id.into())
            .with_headers(headers);
        let confirm = self
            .channel
            .basic_publish(
                ShortString::default(),
                self.name.as_str().into(),
                BasicPublishOptions::default(),
                payload,
                props,
            )
            .await
            .expect("publish");
        assert!(
            confirm.await.expect("publisher confirm").is_ack(),
            "broker confirmed the publish of {id}"
        );
    }

    /// `(ready messages, consumers)` of `queue`, through a passive declare on a fresh channel.
    pub async fn stats_of(&self, queue: &str) -> (u32, u32) {
        let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect("connect for queue stats");
        let ch = conn.create_channel().await.unwrap();
        let q = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("queue exists");
        let _ = conn.close(200, "done".into()).await;
        (q.message_count(), q.consumer_count())
    }

    pub async fn ready(&self) -> u32 {
        self.stats_of(&self.name).await.0
    }

    /// Takes every message of the dead-letter queue: `(message_id, headers as strings)`.
    pub async fn drain_dlq(&self) -> Vec<(Option<String>, HashMap<String, String>)> {
        let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let mut out = Vec::new();
        while let Some(m) = ch
            .basic_get(
                format!("{}.dlq", self.name).as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            let props = &m.delivery.properties;
            let headers = props
                .headers()
                .as_ref()
                .map(|t| {
                    t.inner()
                        .iter()
                        .filter_map(|(k, v)| match v {
                            AMQPValue::LongString(s) => {
                                Some((k.to_string(), String::from_utf8_lossy(s.as_bytes()).into_owned()))
                            }
                            AMQPValue::LongLongInt(i) => Some((k.to_string(), i.to_string())),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push((props.message_id().as_ref().map(|s| s.to_string()), headers));
        }
        let _ = conn.close(200, "done".into()).await;
        out
    }

    /// Deletes the three queues.
    pub async fn delete(self) {
        let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        for q in [
            self.name.clone(),
            format!("{}.retry", self.name),
            format!("{}.dlq", self.name),
        ] {
            let _ = ch
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = conn.close(200, "done".into()).await;
        let _ = self.conn.close(200, "done".into()).await;
    }
}

fn retry_args(queue: &str) -> FieldTable {
    txinbox_amqp::retry_queue_arguments(queue)
}

/// Deletes queues left by earlier runs of this suite (a failed test keeps its own): those whose
/// process is gone. Test processes run side by side (cargo-nextest runs one per test), so a
/// queue of a live process is someone's test in progress and is left alone.
async fn sweep_stale_queues(channel: &Channel) {
    let Ok(out) = Command::new("rabbitmqctl")
        .args(["-q", "list_queues", "--no-table-headers", "name"])
        .output()
    else {
        return;
    };
    let owner_alive = |name: &str| {
        let pid = name
            .strip_prefix("txinbox-amqp-t-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok());
        pid.is_none_or(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
    };
    for name in String::from_utf8_lossy(&out.stdout).lines().map(str::trim) {
        if name.starts_with("txinbox-amqp-t-") && !owner_alive(name) {
            let _ = channel
                .queue_delete(name.into(), QueueDeleteOptions::default())
                .await;
        }
    }
}

fn rabbitmqctl(args: &[&str]) -> String {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("run rabbitmqctl (as root; scripts/test installs RabbitMQ)");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Force-closes every broker connection whose client properties mention `marker` (as
/// `rabbitmqctl close_connection` does to a misbehaving client). Returns how many.
pub fn close_connections(marker: &str) -> usize {
    let list = rabbitmqctl(&[
        "-q",
        "list_connections",
        "--no-table-headers",
        "pid",
        "client_properties",
    ]);
    // In parallel: each rabbitmqctl call takes a while to start.
    let closing: Vec<_> = list
        .lines()
        .filter(|l| l.contains(marker))
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|pid| {
            Command::new("rabbitmqctl")
                .args(["-q", "close_connection", pid, "txinbox test: forced close"])
                .spawn()
                .ok()
        })
        .collect();
    let n = closing.len();
    for mut child in closing {
        // The connection may be gone already; that is fine.
        let _ = child.wait();
    }
    n
}

/// Stops the RabbitMQ application (the node stays up); the guard starts it again even when
/// the test fails.
pub struct StoppedBroker {
    started: bool,
}

impl StoppedBroker {
    pub fn stop() -> StoppedBroker {
        rabbitmqctl(&["-q", "stop_app"]);
        StoppedBroker { started: false }
    }

    pub fn start(mut self) {
        self.start_now();
    }

    fn start_now(&mut self) {
        if !self.started {
            self.started = true;
            rabbitmqctl(&["-q", "start_app"]);
            rabbitmqctl(&["-q", "-t", "60", "await_startup"]);
        }
    }
}

impl Drop for StoppedBroker {
    fn drop(&mut self) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.start_now()));
    }
}

// ---------------------------------------------------------------------------------------------
// A probe around a source: counts receives and settlements, records receive times.

#[derive(Debug, Default)]
pub struct Probe {
    pub received: AtomicU64,
    pub settled_ok: AtomicU64,
    pub settle_failed: AtomicU64,
    pub in_flight: AtomicI64,
    pub receive_times: Mutex<Vec<(usize, Instant)>>,
}

impl Probe {
    pub fn get(&self, c: &AtomicU64) -> u64 {
        c.load(Ordering::SeqCst)
    }
}

pub struct Probed<S> {
    inner: S,
    probe: Arc<Probe>,
    idx: usize,
}

pub struct ProbedDelivery<D> {
    inner: Option<D>,
    probe: Arc<Probe>,
}

#[async_trait]
impl<S: MessageSource> MessageSource for Probed<S> {
    type Delivery = ProbedDelivery<S::Delivery>;

    async fn receive(&mut self) -> Result<Option<Self::Delivery>, SourceError> {
        let d = self.inner.receive().await?;
        Ok(d.map(|d| {
            self.probe.received.fetch_add(1, Ordering::SeqCst);
            self.probe.in_flight.fetch_add(1, Ordering::SeqCst);
            self.probe
                .receive_times
                .lock()
                .unwrap()
                .push((self.idx, Instant::now()));
            ProbedDelivery {
                inner: Some(d),
                probe: self.probe.clone(),
            }
        }))
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn attach_health(&mut self, health: txinbox::health::SourceHealth) {
        self.inner.attach_health(health);
    }

    async fn close(self) -> Result<(), SourceError> {
        self.inner.close().await
    }
}

#[async_trait]
impl<D: Delivery> Delivery for ProbedDelivery<D> {
    fn message(&self) -> &Message {
        self.inner.as_ref().unwrap().message()
    }

    fn lane(&self) -> Lane {
        self.inner.as_ref().unwrap().lane()
    }

    fn position_to_store(&self) -> Option<txinbox::position::Position> {
        self.inner.as_ref().unwrap().position_to_store()
    }

    async fn settle(mut self, settlement: Settlement) -> Result<(), SettleError> {
        let d = self.inner.take().unwrap();
        let r = d.settle(settlement).await;
        self.probe.in_flight.fetch_sub(1, Ordering::SeqCst);
        match &r {
            Ok(()) => self.probe.settled_ok.fetch_add(1, Ordering::SeqCst),
            Err(_) => self.probe.settle_failed.fetch_add(1, Ordering::SeqCst),
        };
        r
    }
}

impl<D> Drop for ProbedDelivery<D> {
    fn drop(&mut self) {
        if self.inner.is_some() {
            self.probe.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running consumers

pub fn fast_retries() -> RetryPolicy {
    RetryPolicy::default()
        .initial_delay(Duration::from_millis(20))
        .max_delay(Duration::from_millis(50))
}

/// A running consumer: its task, its stop switch, its connection monitor.
pub struct Running {
    pub task: tokio::task::JoinHandle<Result<(), txinbox::Error>>,
    stop: tokio::sync::oneshot::Sender<()>,
    pub monitor: AmqpMonitor,
    /// The consumer's health (what `/readyz` would answer).
    pub health: txinbox::health::Health,
}

impl Running {
    /// Graceful shutdown: drains, settles, closes the source.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("consumer stops within 30 s")
            .expect("consumer task")
            .expect("consumer ends without error");
    }
}

pub struct Spec<'a> {
    pub name: &'a str,
    pub db: &'a TestDb,
    pub handler: DepositHandler,
    pub concurrency: usize,
    pub retry: RetryPolicy,
}

pub async fn start(spec: &Spec<'_>, config: AmqpConfig, probe: &Arc<Probe>, idx: usize) -> Running {
    // Logs for debugging a failure: RUST_LOG=txinbox_amqp=debug cargo test -p txinbox-amqp
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .try_init();
    }
    let source = AmqpSource::connect(config).await.expect("AmqpSource connects");
    let monitor = source.monitor();
    let consumer = Consumer::builder(spec.name)
        .source(Probed {
            inner: source,
            probe: probe.clone(),
            idx,
        })
        .inbox(spec.db.inbox())
        .handler(spec.handler.clone())
        .concurrency(spec.concurrency)
        .retry_policy(spec.retry.clone())
        .build()
        .expect("consumer builds");
    let health = consumer.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run_until(async move {
        let _ = stopped.await;
    }));
    Running {
        task,
        stop,
        monitor,
        health,
    }
}

/// Polls `cond` every 50 ms until it holds, or panics with `what` after `limit`.
pub async fn wait_until<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    loop {
        if cond().await {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `unique_ids` effects exist, the queue has nothing ready and no delivery is in
/// flight, and that stays so for 500 ms (so prefetched deliveries have been seen too).
pub async fn wait_settled(db: &TestDb, queue: &TestQueue, probe: &Probe, unique_ids: i64, limit: Duration) {
    let started = Instant::now();
    let mut quiet_since: Option<(Instant, u64)> = None;
    loop {
        let effects = db.scalar("SELECT count(*) FROM effects").await;
        let ready = queue.ready().await;
        let in_flight = probe.in_flight.load(Ordering::SeqCst);
        let received = probe.get(&probe.received);
        if effects >= unique_ids && ready == 0 && in_flight == 0 {
            match quiet_since {
                Some((since, seen)) if seen == received => {
                    if since.elapsed() >= Duration::from_millis(500) {
                        return;
                    }
                }
                _ => quiet_since = Some((Instant::now(), received)),
            }
        } else {
            quiet_since = None;
        }
        assert!(
            started.elapsed() < limit,
            "not settled after {limit:?}: effects {effects}/{unique_ids}, ready {ready}, in flight {in_flight}, received {received}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A deterministic shuffle (xorshift), so runs are comparable.
pub fn shuffle<T>(v: &mut [T], mut seed: u64) {
    for i in (1..v.len()).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
}

/// `unique` deposits of 1..=unique cents to 7 accounts, `dup_every`-th ones published twice,
/// shuffled. Returns the messages and the expected total.
pub fn deposits(prefix: &str, unique: usize, dup_every: usize) -> (Vec<(Option<String>, String)>, i64) {
    let mut msgs = Vec::new();
    let mut total = 0;
    for i in 0..unique {
        let id = format!("{prefix}-{i}");
        let amount = (i % 100) as i64 + 1;
        total += amount;
        let payload = deposit(&format!("acct-{}", i % 7), amount);
        if i % dup_every == 0 {
            msgs.push((Some(id.clone()), payload.clone()));
        }
        msgs.push((Some(id), payload));
    }
    shuffle(&mut msgs, 0x9E37_79B9_7F4A_7C15);
    (msgs, total)
}

pub async fn total_balance(db: &TestDb) -> i64 {
    db.scalar("SELECT coalesce(sum(balance), 0)::bigint FROM accounts")
        .await
}

/// A broker user of this test (`txinbox-amqp-t-…`) that may read every queue of the default
/// vhost but neither write nor configure anything; deleted when dropped.
pub struct ReadOnlyUser {
    pub name: String,
    pub uri: String,
}

impl ReadOnlyUser {
    pub fn create() -> ReadOnlyUser {
        let name = unique("readonly");
        let password = format!("pw-{}", std::process::id());
        rabbitmqctl(&["-q", "add_user", &name, &password]);
        rabbitmqctl(&["-q", "set_permissions", "-p", "/", &name, "^$", "^$", ".*"]);
        let url = amqp_url();
        let uri = url.replacen("guest:guest", &format!("{name}:{password}"), 1);
        assert_ne!(uri, url, "AMQP_URL must use guest:guest for this test");
        ReadOnlyUser { name, uri }
    }
}

impl Drop for ReadOnlyUser {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["-q", "delete_user", &self.name])
            .output();
    }
}
