//! `txinbox status` against Kafka over TLS, on a listener that refuses plaintext
//! (`KAFKA_TLS_BROKERS`, default 127.0.0.1:9094, started by `ensure_tansu_tls` in
//! `scripts/lib/tansu.sh`, with the test CA of `ensure_test_certs` in `TXINBOX_TLS_DIR`), the
//! security settings given as `-X` (like kcat) or `KAFKA_PROPERTIES`; and the errors a user
//! sees for a wrong CA and for plaintext at the TLS listener. A missing listener or
//! certificate fails the test with the command to run.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::*;
use txinbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use txinbox_kafka::rdkafka::client::DefaultClientContext;
use txinbox_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use txinbox_kafka::rdkafka::ClientConfig;

const SETUP: &str = "run: source scripts/lib/services.sh; source scripts/lib/tansu.sh; \
                     source scripts/lib/tls.sh; ensure_test_certs; ensure_tansu_tls";

fn tls_file(name: &str) -> String {
    let dir = std::env::var("TXINBOX_TLS_DIR").unwrap_or_else(|_| "/var/lib/txinbox/tls".into());
    let path = PathBuf::from(dir).join(name);
    assert!(path.is_file(), "{} is missing: {SETUP}", path.display());
    path.to_string_lossy().into_owned()
}

fn tls_brokers() -> String {
    let brokers = std::env::var("KAFKA_TLS_BROKERS").unwrap_or_else(|_| "127.0.0.1:9094".into());
    let reachable = brokers
        .parse()
        .ok()
        .and_then(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok());
    assert!(reachable.is_some(), "no Kafka TLS listener at {brokers}: {SETUP}");
    brokers
}

/// A fresh one-partition topic with `n` records, created and written over TLS.
async fn topic_over_tls(brokers: &str, n: usize) -> String {
    let topic = format!("cli-tls-{}", consumer_name());
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", brokers)
        .set("security.protocol", "SSL")
        .set("ssl.ca.location", tls_file("ca.pem"));
    let admin: AdminClient<DefaultClientContext> = config.create().unwrap();
    for r in admin
        .create_topics(
            &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topic over TLS")
    {
        r.expect("topic created");
    }
    let producer: FutureProducer = config.create().unwrap();
    for i in 0..n {
        producer
            .send(
                FutureRecord::<str, str>::to(&topic)
                    .payload(&format!("r{i}"))
                    .partition(0),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("produced over TLS");
    }
    topic
}

/// Runs `txinbox` with `args` and `env` (DATABASE_URL, KAFKA_BROKERS, KAFKA_PROPERTIES unset
/// unless given).
async fn run(env: &[(&str, String)], args: &[&str]) -> Run {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_txinbox"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("KAFKA_BROKERS")
        .env_remove("KAFKA_PROPERTIES")
        .stdin(std::process::Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("txinbox finishes within 120 s")
        .expect("run txinbox");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reads_the_brokers_over_tls_with_x_properties_or_the_environment() {
    let brokers = tls_brokers();
    let db = TestDb::new().await;
    let consumer = consumer_name();
    let topic = topic_over_tls(&brokers, 5).await;
    record_subscription(&db, &consumer, &topic, &format!("g-{consumer}")).await;
    store_position(&db, &consumer, &topic, 0, 3).await;
    let env = vec![
        ("DATABASE_URL", db.url.clone()),
        ("KAFKA_BROKERS", brokers.clone()),
    ];
    let ca = format!("ssl.ca.location={}", tls_file("ca.pem"));
    let flags = run(
        &env,
        &[
            "--json",
            "status",
            "--consumer",
            &consumer,
            "-X",
            "security.protocol=SSL",
            "-X",
            &ca,
        ],
    )
    .await;
    let mut listed = env.clone();
    listed.push(("KAFKA_PROPERTIES", format!("security.protocol=SSL,{ca}")));
    let environment = run(&listed, &["--json", "status", "--consumer", &consumer]).await;
    for status in [flags.ok(), environment.ok()] {
        let p0 = &status["consumers"][0]["partitions"][0];
        assert_eq!(p0["high_watermark"], 5, "{status:#}");
        assert_eq!(p0["database_position"], 3, "{status:#}");
        assert_eq!(p0["lag"], 2, "{status:#}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_over_tls_refusals_say_what_to_change() {
    let brokers = tls_brokers();
    let db = TestDb::new().await;
    let consumer = consumer_name();
    store_position(&db, &consumer, "t", 0, 1).await;
    let env = vec![("DATABASE_URL", db.url.clone()), ("KAFKA_BROKERS", brokers)];
    let wrong_ca = format!("ssl.ca.location={}", tls_file("other-ca.pem"));
    for (args, expected) in [
        (
            vec!["status", "-X", "security.protocol=SSL", "-X", &wrong_ca],
            ["certificate verify failed", "set ssl.ca.location"],
        ),
        (vec!["status"], ["expects TLS", "security.protocol=SSL"]),
    ] {
        let refused = run(&env, &args).await;
        assert_eq!(refused.code, 3, "unreachable: {refused:?}");
        for e in expected {
            assert!(refused.stderr.contains(e), "{e:?} missing: {}", refused.stderr);
        }
    }
}
