//! `txinbox`: operate a txinbox deployment without writing SQL.
//!
//! Subcommands: `migrate`, `status`, `replay`, `positions show|adopt|set|rebind`, `purge`,
//! `dead-letters list|show|requeue|discard`, `completions bash|zsh|fish`.
//! Every subcommand takes `--json`. See `txinbox --help` and the README's Operations section.

#[cfg(feature = "amqp")]
mod amqp;
#[cfg(not(feature = "amqp"))]
#[path = "amqp_off.rs"]
mod amqp;
mod commands;
mod error;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(not(feature = "kafka"))]
#[path = "kafka_off.rs"]
mod kafka;

use std::io::IsTerminal;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use txinbox::ops::Db;
use txinbox::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use txinbox::sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use txinbox::sqlx::{ConnectOptions as _, Connection as _};
use txinbox::{message::Fingerprint, IdStrategy};

use error::{exit, CliError};
#[cfg(not(feature = "kafka"))]
use kafka::Kafka;

const AFTER_HELP: &str = "\
Exit codes:
  0  done
  1  the operation failed or was refused (the message says why and what to do), or the
     database refused the connection's TLS (an unknown CA, a certificate for another host,
     plaintext to a TLS-only server): a configuration error, retrying does not help
  2  bad arguments
  3  a service (PostgreSQL, the SQLite file, Kafka) could not be reached

The database is PostgreSQL (postgres://...) or the embedded SQLite store (sqlite:path or
sqlite://path): every command works on both, with the same output and exit codes.

Replay procedure: stop the consumers -> `txinbox replay ... --dry-run` -> `txinbox replay ...`
-> start the consumers (they start from the database positions replay set).

The Kafka group of a consumer is read from txinbox.subscriptions (a consumer records it when it
is assigned partitions); --group must agree with it, and is needed only when none is recorded.

Commands that delete or write (purge, positions adopt|set|rebind) print their plan first and ask
for confirmation on a terminal; without a terminal (CI, cron) they need --yes, and refuse
without it. --dry-run prints the plan only.

Durations take one unit: ms, s, min, h, d or w (90s, 30min, 12h, 7d, 2w); `m` is refused
(minutes or months?).";

/// Operate a txinbox deployment: inbox status, safe Kafka replay, retention, dead letters.
#[derive(Debug, Parser)]
#[command(name = "txinbox", version, after_help = AFTER_HELP)]
struct Cli {
    /// Print machine-readable JSON on stdout (errors too, as {"error": ..., "exit_code": ...}).
    #[arg(long, global = true)]
    json: bool,
    /// The database holding the inbox: postgres://user@host:port/database, or the embedded
    /// store's file as sqlite:path or sqlite://path. TLS as with libpq:
    /// ?sslmode=verify-full&sslrootcert=/path/to/ca.pem (sslmode=require encrypts without
    /// checking; sslcert and sslkey for a client certificate).
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Kafka bootstrap servers (host:port,...), for status, replay, positions and Kafka
    /// requeues.
    #[arg(long, global = true, env = "KAFKA_BROKERS", hide_env_values = true)]
    brokers: Option<String>,
    /// A Kafka client property, KEY=VALUE, repeatable like kcat's -X: the security settings of
    /// managed Kafka (-X security.protocol=SASL_SSL -X sasl.mechanisms=PLAIN -X
    /// sasl.username=... -X sasl.password=..., or -X security.protocol=SSL -X
    /// ssl.ca.location=/path/ca.pem). Several in one value (and in KAFKA_PROPERTIES) are
    /// separated by `,` where a property name and `=` follow it. Values are never printed.
    #[arg(
        short = 'X',
        long = "kafka-property",
        global = true,
        env = "KAFKA_PROPERTIES",
        hide_env_values = true,
        value_name = "KEY=VALUE",
        value_parser = KafkaPropertiesParser
    )]
    kafka_properties: Vec<KafkaProperties>,
    /// RabbitMQ URL (amqp://user:pass@host:port/vhost, or amqps:// for TLS), for requeueing
    /// RabbitMQ dead letters.
    #[arg(long, global = true, env = "AMQP_URL", hide_env_values = true)]
    amqp_url: Option<String>,
    #[command(flatten)]
    amqp_tls: AmqpTlsFiles,
    #[command(subcommand)]
    command: Command,
}

