//! One run, whatever the phase: its setup (a fresh topic or queue, database and log directory,
//! and the events to publish), the ledgers it starts and kills, the check against the database
//! and the broker, and its end.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::Signal;
use txinbox_demos::reconcile::{self, Reconciliation};

use crate::args::{Args, Phase};
use crate::brokers::{Amqp, Kafka};
use crate::database::Database;
use crate::events::{self, Outgoing, Plan};
use crate::process::{describe, died_of, tail, Launcher, Ledger};
use crate::report::Report;
use crate::side::Side;

/// How often the harness looks at the database and the children.
pub(crate) const POLL: Duration = Duration::from_millis(100);
/// How long a stopping ledger may take to exit after SIGTERM.
pub(crate) const GRACE: Duration = Duration::from_secs(30);

/// What one run is made of.
pub(crate) struct Setup<'a> {
    pub(crate) source: &'static str,
    pub(crate) phase: Phase,
    pub(crate) ledger: &'a Path,
    pub(crate) seed: u64,
    /// Kafka: partitions of the topic.
    pub(crate) partitions: i32,
    /// A role that may create databases.
    pub(crate) database_url: &'a str,
    /// Unique payment events in the plan.
    pub(crate) events: u32,
}

/// A fresh topic or queue, database and log directory, and the events to publish.
pub(crate) async fn prepare(args: &Args, setup: Setup<'_>) -> anyhow::Result<(Chaos, Plan)> {
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
        "kafka" => Side::Kafka(
            Kafka::create(
                &args.kafka.brokers,
                &tag,
                partitions,
                args.kafka_session_timeout_ms,
            )
            .await?,
        ),
        _ => Side::Amqp(Box::new(Amqp::create(&args.amqp, &tag).await?)),
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
    if matches!(side, Side::Kafka(_)) {
        println!(
            "   Kafka orderings, one ledger after another: {}",
            args.kafka_ordering
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        launcher.rotate(
            args.kafka_ordering
                .iter()
                .map(|o| format!("--kafka-ordering={o}"))
                .collect(),
        );
    }
    launcher.env("DATABASE_URL", &db.url);
    launcher.env("AMQP_URL", &args.amqp.amqp_url);
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
pub(crate) async fn finish(chaos: Chaos, args: &Args) -> Report {
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

pub(crate) struct Chaos {
    pub(crate) source: &'static str,
    pub(crate) side: Side,
    pub(crate) db: Database,
    pub(crate) launcher: Launcher,
    pub(crate) rng: fastrand::Rng,
    /// Distinct event IDs published so far (valid and malformed).
    pub(crate) published: u64,
    pub(crate) sabotage: bool,
    pub(crate) report: Report,
    pub(crate) started: Instant,
}

impl Chaos {
    pub(crate) fn consumer_name(&self) -> String {
        if self.sabotage {
            format!("ledger-run-{}", self.launcher.started() + 1)
        } else {
            "ledger".into()
        }
    }

    pub(crate) fn start(&mut self, label: &str, crash_at: Option<&str>) -> anyhow::Result<Ledger> {
        let name = self.consumer_name();
        self.launcher.start(label, crash_at, &name)
    }

    /// Prints one line about the run just finished.
    pub(crate) fn line(&self, what: &str, outcome: &str, since: Instant) {
        self.line_of(self.launcher.started(), what, outcome, since);
    }

    /// Prints one line about run number `run`.
    pub(crate) fn line_of(&self, run: u32, what: &str, outcome: &str, since: Instant) {
        println!(
            "   {:<5} run {run:>2} {:<26} → {outcome} [{:.1} s, at {:.0} s]",
            self.source,
            what,
            since.elapsed().as_secs_f64(),
            self.started.elapsed().as_secs_f64()
        );
    }

    pub(crate) async fn publish(&mut self, wave: &[Outgoing]) -> anyhow::Result<()> {
        self.side.publish(wave).await?;
        self.published += wave.iter().filter(|m| m.copy == 0).count() as u64;
        Ok(())
    }

    /// Whether every published event is finished.
    pub(crate) async fn all_finished(&self) -> bool {
        self.db.finished().await >= self.published
    }

    /// Kills `ledger` with SIGKILL; a ledger that had already exited is a failure.
    pub(crate) async fn kill(
        &mut self,
        ledger: &mut Ledger,
        since: Instant,
        what: &str,
    ) -> anyhow::Result<()> {
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

    /// Compares the database with what was published and asks the broker what is left.
    pub(crate) async fn check(&mut self, plan: &Plan) -> anyhow::Result<()> {
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
