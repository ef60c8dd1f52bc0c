//! End to end: HTTP → outbox → Kafka → txinbox consumer → one effect downstream.
//!
//! Clients retry `POST /pay` (sequentially and concurrently, and once after a 5xx whose outbox
//! row rolled back); each payment writes one outbox row in the request's transaction; the relay
//! publishes to Kafka (librdkafka's mock cluster: no broker needed), and is then made to publish
//! every row a second time (as after a relay crash between the broker's confirmation and the
//! marking); a downstream txinbox consumer deduplicating on the outbox ID header applies each
//! payment exactly once. Needs PostgreSQL at `DATABASE_URL`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::post;
use axum::{Extension, Router};
use http::{HeaderMap, Request, StatusCode};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::mocking::MockCluster;
use rdkafka::ClientConfig;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Executor, PgPool, Postgres};
use tower::ServiceExt;
use txinbox::outbox::{OutboxMessage, Relay, RelayConfig, ID_HEADER};
use txinbox::{async_trait, Context, Handler, HandlerError, IdStrategy, Message};
use txinbox_http::{IdempotencyContext, IdempotencyLayer, IdempotentTx};
use txinbox_kafka::{KafkaConfig, KafkaPublisher, KafkaSource};

const TOPIC: &str = "payments";

/// librdkafka's mock cluster on its own thread (it is `!Send`); lives until the sender drops.
fn mock_cluster() -> (String, std_mpsc::Sender<()>) {
    let (ready, bootstrap) = std_mpsc::channel();
    let (stop, stopped) = std_mpsc::channel::<()>();
    std::thread::spawn(move || {
        let cluster = MockCluster::new(1).expect("mock cluster");
        cluster.create_topic(TOPIC, 3, 1).unwrap();
        cluster.create_topic(&format!("{TOPIC}.dlq"), 1, 1).unwrap();
        ready.send(cluster.bootstrap_servers()).unwrap();
        let _ = stopped.recv();
    });
    (bootstrap.recv().unwrap(), stop)
}

