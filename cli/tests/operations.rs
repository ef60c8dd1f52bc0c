//! The `txinbox` binary against real PostgreSQL (`DATABASE_URL`) and a Kafka-protocol broker
//! (`KAFKA_BROKERS`, e.g. tansu from `scripts/lib/tansu.sh`'s `ensure_tansu`). Consumers are
//! real txinbox consumers on the Kafka adapter with a non-idempotent handler (a balance plus
//! one `effects` row per application). Without `KAFKA_BROKERS` the broker tests say so and
//! pass without running, except under `CI`, where they fail.

mod support;

use std::time::Duration;

use support::*;

const WAIT: Duration = Duration::from_secs(60);

fn consumer_name() -> String {
    format!(
        "svc-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 1_000_000_000
    )
}

async fn duplicates(db: &TestDb, consumer: &str) -> i64 {
    db.scalar(&format!(
        "SELECT coalesce(sum(duplicates), 0)::bigint FROM txinbox.inbox WHERE consumer = '{consumer}'"
    ))
    .await
}

/// Runs `txinbox args` and asserts a refusal: exit 1, `why` on stderr, the stored position of
/// `consumer` in `topic`/0 unchanged. Then runs it with `--force` and returns the JSON report.
async fn refused_unless_forced(
    db: &TestDb,
    brokers: &str,
    args: &[&str],
    why: &str,
    consumer: &str,
    topic: &str,
) -> serde_json::Value {
    let before = db.position(consumer, topic, 0).await;
    let refused = txinbox(&db.url, Some(brokers), args).await;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stderr.contains(why), "{refused:?}");
    assert_eq!(
        db.position(consumer, topic, 0).await,
        before,
        "a refusal changes nothing"
    );
    txinbox(&db.url, Some(brokers), &[args, &["--force"]].concat())
        .await
        .ok()
}

/// Acceptance: replaying a fully processed partition from offset 0 applies nothing; every
/// replayed record is a duplicate (predicted by the dry run, then counted by the consumer).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_of_fully_processed_partition_applies_nothing() {
    let Some(brokers) = brokers() else { return };
    let db = TestDb::new().await;
    let topic = create_topic(&brokers, 2).await;
    let consumer = consumer_name();
    let producer = Producer::new(&brokers);
    producer.deposits(&topic, 0, "p0", 30).await;
    producer.deposits(&topic, 1, "p1", 10).await;

    let running = Running::start(&db, &brokers, &consumer, &topic);
    db.wait_for("SELECT count(*) FROM effects", 40, WAIT).await;
    running.stop().await;
    assert_eq!(db.position(&consumer, &topic, 0).await, Some(30));
    // The group replay and status read (the consumer's group.id is its name here).
    record_subscription(&db, &consumer, &topic, &consumer).await;

    let dry = txinbox(
        &db.url,
        Some(&brokers),
        &[
            "--json",
            "replay",
            "--consumer",
            &consumer,
            "--topic",
            &topic,
            "--partition",
            "0",
            "--to-offset",
            "0",
            "--dry-run",
        ],
    )
    .await
    .ok();
    assert_eq!(dry["applied"], 30, "{dry:#}");
    assert_eq!(dry["new"], 0, "{dry:#}");
    assert_eq!(dry["conflicting"], 0, "{dry:#}");
    assert_eq!(
        db.position(&consumer, &topic, 0).await,
        Some(30),
        "a dry run changes nothing"
    );
    // With an ID strategy the consumer does not use, the dry run would call everything new.
    let wrong = txinbox(
        &db.url,
        Some(&brokers),
        &[
            "replay",
            "--consumer",
            &consumer,
            "--topic",
            &topic,
            "--to-offset",
            "0",
            "--dry-run",
            "--id-strategy",
            "sha256",
        ],
    )
    .await;
    assert_eq!(wrong.code, 2, "{wrong:?}");
    assert!(wrong.stderr.contains("--id-strategy cloudevents"), "{wrong:?}");

    let replay = txinbox(
        &db.url,
        Some(&brokers),
        &[
            "--json",
            "replay",
            "--consumer",
            &consumer,
            "--topic",
            &topic,
            "--partition",
            "0",
            "--to-offset",
            "0",
        ],
    )
    .await
    .ok();
    assert_eq!(replay["database_positions_set"], true, "{replay:#}");
    eprintln!("group offsets committed: {}", replay["group_offsets_committed"]);
    assert_eq!(db.position(&consumer, &topic, 0).await, Some(0));
    assert_eq!(
        db.position(&consumer, &topic, 1).await,
        Some(10),
        "partition 1 untouched"
    );

    let running = Running::start(&db, &brokers, &consumer, &topic);
    db.wait_for(
        &format!(
            "SELECT coalesce(sum(duplicates), 0)::bigint FROM txinbox.inbox WHERE consumer = '{consumer}'"
        ),
        30,
        WAIT,
    )
    .await;
    db.wait_for(
        &format!("SELECT next_position FROM txinbox.positions WHERE consumer = '{consumer}' AND lane = '0'"),
        30,
        WAIT,
    )
    .await;
    running.stop().await;
    assert_eq!(db.assert_none_twice().await, 40);
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects").await,
        40,
        "nothing applied again"
    );
    assert_eq!(
        duplicates(&db, &consumer).await,
        30,
        "every replayed record a duplicate"
    );

    let status = txinbox(
        &db.url,
        Some(&brokers),
        &["--json", "status", "--consumer", &consumer],
    )
    .await
    .ok();
    let c = &status["consumers"][0];
    assert_eq!(c["processed"], 40, "{status:#}");
    assert_eq!(c["duplicates"], 30, "{status:#}");
    let p0 = c["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["partition"] == 0)
        .unwrap();
    assert_eq!(p0["database_position"], 30, "{status:#}");
    assert_eq!(p0["high_watermark"], 30, "{status:#}");
    assert_eq!(p0["lag"], 0, "{status:#}");
}

