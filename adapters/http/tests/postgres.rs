//! txinbox-http against a real PostgreSQL: one effect per key under concurrency, 422 on a
//! reused key, scopes, 5xx/panic roll back without burning the key, 503 when the database is
//! down, size limits, expiry.
//!
//! Needs PostgreSQL: `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`);
//! each test creates its own database.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Query;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde::Deserialize;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use tower::ServiceExt;
use txinbox_http::{purge_expired, IdempotencyContext, IdempotencyLayer, IdempotentTx, OversizedResponse};
use txinbox_testing::database::TestDatabase;

/// A fresh database with txinbox's migrations and an `effects` table.
async fn db(max_connections: u32) -> PgPool {
    let db = TestDatabase::builder("txinbox_http_t")
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(30))
        .inbox_timeouts(false)
        .create()
        .await;
    let pool = db.pool().clone();
    pool.execute(
        "CREATE TABLE effects (seq bigserial PRIMARY KEY, principal text NOT NULL, route text NOT NULL,
                               amount bigint NOT NULL, derived_id text)",
    )
    .await
    .unwrap();
    pool
}

#[derive(Deserialize)]
struct Pay {
    amount: i64,
}

/// Writes one effect; `x-fail: 500` answers 500 after writing, `x-panic` panics after writing,
/// `x-sleep-ms` (header, not fingerprinted) holds the transaction open; a negative amount is a
/// 400 (stored); `x-swallow` runs a failing statement and ignores the error.
async fn pay(
    mut tx: IdempotentTx,
    Extension(cx): Extension<IdempotencyContext>,
    headers: HeaderMap,
    Json(p): Json<Pay>,
) -> Response<Body> {
    if p.amount < 0 {
        return Response::builder()
            .status(StatusCode::BAD_REQUEST)
            .body(Body::from("negative"))
            .unwrap();
    }
    sqlx::query("INSERT INTO effects (principal, route, amount, derived_id) VALUES ($1, $2, $3, $4)")
        .bind(cx.principal().unwrap_or(""))
        .bind(cx.route())
        .bind(p.amount)
        .bind(cx.derive_id("effect"))
        .execute(&mut *tx)
        .await
        .unwrap();
    if let Some(ms) = headers.get("x-sleep-ms") {
        let ms: u64 = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if headers.contains_key("x-deferred-violation") {
        sqlx::query("INSERT INTO kids (parent) VALUES (999)")
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    if headers.contains_key("x-swallow") {
        let _ = sqlx::query("SELECT 1/0").execute(&mut *tx).await;
    }
    if headers.contains_key("x-panic") {
        panic!("handler panics after writing its effect");
    }
    if headers.get("x-fail").is_some_and(|v| v == "500") {
        return Response::builder()
            .status(StatusCode::INTERNAL_SERVER_ERROR)
            .body(Body::from("provider down"))
            .unwrap();
    }
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("location", format!("/payments/{}", p.amount))
        .header("x-not-stored", "1")
        .body(Body::from(format!("{{\"amount\":{}}}", p.amount)))
        .unwrap()
}

/// A response of `size` bytes in 1 KiB chunks, streamed.
async fn big(
    mut tx: IdempotentTx,
    Query(q): Query<std::collections::HashMap<String, usize>>,
) -> Response<Body> {
    sqlx::query("INSERT INTO effects (principal, route, amount) VALUES ('', '/big', 1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let size = q["size"];
    let chunks = (0..size.div_ceil(1024)).map(move |i| {
        let n = 1024.min(size - i * 1024);
        Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'x'; n]))
    });
    Response::new(Body::from_stream(futures::stream::iter(chunks)))
}

