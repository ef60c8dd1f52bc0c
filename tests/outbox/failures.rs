//! Failures: a failing row holds its key, publish timeouts, broker outages, shutdown while
//! the database is unreachable.

use std::time::{Duration, Instant};

use sqlx::postgres::PgPoolOptions;
use txinbox::outbox::{self, OutboxMessage, Relay};
use txinbox::RetryPolicy;

use crate::support::*;

#[tokio::test]
async fn a_failing_row_holds_its_key_until_dead_lettered() {
    let pool = test_db().await;
    for i in 0..3 {
        outbox::write(
            &pool,
            &OutboxMessage::new(format!("a-{i}"), "t", "x").with_key("a"),
        )
        .await
        .unwrap();
        outbox::write(
            &pool,
            &OutboxMessage::new(format!("b-{i}"), "t", "x").with_key("b"),
        )
        .await
        .unwrap();
    }
    let recorder = Recorder::default();
    recorder
        .failing
        .lock()
        .unwrap()
        .insert("a-1".into(), Failure::Times(u32::MAX));
    recorder
        .failing
        .lock()
        .unwrap()
        .insert("b-1".into(), Failure::Times(1));
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();

    // Key b: b-1 fails once, is retried after its backoff, then b-2 follows.
    // Key a: a-1 fails every time; a-2 must not overtake it; after 3 attempts a-1 is
    // dead-lettered and a-2 goes.
    let started = Instant::now();
    while recorder.log.lock().unwrap().len() < 5 && started.elapsed() < Duration::from_secs(10) {
        relay.relay_once().await.unwrap();
        let ids = recorder.ids();
        if ids.contains(&"a-2".to_string()) {
            let (status,): (String,) =
                sqlx::query_as("SELECT status FROM txinbox.outbox WHERE message_id = 'a-1'")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(status, "dead_lettered", "a-2 went before a-1 was dead-lettered");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ids = recorder.ids();
    assert_eq!(
        ids,
        ids.iter().filter(|i| *i != "a-1").cloned().collect::<Vec<_>>()
    );
    let pos = |id: &str| {
        ids.iter()
            .position(|x| x == id)
            .unwrap_or_else(|| panic!("{id} not published: {ids:?}"))
    };
    assert!(pos("a-0") < pos("a-2"));
    assert!(pos("b-0") < pos("b-1") && pos("b-1") < pos("b-2"));
    let (attempts, error): (i32, String) =
        sqlx::query_as("SELECT attempts, last_error FROM txinbox.outbox WHERE message_id = 'a-1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(attempts, 3, "bounded attempts");
    assert!(error.contains("broker unavailable"), "{error}");

    // A permanent failure dead-letters at once.
    outbox::write(&pool, &OutboxMessage::new("big", "t", "x").with_key("c"))
        .await
        .unwrap();
    recorder
        .failing
        .lock()
        .unwrap()
        .insert("big".into(), Failure::Permanent);
    let round = relay.relay_once().await.unwrap();
    assert_eq!((round.failed, round.dead_lettered), (1, 1));
}

#[tokio::test]
async fn a_round_stops_starting_publishes_after_the_publish_timeout() {
    let pool = test_db().await;
    for i in 0..5 {
        outbox::write(
            &pool,
            &OutboxMessage::new(format!("slow-{i}"), "t", "x").with_key("k"),
        )
        .await
        .unwrap();
    }
    let recorder = Recorder {
        pause: Duration::from_millis(300),
        ..Recorder::default()
    };
    let relay = Relay::new(
        pool.clone(),
        recorder.clone(),
        fast_config().publish_timeout(Duration::from_millis(500)),
    )
    .unwrap();
    // Started at 0 ms and 300 ms; at 600 ms the round's 500 ms are over.
    let round = relay.relay_once().await.unwrap();
    assert_eq!(
        (round.claimed, round.published, round.failed),
        (5, 2, 0),
        "{round:?}"
    );
    let untouched = sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM txinbox.outbox WHERE status = 'pending' AND attempts = 0",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(untouched, 3, "rows not started cost no attempt");
    drain(&relay).await;
    assert_eq!(
        recorder.ids(),
        (0..5).map(|i| format!("slow-{i}")).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_broker_outage_burns_no_attempts_but_a_lone_failing_row_does() {
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
            .insert(format!("{k}-0"), Failure::Times(5));
    }
    // One attempt allowed: a counted failure would dead-letter at once.
    let config = fast_config().retry_policy(RetryPolicy::default().max_attempts(1));
    let relay = Relay::new(pool.clone(), recorder.clone(), config).unwrap();
    for _ in 0..5 {
        let round = relay.relay_once().await.unwrap();
        assert!(round.broker_unavailable, "{round:?}");
        assert_eq!((round.failed, round.dead_lettered), (3, 0));
    }
    let attempts = scalar_i64(
        &pool,
        "SELECT coalesce(sum(attempts), 0)::bigint FROM txinbox.outbox",
    )
    .await;
    assert_eq!(attempts, 0, "an outage counts no attempts");
    drain(&relay).await;
    assert_eq!(recorder.ids().len(), 3, "all published once the broker is back");

    // A lone failing row is counted (and here, with one attempt, dead-lettered).
    outbox::write(&pool, &OutboxMessage::new("poison", "t", "x").with_key("p"))
        .await
        .unwrap();
    recorder
        .failing
        .lock()
        .unwrap()
        .insert("poison".into(), Failure::Times(u32::MAX));
    let round = relay.relay_once().await.unwrap();
    assert!(!round.broker_unavailable);
    assert_eq!(round.dead_lettered, 1);
}

/// While the database is unreachable, every connection attempt waits for the pool's acquire
/// timeout; shutdown must not wait for them.
#[tokio::test]
async fn shutdown_is_prompt_while_the_database_is_unreachable() {
    let unreachable: sqlx::postgres::PgConnectOptions =
        "postgres://postgres@127.0.0.1:1/none".parse().unwrap();
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(30))
        .connect_lazy_with(unreachable);
    let relay = Relay::new(pool, Recorder::default(), fast_config()).unwrap();
    let started = Instant::now();
    relay
        .run_until(tokio::time::sleep(Duration::from_millis(200)))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        started.elapsed()
    );
}