/// The librdkafka properties of one `-X` value; `Debug` masks secret values.
#[derive(Clone)]
struct KafkaProperties(Vec<(String, String)>);

impl std::fmt::Debug for KafkaProperties {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| (k, txinbox::redact::property(k, v))))
            .finish()
    }
}

/// Reads `-X` values by `txinbox_kafka::parse_properties`; a malformed one is refused without
/// being shown (it may hold a secret), unlike clap's own "invalid value '…'" errors.
#[derive(Clone, Copy)]
struct KafkaPropertiesParser;

impl clap::builder::TypedValueParser for KafkaPropertiesParser {
    type Value = KafkaProperties;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<KafkaProperties, clap::Error> {
        let refuse = |why: &str| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("-X / --kafka-property: {why} (the value is not shown: it may hold a secret)\n"),
            )
            .with_cmd(cmd)
        };
        let text = value.to_str().ok_or_else(|| refuse("not UTF-8"))?;
        kafka::parse_properties(text)
            .map(KafkaProperties)
            .map_err(|why| refuse(&why))
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply txinbox's migrations (idempotent; ledger in txinbox._sqlx_migrations).
    Migrate,
    /// Per consumer: processed, duplicates, conflicts, dead letters, oldest retained row,
    /// retention horizon; per partition: database position, group offset, high watermark, lag.
    Status(StatusArgs),
    /// Move a consumer's Kafka position (database and group) for one partition or all to an
    /// offset or a time. Run it with the consumers stopped; it takes effect when they start.
    Replay(ReplayArgs),
    /// A consumer's Kafka positions: show them against the group and the watermarks, adopt the
    /// group's offsets, set them, or record a new group. After a database restore, a partition
    /// with a group offset but no database position is refused by the consumer until one of
    /// these decides.
    #[command(subcommand)]
    Positions(PositionsCommand),
    /// Delete one consumer's (or every consumer's) terminal inbox rows older than a window, in
    /// small batches (never `retrying` rows), after showing the plan and a confirmation.
    Purge(PurgeArgs),
    /// Inspect and resolve dead letters.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(DeadLetterCommand),
    /// HTTP Idempotency-Key records (txinbox-http).
    #[command(subcommand)]
    Http(HttpCommand),
    /// Print a shell completion script: `txinbox completions bash > /etc/bash_completion.d/txinbox`,
    /// `txinbox completions zsh > "${fpath[1]}/_txinbox"`,
    /// `txinbox completions fish > ~/.config/fish/completions/txinbox.fish`.
    Completions {
        /// The shell.
        shell: CompletionShell,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

#[derive(Debug, Subcommand)]
enum HttpCommand {
    /// Delete expired Idempotency-Key records in batches, after showing how many and a
    /// confirmation. An expired key is new again anyway: this only frees space.
    Purge(HttpPurgeArgs),
}

#[derive(Debug, Args)]
struct HttpPurgeArgs {
    /// Rows deleted per statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    batch_size: i64,
    /// Print how many would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Delete without asking (needed when stdin is not a terminal).
    #[arg(long)]
    yes: bool,
}

#[derive(Debug, Args)]
struct StatusArgs {
    /// Only this consumer.
    #[arg(long)]
    consumer: Option<String>,
    /// Kafka group of the consumer, for group offsets (default: the group it recorded; must
    /// agree with it).
    #[arg(long, requires = "consumer")]
    group: Option<String>,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["to_offset", "to_timestamp", "to_earliest"])))]
struct ReplayArgs {
    /// The txinbox consumer name (whose inbox and positions are used).
    #[arg(long)]
    consumer: String,
    /// The topic.
    #[arg(long)]
    topic: String,
    /// Only these partitions (repeatable; default: all).
    #[arg(long = "partition")]
    partitions: Vec<i32>,
    /// Start from this offset (clamped to the partition's low and high watermarks).
    #[arg(long)]
    to_offset: Option<i64>,
    /// Start from the first record at or after this time (RFC 3339 or epoch milliseconds).
    #[arg(long, value_parser = parse_timestamp)]
    to_timestamp: Option<txinbox::ops::Timestamp>,
    /// Start from the earliest record the broker holds.
    #[arg(long)]
    to_earliest: bool,
    /// The consumer's Kafka group id (default: the group it recorded in txinbox.subscriptions;
    /// needed only when none is recorded, and must agree with a recorded one).
    #[arg(long)]
    group: Option<String>,
    /// The consumer's ID strategy: cloudevents, header:NAME, json:/POINTER, sha256, offset.
    #[arg(long, default_value = "cloudevents", value_parser = parse_id_strategy)]
    id_strategy: IdStrategy,
    /// The consumer's fingerprint: bytes or canonical-json.
    #[arg(long, default_value = "bytes", value_parser = parse_fingerprint)]
    fingerprint: Fingerprint,
    /// Report what the consumer would do with the records in the range; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Replay even before the retention horizon, past records the consumer has not reached
    /// yet (skipping them), or while the group has active members.
    #[arg(long)]
    force: bool,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("scope").required(true).args(["consumer", "all_consumers"])))]
