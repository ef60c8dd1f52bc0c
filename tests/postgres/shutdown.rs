//! Shutdown: a graceful stop settles what it received, and what it left unsettled is not
//! overtaken in its lane.

use std::time::Duration;

use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, HandlerError};

use super::support::{deposit_in_lane, DepositHandler, TestDb};

#[tokio::test]
async fn graceful_shutdown_settles_everything_it_received() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    for i in 0..50u64 {
        broker.publish(format!("evt-{i}"), deposit_in_lane("alice", 1, "-", i));
    }
    let handler = DepositHandler::default().holding(Duration::from_millis(50));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer = Consumer::builder("shutdown")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler.clone())
        .concurrency(4)
        .max_in_flight(8)
        .build()
        .unwrap();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();

    let stats = broker.stats();
    assert!(stats.acked > 0 && stats.acked < 50, "stopped midway: {stats:?}");
    assert_eq!(stats.dropped_unsettled, 0, "every received delivery was settled");
    assert_eq!(
        broker.pending() as u64,
        50 - stats.acked,
        "the rest wait in the queue"
    );
    assert_eq!(
        db.balance("alice").await as u64,
        stats.acked,
        "each ack has its committed effect"
    );
}

#[tokio::test]
async fn a_lane_does_not_overtake_a_delivery_left_unsettled_at_shutdown() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.set_retry_mode(txinbox::source::RetryMode::InPlace);
    broker.publish_in_lane("p0", "evt-0", deposit_in_lane("alice", 1, "p0", 0));
    broker.publish_in_lane("p0", "evt-1", deposit_in_lane("alice", 1, "p0", 1));
    let handler = DepositHandler::failing(|m, _| {
        (m.native_id() == Some("evt-0"))
            .then(|| HandlerError::transient("later").retry_after(Duration::from_secs(30)))
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(
        Consumer::builder("abandon")
            .source(broker.source())
            .inbox(db.inbox())
            .handler(handler.clone())
            .build()
            .unwrap()
            .run_until(async {
                let _ = stopped.await;
            }),
    );
    while handler.calls() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await; // evt-0 is now waiting to retry
    stop.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects").await,
        0,
        "evt-1 must not overtake evt-0"
    );
    assert_eq!(handler.calls(), 1);
    assert_eq!(broker.pending(), 2, "both wait for redelivery");
}