/// Acceptance: after a simulated database restore (the last 15 messages' effects and inbox rows
/// are gone, the stored position is not), a replay from offset 0 applies exactly the missing
/// messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_after_database_restore_applies_exactly_the_missing() {
    let Some(brokers) = brokers() else { return };
    let db = TestDb::new().await;
    let topic = create_topic(&brokers, 1).await;
    let consumer = consumer_name();
    let producer = Producer::new(&brokers);
    producer.deposits(&topic, 0, "r", 40).await;
    // Offset 40: r-3 again with another payload (a conflict); offset 41: r-39 again, same
    // payload (a duplicate inside the replayed range).
    producer.send(&topic, 0, "r-3", &deposit("acct-z", 999)).await;
    producer.send(&topic, 0, "r-39", &deposit("acct-4", 40)).await;

    let running = Running::start(&db, &brokers, &consumer, &topic);
    let position = format!(
        "SELECT coalesce(max(next_position), 0) FROM txinbox.positions WHERE consumer = '{consumer}'"
    );
    db.wait_for(&position, 42, WAIT).await;
    running.stop().await;
    assert_eq!(db.scalar("SELECT count(*) FROM effects").await, 40);
    record_subscription(&db, &consumer, &topic, &consumer).await;

    // The restore: business tables and inbox as of 25 messages (one transaction, as a backup
    // would be consistent); the position table kept from later, so the consumer alone would
    // resume at 40 and never apply r-25..r-39 again.
    db.exec(
        "BEGIN;
         DELETE FROM effects WHERE substr(message_id, 3)::int >= 25;
         DELETE FROM txinbox.inbox WHERE substr(message_id, 3)::int >= 25;
         DELETE FROM accounts;
         INSERT INTO accounts SELECT 'x', sum(amount) FROM effects;
         COMMIT;",
    )
    .await;
    assert_eq!(db.scalar("SELECT count(*) FROM effects").await, 25);

    let dry = txinbox(
        &db.url,
        Some(&brokers),
        &[
            "--json",
            "replay",
            "--consumer",
            &consumer,
            "--topic",
            &topic,
            "--to-offset",
            "0",
            "--dry-run",
        ],
    )
    .await
    .ok();
    assert_eq!(
        (
            dry["applied"].as_i64(),
            dry["new"].as_i64(),
            dry["conflicting"].as_i64()
        ),
        (Some(26), Some(15), Some(1)),
        "r-0..r-24 and the second r-39 are skipped, r-25..r-39 new, the other r-3 conflicts: {dry:#}"
    );

    txinbox(
        &db.url,
        Some(&brokers),
        &[
            "--json",
            "replay",
            "--consumer",
            &consumer,
            "--topic",
            &topic,
            "--to-offset",
            "0",
        ],
    )
    .await
    .ok();
    assert_eq!(db.position(&consumer, &topic, 0).await, Some(0));
    let running = Running::start(&db, &brokers, &consumer, &topic);
    db.wait_for(&position, 42, WAIT).await;
    running.stop().await;
    assert_eq!(db.assert_none_twice().await, 40, "every message applied once");
    let restored: i64 = db
        .scalar("SELECT count(*) FROM effects WHERE substr(message_id, 3)::int >= 25")
        .await;
    assert_eq!(restored, 15, "exactly the missing messages applied");
    assert_eq!(
        duplicates(&db, &consumer).await,
        26,
        "r-0..r-24 and the second r-39"
    );
    assert_eq!(db.position(&consumer, &topic, 0).await, Some(42));
}

