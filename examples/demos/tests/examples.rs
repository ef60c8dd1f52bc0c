//! Every example run as a new user runs it (issue 26, item 10): `--help` answers without doing
//! anything and never shows an environment value; an unknown flag is refused; and no secret a
//! user puts in a flag, an environment variable, a URL's password or query, or a Kafka
//! property reaches the output, at the default log level, with `RUST_LOG=debug` for txinbox's
//! crates, and at `RUST_LOG=trace` (where lapin logs its AMQP frames and sqlx its URL parsing).
//! Everything each run prints is searched in every form (`txinbox_testing::output`).
//!
//! Runs the example binaries `cargo test --workspace` builds (`target/<profile>/examples/`);
//! each is skipped with a message when it is not built (a failure under CI). PostgreSQL at
//! `DATABASE_URL` (scratch databases only) and RabbitMQ at `AMQP_URL`; the services the
//! `--help` runs are given are unreachable, so an example that ignored `--help` fails instead
//! of touching anything.

use std::process::Command;
use std::time::Duration;

use txinbox_testing::cluster::PrivateCluster;
use txinbox_testing::database::TestDatabase;
use txinbox_testing::output::{capture, example, find_secret, Captured};
use txinbox_testing::tls::TestCa;

const SECRET: &str = "Kx9-Secret-Tail";

/// Every example in the workspace a user runs, with the package that builds it.
const EXAMPLES: &[&str] = &[
    "quickstart",
    "ledger",
    "observability",
    "payments_api",
    "kafka_consumer",
    "amqp_consumer",
    "service",
];

/// The log levels a user tries: the example's default, debug for txinbox's own crates (and the
/// example's), and everything at trace.
const LOG_LEVELS: &[Option<&str>] = &[
    None,
    Some("info,txinbox=debug,txinbox_kafka=debug,txinbox_amqp=debug,txinbox_http=debug,ledger=debug,payments_api=debug"),
    Some("trace"),
];

/// Every variable the examples read, each holding the secret, pointing at nothing that listens.
fn secret_environment() -> Vec<(&'static str, String)> {
    vec![
        (
            "DATABASE_URL",
            format!("postgres://app:{SECRET}@127.0.0.1:1/app?sslpassword={SECRET}"),
        ),
        ("AMQP_URL", format!("amqp://app:{SECRET}@127.0.0.1:1/%2f")),
        ("KAFKA_BROKERS", format!("sasl_ssl://app:{SECRET}@127.0.0.1:1")),
        (
            "LEDGER_KAFKA_PROPERTIES",
            format!("sasl.password={SECRET},ssl.key.password={SECRET}"),
        ),
        (
            "KAFKA_PROPERTIES",
            format!("sasl.password={SECRET},ssl.key.password={SECRET}"),
        ),
    ]
}

