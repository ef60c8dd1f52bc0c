//! txinbox-http on the embedded SQLite store: one effect per key under concurrency, 422 on a
//! reused key, scopes, 5xx rolls back without burning the key, expiry and purge, and a
//! database that cannot be opened → 503. No server needed: each test uses its own file.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::{Extension, Router};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use txinbox::sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use txinbox::sqlx::{self, Executor, Sqlite, SqlitePool};
use txinbox_http::{purge_expired, IdempotencyContext, IdempotencyLayer, IdempotentTx};

async fn db() -> (SqlitePool, std::path::PathBuf) {
    static N: AtomicU32 = AtomicU32::new(0);
    let path = std::env::temp_dir().join(format!(
        "txinbox_http_{}_{}.db",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    let options = txinbox::SqliteInbox::connect_options(
        SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true),
    );
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .unwrap();
    txinbox::sqlite::migrate(&pool).await.unwrap();
    pool.execute(
        "CREATE TABLE effects (seq INTEGER PRIMARY KEY, principal TEXT NOT NULL, amount INTEGER NOT NULL, derived_id TEXT)",
    )
    .await
    .unwrap();
    (pool, path)
}

async fn pay(
    mut tx: IdempotentTx<Sqlite>,
    Extension(cx): Extension<IdempotencyContext>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response<Body> {
    let amount: i64 = std::str::from_utf8(&body).unwrap().parse().unwrap();
    sqlx::query("INSERT INTO effects (principal, amount, derived_id) VALUES (?1, ?2, ?3)")
        .bind(cx.principal().unwrap_or(""))
        .bind(amount)
        .bind(cx.derive_id("effect"))
        .execute(&mut *tx)
        .await
        .unwrap();
    if headers.contains_key("x-swallow") {
        // The effect again under its own primary key: a UNIQUE violation, whose error the
        // handler ignores. SQLite undoes this statement only; the transaction goes on.
        let _ = sqlx::query(
            "INSERT INTO effects SELECT * FROM effects WHERE seq = (SELECT max(seq) FROM effects)",
        )
        .execute(&mut *tx)
        .await
        .expect_err("a UNIQUE violation");
    }
    if let Some(ms) = headers.get("x-sleep-ms") {
        tokio::time::sleep(Duration::from_millis(ms.to_str().unwrap().parse().unwrap())).await;
    }
    let status = if headers.contains_key("x-fail") { 503 } else { 201 };
    Response::builder()
        .status(status)
        .header("content-type", "text/plain")
        .header("location", format!("/p/{amount}"))
        .body(Body::from(format!("paid {amount}")))
        .unwrap()
}

fn app(layer: IdempotencyLayer<Sqlite>) -> Router {
    let layer = layer.principal(|p| p.headers.get("x-tenant")?.to_str().ok().map(str::to_owned));
    Router::new()
        .route("/pay", post(pay).layer(layer.clone()))
        .route("/pay/{account}", post(pay).layer(layer.clone()))
        .route("/maybe", post(pay).layer(layer.optional()))
}

fn req(tenant: &str, key: &str, amount: i64) -> http::request::Builder {
    let _ = amount;
    Request::post("/pay")
        .header("x-tenant", tenant)
        .header("idempotency-key", key)
}

async fn send(
    app: &Router,
    tenant: &str,
    key: &str,
    amount: i64,
    extra: &[(&str, &str)],
) -> (StatusCode, HeaderMap, String) {
    let mut b = req(tenant, key, amount);
    for (k, v) in extra {
        b = b.header(*k, *v);
    }
    let res = app
        .clone()
        .oneshot(b.body(Body::from(amount.to_string())).unwrap())
        .await
        .unwrap();
    let (parts, body) = res.into_parts();
    let body = String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap();
    (parts.status, parts.headers, body)
}

async fn count(pool: &SqlitePool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_concurrent_64_requests_one_key_one_effect() {
    let (pool, _path) = db().await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            send(&app, "t", "k", 7, &[("x-sleep-ms", "20")]).await
        }));
    }
    let mut fresh = 0;
    for t in tasks {
        let (s, h, b) = t.await.unwrap();
        assert_eq!((s, b.as_str()), (StatusCode::CREATED, "paid 7"));
        if !h.contains_key("idempotent-replayed") {
            fresh += 1;
        }
    }
    assert_eq!(fresh, 1);
    assert_eq!(count(&pool, "effects").await, 1);
}

