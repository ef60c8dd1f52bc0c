//! `txinbox positions` (issue 15, defect 2): after a database restore a partition with a
//! committed group offset but no stored position is refused by the Kafka source; these commands
//! show that, adopt the group's offsets, set positions to the earliest retained offset, and
//! record a new group. Against real PostgreSQL and a Kafka-protocol broker (tansu).

mod support;

use support::*;
use txinbox::ops::positions::{self, Applied, Change, PartitionView, PositionStatus};

/// A topic with two partitions of 5 records each; the consumer's group committed 5 on
/// partition 0 and 3 on partition 1; the database holds a position for partition 0 only
/// (`p0`), as after restoring a backup taken before partition 1 was first processed.
struct Restored {
    db: TestDb,
    brokers: String,
    topic: String,
    consumer: String,
    group: String,
}

async fn restored(p0: i64) -> Option<Restored> {
    let brokers = brokers()?;
    let db = TestDb::new().await;
    let topic = create_topic(&brokers, 2).await;
    let consumer = consumer_name();
    let group = format!("{consumer}-g");
    let producer = Producer::new(&brokers);
    producer.deposits(&topic, 0, "a", 5).await;
    producer.deposits(&topic, 1, "b", 5).await;
    commit_group(&brokers, &group, &topic, &[(0, 5), (1, 3)]);
    record_subscription(&db, &consumer, &topic, &group).await;
    store_position(&db, &consumer, &topic, 0, p0).await;
    Some(Restored {
        db,
        brokers,
        topic,
        consumer,
        group,
    })
}

impl Restored {
    async fn run(&self, args: &[&str]) -> Run {
        let common = [
            "--consumer",
            self.consumer.as_str(),
            "--topic",
            self.topic.as_str(),
        ];
        // `[--json] positions SUBCOMMAND` then the consumer and topic, then the rest.
        let (head, tail) = args.split_at(args.iter().position(|a| *a == "positions").unwrap() + 2);
        txinbox(
            &self.db.url,
            Some(&self.brokers),
            &[head, &common[..], tail].concat(),
        )
        .await
    }

    async fn position(&self, partition: i32) -> Option<i64> {
        self.db.position(&self.consumer, &self.topic, partition).await
    }

    /// Purges the consumer's inbox up to now (`--older-than 0s`): the retention horizon is now,
    /// after every record produced so far.
    async fn purge_up_to_now(&self) {
        old_rows(&self.db, &self.consumer, 3, 10).await;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let purged = txinbox(
            &self.db.url,
            None,
            &[
                "--json",
                "purge",
                "--consumer",
                &self.consumer,
                "--older-than",
                "0s",
                "--force",
                "--yes",
            ],
        )
        .await;
        assert_eq!(purged.ok()["consumers"][0]["deleted"], 3, "{purged:?}");
    }

    fn partition<'a>(&self, report: &'a serde_json::Value, p: i64) -> &'a serde_json::Value {
        report["partitions"]
            .as_array()
            .unwrap_or_else(|| panic!("no partitions: {report:#}"))
            .iter()
            .find(|x| x["partition"] == p)
            .unwrap_or_else(|| panic!("no partition {p}: {report:#}"))
    }
}

