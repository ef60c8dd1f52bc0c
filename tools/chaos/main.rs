//! The crash matrix: runs the `ledger` example against Kafka and RabbitMQ while killing it, and
//! proves that no payment was lost and none applied twice.
//!
//! For each broker it creates a fresh topic or queue and a fresh database, publishes payment
//! events (about `--duplicate-percent` of them twice: half of the copies right behind the
//! first, racing it through two concurrent lanes, half later; plus a few malformed payloads),
//! then starts the ledger as a child process again and again:
//!
//! - once per named crash point (`txinbox::crash`: on Kafka first `rebalance`, armed in a
//!   consuming member while a second member joins the group, which is then SIGKILLed too; then
//!   `after_claim`, `after_handler`, `after_commit`, `batch_open`) with
//!   `TXINBOX_CRASH_AT=<point>:<n>`, where the ledger must abort by itself (SIGABRT). A point
//!   this build never reaches (the ledger finished `n` + 1,000 events, or nothing for 20 s,
//!   without aborting) is reported as "not reached", and is a failure unless it is listed in
//!   `--allow-unreached`;
//! - then, with the second half of the events published, `--random-kills` times with SIGKILL
//!   at a random moment while it is consuming (fewer if the time budget runs out);
//! - finally once to the end, stopped with SIGTERM (which must exit 0).
//!
//! Then it checks PostgreSQL and the broker: the sum of the balances equals the sum of the
//! unique events' amounts (and every account's balance its own sum), `ledger_entries` holds
//! exactly one row per unique event, every malformed event has a dead letter, and nothing is
//! left unacknowledged (RabbitMQ: work and retry queues empty once no consumer is attached;
//! Kafka: group offsets and database positions at the end of every partition). It prints
//! a summary table and exits non-zero on any loss, doubling, unacknowledged message, missed
//! crash point or unexpected exit. The topic or queue and the database are deleted after a
//! clean run and kept (and named) after a failed one, with every ledger's log. Kafka runs use
//! `--kafka-session-timeout-ms` (default 6000; CI uses 3000 on tansu) so that a restart after a
//! kill waits only that long for the dead member.
//!
//! Two more phases, chosen with `--phases` (default `matrix`; CI runs
//! `matrix,storm,outage`), print their figures under the summary:
//!
//! - `storm` ([`storm`]): a rebalance storm on Kafka. Three ledgers in one consumer group on a
//!   topic with six partitions are SIGKILLed (70 %) or stopped with SIGTERM (which must exit 0)
//!   one at a time, every 1 to 3.5 s for `--storm-seconds`, and restarted 0 to 2.5 s later,
//!   while the producer publishes `--storm-events` at an even pace. Then all three run until
//!   everything is drained, stop with SIGTERM, and the run is checked as above. Figures:
//!   events, kills, graceful stops, restarts, the assignments and revocations the members
//!   logged, duration, lost, doubled, unacked. The members log the group protocol
//!   (`debug=cgrp`): a group that stops consuming for 15 s is diagnosed from it. tansu
//!   (0.6) keeps a member that stopped during a rebalance as the group's leader for good, so no
//!   rebalance of that group ever completes again; the storm reports that stall, with the
//!   departed leader's log, and moves the members to a new group, where they start every
//!   partition at its database position (at most three times). Any other stall fails the run.
//! - `outage` ([`outage`]): PostgreSQL crashes (`pg_ctl stop -m immediate`) for
//!   `--outage-seconds` while ledgers consume from Kafka and from RabbitMQ, and comes back; a
//!   second Kafka member is killed as it goes down, so that its partitions are handed over
//!   while the database is down. It runs on a private cluster (initdb in a temporary
//!   directory, a free port; the server programs of `--pg-bin` / `TXINBOX_PG_BIN`, as user
//!   `postgres` when run as root),
//!   never on the `--database-url` server. Besides the final check it asserts that nothing was
//!   acknowledged during the outage: no group offset seen while the database was down is past
//!   the database position of its partition (but over records the database has applied or
//!   dead-lettered), and every RabbitMQ event the database had not finished still has a copy
//!   in the queues once the ledger holding them is killed at the end of the outage. The Kafka
//!   ledger must stay up through the outage.
//!
//! Needs PostgreSQL and the brokers (`docker compose up -d`, or `scripts/test` installs them),
//! and the ledger built with crash points next to this program:
//!
//! ```text
//! cargo build -p txinbox-demos -p txinbox-tools --features txinbox-tools/crash-points --example ledger --example chaos
//! target/debug/examples/chaos --source all --events 2000 --time-budget 120
//! target/debug/examples/chaos --source all --phases storm,outage --kafka-session-timeout-ms 3000
//! ```
//!
//! `scripts/chaos` builds them and runs the harness, after two sabotaged runs that must fail
//! (CI runs it). Against your own setup: `--brokers` /
//! `KAFKA_BROKERS`, `--amqp-url` / `AMQP_URL`, `--database-url` / `DATABASE_URL` (a role that
//! may create databases), `--events`, `--time-budget` (the matrix's; the storm and the outage
//! take their own sizes), `--seed` to replay a run's choices. `--sabotage` proves that the
//! checks can fail. In the matrix and the storm it runs every ledger under a new consumer
//! name, so its inbox cannot recognise what an earlier (killed) run applied: the check must
//! report doubled payments. In the outage every ledger acknowledges each delivery as it
//! receives it, before its transaction (`txinbox_demos::sabotage`): the run must report
//! acknowledgements during the outage on both brokers, and lost payments.

