//! A private PostgreSQL server for tests that stop and start it.
//!
//! Outage tests must never stop the shared server at `DATABASE_URL`: other tests run on it.
//! [`PrivateCluster::start`] runs `initdb` in a temporary directory and starts a server of its
//! own on a free port of 127.0.0.1, which the test may then stop ([`down`](PrivateCluster::down))
//! and start again ([`up`](PrivateCluster::up)):
//!
//! ```no_run
//! use txinbox_testing::cluster::PrivateCluster;
//!
//! # async fn example() {
//! let cluster = PrivateCluster::start();
//! let pool = txinbox::sqlx::PgPool::connect_with(cluster.options()).await.unwrap();
//! cluster.down(); // the server is gone: connections fail
//! cluster.up(); // and back
//! # drop(pool);
//! # }
//! ```
//!
//! [`PrivateCluster::start_tls`] starts one that speaks TLS only, with a server certificate
//! from a [`TestCa`]: plaintext connections are refused, and client
//! certificates are checked against the CA.

use std::path::{Path, PathBuf};
use std::process::Command;

use txinbox::sqlx::postgres::{PgConnectOptions, PgSslMode};

use crate::tls::TestCa;

/// A private PostgreSQL cluster in a temporary directory, stopped and removed on drop. Uses the
/// server binaries of the machine's PostgreSQL (`TXINBOX_PG_BIN`, else the newest
/// `/usr/lib/postgresql/*/bin`); as root it runs them as the `postgres` user, as PostgreSQL
/// refuses to run as root. Trust authentication, superuser `postgres`, fsync off.
#[derive(Debug)]
pub struct PrivateCluster {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    /// The CA certificate clients trust, when the server speaks TLS only.
    ca: Option<PathBuf>,
}

impl PrivateCluster {
    /// Creates the cluster and starts its server.
    ///
    /// # Panics
    ///
    /// When there are no server binaries (install PostgreSQL's server package, or set
    /// `TXINBOX_PG_BIN`) or `initdb` or the server fails: a test cannot run without it.
    pub fn start() -> PrivateCluster {
        let cluster = Self::init();
        cluster.up();
        cluster
    }

    /// [`start`](Self::start), with a server that accepts TLS connections only (`ssl = on`,
    /// `hostssl`-only `pg_hba.conf`: a plaintext connection is refused with "no pg_hba.conf
    /// entry … no encryption"), with a certificate from `ca` valid for `127.0.0.1` only (so
    /// `sslmode=verify-full` to `localhost` fails on the host name). Client certificates are
    /// checked against `ca`; members of the role [`CERT_AUTH_ROLE`](Self::CERT_AUTH_ROLE) must
    /// log in with one (`cert` authentication: the certificate's common name is the role),
    /// everyone else is trusted.
    ///
    /// [`options`](Self::options) and [`url`](Self::url) then use `sslmode=verify-full` with
    /// `ca`'s certificate (a copy in the cluster's directory, so `ca` may be dropped).
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub fn start_tls(ca: &TestCa) -> PrivateCluster {
        let mut cluster = Self::init();
        let server = ca.server(&["127.0.0.1"]);
        let dir = cluster.dir.clone();
        let copy = |from: &Path, to: &str| {
            std::fs::copy(from, dir.join(to)).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
        };
        copy(&server.cert, "server.crt");
        copy(&server.key, "server.key");
        copy(ca.cert_path(), "root.crt");
        append(
            &dir.join("postgresql.conf"),
            "\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nssl_ca_file = 'root.crt'\n",
        );
        let hba = format!(
            "local all all trust\n\
             hostssl all +{role} 127.0.0.1/32 cert\n\
             hostssl all all 127.0.0.1/32 trust\n",
            role = Self::CERT_AUTH_ROLE
        );
        std::fs::write(dir.join("pg_hba.conf"), hba).expect("write pg_hba.conf");
        cluster.chown();
        cluster.ca = Some(dir.join("root.crt"));
        cluster.up();
        cluster
    }