struct PurgeArgs {
    /// Only this consumer.
    #[arg(long)]
    consumer: Option<String>,
    /// Every consumer with inbox rows (instead of --consumer).
    #[arg(long)]
    all_consumers: bool,
    /// Keep rows younger than this (s, min, h, d or w: 7d, 36h, 2w). An ID purged earlier no
    /// longer dedups, so choose at least the broker's retention plus the longest redelivery
    /// horizon; below the dedup window (7d) only with --force.
    #[arg(long, default_value = "7d", value_parser = parse_duration)]
    older_than: Duration,
    /// Rows deleted per statement.
    #[arg(long, default_value_t = txinbox::ops::retention::DEFAULT_BATCH, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    batch_size: i64,
    /// Print the plan (rows per consumer); delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Allow a window shorter than the dedup window (7d): redeliveries of purged IDs are
    /// applied again.
    #[arg(long)]
    force: bool,
    /// Delete without asking (needed when stdin is not a terminal).
    #[arg(long)]
    yes: bool,
}

#[derive(Debug, Subcommand)]
enum PositionsCommand {
    /// Per partition: database position, group offset, watermarks, and what a consumer does
    /// with it (ok, missing-in-db: refused, behind-group, ...).
    Show(PositionsShowArgs),
    /// Store the group's committed offsets as database positions where the database has none
    /// (the group's progress counts as done: e.g. moving a service onto txinbox).
    Adopt(PositionsAdoptArgs),
    /// Store positions: the earliest offset the broker holds (re-read everything retained; the
    /// inbox skips what is already applied), or one offset.
    Set(PositionsSetArgs),
    /// Record a new group for the consumer on this topic, on purpose (the old one is refused by
    /// tools and consumers from then on).
    Rebind(PositionsRebindArgs),
}

#[derive(Debug, Args)]
struct PositionsTarget {
    /// The txinbox consumer name.
    #[arg(long)]
    consumer: String,
    /// The topic.
    #[arg(long)]
    topic: String,
}

/// What every write of `positions` takes.
#[derive(Debug, Args)]
struct WriteFlags {
    /// Print the plan; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Write without asking (needed when stdin is not a terminal).
    #[arg(long)]
    yes: bool,
}

#[derive(Debug, Args)]
struct PositionsShowArgs {
    #[command(flatten)]
    consumer: PositionsConsumer,
    /// The consumer's Kafka group (default: the recorded one; must agree with it).
    #[arg(long)]
    group: Option<String>,
}

/// `--consumer` with `--topic` optional (show: every topic the consumer has positions in or a
/// recorded group for).
#[derive(Debug, Args)]
struct PositionsConsumer {
    /// The txinbox consumer name.
    #[arg(long)]
    consumer: String,
    /// Only this topic.
    #[arg(long)]
    topic: Option<String>,
}

#[derive(Debug, Args)]
struct PositionsAdoptArgs {
    #[command(flatten)]
    target: PositionsTarget,
    /// Only these partitions (repeatable; default: all).
    #[arg(long = "partition")]
    partitions: Vec<i32>,
    /// The consumer's Kafka group (default: the recorded one; must agree with it).
    #[arg(long)]
    group: Option<String>,
    /// Also overwrite partitions that have a database position (with the checks of
    /// `positions set`: not before the retention horizon, not past records not processed yet,
    /// not while the group has active members).
    #[arg(long)]
    overwrite: bool,
    /// Write even where those checks refuse (as `positions set --force`).
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    write: WriteFlags,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("to").required(true).args(["to_earliest", "offset"])))]
struct PositionsSetArgs {
    #[command(flatten)]
    target: PositionsTarget,
    /// Each selected partition's low watermark: the earliest offset the broker holds.
    #[arg(long)]
    to_earliest: bool,
    /// This offset (needs --partition).
    #[arg(long, requires = "partitions")]
    offset: Option<i64>,
    /// Only these partitions (repeatable; default with --to-earliest: all).
    #[arg(long = "partition")]
    partitions: Vec<i32>,
    /// The consumer's Kafka group (default: the recorded one; must agree with it).
    #[arg(long)]
    group: Option<String>,
    /// Write even before the retention horizon (purged IDs would be applied again), past
    /// records not processed yet (skipping them), or while the group has active members.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    write: WriteFlags,
}