mod brokers;
mod events;
mod outage;
mod process;
mod storm;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use nix::sys::signal::Signal;
use txinbox::crash;
use txinbox::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use txinbox::sqlx::{self, ConnectOptions as _, Executor as _, PgPool};
use txinbox_demos::reconcile::{self, Reconciliation};

use brokers::{Amqp, Kafka};
use events::{Outgoing, Plan};
use process::{describe, died_of, tail, Launcher, Ledger};

/// How often the harness looks at the database and the children.
const POLL: Duration = Duration::from_millis(100);
/// How long a stopping ledger may take to exit after SIGTERM.
const GRACE: Duration = Duration::from_secs(30);
/// A crash point counts as not reached once this many more messages than its `n` were applied
/// without an abort (a point on the batch path is hit once per batch of up to 100 messages,
/// and several lanes commit batches at once).
const NOT_REACHED_MARGIN: u64 = 1_000;
/// A crash-point run that finishes no event for this long (a restart after a kill included)
/// has nothing left to do: the point counts as not reached.
const STALL: Duration = Duration::from_secs(20);
/// Longest wait for one crash-point run.
const POINT_CAP: Duration = Duration::from_secs(60);
/// How long a rebalance takes at most once the second member started (a few session
/// timeouts).
const REBALANCE_CAP: Duration = Duration::from_secs(40);
/// Time left for the final run when random kills stop.
const FINAL_RESERVE: Duration = Duration::from_secs(20);
/// The final run may always take this long to drain, even past the budget.
const FINAL_MIN: Duration = Duration::from_secs(60);

