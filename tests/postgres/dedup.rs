//! Dedup: concurrent deliveries of one ID apply once; the same ID with another payload is a
//! conflict, dead-lettered.

use std::time::Duration;

use txinbox::memory::MemoryBroker;
use txinbox::{dead_letter::DeadLetterReason, Consumer};

use super::support::{deposit_in_lane, drain, DepositHandler, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_deliveries_of_one_id_apply_once() {
    let db = TestDb::new(30).await;
    // The handler keeps its transaction open, so all 20 claims overlap: without the unique-index
    // serialisation each of them would apply the deposit.
    let handler = DepositHandler::default().holding(Duration::from_millis(300));
    let brokers: Vec<MemoryBroker> = (0..20)
        .map(|_| {
            let b = MemoryBroker::new("payments");
            b.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
            b.close();
            b
        })
        .collect();
    let runs = brokers.iter().map(|b| {
        let consumer = Consumer::builder("payments")
            .source(b.source())
            .inbox(db.inbox())
            .handler(handler.clone())
            .concurrency(1)
            .build()
            .unwrap();
        tokio::spawn(consumer.run())
    });
    for run in futures::future::join_all(runs).await {
        run.unwrap().unwrap();
    }
    assert_eq!(
        db.balance("alice").await,
        10,
        "the deposit is applied exactly once"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM effects").await, 1);
    let acked: u64 = brokers.iter().map(|b| b.stats().acked).sum();
    assert_eq!(acked, 20, "every delivery is settled with an ack");
    assert_eq!(handler.calls(), 1, "duplicates never run the handler");
}

#[tokio::test]
async fn same_id_with_another_payload_is_a_conflict_and_dead_lettered() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish_in_lane("l", "evt-1", deposit_in_lane("alice", 10, "l", 0));
    broker.publish_in_lane("l", "evt-1", deposit_in_lane("alice", 99, "l", 1));
    broker.close();
    let handler = DepositHandler::default();
    drain("conflicts", &db, &broker, handler.clone()).await;

    assert_eq!(handler.calls(), 1, "the handler never runs for a conflict");
    assert_eq!(db.balance("alice").await, 10, "the effect is unchanged");
    let (reason, payload): (String, Vec<u8>) =
        sqlx::query_as("SELECT reason, payload FROM txinbox.dead_letters WHERE message_id = 'evt-1'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reason, "conflict");
    assert_eq!(
        payload,
        deposit_in_lane("alice", 99, "l", 1).into_bytes(),
        "the conflicting payload is kept"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.reason, DeadLetterReason::Conflict);
}
