//! The ledger's handler and the crash matrix's reconciliation against a real PostgreSQL
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/postgres`; each test creates and
//! drops its own database). Messages come from txinbox's in-process `MemoryBroker`, which
//! redelivers like a broker that lost acknowledgements.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use txinbox::memory::MemoryBroker;
use txinbox::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use txinbox::sqlx::{self, ConnectOptions as _, Executor as _, PgPool};
use txinbox::{Consumer, PostgresInbox};
use txinbox_demos::payments::{create_tables, Ledger, Payment};
use txinbox_demos::reconcile::{observe, Expected, Reconciliation};

struct TestDb {
    admin: PgConnectOptions,
    name: String,
    pool: PgPool,
}

impl TestDb {
    async fn new() -> TestDb {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
        let admin: PgConnectOptions = url.parse().expect("DATABASE_URL parses");
        let name = format!(
            "ledger_t_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let mut conn = admin
            .connect()
            .await
            .expect("connect to DATABASE_URL (is PostgreSQL running? scripts/test starts it)");
        conn.execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .await
        .unwrap();
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .connect_with(PostgresInbox::connect_options(admin.clone().database(&name)))
            .await
            .unwrap();
        txinbox::postgres::migrate(&pool).await.unwrap();
        TestDb { admin, name, pool }
    }

    async fn drop_database(self) {
        self.pool.close().await;
        let mut conn = self.admin.connect().await.unwrap();
        conn.execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .await
        .unwrap();
    }
}

/// 200 payments over 7 accounts, every 5th published twice, and two malformed payloads; the
/// broker loses 30% of the acknowledgements, so many messages are delivered again after their
/// transaction committed.
async fn apply_through_a_lossy_broker(db: &TestDb) -> Expected {
    let broker = MemoryBroker::with_seed("payments", 9);
    broker.set_lose_ack_probability(0.3);
    let mut expected = Expected::default();
    for i in 0..200 {
        let id = format!("pay-{i}");
        let payment = Payment {
            account: format!("acct-{}", i % 7),
            amount_cents: (i as i64 * 37) % 1_000 - 300,
        };
        let payload = serde_json::to_vec(&payment).unwrap();
        let copies = if i % 5 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            broker.publish(id.clone(), payload.clone());
            expected.messages += 1;
        }
        expected.events.insert(id, payment);
    }
    for (id, payload) in [
        ("bad-json", &b"{oops"[..]),
        ("bad-account", br#"{"account":" ","amount_cents":1}"#),
    ] {
        broker.publish(id, payload.to_vec());
        expected.malformed.insert(id.to_string());
        expected.messages += 1;
    }
    broker.close();
    let consumer = Consumer::builder("ledger")
        .source(broker.source())
        .inbox(PostgresInbox::new(db.pool.clone()))
        .handler(Ledger)
        .build()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), consumer.run())
        .await
        .expect("the consumer drains the broker within 60 s")
        .expect("no fatal error");
    let dead = broker.dead_letters();
    assert_eq!(
        dead.len(),
        2,
        "both malformed payloads dead-lettered, nothing else"
    );
    assert!(dead.iter().all(|(_, dl)| dl.reason.as_str() == "undecodable"));
    assert!(
        broker.stats().acks_lost > 0,
        "the broker redelivered committed messages"
    );
    expected
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_ledger_applies_each_payment_once_and_the_check_agrees() {
    let db = TestDb::new().await;
    // Two instances starting at once both create the tables.
    let (a, b) = tokio::join!(create_tables(&db.pool), create_tables(&db.pool));
    a.unwrap();
    b.unwrap();
    let expected = apply_through_a_lossy_broker(&db).await;

    let observed = observe(&db.pool).await.unwrap();
    let verdict = Reconciliation::compare(&expected, &observed);
    assert!(verdict.is_clean(), "{:#?}", verdict.problems(5));
    assert_eq!(observed.entries.len(), 200);
    assert_eq!(verdict.actual_total, expected.total());
    db.drop_database().await;
}

/// The check must fail on a database that is wrong: a second application of one payment (entry
/// and balance), then a lost one. Rows are changed by hand, as a broken inbox would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_check_catches_a_doubled_and_a_lost_payment_in_the_database() {
    let db = TestDb::new().await;
    create_tables(&db.pool).await.unwrap();
    let expected = apply_through_a_lossy_broker(&db).await;

    // Apply pay-7 a second time, as a redelivery without the inbox would.
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO ledger_entries (event_id, account, amount_cents) SELECT event_id, account, amount_cents FROM ledger_entries WHERE event_id = 'pay-7'")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("UPDATE accounts SET balance_cents = balance_cents + (SELECT amount_cents FROM ledger_entries WHERE event_id = 'pay-7' LIMIT 1) WHERE account = 'acct-0'")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let verdict = Reconciliation::compare(&expected, &observe(&db.pool).await.unwrap());
    assert!(!verdict.is_clean());
    assert_eq!(verdict.doubled_count(), 1);
    assert_eq!(verdict.doubled.get("pay-7"), Some(&2));
    assert_eq!(verdict.wrong_balances.len(), 1);
    assert!(verdict.lost.is_empty());

    // Now lose pay-8 entirely.
    sqlx::query("DELETE FROM ledger_entries WHERE event_id = 'pay-8'")
        .execute(&db.pool)
        .await
        .unwrap();
    let verdict = Reconciliation::compare(&expected, &observe(&db.pool).await.unwrap());
    assert_eq!(verdict.lost, vec!["pay-8".to_string()]);
    db.drop_database().await;
}
