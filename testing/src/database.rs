//! Scratch PostgreSQL databases for tests.
//!
//! Each test gets a database of its own on the server at `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`), with txinbox migrated into it, the way
//! `#[sqlx::test]` gives each test a fresh database:
//!
//! ```no_run
//! # async fn example() {
//! use txinbox_testing::database::TestDatabase;
//!
//! let db = TestDatabase::new("myapp_t").await;
//! let inbox = txinbox::PostgresInbox::new(db.pool().clone());
//! // ... run the consumer, assert on db.pool() ...
//! db.drop_database().await; // optional: a later run drops what a failed test left
//! # let _ = inbox;
//! # }
//! ```
//!
//! [`TestDatabase::builder`] sets the pool size, the acquire timeout, and whether to migrate.
//!
//! A failing test keeps its database for inspection, for an hour at least. The first database a
//! test process creates first drops the scratch databases of earlier runs, and only those that
//! are certainly unused: made more than an hour ago by a process of this machine that is no
//! longer running, and with nobody connected to them. Test processes that run side by side, on
//! this machine or elsewhere, never lose theirs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use txinbox::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use txinbox::sqlx::{self, ConnectOptions, Executor};

/// The server the scratch databases are created on: `DATABASE_URL`, or
/// `postgres://postgres@127.0.0.1:5432/postgres` when it is not set. The user needs the
/// `CREATEDB` privilege.
pub fn server_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn server_options() -> PgConnectOptions {
    server_url()
        .parse()
        .unwrap_or_else(|e| panic!("DATABASE_URL is not a PostgreSQL URL ({e}): {}", server_url()))
}

/// A database created for one test. Dropping the value leaves the database in place (see
/// [`drop_database`](Self::drop_database)).
#[derive(Debug)]
pub struct TestDatabase {
    pool: PgPool,
    name: String,
    url: String,
}

impl TestDatabase {
    /// A migrated database named `<prefix>_<process>_<n>`, with the [`Builder`]'s defaults.
    pub async fn new(prefix: &str) -> TestDatabase {
        Self::builder(prefix).create().await
    }

    /// Settings for a database whose name starts with `prefix` (lowercase letters, digits
    /// and `_`, so that it is a plain SQL identifier).
    pub fn builder(prefix: &str) -> Builder {
        assert!(
            !prefix.is_empty()
                && prefix
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "a scratch database prefix is lowercase letters, digits and `_`: {prefix:?}"
        );
        Builder {
            prefix: prefix.to_owned(),
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            migrate: true,
            inbox_timeouts: true,
        }
    }

    /// A pool on the database.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The database's name, e.g. to hand it to a child process that [opens](Builder::open) it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A URL of the database: `DATABASE_URL` with the database name replaced, e.g. for a
    /// program under test that takes a `--database-url`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Makes the database refuse new connections (`ALTER DATABASE … ALLOW_CONNECTIONS false`,
    /// SQLSTATE 55000 for whoever connects) and ends every session on it, as an operator taking
    /// it offline would. The test's own pool is left to find that out. Undo it with
    /// [`allow_connections`](Self::allow_connections).
    pub async fn refuse_connections(&self) {
        let mut server = connect_server().await;
        server
            .execute(sqlx::AssertSqlSafe(format!(
                "ALTER DATABASE {} ALLOW_CONNECTIONS false",
                self.name
            )))
            .await
            .unwrap_or_else(|e| panic!("make {} refuse connections: {e}", self.name));
        terminate(&mut server, &self.name).await;
    }

    /// Lets the database take connections again after
    /// [`refuse_connections`](Self::refuse_connections).
    pub async fn allow_connections(&self) {
        let mut server = connect_server().await;
        server
            .execute(sqlx::AssertSqlSafe(format!(
                "ALTER DATABASE {} ALLOW_CONNECTIONS true",
                self.name
            )))
            .await
            .unwrap_or_else(|e| panic!("let {} take connections again: {e}", self.name));
    }

