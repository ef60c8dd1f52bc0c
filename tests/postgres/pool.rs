//! The pool `PostgresInbox::connect` builds never hands a transaction a connection the server
//! has ended, even one used a moment ago.
//!
//! sqlx pings a connection each time the pool hands it out (`test_before_acquire`, kept on)
//! and each time it comes back: two round trips a transaction beside its statements. Skipping
//! the first for a connection used in the last second gained the one-message rows 5–15 % and
//! the batched, Kafka and HTTP rows nothing measurable (BENCHMARKS.md), and handed connections
//! ended by a switchover, a fast restart or `pg_terminate_backend` to transactions: 503s from
//! txinbox-http, a paused consumer, failures logged by the relay and the janitor, where the
//! ping replaces them unseen; after a silent partition, a BEGIN waiting on one until TCP gives
//! up. This test fails on such a pool.

use std::time::{Duration, Instant};

use sqlx::Connection;
use txinbox::store::InboxStore;
use txinbox::PostgresInbox;
use txinbox_testing::database::TestDatabase;

/// Runs one transaction on the inbox's pool and returns its session's backend PID.
async fn backend_pid(inbox: &PostgresInbox) -> Result<i32, String> {
    let mut tx = inbox.begin().await.map_err(|e| format!("BEGIN: {e}"))?;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| format!("a statement: {e}"))?;
    inbox.commit(tx).await.map_err(|e| format!("COMMIT: {e}"))?;
    Ok(pid)
}

#[tokio::test]
async fn a_connection_the_server_ended_a_moment_after_its_last_use_is_not_handed_out() {
    let db = TestDatabase::new("txinbox_pool").await;
    let inbox = PostgresInbox::connect(db.url(), 1).await.expect("connect");
    let mut admin = sqlx::PgConnection::connect(&txinbox_testing::database::server_url())
        .await
        .expect("an admin session");
    for round in 0..3 {
        let pid = backend_pid(&inbox).await.expect("a transaction on a live pool");
        // Back in the pool (after sqlx's return ping), then ended by the server.
        let deadline = Instant::now() + Duration::from_secs(5);
        while inbox.pool().num_idle() < 1 {
            assert!(
                Instant::now() < deadline,
                "the connection never came back to the pool"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&mut admin)
            .await
            .expect("pg_terminate_backend");
        assert!(ended, "round {round}: the pool's session {pid} was ended");
        while sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
            .bind(pid)
            .fetch_one(&mut admin)
            .await
            .expect("pg_stat_activity")
        {
            assert!(
                Instant::now() < deadline,
                "session {pid} outlived pg_terminate_backend"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A few milliseconds after its last use: handed out only after a ping, which finds it
        // dead, so the transaction runs on a new session.
        let next = backend_pid(&inbox)
            .await
            .unwrap_or_else(|e| panic!("round {round}: a transaction got the ended session {pid}: {e}"));
        assert_ne!(next, pid, "round {round}: the ended session was reused");
    }
    admin.close().await.ok();
    db.drop_database().await;
}