/// Acceptance: a purge running while a consumer processes redeliveries of IDs inside the window
/// lets no duplicate through; old terminal rows go, `retrying` rows stay, the horizon is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purge_while_consumer_runs_lets_no_duplicate_through() {
    let Some(brokers) = brokers() else { return };
    let db = TestDb::new().await;
    let topic = create_topic(&brokers, 1).await;
    let consumer = consumer_name();
    let producer = Producer::new(&brokers);
    producer.deposits(&topic, 0, "w", 200).await;
    let running = Running::start(&db, &brokers, &consumer, &topic);
    db.wait_for("SELECT count(*) FROM effects", 200, WAIT).await;

    // 20,000 rows that finished 30 days ago, and one old message still retrying.
    db.exec(&format!(
        "INSERT INTO txinbox.inbox (consumer, message_id, id_strategy, fingerprint, status, attempts,
                                    first_seen_at, processed_at, source_system, destination)
         SELECT '{consumer}', 'old-' || i, 'cloudevents', sha256(i::text::bytea), 'processed', 1,
                now() - interval '30 days', now() - interval '30 days', 'kafka', '{topic}'
         FROM generate_series(1, 20000) i;
         INSERT INTO txinbox.inbox (consumer, message_id, id_strategy, fingerprint, status, attempts,
                                    first_seen_at, processed_at, source_system, destination)
         VALUES ('{consumer}', 'old-retrying', 'cloudevents', sha256('x'::bytea), 'retrying', 2,
                 now() - interval '30 days', NULL, 'kafka', '{topic}');"
    ))
    .await;

    let purge = {
        let url = db.url.clone();
        let consumer = consumer.clone();
        tokio::spawn(async move {
            txinbox(
                &url,
                None,
                &[
                    "--json",
                    "purge",
                    "--consumer",
                    &consumer,
                    "--older-than",
                    "7d",
                    "--batch-size",
                    "200",
                    "--yes",
                ],
            )
            .await
        })
    };
    // Redeliveries of every ID inside the window while the purge runs.
    producer.deposits(&topic, 0, "w", 200).await;
    let purged = purge.await.unwrap().ok();
    // Every redelivery consumed (the position is stored with each message's outcome).
    db.wait_for(
        &format!("SELECT next_position FROM txinbox.positions WHERE consumer = '{consumer}'"),
        400,
        WAIT,
    )
    .await;
    running.stop().await;

    assert_eq!(db.assert_none_twice().await, 200);
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects").await,
        200,
        "no redelivery applied"
    );
    assert_eq!(
        duplicates(&db, &consumer).await,
        200,
        "every redelivery a duplicate"
    );
    assert_eq!(purged["consumers"][0]["deleted"], 20_000, "{purged:#}");
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) FROM txinbox.inbox WHERE consumer = '{consumer}'"
        ))
        .await,
        201,
        "the 200 rows inside the window and the retrying row remain"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox.inbox WHERE message_id = 'old-retrying'")
            .await,
        1,
        "a retrying row is never purged"
    );
    let status = txinbox(&db.url, None, &["--json", "status", "--consumer", &consumer])
        .await
        .ok();
    assert!(
        status["consumers"][0]["retention_horizon"].is_string(),
        "{status:#}"
    );

    // Nothing left to purge: a second run deletes nothing.
    let again = txinbox(
        &db.url,
        None,
        &["--json", "purge", "--consumer", &consumer, "--yes"],
    )
    .await
    .ok();
    assert_eq!(again["consumers"][0]["deleted"], 0, "{again:#}");
}