/// Runs the ledger under a crash matrix and checks that nothing was lost or doubled.
#[derive(Debug, Parser)]
#[command(name = "chaos")]
struct Args {
    /// Which broker(s) to run against.
    #[arg(long, value_enum, default_value = "all", env = "CHAOS_SOURCE")]
    source: Which,
    /// Unique payment events to publish per broker.
    #[arg(long, default_value_t = 2000, env = "CHAOS_EVENTS", value_parser = clap::value_parser!(u32).range(10..))]
    events: u32,
    /// Percentage of the events published twice.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(0..=100))]
    duplicate_percent: u32,
    /// Malformed payloads to publish per broker (each must end as a dead letter).
    #[arg(long, default_value_t = 4)]
    malformed: usize,
    /// SIGKILLs at random moments per broker (fewer if the time budget runs out).
    #[arg(long, default_value_t = 4)]
    random_kills: u32,
    /// Seconds for the whole run, all brokers together; the crash points always run, random
    /// kills fill the rest.
    #[arg(long, default_value_t = 120, env = "CHAOS_TIME_BUDGET")]
    time_budget: u64,
    /// Kafka bootstrap brokers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// The ledger's Kafka `session.timeout.ms`: how long the group waits for a killed member
    /// before a restarted one gets its partitions. Apache Kafka refuses less than its
    /// `group.min.session.timeout.ms` (6000 by default).
    #[arg(long, default_value_t = 6000)]
    kafka_session_timeout_ms: u32,
    /// Extra librdkafka properties for every Kafka ledger, KEY=VALUE (repeatable), e.g.
    /// `debug=cgrp` with `CHAOS_LEDGER_LOG=info,librdkafka=debug` to see the group protocol in
    /// the ledgers' logs.
    #[arg(long)]
    ledger_kafka_property: Vec<String>,
    /// RabbitMQ URI.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// PostgreSQL URL of a role that may create databases; each broker's run gets its own.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database_url: String,
    /// The ledger binary (built with `--features crash-points`). Default: `ledger` next to
    /// this program.
    #[arg(long, env = "CHAOS_LEDGER")]
    ledger: Option<PathBuf>,
    /// Crash points that may go unreached without failing the run (comma-separated; none by
    /// default: every point applies to the ledger on the default batching configuration).
    #[arg(long, value_delimiter = ',')]
    allow_unreached: Vec<String>,
    /// Seed for every random choice (printed at the start of each run).
    #[arg(long, env = "CHAOS_SEED")]
    seed: Option<u64>,
    /// Keep the databases, topics and queues even after a clean run.
    #[arg(long)]
    keep: bool,
    /// Matrix and storm: run each ledger under a new consumer name, so the inbox cannot
    /// deduplicate across restarts and the run must FAIL with doubled payments. Outage: every
    /// ledger acknowledges each delivery before its transaction, so the run must FAIL with
    /// acknowledgements during the outage (and lost payments). Proves the checks can fail.
    #[arg(long)]
    sabotage: bool,
    /// What to run (comma-separated): `matrix` (per broker: crash points, random kills, a final
    /// run; bounded by --time-budget), `storm` (Kafka: a rebalance storm of three members on
    /// six partitions), `outage` (PostgreSQL crashed and restarted under both brokers).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "matrix")]
    phases: Vec<Phase>,
    /// Storm: unique payment events, published while the members churn.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(10..))]
    storm_events: u32,
    /// Storm: seconds of kills, graceful stops and restarts (then every member drains).
    #[arg(long, default_value_t = 40)]
    storm_seconds: u64,
    /// Outage: unique payment events per broker.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(10..))]
    outage_events: u32,
    /// Outage: seconds PostgreSQL stays down at least: more than librdkafka's 5 s auto-commit
    /// interval, so that an offset stored without a commit would reach the group meanwhile.
    /// Longer if the group has not yet begun to hand the killed Kafka member's partitions over.
    #[arg(long, default_value_t = 10)]
    outage_seconds: u64,
    /// Outage: the directory of PostgreSQL's server programs (initdb, pg_ctl) for the private
    /// cluster the outage stops and starts. Default: the newest /usr/lib/postgresql/*/bin.
    #[arg(long, env = "TXINBOX_PG_BIN")]
    pg_bin: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    All,
    Kafka,
    Amqp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Phase {
    Matrix,
    Storm,
    Outage,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Matrix => "matrix",
            Phase::Storm => "storm",
            Phase::Outage => "outage",
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    for point in &args.allow_unreached {
        anyhow::ensure!(
            point.is_empty() || crash::POINTS.contains(&point.as_str()),
            "--allow-unreached {point}: unknown crash point; known: {:?}",
            crash::POINTS
        );
    }
    let ledger = match &args.ledger {
        Some(path) => path.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("this program's directory")?
            .join("ledger"),
    };
    anyhow::ensure!(
        ledger.is_file(),
        "no ledger binary at {}: build it first with `cargo build -p txinbox-demos --features crash-points --example ledger` (or pass --ledger)",
        ledger.display()
    );
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    let sources: Vec<&'static str> = match args.source {
        Which::All => vec!["kafka", "amqp"],
        Which::Kafka => vec!["kafka"],
        Which::Amqp => vec!["amqp"],
    };
    let phases: Vec<&str> = args.phases.iter().map(|p| p.name()).collect();
    println!(
        "chaos: phases {}; matrix: {} events per broker, {}% sent twice, {} malformed, up to {} random kills, budget {} s; seed {seed}{}",
        phases.join(","),
        args.events,
        args.duplicate_percent,
        args.malformed,
        args.random_kills,
        args.time_budget,
        if args.sabotage { "; SABOTAGE" } else { "" }
    );
    let mut reports = Vec::new();
    if args.phases.contains(&Phase::Matrix) {
        let deadline = Instant::now() + Duration::from_secs(args.time_budget);
        for (i, source) in sources.iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            let share = left / (sources.len() - i) as u32;
            let source_seed = seed.wrapping_add(i as u64);
            let run = run_source(&args, source, &ledger, source_seed, Instant::now() + share);
            reports.push(interruptible(run).await?);
        }
    }
    if args.phases.contains(&Phase::Storm) {
        anyhow::ensure!(
            sources.contains(&"kafka"),
            "the storm runs on Kafka: use --source all or kafka with --phases storm"
        );
        reports.push(interruptible(storm::run(&args, &ledger, seed.wrapping_add(100))).await?);
    }
    if args.phases.contains(&Phase::Outage) {
        let run = outage::run(&args, &ledger, seed.wrapping_add(200), &sources);
        reports.extend(interruptible(run).await?);
    }
    print_summary(&reports);
    let failed: Vec<&Report> = reports.iter().filter(|r| !r.failures.is_empty()).collect();
    if failed.is_empty() {
        println!("chaos: ok");
        Ok(())
    } else {
        for r in &failed {
            println!("\n{} {} FAILED ({}):", r.source, r.phase, r.resources);
            for f in &r.failures {
                println!("  - {f}");
            }
        }
        std::process::exit(1);
    }
}

/// `run`, unless Ctrl-C comes first (the ledgers are killed when their handles drop).
async fn interruptible<T>(run: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::select! {
        result = run => result,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted; the ledgers were killed"),
    }
}

/// What happened at one named crash point.
#[derive(Debug, Clone)]
enum PointResult {
    /// The ledger aborted by itself at the point's `nth` hit, `applied` events after it started.
    Aborted { nth: u32, applied: u64 },
    /// The ledger applied `applied` events and never reached the point.
    NotReached { applied: u64 },
    /// Something else ended the run.
    Failed(String),
    /// The point does not exist for this broker.
    NotApplicable,
}