async fn db() -> PgPool {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "txinbox_http_e2e_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    );
    let admin: PgConnectOptions = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
        .parse()
        .unwrap();
    let mut c = admin.connect().await.expect("PostgreSQL at DATABASE_URL");
    c.execute(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .await
    .unwrap();
    c.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(12)
        .connect_with(txinbox::PostgresInbox::connect_options(admin.database(&name)))
        .await
        .unwrap();
    txinbox::postgres::migrate(&pool).await.unwrap();
    pool.execute(
        "CREATE TABLE payments (payment_id text PRIMARY KEY, amount bigint NOT NULL);
         CREATE TABLE downstream (seq bigserial PRIMARY KEY, message_id text NOT NULL, payload text NOT NULL);",
    )
    .await
    .unwrap();
    pool
}

/// Upstream: the payment and its outbox event, on the request's transaction.
async fn pay(
    mut tx: IdempotentTx,
    Extension(cx): Extension<IdempotencyContext>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> StatusCode {
    let amount: i64 = std::str::from_utf8(&body).unwrap().parse().unwrap();
    let payment_id = cx.derive_id("payment").unwrap();
    sqlx::query("INSERT INTO payments (payment_id, amount) VALUES ($1, $2)")
        .bind(&payment_id)
        .bind(amount)
        .execute(&mut *tx)
        .await
        .unwrap();
    let event = OutboxMessage::new(
        cx.derive_id("payment-created").unwrap(),
        TOPIC,
        format!("{payment_id}:{amount}"),
    )
    .with_key(payment_id.clone());
    txinbox::outbox::write(&mut *tx, &event).await.unwrap();
    if headers.contains_key("x-fail") {
        return StatusCode::BAD_GATEWAY; // rolled back, outbox row included
    }
    StatusCode::CREATED
}

/// Downstream: a non-idempotent effect per event.
struct Apply;

#[async_trait]
impl Handler<Postgres> for Apply {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO downstream (message_id, payload) VALUES ($1, $2)")
            .bind(cx.message_id().as_str())
            .bind(String::from_utf8_lossy(msg.payload()).into_owned())
            .execute(cx.db())
            .await?;
        Ok(())
    }
}

async fn scalar(pool: &PgPool, q: &'static str) -> i64 {
    sqlx::query_scalar(q).fetch_one(pool).await.unwrap()
}

async fn wait_until(pool: &PgPool, q: &'static str, want: i64, what: &str) {
    let started = Instant::now();
    loop {
        let got = scalar(pool, q).await;
        if got == want {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}: {got} ≠ {want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn records_in_topic(brokers: &str) -> i64 {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    (0..3)
        .map(|p| {
            let (lo, hi) = c.fetch_watermarks(TOPIC, p, Duration::from_secs(10)).unwrap();
            hi - lo
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_to_outbox_to_kafka_to_consumer_is_one_effect_per_key() {
    let (brokers, _cluster) = mock_cluster();
    let pool = db().await;
    let layer = IdempotencyLayer::new(pool.clone()).principal(|_| Some("tenant".into()));
    let app = Router::new().route("/pay", post(pay).layer(layer));
    let send = |key: String, amount: i64, fail: bool| {
        let app = app.clone();
        async move {
            let mut r = Request::post("/pay").header("idempotency-key", key);
            if fail {
                r = r.header("x-fail", "1");
            }
            app.oneshot(r.body(Body::from(amount.to_string())).unwrap())
                .await
                .unwrap()
                .status()
        }
    };

    // 20 payments; each key sent 3 times, 2 of them concurrently; key 0 first fails with a 502.
    assert_eq!(send("k0".into(), 100, true).await, StatusCode::BAD_GATEWAY);
    for i in 0..20 {
        let key = format!("k{i}");
        assert_eq!(send(key.clone(), 100 + i, false).await, StatusCode::CREATED);
        let (a, b) = tokio::join!(send(key.clone(), 100 + i, false), send(key, 100 + i, false));
        assert_eq!((a, b), (StatusCode::CREATED, StatusCode::CREATED));
    }
    assert_eq!(scalar(&pool, "SELECT count(*) FROM payments").await, 20);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM txinbox.outbox").await,
        20,
        "one outbox row per key"
    );

    // Relay, then publish everything a second time (as after a crash before marking).
    let publisher = KafkaPublisher::builder(&brokers)
        .delivery_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let relay = Relay::new(
        pool.clone(),
        publisher,
        RelayConfig::default()
            .name("http-e2e")
            .poll_interval(Duration::from_millis(100)),
    )
    .unwrap();
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay = tokio::spawn(relay.run_until(async {
        let _ = relay_stopped.await;
    }));
    const PENDING: &str = "SELECT count(*) FROM txinbox.outbox WHERE status = 'pending'";
    wait_until(&pool, PENDING, 0, "the relay to publish every row").await;
    pool.execute("UPDATE txinbox.outbox SET status = 'pending', published_at = NULL")
        .await
        .unwrap();
    wait_until(&pool, PENDING, 0, "the relay to publish every row again").await;
    assert_eq!(records_in_topic(&brokers), 40, "every event is in Kafka twice");

    // Downstream consumer.
    let inbox = txinbox::PostgresInbox::new(pool.clone());
    let config = KafkaConfig::new(&brokers, "g-downstream", "downstream")
        .topic(TOPIC)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500");
    let source = KafkaSource::new(config, inbox.clone()).unwrap();
    let consumer = txinbox::Consumer::builder("downstream")
        .source(source)
        .inbox(inbox)
        .handler(Apply)
        .id_strategy(IdStrategy::Header(ID_HEADER.into()))
        .build()
        .unwrap();
    let (stop_consumer, consumer_stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = tokio::spawn(consumer.run_until(async {
        let _ = consumer_stopped.await;
    }));
    wait_until(
        &pool,
        "SELECT count(*) FROM txinbox.inbox WHERE consumer = 'downstream' AND duplicates > 0",
        20,
        "the consumer to see every event twice",
    )
    .await;
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM downstream").await,
        20,
        "one effect per key"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(DISTINCT payload) FROM downstream").await,
        20
    );
    let _ = stop_consumer.send(());
    let _ = stop_relay.send(());
    tokio::time::timeout(Duration::from_secs(30), consumer)
        .await
        .expect("consumer stops")
        .unwrap()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), relay)
        .await
        .expect("relay stops")
        .unwrap()
        .unwrap();
}
