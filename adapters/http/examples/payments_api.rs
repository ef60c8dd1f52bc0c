//! A payments API whose `Idempotency-Key` makes client retries safe: the key's claim, the
//! payment, the balance update, the outbox message and the stored response commit in one
//! database transaction, so a retried `POST /payments` charges once and replays its answer.
//!
//! Contract:
//!
//! - `POST /payments` with `Authorization: Bearer <tenant>`, `Idempotency-Key: <key>` (required)
//!   and JSON `{"account": "<id>", "amount_cents": <i64>}` → `201`
//!   `{"payment_id", "account", "amount_cents", "balance_cents"}` (the balance after this
//!   payment); a body that is not a payment → `400`. The tenant scopes the key and the
//!   accounts. A replay carries `Idempotent-Replayed: true`; the same key with another body is
//!   `422`; see the txinbox-http crate docs for the whole table.
//! - `GET /accounts/<id>` with the same `Authorization` → `200 {"account", "balance_cents"}`
//!   (`0` for an unknown account).
//! - Each payment writes an outbox message (destination `--topic`, key = tenant/account) in its
//!   transaction. With `--publish-kafka BROKERS` a relay publishes them to that Kafka topic;
//!   with `--publish-amqp URL` to the RabbitMQ queue of that name (declared durable if
//!   missing). A txinbox consumer deduplicating on the message ID (Kafka header `message-id`,
//!   AMQP `message_id`) gets each payment once. Without either they stay in the outbox table.
//! - Ctrl-C or SIGTERM stops it gracefully (in-flight requests finish).
//!
//! Store: PostgreSQL with `--database-url` or `DATABASE_URL` (tables in the schema `payments`,
//! created if missing); without a URL, the embedded SQLite store in `--sqlite-path`
//! (`payments_api.db`), where the same contract holds and concurrent requests queue for
//! SQLite's one writer.
//!
//! `--bench` (PostgreSQL) measures `POST /payments` in process with the layer beside the same
//! endpoint without it and prints a table instead of serving.
//!
//! Run with:
//!
//! ```text
//! cargo run --release --example payments_api -- --listen 127.0.0.1:8080   # embedded store
//! cargo run --release --example payments_api -- --listen 127.0.0.1:8080 \
//!     --database-url postgres://postgres@127.0.0.1:5432/postgres [--publish-kafka 127.0.0.1:9092]
//! cargo run --release --example payments_api -- --publish-amqp amqp://guest:guest@127.0.0.1:5672/%2f
//! cargo run --release --example payments_api -- --bench --database-url URL [--requests 5000 --concurrency 8 --rounds 3]
//! curl -si localhost:8080/payments -H 'Authorization: Bearer acme' -H 'Idempotency-Key: k1' \
//!     -H 'Content-Type: application/json' -d '{"account":"a1","amount_cents":500}'
//! ```
//!
//! `RUST_LOG` (default `info`) controls the logs, written to stderr; the directives of
//! `txinbox::redact::LOG_DIRECTIVES` are added whatever it says, so no dependency logs a
//! credential.

use std::net::SocketAddr;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use clap::Parser;
use serde::Deserialize;
use serde_json::json;
use tracing_subscriber::EnvFilter;
use txinbox::outbox::{OutboxMessage, OutboxPool, Relay, RelayConfig, RelayError};
use txinbox::sqlx::{self, Executor as _, PgPool, Sqlite, SqlitePool};
use txinbox_http::{IdempotencyContext, IdempotencyLayer, IdempotentTx};

#[derive(Parser, Debug)]
#[command(about = "An idempotent payments API on txinbox-http")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// PostgreSQL URL; without one the embedded SQLite store at `--sqlite-path` is used. TLS
    /// as with libpq: `?sslmode=verify-full&sslrootcert=/path/to/ca.pem`. Its value is never
    /// printed.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// The embedded store's file (when no database URL is given).
    #[arg(long, default_value = "payments_api.db")]
    sqlite_path: std::path::PathBuf,
    /// Publish the outbox to these Kafka brokers (host:port[,host:port]).
    #[arg(long, conflicts_with = "publish_amqp")]
    publish_kafka: Option<String>,
    /// Publish the outbox to RabbitMQ at this URL (amqp://user:password@host:5672/vhost), to
    /// the queue named by `--topic`.
    #[arg(long)]
    publish_amqp: Option<String>,
    /// Kafka topic, or RabbitMQ queue, of the payment events (the outbox destination).
    #[arg(long, default_value = "payments.created")]
    topic: String,
    /// Database connections.
    #[arg(long, default_value_t = 16)]
    max_connections: u32,
    /// Instead of serving: measure POST /payments with the layer beside the same endpoint
    /// without it, in process (no sockets), and print a table.
    #[arg(long)]
    bench: bool,
    /// `--bench`: requests per scenario.
    #[arg(long, default_value_t = 5000)]
    requests: usize,
    /// `--bench`: requests in flight.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// `--bench`: rounds, interleaved across scenarios (the median round is shown).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

