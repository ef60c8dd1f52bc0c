//! Trace context across RabbitMQ hops (txinbox feature `otel`, a real RabbitMQ and
//! PostgreSQL): a producer's CloudEvents `cloudEvents:traceparent` header (AMQP binary mode)
//! makes the consumer's `txinbox.process` span its child, and the message the relay publishes
//! for the handler's outbox row carries the consumer span's context in `traceparent`. Spans are
//! read back from an in-memory OpenTelemetry exporter behind the `tracing_opentelemetry` layer.
//! Needs `DATABASE_URL` and `AMQP_URL` (defaults: local PostgreSQL, `guest` on 127.0.0.1).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Executor, Postgres};
use tracing_subscriber::layer::SubscriberExt;
use txinbox::outbox::{OutboxMessage, Relay, RelayConfig};
use txinbox::{async_trait, Context, Handler, HandlerError, Message};
use txinbox_amqp::{AmqpConfig, AmqpPublisher, AmqpSource};

const PRODUCER_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const PRODUCER_SPAN: &str = "b7ad6b7169203331";

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// W3C propagator, SDK tracer provider with an in-memory exporter, `tracing_opentelemetry`
/// layer: what an application installs (the library installs nothing).
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("txinbox-amqp-test"));
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
            .expect("the only global subscriber in this test binary");
        exporter
    })
}

fn process_spans(trace: TraceId) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace && s.name == "txinbox.process")
        .collect()
}

/// Writes one outbox event to `self.0` per order.
#[derive(Clone)]
struct Forward(String);

#[async_trait]
impl Handler<Postgres> for Forward {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let event = OutboxMessage::new(cx.derive_id("forwarded"), &self.0, msg.payload().clone());
        cx.outbox(&event).await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_trace_runs_through_the_consumer_and_the_relayed_message() {
    exporter();
    let tag = std::process::id();
    let (orders, events) = (
        format!("txinbox-otel-t-{tag}-orders"),
        format!("txinbox-otel-t-{tag}-events"),
    );
    let admin: PgConnectOptions = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
        .parse()
        .expect("DATABASE_URL parses");
    let db = format!("txinbox_amqp_otel_t_{tag}");
    let mut c = admin.connect().await.expect("connect to DATABASE_URL");
    c.execute(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .await
    .unwrap();
    c.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect_with(txinbox::PostgresInbox::connect_options(admin.database(&db)))
        .await
        .unwrap();
    txinbox::postgres::migrate(&pool).await.unwrap();

    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect to AMQP_URL (is RabbitMQ running? scripts/test starts it)");
    let ch = conn.create_channel().await.unwrap();
    for q in [&orders, &events] {
        let options = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.queue_declare(q.as_str().into(), options, FieldTable::default())
            .await
            .unwrap();
    }
    // A producer outside txinbox, its span's context in the CloudEvents AMQP binary form.
    let mut headers = FieldTable::default();
    headers.insert(
        ShortString::from("cloudEvents:traceparent"),
        AMQPValue::LongString(format!("00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01").into()),
    );
    let props = BasicProperties::default()
        .with_message_id("order-1".into())
        .with_headers(headers);
    ch.basic_publish(
        ShortString::default(),
        orders.as_str().into(),
        BasicPublishOptions::default(),
        b"order one",
        props,
    )
    .await
    .unwrap();

    let source = AmqpSource::connect(AmqpConfig::new(amqp_url(), &orders))
        .await
        .expect("amqp source");
    let consumer = txinbox::Consumer::builder("otel")
        .source(source)
        .inbox(txinbox::PostgresInbox::new(pool.clone()))
        .handler(Forward(events.clone()))
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    let started = Instant::now();
    loop {
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM txinbox.outbox")
            .fetch_one(&pool)
            .await
            .unwrap();
        if rows > 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the order was not processed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    run.await.unwrap().unwrap();

    let trace = TraceId::from_hex(PRODUCER_TRACE).unwrap();
    let spans = process_spans(trace);
    assert_eq!(spans.len(), 1, "one txinbox.process span in the producer's trace");
    assert_eq!(spans[0].parent_span_id, SpanId::from_hex(PRODUCER_SPAN).unwrap());

    let publisher = AmqpPublisher::connect(amqp_url())
        .await
        .expect("publisher connects")
        .publish_timeout(Duration::from_secs(5));
    let relay = Relay::new(pool.clone(), publisher, RelayConfig::default()).unwrap();
    assert_eq!(relay.relay_once().await.unwrap().published, 1);

    let got = ch
        .basic_get(events.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the relayed message");
    let headers = got.delivery.properties.headers().as_ref().expect("headers");
    let relayed = match headers.inner().get("traceparent") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        other => panic!("traceparent header: {other:?}"),
    };
    assert_eq!(
        relayed,
        format!("00-{PRODUCER_TRACE}-{}-01", spans[0].span_context.span_id()),
        "the relayed message's parent is the consumer's span, in the producer's trace"
    );

    for q in [
        orders.clone(),
        format!("{orders}.retry"),
        format!("{orders}.dlq"),
        events,
    ] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    pool.close().await;
    let _ = c
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
        )))
        .await;
}