/// `name` with `args` and `env` (and nothing else from the test's environment that an example
/// reads), in a scratch directory, until it exits or `until` shows or `timeout`.
fn run(
    name: &str,
    args: &[&str],
    env: &[(&str, String)],
    until: Option<&str>,
    timeout: Duration,
) -> Option<Captured> {
    let bin = example(name)?;
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("txinbox-examples-{}-{name}-{run}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = Command::new(bin);
    cmd.args(args).current_dir(&dir);
    for var in [
        "DATABASE_URL",
        "AMQP_URL",
        "KAFKA_BROKERS",
        "RUST_LOG",
        "LEDGER_KAFKA_PROPERTIES",
        "KAFKA_PROPERTIES",
        "LEDGER_SOURCE",
        "AMQP_CA_FILE",
        "AMQP_CLIENT_CERT",
        "AMQP_CLIENT_KEY",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    Some(capture(&mut cmd, until, timeout))
}

#[track_caller]
fn assert_hidden(what: &str, out: &Captured, secret: &str) {
    if let Some(found) = find_secret(&out.all(), secret) {
        panic!(
            "{what} shows the secret: {found}\n--- exit {:?} ---\n{}",
            out.code,
            out.all()
        );
    }
    // Its output goes to a pipe here, as into a file or a log collector: no colour codes.
    assert!(
        !out.all().contains('\u{1b}'),
        "{what} writes terminal escape codes into a pipe:\n{}",
        out.all()
    );
}

/// `--help` (and `-h`) print the usage and exit 0 at once, before touching a service; the
/// environment's values never show. An unknown flag is refused with exit code 2, naming it.
#[test]
fn every_example_answers_help_without_side_effects_and_refuses_unknown_flags() {
    let env = secret_environment();
    for name in EXAMPLES {
        for help in ["--help", "-h"] {
            let Some(out) = run(name, &[help], &env, None, Duration::from_secs(30)) else {
                continue;
            };
            assert!(
                out.code == Some(0) && out.stdout.contains("Usage"),
                "{name} {help}: expected the usage and exit 0, got exit {:?}:\n{}",
                out.code,
                out.all()
            );
            assert_hidden(&format!("{name} {help}"), &out, SECRET);
        }
        // A URL given without its flag: clap echoes the whole argument.
        let stray = format!("postgres://app:{SECRET}@127.0.0.1:1/app");
        for unknown in ["--no-such-flag", stray.as_str()] {
            let Some(out) = run(name, &[unknown], &env, None, Duration::from_secs(30)) else {
                continue;
            };
            assert!(
                out.code == Some(2) && out.stderr.contains(&unknown[..10]),
                "{name} {unknown}: expected a refusal with exit 2, got exit {:?}:\n{}",
                out.code,
                out.all()
            );
            assert_hidden(&format!("{name} {unknown}"), &out, SECRET);
        }
    }
}

/// The ledger's `--kafka-property` keeps a value whole, `,` included, from the flag and from
/// `LEDGER_KAFKA_PROPERTIES`: no piece of it is taken for another property and echoed.
#[test]
fn the_ledger_keeps_a_kafka_property_whole_and_never_echoes_it() {
    let secret = "Kx9-Secret-Tail,Second-Secret-Half";
    let database = (
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:1/nothing".to_owned(),
    );
    let jaas = format!(
        "--kafka-property=sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule \
         required username=\"u\" password=\"{secret}\";"
    );
    let flag = format!("sasl.password={secret}");
    let listed = format!("session.timeout.ms=6000,sasl.password={secret},ssl.key.password={secret}");
    let flag_case = (
        vec!["--source", "kafka", "--kafka-property", &flag],
        vec![database.clone()],
    );
    let jaas_case = (vec!["--source", "kafka", &jaas], vec![database.clone()]);
    // kcat's form: -X KEY=VALUE, a SASL password and a TLS key password.
    let key_password = format!("ssl.key.password={secret}");
    let x_case = (
        vec!["--source", "kafka", "-X", &flag, "-X", &key_password],
        vec![database.clone()],
    );
    let x_joined = format!("-Xsasl.password={secret}");
    let x_joined_case = (vec!["--source", "kafka", &x_joined], vec![database.clone()]);
    let env_case = (
        vec!["--source", "kafka"],
        vec![database.clone(), ("LEDGER_KAFKA_PROPERTIES", listed)],
    );
    for (args, env) in [flag_case, jaas_case, env_case, x_case, x_joined_case] {
        let args = &args[..];
        for level in LOG_LEVELS {
            let mut env = env.clone();
            env.extend(level.map(|l| ("RUST_LOG", l.to_owned())));
            let Some(out) = run("ledger", args, &env, None, Duration::from_secs(60)) else {
                return;
            };
            // It got past its flags to the (unreachable) database.
            assert!(
                out.code == Some(1) && out.all().contains("connecting to PostgreSQL failed"),
                "ledger {args:?} {env:?}: expected the database error, got exit {:?}:\n{}",
                out.code,
                out.all()
            );
            assert_hidden(&format!("ledger {args:?} {env:?}"), &out, secret);
        }
    }
}

/// Secrets in the database URL that sqlx logs while parsing it (`sslpassword`, the rest of a
/// `password` after an unencoded `&`), a password with an unencoded `/`, and an AMQP password
/// that RabbitMQ refuses (lapin logs the frame carrying it at trace): the ledger on a scratch
/// database, at every log level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_never_shows_a_database_or_broker_secret() {
    let db = TestDatabase::builder("examples_t").migrate(false).create().await;
    let server_db = db.url().split('@').nth(1).unwrap().to_owned(); // 127.0.0.1:5432/name
    let amqp = txinbox_amqp_host();
    let urls = [
        format!("postgres://postgres@{server_db}?sslpassword={SECRET}"),
        format!("postgres://postgres@{server_db}?password=Kx9&{SECRET}"),
        format!("postgres://postgres:6543/{SECRET}@{server_db}"),
        format!("postgres://postgres:{SECRET}@127.0.0.1:1/nothing"),
    ];
    for url in &urls {
        for level in LOG_LEVELS {
            let mut env = vec![
                ("DATABASE_URL", url.clone()),
                ("AMQP_URL", format!("amqp://guest:{SECRET}@{amqp}")),
            ];
            env.extend(level.map(|l| ("RUST_LOG", l.to_owned())));
            let out = tokio::task::block_in_place(|| {
                run(
                    "ledger",
                    &["--source", "amqp"],
                    &env,
                    None,
                    Duration::from_secs(60),
                )
            });
            let Some(out) = out else { return };
            // It stopped at the database or at RabbitMQ's refusal, by itself.
            assert!(
                !out.stopped && out.code == Some(1),
                "ledger with {env:?}: expected it to fail and exit, got exit {:?}:\n{}",
                out.code,
                out.all()
            );
            assert_hidden(&format!("ledger with {env:?}"), &out, SECRET);
        }
    }
    db.drop_database().await;
}

/// The ledger over `amqps://` to the TLS-only node (`AMQPS_URL`) with a password RabbitMQ
/// refuses, trusting the test CA (`AMQP_CA_FILE`) or a CA that did not sign the broker's
/// certificate: it exits with the broker's or the TLS refusal, never showing the password, at
/// every log level (lapin logs its frames at trace, rustls its handshake).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_over_tls_never_shows_a_broker_secret() {
    let db = TestDatabase::builder("examples_t").migrate(false).create().await;
    let tls_host = std::env::var("AMQPS_URL")
        .unwrap_or_else(|_| "amqps://guest:guest@127.0.0.1:5671/%2f".into())
        .rsplit_once('@')
        .map(|(_, h)| h.to_owned())
        .expect("AMQPS_URL has user@host");
    let dir = std::env::var("TXINBOX_TLS_DIR").unwrap_or_else(|_| "/var/lib/txinbox/tls".into());
    for ca in ["ca.pem", "other-ca.pem"] {
        let ca = format!("{dir}/{ca}");
        assert!(
            std::path::Path::new(&ca).is_file(),
            "{ca} is missing: run scripts/test's setup (ensure_test_certs and ensure_rabbitmq_tls)"
        );
        for level in LOG_LEVELS {
            let mut env = vec![
                ("DATABASE_URL", db.url().to_owned()),
                ("AMQP_URL", format!("amqps://guest:{SECRET}@{tls_host}")),
                ("AMQP_CA_FILE", ca.clone()),
            ];
            env.extend(level.map(|l| ("RUST_LOG", l.to_owned())));
            let out = tokio::task::block_in_place(|| {
                run(
                    "ledger",
                    &["--source", "amqp"],
                    &env,
                    None,
                    Duration::from_secs(60),
                )
            });
            let Some(out) = out else { return };
            assert!(
                !out.stopped && out.code == Some(1),
                "ledger with {env:?}: expected it to be refused and exit, got exit {:?}:\n{}",
                out.code,
                out.all()
            );
            assert_hidden(&format!("ledger with {env:?}"), &out, SECRET);
        }
    }
    db.drop_database().await;
}

