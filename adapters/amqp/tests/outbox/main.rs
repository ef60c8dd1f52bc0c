//! The transactional outbox end to end on a real RabbitMQ and PostgreSQL: consumer A (inbox)
//! writes outbox rows, the relay publishes them with [`AmqpPublisher`], consumer B (inbox)
//! applies them — with the relay killed between the broker's confirm and the marking of the
//! rows, several times. Two relays on one outbox. Unroutable messages count as failures.
//!
//! Needs `DATABASE_URL` and `AMQP_URL` (defaults: local PostgreSQL, `guest` on 127.0.0.1).
//! The pipeline test needs the feature `crash-points` and is not compiled without it
//! (`scripts/test` runs with `--all-features`;
//! `cargo test -p txinbox-amqp --features crash-points --test outbox` runs it alone).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use sqlx::postgres::PgPool;
use sqlx::{Executor, Postgres};
use txinbox::outbox::{self, OutboxMessage, Publisher, Relay, RelayConfig, ID_HEADER};
use txinbox::{async_trait, Context, Handler, HandlerError, Message, RetryPolicy};
use txinbox_amqp::headers;
use txinbox_amqp::{AmqpConfig, AmqpPublisher, AmqpSource};
use txinbox_testing::database::TestDatabase;

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A name unique to this process and call.
fn unique(what: &str) -> String {
    format!(
        "txinbox-outbox-t-{}-{}-{what}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    )
}

/// A scratch database with the tables of consumers A and B.
async fn create_db() -> (PgPool, TestDatabase) {
    // Not `txinbox_outbox_t_*`, the prefix of the root crate's outbox tests.
    let db = TestDatabase::new("txinbox_amqp_outbox_t").await;
    db.pool()
        .execute(
            "CREATE TABLE a_orders (order_id text PRIMARY KEY, customer text NOT NULL);
             CREATE TABLE b_effects (seq bigserial PRIMARY KEY, message_id text NOT NULL, customer text,
                                     event text NOT NULL);",
        )
        .await
        .unwrap();
    (db.pool().clone(), db)
}

async fn open_db(name: &str) -> PgPool {
    TestDatabase::builder("txinbox_amqp_outbox_t")
        .open(name)
        .await
        .pool()
        .clone()
}

async fn drop_db(pool: PgPool, db: TestDatabase) {
    drop(pool);
    db.drop_database().await;
}

async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Declares durable queues (no arguments) and returns a channel for inspection.
async fn broker(queues: &[&str]) -> (Connection, lapin::Channel) {
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect to AMQP_URL (is RabbitMQ running? scripts/test starts it)");
    let ch = conn.create_channel().await.unwrap();
    for q in queues {
        ch.queue_declare(
            (*q).into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
    (conn, ch)
}

async fn ready(ch: &lapin::Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .expect("queue exists")
    .message_count()
}

async fn delete_queues(ch: &lapin::Channel, base: &[&str]) {
    for b in base {
        for q in [b.to_string(), format!("{b}.retry"), format!("{b}.dlq")] {
            let _ = ch
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
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

fn relay_config(name: &str, batch: usize) -> RelayConfig {
    RelayConfig::default()
        .name(name)
        .batch_size(batch)
        .poll_interval(Duration::from_millis(100))
}

async fn publisher() -> AmqpPublisher {
    AmqpPublisher::connect(amqp_url())
        .await
        .expect("publisher connects")
        .publish_timeout(Duration::from_secs(5))
}

const STEPS: [&str; 2] = ["reserved", "billed"];

#[derive(serde::Deserialize)]
struct Order {
    customer: String,
}

/// Consumer A: records the order and writes one outbox event per step to `events`, keyed by
/// customer; fails the first attempt of every 5th order after writing (the rows roll back);
/// remembers the IDs each attempt derived.
#[derive(Clone)]
struct OrderHandler {
    events: String,
    derived: Arc<Mutex<HashMap<String, Vec<Vec<String>>>>>,
}

#[async_trait]
impl Handler<Postgres> for OrderHandler {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let order: Order = msg.json()?;
        let id = cx.message_id().as_str().to_owned();
        sqlx::query("INSERT INTO a_orders (order_id, customer) VALUES ($1, $2)")
            .bind(&id)
            .bind(&order.customer)
            .execute(cx.db())
            .await?;
        let mut ids = Vec::new();
        for step in STEPS {
            let event_id = cx.derive_id(step);
            let payload = format!(r#"{{"order":"{id}","step":"{step}"}}"#);
            let event = OutboxMessage::new(&event_id, &self.events, payload).with_key(order.customer.clone());
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

/// Consumer B: a non-idempotent effect per event.
struct ApplyHandler;

#[async_trait]
impl Handler<Postgres> for ApplyHandler {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let event: Event = msg.json()?;
        sqlx::query("INSERT INTO b_effects (message_id, customer, event) VALUES ($1, $2, $3)")
            .bind(cx.message_id().as_str())
            .bind(msg.headers().get_str(headers::KEY))
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
    async fn start<H: Handler<Postgres>>(
        pool: &PgPool,
        name: &str,
        config: AmqpConfig,
        handler: H,
    ) -> Running {
        let inbox = txinbox::PostgresInbox::new(pool.clone());
        let source = AmqpSource::connect(config.prefetch(20))
            .await
            .expect("amqp source");
        let consumer = txinbox::Consumer::builder(name)
            .source(source)
            .inbox(inbox)
            .handler(handler)
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

fn by_key(rows: &[(String, String)]) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, id) in rows {
        m.entry(k.clone()).or_default().push(id.clone());
    }
    m
}

/// Run by `pipeline_exactly_once_with_relay_killed_between_publish_and_mark` in a child process
/// with `TXINBOX_CRASH_AT=relay_published:<n>`: relays until the crash point aborts it.
#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process of pipeline_exactly_once_with_relay_killed_between_publish_and_mark"]
async fn relay_child() {
    let Ok(db) = std::env::var("TXOUTBOX_CHILD_DB") else {
        return;
    };
    let pool = open_db(&db).await;
    let relay = Relay::new(pool, publisher().await, relay_config("child", 10)).unwrap();
    relay.run_until(std::future::pending()).await.unwrap();
}

#[cfg(feature = "crash-points")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pipeline_exactly_once_with_relay_killed_between_publish_and_mark() {
    let (pool, db_name) = create_db().await;
    let orders_q = unique("orders");
    let events_q = unique("events");
    let (_conn, ch) = broker(&[&orders_q, &events_q]).await;

    // 40 orders of 4 customers, published with their message_id.
    let orders = 40;
    let feeder = publisher().await;
    for i in 0..orders {
        let payload = format!(r#"{{"customer":"c{}"}}"#, i % 4);
        feeder
            .publish(&OutboxMessage::new(format!("order-{i}"), &orders_q, payload))
            .await
            .expect("publish an order");
    }

    let handler_a = OrderHandler {
        events: events_q.clone(),
        derived: Arc::default(),
    };
    let a = Running::start(
        &pool,
        "service-a",
        AmqpConfig::new(amqp_url(), &orders_q),
        handler_a.clone(),
    )
    .await;
    let expected_rows = (orders * STEPS.len()) as i64;
    let pending = || {
        scalar(
            &pool,
            "SELECT count(*) FROM txinbox.outbox WHERE status = 'pending'",
        )
    };
    wait_until(
        Duration::from_secs(60),
        "consumer A to write every outbox row",
        || async { pending().await == expected_rows },
    )
    .await;

    // Kill the relay between the broker's confirm and the marking, four times: twice on its
    // first batch (the same rows published again), then on its 2nd and 3rd batch.
    let batch = 10;
    let mut queued_before = ready(&ch, &events_q).await as i64;
    assert_eq!(queued_before, 0);
    for nth in [1, 1, 2, 3] {
        let pending_before = pending().await;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "relay_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TXOUTBOX_CHILD_DB", db_name.name())
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
        assert_eq!(
            pending_before - pending().await,
            batch * (nth - 1),
            "only the batches before the crash were marked"
        );
        let queued = ready(&ch, &events_q).await as i64;
        assert_eq!(
            queued - queued_before,
            batch * nth,
            "the crashed batch was confirmed by the broker before the crash"
        );
        queued_before = queued;
    }

    // B starts now and sees every republished copy; a relay that is not killed finishes.
    let b = Running::start(
        &pool,
        "service-b",
        AmqpConfig::new(amqp_url(), &events_q).lane_header(headers::KEY),
        ApplyHandler,
    )
    .await;
    let relay = Relay::new(pool.clone(), publisher().await, relay_config("final", 10)).unwrap();
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay_task = tokio::spawn(relay.run_until(async {
        let _ = relay_stopped.await;
    }));
    wait_until(
        Duration::from_secs(60),
        "the relay to publish every row",
        || async { pending().await == 0 },
    )
    .await;
    wait_until(
        Duration::from_secs(60),
        "consumer B to apply every event",
        || async { scalar(&pool, "SELECT count(DISTINCT message_id) FROM b_effects").await >= expected_rows },
    )
    .await;
    wait_until(Duration::from_secs(30), "B to take every copy", || async {
        ready(&ch, &events_q).await == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop_relay.send(());
    relay_task.await.unwrap().unwrap();
    b.stop().await;
    a.stop().await;

    // IDs: every attempt derived the documented IDs; failed orders ran again.
    let derived = handler_a.derived.lock().unwrap().clone();
    let mut expected_ids = HashSet::new();
    for i in 0..orders {
        let order = format!("order-{i}");
        let want: Vec<String> = STEPS
            .iter()
            .map(|s| outbox::derive_id("service-a", &order, s))
            .collect();
        let attempts = &derived[&order];
        assert!(attempts.iter().all(|ids| *ids == want), "{order}: {attempts:?}");
        // Every order ran; a failed one at least twice. Micro-batching may run a handler
        // again when a neighbour's failure rolls its batch back (the effects roll back too).
        let at_least = if i.is_multiple_of(5) { 2 } else { 1 };
        assert!(attempts.len() >= at_least, "{order}: {} attempts", attempts.len());
        expected_ids.extend(want);
    }
    let in_outbox: HashSet<String> = sqlx::query_scalar("SELECT message_id FROM txinbox.outbox")
        .fetch_all(&pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(
        in_outbox, expected_ids,
        "one row per derived ID, none from rolled-back attempts"
    );

    // B: every event exactly once, by business identity and by ID.
    let per_event: Vec<(String, i64)> =
        sqlx::query_as("SELECT event, count(*) FROM b_effects GROUP BY event")
            .fetch_all(&pool)
            .await
            .unwrap();
    let twice: Vec<_> = per_event.iter().filter(|(_, n)| *n != 1).collect();
    assert!(twice.is_empty(), "events applied more than once: {twice:?}");
    assert_eq!(per_event.len() as i64, expected_rows, "every event applied");
    let applied: HashSet<String> = sqlx::query_scalar("SELECT message_id FROM b_effects")
        .fetch_all(&pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(applied, expected_ids);

    // Per customer, B applied the events in outbox order.
    let outbox_order: Vec<(String, String)> = sqlx::query_as(
        "SELECT convert_from(message_key, 'UTF8'), message_id FROM txinbox.outbox ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let b_order: Vec<(String, String)> =
        sqlx::query_as("SELECT customer, message_id FROM b_effects ORDER BY seq")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        by_key(&b_order),
        by_key(&outbox_order),
        "per-key order at consumer B"
    );

    delete_queues(&ch, &[&orders_q, &events_q]).await;
    drop_db(pool, db_name).await;
}

/// Counts what one relay published, after a random pause (so two relays interleave).
struct Counting(AmqpPublisher, Arc<AtomicUsize>);

#[async_trait]
impl Publisher for Counting {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), outbox::PublishError> {
        tokio::time::sleep(Duration::from_micros(fastrand::u64(0..3000))).await;
        self.0.publish(message).await?;
        self.1.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_on_one_outbox_publish_every_row_in_key_order() {
    let (pool, db_name) = create_db().await;
    let events_q = unique("events");
    let (_conn, ch) = broker(&[&events_q]).await;
    // A few more keys than a round claims (batch 7; 5 on AMQP): both relays find work, and
    // they contend for the same keys.
    let (keys, per_key) = (7, 40);
    let write = |from: usize, to: usize| {
        let pool = pool.clone();
        let q = events_q.clone();
        async move {
            for i in from..to {
                for k in 0..keys {
                    let m =
                        OutboxMessage::new(format!("k{k}-{i}"), &q, format!("{i}")).with_key(format!("k{k}"));
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
            pool.clone(),
            Counting(publisher().await, counts[n].clone()),
            relay_config(name, 5),
        )
        .unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        stops.push(stop);
        tasks.push(tokio::spawn(relay.run_until(async {
            let _ = stopped.await;
        })));
    }
    write(per_key / 2, per_key).await;
    let total = (keys * per_key) as i64;
    wait_until(
        Duration::from_secs(60),
        "both relays to publish every row",
        || async {
            scalar(
                &pool,
                "SELECT count(*) FROM txinbox.outbox WHERE status = 'published'",
            )
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

    let mut next: HashMap<String, usize> = HashMap::new();
    let mut got = 0;
    while let Some(m) = ch
        .basic_get(events_q.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        got += 1;
        let props = &m.delivery.properties;
        let id = props.message_id().as_ref().expect("message_id set").to_string();
        let headers = props.headers().as_ref().expect("headers");
        match headers.inner().get(ID_HEADER) {
            Some(lapin::types::AMQPValue::LongString(s)) => assert_eq!(s.as_bytes(), id.as_bytes()),
            other => panic!("ID header: {other:?}"),
        }
        let key = match headers.inner().get(headers::KEY) {
            Some(lapin::types::AMQPValue::LongString(s)) => {
                String::from_utf8_lossy(s.as_bytes()).into_owned()
            }
            other => panic!("key header: {other:?}"),
        };
        let expected = next.entry(key.clone()).or_default();
        assert_eq!(id, format!("{key}-{expected}"), "key {key} out of order");
        *expected += 1;
    }
    assert_eq!(got, total, "every row on the queue");
    assert!(next.values().all(|n| *n == per_key));

    delete_queues(&ch, &[&events_q]).await;
    drop_db(pool, db_name).await;
}

#[tokio::test]
async fn unroutable_is_a_failure_and_the_publisher_recovers() {
    let q = unique("routable");
    let (_conn, ch) = broker(&[&q]).await;
    let p = publisher().await;
    let err = p
        .publish(&OutboxMessage::new("lost", unique("no-such-queue"), "x"))
        .await
        .expect_err("an unroutable message is not published");
    assert!(err.to_string().contains("unroutable"), "{err}");
    assert!(
        !err.is_permanent(),
        "retried with backoff, dead-lettered after bounded attempts"
    );
    p.publish(&OutboxMessage::new("ok", &q, "x"))
        .await
        .expect("the next publish reconnects and succeeds");
    assert_eq!(ready(&ch, &q).await, 1);

    // Concurrent publishes over the channels, routable and unroutable mixed: each gets its own
    // verdict (a return must never be taken for another message's confirm).
    let p = p.channels(3);
    let nowhere = unique("no-such-queue");
    let results = futures::future::join_all((0..24).map(|i| {
        let m = if i % 2 == 0 {
            OutboxMessage::new(format!("ok-{i}"), &q, "x")
        } else {
            OutboxMessage::new(format!("lost-{i}"), &nowhere, "x")
        };
        let p = &p;
        async move { (i, p.publish(&m).await) }
    }))
    .await;
    for (i, r) in results {
        assert_eq!(r.is_ok(), i % 2 == 0, "message {i}: {r:?}");
    }
    assert_eq!(ready(&ch, &q).await, 1 + 12);
    delete_queues(&ch, &[&q]).await;

    let err = AmqpPublisher::connect("amqp://guest:wrong@127.0.0.1:5672/%2f")
        .await
        .expect_err("bad credentials fail at connect");
    assert!(
        !err.to_string().contains("wrong"),
        "the password is not shown: {err}"
    );
}

/// Consumer B of [`a_consumer_with_default_settings_takes_the_outbox_messages_once`]: one
/// effect per message, with the CloudEvents type and source it arrived with.
struct RecordHandler;

#[async_trait]
impl Handler<Postgres> for RecordHandler {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let h = msg.headers();
        assert_eq!(h.get_str("cloudEvents:id"), Some(cx.message_id().as_str()));
        assert_eq!(h.get_str("cloudEvents:specversion"), Some("1.0"));
        sqlx::query("INSERT INTO b_effects (message_id, customer, event) VALUES ($1, $2, $3)")
            .bind(cx.message_id().as_str())
            .bind(h.get_str("cloudEvents:type"))
            .bind(h.get_str("cloudEvents:source").unwrap_or("-"))
            .execute(cx.db())
            .await?;
        Ok(())
    }
}

/// What one service's outbox publishes, another service's consumer takes with its **default**
/// settings (an `AmqpSource` reads the `message_id` property): every row applied once, none
/// dead-lettered. The messages carry the CloudEvents attributes of the AMQP binding too, the
/// row's own `type` and `source` where it set them, and never an ID other than the row's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_with_default_settings_takes_the_outbox_messages_once() {
    use txinbox::message::Headers;
    let q = unique("default");
    let (_conn, ch) = broker(&[&q]).await;
    let (pool, db) = create_db().await;
    const ROWS: usize = 24;
    for i in 0..ROWS {
        let mut h = Headers::new();
        if i.is_multiple_of(4) {
            h.insert("ce_type", "bank.deposit");
            h.insert("cloudEvents:source", "/bank");
        }
        if i.is_multiple_of(3) {
            h.insert("cloudEvents:id", "the-incoming-event");
            h.insert("ce_id", "the-incoming-event");
        }
        let m = OutboxMessage::new(format!("evt-{i}"), &q, format!("{i}"))
            .with_key(format!("k{}", i % 3))
            .with_headers(h);
        outbox::write(&pool, &m).await.unwrap();
    }
    let relay = Relay::new(pool.clone(), publisher().await, relay_config("default", 10)).unwrap();
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(relay.run_until(async {
        let _ = relay_stopped.await;
    }));
    let b = Running::start(&pool, "service-b", AmqpConfig::new(amqp_url(), &q), RecordHandler).await;
    let started = Instant::now();
    loop {
        let applied = scalar(&pool, "SELECT count(DISTINCT message_id) FROM b_effects").await;
        if applied == ROWS as i64 {
            break;
        }
        let dead: Vec<(String, String)> =
            sqlx::query_as("SELECT coalesce(message_id, '-'), reason FROM txinbox.dead_letters LIMIT 3")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{applied} of {ROWS} outbox messages applied after 30 s; dead letters: {dead:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    b.stop().await;
    let _ = stop_relay.send(());
    relay.await.unwrap().unwrap();

    let rows: Vec<(String, Option<String>, String)> =
        sqlx::query_as("SELECT message_id, customer, event FROM b_effects ORDER BY seq")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), ROWS, "each applied once: {rows:?}");
    let ids: HashSet<String> = rows.iter().map(|r| r.0.clone()).collect();
    let expected: HashSet<String> = (0..ROWS).map(|i| format!("evt-{i}")).collect();
    assert_eq!(ids, expected, "under the rows' own IDs");
    for (id, kind, source) in &rows {
        let i: usize = id.trim_start_matches("evt-").parse().unwrap();
        let (want_kind, want_source) = if i.is_multiple_of(4) {
            ("bank.deposit", "/bank")
        } else {
            (q.as_str(), outbox::DEFAULT_SOURCE)
        };
        assert_eq!(
            (kind.as_deref(), source.as_str()),
            (Some(want_kind), want_source),
            "{id}"
        );
    }
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM txinbox.dead_letters").await,
        0
    );
    delete_queues(&ch, &[&q]).await;
    drop_db(pool, db).await;
}

/// A row whose headers do not fit in one content-header frame of the connection's `frame_max`
/// would make the broker close the connection (FRAME_ERROR) on every attempt: the publisher
/// refuses it as permanent before sending (the relay dead-letters it at once), and the next
/// row goes through on the same connection.
#[tokio::test]
async fn a_row_whose_headers_exceed_a_frame_is_a_permanent_failure() {
    use txinbox::message::Headers;
    let q = unique("frame");
    let (_conn, ch) = broker(&[&q]).await;
    let p = publisher().await.channels(1);
    let big = Headers::new().with("x-big", "x".repeat(140_000));
    let err = p
        .publish(&OutboxMessage::new("too-big", &q, "x").with_headers(big))
        .await
        .expect_err("a row over frame_max is not published");
    assert!(err.is_permanent(), "no retry can send it: {err}");
    assert!(err.to_string().contains("frame_max"), "{err}");
    p.publish(&OutboxMessage::new("ok", &q, "x"))
        .await
        .expect("the next row goes through");
    assert_eq!(ready(&ch, &q).await, 1);
    delete_queues(&ch, &[&q]).await;
}