/// `positions show` reports, per partition, the database position, the group offset (of the
/// recorded group), the watermarks and a status: partition 1 is missing in the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn positions_show_reports_a_partition_missing_in_the_database() {
    let Some(r) = restored(5).await else { return };
    let show = r.run(&["--json", "positions", "show"]).await.ok();
    assert_eq!(show["group"], r.group.as_str(), "{show:#}");
    let p0 = r.partition(&show, 0);
    assert_eq!(
        (
            p0["database_position"].as_i64(),
            p0["group_offset"].as_i64(),
            p0["low_watermark"].as_i64(),
            p0["high_watermark"].as_i64(),
            p0["status"].as_str()
        ),
        (Some(5), Some(5), Some(0), Some(5), Some("ok")),
        "{show:#}"
    );
    let p1 = r.partition(&show, 1);
    assert_eq!(p1["database_position"], serde_json::Value::Null, "{show:#}");
    assert_eq!(p1["group_offset"], 3, "{show:#}");
    assert_eq!(p1["status"], "missing-in-db", "{show:#}");

    // status says the same, for the recorded group.
    let status = txinbox(
        &r.db.url,
        Some(&r.brokers),
        &["--json", "status", "--consumer", &r.consumer],
    )
    .await
    .ok();
    let c = &status["consumers"][0];
    let p1 = c["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["partition"] == 1)
        .unwrap_or_else(|| panic!("{status:#}"));
    assert_eq!(p1["status"], "missing-in-db", "{status:#}");
    assert_eq!(p1["group"], r.group.as_str(), "{status:#}");

    let text = r.run(&["positions", "show"]).await;
    assert_eq!(text.code, 0, "{text:?}");
    assert!(text.stdout.contains("missing-in-db"), "{text:?}");
    assert!(
        text.stdout.contains("positions adopt"),
        "says the way out: {text:?}"
    );
}

/// `positions adopt` writes the group's committed offset where the database has no position,
/// never over an existing one unless `--overwrite`; a dry run and an unconfirmed run write
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn positions_adopt_writes_the_group_offset_where_the_database_has_none() {
    let Some(r) = restored(4).await else { return };

    let dry = r.run(&["--json", "positions", "adopt", "--dry-run"]).await.ok();
    assert_eq!(dry["changes"][0]["partition"], 1, "{dry:#}");
    assert_eq!(dry["changes"][0]["to"], 3, "{dry:#}");
    assert_eq!(dry["changes"].as_array().unwrap().len(), 1, "{dry:#}");
    assert_eq!(r.position(1).await, None, "a dry run writes nothing");

    let unconfirmed = r.run(&["positions", "adopt"]).await;
    assert_eq!(unconfirmed.code, 1, "{unconfirmed:?}");
    assert!(unconfirmed.stderr.contains("--yes"), "{unconfirmed:?}");
    assert!(
        unconfirmed.stderr.contains("partition 1"),
        "the plan is shown first: {unconfirmed:?}"
    );
    assert_eq!(r.position(1).await, None, "unconfirmed: nothing written");

    r.run(&["--json", "positions", "adopt", "--yes"]).await.ok();
    assert_eq!(r.position(1).await, Some(3), "the group offset adopted");
    assert_eq!(r.position(0).await, Some(4), "an existing position is kept");

    // Partition 0 is behind the group (4 < 5): adopting counts offset 4 as done although the
    // database has no effect of it. The plan says so before anything is written, and refuses
    // it (the check `positions set` makes) unless forced.
    let behind = r
        .run(&[
            "--json",
            "positions",
            "adopt",
            "--partition",
            "0",
            "--overwrite",
            "--dry-run",
        ])
        .await
        .ok();
    let warning = behind["warnings"][0].as_str().unwrap_or_default();
    assert!(
        warning.contains("partition 0 offsets 4..5"),
        "the records it skips are named: {behind:#}"
    );
    let refused = r
        .run(&["positions", "adopt", "--partition", "0", "--overwrite", "--yes"])
        .await;
    assert_eq!(refused.code, 1, "{refused:?}");
    assert_eq!(r.position(0).await, Some(4), "a refusal writes nothing");
    r.run(&[
        "--json",
        "positions",
        "adopt",
        "--partition",
        "0",
        "--overwrite",
        "--force",
        "--yes",
    ])
    .await
    .ok();
    assert_eq!(r.position(0).await, Some(5), "--overwrite --force overwrites");
    let show = r.run(&["--json", "positions", "show"]).await.ok();
    assert_eq!(r.partition(&show, 1)["status"], "ok", "{show:#}");
}

