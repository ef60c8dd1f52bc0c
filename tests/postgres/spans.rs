//! One `txinbox.process` span per delivery, with OpenTelemetry messaging attributes and an
//! outcome, whatever path the delivery took.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context as LayerContext, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;
use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, HandlerError};

use super::support::{deposit_in_lane, drain, fast_retries, DepositHandler, TestDb};

type Fields = HashMap<String, String>;

/// Collects the fields of every closed `txinbox.process` span, and of every WARN or ERROR
/// event (its text under `message`).
#[derive(Clone, Default)]
pub(crate) struct Capture {
    spans: Arc<Mutex<Vec<Fields>>>,
    events: Arc<Mutex<Vec<Fields>>>,
}

struct Visitor<'a>(&'a mut Fields);
impl Visit for Visitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").trim_matches('"').to_owned(),
        );
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, cx: LayerContext<'_, S>) {
        let mut fields = Fields::new();
        attrs.record(&mut Visitor(&mut fields));
        cx.span(id).unwrap().extensions_mut().insert(fields);
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, cx: LayerContext<'_, S>) {
        let span = cx.span(id).unwrap();
        let mut ext = span.extensions_mut();
        let fields = ext.get_mut::<Fields>().unwrap();
        values.record(&mut Visitor(fields));
        // How often each field was recorded: a formatting subscriber prints every record, so
        // a field recorded three times shows three times on the span's line.
        let mut recorded = Fields::new();
        values.record(&mut Visitor(&mut recorded));
        for name in recorded.keys() {
            let count = fields.entry(format!("#{name}")).or_insert_with(|| "0".into());
            *count = (count.parse::<u32>().unwrap() + 1).to_string();
        }
    }
    fn on_close(&self, id: Id, cx: LayerContext<'_, S>) {
        let span = cx.span(&id).unwrap();
        if span.name() == "txinbox.process" {
            let fields = span.extensions_mut().remove::<Fields>().unwrap();
            self.spans.lock().unwrap().push(fields);
        }
    }
    fn on_event(&self, event: &tracing::Event<'_>, _: LayerContext<'_, S>) {
        if *event.metadata().level() <= tracing::Level::WARN {
            let mut fields = Fields::new();
            event.record(&mut Visitor(&mut fields));
            self.events.lock().unwrap().push(fields);
        }
    }
}

/// A global subscriber: a thread-local default races with other tests over tracing's
/// global callsite-interest cache. Spans of other tests are filtered out by consumer name.
pub(crate) fn capture() -> &'static Capture {
    static CAPTURE: std::sync::OnceLock<Capture> = std::sync::OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture = Capture::default();
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
            .expect("the only global subscriber in this test binary");
        capture
    })
}

/// WARN and ERROR events logged with `consumer = <consumer>`.
pub(crate) fn warnings_of(consumer: &str) -> Vec<Fields> {
    capture()
        .events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.get("consumer").map(String::as_str) == Some(consumer))
        .cloned()
        .collect()
}

fn spans_of(consumer: &str) -> Vec<Fields> {
    capture()
        .spans
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.get("messaging.consumer.group.name").map(String::as_str) == Some(consumer))
        .cloned()
        .collect()
}

