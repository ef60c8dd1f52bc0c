//! Feature `otel`: a trace put in by a producer runs through the consumer's `txinbox.process`
//! span, the outbox row its handler writes, and the message the relay publishes. Spans are read
//! back from an in-memory OpenTelemetry exporter behind the `tracing_opentelemetry` layer, set
//! up the way an application sets it up. Needs `DATABASE_URL`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use opentelemetry::trace::{SpanId, TraceContextExt as _, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sqlx::postgres::PgPool;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;
use txinbox::memory::MemoryBroker;
use txinbox::outbox::{OutboxMessage, PublishError, Publisher, Relay, RelayConfig};
use txinbox::{
    async_trait, handler::BatchContext, handler::BatchHandler, handler::BatchMessage, message::Headers,
    Consumer, Context, Handler, HandlerError, Message,
};
use txinbox_testing::database::TestDatabase;

/// The exporter behind the global subscriber: W3C propagator, SDK tracer provider, the
/// `tracing_opentelemetry` layer (what an application installs; the library installs nothing).
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
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("txinbox-test"));
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
            .expect("the only global subscriber in this test binary");
        exporter
    })
}

fn spans_in(trace: TraceId, name: &str) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace && s.name == name)
        .collect()
}

async fn test_db() -> PgPool {
    TestDatabase::builder("txinbox_otel_t")
        .max_connections(12)
        .create()
        .await
        .pool()
        .clone()
}

/// Writes one outbox message per delivery, to `events`; a payload `keep:<traceparent>` makes
/// the message carry that `traceparent` itself.
#[derive(Clone)]
struct Forward;

#[async_trait]
impl Handler<sqlx::Postgres> for Forward {
    async fn handle(&self, cx: &mut Context<'_, sqlx::Postgres>, msg: &Message) -> Result<(), HandlerError> {
        let payload = String::from_utf8_lossy(msg.payload()).into_owned();
        let mut event = OutboxMessage::new(cx.derive_id("forward"), "events", payload.clone());
        if let Some(own) = payload.strip_prefix("keep:") {
            event = event.with_headers(Headers::new().with("traceparent", own.to_owned()));
        }
        cx.outbox(&event).await?;
        Ok(())
    }
}

/// The bulk form of [`Forward`]: one call for a batch, each outbox write in its message's span.
/// Remembers the largest batch it was given.
#[derive(Clone, Default)]
struct BulkForward(Arc<AtomicUsize>);

#[async_trait]
impl Handler<sqlx::Postgres> for BulkForward {
    async fn handle(&self, cx: &mut Context<'_, sqlx::Postgres>, msg: &Message) -> Result<(), HandlerError> {
        Forward.handle(cx, msg).await
    }

    fn batch(&self) -> Option<&dyn BatchHandler<sqlx::Postgres>> {
        Some(self)
    }
}

#[async_trait]
impl BatchHandler<sqlx::Postgres> for BulkForward {
    async fn handle_batch(
        &self,
        cx: &mut BatchContext<'_, sqlx::Postgres>,
        batch: &[BatchMessage<'_>],
    ) -> Result<(), HandlerError> {
        self.0.fetch_max(batch.len(), Ordering::SeqCst);
        for m in batch {
            let payload = m.message().payload().clone();
            let event = OutboxMessage::new(format!("fwd-{}", m.id()), "events", payload);
            cx.outbox(&event).instrument(m.span().clone()).await?;
        }
        Ok(())
    }
}

/// Stands in for the broker: keeps what the relay published.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<OutboxMessage>>>);

#[async_trait]
impl Publisher for Recorder {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        self.0.lock().unwrap().push(message.clone());
        Ok(())
    }
}

fn traceparent(trace: TraceId, span: SpanId) -> String {
    format!("00-{trace}-{span}-01")
}

/// `(trace ID, parent span ID)` of a published message's `traceparent` header.
fn published_context(message: &OutboxMessage) -> (TraceId, SpanId) {
    let value = message.headers().get_str("traceparent").unwrap_or_else(|| {
        panic!(
            "{} has no traceparent: {:?}",
            message.message_id(),
            message.headers()
        )
    });
    let parts: Vec<&str> = value.split('-').collect();
    (
        TraceId::from_hex(parts[1]).unwrap(),
        SpanId::from_hex(parts[2]).unwrap(),
    )
}