#[tokio::test]
async fn sqlite_replay_mismatch_scopes_and_5xx() {
    let (pool, _path) = db().await;
    let app = app(IdempotencyLayer::from(&txinbox::SqliteInbox::new(pool.clone())));
    // 5xx: rolled back, key not used up.
    assert_eq!(
        send(&app, "t", "k", 1, &[("x-fail", "1")]).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        (
            count(&pool, "effects").await,
            count(&pool, "txinbox_http_idempotency").await
        ),
        (0, 0)
    );
    let (s, h, _) = send(&app, "t", "k", 1, &[]).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(!h.contains_key("idempotent-replayed"));
    // Replay with the stored headers.
    let (s, h, b) = send(&app, "t", "\"k\"", 1, &[]).await;
    assert_eq!((s, b.as_str()), (StatusCode::CREATED, "paid 1"));
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(h["location"], "/p/1");
    assert_eq!(h["content-type"], "text/plain");
    // Same key, other body.
    let (s, _, b) = send(&app, "t", "k", 2, &[]).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(b.contains("idempotency-key-reused"));
    // Other tenant, same key: another request.
    let (s, h, _) = send(&app, "u", "k", 1, &[]).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(!h.contains_key("idempotent-replayed"));
    assert_eq!(count(&pool, "effects").await, 2);
}