#[derive(Debug, Args)]
struct PositionsRebindArgs {
    #[command(flatten)]
    target: PositionsTarget,
    /// The group the consumer reads the topic through from now on.
    #[arg(long)]
    group: String,
    #[command(flatten)]
    write: WriteFlags,
}

#[derive(Debug, Subcommand)]
enum DeadLetterCommand {
    /// List dead letters, newest first.
    List(ListArgs),
    /// Show one dead letter in full (payload as text, or hex when not UTF-8).
    Show {
        /// Dead letter id.
        id: i64,
    },
    /// Send the original message back through the consumer with its original ID (Kafka: to the
    /// original topic and partition). Its inbox row is reopened only if it is dead-lettered.
    Requeue {
        /// Dead letter ids.
        #[arg(required = true)]
        ids: Vec<i64>,
        /// Requeue even a discarded dead letter, one requeued before whose inbox row is purged,
        /// or a Kafka dead letter that other consumers of the topic would take for a new message
        /// (their inbox has no row for its ID).
        #[arg(long)]
        force: bool,
    },
    /// Mark dead letters as discarded with a reason (the rows are kept).
    Discard {
        /// Dead letter ids.
        #[arg(required = true)]
        ids: Vec<i64>,
        /// Why (kept with the dead letter).
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Args)]
struct ListArgs {
    /// Only this consumer.
    #[arg(long)]
    consumer: Option<String>,
    /// Only this reason (permanent_error, conflict, undecodable, missing_id, ...).
    #[arg(long)]
    reason: Option<String>,
    /// Only recorded at or after this time (RFC 3339 or epoch milliseconds).
    #[arg(long, value_parser = parse_timestamp)]
    since: Option<txinbox::ops::Timestamp>,
    /// Only in this state.
    #[arg(long, value_parser = ["pending", "requeued", "discarded"])]
    state: Option<String>,
    /// At most this many.
    #[arg(long, default_value_t = 50)]
    limit: i64,
}

/// What a command prints: JSON for `--json`, text otherwise.
pub(crate) struct Report {
    json: serde_json::Value,
    text: String,
    /// Exit code when the command ran but something in it failed (e.g. one of several requeues).
    code: i32,
}

impl Report {
    fn ok(json: serde_json::Value, text: String) -> Report {
        Report {
            json,
            text,
            code: exit::OK,
        }
    }
}

/// The TLS files of an `amqps://` RabbitMQ connection.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct AmqpTlsFiles {
    /// RabbitMQ over TLS: a PEM file of CA certificates that sign the broker's certificate
    /// (trusted besides the system's roots).
    #[arg(long, global = true, env = "AMQP_CA_FILE", hide_env_values = true)]
    pub(crate) amqp_ca_file: Option<std::path::PathBuf>,
    /// RabbitMQ over TLS: a client certificate (PEM), e.g. for SASL EXTERNAL
    /// (`amqps://host/vhost?auth_mechanism=external`); with --amqp-client-key.
    #[arg(
        long,
        global = true,
        env = "AMQP_CLIENT_CERT",
        hide_env_values = true,
        requires = "amqp_client_key"
    )]
    pub(crate) amqp_client_cert: Option<std::path::PathBuf>,
    /// RabbitMQ over TLS: the client certificate's private key (PEM, unencrypted).
    #[arg(
        long,
        global = true,
        env = "AMQP_CLIENT_KEY",
        hide_env_values = true,
        requires = "amqp_client_cert"
    )]
    pub(crate) amqp_client_key: Option<std::path::PathBuf>,
}

/// What commands get: output mode, and lazily the services.
pub(crate) struct Env {
    json: bool,
    database_url: Option<String>,
    brokers: Option<String>,
    /// `-X` / `KAFKA_PROPERTIES`, in order.
    kafka_properties: Vec<(String, String)>,
    amqp_url: Option<String>,
    amqp_tls: AmqpTlsFiles,
}