/// Acceptance: a dead letter requeued after fixing its cause is applied once; a second requeue
/// reaches the consumer as a duplicate. Also list, show and discard.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letter_requeue_applies_once_then_is_a_duplicate() {
    let Some(brokers) = brokers() else { return };
    let db = TestDb::new().await;
    let topic = create_topic(&brokers, 1).await;
    let consumer = consumer_name();
    db.exec("INSERT INTO blocked VALUES ('acct-bad')").await;
    let running = Running::start(&db, &brokers, &consumer, &topic);
    let producer = Producer::new(&brokers);
    producer.send(&topic, 0, "d-1", &deposit("acct-bad", 7)).await;
    producer.send(&topic, 0, "d-2", &deposit("acct-ok", 5)).await;
    db.wait_for("SELECT count(*) FROM txinbox.dead_letters", 1, WAIT)
        .await;
    db.wait_for("SELECT count(*) FROM effects", 1, WAIT).await;

    let list = txinbox(
        &db.url,
        None,
        &["--json", "dead-letters", "list", "--consumer", &consumer],
    )
    .await
    .ok();
    let dls = list["dead_letters"].as_array().unwrap();
    assert_eq!(dls.len(), 1, "{list:#}");
    assert_eq!(dls[0]["message_id"], "d-1");
    assert_eq!(dls[0]["state"], "pending");
    assert_eq!(dls[0]["reason"], "permanent_error");
    let id = dls[0]["id"].as_i64().unwrap().to_string();
    let show = txinbox(&db.url, None, &["--json", "dead-letters", "show", &id])
        .await
        .ok();
    assert_eq!(show["payload"], deposit("acct-bad", 7), "{show:#}");
    assert!(show["error"].as_str().unwrap().contains("blocked"), "{show:#}");
    assert_eq!(show["headers"][0]["name"], "ce_id", "{show:#}");

    // Fix the cause, then requeue: applied once.
    db.exec("DELETE FROM blocked").await;
    // Not while another consumer of the topic would take the copy for a new message.
    db.exec(&format!(
        "INSERT INTO txinbox.positions (consumer, source, lane, next_position) VALUES ('audit-{consumer}', '{topic}', '0', 2)"
    ))
    .await;
    let refused = txinbox(&db.url, Some(&brokers), &["dead-letters", "requeue", &id]).await;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.stderr.contains(&format!("audit-{consumer}")),
        "{refused:?}"
    );
    db.exec(&format!(
        "DELETE FROM txinbox.positions WHERE consumer = 'audit-{consumer}'"
    ))
    .await;
    let first = txinbox(
        &db.url,
        Some(&brokers),
        &["--json", "dead-letters", "requeue", &id],
    )
    .await
    .ok();
    db.wait_for("SELECT count(*) FROM effects WHERE message_id = 'd-1'", 1, WAIT)
        .await;
    assert_eq!(first["results"][0]["inbox_reopened"], true, "{first:#}");

    // Again: the copy is a duplicate.
    let second = txinbox(
        &db.url,
        Some(&brokers),
        &["--json", "dead-letters", "requeue", &id],
    )
    .await
    .ok();
    // d-1, d-2, the first copy, the second copy: four records consumed.
    db.wait_for("SELECT max(next_position) FROM txinbox.positions", 4, WAIT)
        .await;
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects WHERE message_id = 'd-1'")
            .await,
        1,
        "the second copy is not applied"
    );
    assert_eq!(
        db.scalar("SELECT duplicates FROM txinbox.inbox WHERE message_id = 'd-1'")
            .await,
        1,
        "the second copy is counted as a duplicate"
    );
    assert_eq!(second["results"][0]["inbox_reopened"], false, "{second:#}");
    assert_eq!(
        second["results"][0]["inbox_status_before"], "processed",
        "{second:#}"
    );
    // A conflict (d-2 again with another payload) is dead-lettered; requeueing it is refused.
    producer.send(&topic, 0, "d-2", &deposit("acct-ok", 500)).await;
    db.wait_for("SELECT count(*) FROM txinbox.dead_letters", 2, WAIT)
        .await;
    running.stop().await;
    let conflict = db
        .scalar("SELECT id FROM txinbox.dead_letters WHERE reason = 'conflict'")
        .await
        .to_string();
    let refused = txinbox(&db.url, Some(&brokers), &["dead-letters", "requeue", &conflict]).await;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stderr.contains("conflict"), "{refused:?}");

    // A binary payload is shown as hex; status reads as text too, and a topic the broker no
    // longer has is reported, not fatal.
    db.exec(&format!(
        "INSERT INTO txinbox.dead_letters (consumer, reason, error, attempts, payload, headers, source_system, destination)
         VALUES ('{consumer}', 'undecodable', 'not JSON', 0, '\\xff00'::bytea, '[]', 'kafka', '{topic}');
         INSERT INTO txinbox.positions (consumer, source, lane, next_position) VALUES ('{consumer}', 'gone-{topic}', '0', 5);"
    ))
    .await;
    let binary = db
        .scalar("SELECT id FROM txinbox.dead_letters WHERE reason = 'undecodable'")
        .await
        .to_string();
    let show = txinbox(&db.url, None, &["--json", "dead-letters", "show", &binary])
        .await
        .ok();
    assert_eq!(show["payload_hex"], "ff00", "{show:#}");
    let text = txinbox(&db.url, Some(&brokers), &["status", "--consumer", &consumer]).await;
    assert_eq!(text.code, 0, "{text:?}");
    assert!(text.stdout.contains(&format!("consumer {consumer}")), "{text:?}");
    assert!(
        text.stdout.contains("dead letters 3 (2 pending)  conflicts 1"),
        "{text:?}"
    );
    assert!(
        text.stdout.contains(&format!("warning: gone-{topic}")),
        "{text:?}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects WHERE message_id = 'd-1'")
            .await,
        1
    );
    assert_eq!(db.assert_none_twice().await, 2);
    assert_eq!(
        db.scalar("SELECT balance FROM accounts WHERE id = 'acct-bad'")
            .await,
        7
    );

    // Discard keeps the row with its reason; a discarded dead letter is not requeued.
    let discard = txinbox(
        &db.url,
        None,
        &[
            "--json",
            "dead-letters",
            "discard",
            &id,
            "--reason",
            "handled by hand",
        ],
    )
    .await
    .ok();
    assert_eq!(discard["results"][0]["reason"], "handled by hand", "{discard:#}");
    let listed = txinbox(
        &db.url,
        None,
        &["--json", "dead-letters", "list", "--state", "discarded"],
    )
    .await
    .ok();
    assert_eq!(listed["dead_letters"].as_array().unwrap().len(), 1, "{listed:#}");
    let refused = txinbox(
        &db.url,
        Some(&brokers),
        &["--json", "dead-letters", "requeue", &id],
    )
    .await;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stdout.contains("discarded"), "{refused:?}");
    let missing = txinbox(&db.url, Some(&brokers), &["dead-letters", "requeue", "999999"]).await;
    assert_eq!(missing.code, 1, "{missing:?}");
    assert!(missing.stderr.contains("no such dead letter"), "{missing:?}");

    // A batch that meets an unreachable service stops there, reporting what it did requeue.
    db.exec(&format!(
        "INSERT INTO txinbox.dead_letters (consumer, message_id, id_strategy, fingerprint, reason, error,
                                           attempts, payload, headers, source_system, destination)
         VALUES ('{consumer}', 'r-1', 'cloudevents', sha256('x'::bytea), 'permanent_error', 'x', 1,
                 'x', '[]', 'rabbitmq', 'q-{consumer}')"
    ))
    .await;
    let rabbit = db
        .scalar("SELECT id FROM txinbox.dead_letters WHERE source_system = 'rabbitmq'")
        .await
        .to_string();
    let partial = txinbox(
        &db.url,
        Some(&brokers),
        &[
            "--json",
            "--amqp-url",
            "amqp://guest:sekret@127.0.0.1:1/%2f",
            "dead-letters",
            "requeue",
            "--force",
            &id,
            &rabbit,
            &id,
        ],
    )
    .await;
    assert_eq!(partial.code, 3, "{partial:?}");
    let results = partial.json()["results"].clone();
    assert_eq!(results[0]["requeued"], true, "{partial:?}");
    assert_eq!(results[1]["requeued"], false, "{partial:?}");
    assert_eq!(results[2]["error"], "not attempted", "{partial:?}");
    assert!(
        !partial.stdout.contains("sekret") && !partial.stderr.contains("sekret"),
        "{partial:?}"
    );
    // Requeued before, inbox row purged since: an earlier copy may have been applied.
    db.exec(&format!(
        "UPDATE txinbox.dead_letters SET discarded_at = NULL WHERE id = {id};
         DELETE FROM txinbox.inbox WHERE message_id = 'd-1'"
    ))
    .await;
    let purged_row = txinbox(&db.url, Some(&brokers), &["dead-letters", "requeue", &id]).await;
    assert_eq!(purged_row.code, 1, "{purged_row:?}");
    assert!(
        purged_row.stderr.contains("requeued 3 time(s) before"),
        "{purged_row:?}"
    );
    // A RabbitMQ URL that does not parse is a bad argument, and is not echoed.
    let bad_url = txinbox(
        &db.url,
        None,
        &[
            "--amqp-url",
            "amqp:guest:sekret@127.0.0.1",
            "dead-letters",
            "requeue",
            &rabbit,
        ],
    )
    .await;
    assert_eq!(bad_url.code, 2, "{bad_url:?}");
    assert!(
        !bad_url.stdout.contains("sekret") && !bad_url.stderr.contains("sekret"),
        "{bad_url:?}"
    );
}

