//! The database outage: PostgreSQL crashes (`pg_ctl stop -m immediate`) and comes back while
//! ledgers consume from Kafka and RabbitMQ at once, and the producers keep writing.
//!
//! The system's PostgreSQL is never touched: the outage runs on a private cluster (initdb in a
//! temporary directory, a free port on 127.0.0.1, the server programs of `--pg-bin` /
//! `TXINBOX_PG_BIN`, run as the `postgres` user when the harness runs as root). Each broker
//! gets its own database there. The sequence:
//!
//! 1. publish half the events, start one ledger for RabbitMQ and two in one group for Kafka,
//!    and wait until every partition has been processed;
//! 2. crash PostgreSQL; publish the other half; SIGKILL the second Kafka member, whose
//!    partitions are then handed over to the first while the database is down; keep it down
//!    `--outage-seconds`, and until that handover has begun (plus a few seconds), asking the
//!    Kafka group for its committed offsets every 250 ms; the ledgers must stay up meanwhile
//!    (fail closed: intake pauses, the assignment waits, nothing is acknowledged);
//! 3. still down: SIGKILL the RabbitMQ ledger (a crash during the outage), so that everything it
//!    held unacknowledged goes back to the queue, and count the messages in its queues;
//! 4. start PostgreSQL on its Unix socket only (the ledgers, on TCP, cannot get in) and read
//!    what the outage froze: the Kafka database positions and the events RabbitMQ's database
//!    finished; then restart it on TCP;
//! 5. check **nothing acknowledged during the outage**: on every partition, no group offset
//!    seen during the outage is past the database position, except over records the database
//!    has applied or dead-lettered (dead letters do not move the position: issue 15, defect
//!    4); and every RabbitMQ event the database has not finished still has a copy in the
//!    queues (a message is only acked after its commit). Both fail when a ledger
//!    acknowledges before its commit (`--sabotage`, see `txinbox_demos::sabotage`);
//! 6. start a new RabbitMQ ledger; both drain; SIGTERM (exit 0); then the crash matrix's
//!    check: nothing lost, nothing doubled, nothing left unacknowledged.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use txinbox::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use txinbox::sqlx::{self, PgPool};

use crate::args::{Args, Phase};
use crate::brokers;
use crate::events::{Outgoing, Plan};
use crate::process::{describe, tail, Ledger};
use crate::report::Report;
use crate::run::{finish, prepare, Chaos, Setup, GRACE, POLL};
use crate::side::Side;

/// How often the group's committed offsets are sampled while the database is down.
const SAMPLE: Duration = Duration::from_millis(250);
/// How long the ledgers may take to apply their first events.
const START_CAP: Duration = Duration::from_secs(60);
/// How much longer than `--outage-seconds` the database may stay down for the group to start
/// the rebalance after the killed member (tansu takes up to about 13 s, whatever the session
/// timeout).
const HANDOVER_CAP: Duration = Duration::from_secs(25);
/// How long the database stays down once the handover began.
const HANDOVER_DOWN: Duration = Duration::from_secs(6);
/// How long the ledgers may take to drain once the database is back.
const DRAIN_CAP: Duration = Duration::from_secs(90);
/// The same for a sabotaged run, which loses events and so never drains: long enough to show
/// that the loss is not a delay.
const SABOTAGED_DRAIN_CAP: Duration = Duration::from_secs(10);

