//! The outbox and its relay on SQLite (`txinbox_outbox`): the same contract as on PostgreSQL,
//! and what SQLite does differently — a relay leases its rows instead of locking them, so it
//! never holds the one write lock while a broker confirms, and a dead relay's claim is taken
//! over when its lease runs out.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use txinbox::memory::MemoryBroker;
use txinbox::outbox::{self, OutboxMessage, Relay};
use txinbox::{
    async_trait, message::Headers, Consumer, Context, Handler, HandlerError, Message, SqliteInbox,
};

use crate::support::{assert_key_order, drain, fast_config, write_interleaved, Failure, Recorder};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A fresh database file with the migrations run, and a pool of `connections`.
async fn sqlite_db(connections: u32) -> SqlitePool {
    sqlite_db_with(connections, Duration::from_secs(30)).await
}

/// [`sqlite_db`] with another busy timeout (how long a writer waits for the lock).
async fn sqlite_db_with(connections: u32, busy_timeout: Duration) -> SqlitePool {
    let dir = std::env::temp_dir().join(format!(
        "txinbox-outbox-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let options = SqliteInbox::connect_options(
        SqliteConnectOptions::new()
            .filename(dir.join("outbox.db"))
            .create_if_missing(true),
    )
    .busy_timeout(busy_timeout);
    let pool = SqlitePoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await
        .unwrap();
    txinbox::sqlite::migrate(&pool).await.unwrap();
    pool
}

async fn count(pool: &SqlitePool, status: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM txinbox_outbox WHERE status = ?1")
        .bind(status)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn sqlite_rows_follow_their_transaction_and_ids_are_written_once() {
    let pool = sqlite_db(4).await;
    let msg = |id: &str| {
        OutboxMessage::new(id, "orders", format!("payload-{id}"))
            .with_key("k")
            .with_headers(Headers::new().with("h", &b"\xff\x00raw"[..]).with("b", ""))
    };
    let mut tx = pool.begin().await.unwrap();
    assert!(outbox::write(&mut *tx, &msg("committed")).await.unwrap());
    assert!(!outbox::write(&mut *tx, &msg("committed")).await.unwrap());
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert!(outbox::write(&mut *tx, &msg("rolled-back")).await.unwrap());
    tx.rollback().await.unwrap();

    assert!(!outbox::write(&pool, &msg("committed")).await.unwrap());
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
        // In a transaction that goes on to commit something else: a conflict leaves it usable.
        let mut tx = pool.begin().await.unwrap();
        let err = outbox::write(&mut *tx, &other).await.unwrap_err();
        assert!(
            matches!(&err, outbox::WriteError::Conflict { message_id, differs: d } if message_id == "committed" && *d == differs),
            "{err}"
        );
        outbox::write(
            &mut *tx,
            &OutboxMessage::new(format!("after-{differs}-{}", other.destination()), "t", "x"),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    sqlx::query("DELETE FROM txinbox_outbox WHERE message_id LIKE 'after-%'")
        .execute(&pool)
        .await
        .unwrap();

    let recorder = Recorder::default();
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    drain(&relay).await;
    let log = recorder.log.lock().unwrap().clone();
    assert_eq!(log.len(), 1, "only the committed row is published");
    assert_eq!(
        log[0].1,
        msg("committed"),
        "published exactly as written, headers included"
    );
    assert_eq!(count(&pool, "published").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_two_relays_publish_every_row_once_in_key_order() {
    let pool = sqlite_db(8).await;
    let (keys, per_key) = (9, 40);
    let total = write_interleaved(&pool, keys, per_key).await;
    let recorder = Recorder {
        jitter: true,
        ..Recorder::default()
    };
    let config = || fast_config().batch_size(7);
    let a = Relay::new(pool.clone(), recorder.as_relay("a"), config()).unwrap();
    let b = Relay::new(pool.clone(), recorder.as_relay("b"), config()).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let ta = tokio::spawn(a.run_until(stopped(stop_rx.clone())));
    let tb = tokio::spawn(b.run_until(stopped(stop_rx)));
    for i in per_key..per_key + 20 {
        for k in 0..keys {
            let m = OutboxMessage::new(format!("k{k}-{i}"), "events", "late").with_key(format!("k{k}"));
            outbox::write(&pool, &m).await.unwrap();
        }
    }
    let total = total + keys * 20;
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
    assert_key_order(&ids, keys, per_key + 20);
    let by = |r: &str| {
        recorder
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|(x, _)| *x == r)
            .count()
    };
    assert!(
        by("a") > 0 && by("b") > 0,
        "both relays published (a: {}, b: {})",
        by("a"),
        by("b")
    );
    assert_eq!(count(&pool, "published").await, total as i64);
    let leased: i64 =
        sqlx::query_scalar("SELECT count(*) FROM txinbox_outbox WHERE leased_until IS NOT NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(leased, 0, "every lease is cleared when its row is marked");
}

#[tokio::test]
async fn sqlite_a_failing_row_holds_its_key_until_dead_lettered_and_an_outage_burns_no_attempts() {
    let pool = sqlite_db(4).await;
    for i in 0..3 {
        outbox::write(
            &pool,
            &OutboxMessage::new(format!("a-{i}"), "t", "x").with_key("a"),
        )
        .await
        .unwrap();
    }
    let recorder = Recorder::default();
    recorder
        .failing
        .lock()
        .unwrap()
        .insert("a-0".into(), Failure::Permanent);
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    let round = relay.relay_once().await.unwrap();
    assert_eq!((round.claimed, round.dead_lettered), (3, 1), "{round:?}");
    assert!(
        recorder.ids().is_empty(),
        "nothing of the key overtakes its failing head"
    );
    drain(&relay).await;
    assert_eq!(
        recorder.ids(),
        ["a-1", "a-2"],
        "the later rows go once the head is dead-lettered"
    );
    let (status, error): (String, String) =
        sqlx::query_as("SELECT status, last_error FROM txinbox_outbox WHERE message_id = 'a-0'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(status, "dead_lettered");
    assert!(error.contains("too large"), "{error}");

    // Two keys whose publishes both fail transiently: an outage. No attempt is counted, and
    // the rows are not left leased: the next round takes them at once.
    for k in ["b", "c"] {
        outbox::write(&pool, &OutboxMessage::new(k, "t", "x").with_key(k))
            .await
            .unwrap();
        recorder
            .failing
            .lock()
            .unwrap()
            .insert(k.into(), Failure::Times(1));
    }
    let round = relay.relay_once().await.unwrap();
    assert!(round.broker_unavailable, "{round:?}");
    let (attempts, leased): (i64, i64) = sqlx::query_as(
        "SELECT sum(attempts), count(leased_until) FROM txinbox_outbox WHERE message_id IN ('b', 'c')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((attempts, leased), (0, 0));
    let round = relay.relay_once().await.unwrap();
    assert_eq!(
        round.published, 2,
        "released at once, published by the next round: {round:?}"
    );
}

/// The reason SQLite gets leases: while a broker takes its time to confirm, the application's
/// own write transactions go on. (Holding the claim transaction open while publishing would
/// keep SQLite's one write lock for the whole publish.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_relay_holds_no_write_lock_while_the_broker_confirms() {
    let pool = sqlite_db(4).await;
    outbox::write(&pool, &OutboxMessage::new("slow", "t", "x"))
        .await
        .unwrap();
    let recorder = Recorder {
        pause: Duration::from_secs(3),
        ..Recorder::default()
    };
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    let round = tokio::spawn(async move { relay.relay_once().await });
    // Wait until the row is claimed, i.e. the publish has begun.
    until_leased(&pool, 1).await;
    let writing = Instant::now();
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    outbox::write(&mut *tx, &OutboxMessage::new("meanwhile", "t", "x"))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let took = writing.elapsed();
    assert!(
        !round.is_finished(),
        "the publish was still waiting for its confirmation"
    );
    assert!(
        took < Duration::from_secs(1),
        "a write transaction waited {took:?} for the relay's publish"
    );
    assert_eq!(round.await.unwrap().unwrap().published, 1);
}

/// A relay that dies after claiming rows (the task is aborted mid-publish, as a killed process
/// would stop) leaves them leased: no other relay takes them, or any later row of their key,
/// until the lease runs out; then they are published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_dead_relays_claim_is_taken_over_when_its_lease_runs_out() {
    let pool = sqlite_db(4).await;
    for i in 0..2 {
        outbox::write(
            &pool,
            &OutboxMessage::new(format!("k-{i}"), "t", "x").with_key("k"),
        )
        .await
        .unwrap();
    }
    // publish_timeout 1 s: the lease is 2 × 1 s + 10 s.
    let config = || fast_config().publish_timeout(Duration::from_secs(1));
    let hanging = Recorder {
        pause: Duration::from_secs(3600),
        ..Recorder::default()
    };
    let dead = Relay::new(pool.clone(), hanging, config()).unwrap();
    let claimed_at = Instant::now();
    let dying = tokio::spawn(async move { dead.relay_once().await });
    until_leased(&pool, 2).await;
    dying.abort();
    let _ = dying.await;
    // A later row of the same key, written after the claim, must wait too.
    outbox::write(&pool, &OutboxMessage::new("k-2", "t", "x").with_key("k"))
        .await
        .unwrap();

    let recorder = Recorder::default();
    let heir = Relay::new(pool.clone(), recorder.clone(), config()).unwrap();
    let round = heir.relay_once().await.unwrap();
    assert_eq!(
        round.claimed, 0,
        "leased rows, and the rest of their key, wait: {round:?}"
    );
    while recorder.ids().len() < 3 {
        assert!(
            claimed_at.elapsed() < Duration::from_secs(30),
            "the claim was never taken over"
        );
        heir.relay_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let waited = claimed_at.elapsed();
    assert!(
        waited >= Duration::from_secs(11),
        "taken over after {waited:?}, before the lease ran out"
    );
    assert_eq!(recorder.ids(), ["k-0", "k-1", "k-2"], "in key order");
}

#[tokio::test]
async fn sqlite_retention_deletes_old_published_rows_and_the_backlog_is_reported() {
    let pool = sqlite_db(4).await;
    for i in 0..5 {
        outbox::write(&pool, &OutboxMessage::new(format!("r-{i}"), "t", "x"))
            .await
            .unwrap();
    }
    let recorder = Recorder::default();
    recorder
        .failing
        .lock()
        .unwrap()
        .insert("r-4".into(), Failure::Permanent);
    let relay = Relay::new(
        pool.clone(),
        recorder.clone(),
        fast_config()
            .retention(Duration::from_millis(300))
            .retention_schedule(Duration::from_secs(60), 2),
    )
    .unwrap();
    // A pending row ~200 ms old.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let backlog = relay.refresh_metrics().await.unwrap();
    assert_eq!(backlog.pending, 5);
    assert!(
        backlog.oldest_pending_age >= Duration::from_millis(150),
        "{backlog:?}"
    );
    drain(&relay).await;
    assert_eq!(relay.refresh_metrics().await.unwrap().pending, 0);
    assert_eq!(
        relay.purge_published().await.unwrap(),
        0,
        "published just now: kept"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    outbox::write(&pool, &OutboxMessage::new("fresh", "t", "x"))
        .await
        .unwrap();
    drain(&relay).await;
    assert_eq!(
        relay.purge_published().await.unwrap(),
        4,
        "in batches of 2, until done"
    );
    let left: Vec<String> = sqlx::query_scalar("SELECT message_id FROM txinbox_outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, ["r-4", "fresh"], "dead letters and recent rows stay");
}

struct Emit;

#[async_trait]
impl Handler<sqlx::Sqlite> for Emit {
    async fn handle(&self, cx: &mut Context<'_, sqlx::Sqlite>, msg: &Message) -> Result<(), HandlerError> {
        let event = OutboxMessage::new(cx.derive_id("seen"), "seen", msg.payload().clone());
        cx.outbox(&event).await?;
        Ok(())
    }
}

/// A consumer on the embedded store writes outbox rows in its message transactions
/// (`Context::outbox`), one per message however often the message is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_consumer_writes_one_outbox_row_per_message() {
    let pool = sqlite_db(4).await;
    let broker = MemoryBroker::with_seed("in", 7);
    broker.set_duplicate_probability(0.3);
    for i in 0..50 {
        broker.publish(format!("m-{i}"), format!("p-{i}"));
    }
    broker.close();
    Consumer::builder("emitter")
        .source(broker.source())
        .inbox(SqliteInbox::new(pool.clone()))
        .handler(Emit)
        .concurrency(2)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert!(
        broker.stats().delivered > 50,
        "some messages came twice: {:?}",
        broker.stats()
    );
    let recorder = Recorder::default();
    drain(&Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap()).await;
    let mut published = recorder.ids();
    published.sort();
    published.dedup();
    assert_eq!(recorder.ids().len(), 50);
    assert_eq!(published.len(), 50);
    assert!(published.contains(&outbox::derive_id("emitter", "m-7", "seen")));
}

async fn leased(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT count(leased_until) FROM txinbox_outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits until `n` rows are leased (a round has claimed them and is publishing).
async fn until_leased(pool: &SqlitePool, n: i64) {
    let started = Instant::now();
    while leased(pool).await < n {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the relay never claimed the rows"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A round that stalls past its lease loses its rows to the next relay; when it finally marks
/// them, nothing changes: the failure it saw does not dead-letter the row the other relay
/// published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_stalled_rounds_late_marks_change_nothing() {
    let pool = sqlite_db(4).await;
    outbox::write(&pool, &OutboxMessage::new("row", "t", "x").with_key("k"))
        .await
        .unwrap();
    let stalled = Recorder {
        pause: Duration::from_secs(2),
        ..Recorder::default()
    };
    stalled
        .failing
        .lock()
        .unwrap()
        .insert("row".into(), Failure::Permanent);
    let first = Relay::new(pool.clone(), stalled, fast_config()).unwrap();
    let round = tokio::spawn(async move { first.relay_once().await });
    until_leased(&pool, 1).await;
    // The stall outlasts the lease (made to run out now, instead of waiting 50 s).
    sqlx::query("UPDATE txinbox_outbox SET leased_until = 0")
        .execute(&pool)
        .await
        .unwrap();
    let recorder = Recorder::default();
    let next = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    assert_eq!(next.relay_once().await.unwrap().published, 1);
    let late = round.await.unwrap().unwrap();
    assert_eq!(
        late.dead_lettered, 1,
        "the stalled round saw a permanent failure: {late:?}"
    );
    let (status, attempts, error): (String, i64, Option<String>) =
        sqlx::query_as("SELECT status, attempts, last_error FROM txinbox_outbox")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), attempts, error),
        ("published", 1, None),
        "the late mark of the stalled round changed the row"
    );
}

/// A row put back before rows that another relay is publishing (a dead letter set to `pending`
/// again) is not published alongside them: its key is skipped while one of its rows is leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_row_put_back_before_leased_rows_waits_for_their_claim() {
    let pool = sqlite_db(4).await;
    for i in 0..3 {
        outbox::write(
            &pool,
            &OutboxMessage::new(format!("k-{i}"), "t", "x").with_key("k"),
        )
        .await
        .unwrap();
    }
    sqlx::query("UPDATE txinbox_outbox SET status = 'dead_lettered' WHERE message_id = 'k-0'")
        .execute(&pool)
        .await
        .unwrap();
    let slow = Recorder {
        pause: Duration::from_millis(1500),
        ..Recorder::default()
    };
    let first = Relay::new(pool.clone(), slow.clone(), fast_config()).unwrap();
    let round = tokio::spawn(async move { first.relay_once().await });
    until_leased(&pool, 2).await;
    sqlx::query("UPDATE txinbox_outbox SET status = 'pending', next_attempt_at = 0 WHERE message_id = 'k-0'")
        .execute(&pool)
        .await
        .unwrap();
    let recorder = Recorder::default();
    let other = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    let meanwhile = other.relay_once().await.unwrap();
    assert_eq!(
        meanwhile.claimed, 0,
        "claimed rows of a key another relay holds: {meanwhile:?}"
    );
    assert_eq!(round.await.unwrap().unwrap().published, 2);
    drain(&other).await;
    assert_eq!(slow.ids(), ["k-1", "k-2"]);
    assert_eq!(recorder.ids(), ["k-0"], "published once the claim ended");
}

/// An idle relay's poll does not wait for SQLite's write lock: it only reads. (Taking the lock to
/// find nothing would queue every poll behind the application's writers, and them behind it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_an_idle_poll_takes_no_write_lock() {
    let pool = sqlite_db(4).await;
    outbox::write(&pool, &OutboxMessage::new("done", "t", "x"))
        .await
        .unwrap();
    let relay = Relay::new(pool.clone(), Recorder::default(), fast_config()).unwrap();
    drain(&relay).await;
    let mut writer = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    outbox::write(&mut *writer, &OutboxMessage::new("uncommitted", "t", "x"))
        .await
        .unwrap();
    let started = Instant::now();
    let round = tokio::time::timeout(Duration::from_secs(5), relay.relay_once())
        .await
        .expect("the poll waited for the write lock")
        .unwrap();
    assert_eq!(round.claimed, 0);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    writer.commit().await.unwrap();
}

/// The broker confirmed, then the database is busy past the busy timeout when the round marks
/// its rows: the round waits it out (within its lease) instead of failing and leaving confirmed
/// rows to be published again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_marking_waits_out_a_busy_database() {
    let pool = sqlite_db_with(4, Duration::from_millis(100)).await;
    outbox::write(&pool, &OutboxMessage::new("row", "t", "x"))
        .await
        .unwrap();
    let recorder = Recorder {
        pause: Duration::from_millis(300),
        ..Recorder::default()
    };
    let relay = Relay::new(pool.clone(), recorder.clone(), fast_config()).unwrap();
    let round = tokio::spawn(async move { relay.relay_once().await });
    until_leased(&pool, 1).await;
    // Another writer holds the lock from during the publish until well after it.
    let mut writer = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS busy (x INTEGER)")
        .execute(&mut *writer)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !round.is_finished(),
        "the round gave up (or did not wait for the lock)"
    );
    writer.commit().await.unwrap();
    let round = round.await.unwrap().expect("marking waited for the lock");
    assert_eq!(round.published, 1);
    assert_eq!(count(&pool, "published").await, 1);
}
