//! The database is unavailable: it refuses connections (`ALLOW_CONNECTIONS false`, SQLSTATE
//! 55000), ends its sessions (`pg_terminate_backend`, 57P01), has no connection left for the
//! role (53300), or the server is stopped. Whatever the cause, the consumer fails closed the
//! same way: intake pauses, the health report says the database is unreachable, nothing is
//! acknowledged, no attempt is counted (an outage is not the message's fault), and once the
//! database is back every message is applied exactly once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, Executor};
use txinbox::health::{Health, HealthReport};
use txinbox::memory::MemoryBroker;
use txinbox::Consumer;

use super::support::{deposit_in_lane, fast_retries, DepositHandler, TestDb};

/// Polls `health` until `pred` holds, or panics with the last report after `within`.
async fn wait_for(health: &Health, within: Duration, what: &str, pred: impl Fn(&HealthReport) -> bool) {
    let deadline = Instant::now() + within;
    loop {
        let report = health.report();
        if pred(&report) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: last report {report:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls until `f` is true, or panics after `within`.
async fn wait_until<F, Fut>(within: Duration, what: &str, f: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The report of a paused consumer that rides an outage out: alive, not ready, the database
/// named as the problem.
fn paused_for_the_database(r: &HealthReport) -> bool {
    !r.database_reachable
        && r.intake_paused
        && !r.is_ready()
        && r.is_alive()
        && r.problems().iter().any(|p| p.contains("database unreachable"))
}

/// Every message of `consumer` applied exactly once, on its first counted attempt, and none
/// dead-lettered.
async fn applied_once_on_the_first_attempt(db: &TestDb, consumer: &str, messages: i64) {
    let dead: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT message_id, reason, coalesce(error, '') FROM txinbox.dead_letters WHERE consumer = $1",
    )
    .bind(consumer)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(dead, [], "an outage dead-lettered a message");
    let (effects, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT message_id) FROM effects")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (effects, distinct),
        (messages, messages),
        "one effect per message"
    );
    let attempts: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT message_id, status, attempts FROM txinbox.inbox WHERE consumer = $1 ORDER BY message_id",
    )
    .bind(consumer)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts.len() as i64, messages, "{attempts:?}");
    assert!(
        attempts
            .iter()
            .all(|(_, status, n)| status == "processed" && *n == 1),
        "an outage counted as an attempt: {attempts:?}"
    );
}

/// An operator takes the database offline (`ALTER DATABASE … ALLOW_CONNECTIONS false`, its
/// sessions ended): every new connection is refused with SQLSTATE 55000. That is an outage, not
/// a fault of the consumer's: it pauses, says the database is unreachable and goes on once the
/// database takes connections again. (It used to stop with a fatal store error.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_refusing_connections_pauses_intake_and_counts_no_attempt() {
    let db = TestDb::new(4).await;
    let broker = MemoryBroker::new("payments");
    let consumer = Consumer::builder("refused")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .concurrency(2)
        .retry_policy(fast_retries().max_attempts(2))
        .build()
        .unwrap();
    let health = consumer.health();
    let run = tokio::spawn(consumer.run());
    broker.publish("evt-0", deposit_in_lane("alice", 1, "-", 0));
    wait_until(Duration::from_secs(10), "the first deposit applied", || async {
        db.balance("alice").await == 1
    })
    .await;

    db.scratch().refuse_connections().await;
    for i in 1..=5 {
        broker.publish(format!("evt-{i}"), deposit_in_lane("alice", 1, "-", i));
    }
    wait_for(
        &health,
        Duration::from_secs(20),
        "paused while the database refuses connections",
        paused_for_the_database,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !run.is_finished(),
        "the consumer stopped for an outage: {:?}",
        run.await
    );
    assert!(paused_for_the_database(&health.report()));

    db.scratch().allow_connections().await;
    wait_until(
        Duration::from_secs(30),
        "every deposit applied after the outage",
        || async { db.balance("alice").await == 6 },
    )
    .await;
    wait_for(&health, Duration::from_secs(10), "ready again", |r| {
        r.is_ready() && r.database_reachable
    })
    .await;
    broker.close();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("drains after close")
        .unwrap()
        .unwrap();
    applied_once_on_the_first_attempt(&db, "refused", 6).await;
}

