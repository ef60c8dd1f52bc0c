//! Outcomes are counted through the `metrics` facade and recorded on the
//! `txinbox.http.idempotency` span (SQLite store: no server needed).

use std::io::Write;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use http::{Request, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tower::ServiceExt;
use txinbox::sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use txinbox::sqlx::{self, Sqlite};
use txinbox_http::{IdempotencyLayer, IdempotentTx};

async fn handler(mut tx: IdempotentTx<Sqlite>) -> (StatusCode, &'static str) {
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    (StatusCode::CREATED, "created!")
}

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn outcomes_are_counted_and_recorded_on_the_span() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_ansi(false)
        .finish();
    let path = std::env::temp_dir().join(format!("txinbox_http_telemetry_{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    // Global, not scoped to this thread: sqlx's SQLite worker threads hold clones of the
    // request's span while they run its statements, and the span closes where its last clone
    // is dropped, which may be one of them. (The only test in this binary.)
    tracing::subscriber::set_global_default(subscriber).unwrap();
    {
        metrics::with_local_recorder(&recorder, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let pool = SqlitePoolOptions::new()
                        .connect_with(
                            SqliteConnectOptions::new()
                                .filename(&path)
                                .create_if_missing(true),
                        )
                        .await
                        .unwrap();
                    txinbox::sqlite::migrate(&pool).await.unwrap();
                    let layer = IdempotencyLayer::new(pool).principal(|_| Some("p".into()));
                    let app = Router::new().route("/t", post(handler).layer(layer));
                    let send = |key: &str, body: &'static str| {
                        let mut r = Request::post("/t");
                        if !key.is_empty() {
                            r = r.header("idempotency-key", key);
                        }
                        app.clone().oneshot(r.body(Body::from(body)).unwrap())
                    };
                    assert_eq!(send("a", "1").await.unwrap().status(), StatusCode::CREATED);
                    assert_eq!(send("a", "1").await.unwrap().status(), StatusCode::CREATED);
                    assert_eq!(
                        send("a", "2").await.unwrap().status(),
                        StatusCode::UNPROCESSABLE_ENTITY
                    );
                    assert_eq!(send("", "2").await.unwrap().status(), StatusCode::BAD_REQUEST);
                });
        })
    }
    let mut outcomes = Vec::new();
    let (mut stored, mut claims, mut in_flight) = (0, 0, None);
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let label = |k: &str| {
            key.key()
                .labels()
                .find(|l| l.key() == k)
                .map(|l| l.value().to_owned())
        };
        match (key.key().name(), value) {
            ("txinbox_http_requests_total", DebugValue::Counter(n)) => {
                assert_eq!(label("route").as_deref(), Some("/t"));
                outcomes.push((label("outcome").unwrap(), n));
            }
            ("txinbox_http_stored_bytes_total", DebugValue::Counter(n)) => stored += n,
            ("txinbox_http_claim_duration_seconds", DebugValue::Histogram(h)) => claims += h.len(),
            ("txinbox_http_in_flight", DebugValue::Gauge(g)) => in_flight = Some(g.into_inner()),
            _ => {}
        }
    }
    outcomes.sort();
    let expected: Vec<(String, u64)> = [
        ("executed", 1),
        ("key_reused", 1),
        ("missing_key", 1),
        ("replayed", 1),
    ]
    .iter()
    .map(|(o, n)| (o.to_string(), *n))
    .collect();
    assert_eq!(outcomes, expected);
    assert_eq!(stored, "created!".len() as u64);
    assert_eq!(claims, 3, "one claim per request with a key");
    assert_eq!(in_flight, Some(0.0), "the in-flight gauge is back to 0");
    let closed = |logs: &str, outcome: &str| {
        logs.contains(&format!("txinbox.http.outcome=\"{outcome}\""))
            || logs.contains(&format!("txinbox.http.outcome={outcome}"))
    };
    let outcomes = ["executed", "replayed", "key_reused", "missing_key"];
    // A span whose last clone a SQLite worker thread holds closes when that thread lets go.
    let started = std::time::Instant::now();
    let logs = loop {
        let logs = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        if outcomes.iter().all(|o| closed(&logs, o)) || started.elapsed().as_secs() >= 5 {
            break logs;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    for outcome in outcomes {
        assert!(
            closed(&logs, outcome),
            "span closed with outcome {outcome}:\n{logs}"
        );
    }
}
