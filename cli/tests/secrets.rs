//! No secret reaches the CLI's output (issue 26, item 10), tried as a new user would: passwords
//! pasted into `DATABASE_URL` unencoded (with `/`, `@`, `#`, `?`, `&`, `:`), secret query
//! parameters (`password` cut by an unencoded `&`, `sslpassword`, `sslkey`), a libpq
//! `key=value` string, SASL credentials in `KAFKA_BROKERS` and an AMQP password; every command,
//! as text and as `--json`; and `--help` with all of them set. Everything each run prints is
//! searched for the secret in every form (`txinbox_testing::output`: plain, percent-encoded,
//! base64, pieces). Against real PostgreSQL (`DATABASE_URL`), RabbitMQ (`AMQP_URL`); the Kafka
//! brokers named are unreachable on purpose.

mod support;

use support::*;
use txinbox_testing::output::find_secret;

/// The database URLs a user might give, each with the secret in it: `{db}` is the test's
/// database, on the real server (trust authentication: a password, wherever it is, is
/// accepted), so a URL that parses as intended connects and the command runs.
fn database_urls(db: &str) -> Vec<(String, &'static str)> {
    let server = "127.0.0.1:5432";
    [
        // Digits, then `/`: a URL parser takes `postgres` for the host, 6543 for the port and
        // the rest for the database name.
        (
            format!("postgres://postgres:6543/Kx9-Secret-Tail@{server}/{db}"),
            "6543/Kx9-Secret-Tail",
        ),
        (
            format!("postgres://postgres:Kx9/Secret-Tail@{server}/{db}"),
            "Kx9/Secret-Tail",
        ),
        (
            format!("postgres://postgres:Kx9@Secret-Tail@{server}/{db}"),
            "Kx9@Secret-Tail",
        ),
        (
            format!("postgres://postgres:Kx9#Secret-Tail@{server}/{db}"),
            "Kx9#Secret-Tail",
        ),
        (
            format!("postgres://postgres:Kx9?Secret-Tail@{server}/{db}"),
            "Kx9?Secret-Tail",
        ),
        (
            format!("postgres://postgres:Kx9&Secret-Tail@{server}/{db}"),
            "Kx9&Secret-Tail",
        ),
        (
            format!("postgres://postgres:Kx9:Secret-Tail@{server}/{db}"),
            "Kx9:Secret-Tail",
        ),
        (
            format!("postgres://postgres@{server}/{db}?password=Kx9&Secret-Tail"),
            "Kx9&Secret-Tail",
        ),
        (
            format!("postgres://postgres@{server}/{db}?sslpassword=Kx9-Secret-Tail"),
            "Kx9-Secret-Tail",
        ),
        (
            format!("postgres://postgres@{server}/{db}?sslkey=/keys/Kx9-Secret-Tail.key"),
            "Kx9-Secret-Tail",
        ),
        (
            format!("host=127.0.0.1 port=5432 user=postgres password=Kx9-Secret-Tail dbname={db}"),
            "Kx9-Secret-Tail",
        ),
        (
            format!("postgres://postgres:Kx9-Secret-Tail@127.0.0.1:1/{db}"),
            "Kx9-Secret-Tail",
        ),
    ]
    .into_iter()
    .collect()
}

/// Every command that opens the database, with arguments that get it as far as it goes
/// without brokers.
const COMMANDS: &[&[&str]] = &[
    &["migrate"],
    &["status"],
    &[
        "replay",
        "--consumer",
        "c",
        "--topic",
        "t",
        "--to-earliest",
        "--group",
        "g",
    ],
    &["purge", "--all-consumers", "--dry-run"],
    &["positions", "show", "--consumer", "c"],
    &[
        "positions",
        "adopt",
        "--consumer",
        "c",
        "--topic",
        "t",
        "--dry-run",
    ],
    &[
        "positions",
        "set",
        "--consumer",
        "c",
        "--topic",
        "t",
        "--to-earliest",
        "--dry-run",
    ],
    &["dead-letters", "list"],
    &["dead-letters", "show", "1"],
    &["http", "purge", "--dry-run"],
];

