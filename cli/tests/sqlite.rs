//! The `txinbox` binary on the embedded SQLite store (`--database-url sqlite:path`), against a
//! real SQLite file, next to the same data in a real PostgreSQL database (`DATABASE_URL`): the
//! same commands give the same JSON and the same exit codes on both. The requeue, replay and
//! positions tests also need a Kafka-protocol broker (`KAFKA_BROKERS`); without it, it says so and passes, except
//! under `CI`.

mod support;

use serde_json::Value;
use support::*;

/// One of the two stores, with what differs in the SQL that seeds it.
#[derive(Clone, Copy)]
enum Side<'a> {
    Pg(&'a TestDb),
    Lite(&'a SqliteDb),
}

impl Side<'_> {
    fn url(self) -> &'static str {
        match self {
            Side::Pg(db) => Box::leak(db.url.clone().into_boxed_str()),
            Side::Lite(db) => Box::leak(db.url.clone().into_boxed_str()),
        }
    }

    fn t(self, name: &str) -> String {
        match self {
            Side::Pg(_) => format!("txinbox.{name}"),
            Side::Lite(_) => format!("txinbox_{name}"),
        }
    }

    /// The time `days` days ago, as the time columns store it.
    fn ago(self, days: i64) -> String {
        match self {
            Side::Pg(_) => format!("now() - interval '{days} days'"),
            Side::Lite(_) => format!("CAST(unixepoch('subsec') * 1000 AS INTEGER) - {days} * 86400000"),
        }
    }

    /// 32 bytes, each `byte` (two hex digits).
    fn bytes32(self, byte: &str) -> String {
        let hex = byte.repeat(32);
        match self {
            Side::Pg(_) => format!("decode('{hex}', 'hex')"),
            Side::Lite(_) => format!("X'{hex}'"),
        }
    }

    fn blob(self, text: &str) -> String {
        match self {
            Side::Pg(_) => format!("convert_to('{text}', 'UTF8')"),
            Side::Lite(_) => format!("CAST('{text}' AS BLOB)"),
        }
    }

    async fn exec(self, sql: &str) {
        match self {
            Side::Pg(db) => db.exec(sql).await,
            Side::Lite(db) => db.exec(sql).await,
        }
    }

    async fn scalar(self, sql: &str) -> i64 {
        match self {
            Side::Pg(db) => db.scalar(sql).await,
            Side::Lite(db) => db.scalar(sql).await,
        }
    }

    async fn run(self, brokers: Option<&str>, args: &[&str]) -> Run {
        txinbox(self.url(), brokers, args).await
    }
}

const CONSUMER: &str = "svc";

