//! Dead letters that the dead-letter topic cannot take as they are: too large for the producer,
//! or refused outright. Neither may stall the partition (issue 15, defect 1).

use std::time::Duration;

use rdkafka::message::{Header, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientConfig;
use sha2::{Digest, Sha256};
use txinbox_kafka::{headers, telemetry};

use super::common::*;
use super::{metrics, setup_topic, Command};

/// Sends one record with `hs` as headers (plus the `ce_id`).
async fn send_raw(brokers: &str, topic: &str, id: &str, payload: &[u8], hs: &[(&str, &[u8])]) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("message.timeout.ms", "30000")
        .create()
        .unwrap();
    let mut h = OwnedHeaders::new().insert(Header {
        key: "ce_id",
        value: Some(id),
    });
    for (key, value) in hs {
        h = h.insert(Header {
            key,
            value: Some(*value),
        });
    }
    producer
        .send(
            FutureRecord::to(topic)
                .key("k")
                .payload(payload)
                .partition(0)
                .headers(h),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produce");
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A poison record whose dead-letter copy (payload + original headers + `txinbox.dlq.*`
/// headers) exceeds the dead-letter producer's `message.max.bytes`: the copy leaves the
/// payload out (and then the original headers) and says so; the good records behind it are
/// processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn oversized_dead_letter_falls_back_to_a_copy_that_fits_and_the_partition_moves_on() {
    let (mock, topic) = setup_topic("oversized", 1);
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    let config =
        kafka_config(&mock.bootstrap, "g-oversized", &topic).set_producer("message.max.bytes", "2000");
    let running = Running::start(&db, config, DepositHandler::default().tagged(1));

    let big_payload = vec![b'x'; 1900]; // not JSON: undecodable
    let big_header = vec![b'h'; 1800];
    producer
        .send(&topic, Some(0), "k", Some("ok-1"), &deposit("acct-1", 5))
        .await;
    send_raw(&mock.bootstrap, &topic, "bad-payload", &big_payload, &[]).await;
    send_raw(
        &mock.bootstrap,
        &topic,
        "bad-headers",
        &big_payload[..1500],
        &[("trace", &big_header)],
    )
    .await;
    producer
        .send(&topic, Some(0), "k", Some("ok-2"), &deposit("acct-1", 11))
        .await;
    db.wait_applied(2, Duration::from_secs(30)).await;

    let dead = tokio::task::spawn_blocking({
        let brokers = mock.bootstrap.clone();
        let dlq = format!("{topic}.dlq");
        move || read_all(&brokers, &dlq, 1, 2, Duration::from_secs(30))
    })
    .await
    .unwrap();
    assert_eq!(dead.len(), 2, "two dead letters");
    let (first, second) = (&dead[0], &dead[1]);

    // Payload left out, original headers kept.
    assert_eq!(header(first, headers::OFFSET).as_deref(), Some("1"));
    assert_eq!(header(first, headers::REASON).as_deref(), Some("undecodable"));
    assert!(first.payload().is_none_or(<[u8]>::is_empty), "payload left out");
    assert_eq!(header(first, headers::PAYLOAD).as_deref(), Some("omitted"));
    assert_eq!(header(first, headers::ORIGINAL_SIZE).as_deref(), Some("1900"));
    assert_eq!(
        header(first, headers::ORIGINAL_SHA256),
        Some(sha256_hex(&big_payload))
    );
    assert_eq!(header(first, "ce_id").as_deref(), Some("bad-payload"));
    assert_eq!(header(first, headers::HEADERS), None, "original headers kept");

    // Payload and original headers left out.
    assert_eq!(header(second, headers::OFFSET).as_deref(), Some("2"));
    assert!(second.payload().is_none_or(<[u8]>::is_empty));
    assert_eq!(header(second, headers::PAYLOAD).as_deref(), Some("omitted"));
    assert_eq!(header(second, headers::HEADERS).as_deref(), Some("omitted"));
    assert_eq!(header(second, headers::ORIGINAL_SIZE).as_deref(), Some("1500"));
    assert_eq!(
        header(second, headers::ORIGINAL_SHA256),
        Some(sha256_hex(&big_payload[..1500]))
    );
    assert_eq!(header(second, "ce_id"), None);
    assert_eq!(header(second, "trace"), None);
    assert_eq!(header(second, headers::TOPIC).as_deref(), Some(topic.as_str()));

    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 2);
    assert_eq!(db.positions(&topic).await[&0], 4, "the partition moved on");
}

/// A dead-letter topic that refuses writes for good (authorization): the database's
/// dead-letter row is the record, the refusal is logged and counted, the partition goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_dead_letter_topic_is_counted_and_the_partition_moves_on() {
    metrics::install();
    let (mock, topic) = setup_topic("refusing", 1);
    let dlq = "refusing.forbidden";
    mock.call(|d| {
        Command::TopicError(
            dlq.into(),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
            d,
        )
    });
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    let config = kafka_config(&mock.bootstrap, "g-refusing", &topic).dead_letter_topic(dlq);
    let running = Running::start(&db, config, DepositHandler::default().tagged(1));
    producer
        .send(&topic, Some(0), "k", Some("ok-1"), &deposit("acct-1", 5))
        .await;
    producer
        .send(&topic, Some(0), "k", Some("bad-1"), "{not json")
        .await;
    producer
        .send(&topic, Some(0), "k", Some("ok-2"), &deposit("acct-1", 11))
        .await;
    db.wait_applied(2, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;

    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox.dead_letters WHERE reason = 'undecodable'")
            .await,
        1,
        "the database's dead-letter row is the record"
    );
    assert_eq!(db.positions(&topic).await[&0], 3, "the partition moved on");
    assert_eq!(
        metrics::counter(telemetry::DEAD_LETTERS_REFUSED, ("topic", dlq)),
        1,
        "the refusal is counted"
    );
    assert_eq!(
        metrics::gauge(telemetry::DEAD_LETTERS_WAITING, ("topic", dlq)),
        0.0,
        "nothing left waiting"
    );
}

