//! PostgreSQL over TLS (issue 27): against a private cluster that speaks TLS only
//! (`txinbox_testing::cluster::PrivateCluster::start_tls`, `hostssl`-only `pg_hba.conf`, a
//! server certificate for 127.0.0.1 from a CA made by the test), every `sslmode` a managed
//! database is used with, and every refusal with the error a user sees: what went wrong and
//! what to change. A refusal is a configuration error (fatal), never an outage that intake
//! would wait out forever.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::ConnectOptions as _;
use txinbox::memory::MemoryBroker;
use txinbox::store::{is_unavailable, tls_refusal};
use txinbox::{Consumer, PostgresInbox};
use txinbox_testing::tls::TestCa;

use super::support::{deposit_in_lane, drain, DepositHandler, PrivateCluster, TestDb};

/// `sslmode` and the rest, for the `postgres` database of `cluster`, by URL.
fn url(cluster: &PrivateCluster, host: &str, query: &str) -> String {
    format!("postgres://postgres@{host}:{}/postgres?{query}", cluster.port())
}

/// Whether the session behind `pool` is encrypted, as the server sees it.
async fn encrypted(pool: &sqlx::PgPool) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The error `PostgresInbox::connect` gives for `url`, and the driver's own for the same URL.
async fn refused(url: &str) -> (txinbox::store::StoreError, sqlx::Error) {
    let store = PostgresInbox::connect(url, 2)
        .await
        .expect_err(&format!("{url} must be refused"));
    let options: PgConnectOptions = url.parse().unwrap();
    let driver = options.connect().await.expect_err("refused by the driver too");
    (store, driver)
}

/// `verify-full` with the right CA: the consumer runs its messages over an encrypted session,
/// effects and inbox committed. A TLS server that stops is an outage (unavailable), as a plain
/// one: only a refusal of the certificate is a configuration error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_right_ca_consumes_over_tls() {
    let ca = TestCa::new("txinbox test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let inbox = PostgresInbox::connect(&cluster.url("postgres"), 4)
        .await
        .expect("verify-full with the cluster's CA connects");
    assert!(encrypted(inbox.pool()).await);

    let db = TestDb::on(cluster.options(), 8).await;
    assert!(encrypted(&db.pool).await);
    let broker = MemoryBroker::new("payments");
    for i in 0..20u64 {
        broker.publish(format!("evt-{i}"), deposit_in_lane("alice", 5, "-", i));
    }
    broker.close();
    drain("tls-consumer", &db, &broker, DepositHandler::default()).await;
    assert_eq!(db.balance("alice").await, 100);
    assert_eq!(
        db.scalar("SELECT count(*) FROM txinbox.inbox WHERE consumer = 'tls-consumer'")
            .await,
        20
    );

    cluster.down();
    let gone = cluster.options().connect().await.expect_err("the server is down");
    assert!(is_unavailable(&gone), "a stopped TLS server is an outage: {gone}");
    assert!(tls_refusal(&gone).is_none(), "{gone}");
}

/// A certificate from another CA, under `verify-full` and `verify-ca`: refused, the error says
/// the CA is unknown and to set `sslrootcert`; fatal, not "unavailable (will retry)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_is_refused_saying_to_set_sslrootcert() {
    let ca = TestCa::new("txinbox test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let other = TestCa::new("some other CA");
    for mode in ["verify-full", "verify-ca"] {
        let (store, driver) = refused(&url(
            &cluster,
            "127.0.0.1",
            &format!("sslmode={mode}&sslrootcert={}", other.cert_path().display()),
        ))
        .await;
        let shown = store.to_string();
        assert!(
            shown.contains("unknown CA") && shown.contains("set sslrootcert"),
            "{mode}: {shown}"
        );
        assert!(
            !store.is_transient(),
            "{mode}: a wrong CA is not retried: {shown}"
        );
        assert!(!is_unavailable(&driver), "{mode}: not an outage: {driver}");
    }
}

/// `verify-full` to a host name the certificate does not name (`localhost`; it names
/// 127.0.0.1): refused, naming the host and what the certificate names. `verify-ca` checks the
/// CA only and connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_host_is_refused_naming_it() {
    let ca = TestCa::new("txinbox test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let root = ca.cert_path().display().to_string();
    let (store, driver) = refused(&url(
        &cluster,
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={root}"),
    ))
    .await;
    let shown = store.to_string();
    assert!(
        shown.contains("not valid for host localhost (it names 127.0.0.1)"),
        "{shown}"
    );
    assert!(!store.is_transient(), "{shown}");
    assert!(!is_unavailable(&driver), "{driver}");

    let inbox = PostgresInbox::connect(
        &url(
            &cluster,
            "localhost",
            &format!("sslmode=verify-ca&sslrootcert={root}"),
        ),
        2,
    )
    .await
    .expect("verify-ca does not check the name");
    assert!(encrypted(inbox.pool()).await);
}