impl std::fmt::Display for PointResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PointResult::Aborted { nth, applied } => write!(f, "aborted (hit {nth}, {applied} applied)"),
            PointResult::NotReached { applied } => write!(f, "not reached ({applied} applied)"),
            PointResult::Failed(_) => write!(f, "FAILED"),
            PointResult::NotApplicable => write!(f, "n/a"),
        }
    }
}

/// One broker's results in one phase.
#[derive(Debug, Default)]
struct Report {
    source: &'static str,
    phase: &'static str,
    resources: String,
    runs: u32,
    kills: u32,
    aborts: u32,
    messages: u64,
    absorbed: u64,
    lost: u64,
    doubled: u64,
    unacked: u64,
    points: BTreeMap<&'static str, PointResult>,
    failures: Vec<String>,
    elapsed: Duration,
    /// The phase's own figures, printed under the summary.
    figures: Vec<String>,
}

/// The broker under test.
enum Side {
    Kafka(Kafka),
    Amqp(Box<Amqp>),
}

impl Side {
    fn ledger_args(&self) -> Vec<String> {
        match self {
            Side::Kafka(k) => k.ledger_args(),
            Side::Amqp(a) => a.ledger_args(),
        }
    }

    fn name(&self) -> String {
        match self {
            Side::Kafka(k) => format!("topic {}", k.topic()),
            Side::Amqp(a) => format!("queue {}", a.queue()),
        }
    }

    async fn publish(&self, messages: &[Outgoing]) -> anyhow::Result<()> {
        match self {
            Side::Kafka(k) => k.publish(messages).await,
            Side::Amqp(a) => a.publish(messages).await,
        }
    }

    async fn consumed(&self, pool: &PgPool) -> anyhow::Result<bool> {
        match self {
            Side::Kafka(k) => k.consumed(pool).await,
            Side::Amqp(a) => a.consumed().await,
        }
    }

    async fn unacknowledged(&self, pool: &PgPool) -> anyhow::Result<(u64, Vec<String>)> {
        match self {
            Side::Kafka(k) => k.unacknowledged(pool).await,
            Side::Amqp(a) => a.unacknowledged().await,
        }
    }

    async fn delete(&self) -> anyhow::Result<()> {
        match self {
            Side::Kafka(k) => k.delete().await,
            Side::Amqp(a) => a.delete().await,
        }
    }

    /// The points in the order they are run, each on its own share of the first wave:
    /// `rebalance` first (a revocation while a second member joins), then the message path.
    fn points(&self) -> Vec<&'static str> {
        let mut points = Vec::new();
        if matches!(self, Side::Kafka(_)) {
            points.push(crash::REBALANCE);
        }
        points.extend([
            crash::AFTER_CLAIM,
            crash::AFTER_HANDLER,
            crash::AFTER_COMMIT,
            crash::BATCH_OPEN,
        ]);
        points
    }
}

/// A database made for one broker's run.
struct Database {
    admin: PgConnectOptions,
    name: String,
    url: String,
    pool: PgPool,
}

impl Database {
    async fn create(admin_url: &str, name: &str) -> anyhow::Result<Database> {
        let admin: PgConnectOptions = admin_url.parse().context(
            "--database-url / DATABASE_URL does not parse; expected postgres://user@host:port/database",
        )?;
        let mut conn = admin
            .connect()
            .await
            .context("connecting to PostgreSQL failed; check --database-url / DATABASE_URL")?;
        conn.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .with_context(|| format!("creating database {name} (the role needs CREATEDB)"))?;
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(admin.clone().database(name))
            .await?;
        Ok(Database {
            url: txinbox_demos::with_database(admin_url, name),
            name: name.to_owned(),
            admin,
            pool,
        })
    }

    /// Distinct events the ledger has finished: applied, or dead-lettered. 0 until the first
    /// ledger has created its tables.
    async fn finished(&self) -> u64 {
        sqlx::query_scalar::<_, i64>(
            "SELECT (SELECT count(DISTINCT event_id) FROM ledger_entries)
                  + (SELECT count(DISTINCT message_id) FROM txinbox.dead_letters)",
        )
        .fetch_one(&self.pool)
        .await
        .map(|n| n as u64)
        .unwrap_or(0)
    }

    async fn drop_database(self) -> anyhow::Result<()> {
        self.pool.close().await;
        let mut conn = self.admin.connect().await?;
        conn.execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .await?;
        Ok(())
    }
}

