//! The CLI's guards (issue 15, defect 7): durations with unambiguous units; purge scoped to one
//! consumer unless told otherwise, refusing the dedup window unless forced, showing its plan and
//! asking before it deletes; replay and status reading the group the consumer records; secrets
//! never echoed. Against real PostgreSQL (`DATABASE_URL`) and, where a group is read, a
//! Kafka-protocol broker (`KAFKA_BROKERS`).

mod support;

use support::*;

/// `m` (minutes or months?), `M`, `mo` and bare numbers are refused with the accepted units;
/// `90s`, `30min`, `12h`, `7d`, `2w` are accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durations_accept_only_unambiguous_units() {
    let db = TestDb::new().await;
    let consumer = consumer_name();
    for bad in ["90m", "3M", "1mo", "90", "7x", "min", "1.5h", "1d2h"] {
        let run = txinbox(
            &db.url,
            None,
            &["purge", "--consumer", &consumer, "--older-than", bad, "--dry-run"],
        )
        .await;
        assert_eq!(run.code, 2, "{bad}: {run:?}");
        assert!(
            run.stderr.contains("s, min, h, d or w"),
            "{bad}: the accepted units are listed: {run:?}"
        );
    }
    for (good, seconds) in [
        ("90s", 90),
        ("30min", 1800),
        ("12h", 43_200),
        ("7d", 604_800),
        ("2w", 1_209_600),
    ] {
        let run = txinbox(
            &db.url,
            None,
            &[
                "--json",
                "purge",
                "--consumer",
                &consumer,
                "--older-than",
                good,
                "--dry-run",
            ],
        )
        .await
        .ok();
        assert_eq!(run["window_seconds"], seconds, "{good}: {run:#}");
    }
}

/// Purge needs `--consumer` or `--all-consumers`, and refuses a window inside the documented
/// dedup window (7 days) unless `--force`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_is_scoped_and_refuses_inside_the_dedup_window() {
    let db = TestDb::new().await;
    let (a, b) = (consumer_name(), consumer_name());
    old_rows(&db, &a, 5, 30).await;
    old_rows(&db, &b, 5, 30).await;
    old_rows(&db, &a, 3, 1).await;

    // No scope: a usage error, nothing deleted.
    let unscoped = txinbox(&db.url, None, &["purge", "--older-than", "0s", "--yes"]).await;
    assert_eq!(unscoped.code, 2, "{unscoped:?}");
    assert!(
        unscoped.stderr.contains("--consumer") && unscoped.stderr.contains("--all-consumers"),
        "{unscoped:?}"
    );
    // Inside the window: refused unless --force.
    let inside = txinbox(
        &db.url,
        None,
        &["purge", "--consumer", &a, "--older-than", "0s", "--yes"],
    )
    .await;
    assert_eq!(inside.code, 1, "{inside:?}");
    assert!(inside.stderr.contains("--force"), "{inside:?}");
    assert!(inside.stderr.contains("7d"), "names the window: {inside:?}");
    assert_eq!(inbox_rows(&db, &a).await, 8, "a refusal deletes nothing");
    assert_eq!(inbox_rows(&db, &b).await, 5, "a refusal deletes nothing");

    let forced = txinbox(
        &db.url,
        None,
        &[
            "--json",
            "purge",
            "--consumer",
            &a,
            "--older-than",
            "0s",
            "--yes",
            "--force",
        ],
    )
    .await
    .ok();
    assert_eq!(forced["consumers"][0]["deleted"], 8, "{forced:#}");
    assert_eq!(inbox_rows(&db, &b).await, 5, "only the named consumer");
}