/// Runs consumer `name` over the deliveries, then one relay round; returns what was published,
/// by payload.
async fn consume_and_relay(
    name: &str,
    handler: impl Handler<sqlx::Postgres>,
    deliveries: Vec<(&str, Headers)>,
) -> Vec<(String, OutboxMessage)> {
    exporter();
    let pool = test_db().await;
    let broker = MemoryBroker::new("orders");
    for (i, (payload, headers)) in deliveries.into_iter().enumerate() {
        broker.publish_with(
            None,
            Some(format!("m-{i}")),
            headers,
            Bytes::from(payload.to_owned()),
        );
    }
    broker.close();
    Consumer::builder(name)
        .source(broker.source())
        .inbox(txinbox::PostgresInbox::new(pool.clone()))
        .handler(handler)
        // Lets the deliveries of the lane gather into one batch (a batch handler gets them at once).
        .batch_linger(Duration::from_millis(200))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let recorder = Recorder::default();
    let relay = Relay::new(pool, recorder.clone(), RelayConfig::default()).unwrap();
    relay.relay_once().await.unwrap();
    let published = recorder.0.lock().unwrap().clone();
    published
        .into_iter()
        .map(|m| (String::from_utf8_lossy(m.payload()).into_owned(), m))
        .collect()
}

#[tokio::test]
async fn a_producer_trace_runs_through_the_consumer_span_and_the_relayed_message() {
    let w3c = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    let w3c_parent = SpanId::from_hex("00f067aa0ba902b7").unwrap();
    let cloudevents = TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap();
    let cloudevents_parent = SpanId::from_hex("b7ad6b7169203331").unwrap();
    let amqp_cloudevents = TraceId::from_hex("11112222333344445555666677778888").unwrap();
    let amqp_parent = SpanId::from_hex("aaaabbbbccccdddd").unwrap();
    let published = consume_and_relay(
        "otel-hops",
        Forward,
        vec![
            (
                "w3c",
                Headers::new()
                    .with("traceparent", traceparent(w3c, w3c_parent))
                    .with("tracestate", "vendor=abc"),
            ),
            (
                "kafka-cloudevents",
                Headers::new().with("ce_traceparent", traceparent(cloudevents, cloudevents_parent)),
            ),
            (
                "amqp-cloudevents",
                Headers::new().with(
                    "cloudEvents:traceparent",
                    traceparent(amqp_cloudevents, amqp_parent),
                ),
            ),
        ],
    )
    .await;
    assert_eq!(published.len(), 3, "{published:?}");

    for (payload, trace, parent) in [
        ("w3c", w3c, w3c_parent),
        ("kafka-cloudevents", cloudevents, cloudevents_parent),
        ("amqp-cloudevents", amqp_cloudevents, amqp_parent),
    ] {
        // The consumer's span is a child of the producer's span, in the producer's trace.
        let process = spans_in(trace, "txinbox.process");
        assert_eq!(
            process.len(),
            1,
            "{payload}: one txinbox.process span in the producer's trace"
        );
        let process = &process[0];
        assert_eq!(
            process.parent_span_id, parent,
            "{payload}: parent is the producer's span"
        );
        assert!(process.parent_span_is_remote, "{payload}");

        // The relayed message continues the trace from the handler's span.
        let (_, message) = published.iter().find(|(p, _)| p == payload).unwrap();
        assert_eq!(
            published_context(message),
            (trace, process.span_context.span_id()),
            "{payload}: the relayed message's parent is the consumer's span"
        );
    }
    // The producer's trace state travels with its context.
    let (_, w3c_message) = published.iter().find(|(p, _)| p == "w3c").unwrap();
    assert_eq!(w3c_message.headers().get_str("tracestate"), Some("vendor=abc"));
}

