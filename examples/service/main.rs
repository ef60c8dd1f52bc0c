//! A production-shaped txinbox service, to copy (`cargo run --example service`): deposits from
//! Kafka, each credited once in PostgreSQL, with an event per deposit published through the
//! transactional outbox.
//!
//! - configuration from the environment (`--help` lists it, with the local defaults);
//! - txinbox's migrations and the service's table at start;
//! - a Kafka source and the `Deposits` handler (`lib.rs`): an effect and an outbox row per message;
//! - the outbox relay, publishing to Kafka;
//! - `/healthz`, `/readyz` (consumer and relay) and `/metrics` (Prometheus) on `LISTEN`;
//! - JSON logs on stderr (`RUST_LOG`);
//! - graceful shutdown on SIGTERM or Ctrl-C: intake stops, messages in progress finish, offsets
//!   are committed, the relay finishes its round, then the process exits 0.

use std::process::ExitCode;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use txinbox::health::{Health, RelayHealth};
use txinbox::outbox::{Relay, RelayConfig};
use txinbox::{Consumer, PostgresInbox};
use txinbox_kafka::{KafkaConfig, KafkaPublisher, KafkaSource, Ordering};
use txinbox_service::Deposits;

/// What the service reads from the environment, with the defaults of a local run.
const ENV: &[(&str, &str)] = &[
    ("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"),
    ("KAFKA_BROKERS", "127.0.0.1:9092"),
    ("KAFKA_TOPIC", "deposits"),
    ("KAFKA_GROUP", "deposits-service"),
    // partition, key (each account's deposits in order, accounts side by side),
    // key-or-unordered (deposits without a key in no order), unordered.
    ("KAFKA_ORDERING", "partition"),
    // Transactions at once; the pool gets four connections more (the relay, retention).
    ("CONCURRENCY", "8"),
    ("EVENTS_TOPIC", "deposits.applied"),
    ("LISTEN", "127.0.0.1:8080"),
];

fn env(name: &str) -> String {
    let default = ENV.iter().find(|(n, _)| *n == name).map(|(_, d)| *d);
    std::env::var(name).unwrap_or_else(|_| default.expect("a known variable").to_owned())
}

#[tokio::main]
async fn main() -> ExitCode {
    if let Some(code) = answer_arguments() {
        return code;
    }
    init_logs();
    match run().await {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %e, "stopped");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), txinbox::Error> {
    // Installed before the consumer and the relay are built: they take their metric handles then.
    let prometheus = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| txinbox::Error::Config(format!("installing the Prometheus recorder: {e}")))?;
    let concurrency: usize = env("CONCURRENCY")
        .parse()
        .map_err(|e| txinbox::Error::Config(format!("CONCURRENCY={}: {e}", env("CONCURRENCY"))))?;
    let ordering: Ordering = env("KAFKA_ORDERING")
        .parse()
        .map_err(|e| txinbox::Error::Config(format!("KAFKA_ORDERING: {e}")))?;
    let pool_size = u32::try_from(concurrency)
        .ok()
        .and_then(|c| c.checked_add(4))
        .ok_or_else(|| txinbox::Error::Config(format!("CONCURRENCY={concurrency} is too large")))?;
    let inbox = PostgresInbox::connect(&env("DATABASE_URL"), pool_size).await?;
    txinbox::postgres::migrate(inbox.pool()).await?;
    txinbox_service::migrate(inbox.pool()).await?;

    let (brokers, topic, group) = (env("KAFKA_BROKERS"), env("KAFKA_TOPIC"), env("KAFKA_GROUP"));
    let source = KafkaSource::new(
        KafkaConfig::new(&brokers, &group)
            .topic(&topic)
            .ordering(ordering),
    )?;
    let consumer = Consumer::builder(&group)
        .source(source)
        .inbox(inbox.clone())
        .concurrency(concurrency)
        .handler(Deposits {
            events_topic: env("EVENTS_TOPIC"),
        })
        .build()?;
    let publisher = KafkaPublisher::builder(&brokers).build()?;
    let relay = Relay::new(inbox.pool().clone(), publisher, RelayConfig::default())?;
    let endpoints = Endpoints {
        consumer: consumer.health(),
        relay: relay.health(),
        prometheus: prometheus.clone(),
    };

    let listen = env("LISTEN");
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| txinbox::Error::Config(format!("LISTEN={listen}: {e}")))?;
    tracing::info!(%listen, %topic, %group, %ordering, concurrency, "consuming; serving /healthz, /readyz and /metrics");

    let shutdown = CancellationToken::new();
    tokio::spawn(on_signal(shutdown.clone()));
    tokio::spawn(async move {
        // Histograms are summarised over a window: the exporter needs its upkeep.
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            prometheus.run_upkeep();
        }
    });
    let http =
        axum::serve(listener, app(endpoints)).with_graceful_shutdown(shutdown.clone().cancelled_owned());
    // Whichever stops first (a signal, or a fatal error) stops the others.
    let (consumed, relayed, served) = tokio::join!(
        stop_all_after(&shutdown, consumer.run_until(shutdown.clone().cancelled_owned())),
        stop_all_after(&shutdown, relay.run_until(shutdown.clone().cancelled_owned())),
        stop_all_after(&shutdown, async { http.await }),
    );
    consumed?;
    relayed?;
    served.map_err(|e| txinbox::Error::Config(format!("serving HTTP on {listen}: {e}")))
}