/// The same rows in either store: consumer `svc` reading `topic` partition 0 (stored position
/// 100, group `grp` recorded), three processed inbox rows 10 days old (purgeable), a fresh
/// processed one, an old `retrying` one (never purged), a dead-lettered one; six dead letters:
/// 1 requeueable, 2 a conflict, 3 truncated, 4 discarded, 5 without an ID, 6 with an
/// offset-derived ID.
async fn seed(db: Side<'_>, topic: &str) {
    let (inbox, dead) = (db.t("inbox"), db.t("dead_letters"));
    let rows = [
        ("old-1", "processed", 10, 1),
        ("old-2", "processed", 10, 2),
        ("old-3", "processed", 10, 3),
        ("fresh", "processed", 0, 4),
        ("stuck", "retrying", 10, 6),
        ("m-dead", "dead_lettered", 0, 5),
    ];
    for (id, status, days, offset) in rows {
        let at = db.ago(days);
        let done = if status == "retrying" {
            "NULL".to_owned()
        } else {
            at.clone()
        };
        db.exec(&format!(
            "INSERT INTO {inbox} (consumer, message_id, id_strategy, fingerprint, status, attempts,
                                  first_seen_at, processed_at, source_system, destination,
                                  source_partition, source_offset)
             VALUES ('{CONSUMER}', '{id}', 'cloudevents', {fp}, '{status}', 1, {at}, {done},
                     'kafka', '{topic}', 0, {offset})",
            fp = db.bytes32("07"),
        ))
        .await;
    }
    db.exec(&format!(
        "INSERT INTO {} (consumer, source, lane, next_position) VALUES ('{CONSUMER}', '{topic}', '0', 100)",
        db.t("positions")
    ))
    .await;
    db.exec(&format!(
        "INSERT INTO {} (consumer, source_system, source, subscription) VALUES ('{CONSUMER}', 'kafka', '{topic}', 'grp')",
        db.t("subscriptions")
    ))
    .await;
    let payload = r#"{"account":"a","amount":1}"#;
    let letters = [
        (
            "'m-dead'",
            "'cloudevents'",
            "07",
            "permanent_error",
            5,
            "false",
            "NULL",
            "NULL",
        ),
        (
            "'m-conf'",
            "'cloudevents'",
            "08",
            "conflict",
            7,
            "false",
            "NULL",
            "NULL",
        ),
        (
            "'m-cut'",
            "'cloudevents'",
            "09",
            "permanent_error",
            8,
            "true",
            "NULL",
            "NULL",
        ),
        (
            "'m-disc'",
            "'cloudevents'",
            "0a",
            "permanent_error",
            9,
            "false",
            "now",
            "'known bad'",
        ),
        ("NULL", "NULL", "0b", "missing_id", 10, "false", "NULL", "NULL"),
        (
            "'kafka:t/0@11'",
            "'offset'",
            "0c",
            "permanent_error",
            11,
            "false",
            "NULL",
            "NULL",
        ),
    ];
    for (id, strategy, fp, reason, offset, truncated, discarded, why) in letters {
        let discarded = if discarded == "now" {
            db.ago(0)
        } else {
            discarded.to_owned()
        };
        db.exec(&format!(
            "INSERT INTO {dead} (consumer, message_id, id_strategy, fingerprint, reason, error, attempts,
                                 payload, headers, source_system, destination, source_partition,
                                 source_offset, payload_size, truncated, discarded_at, discard_reason)
             VALUES ('{CONSUMER}', {id}, {strategy}, {fp}, '{reason}', 'account a is blocked', 3,
                     {payload}, '[{{\"name\": \"ce_id\", \"value\": \"x\"}}]', 'kafka', '{topic}', 0,
                     {offset}, {size}, {truncated}, {discarded}, {why})",
            fp = db.bytes32(fp),
            payload = db.blob(payload),
            size = payload.len(),
        ))
        .await;
    }
}

/// `v` with every time (an RFC 3339 string) replaced by `<time>`: the two stores' clocks differ.
fn timeless(v: &Value) -> Value {
    match v {
        Value::String(s) if s.parse::<txinbox::ops::Timestamp>().is_ok() && s.contains('T') => {
            Value::String("<time>".into())
        }
        Value::Array(a) => Value::Array(a.iter().map(timeless).collect()),
        Value::Object(o) => Value::Object(o.iter().map(|(k, v)| (k.clone(), timeless(v))).collect()),
        other => other.clone(),
    }
}

/// Runs `args` on both stores: the same exit code and the same JSON (times aside). Returns the
/// SQLite run.
async fn same_on_both(pg: Side<'_>, lite: Side<'_>, args: &[&str]) -> Run {
    let mut with_json = vec!["--json"];
    with_json.extend_from_slice(args);
    let a = pg.run(None, &with_json).await;
    let b = lite.run(None, &with_json).await;
    assert_eq!(a.code, b.code, "exit codes of {args:?}\npg: {a:?}\nsqlite: {b:?}");
    assert_eq!(
        timeless(&a.json()),
        timeless(&b.json()),
        "JSON of {args:?}\npg: {a:?}\nsqlite: {b:?}"
    );
    b
}

async fn both() -> (TestDb, SqliteDb) {
    let (pg, lite) = (TestDb::new().await, SqliteDb::new().await);
    seed(Side::Pg(&pg), "orders").await;
    seed(Side::Lite(&lite), "orders").await;
    (pg, lite)
}