/// Plaintext (`sslmode=disable`) to the TLS-only server: refused by its `pg_hba.conf`, and the
/// error says the server wants TLS and which parameters to add.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_to_a_tls_only_server_is_refused_saying_to_use_tls() {
    let ca = TestCa::new("txinbox test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let (store, driver) = refused(&url(&cluster, "127.0.0.1", "sslmode=disable")).await;
    let shown = store.to_string();
    assert!(
        shown.contains("accepts TLS connections only") && shown.contains("sslmode=verify-full"),
        "{shown}"
    );
    assert!(!store.is_transient(), "{shown}");
    assert!(!is_unavailable(&driver), "{driver}");
}

/// `sslmode=require` without any CA encrypts (and does not verify), as with libpq; so does a URL
/// without `sslmode` (`prefer`) when the server offers TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_encrypts_without_a_ca() {
    let ca = TestCa::new("txinbox test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    for query in ["sslmode=require", ""] {
        let inbox = PostgresInbox::connect(&url(&cluster, "127.0.0.1", query), 2)
            .await
            .unwrap_or_else(|e| panic!("{query:?}: {e}"));
        assert!(encrypted(inbox.pool()).await, "{query:?}");
    }
}

/// A certificate or key file that is not there: refused before connecting, naming the
/// parameter (and the path, except a key's), not reported as an outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_certificate_file_is_named() {
    let ca = TestCa::new("txinbox test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let root = ca.cert_path().display().to_string();
    let missing = ca.dir().join("no-such.pem").display().to_string();
    for (query, says) in [
        (
            format!("sslmode=verify-full&sslrootcert={missing}"),
            format!("sslrootcert {missing} cannot be read"),
        ),
        (
            format!("sslmode=verify-full&sslrootcert={root}&sslcert={missing}&sslkey={missing}"),
            format!("sslcert {missing} cannot be read"),
        ),
        (
            format!("sslmode=verify-full&sslrootcert={root}&sslkey={missing}"),
            "sslkey cannot be read".to_owned(),
        ),
    ] {
        let e = PostgresInbox::connect(&url(&cluster, "127.0.0.1", &query), 2)
            .await
            .expect_err(&query);
        assert!(e.to_string().contains(&says) && !e.is_transient(), "{query}: {e}");
    }
}

/// `sslmode=require` to a server without TLS: refused, saying so, not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_to_a_server_without_tls_is_refused_saying_so() {
    let cluster = PrivateCluster::start();
    let (store, driver) = refused(&url(&cluster, "127.0.0.1", "sslmode=require")).await;
    let shown = store.to_string();
    assert!(shown.contains("does not accept TLS connections"), "{shown}");
    assert!(!store.is_transient(), "{shown}");
    assert!(!is_unavailable(&driver), "{driver}");
}

/// Client-certificate authentication (`hostssl … cert`): a certificate from the server's CA
/// whose common name is the role logs in; a certificate without its key, none, one for another
/// role, or one from another CA is refused, each with what to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_in_where_the_server_requires_one() {
    let ca = TestCa::new("txinbox test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let admin = PgPoolOptions::new()
        .connect_with(cluster.options())
        .await
        .unwrap();
    for sql in [
        format!("CREATE ROLE {} NOLOGIN", PrivateCluster::CERT_AUTH_ROLE),
        format!(
            "CREATE ROLE tls_app LOGIN IN ROLE {}",
            PrivateCluster::CERT_AUTH_ROLE
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&admin)
            .await
            .unwrap();
    }
    let root = ca.cert_path().display().to_string();
    let as_app = |query: String| {
        format!(
            "postgres://tls_app@127.0.0.1:{}/postgres?sslmode=verify-full&sslrootcert={root}{query}",
            cluster.port()
        )
    };

    let mine = ca.client("tls_app");
    let inbox = PostgresInbox::connect(
        &as_app(format!(
            "&sslcert={}&sslkey={}",
            mine.cert.display(),
            mine.key.display()
        )),
        2,
    )
    .await
    .expect("the role's certificate logs in");
    let user: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(inbox.pool())
        .await
        .unwrap();
    assert_eq!(user, "tls_app");

    let (half, _) = refused(&as_app(format!("&sslcert={}", mine.cert.display()))).await;
    assert!(
        half.to_string().contains("give sslcert and sslkey together"),
        "{half}"
    );

    let (none, _) = refused(&as_app(String::new())).await;
    assert!(none.to_string().contains("set sslcert and sslkey"), "{none}");

    let someone_else = ca.client("postgres");
    let (other_role, _) = refused(&as_app(format!(
        "&sslcert={}&sslkey={}",
        someone_else.cert.display(),
        someone_else.key.display()
    )))
    .await;
    assert!(other_role.to_string().contains("common name"), "{other_role}");

    let stranger_ca = TestCa::new("some other CA");
    let stranger = stranger_ca.client("tls_app");
    let (untrusted, driver) = refused(&as_app(format!(
        "&sslcert={}&sslkey={}",
        stranger.cert.display(),
        stranger.key.display()
    )))
    .await;
    assert!(
        untrusted.to_string().contains("refused the TLS handshake")
            && untrusted.to_string().contains("sslcert"),
        "{untrusted}"
    );
    for e in [&half, &none, &other_role, &untrusted] {
        assert!(!e.is_transient(), "{e}");
    }
    assert!(!is_unavailable(&driver), "{driver}");
    admin.close().await;
}

