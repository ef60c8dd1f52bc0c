//! The runtime against a real PostgreSQL: races, failures, crashes, outages, ordering,
//! migrations and metrics. Needs `DATABASE_URL` (a role that may create databases);
//! `scripts/test` provides it.

mod batch_model;
mod contention;
mod health;
mod limits;
mod metrics;
mod positions;
mod spans;
mod store_health;
mod support;
mod upgrade;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use txinbox::memory::MemoryBroker;
use txinbox::{message::Headers, Consumer, DeadLetterReason, Error, HandlerError, IdStrategy, RetryPolicy};

use support::{deposit, DepositHandler, PrivateCluster, TestDb};

fn fast_retries() -> RetryPolicy {
    RetryPolicy::default()
        .initial_delay(Duration::from_millis(5))
        .max_delay(Duration::from_millis(20))
}

/// Runs a consumer on `broker` until the broker is drained (the broker must be closed).
async fn drain(name: &str, db: &TestDb, broker: &MemoryBroker, handler: DepositHandler) {
    Consumer::builder(name)
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler)
        .retry_policy(fast_retries())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_deliveries_of_one_id_apply_once() {
    let db = TestDb::new(30).await;
    // The handler keeps its transaction open, so all 20 claims overlap: without the unique-index
    // serialisation each of them would apply the deposit.
    let handler = DepositHandler::default().holding(Duration::from_millis(300));
    let brokers: Vec<MemoryBroker> = (0..20)
        .map(|_| {
            let b = MemoryBroker::new("payments");
            b.publish("evt-1", deposit("alice", 10, "-", 0));
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
    broker.publish_in_lane("l", "evt-1", deposit("alice", 10, "l", 0));
    broker.publish_in_lane("l", "evt-1", deposit("alice", 99, "l", 1));
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
        deposit("alice", 99, "l", 1).into_bytes(),
        "the conflicting payload is kept"
    );
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.reason, DeadLetterReason::Conflict);
}

#[tokio::test]
async fn transient_failures_are_retried_and_counted_without_burning_the_key() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit("alice", 10, "-", 0));
    broker.close();
    let handler = DepositHandler::failing(|_, attempt| {
        (attempt <= 2).then(|| HandlerError::transient(format!("flaky downstream, attempt {attempt}")))
    });
    drain("retries", &db, &broker, handler.clone()).await;

    assert_eq!(db.balance("alice").await, 10);
    assert_eq!(handler.calls(), 3);
    let (status, attempts, last_error): (String, i32, Option<String>) = sqlx::query_as(
        "SELECT status, attempts, last_error FROM txinbox.inbox WHERE consumer = 'retries' AND message_id = 'evt-1'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), attempts), ("processed", 3));
    assert_eq!(last_error.as_deref(), Some("flaky downstream, attempt 2"));
    assert_eq!(broker.stats().retried, 2, "redelivered twice through the broker");
}

#[tokio::test]
async fn exhausted_attempts_are_dead_lettered() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit("alice", 10, "-", 0));
    broker.close();
    let handler = DepositHandler::failing(|_, _| Some(HandlerError::transient("always down")));
    Consumer::builder("exhausted")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler.clone())
        .retry_policy(fast_retries().max_attempts(4))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(handler.calls(), 4);
    let (reason, attempts): (String, i32) =
        sqlx::query_as("SELECT reason, attempts FROM txinbox.dead_letters WHERE consumer = 'exhausted'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((reason.as_str(), attempts), ("attempts_exhausted", 4));
    assert_eq!(
        broker.dead_letters()[0].1.reason,
        DeadLetterReason::AttemptsExhausted
    );
}

