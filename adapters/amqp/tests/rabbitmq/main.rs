//! The AMQP adapter against a real RabbitMQ and PostgreSQL: exactly-once effects under
//! duplicates, competing consumers, forced connection closes and a broker restart; delayed
//! retries; dead letters with reason headers.
//!
//! Needs `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`, a role that may create databases) and
//! `rabbitmqctl` as root for the fault-injection tests; `scripts/test` provides them.

mod health;
mod quorum;
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::types::FieldTable;
use txinbox::HandlerError;
use txinbox_amqp::{AmqpConfig, AmqpError, AmqpSource};

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_messages_with_duplicates_and_three_competing_consumers_apply_exactly_once() {
    let _suite = exclusive().await;
    let db = TestDb::new(30).await;
    let queue = TestQueue::new("bulk").await;
    // 10,000 unique IDs; every 5th published twice: 12,000 messages, 20 % duplicate IDs.
    let (messages, total) = deposits("bulk", 10_000, 5);
    assert_eq!(messages.len(), 12_000);
    queue.publish_all(&messages).await;

    let handler = DepositHandler::default();
    let spec = Spec {
        name: "bulk",
        db: &db,
        handler: handler.clone(),
        concurrency: 8,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    let started = Instant::now();
    let mut consumers = Vec::new();
    for i in 0..3 {
        consumers.push(start(&spec, queue.config(32), &probe, i).await);
    }
    // Without faults every delivery is settled exactly once. (~60 s alone; the bound only
    // catches a hang: under nextest the other suites share the two cores, and it took 144 s.)
    wait_until(Duration::from_secs(300), "12,000 deliveries settled", || async {
        probe.get(&probe.settled_ok) >= 12_000
    })
    .await;
    let elapsed = started.elapsed();
    for c in consumers {
        c.stop().await;
    }

    db.assert_exactly_once(10_000).await;
    assert_eq!(
        total_balance(&db).await,
        total,
        "balances add up to the unique deposits"
    );
    // With micro-batching (the default) the handler can run more than once per message: this
    // handler updates shared account rows, so concurrent batches deadlock now and then, and a
    // rolled-back batch runs its handlers again. So count what matters: no call ever saw the
    // message's effect already committed (a duplicate reaching the handler).
    assert!(handler.calls() >= 10_000, "every message was handled");
    assert_eq!(
        handler.after_commit(),
        0,
        "the handler never ran for a message whose effect had committed (a duplicate)"
    );
    let per_consumer: Vec<usize> = (0..3)
        .map(|i| {
            probe
                .receive_times
                .lock()
                .unwrap()
                .iter()
                .filter(|(c, _)| *c == i)
                .count()
        })
        .collect();
    assert!(
        per_consumer.iter().all(|n| *n > 0),
        "all three consumers competed: {per_consumer:?}"
    );
    assert_eq!(probe.get(&probe.settle_failed), 0);
    assert_eq!(queue.ready().await, 0, "the queue is empty at the end");
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 0);
    eprintln!("12,000 deliveries over 3 consumers in {elapsed:?} ({per_consumer:?})");
    queue.delete().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_force_closed_mid_stream_recover_without_restart_and_stay_exactly_once() {
    let _suite = exclusive().await;
    let db = TestDb::new(20).await;
    let queue = TestQueue::new("forced").await;
    let (messages, total) = deposits("forced", 3_000, 5);
    queue.publish_all(&messages).await;

    // Slow enough that the stream is still running when the connections are cut.
    let handler = DepositHandler::default().holding(Duration::from_millis(25));
    let spec = Spec {
        name: "forced",
        db: &db,
        handler: handler.clone(),
        concurrency: 4,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    let a = start(&spec, queue.config(16), &probe, 0).await;
    let b = start(&spec, queue.config(16), &probe, 1).await;

    let mut closes = 0;
    for round in 1..=3 {
        let before = db.scalar("SELECT count(*) FROM effects").await;
        wait_until(
            Duration::from_secs(30),
            "progress before the next forced close",
            || async { db.scalar("SELECT count(*) FROM effects").await >= before + 100 },
        )
        .await;
        let done = db.scalar("SELECT count(*) FROM effects").await;
        assert!(
            done < 3_000,
            "round {round}: the connections are cut mid-stream ({done} done)"
        );
        let closed = tokio::task::spawn_blocking({
            let marker = queue.conn_prefix.clone();
            move || close_connections(&marker)
        })
        .await
        .unwrap();
        assert!(
            closed >= 1,
            "round {round}: found the consumers' connections to close"
        );
        closes += closed;
        // Both sources come back by themselves: same Consumer, same process.
        wait_until(Duration::from_secs(20), "both sources reconnected", || async {
            a.monitor.reconnects() >= round
                && b.monitor.reconnects() >= round
                && a.monitor.is_connected()
                && b.monitor.is_connected()
        })
        .await;
    }
    wait_settled(&db, &queue, &probe, 3_000, Duration::from_secs(90)).await;
    let (ra, rb) = (a.monitor.reconnects(), b.monitor.reconnects());
    a.stop().await;
    b.stop().await;

    db.assert_exactly_once(3_000).await;
    assert_eq!(total_balance(&db).await, total);
    assert_eq!(queue.ready().await, 0, "nothing left in the queue");
    assert!(
        ra >= 3 && rb >= 3,
        "each source reconnected after each close: {ra}, {rb}"
    );
    eprintln!(
        "{closes} connections closed; reconnects {ra} + {rb}; {} settlements failed (stale channel) and were redelivered as duplicates",
        probe.get(&probe.settle_failed)
    );
    queue.delete().await;
    db.drop_db().await;
}

/// Also: the consumers' health reports the broker disconnected (not ready, still alive) while
/// it is stopped, and connected once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_stopped_and_started_mid_stream_recovers_and_stays_exactly_once() {
    let _suite = exclusive().await;
    let db = TestDb::new(20).await;
    let queue = TestQueue::new("restart").await;
    let (messages, total) = deposits("restart", 1_500, 5);
    queue.publish_all(&messages).await;

    let handler = DepositHandler::default().holding(Duration::from_millis(20));
    let spec = Spec {
        name: "restart",
        db: &db,
        handler: handler.clone(),
        concurrency: 4,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    let a = start(&spec, queue.config(16), &probe, 0).await;
    let b = start(&spec, queue.config(16), &probe, 1).await;
    wait_until(
        Duration::from_secs(30),
        "some progress before the restart",
        || async { db.scalar("SELECT count(*) FROM effects").await >= 200 },
    )
    .await;

    let stopped = tokio::task::spawn_blocking(StoppedBroker::stop).await.unwrap();
    let at_stop = db.scalar("SELECT count(*) FROM effects").await;
    assert!(at_stop < 1_500, "the broker stopped mid-stream ({at_stop} done)");
    wait_until(
        Duration::from_secs(10),
        "the sources notice the broker is gone",
        || async { !a.monitor.is_connected() && !b.monitor.is_connected() },
    )
    .await;
    // What an orchestrator sees meanwhile: alive, not ready, because the broker is gone.
    for running in [&a, &b] {
        let report = running.health.report();
        assert_eq!(report.broker, txinbox::health::BrokerStatus::Disconnected);
        assert!(report.is_alive() && !report.is_ready(), "{report:?}");
        assert!(report.problems().contains(&"broker disconnected".to_owned()));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    tokio::task::spawn_blocking(move || stopped.start())
        .await
        .unwrap();

    wait_until(Duration::from_secs(30), "both sources reconnected", || async {
        a.monitor.is_connected() && b.monitor.is_connected()
    })
    .await;
    for running in [&a, &b] {
        let report = running.health.report();
        assert_eq!(report.broker, txinbox::health::BrokerStatus::Connected);
    }
    wait_settled(&db, &queue, &probe, 1_500, Duration::from_secs(90)).await;
    let (ra, rb) = (a.monitor.reconnects(), b.monitor.reconnects());
    a.stop().await;
    b.stop().await;

    db.assert_exactly_once(1_500).await;
    assert_eq!(total_balance(&db).await, total);
    assert_eq!(queue.ready().await, 0, "nothing left in the queue");
    assert!(ra >= 1 && rb >= 1, "both sources reconnected: {ra}, {rb}");
    queue.delete().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failure_is_retried_after_its_delay_and_permanent_one_is_dead_lettered() {
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("retry").await;
    const DELAY: Duration = Duration::from_millis(1500);
    let handler = DepositHandler::failing(|m, attempt| match m.native_id() {
        Some("flaky") if attempt == 1 => Some(HandlerError::transient("downstream busy").retry_after(DELAY)),
        Some("poison") => Some(HandlerError::permanent("account is closed")),
        _ => None,
    });
    let spec = Spec {
        name: "retry",
        db: &db,
        handler: handler.clone(),
        concurrency: 4,
        // A requested delay is honoured up to max_delay.
        retry: fast_retries().max_delay(DELAY * 2),
    };
    let probe = Arc::new(Probe::default());
    let consumer = start(&spec, queue.config(8), &probe, 0).await;
    // The retry queue dead-letters back at least once, which only a quorum queue does.
    let listed = std::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-q", "name", "type", "arguments"])
        .output()
        .expect("rabbitmqctl");
    let listed = String::from_utf8_lossy(&listed.stdout);
    let retry_line = listed
        .lines()
        .find(|l| l.starts_with(&format!("{}.retry\t", queue.name)))
        .unwrap_or_else(|| panic!("no retry queue in {listed}"));
    assert!(
        retry_line.contains("quorum") && retry_line.contains("at-least-once"),
        "{retry_line}"
    );
    queue
        .publish_all(&[
            (Some("flaky".into()), deposit("alice", 10)),
            (Some("poison".into()), deposit("bob", 99)),
            (Some("fine".into()), deposit("carol", 1)),
        ])
        .await;

    wait_settled(&db, &queue, &probe, 2, Duration::from_secs(30)).await;
    consumer.stop().await;

    let starts = handler.starts_of("flaky");
    assert_eq!(starts.len(), 2, "one failure, one retry: {starts:?}");
    let gap = starts[1].at - starts[0].at;
    assert!(gap >= DELAY, "the retry waited its delay: {gap:?} < {DELAY:?}");
    assert!(
        gap < DELAY + Duration::from_secs(10),
        "and did not wait far longer: {gap:?}"
    );
    assert_eq!(
        (starts[0].attempt, starts[1].attempt),
        (1, 2),
        "attempts counted in Postgres"
    );
    assert_eq!(starts[0].headers.get_str(txinbox_amqp::headers::RETRY), None);
    assert_eq!(
        starts[1].headers.get_str(txinbox_amqp::headers::RETRY),
        Some("1"),
        "the retry copy is marked"
    );
    assert_eq!(db.balance("alice").await, 10, "the retried deposit applied once");
    assert_eq!(db.balance("carol").await, 1);
    assert_eq!(db.balance("bob").await, 0, "the poison message had no effect");
    // Its handler may run twice (a batch it was in is re-run without it, and it runs alone
    // once more, on a clean transaction), but never as a second attempt.
    let poison = handler.starts_of("poison");
    assert!(
        !poison.is_empty() && poison.iter().all(|s| s.attempt == 1),
        "a permanent failure is not retried: {poison:?}"
    );

    let dlq = queue.drain_dlq().await;
    assert_eq!(
        dlq.len(),
        1,
        "exactly the poison message is dead-lettered: {dlq:?}"
    );
    let (id, headers) = &dlq[0];
    assert_eq!(id.as_deref(), Some("poison"), "the message ID is kept");
    assert_eq!(
        headers.get("x-txinbox-reason").map(String::as_str),
        Some("permanent_error")
    );
    assert_eq!(
        headers.get("x-txinbox-error").map(String::as_str),
        Some("account is closed")
    );
    assert_eq!(
        headers.get("x-txinbox-original-queue").map(String::as_str),
        Some(queue.name.as_str())
    );
    let (reason,): (String,) =
        sqlx::query_as("SELECT reason FROM txinbox.dead_letters WHERE message_id = 'poison'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(reason, "permanent_error", "recorded in the database too");
    assert_eq!(queue.stats_of(&format!("{}.retry", queue.name)).await.0, 0);
    assert_eq!(queue.ready().await, 0);
    queue.delete().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_id_delivered_to_two_consumers_at_the_same_time_has_one_effect() {
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("race").await;
    // The handler keeps its transaction open, so the second claim blocks on the unique index
    // until the first commits, and then finds a duplicate.
    const HOLD: Duration = Duration::from_millis(800);
    let handler = DepositHandler::default().holding(HOLD);
    let spec = Spec {
        name: "race",
        db: &db,
        handler: handler.clone(),
        concurrency: 1,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    let a = start(&spec, queue.config(1), &probe, 0).await;
    let b = start(&spec, queue.config(1), &probe, 1).await;
    wait_until(Duration::from_secs(10), "both consumers registered", || async {
        queue.stats_of(&queue.name).await.1 == 2
    })
    .await;
    let payload = deposit("alice", 10);
    queue
        .publish_all(&[
            (Some("evt-1".into()), payload.clone()),
            (Some("evt-1".into()), payload),
        ])
        .await;
    wait_until(Duration::from_secs(20), "both deliveries settled", || async {
        probe.get(&probe.settled_ok) == 2
    })
    .await;
    a.stop().await;
    b.stop().await;

    let times = probe.receive_times.lock().unwrap().clone();
    assert_eq!(times.len(), 2);
    assert_ne!(times[0].0, times[1].0, "each consumer got one copy");
    let apart = if times[0].1 > times[1].1 {
        times[0].1 - times[1].1
    } else {
        times[1].1 - times[0].1
    };
    assert!(apart < HOLD, "the two deliveries overlapped ({apart:?} apart)");
    assert_eq!(db.balance("alice").await, 10, "the deposit applied once");
    db.assert_exactly_once(1).await;
    assert_eq!(handler.calls(), 1, "the duplicate never ran the handler");
    assert_eq!(queue.ready().await, 0);
    queue.delete().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_without_id_is_dead_lettered_as_missing_id_and_the_queue_keeps_flowing() {
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("noid").await;
    let handler = DepositHandler::default();
    let spec = Spec {
        name: "noid",
        db: &db,
        handler: handler.clone(),
        concurrency: 2,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    let consumer = start(&spec, queue.config(8), &probe, 0).await;
    queue
        .publish_all(&[
            (Some("a".into()), deposit("alice", 1)),
            (None, deposit("alice", 100)),
            (Some("c".into()), deposit("alice", 2)),
        ])
        .await;
    wait_settled(&db, &queue, &probe, 2, Duration::from_secs(20)).await;
    consumer.stop().await;

    assert_eq!(
        db.balance("alice").await,
        3,
        "the messages around it were processed"
    );
    assert_eq!(handler.calls(), 2, "the handler never saw the message without ID");
    let dlq = queue.drain_dlq().await;
    assert_eq!(dlq.len(), 1, "{dlq:?}");
    assert_eq!(dlq[0].0, None);
    assert_eq!(
        dlq[0].1.get("x-txinbox-reason").map(String::as_str),
        Some("missing_id")
    );
    assert!(dlq[0].1["x-txinbox-error"].contains("native"), "{:?}", dlq[0].1);
    assert_eq!(queue.ready().await, 0);
    queue.delete().await;
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_side_consumer_cancel_is_recovered_by_resubscribing() {
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("cancel").await;
    let spec = Spec {
        name: "cancel",
        db: &db,
        handler: DepositHandler::default(),
        concurrency: 2,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    let consumer = start(&spec, queue.config(8), &probe, 0).await;
    queue
        .publish_all(&[(Some("before".into()), deposit("alice", 1))])
        .await;
    wait_settled(&db, &queue, &probe, 1, Duration::from_secs(20)).await;

    // Deleting the queue makes the broker send basic.cancel: the consumer stream ends. The
    // supervisor re-declares the queue and consumes again.
    {
        let conn = lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.queue_delete(queue.name.as_str().into(), Default::default())
            .await
            .unwrap();
        let _ = conn.close(200, "done".into()).await;
    }
    wait_until(Duration::from_secs(20), "the source resubscribed", || async {
        consumer.monitor.reconnects() >= 1 && consumer.monitor.is_connected()
    })
    .await;
    queue
        .publish_all(&[(Some("after".into()), deposit("alice", 2))])
        .await;
    wait_settled(&db, &queue, &probe, 2, Duration::from_secs(20)).await;
    consumer.stop().await;
    assert_eq!(db.balance("alice").await, 3);
    queue.delete().await;
    db.drop_db().await;
}

#[tokio::test]
async fn bad_credentials_fail_at_connect_without_leaking_the_password() {
    let _suite = shared().await;
    let url = amqp_url().replacen("guest:guest@", "guest:wr0ng-s3cret@", 1);
    if url == amqp_url() {
        return; // a custom AMQP_URL without the default credentials: nothing to corrupt
    }
    let err = AmqpSource::connect(AmqpConfig::new(url, unique("creds")))
        .await
        .expect_err("wrong password is refused");
    assert!(matches!(err, AmqpError::Broker { .. }), "{err:?}");
    assert!(err.is_fatal(), "retrying cannot fix credentials: {err}");
    assert!(!format!("{err} {err:?}").contains("wr0ng-s3cret"), "{err:?}");
    let invalid = AmqpSource::connect(AmqpConfig::new(amqp_url(), "q").prefetch(0))
        .await
        .expect_err("invalid config");
    assert!(matches!(invalid, AmqpError::Config(_)) && invalid.is_fatal());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_retry_copy_leaves_the_original_unacked_and_requeues_it_after_a_delay() {
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("noretryq").await;
    // A broken topology: the retry queue is missing and the source does not declare it.
    {
        let conn = lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.queue_delete(
            format!("{}.retry", queue.name).as_str().into(),
            Default::default(),
        )
        .await
        .unwrap();
        let _ = conn.close(200, "done".into()).await;
    }
    const REQUEUE: Duration = Duration::from_millis(400);
    let handler = DepositHandler::failing(|_, attempt| {
        (attempt == 1)
            .then(|| HandlerError::transient("downstream busy").retry_after(Duration::from_millis(50)))
    });
    let spec = Spec {
        name: "noretryq",
        db: &db,
        handler: handler.clone(),
        concurrency: 2,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    let config = queue.config(4).declare_topology(false).requeue_delay(REQUEUE);
    let consumer = start(&spec, config, &probe, 0).await;
    queue
        .publish_all(&[(Some("flaky".into()), deposit("alice", 7))])
        .await;
    wait_settled(&db, &queue, &probe, 1, Duration::from_secs(20)).await;
    consumer.stop().await;

    let starts = handler.starts_of("flaky");
    assert_eq!(starts.len(), 2, "{starts:?}");
    let gap = starts[1].at - starts[0].at;
    assert!(
        gap >= REQUEUE,
        "requeued after requeue_delay, not at once: {gap:?}"
    );
    assert_eq!(
        starts[1].headers.get_str(txinbox_amqp::headers::RETRY),
        None,
        "the second attempt is the original, requeued"
    );
    assert_eq!(
        probe.get(&probe.settle_failed),
        1,
        "the unconfirmed retry copy failed the settlement"
    );
    assert_eq!(db.balance("alice").await, 7);
    db.assert_exactly_once(1).await;
    assert_eq!(queue.ready().await, 0);
    queue.delete().await;
    db.drop_db().await;
}

/// A dead-letter queue that refuses writes (full, `x-overflow = reject-publish`): the dead letter
/// is recorded once in the database, the original is requeued after `requeue_delay` and
/// dead-lettered again until the queue takes it; good messages behind it flow meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_queue_that_refuses_writes_holds_only_its_message_and_takes_it_once_fixed() {
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("fulldlq").await;
    let dlq = format!("{}.dlq", queue.name);
    let redeclare = |args: FieldTable| {
        let dlq = dlq.clone();
        async move {
            let conn = lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                .await
                .unwrap();
            let ch = conn.create_channel().await.unwrap();
            ch.queue_delete(dlq.as_str().into(), Default::default())
                .await
                .unwrap();
            ch.queue_declare(
                dlq.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .unwrap();
            let _ = conn.close(200, "done".into()).await;
        }
    };
    let mut full = FieldTable::default();
    full.insert("x-max-length".into(), lapin::types::AMQPValue::LongLongInt(0));
    full.insert(
        "x-overflow".into(),
        lapin::types::AMQPValue::LongString("reject-publish".into()),
    );
    redeclare(full).await;

    const REQUEUE: Duration = Duration::from_millis(300);
    let spec = Spec {
        name: "fulldlq",
        db: &db,
        handler: DepositHandler::default(),
        concurrency: 2,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    let config = queue.config(4).declare_topology(false).requeue_delay(REQUEUE);
    let consumer = start(&spec, config, &probe, 0).await;
    queue
        .publish_all(&[
            (Some("poison".into()), "not json".into()),
            (Some("good-1".into()), deposit("alice", 5)),
            (Some("good-2".into()), deposit("alice", 6)),
        ])
        .await;
    // The good messages behind the poison one are applied while the queue refuses its copy.
    let started = Instant::now();
    while db.balance("alice").await != 11 {
        assert!(started.elapsed() < Duration::from_secs(20), "good messages held");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    while probe.get(&probe.settle_failed) < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the refused copy is tried again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox.dead_letters").await,
        1,
        "recorded once, however often it is tried"
    );
    assert_eq!(queue.stats_of(&dlq).await.0, 0, "the full queue took nothing");

    // Fixed: the next try lands, once.
    redeclare(FieldTable::default()).await;
    while queue.stats_of(&dlq).await.0 == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the copy reaches the fixed queue"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(REQUEUE * 3).await;
    consumer.stop().await;
    let copies = queue.drain_dlq().await;
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert_eq!(copies[0].0.as_deref(), Some("poison"));
    assert_eq!(queue.ready().await, 0);
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 1);
    queue.delete().await;
    db.drop_db().await;
}

/// The size of the content-header frame that carries `properties`, as lapin writes it:
/// frame header (7) + class, weight and body size (12) + properties + frame end (1).
fn header_frame_len(properties: &lapin::BasicProperties) -> usize {
    let written = lapin::protocol::basic::gen_properties::<Vec<u8>>(properties)(Vec::new().into())
        .expect("serialize the properties");
    20 + written.position as usize
}

/// Headers whose content-header frame, with message ID `id`, is exactly `target` bytes:
/// `count` headers `h-0000`…, their long-string values padded to fill the rest.
fn headers_filling(id: &str, target: usize, count: usize) -> FieldTable {
    use lapin::types::{AMQPValue, LongString};
    let build = |pad: usize| {
        let mut t = FieldTable::default();
        for i in 0..count {
            let len = pad / count + usize::from(i < pad % count);
            t.insert(
                format!("h-{i:04}").into(),
                AMQPValue::LongString(LongString::from("x".repeat(len))),
            );
        }
        t
    };
    let props = |t: FieldTable| {
        lapin::BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(id.into())
            .with_headers(t)
    };
    let empty = header_frame_len(&props(build(0)));
    let table = build(target - empty);
    assert_eq!(header_frame_len(&props(table.clone())), target);
    table
}

/// A third-party message whose header table is within a few hundred bytes of the connection's
/// `frame_max`: the dead-letter copy's `x-txinbox-*` headers must not push its content-header
/// frame over the limit (the broker closes the connection with FRAME_ERROR, the message goes
/// back to the head of the queue, for ever). The copy is cut to fit, the queue behind it flows,
/// the connection is never lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_headers_nearly_fill_a_frame_is_dead_lettered_without_a_reconnect() {
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("bighead").await;
    let frame_max = {
        let conn = lapin::Connection::connect(&amqp_url(), Default::default())
            .await
            .unwrap();
        let f = conn.configuration().frame_max() as usize;
        let _ = conn.close(200, "done".into()).await;
        f
    };
    assert!(frame_max >= 4096, "negotiated frame_max {frame_max}");
    let handler = DepositHandler::failing(|m, attempt| match m.native_id() {
        Some("tight-flaky") if attempt == 1 => Some(HandlerError::transient("downstream busy")),
        _ => None,
    });
    let spec = Spec {
        name: "bighead",
        db: &db,
        handler: handler.clone(),
        concurrency: 4,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    let consumer = start(&spec, queue.config(16), &probe, 0).await;

    // Two undecodable messages, 64 bytes short of the limit: one long header value, many
    // small headers. A valid one 8 bytes short that fails once (its retry copy adds a header
    // and an expiration).
    queue
        .publish_with_headers(
            "poison-long",
            b"not json",
            headers_filling("poison-long", frame_max - 64, 1),
        )
        .await;
    queue
        .publish_with_headers(
            "poison-many",
            b"not json either",
            headers_filling("poison-many", frame_max - 64, 1500),
        )
        .await;
    queue
        .publish_with_headers(
            "tight-flaky",
            deposit("dora", 7).as_bytes(),
            headers_filling("tight-flaky", frame_max - 8, 1),
        )
        .await;
    const GOOD: i64 = 300;
    let good: Vec<(Option<String>, String)> = (0..GOOD)
        .map(|i| (Some(format!("good-{i}")), deposit(&format!("acct-{}", i % 5), 1)))
        .collect();
    queue.publish_all(&good).await;

    let started = Instant::now();
    loop {
        let applied = total_balance(&db).await;
        if applied == GOOD + 7 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{applied} of {} deposited after 30 s, {} reconnects",
            GOOD + 7,
            consumer.monitor.reconnects()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = started.elapsed();
    wait_until(
        Duration::from_secs(15),
        "both copies in the dead-letter queue",
        || async { queue.stats_of(&format!("{}.dlq", queue.name)).await.0 == 2 },
    )
    .await;
    let reconnects = consumer.monitor.reconnects();
    consumer.stop().await;

    assert_eq!(reconnects, 0, "a copy never costs the connection");
    assert_eq!(db.balance("dora").await, 7, "the tight message's retry worked");
    let attempts: Vec<u32> = handler
        .starts_of("tight-flaky")
        .iter()
        .map(|s| s.attempt)
        .collect();
    assert_eq!(attempts.last(), Some(&2), "retried once: {attempts:?}");
    assert_eq!(queue.ready().await, 0);
    let mut dlq = queue.drain_dlq().await;
    dlq.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(dlq.len(), 2, "{:?}", dlq.iter().map(|d| &d.0).collect::<Vec<_>>());
    for ((id, headers), name) in dlq.iter().zip(["poison-long", "poison-many"]) {
        assert_eq!(id.as_deref(), Some(name));
        assert_eq!(
            headers.get("x-txinbox-reason").map(String::as_str),
            Some("undecodable")
        );
        assert_eq!(
            headers.get("x-txinbox-headers").map(String::as_str),
            Some("omitted"),
            "{name}: the original headers were cut"
        );
        assert!(!headers.contains_key("h-0000"), "{name}");
        let (size, sha256): (i64, String) = sqlx::query_as(
            "SELECT payload_size, encode(payload_sha256, 'hex') FROM txinbox.dead_letters WHERE message_id = $1",
        )
        .bind(name)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            headers.get("x-txinbox-original-size"),
            Some(&size.to_string()),
            "{name}"
        );
        assert_eq!(headers.get("x-txinbox-original-sha256"), Some(&sha256), "{name}");
    }
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 2);
    eprintln!("{GOOD} good deposits applied in {took:?}");
    queue.delete().await;
    db.drop_db().await;
}

/// A dead-letter copy the broker refuses with a channel error (here `ACCESS_REFUSED`: the
/// consumer's user may not write) closes only the channel copies go on: the consumer keeps its
/// connection and channel, the good messages are applied and acked, and the refused message
/// alone waits, requeued after `requeue_delay`, as with a dead-letter queue that nacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_refused_with_a_channel_error_costs_neither_the_consumer_nor_its_queue() {
    let _suite = shared().await;
    let db = TestDb::new(10).await;
    let queue = TestQueue::new("refused").await;
    let user = ReadOnlyUser::create();
    const REQUEUE: Duration = Duration::from_millis(300);
    let spec = Spec {
        name: "refused",
        db: &db,
        handler: DepositHandler::default(),
        concurrency: 4,
        retry: fast_retries(),
    };
    let probe = Arc::new(Probe::default());
    // The queues exist already (TestQueue); this user may not declare them.
    let config = AmqpConfig::new(user.uri.clone(), &queue.name)
        .prefetch(16)
        .connection_name(unique(&queue.conn_prefix))
        .reconnect_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .publish_timeout(Duration::from_secs(5))
        .declare_topology(false)
        .requeue_delay(REQUEUE);
    let consumer = start(&spec, config, &probe, 0).await;
    queue
        .publish_all(&[(Some("poison".into()), "not json".into())])
        .await;
    const GOOD: i64 = 200;
    let good: Vec<(Option<String>, String)> = (0..GOOD)
        .map(|i| (Some(format!("good-{i}")), deposit(&format!("acct-{}", i % 5), 1)))
        .collect();
    queue.publish_all(&good).await;

    let started = Instant::now();
    loop {
        let applied = total_balance(&db).await;
        let refused = probe.get(&probe.settle_failed);
        if applied == GOOD && refused >= 3 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{applied} of {GOOD} deposited and {refused} refused copies after 30 s, {} reconnects",
            consumer.monitor.reconnects()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reconnects = consumer.monitor.reconnects();
    consumer.stop().await;

    assert_eq!(
        reconnects, 0,
        "a refused copy never costs the consumer's connection"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox.dead_letters").await,
        1,
        "recorded once, however often its copy is refused"
    );
    assert_eq!(queue.stats_of(&format!("{}.dlq", queue.name)).await.0, 0);
    assert_eq!(
        queue.ready().await,
        1,
        "the refused message is still in its queue"
    );
    drop(user);
    queue.delete().await;
    db.drop_db().await;
}