#[tokio::test]
async fn a_message_without_trace_context_starts_a_trace_and_an_explicit_traceparent_is_kept() {
    let own = "00-99999999999999999999999999999999-1234567812345678-01";
    let keep = format!("keep:{own}");
    let published = consume_and_relay(
        "otel-fresh",
        Forward,
        vec![
            ("untraced", Headers::new()),
            (&keep, Headers::new()),
            (
                "garbage",
                Headers::new().with("traceparent", "not-a-trace-context"),
            ),
        ],
    )
    .await;
    assert_eq!(published.len(), 3, "{published:?}");
    for payload in ["untraced", "garbage"] {
        let (_, message) = published.iter().find(|(p, _)| p == payload).unwrap();
        let (trace, parent) = published_context(message);
        let process = spans_in(trace, "txinbox.process");
        assert_eq!(
            process.len(),
            1,
            "{payload}: the consumer's span starts the trace"
        );
        assert_eq!(
            process[0].parent_span_id,
            SpanId::INVALID,
            "{payload}: a root span"
        );
        assert_eq!(process[0].span_context.span_id(), parent, "{payload}");
    }
    let (_, kept) = published.iter().find(|(p, _)| p.starts_with("keep:")).unwrap();
    assert_eq!(kept.headers().get_str("traceparent"), Some(own));
    assert_eq!(
        kept.headers().iter().filter(|(n, _)| *n == "traceparent").count(),
        1,
        "not doubled"
    );
}

#[tokio::test]
async fn a_batch_handler_writing_in_each_message_span_gives_each_row_its_producer_trace() {
    let traces: Vec<TraceId> = (1..=4u128).map(|i| TraceId::from(0xabc0_0000 + i)).collect();
    let parent = SpanId::from_hex("00f067aa0ba902b7").unwrap();
    let payloads: Vec<String> = (0..traces.len()).map(|i| format!("bulk-{i}")).collect();
    let handler = BulkForward::default();
    let published = consume_and_relay(
        "otel-batch",
        handler.clone(),
        traces
            .iter()
            .zip(&payloads)
            .map(|(trace, payload)| {
                (
                    payload.as_str(),
                    Headers::new().with("traceparent", traceparent(*trace, parent)),
                )
            })
            .collect(),
    )
    .await;
    assert!(
        handler.0.load(Ordering::SeqCst) > 1,
        "the messages went through the batch handler"
    );
    for (trace, payload) in traces.iter().zip(&payloads) {
        let process = spans_in(*trace, "txinbox.process");
        assert_eq!(process.len(), 1, "{payload}");
        let (_, message) = published.iter().find(|(p, _)| p == payload).unwrap();
        assert_eq!(
            published_context(message),
            (*trace, process[0].span_context.span_id()),
            "{payload}: its own trace, not a neighbour's"
        );
    }
}

/// The HTTP hop: an outbox row written in an application's span (an HTTP handler's, continuing
/// the caller's `traceparent` the way the application's HTTP tracing does) is published in
/// that trace, with that span as parent.
#[tokio::test]
async fn an_outbox_write_in_an_application_span_is_published_in_its_trace() {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    exporter();
    let pool = test_db().await;
    let caller = TraceId::from_hex("5b8aa5a2d2c872e8321cf37308d69df2").unwrap();
    let request_headers = Headers::new().with(
        "traceparent",
        traceparent(caller, SpanId::from_hex("051581bf3cb55c13").unwrap()),
    );
    let span = tracing::info_span!("POST /orders");
    span.set_parent(txinbox::otel::extract(&request_headers)).unwrap();
    let request_span = span.context().span().span_context().span_id();
    async {
        let mut tx = pool.begin().await.unwrap();
        txinbox::outbox::write(&mut *tx, &OutboxMessage::new("order-9", "orders", "placed"))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    .instrument(span)
    .await;
    let recorder = Recorder::default();
    let relay = Relay::new(pool, recorder.clone(), RelayConfig::default()).unwrap();
    relay.relay_once().await.unwrap();
    let published = recorder.0.lock().unwrap().clone();
    assert_eq!(published_context(&published[0]), (caller, request_span));
}