impl Env {
    /// Connects to the database `--database-url` names, by its scheme: PostgreSQL
    /// (`postgres://`) or the embedded SQLite store (`sqlite:path`, `sqlite://path`), and checks
    /// that the txinbox tables exist unless `migrating`.
    async fn db(&self, migrating: bool) -> Result<Store, CliError> {
        let url = self.database_url.as_deref().ok_or_else(|| {
            CliError::BadArgs("no database: pass --database-url or set DATABASE_URL".into())
        })?;
        if url.starts_with("sqlite:") {
            return sqlite(url, migrating).await.map(Store::Sqlite);
        }
        self.postgres(url, migrating).await.map(Store::Postgres)
    }

    async fn postgres(&self, url: &str, migrating: bool) -> Result<PgPool, CliError> {
        // A password pasted unencoded would be read partly as the host, port or database, and
        // echoed as such in every error: refused before anything is parsed or printed.
        if let Some(c) = txinbox::redact::unencoded_in_userinfo(url) {
            return Err(CliError::BadArgs(format!(
                "--database-url / DATABASE_URL: the user or password holds an unencoded `{c}`, which ends them early in a URL (the rest would be taken for the host, port or database); percent-encode it: `/` as %2F, `?` as %3F, `#` as %23, `@` as %40"
            )));
        }
        // A certificate or key file that cannot be read, named before connecting (sqlx would
        // say only "No such file or directory").
        txinbox::postgres::check_tls_files(url).map_err(CliError::BadArgs)?;
        let options: PgConnectOptions = url.parse().map_err(|_| {
            CliError::BadArgs(if !url.contains("://") && url.contains('=') {
                "--database-url / DATABASE_URL looks like a libpq key=value string, which is not supported; write it as a URL: postgres://user:password@host:port/database (percent-encode `/`, `?`, `#`, `@` in the password)".to_owned()
            } else {
                "--database-url / DATABASE_URL does not parse; expected postgres://user@host:port/database or sqlite:path (percent-encode `/`, `?`, `#`, `@` in the password)".into()
            })
        })?;
        // Through the one redaction, should anything of a secret have got this far.
        let service = txinbox::redact::url(&format!(
            "PostgreSQL at {}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or("")
        ));
        // One direct connection first: its error names the cause (refused, unknown host, bad
        // password), where a pool would only report a timeout.
        let probe = tokio::time::timeout(Duration::from_secs(5), options.connect()).await;
        match probe {
            Ok(Ok(conn)) => drop(conn.close().await),
            Ok(Err(e)) => return Err(connect_error(service, e)),
            Err(_) => {
                return Err(CliError::Unreachable {
                    service,
                    detail:
                        "no answer within 5 s (check --database-url / DATABASE_URL and that the server runs)"
                            .into(),
                })
            }
        }
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(txinbox::PostgresInbox::connect_options(options))
            .await
            .map_err(|e| connect_error(service, e))?;
        if !migrating {
            let ready: bool =
                txinbox::sqlx::query_scalar("SELECT to_regclass('txinbox.retention') IS NOT NULL")
                    .fetch_one(&pool)
                    .await
                    .map_err(error::db("checking the txinbox schema"))?;
            if !ready {
                return Err(CliError::failed(
                    "the txinbox tables are missing or older than this tool: run `txinbox migrate` first",
                ));
            }
        }
        Ok(pool)
    }

    /// Connects to Kafka; `why` says what needs it, for the error when no brokers are given.
    fn kafka(&self, why: &str) -> Result<kafka::Kafka, CliError> {
        let brokers = self.brokers.as_deref().ok_or_else(|| {
            CliError::BadArgs(format!("{why} needs Kafka: pass --brokers or set KAFKA_BROKERS"))
        })?;
        tokio::task::block_in_place(|| kafka::Kafka::connect(brokers, &self.kafka_properties))
    }

    /// Connects to RabbitMQ; `why` says what needs it.
    async fn amqp(&self, why: &str) -> Result<amqp::Amqp, CliError> {
        let url = self.amqp_url.as_deref().ok_or_else(|| {
            CliError::BadArgs(format!("{why} needs RabbitMQ: pass --amqp-url or set AMQP_URL"))
        })?;
        amqp::Amqp::connect(url, &self.amqp_tls).await
    }

