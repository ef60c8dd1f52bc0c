//! The relay while its database is unavailable, and when a round fails for another reason: the
//! same classification as the consumer's and txinbox-http's (`txinbox::store::is_unavailable`)
//! decides which is which.

use std::time::Duration;

use txinbox::outbox::{self, OutboxMessage, Relay};
use txinbox_testing::database::TestDatabase;

use crate::support::*;

/// An operator takes the database offline (`ALLOW_CONNECTIONS false`, sessions ended) while a
/// round is publishing: the relay reports the database unreachable and nothing else, counts no
/// attempt against the rows it could not mark, and publishes everything once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_rides_out_a_database_refusing_connections() {
    let db = TestDatabase::builder("txinbox_outbox_t")
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(1))
        .create()
        .await;
    let pool = db.pool().clone();
    for k in ["a", "b", "c"] {
        outbox::write(&pool, &OutboxMessage::new(format!("{k}-0"), "t", "x").with_key(k))
            .await
            .unwrap();
    }
    // Each publish takes a while: the sessions end while the round holds its claim.
    let recorder = Recorder {
        pause: Duration::from_millis(700),
        ..Recorder::default()
    };
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    let health = relay.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    tokio::time::sleep(Duration::from_millis(300)).await;
    db.refuse_connections().await;
    wait_relay(&health, Duration::from_secs(10), "database unreachable", |r| {
        !r.database_reachable && !r.is_ready() && r.is_alive()
    })
    .await;
    assert_eq!(health.report().problems(), ["outbox database unreachable"]);
    assert!(!run.is_finished(), "the relay gave up");

    db.allow_connections().await;
    wait_relay(&health, Duration::from_secs(20), "ready again", |r| {
        r.database_reachable && r.is_ready()
    })
    .await;
    for _ in 0..200 {
        if status_counts(&pool).await.get("published") == Some(&3) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status_counts(&pool).await.get("published"), Some(&3));
    // A published row counts its one successful publish; the outage adds nothing.
    assert_eq!(
        scalar_i64(&pool, "SELECT max(attempts)::bigint FROM txinbox.outbox").await,
        1,
        "an outage counted as publish attempts"
    );
    let mut ids = recorder.ids();
    ids.sort();
    ids.dedup();
    assert_eq!(ids, ["a-0", "b-0", "c-0"]);
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

/// A round that fails for a reason other than an outage (here: the outbox table is missing, the
/// database was never migrated) is not reported as an unreachable database, which would send
/// an operator after the network: the relay is not ready and the problem names the error.
#[tokio::test]
async fn a_failing_round_is_not_reported_as_an_unreachable_database() {
    let db = TestDatabase::builder("txinbox_outbox_t")
        .max_connections(4)
        .migrate(false)
        .create()
        .await;
    let relay = Relay::new(db.pool().clone(), Recorder::default(), fast_config()).unwrap();
    let health = relay.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    wait_relay(&health, Duration::from_secs(10), "rounds fail", |r| {
        !r.is_ready() && r.state == txinbox::health::RunState::Running
    })
    .await;
    let report = health.report();
    assert!(report.database_reachable, "{report:?}");
    let problems = report.problems();
    assert!(
        problems.len() == 1 && problems[0].contains("outbox") && problems[0].contains("does not exist"),
        "{problems:?}"
    );
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}