/// `positions set --to-earliest` writes each partition's low watermark (the inbox skips what
/// was applied); `--offset N --partition P` one partition; dry run and no `--yes` write nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn positions_set_to_earliest_writes_the_low_watermark() {
    let Some(r) = restored(5).await else { return };
    let show = r.run(&["--json", "positions", "show"]).await.ok();
    let low: Vec<i64> = (0..2)
        .map(|p| r.partition(&show, p)["low_watermark"].as_i64().unwrap())
        .collect();

    r.run(&["--json", "positions", "set", "--to-earliest", "--dry-run"])
        .await
        .ok();
    let unconfirmed = r.run(&["positions", "set", "--to-earliest"]).await;
    assert_eq!(unconfirmed.code, 1, "{unconfirmed:?}");
    assert!(unconfirmed.stderr.contains("--yes"), "{unconfirmed:?}");
    assert_eq!((r.position(0).await, r.position(1).await), (Some(5), None));

    let set = r
        .run(&["--json", "positions", "set", "--to-earliest", "--yes"])
        .await
        .ok();
    assert_eq!(r.position(0).await, Some(low[0]), "{set:#}");
    assert_eq!(r.position(1).await, Some(low[1]), "{set:#}");

    // Forward past where the consumer resumes skips records: only with --force.
    let skip = r
        .run(&["positions", "set", "--offset", "2", "--partition", "1", "--yes"])
        .await;
    assert_eq!(skip.code, 1, "{skip:?}");
    assert!(skip.stderr.contains("offsets 0..2"), "{skip:?}");
    assert_eq!(r.position(1).await, Some(low[1]), "a refusal writes nothing");
    r.run(&[
        "--json",
        "positions",
        "set",
        "--offset",
        "2",
        "--partition",
        "1",
        "--yes",
        "--force",
    ])
    .await
    .ok();
    assert_eq!(r.position(1).await, Some(2));
    assert_eq!(r.position(0).await, Some(low[0]), "other partitions untouched");
    let no_partition = r.run(&["positions", "set", "--offset", "2", "--yes"]).await;
    assert_eq!(no_partition.code, 2, "{no_partition:?}");
}

/// `positions rebind` records another group on purpose (after confirmation); tools read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn positions_rebind_records_a_new_group() {
    let Some(r) = restored(5).await else { return };
    let new = format!("{}-new", r.group);
    commit_group(&r.brokers, &new, &r.topic, &[(0, 2), (1, 2)]);
    let unconfirmed = r.run(&["positions", "rebind", "--group", &new]).await;
    assert_eq!(unconfirmed.code, 1, "{unconfirmed:?}");
    assert!(
        unconfirmed.stderr.contains(&r.group),
        "the plan names the old group: {unconfirmed:?}"
    );
    let rebound = r
        .run(&["--json", "positions", "rebind", "--group", &new, "--yes"])
        .await
        .ok();
    assert_eq!(rebound["previous_group"], r.group.as_str(), "{rebound:#}");
    let show = r.run(&["--json", "positions", "show"]).await.ok();
    assert_eq!(show["group"], new.as_str(), "{show:#}");
    assert_eq!(r.partition(&show, 1)["group_offset"], 2, "{show:#}");
    let old = r.run(&["positions", "show", "--group", &r.group]).await;
    assert_eq!(old.code, 1, "the old group now disagrees: {old:?}");
}