/// One run of the tool: its environment, its arguments, and the secret it must not show.
#[derive(Clone)]
struct Attempt {
    env: Vec<(&'static str, String)>,
    args: Vec<String>,
    secret: String,
}

fn attempt(env: Vec<(&'static str, String)>, args: Vec<String>, secret: &str) -> Attempt {
    Attempt {
        env,
        args,
        secret: secret.to_owned(),
    }
}

/// Runs `runs` side by side, a few at a time, and returns the ones whose output shows their
/// secret, with what was found.
async fn leaks(runs: Vec<Attempt>) -> Vec<String> {
    let mut found = Vec::new();
    for batch in runs.chunks(8) {
        let handles: Vec<_> = batch
            .iter()
            .cloned()
            .map(|Attempt { env, args, secret }| {
                tokio::spawn(async move {
                    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_txinbox"));
                    cmd.args(&args)
                        .env_remove("DATABASE_URL")
                        .env_remove("KAFKA_BROKERS")
                        .env_remove("KAFKA_PROPERTIES")
                        .env_remove("AMQP_URL")
                        .stdin(std::process::Stdio::null());
                    for (k, v) in &env {
                        cmd.env(k, v);
                    }
                    let out = tokio::time::timeout(std::time::Duration::from_secs(120), cmd.output())
                        .await
                        .expect("txinbox finishes within 120 s")
                        .expect("run txinbox");
                    let printed = format!(
                        "{}\n{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                    find_secret(&printed, &secret).map(|f| format!("{env:?} txinbox {args:?}: {f}"))
                })
            })
            .collect();
        for h in handles {
            found.extend(h.await.unwrap());
        }
    }
    found
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|a| a.to_string()).collect()
}

/// Every command, text and `--json`, with each database URL in `DATABASE_URL`, and `status` with
/// it in `--database-url`: no output shows the password or secret parameter in any form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_command_shows_a_secret_from_the_database_url() {
    let db = TestDb::new().await;
    let name = db.url.rsplit('/').next().unwrap().to_owned();
    let mut runs = Vec::new();
    for (url, secret) in database_urls(&name) {
        for command in COMMANDS {
            for json in [false, true] {
                let mut a = if json { args(&["--json"]) } else { Vec::new() };
                a.extend(args(command));
                runs.push(attempt(vec![("DATABASE_URL", url.clone())], a, secret));
            }
        }
        runs.push(attempt(
            Vec::new(),
            args(&["--database-url", &url, "status"]),
            secret,
        ));
    }
    let total = runs.len();
    let found = leaks(runs).await;
    assert!(
        found.is_empty(),
        "{} of {total} runs show a secret:\n{}",
        found.len(),
        found.join("\n")
    );
}

/// Requeueing a Kafka and a RabbitMQ dead letter with credentials in `KAFKA_BROKERS` (SASL, as
/// `user:password@host` and `scheme://user:password@host`) and `AMQP_URL` (a wrong password for
/// a real broker, and one with an unencoded `/`): the errors name the service, never the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_never_shows_broker_credentials() {
    let db = TestDb::new().await;
    let kafka_id = dead_letter(&db, "kafka", "t").await;
    let amqp_id = dead_letter(&db, "rabbitmq", "q").await;
    let mut runs = Vec::new();
    for (brokers, secret) in [
        (
            "sasl_ssl://operator:Kx9/Secret-Tail@127.0.0.1:1",
            "Kx9/Secret-Tail",
        ),
        (
            "operator:Kx9@Secret-Tail@127.0.0.1:1,127.0.0.1:2",
            "Kx9@Secret-Tail",
        ),
    ] {
        for json in [false, true] {
            let mut a = if json { args(&["--json"]) } else { Vec::new() };
            a.extend(args(&["dead-letters", "requeue", &kafka_id]));
            let env = vec![
                ("DATABASE_URL", db.url.clone()),
                ("KAFKA_BROKERS", brokers.into()),
            ];
            runs.push(attempt(env, a, secret));
        }
    }
    let amqp_host = amqp_url()
        .split_once('@')
        .map(|(_, h)| h.to_owned())
        .unwrap_or_else(|| "127.0.0.1:5672/%2f".into());
    for (url, secret) in [
        (
            format!("amqp://guest:Kx9-Secret-Tail@{amqp_host}"),
            "Kx9-Secret-Tail",
        ),
        (
            format!("amqp://guest:5672/Kx9-Secret-Tail@{amqp_host}"),
            "5672/Kx9-Secret-Tail",
        ),
        (
            format!("amqp://guest:Kx9/Secret-Tail@{amqp_host}"),
            "Kx9/Secret-Tail",
        ),
    ] {
        for json in [false, true] {
            let mut a = if json { args(&["--json"]) } else { Vec::new() };
            a.extend(args(&["dead-letters", "requeue", &amqp_id]));
            let env = vec![("DATABASE_URL", db.url.clone()), ("AMQP_URL", url.clone())];
            runs.push(attempt(env, a, secret));
        }
    }
    // amqps:// to the TLS-only node: a wrong password over verified TLS, a CA that did not sign
    // the broker's certificate, and TLS files with a plaintext URL (refused before connecting).
    let tls_host = amqps_url()
        .split_once('@')
        .map(|(_, h)| h.to_owned())
        .unwrap_or_else(|| "127.0.0.1:5671/%2f".into());
    for (url, ca) in [
        (format!("amqps://guest:Kx9-Secret-Tail@{tls_host}"), "ca.pem"),
        (
            format!("amqps://guest:Kx9-Secret-Tail@{tls_host}"),
            "other-ca.pem",
        ),
        (format!("amqp://guest:Kx9-Secret-Tail@{amqp_host}"), "ca.pem"),
    ] {
        for json in [false, true] {
            let mut a = if json { args(&["--json"]) } else { Vec::new() };
            a.extend(args(&["--amqp-ca-file", &tls_file(ca)]));
            a.extend(args(&["dead-letters", "requeue", &amqp_id]));
            let env = vec![("DATABASE_URL", db.url.clone()), ("AMQP_URL", url.clone())];
            runs.push(attempt(env, a, "Kx9-Secret-Tail"));
        }
    }
    let found = leaks(runs).await;
    assert!(found.is_empty(), "runs show a secret:\n{}", found.join("\n"));
    // They reached the broker step: nothing was requeued, both are still pending.
    let pending = db
        .scalar("SELECT count(*) FROM txinbox.dead_letters WHERE requeued_at IS NULL")
        .await;
    assert_eq!(pending, 2);
}