    /// A progress bar on stderr, hidden with `--json` or when stderr is not a terminal.
    fn progress(&self, total: u64, what: &str) -> ProgressBar {
        let bar = ProgressBar::new(total);
        if self.json || !std::io::stderr().is_terminal() {
            bar.set_draw_target(ProgressDrawTarget::hidden());
        }
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({per_sec}, eta {eta})")
                .expect("static template")
                .progress_chars("=> "),
        );
        bar.set_message(what.to_owned());
        bar
    }
}

/// The database the inbox is in.
pub(crate) enum Store {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

impl Store {
    /// What the operations in `txinbox::ops` run on.
    pub(crate) fn ops(&self) -> Db<'_> {
        match self {
            Store::Postgres(pool) => pool.into(),
            Store::Sqlite(pool) => pool.into(),
        }
    }

    /// How a table is called in this store, for messages (`txinbox.inbox`, `txinbox_inbox`).
    pub(crate) fn table(&self, name: &str) -> String {
        self.ops().table(name)
    }
}

/// Opens the SQLite database file of `url` (`sqlite:path`, `sqlite://path`; created only when
/// `migrating`) with the store's settings, and checks its txinbox tables unless `migrating`.
async fn sqlite(url: &str, migrating: bool) -> Result<SqlitePool, CliError> {
    let options: SqliteConnectOptions = url.parse().map_err(|e: txinbox::sqlx::Error| {
        CliError::BadArgs(format!(
            "--database-url / DATABASE_URL does not parse as a SQLite URL ({}); expected sqlite:path or sqlite://path",
            txinbox::redact::url(&e.to_string())
        ))
    })?;
    let service = format!("SQLite database {}", options.get_filename().display());
    let pool = SqlitePoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(txinbox::SqliteInbox::connect_options(options.create_if_missing(migrating)))
        .await
        .map_err(|e| CliError::Unreachable {
            service,
            detail: format!("{e} (check --database-url / DATABASE_URL: the file must exist; `txinbox migrate` creates it)"),
        })?;
    if !migrating {
        let ready: bool = txinbox::sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'txinbox_retention')",
        )
        .fetch_one(&pool)
        .await
        .map_err(error::db("checking the txinbox tables"))?;
        if !ready {
            return Err(CliError::failed(
                "the txinbox tables are missing or older than this tool: run `txinbox migrate` first",
            ));
        }
    }
    Ok(pool)
}

/// Why connecting to `service` failed: a refused TLS connection (an unknown CA, a certificate
/// for another host, plaintext to a TLS-only server: [`txinbox::store::tls_refusal`]) is a
/// configuration error that says what to change, exit 1, as retrying cannot help; anything
/// else is "cannot reach", exit 3.
fn connect_error(service: String, e: txinbox::sqlx::Error) -> CliError {
    match txinbox::store::tls_refusal(&e) {
        Some(advice) => CliError::failed(format!(
            "{service} refused the connection: {advice} ({e}; check --database-url / DATABASE_URL)"
        )),
        None => CliError::Unreachable {
            service,
            detail: format!("{e} (check --database-url / DATABASE_URL and that the server runs)"),
        },
    }
}

