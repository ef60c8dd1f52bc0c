//! The ledger binary on RabbitMQ over TLS, as a team runs it in production: against the
//! TLS-only node (`AMQPS_URL`, default `amqps://guest:guest@127.0.0.1:5671/%2f`, which refuses
//! plaintext; `scripts/test` starts it with the certificates of `$TXINBOX_TLS_DIR`), trusting
//! the test CA with `--amqp-ca-file`, consuming a quorum queue declared beforehand.
//!
//! Runs the `ledger` example that `cargo test --workspace` builds (skipped with a message when it
//! is not built); PostgreSQL at `DATABASE_URL` (a scratch database).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use txinbox::sqlx;
use txinbox_amqp::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use txinbox_amqp::lapin::types::{AMQPValue, FieldTable};
use txinbox_amqp::lapin::{BasicProperties, ConnectionProperties};
use txinbox_amqp::AmqpTls;
use txinbox_testing::database::TestDatabase;
use txinbox_testing::output::{capture, example};

fn amqps_url() -> String {
    std::env::var("AMQPS_URL").unwrap_or_else(|_| "amqps://guest:guest@127.0.0.1:5671/%2f".into())
}

/// `$TXINBOX_TLS_DIR/<name>`; panics saying what to run when it is missing.
fn tls_file(name: &str) -> PathBuf {
    let dir = std::env::var("TXINBOX_TLS_DIR").unwrap_or_else(|_| "/var/lib/txinbox/tls".into());
    let path = PathBuf::from(dir).join(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/test's setup (ensure_test_certs and ensure_rabbitmq_tls)",
        path.display()
    );
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_applies_payments_over_tls_from_a_quorum_queue_declared_beforehand() {
    let Some(ledger) = example("ledger") else { return };
    let db = TestDatabase::builder("ledger_tls_t")
        .migrate(false)
        .create()
        .await;
    let queue = format!("ledger-tls-{}", std::process::id());
    let ca = tls_file("ca.pem");

    // The queue, declared beforehand as a team declares it (quorum), and 40 payments, every
    // 4th published twice, over TLS.
    let tls = AmqpTls::new().ca_file(&ca);
    let conn = tls
        .connect(&amqps_url(), ConnectionProperties::default())
        .await
        .expect("connect to the TLS node (scripts/test starts it)");
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut quorum = FieldTable::default();
    quorum.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(queue.as_str().into(), durable, quorum)
        .await
        .unwrap();
    let mut expected_total = 0i64;
    for i in 0..40i64 {
        let payload = format!(r#"{{"account":"acct-{}","amount_cents":{}}}"#, i % 5, i + 1);
        expected_total += i + 1;
        for _ in 0..if i % 4 == 0 { 2 } else { 1 } {
            let confirm = channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    payload.as_bytes(),
                    BasicProperties::default()
                        .with_delivery_mode(2)
                        .with_message_id(format!("pay-{i}").into()),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(confirm.is_ack());
        }
    }

    let ledger_cmd = |url: String| {
        let mut cmd = Command::new(&ledger);
        cmd.args([
            "--source",
            "amqp",
            "--queue",
            &queue,
            "--amqp-queue-type",
            "quorum",
        ])
        .arg("--amqp-ca-file")
        .arg(&ca)
        .env("DATABASE_URL", db.url())
        .env("AMQP_URL", url)
        .env_remove("RUST_LOG")
        .env_remove("LEDGER_SOURCE");
        cmd
    };

    // Plaintext to the TLS-only port: refused, saying what to do (before any consuming).
    let plaintext = tokio::task::block_in_place(|| {
        capture(
            &mut ledger_cmd(amqps_url().replacen("amqps://", "amqp://", 1)),
            None,
            Duration::from_secs(60),
        )
    });
    assert!(
        !plaintext.stopped && plaintext.code == Some(1) && plaintext.all().contains("use amqps://"),
        "the ledger with amqp:// to the TLS port: {:?}\n{}",
        plaintext.code,
        plaintext.all()
    );

    let mut child = ledger_cmd(amqps_url())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run the ledger");
    let started = Instant::now();
    let applied = loop {
        let applied: Option<i64> = sqlx::query_scalar("SELECT count(*) FROM ledger_entries")
            .fetch_one(db.pool())
            .await
            .ok();
        if applied == Some(40) || started.elapsed() > Duration::from_secs(90) {
            break applied;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the ledger exited over TLS: {status}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // This child only, by its handle.
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(applied, Some(40), "every payment applied within 90 s");
    let (entries, distinct, total): (i64, i64, Option<i64>) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT event_id), sum(amount_cents)::bigint FROM ledger_entries",
    )
    .fetch_one(db.pool())
    .await
    .unwrap();
    assert_eq!((entries, distinct), (40, 40), "none doubled");
    assert_eq!(total, Some(expected_total));

    for q in [queue.clone(), format!("{queue}.retry"), format!("{queue}.dlq")] {
        let _ = channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "done".into()).await;
    db.drop_database().await;
}