/// The store side: the status of a partition, the adopt plan, and a write that finds a position
/// changed since the plan writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positions_ops_classify_plan_and_write_only_what_was_planned() {
    let view = |database_position, group_offset| PartitionView {
        partition: 0,
        database_position,
        group_offset,
        low: 10,
        high: 100,
    };
    assert_eq!(view(None, Some(50)).status(), PositionStatus::MissingInDb);
    assert_eq!(view(None, None).status(), PositionStatus::Unstarted);
    assert_eq!(view(Some(50), Some(50)).status(), PositionStatus::Ok);
    assert_eq!(view(Some(40), Some(50)).status(), PositionStatus::BehindGroup);
    assert_eq!(view(Some(60), Some(50)).status(), PositionStatus::AheadOfGroup);
    assert_eq!(view(Some(5), None).status(), PositionStatus::BelowLowWatermark);
    // The two a Kafka consumer holds (never writing their position): running members are no
    // reason to refuse writing one.
    assert!(view(Some(5), None).status().held_by_consumer());
    assert!(view(None, Some(50)).status().held_by_consumer());
    assert!(!view(Some(50), Some(50)).status().held_by_consumer());
    assert!(!view(None, None).status().held_by_consumer());
    assert_eq!(
        view(Some(101), None).status(),
        PositionStatus::BeyondHighWatermark
    );

    let views = [
        PartitionView {
            partition: 1,
            ..view(None, Some(50))
        },
        PartitionView {
            partition: 2,
            ..view(Some(40), Some(50))
        },
        PartitionView {
            partition: 3,
            ..view(None, None)
        },
    ];
    let (changes, skips) = positions::adopt_plan(&views, false);
    assert_eq!(
        changes,
        [Change {
            partition: 1,
            from: None,
            to: 50
        }]
    );
    assert_eq!(skips.iter().map(|s| s.partition).collect::<Vec<_>>(), [2, 3]);
    assert_eq!(positions::adopt_plan(&views, true).0.len(), 2);

    assert_eq!(positions::resolve_group(Some("g"), None), Ok("g".to_owned()));
    assert_eq!(positions::resolve_group(None, Some("h")), Ok("h".to_owned()));
    assert!(positions::resolve_group(Some("g"), Some("h")).is_err());
    assert_eq!(
        positions::resolve_group(None, None),
        Err(positions::GroupError::Unknown)
    );

    let db = TestDb::new().await;
    let consumer = consumer_name();
    store_position(&db, &consumer, "t", 0, 7).await;
    // The plan saw no position for partition 0 and 7 for 1: both are wrong now.
    let stale = [
        Change {
            partition: 1,
            from: None,
            to: 3,
        },
        Change {
            partition: 0,
            from: None,
            to: 3,
        },
    ];
    let applied = positions::apply(&db.pool, &consumer, "t", &stale, None)
        .await
        .unwrap();
    assert_eq!(
        applied,
        Applied::Changed {
            partition: 0,
            now: Some(7)
        }
    );
    assert_eq!(db.position(&consumer, "t", 1).await, None, "nothing written");
    assert_eq!(db.position(&consumer, "t", 0).await, Some(7));
    let fresh = [Change {
        partition: 0,
        from: Some(7),
        to: 3,
    }];
    assert_eq!(
        positions::apply(&db.pool, &consumer, "t", &fresh, None)
            .await
            .unwrap(),
        Applied::Done
    );
    assert_eq!(db.position(&consumer, "t", 0).await, Some(3));
    assert_eq!(
        positions::rebind(&db.pool, &consumer, positions::KAFKA, "t", "g2")
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        positions::subscription(&db.pool, &consumer, positions::KAFKA, "t")
            .await
            .unwrap()
            .as_deref(),
        Some("g2")
    );
}

/// 10 deposits on each of 2 partitions processed (positions, group offsets, recorded group),
/// then the database "restored" to a dump taken before partition 1 was first processed (its
/// effects, inbox rows and position gone). Returns the database, topic, consumer name and a
/// query of the sum of its positions.
async fn processed_then_restored(brokers: &str) -> (TestDb, String, String, String) {
    let db = TestDb::new().await;
    let topic = create_topic(brokers, 2).await;
    let consumer = consumer_name();
    let producer = Producer::new(brokers);
    producer.deposits(&topic, 0, "a", 10).await;
    producer.deposits(&topic, 1, "b", 10).await;
    let running = Running::start(&db, brokers, &consumer, &topic);
    let done = format!(
        "SELECT coalesce(sum(next_position), 0)::bigint FROM txinbox.positions WHERE consumer = '{consumer}'"
    );
    db.wait_for(&done, 20, std::time::Duration::from_secs(60)).await;
    running.stop().await;
    // The consumer's group.id is its name.
    record_subscription(&db, &consumer, &topic, &consumer).await;
    db.exec(&format!(
        "BEGIN;
         DELETE FROM effects WHERE message_id LIKE 'b-%';
         DELETE FROM txinbox.inbox WHERE message_id LIKE 'b-%';
         DELETE FROM txinbox.positions WHERE consumer = '{consumer}' AND lane = '1';
         COMMIT;"
    ))
    .await;
    (db, topic, consumer, done)
}