/// One broker's crash matrix, random kills, final run and checks.
async fn run_source(
    args: &Args,
    source: &'static str,
    ledger: &Path,
    seed: u64,
    deadline: Instant,
) -> anyhow::Result<Report> {
    let setup = Setup {
        source,
        phase: Phase::Matrix,
        ledger,
        seed,
        partitions: brokers::PARTITIONS,
        database_url: &args.database_url,
        events: args.events,
    };
    let (mut chaos, plan) = prepare(args, setup).await?;
    chaos.run(args, &plan, deadline).await;
    Ok(finish(chaos, args).await)
}

/// What one run is made of.
struct Setup<'a> {
    source: &'static str,
    phase: Phase,
    ledger: &'a Path,
    seed: u64,
    /// Kafka: partitions of the topic.
    partitions: i32,
    /// A role that may create databases.
    database_url: &'a str,
    /// Unique payment events in the plan.
    events: u32,
}

/// A fresh topic or queue, database and log directory, and the events to publish.
async fn prepare(args: &Args, setup: Setup<'_>) -> anyhow::Result<(Chaos, Plan)> {
    let Setup {
        source,
        phase,
        ledger,
        seed,
        partitions,
        database_url,
        events,
    } = setup;
    let started = Instant::now();
    let mut rng = fastrand::Rng::with_seed(seed);
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let tag = match phase {
        Phase::Matrix => format!("{stamp}-{:04x}", rng.u16(..)),
        other => format!("{}-{stamp}-{:04x}", other.name(), rng.u16(..)),
    };
    match phase {
        Phase::Matrix => println!("\n== {source}: seed {seed}"),
        other => println!("\n== {source} {}: seed {seed}", other.name()),
    }
    let side = match source {
        "kafka" => {
            Side::Kafka(Kafka::create(&args.brokers, &tag, partitions, args.kafka_session_timeout_ms).await?)
        }
        _ => Side::Amqp(Box::new(Amqp::create(&args.amqp_url, &tag).await?)),
    };
    let db = Database::create(database_url, &format!("ledger_chaos_{}", tag.replace('-', "_"))).await?;
    let logs = std::env::temp_dir().join(format!("txinbox-chaos-{source}-{tag}"));
    let resources = format!("database {}, {}, logs {}", db.name, side.name(), logs.display());
    println!("   {resources}");
    let mut ledger_args = side.ledger_args();
    if matches!(side, Side::Kafka(_)) {
        ledger_args.extend(
            args.ledger_kafka_property
                .iter()
                .map(|p| format!("--kafka-property={p}")),
        );
    }
    let mut launcher = Launcher::new(ledger.to_path_buf(), ledger_args, logs)?;
    launcher.env("DATABASE_URL", &db.url);
    launcher.env("AMQP_URL", &args.amqp_url);
    let plan = events::plan(
        &tag,
        events as usize,
        args.duplicate_percent,
        args.malformed,
        &mut rng,
    );
    let chaos = Chaos {
        source,
        side,
        db,
        launcher,
        rng,
        published: 0,
        sabotage: args.sabotage,
        report: Report {
            source,
            phase: phase.name(),
            resources,
            messages: plan.expected.messages,
            ..Report::default()
        },
        started,
    };
    Ok((chaos, plan))
}

/// Ends a run: its report, with the topic or queue, the database and the logs deleted after a
/// clean run (kept and named in the report after a failed one).
async fn finish(chaos: Chaos, args: &Args) -> Report {
    let Chaos {
        side,
        db,
        launcher,
        mut report,
        started,
        ..
    } = chaos;
    report.runs = launcher.started();
    report.elapsed = started.elapsed();
    // A sabotaged run is meant to fail: nothing in it is worth keeping.
    if (report.failures.is_empty() || args.sabotage) && !args.keep {
        if let Err(e) = side.delete().await {
            println!("   (could not delete the {}: {e})", side.name());
        }
        if let Err(e) = db.drop_database().await {
            println!("   (could not drop the database: {e})");
        }
        let _ = std::fs::remove_dir_all(launcher.logs());
    }
    report
}

struct Chaos {
    source: &'static str,
    side: Side,
    db: Database,
    launcher: Launcher,
    rng: fastrand::Rng,
    /// Distinct event IDs published so far (valid and malformed).
    published: u64,
    sabotage: bool,
    report: Report,
    started: Instant,
}

impl Chaos {
    async fn run(&mut self, args: &Args, plan: &Plan, deadline: Instant) {
        if let Err(e) = self.matrix_and_kills(args, plan, deadline).await {
            self.report.failures.push(format!("{e:#}"));
            return;
        }
        if let Err(e) = self.check(plan).await {
            self.report.failures.push(format!("checking failed: {e:#}"));
        }
        let unreached: Vec<&str> = self
            .report
            .points
            .iter()
            .filter(|(_, r)| matches!(r, PointResult::NotReached { .. }))
            .map(|(p, _)| *p)
            .collect();
        let attempted = self
            .report
            .points
            .values()
            .filter(|r| !matches!(r, PointResult::NotApplicable))
            .count();
        for point in &unreached {
            if !args.allow_unreached.iter().any(|p| p == point) {
                let hint = if unreached.len() == attempted {
                    " (no point was reached: was the ledger built with --features crash-points?)"
                } else {
                    ""
                };
                self.report.failures.push(format!(
                    "crash point {point} was never reached{hint}; pass --allow-unreached {point} if this build has no such point"
                ));
            }
        }
    }