/// `payments_api` with a secret query parameter in `--database-url` (it serves; its startup
/// log is searched) and with `--publish-amqp` naming a password RabbitMQ refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_api_never_shows_a_database_or_broker_secret() {
    let db = TestDatabase::builder("examples_t").migrate(false).create().await;
    let server_db = db.url().split('@').nth(1).unwrap().to_owned();
    let amqp = txinbox_amqp_host();
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    for level in LOG_LEVELS {
        let env: Vec<(&str, String)> = level.map(|l| ("RUST_LOG", l.to_owned())).into_iter().collect();
        let url = format!("postgres://postgres@{server_db}?sslpassword={SECRET}");
        let out = tokio::task::block_in_place(|| {
            run(
                "payments_api",
                &["--listen", &listen, "--database-url", &url],
                &env,
                Some("payments_api listening"),
                Duration::from_secs(60),
            )
        });
        let Some(out) = out else { return };
        assert!(
            out.stopped && out.all().contains("listening"),
            "payments_api did not serve:\n{}",
            out.all()
        );
        assert_hidden(
            &format!("payments_api --database-url {url} {env:?}"),
            &out,
            SECRET,
        );

        let url = format!("postgres://postgres@{server_db}?password=Kx9&{SECRET}");
        let broker = format!("amqp://guest:{SECRET}@{amqp}");
        let out = tokio::task::block_in_place(|| {
            run(
                "payments_api",
                &[
                    "--listen",
                    &listen,
                    "--database-url",
                    &url,
                    "--publish-amqp",
                    &broker,
                ],
                &env,
                Some("payments_api listening"),
                Duration::from_secs(60),
            )
        });
        let Some(out) = out else { return };
        assert!(
            !out.stopped && out.code == Some(1),
            "payments_api --publish-amqp with a refused password: expected it to fail, got exit {:?}:\n{}",
            out.code,
            out.all()
        );
        assert_hidden(
            &format!("payments_api --publish-amqp {broker} {env:?}"),
            &out,
            SECRET,
        );
    }
    db.drop_database().await;
}