/// The restore procedure end to end: a database restored to a state where partition 1 was never
/// processed (no effects, no inbox rows, no position) while the group committed it; `positions
/// show` says so, `positions set --to-earliest` and a restart re-apply exactly what was lost,
/// nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restore_then_set_to_earliest_reapplies_exactly_the_lost_effects() {
    let Some(brokers) = brokers() else { return };
    let (db, topic, consumer, done) = processed_then_restored(&brokers).await;
    let show = txinbox(
        &db.url,
        Some(&brokers),
        &[
            "--json",
            "positions",
            "show",
            "--consumer",
            &consumer,
            "--topic",
            &topic,
        ],
    )
    .await
    .ok();
    let p1 = show["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["partition"] == 1)
        .unwrap_or_else(|| panic!("{show:#}"));
    assert_eq!(
        p1["status"], "missing-in-db",
        "the group committed partition 1: {show:#}"
    );

    txinbox(
        &db.url,
        Some(&brokers),
        &[
            "--json",
            "positions",
            "set",
            "--consumer",
            &consumer,
            "--topic",
            &topic,
            "--to-earliest",
            "--yes",
        ],
    )
    .await
    .ok();
    assert_eq!(db.position(&consumer, &topic, 1).await, Some(0));
    let running = Running::start(&db, &brokers, &consumer, &topic);
    db.wait_for(&done, 20, std::time::Duration::from_secs(60)).await;
    running.stop().await;
    assert_eq!(db.assert_none_twice().await, 20, "every effect once");
    assert_eq!(
        db.scalar("SELECT count(*) FROM effects WHERE message_id LIKE 'b-%'")
            .await,
        10,
        "the lost effects re-applied"
    );
    assert_eq!(
        db.scalar(&format!(
            "SELECT coalesce(sum(duplicates), 0)::bigint FROM txinbox.inbox WHERE consumer = '{consumer}'"
        ))
        .await,
        10,
        "partition 0 re-read from the earliest offset: every record a duplicate"
    );
}

/// The remedy the consumer's error names works while it runs: the consumer holds the partition
/// without a database position (paused, never writing its position), so the running group is
/// no reason to refuse `set --to-earliest` for it, and the consumer picks the position up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn set_to_earliest_for_a_held_partition_works_while_the_consumer_runs() {
    let Some(brokers) = brokers() else { return };
    let (db, topic, consumer, _) = processed_then_restored(&brokers).await;

    // Restarted: it holds partition 1.
    let running = Running::start(&db, &brokers, &consumer, &topic);
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let set = txinbox(
        &db.url,
        Some(&brokers),
        &[
            "--json",
            "positions",
            "set",
            "--consumer",
            &consumer,
            "--topic",
            &topic,
            "--to-earliest",
            "--partition",
            "1",
            "--yes",
        ],
    )
    .await;
    assert_eq!(set.code, 0, "not refused for the running group: {set:?}");
    db.wait_for(
        "SELECT count(*) FROM effects WHERE message_id LIKE 'b-%'",
        10,
        std::time::Duration::from_secs(60),
    )
    .await;
    running.stop().await;
    assert_eq!(db.assert_none_twice().await, 20, "every effect once");
}