fn app(layer: IdempotencyLayer) -> Router {
    let layer = layer.principal(|parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    Router::new()
        .route("/pay", post(pay).layer(layer.clone()))
        .route("/pay/{account}", post(pay).layer(layer.clone()))
        .route("/maybe", post(pay).layer(layer.clone().optional()))
        .route("/big", get(big).layer(layer))
}

fn req(tenant: &str, key: Option<&str>, amount: i64) -> http::request::Builder {
    let _ = amount;
    let mut b = Request::post("/pay")
        .header("x-tenant", tenant)
        .header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b
}

fn body(amount: i64) -> Body {
    Body::from(format!("{{\"amount\":{amount}}}"))
}

async fn send(app: &Router, r: Request<Body>) -> (StatusCode, HeaderMap, bytes::Bytes) {
    let res = app.clone().oneshot(r).await.unwrap();
    let (parts, b) = res.into_parts();
    (parts.status, parts.headers, b.collect().await.unwrap().to_bytes())
}

async fn effects(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn records(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM txinbox.http_idempotency")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn problem_code(b: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(b).expect("problem+json");
    v["code"].as_str().unwrap().to_owned()
}

/// `n` requests with one key at once: exactly one effect, every answer a 201 (the first, or
/// a replay of it) or a 409 with Retry-After.
async fn concurrent_one_key(n: usize, lock_wait: Duration) -> (usize, usize, usize) {
    let pool = db(16).await;
    let app = app(IdempotencyLayer::new(pool.clone()).lock_wait(lock_wait));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            let r = req("t1", Some("\"k-concurrent\""), 7)
                .header("x-sleep-ms", "200")
                .body(body(7))
                .unwrap();
            send(&app, r).await
        }));
    }
    let (mut fresh, mut replayed, mut conflicts) = (0, 0, 0);
    for t in tasks {
        let (status, headers, b) = t.await.unwrap();
        match status {
            StatusCode::CREATED => {
                assert_eq!(&b[..], b"{\"amount\":7}");
                if headers.get("idempotent-replayed").is_some_and(|v| v == "true") {
                    replayed += 1;
                } else {
                    fresh += 1;
                }
            }
            StatusCode::CONFLICT => {
                assert!(headers.contains_key("retry-after"));
                assert_eq!(problem_code(&b), "idempotency-key-in-flight");
                conflicts += 1;
            }
            other => panic!("unexpected {other}: {}", String::from_utf8_lossy(&b)),
        }
    }
    assert_eq!(fresh, 1, "exactly one request ran the handler");
    assert_eq!(effects(&pool).await, 1, "exactly one effect");
    assert_eq!(records(&pool).await, 1);
    pool.close().await;
    (fresh, replayed, conflicts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_64_requests_one_key_one_effect() {
    let (f, r, c) = concurrent_one_key(64, Duration::from_secs(10)).await;
    println!("64 concurrent: {f} executed, {r} replayed, {c} conflicts (409)");
    assert_eq!(
        f + r,
        64,
        "with a long lock wait every duplicate waits and is replayed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_512_requests_one_key_one_effect_short_wait() {
    let (f, r, c) = concurrent_one_key(512, Duration::from_millis(50)).await;
    println!("512 concurrent, 50 ms lock wait: {f} executed, {r} replayed, {c} conflicts (409)");
    assert_eq!(f + r + c, 512);
    assert!(c > 0, "a 50 ms wait behind a 200 ms handler gives 409s");
}

#[tokio::test]
async fn replay_returns_stored_status_headers_and_body() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::from(&txinbox::PostgresInbox::new(pool.clone())));
    let (s1, h1, b1) = send(&app, req("t1", Some("\"abc\""), 5).body(body(5)).unwrap()).await;
    assert_eq!(s1, StatusCode::CREATED);
    assert!(!h1.contains_key("idempotent-replayed"));
    // The bare form of the same key.
    let (s2, h2, b2) = send(&app, req("t1", Some("abc"), 5).body(body(5)).unwrap()).await;
    assert_eq!(s2, StatusCode::CREATED);
    assert_eq!(b1, b2);
    assert_eq!(h2["idempotent-replayed"], "true");
    assert_eq!(h2["content-type"], "application/json");
    assert_eq!(h2["location"], "/payments/5");
    assert!(
        !h2.contains_key("x-not-stored"),
        "only the configured headers are stored"
    );
    assert_eq!(effects(&pool).await, 1);
    // A 4xx is stored too.
    let (s3, _, _) = send(&app, req("t1", Some("neg"), -1).body(body(-1)).unwrap()).await;
    let (s4, h4, b4) = send(&app, req("t1", Some("neg"), -1).body(body(-1)).unwrap()).await;
    assert_eq!((s3, s4), (StatusCode::BAD_REQUEST, StatusCode::BAD_REQUEST));
    assert_eq!(h4["idempotent-replayed"], "true");
    assert_eq!(&b4[..], b"negative");
    assert_eq!(records(&pool).await, 2);
}