#[tokio::test]
async fn sqlite_expiry_and_purge() {
    let (pool, _path) = db().await;
    let short = app(IdempotencyLayer::new(pool.clone()).ttl(Duration::from_millis(1)));
    assert_eq!(send(&short, "t", "e", 1, &[]).await.0, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (s, h, _) = send(&short, "t", "e", 2, &[]).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(!h.contains_key("idempotent-replayed"), "expired: new again");
    assert_eq!(count(&pool, "effects").await, 2);
    let long = app(IdempotencyLayer::new(pool.clone()));
    assert_eq!(send(&long, "t", "live", 1, &[]).await.0, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(purge_expired(&pool, 10).await.unwrap(), 1);
    assert_eq!(count(&pool, "txinbox_http_idempotency").await, 1);
}

#[tokio::test]
async fn sqlite_closed_pool_is_503_and_nothing_stored() {
    let (pool, path) = db().await;
    let closed = SqlitePoolOptions::new()
        .connect_with(SqliteConnectOptions::new().filename(&path))
        .await
        .unwrap();
    closed.close().await;
    let app = app(IdempotencyLayer::new(closed));
    let (s, h, b) = send(&app, "t", "k", 1, &[]).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(h.contains_key("retry-after"));
    assert!(b.contains("store-unavailable"));
    assert_eq!(count(&pool, "effects").await, 0);
}

/// `POST path` with tenant `t`, key `key` and amount 10; the status and whether it was a replay.
async fn post_at(app: &Router, path: &str, key: &str) -> (StatusCode, bool, String) {
    let r = Request::post(path)
        .header("x-tenant", "t")
        .header("idempotency-key", key)
        .body(Body::from("10"))
        .unwrap();
    let res = app.clone().oneshot(r).await.unwrap();
    let replayed = res.headers().contains_key("idempotent-replayed");
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, String::from_utf8_lossy(&body).into_owned())
}

/// Issue 26, item 1, on SQLite: one key on two resources of `/pay/{account}` is 422 for the
/// second, never a replay of the first; the same resource percent-encoded is a replay.
#[tokio::test]
async fn sqlite_same_key_on_another_resource_of_the_route_is_422_not_a_replay() {
    let (pool, _path) = db().await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    assert_eq!(post_at(&app, "/pay/a1", "k").await.0, StatusCode::CREATED);
    let (s, replayed, b) = post_at(&app, "/pay/a2", "k").await;
    assert_eq!((s, replayed), (StatusCode::UNPROCESSABLE_ENTITY, false), "{b}");
    assert!(b.contains("idempotency-key-reused"));
    assert_eq!(
        post_at(&app, "/pay/%61%31", "k").await,
        (StatusCode::CREATED, true, "paid 10".into())
    );
    assert_eq!(count(&pool, "effects").await, 1);
}

/// Issue 26, item 1, on SQLite: after the key expired, the same key on another resource runs,
/// with other derived IDs.
#[tokio::test]
async fn sqlite_derived_ids_differ_for_two_resources_of_one_route() {
    let (pool, _path) = db().await;
    let app = app(IdempotencyLayer::new(pool.clone()).ttl(Duration::from_millis(1)));
    assert_eq!(post_at(&app, "/pay/a1", "k").await.0, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(post_at(&app, "/pay/a2", "k").await.0, StatusCode::CREATED);
    let ids: Vec<String> = sqlx::query_scalar("SELECT derived_id FROM effects ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ids.len(), 2);
    assert_ne!(ids[0], ids[1], "a1 and a2 share an outbox ID");
}

/// The path a nested router strips is part of the request: `/t1/api/pay` and `/t2/api/pay`
/// are two resources of the route `/{tenant}/api/pay`, though the inner router sees `/pay`.
#[tokio::test]
async fn sqlite_a_nested_routers_prefix_is_part_of_the_request() {
    let (pool, _path) = db().await;
    let app = Router::new().nest("/{tenant}/api", app(IdempotencyLayer::new(pool.clone())));
    assert_eq!(post_at(&app, "/t1/api/pay", "k").await.0, StatusCode::CREATED);
    let (s, replayed, b) = post_at(&app, "/t2/api/pay", "k").await;
    assert_eq!((s, replayed), (StatusCode::UNPROCESSABLE_ENTITY, false), "{b}");
    assert_eq!(
        post_at(&app, "/t1/api/pay", "k").await,
        (StatusCode::CREATED, true, "paid 10".into())
    );
    assert_eq!(count(&pool, "effects").await, 1);
}

/// Issue 26, item 3: a handler that ignores a failed statement and answers 201. SQLite does
/// not abort the transaction after a failed statement, so without a check the first
/// statement's effect and the key would commit. As on PostgreSQL: 500 `response-not-stored`,
/// nothing committed, and the retry runs once.
#[tokio::test]
async fn sqlite_ignored_failed_statement_commits_nothing() {
    let (pool, _path) = db().await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let (s, _, b) = send(&app, "t", "ks", 9, &[("x-swallow", "1")]).await;
    assert_eq!(
        (
            count(&pool, "effects").await,
            count(&pool, "txinbox_http_idempotency").await
        ),
        (0, 0),
        "the first statement's effect and the key were committed ({s}: {b})"
    );
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(b.contains("response-not-stored"), "{b}");
    let (s, h, _) = send(&app, "t", "ks", 9, &[]).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(!h.contains_key("idempotent-replayed"));
    assert_eq!(count(&pool, "effects").await, 1);
}

/// The same on an optional route called without a key: the handler's plain transaction must
/// not commit half its work either.
#[tokio::test]
async fn sqlite_ignored_failed_statement_without_a_key_commits_nothing() {
    let (pool, _path) = db().await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let r = Request::post("/maybe")
        .header("x-tenant", "t")
        .header("x-swallow", "1")
        .body(Body::from("9"))
        .unwrap();
    let res = app.clone().oneshot(r).await.unwrap();
    let status = res.status();
    assert_eq!(
        count(&pool, "effects").await,
        0,
        "half the handler's work committed ({status})"
    );
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
}