/// The adapters' demos and the service with a secret in the database URL (sqlx logs `sslpassword` while
/// parsing) and a broker password: they stop at the unreachable database without showing it.
#[test]
fn the_adapter_demos_never_show_a_secret() {
    // Side by side: a pool waits out its acquire timeout against the unreachable database.
    std::thread::scope(|scope| {
        for name in ["kafka_consumer", "amqp_consumer", "service"] {
            for level in LOG_LEVELS {
                scope.spawn(move || {
                    let mut env = secret_environment();
                    env.extend(level.map(|l| ("RUST_LOG", l.to_owned())));
                    let Some(out) = run(name, &[], &env, None, Duration::from_secs(90)) else {
                        return;
                    };
                    assert!(
                        !out.stopped && out.code != Some(0),
                        "{name}: expected it to fail at the unreachable database, got exit {:?}:\n{}",
                        out.code,
                        out.all()
                    );
                    assert_hidden(&format!("{name} {env:?}"), &out, SECRET);
                });
            }
        }
    });
}

/// A `-X` value that is not `KEY=VALUE` is refused with exit 2, without being shown (it may be
/// a password pasted without its name), by the ledger and by the Kafka adapter's demo.
#[test]
fn a_malformed_x_property_is_refused_without_its_value() {
    for name in ["ledger", "kafka_consumer"] {
        let Some(out) = run(name, &["-X", SECRET], &[], None, Duration::from_secs(30)) else {
            continue;
        };
        assert!(
            out.code == Some(2) && out.stderr.contains("KEY=VALUE"),
            "{name} -X {SECRET}: expected a refusal with exit 2, got exit {:?}:\n{}",
            out.code,
            out.all()
        );
        assert_hidden(&format!("{name} -X"), &out, SECRET);
    }
}

/// The ledger on Kafka over SASL_SSL with its password as `-X sasl.password=…`, against the
/// SASL listener of `ensure_tansu_tls` (which refuses the login), at every log level: the
/// refusal is reported (what to change, librdkafka's words), the password never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_over_sasl_ssl_never_shows_the_password() {
    let brokers = std::env::var("KAFKA_SASL_SSL_BROKERS").unwrap_or_else(|_| "127.0.0.1:9098".into());
    let tls_dir = std::env::var("TXINBOX_TLS_DIR").unwrap_or_else(|_| "/var/lib/txinbox/tls".into());
    let ca = format!("ssl.ca.location={tls_dir}/ca.pem");
    assert!(
        std::path::Path::new(&tls_dir).join("ca.pem").is_file(),
        "{tls_dir}/ca.pem is missing: run ensure_test_certs and ensure_tansu_tls (scripts/lib/tls.sh, scripts/lib/tansu.sh)"
    );
    let db = TestDatabase::builder("examples_t").migrate(false).create().await;
    let password = format!("sasl.password={SECRET}");
    for level in LOG_LEVELS {
        let mut env = vec![("DATABASE_URL", db.url().to_owned())];
        env.extend(level.map(|l| ("RUST_LOG", l.to_owned())));
        let args = [
            "--source",
            "kafka",
            "--brokers",
            &brokers,
            "-X",
            "security.protocol=SASL_SSL",
            "-X",
            &ca,
            "-X",
            "sasl.mechanisms=SCRAM-SHA-512",
            "-X",
            "sasl.username=ledger",
            "-X",
            &password,
        ];
        let out = tokio::task::block_in_place(|| {
            run(
                "ledger",
                &args,
                &env,
                Some("SASL authentication failed"),
                Duration::from_secs(60),
            )
        });
        let Some(out) = out else { return };
        assert!(
            out.stopped && out.all().contains("SASL authentication failed"),
            "ledger over SASL_SSL ({level:?}): expected the refused login to be reported:\n{}",
            out.all()
        );
        assert_hidden(&format!("ledger over SASL_SSL ({level:?})"), &out, SECRET);
    }
    db.drop_database().await;
}

