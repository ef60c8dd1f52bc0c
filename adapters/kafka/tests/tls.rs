//! TLS and SASL against real Kafka-protocol listeners that refuse plaintext: **needs the
//! listeners of `ensure_tansu_tls`** (`scripts/lib/tansu.sh`; `scripts/test` starts them) and
//! the test CA of `ensure_test_certs` (`scripts/lib/tls.sh`, in `TXINBOX_TLS_DIR`), and
//! `DATABASE_URL`. A missing listener or certificate fails the test with the command to run.
//!
//! | listener | what it is |
//! |---|---|
//! | `KAFKA_TLS_BROKERS` (127.0.0.1:9094) | TLS with a server certificate for 127.0.0.1 |
//! | `KAFKA_MTLS_BROKERS` (127.0.0.1:9096) | the same, requiring a client certificate |
//! | `KAFKA_TLS_WRONG_HOST_BROKERS` (127.0.0.1:9097) | TLS with a certificate for another host |
//! | `KAFKA_SASL_SSL_BROKERS` (127.0.0.1:9098) | TLS to a broker requiring SASL SCRAM |
//!
//! End to end over TLS: a consumer with a real store applies records, the dead-letter producer
//! reaches the TLS broker, the outbox publisher (the relay's) delivers. Each refusal (wrong CA,
//! wrong host name, plaintext to the TLS listener, no client certificate, failed SASL SCRAM
//! authentication) is checked in the consumer's health and the publisher's error, as a user
//! sees it.

mod common;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::ClientConfig;
use txinbox::outbox::{OutboxMessage, Publisher as _};
use txinbox_kafka::{headers, ConnectionContext, KafkaConfig, KafkaPublisher};

const SETUP: &str = "run: source scripts/lib/services.sh; source scripts/lib/tansu.sh; \
                     source scripts/lib/tls.sh; ensure_test_certs; ensure_tansu_tls";

/// A file of the test CA's directory (`TXINBOX_TLS_DIR`, default `/var/lib/txinbox/tls`).
fn tls_file(name: &str) -> String {
    let dir = std::env::var("TXINBOX_TLS_DIR").unwrap_or_else(|_| "/var/lib/txinbox/tls".into());
    let path = PathBuf::from(dir).join(name);
    assert!(path.is_file(), "{} is missing: {SETUP}", path.display());
    path.to_string_lossy().into_owned()
}

/// The listener in `var` (default `127.0.0.1:<port>`), which must accept connections.
fn listener(var: &str, port: u16) -> String {
    let brokers = std::env::var(var).unwrap_or_else(|_| format!("127.0.0.1:{port}"));
    let reachable = brokers
        .parse()
        .ok()
        .and_then(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok());
    assert!(
        reachable.is_some(),
        "no Kafka TLS listener at {brokers} ({var}): {SETUP}"
    );
    brokers
}

/// TLS trusting `ca` (a file of the test CA's directory).
fn ssl(ca: &str) -> Vec<(&'static str, String)> {
    vec![
        ("security.protocol", "SSL".into()),
        ("ssl.ca.location", tls_file(ca)),
    ]
}

fn with(mut config: KafkaConfig, properties: &[(&str, String)]) -> KafkaConfig {
    for (k, v) in properties {
        config = config.set(*k, v);
    }
    config
}

fn name(prefix: &str) -> String {
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis();
    format!("{prefix}-{}-{stamp}", std::process::id())
}

