//! A process killed between the handler and COMMIT, or between COMMIT and the response, then a
//! retry with the same key: one effect either way.
//!
//! The test re-runs its own binary as a child (`crash_child`) with `TXINBOX_CRASH_AT` set; the
//! child serves one request in-process and aborts at the crash point (`std::process::abort`:
//! for PostgreSQL the same as SIGKILL). Needs `--features crash-points` and PostgreSQL at
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`).
#![cfg(feature = "crash-points")]

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use sqlx::{Executor, PgPool};
use tower::ServiceExt;
use txinbox_http::{IdempotencyLayer, IdempotentTx};
use txinbox_testing::database::{Builder, TestDatabase};

const CHILD_DB: &str = "TXINBOX_HTTP_CRASH_DB";

/// The settings of the scratch databases here: 2 connections, no inbox session timeouts.
fn scratch() -> Builder {
    TestDatabase::builder("txinbox_http_crash")
        .max_connections(2)
        .inbox_timeouts(false)
}

async fn pool(name: &str) -> PgPool {
    scratch().open(name).await.pool().clone()
}

async fn fresh_db() -> String {
    let db = scratch().create().await;
    let p = db.pool();
    p.execute("CREATE TABLE effects (seq bigserial PRIMARY KEY)")
        .await
        .unwrap();
    p.close().await;
    db.name().to_owned()
}

async fn effect(mut tx: IdempotentTx) -> (StatusCode, &'static str) {
    sqlx::query("INSERT INTO effects DEFAULT VALUES")
        .execute(&mut *tx)
        .await
        .unwrap();
    (StatusCode::CREATED, "done")
}

fn app(pool: PgPool) -> Router {
    let layer = IdempotencyLayer::new(pool).principal(|_| Some("tenant".into()));
    Router::new().route("/effect", post(effect).layer(layer))
}

async fn request(app: &Router) -> (StatusCode, bool) {
    let r = Request::post("/effect")
        .header("idempotency-key", "crash-key")
        .body(Body::from("x"))
        .unwrap();
    let res = app.clone().oneshot(r).await.unwrap();
    (res.status(), res.headers().contains_key("idempotent-replayed"))
}

/// The child: one request; the crash point aborts the process before this returns.
#[tokio::test]
async fn crash_child() {
    let Ok(name) = std::env::var(CHILD_DB) else {
        return; // run directly: nothing to do
    };
    let p = pool(&name).await;
    let _ = request(&app(p)).await;
    unreachable!("the crash point should have aborted the process");
}

async fn count(p: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(p)
        .await
        .unwrap()
}

async fn kill_at(point: &str) -> (String, PgPool) {
    let name = fresh_db().await;
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_DB, &name)
        .env(txinbox::crash::ENV, point)
        .status()
        .unwrap();
    assert!(!status.success(), "the child must die at {point}");
    let p = pool(&name).await;
    // The server ends the dead client's session (and rolls back its transaction) on its own.
    for _ in 0..100 {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        .fetch_one(&p)
        .await
        .unwrap();
        if others == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (name, p)
}

#[tokio::test]
async fn killed_between_handler_and_commit_then_retry_is_one_effect() {
    let (_name, p) = kill_at(txinbox::crash::AFTER_HANDLER).await;
    assert_eq!(count(&p, "effects").await, 0, "nothing committed");
    assert_eq!(count(&p, "txinbox.http_idempotency").await, 0, "no stuck key");
    assert_eq!(
        request(&app(p.clone())).await,
        (StatusCode::CREATED, false),
        "the retry runs"
    );
    assert_eq!(
        request(&app(p.clone())).await,
        (StatusCode::CREATED, true),
        "then replays"
    );
    assert_eq!(count(&p, "effects").await, 1);
}

#[tokio::test]
async fn killed_between_commit_and_response_then_retry_is_one_effect() {
    let (_name, p) = kill_at(txinbox::crash::AFTER_COMMIT).await;
    assert_eq!(count(&p, "effects").await, 1, "committed before the kill");
    assert_eq!(
        request(&app(p.clone())).await,
        (StatusCode::CREATED, true),
        "the retry replays"
    );
    assert_eq!(count(&p, "effects").await, 1);
}

// The same on the embedded SQLite store: an aborted process leaves an uncommitted WAL tail,
// which SQLite discards when the file is opened again.

const CHILD_SQLITE: &str = "TXINBOX_HTTP_CRASH_SQLITE";

async fn sqlite_pool(path: &str) -> txinbox::sqlx::SqlitePool {
    use txinbox::sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(txinbox::SqliteInbox::connect_options(
            SqliteConnectOptions::new().filename(path).create_if_missing(true),
        ))
        .await
        .unwrap()
}

async fn sqlite_effect(mut tx: IdempotentTx<txinbox::sqlx::Sqlite>) -> (StatusCode, &'static str) {
    txinbox::sqlx::query("INSERT INTO effects DEFAULT VALUES")
        .execute(&mut *tx)
        .await
        .unwrap();
    (StatusCode::CREATED, "done")
}

fn sqlite_app(pool: txinbox::sqlx::SqlitePool) -> Router {
    let layer = IdempotencyLayer::new(pool).principal(|_| Some("tenant".into()));
    Router::new().route("/effect", post(sqlite_effect).layer(layer))
}

#[tokio::test]
async fn crash_child_sqlite() {
    let Ok(path) = std::env::var(CHILD_SQLITE) else {
        return;
    };
    let _ = request(&sqlite_app(sqlite_pool(&path).await)).await;
    unreachable!("the crash point should have aborted the process");
}

async fn sqlite_kill_at(point: &str) -> txinbox::sqlx::SqlitePool {
    static N: AtomicU32 = AtomicU32::new(0);
    let path = std::env::temp_dir().join(format!(
        "txinbox_http_crash_{}_{}.db",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let path = path.to_str().unwrap().to_owned();
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{path}{suffix}"));
    }
    let p = sqlite_pool(&path).await;
    txinbox::sqlite::migrate(&p).await.unwrap();
    p.execute("CREATE TABLE effects (seq INTEGER PRIMARY KEY)")
        .await
        .unwrap();
    p.close().await;
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child_sqlite", "--nocapture", "--test-threads=1"])
        .env(CHILD_SQLITE, &path)
        .env(txinbox::crash::ENV, point)
        .status()
        .unwrap();
    assert!(!status.success(), "the child must die at {point}");
    sqlite_pool(&path).await
}

async fn sqlite_count(p: &txinbox::sqlx::SqlitePool, table: &str) -> i64 {
    txinbox::sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(p)
        .await
        .unwrap()
}

#[tokio::test]
async fn sqlite_killed_between_handler_and_commit_then_retry_is_one_effect() {
    let p = sqlite_kill_at(txinbox::crash::AFTER_HANDLER).await;
    assert_eq!(sqlite_count(&p, "effects").await, 0, "nothing committed");
    assert_eq!(
        sqlite_count(&p, "txinbox_http_idempotency").await,
        0,
        "no stuck key"
    );
    let app = sqlite_app(p.clone());
    assert_eq!(request(&app).await, (StatusCode::CREATED, false));
    assert_eq!(request(&app).await, (StatusCode::CREATED, true));
    assert_eq!(sqlite_count(&p, "effects").await, 1);
}

#[tokio::test]
async fn sqlite_killed_between_commit_and_response_then_retry_is_one_effect() {
    let p = sqlite_kill_at(txinbox::crash::AFTER_COMMIT).await;
    assert_eq!(sqlite_count(&p, "effects").await, 1, "committed before the kill");
    assert_eq!(request(&sqlite_app(p.clone())).await, (StatusCode::CREATED, true));
    assert_eq!(sqlite_count(&p, "effects").await, 1);
}