    /// Ends every session on the database (`pg_terminate_backend`, SQLSTATE 57P01 for each of
    /// them), as a failover or an operator would; new connections are still accepted. Returns
    /// how many sessions were ended.
    pub async fn terminate_sessions(&self) -> usize {
        terminate(&mut connect_server().await, &self.name).await
    }

    /// Closes the pool and drops the database, disconnecting anyone still connected. Call it at
    /// the end of a test that passed; a failed test's database stays for inspection.
    pub async fn drop_database(self) {
        self.pool.close().await;
        let mut server = connect_server().await;
        server
            .execute(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            )))
            .await
            .unwrap_or_else(|e| panic!("drop the scratch database {}: {e}", self.name));
    }
}

/// How to create a [`TestDatabase`]: [`TestDatabase::builder`], then [`create`](Self::create).
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `create` or `open`"]
pub struct Builder {
    prefix: String,
    max_connections: u32,
    acquire_timeout: Duration,
    migrate: bool,
    inbox_timeouts: bool,
}

impl Builder {
    /// The pool's size (default 10).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// How long the pool waits for a free connection before an error (default 5 s).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Whether to run `txinbox::postgres::migrate` on the new database (default `true`). Tests of the
    /// migrations themselves turn it off.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Whether the pool's connections get the session timeouts of
    /// `txinbox::PostgresInbox::connect_options` (default `true`), as an application's inbox
    /// pool does. Turn it off to test code that must work on a pool without them.
    pub fn inbox_timeouts(mut self, on: bool) -> Self {
        self.inbox_timeouts = on;
        self
    }

