//! Ordering: each lane applies in publish order, also while a message waits to retry, and a
//! waiting lane never holds back the others.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, HandlerError};

use super::support::{deposit_in_lane, drain, DepositHandler, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_messages_with_duplicates_in_eight_lanes_apply_once_in_order() {
    let db = TestDb::new(12).await;
    let broker = MemoryBroker::with_seed("payments", 42);
    broker.set_duplicate_probability(0.05);
    broker.set_lose_ack_probability(0.02);
    let mut rng = fastrand::Rng::with_seed(7);
    let mut expected: HashMap<String, i64> = HashMap::new();
    let mut published = Vec::new();
    for i in 0..10_000u64 {
        let lane = format!("lane-{}", i % 8);
        let account = format!("acct-{}", rng.u32(0..50));
        let amount = rng.i64(1..1000);
        *expected.entry(account.clone()).or_default() += amount;
        let payload = deposit_in_lane(&account, amount, &lane, i);
        broker.publish_in_lane(&lane, format!("evt-{i}"), payload.clone());
        published.push((lane.clone(), format!("evt-{i}"), payload.clone()));
        // 30% of the stream are producer-side duplicates, re-sent shortly after.
        if rng.f64() < 3.0 / 7.0 {
            let (l, id, p) = &published[rng.usize(published.len().saturating_sub(20)..published.len())];
            broker.publish_in_lane(l, id.clone(), p.clone());
        }
    }
    broker.close();
    let stats_before = broker.stats();
    let handler = DepositHandler::default();
    Consumer::builder("bulk")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler.clone())
        .concurrency(8)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();

    let dup_share = (stats_before.published - 10_000) as f64 / stats_before.published as f64;
    assert!(
        dup_share > 0.25,
        "the stream carries ~30% duplicates, got {dup_share:.2}"
    );
    assert_eq!(
        db.scalar("SELECT count(DISTINCT message_id) FROM effects").await,
        10_000,
        "none missing"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects").await,
        10_000,
        "none applied twice"
    );
    for (account, want) in &expected {
        assert_eq!(db.balance(account).await, *want, "balance of {account}");
    }
    // Within each lane the effects were applied in publish order.
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT lane, idx FROM effects ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut last: HashMap<String, i64> = HashMap::new();
    for (lane, idx) in rows {
        let prev = last.insert(lane.clone(), idx);
        assert!(
            prev.is_none_or(|p| p < idx),
            "lane {lane}: {idx} applied after {prev:?}"
        );
    }
    assert!(broker.stats().acks_lost > 0, "the run exercised lost acks");
    assert_eq!(broker.pending(), 0);
    // Every delivery beyond the first of each message was absorbed as a duplicate and counted
    // in its inbox row (what `txinbox status` reports).
    assert_eq!(
        db.scalar("SELECT sum(duplicates)::bigint FROM txinbox.inbox")
            .await,
        broker.stats().delivered as i64 - 10_000,
        "duplicates counted in the inbox"
    );
}

#[tokio::test]
async fn in_place_retries_hold_the_lane_and_keep_order() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.set_retry_mode(txinbox::source::RetryMode::InPlace);
    broker.publish_in_lane("p0", "evt-0", deposit_in_lane("alice", 1, "p0", 0));
    broker.publish_in_lane("p0", "evt-1", deposit_in_lane("alice", 1, "p0", 1));
    broker.close();
    let handler = DepositHandler::failing(|m, attempt| {
        (m.native_id() == Some("evt-0") && attempt < 3).then(|| HandlerError::transient("not yet"))
    });
    drain("inplace", &db, &broker, handler.clone()).await;
    let order: Vec<String> = sqlx::query_scalar("SELECT message_id FROM effects ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(order, ["evt-0", "evt-1"]);
    assert_eq!(broker.stats().retried, 0, "no broker redelivery in place mode");
    assert_eq!(handler.start_counts()["evt-0"], 3);
}

#[tokio::test]
async fn a_lane_waiting_to_retry_does_not_hold_back_other_lanes() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.set_retry_mode(txinbox::source::RetryMode::InPlace);
    broker.publish_in_lane("a", "a-0", deposit_in_lane("alice", 1, "a", 0));
    for i in 0..5 {
        broker.publish_in_lane("b", format!("b-{i}"), deposit_in_lane("bob", 1, "b", i));
    }
    broker.close();
    let first = Arc::new(AtomicUsize::new(0));
    let seen = first.clone();
    let handler = DepositHandler::failing(move |m, attempt| {
        (m.native_id() == Some("a-0") && attempt == 1 && seen.fetch_add(1, Ordering::SeqCst) == 0)
            .then(|| HandlerError::transient("slow down").retry_after(Duration::from_millis(1500)))
    });
    Consumer::builder("starve")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler)
        .concurrency(1)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let order: Vec<String> = sqlx::query_scalar("SELECT message_id FROM effects ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(order.len(), 6);
    assert_eq!(
        order.last().map(String::as_str),
        Some("a-0"),
        "lane b ran while a-0 waited: {order:?}"
    );
}