/// `positions adopt --force` moved a stored position to the group's offset with none of the
/// guards of `positions set` (issue 26, item 6): backwards past the retention horizon, it
/// re-applied records whose inbox rows a purge had deleted. Both commands now share one check:
/// adopt overwrites an existing position only with `--overwrite`, refused like `set` past the
/// horizon, and `--force` writes anyway on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adopt_is_refused_past_the_retention_horizon_like_set() {
    let Some(r) = restored(5).await else { return };
    // Partition 1 stored ahead of the group (5 > 3): adopting moves it back over 3..5, records
    // produced before the horizon of the purge that follows.
    store_position(&r.db, &r.consumer, &r.topic, 1, 5).await;
    r.purge_up_to_now().await;

    let forced = r
        .run(&["positions", "adopt", "--partition", "1", "--force", "--yes"])
        .await;
    assert_eq!(
        r.position(1).await,
        Some(5),
        "not moved back past the retention horizon: {forced:?}"
    );

    let overwrite = r
        .run(&["positions", "adopt", "--partition", "1", "--overwrite", "--yes"])
        .await;
    assert_eq!(overwrite.code, 1, "{overwrite:?}");
    assert!(overwrite.stderr.contains("retention horizon"), "{overwrite:?}");
    assert_eq!(r.position(1).await, Some(5), "a refusal writes nothing");

    let set = r
        .run(&["positions", "set", "--offset", "3", "--partition", "1", "--yes"])
        .await;
    assert_eq!(set.code, 1, "{set:?}");
    assert!(
        set.stderr.contains("retention horizon"),
        "the same check: {set:?}"
    );

    let done = r
        .run(&[
            "--json",
            "positions",
            "adopt",
            "--partition",
            "1",
            "--overwrite",
            "--force",
            "--yes",
        ])
        .await
        .ok();
    assert!(
        done["warnings"][0]
            .as_str()
            .unwrap_or_default()
            .contains("retention horizon"),
        "forced on purpose, with the reason as a warning: {done:#}"
    );
    assert_eq!(r.position(1).await, Some(3));
}

/// `positions adopt` refuses, like `positions set`, to overwrite the position of a partition a
/// running member holds: the consumer overwrites it with its own progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adopt_is_refused_while_the_group_has_active_members_like_set() {
    let Some(brokers) = brokers() else { return };
    let (db, topic, consumer, _) = processed_then_restored(&brokers).await;
    let running = Running::start(&db, &brokers, &consumer, &topic);
    // One more record on partition 0: once its position is 11, the member consumes it.
    Producer::new(&brokers).deposits(&topic, 0, "c", 1).await;
    db.wait_for(
        &format!("SELECT next_position FROM txinbox.positions WHERE consumer = '{consumer}' AND lane = '0'"),
        11,
        std::time::Duration::from_secs(60),
    )
    .await;
    // Stored behind the group's offset while the member is idle.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    store_position(&db, &consumer, &topic, 0, 9).await;
    let run = |extra: &'static [&'static str]| {
        let args: Vec<&str> = [
            &[
                "positions",
                "adopt",
                "--consumer",
                consumer.as_str(),
                "--topic",
                topic.as_str(),
                "--partition",
                "0",
                "--yes",
            ][..],
            extra,
        ]
        .concat();
        let (url, brokers) = (db.url.clone(), brokers.clone());
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            txinbox(&url, Some(&brokers), &args).await
        }
    };
    let forced = run(&["--force"]).await;
    assert_eq!(
        db.position(&consumer, &topic, 0).await,
        Some(9),
        "not overwritten under a running member: {forced:?}"
    );
    let overwrite = run(&["--overwrite"]).await;
    assert_eq!(overwrite.code, 1, "{overwrite:?}");
    assert!(overwrite.stderr.contains("active member"), "{overwrite:?}");
    assert_eq!(db.position(&consumer, &topic, 0).await, Some(9));
    running.stop().await;
}
