//! LISTEN/NOTIFY: notifications wake the relay, and are read during outages and long drains.

use std::time::{Duration, Instant};

use sqlx::postgres::PgPool;
use txinbox::outbox::{self, OutboxMessage, Relay};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_wakes_the_relay_long_before_its_poll_interval() {
    let pool = test_db().await;
    let recorder = Recorder::default();
    let relay = Relay::new(
        pool.clone(),
        recorder.clone(),
        fast_config().poll_interval(Duration::from_secs(3600)),
    )
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    // Let it reach its wait (first round finds nothing).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut tx = pool.begin().await.unwrap();
    outbox::write(&mut *tx, &OutboxMessage::new("wake", "t", "x"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let started = Instant::now();
    while recorder.ids().is_empty() && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        recorder.ids(),
        vec!["wake".to_string()],
        "woken by NOTIFY, not by polling (1 h)"
    );
    let _ = stop.send(());
    task.await.unwrap().unwrap();
}

/// The relay's LISTEN connection must be read even while the relay does not wait for it
/// (here: a broker outage spaces its rounds out). A listener the client does not read blocks
/// its server backend on the socket, which holds back the server's NOTIFY queue for every
/// database; when that queue is full, every writer's COMMIT fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_are_read_during_a_broker_outage() {
    let pool = test_db().await;
    let recorder = Recorder::default();
    for k in ["a", "b"] {
        outbox::write(&pool, &OutboxMessage::new(k, "t", "x").with_key(k))
            .await
            .unwrap();
        recorder
            .failing
            .lock()
            .unwrap()
            .insert(k.into(), Failure::Times(u32::MAX));
    }
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    let caught_up = floods_are_read(&pool).await;
    let _ = stop.send(());
    running.await.unwrap().unwrap();
    assert!(
        caught_up,
        "the listening backend is idle again once the relay read its notifications"
    );
}

/// The same while the relay drains a backlog round after round without waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_are_read_during_a_long_drain() {
    let pool = test_db().await;
    sqlx::query(
        "INSERT INTO txinbox.outbox (message_id, destination, payload)
         SELECT 'r-' || g, 't', '' FROM generate_series(1, 3000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    let recorder = Recorder {
        pause: Duration::from_millis(5),
        ..Recorder::default()
    };
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config().batch_size(1)).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    let caught_up = floods_are_read(&pool).await;
    let pending = scalar_i64(
        &pool,
        "SELECT count(*) FROM txinbox.outbox WHERE status = 'pending'",
    )
    .await;
    let _ = stop.send(());
    running.await.unwrap().unwrap();
    assert!(pending > 0, "test setup: the drain ended before the check");
    assert!(
        caught_up,
        "the listening backend is idle again once the relay read its notifications"
    );
}

/// Waits for the relay's LISTEN, sends it far more notifications than the sockets buffer (one
/// transaction: distinct payloads are not folded), and reports whether its server backend is
/// back to waiting for the client (`ClientRead`) rather than blocked writing to it within 15 s.
async fn floods_are_read(pool: &PgPool) -> bool {
    let listener_waits = "SELECT coalesce(max(wait_event), '') FROM pg_stat_activity
        WHERE datname = current_database() AND query LIKE 'LISTEN%'";
    let started = Instant::now();
    while scalar_text(pool, listener_waits).await.is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the relay never listened"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::query(
        "SELECT count(pg_notify('txinbox_outbox', g::text || repeat('x', 400)))
         FROM generate_series(1, 100000) g",
    )
    .execute(pool)
    .await
    .unwrap();
    let started = Instant::now();
    loop {
        if scalar_text(pool, listener_waits).await == "ClientRead" {
            return true;
        }
        if started.elapsed() > Duration::from_secs(15) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