#[tokio::test]
async fn a_batch_stopped_at_shutdown_marks_every_delivery_it_held_abandoned() {
    capture();
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.set_retry_mode(txinbox::source::RetryMode::InPlace);
    for i in 0..4 {
        broker.publish_in_lane("p0", format!("evt-{i}"), deposit_in_lane("a", 1, "p0", i));
    }
    let handler = DepositHandler::failing(|m, _| {
        (m.native_id() == Some("evt-1"))
            .then(|| HandlerError::transient("later").retry_after(Duration::from_secs(30)))
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(
        Consumer::builder("spans-abandon")
            .source(broker.source())
            .inbox(db.inbox())
            .handler(handler.clone())
            .batch_linger(Duration::from_millis(300))
            .build()
            .unwrap()
            .run_until(async {
                let _ = stopped.await;
            }),
    );
    // The batch runs evt-0 and evt-1 (cut), then each alone: evt-1 then waits to retry,
    // holding evt-2 and evt-3 behind it in the batch's queue.
    while handler.calls() < 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();

    let mut outcomes: Vec<(String, Option<String>)> = spans_of("spans-abandon")
        .into_iter()
        .map(|s| {
            (
                s["messaging.message.id"].clone(),
                s.get("txinbox.outcome").cloned(),
            )
        })
        .collect();
    outcomes.sort();
    let abandoned = Some("abandoned".to_string());
    assert_eq!(
        outcomes,
        [
            ("evt-0".to_string(), Some("processed".to_string())),
            ("evt-1".to_string(), abandoned.clone()),
            ("evt-2".to_string(), abandoned.clone()),
            ("evt-3".to_string(), abandoned),
        ],
        "one span per delivery, each with its outcome"
    );
}

#[tokio::test]
async fn each_message_gets_one_span_with_opentelemetry_messaging_attributes() {
    let capture = capture();
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("a", 1, "-", 0));
    broker.publish("evt-1", deposit_in_lane("a", 1, "-", 0));
    broker.close();
    drain("spans", &db, &broker, DepositHandler::default()).await;

    let spans: Vec<Fields> = capture
        .spans
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.get("messaging.consumer.group.name").map(String::as_str) == Some("spans"))
        .cloned()
        .collect();
    assert_eq!(spans.len(), 2, "one span per delivery");
    for s in &spans {
        assert_eq!(s["messaging.system"], "memory");
        assert_eq!(s["messaging.destination.name"], "payments");
        assert_eq!(s["messaging.consumer.group.name"], "spans");
        assert_eq!(s["messaging.message.id"], "evt-1");
    }
    let mut outcomes: Vec<_> = spans.iter().map(|s| s["txinbox.outcome"].as_str()).collect();
    outcomes.sort();
    assert_eq!(outcomes, ["duplicate", "processed"]);
    assert!(spans
        .iter()
        .any(|s| s.get("txinbox.attempt").map(String::as_str) == Some("1")));
}

/// An ID over `MAX_ID_LEN` is dead-lettered as `invalid_id` and never copied into a span (a
/// tracing pipeline would carry a megabyte per delivery).
#[tokio::test]
async fn an_oversized_id_never_reaches_a_span() {
    capture();
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    let huge_id = "i".repeat(512 * 1024);
    broker.publish(huge_id.clone(), deposit_in_lane("a", 1, "-", 0));
    broker.publish("a\0b", deposit_in_lane("a", 1, "-", 1));
    broker.close();
    drain("huge-ids", &db, &broker, DepositHandler::default()).await;
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM txinbox.dead_letters WHERE consumer = 'huge-ids'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(reasons, ["invalid_id", "invalid_id"]);
    let spans = spans_of("huge-ids");
    assert_eq!(spans.len(), 2);
    for s in &spans {
        let recorded = s.get("messaging.message.id").map(String::len);
        assert_eq!(recorded, None, "an ID of this many bytes was recorded");
        assert_eq!(s["txinbox.outcome"], "dead_lettered");
    }
}

/// Each field of a `txinbox.process` span is recorded once, whatever path the delivery took:
/// cut out of a batch and run alone, retried in place. A formatting subscriber prints every
/// record, so the span line used to carry `txinbox.attempt=1` three times.
#[tokio::test]
async fn every_span_field_is_recorded_once() {
    capture();
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.set_retry_mode(txinbox::source::RetryMode::InPlace);
    for i in 0..4 {
        broker.publish_in_lane("l", format!("evt-{i}"), deposit_in_lane("a", 1, "l", i));
    }
    broker.close();
    // evt-2 fails once: its batch is cut, it runs alone, fails, is retried in place.
    let handler = DepositHandler::failing(|m, attempt| {
        (m.native_id() == Some("evt-2") && attempt == 1).then(|| HandlerError::transient("once"))
    });
    Consumer::builder("fields-once")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler)
        .retry_policy(fast_retries())
        .batch_linger(Duration::from_millis(200))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let spans = spans_of("fields-once");
    assert_eq!(spans.len(), 4);
    for s in &spans {
        for (field, count) in s.iter().filter(|(k, _)| k.starts_with('#')) {
            assert_eq!(count, "1", "{field} recorded {count} times on {s:?}");
        }
        assert_eq!(s["txinbox.outcome"], "processed");
    }
    let retried = spans
        .iter()
        .find(|s| s["messaging.message.id"] == "evt-2")
        .unwrap();
    assert_eq!(retried["txinbox.attempt"], "2");
}