    /// Creates the database (after dropping the unused ones of earlier runs, once per
    /// process), connects a pool and migrates it.
    ///
    /// # Panics
    ///
    /// When the server at [`server_url`] cannot be reached or refuses to create a database:
    /// a test cannot run without it.
    pub async fn create(self) -> TestDatabase {
        static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let mut server = connect_server().await;
        SWEPT.get_or_init(|| sweep(&mut server)).await;
        let name = format!(
            "{}_{}_{}",
            self.prefix,
            process_tag(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        server
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap_or_else(|e| {
                panic!("create the scratch database {name} (does the DATABASE_URL user have CREATEDB?): {e}")
            });
        server
            .execute(sqlx::AssertSqlSafe(format!(
                "COMMENT ON DATABASE {name} IS '{MARK}{}'",
                owner()
            )))
            .await
            .unwrap_or_else(|e| panic!("mark {name} as a scratch database: {e}"));
        let db = self.open(&name).await;
        if self.migrate {
            txinbox::postgres::migrate(&db.pool)
                .await
                .unwrap_or_else(|e| panic!("migrate the scratch database {name}: {e}"));
        }
        db
    }

    /// Connects to a database that [`create`](Self::create) made, e.g. in the parent of a test
    /// that runs itself as a child process: a pool with these settings, no migration.
    pub async fn open(&self, name: &str) -> TestDatabase {
        let mut options = server_options().database(name);
        if self.inbox_timeouts {
            options = txinbox::PostgresInbox::connect_options(options);
        }
        let pool = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .connect_with(options)
            .await
            .unwrap_or_else(|e| panic!("connect to the scratch database {name}: {e}"));
        TestDatabase {
            pool,
            name: name.to_owned(),
            url: url_of(&server_url(), name),
        }
    }
}

/// Ends every session on database `name` but the caller's; returns how many.
async fn terminate(server: &mut sqlx::PgConnection, name: &str) -> usize {
    let ended: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(name)
    .fetch_all(&mut *server)
    .await
    .unwrap_or_else(|e| panic!("end the sessions on {name}: {e}"));
    ended.into_iter().filter(|ended| *ended).count()
}

async fn connect_server() -> sqlx::PgConnection {
    server_options().connect().await.unwrap_or_else(|e| {
        panic!(
            "connect to the PostgreSQL server at DATABASE_URL ({}): {e}; is it running?",
            server_url()
        )
    })
}

/// Starts the comment that marks a scratch database, followed by [`owner`].
const MARK: &str = "txinbox-testing scratch database of ";

/// `host:pid@created` (Unix seconds) of this process.
fn owner() -> String {
    format!("{}:{}@{}", host(), std::process::id(), unix_seconds())
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// How old a scratch database must be before a later run may drop it. Host name and pid alone
/// cannot prove a process gone: containers that share a host name but not a pid namespace,
/// `/proc` mounted with `hidepid`, or hosts without a readable host name would all see a
/// running test's process as gone. Nothing runs a single test this long.
const SWEEP_AFTER: Duration = Duration::from_secs(60 * 60);

fn host() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map(|h| h.trim().replace('\'', ""))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// `<pid>_<start in ms, base 36>`: unique to this process, even when a pid is reused.
fn process_tag() -> &'static str {
    static TAG: OnceLock<String> = OnceLock::new();
    TAG.get_or_init(|| {
        let mut ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let mut stamp = Vec::new();
        while ms > 0 {
            stamp.push(char::from_digit((ms % 36) as u32, 36).unwrap());
            ms /= 36;
        }
        let stamp: String = stamp.into_iter().rev().collect();
        format!("{}_{stamp}", std::process::id())
    })
}

/// Whether process `pid` of this machine is running. When that cannot be told, it is.
fn running(pid: u32) -> bool {
    if std::path::Path::new("/proc/self").exists() {
        return std::path::Path::new(&format!("/proc/{pid}")).exists();
    }
    std::process::Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status()
        .map_or(true, |s| s.success())
}

/// Drops the scratch databases of earlier runs: those made at least [`SWEEP_AFTER`] ago by a
/// process of this machine that is no longer running, with nobody connected to them. `DROP DATABASE` without `FORCE` fails if
/// someone connects meanwhile, and that database stays.
async fn sweep(server: &mut sqlx::PgConnection) {
    let marked: Vec<(String, String)> = sqlx::query_as(
        "SELECT d.datname, shobj_description(d.oid, 'pg_database') FROM pg_database d
          WHERE shobj_description(d.oid, 'pg_database') LIKE $1 || '%'
            AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)",
    )
    .bind(MARK)
    .fetch_all(&mut *server)
    .await
    .unwrap_or_default();
    let host = host();
    for (name, comment) in marked {
        let Some((h, pid_at)) = comment[MARK.len()..].rsplit_once(':') else {
            continue;
        };
        let Some((pid, created)) = pid_at.split_once('@') else {
            continue;
        };
        let (Ok(pid), Ok(created)) = (pid.parse::<u32>(), created.parse::<u64>()) else {
            continue;
        };
        let old_enough = unix_seconds().saturating_sub(created) >= SWEEP_AFTER.as_secs();
        if h != host || !old_enough || running(pid) {
            continue;
        }
        let _ = server
            .execute(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
            .await;
    }
}

/// `url` with its database name replaced by `name`, query parameters kept.
fn url_of(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let authority = base.find("://").map_or(0, |i| i + 3);
    let server = match base[authority..].find('/') {
        Some(i) => &base[..authority + i],
        None => base,
    };
    match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::url_of;

    #[test]
    fn url_of_replaces_only_the_database_name() {
        assert_eq!(
            url_of("postgres://u@h:5432/postgres", "x_1"),
            "postgres://u@h:5432/x_1"
        );
        assert_eq!(url_of("postgres://u@h", "x_1"), "postgres://u@h/x_1");
        assert_eq!(
            url_of("postgres://u:p@h/postgres?sslmode=disable", "x_1"),
            "postgres://u:p@h/x_1?sslmode=disable"
        );
    }
}