/// The handler's session is ended while its transaction is open (a failover, an operator's
/// `pg_terminate_backend`): the COMMIT fails with 57P01 or a lost connection. The message is
/// not to blame, so no attempt is counted; with one attempt allowed, counting it would
/// dead-letter the message for an outage (it used to).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sessions_ended_mid_transaction_count_no_attempt() {
    let db = TestDb::new(4).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 10, "-", 0));
    broker.close();
    let handler = DepositHandler::default().holding(Duration::from_millis(1500));
    let consumer = Consumer::builder("ended")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler.clone())
        .concurrency(2)
        .retry_policy(fast_retries().max_attempts(1))
        .build()
        .unwrap();
    let run = tokio::spawn(consumer.run());
    wait_until(
        Duration::from_secs(10),
        "the handler holds its transaction",
        || async { handler.calls() == 1 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ended = db.scratch().terminate_sessions().await;
    assert!(ended >= 1, "the handler's session was ended");
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("finishes once the message is applied")
        .unwrap()
        .unwrap();
    applied_once_on_the_first_attempt(&db, "ended", 1).await;
    assert!(handler.calls() >= 2, "the message ran again after the outage");
    assert!(
        handler.starts_of("evt-1").iter().all(|s| s.attempt == 1),
        "{:?}",
        handler.starts_of("evt-1")
    );
    assert_eq!(db.balance("alice").await, 10);
}

/// A role name of its own per test (roles are the server's, not the scratch database's).
fn role_name() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "txinbox_limit_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// A login role that may read and write every table, limited to `limit` connections; returns
/// its connection options on `db`.
async fn limited_role(db: &TestDb, role: &str, limit: u32) -> PgConnectOptions {
    db.pool
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE ROLE {role} LOGIN CONNECTION LIMIT {limit} IN ROLE pg_read_all_data, pg_write_all_data"
        )))
        .await
        .unwrap();
    db.pool.connect_options().as_ref().clone().username(role)
}

async fn drop_role(db: &TestDb, role: &str) {
    db.pool
        .execute(sqlx::AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}")))
        .await
        .unwrap();
}

/// The consumer's role has used up its `CONNECTION LIMIT` (other processes of the same role
/// hold them): every connection is refused with 53300 "too many connections for role". The
/// consumer pauses and says the database is unreachable; once a connection is free it applies
/// everything once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_role_out_of_connections_pauses_intake_and_counts_no_attempt() {
    let db = TestDb::new(4).await;
    let role = role_name();
    let options = limited_role(&db, &role, 1).await;
    let held = options.connect().await.expect("the role's one connection");
    let refused = options.connect().await.expect_err("the role's limit is used up");
    assert_eq!(
        refused.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("53300"),
        "{refused}"
    );

    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(txinbox::PostgresInbox::connect_options(options));
    let broker = MemoryBroker::new("payments");
    for i in 0..3 {
        broker.publish(format!("evt-{i}"), deposit_in_lane("alice", 1, "-", i));
    }
    let consumer = Consumer::builder("limited")
        .source(broker.source())
        .inbox(txinbox::PostgresInbox::new(pool.clone()))
        .handler(DepositHandler::default())
        .concurrency(1)
        .retry_policy(fast_retries().max_attempts(1))
        .build()
        .unwrap();
    let health = consumer.health();
    let run = tokio::spawn(consumer.run());
    wait_for(
        &health,
        Duration::from_secs(20),
        "paused while the role has no connection left",
        paused_for_the_database,
    )
    .await;
    assert!(!run.is_finished(), "the consumer stopped for an outage");

    held.close().await.unwrap();
    wait_until(
        Duration::from_secs(30),
        "every deposit applied once a connection is free",
        || async { db.balance("alice").await == 3 },
    )
    .await;
    broker.close();
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("drains after close")
        .unwrap()
        .unwrap();
    pool.close().await;
    applied_once_on_the_first_attempt(&db, "limited", 3).await;
    drop_role(&db, &role).await;
}