/// `--help`, of the tool and of the commands that take services, with every variable set to a
/// value holding a secret: clap shows the variables' names, never their values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn help_never_shows_the_environment_values() {
    let env = vec![
        ("DATABASE_URL", "postgres://app:Kx9-Secret-Tail@db/app".to_owned()),
        ("KAFKA_BROKERS", "sasl_ssl://op:Kx9-Secret-Tail@k:9093".to_owned()),
        ("AMQP_URL", "amqp://app:Kx9-Secret-Tail@mq/%2f".to_owned()),
        ("AMQP_CA_FILE", "/etc/Kx9-Secret-Tail/ca.pem".to_owned()),
        ("AMQP_CLIENT_CERT", "/etc/Kx9-Secret-Tail/client.pem".to_owned()),
        ("AMQP_CLIENT_KEY", "/etc/Kx9-Secret-Tail/client.key".to_owned()),
        ("KAFKA_PROPERTIES", "sasl.password=Kx9-Secret-Tail".to_owned()),
    ];
    let mut runs = Vec::new();
    for command in [
        &["--help"][..],
        &["status", "--help"],
        &["replay", "--help"],
        &["dead-letters", "requeue", "--help"],
        &["help", "positions", "set"],
    ] {
        runs.push(attempt(env.clone(), args(command), "Kx9-Secret-Tail"));
    }
    let found = leaks(runs).await;
    assert!(found.is_empty(), "--help shows a secret:\n{}", found.join("\n"));
}

/// Kafka client properties with secrets, as `-X` flags and as `KAFKA_PROPERTIES`: a SASL
/// password (against the SASL_SSL listener of `ensure_tansu_tls`, which refuses the login), a
/// TLS key password with a key that does not exist, a password under a mistyped name, a value
/// without `=`. Every run fails; none shows the secret, as text or `--json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_properties_never_show_their_secrets() {
    let db = TestDb::new().await;
    let secret = "Kx9-Secret-Tail";
    let sasl_ssl = std::env::var("KAFKA_SASL_SSL_BROKERS").unwrap_or_else(|_| "127.0.0.1:9098".into());
    let tls_dir = std::env::var("TXINBOX_TLS_DIR").unwrap_or_else(|_| "/var/lib/txinbox/tls".into());
    let ca = format!("ssl.ca.location={tls_dir}/ca.pem");
    let cases: Vec<(&str, Vec<String>)> = vec![
        (
            sasl_ssl.as_str(),
            vec![
                "security.protocol=SASL_SSL".into(),
                "sasl.mechanisms=SCRAM-SHA-512".into(),
                "sasl.username=operator".into(),
                format!("sasl.password={secret}"),
                ca.clone(),
            ],
        ),
        (
            "127.0.0.1:9094",
            vec![
                "security.protocol=SSL".into(),
                ca.clone(),
                "ssl.certificate.location=/nonexistent/client.pem".into(),
                "ssl.key.location=/nonexistent/client.key".into(),
                format!("ssl.key.password={secret}"),
            ],
        ),
        ("127.0.0.1:9094", vec![format!("sasl.pasword={secret}")]),
        ("127.0.0.1:9094", vec![secret.to_owned()]),
    ];
    let mut runs = Vec::new();
    for (brokers, properties) in &cases {
        for json in [false, true] {
            let base = if json {
                args(&["--json", "status"])
            } else {
                args(&["status"])
            };
            let env = vec![
                ("DATABASE_URL", db.url.clone()),
                ("KAFKA_BROKERS", brokers.to_string()),
            ];
            let mut flags = base.clone();
            for p in properties {
                flags.extend(["-X".to_owned(), p.clone()]);
            }
            runs.push(attempt(env.clone(), flags, secret));
            let mut listed = env;
            listed.push(("KAFKA_PROPERTIES", properties.join(",")));
            runs.push(attempt(listed, base, secret));
        }
    }
    let total = runs.len();
    let found = leaks(runs).await;
    assert!(
        found.is_empty(),
        "{} of {total} runs show a secret:\n{}",
        found.len(),
        found.join("\n")
    );
}

