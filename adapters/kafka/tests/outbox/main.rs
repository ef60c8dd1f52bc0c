//! The transactional outbox end to end on Kafka (librdkafka's mock cluster) and a real
//! PostgreSQL: consumer A (inbox) writes outbox rows, the relay publishes them with
//! [`KafkaPublisher`], consumer B (inbox) applies them — with the relay killed between the
//! broker's confirmation and the marking of the rows, several times. And two relays on one
//! outbox. Needs `DATABASE_URL`; the pipeline test needs the feature `crash-points` and is not
//! compiled without it (`scripts/test` runs with `--all-features`;
//! `cargo test -p txinbox-kafka --features crash-points --test outbox` runs it alone).

#[path = "../common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{header, init_tracing, read_all, Producer, TestDb};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::mocking::MockCluster;
use rdkafka::ClientConfig;
use sqlx::{Executor, Postgres};
use txinbox::outbox::{self, OutboxMessage, Relay, RelayConfig, ID_HEADER};
use txinbox::{async_trait, sqlx, Context, Handler, HandlerError, IdStrategy, Message, RetryPolicy};
use txinbox_kafka::{KafkaConfig, KafkaPublisher, KafkaSource};

/// librdkafka's mock cluster on its own thread (it is `!Send`); it lives until dropped.
struct Mock {
    bootstrap: String,
    commands: std_mpsc::Sender<(MockCommand, std_mpsc::Sender<()>)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

enum MockCommand {
    Topic(String, i32),
    /// Broker 1 up (`true`) or down.
    Broker(bool),
}

impl Mock {
    fn start() -> Mock {
        let (commands, rx) = std_mpsc::channel::<(MockCommand, std_mpsc::Sender<()>)>();
        let (ready, bootstrap) = std_mpsc::channel();
        let thread = std::thread::spawn(move || {
            let cluster = MockCluster::new(1).expect("mock cluster");
            ready.send(cluster.bootstrap_servers()).unwrap();
            for (command, done) in rx {
                match command {
                    MockCommand::Topic(name, partitions) => {
                        cluster.create_topic(&name, partitions, 1).unwrap()
                    }
                    MockCommand::Broker(true) => cluster.broker_up(1).unwrap(),
                    MockCommand::Broker(false) => cluster.broker_down(1).unwrap(),
                }
                let _ = done.send(());
            }
        });
        Mock {
            bootstrap: bootstrap.recv().unwrap(),
            commands,
            thread: Some(thread),
        }
    }

    fn call(&self, command: MockCommand) {
        let (done, wait) = std_mpsc::channel();
        self.commands.send((command, done)).unwrap();
        wait.recv().unwrap();
    }

