//! The outbox and its relay against a real PostgreSQL, with an in-process publisher standing in
//! for the broker (it records what it was given, in order, and fails on request). Broker
//! publishers are tested in the adapters. Needs `DATABASE_URL`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use txinbox::outbox::{self, OutboxMessage, PublishError, Publisher, Relay, RelayConfig};
use txinbox::{async_trait, message::Headers, RetryPolicy};

#[cfg(feature = "sqlite")]
mod sqlite;

use txinbox_testing::database::{server_url as admin_url, TestDatabase};

async fn test_db() -> PgPool {
    TestDatabase::builder("txinbox_outbox_t")
        .max_connections(12)
        .create()
        .await
        .pool()
        .clone()
}

/// Stands in for a broker: records every confirmed message in confirmation order, with the
/// relay that sent it; fails messages whose ID is in `failing` (transiently, `n` times, or
/// permanently).
#[derive(Clone, Default)]
struct Recorder {
    relay: &'static str,
    log: Arc<Mutex<Vec<(&'static str, OutboxMessage)>>>,
    failing: Arc<Mutex<HashMap<String, Failure>>>,
    jitter: bool,
    pause: Duration,
}

#[derive(Clone, Copy)]
enum Failure {
    Times(u32),
    Permanent,
}

impl Recorder {
    fn as_relay(&self, relay: &'static str) -> Recorder {
        Recorder {
            relay,
            ..self.clone()
        }
    }

