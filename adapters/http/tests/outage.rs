//! txinbox-http while the database is unavailable, on a real PostgreSQL: a database that refuses
//! connections (`ALLOW_CONNECTIONS false`, SQLSTATE 55000), a role out of connections (53300),
//! a stopped server. Each answers 503 with `Retry-After` (`store-unavailable`), stores nothing,
//! and the same key retried once the database is back runs the handler exactly once.
//!
//! (Sessions ended under a running handler, 57P01: `postgres.rs`, `connection_lost_*`.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, Executor, PgPool};
use tower::ServiceExt;
use txinbox_http::{IdempotencyLayer, IdempotentTx};
use txinbox_testing::cluster::PrivateCluster;
use txinbox_testing::database::TestDatabase;

/// Writes one effect in the request's transaction and answers 201.
async fn pay(mut tx: IdempotentTx) -> http::Response<Body> {
    sqlx::query("INSERT INTO effects DEFAULT VALUES")
        .execute(&mut *tx)
        .await
        .unwrap();
    http::Response::builder()
        .status(StatusCode::CREATED)
        .body(Body::from("paid"))
        .unwrap()
}

fn app(pool: PgPool) -> Router {
    let layer = IdempotencyLayer::new(pool)
        .retry_after(Duration::from_secs(3))
        .principal(|_| Some("tenant".to_owned()));
    Router::new().route("/pay", post(pay).layer(layer))
}

async fn create_effects(pool: &PgPool) {
    pool.execute("CREATE TABLE effects (seq bigserial PRIMARY KEY)")
        .await
        .unwrap();
}

async fn effects(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// POSTs `/pay` with `key`; the status, the `Retry-After` header and the body.
async fn post_pay(app: &Router, key: &str) -> (StatusCode, Option<String>, String) {
    let req = Request::post("/pay")
        .header("idempotency-key", key)
        .body(Body::from("{}"))
        .unwrap();
    let res = app.clone().oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let retry_after = parts
        .headers
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = String::from_utf8_lossy(&body.collect().await.unwrap().to_bytes()).into_owned();
    (parts.status, retry_after, body)
}

/// 503, `Retry-After: 3`, `urn:txinbox:http:store-unavailable`.
fn assert_unavailable((status, retry_after, body): &(StatusCode, Option<String>, String)) {
    assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(retry_after.as_deref(), Some("3"), "{body}");
    assert!(body.contains("store-unavailable"), "{body}");
}

/// The same key, retried once the database is back: the handler runs once; a further retry
/// replays it.
async fn retried_once_back(app: &Router, key: &str, pool: &PgPool, effects_before: i64) {
    let (status, _, body) = post_pay(app, key).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(effects(pool).await, effects_before + 1);
    let (status, _, _) = post_pay(app, key).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(
        effects(pool).await,
        effects_before + 1,
        "a replay, no second effect"
    );
}

/// What a new user of `payments_api` saw: the database set to refuse connections and its
/// sessions ended answered 500 `store-failed` ("database … is not currently accepting
/// connections"). It is an outage: 503 with Retry-After, and the key works once it is back.
#[tokio::test]
async fn a_database_refusing_connections_is_503_then_the_key_runs_once() {
    let db = TestDatabase::builder("txinbox_http_t")
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .create()
        .await;
    create_effects(db.pool()).await;
    let app = app(db.pool().clone());
    let (status, _, _) = post_pay(&app, "before").await;
    assert_eq!(status, StatusCode::CREATED);

    db.refuse_connections().await;
    assert_unavailable(&post_pay(&app, "during").await);
    assert_unavailable(&post_pay(&app, "during").await);

    db.allow_connections().await;
    assert_eq!(effects(db.pool()).await, 1, "nothing of the refused requests");
    retried_once_back(&app, "during", db.pool(), 1).await;
}

/// The pool's role has used up its `CONNECTION LIMIT` (53300 "too many connections for role"):
/// 503, and the key runs once a connection is free.
#[tokio::test]
async fn a_role_out_of_connections_is_503_then_the_key_runs_once() {
    static N: AtomicUsize = AtomicUsize::new(0);
    let db = TestDatabase::builder("txinbox_http_t")
        .max_connections(2)
        .create()
        .await;
    create_effects(db.pool()).await;
    let role = format!(
        "txinbox_http_limit_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    );
    db.pool()
        .execute(sqlx::AssertSqlSafe(format!(
            "CREATE ROLE {role} LOGIN CONNECTION LIMIT 1 IN ROLE pg_read_all_data, pg_write_all_data"
        )))
        .await
        .unwrap();
    let options: PgConnectOptions = db.pool().connect_options().as_ref().clone().username(&role);
    let held = options.connect().await.expect("the role's one connection");
    let limited = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(options);
    let app = app(limited.clone());

    assert_unavailable(&post_pay(&app, "k").await);

    held.close().await.unwrap();
    retried_once_back(&app, "k", db.pool(), 0).await;
    limited.close().await;
    db.pool()
        .execute(sqlx::AssertSqlSafe(format!("DROP ROLE {role}")))
        .await
        .unwrap();
}

/// The server stops (a private cluster: the shared one is never stopped): 503, and the key runs
/// once the server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_is_503_then_the_key_runs_once() {
    let cluster = PrivateCluster::start();
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(1))
        .connect_with(cluster.options())
        .await
        .unwrap();
    txinbox::postgres::migrate(&pool).await.unwrap();
    create_effects(&pool).await;
    let app = app(pool.clone());
    let (status, _, _) = post_pay(&app, "before").await;
    assert_eq!(status, StatusCode::CREATED);

    cluster.down();
    assert_unavailable(&post_pay(&app, "during").await);

    cluster.up();
    retried_once_back(&app, "during", &pool, 1).await;
}