/// Replay refuses a range that starts before the retention horizon (purged IDs would be
/// applied again) unless `--force`, and refuses while the group has active members.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_refuses_before_the_retention_horizon_and_with_running_consumers() {
    let Some(brokers) = brokers() else { return };
    let db = TestDb::new().await;
    let topic = create_topic(&brokers, 1).await;
    let consumer = consumer_name();
    Producer::new(&brokers).deposits(&topic, 0, "h", 10).await;
    let running = Running::start(&db, &brokers, &consumer, &topic);
    db.wait_for("SELECT count(*) FROM effects", 10, WAIT).await;
    record_subscription(&db, &consumer, &topic, &consumer).await;

    let args = [
        "--json",
        "replay",
        "--consumer",
        &consumer,
        "--topic",
        &topic,
        "--to-offset",
        "0",
    ];
    // While the consumer runs, its group has a member.
    let busy = txinbox(&db.url, Some(&brokers), &args).await;
    assert_eq!(busy.code, 1, "{busy:?}");
    assert!(busy.stderr.contains("active member"), "{busy:?}");
    running.stop().await;

    tokio::time::sleep(Duration::from_secs(1)).await;
    let purged = txinbox(
        &db.url,
        None,
        &[
            "--json",
            "purge",
            "--consumer",
            &consumer,
            "--older-than",
            "0s",
            "--force",
            "--yes",
        ],
    )
    .await
    .ok();
    assert_eq!(purged["consumers"][0]["deleted"], 10, "{purged:#}");

    let dry = txinbox(&db.url, Some(&brokers), &[&args[..], &["--dry-run"]].concat())
        .await
        .ok();
    assert_eq!(dry["new"], 10, "purged IDs no longer dedup: {dry:#}");
    assert!(
        dry["warning"].as_str().unwrap().contains("retention horizon"),
        "{dry:#}"
    );
    assert_eq!(db.position(&consumer, &topic, 0).await, Some(10));
    let forced = refused_unless_forced(&db, &brokers, &args, "retention horizon", &consumer, &topic).await;
    assert_eq!(forced["database_positions_set"], true, "{forced:#}");
    assert_eq!(db.position(&consumer, &topic, 0).await, Some(0));
}

/// Bad arguments exit 2, unreachable services exit 3 naming the service without the password,
/// an unmigrated database exits 1 and says to migrate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_and_unreachable_services_have_their_exit_codes() {
    let url = admin_url();
    for (args, hint) in [
        (&["replay", "--consumer", "x"][..], "--topic"),
        (&["purge", "--older-than", "7x"][..], "duration"),
        (&["dead-letters", "list", "--since", "yesterday"][..], "RFC 3339"),
        (
            &[
                "replay",
                "--consumer",
                "x",
                "--topic",
                "t",
                "--to-offset",
                "1",
                "--id-strategy",
                "uuid",
            ][..],
            "ID strategy",
        ),
        (&["frobnicate"][..], "frobnicate"),
    ] {
        let run = txinbox(&url, None, args).await;
        assert_eq!(run.code, 2, "{args:?}: {run:?}");
        assert!(run.stderr.contains(hint), "{args:?}: {run:?}");
    }

    let secret = "postgres://operator:sekret@127.0.0.1:1/inbox";
    let down = txinbox(secret, None, &["--json", "status"]).await;
    assert_eq!(down.code, 3, "{down:?}");
    assert!(
        down.stderr.contains("PostgreSQL at 127.0.0.1:1/inbox"),
        "{down:?}"
    );
    assert_eq!(down.json()["exit_code"], 3);
    assert!(
        !down.stderr.contains("sekret") && !down.stdout.contains("sekret"),
        "{down:?}"
    );

    let fresh = TestDb::create(false).await;
    let unmigrated = txinbox(&fresh.url, None, &["status"]).await;
    assert_eq!(unmigrated.code, 1, "{unmigrated:?}");
    assert!(unmigrated.stderr.contains("txinbox migrate"), "{unmigrated:?}");
    txinbox(&fresh.url, None, &["--json", "migrate"]).await.ok();
    txinbox(&fresh.url, None, &["--json", "migrate"]).await.ok();
    let empty = txinbox(&fresh.url, None, &["--json", "status"]).await.ok();
    assert_eq!(empty["consumers"], serde_json::json!([]));

    let kafka_down = txinbox(&fresh.url, Some("127.0.0.1:1"), &["status"]).await;
    assert_eq!(kafka_down.code, 3, "{kafka_down:?}");
    assert!(
        kafka_down.stderr.contains("Kafka brokers at 127.0.0.1:1"),
        "{kafka_down:?}"
    );
    let no_kafka = txinbox(
        &fresh.url,
        None,
        &["replay", "--consumer", "c", "--topic", "t", "--to-earliest"],
    )
    .await;
    assert_eq!(no_kafka.code, 2, "{no_kafka:?}");
    assert!(no_kafka.stderr.contains("KAFKA_BROKERS"), "{no_kafka:?}");
}

