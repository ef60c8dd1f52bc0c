//! What the Kafka source tells the consumer's health and the lag gauge: the assigned
//! partitions, the broker connection, and per partition the high watermark minus the database
//! position.

use txinbox::health::BrokerStatus;
use txinbox_kafka::{telemetry, KafkaSource};

use super::metrics::{gauge_mark, gauge_values, install};
use super::*;

/// Handlers blocked on row locks hold every partition: the lag gauge shows what waits per
/// partition (the whole partition: nothing is in the database yet), the report lists both
/// partitions as assigned and the broker as connected. With the broker down the report says
/// disconnected (not ready, still alive), and connected once it is back. Once the locks go,
/// everything is applied and the lag falls to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lag_and_assignment_are_reported() {
    install();
    let (mock, topic) = setup_topic("health-lag", 2);
    let db = TestDb::new().await;
    for i in 0..7 {
        sqlx::query("INSERT INTO accounts (id, balance) VALUES ($1, 0)")
            .bind(format!("acct-{i}"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("SELECT * FROM accounts FOR UPDATE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let published = Producer::new(&mock.bootstrap)
        .deposits(&topic, 2, "lag", 14, 0)
        .await;

    let inbox = db.inbox();
    let config = kafka_config(&mock.bootstrap, "g-health-lag", &topic).set("statistics.interval.ms", "200");
    let source = KafkaSource::new(config).unwrap();
    let consumer = txinbox::Consumer::builder(CONSUMER)
        .source(source)
        .inbox(inbox)
        .handler(DepositHandler::default().tagged(1))
        .concurrency(4)
        .build()
        .unwrap();
    let health = consumer.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    let lag_seen = |partition: &str, mark: usize| {
        gauge_values(
            telemetry::LAG,
            &[("topic", &topic), ("partition", partition)],
            mark,
        )
    };
    let start = gauge_mark();
    wait_for(
        Duration::from_secs(30),
        "a lag of 7 on both partitions",
        || async { lag_seen("0", start).contains(&7.0) && lag_seen("1", start).contains(&7.0) },
    )
    .await;
    let report = health.report();
    let lanes = vec![format!("{topic}/0"), format!("{topic}/1")];
    assert_eq!(report.assigned.as_ref(), Some(&lanes), "{report:#?}");
    assert_eq!(report.broker, BrokerStatus::Connected);
    assert!(report.is_ready(), "{:?}", report.problems());
    assert!(
        report
            .lanes
            .iter()
            .any(|l| l.unsettled > 0 && l.oldest_unsettled.is_some()),
        "{report:#?}"
    );

    // The broker goes away: the report says so (and not ready) from the next statistics on;
    // it comes back: connected and ready again.
    mock.call(|d| Command::BrokerDown(1, d));
    wait_for(
        Duration::from_secs(30),
        "the broker is reported disconnected",
        || async { health.report().broker == BrokerStatus::Disconnected },
    )
    .await;
    let report = health.report();
    assert!(!report.is_ready() && report.is_alive(), "{report:#?}");
    assert!(report.problems().contains(&"broker disconnected".to_owned()));
    mock.call(|d| Command::BrokerUp(1, d));
    wait_for(
        Duration::from_secs(30),
        "the broker is reported connected again",
        || async {
            let report = health.report();
            report.broker == BrokerStatus::Connected && report.is_ready()
        },
    )
    .await;

    lock.rollback().await.unwrap();
    db.wait_applied(published.amounts.len() as i64, Duration::from_secs(30))
        .await;
    // Statistics come every 200 ms: over 2 s after everything is applied (and the position
    // stored), no partition shows a lag.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let drained = gauge_mark();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for partition in ["0", "1"] {
        let seen = lag_seen(partition, drained);
        assert!(seen.iter().all(|v| *v == 0.0), "partition {partition}: {seen:?}");
    }
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    drop(mock);
}

/// The rebalance callback waits while the inbox database refuses connections (recording the
/// group and loading the positions retry, fail closed): nothing of the assignment is consumed,
/// so the consumer is not ready, and the report says why. Once the database takes connections
/// again, the assignment completes and the consumer is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_assignment_waiting_for_the_database_is_not_ready() {
    use sqlx::postgres::{PgPool, PgPoolOptions};
    let (mock, topic) = setup_topic("health-db-wait", 2);
    let db = TestDb::new().await;
    let published = Producer::new(&mock.bootstrap)
        .deposits(&topic, 2, "w", 6, 0)
        .await;
    // The scratch database refuses new connections and loses the ones it had.
    let server = PgPool::connect(&txinbox_testing::database::server_url())
        .await
        .unwrap();
    let allow = |on: bool| format!("ALTER DATABASE {} ALLOW_CONNECTIONS {on}", db.name);
    sqlx::query(sqlx::AssertSqlSafe(allow(false)))
        .execute(&server)
        .await
        .unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(&db.name)
    .execute(&server)
    .await
    .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&db.url)
        .unwrap();
    let consumer = txinbox::Consumer::builder(CONSUMER)
        .source(KafkaSource::new(kafka_config(&mock.bootstrap, "g-health-db-wait", &topic)).unwrap())
        .inbox(txinbox::PostgresInbox::new(pool))
        .handler(DepositHandler::default().tagged(1))
        .concurrency(2)
        .build()
        .unwrap();
    let health = consumer.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));

    let named = |r: &txinbox::health::HealthReport| {
        r.problems()
            .iter()
            .any(|p| p.contains("assignment waits for the inbox database") && p.contains(&topic))
    };
    let started = std::time::Instant::now();
    while !named(&health.report()) {
        let report = health.report();
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the waiting assignment is not reported: ready {}, problems {:?}",
            report.is_ready(),
            report.problems()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = health.report();
    assert!(!report.is_ready() && report.is_alive(), "{report:#?}");

    sqlx::query(sqlx::AssertSqlSafe(allow(true)))
        .execute(&server)
        .await
        .unwrap();
    db.wait_applied(published.amounts.len() as i64, Duration::from_secs(60))
        .await;
    wait_for(
        Duration::from_secs(30),
        "ready once the assignment completed",
        || async { health.report().is_ready() },
    )
    .await;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// A dead-letter topic the broker says does not exist is found when the source starts, not
/// when the first bad record waits for it: the consumer is not ready and the problem names the
/// topic. Once the topic exists, the consumer is ready again without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_missing_dead_letter_topic_is_reported_at_start() {
    use rdkafka::types::RDKafkaRespErr;
    let (mock, topic) = setup_topic("health-dlq-missing", 1);
    let dlq = format!("{topic}.dlq");
    // What a broker that does not create topics answers for one that does not exist.
    mock.call(|d| {
        Command::TopicError(
            dlq.clone(),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART,
            d,
        )
    });
    let db = TestDb::new().await;
    let running = Running::start(
        &db,
        kafka_config(&mock.bootstrap, "g-health-dlq-missing", &topic),
        DepositHandler::default().tagged(1),
    );
    let report = running
        .wait_health(
            Duration::from_secs(30),
            "a problem names the missing dead-letter topic",
            |r| {
                r.problems()
                    .iter()
                    .any(|p| p.contains(&dlq) && p.contains("does not exist"))
            },
        )
        .await;
    assert!(!report.is_ready(), "{report:#?}");

    mock.call(|d| Command::TopicError(dlq.clone(), RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR, d));
    running
        .wait_health(Duration::from_secs(30), "ready once the topic exists", |r| {
            r.is_ready()
        })
        .await;
    running.stop().await;
}