/// Purge prints its plan (rows per consumer) first; without a terminal it needs `--yes` and
/// refuses (never waits) without it; `--dry-run` prints the plan only; `--all-consumers`
/// covers every consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_shows_its_plan_and_needs_yes_without_a_terminal() {
    let db = TestDb::new().await;
    let (a, b) = (consumer_name(), consumer_name());
    old_rows(&db, &a, 4, 30).await;
    old_rows(&db, &b, 6, 30).await;

    let unconfirmed = txinbox(&db.url, None, &["purge", "--consumer", &a]).await;
    assert_eq!(unconfirmed.code, 1, "{unconfirmed:?}");
    assert!(unconfirmed.stderr.contains("--yes"), "{unconfirmed:?}");
    assert!(
        unconfirmed.stderr.contains(&format!("{a}: would delete 4")),
        "the plan is shown first: {unconfirmed:?}"
    );
    assert_eq!(inbox_rows(&db, &a).await, 4, "unconfirmed: nothing deleted");

    let dry = txinbox(&db.url, None, &["purge", "--all-consumers", "--dry-run"]).await;
    assert_eq!(dry.code, 0, "{dry:?}");
    assert!(dry.stdout.contains(&format!("{a}: would delete 4")), "{dry:?}");
    assert!(dry.stdout.contains(&format!("{b}: would delete 6")), "{dry:?}");
    assert_eq!(inbox_rows(&db, &a).await + inbox_rows(&db, &b).await, 10);

    let one = txinbox(&db.url, None, &["--json", "purge", "--consumer", &a, "--yes"])
        .await
        .ok();
    assert_eq!(one["consumers"][0]["deleted"], 4, "{one:#}");
    assert_eq!(inbox_rows(&db, &b).await, 6, "only the named consumer");

    let all = txinbox(&db.url, None, &["--json", "purge", "--all-consumers", "--yes"])
        .await
        .ok();
    let deleted: i64 = all["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["deleted"].as_i64().unwrap())
        .sum();
    assert_eq!(deleted, 6, "{all:#}");
    assert_eq!(inbox_rows(&db, &b).await, 0);
}

/// Replay and status read the group the consumer recorded (here not its name); a `--group`
/// that disagrees is refused; with nothing recorded and no `--group`, replay refuses and says
/// to pass it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replay_and_status_read_the_recorded_group() {
    let Some(brokers) = brokers() else { return };
    let db = TestDb::new().await;
    let topic = create_topic(&brokers, 1).await;
    let consumer = consumer_name();
    let group = format!("{consumer}-group");
    Producer::new(&brokers).deposits(&topic, 0, "g", 6).await;
    commit_group(&brokers, &group, &topic, &[(0, 4)]);
    // What the consumer's own name as a group committed: a decoy the old default read.
    commit_group(&brokers, &consumer, &topic, &[(0, 1)]);
    record_subscription(&db, &consumer, &topic, &group).await;
    store_position(&db, &consumer, &topic, 0, 4).await;

    let replay = |extra: &'static [&'static str]| {
        let (url, brokers, consumer, topic) =
            (db.url.clone(), brokers.clone(), consumer.clone(), topic.clone());
        async move {
            let args = [
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
                ][..],
                extra,
            ]
            .concat();
            txinbox(&url, Some(&brokers), &args).await
        }
    };
    let dry = replay(&[]).await.ok();
    assert_eq!(dry["group"], group.as_str(), "{dry:#}");
    assert_eq!(dry["partitions"][0]["group_offset"], 4, "{dry:#}");

    let status = txinbox(
        &db.url,
        Some(&brokers),
        &["--json", "status", "--consumer", &consumer],
    )
    .await
    .ok();
    let c = &status["consumers"][0];
    assert_eq!(c["partitions"][0]["group_offset"], 4, "{status:#}");

    // A --group that is not the recorded one.
    let args = [
        "replay",
        "--consumer",
        &consumer,
        "--topic",
        &topic,
        "--to-offset",
        "0",
        "--dry-run",
        "--group",
        &consumer,
    ];
    let wrong = txinbox(&db.url, Some(&brokers), &args).await;
    assert_eq!(wrong.code, 1, "{wrong:?}");
    assert!(
        wrong.stderr.contains(&format!("recorded group {group}")),
        "{wrong:?}"
    );
    let wrong_status = txinbox(
        &db.url,
        Some(&brokers),
        &["status", "--consumer", &consumer, "--group", "elsewhere"],
    )
    .await;
    assert_eq!(wrong_status.code, 1, "{wrong_status:?}");
    assert!(wrong_status.stderr.contains("recorded group"), "{wrong_status:?}");

    // Nothing recorded for this consumer: refused until --group is passed.
    let other = consumer_name();
    let args = [
        "replay",
        "--consumer",
        &other,
        "--topic",
        &topic,
        "--to-offset",
        "0",
        "--dry-run",
    ];
    let unknown = txinbox(&db.url, Some(&brokers), &args).await;
    assert_eq!(unknown.code, 1, "{unknown:?}");
    assert!(unknown.stderr.contains("pass --group"), "{unknown:?}");
    let given = txinbox(
        &db.url,
        Some(&brokers),
        &[&["--json"][..], &args, &["--group", &group]].concat(),
    )
    .await
    .ok();
    assert_eq!(given["partitions"][0]["group_offset"], 4, "{given:#}");
}

