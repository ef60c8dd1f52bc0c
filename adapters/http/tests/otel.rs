//! Feature `otel`: a request's `traceparent` puts the idempotency layer's span, the handler and
//! the outbox row it writes into the caller's trace, when the application has no HTTP tracing
//! of its own. Spans are read back from an in-memory OpenTelemetry exporter behind the
//! `tracing_opentelemetry` layer, set up as an application does. Needs `DATABASE_URL`.

use std::sync::OnceLock;

use axum::body::Body;
use axum::routing::post;
use axum::{Extension, Router};
use http::{Request, StatusCode};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Executor};
use tower::ServiceExt;
use tracing_subscriber::layer::SubscriberExt;
use txinbox::outbox::OutboxMessage;
use txinbox_http::{IdempotencyContext, IdempotencyLayer, IdempotentTx};

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("txinbox-http-test"));
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
            .expect("the only global subscriber in this test binary");
        exporter
    })
}

/// Writes one outbox row on the request's transaction.
async fn place(mut tx: IdempotentTx, Extension(cx): Extension<IdempotencyContext>) -> StatusCode {
    let event = OutboxMessage::new(cx.derive_id("placed").unwrap(), "orders", "placed");
    txinbox::outbox::write(&mut *tx, &event).await.unwrap();
    StatusCode::CREATED
}

#[tokio::test]
async fn a_callers_traceparent_reaches_the_layer_span_and_the_outbox_row() {
    exporter();
    let admin: PgConnectOptions = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
        .parse()
        .unwrap();
    let name = format!("txinbox_http_otel_t_{}", std::process::id());
    let mut conn = admin.connect().await.expect("PostgreSQL at DATABASE_URL");
    conn.execute(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .await
    .unwrap();
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(admin.database(&name))
        .await
        .unwrap();
    txinbox::postgres::migrate(&pool).await.unwrap();

    let layer = IdempotencyLayer::new(pool.clone()).principal(|_| Some("tenant".into()));
    let app = Router::new().route("/orders", post(place).layer(layer));
    let res = app
        .oneshot(
            Request::post("/orders")
                .header("idempotency-key", "k-1")
                .header("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);

    let trace = TraceId::from_hex(CALLER_TRACE).unwrap();
    let spans: Vec<_> = exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace && s.name == "txinbox.http.idempotency")
        .collect();
    assert_eq!(spans.len(), 1, "the layer's span is in the caller's trace");
    assert_eq!(spans[0].parent_span_id, SpanId::from_hex(CALLER_SPAN).unwrap());

    let stored: Vec<u8> = sqlx::query_scalar(
        "SELECT header_values[array_position(header_names, 'traceparent')] FROM txinbox.outbox",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        String::from_utf8(stored).unwrap(),
        format!("00-{CALLER_TRACE}-{}-01", spans[0].span_context.span_id()),
        "the outbox row carries the caller's trace, the handler's span as parent"
    );

    pool.close().await;
    let _ = conn
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .await;
}
