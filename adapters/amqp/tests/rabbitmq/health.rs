//! What the AMQP source tells the consumer's health and the queue-depth gauge.

use std::sync::{Mutex, OnceLock};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use txinbox::health::BrokerStatus;
use txinbox::Consumer;
use txinbox_amqp::telemetry;

use super::*;

fn snapshotter() -> &'static Snapshotter {
    static S: OnceLock<Snapshotter> = OnceLock::new();
    S.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let s = recorder.snapshotter();
        recorder.install().expect("the only recorder in this test binary");
        s
    })
}

/// Values of gauge `name` for `queue` seen so far (the recorder resets a gauge when read: each
/// is what was set since the previous read, or 0).
fn gauge_values(name: &str, queue: &str) -> Vec<f64> {
    static SEEN: Mutex<Vec<(String, String, f64)>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let q = key
            .key()
            .labels()
            .find(|l| l.key() == "queue")
            .map(|l| l.value().to_owned());
        if let (DebugValue::Gauge(g), Some(q)) = (value, q) {
            seen.push((key.key().name().to_owned(), q, g.into_inner()));
        }
    }
    seen.iter()
        .filter(|(n, q, _)| n == name && q == queue)
        .map(|(.., v)| *v)
        .collect()
}

/// With a slow handler and a small prefetch most messages wait in the queue: the depth gauge
/// shows them (ready messages, as the broker counts them), and the consumer's health reports
/// the broker connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_depth_and_connection_are_reported() {
    snapshotter();
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("depth").await;
    let messages: Vec<_> = (0..30)
        .map(|i| (Some(format!("depth-{i}")), deposit("alice", 1)))
        .collect();
    queue.publish_all(&messages).await;

    let source = AmqpSource::connect(queue.config(2)).await.unwrap();
    let consumer = Consumer::builder("amqp-health")
        .source(source)
        .inbox(db.inbox())
        .handler(DepositHandler::default().holding(Duration::from_millis(500)))
        .concurrency(1)
        .build()
        .unwrap();
    let health = consumer.health();
    assert_eq!(
        health.report().broker,
        BrokerStatus::Connected,
        "connected before it runs"
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run_until(async move {
        let _ = stopped.await;
    }));

    wait_until(
        Duration::from_secs(15),
        "the depth gauge shows the waiting messages",
        || async {
            gauge_values(telemetry::QUEUE_DEPTH, &queue.name)
                .iter()
                .any(|v| *v >= 20.0)
        },
    )
    .await;
    let report = health.report();
    assert!(report.is_ready(), "{:?}", report.problems());
    assert_eq!(report.broker, BrokerStatus::Connected);

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    queue.delete().await;
    db.drop_db().await;
}

/// With `declare_topology(false)` the dead-letter queue is someone else's to declare. One that
/// does not exist is found when the source connects, not when the first bad message's copy is
/// unroutable and the message keeps coming back: the consumer is not ready and the problem names
/// the queue. Once it is declared, the consumer is ready again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_queue_is_reported_at_start() {
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("dlq-missing").await;
    let dlq = format!("{}.elsewhere", queue.name);
    let config = queue.config(5).declare_topology(false).dead_letter_queue(&dlq);
    let consumer = Consumer::builder("amqp-dlq-missing")
        .source(AmqpSource::connect(config).await.unwrap())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .concurrency(1)
        .build()
        .unwrap();
    let health = consumer.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run_until(async move {
        let _ = stopped.await;
    }));
    let named = |r: &txinbox::health::HealthReport| {
        r.problems()
            .iter()
            .any(|p| p.contains(&dlq) && p.contains("does not exist"))
    };
    wait_until(
        Duration::from_secs(15),
        "a problem names the missing dead-letter queue",
        || async { named(&health.report()) },
    )
    .await;
    assert!(!health.report().is_ready(), "{:?}", health.report().problems());

    let conn = lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            dlq.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    wait_until(Duration::from_secs(30), "ready once the queue exists", || async {
        health.report().is_ready()
    })
    .await;

    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let _ = channel
        .queue_delete(dlq.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "done".into()).await;
    queue.delete().await;
    db.drop_db().await;
}
