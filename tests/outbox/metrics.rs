//! The relay's metrics.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use txinbox::outbox::{self, OutboxMessage, Relay};

use crate::support::*;

#[tokio::test]
async fn metrics_count_publishes_failures_dead_letters_and_the_backlog() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use metrics_util::MetricKind;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Only this test reads metrics; the recorder is scoped to this thread while the relay is
    // built and run, so concurrent tests are unaffected.
    let pool = test_db().await;
    for (id, key) in [("ok-1", "a"), ("flaky", "b"), ("poison", "c"), ("ok-2", "a")] {
        outbox::write(&pool, &OutboxMessage::new(id, "t", "x").with_key(key))
            .await
            .unwrap();
    }
    let publisher = Recorder::default();
    {
        let mut failing = publisher.failing.lock().unwrap();
        failing.insert("flaky".into(), Failure::Times(1));
        failing.insert("poison".into(), Failure::Permanent);
    }
    let _guard = metrics::set_default_local_recorder(&recorder);
    let relay = Relay::new(pool.clone(), publisher, fast_config().name("metrics-relay")).unwrap();
    let backlog = relay.refresh_metrics().await.unwrap();
    assert_eq!(backlog.pending, 4);
    // A snapshot resets counters: accumulate them across snapshots, keep the last gauges.
    let totals: std::cell::RefCell<HashMap<String, u64>> = Default::default();
    let gauges: std::cell::RefCell<HashMap<String, f64>> = Default::default();
    let take = || {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let mine = key
                .key()
                .labels()
                .any(|l| l.key() == "relay" && l.value() == "metrics-relay");
            let name = key.key().name().to_owned();
            match value {
                DebugValue::Counter(c) if mine && key.kind() == MetricKind::Counter => {
                    *totals.borrow_mut().entry(name).or_default() += c
                }
                DebugValue::Gauge(g) if mine => {
                    gauges.borrow_mut().insert(name, g.into_inner());
                }
                _ => {}
            }
        }
    };
    let gauge = |name: &str| {
        take();
        *gauges
            .borrow()
            .get(name)
            .unwrap_or_else(|| panic!("gauge {name} recorded"))
    };
    assert_eq!(gauge("txinbox_outbox_pending"), 4.0);
    assert!(gauge("txinbox_outbox_oldest_pending_age_seconds") >= 0.0);

    let started = Instant::now();
    while relay.refresh_metrics().await.unwrap().pending > 0 && started.elapsed() < Duration::from_secs(10) {
        relay.relay_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(gauge("txinbox_outbox_pending"), 0.0);
    assert_eq!(gauge("txinbox_outbox_oldest_pending_age_seconds"), 0.0);
    take();
    let counters = totals.borrow().clone();
    assert_eq!(
        counters.get("txinbox_outbox_published_total"),
        Some(&3),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("txinbox_outbox_publish_failures_total"),
        Some(&2),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("txinbox_outbox_dead_letters_total"),
        Some(&1),
        "{counters:?}"
    );
}
