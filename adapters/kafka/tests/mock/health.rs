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