/// The SQLSTATE of `e`, if the database answered.
fn code(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

/// `e` is an outage by the one classification, and not a lock conflict.
#[track_caller]
fn assert_unavailable(what: &str, e: &sqlx::Error) {
    assert!(
        txinbox::store::is_unavailable(e) && !txinbox::store::is_lock_conflict(e),
        "{what}: {e:?} must be classified unavailable"
    );
}

/// A statement on a connection the test holds, in a transaction.
async fn query_on(conn: &mut sqlx::PgConnection) -> sqlx::Error {
    conn.execute("SELECT 1").await.expect_err("the session is gone")
}

/// Every way a real PostgreSQL tells that it is unavailable is classified so by
/// `txinbox::store::is_unavailable`, the function the consumer, the relay, txinbox-http and the
/// CLI share: a database refusing connections, sessions ended, a role out of connections, a
/// server shutting down, crashed, or stopped. And nothing the database answers about a
/// statement is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_of_a_real_postgres_is_unavailable_and_nothing_else_is() {
    let db = TestDb::new(2).await;
    let options = db.pool.connect_options().as_ref().clone();

    // ALLOW_CONNECTIONS false, sessions ended.
    let mut held = options.connect().await.unwrap();
    held.execute("BEGIN").await.unwrap();
    db.scratch().refuse_connections().await;
    assert_unavailable(
        "a session ended by pg_terminate_backend",
        &query_on(&mut held).await,
    );
    let refused = options.connect().await.expect_err("refused");
    assert_eq!(code(&refused).as_deref(), Some("55000"), "{refused}");
    assert_unavailable("a connection refused by ALLOW_CONNECTIONS false", &refused);
    let refused = db.pool.acquire().await.expect_err("refused");
    assert_unavailable(
        "the pool's connection refused by ALLOW_CONNECTIONS false",
        &refused,
    );
    db.scratch().allow_connections().await;

    // Sessions ended alone; new connections are accepted.
    let mut held = options.connect().await.unwrap();
    held.execute("BEGIN").await.unwrap();
    assert!(db.scratch().terminate_sessions().await >= 1);
    let ended = query_on(&mut held).await;
    assert_unavailable("a session ended by pg_terminate_backend", &ended);

    // A role whose CONNECTION LIMIT is used up.
    let role = role_name();
    let limited = limited_role(&db, &role, 1).await;
    let one = limited.connect().await.unwrap();
    let too_many = limited.connect().await.expect_err("over the role's limit");
    assert_eq!(code(&too_many).as_deref(), Some("53300"), "{too_many}");
    assert_unavailable("too many connections for the role", &too_many);
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(limited);
    let timed_out = pool.acquire().await.expect_err("over the role's limit");
    assert!(matches!(timed_out, sqlx::Error::PoolTimedOut), "{timed_out:?}");
    assert_unavailable(
        "a pool that cannot connect within its acquire timeout",
        &timed_out,
    );
    pool.close().await;
    assert_unavailable("a closed pool", &pool.acquire().await.expect_err("closed"));
    one.close().await.unwrap();
    drop_role(&db, &role).await;

    // What the database answers about a statement is not an outage, even under SQLSTATEs
    // that share a class with one (a statement's 55000 is an error, not a fatal refusal).
    let raise = |code: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DO $$ BEGIN RAISE EXCEPTION 'test' USING ERRCODE = '{code}'; END $$"
            )))
            .execute(&pool)
            .await
            .expect_err("raised")
        }
    };
    for code in [
        "55000", "57014", "25P03", "23505", "42501", "40001", "40P01", "55P03",
    ] {
        let e = raise(code).await;
        assert!(!txinbox::store::is_unavailable(&e), "{code}: {e}");
    }
    let missing = db
        .pool
        .execute("SELECT * FROM no_such_table")
        .await
        .expect_err("missing table");
    assert!(!txinbox::store::is_unavailable(&missing), "{missing}");
}

/// The same on a server of the test's own, which it shuts down, crashes and stops (the shared
/// server is never touched): 57P03 while shutting down, 57P02 after another backend crashed,
/// a refused TCP connection and a broken session once it is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_shutting_down_crashed_or_stopped_is_unavailable() {
    let cluster = txinbox_testing::cluster::PrivateCluster::start();
    let options = cluster.options();

    // Smart shutdown: sessions go on, new connections are refused with 57P03.
    let mut held = options.connect().await.unwrap();
    cluster.begin_shutdown();
    let refused = options.connect().await.expect_err("shutting down");
    assert_eq!(code(&refused).as_deref(), Some("57P03"), "{refused}");
    assert_unavailable("a server shutting down", &refused);
    held.execute("SELECT 1").await.unwrap();
    held.close().await.unwrap();
    cluster.wait_stopped();
    cluster.up();

    // Another backend crashes: the server ends every session (57P02) and restarts.
    let mut victim = options.connect().await.unwrap();
    let mut bystander = options.connect().await.unwrap();
    bystander.execute("BEGIN").await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut victim)
        .await
        .unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success(), "kill -9 the victim's backend");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let crashed = query_on(&mut bystander).await;
    assert_unavailable("a session ended by the crash of another backend", &crashed);
    drop(victim);

    // Stopped: open sessions break, connections are refused.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(options.clone());
    let mut held = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match options.connect().await {
                Ok(c) => break c,
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
    .await
    .expect("the server restarts after the crash");
    held.execute("BEGIN").await.unwrap();
    cluster.down();
    assert_unavailable("a session of a stopped server", &query_on(&mut held).await);
    let refused = options.connect().await.expect_err("stopped");
    assert!(matches!(refused, sqlx::Error::Io(_)), "{refused:?}");
    assert_unavailable("a connection to a stopped server", &refused);
    let timed_out = pool.acquire().await.expect_err("stopped");
    assert_unavailable("a pool whose server is stopped", &timed_out);
}
