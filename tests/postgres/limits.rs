//! Untrusted input is bounded: a message without a usable ID, with an oversized ID or payload is
//! dead-lettered without running the handler, nothing of it beyond the limits is copied, and
//! the dead letter stores at most the configured number of bytes.

use bytes::Bytes;
use txinbox::memory::MemoryBroker;
use txinbox::{dead_letter::DeadLetterReason, message::Headers, Consumer, IdStrategy};

use super::support::{deposit_in_lane, drain, DepositHandler, TestDb};

#[tokio::test]
async fn messages_without_a_usable_id_or_too_large_are_dead_lettered_not_processed() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish_with(
        Some("l"),
        None,
        Headers::new(),
        deposit_in_lane("alice", 1, "l", 0).into(),
    );
    broker.publish_with(
        Some("l"),
        Some("evt-big".into()),
        Headers::new().with("bin", Bytes::from_static(b"\xff\x00\xfe")),
        Bytes::from(vec![b'x'; 2048]),
    );
    broker.publish_with(
        Some("l"),
        Some("a\0b".into()),
        Headers::new(),
        deposit_in_lane("alice", 1, "l", 2).into(),
    );
    broker.publish_in_lane("l", "evt-ok", deposit_in_lane("alice", 7, "l", 3));
    broker.close();
    let handler = DepositHandler::default();
    Consumer::builder("untrusted")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler.clone())
        .max_message_bytes(1024)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    assert_eq!(handler.calls(), 1, "only the valid message ran");
    assert_eq!(db.balance("alice").await, 7);
    let reasons: Vec<String> = sqlx::query_scalar("SELECT reason FROM txinbox.dead_letters ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(reasons, ["missing_id", "too_large", "invalid_id"]);
    let headers: serde_json::Value =
        sqlx::query_scalar("SELECT headers FROM txinbox.dead_letters WHERE reason = 'too_large'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        headers[0]["value_hex"], "ff00fe",
        "binary headers are kept, not lost"
    );
}

/// What `txinbox.dead_letters` holds of a message: stored bytes, recorded size, recorded hash,
/// whether it was cut, and the stored headers.
async fn stored(db: &TestDb, consumer: &str) -> (i64, Option<i64>, Option<Vec<u8>>, bool, serde_json::Value) {
    sqlx::query_as(
        "SELECT octet_length(payload)::bigint, payload_size, payload_sha256, truncated, headers
         FROM txinbox.dead_letters WHERE consumer = $1",
    )
    .bind(consumer)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

fn sha256(bytes: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).to_vec()
}

#[tokio::test]
async fn an_oversized_message_is_stored_cut_with_its_size_and_hash() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    let payload = Bytes::from(vec![b'x'; 3 << 20]);
    let big_header = Bytes::from(vec![b'h'; 2 << 20]);
    broker.publish_with(
        None,
        Some("evt-big".into()),
        Headers::new().with("small", "kept").with("big", big_header),
        payload.clone(),
    );
    broker.close();
    drain("oversized", &db, &broker, DepositHandler::default()).await;
    let (bytes, size, hash, truncated, headers) = stored(&db, "oversized").await;
    assert_eq!(
        bytes,
        1 << 20,
        "cut to the default limit, max_message_bytes (1 MiB)"
    );
    assert_eq!(size, Some(3 << 20), "the size as received");
    assert_eq!(hash, Some(sha256(&payload)), "the SHA-256 of the whole payload");
    assert!(truncated);
    assert_eq!(
        headers,
        serde_json::json!([{"name": "small", "value": "kept"}]),
        "headers in order while they fit"
    );
    assert_eq!(broker.dead_letters()[0].1.reason, DeadLetterReason::TooLarge);
}

#[tokio::test]
async fn the_dead_letter_payload_limit_is_configurable_and_whole_payloads_say_so() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", "not json, and longer than the limit");
    broker.publish("evt-2", "short");
    broker.close();
    Consumer::builder("capped")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .dead_letter_payload_limit(8)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let rows: Vec<(Vec<u8>, i64, bool)> = sqlx::query_as(
        "SELECT payload, payload_size, truncated FROM txinbox.dead_letters WHERE consumer = 'capped' ORDER BY message_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        rows,
        [(b"not json".to_vec(), 35, true), (b"short".to_vec(), 5, false),]
    );
}

/// The size is checked before anything else: an oversized payload is not parsed to find its
/// ID (a JSON pointer strategy finds none), while an ID in a header is still recorded, so a
/// redelivery is recognised as the same dead letter.
#[tokio::test]
async fn an_oversized_payload_is_never_parsed_for_its_id() {
    let db = TestDb::new(10).await;
    let broker = MemoryBroker::new("payments");
    let pad = "x".repeat(2 << 20);
    broker.publish("native-1", format!(r#"{{"id":"evt-json","pad":"{pad}"}}"#));
    broker.close();
    Consumer::builder("pointer")
        .source(broker.source())
        .inbox(db.inbox())
        .handler(DepositHandler::default())
        .id_strategy(IdStrategy::JsonPointer("/id".into()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let id: Option<String> =
        sqlx::query_scalar("SELECT message_id FROM txinbox.dead_letters WHERE consumer = 'pointer'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(id, None, "the payload was not parsed");

    let broker = MemoryBroker::new("payments");
    broker.publish("native-1", format!(r#"{{"id":"evt-json","pad":"{pad}"}}"#));
    broker.publish("native-1", format!(r#"{{"id":"evt-json","pad":"{pad}"}}"#));
    broker.close();
    drain("native", &db, &broker, DepositHandler::default()).await;
    let ids: Vec<Option<String>> =
        sqlx::query_scalar("SELECT message_id FROM txinbox.dead_letters WHERE consumer = 'native'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(ids, [Some("native-1".to_string())], "recorded once, with its ID");
    assert_eq!(
        broker.dead_letters().len(),
        2,
        "both deliveries go to the dead letters"
    );
}

/// With `CanonicalJson`, a processed message read again with headers that now put it over
/// `max_message_bytes` (the limit lowered, or an `x-death` header grown) is `too_large`, not a
/// `conflict`: its payload was not parsed, so its fingerprint cannot be compared.
#[tokio::test]
async fn a_processed_message_over_the_limit_when_read_again_is_too_large_not_a_conflict() {
    let db = TestDb::new(10).await;
    let payload = deposit_in_lane("alice", 10, "-", 0);
    for headers in [Headers::new(), Headers::new().with("x-death", "y".repeat(200))] {
        let broker = MemoryBroker::new("payments");
        broker.publish_with(None, Some("evt-1".into()), headers, Bytes::from(payload.clone()));
        broker.close();
        Consumer::builder("canon-limit")
            .source(broker.source())
            .inbox(db.inbox())
            .handler(DepositHandler::default())
            .fingerprint(txinbox::message::Fingerprint::CanonicalJson)
            .max_message_bytes(150)
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
    }
    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM txinbox.dead_letters WHERE consumer = 'canon-limit'")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(reasons, ["too_large"]);
}