/// A dead-letter topic that is unavailable for a while (its leader is not available): the
/// partition waits (fail closed), visibly, and goes on once the dead letter is confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unavailable_dead_letter_topic_holds_the_partition_visibly_until_it_is_back() {
    metrics::install();
    let (mock, topic) = setup_topic("waiting", 1);
    let dlq = "waiting.dlq";
    mock.call(|d| {
        Command::TopicError(
            dlq.into(),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE,
            d,
        )
    });
    let db = TestDb::new().await;
    let producer = Producer::new(&mock.bootstrap);
    let config =
        kafka_config(&mock.bootstrap, "g-waiting", &topic).dead_letter_timeout(Duration::from_secs(1));
    let running = Running::start(&db, config, DepositHandler::default().tagged(1));
    producer
        .send(&topic, Some(0), "k", Some("ok-1"), &deposit("acct-1", 5))
        .await;
    producer
        .send(&topic, Some(0), "k", Some("bad-1"), "{not json")
        .await;
    producer
        .send(&topic, Some(0), "k", Some("ok-2"), &deposit("acct-1", 11))
        .await;
    db.wait_applied(1, Duration::from_secs(30)).await;
    super::wait_for(
        Duration::from_secs(20),
        "the dead letter is reported waiting",
        || async { metrics::gauge(telemetry::DEAD_LETTERS_WAITING, ("topic", dlq)) == 1.0 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        db.applied().await,
        1,
        "the partition waits for its dead letter (fail closed)"
    );
    assert_eq!(db.positions(&topic).await.get(&0).copied(), Some(1));

    mock.call(|d| Command::TopicError(dlq.into(), RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR, d));
    db.wait_applied(2, Duration::from_secs(30)).await;
    assert_eq!(
        metrics::gauge(telemetry::DEAD_LETTERS_WAITING, ("topic", dlq)),
        0.0
    );
    let dead = tokio::task::spawn_blocking({
        let brokers = mock.bootstrap.clone();
        move || read_all(&brokers, dlq, 1, 1, Duration::from_secs(30))
    })
    .await
    .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(header(&dead[0], headers::OFFSET).as_deref(), Some("1"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    assert_eq!(db.positions(&topic).await[&0], 3);
    assert_eq!(
        metrics::counter(telemetry::DEAD_LETTERS_REFUSED, ("topic", dlq)),
        0,
        "a transient failure is not a refusal"
    );
}