#[derive(Clone)]
struct App {
    pool: PgPool,
    topic: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Payment {
    account: String,
    amount_cents: i64,
}

fn tenant(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let t = v.strip_prefix("Bearer ")?.trim();
    (!t.is_empty() && t.len() <= 128).then(|| t.to_owned())
}

fn problem(status: StatusCode, code: &str, detail: &str) -> Response {
    let body = json!({
        "type": format!("urn:payments-api:{code}"),
        "title": detail,
        "status": status.as_u16(),
        "code": code,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

async fn create_payment(
    State(app): State<App>,
    Extension(cx): Extension<IdempotencyContext>,
    mut tx: IdempotentTx,
    body: Bytes,
) -> Result<Response, Response> {
    let tenant = cx.principal().unwrap_or_default().to_owned();
    // Derived from (tenant, route, key): the same on every retry of this request.
    let payment_id = cx
        .derive_id("payment")
        .expect("the key is required on this route");
    let event_id = cx
        .derive_id("payment-created")
        .expect("the key is required on this route");
    pay(&mut tx, &app.topic, &tenant, &payment_id, &event_id, &body).await
}

/// The same endpoint without the layer (for `--bench`): its own transaction, random IDs.
async fn create_payment_plain(
    State(app): State<App>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Response> {
    let Some(tenant) = tenant(&headers) else {
        return Err(problem(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "send Authorization: Bearer <tenant>",
        ));
    };
    let id = format!("{:032x}", rand_u128());
    // `--bench` reference: what the layer does, written by hand in the endpoint (its BEGIN with
    // a lock timeout, the claim of the key, the fingerprint, the response stored before
    // COMMIT): the layer's cost beyond the writes an idempotency key needs is the difference.
    let by_hand = headers.contains_key("x-bench-by-hand");
    let mut tx = if by_hand {
        app.pool
            .begin_with("BEGIN; SET LOCAL lock_timeout = '5000ms'")
            .await
    } else {
        app.pool.begin().await
    }
    .map_err(db_failed)?;
    if by_hand {
        use sha2::Digest;
        let fingerprint = sha2::Sha256::digest(&body);
        sqlx::query(
            "INSERT INTO txinbox.http_idempotency (principal, route, idempotency_key, fingerprint, expires_at)
             VALUES ($1, 'POST /bench/plain-payments', $2, $3, now() + interval '1 day')
             ON CONFLICT (principal, route, idempotency_key) DO NOTHING RETURNING 1",
        )
        .bind(&tenant)
        .bind(&id)
        .bind(&fingerprint[..])
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_failed)?;
    }
    let mut res = pay(&mut tx, &app.topic, &tenant, &id, &format!("{id}-created"), &body).await?;
    if by_hand {
        let (parts, body) = res.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX)
            .await
            .expect("a buffered body");
        let names: Vec<&str> = parts.headers.keys().map(|n| n.as_str()).collect();
        let values: Vec<&[u8]> = parts.headers.values().map(|v| v.as_bytes()).collect();
        sqlx::query(
            "UPDATE txinbox.http_idempotency
             SET status = $3, header_names = $4, header_values = $5, body = $6, body_size = $7
             WHERE principal = $1 AND route = 'POST /bench/plain-payments' AND idempotency_key = $2
                 AND status = 0
             RETURNING 1",
        )
        .bind(&tenant)
        .bind(&id)
        .bind(parts.status.as_u16() as i16)
        .bind(&names)
        .bind(&values)
        .bind(&bytes[..])
        .bind(bytes.len() as i64)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_failed)?;
        res = Response::from_parts(parts, axum::body::Body::from(bytes));
    }
    tx.commit().await.map_err(db_failed)?;
    Ok(res)
}

fn rand_u128() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let s = std::collections::hash_map::RandomState::new();
    let (mut a, mut b) = (s.build_hasher(), s.build_hasher());
    a.write_u8(1);
    b.write_u8(2);
    (a.finish() as u128) << 64 | b.finish() as u128
}

/// A database error of a handler. An outage (`txinbox::store::is_unavailable`: unreachable,
/// refusing connections, the session ended) is a 503 with `Retry-After`, as the layer's own
/// answer; anything else a 500. Either way the transaction is rolled back and the key is not
/// used up: the client retries with the same key.
fn db_failed(e: sqlx::Error) -> Response {
    if txinbox::store::is_unavailable(&e) {
        tracing::warn!(error = %e, "the database is unavailable; rolled back");
        let mut res = problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the database is unavailable; retry later with the same key",
        );
        res.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return res;
    }
    tracing::error!(error = %e, "payment failed; rolled back");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "the payment failed; retry with the same key",
    )
}

