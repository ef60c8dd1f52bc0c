//! The ledger example on Kafka over TLS, as a user runs it against a managed Kafka: the
//! security settings as `-X key=value` (like kcat), the brokers a TLS-only listener that
//! refuses plaintext (`KAFKA_TLS_BROKERS`, default 127.0.0.1:9094, started by
//! `ensure_tansu_tls` in `scripts/lib/tansu.sh`; the test CA from `ensure_test_certs` in
//! `TXINBOX_TLS_DIR`). Payments written over TLS are applied once each, and the malformed one
//! is dead-lettered over TLS. PostgreSQL at `DATABASE_URL` (a scratch database).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use txinbox::sqlx;
use txinbox_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use txinbox_kafka::rdkafka::client::DefaultClientContext;
use txinbox_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use txinbox_kafka::rdkafka::message::{Header, OwnedHeaders};
use txinbox_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use txinbox_kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use txinbox_testing::database::TestDatabase;
use txinbox_testing::output::example;

const SETUP: &str = "run: source scripts/lib/services.sh; source scripts/lib/tansu.sh; \
                     source scripts/lib/tls.sh; ensure_test_certs; ensure_tansu_tls";

fn ca() -> String {
    let dir = std::env::var("TXINBOX_TLS_DIR").unwrap_or_else(|_| "/var/lib/txinbox/tls".into());
    let path = PathBuf::from(dir).join("ca.pem");
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

/// A client configuration for the TLS listener.
fn tls_config(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("security.protocol", "SSL")
        .set("ssl.ca.location", ca());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_applies_payments_over_tls_given_as_x_properties() {
    let Some(ledger) = example("ledger") else {
        return;
    };
    let brokers = tls_brokers();
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis();
    let topic = format!("ledger-tls-{}-{stamp}", std::process::id());

    let admin: AdminClient<DefaultClientContext> = tls_config(&brokers).create().unwrap();
    for r in admin
        .create_topics(
            &[
                NewTopic::new(&topic, 2, TopicReplication::Fixed(1)),
                NewTopic::new(&format!("{topic}.dlq"), 1, TopicReplication::Fixed(1)),
            ],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topics over TLS")
    {
        r.expect("topic created");
    }
    // 60 payments, every 6th sent twice, and one that is not a payment.
    let producer: FutureProducer = tls_config(&brokers).create().unwrap();
    let mut total = 0i64;
    let send = |id: String, payload: String, partition: i32| {
        let producer = producer.clone();
        let topic = topic.clone();
        async move {
            let headers = OwnedHeaders::new().insert(Header {
                key: "ce_id",
                value: Some(&id),
            });
            producer
                .send(
                    FutureRecord::to(&topic)
                        .key(&id)
                        .payload(&payload)
                        .partition(partition)
                        .headers(headers),
                    Duration::from_secs(30),
                )
                .await
                .map_err(|(e, _)| e)
                .expect("produced over TLS");
        }
    };
    for i in 0..60i64 {
        let amount = i * 7 - 100;
        total += amount;
        let payload = format!(r#"{{"account":"acct-{}","amount_cents":{amount}}}"#, i % 4);
        send(format!("pay-{i}"), payload.clone(), (i % 2) as i32).await;
        if i % 6 == 0 {
            send(format!("pay-{i}"), payload, ((i + 1) % 2) as i32).await;
        }
    }
    send("not-a-payment".into(), "{oops".into(), 0).await;

    let db = TestDatabase::builder("ledger_tls_t")
        .migrate(false)
        .create()
        .await;
    let log = std::env::temp_dir().join(format!("ledger-tls-{}-{stamp}.log", std::process::id()));
    let ca = format!("ssl.ca.location={}", ca());
    let mut child = Command::new(ledger)
        .args([
            "--source",
            "kafka",
            "--brokers",
            &brokers,
            "--topic",
            &topic,
            "--group",
            &format!("g-{topic}"),
            "-X",
            "security.protocol=SSL",
            "-X",
            &ca,
            "-X",
            "session.timeout.ms=6000",
        ])
        .env("DATABASE_URL", db.url())
        .env_remove("KAFKA_BROKERS")
        .env_remove("LEDGER_KAFKA_PROPERTIES")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(log.with_extension("err")).unwrap())
        .spawn()
        .expect("start the ledger");

    let started = Instant::now();
    let applied = loop {
        let n: Option<i64> = sqlx::query_scalar("SELECT count(*) FROM ledger_entries")
            .fetch_one(db.pool())
            .await
            .ok();
        if n == Some(60) || started.elapsed() > Duration::from_secs(120) {
            break n;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the ledger exited ({status}):\n{}",
                std::fs::read_to_string(log.with_extension("err")).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    // The dead letter, read back over TLS: the ledger's dead-letter producer used TLS too.
    let dlq = format!("{topic}.dlq");
    let dead = tokio::task::spawn_blocking(move || {
        let mut c = tls_config(&brokers);
        c.set("group.id", "reader").set("enable.auto.commit", "false");
        let reader: BaseConsumer = c.create().unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&dlq, 0, Offset::Beginning).unwrap();
        reader.assign(&tpl).unwrap();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            if let Some(Ok(m)) = reader.poll(Duration::from_millis(200)) {
                return m.key().map(|k| String::from_utf8_lossy(k).into_owned());
            }
        }
        None
    })
    .await
    .unwrap();
    // This child only, by its handle.
    let _ = child.kill();
    let _ = child.wait();
    let stderr = std::fs::read_to_string(log.with_extension("err")).unwrap_or_default();
    assert_eq!(
        applied,
        Some(60),
        "every payment applied once over TLS; the ledger said:\n{stderr}"
    );
    assert_eq!(
        dead.as_deref(),
        Some("not-a-payment"),
        "the malformed record dead-lettered over TLS"
    );
    let (distinct, balance): (i64, Option<i64>) = sqlx::query_as(
        "SELECT (SELECT count(DISTINCT event_id) FROM ledger_entries), (SELECT sum(balance_cents)::bigint FROM accounts)",
    )
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!(distinct, 60);
    assert_eq!(
        balance,
        Some(total),
        "the balances are the sum of the payments, each once"
    );
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_file(log.with_extension("err"));
    db.drop_database().await;
}
