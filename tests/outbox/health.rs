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