/// Acceptance, RabbitMQ: a dead letter requeued to its original queue (AMQP `message_id`
/// restored, so the `native` ID is the same) is applied once after the fix; again: a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_dead_letter_requeue_applies_once_then_is_a_duplicate() {
    let db = TestDb::new().await;
    let url = amqp_url();
    let consumer = consumer_name();
    let queue = format!("cli-{consumer}");
    db.exec("INSERT INTO blocked VALUES ('acct-bad')").await;
    let running = Running::start_amqp(&db, &url, &consumer, &queue).await;
    amqp_publish(&url, &queue, "m-1", &deposit("acct-bad", 3)).await;
    db.wait_for("SELECT count(*) FROM txinbox.dead_letters", 1, WAIT)
        .await;
    let id = db.scalar("SELECT id FROM txinbox.dead_letters").await.to_string();
    db.exec("DELETE FROM blocked").await;

    let requeue = |id: String| {
        let (db_url, url) = (db.url.clone(), url.clone());
        async move {
            let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_txinbox"));
            cmd.args(["--json", "dead-letters", "requeue", &id])
                .env("DATABASE_URL", &db_url)
                .env("AMQP_URL", &url)
                .env_remove("KAFKA_BROKERS");
            let out = cmd.output().await.unwrap();
            assert!(out.status.success(), "{out:?}");
            serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
        }
    };
    let first = requeue(id.clone()).await;
    db.wait_for("SELECT count(*) FROM effects WHERE message_id = 'm-1'", 1, WAIT)
        .await;
    assert_eq!(first["results"][0]["inbox_reopened"], true, "{first:#}");
    let second = requeue(id.clone()).await;
    db.wait_for(
        "SELECT duplicates FROM txinbox.inbox WHERE message_id = 'm-1'",
        1,
        WAIT,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.stop().await;
    amqp_delete(&url, &queue).await;
    assert_eq!(
        second["results"][0]["inbox_status_before"], "processed",
        "{second:#}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects WHERE message_id = 'm-1'")
            .await,
        1
    );
    assert_eq!(
        db.scalar("SELECT balance FROM accounts WHERE id = 'acct-bad'")
            .await,
        3
    );

    // Unreachable RabbitMQ: exit 3, named without the password.
    let down = tokio::process::Command::new(env!("CARGO_BIN_EXE_txinbox"))
        .args(["dead-letters", "requeue", &id])
        .env("DATABASE_URL", &db.url)
        .env("AMQP_URL", "amqp://guest:sekret@127.0.0.1:1/%2f")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&down.stderr);
    assert_eq!(down.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("RabbitMQ at 127.0.0.1:1/%2f") && !stderr.contains("sekret"),
        "{stderr}"
    );
}

/// A RabbitMQ dead letter requeued over `amqps://` to the TLS-only node, trusting the test CA
/// with `--amqp-ca-file`: the copy arrives with its `message_id`. With a CA that did not sign
/// the broker's certificate the requeue is refused (exit 3) saying what to give, and the dead
/// letter stays pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_dead_letter_requeue_over_tls_verifies_the_broker() {
    use txinbox_amqp::lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
    let db = TestDb::new().await;
    let queue = format!("cli-tls-{}", consumer_name());
    let tls = txinbox_amqp::AmqpTls::new().ca_file(tls_file("ca.pem"));
    let conn = tls
        .connect(&amqps_url(), txinbox_amqp::lapin::ConnectionProperties::default())
        .await
        .expect("connect to the TLS node (scripts/test starts it)");
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            Default::default(),
        )
        .await
        .unwrap();
    db.exec(&format!(
        "INSERT INTO txinbox.dead_letters (consumer, message_id, id_strategy, fingerprint, reason, error,
                                           attempts, payload, headers, source_system, destination)
         VALUES ('c', 'tls-1', 'native', sha256('{{}}'::bytea), 'permanent_error', 'x', 1,
                 '{{}}', '[]', 'rabbitmq', '{queue}')"
    ))
    .await;
    let id = db
        .scalar("SELECT max(id) FROM txinbox.dead_letters")
        .await
        .to_string();
    let requeue = |ca: &str| {
        let (db_url, ca) = (db.url.clone(), tls_file(ca));
        let id = id.clone();
        async move {
            tokio::process::Command::new(env!("CARGO_BIN_EXE_txinbox"))
                .args(["dead-letters", "requeue", &id, "--amqp-ca-file", &ca])
                .env("DATABASE_URL", &db_url)
                .env("AMQP_URL", amqps_url())
                .env_remove("KAFKA_BROKERS")
                .output()
                .await
                .unwrap()
        }
    };

    let refused = requeue("other-ca.pem").await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("not signed by a CA this client trusts") && stderr.contains("--amqp-ca-file"),
        "{stderr}"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox.dead_letters WHERE requeued_at IS NULL")
            .await,
        1,
        "still pending"
    );

    let done = requeue("ca.pem").await;
    assert!(done.status.success(), "{done:?}");
    let copy = channel
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the requeued copy is in the queue");
    assert_eq!(
        copy.delivery.properties.message_id().as_ref().map(|s| s.as_str()),
        Some("tls-1")
    );
    let _ = channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "done".into()).await;
}