/// A consumer whose pool meets an untrusted certificate (a lazy pool: the first connection is
/// made by the consumer) stops with the refusal instead of pausing intake forever as for an
/// outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_stops_on_a_refused_certificate_instead_of_waiting() {
    let ca = TestCa::new("txinbox test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let other = TestCa::new("some other CA");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(
            cluster
                .options()
                .ssl_mode(PgSslMode::VerifyFull)
                .ssl_root_cert(other.cert_path()),
        );
    let broker = MemoryBroker::new("payments");
    broker.publish("evt-1", deposit_in_lane("alice", 1, "-", 1));
    let consumer = Consumer::builder("tls-refused")
        .source(broker.source())
        .inbox(PostgresInbox::new(pool))
        .handler(DepositHandler::default())
        .concurrency(1)
        .build()
        .unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(30), consumer.run())
        .await
        .expect("the consumer stops on its own, it does not wait for the certificate to change");
    let e = outcome.expect_err("a refused certificate stops the consumer");
    assert!(e.to_string().contains("unknown CA"), "{e}");
}

/// A service's configuration file (issue 27, item 5): the database over TLS with the CA given
/// as a field beside the URL, the consumer's settings with durations in units, read from TOML;
/// the consumer built from them runs its messages over the encrypted connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_from_toml_connect_over_tls_and_run_a_consumer() {
    use txinbox::settings::{ConsumerSettings, DatabaseSettings};

    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Service {
        database: DatabaseSettings,
        consumer: ConsumerSettings,
    }

    let ca = TestCa::new("txinbox test CA");
    let cluster = PrivateCluster::start_tls(&ca);
    let text = format!(
        r#"
        [database]
        url = "postgres://postgres@127.0.0.1:{port}/postgres"
        ssl_mode = "verify-full"
        ssl_root_cert = "{root}"
        max_connections = 4

        [consumer]
        concurrency = 2
        batch_size = 10
        batch_linger = "2ms"
        retry = {{ max_attempts = 3, initial_delay = "5ms", max_delay = "20ms" }}
        "#,
        port = cluster.port(),
        root = ca.cert_path().display()
    );
    let service: Service = toml::from_str(&text).unwrap();
    let inbox = service.database.connect().await.expect("connects over TLS");
    assert!(encrypted(inbox.pool()).await);
    txinbox::postgres::migrate(inbox.pool()).await.unwrap();
    txinbox_testing::ledger::create_tables(inbox.pool()).await;

    let broker = MemoryBroker::new("payments");
    for i in 0..10u64 {
        broker.publish(format!("evt-{i}"), deposit_in_lane("bob", 3, "-", i));
    }
    broker.close();
    Consumer::builder("tls-settings")
        .settings(&service.consumer)
        .source(broker.source())
        .inbox(inbox.clone())
        .handler(DepositHandler::default())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = 'bob'")
        .fetch_one(inbox.pool())
        .await
        .unwrap();
    assert_eq!(balance, 30);

    // The same file with a wrong CA: refused at connect, saying so.
    let other = TestCa::new("some other CA");
    let wrong: Service = toml::from_str(&text.replace(
        &ca.cert_path().display().to_string(),
        &other.cert_path().display().to_string(),
    ))
    .unwrap();
    let e = wrong.database.connect().await.expect_err("another CA");
    assert!(e.to_string().contains("unknown CA") && !e.is_transient(), "{e}");
}