#[tokio::test]
async fn same_key_other_request_is_422_and_no_effect() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let (s1, _, _) = send(&app, req("t1", Some("k"), 10).body(body(10)).unwrap()).await;
    assert_eq!(s1, StatusCode::CREATED);
    let (s2, h2, b2) = send(&app, req("t1", Some("k"), 20).body(body(20)).unwrap()).await;
    assert_eq!(s2, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(h2["content-type"], "application/problem+json");
    assert_eq!(problem_code(&b2), "idempotency-key-reused");
    // Another query string is another request too.
    let r = Request::post("/pay?x=1")
        .header("x-tenant", "t1")
        .header("idempotency-key", "k")
        .body(body(10))
        .unwrap();
    assert_eq!(send(&app, r).await.0, StatusCode::UNPROCESSABLE_ENTITY);
    let amounts: Vec<i64> = sqlx::query_scalar("SELECT amount FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(amounts, vec![10]);
}

#[tokio::test]
async fn two_scopes_one_key_two_effects() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    for tenant in ["a", "b"] {
        let (s, h, _) = send(&app, req(tenant, Some("shared"), 3).body(body(3)).unwrap()).await;
        assert_eq!(s, StatusCode::CREATED);
        assert!(
            !h.contains_key("idempotent-replayed"),
            "tenant {tenant} is not replayed"
        );
    }
    // Another route with the same key and tenant: another scope.
    let r = Request::post("/pay/acc-1")
        .header("x-tenant", "a")
        .header("idempotency-key", "shared")
        .header("content-type", "application/json")
        .body(body(3))
        .unwrap();
    let (s, h, _) = send(&app, r).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(!h.contains_key("idempotent-replayed"));
    assert_eq!(effects(&pool).await, 3);
    let routes: Vec<String> =
        sqlx::query_scalar("SELECT route FROM txinbox.http_idempotency ORDER BY route, principal")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        routes,
        ["/pay", "/pay", "/pay/{account}"],
        "the matched route, not the path"
    );
    // Derived IDs differ per scope.
    let ids: i64 = sqlx::query_scalar("SELECT count(DISTINCT derived_id) FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(ids, 3);
}

#[tokio::test]
async fn server_error_then_retry_is_one_effect() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let (s, _, b) = send(
        &app,
        req("t1", Some("k5"), 9)
            .header("x-fail", "500")
            .body(body(9))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(&b[..], b"provider down", "the handler's own 5xx is passed on");
    assert_eq!(
        (effects(&pool).await, records(&pool).await),
        (0, 0),
        "rolled back"
    );
    let (s, h, _) = send(&app, req("t1", Some("k5"), 9).body(body(9)).unwrap()).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(!h.contains_key("idempotent-replayed"));
    let (s, h, _) = send(&app, req("t1", Some("k5"), 9).body(body(9)).unwrap()).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(effects(&pool).await, 1);
}

#[tokio::test]
async fn panic_rolls_back_and_the_key_can_be_retried() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let (s, _, b) = send(
        &app,
        req("t1", Some("kp"), 9)
            .header("x-panic", "1")
            .body(body(9))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(problem_code(&b), "handler-panicked");
    assert_eq!((effects(&pool).await, records(&pool).await), (0, 0));
    let (s, _, _) = send(&app, req("t1", Some("kp"), 9).body(body(9)).unwrap()).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(effects(&pool).await, 1);
}