/// A password in `--database-url` or in SASL credentials inside `--brokers` never reaches the
/// output, whatever fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_in_connection_strings_never_reach_the_output() {
    let db = TestDb::new().await;
    let secret = "s3kr1t-pw";
    let brokers_with_secret = [
        format!("sasl_ssl://operator:{secret}@127.0.0.1:1"),
        format!("operator:{secret}@127.0.0.1:1,127.0.0.1:2"),
    ];
    let mut runs = Vec::new();
    for brokers in &brokers_with_secret {
        for args in [
            &["status"][..],
            &["--json", "status"][..],
            &[
                "replay",
                "--consumer",
                "c",
                "--topic",
                "t",
                "--to-earliest",
                "--group",
                "g",
            ][..],
            &[
                "positions",
                "show",
                "--consumer",
                "c",
                "--topic",
                "t",
                "--group",
                "g",
            ][..],
        ] {
            // Side by side: each waits for the unreachable brokers' timeout.
            let (url, brokers) = (db.url.clone(), brokers.clone());
            let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            runs.push(tokio::spawn(async move {
                let argv: Vec<&str> = args.iter().map(String::as_str).collect();
                let run = txinbox(&url, Some(&brokers), &argv).await;
                (args, brokers, run)
            }));
        }
    }
    for r in runs {
        let (args, brokers, run) = r.await.unwrap();
        assert_ne!(run.code, 0, "{args:?} {brokers}: {run:?}");
        assert!(
            !run.stdout.contains(secret) && !run.stderr.contains(secret),
            "{args:?} {brokers}: {run:?}"
        );
    }
    for url in [
        format!("postgres://operator:{secret}@127.0.0.1:1/inbox"),
        format!("postgres://operator:{secret}@127.0.0.1:notaport/inbox"),
        format!("postgres://operator@127.0.0.1:1/inbox?password={secret}"),
        format!("postgres://operator:{secret}@127.0.0.1:5432/no_such_database_here"),
    ] {
        for args in [
            &["status"][..],
            &["--json", "purge", "--all-consumers", "--dry-run"][..],
        ] {
            let run = txinbox(&url, None, args).await;
            assert_ne!(run.code, 0, "{args:?} {url}: {run:?}");
            assert!(
                !run.stdout.contains(secret) && !run.stderr.contains(secret),
                "{args:?} {url}: {run:?}"
            );
            let run = txinbox(&db.url, None, &[&["--database-url", &url][..], args].concat()).await;
            assert!(
                !run.stdout.contains(secret) && !run.stderr.contains(secret),
                "{args:?} --database-url {url}: {run:?}"
            );
        }
    }
}