#[tokio::test(flavor = "multi_thread")]
async fn status_is_the_same_on_sqlite_as_on_postgres() {
    let (pg, lite) = both().await;
    let (pg, lite) = (Side::Pg(&pg), Side::Lite(&lite));
    let run = same_on_both(pg, lite, &["status"]).await;
    let c = &run.ok()["consumers"][0];
    assert_eq!(c["consumer"], CONSUMER);
    assert_eq!(c["processed"], 4);
    assert_eq!(c["retrying"], 1);
    assert_eq!(c["dead_lettered_rows"], 1);
    assert_eq!(c["dead_letters"], 6);
    assert_eq!(c["dead_letters_pending"], 5);
    assert_eq!(c["conflicts"], 1);
    assert_eq!(c["retention_horizon"], Value::Null);
    assert_eq!(c["partitions"][0]["database_position"], 100);
    same_on_both(pg, lite, &["status", "--consumer", CONSUMER]).await;
    let unknown = same_on_both(pg, lite, &["status", "--consumer", "nobody"]).await;
    assert_eq!(unknown.code, 1);

    // Text output too.
    let text = lite.run(None, &["status"]).await;
    assert_eq!(text.code, 0, "{text:?}");
    assert!(text.stdout.contains("consumer svc"), "{}", text.stdout);
    assert!(
        text.stdout.contains("dead letters 6 (5 pending)"),
        "{}",
        text.stdout
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn purge_on_sqlite_plans_guards_the_window_and_deletes_like_postgres() {
    let (pg, lite) = both().await;
    let (pg, lite) = (Side::Pg(&pg), Side::Lite(&lite));
    let scope = ["purge", "--consumer", CONSUMER];

    let plan = same_on_both(pg, lite, &[&scope[..], &["--dry-run"]].concat()).await;
    assert_eq!(plan.ok()["consumers"][0]["candidates"], 3);

    // Inside the dedup window: refused without --force.
    let inside = same_on_both(pg, lite, &[&scope[..], &["--older-than", "1d", "--yes"]].concat()).await;
    assert_eq!(inside.code, 1);
    assert!(inside.stderr.contains("inside the dedup window"), "{inside:?}");

    // No terminal and no --yes: refused, nothing deleted.
    let unconfirmed = same_on_both(pg, lite, &scope).await;
    assert_eq!(unconfirmed.code, 1);
    assert!(unconfirmed.stderr.contains("pass --yes"), "{unconfirmed:?}");
    assert_eq!(lite.scalar("SELECT count(*) FROM txinbox_inbox").await, 6);

    let done = same_on_both(pg, lite, &[&scope[..], &["--yes"]].concat()).await;
    assert_eq!(done.ok()["consumers"][0]["deleted"], 3);
    assert_eq!(
        lite.scalar("SELECT count(*) FROM txinbox_inbox").await,
        3,
        "the fresh, the retrying and the dead-lettered rows stay"
    );
    assert_eq!(
        lite.scalar("SELECT count(*) FROM txinbox_inbox WHERE message_id = 'stuck'")
            .await,
        1,
        "retrying rows are never purged"
    );
    assert_eq!(lite.scalar("SELECT rows_purged FROM txinbox_retention").await, 3);
    let status = same_on_both(pg, lite, &["status"]).await;
    assert_ne!(status.ok()["consumers"][0]["retention_horizon"], Value::Null);

    // A row at or after the stored position is kept even when old: a restart reads it again.
    lite.exec("UPDATE txinbox_positions SET next_position = 4").await;
    lite.exec(&format!(
        "UPDATE txinbox_inbox SET processed_at = {} WHERE message_id IN ('fresh', 'm-dead')",
        lite.ago(30)
    ))
    .await;
    let again = lite
        .run(None, &["--json", "purge", "--consumer", CONSUMER, "--yes"])
        .await;
    assert_eq!(again.ok()["consumers"][0]["deleted"], 0, "{again:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_on_sqlite_list_show_discard_and_refuse_like_postgres() {
    let (pg, lite) = both().await;
    let (pg, lite) = (Side::Pg(&pg), Side::Lite(&lite));

    let all = same_on_both(pg, lite, &["dead-letters", "list"]).await;
    assert_eq!(all.ok()["dead_letters"].as_array().unwrap().len(), 6);
    let pending = same_on_both(pg, lite, &["dead-letters", "list", "--state", "pending"]).await;
    assert_eq!(pending.ok()["dead_letters"].as_array().unwrap().len(), 5);
    same_on_both(pg, lite, &["dead-letters", "list", "--reason", "conflict"]).await;
    same_on_both(
        pg,
        lite,
        &["dead-letters", "list", "--consumer", CONSUMER, "--limit", "2"],
    )
    .await;
    same_on_both(
        pg,
        lite,
        &["dead-letters", "list", "--since", "2000-01-01T00:00:00Z"],
    )
    .await;
    same_on_both(pg, lite, &["dead-letters", "show", "1"]).await;
    let missing = same_on_both(pg, lite, &["dead-letters", "show", "99"]).await;
    assert_eq!(missing.code, 1);

    // Every requeue refusal, before any broker is needed: conflict, truncated, discarded,
    // no ID, an offset-derived ID. Exit 1, nothing changed.
    let refused = same_on_both(pg, lite, &["dead-letters", "requeue", "2", "3", "4", "5", "6"]).await;
    assert_eq!(refused.code, 1);
    let results = refused.json()["results"].as_array().unwrap().clone();
    assert!(results.iter().all(|r| r["requeued"] == false), "{results:?}");
    for (r, why) in results.iter().zip([
        "conflict",
        "stored cut",
        "discarded",
        "no message ID",
        "strategy `offset`",
    ]) {
        assert!(r["error"].as_str().unwrap().contains(why), "{r} should say {why}");
    }
    assert_eq!(
        lite.scalar("SELECT count(*) FROM txinbox_dead_letters WHERE requeued_at IS NOT NULL")
            .await,
        0
    );
    // No brokers: the requeueable one stops at the missing service (exit 2), as on PostgreSQL.
    let no_kafka = same_on_both(pg, lite, &["dead-letters", "requeue", "1"]).await;
    assert_eq!(no_kafka.code, 2, "{no_kafka:?}");
    assert_eq!(
        lite.scalar("SELECT count(*) FROM txinbox_inbox WHERE status = 'dead_lettered'")
            .await,
        1,
        "the refused requeue rolled back"
    );

    let discarded = same_on_both(
        pg,
        lite,
        &["dead-letters", "discard", "1", "2", "--reason", "fixed by hand"],
    )
    .await;
    assert_eq!(discarded.code, 0, "{discarded:?}");
    assert_eq!(
        lite.scalar("SELECT count(*) FROM txinbox_dead_letters WHERE discard_reason = 'fixed by hand' AND discarded_at IS NOT NULL").await,
        2
    );
    // Discarding twice keeps the first reason.
    same_on_both(pg, lite, &["dead-letters", "discard", "4", "--reason", "again"]).await;
    assert_eq!(
        lite.scalar("SELECT count(*) FROM txinbox_dead_letters WHERE discard_reason = 'known bad'")
            .await,
        1
    );
    same_on_both(pg, lite, &["dead-letters", "list", "--state", "discarded"]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn requeue_on_sqlite_republishes_to_kafka_and_reopens_the_row() {
    let Some(brokers) = brokers() else { return };
    let topic = create_topic(&brokers, 1).await;
    let db = SqliteDb::new().await;
    let lite = Side::Lite(&db);
    seed(lite, &topic).await;

    let run = lite
        .run(Some(&brokers), &["--json", "dead-letters", "requeue", "1"])
        .await;
    let r = &run.ok()["results"][0];
    assert_eq!(r["requeued"], true, "{run:?}");
    assert_eq!(r["topic"], topic.as_str());
    assert_eq!(r["partition"], 0);
    assert_eq!(r["offset"], 0, "the copy is the topic's first record");
    assert_eq!(r["inbox_status_before"], "dead_lettered");
    assert_eq!(r["inbox_reopened"], true);
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox_inbox WHERE message_id = 'm-dead' AND status = 'retrying' AND attempts = 0")
            .await,
        1,
        "the inbox row is reopened, so the consumer processes the copy"
    );
    assert_eq!(
        db.scalar("SELECT requeue_count FROM txinbox_dead_letters WHERE id = 1 AND requeued_at IS NOT NULL")
            .await,
        1
    );
    // Requeued again: the row is not dead-lettered any more, so it is left alone.
    let again = lite
        .run(Some(&brokers), &["--json", "dead-letters", "requeue", "1"])
        .await;
    assert_eq!(again.ok()["results"][0]["inbox_reopened"], false, "{again:?}");
    assert_eq!(again.json()["results"][0]["offset"], 1);
    let listed = lite
        .run(None, &["--json", "dead-letters", "list", "--state", "requeued"])
        .await;
    assert_eq!(listed.ok()["dead_letters"][0]["id"], 1);
    let shown = lite.run(None, &["--json", "dead-letters", "show", "1"]).await;
    assert_eq!(shown.ok()["requeue_count"], 2, "{shown:?}");
    assert_eq!(shown.json()["state"], "requeued");
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_urls_migrate_and_http_purge_works() {
    let dir = std::env::temp_dir().join(format!("txinbox-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("new.db");
    let _ = std::fs::remove_file(&file);
    let url = format!("sqlite://{}", file.display());

    // A missing file is not created by a read: exit 3, as an unreachable database.
    let missing = txinbox(&url, None, &["status"]).await;
    assert_eq!(missing.code, 3, "{missing:?}");
    assert!(!file.exists());
    // An existing file without the txinbox tables: refused, and told to migrate.
    std::fs::File::create(&file).unwrap();
    let bare = txinbox(&url, None, &["--json", "dead-letters", "list"]).await;
    assert_eq!(bare.code, 1, "{bare:?}");
    assert!(bare.stderr.contains("run `txinbox migrate`"), "{bare:?}");
    assert_eq!(bare.json()["exit_code"], 1);
    let migrated = txinbox(&url, None, &["--json", "migrate"]).await;
    assert_eq!(migrated.ok()["migrated"], true);
    let empty = txinbox(&url, None, &["--json", "status"]).await;
    assert_eq!(empty.ok()["consumers"], serde_json::json!([]));
    let again = txinbox(&format!("sqlite:{}", file.display()), None, &["migrate"]).await;
    assert_eq!(again.code, 0, "migrate is idempotent: {again:?}");

    // http purge: only expired Idempotency-Key records go.
    let db = SqliteDb::new().await;
    db.exec(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 5)
         INSERT INTO txinbox_http_idempotency (principal, route, idempotency_key, fingerprint, status, body, body_size, expires_at)
         SELECT 'tenant-a', '/payments', 'k-' || i, zeroblob(32), 201, CAST('ok' AS BLOB), 2,
                CAST(unixepoch('subsec') * 1000 AS INTEGER) + CASE WHEN i <= 3 THEN -3600000 ELSE 86400000 END
         FROM n",
    )
    .await;
    let dry = txinbox(&db.url, None, &["--json", "http", "purge", "--dry-run"])
        .await
        .ok();
    assert_eq!(dry["expired"], 3, "{dry}");
    let unconfirmed = txinbox(&db.url, None, &["http", "purge"]).await;
    assert_eq!(unconfirmed.code, 1, "{unconfirmed:?}");
    let done = txinbox(&db.url, None, &["--json", "http", "purge", "--yes"])
        .await
        .ok();
    assert_eq!(done["deleted"], 3, "{done}");
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox_http_idempotency").await,
        2
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn completions_for_bash_zsh_and_fish() {
    for shell in ["bash", "zsh", "fish"] {
        let r = txinbox("postgres://unused", None, &["completions", shell]).await;
        assert_eq!(r.code, 0, "{shell}: {r:?}");
        for word in ["dead-letters", "purge", "database-url", "older-than"] {
            assert!(r.stdout.contains(word), "{shell} completions lack {word}");
        }
    }
    let bad = txinbox("postgres://unused", None, &["completions", "powershell"]).await;
    assert_eq!(bad.code, 2);
}

/// Counts each application in `effects` (a table of the SQLite test file), inside the inbox
/// transaction.
struct CountEffects;

#[txinbox::async_trait]
impl txinbox::Handler<txinbox::sqlx::Sqlite> for CountEffects {
    async fn handle(
        &self,
        cx: &mut txinbox::Context<'_, txinbox::sqlx::Sqlite>,
        _msg: &txinbox::Message,
    ) -> Result<(), txinbox::HandlerError> {
        let id = cx.message_id().as_str().to_owned();
        txinbox::sqlx::query("INSERT INTO effects (message_id) VALUES ($1)")
            .bind(id)
            .execute(cx.db())
            .await?;
        Ok(())
    }
}

/// A txinbox consumer on the Kafka adapter with the SQLite inbox, until `stop` is sent.
fn run_sqlite_consumer(
    db: &SqliteDb,
    brokers: &str,
    topic: &str,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), txinbox::Error>>,
) {
    let config = txinbox_kafka::KafkaConfig::new(brokers, CONSUMER)
        .topic(topic)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("auto.offset.reset", "earliest")
        .revoke_timeout(std::time::Duration::from_secs(5))
        .close_timeout(std::time::Duration::from_secs(15));
    let inbox = txinbox::SqliteInbox::new(db.pool.clone());
    let source = txinbox_kafka::KafkaSource::new(config).expect("kafka source");
    let consumer = txinbox::Consumer::builder(CONSUMER)
        .source(source)
        .inbox(inbox)
        .handler(CountEffects)
        .concurrency(2)
        .build()
        .expect("consumer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run_until(async {
        let _ = stopped.await;
    }));
    (stop, task)
}

async fn wait_sqlite(db: &SqliteDb, sql: &str, n: i64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let got = db.scalar(sql).await;
        if got >= n {
            assert_eq!(got, n, "{sql}");
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{sql}: {got} of {n} within 60 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_on_sqlite_moves_the_stored_position_and_applies_nothing_twice() {
    let Some(brokers) = brokers() else { return };
    let topic = create_topic(&brokers, 1).await;
    let db = SqliteDb::new().await;
    db.exec("CREATE TABLE effects (message_id TEXT NOT NULL)").await;
    Producer::new(&brokers).deposits(&topic, 0, "r", 8).await;

    let (stop, task) = run_sqlite_consumer(&db, &brokers, &topic);
    wait_sqlite(&db, "SELECT count(*) FROM effects", 8).await;
    let _ = stop.send(());
    task.await.unwrap().expect("consumer ran");
    assert_eq!(
        db.scalar("SELECT next_position FROM txinbox_positions WHERE lane = '0'")
            .await,
        8
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox_subscriptions").await,
        1,
        "the Kafka source recorded its group in the SQLite file"
    );

    let args = [
        "--json",
        "replay",
        "--consumer",
        CONSUMER,
        "--topic",
        &topic,
        "--to-earliest",
    ];
    let dry = txinbox(&db.url, Some(&brokers), &[&args[..], &["--dry-run"]].concat()).await;
    let dry = dry.ok();
    assert_eq!(dry["applied"], 8, "{dry:#}");
    assert_eq!(dry["new"], 0, "{dry:#}");
    assert_eq!(
        db.scalar("SELECT next_position FROM txinbox_positions WHERE lane = '0'")
            .await,
        8,
        "a dry run changes nothing"
    );

    let done = txinbox(&db.url, Some(&brokers), &args).await.ok();
    assert_eq!(done["database_positions_set"], true, "{done:#}");
    assert_eq!(
        db.scalar("SELECT next_position FROM txinbox_positions WHERE lane = '0'")
            .await,
        0
    );

    // The consumer re-reads all 8 from the database position: all duplicates, no new effect.
    let (stop, task) = run_sqlite_consumer(&db, &brokers, &topic);
    wait_sqlite(&db, "SELECT coalesce(sum(duplicates), 0) FROM txinbox_inbox", 8).await;
    let _ = stop.send(());
    task.await.unwrap().expect("consumer ran");
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects").await,
        8,
        "nothing applied twice"
    );

    // After a purge up to now, replay refuses a range before the horizon, as on PostgreSQL.
    let purged = txinbox(
        &db.url,
        None,
        &[
            "--json",
            "purge",
            "--consumer",
            CONSUMER,
            "--older-than",
            "0s",
            "--force",
            "--yes",
        ],
    )
    .await;
    assert_eq!(purged.ok()["consumers"][0]["deleted"], 8, "{purged:?}");
    let refused = txinbox(&db.url, Some(&brokers), &args).await;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stderr.contains("horizon"), "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn positions_on_sqlite_show_adopt_set_and_rebind() {
    let Some(brokers) = brokers() else { return };
    let topic = create_topic(&brokers, 2).await;
    let db = SqliteDb::new().await;
    let producer = Producer::new(&brokers);
    producer.deposits(&topic, 0, "a", 5).await;
    producer.deposits(&topic, 1, "b", 3).await;
    // A restored database: the group has committed offsets, the file has no positions.
    commit_group(&brokers, "grp", &topic, &[(0, 4), (1, 3)]);
    db.exec(&format!(
        "INSERT INTO txinbox_subscriptions (consumer, source_system, source, subscription)
         VALUES ('{CONSUMER}', 'kafka', '{topic}', 'grp')"
    ))
    .await;
    let run = |args: Vec<&str>| {
        let (url, brokers) = (db.url.clone(), brokers.clone());
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            txinbox(&url, Some(&brokers), &args).await
        }
    };
    let target = ["--consumer", CONSUMER, "--topic", topic.as_str()];

    let shown = run([&["--json", "positions", "show"][..], &target[..]].concat())
        .await
        .ok();
    let statuses: Vec<&str> = shown["partitions"]
        .as_array()
        .unwrap_or_else(|| panic!("{shown:#}"))
        .iter()
        .map(|p| p["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["missing-in-db", "missing-in-db"], "{shown:#}");

    // Without --yes and no terminal: refused, nothing written.
    let unconfirmed = run([&["positions", "adopt"][..], &target[..]].concat()).await;
    assert_eq!(unconfirmed.code, 1, "{unconfirmed:?}");
    assert_eq!(db.scalar("SELECT count(*) FROM txinbox_positions").await, 0);
    let adopted = run([&["--json", "positions", "adopt", "--yes"][..], &target[..]].concat()).await;
    adopted.ok();
    assert_eq!(
        db.scalar("SELECT next_position FROM txinbox_positions WHERE lane = '0'")
            .await,
        4
    );
    assert_eq!(
        db.scalar("SELECT next_position FROM txinbox_positions WHERE lane = '1'")
            .await,
        3
    );

    let set = run([
        &[
            "--json",
            "positions",
            "set",
            "--offset",
            "2",
            "--partition",
            "0",
            "--yes",
            "--force",
        ][..],
        &target[..],
    ]
    .concat())
    .await;
    set.ok();
    assert_eq!(
        db.scalar("SELECT next_position FROM txinbox_positions WHERE lane = '0'")
            .await,
        2
    );

    let rebound = run([
        &["--json", "positions", "rebind", "--group", "grp2", "--yes"][..],
        &target[..],
    ]
    .concat())
    .await;
    assert_eq!(rebound.ok()["previous_group"], "grp");
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox_subscriptions WHERE subscription = 'grp2'")
            .await,
        1
    );
}

/// As on PostgreSQL (`positions.rs`): `positions adopt` does not move a stored position back
/// past the retention horizon unless forced, with the check `positions set` makes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adopt_on_sqlite_is_refused_past_the_retention_horizon_like_set() {
    let Some(brokers) = brokers() else { return };
    let topic = create_topic(&brokers, 1).await;
    let group = format!("{topic}-grp");
    let db = SqliteDb::new().await;
    let lite = Side::Lite(&db);
    Producer::new(&brokers).deposits(&topic, 0, "h", 5).await;
    commit_group(&brokers, &group, &topic, &[(0, 3)]);
    db.exec(&format!(
        "INSERT INTO txinbox_subscriptions (consumer, source_system, source, subscription)
         VALUES ('{CONSUMER}', 'kafka', '{topic}', '{group}')"
    ))
    .await;
    db.exec(&format!(
        "INSERT INTO txinbox_positions (consumer, source, lane, next_position) VALUES ('{CONSUMER}', '{topic}', '0', 5)"
    ))
    .await;
    for i in 0..3 {
        db.exec(&format!(
            "INSERT INTO txinbox_inbox (consumer, message_id, id_strategy, fingerprint, status, attempts,
                                        first_seen_at, processed_at, source_system, destination)
             VALUES ('{CONSUMER}', 'old-{i}', 'cloudevents', {fp}, 'processed', 1, {at}, {at}, 'kafka', 't')",
            fp = lite.bytes32("07"),
            at = lite.ago(10),
        ))
        .await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let purged = lite
        .run(
            None,
            &[
                "--json",
                "purge",
                "--consumer",
                CONSUMER,
                "--older-than",
                "0s",
                "--force",
                "--yes",
            ],
        )
        .await;
    assert_eq!(purged.ok()["consumers"][0]["deleted"], 3, "{purged:?}");
    let position = || db.scalar("SELECT next_position FROM txinbox_positions WHERE lane = '0'");
    let target = ["--consumer", CONSUMER, "--topic", topic.as_str()];
    let run = |args: &'static [&'static str]| {
        let all: Vec<String> = args.iter().chain(&target).map(|a| a.to_string()).collect();
        let brokers = brokers.clone();
        async move {
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            lite.run(Some(&brokers), &all).await
        }
    };

    let forced = run(&["positions", "adopt", "--force", "--yes"]).await;
    assert_eq!(position().await, 5, "not moved back past the horizon: {forced:?}");
    let overwrite = run(&["positions", "adopt", "--overwrite", "--yes"]).await;
    assert_eq!(overwrite.code, 1, "{overwrite:?}");
    assert!(overwrite.stderr.contains("retention horizon"), "{overwrite:?}");
    let set = run(&["positions", "set", "--offset", "3", "--partition", "0", "--yes"]).await;
    assert_eq!(set.code, 1, "{set:?}");
    assert!(set.stderr.contains("retention horizon"), "{set:?}");
    assert_eq!(position().await, 5, "a refusal writes nothing");
}