async fn stop_all_after<T>(shutdown: &CancellationToken, work: impl std::future::Future<Output = T>) -> T {
    let result = work.await;
    shutdown.cancel();
    result
}

/// Cancels `shutdown` on SIGTERM (what an orchestrator sends) or Ctrl-C.
async fn on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("a SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping gracefully"),
        _ = tokio::signal::ctrl_c() => tracing::info!("Ctrl-C: stopping gracefully"),
    }
    shutdown.cancel();
}

#[derive(Clone)]
struct Endpoints {
    consumer: Health,
    relay: RelayHealth,
    prometheus: PrometheusHandle,
}

fn app(endpoints: Endpoints) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route(
            "/metrics",
            get(|State(e): State<Endpoints>| async move { e.prometheus.render() }),
        )
        .with_state(endpoints)
}

/// Liveness: 200 until the consumer or the relay has stopped (then restart the process).
async fn healthz(State(e): State<Endpoints>) -> StatusCode {
    match e.consumer.report().is_alive() && e.relay.report().is_alive() {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// Readiness: 200 when both can make progress; otherwise 503 with what blocks them.
async fn readyz(State(e): State<Endpoints>) -> (StatusCode, Json<Value>) {
    let (consumer, relay) = (e.consumer.report().problems(), e.relay.report().problems());
    let ready = consumer.is_empty() && relay.is_empty();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({ "ready": ready, "consumer": consumer, "relay": relay })),
    )
}

/// JSON lines on stderr, filtered by `RUST_LOG` (default `info`), never with the events of
/// dependencies that carry credentials ([`txinbox::redact::LOG_DIRECTIVES`]).
fn init_logs() {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    for directive in txinbox::redact::LOG_DIRECTIVES {
        filter = filter.add_directive(directive.parse().expect("a valid directive"));
    }
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// `--help` lists the environment; any other argument is refused (exit 2).
fn answer_arguments() -> Option<ExitCode> {
    let arg = std::env::args().nth(1)?;
    if arg == "--help" || arg == "-h" {
        println!("Usage: service\n\nA txinbox deposits service, configured from the environment:\n");
        for (name, default) in ENV {
            println!("  {name:<14} default {default}");
        }
        println!("  {:<14} default info", "RUST_LOG");
        return Some(ExitCode::SUCCESS);
    }
    eprintln!(
        "service: unexpected argument {}; it takes none: configure it through the environment (--help)",
        txinbox::redact::url(&arg)
    );
    Some(ExitCode::from(2))
}