    fn topic(&self, name: &str, partitions: i32) {
        self.call(MockCommand::Topic(name.into(), partitions));
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

/// A scratch database (`txinbox_kafka_outbox_t_…`) with the demo tables; a passing test drops
/// its own ([`drop_db`]).
async fn outbox_db() -> TestDb {
    TestDb::create("txinbox_kafka_outbox_t").await
}

async fn drop_db(db: TestDb) {
    db.drop_db().await;
}

const ORDERS: &str = "orders";
const EVENTS: &str = "events";
const STEPS: [&str; 2] = ["reserved", "billed"];

#[derive(serde::Deserialize)]
struct Order {
    customer: String,
    amount: i64,
}

/// Consumer A: records the order and writes one outbox event per step, keyed by customer.
/// Fails the first attempt of every 5th order *after* writing its outbox rows (they roll back),
/// and remembers the IDs every attempt derived.
#[derive(Clone, Default)]
struct OrderHandler {
    derived: Arc<Mutex<HashMap<String, Vec<Vec<String>>>>>,
}

#[async_trait]
impl Handler<Postgres> for OrderHandler {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let order: Order = msg.json()?;
        let id = cx.message_id().as_str().to_owned();
        sqlx::query("INSERT INTO a_orders (order_id, customer, amount) VALUES ($1, $2, $3)")
            .bind(&id)
            .bind(&order.customer)
            .bind(order.amount)
            .execute(cx.db())
            .await?;
        let mut ids = Vec::new();
        for step in STEPS {
            let event_id = cx.derive_id(step);
            let payload = format!(
                r#"{{"order":"{id}","customer":"{}","step":"{step}","amount":{}}}"#,
                order.customer, order.amount
            );
            let event = OutboxMessage::new(&event_id, EVENTS, payload).with_key(order.customer.clone());
            cx.outbox(&event).await?;
            ids.push(event_id);
        }
        self.derived
            .lock()
            .unwrap()
            .entry(id.clone())
            .or_default()
            .push(ids);
        let n: usize = id.trim_start_matches("order-").parse().unwrap();
        if n.is_multiple_of(5) && cx.attempt() == 1 {
            return Err(HandlerError::transient(
                "simulated failure after the outbox write",
            ));
        }
        Ok(())
    }
}

#[derive(serde::Deserialize)]
struct Event {
    order: String,
    step: String,
}

/// Consumer B: a non-idempotent effect per event (a row per application, in application
/// order).
#[derive(Clone)]
struct ApplyHandler;

#[async_trait]
impl Handler<Postgres> for ApplyHandler {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let key = msg.key().map(|k| String::from_utf8_lossy(k).into_owned());
        let event: Event = msg.json()?;
        sqlx::query("INSERT INTO b_effects (message_id, customer, event) VALUES ($1, $2, $3)")
            .bind(cx.message_id().as_str())
            .bind(key)
            .bind(format!("{}/{}", event.order, event.step))
            .execute(cx.db())
            .await?;
        Ok(())
    }
}

struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), txinbox::Error>>,
}

impl Running {
    fn start<H: Handler<Postgres>>(
        db: &TestDb,
        brokers: &str,
        name: &str,
        topic: &str,
        id: IdStrategy,
        handler: H,
    ) -> Running {
        let inbox = db.inbox();
        let config = KafkaConfig::new(brokers, format!("g-{name}"))
            .topic(topic)
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("auto.commit.interval.ms", "200")
            .revoke_timeout(Duration::from_secs(5))
            .close_timeout(Duration::from_secs(15));
        let source = KafkaSource::new(config).expect("kafka source");
        let consumer = txinbox::Consumer::builder(name)
            .source(source)
            .inbox(inbox)
            .handler(handler)
            .id_strategy(id)
            .retry_policy(
                RetryPolicy::default()
                    .initial_delay(Duration::from_millis(5))
                    .max_delay(Duration::from_millis(20)),
            )
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

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .expect("consumer stops within 30 s")
            .expect("consumer task")
            .expect("consumer ran without a fatal error");
    }
}

fn publisher(brokers: &str) -> KafkaPublisher {
    KafkaPublisher::builder(brokers)
        .delivery_timeout(Duration::from_secs(10))
        .build()
        .expect("publisher")
}

fn relay_config(name: &str, batch: usize) -> RelayConfig {
    RelayConfig::default()
        .name(name)
        .batch_size(batch)
        .poll_interval(Duration::from_millis(100))
}

/// Records in `topic` (all partitions), from the high watermarks.
fn records_in(brokers: &str, topic: &str, partitions: i32) -> i64 {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    (0..partitions)
        .map(|p| {
            let (lo, hi) = c
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            hi - lo
        })
        .sum()
}

async fn pending(db: &TestDb) -> i64 {
    db.scalar("SELECT count(*) FROM txinbox.outbox WHERE status = 'pending'")
        .await
}