    fn consumer_name(&self) -> String {
        if self.sabotage {
            format!("ledger-run-{}", self.launcher.started() + 1)
        } else {
            "ledger".into()
        }
    }

    fn start(&mut self, label: &str, crash_at: Option<&str>) -> anyhow::Result<Ledger> {
        let name = self.consumer_name();
        self.launcher.start(label, crash_at, &name)
    }

    /// Prints one line about the run just finished.
    fn line(&self, what: &str, outcome: &str, since: Instant) {
        self.line_of(self.launcher.started(), what, outcome, since);
    }

    /// Prints one line about run number `run`.
    fn line_of(&self, run: u32, what: &str, outcome: &str, since: Instant) {
        println!(
            "   {:<5} run {run:>2} {:<26} → {outcome} [{:.1} s, at {:.0} s]",
            self.source,
            what,
            since.elapsed().as_secs_f64(),
            self.started.elapsed().as_secs_f64()
        );
    }

    async fn publish(&mut self, wave: &[Outgoing]) -> anyhow::Result<()> {
        self.side.publish(wave).await?;
        self.published += wave.iter().filter(|m| m.copy == 0).count() as u64;
        Ok(())
    }

    async fn matrix_and_kills(&mut self, args: &Args, plan: &Plan, deadline: Instant) -> anyhow::Result<()> {
        let points = self.side.points();
        for point in crash::POINTS {
            self.report.points.insert(point, PointResult::NotApplicable);
        }
        // Each crash point gets a fresh share of the first wave, published just before its run:
        // the runtime batches, so one run can consume everything already published, and a
        // point must never find nothing left to process.
        // An even split: the first `extra` points get one more, so no point gets an empty share
        // while there are at least as many events as points.
        let (share, extra) = (
            plan.first_wave.len() / points.len(),
            plan.first_wave.len() % points.len(),
        );
        let mut rest = &plan.first_wave[..];
        for (i, point) in points.into_iter().enumerate() {
            let (chunk, after) = rest.split_at(share + usize::from(i < extra));
            rest = after;
            self.publish(chunk).await?;
            let fresh = chunk.iter().filter(|m| m.copy == 0).count() as u64;
            println!("   published {} messages for {point}", chunk.len());
            let result = if point == crash::REBALANCE {
                // The first revocation: the one the joining member causes.
                self.rebalance_run(1).await?
            } else {
                // The n-th hit: early enough that this share cannot run out before it. A point
                // on the batch path is hit once per batch (up to 100 messages), not per message.
                let most = (fresh / 100).clamp(1, 3) as u32;
                let nth = self.rng.u32(1..=most);
                self.point_run(point, nth).await?
            };
            let failed = match &result {
                PointResult::Failed(why) => Some(format!("crash point {point}: {why}")),
                _ => None,
            };
            self.report.points.insert(point, result);
            if let Some(why) = failed {
                anyhow::bail!(why);
            }
        }
        self.publish(&plan.second_wave).await?;
        println!("   published {} messages (second wave)", plan.second_wave.len());
        let mut kills = 0;
        while kills < args.random_kills && Instant::now() + FINAL_RESERVE < deadline {
            self.kill_run().await?;
            kills += 1;
        }
        self.final_run(deadline.max(Instant::now() + FINAL_MIN)).await
    }

    /// Whether every published event is finished.
    async fn all_finished(&self) -> bool {
        self.db.finished().await >= self.published
    }

    async fn point_run(&mut self, point: &'static str, nth: u32) -> anyhow::Result<PointResult> {
        let since = Instant::now();
        let before = self.db.finished().await;
        let mut what = format!("crash at {point}:{nth}");
        let mut ledger = self.start(&format!("crash-{point}"), Some(&format!("{point}:{nth}")))?;
        let mut idle_since: Option<Instant> = None;
        let mut progress = (0, Instant::now());
        let result = loop {
            tokio::time::sleep(POLL).await;
            let applied = self.db.finished().await.saturating_sub(before);
            if applied > progress.0 {
                progress = (applied, Instant::now());
            }
            if let Some(status) = ledger.exited()? {
                break self.ended(&ledger, status, nth, applied, point);
            }
            if self.all_finished().await {
                idle_since.get_or_insert_with(Instant::now);
            }
            let enough = applied >= u64::from(nth) + NOT_REACHED_MARGIN;
            let idle = idle_since.is_some_and(|t| t.elapsed() > Duration::from_secs(3));
            let stalled = progress.1.elapsed() > STALL;
            if enough || idle || stalled || ledger.age() > POINT_CAP {
                break match ledger.terminate(GRACE).await? {
                    // Reached while draining after SIGTERM: still a hit.
                    Some(status) if !status.success() => {
                        what.push_str(" +SIGTERM");
                        self.ended(&ledger, status, nth, applied, point)
                    }
                    Some(_) => PointResult::NotReached { applied },
                    None => PointResult::Failed(format!(
                        "did not stop within {GRACE:?} of SIGTERM; log {}",
                        ledger.log().display()
                    )),
                };
            }
        };
        self.line(&what, &result.to_string(), since);
        Ok(result)
    }