/// Replay to a time: the start is the first record at or after it (Kafka `offsets_for_times`).
/// (Runs on tansu, which answers timestamp lookups; real Kafka semantics are the same API.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_to_a_timestamp_starts_at_the_first_record_after_it() {
    let Some(brokers) = brokers() else { return };
    let db = TestDb::new().await;
    let topic = create_topic(&brokers, 1).await;
    let consumer = consumer_name();
    let producer = Producer::new(&brokers);
    producer.deposits(&topic, 0, "a", 5).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let between = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        .to_string();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    producer.deposits(&topic, 0, "b", 5).await;
    record_subscription(&db, &consumer, &topic, &consumer).await;
    let dry = txinbox(
        &db.url,
        Some(&brokers),
        &[
            "--json",
            "replay",
            "--consumer",
            &consumer,
            "--topic",
            &topic,
            "--to-timestamp",
            &between,
            "--dry-run",
        ],
    )
    .await
    .ok();
    assert_eq!(dry["partitions"][0]["start"], 5, "{dry:#}");
    assert_eq!(dry["new"], 5, "{dry:#}");

    // A consumer that resumes at offset 2 would skip 2..5: refused unless --force.
    db.exec(&format!(
        "INSERT INTO txinbox.positions (consumer, source, lane, next_position) VALUES ('{consumer}', '{topic}', '0', 2)"
    ))
    .await;
    let args = [
        "--json",
        "replay",
        "--consumer",
        &consumer,
        "--topic",
        &topic,
        "--to-timestamp",
        &between,
    ];
    let forced = refused_unless_forced(&db, &brokers, &args, "offsets 2..5", &consumer, &topic).await;
    assert_eq!(forced["database_positions_set"], true, "{forced:#}");
    assert!(
        forced["forced"][0].as_str().unwrap().contains("offsets 2..5"),
        "what --force overrode is reported: {forced:#}"
    );
    assert_eq!(db.position(&consumer, &topic, 0).await, Some(5));
}

/// A dead letter whose copy the broker confirmed moves the stored position past it (since
/// 9678acb), so a restart does not read it again; purging its row (it is before the position)
/// then lets nothing through: the cause fixed meanwhile, the record is still not handled (only
/// a requeue may apply it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purge_after_a_confirmed_dead_letter_lets_no_restart_handle_it() {
    let Some(brokers) = brokers() else { return };
    let db = TestDb::new().await;
    let topic = create_topic(&brokers, 1).await;
    let consumer = consumer_name();
    db.exec("INSERT INTO blocked VALUES ('acct-bad')").await;
    let producer = Producer::new(&brokers);
    producer.send(&topic, 0, "k-1", &deposit("acct-ok", 5)).await;
    producer.send(&topic, 0, "k-2", &deposit("acct-bad", 7)).await;
    let running = Running::start(&db, &brokers, &consumer, &topic);
    db.wait_for("SELECT count(*) FROM txinbox.dead_letters", 1, WAIT)
        .await;
    // The position moves past the dead letter at offset 1 once its copy is confirmed.
    db.wait_for(
        &format!(
            "SELECT coalesce(max(next_position), 0) FROM txinbox.positions WHERE consumer = '{consumer}'"
        ),
        2,
        WAIT,
    )
    .await;
    running.stop().await;
    assert_eq!(db.position(&consumer, &topic, 0).await, Some(2));

    let purged = txinbox(
        &db.url,
        None,
        &[
            "--json",
            "purge",
            "--consumer",
            &consumer,
            "--older-than",
            "0s",
            "--force",
            "--yes",
        ],
    )
    .await
    .ok();

    db.exec("DELETE FROM blocked").await;
    producer.send(&topic, 0, "k-3", &deposit("acct-ok", 1)).await;
    let running = Running::start(&db, &brokers, &consumer, &topic);
    db.wait_for(
        &format!("SELECT next_position FROM txinbox.positions WHERE consumer = '{consumer}'"),
        3,
        WAIT,
    )
    .await;
    running.stop().await;
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects WHERE message_id = 'k-2'")
            .await,
        0,
        "the dead-lettered record is not read again, so not handled"
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects WHERE message_id = 'k-3'")
            .await,
        1
    );
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox.dead_letters").await, 1);
    assert_eq!(
        purged["consumers"][0]["deleted"], 2,
        "k-1's and k-2's rows: {purged:#}"
    );
}

/// Purge keeps rows of records at or after the stored position (here: after a replay moved it
/// back), so the replayed records stay duplicates; rows before it, and rows without a
/// partition, go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_keeps_rows_at_or_after_the_stored_position() {
    let db = TestDb::new().await;
    let consumer = consumer_name();
    db.exec(&format!(
        "INSERT INTO txinbox.inbox (consumer, message_id, id_strategy, fingerprint, status, attempts,
                                    first_seen_at, processed_at, source_system, destination,
                                    source_partition, source_offset)
         SELECT '{consumer}', 'm-' || i, 'cloudevents', sha256(i::text::bytea), 'processed', 1,
                now() - interval '30 days', now() - interval '30 days', 'kafka', 't',
                CASE WHEN i < 100 THEN 0 END, i % 100
         FROM generate_series(0, 109) i;
         INSERT INTO txinbox.positions (consumer, source, lane, next_position)
         VALUES ('{consumer}', 't', '0', 60), ('{consumer}', 'other', '0', 0);"
    ))
    .await;
    let dry = txinbox(
        &db.url,
        None,
        &["--json", "purge", "--consumer", &consumer, "--dry-run"],
    )
    .await
    .ok();
    assert_eq!(dry["consumers"][0]["candidates"], 70, "{dry:#}");
    let purged = txinbox(
        &db.url,
        None,
        &[
            "--json",
            "purge",
            "--consumer",
            &consumer,
            "--batch-size",
            "7",
            "--yes",
        ],
    )
    .await
    .ok();
    assert_eq!(purged["consumers"][0]["deleted"], 70, "{purged:#}");
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) FROM txinbox.inbox WHERE consumer = '{consumer}' AND source_offset >= 60 AND source_partition = 0"
        ))
        .await,
        40,
        "offsets 60..99 of partition 0 are read again from position 60"
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) FROM txinbox.inbox WHERE consumer = '{consumer}'"
        ))
        .await,
        40
    );
}