fn main() {
    let cli = Cli::parse();
    if let Command::Completions { shell } = cli.command {
        use clap::CommandFactory as _;
        use clap_complete::Shell;
        let shell = match shell {
            CompletionShell::Bash => Shell::Bash,
            CompletionShell::Zsh => Shell::Zsh,
            CompletionShell::Fish => Shell::Fish,
        };
        clap_complete::generate(shell, &mut Cli::command(), "txinbox", &mut std::io::stdout());
        return;
    }
    let env = Env {
        json: cli.json,
        database_url: cli.database_url,
        brokers: cli.brokers,
        kafka_properties: cli.kafka_properties.into_iter().flat_map(|p| p.0).collect(),
        amqp_url: cli.amqp_url,
        amqp_tls: cli.amqp_tls,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(run(&env, cli.command));
    let code = match result {
        Ok(report) => {
            if env.json {
                println!("{}", serde_json::to_string_pretty(&report.json).expect("JSON"));
            } else {
                print!("{}", report.text);
            }
            report.code
        }
        Err(e) => {
            let code = e.exit_code();
            if env.json {
                println!(
                    "{}",
                    serde_json::json!({ "error": e.to_string(), "exit_code": code })
                );
            }
            eprintln!("error: {e}");
            code
        }
    };
    drop(runtime);
    std::process::exit(code);
}

async fn run(env: &Env, command: Command) -> Result<Report, CliError> {
    match command {
        Command::Migrate => {
            match env.db(true).await? {
                Store::Postgres(pool) => txinbox::postgres::migrate(&pool).await,
                Store::Sqlite(pool) => txinbox::sqlite::migrate(&pool).await,
            }
            .map_err(|e| match e {
                // The database gone mid-way is "unreachable" (exit 3), as for every command.
                txinbox::sqlx::migrate::MigrateError::Execute(e)
                | txinbox::sqlx::migrate::MigrateError::ExecuteMigration(e, _)
                    if txinbox::store::is_unavailable(&e) =>
                {
                    error::db("migrating")(e)
                }
                e => CliError::failed(format!("migrating: {e}")),
            })?;
            Ok(Report::ok(
                serde_json::json!({ "migrated": true }),
                "txinbox migrations applied\n".into(),
            ))
        }
        Command::Status(a) => commands::status::run(env, a.consumer.as_deref(), a.group.as_deref()).await,
        #[cfg(feature = "kafka")]
        Command::Replay(a) => commands::replay::run(env, a).await,
        #[cfg(not(feature = "kafka"))]
        Command::Replay(_) => Kafka::connect("", &[]).map(|k| match k {}),
        #[cfg(feature = "kafka")]
        Command::Positions(c) => commands::positions::run(env, c).await,
        #[cfg(not(feature = "kafka"))]
        Command::Positions(_) => Kafka::connect("", &[]).map(|k| match k {}),
        Command::Purge(a) => commands::purge::run(env, a).await,
        Command::DeadLetters(c) => commands::dead_letters::run(env, c).await,
        Command::Http(HttpCommand::Purge(a)) => commands::http::purge(env, a).await,
        Command::Completions { .. } => unreachable!("printed before the runtime starts"),
    }
}

fn parse_timestamp(s: &str) -> Result<txinbox::ops::Timestamp, String> {
    s.parse()
}

/// A whole number and one unit (`ms`, `s`, `min`, `h`, `d` or `w`): txinbox's one duration
/// syntax ([`txinbox::settings::duration`]). Never `m` (minutes or months?), `M`, `mo` or a
/// bare number.
fn parse_duration(s: &str) -> Result<Duration, String> {
    txinbox::settings::duration::parse(s)
}

/// `d` as the shortest exact text `parse_duration` reads back (`7d`, `36h`, `90s`).
pub(crate) fn show_duration(d: Duration) -> String {
    txinbox::settings::duration::format(d)
}

/// [`IdStrategy`]'s own `FromStr`, reminding which strategy to give.
fn parse_id_strategy(s: &str) -> Result<IdStrategy, String> {
    match s.parse::<IdStrategy>() {
        // A Kafka record has no broker message ID: every record would come out `missing_id`.
        Ok(IdStrategy::Native) => Err(
            "`native` is the broker's own message ID, which a Kafka record does not have: give the \
             strategy the consumer derives IDs with (cloudevents, header:NAME, json:/POINTER, sha256, \
             offset)"
                .into(),
        ),
        Ok(strategy) => Ok(strategy),
        Err(e) => Err(format!("{e} (as the consumer is configured)")),
    }
}

fn parse_fingerprint(s: &str) -> Result<Fingerprint, String> {
    match s {
        "bytes" => Ok(Fingerprint::PayloadBytes),
        "canonical-json" => Ok(Fingerprint::CanonicalJson),
        _ => Err(format!("`{s}` is not a fingerprint: use bytes or canonical-json")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `replay` reads Kafka records, which carry no broker message ID: `native` would turn
    /// every record into `missing_id`, so it is refused as it was before `IdStrategy: FromStr`.
    #[test]
    fn replay_refuses_the_native_id_strategy_and_takes_the_others() {
        let refused = parse_id_strategy("native").unwrap_err();
        assert!(refused.contains("does not have"), "{refused}");
        for ok in ["cloudevents", "sha256", "offset", "header:id", "json:/id"] {
            assert!(parse_id_strategy(ok).is_ok(), "{ok}");
        }
        let unknown = parse_id_strategy("bogus").unwrap_err();
        assert!(unknown.contains("as the consumer is configured"), "{unknown}");
    }
}