/// A pending dead letter from `source` (`kafka` or `rabbitmq`) with a message ID, ready to be
/// requeued; its id.
async fn dead_letter(db: &TestDb, source: &str, destination: &str) -> String {
    let (partition, offset) = if source == "kafka" {
        ("0", "1")
    } else {
        ("NULL", "NULL")
    };
    db.exec(&format!(
        "INSERT INTO txinbox.dead_letters (consumer, message_id, id_strategy, reason, error, attempts,
             payload, headers, source_system, destination, source_partition, source_offset)
         VALUES ('c', 'm-{source}', 'cloudevents', 'permanent_error', 'x', 1, '\\x7b7d', '[]',
             '{source}', '{destination}', {partition}, {offset})"
    ))
    .await;
    db.scalar(&format!(
        "SELECT max(id) FROM txinbox.dead_letters WHERE source_system = '{source}'"
    ))
    .await
    .to_string()
}

/// A password with an unencoded `/`, `?` or `#` is refused before anything connects, with exit
/// code 2 and what to do, instead of being read partly as the host, port or database; a libpq
/// `key=value` string is refused saying to write a URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unencoded_password_is_refused_with_what_to_do() {
    for (url, char) in [
        (
            "postgres://postgres:6543/Kx9-Secret-Tail@127.0.0.1:5432/postgres",
            '/',
        ),
        ("postgres://postgres:Kx9?Secret-Tail@127.0.0.1:5432/postgres", '?'),
        ("postgres://postgres:Kx9#Secret-Tail@127.0.0.1:5432/postgres", '#'),
    ] {
        for json in [false, true] {
            let args: &[&str] = if json { &["--json", "status"] } else { &["status"] };
            let run = txinbox(url, None, args).await;
            assert_eq!(run.code, 2, "{url}: {run:?}");
            let shown = if json {
                run.json()["error"].as_str().unwrap().to_owned()
            } else {
                run.stderr.clone()
            };
            assert!(
                shown.contains(&format!("unencoded `{char}`")) && shown.contains("percent-encode"),
                "{url}: {shown}"
            );
        }
    }
    let run = txinbox(
        "host=127.0.0.1 user=postgres password=Kx9-Secret-Tail dbname=postgres",
        None,
        &["status"],
    )
    .await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("write it as a URL"), "{run:?}");
}

/// Over TLS (issue 27), against a private server that refuses plaintext: a URL whose password
/// and `sslpassword` hold the secret, accepted (migrate, status) and refused (a wrong CA, a
/// wrong host name, plaintext, a missing client key), as text and `--json`: the errors say
/// what to change, never the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_tls_connection_or_refusal_shows_a_secret() {
    use txinbox_testing::cluster::PrivateCluster;
    use txinbox_testing::tls::TestCa;

    let secret = "Kx9-Secret-Tail";
    let ca = TestCa::new("secrets test CA");
    let other = TestCa::new("some other CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let port = cluster.port();
    let root = ca.cert_path().display();
    let server = format!("postgres://postgres:{secret}@127.0.0.1:{port}/postgres");
    let urls = [
        format!("{server}?sslmode=verify-full&sslrootcert={root}&sslpassword={secret}"),
        format!(
            "{server}?sslmode=verify-full&sslrootcert={}&sslpassword={secret}",
            other.cert_path().display()
        ),
        format!(
            "postgres://postgres:{secret}@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={root}&sslpassword={secret}"
        ),
        format!("{server}?sslmode=disable&sslpassword={secret}"),
        format!("{server}?sslmode=verify-full&sslrootcert={root}&sslkey=/keys/{secret}.key"),
    ];
    let mut runs = Vec::new();
    for url in &urls {
        for command in [&["migrate"][..], &["status"][..]] {
            for json in [false, true] {
                let mut a = if json { args(&["--json"]) } else { Vec::new() };
                a.extend(args(command));
                runs.push(attempt(vec![("DATABASE_URL", url.clone())], a, secret));
            }
        }
    }
    let total = runs.len();
    let found = leaks(runs).await;
    assert!(
        found.is_empty(),
        "{} of {total} runs show a secret:\n{}",
        found.len(),
        found.join("\n")
    );
}