/// Runs the outage under one ledger per broker in `sources`.
pub async fn run(
    args: &Args,
    ledger: &Path,
    seed: u64,
    sources: &[&'static str],
) -> anyhow::Result<Vec<Report>> {
    let cluster = Cluster::create(args.pg_bin.as_deref(), seed).await?;
    println!(
        "\n== outage: private PostgreSQL cluster on 127.0.0.1:{} ({})",
        cluster.port,
        cluster.dir.display()
    );
    let url = cluster.url();
    let mut runs = Vec::new();
    for (i, &source) in sources.iter().enumerate() {
        let setup = Setup {
            source,
            phase: Phase::Outage,
            ledger,
            seed: seed.wrapping_add(i as u64),
            partitions: brokers::PARTITIONS,
            database_url: &url,
            events: args.outage_events,
        };
        let (mut chaos, plan) = prepare(args, setup).await?;
        // The outage's sabotage is an early ack, not a new consumer name.
        chaos.sabotage = false;
        if args.sabotage {
            chaos
                .launcher
                .env(txinbox_demos::sabotage::ENV, "ack-before-commit");
        }
        let messages = plan.first_wave.iter().chain(&plan.second_wave).cloned().collect();
        runs.push(Run {
            chaos,
            plan,
            messages,
            ledger: None,
            second: None,
            handover: None,
            revoked_before: 0,
            handover_lead: None,
            first_log: None,
            finished_before: 0,
            frozen: Frozen::default(),
            survived: true,
            verdict: String::new(),
        });
    }
    let mut outage = Outage {
        cluster,
        seconds: args.outage_seconds,
        down_for: Duration::ZERO,
        drain_cap: if args.sabotage {
            SABOTAGED_DRAIN_CAP
        } else {
            DRAIN_CAP
        },
    };
    let result = outage.run(&mut runs).await;
    if let Err(e) = &result {
        for run in &mut runs {
            run.chaos.report.failures.push(format!("{e:#}"));
        }
    }
    let mut reports = Vec::new();
    for mut run in runs {
        for mut ledger in [run.ledger.take(), run.second.take()].into_iter().flatten() {
            let _ = ledger.kill().await;
        }
        if result.is_ok() {
            if let Err(e) = run.chaos.check(&run.plan).await {
                run.chaos.report.failures.push(format!("checking failed: {e:#}"));
            }
        }
        let r = &run.chaos.report;
        let figures = format!(
            "{} events ({} messages); PostgreSQL crashed after {} were finished and was down {:.1} s; {}; the ledger {}; lost {}, doubled {}, unacked {}",
            run.plan.expected.events.len() + run.plan.expected.malformed.len(),
            run.plan.expected.messages,
            run.finished_before,
            outage.down_for.as_secs_f64(),
            run.verdict,
            match (&run.chaos.side, run.survived) {
                (_, false) => "did NOT stay up through the outage".to_string(),
                (Side::Kafka(_), true) => {
                    let waits = count_in(run.first_log.as_deref(), "assignment waits");
                    format!(
                        "stayed up through the outage and resumed; {}",
                        match run.handover_lead {
                            Some(lead) => format!("the 2nd member was SIGKILLed as the database went down and the first took over its partitions while it was down (the rebalance began {:.1} s before the database came back; {waits} 'assignment waits' warnings: fail closed)", lead.as_secs_f64()),
                            None => "the 2nd member was SIGKILLed but the group did not rebalance during the outage".to_string(),
                        }
                    )
                }
                (Side::Amqp(_), true) => {
                    "stayed up until SIGKILLed at the end of the outage; a new one drained".to_string()
                }
            },
            r.lost,
            r.doubled,
            r.unacked,
        );
        println!("   outage {}: {figures}", run.chaos.source);
        run.chaos.report.figures.push(figures);
        reports.push(finish(run.chaos, args).await);
    }
    let clean = reports.iter().all(|r| r.failures.is_empty());
    outage
        .cluster
        .remove((clean || args.sabotage) && !args.keep)
        .await;
    Ok(reports)
}

/// One broker's part of the outage.
struct Run {
    chaos: Chaos,
    plan: Plan,
    messages: Vec<Outgoing>,
    ledger: Option<Ledger>,
    /// Kafka: a second member of the group, SIGKILLed as the outage begins so that its
    /// partitions move to the first one while the database is down.
    second: Option<Ledger>,
    /// Kafka: when the first member gave up its partitions for that rebalance (during the
    /// outage).
    handover: Option<Instant>,
    /// Kafka: revocations in the first member's log before the kill.
    revoked_before: usize,
    /// Kafka: how long before the database came back the handover began.
    handover_lead: Option<Duration>,
    /// The log of the ledger started before the outage.
    first_log: Option<PathBuf>,
    /// Events finished when PostgreSQL went down.
    finished_before: u64,
    frozen: Frozen,
    /// Whether the ledger stayed up while the database was down.
    survived: bool,
    /// What the outage check found, for the figures.
    verdict: String,
}

/// What the database and the broker held at the end of the outage.
#[derive(Default)]
struct Frozen {
    /// Kafka: the highest committed offset the group showed during the outage, per partition.
    committed: BTreeMap<i32, i64>,
    /// Kafka: the database positions, per partition.
    positions: BTreeMap<i32, i64>,
    /// RabbitMQ: messages ready in the work and retry queues with no consumer attached.
    queued: u64,
    /// Distinct events finished (applied or dead-lettered).
    finished: u64,
    /// Kafka: the IDs of the events finished.
    finished_ids: BTreeSet<String>,
}

struct Outage {
    cluster: Cluster,
    seconds: u64,
    down_for: Duration,
    drain_cap: Duration,
}

impl Outage {
    async fn run(&mut self, runs: &mut [Run]) -> anyhow::Result<()> {
        // 1. Half the events, one ledger per broker, until both apply.
        for run in runs.iter_mut() {
            let half = run.messages.len() / 2;
            let first: Vec<Outgoing> = run.messages[..half].to_vec();
            run.chaos.publish(&first).await?;
            let first = run.chaos.start("before-outage", None)?;
            run.first_log = Some(first.log().to_path_buf());
            run.ledger = Some(first);
            if matches!(run.chaos.side, Side::Kafka(_)) {
                run.second = Some(run.chaos.start("before-outage-2nd-member", None)?);
            }
        }
        let since = Instant::now();
        loop {
            tokio::time::sleep(POLL).await;
            let mut ready = true;
            for run in runs.iter_mut() {
                ensure_running(run, "before the outage")?;
                let finished = run.chaos.db.finished().await;
                // Enough to be well under way, and never everything: half the events are yet
                // to come.
                ready &= finished >= (run.chaos.published / 10).max(10);
                // Kafka: every partition processed, so both members hold some (or the second
                // has yet to get its share, which it then does before the outage).
                if let Side::Kafka(kafka) = &run.chaos.side {
                    let positions = kafka
                        .database_positions(&run.chaos.db.pool)
                        .await
                        .unwrap_or_default();
                    ready &= positions.len() == brokers::PARTITIONS as usize;
                }
            }
            if ready {
                break;
            }
            if since.elapsed() > START_CAP {
                bail!(
                    "the ledgers applied too little within {START_CAP:?} of starting; logs under {}",
                    runs[0].chaos.launcher.logs().display()
                );
            }
        }
        for run in runs.iter_mut() {
            run.finished_before = run.chaos.db.finished().await;
        }

        // 2. The crash, and the second half published while the database is down.
        let down = Instant::now();
        self.cluster.crash().await?;
        let what = format!(
            "PostgreSQL crashed (pg_ctl stop -m immediate) for {} s",
            self.seconds
        );
        for run in runs.iter_mut() {
            run.chaos
                .line(&what, &format!("{} finished before", run.finished_before), down);
            let half = run.messages.len() / 2;
            let second: Vec<Outgoing> = run.messages[half..].to_vec();
            run.chaos.publish(&second).await?;
            // Kafka: the 2nd member dies as the database goes down; its partitions are handed
            // over to the first while the database is down.
            if let Some(mut member) = run.second.take() {
                run.revoked_before = count_in(run.first_log.as_deref(), "partitions revoked");
                let since = Instant::now();
                run.chaos
                    .kill(&mut member, since, "SIGKILL the 2nd member")
                    .await?;
            }
        }
        // At least `--outage-seconds`, and until the first Kafka member has been taking its new
        // assignment for a few seconds (the broker may take a while to notice the dead one).
        let outage = Duration::from_secs(self.seconds);
        let handing_over = |runs: &[Run]| {
            runs.iter().any(|r| {
                matches!(r.chaos.side, Side::Kafka(_))
                    && r.handover.is_none_or(|t| t.elapsed() < HANDOVER_DOWN)
            })
        };
        while down.elapsed() < outage || (handing_over(runs) && down.elapsed() < outage + HANDOVER_CAP) {
            for run in runs.iter_mut() {
                if run.handover.is_none()
                    && count_in(run.first_log.as_deref(), "partitions revoked") > run.revoked_before
                {
                    run.handover = Some(Instant::now());
                }
            }
            for run in runs.iter_mut() {
                if let Side::Kafka(kafka) = &run.chaos.side {
                    for (p, offset) in kafka.committed_offsets().await?.into_iter().enumerate() {
                        if let Some(o) = offset {
                            let seen = run.frozen.committed.entry(p as i32).or_insert(o);
                            *seen = (*seen).max(o);
                        }
                    }
                }
                if let Some(ledger) = &mut run.ledger {
                    if let Some(status) = ledger.exited()? {
                        run.survived = false;
                        run.chaos.report.failures.push(format!(
                            "the ledger ended with {} while the database was down (intake should pause instead); log {}:\n{}",
                            describe(status),
                            ledger.log().display(),
                            tail(ledger.log(), 15)
                        ));
                        run.ledger = None;
                    }
                }
            }
            tokio::time::sleep(SAMPLE).await;
        }

        // 3. Still down: crash the RabbitMQ ledger, and count what its queues hold.
        for run in runs.iter_mut() {
            if !matches!(run.chaos.side, Side::Amqp(_)) {
                continue;
            }
            if let Some(mut ledger) = run.ledger.take() {
                let since = Instant::now();
                run.chaos
                    .kill(&mut ledger, since, "SIGKILL during the outage")
                    .await?;
            }
            if let Side::Amqp(amqp) = &run.chaos.side {
                run.frozen.queued = amqp.ready_when_detached().await?;
            }
        }

        // 4. What the outage froze, read over the Unix socket while TCP stays closed.
        self.cluster.start(false).await?;
        for run in runs.iter_mut() {
            let pool = self.cluster.socket_pool(&run.chaos.db.name).await?;
            run.frozen.finished = finished(&pool).await?;
            if let Side::Kafka(kafka) = &run.chaos.side {
                run.frozen.positions = kafka.database_positions(&pool).await?;
                run.frozen.finished_ids = sqlx::query_scalar(
                    "SELECT event_id FROM ledger_entries UNION SELECT message_id FROM txinbox.dead_letters",
                )
                .fetch_all(&pool)
                .await?
                .into_iter()
                .collect();
                // A last look at the group: the ledger cannot have committed anything since.
                for (p, offset) in kafka.committed_offsets().await?.into_iter().enumerate() {
                    if let Some(o) = offset {
                        let seen = run.frozen.committed.entry(p as i32).or_insert(o);
                        *seen = (*seen).max(o);
                    }
                }
            }
            pool.close().await;
        }
        self.cluster.stop().await?;
        self.cluster.start(true).await?;
        self.down_for = down.elapsed();
        for run in runs.iter_mut() {
            run.handover_lead = run.handover.map(|t| t.elapsed());
            run.chaos.line(
                "PostgreSQL back",
                &format!("down {:.1} s", self.down_for.as_secs_f64()),
                down,
            );
        }

        // 5. Nothing acknowledged during the outage.
        for run in runs.iter_mut() {
            let problems = match &run.chaos.side {
                Side::Kafka(kafka) => {
                    // A group offset may pass the database position only over records the
                    // database has settled without moving the position (dead letters do not
                    // move it: issue 15, defect 4): every record below the offset must be
                    // applied or dead-lettered in the database.
                    let mut problems = Vec::new();
                    let mut settled_past = 0;
                    for (p, committed) in &run.frozen.committed {
                        let position = run.frozen.positions.get(p).copied().unwrap_or(0);
                        let unsettled: Vec<String> = (position..*committed)
                            .filter_map(|o| {
                                let id = kafka.id_at(*p, o).unwrap_or_else(|| format!("offset {o}"));
                                (!run.frozen.finished_ids.contains(&id)).then(|| format!("{o} ({id})"))
                            })
                            .collect();
                        settled_past += (committed - position).max(0) as usize - unsettled.len();
                        if !unsettled.is_empty() {
                            problems.push(format!(
                                "partition {p}: the group's offset reached {committed} during the outage, past the database position {position}, over {} records neither applied nor dead-lettered: {}",
                                unsettled.len(),
                                unsettled.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
                            ));
                        }
                    }
                    run.verdict = format!(
                        "group offsets seen during the outage {:?} {} database positions {:?}{}",
                        run.frozen.committed,
                        if problems.is_empty() { "≤" } else { "PAST the" },
                        run.frozen.positions,
                        if settled_past > 0 {
                            format!(" (past them only over {settled_past} records whose IDs the database had applied or dead-lettered: dead letters do not move the position, issue 15 defect 4)")
                        } else {
                            String::new()
                        }
                    );
                    problems
                }
                Side::Amqp(_) => {
                    let unfinished = run.chaos.published.saturating_sub(run.frozen.finished);
                    run.verdict = format!(
                        "{} messages still queued for {unfinished} unfinished events (published {}, finished {})",
                        run.frozen.queued, run.chaos.published, run.frozen.finished
                    );
                    if run.frozen.queued < unfinished {
                        vec![format!(
                            "at the end of the outage the queues held {} messages for {unfinished} events the database had not finished: at least {} acknowledged without a commit",
                            run.frozen.queued,
                            unfinished - run.frozen.queued
                        )]
                    } else {
                        Vec::new()
                    }
                }
            };
            if !problems.is_empty() {
                run.verdict.insert_str(0, "ACKNOWLEDGED DURING THE OUTAGE: ");
            }
            run.chaos.report.failures.extend(
                problems
                    .into_iter()
                    .map(|p| format!("acknowledged during the outage: {p}")),
            );
        }

        // 6. Every broker's ledger up again, until drained, then a graceful stop.
        for run in runs.iter_mut() {
            if run.ledger.is_none() {
                run.ledger = Some(run.chaos.start("after-outage", None)?);
            }
        }
        let since = Instant::now();
        // Per run: consecutive checks that found it drained.
        let mut drained = vec![0; runs.len()];
        while drained.iter().any(|&n| n < 3) {
            tokio::time::sleep(POLL * 2).await;
            for (run, checks) in runs.iter_mut().zip(&mut drained) {
                ensure_running(run, "after the outage")?;
                let done = run.chaos.all_finished().await
                    && run.chaos.side.consumed(&run.chaos.db.pool).await.unwrap_or(false);
                *checks = if done { *checks + 1 } else { 0 };
            }
            if since.elapsed() > self.drain_cap {
                for (run, _) in runs.iter_mut().zip(&drained).filter(|(_, &n)| n < 3) {
                    let finished = run.chaos.db.finished().await;
                    run.chaos.report.failures.push(format!(
                        "not drained within {:?} of the database's return: {finished} of {} events finished; logs {}",
                        self.drain_cap,
                        run.chaos.published,
                        run.chaos.launcher.logs().display()
                    ));
                }
                break;
            }
        }
        for run in runs.iter_mut() {
            let Some(mut ledger) = run.ledger.take() else {
                continue;
            };
            let outcome = match ledger.terminate(GRACE).await? {
                Some(s) if s.success() => "drained, SIGTERM → exit 0".to_string(),
                other => {
                    let what = other.map_or("no exit".to_string(), describe);
                    run.chaos.report.failures.push(format!(
                        "SIGTERM ended the ledger with {what}; log {}",
                        ledger.log().display()
                    ));
                    format!("FAILED: SIGTERM → {what}")
                }
            };
            run.chaos.line("after the outage, until drained", &outcome, since);
        }
        Ok(())
    }
}

/// Occurrences of `what` in the log at `path`.
fn count_in(path: Option<&Path>, what: &str) -> usize {
    path.and_then(|p| std::fs::read_to_string(p).ok())
        .map_or(0, |text| text.matches(what).count())
}

/// Fails when the run's ledger has exited.
fn ensure_running(run: &mut Run, when: &str) -> anyhow::Result<()> {
    for ledger in [&mut run.ledger, &mut run.second].into_iter().flatten() {
        if let Some(status) = ledger.exited()? {
            bail!(
                "the {} ledger ended {when} with {}; log {}:\n{}",
                run.chaos.source,
                describe(status),
                ledger.log().display(),
                tail(ledger.log(), 15)
            );
        }
    }
    Ok(())
}

/// Distinct events finished (applied or dead-lettered), as `Database::finished` counts them.
async fn finished(pool: &PgPool) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(DISTINCT event_id) FROM ledger_entries)
              + (SELECT count(DISTINCT message_id) FROM txinbox.dead_letters)",
    )
    .fetch_one(pool)
    .await?;
    Ok(n as u64)
}