/// The payment's effects on `conn`: payment row, balance, outbox message; the 201 response.
async fn pay(
    conn: &mut sqlx::PgConnection,
    topic: &str,
    tenant: &str,
    payment_id: &str,
    event_id: &str,
    body: &[u8],
) -> Result<Response, Response> {
    let p = parse_payment(body)?;
    sqlx::query(
        "INSERT INTO payments.payments (payment_id, tenant, account, amount_cents) VALUES ($1, $2, $3, $4)",
    )
    .bind(payment_id)
    .bind(tenant)
    .bind(&p.account)
    .bind(p.amount_cents)
    .execute(&mut *conn)
    .await
    .map_err(db_failed)?;
    let balance: i64 = sqlx::query_scalar(
        "INSERT INTO payments.accounts AS a (tenant, account, balance_cents) VALUES ($1, $2, $3)
         ON CONFLICT (tenant, account) DO UPDATE SET balance_cents = a.balance_cents + EXCLUDED.balance_cents
         RETURNING balance_cents",
    )
    .bind(tenant)
    .bind(&p.account)
    .bind(p.amount_cents)
    .fetch_one(&mut *conn)
    .await
    .map_err(db_failed)?;
    let message = payment_event(topic, tenant, payment_id, event_id, &p);
    txinbox::outbox::write(&mut *conn, &message)
        .await
        .map_err(outbox_failed)?;
    Ok(created(payment_id, &p, balance))
}

/// The payment's event: one outbox message, keyed by tenant and account (their order).
fn payment_event(topic: &str, tenant: &str, payment_id: &str, event_id: &str, p: &Payment) -> OutboxMessage {
    let event = json!({"tenant": tenant, "payment_id": payment_id, "account": p.account, "amount_cents": p.amount_cents});
    OutboxMessage::new(event_id, topic, event.to_string()).with_key(format!("{tenant}/{}", p.account))
}

fn outbox_failed(e: txinbox::outbox::WriteError) -> Response {
    tracing::error!(error = %e, "outbox write failed; rolled back");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "the payment failed; retry with the same key",
    )
}

async fn get_account(State(app): State<App>, headers: HeaderMap, Path(account): Path<String>) -> Response {
    let Some(tenant) = tenant(&headers) else {
        return problem(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "send Authorization: Bearer <tenant>",
        );
    };
    let balance: Result<Option<i64>, _> =
        sqlx::query_scalar("SELECT balance_cents FROM payments.accounts WHERE tenant = $1 AND account = $2")
            .bind(&tenant)
            .bind(&account)
            .fetch_optional(&app.pool)
            .await;
    match balance {
        Ok(b) => Json(json!({"account": account, "balance_cents": b.unwrap_or(0)})).into_response(),
        Err(e) => db_failed(e),
    }
}

/// The router; `/bench/plain-payments` is the same endpoint without the layer (`--bench` only).
fn router(pool: PgPool, topic: String, bench: bool) -> Router {
    let idempotent = IdempotencyLayer::new(pool.clone()).principal(|parts| tenant(&parts.headers));
    let mut r = Router::new();
    if bench {
        r = r.route("/bench/plain-payments", post(create_payment_plain));
    }
    r.route("/payments", post(create_payment).layer(idempotent))
        .route("/accounts/{id}", get(get_account))
        .with_state(App { pool, topic })
}

