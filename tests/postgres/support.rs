//! Shared test support: a fresh database per test with the deposit ledger's tables
//! (`txinbox_testing`), and a private PostgreSQL cluster that a test may stop and start.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use txinbox::memory::MemoryBroker;
use txinbox::{Consumer, RetryPolicy};

pub use txinbox_testing::database::server_url as admin_url;
use txinbox_testing::database::TestDatabase;
pub use txinbox_testing::ledger::{deposit_in_lane, DepositHandler};

/// A database created for one test, with txinbox migrated and the demo tables created.
pub struct TestDb {
    pub pool: PgPool,
}

impl TestDb {
    pub async fn new(max_connections: u32) -> TestDb {
        let db = TestDatabase::builder("txinbox_t")
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(2))
            .create()
            .await;
        Self::with_tables(db.pool().clone()).await
    }

    pub async fn on(options: PgConnectOptions, max_connections: u32) -> TestDb {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(2))
            .connect_with(txinbox::PostgresInbox::connect_options(options))
            .await
            .expect("connect to the test database");
        txinbox::postgres::migrate(&pool).await.expect("migrate");
        Self::with_tables(pool).await
    }

    async fn with_tables(pool: PgPool) -> TestDb {
        txinbox_testing::ledger::create_tables(&pool).await;
        TestDb { pool }
    }

    pub fn inbox(&self) -> txinbox::PostgresInbox {
        txinbox::PostgresInbox::new(self.pool.clone())
    }

    pub async fn balance(&self, account: &str) -> i64 {
        sqlx::query_scalar("SELECT coalesce((SELECT balance FROM accounts WHERE id = $1), 0)")
            .bind(account)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap()
    }
}

pub fn fast_retries() -> RetryPolicy {
    RetryPolicy::default()
        .initial_delay(Duration::from_millis(5))
        .max_delay(Duration::from_millis(20))
}

/// Runs a consumer on `broker` until the broker is drained (the broker must be closed).
pub async fn drain(name: &str, db: &TestDb, broker: &MemoryBroker, handler: DepositHandler) {
    Consumer::builder(name)
        .source(broker.source())
        .inbox(db.inbox())
        .handler(handler)
        .retry_policy(fast_retries())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
}

/// A private PostgreSQL cluster in a temporary directory, so a test can stop and start the
/// server without disturbing other tests. Uses the server binaries of the machine's PostgreSQL
/// (`TXINBOX_PG_BIN`, else the newest `/usr/lib/postgresql/*/bin`); as root it runs them as the
/// `postgres` user, as PostgreSQL refuses to run as root.
pub struct PrivateCluster {
    dir: PathBuf,
    bin: PathBuf,
    pub port: u16,
}

impl PrivateCluster {
    pub fn start() -> PrivateCluster {
        let bin =
            std::env::var("TXINBOX_PG_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|_| {
                    let mut versions: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
                .expect("PostgreSQL server binaries under /usr/lib/postgresql (scripts/test installs them)")
                .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                .filter(|p| p.join("initdb").exists())
                .collect();
                    versions.sort();
                    versions.pop().expect("an initdb under /usr/lib/postgresql/*/bin")
                });
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let dir = std::env::temp_dir().join(format!("txinbox-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let cluster = PrivateCluster { dir, bin, port };
        cluster.chown();
        cluster.run(
            "initdb",
            &["-D", cluster.data(), "-A", "trust", "-U", "postgres", "--no-sync"],
        );
        cluster.up();
        cluster
    }

    fn data(&self) -> &str {
        self.dir.to_str().unwrap()
    }

    fn is_root() -> bool {
        Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout == b"0\n")
            .unwrap_or(false)
    }

    fn chown(&self) {
        if Self::is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres", self.data()])
                .status();
            assert!(
                ok.map(|s| s.success()).unwrap_or(false),
                "chown the private cluster's directory"
            );
        }
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let path = self.bin.join(tool);
        let mut cmd = if Self::is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&path);
            c
        } else {
            Command::new(&path)
        };
        let out = cmd.args(args).output().expect("run a PostgreSQL server tool");
        assert!(
            out.status.success(),
            "{tool} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts (or restarts) the server and waits until it accepts connections.
    pub fn up(&self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.data()
        );
        let log = format!("{}/server.log", self.data());
        self.run(
            "pg_ctl",
            &["-D", self.data(), "-o", &opts, "-l", &log, "-w", "start"],
        );
    }

    /// Stops the server the hard way, as a crash or a kill would.
    pub fn down(&self) {
        self.run("pg_ctl", &["-D", self.data(), "-m", "immediate", "-w", "stop"]);
    }

    pub fn options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database("postgres")
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.down()));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