    fn ids(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .map(|(_, m)| m.message_id().to_owned())
            .collect()
    }
}

#[async_trait]
impl Publisher for Recorder {
    async fn publish(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        tokio::time::sleep(self.pause).await;
        if self.jitter {
            tokio::time::sleep(Duration::from_micros(fastrand::u64(0..2000))).await;
        }
        if let Some(f) = self.failing.lock().unwrap().get_mut(message.message_id()) {
            match f {
                Failure::Permanent => return Err(PublishError::permanent("message too large")),
                Failure::Times(0) => {}
                Failure::Times(n) => {
                    *n -= 1;
                    return Err(PublishError::transient("broker unavailable"));
                }
            }
        }
        self.log.lock().unwrap().push((self.relay, message.clone()));
        Ok(())
    }
}

fn fast_config() -> RelayConfig {
    RelayConfig::default()
        .poll_interval(Duration::from_millis(50))
        .retry_policy(
            RetryPolicy::default()
                .max_attempts(3)
                .initial_delay(Duration::from_millis(1))
                .max_delay(Duration::from_millis(5)),
        )
}

async fn status_counts(pool: &PgPool) -> HashMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>("SELECT status, count(*) FROM txinbox.outbox GROUP BY status")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

async fn drain<P: Publisher>(relay: &Relay<P>) {
    for _ in 0..1000 {
        let round = relay.relay_once().await.unwrap();
        if round.claimed == 0 {
            return;
        }
    }
    panic!("relay did not drain");
}

#[tokio::test]
async fn rows_follow_their_transaction_and_ids_are_written_once() {
    let pool = test_db().await;
    let msg = |id: &str| {
        OutboxMessage::new(id, "orders", format!("payload-{id}"))
            .with_key("k")
            .with_headers(Headers::new().with("h", &b"\xff\x00raw"[..]))
    };

    let mut tx = pool.begin().await.unwrap();
    assert!(outbox::write(&mut *tx, &msg("committed")).await.unwrap());
    assert!(
        !outbox::write(&mut *tx, &msg("committed")).await.unwrap(),
        "the same ID twice in one transaction writes one row"
    );
    tx.commit().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    assert!(outbox::write(&mut *tx, &msg("rolled-back")).await.unwrap());
    tx.rollback().await.unwrap();

    // The same message again, in a later transaction: nothing written, no error.
    assert!(!outbox::write(&pool, &msg("committed")).await.unwrap());
    // Another message under an existing ID is an error that says what differs, never a silent
    // no-op (one of the two messages would be lost), and it changes nothing.
    for (other, differs) in [
        (
            OutboxMessage::new("committed", "elsewhere", "payload-committed").with_key("k"),
            "destination",
        ),
        (
            OutboxMessage::new("committed", "orders", "payload-committed").with_key("j"),
            "key",
        ),
        (
            OutboxMessage::new("committed", "orders", "payload-committed"),
            "key",
        ),
        (
            OutboxMessage::new("committed", "orders", "other").with_key("k"),
            "payload",
        ),
    ] {
        let err = outbox::write(&pool, &other).await.unwrap_err();
        assert!(
            matches!(&err, outbox::WriteError::Conflict { message_id, differs: d } if message_id == "committed" && *d == differs),
            "{err}"
        );
        assert!(err.is_permanent());
    }
    let err = outbox::write(&pool, &OutboxMessage::new("", "orders", "p"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");

    let recorder = Recorder::default();
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    drain(&relay).await;
    let log = recorder.log.lock().unwrap().clone();
    assert_eq!(log.len(), 1, "only the committed row is published");
    assert_eq!(log[0].1, msg("committed"), "published exactly as written");
    assert_eq!(status_counts(&pool).await.get("published"), Some(&1));
}

/// Writes `per_key` rows for each of `keys` keys, interleaved, each in its own transaction
/// (like a consumer processing one key after another).
async fn write_interleaved<DB: outbox::OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    keys: usize,
    per_key: usize,
) -> usize
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    let mut n = 0;
    for i in 0..per_key {
        for k in 0..keys {
            let m =
                OutboxMessage::new(format!("k{k}-{i}"), "events", format!("{i}")).with_key(format!("k{k}"));
            assert!(outbox::write(pool, &m).await.unwrap());
            n += 1;
        }
    }
    // Some unkeyed rows too: they must be published, in any order.
    for i in 0..20 {
        outbox::write(pool, &OutboxMessage::new(format!("nokey-{i}"), "events", "x"))
            .await
            .unwrap();
        n += 1;
    }
    n
}

/// Every message of key `k` appears in the log in its write order, each exactly once.
fn assert_key_order(ids: &[String], keys: usize, per_key: usize) {
    let mut next = vec![0usize; keys];
    let mut seen = HashSet::new();
    for id in ids {
        assert!(seen.insert(id.clone()), "{id} published twice");
        if let Some(rest) = id.strip_prefix('k') {
            let (k, i) = rest.split_once('-').unwrap();
            let (k, i): (usize, usize) = (k.parse().unwrap(), i.parse().unwrap());
            assert_eq!(
                i, next[k],
                "key k{k}: message {i} published when {} was due",
                next[k]
            );
            next[k] += 1;
        }
    }
    assert!(
        next.iter().all(|n| *n == per_key),
        "every keyed row published: {next:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_publish_every_row_once_in_key_order() {
    let pool = test_db().await;
    // A few more keys than a round claims (batch 7; 5 on AMQP): both relays find work, and
    // they contend for the same keys.
    let (keys, per_key) = (9, 60);
    let total = write_interleaved(&pool, keys, per_key).await;

    let recorder = Recorder {
        jitter: true,
        ..Recorder::default()
    };
    // Small batches so the relays interleave a lot.
    let config = || fast_config().batch_size(7);
    let a = Relay::new(pool.clone(), recorder.as_relay("a"), config()).unwrap();
    let b = Relay::new(pool.clone(), recorder.as_relay("b"), config()).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let ta = tokio::spawn(a.run_until(stopped(stop_rx.clone())));
    let tb = tokio::spawn(b.run_until(stopped(stop_rx)));
    // More rows while both run.
    let more_pool = pool.clone();
    let writer = tokio::spawn(async move {
        for i in per_key..per_key + 40 {
            for k in 0..keys {
                let m = OutboxMessage::new(format!("k{k}-{i}"), "events", "late").with_key(format!("k{k}"));
                outbox::write(&more_pool, &m).await.unwrap();
            }
        }
    });
    writer.await.unwrap();
    let total = total + keys * 40;
    let started = Instant::now();
    while recorder.log.lock().unwrap().len() < total && started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop_tx.send(true).unwrap();
    ta.await.unwrap().unwrap();
    tb.await.unwrap().unwrap();

    let ids = recorder.ids();
    assert_eq!(ids.len(), total, "every row published once, none lost");
    assert_key_order(&ids, keys, per_key + 40);
    let by_relay = |r: &str| {
        recorder
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|(x, _)| *x == r)
            .count()
    };
    let (na, nb) = (by_relay("a"), by_relay("b"));
    assert!(na > 0 && nb > 0, "both relays published (a: {na}, b: {nb})");
    assert_eq!(status_counts(&pool).await.get("published"), Some(&(total as i64)));
}

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
async fn retention_removes_only_old_published_rows_and_gauges_report_the_backlog() {
    let pool = test_db().await;
    for i in 0..25 {
        outbox::write(&pool, &OutboxMessage::new(format!("m-{i}"), "t", "x"))
            .await
            .unwrap();
    }
    let recorder = Recorder::default();
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
}

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

#[test]
fn bad_relay_configuration_is_refused_with_a_reason() {
    let err = |c: RelayConfig| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let pool = PgPoolOptions::new().connect_lazy(&admin_url()).unwrap();
            Relay::new(pool, Recorder::default(), c).unwrap_err().to_string()
        })
    };
    assert!(err(RelayConfig::default().batch_size(0)).contains("batch_size"));
    assert!(err(RelayConfig::default().poll_interval(Duration::ZERO)).contains("poll_interval"));
    assert!(
        err(RelayConfig::default().retry_policy(RetryPolicy::default().max_attempts(0)))
            .contains("max_attempts")
    );
}