async fn setup(pool: &PgPool) -> Result<(), Box<dyn std::error::Error>> {
    txinbox::postgres::migrate(pool).await?;
    pool.execute(
        "CREATE SCHEMA IF NOT EXISTS payments;
         CREATE TABLE IF NOT EXISTS payments.accounts (
             tenant text NOT NULL, account text NOT NULL, balance_cents bigint NOT NULL,
             PRIMARY KEY (tenant, account));
         CREATE TABLE IF NOT EXISTS payments.payments (
             payment_id text PRIMARY KEY, tenant text NOT NULL, account text NOT NULL,
             amount_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now());",
    )
    .await?;
    Ok(())
}

/// `--bench`: requests/s and latency percentiles per scenario, same process, same pool; once
/// through tower in process, once over loopback sockets (HTTP/1.1 keep-alive, one connection
/// per worker).
async fn bench(pool: PgPool, requests: usize, concurrency: usize, rounds: usize) {
    let app = router(pool, "payments.bench".into(), true);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(std::future::IntoFuture::into_future(axum::serve(
        listener,
        app.clone(),
    )));
    let run_id = format!("{:08x}", rand_u128() as u32);
    for socket in [false, true] {
        let how = if socket {
            "over loopback sockets (HTTP/1.1 keep-alive, a connection per worker)"
        } else {
            "in process (tower oneshot, no sockets)"
        };
        println!();
        println!(
            "POST /payments {how}: {requests} requests per scenario and round, {concurrency} in flight, \
             {rounds} interleaved rounds, the round with the median requests/s shown"
        );
        println!("| scenario | requests/s | p50 ms | p99 ms | statuses |");
        println!("|---|---:|---:|---:|---|");
        let scenarios = [
            "without layer",
            "without layer, the layer's statements by hand",
            "with layer, new keys",
            "with layer, replays",
        ];
        let mut results: Vec<Vec<(f64, f64, f64, String)>> = vec![Vec::new(); scenarios.len()];
        for round in 0..rounds {
            for (n, scenario) in scenarios.iter().copied().enumerate() {
                let run_id = format!("{run_id}-{socket}-{round}");
                if scenario == "with layer, replays" {
                    // The key to replay exists before timing starts.
                    let _ = Transport::new(socket, &app, addr)
                        .await
                        .call(&bench_parts(scenario, &run_id, 0))
                        .await;
                }
                results[n].push(measure(socket, &app, addr, scenario, &run_id, requests, concurrency).await);
            }
        }
        for (scenario, mut rows) in scenarios.iter().zip(results) {
            rows.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (rps, p50, p99, statuses) = &rows[rows.len() / 2];
            println!("| {scenario} | {rps:.0} | {p50:.2} | {p99:.2} | {statuses} |");
        }
    }
}

/// One scenario once: (requests/s, p50 ms, p99 ms, status counts).
async fn measure(
    socket: bool,
    app: &Router,
    addr: SocketAddr,
    scenario: &'static str,
    run_id: &str,
    requests: usize,
    concurrency: usize,
) -> (f64, f64, f64, String) {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = std::time::Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (app, next, run_id) = (app.clone(), next.clone(), run_id.to_owned());
        workers.push(tokio::spawn(async move {
            let mut transport = Transport::new(socket, &app, addr).await;
            let mut lat = Vec::new();
            let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= requests {
                    return (lat, statuses);
                }
                let parts = bench_parts(scenario, &run_id, i);
                let t = std::time::Instant::now();
                let status = transport.call(&parts).await;
                lat.push(t.elapsed());
                *statuses.entry(status).or_default() += 1;
            }
        }));
    }
    let mut lat = Vec::new();
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for w in workers {
        let (l, s) = w.await.unwrap();
        lat.extend(l);
        for (k, v) in s {
            *statuses.entry(k).or_default() += v;
        }
    }
    let statuses: Vec<String> = statuses.iter().map(|(k, v)| format!("{v}×{k}")).collect();
    let elapsed = started.elapsed();
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)].as_secs_f64() * 1000.0;
    (
        requests as f64 / elapsed.as_secs_f64(),
        pct(0.50),
        pct(0.99),
        statuses.join(", "),
    )
}

