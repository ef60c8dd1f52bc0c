//! The relay's health report.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use txinbox::outbox::{self, OutboxMessage, Relay};

use crate::support::*;

/// A relay whose database refuses connections is alive but not ready, and says why; once
/// stopped it is not alive.
#[tokio::test]
async fn relay_health_reports_an_unreachable_database() {
    let refused: PgConnectOptions = "postgres://postgres@127.0.0.1:1/none".parse().unwrap();
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(refused);
    let relay = Relay::new(pool, Recorder::default(), fast_config()).unwrap();
    let health = relay.health();
    assert_eq!(health.report().state, txinbox::health::RunState::NotStarted);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    wait_relay(&health, Duration::from_secs(10), "database unreachable", |r| {
        !r.database_reachable && !r.is_ready() && r.is_alive()
    })
    .await;
    assert_eq!(health.report().problems(), ["outbox database unreachable"]);
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    assert!(!health.report().is_alive());
}

/// Every publish of a round failing transiently reads as the broker being unavailable: not
/// ready. Once publishes are confirmed again, ready.
#[tokio::test]
async fn relay_health_follows_the_broker() {
    let pool = test_db().await;
    for k in ["a", "b", "c"] {
        outbox::write(&pool, &OutboxMessage::new(format!("{k}-0"), "t", "x").with_key(k))
            .await
            .unwrap();
    }
    let recorder = Recorder::default();
    for k in ["a", "b", "c"] {
        recorder
            .failing
            .lock()
            .unwrap()
            .insert(format!("{k}-0"), Failure::Times(1));
    }
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    let health = relay.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    wait_relay(&health, Duration::from_secs(10), "broker unavailable", |r| {
        r.broker == txinbox::health::BrokerStatus::Disconnected && !r.is_ready()
    })
    .await;
    wait_relay(
        &health,
        Duration::from_secs(20),
        "ready once publishes go through",
        |r| {
            r.broker == txinbox::health::BrokerStatus::Connected
                && r.is_ready()
                && r.since_last_round.is_some()
        },
    )
    .await;
    assert_eq!(recorder.ids().len(), 3);
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

/// With several relays, one that took the broker as unavailable may never get a row of its own
/// again (another relay takes them all). A publisher that cannot tell whether the broker is back
/// (no `Publisher::probe`) puts that relay's report back to unknown, so it does not report an
/// outage it has no evidence of any more (issue 26, item 4; Kafka's publisher answers the probe:
/// `txinbox-kafka`'s outbox tests).
#[tokio::test]
async fn a_relay_without_rows_of_its_own_stops_reporting_an_outage_it_cannot_see() {
    use txinbox::health::BrokerStatus;
    let pool = test_db().await;
    let down = Recorder::default();
    for k in 0..6 {
        let id = format!("k{k}-0");
        outbox::write(
            &pool,
            &OutboxMessage::new(&id, "t", "x").with_key(format!("k{k}")),
        )
        .await
        .unwrap();
        down.failing.lock().unwrap().insert(id, Failure::Times(u32::MAX));
    }
    let config = || txinbox::outbox::RelayConfig::default().poll_interval(Duration::from_millis(50));
    let relay_a = Relay::new(pool.clone(), down, config()).unwrap();
    let health = relay_a.health();
    let spawn = |relay: Relay<Recorder>| {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(relay.run_until(async {
            let _ = stopped.await;
        }));
        (stop, task)
    };
    let (stop_a, task_a) = spawn(relay_a);
    wait_relay(&health, Duration::from_secs(10), "A reports the outage", |r| {
        r.broker == BrokerStatus::Disconnected
    })
    .await;
    let (stop_b, task_b) = spawn(Relay::new(pool.clone(), Recorder::default(), config()).unwrap());
    wait_relay(
        &health,
        Duration::from_secs(60),
        "A, with nothing left to publish, no longer reports an outage",
        |r| r.broker == BrokerStatus::Unknown && r.is_ready(),
    )
    .await;
    assert_eq!(status_counts(&pool).await.get("published"), Some(&6));
    let _ = stop_a.send(());
    let _ = stop_b.send(());
    task_a.await.unwrap().unwrap();
    task_b.await.unwrap().unwrap();
}