#[tokio::test]
async fn metrics_count_publishes_failures_dead_letters_and_the_backlog() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use metrics_util::MetricKind;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Only this test reads metrics; the recorder is scoped to this thread while the relay is
    // built and run, so concurrent tests are unaffected.
    let pool = test_db().await;
    for (id, key) in [("ok-1", "a"), ("flaky", "b"), ("poison", "c"), ("ok-2", "a")] {
        outbox::write(&pool, &OutboxMessage::new(id, "t", "x").with_key(key))
            .await
            .unwrap();
    }
    let publisher = Recorder::default();
    {
        let mut failing = publisher.failing.lock().unwrap();
        failing.insert("flaky".into(), Failure::Times(1));
        failing.insert("poison".into(), Failure::Permanent);
    }
    let _guard = metrics::set_default_local_recorder(&recorder);
    let relay = Relay::new(pool.clone(), publisher, fast_config().name("metrics-relay")).unwrap();
    let backlog = relay.refresh_metrics().await.unwrap();
    assert_eq!(backlog.pending, 4);
    // A snapshot resets counters: accumulate them across snapshots, keep the last gauges.
    let totals: std::cell::RefCell<HashMap<String, u64>> = Default::default();
    let gauges: std::cell::RefCell<HashMap<String, f64>> = Default::default();
    let take = || {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let mine = key
                .key()
                .labels()
                .any(|l| l.key() == "relay" && l.value() == "metrics-relay");
            let name = key.key().name().to_owned();
            match value {
                DebugValue::Counter(c) if mine && key.kind() == MetricKind::Counter => {
                    *totals.borrow_mut().entry(name).or_default() += c
                }
                DebugValue::Gauge(g) if mine => {
                    gauges.borrow_mut().insert(name, g.into_inner());
                }
                _ => {}
            }
        }
    };
    let gauge = |name: &str| {
        take();
        *gauges
            .borrow()
            .get(name)
            .unwrap_or_else(|| panic!("gauge {name} recorded"))
    };
    assert_eq!(gauge("txinbox_outbox_pending"), 4.0);
    assert!(gauge("txinbox_outbox_oldest_pending_age_seconds") >= 0.0);

    let started = Instant::now();
    while relay.refresh_metrics().await.unwrap().pending > 0 && started.elapsed() < Duration::from_secs(10) {
        relay.relay_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(gauge("txinbox_outbox_pending"), 0.0);
    assert_eq!(gauge("txinbox_outbox_oldest_pending_age_seconds"), 0.0);
    take();
    let counters = totals.borrow().clone();
    assert_eq!(
        counters.get("txinbox_outbox_published_total"),
        Some(&3),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("txinbox_outbox_publish_failures_total"),
        Some(&2),
        "{counters:?}"
    );
    assert_eq!(
        counters.get("txinbox_outbox_dead_letters_total"),
        Some(&1),
        "{counters:?}"
    );
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

async fn scalar_i64(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
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

/// A row with a lower ID can commit after a higher one of its key was claimed (IDs are taken at
/// insert, not commit). It has no defined order against that row — but rows of transactions
/// that began after it committed must still follow it. The round's head claim and its
/// follower claim see different snapshots: here the writer commits the late row and a newer
/// one while the relay's head claim is still scanning (a long backlog of another key), so the
/// follower claim sees both. It must not take the newer row past the late one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_committing_row_is_not_overtaken_by_rows_written_after_it() {
    let pool = test_db().await;
    let mut late = pool.begin().await.unwrap();
    outbox::write(&mut *late, &OutboxMessage::new("k-late", "t", "x").with_key("k"))
        .await
        .unwrap();
    outbox::write(&pool, &OutboxMessage::new("k-early", "t", "x").with_key("k"))
        .await
        .unwrap();
    // Another key's backlog behind a head that is not due: the head claim scans all of it.
    sqlx::query(
        "INSERT INTO txinbox.outbox (message_id, destination, message_key, payload, next_attempt_at)
         VALUES ('z-head', 't', 'z', '', now() + interval '1 hour')",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO txinbox.outbox (message_id, destination, message_key, payload)
         SELECT 'z-' || g, 't', 'z', '' FROM generate_series(1, 300000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE txinbox.outbox")
        .execute(&pool)
        .await
        .unwrap();

    let recorder = Recorder::default();
    let relay = Arc::new(Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap());
    let round = tokio::spawn({
        let relay = Arc::clone(&relay);
        async move { relay.relay_once().await.unwrap() }
    });
    let claiming = "SELECT count(*) FROM pg_stat_activity
        WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
          AND query LIKE '%FOR UPDATE OF o SKIP LOCKED%'";
    // The head claim has its snapshot once it locked k-early (a row lock sets xmax); the query
    // shows as active in pg_stat_activity already while it is being parsed, before that.
    let early_locked =
        "SELECT (xmax::text <> '0')::int::int8 FROM txinbox.outbox WHERE message_id = 'k-early'";
    let started = Instant::now();
    while scalar_i64(&pool, early_locked).await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the relay never ran its claim"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    late.commit().await.unwrap();
    outbox::write(&pool, &OutboxMessage::new("k-after", "t", "x").with_key("k"))
        .await
        .unwrap();
    assert_eq!(
        scalar_i64(&pool, claiming).await,
        1,
        "test setup: the head claim must still be running when the writes commit"
    );
    let first = round.await.unwrap();
    assert_eq!(first.claimed, 1, "only k-early, the head: {first:?}");
    relay.relay_once().await.unwrap();
    assert_eq!(recorder.ids(), ["k-early", "k-late", "k-after"]);
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

async fn scalar_text(pool: &PgPool, sql: &'static str) -> String {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Two consumers handle the same event and emit a message under the same step name. Their
/// derived IDs used to be equal (the consumer was not part of the derivation), so the second
/// consumer's outbox row was dropped by `ON CONFLICT DO NOTHING` and its message never sent.
#[tokio::test]
async fn two_consumers_emitting_the_same_step_for_one_event_both_publish() {
    use txinbox::memory::MemoryBroker;
    use txinbox::{Consumer, Context, Handler, HandlerError, Message};

    struct Notify;
    #[async_trait]
    impl Handler<sqlx::Postgres> for Notify {
        async fn handle(
            &self,
            cx: &mut Context<'_, sqlx::Postgres>,
            msg: &Message,
        ) -> Result<(), HandlerError> {
            let payload = format!("{} saw {}", cx.consumer(), String::from_utf8_lossy(msg.payload()));
            let event = OutboxMessage::new(cx.derive_id("notify"), "notifications", payload);
            assert!(cx.outbox(&event).await?, "a new row");
            Ok(())
        }
    }

    let pool = test_db().await;
    for consumer in ["billing", "shipping"] {
        let broker = MemoryBroker::new("orders");
        broker.publish("order-1", "placed");
        broker.close();
        Consumer::builder(consumer)
            .source(broker.source())
            .inbox(txinbox::PostgresInbox::new(pool.clone()))
            .handler(Notify)
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
        assert!(
            broker.dead_letters().is_empty(),
            "{consumer}: {:?}",
            broker.dead_letters()
        );
    }
    let rows: Vec<(String, Vec<u8>)> =
        sqlx::query_as("SELECT message_id, payload FROM txinbox.outbox ORDER BY payload")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        [
            (
                outbox::derive_id("billing", "order-1", "notify"),
                b"billing saw placed".to_vec()
            ),
            (
                outbox::derive_id("shipping", "order-1", "notify"),
                b"shipping saw placed".to_vec()
            ),
        ]
    );
}

/// A handler whose outbox message collides with another message's ID is dead-lettered at once
/// (permanent: writing it again cannot succeed), not retried until its attempts run out.
#[tokio::test]
async fn an_outbox_id_taken_by_another_message_dead_letters_the_incoming_one() {
    use std::sync::atomic::AtomicU32;
    use txinbox::memory::MemoryBroker;
    use txinbox::{dead_letter::DeadLetterReason, Consumer, Context, Handler, HandlerError, Message};

    #[derive(Clone, Default)]
    struct FixedId(std::sync::Arc<AtomicU32>);
    #[async_trait]
    impl Handler<sqlx::Postgres> for FixedId {
        async fn handle(
            &self,
            cx: &mut Context<'_, sqlx::Postgres>,
            msg: &Message,
        ) -> Result<(), HandlerError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            cx.outbox(&OutboxMessage::new("fixed", "t", msg.payload().clone()))
                .await?;
            Ok(())
        }
    }

    let pool = test_db().await;
    let broker = MemoryBroker::new("orders");
    broker.publish("a", "first");
    broker.publish("b", "second");
    broker.close();
    let handler = FixedId::default();
    Consumer::builder("fixed")
        .source(broker.source())
        .inbox(txinbox::PostgresInbox::new(pool.clone()))
        .handler(handler.clone())
        .batch_size(1)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(handler.0.load(Ordering::SeqCst), 2, "each message ran once");
    let dead = broker.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.reason, DeadLetterReason::Permanent);
    assert!(dead[0].1.error.contains("another payload"), "{}", dead[0].1.error);
    assert_eq!(scalar_i64(&pool, "SELECT count(*) FROM txinbox.outbox").await, 1);
}

/// Polls `relay`'s health until `pred` holds; panics with the last report after `within`.
async fn wait_relay(
    health: &txinbox::health::RelayHealth,
    within: Duration,
    what: &str,
    pred: impl Fn(&txinbox::health::RelayReport) -> bool,
) {
    let deadline = Instant::now() + within;
    loop {
        let report = health.report();
        if pred(&report) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: last report {report:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

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