/// One benchmark request: path, headers, body.
struct BenchRequest {
    path: &'static str,
    headers: Vec<(&'static str, String)>,
    body: String,
}

fn bench_parts(scenario: &str, run_id: &str, i: usize) -> BenchRequest {
    let (path, key) = match scenario {
        "without layer" | "without layer, the layer's statements by hand" => ("/bench/plain-payments", None),
        "with layer, new keys" => ("/payments", Some(format!("bench-{run_id}-{i}"))),
        _ => ("/payments", Some(format!("bench-{run_id}-replayed"))),
    };
    let mut headers = vec![
        ("authorization", "Bearer bench".to_owned()),
        ("content-type", "application/json".to_owned()),
    ];
    if let Some(k) = key {
        headers.push(("idempotency-key", k));
    }
    if scenario.contains("by hand") {
        headers.push(("x-bench-by-hand", "1".to_owned()));
    }
    // 64 accounts: contention on balances like a real workload, not one hot row.
    let account = if scenario.ends_with("replays") { 0 } else { i % 64 };
    let body = json!({"account": format!("acct-{account}"), "amount_cents": 100}).to_string();
    BenchRequest { path, headers, body }
}

/// How the benchmark reaches the router.
enum Transport {
    InProcess(Router),
    Socket(tokio::io::BufReader<tokio::net::TcpStream>),
}

impl Transport {
    async fn new(socket: bool, app: &Router, addr: SocketAddr) -> Transport {
        if socket {
            let s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.set_nodelay(true).unwrap();
            Transport::Socket(tokio::io::BufReader::new(s))
        } else {
            Transport::InProcess(app.clone())
        }
    }

    /// Sends the request, reads the whole response; its status.
    async fn call(&mut self, r: &BenchRequest) -> u16 {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        use tower::ServiceExt;
        match self {
            Transport::InProcess(app) => {
                let mut b = axum::http::Request::post(r.path);
                for (k, v) in &r.headers {
                    b = b.header(*k, v);
                }
                let res = app
                    .clone()
                    .oneshot(b.body(axum::body::Body::from(r.body.clone())).unwrap())
                    .await
                    .unwrap();
                let status = res.status().as_u16();
                let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await;
                status
            }
            Transport::Socket(s) => {
                let mut wire = format!(
                    "POST {} HTTP/1.1\r\nhost: bench\r\ncontent-length: {}\r\n",
                    r.path,
                    r.body.len()
                );
                for (k, v) in &r.headers {
                    wire.push_str(&format!("{k}: {v}\r\n"));
                }
                wire.push_str("\r\n");
                wire.push_str(&r.body);
                s.get_mut().write_all(wire.as_bytes()).await.unwrap();
                let mut line = String::new();
                s.read_line(&mut line).await.unwrap();
                let status = line.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
                let mut length = 0usize;
                loop {
                    line.clear();
                    s.read_line(&mut line).await.unwrap();
                    if line == "\r\n" || line.is_empty() {
                        break;
                    }
                    if let Some((k, v)) = line.split_once(':') {
                        if k.eq_ignore_ascii_case("content-length") {
                            length = v.trim().parse().unwrap();
                        }
                    }
                }
                let mut body = vec![0; length];
                s.read_exact(&mut body).await.unwrap();
                status
            }
        }
    }
}

/// The embedded store: the same contract on SQLite.
async fn serve_embedded(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let path = &args.sqlite_path;
    use txinbox::sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    let options = txinbox::SqliteInbox::connect_options(
        SqliteConnectOptions::new().filename(path).create_if_missing(true),
    );
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    txinbox::sqlite::migrate(&pool).await?;
    pool.execute(
        "CREATE TABLE IF NOT EXISTS payments_accounts (
             tenant TEXT NOT NULL, account TEXT NOT NULL, balance_cents INTEGER NOT NULL,
             PRIMARY KEY (tenant, account));
         CREATE TABLE IF NOT EXISTS payments_payments (
             payment_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, account TEXT NOT NULL,
             amount_cents INTEGER NOT NULL);",
    )
    .await?;
    tracing::info!(path = %path.display(), "embedded SQLite store");
    let relay = start_relay(pool.clone(), args).await?;
    let idempotent = IdempotencyLayer::new(pool.clone()).principal(|parts| tenant(&parts.headers));
    let app = Router::new()
        .route("/payments", post(create_payment_sqlite).layer(idempotent))
        .route("/accounts/{id}", get(get_account_sqlite))
        .with_state(EmbeddedApp {
            pool: pool.clone(),
            topic: args.topic.clone(),
        });
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(listen = %listener.local_addr()?, "payments_api listening");
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await;
    // The relay finishes its round in progress (at most twice its publish timeout) either way.
    relay.stop().await;
    pool.close().await;
    Ok(served?)
}