/// On a terminal, purge asks after showing its plan: anything but `y`/`yes` changes nothing.
/// (The terminal is a pseudo-terminal from util-linux `script`; skipped where it is missing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_asks_on_a_terminal_and_deletes_only_on_yes() {
    if std::process::Command::new("script")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: no `script` (util-linux) to give the command a terminal");
        return;
    }
    let db = TestDb::new().await;
    let consumer = consumer_name();
    old_rows(&db, &consumer, 3, 30).await;
    let on_a_terminal = |answer: &'static str| {
        let (url, consumer) = (db.url.clone(), consumer.clone());
        async move {
            use tokio::io::AsyncWriteExt;
            let command = format!(
                "{} purge --consumer {consumer} --older-than 7d",
                env!("CARGO_BIN_EXE_txinbox")
            );
            let mut child = tokio::process::Command::new("script")
                .args(["-qec", &command, "/dev/null"])
                .env("DATABASE_URL", &url)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("script runs");
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(answer.as_bytes()).await.unwrap();
            stdin.flush().await.unwrap();
            // script passes the end of input on to the terminal after the answer.
            drop(stdin);
            let out = tokio::time::timeout(std::time::Duration::from_secs(60), child.wait_with_output())
                .await
                .expect("answered within 60 s, not left waiting")
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            )
        }
    };
    let (code, out) = on_a_terminal("n\n").await;
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!("{consumer}: would delete 3")),
        "the plan first: {out}"
    );
    assert!(out.contains("[y/N]"), "{out}");
    assert_eq!(
        inbox_rows(&db, &consumer).await,
        3,
        "not confirmed: nothing deleted"
    );
    let (code, out) = on_a_terminal("y\n").await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(&format!("{consumer}: deleted 3")), "{out}");
    assert_eq!(inbox_rows(&db, &consumer).await, 0);
}

/// A dead letter whose stored copy was cut (over `dead_letter_payload_limit`) says so in `show`
/// and is never requeued: the copy would be a different message. The original is in the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_stored_cut_is_shown_as_such_and_never_requeued() {
    let db = TestDb::new().await;
    let consumer = consumer_name();
    db.exec(&format!(
        "INSERT INTO txinbox.dead_letters (consumer, message_id, id_strategy, reason, error, attempts,
             payload, headers, source_system, destination, source_partition, source_offset,
             payload_size, payload_sha256, truncated)
         VALUES ('{consumer}', 'big-1', 'header:x-id', 'too_large', 'message is 200000 bytes', 0,
             '\\x7b2261', '[]', 'kafka', 'payments', 0, 41, 200000, sha256('whole'), true)"
    ))
    .await;
    let id: i64 = db
        .scalar(&format!(
            "SELECT id FROM txinbox.dead_letters WHERE consumer = '{consumer}'"
        ))
        .await;
    let show = txinbox(
        &db.url,
        None,
        &["--json", "dead-letters", "show", &id.to_string()],
    )
    .await
    .ok();
    assert_eq!(show["truncated"], true, "{show:#}");
    assert_eq!(show["payload_size"], 200000, "{show:#}");
    assert_eq!(
        show["payload_sha256"].as_str().map(str::len),
        Some(64),
        "{show:#}"
    );
    for args in [
        vec!["dead-letters", "requeue"],
        vec!["dead-letters", "requeue", "--force"],
    ] {
        let mut args = args;
        let id = id.to_string();
        args.push(&id);
        let refused = txinbox(&db.url, Some("127.0.0.1:9"), &args).await;
        assert_eq!(refused.code, 1, "{args:?}: {refused:?}");
        assert!(
            refused.stderr.contains("stored cut"),
            "{args:?}: says why: {refused:?}"
        );
    }
    assert_eq!(
        db.scalar(&format!(
            "SELECT requeue_count::bigint FROM txinbox.dead_letters WHERE id = {id}"
        ))
        .await,
        0,
        "nothing was requeued"
    );
}