async fn wait_until<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !check().await {
        assert!(started.elapsed() < within, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Run by `pipeline_exactly_once_with_relay_killed_between_publish_and_mark` in a child process
/// with `TXINBOX_CRASH_AT=relay_published:<n>`: relays until the crash point aborts it.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process of pipeline_exactly_once_with_relay_killed_between_publish_and_mark"]
async fn relay_child() {
    let (Ok(brokers), Ok(db)) = (
        std::env::var("TXOUTBOX_CHILD_BROKERS"),
        std::env::var("TXOUTBOX_CHILD_DB"),
    ) else {
        return;
    };
    init_tracing();
    let db = TestDb::open(&db).await;
    let relay = Relay::new(db.pool.clone(), publisher(&brokers), relay_config("child", 10)).unwrap();
    relay.run_until(std::future::pending()).await.unwrap();
}

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pipeline_exactly_once_with_relay_killed_between_publish_and_mark() {
    init_tracing();
    let mock = Mock::start();
    for t in [ORDERS, EVENTS] {
        mock.topic(t, 3);
        mock.topic(&format!("{t}.dlq"), 1);
    }
    let db = outbox_db().await;
    db.pool
        .execute(
            "CREATE TABLE a_orders (order_id text PRIMARY KEY, customer text NOT NULL, amount bigint NOT NULL);
             CREATE TABLE b_effects (seq bigserial PRIMARY KEY, message_id text NOT NULL, customer text,
                                     event text NOT NULL);",
        )
        .await
        .unwrap();

    // 40 orders of 4 customers.
    let orders = 40;
    let producer = Producer::new(&mock.bootstrap);
    for i in 0..orders {
        let customer = format!("c{}", i % 4);
        let payload = format!(r#"{{"customer":"{customer}","amount":{}}}"#, i + 1);
        producer
            .send(ORDERS, None, &customer, Some(&format!("order-{i}")), &payload)
            .await;
    }
    let handler_a = OrderHandler::default();
    let a = Running::start(
        &db,
        &mock.bootstrap,
        "service-a",
        ORDERS,
        IdStrategy::Header("ce_id".into()),
        handler_a.clone(),
    );
    let expected_rows = (orders * STEPS.len()) as i64;
    wait_until(
        Duration::from_secs(60),
        "consumer A to write every outbox row",
        || async { pending(&db).await == expected_rows },
    )
    .await;
    let b = Running::start(
        &db,
        &mock.bootstrap,
        "service-b",
        EVENTS,
        IdStrategy::Header(ID_HEADER.into()),
        ApplyHandler,
    );

    // Kill the relay between the broker's confirmation and the marking, four times: twice on
    // its first batch (the same rows published again each time), then on its 2nd and 3rd.
    let mut published_before = records_in(&mock.bootstrap, EVENTS, 3);
    for nth in [1, 1, 2, 3] {
        let pending_before = pending(&db).await;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "relay_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TXOUTBOX_CHILD_BROKERS", &mock.bootstrap)
            .env("TXOUTBOX_CHILD_DB", &db.name)
            .env(
                txinbox::crash::ENV,
                format!("{}:{nth}", txinbox::crash::RELAY_PUBLISHED),
            )
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start the child relay");
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("the child relay did not reach its crash point within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(
                status.signal(),
                Some(6),
                "the child relay aborted at the crash point ({status}); is feature crash-points on?"
            );
        }
        let published_now = records_in(&mock.bootstrap, EVENTS, 3);
        let batch = 10;
        let marked = pending_before - pending(&db).await;
        assert_eq!(
            marked,
            batch * (nth - 1),
            "only the batches before the crash were marked"
        );
        assert_eq!(
            published_now - published_before,
            batch * nth,
            "the crashed batch was published (confirmed) before the crash"
        );
        published_before = published_now;
    }

    // A relay that is not killed finishes the job.
    let relay = Relay::new(
        db.pool.clone(),
        publisher(&mock.bootstrap),
        relay_config("final", 10),
    )
    .unwrap();
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay_task = tokio::spawn(relay.run_until(async {
        let _ = relay_stopped.await;
    }));
    wait_until(
        Duration::from_secs(60),
        "the relay to publish every row",
        || async { pending(&db).await == 0 },
    )
    .await;
    wait_until(
        Duration::from_secs(60),
        "consumer B to apply every event",
        || async {
            db.scalar("SELECT count(DISTINCT message_id) FROM b_effects")
                .await
                >= expected_rows
        },
    )
    .await;
    let total_published = records_in(&mock.bootstrap, EVENTS, 3);
    // Let B see every copy (it is behind by at most the republished batches).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = stop_relay.send(());
    relay_task.await.unwrap().unwrap();
    b.stop().await;
    a.stop().await;

    // Republication happened: more records than rows.
    assert_eq!(
        total_published,
        expected_rows + 10 * (1 + 1 + 1 + 1),
        "each crash republished its batch once"
    );

    // The IDs: every attempt of an order derived the same IDs, and they are the documented
    // derivation of (order ID, step); retried orders really ran twice.
    let derived = handler_a.derived.lock().unwrap().clone();
    let mut expected_ids = HashSet::new();
    for i in 0..orders {
        let order = format!("order-{i}");
        let attempts = &derived[&order];
        let want: Vec<String> = STEPS
            .iter()
            .map(|s| outbox::derive_id("service-a", &order, s))
            .collect();
        assert!(attempts.iter().all(|ids| *ids == want), "{order}: {attempts:?}");
        // Every order ran; a failed one at least twice. Micro-batching may run a handler
        // again when a neighbour's failure rolls its batch back (the effects roll back too).
        let at_least = if i.is_multiple_of(5) { 2 } else { 1 };
        assert!(attempts.len() >= at_least, "{order}: {} attempts", attempts.len());
        expected_ids.extend(want);
    }
    let in_outbox: HashSet<String> = sqlx::query_scalar("SELECT message_id FROM txinbox.outbox")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(
        in_outbox, expected_ids,
        "one outbox row per derived ID, none from rolled-back attempts"
    );

    // B: every event applied exactly once, by its business identity (order, step) and by ID.
    let per_event: Vec<(String, i64)> =
        sqlx::query_as("SELECT event, count(*) FROM b_effects GROUP BY event")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let twice: Vec<_> = per_event.iter().filter(|(_, n)| *n != 1).collect();
    assert!(twice.is_empty(), "events applied more than once: {twice:?}");
    assert_eq!(per_event.len() as i64, expected_rows, "every event applied");
    let applied: Vec<(String, i64)> =
        sqlx::query_as("SELECT message_id, count(*) FROM b_effects GROUP BY message_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let twice: Vec<_> = applied.iter().filter(|(_, n)| *n != 1).collect();
    assert!(twice.is_empty(), "applied more than once: {twice:?}");
    let applied: HashSet<String> = applied.into_iter().map(|(id, _)| id).collect();
    assert_eq!(applied, expected_ids, "B applied exactly the events A wrote");
    let inbox_rows = db
        .scalar("SELECT count(*) FROM txinbox.inbox WHERE consumer = 'service-b'")
        .await;
    assert_eq!(inbox_rows, expected_rows, "one inbox row per event at B");

    // Per customer, B applied the events in the outbox's order.
    let outbox_order: Vec<(String, String)> = sqlx::query_as(
        "SELECT convert_from(message_key, 'UTF8'), message_id FROM txinbox.outbox ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let b_order: Vec<(String, String)> =
        sqlx::query_as("SELECT customer, message_id FROM b_effects ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        by_key(&b_order),
        by_key(&outbox_order),
        "per-key order at consumer B"
    );
    drop_db(db).await;
}

fn by_key(rows: &[(String, String)]) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, id) in rows {
        m.entry(k.clone()).or_default().push(id.clone());
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_on_one_outbox_publish_every_row_in_key_order() {
    init_tracing();
    let mock = Mock::start();
    mock.topic(EVENTS, 3);
    two_relays(&mock.bootstrap, EVENTS).await;
}

/// The same against a real Kafka-protocol broker: **needs `KAFKA_BROKERS`** (tansu from
/// `scripts/lib/tansu.sh`); without it the test says so and passes, except under `CI`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_on_a_real_broker() {
    let Ok(brokers) = std::env::var("KAFKA_BROKERS") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "KAFKA_BROKERS must be set in CI (scripts/test sets it)"
        );
        eprintln!("SKIPPED: KAFKA_BROKERS is not set (source scripts/lib/tansu.sh and run ensure_tansu)");
        return;
    };
    init_tracing();
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let topic = format!("outbox-events-{}-{stamp}", std::process::id());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("admin client");
    for r in admin
        .create_topics(
            &[NewTopic::new(&topic, 3, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topic")
    {
        r.expect("topic created");
    }
    two_relays(&brokers, &topic).await;
}

async fn two_relays(brokers: &str, topic: &str) {
    let db = outbox_db().await;
    // A few more keys than a round claims (batch 7; 5 on AMQP): both relays find work, and
    // they contend for the same keys.
    let (keys, per_key) = (9, 40);
    let write = |from: usize, to: usize| {
        let pool = db.pool.clone();
        let topic = topic.to_owned();
        async move {
            for i in from..to {
                for k in 0..keys {
                    let m = OutboxMessage::new(format!("k{k}-{i}"), &topic, format!("{i}"))
                        .with_key(format!("k{k}"));
                    outbox::write(&pool, &m).await.unwrap();
                }
            }
        }
    };
    write(0, per_key / 2).await;

    let counts: Vec<Arc<AtomicUsize>> = vec![Arc::default(), Arc::default()];
    let mut stops = Vec::new();
    let mut tasks = Vec::new();
    for (n, name) in ["relay-a", "relay-b"].into_iter().enumerate() {
        let relay = Relay::new(
            db.pool.clone(),
            Counting(publisher(brokers), counts[n].clone()),
            relay_config(name, 7),
        )
        .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        stops.push(stop);
        tasks.push(tokio::spawn(relay.run_until(async {
            let _ = stopped.await;
        })));
    }
    // The rest arrives while both relays run.
    write(per_key / 2, per_key).await;
    let total = (keys * per_key) as i64;
    wait_until(
        Duration::from_secs(60),
        "both relays to publish every row",
        || async {
            db.scalar("SELECT count(*) FROM txinbox.outbox WHERE status = 'published'")
                .await
                == total
        },
    )
    .await;
    for s in stops {
        let _ = s.send(());
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let (na, nb) = (counts[0].load(Ordering::SeqCst), counts[1].load(Ordering::SeqCst));
    assert!(na > 0 && nb > 0, "both relays published (a: {na}, b: {nb})");
    assert_eq!(
        (na + nb) as i64,
        total,
        "no row published twice without a failure"
    );

    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    let records = tokio::task::spawn_blocking(move || {
        read_all(&brokers, &topic, 3, total as usize, Duration::from_secs(30))
    })
    .await
    .unwrap();
    assert_eq!(records.len() as i64, total, "every row on the topic");
    let mut next: HashMap<String, usize> = HashMap::new();
    for r in &records {
        use rdkafka::message::Message as _;
        let key = String::from_utf8(r.key().unwrap().to_vec()).unwrap();
        let id = header(r, ID_HEADER).expect("message ID header");
        let expected = next.entry(key.clone()).or_default();
        assert_eq!(id, format!("{key}-{expected}"), "key {key} out of order");
        *expected += 1;
    }
    assert_eq!(next.len(), keys);
    assert!(next.values().all(|n| *n == per_key));
    drop_db(db).await;
}

/// Counts what one relay published.
struct Counting(KafkaPublisher, Arc<AtomicUsize>);

#[async_trait]
impl outbox::Publisher for Counting {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), outbox::PublishError> {
        self.0.publish(message).await?;
        self.1.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// librdkafka raises a fatal error on an idempotent producer when it can no longer vouch for
/// order and once-ness (here: the broker answers the first produce with OUT_OF_ORDER_SEQUENCE);
/// that producer refuses every later message. The publisher must replace it, or the relay
/// would fail every row until the process restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_producer_error_is_survived_with_a_new_producer() {
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    use txinbox::outbox::Publisher;

    let topic = "fatal".to_string(); // a mock cluster of its own
    let (ready, bootstrap) = std_mpsc::channel();
    let (stop, stopped) = std_mpsc::channel::<()>();
    let cluster_topic = topic.clone();
    let cluster = std::thread::spawn(move || {
        let cluster = MockCluster::new(1).expect("mock cluster");
        cluster.create_topic(&cluster_topic, 1, 1).unwrap();
        cluster.request_errors(
            RDKafkaApiKey::Produce,
            &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER],
        );
        ready.send(cluster.bootstrap_servers()).unwrap();
        let _ = stopped.recv();
    });
    let brokers: String = bootstrap.recv().unwrap();
    let publisher = KafkaPublisher::builder(&brokers)
        .delivery_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let first = publisher
        .publish(&OutboxMessage::new("fatal-1", &topic, "x").with_key("k"))
        .await;
    assert!(first.is_err(), "the broker refused the first produce: {first:?}");
    let second = publisher
        .publish(&OutboxMessage::new("fatal-2", &topic, "y").with_key("k"))
        .await;
    let third = publisher
        .publish(&OutboxMessage::new("fatal-1", &topic, "x").with_key("k"))
        .await;
    tokio::task::spawn_blocking(move || drop(publisher))
        .await
        .unwrap();
    let _ = stop.send(());
    cluster.join().unwrap();
    second.expect("a publish after a fatal producer error goes through a new producer");
    third.expect("and the failed row's retry too");
}

/// What one service's outbox publishes, another service's consumer takes with its **default**
/// settings (a `KafkaSource` reads CloudEvents IDs): every row applied once, none dead-lettered
/// as `missing_id`. Rows that set their own CloudEvents `type` and `source` keep them; a row
/// header that names another ID (`ce_id` copied from an incoming event) does not replace the
/// row's. On librdkafka's mock cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_with_default_settings_takes_the_outbox_messages_once() {
    init_tracing();
    let mock = Mock::start();
    mock.topic("deposits", 3);
    outbox_to_default_consumer(&mock.bootstrap, "deposits").await;
}

/// The same against a real Kafka-protocol broker: **needs `KAFKA_BROKERS`** (tansu), else
/// skipped except under `CI`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_with_default_settings_takes_the_outbox_messages_once_on_a_real_broker() {
    let Ok(brokers) = std::env::var("KAFKA_BROKERS") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "KAFKA_BROKERS must be set in CI (scripts/test sets it)"
        );
        eprintln!("SKIPPED: KAFKA_BROKERS is not set (source scripts/lib/tansu.sh and run ensure_tansu)");
        return;
    };
    init_tracing();
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let topic = format!("outbox-default-{}-{stamp}", std::process::id());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("admin client");
    for r in admin
        .create_topics(
            &[NewTopic::new(&topic, 3, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topic")
    {
        r.expect("topic created");
    }
    outbox_to_default_consumer(&brokers, &topic).await;
}

async fn outbox_to_default_consumer(brokers: &str, topic: &str) {
    use txinbox::message::Headers;
    use txinbox_testing::ledger::{deposit, DepositHandler};
    let db = outbox_db().await;
    const ROWS: usize = 24;
    for i in 0..ROWS {
        let mut headers = Headers::new();
        if i.is_multiple_of(4) {
            headers.insert("ce_type", "bank.deposit");
            headers.insert("ce_source", "/bank");
        }
        if i.is_multiple_of(3) {
            // Copied from the event this row answers: not the row's ID.
            headers.insert("ce_id", "the-incoming-event");
        }
        let m = OutboxMessage::new(format!("evt-{i}"), topic, deposit(&format!("acct-{}", i % 3), 1))
            .with_key(format!("acct-{}", i % 3))
            .with_headers(headers);
        outbox::write(&db.pool, &m).await.unwrap();
    }
    let relay = Relay::new(db.pool.clone(), publisher(brokers), relay_config("default", 10)).unwrap();
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(relay.run_until(async {
        let _ = relay_stopped.await;
    }));

    // The consumer side sets nothing about IDs.
    let handler = DepositHandler::default();
    let consumer = common::Running::start(
        &db,
        common::kafka_config(brokers, &format!("g-default-{}", std::process::id()), topic),
        handler.clone(),
    );
    let started = Instant::now();
    loop {
        let applied = db.applied().await;
        if applied == ROWS as i64 {
            break;
        }
        let dead: Vec<(String, String)> =
            sqlx::query_as("SELECT coalesce(message_id, '-'), reason FROM txinbox.dead_letters LIMIT 3")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{applied} of {ROWS} outbox messages applied after 60 s; dead letters: {dead:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    consumer.stop().await;
    let _ = stop_relay.send(());
    relay.await.unwrap().unwrap();

    let applications = db.applications().await;
    let expected: HashMap<String, i64> = (0..ROWS).map(|i| (format!("evt-{i}"), 1)).collect();
    assert_eq!(applications, expected, "every row applied once, under its own ID");
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 0);
    for start in handler.starts() {
        let i: usize = start.id.trim_start_matches("evt-").parse().unwrap();
        let h = &start.headers;
        assert_eq!(h.get_str("ce_specversion"), Some("1.0"));
        assert_eq!(h.get_str("ce_id"), Some(start.id.as_str()));
        let (source, kind) = if i.is_multiple_of(4) {
            ("/bank", "bank.deposit")
        } else {
            (outbox::DEFAULT_SOURCE, topic)
        };
        assert_eq!(h.get_str("ce_source"), Some(source), "{}", start.id);
        assert_eq!(h.get_str("ce_type"), Some(kind), "{}", start.id);
    }
    drop_db(db).await;
}

/// Two relays on one outbox; relay A's broker goes down, and every publish of its rounds fails:
/// it reports the broker unavailable. Relay B (its broker up) takes and publishes every row.
/// A's broker comes back, but A never gets a row of its own again: it must find out from the
/// broker itself (`Publisher::probe`, a metadata request), or it would report an outage for
/// ever (issue 26, item 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_in_an_outage_finds_out_the_broker_is_back_without_a_row_of_its_own() {
    use txinbox::health::BrokerStatus;
    init_tracing();
    let topic = "outage";
    let (a_cluster, b_cluster) = (Mock::start(), Mock::start());
    a_cluster.topic(topic, 3);
    b_cluster.topic(topic, 3);
    let db = outbox_db().await;
    for k in 0..6 {
        let m = OutboxMessage::new(format!("k{k}-0"), topic, "x").with_key(format!("k{k}"));
        outbox::write(&db.pool, &m).await.unwrap();
    }
    let fast = |brokers: &str| {
        KafkaPublisher::builder(brokers)
            .delivery_timeout(Duration::from_secs(1))
            .build()
            .expect("publisher")
    };
    let config = |name: &str| relay_config(name, 10).publish_timeout(Duration::from_secs(3));
    let spawn = |relay: Relay<KafkaPublisher>| {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(relay.run_until(async {
            let _ = stopped.await;
        }));
        (stop, task)
    };

    a_cluster.call(MockCommand::Broker(false));
    let relay_a = Relay::new(db.pool.clone(), fast(&a_cluster.bootstrap), config("relay-a")).unwrap();
    let health = relay_a.health();
    let (stop_a, task_a) = spawn(relay_a);
    wait_until(Duration::from_secs(30), "relay A reports the outage", || async {
        health.report().broker == BrokerStatus::Disconnected
    })
    .await;
    assert!(!health.report().is_ready());

    let relay_b = Relay::new(db.pool.clone(), fast(&b_cluster.bootstrap), config("relay-b")).unwrap();
    let (stop_b, task_b) = spawn(relay_b);
    wait_until(Duration::from_secs(60), "relay B publishes every row", || async {
        pending(&db).await == 0
    })
    .await;
    assert_eq!(
        health.report().broker,
        BrokerStatus::Disconnected,
        "A's broker is still down"
    );

    a_cluster.call(MockCommand::Broker(true));
    wait_until(
        Duration::from_secs(90),
        "relay A reports the broker back",
        || async {
            let report = health.report();
            report.broker == BrokerStatus::Connected && report.is_ready()
        },
    )
    .await;
    let _ = stop_a.send(());
    let _ = stop_b.send(());
    task_a.await.unwrap().unwrap();
    task_b.await.unwrap().unwrap();
    drop_db(db).await;
}