/// A replay writes its positions only if the retention horizon is still the one it checked
/// the range against: a purge that moved it in between makes the replay change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_positions_are_not_set_when_a_purge_moved_the_horizon_meanwhile() {
    use txinbox::ops::{replay, retention, Timestamp};
    let db = TestDb::new().await;
    let consumer = consumer_name();
    let lanes = [("0".to_owned(), 0)];
    // The replay checked its range: no horizon yet. Then a purge records one.
    retention::record_horizon(&db.pool, &consumer, Timestamp(1_000))
        .await
        .unwrap();
    assert!(!replay::set_positions(&db.pool, &consumer, "t", &lanes, None)
        .await
        .unwrap());
    assert_eq!(db.position(&consumer, "t", 0).await, None, "nothing set");
    // Checked against the current horizon: set.
    let h = retention::horizon(&db.pool, &consumer).await.unwrap();
    assert_eq!(h, Some(Timestamp(1_000)));
    assert!(replay::set_positions(&db.pool, &consumer, "t", &lanes, h)
        .await
        .unwrap());
    assert_eq!(db.position(&consumer, "t", 0).await, Some(0));
}

/// `txinbox migrate` and `status` over TLS (issue 27) against a private PostgreSQL that refuses
/// plaintext (`hostssl` only), with `sslmode=verify-full` and the server's CA; and each refusal
/// with the error an operator sees: an unknown CA (set sslrootcert), a certificate for another
/// host (naming it), plaintext to the TLS-only server (add sslmode), a certificate file that is
/// not there (naming it). A refusal is a configuration error: exit 1 ("retrying does not help"),
/// not 3 ("cannot reach").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_runs_over_tls_and_a_refused_connection_says_what_to_change() {
    use txinbox_testing::cluster::PrivateCluster;
    use txinbox_testing::tls::TestCa;

    let ca = TestCa::new("cli test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let url = cluster.url("postgres");
    txinbox(&url, None, &["--json", "migrate"]).await.ok();
    let status = txinbox(&url, None, &["--json", "status"]).await.ok();
    assert!(status.is_object(), "{status:#}");

    let other = TestCa::new("some other CA");
    let port = cluster.port();
    let root = ca.cert_path().display().to_string();
    let missing = ca.dir().join("missing.pem").display().to_string();
    for (url, says, code) in [
        (
            format!(
                "postgres://postgres@127.0.0.1:{port}/postgres?sslmode=verify-full&sslrootcert={}",
                other.cert_path().display()
            ),
            "unknown CA",
            1,
        ),
        (
            format!("postgres://postgres@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={root}"),
            "not valid for host localhost",
            1,
        ),
        (
            format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode=disable"),
            "accepts TLS connections only",
            1,
        ),
        (
            format!(
                "postgres://postgres@127.0.0.1:{port}/postgres?sslmode=verify-full&sslrootcert={missing}"
            ),
            "sslrootcert",
            2,
        ),
    ] {
        let run = txinbox(&url, None, &["--json", "status"]).await;
        assert_eq!(run.code, code, "{url}: {run:?}");
        assert!(run.stderr.contains(says), "{url}: {run:?}");
        assert_eq!(run.json()["exit_code"], code, "{url}");
    }
}

/// sqlx (rustls with ring, chosen by sqlx itself) and lapin (rustls with ring, installed as the
/// process's default provider by its connector) in one process: neither panics for want of a
/// provider ("no process-level CryptoProvider available") or for two of them, in either
/// order: a TLS session to PostgreSQL, lapin setting up `amqps://` (to a listener that hangs up:
/// its TLS configuration is built before the handshake fails), and PostgreSQL again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_and_lapin_share_the_process_without_a_crypto_provider_panic() {
    use txinbox::sqlx::{ConnectOptions as _, Connection as _};
    use txinbox_testing::cluster::PrivateCluster;
    use txinbox_testing::tls::TestCa;

    let ca = TestCa::new("provider test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let encrypted = || async {
        let mut conn = cluster.options().connect().await.expect("PostgreSQL over TLS");
        let ssl: bool =
            txinbox::sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        conn.close().await.unwrap();
        ssl
    };
    assert!(encrypted().await);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hang_up = tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            drop(socket);
        }
    });
    let amqps = tokio::spawn(async move {
        lapin::Connection::connect(
            &format!("amqps://guest:guest@127.0.0.1:{port}/%2f"),
            lapin::ConnectionProperties::default(),
        )
        .await
        .map(|_| ())
    });
    let outcome = tokio::time::timeout(std::time::Duration::from_secs(30), amqps)
        .await
        .expect("lapin gives up on a listener that hangs up");
    let refused = outcome.expect("lapin's amqps:// set-up does not panic");
    assert!(refused.is_err(), "nothing speaks AMQP there");
    hang_up.abort();

    assert!(encrypted().await, "sqlx's TLS still works after lapin's");
}