/// Creates `<prefix>-…` with `partitions` and its dead-letter topic, over `properties`.
async fn fresh_topic(brokers: &str, properties: &[(&str, String)], prefix: &str, partitions: i32) -> String {
    let topic = name(prefix);
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (k, v) in properties {
        config.set(*k, v);
    }
    let admin: AdminClient<DefaultClientContext> = config.create().expect("admin client");
    let created = admin
        .create_topics(
            &[
                NewTopic::new(&topic, partitions, TopicReplication::Fixed(1)),
                NewTopic::new(&format!("{topic}.dlq"), 1, TopicReplication::Fixed(1)),
            ],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topics over TLS");
    for r in created {
        r.expect("topic created");
    }
    topic
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_tls_a_consumer_applies_records_and_its_dead_letter_reaches_the_broker() {
    let brokers = listener("KAFKA_TLS_BROKERS", 9094);
    init_tracing();
    let tls = ssl("ca.pem");
    let topic = fresh_topic(&brokers, &tls, "tls-deposits", 2).await;
    let producer = Producer::with(&brokers, &tls);
    let expected = producer.deposits(&topic, 2, "t", 200, 4).await;
    producer
        .send(&topic, Some(1), "k", Some("not-a-deposit"), "this is not JSON")
        .await;

    let db = TestDb::new().await;
    let config = with(kafka_config(&brokers, &name("g"), &topic), &tls);
    let running = Running::start(&db, config, DepositHandler::default());
    db.wait_applied(expected.amounts.len() as i64, Duration::from_secs(90))
        .await;

    // The dead-letter producer inherits the consumer's security settings (it would get no
    // answer from this listener without TLS).
    let dead = read_all_with(
        &brokers,
        &tls,
        &format!("{topic}.dlq"),
        1,
        1,
        Duration::from_secs(60),
    );
    assert_eq!(dead.len(), 1, "one dead letter on {topic}.dlq, produced over TLS");
    assert_eq!(header(&dead[0], headers::REASON).as_deref(), Some("undecodable"));
    let report = running
        .wait_health(Duration::from_secs(20), "ready over TLS", |r| r.is_ready())
        .await;
    assert!(report.problems().is_empty(), "{:?}", report.problems());
    running.stop().await;
    db.assert_exactly_once(&expected).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_outbox_publisher_delivers() {
    let brokers = listener("KAFKA_TLS_BROKERS", 9094);
    init_tracing();
    let tls = ssl("ca.pem");
    let topic = fresh_topic(&brokers, &tls, "tls-outbox", 1).await;
    let mut builder = KafkaPublisher::builder(&brokers);
    for (k, v) in &tls {
        builder = builder.set(*k, v);
    }
    let publisher = builder.build().expect("publisher");
    publisher
        .publish(&OutboxMessage::new("outbox-tls-1", &topic, "paid").with_key("acct-1"))
        .await
        .expect("published over TLS");
    assert!(matches!(publisher.probe().await, Some(Ok(()))));
    let read = read_all_with(&brokers, &tls, &topic, 1, 1, Duration::from_secs(30));
    assert_eq!(read.len(), 1);
    assert_eq!(header(&read[0], "ce_id").as_deref(), Some("outbox-tls-1"));
    tokio::task::spawn_blocking(move || drop(publisher))
        .await
        .unwrap();
}

/// Starts a consumer of a topic that need not exist with `properties` on `brokers`, and returns
/// its connection problem once the health reports one with `expected` in it (within 30 s):
/// what a user sees. Nothing is applied meanwhile.
async fn refused(brokers: &str, properties: &[(&str, String)], expected: &str) -> String {
    let db = TestDb::new().await;
    let config = with(kafka_config(brokers, &name("g"), &name("refused")), properties);
    let running = Running::start(&db, config, DepositHandler::default());
    let report = running
        .wait_health(Duration::from_secs(30), expected, |r| {
            r.problems().iter().any(|p| p.contains(expected))
        })
        .await;
    assert!(!report.is_ready());
    let problem = report
        .problems()
        .into_iter()
        .find(|p| p.contains(expected))
        .unwrap();
    running.stop().await;
    assert_eq!(db.applied().await, 0);
    problem
}

/// The publisher's error for one publish over `properties`: the relay's view.
async fn publish_refused(brokers: &str, properties: &[(&str, String)]) -> String {
    let mut builder = KafkaPublisher::builder(brokers).delivery_timeout(Duration::from_secs(4));
    for (k, v) in properties {
        builder = builder.set(*k, v);
    }
    let publisher = builder.build().expect("publisher");
    let error = publisher
        .publish(&OutboxMessage::new("refused-1", name("refused"), "x"))
        .await
        .expect_err("no delivery through a refused connection");
    assert!(
        !error.is_permanent(),
        "a configuration fix (or a rotated certificate) lets it through"
    );
    tokio::task::spawn_blocking(move || drop(publisher))
        .await
        .unwrap();
    error.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wrong_ca_is_refused_and_the_problem_says_to_set_the_ca() {
    let brokers = listener("KAFKA_TLS_BROKERS", 9094);
    init_tracing();
    let wrong = ssl("other-ca.pem");
    let problem = refused(&brokers, &wrong, "certificate verify failed").await;
    assert!(problem.contains("set ssl.ca.location"), "{problem}");
    let error = publish_refused(&brokers, &wrong).await;
    assert!(
        error.contains("certificate verify failed") && error.contains("set ssl.ca.location"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plaintext_to_the_tls_listener_is_refused_and_the_problem_says_to_use_tls() {
    let brokers = listener("KAFKA_TLS_BROKERS", 9094);
    init_tracing();
    let problem = refused(&brokers, &[], "security.protocol=SSL").await;
    assert!(problem.contains("expects TLS"), "{problem}");
    let error = publish_refused(&brokers, &[]).await;
    assert!(error.contains("security.protocol=SSL"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_certificate_for_another_host_is_refused() {
    let brokers = listener("KAFKA_TLS_WRONG_HOST_BROKERS", 9097);
    init_tracing();
    // Signed by the CA the client trusts: only the host name (127.0.0.1 against the
    // certificate's kafka.invalid) is wrong.
    let problem = refused(&brokers, &ssl("ca.pem"), "certificate verify failed").await;
    assert!(
        problem.contains("bootstrap.servers") && problem.contains("host name"),
        "{problem}"
    );
    // The control: without host name verification the same listener and CA answer.
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers);
    for (k, v) in ssl("ca.pem") {
        config.set(k, v);
    }
    config.set("ssl.endpoint.identification.algorithm", "none");
    let context = ConnectionContext::new(&mut config);
    let client: BaseConsumer<ConnectionContext> = config.create_with_context(context).unwrap();
    let metadata = tokio::task::spawn_blocking(move || {
        client
            .fetch_metadata(None, Duration::from_secs(10))
            .map(|m| m.brokers().len())
    })
    .await
    .unwrap();
    assert!(metadata.is_ok(), "{metadata:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_certificate_is_presented_and_its_absence_is_refused() {
    let brokers = listener("KAFKA_MTLS_BROKERS", 9096);
    init_tracing();
    let problem = refused(&brokers, &ssl("ca.pem"), "client certificate").await;
    assert!(problem.contains("ssl.certificate.location"), "{problem}");
    // With the client certificate and key, the listener answers (the bootstrap connection,
    // where the certificate is required, serves the metadata request).
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers);
    for (k, v) in ssl("ca.pem") {
        config.set(k, v);
    }
    config
        .set("ssl.certificate.location", tls_file("client.pem"))
        .set("ssl.key.location", tls_file("client.key"));
    let context = ConnectionContext::new(&mut config);
    let client: BaseConsumer<ConnectionContext> = config.create_with_context(context).unwrap();
    let answer = tokio::task::spawn_blocking(move || {
        client
            .fetch_metadata(None, Duration::from_secs(10))
            .map(|m| m.brokers().len())
    })
    .await
    .unwrap();
    assert!(answer.is_ok(), "{answer:?}");
}

/// SASL SCRAM over TLS reaches a broker that authenticates: tansu 0.6 with `--authentication`
/// and memory storage has no SCRAM user (none can be created while authentication is on), so
/// the login is refused, and that refusal must read as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_sasl_scram_login_over_tls_says_to_check_the_credentials() {
    let brokers = listener("KAFKA_SASL_SSL_BROKERS", 9098);
    init_tracing();
    for mechanism in ["SCRAM-SHA-512", "SCRAM-SHA-256"] {
        let sasl = vec![
            ("security.protocol", "SASL_SSL".to_owned()),
            ("ssl.ca.location", tls_file("ca.pem")),
            ("sasl.mechanisms", mechanism.to_owned()),
            ("sasl.username", "txinbox".to_owned()),
            ("sasl.password", "not-this-one".to_owned()),
        ];
        let problem = refused(&brokers, &sasl, "SASL authentication failed").await;
        assert!(
            problem.contains("SCRAM") && problem.contains("sasl.password"),
            "{problem}"
        );
        assert!(
            !problem.contains("not-this-one"),
            "the password never appears: {problem}"
        );
    }
}

/// What this build of librdkafka has: TLS, the SASL mechanisms, every compression codec.
#[test]
fn librdkafka_is_built_with_tls_sasl_and_every_codec() {
    let features = ClientConfig::new()
        .create_native_config()
        .unwrap()
        .get("builtin.features")
        .unwrap();
    let features: Vec<&str> = features.split(',').map(str::trim).collect();
    let mut wanted = vec!["gzip", "snappy", "lz4", "sasl_plain"];
    if cfg!(feature = "ssl") {
        wanted.extend(["ssl", "sasl_scram", "sasl_oauthbearer"]);
    }
    if cfg!(feature = "zstd") {
        wanted.push("zstd");
    }
    if cfg!(feature = "gssapi") {
        wanted.push("sasl_gssapi");
    }
    if cfg!(feature = "oidc") {
        wanted.push("oidc");
    }
    for f in wanted {
        assert!(
            features.contains(&f),
            "{f} missing from builtin.features {features:?}"
        );
    }
}

/// Each SASL mechanism is accepted by client creation (librdkafka refuses one it has no
/// provider for: "No provider for SASL mechanism"). Configuration only: no broker here speaks
/// PLAIN, OAUTHBEARER or GSSAPI.
#[cfg(feature = "ssl")]
#[test]
fn every_sasl_mechanism_is_accepted_by_configuration() {
    let mut cases: Vec<Vec<(&str, &str)>> = vec![
        vec![
            ("sasl.mechanisms", "PLAIN"),
            ("sasl.username", "u"),
            ("sasl.password", "p"),
        ],
        vec![
            ("sasl.mechanisms", "SCRAM-SHA-256"),
            ("sasl.username", "u"),
            ("sasl.password", "p"),
        ],
        vec![
            ("sasl.mechanisms", "SCRAM-SHA-512"),
            ("sasl.username", "u"),
            ("sasl.password", "p"),
        ],
        vec![
            ("sasl.mechanisms", "OAUTHBEARER"),
            ("enable.sasl.oauthbearer.unsecure.jwt", "true"),
            ("sasl.oauthbearer.config", "principal=txinbox"),
        ],
    ];
    if cfg!(feature = "oidc") {
        cases.push(vec![
            ("sasl.mechanisms", "OAUTHBEARER"),
            ("sasl.oauthbearer.method", "oidc"),
            ("sasl.oauthbearer.client.id", "id"),
            ("sasl.oauthbearer.client.secret", "secret"),
            ("sasl.oauthbearer.token.endpoint.url", "https://127.0.0.1:1/token"),
        ]);
    }
    if cfg!(feature = "gssapi") {
        cases.push(vec![
            ("sasl.mechanisms", "GSSAPI"),
            ("sasl.kerberos.service.name", "kafka"),
            ("sasl.kerberos.kinit.cmd", "true"),
        ]);
    }
    for case in cases {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", "127.0.0.1:1")
            .set("security.protocol", "SASL_SSL");
        for (k, v) in &case {
            config.set(*k, *v);
        }
        let created: Result<BaseConsumer, _> = config.create();
        assert!(created.is_ok(), "{case:?}: {:?}", created.err());
    }
}
