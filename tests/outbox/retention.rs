//! Retention of published rows, and the backlog gauges while it runs.

use std::time::{Duration, Instant};

use txinbox::outbox::{self, OutboxMessage, Relay};

use crate::support::*;

#[tokio::test]
async fn retention_removes_only_old_published_rows_and_gauges_report_the_backlog() {
    let pool = test_db().await;
    for i in 0..25 {
        outbox::write(&pool, &OutboxMessage::new(format!("m-{i}"), "t", "x"))
            .await
            .unwrap();
    }
    let recorder = Recorder::default();
    // The retention metrics, read from a recorder local to this thread.
    let metrics = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = metrics.snapshotter();
    let _guard = metrics::set_default_local_recorder(&metrics);
    let relay = Relay::new(
        pool.clone(),
        recorder.clone(),
        fast_config()
            .retention(Duration::from_secs(3600))
            .retention_schedule(Duration::from_secs(60), 4),
    )
    .unwrap();
    // Backlog before publishing: 25 pending, the oldest aged.
    sqlx::query(
        "UPDATE txinbox.outbox SET created_at = now() - interval '90 seconds' WHERE message_id = 'm-0'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let backlog = relay.refresh_metrics().await.unwrap();
    assert_eq!(backlog.pending, 25);
    assert!(
        backlog.oldest_pending_age >= Duration::from_secs(89),
        "{backlog:?}"
    );

    drain(&relay).await;
    // 10 published long ago, 15 recently; one pending row also old.
    sqlx::query(
        "UPDATE txinbox.outbox SET published_at = now() - interval '2 hours'
         WHERE message_id IN (SELECT message_id FROM txinbox.outbox ORDER BY id LIMIT 10)",
    )
    .execute(&pool)
    .await
    .unwrap();
    outbox::write(&pool, &OutboxMessage::new("still-pending", "t", "x"))
        .await
        .unwrap();
    sqlx::query("UPDATE txinbox.outbox SET created_at = now() - interval '3 hours' WHERE message_id = 'still-pending'")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        relay.purge_published().await.unwrap(),
        10,
        "in batches of 4: 4 + 4 + 2"
    );
    let counts = status_counts(&pool).await;
    assert_eq!(counts.get("published"), Some(&15));
    assert_eq!(
        counts.get("pending"),
        Some(&1),
        "retention never deletes pending rows"
    );
    let backlog = relay.refresh_metrics().await.unwrap();
    assert_eq!(backlog.pending, 1);
    assert!(backlog.oldest_pending_age >= Duration::from_secs(3 * 3600 - 1));

    // The janitor's metrics, labelled with the table and the relay.
    use metrics_util::debugging::DebugValue;
    let (mut deleted, mut deletes, mut oldest) = (0, 0, None);
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let labels: Vec<(String, String)> = key
            .key()
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        assert!(
            !key.key().name().starts_with("txinbox_retention_")
                || labels.contains(&("table".into(), "outbox".into()))
                    && labels.iter().any(|(k, _)| k == "relay"),
            "{key:?}"
        );
        match (key.key().name(), value) {
            ("txinbox_retention_deleted_total", DebugValue::Counter(c)) => deleted += c,
            ("txinbox_retention_batch_duration_seconds", DebugValue::Histogram(h)) => deletes += h.len(),
            ("txinbox_retention_oldest_row_age_seconds", DebugValue::Gauge(g)) => {
                oldest = Some(g.into_inner())
            }
            _ => {}
        }
    }
    assert_eq!((deleted, deletes), (10, 3), "10 rows in 3 DELETEs");
    let oldest = oldest.expect("the oldest published row's age is reported");
    assert!(
        (0.0..3600.0).contains(&oldest),
        "the kept rows were published just now: {oldest}"
    );
}

#[tokio::test]
async fn retention_and_gauges_keep_running_while_a_backlog_drains() {
    let pool = test_db().await;
    let rows = 300;
    for i in 0..rows {
        outbox::write(&pool, &OutboxMessage::new(format!("r-{i}"), "t", "x"))
            .await
            .unwrap();
    }
    let recorder = Recorder {
        pause: Duration::from_millis(3),
        ..Recorder::default()
    };
    // One row per round: every round is full, so run_until keeps draining without pausing.
    let config = fast_config()
        .batch_size(1)
        .retention(Duration::ZERO)
        .retention_schedule(Duration::from_millis(20), 1000);
    let relay = Relay::new(pool.clone(), recorder.clone(), config).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(relay.run_until(async {
        let _ = stopped.await;
    }));
    let started = Instant::now();
    let mut purged_mid_drain = false;
    loop {
        let (pending, total): (i64, i64) =
            sqlx::query_as("SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FROM txinbox.outbox")
                .fetch_one(&pool)
                .await
                .unwrap();
        if pending > 0 && total < rows {
            purged_mid_drain = true;
            break;
        }
        if pending == 0 || started.elapsed() > Duration::from_secs(30) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(());
    running.await.unwrap().unwrap();
    assert!(
        purged_mid_drain,
        "retention must run between the rounds of a long drain, not only once it is over"
    );
}