    /// Classifies the exit of a ledger armed with a crash point.
    fn ended(
        &mut self,
        ledger: &Ledger,
        status: std::process::ExitStatus,
        nth: u32,
        applied: u64,
        point: &str,
    ) -> PointResult {
        if died_of(status, Signal::SIGABRT) {
            self.report.aborts += 1;
            PointResult::Aborted { nth, applied }
        } else {
            PointResult::Failed(format!(
                "ended with {} instead of aborting at {point}; log {}:\n{}",
                describe(status),
                ledger.log().display(),
                tail(ledger.log(), 15)
            ))
        }
    }

    /// Kafka: a consuming member armed with `rebalance:<nth>` must abort while it gives up
    /// partitions to a second member that joins the group.
    async fn rebalance_run(&mut self, nth: u32) -> anyhow::Result<PointResult> {
        let since = Instant::now();
        let point = crash::REBALANCE;
        let before = self.db.finished().await;
        let mut victim = self.start("crash-rebalance", Some(&format!("{point}:{nth}")))?;
        let victim_run = self.launcher.started();
        // Let it take the partitions and consume a little first.
        let consuming = Instant::now();
        loop {
            tokio::time::sleep(POLL).await;
            let applied = self.db.finished().await.saturating_sub(before);
            if let Some(status) = victim.exited()? {
                let result = self.ended(&victim, status, nth, applied, point);
                self.line(
                    &format!("crash at {point}:{nth} (alone)"),
                    &result.to_string(),
                    since,
                );
                return Ok(result);
            }
            if applied >= 10 || self.all_finished().await || consuming.elapsed() > POINT_CAP {
                break;
            }
        }
        let mut joiner = self.start("rebalance-joiner", None)?;
        let joined = Instant::now();
        let result = loop {
            tokio::time::sleep(POLL).await;
            let applied = self.db.finished().await.saturating_sub(before);
            if let Some(status) = victim.exited()? {
                break self.ended(&victim, status, nth, applied, point);
            }
            if let Some(status) = joiner.exited()? {
                break PointResult::Failed(format!(
                    "the joining member ended with {}; log {}",
                    describe(status),
                    joiner.log().display()
                ));
            }
            if joined.elapsed() > REBALANCE_CAP {
                // Not during the join: stopping revokes too, but that is not the point here.
                victim.terminate(GRACE).await?;
                break PointResult::NotReached { applied };
            }
        };
        self.line_of(
            victim_run,
            &format!("crash at {point}:{nth} (2nd member)"),
            &result.to_string(),
            since,
        );
        // The joiner has just been handed every partition: kill it mid-stream too.
        let since = Instant::now();
        tokio::time::sleep(Duration::from_millis(self.rng.u64(500..2_500))).await;
        self.kill(&mut joiner, since, "SIGKILL the joiner").await?;
        Ok(result)
    }

    /// Kills `ledger` with SIGKILL; a ledger that had already exited is a failure.
    async fn kill(&mut self, ledger: &mut Ledger, since: Instant, what: &str) -> anyhow::Result<()> {
        if let Some(status) = ledger.exited()? {
            self.line(what, "FAILED (ended by itself)", since);
            anyhow::bail!(
                "{what}: the ledger had already ended with {}; log {}:\n{}",
                describe(status),
                ledger.log().display(),
                tail(ledger.log(), 15)
            );
        }
        let status = ledger.kill().await?;
        anyhow::ensure!(
            died_of(status, Signal::SIGKILL),
            "SIGKILL ended the ledger with {}",
            describe(status)
        );
        self.report.kills += 1;
        self.line(what, "killed", since);
        Ok(())
    }

    /// Starts a ledger and SIGKILLs it at a random moment once it consumes.
    async fn kill_run(&mut self) -> anyhow::Result<()> {
        let since = Instant::now();
        let before = self.db.finished().await;
        let mut ledger = self.start("sigkill", None)?;
        while ledger.age() < POINT_CAP {
            tokio::time::sleep(POLL).await;
            if ledger.exited()?.is_some() || self.db.finished().await > before || self.all_finished().await {
                break;
            }
        }
        let delay = Duration::from_millis(self.rng.u64(0..2_000));
        tokio::time::sleep(delay).await;
        let what = format!("SIGKILL after {} ms", delay.as_millis());
        self.kill(&mut ledger, since, &what).await
    }