#[tokio::test]
async fn permanent_failure_is_dead_lettered_and_its_lane_moves_on() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish_in_lane("l", "poison", deposit("alice", 1, "l", 0));
    broker.publish_in_lane("l", "next", deposit("alice", 5, "l", 1));
    broker.publish_in_lane("l", "garbage", "{not json");
    broker.close();
    let handler = DepositHandler::failing(|m, _| {
        (m.native_id() == Some("poison")).then(|| HandlerError::permanent("account is closed"))
    });
    drain("poison", &db, &broker, handler.clone()).await;

    assert_eq!(
        db.balance("alice").await,
        5,
        "the next message in the lane was applied"
    );
    let rows: Vec<(String, String, String, Vec<u8>)> = sqlx::query_as(
        "SELECT message_id, reason, error, payload FROM txinbox.dead_letters ORDER BY message_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (rows[0].0.as_str(), rows[0].1.as_str()),
        ("garbage", "undecodable")
    );
    assert_eq!(rows[0].3, b"{not json");
    assert_eq!(
        (rows[1].0.as_str(), rows[1].1.as_str()),
        ("poison", "permanent_error")
    );
    assert_eq!(rows[1].2, "account is closed");
    assert_eq!(broker.stats().acked, 1);
    assert_eq!(broker.stats().dead_lettered, 2);

    // A later redelivery of the dead-lettered message (say its broker-side dead-letter copy
    // was never confirmed) goes to the broker's dead-letter destination again, with its
    // recorded reason, without running the handler or recording a second dead letter.
    let again = MemoryBroker::new("payments");
    again.publish_in_lane("l", "poison", deposit("alice", 1, "l", 0));
    again.close();
    let calls = handler.calls();
    drain("poison", &db, &again, handler.clone()).await;
    assert_eq!(handler.calls(), calls);
    assert_eq!((again.stats().acked, again.stats().dead_lettered), (0, 1));
    let (_, resent) = &again.dead_letters()[0];
    assert_eq!(
        (resent.reason, resent.error.as_str()),
        (DeadLetterReason::Permanent, "account is closed")
    );
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 2);
}

#[tokio::test]
async fn a_crash_mid_handler_leaves_nothing_and_the_redelivery_applies_once() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit("alice", 10, "-", 0));
    broker.close();
    let stuck = DepositHandler::default().blocking_forever();
    let entered = stuck.entered.clone();
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
    broker.publish("evt-1", deposit("alice", 10, "-", 0));
    let stuck = DepositHandler::default().blocking_forever();
    let entered = stuck.entered.clone();
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
        let payload = deposit(&account, amount, &lane, i);
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
                broker.publish(format!("evt-{i}"), deposit("alice", 1, "-", i));
                if i % 3 == 0 {
                    // A duplicate of an earlier event, as a producer retry would send.
                    broker.publish(format!("evt-{}", i / 2), deposit("alice", 1, "-", i / 2));
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

#[tokio::test]
async fn graceful_shutdown_settles_everything_it_received() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    for i in 0..50u64 {
        broker.publish(format!("evt-{i}"), deposit("alice", 1, "-", i));
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
async fn in_place_retries_hold_the_lane_and_keep_order() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.set_retry_mode(txinbox::source::RetryMode::InPlace);
    broker.publish_in_lane("p0", "evt-0", deposit("alice", 1, "p0", 0));
    broker.publish_in_lane("p0", "evt-1", deposit("alice", 1, "p0", 1));
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
    assert_eq!(handler.starts.lock().unwrap()["evt-0"], 3);
}

#[tokio::test]
async fn configuration_errors_say_what_to_change() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy(&support::admin_url())
        .unwrap();
    let build = |name: &str, concurrency: usize, id: IdStrategy| {
        Consumer::builder(name)
            .source(MemoryBroker::new("q").source())
            .inbox(txinbox::PostgresInbox::new(pool.clone()))
            .handler(DepositHandler::default())
            .concurrency(concurrency)
            .id_strategy(id)
            .build()
            .unwrap_err()
    };
    let msg = |e: Error| e.to_string();
    assert!(msg(build("bad name; DROP", 1, IdStrategy::Native)).contains("use only A-Z a-z 0-9"));
    assert!(msg(build("", 1, IdStrategy::Native)).contains("1 to 128"));
    assert!(msg(build("ok", 9, IdStrategy::Native)).contains("raise max_connections or lower concurrency"));
    assert!(msg(build("ok", 1, IdStrategy::JsonPointer("id".into()))).contains("start with '/'"));
    let bad_url = txinbox::PostgresInbox::connect("postgres://user:s3cret@127.0.0.1:1/db", 2)
        .await
        .unwrap_err();
    assert!(
        !bad_url.to_string().contains("s3cret"),
        "secrets never appear in errors: {bad_url}"
    );
    let unparsable = txinbox::PostgresInbox::connect("not a url", 2).await.unwrap_err();
    assert!(unparsable.to_string().contains("does not parse"), "{unparsable}");
}

