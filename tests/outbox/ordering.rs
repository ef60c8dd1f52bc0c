//! Order and atomicity: rows follow their transaction, IDs are written once, keys keep their
//! order across relays and late commits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use txinbox::message::Headers;
use txinbox::outbox::{self, OutboxMessage, Relay};

use crate::support::*;

#[tokio::test]
async fn rows_follow_their_transaction_and_ids_are_written_once() {
    let pool = test_db().await;
    let msg = |id: &str| {
        OutboxMessage::new(id, "orders", format!("payload-{id}"))
            .with_key("k")
            .with_headers(Headers::new().with("h", &b"\xff\x00raw"[..]))
    };

    let mut tx = pool.begin().await.unwrap();
    assert!(outbox::write(&mut *tx, &msg("committed")).await.unwrap());
    assert!(
        !outbox::write(&mut *tx, &msg("committed")).await.unwrap(),
        "the same ID twice in one transaction writes one row"
    );
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    assert!(outbox::write(&mut *tx, &msg("rolled-back")).await.unwrap());
    tx.rollback().await.unwrap();

    // The same message again, in a later transaction: nothing written, no error.
    assert!(!outbox::write(&pool, &msg("committed")).await.unwrap());
    // Another message under an existing ID is an error that says what differs, never a silent
    // no-op (one of the two messages would be lost), and it changes nothing.
    for (other, differs) in [
        (
            OutboxMessage::new("committed", "elsewhere", "payload-committed").with_key("k"),
            "destination",
        ),
        (
            OutboxMessage::new("committed", "orders", "payload-committed").with_key("j"),
            "key",
        ),
        (
            OutboxMessage::new("committed", "orders", "payload-committed"),
            "key",
        ),
        (
            OutboxMessage::new("committed", "orders", "other").with_key("k"),
            "payload",
        ),
    ] {
        let err = outbox::write(&pool, &other).await.unwrap_err();
        assert!(
            matches!(&err, outbox::WriteError::Conflict { message_id, differs: d } if message_id == "committed" && *d == differs),
            "{err}"
        );
        assert!(err.is_permanent());
    }
    let err = outbox::write(&pool, &OutboxMessage::new("", "orders", "p"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");

    let recorder = Recorder::default();
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    drain(&relay).await;
    let log = recorder.log.lock().unwrap().clone();
    assert_eq!(log.len(), 1, "only the committed row is published");
    assert_eq!(log[0].1, msg("committed"), "published exactly as written");
    assert_eq!(status_counts(&pool).await.get("published"), Some(&1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_publish_every_row_once_in_key_order() {
    let pool = test_db().await;
    // A few more keys than a round claims (batch 7; 5 on AMQP): both relays find work, and
    // they contend for the same keys.
    let (keys, per_key) = (9, 60);
    let total = write_interleaved(&pool, keys, per_key).await;

    let recorder = Recorder {
        jitter: true,
        ..Recorder::default()
    };
    // Small batches so the relays interleave a lot.
    let config = || fast_config().batch_size(7);
    let a = Relay::new(pool.clone(), recorder.as_relay("a"), config()).unwrap();
    let b = Relay::new(pool.clone(), recorder.as_relay("b"), config()).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let ta = tokio::spawn(a.run_until(stopped(stop_rx.clone())));
    let tb = tokio::spawn(b.run_until(stopped(stop_rx)));
    // More rows while both run.
    let more_pool = pool.clone();
    let writer = tokio::spawn(async move {
        for i in per_key..per_key + 40 {
            for k in 0..keys {
                let m = OutboxMessage::new(format!("k{k}-{i}"), "events", "late").with_key(format!("k{k}"));
                outbox::write(&more_pool, &m).await.unwrap();
            }
        }
    });
    writer.await.unwrap();
    let total = total + keys * 40;
    let started = Instant::now();
    while recorder.log.lock().unwrap().len() < total && started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop_tx.send(true).unwrap();
    ta.await.unwrap().unwrap();
    tb.await.unwrap().unwrap();

    let ids = recorder.ids();
    assert_eq!(ids.len(), total, "every row published once, none lost");
    assert_key_order(&ids, keys, per_key + 40);
    let by_relay = |r: &str| {
        recorder
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|(x, _)| *x == r)
            .count()
    };
    let (na, nb) = (by_relay("a"), by_relay("b"));
    assert!(na > 0 && nb > 0, "both relays published (a: {na}, b: {nb})");
    assert_eq!(status_counts(&pool).await.get("published"), Some(&(total as i64)));
}

/// A row with a lower ID can commit after a higher one of its key was claimed (IDs are taken at
/// insert, not commit). It has no defined order against that row — but rows of transactions
/// that began after it committed must still follow it. The round's head claim and its
/// follower claim see different snapshots: here the writer commits the late row and a newer
/// one while the relay's head claim is still scanning (a long backlog of another key), so the
/// follower claim sees both. It must not take the newer row past the late one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_committing_row_is_not_overtaken_by_rows_written_after_it() {
    let pool = test_db().await;
    let mut late = pool.begin().await.unwrap();
    outbox::write(&mut *late, &OutboxMessage::new("k-late", "t", "x").with_key("k"))
        .await
        .unwrap();
    outbox::write(&pool, &OutboxMessage::new("k-early", "t", "x").with_key("k"))
        .await
        .unwrap();
    // Another key's backlog behind a head that is not due: the head claim scans all of it.
    sqlx::query(
        "INSERT INTO txinbox.outbox (message_id, destination, message_key, payload, next_attempt_at)
         VALUES ('z-head', 't', 'z', '', now() + interval '1 hour')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO txinbox.outbox (message_id, destination, message_key, payload)
         SELECT 'z-' || g, 't', 'z', '' FROM generate_series(1, 300000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE txinbox.outbox")
        .execute(&pool)
        .await
        .unwrap();

    let recorder = Recorder::default();
    let relay = Arc::new(Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap());
    let round = tokio::spawn({
        let relay = Arc::clone(&relay);
        async move { relay.relay_once().await.unwrap() }
    });
    let claiming = "SELECT count(*) FROM pg_stat_activity
        WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
          AND query LIKE '%FOR UPDATE OF o SKIP LOCKED%'";
    // The head claim has its snapshot once it locked k-early (a row lock sets xmax); the query
    // shows as active in pg_stat_activity already while it is being parsed, before that.
    let early_locked =
        "SELECT (xmax::text <> '0')::int::int8 FROM txinbox.outbox WHERE message_id = 'k-early'";
    let started = Instant::now();
    while scalar_i64(&pool, early_locked).await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the relay never ran its claim"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    late.commit().await.unwrap();
    outbox::write(&pool, &OutboxMessage::new("k-after", "t", "x").with_key("k"))
        .await
        .unwrap();
    assert_eq!(
        scalar_i64(&pool, claiming).await,
        1,
        "test setup: the head claim must still be running when the writes commit"
    );
    let first = round.await.unwrap();
    assert_eq!(first.claimed, 1, "only k-early, the head: {first:?}");
    relay.relay_once().await.unwrap();
    assert_eq!(recorder.ids(), ["k-early", "k-late", "k-after"]);
}