#[derive(Clone)]
struct EmbeddedApp {
    pool: SqlitePool,
    topic: String,
}

async fn create_payment_sqlite(
    State(app): State<EmbeddedApp>,
    Extension(cx): Extension<IdempotencyContext>,
    mut tx: IdempotentTx<Sqlite>,
    body: Bytes,
) -> Result<Response, Response> {
    let p = parse_payment(&body)?;
    let tenant = cx.principal().unwrap_or_default().to_owned();
    let payment_id = cx
        .derive_id("payment")
        .expect("the key is required on this route");
    let event_id = cx
        .derive_id("payment-created")
        .expect("the key is required on this route");
    sqlx::query(
        "INSERT INTO payments_payments (payment_id, tenant, account, amount_cents) VALUES (?1, ?2, ?3, ?4)",
    )
    .bind(&payment_id)
    .bind(&tenant)
    .bind(&p.account)
    .bind(p.amount_cents)
    .execute(&mut *tx)
    .await
    .map_err(db_failed)?;
    let balance: i64 = sqlx::query_scalar(
        "INSERT INTO payments_accounts (tenant, account, balance_cents) VALUES (?1, ?2, ?3)
         ON CONFLICT (tenant, account) DO UPDATE SET balance_cents = balance_cents + excluded.balance_cents
         RETURNING balance_cents",
    )
    .bind(&tenant)
    .bind(&p.account)
    .bind(p.amount_cents)
    .fetch_one(&mut *tx)
    .await
    .map_err(db_failed)?;
    let message = payment_event(&app.topic, &tenant, &payment_id, &event_id, &p);
    txinbox::outbox::write(&mut *tx, &message)
        .await
        .map_err(outbox_failed)?;
    Ok(created(&payment_id, &p, balance))
}

async fn get_account_sqlite(
    State(EmbeddedApp { pool, .. }): State<EmbeddedApp>,
    headers: HeaderMap,
    Path(account): Path<String>,
) -> Response {
    let Some(tenant) = tenant(&headers) else {
        return problem(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "send Authorization: Bearer <tenant>",
        );
    };
    let balance: Result<Option<i64>, _> =
        sqlx::query_scalar("SELECT balance_cents FROM payments_accounts WHERE tenant = ?1 AND account = ?2")
            .bind(&tenant)
            .bind(&account)
            .fetch_optional(&pool)
            .await;
    match balance {
        Ok(b) => Json(json!({"account": account, "balance_cents": b.unwrap_or(0)})).into_response(),
        Err(e) => db_failed(e),
    }
}

// The error is the response itself, as in the handlers that call this.
#[allow(clippy::result_large_err)]
fn parse_payment(body: &[u8]) -> Result<Payment, Response> {
    let p: Payment = serde_json::from_slice(body).map_err(|e| {
        problem(
            StatusCode::BAD_REQUEST,
            "not-a-payment",
            &format!("the body is not a payment: {e}"),
        )
    })?;
    if p.account.is_empty() || p.account.len() > 128 {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            "not-a-payment",
            "account must have 1 to 128 characters",
        ));
    }
    Ok(p)
}