    /// On a [`start_tls`](Self::start_tls) cluster, the members of this role must log in with
    /// a client certificate whose common name is their role (`hostssl … cert`). Create it
    /// (`CREATE ROLE txinbox_cert_auth NOLOGIN`) and a member to try it.
    pub const CERT_AUTH_ROLE: &'static str = "txinbox_cert_auth";

    /// The CA certificate a client of a [`start_tls`](Self::start_tls) cluster trusts.
    pub fn ca_path(&self) -> Option<&Path> {
        self.ca.as_deref()
    }

    fn init() -> PrivateCluster {
        let bin = std::env::var("TXINBOX_PG_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|_| newest_server_bin());
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port on 127.0.0.1");
            l.local_addr().expect("the free port").port()
        };
        let dir = std::env::temp_dir().join(format!("txinbox-pg-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the private cluster's directory");
        let cluster = PrivateCluster {
            dir,
            bin,
            port,
            ca: None,
        };
        cluster.chown();
        cluster.run(
            "initdb",
            &["-D", cluster.data(), "-A", "trust", "-U", "postgres", "--no-sync"],
        );
        cluster
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connection options for the `postgres` database as the `postgres` superuser; on a TLS
    /// cluster with `sslmode=verify-full` and the cluster's CA.
    pub fn options(&self) -> PgConnectOptions {
        let options = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database("postgres");
        match &self.ca {
            Some(ca) => options.ssl_mode(PgSslMode::VerifyFull).ssl_root_cert(ca),
            None => options,
        }
    }

    /// A URL of database `database` on the server, e.g. for a program under test; on a TLS
    /// cluster with `?sslmode=verify-full&sslrootcert=` the cluster's CA.
    pub fn url(&self, database: &str) -> String {
        let url = format!("postgres://postgres@127.0.0.1:{}/{database}", self.port);
        match &self.ca {
            Some(ca) => format!("{url}?sslmode=verify-full&sslrootcert={}", ca.display()),
            None => url,
        }
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

    /// Stops the server the hard way (`pg_ctl stop -m immediate`), as a crash or a kill would:
    /// open connections break, new ones are refused.
    pub fn down(&self) {
        self.run("pg_ctl", &["-D", self.data(), "-m", "immediate", "-w", "stop"]);
    }

    /// Starts a smart shutdown and returns at once (`pg_ctl stop -m smart -W`): the server
    /// refuses new connections ("the database system is shutting down", SQLSTATE 57P03) and
    /// stops once its last session ends. [`up`](Self::up) starts it again after that.
    pub fn begin_shutdown(&self) {
        self.run("pg_ctl", &["-D", self.data(), "-m", "smart", "-W", "stop"]);
    }

    /// Waits until the server has stopped (after [`begin_shutdown`](Self::begin_shutdown)).
    pub fn wait_stopped(&self) {
        let pid_file = self.dir.join("postmaster.pid");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while pid_file.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the private cluster did not stop"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    fn data(&self) -> &str {
        self.dir.to_str().expect("a UTF-8 temporary directory")
    }

    fn chown(&self) {
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres", self.data()])
                .status();
            assert!(
                ok.map(|s| s.success()).unwrap_or(false),
                "chown the private cluster's directory to postgres"
            );
        }
    }

    fn run(&self, tool: &str, args: &[&str]) {
        let path = self.bin.join(tool);
        let mut cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&path);
            c
        } else {
            Command::new(&path)
        };
        let out = cmd
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", path.display()));
        assert!(
            out.status.success(),
            "{tool} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.down()));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn append(path: &Path, text: &str) {
    use std::io::Write as _;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .unwrap_or_else(|e| panic!("append to {}: {e}", path.display()));
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout == b"0\n")
        .unwrap_or(false)
}

/// The newest `/usr/lib/postgresql/<version>/bin` with an `initdb`.
fn newest_server_bin() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql (scripts/test installs them), or TXINBOX_PG_BIN")
        .filter_map(|e| {
            let e = e.ok()?;
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("an initdb under /usr/lib/postgresql/*/bin, or TXINBOX_PG_BIN")
        .1
}
