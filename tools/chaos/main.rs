//! The crash matrix (`scripts/chaos` builds the ledger and this harness, then runs it): runs the `ledger` example against Kafka and RabbitMQ while killing it, and
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

mod args;
mod brokers;
mod database;
mod events;
mod matrix;
mod outage;
mod process;
mod report;
mod run;
mod side;
mod storm;

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use txinbox::crash;

use args::{Args, Phase, Which};
use matrix::run_source;
use report::{print_summary, Report};

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