/// The 201 response.
fn created(payment_id: &str, p: &Payment, balance: i64) -> Response {
    let out = json!({
        "payment_id": payment_id,
        "account": p.account,
        "amount_cents": p.amount_cents,
        "balance_cents": balance,
    });
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/json".to_owned()),
            (header::LOCATION, format!("/payments/{payment_id}")),
        ],
        out.to_string(),
    )
        .into_response()
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: finishing in-flight requests");
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        // Its Display, which says what to change (a refused TLS connection names the CA or the
        // host), rather than the Debug a `main` returning the error would print.
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    // clap echoes a misspelt flag with its value (`--databse-url=postgres://app:pw@db`):
    // its errors go through the one redaction.
    let args = Args::try_parse().unwrap_or_else(|e| {
        let text = e.render().to_string();
        if e.use_stderr() {
            eprint!("{}", txinbox::redact::url(&text));
        } else {
            print!("{text}");
        }
        std::process::exit(e.exit_code());
    });
    // RUST_LOG, plus the directives that keep dependencies' events carrying credentials out
    // whatever it says (sqlx's unrecognized URL parameters, lapin's frames at trace).
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    for directive in txinbox::redact::LOG_DIRECTIVES {
        filter = filter.add_directive(directive.parse()?);
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal, never in a file or a log collector.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let Some(url) = args.database_url.clone() else {
        if args.bench {
            eprintln!("--bench needs PostgreSQL: pass --database-url or set DATABASE_URL");
            std::process::exit(2);
        }
        return serve_embedded(&args).await;
    };
    // TLS as the URL says (sslmode, sslrootcert, sslcert, sslkey); a refused connection (an
    // unknown CA, a certificate for another host, plaintext to a TLS-only server) is reported
    // with what to change.
    let pool = txinbox::PostgresInbox::connect(&url, args.max_connections)
        .await?
        .pool()
        .clone();
    setup(&pool).await?;
    if args.bench {
        bench(pool, args.requests, args.concurrency, args.rounds.max(1)).await;
        return Ok(());
    }

    let relay = start_relay(pool.clone(), &args).await?;

    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(listen = %listener.local_addr()?, "payments_api listening");
    let served = axum::serve(listener, router(pool.clone(), args.topic, false))
        .with_graceful_shutdown(shutdown_signal())
        .await;
    // The relay finishes its round in progress (at most twice its publish timeout) either way.
    relay.stop().await;
    pool.close().await;
    Ok(served?)
}

/// The outbox relay, when `--publish-kafka` or `--publish-amqp` asks for one.
struct RunningRelay(Option<RelayTask>);

struct RelayTask {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), RelayError>>,
}

impl RunningRelay {
    /// Stops the relay after its round in progress.
    async fn stop(self) {
        let Some(RelayTask { stop, task }) = self.0 else {
            return;
        };
        let _ = stop.send(true);
        if let Ok(Err(e)) = task.await {
            tracing::error!(error = %e, "the outbox relay failed");
        }
    }
}

async fn start_relay(
    pool: impl Into<OutboxPool>,
    args: &Args,
) -> Result<RunningRelay, Box<dyn std::error::Error>> {
    let config = RelayConfig::default().name("payments_api");
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let stopped = async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    };
    let task = if let Some(brokers) = &args.publish_kafka {
        let publisher = txinbox_kafka::KafkaPublisher::builder(brokers.clone()).build()?;
        tracing::info!(brokers, topic = %args.topic, "publishing the outbox to Kafka");
        tokio::spawn(Relay::new(pool, publisher, config)?.run_until(stopped))
    } else if let Some(url) = &args.publish_amqp {
        // Connecting first checks the URL (its errors never quote the password).
        let publisher = txinbox_amqp::AmqpPublisher::connect(url.clone()).await?;
        declare_queue(url, &args.topic).await?;
        tracing::info!(queue = %args.topic, "publishing the outbox to RabbitMQ");
        tokio::spawn(Relay::new(pool, publisher, config)?.run_until(stopped))
    } else {
        tracing::info!("no --publish-kafka or --publish-amqp: payment events stay in the outbox table");
        return Ok(RunningRelay(None));
    };
    Ok(RunningRelay(Some(RelayTask { stop: stop_tx, task })))
}

/// Declares `queue` durable on the default exchange, so payment events are routable (the
/// publisher counts an unroutable message as not delivered).
async fn declare_queue(url: &str, queue: &str) -> Result<(), Box<dyn std::error::Error>> {
    use txinbox_amqp::lapin::{
        options::QueueDeclareOptions, types::FieldTable, Connection, ConnectionProperties,
    };
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("--publish-amqp: cannot connect to RabbitMQ ({e})"))?;
    let channel = conn.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await?;
    conn.close(0, "declared".into()).await?;
    Ok(())
}