#[tokio::test]
async fn a_missing_schema_stops_the_consumer_with_a_clear_error() {
    let db = TestDb::new(10).await;
    sqlx::query("DROP SCHEMA txinbox CASCADE")
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = MemoryBroker::new("q");
    broker.publish("evt-1", deposit("alice", 1, "-", 0));
    let err = Consumer::builder("nomigrate")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("run txinbox::postgres::migrate"),
        "{err}"
    );
    assert_eq!(broker.stats().acked, 0);
    assert_eq!(broker.pending(), 1, "the message is still there");
}

mod migrations {
    use super::support::TestDb;

    #[tokio::test]
    async fn fresh_install_rerun_and_coexistence_with_the_applications_migrations() {
        let db = TestDb::new(10).await; // fresh database, txinbox migrated once
        let ledger = "SELECT count(*) FROM txinbox._sqlx_migrations";
        let applied = db.scalar(ledger).await;
        assert!(applied >= 1);
        txinbox::postgres::migrate(&db.pool)
            .await
            .expect("re-running is a no-op");
        assert_eq!(db.scalar(ledger).await, applied);

        // The application's own sqlx migrations, in the default public ledger.
        let dir = std::env::temp_dir().join(format!("txinbox-app-migrations-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("1_app.sql"),
            "CREATE TABLE app_orders (id bigint PRIMARY KEY);",
        )
        .unwrap();
        let app = sqlx::migrate::Migrator::new(dir.as_path()).await.unwrap();
        app.run(&db.pool).await.expect("the app migrates beside txinbox");
        txinbox::postgres::migrate(&db.pool)
            .await
            .expect("txinbox still migrates after the app");
        app.run(&db.pool)
            .await
            .expect("the app's migrator does not trip over txinbox's ledger");
        assert_eq!(db.scalar("SELECT count(*) FROM public._sqlx_migrations").await, 1);
        assert_eq!(db.scalar(ledger).await, applied);
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[tokio::test]
async fn a_router_picks_the_handler_by_type_and_dead_letters_what_it_cannot_route() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    let typed = |t: &str| Headers::new().with("ce_type", t.to_owned());
    let payload = |amount| Bytes::from(deposit("alice", amount, "-", 0));
    broker.publish_with(None, Some("e1".into()), typed("deposit"), payload(5));
    broker.publish_with(None, Some("e2".into()), typed("refund"), payload(3));
    broker.publish_with(None, Some("e3".into()), typed("mystery"), payload(1));
    broker.close();
    let (deposits, refunds) = (DepositHandler::default(), DepositHandler::default());
    let router = txinbox::Router::new()
        .on_type("deposit", deposits.clone())
        .on_type("refund", refunds.clone());
    Consumer::builder("router")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(router)
        // One transaction per message: a batch with e3 in it would be re-run without it, and
        // run its neighbours' handlers twice (committed once); these counts are the routing's.
        .batch_size(1)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!((deposits.calls(), refunds.calls()), (1, 1));
    let (id, reason): (String, String) =
        sqlx::query_as("SELECT message_id, reason FROM txinbox.dead_letters")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((id.as_str(), reason.as_str()), ("e3", "no_handler"));
}

mod review_regressions {
    //! Each test here failed before the fix it names.

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use sqlx::Postgres;
    use txinbox::{Context, Handler, Message};

    use super::*;

    /// Ignores a failed statement on its first attempt, which aborts the PostgreSQL
    /// transaction; COMMIT then rolls back without reporting an error.
    struct SwallowsErrors(DepositHandler);

    #[txinbox::async_trait]
    impl Handler<Postgres> for SwallowsErrors {
        async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
            self.0.handle(cx, msg).await?;
            if cx.attempt() == 1 {
                let _ = sqlx::query("SELECT 1 / 0").execute(cx.db()).await; // error ignored
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_handler_that_swallows_a_database_error_is_not_acked_as_processed() {
        let db = TestDb::new(10).await;
        let broker = MemoryBroker::new("payments");
        broker.publish("evt-1", deposit("alice", 10, "-", 0));
        broker.close();
        Consumer::builder("swallow")
            .source(broker.source())
            .inbox(db.inbox())
            .handler(SwallowsErrors(DepositHandler::default()))
            .retry_policy(fast_retries())
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
        assert_eq!(
            db.balance("alice").await,
            10,
            "applied once, by the second attempt"
        );
        let attempts: i32 =
            sqlx::query_scalar("SELECT attempts FROM txinbox.inbox WHERE message_id = 'evt-1'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(attempts, 2);
    }

    #[tokio::test]
    async fn a_constraint_failing_at_commit_is_counted_and_dead_lettered_not_fatal() {
        let db = TestDb::new(10).await;
        sqlx::raw_sql(
            "CREATE TABLE parents (id text PRIMARY KEY);
             CREATE TABLE children (parent text REFERENCES parents DEFERRABLE INITIALLY DEFERRED);",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        struct Orphans(DepositHandler);
        #[txinbox::async_trait]
        impl Handler<Postgres> for Orphans {
            async fn handle(
                &self,
                cx: &mut Context<'_, Postgres>,
                msg: &Message,
            ) -> Result<(), HandlerError> {
                self.0.handle(cx, msg).await?;
                if msg.native_id() == Some("orphan") {
                    // Checked only at COMMIT.
                    sqlx::query("INSERT INTO children VALUES ('nobody')")
                        .execute(cx.db())
                        .await?;
                }
                Ok(())
            }
        }
        let broker = MemoryBroker::new("payments");
        broker.publish_in_lane("l", "orphan", deposit("alice", 1, "l", 0));
        broker.publish_in_lane("l", "fine", deposit("alice", 5, "l", 1));
        broker.close();
        Consumer::builder("deferred")
            .source(broker.source())
            .inbox(db.inbox())
            .handler(Orphans(DepositHandler::default()))
            .retry_policy(fast_retries().max_attempts(3))
            .build()
            .unwrap()
            .run()
            .await
            .expect("a message that cannot commit does not stop the consumer");
        assert_eq!(db.balance("alice").await, 5);
        let (reason, attempts): (String, i32) =
            sqlx::query_as("SELECT reason, attempts FROM txinbox.dead_letters WHERE message_id = 'orphan'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!((reason.as_str(), attempts), ("attempts_exhausted", 3));
    }

    #[tokio::test]
    async fn a_lane_does_not_overtake_a_delivery_left_unsettled_at_shutdown() {
        let db = TestDb::new(10).await;
        let broker = MemoryBroker::new("payments");
        broker.set_retry_mode(txinbox::source::RetryMode::InPlace);
        broker.publish_in_lane("p0", "evt-0", deposit("alice", 1, "p0", 0));
        broker.publish_in_lane("p0", "evt-1", deposit("alice", 1, "p0", 1));
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

    #[tokio::test]
    async fn a_lane_waiting_to_retry_does_not_hold_back_other_lanes() {
        let db = TestDb::new(10).await;
        let broker = MemoryBroker::new("payments");
        broker.set_retry_mode(txinbox::source::RetryMode::InPlace);
        broker.publish_in_lane("a", "a-0", deposit("alice", 1, "a", 0));
        for i in 0..5 {
            broker.publish_in_lane("b", format!("b-{i}"), deposit("bob", 1, "b", i));
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
}

mod batching {
    //! Micro-batching: several messages of a lane in one transaction, with the same outcomes as
    //! one at a time. Each test publishes before the consumer starts and sets a linger, so the
    //! lane's messages are claimed as one batch; `batch_effects.txid` shows which messages
    //! shared a transaction.

    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use sqlx::Postgres;
    use txinbox::{
        handler::BatchContext, handler::BatchHandler, handler::BatchMessage, Context, Handler, Message,
    };

    use super::*;

    type FailFn = dyn Fn(&Message, u32) -> Option<HandlerError> + Send + Sync;

    /// Writes one `batch_effects` row (with its transaction ID) per message, then fails if
    /// `fail` says so: a failing message always leaves a partial effect in its transaction.
    #[derive(Clone)]
    struct Recording {
        fail: Arc<FailFn>,
        /// IDs whose handler ignores a failed statement on attempt 1.
        swallow: Option<&'static str>,
        block_on: Option<&'static str>,
        entered: Arc<tokio::sync::Notify>,
        calls: Arc<AtomicUsize>,
    }

    impl Recording {
        fn new() -> Self {
            Recording {
                fail: Arc::new(|_, _| None),
                swallow: None,
                block_on: None,
                entered: Arc::default(),
                calls: Arc::default(),
            }
        }
        fn failing(f: impl Fn(&Message, u32) -> Option<HandlerError> + Send + Sync + 'static) -> Self {
            Recording {
                fail: Arc::new(f),
                ..Self::new()
            }
        }
    }

    async fn record(conn: &mut sqlx::PgConnection, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO batch_effects (message_id, txid) VALUES ($1, txid_current())")
            .bind(id)
            .execute(conn)
            .await
            .map(drop)
    }

    #[txinbox::async_trait]
    impl Handler<Postgres> for Recording {
        async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let id = cx.message_id().to_string();
            record(cx.db(), &id).await?;
            if self.swallow == Some(id.as_str()) && cx.attempt() == 1 {
                let _ = sqlx::query("SELECT 1 / 0").execute(cx.db()).await; // error ignored
            }
            if self.block_on == Some(id.as_str()) {
                self.entered.notify_one();
                std::future::pending::<()>().await;
            }
            match (self.fail)(msg, cx.attempt()) {
                Some(e) => Err(e),
                None => Ok(()),
            }
        }
    }

    async fn db() -> TestDb {
        let db = TestDb::new(10).await;
        sqlx::raw_sql(
            "CREATE TABLE batch_effects (seq bigserial PRIMARY KEY, message_id text NOT NULL, txid bigint NOT NULL)",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        db
    }

    /// Message ID → (effect rows, transaction IDs).
    async fn effects(db: &TestDb) -> HashMap<String, (usize, Vec<i64>)> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT message_id, txid FROM batch_effects ORDER BY seq")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        let mut map: HashMap<String, (usize, Vec<i64>)> = HashMap::new();
        for (id, txid) in rows {
            let e = map.entry(id).or_default();
            e.0 += 1;
            e.1.push(txid);
        }
        map
    }

    fn consumer<H: Handler<Postgres>>(
        name: &str,
        db: &TestDb,
        broker: &MemoryBroker,
        handler: H,
    ) -> Consumer<txinbox::memory::MemorySource, txinbox::PostgresInbox, H> {
        Consumer::builder(name)
            .source(broker.source())
            .inbox(db.inbox())
            .handler(handler)
            .retry_policy(fast_retries().max_attempts(3))
            .batch_linger(Duration::from_millis(300))
            .build()
            .unwrap()
    }

    /// On the shared queue of unordered deliveries, while a transaction runs, the next one
    /// starts with a full batch, or after a short wait with what is queued: one transaction of
    /// ten messages, not ten of one (several small concurrent transactions cost the database,
    /// and the CPU it shares with the broker, far more per message), and never held behind a
    /// transaction that does not end. Under load the queue fills and they all run.
    #[tokio::test(flavor = "multi_thread")]
    async fn unordered_messages_wait_briefly_for_a_full_batch_while_a_transaction_runs() {
        let db = db().await;
        let broker = MemoryBroker::new("batch");
        let mut handler = Recording::new();
        handler.block_on = Some("first");
        let (calls, entered) = (handler.calls.clone(), handler.entered.clone());
        let consumer = Consumer::builder("fullbatch")
            .source(broker.source())
            .inbox(db.inbox())
            .handler(handler)
            .batch_size(20)
            .build()
            .unwrap();
        let running = tokio::spawn(consumer.run());
        broker.publish("first", "blocks its transaction");
        tokio::time::timeout(Duration::from_secs(10), entered.notified())
            .await
            .expect("the first message's handler runs");
        for i in 0..10 {
            broker.publish(format!("m{i}"), "p");
        }
        let wait_for = |n: usize, what: &'static str| {
            let calls = calls.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while calls.load(Ordering::SeqCst) < n {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "{what}: {} calls",
                        calls.load(Ordering::SeqCst)
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        wait_for(11, "the queued messages do not wait for the blocked transaction").await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let fx = loop {
            let fx = effects(&db).await;
            if fx.len() == 10 || tokio::time::Instant::now() > deadline {
                break fx;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let txids: std::collections::HashSet<i64> = fx.values().flat_map(|(_, t)| t.clone()).collect();
        assert_eq!(
            (fx.len(), txids.len()),
            (10, 1),
            "the 10 messages queued behind a running transaction commit as one: {fx:?}"
        );
        for i in 10..50 {
            broker.publish(format!("m{i}"), "p");
        }
        wait_for(
            51,
            "with full batches queued, more transactions start beside the blocked one",
        )
        .await;
        running.abort();
    }

    #[tokio::test]
    async fn a_failing_message_mid_batch_never_loses_or_duplicates_its_neighbours() {
        let db = db().await;
        let broker = MemoryBroker::new("batch");
        for i in 0..8 {
            broker.publish_in_lane("l", format!("m{i}"), format!("payload {i}"));
        }
        broker.close();
        let handler = Recording::failing(|m, attempt| match m.native_id() {
            Some("m2") => Some(HandlerError::permanent("poison")),
            Some("m5") if attempt == 1 => Some(HandlerError::transient("flaky once")),
            _ => None,
        });
        consumer("midfail", &db, &broker, handler).run().await.unwrap();

        let fx = effects(&db).await;
        for i in [0, 1, 3, 4, 5, 6, 7] {
            assert_eq!(fx[&format!("m{i}")].0, 1, "m{i} applied exactly once: {fx:?}");
        }
        assert!(
            !fx.contains_key("m2"),
            "no partial effect of the failing message committed"
        );
        assert_eq!(
            fx["m0"].1, fx["m1"].1,
            "the messages before the failure committed as one batch"
        );
        let (reason, attempts): (String, i32) =
            sqlx::query_as("SELECT reason, attempts FROM txinbox.dead_letters WHERE message_id = 'm2'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!((reason.as_str(), attempts), ("permanent_error", 1));
        let m5: (String, i32) =
            sqlx::query_as("SELECT status, attempts FROM txinbox.inbox WHERE message_id = 'm5'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!(m5, ("processed".to_string(), 2), "m5 retried once, counted once");
        let stats = broker.stats();
        assert_eq!((stats.acked, stats.dead_lettered, stats.retried), (7, 1, 1));
    }

    #[tokio::test]
    async fn repeats_of_an_id_inside_a_batch_are_duplicates_or_conflicts() {
        let db = db().await;
        let broker = MemoryBroker::new("batch");
        broker.publish_in_lane("l", "a", "pa");
        broker.publish_in_lane("l", "b", "pb");
        broker.publish_in_lane("l", "a", "pa"); // the same ID twice in one batch
        broker.publish_in_lane("l", "c", "pc");
        broker.publish_in_lane("l", "a", "pa"); // and a third time
        broker.publish_in_lane("l", "b", "pb-other"); // same ID, other payload: a conflict
        broker.publish_in_lane("l", "d", "pd");
        broker.close();
        consumer("repeats", &db, &broker, Recording::new())
            .run()
            .await
            .expect("repeated IDs never fail the batch statement");

        let fx = effects(&db).await;
        for id in ["a", "b", "c", "d"] {
            assert_eq!(fx[id].0, 1, "{id} applied exactly once: {fx:?}");
        }
        assert!(
            fx["a"].1 == fx["b"].1 && fx["b"].1 == fx["c"].1,
            "a, b and c shared one transaction: {fx:?}"
        );
        let dups: i64 = sqlx::query_scalar("SELECT duplicates FROM txinbox.inbox WHERE message_id = 'a'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(dups, 2, "both repeats of a counted as duplicates");
        let dead = broker.dead_letters();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].1.reason, DeadLetterReason::Conflict);
        assert_eq!(&dead[0].0.payload()[..], b"pb-other");
        assert_eq!(broker.stats().acked, 6);
    }

    #[tokio::test]
    async fn a_handler_swallowing_a_failed_statement_in_a_batch_gets_nothing_acked_as_processed() {
        let db = db().await;
        let broker = MemoryBroker::new("batch");
        broker.record_acks();
        for i in 0..4 {
            broker.publish_in_lane("l", format!("m{i}"), format!("payload {i}"));
        }
        broker.close();
        let handler = Recording {
            swallow: Some("m1"),
            ..Recording::new()
        };
        consumer("swallow-batch", &db, &broker, handler)
            .run()
            .await
            .unwrap();
        let fx = effects(&db).await;
        for i in 0..4 {
            assert_eq!(fx[&format!("m{i}")].0, 1, "m{i} applied exactly once: {fx:?}");
        }
        let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM txinbox.inbox WHERE message_id = 'm1'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(
            attempts, 2,
            "the aborted attempt of m1 was caught and counted, alone"
        );
        assert_eq!(
            broker.acks().len(),
            4,
            "each message acked once, after its effect committed"
        );
    }

    #[tokio::test]
    async fn a_crash_with_a_batch_open_leaves_nothing_and_the_redelivery_applies_once() {
        let db = db().await;
        let broker = MemoryBroker::new("batch");
        for i in 0..6 {
            broker.publish_in_lane("l", format!("m{i}"), format!("payload {i}"));
        }
        broker.close();
        let stuck = Recording {
            block_on: Some("m3"),
            ..Recording::new()
        };
        let entered = stuck.entered.clone();
        let run = tokio::spawn(consumer("crash-batch", &db, &broker, stuck.clone()).run());
        entered.notified().await; // m0..m3 written in the open batch transaction
        assert_eq!(stuck.calls.load(Ordering::SeqCst), 4, "one batch holds m0..m3");
        run.abort(); // the process "dies" mid-batch
        let _ = run.await;

        let handler = Recording::new();
        consumer("crash-batch", &db, &broker, handler.clone())
            .run()
            .await
            .unwrap();
        let fx = effects(&db).await;
        assert_eq!(fx.len(), 6);
        for i in 0..6 {
            assert_eq!(fx[&format!("m{i}")].0, 1, "m{i} applied exactly once: {fx:?}");
        }
        assert_eq!(
            handler.calls.load(Ordering::SeqCst),
            6,
            "nothing of the crashed batch committed"
        );
        assert_eq!(broker.stats().acked, 6);
        assert!(
            broker.stats().dropped_unsettled >= 6,
            "the crashed batch was not acked"
        );
    }

    /// Adds 1 to the `hot` row named by the payload; the first message of each lane then holds
    /// its transaction a while, so two lanes' batches lock their rows in opposite orders.
    struct Hot;

    #[txinbox::async_trait]
    impl Handler<Postgres> for Hot {
        async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
            let row = std::str::from_utf8(msg.payload()).unwrap().to_owned();
            sqlx::query("UPDATE hot SET n = n + 1 WHERE id = $1")
                .bind(&row)
                .execute(cx.db())
                .await?;
            let id = cx.message_id().to_string();
            record(cx.db(), &id).await?;
            if id.ends_with("-0") {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_deadlock_between_batches_turns_batching_off_for_a_while() {
        let db = db().await;
        sqlx::raw_sql("CREATE TABLE hot (id text PRIMARY KEY, n bigint NOT NULL); INSERT INTO hot VALUES ('A', 0), ('B', 0);")
            .execute(&db.pool)
            .await
            .unwrap();
        let broker = MemoryBroker::new("batch");
        // Lane x locks A then B, lane y B then A: their batches deadlock.
        broker.publish_in_lane("x", "x-0", "A");
        broker.publish_in_lane("x", "x-1", "B");
        broker.publish_in_lane("y", "y-0", "B");
        broker.publish_in_lane("y", "y-1", "A");
        let run = tokio::spawn(consumer("hot", &db, &broker, Hot).run());
        let deadline = Instant::now() + Duration::from_secs(30);
        while db
            .scalar("SELECT count(DISTINCT message_id) FROM batch_effects")
            .await
            < 4
        {
            assert!(Instant::now() < deadline, "the deadlocked batches finish");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Within the cool-down a new lane's messages run one per transaction, although the
        // linger would otherwise gather them into one batch.
        for i in 0..3 {
            broker.publish_in_lane("z", format!("z-{i}"), "A");
        }
        while db
            .scalar("SELECT count(*) FROM batch_effects WHERE message_id LIKE 'z-%'")
            .await
            < 3
        {
            assert!(Instant::now() < deadline, "lane z finishes");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // After the cool-down (5 s) batching grows back, although at size 1 every transaction
        // is a lone message's: w-0 runs alone, the rest of lane w queue up behind it and batch.
        tokio::time::sleep(Duration::from_millis(5500)).await;
        for i in 0..6 {
            broker.publish_in_lane("w", format!("w-{i}"), "A");
        }
        broker.close();
        run.await.unwrap().unwrap();

        let fx = effects(&db).await;
        assert_eq!(fx.len(), 13);
        assert!(fx.values().all(|(n, _)| *n == 1), "each applied once: {fx:?}");
        assert_eq!(db.scalar("SELECT sum(n)::bigint FROM hot").await, 13);
        let z: std::collections::HashSet<i64> = ["z-0", "z-1", "z-2"].iter().map(|id| fx[*id].1[0]).collect();
        assert_eq!(z.len(), 3, "after the deadlock, no batching: {fx:?}");
        let w: std::collections::HashSet<i64> = (0..6).map(|i| fx[&format!("w-{i}")].1[0]).collect();
        assert!(w.len() < 6, "after the cool-down, batching is back: {fx:?}");
    }

    /// One statement for the whole batch; `handle` for messages that travel alone.
    #[derive(Clone, Default)]
    struct Bulk {
        sizes: Arc<Mutex<Vec<usize>>>,
        alone: Arc<AtomicUsize>,
    }

    #[txinbox::async_trait]
    impl Handler<Postgres> for Bulk {
        async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
            self.alone.fetch_add(1, Ordering::SeqCst);
            if msg.payload() == "poison" {
                return Err(HandlerError::permanent("poison"));
            }
            let id = cx.message_id().to_string();
            record(cx.db(), &id).await?;
            Ok(())
        }
        fn batch(&self) -> Option<&dyn BatchHandler<Postgres>> {
            Some(self)
        }
    }

    #[txinbox::async_trait]
    impl BatchHandler<Postgres> for Bulk {
        async fn handle_batch(
            &self,
            cx: &mut BatchContext<'_, Postgres>,
            batch: &[BatchMessage<'_>],
        ) -> Result<(), HandlerError> {
            self.sizes.lock().unwrap().push(batch.len());
            let ids: Vec<&str> = batch.iter().map(|m| m.id().as_str()).collect();
            sqlx::query(
                "INSERT INTO batch_effects (message_id, txid) SELECT id, txid_current() FROM UNNEST($1::text[]) AS id",
            )
            .bind(&ids)
            .execute(cx.db())
            .await?;
            if batch.iter().any(|m| m.message().payload() == "poison") {
                return Err(HandlerError::permanent("a poison message in the batch"));
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_batch_handler_gets_the_new_messages_at_once_and_failures_run_alone() {
        let db = db().await;
        // Unordered deliveries (no lane) batch too.
        let broker = MemoryBroker::new("batch");
        for i in 0..40 {
            broker.publish(format!("u{i}"), format!("payload {i}"));
        }
        broker.publish("u3", "payload 3"); // a duplicate: not given to the batch handler
        broker.close();
        let bulk = Bulk::default();
        Consumer::builder("bulk")
            .source(broker.source())
            .inbox(db.inbox())
            .handler(bulk.clone())
            .concurrency(2)
            .batch_linger(Duration::from_millis(300))
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
        let fx = effects(&db).await;
        assert_eq!(fx.len(), 40);
        assert!(fx.values().all(|(n, _)| *n == 1), "each applied once: {fx:?}");
        let sizes = bulk.sizes.lock().unwrap().clone();
        assert!(
            sizes.iter().any(|&n| n > 1),
            "the batch handler received several messages at once: {sizes:?}"
        );
        assert_eq!(
            sizes.iter().sum::<usize>() + bulk.alone.load(Ordering::SeqCst),
            40,
            "every new message handled once, the duplicate never: {sizes:?}"
        );
        assert_eq!(broker.stats().acked, 41);

        // A failing batch handler: rolled back whole, then each message alone.
        let broker = MemoryBroker::new("batch");
        broker.publish_in_lane("l", "p0", "fine");
        broker.publish_in_lane("l", "p1", "poison");
        broker.publish_in_lane("l", "p2", "fine");
        broker.close();
        let bulk = Bulk::default();
        consumer("bulk-fail", &db, &broker, bulk.clone())
            .run()
            .await
            .unwrap();
        let fx = effects(&db).await;
        assert_eq!(fx["p0"].0, 1);
        assert_eq!(fx["p2"].0, 1);
        assert!(!fx.contains_key("p1"), "nothing of the failed batch stayed");
        assert_eq!(
            *bulk.sizes.lock().unwrap(),
            [3],
            "one batch of three, rolled back"
        );
        assert_eq!(bulk.alone.load(Ordering::SeqCst), 3, "then each message alone");
        assert_eq!(broker.dead_letters()[0].1.reason, DeadLetterReason::Permanent);
    }
}