#[tokio::test]
async fn ignored_failed_statement_commits_nothing() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let (s, _, b) = send(
        &app,
        req("t1", Some("ks"), 9)
            .header("x-swallow", "1")
            .body(body(9))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(problem_code(&b), "response-not-stored");
    assert_eq!((effects(&pool).await, records(&pool).await), (0, 0));
}

/// An optional route called without a key: PostgreSQL rolls the aborted transaction back at
/// COMMIT without an error, so the handler's 201 would claim effects that are gone.
#[tokio::test]
async fn ignored_failed_statement_without_a_key_is_500_not_a_201_for_nothing() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let r = Request::post("/maybe")
        .header("x-tenant", "t1")
        .header("content-type", "application/json")
        .header("x-swallow", "1")
        .body(body(9))
        .unwrap();
    let (s, _, b) = send(&app, r).await;
    assert_eq!(effects(&pool).await, 0);
    assert_eq!(
        s,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the response claims effects that were rolled back: {}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(problem_code(&b), "response-not-stored");
}

#[tokio::test]
async fn database_down_is_503_and_nothing_stored() {
    // Unreachable server.
    let unreachable = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy("postgres://postgres@127.0.0.1:1/none")
        .unwrap();
    let app_down = app(IdempotencyLayer::new(unreachable).retry_after(Duration::from_secs(2)));
    let (s, h, b) = send(&app_down, req("t1", Some("k"), 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(h["retry-after"], "2");
    assert_eq!(problem_code(&b), "store-unavailable");

    // A closed pool on the real database: nothing is stored.
    let pool = db(4).await;
    let closed = PgPoolOptions::new()
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    closed.close().await;
    let app_closed = app(IdempotencyLayer::new(closed));
    let (s, h, _) = send(&app_closed, req("t1", Some("k"), 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(h.contains_key("retry-after"));
    assert_eq!((effects(&pool).await, records(&pool).await), (0, 0));
    // Back up: the same key runs.
    let (s, _, _) = send(
        &app(IdempotencyLayer::new(pool.clone())),
        req("t1", Some("k"), 1).body(body(1)).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(effects(&pool).await, 1);
}

#[tokio::test]
async fn connection_lost_before_commit_then_retry_is_one_effect() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    // Kill the request's backend while the handler holds the transaction open.
    let killer = {
        let pool = pool.clone();
        tokio::spawn(async move {
            // Polls until the handler sits in its transaction, then kills that backend.
            for _ in 0..400 {
                let killed: Vec<bool> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = current_database() AND pid <> pg_backend_pid()
                       AND state = 'idle in transaction' AND query LIKE 'INSERT INTO effects%'",
                )
                .fetch_all(&pool)
                .await
                .unwrap();
                if !killed.is_empty() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            panic!("the handler's transaction never showed up");
        })
    };
    let (s, h, b) = send(
        &app,
        req("t1", Some("kk"), 4)
            .header("x-sleep-ms", "1000")
            .body(body(4))
            .unwrap(),
    )
    .await;
    killer.await.unwrap();
    assert_eq!(
        s,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert!(h.contains_key("retry-after"));
    assert_eq!((effects(&pool).await, records(&pool).await), (0, 0));
    let (s, _, _) = send(&app, req("t1", Some("kk"), 4).body(body(4)).unwrap()).await;
    assert_eq!(s, StatusCode::CREATED);
    assert_eq!(effects(&pool).await, 1);
}

#[tokio::test]
async fn in_flight_duplicate_gets_409_with_retry_after_then_replay() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()).lock_wait(Duration::from_millis(100)));
    let first = {
        let app = app.clone();
        tokio::spawn(async move {
            send(
                &app,
                req("t1", Some("kf"), 2)
                    // Long enough that the duplicate's claim, even on a loaded CI machine, comes
                    // while this one still holds the key (800 ms was not: it replayed once).
                    .header("x-sleep-ms", "3000")
                    .body(body(2))
                    .unwrap(),
            )
            .await
        })
    };
    // The first request holds the key once its handler has written its effect: a session merely
    // idle in transaction may still be between BEGIN and the claim, and under load the
    // duplicate then claims first (seen in CI: 201 instead of 409).
    for _ in 0..400 {
        let holding: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
               AND pid <> pg_backend_pid() AND state = 'idle in transaction'
               AND query LIKE 'INSERT INTO effects%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if holding > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (s, h, b) = send(&app, req("t1", Some("kf"), 2).body(body(2)).unwrap()).await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(h["retry-after"], "1");
    assert_eq!(problem_code(&b), "idempotency-key-in-flight");
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    let (s, h, _) = send(&app, req("t1", Some("kf"), 2).body(body(2)).unwrap()).await;
    assert_eq!(
        (s, &h["idempotent-replayed"]),
        (StatusCode::CREATED, &"true".parse().unwrap())
    );
    assert_eq!(effects(&pool).await, 1);
}

#[tokio::test]
async fn missing_invalid_and_optional_keys() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let (s, _, b) = send(&app, req("t1", None, 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(problem_code(&b), "idempotency-key-missing");
    let long = "k".repeat(256);
    let (s, _, b) = send(&app, req("t1", Some(&long), 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(problem_code(&b), "idempotency-key-invalid");
    let (s, _, _) = send(&app, req("t1", Some("\"open"), 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let max = "k".repeat(255);
    let (s, _, _) = send(&app, req("t1", Some(&max), 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::CREATED);
    // No principal.
    let r = Request::post("/pay")
        .header("idempotency-key", "x")
        .body(body(1))
        .unwrap();
    let (s, _, b) = send(&app, r).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(problem_code(&b), "no-principal");
    assert_eq!(effects(&pool).await, 1);
    // Optional route without a key: runs (in a transaction), every time, no record.
    for _ in 0..2 {
        let r = Request::post("/maybe")
            .header("x-tenant", "t1")
            .header("content-type", "application/json")
            .body(body(1))
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::CREATED);
    }
    // Optional route with a key: idempotent.
    for _ in 0..2 {
        let r = Request::post("/maybe")
            .header("x-tenant", "t1")
            .header("idempotency-key", "m")
            .header("content-type", "application/json")
            .body(body(1))
            .unwrap();
        assert_eq!(send(&app, r).await.0, StatusCode::CREATED);
    }
    assert_eq!(effects(&pool).await, 4);
    assert_eq!(records(&pool).await, 2);
}

#[tokio::test]
async fn oversized_request_is_413_and_never_runs() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()).max_request_bytes(64));
    let big = format!("{{\"amount\":1,\"pad\":\"{}\"}}", "x".repeat(100));
    let (s, _, b) = send(
        &app,
        req("t1", Some("k"), 1).body(Body::from(big.clone())).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(problem_code(&b), "request-too-large");
    // Without Content-Length (streamed): refused as well.
    let stream = futures::stream::iter(vec![Ok::<_, std::io::Error>(bytes::Bytes::from(big))]);
    let r = req("t1", Some("k"), 1).body(Body::from_stream(stream)).unwrap();
    assert_eq!(send(&app, r).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!((effects(&pool).await, records(&pool).await), (0, 0));
}

#[tokio::test]
async fn oversized_and_streaming_responses_are_refused_or_stored_without_body() {
    let pool = db(4).await;
    let big = |key: &str, size: usize| {
        Request::get(format!("/big?size={size}"))
            .header("x-tenant", "t1")
            .header("idempotency-key", key)
            .body(Body::empty())
            .unwrap()
    };
    // A streamed body under the limit is stored whole.
    let app_refuse = app(IdempotencyLayer::new(pool.clone()).max_response_bytes(4096));
    let (s, _, b) = send(&app_refuse, big("small", 3000)).await;
    assert_eq!((s, b.len()), (StatusCode::OK, 3000));
    let (s, h, b) = send(&app_refuse, big("small", 3000)).await;
    assert_eq!((s, b.len()), (StatusCode::OK, 3000));
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(effects(&pool).await, 1);
    // Over the limit, Refuse (the default): rolled back, the key is not used up.
    let (s, _, b) = send(&app_refuse, big("large", 10_000)).await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(problem_code(&b), "response-not-stored");
    assert_eq!((effects(&pool).await, records(&pool).await), (1, 1));
    // Over the limit, StoreHeadersOnly: the first response is whole, the replay has no body.
    let app_headers = app(IdempotencyLayer::new(pool.clone())
        .max_response_bytes(4096)
        .oversized_response(OversizedResponse::StoreHeadersOnly));
    let (s, _, b) = send(&app_headers, big("large", 10_000)).await;
    assert_eq!((s, b.len()), (StatusCode::OK, 10_000), "never cut");
    let (s, h, b) = send(&app_headers, big("large", 10_000)).await;
    assert_eq!((s, b.len()), (StatusCode::OK, 0));
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(h["idempotent-replayed-body"], "omitted");
    assert_eq!(effects(&pool).await, 2);
}

#[tokio::test]
async fn expired_key_runs_afresh_and_is_purged() {
    let pool = db(4).await;
    let short = app(IdempotencyLayer::new(pool.clone()).ttl(Duration::from_millis(1)));
    assert_eq!(
        send(&short, req("t1", Some("e"), 1).body(body(1)).unwrap())
            .await
            .0,
        StatusCode::CREATED
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (s, h, _) = send(&short, req("t1", Some("e"), 2).body(body(2)).unwrap()).await;
    assert_eq!(
        s,
        StatusCode::CREATED,
        "an expired key is new again, even with another body"
    );
    assert!(!h.contains_key("idempotent-replayed"));
    assert_eq!(effects(&pool).await, 2);
    assert_eq!(records(&pool).await, 1);
    // A live record stays.
    let long = app(IdempotencyLayer::new(pool.clone()));
    assert_eq!(
        send(&long, req("t1", Some("live"), 1).body(body(1)).unwrap())
            .await
            .0,
        StatusCode::CREATED
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(purge_expired(&pool, 1).await.unwrap(), 1);
    assert_eq!(records(&pool).await, 1);
}

/// The retention janitor (the one the inbox and the outbox use) deletes expired records on its
/// schedule while the service runs, in batches, keeps live ones, and stops when told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_janitor_deletes_expired_records_on_its_schedule_and_stops() {
    let pool = db(4).await;
    let short = app(IdempotencyLayer::new(pool.clone()).ttl(Duration::from_millis(1)));
    let long = app(IdempotencyLayer::new(pool.clone()));
    for i in 0..5 {
        let key = format!("short-{i}");
        let (s, _, _) = send(&short, req("t1", Some(key.as_str()), 1).body(body(1)).unwrap()).await;
        assert_eq!(s, StatusCode::CREATED);
    }
    let (s, _, _) = send(&long, req("t1", Some("live"), 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(20)).await;

    let schedule = txinbox::janitor::Schedule {
        interval: Duration::from_millis(50),
        batch: 2,
        pause: Duration::from_millis(1),
    };
    let running = std::sync::Arc::new(txinbox_http::janitor(pool.clone(), schedule).unwrap()).spawn();
    let until_records = |n: i64| {
        let pool = pool.clone();
        async move {
            for _ in 0..500 {
                if records(&pool).await == n {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("never {n} records");
        }
    };
    until_records(1).await;
    // Expired later: the next pass takes it.
    let (s, _, _) = send(&short, req("t1", Some("later"), 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::CREATED);
    until_records(1).await;
    running.stop().await;
    let (s, _, _) = send(&short, req("t1", Some("after-stop"), 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(records(&pool).await, 2, "a stopped janitor deletes nothing");
    let live: i64 =
        sqlx::query_scalar("SELECT count(*) FROM txinbox.http_idempotency WHERE idempotency_key = 'live'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(live, 1, "a live record stays");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_on_an_expired_key_take_it_over_once() {
    let pool = db(16).await;
    let short = app(IdempotencyLayer::new(pool.clone()).ttl(Duration::from_millis(1)));
    assert_eq!(
        send(&short, req("t1", Some("x"), 1).body(body(1)).unwrap())
            .await
            .0,
        StatusCode::CREATED
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let long = app(IdempotencyLayer::new(pool.clone()).lock_wait(Duration::from_secs(10)));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let long = long.clone();
        tasks.push(tokio::spawn(async move {
            let r = req("t1", Some("x"), 2)
                .header("x-sleep-ms", "100")
                .body(body(2))
                .unwrap();
            send(&long, r).await
        }));
    }
    let mut fresh = 0;
    for t in tasks {
        let (s, h, _) = t.await.unwrap();
        assert_eq!(s, StatusCode::CREATED);
        if !h.contains_key("idempotent-replayed") {
            fresh += 1;
        }
    }
    assert_eq!(
        fresh, 1,
        "one request takes the expired key over, the rest replay it"
    );
    assert_eq!(effects(&pool).await, 2);
}

#[tokio::test]
async fn commit_refused_by_a_deferred_constraint_is_500_and_nothing_stored() {
    let pool = db(4).await;
    pool.execute(
        "CREATE TABLE parents (id int PRIMARY KEY);
         CREATE TABLE kids (parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED);",
    )
    .await
    .unwrap();
    let app = app(IdempotencyLayer::new(pool.clone()));
    let r = req("t1", Some("kd"), 1)
        .header("x-deferred-violation", "1")
        .body(body(1))
        .unwrap();
    let (s, h, b) = send(&app, r).await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        !h.contains_key("retry-after"),
        "a refused COMMIT is known: rolled back"
    );
    assert_eq!(problem_code(&b), "response-not-stored");
    assert_eq!((effects(&pool).await, records(&pool).await), (0, 0));
    // The key is not used up.
    assert_eq!(
        send(&app, req("t1", Some("kd"), 1).body(body(1)).unwrap())
            .await
            .0,
        StatusCode::CREATED
    );
    assert_eq!(effects(&pool).await, 1);
}

#[tokio::test]
async fn connection_lost_during_commit_is_503_then_retry_is_one_effect() {
    let pool = db(4).await;
    // The first COMMIT that reaches this deferred trigger ends its own session: the client sees
    // the connection drop while committing (outcome unknown to it; here, rolled back).
    pool.execute(
        "CREATE SEQUENCE die_once;
         CREATE FUNCTION die_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF nextval('die_once') = 1 THEN PERFORM pg_terminate_backend(pg_backend_pid()); END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER die_at_commit AFTER INSERT ON effects
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION die_at_commit();",
    )
    .await
    .unwrap();
    let app = app(IdempotencyLayer::new(pool.clone()));
    let (s, h, b) = send(&app, req("t1", Some("kc"), 1).body(body(1)).unwrap()).await;
    assert_eq!(
        s,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert!(h.contains_key("retry-after"));
    assert_eq!(problem_code(&b), "store-unavailable");
    assert!(
        String::from_utf8_lossy(&b).contains("while committing"),
        "the COMMIT path"
    );
    assert_eq!((effects(&pool).await, records(&pool).await), (0, 0));
    let (s, h, _) = send(&app, req("t1", Some("kc"), 1).body(body(1)).unwrap()).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(!h.contains_key("idempotent-replayed"));
    let (_, h, _) = send(&app, req("t1", Some("kc"), 1).body(body(1)).unwrap()).await;
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(effects(&pool).await, 1);
}

/// A `POST` to `path` with tenant `t1`, key `key` and amount 10.
fn at(path: &str, key: &str) -> Request<Body> {
    Request::post(path)
        .header("x-tenant", "t1")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body(10))
        .unwrap()
}

/// Issue 26, item 1: one key on two resources of one route (`/pay/{account}`). The second is
/// another request: 422, never the first one's response, and nothing charged. The same
/// resource spelled with a percent-encoded unreserved character is the same request (a
/// replay); another case is another resource (422).
#[tokio::test]
async fn same_key_on_another_resource_of_the_route_is_422_not_a_replay() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let (s, h, _) = send(&app, at("/pay/a1", "k")).await;
    assert_eq!(s, StatusCode::CREATED);
    assert!(!h.contains_key("idempotent-replayed"));
    let (s, h, b) = send(&app, at("/pay/a2", "k")).await;
    assert_eq!(
        (s, h.get("idempotent-replayed")),
        (StatusCode::UNPROCESSABLE_ENTITY, None),
        "a2 must not get a1's response: {}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(problem_code(&b), "idempotency-key-reused");
    let (s, h, _) = send(&app, at("/pay/%61%31", "k")).await;
    assert_eq!(s, StatusCode::CREATED, "a1 percent-encoded is a1");
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(
        send(&app, at("/pay/A1", "k")).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(effects(&pool).await, 1, "only a1 was charged, once");
}

/// Issue 26, item 1: `IdempotencyContext::derive_id` differs for two resources of one route.
/// The handler runs for both only when the key expired in between (a key is new again after
/// its TTL); their outbox IDs must not collide, or the downstream inbox drops the second.
#[tokio::test]
async fn derived_ids_differ_for_two_resources_of_one_route() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()).ttl(Duration::from_millis(1)));
    assert_eq!(send(&app, at("/pay/a1", "k")).await.0, StatusCode::CREATED);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(send(&app, at("/pay/a2", "k")).await.0, StatusCode::CREATED);
    let ids: Vec<String> = sqlx::query_scalar("SELECT derived_id FROM effects ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ids.len(), 2);
    assert_ne!(ids[0], ids[1], "a1 and a2 share an outbox ID");
}

/// The fingerprint of txinbox-http before it covered the path: method, route, canonical query
/// (pairs sorted as sent), body.
fn legacy_fingerprint(method: &str, route: &str, query: &str, body: &[u8]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut pairs: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
    pairs.sort_unstable();
    let query = pairs.join("&");
    let mut h = Sha256::new();
    for part in [method.as_bytes(), route.as_bytes(), query.as_bytes(), body] {
        h.update((part.len() as u32).to_be_bytes());
        h.update(part);
    }
    h.finalize().to_vec()
}

/// Records stored before the upgrade carry the old fingerprint. On a route without
/// parameters it still identified the request: the retry is replayed. On a route with
/// parameters it cannot tell which resource it was for: 422, never a replay, nothing run.
#[tokio::test]
async fn records_stored_before_the_upgrade_are_replayed_only_where_they_identify_the_request() {
    let pool = db(4).await;
    let app = app(IdempotencyLayer::new(pool.clone()));
    let body = b"{\"amount\":10}";
    for route in ["/pay", "/pay/{account}"] {
        sqlx::query(
            "INSERT INTO txinbox.http_idempotency
                 (principal, route, idempotency_key, fingerprint, status, header_names, header_values,
                  body, body_size, expires_at)
             VALUES ('t1', $1, 'old', $2, 201, '{content-type}', ARRAY['text/plain'::bytea],
                     'stored before', 13, now() + interval '1 hour')",
        )
        .bind(route)
        .bind(legacy_fingerprint("POST", route, "", body))
        .execute(&pool)
        .await
        .unwrap();
    }
    let (s, h, b) = send(&app, at("/pay", "old")).await;
    assert_eq!((s, &b[..]), (StatusCode::CREATED, &b"stored before"[..]));
    assert_eq!(h["idempotent-replayed"], "true");
    let (s, h, b) = send(&app, at("/pay/a2", "old")).await;
    assert_eq!(
        (s, h.get("idempotent-replayed")),
        (StatusCode::UNPROCESSABLE_ENTITY, None),
        "an old record of /pay/{{account}} may be another account's: {}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(problem_code(&b), "idempotency-key-reused");
    assert_eq!(effects(&pool).await, 0);
}
