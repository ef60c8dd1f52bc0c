//! Crashes and outages: a process killed mid-handler leaves nothing behind, and a database
//! outage acks nothing and loses nothing.

use std::time::{Duration, Instant};

use txinbox::memory::MemoryBroker;
use txinbox::Consumer;

use super::support::{deposit_in_lane, drain, DepositHandler, PrivateCluster, TestDb};

#[tokio::test]
async fn a_crash_mid_handler_leaves_nothing_and_the_redelivery_applies_once() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    broker.close();
    let stuck = DepositHandler::default().blocking_forever();
    let entered = stuck.entered();
    let consumer = Consumer::builder("crash")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(stuck)
        .build()
        .unwrap();
    let run = tokio::spawn(consumer.run());
    entered.notified().await; // the effect is written inside the open transaction
    run.abort(); // the process "dies" mid-handler
    let _ = run.await;

    // The redelivery runs once the dead transaction has rolled back and released its row lock.
    let handler = DepositHandler::default();
    drain("crash", &db, &broker, handler.clone()).await;
    assert_eq!(handler.calls(), 1);
    assert_eq!(db.balance("alice").await, 10, "applied exactly once");
    assert_eq!(db.scalar("SELECT count(*) FROM effects").await, 1);
    assert_eq!(
        broker.stats().dropped_unsettled,
        1,
        "the crashed delivery was not acked"
    );
}

#[tokio::test]
async fn nothing_committed_survives_a_crash_before_the_redelivery() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    let stuck = DepositHandler::default().blocking_forever();
    let entered = stuck.entered();
    let consumer = Consumer::builder("crash2")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(stuck)
        .build()
        .unwrap();
    let run = tokio::spawn(consumer.run());
    entered.notified().await;
    run.abort();
    let _ = run.await;
    // Wait until PostgreSQL has no transaction of ours open, then look: no inbox row, no effect.
    let deadline = Instant::now() + Duration::from_secs(10);
    while db
        .scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'")
        .await
        > 0
    {
        assert!(Instant::now() < deadline, "the aborted transaction never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.inbox").await, 0);
    assert_eq!(db.scalar("SELECT count(*) FROM effects").await, 0);
    assert_eq!(broker.pending(), 1, "the message is waiting for redelivery");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn database_outage_acks_nothing_and_loses_nothing() {
    let cluster = PrivateCluster::start();
    let db = TestDb::on(cluster.options(), 6).await;
    let broker = MemoryBroker::new("payments");
    broker.record_acks();
    let total = 600u64;
    let consumer = Consumer::builder("outage")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .concurrency(4)
        .build()
        .unwrap();
    let run = tokio::spawn(consumer.run());
    let publisher = {
        let broker = broker.clone();
        tokio::spawn(async move {
            for i in 0..total {
                broker.publish(format!("evt-{i}"), deposit_in_lane("alice", 1, "-", i));
                if i % 3 == 0 {
                    // A duplicate of an earlier event, as a producer retry would send.
                    broker.publish(format!("evt-{}", i / 2), deposit_in_lane("alice", 1, "-", i / 2));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            broker.close();
        })
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    let acks_before_stop = broker.stats().acked;
    let stopped = Instant::now();
    cluster.down();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let restarted = Instant::now();
    cluster.up();
    publisher.await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the consumer recovers and drains after the restart")
        .unwrap()
        .unwrap();

    assert!(acks_before_stop > 0, "messages flowed before the outage");
    // Transactions that committed just before the stop may be acked a moment after it; after
    // that grace period nothing may be acked until the server is back.
    assert_eq!(
        broker.acks().len() as u64,
        broker.stats().acked,
        "every ack is on record"
    );
    let grace = stopped + Duration::from_millis(500);
    let during: Vec<_> = broker
        .acks()
        .into_iter()
        .filter(|a| a.at > grace && a.at < restarted)
        .collect();
    assert!(during.is_empty(), "acked while the database was down: {during:?}");
    assert_eq!(
        db.balance("alice").await,
        total as i64,
        "every unique event applied once"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM effects").await, total as i64);
}