/// A private PostgreSQL cluster in a temporary directory, which the outage may crash.
struct Cluster {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    /// Running as root: the server programs run as `postgres` (PostgreSQL refuses root).
    as_postgres: bool,
    /// Stopped for good by `remove`.
    removed: bool,
}

impl Cluster {
    /// initdb, then start on a free port.
    async fn create(bin: Option<&Path>, seed: u64) -> anyhow::Result<Cluster> {
        let bin = match bin {
            Some(b) => b.to_path_buf(),
            None => newest_server_bin()?,
        };
        ensure!(
            bin.join("initdb").is_file() && bin.join("pg_ctl").is_file(),
            "no initdb and pg_ctl in {} (--pg-bin / TXINBOX_PG_BIN; scripts/lib/services.sh ensure_postgres installs them)",
            bin.display()
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = std::env::temp_dir().join(format!("txinbox-chaos-pg-{port}-{:04x}", seed & 0xffff));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let as_postgres = nix::unistd::geteuid().is_root();
        let cluster = Cluster {
            bin,
            dir,
            port,
            as_postgres,
            removed: false,
        };
        if as_postgres {
            let status = tokio::process::Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&cluster.dir)
                .status()
                .await?;
            ensure!(
                status.success(),
                "chown postgres {} failed",
                cluster.dir.display()
            );
        }
        let data = cluster.data();
        cluster
            .tool(
                "initdb",
                &["-D", &data, "-A", "trust", "-U", "postgres", "--no-sync"],
            )
            .await?;
        cluster.start(true).await?;
        Ok(cluster)
    }

