//! Shared test support: a fresh database per test, a deposit handler with programmable
//! failures, and a private PostgreSQL cluster that a test may stop and start.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Executor, Postgres};
use txinbox::{async_trait, Context, Handler, HandlerError, Message};

pub fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database created for one test, with txinbox migrated and the demo tables created.
pub struct TestDb {
    pub pool: PgPool,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);
static CLEANED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

impl TestDb {
    pub async fn new(max_connections: u32) -> TestDb {
        let admin: PgConnectOptions = admin_url().parse().expect("DATABASE_URL parses");
        let name = format!(
            "txinbox_t_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let mut conn = admin
            .connect()
            .await
            .expect("connect to DATABASE_URL (is PostgreSQL running? scripts/test starts it)");
        CLEANED
            .get_or_init(|| async {
                // Databases left by earlier runs (a failed test does not drop its own). Only those
                // nobody is connected to: another test process may be using its own right now.
                let stale: Vec<String> = sqlx::query_scalar(
                    "SELECT datname FROM pg_database d WHERE datname LIKE 'txinbox\\_t\\_%'
                       AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)",
                )
                .fetch_all(&mut admin.connect().await.unwrap())
                .await
                .unwrap();
                let mut c = admin.connect().await.unwrap();
                for db in stale {
                    let _ = c
                        .execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {db}")))
                        .await;
                }
            })
            .await;
        conn.execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .await
        .unwrap();
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
        Self::on(admin.database(&name), max_connections).await
    }

    pub async fn on(options: PgConnectOptions, max_connections: u32) -> TestDb {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(2))
            .connect_with(txinbox::PostgresInbox::connect_options(options))
            .await
            .expect("connect to the test database");
        txinbox::postgres::migrate(&pool).await.expect("migrate");
        pool.execute(
            "CREATE TABLE accounts (id text PRIMARY KEY, balance bigint NOT NULL);
             CREATE TABLE effects (seq bigserial PRIMARY KEY, message_id text NOT NULL,
                                   lane text, idx bigint, amount bigint NOT NULL);",
        )
        .await
        .unwrap();
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

/// A deposit event as the tests publish it.
pub fn deposit(account: &str, amount: i64, lane: &str, idx: u64) -> String {
    format!(r#"{{"account":"{account}","amount":{amount},"lane":"{lane}","idx":{idx}}}"#)
}

#[derive(serde::Deserialize)]
struct Deposit {
    account: String,
    amount: i64,
    lane: String,
    idx: i64,
}

type FailFn = dyn Fn(&Message, u32) -> Option<HandlerError> + Send + Sync;

/// A non-idempotent handler: `balance += amount`, plus one `effects` row per application.
#[derive(Clone)]
pub struct DepositHandler {
    pub calls: Arc<AtomicUsize>,
    fail: Arc<FailFn>,
    hold: Duration,
    /// Per message ID: how many times the handler started on it.
    pub starts: Arc<Mutex<HashMap<String, u32>>>,
    pub entered: Arc<tokio::sync::Notify>,
    block_forever: bool,
}

impl Default for DepositHandler {
    fn default() -> Self {
        DepositHandler {
            calls: Arc::default(),
            fail: Arc::new(|_, _| None),
            hold: Duration::ZERO,
            starts: Arc::default(),
            entered: Arc::default(),
            block_forever: false,
        }
    }
}

impl DepositHandler {
    /// Fails with whatever `f(message, attempt)` returns.
    pub fn failing(f: impl Fn(&Message, u32) -> Option<HandlerError> + Send + Sync + 'static) -> Self {
        DepositHandler {
            fail: Arc::new(f),
            ..Default::default()
        }
    }

    /// Keeps the transaction open this long after writing the effect.
    pub fn holding(mut self, d: Duration) -> Self {
        self.hold = d;
        self
    }

    /// Writes the effect, signals `entered`, then never returns (a crash is simulated by
    /// dropping the consumer).
    pub fn blocking_forever(mut self) -> Self {
        self.block_forever = true;
        self
    }

    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Handler<Postgres> for DepositHandler {
    async fn handle(&self, cx: &mut Context<'_, Postgres>, msg: &Message) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        *self
            .starts
            .lock()
            .unwrap()
            .entry(cx.message_id().to_string())
            .or_default() += 1;
        if let Some(e) = (self.fail)(msg, cx.attempt()) {
            return Err(e);
        }
        let d: Deposit = msg.json()?;
        sqlx::query(
            "INSERT INTO accounts (id, balance) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
        )
        .bind(&d.account)
        .bind(d.amount)
        .execute(cx.db())
        .await?;
        sqlx::query("INSERT INTO effects (message_id, lane, idx, amount) VALUES ($1, $2, $3, $4)")
            .bind(cx.message_id().as_str())
            .bind(&d.lane)
            .bind(d.idx)
            .bind(d.amount)
            .execute(cx.db())
            .await?;
        if self.block_forever {
            self.entered.notify_one();
            std::future::pending::<()>().await;
        }
        if !self.hold.is_zero() {
            tokio::time::sleep(self.hold).await;
        }
        Ok(())
    }
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
