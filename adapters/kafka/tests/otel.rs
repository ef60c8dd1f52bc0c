//! Trace context across Kafka hops (txinbox feature `otel`, librdkafka's mock cluster and a
//! real PostgreSQL): a producer's `traceparent` record header makes the consumer's
//! `txinbox.process` span its child, and the record the relay publishes for the handler's
//! outbox row carries the consumer span's context on. Spans are read back from an in-memory
//! OpenTelemetry exporter behind the `tracing_opentelemetry` layer. Needs `DATABASE_URL`.

#[path = "common/mod.rs"]
mod common;

use std::sync::mpsc as std_mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{header, read_all, TestDb};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sqlx::Postgres;
use tracing_subscriber::layer::SubscriberExt;
use txinbox::outbox::{OutboxMessage, Relay, RelayConfig};
use txinbox::{async_trait, sqlx, Context, Handler, HandlerError, IdStrategy, Message};
use txinbox_kafka::{KafkaConfig, KafkaPublisher, KafkaSource};

const PRODUCER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PRODUCER_SPAN: &str = "00f067aa0ba902b7";

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
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("txinbox-kafka-test"));
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

/// librdkafka's mock cluster on its own thread (it is `!Send`), with `topics` created; it
/// lives until the returned sender is dropped.
fn mock_cluster(topics: &[&str]) -> (String, std_mpsc::Sender<()>) {
    let topics: Vec<String> = topics.iter().map(|t| t.to_string()).collect();
    let (ready, bootstrap) = std_mpsc::channel();
    let (keep, until) = std_mpsc::channel::<()>();
    std::thread::spawn(move || {
        let cluster = MockCluster::new(1).expect("mock cluster");
        for topic in &topics {
            cluster.create_topic(topic, 1, 1).unwrap();
        }
        ready.send(cluster.bootstrap_servers()).unwrap();
        let _ = until.recv();
    });
    (bootstrap.recv().unwrap(), keep)
}

/// Writes one outbox event to `events` per order.
#[derive(Clone)]
struct Forward;

#[async_trait]
impl Handler<Postgres> for Forward {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let event = OutboxMessage::new(cx.derive_id("forwarded"), "events", msg.payload().clone());
        cx.outbox(&event).await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_trace_runs_through_the_consumer_and_the_relayed_record() {
    exporter();
    let (brokers, _cluster) = mock_cluster(&["orders", "events"]);
    let db = TestDb::new().await;

    // A producer outside txinbox, with its span's context in the record headers.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    let traceparent = format!("00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01");
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "ce_id",
            value: Some("order-1"),
        })
        .insert(Header {
            key: "traceparent",
            value: Some(&traceparent),
        });
    producer
        .send(
            FutureRecord::to("orders")
                .key("k")
                .payload("order one")
                .headers(headers),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produce");

    let config = KafkaConfig::new(&brokers, "g-otel")
        .topic("orders")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500");
    let source = KafkaSource::new(config).expect("kafka source");
    let consumer = txinbox::Consumer::builder("otel")
        .source(source)
        .inbox(db.inbox())
        .handler(Forward)
        .id_strategy(IdStrategy::CloudEvents)
        .build()
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    let started = Instant::now();
    while db.scalar("SELECT count(*) FROM txinbox.outbox").await < 1 {
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

    let publisher = KafkaPublisher::builder(&brokers)
        .delivery_timeout(Duration::from_secs(10))
        .build()
        .expect("publisher");
    let relay = Relay::new(db.pool.clone(), publisher, RelayConfig::default()).unwrap();
    assert_eq!(relay.relay_once().await.unwrap().published, 1);

    let records =
        tokio::task::spawn_blocking(move || read_all(&brokers, "events", 1, 1, Duration::from_secs(30)))
            .await
            .unwrap();
    assert_eq!(records.len(), 1, "the relayed record");
    let relayed = header(&records[0], "traceparent").expect("the relayed record has a traceparent");
    assert_eq!(
        relayed,
        format!("00-{PRODUCER_TRACE}-{}-01", spans[0].span_context.span_id()),
        "the relayed record's parent is the consumer's span, in the producer's trace"
    );
}