    /// Runs a ledger until every event is finished and the broker is drained, then stops it
    /// with SIGTERM, which must end it with exit 0.
    async fn final_run(&mut self, deadline: Instant) -> anyhow::Result<()> {
        let since = Instant::now();
        let mut ledger = self.start("final", None)?;
        let mut drained_checks = 0;
        loop {
            tokio::time::sleep(POLL * 2).await;
            if let Some(status) = ledger.exited()? {
                anyhow::bail!(
                    "the final ledger ended by itself with {}; log {}:\n{}",
                    describe(status),
                    ledger.log().display(),
                    tail(ledger.log(), 15)
                );
            }
            let drained =
                self.all_finished().await && self.side.consumed(&self.db.pool).await.unwrap_or(false);
            drained_checks = if drained { drained_checks + 1 } else { 0 };
            if drained_checks >= 3 {
                break;
            }
            if Instant::now() > deadline {
                let finished = self.db.finished().await;
                self.report.failures.push(format!(
                    "not drained in time: {finished} of {} events finished (the unfinished ones are counted as lost below); log {}",
                    self.published,
                    ledger.log().display()
                ));
                break;
            }
        }
        let outcome = match ledger.terminate(GRACE).await? {
            Some(status) if status.success() => "drained, SIGTERM → exit 0".to_string(),
            Some(status) => {
                self.report.failures.push(format!(
                    "SIGTERM ended the final ledger with {}; log {}",
                    describe(status),
                    ledger.log().display()
                ));
                format!("FAILED: SIGTERM → {}", describe(status))
            }
            None => {
                self.report.failures.push(format!(
                    "the final ledger did not stop within {GRACE:?} of SIGTERM; log {}",
                    ledger.log().display()
                ));
                "FAILED: no exit after SIGTERM".into()
            }
        };
        self.line("final (until drained)", &outcome, since);
        Ok(())
    }

    /// Compares the database with what was published and asks the broker what is left.
    async fn check(&mut self, plan: &Plan) -> anyhow::Result<()> {
        let observed = reconcile::observe(&self.db.pool).await?;
        let verdict = Reconciliation::compare(&plan.expected, &observed);
        let report = &mut self.report;
        report.lost = verdict.lost.len() as u64;
        report.doubled = verdict.doubled_count();
        report.absorbed = plan.expected.duplicate_copies().saturating_sub(report.doubled);
        report.failures.extend(verdict.problems(5));
        println!(
            "   balances: sum {} (expected {}), {} ledger entries for {} unique events, {} dead-lettered",
            verdict.actual_total,
            verdict.expected_total,
            observed.entries.len(),
            verdict.unique,
            observed.dead_lettered.len()
        );
        let (unacked, details) = self.side.unacknowledged(&self.db.pool).await?;
        self.report.unacked = unacked;
        if unacked > 0 {
            self.report.failures.push(format!(
                "{unacked} messages left unacknowledged: {}",
                details.join("; ")
            ));
        }
        Ok(())
    }
}

fn print_summary(reports: &[Report]) {
    println!(
        "\n{:<6} {:<6} {:>5} {:>6} {:>7} {:>9} {:>20} {:>5} {:>8} {:>8} {:>8}  result",
        "source",
        "phase",
        "runs",
        "kills",
        "aborts",
        "messages",
        "duplicates absorbed",
        "lost",
        "doubled",
        "unacked",
        "time"
    );
    for r in reports {
        println!(
            "{:<6} {:<6} {:>5} {:>6} {:>7} {:>9} {:>20} {:>5} {:>8} {:>8} {:>7.0}s  {}",
            r.source,
            r.phase,
            r.runs,
            r.kills,
            r.aborts,
            r.messages,
            r.absorbed,
            r.lost,
            r.doubled,
            r.unacked,
            r.elapsed.as_secs_f64(),
            if r.failures.is_empty() { "ok" } else { "FAILED" }
        );
    }
    let matrix: Vec<&Report> = reports
        .iter()
        .filter(|r| r.phase == Phase::Matrix.name())
        .collect();
    if !matrix.is_empty() {
        println!(
            "\n{:<14} {}",
            "crash point",
            matrix
                .iter()
                .map(|r| format!("{:<36}", r.source))
                .collect::<String>()
        );
        for point in crash::POINTS {
            let cells: String = matrix
                .iter()
                .map(|r| {
                    format!(
                        "{:<36}",
                        r.points.get(point).map(|p| p.to_string()).unwrap_or_default()
                    )
                })
                .collect();
            println!("{point:<14} {cells}");
        }
    }
    for r in reports.iter().filter(|r| !r.figures.is_empty()) {
        println!("\n{} {}:", r.source, r.phase);
        for line in &r.figures {
            println!("  {line}");
        }
    }
    println!("(duplicates absorbed: published copies beyond the first that left no second entry; the redeliveries caused by the kills are absorbed too but not counted)");
}
