//! Every outcome is counted under the `consumer` label, through the `metrics` facade.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, HandlerError};

use super::support::{deposit_in_lane, drain, DepositHandler, TestDb};

pub(crate) fn snapshotter() -> &'static Snapshotter {
    static S: OnceLock<Snapshotter> = OnceLock::new();
    S.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let s = recorder.snapshotter();
        recorder.install().expect("the only recorder in this test binary");
        s
    })
}

/// Counter totals so far. A snapshot resets the recorder's counters, so totals are
/// accumulated here across snapshots (tests in this binary run concurrently).
pub(crate) fn counter(name: &str, consumer: &str, label: Option<(&str, &str)>) -> u64 {
    type Labels = Vec<(String, String)>;
    static TOTALS: Mutex<Vec<(String, Labels, u64)>> = Mutex::new(Vec::new());
    let mut totals = TOTALS.lock().unwrap();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        if let DebugValue::Counter(c) = value {
            let labels: Labels = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            totals.push((key.key().name().to_owned(), labels, c));
        }
    }
    let has = |labels: &Labels, k: &str, v: &str| labels.iter().any(|(lk, lv)| lk == k && lv == v);
    totals
        .iter()
        .filter(|(n, labels, _)| n == name && has(labels, "consumer", consumer))
        .filter(|(_, labels, _)| label.is_none_or(|(k, v)| has(labels, k, v)))
        .map(|(.., c)| c)
        .sum()
}

#[tokio::test]
async fn every_outcome_is_counted() {
    snapshotter();
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish_in_lane("l", "ok", deposit_in_lane("a", 1, "l", 0));
    broker.publish_in_lane("l", "ok", deposit_in_lane("a", 1, "l", 0)); // duplicate
    broker.publish_in_lane("l", "ok", deposit_in_lane("a", 2, "l", 0)); // conflict
    broker.publish_in_lane("l", "flaky", deposit_in_lane("a", 1, "l", 1)); // one retry
    broker.publish_in_lane("l", "bad", "nope"); // undecodable
    broker.close();
    let handler = DepositHandler::failing(|m, attempt| {
        (m.native_id() == Some("flaky") && attempt == 1).then(|| HandlerError::transient("once"))
    });
    broker.set_lose_ack_probability(0.0);
    drain("metrics", &db, &broker, handler).await;
    let c = |name| counter(name, "metrics", None);
    assert_eq!(c(txinbox::telemetry::PROCESSED), 2);
    assert_eq!(c(txinbox::telemetry::DUPLICATES), 1);
    assert_eq!(c(txinbox::telemetry::CONFLICTS), 1);
    assert_eq!(c(txinbox::telemetry::RETRIES), 1);
    assert_eq!(c(txinbox::telemetry::DEAD_LETTERS), 2);
    assert_eq!(
        counter(
            txinbox::telemetry::DEAD_LETTERS,
            "metrics",
            Some(("reason", "conflict"))
        ),
        1
    );
    assert_eq!(c(txinbox::telemetry::ACK_FAILURES), 0);

    let lossy = MemoryBroker::with_seed("payments", 3);
    lossy.set_lose_ack_probability(1.0);
    lossy.publish("x", deposit_in_lane("a", 1, "-", 9));
    let run = tokio::spawn(
        Consumer::builder("metrics-acks")
            .source(lossy.source())
            .inbox(db.inbox())
            .handler(DepositHandler::default())
            .build()
            .unwrap()
            .run(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while counter(txinbox::telemetry::ACK_FAILURES, "metrics-acks", None) < 3 {
        assert!(Instant::now() < deadline, "ack failures after commit are counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    run.abort();
    assert_eq!(counter(txinbox::telemetry::PROCESSED, "metrics-acks", None), 1);
    assert!(counter(txinbox::telemetry::DUPLICATES, "metrics-acks", None) >= 2);
}
