//! Observability for orchestrators and Prometheus (`cargo run --release --example observability`): the `ledger` consumer on Kafka, with an
//! HTTP server on `--listen` (default 127.0.0.1:9898) serving
//!
//! - `GET /healthz`: 200 while the consumer has not stopped (liveness: restart it if not);
//! - `GET /readyz`: 200 when it can make progress, 503 otherwise (database unreachable and
//!   intake paused, broker disconnected, a partition stalled past `--stall-after`), with the
//!   [`HealthReport`](txinbox::health::HealthReport) as JSON either way;
//! - `GET /metrics`: every txinbox metric in the Prometheus text format, through
//!   `metrics-exporter-prometheus` (the library only records through the `metrics` facade; the
//!   application installs the exporter, here, before building the consumer). The Grafana
//!   dashboard `deploy/grafana/txinbox.json` and the alert rules `deploy/prometheus/alerts.yml`
//!   read these names.
//!
//! ```text
//! cargo run --release --example observability -- \
//!     --brokers 127.0.0.1:9092 --topic payments --group ledger \
//!     --database-url postgres://postgres@127.0.0.1:5432/postgres
//! curl -s 127.0.0.1:9898/readyz; curl -s 127.0.0.1:9898/metrics | grep txinbox_
//! ```
//!
//! Stop PostgreSQL and `/readyz` answers 503 with "inbox database unreachable; intake paused"
//! within one failed transaction, while `/healthz` stays 200 (the consumer rides the outage
//! out: nothing is acked meanwhile); start it again and `/readyz` is 200.

use std::time::Duration;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use clap::Parser;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde_json::{json, Value};
use txinbox::health::{Health, HealthReport};
use txinbox::{Consumer, PostgresInbox};
use txinbox_demos::flags;
use txinbox_demos::payments::{create_tables, Ledger};
use txinbox_kafka::{KafkaConfig, KafkaSource};

/// The ledger consumer with /healthz, /readyz and /metrics.
#[derive(Debug, Parser)]
#[command(name = "observability")]
struct Args {
    /// Where the HTTP server listens.
    #[arg(
        long,
        env = "LISTEN",
        hide_env_values = true,
        default_value = "127.0.0.1:9898"
    )]
    listen: String,
    #[command(flatten)]
    kafka: flags::Kafka,
    /// The topic of payment events.
    #[arg(long, env = "KAFKA_TOPIC", hide_env_values = true, default_value = "payments")]
    topic: String,
    /// The consumer group.
    #[arg(long, env = "KAFKA_GROUP", hide_env_values = true, default_value = "ledger")]
    group: String,
    #[command(flatten)]
    postgres: flags::Postgres,
    /// The txinbox consumer name.
    #[arg(
        long,
        env = "LEDGER_CONSUMER",
        hide_env_values = true,
        default_value = "ledger"
    )]
    consumer_name: String,
    /// A partition with messages waiting and no progress for this many seconds makes
    /// `/readyz` fail.
    #[arg(long, default_value_t = 300)]
    stall_after: u64,
}

#[derive(Clone)]
struct Endpoints {
    health: Health,
    prometheus: PrometheusHandle,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Args = txinbox_demos::parse_args();
    txinbox_demos::init_logs("info");
    // Before the consumer is built: it resolves its metric handles then.
    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .context("installing the Prometheus recorder failed")?;

    let inbox = PostgresInbox::connect(&args.postgres.database_url, 10)
        .await
        .context("connecting to PostgreSQL failed; check --database-url / DATABASE_URL")?;
    txinbox::postgres::migrate(inbox.pool()).await?;
    create_tables(inbox.pool()).await?;
    let config = KafkaConfig::new(&args.kafka.brokers, &args.group).topic(&args.topic);
    let consumer = Consumer::builder(&args.consumer_name)
        .source(KafkaSource::new(config)?)
        .inbox(inbox)
        .handler(Ledger)
        .build()?;
    let endpoints = Endpoints {
        health: consumer
            .health()
            .stall_after(Duration::from_secs(args.stall_after)),
        prometheus: prometheus.clone(),
    };
    // Histograms are summarised over a window: the exporter needs its upkeep.
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            prometheus.run_upkeep();
        }
    });
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(endpoints);
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("listening on {} failed", args.listen))?;
    tracing::info!(listen = %args.listen, "serving /healthz, /readyz and /metrics");
    tokio::spawn(async move { axum::serve(listener, app).await });

    consumer.run_until(shutdown_signal()?).await?;
    Ok(())
}

async fn healthz(State(e): State<Endpoints>) -> (StatusCode, &'static str) {
    if e.health.report().is_alive() {
        (StatusCode::OK, "alive\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "stopped\n")
    }
}

async fn readyz(State(e): State<Endpoints>) -> (StatusCode, Json<Value>) {
    let report = e.health.report();
    let status = if report.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(to_json(&report)))
}

async fn metrics(State(e): State<Endpoints>) -> String {
    e.prometheus.render()
}

fn to_json(r: &HealthReport) -> Value {
    let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
    json!({
        "consumer": r.consumer,
        "ready": r.is_ready(),
        "problems": r.problems(),
        "state": format!("{:?}", r.state),
        "database_reachable": r.database_reachable,
        "intake_paused": r.intake_paused,
        "broker": format!("{:?}", r.broker),
        "assigned": r.assigned,
        "lanes": r.lanes.iter().map(|l| json!({
            "lane": l.lane,
            "unsettled": l.unsettled,
            "oldest_unsettled_seconds": secs(l.oldest_unsettled),
            "seconds_since_progress": secs(l.since_progress),
            "stalled": l.stalled,
        })).collect::<Vec<_>>(),
    })
}

/// Completes on SIGTERM or Ctrl-C (SIGINT).
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()> + Send> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM failed")?;
    let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT failed")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: stopping gracefully"),
            _ = int.recv() => tracing::info!("SIGINT: stopping gracefully"),
        }
    })
}