    fn data(&self) -> String {
        self.dir.join("data").display().to_string()
    }

    /// The admin URL over TCP.
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A pool over the Unix socket to `database`.
    async fn socket_pool(&self, database: &str) -> anyhow::Result<PgPool> {
        let options = PgConnectOptions::new()
            .socket(&self.dir)
            .port(self.port)
            .username("postgres")
            .database(database);
        Ok(PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await?)
    }

    async fn tool(&self, tool: &str, args: &[&str]) -> anyhow::Result<()> {
        let path = self.bin.join(tool);
        let mut command = if self.as_postgres {
            let mut c = tokio::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&path);
            c
        } else {
            tokio::process::Command::new(&path)
        };
        let out = command
            .args(args)
            .output()
            .await
            .with_context(|| format!("running {}", path.display()))?;
        ensure!(
            out.status.success(),
            "{tool} {} failed: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Starts the server and waits until it accepts connections; on its Unix socket (in the
    /// cluster's directory) only, unless `tcp`.
    async fn start(&self, tcp: bool) -> anyhow::Result<()> {
        let listen = if tcp { "127.0.0.1" } else { "''" };
        let options = format!(
            "-p {} -k {} -c listen_addresses={listen} -c fsync=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log").display().to_string();
        let data = self.data();
        self.tool(
            "pg_ctl",
            &["-D", &data, "-o", &options, "-l", &log, "-w", "start"],
        )
        .await
    }

    /// Stops the server the hard way, as a crash would: no checkpoint, clients cut off.
    async fn crash(&self) -> anyhow::Result<()> {
        let data = self.data();
        self.tool("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
            .await
    }

    /// Stops the server cleanly.
    async fn stop(&self) -> anyhow::Result<()> {
        let data = self.data();
        self.tool("pg_ctl", &["-D", &data, "-m", "fast", "-w", "stop"])
            .await
    }

    /// Stops the server; deletes its directory if `delete`, else says where it is.
    async fn remove(mut self, delete: bool) {
        let _ = self.stop().await;
        self.removed = true;
        if delete {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            println!(
                "   (kept the outage's PostgreSQL cluster, stopped: {}/data, port {}; start it with pg_ctl -D … -o '-p {} -k …' start)",
                self.dir.display(),
                self.port,
                self.port
            );
        }
    }
}

impl Drop for Cluster {
    /// An interrupted or failed outage still stops its server (synchronously: there may be no
    /// runtime left to await on).
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        let pg_ctl = self.bin.join("pg_ctl");
        let data = self.data();
        let mut command = if self.as_postgres {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&pg_ctl);
            c
        } else {
            std::process::Command::new(&pg_ctl)
        };
        let _ = command
            .args(["-D", &data, "-m", "immediate", "-w", "stop"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        println!(
            "   (stopped the outage's PostgreSQL cluster; its files are in {})",
            self.dir.display()
        );
    }
}

/// The newest `/usr/lib/postgresql/<version>/bin` with an initdb.
fn newest_server_bin() -> anyhow::Result<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context("no /usr/lib/postgresql: install PostgreSQL's server (scripts/lib/services.sh ensure_postgres does) or pass --pg-bin")?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .context("no /usr/lib/postgresql/*/bin/initdb: install PostgreSQL's server or pass --pg-bin")
}