/// `host:port/vhost` of the test RabbitMQ (`AMQP_URL`, default the local broker).
fn txinbox_amqp_host() -> String {
    let url = std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    url.rsplit_once('@').map(|(_, h)| h.to_owned()).unwrap_or(url)
}

/// The URLs of the three refusals a user meets against `cluster`, a TLS-only server (issue 27),
/// each with what its error must say: a certificate from a CA the client was not given
/// (`other`), a host name the certificate does not name, and plaintext. Each carries
/// [`SECRET`] as its password and `sslpassword` (the server trusts: neither is checked).
fn tls_refusals(cluster: &PrivateCluster, ca: &TestCa, other: &TestCa) -> Vec<(String, &'static str)> {
    let port = cluster.port();
    let user = format!("postgres:{SECRET}");
    vec![
        (
            format!(
                "postgres://{user}@127.0.0.1:{port}/postgres?sslmode=verify-full&sslrootcert={}&sslpassword={SECRET}",
                other.cert_path().display()
            ),
            "set sslrootcert",
        ),
        (
            format!(
                "postgres://{user}@localhost:{port}/postgres?sslmode=verify-full&sslrootcert={}&sslpassword={SECRET}",
                ca.cert_path().display()
            ),
            "not valid for host localhost",
        ),
        (
            format!("postgres://{user}@127.0.0.1:{port}/postgres?sslmode=disable&sslpassword={SECRET}"),
            "accepts TLS connections only",
        ),
    ]
}

/// `cluster`'s TLS URL with [`SECRET`] as the password and as `sslpassword` (which sqlx
/// ignores, and logs while parsing): accepted, as the server trusts every TLS connection.
fn tls_url_with_secrets(cluster: &PrivateCluster) -> String {
    cluster
        .url("postgres")
        .replacen("postgres@", &format!("postgres:{SECRET}@"), 1)
        + &format!("&sslpassword={SECRET}")
}

/// Runs example `name` with `args` and then `url`, at `RUST_LOG=trace`: what it printed, or
/// `None` when it is not built. Its output must not show [`SECRET`].
fn run_with_url(name: &str, args: &[&str], url: &str, timeout: Duration) -> Option<Captured> {
    let args: Vec<&str> = args.iter().copied().chain([url]).collect();
    let out = run(name, &args, &[("RUST_LOG", "trace".to_owned())], None, timeout)?;
    assert_hidden(&format!("{name} {url}"), &out, SECRET);
    Some(out)
}

/// `name` (run with `args` then a database URL) over TLS against a private server that refuses
/// plaintext (issue 27): with `sslmode=verify-full` and the server's CA it succeeds and prints
/// `done`; with a wrong CA, a wrong host name or plaintext it exits 1 saying what to change.
/// No run shows the URL's password or `sslpassword`, at `RUST_LOG=trace` either.
fn runs_over_tls(name: &str, args: &[&str], done: &str) {
    let ca = TestCa::new("examples test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let Some(out) = run_with_url(
        name,
        args,
        &tls_url_with_secrets(&cluster),
        Duration::from_secs(300),
    ) else {
        return;
    };
    assert!(
        out.code == Some(0) && out.stdout.contains(done),
        "{name} over TLS: exit {:?}:\n{}",
        out.code,
        out.all()
    );
    let other = TestCa::new("some other CA");
    for (url, says) in tls_refusals(&cluster, &ca, &other) {
        let out = run_with_url(name, args, &url, Duration::from_secs(60)).unwrap();
        assert!(
            out.code == Some(1) && out.stderr.contains(says),
            "{name} {url}: expected exit 1 saying {says:?}, got exit {:?}:\n{}",
            out.code,
            out.all()
        );
    }
}

/// The quickstart on PostgreSQL over TLS: [`runs_over_tls`], to its report.
#[test]
fn the_quickstart_runs_on_postgres_over_tls() {
    runs_over_tls("quickstart", &["--database-url"], "PostgreSQL");
}

/// `payments_api` on PostgreSQL over TLS: [`runs_over_tls`], its `--bench` (POST /payments
/// through the Idempotency-Key layer, committed in the database) to its table.
#[test]
fn payments_api_runs_on_postgres_over_tls() {
    runs_over_tls(
        "payments_api",
        &[
            "--bench",
            "--requests",
            "20",
            "--rounds",
            "1",
            "--concurrency",
            "2",
            "--database-url",
        ],
        "with layer, new keys",
    );
}
